"""attention: dense attention in inference graphs -> npu_fused_infer_attention_score (FIA).

    out = softmax(scale * query @ key^T + mask) @ value          (B, N, S_q, D) in, BNSD

The unfused forms are what transformers' attention reaches an aot graph as on CPU
(shared/reference/attention_inference.md 3.3):

- SDPA's CPU decomposition: `_scaled_dot_product_flash_attention_for_cpu`, with a bool mask
  turned into `where(mask, 0, -inf)` inside SDPA, or `is_causal=True` without a mask (a
  prefill into an empty cache); and SDPA's math path (`_safe_softmax` between two matmuls,
  q and k^T each scaled by sqrt(scale)) where the head dims of q and v differ (DeepSeek's
  MLA, D_qk = nope + rope > D_v), upcast to fp32 in half precision;
- eager attention (`eager_attention_forward`): matmul, * scale, + the additive mask
  `where(mask, 0, finfo.min)`, softmax in fp32, dropout(p=0) (a clone in the aot graph), matmul;
- GQA: transformers' `repeat_kv` (unsqueeze, expand, reshape) of the key and the value
  before attention. FIA reads N_kv heads itself (num_key_value_heads), so the copy goes;
- SDPA with the model's own float mask (`triu(full(-inf), 1)`, litgpt's sliding window),
  proven to hold only 0 and hiding values.
Any other spelling (other codebases: a divided or folded scale, baddbmm / bmm, einsum
layouts, several masks) is recognised by what it computes (`recognize`, the engine's axis
algebra), and what FIA cannot compute (a soft-cap, a bias) is a near miss saying so.

The mask decides the sparse_mode (FIA's mask is True where a key is NOT attended, the
opposite of SDPA's bool mask):
- proven right-down causal at compile time (built from aranges only, constants.sparse_mode_of):
  sparse_mode 3 with the compressed mask triu(ones(2048, 2048), 1);
- otherwise (a static cache's mask depends on its cumulative_length, an input; a caller's
  padding mask; a sliding window; a mask that masks nothing) the mask itself: logical_not(mask), sparse_mode 0, with
  the invalid-row correction (inner_precise 2) when S_q > 1, as torch_npu's own SDPA does.
  That is exact whatever the mask is; the site's note says it could not be proven causal;
- is_causal=True: torch's top-left causal mask, sparse_mode 2 (= 3 when S_q = S_kv).
In decode (S_q = 1, FIA's incremental branch) the kernel reads all max_cache_len keys of
a static cache under the explicit mask: actual_seq_lengths_kv would limit it to the valid
ones, but it is a host int list and the cache length lives on the device.

FIA takes key and value of one shape: where D_v < D_qk, value is zero-padded to D_qk and
the output cut back (exact: the padding columns only add zero outputs). Layout: BNSD, as
the models hold q, k and v, with a copy of whatever is not contiguous (the op takes no
strided input). BSND (which the stand-in implements too) would save the query's copy in a
prefill, but which memory layout runs is decided only after every pass (a fused rope's
output is contiguous), so a layout chosen from the strides seen here could be wrong.

Inference only: FIA has no backward. In a training graph SDPA's logsumexp (or eager's
probabilities) is saved for the backward, no form matches, and the site is reported; on
an NPU the training graph already holds npu_fusion_attention(_v3), which has one.

Hardware limits (fp16/bf16 only, head dims, head counts) come from the capability table:
in emulation (no SoC) a site fuses and the note says what a real NPU would refuse.
"""
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.constants import MaskTerm, fill_note, hidden_keys, hides, mask_mode, sparse_mode_of, value_set
from npu_fx_fusion.matching import (AxisEvaluation, Form, FusionPass, NotEvaluable, Recognized, atom_sizes, atoms_of,
                                    is_call, read_masked_scores, rearrange, region_between, sdpa_as_on_npu, strip_casts,
                                    tensor_meta)

aten = torch.ops.aten
FIA = CAPABILITIES["npu.npu_fused_infer_attention_score"]
COMPRESSED = FIA.limits["compressed_mask_size"]


# ---- the unfused forms --------------------------------------------------------------------
def repeat_kv(hidden, groups):
    # transformers' repeat_kv (integrations/sdpa_attention.py, models/*/modeling_*.py)
    batch, heads, length, dim = hidden.shape
    return hidden.unsqueeze(2).expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _sdpa_bias(mask, query):
    # SDPA's CPU path turns a bool mask (True = attend) into an additive one
    zero = aten.scalar_tensor.default(0.0, dtype=query.dtype, layout=torch.strided, device=query.device)
    minus_inf = aten.scalar_tensor.default(float("-inf"), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, minus_inf)


def sdpa_cpu_masked(query, key, value, mask, scale):
    """F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, scale=s) on CPU."""
    bias = _sdpa_bias(mask, query)
    return aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, attn_mask=bias,
                                                                      scale=scale)[0]


def sdpa_cpu_masked_gqa(query, grouped_key, grouped_value, mask, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return sdpa_cpu_masked(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), mask, scale)


def sdpa_cpu_additive(query, key, value, bias, scale):
    """F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=s) on CPU: the
    model's own additive mask (`triu(full(-inf), 1)`, litgpt's sliding window), which the
    check proves holds only 0 and hiding values."""
    return aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, attn_mask=bias,
                                                                      scale=scale)[0]


def sdpa_cpu_additive_gqa(query, grouped_key, grouped_value, bias, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return sdpa_cpu_additive(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), bias, scale)


