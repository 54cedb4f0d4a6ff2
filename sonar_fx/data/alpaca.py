"""Alpaca files: a JSON list or JSONL, read record by record with the line of each record known.

For: loading ``{"instruction", "input", "output"}`` records and refusing bad input with a `DataError`
that names the file, line, record and the fix. Never: let a Python exception from the parser escape
(deep nesting, bad UTF-8, a lone surrogate) or drop a record silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sonar_fx.data.types import DataError

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
    record = {"instruction": obj["instruction"], "input": inp, "output": obj["output"]}
    for field, text in record.items():
        _check_text(text, where, index, field)
    return record


def _check_text(text: str, where: str, index: int, field: str) -> None:
    """A JSON `\\u` escape (four hex digits) can spell half of a surrogate pair, which no tokenizer can
    encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: record {index}: field {field!r} holds a lone surrogate "
            f"({text[exc.start]!r} at character {exc.start}), which is not text; fix or drop that "
            "\\u escape (a character outside the BMP is written as a surrogate pair)"
        ) from exc


def _decode(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int]:
    """`raw_decode` whose every failure is a `JSONDecodeError` located in the document."""
    try:
        return decoder.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nesting too deep for Python's JSON parser", text, pos) from None
    except ValueError as exc:  # e.g. an integer longer than Python's int-parsing limit
        raise json.JSONDecodeError(str(exc), text, pos) from None


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
            obj, end = _decode(dec, text, pos)
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
    dec = json.JSONDecoder()
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is text
        if not line.strip():  # blank lines (e.g. a trailing newline) are not records
            continue
        try:
            start = _WS.match(line).end()  # type: ignore[union-attr]
            obj, end = _decode(dec, line, start)
            if line[end:].strip():
                raise json.JSONDecodeError("extra data after the object", line, end)
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
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".json", ".jsonl"))[:3]
        found = f" (it holds {', '.join(inside)})" if inside else ""
        raise DataError(
            f"{path}: is a directory, not a data file{found}; pass the path of an Alpaca .json list or "
            ".jsonl file"
        )
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass the path of an Alpaca .json list or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a BOM from Windows editors
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc}); re-save the file as UTF-8") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror}); check its permissions") from exc
    is_json_list = text.lstrip().startswith("[")
    records = _load_json(text, path) if is_json_list else _load_jsonl(text, path)
    if not records:
        raise DataError(f"{path}: empty dataset (no records); add Alpaca records or pick another file")
    return records
