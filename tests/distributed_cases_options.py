"""What each rank runs in the tests of optimizer options on the engines (`test_distributed_options`).

A case trains one model with Sonar on an engine and its twin with that engine's standard recipe,
written here in plain torch: the engine's own wrapper (DDP, `fully_shard`, expert-parallel experts
with DDP on the dense part), torch's or torchao's optimizer, and the clip the option names applied
after the engine's reduction (`clip_grad_norm_` of the dense gradients, of each expert tensor, or of
all of them; under expert parallelism the global norm is torchtitan's: the experts' norm reduced
over ranks as a DTensor, combined with the dense one). Each case reports which tensors differ on
this rank (`torch.equal`), a digest of every tensor (ranks must agree), the update counts and the
last step's norms (so the test can check the clip was active). Negative controls train the twin by
a neighbouring rule and must differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import differ, digest
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import sonar_fx
import sonar_fx.distributed as sd
from sonar_fx.compiled import repeated_blocks
from sonar_fx.experts.discovery import ExpertSet
from sonar_fx.models import build_model
from sonar_fx.optim.rules import rule_for

from helpers import batches

STEPS = 2
SMALL: dict[str, Any] = {}
"""tiny-reference as it is: 2 layers of 4 experts (d 32, n 16), 4 expert tensors."""
WIDE = {"num_experts": 8, "hidden_size": 64, "intermediate_size": 32}
"""Expert tensors whose local shard (FSDP2, EP on 2 ranks) is large enough for torchao to quantize."""
BASE = dict(lr=1e-2, weight_decay=0.01)
ADAMW = sonar_fx.AdamWConfig(**BASE, betas=(0.9, 0.95), max_grad_norm=0.5)


# ----------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    """How one engine puts Sonar and the standard recipe on a model (`compiler`: eager or per block)."""

    name: str

    def sonar(self, model: nn.Module, cfg: Any, compiler: str) -> tuple[Callable[..., Any], Any]:
        if self.name in ("ddp", "ddp-async"):
            wrapped = sd.ddp(model, cfg, compiler=compiler, async_reduce=self.name == "ddp-async")
        elif self.name == "fsdp2":
            wrapped = sd.fsdp2(model, cfg, compiler=compiler)
        else:
            wrapped = sd.expert_parallel(
                model, cfg, **({} if compiler == "eager" else {"compiler": compiler})
            )
        return wrapped, wrapped.sonar

    def standard(self, model: nn.Module, compiler: str) -> Callable[..., Any]:
        if self.name in ("ddp", "ddp-async"):
            run = DDP(model)
            return run if compiler == "eager" else torch.compile(run, backend=compiler)
        if self.name == "fsdp2":
            sd.fully_shard_experts(model)
        else:
            sd.shard_experts_(model)
            DDP._set_params_and_buffers_to_ignore_for_model(model, ExpertSet.discover(model).names)
        if compiler != "eager":
            for _, block in repeated_blocks(
                model, [layer.name for layer in ExpertSet.discover(model).layers]
            ):
                block.compile(backend=compiler)
        return model if self.name == "fsdp2" else DDP(model)

    @property
    def expert_scale(self) -> float:
        """Expert parallelism: the 1/world of data-parallel averaging, which DDP gives dense gradients."""
        return 1.0 / dist.get_world_size() if self.name == "ep" else 1.0


ENGINES = {name: Engine(name) for name in ("ddp", "ddp-async", "fsdp2", "ep")}


# ------------------------------------------------------------------------------------------ oracle


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    ids = ExpertSet.discover(model).names_by_id()
    return [p for p in model.parameters() if id(p) in ids]


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    ids = ExpertSet.discover(model).names_by_id()
    return [p for p in model.parameters() if id(p) not in ids]


def clip_(rule: str, model: nn.Module, engine: Engine, max_norm: float) -> None:
    """The standard recipe's clip, after the engine reduced every gradient."""
    dense, experts = dense_params(model), expert_params(model)
    clip = torch.nn.utils.clip_grad_norm_
    if rule == "global" and engine.name == "ep":
        ep_global_clip_(dense, experts, max_norm)
    elif rule == "global":
        clip(list(model.parameters()), max_norm)
    else:
        clip(dense, max_norm)
    if rule == "per_tensor":
        for p in experts:
            clip([p], max_norm)
    if rule == "per_local_shard":  # negative control: an FSDP2 expert clipped by its own shard's norm
        for p in experts:
            local = p.grad.to_local()
            local.mul_(torch.clamp(max_norm / (torch.linalg.vector_norm(local) + 1e-6), max=1.0))


