"""softmax_l1_norm: the indexer's KL target -> cann_ops_transformer.sparse_flash_mla_softmax_l1_norm.

No third-party model ships DeepSeek-V3.2's indexer loss, so the unfused code is written
here from the published formula (op_semantics.md 10; the V3.2 paper: the main attention
summed over the heads, L1-normalised), as a small MLA training module would write it.

Numerics. The op computes q.k in fp32 from its inputs, exp(s - lse) in fp32, sums over the
heads and divides by G. Against the unfused target:
- fp32 model: only the order of the D = 512 products in each dot product and of the
  softmax's sums differs. An absolute error e in s - lse is a relative error e in
  p = exp(s - lse); with |s|, |lse| < 8 an fp32 rounding of them is at most 2^-21 = 4 ulp
  of p. Measured over all 48 forms: at most 4 ulp (both within 3 ulp of the float64
  target). Allowed: FP32_ULPS = 8.
- bf16 model (its scores rounded to bf16 before the fp32 softmax, as DeepSeek's einsum
  does): the op does not round them. The fused target is within FP32_ULPS of the float64
  target on the same bf16 q and kv (measured: 2.2 ulp). The unfused one is off by the
  model's own rounding delta of s (s and lse each move by <= delta): |fused - unfused| <=
  expm1(2 delta) * p + FP32_ULPS ulp (measured: up to 0.2% relative).
"""
import math

import pytest
import torch

import npu_fx_fusion as nff
from npu_fx_fusion.backend import EmulationBackend
from helpers import assert_within_ulps, compile_and_run, near_miss_reasons, ulp
from npu_fx_fusion.patterns.softmax_l1_norm import SYMBOLIC_SIZES

OP = "cann_ops_transformer.sparse_flash_mla_softmax_l1_norm"
METADATA = "cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata"
ONLY = nff.FusionConfig(enable={"softmax_l1_norm"})
FP32_ULPS = 16

HIDDEN, HEADS, HEAD_DIM = 32, 4, 512  # the op's D = 512: MLA's latent key
B, S1, S2, K = 2, 6, 9, 5  # BSND; S1 != S2, so upper-left and right-down causal differ
CU_Q, CU_K = [0, 5, 11], [0, 7, 15]  # TND: sequences of 5 and 6 queries, 7 and 8 keys
# compressed keys: 5 (BSND) or 7 and 8 (TND) compressed keys of 2 original tokens each, and
# 1 and 0 original tokens not compressed yet
RATIO, RESIDUAL, S2_COMPRESSED = 2, [1, 0], 5


def sequence_positions(cu_seqlens, tokens):
    """Packed (TND) tokens: the sequence of each token and its position in it."""
    t = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens, t, right=True) - 1
    return seq, t - cu_seqlens[seq]


