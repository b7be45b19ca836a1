"""The CPU stand-ins compute what the NPU kernels compute (op_semantics.md section 2)."""
import pytest
import torch

from helpers import assert_within_ulps
from npu_fx_fusion.npu_ops import ensure_registered

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def _ops():
    assert "npu::npu_rms_norm" in ensure_registered()


def _x(dtype, shape=(2, 3, 4, 32)):
    torch.manual_seed(0)
    return (torch.randn(shape) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_is_one_fp32_computation_rounded_once(dtype):
    x, gamma = _x(dtype), (torch.rand(32) + 0.5).to(dtype)
    y, rstd = torch.ops.npu.npu_rms_norm(x, gamma, 1e-5)
    x64 = x.double()
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 3, 4, 1)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-6, atol=0)
    # half: one rounding of the fp32 product, so within 1 ulp of the correctly rounded
    # result; fp32: the mean, rsqrt and two products each round once (4 ulp).
    exact = (x64 * rstd64 * gamma.double()).to(dtype)
    assert_within_ulps(y, exact, 4 if dtype == torch.float32 else 1)


def test_rms_norm_gamma_over_trailing_dims():
    x, gamma = _x(torch.float32), torch.rand(4, 32)
    y, rstd = torch.ops.npu.npu_rms_norm(x, gamma)
    assert rstd.shape == (2, 3, 1, 1)
    ref = x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * gamma
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_autograd_matches_the_formula(dtype):
    x = _x(torch.float64).float().requires_grad_()
    gamma = (torch.rand(32) + 0.5).requires_grad_()
    grad = torch.randn(2, 3, 4, 32)
    y, _ = torch.ops.npu.npu_rms_norm(x, gamma, 1e-6)
    dx, dgamma = torch.autograd.grad(y, (x, gamma), grad)
    x2, g2 = x.detach().double().requires_grad_(), gamma.detach().double().requires_grad_()
    ref = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * g2
    dx_ref, dgamma_ref = torch.autograd.grad(ref, (x2, g2), grad.double())
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dgamma.double(), dgamma_ref, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_bf16_rounding_points():
    # bf16: sum in fp32, rstd from the unrounded sum, x*rstd rounded before the gamma multiply
    x1, x2, gamma = _x(torch.bfloat16), _x(torch.bfloat16).flip(0), (torch.rand(32) + 0.5).bfloat16()
    y, rstd, x_out = torch.ops.npu.npu_add_rms_norm(x1, x2, gamma, 1e-6)
    s32 = x1.float() + x2.float()
    assert torch.equal(x_out, s32.bfloat16())
    expected_rstd = torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rstd, expected_rstd, rtol=0, atol=0)
    expected_y = ((s32 * expected_rstd).bfloat16().float() * gamma.float()).bfloat16()
    assert torch.equal(y, expected_y)


def test_add_rms_norm_fp16_adds_in_fp16():
    x1, x2, gamma = _x(torch.float16), _x(torch.float16).flip(0), torch.rand(32).half()
    _, rstd, x_out = torch.ops.npu.npu_add_rms_norm(x1, x2, gamma)
    assert torch.equal(x_out, x1 + x2)
    torch.testing.assert_close(rstd, torch.rsqrt((x1 + x2).float().pow(2).mean(-1, keepdim=True) + 1e-6))


def test_add_rms_norm_has_no_backward_like_torch_npu():
    x1 = _x(torch.float32).requires_grad_()
    y, _, _ = torch.ops.npu.npu_add_rms_norm(x1, x1.detach(), torch.rand(32))
    with pytest.raises(RuntimeError, match="no backward in torch_npu"):
        y.sum().backward()
