"""Running a real training step on fake tensors: the planner's fake mode and its stand-ins.

For: `sonar_fx.planner`, which runs the training step of a real-size model with no memory allocated.
What a real step does that cannot run as it is on fake tensors is handled so that no allocation of
the step changes:
- Weights: the model is built on the `meta` device, then each parameter and buffer gets fake storage
  of its shape, dtype and strides (`fake_parameters`); tied parameters stay tied.
- Host reads of a tensor's value (`bool(t)`, `.item()`, `.tolist()`): Sonar's non-finite flags and the
  finiteness of the norms it clips by. `PlanFakeMode` answers them as a step whose gradients are finite
  (the step a plan predicts): a `torch.isfinite` result is known to be all True, and the values of
  the few small tensors computed from known ones alone (a flag's negation, cast, stack, unbind) are
  followed exactly by running the same op on those values. Any other host read raises `PlanError`
  naming it: the plan never guesses a value.
- `torch.compile`: inductor's code cannot run on fake tensors. The step itself runs eager (Sonar's
  post-accumulate-grad hooks, the paper's method). The one compiled function a training step calls,
  torchao's low-bit Adam update (`single_param_adam`, compiled by torchao's optimizer and by Sonar's
  low-bit rule), is replaced while planning by `lowbit_update_buffers`, which allocates what inductor's
  kernel for it allocates (read from its generated CPU code, tested against a measured call) and
  changes nothing else; anything else compiled is refused with `PlanError`.
- Paths chosen for fake tensors: transformers treats a fake tensor as a trace and then builds the causal
  mask a real step leaves to SDPA's `is_causal` (`real_step_paths` makes it see the real step's
  inputs); torch's meta function for `_grouped_mm` knows only bf16, while the CPU kernel also runs fp32
  (`PlanFakeMode` gives the fp32 output the kernel gives).
A CPU-only torch cannot run autograd on fake `cuda` tensors (autograd asks the CUDA device guard for a
stream and the process aborts), so the fake tensors live on the CPU; the tracker counts them as the
target device's allocator would (see `tracker`).
Never: allocate real memory for a model's tensors; change what a step allocates; leave torch.compile
replaced after planning.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from sonar_fx.optim import grad_watch

aten = torch.ops.aten
KNOWN_NUMEL_LIMIT = 4096
"""Values are followed only for tensors this small: flags, norms and their stacks, never activations."""


class PlanError(ValueError):
    """A plan cannot be made as asked; the message names the input and the fix."""


class PlanFakeMode(FakeTensorMode):
    """A `FakeTensorMode` that answers host reads as a step with finite gradients would (see the
    module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.known = WeakTensorKeyDictionary()
        """Fake tensor -> a real CPU tensor holding its values (small tensors of known value only)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            value = self._value(args[0])
            if value is None:
                raise PlanError(
                    "the training step reads a tensor's value on the host (bool(), .item() or .tolist() of a "
                    f"{tuple(args[0].shape)} {args[0].dtype} tensor that is not a finiteness check); a plan "
                    "runs on fake tensors and cannot know it. Plan a method that reads no data-dependent "
                    "value."
                )
            return value.item()
        if func is aten._grouped_mm.default and args[0].dtype == torch.float32:
            return self._grouped_mm_fp32(types, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:  # a tensor subclass's op (FSDP2's DTensors): dispatched again, unwrapped
            return out
        if _is_finiteness_test(func, args) and isinstance(out, Tensor):
            with _disable_current_modes():
                self._remember(out, torch.ones(out.shape, dtype=torch.bool))
        else:
            self._follow(func, args, kwargs, out)
        return out

    def _grouped_mm_fp32(self, types: Any, args: Any, kwargs: Any) -> Tensor:
        """torch's meta function for `_grouped_mm` accepts bf16 only (the CUDA kernel's dtype), while
        the CPU kernel runs fp32 too: the output's shape comes from bf16 stand-ins (made and dropped
        inside this mode, where no tracker sees them), its dtype is fp32."""
        bf16 = [a.to(torch.bfloat16) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
        like = super().__torch_dispatch__(aten._grouped_mm.default, types, bf16, kwargs)
        assert isinstance(like, Tensor)
        out_dtype = kwargs.get("out_dtype") or torch.float32
        out = super().__torch_dispatch__(
            aten.empty_strided.default, types, (like.shape, like.stride()), {"dtype": out_dtype}
        )
        assert isinstance(out, Tensor)
        return out

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Compute `out`'s values when every tensor input's are known (or there are none: a constant
        made from Python numbers); forget an output (an in-place op's target) whose new value depends
        on an unknown input."""
        inputs = [*_tensors(args), *_tensors(kwargs.values())]
        outputs = [*_tensors(out if isinstance(out, (tuple, list)) else (out,))]
        unset = func._schema.name.startswith("aten::empty") or torch.Tag.nondeterministic_seeded in func.tags
        if (
            any(self._value(t) is None for t in inputs)
            or (not inputs and unset)
            or any(t.numel() > KNOWN_NUMEL_LIMIT for t in outputs)
        ):
            for t in _written(func, args, kwargs):  # a known tensor it writes to is known no longer
                self.known.pop(t, None)
            return
        real_args, real_kwargs = tree_map_only(Tensor, self._value, (args, kwargs))
        with _disable_current_modes():  # the values are real tensors: compute them for real
            result = func(*real_args, **real_kwargs)
        real = [t for t in tree_flatten(result)[0] if isinstance(t, Tensor)]
        for fake, value in zip(outputs, real, strict=True):
            self._remember(fake, value)

    def _value(self, t: Tensor) -> Tensor | None:
        """A tensor's known values: a real tensor's own, a fake tensor's if followed, else None."""
        return self.known.get(t) if isinstance(t, FakeTensor) else t

    def _remember(self, fake: Any, value: Tensor) -> None:
        if isinstance(fake, Tensor) and fake.numel() <= KNOWN_NUMEL_LIMIT:
            self.known[fake] = value