class IndexerTarget(torch.nn.Module):
    """A DeepSeek-V3.2-style MLA attention in training (absorbed: H query heads of dim 512
    over one latent key head), computing the KL target of its lightning indexer: the
    attention probabilities summed over the heads and divided by their number.

    layout "BSND": x (B, S1, hidden), kv_x (B, S2, hidden); "TND": packed x (T1, hidden),
    kv_x (T2, hidden) with cu_seqlens_q / cu_seqlens_k. keys "sparse": each query reads
    the keys at its `indices` (-1: none), as the indexer picked them. mask "causal":
    right-down; "compressed": kv_x are compressed keys, RATIO original tokens each, plus
    `cmp_residual` original tokens per sequence not compressed yet. probs "lse": the
    log-sum-exp of the attention forward is given (B, S1, H) / (T1, H).
    """

    def __init__(self, layout="BSND", keys="dense", mask="causal", probs="softmax", heads="sum_div",
                 dtype=torch.bfloat16, head_dim=HEAD_DIM, num_heads=HEADS, ratio=RATIO, causal_mask=None):
        super().__init__()
        torch.manual_seed(0)
        self.wq = torch.nn.Linear(HIDDEN, num_heads * head_dim, bias=False, dtype=dtype)
        self.wkv = torch.nn.Linear(HIDDEN, head_dim, bias=False, dtype=dtype)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.softmax_scale = head_dim ** -0.5
        self.layout, self.keys, self.mask, self.probs, self.heads = layout, keys, mask, probs, heads
        self.ratio = ratio
        self.causal_mask = causal_mask or (lambda s1, s2, device: torch.ones(
            s1, s2, dtype=torch.bool, device=device).triu(s2 - s1 + 1))
        self.exact = False  # the float64 reference of the same computation (tests only)

    def project(self, x, kv_x):
        return self.wq(x).unflatten(-1, (self.num_heads, self.head_dim)), self.wkv(kv_x)

    def forward(self, x, kv_x, cu_seqlens_q=None, cu_seqlens_k=None, indices=None, lse=None, cmp_residual=None):
        q, kv = self.project(x, kv_x)
        return self.target(q, kv, cu_seqlens_q, cu_seqlens_k, indices, lse, cmp_residual)

    def target(self, q, kv, cu_seqlens_q, cu_seqlens_k, indices, lse, cmp_residual):
        scores = self.masked_scores(q, kv, cu_seqlens_q, cu_seqlens_k, indices, cmp_residual)
        if self.exact:
            scores = scores.double()
            probs = (scores.softmax(dim=-1) if self.probs == "softmax"
                     else torch.exp(scores - lse.double().unsqueeze(-1)))
        else:
            probs = self.probabilities(scores, lse)
        return self.head_mean(probs, 2 if self.layout == "BSND" else 1)

    def probabilities(self, scores, lse):
        if self.probs == "softmax":
            return scores.softmax(dim=-1, dtype=torch.float32)
        return torch.exp(scores.float() - lse.unsqueeze(-1))

    def head_mean(self, probs, head):
        if self.heads == "mean":
            return probs.mean(dim=head)
        return probs.sum(dim=head) / self.num_heads

    def masked_scores(self, q, kv, cu_seqlens_q, cu_seqlens_k, indices, cmp_residual):
        if self.exact:
            q, kv = q.double(), kv.double()
        if self.layout == "BSND":
            return self._bsnd_scores(q, kv, indices, cmp_residual)
        return self._tnd_scores(q, kv, cu_seqlens_q, cu_seqlens_k, indices, cmp_residual)

    def _bsnd_scores(self, q, kv, indices, cmp_residual):
        b, s1, s2 = q.shape[0], q.shape[1], kv.shape[1]
        i = torch.arange(s1, device=q.device)
        if self.mask == "compressed":  # query i sits at original position orig - S1 + i
            position = (s2 * self.ratio + cmp_residual - s1).view(-1, 1, 1) + i.view(-1, 1)
        if self.keys == "sparse":
            batch = torch.arange(b, device=q.device).view(-1, 1, 1)
            scores = torch.einsum("bshd,bskd->bshk", q, kv[batch, indices]) * self.softmax_scale
            hidden = indices < 0
            if self.mask == "causal":
                hidden = hidden | (indices > i.view(-1, 1) + (s2 - s1))
            elif self.mask == "compressed":
                hidden = hidden | ((indices + 1) * self.ratio > position + 1)
            return scores.masked_fill(hidden.unsqueeze(2), float("-inf"))
        scores = torch.einsum("bshd,btd->bsht", q, kv) * self.softmax_scale
        if self.mask == "causal":
            scores = scores.masked_fill(self.causal_mask(s1, s2, q.device).unsqueeze(1), float("-inf"))
        elif self.mask == "compressed":  # compressed key j covers original tokens [j r, (j + 1) r)
            hidden = (torch.arange(s2, device=q.device) + 1) * self.ratio > position + 1
            scores = scores.masked_fill(hidden.unsqueeze(2), float("-inf"))
        return scores

    def _tnd_scores(self, q, kv, cu_q, cu_k, indices, cmp_residual):
        seq_q, pos_q = sequence_positions(cu_q, q.shape[0])
        if self.mask == "causal":  # the last key each query sees
            last = pos_q + (cu_k[1:] - cu_k[:-1] - (cu_q[1:] - cu_q[:-1]))[seq_q]
        elif self.mask == "compressed":  # each query's position in its original sequence
            orig = (cu_k[1:] - cu_k[:-1]) * self.ratio + cmp_residual
            position = pos_q + (orig - (cu_q[1:] - cu_q[:-1]))[seq_q]
        if self.keys == "sparse":
            k = kv[cu_k[seq_q].view(-1, 1) + indices]  # batch-local indices
            scores = torch.einsum("thd,tkd->thk", q, k) * self.softmax_scale
            hidden = indices < 0
            if self.mask == "causal":
                hidden = hidden | (indices > last.view(-1, 1))
            elif self.mask == "compressed":
                hidden = hidden | ((indices + 1) * self.ratio > position.view(-1, 1) + 1)
            return scores.masked_fill(hidden.unsqueeze(1), float("-inf"))
        scores = torch.einsum("thd,sd->ths", q, kv) * self.softmax_scale
        seq_k, pos_k = sequence_positions(cu_k, kv.shape[0])
        hidden = seq_q.view(-1, 1) != seq_k
        if self.mask == "causal":
            hidden = hidden | (pos_k > last.view(-1, 1))
        elif self.mask == "compressed":
            hidden = hidden | ((pos_k + 1) * self.ratio > position.view(-1, 1) + 1)
        return scores.masked_fill(hidden.unsqueeze(1), float("-inf"))

    def attention_lse(self, inputs):
        """The log-sum-exp the attention forward hands over (fp32, from fp32 scores)."""
        x, kv_x, cu_q, cu_k, indices, _, residual = inputs
        q, kv = self.project(x, kv_x)
        with torch.no_grad():
            return torch.logsumexp(self.masked_scores(q.float(), kv.float(), cu_q, cu_k, indices, residual), -1)


