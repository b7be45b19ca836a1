"""lightning_indexer over an indexer whose top-k values and indices the model reads beyond the attention.

torchtitan-npu's DeepSeek-V3.2 (DSV32_SDPA.forward) spells its indexer `bf16_index` (rearrange to
b h s d, fp32 matmul, relu, times the per-head weights, sum over the heads), adds an additive -inf
causal mask, takes `topk(min(index_topk, S))`, replaces the slots whose key is in the future by
the sentinel S - 1 (`where(index <= position, index, S - 1)`), scatters a mask from them for its
sparse attention, and feeds its indexer loss a softmax of the top-k scores and a gather of the
attention distribution at the indices (DSAIndexerLoss: L1-normalised, kl_div, summed over the slots,
mean). The pass recognises the scores by what they compute (axis algebra), whatever the spelling,
and fuses the top-k into npu_lightning_indexer (return_value=True where the scores are read) once
every reader is proven indifferent to the order of the k slots and to which hidden key a padded
slot lists (the op pads with -1 / -inf; the replacement lists key T - 1, hidden there, with -inf).

Numerics, fp32: the op computes the same fp32 scores with the weights' constants folded into one
multiplication and the products summed in another order (a few ulp of the scores), the loss sums
the same slots in another order: the loss within 64 ulp of its value, the attention output within
16 ulp at its scale (the scale applied once, as in test_sparse_attention_given_mask). With 16
indexer heads a tie at the k-th score (a key zeroed by relu in every head) has probability ~2^-16.
"""

import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import (assert_close_at_scale, compile_and_run, in_subprocess, near_miss_reasons,
                     torchtitan_npu)

CONFIG = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"})
SEQ, TOPK, HEADS, DIM = 12, 5, 16, 16


def _bf16_index(q, weight, k):
    """torchtitan-npu's spelling (model.py bf16_index), einops' rearrange as the permutes it is."""
    query = q.permute(0, 2, 1, 3).to(torch.float32)       # b s h d -> b h s d
    key = k.permute(0, 2, 3, 1).to(torch.float32)         # b s h d -> b h d s
    p = torch.matmul(query, key)
    relu_out = torch.nn.functional.relu(p)
    weight_out = relu_out * weight.permute(0, 2, 1, 3)
    return torch.sum(weight_out, dim=1)


def _scores(spelling, q, k, w):
    """The indexer's scores sum_h w_h * relu(q_h . k) (B, S, T), spelled several ways; the negatives
    compute something else."""
    if spelling == "rearrange":
        return _bf16_index(q, w.unsqueeze(-1), k.unsqueeze(2))
    if spelling == "einsum":
        return torch.einsum("bsht,bsh->bst", torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float())),
                            w.float())
    if spelling == "weights_matmul":  # transformers' spelling: the heads summed by a matmul with the weights
        scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * 0.5)
        return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    if spelling == "no_relu":
        return (torch.einsum("bshd,btd->bsht", q, k) * w[..., None]).sum(2)
    if spelling == "max_heads":
        return (torch.relu(torch.einsum("bshd,btd->bsht", q, k)) * w[..., None]).amax(2)
    raise ValueError(spelling)


class DSAIndexerAttention(torch.nn.Module):
    """DSV32_SDPA.forward's indexer, sparse attention and indexer loss, as torchtitan-npu writes them.

    spelling: the scores' spelling (_scores); reader: "loss" (the model's), "first_slot" (the loss
    reads topk_indices[..., 0] too), "cumsum" (a cumulative sum over the slots), "raw_gather" (the
    loss gathers at the top-k's own indices, before the sentinel: the padded slots' keys reach it),
    "strict" (the sentinel replaces where index < position: the query's own key is replaced too);
    mask: "causal", or "window" (a sliding window: not a mask the op has)."""

    def __init__(self, spelling="rearrange", reader="loss", mask="causal"):
        super().__init__()
        self.spelling, self.reader, self.mask = spelling, reader, mask

    def forward(self, q_idx, k_idx, w, q, k, v):
        bsz, seqlen = q_idx.shape[:2]
        index_score = _scores(self.spelling, q_idx, k_idx, w)
        attn_mask = torch.where(torch.triu(torch.ones((bsz, seqlen, seqlen), dtype=q.dtype), diagonal=1) == 1,
                                float("-inf"), 0.0)
        if self.mask == "window":
            i, j = torch.arange(seqlen).unsqueeze(-1), torch.arange(seqlen).unsqueeze(0)
            attn_mask = torch.where((j <= i) & (j > i - 3), 0.0, float("-inf")).expand(bsz, -1, -1)
        index_score = index_score + attn_mask
        topk_score, topk_indices = index_score.topk(min(TOPK, seqlen), dim=-1)
        raw_indices = topk_indices
        positions = torch.arange(seqlen).unsqueeze(0).unsqueeze(-1)
        valid = topk_indices < positions if self.reader == "strict" else topk_indices <= positions
        topk_indices = torch.where(valid, topk_indices, torch.full_like(topk_indices, seqlen - 1))
        index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter_(-1, topk_indices, 0)
        hidden = attn_mask + index_mask
        hidden = (torch.isinf(hidden) & (hidden < 0)).unsqueeze(1)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, scale=0.25)
        # get_attn_scores + the gather + DSAIndexerLoss.forward
        attn = (q @ k.transpose(-1, -2)) * 0.25
        attn = F.softmax(attn.masked_fill(hidden, float("-inf")), dim=-1, dtype=torch.float32).sum(dim=1)
        gathered_at = raw_indices if self.reader == "raw_gather" else topk_indices
        selected = torch.gather(attn, -1, gathered_at).masked_fill(~valid, 0.0)
        index_prob = F.softmax(topk_score, dim=-1, dtype=torch.float32)
        if self.reader == "cumsum":
            index_prob = index_prob.cumsum(-1)
        selected = F.normalize(selected, p=1, dim=-1)
        loss = F.kl_div((index_prob + 1e-8).log(), selected + 1e-8, reduction="none").sum(dim=-1).mean()
        if self.reader == "first_slot":
            loss = loss + topk_indices[..., 0].float().mean()
        return output, loss


