"""The fused expert update is the same arithmetic as torch.optim.AdamW(fused=True)."""

import pytest
import torch

from sonar_fx.optim.adamw import adamw_ref, fused_adamw_

HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _torch_adamw_steps(p0, grads):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed_grad", [False, True])
def test_fused_update_matches_torch_adamw_bitwise(dtype, transposed_grad):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(4, 24, 16, generator=g).to(dtype)
    grads = [torch.randn(4, 24, 16, generator=g).to(dtype) for _ in range(3)]
    ref_p, ref_m, ref_v, ref_step = _torch_adamw_steps(p0, grads)

    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    step = torch.zeros((), dtype=torch.float32)
    for grad in grads:
        if transposed_grad:  # same values, the strides a graph output would have: (E, n, d) view of (E, d, n)
            grad = grad.transpose(1, 2).contiguous().transpose(1, 2)
            assert grad.stride() != p.stride()
        fused_adamw_([p], [grad], [m], [v], [step], **HYPER)
    assert m.dtype == dtype and v.dtype == dtype
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m) and torch.equal(v, ref_v)
    assert torch.equal(step, ref_step)
    assert not torch.equal(p, p0)


def test_transposed_grad_without_relayout_would_be_wrong():
    """The hazard the relayout guards against is real: raw CPU _fused_adamw_ misreads strided grads."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(4, 24, 16, generator=g)
    grad = torch.randn(4, 16, 24, generator=g).transpose(1, 2)
    ours, raw = p.clone(), p.clone()
    fused_adamw_([ours], [grad], [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.zeros(())], **HYPER)
    torch._fused_adamw_(
        [raw], [grad], [torch.zeros_like(p)], [torch.zeros_like(p)], [], [torch.ones(())],
        amsgrad=False, maximize=False, grad_scale=None, found_inf=None, **HYPER,
    )  # fmt: skip
    assert not torch.equal(ours, raw)


def test_reference_agrees_within_fp32_tolerance():
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(3, 8, 5, generator=g)
    p, m, v, s = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.zeros(())
    pr, mr, vr = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t in range(1, 4):
        grad = torch.randn(3, 8, 5, generator=g)
        fused_adamw_([p], [grad], [m], [v], [s], **HYPER)
        adamw_ref(pr, grad, mr, vr, t, **HYPER)
    torch.testing.assert_close(p, pr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m, mr, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, vr, rtol=1e-6, atol=1e-9)
