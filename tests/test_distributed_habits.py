"""Training-loop habits on the engines, default schedule (updates inside backward), 2 gloo processes
(see `distributed_cases_habits`; the same habits on one process: `test_loop_contract`).

Each habit trains exactly as the same engine in plain torch, or is refused with a SonarUsageError
that names the habit and the fix: before any tensor moves where the habit can be seen before an
update (no_sync, a comm hook, join, a builder's input), else at step(), the first moment it can be
seen, before any dense tensor moves, with `abandon_step()` letting the loop go on. One spawn runs
every multi-process case; the device rule of the builders is checked in this process.
"""

from __future__ import annotations

import pytest
import torch

from sonar_fx.distributed.model_checks import device_problem

import distributed_worker

ENGINES = ("ddp", "fsdp2", "ep", "fsdp2_ep")
EXPERT_TENSORS = 4  # tiny-reference: 2 layers x (gate_up, down)


@pytest.fixture(scope="module")
def habits(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("habits")
    distributed_worker.run("distributed_cases_habits:habits", str(out), timeout_s=900)
    return distributed_worker.results(str(out))


def runs(ranks: list[dict], label: str) -> list:
    return [r[label] for r in ranks]


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", [*ENGINES, "ddp/aot_eager"])
def test_own_clip_while_sonar_clips_is_refused_at_step_on_every_engine(habits, label):
    for run in runs(habits, f"own_clip/{label}"):
        assert "clip_grad_norm_" in run["message"] and "max_grad_norm=None" in run["message"], run
        assert "abandon_step" in run["message"]
        assert run["moved"] == []  # the refused step moved no tensor (the experts moved in backward)
        assert len(run["abandoned"]) == EXPERT_TENSORS


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "ep"])
def test_own_clip_with_sonar_clip_off_equals_the_engine_standard(habits, engine):
    """The fix the refusal names is exact: the user's clip over model.parameters() sees the dense
    gradients only, which is the standard recipe's dense-only clip."""
    assert runs(habits, f"own_clip_sonar_off/{engine}") == [[], []]


@pytest.mark.multiprocess
def test_comm_hook_on_ddp_is_refused_at_registration(habits):
    for run in runs(habits, "comm_hook/ddp"):
        for message in run.values():
            assert "register_comm_hook" in message and "Train without the hook" in message, message


@pytest.mark.multiprocess
def test_comm_hook_on_expert_parallel_equals_the_plain_engine_with_the_hook(habits):
    for run in runs(habits, "comm_hook/ep"):
        assert run["differ"] == [], run["differ"][:3]
        assert run["without_hook"], "fp16 compression must change the dense gradients"


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", ["no_sync/ddp", "no_sync/ep", "flag/ddp", "no_sync/ddp/aot_eager"])
def test_backward_under_no_sync_is_refused_before_any_tensor_moves(habits, label):
    """A whole step under no_sync() (local steps) and the first micro-batch of an accumulation look
    the same at the first backward: refused there, nothing moved; after abandon_step() the loop trains
    exactly as the engine's standard on the same batches."""
    for run in runs(habits, label):
        assert "no_sync()" in run["message"] and "require_backward_grad_sync" in run["message"], run
        assert "abandon_step" in run["message"] and "accumulation='per_microbatch'" in run["message"]
        assert run["moved"] == [], run["moved"]
        assert run["differ"] == [], run["differ"][:3]


@pytest.mark.multiprocess
def test_fsdp2_accumulation_by_its_sync_flag_equals_plain_fsdp2(habits):
    """FSDP2's set_requires_gradient_sync(False) on the first micro-batch is not refused: FSDP2 hands
    Sonar's hooks nothing until the synced backward, so each expert is updated once per step."""
    for run in runs(habits, "accumulation/fsdp2"):
        assert run["differ"] == [], run["differ"][:3]
        assert run["by_hook"] == 2 * EXPERT_TENSORS  # once per step, not per micro-batch


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_lr_set_between_backward_and_step_is_refused_before_the_dense_step(habits, engine):
    for run in runs(habits, f"lr/{engine}"):
        assert "lr: 0.01 -> 0.005" in run["message"] and "before the forward" in run["message"], run
        assert run["moved"] == [] and len(run["abandoned"]) == EXPERT_TENSORS


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "ep"])
def test_join_with_uneven_inputs_is_refused_before_any_rank_joins(habits, engine):
    for run in runs(habits, f"join/{engine}"):
        for message in run.values():
            assert "join()" in message and "same number of batches" in message, message


BUILDER_FIXES = {
    "fsdp2/sharded_below_root": "fully_shard(model) on the root",
    "ddp/sharded": "Pass the model before fully_shard",
    "expert_parallel/sharded": "Pass the model before fully_shard",
    "fsdp2/ddp_wrapped": "Pass the model before DDP",
    "fsdp2_ep/ddp_wrapped": "Pass the model before DDP",
    "expert_parallel/ddp_wrapped": "Pass the model before DDP",
    "ddp/expert_parallel": "shard=False",
    "expert_parallel/expert_parallel": "shard=False",
    "fsdp2/meta": "to_empty",
    "ddp/meta": "to_empty",
}


@pytest.mark.multiprocess
def test_engine_builders_refuse_a_model_they_cannot_take(habits):
    for ranks in habits:
        assert ranks["builders"].keys() == BUILDER_FIXES.keys()
        for label, fix in BUILDER_FIXES.items():
            message = ranks["builders"][label]
            assert message is not None and fix in message, (label, message)
            assert message.startswith(f"sonar_fx.distributed.{label.split('/')[0]}:"), message


CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("devices", "backend", "says"),
    [
        ({CPU}, "nccl", "NCCL reduces CUDA tensors of this rank's device (cuda:0)"),
        ({CUDA1}, "nccl", "the model is on cuda:1"),
        ({CPU, CUDA0}, "gloo", "several devices (cpu, cuda:0)"),
        ({torch.device("meta")}, "gloo", "to_empty"),
    ],
)
def test_device_rule_names_the_fix(devices, backend, says):
    assert says in (device_problem(devices, backend, cuda_index=0) or "")


@pytest.mark.parametrize(("devices", "backend"), [({CPU}, "gloo"), ({CUDA0}, "nccl"), ({CUDA0}, "gloo")])
def test_device_rule_takes_what_the_backend_reduces(devices, backend):
    assert device_problem(devices, backend, cuda_index=0) is None
