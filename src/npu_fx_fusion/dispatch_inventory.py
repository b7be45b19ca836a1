"""What an NPU compile holds instead of the CPU trace: the inventory, from evidence.

A composite (CompositeImplicitAutograd) aten op decomposes in an aot graph only where
autograd would have decomposed it (torch.utils._python_dispatch.autograd_would_have_decomposed):
a kernel at the device's keys pre-empts the decomposition, and the graph records the op
itself (a PrivateUse1 kernel, autograd from a formula) or what its AutogradPrivateUse1
kernel calls. OVERRIDES lists every aten op torch_npu 2.13 registers at PrivateUse1 or
AutogradPrivateUse1 that is CompositeImplicitAutograd in torch 2.13, one row each, with
what an NPU aot graph then holds. TORCHAIR, TRANSFORMERS, DTYPE_CAST and AUTOCAST (with its
AUTOCAST_POLICIES) cover the other sources of NPU-only spellings. npu_dispatch.py reproduces
the rows marked `emulated`, and AUTOCAST; docs/npu-graph.md is the prose version.

Sources (tests/test_npu_dispatch.py checks every claim about the wheel against it):
* W = the torch-npu 2.13.0 wheel: Y = torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml
  (its sections), S = the strings of torch_npu/lib/libtorch_npu.so: torchgen's
  `wrapper_NPU_<overload>_<name>` (a PrivateUse1 kernel) and `wrapper_AutogradNPU_...`
  (AutogradPrivateUse1, a kernel that runs in place of autograd and records what it calls),
  and `at_npu::autograd::generated::<Op>Backward<n>` (an autograd formula of op-plugin's
  derivatives.yaml, registered at AutogradPrivateUse1).
* OP = Ascend/op-plugin at 517f2e7 (2026-08-21), op_plugin/ops/opapi/*.cpp (the op_api
  kernels, which torch_npu runs on A2/A3/950 with the default jit_compile=False; the
  acl_op ones are not covered) and op_plugin/config/derivatives.yaml.
* PT = Ascend/pytorch master (torch_npu's own kernels, e.g. contiguous); its strings match W's.
* "observed": traced on CPU with the emulation on and off (tests/test_npu_dispatch.py
  repeats each observation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# A row's effect on the aot graph
CHANGES = "changes"  # the NPU graph differs from the CPU trace
SAME = "same"  # the NPU kernel records what CPU's composite records
NOT_ESTABLISHED = "not established"


@dataclass(frozen=True)
class Override:
    op: str  # aten overload, "softmax.int"
    yaml: str  # the section of Y listing it ("supported", "symint"): a PrivateUse1 kernel
    npu_kernel: str  # S: the wrapper_NPU_ symbol
    autograd: Optional[str]  # S: wrapper_AutogradNPU_ symbol or autograd node class; None: none
    kernel: str  # what the kernel does under tracing (OP / PT file), the reason for `effect`
    cpu_graph: str  # what the CPU aot graph holds for it
    npu_graph: str  # what an NPU aot graph holds instead
    effect: str  # CHANGES / SAME / NOT_ESTABLISHED
    emulated: bool  # npu_dispatch.REGISTRATIONS reproduces it
    why_not_emulated: str = ""  # for a CHANGES row that is not emulated

    @property
    def keys(self) -> tuple[str, ...]:
        return ("PrivateUse1",) + (("AutogradPrivateUse1",) if self.autograd else ())

    @property
    def autograd_is_formula(self) -> bool:
        """Its AutogradPrivateUse1 kernel is op-plugin's autograd formula (the graph records
        the op), not a wrapper that runs the kernel in autograd's place."""
        return bool(self.autograd) and not self.autograd.startswith("wrapper_")


_FAKE_PATH = "(fake tensors: the op_api kernel's is_fake_or_meta branch)"
_ACLNN_AT_AUTOGRAD = ("its AutogradPrivateUse1 kernel launches the aclnn kernel itself (EXEC_NPU_CMD) "
                      "instead of calling ops: what aot records for it on fake tensors was not traced")
