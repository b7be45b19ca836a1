"""quant_grouped_matmul: MoE expert GEMMs over int8 experts -> npu_grouped_matmul with its
quantisation arguments.

Tolerances (docs/passes/quant_grouped_matmul.md):
* weight-only: the code rounds w * scale to x's dtype once, as the op does (an int8 times a bf16 /
  fp16 scale is exact in fp32): the same weights, both GEMMs accumulate in fp32 and round once;
  they differ only in the fp32 summation order: 1 ulp, as grouped_matmul's float GEMM.
* W8A8: the op scales the exact int32 product in fp32 and rounds once; the code rounds each
  dequantized operand to bf16 / fp16 (a relative 2^-9 / 2^-11 each) before its GEMM: the
  difference is bounded by 2^-7 * sum_k |x_dq| |w_dq| plus an ulp (quant_matmul's bound).
"""
import pytest
import torch

import npu_fx_fusion as nff
import quant_modules as qm
from helpers import assert_within_ulps, compile_and_run, near_miss_reasons, ulp

QUANT_GMM = {"dynamic_quant", "quant_grouped_matmul", "grouped_matmul"}


def _inputs(dtype, rows=24, k=32):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    return x, torch.tensor([8, 8, rows], dtype=torch.int32)  # the second expert gets no rows


