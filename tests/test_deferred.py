"""The deferred schedule: exact end-of-step semantics (all-parameter clip, accumulation, GradScaler)
against plain torch written here, with expert gradients computed at step() from kept operands.

The twin is plain torch: `AdamW(fused=True)` over [dense, experts] groups, `clip_grad_norm_` over every
parameter (or the dense ones), `torch.amp.GradScaler`. Every comparison is `torch.equal` on every
parameter after 3 steps with the clip active on each step (the norm is checked to exceed it).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

import sonar_fx
from sonar_fx.errors import SonarUsageError
from sonar_fx.models import build_model
from sonar_fx.models.tiny import enable_activation_checkpointing

from helpers import CFG, assert_same_weights, batches, known_library_failure

MAX_NORM = 0.05  # below every step's total norm on these models: the clip is active on each step


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: earlier tests' graphs of the same class would count toward
    dynamo's recompile limit (8 per code object) and send later compiles to eager."""
    torch._dynamo.reset()


def crossover_warned():
    """The crossover's warning, expected at the first step of a run that crosses over (said once)."""
    return pytest.warns(UserWarning, match=r"kept operands outgrew them")


def cfg_for(clip: str) -> sonar_fx.AdamWConfig:
    return replace(CFG, max_grad_norm=MAX_NORM, expert_clip="global" if clip == "all" else None)


class Twin:
    """Plain torch for the same model: fused AdamW over [dense, experts], clip over `clip`."""

    def __init__(self, model: torch.nn.Module, expert_names: set[str], clip: str, compiler: str) -> None:
        params = dict(model.named_parameters())
        self.dense = [p for n, p in params.items() if n not in expert_names]
        self.all = list(params.values())
        self.clip = clip
        experts = [p for n, p in params.items() if n in expert_names]
        self.opt = torch.optim.AdamW(
            [dict(params=self.dense), dict(params=experts)],
            lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, weight_decay=CFG.weight_decay, fused=True,
        )  # fmt: skip
        self.run = model if compiler == "eager" else torch.compile(model, backend=compiler)

    def clip_(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.all if self.clip == "all" else self.dense, MAX_NORM)

    def scaler_step(self, scaler: torch.amp.GradScaler) -> None:
        """The plain loop's step under a GradScaler: unscale, clip, step (or skip), update, zero_grad."""
        scaler.unscale_(self.opt)
        self.clip_()
        scaler.step(self.opt)
        scaler.update()
        self.opt.zero_grad()

    def step(self) -> None:
        self.clip_()
        self.opt.step()
        self.opt.zero_grad()


def pair(compiler: str, dtype: torch.dtype, clip: str, model_name: str = "tiny-olmoe", **options):
    model = build_model(model_name, dtype=dtype, seed=0)
    twin_model = copy.deepcopy(model)
    sonar_fx.compile(model, cfg_for(clip), compiler=compiler, schedule="deferred", **options)
    opt = model.sonar
    names = {opt.expert_name(p) for p in opt.expert_group["params"]}
    return model, opt, twin_model, Twin(twin_model, names, clip, compiler)


