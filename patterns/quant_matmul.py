"""quant_matmul: an int8 x int8 GEMM dequantized per token and per channel -> npu_quant_matmul.

    acc = q @ w                               # q int8 (M, K): a per-token quantized activation
                                              # w int8 (K, N): a per-channel quantized weight
    y   = (acc * x_scale[m] * w_scale[n]).to(bf16 / fp16)
 -> y = npu_quant_matmul(q, w, w_scale, pertoken_scale=x_scale, output_dtype=bf16 / fp16)

The GEMM appears as torch._int_mm (torchao, SmoothQuant-style modules; torchao's CPU kernel
also spells it as a uint8 GEMM with a column-sum correction, exact in int32), or as a float
matmul of the two dequantized operands (vLLM / compressed-tensors: `F.linear(q * x_scale,
w * w_scale)`), which is the same product of integers, scaled. torch_npu has no _int_mm
kernel: on an NPU this pass is what runs the GEMM at all.

Numerics (docs/passes/quant_matmul.md): the op accumulates q @ w exactly in int32 and applies
fp32(acc) * scale[n] * pertoken_scale[m] (+ bias) with one rounding to the output dtype. The
code rounds where it rounds: torchao to bf16 after the per-token scale and again after the
per-channel one; the dequantize-then-matmul spelling rounds each dequantized operand to bf16
before its (fp32-accumulated) matmul. The fused result is the exact quantized product rounded
once, so it differs from the code's by the code's own roundings: a few bf16 ulps of the output
for the first, up to about 2^-8 of sum(|x_dq| |w_dq|) for the second.
The activation's int8 values come from anywhere (npu_dynamic_quant after the dynamic_quant
pass, or code it left alone, such as torchao's amax / 127.5 quantization).
"""
import torch

from npu_fx_fusion.capabilities import capability, unsupported
from npu_fx_fusion.matching import Form, FusionPass, dtype_argument, is_call, known_equal, tensor_meta

aten = torch.ops.aten


# ---- the unfused forms ------------------------------------------------------------------------
# q (M, K) int8, w (K, N) int8 (or (N, K) for the dequantized linear), x_scale (M, 1),
# w_scale (N,) / (N, 1); the output dtype is written in the code, so each spelling is a form per
# output dtype.
def int_mm_then_scales_to_bf16(q, w, x_scale, w_scale):
    # torchao-style / SmoothQuant: both scales in fp32, one cast at the end
    return (torch._int_mm(q, w).float() * x_scale * w_scale).to(torch.bfloat16)


def int_mm_then_scales_to_fp16(q, w, x_scale, w_scale):
    return (torch._int_mm(q, w).float() * x_scale * w_scale).to(torch.float16)


def _u8s8_int_mm(q, w):
    # torchao's CPU u8s8 kernel (kernel/intmm.py _int_scaled_matmul_cpu on AVX512-VNNI):
    # (q + 128) as uint8 @ w - 128 * column sums of w, which is q @ w in int32
    shifted = (q.to(torch.int32) + 128).to(torch.uint8)
    return torch._int_mm(shifted, w) - w.sum(dim=0, keepdim=True, dtype=torch.int32) * 128


def torchao_int8_tensor_to_bf16(q, w, x_scale, w_scale):
    # torchao 0.18 Int8Tensor linear (s8s8): int_scaled_matmul rounds to the output dtype after the
    # per-token scale, the per-channel scale is applied in it
    return (torch._int_mm(q, w).to(torch.float32) * x_scale).to(torch.bfloat16) * w_scale


def torchao_int8_tensor_to_fp16(q, w, x_scale, w_scale):
    return (torch._int_mm(q, w).to(torch.float32) * x_scale).to(torch.float16) * w_scale


def torchao_int8_tensor_u8s8_to_bf16(q, w, x_scale, w_scale):
    return (_u8s8_int_mm(q, w).to(torch.float32) * x_scale).to(torch.bfloat16) * w_scale


def torchao_int8_tensor_u8s8_to_fp16(q, w, x_scale, w_scale):
    return (_u8s8_int_mm(q, w).to(torch.float32) * x_scale).to(torch.float16) * w_scale