def sdpa_cpu_causal(query, key, value, scale):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s) on CPU (no mask)."""
    return aten._scaled_dot_product_flash_attention_for_cpu.default(query, key, value, 0.0, True, scale=scale)[0]


def sdpa_cpu_causal_gqa(query, grouped_key, grouped_value, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return sdpa_cpu_causal(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), scale)


# SDPA as an A2/A3 compile records it (torch_npu's own kernel, reproduced by the NPU dispatch
# emulation, docs/npu-graph.md): the bool mask as Ascend's (logical_not) or, for is_causal,
# ones/triu with sparse_mode 2, into npu_fusion_attention_v3, output 0. The forms call the
# emulation's kernel itself, so they spell exactly what it records (the same FA-v3 spelling
# sparse_attention matches). Ascend950 records npu_fusion_attention, for which FIA is not
# emitted (capability table): those calls are anchors with that reason (explain).
_NPU_SDPA = sdpa_as_on_npu("Ascend910B")


def sdpa_npu_masked(query, key, value, mask, scale):
    """F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, scale=s) on an NPU."""
    return _NPU_SDPA(query, key, value, attn_mask=mask, scale=scale)


def sdpa_npu_masked_gqa(query, grouped_key, grouped_value, mask, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return sdpa_npu_masked(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), mask, scale)


def sdpa_npu_causal(query, key, value, scale):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s) on an NPU; with fewer
    key heads too (transformers' enable_gqa without a mask: FA takes N_kv itself)."""
    return _NPU_SDPA(query, key, value, is_causal=True, scale=scale)


def sdpa_npu_causal_gqa(query, grouped_key, grouped_value, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return sdpa_npu_causal(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), scale)


def _sdpa_math(query, key, value, mask, sqrt_scale, mask_dtype):
    # SDPA's math decomposition (_scaled_dot_product_attention_math): q and k^T each scaled
    # by sqrt(scale), the bool mask made additive in the caller's dtype
    zero = aten.scalar_tensor.default(0.0, dtype=mask_dtype, layout=torch.strided, device=query.device)
    minus_inf = aten.scalar_tensor.default(float("-inf"), dtype=mask_dtype, device=query.device)
    bias = torch.where(mask, zero, minus_inf)
    scores = aten.mul.Scalar(query, sqrt_scale) @ aten.mul.Scalar(key.transpose(-2, -1), sqrt_scale)
    return aten._safe_softmax.default(scores + bias, -1) @ value


def sdpa_math_masked(query, key, value, mask, sqrt_scale):
    """SDPA on CPU where q's and v's head dims differ (MLA): the math path."""
    return _sdpa_math(query, key, value, mask, sqrt_scale, query.dtype)


def sdpa_math_masked_upcast(query, key, value, mask, sqrt_scale):
    """The same in bf16/fp16: the math path computes in fp32 and casts back."""
    return _sdpa_math(query.float(), key.float(), value.float(), mask, sqrt_scale, query.dtype).to(query.dtype)


def eager_attention(query, key, value, bias, scale):
    """transformers eager_attention_forward (no GQA): the additive mask is the model's
    where(mask, 0, finfo.min), shared by the layers."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    weights = weights + bias
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    # nn.functional.dropout(weights, p=0.0, training=False): aot_autograd records a clone
    weights = weights.clone()
    return torch.matmul(weights, value)


def eager_attention_gqa(query, grouped_key, grouped_value, bias, scale):
    groups = query.shape[1] // grouped_key.shape[1]
    return eager_attention(query, repeat_kv(grouped_key, groups), repeat_kv(grouped_value, groups), bias, scale)


# ---- the fused calls ----------------------------------------------------------------------
def _fia(query, key, value, scale, atten_mask=None, sparse_mode=0):
    """FIA on (B, N, S, D) query and (B, N_kv, S_kv, D) key / value; (B, N, S, D_v) out.

    BNSD, each input made contiguous (the op takes no strided tensor). The strides a pass
    sees are not the ones that run once a later pass replaces the producer (a fused rope's
    output is contiguous where the model's was a transposed view), so the layout is not
    chosen by strides: a copy recorded here that turns out to copy nothing is dropped by
    torchair's remove_noop_ops."""
    heads, kv_heads = query.shape[1], key.shape[1]
    dim, dim_v = query.shape[-1], value.shape[-1]
    if scale is None:  # SDPA's default (scale=None reaches its CPU op as is): 1 / sqrt(E)
        scale = 1.0 / math.sqrt(dim)
    if dim_v < dim:  # FIA takes key and value of one shape: zero columns add zero outputs
        value = F.pad(value, (0, dim - dim_v))
    q, k, v = (t.contiguous() for t in (query, key, value))
    explicit = atten_mask is not None and sparse_mode == 0
    inner_precise = 2 if explicit and query.shape[2] > 1 else 0  # invalid-row correction, as torch_npu's SDPA
    out, _ = torch.ops.npu.npu_fused_infer_attention_score(
        q, k, v, atten_mask=atten_mask, num_heads=heads, scale=scale, input_layout="BNSD",
        num_key_value_heads=kv_heads, sparse_mode=sparse_mode, inner_precise=inner_precise)
    return out[..., :dim_v] if dim_v < dim else out


def _compressed_mask(query):
    return torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=query.device).triu(1)


def fia_right_down_causal(query, key, value, mask, scale):
    return _fia(query, key, value, scale, _compressed_mask(query), sparse_mode=3)


def fia_explicit_mask(query, key, value, mask, scale):
    return _fia(query, key, value, scale, torch.logical_not(mask))


def fia_right_down_causal_math(query, key, value, mask, sqrt_scale):
    return _fia(query, key, value, sqrt_scale * sqrt_scale, _compressed_mask(query), sparse_mode=3)


def fia_explicit_mask_math(query, key, value, mask, sqrt_scale):
    return _fia(query, key, value, sqrt_scale * sqrt_scale, torch.logical_not(mask))


def fia_right_down_causal_additive(query, key, value, bias, scale):
    return _fia(query, key, value, scale, _compressed_mask(query), sparse_mode=3)


def fia_explicit_additive_mask(query, key, value, bias, scale):
    # the check proved bias = where(mask, 0, very negative): nonzero = masked out
    return _fia(query, key, value, scale, torch.ne(bias, 0))


