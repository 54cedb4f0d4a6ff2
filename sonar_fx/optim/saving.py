"""The saving guard: a compiled run that would quietly save nothing says so, or refuses to run.

Sonar's memory saving holds only where an expert gradient is updated as soon as it is complete. Under
torch.compile that is the in-graph update; a gradient the compiled backward graph returns instead is
updated by its hook after the whole graph has returned, so every such gradient of the graph is alive
at once: exact, but no memory saved. Two guards:
- static, at compile time: the backend reports each graph that returns expert gradients un-rewritten
  (`graph_returns`); it warns once per graph naming the tensors, their producing op and the bytes, or
  raises `SavingLostError` under `on_saving_lost="raise"`;
- at run time: a model compiled with a compiler whose step updated every expert by hook on an eager
  forward (its forward was replaced or bypassed, or dynamo skipped the frames) warns once (`end_step`);
- at forward time: a prepared model whose forward ran in a graph that ANOTHER backend compiled (the
  user's own `torch.compile(model)`) holds expert tensors (`watch_compiled_forward`): every expert
  gradient of that graph comes back at once for the hooks. Warns once, or raises under "raise" (before
  its backward, so before any weight moves), and has the meter count them alive together.
What the meter measured (`sonar_fx.runtime.meter`) is reported beside the bounds (`expert_grad_bytes`).
This module judges and reports; it never changes where or how an update runs.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from sonar_fx.errors import SavingLostError
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.runtime.meter import ExpertGradMeter, compiled_nodes, meter_node

if TYPE_CHECKING:
    from torch import Tensor

    from sonar_fx.experts.discovery import ExpertLayer
    from sonar_fx.optim.stats import SonarStats

OnSavingLost = Literal["warn", "raise"]
ON_SAVING_LOST = ("warn", "raise")
ON_SAVING_LOST_ENV = "SONAR_FX_ON_SAVING_LOST"
"""Environment variable read when `on_saving_lost` is not given (the test suite sets "raise")."""
MiB = 2**20


def resolve_on_saving_lost(value: str | None) -> OnSavingLost:
    """`value`, or the environment's default ("warn" when unset); anything else is refused."""
    chosen = value if value is not None else os.environ.get(ON_SAVING_LOST_ENV, "warn")
    if chosen not in ON_SAVING_LOST:
        source = f"on_saving_lost={value!r}" if value is not None else f"{ON_SAVING_LOST_ENV}={chosen!r}"
        raise ValueError(f"{source}: expected 'warn' or 'raise'.")
    return cast(OnSavingLost, chosen)


@dataclass(frozen=True, kw_only=True)
class LostGradient:
    """An expert gradient that a compiled backward graph returns instead of updating."""

    name: str
    """The expert tensor's name in the model."""
    kind: str
    """The op that produces it in the backward graph (`ExpertGrad.kind`, e.g. "other:aten::index_put")."""
    nbytes: int
    """Bytes of the gradient."""


