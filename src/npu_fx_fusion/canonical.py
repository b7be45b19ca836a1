"""One spelling per computation: the normalisations both sides of a match get.

A pattern matches only what is spelled exactly like its trace. Model code and autograd
spell the same computation in several ways (a dim as 2 or -1, a view's size as -1, a
gradient sum in arrival order ...), so the graphs being fused and the traces of the
patterns' search functions are both put into one canonical spelling before matching.
Every rewrite here keeps the computation exactly as it was.

The bottom of the engine, beside nodes.py: it imports nothing above it.
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from .cleanup import fake_copy
from .nodes import RESHAPES, is_call, known_equal, same_layout, tensor_meta

aten = torch.ops.aten
Node = torch.fx.Node


def is_backward(node: Node) -> bool:
    """A node aot_autograd derived from autograd (the backward half of a joint graph)."""
    return bool(node.meta.get("autograd_backward")) or node.meta.get("partitioner_tag") == "is_backward"


def is_joint_graph(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)


def functionalize_inplace_on_temporaries(graph: torch.fx.Graph) -> int:
    """`add_(t, eps)` on a temporary `t` used nowhere else -> `add(t, eps)`.

    That is what aot_autograd's functionalization makes of it (F.rms_norm's eps add), and
    make_fx alone does not functionalize. Only this trivial case occurs in search
    functions; anything else is left alone (and then simply will not match).
    """
    changed = 0
    for node in graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.name.endswith("_"):  # noqa: SLF001
            continue
        mutated = node.args[0] if node.args else None
        if not isinstance(mutated, Node) or mutated.op == "placeholder" or len(mutated.users) != 1:
            continue
        packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1][:-1], None)  # noqa: SLF001
        functional = getattr(packet, target._overloadname, None)  # noqa: SLF001
        if functional is not None:
            node.target = functional
            changed += 1
    return changed



# op -> (index of its dim argument(s), name of that argument, whether it is a list of
# dims, how many dims the output has more than the input the dim refers to). The rank a
# dim refers to is the first tensor input's (cat, stack: the first tensor of its list).
_DIM_ARGUMENTS = {
    aten.mean.dim: ((1,), "dim", True, 0),
    aten.sum.dim_IntList: ((1,), "dim", True, 0),
    aten.amax.default: ((1,), "dim", True, 0),
    aten.amin.default: ((1,), "dim", True, 0),
    aten.slice.Tensor: ((1,), "dim", False, 0),
    aten.split.Tensor: ((2,), "dim", False, 0),
    aten.split_with_sizes.default: ((2,), "dim", False, 0),
    aten.cat.default: ((1,), "dim", False, 0),
    aten.select.int: ((1,), "dim", False, 0),
    aten._softmax.default: ((1,), "dim", False, 0),
    aten._log_softmax.default: ((1,), "dim", False, 0),
    aten.topk.default: ((2,), "dim", False, 0),
    aten.sort.default: ((1,), "dim", False, 0),
    aten.sort.stable: ((), "dim", False, 0),
    aten.argsort.default: ((1,), "dim", False, 0),
    aten.argsort.stable: ((), "dim", False, 0),
    aten.cumsum.default: ((1,), "dim", False, 0),
    aten.argmax.default: ((1,), "dim", False, 0),
    aten.max.dim: ((1,), "dim", False, 0),
    aten.gather.default: ((1,), "dim", False, 0),
    aten.index_select.default: ((1,), "dim", False, 0),
    aten.squeeze.dim: ((1,), "dim", False, 0),
    aten.unsqueeze.default: ((1,), "dim", False, 1),
    aten.stack.default: ((1,), "dim", False, 1),
    aten.transpose.int: ((1, 2), None, False, 0),
}

# x + 2.0 reaches a graph as add.Tensor(x, 2.0) or (F.rms_norm's eps) add.Scalar(x, 2.0):
# one computation (a Python number is a wrapped scalar either way). Spelled .Tensor.
_SCALAR_OVERLOADS = {
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Scalar: aten.div.Tensor,
}


def canonicalize(graph: torch.fx.Graph) -> int:
    """Spell each computation one way, whichever way the code wrote it.

    - dim arguments as negative indices (`mean(x, [2])` on 3-d x -> `[-1]`, a transpose's
      two dims in order): model code says `mean(-1)`, F.rms_norm `mean([x.dim() - 1])`,
      dynamo turns `x[..., :h]` into `slice(x, 3, 0, h)`;
    - a -1 in a view's sizes as the size it stands for (`view(x, [2, 16, -1, 2])` ->
      `[2, 16, 32, 2]`), where that size is a plain int: `reshape(..., -1, 2)` reaches
      the graph with or without its -1;
    - the pieces of a split (chunk, split, split_with_sizes) as the slices they are, and
      a slice's bounds within the dim (`x[..., h:]` ends at 2**63 - 1, the second chunk at
      the dim's size): one view of the same elements, however it was taken;
    - a binary op with a Python number as its .Tensor overload (add.Scalar -> add.Tensor),
      or with a symbolic one (the mean's backward divides by its count s1 as
      `div.Scalar(grad, s1)` under dynamic shapes, by 8 as `div.Tensor(grad, 8)` in a trace);
    - a reshape of an expanded tensor as `reshape`: torch decomposes it into a `view`
      where the expanded strides allow one (an expand of a size-1 dim: DeepSeek's group
      mask with n_group=1) and into `clone` + `_unsafe_view` elsewhere, the same values;
      torchair turns views into reshapes anyway (_optimize_fx's view_to_reshape);
    - no `detach`: aot graphs run without autograd, where it is the identity. Joint
      graphs detach what they save for the backward, and a search may detach an output
      the model uses without a gradient (a router's full scores), so that its joint
      trace has no tangent for it.
    - no clone that copies a tensor into one of the same metadata (eager attention's
      `dropout(p=0)` in eval reaches aot graphs as one): torch's fwd_only, which traces the
      search functions, removes those as no-ops (remove_noop_ops), so a pattern never has
      one. A clone of a graph input stays (the input may be written back by a copy_), and
      so does one that leaves the graph (an output must not alias another value).
    - an operand a binary op upcasts to its result's dtype (`x_bf16 * rsqrt(v_fp32)`,
      transformers' CpmAntLayerNorm) as the graph's explicit cast of that operand
      (`x.to(torch.float32)`), where it has one defined before: type promotion converts it
      exactly, as the cast does. No cast is added where the graph has none.
    - no slice of a whole dim (`t[:, None]` under dynamic shapes records `slice(t, 0, 0, 2**63 - 1)`
      before the unsqueeze, where a static size lets dynamo leave it out): its input, with the
      same metadata (the test remove_noop_ops uses), stands for it.
    - `1 / t` as `reciprocal(t)`: dynamo records it as `reciprocal(t) * 1`, a multiply by
      the number 1 with the result's metadata (exact for every float, -0.0, inf and nan
      included). Only after a reciprocal: elsewhere a model's multiply by a scale that
      happens to be 1 (torchtitan's route_scale) is where a form has a scale argument.
    - one node per symbolic size: aot graphs can compute one SymInt expression twice
      (`sym_size(a2a, 0)` and `sym_sum(u2, u3)` for the rows an expert-parallel
      all-to-all received), where the exact retrace of a form (accept._exact_pattern)
      has one placeholder per symbolic size, which torch's matcher binds to one node
      (_one_node_per_symbolic_size).
    - a size read of a computed tensor (`sym_size(slice, 3)`: dynamo sizes a flatten after a
      stack from its operand's size) as the same symbolic size computed from the graph's
      inputs (`s92 // 2` of its SymInt input s92), where the shape environment gives it
      from their symbols: a read is a use, and a pattern pins the users of its
      intermediates, so the read of an intermediate kept the region from matching, and a
      replacement erasing it would leave the read behind (size_reads_from_inputs).
    - a tensor assembled by writing slices into a new buffer (`k = x.new_empty(...)`,
      `k[..., :a].copy_(p)`, `k[..., a:].copy_(q)`: transformers' DeepSeek-V3 key) as the
      `cat` of the pieces, each broadcast and cast as copy_ does, where the slices tile the
      buffer's dim and nothing else reads it half written (_slice_writes_as_cat): the
      buffer's own contents are never read, and one concatenation is one launch where the
      writes were five.
    Each of these computes exactly what it replaces. Spellings that are equal in value
    but not bit for bit (x / sqrt(v) and x * rsqrt(v)) are not rewritten: the patterns
    accept them instead (spellings.py). Search functions and matched graphs are both
    canonicalised. Returns the number of nodes changed.
    """
    changed = size_reads_from_inputs(graph) + _one_node_per_symbolic_size(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _CANONICALIZED:
            continue
        if node.target is aten.detach.default and not (
                node.args[0].op == "placeholder" and any(u.op == "output" for u in node.users)):
            # (an input's detached alias leaving the graph stays: aot's runtime wrapper
            # knows that output as a view of the input)
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
            continue
        if node.target in _SCALAR_OVERLOADS and len(node.args) == 2 and _is_number(node.args[1]):
            node.target = _SCALAR_OVERLOADS[node.target]
            changed += 1
        if node.target in _PROMOTING:
            changed += _explicit_upcasts(node)
        if _is_noop_clone(node) or _is_reciprocal_times_one(node) or _is_whole_slice(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
            continue
        if node.target in (aten.view.default, aten._unsafe_view.default):
            changed += _reshape_of_expand(graph, node)
        if node.target in RESHAPES:
            changed += _resolve_inferred_size(node)
        elif node.target in _DIM_ARGUMENTS:
            changed += _canonical_dims(node)
        if node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            changed += _split_as_slices(graph, node)
        elif node.target is aten.slice.Tensor:
            changed += _canonical_slice_bounds(node)
        elif node.target is aten.slice_backward.default:
            changed += _canonical_slice_backward_bounds(node)
    for node in sorted(n for target in _NEW_BUFFERS for n in graph.find_nodes(op="call_function", target=target)):
        changed += _slice_writes_as_cat(graph, node)
    return changed


# Buffers whose initial contents a full overwrite makes irrelevant.
_NEW_BUFFERS = frozenset({aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default,
                          aten.zeros.default})


def _slice_writes_as_cat(graph: torch.fx.Graph, buffer: Node) -> int:
    """`slice_scatter(... slice_scatter(buffer, p0, d, 0, a) ..., pn, d, b, end)` -> `cat([p0 ..
    pn], d)`, where the slices tile dim d of `buffer` in order (any order of writes), each
    written value is a copy into the slice it replaces (`copy(slice(current, d, s, e), src)`:
    src broadcast to the slice and cast to its dtype) or a value of the slice's shape and
    dtype, and no node but the next write reads a half-written buffer."""
    out = tensor_meta(buffer)
    if out is None:
        return 0
    pieces, current, chain = [], buffer, [buffer]
    while True:
        scatters = [u for u in current.users if is_call(u, aten.slice_scatter.default) and u.args[0] is current]
        if len(scatters) != 1:
            break
        scatter = scatters[0]
        bounds = _write_bounds(scatter.args[2:], out)
        piece = _written_value(scatter, current, bounds)
        if piece is None or set(current.users) - {scatter, *piece[1]}:
            return 0
        pieces.append((bounds, piece[0]))
        chain.extend((*piece[1], scatter.args[1], scatter))
        current = scatter
    if current is buffer or len({dim for (dim, _, _), _ in pieces}) != 1:
        return 0
    dim, ordered, edge = pieces[0][0][0], [], 0
    while pieces:  # the pieces in order along dim: each starts where the one before ends
        following = next((item for item in pieces if known_equal(item[0][1], edge)), None)
        if following is None:
            return 0
        pieces.remove(following)
        ordered.append(following[1])
        edge = following[0][2]
    if not known_equal(edge, out.shape[dim]):
        return 0
    with graph.inserting_before(current):
        values = [_as_written(graph, src, slot) for src, slot in ordered]
        cat = graph.call_function(aten.cat.default, (values, dim))
    cat.meta = dict(current.meta)
    current.replace_all_uses_with(cat)
    for node in reversed(chain):  # the writes, the slices they read, the buffer
        if not node.users:
            graph.erase_node(node)
    return 1


def _write_bounds(args: Sequence[Any], out: torch.Tensor) -> Optional[tuple]:
    """(dim, start, end) of a slice's or slice_scatter's (dim, start, end, step) arguments,
    the dim negative and the end within the dim of `out`."""
    dim, start, end, step = (list(args) + [0, 0, _END, 1][len(args):])[:4]
    if step != 1 or not isinstance(dim, int) or not isinstance(start, (int, torch.SymInt)):
        return None
    dim = dim - out.dim() if dim >= 0 else dim
    size = out.shape[dim]
    if end == _END or (isinstance(end, int) and isinstance(size, int) and end >= size):
        end = size
    return dim, start, end


def _written_value(scatter: Node, current: Node, bounds: Optional[tuple]) -> Optional[tuple]:
    """((src, slot value), the nodes of current it reads) for the value a slice_scatter writes: a
    copy into the slice of `current` it replaces reads only that slice's shape, dtype."""
    out = tensor_meta(current)
    if bounds is None or scatter.kwargs:
        return None
    value = scatter.args[1]
    slot = tensor_meta(value)
    if is_call(value, aten.copy.default) and len(value.users) == 1 and not value.kwargs:
        destination, src = value.args[0], value.args[1]
        if (is_call(destination, aten.slice.Tensor) and destination.args[0] is current
                and len(destination.users) == 1 and isinstance(src, Node)
                and not destination.kwargs and _same_bounds(_write_bounds(destination.args[1:], out), bounds)):
            return (src, slot), (destination,)
        return None
    if isinstance(value, Node) and current not in value.all_input_nodes:
        return (value, slot), ()
    return None


def _same_bounds(a: Optional[tuple], b: tuple) -> bool:
    return a is not None and a[0] == b[0] and known_equal(a[1], b[1]) and known_equal(a[2], b[2])


def _as_written(graph: torch.fx.Graph, src: Node, slot: torch.Tensor) -> Node:
    """src as a write into `slot` makes it: broadcast to its shape, in its dtype."""
    value = tensor_meta(src)
    if tuple(value.shape) != tuple(slot.shape):
        src = graph.call_function(aten.expand.default, (src, list(slot.shape)))
        src.meta["val"] = value = value.expand(slot.shape)
    if value.dtype != slot.dtype:
        src = graph.call_function(aten._to_copy.default, (src,), {"dtype": slot.dtype})
        src.meta["val"] = value.to(slot.dtype)
    return src


def _is_number(arg: Any) -> bool:
    """A Python number, or a node computing a symbolic one: under dynamic shapes the mean's
    backward divides by its count as `div.Scalar(grad, s1)`, a SymInt node."""
    if isinstance(arg, Node):
        return isinstance(arg.meta.get("val"), (torch.SymInt, torch.SymFloat))
    return True


# binary ops that compute in their result's dtype, type promotion converting each operand
_PROMOTING = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor})

# the ops a rewrite of canonicalize's walk starts from (each one tests its node's op first):
# other calls it passes by
_CANONICALIZED = frozenset({aten.detach.default, *_SCALAR_OVERLOADS, *_PROMOTING, aten.clone.default,
                            aten.slice.Tensor, aten.view.default, aten._unsafe_view.default, *RESHAPES,
                            *_DIM_ARGUMENTS, aten.split.Tensor, aten.split_with_sizes.default,
                            aten.slice_backward.default})


def _explicit_upcasts(node: Node) -> int:
    result = node.meta.get("val")
    if not isinstance(result, torch.Tensor) or not result.is_floating_point():
        return 0
    changed = 0
    for index, operand in enumerate(node.args[:2]):
        value = operand.meta.get("val") if isinstance(operand, Node) else None
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.element_size() < result.element_size()):
            continue  # not upcast (a wider operand is rounded to the result: not a cast's value)
        # (in a joint graph a backward op reads a backward cast only: one of the forward's
        # would be saved for the backward in place of the narrower operand)
        cast = next((user for user in operand.users if user < node and user.target is aten._to_copy.default
                     and user.args == (operand,) and user.kwargs == {"dtype": result.dtype}
                     and is_backward(user) == is_backward(node)), None)
        if cast is not None:
            node.update_arg(index, cast)
            changed += 1
    return changed


def _one_node_per_symbolic_size(graph: torch.fx.Graph) -> int:
    """Every later node computing the same symbolic size (SymInt expression) as an earlier
    one reads the earlier one instead (and goes): the same value, by the shape environment
    that gave both nodes their expression. A node that defines a data-dependent symbol
    (`_local_scalar_dense`: meta["unbacked_bindings"]) reads data and stays, even where the
    shape environment knows its value equals another's: the runtime check of that
    equality reads it."""
    first: dict = {}
    changed = 0
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.SymInt) or not val.node.expr.free_symbols:
            continue
        earlier = first.setdefault(val.node.expr, node)
        if earlier is not node and not node.meta.get("unbacked_bindings"):
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            changed += 1
    return changed


