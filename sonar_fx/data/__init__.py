"""Data for fine-tuning MoE models on Alpaca-format instructions.

What it is for: turning an Alpaca JSON/JSONL file (or the built-in synthetic instruction set) into
deterministic, resumable training batches, with the loss on response tokens only, and a hash that
proves two runs saw the same data. One module per concern: `tokenizers`, `alpaca` (file loading),
`synthetic` (the built-in set), `encoding` (prompt template and masks), `batching` (split, collate,
the resumable stream), `hashing`.

What it must never do: contact a model or dataset hub (tokenizers load from a local directory only),
depend on process state for determinism (no Python ``hash()``, no global RNG: every shuffle takes an
explicit seed), silently drop or mangle a record (bad input raises ``DataError`` naming file, line,
record and fix; examples dropped by truncation are counted), or import training/optimizer code.
"""

from sonar_fx.data.alpaca import load_records
from sonar_fx.data.batching import BatchStream, collate, pad_to, split_records, supervised_tokens
from sonar_fx.data.encoding import (
    PROMPT_NO_INPUT,
    PROMPT_WITH_INPUT,
    EncodedSet,
    encode_example,
    encode_records,
    format_example,
)
from sonar_fx.data.hashing import data_hash
from sonar_fx.data.synthetic import synthetic_records
from sonar_fx.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from sonar_fx.data.types import IGNORE_INDEX, DataError, Example

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
    "pad_to",
    "split_records",
    "supervised_tokens",
    "synthetic_records",
]
