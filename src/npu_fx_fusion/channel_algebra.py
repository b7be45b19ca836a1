"""What a region of a graph computes over its tensors' last dims, whatever its spelling.

Many fusions are a fixed map of a tensor's trailing "channel" dims: a rotary embedding
multiplies each channel by a table and adds its partner channel times another table, a
gated unit takes the two halves of one tensor. Model code spells the indexing in endless
ways (slices, chunk, split, unbind, pairs from a reshape, stack, flatten, complex numbers,
the backward's slice_backward), so instead of matching one spelling this module evaluates
a region symbolically: every element of a tracked trailing block of every tensor is a
polynomial (of degree <= 2) in the elements of the region's inputs (its leaves), with
numeric coefficients. Index and view ops move elements: they are computed by running the
aten op itself on a tensor of element ids, so their semantics are torch's own. Arithmetic
(add, sub, neg, mul, division by a constant) combines the polynomials elementwise, with
broadcasting. A pattern then reads off, per output channel, which leaf elements it is made
of and with which signs (`ChannelValue.channels`), and decides whether that is its op.

Leading dims (batch, heads, sequence) are not tracked: a region's ops may not move
elements between them (views must keep the leading dims, index ops act on tracked dims),
so an element's polynomial holds at every leading position, with each leaf broadcast the
way the region broadcasts it. Tracked dims are static sizes (a head dim is, under dynamic
shapes too); a region over a symbolic trailing size is not evaluated.

This module names no op family: which regions to evaluate and what their maps mean is
the patterns' business.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx

from .nodes import SHAPE_ONLY_OPS, is_call, known_equal, tensor_meta

Node = torch.fx.Node
aten = torch.ops.aten
prims = torch.ops.prims

# a region's tracked block may hold at most this many elements (a head dim, or a head dim
# split in pairs): beyond that the symbolic evaluation would cost more than it can save
MAX_TRACKED = 4096
# a region grows to at most this many nodes
MAX_REGION = 256
# polynomials of higher degree than this are not evaluated: the maps the passes read are
# linear in one input, times at most one table element
MAX_DEGREE = 2


class NotEvaluable(Exception):
    """The region does something this algebra does not model (the reason says what)."""


class _DegreeOverflow(NotEvaluable):
    """A product of more than MAX_DEGREE inputs."""


class _Stop(Exception):
    """A node acts on leading dims, or its value is a product the region takes as a whole:
    the region ends there (the node is one of its leaves)."""

    def __init__(self, node: Node, why: str):
        super().__init__(why)
        self.node = node


class _NeedDims(Exception):
    """An operand tracks fewer trailing dims than an op needs: its leaves must track more."""

    def __init__(self, leaves: frozenset, more: int):
        super().__init__(f"{more} more dims for {sorted(n.name for n in leaves)}")
        self.leaves, self.more = leaves, more


# ---- polynomials -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Factor:
    """One element of a leaf: `leaf`'s last `tracked` dims, flattened, at `index`; `part` 0 is
    the real part (or a real leaf), 1 the imaginary part of a complex leaf."""

    leaf: Node
    tracked: int
    index: int
    part: int = 0

    def multi_index(self) -> tuple[int, ...]:
        """`index` as an index into the leaf's last `tracked` dims."""
        shape = tensor_meta(self.leaf).shape[-self.tracked:] if self.tracked else ()
        out = []
        rest = self.index
        for size in reversed(shape):
            out.append(rest % int(size))
            rest //= int(size)
        return tuple(reversed(out))


class Poly(dict):
    """{monomial: coefficient}; a monomial is a sorted tuple of factor ids (() the constant)."""

    def plus(self, other: "Poly", scale: float = 1.0) -> "Poly":
        out = Poly(self)
        for mono, coef in other.items():
            value = out.get(mono, 0.0) + scale * coef
            if value == 0.0:
                out.pop(mono, None)
            else:
                out[mono] = value
        return out

    def scaled(self, scale: float) -> "Poly":
        return Poly({mono: coef * scale for mono, coef in self.items()}) if scale != 0.0 else Poly()

    def times(self, other: "Poly") -> "Poly":
        out: dict = {}
        for m1, c1 in self.items():
            for m2, c2 in other.items():
                mono = tuple(sorted(m1 + m2))
                if len(mono) > MAX_DEGREE:
                    raise _DegreeOverflow(f"a product of degree {len(mono)} (more than {MAX_DEGREE} inputs "
                                          "multiplied)")
                out[mono] = out.get(mono, 0.0) + c1 * c2
        return Poly({m: c for m, c in out.items() if c != 0.0})


@dataclass(frozen=True)
class Complex:
    """A complex element: two polynomials."""

    re: Poly
    im: Poly


# ---- the symbolic value of a node ---------------------------------------------------------------
@dataclass
class _Value:
    ids: torch.Tensor  # int64, the tracked block: each entry indexes the evaluation's element table
    rank: int  # the node's full rank (tracked dims are its last ids.dim())
    is_complex: bool
    leaves: frozenset  # the leaf nodes it depends on
    shape: tuple = ()  # the node's full shape (set once the node is evaluated)
    rounded: bool = False  # arithmetic that rounds (add, mul, a scale) made it

    @property
    def lead(self) -> int:
        return self.rank - self.ids.dim()


@dataclass
class ChannelValue:
    """A node's value as polynomials over its tracked dims, flattened in row-major order."""

    node: Node
    tracked_shape: tuple[int, ...]
    channels: list  # Poly (or Complex) per flat tracked index
    factors: list[Factor]  # factor id -> Factor

    def factor(self, fid: int) -> Factor:
        return self.factors[fid]


