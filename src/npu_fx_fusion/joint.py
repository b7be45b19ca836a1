"""Joint forward+backward graphs: tracing patterns joint, and normalising the graphs.

A training graph cannot be fused well after partitioning: the forward keeps every
intermediate autograd saved for the backward, and the backward stays unfused. So, as
Inductor does for attention, the fusions with a backward also run on aot_autograd's
*joint* graph, before the partitioner splits it. Their patterns are the same Forms,
traced with `joint_fwd_bwd`: the search pattern then covers the forward nodes AND the
autograd-derived backward nodes (a MultiOutputPattern over [out, *grads], with the
tangents as wildcards), and the replacement brings the fused op and its backward op.

This module holds what differs from forward-only tracing:
- `trace_joint_without_decompositions`: the trace_fn of joint patterns;
- `canonicalize_grad_accumulation`: without it no fp32 transformer norm would match
  (see its docstring);
- `normalize_joint_graph`: what those traces get, done to the graph being matched.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

aten = torch.ops.aten
Node = torch.fx.Node


def is_backward(node: Node) -> bool:
    """A node aot_autograd derived from autograd (the backward half of a joint graph)."""
    return bool(node.meta.get("autograd_backward")) or node.meta.get("partitioner_tag") == "is_backward"


def is_joint_graph(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def trace_joint_without_decompositions(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The joint (forward + backward) trace of a search or replace function.

    `pm.joint_fwd_bwd` without Inductor's decompositions (torchair's joint graphs have
    none), then the same normalisation the target joint graph gets (normalize_joint_graph)
    plus the forward traces' functionalisation of in-place ops on temporaries.
    """
    from .matching import _functionalize_inplace_on_temporaries, canonicalize

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
    changed = (_functionalize_inplace_on_temporaries(gm.graph) + canonicalize(gm.graph)
               + hoist_contiguous_copies(gm.graph) + canonicalize_grad_accumulation(gm.graph))
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def trace_joint_with_npu_dtype_casts(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The joint trace with casts spelled as torch_npu records them in a training graph:
    `_npu_dtype_cast` forward and its derivative `_npu_dtype_cast_backward` backward."""
    from .matching import spell_casts_as_npu

    return spell_casts_as_npu(trace_joint_without_decompositions(fn, args, **kwargs), is_backward)


def normalize_joint_graph(gm: torch.fx.GraphModule) -> None:
    """Make a joint graph look like the joint pattern traces: what joint_fwd_bwd does to
    them (remove_noop_ops, then Inductor's early_patterns: pointless views, view pairs and
    permute pairs, which einsum's backward leaves), and the canonicalisations both sides
    get."""
    from torch._inductor.fx_passes.joint_graph import early_patterns
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    from .matching import canonicalize

    gm.graph.eliminate_dead_code()  # patterns pin user counts
    # canonicalize first: a view whose sizes spell a -1 (transformers' `reshape(B, -1, S, D)`
    # after SDPA) is a no-op only once the -1 is resolved, as it is in the traces
    canonicalize(gm.graph)
    remove_noop_ops(gm.graph)
    early_patterns.apply(gm.graph)
    hoist_contiguous_copies(gm.graph)
    canonicalize_grad_accumulation(gm.graph)
    gm.recompile()


# ---- layout copies ------------------------------------------------------------------------
def hoist_contiguous_copies(graph: torch.fx.Graph) -> int:
    """Rewrite clone(view(x), contiguous) as view(clone(x, contiguous)).

    A gradient that reaches a backward as a slice of a wider one (the rope half of
    DeepSeek's q, split from its nope half) is not contiguous, so autograd copies it
    between its view and the op that needs contiguity (view_as_complex); a pattern traced
    alone gets a contiguous tangent and no copy. With the copy moved above the view, the
    pattern's tangent is the copy. Same values, same contiguous result: a view that is
    valid on x is valid on a contiguous copy of it. Returns the number of copies moved.
    """
    moved = 0
    for clone in list(graph.nodes):
        if not (clone.op == "call_function" and clone.target is aten.clone.default
                and clone.kwargs.get("memory_format") == torch.contiguous_format):
            continue
        view = clone.args[0]
        if not (isinstance(view, Node) and view.op == "call_function"
                and view.target in (aten.view.default, aten.reshape.default) and len(view.users) == 1):
            continue
        with graph.inserting_before(view):
            copy = graph.call_function(aten.clone.default, (view.args[0],),
                                       {"memory_format": torch.contiguous_format})
        source = view.args[0].meta.get("val") if isinstance(view.args[0], Node) else None
        if source is not None:
            copy.meta["val"] = source.clone(memory_format=torch.contiguous_format)
        view.args = (copy, *view.args[1:])
        if "val" in clone.meta:  # the view of a contiguous copy is the contiguous copy's layout
            view.meta["val"] = clone.meta["val"]
        clone.replace_all_uses_with(view)
        graph.erase_node(clone)
        moved += 1
    return moved


# ---- gradient accumulation ----------------------------------------------------------------
def canonicalize_grad_accumulation(graph: torch.fx.Graph) -> int:
    """Re-fold every chain of gradient-accumulating adds in one canonical order.

    Autograd sums the gradient of a tensor with several users as a left fold
    add(add(g_1, g_2), g_3), in the order the contributions arrive. A pattern traced alone
    sees only its own users of the tensor, so where the model has another one (the
    residual stream of every transformer block, in fp32 where no cast isolates the norm's
    input) the pattern's own add(g_a, g_b) does not exist in the graph, and a search
    function that runs its ops in another order than the model (rotate_half slicing x2
    before x1) sums in another order. Both the joint graph and every joint pattern trace
    are re-folded as a left fold over their leaves sorted by a key that depends on the
    graph's structure only (_leaf_key). Only the rounding of those sums changes.
    Returns the number of chains re-folded.
    """
    changed = 0
    order = _forward_order(graph)
    by_seq: dict = {}  # seq_nr -> the forward nodes with it (backward nodes carry their forward's)
    for n in graph.nodes:
        if n.op == "call_function" and not is_backward(n) and n.meta.get("seq_nr") is not None:
            by_seq.setdefault(n.meta["seq_nr"], []).append(n)
    for root in list(reversed(graph.nodes)):
        if root.graph is not graph or not _plain_add(root):
            continue
        if len(root.users) == 1 and _plain_add(next(iter(root.users))):
            continue  # not the top of its chain
        leaves, inner = _chain(root)
        if len(leaves) < 2:
            continue
        accumulated = _accumulated_tensor(leaves, root, by_seq)
        if accumulated is None:
            continue
        ordered = sorted(leaves, key=lambda leaf: _leaf_key(leaf, accumulated, order, by_seq))
        if _left_fold_leaves(root) == ordered:
            continue
        with graph.inserting_before(root):
            acc = ordered[0]
            for leaf in ordered[1:-1]:
                acc_new = graph.call_function(aten.add.Tensor, (acc, leaf))
                acc_new.meta = dict(root.meta)
                acc = acc_new
        root.args = (acc, ordered[-1])
        for n in inner:
            if n is not root and not n.users:
                graph.erase_node(n)
        changed += 1
    return changed


def _plain_add(node: Any) -> bool:
    """A backward add.Tensor of two same-shape, same-dtype tensors, without alpha."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.add.Tensor
            and not node.kwargs and is_backward(node) and len(node.args) == 2):
        return False
    vals = [a.meta.get("val") if isinstance(a, Node) else None for a in node.args]
    out = node.meta.get("val")
    return all(isinstance(v, torch.Tensor) for v in (*vals, out)) and all(
        _same_shape(v, out) and v.dtype == out.dtype for v in vals)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Provably the same shape. `a.shape == b.shape` guards on symbolic sizes, and raises
    on data-dependent ones (the rows an expert-parallel all-to-all received)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return a.dim() == b.dim() and statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape)))


