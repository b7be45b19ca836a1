"""Equal computations, however they are spelled: what a pattern accepts besides its own trace.

Model code writes one computation in many ways: `cos * x` or `x * cos`, `rsqrt(v)` or
`v ** -0.5`, `x * rsqrt(v)` or `x / sqrt(v)`, `silu(g)` or `g * sigmoid(g)`, `x ** 2` or
`x * x`, `mean(x)` or `sum(x) / n`. Rather than a form per spelling, every pattern
(structural and exact, registry.py and accept.py) is rewritten so that each of its nodes
accepts every spelling of what that node computes (`respell`). The graph itself is not
changed: code that no pattern matches keeps its own spelling and computes exactly what it
did; a region that matches is replaced by the fused op, which computes the same math in
one rounding (as it does for the pattern's own spelling).

Spellings that are the same computation bit for bit (an eps added with add.Scalar or
add.Tensor) are instead written one way in the graph and the traces (canonical.py).

The classes here extend torch's pattern matcher:
- `Commutative`: mul.Tensor / add.Tensor with its two operands in either order;
- `AnyOf`: one value, in any of several spellings (the first that matches);
- `SumOverCount`: `sum(x, dims, keepdim) / n` where n is the number of elements summed.
"""
from __future__ import annotations

import copy
import math
import threading
from typing import Any, Callable, Optional

import torch
from torch._inductor import pattern_matcher as pm

from .nodes import known_equal

aten = torch.ops.aten
Node = torch.fx.Node


class Commutative(pm.CallFunction):
    """A call of a commutative op of two tensors, matched with its operands in either order.

    IEEE addition and multiplication are commutative, so `a * b` and `b * a` are one value.
    An order is tried only where each operand's op can be what the pattern has there
    (`arguments_may_match`), and the second only when the first fails, with the bindings of
    the failed attempt undone (torch's MatchContext keeps what each sub-pattern matched)."""

    def _match(self, node: Node, ctx: pm.MatchContext) -> pm.MatchResult:
        if len(self.args) != 2 or not isinstance(node, Node):
            return super()._match(node, ctx)
        orders = [crossed for crossed in (False, True) if arguments_may_match(self, node.args, crossed)]
        if not orders:  # the operands' own ops rule both orders out: no match of their subtrees needed
            return pm.FailedMatch("function_mismatch: operands {} cannot be {}", node.args, self.args)
        if (id(self), node) in _attempt.flipped:
            orders.reverse()
        saved = len(ctx.pattern_to_node)
        first: Optional[pm.MatchResult] = None
        for crossed in orders:
            found = self._match_in_order(node, ctx, crossed)
            if found:
                if crossed is orders[0] and len(orders) == 2 and _attempt.choices is not None:
                    # the other order was possible too: if the whole match fails, match() tries it
                    _attempt.choices.append((id(self), node))
                return found
            _undo_bindings(ctx, saved)
            first = first if first is not None else found
        return first

    def _match_in_order(self, node: Node, ctx: pm.MatchContext, crossed: bool) -> pm.MatchResult:
        if not crossed:
            return super()._match(node, ctx)
        args, flat = self.args, self.flat_args_kwargs
        self.args = (args[1], args[0])
        self.flat_args_kwargs = self.flatten(self.args, self.kwargs)
        try:
            return super()._match(node, ctx)
        finally:
            self.args, self.flat_args_kwargs = args, flat


class _Attempt(threading.local):
    """The operand orders of one match attempt (match()): the commutative calls whose second
    order goes first (flipped), and where an order was chosen that another could replace."""

    flipped: frozenset = frozenset()
    choices: Optional[list] = None


_attempt = _Attempt()
# how many single flips match() tries after a failed match (each a whole match again)
_RETRIES = 4


