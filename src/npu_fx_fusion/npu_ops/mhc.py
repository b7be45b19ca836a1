"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): pre (collapse + the three
mappings), Sinkhorn, post (residual mix), and their backward ops.

torch_npu 2.13 (Ascend 950): npu_mhc_pre, npu_mhc_sinkhorn, npu_mhc_post, each with a
dispatcher derivative (NpuMhcPreBackward0, NpuMhcSinkhornBackward0, NpuMhcPostBackward0).
cann_ops_transformer (950 / A2 / A3): mhc_pre_sinkhorn (pre and Sinkhorn in one op) and
mhc_post, differentiated by the extension's Python autograd.Functions
(MhcPreSinkhornFunction, MhcPostFunction), so their raw ops have no dispatcher autograd.

Reference semantics (shared/reference/deepseek_v4.md sections 3-4): the torch_npu docs
(_op_plugin_docs.py) and the op-plugin goldens as quoted there; the COT docs
(torch_extension/cann_ops_transformer/docs/zh/mhc_pre_sinkhorn.md, mhc_post.md), the COT
Meta functions (ops/mhc_*.py) and the backward golden
(mhc/mhc_pre_sinkhorn_backward/tests/assets/golden_src.py) of mirror-cann/ops-transformer at
3a280bc. Per token (x: n streams of D channels, xf = x flattened to n*D, fp32):

    inv_rms = rsqrt(mean(xf^2) + norm_eps)
    h_mix   = (xf * gamma) @ phi^T                       (gamma: torch_npu only; V4 has none)
    w       = h_mix * inv_rms                            (linear first, then the scale)
    h_pre   = sigmoid(w_pre * alpha[0] + bias_pre) + hc_eps
    h_post  = 2 * sigmoid(w_post * alpha[1] + bias_post)
    z_res   = w_res * alpha[2] + bias_res                (n x n; npu_mhc_pre returns this)
    h_in    = sum_j h_pre[j] * x[j]                      (the un-normalised x), in x's dtype
    Sinkhorn: norm[0] = softmax(z_res, -1) + hc_eps; norm[1] = norm[0] / (colsum + hc_eps);
              then num_iters - 1 times a row and a column normalisation, each + hc_eps

