"""quant_grouped_matmul: MoE expert GEMMs over int8 expert weights -> npu_grouped_matmul with its
quantisation arguments.

Two spellings of a quantised expert GEMM over tokens sorted by expert (offs: cumulative row ends):

  weight-only (W8A16), the int8 experts dequantized per output channel, then the grouped GEMM
    w_dq = (w_int8 - zero) * scale                       # scale, zero: one per (expert, channel)
    y    = grouped_mm(x, w_dq^T, offs)                   # x fp16 / bf16
 -> y = npu_grouped_matmul([x], [w_int8^T], antiquant_scale=[scale], antiquant_offset=[-zero], ...)

  W8A8 dynamic, a per-token int8 activation and per-channel int8 experts, both dequantized
    x_dq = (q.float() * x_scale).to(bf16 / fp16)         # q int8 (M, K), x_scale (M, 1)
    y    = grouped_mm(x_dq, (w_int8 * w_scale)^T, offs)
 -> y = npu_grouped_matmul([q], [w_int8^T], scale=[w_scale], per_token_scale=[x_scale],
                          output_dtype=bf16 / fp16, ...)

each with group_type 0, one 3-d weight, one output (split_item 3) and the offsets as cumulative
ends (group_list_type 0), as grouped_matmul emits the float GEMM. grouped_mm is torch._grouped_mm
(transformers' bf16 experts) or transformers' grouped_mm_fallback op (its fp16 experts under
torch.compile). The weight is stored (E, N, K) and passed transposed (transformers' experts, the
layout compressed-tensors' `dequantize` keeps) or stored (E, K, N); both are views the op reads
(docs/passes/quant_grouped_matmul.md). No repacking: the int8 weight goes to the op as it is.

The op's facts (torch_npu docstring of npu_grouped_matmul, CANN aclnnGroupedMatmulV4): an int8
weight is dequantized per channel only (per-group needs its int4 layout), with antiquant_scale /
antiquant_offset (E, N) in x's dtype as (w + offset) * scale, so the code's zero point z becomes
offset = -z (exact); the per-token mode takes a bf16 scale for a bf16 output and an fp32 one for
fp16 (an fp16 scale widens exactly; an fp32 scale for a bf16 output would be a rounding the code
does not make: a near miss), and an fp32 per-token scale (M,). Atlas inference (310P) takes
no quantisation arguments.

Numerics: weight-only, the code rounds w * scale to x's dtype once, as the op does (an int8 times a
bf16 / fp16 scale is exact in fp32): the same weights, the same fp32-accumulated GEMM. W8A8, the
op scales the exact int32 product in fp32 and rounds once; the code rounds each dequantized
operand to bf16 / fp16 first: the two differ by up to about 2^-8 of sum_k |x_dq| |w_dq| (as
quant_matmul's dequantized-linear spelling). The activation's int8 values come from anywhere
(npu_dynamic_quant where dynamic_quant fused them, or code it left alone).
"""
import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES
from npu_fx_fusion.matching import Form, FusionPass, dtype_argument, is_call, known_equal, tensor_meta
from npu_fx_fusion.patterns.grouped_matmul import (aten_grouped_mm, counts_for_running_sums, even_offsets,
                                                   gemm_limits_reason, transformers_grouped_mm_fallback)
from npu_fx_fusion.patterns.quant_matmul import per_token_scale_reason
from npu_fx_fusion.patterns.weight_quant_matmul import integer_source

aten = torch.ops.aten
GROUPED_MATMUL = CAPABILITIES["npu.npu_grouped_matmul"]


# ---- the expert GEMMs the forms are written around: grouped_matmul's two ----------------------
# (the GEMM, the dtype the library runs it in): torch._grouped_mm in bf16; transformers' fallback op
# where _grouped_mm does not apply under torch.compile (fp16)
GEMMS = ((aten_grouped_mm, torch.bfloat16), (transformers_grouped_mm_fallback, torch.float16))