def run_steps(model, opt, twin: Twin, accum: int, steps: int = 3) -> list[float]:
    totals = []
    data = batches(steps * accum)
    for s in range(steps):
        for b in data[s * accum : (s + 1) * accum]:
            model(**b).loss.backward()  # a plain loop: no closure, no declared accumulation count
            twin.run(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        twin.step()
        norms = opt.grad_norms()
        totals.append(norms["total"] if norms["total"] is not None else norms["dense"])
    return totals


CASES = [(1, "all"), (4, "all"), (4, "dense")]


@pytest.mark.parametrize(("accum", "clip"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches cross over
def test_eager_deferred_is_plain_torch(dtype, accum, clip):
    model, opt, twin_model, twin = pair("eager", dtype, clip)
    totals = run_steps(model, opt, twin, accum)
    assert all(t > MAX_NORM for t in totals), totals  # the clip was active on every step
    assert_same_weights(model, twin_model)
    deferred = opt.report()["deferred"]
    assert deferred["kept_whole"] == [], deferred  # every expert gradient came from kept operands
    assert opt.report()["updates_deferred"] == 12


# Compiles cost seconds each: every case in bf16 (transformers' grouped_mm under compile), and fp32
# (its fallback op, whose producer also computes the input gradient) on the accumulated global clip.
COMPILED_CASES = [(torch.bfloat16, a, c) for a, c in CASES] + [
    pytest.param(torch.float32, 4, "all", marks=known_library_failure(grouped_mm_compiled=torch.float32))
]


@pytest.mark.parametrize(("dtype", "accum", "clip"), COMPILED_CASES)
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches cross over
def test_aot_eager_deferred_is_plain_torch(dtype, accum, clip):
    counters.clear()
    model, opt, twin_model, twin = pair("aot_eager", dtype, clip)
    totals = run_steps(model, opt, twin, accum)
    assert all(t > MAX_NORM for t in totals), totals
    assert_same_weights(model, twin_model)
    assert counters["sonar"]["deferred"] == 4  # every expert output rewritten in the one graph
    assert opt.report()["deferred"]["kept_whole"] == []
    assert opt.report()["updates_deferred"] == 12


def test_negative_control_dense_only_twin_differs():
    """The all-parameter twin is not trivially equal: clipping only the dense gradients differs."""
    model, opt, twin_model, _ = pair("eager", torch.float32, "all")
    names = {opt.expert_name(p) for p in opt.expert_group["params"]}
    run_steps(model, opt, Twin(twin_model, names, "dense", "eager"), accum=1)
    pa, pb = dict(model.named_parameters()), dict(twin_model.named_parameters())
    assert [n for n in pa if not torch.equal(pa[n], pb[n])]


@pytest.mark.parametrize(
    "compiler",
    ["eager", pytest.param("aot_eager", marks=known_library_failure(grouped_mm_compiled=torch.float32))],
)
def test_grad_scaler_fp16_autocast_with_overflowing_steps(compiler):
    """fp16 CPU autocast, fp32 weights, the ordinary scaler loop: a scale that grows into overflow
    every other step, so steps are skipped and the scale backs off exactly as in plain torch."""
    model, opt, twin_model, twin = pair(compiler, torch.float32, "all")
    kw = dict(init_scale=256.0, growth_factor=2.0**12, backoff_factor=2.0**-12, growth_interval=1)
    ours, theirs = torch.amp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    scales = []
    for b in batches(5):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**b).loss
        ours.scale(loss).backward()
        ours.step(opt)
        ours.update()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = twin.run(**b).loss
        theirs.scale(loss).backward()
        twin.scaler_step(theirs)
        scales.append((ours.get_scale(), theirs.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert len({s for s, _ in scales}) > 1  # some steps overflowed and some stepped
    assert_same_weights(model, twin_model)


def test_grad_scaler_with_crossed_over_gradients_unscales_them_once():
    """Past the crossover an expert gradient sits in `.grad`, where the scaler itself unscales and checks
    it: the deferred step must not unscale it a second time (it did: 1/scale^2). The crossover loses
    the saving: warned (tests/test_saving_guard.py checks the warning and the refusal)."""
    model, opt, twin_model, twin = pair("eager", torch.float32, "all", on_saving_lost="warn")
    ours, theirs = (
        torch.amp.GradScaler("cpu", init_scale=2.0**8),
        torch.amp.GradScaler("cpu", init_scale=2.0**8),
    )
    big = batches(6, batch=4, seq=64)
    for s in range(2):
        for b in big[3 * s : 3 * s + 3]:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**b).loss
            ours.scale(loss).backward()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = twin.run(**b).loss
            theirs.scale(loss).backward()
        with crossover_warned() if s == 0 else contextlib.nullcontext():
            ours.step(opt)
        ours.update()
        opt.zero_grad()
        twin.scaler_step(theirs)
    assert opt.report()["deferred"]["crossed_over"], "no tensor crossed over"
    assert ours.get_scale() == theirs.get_scale()
    assert_same_weights(model, twin_model)


def test_an_inf_only_in_an_expert_gradient_skips_the_step_and_backs_off():
    """The scaler's own check sees only dense gradients; an inf in a deferred expert gradient must
    reach its verdict: no weight or state moves, and update() backs off."""
    model, opt, _, _ = pair("eager", torch.float32, "dense")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler.scale(model(**batches(1)[0]).loss).backward()
    kept = opt.deferred.entries()[0]
    kept.operands[1].fill_(float("inf"))  # dy of one expert GEMM
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not opt.state


def test_compiled_model_called_twice_before_one_backward():
    """Two forwards, one backward (DPO's chosen and rejected): each call keeps its operands."""
    model, opt, twin_model, twin = pair("aot_eager", torch.bfloat16, "all")
    data = batches(6)
    for s in range(3):
        a, b = data[2 * s], data[2 * s + 1]
        (model(**a).loss + model(**b).loss).backward()
        (twin.run(**a).loss + twin.run(**b).loss).backward()
        opt.step()
        opt.zero_grad()
        twin.step()
    assert_same_weights(model, twin_model)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_expert_gradients_never_pile_up(compiler):
    """After 2 backwards no expert gradient exists, the kept operands are below the expert gradients,
    and at step() at most one expert tensor's gradients are alive at a time (its two micro-batches'
    pieces while they are summed: the sum is the running total plus one piece)."""
    model, opt, _, _ = pair(compiler, torch.bfloat16, "all")
    for b in batches(2):
        model(**b).loss.backward()
    assert opt.report()["deferred"]["crossed_over"] == {}
    experts = opt.expert_group["params"]
    assert all(p.grad is None for p in experts)
    kept = opt.deferred.live_bytes
    grad_bytes = sum(p.numel() * p.element_size() for p in experts)
    assert 0 < kept < grad_bytes
    opt.step()
    report = opt.report()
    assert report["deferred"]["kept_operand_peak"] == kept
    assert report["deferred"]["kept_operand_bytes"] == 0
    biggest = max(p.numel() * p.element_size() for p in experts)
    assert report["expert_grad_bytes"]["measured_peak"] == 2 * biggest


def test_a_loop_holding_its_loss_through_step_keeps_no_operand(monkeypatch):
    """`loss` alive through step() (a plain loop logs it after the step) keeps the backward graph's
    nodes alive; the kept operands must not live on with them: each is freed once step() consumed it."""
    model, opt, _, _ = pair("eager", torch.bfloat16, "all")
    kept: list[weakref.ref] = []
    defer = type(opt).defer_expert_

    def watched(self, param, recipe, operands):
        kept.extend(weakref.ref(t) for t in operands)
        return defer(self, param, recipe, operands)

    monkeypatch.setattr(type(opt), "defer_expert_", watched)
    loss = model(**batches(1)[0]).loss
    loss.backward()
    opt.step()
    assert kept and loss.grad_fn is not None  # the graph is alive...
    assert [r for r in kept if r() is not None] == []  # ...and holds no operand


def test_gradient_checkpointing_recomputes_the_capture_and_stays_exact():
    """Under activation checkpointing the experts' forward runs again in backward; the operands kept
    are the recomputed ones, and two micro-batches still train as plain torch does."""
    model, opt, twin_model, twin = pair("eager", torch.float32, "all")
    for m in (model, twin_model):
        assert enable_activation_checkpointing(m, {"use_reentrant": False})
    run_steps(model, opt, twin, accum=2)
    assert opt.deferred.last_peak_bytes > 0 and opt.report()["deferred"]["kept_whole"] == []
    assert_same_weights(model, twin_model)


def test_crossover_keeps_the_gradient_once_operands_outgrow_it():
    """Many tokens per step: operands beyond a tensor's gradient size cross over to a kept gradient,
    accumulated as autograd does; still exact, and reported (and warned: the saving is lost)."""
    model, opt, twin_model, twin = pair("eager", torch.float32, "all", on_saving_lost="warn")
    big = batches(6, batch=4, seq=64)
    for s in range(2):
        for b in big[3 * s : 3 * s + 3]:
            model(**b).loss.backward()
            twin.run(**b).loss.backward()
        with crossover_warned() if s == 0 else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
        twin.step()
    assert_same_weights(model, twin_model)
    crossed = opt.report()["deferred"]["crossed_over"]
    assert crossed, "no tensor crossed over"
    for p in opt.expert_group["params"]:
        name = opt.expert_name(p)
        if name in crossed:
            assert crossed[name] > p.numel() * p.element_size()


def test_deferred_refusals():
    model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    with pytest.raises(SonarUsageError, match="accumulates exactly"):
        sonar_fx.prepare(model, CFG, schedule="deferred", accumulation="per_microbatch")
    with pytest.raises(ValueError, match="schedule="):
        sonar_fx.prepare(build_model("tiny-olmoe", dtype=torch.float32, seed=0), CFG, schedule="later")
    gap = sonar_fx.api.distributed_gap(CFG, "ddp-async", "deferred")
    assert gap is not None and gap[0] == "schedule" and "ddp-async" in gap[1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_deferred_equals_inductor_twin(dtype):
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # inductor's CPU embedding backward accumulates in parallel
    try:
        model, opt, twin_model, twin = pair("inductor", dtype, "all")
        run_steps(model, opt, twin, accum=2)
        assert_same_weights(model, twin_model)
        report = opt.report()  # caches stay on: the graph may come from an earlier process's compile
        assert report["graphs_compiled"] + report["graphs_from_cache"] == 1, report
        assert report["updates_deferred"] == 12 and report["deferred"]["kept_whole"] == []
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_nonfinite_skip_is_as_if_the_batch_was_never_seen():
    """nonfinite="skip": an inf in one expert's gradient skips the whole step before any weight or
    state moves (the in-backward schedule has already updated the tensors before it by then)."""
    model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    sonar_fx.compile(model, cfg_for("dense"), compiler="eager", schedule="deferred", nonfinite="skip")
    opt = model.sonar
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**batches(1)[0]).loss.backward()
    entries = opt.deferred.entries()
    entries[-1].operands[1].fill_(float("nan"))  # the last expert tensor's dy
    with pytest.warns(UserWarning, match="step skipped"):
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not opt.state and opt.report()["skipped_steps"] == 1


def test_in_backward_compiled_refuses_a_second_forward_before_backward():
    """The in-backward schedule under compile cannot run two forwards into one backward: refused at
    the second forward, before any weight moves, naming the deferred schedule."""
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    sonar_fx.compile(model, cfg_for("dense"), compiler="aot_eager")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    a, b = batches(2)
    model(**a)
    with pytest.raises(SonarUsageError, match="schedule='deferred'"):
        model(**b)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt = model.sonar
    model(**a).loss.backward()  # one forward per backward still trains
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(**a)
    model(**b).loss.backward()
    opt.step()


def test_models_of_one_class_with_both_schedules_in_one_process():
    """Dynamo reuses a graph across models of one class: the in-backward and the deferred model each
    get their own backend, so each runs its own pass (both exact against their twins)."""
    for clip in ("dense", "all"):
        model, opt, twin_model, twin = pair("aot_eager", torch.bfloat16, clip)
        plain = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
        plain_twin = copy.deepcopy(plain)
        sonar_fx.compile(plain, cfg_for("dense"), compiler="aot_eager")
        names = {plain.sonar.expert_name(p) for p in plain.sonar.expert_group["params"]}
        ptwin = Twin(plain_twin, names, "dense", "aot_eager")
        for b in batches(3):
            for m, o, t in ((model, opt, twin), (plain, plain.sonar, ptwin)):
                m(**b).loss.backward()
                o.step()
                o.zero_grad()
                t.run(**b).loss.backward()
                t.step()
        assert_same_weights(model, twin_model)
        assert_same_weights(plain, plain_twin)
        assert opt.report()["updates_deferred"] == 12 and plain.sonar.report()["updates_in_graph"] == 12


def test_cast_after_training_started_is_refused_before_any_weight_moves():
    """The in-backward schedule's check (tests/test_runtime_lifetimes.py), at the deferred step(): the
    state made in fp32, the model cast to bf16, is refused before the dense step or any expert moves."""
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred")
    b0, b1 = batches(2)
    model(**b0).loss.backward()
    model.sonar.step()
    model.sonar.zero_grad()
    model.to(torch.bfloat16)
    model(**b1).loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SonarUsageError, match=r"cast or moved .*model\.half\(\), model\.to"):
        model.sonar.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # Control: cast before the first step, the same step trains (the state is made in bf16).
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred")
    model.to(torch.bfloat16)
    model(**b1).loss.backward()
    before = [p.detach().clone() for p in model.sonar.expert_group["params"]]
    model.sonar.step()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.sonar.expert_group["params"], strict=True))


def test_fp16_weights_are_not_refused_by_the_deferred_step():
    """The in-backward schedule refuses fp16 weights (its update would precede a GradScaler's verdict);
    the deferred step updates after it, as torch's optimizer does, and trains them."""
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager", schedule="deferred")
    model.half()
    model(**batches(1)[0]).loss.backward()
    model.sonar.step()
    assert model.sonar.state[model.sonar.expert_group["params"][0]]["exp_avg"].dtype == torch.float16
