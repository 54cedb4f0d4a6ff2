"""Smoke tests of the benchmark harness: it runs, measures, writes JSON and regenerates the README.

Fast on purpose (micro models, one torch thread, aot_eager where a compiled arm is needed). Timings
are never asserted here: they belong in the benchmark output, not in a pass/fail test.
"""

import json
import shlex
from dataclasses import dataclass

import pytest
import torch

from benchmarks import common, gpu, readme
from benchmarks.arms import Arm, Plan, run_arms
from benchmarks.common import Goal, Report, Spread, Table, paired_ratio
from benchmarks.memory_timeline import PHASES, profile_step, timeline
from benchmarks.methods import shape_goals, table
from benchmarks.workload import SHAPES, Workload, make_batches
from sonar_fx.config import AdamWConfig


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only add contention on a shared machine
    yield
    torch.set_num_threads(before)


def test_spread_and_paired_ratio():
    s = Spread.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 5.0, 5)
    assert s.q25 == 2.0 and s.q75 == 4.0
    assert s.fmt(0) == "3 [2-4]"
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]).median == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_batches_are_fixed_shape_and_held_out_differs():
    train = make_batches(2, 2, 128)
    held = make_batches(2, 2, 128, held_out=True)
    assert all(b["input_ids"].shape == (2, 128) for b in train)
    assert torch.equal(train[1]["input_ids"], make_batches(2, 2, 128)[1]["input_ids"])  # deterministic
    # Every record opens with the same Alpaca preamble; the records themselves differ.
    assert not torch.equal(train[1]["input_ids"], held[1]["input_ids"])


def test_run_arms_measures_eager_arms_and_methods_table(one_thread):
    shape, w = SHAPES["olmoe-micro"], Workload(batch=2, seq=16)
    plan = Plan(warmup=1, rounds=2, held_out_batches=1)
    arms = [Arm(method="standard", mode="eager"), Arm(method="sonar", mode="eager")]
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
    assert len(sonar.step_s) == plan.rounds and sonar.peak_bytes > 0
    assert sonar.update_calls_per_step == 2 * shape.layers  # batched: one call per expert tensor
    assert sonar.update_paths == {"hook": 2 * shape.layers}
    rendered = table("micro", results, w).render()
    assert "sonar · eager hooks" in rendered
    goals = {g.name.split(": ", 1)[1]: g for g in shape_goals("micro", results)}
    assert goals["memory saved, eager hooks"].met is not None
    assert goals["compiled pass vs compiled standard"].met is None  # that arm did not run


def test_a_failing_arm_is_reported_not_raised(one_thread):
    shape, w = SHAPES["olmoe-micro"], Workload(batch=2, seq=16)
    plan = Plan(warmup=1, rounds=1, held_out_batches=1)
    bad = Arm(method="sonar", mode="eager", accumulation="bogus")
    (result,) = run_arms(
        lambda: shape.build(w.torch_dtype),
        [bad],
        AdamWConfig(),
        plan,
        make_batches(3, w.batch, w.seq),
        make_batches(1, w.batch, w.seq, held_out=True),
    )
    assert not result.ok and "accumulation" in (result.error or "")


def test_memory_timeline_marks_phases_and_sees_the_peak(one_thread):
    shape = SHAPES["olmoe-micro"]
    method = Arm(method="sonar", mode="eager").build(shape.build(torch.bfloat16), AdamWConfig())
    data = make_batches(2, 2, 16)
    method.train_step(data[0])
    line = timeline("sonar", profile_step(method, data[1]))
    assert set(line.phases) == set(PHASES)
    assert line.phases["forward"][1] <= line.phases["backward"][0] <= line.phases["optimizer"][0]
    assert line.peak_mib > 0 and line.peak_phase in (*PHASES, "between phases")


def test_gpu_script_smoke_mode_on_cpu(tmp_path, one_thread):
    gpu.main(
        ["--device", "cpu", "--tiny", "--compiler", "aot_eager", "--threads", "1", "--out", str(tmp_path)]
    )
    data = json.loads((tmp_path / "gpu_smoke" / "results.json").read_text())
    records = {r["arm"]: r for r in data["records"]}
    assert set(records) == {
        "standard · eager",
        "standard_no_expert_clip · eager",
        "sonar · eager hooks",
        "sonar · compiled pass",
    }
    assert all("error" not in r for r in records.values()), records
    assert records["sonar · compiled pass"]["updates_in_graph"] > 0  # the pass, not the hook fallback
    assert records["sonar · compiled pass"]["updates_by_hook"] == 0
    assert data["env"]["torch"] == torch.__version__ and data["command"].startswith(
        "python -m benchmarks.gpu"
    )


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
    report = Report(
        script=script,
        command=f"python -m benchmarks.{script} --quick",
        env=common.environment(),
        config={},
        tables=[Table(title="T", headers=["arm", "peak MiB"], rows=[["sonar", value]], note="a note")],
        goals=[Goal(name="g", target="t", measured=value, met=True)],
    )
    common.emit(report, tmp_path / "results" / script)


def test_readme_section_is_generated_between_markers_only(tmp_path):
    _fake_report(tmp_path, "12.5")
    _fake_report(tmp_path, "77.7", script="gpu_smoke")  # a smoke run is never shown as a result
    path = tmp_path / "README.md"
    path.write_text("# project\n\nhand-written text\n")
    args = ["--results", str(tmp_path / "results"), "--readme", str(path)]
    assert readme.main(args) == 0
    text = path.read_text()
    assert text.startswith("# project\n\nhand-written text\n")  # untouched outside the markers
    assert readme.START in text and readme.END in text
    section = text.split(readme.START)[1].split(readme.END)[0]
    assert "12.5" in section and "python -m benchmarks.methods --quick" in section
    assert "| sonar" in section  # a Markdown table
    assert "77.7" not in section and "Not run yet" in section  # the GPU script has no real results
    assert readme.main([*args, "--check"]) == 0  # idempotent: a second run changes nothing
    _fake_report(tmp_path, "99.9")  # new measurements: the README is now stale
    assert readme.main([*args, "--check"]) == 1
    readme.main(args)
    assert "99.9" in path.read_text() and "12.5" not in path.read_text()


def test_replace_between_markers_keeps_the_rest():
    text = f"a\n{readme.START}\nold\n{readme.END}\nb\n"
    assert readme.replace_between_markers(text, "new") == f"a\n{readme.START}\nnew\n{readme.END}\nb\n"