class _Evaluation:
    def __init__(self, leaf_dims: dict):
        self.elements: list = []  # element id -> Poly or Complex
        self.factors: list[Factor] = []
        self.factor_ids: dict = {}
        self.memo: dict = {}
        self.leaf_dims = leaf_dims  # leaf -> tracked dims (default 1)
        # leaf -> how many of its leading dims a broadcast took into the tracked block (size-1
        # dims where the other operand tracks more): the rest line up with the region's
        # leading dims
        self.absorbed: dict = {}
        self.zero = self._element(Poly())

    def _element(self, value: Any) -> int:
        self.elements.append(value)
        return len(self.elements) - 1

    def factor_id(self, factor: Factor) -> int:
        fid = self.factor_ids.get(factor)
        if fid is None:
            fid = self.factor_ids[factor] = len(self.factors)
            self.factors.append(factor)
        return fid

    def leaf(self, node: Node) -> _Value:
        value = tensor_meta(node)
        if value is None:
            raise NotEvaluable(f"{node.name} carries no tensor metadata")
        tracked = min(self.leaf_dims.get(node, 1), value.dim())
        shape = _static(value.shape[value.dim() - tracked:], node)
        count = math.prod(shape)
        if count > MAX_TRACKED:
            raise NotEvaluable(f"{node.name}'s last {tracked} dims hold {count} elements")
        first = len(self.elements)
        for index in range(count):
            if value.is_complex():
                re = Poly({(self.factor_id(Factor(node, tracked, index, 0)),): 1.0})
                im = Poly({(self.factor_id(Factor(node, tracked, index, 1)),): 1.0})
                self.elements.append(Complex(re, im))
            else:
                self.elements.append(Poly({(self.factor_id(Factor(node, tracked, index)),): 1.0}))
        ids = torch.arange(first, first + count, dtype=torch.int64).view(shape)
        return _Value(ids, value.dim(), value.is_complex(), frozenset({node}), tuple(value.shape))

    def constant(self, number: float, rank: int = 0) -> _Value:
        key = ("constant", number)
        if key not in self.memo:
            self.memo[key] = self._element(Poly({(): float(number)}) if number != 0 else Poly())
        return _Value(torch.tensor(self.memo[key]), rank, False, frozenset(), ())

    def combine(self, op: str, a: _Value, b: _Value) -> _Value:
        a_ids, b_ids = _aligned(a, b)
        for value, ids in ((a, a_ids), (b, b_ids)):
            for leaf in value.leaves:
                self.absorbed[leaf] = max(self.absorbed.get(leaf, 0), ids.dim() - value.ids.dim())
        a_ids, b_ids = torch.broadcast_tensors(a_ids, b_ids)
        out = torch.empty(a_ids.shape, dtype=torch.int64)
        flat_a, flat_b, flat_out = a_ids.reshape(-1).tolist(), b_ids.reshape(-1).tolist(), out.view(-1)
        results = []
        for x, y in zip(flat_a, flat_b):
            key = (op, x, y)
            found = self.memo.get(key)
            if found is None:
                found = self.memo[key] = self._element(_arith(op, self.elements[x], self.elements[y]))
            results.append(found)
        flat_out.copy_(torch.tensor(results, dtype=torch.int64))
        return _Value(out, max(a.rank, b.rank), a.is_complex or b.is_complex, a.leaves | b.leaves, rounded=True)

    def unary(self, op: str, a: _Value) -> _Value:
        flat = a.ids.reshape(-1).tolist()
        results = []
        for x in flat:
            key = (op, x)
            found = self.memo.get(key)
            if found is None:
                found = self.memo[key] = self._element(_unary(op, self.elements[x]))
            results.append(found)
        ids = torch.tensor(results, dtype=torch.int64).view(a.ids.shape)
        exact = op in ("neg", "conj", "scale:1.0", "scale:-1.0")
        return _Value(ids, a.rank, a.is_complex, a.leaves, rounded=a.rounded or not exact)


def _arith(op: str, x: Any, y: Any) -> Any:
    if isinstance(x, Complex) or isinstance(y, Complex):
        x, y = _as_complex(x), _as_complex(y)
        if op == "add":
            return Complex(x.re.plus(y.re), x.im.plus(y.im))
        if op == "sub":
            return Complex(x.re.plus(y.re, -1.0), x.im.plus(y.im, -1.0))
        if op == "mul":
            return Complex(x.re.times(y.re).plus(x.im.times(y.im), -1.0), x.re.times(y.im).plus(x.im.times(y.re)))
        raise NotEvaluable(f"complex {op}")
    if op == "add":
        return x.plus(y)
    if op == "sub":
        return x.plus(y, -1.0)
    if op == "mul":
        return x.times(y)
    raise NotEvaluable(op)


def _unary(op: str, x: Any) -> Any:
    if op == "neg":
        return Complex(x.re.scaled(-1.0), x.im.scaled(-1.0)) if isinstance(x, Complex) else x.scaled(-1.0)
    if op == "conj":
        return Complex(x.re, x.im.scaled(-1.0)) if isinstance(x, Complex) else x
    if op.startswith("scale:"):
        s = float(op[6:])
        return Complex(x.re.scaled(s), x.im.scaled(s)) if isinstance(x, Complex) else x.scaled(s)
    raise NotEvaluable(op)


def _as_complex(x: Any) -> Complex:
    return x if isinstance(x, Complex) else Complex(x, Poly())


def _static(sizes: Iterable[Any], node: Node) -> tuple[int, ...]:
    out = []
    for size in sizes:
        if not isinstance(size, int):
            raise NotEvaluable(f"{node.name} has a symbolic size {size} in its tracked dims")
        out.append(size)
    return tuple(out)


