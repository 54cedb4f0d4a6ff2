"""Data layer for fine-tuning MoE models on Alpaca-format instructions.

What it is for: turning an Alpaca JSON/JSONL file (or the built-in synthetic instruction set) into
deterministic, resumable training batches, with the loss on response tokens only, and a hash that
proves two runs saw the same data.

What it must never do: contact a model or dataset hub (tokenizers load from a local directory only),
depend on process state for determinism (no Python ``hash()``, no global RNG: every shuffle takes an
explicit seed), silently drop or mangle a record (bad input raises ``DataError`` naming file, line,
record and fix; examples dropped by truncation are counted), or import training/optimizer code.

Conventions: ``labels`` are aligned with ``input_ids`` (unshifted, the Hugging Face causal-LM
convention: the model shifts internally) and carry ``IGNORE_INDEX`` (-100) where no loss is taken.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

import torch

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "PROMPT_NO_INPUT",
    "PROMPT_WITH_INPUT",
    "BatchStream",
    "ByteTokenizer",
    "DataError",
    "EncodedSet",
    "Example",
    "HFTokenizer",
    "Tokenizer",
    "collate",
    "data_hash",
    "encode_example",
    "encode_records",
    "format_example",
    "load_records",
    "load_tokenizer",
    "split_records",
    "synthetic_records",
]


class DataError(ValueError):
    """Bad dataset input; the message names the file, line, record index and the fix."""


class Example(TypedDict):
    input_ids: list[int]
    labels: list[int]


# ----------------------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then PAD=256, BOS=257, EOS=258 (vocab_size 259)."""

    vocab_size = 259
    pad_id = 256
    bos_id = 257
    eos_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids are structure, not text; a cut multi-byte character decodes as U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter giving a transformers tokenizer the ``Tokenizer`` interface.

    No special tokens are added by ``encode``: ``encode_example`` places BOS/EOS itself so the prompt mask
    is exact. Tokenizers without a BOS token (GPT-2, Qwen) use EOS as BOS; without PAD, EOS is the pad
    (padding positions are masked in ``attention_mask`` and ``labels``, so its value never matters).
    """

    def __init__(self, tok: Any, name: str = "") -> None:
        if tok.eos_token_id is None:
            raise ValueError(
                f"tokenizer {name!r} has no EOS token; set eos_token in its tokenizer_config.json"
            )
        self.tok = tok
        self.vocab_size: int = len(tok)
        self.eos_id: int = int(tok.eos_token_id)
        self.bos_id: int = int(tok.bos_token_id) if tok.bos_token_id is not None else self.eos_id
        self.pad_id: int = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> ``ByteTokenizer``; otherwise a LOCAL tokenizer directory (the hub is never contacted)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"tokenizer {spec!r}: no such directory; pass 'byte' for the built-in byte tokenizer or a "
            "local directory holding tokenizer files (no hub is reachable, nothing is downloaded)"
        )
    from transformers import AutoTokenizer  # deferred: heavy import, unused for the byte tokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # re-raised with the path and the fix; the cause stays chained
        raise ValueError(
            f"tokenizer {spec!r}: cannot load a tokenizer from this directory ({type(exc).__name__}: {exc}); "
            "it needs tokenizer.json or the tokenizer files save_pretrained writes"
        ) from exc
    return HFTokenizer(tok, spec)


# ------------------------------------------------------------------------------------------- records

_WS = re.compile(r"[ \t\n\r]*")
_FIX = "every record needs string fields 'instruction' and 'output' ('input' is optional)"


def _check_record(obj: Any, where: str, index: int) -> dict[str, str]:
    """Validate one raw record; returns exactly the three Alpaca fields."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: record {index} is a {type(obj).__name__}, not an object; {_FIX}")
    for field in ("instruction", "output"):
        if field not in obj:
            raise DataError(f"{where}: record {index}: missing field {field!r}; {_FIX}")
        if not isinstance(obj[field], str):
            raise DataError(f"{where}: record {index}: field {field!r} is not a string; {_FIX}")
    inp = obj.get("input")
    if inp is None:
        inp = ""
    if not isinstance(inp, str):
        raise DataError(f"{where}: record {index}: field 'input' is not a string; {_FIX}")
    return {"instruction": obj["instruction"], "input": inp, "output": obj["output"]}


