"""The deferred step's reduce-scatter input on FSDP2 (`deferred_sharded._world_chunked`): the gradient
itself where its memory already lies as FSDP2's world-chunked copy-in would lay it out (no copy), the
copy-in otherwise; the same values either way, bit for bit, against FSDP2's own `chunk_cat`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce_scatter_copy_in
from torch.distributed.fsdp._fully_shard._fsdp_common import _get_dim0_padded_size

from sonar_fx.distributed.deferred_sharded import _world_chunked


def fsdp2_copy_in(full: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    padded = _get_dim0_padded_size(full.size(), world)
    out = torch.empty((padded.numel(),), dtype=dtype)
    foreach_reduce_scatter_copy_in([full], out, world)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_contiguous_gradient_whose_dim0_the_world_divides_is_its_own_input(world):
    full = torch.randn(8, 6, 5, dtype=torch.bfloat16)
    chunked = _world_chunked(full, _get_dim0_padded_size(full.size(), world), torch.bfloat16, None, world)
    assert chunked.data_ptr() == full.data_ptr()  # no copy
    assert torch.equal(chunked, fsdp2_copy_in(full, world, torch.bfloat16))


@pytest.mark.parametrize(
    "make, reduce_dtype, predivide",
    [
        (lambda: torch.randn(3, 6, 5), torch.float32, None),  # dim 0 padded to the world
        (lambda: torch.randn(8, 5, 6).transpose(1, 2), torch.float32, None),  # another layout
        (lambda: torch.randn(8, 6, 5, dtype=torch.bfloat16), torch.float32, None),  # reduced in fp32
        (lambda: torch.randn(8, 6, 5, dtype=torch.float16), torch.float16, 1.5),  # pre-divided in place
    ],
    ids=["padded", "transposed", "cast", "predivided"],
)
def test_any_other_gradient_is_copied_in_as_fsdp2_copies_it(make, reduce_dtype, predivide):
    full = make()
    before = full.clone()
    chunked = _world_chunked(full, _get_dim0_padded_size(full.size(), 2), reduce_dtype, predivide, 2)
    assert chunked.data_ptr() != full.data_ptr()
    assert torch.equal(chunked, fsdp2_copy_in(full, 2, reduce_dtype))
    assert torch.equal(full, before)
