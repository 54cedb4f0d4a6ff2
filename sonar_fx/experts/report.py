"""What discovery found in a model, as plain data and as text (what `sonar-fx inspect` prints).

For: users checking, before any training, which tensors Sonar will update in backward and which stay
dense. Per layer: the expert tensors with their roles and per-expert shapes, what is frozen, where
per-expert biases go, and the dense modules of the same MoE block (router, shared experts: dense by
design, since they see every token); for the model: 3-D parameters that were NOT taken as experts,
and why. It reads the model only; it never trains, moves or changes a parameter, builds a model or
prints (the command line does both).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from torch import nn

from sonar_fx.experts.discovery import (
    DEFAULT_EXPERT_BIASES,
    ExpertBiases,
    ExpertLayer,
    ExpertSet,
    NoExpertsFoundError,
)
from sonar_fx.experts.structure import declared_counts

SHARED_EXPERTS_NOTE = (
    "Shared experts (and every other module of an MoE block that is not a routed expert: router, "
    "shared-expert gate) stay dense by design: they see every token, are clipped with the dense "
    "gradients and updated at step()."
)
BIAS_NOTE = {
    "experts": "per-expert biases train with their experts (updated in backward, not clipped)",
    "dense": "per-expert biases train with the dense parameters (clipped, updated at step())",
}


def discovery_report(
    model: nn.Module,
    experts: Iterable[nn.Parameter | str] | None = None,
    *,
    expert_biases: ExpertBiases = DEFAULT_EXPERT_BIASES,
) -> dict[str, Any]:
    """Plain data (JSON-ready) describing the expert/dense split discovery makes for `model`."""
    try:
        found = ExpertSet.discover(model, experts, expert_biases=expert_biases)
    except NoExpertsFoundError as err:
        return {"found": False, "error": str(err), "expert_biases": expert_biases}
    layers = list(found.layers)
    modules = dict(model.named_modules())
    split = found.split(model)
    n_expert = sum(p.numel() for p in split.expert_params)
    n_all = sum(p.numel() for p in split.params)
    return {
        "found": True,
        "expert_biases": expert_biases,
        "bias_policy": BIAS_NOTE[expert_biases],
        "layers": [{**layer.describe(), **_block(model, modules, layer)} for layer in layers],
        "expert_params": n_expert,
        "dense_params": n_all - n_expert,
        "expert_fraction": n_expert / n_all if n_all else 0.0,
        "not_experts": _unclaimed_3d(model, modules, layers),
        "shared_experts": SHARED_EXPERTS_NOTE,
    }


def _claimed_names(layer: ExpertLayer) -> set[str]:
    return {t.name for t in layer.tensors} | set(layer.frozen) | set(layer.dense_biases)


def _block(model: nn.Module, modules: dict[str, nn.Module], layer: ExpertLayer) -> dict[str, Any]:
    """The MoE block around a layer (the nearest module holding trainable parameters that are not the
    layer's) and those dense parameters, grouped by the block's direct children."""
    claimed = _claimed_names(layer)
    name = layer.name
    while True:
        prefix = f"{name}." if name else ""
        others = [
            (prefix + n, p)
            for n, p in modules[name].named_parameters()
            if prefix + n not in claimed and p.requires_grad
        ]
        if others or not name or layer.layout == "explicit":
            break
        name = name.rpartition(".")[0]
    entries: dict[str, dict[str, Any]] = {}
    for full, p in others:
        child = full[len(prefix) :].split(".")[0]
        entry = entries.setdefault(child, {"module": prefix + child, "params": 0, "kind": "dense"})
        entry["params"] += p.numel()
        entry["class"] = type(modules.get(prefix + child, p)).__name__
        if _looks_like_router(modules.get(prefix + child), p, layer.num_experts):
            entry["kind"] = "router"
    return {"block": name, "dense_in_block": list(entries.values())}


def _looks_like_router(module: nn.Module | None, param: nn.Parameter, num_experts: int) -> bool:
    # Structure again, not names: a router declares the expert count or scores E experts per token.
    if module is not None and any(declared_counts(m) for m in module.modules()):
        return True
    return param.dim() >= 1 and int(param.shape[0]) == num_experts


def _unclaimed_3d(model: nn.Module, modules: dict[str, nn.Module], layers: list[ExpertLayer]) -> list[dict]:
    claimed = set().union(*(_claimed_names(layer) for layer in layers))
    out = []
    for full, p in model.named_parameters():
        if p.dim() != 3 or full in claimed:
            continue
        owner = modules[full.rpartition(".")[0]]
        if isinstance(owner, nn.modules.conv._ConvNd):
            why = "convolution weight"
        elif p.shape[0] < 2:
            why = "leading dimension 1: one dense (shared) expert stored batched"
        else:
            why = "its module declares no expert count equal to its leading dimension"
        out.append({"name": full, "shape": list(p.shape), "why": why})
    return out


def format_report(report: dict[str, Any]) -> str:
    """The report as text, one block per expert layer."""
    if not report["found"]:
        return report["error"]
    lines = [
        f"{len(report['layers'])} expert layers; expert parameters {report['expert_params']:,} "
        f"({report['expert_fraction']:.1%} of trainable), dense {report['dense_params']:,}.",
        f"expert_biases={report['expert_biases']!r}: {report['bias_policy']}.",
    ]
    for layer in report["layers"]:
        lines.append(f"\n{layer['layer']}  [{layer['layout']}, E={layer['num_experts']}]")
        for t in layer["tensors"]:
            shape = "x".join(map(str, t["shape"]))
            view = "" if t["expert_shape"] == t["shape"] else f" viewed as {tuple(t['expert_shape'])}"
            lines.append(f"  expert  {t['name']}  {t['role']}  {shape} {t['dtype']}{view}")
        lines += [f"  frozen  {n} (no update)" for n in layer["frozen"]]
        lines += [f"  dense   {n} (per-expert bias, expert_biases='dense')" for n in layer["dense_biases"]]
        for d in layer["dense_in_block"]:
            lines.append(f"  dense   {d['module']}  {d['kind']} ({d['class']}, {d['params']:,} params)")
        lines += [f"  note    {n}" for n in layer["notes"]]
    convs = [t for t in report["not_experts"] if t["why"] == "convolution weight"]
    if convs:
        lines.append(f"\n{len(convs)} convolution weights are 3-D and stay dense.")
    for t in report["not_experts"]:
        if t not in convs:
            lines.append(f"not an expert: {t['name']} {tuple(t['shape'])}: {t['why']}")
    lines.append(f"\n{report['shared_experts']}")
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1)
