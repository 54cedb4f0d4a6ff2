"""How to compute an expert weight gradient again, later, from the operands its producer read.

A `Recipe` is the producer node of a backward graph (one op, or one output of a multi-output op) and
the chain of views from it to the returned gradient, with every tensor argument replaced by an index
into a list of kept operands. It is plain data, written as JSON into the graph as a string constant:
a graph served from a compile cache in another process still carries it, and nothing in it names a
particular parameter (which parameter is found at run time, as for the update op). `run` calls the
same ops on the same operands, so the gradient comes out bitwise as the graph would have made it.
Pure torch: never imports training code.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.fx import Node


class NotRerunnable(ValueError):
    """The producer cannot be written as a recipe (a higher-order op, a symbolic size, an argument
    this format does not carry); the message says which."""


@dataclass(frozen=True)
class Recipe:
    op: str
    """The producer's `OpOverload`, as `str()` names it ("aten._grouped_mm.default")."""
    args: list[Any]
    kwargs: dict[str, Any]
    item: int | None
    """For a multi-output producer, which output is the gradient."""
    views: list[tuple[str, list[Any], dict[str, Any]]]
    """View ops from the producer's output to the gradient, each applied to the previous result."""

    def to_json(self) -> str:
        return json.dumps([self.op, self.args, self.kwargs, self.item, self.views], separators=(",", ":"))

    @staticmethod
    @functools.cache
    def from_json(text: str) -> Recipe:
        op, args, kwargs, item, views = json.loads(text)
        return Recipe(op, args, kwargs, item, [(v[0], v[1], v[2]) for v in views])

    def run(self, operands: Sequence[Tensor]) -> Tensor:
        """The gradient, from the kept operands (the same ops, in the same order, as the graph)."""
        out = _op(self.op)(*_decode(self.args, operands), **_decode(self.kwargs, operands))
        if self.item is not None:
            out = out[self.item]
        for name, args, kwargs in self.views:
            out = _op(name)(out, *_decode(args, operands), **_decode(kwargs, operands))
        return out


def build_recipe(producer: Node, grad: Node) -> tuple[Recipe, list[Node]]:
    """The recipe of the gradient `grad` (a view chain over `producer`) and the operand nodes it reads."""
    views = []
    node = grad
    while node is not producer:
        views.append(node)
        parent = node.args[0]
        assert isinstance(parent, Node)
        node = parent
    operands: list[Node] = []
    item: int | None = None
    call = producer
    if producer.target is operator.getitem:
        inner, index = producer.args[0], producer.args[1]
        assert isinstance(inner, Node) and isinstance(index, int)
        call, item = inner, index
    if not isinstance(call.target, torch._ops.OpOverload):
        raise NotRerunnable(f"the producer {call.target} is not a single op")
    recipe = Recipe(
        op=str(call.target),
        args=_encode(list(call.args), operands),
        kwargs=_encode(dict(call.kwargs), operands),
        item=item,
        views=[_view(v, operands) for v in reversed(views)],
    )
    return recipe, operands


def _view(node: Node, operands: list[Node]) -> tuple[str, list[Any], dict[str, Any]]:
    if not isinstance(node.target, torch._ops.OpOverload):
        raise NotRerunnable(f"the view {node.target} is not an op")
    return str(node.target), _encode(list(node.args[1:]), operands), _encode(dict(node.kwargs), operands)


def _encode(value: Any, operands: list[Node]) -> Any:
    """Tensor nodes -> {"operand": i} (appended to `operands`); constants as JSON values."""
    if isinstance(value, Node):
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise NotRerunnable(f"argument {value.name} is not a tensor (a symbolic size?)")
        if value not in operands:
            operands.append(value)
        return {"operand": operands.index(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v, operands) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v, operands) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotRerunnable(f"argument {value!r} of type {type(value).__name__} has no recipe form")


def _decode(value: Any, operands: Sequence[Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, operands) for v in value]
    if isinstance(value, dict):
        if "operand" in value and len(value) == 1:
            return operands[value["operand"]]
        if "dtype" in value and len(value) == 1:
            return getattr(torch, value["dtype"])
        return {k: _decode(v, operands) for k, v in value.items()}
    return value


@functools.cache
def _op(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