def fia_top_left_causal(query, key, value, scale):
    # torch's is_causal is top-left aligned: sparse_mode 2 (equal to 3 when S_q = S_kv)
    mode = 3 if query.shape[2] == key.shape[2] else 2
    return _fia(query, key, value, scale, _compressed_mask(query), sparse_mode=mode)


_CAUSAL, _EXPLICIT, _TOP_LEFT = "right-down causal", "explicit mask", "top-left causal"
_MODE = {fia_right_down_causal: _CAUSAL, fia_explicit_mask: _EXPLICIT,
         fia_right_down_causal_math: _CAUSAL, fia_explicit_mask_math: _EXPLICIT,
         fia_right_down_causal_additive: _CAUSAL, fia_explicit_additive_mask: _EXPLICIT,
         fia_top_left_causal: _TOP_LEFT}
_BY_MASK = {
    "bool": (fia_right_down_causal, fia_explicit_mask),
    "math": (fia_right_down_causal_math, fia_explicit_mask_math),
    "additive": (fia_right_down_causal_additive, fia_explicit_additive_mask),
}


def _forms(search, mask_kind, dtypes):
    # one search, one replacement per mask proof, tried in this order: the check keeps the
    # first the mask allows (a runtime mask ends at the explicit one, whose note says why)
    return [Form(search, replace, dtypes=dtypes) for replace in _BY_MASK[mask_kind]]


FP32 = (torch.float32,)  # no casts in the search: one trace matches every dtype
HALF = (torch.bfloat16,)  # the upcast forms (their casts are dtype-blind in the pattern)
FORMS = [
    # GQA first: the repeat_kv copies are part of it. The NPU spelling first: an NPU graph
    # (FusionConfig(npu_dispatch=True), the default) holds it; FA-v3 takes every dtype itself
    *_forms(sdpa_npu_masked_gqa, "bool", FP32),
    *_forms(sdpa_npu_masked, "bool", FP32),
    Form(sdpa_npu_causal_gqa, fia_top_left_causal, dtypes=FP32),
    Form(sdpa_npu_causal, fia_top_left_causal, dtypes=FP32),
    *_forms(sdpa_cpu_masked_gqa, "bool", FP32),
    *_forms(sdpa_cpu_masked, "bool", FP32),
    *_forms(sdpa_cpu_additive_gqa, "additive", FP32),
    *_forms(sdpa_cpu_additive, "additive", FP32),
    Form(sdpa_cpu_causal_gqa, fia_top_left_causal, dtypes=FP32),
    Form(sdpa_cpu_causal, fia_top_left_causal, dtypes=FP32),
    *_forms(sdpa_math_masked, "math", FP32),
    *_forms(sdpa_math_masked_upcast, "math", HALF),
    *_forms(eager_attention_gqa, "additive", (torch.float32, torch.bfloat16)),
    *_forms(eager_attention, "additive", (torch.float32, torch.bfloat16)),
]


# ---- checks -------------------------------------------------------------------------------
def _additive_mask_condition(bias_node):
    """The bool mask of an additive `where(mask, 0, c)` with c -inf or a dtype's minimum
    (through views), or None: only then is `bias != 0` the keys it excludes."""
    node = bias_node
    while is_call(node, aten.expand.default, aten.slice.Tensor, aten.view.default, aten.reshape.default):
        node = node.args[0]
    if not is_call(node, aten.where.self):
        return None
    condition, zero, fill = node.args[:3]
    cond = tensor_meta(condition)
    if cond is None or cond.dtype != torch.bool:
        return None
    zero_value, fill_value = _scalar_of(zero), _scalar_of(fill)
    bias = tensor_meta(bias_node)
    if zero_value != 0.0 or fill_value is None or bias is None or not bias.is_floating_point():
        return None
    # the dtype's minimum (transformers' eager mask) or -inf: exp(min - max) is 0 in the fp32 softmax
    return condition if fill_value <= torch.finfo(bias.dtype).min else None


def _additive_mask_reason(bias_node):
    """Why an additive mask is not one FIA can take as `bias != 0`, or None: it must hold only
    0 and hiding values (-inf, a dtype's minimum, constants.hides), 0 somewhere."""
    if _additive_mask_condition(bias_node) is not None:
        return None
    values = value_set(bias_node)
    if values is None or not all(x == 0.0 or hides(x) for x in values):
        shown = "" if values is None else f" (it holds {sorted(values)})"
        return (f"the additive mask is not only 0 and -inf or a large negative{shown}: values in between (a bias) "
                "are not a mask FIA can take")
    if 0.0 not in values:
        return "the additive mask hides every key"
    return None


def _scalar_of(node):
    """The value of a 0-d constant the graph makes (scalar_tensor, zeros, full), or a float."""
    if isinstance(node, (int, float)):
        return float(node)
    if is_call(node, aten.scalar_tensor.default):
        return float(node.args[0])
    if is_call(node, aten.zeros.default) and list(node.args[0]) == []:
        return 0.0
    if is_call(node, aten.full.default) and list(node.args[0]) == []:
        return float(node.args[1])
    return None


def _mask_proof(site):
    """(sparse_mode 3 / 0 / None, why) of the site's mask."""
    if "mask" in site.args:
        return sparse_mode_of(site.arg_nodes["mask"])
    return sparse_mode_of(site.arg_nodes["bias"], visible_when="zero")


def _fia_mask_shapes(batch, queries, keys):
    shapes = [[queries, keys], [1, queries, keys], [batch, 1, queries, keys], [1, 1, queries, keys]]
    return shapes + [[batch, keys]] if queries == 1 else shapes  # lists: the sizes may be symbolic


def _qkv(site):
    """(query, key, value) of a site: key and value before repeat_kv in the GQA forms."""
    if "grouped_key" in site.args:
        return site["query"], site["grouped_key"], site["grouped_value"]
    return site["query"], site["key"], site["value"]


