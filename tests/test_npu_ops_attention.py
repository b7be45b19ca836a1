"""The DSA stand-ins compute what op_semantics.md sections 8 and 10 say, conventions first.

Every kernel is compared with a reference written here independently: per-batch Python
loops over query rows, heads and keys, in float64, on data built batch by batch and only
then packed into the op's layout (BSND with garbage in the padding rows, TND concatenated,
PA_BSND in shuffled cache blocks with garbage in the free slots), so a kernel that reads
the wrong rows, the wrong lengths or the padding disagrees. Each convention also gets a
"mix-up" test: the reference of the other convention (upper-left causal, per-batch instead
of cumulative lengths, token instead of block indices, no division by G, ...) differs from
the stand-in on the same input, so the comparisons would catch a swap.
"""
from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from npu_fx_fusion.npu_ops import _library, ensure_registered, spec_of
from npu_fx_fusion.npu_ops.attention import smla_kwargs, v4_attention_inputs

npu = torch.ops.npu
cann = torch.ops.cann_ops_transformer
ATTENTION_OPS = ["npu::npu_lightning_indexer", "npu::npu_sparse_flash_attention",
                 "npu::npu_lightning_indexer_grad", "npu::npu_sparse_flash_attention_grad",
                 "cann_ops_transformer::sparse_flash_mla_softmax_l1_norm_metadata",
                 "cann_ops_transformer::sparse_flash_mla_softmax_l1_norm"]
GARBAGE = 50.0  # padding rows and free cache slots: large, so reading them changes results
SOFTMAX_MIN = -2e38


@pytest.fixture(scope="module", autouse=True)
def _ops():
    registered = ensure_registered()
    assert all(op in registered for op in ATTENTION_OPS)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


