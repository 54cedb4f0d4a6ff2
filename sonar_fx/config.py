"""Optimizer configuration shared by every training method: which element-wise optimizer, its
hyper-parameters, how gradients are clipped and how expert optimizer states are stored.

Frozen, keyword-only dataclasses: the one place where hyper-parameters are validated. Sonar's argument
holds for any optimizer whose update of a tensor needs only that tensor's gradient, so each config
here names one: `AdamWConfig` (the paper's), `AdamConfig` (L2 decay), `SGDConfig`, `LionConfig`, and
`MuonConfig`, which is matrix-wise but still per tensor: each expert matrix's update needs that
matrix's momentum alone. They never hold tensors or model state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias

from sonar_fx.config_options import refuse_unknown_options

ExpertClip = Literal["per_tensor", "global"] | None
EXPERT_CLIPS: tuple[ExpertClip, ...] = (None, "per_tensor", "global")
StateBits = Literal[32, 8, 4]
STATE_BITS: tuple[int, ...] = (32, 8, 4)
KeepBudget = int | Literal["auto"]


@dataclass(frozen=True, kw_only=True)
class WeightDecayGroup:
    """Parameters, by the model's names (`model.named_parameters()`), that take their own weight decay
    instead of the config's `weight_decay`: what a torch.optim param group with its own `weight_decay`
    expresses (e.g. biases and norm weights at 0.0, as transformers' Trainer groups them)."""

    params: tuple[str, ...]
    """Names of trainable parameters, dense or expert; each in at most one group."""
    weight_decay: float
    """Their weight decay, >= 0."""

    def __post_init__(self) -> None:
        # One name or any iterable of names, kept as a tuple: the config stays hashable.
        names = (self.params,) if isinstance(self.params, str) else tuple(self.params)
        object.__setattr__(self, "params", names)


class ConfigFieldError(ValueError):
    """A config value is invalid; `field` names it, so a caller can name its own flag for it."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True)
class _OptimizerConfig:
    """Fields every optimizer shares: LR, weight decay and clipping."""

    lr: float = 2e-5
    """Peak learning rate; an LR scheduler on `SonarOptimizer` scales both groups from it."""
    weight_decay: float = 0.0
    """Weight decay, >= 0 (decoupled for AdamW and Lion, added to the gradient for Adam and SGD)."""
    max_grad_norm: float | None = 1.0
    """Global-norm clip of the DENSE gradients at `step()` (and the threshold of `expert_clip`); None or
    inf turns clipping off."""
    weight_decay_groups: tuple[WeightDecayGroup, ...] = ()
    """Parameters with a weight decay of their own (see `WeightDecayGroup`); each group becomes a param
    group of `SonarOptimizer` beside the one it was split from, so a scheduler drives it too."""
    expert_clip: ExpertClip = None
    """How expert gradients are clipped to `max_grad_norm`: None (the paper: not at all; the dense
    clip covers dense gradients only), "per_tensor" (each batched expert gradient by its own norm,
    inside its update) or "global" (one norm over dense AND expert gradients, exactly as standard
    training clips; costs a second forward and backward: `SonarOptimizer.backward(closure)` runs
    both)."""
    keep_budget: KeepBudget = 0
    """schedule="deferred" with expert_clip="global" (or `model.sonar.clip_grad_norm_`, a GradScaler,
    nonfinite="skip"): bytes of expert gradients the norm pass may keep for the update pass instead of
    computing them again (those the update pass reaches first; a gradient already held whole, e.g.
    past its crossover, counts against it). 0: none kept, each computed twice (one gradient alive at a
    time); "auto": the CUDA caching allocator's free memory at each step less a stated margin
    (`sonar_fx.optim.keep_budget`; refused on CPU). Exact at every budget."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Before the dataclass's own __init__: a torch optimizer's keyword (maximize=, ...) is refused
        # naming the alternative, not with a bare "unexpected keyword argument".
        refuse_unknown_options(cls.__name__, {f.name for f in fields(cls) if f.init}, kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._check(self.lr >= 0 and math.isfinite(self.lr), "lr", self.lr, "a finite number >= 0")
        self._check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        self._check_weight_decay_groups()
        if self.max_grad_norm is not None:
            self._check(
                self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "> 0, or None for no clip"
            )
        self._check(
            self.expert_clip in EXPERT_CLIPS,
            "expert_clip",
            self.expert_clip,
            "None, 'per_tensor' or 'global'",
        )
        self._check(
            self.expert_clip is None or self.clips,
            "expert_clip",
            self.expert_clip,
            "None when max_grad_norm is None (there is no threshold to clip expert gradients to)",
        )
        self._check_keep_budget()

    @property
    def clips(self) -> bool:
        """Whether `step()` clips the dense gradients."""
        return self.max_grad_norm is not None and math.isfinite(self.max_grad_norm)

    @property
    def name(self) -> str:
        """The optimizer's name as the command line spells it (`--optimizer`)."""
        return type(self).__name__.removesuffix("Config").lower()

    def _check(self, ok: bool, field: str, value: object, expected: str) -> None:
        if not ok:
            raise ConfigFieldError(
                f"{type(self).__name__}.{field}={value!r} is invalid: expected {expected}.",
                field=field.split("[")[0],
            )

    def _check_keep_budget(self) -> None:
        budget = self.keep_budget
        if budget == "auto":
            return
        # bool is an int: keep_budget=True would read as one byte
        whole = isinstance(budget, int) and not isinstance(budget, bool)
        self._check(
            whole and budget >= 0,
            "keep_budget",
            budget,
            "a whole number of bytes >= 0 (0: keep none), or 'auto' (CUDA: the caching allocator's free "
            "memory less a margin)",
        )

    def _check_weight_decay_groups(self) -> None:
        groups = tuple(self.weight_decay_groups)
        seen: set[str] = set()
        for i, group in enumerate(groups):
            where = f"weight_decay_groups[{i}]"
            self._check(isinstance(group, WeightDecayGroup), where, group, "a sonar_fx.WeightDecayGroup")
            self._check(group.weight_decay >= 0, f"{where}.weight_decay", group.weight_decay, "a number >= 0")
            twice = sorted(seen.intersection(group.params))
            self._check(not twice, f"{where}.params", twice, "names in no other group")
            seen.update(group.params)
        object.__setattr__(self, "weight_decay_groups", groups)

    def _check_betas(self, betas: tuple[float, float]) -> None:
        values = tuple(betas)
        self._check(len(values) == 2, "betas", betas, "a pair (beta1, beta2)")
        for i, b in enumerate(values):
            self._check(0.0 <= b < 1.0, f"betas[{i}]", b, "in [0, 1)")
        object.__setattr__(self, "betas", (float(values[0]), float(values[1])))


@dataclass(frozen=True, kw_only=True)
class _AdamFamilyConfig(_OptimizerConfig):
    betas: tuple[float, float] = (0.9, 0.95)
    """Exponential decay rates of the first and second moments, each in [0, 1)."""
    eps: float = 1e-8
    """Denominator term, > 0."""
    state_bits: StateBits = 32
    """Bits per element of the EXPERT tensors' moments: 32 (the param's dtype, torch's fused kernel)
    or 8 / 4 (torchao's block-quantized states, `pip install torchao`)."""
    dense_state_bits: StateBits = 32
    """The same for the DENSE tensors' moments (updated at `step()`): 8 with `state_bits=8` keeps every
    state in 8 bits (torchao's AdamW8bit for all parameters)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_betas(self.betas)
        self._check(self.eps > 0 and math.isfinite(self.eps), "eps", self.eps, "a finite number > 0")
        self._check(self.state_bits in STATE_BITS, "state_bits", self.state_bits, "32, 8 or 4")
        self._check(
            self.dense_state_bits in STATE_BITS, "dense_state_bits", self.dense_state_bits, "32, 8 or 4"
        )


@dataclass(frozen=True, kw_only=True)
class AdamWConfig(_AdamFamilyConfig):
    """AdamW (decoupled weight decay), the paper's optimizer, for dense and expert tensors alike."""


@dataclass(frozen=True, kw_only=True)
class AdamConfig(_AdamFamilyConfig):
    """Adam with L2 weight decay (`weight_decay * param` is added to the gradient), as torch.optim.Adam."""


@dataclass(frozen=True, kw_only=True)
class SGDConfig(_OptimizerConfig):
    """SGD with momentum, dampening, Nesterov momentum and L2 weight decay, as torch.optim.SGD."""

    lr: float = 1e-3
    momentum: float = 0.0
    """Momentum factor, >= 0 (0: plain SGD, no momentum buffer)."""
    dampening: float = 0.0
    """Dampening of the momentum, in [0, 1]."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(self.momentum >= 0 and math.isfinite(self.momentum), "momentum", self.momentum, ">= 0")
        self._check(0.0 <= self.dampening <= 1.0, "dampening", self.dampening, "in [0, 1]")
        self._check(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "nesterov",
            self.nesterov,
            "False unless momentum > 0 and dampening == 0",
        )


@dataclass(frozen=True, kw_only=True)
class LionConfig(_OptimizerConfig):
    """Lion (sign of an interpolated momentum; decoupled weight decay), Chen et al. 2023."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.99)
    """beta1 interpolates the update direction, beta2 the momentum; each in [0, 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_betas(self.betas)


MuonRouters = Literal["adamw", "muon"]
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's default Newton-Schulz coefficients (a, b, c)."""


@dataclass(frozen=True, kw_only=True)
class MuonConfig(_OptimizerConfig):
    """Muon for matrices (torch.optim.Muon's hyper-parameters and defaults), AdamW for the rest.

    Expert tensors get Muon per expert matrix inside backward; dense hidden 2-D matrices get Muon at
    `step()`; embeddings, the output head, routers (see `routers`), norms, biases and any tensor that
    is not 2-D get AdamW at `step()` (the `adamw_*` fields). `sonar_fx.optim.matrices` decides which
    dense tensors are hidden matrices; docs/muon.md gives the recipe and the matrix orientation.
    """

    lr: float = 1e-3
    """Muon's LR (expert and hidden matrices); also AdamW's unless `adamw_lr` is set. An LR scheduler
    scales every group from its own starting LR."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices (`p *= 1 - lr * weight_decay`, with the unadjusted LR);
    also AdamW's unless `adamw_weight_decay` is set."""
    momentum: float = 0.95
    """Momentum factor, >= 0: `buf.lerp_(grad, 1 - momentum)`, as torch.optim.Muon keeps it."""
    nesterov: bool = True
    """Orthogonalise `grad.lerp(buf, momentum)` (True) or the momentum buffer itself (False)."""
    ns_coefficients: tuple[float, float, float] = MUON_NS_COEFFICIENTS
    """Coefficients (a, b, c) of the quintic Newton-Schulz iteration."""
    eps: float = 1e-7
    """Floor of the Frobenius norm the iteration's input is divided by, > 0."""
    ns_steps: int = 5
    """Newton-Schulz iterations, in [1, 100)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    """How a matrix's (A, B) shape scales its LR: None or "original" (`sqrt(max(1, A / B))`), or
    "match_rms_adamw" (`0.2 * sqrt(max(A, B))`). A and B are each expert matrix's rows and columns
    as stored: (2n, d) for gate_up, (d, n) for down in transformers' layout (see docs/muon.md)."""
    routers: MuonRouters = "adamw"
    """Routers ((E, d) weights beside an experts module): "adamw" (the default recipe) or "muon"."""
    adamw_lr: float | None = None
    """LR of the AdamW tensors; None: `lr`."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1)."""
    adamw_eps: float = 1e-8
    """AdamW's denominator term, > 0."""
    adamw_weight_decay: float | None = None
    """AdamW's decoupled weight decay; None: `weight_decay`."""
    state_bits: Literal[32] = 32
    """Muon keeps its momentum in the parameter's dtype: only 32 (no low-bit state reproduces it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(self.momentum >= 0 and math.isfinite(self.momentum), "momentum", self.momentum, ">= 0")
        coefficients = tuple(self.ns_coefficients)
        self._check(
            len(coefficients) == 3 and all(math.isfinite(c) for c in coefficients),
            "ns_coefficients", self.ns_coefficients, "three finite numbers (a, b, c)",
        )  # fmt: skip
        object.__setattr__(self, "ns_coefficients", tuple(float(c) for c in coefficients))
        self._check(self.eps > 0 and math.isfinite(self.eps), "eps", self.eps, "a finite number > 0")
        self._check(1 <= self.ns_steps < 100, "ns_steps", self.ns_steps, "an integer in [1, 100)")
        self._check(
            self.adjust_lr_fn in (None, "original", "match_rms_adamw"),
            "adjust_lr_fn", self.adjust_lr_fn, "None, 'original' or 'match_rms_adamw'",
        )  # fmt: skip
        self._check(self.routers in ("adamw", "muon"), "routers", self.routers, "'adamw' or 'muon'")
        if self.adamw_lr is not None:
            ok = self.adamw_lr >= 0 and math.isfinite(self.adamw_lr)
            self._check(ok, "adamw_lr", self.adamw_lr, "a finite number >= 0, or None for lr")
        if self.adamw_weight_decay is not None:
            ok = self.adamw_weight_decay >= 0
            self._check(ok, "adamw_weight_decay", self.adamw_weight_decay, ">= 0, or None for weight_decay")
        self._check(self.adamw_eps > 0 and math.isfinite(self.adamw_eps), "adamw_eps", self.adamw_eps, "> 0")
        values = tuple(self.adamw_betas)
        self._check(len(values) == 2, "adamw_betas", self.adamw_betas, "a pair (beta1, beta2)")
        for i, b in enumerate(values):
            self._check(0.0 <= b < 1.0, f"adamw_betas[{i}]", b, "in [0, 1)")
        object.__setattr__(self, "adamw_betas", (float(values[0]), float(values[1])))
        self._check(
            self.state_bits == 32, "state_bits", self.state_bits,
            "32: Muon's momentum has no low-bit form here (low-bit states are AdamWConfig/AdamConfig's)",
        )  # fmt: skip

    @property
    def adamw(self) -> AdamWConfig:
        """The AdamW half of the recipe (embeddings, head, routers, norms, biases), as its own config."""
        return AdamWConfig(
            lr=self.lr if self.adamw_lr is None else self.adamw_lr,
            betas=self.adamw_betas,
            eps=self.adamw_eps,
            weight_decay=self.weight_decay if self.adamw_weight_decay is None else self.adamw_weight_decay,
            max_grad_norm=self.max_grad_norm,
            expert_clip=self.expert_clip,
        )


OptimizerConfig: TypeAlias = AdamWConfig | AdamConfig | SGDConfig | LionConfig | MuonConfig
"""Any optimizer configuration Sonar accepts."""
OPTIMIZER_CONFIGS: dict[str, type[OptimizerConfig]] = {
    "adamw": AdamWConfig,
    "adam": AdamConfig,
    "sgd": SGDConfig,
    "lion": LionConfig,
    "muon": MuonConfig,
}
"""`--optimizer` name -> config class."""
