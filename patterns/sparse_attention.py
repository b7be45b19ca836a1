"""sparse_attention: attention over the indexer's top-k keys -> npu_sparse_flash_attention.

transformers' DeepseekV32Attention (eager / sdpa) turns the indexer's top-k indices into a
mask and runs dense attention with it:

    index_mask = ones(B, S, T).scatter(-1, indices, False)            True = not selected
    attn_mask = causal_mask & ~index_mask
    out = scaled_dot_product_attention(q, k, v, attn_mask, scale)      (B, N, S, Dv)

On CPU, SDPA with a bool mask reaches the graph as its math decomposition (q and k^T each
scaled by sqrt(scale), bmm, + where(mask, 0, -inf), _safe_softmax, bmm), which is what
the form spells out. npu_sparse_flash_attention(q, k, v, indices, scale) attends to the
listed keys only (op_semantics.md 8.2); its sparse_mode 3 is the right-down causal mask,
0 none. So the model's mask must be proven one of them (constants.sparse_mode_of; it is
built from aranges) and everything else is not fused. A key listed by the indexer but
hidden by the causal mask (the first queries, where fewer than k keys are visible) is
hidden by mode 3 too; a fully hidden row gives 0 in both (_safe_softmax, the kernel).

On an NPU the same SDPA call is torch_npu's own kernel (npu_dispatch.py, docs/npu-graph.md):
on A2/A3 the bool mask becomes Ascend's (True = masked out) with `logical_not` and goes to
`npu_fusion_attention_v3(q, k, v, N, "BNSD", atten_mask=~mask, scale, inner_precise=2 for
more than one query, ...)[0]`; on Ascend950 `npu_fusion_attention` with the same arguments.
Those are the FA forms below, with the same mask proof on the model's own mask.

transformers' attention is not MLA-absorbed: q and k are per head with the rope part
concatenated (Dqk = nope + rope), v has Dv = nope. The op takes value of key's shape, so
q and k are split at Dv: the first Dv dims as query / key, the rest as query_rope /
key_rope (the op concatenates them again for the scores). Real kernels take one latent
KV head of 512 (+ 64 rope): in emulation such sites fuse with a note saying so, with a SoC
given they are refused.

Training graphs: the pass also matches on the joint forward+backward graph (differentiable
q, k, v); the joint replacement asks the op for its lse (return_softmax_lse=True, set only
where autograd records the call: records_gradient), which its autograd hands to
npu_sparse_flash_attention_grad. Under max-autotune joint sites are refused
(_training_reason). docs/passes/sparse_attention.md, "Training graphs".
"""
import math
import operator

import sympy
import torch

from npu_fx_fusion.capabilities import CAPABILITIES, GE_MODES, not_lowerable, unsupported
from npu_fx_fusion.constants import sparse_mode_of
from npu_fx_fusion.matching import (Form, FusionPass, decided_nonnegative, formula_of, index_symbol, is_backward,
                                   is_call, is_cast, is_training_graph, known_equal, mask_mode_with_leaf, records_gradient,
                                   sdpa_as_on_npu, size_expr, tensor_meta)

aten = torch.ops.aten
SFA = CAPABILITIES["npu.npu_sparse_flash_attention"]


# ---- the unfused form --------------------------------------------------------------------
def _top_k_sdpa(query, key, value, indices, mask, sqrt_scale, mask_dtype):
    batch, heads, queries, _ = query.shape
    keys = key.shape[-2]
    index_mask = indices.new_ones((batch, queries, keys), dtype=torch.bool).scatter(-1, indices.long(), False)
    attn_mask = mask & ~index_mask.unsqueeze(1)
    # SDPA's math decomposition (_scaled_dot_product_attention_math); its scalar tensors
    # carry dtype and device only, in the dtype of the caller's query
    zero = aten.scalar_tensor.default(0.0, dtype=mask_dtype, device=query.device)
    minus_inf = aten.scalar_tensor.default(float("-inf"), dtype=mask_dtype, device=query.device)
    bias = torch.where(attn_mask, zero, minus_inf)
    scores = aten.mul.Scalar(query, sqrt_scale) @ aten.mul.Scalar(key.transpose(-2, -1), sqrt_scale)
    probs = aten._safe_softmax.default(scores + bias, -1)
    return probs @ value


def transformers_sdpa_top_k_mask(query, key, value, indices, mask, sqrt_scale):
    return _top_k_sdpa(query, key, value, indices, mask, sqrt_scale, query.dtype)


def transformers_sdpa_top_k_mask_upcast(query, key, value, indices, mask, sqrt_scale):
    """The same in bf16/fp16: SDPA's math path on CPU computes in fp32 and casts back."""
    out = _top_k_sdpa(query.float(), key.float(), value.float(), indices, mask, sqrt_scale, query.dtype)
    return out.to(query.dtype)


def _as_transformers_returns_it(out, query, value):
    # sdpa_attention_forward: `attn_output.reshape(B, -1, q_length, v_dim).transpose(1, 2)
    # .contiguous()` (the reshape undoes a GQA packing, a no-op here)
    return out.reshape(out.shape[0], -1, query.shape[-2], value.shape[-1]).transpose(1, 2).contiguous()


def transformers_sdpa_top_k_mask_bsnd(query, key, value, indices, mask, sqrt_scale):
    """The same, reshaped and transposed to a contiguous (B, S, N, Dv) as transformers'
    sdpa_attention_forward returns it. In a training graph the output's gradient then
    enters through that transpose (a clone and an _unsafe_view, not the plain view of the
    untransposed form's trace), so only this form matches the joint graph."""
    out = transformers_sdpa_top_k_mask(query, key, value, indices, mask, sqrt_scale)
    return _as_transformers_returns_it(out, query, value)


def transformers_sdpa_top_k_mask_upcast_bsnd(query, key, value, indices, mask, sqrt_scale):
    out = transformers_sdpa_top_k_mask_upcast(query, key, value, indices, mask, sqrt_scale)
    return _as_transformers_returns_it(out, query, value)


