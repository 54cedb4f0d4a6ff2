"""The deferred step's pipelining (`sonar_fx.optim.deferred_pipeline`), in one process: each expert
gradient's reduction is started as soon as the gradient exists, runs while the next one is computed,
and is waited before its norm or update; never more than two expert gradients alive at once.

A reduction stands in for the engine's (`step_reduction`): it leaves the gradient as it is (so the run
is bitwise the plain-torch twin of `test_deferred`), hands back a handle that says a collective is in
flight, and logs when each is started and waited; the store's `gradient` logs when each computation
begins. The 2-rank runs with DDP's real asynchronous all-reduce are in test_distributed_deferred.py.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import pytest
import torch

from sonar_fx.optim import deferred_entries, deferred_step
from sonar_fx.optim.reduction import Reduced, StepReduce
from sonar_fx.optim.sliced_sum import SLICES

from helpers import assert_same_weights
from test_deferred import pair, run_steps


@dataclass
class _InFlight:
    grad: torch.Tensor
    log: list[tuple[str, str]]
    name: str
    in_flight: bool = True

    def wait(self) -> torch.Tensor:
        self.log.append(("wait", self.name))
        return self.grad


@dataclass
class Recorder:
    """A stand-in reduction and the events of each step: ("compute" | "start" | "wait", tensor name)."""

    in_flight: bool = True
    log: list[tuple[str, str]] = field(default_factory=list)
    started: list[weakref.ref] = field(default_factory=list)
    most_started_alive: int = 0
    """The most gradients started earlier still alive (not garbage) when a computation begins."""
    dense_at: list[int] = field(default_factory=list)
    """Where in `log` each step's dense update ran (its length then)."""

    def reduce(self, name: str, grad: torch.Tensor):
        self.log.append(("start", name))
        self.started.append(weakref.ref(grad))
        return _InFlight(grad, self.log, name) if self.in_flight else Reduced(grad)

    def watch(self, opt) -> None:
        store, compute = opt.deferred, opt.deferred.gradient

        def logged(param, **kwargs):
            self.log.append(("compute", opt.expert_name(param)))
            alive = sum(ref() is not None for ref in self.started)
            self.most_started_alive = max(self.most_started_alive, alive)
            return compute(param, **kwargs)

        store.gradient = logged
        dense_update = opt.dense_update

        def dense_logged() -> None:
            self.dense_at.append(len(self.log))
            dense_update()

        opt.dense_update = dense_logged


@pytest.fixture
def recorded(monkeypatch):
    def build(in_flight: bool, accum: int, clip: str = "all"):
        recorder = Recorder(in_flight=in_flight)
        at_step: StepReduce = recorder.reduce
        monkeypatch.setattr(deferred_step, "step_reduction", lambda distributed: at_step)
        model, opt, twin_model, twin = pair("eager", torch.float32, clip)
        recorder.watch(opt)
        run_steps(model, opt, twin, accum, steps=2)
        return recorder, model, opt, twin_model

    return build


@pytest.mark.parametrize("accum", [1, 2])
def test_each_reduction_runs_while_the_next_gradient_is_computed_and_stays_bitwise(recorded, accum):
    recorder, model, opt, twin_model = recorded(in_flight=True, accum=accum)
    assert_same_weights(model, twin_model)  # the order of waits changes no bit
    names = [opt.expert_name(p) for p in opt.expert_group["params"]]
    log = recorder.log
    # One step, norm pass then update pass: each pass starts every tensor's reduction once, in order.
    for events in _passes(log):
        assert [n for e, n in events if e == "start"] == names
        assert [n for e, n in events if e == "wait"] == names  # waited in the order started
        for before, after in itertools.pairwise(names):
            order = [("start", before), ("compute", after), ("wait", before)]
            started, computing, waited = (events.index(event) for event in order)
            # g[i]'s reduction was started before g[i+1]'s computation began and waited only after.
            assert started < computing < waited, events
    assert opt.report()["deferred"]["overlapped"] == 2 * 2 * (len(names) - 1)  # 2 passes x 2 steps


