"""weight_quant_matmul: a linear over an int8 / int4 weight dequantized in the graph ->
torch.ops.npu.npu_weight_quant_batchmatmul.

    w_dq = (w_int - zero) * scale             # per output channel, or per group of 32.. along K
    y    = x @ w_dq.t()                       # x fp16 / bf16
 -> y = npu_weight_quant_batchmatmul(x, w_int.t(), scale, offset=-zero, antiquant_group_size=g)

The op dequantizes with (w + offset) * scale (docs/passes/weight_quant_matmul.md), so the code's
zero point z becomes offset = -z, exactly (a negation). Its scale and offset are in x's dtype,
(N,) per channel or (ceil(K / g), N) per group; the weight is (K, N) int8, which the Linear
layout (N, K) gives as a transposed view (no copy). Spellings:
  * compressed-tensors' channel-int8 weight-only `dequantize`, then F.linear;
  * torchao's int8 weight-only linear (x @ w, then times the per-channel scale);
  * torchao's int4 weight-only (IntxWeightOnlyConfig, int4 values held in int8, group 32);
  * HQQ's 4-bit: two rows per byte unpacked (`(W >> 4) & 0xF`, `W & 0xF`), per-group scale
    and zero point;
  * GPTQ's int32 qweight / qzeros unpacked by shifts and masks, per-group (K) scales.
The unpacking ops stay as the code writes them: they feed the fused op the int4 values one per
int8 (a uint8 unpack is cast to int8, exact: the masks prove the values below 16). The op's own
int4 layout (8 values per int32) would halve the weight reads again, but building it from the
model's packing is a per-step repack of the whole weight unless the weight is a constant of
the compile; this pass does not do it (docs/passes/weight_quant_matmul.md).

Numerics: for a bf16 x the op dequantizes in fp32 and rounds the weight to bf16 once; code
that dequantizes in bf16 rounds after the subtraction too (<= 1 bf16 ulp per weight); torchao's
int8 weight-only multiplies the scale into the product instead (a rounding of the product, then
of the scaled product). The matmul accumulates in fp32 in both.
"""
import torch

from npu_fx_fusion.capabilities import capability, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten


# ---- the unfused forms ------------------------------------------------------------------------
def channel_dequantized(x, weight, scale_col):
    # compressed-tensors dequantize (strategy channel): weight (N, K) int8, scale (N, 1); F.linear
    return x @ (weight.to(scale_col.dtype) * scale_col).t()


def channel_scaled_product(x, weight, scale_col):
    # torchao Int8Tensor weight-only, per row: x @ w.t(), then times the scale
    return torch.mm(x, weight.t().to(x.dtype)) * scale_col.to(x.dtype).reshape(-1)


def group_dequantized_zero(x, weight, zero_ng, scale_ng):
    # torchao IntxUnpackedToInt8Tensor (int4 in int8): weight (N, K), zero and scale (N, K / g)
    n, groups = scale_ng.shape
    grouped = weight.reshape(n, groups, -1).to(x.dtype) - zero_ng.reshape(n, groups, 1).to(x.dtype)
    return torch.mm(x, (grouped * scale_ng.reshape(n, groups, 1)).reshape(n, -1).t())


def hqq_rows(x, w_rows, zero_rows, scale_rows):
    # HQQ (axis=1): each of the N*K/g rows of g values has a scale and a zero point (N*K/g, 1)
    k = x.shape[-1]
    return x @ ((w_rows.to(x.dtype) - zero_rows) * scale_rows).reshape(-1, k).t()


def gptq_groups(x, w_groups, zeros_gn, scales_gn):
    # GPTQ (gptqmodel TorchQuantLinear.dequantize_weight): w (K / g, g, N) int8, zeros (K / g, N)
    n = scales_gn.shape[-1]
    dequantized = scales_gn.view(-1, 1, n) * (w_groups - zeros_gn.view(-1, 1, n))
    return x @ dequantized.reshape(-1, n)


