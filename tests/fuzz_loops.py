"""The differential fuzzer's machinery: random loop programs built of a loop's habits (forwards,
backwards of several forwards, `backward(inputs=)`, `autograd.grad`, a penalty on the expert weights,
zero_grad of either kind, a dense `.grad` dropped by hand, skipped and repeated steps, accumulation, an
inf in the loss or in one expert's gradient), run once on Sonar and once on plain torch written in the
test files, and one verdict for every arm (`run_program`): the same bits after the program, or a
`SonarUsageError` raised before any weight moved, the weights then equal to plain torch's before that
operation. An `InterruptedStepError` is never a refusal: it says expert tensors moved.

Each arm (test_deferred_fuzz.py, test_in_backward_fuzz.py) builds its two `Loop`s per seed. CI runs a
handful of seeded programs per arm; `SONAR_FX_FUZZ_PROGRAMS=300` soaks each arm with 300."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import sonar_fx
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
    zero_grad: Callable[[], None]
    after_backward: Callable[[], None] = lambda: None
    """Plain torch's twin of the in-backward schedule steps its experts here; Sonar's side does nothing."""
    autocast: torch.dtype | None = None
    """The forwards' CPU autocast dtype (a GradScaler's programs: float16), or None."""
    scaler: torch.amp.GradScaler | None = None
    """The loop's GradScaler: each backward is of the scaled loss (`step` is the scaler's step)."""
    norms: list[torch.Tensor] = field(default_factory=list)
    """The total norm each step's clip returned, where the loop clips."""

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
    if op == "optimizer_zero_grad":
        side.zero_grad()
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
        yield


def run_program(
    seed: int, ops: list[str], sonar: Loop, plain: Loop, *, seq: int = 8
) -> tuple[str, str | None, str | None]:
    """`ops` on both sides, op by op; returns ("exact", None, None) or ("refused", op, message), having
    asserted what each promises: the same bits, or a refusal before any weight moved."""
    pool = batches(2 * len(ops), seq=seq, seed=seed)
    ours, theirs = list(pool), list(pool)
    with sonar_warnings_quiet():
        for i, op in enumerate(ops):
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
