"""npu._npu_dtype_cast: torch_npu's spelling of a dtype conversion (`x.to(dtype)`)."""
from __future__ import annotations

import torch

from ._library import stand_in


def _fake(self, dtype):
    return self.new_empty(self.shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.input_dtype = inputs[0].dtype


def _backward(ctx, grad):
    return grad.to(ctx.input_dtype), None


@stand_in("npu::_npu_dtype_cast", fake=_fake, backward=_backward, setup_context=_setup_context)
def npu_dtype_cast(self, dtype):
    return self.to(dtype, copy=True)  # an op output must not alias its input
