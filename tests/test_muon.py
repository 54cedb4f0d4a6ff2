"""Muon for expert tensors: each expert matrix of an (E, out, in) tensor is updated like torch.optim.Muon
updates a 2-D parameter, with one batched Newton-Schulz for all E, bitwise (fp32 and bf16 tensors, an LR
that changes every step). The negative controls show what would differ: one Newton-Schulz over the
tensor flattened to one matrix, a single batched bf16 add, a missing LR schedule.
"""

import pytest
import torch
from torch import nn

import sonar_fx
from sonar_fx.config import MuonConfig
from sonar_fx.optim import muon as muon_math
from sonar_fx.optim.muon import MuonTwin, adjusted_lr, muon_, muon_ref, zeropower_via_newtonschulz
from sonar_fx.optim.rules import MuonRule

COEFFS = (3.4445, -4.7750, 2.0315)
NS = dict(ns_coefficients=COEFFS, ns_steps=5, eps=1e-7)
# (E, A, B): wide, tall, square, and odd sizes whose element counts end a vector loop in its tail.
SHAPES = [(4, 16, 24), (4, 24, 16), (4, 5, 7), (3, 17, 9)]
LRS = [2e-2, 1e-2, 5e-3]  # a different LR at every step


def _hyper(cfg: MuonConfig, lr: float) -> dict:
    return dict(lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                ns_coefficients=cfg.ns_coefficients, ns_steps=cfg.ns_steps, eps=cfg.eps,
                adjust_lr_fn=cfg.adjust_lr_fn)  # fmt: skip


def _data(shape, dtype, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(*shape, generator=g).to(dtype)
    return p0, [torch.randn(*shape, generator=g).to(dtype) for _ in range(steps)]


def _torch_per_matrix(cfg, p0, grads):
    """torch.optim.Muon with each expert matrix as its own 2-D parameter (separate tensors)."""
    mats = [nn.Parameter(p0[e].clone()) for e in range(p0.shape[0])]
    opt = torch.optim.Muon(mats, **_hyper(cfg, LRS[0]))
    for lr, g in zip(LRS, grads, strict=False):
        opt.param_groups[0]["lr"] = lr
        for e, m in enumerate(mats):
            m.grad = g[e].clone()
        opt.step()
    buffers = [opt.state[m]["momentum_buffer"] for m in mats]
    return torch.stack([m.detach() for m in mats]), torch.stack(buffers)


def _batched(cfg, p0, grads, fn=muon_):
    p, buf = p0.clone(), torch.zeros_like(p0)
    for lr, g in zip(LRS, grads, strict=False):
        if fn is muon_:
            muon_([p], [g], [buf], **_hyper(cfg, lr))
        else:
            fn(p, g, buf, **_hyper(cfg, lr))
    return p, buf


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_newton_schulz_equals_torch_per_matrix_bitwise(dtype, shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = zeropower_via_newtonschulz(g, **NS)
    theirs = torch.stack([torch.optim._muon._zeropower_via_newtonschulz(g[e].clone(), COEFFS, 5, 1e-7)
                          for e in range(shape[0])])  # fmt: skip
    assert torch.equal(ours, theirs)
    # Negative control: the tensor as one (E*A, B) matrix is another orthogonalisation.
    flat = zeropower_via_newtonschulz(g.reshape(-1, shape[-1]), **NS).reshape(shape)
    assert not torch.equal(flat, theirs)


CASES = {
    "default": MuonConfig(),
    "plain_momentum": MuonConfig(nesterov=False, weight_decay=0.05),
    "match_rms_adamw": MuonConfig(adjust_lr_fn="match_rms_adamw", momentum=0.9, ns_steps=3),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_muon_update_equals_torch_muon_per_matrix_bitwise(case, dtype, shape, monkeypatch):
    cfg = CASES[case]
    if dtype == torch.bfloat16 and not cfg.nesterov:
        _patch_torch_aliasing(monkeypatch)  # see test_torch_213_normalises_a_bf16_buffer_in_place
    p0, grads = _data(shape, dtype)
    ref_p, ref_buf = _torch_per_matrix(cfg, p0, grads)
    p, buf = _batched(cfg, p0, grads)
    assert not torch.equal(p, p0)
    assert torch.equal(p, ref_p) and torch.equal(buf, ref_buf)
    ref_p2, ref_buf2 = _batched(cfg, p0, grads, fn=muon_ref)
    assert torch.equal(ref_p2, ref_p) and torch.equal(ref_buf2, ref_buf)


def _patch_torch_aliasing(monkeypatch):
    """torch's Muon with the upstream fix (its Newton-Schulz works on a copy of the buffer)."""
    original = torch.optim._muon._zeropower_via_newtonschulz
    monkeypatch.setattr(
        torch.optim._muon, "_zeropower_via_newtonschulz", lambda g, *a: original(g.clone(), *a)
    )


def test_torch_213_normalises_a_bf16_buffer_in_place():
    """Why the bf16 nesterov=False case compares with torch's fixed Muon: torch 2.13 divides the momentum
    buffer by its norm in place (`grad.bfloat16()` is the buffer itself). When torch ships the fix, this
    test fails: drop the patch above."""
    cfg = CASES["plain_momentum"]
    p0, grads = _data((2, 8, 12), torch.bfloat16, steps=1)
    _, torch_buf = _torch_per_matrix(cfg, p0, grads)
    _, our_buf = _batched(cfg, p0, grads)
    assert torch.equal(our_buf, torch.zeros_like(p0).lerp_(grads[0], 1 - cfg.momentum))
    assert not torch.equal(torch_buf, our_buf)


def test_per_matrix_add_is_what_makes_bf16_batches_exact():
    """The last add of a bf16 batch runs per matrix: one batched add rounds some elements otherwise."""
    p, ortho = _data((4, 5, 7), torch.bfloat16, steps=1)
    ortho = ortho[0]
    per_matrix, batched = p.clone(), p.clone()
    muon_math._add_per_matrix_(per_matrix, ortho, alpha=-0.3)
    batched.add_(ortho, alpha=-0.3)
    by_slice = torch.stack([p[e].clone().add_(ortho[e], alpha=-0.3) for e in range(4)])
    assert torch.equal(per_matrix, by_slice)
    assert not torch.equal(batched, by_slice)


def test_adjusted_lr_reads_each_matrix_as_stored():
    # gate_up (E, 2n, d) and down (E, d, n) of transformers' layout: (out, in) per expert.
    n, d = 32, 64
    assert adjusted_lr(1.0, None, (8, 2 * n, d)) == 1.0  # 2n == d: no scale
    assert adjusted_lr(1.0, "original", (8, d, n)) == pytest.approx(2**0.5)  # down: sqrt(d / n)
    assert adjusted_lr(1.0, "match_rms_adamw", (8, d, n)) == pytest.approx(0.2 * d**0.5)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr(1.0, "other", (2, 2))


def test_newton_schulz_orthogonalises():
    g = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(2))
    singular = torch.linalg.svdvals(zeropower_via_newtonschulz(g, **NS).float())
    assert singular.min() > 0.5 and singular.max() < 1.5  # NS5 gives U S' V^T, S' ~ U(0.5, 1.5)
    assert torch.linalg.svdvals(g).max() > 1.5  # control: the input is not


def test_found_inf_leaves_weights_and_momentum_untouched():
    cfg, rule = MuonConfig(), MuonRule()
    p0, (g0, g1) = _data((4, 16, 24), torch.float32, steps=2)
    p, state = p0.clone(), {}
    rule.init_state(p, state)
    group = rule.defaults(cfg)
    rule.update_([p], [g0], [state], group)
    before = p.clone(), state["momentum_buffer"].clone()
    rule.update_([p], [g1 * float("inf")], [state], group, found_inf=torch.ones(()))
    assert torch.equal(p, before[0]) and torch.equal(state["momentum_buffer"], before[1])
    rule.update_([p], [g1], [state], group, found_inf=torch.zeros(()))
    unflagged, buf = p.clone(), state["momentum_buffer"].clone()
    assert not torch.equal(unflagged, before[0])  # control: a zero flag updates
    p, state = before[0].clone(), {"momentum_buffer": before[1].clone()}
    rule.update_([p], [g1], [state], group)
    assert torch.equal(p, unflagged) and torch.equal(state["momentum_buffer"], buf)  # same bits as no flag


def test_per_expert_slices_equal_batched_update():
    cfg, rule = MuonConfig(), MuonRule()
    p0, grads = _data((4, 5, 7), torch.bfloat16)
    a, b, sa, sb = p0.clone(), p0.clone(), {}, {}
    rule.init_state(a, sa)
    rule.init_state(b, sb)
    for g in grads:
        rule.update_([a], [g], [sa], rule.defaults(cfg))
        assert rule.update_slices_(b, g, sb, rule.defaults(cfg), found_inf=None) == 4
    assert torch.equal(a, b) and torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])


