"""The backward ops op-plugin's derivatives.yaml gives aten ops torch_npu differentiates
itself (NPU dispatch, npu_dispatch.py): repeat_interleave, kl_div, l1_loss.

On an NPU, `repeat_interleave.self_int` / `.self_Tensor`, `kl_div` and `l1_loss` reach the
aot graph undecomposed (torch_npu registers them at PrivateUse1 with its own autograd), so a
training graph's backward holds these npu ops where CPU's holds the decomposition's
gradient. Formulas (op-plugin op_plugin/config/derivatives.yaml):
    repeat_interleave.self_int:    self: repeat_interleave_backward_int(grad, self, repeats, dim)
    repeat_interleave.self_Tensor: self: repeat_interleave_backward_tensor(grad, self, repeats, dim)
    kl_div:  self: kl_div_backward(grad, self, target, reduction, log_target)
             target: kl_div_target_backward(grad, self, target, reduction, log_target)
    l1_loss: self: l1_loss_backward(grad, self, target, reduction)
             target: l1_loss_backward(grad, self, target, reduction) * -1
The kernels compute the gradient of the aten op they belong to (reduction: 0 none,
1 mean, 2 sum, torch's Reduction enum), in the input's dtype as the aclnn kernels do.
"""
from __future__ import annotations

import torch

from .spec import FLOAT_DTYPES, Sample, in_layout_of, op_spec, randn

_NONE, _MEAN, _SUM = 0, 1, 2


# Outputs: the wheel's Meta functions (repeat_interleave_backward_int, kl_div_backward,
# l1_loss_backward) give torch.empty_like(self), which keeps a transposed self's strides; the
# two ops without one (repeat_interleave_backward_tensor, kl_div_target_backward) are taken to
# allocate like their siblings (empty_like of the input they are the gradient of) [inferred].
# The kernels return their result in that layout (in_layout_of).
def _like_self(grad, self, *args, **kwargs):
    return torch.empty_like(self)


def _repeat_int_samples(dtype):
    x = randn(3, 4, dtype=dtype, seed=0)
    yield Sample((randn(9, 4, dtype=dtype, seed=1), x, 3, 0))  # repeated along dim 0
    yield Sample((randn(3, 12, dtype=dtype, seed=2), x, 3, 1))  # along dim 1
    yield Sample((randn(36, dtype=dtype, seed=3), x, 3, None))  # flattened


def _repeat_tensor_samples(dtype):
    x = randn(3, 4, dtype=dtype, seed=0)
    yield Sample((randn(4, 4, dtype=dtype, seed=1), x, torch.tensor([1, 0, 3]), 0))  # per element
    yield Sample((randn(3, 8, dtype=dtype, seed=2), x, torch.tensor([2]), 1))  # one count for all


def _loss_samples(dtype):
    # (grad_output, self, target, reduction): elementwise (none) and a scalar gradient (mean, sum)
    x, target = randn(3, 5, dtype=dtype, seed=0).log_softmax(-1), randn(3, 5, dtype=dtype, seed=1).softmax(-1)
    yield Sample((randn(3, 5, dtype=dtype, seed=2), x, target, _NONE))
    yield Sample((randn(dtype=dtype, seed=3), x, target, _MEAN))
    yield Sample((randn(dtype=dtype, seed=4), x, target, _SUM))


def _kl_div_samples(dtype):
    yield from _loss_samples(dtype)
    for sample in _loss_samples(dtype):  # a log-space target
        grad, x, target, reduction = sample.args
        yield Sample((grad, x, target.log(), reduction), {"log_target": True})


def _repeated_dim(self, dim):
    return (self.reshape(-1), 0) if dim is None else (self, dim % max(self.dim(), 1))


@op_spec("npu::repeat_interleave_backward_int",
         schema="repeat_interleave_backward_int(Tensor grad, Tensor self, SymInt repeats, int? dim=None) -> Tensor",
         fake=_like_self, samples=_repeat_int_samples, sample_dtypes=FLOAT_DTYPES)
