"""add_rms_norm_quant: a residual add + RMSNorm whose output is quantized per token ->
torch.ops.npu.npu_add_rms_norm_dynamic_quant.

    y, _, h = npu_add_rms_norm(x, residual, w)   # from the add_rms_norm pass (or the model)
    q, s    = npu_dynamic_quant(y)               # from the dynamic_quant pass (or the model)
 -> q, _, h, s, _ = npu_add_rms_norm_dynamic_quant(x, residual, w)

The norm feeding a W8A8 linear: one kernel reads x and the residual once and writes the sum h,
the int8 values and the per-token scales, never the normed activation itself. torchair's own
pattern pass (torchair/patterns/add_rms_norm_dynamic_quant.py) makes the same rewrite of the same
two NPU ops; here it runs in the emulation too and is reported. Where the model quantizes the
norm's output once per projection (transformers' q, k and v linears), the identical
npu_dynamic_quant calls are one value (the pipeline merges repeated pure fused calls after each
pass), so the norm feeds one quantization.

Numerics (docs/passes/add_rms_norm_quant.md): the fused kernel adds x and the residual in fp32
(fp16 too), normalizes and multiplies gamma in fp32 and quantizes that fp32 value; unfused, the
norm's output is rounded to x's dtype first (npu_add_rms_norm rounds x * rstd, then y), and the
quantization reads the rounded value. So an int8 value can differ by one where that rounding
moves x * 127 / amax across a .5 (a note on each site; FusionConfig.keep_intermediate_rounding
refuses the fusion), and the scale by the rounding of the row's max. The fused one is the
quantization of the exact norm.
"""
import operator

import torch

from npu_fx_fusion.capabilities import unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call


def add_rms_norm_then_quant(x, residual, weight, eps):
    y, _, h = torch.ops.npu.npu_add_rms_norm(x, residual, weight, eps)
    q, scale = torch.ops.npu.npu_dynamic_quant(y)
    return q, scale, h


def add_rms_norm_then_quant_default_eps(x, residual, weight):
    # eps equal to the schema default (1e-6) is left out of the traced call
    y, _, h = torch.ops.npu.npu_add_rms_norm(x, residual, weight)
    q, scale = torch.ops.npu.npu_dynamic_quant(y)
    return q, scale, h


def npu_add_rms_norm_dynamic_quant(x, residual, weight, eps):
    q, _, h, scale, _ = torch.ops.npu.npu_add_rms_norm_dynamic_quant(x, residual, weight, epsilon=eps)
    return q, scale, h


def npu_add_rms_norm_dynamic_quant_default_eps(x, residual, weight):
    q, _, h, scale, _ = torch.ops.npu.npu_add_rms_norm_dynamic_quant(x, residual, weight)
    return q, scale, h


FORMS = [
    Form(add_rms_norm_then_quant, npu_add_rms_norm_dynamic_quant, dtypes=(torch.bfloat16,)),
    Form(add_rms_norm_then_quant_default_eps, npu_add_rms_norm_dynamic_quant_default_eps, dtypes=(torch.bfloat16,)),
]

ROUNDED_NORM_NOTE = ("quantizes the fp32 norm where the code quantizes it rounded to {dtype}: an int8 value can differ "
                     "by one where that rounding crosses a .5")


def check(site):
    x, weight = site["x"], site["weight"]
    if weight.dim() != 1 or weight.dtype != x.dtype:
        return (f"the norm's weight is {str(weight.dtype)[6:]} {tuple(weight.shape)}: "
                "npu_add_rms_norm_dynamic_quant takes a 1-d gamma in x's dtype")
    problem = unsupported("npu.npu_add_rms_norm_dynamic_quant", site.soc, x=x, x1=x, x2=site["residual"])
    if problem:
        return problem
    dtype = str(x.dtype).removeprefix("torch.")
    if site.keep_intermediate_rounding:
        return (f"quantizes the norm before its rounding to {dtype} (FusionConfig.keep_intermediate_rounding keeps "
                "the code's rounding)")
    site.notes.append(ROUNDED_NORM_NOTE.format(dtype=dtype))
    return None


# ---- near misses: a per-token quantization of a norm's output that did not fuse ------------------
def _norm_output(quant):
    """The npu_add_rms_norm / npu_rms_norm call whose normed output npu_dynamic_quant reads, or None."""
    y = quant.args[0] if quant.args else None
    if not (is_call(y, operator.getitem) and y.args[1] == 0):
        return None
    norm = y.args[0]
    npu = getattr(torch.ops, "npu", None)
    return norm if npu is not None and is_call(norm, npu.npu_add_rms_norm.default, npu.npu_rms_norm.default) else None


def anchor(node):
    npu = getattr(torch.ops, "npu", None)
    return npu is not None and is_call(node, npu.npu_dynamic_quant.default) and _norm_output(node) is not None


def explain(quant):
    norm = _norm_output(quant)
    if is_call(norm, torch.ops.npu.npu_rms_norm.default):
        return ("no residual add before the norm: torch_npu 2.13 has no RMSNorm + per-token quant op for A2/A3 "
                "(npu_rms_norm_dynamic_mx_quant is Ascend950's MX format)")
    if quant.kwargs:
        return f"the quantization has arguments of its own ({', '.join(quant.kwargs)})"
    y = quant.args[0]
    others = [u for u in y.users if u is not quant]
    if others:
        return (f"the norm's output is also used by {', '.join(u.name for u in others[:3])}: "
                "npu_add_rms_norm_dynamic_quant writes only its quantization")
    return None


PASS = FusionPass(
    name="add_rms_norm_quant",
    # it fuses the npu_add_rms_norm and npu_dynamic_quant calls those passes produce
    after=("add_rms_norm", "dynamic_quant"),
    fused_op="npu.npu_add_rms_norm_dynamic_quant",
    forms=FORMS,
    example={
        "x": lambda dtype: torch.empty(2, 3, 16, dtype=dtype),
        "residual": lambda dtype: torch.empty(2, 3, 16, dtype=dtype),
        "weight": lambda dtype: torch.empty(16, dtype=dtype),
        "eps": 2.0**-17,
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (getattr(getattr(torch.ops, "npu", None), "npu_dynamic_quant", None),),
    explain=explain,
)