class SavingGuard:
    """The guard of one `SonarOptimizer` (see the module docstring)."""

    def __init__(self, on_saving_lost: OnSavingLost) -> None:
        self.on_saving_lost = on_saving_lost
        self.lost: dict[str, LostGradient] = {}
        """Every expert gradient some compiled graph returned un-rewritten, by name."""
        self.graphs_lost = 0
        """Compiled backward graphs that returned at least one expert gradient un-rewritten."""
        self.compiled_forwards = 0
        """Compiled forwards run (with grad enabled) since the last step."""
        self._after_graph = 0
        self._warned_uncompiled = False
        self._warned_foreign = False

    @property
    def lost_bytes(self) -> int:
        return sum(g.nbytes for g in self.lost.values())

    def graph_returns(self, lost: Sequence[LostGradient], *, nested: int = 0) -> None:
        """A compiled backward graph returns `lost` un-rewritten (`nested`: subgraphs of it the pass
        could not map, such as a nested compile region). Warns, or raises under "raise"."""
        if not lost:
            return
        self.graphs_lost += 1
        self.lost.update((g.name, g) for g in lost)
        nbytes = sum(g.nbytes for g in lost)
        shown = ", ".join(f"{g.name} ({g.kind})" for g in lost[:4]) + (" ..." if len(lost) > 4 else "")
        why = (
            f" The graph holds {nested} nested subgraph(s) the pass cannot map to parameters "
            "(a nested compile region): their expert gradients leave the graph as plain outputs."
            if nested
            else ""
        )
        message = (
            f"sonar: a compiled backward graph returns the gradients of {len(lost)} expert tensor(s) that "
            f"the pass did not rewrite: {shown}. Their hooks run after this graph returns: no memory saved "
            f"for {nbytes / MiB:.2f} MiB of expert gradients (training stays exact).{why}"
        )
        if self.on_saving_lost == "raise":
            raise SavingLostError(
                f"{message} on_saving_lost='raise' refuses to train so. Fix: compile with compiler='eager' "
                "(hooks on an eager model free each gradient as it is computed), use an experts "
                "implementation the pass rewrites (grouped_mm, the default: model.set_experts_implementation"
                "('grouped_mm')), or pass on_saving_lost='warn' to train without the saving.",
                [g.name for g in lost],
            )
        warnings.warn(message, stacklevel=3)

    def foreign_graph(self, lost: Sequence[LostGradient]) -> None:
        """A graph that another backend compiled returns `lost` (it holds their expert tensors): warns
        once, or raises under "raise"."""
        if self._warned_foreign and self.on_saving_lost == "warn":
            return
        nbytes = sum(g.nbytes for g in lost)
        shown = ", ".join(g.name for g in lost[:4]) + (" ..." if len(lost) > 4 else "")
        message = (
            f"sonar: the prepared model's forward ran in a graph compiled by a backend other than sonar's "
            f"(torch.compile(model) with its default or another backend), and that graph holds "
            f"{len(lost)} expert tensor(s): {shown}. Its backward returns all their gradients at once and "
            f"their hooks update them only after it returns: no memory saved for {nbytes / MiB:.2f} MiB of "
            "expert gradients (training stays exact). Fix: sonar_fx.compile(model, cfg) instead of "
            "prepare + torch.compile, or torch.compile(model, backend='sonar'), whose pass updates each "
            "expert inside the graph."
        )
        if self.on_saving_lost == "raise":
            raise SavingLostError(
                f"{message} on_saving_lost='raise' refuses to train so (pass on_saving_lost='warn' to train "
                "without the saving).",
                [g.name for g in lost],
            )
        self._warned_foreign = True
        warnings.warn(message, stacklevel=4)

    def compiled_forward(self) -> None:
        """A compiled forward ran with grad enabled (its backward can update in-graph)."""
        self.compiled_forwards += 1

    def end_step(
        self, *, compiler: str, paths: dict[str, str], after_graph: int, fallbacks: Sequence[str] = ()
    ) -> None:
        """At `step()`: `paths` maps each expert tensor updated in this step to "graph" or "hook";
        `after_graph`: the meter's count of hook updates of gradients a compiled graph returned;
        `fallbacks`: the causes of compile fallbacks so far (`report()["fallbacks"]`)."""
        returned = after_graph > self._after_graph
        self._after_graph = after_graph
        in_graph = {"graph", "deferred"} & set(paths.values())
        uncompiled = compiler != "eager" and paths and not in_graph and not returned
        if uncompiled and not self._warned_uncompiled:
            self._warned_uncompiled = True
            warnings.warn(self._uncompiled_message(compiler, len(paths), fallbacks), stacklevel=4)
        self.compiled_forwards = 0

    def _uncompiled_message(self, compiler: str, updates: int, fallbacks: Sequence[str]) -> str:
        if fallbacks:
            cause = (
                f"compilation fell back to eager hooks ({fallbacks[-1]}; report()['fallbacks'] lists every "
                "cause; fallback=False raises it instead)"
            )
        elif self.compiled_forwards == 0:
            cause = (
                "no compiled forward ran: the model's forward was replaced or bypassed after "
                "sonar_fx.compile (something set model.forward, as TRL's SFTTrainer does for its fused LM "
                "head: train with sonar_fx.integrations.sft.SonarSFTTrainer, which compiles the backbone it "
                "calls; or code calls an inner module directly)"
            )
        else:
            cause = (
                "the compiled forward ran, but dynamo ran the code that holds the experts eagerly (a graph "
                "break it cannot resume from, such as one inside a loop, makes it skip the whole frame; "
                "TORCH_LOGS=graph_breaks names it), or that code reached dynamo's recompile limit (models "
                "of one class share it: torch._dynamo.reset() between models; TORCH_LOGS=recompiles)"
            )
        return (
            f"sonar: the model was compiled (compiler={compiler!r}), but no compiled graph computed an "
            f"expert gradient in this step: its {updates} expert update(s) all ran by hook on an eager "
            f"forward. Likely cause: {cause}. Training is exact and each hook frees its gradient, but the "
            "experts train uncompiled."
        )

    def report(self) -> dict[str, Any]:
        return {
            "saving_lost_bytes": self.lost_bytes,
            "saving_lost_tensors": sorted(self.lost),
            "graphs_saving_lost": self.graphs_lost,
        }


class _Owner(Protocol):
    """What `watch_compiled_forward` reads of `SonarOptimizer` (which imports this module)."""

    compiler: str
    schedule: str
    stats: SonarStats
    meter: ExpertGradMeter
    saving: SavingGuard

    def owns(self, param: Tensor) -> bool: ...

    def expert_name(self, param: Tensor) -> str: ...


def watch_compiled_forward(owner: _Owner, tensors: Sequence[Tensor]) -> None:
    """After a forward of a model `owner` prepared (not compiled by sonar_fx): find the compiled graphs
    behind its outputs that hold `owner`'s expert tensors; meter the expert gradients their backward
    returns, and warn (or raise, before any hook updates them) when such a graph returns expert
    gradients and no graph of this model ever came through the sonar backend. Nothing to do where
    dynamo never compiled a frame in this process (an eager run pays nothing)."""
    if owner.compiler != "eager" or owner.schedule != "in_backward":
        return
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None or not dynamo.counters["frames"]["ok"]:
        return

    def lost(params: list[Tensor]) -> None:
        # Only a graph no sonar backend made: the sonar backend reports its own leftovers (graph_returns).
        if owner.stats.graphs_compiled + owner.stats.graphs_from_cache == 0:
            owner.saving.foreign_graph(
                [
                    LostGradient(
                        name=owner.expert_name(p), kind="another backend", nbytes=p.numel() * p.element_size()
                    )
                    for p in params
                ]
            )

    for node, leaves in compiled_nodes(tensors):
        if any(owner.owns(p) for p in leaves):
            meter_node(node, lambda p: owner.meter if owner.owns(p) else None, lost)


def expert_grad_bytes(meter: ExpertGradMeter, layers: Sequence[ExpertLayer]) -> dict[str, int | None]:
    """The measured peak of expert-gradient bytes alive at once in the last step, beside the bounds:
    Sonar keeps at most `one_layer`; standard training holds `all_layers` at its optimizer step."""
    bounds = ExpertGradBytes.of(layers) if layers else None
    return {
        "measured_peak": meter.last_peak,
        "one_layer": bounds.one_layer if bounds else None,
        "all_layers": bounds.total if bounds else None,
    }
