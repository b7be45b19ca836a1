"""The MoE stand-ins compute what op_semantics.md sections 5-7 say, index conventions first.

Every kernel is compared with a reference written here independently (loops over tokens
and experts, Megatron's and HF's own code, argsort-based constructions), in float64 where
values are compared. Each index convention (k-major vs token-major, inverse vs forward
permutation, cumsum vs counts) also gets a "mix-up" test: the other convention gives a
different result on the same non-trivial input, so the tests above would catch a swap.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import ulp
from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.moe import DEEPSEEK_SMALL, expert_ids
from npu_fx_fusion.npu_ops.spec import randn

npu = torch.ops.npu
FLOAT = [torch.float32, torch.bfloat16, torch.float16]
MOE_OPS = ["npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_moe_gating_top_k_backward",
           "npu_moe_init_routing_v2", "npu_moe_compute_expert_tokens", "npu_moe_token_permute",
           "npu_moe_token_permute_grad_v2", "npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2",
           "npu_moe_finalize_routing", "npu_grouped_matmul", "npu_moe_re_routing"]
U32 = 2.0 ** -24  # fp32 unit roundoff


@pytest.fixture(scope="module", autouse=True)
def _ops():
    registered = ensure_registered()
    assert all(f"npu::{op}" in registered for op in MOE_OPS)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _distinct_logits(rows, experts, dtype=torch.float32, seed=0):
    """Router logits whose values within a row are far apart (no ties after any rounding)."""
    g = _gen(seed)
    return torch.stack([torch.randperm(experts, generator=g).double() * 0.37 - 2
                        for _ in range(rows)]).to(dtype)


def assert_rounded_once(actual, exact, scale, fp32_ops):
    """`actual` is `exact` computed in fp32 (`fp32_ops` roundings of terms of size `scale`),
    then rounded once to actual's dtype."""
    assert actual.shape == exact.shape, (actual.shape, exact.shape)
    allowed = 0.5 * ulp(exact.to(actual.dtype)).double() + fp32_ops * U32 * scale.double()
    excess = (actual.double() - exact.double()).abs() - allowed
    assert excess.max().item() <= 0, f"max excess over one rounding: {excess.max().item():.3g}"


# =====================================================================================
# npu_moe_gating_top_k_softmax
# =====================================================================================
def gating_softmax_loop_ref(x, k):
    """(weights, expert ids, row ids) per op_semantics 5.1, by looping over rows, in float64."""
    rows = x.reshape(-1, x.shape[-1]).double()
    n = rows.shape[0]
    y, idx, row_idx = [], [], []
    for i in range(n):
        p = torch.softmax(rows[i], -1)
        order = sorted(range(rows.shape[1]), key=lambda e: -p[e].item())[:k]
        y.append([p[e].item() for e in order])
        idx.append(order)
        row_idx.append([j * n + i for j in range(k)])  # k-major: j*N + i
    shape = (*x.shape[:-1], k)
    return (torch.tensor(y, dtype=torch.float64).view(shape), torch.tensor(idx).view(shape),
            torch.tensor(row_idx).view(shape))


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
@pytest.mark.parametrize("shape, k", [((7, 6), 2), ((5, 16), 4), ((2, 3, 8), 3), ((4, 5), 5)], ids=str)
def test_gating_softmax_is_softmax_then_topk_with_k_major_row_idx(shape, k, dtype):
    x = _distinct_logits(math.prod(shape[:-1]), shape[-1], dtype).view(shape)
    y, idx, row_idx = npu.npu_moe_gating_top_k_softmax(x, None, k)
    ref_y, ref_idx, ref_row = gating_softmax_loop_ref(x, k)
    assert (y.dtype, idx.dtype, row_idx.dtype) == (dtype, torch.int32, torch.int32)
    assert torch.equal(idx.long(), ref_idx) and torch.equal(row_idx.long(), ref_row)
    # softmax in fp32: exp, E-term sum, divide; then one rounding
    assert_rounded_once(y, ref_y, ref_y.abs(), fp32_ops=shape[-1] + 6)
    # ... and it is exactly torch's unfused routing `softmax(float) -> topk` (Mixtral, Qwen2-MoE)
    p = torch.softmax(x.float(), dim=-1)
    w, i = torch.topk(p, k, dim=-1)
    assert torch.equal(idx.long(), i)
    torch.testing.assert_close(y, w.to(dtype), rtol=0, atol=0)


def test_gating_softmax_does_not_renormalise():
    x = _distinct_logits(4, 8)
    y, _, _ = npu.npu_moe_gating_top_k_softmax(x, None, 2)
    assert (y.sum(-1) < 0.999).all()  # the top-2 of a softmax over 8 experts
    y_all, _, _ = npu.npu_moe_gating_top_k_softmax(x, None, 8)
    torch.testing.assert_close(y_all.sum(-1), torch.ones(4))


def test_gating_softmax_row_idx_is_k_major_not_token_major():
    # mix-up: row_idx[t, j] = j*N + t. The v1 init_routing decodes it as x[row % N] (token t
    # for every j); the token-major decode (row // k) reads other tokens' rows.
    n, k = 5, 3
    x = _distinct_logits(n, 8)
    _, _, row_idx = npu.npu_moe_gating_top_k_softmax(x, None, k)
    token_major = torch.arange(n * k).view(n, k)
    assert not torch.equal(row_idx.long(), token_major)
    tokens = torch.arange(n).unsqueeze(1).expand(n, k)
    assert torch.equal(row_idx.long() % n, tokens)
    assert not torch.equal(row_idx.long() // k, tokens)
    assert torch.equal(row_idx.long(), torch.arange(n * k).view(k, n).t())


def test_gating_softmax_finished_rows_get_expert_id_e():
    x = _distinct_logits(4, 6)
    finished = torch.tensor([False, True, False, True])
    y, idx, row_idx = npu.npu_moe_gating_top_k_softmax(x, finished, 2)
    y0, idx0, row0 = npu.npu_moe_gating_top_k_softmax(x, None, 2)
    assert (idx[finished] == 6).all() and torch.equal(idx[~finished], idx0[~finished])
    assert torch.equal(y, y0) and torch.equal(row_idx, row0)  # y of finished rows: kept [inferred]


def test_gating_softmax_ties_go_to_the_lower_expert():
    y, idx, _ = npu.npu_moe_gating_top_k_softmax(torch.zeros(2, 6), None, 3)
    assert idx.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_gating_softmax_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match=r"k must be in \(0, 4\]"):
        npu.npu_moe_gating_top_k_softmax(torch.zeros(2, 4), None, 5)
    with pytest.raises(RuntimeError, match="finished must be a bool tensor of shape"):
        npu.npu_moe_gating_top_k_softmax(torch.zeros(2, 4), torch.zeros(2), 1)


