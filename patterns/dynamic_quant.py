"""dynamic_quant: per-token symmetric int8 quantization -> torch.ops.npu.npu_dynamic_quant.

    scale = max(|x|, last dim) / 127          # one scale per token (row)
    q     = clamp(round(x / scale), -128, 127).to(int8)
 -> q, scale = npu_dynamic_quant(x)           # scale without the trailing 1

What the op computes (docs/passes/dynamic_quant.md, with sources): on A2/A3 the kernel takes
the row max of |x| in fp32, divides 127 by it once, multiplies x by that in fp32 and rounds
half to even (CAST_RINT, as torch.round does); it has no clamp (|q| <= 127 by construction)
and no floor on the scale. The code's spellings compute x / (amax / 127), x * (1 / scale) or
x * (127 / amax): the same quotient up to one fp32 rounding, so a q can differ by one where
x / scale lies within an fp32 ulp of a .5 boundary, and the scale by one fp32 ulp.

Only the op's math fuses; each look-alike is a near miss that names the difference:
  * another divisor (compressed-tensors' and torchao's amax / 127.5 for the range [-128, 127]);
  * a clamp that can bind (bounds inside [-127, 127]);
  * a scale over the whole tensor (per-tensor) or other dims;
  * another rounding (round half away from zero: sign(v) * floor(|v| + 0.5); a bare cast
    truncates);
  * an fp32 input (the op takes fp16 / bf16).
A scale floored at eps (torchao's `clamp(min=eps)`) fuses with a note: it differs only for a
row whose max is below 127 * eps. Code that quantizes in bf16 / fp16 step by step rounds the
quotient to that dtype before rounding it to an integer; the op computes it in fp32 and is
closer to exact (a note; FusionConfig.keep_intermediate_rounding refuses it).
"""
import torch

from npu_fx_fusion.capabilities import capability, unsupported
from npu_fx_fusion.constants import constant_number
from npu_fx_fusion.matching import Form, FusionPass, is_call, normalized_dims, tensor_meta

aten = torch.ops.aten


# ---- the unfused forms, as model code writes them -------------------------------------------
# qmax, lo and hi are captured from the graph (check() says which values are the op's)
def scale_then_divide(x, qmax, lo, hi):
    # SmoothQuant / torchao-style per-token absmax in fp32
    scale = x.abs().amax(dim=-1, keepdim=True).float() / qmax
    return torch.clamp(torch.round(x.float() / scale), lo, hi).to(torch.int8), scale


def floored_scale_then_divide(x, eps, qmax, lo, hi):
    # torchao choose_qparams_affine (SYMMETRIC): the scale floored at eps after the division
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True).float() / qmax, min=eps)
    return torch.clamp(torch.round(x.float() / scale), lo, hi).to(torch.int8), scale


def reciprocal_scale(x, qmax, lo, hi):
    # vLLM's reference (tests/kernels/quant_utils.py ref_dynamic_per_token_quant, int8)
    amax, _ = x.abs().max(dim=-1)
    scale = (amax.float() / qmax)[..., None]
    return torch.clamp(torch.round(x.float() * (1.0 / scale)), lo, hi).to(torch.int8), scale


def multiply_by_qmax_over_amax(x, qmax, lo, hi):
    # the kernels' own order (vLLM's CUDA dynamic_scaled_int8_quant, the NPU's): x * (127 / amax)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return torch.clamp(torch.round(x.float() * (qmax / amax)), lo, hi).to(torch.int8), amax / qmax


def in_input_dtype(x, eps, qmax, lo, hi):
    # torchao's quantize_activation_per_token_absmax for bf16: scale and quotient in x's dtype
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True) / qmax, min=eps)
    return torch.clamp(torch.round(x * (1.0 / scale)), lo, hi).to(torch.int8), scale


# ---- the fused calls --------------------------------------------------------------------------
def npu_dynamic_quant(x, qmax, lo, hi):
    q, scale = torch.ops.npu.npu_dynamic_quant(x)
    return q, scale.unsqueeze(-1)


def npu_dynamic_quant_floored(x, eps, qmax, lo, hi):
    q, scale = torch.ops.npu.npu_dynamic_quant(x)
    return q, scale.unsqueeze(-1)


def npu_dynamic_quant_in_input_dtype(x, eps, qmax, lo, hi):
    q, scale = torch.ops.npu.npu_dynamic_quant(x)
    return q, scale.unsqueeze(-1).to(x.dtype)


FORMS = [
    Form(floored_scale_then_divide, npu_dynamic_quant_floored),
    Form(scale_then_divide, npu_dynamic_quant),
    Form(reciprocal_scale, npu_dynamic_quant),
    Form(multiply_by_qmax_over_amax, npu_dynamic_quant),
    Form(in_input_dtype, npu_dynamic_quant_in_input_dtype, dtypes=(torch.bfloat16,)),
]


