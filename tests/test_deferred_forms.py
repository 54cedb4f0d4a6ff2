"""The eager deferred capture's per-expert forms (sonar_fx/optim/defer_eager_forms.py) on the zoo's
families that read their experts so (tests/families.py): each against its standard run in plain torch
(`Twin`: fused AdamW, the clip over every parameter, 4 micro-batches per step), `torch.equal` on every
parameter, with no expert gradient arriving whole. Where a step's kept operands outgrow the tensor
they are for (a bias's rows: one per routed slot; an embedding's: one per token and pick), the store
crosses it over by its rule (computes it in backward and holds it, as standard training does): those
are named here with why (`CROSSES_OVER`); one micro-batch of a model with more experts keeps operands
below the gradients on every form. Kept operands count the storages they keep alive, each once (an
eager loop's slices are views of a few buffers): `test_the_store_counts_each_storage_once`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sonar_fx
from sonar_fx.memory import ExpertGradBytes
from sonar_fx.models.families import build_family
from sonar_fx.optim.deferred import DeferredGrads
from sonar_fx.passes.recipe import Recipe
from sonar_fx.runtime.meter import ExpertGradMeter

from families import batches, explicit_experts
from helpers import assert_same_weights, known_library_failure
from test_deferred import MAX_NORM, Twin, cfg_for

FORMS = {
    ("gpt_oss", "eager"): "transformers' loop: `x @ W[e] + b[e]` (a row-major slice, a selected bias row)",
    ("gpt_oss", "grouped_mm"): "biases as gathered rows `b[ids]` added to the grouped GEMM's output",
    ("gpt_oss", "batched_mm"): "biases as gathered rows `b[ids]` added to the batched GEMM's output",
    ("aria_text", "eager"): "transformers' loop: `x @ W[e]`",
    ("dbrx", None): "fused 2-D experts: `x.matmul(W.view(E, f, h)[e].T)`, one view per expert",
    ("doge", None): "embedding-style experts: `embedding(ids, W)`",
    ("jetmoe", None): "attention experts: `linear(x, W[e])` in `map` / `reduce`, never in forward",
}
"""(family, experts implementation) -> how it reads its experts."""
CROSSES_OVER = {
    ("gpt_oss", "grouped_mm"): (
        "_bias",
        "a bias's rows' gradient is one row per routed slot (32 tokens x top-2) against 8 experts' rows",
    ),
    ("gpt_oss", "batched_mm"): ("_bias", "the same rows as under grouped_mm"),
    ("doge", None): ("_embed", "an embedding's rows' gradient is one row per token and pick (64) against 8"),
}
"""The tiny families' tensors that cross over at their first micro-batch (a name fragment of each, and
why); the other forms keep operands (`test_each_form_keeps_operands_below_its_gradient`)."""
WIDE = {
    ("gpt_oss", "eager"): {"num_local_experts": 128},
    ("gpt_oss", "grouped_mm"): {"num_local_experts": 128},
    ("aria_text", "eager"): {"moe_num_experts": 16},
    ("dbrx", None): {"ffn_config": {"moe_num_experts": 16, "moe_top_k": 1, "ffn_hidden_size": 64}},
    ("doge", None): {"num_experts": 256},
    # Its loop's operands are views of one buffer per GEMM side (split() inputs, cat()'s gradient):
    # counted once, 64 routed slots x (in + out) stay below each tensor as the tiny config has it.
    ("jetmoe", None): {},
}
"""Config overrides with more experts than one micro-batch's routed slots (below every crossover)."""
ACCUM, STEPS = 4, 2