def _aligned(a: _Value, b: _Value) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands' id blocks over the same number of trailing dims (a broadcast dim
    of size 1 is added where an operand tracks fewer and has size 1 there)."""
    blocks = [_without_leading_ones(a, b.ids.dim()), _without_leading_ones(b, a.ids.dim())]
    tracked = max(ids.dim() for ids in blocks)
    out = []
    for v, ids in zip((a, b), blocks):
        missing = tracked - ids.dim()
        if missing <= 0:
            out.append(ids)
            continue
        # the operand's dims at those positions (right-aligned in the broadcast) are leading
        # for it: they must be absent or of size 1, else its leaves must track them
        untracked = v.shape[:len(v.shape) - ids.dim()]
        among = untracked[max(0, len(untracked) - missing):]
        if any(not (isinstance(size, int) and size == 1) for size in among):
            if not v.leaves:
                raise NotEvaluable("a constant broadcast over tracked dims")
            raise _NeedDims(v.leaves, missing)
        out.append(ids.view((1,) * missing + tuple(ids.shape)))
    return out[0], out[1]


def _without_leading_ones(value: _Value, keep: int) -> torch.Tensor:
    """`value`'s block without its leading size-1 dims, down to `keep` dims, where the block is
    the whole value: those dims then broadcast as absent ones do. (A size-1 dim behind an
    untracked one places what precedes it: a table's (S, 1, D) against x's (S, H, D).)"""
    ids = value.ids
    if ids.dim() != value.rank:
        return ids
    while ids.dim() > keep and ids.shape[0] == 1:
        ids = ids[0]
    return ids


# ---- the ops a region may hold -------------------------------------------------------------------
def _dim(node: Node, dim: int, rank: int) -> int:
    return dim % rank if rank else 0


def _tracked_dim(value: _Value, dim: int, node: Node) -> int:
    """A full-rank dim of `value` as a dim of its tracked block; an op on a dim the block
    does not hold (a transpose of heads and sequence, a select of a position) ends the
    region there."""
    dim = _dim(node, dim, value.rank)
    if dim < value.lead:
        raise _Stop(node, f"{node.name} acts on a leading dim")
    return dim - value.lead


def _full_shape(node: Node) -> tuple:
    value = tensor_meta(node)
    if value is None:
        raise NotEvaluable(f"{node.name} carries no tensor metadata")
    return tuple(value.shape)


def _view(ev: _Evaluation, node: Node, x: _Value) -> _Value:
    out_shape = _full_shape(node)
    in_shape = _full_shape(node.args[0])
    kept = 0  # the leading dims the view keeps as they are
    while kept < min(len(in_shape), len(out_shape)) and known_equal(in_shape[kept], out_shape[kept]):
        kept += 1
    if kept >= x.lead:  # it reshapes the tracked block only
        trailing = out_shape[x.lead:]
        if all(isinstance(size, int) for size in trailing) and math.prod(trailing) == x.ids.numel():
            return _Value(x.ids.reshape(trailing), len(out_shape), x.is_complex, x.leaves, rounded=x.rounded)
        raise _Stop(node, f"{node.name} moves elements between leading and tracked dims")
    block = x.ids.dim()
    if block and len(out_shape) >= block and all(known_equal(a, b) for a, b in zip(in_shape[-block:], out_shape[-block:])):
        raise _Stop(node, f"{node.name} reshapes leading dims only")  # batch and sequence merged
    # it merges leading dims into the block (pairs stacked, then flattened back into the
    # head dim): the leaves must track them, if they are static and few
    taken = in_shape[kept:x.lead]
    if x.leaves and all(isinstance(size, int) for size in taken) and math.prod(taken) * x.ids.numel() <= MAX_TRACKED:
        raise _NeedDims(x.leaves, x.lead - kept)
    raise _Stop(node, f"{node.name} reshapes leading dims")


def _cat(ev: _Evaluation, node: Node, tensors: Sequence[_Value], stack: bool) -> _Value:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = len(_full_shape(node))
    dim = dim % rank
    tracked = max(t.ids.dim() for t in tensors) + (1 if stack else 0)
    lead = rank - tracked
    if dim < lead:
        tracked = rank - dim
        lead = dim
    pieces = []
    for t in tensors:
        need = tracked - (1 if stack else 0) - t.ids.dim()
        if need > 0:
            if not t.leaves:
                raise NotEvaluable(f"{node.name} joins a constant")
            raise _NeedDims(t.leaves, need)
        pieces.append(t.ids)
    local = dim - lead
    ids = torch.stack(pieces, local) if stack else torch.cat(pieces, local)
    return _Value(ids, rank, tensors[0].is_complex, frozenset().union(*(t.leaves for t in tensors)),
                  rounded=any(t.rounded for t in tensors))


def _evaluate_node(ev: _Evaluation, node: Node, env: dict) -> _Value:
    def value(arg: Any) -> _Value:
        if isinstance(arg, Node):
            return env[arg]
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return ev.constant(arg)
        raise NotEvaluable(f"{node.name} takes {type(arg).__name__} {arg!r}")

    t = node.target
    args = node.args
    if t in _IDENTITY or (t is prims.convert_element_type.default) or _is_cast(node):
        source = env[args[0]]
        if not source.rounded and _narrowing(tensor_meta(args[0]), tensor_meta(node)):
            # a rounded copy of an input (a table cast to the activations' dtype): the
            # region reads the rounded values, so they are its input
            raise _Stop(node, f"{node.name} rounds an input")
        return source
    if t is aten.neg.default:
        return ev.unary("neg", env[args[0]])
    if t in (aten._conj.default, aten.conj_physical.default, aten.conj.default):
        return ev.unary("conj", env[args[0]])
    if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
        alpha = node.kwargs.get("alpha", 1)
        other = value(args[1])
        if alpha != 1:
            other = ev.unary(f"scale:{float(alpha)}", other)
        return ev.combine("add" if t in (aten.add.Tensor, aten.add.Scalar) else "sub", value(args[0]), other)
    if t in (aten.mul.Tensor, aten.mul.Scalar):
        a, b = args
        if not isinstance(a, Node):
            return ev.unary(f"scale:{float(a)}", env[b])
        if not isinstance(b, Node):
            return ev.unary(f"scale:{float(b)}", env[a])
        return ev.combine("mul", env[a], env[b])
    if t in (aten.div.Tensor, aten.div.Scalar):
        if isinstance(args[1], Node) or node.kwargs.get("rounding_mode") is not None:
            raise NotEvaluable(f"{node.name} divides by a tensor")
        return ev.unary(f"scale:{1.0 / float(args[1])}", env[args[0]])
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return _view(ev, node, env[args[0]])
    if t is aten.view_as_complex.default:
        x = env[args[0]]
        if x.ids.dim() < 1 or x.ids.shape[-1] != 2:
            raise NotEvaluable(f"{node.name}: view_as_complex of a block without its pairs")
        pairs = x.ids.reshape(-1, 2).tolist()
        ids = [ev._element(Complex(_real(ev.elements[r]), _real(ev.elements[i]))) for r, i in pairs]
        return _Value(torch.tensor(ids, dtype=torch.int64).view(x.ids.shape[:-1]), x.rank - 1, True, x.leaves,
                      rounded=x.rounded)
    if t is aten.view_as_real.default:
        x = env[args[0]]
        flat = x.ids.reshape(-1).tolist()
        out = []
        for e in flat:
            c = _as_complex(ev.elements[e])
            out += [ev._element(c.re), ev._element(c.im)]
        return _Value(torch.tensor(out, dtype=torch.int64).view(*x.ids.shape, 2), x.rank + 1, False, x.leaves,
                      rounded=x.rounded)
    if t is aten.slice.Tensor:
        x = env[args[0]]
        dim = _tracked_dim(x, args[1] if len(args) > 1 else 0, node)
        start = args[2] if len(args) > 2 else None
        end = args[3] if len(args) > 3 else None
        step = args[4] if len(args) > 4 else 1
        for bound in (start, end, step):
            if bound is not None and not isinstance(bound, int):
                raise NotEvaluable(f"{node.name} slices at a symbolic bound {bound}")
        return _Value(aten.slice.Tensor(x.ids, dim, start, end, step), x.rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.select.int:
        x = env[args[0]]
        dim = _tracked_dim(x, args[1], node)
        return _Value(x.ids.select(dim, args[2]), x.rank - 1, x.is_complex, x.leaves, rounded=x.rounded)
    if t in (aten.cat.default, aten.stack.default):
        return _cat(ev, node, [value(a) for a in args[0]], stack=t is aten.stack.default)
    if t in (aten.transpose.int, aten.permute.default):
        x = env[args[0]]
        if t is aten.transpose.int:
            a, b = (_dim(node, d, x.rank) for d in args[1:3])
            perm = list(range(x.rank))
            perm[a], perm[b] = perm[b], perm[a]
        else:
            perm = [_dim(node, d, x.rank) for d in args[1]]
        moved = [i for i, p in enumerate(perm) if p != i]
        if moved and min(moved) < x.lead:
            raise _Stop(node, f"{node.name} permutes leading dims")
        local = [p - x.lead for p in perm[x.lead:]]
        return _Value(x.ids.permute(local), x.rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.unsqueeze.default:
        x = env[args[0]]
        dim = args[1] % (x.rank + 1)
        if dim == x.lead == 0:  # a leading dim in front of a vector (a bias (E,) made (1, E) for the tokens)
            return _Value(x.ids, x.rank + 1, x.is_complex, x.leaves, rounded=x.rounded)
        if dim < x.lead:
            raise _Stop(node, f"{node.name} adds a leading dim")
        return _Value(x.ids.unsqueeze(dim - x.lead), x.rank + 1, x.is_complex, x.leaves, rounded=x.rounded)
    if t in (aten.squeeze.dim, aten.squeeze.dims):
        x = env[args[0]]
        dims = [args[1]] if t is aten.squeeze.dim else list(args[1])
        shape = _full_shape(args[0])
        dims = sorted({d % x.rank for d in dims if shape[d % x.rank] == 1}, reverse=True)
        ids, rank = x.ids, x.rank
        for d in dims:
            if d < x.lead:
                raise _Stop(node, f"{node.name} drops a leading dim")
            ids = ids.squeeze(d - x.lead)
            rank -= 1
        return _Value(ids, rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.expand.default:
        x = env[args[0]]
        shape = _full_shape(node)
        before = _full_shape(args[0])
        if len(shape) != len(before) or not all(known_equal(a, b) for a, b in zip(before[:x.lead], shape[:x.lead])):
            raise _Stop(node, f"{node.name} broadcasts leading dims")
        trailing = _static(shape[len(shape) - x.ids.dim():], node) if x.ids.dim() else ()
        return _Value(x.ids.expand(trailing), len(shape), x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.flip.default:
        x = env[args[0]]
        return _Value(x.ids.flip([_tracked_dim(x, d, node) for d in args[1]]), x.rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.roll.default:
        x = env[args[0]]
        shifts, dims = args[1], args[2] if len(args) > 2 else []
        if not dims:
            raise NotEvaluable(f"{node.name} rolls the flattened tensor")
        return _Value(x.ids.roll(shifts, [_tracked_dim(x, d, node) for d in dims]), x.rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.repeat_interleave.self_int:
        x = env[args[0]]
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim")
        if dim is None or not isinstance(args[1], int):
            raise NotEvaluable(f"{node.name} repeats over a flattened tensor or a tensor of repeats")
        return _Value(x.ids.repeat_interleave(args[1], _tracked_dim(x, dim, node)), x.rank, x.is_complex, x.leaves, rounded=x.rounded)
    if t is aten.slice_backward.default:
        grad, sizes, dim, start, end, step = args
        g = env[grad]
        local = _tracked_dim(g, dim, node)
        full = _static(list(sizes)[len(sizes) - g.ids.dim():], node)
        ids = torch.full(full, ev.zero, dtype=torch.int64)
        aten.slice.Tensor(ids, local, start, end, step).copy_(g.ids)
        return _Value(ids, len(sizes), g.is_complex, g.leaves, rounded=g.rounded)
    if t is aten.select_backward.default:
        grad, sizes, dim, index = args
        g = env[grad]
        rank = len(sizes)
        local = dim % rank - (rank - g.ids.dim() - 1)
        if local < 0:
            raise NotEvaluable(f"{node.name} selects a leading dim")
        full = _static(list(sizes)[rank - g.ids.dim() - 1:], node)
        ids = torch.full(full, ev.zero, dtype=torch.int64)
        ids.select(local, index).copy_(g.ids)
        return _Value(ids, rank, g.is_complex, g.leaves, rounded=g.rounded)
    if t is operator.getitem:
        source = node.args[0]
        if is_call(source, aten.unbind.int):
            x = env[source.args[0]]
            dim = _tracked_dim(x, source.args[1] if len(source.args) > 1 else 0, node)
            return _Value(x.ids.select(dim, node.args[1]), x.rank - 1, x.is_complex, x.leaves, rounded=x.rounded)
        if is_call(source, aten.split.Tensor, aten.split_with_sizes.default):
            x = env[source.args[0]]
            dim = _tracked_dim(x, source.args[2] if len(source.args) > 2 else 0, node)
            piece = (x.ids.split(source.args[1], dim) if is_call(source, aten.split.Tensor)
                     else x.ids.split(list(source.args[1]), dim))[node.args[1]]
            return _Value(piece, x.rank, x.is_complex, x.leaves, rounded=x.rounded)
        raise NotEvaluable(f"{node.name} is an item of {source.target}")
    raise NotEvaluable(f"{node.name} ({t}) is not an op the channel algebra models")


_WIDENING = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float64),
             (torch.bfloat16, torch.float64), (torch.float16, torch.float64),
             (torch.complex64, torch.complex128)}


def _narrowing(source: Optional[torch.Tensor], result: Optional[torch.Tensor]) -> bool:
    """A cast from `source`'s dtype to `result`'s that can change a value."""
    if source is None or result is None:
        return True
    return source.dtype != result.dtype and (source.dtype, result.dtype) not in _WIDENING


def _real(element: Any) -> Poly:
    if isinstance(element, Complex):
        raise NotEvaluable("view_as_complex of complex elements")
    return element


_IDENTITY = frozenset({aten.clone.default, aten.alias.default, aten.contiguous.default, aten._to_copy.default,
                       aten.lift_fresh_copy.default})


def _is_cast(node: Node) -> bool:
    # torch_npu's own cast (npu._npu_dtype_cast), and .to(dtype) as aot spells it
    target = getattr(node.target, "__name__", "")
    return target.startswith("_npu_dtype_cast")


# ---- which nodes a region may hold ---------------------------------------------------------------
_ELEMENTWISE = frozenset({aten.neg.default, aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar,
                          aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten._conj.default,
                          aten.conj_physical.default, aten.conj.default, prims.convert_element_type.default})
_MOVES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
                    aten.select.int, aten.cat.default, aten.stack.default, aten.transpose.int, aten.permute.default,
                    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
                    aten.flip.default, aten.roll.default, aten.repeat_interleave.self_int,
                    aten.view_as_complex.default, aten.view_as_real.default, aten.slice_backward.default,
                    aten.select_backward.default, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default})


def modelled(node: Node) -> bool:
    """`node` is an op the algebra evaluates (its value may still turn out not evaluable)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        return is_call(node.args[0], aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default)
    if t in (aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default):
        return True  # the getitems are the values
    value = tensor_meta(node)
    if value is None or not (value.is_floating_point() or value.is_complex()):
        return False
    if t in (aten.div.Tensor, aten.div.Scalar) and isinstance(node.args[1], Node):
        return False
    return t in _ELEMENTWISE or t in _MOVES or t in _IDENTITY or _is_cast(node)


