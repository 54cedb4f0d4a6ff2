"""One expert gradient of the deferred step, made from the store's kept contributions and counted on the
meter while it is made and held: the one helper of every pass that computes expert gradients at
`step()` (the step's verdict and update passes, `deferred_step`; the user's clip, `deferred_loop`).
It imports the store and the layout rule only, so both passes sit above it. Never changes what is
computed; it only reads the store and tells the meter what is alive.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.deferred import DeferredGrads, alive_for_a_moment
from sonar_fx.runtime.meter import ExpertGradMeter


def _nothing() -> None:
    return None


def step_gradient(
    store: DeferredGrads,
    meter: ExpertGradMeter,
    p: Tensor,
    *,
    consume: bool,
    key: object,
    read_only: bool = False,
    make_room: Callable[[], None] = _nothing,
    in_flight: bool = False,
) -> Tensor:
    """`p`'s gradient for the step, in its layout, counted on the meter under `key` while the caller
    holds it, with what is alive beside it while it is made: one more gradient-sized tensor when pieces
    are summed (backwards, or a gradient held and kept operands), and a layout copy's source. Before
    either, `make_room()` finishes the gradient still in flight (`deferred_pipeline`): never three
    alive. `in_flight`: a gradient is in flight (`make_room` would wait for it): a piece the store can
    add by expert slices is (`sliced_sum`), so nothing waits until this gradient is complete and one
    slice is alive beside the two. A norm pass (`consume=False`) reads a gradient already held as one
    tensor in place when it only reads it (`read_only`: no unscaling in place): no second copy."""
    nbytes = p.numel() * p.element_size()
    held = store.held(p)  # counted by the store while it holds it (arrived whole, or crossed over)

    def piece_beside_the_sum() -> None:
        make_room()
        alive_for_a_moment(meter, nbytes)

    if not consume and read_only and held is not None:
        raw = held
    elif consume and held is not None:  # the held tensor itself is the step's gradient: counted anew
        raw = _required(store.gradient(p, consume=True))
        meter.appeared(key, nbytes)
    else:
        meter.appeared(key, nbytes)
        by_slices = partial(_slice_made, store, meter) if in_flight else None
        raw = _required(
            store.gradient(p, consume=consume, before_second=piece_beside_the_sum, before_slice=by_slices)
        )
    if raw.stride() == p.stride():
        return raw
    make_room()  # a layout copy: counted under `key`, with its source beside it for a moment
    grad = grad_like_param(p, raw)
    meter.appeared(key, nbytes)
    if raw is not held:  # (a held source is counted already)
        alive_for_a_moment(meter, nbytes)
    return grad


def _slice_made(store: DeferredGrads, meter: ExpertGradMeter, nbytes: int) -> None:
    """An expert slice of a piece, alive beside the sum for a moment (`sliced_sum`), counted."""
    store.sliced += 1
    alive_for_a_moment(meter, nbytes)


def _required(grad: Tensor | None) -> Tensor:
    assert grad is not None, "an expert with neither kept operands nor a gradient was stepped"
    return grad
