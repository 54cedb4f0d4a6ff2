"""A differential fuzzer of the in-backward schedule's loop contract: the random loop programs of
`fuzz_loops` on plain torch and on Sonar (schedule="in_backward", the default), bitwise after every
program or a `SonarUsageError` before any weight moves.

The twin is plain torch written here: `AdamW(fused=True)` over the experts, stepped after every
backward (each expert tensor by its own gradient, clipped alone under expert_clip="per_tensor"), and
`AdamW(fused=True)` over the dense tensors, clipped by their global norm and stepped at `step()`.
Arms: eager hooks, `sonar_fx.compile(..., compiler="aot_eager")` and `sonar_fx.prepare` then
`torch.compile` with the sonar backend (aot_eager), each with accumulation None (a second backward
into the experts before `step()` is refused) and "per_microbatch" (each backward updates them).
Seeded (`SONAR_FX_FUZZ_PROGRAMS` soaks each arm)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

import sonar_fx
from sonar_fx.backend import sonar_backend
from sonar_fx.models import build_model
from sonar_fx.optim.saving import ON_SAVING_LOST_ENV

from fuzz_loops import OPS, Loop, program, run_program, seeds
from helpers import CFG

MAX_NORM = 0.05  # below every backward's norm on this model: each clip is active
ROUTES = ["eager", "compile", "torch.compile"]

# The refusals the in-backward contract names (docs/failures.md), by the habit each names; anything
# else refused is a bug. Two forwards into one compiled backward and a weight read outside its
# compiled GEMM are refused by the compiled routes only.
REFUSED = {
    "second backward": "before optimizer.step(): this looks like gradient accumulation",
    "side backward": "before optimizer.step(): a side backward that reached the experts",
    "second step": "no backward since the last step",
    "two forwards, compiled": "a compiled module ran a second forward with gradients before any backward",
}

# A penalty on the expert weights under a compiled route moves every expert by its in-graph gradient
# alone, then refuses the penalty's part (`test_a_penalty_on_compiled_experts_is_refused_before_they_move`,
# a known bug): left out of the compiled routes' programs until it is fixed.
# Two forwards into one backward are refused there at once, on both compiled routes (documented): rarer,
# so programs go on.
COMPILED_OPS = {op: weight for op, weight in OPS.items() if op != "penalty"} | {"backward_of_two": 1}


@pytest.fixture(autouse=True)
def saving_guard_warns(monkeypatch):
    """A penalty on the expert weights returns their gradient from the compiled graph (no saving):
    the suite's "raise" would refuse it at the step (tests/test_saving_guard.py tests that refusal)."""
    monkeypatch.setenv(ON_SAVING_LOST_ENV, "warn")


@pytest.fixture(scope="module", autouse=True)
def one_dynamo_cache():
    """Dynamo reuses a route's graph for every fresh model of the class (binding is at run time): each
    compiled arm compiles once for all its programs."""
    torch._dynamo.reset()


def loops(route: str, accumulation: str | None, expert_clip: str | None) -> tuple[Loop, Loop]:
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    twin_model = copy.deepcopy(model)
    cfg = replace(CFG, max_grad_norm=MAX_NORM, expert_clip=expert_clip)
    if route == "torch.compile":
        opt = sonar_fx.prepare(model, cfg, accumulation=accumulation)
        run = torch.compile(model, backend=sonar_backend("aot_eager", schedule=None))
    else:
        compiler = "eager" if route == "eager" else "aot_eager"
        run = sonar_fx.compile(model, cfg, compiler=compiler, accumulation=accumulation)
        opt = model.sonar
    sonar = Loop(model, run, opt.step, opt.zero_grad)
    return sonar, plain_loop(twin_model, route, {opt.expert_name(p) for p in opt.expert_group["params"]}, cfg)


def plain_loop(model: torch.nn.Module, route: str, expert_names: set[str], cfg) -> Loop:
    params = dict(model.named_parameters())
    experts = [p for n, p in params.items() if n in expert_names]
    dense = [p for n, p in params.items() if n not in expert_names]
    hyper = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
    expert_opt, dense_opt = torch.optim.AdamW(experts, **hyper), torch.optim.AdamW(dense, **hyper)

    def after_backward() -> None:  # the expert update Sonar runs inside that backward
        if cfg.expert_clip == "per_tensor":
            for p in experts:
                if p.grad is not None:
                    torch.nn.utils.clip_grad_norm_([p], MAX_NORM)
        expert_opt.step()
        expert_opt.zero_grad()

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(dense, MAX_NORM)
        dense_opt.step()

    def zero_grad() -> None:
        dense_opt.zero_grad()
        expert_opt.zero_grad()

    run = model if route == "eager" else torch.compile(model, backend="aot_eager")
    return Loop(model, run, step, zero_grad, after_backward=after_backward)


