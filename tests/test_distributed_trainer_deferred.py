"""Where users start the deferred schedule on an engine: `torchrun -m sonar_fx finetune --parallel
ddp|ep|fsdp2|fsdp2_ep --grad-accum N --clip-scope all`, and SonarTrainer under torchrun (the Trainer's own
DDP); what a rule refuses is refused by the one rule, `sonar_fx.api.distributed_gap`, before anything
trains; a mesh `--ep-size` cannot lay out is refused naming the flag, and experts the world cannot
split on `--parallel ep` naming `--parallel` (exit 2, not a traceback).

Each exactness claim is `torch.equal` on every parameter against the plain engine with the same recipe
(gradients synced at the last micro-batch only), with a negative control that must differ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers.training_args import ParallelMode

from sonar_fx import api
from sonar_fx.cli import main
from sonar_fx.errors import SonarUsageError

import distributed_worker

MAX_NORM = 0.05  # the command-line cases' clip (distributed_cases_cli_deferred.ACCUM)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    """Every rank's results of one spawn of 2 gloo ranks (`distributed_cases_cli_deferred.every_case`)."""
    out = str(tmp_path_factory.mktemp("trainer-deferred"))
    distributed_worker.run("distributed_cases_cli_deferred:every_case", out, timeout_s=1200)
    return distributed_worker.results(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "fsdp2_ep"])
def test_train_step_syncs_only_the_last_micro_batch(seen, engine):
    """`TrainingMethod.train_step` (what the command line runs) of the standard method on the engine
    equals the plain engine with gradient sync off on all micro-batches but the last (DDP's no_sync(),
    FSDP2's set_requires_gradient_sync(False)); syncing every one differs. FSDP2 x EP: its default
    1 x 2 mesh against `shard_fsdp2_ep` with torchtitan's clip written in the test."""
    for rank in seen:
        case = rank["train_step"][engine]
        assert case["last"] == []
        every = case["every"]  # other sums: nearly every tensor differs, every expert one
        assert len(every) > case["count"] // 2 and sum("experts" in n for n in every) == 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "ep", "fsdp2", "fsdp2_ep"])
def test_cli_grad_accum_and_clip_all_train_deferred_bitwise_the_standard_method(seen, engine):
    """--grad-accum 2 --clip-scope all trains sonar as sonar_deferred on the engine, with the clip active
    on every step, and ends bitwise equal to --method standard with the same flags, on every rank."""
    for rank, result in enumerate(seen):
        run = result["cli"][engine]
        assert run["codes"] == [0, 0], (rank, run)
        assert run["differ"] == [], rank
    writer = seen[0]["cli"][engine]
    assert writer["method"] == "sonar_deferred"
    assert len(writer["norms"]) == 3 and all(norm > MAX_NORM for norm in writer["norms"])
    assert all(peak > 0 for peak in writer["kept_operand_peaks"])  # operands kept: the deferred schedule


@pytest.mark.multiprocess
def test_fsdp2_ep_with_experts_the_mesh_cannot_split_is_refused_naming_ep_size(seen):
    """3 experts per layer on the default 1 x 2 mesh: exit 2 on every rank before any step, naming
    --ep-size and the layer; no checkpoint."""
    for rank in seen:
        run = rank["uneven_experts"]["fsdp2_ep"]
        assert run["code"] == 2 and run["checkpoints"] == []
        assert "error: --ep-size:" in run["err"] and "holds 3 experts, which ep_size=2" in run["err"]


