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
