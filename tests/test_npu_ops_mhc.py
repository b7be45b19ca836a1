"""The mHC stand-ins (npu_ops/mhc.py) against transformers' DeepseekV4HyperConnection and
decoder-layer mix written out in float64, their backward ops against autograd of that
reference, and one mix-up test per convention the ops fix (the transposed residual matrix,
the extension's positional eps order, the flattened hRes, h_in from the un-normalised x)."""
import pytest
import torch
from torch.autograd import gradcheck

from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.mhc import mhc_inputs

npu = torch.ops.npu
cot = torch.ops.cann_ops_transformer
NORM_EPS, HC_EPS = 1e-3, 1e-2  # distinct and large enough to matter in float64


@pytest.fixture(scope="module", autouse=True)
def _ops():
    ensure_registered()


def reference_pre(x, phi, alpha, bias, norm_eps=NORM_EPS, hc_eps=HC_EPS, iters=None):
    """DeepseekV4HyperConnection.forward in float64 (scale, then linear, as transformers does):
    (collapsed, post, comb); comb is the Sinkhorn of the logits when iters is given."""
    n = x.shape[-2]
    flat = x.flatten(-2).double()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = flat @ phi.double().t()
    a, b = alpha.double(), bias.double()
    pre = torch.sigmoid(mix[..., :n] * a[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., n:2 * n] * a[1] + b[n:2 * n])
    comb = mix[..., 2 * n:].unflatten(-1, (n, n)) * a[2] + b[2 * n:].view(n, n)
    if iters is not None:
        comb = torch.softmax(comb, -1) + hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x.double()).sum(-2)
    return collapsed, post, comb


def reference_post(x, comb, o, post):
    """DeepseekV4DecoderLayer: post.unsqueeze(-1) * o.unsqueeze(-2) + comb^T @ X."""
    return post.double().unsqueeze(-1) * o.double().unsqueeze(-2) + comb.double().transpose(-1, -2) @ x.double()


def test_npu_mhc_pre_is_the_hyper_connection_without_sinkhorn():
    x, phi, alpha, bias = mhc_inputs()
    h_in, h_post, h_res, inv_rms, h_mix, h_pre = npu.npu_mhc_pre(x, phi, alpha, bias, norm_eps=NORM_EPS,
                                                                 hc_eps=HC_EPS, out_flag=1)
    collapsed, post, logits = reference_pre(x, phi, alpha, bias)
    torch.testing.assert_close(h_in, collapsed)
    torch.testing.assert_close(h_post, post)
    torch.testing.assert_close(h_res, logits)  # the logits: Sinkhorn is npu_mhc_sinkhorn's
    rms = torch.rsqrt(x.flatten(-2).square().mean(-1) + NORM_EPS)
    torch.testing.assert_close(inv_rms, rms)
    torch.testing.assert_close(h_mix, x.flatten(-2) @ phi.t())  # linear BEFORE the rms scale
    assert h_pre.shape == (2, 3, 4) and (h_pre > HC_EPS).all()


def test_npu_mhc_sinkhorn_is_the_unrolled_loop():
    x, phi, alpha, bias = mhc_inputs()
    _, _, logits = reference_pre(x, phi, alpha, bias)
    _, _, comb = reference_pre(x, phi, alpha, bias, iters=7)
    y, norm, total = npu.npu_mhc_sinkhorn(logits, eps=HC_EPS, num_iters=7, out_flag=1)
    torch.testing.assert_close(y, comb)
    assert norm.numel() == 2 * 7 * 6 * 4 * 8 and total.numel() == 2 * 7 * 6 * 8  # the wheel's Meta sizes
    y0, empty_norm, _ = npu.npu_mhc_sinkhorn(logits, eps=HC_EPS, num_iters=7)
    torch.testing.assert_close(y0, comb)
    assert empty_norm.numel() == 0


