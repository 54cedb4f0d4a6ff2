"""Splits and batches: a seeded train/held-out split, collation and the resumable batch stream.

For: batches that are a pure function of (examples, batch size, seed, position), so a resumed run sees
exactly the batches an uninterrupted run would. Never: draw from a global RNG.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import torch

from sonar_fx.data.types import IGNORE_INDEX, DataError, Example


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


def pad_to(batch: Mapping[str, torch.Tensor], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a collated batch to `length` (one shape for every step: one compiled graph)."""
    extra = length - batch["input_ids"].shape[1]
    if extra <= 0:
        return dict(batch)
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
    return {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in batch.items()}


def supervised_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    """Tokens that carry loss (labels are shifted by one inside the model)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


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