def _indices(rows, keys, seed):
    """Indexer-like picks: K distinct keys per row in any order, some slots -1 (also mid-list)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.stack([torch.randperm(keys, generator=g)[:K] for _ in range(math.prod(rows))]).view(*rows, K)
    out[torch.rand(out.shape, generator=g) < 0.2] = -1
    return out.to(torch.int32)


def inputs_for(module, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    cu_q = cu_k = indices = residual = None
    if module.layout == "BSND":
        s2 = S2_COMPRESSED if module.mask == "compressed" else S2
        x, kv_x = torch.randn(B, S1, HIDDEN, generator=g), torch.randn(B, s2, HIDDEN, generator=g)
        if module.keys == "sparse":
            indices = _indices((B, S1), s2, seed)
        if module.mask == "compressed":
            residual = torch.tensor(RESIDUAL, dtype=torch.int32)
    else:
        x, kv_x = torch.randn(CU_Q[-1], HIDDEN, generator=g), torch.randn(CU_K[-1], HIDDEN, generator=g)
        cu_q, cu_k = torch.tensor(CU_Q, dtype=torch.int32), torch.tensor(CU_K, dtype=torch.int32)
        if module.keys == "sparse":  # batch-local: below each query's sequence length
            lens = [CU_K[b + 1] - CU_K[b] for b in range(len(CU_K) - 1)]
            indices = torch.cat([_indices((CU_Q[b + 1] - CU_Q[b],), lens[b], seed + b) for b in range(len(lens))])
        if module.mask == "compressed":
            residual = torch.tensor(RESIDUAL, dtype=torch.int32)
    inputs = [x.to(dtype), kv_x.to(dtype), cu_q, cu_k, indices, None, residual]
    if module.probs == "lse":
        inputs[5] = module.attention_lse(inputs)
    return inputs


def exact_target(module, inputs):
    """The float64 target on the model's own (rounded) q and kv."""
    module.exact = True
    try:
        with torch.no_grad():
            return module(*inputs)
    finally:
        module.exact = False


