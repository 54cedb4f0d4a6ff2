"""One norm as torch computes it, and the loop's own clip, under the deferred schedule (issue 39 item
4, issue 38 item 1): `norms.total_norm` groups as `torch.nn.utils.get_total_norm`, fp32 dense tensors
with bf16 experts clip by torch's norm in both schedules, and `model.sonar.clip_grad_norm_` returns
`clip_grad_norm_`'s norm over every parameter, bitwise, in a plain loop and in accelerate's
`accumulate()`; torch's or accelerate's own clip is refused before any weight moves."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import sonar_fx
from sonar_fx.models import build_model
from sonar_fx.optim.norms import total_norm

from helpers import assert_same_weights, batches
from test_deferred import MAX_NORM, Twin, cfg_for, pair
from test_deferred_corners import DTYPES, clip_off_pair, moved


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


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


# issue 38 --------------------------------------------- the user's own clip under the deferred schedule


@pytest.mark.parametrize("dtype", DTYPES)
def test_sonar_clip_grad_norm_is_torchs_over_every_parameter(dtype):
    """`model.sonar.clip_grad_norm_` between the last backward and step(), 2 micro-batches: the norm
    it returns is torch's `clip_grad_norm_(model.parameters())`'s, bitwise, and the step clips by it
    (aot_eager: `test_compiled_every_habit_as_autograd`)."""
    model, twin_model, twin = clip_off_pair("eager", dtype)
    data = batches(6)
    for s in range(3):
        for b in data[2 * s : 2 * s + 2]:
            model(**b).loss.backward()
            twin.run(**b).loss.backward()
        ours = model.sonar.clip_grad_norm_(MAX_NORM)
        theirs = torch.nn.utils.clip_grad_norm_(twin_model.parameters(), MAX_NORM)
        assert torch.equal(ours, theirs) and theirs > MAX_NORM
        model.sonar.step()
        model.sonar.zero_grad()
        twin.opt.step()
        twin.opt.zero_grad()
    assert_same_weights(model, twin_model)
    assert model.sonar.report()["deferred"]["kept_whole"] == []


def test_torchs_own_clip_under_the_deferred_schedule_is_refused():
    """It cannot see the expert gradients (they do not exist before step()): refused at step() before
    any weight moves, with Sonar's clip off, naming model.sonar.clip_grad_norm_."""
    model, _, _ = clip_off_pair("eager", torch.float32)
    model(**batches(1)[0]).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(sonar_fx.SonarUsageError, match=r"model\.sonar\.clip_grad_norm_\(max_norm\)"):
        model.sonar.step()
    assert moved(model, before) == []


def accelerate_loop(model: nn.Module, opt: torch.optim.Optimizer, clip: Callable[..., Any]) -> list[Any]:
    """accelerate's accumulation loop (2 micro-batches per step), clipping on the syncing micro-batch."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model, opt = accelerator.prepare(model, opt)
    norms = []
    for b in batches(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(**b).loss)
            if accelerator.sync_gradients:
                norms.append(clip(accelerator, model))
            opt.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize(("compiler", "dtype"), [("eager", torch.float32), ("aot_eager", torch.bfloat16)])
def test_accelerate_accumulation_with_sonars_clip_is_exact(compiler, dtype):
    model, twin_model, twin = clip_off_pair(compiler, dtype)
    ours = accelerate_loop(model, model.sonar, lambda acc, m: m.sonar.clip_grad_norm_(MAX_NORM))
    theirs = accelerate_loop(twin.run, twin.opt, lambda acc, m: acc.clip_grad_norm_(twin.all, MAX_NORM))
    assert len(ours) == 2 and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert_same_weights(model, twin_model)


def test_accelerates_own_clip_is_refused():
    model, _, _ = clip_off_pair("eager", torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(sonar_fx.SonarUsageError, match=r"accelerate's"):
        accelerate_loop(model, model.sonar, lambda acc, m: acc.clip_grad_norm_(m.parameters(), MAX_NORM))
    assert moved(model, before) == []


def test_sonar_clip_grad_norm_refusals():
    """Where it cannot be torch's clip: while Sonar clips itself, twice in a step, before another
    backward of the step, under a GradScaler (its norm would be of scaled expert gradients)."""
    a, b = batches(2)
    model, opt, _, _ = pair("eager", torch.float32, "all")
    model(**a).loss.backward()
    with pytest.raises(sonar_fx.SonarUsageError, match="clipped twice"):
        opt.clip_grad_norm_(MAX_NORM)
    model, _, _ = clip_off_pair("eager", torch.float32)
    opt, before = model.sonar, [p.detach().clone() for p in model.parameters()]
    model(**a).loss.backward()
    opt.clip_grad_norm_(MAX_NORM)
    with pytest.raises(sonar_fx.SonarUsageError, match="twice"):
        opt.clip_grad_norm_(MAX_NORM)
    model(**b).loss.backward()
    with pytest.raises(sonar_fx.SonarUsageError, match="a backward ran after"):
        opt.step()
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(**a).loss).backward()
    opt.clip_grad_norm_(MAX_NORM)
    with pytest.raises(sonar_fx.SonarUsageError, match="GradScaler"):
        scaler.step(opt)
    assert moved(model, before) == []