def match(pattern: Any, node: Node) -> pm.MatchResult:
    """pattern.match(node), with the operand orders of its commutative calls chosen jointly.

    Commutative picks an order locally, the first whose subtrees match; a later sibling can
    then fail for it: in `cos * q + sin * rotate_half(q)`, the first product matches the
    pattern's `x * cos` with x = cos, and the second then cannot bind x to q. So a failed
    match is tried again with one such choice flipped at a time (up to _RETRIES; a match that
    needs two flipped together stays a miss, and gets its near miss)."""
    if _attempt.choices is not None:  # nested in another match: its caller decides
        return pattern.match(node)
    choices: list = []
    _attempt.choices = choices
    try:
        found = pattern.match(node)
    finally:
        _attempt.choices = None
    if found:
        return found
    try:
        for choice in choices[:_RETRIES]:
            _attempt.flipped, _attempt.choices = frozenset([choice]), []  # (not recorded again)
            again = pattern.match(node)
            if again:
                return again
    finally:
        _attempt.flipped, _attempt.choices = frozenset(), None
    return found


def op_may_match(pattern: Any, node: Any) -> bool:
    """False when `pattern` cannot match `node` by its op alone (a call pattern of other
    targets, or a non-node for a call); True when it may (and for patterns that match any
    value: arguments, ignored values, literals the match compares)."""
    if isinstance(pattern, AnyOf):
        return any(op_may_match(alternative, node) for alternative in pattern.alternatives)
    if isinstance(pattern, pm._TargetExpr):  # noqa: SLF001 - CallFunction and its kin
        return pattern._match_fns(node)  # noqa: SLF001
    return True


def arguments_may_match(pattern: Any, args: Any, crossed: bool = False) -> bool:
    """A necessary condition for a call pattern's positional arguments to match `args`, one
    level down (each argument's op), checked without matching their subtrees; `crossed`:
    the two arguments of a commutative call swapped. True where it cannot tell (keyword
    arguments the matcher normalises, another argument count: the match decides)."""
    if not isinstance(pattern, pm._TargetArgsExpr) or pattern.kwargs or len(args) != len(pattern.args):  # noqa: SLF001
        return True
    expected = pattern.args[::-1] if crossed else pattern.args
    return all(op_may_match(p, a) for p, a in zip(expected, args))


def may_match(pattern: pm.PatternExpr, node: Node) -> bool:
    """A necessary condition for `pattern` (its first output, for a multi-output one) to
    match at `node`: its op, its arguments' ops (in either order for a commutative call)
    and, below a single-output pattern's root, their user counts. The matcher tries every
    registration at every node of an anchor op; most fail one level down, after torch's
    matcher has matched every argument before the one that differs."""
    return prefilter(pattern)(node)


def prefilter(pattern: pm.PatternExpr) -> Callable[[Any], bool]:
    """may_match(pattern, ·), compiled once per pattern into set lookups (it runs thousands
    of times per graph); patterns that test the same (a form's dtype variants) share one
    function, so a caller can test a node once for all of them."""
    check = _PREFILTERS.get(pattern)
    if check is None:
        tests = _prefilter_tests(pattern)
        check = _PREFILTERS[pattern] = _BY_TESTS.setdefault(tests, _compiled(tests))
    return check


_PREFILTERS: dict = {}  # pattern -> its may_match
_BY_TESTS: dict = {}  # what a prefilter tests -> the one function testing it


def _prefilter_tests(pattern: pm.PatternExpr) -> Optional[tuple]:
    """What may_match tests, hashable: per alternative of the root, (op, targets, per
    operand order the argument tests); None where it cannot tell."""
    # below the root of a single-output pattern every call must have its user count
    # (torch's _match_users); a multi-output pattern's other outputs may sit there, with any
    single_output = not isinstance(pattern, pm.MultiOutputPattern)
    roots = _calls(pattern if single_output else pattern.outputs[0])
    if roots is None:
        return None
    alternatives = []
    for root in roots:
        orders = [_argument_tests(root, False, single_output)]
        if isinstance(root, Commutative):
            orders.append(_argument_tests(root, True, single_output))
        alternatives.append((root.op, frozenset(root.fns_set), tuple(orders)))
    return tuple(alternatives)


def _compiled(alternatives: Optional[tuple]) -> Callable[[Any], bool]:
    if alternatives is None:
        return lambda node: True
    alternatives = [(op, fns, [None if order is None else [_argument_check(test) for test in order]
                               for order in orders]) for op, fns, orders in alternatives]

    def check(node: Any) -> bool:
        if not isinstance(node, Node):
            return False
        target = pm.extract_target(node)
        for op, fns, orders in alternatives:
            if node.op == op and target in fns and any(
                    order is None or len(order) != len(node.args)
                    or all(argument is None or argument(arg) for argument, arg in zip(order, node.args))
                    for order in orders):
                return True
        return False

    return check


