"""quant_matmul pass: an int8 GEMM dequantized per token and per channel -> npu_quant_matmul.

Tolerances (docs/passes/quant_matmul.md): the op computes the exact int32 product and scales it
with one rounding. Code that also scales in fp32 and rounds once (the torchao-style modules)
differs only in the order of the two fp32 multiplies: within one ulp of the output. torchao's
Int8Tensor rounds to bf16 after the per-token scale and again after the per-channel one: two
ulps. Code that dequantizes both operands to bf16 before a matmul rounds each to bf16 (a
relative 2^-9 each): the difference is bounded by 2^-7 * sum_k |x_dq| |w_dq| plus an ulp.
"""
import pytest
import torch

import npu_fx_fusion as nff
import quant_modules as qm
from helpers import assert_within_ulps, compile_and_run, near_miss_reasons, ulp


def _x(dtype, shape=(2, 5, 64), seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _linear(dtype, out=32, k=64, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Linear(k, out, bias=False).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torchao_style_w8a8_linear_fuses_into_two_ops(dtype, dynamic):
    module = qm.TorchaoStyleW8A8Linear.from_float(_linear(dtype))
    out, ref, report = compile_and_run(module, _x(dtype), dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1, "npu.npu_quant_matmul": 1}
    ops = report.graphs[0].ops_after
    assert ops.get("aten._int_mm.default", 0) == 0 and ops.get("aten.round.default", 0) == 0
    assert_within_ulps(out, ref, 1)


def _dequantized_bound(module, x):
    """2^-7 * sum_k |x_dq| |w_dq| + one ulp: what rounding each dequantized operand to x's dtype
    can move the unfused result by."""
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = qm.vllm_ref_dynamic_per_token_quant(rows)
    x_dq = x_q.double() * x_scale.double()
    w_dq = module.weight_q.double() * module.weight_scale.double()
    return (x_dq.abs() @ w_dq.abs().t()).reshape(*x.shape[:-1], -1) * 2**-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_vllm_reference_quant_with_compressed_tensors_dequantize_fuses(dtype, dynamic):
    pytest.importorskip("compressed_tensors")
    module = qm.VllmRefW8A8Linear.from_float(_linear(dtype))
    x = _x(dtype)
    out, ref, report = compile_and_run(module, x, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_dynamic_quant": 1, "npu.npu_quant_matmul": 1}
    assert report.graphs[0].ops_after.get("aten.matmul.default", 0) == 0
    diff = (out.double() - ref.double()).abs()
    assert (diff <= _dequantized_bound(module, x) + ulp(ref).double()).all()


def _torchao_quantized(dtype, config):
    ao = pytest.importorskip("torchao.quantization")
    module = torch.nn.Sequential(_linear(dtype))
    ao.quantize_(module, config(ao))
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torchao_int8_tensor_linear_fuses_its_gemm_and_reports_its_quantization(dtype):
    # torchao 0.18's Int8DynamicActivationInt8WeightConfig: its activation scale is amax / 127.5 (the
    # [-128, 127] range's), not npu_dynamic_quant's; its int8 GEMM and scales are npu_quant_matmul's
    module = _torchao_quantized(dtype, lambda ao: ao.Int8DynamicActivationInt8WeightConfig())
    out, ref, report = compile_and_run(module, _x(dtype))
    assert report.fused_ops == {"npu.npu_quant_matmul": 1}
    assert any("127.5" in r for r in near_miss_reasons(report, "dynamic_quant"))
    assert report.graphs[0].ops_after.get("aten._int_mm.default", 0) == 0
    assert_within_ulps(out, ref, 2)


def u8s8_and_s8s8(q, w, x_scale, w_scale):
    # torchao's CPU kernel picks u8s8 or s8s8 by the machine's ISA: both spellings, one graph
    shifted = (q.to(torch.int32) + 128).to(torch.uint8)
    u8s8 = torch._int_mm(shifted, w) - w.sum(dim=0, keepdim=True, dtype=torch.int32) * 128
    a = (u8s8.to(torch.float32) * x_scale).to(torch.bfloat16) * w_scale
    b = (torch._int_mm(q, w).to(torch.float32) * x_scale).to(torch.bfloat16) * w_scale
    return a, b


def test_both_of_torchaos_cpu_gemm_spellings_fuse():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (10, 64), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=gen)
    x_scale, w_scale = torch.rand(10, 1, generator=gen) / 100, torch.rand(32, generator=gen).to(torch.bfloat16) / 100
    (a, b), (a_ref, b_ref), report = compile_and_run(_Fn(u8s8_and_s8s8), q, w, x_scale, w_scale)
    assert report.counts["quant_matmul"] == 2  # each spelling fused ...
    # ... into the same call on the same operands, one value: merged (cleanup.merge_repeated_pure_calls)
    assert report.fused_ops == {"npu.npu_quant_matmul": 1}
    assert_within_ulps(a, a_ref, 2)
    assert_within_ulps(b, b_ref, 2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same product


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_a_bare_int8_gemm_becomes_the_ops_int32_mode():
    # torch_npu has no _int_mm kernel: the op's int32 output is what runs it on an NPU
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (17, 64), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=gen)
    out, ref, report = compile_and_run(_Fn(torch._int_mm), q, w)
    assert report.fused_ops == {"npu.npu_quant_matmul": 1}
    assert torch.equal(out, ref)


def test_a_per_tensor_activation_scale_keeps_its_scaling():
    def per_tensor(q, w, x_scale, w_scale):  # one scale for the whole activation
        return (torch._int_mm(q, w).float() * x_scale * w_scale).to(torch.bfloat16)

    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-128, 128, (10, 64), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=gen)
    out, ref, report = compile_and_run(_Fn(per_tensor), q, w, torch.rand(1, 1, generator=gen),
                                       torch.rand(32, generator=gen))
    # the scaled forms refuse it (not one scale per token); the bare GEMM is the op's, the scaling stays
    assert report.fused_ops == {"npu.npu_quant_matmul": 1}
    assert [s.form for s in sites_of(report, "quant_matmul")] == ["int_mm"]
    assert report.graphs[0].ops_after.get("aten.mul.Tensor", 0) == 2
    assert torch.equal(out, ref)


def sites_of(report, pass_name):
    return [site for graph in report.graphs for result in graph.passes if result.pass_name == pass_name
            for site in result.sites]


def test_310p_takes_no_per_token_scale_and_has_no_int32_output():
    module = qm.TorchaoStyleW8A8Linear.from_float(_linear(torch.float16))
    _, _, report = compile_and_run(module, _x(torch.float16), config=nff.FusionConfig(soc="Ascend310P"))
    assert "npu.npu_quant_matmul" not in report.fused_ops
    assert near_miss_reasons(report, "quant_matmul") == ["npu_quant_matmul takes no per-token scale on Ascend310P"]