def _passes(log: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The first step's norm pass and update pass (2 steps of 2 passes each)."""
    return [log[: len(log) // 4], log[len(log) // 4 : len(log) // 2]]


def test_a_reduction_overlaps_the_whole_next_gradient_by_slices(recorded):
    """With accumulation a gradient is the sum of its micro-batches' pieces. Those after the first are
    added into the sum by expert slices (`sliced_sum`), so the gradient in flight is waited only once
    the next one is complete and started, not before that one's second piece; bitwise all the same.
    (Two micro-batches: more would cross over on this model, its gradients then held whole; three
    pieces are summed by slices in test_sliced_sum.py, four on 2 ranks in test_distributed_deferred.)"""
    recorder, model, opt, twin_model = recorded(in_flight=True, accum=2)
    assert_same_weights(model, twin_model)
    names = [opt.expert_name(p) for p in opt.expert_group["params"]]
    for events in _passes(recorder.log):
        for before, after in itertools.pairwise(names):
            started_next, waited = events.index(("start", after)), events.index(("wait", before))
            assert started_next < waited, events


def test_negative_control_pieces_made_whole_wait_before_the_second(recorded, monkeypatch):
    """A piece the store cannot add by slices is made whole: the gradient in flight is finished first
    (never three alive), so its reduction overlaps only the first piece."""
    monkeypatch.setattr(deferred_entries, "add_by_slices", lambda *args: False)
    recorder, model, opt, twin_model = recorded(in_flight=True, accum=2)
    assert_same_weights(model, twin_model)
    names = [opt.expert_name(p) for p in opt.expert_group["params"]]
    for events in _passes(recorder.log):
        for before, after in itertools.pairwise(names):
            order = [("compute", after), ("wait", before), ("start", after)]
            computing, waited, started_next = (events.index(event) for event in order)
            assert computing < waited < started_next, events


@pytest.mark.parametrize("accum", [1, 2])
def test_at_most_two_expert_gradients_alive_at_once(recorded, accum):
    """The meter (the honest count) and the tensors themselves: the one in flight and the one being
    computed; its later pieces (a micro-batch's, beside its running sum) are added one expert slice at
    a time, so one slice is alive beside the two."""
    recorder, _, opt, _ = recorded(in_flight=True, accum=accum)
    params = opt.expert_group["params"]
    sizes = [p.numel() * p.element_size() for p in params]
    slices = [-(-p.shape[0] // SLICES) * p[0].numel() * p.element_size() for p in params]
    pairs = [a + b for a, b in itertools.pairwise(sizes)]
    beside = [pair + s for pair, s in zip(pairs, slices[1:], strict=True)] if accum > 1 else pairs
    assert opt.deferred.crossed == {} and opt.report()["deferred"]["kept_whole"] == []  # nothing held
    peak = opt.meter.last_peak
    # Two at most (the first of a pass: its sum and a whole piece), and a slice, beside the operands.
    assert peak <= max(*beside, *(2 * s for s in sizes)), (peak, sizes)
    assert peak >= min(pairs), (peak, sizes)  # and two were alive: the overlap is counted, not hidden
    assert recorder.most_started_alive <= 1  # no gradient outlives its update but the one in flight


def test_negative_control_nothing_in_flight_finishes_each_at_once(recorded):
    """A reduction with nothing in flight (one process, expert parallelism) is finished as soon as
    it is started: no overlap, one gradient alive at a time (two only while pieces are summed)."""
    recorder, model, opt, twin_model = recorded(in_flight=False, accum=1)
    assert_same_weights(model, twin_model)
    sizes = [p.numel() * p.element_size() for p in opt.expert_group["params"]]
    assert opt.meter.last_peak == max(sizes)
    assert opt.report()["deferred"]["overlapped"] == 0
    assert recorder.most_started_alive == 0


@pytest.mark.parametrize("clip", ["all", "dense"])
def test_the_dense_update_runs_beside_the_last_reduction(recorded, clip):
    """No next expert gradient is left to overlap the last one's collective: the dense update does
    (after every verdict and the clip, so it still moves nothing on a refused or skipped step)."""
    recorder, model, opt, twin_model = recorded(in_flight=True, accum=1, clip=clip)
    assert_same_weights(model, twin_model)
    last = opt.expert_name(opt.expert_group["params"][-1])
    log, ends = recorder.log, [len(recorder.log) // 2, len(recorder.log)]  # 2 steps, equal logs
    assert len(recorder.dense_at) == 2
    for begin, at, end in zip([0, ends[0]], recorder.dense_at, ends, strict=True):
        step = log[begin:end]
        started = max(i for i, e in enumerate(step) if e == ("start", last))  # the update pass's
        waited = max(i for i, e in enumerate(step) if e == ("wait", last))
        assert started < at - begin <= waited, (step, at - begin)