def _argument_check(test: Optional[tuple]) -> Optional[Callable[[Any], bool]]:
    if test is None:
        return None
    users, ops = test

    def argument(arg: Any) -> bool:
        if not isinstance(arg, Node) or (users is not None and len(arg.users) != users):
            return False
        target = pm.extract_target(arg)
        return any(arg.op == op and target in fns for op, fns in ops)

    return argument


def _calls(pattern: Any) -> Optional[list]:
    """The call patterns that `pattern` is one of, through AnyOf; None when it also
    matches what no call pattern does (an argument, a literal)."""
    if isinstance(pattern, AnyOf):
        calls = [_calls(alternative) for alternative in pattern.alternatives]
        if any(c is None for c in calls):
            return None
        return [call for alternatives in calls for call in alternatives]
    if isinstance(pattern, pm._TargetExpr):  # noqa: SLF001 - CallFunction and its kin
        return [pattern]
    return None


def ops_present(nodes: Any) -> set:
    """The (op, target) of each of `nodes` (a graph's), as torch's matcher reads a node
    (pm.extract_target: a module call by its module's class): what may_occur reads."""
    return {(node.op, pm.extract_target(node) if node.op == "call_module" else node.target) for node in nodes}


def may_occur(pattern: pm.PatternExpr, present: set) -> bool:
    """A necessary condition for `pattern` to match anywhere in a graph whose nodes'
    (op, target)s are `present`: every call it always holds (not one of an AnyOf's
    alternatives, not in a ListOf) has one of its targets there. A pass's patterns mostly
    spell ops a given graph lacks (a collective, a quantized matmul); torch's matcher would
    try each at every node of its anchor op."""
    required = _REQUIRED.get(pattern)
    if required is None:
        required = _REQUIRED[pattern] = frozenset(_required_calls(pattern))
    return all(not calls.isdisjoint(present) for calls in required)


_REQUIRED: dict = {}  # pattern -> the (op, target) alternatives of each call it always holds


def _required_calls(pattern: Any) -> set:
    """may_occur's calls of `pattern`, each sub-pattern visited once (a joint pattern shares
    its sub-patterns between the forward and the backward: walked as a tree, it is
    exponential in its depth)."""
    required, seen, pending = set(), set(), [pattern]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, pm.MultiOutputPattern):
            pending.extend(current.outputs)
        elif isinstance(current, pm._TargetArgsExpr):  # noqa: SLF001 - CallFunction and its kin
            required.add(frozenset((current.op, fn) for fn in current.fns_set))
            pending.extend(torch.utils._pytree.tree_leaves((current.args, current.kwargs)))  # noqa: SLF001
    return required


def _argument_tests(pattern: Any, crossed: bool, check_users: bool) -> Optional[tuple]:
    """Per positional argument of a call pattern, what the graph's argument one level down
    must be: (its user count or None, its (op, targets) alternatives), or None for any
    value; the two of a commutative call swapped if `crossed`. None where it cannot tell
    (keyword arguments the matcher normalises)."""
    if not isinstance(pattern, pm._TargetArgsExpr) or pattern.kwargs:  # noqa: SLF001
        return None
    tests: list = []
    for expected in (pattern.args[::-1] if crossed else pattern.args):
        calls = _calls(expected)
        if calls is None:
            tests.append(None)
            continue
        users = expected.users if check_users and isinstance(expected.users, int) else None
        tests.append((users, tuple((call.op, frozenset(call.fns_set)) for call in calls)))
    return tuple(tests)


def _undo_bindings(ctx: pm.MatchContext, saved: int) -> None:
    """Forget what a failed attempt bound: the bindings after the first `saved`.

    torch's MatchContext.match only ever adds a binding (pattern -> node, or None for a
    failure), and a dict pops its last-added item first, so this undoes exactly the attempt
    in the time it bound, not a copy of every binding so far per attempt (which made a
    joint pattern's exact match quadratic in its size: a second of a training step)."""
    bindings = ctx.pattern_to_node
    while len(bindings) > saved:
        bindings.popitem()