# =====================================================================================
# npu_moe_gating_top_k (DeepSeek noaux_tc)
# =====================================================================================
def grouped_topk_loop_ref(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                          norm_type=0, routed_scaling_factor=1.0, eps=1e-20):
    """op_semantics 5.2 one token at a time, in float64 Python scalars."""
    n, e = x.shape
    size = e // group_count
    weights, ids = [], []
    for t in range(n):
        xt = [v.item() for v in x[t].double()]
        if norm_type == 1:
            s = [1 / (1 + math.exp(-v)) for v in xt]
        elif norm_type == 2:  # sqrt(softplus)
            s = [math.sqrt(math.log1p(math.exp(v))) for v in xt]
        else:
            m = max(xt)
            ex = [math.exp(v - m) for v in xt]
            s = [v / sum(ex) for v in ex]
        sel = [s[i] + (bias[i].item() if bias is not None else 0.0) for i in range(e)]
        group_scores = []
        for g in range(group_count):
            members = sorted(sel[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] if group_select_mode == 0 else members[0] + members[1])
        groups = sorted(range(group_count), key=lambda g: -group_scores[g])[:k_group]
        chosen = sorted((i for i in range(e) if i // size in groups), key=lambda i: -sel[i])[:k]
        w = [s[i] for i in chosen]  # from the UNBIASED scores
        if norm_type in (1, 2) or renorm == 1:
            total = sum(w) + eps
            w = [v / total for v in w]
        weights.append([v * routed_scaling_factor for v in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def hf_deepseek_v3_gate(logits, bias, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob=True):
    """HF modeling_deepseek.py MoEGate.forward, topk_method == "noaux_tc" (verbatim logic)."""
    scores = logits.sigmoid()
    scores_for_choice = scores + bias.unsqueeze(0)
    group_scores = scores_for_choice.view(logits.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(logits.shape[0], n_group, logits.shape[1] // n_group)
    tmp_scores = scores_for_choice.masked_fill(~score_mask.reshape(logits.shape[0], -1).bool(), 0.0)
    _, topk_idx = torch.topk(tmp_scores, k=top_k, dim=-1, sorted=False)
    topk_weight = scores.gather(1, topk_idx)
    if top_k > 1 and norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weight * routed_scaling_factor, topk_idx


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
def test_gating_top_k_noaux_tc_equals_the_loop_reference(dtype):
    x = randn(9, 16, dtype=dtype, seed=1)
    bias = (randn(16, seed=2) * 0.3).to(dtype)
    y, idx, norm_out = npu.npu_moe_gating_top_k(x, bias=bias, **DEEPSEEK_SMALL)
    ref_y, ref_idx = grouped_topk_loop_ref(x, bias=bias, **DEEPSEEK_SMALL)
    assert (y.dtype, idx.dtype, norm_out.dtype) == (dtype, torch.int32, torch.float32)
    assert torch.equal(idx.long(), ref_idx)  # descending by the biased score
    assert_rounded_once(y, ref_y, ref_y.abs(), fp32_ops=2 * DEEPSEEK_SMALL["k"] + 8)


def test_gating_top_k_equals_hf_deepseek_v3_gate():
    # HF masks unselected groups with 0.0, the NPU with -inf: equal when biased scores are
    # positive (sigmoid > 0, bias >= 0 here). HF's topk is unsorted: compare as sets.
    x, bias = randn(8, 16, seed=3), randn(16, seed=4).abs() * 0.2
    y, idx, _ = npu.npu_moe_gating_top_k(x, bias=bias, **DEEPSEEK_SMALL)
    hf_w, hf_idx = hf_deepseek_v3_gate(x.double(), bias.double(), 4, 4, 2, 2.5)
    order = hf_idx.argsort(-1)
    mine = idx.long().argsort(-1)
    assert torch.equal(idx.long().gather(1, mine), hf_idx.gather(1, order))
    torch.testing.assert_close(y.gather(1, mine).double(), hf_w.gather(1, order), rtol=1e-6, atol=1e-7)


def test_gating_top_k_bias_selects_but_does_not_weigh():
    # mix-up: weights taken from the biased scores (what was selected on) are different
    x, bias = randn(6, 16, seed=5), randn(16, seed=6) * 0.5
    y, idx, _ = npu.npu_moe_gating_top_k(x, bias=bias, **DEEPSEEK_SMALL)
    s = torch.sigmoid(x.double())
    unbiased = s.gather(1, idx.long())
    biased = (s + bias.double()).gather(1, idx.long())
    scale = 2.5
    torch.testing.assert_close(y.double(), unbiased / unbiased.sum(-1, keepdim=True) * scale,
                               rtol=1e-6, atol=0)
    assert not torch.allclose(y.double(), biased / biased.sum(-1, keepdim=True) * scale, rtol=1e-3)
    # and the bias does change which experts win
    _, idx_nobias, _ = npu.npu_moe_gating_top_k(x, **DEEPSEEK_SMALL)
    assert not torch.equal(idx, idx_nobias)


def test_gating_top_k_group_select_modes_differ():
    # group 0: one strong expert; group 1: two good ones. max picks group 0, top-2 sum group 1.
    x = torch.full((1, 16), -4.0)
    x[0, 0] = 4.0
    x[0, 4:6] = 2.0
    common = dict(k=2, k_group=1, group_count=4, norm_type=1)
    _, by_max, _ = npu.npu_moe_gating_top_k(x, group_select_mode=0, **common)
    _, by_top2, _ = npu.npu_moe_gating_top_k(x, group_select_mode=1, **common)
    assert set(by_max[0].tolist()) <= set(range(4)) and by_max[0, 0] == 0
    assert by_top2[0].tolist() == [4, 5]
    for mode, ids in ((0, by_max), (1, by_top2)):
        assert torch.equal(ids.long(), grouped_topk_loop_ref(x, group_select_mode=mode, **common)[1])


@pytest.mark.parametrize("renorm", [0, 1])
def test_gating_top_k_softmax_mode_renormalises_only_with_renorm_1(renorm):
    x = randn(5, 12, seed=7)
    kw = dict(k=3, k_group=2, group_count=3, group_select_mode=0, norm_type=0, renorm=renorm)
    y, idx, _ = npu.npu_moe_gating_top_k(x, **kw)
    ref_y, ref_idx = grouped_topk_loop_ref(x, **kw)
    assert torch.equal(idx.long(), ref_idx)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-6, atol=1e-8)
    sums = y.sum(-1)
    assert torch.allclose(sums, torch.ones(5)) == (renorm == 1)


def test_gating_top_k_scaling_and_norm_out():
    x = randn(4, 16, seed=8)
    y, _, norm_out = npu.npu_moe_gating_top_k(x, out_flag=True, **DEEPSEEK_SMALL)
    torch.testing.assert_close(y.sum(-1), torch.full((4,), 2.5))  # sigmoid renormalised, x 2.5
    torch.testing.assert_close(norm_out, torch.sigmoid(x.double()).float(), rtol=4 * U32, atol=0)
    _, _, not_written = npu.npu_moe_gating_top_k(x, **DEEPSEEK_SMALL)  # out_flag False
    assert not_written.shape == (4, 16) and not_written.dtype == torch.float32 and not not_written.any()


def test_gating_top_k_hash_mode_reads_tid2eid():
    x = randn(4, 16, seed=9)
    tid2eid = torch.tensor([[3, 7, 1, 0], [15, 14, 13, 12], [2, 4, 6, 8]], dtype=torch.int32)
    input_ids = torch.tensor([2, 0, 0, 1])
    y, idx, _ = npu.npu_moe_gating_top_k(x, 4, input_ids=input_ids, tid2eid=tid2eid, norm_type=1)
    assert torch.equal(idx, tid2eid[input_ids])
    s = torch.sigmoid(x.double()).gather(1, idx.long())
    torch.testing.assert_close(y.double(), s / s.sum(-1, keepdim=True), rtol=1e-6, atol=0)


# ---- backward -----------------------------------------------------------------------------
def test_gating_top_k_gradcheck_float64():
    x = randn(5, 16, dtype=torch.float64, seed=10).requires_grad_()
    bias = randn(16, dtype=torch.float64, seed=11) * 0.3
    fn = lambda t: npu.npu_moe_gating_top_k(t, bias=bias, out_flag=True, **DEEPSEEK_SMALL)[0]  # noqa: E731
    # norm_out (what the backward reads) is fp32 as on the NPU: fp32-accurate gradients
    assert torch.autograd.gradcheck(fn, (x,), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
def test_gating_top_k_grads_equal_autograd_of_the_unfused_reference(dtype):
    x = randn(6, 16, dtype=dtype, seed=12).requires_grad_()
    grad = randn(6, 4, dtype=dtype, seed=13)
    y, idx, _ = npu.npu_moe_gating_top_k(x, out_flag=True, **DEEPSEEK_SMALL)
    (dx,) = torch.autograd.grad(y, x, grad)
    x64 = x.detach().double().requires_grad_()
    s = torch.sigmoid(x64).gather(1, idx.long())
    ref = s / (s.sum(-1, keepdim=True) + 1e-20) * 2.5
    (exact,) = torch.autograd.grad(ref, x64, grad.double())
    assert dx.dtype == dtype and dx.shape == x.shape
    assert (dx[torch.ones_like(dx, dtype=torch.bool).scatter_(1, idx.long(), False)] == 0).all()
    assert_rounded_once(dx, exact, grad.double().abs().max().expand(exact.shape) * 2.5, fp32_ops=16)


def test_gating_top_k_backward_needs_out_flag_and_sigmoid():
    x = randn(3, 16, seed=14).requires_grad_()
    y, _, _ = npu.npu_moe_gating_top_k(x, **DEEPSEEK_SMALL)  # out_flag False
    with pytest.raises(RuntimeError, match="only computed with out_flag=True"):
        y.sum().backward()
    y, _, _ = npu.npu_moe_gating_top_k(x, 2, out_flag=True, norm_type=0)
    with pytest.raises(RuntimeError, match="supports norm_type=1"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="no gradient for its keyword-only argument bias"):
        npu.npu_moe_gating_top_k(x, bias=torch.zeros(16, requires_grad=True), **DEEPSEEK_SMALL)


def test_gating_top_k_refuses_what_it_cannot_compute():
    x = torch.zeros(2, 16)
    with pytest.raises(RuntimeError, match="must divide the 16 experts"):
        npu.npu_moe_gating_top_k(x, 2, group_count=3)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, k_group"):
        npu.npu_moe_gating_top_k(x, 5, k_group=1, group_count=4)
    with pytest.raises(RuntimeError, match="norm_type must be 0"):
        npu.npu_moe_gating_top_k(x, 2, norm_type=3)


# =====================================================================================
# npu_moe_init_routing_v2
# =====================================================================================
def init_routing_ref(x, expert_idx, start, end):
    """argsort(stable) construction, op_semantics 6.1; positions are token-major t*K + j."""
    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # dst -> src
    active = [f for f in order.tolist() if start <= flat[f] < end]
    expanded_x = torch.stack([x[f // k] for f in active]) if active else x.new_zeros(0, x.shape[1])
    gather_idx = torch.full((n * k,), -1)
    for dst, f in enumerate(active):
        gather_idx[f] = dst
    counts = torch.tensor([sum(1 for f in active if flat[f] == e) for e in range(start, end)])
    return expanded_x, gather_idx, torch.tensor(active, dtype=torch.long), counts


@pytest.mark.parametrize("dtype", FLOAT + [torch.int8], ids=str)
@pytest.mark.parametrize("row_idx_type", [0, 1])
def test_init_routing_v2_matches_the_argsort_reference(row_idx_type, dtype):
    n, k, e = 7, 3, 6
    x = (randn(n, 5, seed=20) * 10).to(dtype)
    expert_idx = expert_ids(n, k, [0, 1, 3, 5], seed=21)  # experts 2 and 4 get nothing
    ex, eri, counts, escale = npu.npu_moe_init_routing_v2(
        x, expert_idx, expert_num=e, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        row_idx_type=row_idx_type)
    ref_x, ref_gather, ref_active, ref_counts = init_routing_ref(x, expert_idx, 0, e)
    assert torch.equal(ex, ref_x) and ex.dtype == dtype
    assert eri.dtype == torch.int32 and counts.dtype == torch.int64 and escale.shape == (n * k,)
    assert torch.equal(eri.long(), ref_gather if row_idx_type == 0 else ref_active)
    assert torch.equal(counts, ref_counts) and counts.tolist()[2] == counts.tolist()[4] == 0
    # the gather property of row_idx_type 0: expanded_x[eri[t*K + j]] is token t
    if row_idx_type == 0:
        for t in range(n):
            for j in range(k):
                assert torch.equal(ex[eri[t * k + j]], x[t])


def test_init_routing_v2_expert_token_modes():
    n, k, e = 6, 2, 5
    x, expert_idx = randn(n, 4, seed=22), expert_ids(n, k, [0, 2, 3], seed=23)
    counts = torch.bincount(expert_idx.reshape(-1).long(), minlength=e)
    out = {t: npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=e, expert_tokens_num_type=t,
                                          expert_tokens_num_flag=True)[2] for t in (0, 1, 2)}
    assert torch.equal(out[1], counts)
    assert torch.equal(out[0], counts.cumsum(0))
    # key_value: (expert_num, 2) pairs [id, count] of the non-empty experts, then (0, 0)
    nonzero = [(i, c) for i, c in enumerate(counts.tolist()) if c]
    assert out[2].shape == (e, 2) and out[2][:len(nonzero)].tolist() == [list(p) for p in nonzero]
    assert out[2][len(nonzero)].tolist() == [0, 0]
    # mix-up: cumsum and counts are different tensors here (two non-empty experts or more)
    assert not torch.equal(out[0], out[1])
    # no flag: a 0-dim tensor, as the Meta function (not an empty (0,) tensor)
    none = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=e)[2]
    assert none.shape == () and none.dtype == torch.int64


def test_init_routing_v2_active_expert_range_and_scale():
    n, k = 6, 3
    x, expert_idx = randn(n, 4, seed=24), expert_ids(n, k, list(range(6)), seed=25)
    scale = randn(n, seed=26)
    ex, eri, counts, escale = npu.npu_moe_init_routing_v2(
        x, expert_idx, scale=scale, expert_num=6, active_expert_range=[1, 4], expert_tokens_num_type=1,
        expert_tokens_num_flag=True)
    ref_x, ref_gather, ref_active, ref_counts = init_routing_ref(x, expert_idx, 1, 4)
    n_valid = ref_active.numel()
    assert 0 < n_valid < n * k
    assert torch.equal(ex[:n_valid], ref_x) and not ex[n_valid:].any()  # undefined tail: zeros
    assert torch.equal(eri.long(), ref_gather) and (eri == -1).sum() == n * k - n_valid
    assert torch.equal(counts, ref_counts) and counts.shape == (3,)
    assert torch.equal(escale[:n_valid], scale[ref_active // k])


def test_init_routing_v2_active_num_keeps_the_first_rows():
    x, expert_idx = randn(5, 4, seed=27), expert_ids(5, 2, [0, 1, 2], seed=28)
    ex, _, _, escale = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=3, active_num=4)
    full = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=3)[0]
    assert ex.shape == (4, 4) and escale.shape == (4,) and torch.equal(ex, full[:4])


def test_init_routing_v2_row_idx_is_the_inverse_permutation_and_token_major():
    # mix-ups on the same input: (a) reading expanded_row_idx (type 0) as dst -> src, (b) the
    # k-major decode of the v1 op (x[order % N]), (c) type 1 read as src -> dst.
    n, k = 6, 3
    x, expert_idx = randn(n, 4, seed=29), expert_ids(n, k, [0, 1, 2, 3], seed=30)
    ex, eri, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=4)
    order = torch.argsort(expert_idx.reshape(-1).long(), stable=True)
    assert torch.equal(eri.long(), torch.argsort(order))  # the inverse of the sort
    assert not torch.equal(x[eri.long() // k], ex)  # (a)
    assert not torch.equal(x[order % n], ex)  # (b)
    assert torch.equal(x[order // k], ex)
    _, scatter, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=4, row_idx_type=1)
    assert torch.equal(scatter.long(), order) and not torch.equal(scatter, eri)  # (c)


def test_init_routing_v2_refuses_what_it_cannot_compute():
    x, expert_idx = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="quant_mode=-1"):
        npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=2, quant_mode=1)
    with pytest.raises(NotImplementedError, match="drop_pad_mode=0"):
        npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=2, drop_pad_mode=1, expert_capacity=2)
    with pytest.raises(RuntimeError, match="expert_num must be > 0"):
        npu.npu_moe_init_routing_v2(x, expert_idx)


# =====================================================================================
# npu_moe_compute_expert_tokens
# =====================================================================================
def expert_tokens_loop_ref(sorted_experts, num_expert):
    """out[e] = last index of expert e + 1; an absent expert carries the previous value."""
    out, last = [], 0
    values = sorted_experts.tolist()
    for e in range(num_expert):
        for i, v in enumerate(values):
            if v == e:
                last = i + 1
        out.append(last)
    return torch.tensor(out, dtype=torch.int32)


def test_compute_expert_tokens_doc_example():
    out = npu.npu_moe_compute_expert_tokens(torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32), 3)
    assert out.tolist() == [3, 5, 6] and out.dtype == torch.int32


@pytest.mark.parametrize("ids, num_expert", [([1, 1, 3, 3, 3, 4], 6), ([0, 2, 2, 5], 7), ([], 3)], ids=str)
def test_compute_expert_tokens_is_the_cumulative_end_offset(ids, num_expert):
    # empty experts at the start, in the middle and at the end
    sorted_experts = torch.tensor(ids, dtype=torch.int32)
    out = npu.npu_moe_compute_expert_tokens(sorted_experts, num_expert)
    assert torch.equal(out, expert_tokens_loop_ref(sorted_experts, num_expert))
    counts = torch.bincount(sorted_experts.long(), minlength=num_expert)
    assert torch.equal(out.long(), counts.cumsum(0))
    if ids:
        assert not torch.equal(out.long(), counts)  # mix-up: these are not counts


def test_compute_expert_tokens_refuses_unsorted_ids():
    with pytest.raises(RuntimeError, match="non-decreasing"):
        npu.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2)


# =====================================================================================
# npu_moe_token_permute / npu_moe_token_unpermute
# =====================================================================================
def megatron_permute(tokens, indices, num_out_tokens=None):
    """megatron/core/transformer/moe/moe_utils.py permute (indices API)."""
    topk = 1 if indices.dim() == 1 else indices.size(1)
    sorted_indices = torch.argsort(indices.view(-1), stable=True)
    if num_out_tokens is not None:
        sorted_indices = sorted_indices[:num_out_tokens]
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def megatron_unpermute(permuted_tokens, sorted_indices, num_rows, probs=None):
    """moe_utils.py unpermute: index_copy back to the flat order, weight, sum over top-k."""
    topk = 1 if probs is None else probs.size(1)
    unpermuted = permuted_tokens.new_zeros((num_rows, permuted_tokens.shape[-1]))
    unpermuted = unpermuted.index_copy(0, sorted_indices, permuted_tokens)
    unpermuted = unpermuted.reshape(-1, topk, permuted_tokens.size(-1))
    if probs is not None:
        unpermuted = unpermuted * probs.unsqueeze(-1)
    return unpermuted.sum(dim=1)


def scatter_add_unpermute(permuted_tokens, forward_order, probs, topk):
    """The combine as scatter_add: row i (flat source order[i]) adds into token order[i] // topk."""
    weights = probs.reshape(-1)[forward_order].unsqueeze(-1)
    index = (forward_order // topk).unsqueeze(-1).expand(-1, permuted_tokens.shape[1])
    out = permuted_tokens.new_zeros((forward_order.numel() // topk, permuted_tokens.shape[1]))
    return out.scatter_add(0, index, permuted_tokens * weights)


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
@pytest.mark.parametrize("indices_shape", [(6, 3), (7,)], ids=str)
def test_token_permute_gathers_like_megatron_and_returns_the_inverse_index(indices_shape, dtype):
    t = indices_shape[0]
    tokens = randn(t, 5, dtype=dtype, seed=40)
    g = _gen(41)
    indices = torch.randint(0, 4, indices_shape, generator=g)  # repeats: the stable order matters
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    ref, forward = megatron_permute(tokens, indices)
    assert torch.equal(permuted, ref) and sorted_indices.dtype == torch.int32
    assert torch.equal(sorted_indices.long(), torch.argsort(forward))  # inverse of Megatron's
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    for i in range(indices.numel()):  # the docstring's identity
        assert torch.equal(permuted[sorted_indices[i]], tokens[i // topk])


def test_token_permute_and_unpermute_docstring_examples():
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    assert permuted[:, 0].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert sorted_indices.tolist() == [0, 4, 5, 1, 2, 6, 7, 3]  # the unpermute example's input
    out = npu.npu_moe_token_unpermute(permuted, sorted_indices, torch.ones(4, 2, dtype=torch.float16) / 2)
    assert torch.equal(out, tokens)


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
def test_token_unpermute_equals_megatron_and_scatter_add(dtype):
    t, topk, h = 6, 3, 5
    indices = expert_ids(t, topk, list(range(5)), seed=42).long()
    probs = torch.rand(t, topk, generator=_gen(43), dtype=torch.float64).to(dtype)
    permuted = randn(t * topk, h, dtype=dtype, seed=44)  # expert outputs, in permuted order
    _, sorted_indices = npu.npu_moe_token_permute(randn(t, h, dtype=dtype), indices)
    forward = torch.argsort(indices.reshape(-1), stable=True)
    out = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    exact = megatron_unpermute(permuted.double(), forward, t * topk, probs.double())
    torch.testing.assert_close(scatter_add_unpermute(permuted.double(), forward, probs.double(), topk), exact)
    scale = permuted.double().abs().max() * probs.double().abs().max() * topk
    assert out.dtype == dtype
    assert_rounded_once(out, exact, scale.expand(exact.shape), fp32_ops=2 * topk)


def test_token_unpermute_reads_the_inverse_index_not_megatrons():
    # mix-up: handing unpermute Megatron's forward argsort gives another (wrong) combine
    t, topk = 5, 2
    indices = expert_ids(t, topk, [0, 1, 2, 3], seed=45).long()
    tokens = randn(t, 4, seed=46)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    forward = torch.argsort(indices.reshape(-1), stable=True)
    assert not torch.equal(forward, sorted_indices.long())
    probs = torch.rand(t, topk, generator=_gen(47))
    right = npu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    wrong = npu.npu_moe_token_unpermute(permuted, forward.int(), probs)
    torch.testing.assert_close(right, tokens * probs.sum(-1, keepdim=True))
    assert not torch.allclose(wrong, right)


@pytest.mark.parametrize("topk", [1, 3])
def test_permute_then_unpermute_round_trips(topk):
    t, h, e = 6, 4, 5
    tokens = randn(t, h, seed=48)
    indices = expert_ids(t, topk, list(range(e)), seed=49).long()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    # without probs (topK = 1): the expanded tokens come back in token order
    assert torch.equal(npu.npu_moe_token_unpermute(permuted, sorted_indices),
                       tokens.repeat_interleave(topk, dim=0))
    # unit weights: sum of topK copies; top-k weights with an expert function per row:
    # out[t] = sum_j w[t, j] * f_{e(t, j)}(tokens[t])
    torch.testing.assert_close(npu.npu_moe_token_unpermute(permuted, sorted_indices, torch.ones(t, topk)),
                               tokens * topk)
    w = torch.softmax(randn(t, topk, seed=50), -1)
    experts_of_rows = indices.reshape(-1)[torch.argsort(indices.reshape(-1), stable=True)]
    f = lambda rows, ex: rows * (ex.unsqueeze(-1) + 1.0) - ex.unsqueeze(-1)  # noqa: E731
    out = npu.npu_moe_token_unpermute(f(permuted, experts_of_rows), sorted_indices, w)
    ref = torch.stack([sum(w[i, j] * f(tokens[i], indices[i, j]) for j in range(topk)) for i in range(t)])
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("num_out_tokens", [9, -4, 0, 100])
def test_token_permute_num_out_tokens_drops_the_last_rows(num_out_tokens):
    t, topk = 5, 3
    tokens, indices = randn(t, 4, seed=51), expert_ids(t, topk, list(range(6)), seed=52).long()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices, num_out_tokens)
    n = t * topk
    rows = {9: 9, -4: n - 4, 0: n, 100: n}[num_out_tokens]  # None/0 all, > 0 capped, < 0 from the end
    ref, forward = megatron_permute(tokens, indices, rows)
    assert torch.equal(permuted, ref) and sorted_indices.shape == (n,)
    # a dropped row contributes nothing to the combine [inferred, op_semantics 11.5], as in
    # Megatron's unpermute, which zero-fills what the permute dropped
    probs = torch.rand(t, topk, generator=_gen(53))
    torch.testing.assert_close(npu.npu_moe_token_unpermute(permuted, sorted_indices, probs),
                               megatron_unpermute(permuted, forward, n, probs))


# ---- autograd -------------------------------------------------------------------------------
def test_token_permute_unpermute_gradcheck_float64():
    t, topk = 4, 2
    indices = expert_ids(t, topk, [0, 1, 2], seed=54).long()
    tokens = randn(t, 3, dtype=torch.float64, seed=55).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: npu.npu_moe_token_permute(x, indices, 6)[0], (tokens,))
    _, sorted_indices = npu.npu_moe_token_permute(tokens.detach(), indices)
    permuted = randn(t * topk, 3, dtype=torch.float64, seed=56).requires_grad_()
    probs = torch.rand(t, topk, generator=_gen(57), dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda p, w: npu.npu_moe_token_unpermute(p, sorted_indices, w),
                                    (permuted, probs))


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
def test_token_permute_unpermute_grads_equal_megatrons(dtype):
    t, topk, h = 5, 2, 4
    indices = expert_ids(t, topk, [0, 1, 2, 3], seed=58).long()
    tokens = randn(t, h, dtype=dtype, seed=59).requires_grad_()
    probs = torch.rand(t, topk, generator=_gen(60), dtype=torch.float64).to(dtype).requires_grad_()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    expert_out = permuted * 2 + 1
    out = npu.npu_moe_token_unpermute(expert_out, sorted_indices, probs)
    grad = randn(t, h, dtype=dtype, seed=61)
    d_tokens, d_probs = torch.autograd.grad(out, (tokens, probs), grad)

    leaves = [tokens.detach().double().requires_grad_(), probs.detach().double().requires_grad_()]
    ref_perm, forward = megatron_permute(leaves[0], indices)
    ref = megatron_unpermute(ref_perm * 2 + 1, forward, t * topk, leaves[1])
    e_tokens, e_probs = torch.autograd.grad(ref, leaves, grad.double())
    assert d_tokens.dtype == dtype and d_probs.dtype == dtype
    # fp32 grads of at most topK products, rounded at each op boundary of the fused chain
    # (unpermute grad, x2, permute grad): a few roundings of the dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(d_tokens.double(), e_tokens, rtol=tol, atol=tol)
    torch.testing.assert_close(d_probs.double(), e_probs, rtol=tol, atol=tol * 4)


def test_token_unpermute_without_probs_has_no_probs_grad():
    permuted = randn(4, 3, seed=62).requires_grad_()
    out = npu.npu_moe_token_unpermute(permuted, torch.tensor([2, 0, 3, 1], dtype=torch.int32))
    (d,) = torch.autograd.grad(out, permuted, torch.ones(4, 3))
    assert torch.equal(d, torch.ones(4, 3))
    g_perm, g_probs = npu.npu_moe_token_unpermute_grad_v2(torch.ones(4, 3), torch.tensor([2, 0, 3, 1]),
                                                          4, torch.float32)
    assert torch.equal(g_perm, torch.ones(4, 3)) and g_probs.numel() == 0


# =====================================================================================
# npu_moe_finalize_routing
# =====================================================================================
def finalize_loop_ref(rows, skip1, skip2, bias, scales, src2dst, expert_for_src, mode, k):
    """op_semantics 6.4 doc loop, float64."""
    kk = scales.shape[1] if scales is not None else k
    n = src2dst.numel() // kk
    h = rows.shape[-1]
    flat_rows = rows.reshape(-1, h).double()
    out = torch.zeros(n, h, dtype=torch.float64)
    for i in range(n):
        if skip1 is not None:
            out[i] += skip1[i].double()
        if skip2 is not None:
            out[i] += skip2[i].double()
        for j in range(kk):
            r = int(src2dst[j * n + i] if mode in (0, 1) else src2dst[i * kk + j])
            row = torch.zeros(h, dtype=torch.float64) if r == -1 else flat_rows[r].clone()
            if bias is not None:
                row += bias[int(expert_for_src[i, j])].double()
            out[i] += (scales[i, j].double() if scales is not None else 1.0) * row
    return out


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_is_the_weighted_combine(mode, dtype):
    n, k, h, e = 5, 3, 4, 6
    rows = randn(n * k, h, dtype=dtype, seed=70)
    skip1, skip2 = randn(n, h, dtype=dtype, seed=71), randn(n, h, dtype=dtype, seed=72)
    bias, scales = randn(e, h, dtype=dtype, seed=73), randn(n, k, dtype=dtype, seed=74)
    src2dst = torch.randperm(n * k, generator=_gen(75)).int()
    expert = expert_ids(n, k, list(range(e)), seed=76)
    out = npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src2dst, expert, mode, k)
    exact = finalize_loop_ref(rows, skip1, skip2, bias, scales, src2dst, expert, mode, k)
    terms = (rows.double().abs().max() + bias.double().abs().max()) * scales.double().abs().max() * k
    scale = terms + skip1.double().abs().max() + skip2.double().abs().max()
    assert out.dtype == dtype and out.shape == (n, h)
    assert_rounded_once(out, exact, scale.expand(exact.shape), fp32_ops=3 * k + 4)


def test_finalize_routing_drop_pad_and_minus_one_rows():
    e, c, h, n, k = 3, 2, 4, 4, 2
    rows = randn(e, c, h, seed=77)
    src2dst = torch.tensor([0, 5, -1, 2, 3, -1, 1, 4], dtype=torch.int32)
    scales = randn(n, k, seed=78)
    for mode in (1, 3):
        out = npu.npu_moe_finalize_routing(rows, None, None, None, scales, src2dst, None, mode, k)
        ref = finalize_loop_ref(rows, None, None, None, scales, src2dst, None, mode, k)
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    # no scales: k from the argument, unit weights
    out = npu.npu_moe_finalize_routing(rows.reshape(-1, h)[:6], None, None, None, None,
                                       torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32), None, 2, 3)
    torch.testing.assert_close(out, rows.reshape(-1, h)[:6].flip(0).reshape(2, 3, h).sum(1))


def test_finalize_routing_mode_0_is_k_major_and_mode_2_token_major():
    # mix-up: the same src -> dst map read k-major (mode 0) instead of token-major (mode 2)
    n, k, h = 4, 3, 2
    rows, scales = randn(n * k, h, seed=79), randn(n, k, seed=80)
    src2dst = torch.randperm(n * k, generator=_gen(81)).int()
    token_major = npu.npu_moe_finalize_routing(rows, None, None, None, scales, src2dst, None, 2, k)
    k_major = npu.npu_moe_finalize_routing(rows, None, None, None, scales, src2dst, None, 0, k)
    assert not torch.allclose(token_major, k_major)
    # mode 0 with the map transposed to k-major order is mode 2
    as_k_major = src2dst.view(n, k).t().reshape(-1)
    torch.testing.assert_close(npu.npu_moe_finalize_routing(rows, None, None, None, scales, as_k_major,
                                                            None, 0, k), token_major)


def test_init_routing_v2_then_finalize_routing_round_trips():
    # x -> init_routing_v2 -> a per-expert function of each row -> finalize (mode 2) is the
    # dense sum_j w[t, j] * f_{e(t, j)}(x[t]) + residual
    n, k, h, e = 6, 3, 4, 5
    x, expert_idx = randn(n, h, seed=82), expert_ids(n, k, list(range(e)), seed=83)
    w, residual = torch.softmax(randn(n, k, seed=84), -1), randn(n, h, seed=85)
    ex, eri, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=e)
    sorted_experts = expert_idx.reshape(-1)[torch.argsort(expert_idx.reshape(-1).long(), stable=True)]
    f = lambda rows, ex_ids: torch.tanh(rows) * (ex_ids.unsqueeze(-1) + 1.0)  # noqa: E731
    out = npu.npu_moe_finalize_routing(f(ex, sorted_experts), residual, None, None, w, eri, None, 2, k)
    ref = residual + torch.stack([sum(w[t, j] * f(x[t], expert_idx[t, j]) for j in range(k))
                                  for t in range(n)])
    torch.testing.assert_close(out, ref)
    # identity experts and unit weights: k copies of x back
    identity = npu.npu_moe_finalize_routing(ex, None, None, None, None, eri, None, 2, k)
    torch.testing.assert_close(identity, x * k)
    # the same combine as npu_moe_token_unpermute (both read the src -> dst token-major map)
    torch.testing.assert_close(npu.npu_moe_token_unpermute(f(ex, sorted_experts), eri, w), ref - residual)


# =====================================================================================
# npu_grouped_matmul
# =====================================================================================
def gmm_loop_ref(x, weights, sizes, bias=None):
    """Per-expert matmuls over contiguous row groups, float64; rows past the groups zero."""
    out = torch.zeros(x.shape[0], weights[0].shape[-1], dtype=torch.float64)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            out[start:start + size] = x[start:start + size].double() @ weights[e].double()
            if bias is not None:
                out[start:start + size] += bias[e].double()
        start += size
    return out


SIZES = [[3, 0, 2, 0, 4], [0, 0, 5, 4, 0], [2, 2, 2, 2, 1]]  # empty experts first, inside, last


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("group_list_type", [0, 1], ids=["cumsum", "counts"])
def test_grouped_matmul_is_per_expert_matmuls(group_list_type, sizes, dtype):
    e, kdim, n = len(sizes), 6, 5
    x = randn(sum(sizes), kdim, dtype=dtype, seed=90)
    w = randn(e, kdim, n, dtype=dtype, seed=91)
    counts = torch.tensor(sizes, dtype=torch.int64)
    group_list = counts.cumsum(0) if group_list_type == 0 else counts
    (out,) = npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                    group_list_type=group_list_type)
    exact = gmm_loop_ref(x, w, sizes)
    assert out.dtype == dtype and out.shape == (sum(sizes), n)
    scale = x.double().abs() @ w.double().abs().amax(0)
    assert_rounded_once(out, exact, scale, fp32_ops=kdim + 1)


@pytest.mark.parametrize("layout", ["list", "transposed", "bias", "list+bias"])
def test_grouped_matmul_weight_layouts_and_bias(layout):
    sizes, kdim, n = [2, 0, 3], 4, 6
    x = randn(5, kdim, seed=92)
    w = randn(3, kdim, n, seed=93)
    bias = randn(3, n, seed=94)
    kwargs = dict(group_list=torch.tensor(sizes), split_item=2, group_type=0, group_list_type=1)
    if layout == "list":
        out = npu.npu_grouped_matmul([x], list(w.unbind(0)), **kwargs)[0]
    elif layout == "transposed":  # nn.Linear weights (E, N, K) passed as a transposed view
        out = npu.npu_grouped_matmul([x], [w.transpose(1, 2).contiguous().transpose(1, 2)], **kwargs)[0]
    elif layout == "bias":
        out = npu.npu_grouped_matmul([x], [w], bias=[bias], **kwargs)[0]
    else:
        out = npu.npu_grouped_matmul([x], list(w.unbind(0)), bias=list(bias.unbind(0)), **kwargs)[0]
    ref = gmm_loop_ref(x, w, sizes, bias if "bias" in layout else None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_grouped_matmul_takes_the_bias_dtype_its_docs_give():
    """A bf16 x takes an fp32 bias, an fp16 x an fp16 one (the wheel's 数据类型约束, 非量化)."""
    x, w = randn(5, 4, seed=92).bfloat16(), randn(2, 4, 6, seed=93).bfloat16()
    kwargs = dict(group_list=torch.tensor([2, 5]), split_item=3, group_type=0)
    out = npu.npu_grouped_matmul([x], list(w.unbind(0)), bias=[torch.ones(6)] * 2, **kwargs)[0]
    assert out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="takes a torch.float32 bias"):
        npu.npu_grouped_matmul([x], list(w.unbind(0)), bias=[torch.ones(6, dtype=torch.bfloat16)] * 2, **kwargs)


def test_grouped_matmul_rows_past_the_groups_are_zero():
    x, w = randn(6, 3, seed=95), randn(2, 3, 4, seed=96)
    (out,) = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 4]), split_item=3, group_type=0)
    assert not out[4:].any() and out[:4].abs().sum() > 0