The Sinkhorn intermediates (norm_out / sum_out) are what the backward reads: norm[k] after
step k, sum[k] its denominator (sum[0]: the eps step 0 adds). Layouts: the COT Meta's
[2*iters, B, S, n(, n)]; torch_npu's Meta only gives flat sizes 2*iters*T*n*8 and 2*iters*T*8
(n padded to 8), laid out here as [2*iters, T, n, 8] / [2*iters, T, 8] [inferred: the
kernel's order is undocumented, and only its own backward reads them].

Everything in fp32 (float64 stays float64) and rounded once to the output dtype; the
kernels' HF32 mode (inner_precise=1) is not emulated. Hardware limits (n in {4, 6, 8}, bf16 /
fp16 x, SoCs, the COT op's N = 4 and 20 iterations) live in capabilities.py.
"""
from __future__ import annotations

import torch

from .spec import HALF_DTYPES, OpCapability, Sample, in_layout_of, only_on_socs, op_spec, randn

# the CANN ops-transformer extension's products (its docs): Atlas A2, A3 and Ascend 950
_A2_A3_950 = only_on_socs("Ascend910B", "Ascend910_93", "Ascend950")


_NORM_ALIGN = 8  # torch_npu's Meta pads n to 8 in the flat Sinkhorn intermediates


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _streams(op: str, x: torch.Tensor) -> tuple[tuple, int, int]:
    """(leading dims, n, D) of a [B, S, n, D] / [T, n, D] x."""
    if x.dim() not in (3, 4):
        raise RuntimeError(f"{op}: x must be 3-D [T, n, D] or 4-D [B, S, n, D], it has {x.dim()} dims")
    return tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]


def _check_pre(op, x, phi, alpha, bias, gamma, branches) -> tuple[tuple, int, int]:
    lead, n, d = _streams(op, x)
    width = (2 + n) * n if branches == 3 else 2 * n
    if tuple(phi.shape) != (width, n * d):
        raise RuntimeError(f"{op}: phi must be ({width}, {n * d}) for n={n}, D={d} ({branches} mappings), "
                           f"got {tuple(phi.shape)}")
    if tuple(bias.shape) != (width,):
        raise RuntimeError(f"{op}: bias must be ({width},), got {tuple(bias.shape)}")
    if alpha.numel() != branches:
        raise RuntimeError(f"{op}: alpha must have {branches} elements, got {alpha.numel()}")
    if gamma is not None and gamma.numel() != n * d:
        raise RuntimeError(f"{op}: gamma must be [n, D] = [{n}, {d}], got {tuple(gamma.shape)}")
    return lead, n, d


def _branches(alpha: torch.Tensor) -> int:
    return 3 if alpha.numel() == 3 else 2


# ---- the shared forward and backward of the pre mapping ---------------------------------
def _pre_forward(x, phi, alpha, bias, gamma, norm_eps, hc_eps):
    """Per-token (T = prod(lead)) fp32 pieces: xs [T, n, D], xf, r [T, 1], h_mix, w,
    h_pre, h_post, z_res [T, n, n] or None, h_in [T, D] (x's dtype)."""
    n, d = x.shape[-2], x.shape[-1]
    acc = _acc(x)
    xs = x.reshape(-1, n, d).to(acc)
    xf = xs.reshape(-1, n * d)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    u = xf * gamma.reshape(1, n * d).to(acc) if gamma is not None else xf
    h_mix = u @ phi.to(acc).t()
    w = h_mix * r
    a, b = alpha.to(acc).reshape(-1), bias.to(acc)
    h_pre = torch.sigmoid(w[:, :n] * a[0] + b[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(w[:, n:2 * n] * a[1] + b[n:2 * n])
    z_res = (w[:, 2 * n:] * a[2] + b[2 * n:]).view(-1, n, n) if alpha.numel() == 3 else None
    h_in = (h_pre.unsqueeze(-1) * xs).sum(1).to(x.dtype)
    return xs, xf, r, h_mix, w, h_pre, h_post, z_res, h_in


def _pre_backward(xs, xf, r, h_mix, h_pre, h_post, alpha, phi, gamma, hc_eps, grad_h_in, grad_h_post, grad_z_res):
    """Gradients (dx [T, n, D], dphi, dalpha, dbias, dgamma or None) of the pre mapping from
    those of h_in [T, D], h_post [T, n] and z_res [T, n*n] (None: 2-branch mode)."""
    acc = xs.dtype
    t, n, d = xs.shape
    g_in = grad_h_in.reshape(t, d).to(acc)
    # h_pre = sigmoid(z) + hc_eps: the sigmoid is h_pre - hc_eps (the COT backward golden)
    s_pre = h_pre - hc_eps
    dz_pre = torch.einsum("td,tjd->tj", g_in, xs) * s_pre * (1 - s_pre)
    s_post = h_post / 2
    dz_post = grad_h_post.reshape(t, n).to(acc) * 2 * s_post * (1 - s_post)
    pieces = [dz_pre, dz_post] + ([grad_z_res.reshape(t, n * n).to(acc)] if grad_z_res is not None else [])
    dz = torch.cat(pieces, -1)  # [T, K]
    a = alpha.to(acc).reshape(-1)
    widths = [n, n, n * n][:a.numel()]
    scale = torch.cat([a[i].expand(width) for i, width in enumerate(widths)])
    w = h_mix * r
    dalpha = torch.stack([(dz * w)[:, sum(widths[:i]):sum(widths[:i + 1])].sum() for i in range(len(widths))])
    dbias = dz.sum(0)
    dw = dz * scale
    dh_mix = dw * r
    dr = (dw * h_mix).sum(-1, keepdim=True)
    u = xf * gamma.reshape(1, n * d).to(acc) if gamma is not None else xf
    du = dh_mix @ phi.to(acc)
    dphi = dh_mix.t() @ u
    dgamma = (du * xf).sum(0).view(gamma.shape) if gamma is not None else None
    dxf = du * gamma.reshape(1, n * d).to(acc) if gamma is not None else du
    dxf = dxf - dr * r.pow(3) * xf / (n * d)  # r = (mean(xf^2) + eps)^-1/2
    dx = dxf.view(t, n, d) + h_pre.unsqueeze(-1) * g_in.unsqueeze(1)
    return dx, dphi, dalpha, dbias, dgamma


# ---- Sinkhorn ----------------------------------------------------------------------------
def _sinkhorn_forward(logits: torch.Tensor, eps: float, iters: int):
    """(y, norms [2*iters, T, n, n], sums [2*iters, T, n]) of [T, n, n] logits."""
    y = torch.softmax(logits, -1) + eps
    # step 0 has no denominator: its slot records the eps it added (the backward needs the
    # softmax itself, norm[0] - eps, and npu_mhc_sinkhorn_backward has no eps argument)
    norms, sums = [y], [torch.full_like(y[..., 0], eps)]
    for step in range(1, 2 * iters):
        dim = -2 if step % 2 else -1  # the first normalisation is over columns (dim -2)
        total = y.sum(dim, keepdim=True) + eps
        y = y / total
        norms.append(y)
        sums.append(total.squeeze(dim))
    return y, torch.stack(norms), torch.stack(sums)


def _sinkhorn_backward(grad_y: torch.Tensor, norms: torch.Tensor, sums: torch.Tensor, eps: float) -> torch.Tensor:
    """The gradient of the logits, from the saved norms / sums (the reverse of each step
    y_k = y_{k-1} / s_k with s_k = sum(y_{k-1}) + eps: dy_{k-1} = g / s_k - sum(g * y_k / s_k)),
    then softmax's backward on norm[0] - eps."""
    g = grad_y
    for step in range(norms.shape[0] - 1, 0, -1):
        dim = -2 if step % 2 else -1
        total = sums[step].unsqueeze(dim)
        g = g / total - (g * norms[step] / total).sum(dim, keepdim=True)
    p = norms[0] - eps
    return p * (g - (g * p).sum(-1, keepdim=True))


def _sinkhorn_eps(sums: torch.Tensor) -> float:
    """The forward's eps, from its sum_out (slot 0, _sinkhorn_forward)."""
    return float(sums[0].flatten()[0])


# ---- opcheck samples (and the inputs tests/test_npu_ops_mhc.py builds its cases from) ----------
def mhc_inputs(b=2, s=3, n=4, d=8, *, dtype=torch.float64, seed=0):
    """x (B, S, n, D) in `dtype` and the fp32 (float64 for a float64 x) mapping weights
    phi (n^2 + 2n, nD), alpha (3,), bias (n^2 + 2n,)."""
    weights = torch.float64 if dtype == torch.float64 else torch.float32
    x = randn(b, s, n, d, dtype=dtype, seed=seed)
    phi = randn(n * n + 2 * n, n * d, dtype=weights, seed=seed + 1) * 0.3
    alpha = torch.rand(3, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64).to(weights) + 0.5
    bias = randn(n * n + 2 * n, dtype=weights, seed=seed + 3) * 0.5
    return x, phi, alpha, bias


def _pre_samples(dtype):
    x, phi, alpha, bias = mhc_inputs(dtype=dtype)
    yield Sample((x, phi, alpha, bias), {"norm_eps": 1e-3, "hc_eps": 1e-2, "out_flag": 1}, grad_args=(0, 1, 2, 3))
    gamma = randn(4, 8, dtype=phi.dtype, seed=4)
    yield Sample((x, phi, alpha, bias), {"gamma": gamma, "out_flag": 1}, grad_args=(0, 1, 2, 3))
    yield Sample((x, phi[:8], alpha[:2], bias[:8]))  # two mappings (no residual matrix), no out_flag


def _pre_backward_samples(dtype):
    for sample in _pre_samples(dtype):
        if not sample.kwargs.get("out_flag"):
            continue
        x, phi, alpha, bias = sample.args
        h_in, h_post, h_res, inv_rms, h_mix, h_pre = npu_mhc_pre(*sample.args, **sample.kwargs)
        grads = (randn(*h_in.shape, dtype=dtype, seed=5), randn(*h_post.shape, seed=6), randn(*h_res.shape, seed=7))
        yield Sample((x, phi, alpha, *grads, inv_rms, h_mix, h_pre, h_post, sample.kwargs.get("gamma")))


def _sinkhorn_samples(dtype):
    logits = randn(2, 3, 4, 4, dtype=dtype, seed=8)
    yield Sample((logits,), {"eps": 1e-2, "num_iters": 4, "out_flag": 1}, grad_args=(0,))
    yield Sample((logits.flatten(0, 1),), {"num_iters": 3})  # [T, n, n], inference


def _sinkhorn_backward_samples(dtype):
    y, norm, total = npu_mhc_sinkhorn(randn(2, 3, 4, 4, dtype=dtype, seed=8), eps=1e-2, num_iters=4, out_flag=1)
    yield Sample((randn(*y.shape, dtype=dtype, seed=9), norm, total))


def _post_inputs(dtype):
    """(x, h_res, h_out, h_post): streams and h_out in `dtype`, the mixes in fp32."""
    weights = torch.float64 if dtype == torch.float64 else torch.float32
    generator = torch.Generator().manual_seed(10)
    return (randn(2, 3, 4, 8, dtype=dtype, seed=11), torch.rand(2, 3, 4, 4, generator=generator).to(weights),
            randn(2, 3, 8, dtype=dtype, seed=12), torch.rand(2, 3, 4, generator=generator).to(weights))


def _post_samples(dtype):
    # the extension's raw op has no dispatcher autograd (its Python MhcPostFunction differentiates it)
    yield Sample(_post_inputs(dtype))


def _npu_post_samples(dtype):
    x, h_res, h_out, h_post = _post_inputs(dtype)
    yield Sample((x, h_res, h_out, h_post), grad_args=(0, 1, 2, 3))
    yield Sample((x, None, h_out, h_post), grad_args=(0, 2, 3))  # no residual mix (Ascend950)


def _post_backward_samples(dtype):
    x, h_res, h_out, h_post = _post_inputs(dtype)
    yield Sample((randn(*x.shape, dtype=dtype, seed=13), x, h_res, h_out, h_post))


def _npu_post_backward_samples(dtype):
    yield from _post_backward_samples(dtype)
    x, _, h_out, h_post = _post_inputs(dtype)
    yield Sample((randn(*x.shape, dtype=dtype, seed=13), x, None, h_out, h_post))


def _pre_sinkhorn_samples(dtype):
    x, phi, alpha, bias = mhc_inputs(dtype=dtype)
    yield Sample((x, phi, alpha, bias, 4, 4, 1e-2, 1e-3, True))
    yield Sample((x, phi, alpha, bias, 4, 20, 1e-6, 1e-6, False))


def _pre_sinkhorn_backward_samples(dtype):
    x, phi, alpha, bias = mhc_inputs(dtype=dtype)
    h_in, h_post, h_res, h_pre, h_mix, inv_rms, sums, norms = mhc_pre_sinkhorn(x, phi, alpha, bias, 4, 4, 1e-2,
                                                                              1e-3, True)
    grads = (randn(*h_in.shape, dtype=dtype, seed=5), randn(*h_post.shape, seed=6), randn(*h_res.shape, seed=7))
    yield Sample((*grads, x, phi, alpha, bias, h_pre, h_mix, inv_rms, sums, norms, 1e-2))


# =====================================================================================
# npu_mhc_pre (+ backward)
# =====================================================================================
def _mhc_pre_fake(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    op = "npu_mhc_pre"
    lead, n, _ = _check_pre(op, x, phi, alpha, bias, gamma, _branches(alpha))
    if out_flag not in (0, 1) or inner_precise not in (0, 1):
        raise RuntimeError(f"{op}: out_flag and inner_precise must be 0 or 1, got {out_flag} and {inner_precise}")
    f32 = torch.float32
    h_res = x.new_empty((*lead, n, n), dtype=f32) if alpha.numel() == 3 else x.new_empty((1,), dtype=f32)
    # the wheel's Meta: the three optional outputs always have their full shapes
    return (x.new_empty((*lead, x.shape[-1])), x.new_empty((*lead, n), dtype=f32), h_res,
            x.new_empty(lead, dtype=f32), x.new_empty((*lead, phi.shape[0]), dtype=f32),
            x.new_empty((*lead, n), dtype=f32))


def _mhc_pre_setup_context(ctx, inputs, keyword_only_inputs, output):
    x, phi, alpha, bias = inputs
    kw = keyword_only_inputs
    ctx.mark_non_differentiable(output[3], output[4], output[5])
    ctx.save_for_backward(x, phi, alpha, output[3], output[4], output[5], output[1], kw["gamma"])
    ctx.hc_eps, ctx.out_flag, ctx.inner_precise = kw["hc_eps"], kw["out_flag"], kw["inner_precise"]


def _mhc_pre_backward(ctx, grad_h_in, grad_h_post, grad_h_res, *_):
    # torch_npu (NpuMhcPreBackward0; derivatives.yaml, deepseek_v4.md 3.2), outputs 0-2:
    #   x, phi, alpha, bias, gamma: npu_mhc_pre_backward(x, phi, alpha, grads[0], grads[1], grads[2],
    #       result3, result4, result5, result1, gamma, hc_eps, nullopt)
    # It reads inv_rms / h_mix / h_pre, which the forward writes only with out_flag=1.
    if not ctx.out_flag:
        raise RuntimeError("npu_mhc_pre: its backward reads inv_rms, h_mix and h_pre, which the forward computes "
                           "only with out_flag=1; call it with out_flag=1 to train")
    x, phi, alpha, inv_rms, h_mix, h_pre, h_post, gamma = ctx.saved_tensors
    lead, n = x.shape[:-2], x.shape[-2]
    zeros = torch.zeros
    grad_h_in = grad_h_in if grad_h_in is not None else zeros((*lead, x.shape[-1]), dtype=x.dtype)
    grad_h_post = grad_h_post if grad_h_post is not None else zeros((*lead, n))
    if alpha.numel() == 3 and grad_h_res is None:
        grad_h_res = zeros((*lead, n, n))
    dx, dphi, dalpha, dbias, dgamma = torch.ops.npu.npu_mhc_pre_backward(
        x, phi, alpha, grad_h_in, grad_h_post, grad_h_res, inv_rms, h_mix, h_pre, h_post, gamma, ctx.hc_eps,
        None, ctx.inner_precise)
    return dx, dphi, dalpha, dbias, (dgamma if gamma is not None else None)


@op_spec("npu::npu_mhc_pre",
         schema="npu_mhc_pre(Tensor x, Tensor phi, Tensor alpha, Tensor bias, *, Tensor? gamma=None, float "
                "norm_eps=1e-6, float hc_eps=1e-6, int out_flag=0, int inner_precise=0) -> (Tensor, Tensor, Tensor, "
                "Tensor, Tensor, Tensor)",
         fake=_mhc_pre_fake, samples=_pre_samples, backward=_mhc_pre_backward,
         setup_context=_mhc_pre_setup_context, differentiable_kwargs=("gamma",),
         capability=OpCapability(
             dtypes=HALF_DTYPES,  # x; phi / alpha / bias / gamma fp32
             min_rank=3,  # [T, n, D]
             max_rank=4,  # [B, S, n, D]
             backward="npu.npu_mhc_pre_backward",
             ge_converter=False,  # torchair 2.13: none (its docs show reduce-overhead only)
             socs=only_on_socs("Ascend950"),
             limits={
                 "streams": (4, 6, 8),  # n
                 "max_dim": 16384, "dim_multiple": 16,  # D in 1..16384, 16-aligned
                 "backward_needs_out_flag": True,  # the backward reads inv_rms / h_mix / h_pre
                 "phi_dtype": torch.float32,
             },
             doc="deepseek_v4.md 3.2 / torch_npu docstring npu_mhc_pre (_op_plugin_docs.py): Ascend 950 only; x "
             "bf16/fp16 [B, S, n, D] or [T, n, D], phi fp32 [n^2 + 2n, nD], alpha [3] (or [2]: two mappings), "
             "bias [n^2 + 2n], gamma fp32 [n, D]; n 4 / 6 / 8, D <= 16384 and 16-aligned; h_res returned BEFORE "
             "Sinkhorn; autograd NpuMhcPreBackward0 (needs out_flag=1); no GE converter in torchair 2.13",
         ))
def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    # the module docstring's formulas; h_res is z_res, BEFORE softmax and Sinkhorn (npu_mhc_sinkhorn).
    # Without out_flag the optional outputs are not written on the NPU: zeros here.
    _mhc_pre_fake(x, phi, alpha, bias, gamma=gamma, norm_eps=norm_eps, hc_eps=hc_eps, out_flag=out_flag,
                  inner_precise=inner_precise)
    lead, n = x.shape[:-2], x.shape[-2]
    _, _, r, h_mix, _, h_pre, h_post, z_res, h_in = _pre_forward(x, phi, alpha, bias, gamma, norm_eps, hc_eps)
    f32 = torch.float32 if x.dtype != torch.float64 else torch.float64
    h_res = z_res.view(*lead, n, n).to(f32) if z_res is not None else torch.zeros((1,), dtype=f32)
    extras = (r.view(lead), h_mix.view(*lead, -1), h_pre.view(*lead, n))
    if not out_flag:
        extras = tuple(torch.zeros_like(t) for t in extras)
    return (h_in.view(*lead, x.shape[-1]), h_post.view(*lead, n).to(f32), h_res,
            *(t.to(f32).contiguous() for t in extras))


def _mhc_pre_backward_fake(x, phi, alpha, grad_h_in, grad_h_post, grad_h_res, inv_rms, h_mix, h_pre, h_post,
                           gamma=None, hc_eps=1e-6, grad_x_post=None, inner_precise=0):
    _streams("npu_mhc_pre_backward", x)
    # contiguous, as op-plugin allocates them (op_plugin/ops/opapi/MhcPreBackwardNpuOpapi.cpp: at::empty)
    grad_gamma = gamma.new_empty(gamma.shape) if gamma is not None else x.new_empty((0,), dtype=torch.float32)
    return (x.new_empty(x.shape), phi.new_empty(phi.shape), alpha.new_empty(alpha.shape),
            phi.new_empty((phi.shape[0],)), grad_gamma)


@op_spec("npu::npu_mhc_pre_backward",
         schema="npu_mhc_pre_backward(Tensor x, Tensor phi, Tensor alpha, Tensor grad_h_in, Tensor grad_h_post, Tensor "
                "grad_h_res, Tensor inv_rms, Tensor h_mix, Tensor h_pre, Tensor h_post, Tensor? gamma=None, float "
                "hc_eps=1e-6, Tensor? grad_x_post=None, int inner_precise=0) -> (Tensor, Tensor, Tensor, Tensor, "
                "Tensor)",
         fake=_mhc_pre_backward_fake, samples=_pre_backward_samples,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
             ge_converter=False, socs=only_on_socs("Ascend950"),
             doc="npu_mhc_pre's backward (NpuMhcPreBackward0): grads of x, phi, alpha, bias, gamma from those of "
             "h_in, h_post and the pre-Sinkhorn h_res; Ascend 950; no GE converter",
         ))
def npu_mhc_pre_backward(x, phi, alpha, grad_h_in, grad_h_post, grad_h_res, inv_rms, h_mix, h_pre, h_post,
                         gamma=None, hc_eps=1e-6, grad_x_post=None, inner_precise=0):
    # The chain rule through the module docstring's forward, from the saved inv_rms, h_mix,
    # h_pre and h_post (w = h_mix * inv_rms): grad_h_res is that of z_res (the pre-Sinkhorn
    # logits npu_mhc_pre returns). grad_x_post, when given, is added to x's gradient (the
    # mHC post's gradient of the same x, fused into one write). -> (grad_x, grad_phi,
    # grad_alpha, grad_bias, grad_gamma: empty (0,) without gamma) [the output order of the
    # derivative; grad_bias from the same dz as alpha's, inferred: bias is not an input].
    _, n, d = _streams("npu_mhc_pre_backward", x)
    acc = _acc(x)
    xs = x.reshape(-1, n, d).to(acc)
    xf = xs.reshape(-1, n * d)
    t = xs.shape[0]
    dx, dphi, dalpha, dbias, dgamma = _pre_backward(
        xs, xf, inv_rms.reshape(t, 1).to(acc), h_mix.reshape(t, -1).to(acc), h_pre.reshape(t, n).to(acc),
        h_post.reshape(t, n).to(acc), alpha, phi, gamma, hc_eps, grad_h_in, grad_h_post,
        grad_h_res if alpha.numel() == 3 else None)
    if grad_x_post is not None:
        dx = dx + grad_x_post.reshape(t, n, d).to(acc)
    grad_gamma = dgamma.to(gamma.dtype).contiguous() if gamma is not None else x.new_empty((0,), dtype=torch.float32)
    return (dx.to(x.dtype).view(x.shape), dphi.to(phi.dtype).contiguous(), dalpha.to(alpha.dtype).view(alpha.shape),
            dbias.to(phi.dtype), grad_gamma)


# =====================================================================================
# npu_mhc_sinkhorn (+ backward)
# =====================================================================================
def _check_sinkhorn(op, x, num_iters, out_flag) -> int:
    if x.dim() not in (3, 4) or x.shape[-1] != x.shape[-2]:
        raise RuntimeError(f"{op}: x must be [T, n, n] or [B, S, n, n], got {tuple(x.shape)}")
    if not 0 < num_iters <= 100:
        raise RuntimeError(f"{op}: num_iters must be within (0, 100], got {num_iters}")
    if out_flag not in (0, 1):
        raise RuntimeError(f"{op}: out_flag must be 0 or 1, got {out_flag}")
    return x.shape[-1]


def _sinkhorn_fake(x, *, eps=1e-6, num_iters=20, out_flag=0):
    n = _check_sinkhorn("npu_mhc_sinkhorn", x, num_iters, out_flag)
    tokens = x.numel() // (n * n)
    # y contiguous: the wheel's Meta torch.empty(x.shape)
    if not out_flag:  # the Meta returns None for both; an empty tensor keeps the schema's Tensor
        return x.new_empty(x.shape), x.new_empty((0,)), x.new_empty((0,))
    return (x.new_empty(x.shape), x.new_empty((2 * num_iters * tokens * n * _NORM_ALIGN,)),
            x.new_empty((2 * num_iters * tokens * _NORM_ALIGN,)))


def _sinkhorn_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[1], output[2])
    ctx.out_flag = keyword_only_inputs["out_flag"]


def _sinkhorn_autograd_backward(ctx, grad_y, *_):
    # torch_npu (NpuMhcSinkhornBackward0), output 0 only: x: npu_mhc_sinkhorn_backward(grad, result1, result2)
    if not ctx.out_flag:
        raise RuntimeError("npu_mhc_sinkhorn: its backward reads norm_out and sum_out, which the forward returns only "
                           "with out_flag=1; call it with out_flag=1 to train")
    norm, total = ctx.saved_tensors
    return torch.ops.npu.npu_mhc_sinkhorn_backward(grad_y, norm, total)


@op_spec("npu::npu_mhc_sinkhorn",
         schema="npu_mhc_sinkhorn(Tensor x, *, float eps=1e-6, SymInt num_iters=20, int out_flag=0) -> (Tensor, Tensor,"
                " Tensor)",
         fake=_sinkhorn_fake, samples=_sinkhorn_samples, backward=_sinkhorn_autograd_backward,
         setup_context=_sinkhorn_setup_context,
         capability=OpCapability(
             dtypes=frozenset({torch.float32}),
             min_rank=3,
             max_rank=4,
             backward="npu.npu_mhc_sinkhorn_backward",
             ge_converter=False,
             socs=only_on_socs("Ascend950"),
             limits={"streams": (4, 6, 8), "iterations": (1, 100), "backward_needs_out_flag": True},
             doc="deepseek_v4.md 3.2 / torch_npu docstring npu_mhc_sinkhorn: fp32 [B, S, n, n] or [T, n, n], n 4 / 6 / "
             "8, num_iters 1..100; softmax + eps, a column normalisation, then num_iters - 1 row / column "
             "normalisations (each + eps): transformers' loop exactly; 'Atlas A5' (950) only; autograd "
             "NpuMhcSinkhornBackward0 (needs out_flag=1); no GE converter",
         ))
def npu_mhc_sinkhorn(x, *, eps=1e-6, num_iters=20, out_flag=0):
    # softmax(x, -1) + eps, a column normalisation, then num_iters - 1 row and column
    # normalisations, each denominator + eps (the module docstring); fp32 in and out.
    n = _check_sinkhorn("npu_mhc_sinkhorn", x, num_iters, out_flag)
    y, norms, sums = _sinkhorn_forward(x.reshape(-1, n, n).to(_acc(x)), eps, num_iters)
    if not out_flag:
        return y.to(x.dtype).view(x.shape), x.new_empty((0,)), x.new_empty((0,))
    steps, tokens = norms.shape[0], norms.shape[1]
    norm_out = x.new_zeros((steps, tokens, n, _NORM_ALIGN))
    norm_out[..., :n] = norms.to(x.dtype)
    sum_out = x.new_zeros((steps, tokens, _NORM_ALIGN))
    sum_out[..., :n] = sums.to(x.dtype)
    return y.to(x.dtype).view(x.shape), norm_out.reshape(-1), sum_out.reshape(-1)


def _sinkhorn_backward_fake(grad_y, norm, sum):  # noqa: A002 - the schema's name
    # contiguous: op-plugin's generated kernel (op_plugin_functions.yaml gen_opapi out: size grad_y,
    # dtype grad_y) allocates it with apply_tensor_without_format
    return grad_y.new_empty(grad_y.shape)


@op_spec("npu::npu_mhc_sinkhorn_backward",
         schema="npu_mhc_sinkhorn_backward(Tensor grad_y, Tensor norm, Tensor sum) -> Tensor",
         fake=_sinkhorn_backward_fake, samples=_sinkhorn_backward_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float32}), min_rank=3, max_rank=4,
             backward=None, ge_converter=False, socs=only_on_socs("Ascend950"),
             doc="npu_mhc_sinkhorn's backward, from its norm_out / sum_out; Ascend 950; no GE converter",
         ))
