"""A differential fuzzer of the deferred schedule's loop contract: random loop programs (forwards,
backwards of several forwards, `backward(inputs=)`, `autograd.grad`, a penalty on the expert weights,
zero_grad of either kind, a dense `.grad` dropped by hand, skipped and repeated steps, accumulation,
the clip of Sonar's config or the loop's own) run on plain torch and on Sonar: bitwise after every
program, or a `SonarUsageError` before any weight moves (the weights then equal plain torch's before
that operation). Seeded; eager, fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

import sonar_fx

from helpers import assert_same_weights, batches
from test_deferred_corners import Side, sides

# Tiny models with many tokens per step cross over, and a weight read outside its GEMM is kept whole:
# the saving is lost by design here (the guard's refusal has its own tests in test_saving_guard.py).
pytestmark = pytest.mark.usefixtures("deferred_saving_lost")

OPS = {
    "backward": 6,  # one forward, one backward
    "backward_of_two": 3,  # two forwards summed into one backward
    "penalty": 1,  # an L2 penalty on the expert weights joins the loss
    "inputs_dense": 1,  # backward(inputs=dense tensors)
    "grad_of_embedding": 1,  # torch.autograd.grad of the embedding
    "optimizer_zero_grad": 3,
    "model_zero_grad": 2,
    "model_zero_grad_keep": 1,  # set_to_none=False
    "drop_a_dense_grad": 1,
    "step": 5,
}


def program(rng: random.Random, length: int) -> list[str]:
    names, weights = list(OPS), list(OPS.values())
    return rng.choices(names, weights, k=length)


def apply(side: Side, op: str, data: list[dict[str, torch.Tensor]]) -> None:
    if op == "backward":
        side.loss(data.pop()).backward()
    elif op == "backward_of_two":
        (side.loss(data.pop()) + side.loss(data.pop())).backward()
    elif op == "penalty":
        penalty = sum(w.float().pow(2).sum() for w in side.experts())
        (side.loss(data.pop()) + 1e-3 * penalty).backward()
    elif op == "inputs_dense":
        side.loss(data.pop()).backward(inputs=side.dense())
    elif op == "grad_of_embedding":
        torch.autograd.grad(side.loss(data.pop()), [side.model.get_input_embeddings().weight])
    elif op == "optimizer_zero_grad":
        side.zero_grad()
    elif op in ("model_zero_grad", "model_zero_grad_keep"):
        side.model.zero_grad(set_to_none=op == "model_zero_grad")
    elif op == "drop_a_dense_grad":
        side.dense()[1].grad = None
    else:
        side.step()


def run(seed: int, dtype: torch.dtype) -> str:
    """One program on both sides; returns "exact" or "refused" (asserting what each promises)."""
    rng = random.Random(seed)
    ops = program(rng, rng.randint(5, 10))
    sonar, plain = sides("eager", dtype, rng.choice(["all", "user"]))
    pool = batches(2 * len(ops), seq=8, seed=seed)
    ours, theirs = list(pool), list(pool)
    for i, op in enumerate(ops):
        before = [p.detach().clone() for p in sonar.model.parameters()]
        try:
            apply(sonar, op, ours)
        except sonar_fx.SonarUsageError:
            moved = [
                p for p, b in zip(sonar.model.parameters(), before, strict=True) if not torch.equal(p, b)
            ]
            assert not moved, f"seed {seed}: {ops[: i + 1]} refused after moving weights"
            assert_same_weights(sonar.model, plain.model)  # plain torch has run the same ops before it
            return "refused"
        apply(plain, op, theirs)
    assert_same_weights(sonar.model, plain.model)
    return "exact"


@pytest.mark.filterwarnings("ignore:sonar. schedule='deferred' kept")  # the penalty's, said per model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_loop_programs_are_bitwise_or_refused(dtype):
    torch._dynamo.reset()
    outcomes = [run(seed, dtype) for seed in range(16)]
    assert outcomes.count("exact") >= 8 and "refused" in outcomes, outcomes  # both paths exercised
