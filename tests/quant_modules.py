"""Quantized linears as third-party code spells them, for the quantization passes' tests.

Each module holds its quantized weight as the library stores it and computes in its forward
what the library's forward computes, op for op (the source is named on each). The weights
are made here from a random float weight (`from_float`), as a checkpoint converter would.

    TorchaoStyleW8A8Linear     torchao's int8 dynamic per-token activation x int8 per-channel
                               weight linear before its tensor subclasses (SmoothQuant's
                               `quantize_activation_per_token_absmax`: amax / 127, round,
                               clamp, torch._int_mm, the two scales)
    VllmRefW8A8Linear          vLLM's reference per-token int8 quant (tests/kernels/quant_utils.py
                               `ref_dynamic_per_token_quant`) feeding compressed-tensors'
                               `dequantize` (the real function) and F.linear
    CompressedTensorsW8A16Linear  compressed-tensors' channel-int8 weight-only: its real
                               `dequantize` of the int8 weight, then F.linear
    HqqW4Linear                HQQ's 4-bit weight (hqq/core/quantize.py, HQQLinear with
                               `unpack_4bit_u8`: two rows per uint8, halves of dim 0) with
                               per-group (32) scales and zero points
    GptqW4Linear               GPTQ's int32 qweight packed along K and qzeros packed along N
                               (gptqmodel TorchQuantLinear.dequantize_weight), group 32
    QuantizedDecoderBlock      a residual add + RMSNorm (transformers' LlamaRMSNorm) whose
                               output is quantized per token and multiplied as int8
    Int8Experts                MoE expert GEMMs over int8 experts (compressed-tensors' channel
                               scheme, its `dequantize`, transformers' grouped GEMM), weight-only or
                               with a per-token quantized activation (W8A8)
    quantize_experts           a transformers MoE model's 3-d experts made int8 that way
and the look-alikes the passes must refuse (per-tensor scale, amax / 127.5, round half away
from zero).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight (N, K), fp32 scale (N, 1)): symmetric per output channel, amax / 127."""
    scale = weight.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8), scale