# ops that read a size of a tensor (aten's spelling of `x.shape[i]`, `x.numel()` ...)
_SIZE_READS = (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default)


def size_reads_from_inputs(graph: torch.fx.Graph, among: Optional[Iterable[Node]] = None) -> int:
    """Each read of a symbolic size of a computed tensor (among `among`, default the whole
    graph) reads the same size computed from the graph's inputs instead (and goes); returns
    how many went.

    The value is the read's own expression in the shape environment's symbols, which hold
    for every input the compiled graph accepts (its guards), and each symbol comes from an
    input: a SymInt placeholder, or a size of a tensor placeholder. A read whose symbols
    do not all come from inputs (a data-dependent size: `u0` of an expert's token count)
    or whose expression is not integer arithmetic stays a read.

    A replacement gets this too (accept.insert_replacement): `ones(x.shape[-1:])` of a
    weightless norm's fused call would read the size of x, the residual sum an
    add_rms_norm then computes itself."""
    reads = [n for n in (graph.nodes if among is None else among)
             if n.op == "call_function" and n.target in _SIZE_READS
             and isinstance(n.args[0], Node) and n.args[0].op != "placeholder"
             and isinstance(n.meta.get("val"), torch.SymInt)]
    if not reads:
        return 0
    sizes = _InputSizes(graph)
    changed = 0
    for read in reads:
        value = sizes.node_for(read.meta["val"])
        if value is not None:
            read.replace_all_uses_with(value)
            graph.erase_node(read)
            changed += 1
    sizes.erase_unused()
    return changed


