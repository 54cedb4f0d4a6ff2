"""The deferred step's keep budget (`sonar_fx.optim.keep_budget`): under the clip over every parameter
(Sonar's, expert_clip="global", or the user's, `model.sonar.clip_grad_norm_`, under nonfinite="skip"
too) and a GradScaler's verdict the norm pass keeps computed expert gradients up to `keep_budget` bytes and
the update pass uses them instead of computing them again. Exact at every budget: `torch.equal` on
every parameter against plain torch (`test_deferred.Twin`: fused AdamW, `clip_grad_norm_` over all),
3 steps of 4 micro-batches, the clip active on each, at budget 0, half and all; the work saved is
counted (recipe runs), the meter counts the kept gradients, and what cannot be honoured is refused.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch
import transformers
from test_cli_grad_accum import finetune, metrics, model_of

import sonar_fx
from benchmarks.workload import SHAPES
from sonar_fx.cli import main
from sonar_fx.config import ConfigFieldError
from sonar_fx.errors import SonarUsageError
from sonar_fx.models import build_model
from sonar_fx.optim import keep_budget
from sonar_fx.optim.deferred_entries import Kept
from sonar_fx.planner.keep import choose_keep_budget
from sonar_fx.planner.models import model_source
from sonar_fx.planner.run import MethodRun, StepMemory

from helpers import assert_same_weights, batches, expert_params
from test_deferred import MAX_NORM, Twin, cfg_for

ACCUM = 4
SEQ = 8  # 4 micro-batches of 2 x 8 tokens: no tensor crosses over (2 x 12 crosses every down_proj)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def expert_bytes(opt) -> int:
    return sum(p.numel() * p.element_size() for p in opt.expert_group["params"])


def pair(compiler: str, dtype: torch.dtype, budget: object, clip: str = "sonar", **options):
    """A deferred model with the clip over all and `budget` ("half"/"all": of its expert gradients'
    bytes), and its plain-torch twin. `clip`: "sonar" (expert_clip="global") or "user" (Sonar's clip
    off: the loop calls `model.sonar.clip_grad_norm_`)."""
    model = build_model("tiny-olmoe", dtype=dtype, seed=0)
    twin_model = copy.deepcopy(model)
    total = sum(p.numel() * p.element_size() for p in expert_params(model))
    chosen = {"half": total // 2, "all": total}.get(budget, budget)  # type: ignore[call-overload]
    cfg = replace(cfg_for("all"), keep_budget=chosen)
    if clip == "user":
        cfg = replace(cfg, max_grad_norm=None, expert_clip=None)
    sonar_fx.compile(model, cfg, compiler=compiler, schedule="deferred", **options)
    opt = model.sonar
    names = {opt.expert_name(p) for p in opt.expert_group["params"]}
    return model, opt, twin_model, Twin(twin_model, names, "all", compiler)


def count_recipe_runs(monkeypatch) -> list[int]:
    """How many expert gradients were computed from kept operands (one per kept GEMM's recipe run)."""
    runs = [0]
    gradient = Kept.gradient

    def counted(self, param):
        runs[0] += 1
        return gradient(self, param)

    monkeypatch.setattr(Kept, "gradient", counted)
    return runs


def run_counted(
    model, opt, twin: Twin, runs: list[int], seq: int = SEQ, clip: str = "sonar"
) -> tuple[list[float], int, int]:
    """3 steps of `ACCUM` micro-batches on both; returns each step's total norm, and of the last step the
    expert tensors whose gradient the step computed (not held whole) and the GEMM recipes it ran (the
    user's clip's included). `clip="user"`: `model.sonar.clip_grad_norm_` before `step()`, its norm
    torch's `clip_grad_norm_` over every parameter of the twin, bitwise."""
    totals, data = [], batches(3 * ACCUM, seq=seq)
    for s in range(3):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            model(**b).loss.backward()
            twin.run(**b).loss.backward()
        computed = sum(keep_budget.computed_twice(p, opt.deferred) for p in opt.expert_group["params"])
        runs[0] = 0
        if clip == "user":
            ours = opt.clip_grad_norm_(MAX_NORM)
            theirs = torch.nn.utils.clip_grad_norm_(twin.all, MAX_NORM)
            assert torch.equal(ours, theirs), (ours, theirs)
            twin.opt.step()
            twin.opt.zero_grad()
        opt.step()
        opt.zero_grad()
        if clip == "sonar":
            twin.step()
        totals.append(opt.grad_norms()["total"])
    return totals, computed, runs[0]


# Eager at every budget in bf16 and fp32; compiled (the graph pass keeps the operands; the step is the
# same code) at half, where the update pass takes kept gradients and computes the others. Each with
# Sonar's clip and with the user's (`model.sonar.clip_grad_norm_`: its own norm pass keeps).
CASES = [
    (c, d, b, clip)
    for clip in ("sonar", "user")
    for c, d in (("eager", torch.bfloat16), ("eager", torch.float32))
    for b in (0, "half", "all")
]
COMPILED = [
    pytest.param("aot_eager", torch.bfloat16, "half", clip, marks=pytest.mark.slow)
    for clip in ("sonar", "user")
]


@pytest.mark.parametrize(("compiler", "dtype", "budget", "clip"), [*CASES, *COMPILED])
def test_every_budget_is_plain_torch(compiler, dtype, budget, clip, monkeypatch):
    model, opt, twin_model, twin = pair(compiler, dtype, budget, clip)
    runs = count_recipe_runs(monkeypatch)
    totals, computed, step_runs = run_counted(model, opt, twin, runs, clip=clip)
    assert all(t > MAX_NORM for t in totals), totals  # the clip was active on every step
    assert_same_weights(model, twin_model)
    d = opt.report()["deferred"]
    assert (d["held_grad_bytes"], d["computed_grad_bytes"]) == (0, expert_bytes(opt)), d
    # tiny-olmoe, update order: layer 0's gate_up_proj (2/3 of a layer), down_proj, then layer 1's
    layer = [f"mlp.experts.{t}" for t in ("gate_up_proj", "down_proj")]
    kept, share = {0: ([], 1.0), "half": ([f"0.{t}" for t in layer], 0.5),
                   "all": ([f"{i}.{t}" for i in (0, 1) for t in layer], 0.0)}[budget]  # fmt: skip
    assert d["kept"] == [f"model.layers.{k}" for k in kept] and d["recomputed_share"] == share, d
    # The last step's GEMMs: each computed gradient once per micro-batch in the norm pass, and again in
    # the update pass unless it was kept.
    assert computed > 0
    assert step_runs == ACCUM * (2 * computed - len(d["kept"])), (step_runs, computed, d["kept"])


@pytest.mark.parametrize(("room", "kept"), [(0, ["model.layers.0.mlp.experts.gate_up_proj"]), (-1, [])])
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches of 2 x 12 tokens cross down_proj over
def test_a_gradient_past_its_crossover_counts_against_the_budget(room, kept):
    """Every down_proj crosses over (its operands outgrow its gradient): the step holds its gradient, as
    standard does, and those bytes come off the budget first. A budget of the held bytes plus one
    gate_up_proj keeps exactly that one; a byte less keeps none. Exact either way."""
    params = dict(build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0).named_parameters())
    size = {n: p.numel() * p.element_size() for n, p in params.items() if ".experts." in n}
    held = sum(b for n, b in size.items() if "down_proj" in n)
    budget = held + size["model.layers.0.mlp.experts.gate_up_proj"] + room
    model, opt, twin_model, twin = pair("eager", torch.bfloat16, budget)
    totals, computed, _ = run_counted(model, opt, twin, [0], seq=12)
    assert all(t > MAX_NORM for t in totals), totals
    assert_same_weights(model, twin_model)
    d = opt.report()["deferred"]
    assert sorted(d["crossed_over"]) == sorted(n for n in size if "down_proj" in n)
    assert (d["held_grad_bytes"], d["kept"], computed) == (held, kept, 2), d
    assert d["recomputed_share"] == (0.5 if kept else 1.0)