def npu_mhc_sinkhorn_backward(grad_y, norm, sum):  # noqa: A002
    # The reverse of the forward's steps from its norm_out / sum_out (layout: module docstring).
    op = "npu_mhc_sinkhorn_backward"
    n = grad_y.shape[-1]
    tokens = grad_y.numel() // (n * n)
    per_step = tokens * n * _NORM_ALIGN
    if norm.numel() == 0 or norm.numel() % per_step or sum.numel() != norm.numel() // n:
        raise RuntimeError(f"{op}: norm and sum must be the forward's out_flag=1 outputs for {tokens} tokens of "
                           f"n={n}, got {norm.numel()} and {sum.numel()} elements")
    steps = norm.numel() // per_step
    acc = _acc(grad_y)
    norms = norm.view(steps, tokens, n, _NORM_ALIGN)[..., :n].to(acc)
    sums = sum.view(steps, tokens, _NORM_ALIGN)[..., :n].to(acc)
    grad = _sinkhorn_backward(grad_y.reshape(tokens, n, n).to(acc), norms, sums, _sinkhorn_eps(sums))
    return grad.to(grad_y.dtype).view(grad_y.shape)


# =====================================================================================
# npu_mhc_post (+ backward), shared with cann_ops_transformer.mhc_post
# =====================================================================================
def _check_post(op, x, h_res, h_out, h_post) -> tuple[tuple, int, int]:
    lead, n, d = _streams(op, x)
    if h_res is not None and tuple(h_res.shape) != (*lead, n, n):
        raise RuntimeError(f"{op}: h_res must be {(*lead, n, n)}, got {tuple(h_res.shape)}")
    if tuple(h_out.shape) != (*lead, d) or tuple(h_post.shape) != (*lead, n):
        raise RuntimeError(f"{op}: h_out must be {(*lead, d)} and h_post {(*lead, n)}, got {tuple(h_out.shape)} "
                           f"and {tuple(h_post.shape)}")
    return lead, n, d