_OUT_VARIANT = ("an out= overload: aot's functionalization decomposes mutating composites itself, but the "
                "AutogradPrivateUse1 kernel runs first and launches aclnn directly; not traced on an NPU")
_NPU_ONLY = ("PrivateUse1 only, no autograd formula of its own: the AutogradPrivateUse1 entry falls back, "
             "and autograd_would_have_decomposed is False, so the op is recorded undecomposed")
_FORMULA = ("a PrivateUse1 kernel with op-plugin's autograd formula at AutogradPrivateUse1: recorded "
            "undecomposed, differentiated by the formula")

OVERRIDES: tuple[Override, ...] = (
    # ---- the SDPA and the ops of the passes' forms -------------------------------------------
    Override("scaled_dot_product_attention", "supported", "wrapper_NPU__scaled_dot_product_attention",
             "wrapper_AutogradNPU__scaled_dot_product_attention",
             "OP ScaledDotProductAttentionKernelNpuOpApi.cpp (V2R5+): fp32 with a head dim % 4 != 0 -> "
             "_scaled_dot_product_attention_math; fp16/bf16/fp32, bool mask or none, 4-D, N <= 2048, D <= 512, "
             "Nq % Nkv == 0, SoC >= Ascend910B1 -> npu_fusion_attention_v3 (< Ascend950) / npu_fusion_attention "
             "(Ascend950), the mask made Ascend's (logical_not; ones + triu and sparse_mode 2 for is_causal); "
             "the FIA branch is unreachable (its inputs all take the FA branch); else the math path with a "
             "bool mask made additive (zeros_like + masked_fill)",
             "_scaled_dot_product_flash_attention_for_cpu (a bool mask as where(mask, 0, -inf)) or "
             "_scaled_dot_product_attention_math's decomposition (bmm, _safe_softmax)",
             "A2/A3: [ones, triu |] logical_not -> npu.npu_fusion_attention_v3 -> getitem 0; backward "
             "npu.npu_fusion_attention_grad_v3; Ascend950: npu.npu_fusion_attention / _grad; 310P, fp32 with "
             "D % 4 != 0, 3-D, float masks: the math decomposition with aten.matmul",
             CHANGES, True),
    Override("softmax.int", "supported", "wrapper_NPU_int_softmax", "wrapper_AutogradNPU_int_softmax",
             "OP SoftmaxKernelNpuOpApi.cpp: a dtype other than the input's is custom_ops::_npu_dtype_cast, "
             "then at::_softmax(converted, dim, false)",
             "_to_copy(dtype=..., layout, device) + _softmax; backward _softmax_backward_data + _to_copy",
             "npu._npu_dtype_cast + _softmax; backward _softmax_backward_data + npu._npu_dtype_cast_backward "
             "(observed); no dtype or the same dtype: as CPU",
             CHANGES, True),
    Override("matmul", "supported", "wrapper_NPU__matmul", "at_npu::autograd::generated::MatmulBackward0",
             _FORMULA + " (derivatives.yaml: matmul_backward(grad, self, other, grad_input_mask), which is torch's "
             "own formula too); torchair's comment: 'Torch_npu currently dispatch linear to matmul and "
             "matmul_backward instead of mm' (torchair/_utils/__init__.py register_matmul_backward_decomp)",
             "view + mm + _unsafe_view (3-D and up), mm, bmm + expands; backward t + mm",
             "aten.matmul for every matmul / @ / bias-free F.linear (linear's composite calls matmul); backward "
             "aten.matmul_backward (a PrivateUse1 kernel, wrapper_NPU__matmul_backward) (observed)",
             CHANGES, True),
    Override("repeat_interleave.self_int", "supported", "wrapper_NPU_self_int_repeat_interleave",
             "at_npu::autograd::generated::RepeatInterleaveBackward1",
             _FORMULA + ": self: repeat_interleave_backward_int(grad, self, repeats, dim)",
             "unsqueeze + expand + clone + view; backward view + sum + squeeze",
             "aten.repeat_interleave.self_int; backward npu.repeat_interleave_backward_int (observed)",
             CHANGES, True),
    Override("repeat_interleave.self_Tensor", "supported", "wrapper_NPU_self_Tensor_repeat_interleave",
             "at_npu::autograd::generated::RepeatInterleaveBackward0",
             _FORMULA + ": self: repeat_interleave_backward_tensor(grad, self, repeats, dim)",
             "repeat_interleave.Tensor + index_select",
             "aten.repeat_interleave.self_Tensor; backward npu.repeat_interleave_backward_tensor",
             CHANGES, True),
    Override("one_hot", "supported", "wrapper_NPU__one_hot", "wrapper_AutogradNPU__one_hot",
             "OP OneHotKernelNpuOpApi.cpp " + _FAKE_PATH + ": arange(num_classes) + eq(self.unsqueeze(-1)) + "
             ".to(long); num_classes=-1 is refused",
             "bounds checks (ge, lt, all, _assert_async) + unsqueeze + arange + eq + _to_copy",
             "arange + unsqueeze + eq + _to_copy (no bounds checks) (observed)",
             CHANGES, True),
    Override("argsort", "supported", "wrapper_NPU__argsort", "wrapper_AutogradNPU__argsort",
             "OP ArgSortKernelNpuOpApi.cpp: std::get<1>(at::sort(self, dim, descending))",
             "sort + getitem 1", "the same (observed)", SAME, True),
    Override("argsort.stable", "supported", "wrapper_NPU_stable_argsort", "wrapper_AutogradNPU_stable_argsort",
             "OP ArgSortKernelNpuOpApi.cpp: std::get<1>(at::sort(self, stable, dim, descending))",
             "sort.stable + getitem 1 (torchtitan's token dispatcher)", "the same (observed)", SAME, True),
    Override("contiguous", "supported", "wrapper_NPU__contiguous", "wrapper_AutogradNPU__contiguous",
             "PT torch_npu/csrc/aten/common/TensorProperties.cpp: self if contiguous, else "
             "self.clone(memory_format) (the wheel holds its message 'NPU contiguous operator only supported "
             "contiguous memory format.')",
             "clone(memory_format=contiguous_format) or nothing", "the same (observed)", SAME, True),
    Override("_weight_norm", "supported", "wrapper_NPU___weight_norm", "wrapper_AutogradNPU___weight_norm",
             "OP WeightNormKernelNpuOpApi.cpp: v.contiguous() * g.contiguous().div(at::norm_except_dim(v, 2, dim)), "
             "always",
             "_weight_norm_interface (dim 0 or last); backward _weight_norm_interface_backward",
             "norm_except_dim's decomposition (view, norm, div, mul), differentiated op by op (observed)",
             CHANGES, True),
    Override("where", "supported", "wrapper_NPU__where", "wrapper_AutogradNPU__where",
             "OP WhereKernelNpuOpApi.cpp: where(condition) is at::native::where, the composite",
             "nonzero_numpy (a data-dependent shape: no fake-tensor trace, a graph break)",
             "the same (observed on real tensors)", SAME, True),
    Override("log_sigmoid", "supported", "wrapper_NPU__log_sigmoid", "wrapper_AutogradNPU__log_sigmoid",
             "OP LogSigmoidNpuOpApi.cpp: std::get<0>(at::log_sigmoid_forward(self))",
             "log_sigmoid_forward + getitem 0", "the same (observed)", SAME, True),
    Override("adaptive_avg_pool2d", "supported", "wrapper_NPU__adaptive_avg_pool2d",
             "wrapper_AutogradNPU__adaptive_avg_pool2d",
             "OP AdaptiveAvgPool2dKernelNpuOpApi.cpp: 1x1 output -> mean([-1, -2], keepdim), else "
             "at::_adaptive_avg_pool2d",
             "the same composite", "the same", SAME, True),
    Override("multilabel_margin_loss", "supported", "wrapper_NPU__multilabel_margin_loss",
             "wrapper_AutogradNPU__multilabel_margin_loss",
             "OP MultilabelMarginLossKernelNpuOpApi.cpp: std::get<0>(at::multilabel_margin_loss_forward(...))",
             "multilabel_margin_loss_forward + getitem 0", "the same", SAME, True),
    Override("pdist", "supported", "wrapper_NPU__pdist", "wrapper_AutogradNPU__pdist",
             "OP PdistKernelNpuOpApi.cpp: at::_pdist_forward(self, p), without CPU's contiguous()",
             "[clone +] _pdist_forward",
             "_pdist_forward, the same for a contiguous input (observed); a non-contiguous one fails to trace "
             "(torch's Meta of _pdist_forward requires contiguity, which CPU's composite makes first)",
             SAME, True),
    Override("fft_fftshift", "supported", "wrapper_NPU__fft_fftshift", "wrapper_AutogradNPU__fft_fftshift",
             "OP FFTShiftKernelNpuOpApi.cpp: at::roll_symint(self, size / 2, dims) (ComplexFloat: rolled as an "
             "int64 reinterpretation of its storage)",
             "roll", "the same for real dtypes; ComplexFloat not established", SAME, True),
    Override("fft_ifftshift", "supported", "wrapper_NPU__fft_ifftshift", "wrapper_AutogradNPU__fft_ifftshift",
             "OP FFTShiftKernelNpuOpApi.cpp: at::roll_symint(self, (size + 1) / 2, dims)",
             "roll", "the same for real dtypes; ComplexFloat not established", SAME, True),
    Override("__ior__.Tensor", "supported", "wrapper_NPU_Tensor___ior__", "wrapper_AutogradNPU_Tensor___ior__",
             "OP __Ior__KernelNpuOpApi.cpp: self.bitwise_or_(other)", "bitwise_or (functionalized)", "the same",
             SAME, True),
    Override("__ior__.Scalar", "supported", "wrapper_NPU_Scalar___ior__", "wrapper_AutogradNPU_Scalar___ior__",
             "OP __Ior__KernelNpuOpApi.cpp: self.bitwise_or_(other)", "bitwise_or (functionalized)", "the same",
             SAME, True),
    # ---- PrivateUse1 kernels with op-plugin autograd formulas, or none ----------------------------
    Override("cdist", "supported", "wrapper_NPU__cdist", "at_npu::autograd::generated::CdistBackward0",
             _FORMULA + ": x1: _cdist_backward(grad, x1, x2, p, result), x2: _cdist_backward(grad.mT().contiguous(), "
             "x2, x1, p, result.mT().contiguous())",
             "_cdist_forward (or _euclidean_dist); backward _cdist_backward (observed)",
             "aten.cdist; backward aten._cdist_backward x2 (the second on transposed copies) (observed)",
             CHANGES, True),
    Override("inverse", "supported", "wrapper_NPU__inverse", "at_npu::autograd::generated::InverseBackward0",
             _FORMULA + ": self: -at::matmul(result.mH(), at::matmul(grad, result.mH()))",
             "linalg_inv_ex + getitem", "aten.inverse; backward two aten.matmul", CHANGES, True),
    Override("kl_div", "supported", "wrapper_NPU__kl_div", "at_npu::autograd::generated::KlDivBackward0",
             _FORMULA + ": self: kl_div_backward(...), target: kl_div_target_backward(...)",
             "the composite (sub, mul, xlogy / exp, mean)",
             "aten.kl_div; backward npu.kl_div_backward, npu.kl_div_target_backward", CHANGES, True),
    Override("l1_loss", "supported", "wrapper_NPU__l1_loss", "at_npu::autograd::generated::L1LossBackward0",
             _FORMULA + ": self: l1_loss_backward(grad, self, target, reduction), target: the same * -1",
             "sub + abs + mean", "aten.l1_loss; backward npu.l1_loss_backward (x2, one negated)", CHANGES, True),
    Override("linalg_cholesky", "supported", "wrapper_NPU__linalg_cholesky",
             "at_npu::autograd::generated::LinalgCholeskyBackward0",
             _FORMULA + ": self: cholesky_backward(grad, upper, result) (torch's FunctionsManual helper)",
             "linalg_cholesky_ex + getitem", "aten.linalg_cholesky; backward cholesky_backward's ops (with "
             "aten.matmul)", CHANGES, True),
    Override("stft", "supported", "wrapper_NPU__stft", "at_npu::autograd::generated::StftBackward0",
             _FORMULA + ": self: stft_backward(grad, self, n_fft, ...)",
             "the composite (unfold, _fft_r2c ...)", "aten.stft; backward npu.stft_backward", CHANGES, True),
    Override("isclose", "supported", "wrapper_NPU__isclose", None, _NPU_ONLY,
             "the composite (eq, sub, abs, mul, le, logical_and / or ...)", "aten.isclose", CHANGES, True),
    Override("isfinite", "supported", "wrapper_NPU__isfinite", None, _NPU_ONLY,
             "the composite (abs, ne, mul / eq)", "aten.isfinite", CHANGES, True),
    Override("mish_backward", "supported", "wrapper_NPU__mish_backward", None,
             "PrivateUse1 kernel; CPU has a kernel of its own too, so neither decomposes it",
             "mish_backward", "the same", SAME, False),
    Override("silu_backward", "supported", "wrapper_NPU__silu_backward", None,
             "PrivateUse1 kernel; CPU has a kernel of its own too, so neither decomposes it",
             "silu_backward", "the same", SAME, False),
    # ---- graph-changing, not emulated -------------------------------------------------------------
    Override("lstm.input", "supported", "wrapper_NPU_input_lstm", "wrapper_AutogradNPU_input_lstm",
             "OP LSTMKernelNpuOpApi.cpp: custom_ops::_lstm_npu(...)", "the composite (_thnn / mkldnn cells)",
             "npu._lstm_npu", CHANGES, False,
             "needs a stand-in of npu._lstm_npu (and its backward); no pass or tiny model has an LSTM"),
    Override("lstm.data", "supported", "wrapper_NPU_data_lstm", "wrapper_AutogradNPU_data_lstm",
             "OP LSTMKernelNpuOpApi.cpp: custom_ops::_lstm_npu(...) (packed sequences)", "the composite",
             "npu._lstm_npu", CHANGES, False, "as lstm.input"),
    Override("gru.input", "supported", "wrapper_NPU_input_gru", "wrapper_AutogradNPU_input_gru",
             "OP GRUKernelNpuOpApi.cpp: custom_ops::_gru_npu(...)", "the composite", "npu._gru_npu", CHANGES, False,
             "needs a stand-in of npu._gru_npu; no pass or tiny model has a GRU"),
    Override("lstm_cell", "supported", "wrapper_NPU__lstm_cell", "wrapper_AutogradNPU__lstm_cell",
             "OP LstmCellKernelNpuOpApi.cpp: at::matmul x2 + at::_thnn_fused_lstm_cell",
             "the composite (linear, chunk, sigmoid, tanh ...)", "aten.matmul x2 + aten._thnn_fused_lstm_cell",
             CHANGES, False, "_thnn_fused_lstm_cell has no CPU kernel to run the emulated graph with"),
    Override("flatten_dense_tensors", "supported", "wrapper_NPU__flatten_dense_tensors",
             "wrapper_AutogradNPU__flatten_dense_tensors",
             "PT torch_npu/csrc/aten/ops/FlattenDenseTensorsKernelNpu.cpp: npu_format_cast to the origin format, "
             "contiguous, view(-1), cat",
             "view(-1) + cat", "npu.npu_format_cast + view + cat", CHANGES, False,
             "reads the NPU storage format of its inputs, which fake CPU tensors do not have; a distributed "
             "utility, not model code"),
    # ---- not established: the autograd-key kernel launches aclnn itself ----------------------------
    Override("slogdet", "supported", "wrapper_NPU__slogdet", "wrapper_AutogradNPU__slogdet",
             "OP SlogdetKernelNpuOpApi.cpp: " + _ACLNN_AT_AUTOGRAD, "_linalg_slogdet + getitems", "?",
             NOT_ESTABLISHED, False, _ACLNN_AT_AUTOGRAD),
    Override("affine_grid_generator_backward", "supported", "wrapper_NPU__affine_grid_generator_backward",
             "wrapper_AutogradNPU__affine_grid_generator_backward",
             "OP AffineGridGeneratorBackwardKernelNpuOpApi.cpp: " + _ACLNN_AT_AUTOGRAD, "the composite", "?",
             NOT_ESTABLISHED, False, _ACLNN_AT_AUTOGRAD),
    Override("conv_tbc_backward", "supported", "wrapper_NPU__conv_tbc_backward",
             "wrapper_AutogradNPU__conv_tbc_backward",
             "OP ConvolutionBackwardKernelNpuOpApi.cpp: " + _ACLNN_AT_AUTOGRAD, "the composite", "?",
             NOT_ESTABLISHED, False, _ACLNN_AT_AUTOGRAD),
    Override("fill_diagonal_", "supported", "wrapper_NPU__fill_diagonal_", "wrapper_AutogradNPU__fill_diagonal_",
             "OP aclops/FillDiagonalKernelNpu.cpp (acl_op only): an OpCommand 'FillDiagonal' run from the "
             "autograd key", "the composite (as_strided + fill_)", "?", NOT_ESTABLISHED, False, _ACLNN_AT_AUTOGRAD),
    Override("_pad_packed_sequence", "supported", "wrapper_NPU___pad_packed_sequence",
             "wrapper_AutogradNPU___pad_packed_sequence",
             "OP PadPackedSequenceKernelNpuOpApi.cpp: " + _ACLNN_AT_AUTOGRAD, "the composite", "?",
             NOT_ESTABLISHED, False, _ACLNN_AT_AUTOGRAD),
    Override("max.out", "supported", "wrapper_NPU_out_max_out", "wrapper_AutogradNPU_out_max_out",
             "OP MaxKernelNpuOpApi.cpp max_out(self, other, result): aclnnMaximum", "maximum (functionalized)",
             "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("min.out", "supported", "wrapper_NPU_out_min_out", "wrapper_AutogradNPU_out_min_out",
             "OP MinKernelNpuOpApi.cpp min_out(self, other, result): aclnnMinimum", "minimum (functionalized)",
             "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("log_sigmoid.out", "supported", "wrapper_NPU_out_log_sigmoid_out",
             "wrapper_AutogradNPU_out_log_sigmoid_out", "OP LogSigmoidNpuOpApi.cpp log_sigmoid_out",
             "log_sigmoid_forward (functionalized)", "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("multilabel_margin_loss.out", "supported", "wrapper_NPU_out_multilabel_margin_loss_out",
             "wrapper_AutogradNPU_out_multilabel_margin_loss_out",
             "OP MultilabelMarginLossKernelNpuOpApi.cpp multilabel_margin_loss_out",
             "multilabel_margin_loss_forward (functionalized)", "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("nanmean.out", "supported", "wrapper_NPU_out_nanmean_out", "wrapper_AutogradNPU_out_nanmean_out",
             "OP NanmeanKernelNpuOpApi.cpp: isnan, logical_not_, sum, op_api::nansum_out, div_",
             "the composite (functionalized)", "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("matmul.out", "supported", "wrapper_NPU_out_matmul_out", None, _OUT_VARIANT.split(":")[0],
             "the composite (functionalized)", "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("inverse.out", "supported", "wrapper_NPU_out_inverse_out", None, _OUT_VARIANT.split(":")[0],
             "the composite (functionalized)", "?", NOT_ESTABLISHED, False, _OUT_VARIANT),
    Override("linalg_cholesky.out", "supported", "wrapper_NPU_out_linalg_cholesky_out", None,
             _OUT_VARIANT.split(":")[0], "the composite (functionalized)", "?", NOT_ESTABLISHED, False,
             _OUT_VARIANT),
)