@pytest.mark.parametrize("budget", ["half", "all"])
def test_grad_scaler_with_overflowing_steps_at_every_budget(budget):
    """fp16 CPU autocast, fp32 weights, 4 micro-batches, the ordinary scaler loop, a scale that grows
    into overflow every other step: the norm pass keeps unscaled gradients, a skipped step frees them
    (and keeps the operands: they were not dropped under a scaler), and weights and scales are plain
    torch's."""
    model, opt, twin_model, twin = pair("eager", torch.float32, budget)
    kw = dict(init_scale=256.0, growth_factor=2.0**12, backoff_factor=2.0**-12, growth_interval=1)
    ours, theirs = torch.amp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    scales, data = [], batches(4 * ACCUM, seq=SEQ)
    for s in range(4):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            with torch.autocast("cpu", dtype=torch.float16):
                ours.scale(model(**b).loss).backward()
                theirs.scale(twin.run(**b).loss).backward()
        ours.step(opt)
        ours.update()
        assert opt.meter.live == 0  # nothing kept outlives the step, stepped or skipped
        opt.zero_grad()
        twin.scaler_step(theirs)
        scales.append((ours.get_scale(), theirs.get_scale()))
    assert all(a == b for a, b in scales), scales
    assert len({s for s, _ in scales}) > 1  # some steps overflowed and some stepped
    assert opt.report()["deferred"]["kept"]
    assert_same_weights(model, twin_model)