# ---- the unfused forms -------------------------------------------------------------------------
# w int8, stored (E, N, K) with scale / zero (E, N, 1) ("nk", passed transposed) or stored (E, K, N)
# with (E, 1, N) ("kn"); x (M, K); q int8 (M, K) with x_scale (M, 1); offs (E,) cumulative ends.
def _weight_only_forms(gemm, dtype):
    def channel_dequantized_nk(x, w, scale, offs):
        # compressed-tensors `dequantize` (strategy channel, symmetric): w.to(scale.dtype) * scale
        return gemm(x, (w.to(scale.dtype) * scale).transpose(-2, -1), offs)

    def channel_zero_dequantized_nk(x, w, zero, scale, offs):
        # compressed-tensors `dequantize` (asymmetric): (w - zero) in the scale's dtype, times scale
        return gemm(x, ((w.to(scale.dtype) - zero.to(scale.dtype)) * scale).transpose(-2, -1), offs)

    def channel_dequantized_kn(x, w, scale, offs):
        return gemm(x, w.to(scale.dtype) * scale, offs)

    def channel_zero_dequantized_kn(x, w, zero, scale, offs):
        return gemm(x, (w.to(scale.dtype) - zero.to(scale.dtype)) * scale, offs)

    def fused_nk(x, w, scale, offs):
        return _npu_weight_only(x, w.transpose(-2, -1), _per_channel(scale, w, "nk"), None, offs)

    def fused_zero_nk(x, w, zero, scale, offs):
        return _npu_weight_only(x, w.transpose(-2, -1), _per_channel(scale, w, "nk"),
                                _per_channel(zero, w, "nk"), offs)

    def fused_kn(x, w, scale, offs):
        return _npu_weight_only(x, w, _per_channel(scale, w, "kn"), None, offs)

    def fused_zero_kn(x, w, zero, scale, offs):
        return _npu_weight_only(x, w, _per_channel(scale, w, "kn"), _per_channel(zero, w, "kn"), offs)

    pairs = [(channel_zero_dequantized_nk, fused_zero_nk), (channel_dequantized_nk, fused_nk),
             (channel_zero_dequantized_kn, fused_zero_kn), (channel_dequantized_kn, fused_kn)]
    return [_named(Form(search, replace, dtypes=(dtype,)), gemm) for search, replace in pairs]


def _w8a8_forms(gemm, dtype):
    def dequantized_nk(q, x_scale, w, w_scale, offs):
        # vLLM's reference per-token quant dequantized as compressed-tensors does (q * x_scale in
        # fp32, cast to the model dtype), the experts dequantized per channel
        x_dq = (q.to(torch.float32) * x_scale).to(dtype)
        return gemm(x_dq, (w.to(dtype) * w_scale).transpose(-2, -1), offs)

    def dequantized_kn(q, x_scale, w, w_scale, offs):
        x_dq = (q.to(torch.float32) * x_scale).to(dtype)
        return gemm(x_dq, w.to(dtype) * w_scale, offs)

    def fused_nk(q, x_scale, w, w_scale, offs):
        return _npu_per_token(q, x_scale, w.transpose(-2, -1), _per_channel(w_scale, w, "nk"), offs, dtype)

    def fused_kn(q, x_scale, w, w_scale, offs):
        return _npu_per_token(q, x_scale, w, _per_channel(w_scale, w, "kn"), offs, dtype)

    return [_named(Form(dequantized_nk, fused_nk, dtypes=(dtype,)), gemm, "w8a8_"),
            _named(Form(dequantized_kn, fused_kn, dtypes=(dtype,)), gemm, "w8a8_")]


def _named(form, gemm, prefix=""):
    """Names that say which GEMM the form is written around (the report shows them)."""
    gemm_name = "grouped_mm" if gemm is aten_grouped_mm else "grouped_mm_fallback"
    form.search.__name__ = f"{prefix}{form.search.__name__}_{gemm_name}"
    form.replace.__name__ = f"npu_grouped_matmul_{prefix}{form.replace.__name__}"
    return form


FORMS = {gemm: _w8a8_forms(gemm, dtype) + _weight_only_forms(gemm, dtype) for gemm, dtype in GEMMS}


def forms():
    """The fallback forms exist once transformers is imported (asked at every apply)."""
    fallback = interop.transformers_grouped_mm_fallback() is not None
    return FORMS[aten_grouped_mm] + (FORMS[transformers_grouped_mm_fallback] if fallback else [])


# ---- the fused calls ---------------------------------------------------------------------------
def _per_channel(value, w, layout):
    """A scale or zero point with no K extent as the op's (E, N): the stored weight w is (E, N, K)
    ("nk") or (E, K, N) ("kn"), the value (E, N, 1) or (E, 1, N), or fewer numbers broadcasting
    to that (one per expert, one set of channels for all experts), expanded (exact)."""
    experts, n = (w.shape[0], w.shape[1]) if layout == "nk" else (w.shape[0], w.shape[2])
    return value.expand((experts, n, 1) if layout == "nk" else (experts, 1, n)).reshape(experts, n)  # a view