def _chain(root: Node) -> tuple[list[Node], list[Node]]:
    """(leaves, inner adds) of the add tree under root; inner adds have root as only user."""
    leaves, inner, stack = [], [], [root]
    while stack:
        n = stack.pop()
        if n is root or (_plain_add(n) and len(n.users) == 1):
            inner.append(n)
            stack.extend(reversed(n.args))
        else:
            leaves.append(n)
    return leaves, inner


def _left_fold_leaves(root: Node) -> list[Node]:
    """Leaves of a left fold add(add(a, b), c) -> [a, b, c] (the right args, then the base)."""
    out, n = [], root
    while _plain_add(n) and (n is root or len(n.users) == 1):
        out.append(n.args[1])
        n = n.args[0]
    out.append(n)
    return out[::-1]


def _forward_order(graph: torch.fx.Graph) -> dict:
    """Post-order index of every forward node in a DFS from the outputs, args in order.

    Independent of the order the model (or a search function) ran its ops in: a
    consumer inside a pattern comes before a consumer that takes the pattern's result
    (the block's residual add).
    """
    out = next(iter(graph.find_nodes(op="output")))
    roots: list[Node] = []
    torch.fx.node.map_arg(out.args[0], roots.append)
    order: dict = {}
    for root in roots:
        if root.op == "placeholder" or is_backward(root):
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in order:
                continue
            if expanded:
                order[node] = len(order)
                continue
            stack.append((node, True))
            args: list[Node] = []
            torch.fx.node.map_arg((node.args, node.kwargs), args.append)
            stack.extend((a, False) for a in reversed(args) if a not in order and not is_backward(a))
    return order


