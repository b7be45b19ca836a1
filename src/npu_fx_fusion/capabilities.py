"""What the hardware accepts, per fused op and SoC: one declarative table.

Patterns never write hardware limits as literals; they ask `unsupported(op, soc, ...)`
which returns the first limit a call would break, in words, or None. Sources are the
torch_npu op docs (`_op_plugin_docs.py` in the wheel) and shared/reference/op_semantics.md.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

log = logging.getLogger("npu_fx_fusion.capabilities")

# SoC names as torch_npu's get_soc_version / the docs name the product lines.
SOCS: tuple[str, ...] = (
    "Ascend910B",  # Atlas A2 training / 800I A2 inference
    "Ascend910_93",  # Atlas A3
    "Ascend310P",  # Atlas inference series ("310P-class")
    "Ascend950",  # arch35
)

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

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


@dataclass(frozen=True)
class SocLimits:
    """Restrictions one SoC adds on top of an op's general limits."""

    supported: bool = True
    dtypes: Optional[frozenset] = None  # None: the op's general dtypes
    mixed_gamma: bool = True  # fp32 gamma with an fp16/bf16 input


@dataclass(frozen=True)
class OpCapability:
    op: str  # "npu.npu_rms_norm"
    dtypes: frozenset
    min_rank: int
    max_rank: int
    backward: Optional[str]  # the op torch_npu differentiates it with, None: inference only
    # torchair 2.13 registers a GE converter for it (register_fx_node_ge_converter), so
    # max-autotune can lower it; tests/test_torchair_backend.py checks this against the wheel
    ge_converter: bool
    socs: Mapping[str, SocLimits] = field(default_factory=dict)
    same_shape: tuple[str, ...] = ()  # tensor arguments that must have one shape and dtype
    # op-specific numeric limits read by the pattern's check ("max_head_dim": 896, ...)
    limits: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""


CAPABILITIES: dict[str, OpCapability] = {
    cap.op: cap
    for cap in (
        OpCapability(
            op="npu.npu_rms_norm",
            dtypes=FLOAT_DTYPES,
            min_rank=1,
            max_rank=8,
            backward="npu.npu_rms_norm_backward",
            ge_converter=True,
            # fp32 gamma with fp16/bf16 x is documented for A2/A3 only.
            socs={
                "Ascend310P": SocLimits(dtypes=frozenset({torch.float32, torch.float16}), mixed_gamma=False),
                "Ascend950": SocLimits(mixed_gamma=False),
            },
            doc="torch_npu docs: x 1-8 dims, fp16/bf16/fp32; gamma x.shape[n:], same dtype "
            "(or fp32 with fp16/bf16 x on A2/A3)",
        ),
        OpCapability(
            op="npu.npu_add_rms_norm",
            dtypes=FLOAT_DTYPES,
            min_rank=1,
            max_rank=8,
            backward=None,
            ge_converter=True,
            same_shape=("x1", "x2"),
            socs={"Ascend310P": SocLimits(dtypes=frozenset({torch.float32, torch.float16}), mixed_gamma=False)},
            doc="torch_npu docs: x1, x2 same shape, 1-8 dims; no bf16 on Atlas inference (310P); "
            "no autograd (inference graphs only)",
        ),
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
