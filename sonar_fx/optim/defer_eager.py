"""The deferred schedule without a compiler: the experts' GEMMs keep their operands, eagerly.

While an experts module, or a module owning an expert tensor, runs its forward (a pre-hook enters
`DeferGemms`, a hook leaves it), a GEMM whose weight operand is an owned expert tensor, a view of it,
a copy of it cast to another dtype, or rows or a slice read off it (each path: `defer_eager_paths`; the
per-expert forms, rows of per-expert vectors and embedding gathers: `defer_eager_forms`) runs on the
DETACHED weight, so
autograd computes the input gradient exactly as before and no weight gradient at all; a node after
the GEMM receives dy when backward reaches it and hands the operands of autograd's weight gradient
to the owner, with the recipe that computes it again.
Any other use of an expert weight is left to autograd: its gradient arrives whole in `.grad` and the
deferred step says it kept it. Never active under dynamo: compiled graphs get the graph pass instead.

Inside a compiled model, an experts module whose call dynamo leaves eager (a graph break it cannot resume
from, such as transformers' per-expert loop: `nonzero()`, then a branch on a tensor inside the loop) runs
its hooks as frames of their own; dynamo would compile them, and a compiled hook sees `is_compiling()` and
enters nothing. So dynamo skips the hooks' and the mode's own frames (`_eager_only`): the capture then
applies to whatever of that forward runs eagerly (the loop's GEMMs), while a frame dynamo compiles inside
it (the activation) sees a mode that passes every call through, and the graph pass defers there.
Dynamo cannot trace that mode (its frames are skipped): a frame it compiles under it breaks its graph
at every torch call and runs them eagerly, so the capture keeps those GEMMs, not the pass. An experts
module whose GEMMs trace into a compiled forward's graph when the mode is absent (expert parallelism's
`local_experts`: the token exchange around them is its only graph break) says so
(`traced_when_compiled`), and inside a forward Sonar compiled (`compiled_run`) it enters no capture:
the graph pass defers its GEMMs (olmoe-cpu, expert parallelism on 2 ranks, aot_eager: the capture
cost the deferred forward 16-18 ms of CPU per step of 4 micro-batches, some 3% of the step). Its
eager forward (compiler="eager", a compile that fell back) is captured as any other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch._dynamo.eval_frame import skip_code
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily
from torch.utils.hooks import RemovableHandle

from sonar_fx.experts.discovery import ExpertLayer
from sonar_fx.optim import defer_eager_forms as forms
from sonar_fx.optim import defer_eager_paths as paths
from sonar_fx.runtime.registry import owner_of

_GROUPED_MM = {torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm)}


def _captures() -> dict[Any, Callable[..., paths.Capture | None]]:
    """The calls the capture knows, each with its path."""
    import sonar_fx.experts.grouped  # noqa: F401  (registers the reference kernel's op)

    table: dict[Any, Callable[..., paths.Capture | None]] = dict.fromkeys(
        _GROUPED_MM, paths.capture_grouped_mm
    )
    table[torch.ops.sonar_fx.grouped_mm.default] = paths.capture_sonar_grouped_mm
    table.update(dict.fromkeys((torch.bmm, Tensor.bmm), paths.capture_gathered_bmm))
    table.update(dict.fromkeys((torch.nn.functional.linear, *forms.MM_CALLS), forms.capture_slice_gemm))
    table[Tensor.__getitem__] = forms.capture_vector_rows
    table[torch.nn.functional.embedding] = forms.capture_embedding
    return table


_CAPTURES = _captures()


class DeferGemms(TorchFunctionMode):
    """GEMMs on expert weights keep their operands instead of computing the weight gradient."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        capture = _CAPTURES.get(func)
        if capture is None or torch.compiler.is_compiling() or not torch.is_grad_enabled() or len(args) < 2:
            return func(*args, **kwargs)  # (a frame dynamo compiles under the mode: the graph pass defers)
        return _capture_or_call(capture, func, args, kwargs)


@torch.compiler.disable  # eager only: in a compiled model's eager region dynamo would trace the keeper
def _capture_or_call(
    capture: Callable[..., paths.Capture | None], func: Callable[..., Any], args: Any, kwargs: dict[str, Any]
) -> Any:
    found = capture(func, args, kwargs)
    if found is None:
        return func(*args, **kwargs)
    # `param` is an input of the keeper: its output needs a gradient (so dy comes) even where nothing
    # upstream does (a frozen layer before the experts), and its node has the edge to `param` by which the
    # engine says whether this backward accumulates into it (`inputs=`, `autograd.grad`).
    return _KeepOperands.apply(found.output, found.param, found.keep, *found.saved)


