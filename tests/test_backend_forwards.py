"""Forwards that `prepare` + `torch.compile(backend="sonar")` must keep running while it refuses two
forwards into one backward (`test_two_forwards_into_one_backward_under_torch_compile_are_refused`):
one graph run for several layers in one forward (regional compile), a forward under `torch.no_grad()`,
and checkpointed layers (transformers' activation checkpointing, traced into each layer's graph); each
trains bitwise as plain torch, compiled alike (aot_eager), stepping its experts after each backward."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_in_backward_fuzz import MAX_NORM, plain_loop

import sonar_fx
from sonar_fx.backend import sonar_backend
from sonar_fx.models import build_model

from fuzz_loops import Loop, run_program
from helpers import CFG

SONAR = sonar_backend("aot_eager", schedule=None)


@pytest.fixture(scope="module", autouse=True)
def one_dynamo_cache():
    torch._dynamo.reset()


def regional_loops(*, checkpointing: bool) -> tuple[Loop, Loop]:
    """Sonar's and plain torch's loops, each decoder layer compiled alone (one graph for both layers)."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    twin_model = copy.deepcopy(model)
    cfg = replace(CFG, max_grad_norm=MAX_NORM)
    opt = sonar_fx.prepare(model, cfg)
    for side, backend in ((model, SONAR), (twin_model, "aot_eager")):
        if checkpointing:
            side.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
            side.train()
        for layer in side.model.layers:
            layer.compile(backend=backend)
    sonar = Loop(model, model, opt.step, opt.zero_grad)
    plain = plain_loop(twin_model, "eager", {opt.expert_name(p) for p in opt.expert_group["params"]}, cfg)
    return sonar, plain


@pytest.mark.parametrize("checkpointing", [False, True], ids=["regional", "regional_checkpointed"])
def test_one_graph_for_every_layer_checkpointed_or_not_is_no_second_forward(checkpointing):
    """Both layers run one compiled graph in each forward (different expert tensors), checkpointed or
    not: no forward is refused, and both train exactly."""
    sonar, plain = regional_loops(checkpointing=checkpointing)
    ops = ["backward", "step", "backward"]
    assert run_program(0, ops, sonar, plain) == ("exact", None, None)
    # The habit itself is still refused on this route, before any weight moves (run_program checks).
    assert run_program(1, ["backward_of_two"], sonar, plain)[0] == "refused"


def test_a_forward_under_no_grad_begins_no_backward_to_wait_for():
    """An evaluation forward under `torch.no_grad()` (or inference mode) before a training forward is
    not a second forward: the step trains exactly."""
    sonar, plain = regional_loops(checkpointing=False)
    batch = {"input_ids": torch.randint(0, 259, (2, 8)), "labels": torch.randint(0, 259, (2, 8))}
    with torch.no_grad():
        sonar.run(**batch)
    with torch.inference_mode():
        sonar.run(**batch)
    assert run_program(0, ["backward", "step"], sonar, plain) == ("exact", None, None)
