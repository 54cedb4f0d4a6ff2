"""The differential fuzzer's machinery: random loop programs built of a loop's habits (forwards,
backwards of several forwards, `backward(inputs=)`, `autograd.grad`, a penalty on the expert weights,
zero_grad of either kind, a dense `.grad` dropped by hand, skipped and repeated steps, accumulation, an
inf in the loss or in one expert's gradient; with `OPTIMIZER_OPS`, an LR set by hand or by a torch
scheduler and zero_grad(set_to_none=False) of the optimizer, over the optimizer `Options` an arm
draws: AdamW or SGD, weight-decay groups, per-expert updates), run once on Sonar and once on plain
torch written in the test files, and one verdict for every arm (`run_program`): the same bits after
the program, or a `SonarUsageError` raised before any weight moved, the weights then equal to plain
torch's before that operation. An `InterruptedStepError` is never a refusal: it says expert tensors moved.

Each arm (test_deferred_fuzz.py, test_in_backward_fuzz.py) builds its two `Loop`s per seed. CI runs a
handful of seeded programs per arm; `SONAR_FX_FUZZ_PROGRAMS=300` soaks each arm with 300."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import nn

import sonar_fx
from sonar_fx.config import AdamWConfig, SGDConfig, WeightDecayGroup
from sonar_fx.errors import InterruptedStepError

from helpers import assert_same_weights, batches

PROGRAMS_ENV = "SONAR_FX_FUZZ_PROGRAMS"

OPS = {
    "backward": 6,  # one forward, one backward
    "backward_of_two": 3,  # two forwards summed into one backward
    "penalty": 1,  # an L2 penalty on the expert weights joins the loss
    "inputs_dense": 1,  # backward(inputs=dense tensors)
    "inputs_dense_and_expert": 1,  # backward(inputs=dense tensors + the first expert tensor)
    "grad_of_embedding": 1,  # torch.autograd.grad of the embedding
    "optimizer_zero_grad": 3,
    "model_zero_grad": 2,
    "model_zero_grad_keep": 1,  # set_to_none=False
    "drop_a_dense_grad": 1,
    "step": 5,
}
# The loop around the optimizer (each schedule's options arm): steps drawn more often, so that two
# steps with no backward between them come up, with the optimizer's zero_grad of either kind between.
OPTIMIZER_OPS = OPS | {
    "set_lr": 1,  # every param group's "lr" halved by hand
    "scheduler_step": 1,  # the loop's torch StepLR (gamma 0.5) steps
    "optimizer_zero_grad_keep": 2,  # the optimizer's zero_grad(set_to_none=False)
    "step": 7,
}
INF_OPS = {
    "inf_loss": 1,  # the loss times inf: every gradient non-finite
    "inf_expert": 1,  # inf times the sum of one expert tensor joins the loss: only its gradient is inf
}


def seeds(default: int) -> range:
    """The seeds of one arm: `default` in CI, `SONAR_FX_FUZZ_PROGRAMS` when set (a soak)."""
    return range(int(os.environ.get(PROGRAMS_ENV, default)))


@dataclass
class Loop:
    """One side of a program, Sonar's or plain torch's: what the loop calls."""

    model: nn.Module
    run: Callable[..., object]
    """The model's forward (plain torch's compiled as Sonar's is)."""
    step: Callable[[], None]
    zero_grad: Callable[..., None]
    """The optimizer's (or optimizers') zero_grad, `set_to_none` as torch's."""
    after_backward: Callable[[], None] = lambda: None
    """Plain torch's twin of the in-backward schedule steps its experts here; Sonar's side does nothing."""
    autocast: torch.dtype | None = None
    """The forwards' CPU autocast dtype (a GradScaler's programs: float16), or None."""
    scaler: torch.amp.GradScaler | None = None
    """The loop's GradScaler: each backward is of the scaled loss (`step` is the scaler's step)."""
    norms: list[torch.Tensor] = field(default_factory=list)
    """The total norm each step's clip returned, where the loop clips."""
    param_groups: list[dict] = field(default_factory=list)
    """Every param group of the loop's optimizers (set_lr)."""
    schedulers: list[torch.optim.lr_scheduler.LRScheduler] = field(default_factory=list)
    """The loop's LR schedulers, one per optimizer (scheduler_step)."""

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = self.autocast or torch.bfloat16
        with torch.autocast("cpu", dtype=dtype, enabled=self.autocast is not None):
            return self.run(**batch).loss  # type: ignore[attr-defined]

    def backward(self, loss: torch.Tensor, inputs: list[nn.Parameter] | None = None) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward(inputs=inputs)
        self.after_backward()

    def experts(self) -> list[nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if ".experts." in n]

    def dense(self) -> list[nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if ".experts." not in n]


