"""A differential fuzzer of the deferred schedule's loop contract: random loop programs
(`fuzz_loops.OPS`: forwards, backwards of several forwards, `backward(inputs=)`, `autograd.grad`, a
penalty on the expert weights, zero_grad of either kind, a dense `.grad` dropped by hand, skipped and
repeated steps, accumulation) run on plain torch and on Sonar: bitwise after every program, or a
`SonarUsageError` before any weight moves (the weights then equal plain torch's before that operation).

Arms: eager and compiled (`sonar_fx.compile(..., compiler="aot_eager")`), fp32 and bf16, the clip of
Sonar's config (every parameter, or the dense ones) or the loop's own (`model.sonar.clip_grad_norm_`),
the keep budget 0 or everything; a GradScaler's loop (fp16 autocast,
fp32 weights, a scale that grows into overflow, so steps are skipped); nonfinite="skip" with an inf
in the loss or in one expert's gradient; the optimizer options arm (`fuzz_loops.Options`: AdamW or SGD,
weight-decay groups, per-expert updates; `OPTIMIZER_OPS`: the LR set by hand or by a scheduler, the
optimizer's zero_grad(set_to_none=False), repeated steps). Seeded (`SONAR_FX_FUZZ_PROGRAMS` soaks each
arm)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

import sonar_fx
from sonar_fx.models import build_model

from fuzz_loops import (
    GRADIENT_OPS,
    INF_OPS,
    OPS,
    OPTIMIZER_OPS,
    Loop,
    Options,
    program,
    repeats_a_step,
    run_program,
    seeds,
    step_lr,
)
from helpers import weights_differ
from test_deferred import MAX_NORM, Twin, cfg_for

# Tiny models with many tokens per step cross over, and a weight read outside its GEMM is kept whole:
# the saving is lost by design here (the guard's refusal has its own tests in test_saving_guard.py).
pytestmark = pytest.mark.usefixtures("deferred_saving_lost")

# The refusals the deferred contract names (docs/failures.md): a step with no zero_grad() since the
# last one, and an inf under nonfinite="raise" (never generated here). Anything else refused is a bug.
REFUSED = (
    "no zero_grad() since the last step()",
    "no backward since the last step",
    "none yet, because some expert tensors stepped before the others",  # `sgd.refuse_mixed_momentum`
)
SCALER = dict(init_scale=256.0, growth_factor=2.0**12, backoff_factor=2.0**-12, growth_interval=1)


def loops(
    compiler: str,
    dtype: torch.dtype,
    clip: str,
    *,
    scaled: bool = False,
    nonfinite: str = "raise",
    keep_budget: int = 0,
    options: Options | None = None,
) -> tuple[Loop, Loop]:
    """Sonar (schedule="deferred") and plain torch (`test_deferred.Twin`: AdamW(fused=True), one
    `clip_grad_norm_` over every parameter, or the dense ones), clipped by Sonar's config
    (`clip="all"`: expert_clip="global"; `clip="dense"`) or by the loop (`clip="user"`:
    `model.sonar.clip_grad_norm_`, Sonar's own clip off). `scaled`: each side's own GradScaler over fp16
    autocast. `nonfinite="skip"`: plain torch drops every gradient and steps nothing when one is not
    finite, as Sonar promises. `keep_budget`: bytes of expert gradients the norm pass may keep.
    `options`: the optimizer (AdamW or SGD), weight-decay groups and granularity, plain torch's
    optimizer built by `Options.plain` (default: AdamW, no groups, batched)."""
    model = build_model("tiny-olmoe", dtype=dtype, seed=0)
    twin_model = copy.deepcopy(model)
    cfg = cfg_for(clip) if clip != "user" else replace(cfg_for("all"), max_grad_norm=None, expert_clip=None)
    options = options or Options()
    cfg = options.config(replace(cfg, keep_budget=keep_budget), model)
    sonar_fx.compile(
        model,
        cfg,
        compiler=compiler,
        schedule="deferred",
        nonfinite=nonfinite,
        granularity=options.granularity,
    )
    opt = model.sonar
    names = {opt.expert_name(p) for p in opt.experts.params}  # every expert group, split by decay or not
    twin = Twin(twin_model, names, "dense" if clip == "dense" else "all", compiler)
    dense = {n for n, _ in twin_model.named_parameters()} - names
    twin.opt = options.plain(twin_model, [dense, names], cfg)
    autocast = torch.float16 if scaled else None
    ours = torch.amp.GradScaler("cpu", **SCALER) if scaled else None
    theirs = torch.amp.GradScaler("cpu", **SCALER) if scaled else None
    sonar = Loop(model, model, lambda: None, opt.zero_grad, autocast=autocast, scaler=ours)
    plain = Loop(twin_model, twin.run, lambda: None, twin.opt.zero_grad, autocast=autocast, scaler=theirs)
    for side, optimizer in ((sonar, opt), (plain, twin.opt)):
        side.param_groups, side.schedulers = optimizer.param_groups, [step_lr(optimizer)]

    def sonar_step() -> None:
        if clip == "user":
            sonar.norms.append(opt.clip_grad_norm_(MAX_NORM))
        if ours is None:
            opt.step()
        else:
            ours.step(opt)
            ours.update()

    def plain_step() -> None:
        if theirs is not None:
            theirs.unscale_(twin.opt)
        finite = all(p.grad is None or bool(p.grad.isfinite().all()) for p in twin.all)
        norm = torch.nn.utils.clip_grad_norm_(twin.dense if clip == "dense" else twin.all, MAX_NORM)
        if clip == "user":
            plain.norms.append(norm)
        if nonfinite == "skip" and not finite:  # as if the step's batches had never been seen
            for p in twin.all:
                p.grad = None
        elif theirs is None:
            twin.opt.step()
        else:
            theirs.step(twin.opt)
            theirs.update()

    sonar.step, plain.step = sonar_step, plain_step
    return sonar, plain


def run(seed: int, compiler: str, dtype: torch.dtype, *, scaled: bool = False, nonfinite: str = "raise"):
    rng = random.Random(seed)
    ops = {**OPS, **INF_OPS} if nonfinite == "skip" else OPS
    # The loop's clip under a scaler is refused (it would take the norm of scaled gradients).
    clip = rng.choice(["all", "dense"] if scaled else ["all", "dense", "user"])
    keep_budget = rng.choice([0, 1 << 30])  # every expert gradient the norm pass computes kept, or none
    sonar, plain = loops(compiler, dtype, clip, scaled=scaled, nonfinite=nonfinite, keep_budget=keep_budget)
    ops = program(rng, ops, rng.randint(5, 10))
    outcome, op, message = run_program(seed, with_gradients(ops) if scaled else ops, sonar, plain)
    assert outcome == "exact" or any(r in message for r in REFUSED), f"seed {seed}: refused {op}: {message}"
    return outcome


def with_gradients(ops: list[str]) -> list[str]:
    """A program less each step that would find no gradient at all: plain torch's GradScaler asserts
    ("No inf checks were recorded") where an unscaled loop's step does nothing."""
    kept, any_grad = [], False
    for op in ops:
        if op == "step" and not any_grad:
            continue
        any_grad = op in GRADIENT_OPS or (any_grad and op not in ("optimizer_zero_grad", "model_zero_grad"))
        kept.append(op)
    return kept


def run_options(seed: int, dtype: torch.dtype) -> tuple[str, str | None, list[str]]:
    """An options arm's program (eager): `OPTIMIZER_OPS` over the optimizer `Options` drawn per seed;
    returns (outcome, the `REFUSED` text a refusal names, the ops run: the refused one last)."""
    rng = random.Random(seed)
    options = Options.draw(rng)
    clip, keep_budget = rng.choice(["all", "dense", "user"]), rng.choice([0, 1 << 30])
    sonar, plain = loops("eager", dtype, clip, keep_budget=keep_budget, options=options)
    ops, ran = program(rng, OPTIMIZER_OPS, rng.randint(5, 10)), []
    outcome, op, message = run_program(seed, ops, sonar, plain, ran=ran)
    named = next((r for r in REFUSED if message is not None and r in message), None)
    assert outcome == "exact" or named is not None, f"seed {seed}: {options}: refused {op}: {message}"
    return outcome, named, ran


def both_outcomes(outcomes: list[str]) -> None:
    """Both verdicts occur over a CI run's seeds (a soak's too): neither path is left untested."""
    assert outcomes.count("exact") >= len(outcomes) // 2 and "refused" in outcomes, outcomes


@pytest.fixture(scope="module", autouse=True)
def one_dynamo_cache():
    """Dynamo reuses each arm's graph for every fresh model of the class (binding is at run time), so
    each compiled arm compiles once for all its programs."""
    torch._dynamo.reset()


# Each compiled arm's first program compiles (seconds on a loaded machine); CI runs one compiled arm
# of each kind, the others are slow (run with `-m slow`, or soaked).
COMPILED_FP32 = pytest.param("aot_eager", marks=pytest.mark.slow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_programs_are_bitwise_or_refused(dtype):
    both_outcomes([run(seed, "eager", dtype) for seed in seeds(16)])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_compiled_programs_are_bitwise_or_refused(dtype):
    both_outcomes([run(seed, "aot_eager", dtype) for seed in seeds(6)])


@pytest.mark.parametrize("compiler", ["eager", COMPILED_FP32])
def test_grad_scaler_programs_are_bitwise_or_refused(compiler):
    both_outcomes([run(seed, compiler, torch.float32, scaled=True) for seed in seeds(6)])


@pytest.mark.parametrize("compiler", ["eager", COMPILED_FP32])
def test_nonfinite_skip_programs_with_an_inf_are_bitwise_or_refused(compiler):
    both_outcomes([run(seed, compiler, torch.float32, nonfinite="skip") for seed in seeds(8)])


def test_optimizer_options_programs_are_bitwise_or_refused():
    """AdamW or SGD, weight-decay groups, per-expert updates, fp32 and bf16 in turn; the LR set by hand
    and by a torch scheduler, the optimizer's zero_grad(set_to_none=False) (each in some exact
    program), steps with no backward between them."""
    runs = [run_options(seed, (torch.float32, torch.bfloat16)[seed % 2]) for seed in seeds(6)]
    both_outcomes([outcome for outcome, _, _ in runs])
    ran = [ops for _, _, ops in runs]
    assert any(map(repeats_a_step, ran)), ran  # exact, or refused at the repeated step
    drawn = {op for outcome, _, ops in runs if outcome == "exact" for op in ops}
    assert {"set_lr", "scheduler_step", "optimizer_zero_grad_keep"} <= drawn, runs


def test_grad_scaler_optimizer_options_programs_are_bitwise_or_refused():
    """The options arm under a GradScaler (fp16 autocast, fp32 weights, a scale that overflows): the
    scaler's skipped steps meet the LR ops, SGD and the weight-decay groups."""
    outcomes = []
    for seed in seeds(6):
        rng = random.Random(seed)
        options, clip, keep_budget = Options.draw(rng), rng.choice(["all", "dense"]), rng.choice([0, 1 << 30])
        sonar, plain = loops(
            "eager", torch.float32, clip, scaled=True, keep_budget=keep_budget, options=options
        )
        ops = with_gradients(program(rng, OPTIMIZER_OPS, rng.randint(5, 10)))
        outcome, op, message = run_program(seed, ops, sonar, plain)
        assert outcome == "exact" or any(r in message for r in REFUSED), (
            f"seed {seed}: refused {op}: {message}"
        )
        outcomes.append(outcome)
    both_outcomes(outcomes)


# ---------------------------------------------------------------- what the fuzzer found, minimised

ZEROS_THEN_STEP = ["backward", "model_zero_grad_keep", "step"]


@pytest.mark.parametrize("clip", ["all", "user"])
def test_the_step_applies_the_zeros_that_zero_grad_keeps(clip):
    """`model.zero_grad(set_to_none=False)` then `step()` (seed 5 of the nonfinite="skip" arm): plain
    torch steps every tensor with a zero gradient (AdamW's moments and weight decay move it). The
    deferred schedule dropped the kept expert gradients instead: with the loop's clip the experts did
    not step (4 tensors differed), with Sonar's the zeroed dense gradients were refused as a clip of
    the user's own."""
    assert run_program(0, ZEROS_THEN_STEP, *loops("eager", torch.float32, clip))[0] == "exact"


def test_negative_control_a_step_of_zero_gradients_moves_every_weight():
    """The zeros' step is no no-op (fp32: AdamW's weight decay moves every tensor): dropping the
    experts' zeros differs."""
    sonar, plain = loops("eager", torch.float32, "user")
    run_program(0, ZEROS_THEN_STEP, sonar, plain)
    untouched = loops("eager", torch.float32, "user")[1].model
    assert set(weights_differ(plain.model, untouched)) == {n for n, _ in plain.model.named_parameters()}


def test_the_zeros_kept_after_a_step_are_applied_by_the_next_step():
    """Seed 145 of the soak's nonfinite="skip" arms (eager and aot_eager), minimised: after a step torch
    still holds the experts' gradients, which zero_grad(set_to_none=False) makes zeros that the next
    step applies; the deferred step had freed them (the experts did not step: 4 tensors differed)."""
    program = ["backward", "step", "model_zero_grad_keep", "step"]
    assert run_program(0, program, *loops("eager", torch.float32, "dense"))[0] == "exact"


# A step the GradScaler skips: the scale (2**20 after one step) overflows fp16 in every gradient, so the
# scaler never calls step(); or one expert's gradient is inf, the dense ones finite, so Sonar's step
# finds it in its first pass and skips.
SKIPPED_STEPS = {
    "scale overflows": ["backward", "step"],
    "one expert's inf": ["inf_expert", "step"],
}


@pytest.mark.parametrize(
    ("skipped", "zero_grad"),
    [(skipped, "optimizer_zero_grad_keep") for skipped in SKIPPED_STEPS]
    + [("scale overflows", "model_zero_grad_keep")],
)
def test_after_a_skipped_step_the_zeros_that_zero_grad_keeps_step_every_tensor(skipped, zero_grad):
    """A step the scaler skips, then zero_grad(set_to_none=False), then a step: plain torch keeps the
    skipped step's gradients, zeroes them and steps every tensor with a zero gradient (AdamW's decay and
    moments move it). Sonar's deferred step applies the experts' zeros too, exactly; checked here that
    the step was skipped (no weight moved, the scale backed off) and that the last step moved every
    tensor on both sides (an expert left unstepped would differ)."""
    sonar, plain = loops("eager", torch.float32, "all", scaled=True)
    assert run_program(0, ["backward", "step", "optimizer_zero_grad"], sonar, plain)[0] == "exact"
    before = copy.deepcopy(plain.model)
    assert run_program(1, SKIPPED_STEPS[skipped], sonar, plain)[0] == "exact"
    assert weights_differ(plain.model, before) == [] and sonar.scaler.get_scale() == 256.0
    assert run_program(2, [zero_grad, "step"], sonar, plain)[0] == "exact"
    every = {n for n, _ in plain.model.named_parameters()}
    assert set(weights_differ(plain.model, before)) == every == set(weights_differ(sonar.model, before))


ONE_EXPERT_FIRST = ["inputs_dense_and_expert", "step", "optimizer_zero_grad", "backward", "step"]


def test_bf16_sgd_experts_with_and_without_momentum_are_refused_at_the_step():
    """bf16 SGD with momentum (torch's foreach path): one expert tensor stepped alone first, then every
    expert: refused at the step, before any weight moves (torch's step over the expert group takes its
    per-tensor path where Sonar's own update of that tensor would not). In fp32 torch's fused SGD
    raises on such a group; Sonar's steps its tensors with and without a buffer in two calls."""
    sonar, plain = loops("eager", torch.bfloat16, "dense", options=Options("sgd"))
    outcome, op, message = run_program(0, ONE_EXPERT_FIRST, sonar, plain)
    assert (outcome, op) == ("refused", "step") and REFUSED[2] in message, (outcome, op, message)


def test_negative_control_deferred_mixed_momentum_differs_without_the_refusal(monkeypatch):
    monkeypatch.setattr("sonar_fx.optim.optimizer.refuse_mixed_momentum", lambda *args: None)
    with pytest.raises(AssertionError, match=r"tensors differ"):
        run_program(0, ONE_EXPERT_FIRST, *loops("eager", torch.bfloat16, "dense", options=Options("sgd")))
