"""Rotary position embedding family: npu_rotary_mul (+ backward) and npu_interleave_rope.

Reference semantics: shared/reference/op_semantics.md section 3, from the torch_npu docs
(_op_plugin_docs.py), the wheel's inductor decomposition of half mode
(_inductor/decomposition.py) and its Meta functions (op_plugin/meta/_meta_registrations.py).
The kernels' internal precision is undocumented (op_semantics 11.4); like the norm kernels,
these compute in fp32 and round once to the input dtype.

Hardware limits (D < 896, B*N < 1000, D == 64, ...) are not checked here: they live in
capabilities.py. The kernels only refuse what they could not compute.
"""
from __future__ import annotations

import torch

from ._library import stand_in

# How many equal parts of the last dim each mode's rotation pairs up.
_MODE_PARTS = {"half": 2, "interleave": 2, "quarter": 4}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 as on the NPU; float64 stays float64 so gradcheck can run on the stand-in.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_split(op: str, x: torch.Tensor, parts: int) -> None:
    # Unequal parts would silently misalign the rotation pairs.
    if x.shape[-1] % parts:
        raise RuntimeError(f"{op}: the last dim must split into {parts} equal parts, "
                           f"it has size {x.shape[-1]}")


def _check_mode(op: str, x: torch.Tensor, mode: str) -> None:
    if mode not in _MODE_PARTS:
        raise RuntimeError(f"{op}: rotary_mode {mode!r} has no CPU reference; "
                           f"known modes: {', '.join(_MODE_PARTS)}")
    _check_split(op, x, _MODE_PARTS[mode])


def _check_broadcasts_to(op: str, x: torch.Tensor, *tables: torch.Tensor) -> None:
    # The output has x's shape (Meta functions): cos/sin may broadcast, never enlarge it.
    for t in tables:
        if torch.broadcast_shapes(x.shape, t.shape) != x.shape:
            raise RuntimeError(f"{op}: a cos/sin of shape {tuple(t.shape)} does not broadcast "
                               f"to the input's shape {tuple(x.shape)}")


