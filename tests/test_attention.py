"""attention: dense attention -> npu_fused_infer_attention_score, one unfused form at a time.

Each module below is one attention core as transformers writes it (SDPA with a bool mask,
SDPA with is_causal, the MLA math path, eager attention with its additive mask, GQA through
repeat_kv), compiled through the emulation backend and compared with eager. The mask
decides the sparse_mode: proven causal (built from aranges) -> 3 with the compressed mask;
anything else -> the explicit mask, exact; is_causal -> 2 or 3. Tolerances: fp32 1e-5 (the
same fp32 arithmetic in another order); bf16 within 2 ulps at the output's scale (the
stand-in rounds once, SDPA's CPU kernel too, in another order).

Every test runs on both graphs (the `npu_dispatch` fixture): the NPU graph, where SDPA is
torch_npu's npu_fusion_attention_v3 behind logical_not / ones+triu and eager attention's
matmuls stay aten.matmul, and the plain CPU graph (SDPA's CPU op or math path, bmm).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import npu_fx_fusion as nff
import helpers
from helpers import assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered
from transformers.integrations.sdpa_attention import repeat_kv

B, N, NKV, D = 2, 4, 2, 16
ensure_registered()
FIA = torch.ops.npu.npu_fused_infer_attention_score.default


_GRAPH = {"npu_dispatch": True}


@pytest.fixture(autouse=True, params=[True, False], ids=["npu-graph", "cpu-graph"])
def npu_dispatch(request):
    """Which graph every compile of the test fuses (FusionConfig.npu_dispatch)."""
    _GRAPH["npu_dispatch"] = request.param
    yield request.param
    _GRAPH["npu_dispatch"] = True


def _config(config=None):
    return dataclasses.replace(config or nff.FusionConfig(), npu_dispatch=_GRAPH["npu_dispatch"])


def RecordingBackend(config=None):  # noqa: N802 - the helper's class, on the test's graph
    return helpers.RecordingBackend(_config(config))


def compile_and_run(module, *inputs, config=None):
    return helpers.compile_and_run(module, *inputs, config=_config(config))


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(queries, keys, dtype=torch.float32, heads_kv=NKV, dim_v=D, dim=D):
    # q as transformers makes it: a (B, N, S, D) view of the projection's (B, S, N, D)
    q = _randn(B, queries, N, dim, seed=1, dtype=dtype).transpose(1, 2)
    return q, _randn(B, heads_kv, keys, dim, seed=2, dtype=dtype), _randn(B, heads_kv, keys, dim_v, seed=3, dtype=dtype)


def causal(queries, keys, offset):
    """transformers' sdpa_mask: key j visible to query i iff j <= i + offset (True = attend)."""
    q_idx = torch.arange(queries) + offset
    kv_idx = torch.arange(keys)
    return (kv_idx[None, None, None, :] <= q_idx[None, None, :, None]).expand(B, -1, -1, -1)