def hardware_notes(site):
    return [part for part in site.note.split("; ") if part.startswith("on an NPU")]


def _fused_ops(report):
    return report.fused_ops.get(OP, 0), report.fused_ops.get(METADATA, 0)


def score_rounding(module, inputs):
    """The largest error of the model's own scores (its dtype) against float64 ones."""
    x, kv_x, cu_q, cu_k, indices, _, residual = inputs
    with torch.no_grad():
        q, kv = module.project(x, kv_x)
        scores = module.masked_scores(q, kv, cu_q, cu_k, indices, residual).double()
        module.exact = True
        exact = module.masked_scores(q, kv, cu_q, cu_k, indices, residual)
        module.exact = False
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(scores))
    return (scores - exact)[finite].abs().max().item()


def assert_numerics(module, inputs, out, ref):
    """fp32 model: fused and unfused within FP32_ULPS. Half model: the fused target within
    FP32_ULPS of the float64 one, and away from the unfused one by at most the model's own
    rounding of its scores (delta): p = exp(s - lse), s and lse each off by <= delta."""
    exact = exact_target(module, inputs)
    if inputs[0].dtype == torch.float32:
        assert_within_ulps(out, ref, FP32_ULPS)
    else:
        assert_within_ulps(out, exact.float(), FP32_ULPS)
        delta = score_rounding(module, inputs)
        allowed = math.expm1(2 * delta) * exact + FP32_ULPS * ulp(exact.float()).double()
        assert ((out.double() - ref.double()).abs() <= allowed).all()
    return exact


def hardware_notes(site):
    return [part for part in site.note.split("; ") if part.startswith("on an NPU")]


def _fused_ops(report):
    return report.fused_ops.get(OP, 0), report.fused_ops.get(METADATA, 0)


def assert_fires(module, inputs, config=ONLY):
    out, ref, report = compile_and_run(module, *inputs, config=config)
    assert report.counts["softmax_l1_norm"] == 1, near_miss_reasons(report, "softmax_l1_norm")
    assert _fused_ops(report) == (1, 1)  # the metadata op, then the main op
    assert near_miss_reasons(report, "softmax_l1_norm") == []
    assert out.dtype == ref.dtype == torch.float32 and out.shape == ref.shape
    ops = report.graphs[0].ops_after
    assert ops["aten._softmax.default"] == 0 and ops["aten.exp.default"] == 0
    return out, ref, report


def assert_does_not_fire(module, inputs, reason, config=ONLY):
    out, ref, report = compile_and_run(module, *inputs, config=config)
    assert report.counts["softmax_l1_norm"] == 0
    (miss,) = near_miss_reasons(report, "softmax_l1_norm")
    assert reason in miss, miss
    torch.testing.assert_close(out, ref, equal_nan=True)
    return miss


FORMS = [(layout, keys, mask, probs, heads)
         for layout in ("BSND", "TND") for keys in ("dense", "sparse") for mask in ("none", "causal", "compressed")
         for probs in ("softmax", "lse") for heads in ("sum_div", "mean")]


@pytest.mark.parametrize("layout, keys, mask, probs, heads", FORMS, ids=["-".join(f) for f in FORMS])
def test_every_form_fires(layout, keys, mask, probs, heads):
    """bf16, the op's dtype and D = 512: every layout, key set, mask, probability and head mean."""
    module = IndexerTarget(layout, keys, mask, probs, heads)
    inputs = inputs_for(module)
    out, ref, report = assert_fires(module, inputs)
    (site,) = report.sites
    # bf16, D = 512, 4 heads: nothing the hardware refuses; no SoC given, so it says which
    assert hardware_notes(site) == ["on an NPU: the op runs on Ascend950 (950PR/950DT) only"]
    assert_numerics(module, inputs, out, ref)


