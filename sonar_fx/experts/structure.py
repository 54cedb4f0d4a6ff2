"""Recognise expert tensors by the structure of a module, never by parameter names.

For: `discovery.discover_experts`. A module holds experts when it declares an expert count E (an int
attribute such as `num_experts`, or transformers' `use_experts_implementation` flags) and owns, as its
own parameters, tensors laid out per expert:
- batched 3-D weights with a leading dimension that is a declared count: (E, out, in) or transposed,
  gated (gate_up) or not (up), including the extra rows of zero-computation experts (LongCat-Flash:
  gate_up has E + Z rows where down has E);
- per-expert linear modules, one (E, out, in) `weight` each (JetMoE's `ParallelExperts`): each is found
  here alone and `discovery` groups the ones sharing a parent into one layer;
- fused 2-D weights (E*n, d) (DBRX `w1`, `v1`, `w2`): the rows of expert e are e*n..(e+1)*n-1, so the
  tensor IS its (E, n, d) view and an element-wise update of the whole tensor is exact. A 2-D weight
  with exactly E rows is not taken: routers have that shape too;
- per-expert biases and other small per-expert tensors: (E, k) or (E,) beside the weights.
A module with no declared count still counts when it owns two or more 3-D tensors with the same
leading dimension >= 2 (a user's own experts module). A module that says it holds one rank's share of
the experts (`holds_expert_shard`, expert parallelism's) counts its local experts, one included: with
as many experts as ranks each rank's batched weights are (1, out, in). Convolutions never count (their
weights are 3-D). This module only reads modules; it never changes one, and it does not trace the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_COUNT_WORD = "expert"
# Attribute names that hold a per-expert SIZE or a routing knob, not a number of experts.
_NOT_A_COUNT = ("per_tok", "per_token", "top", "shared", "group", "dim", "size", "capacity", "layer")


@dataclass(frozen=True)
class Found:
    """Expert tensors of one module, before discovery applies the bias policy and freezing."""

    kind: str
    """"transformers" (a `use_experts_implementation` module), "batched", "parallel_linear" (one
    (E, out, in) weight; grouped with its siblings later) or "fused_2d"."""
    num_experts: int
    """E: routed experts that compute (zero-computation experts excluded)."""
    weights: tuple[tuple[str, str, tuple[int, ...]], ...]
    """(attribute, role, expert view shape) of each weight; role "up", "down" or "weight"."""
    biases: tuple[str, ...]
    """Attributes of per-expert biases and other small per-expert tensors."""
    notes: tuple[str, ...] = ()


def declared_counts(module: nn.Module) -> set[int]:
    """Expert counts (>= 2) the module declares in int attributes named like `num_experts`."""
    counts = set()
    for attr, value in vars(module).items():
        name = attr.lower()
        if _COUNT_WORD not in name or any(word in name for word in _NOT_A_COUNT):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            counts.add(value)
    return counts


def find_in_module(module: nn.Module) -> Found | None:
    """The expert tensors `module` owns directly, or None."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return None
    if is_transformers_experts(module):
        return _transformers_experts(module)
    counts = declared_counts(module)
    return _batched(module, counts | shard_count(module)) or (_fused_2d(module, counts) if counts else None)


def shard_count(module: nn.Module) -> set[int]:
    """The local expert count (>= 1) of a module that declares it holds one rank's share of the experts.

    A count of 1 is no evidence of experts on an ordinary module (every linear layer holds "one"), so
    `declared_counts` leaves it out; an expert-parallel shard declares its layout (the class attribute
    `holds_expert_shard`), and there one local expert per rank is the ordinary case, not a guess."""
    if getattr(type(module), "holds_expert_shard", False) is not True:
        return set()
    local = getattr(module, "num_experts", None)
    return {local} if isinstance(local, int) and not isinstance(local, bool) and local >= 1 else set()


def _own_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {a: p for a, p in module._parameters.items() if p is not None}


def is_transformers_experts(module: nn.Module) -> bool:
    # `transformers.integrations.moe.use_experts_implementation` sets these four flags on every instance.
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    return all(isinstance(getattr(module, f, None), bool) for f in flags)


