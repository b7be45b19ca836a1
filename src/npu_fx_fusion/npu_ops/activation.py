"""Activation family: npu_swiglu (+ backward).

Reference semantics: shared/reference/op_semantics.md section 4.1, from the torch_npu docs
and the wheel's inductor decomposition (_inductor/decomposition.py). The FIRST half along
`dim` is the gate that goes through silu, the second half multiplies it: a model whose
gate/up projections are concatenated the other way round does not match this op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import FLOAT_DTYPES, OpCapability, Sample, SocLimits, in_layout_of, only_on_socs, op_spec, randn



def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 as on the NPU; float64 stays float64 so gradcheck can run on the stand-in.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate_and_up(op: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of x along dim, in the compute dtype."""
    if x.shape[dim] % 2:  # chunk would make unequal halves that no longer line up
        raise RuntimeError(f"{op}: dim {dim} must split into two equal halves, it has size {x.shape[dim]}")
    a, b = x.to(_compute_dtype(x)).chunk(2, dim)
    return a, b


# Output layouts are the Meta functions' (the wheel's op_plugin/meta/_meta_registrations.py; the
# cann_ops_nn extension's register_meta, hicann/ops-nn torch_extension/cann_ops_nn/ops/activation/
# swiglu_group*/): torch.empty / new_empty (contiguous) everywhere but npu_swiglu_backward, whose
# torch.empty_like(x) keeps x's strides. The kernels return those layouts.


# ---- npu_swiglu ----------------------------------------------------------------------
def _swiglu_samples(dtype):
    x = randn(2, 3, 4, 64, dtype=dtype)
    yield Sample((x, -1), grad_args=(0,))
    yield Sample((x, 2), grad_args=(0,))  # the halves along another dim


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


@op_spec("npu::npu_swiglu",
         schema="npu_swiglu(Tensor self, int dim=-1) -> Tensor",
         fake=_swiglu_fake, samples=_swiglu_samples,
         backward=_swiglu_backward, setup_context=_swiglu_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=1,
             max_rank=8,
             backward="npu.npu_swiglu_backward",
             ge_converter=True,
             # documented products: Atlas A2 (and A3 in the performance-tuning guide)
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "split_dim_multiple": 2,  # self.size(dim) even
                 "contiguous": True,
                 "empty": False,  # no empty tensors
             },
             doc="op_semantics 4.1 / torch_npu docs: fp32/fp16/bf16, 1-8 dims, size(dim) even, "
             "contiguous and non-empty; the first half is the gate; products A2/A3 (torch_npu "
             "docs and the hiascend SwiGlu tuning guide; 950 not covered by those docs)",
         ))
def npu_swiglu(self, dim=-1):
    # silu and the product in fp32, one rounding at the end (the documented reference).
    a, b = _gate_and_up("npu_swiglu", self, dim)
    return (F.silu(a) * b).to(self.dtype).contiguous()


# ---- npu_swiglu_backward -------------------------------------------------------------
def _swiglu_backward_fake(grad_output, self, dim=-1):
    return torch.empty_like(self)


def _swiglu_backward_samples(dtype):
    x = randn(2, 3, 4, 64, dtype=dtype)
    yield Sample((randn(2, 3, 4, 32, dtype=dtype, seed=1), x, -1))
    yield Sample((randn(2, 3, 2, 64, dtype=dtype, seed=2), x, 2))


@op_spec("npu::npu_swiglu_backward",
         schema="npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
         fake=_swiglu_backward_fake, samples=_swiglu_backward_samples, sample_dtypes=FLOAT_DTYPES)
def npu_swiglu_backward(grad_output, self, dim=-1):
    # d silu(a)/da = s * (1 + a * (1 - s)) with s = sigmoid(a); d(silu(a) * b)/db = silu(a).
    a, b = _gate_and_up("npu_swiglu_backward", self, dim)
    g = grad_output.to(a.dtype)
    s = torch.sigmoid(a)
    grad_a = g * b * s * (1 + a * (1 - s))
    grad_b = g * a * s
    return in_layout_of(torch.cat((grad_a, grad_b), dim).to(self.dtype), self)


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


def _clipped_swiglu_samples(dtype):
    x = randn(6, 16, dtype=dtype) * 4  # some values past the limit
    yield Sample((x,))
    yield Sample((x,), {"interleaved": False, "limit": 3.0, "alpha": 1.0, "bias": 0.5})
    yield Sample((x,), {"group_index": torch.tensor([3, 2])})  # rows past the first 5 not computed