class _InputSizes:
    """Symbolic sizes as nodes computing them from a graph's inputs, made on demand at the
    top of the graph (after the placeholders: only they are read)."""

    def __init__(self, graph: torch.fx.Graph):
        import sympy
        from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PowByNatural, PythonMod

        self.graph = graph
        placeholders = graph.find_nodes(op="placeholder")
        self.top = placeholders[-1].next if placeholders else None  # what the nodes made go before
        self.made: list[Node] = []
        self.nodes: dict = {}  # sympy expression -> (node or int, its value)
        self.symbols: dict = {}  # symbol -> (placeholder, None: it is the SymInt / i: its size i)
        for placeholder in placeholders:
            value = placeholder.meta.get("val")
            if isinstance(value, torch.SymInt):
                self.symbols.setdefault(value.node.expr, (placeholder, None))
            elif isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        self.symbols.setdefault(size.node.expr, (placeholder, dim))
        # sympy's classes of integer arithmetic -> the Python operator computing each
        self.operators = [(sympy.Add, operator.add), (sympy.Mul, operator.mul), (FloorDiv, operator.floordiv),
                          (PythonMod, operator.mod), (Mod, operator.mod), (PowByNatural, operator.pow),
                          (Max, torch.sym_max), (Min, torch.sym_min)]

    def node_for(self, value: torch.SymInt) -> Optional[Node]:
        """A node computing `value` from the inputs, or None where it cannot be computed."""
        found = self._expression(value.node.expr)
        if found is None or not isinstance(found[0], Node) or not statically_known_true(found[1] == value):
            return None
        return found[0]

    def _expression(self, expr: Any) -> Optional[tuple]:
        if expr in self.nodes:
            return self.nodes[expr]
        if expr.is_Integer:
            return int(expr), int(expr)
        if expr.is_Symbol:
            found = self._symbol(expr)
        else:
            op = next((op for kind, op in self.operators if isinstance(expr, kind)), None)
            operands = [self._expression(arg) for arg in expr.args] if op is not None else [None]
            if any(operand is None for operand in operands):
                return None
            found = operands[0]
            for operand in operands[1:]:  # (Add and Mul take any number of terms)
                found = self._call(op, found, operand)
        self.nodes[expr] = found
        return found

    def _symbol(self, symbol: Any) -> Optional[tuple]:
        if symbol not in self.symbols:
            return None
        placeholder, dim = self.symbols[symbol]
        if dim is None:
            return placeholder, placeholder.meta["val"]
        # (a read of the same size further down then reads this one: _one_node_per_symbolic_size)
        size = placeholder.meta["val"].shape[dim]
        return self._made(aten.sym_size.int, (placeholder, dim), size), size

    def _call(self, op: Any, a: tuple, b: tuple) -> tuple:
        value = op(a[1], b[1])
        if not isinstance(value, torch.SymInt):  # two numbers
            return value, value
        return self._made(op, (a[0], b[0]), value), value

    def _made(self, target: Any, args: tuple, value: Any) -> Node:
        with self.graph.inserting_before(self.top):
            node = self.graph.call_function(target, args)
        node.meta["val"] = value
        self.made.append(node)
        return node

    def erase_unused(self) -> None:
        for node in reversed(self.made):
            if not node.users:
                self.graph.erase_node(node)