OVERRIDE_BY_OP = {row.op: row for row in OVERRIDES}


@dataclass(frozen=True)
class Change:
    """An NPU-only spelling that comes from somewhere else than an aten override."""

    what: str
    source: str  # file:line in W (TA = torch_npu/dynamo/torchair/) or transformers 5.24
    effect: str  # on the aot graph
    emulated: str  # how npu_dispatch reproduces it, or why not


# torchair's own changes, made process-wide by add_npu_patch when its backend is built
# (TA/_utils/__init__.py:447-455) or by its decomposition table.
TORCHAIR: tuple[Change, ...] = (
    Change("aten.to.other and aten.type_as get Python kernels at AutogradPrivateUse1: self.to(other.dtype)",
           "TA/_utils/__init__.py register_matmul_backward_decomp",
           "x.type_as(y) records _to_copy(x, dtype=...) without CPU's layout= / device= keywords (observed; to.other "
           "records the same as on CPU)",
           "npu_dispatch.TORCHAIR_PY_KERNELS, at AutogradCPU"),
    Change("aten.matmul_backward gets a CompositeImplicitAutograd Python kernel",
           "TA/_utils/__init__.py register_matmul_backward_decomp",
           "none on the graph (the PrivateUse1 kernel keeps it undecomposed): fake tensors evaluate it",
           "npu_dispatch.TORCHAIR_PY_KERNELS (with a CPU kernel, as the NPU has one)"),
    Change("get_npu_default_decompositions: npu_define.allgather, _c10d_functional.all_to_all_single",
           "TA/_utils/__init__.py:465-478", "collectives only: nothing in a one-device graph",
           "not needed on one device"),
    Change("npu_patch_meta: Meta kernels of native_dropout (packed uint8 mask) and "
           "_native_batch_norm_legit_no_training (empty save_mean / save_rstd)",
           "TA/_utils/__init__.py:85-121", "fake output shapes of those ops (training dropout, batch norm)",
           "not emulated: no pass matches dropout masks or batch norm"),
    Change("adjust_implicit_decomposition: upsample_nearest2d.vec's Python decomposition replaced, .default's "
           "removed", "TA/_utils/adjust_implicit_decomposition.py", "upsampling stays one op",
           "not emulated: no pass or model involves upsampling"),
    Change("npu_patch_fx_pass (experimental_config.npu_fx_pass only): Inductor's joint patterns and "
           "decompositions cleared", "TA/_utils/__init__.py:384-405", "off by default", "not emulated (off)"),
)