FP32_FORMS = [(layout, keys, mask, probs, heads)
              for (layout, keys, mask), (probs, heads) in zip(
                  [(layout, keys, mask) for layout in ("BSND", "TND") for keys in ("dense", "sparse")
                   for mask in ("none", "causal", "compressed")],
                  [("softmax", "sum_div"), ("lse", "mean"), ("lse", "sum_div"), ("softmax", "mean")] * 3)]


@pytest.mark.parametrize("layout, keys, mask, probs, heads", FP32_FORMS, ids=["-".join(f) for f in FP32_FORMS])
def test_fp32_models_fuse_in_emulation_and_agree_to_a_few_ulps(layout, keys, mask, probs, heads):
    module = IndexerTarget(layout, keys, mask, probs, heads, dtype=torch.float32)
    inputs = inputs_for(module, dtype=torch.float32)
    out, ref, report = assert_fires(module, inputs)
    # no SoC given: it fuses, and the note says what the hardware would refuse
    assert f"on an NPU: {OP} does not support float32" in report.sites[0].note
    assert_numerics(module, inputs, out, ref)


# ---- spellings of the causal mask: any constant one that is right-down causal ----------
@pytest.mark.parametrize("spelling", [
    lambda s1, s2, device: torch.ones(s1, s2, dtype=torch.bool, device=device).triu(s2 - s1 + 1),
    lambda s1, s2, device: ~torch.ones(s1, s2, dtype=torch.bool, device=device).tril(s2 - s1),
    lambda s1, s2, device: (torch.arange(s2, device=device).view(1, -1)
                            > torch.arange(s1, device=device).view(-1, 1) + (s2 - s1)),
], ids=["triu", "not tril", "arange"])
def test_a_causal_mask_fires_however_it_is_spelled(spelling):
    module = IndexerTarget("BSND", "dense", "causal", "lse", "sum_div", causal_mask=spelling)
    inputs = inputs_for(module)
    out, ref, _ = assert_fires(module, inputs)
    assert_numerics(module, inputs, out, ref)


def test_upper_left_causal_is_right_down_when_there_are_as_many_queries_as_keys():
    upper_left = lambda s1, s2, device: torch.ones(s1, s2, dtype=torch.bool, device=device).triu(1)  # noqa: E731
    module = IndexerTarget("BSND", "dense", "causal", "softmax", "mean", causal_mask=upper_left)
    x, kv_x, *rest = inputs_for(module)
    assert_fires(module, [x, x, *rest])  # S1 == S2 (self-attention)


def test_rows_without_a_key_stay_nan_as_in_the_models_softmax():
    # more queries than keys: right-down causal hides every key from the first S1 - S2 rows;
    # the model's softmax gives 0/0 there, the op 0, the replacement adds back the NaN
    module = IndexerTarget("BSND", "dense", "causal", "softmax", "sum_div")
    x, kv_x, *rest = inputs_for(module)
    out, ref, _ = assert_fires(module, [x, kv_x[:, :4], *rest])
    assert ref[:, :S1 - 4].isnan().all() and not ref[:, S1 - 4:].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=0.01, atol=1e-6)


def test_scalars_come_from_the_model():
    # a softmax scale and a compression ratio other than the pass's example values
    module = IndexerTarget("TND", "dense", "compressed", "lse", "sum_div", ratio=3)
    module.softmax_scale = 0.07
    inputs = inputs_for(module)
    inputs[6] = torch.tensor([2, 0], dtype=torch.int32)
    inputs[5] = module.attention_lse(inputs)
    out, ref, _ = assert_fires(module, inputs)
    assert_numerics(module, inputs, out, ref)


# ---- SoC and torchair mode ---------------------------------------------------------------
def test_on_ascend950_a_site_within_the_limits_fuses_without_hardware_notes():
    module = IndexerTarget("BSND", "sparse", "causal", "lse", "sum_div")
    _, _, report = assert_fires(module, inputs_for(module),
                                config=nff.FusionConfig(enable={"softmax_l1_norm"}, soc="Ascend950"))
    assert hardware_notes(report.sites[0]) == []


