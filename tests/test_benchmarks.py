"""Smoke tests of the benchmark harness: it runs, measures, writes JSON and regenerates the README.

Fast on purpose (micro models, one torch thread, aot_eager where a compiled arm is needed). Timings
are never asserted here: they belong in the benchmark output, not in a pass/fail test.
"""

import dataclasses
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from benchmarks import common, keep_budget, optimizers, profiles, readme
from benchmarks import compile as compile_overhead
from benchmarks.arms import COMPILED, EAGER, Arm, ArmResult, Plan, run_arms
from benchmarks.common import Goal, Report, Table, goal_status, grade, worst
from benchmarks.methods import accumulation_goals, shape_goals, table
from benchmarks.profiles import PHASES, profile_step, timeline
from benchmarks.workload import SHAPES, Workload
from sonar_fx.config import AdamWConfig
from sonar_fx.environment import Environment
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.measure import Spread, side_by_side
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.methods import Execution
from sonar_fx.workload import make_batches


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention on a shared machine
    yield
    torch.set_num_threads(before)


def test_batches_are_fixed_shape_and_held_out_differs():
    train = make_batches(2, 2, 128)
    held = make_batches(2, 2, 128, held_out=True)
    assert all(b["input_ids"].shape == (2, 128) for b in train)
    assert torch.equal(train[1]["input_ids"], make_batches(2, 2, 128)[1]["input_ids"])  # deterministic
    # Every record opens with the same Alpaca preamble; the records themselves differ.
    assert not torch.equal(train[1]["input_ids"], held[1]["input_ids"])


def expert_tensor_count(model) -> int:
    return sum(len(layer.tensors) for layer in discover_experts(model))


def test_run_arms_measures_eager_arms_interleaved_and_methods_table(one_thread):
    shape, w = SHAPES["olmoe-micro"], Workload(batch=2, seq=16)
    plan = Plan(warmup=1, rounds=3, held_out_batches=1)
    arms = [Arm(method="standard"), Arm(method="sonar")]
    results = run_arms(
        lambda: shape.build(w.torch_dtype),
        arms,
        AdamWConfig(lr=1e-3),
        plan,
        make_batches(plan.warmup + 1 + plan.rounds, w.batch, w.seq),
        make_batches(1, w.batch, w.seq, held_out=True),
    )
    standard, sonar = results
    assert standard.ok and sonar.ok, (standard.error, sonar.error)
    assert len(standard.step_s) == len(sonar.step_s) == plan.rounds  # one step per round each
    assert sonar.peak_bytes > 0 and sonar.resident_bytes > 0
    model = shape.build(w.torch_dtype)
    tensors = expert_tensor_count(model)
    assert sonar.update_calls_per_step == tensors  # batched: one fused call per expert tensor
    assert sonar.update_paths == {"hook": tensors}
    assert standard.update_calls_per_step is None  # not a Sonar arm
    assert sonar.predicted_saving_bytes == ExpertGradBytes.of(discover_experts(model)).predicted_saving
    rendered = table("micro", results, w).render()
    assert "sonar · eager hooks" in rendered and f"{tensors} ({tensors} tensors by hook)" in rendered


def _measured(
    method: str, execution: Execution, *, peak: int, step_s: list[float], predicted: int = 0
) -> ArmResult:
    arm = Arm(method=method, execution=execution)
    return ArmResult(
        label=arm.label, arm=arm, peak_bytes=peak, step_s=step_s, predicted_saving_bytes=predicted
    )


def test_methods_goals_are_met_missed_or_not_measured_as_measured():
    std_e = _measured("standard", EAGER, peak=1000, step_s=[1.0, 1.0, 1.0])
    std_c = _measured("standard", COMPILED, peak=1000, step_s=[1.0, 1.0, 1.0])
    sonar_e = _measured("sonar", EAGER, peak=500, step_s=[0.8, 0.8, 0.8], predicted=500)  # saves 100%
    sonar_p = _measured("sonar", COMPILED, peak=900, step_s=[0.9, 0.9, 0.9], predicted=500)  # saves 20%
    goals = {g.name.split(": ", 1)[1]: g for g in shape_goals("s", [std_e, std_c, sonar_e, sonar_p])}
    assert goals["memory saved, eager hooks"].met is True
    assert goals["memory saved, eager hooks"].measured == "100%"
    assert goals["memory saved, compiled pass"].met is False  # 20% < 95% of the prediction
    assert goals["compiled pass vs compiled standard"].met is False  # 0.90x > 0.85x
    assert goals["compiled pass vs sonar eager hooks"].met is False  # 1.12x > 0.9x
    assert goals["compiled pass vs compiled standard_no_expert_clip"].status == "not measured"  # arm not run
    faster = _measured("sonar", COMPILED, peak=500, step_s=[0.8, 0.8, 0.8], predicted=500)
    goals = {g.name.split(": ", 1)[1]: g for g in shape_goals("s", [std_c, faster])}
    assert (
        goals["compiled pass vs compiled standard"].met is True and goals["memory saved, compiled pass"].met
    )