def _top_k_flash_attention(flash_attention, query, key, value, indices, mask, scale):
    """What torch_npu's scaled_dot_product_attention kernel records for the same call
    (op-plugin ScaledDotProductAttentionKernelNpuOpApi.cpp, FlashAttention branch): the
    mask as Ascend's (True = masked out), inner_precise 2 over more than one query row."""
    batch, heads, queries, _ = query.shape
    keys = key.shape[-2]
    index_mask = indices.new_ones((batch, queries, keys), dtype=torch.bool).scatter(-1, indices.long(), False)
    attn_mask = mask & ~index_mask.unsqueeze(1)
    inner_precise = 2 if queries > 1 else 0
    return flash_attention(query, key, value, heads, "BNSD", None, None, torch.logical_not(attn_mask), scale, 1.0,
                           2147483647, 2147483647, inner_precise, None, None, None, 0, True, False)[0]


def transformers_fa_v3_top_k_mask(query, key, value, indices, mask, scale):
    """The transformers form as an A2/A3 compile records it: SDPA is npu_fusion_attention_v3."""
    return _top_k_flash_attention(torch.ops.npu.npu_fusion_attention_v3, query, key, value, indices, mask, scale)


def transformers_fa_top_k_mask(query, key, value, indices, mask, scale):
    """The same on Ascend950, where torch_npu's SDPA calls npu_fusion_attention."""
    return _top_k_flash_attention(torch.ops.npu.npu_fusion_attention, query, key, value, indices, mask, scale)


def transformers_fa_v3_top_k_mask_bsnd(query, key, value, indices, mask, scale):
    """The FA-v3 form as transformers' sdpa_attention_forward returns it (the joint graphs')."""
    out = transformers_fa_v3_top_k_mask(query, key, value, indices, mask, scale)
    return _as_transformers_returns_it(out, query, value)


def transformers_fa_top_k_mask_bsnd(query, key, value, indices, mask, scale):
    out = transformers_fa_top_k_mask(query, key, value, indices, mask, scale)
    return _as_transformers_returns_it(out, query, value)


def _mla_gathered(q_nope, q_rope, kv, k_rope, indices, scale, causal):
    batch = torch.arange(indices.shape[0], device=indices.device).view(-1, 1, 1)
    keys = indices.clamp(min=0).long()
    kv_selected, rope_selected = kv[batch, keys], k_rope[batch, keys]        # (B, S, K, D), (B, S, K, R)
    scores = (torch.einsum("bsnd,bskd->bsnk", q_nope, kv_selected)
              + torch.einsum("bsnr,bskr->bsnk", q_rope, rope_selected)) * scale
    hidden = indices < 0
    if causal:  # query i (of S, the last S of T positions) sees keys up to T - S + i
        queries, total = indices.shape[1], kv.shape[1]
        last_visible = torch.arange(queries, device=indices.device).view(1, -1, 1)
        if total != queries:  # a prefill (S == T) writes no offset (example_variants)
            last_visible = last_visible + (total - queries)
        hidden = hidden | (indices > last_visible)
    scores = scores.masked_fill(hidden.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
    return torch.einsum("bsnk,bskd->bsnd", probs, kv_selected)


def mla_gathered_top_k_causal(q_nope, q_rope, kv, k_rope, indices, scale):
    """Absorbed MLA over gathered keys (DeepSeek-V3.2's inference form, the sparse kernels'
    reference): one latent KV head that is also the value, a separate rope part, the
    indexer's top-k keys gathered per query, -1 slots and future keys masked out."""
    return _mla_gathered(q_nope, q_rope, kv, k_rope, indices, scale, causal=True)


def mla_gathered_top_k(q_nope, q_rope, kv, k_rope, indices, scale):
    """The same attending to every listed key (the indices are trusted to be causal)."""
    return _mla_gathered(q_nope, q_rope, kv, k_rope, indices, scale, causal=False)


# A mask given to SDPA whole: the model built it from top-k indices and the causal mask in its
# own way (torchtitan-npu's DSV32_SDPA: `isinf(causal_bias + full(-inf).scatter(-1, indices, 0))
# & (... < 0)`, inverted; other code a bool scatter, masked_fill ...). The search is SDPA over
# any bool mask (True = attend); the check proves what the mask is (_top_k_mask_proof) and binds
# the indices it was scattered from, which the fused call takes (Form.bound).
def sdpa_math_given_mask(query, key, value, mask, sqrt_scale):
    """SDPA's CPU math decomposition over a bool mask the check proves causal & listed."""
    zero = aten.scalar_tensor.default(0.0, dtype=query.dtype, layout=torch.strided, device=query.device)
    minus_inf = aten.scalar_tensor.default(float("-inf"), dtype=query.dtype, device=query.device)
    bias = torch.where(mask, zero, minus_inf)
    scores = aten.mul.Scalar(query, sqrt_scale) @ aten.mul.Scalar(key.transpose(-2, -1), sqrt_scale)
    return aten._safe_softmax.default(scores + bias, -1) @ value


def sdpa_math_given_mask_upcast(query, key, value, mask, sqrt_scale):
    """The same in bf16/fp16: SDPA's math path computes in fp32 and casts back."""
    zero = aten.scalar_tensor.default(0.0, dtype=query.dtype, layout=torch.strided, device=query.device)
    minus_inf = aten.scalar_tensor.default(float("-inf"), dtype=query.dtype, device=query.device)
    bias = torch.where(mask, zero, minus_inf)
    q, k, v = query.float(), key.float(), value.float()
    scores = aten.mul.Scalar(q, sqrt_scale) @ aten.mul.Scalar(k.transpose(-2, -1), sqrt_scale)
    return (aten._safe_softmax.default(scores + bias, -1) @ v).to(query.dtype)


_NPU_SDPA = {soc: sdpa_as_on_npu(soc) for soc in ("Ascend910B", "Ascend950")}


def sdpa_fa_v3_given_mask(query, key, value, mask, scale):
    """The same SDPA as an A2/A3 compile records it (npu_fusion_attention_v3, logical_not(mask))."""
    return _NPU_SDPA["Ascend910B"](query, key, value, attn_mask=mask, scale=scale)


def sdpa_fa_given_mask(query, key, value, mask, scale):
    """The same on Ascend950 (npu_fusion_attention)."""
    return _NPU_SDPA["Ascend950"](query, key, value, attn_mask=mask, scale=scale)


# ---- the fused calls -----------------------------------------------------------------------
def _sparse_flash_attention(query, key, value, indices, scale_value, sparse_mode, bsnd_out=False):
    """(B, N, S, D) in, (B, N, S, Dv) out (bsnd_out: (B, S, N, Dv)); the op works in BSND.
    The math forms scale q and k by sqrt(scale) each, the FA forms pass the scale itself."""
    dim_v = value.shape[-1]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    rope = {}
    if q.shape[-1] > dim_v:  # the rope part of q and k, as the op's MLA inputs take it
        rope = {"query_rope": q[..., dim_v:], "key_rope": k[..., dim_v:]}
        q, k = q[..., :dim_v], k[..., :dim_v]
    heads_kv = k.shape[2]
    sparse_indices = indices.to(torch.int32).unsqueeze(2).expand(-1, -1, heads_kv, -1)
    out, _, _ = torch.ops.npu.npu_sparse_flash_attention(
        q, k, v, sparse_indices, scale_value, layout_query="BSND", layout_kv="BSND",
        sparse_mode=sparse_mode, return_softmax_lse=records_gradient(query, key, value), **rope)
    return out if bsnd_out else out.transpose(1, 2)


def npu_sparse_flash_attention_causal(query, key, value, indices, mask, sqrt_scale):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=3)


