"""Values a graph computes from its symbolic sizes only, as formulas of their indices.

Under dynamic shapes the causal mask a model builds from `arange`s of the sequence length is
another tensor at every size, so evaluating it once (constants.evaluate_constant) proves
nothing. But it is a function of its indices and of the size symbols: element [b, h, i, j]
of `arange(S)[None, :] <= arange(S)[:, None]` is `j <= i`, whatever S is. This module
evaluates a subgraph that reads no tensor input (aranges, constants, sizes; arithmetic,
comparisons, logic, where, views, expand, slice, cat, index with index tensors, cumsum of a
constant, triu / tril) into one sympy formula per node over one index symbol per dim, and
decides a boolean formula over the box of every index (0 <= i < size) for every size the
shape environment allows (each symbol at least its lower bound):

- a comparison linear in the indices is decided from its least and greatest value over the
  box (a polynomial in the size symbols with every coefficient of one sign, after writing
  each symbol as its lower bound plus a non-negative part);
- a conjunction narrows the box with its one-index bounds (`i < 1` makes i 0) and
  intersects the ranges its comparisons give each linear form of the indices (`j - i <= 0`
  and `j - i >= 1` are empty);
- `where`, `cat` and a cast of a bool are piecewise: each piece is decided under its
  condition.

A mask is then right-down causal when `visible and not causal` and `causal and not visible`
are both decided False: a proof for every size, not a test at some. Anything else (a tensor
input, an op this module does not know, a formula it cannot decide) is "not proven", and
the pass keeps the mask as a tensor. Nothing here names an op family.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx

Node = torch.fx.Node
aten = torch.ops.aten

_IDX = tuple(sympy.Symbol(f"_i{d}", integer=True, nonnegative=True) for d in range(12))
# the roles of an attention mask's dims
_ROLE = {"b": sympy.Symbol("_batch", integer=True, nonnegative=True),
         "s": sympy.Symbol("_query", integer=True, nonnegative=True),
         "t": sympy.Symbol("_key", integer=True, nonnegative=True)}
MAX_NODES = 400


class NotSymbolic(Exception):
    """The node's value is not a formula this module builds or decides."""


@dataclass(frozen=True)
class Formula:
    shape: tuple  # sympy sizes
    expr: Any  # sympy: over _IDX[:len(shape)]


# ---- sizes ----------------------------------------------------------------------------------------------
def _size(value: Any) -> Any:
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return _floors_of_sizes(value.node.expr)
    raise NotSymbolic(f"a size {value!r}")


def _floors_of_sizes(expr: Any) -> Any:
    """A size expression with torch's FloorDiv(a, b) as sympy's floor(a / b): the spelling the
    formulas' own floors have ((t + 1) // m), so that the block count S // m of a shape and the
    threshold floor(S / m) of its last query cancel."""
    if not any(type(e).__name__ == "FloorDiv" for e in sympy.preorder_traversal(expr)):
        return expr
    return expr.replace(lambda e: type(e).__name__ == "FloorDiv", lambda e: sympy.floor(e.args[0] / e.args[1]))


def _meta_shape(node: Node) -> tuple:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise NotSymbolic(f"{node.name} is not a tensor")
    return tuple(_size(s) for s in value.shape)


def _is_one(size: Any) -> bool:
    return size == 1


# ---- evaluation ------------------------------------------------------------------------------------------
class _Evaluation:
    def __init__(self, lower: dict):
        self.values: dict[Node, Formula] = {}
        self.lower = lower  # each size symbol's least value

    def value(self, node: Any) -> Any:
        """A Formula for a tensor node, a sympy number for a Python scalar or a SymInt node."""
        if not isinstance(node, Node):
            if isinstance(node, bool):
                return sympy.true if node else sympy.false
            if isinstance(node, (int, float)):
                return sympy.Integer(node) if isinstance(node, int) else _float(node)
            if isinstance(node, torch.SymInt):
                return _floors_of_sizes(node.node.expr)
            raise NotSymbolic(f"an argument {node!r}")
        found = self.values.get(node)
        if found is None:
            if len(self.values) > MAX_NODES:
                raise NotSymbolic("the subgraph is too large")
            found = self.values[node] = _evaluate(self, node)
        return found


def _float(x: float) -> Any:
    if x == float("inf"):
        return sympy.oo
    if x == float("-inf"):
        return -sympy.oo
    return sympy.Rational(x) if float(x).is_integer() else sympy.Float(x)


def _evaluate(ev: _Evaluation, node: Node) -> Any:
    meta = node.meta.get("val")
    if isinstance(meta, torch.SymInt):
        return _floors_of_sizes(meta.node.expr)
    if node.op != "call_function":
        raise NotSymbolic(f"{node.name} is a graph input")
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    handler = _HANDLERS.get(name)
    if handler is None:
        raise NotSymbolic(f"{node.target} is not evaluated symbolically")
    shape = _meta_shape(node)
    expr = handler(ev, node, shape)
    return Formula(shape, expr)


def _scalar_or(ev: _Evaluation, arg: Any, shape: tuple) -> Any:
    """An operand as an expression over the output's indices (broadcast)."""
    value = ev.value(arg)
    if not isinstance(value, Formula):
        return value
    return _broadcast(value, shape)


def _broadcast(value: Formula, shape: tuple) -> Any:
    offset = len(shape) - len(value.shape)
    mapping = {}
    for d, size in enumerate(value.shape):
        mapping[_IDX[d]] = sympy.Integer(0) if _is_one(size) else _IDX[d + offset]
    return value.expr.xreplace(mapping)


def _arange(ev, node, shape):
    args = [ev.value(a) for a in node.args]
    start, step = (args[0], args[2] if len(args) > 2 else 1) if len(args) > 1 else (0, 1)
    return sympy.sympify(start) + step * _IDX[0]


def _constant(index):
    def handler(ev, node, shape):
        value = node.args[index] if len(node.args) > index else node.kwargs.get("fill_value")
        return ev.value(value)
    return handler


def _fixed(value):
    return lambda ev, node, shape: value


def _binary(op):
    def handler(ev, node, shape):
        a, b = (_scalar_or(ev, x, shape) for x in node.args[:2])
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            b = b * alpha
        return op(a, b)
    return handler


def _compare(op):
    def handler(ev, node, shape):
        a, b = (_scalar_or(ev, x, shape) for x in node.args[:2])
        return _relation(op, a, b)
    return handler