# ---- the fused calls ----------------------------------------------------------------------------
def _npu_weight_quant(x, weight_kn, scale, offset, group):
    """npu_weight_quant_batchmatmul on x's rows: weight (K, N) int8, scale / offset (N,) or
    (K / group, N) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.npu.npu_weight_quant_batchmatmul(rows, weight_kn.to(torch.int8), scale.to(x.dtype),
                                                   None if offset is None else offset.to(x.dtype),
                                                   antiquant_group_size=group)
    return y.reshape(*x.shape[:-1], weight_kn.shape[-1])


def npu_weight_quant_channel(x, weight, scale_col):
    return _npu_weight_quant(x, weight.t(), scale_col.reshape(-1), None, 0)


def npu_weight_quant_channel_scaled(x, weight, scale_col):
    return _npu_weight_quant(x, weight.t(), scale_col.to(x.dtype).reshape(-1), None, 0)


def npu_weight_quant_group(x, weight, zero_ng, scale_ng):
    group = weight.shape[-1] // scale_ng.shape[-1]
    return _npu_weight_quant(x, weight.t(), scale_ng.t(), -zero_ng.to(x.dtype).t(), group)


def npu_weight_quant_hqq(x, w_rows, zero_rows, scale_rows):
    k = x.shape[-1]
    n, group = w_rows.numel() // k, w_rows.shape[-1]
    return _npu_weight_quant(x, w_rows.reshape(n, k).t(), scale_rows.reshape(n, -1).t(),
                             (-zero_rows).reshape(n, -1).t(), group)


def npu_weight_quant_gptq(x, w_groups, zeros_gn, scales_gn):
    group = w_groups.shape[1]
    return _npu_weight_quant(x, w_groups.reshape(-1, w_groups.shape[-1]), scales_gn, -zeros_gn.to(x.dtype),
                             group)


FORMS = [
    Form(group_dequantized_zero, npu_weight_quant_group),
    Form(hqq_rows, npu_weight_quant_hqq),
    Form(gptq_groups, npu_weight_quant_gptq),
    Form(channel_scaled_product, npu_weight_quant_channel_scaled),
    Form(channel_dequantized, npu_weight_quant_channel),
]


# ---- checks -------------------------------------------------------------------------------------
def _upper_bound(node, limit=12):
    """An upper bound of the integer values `node` holds, from the masks and shifts that made
    them (`W & 0xF`, `(W & 0xF0) >> 4`, their cat), else the dtype's maximum."""
    value = tensor_meta(node)
    if value is None or value.is_floating_point() or value.dtype == torch.bool:
        return None
    if limit and is_call(node, aten.bitwise_and.Scalar) and isinstance(node.args[1], int) and node.args[1] >= 0:
        return node.args[1]
    if limit and is_call(node, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar) \
            and isinstance(node.args[1], int):
        bound = _upper_bound(node.args[0], limit - 1)
        return None if bound is None else bound >> node.args[1]
    if limit and is_call(node, aten.cat.default):
        bounds = [_upper_bound(part, limit - 1) for part in node.args[0]]
        return None if None in bounds else max(bounds)
    if limit and is_call(node, aten.view.default, aten.reshape.default, aten._to_copy.default, aten.t.default,
                         aten.slice.Tensor, aten.clone.default):
        return _upper_bound(node.args[0], limit - 1)
    return torch.iinfo(value.dtype).max


def _weight_node(site):
    name = next(n for n in ("weight", "w_rows", "w_groups") if n in site.arg_nodes)
    return site.arg_nodes[name], site[name]


def check(site):
    x = site["x"]
    node, weight = _weight_node(site)
    if weight.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        return f"the weight is {weight.dtype}, not integers"
    bound = _upper_bound(node)
    if weight.dtype != torch.int8 and (bound is None or bound > 127):
        return (f"the weight is {str(weight.dtype)[6:]} with values up to {bound} (nothing in the graph bounds "
                "them below 128): npu_weight_quant_batchmatmul takes int8")
    k = x.shape[-1]
    scales = [site[n] for n in ("scale_col", "scale_ng", "scale_rows", "scales_gn") if n in site.args]
    # (torchao's int8 weight-only casts its fp32 scale to x's dtype itself)
    if scales and scales[0].dtype != x.dtype and site.form.search is not channel_scaled_product:
        return (f"the scale is {str(scales[0].dtype)[6:]} and x {str(x.dtype)[6:]}: npu_weight_quant_batchmatmul "
                "dequantizes with a scale in x's dtype")
    zeros = [site[n] for n in ("zero_ng", "zero_rows") if n in site.args]
    if zeros and zeros[0].is_floating_point() and zeros[0].dtype != x.dtype:
        return f"the zero point is {str(zeros[0].dtype)[6:]}, x {str(x.dtype)[6:]}: the op's offset is in x's dtype"
    group = _group_size(site, k)
    cap = capability("npu.npu_weight_quant_batchmatmul")
    if group and (group % cap.limits["group_size_multiple"] or not 32 <= group < k):
        return (f"groups of {group} along K={k}: npu_weight_quant_batchmatmul takes groups of a multiple of "
                f"{cap.limits['group_size_multiple']} in [32, K-1]")
    n = site["scale_col"].shape[0] if "scale_col" in site.args else None
    limit = cap.limits["max_k_n"]
    if k > limit or (n is not None and n > limit):
        return f"npu_weight_quant_batchmatmul takes K and N up to {limit}"
    if group and site.soc in cap.limits["per_group_socs_excluded"]:
        return f"npu_weight_quant_batchmatmul has no per-group mode on {site.soc}"
    return unsupported("npu.npu_weight_quant_batchmatmul", site.soc, x=x.reshape(-1, k))