def _iter_json_array(text: str) -> Iterator[tuple[Any, int]]:
    """Yield (element, start offset) of a top-level JSON array, so each record knows its line.

    Syntax errors raise ``json.JSONDecodeError`` with positions in the whole document.
    """
    dec = json.JSONDecoder()
    pos = _WS.match(text, 0).end()  # type: ignore[union-attr]  # `[ \t\n\r]*` always matches
    if text[pos : pos + 1] != "[":
        raise json.JSONDecodeError("expected '[' (an Alpaca JSON file is a list of records)", text, pos)
    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    if text[pos : pos + 1] == "]":
        pos += 1
    else:
        while True:
            obj, end = dec.raw_decode(text, pos)
            yield obj, pos
            pos = _WS.match(text, end).end()  # type: ignore[union-attr]
            sep = text[pos : pos + 1]
            if sep == "]":
                pos += 1
                break
            if sep != ",":
                raise json.JSONDecodeError("expected ',' or ']' after a record", text, pos)
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    if pos != len(text):
        raise json.JSONDecodeError("extra data after the list", text, pos)


def _load_json(text: str, path: Path) -> list[dict[str, str]]:
    records = []
    try:
        for i, (obj, start) in enumerate(_iter_json_array(text)):
            records.append(_check_record(obj, f"{path}:{text.count(chr(10), 0, start) + 1}", i))
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}; fix the file at that position "
            "(a .json dataset is one list of objects; use .jsonl for one object per line)"
        ) from exc
    return records