def program(rng: random.Random, ops: dict[str, int], length: int) -> list[str]:
    return rng.choices(list(ops), list(ops.values()), k=length)


def apply(side: Loop, op: str, data: list[dict[str, torch.Tensor]]) -> None:
    if op == "backward":
        side.backward(side.loss(data.pop()))
    elif op == "backward_of_two":
        side.backward(side.loss(data.pop()) + side.loss(data.pop()))
    elif op == "penalty":
        penalty = sum(w.float().pow(2).sum() for w in side.experts())
        side.backward(side.loss(data.pop()) + 1e-3 * penalty)
    elif op in ("inputs_dense", "inputs_dense_and_expert"):
        extra = side.experts()[:1] if op == "inputs_dense_and_expert" else []
        side.backward(side.loss(data.pop()), inputs=side.dense() + extra)
    elif op == "grad_of_embedding":
        torch.autograd.grad(side.loss(data.pop()), [side.model.get_input_embeddings().weight])
    elif op == "inf_loss":
        side.backward(side.loss(data.pop()) * float("inf"))
    elif op == "inf_expert":
        side.backward(side.loss(data.pop()) + float("inf") * side.experts()[0].float().sum())
    else:
        apply_loop_op(side, op)


def apply_loop_op(side: Loop, op: str) -> None:
    if op in ("optimizer_zero_grad", "optimizer_zero_grad_keep"):
        side.zero_grad(set_to_none=op == "optimizer_zero_grad")
    elif op == "set_lr":
        for group in side.param_groups:
            group["lr"] *= 0.5
    elif op == "scheduler_step":
        for scheduler in side.schedulers:
            scheduler.step()
    elif op in ("model_zero_grad", "model_zero_grad_keep"):
        side.model.zero_grad(set_to_none=op == "model_zero_grad")
    elif op == "drop_a_dense_grad":
        side.dense()[1].grad = None
    elif op == "step":
        side.step()
    else:
        raise ValueError(f"unknown op {op!r}")


@contextlib.contextmanager
def sonar_warnings_quiet() -> Iterator[None]:
    """What Sonar says once per model (per_microbatch, kept whole, crossed over, step skipped) is
    tested where it is said; a program says it on every seed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(sonar|accumulation)", category=UserWarning)
        # A scheduler stepped before any optimizer step is a habit the options arms draw on purpose.
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler.step\(\)`", category=UserWarning
        )
        yield


def run_program(
    seed: int, ops: list[str], sonar: Loop, plain: Loop, *, seq: int = 8, ran: list[str] | None = None
) -> tuple[str, str | None, str | None]:
    """`ops` on both sides, op by op; returns ("exact", None, None) or ("refused", op, message), having
    asserted what each promises: the same bits, or a refusal before any weight moved. `ran`, if given,
    receives each op as it runs (the refused one last)."""
    pool = batches(2 * len(ops), seq=seq, seed=seed)
    ours, theirs = list(pool), list(pool)
    with sonar_warnings_quiet():
        for i, op in enumerate(ops):
            if ran is not None:
                ran.append(op)
            before = [p.detach().clone() for p in sonar.model.parameters()]
            try:
                apply(sonar, op, ours)
            except sonar_fx.SonarUsageError as refusal:
                where = f"seed {seed}: {ops[: i + 1]}"
                assert not isinstance(refusal, InterruptedStepError), f"{where}: {refusal}"
                moved = [
                    n
                    for (n, p), b in zip(sonar.model.named_parameters(), before, strict=True)
                    if not torch.equal(p, b)
                ]
                assert not moved, f"{where} refused after moving {moved[:3]}: {refusal}"
                assert_same_weights(sonar.model, plain.model)  # plain torch has run the ops before it
                return "refused", op, str(refusal)
            apply(plain, op, theirs)
    theirs_by_name = dict(plain.model.named_parameters())
    differ = [n for n, p in sonar.model.named_parameters() if not torch.equal(p, theirs_by_name[n])]
    assert not differ, f"seed {seed}: {ops}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    assert len(sonar.norms) == len(plain.norms), f"seed {seed}: {ops}: {sonar.norms} vs {plain.norms}"
    assert all(map(same_bits, sonar.norms, plain.norms)), f"seed {seed}: {ops}: the clips' norms differ"
    if sonar.scaler is not None:
        assert sonar.scaler.get_scale() == plain.scaler.get_scale(), f"seed {seed}: {ops}: scales differ"
    return "exact", None, None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal`, where a NaN equals a NaN (a norm of an inf loss's gradients)."""
    return torch.equal(a, b) or bool(a.isnan().all() and b.isnan().all())