def check(site):
    query, key, value = _qkv(site)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query, key and value are not all 4-d (B, N, S, D)"
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[-1] != dim:
        return f"query {list(query.shape)}, key {list(key.shape)} and value {list(value.shape)} do not fit"
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key heads"
    if value.shape[-1] > dim:
        return (f"value head dim {value.shape[-1]} > query/key's {dim}: FIA takes key and value of one shape, "
                "and padding the key would change the scores")
    # every replacement's conditions first (the mask's form, the hardware), then the proof
    # that picks the replacement: the reason a site reports is then the real one
    reason = (_mask_form_reason(site, batch, queries, keys)
              or site.hardware_limits(_hardware_reasons(site, batch, heads, kv_heads, queries, keys, dim))
              or _mask_reason(site, queries, keys))
    if reason:
        return reason
    if value.shape[-1] < dim:
        site.notes.append(f"value zero-padded from D {value.shape[-1]} to {dim} (FIA takes key and value of one "
                          "shape), the output cut back")
    if queries == 1:
        site.notes.append(
            f"decode over the whole static cache: the kernel reads all {keys} key positions (max_cache_len) under "
            "the explicit mask; actual_seq_lengths_kv would read only the valid ones, but it is a host int list "
            "and the cache length is a device tensor (StaticCache.cumulative_length), which the graph cannot "
            "pass without a sync (torchair.ops.npu_fused_infer_attention_score takes it as a tensor, in "
            "max-autotune only)")
    return None


def _recognized_mode(site):
    """"causal", "none" or "explicit" for a site recognised by what it computes, else None."""
    return getattr(site.form.replace, "mask_mode", None)


def _mask_form_reason(site, batch, queries, keys):
    """Whether the mask is one FIA can take at all (whatever the proof picks)."""
    if _recognized_mode(site) is not None or _MODE[site.form.replace] == _TOP_LEFT:
        return None  # a recognised site's masks were read and proven where it was found
    mask = site.args.get("mask", site.args.get("bias"))
    if "bias" in site.args:
        reason = _additive_mask_reason(site.arg_nodes["bias"])
        if reason is not None:
            return reason
        site.notes += filter(None, (fill_note(x) for x in value_set(site.arg_nodes["bias"]) or () if x != 0.0))
    if "mask" in site.args and mask.dtype != torch.bool:
        return f"the mask is {str(mask.dtype)[6:]}, not bool"
    if list(mask.shape) not in _fia_mask_shapes(batch, queries, keys):
        return (f"the mask has shape {list(mask.shape)}; FIA takes (B, 1, S_q, S_kv), (1, 1, S_q, S_kv), "
                "(1, S_q, S_kv) or (S_q, S_kv): no per-head mask")
    return None


def _mask_reason(site, queries, keys):
    """The proof behind the replacement's sparse_mode (None: it holds)."""
    if _recognized_mode(site) is not None:
        return None
    wanted = _MODE[site.form.replace]
    if wanted == _TOP_LEFT:
        site.notes.append("is_causal=True: sparse_mode "
                          + ("3 (top-left and right-down causal agree, S_q = S_kv)" if queries == keys
                             else "2 (top-left causal)"))
        return None
    mode, why = _mask_proof(site)
    if wanted == _CAUSAL:
        return None if mode == 3 else f"{why}: not sparse_mode 3"
    site.notes.append("explicit mask (" + ("bias != 0" if "bias" in site.args else "logical_not(mask)")
                      + ", sparse_mode 0" + (", invalid-row correction)" if queries > 1 else ")"))
    if "bias" in site.args and queries > 1:
        site.notes.append("a query row that masks every key: eager softmax averages all values there, FIA "
                          "(invalid-row correction) gives 0")
    return None


def _hardware_reasons(site, batch, heads, kv_heads, queries, keys, dim):
    limits = FIA.limits
    return [
        unsupported("npu.npu_fused_infer_attention_score", site.soc, x=site["query"]),
        f"head dim {dim} is not a multiple of {limits['head_dim_multiple']}"
        if dim % limits["head_dim_multiple"] else None,
        f"head dim {dim} > {limits['max_head_dim']}" if dim > limits["max_head_dim"] else None,
        f"{heads} heads > {limits['max_heads']}" if heads > limits["max_heads"] else None,
        f"batch {batch} > {limits['max_batch']}" if batch > limits["max_batch"] else None,
        f"{heads} query heads per key head > {limits['max_group']}"
        if heads // kv_heads > limits["max_group"] else None,
        f"{keys} keys > {limits['max_decode_kv_len']} in decode"
        if queries == 1 and keys > limits["max_decode_kv_len"] else None,
    ]


# ---- near misses: an attention no form consumed -----------------------------------------------
def _flash_attention_ops():
    """torch_npu's FlashAttention ops its SDPA records: v3 below Ascend950, the plain one on it."""
    return tuple(packet for packet in (getattr(torch.ops.npu, name, None)
                                       for name in ("npu_fusion_attention_v3", "npu_fusion_attention"))
                 if packet is not None)


def _casts():
    # a cast as CPU records it, and as torch_npu's softmax(dtype=) records it (npu_dispatch.py)
    npu_cast = getattr(torch.ops.npu, "_npu_dtype_cast", None)
    return (aten._to_copy.default, *((npu_cast.default,) if npu_cast is not None else ()))


def _scores_source(softmax):
    """The query @ key^T under a softmax's input (through casts, the mask add and the scale),
    or None: a bmm on CPU, aten.matmul on an NPU graph (torch_npu keeps matmul whole), of
    two batched operands (not a router's linear: activations @ a 2-d weight)."""
    node = softmax.args[0]
    for _ in range(6):
        if is_call(node, aten.bmm.default):
            return node
        if is_call(node, aten.matmul.default):
            operands = [tensor_meta(arg) for arg in node.args[:2]]
            return node if all(t is not None and t.dim() >= 3 for t in operands) else None
        if is_call(node, aten.view.default, aten._unsafe_view.default, *_casts(),
                   aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor):
            node = node.args[0]
        else:
            return None
    return None