@pytest.mark.parametrize("soc, dtype, head_dim, heads, reason", [
    ("Ascend910B", torch.bfloat16, HEAD_DIM, HEADS, f"{OP} is not available on Ascend910B"),
    ("Ascend910_93", torch.bfloat16, HEAD_DIM, HEADS, f"{OP} is not available on Ascend910_93"),
    ("Ascend950", torch.float32, HEAD_DIM, HEADS, f"{OP} does not support float32 on Ascend950"),
    ("Ascend950", torch.bfloat16, 64, HEADS, "head dim 64, the kernel takes 512"),
    ("Ascend950", torch.float16, HEAD_DIM, 129, "129 query heads, the kernel takes at most 128"),
], ids=["910B", "910_93", "950 fp32", "950 head dim 64", "950 129 heads"])
def test_with_a_soc_given_its_limits_are_kept_and_reported(soc, dtype, head_dim, heads, reason):
    module = IndexerTarget("BSND", "dense", "causal", "softmax", "sum_div", dtype=dtype, head_dim=head_dim,
                           num_heads=heads)
    assert_does_not_fire(module, inputs_for(module, dtype=dtype), reason,
                         config=nff.FusionConfig(enable={"softmax_l1_norm"}, soc=soc))


def test_without_a_soc_the_note_lists_what_the_hardware_would_refuse():
    module = IndexerTarget("TND", "sparse", "none", "softmax", "mean", head_dim=64, num_heads=129)
    _, _, report = assert_fires(module, inputs_for(module))
    note = report.sites[0].note
    for said in ("on an NPU: the op runs on Ascend950 (950PR/950DT) only",
                 "on an NPU: head dim 64, the kernel takes 512",
                 "on an NPU: 129 query heads, the kernel takes at most 128",
                 f"{OP} has no GE converter in torchair 2.13, so max-autotune cannot lower it",
                 f"{METADATA} has no GE converter"):
        assert said in note, note


def test_max_autotune_does_not_fuse_ops_without_a_ge_converter():
    module = IndexerTarget("BSND", "dense", "none", "lse", "mean")
    assert_does_not_fire(module, inputs_for(module),
                         "has no GE converter in torchair 2.13, so max-autotune cannot lower it",
                         config=nff.FusionConfig(enable={"softmax_l1_norm"}, mode="max-autotune"))


def test_reduce_overhead_fuses():
    module = IndexerTarget("BSND", "dense", "none", "lse", "mean")
    _, _, report = assert_fires(module, inputs_for(module),
                                config=nff.FusionConfig(enable={"softmax_l1_norm"}, mode="reduce-overhead"))
    assert "GE converter" not in report.sites[0].note


# ---- not fused, with the reason ---------------------------------------------------------
class HeadSumOnly(IndexerTarget):
    def head_mean(self, probs, head):
        return probs.sum(dim=head)


class HeadSumOverTwiceTheHeads(IndexerTarget):
    def head_mean(self, probs, head):
        return probs.sum(dim=head) / (2 * self.num_heads)


class SoftmaxOverHeads(IndexerTarget):
    def probabilities(self, scores, lse):
        return scores.softmax(dim=2, dtype=torch.float32)


class L1NormalisedExp(IndexerTarget):
    def head_mean(self, probs, head):
        total = probs.sum(dim=head)
        return total / total.sum(dim=-1, keepdim=True)


class AlsoAttends(IndexerTarget):
    """The probabilities also make the attention output (probs @ kv): they are needed."""

    def forward(self, x, kv_x, *rest):
        q, kv = self.project(x, kv_x)
        scores = self.masked_scores(q, kv, *rest[:3], rest[4])
        probs = self.probabilities(scores, None)
        return self.head_mean(probs, 2), torch.einsum("bsht,btd->bshd", probs.to(kv.dtype), kv)