def _relation(op, a, b):
    if isinstance(a, sympy.Piecewise) or isinstance(b, sympy.Piecewise):
        return _fold(lambda x, y: _relation(op, x, y), a, b)
    return op(a, b)


def _fold(fn, *args):
    """fn applied to each piece of the piecewise arguments."""
    for i, a in enumerate(args):
        if isinstance(a, sympy.Piecewise):
            pieces = []
            for value, cond in a.args:
                rest = list(args)
                rest[i] = value
                pieces.append((_fold(fn, *rest), cond))
            return sympy.Piecewise(*pieces)
    return fn(*args)


def _logic(op):
    def handler(ev, node, shape):
        args = [_as_bool(_scalar_or(ev, x, shape)) for x in node.args[:2]]
        return op(*args)
    return handler


def _as_bool(expr: Any) -> Any:
    if expr is sympy.true or expr is sympy.false or isinstance(expr, (sympy.logic.boolalg.Boolean,)):
        return expr
    if isinstance(expr, sympy.Piecewise):
        return _piecewise_bool(_fold(_as_bool, expr))
    return sympy.Ne(expr, 0)


def _piecewise_bool(expr: Any) -> Any:
    """A piecewise of booleans as one boolean formula."""
    if not isinstance(expr, sympy.Piecewise):
        return expr
    out, previous = [], []
    for value, cond in expr.args:
        out.append(sympy.And(cond, *[sympy.Not(p) for p in previous], _piecewise_bool(value)))
        previous.append(cond)
    return sympy.Or(*out)


def _not(ev, node, shape):
    return sympy.Not(_as_bool(_scalar_or(ev, node.args[0], shape)))


def _where(ev, node, shape):
    cond = _as_bool(_scalar_or(ev, node.args[0], shape))
    a, b = (_scalar_or(ev, x, shape) for x in node.args[1:3])
    return sympy.Piecewise((a, cond), (b, True))


def _masked_fill(ev, node, shape):
    x = _scalar_or(ev, node.args[0], shape)
    cond = _as_bool(_scalar_or(ev, node.args[1], shape))
    return sympy.Piecewise((_scalar_or(ev, node.args[2], shape), cond), (x, True))


def _cast(ev, node, shape):
    x = _scalar_or(ev, node.args[0], shape)
    meta = node.meta["val"]
    if meta.dtype == torch.bool:
        return _as_bool(x)
    if isinstance(x, sympy.logic.boolalg.Boolean):
        return sympy.Piecewise((1, x), (0, True))
    return x


def _unary_map(fn):
    def handler(ev, node, shape):
        x = _scalar_or(ev, node.args[0], shape)
        return _fold(fn, x)
    return handler


def _log(x):
    if x == 0:
        return -sympy.oo
    if x == 1:
        return sympy.Integer(0)
    return sympy.log(x)


def _isinf(x):
    return sympy.true if x in (sympy.oo, -sympy.oo) else sympy.false if x.is_number else _unknown("isinf")


def _unknown(what):
    raise NotSymbolic(f"{what} of a formula")


def _view_like(ev, node, shape):
    """A view that only inserts or removes dims of size 1 (anything else is not followed)."""
    x = ev.value(node.args[0])
    src = [(d, s) for d, s in enumerate(x.shape) if not _is_one(s)]
    dst = [(d, s) for d, s in enumerate(shape) if not _is_one(s)]
    if len(src) != len(dst) or any(sympy.simplify(a[1] - b[1]) != 0 for a, b in zip(src, dst)):
        raise NotSymbolic(f"{node.name} reshapes")
    mapping = {_IDX[d]: sympy.Integer(0) for d, s in enumerate(x.shape) if _is_one(s)}
    mapping.update({_IDX[a[0]]: _IDX[b[0]] for a, b in zip(src, dst)})
    return x.expr.xreplace(mapping)


def _same(ev, node, shape):
    return ev.value(node.args[0]).expr


def _unsqueeze(ev, node, shape):
    x = ev.value(node.args[0])
    d = node.args[1] % (len(x.shape) + 1)
    mapping = {_IDX[i]: _IDX[i + 1 if i >= d else i] for i in range(len(x.shape))}
    return x.expr.xreplace(mapping)


def _squeeze(ev, node, shape):
    return _view_like(ev, node, shape)


def _expand(ev, node, shape):
    x = ev.value(node.args[0])
    return _broadcast(x, shape)


def _permute(ev, node, shape):
    x = ev.value(node.args[0])
    rank = len(x.shape)
    if "transpose" in getattr(node.target, "__name__", ""):
        a, b = node.args[1] % rank, node.args[2] % rank
        order = list(range(rank))
        order[a], order[b] = order[b], order[a]
    else:
        order = [d % rank for d in node.args[1]]
    return x.expr.xreplace({_IDX[src]: _IDX[dst] for dst, src in enumerate(order)})


def _slice(ev, node, shape):
    x = ev.value(node.args[0])
    rank = len(x.shape)
    d = (node.args[1] if len(node.args) > 1 else 0) % rank
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    start = ev.value(start) if start is not None else 0
    if isinstance(start, sympy.Basic) and start.is_number and start < 0:
        start = start + x.shape[d]
    if not isinstance(step, int):
        raise NotSymbolic("a slice with a symbolic step")
    return x.expr.xreplace({_IDX[d]: start + step * _IDX[d]})


def _select(ev, node, shape):
    x = ev.value(node.args[0])
    rank = len(x.shape)
    d = node.args[1] % rank
    index = ev.value(node.args[2])
    mapping = {_IDX[d]: index}
    mapping.update({_IDX[i]: _IDX[i - 1] for i in range(d + 1, rank)})
    return x.expr.xreplace(mapping)


def _cat(ev, node, shape):
    tensors = node.args[0]
    rank = len(shape)
    d = (node.args[1] if len(node.args) > 1 else 0) % rank
    pieces, offset = [], sympy.Integer(0)
    for t in tensors:
        value = ev.value(t)
        if len(value.shape) != rank:
            raise NotSymbolic("a cat of a 1-d empty tensor")
        expr = value.expr.xreplace({_IDX[d]: _IDX[d] - offset})
        offset = offset + value.shape[d]
        pieces.append((expr, sympy.Lt(_IDX[d], offset)))
    pieces[-1] = (pieces[-1][0], True)
    return sympy.Piecewise(*pieces)