def anchor(node):
    if is_call(node, aten._scaled_dot_product_flash_attention_for_cpu.default, *_flash_attention_ops()):
        return True
    if is_call(node, aten._softmax.default, aten._safe_softmax.default):
        return _scores_source(node) is not None
    return False


def explain(node):
    if is_call(node, *_flash_attention_ops()):
        return _explain_flash_attention(node)
    if is_call(node, aten._scaled_dot_product_flash_attention_for_cpu.default):
        extra = [u for u in node.users if not (u.target.__name__ == "getitem" and u.args[1] == 0)]
        if extra:
            return ("SDPA's logsumexp is used (saved for the backward of a training graph): FIA has no backward, "
                    "so training keeps SDPA (npu_fusion_attention_v3 on an NPU)")
        dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
        if dropout:
            return f"SDPA with dropout_p={dropout}: FIA has no dropout"
        mask = node.kwargs.get("attn_mask")
        reason = _additive_mask_reason(mask) if mask is not None else None
        if reason is not None:
            return f"SDPA's float mask: {reason}"
        return None
    probs_users = [u for u in node.users]
    dropout = next((u for u in probs_users if is_call(u, aten.native_dropout.default, aten.dropout.default)), None)
    if dropout is not None:
        return f"dropout (p={dropout.args[1]}) on the attention probabilities: FIA has no dropout"
    if any(u.op == "output" for u in probs_users) or len(probs_users) > 1:
        return ("the attention probabilities are used outside the attention (returned, or saved for a "
                "backward): FIA does not give them")
    if is_call(node, aten._safe_softmax.default):  # SDPA's math path: q and k^T scaled before the product
        return None
    scores = node.args[0]
    while is_call(scores, *_casts()):
        scores = scores.args[0]
    if is_call(scores, aten.add.Tensor):
        scores = scores.args[0]
    if not is_call(scores, aten.mul.Tensor, aten.mul.Scalar):
        return ("the scores are not scaled after query @ key^T (the scale is folded into q or k elsewhere, or "
                "missing): the forms scale the product")
    return None


def _explain_flash_attention(node):
    """Why torch_npu's FlashAttention call (its SDPA on an NPU) is not one of the forms."""
    name = node.target.__name__.split(".")[0]
    if name == "npu_fusion_attention":
        query = tensor_meta(node.args[0])
        refused = query is not None and unsupported("npu.npu_fused_infer_attention_score", "Ascend950", x=query)
        return ("npu_fusion_attention is SDPA as Ascend950 records it: "
                + (refused or "FIA is not emitted for Ascend950 (it has FIA v2)"))
    if any(not (u.target.__name__ == "getitem" and u.args[1] == 0) for u in node.users):
        return (f"{name}'s softmax statistics are used (saved for the backward of a training graph): FIA has no "
                "backward, so training keeps the FlashAttention op")
    keep_prob = node.args[9] if len(node.args) > 9 else node.kwargs.get("keep_prob", 1.0)
    if keep_prob != 1.0:
        return f"{name} with keep_prob={keep_prob} (dropout): FIA has no dropout"
    layout = node.args[4] if len(node.args) > 4 else None
    if layout != "BNSD":
        return f"{name} in layout {layout!r}: the forms are SDPA's BNSD call"
    # (position in the schema: pse 5, padding_mask 6, prefix 13, actual_seq_qlen 14, _kvlen 15)
    extras = [arg for index, arg in ((5, "pse"), (6, "padding_mask"), (13, "prefix"), (14, "actual_seq_qlen"),
                                     (15, "actual_seq_kvlen"))
              if (node.args[index] if len(node.args) > index else node.kwargs.get(arg)) is not None]
    if extras:
        return f"{name} with {', '.join(extras)}: not SDPA's call, which passes none of them"
    return None


# ---- attention recognised by what it computes ---------------------------------------------------
# The forms above are the spellings of SDPA and transformers' eager attention. Any other spelling
# of the same function (the scale as a division by sqrt(d), baddbmm's alpha, q or k scaled
# before the product; einsum over BSND, bmm over (B*N, S, D) views; k and v repeated for
# grouped queries by expand + reshape or repeat_interleave; a float mask added, a bool mask
# through masked_fill / where, several of them; casts anywhere) is found by evaluating the
# region that ends in the product of the probabilities with v (axis_algebra.py): it is FIA's
#     out[b, h, s, e] = sum_t softmax_t(c * sum_d q[b, h, s, d] k[b, h // G, t, d] + masks)[..] v[b, h // G, t, e]
# when every index plays that role: the batch and key heads shared by q, k and v, the query
# positions and head groups q's own, the keys summed with v, d summed in the scores; the
# masks hide keys only (0 or -inf / a large negative: constants.hides), per batch, query and
# key, never per head. Which index is the batch and which the heads is read from q's layout
# (its first dim of shared indices is the batch), never from sizes.
_NORMALISED = ("softmax", "safe_softmax")
_PRODUCTS = (aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.mm.default)
_PASSES_PROBABILITIES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                         aten.clone.default, aten.contiguous.default, aten.permute.default, aten.transpose.int,
                         aten.unsqueeze.default, aten._to_copy.default, torch.ops.prims.convert_element_type.default)


@dataclass(frozen=True)
class AttentionLayout:
    """The atoms of each role, in the order FIA's BNSD dims take them."""

    batch: tuple
    heads_kv: tuple  # the key / value heads
    group: tuple  # the query heads per key head (minor: query head h reads key head h // G)
    queries: tuple
    keys: tuple
    dim: tuple
    dim_v: tuple


