"""Tests for sonar_fx.data: masking, truncation, splits, determinism, resume, hashing, input errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonar_fx.data import (
    IGNORE_INDEX,
    BatchStream,
    ByteTokenizer,
    DataError,
    collate,
    data_hash,
    encode_example,
    encode_records,
    format_example,
    load_records,
    load_tokenizer,
    split_records,
    synthetic_records,
)

REPO = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()
REC = {"instruction": "Add 17 and 25.", "input": "", "output": "42"}
REC_IN = {"instruction": "Reverse the string.", "input": "abc", "output": "cba"}


def _encoded(n: int = 40, seed: int = 0) -> list:
    return encode_records(synthetic_records(n, seed), TOK, max_len=256).examples


# ------------------------------------------------------------------------------------------ tokenizer


def test_byte_tokenizer_roundtrip_and_specials() -> None:
    assert (TOK.vocab_size, TOK.pad_id, TOK.bos_id, TOK.eos_id) == (259, 256, 257, 258)
    ids = TOK.encode("héllo {}")
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode([TOK.bos_id, *ids, TOK.eos_id, TOK.pad_id]) == "héllo {}"
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_unknown_tokenizer_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        load_tokenizer(str(missing))


def test_hf_tokenizer_from_local_dir(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.encode("hello world") == [3, 4]
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (1, 1, 1)  # no BOS/PAD: both fall back to EOS
    assert tok.decode([3, 4, 1]) == "hello world"
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        (tmp_path / "empty").mkdir()
        load_tokenizer(str(tmp_path / "empty"))  # exists, but holds no tokenizer files


# ---------------------------------------------------------------------------------- prompt + masking


def test_format_example_with_and_without_input() -> None:
    prompt, response = format_example(REC)
    assert prompt.endswith("### Instruction:\nAdd 17 and 25.\n\n### Response:\n")
    assert "### Input:" not in prompt and response == "42"
    prompt, response = format_example(REC_IN)
    assert "### Input:\nabc\n\n### Response:\n" in prompt and response == "cba"


def test_masking_prompt_ignored_response_supervised() -> None:
    ex = encode_example(REC, TOK)
    assert ex is not None
    prompt, _ = format_example(REC)
    n_prompt = 1 + len(TOK.encode(prompt))  # BOS + prompt
    assert ex["input_ids"] == [TOK.bos_id, *TOK.encode(prompt), *TOK.encode("42"), TOK.eos_id]
    assert ex["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:] == [*TOK.encode("42"), TOK.eos_id]


def test_truncation_keeps_prompt_start_and_drops_unsupervised() -> None:
    long = {"instruction": "Echo.", "input": "", "output": "x" * 100}
    n_prompt = 1 + len(TOK.encode(format_example(long)[0]))
    ex = encode_example(long, TOK, max_len=n_prompt + 5)
    assert ex is not None and len(ex["input_ids"]) == len(ex["labels"]) == n_prompt + 5
    assert ex["labels"][n_prompt:] == TOK.encode("xxxxx")  # EOS cut off
    assert encode_example(long, TOK, max_len=n_prompt) is None  # no response token survives
    fits = {"instruction": "Echo.", "input": "", "output": "x"}
    overflows = {"instruction": "Echo this.", "input": "", "output": "x"}  # prompt alone is 6 longer
    enc = encode_records([long, fits, overflows], TOK, max_len=n_prompt + 5)
    assert (len(enc.examples), enc.n_dropped, enc.n_truncated) == (2, 1, 1)
    with pytest.raises(DataError, match="raise max_len"):
        encode_records([long], TOK, max_len=10)


# ------------------------------------------------------------------------------------------ synthetic


def test_synthetic_deterministic_and_correct() -> None:
    a, b = synthetic_records(70, seed=3), synthetic_records(70, seed=3)
    assert a == b
    assert a != synthetic_records(70, seed=4)
    assert synthetic_records(20, seed=3) == a[:20]
    assert len({(r["instruction"], r["input"]) for r in a}) == 70  # no duplicates
    for r in a:
        assert set(r) == {"instruction", "input", "output"} and 0 < len(r["output"]) <= 32
        m = re.fullmatch(r"Add (\d+) and (\d+)\.", r["instruction"])
        if m:
            assert int(r["output"]) == int(m[1]) + int(m[2])
        if r["instruction"] == "Reverse the string.":
            assert r["output"] == r["input"][::-1]
        if r["instruction"].startswith("Convert '"):
            assert isinstance(json.loads(r["output"]), dict)
    kinds = {r["instruction"].split()[0] for r in a}
    assert kinds == {"Add", "Subtract", "Reverse", "Sort", "Convert", "Uppercase", "How"}
    assert any(r["input"] for r in a) and any(not r["input"] for r in a)  # both templates


def test_synthetic_fits_byte_model_context() -> None:
    enc = encode_records(synthetic_records(700, seed=1), TOK, max_len=256)
    assert (len(enc.examples), enc.n_dropped, enc.n_truncated) == (700, 0, 0)


# -------------------------------------------------------------------------------------------- split


def test_split_sizes_disjoint_deterministic() -> None:
    records = [{"instruction": f"i{k}", "input": "", "output": str(k)} for k in range(50)]
    train, held = split_records(records, 30, 15, seed=42)
    assert (len(train), len(held)) == (30, 15)
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    assert (train, held) == split_records(records, 30, 15, seed=42)
    assert train != split_records(records, 30, 15, seed=7)[0]
    assert train != records[:30]  # actually shuffled
    with pytest.raises(DataError, match="has 50"):
        split_records(records, 40, 11)


# ------------------------------------------------------------------------------------ collate + stream


def test_collate_shapes_and_padding() -> None:
    exs = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    b = collate(exs, pad_id=9)  # type: ignore[arg-type]
    for key in ("input_ids", "attention_mask", "labels"):
        assert b[key].shape == (2, 3) and b[key].dtype == torch.int64
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]


def test_batch_stream_resume_matches_uninterrupted() -> None:
    exs = _encoded(22)
    ref = BatchStream(exs, batch_size=4, seed=5, pad_id=TOK.pad_id)  # 5 batches/epoch
    ref_batches = [ref.next_batch() for _ in range(10)]  # crosses an epoch boundary
    run = BatchStream(exs, batch_size=4, seed=5, pad_id=TOK.pad_id)
    for _ in range(3):
        next(run)
    state = run.state_dict()
    assert state["position"] == 3
    resumed = BatchStream(exs, batch_size=4, seed=5, pad_id=TOK.pad_id)
    resumed.load_state_dict(state)
    for want in ref_batches[3:]:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # epochs reshuffle: epoch 1 is not a replay of epoch 0
    epoch0, epoch1 = ref_batches[:5], ref_batches[5:]
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(epoch0, epoch1, strict=True))
    with pytest.raises(ValueError, match="seed=6"):
        BatchStream(exs, batch_size=4, seed=6).load_state_dict(state)


# ------------------------------------------------------------------------------------------- hashing

_HASH_SNIPPET = (
    "from sonar_fx.data import *; t = ByteTokenizer(); "
    "ex = encode_records(synthetic_records(30, 1), t).examples; "
    "print(data_hash(BatchStream(ex, 4, seed=2, pad_id=t.pad_id)))"
)


@pytest.mark.subprocess
def test_data_hash_stable_and_sensitive() -> None:
    tok = TOK
    exs = encode_records(synthetic_records(30, 1), tok).examples
    h = data_hash(BatchStream(exs, 4, seed=2, pad_id=tok.pad_id))
    assert h == data_hash(BatchStream(exs, 4, seed=2, pad_id=tok.pad_id)) and len(h) == 64
    assert h != data_hash(BatchStream(exs, 4, seed=3, pad_id=tok.pad_id))
    stream = BatchStream(exs, 4, seed=2, pad_id=tok.pad_id)
    batches = [stream.next_batch() for _ in range(4)]
    assert data_hash(batches) == h
    batches[3]["labels"][0, -1] += 1
    assert data_hash(batches) != h
    stream = BatchStream(exs, 4, seed=2, pad_id=tok.pad_id)
    data_hash(stream, n=2)
    assert stream.position == 2  # consumes exactly n batches
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"}
    out = subprocess.run(
        [sys.executable, "-c", _HASH_SNIPPET], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == h


# ------------------------------------------------------------------------------------ loading + errors


def test_load_json_and_jsonl(tmp_path: Path) -> None:
    js = tmp_path / "d.json"
    js.write_text(json.dumps([REC_IN, {"instruction": "a", "output": "b", "extra": 1}], indent=2))
    assert load_records(js) == [REC_IN, {"instruction": "a", "input": "", "output": "b"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps(REC) + "\n\n" + json.dumps(REC_IN) + "\n")
    assert load_records(jl) == [REC, REC_IN]


def test_malformed_json_names_line_and_col(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a" "output": "b"}\n]\n')
    with pytest.raises(DataError, match=re.escape(f"{p}:3:") + r"\d+: malformed JSON"):
        load_records(p)


def test_jsonl_bad_line_number(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(REC) + "\n\n" + '{"instruction": "a", "output": \n')
    with pytest.raises(DataError, match=re.escape(f"{p}:3:")):
        load_records(p)


def test_missing_field_names_record_index(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(REC) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{p}:2: record 1: missing field 'output'")):
        load_records(p)
    q = tmp_path / "d.json"
    q.write_text(json.dumps([REC, REC, {"output": "y"}], indent=1))
    with pytest.raises(DataError, match=r"d\.json:\d+: record 2: missing field 'instruction'"):
        load_records(q)


@pytest.mark.parametrize("content", ["", "[]", "\n\n"])
def test_empty_dataset(tmp_path: Path, content: str) -> None:
    p = tmp_path / "empty.json"
    p.write_text(content)
    with pytest.raises(DataError, match=re.escape(f"{p}: empty dataset")):
        load_records(p)


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{p}: no such file")):
        load_records(p)


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "alpaca.json").write_text(json.dumps([REC]))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}: is a directory") + r".*alpaca\.json"):
        load_records(tmp_path)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_deep_nesting_is_a_data_error_naming_the_line(tmp_path: Path, suffix: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    p = tmp_path / f"deep{suffix}"
    if suffix == ".json":
        p.write_text("[\n" + json.dumps(REC) + ",\n" + deep + "\n]\n")
        line = 3
    else:
        p.write_text(json.dumps(REC) + "\n" + deep + "\n")
        line = 2
    with pytest.raises(DataError, match=re.escape(f"{p}:{line}:") + r"\d+: malformed JSON.*nesting too deep"):
        load_records(p)


def test_a_lone_surrogate_names_record_and_field(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(REC) + "\n" + '{"instruction": "x", "output": "a\\udc80b"}\n')
    with pytest.raises(DataError, match=re.escape(f"{p}:2: record 1: field 'output' holds a lone surrogate")):
        load_records(p)
    q = tmp_path / "pair.jsonl"  # a proper surrogate pair is one character outside the BMP
    q.write_text('{"instruction": "\\ud83d\\ude00", "output": "b"}\n')
    assert load_records(q)[0]["instruction"] == "\U0001f600"


def test_jsonl_lines_split_on_newline_only(tmp_path: Path) -> None:
    # U+2028 is valid inside a JSON string; str.splitlines() would cut the record in two.
    rec = {"instruction": "a\u2028b\x85c", "input": "", "output": "d"}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(rec, ensure_ascii=False) + "\r\n" + json.dumps(REC) + "\n", encoding="utf-8")
    assert load_records(p) == [rec, REC]
