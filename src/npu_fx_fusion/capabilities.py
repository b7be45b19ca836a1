"""What the hardware accepts, per fused op and SoC: one declarative table.

Patterns never write hardware limits as literals; they ask `unsupported(op, soc, ...)`
which returns the first limit a call would break, in words, or None. Sources are the
torch_npu op docs (`_op_plugin_docs.py` in the wheel) and shared/reference/op_semantics.md.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .npu_ops.spec import FLOAT_DTYPES, OpCapability, SocLimits, all_specs, documented_ops

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


CAPABILITIES: dict[str, OpCapability] = {}


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
    )
})

def only_on(op: str) -> Optional[str]:
    """For a SoC-restricted op: "<op> runs on <SoCs> only" (a site's note in emulation, where no
    SoC is known), else None."""
    cap = CAPABILITIES[op]
    socs = [soc for soc in SOCS if cap.socs.get(soc, SocLimits()).supported]
    return f"{op} runs on {', '.join(socs)} only" if len(socs) < len(SOCS) else None
# ---- end of the DeepSeek-V4 block ----


# ---- Inference attention and KV-cache writes (npu_ops/infer_attention.py, npu_ops/kv_cache.py;
# shared/reference/attention_inference.md sections 3-5) ----
# Appended as a block of its own. `x` of unsupported() is the op's first tensor input (the
# query, the cache, the latent kv).
CAPABILITIES.update({
    cap.op: cap
    for cap in (
    )
})
# ---- end of the inference attention block ----



# Ops no pass emits and no stand-in computes, whose documented limits a near miss quotes
# (npu_ops.spec.documented_op: MC2, in npu_ops/moe.py). Not in CAPABILITIES: a pass may emit
# only what that table lists, and every op there has a stand-in.
NOT_EMITTED: dict[str, OpCapability] = {cap.op: cap for cap in documented_ops().values()}


# Ops declared with npu_ops.spec.op_spec carry their capability in their spec: one place per op.
def _spec_capabilities() -> dict[str, OpCapability]:
    rows = {spec.dotted: spec.capability for spec in all_specs().values() if spec.capability is not None}
    twice = sorted(set(rows) & set(CAPABILITIES))
    if twice:
        raise ValueError(f"{', '.join(twice)}: a capability both in its op spec and in capabilities.py")
    return rows


CAPABILITIES.update(_spec_capabilities())
