"""RMSNorm family: npu_rms_norm (+ backward) and npu_add_rms_norm.

Reference semantics: shared/reference/op_semantics.md section 2, from the ops-nn
kernels (norm/rms_norm/op_kernel/rms_norm.h, norm/add_rms_norm/op_kernel/add_rms_norm.h)
and the torch_npu meta functions (op_plugin/meta/_meta_registrations.py).
"""
from __future__ import annotations

import torch

from .spec import FLOAT_DTYPES, OpCapability, Sample, SocLimits, in_layout_of, op_spec, randn

# Atlas inference (310P) has no bf16 and no fp32 gamma with a half input; Ascend950 no fp32
# gamma with a half input either (the torch_npu docs list the mixed form for A2/A3 only)
_310P = SocLimits(dtypes=frozenset({torch.float32, torch.float16}), mixed_gamma=False)


def _norm_dims(x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    # gamma has shape x.shape[n:]; the norm runs over those trailing dims.
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list[int]:
    lead = x.dim() - gamma.dim()
    return [x.shape[i] if i < lead else 1 for i in range(x.dim())]


def _rstd(x32: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    return torch.rsqrt(x32.pow(2).mean(_norm_dims(x32, gamma), keepdim=True) + epsilon)


def _norm_inputs(dtype):
    # (x, gamma) pairs: a norm over the last dim, one over the last two (gamma x.shape[n:]),
    # and fp32 gamma with a half x (the mixed form of A2/A3)
    yield randn(2, 3, 8, dtype=dtype, seed=0), randn(8, dtype=dtype, seed=1)
    yield randn(2, 4, 6, dtype=dtype, seed=2), randn(4, 6, dtype=dtype, seed=3)
    if dtype != torch.float32:
        yield randn(3, 8, dtype=dtype, seed=4), randn(8, dtype=torch.float32, seed=5)


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


def _rms_norm_samples(dtype):
    for x, gamma in _norm_inputs(dtype):
        yield Sample((x, gamma, 1e-6), grad_args=(0, 1))


@op_spec("npu::npu_rms_norm",
         schema="npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
         fake=_rms_norm_fake, backward=_rms_norm_backward, setup_context=_rms_norm_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES, min_rank=1, max_rank=8, backward="npu.npu_rms_norm_backward", ge_converter=True,
             socs={"Ascend310P": _310P, "Ascend950": SocLimits(mixed_gamma=False)},
             doc="torch_npu docs: x 1-8 dims, fp16/bf16/fp32; gamma x.shape[n:], same dtype "
             "(or fp32 with fp16/bf16 x on A2/A3)"),
         samples=_rms_norm_samples)
def npu_rms_norm(self, gamma, epsilon=1e-6):
    # The kernel normalises in fp32 and multiplies gamma in fp32: one rounding at the end
    # (rms_norm.h ComputeMulGammaCast). HF rounds before the gamma multiply: <= 1 ulp apart.
    x32 = self.float()
    rstd = _rstd(x32, gamma, epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


# ---- npu_rms_norm_backward -----------------------------------------------------------
def _rms_norm_backward_fake(dy, self, gamma, rstd):
    return torch.empty_like(self), torch.empty_like(gamma, dtype=torch.float32)


def _rms_norm_backward_samples(dtype):
    for x, gamma in _norm_inputs(dtype):
        _, rstd = npu_rms_norm(x, gamma)
        yield Sample((torch.randn_like(x), x, gamma, rstd))


@op_spec("npu::npu_rms_norm_backward",
         schema="npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)",
         fake=_rms_norm_backward_fake, samples=_rms_norm_backward_samples, sample_dtypes=FLOAT_DTYPES)
def npu_rms_norm_backward(dy, self, gamma, rstd):
    dims = _norm_dims(self, gamma)
    lead = tuple(range(self.dim() - gamma.dim()))
    xhat = self.float() * rstd
    dyg = dy.float() * gamma.float()
    dx = (dyg - xhat * (dyg * xhat).mean(dims, keepdim=True)) * rstd
    dgamma = (dy.float() * xhat).sum(lead) if lead else dy.float() * xhat
    # torch_npu's Meta: empty_like(self) and empty_like(gamma, fp32)
    return in_layout_of(dx.to(self.dtype), self), in_layout_of(dgamma, gamma)


# ---- npu_add_rms_norm ----------------------------------------------------------------
def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    rstd = x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)
    return torch.empty_like(x1), rstd, torch.empty_like(x1)


def _add_rms_norm_samples(dtype):
    for x, gamma in _norm_inputs(dtype):
        yield Sample((x, torch.randn_like(x), gamma, 1e-6))


@op_spec("npu::npu_add_rms_norm",
         schema="npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
         fake=_add_rms_norm_fake,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES, min_rank=1, max_rank=8, backward=None, ge_converter=True, same_shape=("x1", "x2"),
             socs={"Ascend310P": _310P},
             doc="torch_npu docs: x1, x2 same shape, 1-8 dims; no bf16 on Atlas inference (310P); "
             "no autograd (inference graphs only)"),
         samples=_add_rms_norm_samples)
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
# add_rms_norm's finish emits it where y is also read in fp32 (a router's input).
# torchair's own pattern pass (torchair/patterns/add_rms_norm_cast.py) does the same after
# our passes, for a y read by exactly one other node and an fp32 copy read once; the
# stand-in lets that pass run on CPU too (tests/test_torchair_backend.py).
def _add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-6):
    y, rstd, x_out = _add_rms_norm_fake(x1, x2, gamma, epsilon)
    return torch.empty_like(x1, dtype=torch.float32), y, rstd, x_out


@op_spec("npu::npu_add_rms_norm_cast",
         schema="npu_add_rms_norm_cast(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
         "-> (Tensor, Tensor, Tensor, Tensor)",
         fake=_add_rms_norm_cast_fake, samples=_add_rms_norm_samples, sample_dtypes=FLOAT_DTYPES,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}), min_rank=1, max_rank=8, backward=None,
             ge_converter=True, same_shape=("x1", "x2"), socs={"Ascend310P": SocLimits(supported=False)},
             doc="torch_npu docstring (_op_plugin_docs.py npu_add_rms_norm_cast): x1, x2, gamma BFLOAT16 / FLOAT16 "
             "of one dtype, 1-8 dims; y1 FLOAT32, y2 and x in x1's dtype; Atlas A2 / A3; GE converter "
             "custom/npu_add_rms_norm_cast.py; no autograd"))
def npu_add_rms_norm_cast(x1, x2, gamma, epsilon=1e-6):
    # Outputs (y_fp32, y, rstd, x_out), the order torchair's replacement unpacks. y_fp32 is
    # taken as y rounded to x1's dtype and widened, the value of the cast it replaces
    # ([inferred]: the kernel docs do not say whether it is the unrounded product).
    y, rstd, x_out = npu_add_rms_norm(x1, x2, gamma, epsilon)
    return y.to(torch.float32, copy=True), y, rstd, x_out  # a tensor of its own, even for an fp32 y
