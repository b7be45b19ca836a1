"""sparse_mla: DeepSeek-V4's attention with sinks over sliding + compressed keys ->
cann_ops_transformer.sparse_flash_mla (+ its _metadata; the CSA indexer -> lightning_indexer).

transformers' DeepseekV4Attention (modeling_deepseek_v4.py L812-882) with its only attention,
eager_attention_forward (L727): one KV head that is also the value, repeated to the H query
heads; a per-head learnable sink logit in the softmax's denominator; the keys are the S
tokens under a sliding window, then (CSA / HCA layers) the layer's compressed keys:

    w = q @ k^T * scaling + mask;  p = softmax(cat([w, sink]))[..., :-1];  out = (p @ v)^T

    SWA  mask = the sliding-window causal mask                        (no compressed keys)
    HCA  mask = cat(sliding, block_bias): compressed key w is visible to query t iff
         w < (t + 1) // m (DeepseekV4HCACompressor's masked_fill, m = compress_rate)
    CSA  mask = cat(sliding, block_bias): only the blocks the lightning indexer chose
         (DeepseekV4CSACompressor's new_full(-inf).scatter_(indices, 0)); the indexer
         scores sum_h w_h relu(q_h . k_w) * index_scale, masks w >= (t + 1) // m, keeps the
         top-k and writes -1 for the picks past the threshold (DeepseekV4Indexer)

sparse_flash_mla computes exactly that (npu_ops/attention.py, the COT golden): ori_kv the S
keys under its band mask (ori_mask_mode 4, ori_win_left 127 / ori_win_right 0: a 128-key
window incl. the query), cmp_kv the compressed keys under the compressed causal mask
(cmp_mask_mode 3: visible w < (S - S + t + 1) // cmp_ratio with S = T * m + cmp_residual_kv),
CSA with cmp_sparse_indices (read up to the first -1), and the sinks. So each layer kind is
one form, and everything the op is told is proven from the graph at compile time:

  - the sliding part of the mask is evaluated (it depends on no input) and must be the
    128-key window, the only one the kernel has (constants.band_mask_reason); transformers
    builds it with finfo.min, which hides exactly as -inf does;
  - m and (CSA) k, index_scale, weights_scale and scaling are captured scalars;
  - the positions the thresholds are computed from must be 0..S-1 (a prefill), and
    T = S // m (transformers drops the remainder S - T*m, which is cmp_residual_kv);
  - CSA: the indexer's picks are sorted (topk's default) over scores masked to -inf past the
    threshold, so its -1 slots are trailing, as the kernel reads them; the block bias only
    tests membership, so the fused indexer's order of equally-scored picks does not matter.

The CSA form therefore spans the indexer too: its threshold is shared by the indexer's
mask and its -1 rewrite, so indexer and attention are one site, and become
cann_ops_transformer.lightning_indexer (mask_mode 3 with cmp_ratio and cmp_residual_k: the
compressed causal mask torch_npu's npu_lightning_indexer cannot express) feeding
sparse_flash_mla. The indexer's scale goes into its weights (relu(s x) = s relu(x), s > 0).

torchtitan-npu's own V4 (its SparseAttention.forward) writes the same attention over an index
list: the keys are cat([window, compressed + S]) with -1 slots sent to a padding lane S + T of a
finfo(bf16).min mask that scatter opens at the listed keys and [..., :-1] drops. Its forms
(torchtitan_v4_*) prove every key set by value or by its producers (docs/passes/sparse_mla.md):
the sliding / HCA masks are constants, evaluated against the band and w < (t + 1) // m; CSA's
window indices are evaluated, its compressed ones must be where(k >= (t + 1) // m, -1, k + S) of a
top-k's indices over the T blocks; the op then reads the model's own indices (re-based, -1 last).
cmp_ratio is S // T, proven to be the model's m.

Under dynamic shapes (symbolic S, B) torchtitan-npu's forms are proven for every size
(_symbolic_torchtitan_reason): each index list / mask computed from sizes only is a formula of its
indices and the size symbols (symbolic_values, scatter included), and the band, the thresholds
w < (t + 1) // m, the padding lane S + T (a symbolic scalar the check proves: symbolic_scalars) and
T = S // m are decided for all of them; sizes are compared by proofs, so an accepted site guards
nothing. Only the convention without metadata (A2 / A3) fuses then: sparse_flash_mla_metadata takes
the batch and sequence lengths as int attributes (METADATA_LIMIT). transformers' forms keep SYMBOLIC
(their mask and position proofs evaluate at static sizes).

Layouts: transformers keeps q as (B, H, S, D); the op takes BSND, and returns what
transformers returns after its `transpose(1, 2).contiguous()`. Kernel limits the tiny
models miss (D 512, H in {1, 2, ..., 128}, bf16 / fp16, A2/A3's m in {1, 4, 128} and CSA
top-k of 512 / 1024, the indexer's head dim 128, the indexer metadata's 32 / 64 heads) are
notes in emulation and refusals with a SoC (Site.hardware_limits). A limit of one SoC family
names it ("compress ratio 8: on A2/A3 sparse_flash_mla takes (1, 4, 128)"): with a SoC, that
SoC's limits; in emulation, those of A2/A3 and of Ascend950 alike.

Metadata: 950 needs the _metadata op's tiling, A2 / A3 take none (COT docs): one
replacement per convention, chosen by SoC (in emulation: with metadata).

Training: the extension has no autograd for sparse_flash_mla; SparseFlashMla below asks
for its lse and calls sparse_flash_mla_grad (dq, dori_kv, dcmp_kv, dsinks). The indexer has
no gradient (it selects). In transformers' training graphs the output gradient reaches the
bmm backward through a view (the inverse RoPE hands back a (B, H, S, D)-contiguous gradient)
where the traced joint pattern copies (clone + _unsafe_view, spelled clone + view:
canonical.gradient_copies_apart); the engine's joint-graph canonicalisation
(canonical.normalize_joint_graph) spells both alike, so the joint forms match
(tests/test_sparse_mla.py trains SWA, HCA and CSA through sparse_flash_mla_grad).
"""
import operator

import sympy
import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

from npu_fx_fusion.constants import arange_positions_reason, band_mask_reason, evaluate_constant, hides
from npu_fx_fusion.matching import (Form, FusionPass, formula_of, index_list_members, index_symbol, is_call, known_equal,
                                    never, records_gradient, size_expr, tensor_meta)

aten = torch.ops.aten
cot = torch.ops.cann_ops_transformer
SMLA = CAPABILITIES["cann_ops_transformer.sparse_flash_mla"]
INDEXER = CAPABILITIES["cann_ops_transformer.lightning_indexer"]
WINDOW = SMLA.limits["ori_win_left"][0] + 1  # the kernel's only window: 127 keys back and the query


