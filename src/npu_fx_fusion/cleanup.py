"""After fusion: the graph fixes that fused ops' layouts and one-site-at-a-time
replacement make necessary. Each keeps the computation as it is.

Below the matching layer: imports only nodes.py.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

from .nodes import deterministic_and_pure, hashable, plain_cast, same_layout

aten = torch.ops.aten
Node = torch.fx.Node


def merge_repeated_pure_calls(graph: torch.fx.Graph, original_nodes: set) -> int:
    """One node for each repeated pure computation that fusion introduced, and one for each
    repeated view.

    Replacements are traced one site at a time, so two fused ops reading the same tensor
    each bring their own cast of it (the int32 expert ids of init_routing and finalize, the
    int64 group list of each grouped matmul), their own attention mask, their own rope
    tables. A call repeats an earlier one when it has the same op and the same arguments
    (after the repeats before it are merged). It is merged into it:
    - when one of the two is new: the model's own repeated computations stay as they are;
    - when both are views (a view launches nothing, and one value viewed one way is one
      value): the model's own too. Each decoder layer slices its own view of the rope
      tables the layers share, and only once those views are one do the tables each layer's
      replacement builds from them repeat, and merge.

    Never merged: ops that draw random numbers, mutate, or allocate without initialising,
    and any call that reads or is a value some op of the graph writes in place. Returns the
    number of nodes merged.
    """
    written = _written_in_place(graph)
    pure: dict = {}  # target -> _pure(target), read once per op of the graph

    def merges(node: Node) -> bool:
        target = node.target
        is_pure = pure.get(target)
        if is_pure is None:
            is_pure = pure[target] = _pure(target)
        return is_pure and node not in written and not any(arg in written for arg in node.all_input_nodes)

    one_is_new = _one_is_new(original_nodes)

    def may_merge(node: Node, earlier: Node) -> bool:
        return one_is_new(node, earlier) or (node.target.is_view and earlier.target.is_view)

    return _merge_repeats(graph, merges, may_merge)


def _pure(target: Any) -> bool:
    """An op whose result is a function of its arguments (nodes.deterministic_and_pure),
    returning fresh values or views, not `empty`'s uninitialised memory."""
    if not isinstance(target, torch._ops.OpOverload) or not deterministic_and_pure(target):  # noqa: SLF001
        return False
    schema = target._schema  # noqa: SLF001
    return (not schema.name.split("::")[-1].lstrip("_").startswith(("empty", "new_empty"))
            and all(r.alias_info is None or not r.alias_info.is_write for r in schema.returns))


def _written_in_place(graph: torch.fx.Graph) -> set:
    """The nodes whose values some call of `graph` writes (its schema marks the argument
    written: copy_ into a graph input, an in-place cache update), and the views of them."""
    written = set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
                written.update(value if isinstance(value, (list, tuple)) else (value,))
    frontier = [node for node in written if isinstance(node, Node)]
    while frontier:  # views of a written value see the write
        for user in frontier.pop().users:
            if getattr(user.target, "is_view", False) and user not in written:
                written.add(user)
                frontier.append(user)
    return written


def _one_is_new(original_nodes: set) -> Callable[[Node, Node], bool]:
    """Whether fusion introduced either of two repeats: the model's own repeats stay."""
    return lambda node, earlier: node not in original_nodes or earlier not in original_nodes


