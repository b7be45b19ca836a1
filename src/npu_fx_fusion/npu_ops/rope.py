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

from .spec import FLOAT_DTYPES, OpCapability, Sample, SocLimits, in_layout_of, only_on_socs, op_spec, randn

# the CANN ops-transformer extension's products (its docs): Atlas A2, A3 and Ascend 950
_A2_A3_950 = only_on_socs("Ascend910B", "Ascend910_93", "Ascend950")


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


# Output layouts are the wheel's Meta functions' (op_plugin/meta/_meta_registrations.py), which
# the kernels reproduce: npu_rotary_mul torch.empty(shape) (contiguous), its backward and
# npu_interleave_rope torch.empty_like(input) (a transposed input's strides kept).
def rope_tables(shape, dtype=torch.float32, seed=1):
    """cos / sin of random angles of `shape` (the rounded tables are the inputs)."""
    theta = randn(*shape, dtype=torch.float64, seed=seed) * 3
    return theta.cos().to(dtype), theta.sin().to(dtype)


def _rope_inputs(dtype, d=64):
    # x (B, N, S, D) with per-batch tables (B, 1, S, D) broadcast over the heads
    return (randn(2, 3, 4, d, dtype=dtype), *rope_tables((2, 1, 4, d), dtype))


# ---- npu_rotary_mul ------------------------------------------------------------------
def _rotary_mul_fake(self, r1, r2, rotary_mode="half", rotate=None):
    return self.new_empty(self.shape)


def _rotary_mul_samples(dtype):
    for mode in _MODE_PARTS:
        yield Sample((*_rope_inputs(dtype), mode), grad_args=(0, 1, 2))
    # an explicit rotation matrix (no backward: torch_npu has no gradient through `rotate`)
    x, cos, sin = _rope_inputs(dtype, d=16)
    yield Sample((x, cos, sin, "half", randn(16, 16, dtype=dtype, seed=6)))


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


@op_spec("npu::npu_rotary_mul",
         schema="npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> "
                "Tensor",
         fake=_rotary_mul_fake, samples=_rotary_mul_samples,
         backward=_rotary_mul_backward, setup_context=_rotary_mul_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=3,  # TND
             max_rank=4,  # BNSD / BSND / SBND
             backward="npu.npu_rotary_mul_backward",
             ge_converter=True,
             same_shape=("r1", "r2"),
             limits={
                 "modes": ("half", "interleave", "quarter"),
                 "max_head_dim": 896,  # exclusive: D < 896
                 "head_dim_multiple": 2,
                 "max_batch_heads": 1000,  # half: B < 1000 and N < 1000, each (exclusive)
                 "interleave_max_batch_heads": 1000,  # interleave: B * N < 1000 (exclusive)
                 "grad_max_batch_heads": 1024,  # half, r1/r2 needing grads: B * N <= 1024
                 # interleave: r1/r2 are 11SD / 1S1D / S11D / T1D only, no per-batch cos/sin
                 "interleave_per_batch_tables": False,
                 "interleave_mode_socs": ("Ascend910B", "Ascend910_93", "Ascend950"),
                 "quarter_mode_socs": ("Ascend950",),
                 # SoCs with only the jit_compile=True kernel: half mode, 4-D x, D == 128,
                 # B and N <= 1000 (inclusive)
                 "jit_compile_only_socs": ("Ascend310P",),
                 "jit_compile_head_dim": 128,
                 "jit_compile_max_batch_heads": 1000,
                 # torchair before arch35 lowers a call without `rotate` to GE RotaryMul,
                 # which has no mode attribute: under max-autotune only half mode is right
                 "ge_half_only_without_rotate_socs": ("Ascend910B", "Ascend910_93", "Ascend310P"),
                 # ... and the backward to RotaryMulGrad: 4-D, static shapes, D % 64 == 0,
                 # at most 1024 elements over the dims where r1 broadcasts
                 "ge_backward_head_dim_multiple": 64,
                 "ge_backward_max_broadcast": 1024,
             },
             doc="op_semantics 3.1 / torch_npu docs (_op_plugin_docs.py): fp16/bf16/fp32; x 3-D or "
             "4-D; r1/r2 broadcast to x, one shape and dtype; jit_compile=False (A2/A3): D < 896 and "
             "even; half B, N < 1000 and B*N <= 1024 with r1/r2 grads; interleave B*N < 1000 and "
             "11SD-style r1/r2; jit_compile=True (the only kernel listed for Atlas inference, 310P): "
             "half, 4-D, D == 128, B, N <= 1000. quarter only on arch35 (950), per the GE converter "
             "custom/npu_rotary_mul.py, which also maps a call without rotate to the mode-less "
             "RotaryMul on other SoCs; GE backward limits from custom/npu_rotary_mul_backward.py. "
             "`rotate` has no backward",
         ))
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