# ---- the unfused forms, as transformers writes them -------------------------------------------
def _repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def _eager_attention_with_sinks(query, kv, sinks, attention_mask, scaling):
    # deepseek_v4 eager_attention_forward (dropout 0, eval) with key = value = kv
    heads = query.shape[1]
    key_states = _repeat_kv(kv, heads)
    value_states = _repeat_kv(kv, heads)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]
    attn_weights = F.dropout(scores, p=0.0, training=False).to(value_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous()


def deepseek_v4_sliding_attention(query, kv, sinks, sliding_mask, scaling):
    return _eager_attention_with_sinks(query, kv, sinks, sliding_mask, scaling)


def deepseek_v4_hca_attention(query, kv, compressed_kv, sinks, sliding_mask, position_ids, compress_rate, scaling):
    # DeepseekV4HCACompressor's block bias, then DeepseekV4Attention's concatenations
    batch, seq_len, compressed_len = query.shape[0], query.shape[2], compressed_kv.shape[2]
    entry_indices = torch.arange(compressed_len, device=compressed_kv.device)
    causal_threshold = (position_ids + 1) // compress_rate
    block_bias = compressed_kv.new_zeros((batch, 1, seq_len, compressed_len))
    block_bias = block_bias.masked_fill(
        entry_indices.view(1, 1, 1, -1) >= causal_threshold.unsqueeze(1).unsqueeze(-1), float("-inf"))
    keys = torch.cat([kv, compressed_kv], dim=2)
    attention_mask = torch.cat([sliding_mask, block_bias.to(sliding_mask.dtype)], dim=-1)
    return _eager_attention_with_sinks(query, keys, sinks, attention_mask, scaling)


def deepseek_v4_csa_attention(query, kv, compressed_kv, sinks, sliding_mask, index_query, index_keys,
                              index_weights, position_ids, compress_rate, index_topk, index_scale,
                              weights_scale, scaling):
    # DeepseekV4IndexerScorer on the indexer's rotated queries (B, S, Hi, Di), its compressed keys
    # (B, T, Di) and weights_proj's output (B, S, Hi)
    scores = torch.matmul(index_query.float(), index_keys.transpose(-1, -2).float().unsqueeze(1))
    scores = F.relu(scores) * index_scale
    weights = index_weights.float() * weights_scale
    index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
    # DeepseekV4Indexer's causal selection
    causal_threshold = (position_ids + 1) // compress_rate
    entry_indices = torch.arange(index_keys.shape[1], device=index_scores.device)
    future_mask = entry_indices.view(1, 1, -1) >= causal_threshold.unsqueeze(-1)
    index_scores = index_scores.masked_fill(future_mask, float("-inf"))
    top_k_indices = index_scores.topk(index_topk, dim=-1).indices
    invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
    top_k_indices = torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)
    # DeepseekV4CSACompressor's block bias
    batch, seq_len, compressed_len = query.shape[0], query.shape[2], compressed_kv.shape[2]
    valid = top_k_indices >= 0
    safe_indices = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, compressed_len))
    block_bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
    block_bias = block_bias.scatter(-1, safe_indices.unsqueeze(1), 0.0)[..., :compressed_len]
    keys = torch.cat([kv, compressed_kv], dim=2)
    attention_mask = torch.cat([sliding_mask, block_bias.to(sliding_mask.dtype)], dim=-1)
    return _eager_attention_with_sinks(query, keys, sinks, attention_mask, scaling)