def npu_sparse_flash_attention_unmasked(query, key, value, indices, mask, sqrt_scale):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=0)


def npu_sparse_flash_attention_causal_bsnd(query, key, value, indices, mask, sqrt_scale):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=3, bsnd_out=True)


def npu_sparse_flash_attention_unmasked_bsnd(query, key, value, indices, mask, sqrt_scale):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=0, bsnd_out=True)


# the FA forms' replacements: the scale as the model passed it
def npu_sparse_flash_attention_from_fa_causal(query, key, value, indices, mask, scale):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=3)


def npu_sparse_flash_attention_from_fa_unmasked(query, key, value, indices, mask, scale):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=0)


def npu_sparse_flash_attention_from_fa_causal_bsnd(query, key, value, indices, mask, scale):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=3, bsnd_out=True)


def npu_sparse_flash_attention_from_fa_unmasked_bsnd(query, key, value, indices, mask, scale):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=0, bsnd_out=True)


# the given-mask forms' replacements: the indices the check bound (Form.bound), the scale as
# the form has it (the math form's sqrt(scale) squared)
def npu_sparse_flash_attention_given_causal(query, key, value, mask, sqrt_scale, indices):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=3)


def npu_sparse_flash_attention_given_unmasked(query, key, value, mask, sqrt_scale, indices):
    return _sparse_flash_attention(query, key, value, indices, sqrt_scale * sqrt_scale, sparse_mode=0)


def npu_sparse_flash_attention_from_fa_given_causal(query, key, value, mask, scale, indices):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=3)


def npu_sparse_flash_attention_from_fa_given_unmasked(query, key, value, mask, scale, indices):
    return _sparse_flash_attention(query, key, value, indices, scale, sparse_mode=0)


def _mla_sparse_flash_attention(q_nope, q_rope, kv, k_rope, indices, scale, sparse_mode):
    # one KV head, which is also the value
    out, _, _ = torch.ops.npu.npu_sparse_flash_attention(
        q_nope, kv.unsqueeze(2), kv.unsqueeze(2), indices.to(torch.int32).unsqueeze(2), scale,
        query_rope=q_rope, key_rope=k_rope.unsqueeze(2), layout_query="BSND", layout_kv="BSND",
        sparse_mode=sparse_mode, return_softmax_lse=records_gradient(q_nope, q_rope, kv, k_rope))
    return out


def npu_sparse_flash_attention_mla_causal(q_nope, q_rope, kv, k_rope, indices, scale):
    return _mla_sparse_flash_attention(q_nope, q_rope, kv, k_rope, indices, scale, sparse_mode=3)


def npu_sparse_flash_attention_mla(q_nope, q_rope, kv, k_rope, indices, scale):
    return _mla_sparse_flash_attention(q_nope, q_rope, kv, k_rope, indices, scale, sparse_mode=0)


# The given-mask forms' examples besides the pass's: MLA absorbed into one key head, which
# is also the value (torchtitan-npu's DeepSeek-V3.2: q (B, N, S, D + R) a transposed
# concatenation, k (B, 1, S, D + R), v (B, 1, S, D) a view of the latent), at batch 2 and 1
# (torch's matmul copies or views by strides and broadcasting)
def _given_variant(batch):
    return {
        "query": lambda dtype: torch.empty(batch, 7, 3, 24, dtype=dtype).transpose(1, 2),
        "key": lambda dtype: torch.empty(batch, 7, 1, 24, dtype=dtype).transpose(1, 2),
        "value": lambda dtype: torch.empty(batch, 7, 16, dtype=dtype).unsqueeze(2).transpose(1, 2),
        "mask": lambda dtype: torch.empty(batch, 1, 7, 7, dtype=torch.bool),
    }


_GIVEN_VARIANTS = [_given_variant(2), _given_variant(1)]

# Training graphs (joint patterns): the gradients flow to q, k and v (q_nope, q_rope, kv and
# k_rope), which in the models all come from trainable projections; the indices and the mask
# have none. One subset each: a frozen projection would need a joint trace of its own. The
# transformers forms register joint in their BSND spelling only (see
# transformers_sdpa_top_k_mask_bsnd): the untransposed ones' joint traces match no model.
_QKV = (("query", "key", "value"),)
_MLA = (("q_nope", "q_rope", "kv", "k_rope"),)
_FORWARD_ONLY = ()