def _post(x, h_res, h_out, h_post) -> torch.Tensor:
    # y[k] = h_post[k] * h_out + sum_j h_res[j, k] * x[j]   (the TRANSPOSE of h_res: the wheel's
    # docstring "(H^res)^T x + h_out (x) H^post", the op-plugin and COT goldens)
    acc = _acc(x)
    y = h_post.to(acc).unsqueeze(-1) * h_out.to(acc).unsqueeze(-2)
    mixed = torch.einsum("...jk,...jd->...kd", h_res.to(acc), x.to(acc)) if h_res is not None else x.to(acc)
    return (y + mixed).to(x.dtype)


def _post_grads(grad_y, x, h_res, h_out, h_post):
    acc = _acc(x)
    g = grad_y.to(acc)
    grad_x = torch.einsum("...jk,...kd->...jd", h_res.to(acc), g) if h_res is not None else g
    grad_h_res = torch.einsum("...jd,...kd->...jk", x.to(acc), g)
    grad_h_out = torch.einsum("...k,...kd->...d", h_post.to(acc), g)
    grad_h_post = torch.einsum("...kd,...d->...k", g, h_out.to(acc))
    res_dtype = h_res.dtype if h_res is not None else (torch.float64 if acc == torch.float64 else torch.float32)
    return (grad_x.to(x.dtype), grad_h_res.to(res_dtype), grad_h_out.to(h_out.dtype),
            grad_h_post.to(h_post.dtype))


