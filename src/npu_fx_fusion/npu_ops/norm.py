"""RMSNorm family: npu_rms_norm (+ backward) and npu_add_rms_norm.

Reference semantics: shared/reference/op_semantics.md section 2, from the ops-nn
kernels (norm/rms_norm/op_kernel/rms_norm.h, norm/add_rms_norm/op_kernel/add_rms_norm.h)
and the torch_npu meta functions (op_plugin/meta/_meta_registrations.py).
"""
from __future__ import annotations

import torch

from ._library import stand_in


def _norm_dims(x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    # gamma has shape x.shape[n:]; the norm runs over those trailing dims.
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    lead = x.dim() - gamma.dim()
    return [x.shape[i] if i < lead else 1 for i in range(x.dim())]


def _rstd(x32: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(_norm_dims(x32, gamma), keepdim=True) + epsilon)


# ---- npu_rms_norm ------------------------------------------------------------------
def _rms_norm_fake(self, gamma, epsilon=1e-6):
    return torch.empty_like(self), self.new_empty(_rstd_shape(self, gamma), dtype=torch.float32)


def _rms_norm_setup_context(ctx, inputs, output):
    self, gamma, _ = inputs
    ctx.save_for_backward(self, gamma, output[1])


def _rms_norm_backward(ctx, grad_y, grad_rstd):
    # rstd is not differentiable in torch_npu (output_differentiability: [true, false]).
    self, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(grad_y, self, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None


@stand_in("npu::npu_rms_norm", fake=_rms_norm_fake,
          backward=_rms_norm_backward, setup_context=_rms_norm_setup_context)
def npu_rms_norm(self, gamma, epsilon=1e-6):
    # The kernel normalises in fp32 and multiplies gamma in fp32: one rounding at the end
    # (rms_norm.h ComputeMulGammaCast). HF rounds before the gamma multiply: <= 1 ulp apart.
    x32 = self.float()
    rstd = _rstd(x32, gamma, epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


# ---- npu_rms_norm_backward -----------------------------------------------------------
def _rms_norm_backward_fake(dy, self, gamma, rstd):
    return torch.empty_like(self), torch.empty_like(gamma, dtype=torch.float32)


@stand_in("npu::npu_rms_norm_backward", fake=_rms_norm_backward_fake)
def npu_rms_norm_backward(dy, self, gamma, rstd):
    dims = _norm_dims(self, gamma)
    lead = tuple(range(self.dim() - gamma.dim()))
    xhat = self.float() * rstd
    dyg = dy.float() * gamma.float()
    dx = (dyg - xhat * (dyg * xhat).mean(dims, keepdim=True)) * rstd
    dgamma = (dy.float() * xhat).sum(lead) if lead else dy.float() * xhat
    return dx.to(self.dtype), dgamma


# ---- npu_add_rms_norm ----------------------------------------------------------------
def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    rstd = x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)
    return torch.empty_like(x1), rstd, torch.empty_like(x1)


@stand_in("npu::npu_add_rms_norm", fake=_add_rms_norm_fake)
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    # Rounding points of the A2/A3 kernel (add_rms_norm.h, generic template):
    #   fp16: the add happens in fp16, x*rstd is rounded to fp16 before the gamma multiply.
    #   bf16: the add happens in fp32; rstd comes from the unrounded fp32 sum; x*rstd is
    #         rounded to bf16, then multiplied by gamma in fp32 and rounded again.
    #   fp32: no rounding at all.
    dtype = x1.dtype
    if dtype == torch.float16:
        x_out = x1 + x2
        x32 = x_out.float()
    else:
        x32 = x1.float() + x2.float()
        x_out = x32.to(dtype)
    rstd = _rstd(x32, gamma, epsilon)
    normed = (x32 * rstd).to(dtype).float()
    y = (normed * gamma.float()).to(dtype)
    return y, rstd, x_out


# ---- npu_add_rms_norm_cast ----------------------------------------------------------
# No pass of ours emits it: torchair's own pattern pass (torchair/patterns/
# add_rms_norm_cast.py) rewrites `npu_add_rms_norm` + a cast of y to fp32 into it, after
# our passes. The stand-in lets that pass run on CPU (tests/test_torchair_backend.py).
def _add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-6):
    y, rstd, x_out = _add_rms_norm_fake(x1, x2, gamma, epsilon)
    return torch.empty_like(x1, dtype=torch.float32), y, rstd, x_out


@stand_in("npu::npu_add_rms_norm_cast", fake=_add_rms_norm_cast_fake)
def npu_add_rms_norm_cast(x1, x2, gamma, epsilon=1e-6):
    # Outputs (y_fp32, y, rstd, x_out), the order torchair's replacement unpacks. y_fp32 is
    # taken as y rounded to x1's dtype and widened, the value of the cast it replaces
    # ([inferred]: the kernel docs do not say whether it is the unrounded product).
    y, rstd, x_out = npu_add_rms_norm(x1, x2, gamma, epsilon)
    return y.float(), y, rstd, x_out
