"""The deferred schedule's corners (issue 39): every autograd habit of a loop trains bitwise as plain
torch written here, or is refused before any weight moves.

The twin is `test_deferred.Twin`: `AdamW(fused=True)` over [dense, experts] and one `clip_grad_norm_`
over every parameter. Each program runs once on Sonar and once on the twin; weights are compared with
`torch.equal` (`assert_same_weights`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import sonar_fx
from sonar_fx.models import build_model
from sonar_fx.optim.norms import total_norm

from helpers import assert_same_weights, batches, known_library_failure
from test_deferred import MAX_NORM, Twin, cfg_for, pair

COMPILED_FP32 = known_library_failure(grouped_mm_compiled=torch.float32)
DTYPES = [torch.float32, torch.bfloat16]
COMPILED_DTYPES = [pytest.param(torch.float32, marks=COMPILED_FP32), torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


@dataclass
class Side:
    """One side of a program: Sonar, or plain torch."""

    run: Callable[..., Any]
    """The model's forward (compiled as the other side's when compiled)."""
    model: nn.Module
    step: Callable[[], None]
    zero_grad: Callable[[], None]

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.run(**batch).loss

    def experts(self) -> list[nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if ".experts." in n]

    def dense(self) -> list[nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if ".experts." not in n]


def sides(compiler: str, dtype: torch.dtype, clip: str = "all"):
    model, opt, twin_model, twin = pair(compiler, dtype, clip)

    def twin_step() -> None:
        twin.clip_()
        twin.opt.step()

    sonar = Side(model, model, opt.step, opt.zero_grad)
    return sonar, Side(twin.run, twin_model, twin_step, twin.opt.zero_grad)


def run_both(program: Callable[[Side], None], compiler: str, dtype: torch.dtype, clip: str = "all"):
    sonar, plain = sides(compiler, dtype, clip)
    program(sonar)
    program(plain)
    return sonar, plain


# 1 ----------------------------------------------------- accumulation order: autograd's, per backward


def several_forwards(side: Side) -> None:
    """Per step: a backward of two forwards summed, then one of three (DPO-like pairs, accumulated)."""
    data = batches(10)
    for s in range(2):
        a, b, c, d, e = data[5 * s : 5 * s + 5]
        (side.loss(a) + side.loss(b)).backward()
        (side.loss(c) + side.loss(d) + side.loss(e)).backward()
        side.step()
        side.zero_grad()


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_forwards_per_backward_accumulate_as_autograd(dtype):
    sonar, plain = run_both(several_forwards, "eager", dtype)
    assert_same_weights(sonar.model, plain.model)
    report = sonar.model.sonar.report()
    assert report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == 8


def test_negative_control_one_sum_over_every_kept_gradient_differs():
    """The grouping matters on these batches: the kept gradients of two backwards (2 + 3 forwards)
    summed in one row are other bits than per backward, then accumulated."""
    sonar, _ = sides("eager", torch.bfloat16)
    data = batches(5, seq=8)  # operands below the gradients: nothing crossed over
    (sonar.loss(data[0]) + sonar.loss(data[1])).backward()
    (sonar.loss(data[2]) + sonar.loss(data[3]) + sonar.loss(data[4])).backward()
    store, differ = sonar.model.sonar.deferred, 0
    for p in sonar.experts():
        in_a_row = None
        for e in [e for g in store.kept[id(p)].groups() for e in g]:
            g = e.gradient(p)
            in_a_row = g if in_a_row is None else in_a_row.add_(g)
        assert len(store.kept[id(p)].groups()) == 2 and not store.kept[id(p)].folded
        differ += not torch.equal(in_a_row, store.gradient(p, consume=False))
    assert differ


def penalized(side: Side) -> None:
    """An L2 penalty on the expert weights (a read outside their GEMM), two backwards per step, the
    second of two forwards."""
    data = batches(6)
    for s in range(2):
        a, b, c = data[3 * s : 3 * s + 3]
        penalty = sum(w.float().pow(2).sum() for w in side.experts())
        (side.loss(a) + 1e-3 * penalty).backward()
        penalty = sum(w.float().pow(2).sum() for w in side.experts())
        (side.loss(b) + side.loss(c) + 1e-3 * penalty).backward()
        side.step()
        side.zero_grad()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_read_outside_its_gemm_joins_the_ordered_sum(dtype):
    with pytest.warns(UserWarning, match="whole"):
        sonar, plain = run_both(penalized, "eager", dtype)
    assert_same_weights(sonar.model, plain.model)
    report = sonar.model.sonar.report()
    names = sorted(sonar.model.sonar.expert_name(p) for p in sonar.experts())
    assert report["deferred"]["kept_whole"] == names  # said, in the report as in the warning
    # The whole gradients alive in backward are counted: at least two expert tensors' at once.
    biggest = max(p.numel() * p.element_size() for p in sonar.experts())
    assert report["expert_grad_bytes"]["measured_peak"] >= 2 * biggest
    assert all(p.grad is None for p in sonar.experts())


# 3 ------------------------------------------- a backward that plain torch never takes to the experts


def partial_backwards(side: Side) -> None:
    """Per step: a side `autograd.grad` of the embedding, a backward limited to the dense tensors, and
    an ordinary backward."""
    data = batches(6)
    embed = side.model.get_input_embeddings().weight
    for s in range(2):
        a, b, c = data[3 * s : 3 * s + 3]
        torch.autograd.grad(side.loss(a), [embed])
        side.loss(b).backward(inputs=side.dense())
        side.loss(c).backward()
        side.step()
        side.zero_grad()


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_and_autograd_grad_keep_nothing_for_the_experts(dtype):
    sonar, plain = run_both(partial_backwards, "eager", dtype)
    assert_same_weights(sonar.model, plain.model)


def every_habit(side: Side) -> None:
    several_forwards(side)
    penalized(side)
    partial_backwards(side)


@pytest.mark.parametrize("dtype", COMPILED_DTYPES)
def test_compiled_every_habit_as_autograd(dtype):
    """Under aot_eager (one compile per side, so the three programs run in a row): the same bits."""
    with pytest.warns(UserWarning, match="whole"):
        sonar, plain = run_both(every_habit, "aot_eager", dtype)
    assert_same_weights(sonar.model, plain.model)
    assert sonar.model.sonar.report()["updates_deferred"] == 4 * 6


def test_autograd_grad_of_an_expert_tensor_is_refused():
    sonar, _ = sides("eager", torch.float32)
    before = [p.detach().clone() for p in sonar.model.parameters()]
    with pytest.raises(sonar_fx.SonarUsageError, match=r"autograd\.grad\(\) of an expert tensor"):
        torch.autograd.grad(sonar.loss(batches(1)[0]), sonar.experts()[:1])
    sonar.step()
    assert all(torch.equal(a, p) for a, p in zip(before, sonar.model.parameters(), strict=True))


# 4 ---------------------------------------------------------------- one norm, as torch groups it


def test_total_norm_groups_as_torch_over_random_mixed_lists():
    """`norms.total_norm` of per-tensor norms is `get_total_norm` of the tensors, for any dtype mix;
    the order of first appearance (the old grouping) is other bits on some of the same lists."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    first_appearance_differs = 0
    for _ in range(200):
        count = int(torch.randint(2, 9, (), generator=gen))
        picks = torch.randint(0, len(dtypes), (count,), generator=gen).tolist()
        sizes = torch.randint(1, 64, (count,), generator=gen).tolist()
        grads = [torch.randn(n, generator=gen).to(dtypes[d]) for n, d in zip(sizes, picks, strict=True)]
        per_tensor = [torch._foreach_norm([g], 2.0)[0] for g in grads]
        expected = torch.nn.utils.get_total_norm(grads)
        assert torch.equal(total_norm(per_tensor), expected)
        by_key: dict[torch.dtype, list[torch.Tensor]] = {}
        for n in per_tensor:
            by_key.setdefault(n.dtype, []).append(n)
        in_first_order = torch.linalg.vector_norm(torch.stack([n for ns in by_key.values() for n in ns]))
        first_appearance_differs += not torch.equal(in_first_order, expected)
    assert first_appearance_differs > 0


