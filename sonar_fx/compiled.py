"""Compile a module's forward in place: the model stays the user's object, its class and signature.

`CompiledForward` replaces `module.forward` with the forward compiled by the sonar backend. The
module keeps its type, `state_dict()` keys, attributes and `inspect.signature(module.forward)`, so
code that reads a model (HF Trainer's column filter, PEFT, accelerate) sees the model it knows. A deep
copy or unpickled module gets a forward compiled for ITSELF (never one that runs the original), and a
dynamo failure falls back to the eager forward once, with a warning; nothing here updates anything.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sonar_fx.backend import record_fallback, sonar_backend
from sonar_fx.errors import SavingLostError
from sonar_fx.optim.defer_eager import compiled_run
from sonar_fx.optim.optimizer import SonarOptimizer
from sonar_fx.optim.second_forward import forward_mark, second_forward_error
from sonar_fx.runtime import registry

_COMPILED_ATTR = "_sonar_compiled_forward"
TRACE_CHECKPOINTED_SIDE_EFFECTS = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
"""Dynamo settings every sonar compile traces with (a caller's `dynamo_config` may override them).

Dynamo refuses a Python side effect inside `torch.utils.checkpoint` (it cannot replay it in the
backward's recomputation, as eager does) and runs the frame eagerly: a checkpointed model then
computes every expert gradient outside any graph, and the in-graph saving is lost. Whenever the `kernels`
package is installed (transformers >= 5.25 requires it), transformers wraps most attention classes'
forward in its `use_kernelized_func`, a set/reset of a module-level routing variable (`kernels`'
`_ACTIVE_KERNEL_FUNCS`): a side effect in every checkpointed decoder layer. Set then reset, it leaves
nothing to replay; a capture hook (TRL's router logits) is not active during eager's recomputation
either. A side effect then runs once, in the forward; tensors are traced all the same."""


class CompiledForward:
    """`module.forward`, compiled with the sonar backend; picklable and deep-copyable with its module."""

    def __init__(
        self,
        module: nn.Module,
        compiler: str,
        *,
        fallback: bool = True,
        dynamo_config: dict[str, Any] | None = None,
        **torch_compile_kwargs: Any,
    ) -> None:
        """`dynamo_config`: dynamo settings patched in around every call (they shape tracing)."""
        self.module = module
        self.compiler = compiler
        self.fallback = fallback
        self.dynamo_config = dict(dynamo_config or {})
        self.torch_compile_kwargs = torch_compile_kwargs
        self.eager_forward: Callable[..., Any] = type(module).forward
        self._compiled: Callable[..., Any] | None = None  # built at the first call (see `compiled`)
        self.runs_eagerly = False
        """Run the eager forward: dynamo failed (fallback), or an inner module holds the compiled region."""
        self._owner: Callable[[], SonarOptimizer | None] | None = None  # weak, looked up once
        self._forward_at: tuple[int, int] | None = None  # (backwards began, steps ended) at the last one
        self.__signature__ = inspect.signature(self.eager_forward.__get__(module))
        self.__doc__ = self.eager_forward.__doc__
        self.__name__ = getattr(self.eager_forward, "__name__", "forward")
        # A bound-method look-alike: code that rewraps a forward (accelerate's mixed-precision autocast and
        # its unwrap, regional compilation) takes `forward.__func__`, wraps it and binds the wrapper to the
        # module with MethodType. Without these, accelerate wraps this object as an opaque callable and its
        # unwrap later binds the object itself, which then receives the module twice.
        self.__self__ = module
        self.__func__ = _unbound_forward(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.module, *args, **kwargs)

    def run(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The compiled forward of `module` (this module, or one rebinding `__func__` to itself)."""
        if torch.compiler.is_compiling():
            return _run_outside_outer_compile(self, module, *args, **kwargs)
        if self.runs_eagerly:
            return self.eager_forward(module, *args, **kwargs)
        if torch.is_grad_enabled() and (optimizer := self._optimizer()) is not None:
            self._refuse_second_forward(optimizer)
            optimizer.saving.compiled_forward()  # the saving guard checks that a step ran one
        try:
            with compiled_run():  # modules whose GEMMs trace into the graph leave them to the pass
                if not self.dynamo_config:
                    return self.compiled(module, *args, **kwargs)
                with torch._dynamo.config.patch(**self.dynamo_config):
                    return self.compiled(module, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            lost = _saving_lost(err)
            if lost is not None:
                raise lost from None  # on_saving_lost="raise": the user's own error, not a compiler failure
            if not self.fallback:
                raise
            # Tracing failed before any backend ran (e.g. a graph break under fullgraph=True): no backward
            # ran on this forward, so nothing was updated yet and running it eagerly is safe.
            self.runs_eagerly = True
            optimizer = self._optimizer()
            if optimizer is not None:
                record_fallback(optimizer, err)
            return self.eager_forward(module, *args, **kwargs)

    @property
    def compiled(self) -> Callable[..., Any]:
        """The forward compiled with the sonar backend of the owner's schedule, built at the first call:
        a copy being rebuilt (deepcopy, unpickling) has no parameters or owner to ask yet."""
        if self._compiled is None:
            optimizer = self._optimizer()
            schedule = optimizer.schedule if optimizer is not None else "in_backward"
            backend = sonar_backend(self.compiler, fallback=self.fallback, schedule=schedule)
            self._compiled = torch.compile(self.eager_forward, backend=backend, **self.torch_compile_kwargs)
        return self._compiled

    def _refuse_second_forward(self, optimizer: SonarOptimizer) -> None:
        """In-backward schedule: a second forward with grad before a backward began would give one step
        two compiled backwards that each update every expert they see (a second update, or a
        backward that raises part-way). Refused here, before any weight moves. A forward recomputed
        inside backward (activation checkpointing) is not a new forward."""
        if optimizer.schedule != "in_backward" or torch._C._current_graph_task_id() != -1:
            return
        began = forward_mark(optimizer)
        if self._forward_at == began:
            self._forward_at = None  # told once: the forward after this one starts afresh
            raise second_forward_error()
        self._forward_at = began

    def _optimizer(self) -> SonarOptimizer | None:
        """The optimizer that owns this module's experts (found once, held weakly)."""
        if self._owner is None:
            owners = (registry.owner_of(p) for p in self.module.parameters())
            found = next((o for o in owners if isinstance(o, SonarOptimizer)), None)
            self._owner = weakref.ref(found) if found is not None else lambda: None
        return self._owner()

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt, never copied: a copy compiled for the copied module (deepcopy maps `self.module` to it).
        settings = (self.compiler, self.fallback, self.dynamo_config, self.torch_compile_kwargs)
        return (_rebuild, (self.module, *settings))


@torch.compiler.disable(
    reason="a model compiled by sonar_fx.compile runs its own compiled forward (the sonar backend's graph, "
    "which updates the experts in backward), never traced into an outer torch.compile: compile the model "
    "once, with sonar_fx.compile, or prepare it and compile your function with backend='sonar'"
)
def _run_outside_outer_compile(
    compiled: CompiledForward, module: nn.Module, *args: Any, **kwargs: Any
) -> Any:
    """An outer `torch.compile` (of the model, or of a function that calls it) traced into this forward:
    a graph break here runs the forward as compiled by the sonar backend, whose pass updates every expert
    inside its backward; traced into the outer graph, every expert gradient would come back at once for
    the hooks, saving nothing. Under the outer compile's `fullgraph=True` dynamo raises, naming this."""
    return compiled.run(module, *args, **kwargs)


def _saving_lost(err: BaseException) -> SavingLostError | None:
    """The `SavingLostError` that dynamo wrapped as a backend failure, if that is what `err` is."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, SavingLostError):
            return seen
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return None


def _unbound_forward(compiled: CompiledForward) -> Callable[..., Any]:
    """`CompiledForward.__func__`: a plain function of (module, *args), signed like the class's forward
    (self first), so binding it with MethodType shows the same parameters as the model's forward. It has
    no `__wrapped__`: unwrapping must stop here, not at the eager forward."""

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return compiled.run(module, *args, **kwargs)

    forward.__signature__ = inspect.signature(compiled.eager_forward)  # type: ignore[attr-defined]
    forward.__doc__ = compiled.eager_forward.__doc__
    forward.__name__ = forward.__qualname__ = compiled.__name__
    return forward


def _rebuild(
    module: nn.Module, compiler: str, fallback: bool, dynamo_config: dict[str, Any], kwargs: dict[str, Any]
) -> CompiledForward:
    return CompiledForward(module, compiler, fallback=fallback, dynamo_config=dynamo_config, **kwargs)


def recompile_inner_(
    model: nn.Module, inner: nn.Module, *, dynamo_config: dict[str, Any] | None = None
) -> bool:
    """`model`'s forward, compiled by sonar_fx, was replaced by a function that calls `inner` directly
    (TRL's fused LM head calls the backbone): compile `inner` in place with the same settings, and let
    the model's own compiled forward (which the replacing function may still call) run eagerly, so each
    path runs exactly one compiled region. False when there is nothing to move (`model` was not
    compiled whole by sonar_fx, or `inner` is compiled already)."""
    compiled = getattr(model, _COMPILED_ATTR, None)
    if not isinstance(compiled, CompiledForward) or model.__dict__.get("forward") is compiled:
        return False
    if isinstance(inner.__dict__.get("forward"), CompiledForward):
        return False
    config = {**compiled.dynamo_config, **(dynamo_config or {})}
    compile_forward_(
        inner,
        compiled.compiler,
        fallback=compiled.fallback,
        dynamo_config=config,
        **compiled.torch_compile_kwargs,
    )
    compiled.runs_eagerly = True  # `inner`, inside the eager forward, is the compiled region
    return True


def compile_forward_(
    module: nn.Module,
    compiler: str,
    *,
    fallback: bool,
    dynamo_config: dict[str, Any] | None = None,
    **torch_compile_kwargs: Any,
) -> None:
    """Replace `module.forward` by its compiled forward, in place."""
    if isinstance(module.__dict__.get("forward"), CompiledForward):
        raise ValueError(f"{type(module).__name__}.forward is already compiled by sonar_fx.")
    config = {**TRACE_CHECKPOINTED_SIDE_EFFECTS, **(dynamo_config or {})}
    compiled = CompiledForward(
        module, compiler, fallback=fallback, dynamo_config=config, **torch_compile_kwargs
    )
    module.forward = compiled
    module.__dict__[_COMPILED_ATTR] = compiled  # found again if something replaces module.forward


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