FORMS = [
    # one search, one replacement per sparse_mode: the check keeps the one the mask proves.
    # In half precision the op takes the half tensors and computes in fp32 inside, as the
    # model's upcast math does; both round the output once. The BSND forms first: they
    # contain the others.
    Form(transformers_sdpa_top_k_mask_bsnd, npu_sparse_flash_attention_causal_bsnd, dtypes=(torch.float32,),
         grad_subsets=_QKV),
    Form(transformers_sdpa_top_k_mask_bsnd, npu_sparse_flash_attention_unmasked_bsnd, dtypes=(torch.float32,),
         grad_subsets=_QKV),
    Form(transformers_sdpa_top_k_mask_upcast_bsnd, npu_sparse_flash_attention_causal_bsnd,
         dtypes=(torch.bfloat16, torch.float16), grad_subsets=_QKV),
    Form(transformers_sdpa_top_k_mask_upcast_bsnd, npu_sparse_flash_attention_unmasked_bsnd,
         dtypes=(torch.bfloat16, torch.float16), grad_subsets=_QKV),
    Form(transformers_sdpa_top_k_mask, npu_sparse_flash_attention_causal, dtypes=(torch.float32,),
         grad_subsets=_FORWARD_ONLY),
    Form(transformers_sdpa_top_k_mask, npu_sparse_flash_attention_unmasked, dtypes=(torch.float32,),
         grad_subsets=_FORWARD_ONLY),
    Form(transformers_sdpa_top_k_mask_upcast, npu_sparse_flash_attention_causal,
         dtypes=(torch.bfloat16, torch.float16), grad_subsets=_FORWARD_ONLY),
    Form(transformers_sdpa_top_k_mask_upcast, npu_sparse_flash_attention_unmasked,
         dtypes=(torch.bfloat16, torch.float16), grad_subsets=_FORWARD_ONLY),
    # NPU dispatch (npu_dispatch.py): SDPA as torch_npu's FlashAttention records it, A2/A3 and
    # Ascend950; it takes half inputs itself, so one form serves every dtype
    *(Form(search, replace, grad_subsets=subsets)
      for fa_form, fa_form_bsnd in ((transformers_fa_v3_top_k_mask, transformers_fa_v3_top_k_mask_bsnd),
                                    (transformers_fa_top_k_mask, transformers_fa_top_k_mask_bsnd))
      for search, replace, subsets in (
          (fa_form_bsnd, npu_sparse_flash_attention_from_fa_causal_bsnd, _QKV),
          (fa_form_bsnd, npu_sparse_flash_attention_from_fa_unmasked_bsnd, _QKV),
          (fa_form, npu_sparse_flash_attention_from_fa_causal, _FORWARD_ONLY),
          (fa_form, npu_sparse_flash_attention_from_fa_unmasked, _FORWARD_ONLY))),
    Form(mla_gathered_top_k_causal, npu_sparse_flash_attention_mla_causal, grad_subsets=_MLA),
    Form(mla_gathered_top_k, npu_sparse_flash_attention_mla, grad_subsets=_MLA),
    # SDPA over a mask the model materialised from top-k indices its own way (after the forms
    # above, which contain it): traced also with one key head (MLA absorbed: torchtitan-npu)
    *(Form(search, replace, dtypes=dtypes, grad_subsets=_QKV, bound=("indices",), example_variants=_GIVEN_VARIANTS)
      for search, dtypes in ((sdpa_fa_v3_given_mask, (torch.float32,)), (sdpa_fa_given_mask, (torch.float32,)),
                             (sdpa_math_given_mask, (torch.float32,)),
                             (sdpa_math_given_mask_upcast, (torch.bfloat16, torch.float16)))
      for replace in ((npu_sparse_flash_attention_from_fa_given_causal, npu_sparse_flash_attention_from_fa_given_unmasked)
                      if search in (sdpa_fa_v3_given_mask, sdpa_fa_given_mask) else
                      (npu_sparse_flash_attention_given_causal, npu_sparse_flash_attention_given_unmasked))),
]
_MODE = {npu_sparse_flash_attention_given_causal: 3, npu_sparse_flash_attention_given_unmasked: 0,
         npu_sparse_flash_attention_from_fa_given_causal: 3, npu_sparse_flash_attention_from_fa_given_unmasked: 0,
         npu_sparse_flash_attention_causal: 3, npu_sparse_flash_attention_unmasked: 0,
         npu_sparse_flash_attention_causal_bsnd: 3, npu_sparse_flash_attention_unmasked_bsnd: 0,
         npu_sparse_flash_attention_from_fa_causal: 3, npu_sparse_flash_attention_from_fa_unmasked: 0,
         npu_sparse_flash_attention_from_fa_causal_bsnd: 3, npu_sparse_flash_attention_from_fa_unmasked_bsnd: 0}


# ---- checks -------------------------------------------------------------------------------
GRAD_OP = SFA.backward  # "npu.npu_sparse_flash_attention_grad"


def _training_reason(site):
    """For a site on a joint graph (its nodes include backward ones): the replacement emits
    npu_sparse_flash_attention(return_softmax_lse=True) and, through its autograd, the grad
    op. torchair's GE graph mode (max-autotune) can lower neither: the grad op has no GE
    converter, and the docs refuse return_softmax_lse in graph mode. Refused there; in
    emulation the site says so."""
    if not any(is_backward(node) for node in site.nodes):
        return None
    reason = not_lowerable(GRAD_OP, site.mode or GE_MODES[0])
    if reason is None:
        return None
    reason = (f"training: {reason}, and the op's docs do not support return_softmax_lse (which the "
              "backward needs) in graph mode")
    if site.mode is None:
        site.notes.append(f"in {GE_MODES[0]}: {reason}")
        return None
    return reason if site.mode in GE_MODES else None


