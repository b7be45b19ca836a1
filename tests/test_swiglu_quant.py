"""swiglu_quant: a SwiGLU quantized per token -> npu_swiglu_quant (and the reciprocal of its scale).

Tolerance (docs/passes/swiglu_quant.md): the fused kernel quantizes the fp32 SwiGLU; the code
quantizes it rounded to x's dtype (eager rounds silu(gate) and then the product: two roundings,
npu_swiglu one). An int8 value can differ by one where that rounding crosses a .5; the scale is
the row max / 127 of the rounded or the unrounded values: a relative 2^-7 (bf16) / 2^-10 (fp16)
at most for two roundings, plus the fp32 ulps of 1 / (127 / max) against max / 127.
"""
import pytest
import torch

import npu_fx_fusion as nff
import quant_modules as qm
from helpers import compile_and_run, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered

ensure_registered()  # the NPU code below calls torch.ops.npu eagerly too

SWIGLU_QUANT = {"swiglu", "dynamic_quant", "swiglu_quant"}


class SwigluThenQuant(torch.nn.Module):
    """A W8A8 MLP's activation: silu(gate) * up of a fused gate_up projection, quantized per token
    as vLLM's reference does (amax / 127, round, clamp)."""

    def __init__(self, also_return_activation=False):
        super().__init__()
        self.also_return_activation = also_return_activation

    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        q, scale = qm.vllm_ref_dynamic_per_token_quant(h.reshape(-1, h.shape[-1]))
        return (q, scale, h) if self.also_return_activation else (q, scale)


def _x(dtype, rows=12, width=64):
    return (torch.randn(rows, width, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_swiglu_quantized_per_token_fuses(dtype, dynamic):
    x = _x(dtype)
    if dynamic:  # the hidden size is a weight's, static in a model (a symbolic one: swiglu needs it even)
        torch._dynamo.mark_static(x, 1)
    (q, scale), (q_ref, scale_ref), report = compile_and_run(SwigluThenQuant(), x, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_swiglu_quant": 1}
    assert report.counts["swiglu_quant"] == 1
    (site,) = [s for s in report.sites if s.pass_name == "swiglu_quant"]
    assert "quantizes the fp32 SwiGLU where the code quantizes it rounded to" in site.note
    assert (q.int() - q_ref.int()).abs().max() <= 1
    relative = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype] + 2.0**-22
    assert ((scale - scale_ref).abs() <= scale_ref * relative).all()


def test_the_fused_quantization_is_that_of_the_exact_swiglu():
    # the stand-in's q against the float64 SwiGLU quantized by its own scale: the same integers but
    # where the fp32 SwiGLU sits within fp32 rounding of a .5
    x = _x(torch.bfloat16)
    q, multiplier = torch.ops.npu.npu_swiglu_quant(x, smooth_scales=torch.ones(1, 32), activate_left=True,
                                                   quant_mode=1, dst_type=torch.int8)
    a, b = x.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(a) * b
    assert torch.allclose(multiplier.double(), 127 / exact.abs().amax(-1), rtol=2**-20)
    assert (q.double() - torch.round(exact * multiplier.double().unsqueeze(-1))).abs().max() <= 1


class NpuOpsSwigluThenQuant(torch.nn.Module):
    """The same two steps as NPU code writes them (vllm-ascend's W8A8 dynamic MoE: npu_swiglu, then
    npu_dynamic_quant of its output)."""

    def forward(self, gate_up):
        return torch.ops.npu.npu_dynamic_quant(torch.ops.npu.npu_swiglu(gate_up))


def test_npu_code_that_calls_the_two_ops_fuses():
    (q, scale), (q_ref, scale_ref), report = compile_and_run(NpuOpsSwigluThenQuant(), _x(torch.bfloat16))
    assert report.fused_ops == {"npu.npu_swiglu_quant": 1}
    assert (q.int() - q_ref.int()).abs().max() <= 1
    assert ((scale - scale_ref).abs() <= scale_ref * (2.0**-8 + 2.0**-22)).all()  # npu_swiglu rounds once


def test_keep_intermediate_rounding_refuses_it():
    config = nff.FusionConfig(enable=SWIGLU_QUANT, keep_intermediate_rounding=True)
    _, _, report = compile_and_run(NpuOpsSwigluThenQuant(), _x(torch.bfloat16), config=config)
    assert report.counts["swiglu_quant"] == 0
    assert near_miss_reasons(report, "swiglu_quant") == [
        "quantizes the SwiGLU before its rounding to bfloat16 (FusionConfig.keep_intermediate_rounding keeps the "
        "code's rounding)"]


def test_an_activation_used_elsewhere_stays_unfused():
    _, _, report = compile_and_run(SwigluThenQuant(also_return_activation=True), _x(torch.bfloat16),
                                   config=nff.FusionConfig(enable=SWIGLU_QUANT))
    assert report.counts["swiglu_quant"] == 0
    (reason,) = near_miss_reasons(report, "swiglu_quant")
    assert reason.startswith("the SwiGLU's output is also used by") and reason.endswith(
        "npu_swiglu_quant writes only its quantization")


def test_310p_has_no_swiglu_quant():
    config = nff.FusionConfig(enable=SWIGLU_QUANT, soc="Ascend310P")
    _, _, report = compile_and_run(NpuOpsSwigluThenQuant(), _x(torch.float16), config=config)
    assert report.counts["swiglu_quant"] == 0
    assert near_miss_reasons(report, "swiglu_quant") == ["npu.npu_swiglu_quant is not available on Ascend310P"]