def test_grouped_matmul_counts_are_not_cumsum():
    # mix-up: counts [1, 2, 3] read as cumsum ends [1, 2, 3] leave rows 3..5 unmultiplied and
    # give expert 1 one row instead of two
    x, w = randn(6, 3, seed=97), randn(3, 3, 4, seed=98)
    counts = torch.tensor([1, 2, 3])
    kw = dict(group_list=counts, split_item=3, group_type=0)
    right = npu.npu_grouped_matmul([x], [w], group_list_type=1, **kw)[0]
    wrong = npu.npu_grouped_matmul([x], [w], group_list_type=0, **kw)[0]
    torch.testing.assert_close(right.double(), gmm_loop_ref(x, w, [1, 2, 3]))
    assert not torch.allclose(right, wrong)


def test_grouped_matmul_refuses_other_layouts():
    x, w, gl = randn(4, 3), randn(2, 3, 5), torch.tensor([2, 4])
    for kwargs, what in [(dict(group_type=-1, split_item=0, group_list=None), "group_type=-1"),
                         (dict(group_type=1, split_item=3), "group_type=1"),
                         (dict(group_type=2, split_item=3), "group_type=2 with weight as"),
                         (dict(group_type=0, split_item=0), "split_item=0"),
                         (dict(group_type=0, split_item=3, group_list_type=2), "group_list_type=2"),
                         (dict(group_type=0, split_item=3, act_type=5), "act_type=5"),
                         (dict(group_type=0, split_item=3, scale=[torch.ones(5)]), "scale")]:
        kwargs.setdefault("group_list", gl)
        with pytest.raises(NotImplementedError, match=what):
            npu.npu_grouped_matmul([x], [w], **kwargs)
    with pytest.raises(RuntimeError, match="group_type must be given"):
        npu.npu_grouped_matmul([x], [w], group_list=gl, split_item=3)
    with pytest.raises(RuntimeError, match="covers 5 rows, x has 4"):
        npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 3]), split_item=3, group_type=0,
                               group_list_type=1)