def _reshape_of_expand(graph: torch.fx.Graph, view: Node) -> int:
    source = view.args[0]
    copy = None
    if view.target is aten._unsafe_view.default:
        if not (is_call(source, aten.clone.default) and len(source.users) == 1
                and source.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format):
            return 0
        copy, source = source, source.args[0]
    if not is_call(source, aten.expand.default):
        return 0
    view.target = aten.reshape.default
    if copy is not None:
        view.args = (source, *view.args[1:])
        graph.erase_node(copy)
    return 1


def _can_stand_for(source: Any, node: Node) -> bool:
    """`source` may replace `node`, a no-op of it: a computed value (not an input, which may
    be written back by a copy_) with node's metadata, where node leaves no output (an
    output must not alias another value)."""
    from torch._inductor.fx_passes.post_grad import same_meta  # remove_noop_ops' own test

    return (isinstance(source, Node) and source.op != "placeholder"
            and not any(user.op == "output" for user in node.users) and same_meta(node, source))


def _is_noop_clone(node: Node) -> bool:
    if node.target is not aten.clone.default or node.kwargs.get(
            "memory_format", torch.preserve_format) is not torch.preserve_format:
        return False
    return _can_stand_for(node.args[0], node)


def _is_whole_slice(node: Node) -> bool:
    """`x[:]` of a symbolic dim: slice(x, d, 0, 2**63 - 1) (dynamo records `t[:, None]` so under
    dynamic shapes, where a static size lets it drop the slice), the same elements and strides."""
    if node.target is not aten.slice.Tensor or node.kwargs or len(node.args) < 4:
        return False
    start, end, step = node.args[2], node.args[3], node.args[4] if len(node.args) > 4 else 1
    return start == 0 and end == _END and step == 1 and _can_stand_for(node.args[0], node)


def _is_reciprocal_times_one(node: Node) -> bool:
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return False
    source, number = node.args
    return (is_call(source, aten.reciprocal.default) and not isinstance(number, (Node, bool)) and number == 1
            and _can_stand_for(source, node))


def _canonical_dims(node: Node) -> int:
    indices, keyword, is_list, extra_rank = _DIM_ARGUMENTS[node.target]
    first = node.args[0][0] if node.target in (aten.cat.default, aten.stack.default) else node.args[0]
    source = tensor_meta(first)
    if source is None or source.dim() == 0:
        return 0
    rank = source.dim() + extra_rank
    args, kwargs = list(node.args), dict(node.kwargs)
    spots = [("args", i) for i in indices if i < len(args)]
    if keyword and keyword in kwargs:
        spots.append(("kwargs", keyword))
    if not spots:
        return 0  # the default dim (cat's 0, slice's 0, topk's -1): leave it
    for where, key in spots:
        holder = args if where == "args" else kwargs
        dims = holder[key]
        if is_list and isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims):
            holder[key] = [d - rank if d >= 0 else d for d in dims]
        elif isinstance(dims, int) and not isinstance(dims, bool):
            holder[key] = dims - rank if dims >= 0 else dims
    if node.target is aten.transpose.int and all(isinstance(d, int) for d in args[1:3]):
        args[1:3] = sorted(args[1:3])
    # a trailing dim equal to its default as left out, as a trace records `topk(x, k, dim=-1)`:
    # `topk(x, k, 1)` on 2-d x (older Mixtral routers) is then spelled like the pattern
    schema = node.target._schema.arguments  # noqa: SLF001
    last = len(args) - 1
    if last in indices and last < len(schema) and schema[last].has_default_value() \
            and not is_list and args[last] == schema[last].default_value and isinstance(args[last], int):
        args.pop()
    if tuple(args) == tuple(node.args) and kwargs == dict(node.kwargs):
        return 0
    node.args, node.kwargs = tuple(args), kwargs
    return 1


