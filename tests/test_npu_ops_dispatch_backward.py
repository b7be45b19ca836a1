"""The backward ops of the aten ops torch_npu differentiates itself (npu_ops/dispatch_backward.py).

Each is the gradient of its aten op: compared in float64 with torch's own autograd of that
op, and with the arguments mixed up (the self / target gradients, log_target, the repeated
dim), which must give something else.
"""
import pytest
import torch
import torch.nn.functional as F

from npu_fx_fusion.npu_ops import ensure_registered

ensure_registered()
npu = torch.ops.npu
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _f64(*shape, seed=0):
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
def test_repeat_interleave_backward_int_is_the_gradient(dim):
    x = _f64(3, 4).requires_grad_()
    out = x.repeat_interleave(3, dim=dim)
    grad = _f64(*out.shape, seed=1)
    (expected,) = torch.autograd.grad(out, x, grad)
    actual = npu.repeat_interleave_backward_int(grad, x.detach(), 3, dim)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)
    if dim is not None:  # summing the other dim's copies is something else
        other = 1 - (dim % 2)
        shape = list(x.shape)
        shape[other] *= 3
        wrong = npu.repeat_interleave_backward_int(_f64(*shape, seed=1), x.detach(), 3, other)
        assert not torch.allclose(wrong, expected)


@pytest.mark.parametrize("repeats", [[1, 0, 3], [2]], ids=["per element", "one count"])
def test_repeat_interleave_backward_tensor_is_the_gradient(repeats):
    x = _f64(3, 4).requires_grad_()
    counts = torch.tensor(repeats)
    out = x.repeat_interleave(counts, dim=0)
    grad = _f64(*out.shape, seed=1)
    (expected,) = torch.autograd.grad(out, x, grad)
    actual = npu.repeat_interleave_backward_tensor(grad, x.detach(), counts, 0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=REDUCTIONS.get)
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_backwards_are_the_gradients(reduction, log_target):
    x = _f64(3, 5).log_softmax(-1).requires_grad_()
    target = _f64(3, 5, seed=2).softmax(-1)
    if log_target:
        target = target.log()
    target.requires_grad_()
    out = F.kl_div(x, target, reduction=REDUCTIONS[reduction], log_target=log_target)
    grad = _f64(*out.shape, seed=3)
    expected_self, expected_target = torch.autograd.grad(out, (x, target), grad)
    args = (grad, x.detach(), target.detach(), reduction)
    torch.testing.assert_close(npu.kl_div_backward(*args, log_target=log_target), expected_self,
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(npu.kl_div_target_backward(*args, log_target=log_target), expected_target,
                               rtol=1e-12, atol=1e-12)
    # mix-ups: the other gradient, the other target convention
    assert not torch.allclose(npu.kl_div_target_backward(*args, log_target=log_target), expected_self)
    assert not torch.allclose(npu.kl_div_backward(*args, log_target=not log_target), expected_self)


def test_kl_div_target_backward_where_the_target_is_zero_is_torchs():
    # NaN there, as CPU's autograd of the composite gives (the NPU kernel's value is not documented)
    x = _f64(2, 4).log_softmax(-1)
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    out = F.kl_div(x, target, reduction="sum")
    (expected,) = torch.autograd.grad(out, target, torch.ones_like(out))
    actual = npu.kl_div_target_backward(torch.ones((), dtype=torch.float64), x, target.detach(), 2)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.isnan(actual[target == 0]).all()


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=REDUCTIONS.get)
def test_l1_loss_backward_is_the_gradient(reduction):
    x, target = _f64(3, 5).requires_grad_(), _f64(3, 5, seed=2).requires_grad_()
    out = F.l1_loss(x, target, reduction=REDUCTIONS[reduction])
    grad = _f64(*out.shape, seed=3)
    expected_self, expected_target = torch.autograd.grad(out, (x, target), grad)
    actual = npu.l1_loss_backward(grad, x.detach(), target.detach(), reduction)
    torch.testing.assert_close(actual, expected_self, rtol=0, atol=1e-12)
    torch.testing.assert_close(-actual, expected_target, rtol=0, atol=1e-12)  # the formula's target: * -1
    swapped = npu.l1_loss_backward(grad, target.detach(), x.detach(), reduction)
    assert not torch.allclose(swapped, expected_self)