# ---- checks -----------------------------------------------------------------------------------
QMAX = 127  # the op's divisor: int8's largest value (ops-nn DYNAMIC_QUANT_INT8_SYM_SCALE)
# clamps that never bind after an amax / 127 scaling (|q| <= 127): the op has none
NON_BINDING_LOWER = (-128, -127)
FLOOR_NOTE = ("the code floors the scale at eps={eps}; npu_dynamic_quant does not: a row whose max |x| is below "
              "{limit:.3g} quantizes differently")
IN_INPUT_DTYPE_NOTE = ("quantized in fp32 and rounded once, where the code divides in {dtype} and rounds that "
                       "quotient: q can differ by one where the {dtype} quotient lands on another integer")


def _scale_problem(qmax, lo, hi):
    if qmax != QMAX:
        return (f"the scale is max|x| / {qmax}: npu_dynamic_quant divides by {QMAX} (its range is [-127, 127]; "
                f"a divisor of {qmax} is another quantization)")
    if lo not in NON_BINDING_LOWER or hi != QMAX:
        return (f"clamps to [{lo}, {hi}]: npu_dynamic_quant's values span [-127, 127] with no clamp "
                "(only bounds that cannot bind, [-128 or -127, 127], are its math)")
    return None


def check(site):
    x = site["x"]
    problem = _scale_problem(site["qmax"], site["lo"], site["hi"])
    if problem:
        return problem
    problem = unsupported("npu.npu_dynamic_quant", site.soc, x=x)
    if problem:
        return problem
    multiple = capability("npu.npu_dynamic_quant").limits["310p_last_dim_multiple"]
    if site.soc == "Ascend310P" and x.shape[-1] % multiple:
        return f"npu_dynamic_quant on Ascend310P needs the last dim a multiple of {multiple}, got {x.shape[-1]}"
    if site.form.search is in_input_dtype:
        dtype = str(x.dtype).removeprefix("torch.")
        if site.keep_intermediate_rounding:
            return (f"quantizes in {dtype} step by step; npu_dynamic_quant computes in fp32 "
                    "(FusionConfig.keep_intermediate_rounding keeps the code's roundings)")
        site.notes.append(IN_INPUT_DTYPE_NOTE.format(dtype=dtype))
    if "eps" in site.args:
        site.notes.append(FLOOR_NOTE.format(eps=site["eps"], limit=QMAX * site["eps"]))
    return None


# ---- near misses: a quantization to integers that no form consumed -------------------------------
# Two kinds of site: a cast of rounded floats to int8, and a rounding to integers in a row's
# scale that is never cast (a fake quantization, dequantized in place: compressed-tensors' QDQ).
_VIEWS = (aten.view.default, aten.reshape.default, aten.expand.default)
_FILLS = (aten.full.default, aten.full_like.default, aten.zeros.default, aten.zeros_like.default,
          aten.ones.default, aten.ones_like.default)
_REDUCTIONS = (aten.amax.default, aten.max.dim, aten.max.default, aten.aminmax.default, aten.amin.default)


def _int8_cast_source(node):
    """The float tensor `node` casts to int8 (aten._to_copy or torch_npu's cast), else None."""
    npu_cast = getattr(getattr(torch.ops, "npu", None), "_npu_dtype_cast", None)
    if is_call(node, aten._to_copy.default) and node.kwargs.get("dtype") == torch.int8:
        source = node.args[0]
    elif npu_cast is not None and is_call(node, npu_cast.default) and node.args[1:] == (torch.int8,):
        source = node.args[0]
    else:
        return None
    value = tensor_meta(source)
    return source if value is not None and value.is_floating_point() else None


def _strip(node):
    """(the rounding or other op under the views, clamp and zero-point add of a quantization,
    the clamp's bounds)."""
    lo = hi = None
    while True:
        if is_call(node, *_VIEWS):
            node = node.args[0]
        elif is_call(node, aten.clamp.default, aten.clamp.Tensor) and lo is None:
            lo, hi = (list(node.args[1:]) + [None, None])[:2]
            node = node.args[0]
        elif is_call(node, aten.add.Tensor) and any(is_call(a, aten.round.default) for a in node.args[:2]):
            node = next(a for a in node.args[:2] if is_call(a, aten.round.default))  # + a zero point
        else:
            return node, lo, hi


def _quotient(round_node):
    """What a rounding rounds, under a clamp and a zero-point add (compressed-tensors clamps
    before it rounds): x / scale, x * (1 / scale) ..."""
    value = round_node.args[0]
    while is_call(value, aten.clamp.default, aten.clamp.Tensor, aten.add.Tensor, *_VIEWS):
        value = value.args[0]
    return value


def _is_row_scaled(round_node):
    """A rounding of values divided by a scale computed from a reduction (not a constant)."""
    return any(is_call(n, *_REDUCTIONS) for n in _walk_up(_quotient(round_node)))


def _fake_quantization(node):
    """A rounding in a reduced scale whose result is never cast to int8 (every use stays float)."""
    if not is_call(node, aten.round.default) or not _is_row_scaled(node):
        return False
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if _int8_cast_source(user) is not None:
            return False
        if is_call(user, *_VIEWS, aten.clamp.default, aten.clamp.Tensor, aten.add.Tensor):
            pending.extend(user.users)
    return True


