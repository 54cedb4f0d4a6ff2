"""`sonar-fx demo`: its arms are interleaved, its twins compared bitwise (with a negative control), and
its settings checked. Small shapes and eager arms only; the CLI run of the demo is in test_cli.py."""

import pytest
import torch

from sonar_fx.demo import WARMUP_STEPS, DemoConfig, DemoConfigError, _report, _train, _twin_verdict

SMALL = dict(hidden_size=32, intermediate_size=16, num_experts=16, num_hidden_layers=2)
"""16 experts: each expert gradient outgrows two micro-batches' kept operands (no crossover: the deferred arm
saves, as on the demo's own shape)."""


@pytest.fixture(scope="module")
def runs():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = DemoConfig(
        steps=8, warmup=1, seq=32, held_out=1, progress=False, model_overrides=SMALL,
        arms=("standard", "no_expert_clip", "sonar_eager", "standard_accum", "sonar_deferred"),
    )  # fmt: skip
    yield cfg, _train(cfg, started=0.0)
    torch.set_num_threads(before)


def test_every_arm_is_timed_in_the_same_rounds(runs):
    cfg, by_key = runs
    rounds = cfg.steps - WARMUP_STEPS - 1  # warm-up, one memory step, then the timed rounds
    for run in by_key.values():
        assert run.result.ok, run.result.error
        assert len(run.result.step_s) == rounds and len(run.losses) == cfg.steps
        assert run.result.peak_bytes > 0 and run.state_bytes > 0
        assert sorted(run.evals) == [0, cfg.steps // 2, cfg.steps]  # before, halfway, after


def test_twins_are_bitwise_equal_and_a_non_twin_is_not(runs):
    _, by_key = runs
    twin = _twin_verdict(by_key["sonar_eager"], by_key["no_expert_clip"])
    assert twin["equal"] is True and "BITWISE EQUAL" in twin["text"]
    # Negative control: standard clips the expert gradients too, so its experts must differ.
    other = _twin_verdict(by_key["sonar_eager"], by_key["standard"])
    assert other["equal"] is False and "NOT bitwise equal" in other["text"]


def test_the_ordinary_recipe_deferred_is_bitwise_standard_with_the_same_recipe(runs):
    """Clip over every parameter, each batch as 2 micro-batches: the deferred arm equals standard taking the
    same micro-batches, not standard taking the whole batch at once (the negative control), and the table
    compares it with that baseline."""
    cfg, by_key = runs
    deferred = by_key["sonar_deferred"]
    assert deferred.method.optimizer.report()["deferred"]["kept_whole"] == []  # operands kept, not gradients
    twin = _twin_verdict(deferred, by_key["standard_accum"])
    assert twin["equal"] is True and "BITWISE EQUAL" in twin["text"]
    assert _twin_verdict(deferred, by_key["standard"])["equal"] is False
    rows = {r["arm"]: r for r in _report(cfg, by_key, [twin], wall_s=0.0)["rows"]}
    assert rows["sonar_deferred"]["baseline"] == "standard_accum"
    assert rows["standard_accum"]["baseline"] == "standard"
    base = by_key["standard_accum"]
    peak = deferred.state_bytes + deferred.result.peak_bytes
    assert rows["sonar_deferred"]["peak_change"] == peak / (base.state_bytes + base.result.peak_bytes) - 1


def test_settings_out_of_range_name_the_flag():
    with pytest.raises(DemoConfigError, match="--steps 0"):
        DemoConfig(steps=0)
    with pytest.raises(DemoConfigError, match="unknown arms"):
        DemoConfig(arms=("standard", "sonar_typo"))
    with pytest.raises(DemoConfigError, match="batch_size=3: an arm takes each batch as 2 micro-batches"):
        DemoConfig(batch_size=3)


def test_the_command_line_exits_2_naming_steps(tmp_path, capsys):
    from sonar_fx.cli import main

    assert main(["demo", "--steps", "2", "--out", str(tmp_path)]) == 2
    assert "--steps 2: the demo needs at least 4 steps" in capsys.readouterr().err
