"""add_rms_norm_quant pass: residual add + RMSNorm + per-token quant -> npu_add_rms_norm_dynamic_quant.

Tolerances (docs/passes/add_rms_norm_quant.md): the fused kernel quantizes the fp32 norm, the
unfused pair the norm rounded to x's dtype; an int8 value moves by one where that rounding
crosses a .5 of q, and then the W8A8 linear's output by x_scale * |w_dq| of that column. The
bound used: x_scale[m] * sum_k |w_dq[n, k]| (every value of the row one off) plus an ulp, and
the fused int8 values are checked against the exact quantization of the fp32 norm directly.
"""
import pytest
import torch

import npu_fx_fusion as nff
import quant_modules as qm
from helpers import compile_and_run, near_miss_reasons, ulp


def _inputs(dtype, shape=(2, 5, 64)):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen).to(dtype), torch.randn(*shape, generator=gen).to(dtype)


def _bound(block, x, residual):
    h = (x.float() + residual.float())
    normed = block.norm_weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + block.eps))
    x_scale = normed.abs().amax(-1, keepdim=True) / 127
    w_dq = block.proj.w_int8_t.double().t() * block.proj.w_scale.double().reshape(-1, 1)
    return x_scale.double() * w_dq.abs().sum(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_norm_feeding_a_w8a8_linear_fuses_into_two_ops(dtype, dynamic):
    torch.manual_seed(0)
    block = qm.QuantizedDecoderBlock(64, 32, dtype=dtype)
    x, residual = _inputs(dtype)
    (out, h), (ref, h_ref), report = compile_and_run(block, x, residual, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_add_rms_norm_dynamic_quant": 1, "npu.npu_quant_matmul": 1}
    assert torch.equal(h, h_ref)  # the residual sum, rounded once either way
    diff = (out.double() - ref.double()).abs()
    assert (diff <= _bound(block, x, residual) + ulp(ref).double()).all()
    sites = [s for g in report.graphs for p in g.passes if p.pass_name == "add_rms_norm_quant" for s in p.sites]
    assert "quantizes the fp32 norm" in sites[0].note


class ThreeProjections(torch.nn.Module):
    """transformers' attention: q, k and v each quantize the same normed hidden state."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.block = qm.QuantizedDecoderBlock(64, 32, dtype=dtype)
        self.k = qm.TorchaoStyleW8A8Linear(torch.randn(16, 64, dtype=dtype))
        self.v = qm.TorchaoStyleW8A8Linear(torch.randn(16, 64, dtype=dtype))

    def forward(self, x, residual):
        h = x + residual
        hidden = h.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.block.eps)
        normed = self.block.norm_weight * hidden.to(h.dtype)
        return self.block.proj(normed), self.k(normed), self.v(normed), h


def test_one_norm_quantized_per_projection_is_one_fused_quantization():
    module = ThreeProjections(torch.bfloat16)
    outs, refs, report = compile_and_run(module, *_inputs(torch.bfloat16))
    # three quantizations of one value: merged into one call, which the norm then absorbs
    assert report.counts["dynamic_quant"] == 3
    assert report.fused_ops == {"npu.npu_add_rms_norm_dynamic_quant": 1, "npu.npu_quant_matmul": 3}


def test_fp32_norm_quantization_is_exact_and_the_rounding_can_be_kept():
    block = qm.QuantizedDecoderBlock(64, 32, dtype=torch.bfloat16)
    config = nff.FusionConfig(keep_intermediate_rounding=True)
    _, _, report = compile_and_run(block, *_inputs(torch.bfloat16), config=config)
    assert "npu.npu_add_rms_norm_dynamic_quant" not in report.fused_ops
    assert any("keep_intermediate_rounding" in r for r in near_miss_reasons(report, "add_rms_norm_quant"))


class NormUsedTwice(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.block = qm.QuantizedDecoderBlock(64, 32, dtype=dtype)

    def forward(self, x, residual):
        h = x + residual
        hidden = h.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.block.eps)
        normed = self.block.norm_weight * hidden.to(h.dtype)
        return self.block.proj(normed), normed.sum(-1)  # the normed activation itself is read too


class NoResidual(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.block = qm.QuantizedDecoderBlock(64, 32, dtype=dtype)

    def forward(self, x, residual):
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.block.eps)
        return self.block.proj(self.block.norm_weight * hidden.to(x.dtype))


@pytest.mark.parametrize("module, reason", [
    (NormUsedTwice, "the norm's output is also used by"),
    (NoResidual, "no residual add before the norm"),
], ids=["norm_output_read_elsewhere", "no_residual_add"])
def test_norms_the_op_cannot_take_are_near_misses(module, reason):
    _, _, report = compile_and_run(module(torch.bfloat16), *_inputs(torch.bfloat16))
    assert "npu.npu_add_rms_norm_dynamic_quant" not in report.fused_ops
    assert report.fused_ops["npu.npu_dynamic_quant"] == 1 and report.fused_ops["npu.npu_quant_matmul"] == 1
    assert any(reason in r for r in near_miss_reasons(report, "add_rms_norm_quant")), \
        near_miss_reasons(report, "add_rms_norm_quant")


def test_verification_allows_the_one_step_the_fp32_norm_moves_a_value():
    # FusionConfig(verify=True) compares integer outputs within the op's verify_integer_steps (1)
    block = qm.QuantizedDecoderBlock(64, 32, dtype=torch.bfloat16)
    _, _, report = compile_and_run(block, *_inputs(torch.bfloat16), config=nff.FusionConfig(verify=True))
    assert report.fused_ops.get("npu.npu_add_rms_norm_dynamic_quant") == 1
    sites = [s for g in report.graphs for p in g.passes if p.pass_name == "add_rms_norm_quant" for s in p.sites]
    assert sites[0].verified.startswith("verified")
