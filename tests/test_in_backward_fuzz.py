"""A differential fuzzer of the in-backward schedule's loop contract: the random loop programs of
`fuzz_loops` on plain torch and on Sonar (schedule="in_backward", the default), bitwise after every
program or a `SonarUsageError` before any weight moves.

The twin is plain torch written here: `AdamW(fused=True)` over the experts, stepped after every
backward (each expert tensor by its own gradient, clipped alone under expert_clip="per_tensor"), and
`AdamW(fused=True)` over the dense tensors, clipped by their global norm and stepped at `step()`.
Arms: eager hooks, `sonar_fx.compile(..., compiler="aot_eager")` and `sonar_fx.prepare` then
`torch.compile` with the sonar backend (aot_eager), each with accumulation None (a second backward
into the experts before `step()` is refused) and "per_microbatch" (each backward updates them); and
an optimizer options arm (eager: `fuzz_loops.Options` and `OPTIMIZER_OPS`).
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

from fuzz_loops import (
    OPS,
    OPTIMIZER_OPS,
    Loop,
    Options,
    apply,
    program,
    repeats_a_step,
    run_program,
    seeds,
    sonar_warnings_quiet,
    step_lr,
)
from helpers import CFG, assert_same_weights, batches

MAX_NORM = 0.05  # below every backward's norm on this model: each clip is active
ROUTES = ["eager", "compile", "torch.compile"]

# The refusals the in-backward contract names (docs/failures.md), by the habit each names; anything
# else refused is a bug. Two forwards into one compiled backward and a weight read outside its
# compiled GEMM (a penalty on the expert weights) are refused by the compiled routes only.
REFUSED = {
    "second backward": "before optimizer.step(): this looks like gradient accumulation",
    "side backward": "before optimizer.step(): a side backward that reached the experts",
    "second step": "no backward since the last step",
    "two forwards, compiled": "a compiled module ran a second forward with gradients before any backward",
    "penalty, compiled": "through the compiled graph that updates them in-graph and from outside it",
    "LR set after backward": "the experts' param group changed between backward and step()",
    "mixed SGD momentum": "none yet, because some expert tensors stepped before the others",
}

# Two forwards into one backward and a penalty on the expert weights are refused there at once, on both
# compiled routes (documented): rarer, so programs go on (at the penalty's weight 0.75 or more, fewer
# than half of 150 soaked programs end exact). CI's seeds draw no penalty there: the tests at the end
# of this file do.
COMPILED_OPS = OPS | {"backward_of_two": 1, "penalty": 0.5}


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


def loops(
    route: str, accumulation: str | None, expert_clip: str | None, options: Options | None = None
) -> tuple[Loop, Loop]:
    """Sonar and plain torch; `options`: the optimizer (AdamW or SGD), weight-decay groups and
    granularity (default: AdamW, no groups, batched)."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    twin_model = copy.deepcopy(model)
    options = options or Options()
    cfg = options.config(replace(CFG, max_grad_norm=MAX_NORM, expert_clip=expert_clip), model)
    granularity = options.granularity
    if route == "torch.compile":
        opt = sonar_fx.prepare(model, cfg, accumulation=accumulation, granularity=granularity)
        run = torch.compile(model, backend=sonar_backend("aot_eager", schedule=None))
    else:
        compiler = "eager" if route == "eager" else "aot_eager"
        run = sonar_fx.compile(
            model, cfg, compiler=compiler, accumulation=accumulation, granularity=granularity
        )
        opt = model.sonar
    sonar = Loop(
        model, run, opt.step, opt.zero_grad, param_groups=opt.param_groups, schedulers=[step_lr(opt)]
    )
    names = {opt.expert_name(p) for p in opt.experts.params}  # every expert group, split by decay or not
    return sonar, plain_loop(twin_model, route, names, cfg, options)