def _merge_repeats(graph: torch.fx.Graph, merges: Callable[[Node], bool],
                   may_merge: Callable[[Node, Node], bool]) -> int:
    """Each call node that `merges` and that repeats an earlier one (same op, same arguments)
    is replaced by it where `may_merge(node, earlier)`."""
    first: dict[Any, Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not merges(node):
            continue
        key = (node.target, hashable(node.args), hashable(node.kwargs))
        earlier = first.setdefault(key, node)
        if earlier is not node and may_merge(node, earlier):
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            merged += 1
    return merged


def merge_repeated_fused_calls(graph: torch.fx.Graph, original_nodes: set, pure_ops: frozenset) -> int:
    """One node for each repeated call of a fused op (`pure_ops`: functional, deterministic)
    with the same arguments, where fusion introduced one of the two; their getitems too.

    Code that computes one value several times (transformers' q, k and v projections each
    quantize the same normed hidden state) becomes several identical fused calls, one per
    site; the ops are pure, so they are one value, and a later pass that fuses the call with
    its producer (a norm feeding the quantization) sees it read once. Returns the number of
    nodes merged."""
    def merges(node: Node) -> bool:
        return node.target in pure_ops or (node.target is operator.getitem and isinstance(node.args[0], Node)
                                           and node.args[0].target in pure_ops)

    return _merge_repeats(graph, merges, _one_is_new(original_nodes))


# dtype -> the dtypes that hold each of its values exactly (a conversion there and back is
# the identity): integer widening, float widening, bool into anything.
_EXACT_IN = {
    torch.bool: {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.uint8: {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.int8: {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.int16: {torch.int32, torch.int64, torch.float32, torch.float64},
    torch.int32: {torch.int64, torch.float64},
    torch.float16: {torch.float32, torch.float64},
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
}


def drop_lossless_round_trips(graph: torch.fx.Graph, original_nodes: set) -> int:
    """`convert(convert(x, wide), x.dtype)` -> `x` where `wide` holds every value of x's
    dtype exactly, when fusion introduced either conversion; views between the two stay, now
    of x (`convert(view(convert(x, wide)), x.dtype)` -> `view(x)`).

    Two fusions meeting at an integer tensor each convert it to what their own op or the
    model declares: moe_gating's replacement widens npu_moe_gating_top_k_softmax's int32
    expert ids to the int64 of the top-k it replaces, moe_dispatch narrows them back to
    the int32 npu_moe_init_routing_v2 takes. The pair is the identity; the model's own
    conversions stay. Returns the number of conversions bypassed.
    """
    npu_cast = getattr(getattr(torch.ops, "npu", None), "_npu_dtype_cast", None)

    def dtype_only(node: Node) -> Optional[torch.dtype]:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        if plain_cast(node):
            return node.kwargs["dtype"]
        if npu_cast is not None and node.target is npu_cast.default and len(node.args) == 2:
            return node.args[1]
        return None

    bypassed = 0
    for outer in list(graph.nodes):
        to = dtype_only(outer)
        inner = outer.args[0] if to is not None else None
        views = []  # views between the two conversions (a fused op's rows reshaped back)
        while inner is not None and inner.op == "call_function" and inner.target in _RESHAPES \
                and len(inner.users) == 1:
            views.append(inner)
            inner = inner.args[0] if isinstance(inner.args[0], Node) else None
        wide = dtype_only(inner) if inner is not None else None
        source = inner.args[0].meta.get("val") if wide is not None else None
        if (not isinstance(source, torch.Tensor) or source.dtype != to
                or wide not in _EXACT_IN.get(to, ()) or {outer, inner} <= original_nodes):
            continue
        value = inner.args[0]
        for view in reversed(views):  # the same views, of the narrow tensor
            with graph.inserting_before(outer):
                value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
            if "val" in view.meta:
                value.meta["val"] = view.meta["val"].to(to)
        outer.replace_all_uses_with(value)
        graph.erase_node(outer)
        for node in [*views, inner]:
            if not node.users:
                graph.erase_node(node)
        bypassed += 1
    return bypassed


_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                       torch.ops.aten._unsafe_view.default})


def views_to_reshapes_downstream(new_nodes: Sequence[Node]) -> None:
    """Make every `view` a replacement can reach a `reshape`.

    A fused op's output need not have the strides of what it replaced (torch_npu's meta
    functions return contiguous tensors where elementwise aten kept a transposed layout),
    and aten.view fails on strides it was not traced for. torchair turns every view into
    a reshape right after our pass anyway (_optimize_fx's view_to_reshape); doing it here
    for the views downstream of a fusion keeps fuse() and the emulation backend correct.
    Done once, after every pass: patterns match the graph's own views.

    A view of a graph input or of a replacement's own node that is contiguous stays a
    view: their metadata is exact (an input's, or the replacement's fake kernels'), a view
    of a contiguous tensor cannot fail, and torchair's recover_view_inplace_pattern needs
    `placeholder -> aten.view -> scatter_update -> aten.view -> copy_` (kv_cache's writes).
    """
    for node in new_nodes:
        node.meta.pop(LAYOUT_CHANGED, None)  # every view downstream is converted, changed or not
    new = set(new_nodes)
    seen: set[Node] = set()
    pending = list(new_nodes)
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is torch.ops.aten.view.default and not _views_exact_contiguous(node, new):
            node.target = torch.ops.aten.reshape.default
        elif node.target is torch.ops.aten.view_as_complex.default:
            _contiguous_copy_of_input(node.graph, node)
        pending.extend(node.users)


def _views_exact_contiguous(view: Node, new: set) -> bool:
    source = view.args[0]
    if not isinstance(source, Node) or not (source.op == "placeholder" or source in new):
        return False
    value = source.meta.get("val")
    try:
        return isinstance(value, torch.Tensor) and bool(value.is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides: undecidable, reshape it
        return False



# meta key of a replacement's output whose value has another layout (shape, strides, dtype)
# than the node it replaced had: the matcher sets it, views_to_reshapes_where_needed starts
# from those (and removes it); a replaced value of the same layout leaves its users' values
# as they are
LAYOUT_CHANGED = "npu_fx_fusion_layout_changed"


def views_to_reshapes_where_needed(gm: torch.fx.GraphModule, new_nodes: Sequence[Node]) -> None:
    """Turn into reshapes the views that the fused ops' layouts break, and only those.

    The fused ops and their backward ops return contiguous tensors where the aten code
    they replace could keep a transposed layout, and an aten.view downstream (forward or
    backward) then fails on strides it was not traced for. Converting every view
    downstream, as the forward-only pipeline does after its last pass, would hide the
    remaining views from the forward-only patterns that run on the partitioned graphs
    next (a rope whose `view` became `reshape` no longer matches). So fake values are
    propagated again from the fused ops' real outputs, and a view that fails there
    becomes a reshape. Only as far as a value changes: from the replacement outputs whose
    layout differs from the node they replaced (LAYOUT_CHANGED), and on from a node whose
    recomputed value has another shape, strides or dtype than it had, so the work is
    bounded by where the new layouts reach, not by the graph's size. Every node's
    meta["val"] then describes the fused graph. If a value cannot be recomputed, every
    view downstream of a fused node is converted instead.
    """
    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = torch._guards.detect_fake_mode(inputs)  # noqa: SLF001
    try:
        if fake_mode is None:
            raise RuntimeError("the joint graph's inputs carry no fake values")
        _propagate_changes(gm, new_nodes, fake_mode)
    except Exception:  # noqa: BLE001 - fall back to the safe, broad conversion
        views_to_reshapes_downstream(new_nodes)
    gm.recompile()


def copies_for_contiguous_inputs(graph: torch.fx.Graph, takes_contiguous: Any) -> int:
    """A contiguous copy in front of each tensor argument a fused op needs contiguous
    (`takes_contiguous(node)`) and does not get, by the graph's values once the fused ops'
    layouts have been propagated (views_to_reshapes_where_needed).

    A pass records `.contiguous()` for the layout it sees; a later pass can change that
    layout (the fused rope returns contiguous BNSD where the model's rope kept the BSND memory
    of its projection, so a select and a transpose of it that were contiguous are not any
    more). Returns the number of copies inserted."""
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not takes_contiguous(node):
            continue
        for arg in [*node.args, *node.kwargs.values()]:
            value = arg.meta.get("val") if isinstance(arg, Node) else None
            if not isinstance(value, torch.Tensor) or _surely_contiguous(value):
                continue
            _contiguous_copy(graph, node, arg)
            inserted += 1
    return inserted


def _surely_contiguous(value: torch.Tensor) -> bool:
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    try:
        return bool(guard_or_false(value.is_contiguous()))
    except Exception:  # noqa: BLE001 - undecidable: copy (torchair drops a copy that copies nothing)
        return False


def _contiguous_copy_of_input(graph: torch.fx.Graph, node: Node) -> Node:
    """A contiguous copy in front of a view_as_complex whose input's layout a fused op changed.

    The code it was traced from asked for it: autograd's backward of view_as_real is
    `view_as_complex(grad.contiguous())`, and the trace drops a `.contiguous()` of a value
    that was contiguous then; a fused backward op can return that grad in another layout
    (the aten ops it replaced kept a transposed one, torch_npu's return contiguous ones).
    A copy of a contiguous value is a no-op for torchair."""
    return _contiguous_copy(graph, node, node.args[0])


def _contiguous_copy(graph: torch.fx.Graph, user: Node, arg: Node) -> Node:
    """`user` reads a contiguous copy of `arg` (a clone inserted in front of it)."""
    with graph.inserting_before(user):
        copy = graph.call_function(aten.clone.default, (arg,), {"memory_format": torch.contiguous_format})
    value = arg.meta.get("val")
    if isinstance(value, FakeTensor):
        with value.fake_mode:
            copy.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    elif isinstance(value, torch.Tensor):
        copy.meta["val"] = value.clone(memory_format=torch.contiguous_format)
    user.replace_input_with(arg, copy)
    return copy


# What an op returned for arguments of one static layout (_fake_result_key), process-wide:
# every decoder layer calls it with the same ones, and so does every compile of the model.
# Either new memory, kept as its layout (_Layout: no fake tensor of an earlier compile's fake
# mode is kept alive), or a view of the op's first argument, kept as (shape, strides, offset).
# torch's fake mode caches neither the ops registered outside torch (a fused attention's fake
# kernel: ~2 ms the first time in a compile) nor composite ones (a reshape that copies an
# expanded k / v: ~1 ms each), and running even a cached view costs ~0.3 ms through the
# interpreter. A layout is a function of the op and its arguments' layouts alone.
_RESULTS: dict = {}
_RESULTS_KEPT = 4096  # a bound on what a long-lived process keeps; past it, start again


def _propagate_changes(gm: torch.fx.GraphModule, changed: Sequence[Node], fake_mode: Any) -> None:
    """Recompute meta["val"] of the users of `changed` (nodes whose values are new), and of
    theirs, while the values differ; a view that fails becomes a reshape."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    interpreter = None  # made when a node first has to run (it walks the whole graph)
    pending = [(order[user], user) for node in changed if node.meta.pop(LAYOUT_CHANGED, False)
               for user in node.users]
    heapq.heapify(pending)
    done: set = set()
    with fake_mode:
        while pending:
            _, node = heapq.heappop(pending)
            if node in done or node.op == "output":
                continue
            done.add(node)
            before = node.meta.get("val")
            key = _fake_result_key(node)
            known = _RESULTS.get(key) if key is not None else None
            if known is not None and known[0] == "new":
                node.meta["val"] = _from_layout(known[1], fake_mode)
            elif known is not None:
                node.meta["val"] = _fake_view(node.args[0].meta["val"], known[1], fake_mode)
            else:
                if interpreter is None:
                    interpreter = FakeTensorProp(gm, mode=fake_mode)
                for arg in node.all_input_nodes:
                    interpreter.env[arg] = arg.meta.get("val")
                if node.target is aten.view_as_complex.default and not _viewable_as_complex(node.args[0]):
                    # (running its meta would fail, and torch logs that failure as an error)
                    copy = _contiguous_copy_of_input(gm.graph, node)
                    interpreter.env[copy] = copy.meta["val"]
                try:
                    interpreter.run_node(node)
                except (RuntimeError, ValueError):  # fake mode raises ValueError for a view of strides
                    if node.target is aten.view.default:
                        node.target = aten.reshape.default
                    elif node.target is aten.view_as_complex.default:
                        copy = _contiguous_copy_of_input(gm.graph, node)
                        interpreter.env[copy] = copy.meta["val"]
                    else:
                        raise
                    interpreter.run_node(node)
                # (keyed by the op as it now is: a view that failed is a reshape, and another view of
                # those layouts must fail and become one too, not take the reshape's copy)
                _remember_result(node)
            if not same_layout(before, node.meta.get("val")):
                for user in node.users:
                    heapq.heappush(pending, (order[user], user))


def _remember_result(node: Node) -> None:
    """Keep node's value in _RESULTS where its layout is static and it is new memory (only
    those: a view's fake value must share its base's storage) or a plain view of its first
    argument."""
    key = _fake_result_key(node)
    value = node.meta.get("val")
    if key is None or not _static_layout(value):
        return
    if _new_memory(value, node.all_input_nodes):
        known = ("new", _layout_of(value))
    else:
        view = _view_of_first_argument(node)
        if view is None:
            return
        known = ("view", view)
    if len(_RESULTS) >= _RESULTS_KEPT:
        _RESULTS.clear()
    _RESULTS[key] = known


@dataclass(frozen=True)
class _Layout:
    """A tensor's shape, strides, dtype and device: what fake_copy makes a fake tensor of."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def _layout_of(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_layout_of(v) for v in value)
    if isinstance(value, torch.Tensor):
        return _Layout(tuple(value.shape), value.stride(), value.dtype, value.device)
    return value


def _from_layout(layout: Any, fake_mode: Any) -> Any:
    """A new fake value of `layout` (_layout_of's) in `fake_mode`, as fake_copy makes one."""
    if isinstance(layout, (list, tuple)):
        return type(layout)(_from_layout(v, fake_mode) for v in layout)
    if isinstance(layout, _Layout):
        return _fake_tensor(fake_mode, layout.shape, layout.stride, layout.dtype, layout.device)
    return layout


def _view_of_first_argument(node: Node) -> Optional[tuple]:
    """(shape, strides, offset) of node's value where it is a plain view of its first
    argument's (a view op's one tensor output on that storage, no conjugate or negative bit,
    no gradient); None otherwise."""
    target, value = node.target, node.meta.get("val")
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], Node) else None
    if not (isinstance(target, torch._ops.OpOverload) and target.is_view  # noqa: SLF001
            and isinstance(value, FakeTensor) and isinstance(source, FakeTensor)):
        return None
    if value.is_conj() or value.is_neg() or value.requires_grad or value.dtype != source.dtype \
            or value.device != source.device \
            or value.untyped_storage()._cdata != source.untyped_storage()._cdata:  # noqa: SLF001
        return None
    return tuple(value.shape), value.stride(), value.storage_offset()


