"""NPU dispatch in emulation: the aot graph an NPU compile holds, traced on CPU.

On an Ascend NPU, torch_npu registers kernels for some CompositeImplicitAutograd aten ops
at its device keys (PrivateUse1, AutogradPrivateUse1), and torchair adds Python kernels
of its own. A composite op decomposes in an aot graph only where autograd would have
decomposed it; a device-key kernel pre-empts that, and the graph records what the kernel
calls instead (shared/reference/attention_inference.md 2.2 and 10.2). So the same model
traces into other ops on an NPU: `scaled_dot_product_attention` into
`npu_fusion_attention_v3`, `matmul` stays `aten.matmul`, `softmax(x, dtype=)` casts with
`npu._npu_dtype_cast` ... The inventory of those overrides, with the evidence for each
row, is dispatch_inventory.OVERRIDES; docs/npu-graph.md explains it.

`emulated(soc)` registers, for as long as it is active, the same overrides at the CPU and
AutogradCPU keys: Python kernels that mirror each torch_npu kernel's decision tree and call
what it calls (the stand-in npu ops of npu_ops/ where it calls npu ops). torch's dispatcher
then makes exactly the decisions it makes on an NPU, and the CPU aot graph is the NPU's.
Registrations are torch.library "aten" IMPL fragments, destroyed on exit, plus torchair's
Python-dispatcher kernels (`py_impl`), removed on exit; the Python dispatcher's per-op
caches are cleared both ways. Nothing stays visible to eager code after exit.

The emulation backend (backend.EmulationBackend) traces under it by default
(FusionConfig.npu_dispatch) and suspends it while the passes run; the pattern matcher traces
every form a second time under it (without the SoC-dependent SDPA override), so a pattern
written once in model code's spelling matches both graphs.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch._C import DispatchKey

log = logging.getLogger("npu_fx_fusion.npu_dispatch")

aten = torch.ops.aten

DEFAULT_SOC = "Ascend910B"  # what the emulation dispatches for when FusionConfig.soc is None

# c10_npu::SocVersion of each SoC family in capabilities.SOCS: the value torch_npu's kernels
# compare (torch_npu/csrc/core/npu/NpuVariables.h in Ascend/pytorch; the wheel's
# _inductor/config.py:29-32 repeats 220, 250 and 260). A family's lowest member.
SOC_VERSIONS = {"Ascend310P": 200, "Ascend910B": 220, "Ascend910_93": 250, "Ascend950": 260}
ASCEND910B1, ASCEND950 = 220, 260

# op-plugin ScaledDotProductAttentionKernelNpuOpApi.cpp (V2R5+ branch, torch >= 2.5)
_TOKEN_MAX = 2147483647
_ATTENMASK_LIMIT = 2048
_N_LIMIT = 2048
_D_LIMIT = 512
_LEFT_UP_CAUSAL = 2


def soc_version(soc: Optional[str]) -> int:
    soc = soc or DEFAULT_SOC
    try:
        return SOC_VERSIONS[soc]
    except KeyError:
        raise ValueError(f"no c10_npu SocVersion known for {soc!r}; known: {', '.join(SOC_VERSIONS)}") from None


# =====================================================================================
# The kernels: each mirrors the torch_npu kernel named in its docstring
# =====================================================================================
def _has_python_key(t: torch.Tensor) -> bool:
    """A fake / functional / meta tensor, as op-plugin's kernels test for it
    (`key_set().has_all(DispatchKeySet(DispatchKey::Python)) || is_meta()`)."""
    return torch._C._dispatch_keys(t).has(DispatchKey.Python) or t.is_meta  # noqa: SLF001


def _sdpa_math_mask(attn_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """convert_boolean_attn_mask_math: a bool mask (True = attend) as an additive float mask."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros_like(attn_mask, dtype=dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))


def _sdpa_preprocess_mask(mask: Optional[torch.Tensor], query, key) -> Optional[torch.Tensor]:
    """preprocess_attn_mask_for_npu: pre-expand to (B, N, Sq, Skv) only a mask that broadcasts
    to it and is not already SS, B1SS / BNSS or 11SS."""
    if mask is None:
        return None
    b, n, sq, skv = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if not 2 <= mask.dim() <= 4:
        return mask
    target = (b, n, sq, skv)[4 - mask.dim():]
    if any(size != t and size != 1 for size, t in zip(mask.shape, target)):
        return mask
    if mask.dim() == 2:
        supported = mask.shape[0] == sq and mask.shape[1] == skv
    elif mask.dim() == 4:
        supported = mask.shape[2] == sq and mask.shape[3] == skv and (
            (mask.shape[0] == b and mask.shape[1] in (n, 1)) or (mask.shape[0] == 1 and mask.shape[1] == 1))
    else:
        supported = False
    return mask if supported else mask.expand(b, n, sq, skv)


def _sdpa_npu_mask(query, mask: Optional[torch.Tensor], is_causal: bool) -> Optional[torch.Tensor]:
    """convert_boolean_attn_mask: Ascend's convention, True = masked out."""
    if mask is None and not is_causal:
        return None
    if is_causal:
        if mask is not None:
            raise RuntimeError("The attn_mask should be none when is_causal is true")
        ones = torch.ones(_ATTENMASK_LIMIT, _ATTENMASK_LIMIT, dtype=torch.bool, device=query.device)
        return torch.triu(ones, 1)
    return torch.logical_not(mask)


