"""Checkpoints: resume is bitwise (6 steps straight == 3 steps, stop, resume, 3 steps), writes are
atomic, and a checkpoint from another model or config is refused with what differs named."""

from pathlib import Path

import pytest
import torch

from sonar_fx.cli import main
from sonar_fx.trainer import checkpoint as ckpt_io

COMMON = [
    "finetune", "--model", "tiny-olmoe", "--compiler", "eager", "--train-size", "12", "--held-out", "0",
    "--steps", "6", "--warmup", "2", "--lr", "1e-2", "--min-lr", "1e-3", "--max-grad-norm", "0.5",
    "--weight-decay", "0.01", "--no-progress",
]  # fmt: skip


def finetune(out: Path, *extra: str) -> int:
    return main([*COMMON, "--out", str(out), *extra])


def assert_same_state(a: object, b: object, where: str = "") -> None:
    """Every tensor equal (torch.equal) and every other value equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("method", ["sonar", "standard"])
def test_resume_is_bitwise(tmp_path, method):
    assert finetune(tmp_path / "straight", "--method", method) == 0
    assert finetune(tmp_path / "split", "--method", method, "--stop-after", "3") == 0
    halfway = ckpt_io.load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert halfway["step"] == 3
    assert finetune(tmp_path / "split", "--method", method, "--resume") == 0

    a = ckpt_io.load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = ckpt_io.load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert a["step"] == b["step"] == 6
    for key in ("model", "optimizers", "schedulers", "stream", "identity"):
        assert_same_state(a[key], b[key], key)
    # The halfway weights differ from the final ones, so the comparison above has teeth.
    moved = [k for k, v in halfway["model"].items() if not torch.equal(v, a["model"][k])]
    assert len(moved) == len(a["model"])
    steps = [line for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines() if line]
    assert len(steps) == 6  # the resumed run continues the metrics file, one line per step


def test_optimizer_state_covers_expert_and_dense_tensors(tmp_path):
    assert finetune(tmp_path, "--method", "sonar", "--steps", "2") == 0
    ckpt = ckpt_io.load_checkpoint(tmp_path / "checkpoint.pt")
    (opt_state,) = ckpt["optimizers"]
    names = [g["name"] for g in opt_state["param_groups"]]
    assert names == ["dense", "experts"]
    n_params = sum(len(g["params"]) for g in opt_state["param_groups"])
    assert len(opt_state["state"]) == n_params == len(ckpt["model"])
    assert all(float(s["step"]) == 2.0 for s in opt_state["state"].values())


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--lr", "2e-2"], "--lr"),
        (["--method", "standard"], "--method"),
        (["--model-override", "num_experts=4"], "--model-override"),
        (["--train-size", "14"], "--train-size"),
    ],
)
def test_resume_refuses_another_config(tmp_path, capsys, flags, named):
    assert finetune(tmp_path, "--method", "sonar", "--stop-after", "1") == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert finetune(tmp_path, "--method", "sonar", *flags, "--resume") == 2
    err = capsys.readouterr().err
    assert "another model or config" in err and named in err, err
    assert (tmp_path / "metrics.jsonl").read_text() == before  # refused before training


def test_resume_refuses_another_model(tmp_path, capsys):
    assert finetune(tmp_path / "a", "--method", "standard", "--stop-after", "1") == 0
    capsys.readouterr()
    args = ["--method", "standard", "--resume", str(tmp_path / "a")]
    assert main([*COMMON, "--model", "tiny-reference", "--out", str(tmp_path / "b"), *args]) == 2
    assert "--model: checkpoint has 'tiny-olmoe', this run has 'tiny-reference'" in capsys.readouterr().err


def test_resume_without_a_checkpoint_names_the_path(tmp_path, capsys):
    assert finetune(tmp_path, "--resume") == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "checkpoint.pt") in err and "no such checkpoint" in err


def test_save_is_atomic(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    path = tmp_path / "checkpoint.pt"
    kwargs = dict(identity={"model": "x"}, model=model, optimizers=[], schedulers=[], stream_state={})
    ckpt_io.save_checkpoint(path, step=1, **kwargs)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt_io.save_checkpoint(path, step=2, **kwargs)
    assert ckpt_io.load_checkpoint(path)["step"] == 1  # the old checkpoint survives intact
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left behind
