"""The saving guard: a run that would quietly save nothing (or less than half) says so, or refuses.

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
  its backward, so before any weight moves), and has the meter count them alive together;
- against the prediction (`ExpertGradBytes.predicted_saving`), the causes that take the saving back
  on any path: a deferred tensor whose operands outgrow its gradient (`crossed_over`), a deferred
  gradient autograd computed whole (`kept_whole`), expert-weight copies a gathering experts
  implementation saves for backward (`gathered_weights`, from `watch_gathered_experts`). Each warns
  once, at the step's end, with its cause and fix; under "raise" the path is refused where the cause is
  found once it saves less than half of the prediction, before any weight moves.
`saving_lost_bytes` counts every byte so lost, `saving_lost_by_cause` splits it.
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

import torch

from sonar_fx.errors import SavingLostError
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.runtime.meter import ExpertGradMeter, compiled_nodes, meter_node

if TYPE_CHECKING:
    from torch import Tensor, nn

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

    def __init__(self, on_saving_lost: OnSavingLost, bounds: ExpertGradBytes | None = None) -> None:
        self.on_saving_lost = on_saving_lost
        self.bounds = bounds
        """The model's expert-gradient bytes: what the saving is judged against (None: not judged)."""
        self.activations_lost = 0
        """Bytes of the prediction that activations an experts implementation saves take back (the
        largest estimate of any forward: `gathered_weights`)."""
        self._warned: set[str] = set()  # the causes already warned about (each warns once)
        self._pending: dict[str, str] = {}  # cause -> its warning, said at the end of the step
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
        """Every byte of the prediction not saved: expert gradients alive beyond one at a time (returned
        by a graph, kept whole, crossed over) and what gathered activations take back."""
        grads = sum(g.nbytes for g in self.lost.values())
        if self.bounds is None:
            return grads + self.activations_lost
        return min(grads + self.activations_lost, self.bounds.total)

    def _saves_under_half(self) -> bool:
        """Whether what is lost leaves less than half of the predicted saving."""
        if self.bounds is None or self.bounds.predicted_saving <= 0:
            return False
        return self.lost_bytes > self.bounds.predicted_saving / 2

    def _saving_line(self) -> str:
        if self.bounds is None:
            return ""
        predicted = self.bounds.predicted_saving
        kept = max(predicted - self.lost_bytes, 0)
        return (
            f" The saving left is about {_size(kept)} of the predicted {_size(predicted)} "
            f"({kept / max(predicted, 1):.0%})."
        )

    def _lose(self, cause: str, message: str, fix: str, tensors: Sequence[str], *, warn_always: bool) -> None:
        """One cause of a lost saving: raises under "raise" when the path now saves less than half its
        prediction (before any weight moves: every caller runs before the step's first update);
        otherwise warns once per cause (`warn_always`: even when the loss is smaller), when the step
        ends, so that the message names every tensor the step lost."""
        under_half = self._saves_under_half()
        if self.on_saving_lost == "raise" and under_half:
            raise SavingLostError(
                f"{message}{self._saving_line()} on_saving_lost='raise' refuses to train so. Fix: {fix} "
                "Or pass on_saving_lost='warn' to train without the saving.",
                list(tensors),
            )
        if cause not in self._warned and (under_half or warn_always):
            self._pending[cause] = f"{message}{self._saving_line()} Fix: {fix}"

    def crossed_over(self, name: str, *, operand_bytes: int, grad_bytes: int) -> None:
        """The deferred schedule: `name`'s kept operands (`operand_bytes`) outgrew its gradient
        (`grad_bytes`), which is now kept whole until `step()`."""
        self.lost[name] = LostGradient(name=name, kind="crossover", nbytes=grad_bytes)
        crossed = [g for g in self.lost.values() if g.kind == "crossover"]
        message = (
            f"sonar: schedule='deferred' keeps {len(crossed)} expert gradient(s) whole until step(), "
            f"because their kept operands outgrew them (the crossover; {name}: operands "
            f"{operand_bytes:,} B > gradient {grad_bytes:,} B): no memory saved for "
            f"{_size(sum(g.nbytes for g in crossed))} of expert gradients (training stays exact)."
        )
        fix = (
            "fewer tokens per step (the operands grow with the routed tokens, the gradient does not); an "
            "experts implementation whose weight-gradient operands are per token (grouped_mm: "
            "model.set_experts_implementation('grouped_mm')); or schedule='in_backward' (exact for a "
            "dense-only clip)."
        )
        self._lose("crossover", message, fix, [g.name for g in crossed], warn_always=False)

    def kept_whole(self, name: str, nbytes: int, *, compiler: str) -> None:
        """The deferred schedule: `name`'s gradient was computed by autograd itself (no operands were
        kept for it), so it is kept whole until `step()`."""
        if name in self.lost:
            return  # explained already (a graph another backend compiled returned it)
        self.lost[name] = LostGradient(name=name, kind="kept whole", nbytes=nbytes)
        whole = [g.name for g in self.lost.values() if g.kind == "kept whole"]
        whole_bytes = sum(g.nbytes for g in self.lost.values() if g.kind == "kept whole")
        if compiler == "eager":
            cause = (
                "the weight is also read outside its GEMM (a penalty on it), or the experts' forward "
                "computes them with a GEMM the eager capture does not know (it keeps the operands of "
                "grouped_mm on the weight, bmm on its gathered rows, linear on one expert's slice and the "
                "reference kernel's grouped GEMM)"
            )
            fix = (
                "keep the weight's reads inside its GEMM, or use one of transformers' experts "
                "implementations (grouped_mm, batched_mm, eager)."
            )
        else:
            cause = (
                "they were computed outside every compiled graph (a graph break), by a weight-gradient "
                "op the pass has no recipe for, or by a use of the weight outside its GEMM (a penalty on it)"
            )
            fix = "remove the graph break (TORCH_LOGS=graph_breaks names it) or use grouped_mm experts."
        message = (
            f"sonar: schedule='deferred' kept {len(whole)} expert gradient(s) whole until step() "
            f"({', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''}): {cause}. Training is exact, "
            f"but no memory is saved for their {_size(whole_bytes)} (report()['deferred']['kept_whole'] "
            "lists them)."
        )
        self._lose("kept whole", message, fix, whole, warn_always=True)

    def gathered_weights(self, nbytes: int, *, implementation: str) -> None:
        """The in-backward schedule: the experts implementation saves `nbytes` of gathered per-token
        expert weights for backward, alive at its start, where the step's peak then sits."""
        lost = min(nbytes, self.bounds.predicted_saving) if self.bounds is not None else nbytes
        if lost <= self.activations_lost:
            return
        self.activations_lost = lost
        message = (
            f"sonar: the experts implementation {implementation!r} saves a copy of the expert weights each "
            f"routed token uses ({_size(nbytes)} in this forward), alive when backward begins: the "
            "step's peak sits there, where freeing expert gradients cannot lower it (training stays exact)."
        )
        fix = (
            "model.set_experts_implementation('grouped_mm') (the default; it saves the tokens, not "
            "weight copies), or fewer tokens per step."
        )
        self._lose("gathered weights", message, fix, [], warn_always=False)

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

    def foreign_graph(self, lost: Sequence[LostGradient], *, schedule: str = "in_backward") -> None:
        """A graph that another backend compiled returns `lost` (it holds their expert tensors): warns
        once, or raises under "raise"."""
        self.lost.update((g.name, g) for g in lost)
        if self._warned_foreign and self.on_saving_lost == "warn":
            return
        nbytes = sum(g.nbytes for g in lost)
        shown = ", ".join(g.name for g in lost[:4]) + (" ..." if len(lost) > 4 else "")
        then = (
            "schedule='deferred' keeps them whole until step()"
            if schedule == "deferred"
            else "their hooks update them only after it returns"
        )
        message = (
            f"sonar: the prepared model's forward ran in a graph compiled by a backend other than sonar's "
            f"(torch.compile(model) with its default or another backend), and that graph holds "
            f"{len(lost)} expert tensor(s): {shown}. Its backward returns all their gradients at once and "
            f"{then}: no memory saved for {nbytes / MiB:.2f} MiB of expert gradients (training stays "
            "exact). Fix: sonar_fx.compile(model, cfg) instead of prepare + torch.compile, or "
            "torch.compile(model, backend='sonar'), whose pass "
            + (
                "keeps each expert's operands inside the graph."
                if schedule == "deferred"
                else "updates each expert inside the graph."
            )
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
        for cause, message in self._pending.items():
            self._warned.add(cause)
            warnings.warn(message, stacklevel=4)
        self._pending.clear()
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
        causes: dict[str, int] = {}
        for g in self.lost.values():
            cause = g.kind if g.kind in ("crossover", "kept whole", "another backend") else "graph returns"
            causes[cause] = causes.get(cause, 0) + g.nbytes
        if self.activations_lost:
            causes["gathered weights"] = self.activations_lost
        return {
            "saving_lost_bytes": self.lost_bytes,
            "saving_lost_tensors": sorted(self.lost),
            "saving_lost_by_cause": causes,
            "graphs_saving_lost": self.graphs_lost,
        }


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:.2f} MiB" if nbytes >= MiB else f"{nbytes / 2**10:.0f} KiB"