def make_sdpa(soc: Optional[str]) -> Callable:
    """op-plugin's scaled_dot_product_attention (V2R5 branch), which torch_npu registers at
    PrivateUse1 and AutogradPrivateUse1 (wrapper_NPU__ / wrapper_AutogradNPU__scaled_dot_product_attention).

    1. fp32 with any head dim % 4 != 0: the math path (`_scaled_dot_product_attention_math`,
       a bool mask first made additive).
    2. FlashAttention (no condition on grad): fp16/bf16/fp32, bool mask or none, q/k/v 4-D,
       Nq, Nkv <= 2048, Dq <= 512, Nq % Nkv == 0, SoC >= Ascend910B1 -> the mask as Ascend's
       (`ones`/`triu` for is_causal with sparse_mode 2, `logical_not` of a bool mask with
       sparse_mode 0, inner_precise 2 for a mask over Sq > 1), then npu_fusion_attention_v3
       below Ascend950, npu_fusion_attention on it; output 0. enable_gqa is not passed: FA
       takes Nkv < Nq itself.
    3. The FIA branch (npu_fused_infer_attention_score) admits only inputs branch 2 takes
       already: unreachable, not reproduced.
    4. Otherwise the math path. `force_math` (env CheckCompatibleImpl, off by default) is
       not reproduced.
    """
    version = soc_version(soc)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                     scale=None, enable_gqa=False):
        # validate_sdpa_input
        if not (query.dtype == key.dtype == value.dtype):
            raise RuntimeError("Expected query, key, and value to have the same dtype")
        if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
            raise RuntimeError("Expected attn_mask dtype to be bool or to match query dtype")
        if query.dtype == torch.float32 and (query.shape[-1] % 4 or key.shape[-1] % 4 or value.shape[-1] % 4):
            return aten._scaled_dot_product_attention_math(
                query, key, value, _sdpa_math_mask(attn_mask, query.dtype), dropout_p, is_causal, None,
                scale=scale, enable_gqa=enable_gqa)[0]
        flash = (query.dtype in (torch.float16, torch.bfloat16, torch.float32)
                 and (attn_mask is None or attn_mask.dtype == torch.bool)
                 and query.dim() == key.dim() == value.dim() == 4
                 and query.shape[1] <= _N_LIMIT and query.shape[3] <= _D_LIMIT and key.shape[1] <= _N_LIMIT
                 and query.shape[1] % key.shape[1] == 0 and query.shape[1] // key.shape[1] > 0
                 and version >= ASCEND910B1)
        if not flash:
            return aten._scaled_dot_product_attention_math(
                query, key, value, _sdpa_math_mask(attn_mask, query.dtype), dropout_p, is_causal, None,
                scale=scale, enable_gqa=enable_gqa)[0]
        atten_mask = _sdpa_npu_mask(query, _sdpa_preprocess_mask(attn_mask, query, key), is_causal)
        head_num = query.shape[1]
        # calculate_scale: SymFloat(1.0) / SymFloat(D).sqrt(), in double
        input_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        keep_prob = 1 - dropout_p
        next_tockens = 0 if is_causal else _TOKEN_MAX
        sparse_mode = _LEFT_UP_CAUSAL if is_causal else 0
        # calculate_inner_precise_for_fa: the caller's mask (before preprocessing) counts
        inner_precise = 2 if (not is_causal and query.shape[2] > 1 and attn_mask is not None) else 0
        fused = torch.ops.npu.npu_fusion_attention_v3 if version < ASCEND950 else torch.ops.npu.npu_fusion_attention
        return fused(query, key, value, head_num, "BNSD", None, None, atten_mask, input_scale, keep_prob,
                     _TOKEN_MAX, next_tockens, inner_precise, None, None, None, sparse_mode, True, False)[0]

    return scaled_dot_product_attention


def softmax(self, dim, dtype=None):
    """op_api::softmax (SoftmaxKernelNpuOpApi.cpp): a dtype different from the input's is a
    `custom_ops::_npu_dtype_cast`, where CPU's composite calls `toType` (aten._to_copy)."""
    converted = self
    if dtype is not None and self.dtype != dtype:
        converted = torch.ops.npu._npu_dtype_cast(self, dtype)
    return aten._softmax(converted, dim, False)


def one_hot(self, num_classes=-1):
    """op_api::one_hot (OneHotKernelNpuOpApi.cpp): on a fake or meta tensor (tracing)
    `eq(self.unsqueeze(-1), arange(num_classes)).to(long)`; on a real one the aclnnOneHot
    kernel, which computes what the composite does."""
    if _has_python_key(self):
        if num_classes == -1:
            raise RuntimeError("FakeTensorMode does not support num_classes == -1.")
        index = torch.arange(num_classes, dtype=torch.long, device=self.device)
        return torch.eq(self.unsqueeze(-1), index).to(torch.long)
    return aten.one_hot.default.decompose(self, num_classes)


def argsort(self, dim=-1, descending=False):
    """op_api::argsort: `std::get<1>(at::sort(self, dim, descending))`."""
    return aten.sort.default(self, dim, descending)[1]