class SdpaConstantMask(nn.Module):
    """A prefill without a cache: the causal mask from aranges only."""

    def forward(self, q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        mask = causal(q.shape[2], k.shape[2], k.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


class SdpaRuntimeMask(nn.Module):
    """A static cache's step: the mask depends on the cache length, an input."""

    def forward(self, q, k, v, length):
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        mask = causal(q.shape[2], k.shape[2], length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


class SdpaGivenMask(nn.Module):
    def __init__(self, groups=N // NKV, scale=0.25):
        super().__init__()
        self.groups, self.scale = groups, scale

    def forward(self, q, k, v, mask):
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)


class SdpaCausal(nn.Module):
    def forward(self, q, k, v):
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True,
                                              scale=0.25)


class EagerAttention(nn.Module):
    """transformers' eager_attention_forward, the additive mask made as eager_mask does."""

    def __init__(self, fold_scale_into_q=False, bias=None):
        super().__init__()
        self.fold_scale_into_q, self.bias = fold_scale_into_q, bias

    def forward(self, q, k, v, length):
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        mask = causal(q.shape[2], k.shape[2], length)
        additive = torch.where(mask, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        if self.bias is not None:  # ALiBi-style: values in between, not a mask
            additive = additive + self.bias.to(q.dtype)
        scale = 1 / math.sqrt(q.shape[-1])
        if self.fold_scale_into_q:
            weights = torch.matmul(q * scale, k.transpose(2, 3))
        else:
            weights = torch.matmul(q, k.transpose(2, 3)) * scale
        weights = weights + additive
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = F.dropout(weights, p=0.0, training=False)
        return torch.matmul(weights, v)


def _fused_calls(backend):
    gm = backend.graphs["inference"]
    return [n for n in gm.graph.nodes if n.target is FIA]


def _run(module, *inputs, config=None, dynamic=False):
    backend = RecordingBackend(config)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        expected, actual = module(*inputs), compiled(*inputs)
    return actual, expected, backend


def _sites(backend):
    return [s for s in backend.report.sites if s.pass_name == "attention"]


def _close(actual, expected):
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_close_at_scale(actual, expected, ulps=2)


# ---- the forms, the mask proofs --------------------------------------------------------------
@pytest.mark.parametrize("queries, keys", [(5, 5), (3, 7)])
def test_a_mask_from_aranges_is_right_down_causal(queries, keys):
    actual, expected, backend = _run(SdpaConstantMask(), *_qkv(queries, keys))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs["sparse_mode"] == 3 and call.kwargs["num_key_value_heads"] == NKV
    assert call.args[1].meta["val"].shape[1] == NKV  # repeat_kv's copy is gone: FIA reads the 2 heads
    mask = call.kwargs["atten_mask"]
    assert mask.target is torch.ops.aten.triu.default and mask.meta["val"].shape == (2048, 2048)


def test_a_mask_that_depends_on_an_input_stays_explicit():
    q, k, v = _qkv(3, 8)
    actual, expected, backend = _run(SdpaRuntimeMask(), q, k, v, torch.tensor(4))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs.get("sparse_mode", 0) == 0 and call.kwargs["inner_precise"] == 2
    assert call.kwargs["atten_mask"].target is torch.ops.aten.logical_not.default
    (site,) = _sites(backend)
    assert "cannot be proven causal at compile time" in site.note and "explicit mask" in site.note


def test_decode_reads_the_whole_cache_and_says_so():
    q, k, v = _qkv(1, 8)
    actual, expected, backend = _run(SdpaRuntimeMask(), q, k, v, torch.tensor(5))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs.get("inner_precise", 0) == 0  # Q_S = 1 takes 0 / 1 only
    (site,) = _sites(backend)
    assert "reads all 8 key positions (max_cache_len)" in site.note and "actual_seq_lengths_kv" in site.note


@pytest.mark.parametrize("queries, keys, mode", [(5, 5, 3), (3, 7, 2)])
def test_is_causal_is_top_left(queries, keys, mode):
    actual, expected, backend = _run(SdpaCausal(), *_qkv(queries, keys))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs["sparse_mode"] == mode


def test_caller_padding_mask_fuses_exactly_fully_masked_rows_included():
    q, k, v = _qkv(4, 6)
    mask = causal(4, 6, 2).clone()
    mask[0, :, :, :3] = False  # batch 0: three padding keys on the left
    mask[1, :, 0] = False  # batch 1: a query row that sees nothing (SDPA gives 0 there, so does FIA)
    actual, expected, backend = _run(SdpaGivenMask(), q, k, v, mask)
    _close(actual, expected)
    assert len(_fused_calls(backend)) == 1


def test_sliding_window_mask_fuses_as_an_explicit_mask():
    class SlidingWindow(nn.Module):
        def forward(self, q, k, v):
            k, v = repeat_kv(k, 2), repeat_kv(v, 2)
            i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
            mask = ((j <= i) & (j > i - 3))[None, None].expand(B, -1, -1, -1)  # a window of 3
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)

    actual, expected, backend = _run(SlidingWindow(), *_qkv(6, 6))
    _close(actual, expected)
    (site,) = _sites(backend)
    assert "neither right-down causal nor empty" in site.note and "explicit mask" in site.note


def test_a_scale_that_is_not_one_over_sqrt_d_is_captured():
    # the model folded 1/sqrt(D) into q and calls SDPA with scale=1: FIA takes scale=1.0
    q, k, v = _qkv(3, 8)
    mask = causal(3, 8, 5)
    actual, expected, backend = _run(SdpaGivenMask(scale=1.0), q * 0.25, k, v, mask)
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs.get("scale", 1.0) == 1.0  # FIA's default: the trace leaves it out


def test_mha_without_repeat_kv():
    q, k, v = _qkv(3, 8, heads_kv=N)
    actual, expected, backend = _run(SdpaGivenMask(groups=1), q, k, v, causal(3, 8, 5))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs["num_key_value_heads"] == N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_math_path_pads_the_value(dtype, npu_dispatch):
    # D_qk = 24 (nope + rope) > D_v = 16: SDPA takes its math path on CPU; torch_npu's
    # FlashAttention takes it (Dq = Dk >= Dv)
    q, k, v = _qkv(3, 8, heads_kv=N, dim=24, dtype=dtype)
    actual, expected, backend = _run(SdpaGivenMask(groups=1), q, k, v, causal(3, 8, 5))
    _close(actual, expected)
    (site,) = _sites(backend)
    assert site.form.startswith("sdpa_npu_masked" if npu_dispatch else "sdpa_math_masked")
    assert "value zero-padded from D 16 to 24" in site.note


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("queries", [3, 1])
def test_eager_attention(dtype, queries):
    q, k, v = _qkv(queries, 8, dtype=dtype)
    actual, expected, backend = _run(EagerAttention(), q, k, v, torch.tensor(8 - queries))
    _close(actual, expected)
    (call,) = _fused_calls(backend)
    assert call.kwargs["atten_mask"].target is torch.ops.aten.ne.Scalar


@pytest.mark.parametrize("batch", [1, 2])
def test_dynamic_batch_and_length(batch):
    q, k, v = _qkv(3, 8)
    q, k, v = q[:batch], k[:batch], v[:batch]
    mask = causal(3, 8, 5)[:batch]
    actual, expected, backend = _run(SdpaGivenMask(), q, k, v, mask, dynamic=True)
    _close(actual, expected)
    assert len(_fused_calls(backend)) == 1


# ---- negatives: near misses that name the check ---------------------------------------------
def test_a_scale_folded_into_q_before_the_matmul_fuses():
    # (q * s) @ k^T is s * (q @ k^T): the scale is found wherever the scores carry it
    q, k, v = _qkv(3, 8)
    actual, expected, report = compile_and_run(EagerAttention(fold_scale_into_q=True), q, k, v, torch.tensor(5))
    assert report.counts["attention"] == 1 and near_miss_reasons(report, "attention") == []
    _close(actual, expected)


def test_an_additive_bias_is_not_a_mask():
    q, k, v = _qkv(3, 8)
    bias = _randn(1, 1, 3, 8, seed=7)
    _, _, report = compile_and_run(EagerAttention(bias=bias), q, k, v, torch.tensor(5))
    assert report.counts["attention"] == 0
    reasons = near_miss_reasons(report, "attention")
    assert reasons and all("values in between (a bias)" in r for r in reasons), reasons


def test_a_per_head_mask_is_a_near_miss():
    q, k, v = _qkv(3, 8)
    mask = causal(3, 8, 5).expand(B, N, -1, -1).clone()
    _, _, report = compile_and_run(SdpaGivenMask(), q, k, v, mask)
    assert report.counts["attention"] == 0
    assert any("no per-head mask" in r for r in near_miss_reasons(report, "attention"))


def test_training_keeps_sdpa(npu_dispatch):
    q, k, v = (t.clone().requires_grad_() for t in _qkv(3, 8))
    backend = RecordingBackend()
    out = torch.compile(SdpaConstantMask(), backend=backend, fullgraph=True)(q, k, v)
    out.sum().backward()
    report = backend.report
    assert report.counts.get("attention", 0) == 0
    saved = ("npu_fusion_attention_v3's softmax statistics are used (saved for the backward" if npu_dispatch
             else "logsumexp is used (saved for the backward")
    assert any(saved in r for r in near_miss_reasons(report, "attention")), near_miss_reasons(report, "attention")


def test_dropout_is_not_fused(npu_dispatch):
    if npu_dispatch:
        # the NPU's FlashAttention draws its dropout mask with the device's Philox generator,
        # which its CPU stand-in cannot reproduce (npu_ops/fusion_attention.py refuses to run it)
        pytest.skip("an NPU graph with dropout_p > 0 cannot run in CPU emulation")
    class Dropout(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), dropout_p=0.5,
                                                  is_causal=True, scale=0.25)

    backend = RecordingBackend()
    with torch.no_grad():
        torch.compile(Dropout(), backend=backend, fullgraph=True)(*_qkv(3, 3))
    assert backend.report.counts["attention"] == 0
    # (with dropout SDPA takes its math path on CPU: native_dropout after _safe_softmax)
    assert near_miss_reasons(backend.report, "attention") == [
        "dropout (p=0.5) on the attention probabilities: FIA has no dropout"]


def test_with_a_soc_fp32_is_refused():
    _, _, report = compile_and_run(SdpaConstantMask(), *_qkv(5, 5), config=nff.FusionConfig(soc="Ascend910B"))
    assert near_miss_reasons(report, "attention") == [
        "npu.npu_fused_infer_attention_score does not support float32 on Ascend910B"]


def test_ascend950_records_npu_fusion_attention_which_is_not_fused(npu_dispatch):
    if not npu_dispatch:
        pytest.skip("the SoC's SDPA spelling exists only on the NPU graph")
    q, k, v = _qkv(5, 5, dtype=torch.bfloat16)
    _, _, report = compile_and_run(SdpaConstantMask(), q, k, v, config=nff.FusionConfig(soc="Ascend950"))
    assert report.counts.get("attention", 0) == 0
    assert near_miss_reasons(report, "attention") == [
        "npu_fusion_attention is SDPA as Ascend950 records it: "
        "npu.npu_fused_infer_attention_score is not available on Ascend950"]


def test_bf16_fuses_with_a_soc():
    q, k, v = _qkv(5, 5, dtype=torch.bfloat16)
    actual, expected, backend = _run(SdpaConstantMask(), q, k, v, config=nff.FusionConfig(soc="Ascend910B"))
    _close(actual, expected)
    assert len(_fused_calls(backend)) == 1


# ---- attention by what it computes: other codebases' spellings (issue 28, survey A1 / A2) ----
# (the head dim is the model's config, D: a constant scale under dynamic shapes too)
def _triu_minus_inf(size):
    return torch.triu(torch.full((size, size), float("-inf")), 1)


class DividedBySqrtD(nn.Module):  # scores / math.sqrt(head_dim), masked_fill of a bool triu
    def forward(self, q, k, v):
        s = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return F.softmax(scores, -1) @ v


class SdpaFloatCausalMask(nn.Module):  # SDPA with the float mask triu(full(-inf), 1)
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_triu_minus_inf(q.shape[2]))