def recognize(graph, joint):
    """Attention sites by what a region computes; refused ones say why (a near miss)."""
    if joint:
        return []  # FIA has no backward: training keeps SDPA (npu_fusion_attention_v3 on an NPU)
    evaluation = AxisEvaluation()
    found = []
    softmaxes = [n for target in (aten._softmax.default, aten._safe_softmax.default)
                 for n in graph.find_nodes(op="call_function", target=target)]
    for softmax in sorted(softmaxes):
        product = _product_of(softmax)
        if product is None:
            continue
        try:
            value = evaluation.value(product)
            site = _attention(value, product, softmax)
        except NotEvaluable:
            continue
        if site is not None:
            found.append(site)
    return found


def _product_of(softmax):
    """The matmul / bmm that reads the probabilities (through casts, copies and views)."""
    frontier, seen = [softmax], 0
    while frontier and seen < 12:
        node = frontier.pop(0)
        seen += 1
        for user in node.users:
            if is_call(user, *_PRODUCTS):
                return user
            if is_call(user, *_PASSES_PROBABILITIES):
                frontier.append(user)
    return None


def _attention(value, product, softmax):
    expr = value.expr
    if expr.op != "sum" or expr.node is not product:
        return None
    pair = expr.args[0].args
    probs = [i for i, f in enumerate(pair) if strip_casts(f).op in _NORMALISED]
    if len(probs) != 1:
        return None
    p, v = strip_casts(pair[probs[0]]), strip_casts(pair[1 - probs[0]], lossless_only=True)
    keys = expr.atoms
    if set(p.atoms) != set(keys) or v.contains(*_NORMALISED) or p.node is not softmax:
        return None
    read = read_masked_scores(p.args[0])
    if read.scores is None:
        return _unread(read, product, softmax)
    q, k = (strip_casts(f, lossless_only=True) for f in read.factors)
    if set(keys) & q.free:
        q, k = k, q
    layout = _layout(q, k, v, read, keys, value)
    if isinstance(layout, str):
        return _refused(layout, product, softmax)
    return _site(value, product, softmax, q, k, v, read, layout)


def _unread(read, product, softmax):
    """A near miss for probabilities over something that is not a masked, scaled q @ k^T."""
    rest = strip_casts(read.rest)
    if rest.contains("tanh"):
        return _refused("the scores are soft-capped (cap * tanh(s / cap)): npu_fused_infer_attention_score has no "
                        "soft-cap", product, softmax)
    if rest.op == "add" and all(a.contains("sum") for a in rest.args):
        return _refused("the scores are a sum of two products (MLA's nope and rope parts?): "
                        "npu_fused_infer_attention_score takes one query @ key^T", product, softmax)
    if not rest.contains("sum"):
        return None  # a softmax of something else before a matmul: not an attention
    return _refused(f"the scores are {rest.op}(...) of query @ key^T, not the product scaled by a constant and "
                    "masked: npu_fused_infer_attention_score computes softmax(scale * q @ k^T + mask)",
                    product, softmax)


def _refused(reason, product, softmax):
    return Recognized("attention (axis algebra)", product, [softmax, product], reason=reason)


def _layout(q, k, v, read, keys, value):
    """The AttentionLayout of the site, or why its indices do not play FIA's roles."""
    dim = set(read.scores.atoms)
    qa, ka, va = q.free, k.free, v.free
    keys = set(keys)
    if not dim <= qa or not dim <= ka:
        return "the scores do not sum over a head dim of both query and key"
    if not keys <= ka or not keys <= va or keys & qa:
        return "the probabilities are not summed with value over the keys of the scores"
    shared = (qa & ka & va) - dim - keys
    if ((qa & ka) - va - dim) or ((ka & va) - qa - keys) or ((qa & va) - ka):
        return "query, key and value do not share their batch and head indices as attention does"
    own = qa - ka - va - dim
    dim_v = va - ka - qa - keys
    out = set(atoms_of(value.dims))
    if out != shared | own | dim_v:
        return "the output's indices are not the query's rows and the value's columns"
    masked = set()
    for mask in read.masks:
        masked |= set(atoms_of(mask.dims))
    order_q = [a for group in q.dims for a in group]
    # q's head dim holds the key heads' indices and the group's: the group is a query-only
    # index sharing a dim of q with a shared one
    group, queries, extra_heads = [], [], []
    for d, atoms in enumerate(q.dims):
        owned = [a for a in atoms if a in own]
        if not owned:
            continue
        if any(a in shared for a in atoms):
            first_owned = min(atoms.index(a) for a in owned)
            if any(atoms.index(a) > first_owned for a in atoms if a in shared):
                return ("the query heads read the key heads tiled (repeat): query head h reads key head h % N_kv, "
                        "npu_fused_infer_attention_score groups them (h // G)")
            group += owned
        elif masked and not (set(owned) & masked):
            extra_heads.append(owned)  # heads the key and value broadcast over (one key head)
        else:
            queries.append(owned)
    if not queries and extra_heads:  # no mask says which: the dim nearest the head dim is the queries'
        queries.append(extra_heads.pop())
    if len(queries) != 1:
        return "the query rows are not one dim of the query"
    if extra_heads and group:
        return "the query heads are grouped over the key heads in more than one way"
    group += [a for owned in extra_heads for a in owned]
    shared_dims = [[a for a in atoms if a in shared] for atoms in q.dims]
    head_dims = [d for d, atoms in enumerate(q.dims) if any(a in group for a in atoms)]
    batch, heads = [], []
    for d, atoms in enumerate(shared_dims):
        if not atoms:
            continue
        if d in head_dims or batch:
            heads += atoms
        else:
            batch += atoms
    if masked & (set(heads) | set(group)):
        return "the mask differs per head: npu_fused_infer_attention_score takes one mask for every head"
    unplaced = masked - set(batch) - set(queries[0]) - keys
    if unplaced:
        return "the mask has an index that is neither the batch, the queries nor the keys"
    order_k = [a for g in k.dims for a in g]
    return AttentionLayout(tuple(batch), tuple(heads), tuple(group), tuple(queries[0]),
                           tuple(sorted(keys, key=order_k.index)), tuple(sorted(dim, key=order_q.index)),
                           tuple(sorted(dim_v, key=[a for g in v.dims for a in g].index)))