def test_deferred_goals_grade_eager_against_its_own_threshold_and_only_pairs_run():
    """The clip over every parameter at A=1: eager deferred is held to <= 1.20x its standard, compiled to
    <= 1.10x (so one ratio of 1.15x meets the one and misses the other); the saving to >= 90% of the
    prediction; an (A, clip) pair the run did not measure gets no goal row at all."""

    def record(label: str, ratio: float, peak: int) -> dict:
        saving = {"predicted_saving_bytes": 1000, "kept_operand_bytes": 100, "peak_bytes": peak}
        return {"A": 1, "clip": "all", "error": None, "label": label, "step_s": [ratio] * 3, **saving}

    records = [
        record("standard · eager", 1.0, 2000),
        record("sonar_deferred · eager", 1.15, 1050),
        record("standard · compiled", 1.0, 2000),
        record("sonar_deferred · compiled pass", 1.15, 1150),
    ]
    goals = {g.name: g.status for g in accumulation_goals(records)}
    assert goals == {
        "deferred, clip all, A=1, eager: time vs standard": "met",
        "deferred, clip all, A=1, eager: memory saved": "met",  # 95% of the prediction
        "deferred, clip all, A=1, compiled pass: time vs standard": "MISSED",
        "deferred, clip all, A=1, compiled pass: memory saved": "MISSED",  # 85%
    }


def test_a_goal_is_graded_only_where_the_interquartile_range_lies_on_one_side():
    below = Spread.of([0.78, 0.80, 0.82, 0.84])  # IQR 0.795-0.825
    assert grade(below, 0.85, "<=") == "met"
    assert grade(below, 0.75, "<=") == "MISSED"  # the whole range above the goal
    assert grade(below, 0.81, "<=") == "noise (IQR 0.795-0.825)"  # the median alone would say met
    assert grade(below, 0.81, ">") == "noise (IQR 0.795-0.825)"
    assert grade(below, 0.825, "<=") == "met" and grade(below, 0.825, "<") == "noise (IQR 0.795-0.825)"
    assert grade(None, 1.0, ">") == "not measured" and grade(float("nan"), 1.0, ">") == "not measured"
    assert grade(3, 4, "<") == "met" and grade(0.96, 0.95, ">=") == "met" and grade(5, 4, "<") == "MISSED"
    assert worst("met", "noise (IQR 1-2)") == "noise (IQR 1-2)" and worst("met", "MISSED") == "MISSED"
    assert worst("met", "met") == "met"
    noisy = Goal(name="g", target="<= 0.81x", measured="0.81x [0.80-0.83]", status=grade(below, 0.81, "<="))
    assert noisy.met is None and Goal(name="g", target="t", measured="m", status="MISSED").met is False
    # Results written before grades existed carry a bool: the docs still render them.
    assert goal_status({"met": True}) == "met" and goal_status({"met": None}) == "not measured"
    assert goal_status({"status": noisy.status}) == noisy.status


def test_a_failing_arm_is_reported_not_raised(one_thread):
    shape, w = SHAPES["olmoe-micro"], Workload(batch=2, seq=16)
    plan = Plan(warmup=1, rounds=1, held_out_batches=1)
    bad = Arm(method="sonar", accumulation="bogus")
    (result,) = run_arms(
        lambda: shape.build(w.torch_dtype),
        [bad],
        AdamWConfig(),
        plan,
        make_batches(3, w.batch, w.seq),
        make_batches(1, w.batch, w.seq, held_out=True),
    )
    assert not result.ok and "accumulation" in (result.error or "")