# =====================================================================================
# Packing per-batch data into the layouts (independent of the kernels)
# =====================================================================================
def pack(parts, layout, *, rows=None, seed=0, block_size=4):
    """parts: per-batch (L_b, N, D) tensors. Returns (tensor, lengths tensor, block_table).

    BSND: (B, rows, N, D), garbage past L_b, per-batch lengths. TND: concatenated (plus one
    garbage row at the end), cumulative lengths. PA_BSND: shuffled blocks of block_size
    rows, garbage in free slots and spare blocks, per-batch lengths and the block table.
    """
    dtype, n, d = parts[0].dtype, parts[0].shape[1], parts[0].shape[2]
    lens = [p.shape[0] for p in parts]
    garbage = lambda *s: (_randn(*s, seed=seed + 999) * GARBAGE).to(dtype)  # noqa: E731
    if layout == "BSND":
        out = garbage(len(parts), rows, n, d)
        for b, p in enumerate(parts):
            out[b, :lens[b]] = p
        return out, torch.tensor(lens, dtype=torch.int32), None
    if layout == "TND":
        out = torch.cat(parts + [garbage(1, n, d)])
        return out, torch.tensor(lens, dtype=torch.int32).cumsum(0).int(), None
    per_batch = [-(-n_b // block_size) for n_b in lens]
    total = sum(per_batch) + 2  # two spare blocks
    order = torch.randperm(total, generator=_gen(seed + 7))
    cache = garbage(total, block_size, n, d)
    width = max(per_batch) + 1
    table = torch.full((len(parts), width), total - 1, dtype=torch.int32)  # unused entries: a spare block
    used = 0
    for b, p in enumerate(parts):
        for blk in range(per_batch[b]):
            phys = int(order[used])
            used += 1
            table[b, blk] = phys
            chunk = p[blk * block_size:(blk + 1) * block_size]
            cache[phys, :chunk.shape[0]] = chunk
    return cache, torch.tensor(lens, dtype=torch.int32), table


def unpack(t, layout, lens):
    """Per-batch row blocks of a BSND / TND output."""
    if layout == "BSND":
        return [t[b, :n] for b, n in enumerate(lens)]
    starts = [sum(lens[:b]) for b in range(len(lens))]
    return [t[s:s + n] for s, n in zip(starts, lens)]


def padding_rows(t, layout, lens):
    if layout == "BSND":
        return [t[b, n:] for b, n in enumerate(lens)]
    return [t[sum(lens):]]


# =====================================================================================
# npu_lightning_indexer
# =====================================================================================
def indexer_loop_ref(q, k, w, sparse_count, sparse_mode, *, causal="right-down", relu_inside=True):
    """One batch: q (Lq, N1, D), k (Lk, N2, D), w (Lq, N1) -> indices, values (Lq, N2, K) in float64.

    score[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j]) over the heads of the key head; the
    top sparse_count visible keys, descending, ties to the lower key; -1 / -inf padding.
    """
    lq, n1, _ = q.shape
    lk, n2, _ = k.shape
    g = n1 // n2
    idx = torch.full((lq, n2, sparse_count), -1, dtype=torch.long)
    val = torch.full((lq, n2, sparse_count), float("-inf"), dtype=torch.float64)
    for i in range(lq):
        for n in range(n2):
            scored = []
            for j in range(lk):
                visible = j <= (lk - lq) + i if causal == "right-down" else j <= i
                if sparse_mode == 3 and not visible:
                    continue
                dots = [float(q[i, h].double() @ k[j, n].double()) for h in range(n * g, (n + 1) * g)]
                ws = [float(w[i, h]) for h in range(n * g, (n + 1) * g)]
                s = sum(wh * max(dh, 0.0) for wh, dh in zip(ws, dots)) if relu_inside else \
                    max(sum(wh * dh for wh, dh in zip(ws, dots)), 0.0)
                scored.append((s, j))
            scored.sort(key=lambda p: (-p[0], p[1]))
            for slot, (s, j) in enumerate(scored[:sparse_count]):
                idx[i, n, slot], val[i, n, slot] = j, s
    return idx, val


def _indexer_batches(lq, lk, n1=4, n2=1, d=8, seed=0, dtype=torch.float32):
    qs = [_randn(n, n1, d, seed=seed + b, dtype=dtype) for b, n in enumerate(lq)]
    ks = [_randn(n, n2, d, seed=seed + 10 + b, dtype=dtype) for b, n in enumerate(lk)]
    ws = [_randn(n, n1, seed=seed + 20 + b, dtype=dtype) for b, n in enumerate(lq)]
    return qs, ks, ws


def run_indexer(qs, ks, ws, layout_query, layout_key, *, sparse_count, sparse_mode, return_value=True,
                s1=6, s2=9):
    q, q_len, _ = pack(qs, layout_query, rows=s1, seed=1)
    w, _, _ = pack([x.unsqueeze(-1) for x in ws], layout_query, rows=s1, seed=2)
    k, k_len, table = pack(ks, layout_key, rows=s2, seed=3)
    idx, val = npu.npu_lightning_indexer(
        q, k, w.squeeze(-1), actual_seq_lengths_query=q_len, actual_seq_lengths_key=k_len, block_table=table,
        layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode,
        return_value=return_value)
    return idx, val


LAYOUT_PAIRS = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND"), ("TND", "PA_BSND")]
LQ, LK = [3, 6], [7, 4]  # batch 1 has more queries than keys: its first causal rows see nothing


@pytest.mark.parametrize("sparse_count", [3, 9])  # fewer than the keys, more (-1 padding)
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("layout_query, layout_key", LAYOUT_PAIRS)
def test_indexer_equals_the_loop_reference(layout_query, layout_key, sparse_mode, sparse_count):
    qs, ks, ws = _indexer_batches(LQ, LK, n1=4, n2=1, seed=0)
    idx, val = run_indexer(qs, ks, ws, layout_query, layout_key, sparse_count=sparse_count,
                           sparse_mode=sparse_mode)
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    expected_shape = (2, 6, 1, sparse_count) if layout_query == "BSND" else (10, 1, sparse_count)
    assert idx.shape == val.shape == expected_shape
    for b, (i_b, v_b) in enumerate(zip(unpack(idx, layout_query, LQ), unpack(val, layout_query, LQ))):
        ref_i, ref_v = indexer_loop_ref(qs[b], ks[b], ws[b], sparse_count, sparse_mode)
        assert torch.equal(i_b.long(), ref_i), (b, i_b, ref_i)
        torch.testing.assert_close(v_b.double(), ref_v, rtol=1e-5, atol=1e-5)
    for pad in padding_rows(idx, layout_query, LQ):  # rows past a batch's queries
        assert (pad == -1).all()


def test_indexer_pads_with_minus_one_and_minus_inf():
    qs, ks, ws = _indexer_batches([4], [5], seed=3)
    idx, val = run_indexer(qs, ks, ws, "BSND", "BSND", sparse_count=7, sparse_mode=3, s1=4, s2=5)
    visible = torch.tensor([2, 3, 4, 5])  # row i sees keys 0 .. (5 - 4) + i
    for i in range(4):
        n = int(visible[i])
        assert (idx[0, i, 0, :n] >= 0).all() and (idx[0, i, 0, n:] == -1).all()
        assert torch.isfinite(val[0, i, 0, :n]).all() and torch.isneginf(val[0, i, 0, n:]).all()
        assert sorted(idx[0, i, 0, :n].tolist()) == list(range(n))  # every visible key, once
        assert (val[0, i, 0, :n].diff() <= 0).all()  # descending


def test_indexer_gqa_and_bf16():
    # two key heads (groups of two query heads), bf16 inputs: the reference reads the same
    # bf16 values in float64; values come back rounded once to bf16
    qs, ks, ws = _indexer_batches([3, 5], [6, 5], n1=4, n2=2, seed=4, dtype=torch.bfloat16)
    idx, val = run_indexer(qs, ks, ws, "TND", "TND", sparse_count=4, sparse_mode=3)
    assert idx.shape == (9, 2, 4) and val.dtype == torch.bfloat16  # 8 rows + a garbage row
    for b, (i_b, v_b) in enumerate(zip(unpack(idx, "TND", [3, 5]), unpack(val, "TND", [3, 5]))):
        ref_i, ref_v = indexer_loop_ref(qs[b], ks[b], ws[b], 4, 3)
        assert torch.equal(i_b.long(), ref_i)
        assert torch.equal(v_b, ref_v.to(torch.bfloat16))


def test_indexer_without_return_value_and_without_lengths():
    qs, ks, ws = _indexer_batches([5, 5], [8, 8], seed=5)
    q, k, w = torch.stack(qs), torch.stack(ks), torch.stack(ws)
    idx, val = npu.npu_lightning_indexer(q, k, w, sparse_count=4, sparse_mode=0)
    assert val.shape == (0,) and val.dtype == q.dtype  # Meta: an empty tensor without return_value
    for b in range(2):
        assert torch.equal(idx[b].long(), indexer_loop_ref(qs[b], ks[b], ws[b], 4, 0)[0])


def test_indexer_mixups_would_be_caught():
    qs, ks, ws = _indexer_batches([3, 4], [8, 6], seed=6)
    idx, _ = run_indexer(qs, ks, ws, "TND", "TND", sparse_count=8, sparse_mode=3)
    got = unpack(idx.long(), "TND", [3, 4])
    right_down = [indexer_loop_ref(qs[b], ks[b], ws[b], 8, 3)[0] for b in range(2)]
    upper_left = [indexer_loop_ref(qs[b], ks[b], ws[b], 8, 3, causal="upper-left")[0] for b in range(2)]
    relu_outside = [indexer_loop_ref(qs[b], ks[b], ws[b], 8, 3, relu_inside=False)[0] for b in range(2)]
    assert all(torch.equal(g, r) for g, r in zip(got, right_down))
    assert not all(torch.equal(g, r) for g, r in zip(got, upper_left))  # mode 3 is not j <= i
    assert not all(torch.equal(g, r) for g, r in zip(got, relu_outside))  # relu per head, then weights
    # indices are batch-local: batch 1's keys are 0..5, not offset by batch 0's 8 keys
    assert got[1].max() < 6 and got[1].max() >= 0
    # TND lengths are cumulative: the per-batch query lengths [3, 4] read as prefix sums make
    # batch 1 a single row, and its other rows padding
    q, w, k = torch.cat(qs), torch.cat(ws), torch.cat(ks)
    per_batch, _ = npu.npu_lightning_indexer(
        q, k, w, actual_seq_lengths_query=torch.tensor([3, 4], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([8, 14], dtype=torch.int32), layout_query="TND", layout_key="TND",
        sparse_count=8, sparse_mode=3)
    assert not torch.equal(per_batch[:7].long(), idx[:7].long()) and (per_batch[4:7] == -1).all()


def test_indexer_refuses_what_the_op_rejects():
    q, k, w = _randn(1, 2, 4, 8), _randn(1, 3, 1, 8), _randn(1, 2, 4)
    with pytest.raises(RuntimeError, match="must be 4-D"):
        npu.npu_lightning_indexer(q[0], k, w)
    with pytest.raises(RuntimeError, match="one dtype"):
        npu.npu_lightning_indexer(q, k.half(), w)
    with pytest.raises(RuntimeError, match="head dims differ"):
        npu.npu_lightning_indexer(q, _randn(1, 3, 1, 4), w)
    with pytest.raises(RuntimeError, match="weights must be"):
        npu.npu_lightning_indexer(q, k, w[..., :2])
    with pytest.raises(RuntimeError, match="cumulative lengths"):
        npu.npu_lightning_indexer(q[0], k[0], w[0], layout_query="TND", layout_key="TND")
    with pytest.raises(RuntimeError, match="must equal the query layout"):
        npu.npu_lightning_indexer(q, k[0], w, layout_key="TND")
    with pytest.raises(RuntimeError, match="sparse_mode must be 0"):
        npu.npu_lightning_indexer(q, k, w, sparse_mode=1)
    with pytest.raises(NotImplementedError, match="pre_tokens"):
        npu.npu_lightning_indexer(q, k, w, next_tokens=0)
    with pytest.raises(RuntimeError, match="need block_table"):
        npu.npu_lightning_indexer(q, k, w, layout_key="PA_BSND", actual_seq_lengths_key=torch.tensor([3]))


def test_indexer_backward_needs_return_value():
    # torch_npu differentiates through sparse_values only ([false, true]): without
    # return_value there is nothing to differentiate
    q = _randn(1, 3, 4, 8).requires_grad_()
    _, val = npu.npu_lightning_indexer(q, _randn(1, 5, 1, 8), _randn(1, 3, 4), sparse_count=2)
    with pytest.raises(RuntimeError, match="only through sparse_values, which it returns only with return_value=True"):
        val.float().sum().backward()
    # paged keys: the grad op takes one layout for query and key
    paged, table = _randn(2, 4, 1, 8), torch.tensor([[1, 0]], dtype=torch.int32)
    _, val = npu.npu_lightning_indexer(q, paged, _randn(1, 3, 4), actual_seq_lengths_key=torch.tensor([6]),
                                       block_table=table, layout_key="PA_BSND", sparse_count=2, return_value=True)
    with pytest.raises(RuntimeError, match="paged keys"):
        val.sum().backward()


def indexer_values_ref(q, k, w, idx, sparse_mode):
    """One batch, differentiable, float64: values[i, n, s] = sum_h w relu(q_h . k[idx]) over
    the G heads of key head n, for the slots naming a visible key (0 elsewhere)."""
    lq, n1, _ = q.shape
    lk, n2, _ = k.shape
    g = n1 // n2
    rows = []
    for i in range(lq):
        per_head = []
        for n in range(n2):
            slots = []
            for j in idx[i, n].tolist():
                visible = 0 <= j < lk and (sparse_mode == 0 or j <= (lk - lq) + i)
                if not visible:
                    slots.append(q.new_zeros(()))
                    continue
                heads = range(n * g, (n + 1) * g)
                slots.append(sum(w[i, h] * torch.relu(q[i, h] @ k[j, n]) for h in heads))
            per_head.append(torch.stack(slots))
        rows.append(torch.stack(per_head))
    return torch.stack(rows)


def _leaf(t):
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("sparse_count", [3, 9])
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("n2", [1, 2])
def test_indexer_gradients_equal_autograd_of_the_float64_reference(layout, sparse_mode, sparse_count, n2):
    qs, ks, ws = _indexer_batches(LQ, LK, n1=4, n2=n2, seed=30)
    q, q_len, _ = pack(qs, layout, rows=6, seed=1)
    w, _, _ = pack([x.unsqueeze(-1) for x in ws], layout, rows=6, seed=2)
    k, k_len, _ = pack(ks, layout, rows=9, seed=3)
    q, k, w = _leaf(q), _leaf(k), _leaf(w.squeeze(-1))
    idx, val = npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=q_len, actual_seq_lengths_key=k_len,
                                         layout_query=layout, layout_key=layout, sparse_count=sparse_count,
                                         sparse_mode=sparse_mode, return_value=True)
    dy = _randn(*val.shape, seed=31)
    got = torch.autograd.grad(val, (q, k, w), dy.masked_fill(idx < 0, 0))  # -1 slots: value -inf, no grad
    for b in range(2):
        parts = [_leaf(t.double()) for t in (qs[b], ks[b], ws[b])]
        ref_val = indexer_values_ref(*parts, unpack(idx, layout, LQ)[b], sparse_mode)
        ref = torch.autograd.grad(ref_val, parts, unpack(dy, layout, LQ)[b].double(), allow_unused=True)
        for name, g, r, lens in (("query", got[0], ref[0], LQ), ("key", got[1], ref[1], LK),
                                 ("weights", got[2], ref[2], LQ)):
            torch.testing.assert_close(unpack(g, layout, lens)[b].double(), r, rtol=1e-5, atol=1e-5, msg=name)
    # padding rows and keys past the lengths get no gradient
    for g, lens in ((got[0], LQ), (got[1], LK), (got[2], LQ)):
        assert all((pad == 0).all() for pad in padding_rows(g, layout, lens))


def test_indexer_grad_mixups_would_be_caught():
    qs, ks, ws = _indexer_batches([4], [7], seed=32)
    q, k, w = (_leaf(torch.stack(t)) for t in (qs, ks, ws))
    idx, val = npu.npu_lightning_indexer(q, k, w, sparse_count=5, sparse_mode=3, return_value=True)
    dy = _randn(*val.shape, seed=33).masked_fill(idx < 0, 0)
    got = torch.autograd.grad(val, (q, k, w), dy)
    parts = [_leaf(t.double()) for t in (qs[0], ks[0], ws[0])]

    def ref_grads(values):
        return torch.autograd.grad(values, parts, dy[0].double(), allow_unused=True)

    right = ref_grads(indexer_values_ref(*parts, idx[0], 3))
    assert all(torch.allclose(g[0].double(), r, atol=1e-5) for g, r in zip(got, right))
    # the relu outside the head sum (one relu of the weighted sum) is another gradient
    qq, kk, ww = parts
    outside = torch.stack([torch.stack([torch.stack([torch.relu(sum(ww[i, h] * (qq[i, h] @ kk[j, 0]) for h in range(4)))
                                                     if j >= 0 else qq.new_zeros(()) for j in idx[0][i, 0].tolist()])])
                           for i in range(4)])
    wrong = ref_grads(outside)
    assert not torch.allclose(got[0][0].double(), wrong[0], atol=1e-3)
    # a grad kernel reading the slots as batch-global rows of a TND key (batch 1 offset by
    # batch 0's keys) differs: the stand-in's indices are batch-local
    qs2, ks2, ws2 = _indexer_batches([3, 3], [5, 5], seed=34)
    q2, k2, w2 = torch.cat(qs2), torch.cat(ks2), torch.cat(ws2)
    lens = dict(actual_seq_lengths_query=torch.tensor([3, 6], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([5, 10], dtype=torch.int32))
    idx2, val2 = npu.npu_lightning_indexer(q2, k2, w2, **lens, layout_query="TND", layout_key="TND", sparse_count=2,
                                           sparse_mode=0, return_value=True)
    dq, dk, _ = npu.npu_lightning_indexer_grad(q2, k2, torch.ones_like(val2), idx2, w2, *lens.values(), "TND", 0)
    shifted = idx2.clone()
    shifted[3:] += 5
    dq_global, dk_global, _ = npu.npu_lightning_indexer_grad(q2, k2, torch.ones_like(val2), shifted.clamp(max=4), w2,
                                                             *lens.values(), "TND", 0)
    assert not torch.allclose(dk, dk_global)


# =====================================================================================
# npu_sparse_flash_attention
# =====================================================================================
def sfa_loop_ref(q, qr, k, kr, v, idx, scale, block, sparse_mode, *, causal="right-down"):
    """One batch: q (Lq, N1, D), qr (Lq, N1, R) or None, k/v (Lk, N2, D), kr, idx (Lq, N2, K).

    Returns out (Lq, N1, D), softmax_max and softmax_sum (Lq, N2, G), float64.
    """
    lq, n1, d = q.shape
    lk, n2, _ = k.shape
    g = n1 // n2
    out = torch.zeros(lq, n1, d, dtype=torch.float64)
    smax = torch.full((lq, n2, g), SOFTMAX_MIN, dtype=torch.float64)
    ssum = torch.zeros(lq, n2, g, dtype=torch.float64)
    for i in range(lq):
        for h in range(n1):
            n = h // g
            pos = []
            for s in idx[i, n].tolist():
                if s < 0:
                    break
                pos += list(range(s * block, min(s * block + block, lk)))
            if sparse_mode == 3:
                limit = (lk - lq) + i if causal == "right-down" else i
                pos = [p for p in pos if p <= limit]
            if not pos:
                continue
            scores = []
            for p in pos:
                s = float(q[i, h].double() @ k[p, n].double())
                if qr is not None:
                    s += float(qr[i, h].double() @ kr[p, n].double())
                scores.append(s * scale)
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            total = sum(e)
            out[i, h] = sum(w * v[p, n].double() for w, p in zip(e, pos)) / total
            smax[i, n, h % g], ssum[i, n, h % g] = m, total
    return out, smax, ssum


def _sfa_batches(lq, lk, *, n1=4, n2=1, d=16, r=4, seed=0, dtype=torch.float32):
    q = [_randn(n, n1, d, seed=seed + b, dtype=dtype) for b, n in enumerate(lq)]
    qr = [_randn(n, n1, r, seed=seed + 10 + b, dtype=dtype) for b, n in enumerate(lq)]
    k = [_randn(n, n2, d, seed=seed + 20 + b, dtype=dtype) for b, n in enumerate(lk)]
    kr = [_randn(n, n2, r, seed=seed + 30 + b, dtype=dtype) for b, n in enumerate(lk)]
    v = [_randn(n, n2, d, seed=seed + 40 + b, dtype=dtype) for b, n in enumerate(lk)]
    return q, qr, k, kr, v


def _block_indices(lq, lk, n2, count, block, seed, pad=2):
    """Per batch (Lq, N2, count) int32: distinct block ids in shuffled order (some past the
    causal limit), the last `pad` slots -1."""
    out = []
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        blocks = -(-nk // block)
        rows = torch.full((nq, n2, count), -1, dtype=torch.int32)
        g = _gen(seed + b)
        for i in range(nq):
            for n in range(n2):
                perm = torch.randperm(blocks, generator=g)[:count - pad]
                rows[i, n, :perm.numel()] = perm.int()
        out.append(rows)
    return out


def run_sfa(q, qr, k, kr, v, idx, layout_query, layout_kv, *, block=1, sparse_mode=3, scale=0.3,
            s1=6, s2=12, value_none=False, **kw):
    """Pack per-batch parts into the layouts and call the op (rope parts None: no rope)."""
    qt, q_len, _ = pack(q, layout_query, rows=s1, seed=1)
    it, _, _ = pack(idx, layout_query, rows=s1, seed=3)  # garbage ids in rows the op must skip
    kt, kv_len, table = pack(k, layout_kv, rows=s2, seed=4)
    vt, _, v_table = pack(v, layout_kv, rows=s2, seed=4)
    ropes = {}
    if qr is not None:
        krt, _, kr_table = pack(kr, layout_kv, rows=s2, seed=4)
        assert v_table is None or (torch.equal(v_table, table) and torch.equal(kr_table, table))
        ropes = dict(query_rope=pack(qr, layout_query, rows=s1, seed=2)[0], key_rope=krt)
    return npu.npu_sparse_flash_attention(
        qt, kt, None if value_none else vt, it.int(), scale, block_table=table, actual_seq_lengths_query=q_len,
        actual_seq_lengths_kv=kv_len, sparse_block_size=block, layout_query=layout_query, layout_kv=layout_kv,
        sparse_mode=sparse_mode, **ropes, **kw)


def _lse_rows(t, layout_query, lq):
    """softmax_max/sum back to per-batch (Lq, N2, G): BSND (B, N2, S1, G), TND (N2, T1, G)."""
    if layout_query == "BSND":
        return unpack(t.transpose(1, 2), "BSND", lq)
    return unpack(t.transpose(0, 1), "TND", lq)


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("layout_query, layout_kv", LAYOUT_PAIRS)
def test_sfa_equals_the_loop_reference(layout_query, layout_kv, sparse_mode, block):
    lq, lk = [3, 5], [10, 7]  # 10 keys: blocks of 4 end in a tail of 2
    q, qr, k, kr, v = _sfa_batches(lq, lk, seed=10)
    idx = _block_indices(lq, lk, 1, 4, block, seed=11, pad=1)
    lse = layout_kv != "PA_BSND"
    out, smax, ssum = run_sfa(q, qr, k, kr, v, idx, layout_query, layout_kv, block=block, sparse_mode=sparse_mode,
                              return_softmax_lse=lse, attention_mode=2)
    assert out.shape == ((2, 6, 4, 16) if layout_query == "BSND" else (9, 4, 16)) and out.dtype == torch.float32
    got_out = unpack(out, layout_query, lq)
    if lse:
        assert smax.shape == ((2, 1, 6, 4) if layout_query == "BSND" else (1, 9, 4)) and smax.dtype == torch.float32
        got_max, got_sum = _lse_rows(smax, layout_query, lq), _lse_rows(ssum, layout_query, lq)
    else:
        assert smax.shape == ssum.shape == (0,)
    for b in range(2):
        ref_out, ref_max, ref_sum = sfa_loop_ref(q[b], qr[b], k[b], kr[b], v[b], idx[b], 0.3, block, sparse_mode)
        torch.testing.assert_close(got_out[b].double(), ref_out, rtol=1e-5, atol=1e-5)
        if lse:
            torch.testing.assert_close(got_max[b].double(), ref_max, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_sum[b].double(), ref_sum, rtol=1e-5, atol=1e-5)
    for pad in padding_rows(out, layout_query, lq):
        assert (pad == 0).all()


def test_sfa_minus_one_ends_the_list_and_padded_slots_contribute_nothing():
    q, qr, k, kr, v = _sfa_batches([2], [8], seed=12)
    idx = torch.tensor([[[5, 1, -1, -1]], [[2, 6, 0, -1]]], dtype=torch.int32)
    after_minus_one = idx.clone()
    after_minus_one[0, 0, 3] = 7  # a "valid" id after the first -1: ignored
    short = idx[:, :, :3].contiguous()  # the same lists without the padding slot
    outs = [run_sfa(q, qr, k, kr, v, [t], "TND", "TND", sparse_mode=0)[0] for t in (idx, after_minus_one, short)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # row 0 attends to keys 5 and 1 only: the same as the dense softmax over those two keys
    ref, _, _ = sfa_loop_ref(q[0], qr[0], k[0], kr[0], v[0], idx, 0.3, 1, 0)
    torch.testing.assert_close(outs[0][:2].double(), ref, rtol=1e-5, atol=1e-5)


def test_sfa_block_ids_select_blocks_of_keys_cut_at_the_length():
    q, qr, k, kr, v = _sfa_batches([1], [10], n1=2, seed=13)
    idx = torch.tensor([[[2, 0, -1]]], dtype=torch.int32)  # blocks of 4: keys 8, 9 (tail) and 0..3
    out, smax, ssum = run_sfa(q, qr, k, kr, v, [idx], "TND", "TND", block=4, sparse_mode=0, return_softmax_lse=True)
    tokens = torch.tensor([[[8, 9, 0, 1, 2, 3, -1]]], dtype=torch.int32)  # the same keys, token-wise
    out_tok, _, _ = run_sfa(q, qr, k, kr, v, [tokens], "TND", "TND", block=1, sparse_mode=0)
    torch.testing.assert_close(out, out_tok, rtol=1e-6, atol=1e-6)
    # mix-up: reading the ids as token positions (keys 2 and 0) is another result
    as_tokens, _, _ = run_sfa(q, qr, k, kr, v, [idx], "TND", "TND", block=1, sparse_mode=0)
    assert not torch.allclose(out, as_tokens, atol=1e-3)


def test_sfa_causal_mode_3_is_right_down_not_upper_left():
    q, qr, k, kr, v = _sfa_batches([3], [8], seed=14)
    idx = [torch.arange(8, dtype=torch.int32).flip(0).expand(3, 1, 8).contiguous()]  # every key
    out, _, _ = run_sfa(q, qr, k, kr, v, idx, "TND", "TND", sparse_mode=3)
    right_down, _, _ = sfa_loop_ref(q[0], qr[0], k[0], kr[0], v[0], idx[0], 0.3, 1, 3)
    upper_left, _, _ = sfa_loop_ref(q[0], qr[0], k[0], kr[0], v[0], idx[0], 0.3, 1, 3, causal="upper-left")
    torch.testing.assert_close(out[:3].double(), right_down, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:3].double(), upper_left, atol=1e-3)
    # the last query sees every key: mode 3 and mode 0 agree on it, not on the first
    out0, _, _ = run_sfa(q, qr, k, kr, v, idx, "TND", "TND", sparse_mode=0)
    torch.testing.assert_close(out[2], out0[2], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out[0], out0[0], atol=1e-3)


def test_sfa_rows_with_no_key_are_zero_with_default_lse():
    q, qr, k, kr, v = _sfa_batches([4], [3], seed=15)  # more queries than keys
    idx = [torch.tensor([0, 1, 2, -1], dtype=torch.int32).expand(4, 1, 4).contiguous()]
    out, smax, ssum = run_sfa(q, qr, k, kr, v, idx, "BSND", "BSND", sparse_mode=3, s1=4, s2=3,
                              return_softmax_lse=True)
    # right-down: row i sees keys <= i - 1, so row 0 sees none
    assert (out[0, 0] == 0).all() and (smax[0, :, 0] == SOFTMAX_MIN).all() and (ssum[0, :, 0] == 0).all()
    assert (out[0, 1] != 0).any() and (ssum[0, :, 1] > 0).all()


def test_sfa_value_none_uses_key_and_lse_is_max_plus_log_sum():
    q, qr, k, kr, _ = _sfa_batches([3], [6], seed=16)
    idx = _block_indices([3], [6], 1, 5, 1, seed=17, pad=1)
    with_v = run_sfa(q, qr, k, kr, k, idx, "TND", "TND", return_softmax_lse=True)
    without = run_sfa(q, qr, k, kr, k, idx, "TND", "TND", return_softmax_lse=True, value_none=True)
    assert all(torch.equal(a, b) for a, b in zip(with_v, without))
    # lse = max + log(sum) is the log of the softmax denominator over the selected keys
    _, smax, ssum = with_v
    qq = torch.cat([q[0], qr[0]], -1).double()
    kk = torch.cat([k[0], kr[0]], -1).double()[:, 0]
    for i in range(3):
        sel = [s for s in idx[0][i, 0].tolist() if s >= 0 and s <= 3 + i]
        logits = qq[i] @ kk[sel].T * 0.3  # (N1, n)
        torch.testing.assert_close((smax[0, i] + ssum[0, i].log()).double(), logits.logsumexp(-1), rtol=1e-5,
                                   atol=1e-5)


def test_sfa_bf16_is_rounded_once_and_gqa():
    q, qr, k, kr, v = _sfa_batches([3, 2], [6, 5], n1=4, n2=2, seed=18, dtype=torch.bfloat16)
    idx = _block_indices([3, 2], [6, 5], 2, 4, 1, seed=19, pad=1)
    out, _, _ = run_sfa(q, qr, k, kr, v, idx, "TND", "TND", sparse_mode=3)
    assert out.dtype == torch.bfloat16
    for b, got in enumerate(unpack(out, "TND", [3, 2])):
        ref, _, _ = sfa_loop_ref(q[b], qr[b], k[b], kr[b], v[b], idx[b], 0.3, 1, 3)
        # one rounding of an fp32 result: within half a bf16 ulp (+ fp32 noise)
        assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5).all()


def test_sfa_refuses_what_the_op_rejects():
    q, k, idx = _randn(1, 2, 4, 16), _randn(1, 5, 1, 16), torch.zeros(1, 2, 1, 3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sparse_indices must be int32"):
        npu.npu_sparse_flash_attention(q, k, k, idx.long(), 1.0)
    with pytest.raises(RuntimeError, match=r"sparse_indices must be \(B, S1, N2, K\)"):
        npu.npu_sparse_flash_attention(q, k, k, idx[:, :1], 1.0)
    with pytest.raises(RuntimeError, match="query_rope and key_rope go together"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, query_rope=_randn(1, 2, 4, 4))
    with pytest.raises(RuntimeError, match="value must have key's shape"):
        npu.npu_sparse_flash_attention(q, k, k[:, :3], idx, 1.0)
    with pytest.raises(RuntimeError, match="multiple of the 3 key heads"):
        npu.npu_sparse_flash_attention(q, _randn(1, 5, 3, 16), None, torch.zeros(1, 2, 3, 3, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="not supported with paged keys"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, layout_kv="PA_BSND", block_table=torch.zeros(1, 2).int(),
                                       actual_seq_lengths_kv=torch.tensor([3]), return_softmax_lse=True)
    with pytest.raises(NotImplementedError, match="sinks"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, sinks=torch.zeros(4))
    with pytest.raises(RuntimeError, match="attention_mode must be 0 or 2"):
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, attention_mode=1)


def test_sfa_backward_needs_return_softmax_lse():
    # torch_npu's backward reads softmax_max / softmax_sum: without return_softmax_lse the
    # forward returns none, and differentiating it fails, saying so
    q, k = _randn(1, 2, 4, 16).requires_grad_(), _randn(1, 5, 1, 16)
    idx = torch.zeros(1, 2, 1, 3, dtype=torch.int32)
    out, _, _ = npu.npu_sparse_flash_attention(q, k, k, idx, 1.0)
    with pytest.raises(RuntimeError, match="needs softmax_max and softmax_sum, which the forward returns only with "
                                           "return_softmax_lse=True"):
        out.sum().backward()
    # query_rope is keyword-only but differentiable in torch_npu: autograd tracks it
    qr = _randn(1, 2, 4, 4).requires_grad_()
    out, smax, _ = npu.npu_sparse_flash_attention(q.detach(), k, k, idx, 1.0, query_rope=qr, key_rope=_randn(1, 5, 1, 4),
                                                  return_softmax_lse=True)
    assert out.requires_grad and not smax.requires_grad  # softmax_max / _sum: no gradient
    (grad,) = torch.autograd.grad(out.sum(), qr)
    assert grad.shape == qr.shape
    with torch.no_grad():  # inference is fine
        npu.npu_sparse_flash_attention(q, k, k, idx, 1.0)


def sfa_dense_ref(q, qr, k, kr, v, idx, scale, block, sparse_mode, *, causal="right-down", minus_one="ends"):
    """One batch, differentiable, float64: sfa_loop_ref written with tensor ops.

    minus_one="skips": the mix-up of reading -1 as a skipped slot instead of the list's end.
    """
    lq, n1, _ = q.shape
    lk, n2, _ = k.shape
    g = n1 // n2
    rows = []
    for i in range(lq):
        heads = []
        for h in range(n1):
            n = h // g
            pos = []
            for s in idx[i, n].tolist():
                if s < 0:
                    if minus_one == "ends":
                        break
                    continue
                pos += list(range(s * block, min(s * block + block, lk)))
            if sparse_mode == 3:
                limit = (lk - lq) + i if causal == "right-down" else i
                pos = [p for p in pos if p <= limit]
            if not pos:
                heads.append(q.new_zeros(q.shape[-1]))
                continue
            pos = torch.tensor(pos)
            scores = k[pos, n] @ q[i, h]
            if qr is not None:
                scores = scores + kr[pos, n] @ qr[i, h]
            heads.append(torch.softmax(scores * scale, -1) @ v[pos, n])
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def _sfa_grads(layout, *, rope=True, block=1, sparse_mode=3, value_none=False, lq=(3, 5), lk=(10, 7), seed=40,
               idx=None, n1=4, n2=1):
    """The stand-in's gradients (packed) and the per-batch inputs, indices and output gradient."""
    lq, lk = list(lq), list(lk)
    q, qr, k, kr, v = _sfa_batches(lq, lk, n1=n1, n2=n2, seed=seed)
    if value_none:
        v = k
    idx = idx or _block_indices(lq, lk, n2, 4, block, seed=seed + 1, pad=1)
    qt, q_len, _ = pack(q, layout, rows=6, seed=1)
    it, _, _ = pack(idx, layout, rows=6, seed=3)
    kt, kv_len, _ = pack(k, layout, rows=12, seed=4)
    vt, _, _ = pack(v, layout, rows=12, seed=5)
    leaves = {"query": _leaf(qt), "key": _leaf(kt)}
    if not value_none:
        leaves["value"] = _leaf(vt)
    kwargs = {}
    if rope:
        leaves["query_rope"] = _leaf(pack(qr, layout, rows=6, seed=2)[0])
        leaves["key_rope"] = _leaf(pack(kr, layout, rows=12, seed=6)[0])
        kwargs = dict(query_rope=leaves["query_rope"], key_rope=leaves["key_rope"])
    out, _, _ = npu.npu_sparse_flash_attention(
        leaves["query"], leaves["key"], leaves.get("value"), it.int(), 0.3, actual_seq_lengths_query=q_len,
        actual_seq_lengths_kv=kv_len, sparse_block_size=block, layout_query=layout, layout_kv=layout,
        sparse_mode=sparse_mode, return_softmax_lse=True, **kwargs)
    d_out = _randn(*out.shape, seed=seed + 2)
    grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), d_out)))
    return grads, (q, qr, k, kr, v), idx, d_out, (lq, lk)


