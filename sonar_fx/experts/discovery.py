"""Find the expert tensors of a model: by structure, or from an explicit list.

Two sources: an explicit list from the user (`experts=`: parameters or names), or the model's
structure (`sonar_fx.experts.structure`: any module that declares an expert count and owns per-expert
tensors, whatever their names; transformers' experts modules, gated or not, biased or not; per-expert
linear modules grouped into one layer; fused 2-D layouts). Policy for per-expert biases and other
small per-expert tensors: `expert_biases="experts"` (the default: they belong to their experts, are
updated in backward with them and are never clipped) or `"dense"` (clipped and updated at `step()`
with the dense parameters). Shared experts are dense by design: they see every token, so their
gradients are not the routed, per-expert ones Sonar frees early. Frozen tensors are left out of a
layer, with a warning when the layer is only partly frozen. The result, as an `ExpertSet`, is the one
place that says which parameters are experts and which are dense (`ExpertSet.split`).
Discovery only reads the model; it never wraps, moves or copies a parameter.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from torch import Tensor, nn

from sonar_fx.experts.structure import Found, chain_roles, declared_counts, find_in_module

ExpertBiases = Literal["experts", "dense"]
EXPERT_BIASES = ("experts", "dense")
DEFAULT_EXPERT_BIASES: ExpertBiases = "experts"


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor: a parameter laid out per expert."""

    name: str
    """Fully qualified parameter name in the model."""
    param: nn.Parameter
    role: str
    """"up" ((gate_)up projection), "down", "bias" (a per-expert bias or other small per-expert tensor),
    "weight" (a per-expert weight of no known role) or "expert" (given explicitly)."""
    expert_shape: tuple[int, ...] = ()
    """The tensor as (E, ...): its own shape, or its exact (E, n, d) view for a fused 2-D weight."""

    def __post_init__(self) -> None:
        if not self.expert_shape:
            object.__setattr__(self, "expert_shape", tuple(self.param.shape))

    @property
    def num_experts(self) -> int:
        return int(self.expert_shape[0])


@dataclass(frozen=True)
class ExpertLayer:
    """The expert tensors of one MoE layer (its gradients are freed together)."""

    name: str
    """Qualified name of the module that owns the tensors (their common parent when grouped)."""
    tensors: tuple[ExpertTensor, ...]
    layout: str
    """How the tensors were recognised: "transformers", "batched", "parallel_linear", "fused_2d" or
    "explicit"."""
    experts: int = 0
    """E: routed experts that compute (0: the first tensor's leading dimension)."""
    frozen: tuple[str, ...] = ()
    """Expert tensors of this layer left out because they do not require grad."""
    dense_biases: tuple[str, ...] = ()
    """Per-expert biases left to the dense group (`expert_biases="dense"`)."""
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def num_experts(self) -> int:
        return self.experts or self.tensors[0].num_experts

    def grad_bytes(self) -> int:
        """Bytes of this layer's expert gradients on this rank (same dtype and shape as the parameters;
        an FSDP2 DTensor counts its local shard)."""
        return sum(_local(t.param).numel() * t.param.element_size() for t in self.tensors)

    def describe(self) -> dict[str, Any]:
        """What was found, as plain data (for reports, `sonar-fx inspect`, JSON)."""
        return {
            "layer": self.name,
            "layout": self.layout,
            "num_experts": self.num_experts,
            "tensors": [
                {
                    "name": t.name,
                    "role": t.role,
                    "shape": list(t.param.shape),
                    "expert_shape": list(t.expert_shape),
                    "dtype": str(t.param.dtype).removeprefix("torch."),
                }
                for t in self.tensors
            ],
            "frozen": list(self.frozen),
            "dense_biases": list(self.dense_biases),
            "grad_bytes": self.grad_bytes(),
            "notes": list(self.notes),
        }


class NoExpertsFoundError(ValueError):
    """Raised when a model has no expert tensors that discovery recognises."""


@dataclass(frozen=True)
class Split:
    """A model's trainable parameters as (name, parameter), in the model's order, split by an
    `ExpertSet` into dense and expert ones."""

    trainable: list[tuple[str, nn.Parameter]]
    dense: list[tuple[str, nn.Parameter]]
    experts: list[tuple[str, nn.Parameter]]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.trainable]

    @property
    def dense_params(self) -> list[nn.Parameter]:
        return [p for _, p in self.dense]

    @property
    def expert_params(self) -> list[nn.Parameter]:
        return [p for _, p in self.experts]


