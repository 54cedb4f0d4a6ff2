"""How to compute an expert weight gradient again, later, from the operands its producer read.

A `Recipe` is the producer node of a backward graph (one op, or one output of a multi-output op) and
the chain of views from it to the returned gradient, with every tensor argument replaced by an index
into a list of kept operands. A `Program` is several ops over the kept operands, each reading operands
and earlier results: the weight gradient of a gathered-weight bmm is a bmm, a zero-filled gradient and
an accumulating index_put, and keeping the bmm's product (a slot per routed token, each as large as an
expert's weight) would cost more than the gradient. Both are plain data, written as JSON into the graph
as a string constant: a graph served from a compile cache in another process still carries it, and
nothing in it names a particular parameter (which parameter is found at run time, as for the update
op). `run` calls the same ops on the same operands, so the gradient comes out bitwise as the graph (or
autograd) would have made it; where inductor's fused kernel keeps a low-precision intermediate in
float32, a program built for an inductor graph computes it so too (`fused_precision`). Pure torch:
never imports training code.
"""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.utils import counters
from torch.fx import Node

from sonar_fx.passes.fused_precision import LowPrecisionFused, float32_sources, is_low_precision
from sonar_fx.passes.placed_sum import PlacedSum
from sonar_fx.passes.scatter_chunks import ScatteredProduct, Step, readers_of


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
        out = op_named(self.op)(*_decode(self.args, operands, []), **_decode(self.kwargs, operands, []))
        if self.item is not None:
            out = out[self.item]
        for name, args, kwargs in self.views:
            out = op_named(name)(out, *_decode(args, operands, []), **_decode(kwargs, operands, []))
        return out


Into = tuple[int, int] | tuple[tuple[int, ...], tuple[int, ...], int]


def region_of(total: Tensor, into: Into) -> Tensor:
    """The part of `total` (a contiguous tensor of the parameter's shape) that `into` names."""
    if len(into) == 2:
        return total.select(into[0], into[1])
    size, stride, offset = into
    return total.as_strided(size, stride, total.storage_offset() + offset)


def _into(data: Any) -> Into | None:
    """`Program.into` from its JSON (lists back to tuples)."""
    if not data:
        return None
    if len(data) == 2:
        return (data[0], data[1])
    return (tuple(data[0]), tuple(data[1]), data[2])


@dataclass(frozen=True)
class Program:
    steps: list[tuple[str, list[Any], dict[str, Any]]]
    """(op, args, kwargs) in order; an argument {"step": j} is the result of step j, "getitem" an op's
    output by index."""
    result: int = -1
    """Which step's result is the gradient (an in-place last step returns what it wrote into)."""
    into: Into | None = None
    """Where the result lies in the parameter's gradient, zero elsewhere (what autograd's view backwards
    pad with zeros): (dim, index), the slice `param.select(dim, index)`; or (size, stride, offset), the
    elements a view of the (contiguous) parameter reads. The sum adds it there (`region_of`)."""
    scattered: ScatteredProduct | None = field(init=False, repr=False, compare=False)
    """A bmm product the program scatters into its gradient (batched_mm), which `run` computes a few
    experts at a time rather than whole (`sonar_fx.passes.scatter_chunks`)."""
    placed: PlacedSum | None = field(init=False, repr=False, compare=False)
    """A sum of slice gradients each placed in zeros (a per-expert loop dynamo unrolled), which `run`
    computes and adds one slice at a time (`sonar_fx.passes.placed_sum`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scattered", ScatteredProduct.find(self.steps))
        whole = self.into is None and self.scattered is None
        object.__setattr__(self, "placed", PlacedSum.find(self.steps, self.result) if whole else None)

    def to_json(self) -> str:
        data = {"steps": self.steps, "result": self.result, "into": self.into}
        return json.dumps(data, separators=(",", ":"))

    def run(self, operands: Sequence[Tensor]) -> Tensor:
        """The gradient, from the kept operands (the ops in order, as the graph or autograd ran them)."""
        if self.placed is not None:
            return self.placed.run(functools.partial(self._step, operands))
        scattered = self.scattered
        values: list[Any] = []
        product: list[Any] = []
        tail: list[Any] = []
        for i, (name, args, kwargs) in enumerate(self.steps):
            fn = operator.getitem if name == "getitem" else op_named(name)
            args, kwargs = _decode(args, operands, values), _decode(kwargs, operands, values)
            if scattered is not None and i == scattered.product:
                # Computed by the put, chunk by chunk. Its first operand stands in for it where the
                # buffer's new_zeros reads it (for its dtype and device, which a bmm's operands share).
                product = [fn, *args]
                values.append(args[0])
            elif scattered is not None and i in scattered.tail:  # a cast of each chunk's product
                tail.append(functools.partial(_applied, fn, args[1:], kwargs))
                values.append(args[0])
            elif scattered is not None and i == scattered.put:
                values.append(scattered.run(fn, args, *product, tail=tail))
            else:
                values.append(fn(*args, **kwargs))
        return values[self.result]

    def _step(self, operands: Sequence[Tensor], values: Mapping[int, Any], i: int) -> Any:
        """Step i's result, the results it reads in `values`."""
        name, args, kwargs = self.steps[i]
        fn = operator.getitem if name == "getitem" else op_named(name)
        return fn(*_decode(args, operands, values), **_decode(kwargs, operands, values))