def _sfa_reference_grads(parts, idx, d_out, b, layout, lq, *, rope, block, sparse_mode, value_none, **mixup):
    q, qr, k, kr, v = (_leaf(t[b].double()) for t in parts)
    if value_none:
        v = k
    inputs = {"query": q, "key": k}
    if not value_none:
        inputs["value"] = v
    if rope:
        inputs.update(query_rope=qr, key_rope=kr)
    out = sfa_dense_ref(q, qr if rope else None, k, kr if rope else None, v, idx[b], 0.3, block, sparse_mode, **mixup)
    grads = torch.autograd.grad(out, list(inputs.values()), unpack(d_out, layout, lq)[b].double())
    return dict(zip(inputs, grads))


@pytest.mark.parametrize("rope", [True, False], ids=["mla_rope", "no_rope"])
@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("sparse_mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_sfa_gradients_equal_autograd_of_the_float64_reference(layout, sparse_mode, block, rope):
    grads, parts, idx, d_out, (lq, lk) = _sfa_grads(layout, rope=rope, block=block, sparse_mode=sparse_mode)
    lens = {"query": lq, "query_rope": lq, "key": lk, "value": lk, "key_rope": lk}
    for b in range(2):
        ref = _sfa_reference_grads(parts, idx, d_out, b, layout, lq, rope=rope, block=block, sparse_mode=sparse_mode,
                                   value_none=False)
        assert ref.keys() == grads.keys()
        for name in ref:
            torch.testing.assert_close(unpack(grads[name], layout, lens[name])[b].double(), ref[name], rtol=1e-5,
                                       atol=1e-5, msg=name)
    for name, g in grads.items():  # padding rows and keys past the lengths: no gradient
        assert all((pad == 0).all() for pad in padding_rows(g, layout, lens[name])), name


def test_sfa_gradients_with_gqa_value_none_and_rows_without_keys():
    # two key heads; value None (key is the value: its gradient takes both parts); batch 1
    # has more queries than keys, so its first causal rows select nothing (zero gradient)
    grads, parts, idx, d_out, (lq, lk) = _sfa_grads("TND", value_none=True, lq=(3, 5), lk=(6, 3), n1=4, n2=2, seed=50)
    assert "value" not in grads
    for b in range(2):
        ref = _sfa_reference_grads(parts, idx, d_out, b, "TND", lq, rope=True, block=1, sparse_mode=3,
                                   value_none=True)
        for name in ref:
            lens = lq if name.startswith("query") else lk
            torch.testing.assert_close(unpack(grads[name], "TND", lens)[b].double(), ref[name], rtol=1e-5, atol=1e-5,
                                       msg=name)
    assert (unpack(grads["query"], "TND", lq)[1][:2] == 0).all()  # rows 0, 1 of batch 1 see no key


def test_sfa_grad_mixups_would_be_caught():
    # a valid block id after a -1: the list ends at the -1 (not skipped over)
    idx = [torch.tensor([[[3, -1, 1, 0]], [[2, 5, -1, 4]], [[0, -1, 2, -1]]], dtype=torch.int32)]
    grads, parts, idx, d_out, (lq, lk) = _sfa_grads("TND", lq=(3,), lk=(6,), idx=idx, sparse_mode=0, seed=60)
    common = dict(rope=True, block=1, sparse_mode=0, value_none=False)
    right = _sfa_reference_grads(parts, idx, d_out, 0, "TND", lq, **common)
    skips = _sfa_reference_grads(parts, idx, d_out, 0, "TND", lq, **common, minus_one="skips")
    got = grads["query"][:3].double()
    torch.testing.assert_close(got, right["query"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, skips["query"], atol=1e-3)
    # upper-left instead of right-down causal (fewer queries than keys)
    grads, parts, idx, d_out, (lq, lk) = _sfa_grads("BSND", lq=(3, 5), lk=(10, 7), sparse_mode=3, seed=61)
    common = dict(rope=True, block=1, sparse_mode=3, value_none=False)
    right = _sfa_reference_grads(parts, idx, d_out, 0, "BSND", lq, **common)
    upper_left = _sfa_reference_grads(parts, idx, d_out, 0, "BSND", lq, **common, causal="upper-left")
    got = grads["key"][0, :10].double()
    torch.testing.assert_close(got, right["key"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, upper_left["key"], atol=1e-3)
    # the grad op recomputes P from softmax_max / softmax_sum: a wrong lse gives another gradient
    q, k, idx = _randn(1, 3, 2, 8), _randn(1, 6, 1, 8), torch.tensor([0, 2, 4], dtype=torch.int32).expand(1, 3, 1, 3)
    idx = idx.contiguous()
    out, smax, ssum = npu.npu_sparse_flash_attention(q, k, k, idx, 0.5, sparse_mode=0, return_softmax_lse=True)
    d_out = _randn(*out.shape, seed=62)
    args = (q, k, k, idx, d_out, out)
    good = npu.npu_sparse_flash_attention_grad(*args, smax, ssum, 0.5, 1, sparse_mode=0)
    bad = npu.npu_sparse_flash_attention_grad(*args, smax, ssum * 2, 0.5, 1, sparse_mode=0)
    assert not torch.allclose(good[0], bad[0], atol=1e-3)


def test_grad_ops_refuse_what_they_cannot_compute():
    q, k, idx = _randn(1, 2, 4, 16), _randn(1, 5, 1, 16), torch.zeros(1, 2, 1, 3, dtype=torch.int32)
    out, smax, ssum = npu.npu_sparse_flash_attention(q, k, k, idx, 1.0, return_softmax_lse=True)
    with pytest.raises(RuntimeError, match="softmax_max must be the forward's fp32"):
        npu.npu_sparse_flash_attention_grad(q, k, k, idx, out, out, torch.zeros(0), ssum, 1.0, 1)
    with pytest.raises(RuntimeError, match="layout must be one of"):
        npu.npu_sparse_flash_attention_grad(q, k, k, idx, out, out, smax, ssum, 1.0, 1, layout="PA_BSND")
    with pytest.raises(RuntimeError, match="d_out must be"):
        npu.npu_sparse_flash_attention_grad(q, k, k, idx, out[:, :1], out, smax, ssum, 1.0, 1)
    iq, ik, iw = _randn(1, 3, 4, 8), _randn(1, 5, 1, 8), _randn(1, 3, 4)
    iidx, ival = npu.npu_lightning_indexer(iq, ik, iw, sparse_count=2, return_value=True)
    with pytest.raises(RuntimeError, match="sparse_indices must be int32"):
        npu.npu_lightning_indexer_grad(iq, ik, ival, iidx.long(), iw)
    with pytest.raises(RuntimeError, match="dy"):
        npu.npu_lightning_indexer_grad(iq, ik, ival[..., :1], iidx, iw)


# =====================================================================================
# cann_ops_transformer.sparse_flash_mla_softmax_l1_norm (+ _metadata)
# =====================================================================================
def l1_norm_row_ref(q_row, k_b, lse_row, scale, g, width, *, sel=None, topk_len=None, mask_mode=0,
                    cmp_ratio=1, residual=0, sq=None, sk=None, s1=None, divide=True, causal="right-down"):
    """op_semantics 10 for one query row and key head: q_row (G, D), k_b (Sk, D), lse_row (G,)."""
    if mask_mode == 3:
        ori = sk * cmp_ratio + (residual if cmp_ratio > 1 else 0)
        visible = max((ori - sq + s1 + 1) // cmp_ratio, 0) if causal == "right-down" else s1 + 1
    if sel is None:
        keys = list(range(sk if mask_mode == 0 else visible))
    else:
        klen = len(sel) if topk_len is None else min(len(sel), topk_len)
        n = min(klen, sk) if mask_mode == 0 else min(klen, visible)
        keys = []
        for s in sel[:n]:
            if s < 0:
                break
            keys.append(s)
    out = torch.zeros(width, dtype=torch.float64)
    for slot, j in enumerate(keys):
        p = [math.exp(float(q_row[h].double() @ k_b[j].double()) * scale - float(lse_row[h])) for h in range(g)]
        out[slot if sel is not None else j] = sum(p) / (g if divide else 1)
    return out


def _metadata(layout, **kw):
    return cann.sparse_flash_mla_softmax_l1_norm_metadata(4, 1, 16, layout_q=layout, layout_k=layout, **kw)


def _lse_from_sfa(q_parts, k_parts, idx_parts, layout, scale, sparse_mode, s1):
    """softmax_lse of the matching attention forward ((B, N2, S1, G) / (N2, T1, G))."""
    _, smax, ssum = run_sfa(q_parts, None, k_parts, None, k_parts, idx_parts, layout, layout,
                            sparse_mode=sparse_mode, scale=scale, s1=s1, s2=max(p.shape[0] for p in k_parts),
                            return_softmax_lse=True)
    return smax + ssum.log()


def _l1_check(out, layout, q, k, lse_rows, scale, sq, sk, *, sel=None, **kw):
    """Compare every valid row with the loop reference; the padding rows are 0."""
    width = out.shape[-1]
    per_batch = list(out) if layout == "BSND" else unpack(out, layout, [p.shape[0] for p in q])
    for b, rows in enumerate(per_batch):
        for i in range(sq[b]):
            ref = l1_norm_row_ref(q[b][i], k[b][:, 0], lse_rows[b][i, 0], scale, 4, width,
                                  sel=None if sel is None else sel[b][i, 0].tolist(), sq=sq[b], sk=sk[b], s1=i, **kw)
            torch.testing.assert_close(rows[i, 0].double(), ref, rtol=1e-5, atol=1e-6)
        assert (rows[sq[b]:] == 0).all()


@pytest.mark.parametrize("mask_mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_l1_norm_dense_is_the_head_mean_of_the_attention_probabilities(layout, mask_mode):
    lq, lk = [3, 5], [6, 7]
    q, _, k, _, _ = _sfa_batches(lq, lk, seed=20)
    every_key = [torch.arange(n, dtype=torch.int32).expand(m, 1, n).contiguous() for m, n in zip(lq, lk)]
    every_key = [torch.cat([t, torch.full((t.shape[0], 1, 7 - t.shape[-1]), -1, dtype=torch.int32)], -1)
                 for t in every_key]
    lse = _lse_from_sfa(q, k, every_key, layout, 0.25, mask_mode, s1=5)
    if layout == "BSND":  # BSND needs equal lengths: the full S1 = 5, S2 = 7 of the packing
        lq_full, lk_full = [5, 5], [7, 7]
        qt, _, _ = pack(q, "BSND", rows=5, seed=1)
        kt, _, _ = pack(k, "BSND", rows=7, seed=4)
        kw = dict(seqused_q=torch.tensor(lq, dtype=torch.int32), seqused_k=torch.tensor(lk, dtype=torch.int32))
        meta = _metadata(layout, batch_size=2, max_seqlen_q=5, max_seqlen_k=7, seqused_q=kw["seqused_q"])
    else:
        lq_full, lk_full = lq, lk
        qt, kt = torch.cat(q), torch.cat(k)
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32) for x in (lq, lk))
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_k=9)  # wider than any batch
        meta = _metadata(layout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        lse = lse[:, :8]
    out = cann.sparse_flash_mla_softmax_l1_norm(qt, kt, lse, metadata=meta, softmax_scale=0.25, mask_mode=mask_mode,
                                                layout_q=layout, layout_k=layout, **kw)
    assert out.dtype == torch.float32
    assert out.shape == ((2, 5, 1, 7) if layout == "BSND" else (8, 1, 9))
    lse_rows = _lse_rows(lse, layout, lq_full if layout == "BSND" else lq)
    _l1_check(out, layout, q, k, lse_rows, 0.25, lq, lk, mask_mode=mask_mode)
    # with the lse of the matching forward each row is a distribution over the visible keys
    for b, rows in enumerate(unpack(out, layout, lq_full)):
        torch.testing.assert_close(rows[:lq[b], 0].sum(-1), torch.ones(lq[b]), rtol=1e-5, atol=1e-5)
        assert (rows[:, 0, lk[b]:] == 0).all()  # batch-local key positions, nothing past the batch


@pytest.mark.parametrize("mask_mode", [0, 3])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_l1_norm_sparse_follows_the_slots_and_stops_at_minus_one(layout, mask_mode):
    lq, lk = [4, 3], [8, 8]
    q, _, k, _, _ = _sfa_batches(lq, lk, seed=21)
    idx = _block_indices(lq, lk, 1, 6, 1, seed=22, pad=2)
    if mask_mode == 3:  # the indexer's causal output: only visible keys, -1 after them
        idx = [npu.npu_lightning_indexer(qb[:, :, :8].unsqueeze(0), kb[:, :, :8].unsqueeze(0),
                                         torch.ones(1, qb.shape[0], 4), sparse_count=6, sparse_mode=3)[0][0]
               for qb, kb in zip(q, k)]
    lse = _lse_from_sfa(q, k, idx, layout, 0.25, mask_mode, s1=4)
    if layout == "BSND":
        qt, _, _ = pack(q, "BSND", rows=4, seed=1)
        kt = torch.stack(k)
        it = torch.full((2, 4, 1, 6), -1, dtype=torch.int32)
        for b, t in enumerate(idx):
            it[b, :t.shape[0]] = t
        sq = torch.tensor(lq, dtype=torch.int32)
        kw = dict(seqused_q=sq)
        meta = _metadata(layout, batch_size=2, max_seqlen_q=4, max_seqlen_k=8, seqused_q=sq)
        lse_rows = _lse_rows(lse, layout, [4, 4])
    else:
        qt, kt, it = torch.cat(q), torch.cat(k), torch.cat(idx)
        cu_q, cu_k = torch.tensor([0, 4, 7], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        meta = _metadata(layout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        lse = lse[:, :7]
        lse_rows = _lse_rows(lse, layout, lq)
    out = cann.sparse_flash_mla_softmax_l1_norm(qt, kt, lse, sparse_indices=it, metadata=meta, softmax_scale=0.25,
                                                mask_mode=mask_mode, layout_q=layout, layout_k=layout, **kw)
    assert out.shape == ((2, 4, 1, 6) if layout == "BSND" else (7, 1, 6))
    _l1_check(out, layout, q, k, lse_rows, 0.25, lq, lk, sel=idx, mask_mode=mask_mode)
    for b, rows in enumerate(unpack(out, layout, lq)):
        valid = idx[b][:, 0] >= 0
        assert (rows[:, 0][~valid] == 0).all()  # -1 slots get nothing
        torch.testing.assert_close(rows[:, 0].sum(-1), torch.ones(lq[b]), rtol=1e-5, atol=1e-5)


def test_l1_norm_topk_length_and_the_mode_3_count_cut():
    q, _, k, _, _ = _sfa_batches([2], [6], seed=23)
    idx = torch.tensor([[[5, 4, 0, 1, -1]], [[3, 2, 1, 0, 5]]], dtype=torch.int32)  # row 0 lists keys past causal
    lse = torch.zeros(1, 1, 2, 4)
    meta = _metadata("BSND", batch_size=1, max_seqlen_q=2, max_seqlen_k=6)
    common = dict(sparse_indices=idx.unsqueeze(0), metadata=meta, softmax_scale=0.25)
    # mode 3: row 0 sees 5 keys, row 1 six: the first 5 / 5 slots count, whatever their index
    out3 = cann.sparse_flash_mla_softmax_l1_norm(q[0].unsqueeze(0), k[0].unsqueeze(0), lse, mask_mode=3, **common)
    assert (out3[0, 0, 0, :4] > 0).all() and out3[0, 0, 0, 4] == 0  # key 5 > 4 still counted; -1 ends
    assert (out3[0, 1, 0, :5] > 0).all()
    # topk_length cuts the slots per row
    cut = cann.sparse_flash_mla_softmax_l1_norm(q[0].unsqueeze(0), k[0].unsqueeze(0), lse,
                                                topk_length=torch.tensor([[[2], [3]]], dtype=torch.int32), **common)
    assert (cut[0, 0, 0, 2:] == 0).all() and (cut[0, 1, 0, 3:] == 0).all()
    torch.testing.assert_close(cut[0, 0, 0, :2], out3[0, 0, 0, :2])


def test_l1_norm_compressed_keys_with_cmp_ratio_and_residual():
    # 3 compressed keys of ratio 4 with residual 2: 14 original keys; 4 queries. Row i sees
    # (14 - 4 + i + 1) // 4 compressed keys: 2, 3, 3, 3
    q, _, k, _, _ = _sfa_batches([4], [3], seed=24)
    lse = _randn(1, 1, 4, 4, seed=25).abs()
    meta = _metadata("BSND", batch_size=1, max_seqlen_q=4, max_seqlen_k=3, cmp_ratio=4, mask_mode=3)
    out = cann.sparse_flash_mla_softmax_l1_norm(q[0].unsqueeze(0), k[0].unsqueeze(0), lse, metadata=meta,
                                                cmp_residual_k=torch.tensor([2], dtype=torch.int32), softmax_scale=0.5,
                                                cmp_ratio=4, mask_mode=3)
    assert [(out[0, i, 0] != 0).sum().item() for i in range(4)] == [2, 3, 3, 3]
    for i in range(4):
        ref = l1_norm_row_ref(q[0][i], k[0][:, 0], lse[0, 0, i], 0.5, 4, 3, mask_mode=3, cmp_ratio=4, residual=2,
                              sq=4, sk=3, s1=i)
        torch.testing.assert_close(out[0, i, 0].double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="needs cmp_residual_k"):
        cann.sparse_flash_mla_softmax_l1_norm(q[0].unsqueeze(0), k[0].unsqueeze(0), lse, metadata=meta, cmp_ratio=4,
                                              mask_mode=3)


def test_l1_norm_mixups_would_be_caught():
    q, _, k, _, _ = _sfa_batches([3], [7], seed=26)
    every = [torch.arange(7, dtype=torch.int32).expand(3, 1, 7).contiguous()]
    lse = _lse_from_sfa(q, k, every, "BSND", 0.25, 3, s1=3)
    meta = _metadata("BSND", batch_size=1, max_seqlen_q=3, max_seqlen_k=7)
    out = cann.sparse_flash_mla_softmax_l1_norm(q[0].unsqueeze(0), k[0].unsqueeze(0), lse, metadata=meta,
                                                softmax_scale=0.25, mask_mode=3)
    lse_row = lse[0, 0]
    for i in range(3):
        kw = dict(mask_mode=3, sq=3, sk=7, s1=i)
        right = l1_norm_row_ref(q[0][i], k[0][:, 0], lse_row[i], 0.25, 4, 7, **kw)
        torch.testing.assert_close(out[0, i, 0].double(), right, rtol=1e-5, atol=1e-6)
        not_divided = l1_norm_row_ref(q[0][i], k[0][:, 0], lse_row[i], 0.25, 4, 7, divide=False, **kw)
        upper_left = l1_norm_row_ref(q[0][i], k[0][:, 0], lse_row[i], 0.25, 4, 7, causal="upper-left", **kw)
        assert not torch.allclose(out[0, i, 0].double(), not_divided, atol=1e-3)  # the mean over G, not the sum
        assert not torch.allclose(out[0, i, 0].double(), upper_left, atol=1e-3)
    torch.testing.assert_close(out.sum(-1), torch.ones(1, 3, 1))  # sum over G / G: a distribution


def test_l1_norm_metadata_layout():
    # BSND: batch_size * max_seqlen_q rows; TND: cu_seqlens_q[B]; seqused_q: their sum
    m = _metadata("BSND", batch_size=3, max_seqlen_q=30, max_seqlen_k=8)
    assert m.dtype == torch.int32 and m.shape == (64,) and (m[5:] == 0).all()
    assert m[:5].tolist() == [90, 3, 2, 0 + 36 - 90 % 36, 36]  # 90 rows on 36 cores: 18 take 3, 18 take 2
    m = _metadata("TND", cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 5, 9], dtype=torch.int32))
    assert m[:5].tolist() == [7, 1, 1, 0, 7]
    m = _metadata("BSND", batch_size=2, max_seqlen_q=9, max_seqlen_k=8, seqused_q=torch.tensor([4, 0]).int())
    assert m[:5].tolist() == [4, 1, 1, 0, 4]
    with pytest.raises(RuntimeError, match="needs positive batch_size and max_seqlen_q"):
        _metadata("BSND")
    # the main op computes the rows its metadata counts: a mismatch is refused here
    q, k = _randn(1, 2, 4, 16), _randn(1, 3, 1, 16)
    with pytest.raises(RuntimeError, match="metadata was not made for this call"):
        cann.sparse_flash_mla_softmax_l1_norm(q, k, torch.zeros(1, 1, 2, 4), metadata=m)
    with pytest.raises(RuntimeError, match="metadata is required"):
        cann.sparse_flash_mla_softmax_l1_norm(q, k, torch.zeros(1, 1, 2, 4))


def test_l1_norm_refuses_what_the_op_rejects():
    q, k = _randn(1, 2, 4, 16), _randn(1, 3, 1, 16)
    meta = _metadata("BSND", batch_size=1, max_seqlen_q=2, max_seqlen_k=3)
    with pytest.raises(RuntimeError, match="softmax_lse must be"):
        cann.sparse_flash_mla_softmax_l1_norm(q, k, torch.zeros(1, 2, 1, 4), metadata=meta)
    with pytest.raises(RuntimeError, match="layout_k must be one of"):
        cann.sparse_flash_mla_softmax_l1_norm(q, k, torch.zeros(1, 1, 2, 4), metadata=meta, layout_k="PA_BSND")
    with pytest.raises(RuntimeError, match="dense TND needs max_seqlen_k"):
        cann.sparse_flash_mla_softmax_l1_norm(q[0], k[0], torch.zeros(1, 2, 4), metadata=meta, layout_q="TND",
                                              layout_k="TND", cu_seqlens_q=torch.tensor([0, 2]).int(),
                                              cu_seqlens_k=torch.tensor([0, 3]).int())
    with pytest.raises(RuntimeError, match="select keys past"):
        cann.sparse_flash_mla_softmax_l1_norm(q, k, torch.zeros(1, 1, 2, 4), metadata=meta,
                                              sparse_indices=torch.full((1, 2, 1, 2), 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="no backward in cann_ops_transformer"):
        cann.sparse_flash_mla_softmax_l1_norm(q.requires_grad_(), k, torch.zeros(1, 1, 2, 4),
                                              metadata=meta).sum().backward()


# =====================================================================================
# Registration, fake kernels, the wheel's Meta functions, opcheck
# =====================================================================================
def test_cann_namespace_is_registered_only_without_the_real_package(monkeypatch):
    assert importlib.util.find_spec("cann_ops_transformer") is None  # this venv: stand-ins registered
    assert not _library._real_package_installed("cann_ops_transformer")
    assert not _library._real_package_installed("npu")  # torch_npu is handled by real_torch_npu_available
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "cann_ops_transformer" else real_find_spec(name, *a))
    assert _library._real_package_installed("cann_ops_transformer")


def test_l1_norm_shapes_follow_the_kernel_not_the_extensions_meta():
    # the extension's Meta says (B, S1, S2) / (T1, T2) whatever sparse_indices is; the kernel
    # writes (B, S1, N2, K or S2) / (T1, N2, K or max_seqlen_k) (op_semantics 10, 11.9)
    samples = spec_of("cann_ops_transformer::sparse_flash_mla_softmax_l1_norm").samples(torch.bfloat16)
    shapes = [cann.sparse_flash_mla_softmax_l1_norm(*sample.args, **sample.kwargs).shape for sample in samples]
    assert shapes == [(2, 3, 1, 5), (2, 3, 1, 4), (6, 1, 6), (6, 1, 3)]


# =====================================================================================
# DeepSeek-V4: cann_ops_transformer.sparse_flash_mla (+ grad) and lightning_indexer, against
# transformers' eager_attention_forward with sinks and its sliding / CSA / HCA masks
# =====================================================================================
def v4_masks(seq, window, compressed, ratio, indices=None):
    """transformers' additive masks, as bools (True = visible) over [S window keys, T compressed]:
    the sliding window (q - window < j <= q), then HCA's `w < (t + 1) // ratio` or, with the
    indexer's indices (-1 = none), CSA's scatter of the listed blocks."""
    i = torch.arange(seq).unsqueeze(1)
    j = torch.arange(seq).unsqueeze(0)
    sliding = (j > i - window) & (j <= i)
    if compressed == 0:
        return sliding
    if indices is None:
        block = torch.arange(compressed).unsqueeze(0) < (i + 1) // ratio
        return torch.cat([sliding, block], -1)
    b = indices.shape[0]
    block = torch.zeros(b, seq, compressed + 1, dtype=torch.bool)
    block.scatter_(-1, torch.where(indices >= 0, indices, compressed), True)
    return torch.cat([sliding.expand(b, -1, -1), block[..., :compressed]], -1)


def v4_eager_attention(q, kv, sinks, visible, scale):
    """eager_attention_forward (transformers deepseek_v4) in float64: q (B, H, S, D), kv (B, 1, L, D)
    shared key and value, visible (.., S, L); returns (B, S, H, D)."""
    logits = q.double() @ kv.double().transpose(-1, -2) * scale
    logits = logits.masked_fill(~visible.view(visible.shape[0] if visible.dim() == 3 else 1, 1, *visible.shape[-2:]),
                                float("-inf"))
    b, h, s, _ = q.shape
    sink = sinks.double().reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    combined = torch.cat([logits, sink], -1)
    combined = combined - combined.max(-1, keepdim=True).values
    probs = torch.softmax(combined, -1)[..., :-1]
    return (probs @ kv.double()).transpose(1, 2)


def _v4_reference(x, **leaves):
    q, ori, cmp, sinks = (leaves.get(n, getattr(x, n)) for n in ("q", "ori", "cmp", "sinks"))
    visible = v4_masks(x.s, x.window, x.t, x.ratio, x.indices)
    kv = torch.cat([ori, cmp], 2) if x.t else ori
    return v4_eager_attention(q, kv, sinks, visible, x.scale)


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_sparse_flash_mla_is_v4s_eager_attention_with_sinks(kind):
    x = v4_attention_inputs(kind)
    out, lse = cann.sparse_flash_mla(x.q.transpose(1, 2), **smla_kwargs(x), return_softmax_lse=True)
    torch.testing.assert_close(out, _v4_reference(x))
    # lse includes the sink: logsumexp over the visible logits and the sink
    visible = v4_masks(x.s, x.window, x.t, x.ratio, x.indices)
    kv = torch.cat([x.ori, x.cmp], 2) if x.t else x.ori
    logits = (x.q @ kv.transpose(-1, -2) * x.scale).masked_fill(~visible.view(-1, 1, *visible.shape[-2:]),
                                                                float("-inf"))
    expected = torch.cat([logits, x.sinks.view(1, -1, 1, 1).expand(2, -1, x.s, -1)], -1).logsumexp(-1)
    torch.testing.assert_close(lse.squeeze(1), expected.transpose(1, 2))  # (B, N2=1, S, G=H)
    assert lse.shape == (2, 1, x.s, 4)


def test_sparse_flash_mla_mix_ups():
    x = v4_attention_inputs("csa")
    expected = _v4_reference(x)
    q = x.q.transpose(1, 2)
    # ori_win_left is the window minus one (the query itself is in the window)
    assert not torch.allclose(cann.sparse_flash_mla(q, **smla_kwargs(x, ori_win_left=x.window))[0], expected)
    # the compressed keys' visibility counts the residual: S = T * ratio + residual
    assert not torch.allclose(cann.sparse_flash_mla(
        q, **smla_kwargs(x, cmp_residual_kv=torch.zeros(2, dtype=torch.int32), cmp_sparse_indices=None))[0],
        cann.sparse_flash_mla(q, **smla_kwargs(x, cmp_sparse_indices=None))[0])
    # the sinks are per query head, in the softmax's denominator only
    assert not torch.allclose(cann.sparse_flash_mla(q, **smla_kwargs(x, sinks=None))[0], expected)
    # the indices choose compressed keys (CSA); without them every visible block counts (HCA)
    assert not torch.allclose(cann.sparse_flash_mla(q, **smla_kwargs(x, cmp_sparse_indices=None))[0], expected)


def test_sparse_flash_mla_reads_indices_up_to_the_first_minus_one():
    # the late queries see every block: list [0, -1, 2] and [0, -1, -1] alike (the kernel stops at
    # the first -1), unlike [0, 2, -1]
    x = v4_attention_inputs("csa")
    q = x.q.transpose(1, 2)

    def attend(row):
        indices = torch.tensor(row, dtype=torch.int32).expand(2, x.s, 1, 3).contiguous()
        return cann.sparse_flash_mla(q, **smla_kwargs(x, cmp_sparse_indices=indices))[0][:, -4:]

    torch.testing.assert_close(attend([0, -1, 2]), attend([0, -1, -1]))
    assert not torch.allclose(attend([0, 2, -1]), attend([0, -1, -1]))


def test_sparse_flash_mla_bf16_and_metadata():
    x = v4_attention_inputs("hca", dtype=torch.bfloat16)
    metadata = cann.sparse_flash_mla_metadata(4, 1, 16, batch_size=2, max_seqlen_q=x.s, cmp_ratio=8,
                                              ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=x.window - 1,
                                              ori_win_right=0, layout_q="BSND", layout_kv="BSND")
    assert metadata.shape == (1024,) and metadata.dtype == torch.int32
    out, lse = cann.sparse_flash_mla(x.q.transpose(1, 2), **smla_kwargs(x), metadata=metadata)
    assert out.dtype == torch.bfloat16 and lse.shape == ()
    torch.testing.assert_close(out.double(), _v4_reference(x), atol=2e-2, rtol=2e-2)  # bf16 P before P @ V
    wrong = cann.sparse_flash_mla_metadata(4, 1, 16, batch_size=2, max_seqlen_q=x.s, cmp_ratio=4, ori_mask_mode=4,
                                           cmp_mask_mode=3, ori_win_left=x.window - 1, ori_win_right=0)
    with pytest.raises(RuntimeError, match="metadata was made for another call"):
        cann.sparse_flash_mla(x.q.transpose(1, 2), **smla_kwargs(x), metadata=wrong)


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_sparse_flash_mla_grad_against_autograd(kind):
    x = v4_attention_inputs(kind, s=10, window=4)
    leaves = {n: getattr(x, n).clone().requires_grad_() for n in ("q", "ori", "cmp", "sinks")}
    ref = _v4_reference(x, **leaves)
    dout = torch.randn_like(ref)
    names = ["q", "ori", "sinks"] + (["cmp"] if x.t else [])
    expected = dict(zip(names, torch.autograd.grad(ref, [leaves[n] for n in names], dout)))
    q = x.q.transpose(1, 2)
    out, lse = cann.sparse_flash_mla(q, **smla_kwargs(x), return_softmax_lse=True)
    kw = smla_kwargs(x)
    dq, dori, dcmp, dsinks, _, l1 = cann.sparse_flash_mla_grad(
        q, dout, out, lse, kw.pop("ori_kv"), kw.pop("cmp_kv", None), None, kw.pop("cmp_sparse_indices", None),
        cmp_residual_kv=kw.pop("cmp_residual_kv", None), sinks=kw.pop("sinks"), **kw)
    torch.testing.assert_close(dq.transpose(1, 2), expected["q"])
    torch.testing.assert_close(dori.transpose(1, 2), expected["ori"])
    torch.testing.assert_close(dsinks, expected["sinks"])
    if x.t:
        torch.testing.assert_close(dcmp.transpose(1, 2), expected["cmp"])
    if kind == "csa":  # the head-mean probability at each listed block, 0 at the -1 slots
        assert l1.shape == x.indices.unsqueeze(2).shape and l1.dtype == torch.float64
        assert not l1[x.indices.unsqueeze(2) < 0].any() and (l1[x.indices.unsqueeze(2) >= 0] > 0).all()
    else:
        assert l1.numel() == 0


def v4_indexer(q, k, weights, ratio, topk):
    """DeepseekV4Indexer's scoring and selection after its projections, in float64: q (B, S, H, D)
    rotated, k (B, T, D) compressed, weights (B, S, H) already scaled; returns (B, S, k) ids, -1
    past the causally visible blocks."""
    scores = torch.relu(q.double() @ k.double().transpose(-1, -2).unsqueeze(1))  # (B, S, H, T)
    index_scores = (scores * weights.double().unsqueeze(-1)).sum(2)
    threshold = (torch.arange(q.shape[1]) + 1) // ratio
    future = torch.arange(k.shape[1]).view(1, 1, -1) >= threshold.view(1, -1, 1)
    top = index_scores.masked_fill(future, float("-inf")).topk(min(topk, k.shape[1]), -1).indices
    return torch.where(top >= threshold.view(1, -1, 1), -1, top)


def test_cann_lightning_indexer_is_v4s_indexer():
    g = torch.Generator().manual_seed(7)
    b, s, h, d, ratio = 2, 18, 4, 16, 4
    t = s // ratio
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    w = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    expected = v4_indexer(q, k, w, ratio, 3)
    indices, values = cann.lightning_indexer(q, k.unsqueeze(2), w, 3, mask_mode=3, cmp_ratio=ratio,
                                             cmp_residual_k=torch.full((b,), s % ratio, dtype=torch.int32),
                                             return_value=1)
    assert indices.shape == (b, s, 1, 3) and indices.dtype == torch.int32
    assert torch.equal(indices.squeeze(2).long().sort(-1).values, expected.sort(-1).values)
    # -1 (and -inf values) only past the visible blocks, which come first
    assert torch.equal(torch.isneginf(values.squeeze(2)), indices.squeeze(2) < 0)
    # mix-up: without the residual the pre-compression length is T * ratio, a shorter causal reach
    other, _ = cann.lightning_indexer(q, k.unsqueeze(2), w, 3, mask_mode=3, cmp_ratio=ratio,
                                      cmp_residual_k=torch.zeros(b, dtype=torch.int32))
    assert not torch.equal(other, indices)
    # cmp_ratio 1 is npu_lightning_indexer's right-down causal mask
    plain, _ = cann.lightning_indexer(q.float(), k.unsqueeze(2).float(), w.float(), 3, mask_mode=3)
    npu_plain, _ = npu.npu_lightning_indexer(q.float(), k.unsqueeze(2).float(), w.float(), sparse_count=3)
    assert torch.equal(plain, npu_plain)