def _fake_view(source: FakeTensor, view: tuple, fake_mode: Any) -> FakeTensor:
    """A fake view of `source`'s storage of the layout `view` (_view_of_first_argument's), as
    the fake mode makes a cached view op's output (FakeTensorMode._get_output_tensor_from_cache_entry)."""
    shape, stride, offset = view
    return _fake_tensor(fake_mode, shape, stride, source.dtype, source.device, (source.untyped_storage(), offset))


def _viewable_as_complex(arg: Any) -> bool:
    """Whether view_as_complex can view `arg`'s value: pairs along a last dim of stride 1, every
    other stride and the offset even (False where undecidable: a copy then serves)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    value = arg.meta.get("val") if isinstance(arg, Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    try:
        return bool(guard_or_false(value.stride(-1) == 1) and guard_or_false(value.storage_offset() % 2 == 0)
                    and all(guard_or_false(stride % 2 == 0) for stride in value.stride()[:-1]))
    except Exception:  # noqa: BLE001 - undecidable
        return False


def _fake_result_key(node: Node) -> Optional[tuple]:
    """(target, the layouts and values of its arguments) of an op's call when every size is
    static; None otherwise. An op's result layout is a function of these alone (fake values
    hold no data; a data-dependent size is symbolic, so no key); whether the result is new
    memory or a view of an argument too: new memory is reused as a fresh fake tensor of its
    layout, a view as a view of the argument's own storage (a view's fake value must share its
    base's storage: _remember_result)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return None

    def layout(value: Any) -> Any:
        if isinstance(value, Node):
            if "val" not in value.meta:
                raise _Unkeyable
            return layout(value.meta["val"])
        if isinstance(value, (list, tuple)):
            return tuple(layout(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, layout(v)) for k, v in value.items())
        if isinstance(value, torch.Tensor):
            if not _static_layout(value):
                raise _Unkeyable
            # (the conjugate and negative bits too: a view of a conjugate view is one)
            return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                    value.device, value.requires_grad, value.is_conj(), value.is_neg())
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Unkeyable
        hash(value)
        return (type(value), value)

    try:
        return (target, layout(node.args), layout(node.kwargs))
    except (_Unkeyable, TypeError):
        return None