def check(site):
    reason = _training_reason(site)
    if reason is not None:
        return reason
    if site.form.search in (mla_gathered_top_k, mla_gathered_top_k_causal):
        return _check_mla(site)
    if site.form.bound:
        query, key, value = site["query"], site["key"], site["value"]
        proof = top_k_mask_proof(site.arg_nodes["mask"])
        if isinstance(proof, str):
            return proof
        mode, indices_node, why = proof
        rows = tensor_meta(indices_node).shape
        if not (known_equal(rows[0], query.shape[0]) and known_equal(rows[1], query.shape[2])):
            return (f"the indices {list(rows)} do not hold one row per query of the attention's "
                    f"{list(query.shape)} (batch, queries)")
    else:
        query, key, value = site["query"], site["key"], site["value"]
        mode, why = sparse_mode_of(site.arg_nodes["mask"])
        if mode is None:
            return why
        reason = _listed_once(site.arg_nodes["indices"], mode, query.shape[2], key.shape[2])
        if reason is not None:
            return reason
    if mode != _MODE[site.form.replace]:
        return f"{why}: sparse_mode {mode}, not {_MODE[site.form.replace]}"
    if key.shape[1] != value.shape[1] or key.shape[-2] != value.shape[-2]:
        return f"key {list(key.shape)} and value {list(value.shape)} differ in heads or length"
    if query.shape[-1] < value.shape[-1] or query.shape[-1] != key.shape[-1]:
        return (f"query/key head dim {query.shape[-1]}/{key.shape[-1]} and value head dim "
                f"{value.shape[-1]}: the op needs q = k = [v-sized part, rope part]")
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} key heads"
    reason = site.hardware_limits(_hardware_reasons(query, key, value, site.soc))
    if reason is None and site.form.bound:
        site.bind("indices", indices_node)
        site.notes.append(why)
    return reason


# ---- the proof of a given mask: causal & listed in top-k indices ------------------------------
_ELEMENTWISE = (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
                aten.neg.default, aten.isinf.default, aten.isneginf.default, aten.eq.Scalar, aten.eq.Tensor,
                aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor,
                aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor, aten.bitwise_and.Tensor,
                aten.bitwise_or.Tensor, aten.logical_and.default, aten.logical_or.default, aten.bitwise_not.default,
                aten.logical_not.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
                aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
                aten.unsqueeze.default, aten.expand.default)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim,
             aten.squeeze.default)
_REGION_LIMIT = 40  # nodes between a mask and its scatter: a handful in the models


def _scatters_reached(mask):
    """(the scatter nodes the mask is computed from, the mask's dims' roles when each mask
    element (b, s, t) reads the scatter's element (b, s, t): every path between them
    elementwise with broadcasting, dims inserted or size-1 dims dropped, no permute; else
    None), or None for a region too large to follow."""
    region, stack = set(), [mask]
    while stack:  # the region above the mask
        node = stack.pop()
        if node in region or not isinstance(node, torch.fx.Node):
            continue
        region.add(node)
        if len(region) > _REGION_LIMIT:
            return None
        if node.op == "call_function" and not is_call(node, aten.scatter.value, aten.scatter.src):
            stack.extend(node.all_input_nodes)
    scatters = sorted(n for n in region if is_call(n, aten.scatter.value, aten.scatter.src))
    if len(scatters) != 1:
        return scatters, None
    dims = {scatters[0]: list(range(tensor_meta(scatters[0]).dim()))}  # per dim: the scatter's dim it reads
    for node in sorted(region):  # graph order: inputs first
        if node in dims or not any(a in dims for a in node.all_input_nodes):
            continue
        found = _dims_read(node, dims)
        if found is None:
            return scatters, None
        dims[node] = found
    return scatters, _roles(dims.get(mask), tensor_meta(mask), tensor_meta(scatters[0]))


def _roles(read, mask, leaf):
    """The mask's dims as MaskTerm roles ("b", "s", "t", None for a size-1 dim) read off which
    of the scatter's dims each reads: its last two the scatter's last two (queries, keys), at
    most one other the scatter's batch; None where the mask reads the scatter otherwise (a
    transposed or diagonal read) or has a dim of size > 1 the scatter does not index."""
    if read is None:
        return None
    rank, last = mask.dim(), leaf.dim() - 1
    if read[-1] != last or not (read[-2] == last - 1 or (read[-2] is None and _is_one(mask.shape[-2])
                                                         and _is_one(leaf.shape[-2]))):
        return None
    roles = [None] * (rank - 2) + ["s", "t"]
    batch = [d for d in range(rank - 2) if read[d] is not None]
    if len(batch) > 1 or any(read[d] is None and not _is_one(mask.shape[d]) for d in range(rank - 2)):
        return None
    for d in batch:
        roles[d] = "b"
    return roles


def _is_one(size):
    """A size known to be 1 (a symbolic size is not: dynamo specialises sizes 0 and 1); no guard."""
    return isinstance(size, int) and size == 1


def _dims_read(node, dims):
    """Per dim of `node`, the scatter's dim it reads (None: none, broadcast), from its inputs'
    (`dims`); None where the op moves elements otherwise (a permute, a reshape of non-1 dims)."""
    meta = tensor_meta(node)
    if meta is None:
        return None
    rank = meta.dim()
    if is_call(node, aten.unsqueeze.default):
        read = list(dims[node.args[0]])
        read.insert(node.args[1] % rank, None)
        return read
    if is_call(node, *_RESHAPES):
        source = tensor_meta(node.args[0])
        kept = [(k, size) for k, size in zip(dims[node.args[0]], source.shape) if not _is_one(size)]
        sizes = [size for size in meta.shape if not _is_one(size)]
        if len(kept) != len(sizes) or not all(known_equal(a, b) for (_, a), b in zip(kept, sizes)):
            return None
        it = iter(k for k, _ in kept)
        return [None if _is_one(size) else next(it) for size in meta.shape]
    if not (is_call(node, *_ELEMENTWISE) or is_cast(node)):
        return None
    read = [None] * rank
    for a in node.all_input_nodes:  # right-aligned broadcasting
        if a not in dims:
            continue
        shape = tensor_meta(a).shape
        offset = rank - len(shape)
        for d, k in enumerate(dims[a]):
            if k is None or _is_one(shape[d]):
                continue
            if read[d + offset] not in (None, k):
                return None
            read[d + offset] = k
    return read