def _inputs(dtype=torch.float32, batch=2, seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_idx = torch.randn(batch, seq, HEADS, DIM, generator=g)
    k_idx = torch.randn(batch, seq, DIM, generator=g)
    w = torch.randn(batch, seq, HEADS, generator=g)
    q = torch.randn(batch, 4, seq, 24, generator=g)
    k = torch.randn(batch, 1, seq, 24, generator=g)
    v = k[..., :16].clone()
    return tuple(t.to(dtype) for t in (q_idx, k_idx, w, q, k, v))


def _check_fused(out, ref, report, ulps_out=16, ulps_loss=64):
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    assert report.counts["sparse_attention"] == 1, report.near_misses
    assert report.fused_ops.get("npu.npu_lightning_indexer") == 1, report.fused_ops
    assert_close_at_scale(out[0], ref[0], ulps_out)
    assert_close_at_scale(out[1], ref[1], ulps_loss)


@pytest.mark.parametrize("spelling", ["rearrange", "einsum", "weights_matmul"])
def test_the_indexer_and_its_loss_fuse_whatever_the_spelling(spelling):
    out, ref, report = compile_and_run(DSAIndexerAttention(spelling), *_inputs(), config=CONFIG)
    _check_fused(out, ref, report)
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert "right-down causal" in site.note, site.note


def test_the_scores_are_asked_for_only_where_they_are_read(tmp_path):
    config = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"}, dump_dir=str(tmp_path))
    compile_and_run(DSAIndexerAttention(), *_inputs(), config=config)
    fused = "".join(p.read_text() for p in tmp_path.glob("*/after.py"))
    assert "npu_lightning_indexer" in fused and "return_value = True" in fused


def test_verification_compares_the_kept_keys_scores():
    # the region and the fused call on random inputs, compared as kept_keys_by_score does: the padded
    # slots list key T - 1 where the model lists other hidden keys, and the slots may come in another order
    config = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"}, verify=True)
    out, ref, report = compile_and_run(DSAIndexerAttention(), *_inputs(seq=7), config=config)
    _check_fused(out, ref, report)
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert site.verified.startswith("verified"), site.verified


def test_under_dynamic_shapes_it_fuses_for_every_size():
    out, ref, report = compile_and_run(DSAIndexerAttention(), *_inputs(), config=CONFIG, dynamic=True)
    _check_fused(out, ref, report)


def test_bf16_fuses_and_the_loss_is_the_models_up_to_the_scores_rounding():
    # the model's scores are fp32 (q and k upcast), the op's too, but it returns them in the query's
    # dtype (bf16: a relative error up to 2^-9 in each top-k score, which the site's note says); the
    # loss's softmax over those moves by about as much (measured: 1.7e-4 relative), the attention
    # output rounds to bf16 in both
    out, ref, report = compile_and_run(DSAIndexerAttention(), *_inputs(torch.bfloat16), config=CONFIG)
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert "returns the top-k scores in bfloat16" in site.note, site.note
    assert (out[0].float() - ref[0].float()).abs().max() <= 1e-2 * ref[0].float().abs().max()
    assert (out[1].float() - ref[1].float()).abs() <= 2 ** -9 * ref[1].float().abs()


@pytest.mark.parametrize("seed", range(4))
def test_the_padded_slots_read_as_the_models_for_short_rows(seed):
    # k = 5 of 12 keys: queries 0..3 see fewer than k keys, where the op pads; a longer k pads more
    module = DSAIndexerAttention()
    out, ref, report = compile_and_run(module, *_inputs(seed=seed, seq=7), config=CONFIG)
    _check_fused(out, ref, report)


@pytest.mark.parametrize("reader, expected", [
    ("first_slot", "select"),
    ("cumsum", "cumsum"),
    ("raw_gather", "a gather at the key indices"),
    ("strict", "not with the query's last visible key"),
])
def test_a_reader_that_sees_the_slot_order_or_the_padded_keys_keeps_it_unfused(reader, expected):
    out, ref, report = compile_and_run(DSAIndexerAttention(reader=reader), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert expected in miss, miss
    torch.testing.assert_close(out, ref)


def test_a_mask_that_is_not_causal_keeps_it_unfused():
    out, ref, report = compile_and_run(DSAIndexerAttention(mask="window"), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "not proven right-down causal or empty" in miss, miss
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("spelling, expected", [
    ("no_relu", None),  # no relu anywhere: not an indexer at all, nothing to report
    ("max_heads", "not a sum over the indexer heads"),
])
def test_scores_that_are_not_the_indexers_keep_it_unfused(spelling, expected):
    out, ref, report = compile_and_run(DSAIndexerAttention(spelling), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    misses = near_miss_reasons(report, "lightning_indexer")
    if expected is None:
        assert not any("npu_lightning_indexer" in m and "fused" in m for m in misses), misses
    else:
        assert any(expected in m for m in misses), misses
    torch.testing.assert_close(out, ref)


def test_the_indices_returned_from_the_graph_keep_it_unfused():
    class Returned(DSAIndexerAttention):
        def forward(self, q_idx, k_idx, w, q, k, v):
            scores = _scores("einsum", q_idx, k_idx, w)
            seqlen = scores.shape[-1]
            scores = scores + torch.where(torch.triu(torch.ones(seqlen, seqlen), diagonal=1) == 1,
                                          float("-inf"), 0.0)
            return scores.topk(TOPK, dim=-1).indices

    out, ref, report = compile_and_run(Returned(), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    assert any("outputs of the graph" in m for m in near_miss_reasons(report, "lightning_indexer"))


def test_training_is_a_near_miss_naming_the_missing_backward():
    inputs = [t.requires_grad_(i == 2) for i, t in enumerate(_inputs())]  # the weights train (the loss)
    model = DSAIndexerAttention()
    backend = nff.get_npu_backend(fusion_config=CONFIG)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out, loss = compiled(*inputs)
    loss.backward()
    report = nff.last_report()
    assert report.counts["lightning_indexer"] == 0
    assert any("in training" in m and "npu_lightning_indexer_grad" in m
               for m in near_miss_reasons(report, "lightning_indexer")), report.near_misses


# ---- torchtitan-npu's own DeepSeek-V3.2, built tiny ----------------------------------------------------
@pytest.mark.parametrize("dtype, dynamic", [("float32", False), ("bfloat16", True)], ids=["fp32", "bf16 dynamic"])
def test_torchtitan_npu_dsv32_indexer_fuses_and_its_loss_is_eagers(dtype, dynamic):
    in_subprocess("test_lightning_indexer_readers", f"dsv32_indexer(torch.{dtype}, {dynamic})")


def dsv32_indexer(dtype, dynamic):
    import importlib

    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v32", dtype=dtype)
    helper = importlib.import_module("torchtitan_npu.models.common.dsa_indexer_loss").DSAIndexerLossLoggingHelper
    torch._dynamo.reset()
    backend = nff.get_npu_backend(fusion_config=nff.FusionConfig())
    compiled = torch.compile(tiny.model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        helper.tracker.clear()
        out = compiled(*tiny.example_inputs)
        losses = helper.tracker["values"].clone()
        helper.tracker.clear()
        ref = tiny.model(*tiny.example_inputs)
        expected = helper.tracker["values"].clone()
    report = nff.last_report()
    assert report.counts["lightning_indexer"] == 2, report.near_misses
    assert report.counts["sparse_attention"] == 2, report.near_misses
    assert expected.abs().min() > 0, expected  # each layer's loss was computed
    if dtype == torch.float32:
        assert_close_at_scale(out, ref, 16)
        # the loss is a sum over the slots of kl terms p * (log p - log q) of order 1 that cancel to about
        # 1e-4: the scores' few-ulp differences move it by a few ulp of those terms, not of the loss
        # (measured 3.7e-9, 0.03 ulp of 1.0)
        assert (losses - expected).abs().max() <= torch.finfo(torch.float32).eps, (losses, expected)
    else:
        assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
        assert ((losses - expected).abs() <= 2e-2 * expected.abs()).all(), (losses, expected)
