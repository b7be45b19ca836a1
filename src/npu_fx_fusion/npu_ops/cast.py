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

from .spec import FLOAT_DTYPES, Sample, op_spec, randn


# The wheel's Meta functions (_npu_dtype_cast_meta, _npu_dtype_cast_backward_meta):
# self.new_empty(self.shape, dtype=dtype), a contiguous result whatever self's layout; the
# kernels return that layout too.
def _fake(self, dtype):
    return self.new_empty(self.shape, dtype=dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a tensor of its own (an op output must not alias its input), contiguous like the Meta's
    return t.to(dtype, memory_format=torch.contiguous_format, copy=True)


def _cast_args(dtype):
    # a half dtype widened to fp32, fp32 narrowed to bf16
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    return randn(2, 3, 8, dtype=dtype), other


def _samples(dtype):
    yield Sample(_cast_args(dtype), grad_args=(0,))


def _backward_samples(dtype):
    yield Sample(_cast_args(dtype))


def _setup_context(ctx, inputs, output):
    ctx.input_dtype = inputs[0].dtype


def _backward(ctx, grad):
    return torch.ops.npu._npu_dtype_cast_backward(grad, ctx.input_dtype), None


@op_spec("npu::_npu_dtype_cast",
         schema="_npu_dtype_cast(Tensor self, ScalarType dtype) -> Tensor",
         fake=_fake, backward=_backward, setup_context=_setup_context, samples=_samples,
         sample_dtypes=FLOAT_DTYPES)
def npu_dtype_cast(self, dtype):
    return _cast(self, dtype)


def _backward_fake(grad, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


@op_spec("npu::_npu_dtype_cast_backward",
         schema="_npu_dtype_cast_backward(Tensor grad, ScalarType dtype) -> Tensor",
         fake=_backward_fake, samples=_backward_samples, sample_dtypes=FLOAT_DTYPES)  # the cast of a gradient
def npu_dtype_cast_backward(grad, dtype):
    return _cast(grad, dtype)