@pytest.mark.multiprocess
def test_ep_with_experts_the_world_cannot_split_is_refused_naming_the_layer_and_the_fix(seen):
    """3 experts per layer over 2 ranks on --parallel ep: exit 2 on every rank before any step (no
    traceback), naming the layer, its experts, the world and what to change; no checkpoint."""
    for rank in seen:
        run = rank["uneven_experts"]["ep"]
        assert run["code"] == 2 and run["checkpoints"] == [] and "Traceback" not in run["err"]
        assert "error: --parallel: model.layers.0.mlp.experts holds 3 experts" in run["err"]
        assert "cannot split evenly over 2 ranks" in run["err"]
        assert "run on a number of ranks that divides 3" in run["err"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("clip", ["1.0", "0.5"])
def test_sonar_trainer_under_the_trainers_ddp_is_bitwise_the_plain_trainer(seen, clip):
    """gradient_accumulation_steps=4 and the Trainer's clip over every parameter (its default 1.0, and
    0.5, active on every step): Sonar's experts kept out of accelerate's DDP and averaged as DDP would,
    every parameter equal to the plain Trainer's on every rank, and the same logged norms."""
    for rank in seen:
        run = rank["hf"][clip]
        assert run["wrapped"] == run["sonar_wrapped"] == "DistributedDataParallel"
        assert run["schedule"] == "deferred" and run["experts_in_ddp"] == 0
        assert run["differ"] == []
        assert run["norms"] == run["plain_norms"] and len(run["norms"]) == 3
    if clip == "0.5":
        assert all(norm > 0.5 for norm in seen[0]["hf"][clip]["norms"])
        assert seen[0]["hf"]["clips_differ"]  # teeth: the active clip changed the weights


@pytest.mark.multiprocess
def test_sonar_trainer_in_backward_under_the_trainers_ddp_is_bitwise_the_plain_trainer(seen):
    """No clip and no accumulation (the in-backward schedule): each expert averaged in its hook as DDP
    averages, the weights and the logged norm over every gradient equal to the plain Trainer's."""
    for rank in seen:
        run = rank["hf"]["in_backward"]
        assert run["schedule"] == "in_backward" and run["differ"] == []
        assert run["norms"] == run["plain_norms"] and len(run["norms"]) == 3


@pytest.mark.multiprocess
def test_sonar_trainer_refuses_a_model_prepared_for_one_process(seen):
    for rank in seen:
        message = rank["hf"]["prepared_for_one_process"]
        assert message is not None and "prepared for one process" in message
        assert "Pass the model unprepared" in message


# ------------------------------------------------------------------- refused, by the one rule


@pytest.fixture
def as_rank_0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.usefixtures("as_rank_0")
@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (["--grad-accum", "2", "--clip-scope", "all"], "--grad-accum"),
        (["--clip-scope", "all"], "--clip-scope"),
        (["--method", "sonar_deferred"], "--method"),
        (["--method", "sonar_deferred", "--lr", "1e-3"], "--method"),  # checked with the flags, earlier
    ],
)
def test_deferred_where_the_one_rule_refuses_it_is_refused_naming_the_flag(
    tmp_path, capsys, monkeypatch, flags, blamed
):
    """The command line asks `distributed_gap` (every engine runs the deferred schedule today, so the
    rule is narrowed here to ddp and ep): before any model is built or file written, exit 2 naming the
    flag that chose the deferred schedule, the rule's reason and what to use instead."""
    monkeypatch.setattr(api, "DEFERRED_ENGINES", ("ddp", "ep"))
    code = main(["finetune", "--model", "tiny-reference", "--parallel", "fsdp2", "--train-size", "8",
                 "--held-out", "0", "--out", str(tmp_path / "run"), *flags])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert f"error: {blamed}:" in err
    assert "schedule='deferred' is not supported on the fsdp2 engine yet" in err  # the one rule's words
    assert "--parallel ddp or ep" in err and "--method standard" in err
    assert not any((tmp_path / "run").glob("*.pt"))


@pytest.mark.usefixtures("as_rank_0")
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--parallel", "fsdp2_ep", "--ep-size", "3"], "ep_size=3 does not divide the world of 2 ranks"),
        (["--parallel", "ep", "--ep-size", "2"], "--parallel ep shards experts over every rank"),
        (["--ep-size", "2"], "use --parallel fsdp2_ep or drop --ep-size"),
    ],
)
def test_an_ep_size_the_run_cannot_lay_out_is_refused_naming_the_flag(tmp_path, capsys, flags, words):
    """Checked against torchrun's WORLD_SIZE before any process group, model or file exists."""
    code = main(["finetune", "--model", "tiny-olmoe", "--train-size", "8", "--held-out", "0",
                 "--out", str(tmp_path / "run"), *flags])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "error: --ep-size" in err and words in err
    assert not (tmp_path / "run").exists()


def _args(**fields):
    base = dict(fsdp="", deepspeed=None, parallel_mode=ParallelMode.NOT_PARALLEL, n_gpu=0, world_size=1)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(fsdp="full_shard"), "Trainer's FSDP"),
        (dict(deepspeed="ds.json"), "Trainer's DeepSpeed"),
        (dict(parallel_mode=ParallelMode.NOT_DISTRIBUTED, n_gpu=2), "nn.DataParallel"),
    ],
)
def test_the_trainers_other_engines_are_refused_naming_the_fix(fields, match):
    from sonar_fx.integrations.hf_ddp import trainer_engine

    with pytest.raises(SonarUsageError, match=match):
        trainer_engine(_args(**fields))
    assert trainer_engine(_args()) == "single"
    assert trainer_engine(_args(parallel_mode=ParallelMode.DISTRIBUTED, world_size=2)) == "ddp"


@pytest.mark.multiprocess
def test_deferred_around_the_engines_setup_is_refused_before_any_weight_moves(seen):
    """prepare(schedule="deferred") of a model fully_shard already wraps: refused naming the FSDP2
    builder, or, for a config the one rule refuses on FSDP2 (Muon), that rule's reason; a one-process
    model wrapped in DDP by hand: refused at step(), nothing moved, naming the engine builders."""
    for rank in seen:
        routes = rank["routes"]
        assert "sonar_fx.distributed.fsdp2(model, cfg) on the unwrapped model" in routes["fsdp2_prepare"]
        assert (
            "Nor does Sonar's own setup of it run this: MuonConfig with FSDP2" in routes["fsdp2_prepare_muon"]
        )
        assert "prepared for one" in routes["ddp_after_prepare"]
        assert "sonar_fx.distributed (ddp, expert_parallel, fsdp2" in routes["ddp_after_prepare"]
        assert routes["moved"] == []
