"""The deferred schedule on torchtitan's own MoE layer (`torchtitan.models.common.moe.MoE`, 0.3.0).

Its experts are `GroupedExperts`: w1 (E, F, D) gate, w3 (E, F, D) up, w2 (E, D, F) down, each read as
`torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs)` (the experts always compute in
bf16; fp32 weights are cast in the forward, and their gradient cast back in backward: ToCopyBackward0).
Eager, the capture keeps the bf16 GEMM's operands through the cast; compiled, the graph pass keeps the
cast in its recipe. A tiny language model around one such layer (embedding, the
layer as a residual, a head), against its standard run compiled the same way (`test_deferred.Twin`: fused
AdamW, the clip over every parameter): `torch.equal` on every parameter after a step of one micro-batch
(where the operands kept plus one gradient stay below the whole gradients) and a step of four.
torchtitan is installed by the Makefile with --no-deps (requirements-torchtitan.txt says why); without
it these tests skip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import sonar_fx
from sonar_fx.memory import ExpertGradBytes

from helpers import assert_same_weights
from test_deferred import MAX_NORM, Twin, cfg_for

moe = pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan: make test installs it")
dispatch = pytest.importorskip("torchtitan.models.common.token_dispatcher")
linear = pytest.importorskip("torchtitan.models.common.linear")

pytestmark = pytest.mark.filterwarnings(
    # torchtitan's router asks for an fp32 autocast around its gate; CPU autocast has no fp32 and says so.
    "ignore:In CPU autocast, but the target dtype is not supported:UserWarning"
)

DIM, HIDDEN, EXPERTS, TOP_K, VOCAB = 64, 32, 8, 2, 64
ACCUM = 4
EXPERT_NAMES = {f"moe.routed_experts.inner_experts.{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")}


class TinyTitanLM(nn.Module):
    """An embedding, torchtitan's MoE layer as a residual, and a head: the loss of next tokens."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = moe.MoE.Config(
            num_experts=EXPERTS,
            routed_experts=moe.RoutedExperts.Config(
                inner_experts=moe.GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
                token_dispatcher=dispatch.LocalTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
            ),
            router=moe.TokenChoiceTopKRouter.Config(
                num_experts=EXPERTS,
                gate=linear.Linear.Config(in_features=DIM, out_features=EXPERTS),
                top_k=TOP_K,
                score_func="softmax",
            ),
            load_balance_coeff=None,
        ).build()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # torchtitan leaves its expert weights uninitialised (torch.empty)
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        self.to(dtype)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.moe(h)
        return nn.functional.cross_entropy(self.head(h).float().view(-1, VOCAB), labels.view(-1))


def token_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, VOCAB, (2, 8), generator=generator) for _ in range(2)) for _ in range(n)]


def step(model, opt, twin: Twin, data) -> float:
    for ids, labels in data:
        model(ids, labels).backward()
        twin.run(ids, labels).backward()
    opt.step()
    opt.zero_grad()
    twin.step()
    return opt.grad_norms()["total"]


def deferred_pair(compiler: str, dtype: torch.dtype):
    torch._dynamo.reset()
    counters.clear()
    model = TinyTitanLM(dtype)
    twin_model = copy.deepcopy(model)
    sonar_fx.compile(model, cfg_for("all"), compiler=compiler, schedule="deferred")
    opt = model.sonar
    assert {opt.expert_name(p) for p in opt.expert_group["params"]} == EXPERT_NAMES  # discovery finds them
    return model, opt, twin_model, Twin(twin_model, EXPERT_NAMES, "all", compiler)


CASES = [
    pytest.param("eager", torch.bfloat16, id="eager-bf16"),
    # eager fp32: the GEMM reads `w.bfloat16().transpose(-2, -1)`; the capture keeps the bf16 GEMM's
    # operands, and the recipe is that GEMM, then ToCopyBackward's cast back to fp32
    pytest.param("eager", torch.float32, id="eager-fp32"),
    pytest.param("aot_eager", torch.bfloat16, id="aot_eager-bf16"),
    # compiled fp32: the recipe is a program (the grouped GEMM, its transposes, the cast back to fp32)
    pytest.param("aot_eager", torch.float32, id="aot_eager-fp32"),
]


@pytest.mark.parametrize(("compiler", "dtype"), CASES)
@pytest.mark.usefixtures("deferred_saving_lost")  # 4 micro-batches of a tiny layer cross over
def test_torchtitan_moe_keeps_operands_and_is_its_standard_run(compiler, dtype):
    model, opt, twin_model, twin = deferred_pair(compiler, dtype)
    initial = copy.deepcopy(twin_model.state_dict())
    data = token_batches(1 + ACCUM)

    # One micro-batch (below the crossover): operands kept, not gradients (nor the bf16 gradient under
    # the cast back, which a recipe of the cast alone would keep: every kept operand is 2-D or less).
    ids, labels = data[0]
    model(ids, labels).backward()
    kept_shapes = [tuple(o.shape) for e in opt.deferred.entries() for o in e.operands]
    assert len(opt.deferred.entries()) == 3 and max(map(len, kept_shapes)) <= 2, kept_shapes
    twin.run(ids, labels).backward()
    opt.step()
    opt.zero_grad()
    twin.step()
    bounds = ExpertGradBytes.of(opt.expert_layers)
    kept = opt.report()["deferred"]["kept_operand_peak"]
    assert kept > 0 and kept + max(bounds.tensor_sizes) < bounds.total, (kept, bounds)

    assert step(model, opt, twin, data[1:]) > MAX_NORM  # the clip over every parameter was active
    assert_same_weights(model, twin_model)
    moved = [n for n in EXPERT_NAMES if not torch.equal(model.get_parameter(n), initial[n])]
    assert len(moved) == len(EXPERT_NAMES)  # the experts trained (twins that never moved prove nothing)
    report = opt.report()
    assert report["deferred"]["kept_whole"] == [] and report["updates_deferred"] == 2 * 3, report
    if compiler != "eager":
        assert counters["sonar"]["deferred"] == 3  # each expert output of the one graph rewritten


def test_negative_control_the_twin_with_a_dense_only_clip_differs():
    """The twin with the clip over every parameter is not trivially equal: a dense-only clip differs."""
    model, opt, twin_model, _ = deferred_pair("eager", torch.bfloat16)
    dense_only = Twin(twin_model, EXPERT_NAMES, "dense", "eager")
    assert step(model, opt, dense_only, token_batches(1)) > MAX_NORM
    pairs = zip(model.parameters(), twin_model.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)