def argsort_stable(self, *, stable, dim=-1, descending=False):
    """op_api::argsort (stable overload): `std::get<1>(at::sort(self, stable, dim, descending))`."""
    return aten.sort.stable(self, stable=stable, dim=dim, descending=descending)[1]


def contiguous(self, *, memory_format=torch.contiguous_format):
    """NPUNativeFunctions::contiguous (Ascend/pytorch TensorProperties.cpp; the wheel holds its
    message "NPU contiguous operator only supported contiguous memory format.")."""
    if self.is_contiguous(memory_format=memory_format):
        return self
    if memory_format != torch.contiguous_format:
        raise RuntimeError("NPU contiguous operator only supported contiguous memory format.")
    return self.clone(memory_format=memory_format)


def where(condition):
    """op_api::where(condition): `at::native::where(condition)`, the composite itself."""
    return aten.nonzero_numpy.default(condition)


def log_sigmoid(self):
    """op_api::log_sigmoid: `std::get<0>(at::log_sigmoid_forward(self))`."""
    return aten.log_sigmoid_forward.default(self)[0]


def weight_norm(v_in, g_in, dim=0):
    """op_api::_weight_norm (WeightNormKernelNpuOpApi.cpp): always
    `v * g.div(norm_except_dim(v, 2, dim))`; CPU's composite calls the fused
    `_weight_norm_interface` for dim 0 / last."""
    v, g = v_in.contiguous(), g_in.contiguous()
    return v * g.div(aten.norm_except_dim.default(v, 2, dim))


def adaptive_avg_pool2d(self, output_size):
    """op_api::adaptive_avg_pool2d: a 1x1 output is `mean([-1, -2], keepdim)`, else
    `at::_adaptive_avg_pool2d`."""
    if not self.is_quantized and output_size[0] == 1 and output_size[1] == 1:
        return self.mean([-1, -2], keepdim=True)
    return aten._adaptive_avg_pool2d.default(self, output_size)


def multilabel_margin_loss(self, target, reduction=1):
    """op_api::multilabel_margin_loss: `std::get<0>(at::multilabel_margin_loss_forward(...))`."""
    return aten.multilabel_margin_loss_forward.default(self, target, reduction)[0]


def pdist(self, p=2.0):
    """op_api::pdist: `at::_pdist_forward(self, p)` (CPU's composite makes self contiguous first)."""
    return aten._pdist_forward.default(self, p)