def _roles(dims, layout):
    roles = []
    for atoms in dims:
        found = {("b" if a in layout.batch else "s" if a in layout.queries else "t" if a in layout.keys else "?")
                 for a in atoms}
        if len(found) > 1 or "?" in found:
            raise NotEvaluable("a mask dim mixes the batch, queries and keys")
        roles.append(found.pop() if found else None)
    return tuple(roles)


def _terms(read, layout):
    """The masks as MaskTerms and the notes they bring, or the reason one is not a mask."""
    terms, notes = [], []
    for mask in read.masks:
        roles = _roles(mask.dims, layout)
        if mask.kind in ("fill", "keep"):
            if not hides(float(mask.fill)):
                return (f"the scores are filled with {mask.fill} where masked: a soft mask (hidden keys keep a share "
                        "of the softmax), not one npu_fused_infer_attention_score applies"), None
            terms.append(MaskTerm(mask.node, "true" if mask.kind == "fill" else "false", roles))
            notes.append(fill_note(float(mask.fill)))
            continue
        values = value_set(mask.node)
        if values is None or not all(x == 0.0 or hides(x) for x in values):
            shown = "" if values is None else f" (it holds {sorted(values)})"
            return (f"the additive mask {mask.node.name} is not only 0 and -inf or a large negative{shown}: values in "
                    "between (a bias) are not a mask npu_fused_infer_attention_score takes"), None
        if 0.0 not in values:
            return f"the additive mask {mask.node.name} hides every key", None
        terms.append(MaskTerm(mask.node, "nonzero", roles))
        notes += [fill_note(x) for x in values if x != 0.0]
    return terms, [n for n in notes if n]


def _site(value, product, softmax, q, k, v, read, layout):
    terms, notes = _terms(read, layout)
    if notes is None:  # (terms is then the reason)
        return _refused(terms, product, softmax)
    inputs = {"query": q.node, "key": k.node, "value": v.node}
    masks = {f"mask_{i}": term.node for i, term in enumerate(terms)}
    nodes = region_between([product], [*inputs.values(), *masks.values()])
    if nodes is None:
        return None
    inside = set(nodes)
    for node in nodes:
        outside = next((u for u in node.users if u not in inside), None)
        if node is not product and outside is not None:
            if node is softmax or node in softmax.users:
                reason = ("the attention probabilities are used outside the attention (returned, or saved for a "
                          "backward): npu_fused_infer_attention_score does not give them")
            else:
                reason = f"intermediate {node.name} ({node.target}) is also used by {outside.name}"
            return Recognized("attention (axis algebra)", product, nodes, reason=reason)
    scale = read.scale
    if not isinstance(scale, (int, float)):
        return _refused(f"the scale {scale} is not a constant", product, softmax)
    metas = {name: tensor_meta(node) for name, node in inputs.items()}
    sizes = {}
    for expr, meta in ((q, metas["query"]), (k, metas["key"]), (v, metas["value"])):
        sizes.update(atom_sizes(meta, expr.dims))
    group = {name: _size(sizes, atoms) for name, atoms in (
        ("batch", layout.batch), ("heads", layout.heads_kv + layout.group), ("heads_kv", layout.heads_kv),
        ("queries", layout.queries), ("keys", layout.keys), ("dim", layout.dim), ("dim_v", layout.dim_v))}
    mode, why = mask_mode(terms, group["queries"], group["keys"])
    compute = tensor_meta(read.scores.node if read.scores.node is not None else product).dtype
    dtype = metas["query"].dtype if len({m.dtype for m in metas.values()}) == 1 else compute
    replace = _fia_replacement(q.dims, k.dims, v.dims, layout, terms, float(scale), mode or "explicit",
                               dtype, value.dims, tensor_meta(product).dtype)
    query = metas["query"].new_empty((group["batch"], group["heads"], group["queries"], group["dim"]), dtype=dtype)
    key = metas["key"].new_empty((group["batch"], group["heads_kv"], group["keys"], group["dim"]), dtype=dtype)
    val = metas["value"].new_empty((group["batch"], group["heads_kv"], group["keys"], group["dim_v"]), dtype=dtype)
    site_args = {"query": query, "key": key, "value": val, "scale": float(scale)}
    if mode is None and terms:
        batched = any("b" in t.roles for t in terms)
        site_args["mask"] = query.new_empty((group["batch"] if batched else 1, 1, group["queries"], group["keys"]),
                                            dtype=torch.bool)
        notes.append(f"explicit mask ({why})")
        notes.append(_FULL_ROW[softmax.target is aten._safe_softmax.default])
    elif terms:
        notes.append(why)
    return Recognized("attention (axis algebra)", product, nodes, {**inputs, **masks}, replace, site_args,
                      fused_op="npu.npu_fused_infer_attention_score", notes=notes)


_FULL_ROW = {
    False: ("a query row that hides every key: the model's softmax gives NaN (-inf) or spreads it over all keys (a "
            "finite fill), npu_fused_infer_attention_score (invalid-row correction) gives 0"),
    True: "a query row that hides every key gives 0 in both (_safe_softmax, invalid-row correction)",
}


def _size(sizes, atoms):
    out = 1
    for a in atoms:
        out = out * sizes[a]
    return out


