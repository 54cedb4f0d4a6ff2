"""The deferred store's hot path: an add costs its own operands, however many the tensor holds already.

A step keeps many contributions per expert tensor (micro-batches; an eager loop keeps one per expert),
so the store keeps its counts (the bytes kept, each tensor's operand bytes for its crossover rule)
up per entry as entries come and go. These tests count the work (storages visited, Python calls),
never a time, and check the counts against a recount from scratch and the gradient against plain torch.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import torch

from sonar_fx.memory import measure_peak
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.kept_storages import storages_of
from sonar_fx.passes.recipe import Recipe
from sonar_fx.runtime.meter import ExpertGradMeter

MM_RECIPE = Recipe("aten.mm.default", [{"operand": 0}, {"operand": 1}], {}, None, []).to_json()
"""`dy^T.mm(x)`: a weight gradient over its kept (dy^T, x)."""
WIDTH = 512
"""The weight is WIDTH x WIDTH fp32 (1 MiB); each contribution keeps 2 x WIDTH x 4 bytes of rows."""


def python_calls(call: Callable[..., object], *args: object) -> int:
    """Python frames entered while `call(*args)` runs (a loop over a tensor's entries: one per entry).
    The cyclic collector is off meanwhile: a collection inside the call runs whatever callbacks earlier
    tests left (gc.callbacks, weakref finalizers) and counts their frames."""
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        call(*args)
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def _plus(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """Plain torch's sum of contributions in order, each outside any backward: the first as is."""
    return term if total is None else total + term


def _add(store: DeferredGrads, w: torch.Tensor, operands: list, calls: dict, counted: int | None) -> int:
    """`store.add` of `w`'s contribution over `operands`: the storages it visited; its Python calls go to
    `calls[counted]` when `counted` is given."""
    before = store._ledger.visited
    if counted is not None:
        calls[counted] = python_calls(store.add, w, "w", MM_RECIPE, operands)
    else:
        store.add(w, "w", MM_RECIPE, operands)
    return store._ledger.visited - before


def test_an_add_visits_only_its_own_storages_as_contributions_grow():
    """Each add takes its own two storages in the store's ledger and in its tensor's (the crossover's
    measure), and makes as many Python calls at the 200th contribution as at the 10th: linear in the
    contributions per step, where a recount over all of a tensor's contributions at each add was
    quadratic. The counts equal a recount from scratch (an input buffer every contribution views
    counted once), and the step's gradient is plain torch's sum in order."""
    g = torch.Generator().manual_seed(0)
    w_fd = torch.zeros(WIDTH, WIDTH)
    x_nd = torch.randn(200, WIDTH, generator=g)  # one buffer: every contribution keeps a row of it
    store = DeferredGrads(meter=ExpertGradMeter())
    kept: list[torch.Tensor] = []
    visits, calls, expected = [], {}, None
    for i in range(200):
        dy_1f, x_1d = torch.randn(1, WIDTH, generator=g), x_nd[i : i + 1]
        visits.append(_add(store, w_fd, [dy_1f.t(), x_1d], calls, i if i in (9, 199) else None))
        kept += [dy_1f, x_1d]
        expected = _plus(expected, dy_1f.t().mm(x_1d))
        if i in (0, 9, 199):
            recount = sum(storages_of(kept).values())
            assert store.live_bytes == store.kept[id(w_fd)].operands.live_bytes == recount, i
    assert visits == [2] * 200 and store._ledger.visited == store.kept[id(w_fd)].operands.visited
    assert calls[9] == calls[199], calls
    assert store.crossed == {} and store.live_bytes == 2 * 200 * WIDTH * 4  # 200 rows of dy, x's buffer
    assert torch.equal(store.gradient(w_fd, consume=True), expected)
    assert store.live_bytes == 0 and store._ledger.visited == 4 * 200  # each storage taken and released

    # Negative control: the counter sees work per entry; a recount of the kept operands grows with them.
    assert python_calls(storages_of, kept[:20]) < python_calls(storages_of, kept)


def test_an_add_past_the_crossover_costs_the_same_at_every_contribution():
    """Past its crossover a tensor holds one gradient and each contribution outside any backward is
    added into it at once: each add takes its own operands, then releases them and the old sum's one
    storage and takes the new sum's (the same tensor, summed in place): the same work at every add, and
    the meter holds the one gradient throughout. The gradient is plain torch's sum in order."""
    g = torch.Generator().manual_seed(1)
    w_fd = torch.zeros(8, 8)  # 256 bytes: two contributions' operands (4 x 128 bytes) outgrow it
    store = DeferredGrads(meter=ExpertGradMeter())
    visits, calls, expected = [], {}, None
    for i in range(60):
        dy_4f, x_4d = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)  # 128 bytes each
        visits.append(_add(store, w_fd, [dy_4f.t(), x_4d], calls, i if i in (9, 59) else None))
        expected = _plus(expected, dy_4f.t().mm(x_4d))
    assert store.crossed == {"w": 2 * 256}  # crossed at the second add: 512 bytes of operands > 256
    # First add: take 2. Second: take 2, then the fold releases 4 and takes the sum. Then each: take
    # 2, release them and the sum, take the sum.
    assert visits == [2, 7] + [6] * 58 and calls[9] == calls[59], (visits, calls)
    assert store.live_bytes == 256 and store.meter is not None and store.meter.live == 256
    assert torch.equal(store.gradient(w_fd, consume=True), expected)
    assert store.live_bytes == 0 and store.meter.live == 0


