"""weight_quant_matmul pass: a linear over an int8 / int4 weight dequantized in the graph ->
npu_weight_quant_batchmatmul.

Tolerances (docs/passes/weight_quant_matmul.md): the op dequantizes (w + offset) * scale in
fp32 for a bf16 x (in fp16 for fp16) and rounds the weight to x's dtype once; code whose
dequantization rounds once too (compressed-tensors: w * s; GPTQ: s * (w - z) of integers;
torchao int4: (w - z) * s of integers) gives the same weight, so the two differ only in the
matmul's accumulation order: one ulp. Code that rounds more (HQQ's bf16 w - z with a float
zero; torchao int8 weight-only's scale applied to the rounded product) moves each weight or
product by a relative 2^-9 at most: 2^-7 * sum_k |x| |w_dq| plus an ulp.
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


def _within_rounding_of_weights(out, ref, x, w_dq):
    bound = (x.double().abs() @ w_dq.double().abs().t()) * 2**-7 + ulp(ref).double()
    assert ((out.double() - ref.double()).abs() <= bound).all()


MODULES = {
    "compressed_tensors_int8": qm.CompressedTensorsW8A16Linear,
    "gptq_int4_group32": qm.GptqW4Linear,
    "hqq_int4_group32": qm.HqqW4Linear,
}


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_dequantized_weights_fuse(name, dtype, dynamic):
    if name == "compressed_tensors_int8":
        pytest.importorskip("compressed_tensors")
    module = MODULES[name].from_float(_linear(dtype))
    x = _x(dtype)
    out, ref, report = compile_and_run(module, x, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_weight_quant_batchmatmul": 1}
    ops = report.graphs[0].ops_after
    assert ops.get("aten.matmul.default", 0) == ops.get("aten.mul.Tensor", 0) == 0
    if name == "hqq_int4_group32" and dtype == torch.bfloat16:  # bf16 w - zero rounds in the code
        _within_rounding_of_weights(out, ref, x, module.dequantize())
    else:
        assert_within_ulps(out, ref, 1)


def _torchao(dtype, config):
    ao = pytest.importorskip("torchao.quantization")
    granularity = pytest.importorskip("torchao.quantization.granularity")
    module = torch.nn.Sequential(_linear(dtype))
    ao.quantize_(module, config(ao, granularity))
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torchao_weight_only_int8_and_int4_fuse(dtype):
    int8 = _torchao(dtype, lambda ao, g: ao.Int8WeightOnlyConfig())
    x = _x(dtype)
    out, ref, report = compile_and_run(int8, x)
    assert report.fused_ops == {"npu.npu_weight_quant_batchmatmul": 1}
    w = int8[0].weight
    _within_rounding_of_weights(out, ref, x, w.qdata.double() * w.scale.double().reshape(-1, 1))
    int4 = _torchao(dtype, lambda ao, g: ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=g.PerGroup(32)))
    out, ref, report = compile_and_run(int4, x)
    assert report.fused_ops == {"npu.npu_weight_quant_batchmatmul": 1}
    assert_within_ulps(out, ref, 1)


class _UnmaskedUint8(torch.nn.Module):
    """A uint8 weight read as is: its values go up to 255, which int8 does not hold."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.register_buffer("w", torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=gen))
        self.register_buffer("scale", torch.rand(32, 1, generator=gen).to(torch.bfloat16) / 100)

    def forward(self, x):
        return x @ (self.w.to(torch.bfloat16) * self.scale).t()


class _Group16(torch.nn.Module):
    """torchao's int4 layout with groups of 16: the op's groups are multiples of 32."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(6)
        self.register_buffer("w", torch.randint(-8, 8, (32, 64), dtype=torch.int8, generator=gen))
        self.register_buffer("zero", torch.randint(-2, 2, (32, 4), dtype=torch.int8, generator=gen))
        self.register_buffer("scale", torch.rand(32, 4, generator=gen).to(torch.bfloat16) / 10)

    def forward(self, x):
        grouped = self.w.reshape(32, 4, -1).to(x.dtype) - self.zero.reshape(32, 4, 1).to(x.dtype)
        return torch.mm(x.reshape(-1, 64), (grouped * self.scale.reshape(32, 4, 1)).reshape(32, -1).t())


@pytest.mark.parametrize("module, reason", [
    (_UnmaskedUint8, "the weight is uint8 with values up to 255"),
    (_Group16, "groups of 16 along K=64"),
], ids=["uint8_values_up_to_255", "groups_of_16"])
def test_weights_the_op_cannot_take_are_near_misses(module, reason):
    _, _, report = compile_and_run(module(), _x(torch.bfloat16))
    assert not report.fused_ops
    assert any(reason in r for r in near_miss_reasons(report, "weight_quant_matmul")), \
        near_miss_reasons(report, "weight_quant_matmul")


def test_an_fp32_linear_is_a_near_miss():
    pytest.importorskip("compressed_tensors")
    module = qm.CompressedTensorsW8A16Linear.from_float(_linear(torch.float32))
    _, _, report = compile_and_run(module, _x(torch.float32))
    assert not report.fused_ops
    assert near_miss_reasons(report, "weight_quant_matmul") == [
        "npu.npu_weight_quant_batchmatmul does not support float32"]