def _post_fake(x, h_res, h_out, h_post):
    _check_post("npu_mhc_post", x, h_res, h_out, h_post)
    return x.new_empty(x.shape)  # the wheel's Meta: torch.empty(x.shape), contiguous


def _post_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_autograd_backward(ctx, grad):
    # torch_npu (NpuMhcPostBackward0): x, h_res, h_out, h_post: npu_mhc_post_backward(grad, x, h_res, h_out, h_post)
    x, h_res, h_out, h_post = ctx.saved_tensors
    grad_x, grad_h_res, grad_h_out, grad_h_post = torch.ops.npu.npu_mhc_post_backward(grad, x, h_res, h_out, h_post)
    return grad_x, (grad_h_res if h_res is not None else None), grad_h_out, grad_h_post


@op_spec("npu::npu_mhc_post",
         schema="npu_mhc_post(Tensor x, Tensor? h_res, Tensor h_out, Tensor h_post) -> Tensor",
         fake=_post_fake, samples=_npu_post_samples, backward=_post_autograd_backward,
         setup_context=_post_setup_context,
         capability=OpCapability(
             dtypes=HALF_DTYPES,  # x and h_out; h_res / h_post fp32
             min_rank=3,
             max_rank=4,
             backward="npu.npu_mhc_post_backward",
             ge_converter=False,
             socs=only_on_socs("Ascend950"),
             limits={"streams": (4, 6, 8), "h_res_none_socs": ("Ascend950",)},
             doc="deepseek_v4.md 4.2 / torch_npu docstring npu_mhc_post: y = h_res^T x + h_out (x) h_post; x, h_out "
             "bf16/fp16 (one dtype), h_res, h_post fp32; n 4 / 6 / 8; 950 only; autograd NpuMhcPostBackward0; no GE "
             "converter",
         ))