# ---- regions ----------------------------------------------------------------------------------------
@dataclass
class Region:
    """A connected set of modelled nodes, its leaves (inputs from outside) and outputs."""

    nodes: list[Node]  # in graph order
    leaves: list[Node]
    outputs: list[Node]  # nodes read outside the region (or by the graph's output)


def region_around(seed: Node, include: Callable[[Node], bool] = lambda node: True) -> Optional[Region]:
    """The region of modelled nodes connected to `seed` (through inputs and users) that
    `include` admits. None if the seed is not one, or the region grows past MAX_REGION nodes."""
    if not modelled(seed) or not include(seed):
        return None
    inside = {seed}
    pending = [seed]
    while pending:
        node = pending.pop()
        for other in (*node.all_input_nodes, *node.users):
            if other in inside or not modelled(other) or not include(other):
                continue
            inside.add(other)
            if len(inside) > MAX_REGION:
                return None
            pending.append(other)
    nodes = sorted(inside)
    leaves = sorted({a for n in nodes for a in n.all_input_nodes if a not in inside})
    outputs = [n for n in nodes if (not n.users or any(u not in inside for u in n.users))
               and tensor_meta(n) is not None]
    return Region(nodes, leaves, outputs)


# ops whose elements add terms (x + y, x - y, x + 2.0): with complex values (a complex product
# sums two), the only ones that give a channel more than one term
_SUMS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar})


