"""What the planned device adds to a step: its allocator's rounding, its cards' memory and bf16 rate.

For: `sonar_fx.plan` and `sonar-fx plan --device/--gpu`. A plan counts each storage as the target
device's allocator hands it out (`cuda_block_bytes`: the rules of torch's CUDA caching allocator, read
from c10/cuda/CUDACachingAllocator.cpp, with the constants of c10/core/AllocatorConfig.h), and with
`--gpu` turns a card's memory into a budget (`GPU.usable_bytes`) and a GEMM's FLOPs into a time at the
card's dense bf16 rate (`GPU.gemm_ms`). The card figures are vendors' datasheet numbers, each with its
source; the usable share is an assumption stated here and in docs/plan.md.
Never: measure anything (every figure here is a rule or a datasheet number, named).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MIN_BLOCK = 512
"""kMinBlockSize: every CUDA allocation is rounded up to a multiple of 512 bytes (`round_size`)."""
SMALL_SIZE = 1 << 20
"""kSmallSize: requests up to 1 MiB come from the small pool (2 MiB segments split to the 512 bytes)."""
MIN_LARGE_ALLOC = 10 << 20
"""kMinLargeAlloc: a large request under 10 MiB gets a 20 MiB segment, which is split."""
ROUND_LARGE = 2 << 20
"""kRoundLarge: a request of 10 MiB or more gets a segment rounded up to 2 MiB."""
CONTEXT_BYTES = 1 << 30
"""Memory of the card the CUDA context, cuBLAS/cuDNN handles and their workspaces take before the first
tensor (torch + CUDA 12 with lazy module loading: about 0.5 GiB of context, up to 0.1 GiB of cuBLAS
workspaces; 1 GiB is the figure assumed)."""
RESERVE_FRACTION = 0.05
"""Share of the card assumed held by the caching allocator beyond the allocated peak (segments' unsplit
remainders, fragmentation between steps): a plan counts allocated bytes, the card must hold reserved."""


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes `torch.cuda.memory_allocated` counts for one allocation of `nbytes` (0 for none).

    The allocator rounds a request up to 512 bytes (`round_size`). A request over 1 MiB and of 10 MiB
    or more, on a segment of its own, gets the segment (`get_allocation_size`: rounded up to 2 MiB),
    and the block is split only if more than 1 MiB would remain (`should_split`: remaining >
    kSmallSize); unsplit, the whole segment is the allocated block, and `allocated_bytes` counts
    `block->size`. Requests under 10 MiB get 20 MiB segments and are always split. In a training
    step the same sizes recur every step, so each large request finds the block its twin had in the
    step before: this rule is taken for every large request, reused or new.
    """
    if nbytes <= 0:
        return 0
    size = math.ceil(nbytes / MIN_BLOCK) * MIN_BLOCK
    if size <= SMALL_SIZE or size < MIN_LARGE_ALLOC:
        return size
    segment = math.ceil(size / ROUND_LARGE) * ROUND_LARGE
    return segment if segment - size <= SMALL_SIZE else size


def exact_bytes(nbytes: int) -> int:
    """The CPU allocator: the bytes asked for."""
    return max(nbytes, 0)


@dataclass(frozen=True, kw_only=True)
class GPU:
    """A card a plan can be made for."""

    name: str
    """`--gpu` name."""
    product: str
    memory_mib: int
    """Total memory as `nvidia-smi` reports it (MiB)."""
    bf16_tflops: float
    """Dense bf16 tensor-core rate, FP32 accumulate, without sparsity (vendor datasheet)."""
    source: str
    """Where `bf16_tflops` is from."""

    @property
    def total_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def usable_bytes(self) -> int:
        """What a step's allocated peak may reach: total, less the CUDA context and library workspaces
        (`CONTEXT_BYTES`), less the caching allocator's reserve (`RESERVE_FRACTION` of the total)."""
        return int(self.total_bytes - CONTEXT_BYTES - RESERVE_FRACTION * self.total_bytes)

    def gemm_ms(self, flops: float) -> float:
        """Milliseconds `flops` take at the datasheet rate: a floor (real GEMMs run below peak)."""
        return flops / (self.bf16_tflops * 1e12) * 1e3

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "product": self.product, "total_bytes": self.total_bytes,
                "usable_bytes": self.usable_bytes, "bf16_tflops": self.bf16_tflops,
                "source": self.source}  # fmt: skip


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(name="h100-80", product="H100 SXM5 80GB", memory_mib=81559, bf16_tflops=989.4,
            source="NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense"),
        GPU(name="h200", product="H200 SXM 141GB", memory_mib=143771, bf16_tflops=989.4,
            source="NVIDIA H200 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity, 989.4 dense"),
        GPU(name="a100-80", product="A100 SXM4 80GB", memory_mib=81920, bf16_tflops=312.0,
            source="NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)"),
        GPU(name="a100-40", product="A100 SXM4 40GB", memory_mib=40960, bf16_tflops=312.0,
            source="NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)"),
        GPU(name="l40s", product="L40S 48GB", memory_mib=46068, bf16_tflops=362.05,
            source="NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity)"),
        GPU(name="rtx4090", product="GeForce RTX 4090 24GB", memory_mib=24564, bf16_tflops=165.2,
            source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: peak BF16 Tensor TFLOPS with "
                   "FP32 accumulate 165.2 (330.4 with sparsity)"),
    )
}  # fmt: skip
"""The cards `--gpu` names."""
