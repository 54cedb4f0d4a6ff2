"""The RL example (`examples/rl_fsdp2.py`) on 2 gloo ranks: its GRPO loop with Sonar's deferred schedule
is bitwise the same loop on the plain engine (a twin in plain torch, and the example's own `--plain`
arm), with gradient sync at the last micro-batch, one clip over every parameter and a step skipped on a
non-finite norm; and it holds at most two expert gradients where the plain engine holds them all.

One spawn runs both engines (`distributed_cases_rl`); each rank reports its own comparison.
"""

from __future__ import annotations

import math

import pytest
from distributed_cases_rl import CFG, ENGINES

import distributed_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rl")
    distributed_worker.run("distributed_cases_rl:rl_example", str(out))
    return distributed_worker.results(str(out))


@pytest.mark.parametrize("parallel", ENGINES)
def test_grpo_loop_on_sonar_deferred_is_bitwise_the_plain_engine(ranks, parallel):
    runs = [r[parallel] for r in ranks]
    for run in runs:
        assert "refused" not in run, run.get("refused")
        assert run["differ"] == [], run["differ"][:3]  # every parameter's full tensor, torch.equal
        assert run["plain_differ"] == [], run["plain_differ"][:3]  # the example's --plain arm is the twin
        assert len(run["norms"]) == CFG.steps and all(n > CFG.max_grad_norm for n in run["twin_norms"])
        assert run["norms"] == run["twin_norms"] == run["plain_norms"]  # the norm over every parameter
        assert run["skipped"] == []
        assert run["control_differ"], "a twin syncing every micro-batch must train other bits"
    assert len({run["digest"] for run in runs}) == 1, "ranks disagree"


@pytest.mark.parametrize("parallel", ENGINES)
def test_grpo_loop_skips_a_step_with_a_non_finite_norm_on_every_rank(ranks, parallel):
    """Rank 0's loss is infinite in step 1: the norm is not finite on every rank (the engine's
    reduction spreads it), every rank skips the step, and the weights stay the twin's."""
    for run in [r[parallel] for r in ranks]:
        assert "refused" not in run, run.get("refused")
        assert run["inf_skipped"] == [1]
        assert not math.isfinite(float(run["inf_norms"][1])) and not math.isfinite(
            float(run["inf_twin_norms"][1])
        )
        assert run["inf_differ"] == [], run["inf_differ"][:3]


@pytest.mark.parametrize("parallel", ENGINES)
def test_grpo_loop_holds_at_most_two_expert_gradients_where_the_plain_engine_holds_all(ranks, parallel):
    """The plain engine accumulates every expert gradient, whole, across the unsynced micro-batches
    (DDP's `.grad`, FSDP2's unsharded gradients); Sonar computes them at step(), at most two alive at
    once. Its kept operands are what it holds instead: the net saving stays positive here."""
    for run in [r[parallel] for r in ranks]:
        assert "refused" not in run, run.get("refused")
        sonar, plain, biggest = run["sonar"], run["plain"], run["biggest_expert"]
        assert plain["expert_grad_peak"] == plain["expert_bytes"] == sonar["expert_bytes"]
        assert 0 < sonar["expert_grad_peak"] <= 2 * biggest
        assert plain["expert_grad_peak"] - sonar["expert_grad_peak"] >= plain["expert_bytes"] - 2 * biggest
        assert sonar["kept_operand_peak"] > 0
        assert sonar["expert_grad_peak"] + sonar["kept_operand_peak"] < plain["expert_grad_peak"]
