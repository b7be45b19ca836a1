"""What the hardware accepts, per fused op and SoC: the queries the passes ask.

Each op's facts (dtypes, ranks, SoC limits, GE converter, tolerance, limits) live once, in its
spec (`capability=` of `npu_ops.spec.op_spec`, next to its schema and kernels); CAPABILITIES is
the table those specs make. Patterns never write hardware limits as literals; they ask
`unsupported(op, soc, ...)`, which returns the first limit a call would break, in words, or
None. Sources are the torch_npu op docs (`_op_plugin_docs.py` in the wheel) and
shared/reference/op_semantics.md, quoted in each spec.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .npu_ops.spec import FLOAT_DTYPES, SOCS, OpCapability, SocLimits, all_specs, documented_ops

log = logging.getLogger("npu_fx_fusion.capabilities")

__all__ = ["ACL_MODES", "CAPABILITIES", "FLOAT_DTYPES", "GE_MODES", "MODES", "NOT_EMITTED", "SOCS", "OpCapability",
           "SocLimits", "capability", "check_mode_name", "check_soc_name", "detect_soc", "has_backward",
           "not_lowerable", "only_on", "unsupported"]

# torchair's modes (CompilerConfig.mode) and npugraph_ex, by how they lower a graph:
# max-autotune converts every node into a GE graph and needs a GE converter per op;
# reduce-overhead and npugraph_ex capture the ops' own (aclnn) kernels in an ACL graph,
# so every op torch_npu implements works there.
GE_MODES = ("max-autotune",)
ACL_MODES = ("reduce-overhead", "npugraph_ex")
MODES: tuple[str, ...] = GE_MODES + ACL_MODES

# "npu.npu_rms_norm" -> its capability: every op a pass may emit (each has a stand-in).
CAPABILITIES: dict[str, OpCapability] = {
    spec.dotted: spec.capability for spec in all_specs().values() if spec.capability is not None}
# Ops no pass emits and no stand-in computes, whose documented limits a near miss quotes
# (npu_ops.spec.documented_op). Not in CAPABILITIES: a pass may emit only what that table lists.
NOT_EMITTED: dict[str, OpCapability] = {cap.op: cap for cap in documented_ops().values()}


def check_soc_name(soc: str) -> str:
    if soc not in SOCS:
        raise ValueError(f"unknown SoC {soc!r}; known: {', '.join(SOCS)}")
    return soc


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


def only_on(op: str) -> Optional[str]:
    """For a SoC-restricted op: "<op> runs on <SoCs> only" (a site's note in emulation, where no
    SoC is known), else None."""
    cap = CAPABILITIES[op]
    socs = [soc for soc in SOCS if cap.socs.get(soc, SocLimits()).supported]
    return f"{op} runs on {', '.join(socs)} only" if len(socs) < len(SOCS) else None