def test_memory_timeline_shows_sonar_freeing_every_expert_gradient_in_backward(one_thread):
    shape = SHAPES["olmoe-micro"]
    data = make_batches(2, 2, 16)
    grads = ExpertGradBytes.of(discover_experts(shape.build(torch.bfloat16)))
    lines = {}
    for method in ("standard", "sonar"):
        run = Arm(method=method).build(shape.build(torch.bfloat16), AdamWConfig())
        run.train_step(data[0])
        lines[method] = timeline(method, profile_step(run, data[1]))
    for line in lines.values():
        assert set(line.phases) == set(PHASES)
        assert line.phases["forward"][1] <= line.phases["backward"][0] <= line.phases["optimizer"][0]
        assert line.peak_phase in PHASES  # the step is fully covered by its phases
        start, end = line.phases[line.peak_phase]
        assert line.peak_mib > 0 and any(start <= t <= end for t in line.t_ms)
    # Both hold the same dense gradients when backward returns; standard also every expert gradient.
    held = lines["standard"].end_of_backward_mib - lines["sonar"].end_of_backward_mib
    assert held == pytest.approx(grads.total / 2**20, rel=0.05), (held, grads.total / 2**20)


@dataclass(frozen=True, kw_only=True)
class _Cfg:
    shape: str = "olmoe-cpu"
    modes: tuple[str, ...] = ("eager", "pass")
    steps: int = 10


def test_start_picks_quick_applies_overrides_and_finish_writes_them(tmp_path, capsys):
    overrides = [
        common.Override(field="shape", choices=sorted(SHAPES), help="model shape"),
        common.Override(field="modes", choices=["eager", "pass"], help="modes", many=True),
    ]
    argv = ["--quick", "--shape", "olmoe-micro", "--modes", "pass", "--out", str(tmp_path)]
    inv = common.start("fake", "Doc.", argv, default=_Cfg(), quick=_Cfg(steps=2), overrides=overrides)
    assert inv.cfg == _Cfg(shape="olmoe-micro", modes=("pass",), steps=2)
    assert inv.out == tmp_path / "fake"
    untouched = common.start("fake", "Doc.", [], default=_Cfg(), quick=_Cfg(steps=2), overrides=overrides)
    assert untouched.cfg == _Cfg()  # an override not given leaves the field alone

    inv.finish([Table(title="T", headers=["a"], rows=[["1"]])], records=[{"x": 1}], images=["t.png"])
    data = json.loads((tmp_path / "fake" / "results.json").read_text())
    assert data["command"] == shlex.join(["python", "-m", "benchmarks.fake", *argv])
    assert data["config"] == {"shape": "olmoe-micro", "modes": ["pass"], "steps": 2}
    assert (data["records"], data["images"], data["goals"]) == ([{"x": 1}], ["t.png"], [])
    assert "## T" in capsys.readouterr().out


def _fake_report(tmp_path, value: str, script: str = "methods") -> None:
    headers = ["arm", "Δ peak", "saved / predicted MiB", "× standard", "step ms"]
    rows = [
        ["standard · compiled", "+0.0%", "-", "1.00x", "9"],
        ["sonar · compiled pass", value, "-", "0.70x", "8"],
    ]
    report = Report(
        script=script,
        command=f"python -m benchmarks.{script} --quick",
        env=Environment.now(),
        config={},
        tables=[Table(title="micro: a tiny shape", headers=headers, rows=rows, note="a note")],
        goals=[Goal(name="g", target="t", measured=value, status="met")],
        records=[  # what the README headline reads: resident + step peak, and the per-round step times
            _record("standard · compiled", resident=300, peak=200, steps=[1.0, 1.0]),
            _record("standard_no_expert_clip · compiled", resident=300, peak=200, steps=[0.9, 1.0]),
            _record("sonar · compiled pass", resident=300, peak=float(value), steps=[0.45, 0.5]),
        ],
    )
    common.emit(report, tmp_path / "results" / script)


def _record(label: str, *, resident: float, peak: float, steps: list[float]) -> dict:
    mib = 2**20
    bytes_ = {"resident_bytes": int(resident * mib), "peak_bytes": int(peak * mib)}
    return dict(shape="micro", label=label, step_s=steps, **bytes_)