def _w8a8_bound(module, x):
    """2^-7 * sum_k |x_dq| |w_dq| per output: what rounding each dequantized operand moves it by."""
    x_q, x_scale = module.activation(x)
    x_dq = x_q.double() * x_scale.double()
    w = module.w_int8.double() * module.scale.double()
    w_kn = w.transpose(-2, -1) if module.layout == "nk" else w
    bound = torch.zeros(x.shape[0], w_kn.shape[-1], dtype=torch.float64)
    for e, (start, end) in enumerate(((0, 8), (8, 8), (8, x.shape[0]))):
        bound[start:end] = x_dq[start:end].abs() @ w_kn[e].abs()
    return bound * 2**-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_weight_only_int8_experts_fuse(dtype, dynamic, layout):
    out, ref, report = compile_and_run(qm.Int8Experts(dtype, layout), *_inputs(dtype), dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_grouped_matmul": 1}
    (site,) = report.sites
    assert site.pass_name == "quant_grouped_matmul" and site.form.startswith(f"channel_dequantized_{layout}")
    ops = report.graphs[0].ops_after
    assert not ops.get("aten._grouped_mm.default", 0) and not ops.get("aten.mul.Tensor", 0)
    assert_within_ulps(out, ref, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_zero_point_becomes_the_ops_negated_offset(dtype):
    out, ref, report = compile_and_run(qm.Int8Experts(dtype, zero=True), *_inputs(dtype))
    assert [s.form for s in report.sites] == [
        "channel_zero_dequantized_nk_" + ("grouped_mm" if dtype == torch.bfloat16 else "grouped_mm_fallback")]
    assert_within_ulps(out, ref, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_w8a8_experts_fuse_with_their_per_token_quantization(dtype, dynamic, layout):
    module = qm.Int8Experts(dtype, layout, activation=qm.vllm_ref_dynamic_per_token_quant)
    x, offs = _inputs(dtype)
    out, ref, report = compile_and_run(module, x, offs, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1, "npu.npu_grouped_matmul": 1}
    assert report.counts["quant_grouped_matmul"] == 1 and report.counts["grouped_matmul"] == 0
    assert not report.graphs[0].ops_after.get("aten._grouped_mm.default", 0)
    diff = (out.double() - ref.double()).abs()
    assert (diff <= _w8a8_bound(module, x) + ulp(ref).double()).all()


def test_a_per_tensor_activation_scale_is_no_per_token_gemm():
    module = qm.Int8Experts(torch.bfloat16, activation=qm.per_tensor_quant)
    out, ref, report = compile_and_run(module, *_inputs(torch.bfloat16), config=nff.FusionConfig(enable=QUANT_GMM))
    # the W8A8 form is turned down; the bf16 activation the code dequantized times the int8 experts
    # is the weight-only GEMM, which fuses with its exact math (the per-tensor scaling stays)
    (site,) = report.sites
    assert site.form == "channel_dequantized_nk_grouped_mm"
    assert ("the larger form w8a8_dequantized_nk_grouped_mm was turned down (the activation scale (1, 1) is not one "
            "per token of the (24, 32) activation: npu_grouped_matmul takes a per-token scale)") in site.note
    assert report.fused_ops == {"npu.npu_grouped_matmul": 1}
    assert_within_ulps(out, ref, 1)


@pytest.mark.parametrize("quantize, reason", [
    (qm.over_127_5_quant, "127.5"),
    (qm.half_away_from_zero_quant, "rounds half away from zero"),
], ids=["amax/127.5", "round-half-away"])
def test_activation_look_alikes_stay_unfused_and_the_int8_gemm_still_fuses(quantize, reason):
    # the int8 values and their per-token scale come from code npu_dynamic_quant does not compute (a
    # near miss of dynamic_quant); the GEMM of those int8 values is the op's whatever made them
    module = qm.Int8Experts(torch.bfloat16, activation=quantize)
    x, offs = _inputs(torch.bfloat16)
    out, ref, report = compile_and_run(module, x, offs, config=nff.FusionConfig(enable=QUANT_GMM))
    (dynamic_quant_reason,) = near_miss_reasons(report, "dynamic_quant")
    assert reason in dynamic_quant_reason
    assert report.fused_ops == {"npu.npu_grouped_matmul": 1} and report.counts["quant_grouped_matmul"] == 1
    diff = (out.double() - ref.double()).abs()
    assert (diff <= _w8a8_bound(module, x) + ulp(ref).double()).all()


def test_per_group_int8_experts_stay_unfused():
    out, ref, report = compile_and_run(qm.Int8Experts(torch.bfloat16, group=8), *_inputs(torch.bfloat16),
                                       config=nff.FusionConfig(enable=QUANT_GMM))
    assert near_miss_reasons(report, "quant_grouped_matmul") == [
        "the int8 experts are dequantized per group of 8 along K: npu_grouped_matmul dequantizes int8 experts per "
        "output channel only (per group needs its int4 weight layout, a repack this pass does not do)"]
    assert report.counts["quant_grouped_matmul"] == 0  # (the float GEMM of the dequantized weight fuses)


def test_a_float_zero_point_is_a_near_miss():
    module = qm.Int8Experts(torch.bfloat16, zero=True)
    module.zero_point = module.zero_point.to(torch.float32) + 0.25  # rounds when cast to bf16 minus w
    _, _, report = compile_and_run(module, *_inputs(torch.bfloat16), config=nff.FusionConfig(enable=QUANT_GMM))
    assert near_miss_reasons(report, "quant_grouped_matmul") == [
        "a float32 zero point: the code rounds w - zero to bfloat16 before the scale, npu_grouped_matmul does not"]


def test_310p_takes_no_quantisation_arguments():
    config = nff.FusionConfig(enable=QUANT_GMM, soc="Ascend310P")
    _, _, report = compile_and_run(qm.Int8Experts(torch.float16), *_inputs(torch.float16), config=config)
    assert near_miss_reasons(report, "quant_grouped_matmul") == [
        "npu_grouped_matmul takes no quantisation arguments on Ascend310P"]


def test_weight_only_verification_measures_the_site():
    config = nff.FusionConfig(enable=QUANT_GMM, verify=True)
    _, _, report = compile_and_run(qm.Int8Experts(torch.bfloat16), *_inputs(torch.bfloat16), config=config)
    (site,) = report.sites
    assert site.verified.startswith("verified: max error"), site.verified


class ScalarScaledW8A8(torch.nn.Module):
    """W8A8 experts with one fp32 weight scale for all (a 0-d tensor): the bf16 product stays bf16
    and multiplies by the unrounded fp32 scale (a CPU scalar is read in the op's fp32 math)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, offs):
        q, x_scale = qm.vllm_ref_dynamic_per_token_quant(x)
        x_dq = (q.to(torch.float32) * x_scale).to(torch.bfloat16)
        w = self.experts.w_int8.to(torch.bfloat16) * torch.tensor(0.01)
        return torch._grouped_mm(x_dq, w.transpose(-2, -1), offs)


def test_an_fp32_weight_scale_for_a_bf16_w8a8_output_is_a_near_miss():
    module = ScalarScaledW8A8(qm.Int8Experts(torch.bfloat16))
    _, _, report = compile_and_run(module, *_inputs(torch.bfloat16), config=nff.FusionConfig(enable=QUANT_GMM))
    assert report.counts["quant_grouped_matmul"] == 0
    assert near_miss_reasons(report, "quant_grouped_matmul") == [
        "the weight scale is float32 for a bfloat16 output: npu_grouped_matmul's per-token mode takes a bfloat16 "
        "scale there, a rounding of the scale the code does not make"]