def repeat_interleave_backward_int(grad, self, repeats, dim=None):
    # the sum of each element's `repeats` consecutive copies along dim (self flattened if dim is None)
    flat, d = _repeated_dim(self, dim)
    n = flat.shape[d]
    shape = list(grad.shape)
    shape[d:d + 1] = [n, int(repeats)]
    return in_layout_of(grad.reshape(shape).sum(d + 1).reshape(self.shape), self)


@op_spec("npu::repeat_interleave_backward_tensor",
         schema="repeat_interleave_backward_tensor(Tensor grad, Tensor self, Tensor repeats, int? dim=None) -> Tensor",
         fake=_like_self, samples=_repeat_tensor_samples, sample_dtypes=FLOAT_DTYPES)
def repeat_interleave_backward_tensor(grad, self, repeats, dim=None):
    # element i was copied repeats[i] times (a one-element repeats: every element as often)
    flat, d = _repeated_dim(self, dim)
    n = flat.shape[d]
    counts = repeats.reshape(-1).to(torch.int64)
    counts = counts.expand(n) if counts.numel() == 1 else counts
    owner = torch.repeat_interleave(torch.arange(n, device=grad.device), counts)
    out = torch.zeros(flat.shape, dtype=grad.dtype, device=grad.device).index_add_(d, owner, grad)
    return in_layout_of(out.reshape(self.shape), self)


def _reduced(grad_output, pointwise, reduction):
    if reduction == _MEAN:
        return pointwise * grad_output / pointwise.numel()
    return pointwise * grad_output  # sum: the scalar gradient broadcasts; none: elementwise


def _check_reduction(op, reduction):
    if reduction not in (_NONE, _MEAN, _SUM):
        raise RuntimeError(f"{op}: reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")


@op_spec("npu::kl_div_backward",
         schema="kl_div_backward(Tensor grad_output, Tensor self, Tensor target, int reduction=Mean, *, bool "
                "log_target=False) -> Tensor",
         fake=_like_self, samples=_kl_div_samples, sample_dtypes=FLOAT_DTYPES)
def kl_div_backward(grad_output, self, target, reduction=_MEAN, *, log_target=False):
    # loss = target * (log(target) - self) (0 where target == 0), or exp(target) * (target - self)
    _check_reduction("kl_div_backward", reduction)
    dloss = -target.exp() if log_target else -target
    return in_layout_of(_reduced(grad_output, dloss.expand_as(self), reduction).to(self.dtype), self)


@op_spec("npu::kl_div_target_backward",
         schema="kl_div_target_backward(Tensor grad_output, Tensor self, Tensor target, int reduction=Mean, *, bool "
                "log_target=False) -> Tensor",
         fake=lambda grad, self, target, *a, **k: torch.empty_like(target), samples=_kl_div_samples,
         sample_dtypes=FLOAT_DTYPES)
def kl_div_target_backward(grad_output, self, target, reduction=_MEAN, *, log_target=False):
    _check_reduction("kl_div_target_backward", reduction)
    if log_target:
        dloss = target.exp() * (target - self + 1)
    else:
        # the derivative of kl_div's composite xlogy(t, t) - t * x as torch's autograd takes it:
        # xlogy(t != 0, t) + t / t - x, log(t) + 1 - x where t > 0 and NaN where t == 0 (the
        # NPU kernel's value there is not documented [not established])
        dloss = torch.xlogy((target != 0).to(target.dtype), target) + target / target - self
    return in_layout_of(_reduced(grad_output, dloss.expand_as(target), reduction).to(target.dtype), target)


@op_spec("npu::l1_loss_backward",
         schema="l1_loss_backward(Tensor grad_output, Tensor self, Tensor target, int reduction) -> Tensor",
         fake=_like_self, samples=_loss_samples, sample_dtypes=FLOAT_DTYPES)
def l1_loss_backward(grad_output, self, target, reduction):
    _check_reduction("l1_loss_backward", reduction)
    return in_layout_of(_reduced(grad_output, torch.sign(self - target), reduction).to(self.dtype), self)