def _triangle(upper):
    def handler(ev, node, shape):
        x = ev.value(node.args[0])
        k = ev.value(node.args[1]) if len(node.args) > 1 else 0
        rank = len(shape)
        row, col = _IDX[rank - 2], _IDX[rank - 1]
        keep = sympy.Ge(col - row, k) if upper else sympy.Le(col - row, k)
        if node.meta["val"].dtype == torch.bool:
            return sympy.And(_as_bool(x.expr), keep)
        return sympy.Piecewise((x.expr, keep), (0, True))
    return handler


def _index(ev, node, shape):
    x = ev.value(node.args[0])
    indices = list(node.args[1])
    if any(i is None for i in indices):
        raise NotSymbolic("an index with None")
    count = len(indices)
    lead = len(shape) - (len(x.shape) - count)
    mapping = {}
    for k, index in enumerate(indices):
        value = ev.value(index)
        if not isinstance(value, Formula):
            raise NotSymbolic("an index that is not a tensor")
        mapping[_IDX[k]] = _broadcast(value, shape[:lead])
    for k in range(count, len(x.shape)):
        mapping[_IDX[k]] = _IDX[k - count + lead]
    return x.expr.xreplace(mapping)


def _cumsum(ev, node, shape):
    x = ev.value(node.args[0])
    d = node.args[1] % len(shape)
    summand = x.expr
    if isinstance(summand, sympy.logic.boolalg.Boolean) or summand in (sympy.true, sympy.false):
        summand = sympy.Piecewise((1, summand), (0, True))
    box = _Box.of(shape, ev.lower)
    decided = _decide_value(summand, box)
    if decided is None or decided.has(_IDX[d]):
        raise NotSymbolic("a cumsum of a value that varies along it")
    return decided * (_IDX[d] + 1)


def _clamp(ev, node, shape):
    """clamp(x, lo, hi) as Max / Min (the comparisons below split them: _le)."""
    x = _scalar_or(ev, node.args[0], shape)
    name = getattr(node.target, "__name__", "")
    if name.startswith("clamp_min"):
        bounds = (node.args[1], None)
    elif name.startswith("clamp_max"):
        bounds = (None, node.args[1])
    else:
        bounds = (node.args[1] if len(node.args) > 1 else node.kwargs.get("min"),
                  node.args[2] if len(node.args) > 2 else node.kwargs.get("max"))
    lo, hi = (None if b is None else _scalar_or(ev, b, shape) for b in bounds)
    if lo is not None:
        x = _fold(sympy.Max, x, lo)
    if hi is not None:
        x = _fold(sympy.Min, x, hi)
    return x


def _repeat(ev, node, shape):
    """repeat(x, counts) where each count is 1 or repeats a dim of size 1 (a new leading dim
    included): a broadcast. A count > 1 of a longer dim would tile it (an index mod its size)."""
    x = ev.value(node.args[0])
    counts = list(node.args[1])
    padded = (sympy.Integer(1),) * (len(counts) - len(x.shape)) + tuple(x.shape)
    for size, count in zip(padded, counts):
        if not (_is_one(size) or count == 1):
            raise NotSymbolic(f"{node.name} tiles a dim")
    lead = len(counts) - len(x.shape)  # (x's dims are the last of the padded shape)
    expr = x.expr.xreplace({_IDX[d]: _IDX[d + lead] for d in range(len(x.shape))})
    return _broadcast(Formula(padded, expr), shape)


# one existence this module does not decide: a slot of an index list that holds a value
# independent of its position, under a condition that depends on it ("some slot is -1").
# It is sound to leave it open: a comparison that rules the value out (a padding lane
# sliced away) decides the whole conjunction without it (_conjunction)
_SOME_SLOT = sympy.Symbol("_some_slot")


def listed(index: Formula, slot_count: Any, rank: int) -> Any:
    """The bool formula, over the indices of a tensor of `rank` dims whose last is the key j,
    of "some slot k < slot_count of index[..., k] holds j" (index: a Formula whose last dim is
    the slots, its other dims those of the output's leading dims).

    Each piece of the index's value is either linear in k with coefficient +-1 (then the slot
    holding j is k = +-(j - rest), one at most: substituted, with 0 <= k < slot_count), or
    independent of k (then j must be that value, and some slot must satisfy the piece's
    condition: if that depends on k, it is left open as _SOME_SLOT)."""
    k = sympy.Dummy("slot", integer=True, nonnegative=True)
    j = _IDX[rank - 1]
    expr = index.expr.xreplace({_IDX[len(index.shape) - 1]: k})
    pieces = []
    for value, cond in _leaves(sympy.piecewise_fold(expr)):
        value = sympy.expand(value)
        c = value.coeff(k)
        rest = sympy.expand(value - c * k)
        if rest.has(k):
            raise NotSymbolic("an index slot's value is not linear in its position")
        if c == 0:
            some = _SOME_SLOT if cond.has(k) else sympy.And(cond, sympy.Lt(0, slot_count))
            pieces.append(sympy.And(sympy.Eq(j, rest), some))
        elif c in (1, -1):
            slot = c * (j - rest)
            pieces.append(sympy.And(cond.xreplace({k: slot}), sympy.Ge(slot, 0), sympy.Lt(slot, slot_count)))
        else:
            raise NotSymbolic("an index slot's value steps by more than 1")
    return sympy.Or(*pieces)


def _leaves(expr: Any, cond: Any = sympy.true) -> list:
    """[(value, condition)] of a (nested) piecewise value: each piece under its condition and
    the negation of the ones before it."""
    if not isinstance(expr, sympy.Piecewise):
        return [(expr, cond)]
    out, previous = [], []
    for value, c in expr.args:
        c = _piecewise_bool(c) if isinstance(c, sympy.Piecewise) else c
        here = sympy.And(cond, c, *[sympy.Not(p) for p in previous])
        out += _leaves(sympy.piecewise_fold(value), here)
        previous.append(c)
    return out