def plain_loop(
    model: torch.nn.Module, route: str, expert_names: set[str], cfg, options: Options | None = None
) -> Loop:
    options = options or Options()  # AdamW, one expert group: what the arms without options run
    params = dict(model.named_parameters())
    experts = [p for n, p in params.items() if n in expert_names]
    dense = [p for n, p in params.items() if n not in expert_names]
    expert_opt = options.plain(model, [expert_names], cfg)
    dense_opt = options.plain(model, [set(params) - expert_names], cfg)

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

    def zero_grad(set_to_none: bool = True) -> None:
        dense_opt.zero_grad(set_to_none)
        expert_opt.zero_grad(set_to_none)

    run = model if route == "eager" else torch.compile(model, backend="aot_eager")
    both = (expert_opt, dense_opt)
    groups = [g for o in both for g in o.param_groups]
    loop = Loop(model, run, step, zero_grad, after_backward=after_backward, param_groups=groups)
    loop.schedulers = [step_lr(o) for o in both]
    return loop


def run(seed: int, route: str, accumulation: str | None) -> tuple[str, str | None]:
    rng = random.Random(seed)
    sonar, plain = loops(route, accumulation, rng.choice([None, "per_tensor"]))
    ops = {"eager": OPS, "compile": COMPILED_OPS, "torch.compile": COMPILED_OPS}[route]
    outcome, op, message = run_program(seed, program(rng, ops, rng.randint(5, 10)), sonar, plain)
    return verdict(seed, outcome, op, message)


def verdict(seed: int, outcome: str, op: str | None, message: str | None) -> tuple[str, str | None]:
    """(outcome, the habit a refusal names), having asserted that a refusal names one of `REFUSED`."""
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


def run_options(seed: int, accumulation: str | None) -> tuple[str, str | None, list[str]]:
    """An options arm's program (eager hooks): `OPTIMIZER_OPS` over the optimizer `Options` drawn;
    returns (outcome, the habit a refusal names, the ops run: the refused one last)."""
    rng = random.Random(seed)
    options = Options.draw(rng)
    sonar, plain = loops("eager", accumulation, rng.choice([None, "per_tensor"]), options)
    ops, ran = program(rng, OPTIMIZER_OPS, rng.randint(5, 10)), []
    return (*verdict(seed, *run_program(seed, ops, sonar, plain, ran=ran)), ran)


def test_optimizer_options_programs_are_bitwise_or_refused():
    """AdamW or SGD, weight-decay groups, per-expert updates, accumulation None and "per_microbatch" in
    turn; the LR set by hand and by a torch scheduler (refused between backward and step, where the
    experts already moved with the old LR), the optimizer's zero_grad(set_to_none=False), steps with no
    backward between them."""
    runs = [run_options(seed, (None, "per_microbatch")[seed % 2]) for seed in seeds(4)]
    assert [o for o, _, _ in runs].count("exact") >= len(runs) // 2, runs
    assert any(repeats_a_step(ops) for _, _, ops in runs), runs  # exact, or refused at the repeated step


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


@pytest.mark.parametrize("route", ["compile", "torch.compile"])
def test_a_penalty_on_compiled_experts_is_refused_before_they_move(route):
    """Found by the fuzzer (seeds 3 and 4 of the compile per_microbatch arm): a penalty on the expert
    weights (read outside their compiled GEMM) updated each expert in-graph from the GEMM's gradient
    alone, then the hook refused the penalty's part with every expert moved. Refused when the backward
    begins, naming the habit and its fixes; `run_program` asserts no weight moved (after a step too)."""
    outcome, op, message = run_program(
        0, ["backward", "step", "penalty"], *loops(route, "per_microbatch", None)
    )
    assert (outcome, op) == ("refused", "penalty")
    assert REFUSED["penalty, compiled"] in message and "4 expert tensor(s)" in message
    assert "penalty on the expert weights" in message and "weight_decay" in message
    assert "schedule='deferred'" in message and "compiler='eager'" in message


def test_after_a_refused_penalty_training_goes_on_exactly():
    """The refused backward moved nothing and spent its forward: the next backward and step train as plain
    torch without the refused one (the step's earlier backward kept, accumulation="per_microbatch");
    a penalty in a backward that leaves the experts out (`backward(inputs=dense)`) is not refused."""
    sonar, plain = loops("compile", "per_microbatch", None)
    data = batches(4, seq=8, seed=0)
    with sonar_warnings_quiet():
        for side in (sonar, plain):
            apply(side, "backward", [data[0]])
        with pytest.raises(sonar_fx.SonarUsageError, match="from outside it"):
            apply(sonar, "penalty", [data[1]])
        for side in (sonar, plain):
            apply(side, "backward", [data[2]])
            apply(side, "step", [])
            penalty = sum(w.float().pow(2).sum() for w in side.experts())
            side.backward(side.loss(data[3]) + 1e-3 * penalty, inputs=side.dense())
            apply(side, "step", [])
    assert_same_weights(sonar.model, plain.model)