def top_k_mask_proof(mask):
    """(sparse_mode, indices node, why) when the bool mask (True: the key is visible) shows each
    query exactly the keys its row of an index tensor lists that the right-down causal mask (3)
    or nothing (0) lets through, each visible listed key once; else the reason it is not proven.

    Proven, not sampled: the mask is elementwise (with broadcasting only) in one scatter of a
    scalar into a constant fill along the keys, and in values computed from sizes; its value
    were every element the fill, and were every element the scattered scalar, is decided for
    every size (symbolic_values.mask_mode_with_leaf): hidden everywhere, and causal (or
    nothing hidden). The scattered index tensor must list no visible key twice
    (_listed_once)."""
    meta = tensor_meta(mask)
    if meta is None or meta.dtype != torch.bool or meta.dim() < 2:
        return "the attention mask is not a bool (.., S, T) tensor"
    found = _scatters_reached(mask)
    if found is None:
        return "the attention mask is computed by more ops than the top-k mask proof follows"
    scatters, roles = found
    if len(scatters) != 1:
        return (f"the attention mask is computed from {len(scatters)} scatters, not one scatter of top-k indices: "
                "npu_sparse_flash_attention needs the keys it lists")
    scatter = scatters[0]
    base, dim, index, listed = scatter.args[:4]
    out = tensor_meta(scatter)
    if dim not in (-1, out.dim() - 1) or not isinstance(listed, (int, float, bool)):
        return "the mask's scatter does not write one scalar along the keys (its last dim)"
    if roles is None:
        return ("the attention mask reads its scatter through a permute, slice or reshape, or has a dim the "
                "scatter does not index: the proof follows elementwise ops, broadcasting and inserted dims only, "
                "with the mask's (batch, query, key) reading the scatter's")
    queries, keys = meta.shape[-2], meta.shape[-1]
    rows = tensor_meta(index)
    if (rows is None or rows.dim() != 3 or out.dim() != 3
            or not all(known_equal(a, b) for a, b in zip(rows.shape[:-1], out.shape[:-1]))):
        return ("the mask's scatter is not a (B, S, T) tensor written at (B, S, k) indices, one row of keys per "
                "query, as npu_sparse_flash_attention's sparse_indices are")
    fill = _constant_fill(base)
    if fill is None:
        return "the mask's scatter writes into a tensor that is not one constant"
    unlisted, why_unlisted = mask_mode_with_leaf(mask, roles, scatter, fill, queries, keys)
    if unlisted != "all":
        return f"a key the indices do not list is not hidden by the attention mask: {why_unlisted}"
    mode, why = mask_mode_with_leaf(mask, roles, scatter, listed, queries, keys)
    if mode not in ("causal", "none"):
        return (f"the keys the indices list are not shown by the attention mask as the right-down causal mask or no "
                f"mask shows them ({why}): npu_sparse_flash_attention's sparse_mode 3 / 0 cannot express it")
    sparse_mode = 3 if mode == "causal" else 0
    reason = _listed_once(index, sparse_mode, queries, keys)
    if reason is not None:
        return reason
    return sparse_mode, index, ("the attention mask shows the keys its top-k indices list, under the right-down "
                                "causal mask" if sparse_mode == 3 else "the attention mask shows the keys its top-k "
                                "indices list") + " (proven for every size)"


def _constant_fill(node):
    """The one value of a tensor every element of which is it (full, full_like, new_full,
    ones, zeros ...), or None."""
    meta = tensor_meta(node)
    value = formula_of(node, meta.shape) if meta is not None else None
    if value is None or getattr(value, "free_symbols", set()):
        return None
    try:
        return float(value) if not value.is_Boolean else bool(value)
    except (TypeError, AttributeError):
        return None


def _plain(node):
    while is_call(node, aten._to_copy.default, aten.clone.default, aten.alias.default,
                  torch.ops.prims.convert_element_type.default):
        node = node.args[0]
    return node


def _top_k_indices_of(node):
    """The top-k whose indices `node` is (through casts), taken along the last dim, or None."""
    node = _plain(node)
    if is_call(node, operator.getitem) and node.args[1] == 1 and is_call(node.args[0], aten.topk.default):
        topk = node.args[0]
        dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
        if dim in (-1, tensor_meta(topk.args[0]).dim() - 1):
            return topk
    return None


def _listed_once(index, sparse_mode, queries, keys):
    """Why the index tensor may list a key the query sees twice (the op would count it twice,
    the mask shows it once), or None: its rows are a top-k's indices (distinct), or those
    with the slots whose key the causal mask hides replaced by one constant c >= T - 1
    (torchtitan-npu's sentinel T - 1: scatter takes no -1). Such a slot of query i held a
    key j > i + T - S, and j <= T - 1 <= c: c is hidden from query i too, so its copies and
    the hidden keys it replaced add nothing."""
    if _top_k_indices_of(index) is not None:
        return None
    node = _plain(index)
    if not is_call(node, aten.where.self) or sparse_mode != 3:
        return ("the indices the mask is scattered from are not a top-k's (whose entries are distinct): a key listed "
                "twice would count twice in npu_sparse_flash_attention and once in the mask")
    condition, picked, sentinel = node.args[:3]
    if _top_k_indices_of(picked) is None:
        return "the indices the mask is scattered from keep slots of something other than a top-k's indices"
    reason = _hidden_where_replaced(condition, _plain(picked), tensor_meta(node), queries, keys)
    if reason is not None:
        return reason
    meta = tensor_meta(node)
    value = sentinel if not isinstance(sentinel, torch.fx.Node) else formula_of(sentinel, meta.shape)
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if value is None or getattr(value, "free_symbols", set()) & _index_symbols(meta.dim()):
        return "the indices' replacement for hidden slots is not one constant"
    if not decided_nonnegative(value - (size_expr(keys) - 1), node):
        return (f"the indices' replacement for slots the causal mask hides ({value}) is not proven >= T - 1: a key "
                "the query sees may be listed twice")
    return None


def _index_symbols(rank):
    return {index_symbol(d) for d in range(rank)}


def _hidden_where_replaced(condition, picked, meta, queries, keys):
    """None if `condition` keeps exactly the slots whose key `picked` the right-down causal mask
    shows its query: picked <= i + T - S (or < i + T - S + 1) for the slot's query i, whatever
    side the comparison writes it on."""
    if is_call(condition, aten.le.Tensor, aten.lt.Tensor) and _plain(condition.args[0]) is picked:
        bound, strict = condition.args[1], is_call(condition, aten.lt.Tensor)
    elif is_call(condition, aten.ge.Tensor, aten.gt.Tensor) and _plain(condition.args[1]) is picked:
        bound, strict = condition.args[0], is_call(condition, aten.gt.Tensor)
    else:
        return ("the indices' slots are replaced where a condition other than `index <= query position` holds: "
                "the replacement is not proven hidden")
    value = formula_of(bound, meta.shape) if isinstance(bound, torch.fx.Node) else None
    if value is None:
        return "the indices' slots are replaced by a comparison with something other than the query positions"
    expected = index_symbol(meta.dim() - 2) + size_expr(keys) - size_expr(queries) + (1 if strict else 0)
    if sympy.simplify(value - expected) != 0:
        return (f"the indices' slots are kept where index <= {value}, not where the causal mask shows the key "
                f"(index <= {expected})")
    return None


