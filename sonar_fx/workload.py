"""What measured arms train on: fixed-shape windows of the built-in synthetic instruction set.

For: `sonar-fx demo` and the benchmarks, so that every arm of a comparison sees the same tokens in the
same order and no compiled graph ever sees a new shape. The instruction set is byte-tokenised and
packed into (batch, seq) windows (labels = inputs: every token is supervised); held-out windows come
from other records. Never: measure anything, or shuffle differently for different arms.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sonar_fx.data import ByteTokenizer, format_example, synthetic_records

Batch = dict[str, Tensor]
HELD_OUT_SEED_OFFSET = 10_000
"""Held-out windows are cut from the records of seed + this offset: records the training windows never
contain."""


def make_batches(n: int, batch: int, seq: int, *, seed: int = 0, held_out: bool = False) -> list[Batch]:
    """`n` packed (batch, seq) windows of the synthetic instruction set; held-out uses other records."""
    ids = _token_stream(n * batch * seq, seed=seed + (HELD_OUT_SEED_OFFSET if held_out else 0))
    out = []
    for i in range(n):
        window = ids[i * batch * seq : (i + 1) * batch * seq].view(batch, seq)
        out.append({"input_ids": window, "labels": window.clone()})
    return out


def _token_stream(n_tokens: int, *, seed: int) -> Tensor:
    tok = ByteTokenizer()
    ids: list[int] = []
    n_records = 64
    while len(ids) < n_tokens:
        ids = []
        # synthetic_records(m, s) is a prefix of synthetic_records(n, s): growing n keeps the stream stable.
        for record in synthetic_records(n_records, seed=seed):
            prompt, response = format_example(record)
            ids += [tok.bos_id, *tok.encode(prompt + response), tok.eos_id]
        n_records *= 2
    return torch.tensor(ids[:n_tokens], dtype=torch.int64)


def random_batches(n: int, *, vocab: int = 259, batch: int = 2, seq: int = 16, seed: int = 1) -> list[Batch]:
    """`n` (batch, seq) batches of uniformly random token ids below `vocab` (labels = inputs), from a
    generator seeded with `seed`: for tests and benchmarks whose models need no meaningful text."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@torch.no_grad()
def held_out_loss(model: nn.Module, batches: list[Batch]) -> float:
    """Mean loss of the (eager) model on held-out batches: compares what each arm learned."""
    was_training = model.training
    model.eval()
    losses = [float(model(**b).loss.float()) for b in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