def _scatter(ev, node, shape):
    """scatter(self, dim=-1, index, value) of a scalar value into a tensor: value where some
    slot of the index row holds the column (listed), else self. The index's leading dims
    must be self's (scatter leaves the rows past the index's extent as they are)."""
    if "value" not in str(node.target) and not isinstance(node.args[3], (int, float)):
        raise NotSymbolic("a scatter of a tensor")
    rank = len(shape)
    if node.args[1] % rank != rank - 1:
        raise NotSymbolic("a scatter along a dim other than the last")
    index = ev.value(node.args[2])
    if len(index.shape) != rank or any(sympy.simplify(a - b) != 0 for a, b in zip(index.shape[:-1], shape[:-1])):
        raise NotSymbolic("a scatter whose index rows are not the output's")
    value = ev.value(node.args[3])
    base = _scalar_or(ev, node.args[0], shape)
    return sympy.Piecewise((value, listed(index, index.shape[-1], rank)), (base, True))


_HANDLERS = {
    "arange": _arange, "full": _constant(1), "new_full": _constant(2), "full_like": _constant(1),
    "scalar_tensor": _constant(0), "ones": _fixed(sympy.Integer(1)), "new_ones": _fixed(sympy.Integer(1)),
    "ones_like": _fixed(sympy.Integer(1)), "zeros": _fixed(sympy.Integer(0)), "new_zeros": _fixed(sympy.Integer(0)),
    "zeros_like": _fixed(sympy.Integer(0)),
    "add": _binary(lambda a, b: a + b), "sub": _binary(lambda a, b: a - b), "mul": _binary(lambda a, b: a * b),
    "floor_divide": _binary(lambda a, b: _fold(lambda x, y: sympy.floor(x / y), a, b)),
    "neg": _unary_map(lambda x: -x), "log": _unary_map(_log), "isinf": _unary_map(_isinf),
    "eq": _compare(sympy.Eq), "ne": _compare(sympy.Ne), "lt": _compare(sympy.Lt), "le": _compare(sympy.Le),
    "gt": _compare(sympy.Gt), "ge": _compare(sympy.Ge),
    "bitwise_and": _logic(sympy.And), "logical_and": _logic(sympy.And), "bitwise_or": _logic(sympy.Or),
    "logical_or": _logic(sympy.Or), "bitwise_not": _not, "logical_not": _not,
    "where": _where, "masked_fill": _masked_fill,
    "_to_copy": _cast, "convert_element_type": _cast, "_npu_dtype_cast": _cast,
    "view": _view_like, "_unsafe_view": _view_like, "reshape": _view_like, "squeeze": _squeeze,
    "unsqueeze": _unsqueeze, "expand": _expand, "permute": _permute, "transpose": _permute,
    "slice": _slice, "select": _select, "cat": _cat, "triu": _triangle(True), "tril": _triangle(False),
    "index": _index, "cumsum": _cumsum, "clamp": _clamp, "clamp_min": _clamp, "clamp_max": _clamp,
    "repeat": _repeat, "scatter": _scatter,
    "clone": _same, "contiguous": _same, "alias": _same, "lift_fresh_copy": _same, "detach": _same,
}


# ---- deciding formulas over the box of indices -------------------------------------------------------
@dataclass
class _Box:
    """Each index symbol's range [lo, hi] (sympy, in the size symbols), and each size symbol's
    lower bound."""

    ranges: dict
    lower: dict

    @staticmethod
    def of(shape: Sequence[Any], lower: dict) -> "_Box":
        ranges = {s: (sympy.Integer(0), size - 1) for s, size in zip(_IDX, shape)}
        return _Box(ranges, lower)

    def narrowed(self, symbol: Any, lo: Any = None, hi: Any = None) -> "_Box":
        ranges = dict(self.ranges)
        old_lo, old_hi = ranges.get(symbol, (-sympy.oo, sympy.oo))
        # a bound not provably tighter than the old one is left out (sound: the comparison that
        # gave it stays a part of its conjunction): a Max in a range would undecide every
        # comparison that reads it
        new_lo = _max(old_lo, lo, self.lower) if lo is not None else old_lo
        new_hi = _min(old_hi, hi, self.lower) if hi is not None else old_hi
        ranges[symbol] = (old_lo if _has_extremum(new_lo) else new_lo, old_hi if _has_extremum(new_hi) else new_hi)
        return _Box(ranges, self.lower)


def _has_extremum(expr: Any) -> bool:
    """A Min or Max in expr (sympy's, or torch's own of the same names)."""
    return any(type(e).__name__ in ("Min", "Max") for e in sympy.preorder_traversal(expr))


def _nonnegative(expr: Any, lower: dict) -> bool:
    """expr >= 0 for every value of its size symbols: written with each symbol as its least
    value plus a non-negative part, a polynomial whose every coefficient is >= 0."""
    expr = sympy.expand(expr)
    if expr.is_number:
        return bool(expr >= 0) if expr.is_comparable else False
    if expr.free_symbols & (set(_IDX) | set(_ROLE.values())):
        return False
    expr = _size_quotients_as_unknowns(expr)
    substitution = {s: lower.get(s, 0) + sympy.Dummy(f"u_{s}", nonnegative=True) for s in expr.free_symbols}
    poly = sympy.expand(expr.xreplace(substitution))
    if poly.is_number:
        return bool(poly >= 0)
    try:
        coefficients = sympy.Poly(poly, *poly.free_symbols).coeffs()
    except sympy.PolynomialError:
        return False
    return all(c.is_comparable and c >= 0 for c in coefficients) and poly.xreplace(
        {v: 0 for v in poly.free_symbols}) >= 0


def _size_quotients_as_unknowns(expr: Any) -> Any:
    """expr with each quotient of sizes by a positive integer (S // 4: torch's FloorDiv, or
    floor(S / 4)) as a fresh non-negative unknown: all _nonnegative needs of it (sizes are
    non-negative), so that S + S // 4 - S >= 0 is decided."""
    quotients = [q for q in expr.atoms(sympy.Function, sympy.floor)
                 if type(q).__name__ in ("FloorDiv", "floor") and not q.free_symbols & (set(_IDX) | set(_ROLE.values()))]
    mapping = {}
    for q in quotients:
        numerator, divisor = (q.args if type(q).__name__ == "FloorDiv" else sympy.fraction(sympy.together(q.args[0])))
        if divisor.is_Integer and divisor > 0 and all(s.is_nonnegative for s in numerator.free_symbols) \
                and _polynomial_nonnegative(numerator):
            mapping[q] = sympy.Dummy("quotient", nonnegative=True)
    return sympy.expand(expr.xreplace(mapping)) if mapping else expr