def _split_as_slices(graph: torch.fx.Graph, split: Node) -> int:
    """getitem(split(x, sizes, dim), i) -> slice(x, dim, start_i, end_i), for static sizes,
    and for a split in two pieces of a symbolic size n (`x.chunk(2, -1)`, `torch.split(x,
    x.shape[-1] // 2, -1)` under dynamic shapes): x[..., :n] and x[..., n:], as the slices
    `x[..., : d // 2]` reach the graph."""
    source = tensor_meta(split.args[0])
    if source is None or len(split.args) < 2 or set(split.kwargs) - {"dim"}:
        return 0
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    length = source.shape[dim] if -source.dim() <= dim < source.dim() else None
    sizes = split.args[1]
    if not all(u.op == "call_function" and u.target is operator.getitem for u in split.users):
        return 0
    pieces = split.meta.get("val")
    if (split.target is aten.split.Tensor and isinstance(sizes, Node) and isinstance(sizes.meta.get("val"), torch.SymInt)
            and isinstance(pieces, (list, tuple)) and len(pieces) == 2 and length is not None):
        bounds = [(0, sizes), (sizes, _END)]  # pieces of n, the last one the rest
    elif isinstance(length, int) and (isinstance(sizes, int) or all(isinstance(s, int) for s in sizes)):
        if isinstance(sizes, int):  # split.Tensor: pieces of `sizes`, the last one shorter
            sizes = [min(sizes, length - start) for start in range(0, length, sizes)] if sizes > 0 else []
        if sum(sizes) != length:
            return 0
        bounds = [(start, start + size) for start, size in zip(itertools.accumulate([0, *sizes[:-1]]), sizes)]
    else:
        return 0
    dim = dim - source.dim() if dim >= 0 else dim
    for user in list(split.users):
        start, end = bounds[user.args[1]]
        with graph.inserting_before(user):
            piece = graph.call_function(aten.slice.Tensor, (split.args[0], dim, start, end))
        piece.meta = dict(user.meta)
        user.replace_all_uses_with(piece)
        graph.erase_node(user)
    graph.erase_node(split)
    return 1


_END = 2**63 - 1  # what `x[a:]` passes as the end of a slice


def _canonical_slice_bounds(node: Node) -> int:
    """slice(x, dim, start, end): start and end clamped into [0, size] when static, an
    end at the dim's size spelled as the size, step 1 left out."""
    source = tensor_meta(node.args[0])
    if source is None or len(node.args) < 2 or node.kwargs:
        return 0
    dim = node.args[1]
    size = source.shape[dim] if isinstance(dim, int) and -source.dim() <= dim < source.dim() else None
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else _END
    step = node.args[4] if len(node.args) > 4 else 1
    if not isinstance(size, int) or not all(isinstance(v, int) for v in (start, end, step)) or step != 1:
        return 0
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    args = (node.args[0], dim, start, end)
    if args == tuple(node.args):
        return 0
    node.args = args
    return 1


def _canonical_slice_backward_bounds(node: Node) -> int:
    """slice_backward(grad, sizes, dim, start, end, step), the gradient of a slice: its dim,
    start and end spelled as the forward slice's are (_canonical_dims, _canonical_slice_bounds),
    so that `x.narrow(-1, h, h)` and `x[..., h:]` have one backward as they have one forward."""
    if len(node.args) != 6 or node.kwargs:
        return 0
    grad, sizes, dim, start, end, step = node.args
    if not (isinstance(sizes, (list, tuple)) and all(isinstance(v, int) for v in (dim, start, end, step))
            and step == 1 and -len(sizes) <= dim < len(sizes) and isinstance(sizes[dim], int)):
        return 0
    size = sizes[dim]
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    args = (grad, sizes, dim - len(sizes) if dim >= 0 else dim, start, end, step)
    if args == tuple(node.args):
        return 0
    node.args = args
    return 1


def _resolve_inferred_size(view: Node) -> int:
    out = tensor_meta(view)
    if out is None or len(view.args) < 2 or not isinstance(view.args[1], (list, tuple)):
        return 0
    sizes = list(view.args[1])
    if -1 not in sizes or len(sizes) != out.dim() or not isinstance(out.shape[sizes.index(-1)], int):
        return 0
    sizes[sizes.index(-1)] = out.shape[sizes.index(-1)]
    view.args = (view.args[0], sizes, *view.args[2:])
    return 1


# ---- joint graphs ------------------------------------------------------------------------
def normalize_joint_graph(gm: torch.fx.GraphModule) -> list[Node]:
    """Make a joint graph look like the joint pattern traces: what joint_fwd_bwd does to
    them (remove_noop_ops, then Inductor's early_patterns: pointless views, view pairs and
    permute pairs, which einsum's backward leaves), and the canonicalisations both sides
    get. Returns the gradient sums whose layout the re-folding changed
    (canonicalize_grad_accumulation): the views downstream of them were traced for the old
    one, and the caller must propagate the new one (cleanup.views_to_reshapes_where_needed)."""
    from torch._inductor.fx_passes.joint_graph import early_patterns

    if any(not n.users and n.op == "call_function" for n in gm.graph.nodes):  # aot's joint graphs have none
        gm.graph.eliminate_dead_code()  # patterns pin user counts
    # canonicalize first: a view whose sizes spell a -1 (transformers' `reshape(B, -1, S, D)`
    # after SDPA) is a no-op only once the -1 is resolved, as it is in the traces
    canonicalize(gm.graph)
    remove_noop_ops(gm.graph)
    early_patterns.apply(gm.graph)
    hoist_contiguous_copies(gm.graph)
    gradient_copies_apart(gm.graph)
    relaid: list[Node] = []
    canonicalize_grad_accumulation(gm.graph, relaid)
    gm.recompile()
    return relaid