def single_terms(region: Region) -> bool:
    """Whether every channel of every value of `region`, evaluated from its leaves
    (evaluate_around without `known` values), is one term (a coefficient times a product of
    the leaves' elements) or zero, whatever the region moves: no node in it sums terms and
    no node or leaf is complex. Read from the ops alone, without evaluating the region."""
    def is_complex(node: Node) -> bool:
        value = tensor_meta(node)
        return value is not None and value.is_complex()

    return not any(n.target in _SUMS or is_complex(n) for n in region.nodes) and not any(
        is_complex(leaf) for leaf in region.leaves)


@dataclass
class EvaluatedRegion:
    region: Region
    values: dict  # node -> ChannelValue, for every node of the region
    tracked: dict  # leaf -> how many trailing dims the algebra tracked of it
    absorbed: dict  # leaf -> its leading dims a broadcast took into the tracked block

    def leading_dims(self, leaf: Node) -> int:
        """How many of `leaf`'s leading dims line up with the leading dims of the values it
        meets (the rest of its dims are tracked, or broadcast over tracked ones)."""
        return tensor_meta(leaf).dim() - self.tracked.get(leaf, 1) - self.absorbed.get(leaf, 0)


def evaluate_around(seed: Node, include: Callable[[Node], bool] = lambda node: True,
                    known: Optional[dict] = None) -> EvaluatedRegion:
    """The region around `seed` and every node's ChannelValue; raises NotEvaluable.

    The region ends where an op acts on leading dims (a transpose of heads and sequence,
    a view that splits the hidden dim into heads): such a node is one of its leaves. Each
    leaf tracks as few trailing dims as the region needs (found by retrying). `known`:
    ChannelValues the caller has for some leaves (a backward region reading forward
    values, in the forward's factors): those leaves evaluate to them."""
    # the element ids are real tensors, even while a compile's fake mode is active
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _evaluate_around(seed, include, known)


