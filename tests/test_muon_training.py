"""Muon in training: Sonar's in-backward Muon equals the end-of-step recipe built from torch's own
optimizers (torch.optim.Muon on each expert matrix as its own 2-D parameter and on each hidden matrix,
torch.optim.AdamW(fused=True) on the rest, dense-only clipping), eager and compiled (aot_eager), fp32
and bf16, under an LR that changes every step; which dense tensors are matrices; what is refused;
non-finite gradients; state dicts and the command line's resume. Every exactness claim is
`torch.equal`, with negative controls that must differ.
"""

import inspect
import json

import pytest
import torch
from test_resume import assert_same_state
from torch import nn

import sonar_fx
from sonar_fx.cli import build_parser, main, train_config
from sonar_fx.config import MuonConfig
from sonar_fx.distributed.reductions import ShardedGrads
from sonar_fx.experts.discovery import discover_experts
from sonar_fx.memory import ExpertGradBytes, measure_peak
from sonar_fx.methods import build_method
from sonar_fx.models import build_model
from sonar_fx.optim.matrices import dense_roles
from sonar_fx.trainer import checkpoint as ckpt_io
from sonar_fx.trainer.config import ConfigError, TrainConfig
from sonar_fx.trainer.validate import optimizer_config

from helpers import assert_same_weights, batches, weights_differ

CFG = MuonConfig(lr=2e-2, weight_decay=0.1, max_grad_norm=0.5)
EXPERT_TENSORS = 4  # tiny-olmoe: 2 layers x (gate_up, down)


def _train(method, cfg=CFG, *, compiler="eager", dtype=torch.float32, steps=3, schedule=True, **kw):
    model = build_model("tiny-olmoe", dtype=dtype, seed=0)
    m = build_method(method, model, cfg, compiler=compiler, **kw)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in m.optimizers]
    for b in batches(steps):
        m.train_step(b)
        for s in scheds if schedule else []:
            s.step()
    return model, m


class _Twins(dict):
    """The end-of-step twin (eager, torch's optimizers), trained on first use, once per dtype."""

    def __missing__(self, dtype):
        self[dtype] = _train("standard_no_expert_clip", dtype=dtype)[0]
        return self[dtype]


@pytest.fixture(scope="module")
def twins():
    return _Twins()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiler", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])  # 11-14 s
def test_sonar_muon_equals_torch_muon_twin_bitwise(compiler, dtype, twins):
    torch._dynamo.reset()
    model, method = _train("sonar", compiler=compiler, dtype=dtype)
    assert_same_weights(model, twins[dtype])
    assert len(weights_differ(model, build_model("tiny-olmoe", dtype=dtype, seed=0))) == len(
        list(model.parameters())
    ), "every tensor trains"
    opt = method.optimizer
    report = opt.report()
    path = "updates_in_graph" if compiler == "aot_eager" else "updates_by_hook"
    assert report[path] == 3 * EXPERT_TENSORS and report["expert_rule"] == "muon"
    assert report["recompiles"] == 0 and report["fallbacks"] == []
    assert [g["name"] for g in opt.param_groups] == ["dense", "experts", "dense_matrices"]
    assert len(opt.param_groups[2]["params"]) == 8  # q, k, v, o of 2 layers
    assert set(opt.grad_norms()["experts"]) == {t.name for layer in opt.expert_layers for t in layer.tensors}


def test_negative_control_without_its_lr_schedule_differs(twins):
    unscheduled, _ = _train("sonar", schedule=False)  # the twin has one
    assert weights_differ(unscheduled, twins[torch.float32])


def test_routers_take_adamw_unless_asked():
    for routers, matrices in (("adamw", 8), ("muon", 10)):
        model = build_model("tiny-olmoe")
        opt = sonar_fx.prepare(model, MuonConfig(routers=routers))
        hidden = {id(p) for p in opt.param_groups[2]["params"]}
        gates = [layer.mlp.gate.weight for layer in model.model.layers]
        assert len(hidden) == matrices
        assert all((id(g) in hidden) == (routers == "muon") for g in gates)