def test_grouped_matmul_has_no_backward_like_torch_npu():
    x, w = randn(4, 3).requires_grad_(), randn(2, 3, 5)
    (out,) = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match="npu_grouped_matmul has no backward in torch_npu"):
        out.sum().backward()


# ---- group_type=2: the K axis split into groups (the expert weight gradient) ---------------
def gmm_k_split_loop_ref(x, weight, sizes):
    """out[g] = x[:, K_g] @ weight[K_g] over contiguous column groups of x, float64; an empty
    group gives zeros, columns past the groups take part in no group."""
    out = torch.zeros(len(sizes), x.shape[0], weight.shape[1], dtype=torch.float64)
    start = 0
    for g, size in enumerate(sizes):
        out[g] = x[:, start:start + size].double() @ weight[start:start + size].double()
        start += size
    return out


def _transposed(rows, cols, dtype, seed):
    """(rows, cols) as the transposed view of a contiguous (cols, rows) tensor: how MindSpeed
    passes `input.T` (and the hardware requires x for group_type=2)."""
    return randn(cols, rows, dtype=dtype, seed=seed).t()


@pytest.mark.parametrize("dtype", FLOAT, ids=str)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("group_list_type", [0, 1], ids=["cumsum", "counts"])
def test_grouped_matmul_k_split_is_per_group_products(group_list_type, sizes, dtype):
    m, n = 6, 5
    ktot = sum(sizes) + 2  # two columns past the last group: no group reads them
    x, w = _transposed(m, ktot, dtype, seed=130), randn(ktot, n, dtype=dtype, seed=131)
    counts = torch.tensor(sizes, dtype=torch.int64)
    group_list = counts.cumsum(0) if group_list_type == 0 else counts
    (out,) = npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=2,
                                    group_list_type=group_list_type)
    exact = gmm_k_split_loop_ref(x, w, sizes)
    assert out.dtype == dtype and out.shape == (len(sizes), m, n)
    assert not out[[g for g, size in enumerate(sizes) if size == 0]].any()  # empty groups: zeros
    scale = torch.stack([x.double().abs() @ w.double().abs()] * len(sizes))
    assert_rounded_once(out, exact, scale, fp32_ops=max(sizes) + 1)