def test_mhc_pre_sinkhorn_is_pre_then_sinkhorn():
    x, phi, alpha, bias = mhc_inputs()
    hin, h_post, h_res, *extras = cot.mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 20, HC_EPS, NORM_EPS, True)
    collapsed, post, comb = reference_pre(x, phi, alpha, bias, iters=20)
    torch.testing.assert_close(hin, collapsed)
    torch.testing.assert_close(h_post, post)
    torch.testing.assert_close(h_res, comb.flatten(-2))  # flattened [B, S, n*n], row-major (j, k)
    assert [tuple(t.shape) for t in extras] == [(2, 3, 4), (2, 3, 24), (2, 3, 1), (40, 2, 3, 4), (40, 2, 3, 4, 4)]
    hin2, *_ = cot.mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 20, HC_EPS, NORM_EPS, False)
    torch.testing.assert_close(hin2, collapsed)


def test_mix_up_the_extensions_positional_eps_order():
    # (hcMult, numIters, hcEps, normEps): torch_npu's keywords are (norm_eps, hc_eps)
    x, phi, alpha, bias = mhc_inputs()
    _, _, h_res, *_ = cot.mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 3, NORM_EPS, HC_EPS, False)  # swapped
    _, _, comb = reference_pre(x, phi, alpha, bias, iters=3)
    assert not torch.allclose(h_res, comb.flatten(-2), atol=1e-4)


def test_mix_up_h_in_collapses_the_raw_streams():
    # h_in weights the un-normalised x (transformers' `pre.unsqueeze(-1) * hidden_streams`)
    x, phi, alpha, bias = mhc_inputs()
    h_in, *_ = npu.npu_mhc_pre(x, phi, alpha, bias, norm_eps=NORM_EPS, hc_eps=HC_EPS)
    _, _, _, _, _, h_pre = npu.npu_mhc_pre(x, phi, alpha, bias, norm_eps=NORM_EPS, hc_eps=HC_EPS, out_flag=1)
    normalised = x * torch.rsqrt(x.flatten(-2).square().mean(-1) + NORM_EPS)[..., None, None]
    assert not torch.allclose(h_in, (h_pre.unsqueeze(-1) * normalised).sum(-2))
    torch.testing.assert_close(h_in, (h_pre.unsqueeze(-1) * x).sum(-2))


@pytest.mark.parametrize("op", ["npu", "cann"])
def test_mhc_post_is_the_decoder_layers_mix(op):
    x, phi, alpha, bias = mhc_inputs()
    _, post, comb = reference_pre(x, phi, alpha, bias, iters=5)
    o = torch.randn(2, 3, 8, dtype=torch.float64)
    y = (npu.npu_mhc_post if op == "npu" else cot.mhc_post)(x, comb, o, post)
    torch.testing.assert_close(y, reference_post(x, comb, o, post))
    # mix-up: comb, not its transpose (Sinkhorn's result is not symmetric)
    untransposed = post.unsqueeze(-1) * o.unsqueeze(-2) + comb @ x
    assert not torch.allclose(y, untransposed)