@pytest.mark.slow  # a model whose expert gradients outweigh its activations (tests/test_memory.py's)
def test_sonar_muon_holds_one_layer_of_expert_grads_plus_one_updates_temporaries():
    """The saving, measured as tests/test_memory.py measures AdamW's: the step's transient peak (CPU
    allocator events) of Sonar's Muon, of its end-of-step twin, and of the twin with frozen experts
    (what the step costs besides expert gradients). Sonar holds one layer of expert gradients plus
    what one expert tensor's update allocates: an fp32 tensor and its bf16 copy (1.5x the tensor);
    the twin holds every expert gradient at step()."""
    shape = dict(hidden_size=64, intermediate_size=128, num_experts=32, num_layers=4)

    def peak(method, freeze=False):
        model = build_model("tiny-reference", **shape)
        layers = discover_experts(model)
        m = build_method(method, model, CFG)
        for t in (t for layer in layers for t in layer.tensors if freeze):
            t.param.requires_grad_(False)
        first, measured = batches(2, seq=32)
        m.train_step(first)  # optimizer state exists before the measured step, as in steady training
        return measure_peak(lambda: m.train_step(measured))[1].peak_bytes, layers

    standard, layers = peak("standard_no_expert_clip")
    sonar, _ = peak("sonar")
    no_expert_grads, _ = peak("standard_no_expert_clip", freeze=True)
    grads = ExpertGradBytes.of(layers)
    largest = max(t.param.numel() * t.param.element_size() for layer in layers for t in layer.tensors)
    assert sonar - no_expert_grads <= grads.one_layer + 1.5 * largest, (sonar, no_expert_grads)
    assert standard >= grads.total > grads.one_layer + 1.5 * largest  # the twin holds them all at once
    assert standard - sonar >= grads.predicted_saving - 1.5 * largest - grads.one_layer, (standard, sonar)


def test_per_expert_ablation_equals_twin(twins):
    model, method = _train("sonar_per_expert")
    assert_same_weights(model, twins[torch.float32])
    assert method.optimizer.report()["update_calls"] == 3 * EXPERT_TENSORS * 8  # 8 experts per tensor


def test_dense_roles_split_matrices_from_embeddings_heads_routers_and_vectors():
    model = build_model("tiny-olmoe")
    roles = dense_roles(model, discover_experts(model))
    by_role = {role: sorted(n for n, r in roles.items() if r == role) for role in set(roles.values())}
    assert by_role["embedding"] == ["model.embed_tokens.weight"]
    assert by_role["head"] == ["lm_head.weight"]
    assert by_role["router"] == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert len(by_role["matrix"]) == 8 and all(
        "self_attn" in n and n.endswith("proj.weight") for n in by_role["matrix"]
    )
    assert all(n.endswith("norm.weight") for n in by_role["other"])
    # A model without get_output_embeddings: the head is the Linear onto the vocabulary.
    ref = build_model("tiny-reference")
    roles = dense_roles(ref, discover_experts(ref))
    assert roles["embed.weight"] == "embedding" and roles["lm_head.weight"] == "head"
    assert roles["layers.0.mlp.router.weight"] == "router" and roles["layers.0.mix.weight"] == "other"