def test_docs_results_and_readme_headline_are_generated_between_markers_only(tmp_path):
    _fake_report(tmp_path, "12.5")
    _fake_report(tmp_path, "77.7", script="gpu_smoke")  # a smoke run is never shown as a result
    docs, readme_md = tmp_path / "results.md", tmp_path / "README.md"
    docs.write_text("# Results\n\nhand-written text\n")
    readme_md.write_text("# project\n\nhand-written text\n")
    args = ["--results", str(tmp_path / "results"), "--docs", str(docs), "--readme", str(readme_md)]
    assert readme.main(args) == 0
    text = docs.read_text()
    assert text.startswith("# Results\n\nhand-written text\n")  # untouched outside the markers
    index = text.split(readme.START)[1].split(readme.END)[0]
    assert "[methods](results.md#methods)" in index and "1 met" in index  # no page holds its markers
    start, end = readme.block_markers("methods")
    section = text.split(start)[1].split(end)[0]
    assert "12.5" in section and "python -m benchmarks.methods --quick" in section
    assert "| sonar" in section and "| standard" in section  # every row of a Markdown table
    assert "77.7" not in text and "Not run yet" in text  # the GPU script has no real results
    # A page that holds a script's markers gets its block there, under its own prose, and the index
    # links to it.
    page = tmp_path / "results-methods.md"
    page.write_text(f"# Methods\n\nprose\n\n{start}\n{end}\n\nmore prose\n")
    readme.main(args)
    assert page.read_text().startswith("# Methods\n\nprose\n") and page.read_text().endswith("more prose\n")
    assert "12.5" in page.read_text() and "[methods](results-methods.md#methods)" in docs.read_text()
    text = readme_md.read_text()
    assert text.startswith("# project\n\nhand-written text\n")
    headline = text.split(readme.HEADLINE_START)[1].split(readme.HEADLINE_END)[0]
    # Peak allocated (resident + step) and the step transient against the twin; × twin and × standard.
    row = "| micro | sonar · compiled pass | 312.5 vs 500.0 (-37.5%) | 12.5 vs 200.0 (-93.8%) | 0.50x"
    assert row in " ".join(headline.split()), headline
    assert "| 0.47x [0.46-0.49] |" in " ".join(headline.split())  # against standard: paired per round
    assert "| standard · compiled |" not in headline  # Sonar's arms only
    assert "python -m benchmarks.methods --quick" in headline
    assert readme.main([*args, "--check"]) == 0  # idempotent: a second run changes nothing
    _fake_report(tmp_path, "99.9")  # new measurements: both files are now stale
    assert readme.main([*args, "--check"]) == 1
    readme.main(args)
    for path in (page, readme_md):
        assert "99.9" in path.read_text() and "12.5" not in path.read_text()


def test_the_docs_results_and_readme_headline_are_current():
    """docs/results.md and the README's headline are what `python -m benchmarks.readme` makes of
    results/*/results.json: regenerate them after a benchmark run."""
    repo = Path(__file__).resolve().parents[1]
    paths = {"--results": "results", "--docs": "docs/results.md", "--readme": "README.md"}
    assert readme.main(["--check", *(a for k, v in paths.items() for a in (k, str(repo / v)))]) == 0


def test_a_partial_run_is_shown_as_the_script_whose_name_it_extends_longest():
    """`--engines fsdp2` writes distributed_deferred_fsdp2: distributed_deferred's question and command,
    not those of `distributed`, whose name it also extends."""
    from benchmarks import distributed, distributed_deferred

    command, question = readme._current("distributed_deferred_fsdp2")
    assert command == ["python", "-m", "benchmarks.distributed_deferred"]
    assert question == distributed_deferred.__doc__.strip().split("\n")[0]
    assert question != distributed.__doc__.strip().split("\n")[0]


def test_keep_budget_gives_each_arm_the_cpu_time_and_faults_of_its_own_timed_rounds():
    """The keep budget benchmark counts each step's thread CPU time and page faults per method, in the
    order the arms first stepped: an arm whose build failed (it never stepped) takes nobody's counts,
    and each arm gets its last `rounds` steps (its warm-up and memory steps come first)."""
    counted = keep_budget._CountedSteps()
    counted.by_method = {
        11: [(9.0, 9), (8.0, 8), (1.0, 10), (2.0, 20)],
        22: [(9.0, 9), (8.0, 8), (3.0, 30), (4.0, 40)],
    }
    ran = ArmResult(label="standard", arm=Arm(method="standard"), first_step_s=0.5)
    failed = ArmResult(label="failed", arm=Arm(method="sonar_deferred"))  # never stepped
    later = ArmResult(label="deferred", arm=Arm(method="sonar_deferred"), first_step_s=0.5)
    assert counted.per_arm([ran, failed, later], rounds=2) == {
        "standard": {"cpu_s": [1.0, 2.0], "minor_faults": [10, 20]},
        "deferred": {"cpu_s": [3.0, 4.0], "minor_faults": [30, 40]},
    }