def ep_global_clip_(dense: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's global clip under expert parallelism: the experts as DTensors sharded over the EP
    ranks, whose norm `full_tensor()` reduces; combined with the dense norm as p-th powers."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = [DTensor.from_local(p.grad, mesh, [Shard(0)]) for p in experts]
    ep_norm = torch.nn.utils.get_total_norm(sharded).full_tensor()
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense])
    total = ep_norm**2 + dense_norm**2
    total **= 1.0 / 2
    torch.nn.utils.clip_grads_with_norm_(experts, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
    return total  # the norm torchtitan logs


def torch_optimizers(model: nn.Module, cfg: Any) -> list[torch.optim.Optimizer]:
    """The end-of-step optimizers: the config's torch optimizer, or (low-bit expert states) torchao's
    for the experts beside the torch one for the dense tensors."""
    if getattr(cfg, "state_bits", 32) == 32:
        return [rule_for(cfg).torch_optimizer(list(model.parameters()), cfg)]
    return [
        rule_for(cfg).torch_optimizer(dense_params(model), cfg),
        torchao_optimizer(expert_params(model), cfg),
    ]


def torchao_optimizer(params: list[nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    """torchao's low-bit Adam(W) with the config's bits and hyperparameters."""
    import torchao.optim

    kind = getattr(
        torchao.optim, f"{'AdamW' if isinstance(cfg, sonar_fx.AdamWConfig) else 'Adam'}{cfg.state_bits}bit"
    )
    return kind(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def train_standard(engine: Engine, model: nn.Module, cfg: Any, rank: int, rule: str, compiler: str) -> None:
    run = engine.standard(model, compiler)
    optimizers = torch_optimizers(model, cfg)
    for b in batches(STEPS, seed=1 + rank):
        run(**b).loss.backward()
        for p in expert_params(model):
            if engine.expert_scale != 1.0:
                p.grad.mul_(engine.expert_scale)
        clip_(rule, model, engine, cfg.max_grad_norm)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def train_sonar(run: Callable[..., Any], optimizer: Any, rank: int) -> None:
    for b in batches(STEPS, seed=1 + rank):
        optimizer.backward(lambda b=b: run(**b).loss)  # two passes under expert_clip="global"
        optimizer.step()
        optimizer.zero_grad()


# ------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    engine: str
    cfg: Any
    rule: str
    """The twin's clip: "dense", "per_tensor" or "global" (or a negative control's rule)."""
    compiler: str = "eager"
    dtype: torch.dtype = torch.float32
    shape: tuple[tuple[str, Any], ...] = ()


Control = tuple[str, str, dict[str, Any]]
"""A negative control: (label, the twin's clip rule, config fields changed), trained like the twin."""


def run_case(case: Case, rank: int, *, controls: tuple[Control, ...] = ()) -> dict[str, Any]:
    engine, shape = ENGINES[case.engine], dict(case.shape)
    torch._dynamo.reset()
    model = build_model("tiny-reference", dtype=case.dtype, seed=0, **shape)
    run, optimizer = engine.sonar(model, case.cfg, case.compiler)
    train_sonar(run, optimizer, rank)
    torch._dynamo.reset()
    twin = build_model("tiny-reference", dtype=case.dtype, seed=0, **shape)
    train_standard(engine, twin, case.cfg, rank, case.rule, case.compiler)
    report = optimizer.report()
    norms = report["grad_norms"]
    out = {
        "differ": differ(model, twin),
        "moved": bool(differ(model, build_model("tiny-reference", dtype=case.dtype, seed=0, **shape))),
        "digest": digest(model),
        "dense_digest": digest(model, dense_only=True),
        "by_hook": report["updates_by_hook"],
        "in_graph": report["updates_in_graph"],
        "fallbacks": report["fallbacks"],
        "expert_rule": report["expert_rule"],
        "max_expert_norm": max(norms["experts"].values()),
        "total_norm": norms["total"],
        "state_kinds": sorted(
            {
                type(_local(v)).__name__
                for s in optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim()
            }
        ),
    }
    for label, rule, changes in controls:  # the twin trained by a neighbouring rule: must differ
        torch._dynamo.reset()
        other = build_model("tiny-reference", dtype=case.dtype, seed=0, **shape)
        train_standard(engine, other, replace(case.cfg, **changes), rank, rule, case.compiler)
        out[f"control/{label}"] = differ(model, other)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


PER_TENSOR = sonar_fx.AdamWConfig(**BASE, max_grad_norm=0.05, expert_clip="per_tensor")
GLOBAL = sonar_fx.AdamWConfig(**BASE, max_grad_norm=0.5, expert_clip="global")
DENSE_ONLY: tuple[Control, ...] = (("dense-only clip", "dense", {"expert_clip": None}),)
EAGER_CASES: dict[str, tuple[Case, tuple[Control, ...]]] = {
    # expert_clip="per_tensor": each expert tensor by the norm of its reduced (whole) gradient.
    "ddp/per_tensor": (Case("ddp", PER_TENSOR, "per_tensor"), DENSE_ONLY),
    "fsdp2/per_tensor": (Case("fsdp2", PER_TENSOR, "per_tensor"), (("shard norm", "per_local_shard", {}),)),
    "ep/per_tensor/bf16": (Case("ep", PER_TENSOR, "per_tensor", dtype=torch.bfloat16), DENSE_ONLY),
    # expert_clip="global": one norm over every gradient, two passes.
    "ddp/global": (Case("ddp", GLOBAL, "global"), DENSE_ONLY),
    "ddp-async/global/bf16": (Case("ddp-async", GLOBAL, "global", dtype=torch.bfloat16), ()),
    "fsdp2/global/bf16": (Case("fsdp2", GLOBAL, "global", dtype=torch.bfloat16), DENSE_ONLY),
    "ep/global": (Case("ep", GLOBAL, "global"), DENSE_ONLY),
    # Adam, SGD and Lion on every engine.
    "ddp/adam/global": (
        Case("ddp", sonar_fx.AdamConfig(**BASE, max_grad_norm=0.5, expert_clip="global"), "global"),
        (),
    ),
    "fsdp2/sgd": (Case("fsdp2", sonar_fx.SGDConfig(**BASE, momentum=0.9, nesterov=True), "dense"), ()),
    "ep/lion": (Case("ep", sonar_fx.LionConfig(lr=1e-3), "dense"), ()),
    "ddp/sgd/per_tensor": (
        Case(
            "ddp",
            sonar_fx.SGDConfig(**BASE, momentum=0.9, max_grad_norm=0.05, expert_clip="per_tensor"),
            "per_tensor",
        ),
        (),
    ),
    "fsdp2/lion/global": (
        Case("fsdp2", sonar_fx.LionConfig(lr=1e-3, max_grad_norm=0.5, expert_clip="global"), "global"),
        (),
    ),
    "ep/adam": (Case("ep", sonar_fx.AdamConfig(**BASE), "dense"), ()),
}


COMPILED_CASES: dict[str, tuple[Case, tuple[Control, ...]]] = {
    # DDP: the all-reduce and the update in the graph, in both passes; FSDP2: per block, the hooks
    # after the reduce-scatter; EP: per block, all-to-alls between the graphs, the update in them.
    "ddp/aot_eager/global": (Case("ddp", GLOBAL, "global", compiler="aot_eager"), ()),
    "fsdp2/aot_eager/global": (Case("fsdp2", GLOBAL, "global", compiler="aot_eager"), ()),
    "ep/aot_eager/global/bf16": (
        Case("ep", GLOBAL, "global", compiler="aot_eager", dtype=torch.bfloat16),
        (),
    ),
    # As many experts as ranks: each rank's expert tensors are (1, out, in), found in the graph too.
    "ep/aot_eager/global/one_expert_per_rank": (
        Case("ep", GLOBAL, "global", compiler="aot_eager", shape=(("num_experts", 2),)),
        DENSE_ONLY,
    ),
}
WIDE_4 = (*WIDE.items(), ("num_experts", 4))
"""DDP holds every expert: 4 wide ones have the shapes of EP's 8 over 2 ranks (shared compiles)."""
LOWBIT_CASES: dict[str, tuple[Case, tuple[Control, ...]]] = {
    "ddp/8bit/per_tensor": (
        Case("ddp", sonar_fx.AdamWConfig(**BASE, max_grad_norm=0.05, expert_clip="per_tensor", state_bits=8),
             "per_tensor", shape=WIDE_4),
        (("32-bit states", "per_tensor", {"state_bits": 32}),),
    ),
    "ep/4bit/global": (
        Case("ep", sonar_fx.AdamConfig(**BASE, expert_clip="global", state_bits=4), "global",
             shape=tuple(WIDE.items())),
        (),
    ),
    "fsdp2/8bit": (
        Case("fsdp2", sonar_fx.AdamWConfig(**BASE, state_bits=8), "dense", shape=tuple(WIDE.items())),
        (("32-bit states", "dense", {"state_bits": 32}),),
    ),
    "ddp/aot_eager/8bit": (
        Case("ddp", sonar_fx.AdamWConfig(**BASE, state_bits=8), "dense", compiler="aot_eager", shape=WIDE_4),
        (),
    ),
}  # fmt: skip


def run_cases(cases: dict[str, tuple[Case, tuple[Control, ...]]], rank: int) -> dict[str, Any]:
    return {label: run_case(case, rank, controls=controls) for label, (case, controls) in cases.items()}


def options(rank: int) -> dict[str, Any]:
    """Every case of `EAGER_CASES` and `COMPILED_CASES` (one spawn for all), and global clipping under
    DDP with find_unused_parameters."""
    return run_cases({**EAGER_CASES, **COMPILED_CASES}, rank) | {"ddp/global/find_unused": _find_unused(rank)}


def lowbit_options(rank: int) -> dict[str, Any]:
    """Low-bit expert states (torchao's optimizer as the twin) on every engine; torchao's update is an
    inductor compile."""
    return run_cases(LOWBIT_CASES, rank)


def ep_inductor(rank: int) -> dict[str, Any]:
    """Expert parallelism compiled per block by inductor, deterministic kernels (see `deterministic`)."""
    torch.use_deterministic_algorithms(True)
    return run_cases({"ep/inductor": (Case("ep", ADAMW, "dense", compiler="inductor"), ())}, rank)


def _find_unused(rank: int) -> dict[str, Any]:
    """DDP with find_unused_parameters=True, global clip: `no_sync` keeps its reducer out of pass 2."""
    model = build_model("tiny-reference", seed=0)
    wrapped = sd.ddp(model, GLOBAL, ddp_kwargs={"find_unused_parameters": True})
    train_sonar(wrapped, wrapped.sonar, rank)
    twin = build_model("tiny-reference", seed=0)
    train_standard(ENGINES["ddp"], twin, GLOBAL, rank, "global", "eager")
    return {"differ": differ(model, twin), "digest": digest(model)}