def _tensors(values: Any) -> Iterator[Tensor]:
    """The tensors among an op's arguments (or results): tensors and lists of tensors."""
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, Tensor))


def _written(func: Any, args: Any, kwargs: Any) -> Iterator[Tensor]:
    """The tensors an op writes to (its schema's mutable arguments)."""
    if not func._schema.is_mutable:
        return
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            yield from _tensors((args[i] if i < len(args) else kwargs.get(arg.name),))


def _is_finiteness_test(func: Any, args: Any) -> bool:
    """An op that is all True for finite values: `torch.isfinite` arrives decomposed into
    `x == x` (False only for NaN) and `abs(x) != inf` (False only for inf), both checked here."""
    if func is aten.isfinite.default:
        return True
    if func is aten.eq.Tensor:
        return args[0] is args[1]
    return func is aten.ne.Scalar and args[1] in (math.inf, -math.inf)


def fake_parameters(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Replace every parameter and buffer of `model` (built on `meta`) by a fake CPU tensor of the same
    shape, strides and dtype, in place; a tensor shared by several modules stays shared."""
    done: dict[int, tuple[Tensor, Tensor]] = {}  # id(meta tensor) -> (meta tensor kept alive, fake)

    def fake_of(t: Tensor) -> Tensor:
        if id(t) not in done:
            with mode:
                storage = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fake = (
                nn.Parameter(storage, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else storage
            )
            done[id(t)] = (t, fake)
        return done[id(t)][1]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake_of(p)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake_of(b)
    return model


def _torchao_update() -> Any:
    """torchao's `single_param_adam` when torchao is loaded (a low-bit config imported it), else None."""
    adam = sys.modules.get("torchao.optim.adam")
    return getattr(adam, "single_param_adam", None)


@contextlib.contextmanager
def real_step_paths() -> Iterator[None]:
    """While planning, the step takes the paths a real eager step takes: `torch.compile(torchao's
    single_param_adam)` gives `lowbit_update_buffers` (compiling anything else raises `PlanError`), and
    transformers' mask builder does not treat a fake tensor as a trace (it would materialize the causal
    mask that a real step leaves to SDPA's `is_causal`; a value it then reads is answered or refused by
    `PlanFakeMode`)."""
    real_compile = torch.compile

    def plan_compile(model: Any = None, **kwargs: Any) -> Any:
        if model is not None and model is _torchao_update():
            return lowbit_update_buffers
        name = getattr(model, "__qualname__", type(model).__name__)
        raise PlanError(
            f"the training step compiles {name} with torch.compile, whose kernels cannot run on fake "
            "tensors; the plan models eager execution (Sonar's hooks, the paper's method): plan the model "
            "without torch.compile."
        )

    with contextlib.ExitStack() as stack:
        masking = sys.modules.get("transformers.masking_utils")
        real_is_tracing = getattr(masking, "is_tracing", None)
        if real_is_tracing is not None:

            def is_tracing(tensor: Any = None) -> bool:
                return real_is_tracing(None if isinstance(tensor, FakeTensor) else tensor)

            setattr(masking, "is_tracing", is_tracing)  # noqa: B010 (a module attribute mypy cannot see)
            stack.callback(setattr, masking, "is_tracing", real_is_tracing)
        torch.compile = plan_compile
        stack.callback(setattr, torch, "compile", real_compile)
        real_rewritten = grad_watch.rewritten

        def unwritten(params: Any, before: Any) -> list[Tensor]:
            # FSDP2's dense shards: the watch compares their norms at step() with backward's; a planned
            # step writes none in between (its norms are computed, their comparison is known)
            return real_rewritten(params, {})

        setattr(grad_watch, "rewritten", unwritten)  # noqa: B010
        stack.callback(setattr, grad_watch, "rewritten", real_rewritten)
        yield


_SCRATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("lowbit_scratch", default=True)


@contextlib.contextmanager
def lowbit_scratch(counted: bool) -> Iterator[None]:
    """Count the low-bit update's scratch (the default) or not: `counted=False` is a what-if for a
    kernel that keeps it in registers (benchmarks.plan_accuracy shows both against the paper)."""
    token = _SCRATCH.set(counted)
    try:
        yield
    finally:
        _SCRATCH.reset(token)


def lowbit_update_buffers(
    p: Tensor, grad: Tensor, step: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *args: Any
) -> None:
    """What inductor's kernel for torchao's low-bit Adam update allocates, on fake tensors.

    Read from inductor's generated CPU code (torch 2.13) and measured on calls of the compiled update:
    for each quantized (8-bit) moment it holds the re-quantized values in float32 (numel x 4 bytes,
    before they are coded) and their block scales (numel / block x 4 bytes), all at once; when a 3-D
    parameter's last dimension is the block size, it also writes the new parameter to a buffer of the
    parameter's size before copying it back. It updates parameter and states in place and allocates
    nothing for plain (unquantized) moments. Only the allocation matters here: no value is computed.
    """
    moments = [m for m in (exp_avg, exp_avg_sq) if hasattr(m, "codes") and hasattr(m, "scale")]
    if not moments or not _SCRATCH.get():
        return
    block = moments[0].codes.numel() // moments[0].scale.numel()
    buffers = [torch.empty(m.scale.numel(), dtype=torch.float32, device=p.device) for m in moments]
    buffers += [torch.empty(m.shape.numel(), dtype=torch.float32, device=p.device) for m in moments]
    if p.dim() == 3 and p.shape[-1] == block:
        buffers.append(torch.empty_like(p))
    del buffers