class AnyOf(pm.PatternExpr):
    """One value, spelled any of several ways: matches where one of `alternatives` does.

    The alternatives' own user counts are not checked (they are MULTIPLE): this node's
    `users` is, as a CallFunction checks its own (an output of the pattern may have any).
    """

    def __init__(self, alternatives: list[pm.PatternExpr], users: Any = 1):
        super().__init__()
        self.alternatives = alternatives
        self.users = users

    def _match(self, node: Node, ctx: pm.MatchContext) -> pm.MatchResult:
        if not isinstance(node, Node):
            return pm.FailedMatch("not a node: {}", node)
        if not (self in ctx.outputs or self.users is pm.MULTIPLE or len(node.users) == self.users):
            return pm.FailedMatch("multiple_users {}", self)
        saved = len(ctx.pattern_to_node)
        failure: Optional[pm.MatchResult] = None
        for alternative in self.alternatives:
            found = ctx.match(alternative, node)
            if found:
                return found
            failure = failure if failure is not None else found  # the pattern's own spelling's
            _undo_bindings(ctx, saved)
        return failure

    def has_multiple_users(self) -> bool:
        return self.users is pm.MULTIPLE or self.users > 1

    def find_anchor_nodes(self, ctx: pm.MatchContext, searched: Any):
        if self in ctx.pattern_to_node:
            yield ctx.pattern_to_node[self]
            return
        for alternative in self.alternatives:
            yield from alternative.find_anchor_nodes(ctx, searched)

    def pattern_eq(self, other: Any) -> bool:
        return (super().pattern_eq(other) and len(self.alternatives) == len(other.alternatives)
                and all(a.pattern_eq(b) for a, b in zip(self.alternatives, other.alternatives)))

    def __repr__(self) -> str:
        return f"AnyOf({self.alternatives!r})"


def sum_over_count(node: Any) -> Optional[tuple[Any, Any]]:
    """(n, the number of elements each sum adds) of a node `sum(x, dims, keepdim) / n`, n a
    number (a Python one, or a symbolic size the graph computes: `/ x.shape[-1]` under
    dynamic shapes); None for any other node. The count is a SymInt where x's summed sizes
    are symbolic: the mean only where the shape environment proves it equal to n
    (nodes.known_equal), which it does not for a model's literal n under dynamic=True."""
    if not (isinstance(node, Node) and node.target is aten.div.Tensor and len(node.args) == 2 and not node.kwargs):
        return None
    total, count = node.args
    if isinstance(count, Node):
        count = count.meta.get("val")
    if not (isinstance(total, Node) and total.target is aten.sum.dim_IntList and total.args
            and isinstance(count, (int, float, torch.SymInt)) and not isinstance(count, bool)):
        return None
    values = total.args[0].meta.get("val") if isinstance(total.args[0], Node) else None
    if not isinstance(values, torch.Tensor):
        return None
    dims = total.args[1] if len(total.args) > 1 else None
    summed = dims if dims else range(values.dim())  # (no dims, or [], sums every one)
    return count, math.prod(values.shape[d] for d in summed)


class SumOverCount(pm._TargetExpr):  # noqa: SLF001 - a call_function pattern, as CallFunction is
    """`sum(x, dims, keepdim) / n`, n the number of elements each sum adds: a mean.

    Matches a div.Tensor node whose divisor is provably that count (sum_over_count,
    nodes.known_equal), binding `x` as `source` does."""

    op = "call_function"

    def __init__(self, source: Any, dims: Any, keepdim: Any, users: Any = 1):
        super().__init__(aten.div.Tensor, users)
        self.total = pm.CallFunction(aten.sum.dim_IntList, source, dims, keepdim)

    def _match(self, node: Node, ctx: pm.MatchContext) -> pm.MatchResult:
        if not self._match_fns(node) or len(node.args) != 2 or node.kwargs:
            return pm.FailedMatch("not a division: {}", node)
        if not self._match_users(node, ctx):
            return pm.FailedMatch("multiple_users {}", self)
        counted = sum_over_count(node)
        if counted is None:
            return pm.FailedMatch("no count of summed elements at {}", node)
        count, elements = counted
        if not known_equal(count, elements):
            return pm.FailedMatch("{} divides a sum of {} elements by {}", node, elements, count)
        found = ctx.match(self.total, node.args[0])
        if not found:
            return found
        match = pm.Match(ctx, self)
        match.extend(found)
        match.nodes.append(node)
        return match

    def find_anchor_nodes(self, ctx: pm.MatchContext, searched: Any):
        if self in ctx.pattern_to_node:
            yield ctx.pattern_to_node[self]
            return
        for total in self.total.find_anchor_nodes(ctx, searched):
            if isinstance(total, Node):
                for user in total.users:
                    if user not in searched and self._match_fns(user):
                        searched.add(user)
                        yield user

    def pattern_eq(self, other: Any) -> bool:
        return super().pattern_eq(other) and self.total.pattern_eq(other.total)