# transformers 5.24: every `is_torch_npu_available()` branch on a model's forward path.
TRANSFORMERS: tuple[Change, ...] = (
    Change("sdpa_attention_forward: a mask that is not bool becomes torch.logical_not(mask.bool()).to(query.device) "
           "(so torch_npu's SDPA takes its FlashAttention branch)",
           "transformers/integrations/sdpa_attention.py:15 (evaluated at import), :158-161",
           "logical_not(_to_copy(mask, bool)) before the SDPA of a float mask",
           "npu_dispatch.apply_transformers_npu_branches rewrites the dynamo graph (dynamo traces the Python "
           "before any backend runs); tests/test_npu_dispatch.py compares it with the flag patched on"),
    Change("use_gqa_in_sdpa: the same rule on CUDA and Ascend NPU (no mask, head dim <= 256)",
           "transformers/integrations/sdpa_attention.py:39-47", "none: CPU takes the same branch",
           "nothing to reproduce"),
    Change("attn_implementation='flash_attention_2' on an NPU runs integrations/npu_flash_attention.py "
           "(torch_npu.npu_fusion_attention)", "transformers/modeling_flash_attention_utils.py:59,191",
           "the model calls npu_fusion_attention itself", "not emulated: an opt-in implementation; the tiny models "
           "use sdpa / eager"),
    Change("hub kernels: RMSNorm from kernels-community/liger-kernels for 'npu'",
           "transformers/integrations/hub_kernels.py:499", "only with the kernels package and use_kernels=True",
           "not emulated: opt-in"),
    Change("RoPE, MoE and norms: no is_torch_npu_available() branch in transformers 5.24's model code",
           "grep of transformers/models and integrations", "none", "nothing to reproduce"),
)