def _applied(fn: Any, rest: list[Any], kwargs: dict[str, Any], first: Tensor) -> Any:
    return fn(first, *rest, **kwargs)


@functools.cache
def load_recipe(text: str) -> Recipe | Program:
    """A `Recipe` or a `Program` from its JSON (cached: a graph hands the same text every backward)."""
    data = json.loads(text)
    if isinstance(data, dict):
        return Program([(s[0], s[1], s[2]) for s in data["steps"]], data["result"], _into(data.get("into")))
    return Recipe.from_json(text)


ALONE: dict[tuple[str, int], str] = {}
"""(multi-output op, output) -> an op over the same arguments that computes that output alone, with the
same arithmetic: a recipe runs it instead of the whole op (a backward op's weight output, without the
input gradient the step does not need). Filled by the op's owner (`register_output_alone`)."""


def register_output_alone(op: str, item: int, alone: str) -> None:
    """Recipes of output `item` of `op` run `alone` (same arguments, that output only) instead."""
    ALONE[(op, item)] = alone


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
    op = str(call.target)
    if item is not None and (op, item) in ALONE:
        op, item = ALONE[(op, item)], None
    recipe = Recipe(
        op=op,
        args=_encode(list(call.args), operands),
        kwargs=_encode(dict(call.kwargs), operands),
        item=item,
        views=[_view(v, operands) for v in reversed(views)],
    )
    return recipe, operands


def needs_program(recipe_operands: list[Node], chain: set[Node]) -> bool:
    """Whether a single-op recipe would keep a tensor the backward computes for this gradient alone
    (a non-view node all of whose users are in `chain`, the gradient's producer and views, or are views
    read by it alone on the way to the operand): then the recipe would hold what the graph frees at once
    (batched_mm: the product of its bmm, one expert-sized slab per routed token; an expert read through
    a cast, torchtitan's fp32 weights: the whole bf16 gradient under the cast back, as a transposed
    view), and a `Program` recomputes it from what the graph holds anyway. One output of a multi-output
    op whose other outputs the graph reads (sonicmoe's activation backward: dx and a') is not: a program
    would run the whole op again and keep all its inputs; keeping that output is less."""
    return any(_computed_alone(n, chain) for n in recipe_operands)