def test_nonfinite_skip_frees_what_the_norm_pass_kept():
    """nonfinite="skip" with the clip over all: a NaN in the last expert tensor's gradient skips the
    step after the norm pass kept every gradient (the NaN one too: its verdict comes with the norm);
    the skipped step frees them itself (the meter counts none alive), no weight moves, and the next
    step trains."""
    model, opt, _, _ = pair("eager", torch.float32, "all", nonfinite="skip")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**batches(1, seq=SEQ)[0]).loss.backward()
    opt.deferred.entries()[-1].operands[1].fill_(float("nan"))  # the last expert tensor's dy
    with pytest.warns(UserWarning, match="step skipped"):
        opt.step()
    assert len(opt.report()["deferred"]["kept"]) == 4 and opt.meter.live == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    opt.zero_grad()
    model(**batches(1, seq=SEQ)[0]).loss.backward()
    opt.step()
    assert opt.meter.live == 0 and opt.report()["deferred"]["recomputed_share"] == 0.0


@pytest.mark.parametrize("clip", ["sonar", "user"])
def test_the_meter_counts_the_kept_gradients(clip):
    """The meter's peak of expert-gradient bytes alive at once: budget 0 holds one gradient being
    summed (2 x the largest); a budget adds at most what it kept; "all" holds every expert gradient
    at the end of the norm pass, as standard training holds them."""
    peaks, kept = {}, {}
    for budget in (0, "half", "all"):
        model, opt, _, _ = pair("eager", torch.bfloat16, budget, clip)
        for b in batches(ACCUM, seq=SEQ):
            model(**b).loss.backward()
        if clip == "user":
            opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        report = opt.report()
        peaks[budget] = report["expert_grad_bytes"]["measured_peak"]
        kept[budget] = report["deferred"]["kept_grad_bytes"]
        total = expert_bytes(opt)
    biggest = max(p.numel() * p.element_size() for p in opt.expert_group["params"])
    assert peaks[0] == 2 * biggest and kept[0] == 0
    assert kept["half"] == total // 2 and peaks[0] < peaks["half"] <= peaks[0] + kept["half"]
    assert kept["all"] == total and total <= peaks["all"] <= peaks[0] + total