def _polynomial_nonnegative(expr: Any) -> bool:
    """A polynomial in non-negative sizes with non-negative coefficients."""
    try:
        return all(c >= 0 for c in sympy.Poly(sympy.expand(expr), *expr.free_symbols).coeffs()) if expr.free_symbols \
            else bool(expr >= 0)
    except sympy.PolynomialError:
        return False


def _max(a, b, lower):
    """The larger of two bounds where the sizes' ranges decide it, else sympy.Max."""
    if _nonnegative(a - b, lower):
        return a
    return b if _nonnegative(b - a, lower) else sympy.Max(a, b)


def _min(a, b, lower):
    return -_max(-a, -b, lower)


def _linear(expr: Any, box: _Box) -> Optional[tuple[dict, Any]]:
    """({index symbol: integer coefficient}, rest) of an expression linear in the box's
    indices, or None."""
    expr = _with_floor_atoms(sympy.expand(expr))
    coefficients = {}
    rest = expr
    for symbol in (*box.ranges, *(expr.free_symbols & _FLOOR_ATOM_SYMBOLS)):
        c = expr.coeff(symbol)
        if c != 0:
            if not c.is_Integer:
                return None
            coefficients[symbol] = int(c)
            rest = rest - c * symbol
    rest = sympy.expand(rest)
    if rest.free_symbols & (set(box.ranges) | _FLOOR_ATOM_SYMBOLS):
        return None
    return coefficients, rest


# floor(f / m) of the indices (DeepSeek-V4's block threshold (t + 1) // m): an integer the
# linear reasoning takes as one more unknown, the same symbol wherever the same floor occurs,
# of unknown range. So `w < floor((t + 1) / 4)` and `w >= floor((t + 1) / 4)` bound one linear
# form from both sides (_empty_linear_ranges), which is all a proof by this module asks of it
_FLOOR_ATOMS: dict = {}
_FLOOR_ATOM_SYMBOLS: set = set()


def _floor_atom_range(atom: Any, box: _Box) -> tuple:
    """The range of floor(a i + b) (a floor atom) over the box: floor is monotone, so with i's
    range [lo, hi] it is [floor(a lo + b), floor(a hi + b)] for a > 0 (the other way for a < 0);
    unbounded where the floor reads more than one index."""
    inner = next((f.args[0] for f, symbol in _FLOOR_ATOMS.items() if symbol is atom), None)
    if inner is None:
        return -sympy.oo, sympy.oo
    indices = [s for s in inner.free_symbols if s in box.ranges]
    if len(indices) != 1:
        return -sympy.oo, sympy.oo
    (index,) = indices
    slope = sympy.expand(inner).coeff(index)
    if not slope.is_number or slope == 0 or sympy.expand(inner - slope * index).has(index):
        return -sympy.oo, sympy.oo
    lo, hi = box.ranges[index]
    ends = (sympy.floor(inner.xreplace({index: lo})), sympy.floor(inner.xreplace({index: hi})))
    return ends if slope > 0 else ends[::-1]


def _with_floor_atoms(expr: Any) -> Any:
    floors = [f for f in expr.atoms(sympy.floor) if f.free_symbols & (set(_IDX) | set(_ROLE.values()))]
    if not floors:
        return expr
    mapping = {}
    for f in floors:
        atom = _FLOOR_ATOMS.get(f)
        if atom is None:
            atom = _FLOOR_ATOMS[f] = sympy.Dummy("floor", integer=True)
            _FLOOR_ATOM_SYMBOLS.add(atom)
        mapping[f] = atom
    return sympy.expand(expr.xreplace(mapping))


def _bounds(coefficients: dict, rest: Any, box: _Box) -> tuple[Any, Any]:
    lo = hi = rest
    for symbol, c in coefficients.items():
        a, b = box.ranges[symbol] if symbol in box.ranges else _floor_atom_range(symbol, box)
        lo, hi = (lo + c * a, hi + c * b) if c > 0 else (lo + c * b, hi + c * a)
    return lo, hi


def _atom(rel: Any, box: _Box) -> Any:
    """A comparison as canonical  L + c <= 0  (L linear in the indices, integer coefficients),
    decided to True / False over the box where it can be."""
    lhs, rhs = rel.lhs, rel.rhs
    if any(x in (sympy.oo, -sympy.oo, sympy.zoo) for x in (lhs, rhs)):
        return rel.func(lhs, rhs)
    if isinstance(rel, (sympy.Eq, sympy.Ne)):
        d = lhs - rhs
        both = sympy.And(_le(d, box), _le(-d, box))
        return _simplify(both if isinstance(rel, sympy.Eq) else sympy.Not(both), box)
    if isinstance(rel, (sympy.Ge, sympy.Gt)):
        lhs, rhs = rhs, lhs
    d = lhs - rhs + (1 if isinstance(rel, (sympy.Lt, sympy.Gt)) else 0)
    return _le(d, box)


def _le(d: Any, box: _Box) -> Any:
    """d <= 0 (integers), decided where the box decides it. A Min or Max term is split into
    the comparisons it stands for (r + Max(a, b) <= 0 iff r + a <= 0 and r + b <= 0; r + Min(a, b)
    <= 0 iff either; a negated term the other way round): a window of Min(S, 128) slots, a
    clamp(t - 127, 0) start."""
    split = _split_min_max(sympy.expand(d))
    if split is not None:
        return _simplify(split, box)
    found = _linear(d, box)
    if found is None:
        return sympy.Le(sympy.expand(d), 0)
    coefficients, rest = found
    lo, hi = _bounds(coefficients, rest, box)
    if _nonnegative(-hi, box.lower):
        return sympy.true
    if _nonnegative(lo - 1, box.lower):
        return sympy.false
    return sympy.Le(sympy.expand(d), 0)


def _split_min_max(d: Any) -> Any:
    """d <= 0 with its first Min / Max term split (see _le), or None without one."""
    terms = sympy.Add.make_args(d)
    for term in terms:
        coefficient, extremum = term.as_coeff_Mul()
        kind = type(extremum).__name__  # (sympy's Min / Max, or torch's own: torch.utils._sympy.functions)
        if kind not in ("Min", "Max") or coefficient not in (1, -1):
            continue
        rest = sympy.expand(d - term)
        both = (kind == "Max") == (coefficient == 1)
        parts = [sympy.Le(sympy.expand(rest + coefficient * a), 0) for a in extremum.args]
        return sympy.And(*parts) if both else sympy.Or(*parts)
    return None