def _accumulated_tensor(leaves: list[Node], root: Node, by_seq: dict) -> Optional[Node]:
    """The forward tensor whose gradient the chain sums: the forward input most of the
    leaves' forward consumers share (found through the seq_nr backward nodes inherit),
    among those shaped like the sum."""
    counts: dict = {}
    for leaf in leaves:
        for consumer in by_seq.get(leaf.meta.get("seq_nr"), ()):
            for a in consumer.all_input_nodes:
                counts[a] = counts.get(a, 0) + 1
    out = root.meta.get("val")
    fits = [a for a in counts if isinstance(a.meta.get("val"), torch.Tensor)
            and out is not None and _same_shape(a.meta["val"], out)]
    return max(fits, key=lambda a: counts[a]) if fits else None


def _leaf_key(leaf: Node, accumulated: Node, order: dict, by_seq: dict) -> tuple:
    """(structural position of the forward consumer this leaf is the gradient for, seq_nr).

    Leaves whose consumer cannot be told (tangents, pass-through gradients) go last.
    """
    seq = leaf.meta.get("seq_nr")
    consumer = next((n for n in by_seq.get(seq, ()) if accumulated in n.all_input_nodes), None)
    return (order.get(consumer, float("inf")), float("inf") if seq is None else seq)


def views_to_reshapes_where_needed(gm: torch.fx.GraphModule, new_nodes: Sequence[Node]) -> None:
    """Turn into reshapes the views that the fused ops' layouts break, and only those.

    The fused ops and their backward ops return contiguous tensors where the aten code
    they replace could keep a transposed layout, and an aten.view downstream (forward or
    backward) then fails on strides it was not traced for. Converting every view
    downstream, as the forward-only pipeline does after its last pass, would hide the
    remaining views from the forward-only patterns that run on the partitioned graphs
    next (a rope whose `view` became `reshape` no longer matches). So the joint graph's
    fake values are propagated again, with the fused ops' real output strides, and a view
    that fails there becomes a reshape. This also leaves every node's meta["val"]
    describing the fused graph. If the graph cannot be re-propagated, every view
    downstream of a fused node is converted instead.
    """
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = torch._guards.detect_fake_mode(inputs)  # noqa: SLF001

    class _Propagate(FakeTensorProp):
        def run_node(self, node: Node) -> Any:
            try:
                return super().run_node(node)
            except RuntimeError:
                if node.target is not aten.view.default:
                    raise
                node.target = aten.reshape.default
                return super().run_node(node)

    try:
        if fake_mode is None:
            raise RuntimeError("the joint graph's inputs carry no fake values")
        _Propagate(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
    except Exception:  # noqa: BLE001 - fall back to the safe, broad conversion
        from .pipeline import views_to_reshapes_downstream

        views_to_reshapes_downstream(new_nodes)
    gm.recompile()