def remove_noop_ops(graph: torch.fx.Graph) -> None:
    """torch's remove_noop_ops (torch/_inductor/fx_passes/post_grad.py), which joint_fwd_bwd
    runs on the joint pattern traces, with one change: a candidate's metadata are compared
    (same_meta, a few attribute reads) before its fake arguments are collected
    (get_fake_args_kwargs, ~30 us a node). Three in four of a joint graph's candidates fail
    the comparison (slices, concatenations, views that change the shape), and both tests are
    pure, so the graph comes out as torch's does, node for node
    (tests/test_training.py::test_remove_noop_ops_is_torchs)."""
    from torch._inductor.fx_passes.post_grad import get_fake_args_kwargs, get_node_storage, noop_registry, same_meta

    inputs = set(graph.find_nodes(op="placeholder"))
    input_storages = {get_node_storage(node) for node in inputs}
    output_node = next(iter(reversed(graph.nodes)))
    outputs = output_node.args[0] if isinstance(output_node.args[0], (list, tuple)) else (output_node.args[0],)
    output_storages = {get_node_storage(out) for out in outputs if isinstance(out, Node)}
    for node in list(graph.nodes):
        if node.target not in noop_registry:
            continue
        cond, src_index = noop_registry[node.target]
        src = node.args[src_index] if isinstance(src_index, int) else src_index(node.args)
        if not isinstance(src, Node):
            continue
        if node.target is aten.copy.default:
            dst = node.args[0]
            if isinstance(dst, Node) and dst.op == "call_function" and dst.kwargs.get("pin_memory") is True:
                continue
        # no new aliasing between inputs and outputs, and never an output that is its own input
        node_storage, src_storage = get_node_storage(node), get_node_storage(src)
        node_is_view = node_storage == src_storage
        if not node_is_view and node_storage in output_storages \
                and (src_storage in input_storages or src_storage in output_storages):
            continue
        if node_is_view and node in output_node.args and (src in inputs or src in output_node.args):
            continue
        if not same_meta(node, src):  # (torch tests this after collecting the arguments)
            continue
        is_valid, args, kwargs = get_fake_args_kwargs(node)
        if is_valid and cond(*args, **kwargs):
            node.replace_all_uses_with(src)
            graph.erase_node(node)


# ---- dynamo graphs, before autograd ---------------------------------------------------------
DYNAMO_PRODUCTS = (operator.mul, torch.mul, torch.Tensor.mul)


def autograd_spellings(gm: torch.fx.GraphModule) -> int:
    """A dynamo graph about to be differentiated, spelled as the joint forms are traced,
    where the value is the same bit for bit; returns how many nodes changed.

    The forward patterns take every spelling of spellings.py, but autograd differentiates
    the op a spelling calls, so each spelling has a backward of its own, and a joint form
    matches only the one it was traced from. Rewritten before aot_autograd traces the joint
    graph, a respelled RMSNorm trains fused. Each rewrite computes the same bits (measured
    on torch's CPU kernels, the stand-in's reference): x * x and x.square() are x ** 2
    (squares_as_powers); v ** -0.5 is rsqrt(v) (pow's kernel calls rsqrt for -0.5); and a
    float32 sum(x, dims) / n, n the count summed, is mean(x, dims), which divides the same
    sum (in a half dtype mean rounds once where sum / n rounds twice: left as written)."""
    changed = squares_as_powers(gm)
    for node in list(gm.graph.nodes):
        if _is_power(node, -0.5):
            node.op, node.target, node.args, node.kwargs = "call_function", torch.rsqrt, (node.args[0],), {}
            changed += 1
        elif (mean := _sum_over_count(node)) is not None:
            summed, dims, keepdim = mean
            total = node.args[0]
            node.op, node.target = "call_function", torch.mean
            node.args, node.kwargs = (summed,), {"dim": dims, "keepdim": keepdim}
            gm.graph.erase_node(total)  # its one user was this division (not a graph-wide DCE:
            changed += 1                # a dynamo graph's in-place methods look unused to it)
    if changed:
        gm.recompile()
    return changed


def dynamo_call(node: Any, functions: tuple, method: str) -> bool:
    """A dynamo graph's call of one of `functions`, or of the tensor method `method` (dynamo
    records `x.pow(2)` as call_method "pow", `torch.pow(x, 2)` as call_function torch.pow)."""
    return isinstance(node, Node) and (node.op == "call_function" and node.target in functions
                                       or node.op == "call_method" and node.target == method)


def _is_power(node: Node, exponent: float) -> bool:
    """v ** exponent, torch.pow(v, exponent) or v.pow(exponent) of a tensor v."""
    return (dynamo_call(node, (operator.pow, torch.pow), "pow") and len(node.args) == 2 and not node.kwargs
            and node.args[1] == exponent and isinstance(node.args[1], (int, float))
            and isinstance(_example(node.args[0]), torch.Tensor))


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _sum_over_count(node: Node) -> Optional[tuple]:
    """(x, dims, keepdim) of `x.sum(dims, keepdim) / n` in float32, n the count summed."""
    if not (dynamo_call(node, (operator.truediv, torch.div), "div") and len(node.args) == 2 and not node.kwargs):
        return None
    total, count = node.args
    if not (dynamo_call(total, (torch.sum,), "sum") and len(total.users) == 1 and isinstance(count, (int, float))):
        return None
    summed, rest, kwargs = total.args[0], list(total.args[1:]), dict(total.kwargs)
    dims = kwargs.pop("dim", rest.pop(0) if rest else None)
    keepdim = kwargs.pop("keepdim", rest.pop(0) if rest else False)
    x, out = _example(summed), _example(total)
    if (rest or kwargs or dims is None or not isinstance(keepdim, bool) or not isinstance(x, torch.Tensor)
            or not isinstance(out, torch.Tensor) or x.dtype != torch.float32 or out.dtype != torch.float32):
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims or not all(isinstance(d, int) and -x.dim() <= d < x.dim() for d in dims):
        return None
    sizes = [x.shape[d] for d in dims]
    if not all(isinstance(size, int) for size in sizes) or math.prod(sizes) != count:
        return None
    return summed, dims, keepdim


def squares_as_powers(gm: torch.fx.GraphModule) -> int:
    """x * x -> x ** 2 in a dynamo graph about to be differentiated; returns how many.

    The forward is the same value either way (pow(x, 2) computes x * x), and the forward
    patterns take both spellings (spellings.py). The backward is not spelled alike: autograd
    differentiates a product of x with itself as two products summed, g * x + g * x, and a
    square as g * (2 * x). That is the same value too (doubling is exact), but the joint forms
    are traced from squares (a mean of squares in every RMSNorm form), so a model writing
    x * x (litgpt's RMSNorm) left its norm unfused in training. Rewritten here, before
    aot_autograd traces the joint graph, its backward is the square's."""
    changed = 0
    for node in gm.graph.nodes:
        is_square = (dynamo_call(node, DYNAMO_PRODUCTS, "mul") and len(node.args) == 2 and not node.kwargs
                     and node.args[0] is node.args[1]
                     or dynamo_call(node, (torch.square,), "square") and len(node.args) == 1 and not node.kwargs)
        if not (is_square and isinstance(node.args[0], Node)
                and isinstance(node.args[0].meta.get("example_value"), torch.Tensor)):
            continue
        node.op, node.target, node.args = "call_function", torch.pow, (node.args[0], 2)
        changed += 1
    if changed:
        gm.recompile()
    return changed


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
        _copy_before(graph, clone, view)
        moved += 1
    return moved