class _Owner(Protocol):
    """What `watch_compiled_forward` reads of `SonarOptimizer` (which imports this module)."""

    compiler: str
    schedule: str
    stats: SonarStats
    meter: ExpertGradMeter
    saving: SavingGuard

    @property
    def expert_layers(self) -> list[ExpertLayer]: ...

    def owns(self, param: Tensor) -> bool: ...

    def expert_name(self, param: Tensor) -> str: ...


def watch_compiled_forward(owner: _Owner, tensors: Sequence[Tensor]) -> None:
    """After a forward of a model `owner` prepared (not compiled by sonar_fx): find the compiled graphs
    behind its outputs that hold `owner`'s expert tensors; meter the expert gradients their backward
    returns, and warn (or raise, before any hook updates them) when such a graph returns expert
    gradients and no graph of this model ever came through the sonar backend. Nothing to do where
    dynamo never compiled a frame in this process (an eager run pays nothing)."""
    if owner.compiler != "eager":
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
                ],
                schedule=owner.schedule,
            )

    for node, leaves in compiled_nodes(tensors):
        if any(owner.owns(p) for p in leaves):
            meter_node(node, lambda p: owner.meter if owner.owns(p) else None, lost)


GATHERING_IMPLEMENTATIONS = ("batched_mm",)
"""transformers' experts implementations that gather each routed token's expert weights (`w[ids]`)
and save the copies for backward: per token, `top_k` experts' worth of every expert tensor."""


