"""`sonar-fx finetune --parallel ddp|fsdp2|ep|fsdp2_ep`: under torchrun, rank 0 logs and writes, metrics carry
the world size, and a run stopped and resumed (same world size) is bitwise the uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sonar_fx.cli import main
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.config import TrainConfig, run_identity

import distributed_worker


@pytest.mark.multiprocess
@pytest.mark.subprocess
def test_torchrun_ddp_run_writes_once_with_the_world_size(tmp_path):
    out = tmp_path / "run"
    # --standalone: torchrun picks a free port itself (a fixed one collides with any other run at once).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "sonar_fx", "finetune", "--model", "tiny-reference", "--parallel", "ddp",
           "--compiler", "eager", "--train-size", "8", "--held-out", "4", "--steps", "2", "--no-progress",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done: 2 steps on 2 ranks (ddp)") == 1  # rank 0 speaks for the run
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and {r["world_size"] for r in lines} == {2}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["config"]["parallel"] == "ddp"
    assert summary["sonar"]["updates_by_hook"] == 2 * 4


@pytest.mark.multiprocess
def test_stop_and_resume_is_exact_on_every_engine(tmp_path):
    distributed_worker.run("distributed_cases_cli:resume_is_exact", str(tmp_path), timeout_s=1200)
    for rank, seen in enumerate(distributed_worker.results(str(tmp_path))):
        for engine in ("ddp", "fsdp2", "ep", "fsdp2_ep"):
            assert seen[engine]["codes"] == [0, 0, 0], (rank, engine)
            assert seen[engine]["differ"] == [], (rank, engine)
            assert seen[engine]["moved_after_resume"], (rank, engine)
            # One builder for every method on every engine: Sonar equals its twin built there.
            assert seen[engine]["baseline_code"] == 0 and seen[engine]["vs_baseline"] == [], (rank, engine)
        assert all("checkpoint.rank1.pt" in seen[engine]["files"] for engine in ("fsdp2", "ep", "fsdp2_ep"))
        assert "checkpoint.rank1.pt" not in seen["ddp"]["files"]  # replicated: rank 0's file serves all


def test_parallel_outside_torchrun_is_refused_naming_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    code = main(["finetune", "--model", "tiny-reference", "--parallel", "ddp", "--out", str(tmp_path)])
    assert code == 2
    assert "torchrun --nproc-per-node 2 -m sonar_fx finetune" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["oib_all", "sonar_per_expert"])
def test_methods_an_engine_does_not_run_are_refused(tmp_path, capsys, monkeypatch, method):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = main(["finetune", "--model", "tiny-reference", "--parallel", "ep", "--method", method,
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 2 and "--method" in capsys.readouterr().err


def test_resume_on_another_world_size_is_refused_naming_it(monkeypatch, tmp_path):
    cfg = TrainConfig(parallel="fsdp2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    saved = run_identity(cfg, "hash")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ckpt_io.CheckpointError, match=r"torchrun --nproc-per-node: checkpoint has 2, this run has 4"
    ):
        ckpt_io.check_identity(tmp_path / "checkpoint.pt", saved, run_identity(cfg, "hash"))
    assert "world_size" not in run_identity(TrainConfig(), "hash")  # one process: identity as before


def test_resume_on_another_fsdp2_ep_mesh_is_refused_naming_ep_size(monkeypatch, tmp_path):
    """The mesh decides what each rank's checkpoint holds: the default --ep-size is the world size, so
    `--ep-size 4` on 4 ranks resumes a run that left it out, and `--ep-size 2` is refused."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    saved = run_identity(TrainConfig(parallel="fsdp2_ep"), "hash")
    ckpt_io.check_identity(
        tmp_path / "c.pt", saved, run_identity(TrainConfig(parallel="fsdp2_ep", ep_size=4), "hash")
    )
    with pytest.raises(ckpt_io.CheckpointError, match=r"--ep-size: checkpoint has 4, this run has 2"):
        ckpt_io.check_identity(
            tmp_path / "c.pt", saved, run_identity(TrainConfig(parallel="fsdp2_ep", ep_size=2), "hash")
        )