def test_the_users_clip_keeping_everything_still_refuses_what_it_must():
    """The user's clip at budget "all" drops every expert tensor's operands (its gradient kept in their
    place): a reset of every dense gradient Sonar did not see after it, or a GradScaler, is still
    refused at step() before any weight moves, and zero_grad() frees what was kept."""
    model, opt, _, _ = pair("eager", torch.float32, "all", "user")
    before = [p.detach().clone() for p in model.parameters()]
    model(**batches(1, seq=SEQ)[0]).loss.backward()
    opt.clip_grad_norm_(MAX_NORM)
    assert not opt.deferred.kept and len(opt.report()["deferred"]["kept"]) == 4  # all kept, none as operands
    for p in opt.dense_params():
        p.grad = None
    with pytest.raises(SonarUsageError, match="every dense gradient was reset"):
        opt.step()
    opt.zero_grad()
    assert opt.meter.live == 0 and not opt.kept_grads.holds_any()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(**batches(1, seq=SEQ)[0]).loss).backward()
    opt.clip_grad_norm_(MAX_NORM)
    with pytest.raises(SonarUsageError, match="GradScaler"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("budget", [0, "half", "all"])
def test_the_users_clip_keeps_within_the_budget_under_nonfinite_skip(budget, monkeypatch):
    """nonfinite="skip" with the user's clip (`model.sonar.clip_grad_norm_`): its norm pass keeps within
    the budget as without the policy, and its total norm is the step's verdict (the plain loop's
    `isfinite(clip_grad_norm_(...))`), so no gradient is computed a third time. 3 steps of 4
    micro-batches, the second with an inf in one expert tensor's gradient on both sides: that step is
    skipped whole (no weight moves, nothing stays alive), the others are plain torch's, bitwise; a
    gradient the clip computed is computed again only where it was not kept."""
    model, opt, twin_model, twin = pair("eager", torch.float32, budget, "user", nonfinite="skip")
    runs, data = count_recipe_runs(monkeypatch), batches(3 * ACCUM, seq=SEQ)
    poisoned = opt.expert_group["params"][0]
    theirs_poisoned = twin_model.get_parameter(opt.expert_name(poisoned))
    for s in range(3):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            model(**b).loss.backward()
            twin.run(**b).loss.backward()
        if s == 1:  # dy of the poisoned tensor's last kept GEMM; the twin's gradient of the same tensor
            opt.deferred.kept[id(poisoned)].groups()[-1][-1].operands[1].fill_(float("inf"))
            theirs_poisoned.grad.fill_(float("inf"))
        computed = sum(keep_budget.computed_twice(p, opt.deferred) for p in opt.expert_group["params"])
        before = [p.detach().clone() for p in model.parameters()]
        runs[0] = 0
        ours, theirs = opt.clip_grad_norm_(MAX_NORM), torch.nn.utils.clip_grad_norm_(twin.all, MAX_NORM)
        if s == 1:
            assert not (torch.isfinite(ours) or torch.isfinite(theirs)), (ours, theirs)
            with pytest.warns(UserWarning, match="step skipped.*clip_grad_norm_"):
                opt.step()
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        else:
            assert torch.equal(ours, theirs) and ours > MAX_NORM, (ours, theirs)
            opt.step()
            twin.opt.step()
        opt.zero_grad()
        twin.opt.zero_grad()
        assert opt.meter.live == 0 and not opt.deferred.kept and not opt.kept_grads.holds_any()
        kept = opt.report()["deferred"]["kept"]
        assert len(kept) == {0: 0, "half": 2, "all": 4}[budget] and computed == 4, (kept, computed)
        # The clip computes each gradient once per micro-batch; the update pass what it did not keep.
        assert runs[0] == ACCUM * (computed if s == 1 else 2 * computed - len(kept)), (s, runs[0])
    assert opt.report()["skipped_steps"] == 1
    assert_same_weights(model, twin_model)


def test_the_users_clip_under_nonfinite_skip_skips_the_experts_for_a_dense_inf():
    """The verdict is the user's total norm: an inf in a dense gradient alone skips the expert updates
    too (the whole step, as the plain loop that skips on a non-finite clip_grad_norm_)."""
    model, opt, _, _ = pair("eager", torch.float32, "half", "user", nonfinite="skip")
    before = [p.detach().clone() for p in model.parameters()]
    model(**batches(1, seq=SEQ)[0]).loss.backward()
    opt.dense_params()[0].grad.fill_(float("inf"))
    assert not torch.isfinite(opt.clip_grad_norm_(MAX_NORM))
    with pytest.warns(UserWarning, match="step skipped"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert opt.meter.live == 0 and not opt.kept_grads.holds_any()


def test_budgets_are_validated_and_refused_where_they_cannot_hold():
    for bad in (-1, 1.5, True, "all", None):
        with pytest.raises(ConfigFieldError, match="keep_budget"):
            sonar_fx.AdamWConfig(keep_budget=bad)
    model = build_model("tiny-olmoe", dtype=torch.float32, seed=0)
    total = sum(p.numel() * p.element_size() for p in expert_params(model))
    cfg = cfg_for("all")
    with pytest.raises(SonarUsageError, match=rf"keep_budget={total} keeps every expert gradient"):
        sonar_fx.prepare(model, replace(cfg, keep_budget="auto"), schedule="deferred")
    with pytest.raises(SonarUsageError, match="in-backward schedule computes each expert gradient once"):
        sonar_fx.prepare(model, replace(cfg, expert_clip=None, keep_budget=1024))
    with pytest.raises(SonarUsageError, match="distributed engine"):
        keep_budget.check_keep_budget(
            replace(cfg, keep_budget=1024), "deferred", object(), expert_params(model)
        )
    sonar_fx.prepare(model, replace(cfg, keep_budget=0), schedule="deferred")  # 0: today's behaviour


def test_auto_is_the_allocators_free_memory_less_its_margin(monkeypatch):
    """keep_budget="auto" on CUDA, its arithmetic: the driver's free bytes plus the allocator's unused
    reserve, less two of the largest expert gradients and 5% of the card (checked with the CUDA calls
    answered here: this machine may have no GPU)."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    params = [torch.empty(1024, 1024), torch.empty(256, 1024)]  # 4 MiB and 1 MiB of fp32
    margin = 2 * 4 * 2**20 + int(0.05 * 80 * gib)
    assert keep_budget.auto_budget(params) == 10 * gib + gib - margin
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib, 80 * gib))
    assert keep_budget.auto_budget(params) == 0  # never negative: nothing kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_keeps_within_the_free_memory_and_is_exact():
    model = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0).cuda()
    twin_model = copy.deepcopy(model)
    sonar_fx.prepare(model, replace(cfg_for("all"), keep_budget="auto"), schedule="deferred")
    opt = model.sonar
    twin = Twin(twin_model, {opt.expert_name(p) for p in opt.expert_group["params"]}, "all", "eager")
    for b in batches(3):
        b = {k: v.cuda() for k, v in b.items()}
        model(**b).loss.backward()
        twin.run(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        twin.step()
    d = opt.report()["deferred"]
    assert d["keep_budget"] == "auto" and d["keep_budget_bytes"] > 0 and d["recomputed_share"] == 0.0, d
    assert_same_weights(model, twin_model)


# ------------------------------------------------------------------------------------ the planner


def test_the_planners_search_takes_the_largest_keep_budget_whose_step_fits():
    """Budgets tried: the bytes of the first n expert tensors in update order; all first, then bisection;
    a step that does not fit even with nothing kept gives 0."""
    order = [("a", 4), ("b", 2), ("c", 4), ("d", 2)]  # candidates 0, 4, 6, 10, 12
    tried: list[int] = []

    def step_at(keep: int) -> StepMemory:
        tried.append(keep)
        return StepMemory(peak=100 + keep, start=0, by_category={})

    assert choose_keep_budget(step_at, order, 112)[::2] == (12, 1) and tried == [12]
    tried.clear()
    chosen, step, probes = choose_keep_budget(step_at, order, 109)
    assert (chosen, step.peak, probes) == (6, 106, len(tried)) and 10 in tried  # 6 fits, 10 does not
    tried.clear()
    assert choose_keep_budget(step_at, order, 99)[0] == 0 and tried == [12, 0]


@pytest.mark.slow  # eight planned steps: 36 s on the shared 2-core machine
def test_the_plan_keeps_what_fits_on_the_fake_model():
    """The planned deferred step (clip over all) of a model whose expert gradients dominate, at a memory
    budget between its peak keeping nothing and keeping everything: the chosen keep budget's planned
    step fits, the next candidate's does not, and the step's own record says what it kept."""
    cfg = transformers.OlmoeConfig(
        hidden_size=32, intermediate_size=64, num_experts=64, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=259, eos_token_id=0,
    )  # fmt: skip
    run = MethodRun(
        model_source(cfg), "sonar_deferred_global_clip", sonar_fx.AdamWConfig(), dtype=torch.float32,
        gradient_checkpointing=False, seq=8,
    )  # fmt: skip
    order = run.expert_order()
    sizes = list(itertools.accumulate(b for _, b in order))
    nothing, one_layer, everything = (
        run.tracked_step(2, 8, device="cpu", keep_budget=k) for k in (0, sizes[1], sizes[-1])
    )
    assert nothing.keep is not None and nothing.keep.recomputed_share == 1.0
    assert nothing.peak < one_layer.peak < everything.peak  # the norm pass's kept gradients set the peak
    budget = one_layer.peak
    chosen, step, _ = choose_keep_budget(
        lambda k: run.tracked_step(2, 8, device="cpu", keep_budget=k), order, budget
    )
    n = len(step.keep.kept)
    assert 2 <= n < len(order) and chosen == sizes[n - 1] and step.keep.kept_bytes == chosen
    assert step.peak <= budget < run.tracked_step(2, 8, device="cpu", keep_budget=sizes[n]).peak
    assert 0 < step.keep.recomputed_share < 1


def test_plan_budget_auto_without_cuda_is_refused_naming_the_alternatives(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: 'auto' reads it")
    assert main(["plan", "--model", "tiny-olmoe", "--budget", "auto"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--budget 46GiB" in err and "--gpu NAME" in err


# ------------------------------------------------------------------------------------ the trainer


@pytest.mark.usefixtures("deferred_saving_lost")
def test_finetune_keep_budget_writes_its_figures_to_metrics_and_trains_as_standard(tmp_path):
    """`sonar-fx finetune --clip-scope all --grad-accum 2 --keep-budget N`: each metrics.jsonl line has
    the budget, the bytes kept and the share recomputed, and the weights are standard's, bitwise."""
    model = build_model("tiny-olmoe", num_experts=64)
    half = sum(p.numel() * p.element_size() for p in expert_params(model)) // 2
    # 64 experts, 1 x 256 tokens per micro-batch: the operands stay below every gradient (no crossover)
    short = ["--grad-accum", "2", "--batch-size", "1", "--model-override", "num_experts=64"]
    assert finetune(tmp_path / "kept", *short, "--clip-scope", "all", "--keep-budget", str(half)) == 0
    assert finetune(tmp_path / "base", *short, "--method", "standard") == 0
    kept, base = model_of(tmp_path / "kept"), model_of(tmp_path / "base")
    assert [k for k in base if not torch.equal(kept[k], base[k])] == []
    lines = metrics(tmp_path / "kept")
    assert len(lines) == 3 and all(line["keep_budget_bytes"] == half for line in lines)
    assert all((line["kept_grad_bytes"], line["recomputed_share"]) == (half, 0.5) for line in lines)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--keep-budget", "1MB"], "the deferred schedule's"),
        (["--clip-scope", "all", "--keep-budget", "auto", "--device", "cpu"], "'auto' reads the CUDA"),
    ],
)
def test_finetune_refuses_a_keep_budget_it_cannot_honour(tmp_path, capsys, flags, says):
    assert finetune(tmp_path, *flags) == 2
    err = capsys.readouterr().err
    assert "--keep-budget" in err and says in err
    with pytest.raises(SystemExit):
        finetune(tmp_path, "--keep-budget", "lots")
    assert "expected a size" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the benchmark


