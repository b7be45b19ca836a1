"""What a region of contractions, reductions and elementwise ops computes, whatever its layouts.

Attention, an indexer's scores, the head mean of attention probabilities: each is a few
contractions (einsums) of a few tensors, with elementwise maps and reductions around them.
Model code spells one contraction in many layouts: `matmul` of BNSD tensors, `bmm` of
(B*N, S, D) views, `einsum("bshd,bthd->bsht")` (which aot_autograd decomposes into
unsqueezes, permutes, clones, views and a bmm), k repeated for grouped queries by
expand + reshape or repeat_interleave, the scale on q, on k, on the product or as
baddbmm's alpha. This module evaluates such a region into an expression per node over
index variables (atoms), so that a pattern reads what is contracted with what over which
index, and which index of which input is which dim of the output, whatever the layout.

An atom is an index variable with a size (an int or a SymInt). Each dim of a node's value
is a tuple of atoms, major to minor (a merged (B*N) dim is (b, n)); a dim of size 1 is ().
Layout ops move atoms between dims and leave the expression alone: permute, transpose,
unsqueeze, squeeze, views and reshapes that regroup atoms, expand (a fresh atom the value
does not depend on), repeat (a fresh atom in front: the copies are tiled), clone,
contiguous. Ops that combine operands (elementwise arithmetic with broadcasting, matmul,
bmm, baddbmm) give their output fresh atoms at the common refinement of the operands' dims
and substitute them into each operand's expression, so `x + x.transpose(0, 1)` reads x at
(i, j) and at (j, i), never on a diagonal; a contraction is `Expr("sum", atoms=...)` of a
product. softmax / log_softmax / amax / sum / mean are reductions over atoms. What the
algebra does not model is a leaf, read as it is: an op it does not know (cat, gather, a
matmul with a weight that is a projection's), a non-float node, a view that would split an
atom (a projection's (B*S, N*D) output viewed as (B, S, N, D): the view is the leaf).

Every expression records the node that computed it and that node's dims in the
expression's atoms, so a pattern can take any sub-expression as an input of its fused call
and `rearrange` it into the layout the op takes. Nothing here names an op family.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

# one exception for both algebras: a region whose value they cannot describe
from .channel_algebra import NotEvaluable
from .nodes import is_call, is_cast, known_equal, tensor_meta

Node = torch.fx.Node
aten = torch.ops.aten

# a pattern's region is evaluated within this many nodes: past it, nodes are leaves
MAX_REGION = 400


# ---- atoms and expressions ----------------------------------------------------------------------
_ids = itertools.count()


class Atom:
    """An index variable of `size` (an int or a SymInt); identity is the object."""

    __slots__ = ("size", "id")

    def __init__(self, size: Any):
        self.size = size
        self.id = next(_ids)

    def __repr__(self) -> str:
        return f"a{self.id}:{self.size}"


Dims = tuple  # tuple[tuple[Atom, ...], ...]: per dim, its atoms, major to minor


def atoms_of(dims: Dims) -> tuple:
    return tuple(a for dim in dims for a in dim)


@dataclass(eq=False)
class Expr:
    """op: "leaf", "const", "cast" (value: the dtype), an elementwise op ("add", "sub", "mul",
    "div", "neg", "exp", "log", "tanh", "relu", "sigmoid", "rsqrt", "sqrt", "where"), "sum" and
    "mean" (over `atoms`, bound), "amax" and "logsumexp" (over `atoms`, bound), "softmax",
    "safe_softmax", "log_softmax" (normalised over `atoms`, which stay free).

    node / dims: the node that computed it and that node's dims in this expression's atoms
    (for "const", node is None)."""

    op: str
    args: tuple = ()
    node: Optional[Node] = None
    dims: Dims = ()
    atoms: tuple = ()
    value: Any = None
    dtype: Optional[torch.dtype] = None
    _free: Optional[frozenset] = field(default=None, repr=False)

    @property
    def free(self) -> frozenset:
        """The atoms the value depends on."""
        if self._free is None:
            if self.op == "leaf":
                found = frozenset(atoms_of(self.dims))
            else:
                found = frozenset().union(*(a.free for a in self.args))
                if self.op in _BINDING:
                    found -= set(self.atoms)
            self._free = found
        return self._free

    def leaves(self) -> list["Expr"]:
        out, stack = [], [self]
        while stack:
            e = stack.pop()
            if e.op == "leaf":
                out.append(e)
            stack.extend(e.args)
        return out

    def contains(self, *ops: str) -> bool:
        stack = [self]
        while stack:
            e = stack.pop()
            if e.op in ops:
                return True
            stack.extend(e.args)
        return False

    def subst(self, mapping: dict) -> "Expr":
        """The expression with each atom a of `mapping` replaced by the atoms mapping[a]."""
        memo: dict = {}

        def go(e: Expr) -> Expr:
            found = memo.get(id(e))
            if found is None:
                found = memo[id(e)] = Expr(e.op, tuple(go(a) for a in e.args), e.node, _mapped_dims(e.dims, mapping),
                                           _mapped(e.atoms, mapping), e.value, e.dtype)
            return found

        return go(self)

    def __repr__(self) -> str:
        if self.op == "leaf":
            return f"{self.node.name}{list(self.dims)}"
        if self.op == "const":
            return repr(self.value)
        inner = ", ".join(map(repr, self.args))
        over = f"[{', '.join(map(repr, self.atoms))}]" if self.atoms else ""
        value = f"<{self.value}>" if self.op == "cast" else ""
        return f"{self.op}{over}{value}({inner})"


_BINDING = frozenset({"sum", "mean", "amax", "logsumexp"})


def _mapped(atoms: tuple, mapping: dict) -> tuple:
    return tuple(b for a in atoms for b in mapping.get(a, (a,)))


def _mapped_dims(dims: Dims, mapping: dict) -> Dims:
    return tuple(_mapped(dim, mapping) for dim in dims)


def const(value: Any) -> Expr:
    return Expr("const", value=value)


@dataclass
class Value:
    """A node's value: its expression and its dims (in the expression's atoms)."""

    expr: Expr
    dims: Dims
    dtype: torch.dtype


# ---- sizes ------------------------------------------------------------------------------------------
def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return known_equal(a, b)


def _divides(a: Any, b: Any) -> bool:
    """a divides b (a != b), provably."""
    if isinstance(a, int) and isinstance(b, int):
        return a != b and a > 0 and b % a == 0
    try:
        return statically_known_true(b % a == 0) and not _equal(a, b)
    except Exception:  # noqa: BLE001 - a size sympy cannot reduce: not provably
        return False


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1 or (not isinstance(size, int) and statically_known_true(size == 1))


def _product(sizes: Iterable[Any]) -> Any:
    out: Any = 1
    for s in sizes:
        out = out * s
    return out


def _refine(groups: Sequence[tuple]) -> tuple[tuple, list[dict]]:
    """The common refinement of several atom tuples of one total size: fresh atoms (major to
    minor) and, per group, {its atom: the fresh atoms it covers}. Raises NotEvaluable when the
    sizes do not nest (a dim of 6 read as 2 x 3 by one operand and as 3 x 2 by another)."""
    groups = [g for g in groups if g]
    if not groups:
        return (), []
    out = [Atom(a.size) for a in groups[0]]
    maps = [{a: (b,) for a, b in zip(groups[0], out)}]
    for group in groups[1:]:
        out, old_to_new, group_map = _refine_pair(out, group)
        maps = [{a: tuple(n for b in bs for n in old_to_new[b]) for a, bs in m.items()} for m in maps]
        maps.append(group_map)
    return tuple(out), maps


def _refine_pair(xs: Sequence[Atom], ys: Sequence[Atom]) -> tuple[list, dict, dict]:
    # walk both from the minor end
    x_left, y_left = list(xs), list(ys)
    x_map: dict = {a: [] for a in xs}
    y_map: dict = {a: [] for a in ys}
    out: list = []
    x, y = x_left.pop(), y_left.pop()
    x_rest, y_rest = x.size, y.size
    while True:
        if _equal(x_rest, y_rest):
            size, done_x, done_y = x_rest, True, True
        elif _divides(x_rest, y_rest):
            size, done_x, done_y = x_rest, True, False
        elif _divides(y_rest, x_rest):
            size, done_x, done_y = y_rest, False, True
        else:
            raise NotEvaluable(f"dims of sizes {[a.size for a in xs]} and {[a.size for a in ys]} do not nest")
        atom = Atom(size)
        out.append(atom)
        x_map[x].append(atom)
        y_map[y].append(atom)
        if done_x and done_y:
            if not x_left and not y_left:
                break
            if not x_left or not y_left:
                raise NotEvaluable("dims of different sizes")
            x, y = x_left.pop(), y_left.pop()
            x_rest, y_rest = x.size, y.size
        elif done_x:
            if not x_left:
                raise NotEvaluable("dims of different sizes")
            y_rest = y_rest // size
            x = x_left.pop()
            x_rest = x.size
        else:
            if not y_left:
                raise NotEvaluable("dims of different sizes")
            x_rest = x_rest // size
            y = y_left.pop()
            y_rest = y.size
    out.reverse()
    return out, {a: tuple(reversed(b)) for a, b in x_map.items()}, {a: tuple(reversed(b)) for a, b in y_map.items()}


# ---- evaluation ---------------------------------------------------------------------------------------
_LAYOUT = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
                     aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                     aten.squeeze.default, aten.expand.default, aten.clone.default, aten.contiguous.default,
                     aten.alias.default, aten.lift_fresh_copy.default, aten.slice.Tensor, aten.repeat.default,
                     aten.detach.default})
_UNARY = {aten.neg.default: "neg", aten.exp.default: "exp", aten.log.default: "log", aten.tanh.default: "tanh",
          aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.rsqrt.default: "rsqrt",
          aten.sqrt.default: "sqrt"}
_BINARY = {aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
           aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div"}
_NORMALISE = {aten._softmax.default: "softmax", aten._safe_softmax.default: "safe_softmax",
              aten._log_softmax.default: "log_softmax"}
_REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax",
           aten.logsumexp.default: "logsumexp"}
_MATMUL = frozenset({aten.matmul.default, aten.bmm.default, aten.mm.default, aten.baddbmm.default})


def modelled(node: Node) -> bool:
    """Whether the algebra evaluates `node` (else it is a leaf)."""
    if node.op != "call_function":
        return False
    value = tensor_meta(node)
    if value is None or not value.is_floating_point():
        return False
    t = node.target
    return (t in _LAYOUT or t in _UNARY or t in _BINARY or t in _NORMALISE or t in _REDUCE or t in _MATMUL
            or t in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor) or is_cast(node))


class AxisEvaluation:
    """Node values over atoms, evaluated on demand and kept (one per graph and pass run).

    `stop`: nodes to read as leaves whatever they are (a pattern's known inputs)."""

    def __init__(self, max_nodes: int = MAX_REGION, stop: Iterable[Node] = ()):
        self.values: dict[Node, Value] = {}
        self.max_nodes = max_nodes
        self.stop = set(stop)
        self.evaluated = 0

    def value(self, node: Node) -> Value:
        found = self.values.get(node)
        if found is not None:
            return found
        # evaluate the inputs first, without recursion (regions are chains hundreds of nodes deep)
        pending = [node]
        while pending:
            current = pending[-1]
            if current in self.values:
                pending.pop()
                continue
            if self._is_leaf(current):
                self.values[current] = self._leaf(current)
                pending.pop()
                continue
            # (size arguments are SymInt nodes, not values the algebra reads)
            missing = [a for a in current.all_input_nodes if a not in self.values and tensor_meta(a) is not None]
            if missing:
                pending.extend(missing)
                continue
            pending.pop()
            self.evaluated += 1
            try:
                self.values[current] = self._evaluate(current)
            except NotEvaluable:
                self.values[current] = self._leaf(current)
        return self.values[node]

    def _is_leaf(self, node: Node) -> bool:
        return node in self.stop or not modelled(node) or self.evaluated >= self.max_nodes

    def _leaf(self, node: Node) -> Value:
        meta = tensor_meta(node)
        if meta is None:
            raise NotEvaluable(f"{node.name} carries no tensor metadata")
        dims = tuple(() if _is_one(size) else (Atom(size),) for size in meta.shape)
        return Value(Expr("leaf", node=node, dims=dims, dtype=meta.dtype), dims, meta.dtype)

    # -- one node ----------------------------------------------------------------------------------------
    def _evaluate(self, node: Node) -> Value:
        t = node.target
        meta = tensor_meta(node)
        if t in _LAYOUT:
            return self._layout(node, self.value(node.args[0]))
        if is_cast(node):
            x = self.value(node.args[0])
            if x.dtype == meta.dtype:
                return Value(x.expr, x.dims, meta.dtype)
            return Value(_derived("cast", (x.expr,), node, x.dims, meta.dtype, value=meta.dtype), x.dims, meta.dtype)
        if t in _UNARY:
            x = self.value(node.args[0])
            return Value(_derived(_UNARY[t], (x.expr,), node, x.dims, meta.dtype), x.dims, meta.dtype)
        if t in _BINARY:
            return self._binary(node, _BINARY[t])
        if t in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            return self._where(node)
        if t in _NORMALISE:
            x = self.value(node.args[0])
            dim = node.args[1] % max(len(x.dims), 1)
            if not x.dims[dim]:
                raise NotEvaluable(f"{node.name} normalises over a dim of size 1")
            expr = _derived(_NORMALISE[t], (x.expr,), node, x.dims, meta.dtype, atoms=x.dims[dim])
            return Value(expr, x.dims, meta.dtype)
        if t in _REDUCE:
            return self._reduce(node, _REDUCE[t])
        if t in _MATMUL:
            return self._matmul(node)
        raise NotEvaluable(f"{node.target} is not modelled")

    def _operand(self, arg: Any) -> tuple[Optional[Value], Any]:
        """(value, None) of a tensor operand; (None, number) of a constant: a Python number,
        or a 0-d tensor the graph computes from no input (scalar_tensor, full([]), ...)."""
        if isinstance(arg, Node):
            meta = tensor_meta(arg)
            if meta is not None and meta.dim() == 0 and arg.op == "call_function" and not modelled(arg):
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                from .constants import evaluate_constant

                with unset_fake_temporarily():  # a real tensor, read inside the compile's fake mode
                    value = evaluate_constant(arg)
                    if value is not None:
                        return None, value.item()
            return self.value(arg), None
        if isinstance(arg, (int, float, bool)):
            return None, arg
        raise NotEvaluable(f"an operand {arg!r}")

    def _binary(self, node: Node, op: str) -> Value:
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if op == "div" and node.kwargs.get("rounding_mode") is not None:
            raise NotEvaluable("a rounding division")
        (va, a), (vb, b) = self._operand(a), self._operand(b)
        operands = [va, vb]
        exprs = []
        if alpha != 1:
            if vb is None:
                b = b * alpha
            else:
                operands[1] = Value(_derived("mul", (vb.expr, const(alpha)), None, vb.dims, vb.dtype), vb.dims,
                                    vb.dtype)
        dims, maps = self._broadcast(node, [v for v in operands if v is not None])
        it = iter(maps)
        for raw, v in zip((a, b), operands):
            exprs.append(const(raw) if v is None else v.expr.subst(next(it)))
        meta = tensor_meta(node)
        return Value(_derived(op, tuple(exprs), node, dims, meta.dtype), dims, meta.dtype)

    def _where(self, node: Node) -> Value:
        if is_call(node, aten.where.self):
            cond, a, b = node.args[:3]
        else:  # masked_fill(x, mask, value) = where(mask, value, x)
            b, cond, a = node.args[:3]
        read = [self._operand(x) for x in (cond, a, b)]
        operands = [v for v, _ in read]
        dims, maps = self._broadcast(node, [v for v in operands if v is not None])
        it = iter(maps)
        exprs = tuple(const(_number(raw)) if v is None else v.expr.subst(next(it)) for v, raw in read)
        meta = tensor_meta(node)
        return Value(_derived("where", exprs, node, dims, meta.dtype), dims, meta.dtype)

    def _broadcast(self, node: Node, operands: Sequence[Value]) -> tuple[Dims, list[dict]]:
        shape = tensor_meta(node).shape
        rank = len(shape)
        per_dim = []
        maps: list[dict] = [dict() for _ in operands]
        for position in range(rank):
            groups = []
            owners = []
            for i, v in enumerate(operands):
                offset = rank - len(v.dims)
                if position >= offset and v.dims[position - offset]:
                    groups.append(v.dims[position - offset])
                    owners.append(i)
            if not groups:
                if not _is_one(shape[position]):
                    raise NotEvaluable(f"{node.name} broadcasts to a size its operands do not have")
                per_dim.append(())
                continue
            out, group_maps = _refine(groups)
            for owner, m in zip(owners, group_maps):
                maps[owner].update(m)
            per_dim.append(out)
        return tuple(per_dim), maps

    def _reduce(self, node: Node, op: str) -> Value:
        x = self.value(node.args[0])
        rank = len(x.dims)
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None:
            raise NotEvaluable("a reduction over every dim")
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not dims:
            raise NotEvaluable("a reduction over every dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = sorted({d % rank for d in dims})
        reduced = tuple(a for d in dims for a in x.dims[d])
        out = tuple(() if i in dims else dim for i, dim in enumerate(x.dims) if keepdim or i not in dims)
        meta = tensor_meta(node)
        # a mean keeps its count (value): the sum divided by the number of summed elements
        count = _product(tensor_meta(node.args[0]).shape[d] for d in dims) if op == "mean" else None
        return Value(_derived(op, (x.expr,), node, out, meta.dtype, atoms=reduced, value=count), out, meta.dtype)

    def _matmul(self, node: Node) -> Value:
        meta = tensor_meta(node)
        if is_call(node, aten.baddbmm.default):
            base, a, b = node.args[:3]
            beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
            alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        else:
            base, (a, b), beta, alpha = None, node.args[:2], 0, 1
        va, vb = self.value(a), self.value(b)
        if len(va.dims) < 2 or len(vb.dims) < 2:
            raise NotEvaluable("a matrix-vector product")
        rank = len(meta.shape)
        batch_a, batch_b = va.dims[:-2], vb.dims[:-2]
        dims: list = []
        map_a, map_b = {}, {}
        for position in range(rank - 2):
            groups, owners = [], []
            for owner, batch in ((0, batch_a), (1, batch_b)):
                offset = rank - 2 - len(batch)
                if position >= offset and batch[position - offset]:
                    groups.append(batch[position - offset])
                    owners.append(owner)
            out, group_maps = _refine(groups)
            for owner, m in zip(owners, group_maps):
                (map_a if owner == 0 else map_b).update(m)
            dims.append(out)
        contracted, (ca, cb) = _refine([va.dims[-1], vb.dims[-2]]) if va.dims[-1] and vb.dims[-2] else ((), ({}, {}))
        if bool(va.dims[-1]) != bool(vb.dims[-2]):
            raise NotEvaluable("a contraction over a broadcast dim")
        map_a.update(ca)
        map_b.update(cb)
        rows = tuple(Atom(x.size) for x in va.dims[-2])
        cols = tuple(Atom(x.size) for x in vb.dims[-1])
        map_a.update({x: (y,) for x, y in zip(va.dims[-2], rows)})
        map_b.update({x: (y,) for x, y in zip(vb.dims[-1], cols)})
        dims += [rows, cols]
        dims = tuple(dims)
        product = _derived("mul", (va.expr.subst(map_a), vb.expr.subst(map_b)), None, dims, meta.dtype)
        expr = Expr("sum", (product,), None if base is not None or alpha != 1 else node, dims, contracted,
                    dtype=meta.dtype)
        if alpha != 1:
            expr = _derived("mul", (expr, const(alpha)), None if base is not None else node, dims, meta.dtype)
        if base is not None and beta != 0:
            vbase = self.value(base)
            out_dims, (m_base, m_out) = self._broadcast(node, [vbase, Value(expr, dims, meta.dtype)])
            scaled = vbase.expr.subst(m_base)
            if beta != 1:
                scaled = _derived("mul", (scaled, const(beta)), None, out_dims, meta.dtype)
            return Value(_derived("add", (scaled, expr.subst(m_out)), node, out_dims, meta.dtype), out_dims,
                         meta.dtype)
        if base is not None:  # beta = 0: torch ignores the input (its nan and inf too)
            expr = Expr(expr.op, expr.args, node, expr.dims, expr.atoms, expr.value, expr.dtype)
        return Value(expr, dims, meta.dtype)

    # -- layout ops ---------------------------------------------------------------------------------------
    def _layout(self, node: Node, x: Value) -> Value:
        t = node.target
        meta = tensor_meta(node)
        dims = list(x.dims)
        rank = len(dims)
        if t in (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh_copy.default,
                 aten.detach.default):
            return Value(x.expr, x.dims, meta.dtype)
        if t is aten.permute.default:
            order = [d % rank for d in node.args[1]]
            return Value(x.expr, tuple(dims[d] for d in order), meta.dtype)
        if t is aten.transpose.int:
            a, b = node.args[1] % rank, node.args[2] % rank
            dims[a], dims[b] = dims[b], dims[a]
            return Value(x.expr, tuple(dims), meta.dtype)
        if t is aten.t.default:
            return Value(x.expr, tuple(reversed(dims)), meta.dtype)
        if t is aten.unsqueeze.default:
            d = node.args[1] % (rank + 1)
            dims.insert(d, ())
            return Value(x.expr, tuple(dims), meta.dtype)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            wanted = (range(rank) if t is aten.squeeze.default
                      else [node.args[1]] if t is aten.squeeze.dim else node.args[1])
            drop = {d % rank for d in wanted if not dims[d % rank]}
            return Value(x.expr, tuple(dim for i, dim in enumerate(dims) if i not in drop), meta.dtype)
        if t is aten.expand.default:
            sizes = list(node.args[1])
            lead = len(sizes) - rank
            out = [() if _is_one(s) else (Atom(s),) for s in sizes[:lead]]
            for dim, size in zip(dims, sizes[lead:]):
                out.append((Atom(size),) if not dim and not (isinstance(size, int) and size in (1, -1))
                           and not _is_one(size) else dim)
            return Value(x.expr, tuple(out), meta.dtype)
        if t is aten.repeat.default:
            repeats = list(node.args[1])
            lead = len(repeats) - rank
            out = [() if r == 1 else (Atom(r),) for r in repeats[:lead]]
            for dim, r in zip(dims, repeats[lead:]):
                out.append(dim if _is_one(r) else (Atom(r), *dim))
            return Value(x.expr, tuple(out), meta.dtype)
        if t is aten.slice.Tensor:
            d = (node.args[1] if len(node.args) > 1 else 0) % rank
            in_size = tensor_meta(node.args[0]).shape[d]
            if _equal(meta.shape[d], in_size) and (len(node.args) < 5 or node.args[4] == 1):
                return Value(x.expr, x.dims, meta.dtype)
            raise NotEvaluable(f"{node.name} slices a dim")
        # a view: regroup the atoms into the new shape, never splitting one
        return Value(x.expr, _regroup(x.dims, meta.shape, node), meta.dtype)


def _regroup(dims: Dims, shape: Sequence[Any], node: Node) -> Dims:
    atoms = list(atoms_of(dims))
    out = []
    position = 0
    for size in shape:
        if _is_one(size):
            out.append(())
            continue
        group: list = []
        rest = size
        while not _is_one(rest):
            if position == len(atoms):
                raise NotEvaluable(f"{node.name} reshapes to sizes its input's dims do not make")
            atom = atoms[position]
            if _equal(atom.size, rest):
                rest = 1
            elif _divides(atom.size, rest):
                rest = rest // atom.size
            else:
                raise NotEvaluable(f"{node.name} splits a dim of size {atom.size}")
            group.append(atom)
            position += 1
        out.append(tuple(group))
    if position != len(atoms):
        raise NotEvaluable(f"{node.name} reshapes to sizes its input's dims do not make")
    return tuple(out)


def _derived(op: str, args: tuple, node: Optional[Node], dims: Dims, dtype: Any, atoms: tuple = (),
             value: Any = None) -> Expr:
    return Expr(op, args, node, dims, atoms, value, dtype)


def _number(arg: Any) -> Any:
    if isinstance(arg, (int, float, bool)):
        return arg
    raise NotEvaluable(f"an operand {arg!r}")


# ---- reading expressions ----------------------------------------------------------------------------
def strip_casts(expr: Expr, lossless_only: bool = False) -> Expr:
    """The expression under its casts (with lossless_only, only casts that widen a float)."""
    while expr.op == "cast":
        inner = expr.args[0]
        if lossless_only and not _widens(inner.dtype, expr.value):
            break
        expr = inner
    return expr


def _widens(source: Optional[torch.dtype], target: Optional[torch.dtype]) -> bool:
    order = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    if source is None or target is None or source not in order or target not in order:
        return False
    return order[target] > order[source] or source == target


def scale_and_rest(expr: Expr, lossless_casts: bool = True) -> tuple[Any, Expr]:
    """(c, e) with expr = c * e, c a constant collected from multiplications, divisions and
    negations by constants (and the factors of products) through lossless casts."""
    coef: Any = 1.0
    while True:
        expr = strip_casts(expr, lossless_only=lossless_casts)
        if expr.op == "neg":
            coef, expr = -coef, expr.args[0]
            continue
        if expr.op in ("mul", "div") and len(expr.args) == 2:
            a, b = expr.args
            if b.op == "const" and isinstance(b.value, (int, float)):
                coef = coef * b.value if expr.op == "mul" else coef / b.value
                expr = a
                continue
            if expr.op == "mul" and a.op == "const" and isinstance(a.value, (int, float)):
                coef, expr = coef * a.value, b
                continue
        if expr.op == "sum" and len(expr.args) == 1 and expr.args[0].op == "mul":
            factors = [scale_and_rest(f, lossless_casts) for f in expr.args[0].args]
            inner = 1.0
            for c, _ in factors:
                inner *= c
            if inner != 1.0:
                product = Expr("mul", tuple(f for _, f in factors), expr.args[0].node, expr.args[0].dims,
                               dtype=expr.args[0].dtype)
                return coef * inner, Expr("sum", (product,), expr.node, expr.dims, expr.atoms, dtype=expr.dtype)
        return coef, expr


# ---- rearranging a tensor into an op's layout ------------------------------------------------------
def atom_sizes(t: torch.Tensor, dims: Dims) -> dict:
    """{atom: size} of a tensor whose dims are `dims`; a dim's one symbolic atom is its size
    divided by the others' (read from `t`, so traced code uses the tensor's own sizes)."""
    sizes = {}
    for d, group in enumerate(dims):
        static = [a for a in group if isinstance(a.size, int)]
        symbolic = [a for a in group if not isinstance(a.size, int)]
        if len(symbolic) > 1:
            raise NotEvaluable(f"dim {d} holds {len(symbolic)} symbolic atoms")
        for a in static:
            sizes[a] = a.size
        if symbolic:
            sizes[symbolic[0]] = t.shape[d] // math.prod(a.size for a in static) if static else t.shape[d]
    return sizes


def rearrange(t: torch.Tensor, dims: Dims, target: Dims, sizes: dict) -> torch.Tensor:
    """`t`, whose dims are `dims`, as a tensor whose dims are `target` (groups of atoms): its
    atoms permuted into the target's order, atoms it does not have broadcast (expanded, sizes
    from `sizes`), a dim of () of size 1. Every atom of `t` must be in `target`."""
    source = list(atoms_of(dims))
    wanted = list(atoms_of(target))
    missing = [a for a in source if a not in wanted]
    if missing:
        raise ValueError(f"rearrange drops atoms {missing}")
    x = t.reshape([sizes[a] for a in source]) if source else t.reshape(())
    present = [a for a in wanted if a in source]
    order = [source.index(a) for a in present]
    if order != list(range(len(order))):
        x = x.permute(order)
    shape = []
    for a in wanted:
        shape.append(sizes[a] if a in source else 1)
    x = x.reshape(shape) if shape else x
    if any(a not in source for a in wanted):
        x = x.expand([sizes[a] for a in wanted])
    return x.reshape([_product(sizes[a] for a in group) for group in target])


def rearrange_gradient(g: torch.Tensor, dims: Dims, target: Dims, sizes: dict) -> torch.Tensor:
    """The gradient of `t` from the gradient `g` of rearrange(t, dims, target, sizes): the
    adjoint of rearrange. The atoms rearrange broadcast (in `target`, not in `dims`) are summed
    out, and the rest laid out as `dims`."""
    wanted = list(atoms_of(target))
    source = list(atoms_of(dims))
    x = g.reshape([sizes[a] for a in wanted]) if wanted else g.reshape(())
    broadcast = [i for i, a in enumerate(wanted) if a not in source]
    if broadcast:
        x = x.sum(broadcast)
    kept = [a for a in wanted if a in source]
    return rearrange(x, (tuple(kept),) if kept else (), dims, sizes) if kept else x.reshape(
        [_product(sizes[a] for a in group) for group in dims])


def free_atoms_in(dims: Dims, atoms: Iterable[Atom]) -> list[int]:
    """The dims of `dims` that hold any of `atoms`."""
    wanted = set(atoms)
    return [i for i, group in enumerate(dims) if wanted & set(group)]


@dataclass
class MaskUse:
    """A mask applied to scores: "fill" (where(node, fill, scores): hides where node is True),
    "keep" (where(node, scores, fill): hides where it is False) or "add" (scores + node)."""

    kind: str
    node: Node
    dims: Dims  # the node's dims in the scores' atoms
    fill: Any = None


@dataclass
class MaskedScores:
    """An expression read as  masks(scale * sum_D(x * y))  (outermost mask first).

    `scores`: the contraction, its scale taken out (None when what is under the masks is not
    a scaled contraction of two factors: `rest` is then what stands there)."""

    masks: list
    scale: Any
    scores: Optional[Expr]
    rest: Expr

    @property
    def factors(self) -> tuple:
        return self.scores.args[0].args if self.scores is not None else ()


def read_masked_scores(expr: Expr) -> MaskedScores:
    """`expr` as masks applied to a scaled contraction: additive masks (the summand without a
    contraction in it), `where` / `masked_fill` with a constant fill, any casts between them."""
    masks = []
    e = expr
    while True:
        e = strip_casts(e)
        if e.op == "add" and len(e.args) == 2:
            scores, mask = _split_mask(*e.args)
            if mask is not None and mask.node is not None:
                masks.append(MaskUse("add", mask.node, mask.dims))
                e = scores
                continue
        if e.op == "where":
            cond, a, b = e.args
            if cond.node is not None and not cond.contains("sum"):
                if a.op == "const" and b.contains("sum"):
                    masks.append(MaskUse("fill", cond.node, cond.dims, a.value))
                    e = b
                    continue
                if b.op == "const" and a.contains("sum"):
                    masks.append(MaskUse("keep", cond.node, cond.dims, b.value))
                    e = a
                    continue
        break
    scale, core = scale_and_rest(e)
    is_contraction = core.op == "sum" and len(core.args) == 1 and core.args[0].op == "mul" and len(core.args[0].args) == 2
    return MaskedScores(masks, scale, core if is_contraction else None, e)


def _split_mask(a: Expr, b: Expr) -> tuple[Expr, Optional[Expr]]:
    """(scores, mask) of a sum whose one side holds a contraction and the other none."""
    if a.contains("sum") and not b.contains("sum") and b.op != "const":
        return a, b
    if b.contains("sum") and not a.contains("sum") and a.op != "const":
        return b, a
    return a, None