@dataclass(frozen=True)
class ExpertSet:
    """A model's expert tensors, layer by layer: the one answer to "which parameters are experts".

    Everything that separates experts from dense parameters asks this object (`split`, `names_by_id`),
    so the rule is written once. It holds the parameter objects themselves: after an engine replaces them
    (FSDP2's `fully_shard` swaps in DTensors), discover again.
    """

    layers: tuple[ExpertLayer, ...]

    @classmethod
    def discover(
        cls,
        model: nn.Module,
        experts: Iterable[nn.Parameter | str] | None = None,
        *,
        expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
    ) -> ExpertSet:
        """The expert set of `model` (`discover_experts`: by structure, or the explicit `experts`)."""
        return cls(tuple(discover_experts(model, experts, expert_biases=expert_biases)))

    @property
    def tensors(self) -> list[ExpertTensor]:
        return [t for layer in self.layers for t in layer.tensors]

    @property
    def params(self) -> list[nn.Parameter]:
        """Expert parameters in discovery order (layer by layer)."""
        return [t.param for t in self.tensors]

    @property
    def names(self) -> list[str]:
        """Qualified names (as `model.named_parameters()` spells them), in discovery order."""
        return [t.name for t in self.tensors]

    def names_by_id(self) -> dict[int, str]:
        """id(parameter) -> name; computed on each call, so a copied set never answers with stale ids."""
        return {id(t.param): t.name for t in self.tensors}

    def split(self, model: nn.Module) -> Split:
        """`model`'s trainable parameters in its own order, split into dense and expert ones."""
        ids = self.names_by_id()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dense = [(n, p) for n, p in trainable if id(p) not in ids]
        return Split(trainable, dense, [(n, p) for n, p in trainable if id(p) in ids])


def discover_experts(
    model: nn.Module,
    experts: Iterable[nn.Parameter | str] | None = None,
    *,
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
) -> list[ExpertLayer]:
    """The model's MoE layers and their expert tensors, in module order."""
    if expert_biases not in EXPERT_BIASES:
        raise ValueError(f"expert_biases={expert_biases!r}: expected 'experts' or 'dense'.")
    named = dict(model.named_parameters())
    if experts is not None:
        layers = _explicit_layers(named, list(experts))
    else:
        layers = structural_layers(model, expert_biases=expert_biases)
        _warn_partly_frozen(layers)
        layers = [layer for layer in layers if layer.tensors]
    if not layers:
        raise NoExpertsFoundError(_nothing_found_message(model, named))
    return layers


def structural_layers(
    model: nn.Module, *, expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES
) -> list[ExpertLayer]:
    """Every expert layer the structure shows, fully frozen ones included (with no tensors)."""
    found = [(name, module, f) for name, module in model.named_modules() if (f := find_in_module(module))]
    layers = []
    for owner, group in _group_parallel_linears(found):
        layers.append(_layer(owner, group, expert_biases))
    return layers


def _group_parallel_linears(
    found: list[tuple[str, nn.Module, Found]],
) -> list[tuple[str, list[tuple[str, nn.Module, Found]]]]:
    """One entry per layer: siblings holding one (E, out, in) weight each become one layer, named
    after their parent (JetMoE: `mlp.input_linear` + `mlp.output_linear` -> `mlp`)."""
    grouped: dict[str, list[tuple[str, nn.Module, Found]]] = {}
    for name, module, f in found:
        if f.kind == "parallel_linear":
            parent = name.rpartition(".")[0]
            grouped.setdefault(f"parallel:{parent}", []).append((name, module, f))
        else:
            grouped[f"module:{name}"] = [(name, module, f)]
    out = []
    for key, group in grouped.items():
        kind, _, owner = key.partition(":")
        if kind == "parallel" and (len(group) == 1 or len({f.num_experts for _, _, f in group}) > 1):
            out += [(item[0], [item]) for item in group]  # alone, or different E: a layer each
        else:
            out.append((owner, group))
    return out