def _simplify(formula: Any, box: _Box, depth: int = 0) -> Any:
    if depth > 40:
        raise NotSymbolic("the formula is too deep")
    if formula in (sympy.true, sympy.false) or formula is True or formula is False:
        return sympy.true if formula in (sympy.true, True) else sympy.false
    if isinstance(formula, sympy.Piecewise):
        return _simplify(_piecewise_bool(formula), box, depth + 1)
    if isinstance(formula, sympy.ITE):  # sympy's own spelling of a piecewise boolean
        c, a, b = formula.args
        return _simplify(sympy.Or(sympy.And(c, a), sympy.And(sympy.Not(c), b)), box, depth + 1)
    if isinstance(formula, sympy.Not):
        inner = _simplify(formula.args[0], box, depth + 1)
        if inner in (sympy.true, sympy.false):
            return sympy.false if inner == sympy.true else sympy.true
        if isinstance(inner, sympy.Le):  # not (d <= 0) is -d + 1 <= 0 over the integers
            return _le(-inner.lhs + 1, box)
        if isinstance(inner, sympy.And):
            return _simplify(sympy.Or(*[sympy.Not(a) for a in inner.args]), box, depth + 1)
        if isinstance(inner, sympy.Or):
            return _simplify(sympy.And(*[sympy.Not(a) for a in inner.args]), box, depth + 1)
        raise NotSymbolic(f"a negation of {inner}")
    if isinstance(formula, sympy.Or):
        parts, undecided = [], None
        for a in formula.args:  # (a part this module cannot read does not matter beside a true one)
            try:
                parts.append(_simplify(a, box, depth + 1))
            except NotSymbolic as exc:
                undecided = exc
        if any(p == sympy.true for p in parts):
            return sympy.true
        if undecided is not None:
            raise undecided
        parts = [p for p in parts if p != sympy.false]
        return sympy.Or(*parts) if parts else sympy.false
    if isinstance(formula, sympy.And):
        return _conjunction(list(formula.args), box, depth)
    if isinstance(formula, sympy.core.relational.Relational):
        lhs, rhs = formula.lhs, formula.rhs
        if isinstance(lhs, sympy.Piecewise) or isinstance(rhs, sympy.Piecewise):
            return _simplify(_piecewise_bool(_relation(formula.func, lhs, rhs)), box, depth + 1)
        return _atom(formula, box)
    if isinstance(formula, sympy.Basic) and formula.is_number:
        return sympy.true if formula != 0 else sympy.false
    raise NotSymbolic(f"a formula {formula}")


def _conjunction(parts: list, box: _Box, depth: int) -> Any:
    """And of parts: narrow the box with one-index bounds, intersect the ranges of each
    linear form, substitute fixed indices, distribute over a small Or."""
    initial = box
    for _ in range(8):
        simplified, undecided = [], None
        for p in parts:
            try:
                s = _simplify(p, box, depth + 1)
            except NotSymbolic as exc:  # (a part this module cannot read does not matter beside a false one)
                undecided = exc
                continue
            if s == sympy.false:
                return sympy.false
            if s != sympy.true:
                simplified += list(s.args) if isinstance(s, sympy.And) else [s]
        if undecided is not None:
            raise undecided
        narrowed = box
        for p in simplified:
            bound = _one_index_bound(p, narrowed)
            if bound is not None:
                narrowed = narrowed.narrowed(*bound)
                lo, hi = narrowed.ranges[bound[0]]
                if _nonnegative(lo - hi - 1, box.lower):
                    return sympy.false
        for p in simplified:
            narrowed = _difference_narrowed(p, narrowed)
            if narrowed is None:
                return sympy.false
        if _empty_linear_ranges(simplified, narrowed):
            return sympy.false
        fixed = {s: lo for s, (lo, hi) in narrowed.ranges.items() if sympy.expand(hi - lo) == 0}
        if fixed and any(p.has(*fixed) for p in simplified):
            simplified = [p.xreplace(fixed) for p in simplified]
        elif narrowed.ranges == box.ranges:
            parts = simplified
            break
        box, parts = narrowed, simplified
    if not parts:
        found = sympy.true
    else:
        ors = [p for p in parts if isinstance(p, sympy.Or)]
        if ors and len(ors[0].args) <= 8:
            rest = [p for p in parts if p is not ors[0]]
            found = _simplify(sympy.Or(*[sympy.And(a, *rest) for a in ors[0].args]), box, depth + 1)
        else:
            found = sympy.And(*parts)
    if found == sympy.false:
        return found
    # an undecided (or true) answer holds in the narrowed box only: the ranges the parts narrowed
    # go with it, so that a caller in the wider box (a negation, a disjunction) reads the same set
    return sympy.And(found, *_narrowed_ranges(initial, box))


def _narrowed_ranges(initial: _Box, box: _Box) -> list:
    """The comparisons that narrow `initial`'s index ranges to `box`'s."""
    bounds = []
    for symbol, (lo, hi) in box.ranges.items():
        old_lo, old_hi = initial.ranges.get(symbol, (None, None))
        if lo != old_lo and lo != -sympy.oo:
            bounds.append(sympy.Le(lo - symbol, 0))
        if hi != old_hi and hi != sympy.oo:
            bounds.append(sympy.Le(symbol - hi, 0))
    return bounds


def _one_index_bound(part: Any, box: _Box) -> Optional[tuple]:
    if not isinstance(part, sympy.Le) or part.rhs != 0:
        return None
    found = _linear(part.lhs, box)
    if found is None or len(found[0]) != 1:
        return None
    (symbol, c), = found[0].items()
    rest = found[1]
    if abs(c) != 1 and not rest.is_number:
        return None  # (a bound floor(-r / c) of a symbolic r: not a polynomial to compare)
    if c > 0:  # c i + r <= 0: i <= floor(-r / c)
        return symbol, None, -rest if c == 1 else sympy.floor(-rest / c)
    return symbol, rest if c == -1 else sympy.ceiling(rest / -c), None