def test_a_penalty_inside_the_compiled_forward_is_exact_and_updated_in_graph():
    """The fix the refusal names first: the same penalty computed inside the compiled forward is summed
    into the expert gradient by the graph before its update (in-graph, 2 steps bitwise to plain torch)."""

    class Penalised(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, **batch):
            experts = (p for n, p in self.model.named_parameters() if ".experts." in n)
            return self.model(**batch).loss + 1e-3 * sum(w.float().pow(2).sum() for w in experts)

    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    twin_model = copy.deepcopy(model)
    cfg = replace(CFG, max_grad_norm=MAX_NORM)
    penalised = sonar_fx.compile(Penalised(model), cfg, compiler="aot_eager")
    names = {penalised.sonar.expert_name(p) for p in penalised.sonar.expert_group["params"]}
    plain = plain_loop(Penalised(twin_model), "eager", names, cfg, Options())
    with sonar_warnings_quiet():
        for batch in batches(2, seq=8, seed=0):
            penalised(**batch).backward()
            penalised.sonar.step()
            penalised.sonar.zero_grad()
            plain.backward(plain.run(**batch))
            plain.step()
            plain.zero_grad()
    assert_same_weights(model, twin_model)
    assert penalised.sonar.report()["updates_in_graph"] == 8


def test_a_penalty_under_regional_compile_is_refused_before_any_block_moves():
    """Regional compile: one graph node per block, the model's own hook first (its outputs are computed
    outside the blocks). The penalty is refused there, after a backward of the same step, with no weight
    moved; the next backward updates every expert in-graph as usual."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    model.config.use_cache = False  # one graph for both blocks (regional=True would say it sets this)
    run = sonar_fx.compile(model, CFG, compiler="aot_eager", regional=True, accumulation="per_microbatch")
    data = batches(3, seq=8, seed=0)
    with sonar_warnings_quiet():
        run(**data[0]).loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        penalty = sum(p.square().sum() for p in model.sonar.expert_group["params"])
        with pytest.raises(sonar_fx.SonarUsageError, match=r"4 expert tensor\(s\).*from outside it"):
            (run(**data[1]).loss + penalty).backward()
        assert all(map(torch.equal, before, model.parameters()))
        run(**data[2]).loss.backward()
        model.sonar.step()
    assert model.sonar.report()["updates_in_graph"] == 8


# Seed 34 of the soaked options arm (per_microbatch), minimised: one expert tensor steps alone first.
ONE_EXPERT_FIRST = ["inputs_dense_and_expert", "backward"]


def test_bf16_sgd_experts_with_and_without_momentum_are_refused_before_they_move():
    """bf16 SGD with momentum: after a backward(inputs=) that stepped one expert tensor alone, a backward
    reaching every expert would step that one on torch's foreach path for a group whose tensors all
    hold a buffer, where torch's step over the group takes its per-tensor path (other bits). Refused
    when the backward reaches the first expert, naming the habit and the fixes; `run_program` asserts
    no weight moved and both sides agree."""
    sonar, plain = loops("eager", "per_microbatch", None, Options("sgd"))
    outcome, op, message = run_program(0, ONE_EXPERT_FIRST, sonar, plain)
    assert (outcome, op) == ("refused", "backward"), (outcome, op, message)
    assert REFUSED["mixed SGD momentum"] in message and "model.layers.0.mlp.experts" in message
    assert "backward(inputs=...)" in message and "fp32" in message and "momentum=0" in message


def test_negative_control_without_the_refusal_mixed_momentum_differs(monkeypatch):
    """The refusal guards a real difference: with it off, the program trains other bits than torch."""
    monkeypatch.setattr("sonar_fx.optim.optimizer.refuse_mixed_momentum", lambda *args: None)
    with pytest.raises(AssertionError, match=r"1 tensors differ, e\.g\. \['model\.layers\.0\.mlp\.experts"):
        run_program(0, ONE_EXPERT_FIRST, *loops("eager", "per_microbatch", None, Options("sgd")))
