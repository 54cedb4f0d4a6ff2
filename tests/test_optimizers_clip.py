"""Expert clipping modes, logged gradient norms and low-bit expert states, each against its reference:
per-tensor and global clipping against standard training clipping the same way (bitwise, eager and
aot_eager; inductor for one model), the norms against `torch.linalg.vector_norm` of the gradients a
twin run captured, torchao's low-bit AdamW applied inside the update against torchao's own optimizer
applied at the end of the step. Negative controls show each check can fail.
"""

import copy
import io
import json

import pytest
import torch

import sonar_fx
from sonar_fx.cli import main
from sonar_fx.methods import build_method, twin_method
from sonar_fx.models import build_model

from helpers import assert_same_weights, batches, weights_differ

# A small clip threshold, so that clipping is active at every step (checked below). SGD: Adam's update
# barely changes when a whole tensor's gradient is scaled, so clipping would hardly show in its weights.
BASE = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, max_grad_norm=0.5)
CLIPS = {
    mode: sonar_fx.SGDConfig(lr=5e-2, momentum=0.9, weight_decay=0.01, max_grad_norm=0.02, expert_clip=mode)
    for mode in (None, "per_tensor", "global")
}


def _train(method, cfg, *, compiler="eager", dtype=torch.bfloat16, steps=3, capture=None):
    """Train 3 steps; `capture(method)` runs after each backward, before the optimizer step."""
    model = build_model("tiny-olmoe", dtype=dtype, seed=0)
    m = build_method(method, model, cfg, compiler=compiler)
    for b in batches(steps):
        m.forward_backward(b)
        if capture is not None:
            capture(m)
        m.optimizer_step()
    return model, m


@pytest.fixture(scope="module")
def twins():
    """Standard training clipping as each mode says (eager, bf16), trained once."""
    return {mode: _train(twin_method(cfg), cfg)[0] for mode, cfg in CLIPS.items()}


@pytest.fixture(scope="module")
def one_compile():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compiler", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["per_tensor", "global"])
def test_clip_mode_equals_standard_training_clipping_the_same_way(mode, compiler, twins, one_compile):
    model, method = _train("sonar", CLIPS[mode], compiler=compiler)
    assert_same_weights(model, twins[mode])
    # Negative controls: the other modes' twins differ, so the clipping was active and is what matched.
    assert all(weights_differ(model, twins[other]) for other in CLIPS if other != mode)
    report = method.optimizer.report()
    path = "updates_in_graph" if compiler == "aot_eager" else "updates_by_hook"
    assert report[path] == 12 and report["fallbacks"] == [] and report["expert_clip"] == mode
    norms = report["grad_norms"]
    assert max(norms["experts"].values()) > 0.02  # the threshold: clipping was active
    assert (norms["total"] is not None) == (mode == "global")


def test_global_clip_refuses_a_plain_backward_before_updating_anything():
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.compile(model, CLIPS["global"], compiler="eager").sonar
    before = [p.detach().clone() for p in opt.expert_group["params"]]
    with pytest.raises(sonar_fx.SonarUsageError, match=r"optimizer.backward\(lambda"):
        model(**batches(1)[0]).loss.backward()
    assert all(torch.equal(p, q) for p, q in zip(opt.expert_group["params"], before, strict=True))


def test_deep_copy_with_global_clip_trains_its_own_tensors_exactly(twins):
    original = build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0)
    sonar_fx.compile(original, CLIPS["global"], compiler="eager")
    model = copy.deepcopy(original)
    opt = model.sonar
    assert opt is not original.sonar
    for b in batches(3):
        opt.backward(lambda b=b: model(**b).loss)
        opt.step()
        opt.zero_grad()
    assert_same_weights(model, twins["global"])
    assert not weights_differ(original, build_model("tiny-olmoe", dtype=torch.bfloat16, seed=0))


def test_global_clip_never_holds_more_than_one_expert_gradient():
    """The norm pass frees each expert gradient once its norm is taken; the update pass too."""
    model = build_model("tiny-olmoe", seed=0)
    opt = sonar_fx.compile(model, CLIPS["global"], compiler="eager").sonar
    experts, alive = opt.expert_group["params"], []
    update = opt.update_expert_

    def counting(param, grad, *, path):
        alive.append(sum(p.grad is not None for p in experts))
        update(param, grad, path=path)

    opt.update_expert_ = counting
    for b in batches(2):
        opt.backward(lambda b=b: model(**b).loss)
        assert all(p.grad is None for p in experts)
        opt.step()
        opt.zero_grad()
    assert len(alive) == 2 * 2 * len(experts) and max(alive) == 1
    with pytest.raises(sonar_fx.SonarUsageError, match="closure"):
        opt.backward(model(**batches(1)[0]).loss)


def test_logged_norms_equal_vector_norm_of_the_twins_gradients(one_compile):
    """Sonar's norms (taken inside its updates, aot_eager) against the twin's captured gradients."""
    cfg = CLIPS["global"]
    captured = []

    def capture(m):
        params = dict(m.model.named_parameters()) if hasattr(m.model, "named_parameters") else {}
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        experts = {n: torch.linalg.vector_norm(g) for n, g in grads.items() if ".experts." in n}
        dense_grads = [g for n, g in grads.items() if ".experts." not in n]
        norm_of = lambda gs: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))  # noqa: E731
        captured.append({"experts": experts, "dense": norm_of(dense_grads), "total": norm_of(grads.values())})

    _train("standard", cfg, capture=capture)
    seen = []
    _train("sonar", cfg, compiler="aot_eager", capture=lambda m: seen.append(m.optimizer.clipper.current))
    assert len(seen) == len(captured) == 3
    for mine, ref in zip(seen, captured, strict=True):
        assert mine.experts.keys() == ref["experts"].keys()
        for name, norm in ref["experts"].items():
            assert torch.equal(mine.experts[name], norm), name
        assert torch.equal(mine.dense, ref["dense"]) and torch.equal(mine.total, ref["total"])
    assert not torch.equal(seen[0].total, captured[1]["total"])  # control: steps differ