def npu_mhc_post(x, h_res, h_out, h_post):
    # h_res None: the plain residual x + h_out (x) h_post (Ascend 950 only, capabilities.py)
    _check_post("npu_mhc_post", x, h_res, h_out, h_post)
    return _post(x, h_res, h_out, h_post).contiguous()


def _post_backward_fake(grad_y, x, h_res, h_out, h_post):
    lead, n, _ = _check_post("npu_mhc_post_backward", x, h_res, h_out, h_post)
    # grad_h_res is [.., n, n] fp32 even without h_res (deepseek_v4.md 4.2); all contiguous, as op-plugin
    # allocates them (op_plugin/ops/opapi/MhcPostBackwardNpuOpApi.cpp: apply_tensor_without_format)
    return (x.new_empty(x.shape), x.new_empty((*lead, n, n), dtype=torch.float32), h_out.new_empty(h_out.shape),
            h_post.new_empty(h_post.shape))


@op_spec("npu::npu_mhc_post_backward",
         schema="npu_mhc_post_backward(Tensor grad_y, Tensor x, Tensor? h_res, Tensor h_out, Tensor h_post) -> (Tensor,"
                " Tensor, Tensor, Tensor)",
         fake=_post_backward_fake, samples=_npu_post_backward_samples,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
             ge_converter=False, socs=only_on_socs("Ascend950"),
             doc="npu_mhc_post's backward (NpuMhcPostBackward0); Ascend 950; no GE converter",
         ))
def npu_mhc_post_backward(grad_y, x, h_res, h_out, h_post):
    # y[k] = h_post[k] h_out + sum_j h_res[j, k] x[j]:
    #   grad_x[j] = sum_k h_res[j, k] g[k] (g without h_res)    grad_h_res[j, k] = x[j] . g[k]
    #   grad_h_out = sum_k h_post[k] g[k]                       grad_h_post[k] = g[k] . h_out
    _check_post("npu_mhc_post_backward", x, h_res, h_out, h_post)
    # contiguous tensors of their own (without h_res grad_x is grad_y itself)
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in _post_grads(grad_y, x, h_res, h_out, h_post))