class MaskFromOutside(IndexerTarget):
    """The mask comes in as an input (an attention_mask argument)."""

    def forward(self, x, kv_x, mask):
        q, kv = self.project(x, kv_x)
        scores = torch.einsum("bshd,btd->bsht", q, kv) * self.softmax_scale
        return self.head_mean(self.probabilities(scores.masked_fill(mask.unsqueeze(1), float("-inf")), None), 2)


class NegativeSlotsNotMasked(IndexerTarget):
    """Sparse keys whose -1 slots are not masked (only the causal test on the index)."""

    def _bsnd_scores(self, q, kv, indices, cmp_residual):
        batch = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1)
        scores = torch.einsum("bshd,bskd->bshk", q, kv[batch, indices]) * self.softmax_scale
        hidden = indices > torch.arange(q.shape[1]).view(-1, 1) + (kv.shape[1] - q.shape[1])
        return scores.masked_fill(hidden.unsqueeze(2), float("-inf"))


class HeadsBeforeQueries(IndexerTarget):
    """Eager attention's layout: scores (B, H, S1, S2), the head sum over dim 1."""

    def forward(self, x, kv_x, *rest):
        q, kv = self.project(x, kv_x)
        scores = torch.einsum("bhsd,btd->bhst", q.transpose(1, 2), kv) * self.softmax_scale
        hidden = self.causal_mask(q.shape[1], kv.shape[1], q.device)
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1, dtype=torch.float32)
        return probs.sum(dim=1) / self.num_heads


def _upper_left(s1, s2, device):
    return torch.ones(s1, s2, dtype=torch.bool, device=device).triu(1)


@pytest.mark.parametrize("module, reason", [
    (HeadSumOnly("BSND", "dense", "causal", "softmax"), "the sum over the 4 heads is not divided by their number"),
    (HeadSumOnly("TND", "sparse", "causal", "lse"), "the sum over the 4 heads is not divided by their number"),
    (HeadSumOverTwiceTheHeads("BSND", "dense", "causal", "softmax"),
     "the sum over the 4 heads is divided by 8, not by their number"),
    (IndexerTarget("BSND", "dense", "causal", "softmax", causal_mask=_upper_left),
     "the mask is upper-left causal (query i sees keys j <= i) over 6 queries and 9 keys: "
     f"{OP}'s mask_mode 3 is right-down causal (j <= i + 3)"),
    (SoftmaxOverHeads("BSND", "dense", "causal", "softmax"),
     "the softmax is over dim 2 of a 4-d tensor, not over the keys"),
    (L1NormalisedExp("BSND", "dense", "none", "lse"), "normalised by a tensor"),
    (AlsoAttends("BSND", "dense", "causal", "softmax"), "are also used by"),
    (NegativeSlotsNotMasked("BSND", "sparse", "causal", "lse"),
     "the mask does not hide the negative (no key, -1) indices"),
    (HeadsBeforeQueries("BSND", "dense", "causal", "softmax"),
     "the sum is over dim 1 of the 4-d probabilities [2, 4, 6, 9], not the one next to the keys"),
], ids=["sum only", "TND sum only", "sum / 2G", "upper-left causal", "softmax over heads", "L1-normalised exp",
        "probabilities also attend", "-1 slots not masked", "(B, H, S1, S2) layout"])
def test_does_not_fire_and_says_why(module, reason):
    assert_does_not_fire(module, inputs_for(module), reason)


def test_a_mask_from_outside_cannot_be_proven_causal():
    module = MaskFromOutside("BSND", "dense", "causal", "softmax")
    x, kv_x, *_ = inputs_for(module)
    assert_does_not_fire(module, [x, kv_x, _upper_left(S1, S2, None)], "the mask is computed from graph inputs")


class Upcast(IndexerTarget):
    """q and kv upcast to fp32 before the product: the scores are fp32 in a bf16 model."""

    def masked_scores(self, q, kv, *rest):
        return super().masked_scores(q.float(), kv.float(), *rest)


