"""The deferred step's per-tensor loop, pipelined: an expert gradient's reduction runs while the next
one is computed.

Each pass of the deferred step (the norm/verdict pass and the update pass) computes the expert
gradients one after another. Under data parallelism each needs a collective (DDP: the mean
all-reduce) before it is read. Run one at a time, the collective waits for nothing and the GEMMs wait
for the collective. Here a gradient's collective starts as soon as the gradient exists (`started`),
the next gradient is computed while it runs, and only then is it waited, finished (its norm, or its
update) and freed:

    compute g0, start r0 | compute g1 | start r1, wait r0, finish g0 | compute g2 | start r2, wait r1, ...

At most two expert gradients are alive at once: the one in flight and the one being computed. The
one being computed adds its micro-batches' pieces after the first into its running sum one run of
experts at a time while a gradient is in flight (`in_flight`; `sliced_sum`, where the recipe allows):
one slice beside the two, and the collective overlaps the whole computation. When it needs a second
gradient-sized tensor of its own instead (a piece that cannot be sliced, a layout copy), it first makes
room (`make_room`: the one in flight is finished), so the collective overlaps at least its first GEMM
and the bound holds. A reduction with nothing in flight (one process; expert parallelism's own
experts) is finished at once: no gradient is held for nothing, and those runs keep one gradient alive
at a time, as before.

Never: change what is computed, nor the order in which gradients are started and finished (every rank
starts and waits its collectives in the same order; norms and updates run in parameter order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from sonar_fx.optim.reduction import Reducing

Finish = Callable[[Tensor], None]
"""What a pass does with a reduced gradient (its norm, or its update), then frees it (meter)."""


@dataclass
class _Flight:
    reducing: Reducing
    finish: Finish


class OneInFlight:
    """At most one expert gradient whose reduction is running, beside the one being computed."""

    def __init__(self) -> None:
        self._pending: _Flight | None = None
        self.overlapped = 0
        """Gradients whose collective was still in flight when the next gradient was computed."""

    def started(self, reducing: Reducing, finish: Finish) -> None:
        """`reducing` (the gradient just computed) was started: finish the one before it, then keep
        this one in flight while the next is computed (or finish it now when nothing runs)."""
        self.make_room()
        flight = _Flight(reducing, finish)
        if reducing.in_flight:
            self._pending = flight
        else:
            _finish(flight)

    @property
    def in_flight(self) -> bool:
        """Whether a gradient is in flight now (the next one's pieces are then added by expert slices
        where they can be: `deferred_gradient.step_gradient`)."""
        return self._pending is not None

    def make_room(self) -> None:
        """Finish the gradient in flight, if any: wait for its collective, finish it (which frees it).
        Called while the next gradient is computed (or once it is): that one overlapped its collective."""
        flight, self._pending = self._pending, None
        if flight is not None:
            self.overlapped += 1
            _finish(flight)

    def finish_last(self) -> None:
        """The loop's end: finish the gradient still in flight (nothing was computed beside it)."""
        flight, self._pending = self._pending, None
        if flight is not None:
            _finish(flight)

    def abandon(self) -> None:
        """After an error: wait for the collective in flight (every rank started it), finish nothing."""
        flight, self._pending = self._pending, None
        if flight is not None:
            flight.reducing.wait()


def _finish(flight: _Flight) -> None:
    flight.finish(flight.reducing.wait())


@contextmanager
def pipelined() -> Iterator[OneInFlight]:
    """A pass's loop: the gradient still in flight when the loop ends is finished here."""
    line = OneInFlight()
    try:
        yield line
    except BaseException:
        line.abandon()
        raise
    line.finish_last()
