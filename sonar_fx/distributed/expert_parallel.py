"""Expert parallelism: each rank holds E/world experts of every MoE layer; tokens travel to them.

Legend: T tokens on this rank, k experts per token, S = T*k token-slots, E experts in all, El = E/world
experts on this rank, R token-slots this rank received, d model width, n expert width.

`ExpertParallelExperts` replaces an experts module (the reference model's, or any transformers 5.x
one with `gate_up_proj` (E, 2n, d) / `down_proj` (E, d, n)) with this rank's slice of it and the same
forward signature `(hidden (T, d), top_k_index (T, k), top_k_weights (T, k))`: token-slots are sorted
by expert, sent to the rank that owns it with an autograd all-to-all, computed there with the grouped
GEMM, and sent back. Its backward runs the all-to-alls in reverse, so an expert's weight gradient on
its owning rank already sums every rank's tokens: no collective is needed before Sonar's update, only
the 1/world scale that data-parallel averaging of the per-rank losses implies (`LocalExperts`).
Dense parameters are replicated and go through DDP. `expert_parallel` sets all of that up; for
experts sharded by other code (torchtitan's `w1/w2/w3`), pass `shard=False` and `experts=` names.
Never: change the routing; it is the model's router's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from sonar_fx import api
from sonar_fx.config import OptimizerConfig
from sonar_fx.distributed.ddp import SonarDDP, expert_names
from sonar_fx.distributed.deferred import watch_forward_syncs
from sonar_fx.distributed.model_checks import refuse_unfit_model
from sonar_fx.distributed.reductions import LocalExperts
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertLayer, discover_experts
from sonar_fx.experts.grouped import grouped_mm
from sonar_fx.experts.kernels.base import HF_LAYOUT
from sonar_fx.optim.defer_eager import outside_capture
from sonar_fx.optim.optimizer import NonFinite
from sonar_fx.optim.reduction import require_process_group


@dataclass(frozen=True)
class Routing:
    """Where each token-slot went, to bring the results back (see `dispatch` and `combine`)."""

    perm_S: Tensor
    """Slots sorted by global expert (stable)."""
    send: list[int]
    """Slots sent to each rank."""
    recv: list[int]
    """Slots received from each rank."""
    perm_R: Tensor
    """Received slots sorted by local expert (stable)."""
    offs_El: Tensor
    """int32 cumulative ends of each local expert's slots, as the grouped GEMM takes them."""
    group: dist.ProcessGroup


@torch.compiler.disable  # data-dependent splits and collectives: runs between a block's graphs
@outside_capture  # routing reads no expert weight: the deferred schedule's capture has nothing to keep
def dispatch(
    hidden_Td: Tensor, index_Tk: Tensor, num_experts: int, group: dist.ProcessGroup
) -> tuple[Tensor, Routing]:
    """Send each token-slot to the rank owning its expert; returns this rank's slots (R, d), sorted
    by local expert, and the routing to undo it."""
    world = dist.get_world_size(group)
    local = num_experts // world
    k = index_Tk.shape[1]
    expert_S, perm_S = torch.sort(index_Tk.reshape(-1), stable=True)
    x_Sd = hidden_Td.repeat_interleave(k, dim=0)[perm_S]
    counts_E = torch.bincount(expert_S, minlength=num_experts)
    counts_in = torch.empty_like(counts_E)
    dist.all_to_all_single(counts_in, counts_E, group=group)  # row s: rank s's slots per local expert
    counts_WEl = counts_in.view(world, local)
    send = counts_E.view(world, local).sum(1).tolist()
    recv = counts_WEl.sum(1).tolist()
    x_Rd = _all_to_all(x_Sd, recv, send, group)
    local_R = torch.arange(local, device=x_Rd.device).repeat(world).repeat_interleave(counts_in)
    _, perm_R = torch.sort(local_R, stable=True)
    offs_El = torch.cumsum(counts_WEl.sum(0), 0).to(torch.int32)
    return x_Rd[perm_R], Routing(perm_S, send, recv, perm_R, offs_El, group)


@torch.compiler.disable
@outside_capture
def combine(y_Rd: Tensor, routing: Routing, weights_Tk: Tensor) -> Tensor:
    """Bring results (R, d) back to the slots' ranks and sum each token's k results by weight."""
    t, k = weights_Tk.shape
    y_recv = torch.zeros_like(y_Rd).index_copy(0, routing.perm_R, y_Rd)
    y_Sd = _all_to_all(y_recv, routing.send, routing.recv, routing.group)
    y_Skd = torch.zeros_like(y_Sd).index_copy(0, routing.perm_S, y_Sd)
    return (y_Skd.view(t, k, -1) * weights_Tk.unsqueeze(-1)).sum(dim=1)


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """The autograd all-to-all torch keeps (`torch.distributed.nn.functional.all_to_all_single` is
    deprecated for it: a FutureWarning at every call): its backward is the reverse exchange, a copy as
    the forward is, so a gradient's bits are those the deprecated one gave. In eager its result waits on
    the collective at its first use."""
    return funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


