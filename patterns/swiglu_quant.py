"""swiglu_quant: a SwiGLU whose output is quantized per token -> torch.ops.npu.npu_swiglu_quant.

    h     = npu_swiglu(x, -1)                 # from the swiglu pass: silu(x[..., :n]) * x[..., n:]
    q, s  = npu_dynamic_quant(h)              # from the dynamic_quant pass: amax / 127 per row
 -> q, m  = npu_swiglu_quant(x, smooth_scales=ones(1, n), activate_left=True, quant_mode=1,
                             dst_type=int8)
    s     = 1 / m

The activation feeding a W8A8 down projection (a W8A8 MLP, or the experts' down GEMM): one kernel
reads x once and writes the int8 values and the scales, never the activation itself.

What the kernel computes (docs/passes/swiglu_quant.md, hicann/ops-nn quant/swi_glu_quant):
activate_left=True activates the first half, as npu_swiglu does; SwiGLU, the smooth-scale multiply,
the row max of |y| and y * 127 / max in fp32, rounded half to even (CAST_RINT), no clamp: the
quantization npu_dynamic_quant computes. Its scale output is the multiplier 127 / max, not the
max / 127 the code and npu_dynamic_quant give: the fused call takes its reciprocal (an (M,) op per
step; within an fp32 ulp or two of max / 127). The smooth scales are a row of ones (an exact
multiply): the kernel reads them in the dynamic mode whether given or not (its tiling has no
"absent" case, and ATB's runner of the same aclnn op allocates them itself), so they are passed.

Numerics: unfused, the SwiGLU's output is rounded to x's dtype before it is quantized; fused, the
fp32 SwiGLU is. An int8 value can differ by one where that rounding crosses a .5, and the scale by
the rounding of the row's max (a note on each site; FusionConfig.keep_intermediate_rounding refuses
the fusion), as add_rms_norm_quant's.
"""
import torch

from npu_fx_fusion.capabilities import capability, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta


# ---- the unfused forms: the two NPU ops the swiglu and dynamic_quant passes leave ---------------
# (npu_swiglu's dim -1 written out or left to its default trace alike; code that quantizes rows
# flattens the leading dims in between, which a row-wise SwiGLU commutes with)
def swiglu_then_dynamic_quant(x):
    return torch.ops.npu.npu_dynamic_quant(torch.ops.npu.npu_swiglu(x, -1))


def swiglu_then_dynamic_quant_of_rows(x):
    h = torch.ops.npu.npu_swiglu(x, -1)
    return torch.ops.npu.npu_dynamic_quant(h.reshape(-1, h.shape[-1]))


# ---- the fused call ---------------------------------------------------------------------------------
def npu_swiglu_quant(x):
    ones = torch.ones(1, x.shape[-1] // 2, dtype=torch.float32, device=x.device)
    q, multiplier = torch.ops.npu.npu_swiglu_quant(x, smooth_scales=ones, activate_left=True, quant_mode=1,
                                                   dst_type=torch.int8)
    return q, torch.reciprocal(multiplier)  # the kernel's scale is 127 / max: the code's is max / 127


def npu_swiglu_quant_of_rows(x):
    return npu_swiglu_quant(x.reshape(-1, x.shape[-1]))


FORMS = [
    Form(swiglu_then_dynamic_quant_of_rows, npu_swiglu_quant_of_rows, dtypes=(torch.bfloat16,)),
    Form(swiglu_then_dynamic_quant, npu_swiglu_quant, dtypes=(torch.bfloat16,)),
]

ROUNDED_SWIGLU_NOTE = ("quantizes the fp32 SwiGLU where the code quantizes it rounded to {dtype}: an int8 value can "
                       "differ by one where that rounding crosses a .5")


def check(site):
    x = site["x"]
    problem = unsupported("npu.npu_swiglu_quant", site.soc, x=x)
    if problem:
        return problem
    limit = capability("npu.npu_swiglu_quant").limits["max_last_dim"]
    if x.shape[-1] > limit:
        return f"the SwiGLU's input has {x.shape[-1]} channels: npu_swiglu_quant takes at most {limit}"
    dtype = str(x.dtype).removeprefix("torch.")
    if site.keep_intermediate_rounding:
        return (f"quantizes the SwiGLU before its rounding to {dtype} (FusionConfig.keep_intermediate_rounding keeps "
                "the code's rounding)")
    site.notes.append(ROUNDED_SWIGLU_NOTE.format(dtype=dtype))
    return None


# ---- near misses: a per-token quantization of a SwiGLU's output that did not fuse ------------------
def _swiglu_output(quant):
    """The npu_swiglu call whose output npu_dynamic_quant reads (through a view of its rows), or None."""
    npu = getattr(torch.ops, "npu", None)
    source = quant.args[0] if quant.args else None
    if is_call(source, torch.ops.aten.view.default, torch.ops.aten.reshape.default):
        source = source.args[0]
    return source if npu is not None and is_call(source, npu.npu_swiglu.default) else None


def anchor(node):
    npu = getattr(torch.ops, "npu", None)
    return npu is not None and is_call(node, npu.npu_dynamic_quant.default) and _swiglu_output(node) is not None


def explain(quant):
    swiglu = _swiglu_output(quant)
    if quant.kwargs:
        return f"the quantization has arguments of its own ({', '.join(quant.kwargs)})"
    x = tensor_meta(swiglu.args[0])
    if len(swiglu.args) > 1 and x is not None and swiglu.args[1] % x.dim() != x.dim() - 1:
        return f"the SwiGLU splits dim {swiglu.args[1]}: npu_swiglu_quant splits the last"
    others = [u for u in swiglu.users if u is not quant and quant not in u.users]
    if others:
        return (f"the SwiGLU's output is also used by {', '.join(u.name for u in others[:3])}: npu_swiglu_quant "
                "writes only its quantization")
    return None


PASS = FusionPass(
    name="swiglu_quant",
    # it fuses the npu_swiglu and npu_dynamic_quant calls those passes produce
    after=("swiglu", "dynamic_quant"),
    fused_op="npu.npu_swiglu_quant",
    forms=FORMS,
    example={"x": lambda dtype: torch.empty(2, 3, 16, dtype=dtype)},
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (getattr(getattr(torch.ops, "npu", None), "npu_dynamic_quant", None),),
    explain=explain,
)