def test_npu_mhc_post_without_h_res_is_the_plain_residual():
    x, _, _, _ = mhc_inputs()
    post, o = torch.rand(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(npu.npu_mhc_post(x, None, o, post), x + post.unsqueeze(-1) * o.unsqueeze(-2))


def test_bf16_rounds_once():
    x, phi, alpha, bias = mhc_inputs(dtype=torch.bfloat16)
    phi, alpha, bias = phi.float(), alpha.float(), bias.float()
    h_in, *_ = npu.npu_mhc_pre(x, phi, alpha, bias, norm_eps=NORM_EPS, hc_eps=HC_EPS)
    collapsed, _, _ = reference_pre(x, phi, alpha, bias)
    assert h_in.dtype == torch.bfloat16
    assert torch.equal(h_in, collapsed.to(torch.bfloat16))  # fp32 math, one rounding


# ---- backward ops ---------------------------------------------------------------------------
def test_gradcheck_npu_mhc_pre_through_its_backward_op():
    x, phi, alpha, bias = (t.clone().requires_grad_() for t in mhc_inputs(b=1, s=2))

    def f(x, phi, alpha, bias):
        return npu.npu_mhc_pre(x, phi, alpha, bias, norm_eps=NORM_EPS, hc_eps=HC_EPS, out_flag=1)[:3]

    assert gradcheck(f, (x, phi, alpha, bias))


def test_gradcheck_npu_mhc_sinkhorn_and_post():
    logits = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda z: npu.npu_mhc_sinkhorn(z, eps=HC_EPS, num_iters=4, out_flag=1)[0], (logits,))
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    h_res = torch.rand(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    o = torch.randn(1, 2, 8, dtype=torch.float64, requires_grad=True)
    post = torch.rand(1, 2, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(npu.npu_mhc_post, (x, h_res, o, post))


def test_training_needs_out_flag():
    x, phi, alpha, bias = (t.clone().requires_grad_() for t in mhc_inputs(b=1, s=2))
    out = npu.npu_mhc_pre(x, phi, alpha, bias)[0]
    with pytest.raises(RuntimeError, match="out_flag=1"):
        out.sum().backward()
    y = npu.npu_mhc_sinkhorn(torch.randn(1, 4, 4, requires_grad=True), num_iters=2)[0]
    with pytest.raises(RuntimeError, match="out_flag=1"):
        y.sum().backward()


def test_mhc_pre_sinkhorn_backward_against_autograd():
    x, phi, alpha, bias = mhc_inputs(b=1, s=3)
    leaves = [t.clone().requires_grad_() for t in (x, phi, alpha, bias)]
    ref = reference_pre(*leaves, iters=4)
    grads = [torch.randn_like(t) for t in ref]
    expected = torch.autograd.grad(ref, leaves, grads)
    _, _, _, h_pre, h_mix, inv_rms, sums, norms = cot.mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 4, HC_EPS,
                                                                        NORM_EPS, True)
    got = cot.mhc_pre_sinkhorn_backward(grads[0], grads[1], grads[2].flatten(-2), x, phi, alpha, bias, h_pre,
                                        h_mix, inv_rms, sums, norms, HC_EPS)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_mhc_pre_sinkhorn_raw_op_has_no_dispatcher_autograd():
    # the extension differentiates it in Python (MhcPreSinkhornFunction): a pass calls the backward op itself
    x, phi, alpha, bias = (t.clone().requires_grad_() for t in mhc_inputs(b=1, s=2))
    out = cot.mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 2, HC_EPS, NORM_EPS, True)[0]
    with pytest.raises(RuntimeError, match="MhcPreSinkhornFunction"):
        out.sum().backward()


def test_mhc_post_backward_ops_against_autograd():
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    h_res, o, post = torch.rand(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64), \
        torch.rand(2, 3, 4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, h_res, o, post)]
    g = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    expected = torch.autograd.grad(reference_post(*leaves), leaves, g)
    for op in (npu.npu_mhc_post_backward, cot.mhc_post_backward):
        for got, e in zip(op(g, x, h_res, o, post), expected):
            torch.testing.assert_close(got, e)
    grad_x, grad_res, *_ = npu.npu_mhc_post_backward(g, x, None, o, post)
    torch.testing.assert_close(grad_x, g)
    _, grad_res, _, _ = npu.npu_mhc_post_backward(g.bfloat16(), x.bfloat16(), None, o.bfloat16(), post.float())
    assert grad_res.shape == (2, 3, 4, 4) and grad_res.dtype == torch.float32  # even without h_res


def test_fake_kernels_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, phi, alpha, bias = mhc_inputs()
    mode = FakeTensorMode()
    fx, fphi, falpha, fbias = (mode.from_tensor(t.float()) for t in (x, phi, alpha, bias))
    with mode:
        fx = fx.bfloat16()
        outs = npu.npu_mhc_pre(fx, fphi, falpha, fbias, out_flag=1)
        assert [tuple(t.shape) for t in outs] == [(2, 3, 8), (2, 3, 4), (2, 3, 4, 4), (2, 3), (2, 3, 24), (2, 3, 4)]
        assert outs[0].dtype == torch.bfloat16 and outs[1].dtype == torch.float32
        y, norm, total = npu.npu_mhc_sinkhorn(outs[2], num_iters=20, out_flag=1)
        assert y.shape == (2, 3, 4, 4) and norm.shape == (2 * 20 * 6 * 4 * 8,)