def _fia_replacement(q_dims, k_dims, v_dims, layout, terms, scale, mode, dtype, out_dims, out_dtype):
    heads = layout.heads_kv + layout.group
    bnsd_q = (layout.batch, heads, layout.queries, layout.dim)
    bnsd_k = (layout.batch, layout.heads_kv, layout.keys, layout.dim)
    bnsd_v = (layout.batch, layout.heads_kv, layout.keys, layout.dim_v)
    bnsd_out = (layout.batch, heads, layout.queries, layout.dim_v)

    def npu_fused_infer_attention_score_recognized(query, key, value, *masks):
        sizes = {**atom_sizes(query, q_dims), **atom_sizes(key, k_dims), **atom_sizes(value, v_dims)}
        q = rearrange(query, q_dims, bnsd_q, sizes).to(dtype)
        k = rearrange(key, k_dims, bnsd_k, sizes).to(dtype)
        v = rearrange(value, v_dims, bnsd_v, sizes).to(dtype)
        if mode == "causal":
            out = _fia(q, k, v, scale, _compressed_mask(q), sparse_mode=3)
        elif mode == "none":
            out = _fia(q, k, v, scale)
        else:  # FIA's mask: True = hidden, (B or 1, 1, S, T)
            hidden = hidden_keys(masks, terms)
            hidden = hidden.expand(hidden.shape[0], q.shape[2], k.shape[2]).unsqueeze(1).contiguous()
            out = _fia(q, k, v, scale, hidden)
        return rearrange(out.to(out_dtype), bnsd_out, out_dims, sizes)

    npu_fused_infer_attention_score_recognized.mask_mode = mode
    return npu_fused_infer_attention_score_recognized


def could_match(graph):
    """Whether the graph holds an op every form needs (SDPA's CPU op or torch_npu's
    FlashAttention, a softmax after a bmm); the forms take a few seconds to register."""
    targets = (aten._scaled_dot_product_flash_attention_for_cpu.default, aten._softmax.default,
               aten._safe_softmax.default,
               *(getattr(packet, overload) for packet in _flash_attention_ops() for overload in packet.overloads()))
    return any(anchor(node) for target in targets for node in graph.find_nodes(op="call_function", target=target))


# B=2, N=4 query heads, S_q=3 queries, S_kv=6 keys, D=8; the GQA forms' key and value
# have N_kv=2 heads. The query is a BNSD view of BSND memory (q_proj(x).view(B, S, N,
# D).transpose(1, 2), roped), key and value the static cache (contiguous BNSD). torch's
# matmul views or copies by strides, so the eager and math forms are registered at the
# layouts the models produce (example_variants).
def _bsnd(*shape):
    batch, heads, seq, dim = shape
    return lambda dtype: torch.empty(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)


def _bnsd(*shape):
    return lambda dtype: torch.empty(*shape, dtype=dtype)


def _masks(batch, queries, keys):
    return {"mask": lambda dtype: torch.empty(batch, 1, queries, keys, dtype=torch.bool),
            "bias": lambda dtype: torch.empty(batch, 1, queries, keys, dtype=dtype)}


def _cache(batch, keys, dim=8, layout=_bnsd):
    return {"key": layout(batch, 4, keys, dim), "value": layout(batch, 4, keys, dim),
            "grouped_key": layout(batch, 2, keys, dim), "grouped_value": layout(batch, 2, keys, dim)}


EXAMPLE = {
    "query": _bsnd(2, 4, 3, 8), **_cache(2, 6), **_masks(2, 3, 6),
    "scale": 2.0**-3,
    "sqrt_scale": math.sqrt(2.0**-5),
}
VARIANTS = [
    # decode: one query
    {"query": _bsnd(2, 4, 1, 8), **_masks(2, 1, 6)},
    # batch 1 (matmul views where batch 2 copies), prefill and decode
    {"query": _bsnd(1, 4, 3, 8), **_cache(1, 6), **_masks(1, 3, 6)},
    {"query": _bsnd(1, 4, 1, 8), **_cache(1, 6), **_masks(1, 1, 6)},
    # a prefill without a cache: key and value BNSD views of their projections too
    {"query": _bsnd(2, 4, 6, 8), **_cache(2, 6, layout=_bsnd), **_masks(2, 6, 6)},
    # MLA (DeepSeek-V3): q = cat(q_nope, q_rope) contiguous, k built by slice_scatter, v a
    # slice of kv_b_proj's output (B, S_kv, N, nope + v).transpose(1, 2)[..., nope:]
    *({"query": _bnsd(2, 4, queries, 12), **_cache(2, 6, dim=12),
       "value": lambda dtype: torch.empty(2, 6, 4, 16, dtype=dtype).transpose(1, 2)[..., 8:],
       **_masks(2, queries, 6)} for queries in (3, 1)),
]

def verification_input(name, args):
    """Masks as the models make them, for FusionConfig(verify=True): a random bool mask
    with every query row keeping a key (a row masking everything is a documented difference,
    not one to verify), and an additive mask where(mask, 0, the dtype's minimum)."""
    if name not in ("mask", "bias"):
        return None
    shape = [int(s) for s in args[name].shape]
    generator = torch.Generator().manual_seed(0)
    keep = torch.rand(shape, generator=generator) > 0.3
    keep[..., 0] = True
    if name == "mask":
        return keep
    dtype = args["bias"].dtype
    return torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


PASS = FusionPass(
    name="attention",
    fused_op="npu.npu_fused_infer_attention_score",
    forms=FORMS,
    example=EXAMPLE,
    example_variants=VARIANTS,
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (aten._scaled_dot_product_flash_attention_for_cpu.default, *_flash_attention_ops(),
                        aten._softmax.default, aten._safe_softmax.default),
    explain=explain,
    verify_input=verification_input,
    prefilter=could_match,
    # DeepSeek-V3.2's top-k attention is dense attention under an arbitrary mask too:
    # sparse_attention takes it first
    after=("sparse_attention",),
    recognize=recognize,
)