def test_the_benchmark_arms_keep_their_share_and_its_goals_read_the_records():
    """`benchmarks.keep_budget`: an arm's budget is its share of the model's expert-gradient bytes; the
    goals compare "all" with standard and count the budgets whose paired ratio rose."""
    from benchmarks.keep_budget import QUICK, KeepArm, _goals, arms_for

    model = SHAPES["olmoe-micro"].build()
    method = KeepArm(fraction="1/4").build(model, sonar_fx.AdamWConfig(expert_clip="global"))
    total = sum(p.numel() * p.element_size() for p in expert_params(model))
    assert method.optimizer.cfg.keep_budget == total // 4
    arms = arms_for(QUICK)
    assert [a.label for a in arms][:2] == ["standard · eager", "sonar_deferred · eager · keep 0"]
    times = {
        "standard · eager": 1.0,
        **{
            KeepArm(fraction=f).label: t for f, t in zip(QUICK.fractions, (1.3, 1.2, 1.25, 1.01), strict=True)
        },
    }
    records = [
        {
            "A": a,
            "label": label,
            "error": None,
            "step_s": [t, t],
            "peak_bytes": 100 if "standard" in label else 99,
        }
        for a in QUICK.steps_of
        for label, t in times.items()
    ]
    goals = _goals(records, QUICK)  # per A: keep-all time, keep-all peak, budgets whose ratio rose
    assert [(g.measured, g.status) for g in goals[:3]] == [
        ("1.01x [1.01-1.01]", "met"),
        ("0.990", "met"),
        ("1", "MISSED"),
    ]
    assert len(goals) == 3 * len(QUICK.steps_of)