class Forms(nn.Module):
    """Every per-expert form on one layer's expert tensors, each expert read twice (its slices' pieces
    are summed), the routed ids repeated (the rows' gradients accumulate): `linear(x, W[e])`,
    `x @ V[e]`, dbrx's `x.matmul(F.view(E, f, d)[e].T)`, a bias as `b[e]` and as `b[ids]`, and
    `embedding(ids, T)`. More experts than routed slots: nothing crosses over, every recipe runs at the
    step."""

    def __init__(self, dtype: torch.dtype, experts: int = 32, d: int = 8, f: int = 6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.shape = (experts, f, d)
        self.w_Efd = nn.Parameter(torch.randn(experts, f, d, generator=g, dtype=dtype))
        self.v_Efd = nn.Parameter(torch.randn(experts, f, d, generator=g, dtype=dtype))
        self.fused_Ef_d = nn.Parameter(torch.randn(experts * f, d, generator=g, dtype=dtype))
        self.b_Ef = nn.Parameter(torch.randn(experts, f, generator=g, dtype=dtype))
        self.table_Ed = nn.Parameter(torch.randn(experts, d, generator=g, dtype=dtype))
        self.scale = nn.Parameter(torch.ones((), dtype=dtype))  # a dense tensor (its gradient in .grad)

    def forward(self, x_Td: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
        total = (self.b_Ef[ids_T] * x_Td[:, : self.shape[1]]).sum()
        total = total + (torch.nn.functional.embedding(ids_T, self.table_Ed) * x_Td).sum()
        for e in [0, 1, 2, 0, 1]:
            h = torch.nn.functional.linear(x_Td[ids_T == e], self.w_Efd[e]) + self.b_Ef[torch.tensor(e)]
            h = (h @ self.v_Efd[e]).matmul(self.fused_Ef_d.view(self.shape)[e].T)
            total = total + h.square().sum()
        return total * self.scale


EXPERT_NAMES = ["w_Efd", "v_Efd", "fused_Ef_d", "b_Ef", "table_Ed"]


def deferred(model_type: str, implementation: str | None, **overrides):
    """(model, twin model): a tiny family deferred in eager, clipped over every parameter, and its copy."""
    model = build_family(model_type, seed=0, **overrides)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    twin_model = copy.deepcopy(model)
    experts = explicit_experts(model_type, model)
    sonar_fx.compile(model, cfg_for("all"), compiler="eager", schedule="deferred", experts=experts)
    return model, twin_model


def run(model_type: str, implementation: str | None):
    """The family deferred and its plain-torch twin, each trained `STEPS` steps of `ACCUM` micro-batches
    from the same random stream: (model, optimizer, twin model, clip norms)."""
    model, twin_model = deferred(model_type, implementation)
    opt = model.sonar
    twin = Twin(twin_model, {opt.expert_name(p) for p in opt.expert_group["params"]}, "all", "eager")
    data = batches(STEPS * ACCUM)
    torch.manual_seed(0)  # dropout and router jitter draw the same numbers on both sides
    totals = []
    for s in range(STEPS):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        totals.append(opt.grad_norms()["total"])
    torch.manual_seed(0)
    for s in range(STEPS):
        for b in data[s * ACCUM : (s + 1) * ACCUM]:
            twin.run(**b).loss.backward()
        twin.step()
    return model, opt, twin_model, totals


def marks(model_type: str) -> list[pytest.MarkDecorator]:
    return [known_library_failure(forward_of=model_type)] if model_type == "doge" else []


@pytest.mark.parametrize(
    ("model_type", "implementation"), [pytest.param(*f, marks=marks(f[0])) for f in FORMS]
)
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches of a tiny model cross over
def test_each_form_keeps_operands_and_is_its_standard_run(model_type, implementation):
    model, opt, twin_model, totals = run(model_type, implementation)
    initial = build_family(model_type, seed=0).state_dict()
    assert all(t > MAX_NORM for t in totals), totals  # the clip was active on every step
    assert_same_weights(model, twin_model)
    experts = [opt.expert_name(p) for p in opt.expert_group["params"]]
    params = dict(model.named_parameters())
    assert all(not torch.equal(params[n], initial[n]) for n in experts)  # every expert tensor trained
    report = opt.report()
    assert report["deferred"]["kept_whole"] == [], report["deferred"]  # none arrived whole
    assert report["updates_deferred"] == STEPS * len(experts)


@pytest.mark.parametrize(
    ("model_type", "implementation"), [pytest.param(*f, marks=marks(f[0])) for f in WIDE]
)
def test_each_form_keeps_operands_below_its_gradient(model_type, implementation):
    """One micro-batch of a model with more experts than routed slots: nothing crossed over, and the
    most the store held at once (operands) plus the one gradient the step computes at a time is less
    than every expert gradient of standard training."""
    model, _ = deferred(model_type, implementation, **WIDE[model_type, implementation])
    opt = model.sonar
    for b in batches(2):
        model(**b).loss.backward()
        assert opt.deferred.entries()  # operands kept until the step
        opt.step()
        opt.zero_grad()
    bounds = ExpertGradBytes.of(opt.expert_layers)
    report = opt.report()["deferred"]
    kept = report["kept_operand_peak"]
    assert kept > 0 and kept + max(bounds.tensor_sizes) < bounds.total, (kept, bounds)
    assert report["kept_whole"] == [] and report["crossed_over"] == {}, report


@pytest.mark.parametrize(
    ("model_type", "implementation"), [pytest.param(*f, marks=marks(f[0])) for f in CROSSES_OVER]
)
@pytest.mark.usefixtures("deferred_saving_lost")
def test_the_named_exceptions_cross_over_by_the_rule(model_type, implementation):
    """The tiny families' tensors whose kept operands outgrow them at the first micro-batch cross over
    (their gradient computed in backward and held, as standard training holds it), and only those: by
    the crossover rule, not by a form no capture knows (none arrives whole)."""
    model, _ = deferred(model_type, implementation)
    opt = model.sonar
    model(**batches(1)[0]).loss.backward()
    fragment, _why = CROSSES_OVER[model_type, implementation]
    experts = [opt.expert_name(p) for p in opt.expert_group["params"]]
    report = opt.report()["deferred"]
    assert sorted(report["crossed_over"]) == sorted(n for n in experts if fragment in n), report
    assert report["kept_whole"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_forms_recipe_is_autograds_gradient(dtype):
    """Per tensor, the gradient the step computes from the kept operands equals autograd's, bitwise."""
    model = Forms(dtype)
    twin = copy.deepcopy(model)
    sonar_fx.compile(model, cfg_for("all"), compiler="eager", schedule="deferred", experts=EXPERT_NAMES)
    g = torch.Generator().manual_seed(1)
    x_Td, ids_T = torch.randn(12, 8, generator=g, dtype=dtype), torch.randint(0, 3, (12,), generator=g)
    model(x_Td, ids_T).backward()
    twin(x_Td, ids_T).backward()
    opt, grads = model.sonar, {n: p.grad for n, p in twin.named_parameters()}
    report = opt.report()["deferred"]
    assert report["kept_whole"] == [] and report["crossed_over"] == {}, report
    for name in EXPERT_NAMES:
        param = getattr(model, name)
        assert param.grad is None and opt.deferred.kept[id(param)].groups(), name  # operands, no gradient
        assert torch.equal(opt.deferred.gradient(param, consume=False), grads[name]), name
    # Negative control: the ids repeat, so a put that overwrites instead of accumulating is other values
    overwritten = torch.zeros_like(model.table_Ed).index_put_((ids_T,), x_Td)
    assert not torch.equal(overwritten, grads["table_Ed"])


MM_RECIPE = Recipe("aten.mm.default", [{"operand": 0}, {"operand": 1}], {}, None, []).to_json()
"""`dy^T.mm(x)`: a slice GEMM's weight gradient over its kept (dy^T, x)."""


def _keep_slices(store: DeferredGrads, w_fd: torch.Tensor, name: str, sides: list[torch.Tensor]):
    """Three slice GEMMs' operands for `w_fd` kept, each its own backward's: (dy^T, x) of two rows of
    `sides` = [dy_1, x_1, dy_2, x_2, ...] (one pair for all three, or a pair each). Returns the bytes the
    store kept after each, and plain torch's gradient: the three summed in order."""
    live, grads = [], []
    for i, rows in enumerate((slice(0, 2), slice(2, 4), slice(4, 6))):
        pair = 2 * i % len(sides)
        dy_tf, x_td = sides[pair][rows], sides[pair + 1][rows]
        store.add(w_fd, name, MM_RECIPE, [dy_tf.t(), x_td])
        live.append(store.live_bytes)
        grads.append(dy_tf.t().mm(x_td))
    return live, grads[0] + grads[1] + grads[2]


def test_the_store_counts_each_storage_once():
    """Kept operands cost the storages they keep alive, each once: an eager loop's slices of one buffer
    (jetmoe's split() inputs, cat()'s gradient) count that buffer once for the tensor's crossover rule
    and once in the store's live bytes, across expert tensors too; separate storages count each. The
    gradient the step computes is plain torch's either way."""
    g = torch.Generator().manual_seed(0)
    w_fd, v_fd = torch.zeros(16, 16), torch.zeros(16, 16)  # 1,024 bytes each
    one_pair = [torch.randn(6, 16, generator=g) for _ in range(2)]  # dy, x: 384 bytes each
    store = DeferredGrads(meter=ExpertGradMeter())
    live, w_expected = _keep_slices(store, w_fd, "w", one_pair)
    # Six views of two storages: 768 bytes throughout (counted per view: 2,304, beyond w's 1,024).
    assert live == [768, 768, 768] and store.crossed == {} and len(store.entries()) == 3
    live, v_expected = _keep_slices(store, v_fd, "v", one_pair)
    assert live == [768, 768, 768] and store.crossed == {}  # once across tensors too
    assert torch.equal(store.gradient(w_fd, consume=True), w_expected)
    assert store.live_bytes == 768  # v still keeps both storages
    assert torch.equal(store.gradient(v_fd, consume=False), v_expected)
    store.discard(v_fd)  # the keep budget's drop
    assert store.live_bytes == 0 and store.peak_bytes == 768

    # Negative control: the same views, each contribution's in storages of its own (768 bytes each)
    # outgrow w at the second: it crosses over, held as one gradient (a later contribution outside any
    # backward is added into it at once; its operands lived beside it for a moment: the peak), counted
    # by the store and the meter alike.
    store = DeferredGrads(meter=ExpertGradMeter())
    separate = [torch.randn(6, 16, generator=g) for _ in range(6)]
    live, w_expected = _keep_slices(store, w_fd, "w", separate)
    assert live == [768, 1024, 1024] and store.crossed == {"w": 2 * 768} and store.crossed_over(w_fd)
    assert store.peak_bytes == 1024 + 768 and store.meter is not None and store.meter.live == 1024
    assert torch.equal(store.gradient(w_fd, consume=True), w_expected)
    assert store.live_bytes == 0 and store.meter.live == 0