class BaddbmmMaskedFill(nn.Module):  # baddbmm(alpha=scale) + masked_fill(-10000.0) + bmm
    def forward(self, q, k, v):
        b, n, s, d = q.shape
        q2, k2, v2 = (x.reshape(b * n, s, d) for x in (q, k, v))
        scores = torch.baddbmm(torch.zeros(b * n, s, s), q2, k2.transpose(1, 2), beta=0.0, alpha=D ** -0.5)
        scores = scores.view(b, n, s, s).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -10000.0)
        return torch.bmm(F.softmax(scores, -1).view(b * n, s, s), v2).view(b, n, s, d)


class EinsumBSHD(nn.Module):  # einsum over (B, S, H, D): the scores' layout is (B, S, H, T)
    def forward(self, q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        scores = torch.einsum("bshd,bthd->bsht", q, k) * D ** -0.5
        scores = scores + _triu_minus_inf(q.shape[1])[:, None, :]
        return torch.einsum("bsht,bthd->bshd", scores.softmax(-1), v).transpose(1, 2)


class LogOfTril(nn.Module):  # the causal mask as log(tril(ones)): exactly 0 / -inf
    def forward(self, q, k, v):
        s = q.shape[2]
        scores = q @ k.transpose(-2, -1) * D ** -0.5 + torch.log(torch.tril(torch.ones(s, s)))
        return scores.softmax(-1) @ v


class LitgptSlidingWindow(nn.Module):  # litgpt model.py: a float band filled row by row
    def forward(self, q, k, v):
        t = q.shape[2]
        mask = torch.full((t, t), float("-inf"))
        for i in range(t):
            mask[i, max(0, i - 3 + 1): i + 1] = 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, t, t), scale=D ** -0.5)