def anchor(node):
    source = _int8_cast_source(node)
    if source is not None:
        # a cast of computed floats (a constant fill rounded and cast is a zero point, not a quantization)
        base = source
        while is_call(base, aten.round.default, aten.clamp.default, aten._to_copy.default, *_VIEWS):
            base = base.args[0]
        return not is_call(base, *_FILLS)
    return _fake_quantization(node)


def _walk_up(start, limit=24):
    """The nodes `start` (the quotient before rounding) is computed from, breadth first, up to
    `limit` of them, not looking past a tensor as large as `start`: the quantized tensor's own
    history is not the scale's."""
    value = tensor_meta(start)
    full = value.numel() if value is not None else None

    def large(node):
        found = tensor_meta(node)
        return found is not None and full is not None and found.numel() == full

    seen, order, todo = {start}, [], [start]
    while todo and len(order) < limit:
        node = todo.pop(0)
        order.append(node)
        if node is not start and large(node):
            continue
        for parent in node.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return order


def _number(arg):
    """A Python number, or the value of a constant scalar tensor the graph computes (compressed-tensors'
    `bit_range / 2` of two tensor constants), else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return arg
    return constant_number(arg) if isinstance(arg, torch.fx.Node) else None


def explain(node):
    fake = is_call(node, aten.round.default)
    rounding, lo, hi = (node, None, None) if fake else _strip(_int8_cast_source(node))
    if not is_call(rounding, aten.round.default):
        if any(is_call(n, aten.floor.default, aten.sign.default) for n in _walk_up(rounding, 8)):
            return ("rounds half away from zero (sign(v) * floor(|v| + 0.5)); npu_dynamic_quant rounds half to "
                    "even, as torch.round does")
        return "the values are not rounded before the int8 cast (a cast truncates); npu_dynamic_quant rounds"
    ancestors = _walk_up(_quotient(rounding))
    reductions = [n for n in ancestors if is_call(n, *_REDUCTIONS)]
    for reduction in reductions:
        source = tensor_meta(reduction.args[0])
        dims = reduction.args[1] if len(reduction.args) > 1 else None
        if source is not None and (not dims or normalized_dims(dims, source.dim()) != [source.dim() - 1]):
            over = "the whole tensor (per-tensor)" if not dims or len(normalized_dims(dims, source.dim())) == \
                source.dim() else f"dims {list(dims)}"
            return f"the scale is the max over {over}; npu_dynamic_quant scales each token (row) by its own max"
    if not reductions:
        return "the scale is not a row max of |x| computed here (a static or precomputed scale)"
    for step in ancestors:
        if is_call(step, aten.div.Tensor, aten.mul.Tensor):
            number = next((n for n in map(_number, step.args[:2]) if n is not None and n != 1), None)
            if number is not None and abs(number - QMAX) > 1e-9 and abs(number * QMAX - 1) > 1e-6:
                return (f"the scale comes from max|x| and {number:g}: npu_dynamic_quant's scale is max|x| / {QMAX} "
                        "(a divisor of 127.5 is the [-128, 127] range's, another quantization)")
    if any(is_call(n, aten.amin.default, aten.aminmax.default) for n in reductions):
        return "the scale comes from the row's min and max (asymmetric); npu_dynamic_quant is symmetric (max |x|)"
    if fake:
        return ("a fake quantization: the rounded values are dequantized in place, never cast to int8; "
                "npu_dynamic_quant outputs int8 for an int8 GEMM")
    if isinstance(lo, (int, float)) and (lo not in NON_BINDING_LOWER or hi != QMAX):
        return f"clamps to [{lo}, {hi}]: npu_dynamic_quant's values span [-127, 127] with no clamp"
    quantized = _uncast(reductions[0].args[0])
    if is_call(quantized, aten.abs.default):
        quantized = _uncast(quantized.args[0])
    source = tensor_meta(quantized)
    if source is not None and source.dtype not in capability("npu.npu_dynamic_quant").dtypes:
        return f"quantizes a {str(source.dtype)[6:]} tensor; npu_dynamic_quant takes fp16 / bf16"
    chain = " -> ".join(str(n.target).removeprefix("aten.") for n in reversed(ancestors) if n.op == "call_function")
    return f"a per-token int8 quantization spelled unlike every form ({chain} -> round -> int8)"


def _uncast(node):
    while is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        node = node.args[0]
    return node


PASS = FusionPass(
    name="dynamic_quant",
    fused_op="npu.npu_dynamic_quant",
    forms=FORMS,
    example={
        "x": lambda dtype: torch.empty(2, 3, 16, dtype=dtype),
        # marks in the trace: values no form computes otherwise
        "qmax": 13.0,
        "lo": -29,
        "hi": 31,
        "eps": 2.0**-17,
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (aten._to_copy.default, aten.round.default,
                        getattr(getattr(torch.ops, "npu", None), "_npu_dtype_cast", None)),
    explain=explain,
)
