"""Drop, precisely, log lines of other libraries that a sonar-fx user did not ask for and cannot act on.

transformers imports torchao (when it probes quantizers) as a model is built, and torchao's import:
- tries to load its CUDA kernel libraries (`torchao/_C_cutlass_90a.abi3.so`, `_C_mxfp8...so`), which
  cannot load where CUDA is absent: it logs "Failed to load ..." for each;
- registers its enums as pytree constants, which torch now logs as deprecated, once per enum.
Each filter matches one message from one logger, and only what is certain to be that noise (no CUDA,
an enum defined by torchao): a real failure, or the same message about anything else, still shows.
Installed when this module is imported (by `import sonar_fx`); it never touches a logger's level or
any other record.
"""

from __future__ import annotations

import logging
import re

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


_FILTERS = {"torchao": _TorchaoCudaLibraryOnCpu(), "torch.utils._pytree": _TorchaoEnumAsConstant()}


def install() -> None:
    """Add the filters to their loggers (idempotent)."""
    for name, log_filter in _FILTERS.items():
        logger = logging.getLogger(name)
        if log_filter not in logger.filters:
            logger.addFilter(log_filter)


install()
