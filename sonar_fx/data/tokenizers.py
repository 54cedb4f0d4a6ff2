"""Tokenizers for fine-tuning: the built-in byte tokenizer and local Hugging Face tokenizers.

For: turning text into ids behind one small `Tokenizer` protocol. Never: contact a hub (a tokenizer
loads from a local directory only) or add special tokens itself (`encoding` places BOS/EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


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
