"""The configuration of one fine-tuning run, and the command-line flag of each of its fields.

For: `TrainConfig` (frozen; None fields are resolved by `sonar_fx.trainer.validate`), `ConfigError`
(which carries the flag it blames) and `FLAGS`, the one map from a config field to its flag that
validation, checkpoint identity checks and the command line share. Never: validate, build or train.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from sonar_fx.config import ExpertClip, KeepBudget, StateBits
from sonar_fx.methods import Execution
from sonar_fx.optim.optimizer import NonFinite

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

FLAGS: dict[str, str] = {
    "model_overrides": "--model-override",
    "checkpoint": "--no-checkpoint",
    "progress": "--no-progress",
    # fields of the objects a TrainConfig holds, by the name their own errors carry
    "compiler": "--compiler",
    "sonar_pass": "--hooks-on-compiled",
    "data": "--data",
    "world_size": "torchrun --nproc-per-node",
    # MuonConfig's AdamW half takes the Adam(W) flags
    "adamw_betas": "--betas",
    "adamw_eps": "--eps",
}
"""Config field -> flag, where the flag is not `--` + the field with dashes."""


def flag_of(field_name: str) -> str:
    """The command-line flag that sets config field `field_name` (also AdamWConfig/Execution fields)."""
    return FLAGS.get(field_name, "--" + field_name.replace("_", "-"))


class ConfigError(ValueError):
    """A flag or config value is invalid; the message names the flag and the fix; `flag` is the flag."""

    def __init__(self, message: str, *, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One fine-tuning run; None fields are resolved by `plan_run` (see each field)."""

    model: str = "tiny-olmoe"
    """A built-in tiny model (`sonar_fx.models.TINY_MODELS`) or a local checkpoint directory."""
    model_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Config fields of a built-in tiny model to override (e.g. num_experts); unknown keys are refused."""
    data: str | None = None
    """Alpaca .json / .jsonl file; None: the built-in synthetic instruction set."""
    tokenizer: str | None = None
    """"byte" or a local tokenizer directory; None: "byte" for tiny models, the model directory otherwise."""
    method: str = "sonar"
    """One of `sonar_fx.methods.METHODS`."""
    execution: Execution = field(default_factory=lambda: Execution(compiler="inductor"))
    """Eager, or compiled (inductor / aot_eager) with or without Sonar's graph pass."""
    steps: int | None = None
    """Optimizer steps; None: one pass over the training split."""
    batch_size: int = 2
    grad_accum: int = 1
    """Micro-batches (each `batch_size` examples) per optimizer step, their gradients accumulated and
    the loss of each divided by their number, for every method alike. > 1 trains sonar with the
    deferred schedule (exact accumulation; chosen automatically)."""
    clip_scope: Literal["all", "dense"] | None = None
    """Which gradients the one global norm clips: "all" (every parameter; sonar: exact through the
    deferred schedule, chosen automatically; standard), "dense" (the dense ones only; sonar's
    in-backward default, standard_no_expert_clip); None: what the method and --expert-clip say."""
    max_len: int = 256
    """Tokens per example (longer examples are truncated)."""
    lr: float | None = None
    """Peak LR; None: 2e-5 (the paper's) for a checkpoint, 3e-3 for a tiny model trained from scratch."""
    warmup: int | None = None
    """Linear warm-up steps; None: 3% of the steps."""
    min_lr: float = 0.0
    """The cosine decay ends at this LR on the last step."""
    optimizer: str = "adamw"
    """One of `sonar_fx.config.OPTIMIZER_CONFIGS`: adamw, adam (L2 decay), sgd, lion, muon."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam(W) moments (Muon: of its AdamW tensors); Lion's interpolation (beta1) and momentum (beta2)
    decays."""
    eps: float = 1e-8
    """Adam(W)'s denominator term (Muon: of its AdamW tensors)."""
    weight_decay: float | None = None
    """Decoupled weight decay (Adam: L2); None: 0.1 for Muon (torch.optim.Muon's and `MuonConfig`'s
    default), 0.0 for the others (the paper's)."""
    momentum: float | None = None
    """SGD (None: 0.0) and Muon (None: 0.95)."""
    dampening: float = 0.0
    """SGD only."""
    nesterov: bool | None = None
    """SGD (None: False) and Muon (None: True)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    """Muon only: how a matrix's shape scales its LR (None: "original")."""
    max_grad_norm: float | None = 1.0
    """Global-norm clip (which gradients it covers is the method's); None: no clipping."""
    expert_clip: ExpertClip = None
    """How expert gradients are clipped (`sonar_fx.config`): None (sonar: not at all), "per_tensor", or
    "global" (two backward passes; the twin of the standard method)."""
    keep_budget: KeepBudget = 0
    """The deferred schedule under the clip over all: bytes of expert gradients its norm pass keeps for
    the update pass instead of computing them again ("auto": CUDA's free memory less a margin; 0: none;
    `sonar_fx.optim.keep_budget`). Exact at every budget, so not part of a checkpoint's identity."""
    state_bits: StateBits = 32
    """Adam(W) only: bits of the expert tensors' moments (8, 4: torchao's low-bit states)."""
    dense_state_bits: StateBits = 32
    """Adam(W) only: bits of the dense tensors' moments (8, 4: torchao's low-bit states, updated at
    `step()`); with `state_bits=8`, every state in 8 bits."""
    nonfinite: NonFinite = "raise"
    """Sonar methods: an inf/NaN gradient stops the run ("raise", nothing of that step applied), skips
    the step and goes on ("skip", counted in the summary's sonar report) or is trained on ("ignore")."""
    seed: int = 42
    """Model init, split shuffle and batch order; in torch.manual_seed's range [-2**63, 2**64)."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0: only before the first and after the last step)."""
    held_out: int | None = None
    """Held-out examples; None: 500 (the paper's), 0: no evaluation."""
    train_size: int | None = None
    """Training examples; None: 8000 for the built-in set, every record not held out for a file."""
    dtype: Literal["bf16", "fp32"] | None = None
    """Weights, gradients and optimizer states; None: bf16 on CUDA, fp32 on CPU (CPU bf16 GEMMs are slow)."""
    device: str | None = None
    """"cpu", "cuda" or "cuda:N"; None: "cuda" when available, else "cpu"."""
    out: str = "runs/finetune"
    """Folder for metrics.jsonl, summary.json and checkpoint.pt; a fresh run refuses one holding a run."""
    overwrite: bool = False
    """A fresh run may replace the run already in `out` (its checkpoint, metrics and summary)."""
    resume: str | None = None
    """A checkpoint file or run folder to continue from (bitwise, when every setting matches); "auto":
    the checkpoint in `out`."""
    save_every: int | None = None
    """Checkpoint every N steps; None: every 10% of the steps; 0: only at the end. A run stopped by
    SIGTERM/SIGINT also saves at the step boundary it stops at."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps, as a preempted job would; the LR schedule still
    spans `steps`."""
    checkpoint: bool = True
    """Write checkpoint.pt at all (the demo does not keep one per arm)."""
    pad_to_max_len: bool | None = None
    """Pad every batch to max_len; None: when compiled, so the graph compiles once for one shape."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms(True)` for the run: inductor's CPU kernels (e.g. the embedding
    backward) otherwise accumulate in parallel, so two compiled fp32 runs can differ in the last bit
    (CUDA also needs CUBLAS_WORKSPACE_CONFIG=:4096:8)."""
    progress: bool = True
    parallel: Literal["ddp", "fsdp2", "ep", "fsdp2_ep"] | None = None
    """Train on every process torchrun started: "ddp" (experts beside DDP, all-reduced in backward),
    "fsdp2" (experts in their own fully_shard group), "ep" (experts sharded E/world per rank) or
    "fsdp2_ep" (experts E/ep_size per rank, FSDP2 over the rest; dense FSDP2 over every rank);
    None: one process."""
    ep_size: int | None = None
    """fsdp2_ep: the expert-parallel degree (it must divide the world and every layer's experts); the
    rest, world / ep_size, is FSDP2's data-parallel degree. None: the world size (a 1 x world mesh)."""