def test_grouped_matmul_k_split_is_the_weight_gradient_of_the_m_split():
    # MindSpeed's dW: npu_grouped_matmul([x.T], [dy], group_type=2) over the tokens of each
    # expert is the autograd gradient of the per-expert products x_e @ w_e
    sizes, kdim, n = [3, 0, 4, 2], 6, 5
    x = randn(sum(sizes), kdim, dtype=torch.float64, seed=132)
    w = randn(len(sizes), kdim, n, dtype=torch.float64, seed=133).requires_grad_()
    dy = randn(sum(sizes), n, dtype=torch.float64, seed=134)
    gmm_loop_ref(x, w, sizes).backward(dy)
    (dw,) = npu.npu_grouped_matmul([x.t()], [dy], group_list=torch.tensor(sizes).cumsum(0), split_item=3,
                                   group_type=2, group_list_type=0)
    torch.testing.assert_close(dw, w.grad)


def test_grouped_matmul_k_split_mix_ups_fail_or_differ():
    sizes, m, n = [1, 2, 3], 4, 5
    x, w = _transposed(m, 6, torch.float32, seed=135), randn(6, n, seed=136)
    counts = torch.tensor(sizes)
    kw = dict(split_item=3, group_type=2)
    right = npu.npu_grouped_matmul([x], [w], group_list=counts, group_list_type=1, **kw)[0]
    torch.testing.assert_close(right.double(), gmm_k_split_loop_ref(x, w, sizes))
    # counts [1, 2, 3] read as cumsum ends: groups of 1, 1, 1 columns, the last 3 in none
    wrong = npu.npu_grouped_matmul([x], [w], group_list=counts, group_list_type=0, **kw)[0]
    assert not torch.allclose(right, wrong)
    # the hardware needs x transposed (its K groups are rows of x's storage): a contiguous x
    # of the same values is refused, as is a transposed weight
    with pytest.raises(RuntimeError, match="needs x as a transposed view"):
        npu.npu_grouped_matmul([x.contiguous()], [w], group_list=counts, group_list_type=1, **kw)
    with pytest.raises(RuntimeError, match="does not take a transposed weight"):
        npu.npu_grouped_matmul([x], [w.t().contiguous().t()], group_list=counts, group_list_type=1, **kw)
    # x.T of the M-split's x is (K_model, M): its K groups are the tokens, not the hidden size
    with pytest.raises(RuntimeError, match="does not multiply weight"):
        npu.npu_grouped_matmul([x.t().contiguous().t()[:, :5]], [w], group_list=counts, group_list_type=1, **kw)
    with pytest.raises(RuntimeError, match="covers 7 columns"):
        npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2, 4]), group_list_type=1, **kw)
    with pytest.raises(RuntimeError, match="takes no bias"):
        npu.npu_grouped_matmul([x], [w], bias=[torch.zeros(n)], group_list=counts, group_list_type=1, **kw)



