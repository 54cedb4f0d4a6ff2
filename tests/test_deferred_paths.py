"""The deferred schedule keeps operands, not gradients, on every expert path: transformers' batched_mm
(gathered rows `W[ids]`, then bmm) and eager loop (`linear(x, W[e])` per expert), and the reference
model's kernel (`sonar_fx::grouped_mm`), eager and compiled (transformers' grouped_mm: tests/
test_deferred.py; the eager loop under compile: tests/test_deferred_compiled_loop.py). Each path against
its own standard run in plain torch (`Twin`: fused AdamW, the clip over every parameter, 4 micro-batches
per step), `torch.equal` on every parameter; and each keeps, at its peak, operands plus one gradient below
the whole gradients. The zoo's families (tests/families.py) keep no gradient whole, eager or compiled:
the per-expert forms (loops over slices of other forms, rows of per-expert vectors, embedding gathers)
are tests/test_deferred_forms.py's, with the tensors that cross over by the rule named there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import sonar_fx
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.models import build_model
from sonar_fx.passes.recipe import UPCAST, Program, load_recipe

from helpers import assert_same_weights, batches
from test_deferred import MAX_NORM, Twin, cfg_for, run_steps

PATHS = {
    "batched_mm": ("tiny-olmoe", "batched_mm"),
    "loop": ("tiny-olmoe", "eager"),
    "reference": ("tiny-reference", None),
}
"""path -> (model, transformers' experts implementation)."""
ACCUM, STEPS = 4, 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


ONE_LAYER = {"tiny-olmoe": {"num_hidden_layers": 1}, "tiny-reference": {"num_layers": 1}}
"""Compiled runs train one MoE layer: the same graph pass, half the graph to compile."""
WIDE_REFERENCE = {"num_experts": 32, "intermediate_size": 32}
"""A reference model whose expert gradients outweigh one micro-batch's operands (no crossover)."""


def pair(path: str, compiler: str, dtype: torch.dtype, **overrides):
    name, implementation = PATHS[path]
    if compiler != "eager":
        overrides = {**ONE_LAYER[name], **overrides}
    model = build_model(name, dtype=dtype, seed=0, **overrides)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    twin_model = copy.deepcopy(model)
    sonar_fx.compile(model, cfg_for("all"), compiler=compiler, schedule="deferred")
    opt = model.sonar
    names = {opt.expert_name(p) for p in opt.expert_group["params"]}
    return model, opt, twin_model, Twin(twin_model, names, "all", compiler)


def train(model, opt, twin: Twin) -> list[float]:
    totals = []
    data = batches(STEPS * ACCUM)
    for s in range(STEPS):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            model(**b).loss.backward()
            twin.run(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        twin.step()
        totals.append(opt.grad_norms()["total"])
    return totals


CASES = [
    *[
        (p, c, d)
        for p in ("batched_mm", "reference")
        for c in ("eager", "aot_eager")
        for d in ("float32", "bfloat16")
    ],
    *[("loop", "eager", d) for d in ("float32", "bfloat16")],
]


@pytest.mark.parametrize(("path", "compiler", "dtype"), CASES)
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches of a tiny model cross over
def test_each_path_keeps_operands_and_is_its_standard_run(path, compiler, dtype):
    counters.clear()
    model, opt, twin_model, twin = pair(path, compiler, getattr(torch, dtype))
    initial = copy.deepcopy(twin_model.state_dict())
    totals = train(model, opt, twin)
    assert all(t > MAX_NORM for t in totals), totals  # the clip was active on every step
    assert_same_weights(model, twin_model)
    experts = len(opt.expert_group["params"])
    moved = [n for n, p in model.named_parameters() if ".experts." in n and not torch.equal(p, initial[n])]
    assert len(moved) == experts, (
        moved
    )  # every expert tensor trained (equal twins that never moved prove nothing)
    report = opt.report()
    assert report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == STEPS * experts, report
    if compiler != "eager":
        assert counters["sonar"]["deferred"] == experts  # every expert output of the one graph rewritten
    if (path, compiler) == ("batched_mm", "aot_eager"):  # each gathered weight's rows gathered again
        assert counters["sonar"]["gathers_recomputed"] == experts, counters["sonar"]


@pytest.mark.slow  # two inductor compiles
@pytest.mark.usefixtures("deferred_saving_lost", "deterministic")  # 2 micro-batches cross over
def test_batched_mm_under_inductor_is_its_inductor_standard_run():
    """Inductor decomposes the weight gradient's bmm (one contraction) into a float32 mul, fused with
    the activation `act(gate) * up` recomputed in backward and never rounded to bf16; the program
    computes that intermediate in float32 too (passes/fused_precision.py). Bitwise the same model's
    standard run compiled with inductor over 3 steps, clip over all, 2 micro-batches, the step's product
    in chunks (tests/test_scatter_chunks.py). Negative control: the intermediate rounded to bf16, as a
    program run op by op had it, is another gradient."""
    model, opt, twin_model, twin = pair("batched_mm", "inductor", torch.bfloat16)
    totals = run_steps(model, opt, twin, accum=2)
    assert all(t > MAX_NORM for t in totals), totals
    assert_same_weights(model, twin_model)
    experts = len(opt.expert_group["params"])
    report = opt.report()
    assert report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == 3 * experts, report
    # Not the pass's counters: a warm inductor cache serves the graph without running the pass. The
    # programs the graph hands the store say what it did: one has the float32 intermediate.
    model(**batches(1)[0]).loss.backward()
    (entry,) = [e for e in opt.deferred.entries() if _float32_mul(load_recipe(e.recipe)) is not None]
    program = load_recipe(entry.recipe)
    assert program.scattered is not None  # the step runs inductor's float32 product in chunks
    rounded = Program(_rounded(program), program.result)
    assert not torch.equal(program.run(entry.operands), rounded.run(entry.operands))
    opt.zero_grad()


def _float32_mul(program) -> int | None:
    """The step of `program` that multiplies two operands upcast to float32 (the fused intermediate)."""
    if not isinstance(program, Program):
        return None
    upcast_operands = {
        i for i, (name, args, _) in enumerate(program.steps) if name == UPCAST and "operand" in args[0]
    }
    for i, (name, args, _) in enumerate(program.steps):
        steps = [a.get("step") for a in args if isinstance(a, dict)]
        if name == "aten.mul.Tensor" and len(steps) == 2 and set(steps) <= upcast_operands:
            return i
    return None


def _rounded(program: Program) -> list:
    """`program`'s steps with its float32 intermediate computed in bf16, from the operands themselves."""
    steps = list(program.steps)
    i = _float32_mul(program)
    assert i is not None
    name, args, kwargs = steps[i]
    steps[i] = (name, [program.steps[a["step"]][1][0] for a in args], kwargs)
    return steps


@pytest.mark.usefixtures("deferred_saving_lost")
def test_negative_control_the_loop_twin_with_a_dense_clip_differs():
    """The twin with the clip over every parameter is not trivially equal: a dense-only clip differs."""
    model, opt, _, _ = pair("loop", "eager", torch.float32)
    dense_only = copy.deepcopy(model)
    names = {opt.expert_name(p) for p in opt.expert_group["params"]}
    twin = Twin(dense_only, names, "dense", "eager")
    for b in batches(ACCUM):
        model(**b).loss.backward()
        twin.run(**b).loss.backward()
    opt.step()
    twin.step()
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), dense_only.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("path", "compiler"),
    [
        ("batched_mm", "eager"),
        ("batched_mm", "aot_eager"),
        ("loop", "eager"),
        ("reference", "eager"),
        ("reference", "aot_eager"),
    ],
)
def test_each_path_keeps_operands_plus_one_gradient_below_the_whole_gradients(path, compiler):
    """One micro-batch (below the crossover): the most the store held at once (operands) plus the one
    gradient the step computes at a time is less than every expert gradient of standard training."""
    model, opt, _, _ = pair(path, compiler, torch.bfloat16, **(WIDE_REFERENCE if path == "reference" else {}))
    for _ in range(2):
        model(**batches(1)[0]).loss.backward()
        if (path, compiler) == ("batched_mm", "aot_eager"):
            assert_batched_mm_keeps_a_program(opt)
        opt.step()
        opt.zero_grad()
    bounds = ExpertGradBytes.of(opt.expert_layers)
    kept = opt.report()["deferred"]["kept_operand_peak"]
    assert kept > 0 and kept + max(bounds.tensor_sizes) < bounds.total, (kept, bounds)
    assert opt.report()["deferred"]["kept_whole"] == [] and opt.report()["saving_lost_bytes"] == 0