# ---- the spellings of each op ----------------------------------------------------------------
# Each takes the pattern node as traced and its arguments already respelled, and returns
# the other spellings of its value (their own user counts unchecked: AnyOf checks the
# node's). A rule that needs a child's structure reads the traced node's arguments.
def _call(target: Any, *args: Any, users: Any = pm.MULTIPLE) -> pm.CallFunction:
    return pm.CallFunction(target, *args, _users=users)


def _one_user(pattern: Any, *targets: Any) -> bool:
    return isinstance(pattern, pm.CallFunction) and pattern.users == 1 and pattern.fns in ([t] for t in targets)


def _rsqrt_spellings(value: Any) -> list:
    """rsqrt(v) as v ** -0.5 and as 1 / sqrt(v)."""
    return [_call(aten.pow.Tensor_Scalar, value, -0.5),
            _call(aten.reciprocal.default, _call(aten.sqrt.default, value, users=1))]


def _rsqrt(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    return _rsqrt_spellings(args[0])


def _mul(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    """a * rsqrt(v) == a / sqrt(v) == a / v ** 0.5 (either operand order); x * x == x ** 2."""
    alternatives = []
    for kept, other in ((args[0], traced.args[1]), (args[1], traced.args[0])):
        if _one_user(other, aten.rsqrt.default):
            value = respelled(other.args[0])
            alternatives += [_call(aten.div.Tensor, kept, _call(aten.sqrt.default, value, users=1)),
                             _call(aten.div.Tensor, kept, _call(aten.pow.Tensor_Scalar, value, 0.5, users=1))]
            break
    if traced.args[0] is traced.args[1]:
        alternatives.append(_call(aten.pow.Tensor_Scalar, args[0], 2))
    return alternatives


def _div(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    """a / sqrt(v) == a * rsqrt(v) (either order)."""
    denominator = traced.args[1]
    if _one_user(denominator, aten.sqrt.default) or (
            _one_user(denominator, aten.pow.Tensor_Scalar) and denominator.args[1:] == (0.5,)):
        value = respelled(denominator.args[0])
        return [Commutative(aten.mul.Tensor, args[0], AnyOf([_call(aten.rsqrt.default, value),
                                                             *_rsqrt_spellings(value)]), _users=pm.MULTIPLE)]
    return []


def _pow(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    """v ** -0.5 == rsqrt(v) == 1 / sqrt(v); x ** 2 == x * x; v ** 0.5 == sqrt(v)."""
    value, exponent = args
    if exponent == -0.5:
        return [_call(aten.rsqrt.default, value),
                _call(aten.reciprocal.default, _call(aten.sqrt.default, value, users=1))]
    if exponent == 2 or isinstance(exponent, pm.Ignored):
        # (a structural pattern ignores ints, fx_to_pattern's ignore_types: the exact match,
        # which keeps them, tells x ** 2 from x ** 3)
        return [_call(aten.mul.Tensor, value, value)]
    if exponent == 0.5:
        return [_call(aten.sqrt.default, value)]
    return []


def _sqrt(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    return [_call(aten.pow.Tensor_Scalar, args[0], 0.5)]


def _silu(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    """silu(x) == x * sigmoid(x) (either order). x is read twice there (by the sigmoid and
    the product) where silu(x) reads it once: one more user than the trace counted."""
    (value,) = args
    value = _with_one_more_user(value)
    return [Commutative(aten.mul.Tensor, value, _call(aten.sigmoid.default, value, users=1), _users=pm.MULTIPLE)]


def _with_one_more_user(pattern: Any) -> Any:
    """`pattern`, for a spelling that reads its value once more than the traced one: a copy
    counting one user more (the pattern itself is shared with the traced spelling, whose
    count must stay exact). An input (KeywordArg) or a MULTIPLE count is taken as it is."""
    users = getattr(pattern, "users", None)
    if not isinstance(users, int) or isinstance(users, bool):
        return pattern
    widened = copy.copy(pattern)
    widened.users = users + 1
    return widened


def _mean(traced: pm.CallFunction, args: tuple, respelled: Callable) -> list:
    """mean(x, dims, keepdim) == sum(x, dims, keepdim) / n."""
    if len(args) != 3 or traced.kwargs:
        return []
    return [SumOverCount(*args, users=pm.MULTIPLE)]


_SPELLINGS: dict[Any, Callable[..., list]] = {
    aten.rsqrt.default: _rsqrt,
    aten.mul.Tensor: _mul,
    aten.div.Tensor: _div,
    aten.pow.Tensor_Scalar: _pow,
    aten.sqrt.default: _sqrt,
    aten.silu.default: _silu,
    aten.mean.dim: _mean,
}
_COMMUTATIVE = (aten.mul.Tensor, aten.add.Tensor)


def respell(pattern: pm.PatternExpr) -> list[pm.PatternExpr]:
    """`pattern` with each node accepting every spelling of its value; one pattern per
    spelling of the node a match starts from (a matcher starts from one op), the
    pattern's own spelling first. Shared sub-patterns stay shared."""
    memo: dict[int, Any] = {}

    def respelled(p: Any) -> Any:
        return _respelled(p, memo, respelled)

    if isinstance(pattern, pm.MultiOutputPattern):
        first, *rest = pattern.outputs
        rest = [respelled(p) if p is not None else None for p in rest]
        return [pm.MultiOutputPattern([root, *rest]) for root in _spellings_of_root(respelled(first))]
    return _spellings_of_root(respelled(pattern))


def _spellings_of_root(root: Any) -> list:
    if not isinstance(root, AnyOf):
        return [root]
    roots = []
    for alternative in root.alternatives:
        alternative.users = root.users  # a root is the match's output: any users, as before
        roots.append(alternative)
    return roots


def _respelled(pattern: Any, memo: dict, respelled: Callable) -> Any:
    if isinstance(pattern, (list, tuple)):
        return type(pattern)(respelled(p) for p in pattern)
    if type(pattern) is not pm.CallFunction:
        return pattern
    if id(pattern) in memo:
        return memo[id(pattern)]
    args = tuple(respelled(a) for a in pattern.args)
    kwargs = {k: respelled(v) for k, v in pattern.kwargs.items()}
    target = pattern.fns[0] if len(pattern.fns) == 1 else None
    own_class = Commutative if target in _COMMUTATIVE and not kwargs and len(args) == 2 else pm.CallFunction
    spelling = _SPELLINGS.get(target)
    alternatives = spelling(pattern, args, respelled) if spelling is not None else []
    own = own_class(pattern.fns, *args, _users=pm.MULTIPLE if alternatives else pattern.users, **kwargs)
    result = AnyOf([own, *alternatives], users=pattern.users) if alternatives else own
    memo[id(pattern)] = result
    return result


def respell_exact(pattern: pm.PatternExpr) -> pm.PatternExpr:
    """respell() for an exact pattern, matched at a known node: each spelling of its root
    is tried there in turn."""
    spellings = respell(pattern)
    return spellings[0] if len(spellings) == 1 else _FirstOf(spellings)


class _FirstOf:
    """An exact pattern whose root has several spellings, matched at one node."""

    def __init__(self, patterns: list):
        self.patterns = patterns

    def match(self, node: Node) -> pm.MatchResult:
        failure: Optional[pm.MatchResult] = None
        for pattern in self.patterns:
            found = match(pattern, node)
            if found:
                return found
            failure = failure if failure is not None else found
        return failure
