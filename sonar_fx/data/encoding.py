"""Prompt formatting and encoding: Alpaca records into examples whose loss covers the response only.

For: the standard Alpaca template, exact prompt masks and counted truncation. Never: silently drop
an example (dropped and truncated examples are counted in `EncodedSet`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sonar_fx.data.tokenizers import Tokenizer
from sonar_fx.data.types import IGNORE_INDEX, DataError, Example

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