def dequantized_linear_bf16(q, x_scale, weight, weight_scale):
    # vLLM's reference quant + compressed-tensors' dequantize + F.linear: x_dq = q * x_scale
    # (fp32, cast to the model dtype), w_dq = weight * weight_scale in the scale's dtype, with
    # the weight as nn.Linear holds it, (N, K), and its scale (N, 1)
    x_dq = (q.to(torch.float32) * x_scale).to(torch.bfloat16)
    return x_dq @ (weight.to(torch.bfloat16) * weight_scale).t()


def dequantized_linear_fp16(q, x_scale, weight, weight_scale):
    x_dq = (q.to(torch.float32) * x_scale).to(torch.float16)
    return x_dq @ (weight.to(torch.float16) * weight_scale).t()


def int_mm(q, w):
    # the bare int8 GEMM (last: a sub-pattern of the others)
    return torch._int_mm(q, w)


# ---- the fused calls --------------------------------------------------------------------------
def _npu_quant_matmul(q, w, x_scale, w_scale, out):
    """npu_quant_matmul on q's rows: x_scale one fp32 per row, w_scale (N,) in fp32, or in bf16
    for a bf16 output (the op's dtype pairs: a bf16 scale gives a bf16 output only)."""
    rows = q.reshape(-1, q.shape[-1])
    scale = w_scale.reshape(-1)
    if not (scale.dtype == torch.float32 or (scale.dtype == torch.bfloat16 and out == torch.bfloat16)):
        scale = scale.float()  # fp16 -> fp32 is exact
    y = torch.ops.npu.npu_quant_matmul(rows, w, scale, pertoken_scale=x_scale.reshape(-1).float(),
                                       output_dtype=dtype_argument(out))
    return y.reshape(*q.shape[:-1], w.shape[-1])


def npu_quant_matmul_bf16(q, w, x_scale, w_scale):
    return _npu_quant_matmul(q, w, x_scale, w_scale, torch.bfloat16)


def npu_quant_matmul_fp16(q, w, x_scale, w_scale):
    return _npu_quant_matmul(q, w, x_scale, w_scale, torch.float16)


def npu_quant_matmul_then_weight_scale_dtype_bf16(q, w, x_scale, w_scale):
    # torchao multiplies the bf16 product by its fp32 weight scale: an fp32 result (cast back to
    # bf16 after its reshape; cleanup drops that round trip)
    y = _npu_quant_matmul(q, w, x_scale, w_scale, torch.bfloat16)
    return y.to(torch.promote_types(torch.bfloat16, w_scale.dtype))


def npu_quant_matmul_then_weight_scale_dtype_fp16(q, w, x_scale, w_scale):
    y = _npu_quant_matmul(q, w, x_scale, w_scale, torch.float16)
    return y.to(torch.promote_types(torch.float16, w_scale.dtype))


def npu_quant_matmul_of_dequantized_bf16(q, x_scale, weight, weight_scale):
    return _npu_quant_matmul(q, weight.t(), x_scale, weight_scale, torch.bfloat16)


def npu_quant_matmul_of_dequantized_fp16(q, x_scale, weight, weight_scale):
    return _npu_quant_matmul(q, weight.t(), x_scale, weight_scale, torch.float16)


def npu_quant_matmul_int32(q, w):
    ones = torch.ones(w.shape[-1], dtype=torch.float32, device=w.device)
    return torch.ops.npu.npu_quant_matmul(q, w, ones, output_dtype=dtype_argument(torch.int32))


FORMS = [
    Form(torchao_int8_tensor_u8s8_to_bf16, npu_quant_matmul_then_weight_scale_dtype_bf16),
    Form(torchao_int8_tensor_u8s8_to_fp16, npu_quant_matmul_then_weight_scale_dtype_fp16),
    Form(torchao_int8_tensor_to_bf16, npu_quant_matmul_then_weight_scale_dtype_bf16),
    Form(torchao_int8_tensor_to_fp16, npu_quant_matmul_then_weight_scale_dtype_fp16),
    Form(int_mm_then_scales_to_bf16, npu_quant_matmul_bf16),
    Form(int_mm_then_scales_to_fp16, npu_quant_matmul_fp16),
    Form(dequantized_linear_bf16, npu_quant_matmul_of_dequantized_bf16),
    Form(dequantized_linear_fp16, npu_quant_matmul_of_dequantized_fp16),
    Form(int_mm, npu_quant_matmul_int32),
]