def test_a_model_that_upcasts_q_and_kv_fuses_in_emulation_but_not_on_ascend950():
    module = Upcast("BSND", "dense", "causal", "softmax", "sum_div")
    inputs = inputs_for(module)
    out, ref, report = assert_fires(module, inputs)  # the op gets the fp32 q and kv: exact
    assert_within_ulps(out, ref, FP32_ULPS)
    assert_does_not_fire(module, inputs, "does not support float32 on Ascend950 (the model upcasts bfloat16 q and kv",
                         config=nff.FusionConfig(enable={"softmax_l1_norm"}, soc="Ascend950"))


# ---- training -------------------------------------------------------------------------------
class TrainingStep(IndexerTarget):
    """The target of detached q and kv (a constant of the indexer's loss), next to a loss
    that trains the projections."""

    def forward(self, x, kv_x, *rest):
        q, kv = self.project(x, kv_x)
        target = self.target(q.detach(), kv.detach(), *rest)
        return target, q.float().square().mean() + kv.float().square().mean()


def test_in_training_the_detached_target_fuses():
    module = TrainingStep("BSND", "sparse", "causal", "softmax", "mean", dtype=torch.float32)
    inputs = inputs_for(module, dtype=torch.float32)
    (out, loss), (ref, ref_loss), report = compile_and_run(module, *inputs, config=ONLY, grad=True)
    assert report.counts["softmax_l1_norm"] == 1 and not out.requires_grad
    assert_within_ulps(out, ref, FP32_ULPS)
    loss.backward()
    assert module.wq.weight.grad is not None


def test_a_target_that_requires_grad_does_not_fuse():
    module = IndexerTarget("BSND", "dense", "causal", "lse", "sum_div", dtype=torch.float32)
    out, _, report = compile_and_run(module, *inputs_for(module, dtype=torch.float32), config=ONLY, grad=True)
    assert report.counts["softmax_l1_norm"] == 0 and out.requires_grad
    (miss,) = near_miss_reasons(report, "softmax_l1_norm")
    assert "saved for the backward (the target requires grad), and" in miss and "has no backward" in miss, miss


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_symbolic_sizes_are_reported_not_fused(mask):
    # the forms match with symbolic sizes; the check refuses them before anything else
    module = IndexerTarget("BSND", "dense", mask, "lse", "mean", dtype=torch.float32)
    inputs = inputs_for(module, dtype=torch.float32)
    backend = EmulationBackend(ONLY)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=backend, dynamic=True)(*inputs), module(*inputs))
    assert backend.report.counts["softmax_l1_norm"] == 0
    assert near_miss_reasons(backend.report, "softmax_l1_norm") == [SYMBOLIC_SIZES]
    assert SYMBOLIC_SIZES.startswith("the attention has symbolic sizes (dynamic shapes): the metadata op takes")


# ---- verification --------------------------------------------------------------------------
VERIFY = nff.FusionConfig(enable={"softmax_l1_norm"}, verify=True)


@pytest.mark.parametrize("form", [("BSND", "dense", "causal", "softmax", "sum_div"),
                                  ("BSND", "sparse", "none", "lse", "mean"),
                                  ("TND", "dense", "compressed", "lse", "mean"),
                                  ("TND", "sparse", "causal", "softmax", "mean")], ids="-".join)
def test_verify_accepts_fp32_sites(form):
    module = IndexerTarget(*form, dtype=torch.float32)
    _, _, report = assert_fires(module, inputs_for(module, dtype=torch.float32), config=VERIFY)
    assert report.sites[0].verified.startswith("verified"), report.sites[0].verified


def test_verify_turns_down_sites_whose_model_rounds_its_scores():
    # bf16 scores: the model's rounding is ~1e4 fp32 ulps, beyond verify's 4-ulp tolerance
    module = IndexerTarget("BSND", "dense", "causal", "softmax", "sum_div")
    miss = assert_does_not_fire(module, inputs_for(module), "verification failed", config=VERIFY)
    assert "exceeds 4 ulp (float32)" in miss, miss
