"""dynamic_quant pass: per-token symmetric int8 quantization -> npu_dynamic_quant.

Numerics: the op computes rint(x * fp32(127 / amax)); the code x / fp32(amax / 127) or
x * fp32(1 / scale): the quotients are one or two fp32 roundings apart, so a q differs by one
only where the exact quotient is within a few fp32 ulps of a .5 (asserted: nowhere else), and
the scale by at most one fp32 ulp.
"""
import pytest
import torch

import npu_fx_fusion as nff
import quant_modules as qm
from helpers import compile_and_run, near_miss_reasons
from npu_fx_fusion.canonical import canonicalize


class Quantize(torch.nn.Module):
    def __init__(self, quant):
        super().__init__()
        self.quant = quant

    def forward(self, x):
        return self.quant(x)


def sites_of(report, pass_name):
    return [site for graph in report.graphs for result in graph.passes if result.pass_name == pass_name
            for site in result.sites]


def _x(dtype, shape=(2, 5, 64), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_quantized_as_the_op(q, scale, q_ref, scale_ref, x):
    """q equal to the code's but where the exact quotient sits on a .5 within fp32 rounding;
    the scale within one fp32 ulp."""
    assert q.dtype == q_ref.dtype == torch.int8 and q.shape == q_ref.shape
    exact = x.double() * (127 / x.double().abs().amax(-1, keepdim=True))
    near_tie = (exact - exact.floor() - 0.5).abs() < 1e-4
    differs = q != q_ref
    assert (q.int() - q_ref.int()).abs().max() <= 1 and not (differs & ~near_tie).any()
    torch.testing.assert_close(scale.float(), scale_ref.float(), rtol=2**-22, atol=0)


SPELLINGS = {
    "torchao_style": qm.per_token_absmax_quant,  # amax / 127 floored at eps, x / scale
    "vllm_reference": lambda x: qm.vllm_ref_dynamic_per_token_quant(x.reshape(-1, x.shape[-1])),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_per_token_quantization_fuses(spelling, dtype, dynamic):
    x = _x(dtype)
    (q, scale), (q_ref, scale_ref), report = compile_and_run(Quantize(SPELLINGS[spelling]), x, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1}
    assert_quantized_as_the_op(q, scale, q_ref, scale_ref, x.reshape(q.shape))
    assert not near_miss_reasons(report, "dynamic_quant")


def test_the_kernels_own_order_and_the_floored_scale_note():
    def qmax_over_amax(x):  # vLLM's CUDA kernel / the NPU's: x * (127 / amax)
        amax = x.abs().amax(dim=-1, keepdim=True).float()
        return torch.clamp(torch.round(x.float() * (127.0 / amax)), -128, 127).to(torch.int8), amax / 127

    x = _x(torch.bfloat16)
    (q, scale), (q_ref, scale_ref), report = compile_and_run(Quantize(qmax_over_amax), x)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1}
    assert_quantized_as_the_op(q, scale, q_ref, scale_ref, x)
    # the torchao spelling floors the scale at eps: the site says where that differs
    _, _, report = compile_and_run(Quantize(qm.per_token_absmax_quant), x)
    [site] = sites_of(report, "dynamic_quant")
    assert "floors the scale at eps=1e-05" in site.note


def in_input_dtype_quant(x):
    # torchao's quantize_activation_per_token_absmax for bf16: scale and quotient in bf16
    scale = torch.clamp(x.abs().amax(dim=-1, keepdim=True) / 127, min=1e-5)
    return torch.clamp(torch.round(x * (1.0 / scale)), -127, 127).to(torch.int8), scale


def test_quantizing_in_bf16_step_by_step_fuses_with_a_note_or_not_at_all():
    x = _x(torch.bfloat16)
    (q, scale), (q_ref, scale_ref), report = compile_and_run(Quantize(in_input_dtype_quant), x)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1}
    # the bf16 quotient rounds first: q is one off where that rounding crosses a .5 (the op is exact)
    assert (q.int() - q_ref.int()).abs().max() <= 1
    exact = torch.round(x.double() * (127 / x.double().abs().amax(-1, keepdim=True)))
    assert (q.double() == exact).float().mean() > (q_ref.double() == exact).float().mean()
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)  # amax / 127 rounded to bf16 either way
    _, _, report = compile_and_run(Quantize(in_input_dtype_quant), x,
                                   config=nff.FusionConfig(keep_intermediate_rounding=True))
    assert not report.fused_ops
    assert any("step by step" in r for r in near_miss_reasons(report, "dynamic_quant"))


@pytest.mark.parametrize("quant, reason", [
    (qm.per_tensor_quant, "max over the whole tensor (per-tensor)"),
    (qm.over_127_5_quant, "max|x| / 127.5: npu_dynamic_quant divides by 127"),
    (qm.half_away_from_zero_quant, "rounds half away from zero"),
], ids=["per_tensor", "amax_over_127.5", "round_half_away_from_zero"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_look_alikes_are_near_misses_naming_the_difference(quant, reason, dynamic):
    _, _, report = compile_and_run(Quantize(quant), _x(torch.bfloat16), dynamic=dynamic)
    assert "npu.npu_dynamic_quant" not in report.fused_ops
    assert any(reason in r for r in near_miss_reasons(report, "dynamic_quant")), near_miss_reasons(report, "dynamic_quant")


def test_a_clamp_that_binds_is_not_the_ops_math():
    def clamped(x):
        scale = x.abs().amax(dim=-1, keepdim=True).float() / 127
        return torch.clamp(torch.round(x.float() / scale), -100, 100).to(torch.int8), scale

    _, _, report = compile_and_run(Quantize(clamped), _x(torch.bfloat16))
    assert not report.fused_ops
    assert any("clamps to [-100, 100]" in r for r in near_miss_reasons(report, "dynamic_quant"))


def test_an_fp32_activation_is_a_near_miss():
    _, _, report = compile_and_run(Quantize(qm.per_token_absmax_quant), _x(torch.float32))
    assert not report.fused_ops
    assert near_miss_reasons(report, "dynamic_quant") == ["npu.npu_dynamic_quant does not support float32"]


def test_310p_needs_the_last_dim_a_multiple_of_32():
    config = nff.FusionConfig(soc="Ascend310P")
    _, _, report = compile_and_run(Quantize(qm.per_token_absmax_quant), _x(torch.float16, (2, 5, 48)), config=config)
    assert any("multiple of 32" in r for r in near_miss_reasons(report, "dynamic_quant"))
    _, _, report = compile_and_run(Quantize(qm.per_token_absmax_quant), _x(torch.bfloat16), config=config)
    assert near_miss_reasons(report, "dynamic_quant") == ["npu.npu_dynamic_quant does not support bfloat16 on Ascend310P"]


# ---- canonical.py: a slice of a whole dim is its input ------------------------------------------
def _canonical(fn, *inputs):
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="symbolic")(*inputs)
    canonicalize(gm.graph)
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_whole_slice_goes_and_a_partial_one_stays():
    # dynamo records `t[:, None]` of a symbolic dim as slice(t, 0, 0, 2**63 - 1), then the unsqueeze
    whole = _canonical(lambda x: torch.ops.aten.slice.Tensor(x.exp(), 0, 0, 2**63 - 1) * 2, torch.ones(4, 3))
    partial = _canonical(lambda x: torch.ops.aten.slice.Tensor(x.exp(), 0, 1, 2**63 - 1) * 2, torch.ones(4, 3))
    assert torch.ops.aten.slice.Tensor not in whole and torch.ops.aten.slice.Tensor in partial