def test_a_sum_over_many_backwards_holds_the_total_and_one_piece():
    """Four backwards' contributions are summed with at most two gradient-sized tensors alive (the
    running total and the piece being added), as the meter is told (`alive_for_a_moment`): the
    allocator's own events of the gradient's byte size peak at two gradients, not three (the last
    backward's sum made while the one before it was still referenced). The sum is plain torch's."""
    g = torch.Generator().manual_seed(2)
    w_fd = torch.zeros(64, 64)  # 16 KiB; the operands (4 x 64 rows) are of other sizes
    store, expected = DeferredGrads(meter=ExpertGradMeter()), None
    for _ in range(4):  # outside any backward: each contribution is its own backward's sum
        dy_4f, x_4d = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
        store.add(w_fd, "w", MM_RECIPE, [dy_4f.t(), x_4d])
        expected = _plus(expected, dy_4f.t().mm(x_4d))
    nbytes = w_fd.numel() * w_fd.element_size()
    grad, peak = measure_peak(lambda: store.gradient(w_fd, consume=True), sizes={nbytes})
    assert peak.sized_peak_bytes == 2 * nbytes, peak
    assert torch.equal(grad, expected) and store.crossed == {}


def _cases() -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(param, operands): views of the param, fresh tensors, two views of one buffer; real, fake, meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def operands(w: torch.Tensor) -> list[torch.Tensor]:
        buf = w.new_empty(6, 4)
        return [w, w.t(), w[1], buf[:2], buf[2:].t(), w.new_empty(3, 4)]

    real = torch.nn.Parameter(torch.randn(4, 4))
    meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with FakeTensorMode():
        fake = torch.nn.Parameter(torch.empty(4, 4))
        fake_case = (fake, operands(fake))
    return [(real, operands(real)), fake_case, (meta, operands(meta))]


def test_operand_storages_answers_as_same_storage_and_storages_of():
    """The hand-over's storage bookkeeping asks one question of fakeness per hand-over
    (`kept_storages.operand_storages`): its answers are `registry.same_storage` per operand and
    `storages_of` over the others, on real, fake (every fake storage's address is 0) and meta tensors."""
    from sonar_fx.optim.kept_storages import operand_storages
    from sonar_fx.runtime.registry import same_storage

    for param, ops in _cases():
        aliases, storages = operand_storages(param, ops)
        assert aliases == [same_storage(param, t) for t in ops], param.device
        assert storages == storages_of(t for t, alias in zip(ops, aliases, strict=True) if not alias)
    real, fake, _ = _cases()
    assert operand_storages(*real)[0] == [True, True, True, False, False, False]
    assert operand_storages(*fake)[0] == [True, True, True, False, False, False]
    assert len(operand_storages(*fake)[1]) == 2  # the buffer's two views, once; the fresh tensor