def _computed_alone(operand: Node, chain: set[Node]) -> bool:
    """`operand`, or the tensor it is a view of, is computed for the gradient `chain` ends in alone."""
    readers, node = set(chain), operand
    while node.op == "call_function" and is_view_node(node) and all(u in readers for u in node.users):
        readers.add(node)
        base = node.args[0]
        if not isinstance(base, Node):
            return False
        node = base
    return (
        node.op == "call_function"
        and not is_view_node(node)
        and all(u in readers for u in node.users)
        and not _one_of_several_outputs(node)
    )


def _one_of_several_outputs(node: Node) -> bool:
    """`node` is a getitem of an op whose other outputs are read too."""
    if node.target is not operator.getitem or not isinstance(node.args[0], Node):
        return False
    return any(u is not node for u in node.args[0].users)


def build_program(grad: Node, *, fused_precision: bool = False) -> tuple[Program, list[Node], list[Node]]:
    """The program of the gradient `grad`: every node that computes it and nothing else (its users all
    in the program), recomputed at `step()`, over operands the graph computes anyway (placeholders,
    nodes with other users). Returns (program, operand nodes, program nodes in graph order).

    `fused_precision` (a graph inductor compiles): a low-precision intermediate that inductor's fused
    kernel keeps in float32 is computed in float32 by the program too, from its inputs upcast
    (`sonar_fx.passes.fused_precision`)."""
    cone = _cone(grad)
    try:
        in_float32 = float32_sources(cone, grad) if fused_precision else set()
    except LowPrecisionFused as err:
        raise NotRerunnable(str(err)) from err
    order = {n: i for i, n in enumerate(grad.graph.nodes)}
    nodes = sorted(cone, key=order.__getitem__)
    operands: list[Node] = []
    steps: dict[Node, int] = {}
    program: list[Step] = []
    for node in nodes:
        name = "getitem" if node.target is operator.getitem else str(node.target)
        if node in in_float32:
            args = _upcast_args(node, program, operands, steps)
        else:
            args = _encode(list(node.args), operands, steps)
        program.append((name, args, _encode(dict(node.kwargs), operands, steps)))
        steps[node] = len(program) - 1
    counters["sonar"]["float32_intermediates"] += len(in_float32)
    return Program(_in_place_on_fresh(_outputs_alone(program)), steps[grad]), operands, nodes


UPCAST = "prims.convert_element_type.default"


def _upcast_args(node: Node, program: list[Step], operands: list[Node], steps: dict[Node, int]) -> list[Any]:
    """`node`'s encoded arguments, each low-precision tensor through an upcast step of its own (appended
    to `program`): the op then computes in float32 and returns float32, unrounded."""
    args = []
    for arg in node.args:
        encoded = _encode(arg, operands, steps)
        if isinstance(arg, Node) and is_low_precision(arg):
            program.append((UPCAST, [encoded, {"dtype": "float32"}], {}))
            encoded = {"step": len(program) - 1}
        args.append(encoded)
    return args


def _outputs_alone(
    program: list[tuple[str, list[Any], dict[str, Any]]],
) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """A multi-output op whose one output the program reads (`getitem`) and that has an op computing
    that output alone (`ALONE`): that op instead, the `getitem` an alias of its result (no copy)."""
    readers = readers_of(program)
    out = list(program)
    for i, (name, args, _) in enumerate(program):
        if name != "getitem" or not isinstance(args[0], dict) or "step" not in args[0]:
            continue
        j, item = args[0]["step"], args[1]
        alone = ALONE.get((program[j][0], item))
        if alone is not None and len(readers.get(j, [])) == 1:
            out[j] = (alone, program[j][1], program[j][2])
            out[i] = ("aten.alias.default", [{"step": j}], {})
    return out


_FRESH = {"aten.new_zeros.default", "aten.zeros.default", "aten.full.default", "aten.new_full.default"}
_CONSTANTS_OF_NOTHING = {"aten.zeros.default", "aten.full.default"}
"""Buffers made from constants alone (no tensor input): a program makes its own rather than keep one."""