def fft_fftshift(self, dim=None):
    """op_api::fft_fftshift: `at::roll_symint(self, sizes[d] / 2, dims)` (a ComplexFloat input
    is rolled through an int64 reinterpretation of its storage, which is not reproduced)."""
    return _roll_half(self, dim, lambda n: n // 2)


def fft_ifftshift(self, dim=None):
    """op_api::fft_ifftshift: the same with a shift of (size + 1) / 2."""
    return _roll_half(self, dim, lambda n: (n + 1) // 2)


def _roll_half(self, dim, shift_of):
    if self.dtype == torch.complex64:
        raise NotImplementedError("fft shifts of ComplexFloat roll an int64 view of the storage on an NPU, "
                                  "which the emulation does not reproduce")
    dims = list(range(self.dim())) if dim is None else [d % self.dim() for d in dim]
    return aten.roll.default(self, [shift_of(self.shape[d]) for d in dims], dims)


def ior(self, other):
    """op_api::__ior__: `self.bitwise_or_(other)`."""
    return self.bitwise_or_(other)


def composite(op: torch._ops.OpOverload) -> Callable:
    """A backend kernel that computes the op by its CompositeImplicitAutograd decomposition:
    what torch_npu's own kernel computes, for ops whose NPU registration matters only for
    which op the graph records (the op then appears undecomposed, as on an NPU)."""

    def kernel(*args, **kwargs):
        return op.decompose(*args, **kwargs)

    kernel.__name__ = f"{op._schema.name.split('::')[-1]}_composite"  # noqa: SLF001
    return kernel


def matmul_backward(grad, self, other, mask):
    """aten::matmul_backward, which torch_npu implements at PrivateUse1 (wrapper_NPU__matmul_backward)
    and CPU lacks: the gradients of matmul(self, other) for the inputs `mask` selects.

    The mm / bmm products CPU's autograd computes through matmul's decomposition, so the
    emulated gradients round as CPU's do: an N-D input against a matrix (a projection) is
    folded into one 2-D product, as matmul folds it forward (torchair's decomposition folds
    the same way); otherwise the batched product, summed over broadcast dims. Also the
    CompositeImplicitAutograd kernel torchair registers (register_matmul_backward_decomp),
    which fake tensors evaluate."""
    a = self.unsqueeze(0) if self.dim() == 1 else self
    b = other.unsqueeze(-1) if other.dim() == 1 else other
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    g = grad.reshape(*batch, a.shape[-2], b.shape[-1])
    grad_a = grad_b = None
    if a.dim() >= 3 and b.dim() == 2:  # fold a's batch into its rows
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        grad_a = g2.mm(b.t()).reshape(a.shape) if mask[0] else None
        grad_b = a2.t().mm(g2) if mask[1] else None
    elif a.dim() == 2 and b.dim() >= 3:  # fold b's batch into its columns (transposed)
        gt = g.transpose(-1, -2).reshape(-1, g.shape[-2])
        bt = b.transpose(-1, -2).reshape(-1, b.shape[-2])
        grad_a = gt.t().mm(bt) if mask[0] else None
        grad_b = gt.mm(a).reshape(*b.shape[:-2], b.shape[-1], b.shape[-2]).transpose(-1, -2) if mask[1] else None
    else:
        grad_a = torch.matmul(g, b.transpose(-1, -2)).sum_to_size(a.shape) if mask[0] else None
        grad_b = torch.matmul(a.transpose(-1, -2), g).sum_to_size(b.shape) if mask[1] else None
    return (None if grad_a is None else grad_a.reshape(self.shape),
            None if grad_b is None else grad_b.reshape(other.shape))


# ---- the aten ops torch_npu differentiates itself (op-plugin derivatives.yaml) ----------------
# Each backward below is `backward(ctx, grad) -> gradients of the positional inputs` and
# records the ops the op's formula names; the forward is the op itself, below autograd.
def _save_inputs(ctx, inputs, output, keyword_only_inputs=None):
    # the formulas read inputs, keyword-only inputs and the result (ints and tensors alike)
    ctx.inputs = inputs
    ctx.keyword_only_inputs = keyword_only_inputs or {}
    ctx.output = output


def _repeat_interleave_int_backward(ctx, grad):
    self, repeats, dim = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    return torch.ops.npu.repeat_interleave_backward_int(grad, self, repeats, dim), None, None


def _repeat_interleave_tensor_backward(ctx, grad):
    self, repeats, dim = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    return torch.ops.npu.repeat_interleave_backward_tensor(grad, self, repeats, dim), None, None


def _kl_div_backward(ctx, grad):
    self, target, reduction = ctx.inputs
    log_target = ctx.keyword_only_inputs.get("log_target", False)
    return (torch.ops.npu.kl_div_backward(grad, self, target, reduction, log_target=log_target),
            torch.ops.npu.kl_div_target_backward(grad, self, target, reduction, log_target=log_target), None)


def _l1_loss_backward(ctx, grad):
    self, target, reduction = ctx.inputs
    grad_self = torch.ops.npu.l1_loss_backward(grad, self, target, reduction)
    return grad_self, torch.ops.npu.l1_loss_backward(grad, self, target, reduction) * -1, None


def _cdist_backward(ctx, grad):
    x1, x2, p = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    result = ctx.output
    return (aten._cdist_backward.default(grad, x1, x2, p, result),
            aten._cdist_backward.default(grad.mT.contiguous(), x2, x1, p, result.mT.contiguous()), None, None)


def _inverse_backward(ctx, grad):
    result = ctx.output
    return (-torch.matmul(result.mH, torch.matmul(grad, result.mH)),)


def _linalg_cholesky_backward(ctx, grad):
    # cholesky_backward(grad, upper, result): torch's FunctionsManual helper, which op-plugin's
    # formula names too (Iain Murray 2016, arXiv 1602.07527)
    upper = ctx.keyword_only_inputs.get("upper", False)
    chol, g = ctx.output, grad
    if upper:
        chol, g = chol.mH, g.mH
    grad_a = torch.matmul(chol.mH, g).tril()
    grad_a = 0.5 * (grad_a + grad_a.tril(-1).mH)
    grad_a = torch.linalg.solve_triangular(chol.mH, grad_a, upper=True, left=True)
    grad_a = torch.linalg.solve_triangular(chol, grad_a, upper=False, left=False)
    return (grad_a,)


def _stft_backward(ctx, grad):
    raise NotImplementedError("stft on an NPU differentiates through npu.stft_backward, which has no CPU "
                              "stand-in: the emulated training graph cannot be built")


NPU_AUTOGRAD: dict[str, Callable] = {
    "repeat_interleave.self_int": _repeat_interleave_int_backward,
    "repeat_interleave.self_Tensor": _repeat_interleave_tensor_backward,
    "kl_div": _kl_div_backward,
    "l1_loss": _l1_loss_backward,
    "cdist": _cdist_backward,
    "inverse": _inverse_backward,
    "linalg_cholesky": _linalg_cholesky_backward,
    "stft": _stft_backward,
}


def _autograd_kernel(op: torch._ops.OpOverload, backward: Callable) -> Callable:
    """The AutogradCPU kernel of `op` with op-plugin's formula `backward`: torch.library's own
    generated autograd.Function (the forward redispatches below autograd to the CPU kernel,
    so the graph records `op` itself), as npu_ops/_library.py builds it for stand-ins."""
    impl = torch._library.autograd  # noqa: SLF001 - torch 2.13 private API, the version is pinned
    return impl.make_autograd_impl(op, impl.Info(backward, _save_inputs))


# =====================================================================================
# NPU autocast (dispatch_inventory.AUTOCAST): the dtypes torch_npu's autocast takes and its op lists
# =====================================================================================
def npu_autocast_dtypes(soc: Optional[str]) -> tuple[torch.dtype, ...]:
    """get_amp_supported_dtype() of torch_npu (the wheel's torch_npu/npu/autocast_utils.py:8-11):
    fp16 and fp32, and bf16 where c10_npu::IsBF16Supported() (SocVersion >= Ascend910B1)."""
    if soc_version(soc) >= ASCEND910B1:
        return torch.float16, torch.bfloat16, torch.float32
    return torch.float16, torch.float32


_AUTOCAST_DEVICE = "cpu"  # the device the emulation stands the NPU in for
_NPU_AUTOCAST_DEFAULT_DTYPE = torch.float16  # torch.get_autocast_dtype of a PrivateUse1 device
_BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                   "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                   "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                   "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                   "safe to autocast.")


def _autocast_eligible(value: Any) -> bool:
    """at::autocast::is_eligible: a floating tensor of the autocast's device, not fp64."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64
            and value.device.type == _AUTOCAST_DEVICE)


def _cast_eligible(value: Any, dtype: torch.dtype) -> Any:
    """at::autocast::cached_cast over an argument (a tensor, or a list of them)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_eligible(v, dtype) for v in value)
    return value.to(dtype) if _autocast_eligible(value) else value


def _promoted_dtype(values: Sequence[Any]) -> torch.dtype:
    """at::autocast::promote_type: the autocast dtype, widened to fp32 by an fp32 input."""
    dtype = torch.get_autocast_dtype(_AUTOCAST_DEVICE)
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if _autocast_eligible(t) and t.dtype == torch.float32:
                dtype = torch.float32
    return dtype


def _first_arg_eligible(args: Sequence[Any]) -> bool:
    return bool(args) and _autocast_eligible(args[0])


def _with_dtype(op: torch._ops.OpOverload, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """set_opt_dtype: the op's optional `dtype` argument set to `dtype` unless given."""
    names = [a.name for a in op._schema.arguments]  # noqa: SLF001
    position = names.index("dtype")
    if position < len(args):
        if args[position] is None:
            args = (*args[:position], dtype, *args[position + 1:])
        return args, kwargs
    if kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": dtype}
    return args, kwargs


# fp32_append_dtype: the overload with a trailing dtype argument each op is redispatched to
_WITH_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}


def autocast_kernel(op_name: str, policy: str) -> Callable:
    """The AutocastCPU kernel of `op_name` under at::autocast's `policy`, as torch_npu registers
    it at AutocastPrivateUse1 (KERNEL_PRIVATEUSEONE): the casts, then the op below autocast."""
    op = _overload(op_name)
    below_autocast = torch._C.DispatchKeySet(DispatchKey.AutocastCPU)  # noqa: SLF001

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below_autocast):  # noqa: SLF001
            if policy == "banned":
                raise RuntimeError(_BANNED_MESSAGE)
            if policy in ("lower_precision_fp", "fp32", "promote"):
                dtype = {"lower_precision_fp": torch.get_autocast_dtype(_AUTOCAST_DEVICE),
                         "fp32": torch.float32}.get(policy) or _promoted_dtype((*args, *kwargs.values()))
                return op(*_cast_eligible(args, dtype), **{k: _cast_eligible(v, dtype) for k, v in kwargs.items()})
            if not _first_arg_eligible(args):
                return op(*args, **kwargs)
            if policy == "fp32_set_opt_dtype":
                args, kwargs = _with_dtype(op, args, kwargs, torch.float32)
                return op(*args, **kwargs)
            return _overload(_WITH_DTYPE[op_name])(*args, **kwargs, dtype=torch.float32)  # fp32_append_dtype

    kernel.__name__ = f"npu_autocast_{policy}_{op_name.replace('.', '_')}"
    return kernel


