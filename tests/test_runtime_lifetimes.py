"""Lifetimes and guards of the runtime layer: nothing keeps a model alive, nothing trains a tensor
that was cast, moved or wrapped behind Sonar's back, and the update op is part of the cache key."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import torch

import sonar_fx
from sonar_fx import backend
from sonar_fx.backend import SonarPartitioner
from sonar_fx.models import build_model
from sonar_fx.runtime import registry

import distributed_worker
from helpers import CFG, batches


@pytest.mark.parametrize("compiler", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_deleting_model_and_optimizer_frees_both(compiler):
    torch._dynamo.reset()
    gc.collect()  # models of earlier tests that are already unreachable
    bound = registry.bound_count()
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler=compiler)
    opt = model.sonar
    b = batches(1)[0]
    model(**b).loss.backward()
    opt.step()
    assert registry.bound_count() == bound + 4
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert model_ref() is None and opt_ref() is None
    assert registry.bound_count() == bound


def test_hooks_do_not_keep_the_optimizer_alive():
    model = build_model("tiny-olmoe", seed=0)
    opt_ref = weakref.ref(sonar_fx.prepare(model, CFG))
    del model.__dict__["sonar"]
    gc.collect()
    assert opt_ref() is None, "hooks or the registry hold the optimizer"
    model(**batches(1)[0]).loss.backward()  # an orphaned tensor trains as a plain one: .grad is kept
    assert all(p.grad is not None for p in model.parameters())


def test_cast_after_training_started_is_caught_at_the_first_update():
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    b0, b1 = batches(2)
    model(**b0).loss.backward()
    model.sonar.step()
    model.to(torch.bfloat16)
    with pytest.raises(sonar_fx.SonarUsageError, match=r"cast or moved .*model\.half\(\), model\.to"):
        model(**b1).loss.backward()


def test_half_after_prepare_is_refused_before_any_update():
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    model.half()
    experts = [t.param.detach().clone() for layer in model.sonar.expert_layers for t in layer.tensors]
    with pytest.raises(sonar_fx.SonarUsageError, match="float16"):
        model(**batches(1)[0]).loss.backward()
    after = [t.param for layer in model.sonar.expert_layers for t in layer.tensors]
    assert all(torch.equal(a, b) for a, b in zip(experts, after, strict=True))


def test_cast_before_the_first_step_trains_in_the_new_dtype():
    model = sonar_fx.compile(build_model("tiny-olmoe", seed=0), CFG, compiler="eager")
    model.to(torch.bfloat16)
    model(**batches(1)[0]).loss.backward()
    model.sonar.step()
    state = model.sonar.state[model.sonar.expert_group["params"][0]]
    assert state["exp_avg"].dtype == torch.bfloat16


def test_block_running_twice_per_forward_fails_loudly_never_silently():
    """One block called twice per forward, compiled per block: the second call's backward graph would
    update the weight that the first call's backward still needs. Refused at the block's second
    forward, before any weight moves (the compiled in-backward schedule runs one forward per backward)."""
    torch._dynamo.reset()
    model = build_model("tiny-reference", seed=0, num_layers=1)
    model.layers.append(model.layers[0])  # the same block twice: weights shared across depth
    sonar_fx.compile(model, CFG, compiler="aot_eager", regional=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(sonar_fx.SonarUsageError, match="runs twice in one forward"):
        model(**batches(1)[0]).loss.backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _update_in_backward(opt, param, times):
    """Run a backward during which `param` is updated `times` times (as two graphs would)."""
    x = torch.ones(1, requires_grad=True)

    def hook(_):
        for _ in range(times):
            opt.update_expert_(param, torch.zeros_like(param), path="graph")

    x.register_post_accumulate_grad_hook(hook)
    (x * 2).sum().backward()


def test_second_gradient_errors_tell_one_backward_from_accumulation():
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.prepare(model, CFG)
    param = opt.expert_group["params"][0]
    with pytest.raises(sonar_fx.SonarUsageError, match="two gradients in one backward"):
        _update_in_backward(opt, param, times=2)
    opt.abandon_step()
    _update_in_backward(opt, param, times=1)
    with pytest.raises(sonar_fx.SonarUsageError, match="looks like gradient accumulation"):
        _update_in_backward(opt, param, times=1)


def test_cache_key_covers_the_update_op_source(tmp_path, monkeypatch):
    sources = []
    for path in backend._SOURCES:
        copy_path = tmp_path / f"{len(sources)}_{path.rsplit('/', 1)[-1]}"
        shutil.copy(path, copy_path)
        sources.append(str(copy_path))
    monkeypatch.setattr(backend, "_SOURCES", tuple(sources))
    before = SonarPartitioner({3, 7}).uuid()
    assert SonarPartitioner({3}).uuid() != before  # (also evicts torch's one-entry cache of file hashes)
    (op_copy,) = [p for p in sources if p.endswith("update_op.py")]
    with open(op_copy, "a") as f:
        f.write("\n# changed\n")
    assert SonarPartitioner({3, 7}).uuid() != before


@pytest.mark.multiprocess
def test_plain_prepare_of_ddp_experts_is_refused_and_names_the_supported_call(tmp_path):
    """DDP itself is supported through sonar_fx.distributed.ddp (tests/test_distributed.py); a plain
    prepare of a DDP-wrapped model, or a DDP wrapper added after prepare, would update from local
    gradients and is refused."""
    distributed_worker.run("ddp_guard", str(tmp_path))
    for seen in distributed_worker.results(str(tmp_path)):
        expert = "module.model.layers.0.mlp.experts.gate_up_proj"
        assert seen["prepare_ddp"].startswith(
            f"{expert} is an expert tensor managed by DistributedDataParallel"
        )
        assert "sonar_fx.distributed.ddp(model, cfg) on the unwrapped model" in seen["prepare_ddp"]
        assert "this rank's local one" in seen["wrapped_after_prepare"]
        assert "sonar_fx.distributed" in seen["wrapped_after_prepare"]
        assert seen["experts_unchanged"] == "True"