# ---- npu_moe_re_routing (expert parallel: the regroup after the token all-to-all) -----------
def _re_routing_reference(tokens, counts):
    """op_semantics 6.5's reference, written from the CANN README's offsets: output bucket
    (e, r) is input bucket (r, e); inputs rank-major, outputs expert-major."""
    ranks, experts = counts.shape
    flat = counts.flatten()
    start = (flat.cumsum(0) - flat).view(ranks, experts)
    idx = torch.cat([torch.arange(int(start[r, e]), int(start[r, e] + counts[r, e]))
                     for e in range(experts) for r in range(ranks)]).long()
    return tokens[idx], idx, counts.sum(0)


def _titan_permute(tokens, counts):
    """torchtitan 0.3.0's own AllToAllTokenDispatcher._permute on the flat received counts."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    ranks = counts.shape[0]
    dispatcher = SimpleNamespace(ep_mesh=SimpleNamespace(size=lambda: ranks))
    _, permuted, indices, per_expert = AllToAllTokenDispatcher._permute(dispatcher, tokens, counts.flatten())
    return permuted, indices, per_expert


def _counts(ranks, experts, high=4, seed=0, dtype=torch.int64, zeros=True):
    counts = torch.randint(0 if zeros else 1, high, (ranks, experts), generator=_gen(seed))
    if zeros:
        counts[0, -1] = 0  # at least one empty bucket
    return counts.to(dtype)


@pytest.mark.parametrize("ranks, experts", [(2, 2), (4, 3), (8, 1), (3, 5), (1, 4)])
@pytest.mark.parametrize("counts_dtype", [torch.int64, torch.int32], ids=str)
def test_re_routing_equals_torchtitans_permute_bit_for_bit(ranks, experts, counts_dtype):
    """float64 tokens, zero counts included: the permuted rows, the gather index (int32 here,
    int64 in torchtitan) and the per-expert counts are identical."""
    counts = _counts(ranks, experts, seed=ranks * 10 + experts, dtype=counts_dtype)
    tokens = randn(int(counts.sum()), 3, dtype=torch.float64, seed=120)
    permuted, _, idx, per_expert = npu.npu_moe_re_routing(tokens, counts)
    titan_tokens, titan_idx, titan_counts = _titan_permute(tokens, counts.long())
    assert idx.dtype == torch.int32 and per_expert.dtype == counts_dtype
    assert torch.equal(permuted, titan_tokens) and torch.equal(idx.long(), titan_idx)
    assert torch.equal(per_expert.long(), titan_counts)
    ref_tokens, ref_idx, ref_counts = _re_routing_reference(tokens, counts.long())
    assert torch.equal(permuted, ref_tokens) and torch.equal(idx.long(), ref_idx)
    assert torch.equal(per_expert.long(), ref_counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8], ids=str)
def test_re_routing_is_a_copy_in_the_ops_dtypes(dtype):
    counts = _counts(3, 4, seed=3)
    tokens = (randn(int(counts.sum()), 8, seed=121) * 20).to(dtype)
    scales = torch.rand(int(counts.sum()), generator=_gen(122))
    permuted, permuted_scales, idx, _ = npu.npu_moe_re_routing(tokens, counts, per_token_scales=scales)
    assert permuted.dtype == dtype and torch.equal(permuted, tokens[idx.long()])
    assert torch.equal(permuted_scales, scales[idx.long()])


def test_re_routing_reads_the_counts_rank_major_not_expert_major():
    """Mix-up: (ranks, experts) read as (experts, ranks) regroups other rows; and the index
    is the gather index (output -> input), not its inverse."""
    counts = torch.tensor([[1, 2, 0], [3, 1, 2]])
    tokens = randn(9, 2, dtype=torch.float64, seed=123)
    permuted, _, idx, per_expert = npu.npu_moe_re_routing(tokens, counts)
    # bucket (r, e) starts: r0 e0 at 0, e1 at 1, e2 at 3; r1 e0 at 3, e1 at 6, e2 at 7
    assert idx.tolist() == [0, 3, 4, 5, 1, 2, 6, 7, 8]
    assert per_expert.tolist() == [4, 3, 2]
    swapped, _, swapped_idx, _ = npu.npu_moe_re_routing(tokens, counts.t().contiguous())
    assert not torch.equal(swapped_idx, idx)
    inverse = torch.argsort(idx.long())
    assert not torch.equal(inverse, idx.long())
    assert torch.equal(permuted, tokens[idx.long()]) and not torch.equal(permuted, tokens[inverse])


def test_re_routing_all_zero_rows_and_an_empty_input():
    counts = torch.tensor([[0, 0], [2, 0], [0, 1]])
    tokens = randn(3, 4, seed=124).bfloat16()
    permuted, _, idx, per_expert = npu.npu_moe_re_routing(tokens, counts)
    assert idx.tolist() == [0, 1, 2] and per_expert.tolist() == [2, 1]
    empty, _, empty_idx, empty_counts = npu.npu_moe_re_routing(tokens[:0], torch.zeros(2, 3, dtype=torch.int64))
    assert empty.shape == (0, 4) and empty_idx.shape == (0,) and empty_counts.tolist() == [0, 0, 0]


def test_re_routing_refuses_what_it_cannot_compute():
    counts = torch.tensor([[1, 2], [0, 1]])
    tokens = randn(4, 2, seed=125).bfloat16()
    with pytest.raises(RuntimeError, match="add up to 4 tokens"):
        npu.npu_moe_re_routing(tokens[:3], counts)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        npu.npu_moe_re_routing(tokens, counts.float())
    with pytest.raises(NotImplementedError, match="idx_type=1"):
        npu.npu_moe_re_routing(tokens, counts, idx_type=1)
    with pytest.raises(NotImplementedError, match="expert_token_num_type=0"):
        npu.npu_moe_re_routing(tokens, counts, expert_token_num_type=0)
    with pytest.raises(RuntimeError, match="negative"):
        npu.npu_moe_re_routing(tokens, torch.tensor([[5, -1], [0, 0]]))


def test_re_routing_has_no_backward_like_torch_npu():
    counts = torch.tensor([[1, 2], [0, 1]])
    tokens = randn(4, 2, seed=126).requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward in torch_npu"):
        npu.npu_moe_re_routing(tokens, counts)[0].sum().backward()


def test_re_routing_fake_kernel_keeps_a_data_dependent_row_count():
    """After an all-to-all the row count is an unbacked SymInt: the fake kernel's sizes come
    from the inputs' sizes (as the wheel's Meta function), never from the counts' values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def received(splits, tokens, counts):
        rows = splits.sum().item()
        torch._check(rows <= tokens.shape[0])
        return npu.npu_moe_re_routing(tokens[:rows], counts)

    gm = make_fx(received, tracing_mode="symbolic")(torch.tensor([3, 2]), randn(9, 4).bfloat16(),
                                                    torch.tensor([[2, 1], [0, 2]]))
    (node,) = [n for n in gm.graph.nodes if n.target is npu.npu_moe_re_routing.default]
    permuted, scales, idx, per_expert = node.meta["val"]
    rows = permuted.shape[0]
    assert isinstance(rows, torch.SymInt) and scales.shape == idx.shape == (rows,)
    assert permuted.shape[1] == 4 and per_expert.shape == (2,) and idx.dtype == torch.int32