def _npu_weight_only(x, w_kn, scale, zero, offs):
    # the op adds its offset: -zero, cast to x's dtype as the code casts it (exact for integers)
    offset = None if zero is None else [-zero.to(x.dtype)]
    return torch.ops.npu.npu_grouped_matmul([x], [w_kn], antiquant_scale=[scale], antiquant_offset=offset,
                                            group_list=offs.to(torch.int64), split_item=3, group_type=0,
                                            group_list_type=0)[0]


def _npu_per_token(q, x_scale, w_kn, w_scale, offs, out):
    wanted = GROUPED_MATMUL.limits["pertoken_scale_dtype_for_output"][out]
    return torch.ops.npu.npu_grouped_matmul([q], [w_kn], scale=[w_scale.to(wanted)],  # bf16 as is, fp16 -> fp32 exact
                                            per_token_scale=[x_scale.reshape(-1).to(torch.float32)],
                                            group_list=offs.to(torch.int64), split_item=3, group_type=0,
                                            group_list_type=0, output_dtype=dtype_argument(out))[0]


# ---- checks ------------------------------------------------------------------------------------
def _channel_scale_reason(name, value, w, layout):
    """None if `value` is one number per (expert, output channel) of w, or fewer that broadcast
    to that (one per expert, one per channel for all experts): the op's (E, N)."""
    experts, n_axis = w.shape[0], (1 if layout == "nk" else 2)
    k_axis = 3 - n_axis
    shape = (1,) * (3 - value.dim()) + tuple(value.shape)  # as it broadcasts against the 3-d experts
    if value.dim() > 3 or shape[k_axis] != 1:
        return (f"the {name} {shape} varies along K (per group): npu_grouped_matmul dequantizes int8 experts per "
                "output channel only (per group needs its int4 weight layout, a repack this pass does not do)")
    if shape[0] not in (1, experts) or shape[n_axis] not in (1, w.shape[n_axis]):
        return f"the {name} {shape} is not one per expert and output channel of the {tuple(w.shape)} experts"
    return None


def check(site):
    w, offs = site["w"], site["offs"]
    layout = "nk" if "_nk_" in site.form.name else "kn"  # the form's weight layout (its transpose)
    if w.dtype != torch.int8 or w.dim() != 3:
        return f"the experts are {w.dtype} {tuple(w.shape)}: npu_grouped_matmul dequantizes 3-d int8 experts"
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64) or not known_equal(offs.shape[0], w.shape[0]):
        return f"the offsets are {offs.dtype} {tuple(offs.shape)}, not one integer end per expert of {w.shape[0]}"
    experts, k, n = (w.shape[0], w.shape[2], w.shape[1]) if layout == "nk" else tuple(w.shape)
    if site.soc in GROUPED_MATMUL.limits["quant_socs_excluded"]:
        return f"npu_grouped_matmul takes no quantisation arguments on {site.soc}"
    if "q" in site.args:
        return _w8a8_reason(site, w, layout) or gemm_limits_reason(site.soc, site["q"].new_empty(
            (1, k), dtype=_w8a8_output(site)), experts, k, n)
    return _weight_only_reason(site, w, layout) or gemm_limits_reason(site.soc, site["x"], experts, k, n)


def _w8a8_output(site):
    return site.form.dtypes[0]  # the dtype the code casts the dequantized activation to


def _w8a8_reason(site, w, layout):
    q, x_scale, w_scale = site["q"], site["x_scale"], site["w_scale"]
    if q.dtype != torch.int8 or q.dim() != 2:
        return f"the activation is {q.dtype} {tuple(q.shape)}, not int8 (tokens, K)"
    reason = per_token_scale_reason(x_scale, q.shape[0], q.shape[1], "npu_grouped_matmul")
    if reason:
        return reason
    reason = _channel_scale_reason("weight scale", w_scale, w, layout)
    if reason:
        return reason
    out = _w8a8_output(site)
    wanted = GROUPED_MATMUL.limits["pertoken_scale_dtype_for_output"].get(out)
    if wanted is None or not (w_scale.dtype == wanted or (w_scale.dtype == torch.float16 and wanted == torch.float32)):
        return (f"the weight scale is {str(w_scale.dtype)[6:]} for a {str(out)[6:]} output: npu_grouped_matmul's "
                f"per-token mode takes a {str(wanted)[6:]} scale there, a rounding of the scale the code does not make")
    return None