# ---- checks -----------------------------------------------------------------------------------
def check(site):
    q = site["q"]
    w = site["weight"].t() if "weight" in site.args else site["w"]  # (K, N)
    k, n = w.shape[0], w.shape[1]
    if q.dtype != torch.int8 or w.dtype != torch.int8 or w.dim() != 2 or q.shape[-1] != k:
        return f"the GEMM is not int8 (M, K) x int8 (K, N): {q.dtype} {tuple(q.shape)} x {w.dtype} {tuple(w.shape)}"
    limit = capability("npu.npu_quant_matmul").limits["max_k_n"]
    if k > limit or n > limit:
        return f"npu_quant_matmul takes K and N up to {limit}, got K={k}, N={n}"
    if "x_scale" not in site.args:  # the bare GEMM: an int32 output
        if site.soc in capability("npu.npu_quant_matmul").limits["int32_output_socs_excluded"]:
            return f"npu_quant_matmul has no int32 output on {site.soc}"
        return None
    x_scale = site["x_scale"]
    w_scale = site["weight_scale"] if "weight_scale" in site.args else site["w_scale"]
    reason = per_token_scale_reason(x_scale, q.numel() // q.shape[-1], k, "npu_quant_matmul")
    if reason:
        return reason
    if w_scale.numel() not in (1, n) or (w_scale.dim() == 2 and 1 not in w_scale.shape):
        return f"the weight scale {tuple(w_scale.shape)} is not per output channel ({n},)"
    if x_scale.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the activation scale is {x_scale.dtype}"
    if site.soc in capability("npu.npu_quant_matmul").limits["pertoken_socs_excluded"]:
        return f"npu_quant_matmul takes no per-token scale on {site.soc}"
    out = torch.empty((1, 1), dtype=torch.bfloat16 if "bf16" in site.form.name else torch.float16)
    return unsupported("npu.npu_quant_matmul", site.soc, x=out)


def per_token_scale_reason(x_scale, rows, k, op):
    """Why `x_scale` is not one scale per token (row) of the (rows, k) int8 activation, or None
    (also quant_grouped_matmul's: the same per-token scale of its expert GEMM)."""
    # (sizes compared with known_equal: under dynamic=True a `!=` of two SymInts would guard)
    if x_scale.dim() == 0 or x_scale.shape[-1] != 1 or not known_equal(x_scale.numel(), rows):
        return (f"the activation scale {tuple(x_scale.shape)} is not one per token of the ({rows}, {k}) "
                f"activation: {op} takes a per-token scale")
    return None


# ---- near misses: an int8 GEMM left as it was --------------------------------------------------
def anchor(node):
    return is_call(node, aten._int_mm.default)


def explain(node):
    a, b = (tensor_meta(arg) for arg in node.args[:2])
    if a is not None and a.dtype != torch.int8:
        return f"the activation of the int8 GEMM is {str(a.dtype)[6:]} (a shifted uint8 spelling no form takes)"
    users = [u for u in node.users]
    if len(users) > 1:
        return f"the int32 product is used {len(users)} times (by {', '.join(u.name for u in users)})"
    return ("the int32 product is not scaled per token and per channel in a way a form takes "
            f"(it goes to {users[0].name if users else 'the output'})")


PASS = FusionPass(
    name="quant_matmul",
    # the activation's int8 values and per-token scale: npu_dynamic_quant where dynamic_quant fused them
    after=("dynamic_quant",),
    fused_op="npu.npu_quant_matmul",
    forms=FORMS,
    example={
        "q": lambda dtype: torch.empty(17, 32, dtype=torch.int8),
        "w": lambda dtype: torch.empty(32, 16, dtype=torch.int8),
        "x_scale": lambda dtype: torch.empty(17, 1, dtype=torch.float32),
        "w_scale": lambda dtype: torch.empty(16, dtype=dtype),
        "weight": lambda dtype: torch.empty(16, 32, dtype=torch.int8),
        "weight_scale": lambda dtype: torch.empty(16, 1, dtype=dtype),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten._int_mm.default,),
    explain=explain,
)
