"""Every bad input the command line knows exits 2 before training, with a message naming the flag,
file, line or key, and the docs' table of them (docs/failures.md) is this file's `CASES`, so it cannot
drift.

Regenerate the docs table after changing `CASES`: python tests/test_bad_input.py --write-docs
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sonar_fx.cli import main

from helpers import flip_a_byte_of_tensor_data

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "failures.md"
BEGIN, END = "<!-- bad-input-table: begin (tests/test_bad_input.py) -->", "<!-- bad-input-table: end -->"
BASE = ["--model", "tiny-reference", "--compiler", "eager", "--train-size", "8", "--held-out", "4",
        "--steps", "2", "--no-progress"]  # fmt: skip
SHOWN = {"{out}": "OUT", "{file}": "FILE", "{dir}": "DIR"}
"""Placeholders of `Case.flags` and `Case.expect`, as the docs show them."""


def _write(text: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / "data.jsonl").write_text(text, encoding="utf-8")


def _a_run(*extra: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        assert main(["finetune", *BASE, "--steps", "1", "--out", str(tmp / "out"), *extra]) == 0

    return setup


def _a_corrupted_run(tmp: Path) -> None:
    _a_run()(tmp)
    flip_a_byte_of_tensor_data(tmp / "out" / "checkpoint.pt")


RECORD = json.dumps({"instruction": "Add 1 and 2.", "output": "3"})


@dataclass(frozen=True)
class Case:
    input: str
    """What the user did, for the docs."""
    flags: tuple[str, ...]
    """After `sonar-fx finetune` (and the test's small, fast defaults), unless `command` says otherwise."""
    expect: str
    """A part of the message on stderr."""
    setup: Callable[[Path], None] | None = None
    command: str = "finetune"


CASES = (
    Case("a typo in a model override key", ("--model", "tiny-olmoe", "--model-override", "num_expertz=64"),
         "--model-override num_expertz: tiny-olmoe's config (OlmoeConfig) has no field 'num_expertz'; "
         "did you mean num_experts?"),
    Case("an unknown override key, built-in reference model", ("--model-override", "num_expertz=4"),
         "--model-override num_expertz: tiny-reference's config (ReferenceMoEConfig) has no field"),
    Case("an override value of the wrong type", ("--model-override", "num_experts=many"),
         "--model-override num_experts='many': expected int"),
    Case("a negative size", ("--model-override", "hidden_size=-8"),
         "--model-override hidden_size=-8: a count or size, expected >= 1"),
    Case("top-k above the expert count", ("--model-override", "top_k=8"),
         "--model-override: top_k=8 routes each token to more experts than num_experts=4"),
    Case("an override without a value", ("--model-override", "num_experts"),
         "--model-override 'num_experts': expected KEY=VALUE"),
    Case("an unknown model", ("--model", "tiny-nope"), "--model 'tiny-nope': not a built-in model"),
    Case("an unknown device", ("--device", "tpu"), "--device 'tpu' is invalid: expected cpu, cuda or cuda:N"),
    Case("a seed out of range", ("--seed", str(2**70)),
         f"--seed {2**70} is invalid: expected an integer in [-2**63, 2**64)"),
    Case("a negative LR", ("--lr", "-1"), "--lr: AdamWConfig.lr=-1.0 is invalid"),
    Case("a beta out of [0, 1)", ("--betas", "1.5", "0.9"), "--betas: AdamWConfig.betas[0]=1.5 is invalid"),
    Case("a final LR above the peak", ("--min-lr", "1", "--lr", "1e-3"), "--min-lr 1.0 is above --lr 0.001"),
    Case("zero steps", ("--steps", "0"), "--steps 0 is invalid: expected >= 1"),
    Case("a batch larger than the data", ("--batch-size", "64"),
         "only 8 training examples for --batch-size 64"),
    Case("hooks on a compiled model without a compiler", ("--hooks-on-compiled",),
         "--hooks-on-compiled: Execution.sonar_pass=False (hooks on a compiled model) needs compiler "
         "'aot_eager' or 'inductor'"),
    Case("a missing tokenizer directory", ("--tokenizer", "{dir}/none"),
         "--tokenizer: tokenizer '{dir}/none': no such directory"),
    Case("a directory as data", ("--data", "{dir}"), "{dir}: is a directory, not a data file"),
    Case("a missing data file", ("--data", "{dir}/none.json"), "{dir}/none.json: no such file"),
    Case("malformed JSON", ("--data", "{file}"), "{file}:2:21: malformed JSONL line: Expecting ',' delimiter",
         setup=_write(RECORD + '\n{"instruction": "a" "output": "b"}\n')),
    Case("an empty data file", ("--data", "{file}"), "{file}: empty dataset (no records)",
         setup=_write("\n")),
    Case("a record without 'output'", ("--data", "{file}"), "{file}:2: record 1: missing field 'output'",
         setup=_write(RECORD + '\n{"instruction": "x"}\n')),
    Case("a deeply nested JSON line", ("--data", "{file}"),
         "{file}:2:1: malformed JSONL line: nesting too deep for Python's JSON parser",
         setup=_write(RECORD + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")),
    Case("a lone surrogate in a record", ("--data", "{file}"),
         "{file}:1: record 0: field 'instruction' holds a lone surrogate",
         setup=_write('{"instruction": "a\\ud800", "output": "b"}\n')),
    Case("an --out that holds a run, without --resume", ("--out", "{out}"),
         "--out {out} already holds a run (checkpoint.pt, metrics.jsonl, summary.json); continue it with "
         "--resume, replace it with --overwrite, or pick another --out", setup=_a_run()),
    Case("--overwrite with --resume", ("--out", "{out}", "--overwrite", "--resume"),
         "--overwrite replaces the run in --out, --resume continues it: pass one of them"),
    Case("an --out that cannot be written", ("--out", "{file}/run"), "--out {file}/run: cannot write there",
         setup=_write(RECORD)),
    Case("--resume without a checkpoint", ("--out", "{out}", "--resume"),
         "--resume {out}/checkpoint.pt: no such checkpoint"),
    Case("--resume with another setting", ("--out", "{out}", "--resume", "--lr", "1e-2"),
         "the checkpoint is from another model or config, so training would not continue the same run:\n"
         "  --lr: checkpoint has 0.003, this run has 0.01", setup=_a_run()),
    Case("--resume from a corrupted checkpoint", ("--out", "{out}", "--resume"),
         "--resume {out}/checkpoint.pt: the file is corrupted", setup=_a_corrupted_run),
    Case("demo with zero steps", ("--steps", "0"), "argument --steps: expected an integer >= 1, got '0'",
         command="demo"),
)  # fmt: skip


def _fill(text: str, tmp: Path) -> str:
    return text.format(out=tmp / "out", file=tmp / "data.jsonl", dir=tmp)


def _shown(text: str) -> str:
    for placeholder, shown in SHOWN.items():
        text = text.replace(placeholder, shown)
    return text


def _argv(case: Case) -> list[str]:
    """The command line the test runs, placeholders unfilled: the docs show exactly this."""
    if case.command == "demo":
        return ["demo", *case.flags]
    return ["finetune", *BASE, *([] if "--out" in case.flags else ["--out", "{dir}/fresh"]), *case.flags]


def _run(case: Case, tmp: Path) -> int:
    try:
        return main([_fill(a, tmp) for a in _argv(case)])
    except SystemExit as exc:  # argparse's own errors exit 2 after printing the usage
        return int(exc.code or 0)


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.input for c in CASES])
def test_bad_input_exits_2_naming_what_is_wrong(tmp_path, capsys, case):
    if case.setup:
        case.setup(tmp_path)
    before = _files(tmp_path)
    capsys.readouterr()
    assert _run(case, tmp_path) == 2
    err = capsys.readouterr().err
    assert _fill(case.expect, tmp_path) in err, err
    assert "Traceback" not in err
    assert _files(tmp_path) == before  # nothing written or changed


@pytest.mark.subprocess
def test_the_exit_status_reaches_the_shell(tmp_path):
    cmd = [sys.executable, "-m", "sonar_fx", "finetune", *BASE, "--out", str(tmp_path), "--device", "tpu"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "--device 'tpu' is invalid" in result.stderr


def docs_table() -> str:
    rows = ["| input | command | exit | the message says |", "|---|---|---|---|"]
    for case in CASES:
        command = " ".join(["sonar-fx", *(_shown(a) for a in _argv(case))])
        message = " ".join(_shown(case.expect).split()).replace("|", "\\|")
        rows.append(f"| {case.input} | `{command}` | 2 | `{message}` |")
    return "\n".join([BEGIN, *rows, END])


def _docs_section(text: str) -> str:
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_the_docs_table_is_this_files_cases():
    assert _docs_section(DOCS.read_text()) == docs_table(), (
        "docs/failures.md's bad-input table is stale: run `python tests/test_bad_input.py --write-docs`"
    )


if __name__ == "__main__" and sys.argv[1:] == ["--write-docs"]:
    text = DOCS.read_text()
    DOCS.write_text(text.replace(_docs_section(text), docs_table()))
