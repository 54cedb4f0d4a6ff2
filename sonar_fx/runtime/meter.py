"""The expert-gradient meter: bytes of expert gradients alive at once, measured while backward runs.

Sonar's saving is that expert gradients never pile up: each is freed by its update. This meter counts
each gradient from when it appears to when its update frees it, and keeps the step's peak, so a run
can show what it held rather than what a formula predicts. Where each path sees a gradient appear:
- the in-graph update: when the op starts (the graph frees the gradient right after it, its last use);
- the eager hook: in the post-accumulate-grad hook (autograd runs a leaf's AccumulateGrad, and so the
  hook, right after the node that computed the gradient, before any other node);
- a compiled graph that returns expert gradients un-rewritten: all of them when its backward node
  returns (a hook on that node), since every one waits there for its hook; each hook then frees one.
  The sonar backend wraps such graphs (`meter_returned_grads`); a graph another backend compiled (a
  prepared model under the user's own `torch.compile`) is found behind the forward's outputs
  (`compiled_nodes`) and hooked the same way (`meter_node`).
The hot path is a dict lookup and integer adds: no sync, no tensor op. It never changes a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor


class ExpertGradMeter:
    """Expert-gradient bytes alive now, and the most alive at once in this step and the last one."""

    def __init__(self) -> None:
        self.live = 0
        """Bytes of expert gradients alive now."""
        self.peak = 0
        """The most alive at once since the last `end_step()`."""
        self.last_peak: int | None = None
        """The peak of the last completed step (None before the first)."""
        self.after_graph = 0
        """Hook updates of gradients that a compiled graph returned un-rewritten (all alive together)."""
        self._alive: dict[int, int] = {}  # id(param) -> bytes of its gradient, while alive
        self._returned: set[int] = set()  # ids whose gradient a compiled node returned, not yet freed

    def appeared(self, param: object, nbytes: int) -> None:
        """`param`'s gradient of `nbytes` exists now (a second report before its free is ignored).
        `param` is any object that names one gradient while it lives: the parameter for the gradient
        it holds or is updated with, another object for a copy made beside it (the deferred step's)."""
        key = id(param)
        if key in self._alive:
            return
        self._alive[key] = nbytes
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live

    def returned_by_graph(self, params: Sequence[Tensor]) -> None:
        """A compiled backward returned these parameters' gradients, all at once, for their hooks."""
        for p in params:
            self.appeared(p, p.numel() * p.element_size())
            self._returned.add(id(p))

    def freed(self, param: object) -> None:
        """`param`'s gradient was freed by its update."""
        key = id(param)
        self.live -= self._alive.pop(key, 0)
        if key in self._returned:
            self._returned.discard(key)
            self.after_graph += 1

    def end_step(self) -> None:
        """Close the step: its peak becomes `last_peak`; gradients still alive start the next one."""
        self.last_peak = self.peak
        self.peak = self.live

    def forget(self) -> None:
        """Drop what is alive (an abandoned step's gradients were freed by `zero_grad`)."""
        self._alive.clear()
        self._returned.clear()
        self.live = 0


def meter_returned_grads(
    compiled: Callable[..., Any],
    param_indices: Sequence[int],
    meter_of: Callable[[Tensor], ExpertGradMeter | None],
) -> Callable[..., Any]:
    """Wrap a compiled forward whose backward returns the gradients of the parameters at
    `param_indices` (of its inputs) un-rewritten: when that backward node returns, their gradients
    count as alive together on each one's meter (`meter_of(param)`). The parameters are read from the
    inputs of each call, never fixed at compile time (dynamo reuses a graph for other modules)."""

    def run(*args: Any) -> Any:
        # Dynamo calls a backend's function with the inputs, or with one list of them (boxed), which
        # the callee empties: read the parameters first.
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        params = [inputs[i] for i in param_indices]
        outputs = compiled(*args)
        node = backward_node(outputs)
        if node is not None:
            node.register_hook(lambda grad_inputs, grad_outputs: _count(params, meter_of))
        return outputs

    return run


def compiled_nodes(tensors: Sequence[Tensor]) -> list[tuple[Any, list[Tensor]]]:
    """The compiled autograd functions (`CompiledFunctionBackward`) in the graph behind `tensors`, each
    with the leaf tensors its backward returns gradients for (its `AccumulateGrad` next functions). A
    walk of every node: call it only where compiled graphs may be (a graph collapses into one node, so
    the walk of a compiled model is short)."""
    found: list[tuple[Any, list[Tensor]]] = []
    stack: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: dict[int, Any] = {}  # id -> node, held so that an id is never reused during the walk
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        nexts = [f for f, _ in node.next_functions if f is not None]
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append((node, [f.variable for f in nexts if type(f).__name__ == "AccumulateGrad"]))
        stack += [f for f in nexts if type(f).__name__ != "AccumulateGrad"]
    return found


def meter_node(
    node: Any,
    meter_of: Callable[[Tensor], ExpertGradMeter | None],
    on_returned: Callable[[list[Tensor]], None] | None = None,
) -> None:
    """When the compiled backward `node` returns, count each expert gradient it returned (not None) as
    alive, together (`returned_by_graph`); a gradient the graph consumed in-graph comes back as None.
    `on_returned` is then told which expert parameters got a gradient back (before any of their hooks)."""
    leaves = [f.variable if type(f).__name__ == "AccumulateGrad" else None for f, _ in node.next_functions]

    def count(grad_inputs: Sequence[Tensor | None], grad_outputs: Any) -> None:
        returned = [p for p, g in zip(leaves, grad_inputs, strict=False) if p is not None and g is not None]
        _count(returned, meter_of)
        experts = [p for p in returned if meter_of(p) is not None]
        if on_returned is not None and experts:
            on_returned(experts)

    node.register_hook(count)


def _count(params: list[Tensor], meter_of: Callable[[Tensor], ExpertGradMeter | None]) -> None:
    for p in params:
        meter = meter_of(p)
        if meter is not None:
            meter.returned_by_graph([p])


def backward_node(outputs: Any) -> Any:
    """The compiled function's autograd node (`CompiledFunctionBackward`) behind its outputs."""
    tensors = [
        o for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs]) if isinstance(o, Tensor)
    ]
    for t in tensors:
        node = t.grad_fn
        # An output that is a view of another gets a view node whose next function is the compiled one.
        for candidate in (node, *(f for f, _ in getattr(node, "next_functions", ()))):
            if candidate is not None and type(candidate).__name__ == "CompiledFunctionBackward":
                return candidate
    return None
