"""Drop, precisely, log lines of other libraries that a sonar-fx user did not ask for and cannot act on.

transformers imports torchao (when it probes quantizers) as a model is built, and torchao's import:
- tries to load its CUDA kernel libraries (`torchao/_C_cutlass_90a.abi3.so`, `_C_mxfp8...so`), which
  cannot load where CUDA is absent: it logs "Failed to load ..." for each;
- registers its enums as pytree constants, which torch now logs as deprecated, once per enum.
Each filter matches one message from one logger, and only what is certain to be that noise (no CUDA,
an enum defined by torchao): a real failure, or the same message about anything else, still shows.
Installed when this module is imported (by `import sonar_fx`); it never touches a logger's level or
any other record. One filter is scoped instead, to the code that asks for it:
`quiet_norm_over_mesh_dims()`, around the FSDP2 x EP clip's norm over its 2-D mesh (see there).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Its CUDA kernel libraries (`_C_cutlass_90a`, `_C_mxfp8`), never the plain `_C` one.
_TORCHAO_CUDA_LIBRARY = re.compile(r"^Failed to load \S*torchao/_C_\w+\.[\w.-]*so: ")
_ENUM_REGISTERED = "is an Enum subclass and is now natively supported"


class _TorchaoCudaLibraryOnCpu(logging.Filter):
    """torchao's "Failed to load" of a CUDA kernel library, on a machine without CUDA."""

    def filter(self, record: logging.LogRecord) -> bool:
        return torch.cuda.is_available() or not _TORCHAO_CUDA_LIBRARY.match(record.getMessage())


class _TorchaoEnumAsConstant(logging.Filter):
    """torch's deprecation notice for an enum that torchao (not the user) registers as a constant."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _ENUM_REGISTERED not in str(record.msg) or not record.args:
            return True
        enum = record.args[0] if isinstance(record.args, tuple) else None
        return not getattr(enum, "__module__", "").startswith("torchao.")


class _NormOverMeshDims(logging.Filter):
    """DTensor's note that a norm partial over several mesh dimensions (`_NormPartial` on each) is
    reduced by one all-reduce per dimension; the same note about any other redistribution shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_SEQUENTIAL_COLLECTIVES) or not isinstance(record.args, tuple):
            return True
        sources, comm = record.args[0], record.args[3]
        norms = isinstance(sources, tuple) and all(getattr(p, "norm_type", None) is not None for p in sources)
        return not (comm == "all_reduce" and norms)


_SEQUENTIAL_COLLECTIVES = "While redistributing from %s to %s, %d sequential %s operations"
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


@contextmanager
def quiet_norm_over_mesh_dims() -> Iterator[None]:
    """Drop DTensor's "2 sequential all_reduce operations" note for the norms taken inside this block.

    torchtitan's clip on FSDP2 x EP reads each expert gradient as a DTensor over the (dp, ep) mesh, so
    its norm is partial over both dimensions and DTensor reduces it one dimension after the other.
    That is the arithmetic torchtitan's clip has and the one the tests compare against bitwise: one
    all-reduce over a flattened mesh would sum in another order and round otherwise (on a 2 x 2 mesh),
    and every rank runs the same two all-reduces, so ranks agree. The note asks the user to change
    nothing they wrote. DTensor notes each (mesh, dims) once, so the same norm on this run's mesh
    elsewhere stays quiet too."""
    logger, quiet = logging.getLogger(_REDISTRIBUTE_LOGGER), _NormOverMeshDims()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


_FILTERS = {"torchao": _TorchaoCudaLibraryOnCpu(), "torch.utils._pytree": _TorchaoEnumAsConstant()}


def install() -> None:
    """Add the filters to their loggers (idempotent)."""
    for name, log_filter in _FILTERS.items():
        logger = logging.getLogger(name)
        if log_filter not in logger.filters:
            logger.addFilter(log_filter)


install()