def _check_mla(site):
    q_nope, q_rope, kv, k_rope = site["q_nope"], site["q_rope"], site["kv"], site["k_rope"]
    if site["scale"] <= 0:
        return f"scale {site['scale']} <= 0"
    producer = _indices_producer(site.arg_nodes["indices"])
    if producer is None:
        # the form masks every negative slot, the op stops at the first one
        return ("the indices come neither from a top-k nor from npu_lightning_indexer: their -1 "
                "slots are not known to be trailing, which the op assumes")
    limits = SFA.limits
    return site.hardware_limits([
        unsupported("npu.npu_sparse_flash_attention", site.soc, x=q_nope),
        f"latent dim {kv.shape[-1]}, the kernels take {limits['head_dim']}"
        if kv.shape[-1] != limits["head_dim"] else None,
        f"rope dim {k_rope.shape[-1]}, the kernels take {limits['rope_head_dim']}"
        if k_rope.shape[-1] != limits["rope_head_dim"] else None,
        f"{q_nope.shape[2]} query heads" if q_nope.shape[2] not in limits["query_heads"] else None,
        f"q_rope {str(q_rope.dtype)[6:]} and kv {str(kv.dtype)[6:]} differ from q_nope's dtype"
        if {q_rope.dtype, kv.dtype, k_rope.dtype} != {q_nope.dtype} else None,
    ])


def _indices_producer(node):
    """The top-k or lightning indexer the indices come from (through casts and views), or None."""
    while is_call(node, aten._to_copy.default, aten.view.default, aten.reshape.default,
                  aten.squeeze.dim, aten.clone.default):
        node = node.args[0]
    if is_call(node, operator.getitem):
        source = node.args[0]
        if is_call(source, aten.topk.default, torch.ops.npu.npu_lightning_indexer):
            return source
    return None


def _hardware_reasons(query, key, value, soc):
    limits = SFA.limits
    rope = query.shape[-1] - value.shape[-1]
    return [
        unsupported("npu.npu_sparse_flash_attention", soc, x=query),
        f"head dim {value.shape[-1]}, the kernels take {limits['head_dim']} (MLA latent)"
        if value.shape[-1] != limits["head_dim"] else None,
        f"rope dim {rope}, the kernels take {limits['rope_head_dim']}"
        if rope and rope != limits["rope_head_dim"] else None,
        f"{key.shape[1]} key heads, the kernels take {limits['key_heads']} (MLA: value is the key)"
        if key.shape[1] != limits["key_heads"] else None,
        f"{query.shape[1]} query heads" if query.shape[1] not in limits["query_heads"] else None,
    ]


# ---- near misses: a mask scattered from top-k indices, feeding attention ----------------------
def _flash_attention_ops():
    return (torch.ops.npu.npu_fusion_attention_v3.default, torch.ops.npu.npu_fusion_attention.default)


def _given_mask_of(node):
    """The mask an attention node applies, as the given-mask forms take it: FlashAttention's
    atten_mask, or the `where` bias added to the scores _safe_softmax normalises; else None."""
    if is_call(node, aten._safe_softmax.default):
        add = node.args[0]
        if is_call(add, aten.add.Tensor):
            return next((a for a in add.args if is_call(a, aten.where.self)), None)
        return None
    if node.op == "call_function" and node.target in _flash_attention_ops():
        return node.args[7] if len(node.args) > 7 else node.kwargs.get("atten_mask")
    return None


def _is_transformers_top_k_mask(node):
    return (is_call(node, aten.scatter.value) and node.args[3] is False
            and is_call(node.args[0], aten.new_ones.default, aten.ones.default, aten.ones_like.default))


def _attention_over_a_scattered_mask(node):
    """An attention whose mask is computed from a scatter (other than transformers' top-k mask,
    itself an anchor): a top-k mask the model materialised its own way."""
    mask = _given_mask_of(node)
    if not isinstance(mask, torch.fx.Node):
        return False
    found = _scatters_reached(mask)
    return bool(found and found[0]) and not any(_is_transformers_top_k_mask(n) for n in found[0])


def anchor(node):
    """scatter(ones, -1, indices, False): the model deselects everything but the top-k keys;
    an index of keys by clamped top-k indices: it gathers them; or an attention whose mask is
    computed from a scatter (the given-mask forms' sites)."""
    if is_call(node, aten.scatter.value):
        return _is_transformers_top_k_mask(node)
    if is_call(node, aten._safe_softmax.default) or (node.op == "call_function"
                                                     and node.target in _flash_attention_ops()):
        return _attention_over_a_scattered_mask(node)
    if not is_call(node, aten.clamp.default) or tensor_meta(node) is None or tensor_meta(node).is_floating_point():
        return False
    users = [u2 for u in node.users for u2 in (u.users if is_call(u, aten._to_copy.default) else [u])]
    return any(is_call(u, aten.index.Tensor) for u in users)


