"""A user's run is never lost: fresh runs never overwrite one, metrics.jsonl survives kills, SIGTERM
saves, corrupted checkpoints are refused, a step that raises writes nothing, and every recovery
path ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonar_fx.cli import main
from sonar_fx.methods import TrainingMethod
from sonar_fx.trainer import checkpoint as ckpt_io

from helpers import flip_a_byte_of_tensor_data

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "finetune", "--model", "tiny-reference", "--method", "sonar", "--compiler", "eager", "--train-size", "12",
    "--held-out", "0", "--steps", "6", "--warmup", "2", "--lr", "1e-2", "--min-lr", "1e-3",
    "--max-grad-norm", "0.5", "--weight-decay", "0.01", "--save-every", "2", "--no-progress",
]  # fmt: skip
CHILD_TIMEOUT_S = 300


def finetune(out: Path, *extra: str) -> int:
    return main([*COMMON, "--out", str(out), *extra])


def child(fault: str, n: int, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """A separate `sonar-fx` process that kills or signals itself on cue (tests/fault_child.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "tests" / "fault_child.py"), fault, str(n), *COMMON, "--out", str(out)]
    return subprocess.run(
        [*cmd, *extra], env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )


def steps_in_metrics(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The checkpoint of an uninterrupted 6-step run, the reference every recovery must equal."""
    out = tmp_path_factory.mktemp("straight")
    assert finetune(out) == 0
    return ckpt_io.load_checkpoint(out / "checkpoint.pt")


def assert_equals_straight(out: Path, straight: dict) -> None:
    ckpt = ckpt_io.load_checkpoint(out / "checkpoint.pt")
    assert ckpt["step"] == straight["step"] == 6
    # Equal checksums: every tensor (weights, both optimizer groups' moments and steps, torch's RNG)
    # bitwise equal, and every other value (schedulers, stream position, identity) equal. Python's
    # `random` state is saved but not the run's: no step draws from it, and it depends on the process.
    differ = sorted(
        k for k in straight["checksums"]
        if ckpt["checksums"].get(k) != straight["checksums"][k] and k != "<values>/rng"
    )  # fmt: skip
    assert ckpt["checksums"].keys() == straight["checksums"].keys() and not differ, differ
    for name, tensor in straight["model"].items():
        assert torch.equal(ckpt["model"][name], tensor), name
    assert steps_in_metrics(out) == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------ the --out folder


def test_a_fresh_run_refuses_an_out_that_holds_a_run(tmp_path, capsys):
    assert finetune(tmp_path, "--steps", "1") == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")}
    capsys.readouterr()
    assert finetune(tmp_path, "--steps", "2") == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} already holds a run (checkpoint.pt, metrics.jsonl, summary.json)" in err
    assert "--resume" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if not p.name.startswith(".")} == before
    assert finetune(tmp_path, "--steps", "2", "--overwrite") == 0
    assert steps_in_metrics(tmp_path) == [1, 2]  # replaced, not appended to the old run's lines


def test_summary_is_strict_json_with_null_for_what_was_not_measured(tmp_path):
    assert finetune(tmp_path, "--steps", "1") == 0  # one step: nothing is timed

    def refuse(constant: str) -> None:
        raise AssertionError(f"summary.json holds {constant}")

    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert summary["median_step_ms"] is None and summary["timed_steps"] == 0
    assert summary["config"]["compiler"] == "eager" and summary["config"]["sonar_pass"] is True


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    assert finetune(tmp_path, "--steps", "2") == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    capsys.readouterr()
    assert finetune(tmp_path, "--steps", "2", "--resume") == 0
    assert "already finished: the checkpoint is at step 2 of 2" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------------------------ metrics.jsonl


def test_resume_drops_later_and_torn_lines_without_emptying_metrics(tmp_path, straight):
    assert finetune(tmp_path, "--stop-after", "4") == 0
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    # What a run killed during step 6 leaves: step 5 written after the checkpoint, step 6 cut short.
    metrics.write_text("\n".join([*lines, lines[-1].replace('"step": 4', '"step": 5'), '{"step": 6, "lo']))
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: dropped 1 unreadable line\(s\) \(line 6\)"):
        assert finetune(tmp_path, "--resume") == 0
    assert metrics.read_text().splitlines()[:4] == lines
    assert_equals_straight(tmp_path, straight)


# ------------------------------------------------------------------------------------ checkpoints


def test_a_corrupted_checkpoint_is_refused_naming_the_file(tmp_path, capsys):
    assert finetune(tmp_path, "--stop-after", "2") == 0
    ckpt = tmp_path / "checkpoint.pt"
    flip_a_byte_of_tensor_data(ckpt)
    before = (tmp_path / "metrics.jsonl").read_bytes(), ckpt.read_bytes()
    capsys.readouterr()
    assert finetune(tmp_path, "--resume") == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt}: the file is corrupted: 1 entry (/" in err, err
    assert ((tmp_path / "metrics.jsonl").read_bytes(), ckpt.read_bytes()) == before  # nothing rewritten


def test_the_checksum_covers_every_tensor_and_the_other_values(tmp_path):
    model = torch.nn.Linear(2, 2)
    kwargs = dict(
        identity={"model": "x"}, model=model, optimizers=[], schedulers=[], stream_state={"position": 3}
    )
    ckpt_io.save_checkpoint(tmp_path / "c.pt", step=1, **kwargs)
    ckpt = ckpt_io.load_checkpoint(tmp_path / "c.pt")
    assert {"/model/weight", "/model/bias", "/rng/torch", "<values>/stream"} <= ckpt["checksums"].keys()
    ckpt["stream"]["position"] = 4
    with pytest.raises(ckpt_io.CheckpointError, match="1 entry \\(the values of /stream\\)"):
        ckpt_io.verify(tmp_path / "c.pt", ckpt)


def test_temp_files_of_a_killed_save_are_removed_at_the_next_start(tmp_path, straight):
    assert finetune(tmp_path, "--stop-after", "4") == 0
    stale = tmp_path / ".checkpoint.pt.k1ll3d.tmp"
    stale.write_bytes(b"\0" * 4096)
    other = tmp_path / "notes.tmp"  # not ours: left alone
    other.write_text("keep")
    with pytest.warns(UserWarning, match=r"removed 1 temp file\(s\)"):
        assert finetune(tmp_path, "--resume") == 0
    assert not stale.exists() and other.exists()
    assert_equals_straight(tmp_path, straight)


# ------------------------------------------------------------------------------------ kills and signals


@pytest.mark.subprocess
def test_kill_9_during_a_save_then_resume_is_bitwise(tmp_path, straight):
    result = child("kill-in-save", 2, tmp_path)  # saves at steps 2, 4, 6: killed writing step 4's
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2  # the old one, intact
    assert len(list(tmp_path.glob(".checkpoint.pt.*.tmp"))) == 1
    with pytest.warns(UserWarning, match="left by an interrupted save"):
        assert finetune(tmp_path, "--resume") == 0
    assert not list(tmp_path.glob(".*.tmp"))
    assert_equals_straight(tmp_path, straight)


@pytest.mark.subprocess
def test_kill_9_in_the_first_step_after_a_resume_keeps_the_metrics(tmp_path, straight):
    assert finetune(tmp_path, "--stop-after", "2") == 0
    result = child("kill-in-step", 1, tmp_path, "--resume")  # killed after step 3's backward
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert steps_in_metrics(tmp_path) == [1, 2]
    assert finetune(tmp_path, "--resume") == 0
    assert_equals_straight(tmp_path, straight)


@pytest.mark.subprocess
def test_sigterm_saves_at_the_step_boundary_and_resume_is_bitwise(tmp_path, straight):
    result = child("term-at-step", 3, tmp_path)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "stopped by SIGTERM after step 3; checkpoint saved" in result.stderr
    assert ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 3  # off the save-every-2 cadence
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps_done"] == 3
    assert finetune(tmp_path, "--resume") == 0
    assert_equals_straight(tmp_path, straight)


def test_sigint_in_process_returns_130_after_saving(tmp_path, monkeypatch):
    # The handler in place before the run, whatever it is: Python's default in a terminal, SIG_IGN
    # for a job started in the background, xdist's or an IDE's own.
    before = signal.getsignal(signal.SIGINT)
    original, calls = TrainingMethod.train_step, []

    def interrupted(self, batch):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled: the step still completes
        return original(self, batch)

    monkeypatch.setattr(TrainingMethod, "train_step", interrupted)
    assert finetune(tmp_path) == 128 + signal.SIGINT
    assert ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, capsys, monkeypatch):
    original, calls = TrainingMethod.train_step, []

    def impatient(self, batch):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # raises here, in the middle of step 3
        return original(self, batch)

    monkeypatch.setattr(TrainingMethod, "train_step", impatient)
    assert finetune(tmp_path) == 128 + signal.SIGINT
    assert "SIGINT again: stopping now, without a checkpoint" in capsys.readouterr().err
    assert ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    assert steps_in_metrics(tmp_path) == [1, 2]


# ------------------------------------------------------------------------------------ faults in a step


def _fail_in_backward_of_layer_0_on_step(monkeypatch, step: int) -> None:
    """Raise inside the backward of the first layer at `step`: the layer above it has already had
    its experts updated in backward, so the model in memory is partly stepped."""
    from sonar_fx.trainer import run as run_module

    original, calls = run_module.build_method, []

    def build_with_fault(*args, **kwargs):
        method = original(*args, **kwargs)
        model = args[1]

        def hook(module, grad_input, grad_output):
            if len(calls) == step:
                raise RuntimeError("injected fault in layer 0's backward")

        model.layers[0].register_full_backward_hook(hook)
        return method

    monkeypatch.setattr(run_module, "build_method", build_with_fault)
    original_step = TrainingMethod.train_step
    monkeypatch.setattr(
        TrainingMethod, "train_step", lambda self, b: (calls.append(1), original_step(self, b))[1]
    )


def test_a_step_that_raises_writes_nothing_and_resume_is_bitwise(tmp_path, capsys, monkeypatch, straight):
    _fail_in_backward_of_layer_0_on_step(monkeypatch, 4)
    assert finetune(tmp_path) == 3
    err = capsys.readouterr().err
    assert "step 4 failed (RuntimeError: injected fault in layer 0's backward)" in err
    assert (
        f"the last checkpoint is step 2 ({tmp_path / 'checkpoint.pt'}): continue from it with --resume" in err
    )
    assert steps_in_metrics(tmp_path) == [1, 2, 3]  # nothing from step 4
    assert ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    assert not (tmp_path / "summary.json").exists()
    monkeypatch.undo()
    assert finetune(tmp_path, "--resume") == 0
    assert_equals_straight(tmp_path, straight)


def test_a_non_finite_loss_stops_the_run_before_its_step_is_recorded(tmp_path, capsys, monkeypatch):
    original, calls = TrainingMethod.train_step, []

    def nan_on_step_3(self, batch):
        calls.append(1)
        loss = original(self, batch)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(TrainingMethod, "train_step", nan_on_step_3)
    assert finetune(tmp_path) == 3
    assert "step 3 failed (FloatingPointError: training loss is nan; lower --lr" in capsys.readouterr().err
    assert steps_in_metrics(tmp_path) == [1, 2]


def _nan_gradients_on_step(monkeypatch, step: int) -> None:
    """Make the backward of step `step` run on a NaN loss, so every gradient is NaN."""
    calls = []

    def forward_backward(self, batch, micro_batches=1):
        calls.append(1)
        loss = self.model(**batch).loss
        if len(calls) == step:
            loss = loss * float("nan")
        loss.backward()
        return loss.detach()

    monkeypatch.setattr(TrainingMethod, "forward_backward", forward_backward)


def test_nan_gradients_stop_a_sonar_run_with_the_tensor_named(tmp_path, capsys, monkeypatch):
    _nan_gradients_on_step(monkeypatch, 3)
    assert finetune(tmp_path) == 3
    err = capsys.readouterr().err
    assert "step 3 failed (NonFiniteGradientError: non-finite expert gradients (inf or NaN) in layers." in err
    assert steps_in_metrics(tmp_path) == [1, 2]


def test_nonfinite_skip_skips_the_step_and_finishes(tmp_path, monkeypatch):
    _nan_gradients_on_step(monkeypatch, 3)
    assert finetune(tmp_path, "--nonfinite", "skip") == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"] is None, r["nonfinite_loss"]) for r in lines][2] == (3, True, True)
    sonar = json.loads((tmp_path / "summary.json").read_text())["sonar"]
    assert sonar["skipped_steps"] == 1 and sum(sonar["skipped_updates"].values()) == sonar["expert_tensors"]


def test_nonfinite_policy_is_refused_for_a_baseline(capsys):
    assert main([*COMMON, "--method", "standard", "--nonfinite", "skip"]) == 2
    assert "--nonfinite 'skip' is invalid: expected 'raise' for a baseline" in capsys.readouterr().err
