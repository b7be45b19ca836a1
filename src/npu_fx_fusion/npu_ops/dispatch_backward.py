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

from ._library import stand_in

_NONE, _MEAN, _SUM = 0, 1, 2


def _like_self(grad, self, *args, **kwargs):
    return torch.empty_like(self)


def _repeated_dim(self, dim):
    return (self.reshape(-1), 0) if dim is None else (self, dim % max(self.dim(), 1))


@stand_in("npu::repeat_interleave_backward_int", fake=_like_self)
def repeat_interleave_backward_int(grad, self, repeats, dim=None):
    # the sum of each element's `repeats` consecutive copies along dim (self flattened if dim is None)
    flat, d = _repeated_dim(self, dim)
    n = flat.shape[d]
    shape = list(grad.shape)
    shape[d:d + 1] = [n, int(repeats)]
    return grad.reshape(shape).sum(d + 1).reshape(self.shape)


@stand_in("npu::repeat_interleave_backward_tensor", fake=_like_self)
def repeat_interleave_backward_tensor(grad, self, repeats, dim=None):
    # element i was copied repeats[i] times (a one-element repeats: every element as often)
    flat, d = _repeated_dim(self, dim)
    n = flat.shape[d]
    counts = repeats.reshape(-1).to(torch.int64)
    counts = counts.expand(n) if counts.numel() == 1 else counts
    owner = torch.repeat_interleave(torch.arange(n, device=grad.device), counts)
    out = torch.zeros(flat.shape, dtype=grad.dtype, device=grad.device).index_add_(d, owner, grad)
    return out.reshape(self.shape)


def _reduced(grad_output, pointwise, reduction):
    if reduction == _MEAN:
        return pointwise * grad_output / pointwise.numel()
    return pointwise * grad_output  # sum: the scalar gradient broadcasts; none: elementwise


def _check_reduction(op, reduction):
    if reduction not in (_NONE, _MEAN, _SUM):
        raise RuntimeError(f"{op}: reduction must be 0 (none), 1 (mean) or 2 (sum), got {reduction}")


@stand_in("npu::kl_div_backward", fake=_like_self)
def kl_div_backward(grad_output, self, target, reduction=_MEAN, *, log_target=False):
    # loss = target * (log(target) - self) (0 where target == 0), or exp(target) * (target - self)
    _check_reduction("kl_div_backward", reduction)
    dloss = -target.exp() if log_target else -target
    return _reduced(grad_output, dloss.expand_as(self), reduction).to(self.dtype)


@stand_in("npu::kl_div_target_backward", fake=lambda grad, self, target, *a, **k: torch.empty_like(target))
def kl_div_target_backward(grad_output, self, target, reduction=_MEAN, *, log_target=False):
    _check_reduction("kl_div_target_backward", reduction)
    if log_target:
        dloss = target.exp() * (target - self + 1)
    else:
        # the derivative of kl_div's composite xlogy(t, t) - t * x as torch's autograd takes it:
        # xlogy(t != 0, t) + t / t - x, log(t) + 1 - x where t > 0 and NaN where t == 0 (the
        # NPU kernel's value there is not documented [not established])
        dloss = torch.xlogy((target != 0).to(target.dtype), target) + target / target - self
    return _reduced(grad_output, dloss.expand_as(target), reduction).to(target.dtype)


@stand_in("npu::l1_loss_backward", fake=_like_self)
def l1_loss_backward(grad_output, self, target, reduction):
    _check_reduction("l1_loss_backward", reduction)
    return _reduced(grad_output, torch.sign(self - target), reduction).to(self.dtype)