class _BiasedExperts(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.num_experts = 4
        if fused:  # (E*n, d) weights, rows of expert e together
            self.w1, self.w2 = nn.Parameter(torch.randn(4 * 8, 6)), nn.Parameter(torch.randn(4 * 8, 6))
        else:
            self.up, self.down = nn.Parameter(torch.randn(4, 8, 6)), nn.Parameter(torch.randn(4, 6, 8))
            self.bias = nn.Parameter(torch.zeros(4, 8))


def test_refusals_name_the_fix():
    with pytest.raises(sonar_fx.SonarUsageError, match="expert_biases='dense'"):
        sonar_fx.prepare(_BiasedExperts(), CFG)
    sonar_fx.prepare(_BiasedExperts(), CFG, expert_biases="dense")  # the fix works
    with pytest.raises(sonar_fx.SonarUsageError, match=r"fused or flattened layout.*AdamWConfig"):
        sonar_fx.prepare(_BiasedExperts(fused=True), CFG)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"FSDP2.*sonar_fx.distributed.ddp or expert_parallel"):
        sonar_fx.prepare(build_model("tiny-olmoe"), CFG, distributed=ShardedGrads(world_size=2))


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_expert_gradient_leaves_its_weights_and_momentum_untouched(policy):
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.compile(model, CFG, compiler="eager", nonfinite=policy).sonar
    b0, b1 = batches(2)
    model(**b0).loss.backward()
    opt.step()
    opt.zero_grad()
    target = opt.expert_group["params"][0]
    before = {
        p: (p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in opt.expert_group["params"]
    }
    handle = target.register_hook(lambda g: g * float("inf"))
    if policy == "skip":
        with pytest.warns(UserWarning, match="step skipped"):
            model(**b1).loss.backward()
            opt.step()
    else:
        with pytest.raises(sonar_fx.NonFiniteGradientError, match="non-finite expert gradients"):
            model(**b1).loss.backward()
        opt.abandon_step()
    handle.remove()
    weights, buf = before[target]
    assert torch.equal(target, weights) and torch.equal(opt.state[target]["momentum_buffer"], buf)
    others = [p for p in opt.expert_group["params"] if p is not target]
    assert all(not torch.equal(p, before[p][0]) for p in others)  # control: finite ones updated


COMMON = [
    "finetune", "--model", "tiny-olmoe", "--compiler", "eager", "--train-size", "8", "--held-out", "0",
    "--steps", "2", "--warmup", "1", "--lr", "1e-2", "--max-grad-norm", "0.5", "--weight-decay", "0.01",
    "--optimizer", "muon", "--method", "sonar", "--no-progress",
]  # fmt: skip


def test_cli_muon_checkpoint_resumes_bitwise(tmp_path):
    """State dicts (three groups, the momentum buffers) through a checkpoint: 2 steps straight equal
    1 step, stop, resume, 1 step (the twin's MuonTwin state dict: tests/test_muon.py)."""
    assert main([*COMMON, "--out", str(tmp_path / "straight")]) == 0
    split = [*COMMON, "--out", str(tmp_path / "split")]
    assert main([*split, "--stop-after", "1"]) == 0
    halfway = ckpt_io.load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert main([*split, "--resume"]) == 0
    a = ckpt_io.load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = ckpt_io.load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    for key in ("model", "optimizers", "schedulers", "identity"):
        assert_same_state(a[key], b[key], key)
    (opt_state,) = a["optimizers"]
    assert [g["name"] for g in opt_state["param_groups"]] == ["dense", "experts", "dense_matrices"]
    assert all(not torch.equal(v, a["model"][k]) for k, v in halfway["model"].items())  # the check has teeth
    assert a["identity"]["momentum"] == 0.95 and a["identity"]["nesterov"] is True
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(x["grad_norm_dense"] > 0 for x in lines)
    assert len(lines[0]["grad_norm_experts"]) == EXPERT_TENSORS


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (("--optimizer", "muon", "--dampening", "0.1"), "--dampening"),
        (("--optimizer", "muon", "--state-bits", "8"), "--state-bits"),
        (("--optimizer", "adamw", "--adjust-lr-fn", "original"), "--adjust-lr-fn"),
        (("--optimizer", "muon", "--betas", "0.9", "1.0"), "--betas"),
    ],
)
def test_cli_refuses_flags_muon_has_no_use_for(tmp_path, capsys, flags, blamed):
    argv = ["finetune", "--model", "tiny-olmoe", "--steps", "1", "--no-progress", "--out", str(tmp_path)]
    assert main([*argv, *flags]) == 2
    assert f"error: {blamed}" in capsys.readouterr().err


def test_trainer_refuses_muon_on_fsdp2_before_anything_runs():
    with pytest.raises(ConfigError, match=r"--parallel: MuonConfig with FSDP2.*--parallel ddp or ep") as err:
        optimizer_config(TrainConfig(optimizer="muon", parallel="fsdp2"), 1e-3)
    assert err.value.flag == "--parallel"
    assert isinstance(optimizer_config(TrainConfig(optimizer="muon", parallel="ep"), 1e-3), MuonConfig)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--optimizer", "muon"), inspect.signature(torch.optim.Muon).parameters["weight_decay"].default),
        (("--optimizer", "muon", "--weight-decay", "0"), 0.0),  # an explicit zero is kept
        (("--optimizer", "adamw"), 0.0),
    ],
)
def test_cli_weight_decay_defaults_to_torchs_for_muon(flags, expected):
    args = build_parser().parse_args(["finetune", "--model", "tiny-olmoe", *flags])
    opt_cfg = optimizer_config(train_config(args), 1e-3)
    assert opt_cfg.weight_decay == expected
    assert MuonConfig().weight_decay == inspect.signature(torch.optim.Muon).parameters["weight_decay"].default
