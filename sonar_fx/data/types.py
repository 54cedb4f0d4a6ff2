"""The data layer's shared vocabulary: the loss mask value, an encoded example and the input error.

For: the few names every data module uses. Never: hold logic (it imports nothing of the project).
Conventions: ``labels`` are aligned with ``input_ids`` (unshifted, the Hugging Face causal-LM
convention: the model shifts internally) and carry ``IGNORE_INDEX`` (-100) where no loss is taken.
"""

from __future__ import annotations

from typing import TypedDict

IGNORE_INDEX = -100


class DataError(ValueError):
    """Bad dataset input; the message names the file, line, record index and the fix."""


class Example(TypedDict):
    input_ids: list[int]
    labels: list[int]
