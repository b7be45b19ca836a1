"""Activation family: npu_swiglu (+ backward).

Reference semantics: shared/reference/op_semantics.md section 4.1, from the torch_npu docs
and the wheel's inductor decomposition (_inductor/decomposition.py). The FIRST half along
`dim` is the gate that goes through silu, the second half multiplies it: a model whose
gate/up projections are concatenated the other way round does not match this op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._library import stand_in


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 as on the NPU; float64 stays float64 so gradcheck can run on the stand-in.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate_and_up(op: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of x along dim, in the compute dtype."""
    if x.shape[dim] % 2:  # chunk would make unequal halves that no longer line up
        raise RuntimeError(f"{op}: dim {dim} must split into two equal halves, it has size {x.shape[dim]}")
    a, b = x.to(_compute_dtype(x)).chunk(2, dim)
    return a, b


# ---- npu_swiglu ----------------------------------------------------------------------
def _swiglu_fake(self, dim=-1):
    shape = list(self.shape)
    shape[dim] = shape[dim] // 2  # Meta: floor(size / 2)
    return self.new_empty(shape)


def _swiglu_setup_context(ctx, inputs, output):
    self, dim = inputs
    ctx.save_for_backward(self)
    ctx.dim = dim


def _swiglu_backward(ctx, grad):
    (self,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(grad, self, ctx.dim), None


@stand_in("npu::npu_swiglu", fake=_swiglu_fake,
          backward=_swiglu_backward, setup_context=_swiglu_setup_context)
def npu_swiglu(self, dim=-1):
    # silu and the product in fp32, one rounding at the end (the documented reference).
    a, b = _gate_and_up("npu_swiglu", self, dim)
    return (F.silu(a) * b).to(self.dtype).contiguous()


# ---- npu_swiglu_backward -------------------------------------------------------------
def _swiglu_backward_fake(grad_output, self, dim=-1):
    return self.new_empty(self.shape)


@stand_in("npu::npu_swiglu_backward", fake=_swiglu_backward_fake)
def npu_swiglu_backward(grad_output, self, dim=-1):
    # d silu(a)/da = s * (1 + a * (1 - s)) with s = sigmoid(a); d(silu(a) * b)/db = silu(a).
    a, b = _gate_and_up("npu_swiglu_backward", self, dim)
    g = grad_output.to(a.dtype)
    s = torch.sigmoid(a)
    grad_a = g * b * s * (1 + a * (1 - s))
    grad_b = g * a * s
    return torch.cat((grad_a, grad_b), dim).to(self.dtype)
