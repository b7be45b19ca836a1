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


# =====================================================================================
# Clamped SwiGLU (DeepSeek-V4's experts): npu_clipped_swiglu, cann_ops_nn.swiglu_group (+ backward)
# =====================================================================================
def _halves(op: str, x: torch.Tensor, dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[dim] % 2:
        raise RuntimeError(f"{op}: dim {dim} must be even, it has size {x.shape[dim]}")
    xf = x.to(_compute_dtype(x))
    if interleaved:  # even / odd channels
        return xf.unflatten(dim, (-1, 2)).unbind(dim if dim < 0 else dim + 1)
    return xf.chunk(2, dim)


def _clipped_swiglu_fake(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2  # the wheel's Meta: floor(size / 2)
    return x.new_empty(shape)


@stand_in("npu::npu_clipped_swiglu", fake=_clipped_swiglu_fake)  # no autograd in torch_npu
def npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    # torch_npu docstring (_op_plugin_docs.py npu_clipped_swiglu): A, B = even / odd (interleaved)
    # or first / second half of dim; A = min(A, limit), B = clamp(B, -limit, limit);
    # y = A * sigmoid(alpha * A) * (B + bias). With group_index only the first sum(group_index)
    # rows (of x merged to [pre, cut * after] around dim) are computed; the rest are zeros here
    # [inferred: the docs filter them out, the Meta keeps the full shape]. fp32, one rounding.
    op = "npu_clipped_swiglu"
    if x.dim() < 2:
        raise RuntimeError(f"{op}: x must have more than 1 dim, it has {x.dim()}")
    a, b = _halves(op, x, dim, interleaved)
    a = a.clamp(max=limit)
    b = b.clamp(min=-limit, max=limit)
    y = a * torch.sigmoid(alpha * a) * (b + bias)
    if group_index is not None:
        rows = int(group_index.sum())
        pre = y.shape[: dim % x.dim()]
        flat = y.reshape(int(torch.tensor(pre).prod()) if pre else 1, -1)
        flat[rows:] = 0
        y = flat.view(y.shape)
    return y.to(x.dtype).contiguous()


def _swiglu_group_rows(op: str, x: torch.Tensor, weight, group_index) -> int:
    """How many leading rows (x's dims but the last, flattened) the op computes."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or x.shape[-1] % 2:
        raise RuntimeError(f"{op}: x must have an even last dim, got {tuple(x.shape)}")
    if weight is not None and (weight.dtype != torch.float32 and weight.dtype != torch.float64
                               or weight.numel() != rows):
        raise RuntimeError(f"{op}: weight must be fp32 with one value per row ({rows}), got {weight.dtype}"
                           f"{tuple(weight.shape)}")
    if group_index is not None:
        if group_index.dim() != 1 or group_index.numel() == 0 or group_index.dtype != torch.int64:
            raise RuntimeError(f"{op}: group_index must be a non-empty 1-D int64 tensor of counts")
        rows = min(int(group_index.sum()), rows)
    return rows


def _clamped_halves(x: torch.Tensor, clamp_limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = x.to(_compute_dtype(x)).chunk(2, -1)
    if clamp_limit > 0:
        a, b = a.clamp(max=clamp_limit), b.clamp(min=-clamp_limit, max=clamp_limit)
    return a, b


def _swiglu_group_fake(x, *, weight=None, group_index=None, clamp_limit=-1.0):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@stand_in("cann_ops_nn::swiglu_group", fake=_swiglu_group_fake,
          python_autograd="cann_ops_nn swiglu_group.SwigluGroupFn (activation/swiglu_group/torch_extension)")
def swiglu_group(x, *, weight=None, group_index=None, clamp_limit=-1.0):
    # hicann/ops-nn activation/swiglu_group/docs/aclnnSwigluGroup.md: A, B = the two halves of the
    # last dim; clamp_limit > 0: A = min(A, L), B = clamp(B, -L, L) (-1.0 disables); y = silu(A) * B,
    # times weight per row (token) when given; with group_index (counts) only the first
    # min(sum, rows) rows are computed (the others zeros here [inferred: left unwritten]).
    # fp32, one rounding to x's dtype.
    if clamp_limit != -1.0 and clamp_limit <= 0:
        raise RuntimeError(f"swiglu_group: clamp_limit must be -1.0 (off) or > 0, got {clamp_limit}")
    rows = _swiglu_group_rows("swiglu_group", x, weight, group_index)
    a, b = _clamped_halves(x, clamp_limit)
    y = torch.nn.functional.silu(a) * b
    if weight is not None:
        y = y * weight.reshape(*x.shape[:-1], 1).to(y.dtype)
    flat = y.reshape(-1, y.shape[-1])
    flat[rows:] = 0
    return flat.view(y.shape).to(x.dtype)


def _swiglu_group_backward_fake(grad_output, x, *, weight=None, y_origin=None, group_index=None, clamp_limit=0.0):
    grad_weight = torch.empty_like(weight, dtype=torch.float32) if weight is not None else x.new_empty((0,))
    return grad_output.new_empty(x.shape), grad_weight


@stand_in("cann_ops_nn::swiglu_group_backward", fake=_swiglu_group_backward_fake)
def swiglu_group_backward(grad_output, x, *, weight=None, y_origin=None, group_index=None, clamp_limit=0.0):
    # hicann/ops-nn torch_extension/cann_ops_nn/ops/activation/swiglu_group_backward/swiglu_group_backward.md:
    #   dA = g * silu'(A~) * B~ * w * I(A < L)       dB = g * silu(A~) * w * I(-L < B < L)
    #   grad_weight = sum(g * y_origin) over the hidden dim
    # with A~, B~ the clamped halves and I OPEN intervals (a value exactly at the limit gets no
    # gradient; torch's clamp passes it), clamp_limit 0.0 meaning no clamp (the forward's -1.0,
    # SwigluGroupFn maps it). y_origin is the forward WITHOUT the weight (SwigluGroupFn computes
    # it with weight=None; the md's "y already multiplied by the weight" would make grad_weight
    # wrong). Weight (.., 1) fp32, its gradient too; rows past group_index's sum get 0.
    # Returns (grad_x, grad_weight); the schema's `Tensor?` grad_weight is an empty (0,) without
    # weight here (a CPU op cannot return None for it through the dispatcher's fake) [stand-in choice].
    op = "swiglu_group_backward"
    if clamp_limit < 0:
        raise RuntimeError(f"{op}: clamp_limit must be >= 0.0, got {clamp_limit}")
    if (weight is None) != (y_origin is None):
        raise RuntimeError(f"{op}: weight and y_origin must be provided together")
    if grad_output.shape[:-1] != x.shape[:-1] or x.shape[-1] != 2 * grad_output.shape[-1]:
        raise RuntimeError(f"{op}: x {tuple(x.shape)} must be grad_output {tuple(grad_output.shape)} with a doubled "
                           "last dim")
    rows = _swiglu_group_rows(op, x, weight, group_index)
    acc = _compute_dtype(x)
    raw_a, raw_b = x.to(acc).chunk(2, -1)
    a, b = _clamped_halves(x, clamp_limit)
    g = grad_output.to(acc)
    w = weight.reshape(*x.shape[:-1], 1).to(acc) if weight is not None else torch.ones((), dtype=acc)
    s = torch.sigmoid(a)
    silu = a * s
    pass_a = raw_a < clamp_limit if clamp_limit > 0 else torch.ones_like(raw_a, dtype=torch.bool)
    pass_b = (raw_b > -clamp_limit) & (raw_b < clamp_limit) if clamp_limit > 0 else torch.ones_like(raw_b, dtype=torch.bool)
    grad_a = g * (s + silu * (1 - s)) * b * w * pass_a
    grad_b = g * silu * w * pass_b
    grad_x = torch.cat((grad_a, grad_b), -1).reshape(-1, x.shape[-1])
    grad_x[rows:] = 0
    grad_x = grad_x.view(x.shape).to(grad_output.dtype)
    if weight is None:
        return grad_x, x.new_empty((0,))
    grad_w = (g * y_origin.to(acc)).sum(-1, keepdim=True).reshape(-1)
    grad_w[rows:] = 0
    return grad_x, grad_w.view(weight.shape).to(torch.float32 if weight.dtype != torch.float64 else torch.float64)