def _clipped_swiglu_fake(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2  # the wheel's Meta: floor(size / 2)
    return x.new_empty(shape)


@op_spec("npu::npu_clipped_swiglu",
         schema="npu_clipped_swiglu(Tensor x, *, Tensor? group_index=None, int dim=-1, float alpha=1.702, float "
                "limit=7.0, float bias=1.0, bool interleaved=True) -> Tensor",
         fake=_clipped_swiglu_fake, samples=_clipped_swiglu_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,
             max_rank=8,
             backward=None,  # none in torch_npu: inference only
             ge_converter=True,  # custom/npu_clipped_swiglu.py -> GE ClippedSwiglu
             # torch_npu's docstring lists Atlas A2 / A3 inference series only (ops-nn ships kernel
             # configs for ascend950 too; the torch_npu API's docs are followed)
             socs=only_on_socs("Ascend910B", "Ascend910_93"),
             limits={"contiguous": True, "group_index_dtype": torch.int64},
             doc="deepseek_v4.md 12.3 / torch_npu docstring npu_clipped_swiglu: fp16/bf16/fp32, > 1 dim, contiguous, "
             "dim even; A = min(A, limit), B = clamp(B, -limit, limit), y = A sigmoid(alpha A) (B + bias), halves or "
             "even/odd; Atlas A2/A3 inference series; no autograd; GE converter ClippedSwiglu",
         ))  # no autograd in torch_npu
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


def _swiglu_group_inputs(dtype):
    # 12 tokens of a fused gate/up projection, one fp32 routed score per token, 3 + 4 + 2 of
    # them in groups (the last 3 rows past the groups)
    return randn(12, 16, dtype=dtype) * 3, randn(12, dtype=torch.float32, seed=1).abs(), torch.tensor([3, 4, 2])


def _swiglu_group_samples(dtype):
    x, weight, groups = _swiglu_group_inputs(dtype)
    yield Sample((x,))
    yield Sample((x,), {"weight": weight, "group_index": groups, "clamp_limit": 2.0})


def _swiglu_group_fake(x, *, weight=None, group_index=None, clamp_limit=-1.0):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@op_spec("cann_ops_nn::swiglu_group",
         schema="swiglu_group(Tensor x, *, Tensor? weight=None, Tensor? group_index=None, float clamp_limit=-1.0) -> "
                "Tensor",
         fake=_swiglu_group_fake, samples=_swiglu_group_samples,
         python_autograd="cann_ops_nn swiglu_group.SwigluGroupFn (activation/swiglu_group/torch_extension)",
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=1,
             max_rank=8,
             backward=None,  # SwigluGroupFn in the extension, mirrored by ours (swiglu_group_backward)
             autograd_rule="npu_fx_fusion.patterns.swiglu_group.SwigluGroup",
             ge_converter=False,  # CON has converters for the backward and the quant ops, not this one
             socs=only_on_socs("Ascend950"),
             limits={"package": "cann_ops_nn", "backward_op": "cann_ops_nn.swiglu_group_backward",
                     "weight_dtype": torch.float32, "contiguous": True, "clamp_off": -1.0},
             doc="deepseek_v4.md 12.2 / CON aclnnSwigluGroup.md and activation/swiglu_group/torch_extension/"
             "swiglu_group.py: Ascend 950 only; x fp16/bf16/fp32 1-8 dims, contiguous; weight fp32, one per row; "
             "clamp_limit > 0 clamps the gate above and up both ways (-1.0: off); training through SwigluGroupFn "
             "(swiglu_group_backward); no forward GE converter found",
         ))
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


def _swiglu_group_backward_samples(dtype):
    x, weight, groups = _swiglu_group_inputs(dtype)
    grad = randn(12, 8, dtype=dtype, seed=2)
    yield Sample((grad, x))
    yield Sample((grad, x), {"weight": weight, "y_origin": swiglu_group(x, group_index=groups, clamp_limit=2.0),
                             "group_index": groups, "clamp_limit": 2.0})


def _swiglu_group_backward_fake(grad_output, x, *, weight=None, y_origin=None, group_index=None, clamp_limit=0.0):
    grad_weight = weight.new_empty(weight.shape, dtype=torch.float32) if weight is not None else x.new_empty((0,))
    return grad_output.new_empty(x.shape), grad_weight


@op_spec("cann_ops_nn::swiglu_group_backward",
         schema="swiglu_group_backward(Tensor grad_output, Tensor x, *, Tensor? weight=None, Tensor? y_origin=None, "
                "Tensor? group_index=None, float clamp_limit=0.0) -> (Tensor, Tensor?)",
         fake=_swiglu_group_backward_fake, samples=_swiglu_group_backward_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES, min_rank=2, max_rank=3, backward=None,
             ge_converter=True, socs=only_on_socs("Ascend950"),
             limits={"package": "cann_ops_nn",
                     "ge_converter_source": "torch_extension/cann_ops_nn/ops/activation/swiglu_group_backward/"
                                            "graph_convert_swiglu_group_backward.py"},
             doc="CON swiglu_group_backward.md: grad_output / x 2-D or 3-D, weight (.., 1) fp32 with y_origin (the "
             "unweighted forward), clamp_limit >= 0 (0: off), open-interval clamp masks; Ascend 950",
         ))
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