def _evaluate_around(seed: Node, include: Callable[[Node], bool], known: Optional[dict]) -> EvaluatedRegion:
    stops: set = set()
    leaf_dims: dict = {}
    for _ in range(32):
        region = region_around(seed, lambda n: include(n) and n not in stops)
        if region is None:
            raise NotEvaluable(f"no region of at most {MAX_REGION} modelled nodes around {seed.name}")
        ev = _Evaluation(leaf_dims)
        try:
            env = _run(ev, region, known or {})
        except _Stop as stop:
            if stop.node is seed:
                raise NotEvaluable(str(stop)) from None
            stops.add(stop.node)
            continue
        except _NeedDims as need:
            for leaf in need.leaves:
                leaf_dims[leaf] = leaf_dims.get(leaf, 1) + need.more
                if leaf_dims[leaf] > tensor_meta(leaf).dim():
                    raise NotEvaluable(f"{leaf.name} would need more dims tracked than it has") from None
            continue
        except (IndexError, RuntimeError) as exc:  # an index op torch refuses on the ids
            raise NotEvaluable(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        values = {}
        for node in region.nodes:
            v = env.get(node)
            if v is not None:
                flat = v.ids.reshape(-1).tolist()
                values[node] = ChannelValue(node, tuple(v.ids.shape), [ev.elements[i] for i in flat], ev.factors)
        tracked = {leaf: min(leaf_dims.get(leaf, 1), tensor_meta(leaf).dim()) for leaf in region.leaves
                   if tensor_meta(leaf) is not None}
        return EvaluatedRegion(region, values, tracked, dict(ev.absorbed))
    raise NotEvaluable(f"the region around {seed.name} did not settle")


def _product_operand(ev: "_Evaluation", node: Node, env: dict, region: Region) -> Optional[Node]:
    """The input of `node` computed in the region whose elements are products of the most
    inputs (two or more), or None."""
    best, best_degree = None, 1
    for operand in node.all_input_nodes:
        value = env.get(operand)
        if value is None or operand in region.leaves:
            continue
        polys = [poly for i in set(value.ids.reshape(-1).tolist())
                 for poly in ((ev.elements[i].re, ev.elements[i].im) if isinstance(ev.elements[i], Complex)
                              else (ev.elements[i],))]
        degree = max((len(mono) for poly in polys for mono in poly), default=0)
        if degree > best_degree:
            best, best_degree = operand, degree
    return best


def _run(ev: _Evaluation, region: Region, known: dict) -> dict:
    env: dict = {}
    for leaf in region.leaves:
        if leaf in known:
            env[leaf] = _from_channel_value(ev, known[leaf])
        elif tensor_meta(leaf) is not None:
            env[leaf] = ev.leaf(leaf)
    for node in region.nodes:
        if node.target in (aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default):
            continue  # evaluated through their getitems
        try:
            value = _evaluate_node(ev, node, env)
        except _DegreeOverflow as exc:
            # a product of products (nGPT's q = sq * normalize(q), then q * cos): the operand
            # that is already a product becomes a leaf, a value of its own, and the region is
            # evaluated again from it
            operand = _product_operand(ev, node, env, region)
            if operand is None:
                raise
            raise _Stop(operand, f"{operand.name} is a product, taken as it is ({exc})") from None
        env[node] = _Value(value.ids, value.rank, value.is_complex, value.leaves, _full_shape(node), value.rounded)
    return env


def _from_channel_value(ev: _Evaluation, known: ChannelValue) -> _Value:
    """A leaf whose polynomials the caller knows (in terms of its own factors)."""
    remap = {}
    for fid, factor in enumerate(known.factors):
        remap[fid] = ev.factor_id(factor)

    def moved(poly: Poly) -> Poly:
        return Poly({tuple(sorted(remap[f] for f in mono)): c for mono, c in poly.items()})

    ids = []
    for element in known.channels:
        ids.append(ev._element(Complex(moved(element.re), moved(element.im)) if isinstance(element, Complex)
                               else moved(element)))
    value = tensor_meta(known.node)
    block = torch.tensor(ids, dtype=torch.int64).view(known.tracked_shape)
    # (not the forward leaves: this value's tracked dims are what they are)
    return _Value(block, value.dim(), value.is_complex(), frozenset(), tuple(value.shape))


# ---- gathering channels with views ------------------------------------------------------------------
@dataclass(frozen=True)
class ChannelGather:
    """out[..., j] = sign[j] * t[..., *source[j]] over a tensor's trailing dims, as a program
    of selects, narrows, permutes, expands and a stack (no index tensors: the graph holds
    plain views and copies, which every backend lowers).

    The channels j are read as the digits of a mixed radix; each trailing dim of `t` is a
    constant or one digit (plus an offset), and the sign depends on at most one digit."""

    source_shape: tuple[int, ...]
    radix: tuple[int, ...]
    dims: tuple  # per source dim: ("const", c) or ("digit", k, offset)
    sign_digit: Optional[int]  # the digit the sign depends on; None: one sign for all
    signs: tuple[float, ...]  # per value of that digit (or the one sign)
    # the source's last dim is first read as (n // split, split) (pairs of a head dim)
    split: Optional[int] = None

    @property
    def identity(self) -> bool:
        """Reads the trailing dims as they are (flattened)."""
        return (self.radix == self.source_shape and self.signs == (1.0,)
                and self.dims == tuple(("digit", i, 0) for i in range(len(self.dims))))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.split is not None:
            t = t.unflatten(-1, (-1, self.split))
        m = len(self.source_shape)
        lead = t.dim() - m
        kept = []  # (digit, size) of the source dims still there, in order
        for i in reversed(range(m)):
            spec = self.dims[i]
            if spec[0] == "const":
                t = t.select(lead + i, spec[1])
            else:
                _, k, offset = spec
                if offset or self.radix[k] != t.shape[lead + i]:
                    t = t.narrow(lead + i, offset, self.radix[k])
                kept.insert(0, k)
        # the kept dims in digit order, with each unused digit a broadcast dim
        order = sorted(range(len(kept)), key=lambda i: kept[i])
        if order != list(range(len(kept))):
            t = t.permute(*range(lead), *(lead + i for i in order))
        digits = sorted(kept)
        for k in range(len(self.radix)):
            if k not in digits:
                position = lead + sum(1 for d in digits if d < k)
                t = t.unsqueeze(position)
                digits.insert(position - lead, k)
        t = t.expand(*t.shape[:lead], *self.radix)
        if self.sign_digit is not None:
            # one piece per run of equal signs along the digit (a half of the channels negated
            # is two pieces, not one per channel)
            dim, pieces, start = lead + self.sign_digit, [], 0
            for sign, run in itertools.groupby(self.signs):
                length = len(list(run))
                piece = t.narrow(dim, start, length)
                pieces.append(piece if sign > 0 else -piece)
                start += length
            t = torch.cat(pieces, dim)
        elif self.signs[0] < 0:
            t = -t
        return t.reshape(*t.shape[:lead], math.prod(self.radix))


def channel_gather(sources: Sequence[tuple[int, ...]], source_shape: Sequence[int],
                   signs: Optional[Sequence[float]] = None) -> Optional[ChannelGather]:
    """The ChannelGather that reads `sources[j]` (multi-indices into trailing dims of shape
    `source_shape`) with `signs[j]` (+1 / -1) for channel j, or None if no view program does."""
    signs = list(signs) if signs is not None else [1.0] * len(sources)
    if any(sign not in (1.0, -1.0) for sign in signs):
        return None  # a sign, not a scale: a view program negates, it does not multiply
    found = _gather(list(sources), tuple(source_shape), signs)
    if found is None and source_shape and source_shape[-1] % 2 == 0 and source_shape[-1] > 2:
        # a head dim's pairs (de-interleaving): the last dim as (n / 2, 2)
        split = [(*s[:-1], s[-1] // 2, s[-1] % 2) for s in sources]
        found = _gather(split, (*source_shape[:-1], source_shape[-1] // 2, 2), signs)
        if found is not None:
            found = ChannelGather(found.source_shape, found.radix, found.dims, found.sign_digit, found.signs, 2)
    if found is None:
        found = _repeated(list(sources), source_shape, signs)
    return found


def _repeated(sources: list, source_shape: Sequence[int], signs: list) -> Optional[ChannelGather]:
    """The gather of channels that repeat with a period (a rotation's table read alike for
    every batch row, where the rows merge batch and positions): one more digit, in front,
    that no source dim reads (a broadcast), and the gather of one period behind it."""
    count = len(sources)
    for period in range(1, count // 2 + 1):
        if count % period or any(sources[i] != sources[i % period] or signs[i] != signs[i % period]
                                 for i in range(period, count)):
            continue
        inner = channel_gather(sources[:period], source_shape, signs[:period])
        if inner is None:
            return None
        dims = tuple(spec if spec[0] == "const" else ("digit", spec[1] + 1, spec[2]) for spec in inner.dims)
        sign_digit = None if inner.sign_digit is None else inner.sign_digit + 1
        return ChannelGather(inner.source_shape, (count // period, *inner.radix), dims, sign_digit, inner.signs,
                             inner.split)
    return None


def _gather(sources: list, source_shape: tuple, signs: list) -> Optional[ChannelGather]:
    count = len(sources)
    for radix in _radices(count):
        digits = _digits(count, radix)
        dims = []
        used = set()
        for i in range(len(source_shape)):
            values = [s[i] for s in sources]
            if len(set(values)) == 1:
                dims.append(("const", values[0]))
                continue
            found = None
            for k in range(len(radix)):
                if k in used:
                    continue
                offset = values[0] - digits[0][k]
                if offset >= 0 and offset + radix[k] <= source_shape[i] and \
                        all(v == d[k] + offset for v, d in zip(values, digits)):
                    found = ("digit", k, offset)
                    break
            if found is None:
                break
            used.add(found[1])
            dims.append(found)
        else:
            sign_digit, sign_values = _sign_program(signs, digits, radix)
            if sign_values is not None:
                return ChannelGather(source_shape, radix, tuple(dims), sign_digit, sign_values)
    return None


def _sign_program(signs: Sequence[float], digits: Sequence[tuple], radix: tuple) -> tuple:
    if len(set(signs)) == 1:
        return None, (float(signs[0]),)
    for k in range(len(radix)):
        per_value: dict = {}
        if all(per_value.setdefault(d[k], s) == s for s, d in zip(signs, digits)):
            return k, tuple(float(per_value[v]) for v in range(radix[k]))
    return None, None


def _digits(count: int, radix: tuple) -> list[tuple]:
    out = []
    for j in range(count):
        rest, digits = j, []
        for r in reversed(radix):
            digits.append(rest % r)
            rest //= r
        out.append(tuple(reversed(digits)))
    return out


def _radices(count: int) -> list[tuple]:
    """Mixed radices of `count` with 1 to 3 digits (each > 1), the plainest first."""
    out = [(count,)]
    divisors = [d for d in range(2, count) if count % d == 0]
    out += [(d, count // d) for d in divisors]
    out += [(a, b, count // (a * b)) for a in divisors for b in divisors
            if count % (a * b) == 0 and count // (a * b) > 1]
    return out


def channels_of(node: Node, include: Callable[[Node], bool] = lambda node: True) -> ChannelValue:
    """`node`'s value as polynomials over its trailing dims: from the region around it when it
    is a modelled op, else as a leaf (its last dim, each element itself). Raises NotEvaluable."""
    if modelled(node) and include(node):
        evaluated = evaluate_around(node, include)
        value = evaluated.values.get(node)
        if value is not None:
            return value
    meta = tensor_meta(node)
    if meta is None or meta.dim() == 0 or not isinstance(meta.shape[-1], int):
        raise NotEvaluable(f"{node.name} has no static last dim")
    factors = [Factor(node, 1, index) for index in range(meta.shape[-1])]
    return ChannelValue(node, (meta.shape[-1],), [Poly({(i,): 1.0}) for i in range(len(factors))], factors)


# ---- running a slice of the graph on concrete values ------------------------------------------------
MAX_SLICE = 64


def real_tensors():
    """A context in which tensors are real ones, even inside a compile's fake mode (a check
    that computes with the values evaluate_slice returns)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def evaluate_slice(outputs: Sequence[Node], inputs: dict, limit: int = MAX_SLICE) -> list:
    """The values `outputs` take when the graph's own nodes run on concrete `inputs`
    ({node: tensor}), for a function of a few tensors checked on every value it can take
    (a mask built from a top-k's indices). Every node between the inputs and the outputs
    runs as the graph holds it (its aten op); a node outside may be read only for its shape
    (the first argument of zeros_like, new_ones, ...: a zero tensor of its shape stands in)
    or as a symbolic size (its hint, as every size of the run is). Raises NotEvaluable when
    the slice reads anything else, or holds more than `limit` nodes. Call it, and compute
    with what it returns, under real_tensors()."""
    slice_nodes: set = set()
    stand_ins: dict = {}
    pending = list(outputs)
    while pending:
        node = pending.pop()
        if node in inputs or node in slice_nodes or node in stand_ins:
            continue
        value = node.meta.get("val")
        if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
            stand_ins[node] = _hint(value)
            continue
        if node.op != "call_function":
            raise NotEvaluable(f"the slice reads the values of {node.name}")
        slice_nodes.add(node)
        if len(slice_nodes) > limit:
            raise NotEvaluable(f"more than {limit} nodes between the inputs and {outputs[0].name}")
        for index, arg in enumerate(node.all_input_nodes):
            if node.target in SHAPE_ONLY_OPS and arg is node.args[0] and arg not in inputs:
                fake = tensor_meta(arg)
                if fake is None:
                    raise NotEvaluable(f"{arg.name} carries no tensor metadata")
                with real_tensors():
                    stand_ins[arg] = torch.zeros([_hint(s) for s in fake.shape], dtype=fake.dtype)
            else:
                pending.append(arg)
    env = {**stand_ins, **inputs}
    for node in sorted(slice_nodes):
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        try:
            env[node] = node.target(*args, **kwargs)
        except (RuntimeError, IndexError, TypeError, ValueError) as exc:
            raise NotEvaluable(f"{node.name} does not run on the probe values: {str(exc).splitlines()[0]}") from None
    return [env[n] for n in outputs]


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise NotEvaluable(f"the size {size} has no hint")
        return int(hint)
    return int(size)