# ---- a whole MoE layer ----------------------------------------------------------------------
@pytest.mark.parametrize("group_list_type", [0, 1], ids=["cumsum", "counts"])
def test_moe_layer_from_the_stand_ins_equals_the_dense_expert_loop(group_list_type):
    # gating -> init_routing_v2 -> gmm -> relu -> gmm -> finalize_routing, against the HF
    # Mixtral-style loop over experts. The cumsum variant takes its group_list from
    # npu_moe_compute_expert_tokens, the counts variant from init_routing_v2.
    t, h, f, e, k = 7, 6, 10, 4, 2
    x, logits = randn(t, h, seed=100), _distinct_logits(t, e, seed=101)
    w1, w2 = randn(e, h, f, seed=102) * 0.5, randn(e, f, h, seed=103) * 0.5
    y, idx, _ = npu.npu_moe_gating_top_k_softmax(logits, None, k)
    weights = y / y.sum(-1, keepdim=True)  # norm_topk_prob
    ex, eri, counts, _ = npu.npu_moe_init_routing_v2(x, idx, expert_num=e, expert_tokens_num_type=1,
                                                     expert_tokens_num_flag=True)
    if group_list_type == 0:
        sorted_experts = idx.reshape(-1)[torch.argsort(idx.reshape(-1).long(), stable=True)]
        group_list = npu.npu_moe_compute_expert_tokens(sorted_experts, e).long()
    else:
        group_list = counts
    kw = dict(group_list=group_list, split_item=3, group_type=0, group_list_type=group_list_type)
    hidden = torch.relu(npu.npu_grouped_matmul([ex], [w1], **kw)[0])
    expert_out = npu.npu_grouped_matmul([hidden], [w2], **kw)[0]
    out = npu.npu_moe_finalize_routing(expert_out, None, None, None, weights, eri, None, 2, k)

    # HF Mixtral: routing_weights = softmax(float).topk, / sum; loop over experts, index_add_
    routing = torch.softmax(logits.double(), -1)
    rw, selected = torch.topk(routing, k, -1)
    rw = rw / rw.sum(-1, keepdim=True)
    ref = torch.zeros(t, h, dtype=torch.float64)
    mask = torch.nn.functional.one_hot(selected, e).permute(2, 1, 0)
    for expert in range(e):
        slot, token = torch.where(mask[expert])
        cur = torch.relu(x.double()[token] @ w1[expert].double()) @ w2[expert].double()
        ref.index_add_(0, token, cur * rw[token, slot, None])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_gating_top_k_backward_shape_and_dtype_per_its_docs():
    # no Meta function in the wheel: the docs say x_norm's shape, grad_y's dtype
    x_norm, grad_y = torch.sigmoid(randn(6, 16)), randn(6, 4, dtype=torch.bfloat16)
    top_idx = npu.npu_moe_gating_top_k(randn(6, 16, seed=1), **DEEPSEEK_SMALL)[1]
    out = npu.npu_moe_gating_top_k_backward(x_norm, grad_y, top_idx, norm_type=1)
    assert out.shape == x_norm.shape and out.dtype == torch.bfloat16


