"""What a user reads: other libraries' noise is dropped precisely (the same message about anything else
still shows), and the progress bar names each memory figure for what it measures."""

from __future__ import annotations

import enum
import logging
import os

import pytest
import torch

import sonar_fx  # noqa: F401  (installs the log filters)
from sonar_fx.log_filters import quiet_norm_over_mesh_dims
from sonar_fx.memory import _UNKNOWN_BLOCK, _native_stderr_without
from sonar_fx.trainer.loop import _postfix


def shown(logger_name: str, msg: str, *args: object) -> bool:
    """Whether the logger's own filters let this record through."""
    record = logging.LogRecord(logger_name, logging.WARNING, __file__, 1, msg, args, None)
    return bool(logging.getLogger(logger_name).filter(record))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the filter keeps the message where CUDA exists")
def test_torchaos_cuda_library_failure_is_dropped_on_cpu_and_nothing_else():
    prefix = "Failed to load /site-packages/torchao/"
    assert not shown("torchao", prefix + "_C_cutlass_90a.abi3.so: libcuda.so.1: cannot open")
    assert not shown("torchao", prefix + "_C_mxfp8.cpython-311-x86_64-linux-gnu.so: undefined symbol")
    assert shown("torchao", prefix + "_C.abi3.so: undefined symbol")  # its CPU library failing is real
    assert shown("torchao", "Failed to load /elsewhere/_C_cutlass_90a.so: x")
    assert shown("torchao", "Skipping import of cpp extensions")


def test_torch_s_enum_notice_is_dropped_for_torchaos_enums_only():
    msg = "%s is an Enum subclass and is now natively supported"
    theirs = enum.Enum("Granularity", "A B")
    theirs.__module__ = "torchao.quantization.granularity"
    mine = enum.Enum("Mine", "A B")
    assert not shown("torch.utils._pytree", msg, theirs)
    assert shown("torch.utils._pytree", msg, mine)
    assert shown("torch.utils._pytree", "another notice about %s", theirs)


def test_dtensors_sequential_all_reduce_note_is_dropped_for_a_norm_inside_the_block_only():
    """The FSDP2 x EP clip's norm over its 2-D mesh (test_distributed_pass runs the real one): the note
    about a norm partial on both mesh dimensions is dropped inside `quiet_norm_over_mesh_dims`; a sum's,
    another collective's, or the same note outside the block still shows."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    logger = "torch.distributed.tensor._redistribute"
    msg = "While redistributing from %s to %s, %d sequential %s operations will be performed. %s"
    norms, replicated = (_NormPartial(2.0), _NormPartial(2.0)), (Replicate(), Replicate())
    with quiet_norm_over_mesh_dims():
        assert not shown(logger, msg, norms, replicated, 2, "all_reduce", "flatten")
        assert shown(logger, msg, (Partial(), Partial()), replicated, 2, "all_reduce", "flatten")
        assert shown(logger, msg, (Shard(0), Shard(0)), replicated, 2, "all_gather", "flatten")
    assert shown(logger, msg, norms, replicated, 2, "all_reduce", "flatten")


def test_the_profilers_unknown_block_line_is_dropped_and_other_native_lines_pass(capfd):
    with _native_stderr_without(_UNKNOWN_BLOCK):
        os.write(2, f"[W1201 c10] {_UNKNOWN_BLOCK}\n".encode())
        os.write(2, b"a native warning the user must see\n")
    err = capfd.readouterr().err
    assert _UNKNOWN_BLOCK not in err
    assert "a native warning the user must see" in err


def test_the_progress_bar_names_each_memory_figure():
    base = {"loss": 1.0, "step_ms": 10.0, "tokens_per_s": 100.0}
    cpu = _postfix({**base, "peak_rss_mib": 637.0, "expert_grad_peak_bytes": 3 * 2**20})
    assert cpu["rss_hw"] == "637MiB" and cpu["exp_grads"] == "3.0MiB" and "peak" not in cpu
    cuda = _postfix({**base, "cuda_max_allocated_mib": 900.0})
    assert cuda["cuda_hw"] == "900MiB" and "rss_hw" not in cuda and "exp_grads" not in cuda