def test_replace_between_markers_keeps_the_rest():
    text = f"a\n{readme.START}\nold\n{readme.END}\nb\n"
    assert readme.replace_between_markers(text, "new") == f"a\n{readme.START}\nnew\n{readme.END}\nb\n"


@pytest.mark.slow
def test_endurance_quick_writes_series_and_counts_no_recompiles(tmp_path, one_thread):
    compile_overhead.main(["--endurance", "--quick", "--threads", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "endurance" / "results.json").read_text())
    cfg = compile_overhead.ENDURANCE_QUICK
    (record,) = data["records"]
    timed = cfg.steps - cfg.warmup - 1  # warm-up and the first memory step, then rounds, then the last step
    assert record["error"] is None
    assert len(record["step_s"]) == len(record["cpu_step_s"]) == len(record["rss_bytes"]) == timed
    assert record["frames_compiled_after_warmup"] == record["graphs_after_warmup"] == 0
    tensors = expert_tensor_count(SHAPES[cfg.shape].build())
    assert record["sonar"]["recompiles"] == 0
    assert record["sonar"]["updates_in_graph"] == cfg.steps * tensors  # every step in the graph
    assert {g["name"].split(": ")[1]: g["status"] for g in data["goals"]}["no recompiles"] == "met"
    assert (tmp_path / "endurance" / "endurance.png").stat().st_size > 10_000


@pytest.mark.slow
def test_endurance_sees_a_recompile_after_warm_up(one_thread):
    # Negative control: a new sequence length after warm-up must show up as compiles, not as zero.
    cfg = compile_overhead.EnduranceConfig(steps=8, warmup=3, seq=16)
    batches = make_batches(cfg.warmup, cfg.batch, cfg.seq) + make_batches(
        cfg.steps - cfg.warmup, cfg.batch, 8
    )
    result = compile_overhead.Endurance(label="x")
    with side_by_side():
        compile_overhead._run_arm(result, compile_overhead.ENDURANCE_QUICK.arms[0], cfg, batches)
    assert result.error is None, result.error
    assert result.frames_compiled_after_warmup >= 1 and result.sonar["recompiles"] >= 1
    goals = {g.name.split(": ")[1]: g.met for g in compile_overhead.endurance_goals([result])}
    assert goals["no recompiles"] is False
    rss_slope = compile_overhead.rss_slope
    assert rss_slope([0, 1024, 2048, 3072]) == 1024.0 and rss_slope([5, 5, 5]) == 0.0


@pytest.mark.slow
def test_regional_compile_captures_the_same_graphs_whatever_the_depth(one_thread):
    cfg = compile_overhead.Config(
        shape="olmoe-micro", workload=Workload(batch=2, seq=16, dtype="float32"), steady_steps=1,
        regional_layers=(1, 2), regional_compiler="aot_eager",
    )  # fmt: skip
    records = {(r["layers"], r["regional"]): r for r in compile_overhead.run_regional(cfg)}
    assert all("error" not in r for r in records.values()), records
    # One block graph whatever the depth, holding one block's updates; the whole model's holds all.
    assert records[(1, True)]["dynamo_graphs"] == records[(2, True)]["dynamo_graphs"]
    assert records[(1, True)]["graphs_compiled"] == records[(2, True)]["graphs_compiled"]
    assert records[(2, True)]["updates_inserted"] == records[(1, False)]["updates_inserted"]
    assert records[(2, False)]["updates_inserted"] == 2 * records[(2, True)]["updates_inserted"]
    rows = compile_overhead.regional_table(list(records.values())).rows
    assert [row[:2] for row in rows] == [
        ["1", "whole model"],
        ["1", "regional"],
        ["2", "whole model"],
        ["2", "regional"],
    ]