def test_twin_state_dict_round_trip_and_schedules():
    cfg = MuonConfig(lr=1e-2)
    expert = nn.Parameter(torch.randn(4, 8, 6))
    dense, bias = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(8))
    twin = MuonTwin([bias, expert, dense], cfg, matrices=[expert, dense])
    assert [g["name"] for g in twin.param_groups] == ["dense", "experts", "dense_matrices"]
    sched = torch.optim.lr_scheduler.LambdaLR(twin, lambda s: 0.5**s)
    for _ in range(2):
        for p in (expert, dense, bias):
            p.grad = torch.randn_like(p)
        twin.step()
        twin.zero_grad()
        sched.step()
    assert expert.grad is None
    assert [g["lr"] for g in twin.param_groups] == [1e-2 * 0.25] * 3  # the scheduler drives every group
    copy = MuonTwin([bias, expert, dense], cfg, matrices=[expert, dense])
    copy.load_state_dict(twin.state_dict())
    assert copy.parts[1].state is copy.state and copy.parts[1].param_groups[0] is copy.param_groups[1]
    saved, loaded = twin.state_dict()["state"], copy.state_dict()["state"]
    assert len(loaded) == 4 + 1 + 1  # 4 expert matrices, the hidden matrix, the bias
    assert all(torch.equal(loaded[k][n], v) for k, st in saved.items() for n, v in st.items())


def test_config_refuses_low_bit_states_and_bad_values():
    with pytest.raises(ValueError, match=r"MuonConfig.state_bits=8 .*AdamWConfig"):
        MuonConfig(state_bits=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MuonConfig.ns_steps"):
        MuonConfig(ns_steps=0)
    with pytest.raises(ValueError, match=r"MuonConfig.adjust_lr_fn"):
        MuonConfig(adjust_lr_fn="rms")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MuonConfig.adamw_betas"):
        MuonConfig(adamw_betas=(0.9, 1.0))
    adamw = MuonConfig(lr=0.02, adamw_lr=3e-4, weight_decay=0.1).adamw
    assert (adamw.lr, adamw.weight_decay) == (3e-4, 0.1)
    assert sonar_fx.MuonConfig is MuonConfig