def watch_gathered_experts(owner: _Owner, model: nn.Module, output: Any) -> None:
    """After a forward with grad of the in-backward schedule: the bytes of expert-weight copies a
    gathering experts implementation saved for backward (routed slots x one expert's tensors, per layer),
    judged against the predicted saving (`SavingGuard.gathered_weights`): they are alive when backward
    begins, where the step's peak then sits. Before the backward, so before any update."""
    logits = getattr(output, "logits", None)
    if owner.schedule != "in_backward" or not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        return
    per_token, implementation = 0, ""
    for layer in owner.expert_layers:
        config = getattr(model.get_submodule(layer.name), "config", None)
        chosen = getattr(config, "_experts_implementation", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if chosen not in GATHERING_IMPLEMENTATIONS or not isinstance(top_k, int):
            continue
        implementation = chosen
        per_token += (
            top_k
            * sum(t.param.numel() * t.param.element_size() for t in layer.tensors)
            // max(layer.num_experts, 1)
        )
    if per_token:
        owner.saving.gathered_weights(logits.shape[:-1].numel() * per_token, implementation=implementation)


def expert_grad_bytes(meter: ExpertGradMeter, layers: Sequence[ExpertLayer]) -> dict[str, int | None]:
    """The measured peak of expert-gradient bytes alive at once in the last step, beside the bounds:
    Sonar keeps at most `one_layer`; standard training holds `all_layers` at its optimizer step."""
    bounds = ExpertGradBytes.of(layers) if layers else None
    return {
        "measured_peak": meter.last_peak,
        "one_layer": bounds.one_layer if bounds else None,
        "all_layers": bounds.total if bounds else None,
    }
