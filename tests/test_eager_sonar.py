"""Eager Sonar-MoE (hooks) is exact: bitwise equal to standard training that clips only dense grads."""

import pytest
import torch

import sonar_fx
from sonar_fx.experts.discovery import ExpertSet, discover_experts
from sonar_fx.methods import build_method
from sonar_fx.models import build_model

from helpers import CFG, assert_same_weights, batches, trained, weights_differ

MODELS = ["tiny-olmoe", "tiny-granitemoe"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_name", MODELS)
def test_sonar_equals_standard_no_expert_clip_bitwise(model_name, dtype):
    sonar, _ = trained("sonar", model_name, dtype)
    twin, _ = trained("standard_no_expert_clip", model_name, dtype)
    assert_same_weights(sonar, twin)
    initial = build_model(model_name, dtype=dtype, seed=0)
    moved = weights_differ(sonar, initial)
    experts = {t.name for layer in discover_experts(sonar) for t in layer.tensors}
    assert experts <= set(moved), "every expert tensor must have moved"
    assert len(moved) == len(list(sonar.parameters()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_clip_differs_so_the_exactness_test_has_teeth(dtype):
    sonar, _ = trained("sonar", "tiny-olmoe", dtype)
    standard, _ = trained("standard", "tiny-olmoe", dtype)
    experts = {t.name for layer in discover_experts(sonar) for t in layer.tensors}
    assert experts & set(weights_differ(sonar, standard))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_expert_equals_batched_bitwise(dtype):
    batched, mb = trained("sonar", "tiny-olmoe", dtype)
    per_expert, mp = trained("sonar_per_expert", "tiny-olmoe", dtype)
    assert_same_weights(batched, per_expert)
    num_layers, num_experts = 2, 8
    assert mb.optimizer.stats.update_calls == 3 * 2 * num_layers
    assert mp.optimizer.stats.update_calls == 3 * 2 * num_layers * num_experts


def test_oib_all_equals_standard_without_clipping_bitwise():
    no_clip = CFG.__class__(**{**CFG.__dict__, "max_grad_norm": None})
    oib, _ = trained("oib_all", "tiny-olmoe", torch.float32, cfg=no_clip)
    standard, _ = trained("standard", "tiny-olmoe", torch.float32, cfg=no_clip)
    assert_same_weights(oib, standard)
    clipped, _ = trained("standard", "tiny-olmoe", torch.float32)
    assert weights_differ(oib, clipped)


@pytest.mark.parametrize(("expert_bits", "dense_bits"), [(8, 32), (8, 8), (32, 32)])
def test_oib_all_stores_each_tensors_states_as_sonar_does(expert_bits, dense_bits):
    """Expert tensors get the expert rule's optimizer (torchao's 8-bit one with state_bits=8), dense
    tensors the dense rule's: the baseline holds the states Sonar holds (no step: nothing compiles)."""
    pytest.importorskip("torchao")
    cfg = sonar_fx.AdamWConfig(lr=1e-3, state_bits=expert_bits, dense_state_bits=dense_bits)
    model = build_model("tiny-olmoe", seed=0)
    method = build_method("oib_all", model, cfg)
    experts = {id(p) for p in ExpertSet.discover(model).split(model).expert_params}
    kinds = {
        (id(p) in experts, type(method.hook_optimizers[id(p)]).__name__)
        for p in model.parameters()
        if p.requires_grad
    }
    name = {8: "AdamW8bit", 32: "AdamW"}
    assert kinds == {(True, name[expert_bits]), (False, name[dense_bits])}


def test_after_backward_expert_grads_freed_and_hooks_fire_2L_times():
    model = build_model("tiny-olmoe", seed=0)
    method = build_method("sonar", model, CFG)
    opt = method.optimizer
    layers = discover_experts(model)
    for step, batch in enumerate(batches(2), start=1):
        method.forward_backward(batch)
        for layer in layers:
            assert all(t.param.grad is None for t in layer.tensors)
        expert_ids = {id(t.param) for layer in layers for t in layer.tensors}
        dense = [p for p in model.parameters() if id(p) not in expert_ids]
        assert all(p.grad is not None for p in dense)
        assert opt.stats.updates["hook"] == step * 2 * len(layers)
        assert opt.stats.updates["graph"] == 0
        method.optimizer_step()
        assert all(p.grad is None for p in dense)
    report = opt.report()
    assert report["expert_layers"] == len(layers) and report["expert_tensors"] == 2 * len(layers)
    assert set(report["last_step"].values()) == {"hook"}
    assert len(report["last_step"]) == 2 * len(layers)
