"""`SonarOptimizer`: a real `torch.optim.Optimizer` whose expert group is updated during backward.

Two param groups, so any LR scheduler drives both: "dense" (end-of-step fused update after clipping
the global norm of the dense gradients) and "experts" (updated one batched tensor at a time by
`update_expert_`, called from a hook or from the compiled graph, as soon as its gradient is ready).
The arithmetic is an update rule chosen from the config type (AdamW, Adam, SGD, Lion; see `rules`),
the clipping and gradient norms are `norms`'; `backward(closure)` runs the two passes that exact
global clipping of expert gradients needs (expert_clip="global").
The optimizer binds its expert tensors to itself in the runtime registry (weakly), so whatever runs
in backward finds it from the tensor at hand; a deep copy or an unpickled optimizer binds its own
tensors. It never decides where updates run; the eager hooks and the graph pass do.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import NonFiniteGradientError, SonarUsageError
from sonar_fx.experts.discovery import ExpertLayer, ExpertSet
from sonar_fx.optim import lowbit
from sonar_fx.optim.adamw import grad_like_param, nonfinite_flag
from sonar_fx.optim.norms import ExpertClipper, clip_coefficient, plain, total_norm
from sonar_fx.optim.reduction import GradReduction, refuse_unreduced
from sonar_fx.optim.rules import rule_for
from sonar_fx.optim.saving import OnSavingLost, SavingGuard, expert_grad_bytes, resolve_on_saving_lost
from sonar_fx.optim.stats import SonarStats
from sonar_fx.optim.step_tracker import Accumulation, StepTracker
from sonar_fx.optim.untracked import UntrackedGradients
from sonar_fx.runtime import hooks, registry
from sonar_fx.runtime.meter import ExpertGradMeter

Granularity = Literal["batched", "per_expert"]
NonFinite = Literal["raise", "skip", "ignore"]
NONFINITE = ("raise", "skip", "ignore")

__all__ = ["Accumulation", "Granularity", "NonFinite", "SonarOptimizer"]


class SonarOptimizer(torch.optim.Optimizer):
    """An element-wise optimizer for an MoE model: experts in backward, dense parameters at `step()`."""

    def __init__(
        self,
        dense_params: Sequence[nn.Parameter],
        expert_layers: Sequence[ExpertLayer],
        cfg: OptimizerConfig,
        *,
        granularity: Granularity = "batched",
        accumulation: Accumulation = None,
        nonfinite: NonFinite = "raise",
        dense_names: Sequence[str] | None = None,
        param_order: Sequence[nn.Parameter] | None = None,
        compiler: str = "eager",
        distributed: GradReduction | None = None,
        on_saving_lost: OnSavingLost | None = None,
    ) -> None:
        """`param_order`: every trainable parameter in the model's order (`model.parameters()`), the
        order in which expert_clip="global" sums per-tensor norms, as `clip_grad_norm_` over the model
        would (default: dense, then experts). `compiler`: what compiles the model's forward ("eager":
        nothing; reported by `report()`). `distributed`: how expert gradients are reduced across ranks
        before their update (None: one process); `sonar_fx.distributed` passes it. `on_saving_lost`: what
        a compiled graph that returns expert gradients un-rewritten does ("warn" or "raise"; see
        `sonar_fx.optim.saving`)."""
        if granularity not in ("batched", "per_expert"):
            raise ValueError(f"granularity={granularity!r}: expected 'batched' or 'per_expert'.")
        if accumulation not in (None, "per_microbatch"):
            raise ValueError(f"accumulation={accumulation!r}: expected None or 'per_microbatch'.")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}: expected one of {', '.join(map(repr, NONFINITE))}.")
        self.rule, self.expert_rule = rule_for(cfg), rule_for(cfg, experts=True)
        _refuse_unsupported(cfg, self.expert_rule.name, granularity, accumulation)
        self.cfg = cfg
        self.granularity = granularity
        self.accumulation = accumulation
        self.nonfinite = nonfinite
        self.experts = ExpertSet(tuple(expert_layers))
        self.dense_names = list(dense_names) if dense_names is not None else None
        self.stats = SonarStats()
        self.saving = SavingGuard(resolve_on_saving_lost(on_saving_lost))
        self.compiler = compiler
        self.distributed = distributed
        self.untracked: UntrackedGradients | None = None
        """Watches the model for trainable tensors no group holds (set by `prepare`)."""
        defaults = self.rule.defaults(cfg)
        experts = self.experts.params
        order = list(param_order) if param_order is not None else [*dense_params, *experts]
        rank = {id(p): i for i, p in enumerate(order)}
        # Position in model order of each param, in param-group order: plain ints, so copies keep it.
        self._norm_rank = [rank[id(p)] for p in [*dense_params, *experts]]
        super().__init__(
            [dict(params=list(dense_params), name="dense"), dict(params=experts, name="experts")], defaults
        )
        self._bind()

    # ----------------------------------------------------------------------------- binding, copies

    def _bind(self) -> None:
        """Own the expert tensors: registry entries and hooks, both released when self is collected."""
        self.tracker = StepTracker(self.accumulation)
        self.meter = ExpertGradMeter()
        self._skip_flags: dict[str, Tensor] = {}
        self._fresh: set[str] = set()  # expert tensors whose state was created in this step
        self.clipper = ExpertClipper(self.cfg.expert_clip, self.cfg.max_grad_norm)
        self._names = self.experts.names_by_id()
        params = self.experts.params
        for p in params:
            registry.bind(p, self)
        handles = hooks.register_expert_hooks(params)
        weakref.finalize(self, _release, handles)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults, state and param_groups: keep Sonar's own fields, drop
        # what belongs to one process (hooks, the step in progress).
        state = super().__getstate__()
        keep = (
            "cfg",
            "_norm_rank",
            "granularity",
            "accumulation",
            "nonfinite",
            "experts",
            "dense_names",
            "stats",
            "saving",
        )
        state.update({k: self.__dict__[k] for k in keep})
        state.update(compiler=self.compiler, distributed=None)
        # The watched model itself (a deep copy of the model maps it to the copy); weak again once restored.
        state["untracked"] = self.untracked.model() if self.untracked is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = state.pop("untracked", None)
        super().__setstate__(state)
        self.untracked = UntrackedGradients(model) if model is not None else None
        self.rule, self.expert_rule = rule_for(self.cfg), rule_for(self.cfg, experts=True)
        self._bind()  # a deep copy binds the copied tensors (its model's, when the model was copied)

    def expert_name(self, param: Tensor) -> str:
        """The model's name for the expert tensor `param` (one of this optimizer's)."""
        return self._names.get(id(param), f"an expert tensor {tuple(param.shape)}")

    # ------------------------------------------------------------------------------------ updates

    @property
    def expert_layers(self) -> list[ExpertLayer]:
        return list(self.experts.layers)

    @property
    def dense_group(self) -> dict[str, Any]:
        return self.param_groups[0]

    @property
    def expert_group(self) -> dict[str, Any]:
        return self.param_groups[1]

    def _state(self, param: Tensor, *, expert: str | None = None) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            (self.expert_rule if expert else self.rule).init_state(param, state)
            if expert:
                self._fresh.add(expert)
        return state

    def init_state(self) -> None:
        """Create every tensor's state now (zeros, as before its first update), so that a sharded
        checkpoint (torch.distributed.checkpoint) has a template to load into."""
        for p in self.dense_group["params"]:
            self._state(p)
        for p in self.expert_group["params"]:
            self._state(p, expert=self._names[id(p)])
        self._fresh.clear()  # a template, not a first update that a skipped step would undo

    @torch.no_grad()
    def update_expert_(self, param: Tensor, grad: Tensor, *, path: str, reduced: str = "") -> None:
        """Update one batched expert tensor, in this backward; the caller frees `grad` afterwards.
        `reduced` names the all-reduce a compiled graph applied to `grad` ("" for none)."""
        name = self._names.get(id(param))
        if name is None:
            raise KeyError("update_expert_ got a tensor that is not one of this optimizer's experts.")
        self._check_tensor(name, param, grad)
        if self.distributed is None:
            refuse_unreduced(name, reduced)
            self._update_now(name, param, grad, path)
            return
        # The reduction seam: the gradient every rank would see, then the update (now or in this backward).
        self.distributed.reduce_then_update(
            name, grad, path=path, reduced=reduced, update=lambda g: self._update_now(name, param, g, path)
        )

    @torch.no_grad()
    def _update_now(self, name: str, param: Tensor, grad: Tensor, path: str) -> None:
        if self._norm_pass(name, param, grad):  # after the reduction: the norm of the reduced gradient
            return
        if self.tracker.before_update(name):
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        g = grad_like_param(param, grad)
        norm = self.clipper.norm_of(name, g)
        found_inf = self._nonfinite_flag(name, grad, norm)
        # A hook's gradient is param.grad, freed right after: ours to scale in place, as is a copy.
        g = self.clipper.clip(name, g, owned=g is not grad or path == "hook")
        group, state = self.expert_group, self._state(param, expert=name)
        if self.granularity == "batched":
            self.expert_rule.update_([param], [g], [state], group, found_inf=found_inf)
            self.stats.update_calls += 1
        else:
            # The ablation: one kernel call per expert slice.
            self.stats.update_calls += self.expert_rule.update_slices_(
                param, g, state, group, found_inf=found_inf
            )
        self.tracker.record(name)
        self.stats.record_update(name, path)

    def _norm_pass(self, name: str, param: Tensor, grad: Tensor) -> bool:
        """The first pass of expert_clip="global": record the norm, update nothing. True if it ran."""
        if self.cfg.expert_clip != "global":
            return False
        if self.clipper.backward_pass is None:
            raise SonarUsageError(
                f"{name}: expert_clip='global' clips by the norm of ALL gradients, known only after a "
                "first backward pass: call optimizer.backward(lambda: model(**batch).loss) (it runs both "
                "passes) instead of loss.backward()."
            )
        if self.clipper.backward_pass == "update":
            return False
        if name in self.clipper.current.experts:
            raise SonarUsageError(
                f"{name} received two gradients in one backward (a module that runs twice per forward): "
                "expert_clip='global' needs each expert gradient whole; use expert_clip='per_tensor' or None."
            )
        self.clipper.norm_of(name, grad_like_param(param, grad))  # recorded for the update pass
        return True

    def _check_tensor(self, name: str, param: Tensor, grad: Tensor) -> None:
        if param.dtype == torch.float16:
            raise SonarUsageError(
                f"{name} is float16: fp16 weights need a GradScaler, whose unscale and inf check would run "
                "after Sonar has already applied the update in backward. Train in bf16 or fp32."
            )
        if grad.dtype != param.dtype or grad.device != param.device:
            raise SonarUsageError(
                f"{name}: gradient is {grad.dtype} on {grad.device} but the parameter is {param.dtype} on "
                f"{param.device}; Sonar updates weights in their own dtype. Keep expert weights and their "
                "gradients in one dtype (e.g. model.to(torch.bfloat16)), without fp32 master copies."
            )
        moment = next(
            (v for v in self.state.get(param, {}).values() if isinstance(v, Tensor) and v.dim()), None
        )
        if moment is not None and (moment.dtype, moment.device) != (param.dtype, param.device):
            raise SonarUsageError(
                f"{name} is now {param.dtype} on {param.device} but its optimizer state is "
                f"{moment.dtype} on {moment.device}: the model was cast or moved "
                "(model.half(), model.to(...)) after training started. Cast or move the model before "
                "the first step, or load a checkpoint into a model already on its final device and dtype."
            )

    def _nonfinite_flag(self, name: str, grad: Tensor, norm: Tensor | None) -> Tensor | None:
        """The kernel's skip flag (device-side, no sync): a non-finite gradient leaves its tensor
        untouched under "raise" and "skip"; which ones were non-finite is read once per backward.
        With the gradient's norm at hand it decides (an inf or NaN makes the norm non-finite), so the
        logged norm costs no extra pass over the gradient; a finite gradient whose norm overflows
        (entries near 1e19 in fp32) counts as non-finite too."""
        if self.nonfinite == "ignore":
            return None
        if norm is not None and not _is_dtensor(grad):
            bad = (~torch.isfinite(norm)).to(torch.float32)
            self._skip_flags[name] = bad
            return bad
        flag = nonfinite_flag(grad)
        # An FSDP2 shard's flag is a replicated DTensor (the whole tensor's verdict): keep its plain value.
        full = getattr(flag, "full_tensor", None)
        self._skip_flags[name] = full() if full is not None else flag
        return flag

    def backward_began(self) -> None:
        """A backward reached the model's outputs (`step_tracker.mark_backward_root`): await its end."""
        self.tracker.backward_began()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        """Autograd runs this when a backward that updated experts (or began at the model's outputs)
        ends; never when it raised."""
        self.tracker.backward_finished()
        if self.nonfinite != "raise" or not self._skip_flags:
            return
        bad = self._nonfinite_names()
        if not self._any_rank(bool(bad)):
            return
        self.tracker.interrupted = [n for n in self.tracker.updated if n not in bad]
        where = ", ".join(bad[:4]) or "expert tensors of another rank"
        raise NonFiniteGradientError(
            f"non-finite expert gradients (inf or NaN) in {where}"
            f"{' ...' if len(bad) > 4 else ''} (nonfinite='raise'): their weights and moments are untouched. "
            f"{len(self.tracker.interrupted)} expert tensor(s) with finite gradients were already updated "
            "in this backward. Call optimizer.abandon_step() to drop the step and go on, restore the last "
            "checkpoint for an exact run, or pass nonfinite='skip' to skip such steps.",
            bad,
        )

    # -------------------------------------------------------------------------------- step, recovery

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Dense parameters: clip by the global norm (of the dense gradients, or of all of them under
        expert_clip="global"), then the fused update. Experts are done."""
        if closure is not None:
            raise SonarUsageError("SonarOptimizer.step() takes no closure: experts update during backward.")
        if self.untracked is not None:
            self.untracked.check(p for group in self.param_groups for p in group["params"])
        self.tracker.before_step()
        if self.clipper.skip_step:  # skipped by backward() (expert_clip="global", nonfinite="skip")
            self._end_step()
            return
        group = self.dense_group
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        norms = self.clipper.current
        if grads and norms.dense is None:
            # Always taken (the logged dense norm); get_total_norm + clip_grads_with_norm_ is what
            # clip_grad_norm_ runs: the same bits.
            norms.dense = plain(torch.nn.utils.get_total_norm(grads))
        if self._skip_step(params, norms.dense):
            self._end_step()
            return
        clip_by = norms.total if self.cfg.expert_clip == "global" else norms.dense
        if self.cfg.clips and clip_by is not None and grads:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, clip_by)  # type: ignore[arg-type]
        states = [self._state(p) for p in params]
        self.rule.update_(params, grads, states, group)
        self._end_step()

    def backward(self, loss: Tensor | Callable[[], Tensor]) -> Tensor:
        """Backward for this optimizer's step; returns the loss. `loss` is the loss, or a closure that
        computes it (a forward), which expert_clip="global" needs.

        Under expert_clip="global" the step runs forward and backward twice, exactly. Pass 1 computes
        every gradient: dense ones stay in `.grad`, each expert gradient leaves only its norm and is
        freed at once, so expert gradients are never all alive. The global norm (dense + experts,
        summed in parameter order as `clip_grad_norm_` sums it) gives the clip coefficient. Pass 2
        runs the forward again from the same RNG state and a backward that computes expert gradients
        only (`inputs=`), clipping and updating each. Costs one more forward and backward; the graph
        of pass 1 is not kept (that would hold every activation through both passes, and a compiled
        backward may reuse its saved buffers, which is why torch refuses retain_graph for it).
        """
        if self.cfg.expert_clip != "global":
            out = loss() if callable(loss) else loss
            out.backward()
            return out.detach()
        if not callable(loss):
            raise SonarUsageError(
                "expert_clip='global' runs the forward twice (the global norm is known only after a first "
                "backward): pass the forward as a closure, optimizer.backward(lambda: model(**batch).loss)."
            )
        if self.clipper.backward_pass is not None or self.clipper.current.experts:
            raise SonarUsageError(
                "optimizer.backward() was called twice before step(): expert_clip='global' applies the "
                "update of a step once; call step() (or abandon_step()) after each backward."
            )
        rng = _rng_state()
        self.clipper.backward_pass = "norm"
        try:
            first = loss()
            first.backward()
        except BaseException:
            self.clipper.abandon()
            raise
        experts = self._global_norm()
        if experts is None:  # non-finite under nonfinite="skip": the step is skipped
            return first.detach()
        _set_rng_state(rng)  # pass 2 draws what pass 1 drew (dropout): the same forward, bit for bit
        self.clipper.backward_pass = "update"
        try:
            torch.autograd.backward(loss(), inputs=experts)
        finally:
            self.clipper.backward_pass = None
        return first.detach()

    @torch.no_grad()
    def _global_norm(self) -> list[Tensor] | None:
        """Between the passes: the global norm and clip coefficient; the experts pass 2 must update
        (None: the step is skipped for a non-finite norm)."""
        norms = self.clipper.current
        dense = [p for p in self.dense_group["params"] if p.grad is not None]
        dense_norms = torch._foreach_norm([p.grad for p in dense], 2.0) if dense else []
        by_param: dict[int, Tensor] = {id(p): n for p, n in zip(dense, dense_norms, strict=True)}
        names = {name: pid for pid, name in self._names.items()}
        experts = [p for p in self.expert_group["params"] if self._names[id(p)] in norms.experts]
        by_param.update({names[n]: norm for n, norm in norms.experts.items()})
        flat = [*self.dense_group["params"], *self.expert_group["params"]]
        rank = {id(p): r for p, r in zip(flat, self._norm_rank, strict=True)}
        ordered = [by_param[pid] for pid in sorted(by_param, key=rank.__getitem__)]
        norms.total = total_norm(ordered)
        norms.dense = total_norm(list(dense_norms)) if dense_norms else None
        assert self.cfg.max_grad_norm is not None  # the config refuses "global" without a threshold
        self.clipper.coef = clip_coefficient(norms.total, self.cfg.max_grad_norm)
        if self.nonfinite == "ignore" or bool(torch.isfinite(norms.total)):  # one sync per step
            return experts
        bad = [n for n, v in norms.experts.items() if not bool(torch.isfinite(v))]
        bad += [self._dense_name(i) for i, p in enumerate(self.dense_group["params"]) if not _finite(p.grad)]
        if self.nonfinite == "raise":
            self.clipper.abandon()
            raise NonFiniteGradientError(
                f"non-finite gradients (inf or NaN) in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} "
                "(nonfinite='raise', expert_clip='global'): found by the norm pass, before any weight or "
                "moment was touched. Call optimizer.abandon_step() to drop the step and go on, or pass "
                "nonfinite='skip' to skip such steps.",
                bad,
            )
        self.stats.skipped_steps += 1
        self.stats.skipped_updates.update(n for n in norms.experts if n in bad)
        if self.stats.skipped_steps == 1:
            warnings.warn(
                f"sonar: non-finite gradients in {', '.join(bad[:4])}, step skipped (nonfinite='skip', "
                "expert_clip='global'); report() counts every skip.",
                stacklevel=3,
            )
        for p in self.dense_group["params"]:
            p.grad = None
        self.clipper.skip_step = True
        return None

    def _skip_step(self, params: list[Tensor], total_norm: Tensor | None) -> bool:
        """Apply the non-finite policy to the dense gradients (and, under "skip", the experts')."""
        if self.nonfinite == "ignore":
            return False
        skipped = self._nonfinite_names()
        dense_bad = total_norm is not None and not bool(torch.isfinite(total_norm))
        if dense_bad and self.nonfinite == "raise":
            bad = [self._dense_name(i) for i, p in enumerate(params) if not _finite(p.grad)]
            raise NonFiniteGradientError(
                f"dense gradients hold inf or NaN ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; "
                "nonfinite='raise'); no dense weight or moment was touched. The expert tensors were updated "
                "in backward with finite gradients: call optimizer.abandon_step() to drop this step's dense "
                "gradients, or pass nonfinite='skip' to skip such steps.",
                bad,
            )
        if not self._any_rank(dense_bad or bool(skipped)):
            return False
        self.stats.skipped_updates.update(skipped)
        self.stats.skipped_steps += 1
        if self.stats.skipped_steps == 1:
            warnings.warn(
                f"sonar: non-finite gradients, step skipped (nonfinite='skip'; experts skipped: "
                f"{len(skipped)}, dense: {'yes' if dense_bad else 'no'}); report() counts every skip.",
                stacklevel=3,
            )
        for p in params:
            p.grad = None
        self._forget_fresh_states(skipped)
        return True

    def _forget_fresh_states(self, names: list[str]) -> None:
        """A tensor whose FIRST update was skipped gets no state, as if it had never been stepped (an
        SGD momentum buffer is only initialized by an update that runs)."""
        params = {name: pid for pid, name in self._names.items()}
        by_id = {id(p): p for p in self.expert_group["params"]}
        for name in names:
            if name in self._fresh:
                self.state.pop(by_id[params[name]], None)

    def _any_rank(self, local: bool) -> bool:
        """`local` on any rank: every rank stops or skips a step alike (one process: `local`)."""
        return local if self.distributed is None else self.distributed.any_rank(local)

    def _nonfinite_names(self) -> list[str]:
        """Expert tensors whose gradient was non-finite since the last step (one sync for all)."""
        if not self._skip_flags:
            return []
        flags = torch.stack(list(self._skip_flags.values())).tolist()
        return [name for name, flag in zip(self._skip_flags, flags, strict=True) if flag]

    def _dense_name(self, index: int) -> str:
        return self.dense_names[index] if self.dense_names else f"dense tensor #{index}"

    def _end_step(self) -> None:
        self.saving.end_step(
            compiler=self.compiler, paths=self.stats.current_step, after_graph=self.meter.after_graph,
            fallbacks=self.stats.fallbacks,
        )  # fmt: skip
        self.meter.end_step()
        self.clipper.end_step()
        self._fresh.clear()
        self._skip_flags.clear()
        self.tracker.reset()
        self.stats.end_step()

    def abandon_step(self) -> list[str]:
        """Drop a step a backward left partial (it raised): dense gradients and the step's bookkeeping.

        Expert tensors the interrupted backward updated keep that update (it cannot be taken back) and
        their Adam step counts stay one ahead of the others'; returns their names. For a run bitwise
        equal to an uninterrupted one, restore the last checkpoint instead.
        """
        updated = list(self.tracker.interrupted or self.tracker.updated)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self.stats.abandoned_steps.append(updated)
        self.stats.current_step = {}
        self._forget_fresh_states(self._nonfinite_names())
        self._fresh.clear()
        self.clipper.abandon()
        self._skip_flags.clear()
        self.tracker.reset()
        self.meter.forget()
        return updated

    def report(self) -> dict[str, Any]:
        """What Sonar found and did: expert tensors, update counts by path, compiles and fallbacks."""
        s, t = self.stats, self.tracker
        return {
            "expert_layers": len(self.expert_layers),
            "expert_tensors": len(self._names),
            "granularity": self.granularity,
            "optimizer": self.cfg.name,
            "expert_rule": self.expert_rule.name,
            "expert_clip": self.cfg.expert_clip,
            "grad_norms": self.grad_norms(),
            "compiler": self.compiler,
            "nonfinite": self.nonfinite,
            "updates_in_graph": s.updates["graph"],
            "updates_by_hook": s.updates["hook"],
            "update_calls": s.update_calls,
            "graphs_compiled": s.graphs_compiled,
            "graphs_from_cache": s.graphs_from_cache,
            "updates_inserted": s.updates_inserted,
            "recompiles": s.recompiles,
            "fallbacks": list(s.fallbacks),
            **self.saving.report(),
            "updates_after_graph": self.meter.after_graph,
            "expert_grad_bytes": expert_grad_bytes(self.meter, self.expert_layers),
            "last_step": dict(s.last_step),
            "step_in_progress": {
                "updated": sorted(t.updated),
                "backward_unfinished": t.open_task is not None,
                "interrupted": t.interrupted is not None,
            },
            "skipped_updates": dict(s.skipped_updates),
            "skipped_steps": s.skipped_steps,
            "abandoned_steps": [list(names) for names in s.abandoned_steps],
        }

    def grad_norms(self) -> dict[str, Any]:
        """The last completed step's gradient norms as floats (one host sync): "dense" (global norm of
        the dense gradients), "total" (dense and experts, expert_clip="global" only) and "experts"
        (name -> norm of that tensor's gradient), all before clipping."""
        return self.clipper.last.as_floats()

    # ------------------------------------------------------------------------------- state dicts

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; low-bit expert states are stored as their plain tensors (codes, scales)."""
        return lowbit.pack_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, with low-bit expert states rebuilt bitwise (torch would cast their scales)."""
        lowbit.load_packed_state_dict(self, state_dict, super().load_state_dict)


def _refuse_unsupported(cfg: OptimizerConfig, expert_rule: str, granularity: str, accumulation: Any) -> None:
    """Combinations that would train differently from what they promise, refused naming the fix."""
    if cfg.expert_clip == "global" and accumulation is not None:
        raise SonarUsageError(
            "expert_clip='global' with accumulation='per_microbatch': the global norm of one micro-batch is "
            "not the norm of the step's gradient. Use expert_clip='per_tensor' or None to accumulate."
        )
    if granularity == "per_expert" and expert_rule.endswith("bit"):
        raise SonarUsageError(
            "granularity='per_expert' with low-bit states: torchao quantizes a whole tensor in blocks, not "
            "one expert slice at a time. Use granularity='batched' or state_bits=32."
        )


def _rng_state() -> tuple[Tensor, list[Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _release(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _finite(t: Tensor | None) -> bool:
    return t is None or bool(nonfinite_flag(t) == 0)


def _is_dtensor(t: Tensor) -> bool:
    """An FSDP2 shard's gradient: its norm is this rank's part, so the flag comes from the whole tensor."""
    return hasattr(t, "full_tensor")
