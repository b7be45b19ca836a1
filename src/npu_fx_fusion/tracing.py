"""Tracing search and replacement functions into the aten torchair's graphs contain.

The ways to trace one function, one per kind of pattern (TRACERS):
- "forward": make_fx without decompositions, functionalized as aot_autograd's graphs are;
- "forward-npu-cast": the same with each dtype conversion spelled `npu._npu_dtype_cast`
  (torch_npu's kernels that convert call it, and so does model code written for an NPU;
  `x.to(dtype)` itself is aten._to_copy on an NPU too: dispatch_inventory.py);
- "forward-npu": traced as an NPU compile records it, with torch_npu's dispatch overrides
  emulated (aten.matmul, softmax's cast ...; npu_dispatch.py);
- "joint", "joint-npu-cast", "joint-npu": the same for the forward + backward trace
  (`joint_fwd_bwd`) of a training graph.
Every trace gets the canonicalisations the matched graphs get (canonical.py).

Two decisions matter for correctness:
- No decompositions: Inductor's `fwd_only` applies its decomposition table by default
  (silu -> neg/exp/add/div ...), but torchair's graphs are aot_autograd graphs with almost
  none (shared/reference/torchair.md, section 2.2).
- Joint traces keep Python scalars constant (see trace_joint_without_decompositions).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

from .canonical import (canonicalize, canonicalize_grad_accumulation, functionalize_inplace_on_temporaries,
                        gradient_copies_apart, hoist_contiguous_copies, is_backward)
from .npu_dispatch import traced_as_on_npu

Node = torch.fx.Node


@contextlib.contextmanager
def failure_is_an_answer() -> Iterator[None]:
    """A trace whose failure answers a question (does the form trace at this site's shapes?):
    torch's fake tensor mode logs each meta kernel that raises at ERROR, with its traceback,
    before it raises, which a user would read as a failed compile."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was_disabled


def trace_without_decompositions(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """fwd_only minus Inductor's decompositions, functionalized as aot_autograd's graphs are
    (F.rms_norm's in-place `add_` becomes `add`), canonicalised as the matched graphs are."""
    kwargs["get_decomp_fn"] = dict  # -> {}; torch passes its own default explicitly otherwise
    gm = pm.fwd_only(fn, args, **kwargs)
    if functionalize_inplace_on_temporaries(gm.graph) + canonicalize(gm.graph):
        gm.recompile()
    return gm


def trace_with_npu_dtype_casts(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The same trace with each dtype conversion spelled `npu._npu_dtype_cast(x, dtype)`,
    as torch_npu records `x.to(dtype)` in aot graphs (torchair's own patterns accept both)."""
    return spell_casts_as_npu(trace_without_decompositions(fn, args, **kwargs))


def spell_casts_as_npu(gm: torch.fx.GraphModule,
                       is_gradient_cast: Callable[[Node], bool] = lambda node: False) -> torch.fx.GraphModule:
    """Each dtype conversion of `gm` as torch_npu records it: `npu._npu_dtype_cast(x, dtype)`,
    and in a joint graph's backward (is_gradient_cast) `npu._npu_dtype_cast_backward(grad,
    dtype)`, its derivative."""
    for node in gm.graph.nodes:
        if (node.target is torch.ops.aten._to_copy.default and "dtype" in node.kwargs
                and set(node.kwargs) <= {"dtype", "layout", "device"}):
            cast = torch.ops.npu._npu_dtype_cast_backward if is_gradient_cast(node) else torch.ops.npu._npu_dtype_cast
            node.target, node.args, node.kwargs = cast.default, (node.args[0], node.kwargs["dtype"]), {}
    gm.recompile()
    return gm


def trace_joint_without_decompositions(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The joint (forward + backward) trace of a search or replace function.

    `pm.joint_fwd_bwd` without Inductor's decompositions (torchair's joint graphs have
    none), then the normalisation the target joint graph gets (canonical.normalize_joint_graph
    less what joint_fwd_bwd already does) plus the forward traces' functionalisation of
    in-place ops on temporaries.
    """
    kwargs["get_decomp_fn"] = dict
    # Scalars are used as bound constants: aot_function turns int arguments into SymInts
    # of the shape env of fake tensor arguments, and the matcher retraces with the graph's
    # own fake tensors, so a retrace would add guards on symbols dynamo cannot source
    # (`n_group` in a view size). They stay arguments: the pattern's placeholders are
    # named after the search's arguments by position. (SymInts, the symbolic sizes the
    # matcher passes for dynamic shapes, are traced.)
    traced = (torch.Tensor, torch.SymInt, torch.SymFloat)

    def scalars_constant(*traced_args: Any) -> Any:
        return fn(*(t if isinstance(a, traced) else a for a, t in zip(args, traced_args)))

    # joint_fwd_bwd runs aot_function, which calls torch._functorch.config.joint_custom_pass
    # too: with our pass installed there (torchair route), tracing a pattern from inside
    # that pass would re-enter it.
    with torch._functorch.config.patch(joint_custom_pass=None):  # noqa: SLF001
        gm = pm.joint_fwd_bwd(scalars_constant, args, **kwargs)
    changed = (functionalize_inplace_on_temporaries(gm.graph) + canonicalize(gm.graph)
               + hoist_contiguous_copies(gm.graph) + gradient_copies_apart(gm.graph)
               + canonicalize_grad_accumulation(gm.graph))
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def trace_joint_with_npu_dtype_casts(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The joint trace with casts spelled as torch_npu records them in a training graph:
    `_npu_dtype_cast` forward and its derivative `_npu_dtype_cast_backward` backward."""
    return spell_casts_as_npu(trace_joint_without_decompositions(fn, args, **kwargs), is_backward)


FORWARD, FORWARD_NPU_CAST, FORWARD_NPU = "forward", "forward-npu-cast", "forward-npu"
JOINT, JOINT_NPU_CAST, JOINT_NPU = "joint", "joint-npu-cast", "joint-npu"
TRACERS: dict[str, Callable[..., torch.fx.GraphModule]] = {
    FORWARD: trace_without_decompositions,
    FORWARD_NPU_CAST: trace_with_npu_dtype_casts,
    FORWARD_NPU: traced_as_on_npu(trace_without_decompositions),
    JOINT: trace_joint_without_decompositions,
    JOINT_NPU_CAST: trace_joint_with_npu_dtype_casts,
    JOINT_NPU: traced_as_on_npu(trace_joint_without_decompositions),
}


def is_joint_kind(kind: str) -> bool:
    return kind in (JOINT, JOINT_NPU_CAST, JOINT_NPU)


def signature(args: Sequence[Any], requires_grad: Optional[Sequence[bool]] = None) -> Optional[tuple]:
    """What a trace of a function depends on in `args`: shapes, strides, dtypes, devices,
    requires_grad (the tensors' own, or `requires_grad`) and scalar values; None for an
    argument that cannot be keyed.

    A symbolic size is keyed by its expression ("s0"), which names one value only within
    its shape env, i.e. within the graph being fused: callers key per-graph caches with
    these, process-wide ones only with `is_static` signatures.
    """
    parts: list[Any] = []
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            grad = arg.requires_grad if requires_grad is None else requires_grad[index]
            parts.append((tuple(_size_key(d) for d in arg.shape), tuple(_size_key(d) for d in arg.stride()),
                          arg.dtype, arg.device.type, grad))
        elif isinstance(arg, (torch.SymInt, torch.SymFloat)):
            parts.append(("sym", str(arg.node.expr)))
        elif isinstance(arg, (int, float, bool, str, type(None), torch.dtype)):
            parts.append((type(arg), arg))
        else:
            return None
    return tuple(parts)


def _size_key(size: Any) -> Any:
    return size if isinstance(size, int) else ("sym", str(size.node.expr))


def is_static(key: tuple) -> bool:
    """A signature without symbolic sizes: it means the same in every graph."""
    return "sym" not in repr(key)