def _npu_autocast_init(original: Callable, soc: str) -> Callable:
    """torch.autocast.__init__ while the emulation is active: for the emulated device, torch_npu's
    rule for which dtypes an autocast takes (and its default dtype) instead of CPU's."""

    @functools.wraps(original)
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):  # noqa: N807
        if device_type != _AUTOCAST_DEVICE:
            return original(self, device_type, dtype, enabled, cache_enabled)
        dtype = _NPU_AUTOCAST_DEFAULT_DTYPE if dtype is None else dtype
        original(self, device_type, dtype, False, cache_enabled)  # CPU's dtype check skipped, torch_npu's applied
        supported = npu_autocast_dtypes(soc)
        if enabled and dtype not in supported:
            import warnings

            warnings.warn(f"In npu autocast, but the target dtype is not supported. Disabling autocast.\n"
                          f"npu Autocast only supports dtypes of {', '.join(map(str, supported))} currently.",
                          stacklevel=2)
            enabled = False
        self._enabled = enabled
        if enabled and active() is not None:
            active().register_autocast_kernels()

    return __init__


# =====================================================================================
# The emulation
# =====================================================================================
@dataclass(frozen=True)
class Registration:
    """One kernel: `op` ("softmax.int") at `keys`; `make(soc)` builds it. `with_keyset`: the
    kernel takes the dispatch keyset first (torch.library's generated autograd kernels)."""

    op: str
    keys: tuple[str, ...]
    make: Callable[[Optional[str]], Callable]
    with_keyset: bool = False
    soc_dependent: bool = False

    @property
    def overload(self) -> torch._ops.OpOverload:
        name, _, overload = self.op.partition(".")
        return getattr(getattr(aten, name), overload or "default")