# How `.to(dtype)` is recorded on an NPU.
DTYPE_CAST = Change(
    "x.to(dtype) / x.float() / x.type_as(y): aten._to_copy, not npu._npu_dtype_cast",
    "W: no to.* overload in Y or S (neither wrapper_NPU_ nor wrapper_AutogradNPU_); _to_copy is in Y's supported "
    "section with only a PrivateUse1 kernel (wrapper_NPU___to_copy), which runs below the aot trace; torchair's "
    "to.other / type_as kernels call self.to(dtype)",
    "aten._to_copy, as on CPU (type_as: without layout / device keywords). npu._npu_dtype_cast appears where an "
    "override calls it: softmax.int with a dtype (its backward: npu._npu_dtype_cast_backward), or where model "
    "code calls torch_npu's op itself",
    "softmax.int's override emits it; the matcher's second cast spelling (every _to_copy as _npu_dtype_cast) "
    "is kept for model code that calls the op, though torch_npu itself does not record .to() that way",
)


# torch.autocast on an NPU: which dtypes it takes and what it casts. Model code writes
# `torch.autocast(device_type=x.device.type, dtype=...)`, "npu" there and "cpu" in emulation,
# where torch's own CPU rules differ: CPU autocast takes bf16 / fp16 only (torch 2.13
# torch/amp/autocast_mode.py:248-296, "In CPU autocast, but the target dtype is not supported.
# Disabling autocast.") and casts by its own op lists.
AUTOCAST = Change(
    "torch.autocast(device_type='npu', dtype=...) takes fp16, bf16 and fp32 and casts by torch_npu's op lists "
    "(below): torchtitan's MoE router computes its gate under autocast(dtype=float32), an fp32 router on an NPU",
    "W: torch_npu/npu/autocast_utils.py:8-11 get_amp_supported_dtype() (fp16, fp32, and bf16 where "
    "torch.npu.is_bf16_supported(), i.e. c10_npu::IsBF16Supported(): SocVersion >= Ascend910B1), which torch's "
    "autocast_mode.py reads for the PrivateUse1 backend; the default dtype of a PrivateUse1 autocast is fp16 "
    "(torch.get_autocast_dtype); S: ../torch_npu/csrc/aten/AutoCastOps.cpp and its binary_cross_entropy message "
    "in libtorch_npu.so; PT torch_npu/csrc/aten/AutoCastOps.cpp (Ascend/pytorch 0c9b75c): the op lists, "
    "TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1) with KERNEL_PRIVATEUSEONE, every other op falling through",
    "inside an autocast region the NPU graph holds _to_copy casts where CPU's holds none (fp32 on CPU: autocast "
    "disabled) or other ones (CPU's lists differ: e.g. CPU casts cat / stack / fft ops, the NPU exp / log / "
    "softmax / layer_norm)",
    "npu_dispatch: while the emulation is active, torch.autocast(device_type='cpu') takes the NPU's dtypes "
    "(autocast.__init__) and the AutocastCPU key runs these lists (Python kernels at AutocastCPU, CPU's own "
    "ops made to fall through), registered when an autocast region is first entered",
)


