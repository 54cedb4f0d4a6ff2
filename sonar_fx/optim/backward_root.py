"""Where a backward through a prepared model begins: told to its optimizer's step tracker.

Two marks, one per way the model runs:
- `mark_backward_root`, the forward hook `prepare` registers: on the model's outputs, in eager code
  (an eager model, or `sonar_fx.compile`'s compiled forward, which is called from eager code);
- `mark_graph_backward`, the sonar backend's wrapper of each compiled graph that holds bound expert
  tensors: on the graph's outputs, for a forward hook that a compile traced into its graph. Under the
  sonar backend (a user's `torch.compile(train_fn, backend="sonar")`, or of the model itself) the hook
  traces to nothing, so it costs no graph break and `fullgraph=True` runs; under any other backend it
  stays a graph break, because it must run to see that graph (`watch_compiled_forward`).
Each tells the optimizer once per backward, before that backward's first update. Nothing here updates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.checks import refuse_fp16_autocast
from sonar_fx.optim.defer_eager import in_compiled_run
from sonar_fx.optim.outside_reads import refuse_reads_outside_graph, tag_in_graph_updates, updates_in_graph
from sonar_fx.optim.saving import watch_compiled_forward, watch_gathered_experts
from sonar_fx.optim.second_forward import refuse_second_graph_forward
from sonar_fx.runtime import registry
from sonar_fx.runtime.meter import backward_node

SONAR_BACKEND_FLAG = "is_sonar_backend"
"""An attribute set True on every dynamo backend function of `sonar_fx.backend`."""


def mark_backward_root(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a prepared model: when a backward first reaches one of its outputs, tell the
    model's optimizer a backward began (in the outermost graph task). Traced by the sonar backend, it is
    nothing: that backend marks its graph's outputs itself (`mark_graph_backward`)."""
    if torch.compiler.is_compiling() and traced_by_sonar():
        return
    _mark_backward_root(module, output)


@torch.compiler.disable
def _mark_backward_root(module: nn.Module, output: Any) -> None:
    """The hook's work, never traced: it registers a hook on tensors after the forward."""
    owner = module.__dict__.get("sonar")
    if owner is None or not torch.is_grad_enabled():
        return
    tensors = [t for t in _tensors(output) if t.requires_grad]
    if not tensors:
        return
    watch_compiled_forward(owner, tensors)  # a graph another backend compiled saves nothing: say so
    watch_gathered_experts(owner, module, output)  # nor freeing gradients under gathered weight copies
    fp16 = _fp16_devices(owner)

    torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: _began([(owner, fp16)]), mode="any")


@torch._dynamo.assume_constant_result
def traced_by_sonar() -> bool:
    """While dynamo traces: whether the graph goes to a sonar backend. Run at trace time (its result is
    a constant of the trace; dynamo's cache entries are per backend, so it holds for the entry)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    compiler = getattr(getattr(tx, "output", None), "compiler_fn", None)
    compiler = getattr(compiler, "compiler_fn", compiler)  # dynamo wraps the backend for debugging
    return bool(getattr(compiler, SONAR_BACKEND_FLAG, False))


def mark_graph_backward(
    compiled: Callable[..., Any], expert_indices: Sequence[int], *, updated_in_graph: Sequence[int] = ()
) -> Callable[..., Any]:
    """Wrap a compiled graph whose inputs at `expert_indices` are bound expert tensors: at each call with
    grad, the owners of those inputs (found at run time: dynamo reuses a graph for other modules) are
    told a backward began when it first reaches the graph's outputs, unless that backward was already
    seen beginning (the model's own hook, or another graph of the same forward). The inputs at
    `updated_in_graph` are updated in place by the graph's backward: a second forward of one of them
    before a backward is refused first (`second_forward`), unless `sonar_fx.compile`'s wrapper, which
    refuses it by module, runs the graph; and the graph's autograd node is tagged with them
    (`outside_reads`: a backward that also feeds one from outside the graph is refused)."""

    def run(*args: Any) -> Any:
        # Dynamo calls with the inputs, or with one list of them (boxed) that the callee empties.
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        found = (registry.owner_of(inputs[i]) for i in expert_indices)
        owners = {id(o): o for o in found if hasattr(o, "backward_began")}  # a Sonar optimizer
        # A forward run inside a backward (activation checkpointing's recompute) begins no backward.
        forward = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        if forward and updated_in_graph and not in_compiled_run():
            updated = ((registry.owner_of(inputs[i]), inputs[i]) for i in updated_in_graph)
            refuse_second_graph_forward((o, t) for o, t in updated if o is not None)
        in_graph = [inputs[i] for i in updated_in_graph]
        outputs = compiled(*args)
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if in_graph and tensors and (node := backward_node(outputs)) is not None:
            tag_in_graph_updates(node, in_graph, owners.values())
        if owners and tensors and forward:
            marks = [(owner, _fp16_devices(owner)) for owner in owners.values()]
            began = lambda _: _began(marks, graph=True)  # noqa: E731
            torch.autograd.graph.register_multi_grad_hook(tensors, began, mode="any")
        return outputs

    return run


def _began(marks: list[tuple[Any, set[str]]], *, graph: bool = False) -> None:
    """A backward reached marked outputs: tell each (owner, its fp16 autocast devices) it began, unless
    that was told already in this backward: for a graph's mark, by anything (the model's hook, or the
    mark of a graph nearer the loss, whose updates may have run); for the model's hook, by a graph's
    mark of the same outputs, with nothing updated in this backward since (the hook's own second
    sighting, a second forward's outputs, stays the tracker's to judge). Updates of the step's earlier
    backwards (accumulation="per_microbatch") do not count: told again, the tracker would read the
    backward it was just told of as one that raised part-way."""
    if any(updates_in_graph(owner) for owner, _ in marks):
        try:
            refuse_reads_outside_graph()  # before any update of this backward: nothing has moved
        except SonarUsageError:
            for owner, _ in marks:
                owner.tracker.backward_refused()
            raise
    for owner, fp16 in marks:
        refuse_fp16_autocast(fp16)
        tracker = owner.tracker
        told = tracker.rooted and tracker.open_task == torch._C._current_graph_task_id()
        if not (told and (graph or not tracker.updated_in_open_backward())):
            owner.backward_began()


def _fp16_devices(owner: Any) -> set[str]:
    """The expert devices under float16 autocast now (a forward-time state, refused when a backward
    begins: an fp16 forward that never backwards trains nothing wrong). The deferred schedule joins the
    GradScaler's unscale and verdict at step(): fp16 is exact there."""
    if getattr(owner, "schedule", "in_backward") != "in_backward":
        return set()
    devices = {p.device.type for p in owner.experts.params}
    return {
        d for d in devices if torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.float16
    }


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output: pytree leaves, and the fields of a plain dataclass output (not a
    pytree node, unlike transformers' ModelOutput), so its backward is seen beginning too."""
    found = []
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found
