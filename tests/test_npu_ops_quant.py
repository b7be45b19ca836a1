"""The quantization stand-ins compute what the A2/A3 kernels compute (npu_ops/quant.py, with
the sources of each fact). opcheck runs over their samples in tests/test_op_specs.py; here each
kernel is checked against the formula its kernel source gives, computed independently."""
import pytest
import torch

from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.quant import DTYPE_ENUM, pack_int4, unpack_int4

ensure_registered()
npu = torch.ops.npu


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dynamic_quant_rounds_x_times_127_over_amax_half_to_even(dtype):
    x = _randn(4, 7, 64, dtype=dtype)
    q, scale = npu.npu_dynamic_quant(x)
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    # the kernel: one fp32 division 127 / amax, x times it, CAST_RINT (ties to even), no clamp
    expected = torch.round(x32 * (torch.tensor(127.0) / amax))
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(q.float(), expected)
    assert q.abs().max() == 127  # the row max lands on 127 exactly
    torch.testing.assert_close(scale, amax.squeeze(-1) / 127, rtol=2**-23, atol=0)


def test_dynamic_quant_ties_go_to_even():
    # rows whose max is 127: the multiplier is 1 and x * 1 = x, so x's halves are ties
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, 127.0]], dtype=torch.bfloat16)
    q, _ = npu.npu_dynamic_quant(x)
    assert q.tolist() == [[0, 2, 2, 0, -2, 127]]


def test_dynamic_quant_smooth_scales_and_groups():
    x = _randn(6, 16, dtype=torch.bfloat16, seed=1)
    smooth = _randn(2, 16, dtype=torch.bfloat16, seed=2)
    q, scale = npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=torch.tensor([2, 6], dtype=torch.int32))
    rows = torch.cat([x[:2].float() * smooth[0].float(), x[2:].float() * smooth[1].float()])
    amax = rows.abs().amax(-1, keepdim=True)
    assert torch.equal(q.float(), torch.round(rows * (127.0 / amax)))
    torch.testing.assert_close(scale, amax.squeeze(-1) / 127, rtol=2**-23, atol=0)


def test_dynamic_quant_refuses_what_it_does_not_compute():
    x = _randn(2, 16, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dst_type"):
        npu.npu_dynamic_quant(x, dst_type=16)
    with pytest.raises(NotImplementedError, match="pertensor"):
        npu.npu_dynamic_quant(x, quant_mode="pertensor")


def test_int4_packing_is_the_ops_layout():
    # aclnn_convert_weight_to_int4_pack.cpp: element 2i in the low nibble of byte i, 2i+1 in its
    # high nibble, two's complement; the bytes little-endian in each int32
    values = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8]], dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.view(torch.uint8).tolist() == [[(-2 & 0xF) << 4 | 1, (-4 & 0xF) << 4 | 3,
                                                  (-6 & 0xF) << 4 | 5, (-8 & 0xF) << 4 | 7]]
    every = torch.randint(-8, 8, (5, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(unpack_int4(pack_int4(every)), every)


def test_quant_matmul_is_the_exact_int_product_scaled_once():
    x1 = torch.randint(-128, 128, (5, 48), dtype=torch.int8)
    w = torch.randint(-128, 128, (24, 48), dtype=torch.int8)
    scale, token = _randn(24).abs() / 100, _randn(5, seed=1).abs() / 100
    bias = _randn(24, dtype=torch.bfloat16, seed=2)
    y = npu.npu_quant_matmul(x1, w.t(), scale, pertoken_scale=token, bias=bias, output_dtype=DTYPE_ENUM[torch.bfloat16])
    acc = x1.double() @ w.double().t()  # exact
    expected = ((acc.float() * scale) * token[:, None] + bias.float()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    raw = npu.npu_quant_matmul(x1, w.t(), torch.ones(24), output_dtype=DTYPE_ENUM[torch.int32])
    assert raw.dtype == torch.int32 and torch.equal(raw, acc.to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_quant_batchmatmul_dequantizes_w_plus_offset_times_scale(dtype):
    x = _randn(3, 64, dtype=dtype)
    w = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(4))  # (N, K)
    scale = (_randn(16, 2, dtype=dtype, seed=5).abs() / 8)  # (N, K/32)
    offset = _randn(16, 2, dtype=dtype, seed=6).round()
    y = npu.npu_weight_quant_batchmatmul(x, w.t(), scale.t(), offset.t(), antiquant_group_size=32)
    # the kernel: (w + offset) * scale in fp32 for bf16 x (fp16 for fp16), rounded to x's dtype
    compute = torch.float32 if dtype == torch.bfloat16 else torch.float16
    dequantized = ((w.to(compute) + offset.repeat_interleave(32, 1).to(compute))
                   * scale.repeat_interleave(32, 1).to(compute)).to(dtype)
    expected = (x.float() @ dequantized.float().t()).to(dtype)
    assert torch.equal(y, expected)
    # the same weight packed as int4, along N (contiguous (K, N/8)) and along K (a transposed view)
    along_n = npu.npu_weight_quant_batchmatmul(x, pack_int4(w.t().contiguous()), scale.t(), offset.t(),
                                               antiquant_group_size=32)
    along_k = npu.npu_weight_quant_batchmatmul(x, pack_int4(w).t(), scale.t(), offset.t(), antiquant_group_size=32)
    assert torch.equal(along_n, y) and torch.equal(along_k, y)


def test_add_rms_norm_dynamic_quant_quantizes_the_fp32_norm():
    x1, x2 = _randn(2, 3, 32, dtype=torch.bfloat16), _randn(2, 3, 32, dtype=torch.bfloat16, seed=1)
    gamma = _randn(32, dtype=torch.bfloat16, seed=2)
    y1, y2, x_out, scale1, scale2 = npu.npu_add_rms_norm_dynamic_quant(x1, x2, gamma, epsilon=1e-6)
    x = x1.float() + x2.float()
    norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.float()  # never rounded to bf16
    multiplier = 127.0 / norm.abs().amax(-1, keepdim=True)
    assert torch.equal(y1.float(), torch.round(norm * multiplier))
    torch.testing.assert_close(scale1, (1.0 / multiplier).squeeze(-1), rtol=0, atol=0)
    assert torch.equal(x_out, x.to(torch.bfloat16))
    assert y2.shape == (0,) and scale2.shape == (0,)  # no second output without both smooth scales (Meta)