# ---------------------------------------------------------------------------------- low-bit states


def _lowbit_cfg(bits):
    pytest.importorskip("torchao.optim", reason="low-bit states need torchao (pip install torchao --no-deps)")
    return sonar_fx.AdamWConfig(**BASE, state_bits=bits)


# torchao compiles its low-bit update with inductor: both sizes are inductor tests.
@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_lowbit_states_equal_torchao_optimizer_and_resume_bitwise(bits):
    cfg = _lowbit_cfg(bits)
    twin, twin_method_ = _train("standard_no_expert_clip", cfg, dtype=torch.float32)
    assert type(twin_method_.expert_optimizer).__name__ == f"AdamW{bits}bit"
    sonar_model, method = _train("sonar", cfg, dtype=torch.float32)
    assert_same_weights(sonar_model, twin)
    opt = method.optimizer
    kinds = {
        type(s["exp_avg"]).__name__ for p, s in opt.state.items() if p in set(opt.expert_group["params"])
    }
    assert kinds == {f"OptimState{bits}bit"}
    # The state dict is plain tensors (weights_only loads it) and restores the quantized states bitwise.
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    model2 = build_model("tiny-olmoe", seed=5)
    model2.load_state_dict(sonar_model.state_dict())
    opt2 = sonar_fx.compile(model2, cfg, compiler="eager").sonar
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for model, o in ((sonar_model, opt), (model2, opt2)):
        model(**batches(4)[3]).loss.backward()
        o.step()
    assert_same_weights(sonar_model, model2)
    full = _train("standard_no_expert_clip", sonar_fx.AdamWConfig(**BASE), dtype=torch.float32, steps=3)[0]
    assert weights_differ(sonar_model, full)  # control: low-bit states do change the arithmetic


def test_lowbit_refusals_name_the_fix():
    cfg = _lowbit_cfg(8)
    with pytest.raises(sonar_fx.SonarUsageError, match="granularity='batched'"):
        sonar_fx.compile(build_model("tiny-olmoe"), cfg, compiler="eager", granularity="per_expert")


# ------------------------------------------------------------------------------------ command line


def _finetune(tmp_path, name, *flags):
    out = tmp_path / name
    argv = ["finetune", "--model", "tiny-olmoe", "--steps", "3", "--batch-size", "2",
            "--train-size", "8", "--held-out", "0", "--compiler", "eager", "--no-progress", "--out", str(out),
            *flags]  # fmt: skip
    return main(argv), out


def test_cli_trains_with_optimizer_and_clip_logs_norms_and_checkpoint_refuses_another(tmp_path, capsys):
    flags = (
        "--optimizer",
        "sgd",
        "--momentum",
        "0.9",
        "--nesterov",
        "--expert-clip",
        "global",
        "--stop-after",
        "2",
    )
    rc, out = _finetune(tmp_path, "sgd", *flags)
    assert rc == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(x["grad_norm_total"] >= x["grad_norm_dense"] > 0 for x in lines)
    assert len(lines[0]["grad_norm_experts"]) == 4
    assert lines[0]["grad_norm_expert_max"] == max(lines[0]["grad_norm_experts"].values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["optimizer"] == "sgd" and summary["sonar"]["expert_clip"] == "global"
    rc, _ = _finetune(tmp_path, "sgd", "--optimizer", "lion", "--expert-clip", "global", "--resume")
    assert rc == 2 and "--optimizer: checkpoint has 'sgd'" in capsys.readouterr().err
    rc, _ = _finetune(tmp_path, "sgd", *flags[:-2], "--resume")
    assert rc == 0


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (("--optimizer", "sgd", "--state-bits", "8"), "--state-bits"),
        (("--optimizer", "adamw", "--momentum", "0.9"), "--momentum"),
        (("--optimizer", "sgd", "--nesterov"), "--nesterov"),
        (("--optimizer", "sgd", "--betas", "0.8", "0.9"), "--betas"),
        (("--optimizer", "lion", "--eps", "1e-6"), "--eps"),
        (("--method", "standard_no_expert_clip", "--expert-clip", "global"), "--expert-clip"),
        (("--expert-clip", "per_tensor", "--max-grad-norm", "none"), "--expert-clip"),
    ],
)
def test_cli_bad_optimizer_flags_exit_2_naming_the_flag(tmp_path, capsys, flags, blamed):
    rc, _ = _finetune(tmp_path, "bad", *flags)
    assert rc == 2
    assert f"error: {blamed}" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- inductor


@pytest.mark.slow
def test_inductor_sgd_with_global_clip_equals_compiled_standard(deterministic):
    cfg = sonar_fx.SGDConfig(lr=5e-2, momentum=0.9, nesterov=True, max_grad_norm=0.5, expert_clip="global")
    try:
        torch._dynamo.reset()
        twin, _ = _train("standard", cfg, compiler="inductor")
        torch._dynamo.reset()
        model, method = _train("sonar", cfg, compiler="inductor")
    finally:
        torch._dynamo.reset()
    assert_same_weights(model, twin)
    report = method.optimizer.report()
    assert report["updates_in_graph"] == 12 and report["recompiles"] == 0
