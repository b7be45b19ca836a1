"""npu._npu_dtype_cast: torch_npu's dtype conversion op, and its backward op.

torch_npu's own kernels call it where they convert a dtype (softmax with a dtype, in an NPU
aot graph: npu_dispatch.py); `x.to(dtype)` itself is recorded as aten._to_copy on an NPU as
on CPU (dispatch_inventory.DTYPE_CAST).

torch_npu differentiates it as NpuDtypeCastBackward0:
`_npu_dtype_cast_backward(grad, self.scalar_type())` (its generated autograd code), so a
training graph on an NPU holds that op where CPU's holds `aten._to_copy` of the gradient.
"""
from __future__ import annotations

import torch

from ._library import stand_in


def _fake(self, dtype):
    return self.new_empty(self.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.input_dtype = inputs[0].dtype


def _backward(ctx, grad):
    return torch.ops.npu._npu_dtype_cast_backward(grad, ctx.input_dtype), None


@stand_in("npu::_npu_dtype_cast", fake=_fake, backward=_backward, setup_context=_setup_context)
def npu_dtype_cast(self, dtype):
    return self.to(dtype, copy=True)  # an op output must not alias its input


def _backward_fake(grad, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


@stand_in("npu::_npu_dtype_cast_backward", fake=_backward_fake)  # the cast of a gradient
def npu_dtype_cast_backward(grad, dtype):
    return grad.to(dtype, copy=True)