IDENTITY_FIELDS = (
    "model", "model_overrides", "dtype", "method", "steps", "batch_size", "max_len", "lr", "warmup",
    "min_lr", "optimizer", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov",
    "adjust_lr_fn", "max_grad_norm", "expert_clip", "state_bits", "seed", "train_size", "held_out",
    "pad_to_max_len", "deterministic",
)  # fmt: skip
"""Fields a resumed run must share with the run that wrote the checkpoint (plus the execution mode and
the data hash): any difference would change the arithmetic of the remaining steps."""


def run_identity(cfg: TrainConfig, data_hash: str) -> dict[str, Any]:
    """What a checkpoint records about its run, flat, keyed by config field (see `flag_of`)."""
    fields = {k: getattr(cfg, k) for k in IDENTITY_FIELDS}
    fields["model_overrides"] = dict(sorted(cfg.model_overrides.items()))
    fields["compiler"] = cfg.execution.compiler
    fields["sonar_pass"] = cfg.execution.sonar_pass
    if cfg.dense_state_bits != 32:  # (absent at its default, as in checkpoints written before the flag)
        fields["dense_state_bits"] = cfg.dense_state_bits
    if cfg.grad_accum != 1:  # (likewise; --clip-scope is resolved into method and expert_clip)
        fields["grad_accum"] = cfg.grad_accum
    if cfg.parallel is not None:  # (absent from single-process identities, as before)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        fields.update(parallel=cfg.parallel, world_size=world)
        if cfg.parallel == "fsdp2_ep":  # the mesh decides what each rank's checkpoint holds
            fields["ep_size"] = world if cfg.ep_size is None else cfg.ep_size
    return {**fields, "data": data_hash}


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain JSON values for summary.json: the execution mode flattened into
    `compiler` and `sonar_pass`, as the flags spell it."""
    record: dict[str, Any] = {}
    for name in cfg.__dataclass_fields__:
        value = getattr(cfg, name)
        if name == "execution":
            record.update(compiler=value.compiler, sonar_pass=value.sonar_pass)
        elif isinstance(value, Mapping):
            record[name] = dict(value)
        elif isinstance(value, tuple):
            record[name] = list(value)
        else:
            record[name] = value
    return record