def _group_size(site, k):
    if "scale_ng" in site.args:
        return k // site["scale_ng"].shape[-1]
    if "w_rows" in site.args:
        return site["w_rows"].shape[-1]
    if "w_groups" in site.args:
        return site["w_groups"].shape[1]
    return 0


# ---- near misses: a matmul whose weight is dequantized from integers, left unfused --------------
_MATMULS = (aten.matmul.default, aten.mm.default, aten.bmm.default, aten.linear.default)


_QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32)  # not int64: indices, positions


def integer_source(node, limit=10, min_dims=2):
    """The integer tensor `node` (a matmul operand) is dequantized from: an int8 / uint8 / int16 /
    int32 tensor of `min_dims`+ dims reached within `limit` ops through a multiply (the scale), else
    None (also quant_grouped_matmul's, for 3-d experts)."""
    seen, todo = set(), [(node, False)]
    while todo and len(seen) < limit:
        current, scaled = todo.pop()
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        seen.add(current)
        value = tensor_meta(current)
        if value is not None and value.dtype in _QUANTIZED_DTYPES and value.dim() >= min_dims:
            return current if scaled else None
        if current.op == "call_function":
            scaled = scaled or is_call(current, aten.mul.Tensor)
            todo.extend((parent, scaled) for parent in current.all_input_nodes)
    return None


def anchor(node):
    if not is_call(node, *_MATMULS) or len(node.args) < 2:
        return False
    activation, weight = (tensor_meta(a) for a in node.args[:2])
    return (activation is not None and activation.is_floating_point() and integer_source(node.args[0]) is None
            and integer_source(node.args[1]) is not None)


def explain(node):
    weight = integer_source(node.args[1])
    value = tensor_meta(weight)
    x = tensor_meta(node.args[0])
    if x is not None and x.dtype not in capability("npu.npu_weight_quant_batchmatmul").dtypes:
        return f"npu_weight_quant_batchmatmul takes an fp16 / bf16 activation, got {str(x.dtype)[6:]}"
    return (f"the weight is dequantized from {str(value.dtype)[6:]} {tuple(value.shape)} ({weight.name}) in a way no "
            "form takes (per channel or per group of K, scale times (w - zero))")


PASS = FusionPass(
    name="weight_quant_matmul",
    # a dequantized int8 activation times a dequantized int8 weight is quant_matmul's (W8A8)
    after=("quant_matmul",),
    fused_op="npu.npu_weight_quant_batchmatmul",
    forms=FORMS,
    example={
        "x": lambda dtype: torch.empty(3, 64, dtype=dtype),
        "weight": lambda dtype: torch.empty(16, 64, dtype=torch.int8),
        "scale_col": lambda dtype: torch.empty(16, 1, dtype=dtype),
        "zero_ng": lambda dtype: torch.empty(16, 2, dtype=torch.int8),
        "scale_ng": lambda dtype: torch.empty(16, 2, dtype=dtype),
        "w_rows": lambda dtype: torch.empty(32, 32, dtype=torch.uint8),
        "zero_rows": lambda dtype: torch.empty(32, 1, dtype=dtype),
        "scale_rows": lambda dtype: torch.empty(32, 1, dtype=dtype),
        "w_groups": lambda dtype: torch.empty(2, 32, 16, dtype=torch.int8),
        "zeros_gn": lambda dtype: torch.empty(2, 16, dtype=torch.int8),
        "scales_gn": lambda dtype: torch.empty(2, 16, dtype=dtype),
    },
    check=check,
    anchor=anchor,
    anchor_ops=_MATMULS,
    explain=explain,
)