# =====================================================================================
# cann_ops_transformer.mhc_pre_sinkhorn (+ backward)
# =====================================================================================
def _check_pre_sinkhorn(op, x, phi, alpha, bias, hc_mult, num_iters) -> None:
    if x.dim() != 4:
        raise RuntimeError(f"{op}: x must be 4-D (B, S, N, C), it has {x.dim()} dims (the COT Meta reads 4 sizes)")
    _check_pre(op, x, phi, alpha, bias, None, 3)
    if hc_mult != x.shape[2]:
        raise RuntimeError(f"{op}: hcMult {hc_mult} differs from x's N = {x.shape[2]}")
    if num_iters <= 0:
        raise RuntimeError(f"{op}: numIters must be positive, got {num_iters}")


def _pre_sinkhorn_fake(x, phi, alpha, bias, hcMult, numIters, hcEps, normEps, outFlag):  # noqa: N803 - schema names
    _check_pre_sinkhorn("mhc_pre_sinkhorn", x, phi, alpha, bias, hcMult, numIters)
    b, s, n, c = x.shape
    f = phi.dtype
    if outFlag:  # the COT Meta
        extras = (x.new_empty((b, s, n), dtype=f), x.new_empty((b, s, n * n + 2 * n), dtype=f),
                  x.new_empty((b, s, 1), dtype=f), x.new_empty((2 * numIters, b, s, n), dtype=f),
                  x.new_empty((2 * numIters, b, s, n, n), dtype=f))
    else:
        extras = tuple(x.new_empty((0,), dtype=f) for _ in range(5))
    return (x.new_empty((b, s, c)), x.new_empty((b, s, n), dtype=f), x.new_empty((b, s, n * n), dtype=f), *extras)


@op_spec("cann_ops_transformer::mhc_pre_sinkhorn",
         schema="mhc_pre_sinkhorn(Tensor x, Tensor phi, Tensor alpha, Tensor bias, int hcMult, int numIters, float "
                "hcEps, float normEps, bool outFlag) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
                "Tensor)",
         fake=_pre_sinkhorn_fake, samples=_pre_sinkhorn_samples,
         python_autograd="cann_ops_transformer.ops.mhc_pre_sinkhorn.MhcPreSinkhornFunction",
         capability=OpCapability(
             dtypes=frozenset({torch.bfloat16}),  # x; phi / alpha / bias fp32
             min_rank=4,
             max_rank=4,  # (B, S, N, C) only: the Meta reads four sizes
             backward=None,  # no dispatcher autograd: the extension's MhcPreSinkhornFunction ...
             autograd_rule="npu_fx_fusion.patterns.mhc_pre.MhcPreSinkhorn",  # ... mirrored by ours
             ge_converter=True,
             socs=_A2_A3_950,
             limits={
                 "package": "cann_ops_transformer",
                 "ge_converter_source": "ops/graph_convert/graph_convert_mhc_pre_sinkhorn.py (GE MhcPreSinkhorn)",
                 "backward_op": "cann_ops_transformer.mhc_pre_sinkhorn_backward",
                 "streams": (4,),  # N = 4 only
                 "iterations": (20,),  # numIters = 20 only
                 "a2_a3_dim_multiple": 128, "a2_a3_max_dim": 100000,  # C on A2/A3
                 "dims_950": (4096, 7168),  # C on 950
             },
             doc="deepseek_v4.md 3.3 / COT docs/zh/mhc_pre_sinkhorn.md: 950, A2, A3; x bf16 (B, S, N, C), N = 4 and "
             "numIters = 20 only, C 128-aligned in [1, 100000] on A2/A3 and 4096 / 7168 on 950; positional "
             "(hcMult, numIters, hcEps, normEps, outFlag); training through MhcPreSinkhornFunction "
             "(mhc_pre_sinkhorn_backward); COT GE converter MhcPreSinkhorn",
         ))
def mhc_pre_sinkhorn(x, phi, alpha, bias, hcMult, numIters, hcEps, normEps, outFlag):  # noqa: N803
    # The module docstring: the pre mapping, then the Sinkhorn of z_res. -> (hin [B,S,C],
    # hPost [B,S,n], hRes [B,S,n*n] (flattened, doubly stochastic), and with outFlag hPre,
    # hcBeforeNorm (= h_mix), invRms [B,S,1], sumOut [2*iters,B,S,n], normOut [2*iters,B,S,n,n];
    # else empty). Positional order (hcMult, numIters, hcEps, normEps, outFlag): eps order is
    # the reverse of torch_npu's keywords.
    _check_pre_sinkhorn("mhc_pre_sinkhorn", x, phi, alpha, bias, hcMult, numIters)
    b, s, n, c = x.shape
    _, _, r, h_mix, _, h_pre, h_post, z_res, h_in = _pre_forward(x, phi, alpha, bias, None, normEps, hcEps)
    h_res, norms, sums = _sinkhorn_forward(z_res, hcEps, numIters)
    f = phi.dtype
    outs = (h_in.view(b, s, c), h_post.to(f).view(b, s, n), h_res.to(f).reshape(b, s, n * n))
    if not outFlag:
        return (*outs, *(x.new_empty((0,), dtype=f) for _ in range(5)))
    steps = norms.shape[0]
    return (*outs, h_pre.to(f).view(b, s, n), h_mix.to(f).view(b, s, -1), r.to(f).view(b, s, 1),
            sums.to(f).view(steps, b, s, n), norms.to(f).view(steps, b, s, n, n))


def _pre_sinkhorn_backward_fake(gradHin, gradHPost, gradHRes, x, phi, alpha, bias, hPre, hcBeforeNorm,  # noqa: N803
                                invRms, sumOut, normOut, hcEps):
    return torch.empty_like(x), torch.empty_like(phi), torch.empty_like(alpha), torch.empty_like(bias)


@op_spec("cann_ops_transformer::mhc_pre_sinkhorn_backward",
         schema="mhc_pre_sinkhorn_backward(Tensor gradHin, Tensor gradHPost, Tensor gradHRes, Tensor x, Tensor phi, "
                "Tensor alpha, Tensor bias, Tensor hPre, Tensor hcBeforeNorm, Tensor invRms, Tensor sumOut, Tensor "
                "normOut, float hcEps) -> (Tensor, Tensor, Tensor, Tensor)",
         fake=_pre_sinkhorn_backward_fake, samples=_pre_sinkhorn_backward_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.bfloat16}), min_rank=4,
             max_rank=4, backward=None, ge_converter=True, socs=_A2_A3_950,
             limits={"package": "cann_ops_transformer",
                     "ge_converter_source": "ops/graph_convert/graph_convert_mhc_pre_sinkhorn_backward.py "
                                            "(GE MhcPreSinkhornBackward)"},
             doc="mhc_pre_sinkhorn's backward (COT ops/mhc_pre_sinkhorn_backward.py): dx, dphi, dalpha, dbias",
         ))