def _load_jsonl(text: str, path: Path) -> list[dict[str, str]]:
    records: list[dict[str, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():  # blank lines (e.g. a trailing newline) are not records
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = " (a .json dataset must be a list: [{...}, ...])" if path.suffix == ".json" else ""
            raise DataError(
                f"{path}:{lineno}:{exc.colno}: malformed JSONL line: {exc.msg}; "
                f"each line must be one complete JSON object{hint}"
            ) from exc
        records.append(_check_record(obj, f"{path}:{lineno}", len(records)))
    return records


def load_records(path: str | Path) -> list[dict[str, str]]:
    """Load Alpaca records: a JSON list, or JSONL (one object per line; chosen when the file does not
    start with '['). Each record comes back as ``{"instruction", "input", "output"}`` (``input``
    defaults to ""; other keys are dropped). Record indices in errors are 0-based."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass the path of an Alpaca .json list or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a BOM from Windows editors
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc}); re-save the file as UTF-8") from exc
    is_json_list = text.lstrip().startswith("[")
    records = _load_json(text, path) if is_json_list else _load_jsonl(text, path)
    if not records:
        raise DataError(f"{path}: empty dataset (no records); add Alpaca records or pick another file")
    return records


# ------------------------------------------------------------------------------------------ synthetic

_WORD_TEXT = (
    "apple river stone cloud tiger lemon piano rocket garden silver window candle forest yellow "
    "planet bridge orange castle dragon winter summer pepper rabbit mirror ocean violet copper "
    "button meadow falcon harbor marble pencil thunder velvet kitten saddle lantern cactus"
)
_WORDS = tuple(_WORD_TEXT.split())
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _task_add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"Add {a} and {b}.", "", str(a + b)


def _task_subtract(rng: random.Random) -> tuple[str, str, str]:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    return f"Subtract {b} from {a}.", "", str(a - b)


def _task_reverse(rng: random.Random) -> tuple[str, str, str]:
    s = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 8)))
    return "Reverse the string.", s, s[::-1]


def _task_sort(rng: random.Random) -> tuple[str, str, str]:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    return f"Sort {', '.join(map(str, xs))} in ascending order.", "", ", ".join(map(str, sorted(xs)))


def _task_to_json(rng: random.Random) -> tuple[str, str, str]:
    keys = rng.sample(_LETTERS, rng.randint(1, 3))
    pairs = {k: rng.randint(0, 9) for k in keys}
    src = ";".join(f"{k}={v}" for k, v in pairs.items())
    return f"Convert '{src}' to JSON.", "", json.dumps(pairs)


def _task_upper(rng: random.Random) -> tuple[str, str, str]:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 2)))
    return "Uppercase this.", text, text.upper()


def _task_count(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(_WORDS) + rng.choice(_WORDS)
    letter = rng.choice(word)
    return f"How many times does the letter '{letter}' appear in '{word}'?", "", str(word.count(letter))


_TASKS = (_task_add, _task_subtract, _task_reverse, _task_sort, _task_to_json, _task_upper, _task_count)


def synthetic_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A deterministic synthetic instruction set with short, checkable outputs.

    Task kinds rotate (add, subtract, reverse, sort, key=value -> JSON, uppercase, letter count) so every
    kind is equally present; some use the ``input`` field, some not, covering both prompt templates.
    Every record fits in 256 byte tokens untruncated (the Alpaca preamble alone is 140-205 bytes, so
    tasks with an ``input`` stay short). Duplicates are avoided (bounded retries) so held-out records
    are unseen in training. Same
    ``(n, seed)`` gives identical records, and ``synthetic_records(m, s)`` is a prefix of
    ``synthetic_records(n, s)`` for m <= n.
    """
    if n < 0:
        raise ValueError(f"synthetic_records: n must be >= 0, got {n}")
    rng = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    records = []
    for i in range(n):
        task = _TASKS[i % len(_TASKS)]
        for _ in range(64):  # small task spaces (add: 10^4 pairs) may run out; then accept a repeat
            instruction, inp, output = task(rng)
            if (instruction, inp) not in seen:
                break
        seen.add((instruction, inp))
        records.append({"instruction": instruction, "input": inp, "output": output})
    return records


# ---------------------------------------------------------------------------------- prompt + encoding

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_example(record: dict[str, str]) -> tuple[str, str]:
    """The standard Alpaca template: returns (prompt, response)."""
    inp = record.get("input") or ""
    template = PROMPT_WITH_INPUT if inp else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=inp), record["output"]


def encode_example(record: dict[str, str], tokenizer: Tokenizer, max_len: int = 256) -> Example | None:
    """BOS + prompt + response + EOS; labels are IGNORE_INDEX on BOS and the prompt.

    Prompt and response are tokenized separately so the mask boundary is exact for any tokenizer.
    Truncation keeps the start (the whole prompt first, then as much response as fits). Returns None
    when no response token survives truncation (an example with no supervised token contributes
    nothing but padding); ``encode_records`` counts these.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (BOS plus one token), got {max_len}")
    prompt, response = format_example(record)
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    response_ids = [*tokenizer.encode(response), tokenizer.eos_id]
    input_ids = (prompt_ids + response_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_len]
    if all(x == IGNORE_INDEX for x in labels):
        return None
    return Example(input_ids=input_ids, labels=labels)


@dataclass(frozen=True)
class EncodedSet:
    examples: list[Example]
    """Encoded examples, in record order, without the dropped ones."""
    n_dropped: int
    """Records dropped because truncation to ``max_len`` left no response token."""
    n_truncated: int
    """Kept examples that lost part of their response (or EOS) to truncation."""


def encode_records(records: Sequence[dict[str, str]], tokenizer: Tokenizer, max_len: int = 256) -> EncodedSet:
    """Encode every record; examples with no supervised token are dropped and counted, never hidden."""
    examples: list[Example] = []
    n_dropped = n_truncated = 0
    for record in records:
        ex = encode_example(record, tokenizer, max_len)
        if ex is None:
            n_dropped += 1
            continue
        if len(ex["input_ids"]) == max_len and ex["labels"][-1] != tokenizer.eos_id:
            n_truncated += 1
        examples.append(ex)
    if records and not examples:
        raise DataError(
            f"all {len(records)} records were dropped: their prompts fill max_len={max_len}; raise max_len"
        )
    return EncodedSet(examples, n_dropped, n_truncated)


# ------------------------------------------------------------------------------------ split + batches


def split_records(
    records: Sequence[dict[str, str]], n_train: int, n_held_out: int, seed: int = 42
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """One seeded shuffle; train = its first ``n_train``, held-out = the next ``n_held_out`` (disjoint by
    index). The paper uses n_train=8000, n_held_out=500."""
    if n_train < 0 or n_held_out < 0:
        raise ValueError(f"n_train and n_held_out must be >= 0, got {n_train} and {n_held_out}")
    need = n_train + n_held_out
    if need > len(records):
        raise DataError(
            f"split needs {need} records (n_train={n_train} + n_held_out={n_held_out}) but the dataset "
            f"has {len(records)}; lower n_train/n_held_out or use a larger dataset"
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[:n_train]], [records[i] for i in order[n_train:need]]


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids/attention_mask/labels, all (B, T) int64;
    padding has attention_mask 0 and label IGNORE_INDEX."""
    if not examples:
        raise ValueError("collate: empty batch")
    t = max(len(ex["input_ids"]) for ex in examples)
    input_ids = torch.full((len(examples), t), pad_id, dtype=torch.int64)
    labels = torch.full((len(examples), t), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((len(examples), t), dtype=torch.int64)
    for row, ex in enumerate(examples):
        n = len(ex["input_ids"])
        if len(ex["labels"]) != n:
            raise ValueError(f"collate: example {row} has {n} input_ids but {len(ex['labels'])} labels")
        input_ids[row, :n] = torch.tensor(ex["input_ids"], dtype=torch.int64)
        labels[row, :n] = torch.tensor(ex["labels"], dtype=torch.int64)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class BatchStream:
    """Endless, deterministic train batches for step-based training.

    Each epoch is a fresh seeded permutation of the examples (seeded by (seed, epoch), so batch k is a
    pure function of (examples, batch_size, seed, k)); a final partial batch is dropped so every step has
    ``batch_size`` examples. ``position`` counts batches served; restoring it via ``load_state_dict``
    makes a resumed run see exactly the batches an uninterrupted run would.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0, pad_id: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(examples) < batch_size:
            raise DataError(
                f"BatchStream: {len(examples)} examples cannot fill one batch of {batch_size}; "
                "lower batch_size or add examples"
            )
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.position = 0
        self.batches_per_epoch = len(examples) // batch_size
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            # A string seed is hashed with sha512 by `random`: stable across processes and PYTHONHASHSEED.
            self._perm = list(range(len(self.examples)))
            random.Random(f"sonar-fx:{self.seed}:{epoch}").shuffle(self._perm)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> dict[str, torch.Tensor]:
        epoch, k = divmod(self.position, self.batches_per_epoch)
        idx = self._permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
        self.position += 1
        return collate([self.examples[i] for i in idx], self.pad_id)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch()

    @property
    def epoch(self) -> int:
        return self.position // self.batches_per_epoch

    def state_dict(self) -> dict[str, int]:
        # The identity fields let load_state_dict refuse a state from a differently configured stream.
        return {
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "n_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "n_examples"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"BatchStream state has {key}={state[key]} but this stream has {key}={mine[key]}; "
                    "resume with the same data, batch_size and seed or the batches will differ"
                )
        if int(state["position"]) < 0:
            raise ValueError(f"BatchStream position must be >= 0, got {state['position']}")
        self.position = int(state["position"])


def data_hash(batches: Iterable[dict[str, torch.Tensor]], n: int = 4) -> str:
    """sha256 hex of the first ``n`` batches' input_ids and labels (values, shapes, order).

    Stable across processes and runs: only shapes and int64 bytes (native order: little-endian on
    every platform torch ships for) are hashed. It consumes
    up to ``n`` batches from ``batches``: pass a fresh ``BatchStream`` (or a copy restored from a state
    dict), not the one a training loop is reading. Fewer than ``n`` batches are hashed as they are.
    """
    h = hashlib.sha256()
    # islice, not enumerate+break: an endless stream must not lose batch n+1 to the check.
    for i, batch in enumerate(itertools.islice(batches, n)):
        for key in ("input_ids", "labels"):
            t = batch[key].detach().to(device="cpu", dtype=torch.int64).clone()  # clone: compact storage
            h.update(f"{i}:{key}:{tuple(t.shape)};".encode())
            h.update(bytes(t.untyped_storage()))
    return h.hexdigest()
