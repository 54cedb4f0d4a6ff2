"""Sonar on PyTorch's distributed engines: DDP, FSDP2 (`fully_shard`) and expert parallelism.

    model = sonar_fx.distributed.ddp(model, cfg)                  # DDP; compiler="aot_eager"/"inductor"
    model = sonar_fx.distributed.fsdp2(model, cfg)                # FSDP2, experts in their own group
    model = sonar_fx.distributed.expert_parallel(model, cfg)      # experts sharded E/world per rank
    model = sonar_fx.distributed.fsdp2_ep(model, cfg, mesh=mesh)  # 2-D: experts E/ep x FSDP2 over dp
    opt = model.sonar

Each call sets the engine up so that an expert gradient reaches its in-backward update already
reduced the way the engine would reduce it, and hands the optimizer the matching reduction
(`reductions`). The engines' dense parameters train as the engine trains them. A loop habit that
would train otherwise than the plain engine (a comm hook, `no_sync()`, `join()`, a model already
wrapped or sharded) is refused, naming the fix (`SonarDDP`, `reductions.refuse_unsynced`,
`model_checks`).
"""

from sonar_fx.distributed.ddp import SonarDDP, broadcast_experts_, ddp, expert_names
from sonar_fx.distributed.expert_parallel import (
    ExpertParallelExperts,
    combine,
    dispatch,
    expert_parallel,
    shard_experts_,
)
from sonar_fx.distributed.fsdp import fsdp2, fully_shard_experts, load_state, save_state, shared_groups
from sonar_fx.distributed.fsdp_ep import fsdp2_ep, shard_fsdp2_ep
from sonar_fx.distributed.reductions import AsyncMeanAllReduce, LocalExperts, MeanAllReduce, ShardedGrads

__all__ = [
    "AsyncMeanAllReduce",
    "ExpertParallelExperts",
    "LocalExperts",
    "MeanAllReduce",
    "ShardedGrads",
    "SonarDDP",
    "broadcast_experts_",
    "combine",
    "ddp",
    "dispatch",
    "expert_names",
    "expert_parallel",
    "fsdp2",
    "fsdp2_ep",
    "fully_shard_experts",
    "load_state",
    "save_state",
    "shard_experts_",
    "shard_fsdp2_ep",
    "shared_groups",
]