class _Unkeyable(Exception):
    pass


def _new_memory(value: Any, inputs: Sequence[Node]) -> bool:
    """Whether no tensor of `value` shares storage with an input's value: a copy made by the
    op, which a fresh fake tensor of its layout stands for (fake_copy)."""
    outputs = value if isinstance(value, (list, tuple)) else [value]
    if not outputs or not all(isinstance(v, torch.Tensor) for v in outputs):
        return False
    storages = {v.untyped_storage()._cdata for node in inputs
                for v in (node.meta.get("val") if isinstance(node.meta.get("val"), (list, tuple))
                          else [node.meta.get("val")]) if isinstance(v, torch.Tensor)}
    return all(v.untyped_storage()._cdata not in storages for v in outputs)  # noqa: SLF001


def _static_layout(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_static_layout(v) for v in value)
    if isinstance(value, torch.Tensor):
        return all(isinstance(size, int) for size in (*value.shape, *value.stride(), value.storage_offset()))
    return not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def fake_copy(value: Any, fake_mode: Any) -> Any:
    """A new fake value of `value`'s layout (a tensor, or a list or tuple of values) in
    `fake_mode`, made as the fake mode makes its cached outputs
    (FakeTensorMode._get_output_tensor_from_cache_entry): a meta tensor wrapped, not an
    empty_strided dispatched through the mode (5x slower). Values that are not tensors are
    returned as they are."""
    if isinstance(value, (list, tuple)):
        return type(value)(fake_copy(v, fake_mode) for v in value)
    if isinstance(value, torch.Tensor):
        return _fake_tensor(fake_mode, value.shape, value.stride(), value.dtype, value.device)
    return value


def _fake_tensor(fake_mode: Any, shape: Sequence, stride: Sequence, dtype: torch.dtype, device: torch.device,
                 on_storage: Optional[tuple] = None) -> FakeTensor:
    """A fake tensor of this layout in `fake_mode`, made as the fake mode makes its cached outputs
    (a meta tensor wrapped); `on_storage` (storage, offset): a view of that storage."""
    with in_kernel_invocation_manager(fake_mode):
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if on_storage is not None:
            meta.set_(on_storage[0], on_storage[1], shape, stride)
    return FakeTensor(fake_mode, meta, device)