def _layer(owner: str, group: list[tuple[str, nn.Module, Found]], expert_biases: ExpertBiases) -> ExpertLayer:
    tensors, frozen, dense_biases, notes = [], [], [], []
    for module_name, module, f in group:
        prefix = f"{module_name}." if module_name else ""
        entries = [(a, role, shape) for a, role, shape in f.weights]
        entries += [(a, "bias", ()) for a in f.biases]
        for attr, role, shape in entries:
            param = module._parameters[attr]
            assert param is not None
            name = prefix + attr
            if not param.requires_grad:
                frozen.append(name)
            elif role == "bias" and expert_biases == "dense":
                dense_biases.append(name)
            else:
                tensors.append(ExpertTensor(name, param, role, tuple(shape)))
        notes += [n for n in f.notes if n not in notes]
    kind = group[0][2].kind
    if kind == "parallel_linear":
        tensors = _chain_roles(tensors)
        notes.append(
            f"{len(group)} per-expert linear modules ({type(group[0][1]).__name__}) grouped as one layer"
        )
    return ExpertLayer(
        owner, tuple(tensors), kind, group[0][2].num_experts, tuple(frozen), tuple(dense_biases), tuple(notes)
    )


def _chain_roles(tensors: list[ExpertTensor]) -> list[ExpertTensor]:
    """Up/down roles for a pair of per-expert linear weights that chain into each other."""
    weights = {t.name: t.expert_shape for t in tensors if t.role == "weight"}
    roles = chain_roles(weights)
    return [replace(t, role=roles.get(t.name, t.role)) for t in tensors]


def _warn_partly_frozen(layers: list[ExpertLayer]) -> None:
    partly = [layer for layer in layers if layer.frozen and layer.tensors]
    if not partly:
        return
    lines = "; ".join(
        f"{layer.name}: frozen {', '.join(layer.frozen)}, trained {', '.join(t.name for t in layer.tensors)}"
        for layer in partly
    )
    warnings.warn(
        f"Partly frozen expert layers ({lines}). The frozen tensors get no update; the trained ones stay "
        "expert tensors (updated in backward, not clipped with the dense gradients). To train them as dense "
        "parameters instead, list the expert tensors yourself with experts=[...].",
        stacklevel=3,
    )


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
        if not param.requires_grad:
            raise ValueError(f"experts=: {name} does not require grad (frozen); leave it out of experts=.")
        by_module.setdefault(name.rpartition(".")[0], []).append(ExpertTensor(name, param, "expert"))
    if len({id(t.param) for ts in by_module.values() for t in ts}) != len(experts):
        raise ValueError("experts=: the same parameter is listed twice.")
    return [ExpertLayer(m, tuple(ts), "explicit") for m, ts in by_module.items()]


def _nothing_found_message(model: nn.Module, named: dict[str, nn.Parameter]) -> str:
    frozen = [layer for layer in structural_layers(model) if layer.frozen and not layer.tensors]
    if frozen:
        return (
            f"Every expert tensor of this model is frozen ({len(frozen)} layers, e.g. "
            f"{frozen[0].frozen[0]}): Sonar has nothing to update in backward. Train it with a plain "
            "torch.optim.AdamW."
        )
    seen = [f"  {n}: {tuple(p.shape)}" for n, p in named.items() if p.dim() == 3]
    listing = "\n".join(seen) if seen else "  (none)"
    declaring = _modules_declaring_experts(model)
    return (
        "No expert tensors found. Discovery looks for a module that declares its number of experts E (an "
        "int attribute such as num_experts) and owns per-expert weights: batched (E, out, in) tensors, "
        "one (E, out, in) weight per linear module, or fused 2-D (E*n, d) weights; or a module owning two "
        "or more 3-D tensors with the same leading dimension. Per-expert tensors of exactly (E, d) (e.g. "
        "embedding-style experts) are never taken: routers have that shape too.\n"
        f"3-D parameters in this model:\n{listing}\n{declaring}"
        "Pass them explicitly: sonar_fx.compile(model, cfg, experts=[...names or parameters...])."
    )


def _modules_declaring_experts(model: nn.Module) -> str:
    """Modules that declare an expert count, with their parameters: where a user finds `experts=`."""
    declaring = {n: m for n, m in model.named_modules() if declared_counts(m)}
    innermost = [n for n in declaring if not any(o.startswith(f"{n}.") or (not n and o) for o in declaring)]
    lines = []
    for name in innermost[:8]:
        module = declaring[name]
        counts = declared_counts(module)
        params = [(n, tuple(p.shape)) for n, p in module.named_parameters() if p.dim() >= 2]
        if params:
            listed = ", ".join(f"{n} {s}" for n, s in params[:6])
            lines.append(f"  {name or '(model)'} ({type(module).__name__}, E={sorted(counts)}): {listed}")
    if not lines:
        return ""
    return "Modules that declare an expert count, and their parameters:\n" + "\n".join(lines) + "\n"


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (what this rank's memory holds); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
