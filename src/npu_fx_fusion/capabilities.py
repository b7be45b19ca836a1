"""What the hardware accepts, per fused op and SoC: one declarative table.

Patterns never write hardware limits as literals; they ask `unsupported(op, soc, ...)`
which returns the first limit a call would break, in words, or None. Sources are the
torch_npu op docs (`_op_plugin_docs.py` in the wheel) and shared/reference/op_semantics.md.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .npu_ops.spec import FLOAT_DTYPES, OpCapability, SocLimits, all_specs

log = logging.getLogger("npu_fx_fusion.capabilities")

# SoC names as torch_npu's get_soc_version / the docs name the product lines.
SOCS: tuple[str, ...] = (
    "Ascend910B",  # Atlas A2 training / 800I A2 inference
    "Ascend910_93",  # Atlas A3
    "Ascend310P",  # Atlas inference series ("310P-class")
    "Ascend950",  # arch35
)


# torchair's modes (CompilerConfig.mode) and npugraph_ex, by how they lower a graph:
# max-autotune converts every node into a GE graph and needs a GE converter per op;
# reduce-overhead and npugraph_ex capture the ops' own (aclnn) kernels in an ACL graph,
# so every op torch_npu implements works there.
GE_MODES = ("max-autotune",)
ACL_MODES = ("reduce-overhead", "npugraph_ex")
MODES: tuple[str, ...] = GE_MODES + ACL_MODES


def check_soc_name(soc: str) -> str:
    if soc not in SOCS:
        raise ValueError(f"unknown SoC {soc!r}; known: {', '.join(SOCS)}")
    return soc


CAPABILITIES: dict[str, OpCapability] = {
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_rotary_mul",
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
        ),
        OpCapability(
            op="npu.npu_interleave_rope",
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
        ),
        OpCapability(
            op="npu.npu_swiglu",
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
        ),
        # ---- MoE (npu_ops/moe.py). `x` of unsupported() is the op's first tensor input. ----
        OpCapability(
            op="npu.npu_moe_gating_top_k_softmax",
            dtypes=FLOAT_DTYPES,
            min_rank=2,
            max_rank=3,
            backward=None,
            ge_converter=True,
            # the v1 docstring lists Atlas A2 only (v2 adds A3); torchair's converter warns
            # that arch35 no longer supports v1 (use npu_moe_gating_top_k_softmax_v2)
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits={
                "max_k": 1024,  # 0 < k <= E and k <= 1024
                "finished_dtype": torch.bool,  # shape x.shape[:-1]
                "renormalises": False,  # top-k of the softmax, no division by their sum
            },
            doc="op_semantics 5.1 / torch_npu docstring (_op_plugin_docs.py npu_moe_gating_top_k_softmax): "
            "x 2-D/3-D fp16/bf16/fp32, 0 < k <= E, k <= 1024, finished bool of x.shape[:-1]; products: "
            "Atlas A2 (A3 listed for _v2 only); GE converter custom/moe_gating_top_k_softmax.py warns it "
            "is unsupported on Ascend950; no autograd (inference graphs only)",
        ),
        OpCapability(
            op="npu.npu_moe_gating_top_k",
            dtypes=FLOAT_DTYPES,
            min_rank=2,
            max_rank=2,
            backward="npu.npu_moe_gating_top_k_backward",
            ge_converter=True,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "max_experts": 2048,  # x.shape[-1] <= 2048
                "min_group_size": 3,  # E / group_count > 2 (the wheel docstring)
                "max_aligned_experts": 2048,  # align32(E / group_count) * group_count <= 2048
                "group_select_modes": (0, 1),  # 0 group max, 1 sum of the group's top 2
                "norm_types": (0, 1),  # 0 softmax, 1 sigmoid
                "renorm": (0,),  # the wheel docstring: only 0 (the CANN README adds 1)
                "bias_same_dtype": True,  # bias (E,) in x's dtype
                "hash_mode_max_k": 64,  # input_ids/tid2eid (CANN README)
                # autograd: backward reads norm_out, so the forward needs out_flag=True, and
                # supports sigmoid (norm_type=1) only
                "backward_norm_types": (1,),
                "backward_needs_out_flag": True,
                "backward_socs": ("Ascend910B", "Ascend910_93"),
                # torch_npu 7.0.0 docs (hiascend ptaoplist_002365) on A2/A3: E == 256,
                # k <= 32, k_group == 4, bias required; later docs lift these
                "legacy_a2_a3": {"experts": 256, "max_k": 32, "k_group": 4, "bias_required": True},
            },
            doc="op_semantics 5.2 / torch_npu docstring (_op_plugin_docs.py npu_moe_gating_top_k): x 2-D "
            "fp16/bf16/fp32, E <= 2048, E % group_count == 0 and E/group_count > 2, "
            "align32(E/group_count)*group_count <= 2048, 1 <= k_group <= group_count, "
            "1 <= k <= k_group*E/group_count, renorm 0 only; CANN README hicann/ops-transformer "
            "moe/moe_gating_top_k (renorm=1 = softmax-mode renorm, hash mode k <= 64; products A2, A3, "
            "950) and moe/moe_gating_top_k_backward (A2/A3 only, sigmoid only); torch_npu 7.0.0 "
            "page ptaoplist_002365 for the older A2/A3 limits",
        ),
        OpCapability(
            op="npu.npu_moe_init_routing_v2",
            dtypes=FLOAT_DTYPES | {torch.int8},  # int8 x only without (re)quantisation
            min_rank=2,
            max_rank=2,
            backward=None,
            ge_converter=True,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "expert_idx_dtype": torch.int32,  # (N, K)
                "drop_pad_modes": (0,),  # dropless only
                # the docs: count (1) and key_value (2) only, with the flag True; the Meta
                # function also accepts 0 (cumsum), the V3 README does not
                "expert_tokens_num_types": (1, 2),
                "expert_tokens_num_flag": True,
                "quant_modes": (-1, 1),  # none, dynamic int8 (newer CANN: MX/FP8/INT4 modes)
                "max_expert_num": 10240,
                "key_value_max_expert_num": 5120,
                "active_num_equals_rows": True,  # V3 README: unused, must equal N*K
                "row_idx_types": (0, 1),  # 0 gather (src -> dst), 1 scatter (dst -> src)
                "socs_of_docs": ("Ascend910B", "Ascend910_93"),
            },
            doc="op_semantics 6.1 / torch_npu docstring (_op_plugin_docs.py npu_moe_init_routing_v2) and "
            "the aclnnMoeInitRoutingV3 doc (hicann/ops-transformer moe/moe_init_routing_v3): x (N, H) "
            "fp16/bf16/fp32/int8, expert_idx (N, K) int32, drop_pad_mode 0, expert_tokens_num_type 1/2 "
            "with the flag True, quant_mode -1/1, expert_num <= 10240 (<= 5120 key_value), "
            "active_num unused (= N*K); products A2/A3 (950 not covered by those docs); no autograd",
        ),
        OpCapability(
            op="npu.npu_moe_compute_expert_tokens",
            dtypes=frozenset({torch.int32}),
            min_rank=1,
            max_rank=1,
            backward=None,
            ge_converter=True,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "max_num_expert": 2048,  # 0 < num_expert <= 2048
                "max_elements": 2**24,  # exclusive
                "output": "cumsum",  # inclusive end offsets: group_list_type=0
            },
            doc="op_semantics 6.2 / torch_npu docstring (_op_plugin_docs.py "
            "npu_moe_compute_expert_tokens): 1-D int32 sorted expert ids in [0, num_expert), fewer than "
            "2^24, 0 < num_expert <= 2048; products Ascend950 and Atlas A2 (A3 not listed); inference",
        ),
        OpCapability(
            op="npu.npu_moe_token_permute",
            dtypes=FLOAT_DTYPES,
            min_rank=2,
            max_rank=2,
            backward="npu.npu_moe_token_permute_grad_v2",
            ge_converter=False,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "max_topk": 512,
                "max_index": 16777215,  # indices.numel() and values < 16777215 (exclusive)
                "index_dtypes": (torch.int32, torch.int64),  # (T,) or (T, topK)
                "padded_mode": False,
                "int8_tokens_socs": ("Ascend950",),
            },
            doc="op_semantics 6.3 / torch_npu docstring (_op_plugin_docs.py ~L16842 "
            "npu_moe_token_permute): tokens (T, H) fp16/bf16/fp32 (int8 on 950), indices 1-D/2-D "
            "int32/int64 < 16777215, topK <= 512, padded_mode False; products A2, A3, 950; "
            "sorted_indices is the inverse of the stable argsort (Megatron's is the argsort); "
            "no GE converter in torchair 2.13",
        ),
        OpCapability(
            op="npu.npu_moe_token_unpermute",
            dtypes=FLOAT_DTYPES,
            min_rank=2,
            max_rank=2,
            backward="npu.npu_moe_token_unpermute_grad_v2",
            ge_converter=False,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "max_topk": 512,  # A2/A3
                "sorted_indices_dtype": torch.int32,  # (T*topK,), no duplicates
                "padded_mode": False,
                "restore_shape": None,
                # on 950 torch_npu forwards to aclnnMoeFinalizeRoutingV2
            },
            doc="op_semantics 6.3 / torch_npu docstring (_op_plugin_docs.py ~L16931 "
            "npu_moe_token_unpermute): permuted_tokens (T*topK, H) fp16/bf16/fp32, sorted_indices int32 "
            "without duplicates, probs (T, topK), padded_mode False, restore_shape None, topK <= 512 on "
            "A2/A3; products A2, A3, 950; no GE converter in torchair 2.13",
        ),
        OpCapability(
            op="npu.npu_moe_finalize_routing",
            dtypes=FLOAT_DTYPES,
            min_rank=2,  # expanded_permuted_rows (N*K, H) dropless
            max_rank=3,  # (E, C, H) drop-pad
            backward=None,
            ge_converter=True,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                # the wheel docstring documents 0 only (k-major); the op-plugin master doc and
                # the MoeFinalizeRoutingV2 kernel add 1 (drop-pad), 2 (token-major, pairs with
                # npu_moe_init_routing_v2) and 3; torch_npu calls V2 for all but the full
                # mode-0 call (GE converter custom/npu_moe_finalize_routing.py likewise)
                "documented_drop_pad_modes": (0,),
                "v2_drop_pad_modes": (0, 1, 2, 3),
                "index_dtype": torch.int32,
                # skip2 None => skip1 None per the wheel docstring; the master doc says the
                # reverse (op_semantics 11.8)
                "skip1_needs_skip2": True,
            },
            doc="op_semantics 6.4 / torch_npu docstring (_op_plugin_docs.py npu_moe_finalize_routing): "
            "expanded_permuted_rows (N*K, H) fp16/bf16/fp32, skip1/skip2 (N, H) and bias (E, H) and "
            "scales (N, K) in its dtype, expanded_src_to_dst_row (N*K,) int32, drop_pad_mode 0; product "
            "Atlas A2 (docstring); modes 1-3 from the op-plugin master doc; no autograd",
        ),
        OpCapability(
            op="npu.npu_grouped_matmul",
            dtypes=FLOAT_DTYPES,  # the float (non-quantised) expert GEMM the MoE passes emit
            min_rank=2,
            max_rank=2,  # x of group_type 0 and 2 (group_type -1 takes 2-6 dims)
            backward=None,  # no autograd in torch_npu ...
            # ... so training graphs call it through our rule: dx by a group_type 0 call, dw by
            # a group_type 2 one (patterns/grouped_matmul.py)
            autograd_rule="npu_fx_fusion.patterns.grouped_matmul.GroupedMatmul",
            ge_converter=True,
            # Atlas inference (310P): fp16 only, group_type 0 only, N % 16 == 0
            socs={"Ascend310P": SocLimits(dtypes=frozenset({torch.float16}))},
            limits={
                # A2/A3 (aclnnGroupedMatmulV5): -1, 0 and 2 (K-split, float only); the wheel's
                # older docstring lists -1 and 0; 310P: 0 only
                "group_types": (-1, 0, 2),
                "310p_group_types": (0,),
                "split_items_single_output": (2, 3),  # group_type 0 and 2
                "group_list_types": (0, 1),  # cumsum, counts (2, sparse pairs: int8 only)
                "group_list_dtype": torch.int64,
                "max_groups_single_weight": 1024,  # one (E, K, N) weight; group_type 2: 1024 groups
                "max_groups_weight_list": 128,
                "max_inner_dim": 65536,  # exclusive: x's K and weight's N (or K transposed)
                "x_transposed": False,  # group_type 0
                "weight_transposed": True,  # a transposed view of (E, N, K); group_type 0
                # group_type 2 (aclnnGroupedMatmulV5, "groupType支持场景"): one x (M, K) that
                # must be a transposed view (its InnerLimit axis is then M), one (K, N) weight
                # that must not be, output (G, M, N) (Meta), group_list over K with its last
                # end (cumsum) or sum (counts) <= K, no bias, non-quantised dtypes only
                "k_split_x_transposed": True,
                "k_split_weight_transposed": False,
                "k_split_bias": False,
                # [inferred] an empty K group's output is zeros: MindSpeed and others use the
                # group_type 2 output as the expert weight gradient directly, with experts
                # that receive no tokens; the docs do not say it, the stand-in zero-fills.
                "k_split_empty_group": "zeros",
                # [unverified] torchair's GE converter (custom/grouped_matmul.py) passes
                # transpose_x=False for every group_type and lowers the x^T view as its own
                # Transpose; whether GE folds it into the K-split kernel's transposed x has
                # not been run on hardware (reduce-overhead / npugraph_ex pass the view)
                "k_split_ge_transpose_x": "unverified",
                "310p_n_multiple": 16,
            },
            doc="op_semantics 7 / torch_npu docstring (_op_plugin_docs.py npu_grouped_matmul): float "
            "x/weight fp16/bf16/fp32 (310P fp16 only, N % 16 == 0), group_type 0 needs split_item 2/3, "
            "a 3-D weight and a group_list of at most 1024 groups (128 for weight lists), cumsum "
            "(group_list_type 0) or counts (1), InnerLimit 65536, weight may be transposed, x not; "
            "group_type 2 (CANN aclnnGroupedMatmulV5, ops-transformer gmm/grouped_matmul docs): x "
            "transposed, weight not, split_item 2/3, no bias, output (G, M, N) (the wheel's Meta); "
            "products A2/A3 and Atlas inference; no autograd in torch_npu (our rule: autograd_rule)",
        ),
    )
}


def check_mode_name(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown torchair mode {mode!r}; known: {', '.join(MODES)}")
    return mode


def capability(op: str) -> OpCapability:
    """The table entry of an op a pass emits; a pass may emit no op the table lacks."""
    try:
        return CAPABILITIES[op]
    except KeyError:
        raise KeyError(f"{op} is emitted by a pass but has no entry in capabilities.CAPABILITIES; "
                       "add one (dtypes, ranks, backward, GE converter) before emitting it") from None


def has_backward(op: str) -> bool:
    """Whether a training graph may emit `op`: torch_npu differentiates it (`backward`)
    and, where the CPU stand-ins serve, the stand-in implements that backward too; or our
    own `autograd_rule` differentiates it (the same on an NPU and with the stand-ins); or it is
    `gradient_free` (only its integer outputs are used).

    Joint-graph patterns are registered only for forms whose emitted ops all pass this:
    an op without one would fail the whole compile when its replacement is traced."""
    cap = capability(op)
    if cap.gradient_free:
        return True
    if cap.backward is None:
        return cap.autograd_rule is not None
    from .npu_ops import real_torch_npu_available, stand_in_differentiable

    if real_torch_npu_available():
        return True
    return stand_in_differentiable(op.replace(".", "::", 1)) is not False


def not_lowerable(op: str, mode: Optional[str]) -> Optional[str]:
    """Why torchair in `mode` could not lower `op`, or None if it can (or mode is unknown)."""
    if mode in GE_MODES and not capability(op).ge_converter:
        return f"{op} has no GE converter in torchair 2.13, so {mode} cannot lower it"
    return None


def detect_soc() -> Optional[str]:
    """The SoC of the current NPU, from torch_npu; None without one."""
    try:
        import torch_npu  # noqa: F401

        name = torch.npu.get_device_name()
    except Exception:  # no torch_npu, or no device: emulation
        return None
    for soc in sorted(SOCS, key=len, reverse=True):
        if name.startswith(soc):
            return soc
    log.warning("unrecognised NPU %r: SoC-specific limits are not applied", name)
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def unsupported(op: str, soc: Optional[str], *, x: torch.Tensor,
                gamma: Optional[torch.Tensor] = None,
                **same_shape_tensors: torch.Tensor) -> Optional[str]:
    """The first limit of `op` (on `soc`, if given) that a call on these tensors breaks.

    `x` is the main input (its dtype and rank are checked), `gamma` a norm weight (its
    dtype must equal x's, or be fp32 where mixed precision is allowed), and the named
    tensors of `same_shape` must match each other. Returns None when the call is fine.
    """
    cap = CAPABILITIES[op]
    limits = cap.socs.get(soc, SocLimits()) if soc else SocLimits()
    where = f" on {soc}" if soc else ""
    if not limits.supported:
        return f"{op} is not available{where}"
    dtypes = limits.dtypes or cap.dtypes
    if x.dtype not in dtypes:
        return f"{op} does not support {_dtype_name(x.dtype)}{where}"
    if not cap.min_rank <= x.dim() <= cap.max_rank:
        return f"{op} takes {cap.min_rank}-{cap.max_rank} dims, input has {x.dim()}"
    if gamma is not None and gamma.dtype != x.dtype:
        mixed = gamma.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)
        if not mixed:
            return (f"{op}: weight dtype {_dtype_name(gamma.dtype)} differs from input "
                    f"dtype {_dtype_name(x.dtype)}")
        if not limits.mixed_gamma:
            return f"{op}: fp32 weight with {_dtype_name(x.dtype)} input is not supported{where}"
    shaped = [same_shape_tensors[name] for name in cap.same_shape if name in same_shape_tensors]
    if any(t.shape != shaped[0].shape or t.dtype != shaped[0].dtype for t in shaped[1:]):
        desc = ", ".join(f"{name} {tuple(t.shape)} {_dtype_name(t.dtype)}"
                         for name, t in zip(cap.same_shape, shaped))
        return f"{op} needs {' and '.join(cap.same_shape)} of one shape and dtype, got {desc}"
    return None


# ---- DeepSeek-V3.2 sparse attention (npu_ops/attention.py; op_semantics sections 8 and 10) ----
# Appended as a block of its own. `x` of unsupported() is the op's query. sparse_attention
# and lightning_indexer emit the two npu forward ops (their grad ops, in training graphs, come
# from the forward ops' autograd); softmax_l1_norm the cann_ops_transformer ones.
CAPABILITIES.update({
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_lightning_indexer",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # query and key, one dtype
            min_rank=3,  # TND
            max_rank=4,  # BSND
            # through sparse_values only (output_differentiability [false, true]), so the
            # forward needs return_value=True (the stand-in's backward raises otherwise).
            # transformers' indexer runs under no_grad and returns only the indices: the
            # pass emits return_value=False, in training graphs too (matched on the joint
            # graph, forward_forms_on_joint), and never its backward
            backward="npu.npu_lightning_indexer_grad",
            ge_converter=True,  # custom/lightning_indexer.py -> GE LightningIndexer
            socs={
                "Ascend310P": SocLimits(supported=False),
                # Atlas 350 (950): weights fp16/bf16 only, N1 in {8, 16, 24, 32, 64}
                "Ascend950": SocLimits(),
            },
            limits={
                "head_dim": 128,  # query and key D
                "max_query_heads": 64,  # N1 <= 64
                "query_heads_950": (8, 16, 24, 32, 64),
                "key_heads": 1,  # N2
                "layouts_query": ("BSND", "TND"),
                "layouts_key": ("BSND", "TND", "PA_BSND"),  # key layout = query layout unless paged
                "pa_block_size_multiple": 16,  # PA_BSND block_size: a multiple of 16, <= 1024
                "pa_max_block_size": 1024,
                "max_sparse_count": 2048,  # sparse_count in [1, 2048] or one of:
                "large_sparse_counts": (3072, 4096, 5120, 6144, 7168, 8192),
                "sparse_modes": (0, 3),  # none, right-down causal
                "pre_next_tokens_default_only": True,
                "weights_dtypes": (torch.float16, torch.bfloat16, torch.float32),  # fp32: not on 950
                "weights_fp32_socs": ("Ascend910B", "Ascend910_93"),
                # return_value: training only and not with paged keys; in graph mode only on 950
                "return_value_with_paged_key": False,
                "return_value_graph_socs": ("Ascend950",),
                "actual_seq_lengths_dtype": torch.int32,  # TND: cumulative; PA_BSND key: per batch, required
            },
            doc="op_semantics 8.1 / op-plugin doc torch_npu-npu_lightning_indexer.md: products Atlas A2 and "
            "A3 inference, Atlas 350 (950); query/key fp16/bf16 (one dtype), weights fp16/bf16 or fp32 "
            "(not on 950), D == 128, N1 <= 64 (950: 8/16/24/32/64), N2 == 1, PA block_size % 16 == 0 and "
            "<= 1024, sparse_count in [1, 2048] or 3072..8192 step 1024, sparse_mode 0/3, default "
            "pre/next_tokens only, return_value not with PA_BSND; GE converter custom/lightning_indexer.py; "
            "autograd NpuLightningIndexerBackward0 through sparse_values",
        ),
        OpCapability(
            op="npu.npu_sparse_flash_attention",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # query, key, value (and ropes), one dtype
            min_rank=3,  # TND
            max_rank=4,  # BSND
            # needs softmax_max/sum, i.e. return_softmax_lse=True (the stand-in's backward raises
            # otherwise): the joint replacement (training graphs) sets it, the forward-only one
            # (inference) does not. Grads of query, key, value, query_rope, key_rope; none for
            # sinks. Its grad op has no GE converter, and the docs refuse return_softmax_lse in
            # graph mode: joint sites are refused under max-autotune (read as GE graph mode;
            # ACL graph capture runs the aclnn kernels as single ops do [inferred])
            backward="npu.npu_sparse_flash_attention_grad",
            ge_converter=True,  # custom/sparse_flash_attention.py -> GE SparseFlashAttention
            socs={
                "Ascend310P": SocLimits(supported=False),
                # 950 per op_semantics 8.2 (N1 any of 1..128, sparse_block_size 1 only, sinks);
                # the op-plugin master doc lists A2/A3 inference only
                "Ascend950": SocLimits(),
            },
            limits={
                "head_dim": 512,  # query, key, value D
                "rope_head_dim": 64,  # query_rope, key_rope D
                "query_heads": (1, 2, 4, 8, 16, 32, 64, 128),  # 950: any of 1..128
                "max_query_heads_950": 128,
                "key_heads": 1,  # KV_N
                "layouts_query": ("BSND", "TND"),
                "layouts_kv": ("BSND", "TND", "PA_BSND"),  # kv layout = query layout unless paged
                "pa_block_size_multiple": 16,
                "pa_max_block_size": 1024,
                "max_sparse_block_size": 128,  # a power of 2 in [1, 128], dividing the PA block_size
                "sparse_block_size_power_of_2": True,
                "sparse_block_sizes_950": (1,),
                "sparse_modes": (0, 3),
                "attention_modes": (2,),  # the docs: only 2 (MLA absorb, key and value one tensor)
                "pre_next_tokens_default_only": True,
                # return_softmax_lse: training only, not with PA_BSND, not in graph mode
                "return_softmax_lse_with_paged_kv": False,
                "return_softmax_lse_in_graph": False,
                "value_none_min_cann": "9.2.0",  # the wheel's Meta function
                "sinks_socs": ("Ascend950",),  # undocumented semantics: no CPU reference
                "sparse_indices_dtype": torch.int32,
            },
            doc="op_semantics 8.2 / op-plugin doc torch_npu-npu_sparse_flash_attention.md: products Atlas A2 "
            "and A3 inference (950 per op_semantics); query/key/value fp16/bf16 of one dtype, D == 512, rope "
            "D == 64, N1 a power of 2 <= 128, KV_N == 1, sparse_block_size a power of 2 in [1, 128] dividing "
            "the PA block_size (16k <= 1024), sparse_mode 0/3, attention_mode 2, default pre/next_tokens, "
            "return_softmax_lse not with PA_BSND nor in graph mode; value=None needs CANN >= 9.2 (Meta); "
            "GE converter custom/sparse_flash_attention.py; autograd NpuSparseFlashAttentionBackward0",
        ),
        # The backward ops torch_npu's autograd emits for the two forward ops above (training
        # graphs: the joint replacements trace them). Not emitted by a pass directly.
        OpCapability(
            op="npu.npu_lightning_indexer_grad",
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            min_rank=3,  # TND
            max_rank=4,  # BSND
            backward=None,
            ge_converter=False,  # torchair 2.13 has no converter: not lowerable under max-autotune
            limits={"layouts": ("BSND", "TND")},  # one layout for query and key: no paged keys
            doc="op_semantics 1 / 8.1: npu_lightning_indexer's backward (NpuLightningIndexerBackward0), "
            "dquery, dkey, dweights from the gradient of sparse_values; BSND / TND (one layout); "
            "no GE converter in torchair 2.13",
        ),
        OpCapability(
            op="npu.npu_sparse_flash_attention_grad",
            dtypes=frozenset({torch.float16, torch.bfloat16}),
            min_rank=3,  # TND
            max_rank=4,  # BSND
            backward=None,
            ge_converter=False,  # torchair 2.13 has no converter: not lowerable under max-autotune
            limits={"layouts": ("BSND", "TND")},  # one layout for query and kv: no paged kv
            doc="op_semantics 1 / 8.2: npu_sparse_flash_attention's backward "
            "(NpuSparseFlashAttentionBackward0), from out and softmax_max / softmax_sum "
            "(return_softmax_lse=True); grads of query, key, value, query_rope, key_rope; BSND / TND (one "
            "layout); no GE converter in torchair 2.13",
        ),
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla_softmax_l1_norm",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # q and k, one dtype; lse fp32
            min_rank=3,  # TND
            max_rank=4,  # BSND
            backward=None,
            ge_converter=False,  # not a torch_npu op: torchair 2.13 has no converter for it
            socs={soc: SocLimits(supported=soc == "Ascend950") for soc in SOCS},  # 950PR/950DT only
            limits={
                "package": "cann_ops_transformer",  # torch.ops.cann_ops_transformer, not torch_npu
                "head_dim": 512,
                "max_query_heads": 128,  # N1 in 1..128
                "key_heads": 1,
                "layouts": ("BSND", "TND"),  # layout_q == layout_k
                "mask_modes": (0, 3),
                "max_cmp_ratio": 128,  # cmp_ratio in 1..128
                "needs_metadata": "cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata",
                # torchair: single-op and ACL graph (reduce-overhead) per the docs' examples
                "modes": ("reduce-overhead", "npugraph_ex"),
            },
            doc="op_semantics 10 / cann_ops_transformer docs (hicann/ops-transformer torch_extension/"
            "cann_ops_transformer/docs/zh/sparse_flash_mla_softmax_l1_norm.md): Ascend 950PR/950DT only; q/k "
            "fp16/bf16, D == 512, N1 1..128, N2 == 1, BSND/TND (equal), mask_mode 0/3, cmp_ratio 1..128, "
            "metadata from the _metadata op required; fp32 output; no autograd; no GE converter (not in "
            "torch_npu)",
        ),
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata",
            dtypes=frozenset({torch.int32}),  # its tensors: cu_seqlens / seqused / topk_length
            min_rank=1,
            max_rank=1,
            backward=None,
            ge_converter=False,
            socs={soc: SocLimits(supported=soc == "Ascend950") for soc in SOCS},
            limits={
                "package": "cann_ops_transformer",
                "head_dim": 512,
                "max_query_heads": 128,
                "key_heads": 1,
                "output": "int32[64] on the host (an AICPU tiling helper; move it to the device)",
                "bsnd_needs": ("batch_size", "max_seqlen_q", "max_seqlen_k"),
                "tnd_needs": ("cu_seqlens_q", "cu_seqlens_k"),
            },
            doc="op_semantics 10 / cann_ops_transformer docs: the tiling metadata of "
            "sparse_flash_mla_softmax_l1_norm, int32[64]; Ascend 950 only; no GE converter",
        ),
    )
})
# ---- end of the DeepSeek-V3.2 sparse attention block ----


# ---- DeepSeek-V4 (npu_ops/mhc.py, rope.py, activation.py, attention.py, moe.py) ---------------
# Appended as a block of its own. shared/reference/deepseek_v4.md, checked against the torch-npu
# 2.13.0 wheel (_op_plugin_docs.py, meta registrations, torchair's converters), the CANN
# ops-transformer extension at mirror-cann/ops-transformer 3a280bc (COT: torch_extension/
# cann_ops_transformer/{docs/zh,ops,ops/graph_convert}) and hicann/ops-nn (CON). `x` of
# unsupported() is the op's first tensor input.
#
# GE converters of the extension ops: torchair 2.13 has none; an extension registers its own
# (graph_convert_*.py) when it is imported, which it must be for its ops to exist at all. So
# `ge_converter` is True where the extension's converter builds a real GE op, and
# limits["ge_converter_source"] names that file (tests/test_capabilities.py checks the npu ops
# against torchair and these against this column); converters that only raise count as none.
_ONLY_950 = {soc: SocLimits(supported=soc == "Ascend950") for soc in SOCS}
_A2_A3_950 = {"Ascend310P": SocLimits(supported=False)}
_A2_A3_INFERENCE = {"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)}
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

CAPABILITIES.update({
    cap.op: cap
    for cap in (
        # -- mHC ------------------------------------------------------------------------------
        OpCapability(
            op="npu.npu_mhc_pre",
            dtypes=_HALF_DTYPES,  # x; phi / alpha / bias / gamma fp32
            min_rank=3,  # [T, n, D]
            max_rank=4,  # [B, S, n, D]
            backward="npu.npu_mhc_pre_backward",
            ge_converter=False,  # torchair 2.13: none (its docs show reduce-overhead only)
            socs=_ONLY_950,
            limits={
                "streams": (4, 6, 8),  # n
                "max_dim": 16384, "dim_multiple": 16,  # D in 1..16384, 16-aligned
                "backward_needs_out_flag": True,  # the backward reads inv_rms / h_mix / h_pre
                "phi_dtype": torch.float32,
            },
            doc="deepseek_v4.md 3.2 / torch_npu docstring npu_mhc_pre (_op_plugin_docs.py): Ascend 950 only; x "
            "bf16/fp16 [B, S, n, D] or [T, n, D], phi fp32 [n^2 + 2n, nD], alpha [3] (or [2]: two mappings), "
            "bias [n^2 + 2n], gamma fp32 [n, D]; n 4 / 6 / 8, D <= 16384 and 16-aligned; h_res returned BEFORE "
            "Sinkhorn; autograd NpuMhcPreBackward0 (needs out_flag=1); no GE converter in torchair 2.13",
        ),
        OpCapability(
            op="npu.npu_mhc_pre_backward", dtypes=_HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
            ge_converter=False, socs=_ONLY_950,
            doc="npu_mhc_pre's backward (NpuMhcPreBackward0): grads of x, phi, alpha, bias, gamma from those of "
            "h_in, h_post and the pre-Sinkhorn h_res; Ascend 950; no GE converter",
        ),
        OpCapability(
            op="npu.npu_mhc_sinkhorn",
            dtypes=frozenset({torch.float32}),
            min_rank=3,
            max_rank=4,
            backward="npu.npu_mhc_sinkhorn_backward",
            ge_converter=False,
            socs=_ONLY_950,
            limits={"streams": (4, 6, 8), "iterations": (1, 100), "backward_needs_out_flag": True},
            doc="deepseek_v4.md 3.2 / torch_npu docstring npu_mhc_sinkhorn: fp32 [B, S, n, n] or [T, n, n], n 4 / 6 / "
            "8, num_iters 1..100; softmax + eps, a column normalisation, then num_iters - 1 row / column "
            "normalisations (each + eps): transformers' loop exactly; 'Atlas A5' (950) only; autograd "
            "NpuMhcSinkhornBackward0 (needs out_flag=1); no GE converter",
        ),
        OpCapability(
            op="npu.npu_mhc_sinkhorn_backward", dtypes=frozenset({torch.float32}), min_rank=3, max_rank=4,
            backward=None, ge_converter=False, socs=_ONLY_950,
            doc="npu_mhc_sinkhorn's backward, from its norm_out / sum_out; Ascend 950; no GE converter",
        ),
        OpCapability(
            op="npu.npu_mhc_post",
            dtypes=_HALF_DTYPES,  # x and h_out; h_res / h_post fp32
            min_rank=3,
            max_rank=4,
            backward="npu.npu_mhc_post_backward",
            ge_converter=False,
            socs=_ONLY_950,
            limits={"streams": (4, 6, 8), "h_res_none_socs": ("Ascend950",)},
            doc="deepseek_v4.md 4.2 / torch_npu docstring npu_mhc_post: y = h_res^T x + h_out (x) h_post; x, h_out "
            "bf16/fp16 (one dtype), h_res, h_post fp32; n 4 / 6 / 8; 950 only; autograd NpuMhcPostBackward0; no GE "
            "converter",
        ),
        OpCapability(
            op="npu.npu_mhc_post_backward", dtypes=_HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
            ge_converter=False, socs=_ONLY_950,
            doc="npu_mhc_post's backward (NpuMhcPostBackward0); Ascend 950; no GE converter",
        ),
        OpCapability(
            op="cann_ops_transformer.mhc_pre_sinkhorn",
            dtypes=frozenset({torch.bfloat16}),  # x; phi / alpha / bias fp32
            min_rank=4,
            max_rank=4,  # (B, S, N, C) only: the Meta reads four sizes
            backward=None,  # no dispatcher autograd: the extension's MhcPreSinkhornFunction ...
            autograd_rule="npu_fx_fusion.patterns.mhc_pre.MhcPreSinkhorn",  # ... mirrored by ours
            ge_converter=True,
            socs=_A2_A3_950,
            limits={
                "package": "cann_ops_transformer",
                "ge_converter_source": "ops/graph_convert/graph_convert_mhc_pre_sinkhorn.py (GE MhcPreSinkhorn)",
                "backward_op": "cann_ops_transformer.mhc_pre_sinkhorn_backward",
                "streams": (4,),  # N = 4 only
                "iterations": (20,),  # numIters = 20 only
                "a2_a3_dim_multiple": 128, "a2_a3_max_dim": 100000,  # C on A2/A3
                "dims_950": (4096, 7168),  # C on 950
            },
            doc="deepseek_v4.md 3.3 / COT docs/zh/mhc_pre_sinkhorn.md: 950, A2, A3; x bf16 (B, S, N, C), N = 4 and "
            "numIters = 20 only, C 128-aligned in [1, 100000] on A2/A3 and 4096 / 7168 on 950; positional "
            "(hcMult, numIters, hcEps, normEps, outFlag); training through MhcPreSinkhornFunction "
            "(mhc_pre_sinkhorn_backward); COT GE converter MhcPreSinkhorn",
        ),
        OpCapability(
            op="cann_ops_transformer.mhc_pre_sinkhorn_backward", dtypes=frozenset({torch.bfloat16}), min_rank=4,
            max_rank=4, backward=None, ge_converter=True, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer",
                    "ge_converter_source": "ops/graph_convert/graph_convert_mhc_pre_sinkhorn_backward.py "
                                           "(GE MhcPreSinkhornBackward)"},
            doc="mhc_pre_sinkhorn's backward (COT ops/mhc_pre_sinkhorn_backward.py): dx, dphi, dalpha, dbias",
        ),
        OpCapability(
            op="cann_ops_transformer.mhc_post",
            dtypes=_HALF_DTYPES,
            min_rank=3,
            max_rank=4,
            backward=None,  # the extension's MhcPostFunction (mhc_post_backward), mirrored by ours
            autograd_rule="npu_fx_fusion.patterns.mhc_post.MhcPost",
            ge_converter=False,  # the extension has no converter for it
            # The 950 conflict (deepseek_v4.md 16.3): the extension doc (docs/zh/mhc_post.md) says 950
            # "不支持"; the kernel's own README (mhc/mhc_post/README.md) lists 950 as supported, the
            # kernel has arch35 (950) sources (op_kernel/arch35/mhc_post*.h, op_tiling/arch35/*) and
            # torchtitan-npu calls it on A5. Decided from the kernel: supported on 950 (the
            # extension doc read as stale); npu_mhc_post is preferred there anyway (patterns/mhc_post.py).
            socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer", "backward_op": "cann_ops_transformer.mhc_post_backward",
                    "streams": (4, 6, 8),
                    "950_evidence": "kernel README and arch35 kernel sources: supported (extension doc: not)"},
            doc="deepseek_v4.md 4.2 / COT docs/zh/mhc_post.md: x, h_out bf16/fp16, h_res (required) and h_post "
            "fp32, (B, S, n, D) or (T, n, D); A2 / A3 (and 950, see the socs comment); training through "
            "MhcPostFunction (mhc_post_backward); no GE converter",
        ),
        OpCapability(
            op="cann_ops_transformer.mhc_post_backward", dtypes=_HALF_DTYPES, min_rank=3, max_rank=4, backward=None,
            ge_converter=False, socs=_A2_A3_950, limits={"package": "cann_ops_transformer"},
            doc="mhc_post's backward (COT ops/mhc_post_backward.py); no GE converter",
        ),
        # -- partial RoPE ---------------------------------------------------------------------
        OpCapability(
            op="cann_ops_transformer.inplace_partial_rotary_mul",
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
        ),
        OpCapability(
            op="cann_ops_transformer.inplace_partial_rotary_mul_backward", dtypes=FLOAT_DTYPES, min_rank=4,
            max_rank=4, backward=None, ge_converter=True, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer",
                    "ge_converter_source": "ops/graph_convert/graph_convert_inplace_partial_rotary_mul_backward.py "
                                           "(GE InplacePartialRotaryMulGrad)"},
            doc="inplace_partial_rotary_mul's backward: grad_output rotated back in place",
        ),
        # -- compressed sparse MLA attention and its indexer ------------------------------------
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla",
            dtypes=_HALF_DTYPES,  # q, ori_kv, cmp_kv one dtype; sinks fp32
            min_rank=3,  # TND
            max_rank=4,  # BSND
            backward=None,  # none in the extension (torchtitan-npu wraps it); ours calls sparse_flash_mla_grad
            autograd_rule="npu_fx_fusion.patterns.sparse_mla.SparseFlashMla",
            ge_converter=False,  # graph_convert_sparse_flash_mla.py: the metadata op only, and it raises
            socs=_A2_A3_950,
            limits={
                "package": "cann_ops_transformer",
                "backward_op": "cann_ops_transformer.sparse_flash_mla_grad",
                "head_dim": 512,
                "key_heads": 1,
                "query_heads": (1, 2, 4, 8, 16, 32, 64, 128),  # 950: not 1
                "query_heads_950": (2, 4, 8, 16, 32, 64, 128),
                "ori_mask_modes_a2_a3": (4,), "ori_mask_modes_950": (0, 3, 4),
                "cmp_mask_modes": (3,),
                "ori_win_left": (127,), "ori_win_right": (0,),
                "cmp_ratios_a2_a3": (1, 4, 128), "max_cmp_ratio": 128,
                "csa_topk_a2_a3": (512, 1024),
                "sinks_required_a2_a3": True,
                "metadata": {"Ascend950": "required", "Ascend910B": "none", "Ascend910_93": "none"},
                "layouts": ("BSND", "TND"),  # q and kv alike (PA_BBND kv too: not emitted)
            },
            doc="deepseek_v4.md 9.2 / COT docs/zh/sparse_flash_mla.md: 950, A2, A3; q/ori_kv/cmp_kv bf16/fp16, D = 512, "
            "N2 = 1, N1 in {1, 2, 4, ..., 128} (950: not 1); ori_mask_mode 4 with ori_win_left 127 / ori_win_right 0 "
            "only (A2/A3), cmp_mask_mode 3, cmp_ratio 1 / 4 / 128 on A2/A3, CSA top-k 512 or 1024 (A2/A3); sinks fp32 "
            "[N1]; cmp_residual_kv for CSA/HCA; metadata required on 950, none on A2/A3; no autograd in the "
            "extension; no GE converter (aclgraph only)",
        ),
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla_metadata", dtypes=frozenset({torch.int32}), min_rank=1,
            max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer", "output": "int32[1024], shape-only tiling"},
            doc="sparse_flash_mla's AICPU tiling metadata (COT ops/sparse_flash_mla.py); its GE converter raises",
        ),
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla_grad", dtypes=_HALF_DTYPES, min_rank=3, max_rank=4,
            backward=None, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer", "metadata": {"Ascend950": "required"}},
            doc="deepseek_v4.md 9.2 / COT docs/zh/sparse_flash_mla_grad.md: (dq, dori_kv, dcmp_kv, dsinks, "
            "ori_softmax_l1norm, cmp_softmax_l1norm); A2/A3: no seqused / topk_length / metadata, the forward's "
            "mask limits; no GE converter",
        ),
        OpCapability(
            op="cann_ops_transformer.sparse_flash_mla_grad_metadata", dtypes=frozenset({torch.int32}), min_rank=1,
            max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer"},
            doc="sparse_flash_mla_grad's tiling metadata (COT ops/sparse_flash_mla_grad.py)",
        ),
        OpCapability(
            op="cann_ops_transformer.lightning_indexer",
            dtypes=_HALF_DTYPES,  # q and k; w fp32
            min_rank=3,
            max_rank=4,
            backward=None,  # returns indices: no gradient
            gradient_free=True,  # the CSA form uses its int32 indices only (return_value False)
            ge_converter=False,  # graph_convert_lightning_indexer.py: the metadata op only, and it raises
            socs=_A2_A3_950,
            limits={
                "package": "cann_ops_transformer",
                "head_dim": 128, "key_heads": 1, "max_query_heads": 64, "metadata_query_heads": (32, 64),
                "max_topk": 2048, "large_topks": (3072, 4096, 5120, 6144, 7168, 8192),
                "mask_modes": (0, 3), "max_cmp_ratio": 128,
                "weights_dtype": torch.float32,
            },
            doc="deepseek_v4.md 8.2 / COT docs/zh/lightning_indexer.md: 950, A2, A3; q (B, S1, N1, 128) / (T1, N1, "
            "128), k one head, w fp32 (B, S1, N1); topk 1..2048 (+ 3072..8192); mask_mode 3 with cmp_ratio and "
            "cmp_residual_k: the compressed right-down causal mask; indices int32 (-1 padded); no autograd; no GE "
            "converter",
        ),
        OpCapability(
            op="cann_ops_transformer.lightning_indexer_metadata", dtypes=frozenset({torch.int32}), min_rank=1,
            max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer"},
            doc="lightning_indexer's tiling metadata (COT ops/lightning_indexer.py); its GE converter raises",
        ),
        # -- clamped SwiGLU -------------------------------------------------------------------------
        OpCapability(
            op="cann_ops_nn.swiglu_group",
            dtypes=FLOAT_DTYPES,
            min_rank=1,
            max_rank=8,
            backward=None,  # SwigluGroupFn in the extension, mirrored by ours (swiglu_group_backward)
            autograd_rule="npu_fx_fusion.patterns.swiglu_group.SwigluGroup",
            ge_converter=False,  # CON has converters for the backward and the quant ops, not this one
            socs=_ONLY_950,
            limits={"package": "cann_ops_nn", "backward_op": "cann_ops_nn.swiglu_group_backward",
                    "weight_dtype": torch.float32, "contiguous": True, "clamp_off": -1.0},
            doc="deepseek_v4.md 12.2 / CON aclnnSwigluGroup.md and activation/swiglu_group/torch_extension/"
            "swiglu_group.py: Ascend 950 only; x fp16/bf16/fp32 1-8 dims, contiguous; weight fp32, one per row; "
            "clamp_limit > 0 clamps the gate above and up both ways (-1.0: off); training through SwigluGroupFn "
            "(swiglu_group_backward); no forward GE converter found",
        ),
        OpCapability(
            op="cann_ops_nn.swiglu_group_backward", dtypes=FLOAT_DTYPES, min_rank=2, max_rank=3, backward=None,
            ge_converter=True, socs=_ONLY_950,
            limits={"package": "cann_ops_nn",
                    "ge_converter_source": "torch_extension/cann_ops_nn/ops/activation/swiglu_group_backward/"
                                           "graph_convert_swiglu_group_backward.py"},
            doc="CON swiglu_group_backward.md: grad_output / x 2-D or 3-D, weight (.., 1) fp32 with y_origin (the "
            "unweighted forward), clamp_limit >= 0 (0: off), open-interval clamp masks; Ascend 950",
        ),
        OpCapability(
            op="npu.npu_clipped_swiglu",
            dtypes=FLOAT_DTYPES,
            min_rank=2,
            max_rank=8,
            backward=None,  # none in torch_npu: inference only
            ge_converter=True,  # custom/npu_clipped_swiglu.py -> GE ClippedSwiglu
            # torch_npu's docstring lists Atlas A2 / A3 inference series only (ops-nn ships kernel
            # configs for ascend950 too; the torch_npu API's docs are followed)
            socs=_A2_A3_INFERENCE,
            limits={"contiguous": True, "group_index_dtype": torch.int64},
            doc="deepseek_v4.md 12.3 / torch_npu docstring npu_clipped_swiglu: fp16/bf16/fp32, > 1 dim, contiguous, "
            "dim even; A = min(A, limit), B = clamp(B, -limit, limit), y = A sigmoid(alpha A) (B + bias), halves or "
            "even/odd; Atlas A2/A3 inference series; no autograd; GE converter ClippedSwiglu",
        ),
    )
})

# npu_moe_gating_top_k's sqrt-softplus mode (norm_type 2, DeepSeek-V4's routers): CANN README
# (mirror-cann/ops-transformer 3a280bc moe/moe_gating_top_k/README.md) "仅Ascend 950PR/Ascend
# 950DT支持"; the torch_npu docstring documents 0 / 1 only, so whether its host path passes 2
# through is unverified (deepseek_v4.md 11.2). No backward (sigmoid only).
_GATING = CAPABILITIES["npu.npu_moe_gating_top_k"]
CAPABILITIES["npu.npu_moe_gating_top_k"] = OpCapability(
    **{**_GATING.__dict__,
       "limits": {**_GATING.limits, "norm_types": (0, 1, 2), "norm_type_socs": {2: ("Ascend950",)},
                  "norm_type_2_torch_npu_docs": "undocumented (0 / 1 only)"}})


def only_on(op: str) -> Optional[str]:
    """For a SoC-restricted op: "<op> runs on <SoCs> only" (a site's note in emulation, where no
    SoC is known), else None."""
    cap = CAPABILITIES[op]
    socs = [soc for soc in SOCS if cap.socs.get(soc, SocLimits()).supported]
    return f"{op} runs on {', '.join(socs)} only" if len(socs) < len(SOCS) else None
# ---- end of the DeepSeek-V4 block ----

# ---- NPU dispatch block: the FlashAttention ops torch_npu's own SDPA kernel calls ----
# (npu_dispatch.py, npu_ops/fusion_attention.py). Appended as a block of its own. Limits from
# the wheel's npu_fusion_attention_v3 docstring (_op_plugin_docs.py ~L1895) and op_semantics 9.1;
# SoC gates from op-plugin's kernels (npu_fusion_attention_v3_symint refuses Ascend950, whose
# SDPA calls npu_fusion_attention instead; below Ascend910B1 SDPA takes its math path).
_FA_LIMITS = {
    "max_head_dim": 768,  # Dq = Dk >= Dv, 1..768
    "max_query_heads": 256,  # Nq 1..256, Nq % Nkv == 0
    "layouts": ("BSH", "SBH", "BSND", "BNSD", "TND"),  # TND is not stood in on CPU
    "sparse_modes": tuple(range(9)),  # 0-3 stood in on CPU
    "atten_mask": "bool / uint8, True = masked out; SS, B1SS, BNSS, 11SS; sparse_mode 2 / 3: triu(ones(2048, 2048), 1)",
}
CAPABILITIES.update({
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_fusion_attention_v3",
            dtypes=FLOAT_DTYPES,
            min_rank=3,
            max_rank=4,
            backward="npu.npu_fusion_attention_grad_v3",  # NpuFusionAttentionV3Backward0
            ge_converter=False,  # torchair 2.13 has none (attention_inference.md 2.3): not lowerable in max-autotune
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits=_FA_LIMITS,
            doc="npu_fusion_attention's graph-mode version (docstring: aclgraph supports BNSD); what torch_npu's "
                "SDPA calls below Ascend950; training and inference; Atlas A2 training series in the docs",
        ),
        OpCapability(
            op="npu.npu_fusion_attention_grad_v3",
            dtypes=FLOAT_DTYPES,
            min_rank=3,
            max_rank=4,
            backward=None,
            ge_converter=False,
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits=_FA_LIMITS,
            doc="npu_fusion_attention_v3's backward (derivatives.yaml): dq, dk, dv, dpse, dsink from the forward's "
                "softmax_max / softmax_sum / output",
        ),
        OpCapability(
            op="npu.npu_fusion_attention",
            dtypes=FLOAT_DTYPES,
            min_rank=3,
            max_rank=4,
            backward="npu.npu_fusion_attention_grad",  # NpuFusionAttentionBackward0
            ge_converter=True,  # custom/npu_fusion_attention.py:4 (BSH/BNSD, keep_prob 1 only)
            socs={"Ascend310P": SocLimits(supported=False)},
            limits=_FA_LIMITS,
            doc="training FlashAttention (op_semantics 9.1); what torch_npu's SDPA calls on Ascend950",
        ),
        OpCapability(
            op="npu.npu_fusion_attention_grad",
            dtypes=FLOAT_DTYPES,
            min_rank=3,
            max_rank=4,
            backward=None,
            ge_converter=True,  # custom/npu_fusion_attention.py:75
            socs={"Ascend310P": SocLimits(supported=False)},
            limits=_FA_LIMITS,
            doc="npu_fusion_attention's backward (derivatives.yaml)",
        ),
    )
})
# ---- end of the NPU dispatch block ----

# ---- Inference attention and KV-cache writes (npu_ops/infer_attention.py, npu_ops/kv_cache.py;
# shared/reference/attention_inference.md sections 3-5) ----
# Appended as a block of its own. `x` of unsupported() is the op's first tensor input (the
# query, the cache, the latent kv).
CAPABILITIES.update({
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_fused_infer_attention_score",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # query; int8 only with quantisation
            min_rank=3,  # BSH / TND
            max_rank=4,  # BNSD / BSND
            backward=None,  # no autograd node in torch_npu: inference graphs only
            ge_converter=True,  # custom/fused_infer_attention_score.py -> GE FusedInferAttentionScore
            # the 2.13 docstring lists Atlas A2 and A3 only ("支持的芯片型号"); Atlas inference
            # (310P) has PFA/IFA in fp16 but not FIA; 950 has FIA_v2, which no pass emits
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits={
                "layouts": ("BNSD", "BSND"),  # the ones the attention pass emits (also BSH, TND, ...)
                "head_dim_multiple": 16,  # fp16 / bf16 D 16-aligned (Q_S > 1; 32 for int8)
                "max_head_dim": 512,
                "max_heads": 256,
                "max_batch": 65536,
                "max_group": 64,  # num_heads / num_key_value_heads
                "max_bsnd_hidden": 65535,  # N * D < 65535 in BSH / BSND (Q_S > 1)
                "max_decode_kv_len": 262144,  # Q_S = 1: KV_S <= 262144
                "key_value_one_shape": True,  # "key、value中对应tensor的shape需要完全一致"
                "contiguous": True,  # query, key, value, atten_mask: no non-contiguous tensors
                "compressed_mask_size": 2048,  # sparse_mode 2/3/4: triu(ones(2048, 2048), 1)
                "sparse_modes": (0, 1, 2, 3, 4),
                "decode_inner_precise": (0, 1),  # Q_S = 1; 2 / 3 add the invalid-row correction
                # torchair's ACL modes rewrite it to its .out overload with a static workspace
                # and make actual_seq_lengths(_kv) replay parameters (acl_graph.py:108-135)
                "acl_out_rewrite": True,
                # page attention (block_table): block_size <= 512, 16-aligned for fp16/bf16 with
                # Q_S = 1, 128..512 and a multiple of 128 with Q_S > 1; the (blocks, block_size, H)
                # cache layout takes N_kv * D <= 65535; actual_seq_lengths_kv required
                "paged_decode_block_multiple": 16,
                "paged_prefill_block_multiple": 128,
                "paged_min_prefill_block_size": 128,
                "paged_max_block_size": 512,
                "paged_max_hidden": 65535,
            },
            doc="attention_inference.md 3.1-3.2 / torch_npu 2.13.0 docstring (_op_plugin_docs.py "
            "npu_fused_infer_attention_score, ~L8053) and Meta function: query fp16/bf16/int8 (no fp32), "
            "key and value of one shape, contiguous inputs, layouts BSH/BSND/BNSD/BNSD_BSND/TND; Q_S > 1: "
            "B <= 65536, N <= 256, D <= 512 and 16-aligned, N*D < 65535 in BSH/BSND; Q_S = 1 (IFA branch): "
            "KV_S <= 262144, sparse_mode / pre / next ignored, inner_precise 0/1; GQA num_heads % "
            "num_key_value_heads == 0, ratio <= 64; mask True = masked, sparse_mode 2/3/4 with the "
            "compressed 2048x2048 mask; page attention: block_table (B, max_blocks) int32, unchecked ids, "
            "actual_seq_lengths_kv required, block_size 16-aligned <= 512 (Q_S = 1) or 128..512 multiple of "
            "128 (Q_S > 1), caches (blocks, block_size, H) or (blocks, N, block_size, D), mask last dim >= "
            "max_blocks * block_size; products Atlas A2/A3; GE converter "
            "custom/fused_infer_attention_score.py (.default only); no autograd",
        ),
        OpCapability(
            op="npu.scatter_update",
            dtypes=frozenset({torch.int8, torch.float16, torch.float32, torch.bfloat16, torch.int32}),
            min_rank=2,
            max_rank=8,
            backward=None,
            # custom/scatter_update.py: TensorMove(data) + Scatter(reduce="update", axis) (a full
            # copy of the cache), and scatter_update_ -> Scatter in place, which torchair's
            # recover_view_inplace_pattern substitutes for view -> scatter_update -> view -> copy_
            ge_converter=True,
            # the docstring's products: Atlas training, A2, A3 (no Atlas inference, no 950)
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits={
                "axes": (-2, -1),  # the offsets index dim 0; the write runs along one of the last two dims
                "indices_dtypes": (torch.int32, torch.int64),
                "indices_ranks": (1,),  # 1-D: one offset per row of dim 0 (2-D is undocumented)
                "bounds_checked": False,  # "索引越界不校验"
                # torchair recover_view_inplace_pattern (patterns/_recover_view_inplace_pattern.py):
                # placeholder -> aten.view -> scatter_update -> aten.view -> copy_(placeholder),
                # the placeholder with exactly those two users, CANN >= 8.3.RC1
                "reinplace_min_cann": "8.3.RC1",
            },
            doc="attention_inference.md 4.2-4.3 / torch_npu 2.13.0 docstring (_op_plugin_docs.py "
            "scatter_update): data and updates of one rank, 2-8 dims, int8/fp16/fp32/bf16/int32 (A2/A3), "
            "indices int32/int64 1-D or 2-D, no bounds check; products Atlas training, A2, A3; GE "
            "converters custom/scatter_update.py (functional: TensorMove + Scatter; in place: Scatter); "
            "Meta empty_like(self); no autograd",
        ),
        OpCapability(
            op="npu.npu_kv_rmsnorm_rope_cache_v2_functional",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # kv, gamma, cos, sin; caches also int8
            min_rank=4,
            max_rank=4,
            backward=None,
            # custom/npu_kv_rmsnorm_rope_cache.py:43: TensorMove of both caches +
            # KvRmsNormRopeCache; ACL modes re-inplace it (graph_pass.py:165-169, args 5, 6)
            ge_converter=True,
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "cache_modes": ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"),
                "heads": 1,  # kv (B, 1, S, D): N = 1 only
                # torch_npu's doc (hiascend ptaoplist_002368): hidden 576 = RMSNorm 512 + RoPE 64
                # only, on the A2 / A3 kernel; the open-source CANN kernel (ops-transformer README,
                # products Ascend 950) takes any Dv + Dk with Dk even
                "rms_dim": 512,
                "rope_dim": 64,
                "fixed_dims_socs": ("Ascend910B", "Ascend910_93"),
                "norm_index": "(B, S) int64 cache positions, -1 = no write",
            },
            doc="attention_inference.md 5.1 / CANN README ops-transformer posembedding/kv_rms_norm_rope_cache "
            "(formulas: interleaveRope = de-interleave + rotate halves, rmsNorm = x / sqrt(mean(x^2) + eps) * "
            "gamma; Norm index (B, S) in [-1, Scache); N = 1) / torch_npu doc ptaoplist_002368 (kv (B, 1, S, "
            "576) bf16/fp16, gamma 512, rope 64, Norm caches (B, 1, cache_len, 64 | 512)) / torch_npu's golden "
            "test_npu_kv_rmsnorm_rope_cache.py (fp32 compute, one rounding) / Meta: (k_embed, y, k_cache', "
            "ckv_cache'); GE converter custom/npu_kv_rmsnorm_rope_cache.py; no autograd",
        ),
    )
})
# ---- end of the inference attention block ----



# ---- Expert parallel (npu_ops/moe.py's re_routing block; patterns/moe_dispatch.py's EP forms) ----
# Appended as a block of its own.
CAPABILITIES.update({
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_moe_re_routing",
            dtypes=frozenset({torch.float16, torch.bfloat16, torch.int8}),  # tokens (950: fp8/fp4 too)
            min_rank=2,  # tokens (A, H)
            max_rank=2,
            backward=None,  # no autograd in torch_npu ...
            # ... so training graphs call it through our rule (backward: npu_moe_token_unpermute,
            # as torchtitan-npu's NPUMoeReRouting)
            autograd_rule="npu_fx_fusion.patterns.moe_dispatch.ReRouting",
            ge_converter=True,  # custom/npu_moe_re_routing.py -> GE MoeReRouting
            # torch_npu doc: Atlas A2/A3; the CANN README adds 950 and Kirin (no bf16 there)
            socs={"Ascend310P": SocLimits(supported=False)},
            limits={
                "max_hidden": 16384,  # exclusive: 0 < H < 16384
                "counts_dtypes": (torch.int32, torch.int64),  # (ranks, local experts)
                "expert_token_num_types": (1,),  # counts
                "idx_types": (0,),  # the gather index (950 adds 1, scatter)
                # the torch_npu doc says the counts "must be > 0" (取值必须大于0); the CANN
                # kernels copy nothing for a zero count (moe_re_routing.h: zero ubFactor
                # chunks and no tail; arch35 moe_re_routing_re_regbase.h: `if (currTokenNum
                # == 0) continue;`) and the host cannot read the device counts: zeros are
                # computed, not refused (docs/expert-parallel.md)
                "zero_counts": "computed (kernel source), against the doc's > 0",
            },
            doc="op_semantics 6.5 / torch_npu doc (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/"
            "torch_npu-npu_moe_re_routing.md) and the CANN README (ops-transformer moe/moe_re_routing): "
            "tokens (A, H) fp16/bf16/int8, 0 < H < 16384, expert_token_num_per_rank (N, E) int32/int64 "
            "summing to A, per_token_scales (A,) fp32, expert_token_num_type 1 and idx_type 0 only; "
            "outputs sized from the inputs (the wheel's Meta); products A2/A3 (950 in the CANN README); "
            "no autograd",
        ),
    )
})
# Ops no pass emits, whose documented limits a near miss quotes: MC2, which moe_dispatch
# reports for every expert-parallel token exchange (docs/expert-parallel.md says why it is
# never emitted). Not in CAPABILITIES: a pass may emit only what that table lists, and
# every op there has a stand-in.
NOT_EMITTED: dict[str, OpCapability] = {
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_moe_distribute_dispatch_v2",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # x (BS, H); A2 also packed int4 (int32)
            min_rank=2,
            max_rank=2,
            backward=None,  # inference only (the doc: 该接口支持推理场景下使用)
            ge_converter=True,  # custom/moe_distribute_dispatch_v2.py
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits={
                "group": "an HCCL communicator name (group_ep), the EP domain carrying no other operator",
                "max_top_k": 16,  # 0 < K <= 16 (12 with comm_alg fullmesh_v2)
                "max_batch": {"Ascend910B": 256, "Ascend910_93": 512},  # BS per rank (fullmesh / v1)
                "hidden": {"Ascend910B": (1, 7168, 32), "Ascend910_93": (1024, 8192, 1)},  # min, max, multiple
                "a2_world_sizes": (2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256),  # fullmesh
                "a3_world_sizes": (2, 768),  # inclusive range
                "a3_max_experts_times_ranks": 2048,  # local experts * world size
                "tp": "reserved: tp_world_size 0/1 only",
            },
            doc="torch_npu doc (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/"
            "torch_npu-npu_moe_distribute_dispatch_v2.md, 约束说明): inference only, paired with combine_v2 "
            "with identical group_ep, ep_world_size, moe_expert_num, shared-expert and global_bs settings on "
            "every rank and layer; group_ep an HCCL group name; K <= 16; BS <= 256 (A2 fullmesh) / 512 (A3); "
            "H (0, 7168] multiple of 32 on A2, [1024, 8192] on A3; A2/A3 only",
        ),
        OpCapability(
            op="npu.npu_moe_distribute_combine_v2",
            dtypes=frozenset({torch.float16, torch.bfloat16}),  # expand_x
            min_rank=2,
            max_rank=2,
            backward=None,  # inference only
            ge_converter=True,  # custom/moe_distribute_combine_v2.py
            socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
            limits={"pairs_with": "npu.npu_moe_distribute_dispatch_v2"},
            doc="torch_npu doc torch_npu-npu_moe_distribute_combine_v2.md: the reverse of dispatch_v2 "
            "(its assist_info_for_combine, ep_recv_counts passed unchanged), the weighted sum of each "
            "token's k rows (expert_scales fp32); inference only; the limits of dispatch_v2",
        ),
    )
}
# ---- end of the expert-parallel block ----


# Ops declared with npu_ops.spec.op_spec carry their capability in their spec: one place per op.
def _spec_capabilities() -> dict[str, OpCapability]:
    rows = {spec.dotted: spec.capability for spec in all_specs().values() if spec.capability is not None}
    twice = sorted(set(rows) & set(CAPABILITIES))
    if twice:
        raise ValueError(f"{', '.join(twice)}: a capability both in its op spec and in capabilities.py")
    return rows


CAPABILITIES.update(_spec_capabilities())