def _rotary_mul_backward_samples(dtype):
    for mode in _MODE_PARTS:
        x, cos, sin = _rope_inputs(dtype)
        yield Sample((randn(*x.shape, dtype=dtype, seed=7), x, cos, sin, mode))


# ---- npu_rotary_mul_backward ---------------------------------------------------------
def _rotary_mul_backward_fake(grad, self, r1, r2, rotary_mode="half"):
    # Meta: all three in self's dtype, dr1/dr2 shaped like r1/r2.
    return torch.empty_like(self), torch.empty_like(r1, dtype=self.dtype), torch.empty_like(r2, dtype=self.dtype)


@op_spec("npu::npu_rotary_mul_backward",
         schema="npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> "
                "(Tensor, Tensor, Tensor)",
         fake=_rotary_mul_backward_fake, samples=_rotary_mul_backward_samples, sample_dtypes=FLOAT_DTYPES)
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
    return tuple(in_layout_of(t.to(self.dtype), like) for t, like in ((dx, self), (dr1, r1), (dr2, r2)))


# ---- npu_interleave_rope -------------------------------------------------------------
def _interleave_rope_fake(x, cos, sin):
    return torch.empty_like(x)


def _interleave_rope_samples(dtype):
    yield Sample(_rope_inputs(dtype))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...], DeepSeek's view/transpose trick."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@op_spec("npu::npu_interleave_rope",
         schema="npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor",
         fake=_interleave_rope_fake, samples=_interleave_rope_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),
             min_rank=4,  # BNSD
             max_rank=4,
             backward=None,
             ge_converter=True,
             same_shape=("cos", "sin"),
             # documented products: Atlas A2 and A3 only
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "head_dim": 64,  # x, cos and sin: D == 64 exactly
                 "table_heads": 1,  # cos/sin are (B, 1, S or 1, 64)
                 "contiguous": True,
                 # torchair 2.13's InterleaveRope IR (auto_generated_ge_raw_ops.py) lists fp16
                 # inputs only; the op docs say bf16 too. Unconfirmed either way, so a bf16
                 # site under max-autotune takes the exact half-mode alternative instead.
                 "ge_dtypes": (torch.float16,),
             },
             doc="op_semantics 3.3 / torch_npu docs: x (B, N, S, 64) fp16/bf16, contiguous; cos/sin "
             "(B, 1, S or 1, 64), same dtype as x, sin shaped like cos; A2/A3 only (hiascend "
             "torch_npu.npu_interleave_rope page; 950 not covered by those docs); no autograd "
             "(inference graphs only)",
         ))  # no autograd in torch_npu
def npu_interleave_rope(x, cos, sin):
    # Half-mode RoPE of the de-interleaved x; the result is NOT re-interleaved (op_semantics 3.3).
    op = "npu_interleave_rope"
    _check_split(op, x, 2)
    _check_broadcasts_to(op, x, cos, sin)
    acc = _compute_dtype(x)
    q = _deinterleave(x.to(acc))
    return in_layout_of((q * cos.to(acc) + _rot(q, "half") * sin.to(acc)).to(x.dtype), x)


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


