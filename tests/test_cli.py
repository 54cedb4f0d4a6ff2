"""`sonar-fx finetune`: every method runs end to end and writes its records (bad input: see
test_bad_input.py; faults, kills and signals: test_run_safety.py)."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sonar_fx.cli import build_parser, main, train_config
from sonar_fx.methods import METHODS
from sonar_fx.trainer.config import run_identity
from sonar_fx.trainer.validate import optimizer_config

FAST = ["--compiler", "eager", "--train-size", "8", "--held-out", "4", "--steps", "2", "--no-progress"]


def finetune(out: Path, *extra: str, model: str = "tiny-reference") -> int:
    return main(["finetune", "--model", model, *FAST, "--out", str(out), *extra])


def records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Add {i} and 1.", "input": "", "output": str(i + 1)} for i in range(n)]


@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_writes_metrics_and_summary(tmp_path, capsys, method, request):
    if method == "sonar_deferred":  # the tiny reference model's operands outgrow its experts: crossover
        request.getfixturevalue("deferred_saving_lost")
    assert finetune(tmp_path, "--method", method, "--eval-every", "1") == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["supervised_tokens"] > 0 for r in lines)
    assert all("held_out_loss" in r for r in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == 2 and math.isfinite(summary["held_out_loss"])
    assert summary["memory"]["peak_bytes"] > summary["memory"]["state_bytes"] > 0
    assert summary["memory"]["process_peak_rss_bytes"] > 0
    assert set(summary["versions"]) >= {"torch", "transformers", "sonar_fx"}
    assert summary["hardware"]["device"] == "cpu"
    assert (summary["sonar"] is not None) == method.startswith("sonar")
    assert (tmp_path / "checkpoint.pt").is_file()
    # Each memory figure under its own name: the step's, and Sonar's expert gradients beside their bounds.
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "step peak (state + step transient)" in last_line
    assert ("expert gradients alive at once" in last_line) == method.startswith("sonar")
    if method.startswith("sonar"):
        bound = summary["sonar"]["expert_grad_bytes"]
        assert bound["one_layer"] < bound["all_layers"]
        if method == "sonar_deferred":  # crossed over: every expert gradient alive until step()
            assert all(r["expert_grad_peak_bytes"] == bound["all_layers"] for r in lines)
        else:
            assert all(0 < r["expert_grad_peak_bytes"] <= bound["one_layer"] for r in lines)
    else:
        assert not any("expert_grad_peak_bytes" in r for r in lines)


@pytest.mark.parametrize("bits", [8, 4, 32])
def test_dense_state_bits_reaches_the_optimizer_and_the_run_identity(bits):
    """`--dense-state-bits` as `plan` and `AdamWConfig` have it (no step: the states' kinds are
    test_eager_sonar.py's); a checkpoint names it only when set, as checkpoints before the flag did."""
    args = build_parser().parse_args(["finetune", "--state-bits", "8", "--dense-state-bits", str(bits)])
    cfg = train_config(args)
    opt_cfg = optimizer_config(cfg, 1e-3)
    assert (opt_cfg.state_bits, opt_cfg.dense_state_bits) == (8, bits)
    assert run_identity(cfg, "hash").get("dense_state_bits") == (None if bits == 32 else bits)


def test_dense_state_bits_is_refused_where_it_does_not_apply(tmp_path, capsys):
    assert finetune(tmp_path, "--optimizer", "sgd", "--dense-state-bits", "8") == 2
    assert "error: --dense-state-bits does not apply to --optimizer sgd" in capsys.readouterr().err


def test_loss_falls_and_the_lr_schedule_is_logged(tmp_path):
    args = ["--method", "sonar", "--steps", "8", "--train-size", "16", "--lr", "3e-3", "--warmup", "2"]
    assert finetune(tmp_path, *args, "--min-lr", "3e-4") == 0
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lrs[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3])  # linear warm-up, then the peak
    assert lrs[-1] == pytest.approx(3e-4)  # the cosine reaches --min-lr on the last step
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["held_out_loss"] < summary["held_out_loss_initial"]


def test_alpaca_file_and_the_data_hash_is_stable(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(12)))
    hashes = []
    for run in ("a", "b"):
        assert finetune(tmp_path / run, "--data", str(data), "--train-size", "8", "--steps", "1") == 0
        hashes.append(json.loads((tmp_path / run / "summary.json").read_text())["data"]["hash"])
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
    assert f"hash of the first batches {hashes[0][:16]}" in capsys.readouterr().out
    assert (
        finetune(tmp_path / "c", "--data", str(data), "--train-size", "8", "--steps", "1", "--seed", "7") == 0
    )
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["data"]["hash"] != hashes[0]


def test_a_split_larger_than_the_file_names_the_flags(tmp_path, capsys):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records(12)))
    assert finetune(tmp_path / "out", "--data", str(data), "--train-size", "10", "--held-out", "4") == 2
    err = capsys.readouterr().err
    assert f"{data}: split needs 14 records" in err and "--train-size, --held-out" in err


@pytest.mark.subprocess
def test_python_dash_m_runs_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "sonar_fx", "finetune", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--model", "--method", "--compiler", "--resume", "--max-grad-norm", "--held-out"):
        assert flag in result.stdout


@pytest.mark.slow
def test_demo_writes_table_json_chart_and_the_bitwise_verdict(tmp_path, capsys):
    from sonar_fx.demo import DemoConfig, run_demo

    small = dict(hidden_size=32, intermediate_size=16, num_experts=4, num_hidden_layers=2)
    cfg = DemoConfig(
        out=str(tmp_path), steps=4, warmup=1, held_out=8, progress=False, min_loss_drop=0.0,
        model_overrides=small, arms=("standard", "no_expert_clip", "sonar_eager"),
    )  # fmt: skip
    assert run_demo(cfg) == 0
    printed = capsys.readouterr().out
    assert "sonar, eager hooks vs standard_no_expert_clip: expert weights BITWISE EQUAL" in printed
    report = json.loads((tmp_path / "demo.json").read_text())
    assert [r["arm"] for r in report["rows"]] == ["standard", "no_expert_clip", "sonar_eager"]
    assert report["bitwise"][0]["equal"] is True
    # Memory claims are tested in test_memory.py at a shape where expert gradients dominate.
    assert all(r["peak_mib"] > r["step_transient_mib"] > 0 for r in report["rows"])
    assert report["rows"][0]["peak_change"] == 0.0
    assert (tmp_path / "demo.png").stat().st_size > 10_000