# =====================================================================================
# npu_moe_gating_top_k, DeepSeek-V4: sqrt-softplus (norm_type 2) and hash routing
# =====================================================================================
def hf_deepseek_v4_router(logits, bias, top_k, routed_scaling_factor, tid2eid=None, input_ids=None):
    """transformers DeepseekV4TopKRouter / DeepseekV4HashRouter after the gate GEMM, in float64."""
    scores = torch.nn.functional.softplus(logits.double()).sqrt()
    if tid2eid is None:
        ids = torch.topk(scores + bias.double(), top_k, dim=-1, sorted=False).indices
    else:
        ids = tid2eid[input_ids.reshape(-1)].long()
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def test_gating_top_k_sqrt_softplus_equals_hf_deepseek_v4_router():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(9, 16, generator=g, dtype=torch.float64), torch.randn(16, generator=g) * 0.1
    y, idx, norm_out = npu.npu_moe_gating_top_k(logits, 3, bias=bias.double(), norm_type=2, out_flag=True,
                                               routed_scaling_factor=1.5)
    ref_y, ref_idx = hf_deepseek_v4_router(logits, bias, 3, 1.5)
    order = ref_idx.sort(-1)  # HF's top-k is unsorted: compare per token in expert order
    torch.testing.assert_close(y.gather(1, idx.long().sort(-1).indices), ref_y.gather(1, order.indices))
    assert torch.equal(idx.long().sort(-1).values, order.values)
    torch.testing.assert_close(norm_out.double(), torch.nn.functional.softplus(logits).sqrt(), rtol=1e-6, atol=1e-6)
    loop_y, loop_idx = grouped_topk_loop_ref(logits, 3, bias=bias, norm_type=2, routed_scaling_factor=1.5)
    torch.testing.assert_close(y, loop_y)
    assert torch.equal(idx.long(), loop_idx)


def test_gating_top_k_hash_mode_keeps_the_tables_order():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 16, generator=g, dtype=torch.float64)
    tid2eid = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(32)])
    input_ids = torch.randint(0, 32, (6,), generator=g)
    y, idx, _ = npu.npu_moe_gating_top_k(logits, 2, input_ids=input_ids, tid2eid=tid2eid, norm_type=2,
                                         routed_scaling_factor=1.5)
    ref_y, ref_idx = hf_deepseek_v4_router(logits, None, 2, 1.5, tid2eid=tid2eid, input_ids=input_ids)
    assert torch.equal(idx.long(), ref_idx)  # the table's order, not the scores'
    torch.testing.assert_close(y, ref_y)
    # mix-up: the bias steers only a top-k selection, never hash routing's table
    y_biased, idx_biased, _ = npu.npu_moe_gating_top_k(logits, 2, bias=torch.randn(16, dtype=torch.float64) * 10,
                                                       input_ids=input_ids, tid2eid=tid2eid, norm_type=2,
                                                       routed_scaling_factor=1.5)
    assert torch.equal(idx_biased, idx) and torch.equal(y_biased, y)


def test_gating_top_k_sqrt_softplus_has_no_backward():
    x = torch.randn(4, 16, requires_grad=True)
    y, _, _ = npu.npu_moe_gating_top_k(x, 2, norm_type=2, out_flag=True)
    with pytest.raises(RuntimeError, match="supports norm_type=1"):
        y.sum().backward()