def _partial_rotary_samples(dtype):
    # x (B, S, N, D) rotated on its last 8 channels; r1 / r2 one angle per pair, twice (B, S, 1, 8)
    cos, sin = (t.repeat_interleave(2, -1) for t in rope_tables((2, 5, 1, 4), dtype))
    yield Sample((randn(2, 5, 3, 16, dtype=dtype), cos, sin), {"partial_slice": [8, 16]})
    yield Sample((randn(2, 5, 3, 16, dtype=dtype), cos, sin), {"rotary_mode": "interleave", "partial_slice": [0, 8]})


def _partial_rotary_fake(x, r1, r2, *, rotary_mode="interleave", partial_slice=(0, 0)):
    _check_partial_rotary("inplace_partial_rotary_mul", x, r1, r2, rotary_mode, partial_slice)


@op_spec("cann_ops_transformer::inplace_partial_rotary_mul",
         schema='inplace_partial_rotary_mul(Tensor(a!) x, Tensor r1, Tensor r2, *, str rotary_mode="interleave", int[2]'
                " partial_slice=[0, 0]) -> ()",
         fake=_partial_rotary_fake, samples=_partial_rotary_samples,
         python_autograd="cann_ops_transformer.ops.inplace_partial_rotary_mul.InplacePartialRotaryMulFn",
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=4,
             max_rank=4,  # BSND
             backward=None,  # the extension's InplacePartialRotaryMulFn (mark_dirty), mirrored by ours
             autograd_rule="npu_fx_fusion.patterns.rope.InplacePartialRotaryMul",
             ge_converter=True,
             socs=_A2_A3_950,
             limits={
                 "package": "cann_ops_transformer",
                 "ge_converter_source": "ops/graph_convert/graph_convert_inplace_partial_rotary_mul.py "
                                        "(GE InplacePartialRotaryMul)",
                 "backward_op": "cann_ops_transformer.inplace_partial_rotary_mul_backward",
                 "max_head_dim": 1024, "head_dim_multiple": 2, "slice_multiple": 2,
                 "contiguous": True,
                 # r1 / r2 as x's letters (1: broadcast), per SoC
                 "table_layouts_950": ("BSND", "B1ND", "B11D", "111D"),
                 "table_layouts_a2_a3": ("BS1D", "B11D"),
                 # torchtitan-npu's pre-AOT pattern README says "A5 only"; the COT doc and the kernel's
                 # binary configs (ascend910b, ascend910_93, ascend950) list all three
                 "socs_evidence": "COT doc and kernel configs: 950, A2, A3 (torchtitan-npu README: A5 only)",
             },
             doc="deepseek_v4.md 6.2 / COT docs/zh/inplace_partial_rotary_mul.md: x (B, S, N, D) fp16/bf16/fp32, "
             "contiguous, D <= 1024 and even; partial_slice [start, end) of D, even length = r1/r2's last dim; r1/r2 "
             "one dtype, broadcast BSND/B1ND/B11D/111D (950) or BS1D/B11D (A2/A3); in place; training through "
             "InplacePartialRotaryMulFn (no r1/r2 grads); COT GE converter InplacePartialRotaryMul",
         ))
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


@op_spec("cann_ops_transformer::inplace_partial_rotary_mul_backward",
         schema="inplace_partial_rotary_mul_backward(Tensor(a!) grad_output, Tensor r1, Tensor r2, *, str "
                'rotary_mode="interleave", int[2] partial_slice=[0, 0]) -> ()',
         fake=_partial_rotary_backward_fake, samples=_partial_rotary_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES, min_rank=4,
             max_rank=4, backward=None, ge_converter=True, socs=_A2_A3_950,
             limits={"package": "cann_ops_transformer",
                     "ge_converter_source": "ops/graph_convert/graph_convert_inplace_partial_rotary_mul_backward.py "
                                            "(GE InplacePartialRotaryMulGrad)"},
             doc="inplace_partial_rotary_mul's backward: grad_output rotated back in place",
         ))
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
