"""Checkpoints that the plain `Trainer` and `SonarTrainer` resume from each other, bitwise.

The plain Trainer's `optimizer.pt` is torch AdamW's state dict over TWO param groups, the tensors it
decays then the others (`Trainer.create_optimizer`, in the model's order within each); its
`scheduler.pt` keeps one LR per group. `model.sonar` holds the same tensors and the same per-tensor
state (step, exp_avg, exp_avg_sq: fused AdamW's) in its own groups ("dense", "experts", and the
weight-decay groups). So `SonarTrainer` writes both files in the Trainer's layout (a plain Trainer
resumes them as its own) and reads either layout back: each tensor's state moves by the parameter it
belongs to, each group's settings (LR, initial LR, betas, weight decay) from the group that held it.
Also here: the expert tensors `save_pretrained` wrote in another layout (`load_converted_weights_`).
Never: guess a mapping. A tensor count, a shape or a group setting that does not match is a
`SonarUsageError` naming it, raised before anything is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sonar_fx.errors import SonarUsageError
from sonar_fx.optim.optimizer import SonarOptimizer

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
_PER_GROUP = ("base_lrs", "_last_lr", "min_lrs", "lr_lambdas")
"""The entries of a torch LR scheduler's state that hold one value per param group."""

StateDict = dict[str, Any]


def trainer_groups(model: nn.Module, decay_names: Collection[str]) -> list[list[Tensor]]:
    """The plain Trainer's param groups for `model`: trainable tensors it decays, then the others."""
    decay = set(decay_names)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [[p for n, p in trainable if n in decay], [p for n, p in trainable if n not in decay]]


def has_trainer_layout(opt: SonarOptimizer) -> bool:
    """Whether `opt`'s state is the plain Trainer's AdamW's (32-bit AdamW states, no matrix rule)."""
    return opt.rule.name == opt.expert_rule.name == "adamw" and opt.matrix_rule is None


def save_in_trainer_layout(
    checkpoint: Path, opt: SonarOptimizer, groups: Sequence[Sequence[Tensor]], weight_decay: float
) -> None:
    """Rewrite the `optimizer.pt` and `scheduler.pt` the Trainer saved from `opt` into its own layout
    (`groups`: `trainer_groups`; `weight_decay`: the arguments', which an empty decay group carries)."""
    plan = _Plan(opt, groups, weight_decay)
    optimizer = torch.load(checkpoint / OPTIMIZER_FILE, weights_only=True)
    torch.save(plan.to_trainer(optimizer), checkpoint / OPTIMIZER_FILE)
    if (checkpoint / SCHEDULER_FILE).is_file():
        scheduler = torch.load(checkpoint / SCHEDULER_FILE, weights_only=True)
        torch.save(plan.remap_scheduler(scheduler, plan.sonar_of_trainer), checkpoint / SCHEDULER_FILE)


def load_either_layout(
    checkpoint: Path,
    opt: SonarOptimizer,
    scheduler: Any,
    groups: Sequence[Sequence[Tensor]],
    map_location: Any,
) -> None:
    """Load `optimizer.pt` and `scheduler.pt` into `opt` and `scheduler`, from Sonar's layout (as is) or
    from the plain Trainer's (mapped tensor by tensor): every check runs before anything is loaded."""
    optimizer = torch.load(checkpoint / OPTIMIZER_FILE, map_location=map_location, weights_only=True)
    sched = torch.load(checkpoint / SCHEDULER_FILE, weights_only=True)
    if not all("name" in g for g in optimizer["param_groups"]):
        if not has_trainer_layout(opt):
            raise SonarUsageError(
                f"{checkpoint / OPTIMIZER_FILE} is a plain Trainer's AdamW state; model.sonar keeps other "
                f"states ({opt.cfg.name}, dense rule {opt.rule.name}, expert rule {opt.expert_rule.name}): "
                "only 32-bit AdamW states map onto it. Resume with AdamWConfig(state_bits=32)."
            )
        plan = _Plan(opt, groups, weight_decay=None)
        optimizer = plan.to_sonar(optimizer)
        sched = plan.remap_scheduler(sched, plan.trainer_of_sonar)
    opt.load_state_dict(optimizer)
    scheduler.load_state_dict(sched)


