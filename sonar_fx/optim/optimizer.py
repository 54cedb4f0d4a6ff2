"""`SonarOptimizer`: a real `torch.optim.Optimizer` whose expert group is updated during backward.

Param groups, so any LR scheduler drives every one: "dense" (end-of-step fused update after clipping
the global norm of the dense gradients), "experts" (updated one batched tensor at a time by
`update_expert_`, called from a hook or from the compiled graph, as soon as its gradient is ready) and,
for a config that updates hidden matrices apart (Muon), "dense_matrices" (end-of-step, clipped with
the other dense gradients). The arithmetic is an update rule chosen from the config type (AdamW, Adam,
SGD, Lion, Muon; see `rules`); around it live, each in its own module, the clipping and gradient
norms (`norms`), the two passes of exact global clipping (`global_clip`), the non-finite policy
(`nonfinite`), the step's bookkeeping (`step_tracker`), the groups (`param_groups`), the dense half of
the step (`dense_step`), the deferred schedule's intake and step (`deferred_intake`, `deferred_step`)
and `report`.
The optimizer binds its expert tensors to itself in the runtime registry (weakly), so whatever runs
in backward finds it from the tensor at hand; a deep copy or an unpickled optimizer binds its own
tensors. It never decides where updates run; the eager hooks and the graph pass do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sonar_fx.config import OptimizerConfig
from sonar_fx.errors import SonarUsageError
from sonar_fx.experts.discovery import ExpertLayer, ExpertSet
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.optim import added_groups, deferred_intake, deferred_loop, deferred_step, global_clip, lowbit
from sonar_fx.optim.adamw import grad_like_param
from sonar_fx.optim.checks import (
    check_options,
    check_tensor,
    hyperparameters,
    refuse_changed_hyperparameters,
    refuse_second_step,
    refuse_unsupported,
)
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.optim.dense_step import dense_step, dense_update
from sonar_fx.optim.grad_watch import DenseGradWatch
from sonar_fx.optim.group_checks import refuse_before_update, refuse_group_edits
from sonar_fx.optim.keep_budget import KeptGradients, check_keep_budget
from sonar_fx.optim.nonfinite import NONFINITE, NonFinite, NonFinitePolicy
from sonar_fx.optim.norms import ExpertClipper
from sonar_fx.optim.param_groups import build_param_groups
from sonar_fx.optim.reduction import GradReduction, refuse_unreduced
from sonar_fx.optim.report import report
from sonar_fx.optim.rules import matrix_rule_for, rule_for
from sonar_fx.optim.saving import OnSavingLost, SavingGuard, expert_grad_bytes, resolve_on_saving_lost
from sonar_fx.optim.sgd import refuse_mixed_momentum
from sonar_fx.optim.stats import SonarStats
from sonar_fx.optim.step_tracker import Accumulation, StepTracker
from sonar_fx.optim.untracked import UntrackedGradients
from sonar_fx.optim.weight_decay import expert_group_of, role_of
from sonar_fx.runtime import hooks, registry
from sonar_fx.runtime.engine import GradientFate
from sonar_fx.runtime.meter import ExpertGradMeter

Granularity = Literal["batched", "per_expert"]
Schedule = Literal["in_backward", "deferred"]
SCHEDULES = ("in_backward", "deferred")

__all__ = ["NONFINITE", "SCHEDULES", "Accumulation", "Granularity", "NonFinite", "Schedule", "SonarOptimizer"]


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
        matrices: Sequence[nn.Parameter] = (),
        on_saving_lost: OnSavingLost | None = None,
        schedule: Schedule = "in_backward",
    ) -> None:
        """`dense_names`: the model's names of `dense_params`, for messages. `param_order`: every
        trainable parameter in the model's order (`model.parameters()`), the order in which
        expert_clip="global" sums per-tensor norms, as `clip_grad_norm_` over the model would (default:
        dense, then experts). `compiler`: what compiles the model's forward ("eager": nothing; reported
        by `report()`). `distributed`: how expert gradients are reduced across ranks before their update
        (None: one process); `sonar_fx.distributed` passes it. `matrices`: the dense tensors a config
        with a matrix rule (Muon) updates as hidden matrices (`sonar_fx.optim.matrices.matrix_params`).
        `on_saving_lost`: what a compiled graph that returns expert gradients un-rewritten does ("warn"
        or "raise"; see `sonar_fx.optim.saving`). `schedule`: "in_backward" (each expert updated in
        backward) or "deferred" (each expert's gradient computed and applied at `step()` from operands
        kept in backward: `sonar_fx.optim.deferred`)."""
        check_options(
            granularity=granularity, accumulation=accumulation, nonfinite=nonfinite, schedule=schedule
        )
        self._set_rules(cfg)
        refuse_unsupported(cfg, self.expert_rule.name, granularity, accumulation, schedule)
        check_keep_budget(cfg, schedule, distributed, [t.param for la in expert_layers for t in la.tensors])
        self.expert_rule.check_experts(expert_layers)
        self.cfg = cfg
        self.granularity = granularity
        self.accumulation = accumulation
        self.nonfinite = nonfinite
        self.schedule = schedule
        self.experts = ExpertSet(tuple(expert_layers))
        self.stats = SonarStats()
        self.saving = SavingGuard(
            resolve_on_saving_lost(on_saving_lost),
            ExpertGradBytes.of(expert_layers) if expert_layers else None,
        )
        self.compiler, self.distributed = compiler, distributed
        self.untracked: UntrackedGradients | None = None
        """Watches the model for trainable tensors no group holds (set by `prepare`)."""
        groups, self._norm_rank, self._labels = build_param_groups(
            cfg, (self.rule, self.expert_rule, self.matrix_rule), dense_params, self.experts.params,
            self.experts.names_by_id(), matrices=matrices, dense_names=dense_names, param_order=param_order,
        )  # fmt: skip
        super().__init__(groups, self.rule.defaults(cfg))
        self._bind()

    # ----------------------------------------------------------------------------- binding, copies

    def _bind(self) -> None:
        """Own the expert tensors: registry entries and hooks, both released when self is collected."""
        self.tracker = StepTracker(self.accumulation)
        self.grad_watch = DenseGradWatch()
        self.meter = ExpertGradMeter()
        self.deferred = DeferredGrads(meter=self.meter)
        self.kept_grads = KeptGradients(self.cfg.keep_budget, self.meter)  # the norm pass's, for `step()`
        self.loop = deferred_loop.DeferredLoop()  # what the loop did to gradients, for the deferred step
        self.steps_ended = 0
        """Steps completed or abandoned in this process (a compiled forward tells steps apart by it)."""
        self.nonfinite_policy = NonFinitePolicy(self.nonfinite)
        self._fresh: set[str] = set()  # expert tensors whose state was created in this step
        self._zeroed_experts: set[int] = set()  # zero_grad(set_to_none=False) left torch a zero .grad
        self._stepped_experts: set[int] = set()  # updated by the last deferred step: torch's .grad holds them
        self.checked_in_backward: tuple[int, str] | None = None  # `group_checks.refuse_before_update`
        self._momentum_checked_task: int | None = None  # the backward `_refuse_mixed_momentum` last checked
        # id(group) -> (an expert param group, its settings at this step's last update from it)
        self._expert_hyperparameters: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.clipper = ExpertClipper(self.cfg.expert_clip, self.cfg.max_grad_norm)
        self._names = self.experts.names_by_id()
        self._index_params()
        params = self.experts.params
        for p in params:
            registry.bind(p, self)
        handles = hooks.register_expert_hooks(params)
        weakref.finalize(self, _release, handles)

    def _index_params(self) -> None:
        """Model order, labels and the dense tensors, from `_norm_rank` / `_labels` (per flat param)."""
        flat = [p for g in self.param_groups for p in g["params"]]
        self._order = {id(p): r for p, r in zip(flat, self._norm_rank, strict=True)}
        self._label = {id(p): name for p, name in zip(flat, self._labels, strict=True) if name}
        dense = [p for p in flat if id(p) not in self._names]
        self._dense = sorted(dense, key=lambda p: self._order[id(p)])  # changed by add_param_group only

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults, state and param_groups: keep Sonar's own fields, drop
        # what belongs to one process (hooks, the step in progress).
        state = super().__getstate__()
        keep = ["cfg", "_norm_rank", "_labels", "granularity", "accumulation", "nonfinite", "schedule"]
        keep += ["experts", "stats", "saving"]
        state.update({k: self.__dict__[k] for k in keep})
        state.update(compiler=self.compiler, distributed=None)
        # The watched model itself (a deep copy of the model maps it to the copy); weak again once restored.
        state["untracked"] = self.untracked.model() if self.untracked is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = state.pop("untracked", None)
        super().__setstate__(state)
        self.untracked = UntrackedGradients(model) if model is not None else None
        self._set_rules(self.cfg)
        self._bind()  # a deep copy binds the copied tensors (its model's, when the model was copied)

    def _set_rules(self, cfg: OptimizerConfig) -> None:
        self.rule, self.expert_rule = rule_for(cfg), rule_for(cfg, experts=True)
        self.matrix_rule = matrix_rule_for(cfg)

    # ------------------------------------------------------------------------------ groups, state

    @property
    def expert_layers(self) -> list[ExpertLayer]:
        return list(self.experts.layers)

    @property
    def dense_group(self) -> dict[str, Any]:
        return self.param_groups[0]

    @property
    def expert_group(self) -> dict[str, Any]:
        """The experts' role group (groups split off it by weight decay follow the role groups)."""
        return self.param_groups[1]

    def dense_params(self) -> list[Tensor]:
        """Every dense parameter, in model order (the order the dense norm sums in)."""
        return list(self._dense)

    def model_order(self) -> dict[int, int]:
        """id(param) -> its position in the model's order, for every parameter this optimizer holds."""
        return self._order

    def owns(self, param: Tensor) -> bool:
        """`param` is one of this optimizer's expert tensors."""
        return registry.owner_of(param) is self

    def expert_name(self, param: Tensor) -> str:
        """The model's name for the expert tensor `param` (one of this optimizer's)."""
        return self._names.get(id(param), f"an expert tensor {tuple(param.shape)}")

    def dense_name(self, param: Tensor) -> str:
        """The model's name of a dense parameter, for messages."""
        return self._label.get(id(param)) or f"dense tensor #{self._order[id(param)]}"

    def group_rules(self) -> list[tuple[dict[str, Any], Any]]:
        """(param group, its rule) of every group, by its role (`weight_decay.role_of`): a group split
        off by weight decay keeps its role's rule, one added later (`add_param_group`) the dense rule."""
        rules = {"experts": self.expert_rule, "dense_matrices": self.matrix_rule}
        return [(g, rules.get(role_of(g)) or self.rule) for g in self.param_groups]

    def _dense_updates(self) -> list[tuple[dict[str, Any], Any]]:
        """(param group, its rule) of every group updated at `step()`."""
        return [(g, rule) for g, rule in self.group_rules() if role_of(g) != "experts"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, for a dense group (`added_groups`): stepped at `step()` with the dense rule."""
        if not hasattr(self, "_order"):  # torch's __init__ adding the groups Sonar built
            return super().add_param_group(param_group)
        added_groups.add_param_group(self, param_group, super().add_param_group)

    def _state(self, param: Tensor, *, expert: str | None = None, rule: Any = None) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            (rule or (self.expert_rule if expert else self.rule)).init_state(param, state)
            if expert:
                self._fresh.add(expert)
        return state

    def init_state(self) -> None:
        """Create every tensor's state now (zeros, as before its first update), so that a sharded
        checkpoint (torch.distributed.checkpoint) has a template to load into."""
        for group, rule in self._dense_updates():
            for p in group["params"]:
                self._state(p, rule=rule)
        for p in self.experts.params:
            self._state(p, expert=self._names[id(p)])
        self._fresh.clear()  # a template, not a first update that a skipped step would undo

    # ------------------------------------------------------------------------------------ updates

    @torch.no_grad()
    def update_expert_(self, param: Tensor, grad: Tensor, *, path: str, reduced: str = "") -> None:
        """Update one batched expert tensor, in this backward; the caller frees `grad` afterwards.
        `reduced` names the all-reduce a compiled graph applied to `grad` ("" for none)."""
        name = self._names.get(id(param))
        if name is None:
            raise KeyError("update_expert_ got a tensor that is not one of this optimizer's experts.")
        if self.schedule == "deferred" and path == "graph":
            raise SonarUsageError(
                f"{name}: a graph compiled for the in-backward schedule ran for a model prepared with "
                "schedule='deferred' (a graph dynamo reused across models of one class under the 'sonar' "
                "backend). Prepare every model of one class with the same schedule, or call "
                "torch._dynamo.reset() between them."
            )
        refuse_before_update(self, path)  # a group edited mid-run; a hook of the user's the graph skips
        check_tensor(name, param, grad, self.state.get(param, {}))
        if self.distributed is None:
            refuse_unreduced(name, reduced)
            self._update_now(name, param, grad, path)
            return
        # The reduction seam: the gradient every rank would see, then the update (now or in this backward).
        self.distributed.reduce_then_update(
            name, grad, path=path, reduced=reduced, update=lambda g: self._update_now(name, param, g, path)
        )

    def defer_expert_(self, param: Tensor, recipe: str, operands: list[Tensor]) -> None:
        """Keep one backward's operands of `param`'s weight gradient for `step()` (the deferred
        schedule's graph op and eager capture call this; `deferred_intake`)."""
        deferred_intake.keep_operands(self, param, recipe, operands)

    def keep_whole_(self, param: Tensor) -> None:
        """The deferred schedule's hook: `param.grad` arrived whole (`deferred_intake`)."""
        deferred_intake.keep_whole(self, param)

    def not_accumulated(self, param: Tensor, fate: GradientFate) -> None:
        """The in-graph update of `param` met a backward that adds nothing to its `.grad` (see
        `sonar_fx.runtime.engine`): left out, or refused (`StepTracker.not_accumulated`)."""
        self.tracker.not_accumulated(self.expert_name(param), fate)
        self.stats.left_out += 1

    def check_deferred(self, name: str, param: Tensor, grad: Tensor | None) -> None:
        """The deferred step's `check_tensor` (fp16 weights allowed: the update waits for `step()`)."""
        check_tensor(name, param, grad, self.state.get(param, {}), in_backward=False)

    def update_deferred_(self, name: str, param: Tensor, grad: Tensor, *, path: str) -> None:
        """Update `param` at `step()` with its whole-step gradient (ours: clipped in place)."""
        self.check_deferred(name, param, grad)
        self._stepped_experts.add(id(param))
        self._update_now(name, param, grad, path)

    @torch.no_grad()
    def _update_now(self, name: str, param: Tensor, grad: Tensor, path: str) -> None:
        # After the reduction: the norm pass of expert_clip="global" records the reduced gradient's norm.
        if global_clip.norm_pass(self, name, param, grad):
            return
        if self.tracker.before_update(name):
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)
        task = torch._C._current_graph_task_id()
        if self.schedule == "in_backward" and task != self._momentum_checked_task:
            self._momentum_checked_task = task  # the first expert update of this backward: none moved yet
            self._refuse_mixed_momentum()
        g = grad_like_param(param, grad)
        norm = self.clipper.norm_of(name, g)
        found_inf = self.nonfinite_policy.flag(name, grad, norm)
        # A hook's gradient is param.grad, freed right after: ours to scale in place, as is a copy.
        g = self.clipper.clip(name, g, owned=g is not grad or path in ("hook", "deferred", "kept"))
        group, state = expert_group_of(self.param_groups, param), self._state(param, expert=name)
        if self.granularity == "batched":
            self.expert_rule.update_([param], [g], [state], group, found_inf=found_inf)
            calls = 1
        else:  # the ablation: one kernel call per expert slice
            calls = self.expert_rule.update_slices_(param, g, state, group, found_inf=found_inf)
        self.tracker.record(name)
        self._expert_hyperparameters[id(group)] = (group, hyperparameters(group))
        self.stats.record_update(name, path, calls=calls)

    def _refuse_mixed_momentum(self) -> None:
        """Before any expert of a backward (the deferred step: of the step) moves: every SGD expert group's
        tensors hold a momentum buffer, or none does (`sgd.refuse_mixed_momentum`)."""
        for group, rule in self.group_rules():
            if role_of(group) == "experts" and rule.name == "sgd":
                refuse_mixed_momentum(group, self.state, self.expert_name)

    def backward_began(self) -> None:
        """A backward reached the model's outputs (`backward_root`): await its end."""
        self.tracker.backward_began()
        deferred_loop.backward_began(self)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        """Autograd runs this when a backward that updated experts (or began at the model's outputs)
        ends; never when it raised."""
        self.tracker.backward_finished()
        if self.distributed is None:
            self.grad_watch.backward_finished(self._dense)
        else:  # an engine writes the reduced dense gradients in its own end-of-backward callback: after it
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.grad_watch.backward_finished(self._dense)
            )
        deferred_loop.backward_finished(self)
        err = self.nonfinite_policy.after_backward(list(self.tracker.updated), self._any_rank)
        if err is not None:
            self.tracker.interrupted = [n for n in self.tracker.updated if n not in err.tensors]
            raise err

    # -------------------------------------------------------------------------------- step, recovery

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Dense parameters: clip by the global norm (of the dense gradients, or of all of them under
        expert_clip="global"), then the fused update. Experts are done."""
        if closure is not None:
            raise SonarUsageError("SonarOptimizer.step() takes no closure: experts update during backward.")
        if self.untracked is not None:
            self.untracked.check(p for group in self.param_groups for p in group["params"])
        refuse_group_edits(self.group_rules())  # before any weight moves: a flag edited mid-run
        self.tracker.before_step()
        if self.schedule == "deferred":
            self._refuse_mixed_momentum()
            self._make_kept_zeros()
            self._stepped_experts.clear()
            deferred_step.step(self)
            return
        if not self.tracker.updated and self.grad_watch.stale(self._dense):
            refuse_second_step()
        if self.clipper.skip_step:  # skipped by backward() (expert_clip="global", nonfinite="skip")
            self.end_step()
            return
        if self.tracker.updated:  # the experts stepped with the values of their updates: so must the dense
            for group, used in self._expert_hyperparameters.values():
                refuse_changed_hyperparameters(used, group)
        self.dense_step()
        self.end_step()

    def dense_step(self, *, update: bool = True) -> None:
        """The dense half of `step()` (`sonar_fx.optim.dense_step`); `update=False`: all but the update,
        which `dense_update` runs."""
        dense_step(self, update=update)

    def dense_update(self) -> None:
        """The dense groups' update, after `dense_step(update=False)` (the deferred step)."""
        dense_update(self)

    def backward(self, loss: Tensor | Callable[[], Tensor]) -> Tensor:
        """Backward for this optimizer's step; returns the loss, detached. `loss` is the loss, or a
        closure that computes it (a forward), which expert_clip="global" needs: it runs forward and
        backward twice, exactly (`sonar_fx.optim.global_clip`)."""
        if self.cfg.expert_clip == "global" and self.schedule != "deferred":
            return global_clip.backward(self, loss)
        out = loss() if callable(loss) else loss
        out.backward()
        return out.detach()

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
        self._forget_fresh_states(self.nonfinite_policy.flagged())
        self.clipper.abandon()
        self.stats.abandon_step(updated)
        self.meter.forget()
        self._forget_step()
        return updated

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`, and the deferred schedule's kept operands dropped with the gradients.
        `set_to_none=False`: torch leaves a zero `.grad` where a gradient was, which its next step applies
        (AdamW's moments and weight decay move the tensor); the experts' zeros are made only if nothing
        else reaches them before `step()` (`_make_kept_zeros`), since 0 + g is g."""
        if set_to_none:
            self._zeroed_experts.clear()
        else:  # torch's .grad after a backward, or still after a step (the deferred step freed it)
            self._zeroed_experts.update(
                id(p) for p in self.experts.params if self.deferred.has(p) or self.kept_grads.holds(p)
            )
            self._zeroed_experts.update(self._stepped_experts)
        self._stepped_experts.clear()
        super().zero_grad(set_to_none)
        self.deferred.clear()
        self.kept_grads.clear()
        self.loop.zero_grad()
        if set_to_none:  # what the meter counts alive was in `.grad` or kept, freed now
            self.meter.forget()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """`torch.nn.utils.clip_grad_norm_` over every parameter, the experts included (the deferred
        schedule; `sonar_fx.optim.deferred_loop`): returns torch's total norm, bitwise."""
        self._make_kept_zeros()
        return deferred_loop.clip_grad_norm_(self, max_norm, norm_type)

    def _make_kept_zeros(self) -> None:
        """The zero `.grad` torch kept through `zero_grad(set_to_none=False)`, for each expert that no
        backward reached since (one that did has its gradient kept, which the zeros would not change)."""
        for p in self.experts.params:
            if id(p) in self._zeroed_experts and not (self.deferred.has(p) or self.kept_grads.holds(p)):
                p.grad = torch.zeros_like(p)
        self._zeroed_experts.clear()

    def end_step(self) -> None:
        self.grad_watch.step_finished(self._dense)
        self.loop.step_finished(self._dense)
        self.saving.end_step(
            compiler=self.compiler, paths=self.stats.current_step, after_graph=self.meter.after_graph,
            fallbacks=self.stats.fallbacks,
        )  # fmt: skip
        self.meter.end_step()
        self.deferred.end_step()
        self.clipper.end_step()
        self.stats.end_step()
        self._forget_step()

    def _forget_step(self) -> None:
        """What every end of a step, completed or abandoned, clears."""
        self.steps_ended += 1
        self._fresh.clear()
        self._zeroed_experts.clear()
        self._expert_hyperparameters.clear()
        self.nonfinite_policy.flags.clear()
        self.tracker.reset()

    def _forget_fresh_states(self, names: list[str]) -> None:
        """A tensor whose FIRST update was skipped gets no state, as if it had never been stepped (an
        SGD momentum buffer is only initialized by an update that runs)."""
        by_name = {name: pid for pid, name in self._names.items()}
        by_id = {id(p): p for p in self.experts.params}
        for name in names:
            if name in self._fresh:
                self.state.pop(by_id[by_name[name]], None)

    def _any_rank(self, local: bool) -> bool:
        """`local` on any rank: every rank stops or skips a step alike (one process: `local`)."""
        return local if self.distributed is None else self.distributed.any_rank(local)

    # ------------------------------------------------------------------------- report, state dicts

    def report(self) -> dict[str, Any]:
        """What Sonar found and did: expert tensors, update counts by path, compiles and fallbacks
        (`sonar_fx.optim.report`)."""
        settings = dict(
            expert_layers=len(self.experts.layers), expert_tensors=len(self._names), optimizer=self.cfg.name,
            granularity=self.granularity, expert_rule=self.expert_rule.name, expert_clip=self.cfg.expert_clip,
            grad_norms=self.grad_norms(), compiler=self.compiler, nonfinite=self.nonfinite,
            schedule=self.schedule,
        )  # fmt: skip
        saving = {
            **self.saving.report(),
            "updates_after_graph": self.meter.after_graph,
            "expert_grad_bytes": expert_grad_bytes(self.meter, self.expert_layers),
        }
        if self.schedule == "deferred":
            saving["deferred"] = {**self.deferred.report(), **self.kept_grads.report()}
        return report(settings, self.stats, self.tracker, saving)

    def grad_norms(self) -> dict[str, Any]:
        """The last completed step's gradient norms as floats (one host sync): "dense" (global norm of
        the dense gradients), "total" (dense and experts, expert_clip="global" only) and "experts"
        (name -> norm of that tensor's gradient), all before clipping."""
        return self.clipper.last.as_floats()

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; low-bit expert states are stored as their plain tensors (codes, scales)."""
        return lowbit.pack_state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, with low-bit expert states rebuilt bitwise (torch would cast their scales)."""
        lowbit.load_packed_state_dict(self, state_dict, super().load_state_dict)


def _release(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