class _KeepOperands(torch.autograd.Function):
    """Identity on the GEMM's output whose backward hands the weight gradient's operands to the owner
    (`Capture.operands` of dy and the saved tensors: views, never copies).

    The saved tensors are the node's, not a hook's closure: autograd frees them when the backward ends
    (unless the graph is retained, where a second backward keeps them again), so a loop that holds
    `loss` through `step()` does not hold every layer's inputs with it."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, param: Tensor, keep: paths.Keep, *saved: Tensor):
        ctx.save_for_backward(*saved)
        ctx.param, ctx.keep = param, keep
        # Not `y` itself (an input returned as-is is a view, and experts add their bias in place on
        # the GEMM's output): a new tensor on y's storage, whose gradient backward hands on to y.
        return y.detach()

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # unpacked once: checkpointing refuses a second unpack
        keep: paths.Keep = ctx.keep
        owner = owner_of(ctx.param)
        assert owner is not None, "an expert tensor captured in forward lost its optimizer before backward"
        owner.defer_expert_(ctx.param, keep.recipe, keep.operands(dy, saved))
        return (dy, None, None, *(None for _ in saved))


def defer_modules(model: nn.Module, layers: Iterable[ExpertLayer]) -> list[nn.Module]:
    """The modules whose eager forward enters `DeferGemms`: each experts module, and each module that
    owns an expert tensor (jetmoe's attention experts run their experts through `map` and `reduce`,
    never their own forward; the projections they call own the weights)."""
    names: dict[str, None] = {}
    for layer in layers:
        names[layer.name] = None
        names.update((t.name.rpartition(".")[0], None) for t in layer.tensors)
    return [model.get_submodule(name) for name in names]


_COMPILED_RUN: ContextVar[bool] = ContextVar("sonar_fx_compiled_run", default=False)


@contextmanager
def compiled_run() -> Iterator[None]:
    """Around a forward Sonar compiled (`sonar_fx.compiled`; never its eager fallback): an experts
    module that declares `traced_when_compiled` enters no capture inside it (the module docstring)."""
    token = _COMPILED_RUN.set(True)
    try:
        yield
    finally:
        _COMPILED_RUN.reset(token)


def in_compiled_run() -> bool:
    """Whether a forward `sonar_fx.compile` compiled is running now (`compiled_run`)."""
    return _COMPILED_RUN.get()


def _left_to_the_pass(module: nn.Module) -> bool:
    """Whether `module`'s GEMMs trace into the graph of the compiled forward running now."""
    return _COMPILED_RUN.get() and bool(getattr(module, "traced_when_compiled", False))


def register_defer_hooks(modules: Iterable[nn.Module]) -> list[RemovableHandle]:
    """Enter `DeferGemms` for the eager forward of each module in `modules` (`defer_modules`), once: a
    module inside another's forward finds the mode entered; a forward dynamo traces is left alone (the
    graph pass defers there)."""
    handles = []
    for module in modules:
        entered: list[DeferGemms | None] = []

        def enter(_m: nn.Module, _a: Any, entered: list[DeferGemms | None] = entered) -> None:
            if not torch.compiler.is_compiling():
                nested = any(isinstance(m, DeferGemms) for m in _get_current_function_mode_stack())
                mode = None if nested or _left_to_the_pass(_m) else DeferGemms()
                if mode is not None:
                    mode.__enter__()
                entered.append(mode)

        def leave(_m: nn.Module, _a: Any, _o: Any, entered: list[DeferGemms | None] = entered) -> None:
            if entered and not torch.compiler.is_compiling():
                mode = entered.pop()
                if mode is not None:
                    mode.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(_eager_only(enter)))
        handles.append(module.register_forward_hook(_eager_only(leave), always_call=True))
    return handles


def _eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, whose frame dynamo never compiles on its own (it runs eagerly where a compiled model's
    experts call is left eager) yet still inlines where it traces the call (a hook that graph-breaks would
    split every compiled experts module). `skip_code` is dynamo's own: what it does for the frames it
    creates to resume after a graph break; torch has no public form of it."""
    skip_code(fn.__code__)
    return fn


_eager_only(DeferGemms.__torch_function__)  # called for every torch call of an eager region

F = TypeVar("F", bound=Callable[..., Any])


def outside_capture(fn: F) -> F:
    """`fn` run with the capture suspended: eager code inside an experts module's forward that never
    reads an expert weight (expert parallelism's token exchange: sorts, gathers, all-to-alls). Under
    the capture each of its torch calls would pass through `DeferGemms.__torch_function__` in Python
    for nothing (olmoe-cpu, 2 ranks: about 600 calls per step of 4 micro-batches). Only a
    capture on top of the mode stack is suspended: a mode the caller entered inside the experts forward
    is left as it is (and the capture with it)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        stack = _get_current_function_mode_stack()
        if not stack or not isinstance(stack[-1], DeferGemms):
            return fn(*args, **kwargs)
        with _pop_mode_temporarily():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