def _copy_before(graph: torch.fx.Graph, copy: Node, op: Node, meta: Optional[dict] = None) -> None:
    """Rewrite copy = clone(op(x), contiguous) as op(clone(x, contiguous)), for an op whose
    result is laid out as its input (a view, a dtype cast): the same values, and op's result
    is then the contiguous layout the old copy had. The new copy's meta is `meta` (if given),
    with x's value copied contiguous."""
    source = op.args[0]
    with graph.inserting_before(op):
        moved = graph.call_function(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
    if meta is not None:
        moved.meta = meta
    value = source.meta.get("val") if isinstance(source, Node) else None
    if isinstance(value, torch.Tensor):
        moved.meta["val"] = value.clone(memory_format=torch.contiguous_format)
    op.args = (moved, *op.args[1:])
    if "val" in copy.meta:
        op.meta["val"] = copy.meta["val"]
    copy.replace_all_uses_with(op)
    graph.erase_node(copy)


def gradient_copies_apart(graph: torch.fx.Graph) -> int:
    """In a joint graph's backward, a gradient's layout copy stands apart from what reads it:
    - a reshape that had to copy, `_unsafe_view(clone(g, contiguous))`, as the copy and a
      plain `view` of it;
    - a dtype cast the copy follows, `clone(cast(g), contiguous)`, as `cast(clone(g,
      contiguous))` (a cast keeps its input's layout: both are contiguous, the same values).

    A joint pattern's incoming gradient is a contiguous tangent, and where its trace reshapes
    it (aten.matmul's backward flattening the batch dims) the reshape is a plain view of it,
    possibly after a cast (an upcast form's `.to()`). In a model the same gradient may arrive
    in any layout (a permute of an einsum's gradient: torchtitan-npu's attention output
    goes through transpose and einsum), and then the reshape copies it first: clone +
    _unsafe_view. `_unsafe_view` is `view` for an aot graph (it only tells autograd that
    the result is no alias), so spelled this way the copy is a value of its own, contiguous
    as the trace's tangent, and the pattern's tangent binds to it: the copy, and any layout
    change above it, stay outside the match. The trace gets the same rewrite, so a copy
    inside a pattern is spelled alike on both sides. Forward nodes are left as they are
    (the forward forms, traced without this, match them there too). Returns the number of
    nodes rewritten."""
    changed = 0
    for view in graph.find_nodes(op="call_function", target=aten._unsafe_view.default):
        if not is_backward(view):
            continue
        copy = view.args[0]
        if (is_call(copy, aten.clone.default) and len(copy.users) == 1
                and copy.kwargs.get("memory_format") == torch.contiguous_format):
            view.target = aten.view.default
            changed += 1
    for copy in graph.find_nodes(op="call_function", target=aten.clone.default):
        if not (is_backward(copy) and copy.kwargs.get("memory_format") == torch.contiguous_format):
            continue
        cast = copy.args[0]
        if not (isinstance(cast, Node) and _layout_keeping_cast(cast) and len(cast.users) == 1
                and is_backward(cast) and isinstance(cast.args[0], Node)):
            continue
        _copy_before(graph, copy, cast, meta=dict(copy.meta))
        changed += 1
    return changed


def _layout_keeping_cast(node: Node) -> bool:
    """A dtype cast whose result has its input's layout: aten._to_copy with a dtype (and
    layout / device) only, prims.convert_element_type, torch_npu's _npu_dtype_cast(_backward)."""
    if is_call(node, aten._to_copy.default):
        return "dtype" in node.kwargs and set(node.kwargs) <= {"dtype", "layout", "device"}
    if is_call(node, torch.ops.prims.convert_element_type.default):
        return True
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith("_npu_dtype_cast")


# ---- gradient accumulation ----------------------------------------------------------------
def canonicalize_grad_accumulation(graph: torch.fx.Graph, relaid: Optional[list] = None) -> int:
    """Re-fold every chain of gradient-accumulating adds in one canonical order.

    Autograd sums the gradient of a tensor with several users as a left fold
    add(add(g_1, g_2), g_3), in the order the contributions arrive. A pattern traced alone
    sees only its own users of the tensor, so where the model has another one (the
    residual stream of every transformer block, in fp32 where no cast isolates the norm's
    input) the pattern's own add(g_a, g_b) does not exist in the graph, and a search
    function that runs its ops in another order than the model (rotate_half slicing x2
    before x1) sums in another order. Both the joint graph and every joint pattern trace
    are re-folded over their leaves sorted by a key that depends on the graph's structure
    only (_leaf_key): the leaves of related consumers (one computes, within a few ops, what
    the other reads: RMSNorm's square and product) summed first, as a left fold, and those
    sums as a left fold (_related_groups), so that another consumer's gradient that autograd
    met in between (`o + norm(h)`, an auxiliary loss) does not split a pattern's own sum.
    Only the rounding of those sums changes, and,
    where the leaves differ in layout, the sum's: an elementwise add lays its result out
    after its first operand that orders the dims (olmo-core's RoPE: the gradient through
    a transpose, then rotate_half's contiguous one). Each new add gets the fake value of
    its own operands; a chain whose sum's layout changed is appended to `relaid` (the
    views after it were traced for the old layout). Returns the number of chains re-folded.
    """
    changed = 0
    order = _forward_order(graph)
    by_seq: dict = {}  # seq_nr -> the forward nodes with it (backward nodes carry their forward's)
    for n in graph.nodes:
        if n.op == "call_function" and not is_backward(n) and n.meta.get("seq_nr") is not None:
            by_seq.setdefault(n.meta["seq_nr"], []).append(n)
    sums: dict = {}  # the fake value of an add of two static layouts, per pair (_sum_value)
    for root in list(reversed(graph.find_nodes(op="call_function", target=aten.add.Tensor))):
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
        consumers = {leaf: _consumer_of(leaf, accumulated, by_seq) for leaf in leaves}
        keys = {leaf: _leaf_key(leaf, consumers[leaf], order) for leaf in leaves}
        ordered = sorted(leaves, key=keys.__getitem__)
        # (two leaves sum as one pair however they group)
        tree = _canonical_tree(_related_groups(ordered, consumers) if len(leaves) > 2 else [ordered])
        if _tree_of(root, inner) == tree:
            continue
        # the partial sums the re-fold replaces; where they, the leaves and the sum all have one
        # static layout, every new partial sum has it too (an add lays its result out from its
        # operands' layouts alone), and takes one of theirs rather than a fake add's
        partial = [n.meta["val"] for n in inner if n is not root]
        layout = _static_layout(root.meta["val"])
        same = (layout is not None and len(partial) == len(leaves) - 2
                and all(_static_layout(v) == layout for v in (*(leaf.meta["val"] for leaf in leaves), *partial)))
        spare = iter(partial)

        def build(subtree):
            if not isinstance(subtree, tuple):
                return subtree
            left, right = build(subtree[0]), build(subtree[1])
            node = graph.call_function(aten.add.Tensor, (left, right))
            node.meta = dict(root.meta, val=next(spare) if same else _sum_value(left, right, sums))
            return node

        with graph.inserting_before(root):
            left, right = build(tree[0]), build(tree[1])
        before = root.meta["val"]
        root.args = (left, right)
        if not same:
            root.meta["val"] = _sum_value(left, right, sums)
        if relaid is not None and not same_layout(before, root.meta["val"]):
            relaid.append(root)
        for n in inner:
            if n is not root and not n.users:
                graph.erase_node(n)
        changed += 1
    return changed


def _sum_value(a: Node, b: Node, sums: dict) -> torch.Tensor:
    """The value of add(a, b) from the operands' (fake) values: its layout follows theirs,
    in their order. For static layouts it is a function of the two alone, and every layer's
    sums have the same ones: a fresh fake value of the layout an earlier pair gave
    (`sums`: {(layout a, layout b): value}) saves a fake dispatch (~0.2 ms)."""
    x, y = a.meta["val"], b.meta["val"]
    key = (_static_layout(x), _static_layout(y))
    if None in key or not isinstance(x, FakeTensor):
        return aten.add.Tensor(x, y)
    if key not in sums:
        sums[key] = aten.add.Tensor(x, y)
    return fake_copy(sums[key], x.fake_mode)


def _static_layout(value: torch.Tensor) -> Optional[tuple]:
    """(shape, strides, offset, dtype, device) of a tensor whose sizes are all plain ints;
    None where one is symbolic."""
    sizes = (*value.shape, *value.stride(), value.storage_offset())
    if not all(type(size) is int for size in sizes):
        return None
    return tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype, value.device


def _plain_add(node: Any) -> bool:
    """A backward add.Tensor of two same-shape, same-dtype tensors, without alpha."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.add.Tensor
            and not node.kwargs and is_backward(node) and len(node.args) == 2):
        return False
    vals = [a.meta.get("val") if isinstance(a, Node) else None for a in node.args]
    out = node.meta.get("val")
    return all(isinstance(v, torch.Tensor) for v in (*vals, out)) and all(
        same_shape(v, out) and v.dtype == out.dtype for v in vals)


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Provably the same shape (nodes.known_equal). `a.shape == b.shape` guards on symbolic
    sizes, and raises on data-dependent ones (the rows an expert-parallel all-to-all
    received: GuardOnDataDependentSymNode, docs/expert-parallel.md)."""
    if a.dim() != b.dim():
        return False
    shape_a, shape_b = tuple(a.shape), tuple(b.shape)
    if all(type(size) is int for size in (*shape_a, *shape_b)):
        return shape_a == shape_b  # (static sizes: what the symbolic tests below answer)
    return (statically_known_true(sym_eq(shape_a, shape_b))
            or all(known_equal(x, y) for x, y in zip(shape_a, shape_b)))


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


def _tree_of(root: Node, inner: list[Node]) -> Any:
    """The add tree under root as nested pairs of its leaves."""
    if root not in inner:
        return root
    return (_tree_of(root.args[0], inner), _tree_of(root.args[1], inner))


def _canonical_tree(groups: list[list[Node]]) -> Any:
    """Each group's leaves summed as a left fold, then the groups' sums as a left fold."""
    def left_fold(items):
        acc = items[0]
        for item in items[1:]:
            acc = (acc, item)
        return acc

    return left_fold([left_fold(group) for group in groups])


_RELATED_WITHIN = 12  # forward nodes searched below a consumer: one op's decomposition spans a handful


def _related_groups(ordered: list[Node], consumer_of: dict) -> list[list[Node]]:
    """The leaves (in canonical order) grouped by their forward consumers: two leaves are in
    one group where one's consumer computes, within a few ops, what the other's consumer
    reads (RMSNorm's `x.pow(2)` and `x * rsqrt(...)`). A pattern traced alone sums its own
    consumers' gradients first; in the model another consumer of the same tensor (a sibling
    projection, an auxiliary loss) may come between them in the order, however the model
    orders its operands (`o + norm(h)` or `norm(h) + o`). Summing each group on its own keeps
    the pattern's sum a subtree of the model's. Where no leaves are related this is the left
    fold of `ordered`. `consumer_of`: each leaf's (_consumer_of)."""
    consumers = [consumer_of[leaf] for leaf in ordered]
    group_of = list(range(len(ordered)))

    def root_of(i):
        while group_of[i] != i:
            i = group_of[i]
        return i

    for i, consumer in enumerate(consumers):
        if consumer is None:
            continue
        below = _forward_descendants(consumer, _RELATED_WITHIN)
        for j, other in enumerate(consumers):
            if j != i and other is not None and other in below:
                group_of[max(root_of(i), root_of(j))] = min(root_of(i), root_of(j))
    groups: dict = {}
    for i, leaf in enumerate(ordered):
        groups.setdefault(root_of(i), []).append(leaf)
    return list(groups.values())  # in the order of each group's first leaf


def _forward_descendants(node: Node, limit: int) -> set:
    """Up to `limit` forward nodes computed from node, nearest first."""
    found, frontier = set(), [node]
    while frontier and len(found) < limit:
        current = frontier.pop(0)
        for user in current.users:
            if user not in found and not is_backward(user) and user.op == "call_function":
                found.add(user)
                frontier.append(user)
    return found


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
            and out is not None and same_shape(a.meta["val"], out)]
    return max(fits, key=lambda a: counts[a]) if fits else None


def _consumer_of(leaf: Node, accumulated: Node, by_seq: dict) -> Optional[Node]:
    """The forward op reading `accumulated` that the gradient `leaf` was made for (backward
    nodes carry their forward op's seq_nr), or None (tangents, pass-through gradients)."""
    return next((n for n in by_seq.get(leaf.meta.get("seq_nr"), ()) if accumulated in n.all_input_nodes), None)


def _leaf_key(leaf: Node, consumer: Optional[Node], order: dict) -> tuple:
    """(structural position of the forward consumer this leaf is the gradient for, seq_nr).

    Leaves whose consumer cannot be told (tangents, pass-through gradients) go last.
    """
    seq = leaf.meta.get("seq_nr")
    return (order.get(consumer, float("inf")), float("inf") if seq is None else seq)


