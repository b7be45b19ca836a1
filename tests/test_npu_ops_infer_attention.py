"""The inference-attention and KV-cache stand-ins compute what their docs say, conventions first.

npu_fused_infer_attention_score, scatter_update(_) and npu_kv_rmsnorm_rope_cache_v2_functional
are compared with references written here independently (per query row, per head, per
token Python loops in float64). Each convention also gets a mix-up test: the other
convention (a mask with SDPA's True = attend, BNSD read as BSND, query head h on key head
h % N_kv instead of h // G, left-up instead of right-down causal, the rope part rotated
without de-interleaving, the two caches swapped, ...) gives a different result on the same
input, so the comparisons would catch the swap.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.infer_attention import compressed_causal_mask, qkv
from npu_fx_fusion.npu_ops.kv_cache import latent_cache_inputs
from npu_fx_fusion.npu_ops.spec import randn

npu = torch.ops.npu
OPS = ["npu::npu_fused_infer_attention_score", "npu::scatter_update", "npu::scatter_update_",
       "npu::npu_kv_rmsnorm_rope_cache_v2_functional"]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    registered = ensure_registered()
    assert all(op in registered for op in OPS)


# =====================================================================================
# npu_fused_infer_attention_score
# =====================================================================================
def reference_attention(q, k, v, visible, scale):
    """(B, N, Sq, D) float64, one query row and head at a time; visible (B, Sq, Skv) bool;
    query head h reads key head h // (N / N_kv)."""
    batch, heads, queries, _ = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, heads, queries, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(queries):
                keys = [j for j in range(k.shape[2]) if visible[b, i, j]]
                scores = torch.stack([(q[b, h, i] * k[b, h // group, j]).sum() * scale for j in keys])
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = sum(w * v[b, h // group, j] for w, j in zip(weights, keys))
    return out


def right_down(batch, queries, keys, lengths=None):
    lengths = lengths or [keys] * batch
    return torch.tensor([[[j < lengths[b] and j <= i + lengths[b] - queries for j in range(keys)]
                          for i in range(queries)] for b in range(batch)])


def left_up(batch, queries, keys):
    return torch.tensor([[[j <= i for j in range(keys)] for i in range(queries)] for _ in range(batch)])


def fia(q, k, v, **kwargs):
    kwargs.setdefault("input_layout", "BNSD")
    kwargs.setdefault("num_heads", q.shape[1] if kwargs["input_layout"] == "BNSD" else q.shape[2])
    return npu.npu_fused_infer_attention_score(q, k, v, **kwargs)


B, N, NKV, D = 2, 4, 2, 8


@pytest.mark.parametrize("queries, keys", [(5, 5), (3, 7)])
def test_sparse_mode_3_is_right_down_causal_with_the_compressed_mask(queries, keys):
    q, k, v = qkv(queries, keys)
    out, lse = fia(q, k, v, atten_mask=compressed_causal_mask(), sparse_mode=3, scale=0.3,
                   num_key_value_heads=NKV)
    torch.testing.assert_close(out, reference_attention(q, k, v, right_down(B, queries, keys), 0.3))
    assert lse.shape == (0,)
    # mix-up: left-up causal (sparse_mode 2) is another mask unless Q_S == KV_S
    out2, _ = fia(q, k, v, atten_mask=compressed_causal_mask(), sparse_mode=2, scale=0.3, num_key_value_heads=NKV)
    torch.testing.assert_close(out2, reference_attention(q, k, v, left_up(B, queries, keys), 0.3))
    assert torch.equal(out, out2) == (queries == keys)


def test_explicit_mask_is_true_where_masked_out():
    q, k, v = qkv(3, 6)
    hidden = randn(B, 1, 3, 6, seed=9) > 0.3
    hidden[..., 0] = False  # every row keeps a key
    out, _ = fia(q, k, v, atten_mask=hidden, scale=0.5, num_key_value_heads=NKV, inner_precise=2)
    visible = ~hidden[:, 0]
    torch.testing.assert_close(out, reference_attention(q, k, v, visible, 0.5))
    # mix-up: SDPA's convention (True = attend) passed as is attends to the complement
    sdpa_style, _ = fia(q, k, v, atten_mask=~hidden, scale=0.5, num_key_value_heads=NKV, inner_precise=2)
    assert not torch.allclose(sdpa_style, out)


@pytest.mark.parametrize("mask_shape", [(B, 1, 1, 9), (B, 9), (1, 1, 1, 9)])
def test_decode_takes_the_explicit_mask_and_ignores_sparse_mode(mask_shape):
    q, k, v = qkv(1, 9)
    hidden = torch.zeros(mask_shape, dtype=torch.bool)
    hidden[..., 6:] = True  # the static cache's unwritten tail
    out, _ = fia(q, k, v, atten_mask=hidden, scale=0.25, num_key_value_heads=NKV)
    visible = torch.zeros(B, 1, 9, dtype=torch.bool)
    visible[..., :6] = True
    expected = reference_attention(q, k, v, visible, 0.25)
    torch.testing.assert_close(out, expected)
    # the incremental branch ignores sparse_mode (3 without its compressed mask is fine there)
    out3, _ = fia(q, k, v, atten_mask=hidden, scale=0.25, num_key_value_heads=NKV, sparse_mode=3)
    assert torch.equal(out3, out)
    # actual_seq_lengths_kv = 6 reads only the valid keys: the same numbers without a mask
    short, _ = fia(q, k, v, actual_seq_lengths_kv=[6], scale=0.25, num_key_value_heads=NKV)
    torch.testing.assert_close(short, expected)


def test_query_head_h_reads_key_head_h_over_the_group():
    q, k, v = qkv(2, 2)
    out, _ = fia(q, k, v, scale=1.0, num_key_value_heads=NKV)
    everything = torch.ones(B, 2, 2, dtype=torch.bool)
    torch.testing.assert_close(out, reference_attention(q, k, v, everything, 1.0))
    # mix-up: the head of h % N_kv (torch's repeat instead of repeat_interleave)
    tiled = reference_attention(q, k.repeat(1, N // NKV, 1, 1), v.repeat(1, N // NKV, 1, 1), everything, 1.0)
    assert not torch.allclose(out, tiled)


def test_bsnd_reads_the_same_numbers_transposed_and_returns_bsnd():
    q, k, v = qkv(3, 5)
    mask = compressed_causal_mask()
    bnsd, _ = fia(q, k, v, atten_mask=mask, sparse_mode=3, num_key_value_heads=NKV, scale=0.2)
    as_bsnd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    bsnd, _ = fia(*as_bsnd, atten_mask=mask, sparse_mode=3, num_key_value_heads=NKV, scale=0.2,
                  input_layout="BSND", num_heads=N)
    assert bsnd.shape == (B, 3, N, D)
    torch.testing.assert_close(bsnd, bnsd.transpose(1, 2))
    # mix-up: BNSD tensors announced as BSND are read with S and N swapped
    with pytest.raises(RuntimeError, match="heads"):
        fia(q, k, v, atten_mask=mask, sparse_mode=3, num_key_value_heads=NKV, input_layout="BSND", num_heads=N)
    # ... and with S = N = 4 the shapes fit either way, but the numbers do not
    q4, k4, v4 = (t.contiguous() for t in qkv(N, N))
    k4, v4 = k4.repeat_interleave(2, dim=1), v4.repeat_interleave(2, dim=1)
    as_bnsd, _ = fia(q4, k4, v4, input_layout="BNSD", num_heads=N)
    as_bsnd, _ = fia(q4, k4, v4, input_layout="BSND", num_heads=N)
    assert not torch.allclose(as_bnsd, as_bsnd)


def test_bnsd_bsnd_and_bsh_layouts():
    q, k, v = qkv(3, 5)
    bnsd, _ = fia(q, k, v, num_key_value_heads=NKV)
    mixed, _ = fia(q, k, v, num_key_value_heads=NKV, input_layout="BNSD_BSND", num_heads=N)
    torch.testing.assert_close(mixed, bnsd.transpose(1, 2))
    bsh = [t.transpose(1, 2).flatten(-2).contiguous() for t in (q, k, v)]
    out, _ = fia(*bsh, num_key_value_heads=NKV, input_layout="BSH", num_heads=N)
    torch.testing.assert_close(out, bnsd.transpose(1, 2).flatten(-2))


def test_fully_masked_rows_need_the_invalid_row_correction():
    q, k, v = qkv(3, 4)
    hidden = torch.zeros(B, 1, 3, 4, dtype=torch.bool)
    hidden[:, :, 0] = True  # query row 0 sees nothing (left padding)
    corrected, _ = fia(q, k, v, atten_mask=hidden, inner_precise=2, num_key_value_heads=NKV)
    assert torch.equal(corrected[:, :, 0], torch.zeros_like(corrected[:, :, 0]))
    plain, _ = fia(q, k, v, atten_mask=hidden, inner_precise=0, num_key_value_heads=NKV)
    assert torch.isnan(plain[:, :, 0]).all()  # undefined on the NPU: NaN here, never a plausible number
    torch.testing.assert_close(plain[:, :, 1:], corrected[:, :, 1:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rounds_once(dtype):
    q, k, v = qkv(4, 6, dtype=dtype)
    out, _ = fia(q, k, v, atten_mask=compressed_causal_mask(), sparse_mode=3, scale=0.35, num_key_value_heads=NKV)
    assert out.dtype == dtype
    visible = right_down(B, 4, 6)[:, None]
    kk, vv = (t.float().repeat_interleave(2, dim=1) for t in (k, v))
    scores = (q.float() @ kk.transpose(-1, -2) * 0.35).masked_fill(~visible, float("-inf"))
    assert torch.equal(out, (torch.softmax(scores, -1) @ vv).to(dtype))


def test_softmax_lse():
    q, k, v = qkv(2, 3)
    _, lse = fia(q, k, v, softmax_lse_flag=True, scale=0.5, num_key_value_heads=NKV)
    kk = k.repeat_interleave(2, dim=1)
    torch.testing.assert_close(lse, torch.logsumexp(q @ kk.transpose(-1, -2) * 0.5, -1, keepdim=True).float())


def test_refusals():
    q, k, v = qkv(3, 5)
    with pytest.raises(RuntimeError, match="contiguous"):
        fia(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, num_key_value_heads=NKV)
    with pytest.raises(RuntimeError, match="one shape"):
        fia(q, k, v[..., :4].contiguous(), num_key_value_heads=NKV)
    with pytest.raises(RuntimeError, match="compressed mask"):
        fia(q, k, v, atten_mask=torch.ones(3, 5, dtype=torch.bool).triu(1), sparse_mode=3, num_key_value_heads=NKV)
    with pytest.raises(RuntimeError, match="bool, int8 or uint8"):
        fia(q, k, v, atten_mask=torch.zeros(B, 1, 3, 5), num_key_value_heads=NKV)
    with pytest.raises(NotImplementedError, match="block_table"):
        fia(q, k, v, block_table=torch.zeros(B, 1, dtype=torch.int32), num_key_value_heads=NKV)
    with pytest.raises(RuntimeError, match="inner_precise must be 0 or 1"):
        fia(q[:, :, :1].contiguous(), k, v, inner_precise=2, num_key_value_heads=NKV)


# =====================================================================================
# scatter_update / scatter_update_
# =====================================================================================
def reference_scatter_update(data, indices, updates, axis):
    out = data.clone()
    ax = axis % data.dim()
    for b in range(data.shape[0]):
        for k in range(updates.shape[ax]):
            dst = [b] + [slice(None)] * (data.dim() - 1)
            src = [b] + [slice(None)] * (data.dim() - 1)
            dst[ax], src[ax] = int(indices[b]) + k, k
            out[tuple(dst)] = updates[tuple(src)]
    return out


@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_scatter_update_writes_each_row_at_its_offset(axis, index_dtype):
    data = randn(3, 2, 9, 6, seed=1)
    updates = randn(3, 2, 2, 6, seed=2) if axis == -2 else randn(3, 2, 9, 3, seed=2)
    indices = torch.tensor([0, 4, 7] if axis == -2 else [0, 1, 3], dtype=index_dtype)
    before = data.clone()
    out = npu.scatter_update(data, indices, updates, axis)
    assert torch.equal(out, reference_scatter_update(data, indices, updates, axis))
    assert torch.equal(data, before)  # the functional op leaves its input alone
    in_place = npu.scatter_update_(data, indices, updates, axis)
    assert in_place is data and torch.equal(data, out)


def test_scatter_update_mix_ups():
    data = torch.zeros(2, 3, 8, 4)
    updates = randn(2, 3, 1, 4, seed=3, dtype=torch.float32)
    indices = torch.tensor([2, 5])
    out = npu.scatter_update(data, indices, updates, -2)
    # the offsets index dim 0 (the batch), not the heads; the write runs along axis -2
    assert torch.equal(out[0, :, 2], updates[0, :, 0]) and torch.equal(out[1, :, 5], updates[1, :, 0])
    assert out[0, :, 5].abs().sum() == 0 and out[1, :, 2].abs().sum() == 0
    as_last_axis = npu.scatter_update(data.transpose(-1, -2).contiguous(), indices,
                                      updates.transpose(-1, -2).contiguous(), -1)
    assert torch.equal(as_last_axis.transpose(-1, -2), out)


def test_scatter_update_refuses_what_the_npu_would_not_check():
    data, updates = torch.zeros(2, 1, 4, 2), torch.ones(2, 1, 2, 2)
    with pytest.raises(IndexError, match="out of bounds"):
        npu.scatter_update(data, torch.tensor([0, 3]), updates, -2)
    with pytest.raises(NotImplementedError, match="2-D"):
        npu.scatter_update(data, torch.zeros(2, 2, dtype=torch.int64), updates, -2)
    with pytest.raises(RuntimeError, match="one rank"):
        npu.scatter_update(data, torch.tensor([0, 1]), updates[0], -2)


def test_scatter_update_fake():
    data, updates, indices = torch.zeros(2, 1, 4, 2), torch.ones(2, 1, 1, 2), torch.tensor([0, 1])
    with FakeTensorMode() as mode:
        fake = npu.scatter_update(mode.from_tensor(data), mode.from_tensor(indices), mode.from_tensor(updates), -2)
        data_fake = mode.from_tensor(data)
        assert npu.scatter_update_(data_fake, mode.from_tensor(indices), mode.from_tensor(updates), -2) is data_fake
    assert fake.shape == data.shape and fake.dtype == data.dtype


# =====================================================================================
# npu_kv_rmsnorm_rope_cache_v2_functional
# =====================================================================================
DV, DK, LEN = 6, 4, 7  # latent (RMSNorm) dim, rope dim, cache length


def reference_latent(kv, gamma, cos, sin, index, k_cache, ckv_cache, eps):
    """The README's formulas token by token in float64, then the Norm-mode scatter."""
    k_cache, ckv_cache = k_cache.clone(), ckv_cache.clone()
    batch, _, seq, _ = kv.shape
    k_embed = torch.zeros(batch, 1, seq, DK, dtype=torch.float64)
    y = torch.zeros(batch, 1, seq, DV, dtype=torch.float64)
    for b in range(batch):
        for s in range(seq):
            x, r = kv[b, 0, s, :DV].double(), kv[b, 0, s, DV:].double()
            y[b, 0, s] = x / math.sqrt((x * x).mean().item() + eps) * gamma.double()
            x1, x2 = r[0::2], r[1::2]
            c, si = cos[b, 0, s].double(), sin[b, 0, s].double()
            k_embed[b, 0, s] = torch.cat((x1, x2)) * c + torch.cat((-x2, x1)) * si
            position = int(index[b, s])
            if position >= 0:
                k_cache[b, 0, position] = k_embed[b, 0, s].to(k_cache.dtype)
                ckv_cache[b, 0, position] = y[b, 0, s].to(ckv_cache.dtype)
    return k_embed, y, k_cache, ckv_cache


def _latent_inputs(seq=3, dtype=torch.float64, batch=2):
    return latent_cache_inputs(dtype, seq=seq, batch=batch, dim_v=DV, dim_k=DK, cache_len=LEN)


def test_latent_cache_op_matches_the_readme_formulas():
    inputs = _latent_inputs()
    before = [t.clone() for t in inputs]
    out = npu.npu_kv_rmsnorm_rope_cache_v2_functional(*inputs, epsilon=1e-6)
    for got, want in zip(out, reference_latent(*inputs, eps=1e-6)):
        torch.testing.assert_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before))  # functional: inputs untouched


def test_latent_cache_op_equals_transformers_deepseek_v3():
    """HF DeepseekV3: RMSNorm(kv_nope), and apply_rotary_pos_emb_interleave on k_rot with
    the first halves of its duplicated cos/sin, written de-interleaved."""
    kv, gamma, cos, sin, index, k_cache, ckv_cache = _latent_inputs()
    nope, rot = kv[..., :DV], kv[..., DV:]
    hf_norm = gamma * (nope * torch.rsqrt(nope.pow(2).mean(-1, keepdim=True) + 1e-6))
    c, s = cos[..., : DK // 2], sin[..., : DK // 2]
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    hf_rope = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    k_embed, y, new_k, new_ckv = npu.npu_kv_rmsnorm_rope_cache_v2_functional(
        kv, gamma, cos, sin, index, k_cache, ckv_cache, epsilon=1e-6)
    torch.testing.assert_close(y, hf_norm)
    torch.testing.assert_close(k_embed, hf_rope)
    for b in range(2):
        want_k = k_cache[b:b + 1].index_copy(2, index[b], hf_rope[b:b + 1])
        want_ckv = ckv_cache[b:b + 1].index_copy(2, index[b], hf_norm[b:b + 1])
        torch.testing.assert_close(new_k[b:b + 1], want_k)
        torch.testing.assert_close(new_ckv[b:b + 1], want_ckv)
    # mix-ups: rotating the rope part by halves without de-interleaving, or swapping the caches
    halves = torch.cat((rot[..., :DK // 2], rot[..., DK // 2:]), -1) * cos \
        + torch.cat((-rot[..., DK // 2:], rot[..., :DK // 2]), -1) * sin
    assert not torch.allclose(halves, k_embed)
    with pytest.raises(RuntimeError, match="k_cache must be"):
        npu.npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, ckv_cache, k_cache)


def test_latent_cache_op_skips_index_minus_one_and_refuses_out_of_range():
    kv, gamma, cos, sin, index, k_cache, ckv_cache = _latent_inputs()
    index[0, 1] = -1
    _, _, new_k, new_ckv = npu.npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache,
                                                                       ckv_cache)
    assert torch.equal(new_k[0, 0, 2], k_cache[0, 0, 2]) and torch.equal(new_ckv[0, 0, 2], ckv_cache[0, 0, 2])
    assert not torch.equal(new_k[0, 0, 1], k_cache[0, 0, 1])
    index[1, 2] = LEN
    with pytest.raises(IndexError, match="outside"):
        npu.npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache, ckv_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_latent_cache_op_rounds_once(dtype):
    inputs = _latent_inputs(dtype=dtype)
    out = npu.npu_kv_rmsnorm_rope_cache_v2_functional(*inputs, epsilon=1e-6)
    want = reference_latent(*(t.float() if t.is_floating_point() else t for t in inputs), eps=1e-6)
    for got, ref in zip(out, want):
        assert got.dtype == dtype
        torch.testing.assert_close(got, ref.to(dtype), rtol=0, atol=0)


def test_latent_cache_v1_is_defined_but_not_computed():
    # its schema hides the in-place cache write: defined (torchair's converter module needs
    # it), never emitted, and it says what to use instead
    inputs = _latent_inputs()
    with pytest.raises(NotImplementedError, match="_v2_functional"):
        npu.npu_kv_rmsnorm_rope_cache(*inputs)