class _Plan:
    """Where each tensor and group of `opt` sits in the Trainer's layout, and back."""

    def __init__(
        self, opt: SonarOptimizer, groups: Sequence[Sequence[Tensor]], weight_decay: float | None
    ) -> None:
        self.opt = opt
        self.trainer_sizes = [len(g) for g in groups]
        self.trainer_decays = [weight_decay, 0.0]  # the Trainer's groups: decay, then no decay
        self.sonar_params = [p for g in opt.param_groups for p in g["params"]]
        self.trainer_params = [p for g in groups for p in g]
        mine, theirs = {id(p) for p in self.sonar_params}, {id(p) for p in self.trainer_params}
        if mine != theirs:
            raise SonarUsageError(
                f"model.sonar holds {len(mine)} tensors, the Trainer's AdamW would hold {len(theirs)} "
                f"({len(mine - theirs)} only in model.sonar, {len(theirs - mine)} only in the Trainer's "
                "groups): the checkpoint's optimizer state cannot be mapped tensor by tensor. Resume with "
                "the same trainable parameters the checkpoint was saved with."
            )
        group_of_sonar = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        group_of_trainer = {id(p): i for i, g in enumerate(groups) for p in g}
        # For each group of one layout: the groups of the other layout its tensors come from.
        self.sonar_of_trainer = [sorted({group_of_sonar[id(p)] for p in g}) for g in groups]
        self.trainer_of_sonar = [
            sorted({group_of_trainer[id(p)] for p in g["params"]}) for g in opt.param_groups
        ]

    def to_trainer(self, sd: StateDict) -> StateDict:
        index = {id(p): i for i, p in enumerate(self.trainer_params)}
        state = {index[id(self.sonar_params[i])]: s for i, s in sd["state"].items()}
        settings = [{k: v for k, v in g.items() if k not in ("params", "name")} for g in sd["param_groups"]]
        groups, start = [], 0
        for t, (sources, size) in enumerate(zip(self.sonar_of_trainer, self.trainer_sizes, strict=True)):
            merged = _settings(settings, sources, empty_decay=self.trainer_decays[t])
            groups.append({**merged, "params": list(range(start, start + size))})
            start += size
        return {"state": state, "param_groups": groups}

    def to_sonar(self, sd: StateDict) -> StateDict:
        groups = sd["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        if sizes != self.trainer_sizes:
            raise SonarUsageError(
                f"the checkpoint's optimizer state has param groups of {sizes} tensors; the Trainer's AdamW "
                f"over this model has groups of {self.trainer_sizes} (decay, no decay): it was saved for "
                "another model, another set of trainable parameters or another weight-decay rule."
            )
        index = {id(p): i for i, p in enumerate(self.sonar_params)}
        state = {index[id(self.trainer_params[i])]: s for i, s in sd["state"].items()}
        self._check_shapes(state)
        settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        ours, start, merged = self.opt.param_groups, 0, []
        for group, sources in zip(ours, self.trainer_of_sonar, strict=True):
            size = len(group["params"])
            # Sonar computes the fused kernel whatever the checkpoint's flags: its own torch keys stay.
            mine = {k: group[k] for k in self.opt.rule.torch_keys() if k in group}
            theirs = _settings(settings, sources, empty_decay=group["weight_decay"])
            merged.append(
                {**theirs, **mine, "name": group["name"], "params": list(range(start, start + size))}
            )
            start += size
        return {"state": state, "param_groups": merged}

    def remap_scheduler(self, sd: StateDict, sources: list[list[int]]) -> StateDict:
        """A scheduler's per-group entries (base LRs, last LRs) for the other layout's groups."""
        out = dict(sd)
        for key in _PER_GROUP:
            values = sd.get(key)
            if isinstance(values, list):
                out[key] = [_agreed(values, s or [0], f"scheduler.pt's {key}") for s in sources]
        return out

    def _check_shapes(self, state: dict[int, dict[str, Any]]) -> None:
        for i, s in state.items():
            param, moment = self.sonar_params[i], s.get("exp_avg")
            if isinstance(moment, Tensor) and moment.shape != param.shape:
                name = self.opt.expert_name(param) if self.opt.owns(param) else self.opt.dense_name(param)
                raise SonarUsageError(
                    f"the checkpoint's optimizer state for tensor {i} has shape {tuple(moment.shape)}, the "
                    f"model's parameter there ({name}) {tuple(param.shape)}: saved for another model."
                )


def _settings(
    groups: list[dict[str, Any]], sources: list[int], *, empty_decay: float | None
) -> dict[str, Any]:
    """The settings of a group whose tensors come from `sources` (groups of the other layout, which must
    agree); an empty group takes the first group's, with its own weight decay."""
    if sources:
        return dict(_agreed(groups, sources, "param group"))
    first = dict(groups[0])
    return first if empty_decay is None else {**first, "weight_decay": empty_decay}


def _agreed(values: Sequence[Any], sources: list[int], what: str) -> Any:
    """The one value `values` hold at `sources` (groups of one layout that become one group of the
    other), or a SonarUsageError naming what differs."""
    picked = [values[i] for i in sources]
    if all(v == picked[0] for v in picked[1:]):
        return picked[0]
    if all(isinstance(v, dict) for v in picked):
        keys = sorted(k for k in picked[0] if any(v.get(k) != picked[0][k] for v in picked[1:]))
        picked = [{k: v.get(k) for k in keys} for v in picked]
    raise SonarUsageError(
        f"{what} settings differ between groups whose tensors share one group in the other layout "
        f"({picked}): the Trainer's AdamW holds its tensors in a decay and a no-decay group. A "
        "checkpoint saved with another weight_decay than the TrainingArguments' now (or with groups "
        "changed by hand) cannot be mapped: resume with the arguments it was saved with."
    )


def load_converted_weights_(model: nn.Module, checkpoint: Path) -> list[str]:
    """Load, in place, the weights the Trainer's resume could not: those `save_pretrained` wrote in the
    checkpoint's original layout (transformers 5 saves batched MoE experts back as one tensor per
    expert, and the Trainer's resume loads keys as they are, so every expert tensor would silently keep
    its fresh value; `load_best_model_at_end` likewise). `from_pretrained` converts the layout, holding
    one more copy of the model in CPU memory meanwhile; the tensors are then copied into the model's own
    parameters, so Sonar's bindings and compiled graphs stay valid. Returns the names."""
    from transformers import PreTrainedModel

    saved = _checkpoint_keys(checkpoint)
    if saved is None:
        return []  # not a safetensors checkpoint: the Trainer's own load reported what it found
    state = model.state_dict()
    missing = [k for k in state if k not in saved]
    if not missing:
        return []
    if not isinstance(model, PreTrainedModel):
        raise RuntimeError(
            f"{checkpoint}: the checkpoint lacks {len(missing)} of the model's tensors (e.g. "
            f"{missing[:3]}) and {type(model).__name__} is not a PreTrainedModel, whose from_pretrained "
            "could convert them."
        )
    dtype = next(iter(state.values())).dtype
    converted = type(model).from_pretrained(
        checkpoint, config=model.config, dtype=dtype, local_files_only=True
    )
    source = converted.state_dict()
    absent = [k for k in missing if k not in source]
    if absent:
        raise RuntimeError(f"{checkpoint}: the checkpoint holds no value for {absent[:3]}; cannot resume.")
    with torch.no_grad():
        for key in missing:
            state[key].copy_(source[key])
    return missing


def _checkpoint_keys(checkpoint: Path) -> set[str] | None:
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return set(f.keys())
