"""Compile a module's forward in place: the model stays the user's object, its class and signature.

`CompiledForward` replaces `module.forward` with the forward compiled by the sonar backend. The
module keeps its type, `state_dict()` keys, attributes and `inspect.signature(module.forward)`, so
code that reads a model (HF Trainer's column filter, PEFT, accelerate) sees the model it knows. A deep
copy or unpickled module gets a forward compiled for ITSELF (never one that runs the original), and a
dynamo failure falls back to the eager forward once, with a warning; nothing here updates anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sonar_fx.backend import record_fallback, sonar_backend
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.runtime import registry


class CompiledForward:
    """`module.forward`, compiled with the sonar backend; picklable and deep-copyable with its module."""

    def __init__(
        self, module: nn.Module, compiler: str, *, fallback: bool = True, **torch_compile_kwargs: Any
    ) -> None:
        self.module = module
        self.compiler = compiler
        self.fallback = fallback
        self.torch_compile_kwargs = torch_compile_kwargs
        self.eager_forward: Callable[..., Any] = type(module).forward
        backend = sonar_backend(compiler, fallback=fallback)
        self.compiled = torch.compile(self.eager_forward, backend=backend, **torch_compile_kwargs)
        self.failed = False
        self.__signature__ = inspect.signature(self.eager_forward.__get__(module))
        self.__doc__ = self.eager_forward.__doc__
        self.__name__ = getattr(self.eager_forward, "__name__", "forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return self.eager_forward(self.module, *args, **kwargs)
        if not self.fallback:
            return self.compiled(self.module, *args, **kwargs)
        try:
            return self.compiled(self.module, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            # Tracing failed before any backend ran (e.g. a graph break under fullgraph=True): no backward
            # ran on this forward, so nothing was updated yet and running it eagerly is safe.
            self.failed = True
            optimizer = self._optimizer()
            if optimizer is not None:
                record_fallback(optimizer, err)
            return self.eager_forward(self.module, *args, **kwargs)

    def _optimizer(self) -> SonarOptimizer | None:
        """The optimizer that owns this module's experts (it records the fallback)."""
        owners = (registry.owner_of(p) for p in self.module.parameters())
        return next((o for o in owners if isinstance(o, SonarOptimizer)), None)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt, never copied: a copy compiled for the copied module (deepcopy maps `self.module` to it).
        return (_rebuild, (self.module, self.compiler, self.fallback, self.torch_compile_kwargs))


def _rebuild(module: nn.Module, compiler: str, fallback: bool, kwargs: dict[str, Any]) -> CompiledForward:
    return CompiledForward(module, compiler, fallback=fallback, **kwargs)


def compile_forward_(
    module: nn.Module, compiler: str, *, fallback: bool, **torch_compile_kwargs: Any
) -> None:
    """Replace `module.forward` by its compiled forward, in place."""
    if isinstance(module.__dict__.get("forward"), CompiledForward):
        raise ValueError(f"{type(module).__name__}.forward is already compiled by sonar_fx.")
    module.forward = CompiledForward(module, compiler, fallback=fallback, **torch_compile_kwargs)


def repeated_blocks(model: nn.Module, expert_module_names: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """The blocks to compile regionally: the items of the `nn.ModuleList`s that hold expert layers.

    Blocks of one list share a class and code, so dynamo compiles one graph and reuses it for all.
    """
    lists = {name: m for name, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    blocks: dict[str, nn.Module] = {}
    for expert_name in expert_module_names:
        # The outermost list: decoder blocks, not a list of per-expert modules inside one block.
        owner = min((n for n in lists if _inside(expert_name, n) and expert_name != n), key=len, default=None)
        if owner is None:
            raise ValueError(
                f"regional=True compiles the repeated block that holds each expert layer, but "
                f"{expert_name!r} is not inside an nn.ModuleList of blocks. Compile the whole model "
                "(regional=False)."
            )
        index = expert_name[len(owner) :].lstrip(".").split(".")[0]
        block_name = f"{owner}.{index}" if owner else index
        blocks[block_name] = model.get_submodule(block_name)
    return list(blocks.items())


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")