def explain(node):
    if not is_call(node, aten.clamp.default, aten.scatter.value):
        reason = ("an attention over a mask computed from a scatter, in a form other than SDPA over that bool mask "
                  "(its CPU math decomposition, or torch_npu's FlashAttention as an NPU compile records it)")
        if is_training_graph(node.graph):
            # the output's gradient itself may arrive in any layout (torchtitan-npu's DeepSeek-V3.2
            # on the CPU graph: a copy of the permuted gradient of the einsum through wo): the
            # joint graph's canonicalisation leaves that copy outside the match
            # (canonical.gradient_copies_apart)
            reason += ("; in a training graph the joint forms take the output's gradient in any layout (a copy of "
                       "it stays outside the match) but are traced with q, k and v all differentiable: a site where "
                       "one of them gets no gradient (a frozen projection) is not covered, and after partitioning "
                       "the intermediates saved for the backward keep its forward unfused")
        return reason
    if is_call(node, aten.clamp.default):
        return ("keys gathered by clamped top-k indices, in a form other than the absorbed MLA "
                "attention (latent and rope keys gathered, einsum scores, -1 slots masked, softmax)")
    return ("a top-k key mask that reaches no attention of the transformers form (the mask "
            "and-ed into the causal mask, then SDPA's math decomposition or, as an NPU compile records "
            "SDPA, logical_not into npu_fusion_attention_v3 / npu_fusion_attention)")


def could_match(graph):
    """Whether the graph holds the ops every form needs: the top-k mask's scatter and SDPA's
    _safe_softmax or torch_npu's FlashAttention (transformers), or the clamp and gather of the
    keys (absorbed MLA). Its
    many forms (joint ones especially) take seconds to register."""
    targets = {node.target for node in graph.nodes if node.op == "call_function"}
    flash = {torch.ops.npu.npu_fusion_attention_v3.default, torch.ops.npu.npu_fusion_attention.default}
    return ((aten.scatter.value in targets and (aten._safe_softmax.default in targets or flash & targets))
            or {aten.clamp.default, aten.index.Tensor} <= targets)


PASS = FusionPass(
    name="sparse_attention",
    fused_op="npu.npu_sparse_flash_attention",
    forms=FORMS,
    example={
        # B=2, N=3 heads, S=T=7; q, k head dim 24 = v's 16 + rope 8; k=5 indices per query.
        # value is a slice of a wider tensor (transformers splits it from k_nope), as in
        # the models: its matmul then copies it (clone + _unsafe_view)
        "query": lambda dtype: torch.empty(2, 3, 7, 24, dtype=dtype),
        "key": lambda dtype: torch.empty(2, 3, 7, 24, dtype=dtype),
        "value": lambda dtype: torch.empty(2, 7, 3, 32, dtype=dtype).transpose(1, 2)[..., 16:],
        "indices": lambda dtype: torch.empty(2, 7, 5, dtype=torch.int32),
        "mask": lambda dtype: torch.empty(2, 1, 7, 7, dtype=torch.bool),
        "sqrt_scale": math.sqrt(0.125),
        # absorbed MLA: N=3 heads over a 24-wide latent (also the value), rope 8, a prefill
        # (T = S = 7 keys: the shape of training graphs, whose joint patterns are traced at
        # this example only; decode-like shapes are a variant below)
        "q_nope": lambda dtype: torch.empty(2, 7, 3, 24, dtype=dtype),
        "q_rope": lambda dtype: torch.empty(2, 7, 3, 8, dtype=dtype),
        "kv": lambda dtype: torch.empty(2, 7, 24, dtype=dtype),
        "k_rope": lambda dtype: torch.empty(2, 7, 8, dtype=dtype),
        "scale": 0.125,
    },
    # batch 1: torch's matmul then views where it copies at batch 2
    example_variants=[{
        "query": lambda dtype: torch.empty(1, 3, 7, 24, dtype=dtype),
        "key": lambda dtype: torch.empty(1, 3, 7, 24, dtype=dtype),
        "value": lambda dtype: torch.empty(1, 7, 3, 32, dtype=dtype).transpose(1, 2)[..., 16:],
        "indices": lambda dtype: torch.empty(1, 7, 5, dtype=torch.int32),
        "mask": lambda dtype: torch.empty(1, 1, 7, 7, dtype=torch.bool),
        "q_nope": lambda dtype: torch.empty(1, 7, 3, 24, dtype=dtype),
        "q_rope": lambda dtype: torch.empty(1, 7, 3, 8, dtype=dtype),
        "kv": lambda dtype: torch.empty(1, 9, 24, dtype=dtype),
        "k_rope": lambda dtype: torch.empty(1, 9, 8, dtype=dtype),
    }, {  # decode-like: fewer queries than keys (T = 9)
        "kv": lambda dtype: torch.empty(2, 9, 24, dtype=dtype),
        "k_rope": lambda dtype: torch.empty(2, 9, 8, dtype=dtype),
    }, {
        "q_nope": lambda dtype: torch.empty(1, 7, 3, 24, dtype=dtype),
        "q_rope": lambda dtype: torch.empty(1, 7, 3, 8, dtype=dtype),
        "indices": lambda dtype: torch.empty(1, 7, 5, dtype=torch.int32),
        "kv": lambda dtype: torch.empty(1, 7, 24, dtype=dtype),
        "k_rope": lambda dtype: torch.empty(1, 7, 8, dtype=dtype),
    }],
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (aten.scatter.value, aten.clamp.default, aten._safe_softmax.default, *_flash_attention_ops()),
    explain=explain,
    verify_input=lambda name, args: _top_k_indices(args) if name == "indices" else None,
    differentiable=("query", "key", "value", "q_nope", "q_rope", "kv", "k_rope"),
    prefilter=could_match,
)


def _top_k_indices(args):
    """Verification indices as a causal top-k gives them: distinct keys per query, the keys the
    query sees (0 .. T - S + i, the right-down causal mask of sparse_mode 3 and of the MLA
    form) first, in random order, then hidden ones. A key listed twice would count twice in the
    op, once in the model's mask. And every query lists a key it sees, as a top-k over scores
    masked to -inf past the causal limit always does (k >= 1 finite scores come first): with
    uniformly random keys a query can list only future keys, and the MLA form's softmax over a
    row of -inf is NaN (the op's is 0), a row no model computes that failed verification."""
    batch, queries, count = (int(size) for size in args["indices"].shape)
    keys = int(args["key"].shape[-2] if "key" in args else args["kv"].shape[1])
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        for query in range(queries):
            seen = max(1, min(keys, keys - queries + query + 1))
            order = torch.cat([torch.randperm(seen, generator=generator),
                               seen + torch.randperm(keys - seen, generator=generator)])
            rows.append(order[:count])
    return torch.stack(rows).view(batch, queries, count).to(args["indices"].dtype)