class SoftCapped(nn.Module):  # Gemma 2 (torchtune, litgpt): cap * tanh(scores / cap)
    def forward(self, q, k, v):
        s = q.shape[2]
        scores = torch.tanh(q @ k.transpose(-2, -1) * D ** -0.5 / 50.0) * 50.0
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
        return F.softmax(scores, -1, dtype=torch.float) @ v


class SdpaFloatBias(nn.Module):  # a look-alike: -1 above the diagonal is a bias, not a mask
    def forward(self, q, k, v):
        s = q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.triu(torch.full((s, s), -1.0), 1))


def _mha(queries):
    q, _, _ = _qkv(queries, queries)
    return q, _randn(B, N, queries, D, seed=2).transpose(1, 2).contiguous().transpose(1, 2), _randn(B, N, queries, D, seed=3)


@pytest.mark.parametrize("module, sparse_mode", [
    (DividedBySqrtD, 3), (SdpaFloatCausalMask, 3), (BaddbmmMaskedFill, 3), (EinsumBSHD, 3), (LogOfTril, 3),
    (LitgptSlidingWindow, 0),  # a band: the explicit mask
], ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_other_codebases_attention_fuses_by_what_it_computes(module, sparse_mode, dynamic):
    # dynamic: the masks built from the symbolic length are proven for every size
    # (litgpt's loop specialises the length: it stays static)
    actual, expected, backend = _run(module(), *_mha(6), dynamic=dynamic)
    _close(actual, expected)
    calls = _fused_calls(backend)
    assert len(calls) == 1 and len(_sites(backend)) == 1, near_miss_reasons(backend.report, "attention")
    assert calls[0].kwargs.get("sparse_mode", 0) == sparse_mode
    # causal: the kernel's compressed 2048 x 2048 mask; a band: the model's own, (.., 6, 6)
    mask_shape = tuple(calls[0].kwargs["atten_mask"].meta["val"].shape)
    assert mask_shape == (2048, 2048) if sparse_mode == 3 else mask_shape[-2:] == (6, 6), mask_shape


@pytest.mark.parametrize("module, reason", [
    (SoftCapped, "soft-capped (cap * tanh(s / cap)): npu_fused_infer_attention_score has no soft-cap"),
    (SdpaFloatBias, "it holds [-1.0, 0.0]"),
], ids=["softcap", "float-bias"])
def test_attention_the_op_cannot_compute_is_a_near_miss_naming_why(module, reason):
    actual, expected, backend = _run(module(), *_mha(6))
    torch.testing.assert_close(actual, expected)
    assert _fused_calls(backend) == []
    reasons = near_miss_reasons(backend.report, "attention")
    assert reasons and all(reason in r for r in reasons), reasons