def _transformers_experts(module: nn.Module) -> Found | None:
    """The tensors the experts interface reads: (gate_)up_proj, down_proj and their biases."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    params = _own_params(module)
    if up not in params or "down_proj" not in params:
        return None
    e = int(getattr(module, "num_experts", params["down_proj"].shape[0]))
    weights = ((up, "up", tuple(params[up].shape)), ("down_proj", "down", tuple(params["down_proj"].shape)))
    biases = tuple(b for b in (f"{up}_bias", "down_proj_bias") if module.has_bias and b in params)
    layout = "transposed (E, in, out)" if module.is_transposed else "(E, out, in)"
    gate = "gated, gate/up " + ("concatenated" if module.is_concatenated else "interleaved")
    note = f"transformers experts module: {gate if module.has_gate else 'not gated'}, {layout}"
    return Found("transformers", e, weights, biases, (note,))


def _batched(module: nn.Module, counts: set[int]) -> Found | None:
    params = _own_params(module)
    three_d = {a: p for a, p in params.items() if p.dim() == 3}
    if counts:
        kept = {a: p for a, p in three_d.items() if p.shape[0] in counts}
    else:
        kept = {a: three_d[a] for a in batched_by_shape({a: tuple(p.shape) for a, p in three_d.items()})}
    if not kept:
        return None
    leads = {int(p.shape[0]) for p in kept.values()}
    e = min(leads)
    roles = chain_roles({a: tuple(p.shape) for a, p in kept.items()})
    weights = tuple((a, roles[a], tuple(p.shape)) for a, p in kept.items())
    biases = tuple(a for a, p in params.items() if a not in kept and p.dim() <= 2 and p.shape[0] in leads)
    notes = []
    if len(leads) > 1:
        extra = ", ".join(f"{a} has {p.shape[0]} rows" for a, p in kept.items() if p.shape[0] != e)
        notes.append(f"{e} computing experts; {extra} (zero-computation experts), updated whole")
    kind = "parallel_linear" if len(kept) == 1 else "batched"
    return Found(kind, e, weights, biases, tuple(notes))


def batched_by_shape(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The tensors that one module with no declared expert count holds as batched experts, from their
    shapes alone: its 3-D tensors, when exactly one leading dimension >= 2 is shared by two or more."""
    by_lead: dict[int, list[str]] = {}
    for name, shape in shapes.items():
        if len(shape) == 3:
            by_lead.setdefault(int(shape[0]), []).append(name)
    groups = [names for lead, names in by_lead.items() if lead >= 2 and len(names) >= 2]
    return groups[0] if len(groups) == 1 else []


def _fused_2d(module: nn.Module, counts: set[int]) -> Found | None:
    params = _own_params(module)
    for e in sorted(counts):
        fused = {a: p for a, p in params.items() if p.dim() == 2 and p.shape[0] % e == 0 and p.shape[0] > e}
        if len(fused) >= 2:
            weights = tuple(
                (a, "weight", (e, int(p.shape[0]) // e, int(p.shape[1]))) for a, p in fused.items()
            )
            note = "fused 2-D (E*n, d) weights, viewed as (E, n, d): expert e owns rows e*n..(e+1)*n-1"
            return Found("fused_2d", e, weights, (), (note,))
    return None


def chain_roles(shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """ "up"/"down" for a pair that chains (one's output width feeds the other), else "weight"."""
    roles = dict.fromkeys(shapes, "weight")
    if len(shapes) != 2:
        return roles
    (a, sa), (b, sb) = shapes.items()
    for up, s_up, down, s_down in ((a, sa, b, sb), (b, sb, a, sa)):
        # (E, k*n, d) + (E, d, n), or transposed (E, d, k*n) + (E, n, d); k = 2 when gated.
        plain = s_up[2] == s_down[1] and s_up[1] in (s_down[2], 2 * s_down[2])
        transposed = s_up[1] == s_down[2] and s_up[2] in (s_down[1], 2 * s_down[1])
        if (plain and not transposed) or (transposed and not plain):
            roles[up], roles[down] = "up", "down"
            return roles
    return roles