class ExpertParallelExperts(nn.Module):
    """This rank's El experts of one MoE layer, fed by all-to-all (see the module docstring)."""

    holds_expert_shard = True
    """This rank's share of the experts: a builder must not shard or reduce it again (`model_checks`),
    and discovery takes its El experts even when El is 1 (as many experts as ranks: (1, out, in))."""

    traced_when_compiled = False
    """True (set by `expert_parallel` on the modules it lays out): under a Sonar-compiled block its GEMMs
    (`local_experts`) trace into the graph (the token exchange around them is its only graph break),
    where the deferred schedule's graph pass keeps their operands, so the eager capture stays out of
    that forward (`sonar_fx.optim.defer_eager`: its mode would run them eagerly, op by op). Its eager
    forward is captured as any other. Left False under FSDP2 x EP (the graph sees FSDP2's unsharded
    weights there) and for subclasses sharded by other code, whose GEMMs may be laid out otherwise."""

    def __init__(
        self,
        gate_up_proj: Tensor,
        down_proj: Tensor,
        *,
        num_experts: int,
        group: dist.ProcessGroup,
        glu: Callable[[Tensor], Tensor] = HF_LAYOUT.glu,
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj)  # (El, 2n, d)
        self.down_proj = nn.Parameter(down_proj)  # (El, d, n)
        self.global_experts = num_experts
        self.num_experts = gate_up_proj.shape[0]  # what this module holds (discovery matches it to E)
        self.group = group
        self.glu = glu

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        x_Rd, routing = dispatch(
            hidden_states.to(self.weight_dtype), top_k_index, self.global_experts, self.group
        )
        y_Rd = self.local_experts(x_Rd, routing.offs_El)
        return combine(y_Rd, routing, top_k_weights.to(y_Rd.dtype)).to(hidden_states.dtype)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype tokens are computed in (the experts' own)."""
        return self.gate_up_proj.dtype

    def local_experts(self, x_Rd: Tensor, offs_El: Tensor) -> Tensor:
        """(R, d) slots sorted by local expert -> (R, d) results; subclasses compute other layouts."""
        h_R2n = grouped_mm(x_Rd, self.gate_up_proj, offs_El)
        return grouped_mm(self.glu(h_R2n), self.down_proj, offs_El)


@torch.no_grad()
def shard_experts_(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    experts: Iterable[nn.Parameter | str] | None = None,
) -> list[str]:
    """Replace every experts module of `model` by an `ExpertParallelExperts` holding this rank's
    E/world experts (a copy of its slice; every rank must hold the same full weights before, e.g.
    the same seed); returns the replaced modules' names. `experts` (parameters or names, as
    `sonar_fx.compile` takes them): only the modules holding those tensors; the others stay whole.
    Every module is checked before any is replaced: a refusal leaves the model as it was."""
    group = require_process_group("sonar_fx.distributed.shard_experts_", group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = _layers_to_shard(model, experts)
    for layer in layers:
        if (found := {t.role for t in layer.tensors}) != {"up", "down"}:
            raise SonarUsageError(f"{layer.name}: shard_experts_ needs gate_up/down experts, got {found}.")
    problem = _uneven_split_of(layers, world)
    if problem is not None:
        raise SonarUsageError(f"sonar_fx.distributed.shard_experts_: {problem}. Nothing was sharded.")
    for layer in layers:
        roles = {t.role: t.param for t in layer.tensors}
        num_experts = layer.num_experts
        local = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
        old = model.get_submodule(layer.name)
        new = ExpertParallelExperts(
            roles["up"][local].clone(), roles["down"][local].clone(), num_experts=num_experts, group=group,
            glu=_glu_of(old),
        )  # fmt: skip
        parent_name, _, child = layer.name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return [layer.name for layer in layers]


def uneven_split(
    model: nn.Module, ranks: int, experts: Iterable[nn.Parameter | str] | None = None
) -> str | None:
    """Why expert parallelism over `ranks` ranks cannot lay `model` out (the first experts module whose
    expert count `ranks` does not divide, with the fix), or None when every module splits evenly.
    `experts`: as `shard_experts_` takes it. It only reads the model: engines ask before they build."""
    return _uneven_split_of(_layers_to_shard(model, experts), ranks)


def _uneven_split_of(layers: list[ExpertLayer], ranks: int) -> str | None:
    for layer in layers:
        if layer.num_experts % ranks:
            return (
                f"{layer.name} holds {layer.num_experts} experts, which expert parallelism cannot split "
                f"evenly over {ranks} ranks (each rank holds E/{ranks}); run on a number of ranks that "
                f"divides {layer.num_experts}, keep every expert on every rank (DDP or FSDP2), or split the "
                f"experts over fewer ranks with FSDP2 x EP (an ep_size that divides {layer.num_experts} "
                f"and {ranks})"
            )
    return None


def _glu_of(experts: nn.Module) -> Callable[[Tensor], Tensor]:
    """The module's own activation when it has one (transformers' `act_fn`), gate first."""
    act = getattr(experts, "act_fn", None)
    if act is None:
        return HF_LAYOUT.glu

    def glu(h_R2n: Tensor) -> Tensor:
        gate, up = h_R2n.chunk(2, dim=-1)
        return act(gate) * up

    return glu


def _layers_to_shard(model: nn.Module, experts: Iterable[nn.Parameter | str] | None) -> list[ExpertLayer]:
    """The experts modules holding `experts` (all when None); a module is sharded whole, so each must
    be named whole, or Sonar would update one of its tensors and leave the other to the dense step."""
    layers = discover_experts(model)
    if experts is None:
        return layers
    chosen = {t.name for layer in discover_experts(model, experts) for t in layer.tensors}
    picked = [layer for layer in layers if any(t.name in chosen for t in layer.tensors)]
    for layer in picked:
        if missing := [t.name for t in layer.tensors if t.name not in chosen]:
            raise SonarUsageError(
                f"experts= names part of {layer.name} but not {', '.join(missing)}: an experts module is "
                "sharded whole; name all of its expert tensors or none."
            )
    if outside := chosen - {t.name for layer in picked for t in layer.tensors}:
        raise SonarUsageError(
            f"experts= names {', '.join(sorted(outside))}, outside every experts module expert parallelism "
            "can shard (gate_up/down experts): leave it out of experts=."
        )
    return picked


def sharded_expert_names(replaced: list[str]) -> list[str]:
    """The expert tensors of the `ExpertParallelExperts` modules `shard_experts_` put at `replaced`."""
    return [f"{name}.{tensor}" for name in replaced for tensor in ("gate_up_proj", "down_proj")]


def expert_parallel(
    model: nn.Module,
    opt_cfg: OptimizerConfig,
    *,
    compiler: api.Compiler = "eager",
    process_group: dist.ProcessGroup | None = None,
    shard: bool = True,
    experts: Iterable[nn.Parameter | str] | None = None,
    nonfinite: NonFinite = "raise",
    fallback: bool = True,
    ddp_kwargs: dict[str, Any] | None = None,
    **torch_compile_kwargs: Any,
) -> DistributedDataParallel:
    """Shard the experts over ranks (`shard_experts_`, unless `shard=False`: the experts are sharded
    already and named by `experts=`), set Sonar up with the 1/world scale, and wrap the dense
    parameters in DDP (experts ignored). The optimizer is `wrapped.sonar`.

    `compiler` "aot_eager" / "inductor" compiles each block: the all-to-alls run between its graphs
    (`dispatch` and `combine` are never traced: their splits are data), and the graph of the local
    experts updates each one in its backward, where its gradient is already final on this rank."""
    group = require_process_group("sonar_fx.distributed.expert_parallel", process_group)
    refuse_unfit_model(model, "sonar_fx.distributed.expert_parallel", group, expert_parallel=not shard)
    if shard:
        replaced = shard_experts_(model, group, experts)
        experts = None if experts is None else sharded_expert_names(replaced)  # the new modules' tensors
        for name in replaced:
            setattr(model.get_submodule(name), "traced_when_compiled", True)  # noqa: B010  (nn.Module typing)
    reduction = LocalExperts(group)
    model = api.compile(
        model, opt_cfg, compiler=compiler, experts=experts, nonfinite=nonfinite, fallback=fallback,
        regional=compiler != "eager", distributed=reduction, **torch_compile_kwargs,
    )  # fmt: skip
    optimizer = api.sonar_of(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names(optimizer))
    wrapped = SonarDDP(model, process_group=group, **(ddp_kwargs or {}))
    wrapped.experts_reduced_by_ddp_twin = (
        False  # a comm hook reaches the dense gradients alone, as in EP's twin
    )
    wrapped.__dict__["sonar"] = optimizer
    reduction.wrapper = wrapped  # expert_clip="global" replays its forward without DDP's reducer
    if optimizer.schedule == "deferred":  # the step checks that DDP synced its last micro-batch only
        reduction.forward_syncs = watch_forward_syncs(wrapped, optimizer)
    return wrapped