def test_optimizers_clipping_table_runs_every_arm_in_rounds_and_states_its_goals(one_thread):
    tiny = dict(hidden_size=32, intermediate_size=32, num_experts=4, num_hidden_layers=2)
    run = optimizers.Config(overrides=tiny, seq=16, warmup=1, rounds=2, lowbit=False)
    table, arms = optimizers.clipping_table(run)
    assert [a.error for a in arms] == [None] * len(arms)
    assert all(len(a.step_s) == run.rounds and a.peak_bytes > 0 for a in arms)
    assert [row[0] for row in table.rows] == [a.label for a in arms]
    goals = {g.name: g for g in optimizers.goals(arms, None)}
    assert set(goals) == {"logged norms cost", "non-finite check cost", "global clip memory"}
    assert all(g.status != "not measured" for g in goals.values())  # met, MISSED or noise


@pytest.mark.slow  # five arms built and measured: ~18 s on 2 cores
def test_optimizers_muon_table_measures_state_memory_and_time_against_adamw_and_at_step(one_thread):
    tiny = dict(hidden_size=32, intermediate_size=32, num_experts=4, num_hidden_layers=2)
    run = optimizers.Config(muon_overrides=tiny, seq=16, warmup=1, rounds=2, only=("muon",))
    table, arms = optimizers.muon_table(run)
    assert [a.error for a in arms] == [None] * len(arms)
    adamw, sonar, at_step, twin, _ = arms
    # One momentum buffer per expert tensor where AdamW keeps two moments and a step: exactly counted.
    expert_elems = sum(p.numel() for p in sonar.method.optimizer.expert_group["params"])
    assert sonar.expert_state_bytes == 4 * expert_elems
    assert adamw.expert_state_bytes == 8 * expert_elems + 4 * len(
        sonar.method.optimizer.expert_group["params"]
    )
    assert at_step.state_bytes == twin.state_bytes == sonar.state_bytes  # the same states, wherever they run
    assert [row[0] for row in table.rows] == [a.label for a in arms]
    goals = {g.name: g for g in optimizers.muon_goals(arms)}
    assert goals["Muon expert state"].met and goals["in-backward Muon time"].status != "not measured"


def test_hot_path_profiles_each_update_beside_its_equal_work_twin(one_thread):
    """The eager pairs of `benchmarks.methods --profile` on a micro model: every arm timed in every round, the
    profiler counting one fused AdamW call per expert tensor plus the dense one (Sonar and the hand-written
    hooks alike), the logged norms only where Sonar takes them, and every eager goal measured."""
    quick = next(m.quick for m in profiles.MODES if m.flag == "--profile")
    cfg = dataclasses.replace(quick, modes=("eager",))
    out = profiles.run_profile(cfg)
    tables, goals, records = out.tables, out.goals, out.records
    assert [r["error"] for r in records] == [None] * 4
    assert all(
        len(r["cpu_s"]) == cfg.rounds and len(r["op_calls"]["aten::_fused_adamw_"]) == 2 for r in records
    )
    tensors = 2 * SHAPES[cfg.shapes[0]].layers  # gate_up and down per layer
    calls = {r["label"]: r["op_calls"] for r in records}
    assert all(c["aten::_fused_adamw_"] == [tensors + 1] * 2 for c in calls.values())
    norms = {label: c["aten::linalg_vector_norm"][0] for label, c in calls.items()}
    assert norms["sonar · eager hooks"] == norms[f"{profiles.HANDWRITTEN} · eager hooks"] + tensors
    assert (
        norms[f"sonar · eager hooks, {profiles.UNCHECKED}"] == norms[f"{profiles.HANDWRITTEN} · eager hooks"]
    )
    eager = [g for g in goals if "eager" in g.name]
    assert len(eager) == 3 and all(g.status != "not measured" for g in eager)  # met, MISSED or noise
    assert [row[0] for row in tables[0].rows][:2] == ["step, wall (timed rounds)", "step, CPU (timed rounds)"]


@pytest.mark.parametrize("script", ["keep_budget", "methods", "distributed_deferred"])
def test_every_benchmark_prints_its_help(script, capsys):
    """A script without modes once built an empty exclusive group, on which argparse's --help fails."""
    module = __import__(f"benchmarks.{script}", fromlist=["main"])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert f"python -m benchmarks.{script}" in capsys.readouterr().out