def mhc_pre_sinkhorn_backward(gradHin, gradHPost, gradHRes, x, phi, alpha, bias, hPre, hcBeforeNorm,  # noqa: N803
                              invRms, sumOut, normOut, hcEps):
    # The Sinkhorn's reverse from sumOut / normOut (gradHRes is that of the flattened, normalised
    # hRes), then the pre mapping's (npu_mhc_pre_backward's chain); h_post's sigmoid is recomputed
    # from hcBeforeNorm * invRms, alpha and bias (the op takes no hPost). -> (dx, dphi, dalpha, dbias)
    b, s, n, c = x.shape
    acc = _acc(x)
    t = b * s
    xs = x.reshape(t, n, c).to(acc)
    xf = xs.reshape(t, n * c)
    r = invRms.reshape(t, 1).to(acc)
    h_mix = hcBeforeNorm.reshape(t, -1).to(acc)
    a, bb = alpha.to(acc).reshape(-1), bias.to(acc)
    h_post = 2 * torch.sigmoid(h_mix[:, n:2 * n] * r * a[1] + bb[n:2 * n])
    steps = sumOut.shape[0]
    norms = normOut.reshape(steps, t, n, n).to(acc)
    sums = sumOut.reshape(steps, t, n).to(acc)
    grad_z_res = _sinkhorn_backward(gradHRes.reshape(t, n, n).to(acc), norms, sums, hcEps)
    dx, dphi, dalpha, dbias, _ = _pre_backward(xs, xf, r, h_mix, hPre.reshape(t, n).to(acc), h_post, alpha, phi, None,
                                               hcEps, gradHin, gradHPost, grad_z_res)
    # in its inputs' layouts: the extension's Meta (ops/mhc_pre_sinkhorn_backward.py) is empty_like of each
    return tuple(in_layout_of(grad, like) for grad, like in (
        (dx.to(x.dtype).view(x.shape), x), (dphi.to(phi.dtype), phi), (dalpha.to(alpha.dtype).view(alpha.shape), alpha),
        (dbias.to(bias.dtype), bias)))


# =====================================================================================
# cann_ops_transformer.mhc_post (+ backward)
# =====================================================================================
def _cann_post_fake(x, hRes, hOut, hPost):  # noqa: N803
    _check_post("mhc_post", x, hRes, hOut, hPost)
    return torch.empty_like(x)


@op_spec("cann_ops_transformer::mhc_post",
         schema="mhc_post(Tensor x, Tensor hRes, Tensor hOut, Tensor hPost) -> Tensor",
         fake=_cann_post_fake, samples=_post_samples,
         python_autograd="cann_ops_transformer.ops.mhc_post.MhcPostFunction",
         capability=OpCapability(
             dtypes=HALF_DTYPES,
             min_rank=3,
             max_rank=4,
             backward=None,  # the extension's MhcPostFunction (mhc_post_backward), mirrored by ours
             autograd_rule="npu_fx_fusion.patterns.mhc_post.MhcPost",
             ge_converter=False,  # the extension has no converter for it
             # The 950 conflict (deepseek_v4.md 16.3): the extension doc (docs/zh/mhc_post.md) says 950
             # "不支持"; the kernel's own README (mhc/mhc_post/README.md) lists 950 as supported, the
             # kernel has arch35 (950) sources (op_kernel/arch35/mhc_post*.h, op_tiling/arch35/*) and
             # torchtitan-npu calls it on A5. Decided from the kernel: supported on 950 (the
             # extension doc read as stale); npu_mhc_post is preferred there anyway (patterns/mhc_post.py).
             socs=_A2_A3_950,
             limits={"package": "cann_ops_transformer", "backward_op": "cann_ops_transformer.mhc_post_backward",
                     "streams": (4, 6, 8),
                     "950_evidence": "kernel README and arch35 kernel sources: supported (extension doc: not)"},
             doc="deepseek_v4.md 4.2 / COT docs/zh/mhc_post.md: x, h_out bf16/fp16, h_res (required) and h_post "
             "fp32, (B, S, n, D) or (T, n, D); A2 / A3 (and 950, see the socs comment); training through "
             "MhcPostFunction (mhc_post_backward); no GE converter",
         ))
def mhc_post(x, hRes, hOut, hPost):  # noqa: N803
    # npu_mhc_post's formula (COT doc mhc_post.md and golden mhc/mhc_post/tests/assert/golden.py); hRes required
    _check_post("mhc_post", x, hRes, hOut, hPost)
    return in_layout_of(_post(x, hRes, hOut, hPost), x)  # the extension's Meta: empty_like(x)


def _cann_post_backward_fake(gradOutput, x, hRes, hOut, hPost):  # noqa: N803
    # the COT Meta: each gradient like its input
    return torch.empty_like(x), torch.empty_like(hRes), torch.empty_like(hOut), torch.empty_like(hPost)


@op_spec("cann_ops_transformer::mhc_post_backward",
         schema="mhc_post_backward(Tensor gradOutput, Tensor x, Tensor hRes, Tensor hOut, Tensor hPost) -> (Tensor, "
                "Tensor, Tensor, Tensor)",
         fake=_cann_post_backward_fake, samples=_post_backward_samples,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
             ge_converter=False, socs=_A2_A3_950, limits={"package": "cann_ops_transformer"},
             doc="mhc_post's backward (COT ops/mhc_post_backward.py); no GE converter",
         ))
def mhc_post_backward(gradOutput, x, hRes, hOut, hPost):  # noqa: N803
    _check_post("mhc_post_backward", x, hRes, hOut, hPost)
    # the extension's Meta (ops/mhc_post_backward.py): empty_like of x, hRes, hOut, hPost
    return tuple(in_layout_of(grad, like) for grad, like in zip(_post_grads(gradOutput, x, hRes, hOut, hPost),
                                                                 (x, hRes, hOut, hPost)))