@dataclass(frozen=True)
class Options:
    """The optimizer an options arm draws per program, with what plain torch builds for it."""

    optimizer: str = "adamw"
    """"adamw" (`AdamWConfig`) or "sgd" (`SGDConfig`, momentum 0.9)."""
    no_decay: bool = False
    """The norm weights and one expert tensor in a `WeightDecayGroup` of weight decay 0.0."""
    granularity: str = "batched"
    """Sonar's expert updates: one per batched tensor, or one per expert slice ("per_expert")."""

    @classmethod
    def draw(cls, rng: random.Random) -> Options:
        return cls(rng.choice(["adamw", "sgd"]), rng.random() < 0.5, rng.choice(["batched", "per_expert"]))

    def config(self, cfg: AdamWConfig, model: nn.Module) -> AdamWConfig | SGDConfig:
        """`cfg` (its LR, decay and clip) as this optimizer, with the no-decay group of `model`."""
        groups = (WeightDecayGroup(params=no_decay_names(model), weight_decay=0.0),) if self.no_decay else ()
        cfg = replace(cfg, weight_decay_groups=groups)
        if self.optimizer == "adamw":
            return cfg
        shared = ("lr", "weight_decay", "max_grad_norm", "expert_clip", "keep_budget", "weight_decay_groups")
        return SGDConfig(momentum=0.9, **{k: getattr(cfg, k) for k in shared})

    def plain(
        self, model: nn.Module, roles: list[set[str]], cfg: AdamWConfig | SGDConfig
    ) -> torch.optim.Optimizer:
        """Plain torch's optimizer over the parameters of `model` named in `roles`, one param group per
        role (Sonar's dense and expert groups: torch's foreach SGD steps a group's tensors alike), each
        split by `cfg`'s weight-decay groups: `AdamW(fused=True)`, or `SGD` (fused; foreach in bf16,
        where torch's fused CPU kernel leaves the tensors unchanged)."""
        exempt = {n for g in cfg.weight_decay_groups for n in g.params}
        named = dict(model.named_parameters())
        groups = []
        for names in roles:
            params = [(n, p) for n, p in named.items() if n in names]
            groups.append(dict(params=[p for n, p in params if n not in exempt]))
            if any(n in exempt for n, _ in params):
                groups.append(dict(params=[p for n, p in params if n in exempt], weight_decay=0.0))
        if isinstance(cfg, SGDConfig):
            fp32 = all(p.dtype == torch.float32 for p in named.values())
            kernel = dict(fused=True) if fp32 else dict(foreach=True)
            return torch.optim.SGD(
                groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernel
            )
        hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
        return torch.optim.AdamW(groups, **hyper)


def no_decay_names(model: nn.Module) -> tuple[str, ...]:
    """The norm weights (what transformers' Trainer exempts from decay) and the first expert tensor."""
    names = [n for n, _ in model.named_parameters()]
    return (*(n for n in names if "norm" in n), next(n for n in names if ".experts." in n))


def step_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


GRADIENT_OPS = {"backward", "backward_of_two", "penalty", "inputs_dense", "inputs_dense_and_expert"}
"""The ops that write gradients into the model (`grad_of_embedding` returns its own)."""


def repeats_a_step(ops: list[str]) -> bool:
    """Two steps in `ops` with no backward between them (zero_grad of either kind allowed between)."""
    since_step = None
    for op in ops:
        if op == "step":
            if since_step is not None and not since_step & GRADIENT_OPS:
                return True
            since_step = set()
        elif since_step is not None:
            since_step.add(op)
    return False