def mixed_model_pair(schedule: str):
    """fp32 dense tensors, bf16 experts (accepted by prepare), clipped over every parameter."""
    model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    for layer in model.model.layers:
        layer.mlp.experts.to(torch.bfloat16)
    twin_model = copy.deepcopy(model)
    sonar_fx.compile(model, cfg_for("all"), compiler="eager", schedule=schedule)
    names = {model.sonar.expert_name(p) for p in model.sonar.expert_group["params"]}
    return model, twin_model, Twin(twin_model, names, "all", "eager")


@pytest.mark.parametrize("schedule", ["deferred", "in_backward"])
def test_fp32_dense_with_bf16_experts_clips_by_torchs_norm(schedule):
    model, twin_model, twin = mixed_model_pair(schedule)
    opt = model.sonar
    ours, theirs = [], []
    for b in batches(12, seq=8):
        if schedule == "deferred":
            model(**b).loss.backward()
        else:  # the in-backward schedule's global clip: both passes through opt.backward
            opt.backward(lambda b=b: model(**b).loss)
        opt.step()
        opt.zero_grad()
        twin.run(**b).loss.backward()
        theirs.append(float(torch.nn.utils.clip_grad_norm_(twin.all, MAX_NORM)))
        twin.opt.step()
        twin.opt.zero_grad()
        ours.append(opt.grad_norms()["total"])
    assert ours == theirs
    assert all(t > MAX_NORM for t in theirs)
    assert_same_weights(model, twin_model)