def _difference_narrowed(part: Any, box: _Box) -> Optional[_Box]:
    """The box narrowed by a bound on the difference of two indices, x - y + c <= 0 (key j <= query
    t): x <= hi(y) - c and y >= lo(x) + c, where that is provably tighter (a bound that is not
    is left out: a Max in a bound would undecide the comparisons that read it); None if the
    range it leaves is empty."""
    if not isinstance(part, sympy.Le) or part.rhs != 0:
        return box
    found = _linear(part.lhs, box)
    if found is None or len(found[0]) != 2 or sorted(found[0].values()) != [-1, 1]:
        return box
    x, y = sorted(found[0], key=lambda symbol: -found[0][symbol])
    if x not in box.ranges or y not in box.ranges:
        return box
    c = found[1]
    ranges = dict(box.ranges)
    (x_lo, x_hi), (y_lo, y_hi) = ranges[x], ranges[y]
    if _nonnegative(x_hi - (y_hi - c) - 1, box.lower):
        x_hi = y_hi - c
    if _nonnegative(x_lo + c - y_lo - 1, box.lower):
        y_lo = x_lo + c
    if _nonnegative(x_lo - x_hi - 1, box.lower) or _nonnegative(y_lo - y_hi - 1, box.lower):
        return None
    ranges[x], ranges[y] = (x_lo, x_hi), (y_lo, y_hi)
    return _Box(ranges, box.lower)


def _empty_linear_ranges(parts: list, box: _Box) -> bool:
    """Two comparisons bound one linear form of the indices from both sides with nothing between."""
    bounds: dict = {}
    for p in parts:
        if not isinstance(p, sympy.Le) or p.rhs != 0:
            continue
        found = _linear(p.lhs, box)
        if found is None or len(found[0]) < 2:
            continue
        coefficients, rest = found
        sign = 1 if next(iter(sorted(coefficients.items(), key=lambda kv: kv[0].name)))[1] > 0 else -1
        key = tuple(sorted((s.name, sign * c) for s, c in coefficients.items()))
        hi_or_lo = bounds.setdefault(key, [[], []])
        # sign 1: form <= -rest ; sign -1: form >= rest
        (hi_or_lo[0] if sign > 0 else hi_or_lo[1]).append(-rest if sign > 0 else rest)
    for his, los in bounds.values():
        for hi in his:
            for lo in los:
                if _nonnegative(lo - hi - 1, box.lower):
                    return True
    return False


def _decide_value(expr: Any, box: _Box) -> Optional[Any]:
    """A numeric formula with its pieces decided over the box (one piece left), or None."""
    if isinstance(expr, sympy.Piecewise):
        for value, cond in expr.args:
            decided = _simplify(cond, box)
            if decided == sympy.true:
                return _decide_value(value, box)
            if decided != sympy.false:
                return None
        return None
    if isinstance(expr, sympy.logic.boolalg.Boolean):
        decided = _simplify(expr, box)
        return sympy.Integer(1) if decided == sympy.true else sympy.Integer(0) if decided == sympy.false else None
    return expr


# ---- masks ---------------------------------------------------------------------------------------------
def symbolic_mask_mode(terms: Sequence[Any], queries: Any, keys: Any) -> tuple[Optional[str], str]:
    """constants.mask_mode for masks computed from symbolic sizes only: (mode, why)."""
    try:
        return _symbolic_mask_mode(terms, queries, keys)
    except Exception as exc:  # noqa: BLE001 - sympy failing on a formula (oo in a Float op) proves nothing
        return None, f"the attention mask could not be decided symbolically ({type(exc).__name__}: {exc})"


def _symbolic_mask_mode(terms: Sequence[Any], queries: Any, keys: Any) -> tuple[Optional[str], str]:
    try:
        hidden = _hidden_formula(terms, _shape_env_lower_bounds(terms))
    except NotSymbolic as exc:
        return None, (f"the attention mask cannot be proven causal at compile time: it is computed from graph inputs "
                      f"or in a way the symbolic proof does not follow ({exc})")
    S, T = _size(queries), _size(keys)
    lower = _shape_env_lower_bounds(terms)
    ranges = {_ROLE["s"]: (sympy.Integer(0), S - 1), _ROLE["t"]: (sympy.Integer(0), T - 1)}
    batch = next((_meta_shape(t.node)[d] for t in terms for d, role in enumerate(t.roles) if role == "b"), None)
    if batch is not None:
        ranges[_ROLE["b"]] = (sympy.Integer(0), batch - 1)
    box = _Box(ranges, lower)
    visible = sympy.Not(hidden)
    causal = sympy.Le(_ROLE["t"] - _ROLE["s"] - (T - S), 0)
    try:
        if _simplify(hidden, box) == sympy.false:
            return "none", "the attention mask masks nothing (proven for every size)"
        if (_simplify(sympy.And(visible, sympy.Not(causal)), box) == sympy.false
                and _simplify(sympy.And(causal, sympy.Not(visible)), box) == sympy.false):
            return "causal", "the attention mask is right-down causal (proven for every size)"
    except NotSymbolic as exc:
        return None, f"the attention mask could not be decided symbolically ({exc})"
    return None, ("the attention mask is neither right-down causal nor empty for every size (padding, a window, "
                  "or a mask this proof cannot decide)")


def _hidden_formula(terms: Sequence[Any], lower: dict) -> Any:
    ev = _Evaluation(lower)
    parts = []
    for term in terms:
        value = ev.value(term.node)
        if not isinstance(value, Formula):
            raise NotSymbolic("a mask that is not a tensor")
        mapping = {}
        for d, role in enumerate(term.roles):  # (a proof over the batch's index holds for every batch)
            mapping[_IDX[d]] = _ROLE[role] if role is not None else sympy.Integer(0)
        expr = value.expr.xreplace(mapping)
        if term.hides == "true":
            parts.append(_as_bool(expr))
        elif term.hides == "false":
            parts.append(sympy.Not(_as_bool(expr)))
        else:
            parts.append(_as_bool(expr))  # an additive mask: hidden where not 0
    return sympy.Or(*parts)


