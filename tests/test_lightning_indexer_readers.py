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

In training (the indexer loss's gradient reaches the indexer's q, k and weights) the top-k region and the
backward autograd made of it are replaced jointly: npu_lightning_indexer(return_value=True) in the forward
graph, npu_lightning_indexer_grad in the backward, once the backward is proven to need only the values'
gradient, to read the slots in no order, and (behind an additive mask) to give the padded slots none.

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
from helpers import (RecordingBackend, assert_close_at_scale, compile_and_run, in_subprocess, near_miss_reasons,
                     npu_ops, torchtitan_npu)

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
    in training also "where_sum" (the loss adds the visible slots' scores: a gradient in the padded
    slots that only a where zeroes), "slot_weighted_grad" (an autograd.Function, the identity forward,
    whose backward weighs each slot's gradient by its position), "scores_too" (the loss reads the
    indexer's scores before the top-k as well);
    mask: "causal", "fill" (causal, spelled masked_fill: the model's hidden keys get no gradient),
    "finfo_fill" / "finfo_causal" (causal, hiding with finfo.min written or added), "fill_1e9" (hiding
    with -1e9, which a score can rank below), or "window" (a sliding window: not a mask the op has); detach: the attention distribution from
    detached q and k (torchtitan-npu's get_attn_scores)."""

    def __init__(self, spelling="rearrange", reader="loss", mask="causal", detach=False):
        super().__init__()
        self.spelling, self.reader, self.mask, self.detach = spelling, reader, mask, detach

    def forward(self, q_idx, k_idx, w, q, k, v):
        bsz, seqlen = q_idx.shape[:2]
        index_score = scores = _scores(self.spelling, q_idx, k_idx, w)
        attn_mask = torch.where(torch.triu(torch.ones((bsz, seqlen, seqlen), dtype=q.dtype), diagonal=1) == 1,
                                float("-inf"), 0.0)
        if self.mask == "window":
            i, j = torch.arange(seqlen).unsqueeze(-1), torch.arange(seqlen).unsqueeze(0)
            attn_mask = torch.where((j <= i) & (j > i - 3), 0.0, float("-inf")).expand(bsz, -1, -1)
        if self.mask in ("fill", "finfo_fill", "fill_1e9"):
            fill = {"fill": float("-inf"), "finfo_fill": torch.finfo(index_score.dtype).min, "fill_1e9": -1e9}
            index_score = index_score.masked_fill(torch.isinf(attn_mask), fill[self.mask])
        elif self.mask == "finfo_causal":  # an additive finfo.min mask, as torchtitan-npu's V4 writes its own
            index_score = index_score + torch.where(torch.isinf(attn_mask), torch.finfo(index_score.dtype).min, 0.0)
        else:
            index_score = index_score + attn_mask
        topk_score, topk_indices = index_score.topk(min(TOPK, seqlen), dim=-1)
        if self.reader == "slot_weighted_grad":
            topk_score = _SlotWeightedGradient.apply(topk_score)
        raw_indices = topk_indices
        positions = torch.arange(seqlen).unsqueeze(0).unsqueeze(-1)
        valid = topk_indices < positions if self.reader == "strict" else topk_indices <= positions
        topk_indices = torch.where(valid, topk_indices, torch.full_like(topk_indices, seqlen - 1))
        index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter_(-1, topk_indices, 0)
        hidden = attn_mask + index_mask
        hidden = (torch.isinf(hidden) & (hidden < 0)).unsqueeze(1)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, scale=0.25)
        # get_attn_scores + the gather + DSAIndexerLoss.forward
        attn = (q.detach() @ k.detach().transpose(-1, -2) if self.detach else q @ k.transpose(-1, -2)) * 0.25
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
        if self.reader == "where_sum":
            loss = loss + torch.where(valid, topk_score, 0.0).sum() * 1e-3
        if self.reader == "scores_too":
            loss = loss + scores.mean() * 1e-3
        return output, loss


class _SlotWeightedGradient(torch.autograd.Function):
    """The identity, whose backward weighs each top-k slot's gradient by the slot's position: a reader
    whose forward is indifferent to the slot order and whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.arange(1, grad.shape[-1] + 1, dtype=grad.dtype)


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


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mask", ["finfo_fill", "finfo_causal"])
def test_a_finfo_min_fill_hides_keys_as_minus_inf_does(mask, dynamic):
    # every score ranks above f <= -2**127 (written, or added: score + f is f below 2**103); the padded
    # slots' values are given f back, so the loss's softmax over the slots is the model's
    out, ref, report = compile_and_run(DSAIndexerAttention(mask=mask), *_inputs(seq=7), config=CONFIG,
                                       dynamic=dynamic)
    _check_fused(out, ref, report)
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert "the model's hidden keys score -3.40282e+38" in site.note, site.note


@pytest.mark.parametrize("mask, expected", [
    ("window", "not proven right-down causal or empty"),
    ("fill_1e9", "masked with -1000000000.0, not -inf or a fill <= -2**127"),  # a score can rank below it
])
def test_a_mask_the_op_does_not_have_keeps_it_unfused(mask, expected):
    out, ref, report = compile_and_run(DSAIndexerAttention(mask=mask), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert expected in miss, miss
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


# ---- training: the indexer's scores get a gradient (the indexer loss) ------------------------------------------
# The joint replacement: npu_lightning_indexer(return_value=True) in the forward, npu_lightning_indexer_grad
# (its autograd) in the backward, for the top-k region and the backward autograd made of it.
#
# Tolerance: the op sums the heads and the products in another order and applies the scale to the weights
# (the forward's scores a few ulp apart, measured above); the loss's gradient of the values is a difference of
# softmax terms (p - target) that amplifies those relatively, and each input's gradient is then a sum over
# the k slots (and, for the keys, over the queries) of such terms. 32 fp32 ulp of each gradient's largest
# element (assert_close_at_scale; measured <= 13 at these inputs, <= 18.4 over seeds 1-5 at S = 7 and 12; against
# eager in float64 the fused gradients are 20 ulp off where eager in fp32 is 7), and 32 for the outputs.
TRAIN_ULPS = 32


def _train(module, inputs, config=CONFIG, dynamic=None, trained=(0, 1, 2, 3, 4, 5)):
    """One compiled and one eager training step of `module` (the attention output against a fixed probe, plus
    the indexer loss); every input's gradient compared. Returns the backend (its report and graphs)."""
    torch._dynamo.reset()
    fused_in = [t.detach().clone().requires_grad_(i in trained) for i, t in enumerate(inputs)]
    eager_in = [t.detach().clone().requires_grad_(i in trained) for i, t in enumerate(inputs)]
    backend = RecordingBackend(config)
    out, loss = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(*fused_in)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    ((out * probe).sum() + loss).backward()
    out_ref, loss_ref = module(*eager_in)
    ((out_ref * probe).sum() + loss_ref).backward()
    assert backend.report.errors == []
    assert_close_at_scale(out, out_ref, TRAIN_ULPS)
    assert_close_at_scale(loss, loss_ref, 64)  # (the loss within 64 ulp, as in inference)
    for i, (a, b) in enumerate(zip(fused_in, eager_in)):
        assert (a.grad is None) == (b.grad is None), i
        if a.grad is not None:
            try:
                assert_close_at_scale(a.grad, b.grad, TRAIN_ULPS)
            except AssertionError as exc:
                raise AssertionError(f"input {i}: {exc}") from None
    return backend


def _assert_trained_fused(backend, attention=1):
    report = backend.report
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    forward, backward = npu_ops(backend.graphs["forward"]), npu_ops(backend.graphs["backward"])
    assert forward.get("npu_lightning_indexer") == 1 and backward.get("npu_lightning_indexer_grad") == 1, \
        (forward, backward)
    assert forward.get("npu_sparse_flash_attention", 0) == attention, forward
    (indexer,) = [n for n in backend.graphs["forward"].graph.nodes
                  if n.op == "call_function" and str(n.target) == "npu.npu_lightning_indexer.default"]
    assert indexer.kwargs["return_value"] is True
    joint = next(g for g in report.graphs if g.name == "joint")
    (site,) = [s for r in joint.passes if r.pass_name == "lightning_indexer" for s in r.sites]
    assert "in training: the top-k values' gradient reaches query, key and weights" in site.note, site.note
    return site


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mask", ["causal", "fill", "finfo_causal", "finfo_fill"])
def test_a_training_step_fuses_the_indexer_and_its_backward(mask, dynamic):
    # every input trains: the indexer's q, k and weights through the op's backward, the attention's
    # through npu_sparse_flash_attention_grad and the loss's gather of the attention distribution
    module = DSAIndexerAttention(mask=mask)
    site = _assert_trained_fused(_train(module, _inputs(seq=7), dynamic=dynamic))
    # behind the additive mask the values' gradient must be proven 0 in the padded slots (k = 5 of 7
    # keys: queries 0..3 see fewer than k keys); a masked_fill zeroes the hidden keys' gradient itself
    assert ("softmax's over the slots, 0 in the padded slots" in site.note) == (mask in ("causal", "finfo_causal")), site.note
    assert "in max-autotune: training: npu.npu_lightning_indexer_grad has no GE converter" in site.note


def test_a_training_step_fuses_on_the_cpu_graph_too():
    # without NPU dispatch kl_div's backward is aten's formula: the loss's gradient negated and expanded from
    # (B, S, 1), constant along the slots, times the per-slot target (the survey's training step runs so)
    config = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"}, npu_dispatch=False)
    _assert_trained_fused(_train(DSAIndexerAttention(detach=True), _inputs(seq=7), config=config))


def test_verification_of_a_trained_site_compares_its_forward():
    # verify=True runs the recognised region and the fused call (its forward: values and indices, as
    # kept_scores compares them) on random inputs; the backward is not verified for a recognised site
    config = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"}, verify=True)
    site = _assert_trained_fused(_train(DSAIndexerAttention(), _inputs(seq=7), config=config))
    assert site.verified.startswith("verified"), site.verified


@pytest.mark.parametrize("spelling", ["einsum", "weights_matmul"])
def test_the_scale_folded_into_the_weights_gets_its_gradient(spelling):
    # weights_matmul scales the products by 0.5 inside the relu: the replacement's weights * 0.5, which
    # autograd differentiates (the weights' gradient gets the factor, as the model's does); torchtitan-npu's
    # detached attention distribution, and only the indexer's weights train (its q and k frozen)
    backend = _train(DSAIndexerAttention(spelling, detach=True), _inputs(), trained=(2, 3, 4, 5))
    _assert_trained_fused(backend)


def test_a_padded_slots_gradient_only_a_where_zeroes_is_a_near_miss_behind_an_additive_mask():
    # behind an additive -inf mask the model's top-k passes the padded slots' gradient on to the hidden
    # keys it lists there; where(valid, scores, 0) zeroes it, but only a softmax's backward is proven to
    backend = _train(DSAIndexerAttention(reader="where_sum"), _inputs(seq=7))
    assert backend.report.counts["lightning_indexer"] == 0
    # (and, once partitioned, the forward graph's: the pass runs there again, where the values are saved)
    misses = near_miss_reasons(backend.report, "lightning_indexer")
    assert any("behind an additive -inf mask" in m and "is not proven 0 where their value is -inf" in m
               for m in misses), misses
    # with the mask spelled masked_fill, the model's own backward zeroes the hidden keys' gradient: it fuses
    _assert_trained_fused(_train(DSAIndexerAttention(reader="where_sum", mask="fill"), _inputs(seq=7)))


@pytest.mark.parametrize("reader, expected", [
    ("slot_weighted_grad", "varies along the k slots"),
    ("scores_too", "is read outside it: its gradient would come from there too"),
])
def test_a_backward_the_op_does_not_compute_keeps_it_unfused(reader, expected):
    # slot_weighted_grad: the forward reads the values as the loss does, the backward by slot position;
    # scores_too: the scores before the top-k get a gradient from another consumer too
    backend = _train(DSAIndexerAttention(reader=reader), _inputs(seq=7))
    assert backend.report.counts["lightning_indexer"] == 0
    misses = near_miss_reasons(backend.report, "lightning_indexer")
    assert any(expected in m for m in misses), misses
    assert "npu_lightning_indexer_grad" not in npu_ops(backend.graphs["backward"])


def test_max_autotune_refuses_the_trained_indexer():
    # torchair's GE graph mode lowers neither the grad op (no GE converter) nor return_value (Ascend950 only)
    config = nff.FusionConfig(enable={"sparse_attention", "attention", "lightning_indexer"}, mode="max-autotune")
    backend = _train(DSAIndexerAttention(), _inputs(seq=7), config=config)
    assert backend.report.counts["lightning_indexer"] == 0
    misses = near_miss_reasons(backend.report, "lightning_indexer")
    assert any(m.startswith("training: npu.npu_lightning_indexer_grad has no GE converter") for m in misses), misses


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


# torchtitan-npu's DeepSeek-V3.2 trains its indexer through DSAIndexerLoss (its gradient seeded by
# DSAIndexerLossAutoScaler's backward, ones_like: from no tangent). Tolerance: 64 fp32 ulp of each gradient's
# largest element, as for the two-layer model in test_training_dsa.py: the indexer's scores a few ulp apart
# (above), amplified by the loss's softmax gradient and carried through wq_b, wk, k_norm and weights_proj
# (measured <= 42, the indexer's k_norm bias; every other parameter <= 8).
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torchtitan_npu_dsv32_indexer_trains_fused_with_eagers_gradients(dynamic):
    in_subprocess("test_lightning_indexer_readers", f"dsv32_indexer_training({dynamic})")


def dsv32_indexer_training(dynamic):
    import copy

    from npu_fx_fusion.backend import EmulationBackend

    class AllGraphs(EmulationBackend):  # every graph compiled, by phase (a graph break makes several)
        def __init__(self, config):
            super().__init__(config)
            self.graphs = []

        def _compile(self, phase, gm, example_inputs):
            compiled = super()._compile(phase, gm, example_inputs)
            self.graphs.append((phase, gm))
            return compiled

    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v32", dtype=torch.float32)
    model = tiny.model.train()
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    backend = AllGraphs(nff.FusionConfig())
    out = torch.compile(model, backend=backend, dynamic=dynamic)(*tiny.example_inputs)
    out.float().pow(2).mean().backward()
    out_ref = reference(*tiny.example_inputs)
    out_ref.float().pow(2).mean().backward()
    report = backend.report
    assert report.errors == []
    assert report.counts["lightning_indexer"] == 2, report.near_misses
    assert near_miss_reasons(report, "lightning_indexer") == []
    indexers = [n for phase, gm in backend.graphs if phase == "forward" for n in gm.graph.nodes
                if n.op == "call_function" and str(n.target) == "npu.npu_lightning_indexer.default"]
    assert len(indexers) == 2 and all(n.kwargs["return_value"] is True for n in indexers)
    grads = sum(npu_ops(gm).get("npu_lightning_indexer_grad", 0) for phase, gm in backend.graphs
                if phase == "backward")
    assert grads == 2
    assert report.fused_ops["npu.npu_sparse_flash_attention_grad"] == 2, report.fused_ops
    assert_close_at_scale(out, out_ref, 16)
    trained = 0
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p.grad is not None:
            trained += "indexer" in name
            try:
                assert_close_at_scale(p.grad, p_ref.grad, 64)
            except AssertionError as exc:
                raise AssertionError(f"{name}.grad: {exc}") from None
    assert trained == 10  # wq_b, wk, k_norm (weight, bias) and weights_proj of both layers' indexers


class FewerKeysIndexer(torch.nn.Module):
    """An indexer over T < S keys under the right-down causal mask, hiding with an additive finfo.min:
    queries i < S - T see no key, and their top-k lists hidden keys only, all scoring finfo.min."""

    def forward(self, q_idx, k_idx, w):
        queries, keys = q_idx.shape[1], k_idx.shape[1]
        scores = _scores("einsum", q_idx, k_idx, w)
        last_visible = torch.arange(queries).unsqueeze(-1) + (keys - queries)
        scores = scores + torch.where(torch.arange(keys) > last_visible, torch.finfo(scores.dtype).min, 0.0)
        values = scores.topk(3, dim=-1).values
        return F.softmax(values, dim=-1, dtype=torch.float32).square().sum(-1).mean()


def _fewer_keys_inputs():
    q_idx, k_idx, w = _inputs(seq=7)[:3]
    return q_idx, k_idx[:, :4].clone(), w


def test_a_finfo_min_fill_over_fewer_keys_than_queries_fuses_in_inference():
    # a query that sees no key: the model's values are all finfo.min, and so are the op's padded slots
    out, ref, report = compile_and_run(FewerKeysIndexer(), *_fewer_keys_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    assert_close_at_scale(out, ref, 16)


def test_a_finfo_min_fill_over_fewer_keys_than_queries_trains_fused():
    # a query that sees no key has a uniform softmax over its slots: the backward of any reader indifferent
    # to the slot order is the same in every slot there, and the softmax's backward of a constant is 0 (up
    # to the rounding of the probabilities' sum): the hidden keys' scores get no gradient, as the op's
    # padded slots get none
    inputs = [t.requires_grad_() for t in _fewer_keys_inputs()]
    backend = RecordingBackend(CONFIG)
    torch._dynamo.reset()
    torch.compile(FewerKeysIndexer(), backend=backend, fullgraph=True)(*inputs).backward()
    assert backend.report.counts["lightning_indexer"] == 1, backend.report.near_misses
    assert npu_ops(backend.graphs["backward"]).get("npu_lightning_indexer_grad") == 1
    expected = [t.detach().clone().requires_grad_() for t in inputs]
    FewerKeysIndexer()(*expected).backward()
    for got, want in zip(inputs, expected):
        assert_close_at_scale(got.grad, want.grad, TRAIN_ULPS)