BOTH = ("CPU", "AutogradCPU")  # torch_npu registers the op_api kernel at PrivateUse1 and AutogradPrivateUse1
BACKEND = ("CPU",)  # PrivateUse1 only: autograd comes from torch's or op-plugin's formula


def _fixed(kernel: Callable) -> Callable[[Optional[str]], Callable]:
    return lambda soc: kernel


def _composite_of(op: str) -> Callable[[Optional[str]], Callable]:
    def make(soc):
        name, _, overload = op.partition(".")
        return composite(getattr(getattr(aten, name), overload or "default"))
    return make


def _npu_autograd(op: str) -> Callable[[Optional[str]], Callable]:
    def make(soc):
        name, _, overload = op.partition(".")
        return _autograd_kernel(getattr(getattr(aten, name), overload or "default"), NPU_AUTOGRAD[op])
    return make


# What the emulation registers: the rows of dispatch_inventory.OVERRIDES marked `emulated`
# (tests/test_npu_dispatch.py checks the two agree). Kernels registered at BOTH keys mirror
# torch_npu's wrapper_NPU_ / wrapper_AutogradNPU_ pair; a BACKEND kernel with an
# "AutogradCPU" twin from _npu_autograd mirrors an op op-plugin differentiates itself.
REGISTRATIONS: tuple[Registration, ...] = (
    Registration("scaled_dot_product_attention", BOTH, make_sdpa, soc_dependent=True),
    Registration("softmax.int", BOTH, _fixed(softmax)),
    Registration("one_hot", BOTH, _fixed(one_hot)),
    Registration("argsort", BOTH, _fixed(argsort)),
    Registration("argsort.stable", BOTH, _fixed(argsort_stable)),
    Registration("contiguous", BOTH, _fixed(contiguous)),
    Registration("where", BOTH, _fixed(where)),
    Registration("log_sigmoid", BOTH, _fixed(log_sigmoid)),
    Registration("_weight_norm", BOTH, _fixed(weight_norm)),
    Registration("adaptive_avg_pool2d", BOTH, _fixed(adaptive_avg_pool2d)),
    Registration("multilabel_margin_loss", BOTH, _fixed(multilabel_margin_loss)),
    Registration("pdist", BOTH, _fixed(pdist)),
    Registration("fft_fftshift", BOTH, _fixed(fft_fftshift)),
    Registration("fft_ifftshift", BOTH, _fixed(fft_ifftshift)),
    Registration("__ior__.Tensor", BOTH, _fixed(ior)),
    Registration("__ior__.Scalar", BOTH, _fixed(ior)),
    # PrivateUse1 kernels; matmul's autograd is torch's own MatmulBackward0, whose formula
    # (matmul_backward(grad, self, other, grad_input_mask)) is op-plugin's too
    Registration("matmul", BACKEND, _composite_of("matmul")),
    Registration("matmul_backward", BACKEND, _fixed(matmul_backward)),
    Registration("isclose", BACKEND, _composite_of("isclose")),
    Registration("isfinite", BACKEND, _composite_of("isfinite")),
    *(reg for op in NPU_AUTOGRAD for reg in (
        Registration(op, BACKEND, _composite_of(op)),
        Registration(op, ("AutogradCPU",), _npu_autograd(op), with_keyset=True))),
)

# torchair's Python-dispatcher kernels (torchair/_utils/__init__.py register_matmul_backward_decomp,
# installed by add_npu_patch when its backend is built): `to(other)` and `type_as` become
# `to(other.dtype)` on NPU tensors, and matmul_backward gets a CompositeImplicitAutograd
# decomposition for fake tensors.
def _to_other(self, other, non_blocking=False, copy=False, memory_format=None):
    return self.to(other.dtype)


def _type_as(self, other):
    return self.to(other.dtype)


TORCHAIR_PY_KERNELS: tuple[tuple[str, DispatchKey, Callable], ...] = (
    ("to.other", DispatchKey.AutogradCPU, _to_other),  # AutogradPrivateUse1 on an NPU
    ("type_as", DispatchKey.AutogradCPU, _type_as),
    ("matmul_backward", DispatchKey.CompositeImplicitAutograd, matmul_backward),
)


def _from_torchair(kernel: Callable) -> bool:
    """torchair's own kernel, or npugraph_ex's (torch_npu's other graph backend, which
    registers the same ones, e.g. its matmul_backward decomposition)."""
    module = getattr(kernel, "__module__", None) or ""
    return "torchair" in module or "npugraph_ex" in module


def _overload(op: str) -> torch._ops.OpOverload:
    name, _, overload = op.partition(".")
    return getattr(getattr(aten, name), overload or "default")


