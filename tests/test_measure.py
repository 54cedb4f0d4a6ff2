"""The measurement core (`sonar_fx.measure`): statistics, interleaved rounds, failures, memory step.

Fake arms record what they were asked to do, so the order of the rounds is checked exactly; no timing
is asserted (timings belong in benchmark output, not in a pass/fail test).
"""

import pytest
import torch
from torch.utils.benchmark import Measurement, TaskSpec

from sonar_fx.measure import (
    ArmResult,
    Spread,
    fmt_ratio,
    measure_arm,
    paired_ratio,
    ratio,
    run_rounds,
    side_by_side,
)


def test_spread_is_measurements_statistics():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    s = Spread.of(values)
    m = Measurement(number_per_run=1, raw_times=values, task_spec=TaskSpec("", ""))
    assert (s.median, s.q75 - s.q25) == (m.median, m.iqr)
    assert (s.median, s.q25, s.q75, s.min, s.max, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert s.fmt(0) == "3 [2-4]"
    assert s.noisy  # IQR 67% of the median
    assert not Spread.of([1.0, 1.01, 1.0, 1.01]).noisy
    with pytest.raises(ValueError):
        Spread.of([])


def test_paired_ratio_pairs_rounds_not_medians():
    # A load burst in round 2 slows both arms alike: pairing cancels it, medians alone would not.
    a, b = [1.0, 10.0, 1.0, 1.0], [2.0, 20.0, 2.0, 2.0]
    r = ratio(ArmResult(label="a", step_s=a), ArmResult(label="b", step_s=b))
    assert r is not None and (r.median, r.q25, r.q75) == (0.5, 0.5, 0.5)
    assert fmt_ratio(r) == "0.50x [0.50-0.50]" and fmt_ratio(None) == "-"
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        paired_ratio([], [])


class FakeArm:
    """A step function that logs (arm, batch) to a shared list and can fail on a given call."""

    def __init__(self, name: str, log: list, fail_on_call: int | None = None) -> None:
        self.name, self.log, self.fail_on_call, self.calls = name, log, fail_on_call, 0

    def __call__(self, batch: int) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError(f"{self.name} broke")
        self.log.append((self.name, batch))


def test_rounds_interleave_every_arm_once_per_round_in_rotating_order():
    log: list = []
    names = ["a", "b", "c"]
    arms = [(ArmResult(label=n), FakeArm(n, log)) for n in names]
    rounds_seen = []
    run_rounds(arms, [10, 11, 12, 13], after_round=rounds_seen.append)
    assert log == [
        ("a", 10), ("b", 10), ("c", 10),
        ("b", 11), ("c", 11), ("a", 11),
        ("c", 12), ("a", 12), ("b", 12),
        ("a", 13), ("b", 13), ("c", 13),
    ]  # fmt: skip
    assert rounds_seen == [0, 1, 2, 3]
    assert all(len(result.step_s) == 4 and result.ok for result, _ in arms)


def test_a_failing_arm_drops_out_and_the_others_go_on():
    log: list = []
    a, b, c = (ArmResult(label=n) for n in "abc")
    run_rounds(
        [(a, FakeArm("a", log)), (b, FakeArm("b", log, fail_on_call=2)), (c, FakeArm("c", log))], [0, 1, 2]
    )
    assert b.error == "RuntimeError: b broke" and len(b.step_s) == 1 and not b.ok
    assert [name for name, batch in log if batch == 2] == ["c", "a"]  # b no longer steps
    assert len(a.step_s) == len(c.step_s) == 3
    assert ratio(a, b) is None and ratio(a, c) is not None


def test_measure_arm_warms_up_then_measures_one_steps_memory():
    log: list = []
    nbytes = 1 << 20

    def step(batch: int) -> None:
        log.append(batch)
        if batch == 99:  # the memory step allocates a known amount
            x = torch.empty(nbytes, dtype=torch.uint8)
            del x

    result = measure_arm(ArmResult(label="x"), step, [1, 2, 3], 99)
    assert log == [1, 2, 3, 99]
    assert 0 < result.first_step_s <= result.warmup_s
    assert nbytes <= result.peak_bytes < nbytes + 4096
    assert result.error is None and result.step_s == []  # no timed step yet
    no_memory = measure_arm(ArmResult(label="y"), step, [1], None)
    assert no_memory.peak_bytes == 0 and log[-1] == 1
    with pytest.raises(ValueError, match="warm-up"):
        measure_arm(ArmResult(label="z"), step, [], None)


def test_measure_arm_records_an_error_instead_of_raising():
    broken = measure_arm(ArmResult(label="x"), FakeArm("x", [], fail_on_call=2), [0, 1], 2)
    assert broken.error == "RuntimeError: x broke" and broken.peak_bytes == 0
    run_rounds([(broken, FakeArm("x", []))], [0])
    assert broken.step_s == []  # a failed arm is never timed


def test_side_by_side_is_scoped():
    before = torch._dynamo.config.recompile_limit
    with side_by_side():
        assert torch._dynamo.config.recompile_limit >= 64
        assert torch._dynamo.config.automatic_dynamic_shapes is False
    assert torch._dynamo.config.recompile_limit == before
