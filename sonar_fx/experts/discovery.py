"""Find the batched expert tensors of a model.

Three sources, in order: an explicit list from the user (parameters or names), transformers 5.x
experts modules (`gate_up_proj` (E, 2n, d) and `down_proj` (E, d, n): OLMoE, GraniteMoe, Mixtral,
Qwen3-MoE and any model with that layout), and the project's own reference MoE block (same names).
Discovery only reads the model; it never wraps, moves or copies a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

UP_NAMES = ("gate_up_proj", "w_up")
DOWN_NAMES = ("down_proj", "w_down")


@dataclass(frozen=True)
class ExpertTensor:
    """One batched expert tensor: a parameter whose leading dimension indexes the E experts."""

    name: str
    """Fully qualified parameter name in the model."""
    param: nn.Parameter
    role: str
    """"up" (E, 2n, d), "down" (E, d, n), or "expert" when given explicitly with no known role."""

    @property
    def num_experts(self) -> int:
        return int(self.param.shape[0])


@dataclass(frozen=True)
class ExpertLayer:
    """The expert tensors of one MoE layer (its gradients are freed together)."""

    name: str
    """Qualified name of the module that owns the tensors."""
    tensors: tuple[ExpertTensor, ...]
    layout: str
    """How the tensors are laid out, e.g. "gate_up(E,2n,d)+down(E,d,n)"."""

    @property
    def num_experts(self) -> int:
        return self.tensors[0].num_experts

    def grad_bytes(self) -> int:
        """Bytes of this layer's expert gradients (same dtype and shape as the parameters)."""
        return sum(t.param.numel() * t.param.element_size() for t in self.tensors)


class NoExpertsFoundError(ValueError):
    """Raised when a model has no batched expert tensors that discovery recognises."""


def discover_experts(
    model: nn.Module, experts: Iterable[nn.Parameter | str] | None = None
) -> list[ExpertLayer]:
    """The model's MoE layers and their batched expert tensors, in module order."""
    named = dict(model.named_parameters())
    layers = _explicit_layers(named, list(experts)) if experts is not None else _module_layers(model)
    if not layers:
        raise NoExpertsFoundError(_nothing_found_message(named))
    return layers


def _module_layers(model: nn.Module) -> list[ExpertLayer]:
    layers = []
    for module_name, module in model.named_modules():
        up = _first_3d(module, UP_NAMES)
        down = _first_3d(module, DOWN_NAMES)
        if up is None or down is None:
            continue
        (up_attr, up_p), (down_attr, down_p) = up, down
        if up_p.shape[0] != down_p.shape[0]:
            continue
        prefix = f"{module_name}." if module_name else ""
        tensors = (
            ExpertTensor(prefix + up_attr, up_p, "up"),
            ExpertTensor(prefix + down_attr, down_p, "down"),
        )
        layout = f"{up_attr}(E,2n,d)+{down_attr}(E,d,n)"
        layers.append(ExpertLayer(module_name, tensors, layout))
    return layers


def _first_3d(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Parameter] | None:
    for attr in names:
        p = module._parameters.get(attr)
        if p is not None and p.dim() == 3 and p.requires_grad:
            return attr, p
    return None


def _explicit_layers(named: dict[str, nn.Parameter], experts: list[nn.Parameter | str]) -> list[ExpertLayer]:
    by_id = {id(p): n for n, p in named.items()}
    by_module: dict[str, list[ExpertTensor]] = {}
    for item in experts:
        if isinstance(item, str):
            if item not in named:
                raise ValueError(f"experts=: {item!r} is not a parameter name of this model.")
            name, param = item, named[item]
        elif isinstance(item, Tensor):
            if id(item) not in by_id:
                raise ValueError("experts=: a tensor given is not a parameter of this model.")
            name, param = by_id[id(item)], item
        else:
            raise TypeError(f"experts= takes parameters or names, got {type(item).__name__}.")
        if param.dim() < 2:
            raise ValueError(
                f"experts=: {name} has shape {tuple(param.shape)}; expected a batched (E, ...) tensor."
            )
        role = "up" if name.endswith(UP_NAMES) else "down" if name.endswith(DOWN_NAMES) else "expert"
        by_module.setdefault(name.rpartition(".")[0], []).append(ExpertTensor(name, param, role))
    if len({id(t.param) for ts in by_module.values() for t in ts}) != len(experts):
        raise ValueError("experts=: the same parameter is listed twice.")
    return [ExpertLayer(m, tuple(ts), "explicit") for m, ts in by_module.items()]


def _nothing_found_message(named: dict[str, nn.Parameter]) -> str:
    seen = [f"  {n}: {tuple(p.shape)}" for n, p in named.items() if p.dim() == 3]
    listing = "\n".join(seen) if seen else "  (none)"
    return (
        "No batched expert tensors found: expected modules with 3-D parameters "
        f"{'/'.join(UP_NAMES)} (E, 2n, d) and {'/'.join(DOWN_NAMES)} (E, d, n).\n"
        f"3-D parameters in this model:\n{listing}\n"
        "Pass them explicitly: sonar_fx.compile(model, cfg, experts=[...names or parameters...])."
    )
