"""The FlashAttention stand-ins: npu_fusion_attention_v3 / npu_fusion_attention and grads.

Against an independent float64 reference written from the docstring's formula
(softmax(mask(scale * (pse + q k^T))) v, Ascend's mask convention True = masked out), per
layout, mask shape, sparse_mode, GQA and pse; the mask convention against PyTorch SDPA's
(the opposite one); the grads against autograd of the reference; shapes under fake tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import assert_close_at_scale, assert_within_ulps
from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.fusion_attention import qkv, to_layout

ensure_registered()
npu = torch.ops.npu
TOKEN_MAX = 2147483647
COMPRESSED = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


# ---- the reference ------------------------------------------------------------------------------
def reference(q, k, v, scale, hidden=None, pse=None):
    """BNSD float64; `hidden` (bool, broadcast to B, N, Sq, Skv): True = masked out. Fully
    hidden rows give 0. One query row at a time, no shared code with the stand-in."""
    batch, heads, queries, _ = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(batch, heads, queries, v.shape[-1], dtype=torch.float64)
    if hidden is not None:
        hidden = hidden.expand(batch, heads, queries, k.shape[2])
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, h // groups].double(), v[b, h // groups].double()
            for i in range(queries):
                s = kh @ q[b, h, i].double()
                if pse is not None:
                    s = s + pse.expand(batch, heads, queries, k.shape[2])[b, h, i].double()
                s = s * scale
                keep = torch.ones_like(s, dtype=torch.bool) if hidden is None else ~hidden[b, h, i]
                if not keep.any():
                    continue
                p = torch.softmax(s[keep], dim=0)
                out[b, h, i] = p @ vh[keep]
    return out


def _from_layout(t, layout, heads):
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape
    return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _masks(batch, heads, queries, keys):
    generator = torch.Generator().manual_seed(7)
    random = torch.rand(batch, heads, queries, keys, generator=generator) > 0.6
    return {
        "SS": random[0, 0], "B1SS": random[:, :1], "BNSS": random, "11SS": random[:1, :1],
    }


# ---- forward vs the float64 reference --------------------------------------------------------------
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("mask", [None, "SS", "B1SS", "BNSS", "11SS"])
def test_forward_equals_the_float64_reference(layout, mask):
    q, k, v = qkv(dim_v=6 if layout in ("BNSD", "BSND") else 8)
    atten_mask = None if mask is None else _masks(2, 4, 5, 7)[mask]
    out, softmax_max, softmax_sum, softmax_out, seed, offset = npu.npu_fusion_attention_v3(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), 4, layout, atten_mask=atten_mask,
        scale=0.3)
    expected = reference(q, k, v, 0.3, atten_mask)
    torch.testing.assert_close(_from_layout(out, layout, 4), expected, rtol=1e-12, atol=1e-12)
    assert softmax_max.shape == softmax_sum.shape == (2, 4, 5, 8) and softmax_max.dtype == torch.float32
    assert softmax_out.shape == (0,) and seed.shape == offset.shape == (1,) and seed.dtype == torch.int64


@pytest.mark.parametrize("sparse_mode, queries, keys", [(2, 5, 7), (3, 5, 7), (3, 7, 7), (2, 7, 5)])
def test_causal_modes_compute_left_up_and_right_down(sparse_mode, queries, keys):
    q, k, v = qkv(queries=queries, keys=keys)
    out = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, scale=0.5,
                                      sparse_mode=sparse_mode)[0]
    i, j = torch.arange(queries).view(-1, 1), torch.arange(keys).view(1, -1)
    hidden = j > i + (0 if sparse_mode == 2 else keys - queries)  # left-up: j <= i; right-down: j <= i + Skv - Sq
    torch.testing.assert_close(out, reference(q, k, v, 0.5, hidden), rtol=1e-12, atol=1e-12)


def test_left_up_and_right_down_differ_where_the_lengths_do():
    q, k, v = qkv(queries=3, keys=6)
    left_up = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, sparse_mode=2)[0]
    right_down = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, sparse_mode=3)[0]
    assert not torch.allclose(left_up, right_down)


def test_sparse_mode_0_intersects_the_mask_with_the_token_band():
    q, k, v = qkv()
    mask = _masks(2, 4, 5, 7)["SS"]
    out = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3, pre_tockens=1,
                                      next_tockens=0)[0]
    i, j = torch.arange(5).view(-1, 1), torch.arange(7).view(1, -1)
    hidden = mask | (j > i) | (j < i - 1)
    torch.testing.assert_close(out, reference(q, k, v, 0.3, hidden), rtol=1e-12, atol=1e-12)
    # without a mask, sparse_mode and the band do nothing (the docs: full computation)
    unmasked = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", scale=0.3, pre_tockens=1, next_tockens=0,
                                           sparse_mode=3)[0]
    torch.testing.assert_close(unmasked, reference(q, k, v, 0.3), rtol=1e-12, atol=1e-12)


def test_pse_is_added_before_the_scale():
    q, k, v = qkv()
    pse = torch.randn(1, 4, 5, 7, dtype=torch.float64)
    out = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", pse=pse, scale=0.3)[0]
    torch.testing.assert_close(out, reference(q, k, v, 0.3, pse=pse), rtol=1e-12, atol=1e-12)


def test_softmax_statistics_give_the_log_sum_exp():
    q, k, v = qkv(heads=2, kv_heads=2)
    mask = _masks(2, 2, 5, 7)["BNSS"]
    _, softmax_max, softmax_sum, *_ = npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", atten_mask=mask, scale=0.3)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    assert torch.equal(softmax_max, softmax_max[..., :1].expand_as(softmax_max))  # 8 copies
    torch.testing.assert_close((softmax_max[..., 0] + softmax_sum[..., 0].log()).double(), lse,
                               rtol=1e-6, atol=1e-6)


def test_a_fully_masked_row_gives_zero():
    q, k, v = qkv()
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[2] = True
    out, softmax_max, softmax_sum, *_ = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask,
                                                                    inner_precise=2)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert (softmax_sum[:, :, 2] == 0).all() and torch.isneginf(softmax_max[:, :, 2]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_inputs_accumulate_in_fp32_and_round_once(dtype):
    q, k, v = qkv(dtype=dtype)
    mask = _masks(2, 4, 5, 7)["B1SS"]
    out = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3)[0]
    assert out.dtype == dtype
    expected = reference(q, k, v, 0.3, mask).to(dtype)
    if dtype == torch.float32:
        # fp32 arithmetic (8-term dot products, a 7-key softmax, P @ V's cancellations): a few
        # ulp at the output's scale
        assert_close_at_scale(out, expected, 4)
    else:
        # fp32 accumulation stays far below a half ulp: the exact result rounded once
        assert_within_ulps(out, expected, 1)


# ---- the mask convention -----------------------------------------------------------------------
def test_the_mask_is_ascends_true_masked_out_the_opposite_of_sdpas():
    """npu_fusion_attention_v3 with `~mask` is SDPA with `mask`; the unflipped mask is not."""
    q, k, v = qkv(dtype=torch.float32, kv_heads=4)
    attend = _masks(2, 4, 5, 7)["B1SS"] | torch.eye(5, 7, dtype=torch.bool)  # SDPA's: True = attend
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=0.3)
    ascend = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=torch.logical_not(attend), scale=0.3)[0]
    torch.testing.assert_close(ascend, expected, rtol=1e-5, atol=1e-5)
    mixed_up = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=attend, scale=0.3)[0]
    assert not torch.allclose(mixed_up, expected, rtol=1e-3, atol=1e-3)


def test_uint8_masks_read_as_bool():
    q, k, v = qkv()
    mask = _masks(2, 4, 5, 7)["SS"]
    as_bool = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask)[0]
    as_uint8 = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask.to(torch.uint8))[0]
    assert torch.equal(as_bool, as_uint8)


# ---- the backward ------------------------------------------------------------------------------
def _grads_of_reference(q, k, v, dy, scale, hidden=None, pse=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    pse_leaf = None if pse is None else pse.detach().clone().requires_grad_()
    out = _differentiable_reference(*leaves, scale, hidden, pse_leaf)
    grads = torch.autograd.grad(out, leaves + ([pse_leaf] if pse_leaf is not None else []), dy)
    return grads


def _differentiable_reference(q, k, v, scale, hidden, pse):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = s * scale
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("with_pse", [False, True])
def test_grad_equals_autograd_of_the_reference(with_pse):
    q, k, v = qkv(dim_v=6)
    mask = _masks(2, 4, 5, 7)["BNSS"] & ~torch.eye(5, 7, dtype=torch.bool)  # every row keeps a key
    pse = torch.randn(1, 4, 5, 7, dtype=torch.float64) if with_pse else None
    out, softmax_max, softmax_sum, softmax_out, seed, offset = npu.npu_fusion_attention_v3(
        q, k, v, 4, "BNSD", pse=pse, atten_mask=mask, scale=0.3)
    dy = torch.randn_like(out)
    dq, dk, dv, dpse, dsink = npu.npu_fusion_attention_grad_v3(
        q, k, v, dy, 4, "BNSD", pse=pse, atten_mask=mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        softmax_in=softmax_out, attention_in=out, scale_value=0.3, seed=seed, offset=offset)
    expected = _grads_of_reference(q, k, v, dy, 0.3, mask, pse)
    # softmax_max / softmax_sum are fp32 (the kernel's): the recomputed probabilities carry
    # their rounding, about 1e-7 relative
    for actual, wanted in zip((dq, dk, dv, dpse) if with_pse else (dq, dk, dv), expected):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-6)
    assert dk.shape == k.shape and dv.shape == v.shape  # summed over each key head's query heads (GQA)
    assert dsink.shape == (0,) and (with_pse or dpse.shape == (0,))


def test_the_grad_reads_the_forwards_statistics():
    """Mix-up test: softmax_max and softmax_sum swapped (or another row's) give other grads."""
    q, k, v = qkv()
    out, softmax_max, softmax_sum, softmax_out, seed, offset = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD")
    dy = torch.randn_like(out)

    def grad(m, s):
        return npu.npu_fusion_attention_grad_v3(q, k, v, dy, 4, "BNSD", softmax_max=m, softmax_sum=s,
                                                attention_in=out)[0]

    right = grad(softmax_max, softmax_sum)
    torch.testing.assert_close(right, _grads_of_reference(q, k, v, dy, 1.0)[0], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(grad(softmax_sum, softmax_max), right)


def test_autograd_differentiates_through_the_grad_op():
    q, k, v = qkv(dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = npu.npu_fusion_attention_v3(*leaves, 4, "BNSD", atten_mask=COMPRESSED, scale=0.4, sparse_mode=3)[0]
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    i, j = torch.arange(5).view(-1, 1), torch.arange(7).view(1, -1)
    expected = _grads_of_reference(q.double(), k.double(), v.double(), dy.double(), 0.4, j > i + 2)
    for actual, wanted in zip(grads, expected):
        torch.testing.assert_close(actual.double(), wanted, rtol=1e-4, atol=1e-4)


def test_the_plain_op_is_the_same_attention_with_int_outputs():
    q, k, v = qkv()
    mask = _masks(2, 4, 5, 7)["B1SS"]
    v3 = npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3, inner_precise=2)
    plain = npu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3, inner_precise=2)
    assert torch.equal(plain[0], v3[0]) and plain[4:] == (0, 0, 0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = npu.npu_fusion_attention(*leaves, 4, "BNSD", atten_mask=mask, scale=0.3)[0]
    dy = torch.randn_like(out)
    for actual, wanted in zip(torch.autograd.grad(out, leaves, dy),
                              _grads_of_reference(q, k, v, dy, 0.3, mask)):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-6)


# ---- fake tensors and refusals -----------------------------------------------------------------
@pytest.mark.parametrize("layout, shapes, out_shape", [
    ("BNSD", ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)), (2, 4, 5, 6)),
    ("BSND", ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 6)), (2, 5, 4, 6)),
    ("BSH", ((2, 5, 32), (2, 7, 16), (2, 7, 12)), (2, 5, 24)),
    ("SBH", ((5, 2, 32), (7, 2, 16), (7, 2, 12)), (5, 2, 24)),
])
def test_fake_outputs_have_the_kernels_shapes(layout, shapes, out_shape):
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=torch.bfloat16) for s in shapes)
        out, softmax_max, softmax_sum, softmax_out, seed, offset = npu.npu_fusion_attention_v3(q, k, v, 4, layout)
        plain = npu.npu_fusion_attention(q, k, v, 4, layout)
    assert tuple(out.shape) == out_shape and out.dtype == torch.bfloat16
    assert tuple(softmax_max.shape) == (2, 4, 5, 8) and softmax_sum.dtype == torch.float32
    assert tuple(softmax_out.shape) == (0,) and tuple(seed.shape) == (1,) and offset.dtype == torch.int64
    assert tuple(plain[0].shape) == out_shape and plain[4:] == (0, 0, 0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"keep_prob": 0.9}, NotImplementedError, "Philox"),
    ({"sparse_mode": 4, "atten_mask": COMPRESSED}, NotImplementedError, "sparse_mode 4"),
    ({"sparse_mode": 2, "atten_mask": torch.zeros(5, 7, dtype=torch.bool)}, RuntimeError, "compressed mask"),
    ({"atten_mask": torch.zeros(5, 7)}, RuntimeError, "bool or uint8"),
    ({"padding_mask": torch.zeros(1)}, RuntimeError, "padding_mask"),
    ({"sink": torch.zeros(4)}, NotImplementedError, "sink"),
])
def test_what_the_stand_in_cannot_compute_is_refused(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD", **kwargs)


def test_heads_that_do_not_divide_and_tnd_are_refused():
    q, k, v = qkv(heads=4, kv_heads=3)
    with pytest.raises(RuntimeError, match="Nq / Nkv"):
        npu.npu_fusion_attention_v3(q, k, v, 4, "BNSD")
    with pytest.raises(NotImplementedError, match="TND"):
        npu.npu_fusion_attention_v3(q[0], k[0], v[0], 4, "TND")