# ---- the unfused forms, as torchtitan-npu writes them (its SparseAttention.forward) ------------
# One key head (B, S, D), also the value, broadcast to the H query heads by the matmul; the keys
# a query sees are an index list: the window (from aranges), then (CSA / HCA) compressed blocks
# offset by S; -1 slots go to a padding lane S + T that the mask drops. Under bf16 autocast the
# fp32 sinks are concatenated to the bf16 logits: torch_npu's autocast lists leave that cat to
# promote them itself (an NPU graph, and the emulation's), CPU's cast the logits first
# (cast_logits: the same values); the probabilities are cast back for P @ V in both.
def _torchtitan_attention(q, kv_states, sinks, index_mask, scaling, cast_logits):
    query_states = q.transpose(1, 2)
    kv_states = kv_states.unsqueeze(1)
    attn_weights = torch.matmul(query_states, kv_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + index_mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(query_states.shape[0], -1, query_states.shape[-2], -1)
    logits = attn_weights.to(sinks.dtype) if cast_logits else attn_weights
    combined_logits = torch.cat([logits, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits.float(), dim=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]
    attn_output = torch.matmul(scores.to(kv_states.dtype), kv_states)
    return attn_output.transpose(1, 2).contiguous()


def _torchtitan_searches(cast_logits):
    def sliding(q, ori_kv, sinks, window_mask, scaling):
        # the window's index mask is an argument: its value is proven by evaluating it
        return _torchtitan_attention(q, ori_kv, sinks, window_mask, scaling, cast_logits)

    def compressed(q, ori_kv, cmp_kv, sinks, index_mask, scaling):
        # HCA: window + every compressed block before the query's threshold, all from aranges, so
        # the whole (window, compressed) index mask is a compile-time constant, evaluated
        return _torchtitan_attention(q, torch.cat([ori_kv, cmp_kv], dim=1), sinks, index_mask, scaling, cast_logits)

    def indexed(q, ori_kv, cmp_kv, sinks, window_idx, compressed_idx, padding_lane, fill, scaling):
        # CSA: the compressed blocks are the lightning indexer's top-k (compressed_idx: -1 or
        # block + S, proven from its producer by the check); the index mask is spelled out
        batch, seq_len = q.shape[0], q.shape[1]
        kv_states = torch.cat([ori_kv, cmp_kv], dim=1)
        topk_idxs = torch.cat([window_idx, compressed_idx], dim=-1).int()
        topk_idxs = topk_idxs.masked_fill(topk_idxs < 0, padding_lane)
        index_mask = torch.full((batch, 1, seq_len, kv_states.shape[1] + 1), fill, dtype=torch.bfloat16,
                                device=q.device).scatter(-1, topk_idxs.unsqueeze(1), 0)
        return _torchtitan_attention(q, kv_states, sinks, index_mask[..., :-1], scaling, cast_logits)

    suffix = "_logits_cast" if cast_logits else ""
    for fn, kind in ((sliding, "sliding"), (compressed, "compressed"), (indexed, "indexed")):
        fn.__name__ = fn.__qualname__ = f"torchtitan_v4_{kind}_attention{suffix}"
    return sliding, compressed, indexed


_TT_SEARCHES = (_torchtitan_searches(False), _torchtitan_searches(True))
_TT_SLIDING = frozenset(searches[0] for searches in _TT_SEARCHES)
_TT_COMPRESSED = frozenset(searches[1] for searches in _TT_SEARCHES)
_TORCHTITAN = frozenset(search for searches in _TT_SEARCHES for search in searches)


# ---- the fused calls -------------------------------------------------------------------------
class SparseFlashMla(torch.autograd.Function):
    """sparse_flash_mla with the backward the extension leaves to its callers (torchtitan-npu's
    npu_smla): the forward keeps its lse, the backward calls sparse_flash_mla_grad (with its own
    _grad_metadata where the forward had metadata). capabilities.py: the op's autograd_rule.
    forward(q (B, S, H, D), ori_kv (B, S, 1, D), cmp_kv or None, cmp_sparse_indices or None,
    sinks (H,) fp32, metadata or None, options: the op's scalar keywords) -> (B, S, H, D)."""

    @staticmethod
    def forward(ctx, q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, cmp_residual_kv, metadata, options):
        out, lse = cot.sparse_flash_mla(q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices,
                                        cmp_residual_kv=cmp_residual_kv, sinks=sinks, metadata=metadata,
                                        return_softmax_lse=True, **options)
        ctx.save_for_backward(q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, cmp_residual_kv, out, lse)
        ctx.options, ctx.with_metadata = options, metadata is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, cmp_residual_kv, out, lse = ctx.saved_tensors
        o = ctx.options
        metadata = None
        if ctx.with_metadata:
            metadata = cot.sparse_flash_mla_grad_metadata(
                q.shape[2], 1, q.shape[3], cmp_residual_kv=cmp_residual_kv, batch_size=q.shape[0],
                max_seqlen_q=q.shape[1], max_seqlen_ori_kv=ori_kv.shape[1],
                max_seqlen_cmp_kv=cmp_kv.shape[1] if cmp_kv is not None else 0,
                cmp_topk=cmp_sparse_indices.shape[-1] if cmp_sparse_indices is not None else 0,
                cmp_ratio=o["cmp_ratio"], ori_mask_mode=o["ori_mask_mode"], cmp_mask_mode=o["cmp_mask_mode"],
                ori_win_left=o["ori_win_left"], ori_win_right=o["ori_win_right"], layout_q="BSND",
                layout_kv="BSND", has_ori_kv=True, has_cmp_kv=cmp_kv is not None)
        dq, dori, dcmp, dsinks, _, _ = cot.sparse_flash_mla_grad(
            q, dout.contiguous(), out, lse, ori_kv, cmp_kv, None, cmp_sparse_indices, None, None, None, None, None,
            None, cmp_residual_kv, None, None, sinks, metadata, o["softmax_scale"], o["cmp_ratio"],
            o["ori_mask_mode"], o["cmp_mask_mode"], o["ori_win_left"], o["ori_win_right"], "BSND", "BSND")
        return dq, dori, (dcmp if cmp_kv is not None else None), None, dsinks, None, None, None


def _sparse_flash_mla(query, kv, compressed_kv, sinks, scaling, cmp_ratio, indices, with_metadata):
    """(B, H, S, D) query, (B, 1, S, D) kv, (B, 1, T, D) compressed kv or None, int32 (B, S, 1, K)
    indices or None -> (B, S, H, D), the op in BSND."""
    batch, heads, seq_len, dim = query.shape
    q = query.transpose(1, 2).contiguous()
    ori_kv = kv.transpose(1, 2)
    cmp_kv = compressed_kv.transpose(1, 2) if compressed_kv is not None else None
    residual = None
    if cmp_kv is not None:  # transformers drops the last S - T*m tokens from the compression
        residual = torch.full((batch,), seq_len - cmp_kv.shape[1] * cmp_ratio, dtype=torch.int32,
                              device=query.device)
    options = dict(softmax_scale=scaling, cmp_ratio=cmp_ratio, ori_mask_mode=4, cmp_mask_mode=3,
                   ori_win_left=WINDOW - 1, ori_win_right=0, layout_q="BSND", layout_kv="BSND")
    metadata = None
    if with_metadata:
        metadata = cot.sparse_flash_mla_metadata(
            heads, 1, dim, cmp_residual_kv=residual, batch_size=batch, max_seqlen_q=seq_len,
            max_seqlen_ori_kv=seq_len, max_seqlen_cmp_kv=cmp_kv.shape[1] if cmp_kv is not None else 0,
            cmp_topk=indices.shape[-1] if indices is not None else 0, cmp_ratio=cmp_ratio, ori_mask_mode=4,
            cmp_mask_mode=3, ori_win_left=WINDOW - 1, ori_win_right=0, layout_q="BSND", layout_kv="BSND",
            has_ori_kv=True, has_cmp_kv=cmp_kv is not None)
    sinks = sinks.float()
    if records_gradient(query, kv, compressed_kv, sinks):  # the forward returns its lse for the grad op
        return SparseFlashMla.apply(q, ori_kv, cmp_kv, indices, sinks, residual, metadata, options)
    out, _ = cot.sparse_flash_mla(q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=indices,
                                  cmp_residual_kv=residual, sinks=sinks, metadata=metadata, **options)
    return out


def _lightning_indexer(index_query, index_keys, index_weights, compress_rate, index_topk, index_scale,
                       weights_scale, with_metadata):
    """The fused indexer: int32 (B, S, 1, k) picks, -1 past the visible blocks."""
    batch, seq_len, heads, dim = index_query.shape
    compressed_len = index_keys.shape[1]
    residual = torch.full((batch,), seq_len - compressed_len * compress_rate, dtype=torch.int32,
                          device=index_query.device)
    weights = index_weights.float() * (weights_scale * index_scale)  # relu(s x) = s relu(x), s > 0
    metadata = None
    if with_metadata:
        metadata = cot.lightning_indexer_metadata(
            heads, 1, dim, index_topk, cmp_residual_k=residual, batch_size=batch, max_seqlen_q=seq_len,
            max_seqlen_k=compressed_len, layout_q="BSND", layout_k="BSND", mask_mode=3, cmp_ratio=compress_rate)
    indices, _ = cot.lightning_indexer(index_query, index_keys.unsqueeze(2), weights, index_topk,
                                       cmp_residual_k=residual, metadata=metadata, layout_q="BSND",
                                       layout_k="BSND", mask_mode=3, cmp_ratio=compress_rate)
    return indices


def _replacements(with_metadata):
    suffix = "with_metadata" if with_metadata else "without_metadata"

    def sliding(query, kv, sinks, sliding_mask, scaling):
        return _sparse_flash_mla(query, kv, None, sinks, scaling, 1, None, with_metadata)

    def hca(query, kv, compressed_kv, sinks, sliding_mask, position_ids, compress_rate, scaling):
        return _sparse_flash_mla(query, kv, compressed_kv, sinks, scaling, compress_rate, None, with_metadata)

    def csa(query, kv, compressed_kv, sinks, sliding_mask, index_query, index_keys, index_weights, position_ids,
            compress_rate, index_topk, index_scale, weights_scale, scaling):
        indices = _lightning_indexer(index_query, index_keys, index_weights, compress_rate, index_topk,
                                     index_scale, weights_scale, with_metadata)
        return _sparse_flash_mla(query, kv, compressed_kv, sinks, scaling, compress_rate, indices, with_metadata)

    for fn, kind in ((sliding, "swa"), (hca, "hca"), (csa, "csa_with_lightning_indexer")):
        fn.__name__ = f"sparse_flash_mla_{kind}_{suffix}"
    return sliding, hca, csa


def _compress_ratio(seq_len, blocks):
    """The op's cmp_ratio, an int: S // T, which the checks prove is the model's m
    (torchtitan-npu requires S % m == 0). With symbolic sizes S // T is a SymInt, which an int
    attribute would specialise (a guard pinning the compile to this size): m is then read at
    this compile's sizes and taken only where the shape environment proves T = S // m for every
    size, a proof that adds no guard (the check proved the same: _symbolic_torchtitan_reason)."""
    if isinstance(seq_len, int) and isinstance(blocks, int):
        return seq_len // blocks
    ratio = optimization_hint(seq_len) // optimization_hint(blocks)
    if ratio < 1 or not statically_known_true(blocks == seq_len // ratio):
        raise RuntimeError(f"{blocks} compressed keys for {seq_len} tokens: not S // m for one m at every size")
    return ratio


def _torchtitan_smla(q, ori_kv, cmp_kv, sinks, scaling, indices, with_metadata):
    """(B, S, H, D) q, (B, S, D) keys, (B, T, D) compressed keys or None: the ratio is S // T,
    which the checks prove is the m of the model's thresholds (torchtitan-npu requires S % m == 0)."""
    ratio = 1 if cmp_kv is None else _compress_ratio(q.shape[1], cmp_kv.shape[1])
    return _sparse_flash_mla(q.transpose(1, 2), ori_kv.unsqueeze(1), None if cmp_kv is None else cmp_kv.unsqueeze(1),
                             sinks, scaling, ratio, indices, with_metadata)


def _cmp_sparse_indices(compressed_idx, seq_len):
    """The model's compressed index list (-1 or block + S; the check proves every listed block is
    below the query's threshold, listed once: a top-k's indices) as the op's: block ids, -1 last
    (the kernel reads up to the first -1; the model's mask only tests membership, so the order is free)."""
    blocks = torch.where(compressed_idx < 0, -1, compressed_idx - seq_len)
    return blocks.sort(dim=-1, descending=True).values.to(torch.int32).unsqueeze(2)


def _torchtitan_replacements(with_metadata):
    suffix = "with_metadata" if with_metadata else "without_metadata"

    def sliding(q, ori_kv, sinks, window_mask, scaling):
        return _torchtitan_smla(q, ori_kv, None, sinks, scaling, None, with_metadata)

    def compressed(q, ori_kv, cmp_kv, sinks, index_mask, scaling):
        return _torchtitan_smla(q, ori_kv, cmp_kv, sinks, scaling, None, with_metadata)

    def indexed(q, ori_kv, cmp_kv, sinks, window_idx, compressed_idx, padding_lane, fill, scaling):
        indices = _cmp_sparse_indices(compressed_idx, q.shape[1])
        return _torchtitan_smla(q, ori_kv, cmp_kv, sinks, scaling, indices, with_metadata)

    for fn, kind in ((sliding, "swa"), (compressed, "hca"), (indexed, "csa")):
        fn.__name__ = f"sparse_flash_mla_torchtitan_{kind}_{suffix}"
    return sliding, compressed, indexed


_WITH, _WITHOUT = _replacements(True), _replacements(False)
_TRAINABLE = {"swa": (("query", "kv", "sinks"),), "compressed": (("query", "kv", "compressed_kv", "sinks"),)}
_TT_WITH, _TT_WITHOUT = _torchtitan_replacements(True), _torchtitan_replacements(False)
_TT_TRAINABLE = {"swa": (("q", "ori_kv", "sinks"),), "compressed": (("q", "ori_kv", "cmp_kv", "sinks"),)}
_SMLA_OP = dict(fused_op="cann_ops_transformer.sparse_flash_mla")

FORMS = [
    # the largest first (each contains the eager attention the SWA form is); per kind the
    # 950 convention (metadata) first, A2/A3's (none) where the SoC says so
    Form(deepseek_v4_csa_attention, _WITH[2], grad_subsets=_TRAINABLE["compressed"], **_SMLA_OP),
    Form(deepseek_v4_csa_attention, _WITHOUT[2], grad_subsets=_TRAINABLE["compressed"], **_SMLA_OP),
    Form(deepseek_v4_hca_attention, _WITH[1], grad_subsets=_TRAINABLE["compressed"], **_SMLA_OP),
    Form(deepseek_v4_hca_attention, _WITHOUT[1], grad_subsets=_TRAINABLE["compressed"], **_SMLA_OP),
    Form(deepseek_v4_sliding_attention, _WITH[0], grad_subsets=_TRAINABLE["swa"], **_SMLA_OP),
    Form(deepseek_v4_sliding_attention, _WITHOUT[0], grad_subsets=_TRAINABLE["swa"], **_SMLA_OP),
    # torchtitan-npu's SparseAttention: the indexed (CSA) form first, then the compressed one
    # (whose mask argument would also bind CSA's, refused there as not a constant), then the
    # sliding one (whose keys argument would bind the compressed layers' cat, refused as S + T keys)
    *(Form(searches[kind], replacements[kind], grad_subsets=_TT_TRAINABLE["swa" if kind == 0 else "compressed"],
           **_SMLA_OP)
      for kind in (2, 1, 0) for searches in _TT_SEARCHES for replacements in (_TT_WITH, _TT_WITHOUT)),
]
_WITH_METADATA = frozenset(_WITH) | frozenset(_TT_WITH)


# ---- checks -------------------------------------------------------------------------------
def _metadata_reason(site):
    """950 needs metadata, A2 / A3 take none; in emulation the metadata forms serve."""
    with_metadata = site.form.replace in _WITH_METADATA
    wanted = SMLA.limits["metadata"].get(site.soc, "required") if site.soc else "required"
    if with_metadata and wanted == "none":
        return f"on {site.soc} sparse_flash_mla takes no metadata"
    if not with_metadata and wanted == "required":
        return f"on {site.soc or 'Ascend950 (emulation)'} sparse_flash_mla needs its metadata"
    return None


def _attention_reason(site):
    query, kv, sinks = site["query"], site["kv"], site["sinks"]
    if _symbolic(query):
        return SYMBOLIC
    if query.dim() != 4 or kv.dim() != 4:
        return f"query {list(query.shape)} / kv {list(kv.shape)} are not (B, H, S, D) / (B, 1, S, D)"
    batch, heads, seq_len, dim = query.shape
    if tuple(kv.shape) != (batch, 1, seq_len, dim):
        return f"kv {list(kv.shape)} is not one (key = value) head of the {seq_len} queries' tokens"
    if tuple(sinks.shape) != (heads,):
        return f"sinks {list(sinks.shape)}: the op takes one per query head ({heads})"
    if site["scaling"] <= 0:
        return f"scaling {site['scaling']} <= 0"
    if kv.dtype != query.dtype or ("compressed_kv" in site.args and site["compressed_kv"].dtype != query.dtype):
        return "query, kv and compressed kv differ in dtype: the op takes one"
    mask = site["sliding_mask"]
    if mask.shape[-2:] != (seq_len, seq_len):
        return f"the sliding mask {list(mask.shape)} does not cover the {seq_len} tokens' keys"
    return band_mask_reason(site.arg_nodes["sliding_mask"], WINDOW)


def _compressed_reason(site):
    """The compressed keys' mask conditions: prefill positions, T = S // m."""
    query, compressed = site["query"], site["compressed_kv"]
    ratio = site["compress_rate"]
    seq_len = query.shape[2]
    if compressed.dim() != 4 or compressed.shape[1] != 1 or compressed.shape[0] != query.shape[0]:
        return f"compressed kv {list(compressed.shape)} is not (B, 1, T, D)"
    if ratio < 1 or compressed.shape[2] != seq_len // ratio or compressed.shape[2] == 0:
        return (f"{compressed.shape[2]} compressed keys for {seq_len} tokens at ratio {ratio}: the op's "
                "residual S - T * ratio must lie in [0, ratio)")
    return arange_positions_reason(site.arg_nodes["position_ids"])


def _soc_families(site):
    """The SoCs whose kernel limits a site is checked against, each with the name its notes give
    it: the site's SoC, or in emulation (no SoC) both families, each note naming the one it is of."""
    if site.soc is not None:
        return [(site.soc, site.soc == "Ascend950")]
    return [("A2/A3", False), ("Ascend950", True)]


def _hardware_reasons(site, indices_width=None, heads_dim_ratio=None):
    """sparse_flash_mla's limits (capabilities.py's row): those of every SoC as "<what>: <op>
    takes <limit>", those of one SoC family as "<what>: on <SoC> <op> takes <limit>" (COT
    docs/zh/sparse_flash_mla.md, 规格约束: 950 takes no single query head; A2/A3 take the compress
    ratios 1 / 4 / 128 and CSA top-k 512 / 1024 only)."""
    if heads_dim_ratio is None:  # transformers' forms: (B, H, S, D) query, compress_rate captured
        query = site["query"]
        heads, dim, ratio = query.shape[1], query.shape[3], site.args.get("compress_rate", 1)
    else:
        query = site["q"]
        heads, dim, ratio = heads_dim_ratio
    limits = SMLA.limits
    reasons = [
        unsupported(SMLA.op, site.soc, x=query),
        f"head dim {dim}: sparse_flash_mla takes {limits['head_dim']}" if dim != limits["head_dim"] else None,
    ]
    for soc, is_950 in _soc_families(site):
        heads_ok = limits["query_heads_950"] if is_950 else limits["query_heads"]
        reasons.append(f"{heads} query heads: on {soc} sparse_flash_mla takes {heads_ok}"
                       if heads not in heads_ok else None)
        if is_950:
            reasons.append(f"compress ratio {ratio}: on {soc} sparse_flash_mla takes 1..{limits['max_cmp_ratio']}"
                           if not 1 <= ratio <= limits["max_cmp_ratio"] else None)
            continue
        reasons.append(f"compress ratio {ratio}: on {soc} sparse_flash_mla takes {limits['cmp_ratios_a2_a3']}"
                       if ratio not in limits["cmp_ratios_a2_a3"] else None)
        if indices_width is not None:
            reasons.append(f"top-{indices_width} compressed blocks: on {soc} sparse_flash_mla takes "
                           f"{limits['csa_topk_a2_a3']}" if indices_width not in limits["csa_topk_a2_a3"] else None)
    return reasons


def _indexer_reasons(site):
    """lightning_indexer's limits (COT docs/zh/lightning_indexer.md; aclnnLightningIndexer.md):
    the op takes up to 64 query heads of 128; its metadata op only 32 or 64 heads, a limit of
    the forms that call it, where the SoC takes metadata (_metadata_reason: 950, and emulation)."""
    iq = site["index_query"]
    limits = INDEXER.limits
    heads, dim = iq.shape[2], iq.shape[3]
    count = site["index_topk"]
    # (a metadata form on a SoC that takes none is refused by _metadata_reason, not by this)
    with_metadata = site.form.replace in _WITH_METADATA and _metadata_reason(site) is None
    return [
        unsupported(INDEXER.op, site.soc, x=iq),
        f"indexer head dim {dim}: lightning_indexer takes {limits['head_dim']}" if dim != limits["head_dim"] else None,
        f"{heads} indexer heads: lightning_indexer takes 1..{limits['max_query_heads']}"
        if not 1 <= heads <= limits["max_query_heads"] else None,
        f"{heads} indexer heads: on {site.soc or 'Ascend950'} lightning_indexer_metadata takes "
        f"{limits['metadata_query_heads']}" if with_metadata and heads not in limits["metadata_query_heads"] else None,
        f"index top-k {count}: lightning_indexer takes 1..{limits['max_topk']} or one of {limits['large_topks']}"
        if count > limits["max_topk"] and count not in limits["large_topks"] else None,
    ]


def _indexer_shape_reason(site):
    query, iq, ik, iw = site["query"], site["index_query"], site["index_keys"], site["index_weights"]
    batch, _, seq_len, _ = query.shape
    if iq.dim() != 4 or tuple(iq.shape[:2]) != (batch, seq_len) or ik.dim() != 3 or ik.shape[-1] != iq.shape[-1] \
            or tuple(iw.shape) != tuple(iq.shape[:3]):
        return (f"indexer query {list(iq.shape)}, keys {list(ik.shape)}, weights {list(iw.shape)} are not "
                "(B, S, Hi, Di), (B, T, Di), (B, S, Hi)")
    if ik.shape[1] != site["compressed_kv"].shape[2]:
        return f"the indexer compresses to {ik.shape[1]} blocks, the attention to {site['compressed_kv'].shape[2]}"
    if site["index_scale"] <= 0:
        return f"index scale {site['index_scale']} <= 0: relu(s x) is not s relu(x)"
    if not 0 < site["index_topk"] <= ik.shape[1]:
        return f"top-{site['index_topk']} of {ik.shape[1]} blocks"
    return None


def check(site):
    # the metadata convention last: a site refused by the kernel's limits is reported with
    # them, not with the convention of the form that happened to be tried first
    if site.form.search in _TORCHTITAN:
        return _torchtitan_reason(site) or _metadata_reason(site) or _symbolic_metadata_reason(site)
    return _site_reason(site) or _metadata_reason(site)


# ---- checks of torchtitan-npu's forms ----------------------------------------------------------
def _torchtitan_reason(site):
    q, kv, sinks = site["q"], site["ori_kv"], site["sinks"]
    cmp = site.args.get("cmp_kv")
    if _symbolic(q) or _symbolic(kv) or _symbolic(cmp):
        return _symbolic_torchtitan_reason(site)
    if q.dim() != 4 or kv.dim() != 3:
        return f"q {list(q.shape)} / kv {list(kv.shape)} are not (B, S, H, D) / (B, S, D)"
    batch, seq_len, heads, dim = q.shape
    if tuple(kv.shape) != (batch, seq_len, dim):
        return f"kv {list(kv.shape)} is not one (key = value) head of the {seq_len} queries' tokens"
    if tuple(sinks.shape) != (heads,):
        return f"sinks {list(sinks.shape)}: the op takes one per query head ({heads})"
    if site["scaling"] <= 0:
        return f"scaling {site['scaling']} <= 0"
    if kv.dtype != q.dtype or (cmp is not None and cmp.dtype != q.dtype):
        return "q, kv and compressed kv differ in dtype: the op takes one"
    if cmp is None:
        return (_index_mask_reason(site.arg_nodes["window_mask"], seq_len, 0, 1)
                or site.hardware_limits(_hardware_reasons(site, None, (heads, dim, 1))))
    if cmp.dim() != 3 or tuple(cmp.shape) != (batch, cmp.shape[1], dim) or cmp.shape[1] == 0:
        return f"compressed kv {list(cmp.shape)} is not (B, T, D)"
    blocks = cmp.shape[1]
    ratio = seq_len // blocks  # the replacement's cmp_ratio: the check proves it is the model's m
    if seq_len // ratio != blocks:
        return (f"{blocks} compressed keys for {seq_len} tokens: no ratio m with T = S // m and S // T = m "
                "(the op's cmp_ratio is taken as S // T)")
    if site.form.search in _TT_COMPRESSED:
        return (_index_mask_reason(site.arg_nodes["index_mask"], seq_len, blocks, ratio)
                or site.hardware_limits(_hardware_reasons(site, None, (heads, dim, ratio))))
    reason, width = _index_list_reason(site, seq_len, blocks, ratio)
    if reason is None and width is None:  # HCA's constant list: the compressed form fuses it
        return (site.hardware_limits(_hardware_reasons(site, None, (heads, dim, ratio))) or _metadata_reason(site)
                or "the compressed indices are a compile-time constant (HCA): the compressed form, whose op call "
                   "takes no indices, fuses the site")
    return reason or site.hardware_limits(_hardware_reasons(site, width, (heads, dim, ratio)))


# ---- torchtitan-npu's forms under dynamic shapes: the same facts, proven for every size ----------
# sparse_flash_mla_metadata's schema takes batch_size and max_seqlen_q / _ori_kv / _cmp_kv as int?
# attributes: a symbolic size there would be specialised, the compile pinned to one size
METADATA_LIMIT = ("symbolic sizes (dynamic shapes): sparse_flash_mla_metadata takes batch_size and max_seqlen_q / "
                  "max_seqlen_ori_kv / max_seqlen_cmp_kv as int attributes, which would pin the compile to one size; "
                  "only the convention without metadata (A2 / A3: FusionConfig(soc='Ascend910B')) fuses them")


def _symbolic_metadata_reason(site):
    """A metadata form (the convention _metadata_reason chose for the SoC) with symbolic sizes:
    refused, the metadata op's limit."""
    if site.form.replace in _WITH_METADATA and any(_symbolic(site.args.get(n)) for n in ("q", "ori_kv", "cmp_kv")):
        return METADATA_LIMIT
    return None


def _symbolic_torchtitan_reason(site):
    """_torchtitan_reason with symbolic sizes: sizes compared by proofs (known_equal), never with
    `==` on a SymInt (a guard would pin the compile to this size); the index masks and lists read
    as formulas of their indices and sizes (symbolic_values), each fact decided for every size."""
    q, kv, sinks = site["q"], site["ori_kv"], site["sinks"]
    cmp = site.args.get("cmp_kv")
    if q.dim() != 4 or kv.dim() != 3:
        return f"q {list(q.shape)} / kv {list(kv.shape)} are not (B, S, H, D) / (B, S, D)"
    batch, seq_len, heads, dim = q.shape
    if not all(known_equal(a, b) for a, b in zip(kv.shape, (batch, seq_len, dim))):
        return f"kv {list(kv.shape)} is not one (key = value) head of the {seq_len} queries' tokens (for every size)"
    if not (isinstance(heads, int) and isinstance(dim, int)):
        return (f"{heads} heads of dim {dim}: symbolic, where sparse_flash_mla's kernel takes fixed head counts and "
                "dims (its sinks one per head)")
    if sinks.dim() != 1 or not known_equal(sinks.shape[0], heads):
        return f"sinks {list(sinks.shape)}: the op takes one per query head ({heads})"
    if site["scaling"] <= 0:
        return f"scaling {site['scaling']} <= 0"
    if kv.dtype != q.dtype or (cmp is not None and cmp.dtype != q.dtype):
        return "q, kv and compressed kv differ in dtype: the op takes one"
    if cmp is None:
        return (_symbolic_index_mask_reason(site.arg_nodes["window_mask"], seq_len, None, None)
                or site.hardware_limits(_hardware_reasons(site, None, (heads, dim, 1))))
    if cmp.dim() != 3 or not known_equal(cmp.shape[0], batch) or not known_equal(cmp.shape[2], dim):
        return f"compressed kv {list(cmp.shape)} is not (B, T, D)"
    blocks = cmp.shape[1]
    try:
        ratio = _compress_ratio(seq_len, blocks)  # the replacement's cmp_ratio, proven T = S // m
    except RuntimeError:
        return (f"{blocks} compressed keys for {seq_len} tokens: T is not proven S // m for one ratio m at every "
                "size (the op's cmp_ratio is an int)")
    if site.form.search in _TT_COMPRESSED:
        return (_symbolic_index_mask_reason(site.arg_nodes["index_mask"], seq_len, blocks, ratio)
                or site.hardware_limits(_hardware_reasons(site, None, (heads, dim, ratio))))
    reason, width = _symbolic_index_list_reason(site, seq_len, blocks, ratio)
    if reason is None and width is None:
        return (site.hardware_limits(_hardware_reasons(site, None, (heads, dim, ratio)))
                or "the compressed indices are computed from sizes only (HCA): the compressed form, whose op call "
                   "takes no indices, fuses the site")
    return reason or site.hardware_limits(_hardware_reasons(site, width, (heads, dim, ratio)))


def _band(query, key):
    """Key `key` of the S window keys visible to query `query` (sympy): the op's band."""
    return sympy.And(sympy.Le(key, query), sympy.Gt(key, query - WINDOW))


def _threshold(query, ratio):
    """(t + 1) // m as symbolic_values writes it (the same formula: its proofs read it as one unknown)."""
    return sympy.floor((query + 1) / sympy.Integer(ratio))


def _same_set(shown, expected, shape, node):
    """shown and expected (bool formulas over shape's indices) agree at every index, for every size."""
    return (never(sympy.And(shown, sympy.Not(expected)), shape, node)
            and never(sympy.And(expected, sympy.Not(shown)), shape, node))


def _symbolic_index_mask_reason(node, seq_len, blocks, ratio):
    """_index_mask_reason for every size: the additive mask, a formula of its indices, is 0 exactly
    at the band of the S keys and (blocks) at the compressed keys w < (t + 1) // m, and at most
    -1e30 elsewhere."""
    mask = tensor_meta(node)
    keys = seq_len if blocks is None else seq_len + blocks
    if mask is None or mask.dim() < 2 or not mask.is_floating_point() \
            or not (known_equal(mask.shape[-2], seq_len) and known_equal(mask.shape[-1], keys)):
        return f"the index mask is {getattr(mask, 'dtype', None)}{list(getattr(mask, 'shape', []))}, not an " \
               f"additive (.., {seq_len}, {keys}) mask"
    lists = _scattered_index_lists(node, seq_len, blocks)
    if lists is not None:  # torchtitan-npu's spelling: its lists proven one by one (cheaper than the mask)
        return _index_lists_reason(lists, seq_len, blocks, ratio)
    shape = tuple(mask.shape)
    value = formula_of(node, shape)
    if value is None:
        return ("the index mask is computed from graph inputs or in a way the symbolic proof does not follow, so the "
                "keys it shows cannot be proven for every size")
    t, j = index_symbol(len(shape) - 2), index_symbol(len(shape) - 1)
    S = size_expr(seq_len)
    shown = sympy.Eq(value, 0)
    if not never(sympy.And(sympy.Not(shown), sympy.Gt(value, sympy.Float(-1e30))), shape, node):
        return "the index mask holds values that neither show (0) nor hide (-inf, finfo.min) a key (for every size)"
    window = sympy.And(sympy.Lt(j, S), shown)
    if not _same_set(window, _band(t, j), shape, node):
        return (f"the index mask does not show each query the {WINDOW}-key window the op's band is "
                f"(ori_win_left {WINDOW - 1}, ori_win_right 0), not proven for every size")
    if blocks is None:
        return None
    compressed = sympy.And(sympy.Ge(j, S), shown)
    expected = sympy.And(sympy.Ge(j, S), sympy.Lt(j - S, _threshold(t, ratio)))
    if not _same_set(compressed, expected, shape, node):
        return (f"the index mask's compressed keys are not the blocks w < (t + 1) // {ratio} (cmp_mask_mode 3 at "
                f"cmp_ratio S // T = {ratio}), not proven for every size")
    return None


def _scattered_index_lists(node, seq_len, blocks):
    """The index lists of an index mask spelled as torchtitan-npu's SparseAttention spells it:
    full((.., S, keys + 1), fill).scatter(-1, masked_fill(cat(lists).int(), < 0, keys), 0)[..., :-1]
    with keys = S (+ T) and a fill that hides a key: its lists [window(, compressed)], or None
    for any other spelling (then the mask is read as one formula)."""
    keys = seq_len + (blocks or 0)
    if not is_call(node, aten.slice.Tensor) or len(node.args) < 4 or node.args[2] != 0:
        return None
    scatter = node.args[0]
    meta = tensor_meta(scatter)
    end = node.args[3]
    end = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
    if meta is None or node.args[1] not in (-1, meta.dim() - 1) or not isinstance(end, (int, torch.SymInt)) \
            or not (end == -1 or known_equal(end, keys)):
        return None
    if not is_call(scatter, aten.scatter.value) or scatter.args[1] not in (-1, meta.dim() - 1) or scatter.args[3] != 0:
        return None
    base, index = scatter.args[0], scatter.args[2]
    if not is_call(base, aten.full.default) or not isinstance(base.args[1], (int, float)) \
            or not (base.args[1] == float("-inf") or base.args[1] <= -1e30):
        return None
    if not known_equal(meta.shape[-1], keys + 1):
        return None
    if is_call(index, aten.unsqueeze.default):
        index = index.args[0]
    index_meta = tensor_meta(index)
    # (scatter writes the rows its index has: they must be every row of the mask)
    if index_meta is None or meta.dim() != 4 or index_meta.dim() != 3 or meta.shape[1] != 1 \
            or not (known_equal(meta.shape[0], index_meta.shape[0]) and known_equal(meta.shape[2], index_meta.shape[1])):
        return None
    if not is_call(index, aten.masked_fill.Scalar) or not is_call(index.args[1], aten.lt.Scalar) \
            or index.args[1].args != (index.args[0], 0):
        return None
    lane = index.args[2]
    lane = lane.meta.get("val") if isinstance(lane, torch.fx.Node) else lane
    if not isinstance(lane, (int, torch.SymInt)) or not known_equal(lane, keys):
        return None
    ids = index.args[0]
    while is_call(ids, aten._to_copy.default) and set(ids.kwargs) <= {"dtype"}:
        ids = ids.args[0]
    if blocks is None:
        return [ids]
    if not is_call(ids, aten.cat.default) or len(ids.args[0]) != 2 or (len(ids.args) > 1 and ids.args[1] not in (-1, 2)):
        return None
    return list(ids.args[0])


def _index_lists_reason(lists, seq_len, blocks, ratio):
    """The keys of a scattered index mask (_scattered_index_lists), proven list by list: the window
    list's are the band, the compressed list's (HCA: from sizes only) the blocks w < (t + 1) // m."""
    reason = _window_list_reason(lists[0], seq_len, blocks)
    if reason or blocks is None:
        return reason
    reason, width = _symbolic_compressed_list_reason(lists[1], seq_len, blocks, ratio)
    if reason is None and width is not None:
        return ("the index mask's compressed keys are a top-k's picks (CSA): the indexed form, which reads them, "
                "fuses the site")
    return reason


def _symbolic_index_list_reason(site, seq_len, blocks, ratio):
    """_index_list_reason for every size: (reason, top-k width)."""
    lane = site["padding_lane"]
    if not known_equal(lane, seq_len + blocks):
        return (f"the -1 slots go to column {lane}, not the padding lane {seq_len + blocks} the mask drops "
                "(not proven for every size)"), None
    if not hides(site["fill"]) or (site["fill"] != float("-inf") and site["fill"] > -1e30):
        return f"the index mask's fill {site['fill']:g} does not hide a key as -inf does", None
    reason = _window_list_reason(site.arg_nodes["window_idx"], seq_len, blocks)
    if reason:
        return reason, None
    return _symbolic_compressed_list_reason(site.arg_nodes["compressed_idx"], seq_len, blocks, ratio)


def _window_list_reason(node, seq_len, blocks):
    """None if the index list `node` (.., S, W), computed from sizes only, lists exactly the band
    of each query among all S + T keys and the padding lane, for every size; else why not."""
    window = tensor_meta(node)
    if window is None or window.is_floating_point() or window.dim() < 2 or not known_equal(window.shape[-2], seq_len):
        return "the window indices are not a (S, W) index list"
    members = index_list_members(node)
    if members is None:
        return ("the window indices are not computed from sizes only (torchtitan-npu computes them from aranges), so "
                "the keys they list cannot be proven for every size")
    rank = window.dim()
    shape = (*window.shape[:-1], seq_len + (blocks or 0) + 1)  # every key and the padding lane
    if not _same_set(members, _band(index_symbol(rank - 2), index_symbol(rank - 1)), shape, node):
        return (f"the window indices do not list the {WINDOW}-key window the op's band is (ori_win_left "
                f"{WINDOW - 1}, ori_win_right 0), not proven for every size")
    return None


def _symbolic_compressed_list_reason(node, seq_len, blocks, ratio):
    """_compressed_list_reason for every size: where(k >= thr, -1, k + S), k a top-k's indices over
    the T blocks, thr the formula (t + 1) // m; or (HCA) a list computed from sizes only, whose
    members are the blocks w < (t + 1) // m (offset by S)."""
    listed = index_list_members(node)
    if listed is not None:  # HCA (GetCompressTopkIdxs, from aranges): the listed blocks, for every size
        meta = tensor_meta(node)
        rank = meta.dim()
        t, j = index_symbol(rank - 2), index_symbol(rank - 1)
        S = size_expr(seq_len)
        shape = (*meta.shape[:-1], seq_len + blocks + 1)
        expected = sympy.And(sympy.Ge(j, S), sympy.Lt(j - S, _threshold(t, ratio)))
        if not _same_set(sympy.And(listed, sympy.Lt(j, S + size_expr(blocks))), expected, shape, node) \
                or not never(sympy.And(listed, sympy.Lt(j, S)), shape, node):
            return (f"the compressed indices do not list the blocks w < (t + 1) // {ratio} (cmp_mask_mode 3 at "
                    f"cmp_ratio S // T = {ratio}), not proven for every size"), None
        return None, None
    found = _listed_picks(node, seq_len, blocks)
    if isinstance(found, str):
        return found, None
    picks, threshold = found
    picks_shape = tuple(tensor_meta(picks).shape)
    if len(picks_shape) < 2 or not known_equal(picks_shape[-2], seq_len):
        return _NOT_LISTED_PICKS + ": the threshold is not one per query", None
    value = formula_of(threshold, picks_shape)
    t = index_symbol(len(picks_shape) - 2)
    if value is None or not never(sympy.Ne(value, _threshold(t, ratio)), picks_shape, threshold):
        return (f"the compressed indices' threshold is not (t + 1) // {ratio} (cmp_mask_mode 3 at cmp_ratio "
                f"S // T = {ratio}), not proven for every size"), None
    return None, picks_shape[-1]


def _visible_window(seq_len, keys):
    """(S, keys) bool: key j < S visible to query t iff t - WINDOW < j <= t (the op's band,
    ori_win_left WINDOW - 1, ori_win_right 0)."""
    t = torch.arange(seq_len).unsqueeze(-1)
    j = torch.arange(keys).unsqueeze(0)
    return (j <= t) & (j > t - WINDOW) & (j < seq_len)


def _visible_blocks(seq_len, blocks, ratio):
    """(S, T) bool: compressed block w visible to query t iff w < (t + 1) // m (cmp_mask_mode 3
    of a prefill: S keys, S queries)."""
    t = torch.arange(seq_len).unsqueeze(-1)
    return torch.arange(blocks).unsqueeze(0) < (t + 1) // ratio


def _index_mask_reason(node, seq_len, blocks, ratio):
    """None if the additive mask `node` is a compile-time constant showing query t exactly the op's
    keys: the 128-key band of the S keys, then (T > 0) the blocks w < (t + 1) // m; else why not.
    Hidden entries must be -inf or at most -1e30 (torchtitan's finfo(bf16).min): added to a logit
    they leave exp() exactly 0 beside the sink, which every row has."""
    with unset_fake_temporarily():
        value = evaluate_constant(node)
        if value is None:
            return ("the index mask is computed from graph inputs (or symbolic sizes) in a form other than "
                    "torchtitan-npu's index list (a window from aranges, compressed blocks of a top-k), so the "
                    "keys it shows cannot be proven")
        if value.dim() < 2 or not value.is_floating_point() or tuple(value.shape[-2:]) != (seq_len, seq_len + blocks):
            return f"the index mask is {value.dtype}{list(value.shape)}, not an additive (.., {seq_len}, " \
                   f"{seq_len + blocks}) mask"
        visible = value == 0
        if not bool((value[~visible] <= -1e30).all()):
            return "the index mask holds values that neither show (0) nor hide (-inf, finfo.min) a key"
        expected = torch.cat([_visible_window(seq_len, seq_len), _visible_blocks(seq_len, blocks, ratio)], -1)
        wrong = visible != expected
        if not bool(wrong.any()):
            return None
        if bool(wrong[..., :seq_len].any()):
            widest = int(visible[..., :seq_len].sum(-1).max())
            return (f"the index mask does not show each query the {WINDOW}-key window the op's band is "
                    f"(ori_win_left {WINDOW - 1}, ori_win_right 0; the widest row shows {widest} keys)")
        return (f"the index mask's compressed keys are not the blocks w < (t + 1) // {ratio} (cmp_mask_mode 3 "
                f"at cmp_ratio S // T = {ratio})")


def _index_list_reason(site, seq_len, blocks, ratio):
    """torchtitan-npu's CSA index list, proven: (reason, top-k width).

    window_idx is evaluated (aranges): per query t, its ids >= 0 are below S and are the op's
    band; compressed_idx is where(k >= thr, -1, k + S) with k a top-k's indices over T blocks
    (distinct, in [0, T)) and thr the evaluated (t + 1) // m: so every listed block is visible
    under cmp_mask_mode 3 and listed once, and the model's padding lane is S + T, hidden."""
    keys = seq_len + blocks
    if site["padding_lane"] != keys:
        return (f"the -1 slots go to column {site['padding_lane']}, not the padding lane {keys} the mask "
                "drops"), None
    if not hides(site["fill"]) or (site["fill"] != float("-inf") and site["fill"] > -1e30):
        return f"the index mask's fill {site['fill']:g} does not hide a key as -inf does", None
    with unset_fake_temporarily():
        window = evaluate_constant(site.arg_nodes["window_idx"])
        if window is None or window.is_floating_point() or window.dim() < 2 or window.shape[-2] != seq_len:
            return ("the window indices are not a compile-time constant (S, W) index list (torchtitan-npu "
                    "computes them from aranges)"), None
        if bool((window >= seq_len).any()):
            return "the window indices list keys past the S window keys", None
        rows = window.reshape(-1, seq_len, window.shape[-1])
        shown = torch.zeros(rows.shape[0], seq_len, seq_len + 1, dtype=torch.bool)
        shown.scatter_(-1, torch.where(rows < 0, seq_len, rows), True)
        if not bool((shown[..., :seq_len] == _visible_window(seq_len, seq_len)).all()):
            widest = int(shown[..., :seq_len].sum(-1).max())
            return (f"the window indices do not list the {WINDOW}-key window the op's band is (ori_win_left "
                    f"{WINDOW - 1}, ori_win_right 0; the widest row lists {widest} keys)"), None
        reason, width = _compressed_list_reason(site.arg_nodes["compressed_idx"], seq_len, blocks, ratio)
    return reason, width


_NOT_LISTED_PICKS = ("the compressed indices are not where(k >= (t + 1) // m, -1, k + S) of a top-k's indices k "
                     "over the T blocks (torchtitan-npu's LiCompute)")


def _listed_picks(node, seq_len, blocks):
    """(picks, threshold) of where(picks >= threshold, -1, picks + S), picks a top-k's indices over
    the T compressed blocks (torchtitan-npu's LiCompute), or the reason `node` is not that; the
    threshold is the callers' to prove (by value, or for every size)."""
    what = _NOT_LISTED_PICKS
    if not is_call(node, aten.where.self):
        return what
    cond, invalid, valid = node.args
    with unset_fake_temporarily():
        minus_one = evaluate_constant(invalid)
        if minus_one is None or minus_one.numel() != 1 or int(minus_one) != -1:
            return what + ": its masked slots are not -1"
    if not is_call(cond, aten.ge.Tensor) or not is_call(valid, aten.add.Tensor):
        return what
    picks, threshold = cond.args
    offset = valid.args[1] if len(valid.args) > 1 else None
    offset = offset.meta.get("val") if isinstance(offset, torch.fx.Node) else offset
    if valid.args[0] is not picks or valid.kwargs or not isinstance(offset, (int, torch.SymInt)) \
            or not known_equal(offset, seq_len):
        return what + f": the listed blocks are not offset by the S = {seq_len} window keys"
    topk = picks.args[0] if is_call(picks, operator.getitem) and picks.args[1] == 1 else None
    if not is_call(topk, aten.topk.default):
        return what + ": the blocks are not a top-k's indices"
    scores = tensor_meta(topk.args[0])
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    if scores is None or dim not in (-1, scores.dim() - 1) or not known_equal(scores.shape[-1], blocks):
        return what + f": the top-k does not rank the {blocks} compressed blocks"
    return picks, threshold


def _compressed_list_reason(node, seq_len, blocks, ratio):
    """where(k >= thr, -1, k + S), k = topk(scores over T blocks).indices, thr = (t + 1) // m."""
    constant = evaluate_constant(node)
    if constant is not None:  # HCA (GetCompressTopkIdxs, from aranges): the listed blocks, by value
        if constant.is_floating_point() or constant.dim() < 2 or constant.shape[-2] != seq_len:
            return f"the compressed indices are {constant.dtype}{list(constant.shape)}, not a (S, K) index list", None
        rows = constant.reshape(-1, seq_len, constant.shape[-1])
        if bool(((rows >= 0) & (rows < seq_len)).any()) or bool((rows > seq_len + blocks).any()):
            return "the compressed indices list keys outside the T compressed blocks", None
        shown = torch.zeros(rows.shape[0], seq_len, seq_len + blocks + 1, dtype=torch.bool)
        shown.scatter_(-1, torch.where(rows < 0, seq_len + blocks, rows), True)
        if not bool((shown[..., seq_len:seq_len + blocks] == _visible_blocks(seq_len, blocks, ratio)).all()):
            return (f"the compressed indices do not list the blocks w < (t + 1) // {ratio} (cmp_mask_mode 3 at "
                    f"cmp_ratio S // T = {ratio})"), None
        return None, None
    found = _listed_picks(node, seq_len, blocks)
    if isinstance(found, str):
        return found, None
    picks, threshold = found
    value = evaluate_constant(threshold)
    expected = (torch.arange(seq_len) + 1) // ratio
    if value is None or value.is_floating_point():
        return _NOT_LISTED_PICKS + ": the threshold is not a compile-time constant", None
    picks_shape = tensor_meta(picks).shape
    try:
        value = torch.broadcast_to(value, tuple(picks_shape))
    except RuntimeError:
        return _NOT_LISTED_PICKS + ": the threshold is not one per query", None
    if not bool((value == expected.view(seq_len, 1)).all()):
        return (f"the compressed indices' threshold is not (t + 1) // {ratio} (cmp_mask_mode 3 at cmp_ratio "
                f"S // T = {ratio})"), None
    return None, picks_shape[-1]


def _site_reason(site):
    reason = _attention_reason(site)
    if reason:
        return reason
    if site.form.search is deepseek_v4_sliding_attention:
        return site.hardware_limits(_hardware_reasons(site))
    reason = _compressed_reason(site)
    if reason:
        return reason
    if site.form.search is deepseek_v4_hca_attention:
        return site.hardware_limits(_hardware_reasons(site))
    reason = _indexer_shape_reason(site)
    if reason:
        return reason
    return site.hardware_limits(_hardware_reasons(site, site["index_topk"]) + _indexer_reasons(site))


# ---- verification inputs ------------------------------------------------------------------------
def verify_input(name, args):
    """CSA: indexer inputs without exactly tied scores. A block scores exactly 0 where relu zeroes
    all Hi heads' products (2**-Hi of the blocks on random data), and where such ties fall on the
    k-th score the model's top-k and the fused indexer may keep different blocks: both are a
    top-k (torch: "the indices of tied elements are not guaranteed to be stable"), but the
    attention over them differs. With 4 indexer heads 14 of 300 random draws at the tiny V4's
    sizes (S 18, ratio 4, top-3) and 182 of 300 at S 64, top-8 differed so, every one a tie at
    the k-th score, so verification refused correct sites. Positive keys and a positive first
    head make that head's product, and so every score, non-zero (the other heads keep random
    signs, so the relu still counts): then no two scores are equal but by chance (0 of 300
    draws differed)."""
    if name not in ("index_keys", "index_query"):
        return None
    fake = args[name]
    generator = torch.Generator().manual_seed(1 if name == "index_keys" else 2)
    values = torch.randn(*(int(size) for size in fake.shape), generator=generator)
    if name == "index_keys":
        values = values.abs()
    else:  # (B, S, Hi, Di)
        values[:, :, 0] = values[:, :, 0].abs()
    return values.to(fake.dtype)


# ---- near misses: a softmax over logits with a sink column ------------------------------------
def _sink_softmax(node):
    """_softmax(cat([logits, sinks]) - max) whose last column is dropped: the sink softmax."""
    if not is_call(node, aten._softmax.default):
        return False
    shifted = node.args[0]
    if not is_call(shifted, aten.sub.Tensor) or not is_call(shifted.args[0], aten.cat.default):
        return False
    return any(is_call(u, aten.slice.Tensor) and _drops_last_column(u) for u in node.users)


def _drops_last_column(slice_node):
    """slice(p, -1, 0, -1): `[..., :-1]`, whose end the engine's canonicalisation spells as
    the dim's size - 1 (canonical._canonical_slice_bounds)."""
    values = tensor_meta(slice_node.args[0])
    if values is None or len(slice_node.args) < 4 or slice_node.args[1] not in (-1, values.dim() - 1):
        return False
    end = slice_node.args[3]
    return end == -1 or (isinstance(end, int) and end == values.shape[-1] - 1)


def anchor(node):
    return _sink_softmax(node)


# transformers' forms: their sliding mask and positions are proven by evaluating them (constants.
# band_mask_reason, arange_positions_reason), at static sizes only (torchtitan-npu's forms are
# proven for every size: _symbolic_torchtitan_reason)
SYMBOLIC = ("transformers' DeepSeek-V4 attention with symbolic sizes (dynamic shapes): its sliding mask and positions "
            "are proven by evaluating them, at static sizes only")


def _symbolic(value):
    return value is not None and any(isinstance(size, torch.SymInt) for size in value.shape)


def explain(node):
    return ("an attention with sinks (softmax over cat([logits, sink])) in a form other than DeepSeek-V4's "
            "sliding / HCA / CSA attention (transformers' eager_attention_forward with repeat_kv of one kv head, "
            "its masks and, for CSA, the lightning indexer in the same graph; torchtitan-npu's SparseAttention: "
            "one kv head broadcast by the matmul, an additive index mask over the window and compressed keys)")


PASS = FusionPass(
    name="sparse_mla",
    # its forms read the fused partial RoPE calls
    after=("rope",),
    fused_op="cann_ops_transformer.sparse_flash_mla",
    forms=FORMS,
    example={
        # B=2, H=5 heads of D=16, S=47 tokens; 7 compressed blocks (ratio 6, residual 5); an
        # indexer of 2 heads of 8 keeping 4. The scalars differ from every int in the traces
        # (B*H = 10 and the other view sizes included).
        "query": lambda dtype: torch.empty(2, 5, 47, 16, dtype=dtype),
        "kv": lambda dtype: torch.empty(2, 1, 47, 16, dtype=dtype),
        "compressed_kv": lambda dtype: torch.empty(2, 1, 7, 16, dtype=dtype),
        "sinks": lambda dtype: torch.empty(5, dtype=torch.float32),  # V4 keeps them in fp32
        "sliding_mask": lambda dtype: torch.empty(2, 1, 47, 47, dtype=dtype),
        "position_ids": lambda dtype: torch.empty(1, 47, dtype=torch.int64),
        # transformers rotates the indexer's queries as (B, Hi, S, Di) and transposes them back
        "index_query": lambda dtype: torch.empty(2, 2, 47, 8, dtype=dtype).transpose(1, 2),
        "index_keys": lambda dtype: torch.empty(2, 7, 8, dtype=dtype),
        "index_weights": lambda dtype: torch.empty(2, 47, 2, dtype=dtype),
        "compress_rate": 6,
        "index_topk": 4,
        "index_scale": 2.0**-3,
        "weights_scale": 2.0**-4,
        "scaling": 2.0**-5,
        # torchtitan-npu's forms: q (B, S, H, D), one key head (B, S, D), T = 7 compressed (B, T, D);
        # an index list of an 11-key window and 4 compressed picks, its padding lane and fill
        "q": lambda dtype: torch.empty(2, 47, 5, 16, dtype=dtype),
        "ori_kv": lambda dtype: torch.empty(2, 47, 16, dtype=dtype),
        "cmp_kv": lambda dtype: torch.empty(2, 7, 16, dtype=dtype),
        "window_mask": lambda dtype: torch.empty(2, 1, 47, 47, dtype=dtype),
        "index_mask": lambda dtype: torch.empty(2, 1, 47, 54, dtype=dtype),
        "window_idx": lambda dtype: torch.empty(2, 47, 11, dtype=torch.int64),
        "compressed_idx": lambda dtype: torch.empty(2, 47, 4, dtype=torch.int64),
        "padding_lane": 59,
        "fill": -3.0e38,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten._softmax.default,),
    explain=explain,
    verify_input=verify_input,
    differentiable=("query", "kv", "compressed_kv", "sinks", "q", "ori_kv", "cmp_kv"),
    prefilter=lambda graph: any(map(_sink_softmax, graph.find_nodes(op="call_function", target=aten._softmax.default))),
    # torchtitan-npu's padding lane S + T: with symbolic sizes a SymInt, which the check proves
    # equal to S + T for every size (_symbolic_index_list_reason); the replacement does not read it
    symbolic_scalars=("padding_lane",),
)