class NpuDispatch:
    """The overrides of one SoC, registered while entered (not reentrant: use `emulated`)."""

    def __init__(self, soc: Optional[str] = None, *, sdpa: bool = True):
        self.soc = soc or DEFAULT_SOC
        soc_version(self.soc)  # an unknown SoC fails here, not half-way through a trace
        self.sdpa = sdpa
        self._library: Optional[torch.library.Library] = None
        self._py_kernels: list[tuple[torch._ops.OpOverload, DispatchKey]] = []
        self._autocast_library: Optional[torch.library.Library] = None
        self._autocast_init: Optional[Callable] = None

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(r for r in REGISTRATIONS if self.sdpa or not r.soc_dependent)

    def _touched(self) -> list[torch._ops.OpOverload]:
        return [r.overload for r in self.registrations] + [_overload(op) for op, _, _ in TORCHAIR_PY_KERNELS]

    def __enter__(self) -> "NpuDispatch":
        from . import npu_ops

        npu_ops.ensure_registered()  # the npu ops the kernels call
        library = torch.library.Library("aten", "IMPL")
        try:
            for registration in self.registrations:
                kernel = registration.make(self.soc)
                for key in registration.keys:
                    library.impl(registration.op, kernel, key, with_keyset=registration.with_keyset)
            for op, key, kernel in TORCHAIR_PY_KERNELS:
                overload = _overload(op)
                if key in overload.py_kernels:
                    if _from_torchair(overload.py_kernels[key]):
                        continue  # torchair's backend is built in this process: its own kernel is the real one
                    raise RuntimeError(f"{overload} already has a Python kernel at {key}, not torchair's "
                                       f"({getattr(overload.py_kernels[key], '__module__', None)})")
                overload.py_impl(key)(kernel)
                self._py_kernels.append((overload, key))
        except Exception:
            library._destroy()  # noqa: SLF001
            self._remove_py_kernels()
            raise
        self._library = library
        self._clear_python_dispatch_caches()
        autocast = torch.amp.autocast_mode.autocast
        self._autocast_init = autocast.__init__
        autocast.__init__ = _npu_autocast_init(self._autocast_init, self.soc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._autocast_init is not None:
            torch.amp.autocast_mode.autocast.__init__ = self._autocast_init
            self._autocast_init = None
        if self._autocast_library is not None:
            self._autocast_library._destroy()  # noqa: SLF001
            self._autocast_library = None
            self._clear_python_dispatch_caches(_autocast_overloads())
        if self._library is not None:
            self._library._destroy()  # noqa: SLF001 - torch.library's documented way to unregister
            self._library = None
        self._remove_py_kernels()
        self._clear_python_dispatch_caches()

    def register_autocast_kernels(self) -> None:
        """torch_npu's autocast op lists at AutocastCPU (dispatch_inventory.AUTOCAST_POLICIES), and
        CPU's own autocast kernels made to fall through; once, when the first autocast region
        of the emulated device is entered (a model without one pays nothing)."""
        if self._autocast_library is not None:
            return
        import warnings

        from .dispatch_inventory import AUTOCAST_POLICIES

        library = torch.library.Library("aten", "IMPL")
        npu_ops = {op for policy in AUTOCAST_POLICIES for op in policy.ops}
        with warnings.catch_warnings():  # each replaces a CPU autocast kernel, on purpose
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for policy in AUTOCAST_POLICIES:
                for op in policy.ops:
                    library.impl(op, autocast_kernel(op, policy.policy), "AutocastCPU")
            for op in _cpu_autocast_ops() - npu_ops:
                library.impl(op, torch.library.fallthrough_kernel, "AutocastCPU")
        self._autocast_library = library
        self._clear_python_dispatch_caches(_autocast_overloads())

    def _remove_py_kernels(self) -> None:
        for overload, key in self._py_kernels:
            overload.py_kernels.pop(key, None)
        self._py_kernels.clear()

    def _clear_python_dispatch_caches(self, overloads: Optional[Sequence[torch._ops.OpOverload]] = None) -> None:
        # The Python dispatcher (on while aot_autograd traces) caches each op's resolved
        # kernel per key; a registration made or removed since would otherwise be ignored.
        for overload in self._touched() if overloads is None else overloads:
            overload._dispatch_cache.clear()  # noqa: SLF001


@functools.lru_cache(maxsize=None)
def _cpu_autocast_ops() -> frozenset[str]:
    """The aten overloads torch registers CPU autocast kernels for ("linear", "conv1d.padding", ...)."""
    names = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")  # noqa: SLF001
    return frozenset(name.split("::", 1)[1] for name in names if name.startswith("aten::"))


@functools.lru_cache(maxsize=None)
def _autocast_overloads() -> tuple[torch._ops.OpOverload, ...]:
    from .dispatch_inventory import AUTOCAST_POLICIES

    names = {op for policy in AUTOCAST_POLICIES for op in policy.ops} | _cpu_autocast_ops()
    return tuple(_overload(name) for name in sorted(names))


# The emulation currently active (a stack: suspended() pushes None).
_ACTIVE: list[Optional[NpuDispatch]] = []


def active() -> Optional[NpuDispatch]:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def emulated(soc: Optional[str] = None, *, sdpa: bool = True) -> Iterator[NpuDispatch]:
    """Trace as on an NPU of `soc` (None: DEFAULT_SOC) inside this block. An emulation
    already active for the same SoC is reused; another one is suspended meanwhile.
    sdpa=False leaves out the one SoC-dependent override (pattern tracing)."""
    current = active()
    if current is not None and current.soc == (soc or DEFAULT_SOC) and current.sdpa == sdpa:
        yield current
        return
    with suspended():
        dispatch = NpuDispatch(soc, sdpa=sdpa)
        with dispatch:
            _ACTIVE.append(dispatch)
            try:
                yield dispatch
            finally:
                _ACTIVE.pop()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No emulation inside this block (the passes, which trace their own patterns both ways);
    the one active before is registered again after it."""
    current = active()
    if current is None:
        yield
        return
    current.__exit__(None, None, None)
    _ACTIVE.append(None)
    try:
        yield
    finally:
        _ACTIVE.pop()
        current.__enter__()


@functools.lru_cache(maxsize=None)  # one wrapper per trace_fn: traces are memoized by it
def traced_as_on_npu(trace_fn: Callable) -> Callable:
    """`trace_fn` (a pattern trace) run under the SoC-independent emulation: the spelling of
    a form in an NPU graph. SDPA is left out: its spelling depends on the SoC, and a form
    that means the NPU's attention spells its npu op out (patterns/sparse_attention.py)."""

    @functools.wraps(trace_fn)
    def trace(*args: Any, **kwargs: Any):
        with emulated(DEFAULT_SOC, sdpa=False):
            return trace_fn(*args, **kwargs)

    trace.__name__ = f"{getattr(trace_fn, '__name__', 'trace')}_as_on_npu"
    return trace


# =====================================================================================
# Running an emulated graph on CPU
# =====================================================================================
# aten ops an NPU graph may hold that CPU has no kernel for: what runs them on CPU.
CPU_KERNELS: dict[Any, Callable] = {aten.matmul_backward.default: matmul_backward}


def lower_for_cpu(gm: torch.fx.GraphModule) -> int:
    """Retarget the nodes of CPU_KERNELS ops in `gm` (after the passes, for execution only:
    the graph the report and the dumps show keeps the NPU's op). Returns how many."""
    changed = 0
    for node in gm.graph.nodes:
        kernel = CPU_KERNELS.get(node.target) if node.op == "call_function" else None
        if kernel is not None:
            node.target = kernel
            changed += 1
    if changed:
        gm.recompile()
    return changed


# =====================================================================================
# transformers' own NPU branches (traced by dynamo, before any backend runs)
# =====================================================================================
TRANSFORMERS_SDPA_FILE = "transformers/integrations/sdpa_attention.py"


def _stack_trace_frames(node: torch.fx.Node) -> list[str]:
    trace = node.meta.get("stack_trace") or ""
    return [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]


def _called_from_transformers_sdpa(node: torch.fx.Node) -> bool:
    frames = _stack_trace_frames(node)
    return bool(frames) and TRANSFORMERS_SDPA_FILE in frames[-1].replace("\\", "/") \
        and "sdpa_attention_forward" in frames[-1]


def _sdpa_mask_argument(node: torch.fx.Node) -> tuple[Optional[torch.fx.Node], Callable[[Any], None]]:
    """The attn_mask argument of a dynamo-graph SDPA call and a setter for it."""
    if "attn_mask" in node.kwargs:
        def set_kwarg(value):
            node.kwargs = {**node.kwargs, "attn_mask": value}
        return node.kwargs["attn_mask"], set_kwarg
    if len(node.args) > 3:
        def set_arg(value):
            node.args = (*node.args[:3], value, *node.args[4:])
        return node.args[3], set_arg
    return None, lambda value: None


def apply_transformers_npu_branches(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo graph as dynamo traces it with torch_npu importable.

    transformers 5.24 evaluates `is_torch_npu_available()` once, at import
    (integrations/sdpa_attention.py:15), and dynamo traces the Python before any backend
    runs, so a backend cannot make that branch be taken. Its one effect on model code
    (sdpa_attention.py:158-161) is on the SDPA call of `sdpa_attention_forward`: a mask that
    is not bool becomes `torch.logical_not(attention_mask.bool())` (`.to(query.device)`, a
    no-op on one device, is left out). This inserts exactly those two calls before each such
    SDPA call of the dynamo graph; tests/test_npu_dispatch.py shows the aot graph equals the
    one traced with the flag patched to True. Returns the number of calls rewritten.
    """
    sdpa = torch._C._nn.scaled_dot_product_attention  # noqa: SLF001
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (sdpa, torch.nn.functional.scaled_dot_product_attention):
            continue
        if not _called_from_transformers_sdpa(node):
            continue
        mask, set_mask = _sdpa_mask_argument(node)
        value = mask.meta.get("example_value") if isinstance(mask, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
            continue
        with gm.graph.inserting_before(node):
            as_bool = gm.graph.call_method("bool", (mask,))
            inverted = gm.graph.call_function(torch.logical_not, (as_bool,))
        for new in (as_bool, inverted):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                          "source_fn_stack")})
        fake = value.bool()
        as_bool.meta["example_value"] = fake
        inverted.meta["example_value"] = torch.logical_not(fake)
        set_mask(inverted)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def graph_source(fusion_config: Any) -> str:
    """What the emulation backend's graphs are, for the report."""
    if getattr(fusion_config, "npu_dispatch", True):
        return (f"NPU graph: CPU trace with torch_npu 2.13's dispatch emulated for "
                f"{fusion_config.soc or DEFAULT_SOC} (npu_dispatch)")
    return "CPU graph: plain CPU trace, NPU dispatch emulation off (FusionConfig(npu_dispatch=False))"
