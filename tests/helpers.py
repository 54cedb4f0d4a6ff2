"""Shared test helpers: tiny models, fixed batches, and exact comparisons of training state."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch
from torch import nn

from sonar_fx.config import AdamWConfig
from sonar_fx.methods import TrainingMethod, build_method
from sonar_fx.models import build_model
from sonar_fx.workload import random_batches

# lr large enough that bf16 weights visibly move in 3 steps; small clip so clipping is active.
CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)


batches = random_batches  # vocab 259: the byte tokenizer's size, the tiny models' vocab


def trained(
    method: str, model_name: str, dtype: torch.dtype, steps: int = 3, cfg: AdamWConfig = CFG, **kwargs
) -> tuple[nn.Module, TrainingMethod]:
    model = build_model(model_name, dtype=dtype, seed=0)
    m = build_method(method, model, cfg, **kwargs)
    for b in batches(steps):
        m.train_step(b)
    return model, m


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    diff = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def weights_differ(a: nn.Module, b: nn.Module) -> list[str]:
    pb = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if not torch.equal(p, pb[n])]


def flip_a_byte_of_tensor_data(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor record of a torch.save zip (stored, not
    compressed), as a bad disk or a bad copy would."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with path.open("r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