def _rot(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x @ R for the fixed rotation R of `mode` (op_semantics 3.1 `_rot`).

    Every mode's R is antisymmetric (R^T = -R), which the backward relies on.
    """
    if mode == "half":
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)
    if mode == "interleave":  # [-x1, x0, -x3, x2, ...]
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    a, b, c, d = x.chunk(4, -1)  # quarter
    return torch.cat((-b, a, -d, c), -1)


def _new_like(x: torch.Tensor, shape) -> torch.Tensor:
    # contiguous, like the kernels' results: inductor asserts a fallback op's strides
    return x.new_empty(shape)


# ---- npu_rotary_mul ------------------------------------------------------------------
def _rotary_mul_fake(self, r1, r2, rotary_mode="half", rotate=None):
    return _new_like(self, self.shape)


def _rotary_mul_setup_context(ctx, inputs, output):
    self, r1, r2, rotary_mode, rotate = inputs
    ctx.save_for_backward(self, r1, r2)
    ctx.rotary_mode = rotary_mode
    ctx.has_rotate = rotate is not None


def _rotary_mul_backward(ctx, grad):
    # torch_npu's derivative ignores `rotate` (its docs: rotate has no backward), so a
    # gradient through it would silently use the mode's rotation instead: refuse.
    if ctx.has_rotate:
        raise RuntimeError("npu_rotary_mul: passing rotate disables backward (torch_npu has no "
                           "gradient for it); call it without rotate to train")
    self, r1, r2 = ctx.saved_tensors
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, self, r1, r2, ctx.rotary_mode)
    return dx, dr1.to(r1.dtype), dr2.to(r2.dtype), None, None


@stand_in("npu::npu_rotary_mul", fake=_rotary_mul_fake,
          backward=_rotary_mul_backward, setup_context=_rotary_mul_setup_context)
def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    # With `rotate` the rotation is exactly x @ rotate, whatever the mode: the docs' example
    # interleave matrix has no sign (op_semantics 11.11), so no sign is added here either.
    op = "npu_rotary_mul"
    _check_broadcasts_to(op, self, r1, r2)
    acc = _compute_dtype(self)
    x = self.to(acc)
    if rotate is None:
        _check_mode(op, self, rotary_mode)
        xr = _rot(x, rotary_mode)
    else:
        xr = x @ rotate.to(acc)
    return (x * r1.to(acc) + xr * r2.to(acc)).to(self.dtype).contiguous()


# ---- npu_rotary_mul_backward ---------------------------------------------------------
def _rotary_mul_backward_fake(grad, self, r1, r2, rotary_mode="half"):
    # Meta: all three in self's dtype, dr1/dr2 shaped like r1/r2.
    return _new_like(self, self.shape), _new_like(self, r1.shape), _new_like(self, r2.shape)


@stand_in("npu::npu_rotary_mul_backward", fake=_rotary_mul_backward_fake)
def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode="half"):
    # out = x*r1 + R(x)*r2, so dx = r1*g + R^T(r2*g) = r1*g - R(r2*g) (R antisymmetric);
    # dr1/dr2 sum the broadcast dims back to r1/r2's shapes.
    op = "npu_rotary_mul_backward"
    _check_mode(op, self, rotary_mode)
    _check_broadcasts_to(op, self, r1, r2)
    acc = _compute_dtype(self)
    x, g = self.to(acc), grad.to(acc)
    dx = r1.to(acc) * g - _rot(r2.to(acc) * g, rotary_mode)
    dr1 = (x * g).sum_to_size(r1.shape)
    dr2 = (_rot(x, rotary_mode) * g).sum_to_size(r2.shape)
    return tuple(t.to(self.dtype).contiguous() for t in (dx, dr1, dr2))


# ---- npu_interleave_rope -------------------------------------------------------------
def _interleave_rope_fake(x, cos, sin):
    return _new_like(x, x.shape)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...], DeepSeek's view/transpose trick."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@stand_in("npu::npu_interleave_rope", fake=_interleave_rope_fake)  # no autograd in torch_npu
def npu_interleave_rope(x, cos, sin):
    # Half-mode RoPE of the de-interleaved x; the result is NOT re-interleaved (op_semantics 3.3).
    op = "npu_interleave_rope"
    _check_split(op, x, 2)
    _check_broadcasts_to(op, x, cos, sin)
    acc = _compute_dtype(x)
    q = _deinterleave(x.to(acc))
    return (q * cos.to(acc) + _rot(q, "half") * sin.to(acc)).to(x.dtype).contiguous()


# =====================================================================================
# cann_ops_transformer.inplace_partial_rotary_mul (+ backward): DeepSeek-V4's partial RoPE
# =====================================================================================
# COT docs (torch_extension/cann_ops_transformer/docs/zh/inplace_partial_rotary_mul.md) and
# the extension's Meta (ops/inplace_partial_rotary_mul*.py, mirror-cann/ops-transformer
# 3a280bc): x is 4-D BSND, rotated IN PLACE on x[..., start:end] only; r1 = cos, r2 = sin,
# already one entry per channel of the slice (each pair's angle twice), broadcasting to
# the slice. The doc writes the rotation as `cat(-x[..., 1::2], x[..., ::2])`, every caller
# and torchtitan-npu's CPU double (bitwise equal to the A3 kernel in its device smoke test,
# deepseek_v4.md 6.2) as the interleave `stack(-x_odd, x_even).flatten(-2)`: the latter is
# implemented (open in the reference; `_rot(x, "interleave")`). fp32 inside, one rounding.
# No autograd at the dispatcher: the extension's InplacePartialRotaryMulFn (mark_dirty)
# differentiates it with the backward op, which rotates grad_output in place by the
# transpose rotation (no gradients for r1 / r2).
def _check_partial_rotary(op: str, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str,
                          partial_slice) -> tuple[int, int]:
    if x.dim() != 4:
        raise RuntimeError(f"{op}: x must be 4-D (B, S, N, D), it has {x.dim()} dims")
    if rotary_mode != "interleave":
        raise RuntimeError(f"{op}: rotary_mode only supports 'interleave', got {rotary_mode!r}")
    if len(partial_slice) != 2:
        raise RuntimeError(f"{op}: partial_slice must contain exactly two integers, got {list(partial_slice)}")
    start, end = partial_slice
    if not 0 <= start <= end <= x.shape[-1] or (end - start) % 2:
        raise RuntimeError(f"{op}: partial_slice [{start}, {end}) must lie in [0, {x.shape[-1]}] with an even "
                           "length")
    if r1.dtype != r2.dtype or r1.shape != r2.shape or r1.dim() != 4 or r1.shape[-1] != end - start:
        raise RuntimeError(f"{op}: r1 and r2 must be 4-D of one shape and dtype with last dim {end - start}, got "
                           f"{r1.dtype}{tuple(r1.shape)} and {r2.dtype}{tuple(r2.shape)}")
    sliced = (*x.shape[:-1], end - start)
    if torch.broadcast_shapes(sliced, r1.shape) != torch.Size(sliced):
        raise RuntimeError(f"{op}: r1/r2 {tuple(r1.shape)} do not broadcast to x[..., start:end] {sliced}")
    return start, end


def _partial_rotary_fake(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    _check_partial_rotary("inplace_partial_rotary_mul", x, r1, r2, rotary_mode, partial_slice)


@stand_in("cann_ops_transformer::inplace_partial_rotary_mul", fake=_partial_rotary_fake,
          python_autograd="cann_ops_transformer.ops.inplace_partial_rotary_mul.InplacePartialRotaryMulFn")
def inplace_partial_rotary_mul(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    start, end = _check_partial_rotary("inplace_partial_rotary_mul", x, r1, r2, rotary_mode, partial_slice)
    if start == end:
        return None
    acc = _compute_dtype(x)
    part = x[..., start:end].to(acc)
    x[..., start:end] = (part * r1.to(acc) + _rot(part, "interleave") * r2.to(acc)).to(x.dtype)
    return None


def _partial_rotary_backward_fake(grad_output, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    _check_partial_rotary("inplace_partial_rotary_mul_backward", grad_output, r1, r2, rotary_mode, partial_slice)


@stand_in("cann_ops_transformer::inplace_partial_rotary_mul_backward", fake=_partial_rotary_backward_fake)
def inplace_partial_rotary_mul_backward(grad_output, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    # out = x*r1 + R(x)*r2 on the slice, so dx = r1*g + R^T(r2*g) = r1*g - R(r2*g) (R antisymmetric,
    # as npu_rotary_mul_backward); the other channels pass their gradient through unchanged
    start, end = _check_partial_rotary("inplace_partial_rotary_mul_backward", grad_output, r1, r2, rotary_mode,
                                       partial_slice)
    if start == end:
        return None
    acc = _compute_dtype(grad_output)
    g = grad_output[..., start:end].to(acc)
    grad_output[..., start:end] = (r1.to(acc) * g - _rot(r2.to(acc) * g, "interleave")).to(grad_output.dtype)
    return None