def symbolic_compressed_ratio(terms: Sequence[Any], candidate: int) -> tuple[Optional[int], str]:
    """(candidate, why) where the terms hide exactly the keys t >= (s + 1) // candidate of query s
    (DeepSeek-V4's compressed causal mask) for every size, else (None, why not). The proof is an
    identity of formulas: the mask's hidden formula, over the query and key index symbols, is
    (after sympy's canonical form) `t >= floor((s + 1) / candidate)` itself; a mask spelled
    another way that hides the same keys is not proven (not proven, not fused)."""
    try:
        hidden = _hidden_formula(terms, _shape_env_lower_bounds(terms))
    except NotSymbolic as exc:
        return None, (f"the compressed mask cannot be proven at compile time: it is computed from graph inputs or "
                      f"in a way the symbolic proof does not follow ({exc})")
    except Exception as exc:  # noqa: BLE001 - sympy failing on a formula proves nothing
        return None, f"the compressed mask could not be decided symbolically ({type(exc).__name__}: {exc})"
    expected = sympy.Ge(_ROLE["t"], sympy.floor((_ROLE["s"] + 1) / sympy.Integer(candidate)))
    alternatives = {expected, sympy.Le(sympy.floor((_ROLE["s"] + 1) / sympy.Integer(candidate)), _ROLE["t"]),
                    sympy.Not(sympy.Lt(_ROLE["t"], sympy.floor((_ROLE["s"] + 1) / sympy.Integer(candidate))))}
    if hidden in alternatives:
        return candidate, f"the scores' mask hides the blocks t >= (s + 1) // {candidate} (proven for every size)"
    return None, (f"the scores' mask is not proven to hide exactly the blocks t >= (s + 1) // {candidate} for every "
                  f"size (its hidden formula: {hidden})")


def _shape_env_lower_bounds(terms: Sequence[Any]) -> dict:
    for term in terms:
        value = term.node.meta.get("val")
        for size in getattr(value, "shape", ()):
            if isinstance(size, torch.SymInt):
                env = size.node.shape_env
                return {s: int(r.lower) if r.lower.is_finite else 0 for s, r in env.var_to_range.items()}
    return {}


# ---- masks with one data-dependent leaf of two values -----------------------------------------------------
class _Bounds:
    """What _shape_env_lower_bounds reads of a mask term: its node."""

    def __init__(self, node: Node):
        self.node = node


def mask_mode_with_leaf(mask: Node, roles: Sequence[Optional[str]], leaf: Node, leaf_value: Any,
                        queries: Any, keys: Any) -> tuple[Optional[str], str]:
    """(mode, why) of the bool `mask` (True: the key is visible) were every element of the
    tensor `leaf` `leaf_value`: "all" (it hides every key), "none" (it hides none), "causal"
    (right-down: query i of S sees key j <= i + T - S), or None with why not. `roles`: per
    dim of the mask, "b", "s", "t" or None (as MaskTerm's).

    A mask built elementwise from one data-dependent tensor that takes only two values (a
    scatter of a constant into a constant fill) is decided by two such calls, one per value,
    for every size: the caller proves the leaf's elements reach the mask by broadcasting
    alone (no permute), so that the mask's (b, s, t) reads the leaf's (b, s, t)."""
    try:
        lower = _shape_env_lower_bounds([_Bounds(mask), _Bounds(leaf)])
        ev = _Evaluation(lower)
        ev.values[leaf] = Formula(_meta_shape(leaf), ev.value(leaf_value))
        value = ev.value(mask)
        if not isinstance(value, Formula):
            return None, "the mask is not a tensor"
        mapping = {_IDX[d]: _ROLE[role] if role is not None else sympy.Integer(0) for d, role in enumerate(roles)}
        visible = _as_bool(value.expr.xreplace(mapping))
        S, T = _size(queries), _size(keys)
        ranges = {_ROLE["s"]: (sympy.Integer(0), S - 1), _ROLE["t"]: (sympy.Integer(0), T - 1)}
        if "b" in roles:
            ranges[_ROLE["b"]] = (sympy.Integer(0), _meta_shape(mask)[list(roles).index("b")] - 1)
        box = _Box(ranges, lower)
        if _simplify(visible, box) == sympy.true:
            return "none", "it hides no key"
        if _simplify(visible, box) == sympy.false:
            return "all", "it hides every key"
        causal = sympy.Le(_ROLE["t"] - _ROLE["s"] - (T - S), 0)
        if (_simplify(sympy.And(visible, sympy.Not(causal)), box) == sympy.false
                and _simplify(sympy.And(causal, sympy.Not(visible)), box) == sympy.false):
            return "causal", "it is right-down causal"
    except NotSymbolic as exc:
        return None, f"it cannot be evaluated symbolically ({exc})"
    except Exception as exc:  # noqa: BLE001 - sympy failing on a formula proves nothing
        return None, f"it could not be decided ({type(exc).__name__}: {exc})"
    return None, "it is neither right-down causal, empty nor full for every size"


def formula_of(node: Node, shape: Sequence[Any]) -> Any:
    """The value of a tensor node computed from sizes only, as a sympy formula over the
    indices of `shape` (broadcast to it; sizes of the graph's shape env), or None."""
    try:
        lower = _shape_env_lower_bounds([_Bounds(node)])
        value = _Evaluation(lower).value(node)
        if not isinstance(value, Formula):
            return value
        return _broadcast(value, tuple(_size(s) for s in shape))
    except Exception:  # noqa: BLE001 - not a formula: not proven
        return None


def never(formula: Any, shape: Sequence[Any], node: Node) -> bool:
    """The bool `formula` over the indices of `shape` (index_symbol(d) for dim d) is False at
    every index and for every size the shape env of `node` allows: a proof, not a sample.
    Anything not decided (a formula this module cannot read) is not proven."""
    try:
        box = _Box.of(tuple(_size(s) for s in shape), _shape_env_lower_bounds([_Bounds(node)]))
        return _simplify(formula, box) == sympy.false
    except Exception:  # noqa: BLE001 - sympy failing on a formula proves nothing
        return False


def index_list_members(node: Node) -> Any:
    """For an index list `node` computed from sizes only (its last dim the slots), the bool
    formula over (its leading dims' indices, then a key j) of "some slot of the row
    holds j" (what a scatter of the list into `keys` columns opens), or None."""
    try:
        lower = _shape_env_lower_bounds([_Bounds(node)])
        value = _Evaluation(lower).value(node)
        if not isinstance(value, Formula):
            return None
        return listed(value, value.shape[-1], len(value.shape))
    except Exception:  # noqa: BLE001 - not a formula: not proven
        return None


def index_symbol(dim: int) -> Any:
    """The symbol formula_of names a shape's dim `dim` by."""
    return _IDX[dim]


def decided_nonnegative(expr: Any, node: Node) -> bool:
    """expr >= 0 for every size the shape env of `node` allows (no index symbols)."""
    return _nonnegative(expr, _shape_env_lower_bounds([_Bounds(node)]))


def size_expr(size: Any) -> Any:
    """A size (int or SymInt) as the sympy expression the formulas above use."""
    return _size(size)