class _OpNames(TorchDispatchMode):
    """The ops a region runs (compiled graphs included: the mode is off while they compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_the_reference_kernel_computes_each_weight_gradient_once(compiler):
    """Its backward op computes dx and dW; under the deferred schedule backward computes dx alone and
    the step dW alone (the same mm per group: the exactness tests above), never the whole op (a dW
    computed and dropped in backward, or a dx computed and dropped at the step: expert parallelism's
    deferred step ran 1.39x the plain one)."""
    model, opt, _, _ = pair("reference", compiler, torch.float32, **WIDE_REFERENCE)
    tensors = len(opt.expert_group["params"])
    model(**batches(1)[0]).loss.backward()  # compiles (aot_eager) outside the counted region
    opt.step()
    opt.zero_grad()
    backward, step = _OpNames(), _OpNames()
    with backward:
        model(**batches(1)[0]).loss.backward()
    with step:
        opt.step()
    assert "sonar_fx.grouped_mm_backward.default" not in backward.names + step.names
    assert backward.names.count("sonar_fx.grouped_mm_input_grad.default") == tensors
    # The clip over every parameter: its norm pass and the update pass each compute every gradient.
    assert step.names.count("sonar_fx.grouped_mm_weight_grad.default") == 2 * tensors
    opt.zero_grad()


def assert_batched_mm_keeps_a_program(opt) -> None:
    """Under compile, batched_mm's weight gradient is `index_put(new_zeros, [ids], bmm(dy, x^T), True)`:
    a single-op recipe would keep the bmm product (an expert-sized slab per routed slot); the program
    recomputes it from dy, x and ids (each smaller than one expert tensor), and the graph no longer
    computes it."""
    entries = opt.deferred.entries()
    assert len(entries) == len(opt.expert_group["params"])
    smallest_expert = min(p.numel() for p in opt.expert_group["params"])
    for entry in entries:
        program = load_recipe(entry.recipe)
        assert isinstance(program, Program)
        ops = [name for name, _, _ in program.steps]
        assert "aten.bmm.default" in ops and "aten.index_put_.default" in ops, ops  # in place: no copy
        kept = [t for t in entry.operands if isinstance(t, torch.Tensor)]
        assert kept and all(t.numel() < smallest_expert for t in kept), [t.shape for t in kept]


# --- the zoo (tests/families.py): every expert tensor deferred, eager, against its twin -------------

ZOO = [
    ("qwen2_moe", "batched_mm"),  # shared experts beside the routed ones
    ("deepseek_v3", "eager"),  # the per-expert loop
    ("nemotron_h", "batched_mm"),  # not gated
    ("longcat_flash", "eager"),  # zero-computation experts
    ("llama4_text", None),  # one bmm over the batched weight itself
]
ZOO_COMPILED = [
    pytest.param(t, i, "aot_eager", marks=pytest.mark.slow)  # two compiles each: over 10 s
    for t, i in [("qwen2_moe", "batched_mm"), ("gpt_oss", "grouped_mm")]  # gpt-oss: biases too
]


@pytest.mark.parametrize(
    ("model_type", "implementation", "compiler"), [(*z, "eager") for z in ZOO] + ZOO_COMPILED
)
@pytest.mark.usefixtures("deferred_saving_lost")
def test_zoo_families_keep_operands_for_every_expert_tensor(model_type, implementation, compiler):
    from families import differing, train

    kwargs = dict(implementation=implementation)
    twin, _, twin_error = train("standard_no_expert_clip", model_type, compiler, 2, **kwargs)
    sonar, m, error = train("sonar_deferred", model_type, compiler, 2, **kwargs)
    assert error is None and twin_error is None, (error, twin_error)
    assert not differing(sonar, twin)
    report = m.optimizer.report()
    assert (
        report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == 2 * report["expert_tensors"]
    )


def test_a_program_round_trips_through_json_with_its_constants():
    """Plain data: a program's kwargs hold encoded dtypes, layouts and devices (a kwargs dict named
    "dtype" is not a dtype), and `load_recipe` runs it to what the ops give directly."""
    steps = [
        ("aten.t.default", [{"operand": 0}], {}),
        ("aten.mm.default", [{"step": 0}, {"operand": 1}], {}),
        (
            "aten._to_copy.default",
            [{"step": 1}],
            {"dtype": {"dtype": "bfloat16"}, "layout": {"layout": "strided"}},
        ),
        ("aten.new_zeros.default", [{"step": 2}, [3, 4, 5]], {"device": {"device": "cpu"}}),
    ]
    program = Program(steps, result=2, into=(0, 1))
    loaded = load_recipe(program.to_json())
    assert loaded == program
    dy, x = torch.randn(6, 4), torch.randn(6, 5)
    assert torch.equal(loaded.run([dy, x]), dy.t().mm(x).to(torch.bfloat16))
    assert not torch.equal(loaded.run([x[:, :4], x]), dy.t().mm(x).to(torch.bfloat16))  # other operands