def _weight_only_reason(site, w, layout):
    x, scale = site["x"], site["scale"]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"x is {x.dtype}: npu_grouped_matmul's weight-only mode takes an fp16 / bf16 x"
    if scale.dtype != x.dtype:
        return (f"the scale is {str(scale.dtype)[6:]} and x {str(x.dtype)[6:]}: npu_grouped_matmul dequantizes "
                "with a scale in x's dtype")
    reason = _channel_scale_reason("scale", scale, w, layout)
    if reason or "zero" not in site.args:
        return reason
    zero = site["zero"]
    if zero.is_floating_point():
        return (f"a {str(zero.dtype)[6:]} zero point: the code rounds w - zero to {str(x.dtype)[6:]} before the "
                "scale, npu_grouped_matmul does not")
    return _channel_scale_reason("zero point", zero, w, layout)


# ---- near misses: an expert GEMM over a weight dequantized from integers, left unfused -----------
def _dequantized_from_integers(node):
    """The 3-d integer tensor an expert GEMM's weight is computed from through a multiply (its
    scale) within a few ops, else None."""
    return integer_source(node, limit=8, min_dims=3)


def _gemm_ops():
    fallback = interop.transformers_grouped_mm_fallback()
    return (aten._grouped_mm.default,) + ((fallback,) if fallback is not None else ())


def anchor(node):
    return (is_call(node, *_gemm_ops()) and len(node.args) >= 2
            and _dequantized_from_integers(node.args[1]) is not None)


def _group_view(weight, source):
    """The (.., groups, group size) view the experts are dequantized in between `source` (the
    integers) and `weight` (the GEMM's operand): a per-group scale's, else None."""
    todo, seen = [weight], set()
    while todo:
        current = todo.pop()
        if current in seen or current is source or not isinstance(current, torch.fx.Node):
            continue
        seen.add(current)
        value = tensor_meta(current)
        if value is not None and value.dim() == 4 and is_call(current, aten.mul.Tensor):
            return value
        todo.extend(current.all_input_nodes)
    return None


def explain(node):
    integers = _dequantized_from_integers(node.args[1])
    source = tensor_meta(integers)
    x = tensor_meta(node.args[0])
    if x is not None and x.dim() != 2:
        return f"x is {x.dim()}-d: only the 2-d (tokens, hidden) x of the MoE expert GEMM is fused"
    if source is not None and source.dtype != torch.int8:
        return (f"the experts are dequantized from {str(source.dtype)[6:]} {tuple(source.shape)}: npu_grouped_matmul "
                "takes int8 experts (int4 only in its packed layout, a repack this pass does not do)")
    grouped = _group_view(node.args[1], integers)
    if grouped is not None:
        return (f"the int8 experts are dequantized per group of {grouped.shape[-1]} along K: npu_grouped_matmul "
                "dequantizes int8 experts per output channel only (per group needs its int4 weight layout, a "
                "repack this pass does not do)")
    return (f"the experts are dequantized from int8 {tuple(source.shape)} in a way no form takes (per output "
            "channel, scale times (w - zero), the dequantized weight or its transpose fed to the GEMM)")


PASS = FusionPass(
    name="quant_grouped_matmul",
    # the activation's int8 values and per-token scale: npu_dynamic_quant where dynamic_quant fused them
    after=("dynamic_quant", "moe_dispatch"),
    fused_op="npu.npu_grouped_matmul",
    forms=forms,
    example={
        # _grouped_mm's meta function wants 16-byte aligned strides: sizes multiple of 8. K = N here
        # so that one example traces both weight layouts; the form's transpose, not a size,
        # tells them apart
        "x": lambda dtype: torch.empty(24, 16, dtype=dtype),
        "q": lambda dtype: torch.empty(24, 16, dtype=torch.int8),
        "x_scale": lambda dtype: torch.empty(24, 1, dtype=torch.float32),
        "w": lambda dtype: torch.empty(3, 16, 16, dtype=torch.int8),
        # one scale / zero point per expert: it broadcasts over both layouts, and the traces hold
        # no size of it (a per-channel one matches the same forms)
        "zero": lambda dtype: torch.empty(3, 1, 1, dtype=torch.int8),
        "scale": lambda dtype: torch.empty(3, 1, 1, dtype=dtype),
        "w_scale": lambda dtype: torch.empty(3, 1, 1, dtype=dtype),
        "offs": lambda dtype: torch.empty(3, dtype=torch.int32),
    },
    check=check,
    anchor=anchor,
    anchor_ops=_gemm_ops,
    explain=explain,
    verify_input=lambda name, args: even_offsets(args) if name == "offs" else None,
    finish=counts_for_running_sums,  # its calls read the model's expert offsets too
)