def _per_group_uint4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values in [0, 15] (N, K) int32, scale (N, K/group), zero (N, K/group)), asymmetric per group."""
    n, k = weight.shape
    grouped = weight.float().reshape(n, k // group, group)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    values = torch.round(grouped / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return values.reshape(n, k).to(torch.int32), scale, zero


# ---- W8A8: dynamic per-token int8 activations, per-channel int8 weights ----------------
def per_token_absmax_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torchao quantize_activation_per_token_absmax (scale amax / 127, eps 1e-5, clamp [-127, 127])
    # spelled out, with the scale in fp32: choose_qparams_affine divides the row max by
    # (127 - (-127)) / 2 and floors the quotient at eps; quantize_affine rounds and clamps
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True).float() / 127, min=1e-5)
    quantized = torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)
    return quantized, scale


class TorchaoStyleW8A8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias=None, quant=per_token_absmax_quant):
        super().__init__()
        w_int8, w_scale = _per_channel_int8(weight)
        self.register_buffer("w_int8_t", w_int8.t().contiguous())  # (K, N), as torch._int_mm takes it
        self.register_buffer("w_scale", w_scale.squeeze(-1))  # (N,) fp32
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.quant = quant

    @classmethod
    def from_float(cls, linear: nn.Linear, **kwargs):
        return cls(linear.weight.detach(), linear.bias, **kwargs)

    def forward(self, x):
        x_int8, x_scale = self.quant(x)
        y = torch._int_mm(x_int8.reshape(-1, x.shape[-1]), self.w_int8_t)
        y = y.float() * x_scale.reshape(-1, 1) * self.w_scale
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def vllm_ref_dynamic_per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # vLLM tests/kernels/quant_utils.py ref_dynamic_per_token_quant, int8 branch (its
    # as_float32_tensor(...) casts as .float())
    x_token_max, _ = x.abs().max(dim=-1)
    x_token_max = x_token_max.float()
    scales = (x_token_max / 127.0)[:, None]
    iscales = 1.0 / scales
    torch_out = x.float() * iscales
    torch_out = torch_out.round()
    torch_out = torch_out.clamp(-128, 127).to(torch.int8)
    return torch_out, scales


class VllmRefW8A8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias=None):
        super().__init__()
        from compressed_tensors.quantization import QuantizationArgs

        w_int8, w_scale = _per_channel_int8(weight)
        self.register_buffer("weight_q", w_int8)  # (N, K), compressed-tensors' int-quantized layout
        self.register_buffer("weight_scale", w_scale.to(weight.dtype))  # (N, 1) in the model dtype
        self.weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        self.input_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, linear: nn.Linear):
        return cls(linear.weight.detach(), linear.bias)

    def forward(self, x):
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        rows = x.reshape(-1, x.shape[-1])
        x_q, x_scale = vllm_ref_dynamic_per_token_quant(rows)
        x_dq = dequantize(x_q, x_scale, args=self.input_args).to(x.dtype)
        w_dq = dequantize(self.weight_q, self.weight_scale, args=self.weight_args)
        return F.linear(x_dq, w_dq, self.bias).reshape(*x.shape[:-1], -1)


# ---- weight-only ------------------------------------------------------------------------
class CompressedTensorsW8A16Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias=None):
        super().__init__()
        from compressed_tensors.quantization import QuantizationArgs

        w_int8, w_scale = _per_channel_int8(weight)
        self.register_buffer("weight_q", w_int8)
        self.register_buffer("weight_scale", w_scale.to(weight.dtype))
        self.weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, linear: nn.Linear):
        return cls(linear.weight.detach(), linear.bias)

    def forward(self, x):
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        return F.linear(x, dequantize(self.weight_q, self.weight_scale, args=self.weight_args), self.bias)


class HqqW4Linear(nn.Module):
    """HQQ 4-bit, axis=1, group_size 32: W reshaped to (N*K/32, 32) rows quantized with a scale and
    a zero point each; packed two rows per byte, the first half of the rows in the high nibbles."""

    def __init__(self, weight: torch.Tensor, group: int = 32):
        super().__init__()
        n, k = weight.shape
        values, scale, zero = _per_group_uint4(weight, group)
        rows = values.reshape(-1, group).to(torch.uint8)
        half = rows.shape[0] // 2
        self.register_buffer("W_q", (rows[:half] << 4) | rows[half:])  # hqq BitPack.pack_4bit_u8
        self.register_buffer("scale", scale.reshape(-1, 1).to(weight.dtype))
        self.register_buffer("zero", zero.reshape(-1, 1).to(weight.dtype))
        self.shape = (n, k)

    @classmethod
    def from_float(cls, linear: nn.Linear):
        return cls(linear.weight.detach())

    def dequantize(self):
        # hqq BitPack.unpack_4bit_u8, then HQQLinear.dequantize: ((W_r - zero) * scale).reshape(shape)
        w_r = torch.cat([(self.W_q & 0b11110000) >> 4, self.W_q & 0b00001111], dim=0).to(self.scale.dtype)
        return ((w_r - self.zero) * self.scale).reshape(self.shape)

    def forward(self, x):
        return torch.matmul(x, self.dequantize().t())


class GptqW4Linear(nn.Module):
    """GPTQ 4-bit: qweight (K/8, N) int32 packed along K, qzeros (K/32, N/8) packed along N,
    scales (K/32, N); w = scales * (q - zeros) (gptqmodel's v2 zero points: no +1)."""

    def __init__(self, weight: torch.Tensor, group: int = 32):
        super().__init__()
        values, scale, zero = _per_group_uint4(weight, group)  # (N, K), (N, K/g)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        kn = values.t().contiguous()  # (K, N)
        self.register_buffer("qweight", (kn.reshape(-1, 8, kn.shape[1]) << shifts[None, :, None]).sum(1, dtype=torch.int32))
        zeros = zero.t().contiguous().to(torch.int32)  # (K/g, N)
        self.register_buffer("qzeros", (zeros.reshape(zeros.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32))
        self.register_buffer("scales", scale.t().contiguous().to(weight.dtype))
        self.register_buffer("wf", shifts.unsqueeze(0))
        self.group = group

    @classmethod
    def from_float(cls, linear: nn.Linear):
        return cls(linear.weight.detach())

    def dequantize_weight(self):
        # gptqmodel nn_modules/qlinear/torch.py TorchQuantLinear.dequantize_weight (4 bits)
        zeros = torch.bitwise_right_shift(torch.unsqueeze(self.qzeros, 2).expand(-1, -1, 8),
                                          self.wf.unsqueeze(0)).to(torch.int8)
        zeros = torch.bitwise_and(zeros, 15).reshape(self.scales.shape)
        weight = torch.bitwise_right_shift(torch.unsqueeze(self.qweight, 1).expand(-1, 8, -1),
                                           self.wf.unsqueeze(-1)).to(torch.int8)
        weight = torch.bitwise_and(weight, 15)
        weight = weight.reshape(-1, self.group, weight.shape[2])
        weight = self.scales.view(-1, 1, self.scales.shape[-1]) * (weight - zeros.view(-1, 1, zeros.shape[-1]))
        return weight.reshape(-1, weight.shape[-1])

    def forward(self, x):
        return torch.matmul(x, self.dequantize_weight())


# ---- a decoder block's norm feeding a W8A8 linear ----------------------------------------
class QuantizedDecoderBlock(nn.Module):
    """h = x + residual; y = RMSNorm(h) (transformers' LlamaRMSNorm); out = the W8A8 linear of y."""

    def __init__(self, hidden: int, out: int, dtype=torch.bfloat16, eps: float = 1e-6):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.rand(hidden, dtype=dtype) + 0.5, requires_grad=False)
        self.eps = eps
        self.proj = TorchaoStyleW8A8Linear(torch.randn(out, hidden, dtype=dtype))

    def forward(self, x, residual):
        h = x + residual
        hidden = h.to(torch.float32)  # LlamaRMSNorm.forward
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        normed = self.norm_weight * hidden.to(h.dtype)
        return self.proj(normed), h


def quantize_linears(model: nn.Module, make, skip=("lm_head",)) -> int:
    """Replace every nn.Linear of `model` (but those named in `skip`) with `make(linear)`."""
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                setattr(module, child_name, make(child))
                replaced += 1
    return replaced


# ---- MoE experts: transformers' 3-d expert parameters, int8 per (expert, output channel) --------
# transformers 5.24's experts are (E, out, in) parameters, not nn.Linear: neither torchao nor
# compressed-tensors quantizes them there. These quantize them with compressed-tensors' channel
# scheme (symmetric int8, amax / 127 per output channel of each expert, the scale in the model dtype,
# the layout `dequantize` keeps) and dequantize with compressed-tensors' real `dequantize`:
#   quantize_experts(model, "w8a16")  the parameters become properties dequantizing the int8
#                                     buffers: transformers' own grouped_mm experts forward runs
#                                     unchanged (as torchao's weight-only fallback for its fp8
#                                     experts: `_grouped_mm(x, weight.dequantize(), offs)`)
#   quantize_experts(model, "w8a8")   also each GEMM's input quantized per token (vLLM's reference
#                                     quant, dequantized by compressed-tensors): transformers'
#                                     grouped_mm experts forward with its two GEMMs W8A8, registered
#                                     through transformers' ExpertsInterface
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def _dequantized_expert_weight(name):
    def weight(self):
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        return dequantize(getattr(self, f"{name}_q"), getattr(self, f"{name}_scale"), args=self.weight_args)

    return property(weight)


def _w8a8_grouped_linear(experts, x, name, offs):
    # vLLM's reference per-token quant, compressed-tensors' dequantize of both operands, transformers'
    # grouped GEMM of the (E, out, in) weight transposed (integrations/moe.py _grouped_linear)
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers.integrations.moe import _grouped_mm

    x_q, x_scale = vllm_ref_dynamic_per_token_quant(x)
    x_dq = dequantize(x_q, x_scale, args=experts.input_args).to(x.dtype)
    return _grouped_mm(x_dq, getattr(experts, name).transpose(-2, -1), offs)


def w8a8_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm_experts_forward (integrations/moe.py), its routing line for line
    (without expert parallelism and biases), each expert GEMM W8A8 (_w8a8_grouped_linear)."""
    num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    tokens_per_expert = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    proj_out = _w8a8_grouped_linear(self, selected_hidden_states_g, "gate_up_proj", offsets)
    proj_out = self._apply_gate(proj_out)
    proj_out = _w8a8_grouped_linear(self, proj_out, "down_proj", offsets)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted_out = weighted_out[inv_perm]
    return weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


class Int8Experts(torch.nn.Module):
    """Expert GEMMs over tokens sorted by expert, the experts int8 per (expert, output channel) as
    compressed-tensors' channel scheme stores them and dequantized by its real `dequantize`, the
    GEMM transformers' (integrations/moe.py _grouped_mm: F.grouped_mm in bf16, its fallback op in
    fp16). layout "nk": stored (E, N, K), passed transposed (transformers' experts); "kn": stored
    (E, K, N) (transformers' is_transposed experts, gpt-oss). activation: None (weight-only) or a
    per-token quantization (quant_modules) whose int8 values and scale feed the GEMM dequantized."""

    def __init__(self, dtype, layout="nk", experts=3, k=32, n=16, zero=False, activation=None, group=None):
        super().__init__()
        from compressed_tensors.quantization import QuantizationArgs

        torch.manual_seed(0)
        weight = torch.randn(experts, n, k) * 0.2
        strategy = dict(strategy="group", group_size=group) if group else dict(strategy="channel")
        self.args = QuantizationArgs(num_bits=8, type="int", symmetric=not zero, **strategy)
        self.input_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        if group:
            grouped = weight.reshape(experts, n, k // group, group)
            scale = grouped.abs().amax(-1) / 127  # (E, N, K / g)
            w_int8 = torch.round(grouped / scale.unsqueeze(-1)).to(torch.int8).reshape(experts, n, k)
            zero_point = None
        else:
            w_int8, scale = _per_channel_int8(weight)  # (E, N, K), (E, N, 1)
            zero_point = torch.randint(-3, 4, scale.shape, dtype=torch.int8) if zero else None
        self.layout, self.activation = layout, activation
        if layout == "kn":
            w_int8, scale = w_int8.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()
            zero_point = None if zero_point is None else zero_point.transpose(-2, -1).contiguous()
        self.register_buffer("w_int8", w_int8)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("zero_point", zero_point)

    def weight(self):
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        return dequantize(self.w_int8, self.scale, self.zero_point, args=self.args)

    def activation_dequantized(self, x):
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        x_q, x_scale = self.activation(x)
        return dequantize(x_q, x_scale, args=self.input_args).to(x.dtype)

    def forward(self, x, offs):
        from transformers.integrations.moe import _grouped_mm

        if self.activation is not None:
            x = self.activation_dequantized(x)
        w = self.weight()
        return _grouped_mm(x, w.transpose(-2, -1) if self.layout == "nk" else w, offs)



def quantize_experts(model: nn.Module, scheme: str) -> int:
    """Every transformers experts module of `model` with int8 experts ("w8a16" or "w8a8", above);
    returns the number of expert GEMMs quantized (two per module)."""
    from compressed_tensors.quantization import QuantizationArgs
    from transformers.integrations.moe import ExpertsInterface

    if scheme == "w8a8":
        ExpertsInterface.register("w8a8_grouped_mm", w8a8_grouped_mm_experts_forward)
    quantized = 0
    for module in list(model.modules()):
        weights = [getattr(module, name, None) for name in EXPERT_PROJECTIONS]
        if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
            continue
        for name, weight in zip(EXPERT_PROJECTIONS, weights):
            w_int8, w_scale = _per_channel_int8(weight.detach())  # (E, out, in), (E, out, 1)
            del module._parameters[name]
            module.register_buffer(f"{name}_q", w_int8)
            module.register_buffer(f"{name}_scale", w_scale.to(weight.dtype))
            quantized += 1
        module.weight_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        module.input_args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        properties = {name: _dequantized_expert_weight(name) for name in EXPERT_PROJECTIONS}
        module.__class__ = type(f"Int8{type(module).__name__}", (type(module),), properties)
        if scheme == "w8a8":
            module.config._experts_implementation = "w8a8_grouped_mm"
    return quantized


# ---- look-alikes: close to per-token int8 quantization, but not what npu_dynamic_quant does ----
def per_tensor_quant(x):
    scale = torch.clamp(x.abs().amax().float() / 127, min=1e-5)
    return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8), scale.reshape(1, 1)


def over_127_5_quant(x):
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True).float() / 127.5, min=1e-5)
    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8), scale


def half_away_from_zero_quant(x):
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True).float() / 127, min=1e-5)
    scaled = x.float() / scale
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return torch.clamp(rounded, -127, 127).to(torch.int8), scale
