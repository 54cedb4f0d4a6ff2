"""`sonar-fx finetune --grad-accum N --clip-scope all|dense`: the flags resolve the schedule, every method
accumulates alike, sonar equals its baseline bitwise, and resume stays bitwise."""

import json
from pathlib import Path

import pytest
import torch
from test_resume import assert_same_state

from sonar_fx.cli import build_parser, main, train_config
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.config import ConfigError
from sonar_fx.trainer.validate import resolve_schedule

COMMON = [
    "finetune", "--model", "tiny-olmoe", "--compiler", "eager", "--train-size", "16", "--held-out", "0",
    "--steps", "3", "--warmup", "1", "--lr", "1e-2", "--max-grad-norm", "0.05", "--no-progress",
    "--max-len", "256",
]  # fmt: skip
"""max_grad_norm 0.05: below every step's norm, so the clip is active on each step."""


def finetune(out: Path, *extra: str) -> int:
    return main([*COMMON, "--out", str(out), *extra])


def resolved(*flags: str):
    return resolve_schedule(train_config(build_parser().parse_args(["finetune", *flags])))


@pytest.mark.parametrize(
    ("flags", "method", "expert_clip"),
    [
        ([], "sonar", None),
        (["--grad-accum", "2"], "sonar_deferred", None),
        (["--clip-scope", "all"], "sonar_deferred", "global"),
        (["--clip-scope", "dense"], "sonar", None),
        (["--clip-scope", "all", "--grad-accum", "4"], "sonar_deferred", "global"),
        (["--method", "standard", "--grad-accum", "3"], "standard", None),
        (["--method", "standard_no_expert_clip", "--clip-scope", "dense"], "standard_no_expert_clip", None),
        (["--expert-clip", "global"], "sonar", "global"),  # GA 1: the two-pass global clip, as before
    ],
)
def test_the_flags_choose_the_schedule(flags, method, expert_clip):
    cfg = resolved(*flags)
    assert (cfg.method, cfg.expert_clip) == (method, expert_clip)


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (["--method", "standard_no_expert_clip", "--clip-scope", "all"], "--clip-scope"),
        (["--method", "standard", "--clip-scope", "dense"], "--clip-scope"),
        (["--expert-clip", "per_tensor", "--clip-scope", "all"], "--clip-scope"),
        (["--method", "sonar_per_expert", "--grad-accum", "2"], "--grad-accum"),
        (["--method", "oib_all", "--grad-accum", "2"], "--grad-accum"),
    ],
)
def test_contradictions_are_refused_by_flag(flags, blamed):
    with pytest.raises(ConfigError) as caught:
        resolved(*flags)
    assert caught.value.flag == blamed


def test_grad_accum_below_one_is_refused(tmp_path, capsys):
    assert finetune(tmp_path, "--grad-accum", "0") != 0
    assert "--grad-accum" in capsys.readouterr().err


def model_of(out: Path) -> dict[str, torch.Tensor]:
    return ckpt_io.load_checkpoint(out / "checkpoint.pt")["model"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.parametrize(("scope", "baseline"), [("all", "standard"), ("dense", "standard_no_expert_clip")])
@pytest.mark.usefixtures("deferred_saving_lost")
def test_sonar_with_accumulation_equals_its_baseline_accumulating_alike(tmp_path, scope, baseline):
    assert finetune(tmp_path / "sonar", "--grad-accum", "2", "--clip-scope", scope) == 0
    assert finetune(tmp_path / "base", "--method", baseline, "--grad-accum", "2") == 0
    sonar, base = model_of(tmp_path / "sonar"), model_of(tmp_path / "base")
    assert sonar.keys() == base.keys()
    assert [k for k in sonar if not torch.equal(sonar[k], base[k])] == []
    lines = metrics(tmp_path / "sonar")
    assert len(lines) == 3 and all(line["kept_operand_peak_bytes"] > 0 for line in lines)
    assert "kept_operand_peak_bytes" not in metrics(tmp_path / "base")[0]
    # Teeth: the same baseline without accumulation (half the examples per step) trains differently.
    assert finetune(tmp_path / "ga1", "--method", baseline) == 0
    ga1 = model_of(tmp_path / "ga1")
    assert all(not torch.equal(ga1[k], base[k]) for k in base)


@pytest.mark.usefixtures("deferred_saving_lost")
def test_resume_with_accumulation_and_the_global_clip_is_bitwise(tmp_path):
    flags = ("--grad-accum", "2", "--clip-scope", "all", "--steps", "4")
    assert finetune(tmp_path / "straight", *flags) == 0
    assert finetune(tmp_path / "split", *flags, "--stop-after", "2") == 0
    assert finetune(tmp_path / "split", *flags, "--resume") == 0
    a = ckpt_io.load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = ckpt_io.load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert a["step"] == b["step"] == 4 and a["identity"]["grad_accum"] == 2
    assert a["identity"]["method"] == "sonar_deferred"
    for key in ("model", "optimizers", "schedulers", "stream", "identity"):
        assert_same_state(a[key], b[key], key)
    # A resume with another accumulation is refused (it would change the remaining steps' arithmetic).
    assert (
        finetune(tmp_path / "split", "--grad-accum", "3", "--clip-scope", "all", "--steps", "4", "--resume")
        != 0
    )