def run(seed: int, route: str, accumulation: str | None) -> tuple[str, str | None]:
    rng = random.Random(seed)
    sonar, plain = loops(route, accumulation, rng.choice([None, "per_tensor"]))
    ops = {"eager": OPS, "compile": COMPILED_OPS, "torch.compile": COMPILED_OPS}[route]
    outcome, op, message = run_program(seed, program(rng, ops, rng.randint(5, 10)), sonar, plain)
    if outcome == "refused":
        habit = next((h for h, text in REFUSED.items() if text in message), None)
        assert habit is not None, f"seed {seed}: refused {op}: {message}"
        return outcome, habit
    return outcome, None


@pytest.mark.parametrize("route", ROUTES)
def test_per_microbatch_programs_are_bitwise_or_refused(route):
    """accumulation="per_microbatch": every backward updates the experts; no backward is refused."""
    outcomes = [run(seed, route, "per_microbatch") for seed in seeds(6)]
    assert [o for o, _ in outcomes].count("exact") >= len(outcomes) // 2, outcomes
    assert not {h for _, h in outcomes} & {"second backward", "side backward"}, outcomes


@pytest.mark.parametrize("route", ROUTES)  # the compiled routes reuse the graphs of the tests above
def test_one_backward_per_step_programs_are_bitwise_or_refused(route):
    """accumulation=None: the second backward into the experts before `step()` is refused."""
    outcomes = [run(seed, route, None) for seed in seeds(6)]
    assert any(o == "exact" for o, _ in outcomes) and any(o == "refused" for o, _ in outcomes), outcomes


# ---------------------------------------------------------------- what the fuzzer found, minimised


def test_zeros_that_zero_grad_keeps_are_stepped_not_read_as_a_clip():
    """`model.zero_grad(set_to_none=False)` then `step()`: plain torch steps the dense tensors with
    zero gradients; Sonar read the zeroed gradients as a clip of the user's own and refused the step,
    naming a clip nobody ran."""
    program = ["backward", "model_zero_grad_keep", "step"]
    assert run_program(0, program, *loops("eager", None, None))[0] == "exact"


@pytest.mark.parametrize("accumulation", [None, "per_microbatch"])
def test_two_forwards_into_one_backward_under_torch_compile_are_refused(accumulation):
    """Found by the fuzzer (seeds 2 and 10 of the torch.compile per_microbatch arm): under
    `sonar_fx.prepare` + `torch.compile(backend="sonar")` the first graph's backward updated every
    expert in-graph, then torch raised "modified by an inplace operation" for the second: weights moved.
    Now refused at the second forward, with the wrapper's message, before any weight moves (`run_program`
    asserts no parameter moved and both sides still agree); a step first, then the same habit."""
    sonar, plain = loops("torch.compile", accumulation, None)
    outcome, op, message = run_program(0, ["backward", "step", "backward_of_two"], sonar, plain)
    assert (outcome, op) == ("refused", "backward_of_two"), (outcome, op, message)
    assert REFUSED["two forwards, compiled"] in message and "schedule='deferred'" in message, message
    # Told once, as the wrapper: the forward after the refused one starts afresh and trains exactly.
    assert run_program(1, ["backward", "step"], sonar, plain)[0] == "exact"


@pytest.mark.xfail(
    strict=True,
    reason="known bug (fuzzer, seeds 3 and 4 of the compile per_microbatch arm): under a compiled "
    "in-backward route a penalty on the expert weights (a read outside their compiled GEMM) updates "
    "each expert in-graph from the GEMM's gradient alone, then the penalty's part reaches the hook, "
    "which raises 'received two gradients in one backward': every expert moved before the refusal",
    raises=AssertionError,
)
def test_a_penalty_on_compiled_experts_is_refused_before_they_move():
    run_program(0, ["penalty", "step"], *loops("compile", "per_microbatch", None))