def _in_place_on_fresh(
    program: list[tuple[str, list[Any], dict[str, Any]]],
) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """A functional `index_put` on a buffer the program itself just filled, and reads nowhere else,
    written in place (`index_put` is a clone then `index_put_`: the same values, one gradient-sized
    buffer fewer alive at the step)."""
    readers = readers_of(program)
    out = []
    for name, args, kwargs in program:
        first = args[0] if args else None
        source = first.get("step") if isinstance(first, dict) and len(first) == 1 else None
        fresh = isinstance(source, int) and program[source][0] in _FRESH and len(readers[source]) == 1
        if name == "aten.index_put.default" and fresh:
            name = "aten.index_put_.default"
        out.append((name, args, kwargs))
    return out


def _cone(grad: Node) -> set[Node]:
    """`grad` and, walking back in graph order (so a node's users are all decided before it), each node
    whose every user is in: what backward computes only for this gradient. A multi-output op behind a
    getitem comes in even with other users (pinned: the graph still runs it for its other outputs, so
    its own inputs stay alive there and are kept as operands, never computed again). A constant with
    no inputs (a zero-filled buffer) comes in whoever else reads it: the graph may share one between
    gradients of the same shape (inductor's CSE merges the layers' `full` calls), and keeping it would
    keep a gradient-sized operand that the program makes for nothing."""
    cone, pinned = {grad}, set()
    nodes = list(grad.graph.nodes)
    for node in reversed(nodes[: nodes.index(grad)]):
        if node.op != "call_function" or not node.users:
            continue
        if all(u in cone and u not in pinned for u in node.users):
            cone.add(node)
        elif str(node.target) in _CONSTANTS_OF_NOTHING and not node.all_input_nodes:
            if any(u in cone and u not in pinned for u in node.users):
                cone.add(node)
        elif any(u in cone and u not in pinned and u.target is operator.getitem for u in node.users):
            cone.add(node)
            pinned.add(node)
    for node in cone:
        if not _rerunnable(node):
            raise NotRerunnable(f"{node.target} cannot be run again from a recipe")
    return cone


def _rerunnable(node: Node) -> bool:
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def is_view_node(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _view(node: Node, operands: list[Node]) -> tuple[str, list[Any], dict[str, Any]]:
    if not isinstance(node.target, torch._ops.OpOverload):
        raise NotRerunnable(f"the view {node.target} is not an op")
    return str(node.target), _encode(list(node.args[1:]), operands), _encode(dict(node.kwargs), operands)


def _encode(value: Any, operands: list[Node], steps: dict[Node, int] | None = None) -> Any:
    """Tensor nodes -> {"operand": i} (appended to `operands`), or {"step": j} for a node computed by
    step j of a program (`steps`); constants as JSON values."""
    if isinstance(value, Node) and steps is not None and value in steps:
        return {"step": steps[value]}
    if isinstance(value, Node):
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise NotRerunnable(f"argument {value.name} is not a tensor (a symbolic size?)")
        if value not in operands:
            operands.append(value)
        return {"operand": operands.index(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v, operands, steps) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v, operands, steps) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotRerunnable(f"argument {value!r} of type {type(value).__name__} has no recipe form")


_CONSTANTS = {"dtype": torch, "layout": torch, "memory_format": torch}


def _decode(value: Any, operands: Sequence[Tensor], values: Sequence[Any] | Mapping[int, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, operands, values) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((key, item),) = value.items()
            # (a kwargs dict {"dtype": {"dtype": "bfloat16"}} holds an encoded value, not a name)
            if key == "operand" and isinstance(item, int):
                return operands[item]
            if key == "step" and isinstance(item, int):
                return values[item]
            if key in _CONSTANTS and isinstance(item, str):
                return getattr(torch, item)
            if key == "device" and isinstance(item, str):
                return torch.device(item)
        return {k: _decode(v, operands, values) for k, v in value.items()}
    return value


@functools.cache
def op_named(name: str) -> torch._ops.OpOverload:
    """The op `str()` names "namespace.packet.overload" (as recipes write it)."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
