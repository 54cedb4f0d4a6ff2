"""The deferred schedule: expert gradients computed at `step()` from kept operands, one at a time.

In backward, the graph pass hands over, for each expert tensor, the operands of its weight-gradient
op and a recipe to run it (`sonar_fx.passes.defer_grads`); `DeferredGrads` keeps them, per tensor, in
the order backward produced them, for any number of backwards. At `step()` each expert gradient is
computed from them (the same ops on the same operands) and summed in that order, which is what
autograd's accumulation computes, bit for bit; so the step sees the facts of the whole step first:
- the global norm over ALL gradients (expert_clip="global"): a first pass computes, takes the norm of
  and frees each expert gradient; the update pass computes it again (unless the keep budget let the
  first pass keep it: `keep_budget`);
- a GradScaler's verdict: every expert gradient is unscaled and checked before any weight moves;
- gradient accumulation: the micro-batches' operands, summed at the step.
Kept per backward (autograd's graph task): within one backward the contributions to a weight are
summed in the order they arrive, as the engine's input buffer sums them, and the backwards' sums are
accumulated in the order the backwards end, as AccumulateGrad adds them: (e0+e1)+(e2+e3), never
((e0+e1)+e2)+e3. A gradient that arrives whole (the weight also read outside its GEMM, a graph break,
a producer with no recipe) is taken out of `.grad` by the expert's hook and joins its backward's sum
where it arrived: exact, but alive until the step (counted by the meter; the saving guard says
so, once, with the cause). A tensor
whose kept contributions outgrow its gradient (many tokens per step) crosses over: the same sums are
taken then and carried as one gradient from there on, as standard training holds it: each later
backward's contributions are added into it when autograd runs the tensor's AccumulateGrad node (a
pre-hook on it: `_await_accumulation`), as AccumulateGrad adds, so the carried gradient and a new
backward's sum are never held side by side through the backward. A backward that
plain torch would not take to an expert tensor (`inputs=`, `torch.autograd.grad` of other tensors)
keeps nothing for it (`wanted_by_this_backward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.deferred_entries import (
    Entry,
    Kept,
    WeightView,
    accumulate,
    after_first,
    alive_for_a_moment,
    pieces,
)
from sonar_fx.optim.kept_storages import StorageLedger, operand_storages, storages_of
from sonar_fx.runtime.engine import accumulate_grad_node, gradient_fate
from sonar_fx.runtime.meter import ExpertGradMeter

NO_TASK = -1  # what autograd reports outside any backward


@dataclass
class _Pending:
    """One expert tensor's gradient of the step, as autograd accumulates it: within a backward, its
    contributions summed in the order they arrived (the engine's input buffer); the backwards' sums
    added in the order the backwards ended (AccumulateGrad: the first assigned, each next added)."""

    param: Tensor
    closed: list[list[Entry]] = field(default_factory=list)
    open: dict[int, list[Entry]] = field(default_factory=dict)
    """Graph task id -> the contributions of a backward still running."""
    folded: bool = False
    """Crossed over: `closed` holds at most one gradient; an open backward's contributions are added
    into it when autograd's AccumulateGrad for the tensor runs in that backward (`_settle`)."""
    operands: StorageLedger = field(default_factory=StorageLedger)
    """The storages its kept operands live in, each once however many of them view it (an eager loop's
    operands are views of a few buffers): the bytes its crossover rule weighs, kept up per entry."""
    whole_entries: int = 0
    """How many of its entries are gradients (arrived whole, or sums): all in `closed` whenever a
    backward settles (`add_whole` settles its own at once)."""
    metered: dict[int, list[Tensor]] = field(default_factory=dict)
    """The gradient-sized tensors held (whole gradients, sums) as the meter counts them: id -> the
    entries that are that tensor (a fold's sum may be the first of the entries it replaces)."""

    def groups(self) -> list[list[Entry]]:
        """Every backward's contributions, in the order their sums are added (a backward that raised
        and so never ended counts as ended now)."""
        return self.closed + [self.open[task] for task in sorted(self.open)]

    def fold_closed(self) -> bool:
        """The ended backwards' sums accumulated into one gradient (the same additions, in order).
        True if a piece was computed beside the running total (it lived for a moment)."""
        if len(self.closed) > 1 or any(isinstance(e, Kept) for g in self.closed for e in g):
            beside = sum(pieces(g) for g in self.closed) > 1
            total = accumulate(self.closed, self.param, own=True)
            self.closed = [[total]] if total is not None else []
            return beside
        return False


def _flat(groups: list[list[Entry]]) -> list[Entry]:
    return [e for g in groups for e in g]


@dataclass
class DeferredGrads:
    """The step's kept contributions, per expert tensor and per backward, and what they cost."""

    kept: dict[int, _Pending] = field(default_factory=dict)
    meter: ExpertGradMeter | None = None
    """Counts every gradient-sized tensor held here, alive from backward to `step()` (`_count`)."""
    peak_bytes: int = 0
    """The most kept at once since the last `end_step`."""
    last_peak_bytes: int | None = None
    crossed: dict[str, int] = field(default_factory=dict)
    """Expert tensor name -> operand bytes it held when it crossed over to a kept gradient."""
    whole: set[str] = field(default_factory=set)
    """Expert tensors whose gradient arrived whole (not deferred) in this run."""
    overlapped: int = 0
    """Expert gradients computed at `step()` while the collective of the one before still ran
    (`deferred_pipeline`), in this run."""
    sliced: int = 0
    """Expert slices of pieces added by slices beside a gradient in flight (`sliced_sum`), in this run."""
    _open_tasks: set[int] = field(default_factory=set)  # backwards whose end a callback awaits
    _hooks: dict[int, list[RemovableHandle]] = field(default_factory=dict)  # task -> AccumulateGrad hooks
    _ledger: StorageLedger = field(default_factory=StorageLedger)  # what `live_bytes` counts

    @property
    def live_bytes(self) -> int:
        """Bytes kept now: the storages of the kept operands and of the gradients kept whole (arrived
        whole, or crossed over: standard training would hold them in `.grad`), each storage once however
        many kept tensors view it (a kept view keeps its whole storage alive)."""
        return self._ledger.live_bytes

    def add(
        self,
        param: Tensor,
        name: str,
        recipe: str,
        operands: list[Tensor],
        *,
        reached: Tensor | None = None,
        node: Node | None = None,
    ) -> None:
        """One weight-gradient GEMM's operands for `param`, from the backward running now. `reached`:
        the tensor autograd accumulates into for `param`, where that is another (FSDP2's unsharded one);
        `node`: its AccumulateGrad node, where the caller looked it up (`accumulation_node`)."""
        aliases, storages = operand_storages(param, operands)
        kept = [_weight_view(t) if alias else t for t, alias in zip(operands, aliases, strict=True)]
        entry = Kept(recipe, kept, storages)
        self._contribute(param, name, entry, param if reached is None else reached, node)

    def add_whole(self, param: Tensor, name: str) -> None:
        """`param.grad`, arrived whole in this backward (its hook calls this): moved out of `.grad`, which
        the next backward's contributions then find empty, into this backward's sum where it arrived
        (the saving guard says why it came whole: `deferred_intake.keep_whole`)."""
        grad, param.grad = param.grad, None
        assert grad is not None
        self.whole.add(name)
        self._contribute(param, name, grad, None)
        # Its hook runs in AccumulateGrad: this backward's contributions to `param` are all in.
        self._settle(self.kept[id(param)], torch._C._current_graph_task_id())

    def add_accumulated(self, param: Tensor, grad: Tensor) -> None:
        """`param`'s gradient of the backwards so far, as one (ended) backward's sum."""
        pending = self.kept.setdefault(id(param), _Pending(param))
        pending.closed.insert(0, [grad])
        self._swap(pending, dropped=[], added=[grad])

    def _contribute(
        self, param: Tensor, name: str, entry: Entry, reached: Tensor | None, node: Node | None = None
    ) -> None:
        """`entry` joins its backward's contributions (`reached`: the tensor whose AccumulateGrad ends
        them; None: it is running now)."""
        pending = self.kept.get(id(param))
        if pending is None:
            pending = self.kept[id(param)] = _Pending(param)
        task = torch._C._current_graph_task_id()
        self._group(pending, task, reached, node).append(entry)
        self._swap(pending, dropped=[], added=[entry])
        # The crossover is the operands outgrowing the gradient (each storage they live in counted
        # once); whole gradients are summed as their backward's sum is complete (`_settle`) and never
        # cross over by themselves.
        operands = pending.operands.live_bytes
        if not pending.folded and operands > param.numel() * param.element_size():
            pending.folded = True
            self.crossed[name] = operands
            self._fold(pending)  # the ended backwards' sums: one gradient from now on
        elif pending.folded and task == NO_TASK:
            self._fold(pending)  # a contribution outside any backward: its own, added now

    def _group(self, pending: _Pending, task: int, reached: Tensor | None, node: Node | None) -> list[Entry]:
        """The running backward's contributions of `pending` (a call outside any backward: one of its own)."""
        if task == NO_TASK:
            pending.closed.append([])
            return pending.closed[-1]
        if task not in self._open_tasks:
            self._open_tasks.add(task)
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(functools.partial(self._close, task))
        group = pending.open.get(task)
        if group is None:
            group = pending.open[task] = []
            if reached is not None:
                self._await_accumulation(pending, task, reached, node)
        return group

    def _await_accumulation(self, pending: _Pending, task: int, reached: Tensor, node: Node | None) -> None:
        """Settle `pending`'s contributions of backward `task` when autograd runs `reached`'s
        AccumulateGrad node in it: its engine runs that node once every use of the tensor in this
        backward has handed in its part, where plain torch adds the backward's sum to `.grad`."""

        def accumulating(grad_outputs: tuple[Tensor | None, ...]) -> None:
            handle.remove()
            # A gradient computed whole comes with it: its hook (`add_whole`) settles after adding it.
            if grad_outputs[0] is None and self.kept.get(id(pending.param)) is pending:
                self._settle(pending, task)

        handle = (node if node is not None else accumulate_grad_node(reached)).register_prehook(accumulating)
        self._hooks.setdefault(task, []).append(handle)

    def _settle(self, pending: _Pending, task: int) -> None:
        """Backward `task`'s contributions to `pending` are all in: its sum joins the ended ones, and
        where a gradient is held already (crossed over, or arrived whole) it is accumulated into it
        now, as AccumulateGrad adds it, rather than held beside it until the backward ends."""
        group = pending.open.pop(task, None)
        if group:
            pending.closed.append(group)
        if pending.folded or (pending.whole_entries and len(pending.closed) > 1):
            self._fold(pending)

    def _fold(self, pending: _Pending) -> None:
        """`pending`'s ended backwards accumulated into one gradient, counted: what it holds, and the
        piece that lived beside the running total for a moment (the new sum, before its add)."""
        before = pending.closed
        beside = pending.fold_closed()
        if pending.closed is not before:  # folded: a new list of one gradient (or none)
            self._swap(pending, dropped=_flat(before), added=_flat(pending.closed))
        if beside and self.meter is not None:
            alive_for_a_moment(self.meter, pending.param.numel() * pending.param.element_size())

    def _swap(self, pending: _Pending, *, dropped: list[Entry], added: list[Entry]) -> None:
        """The bytes kept (`live_bytes`, `pending.operands`) and the meter's count of `pending`'s held
        gradient-sized tensors made what it holds now: `dropped` (summed into another, or let go)
        released first, then `added` taken. Costs the entries that changed, never all it holds."""
        for entry in dropped:
            self._tally(pending, entry, keep=False)
        for entry in added:
            self._tally(pending, entry, keep=True)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _tally(self, pending: _Pending, entry: Entry, *, keep: bool) -> None:
        """`entry` counted as kept (`keep`) or let go, each storage once however many entries keep it."""
        storages = entry.storages if isinstance(entry, Kept) else storages_of([entry])
        change = StorageLedger.take if keep else StorageLedger.release
        change(self._ledger, storages)
        if isinstance(entry, Kept):
            change(pending.operands, storages)
            return
        pending.whole_entries += 1 if keep else -1
        if self.meter is not None:
            same = pending.metered.setdefault(id(entry), [])
            if keep:
                if not same:
                    self.meter.appeared(entry, entry.numel() * entry.element_size())
                same.append(entry)
            else:
                same.pop()
                if not same:
                    del pending.metered[id(entry)]
                    self.meter.freed(entry)

    def _uncount(self, pending: _Pending) -> None:
        """`pending`'s entries let go (handed to the step, or dropped)."""
        self._swap(pending, dropped=_flat(pending.groups()), added=[])

    def _close(self, task: int) -> None:
        """Autograd ended graph task `task` (nested ones too: reentrant checkpointing accumulates each
        nested backward on its own): its sums are complete (those not settled at AccumulateGrad)."""
        self._open_tasks.discard(task)
        for handle in self._hooks.pop(task, []):
            handle.remove()
        for pending in self.kept.values():
            self._settle(pending, task)

    def has(self, param: Tensor) -> bool:
        return id(param) in self.kept or param.grad is not None

    def arrived_whole(self, param: Tensor) -> bool:
        """`param`'s gradient came whole (taken from `.grad` in backward): no operands were kept for it."""
        pending = self.kept.get(id(param))
        if pending is None:  # a gradient in `.grad` at the step was shown there for a GradScaler
            return False
        return not pending.folded and all(not isinstance(e, Kept) for g in pending.groups() for e in g)

    def crossed_over(self, param: Tensor) -> bool:
        """`param`'s kept contributions outgrew its gradient in this step: it is held as a gradient now."""
        pending = self.kept.get(id(param))
        return pending is not None and pending.folded

    def pieces(self, param: Tensor) -> int:
        """How many gradient-sized pieces `gradient(param)` sums (kept contributions and `.grad`)."""
        pending = self.kept.get(id(param))
        kept = sum(pieces(g) for g in pending.groups()) if pending is not None else 0
        return kept + (param.grad is not None)

    def held(self, param: Tensor) -> Tensor | None:
        """`param`'s step gradient when it is already one tensor (arrived whole or accumulated past the
        crossover, in the store or in `.grad`), to be read in place; else None."""
        pending = self.kept.get(id(param))
        if pending is None:
            return param.grad
        if not pending.whole_entries:  # kept operands alone (the usual case): asked of every tensor
            return None  # twice a pass, so answered before the pieces are counted (`_tally` keeps it)
        if self.pieces(param) != 1:
            return None
        entry = next(e for g in pending.groups() for e in g)
        return entry if isinstance(entry, Tensor) else None

    def entries(self) -> list[Kept]:
        """Every kept set of operands, in the order kept per tensor (for tests and tools)."""
        return [e for p in self.kept.values() for g in p.groups() for e in g if isinstance(e, Kept)]

    def gradient(
        self,
        param: Tensor,
        *,
        consume: bool,
        before_second: Callable[[], None] | None = None,
        before_slice: Callable[[int], None] | None = None,
    ) -> Tensor | None:
        """`param`'s gradient for the step: `.grad` (the backwards so far, shown there for a GradScaler
        by `deferred_loop.backward_finished`), then each backward's sum accumulated in order.
        `consume`: drop the contributions and `.grad` (the update pass); else they stay and the result
        is a new tensor (the norm pass). `before_second` is called before each piece after the first
        is read (a piece then lives beside the running sum: the caller makes room for it first);
        `before_slice` (given: a gradient in flight stays alive) before each expert slice of a piece
        added by slices instead (`accumulate`)."""
        pending = self.kept.pop(id(param), None) if consume else self.kept.get(id(param))
        groups = pending.groups() if pending is not None else []
        grad = param.grad
        if consume:
            param.grad = None
            if pending is not None:
                self._uncount(pending)  # the caller counts the gradient it gets (`deferred_gradient`)
        if grad is not None:
            groups = [[grad], *groups]
        return accumulate(
            groups, param, own=consume, before_piece=after_first(before_second), before_slice=before_slice
        )

    def discard(self, param: Tensor) -> None:
        """Drop `param`'s kept contributions uncomputed: the keep budget holds its gradient
        (`keep_budget.KeptGradients`)."""
        pending = self.kept.pop(id(param), None)
        if pending is not None:
            self._uncount(pending)

    def clear(self) -> None:
        """Drop every kept contribution (`zero_grad`)."""
        for pending in self.kept.values():
            self._uncount(pending)
        self.kept.clear()
        self._ledger.clear()

    def end_step(self) -> None:
        self.last_peak_bytes, self.peak_bytes = self.peak_bytes, self.live_bytes

    def note_whole(self, names: list[str]) -> None:
        """Gradients that arrived whole (the saving guard said why, as each arrived: `kept_whole`)."""
        self.whole.update(names)

    def report(self) -> dict[str, object]:
        return {
            "kept_operand_bytes": self.live_bytes,
            "kept_operand_peak": self.last_peak_bytes,
            "crossed_over": dict(self.crossed),
            "kept_whole": sorted(self.whole),
            "overlapped": self.overlapped,
            "sliced": self.sliced,
        }


def _weight_view(t: Tensor) -> WeightView:
    return WeightView(tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))


def accumulation_node(target: Tensor) -> Node | None:
    """`target`'s AccumulateGrad node in the running backward, looked up once per hand-over for the two
    questions asked of it (`wanted_by_this_backward`, and the node whose run settles the backward's sum:
    `DeferredGrads.add`); None outside any backward or for a frozen tensor (neither asks then)."""
    if torch._C._current_graph_task_id() == NO_TASK or not target.requires_grad:
        return None
    return accumulate_grad_node(target)


def wanted_by_this_backward(param: Tensor, name: str, node: Node | None = None) -> bool:
    """Whether the running backward accumulates into `param` (plain torch would give it a gradient):
    not under `backward(inputs=...)` without it, nor `torch.autograd.grad` of other tensors (autograd's
    engine answers: `sonar_fx.runtime.engine`). Refused: `torch.autograd.grad` of the expert tensor
    itself (its gradient exists only at `step()`)."""
    fate = gradient_fate(param, node)
    if fate == "requested":
        raise SonarUsageError(
            f"{name}: torch.autograd.grad() of an expert tensor under schedule='deferred': its "
            "gradient is computed at step() from kept operands, never returned in backward. Take "
            "autograd.grad() of other tensors only; loss.backward() and step() train the experts."
        )
    return fate == "accumulate"