@dataclass(frozen=True)
class AutocastPolicy:
    """One of at::autocast's cast policies and the ops torch_npu registers under it."""

    policy: str  # at::autocast::CastPolicy
    effect: str
    ops: tuple[str, ...]  # aten overloads, "pow.Tensor_Scalar"


# PT AutoCastOps.cpp, in its order; the policies are torch's (ATen/autocast_mode.h)
AUTOCAST_POLICIES: tuple[AutocastPolicy, ...] = (
    AutocastPolicy("lower_precision_fp", "floating inputs (not fp64) cast to the autocast dtype", (
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
        "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear",
        "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")),
    AutocastPolicy("fp32", "floating inputs (not fp64) cast to fp32", (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp")),
    AutocastPolicy("fp32_set_opt_dtype", "dtype=fp32 unless given, when the first input is eligible", (
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")),
    AutocastPolicy("fp32_append_dtype", "the overload with a dtype, fp32, when the first input is eligible",
                   ("norm.Scalar", "norm.ScalarOpt_dim")),
    AutocastPolicy("promote", "floating inputs cast to the widest among them and the autocast dtype", (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "tensordot",
        "scatter_add")),
    AutocastPolicy("banned", "refused: 'torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe "
                   "to autocast.'", ("binary_cross_entropy",)),
)


def emulated_ops() -> frozenset[str]:
    return frozenset(row.op for row in OVERRIDES if row.emulated)
