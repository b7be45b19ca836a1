"""Reading FX nodes: the small helpers every layer above (and the pattern checks) use.

The bottom of the engine: it imports nothing from the package.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

Node = torch.fx.Node


def is_call(node: Any, *targets: Any) -> bool:
    """node is a call_function of one of `targets` (OpOverloadPackets match any overload)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    called = node.target
    packet = getattr(called, "overloadpacket", None)  # (read once, not once per target)
    for target in targets:
        if called is target or packet is target:
            return True
    return False


def hashable(value: Any) -> Any:
    """`value` (a node's args or kwargs) as a key: lists and tuples as tagged tuples, dicts
    as sorted pairs, the rest (nodes, numbers, dtypes) as they are."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    return value


# x.view, x.reshape and what aot makes of a view it cannot take (_unsafe_view): the same
# elements in the same order, another shape
RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
# the ops that move, copy or re-view a tensor's elements and compute nothing
_aten = torch.ops.aten
# ops whose result depends on their first argument's shape (and dtype, device) only
SHAPE_ONLY_OPS = frozenset({_aten.zeros_like.default, _aten.ones_like.default, _aten.empty_like.default,
                            _aten.full_like.default, _aten.new_zeros.default, _aten.new_ones.default,
                            _aten.new_empty.default, _aten.new_full.default, _aten.sym_size.int})
MOVES = (*RESHAPES, _aten.permute.default, _aten.transpose.int, _aten.t.default, _aten.unsqueeze.default,
         _aten.squeeze.dim, _aten.squeeze.dims, _aten.expand.default, _aten.clone.default, _aten.contiguous.default,
         _aten.alias.default)


def is_cast(node: Any) -> bool:
    """node casts its input's dtype and computes nothing else: .to(dtype) as aot spells it
    (aten._to_copy, with no argument but dtype, memory format, layout and device;
    prims.convert_element_type), or torch_npu's own cast (an NPU compile's _npu_dtype_cast)."""
    if is_call(node, torch.ops.prims.convert_element_type.default):
        return True
    if is_call(node, torch.ops.aten._to_copy.default):
        return set(node.kwargs) <= {"dtype", "memory_format", "layout", "device"}
    return isinstance(node, Node) and getattr(node.target, "__name__", "").startswith("_npu_dtype_cast")


def plain_cast(node: Any, dtype: Optional[torch.dtype] = None) -> bool:
    """node is `.to(dtype)` as aot spells it (aten._to_copy with a dtype and nothing else), to
    `dtype` if given."""
    return (is_call(node, torch.ops.aten._to_copy.default) and set(node.kwargs) == {"dtype"}
            and (dtype is None or node.kwargs["dtype"] == dtype))


def tensor_meta(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor a node computes (node.meta['val']), or None."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def same_layout(a: Any, b: Any) -> bool:
    """Two fake values with provably the same shapes, strides and dtypes."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        sizes = [*zip(a.shape, b.shape), *zip(a.stride(), b.stride()),
                 (a.storage_offset(), b.storage_offset())]
        return (a.dtype == b.dtype and a.dim() == b.dim()
                and all(statically_known_true(x == y) for x, y in sizes))
    return type(a) is type(b) and not isinstance(a, torch.Tensor) and (
        isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) or a == b)


def normalized_dims(dims: Any, rank: int) -> list[int]:
    """Dim arguments as sorted non-negative indices of a rank-`rank` tensor."""
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return sorted(d % rank for d in dims)


def first_refused_use(site: Any, accept: Callable[[Node, Node], bool],
                      pass_on: Union[Sequence[Any], Callable[[Node, Node], bool]],
                      outputs: Optional[Sequence[Node]] = None) -> Optional[Node]:
    """The first node outside `site` (a matching.Site) that reads its `outputs` (default:
    every site node), directly or through what `pass_on` lets through (ops such as casts
    and views, or a predicate `pass_on(user, value_it_reads)`: what counts is where the
    values end up), and that `accept(user, value_it_reads)` refuses; None if every use is
    accepted."""
    inside = set(site.nodes)
    passes_on = pass_on if callable(pass_on) else (lambda user, value: is_call(user, *pass_on))
    pending = [(user, node) for node in (site.nodes if outputs is None else outputs)
               for user in node.users if user not in inside]
    while pending:
        user, value = pending.pop()
        if passes_on(user, value):
            pending += [(u, user) for u in user.users]
        elif not accept(user, value):
            return user
    return None


def known_equal(a: Any, b: Any) -> bool:
    """Sizes `a` and `b` (ints, or SymInts of one shape environment) are equal for every
    input the graph accepts, proven without a guard: by the shape environment, or where it
    does not see it, by writing each symbol it knows to be even as twice another one. A
    chunk in two of a symbolic size s is split at (s + 1) // 2, the half s // 2 of an even s
    only: the shape environment keeps `Eq(Mod(s, 2), 0)` (from a guard the graph already
    has, e.g. a stack of the two halves), but does not reduce (s + 1) // 2 with it."""
    if statically_known_true(a == b):
        return True
    symbolic = next((v for v in (a, b) if isinstance(v, torch.SymInt)), None)
    if symbolic is None:
        return False
    import sympy

    env = symbolic.node.shape_env
    difference = _expression(a) - _expression(b)
    halved = {symbol: 2 * sympy.Dummy(integer=True, positive=True) for symbol in difference.free_symbols
              if statically_known_true(env.create_symintnode(symbol, hint=None) % 2 == 0)}
    # (substituting re-evaluates torch's FloorDiv / Mod: (2k + 1) // 2 becomes k)
    return bool(halved) and sympy.expand(difference.subs(halved)) == 0


def _expression(size: Any) -> Any:
    import sympy

    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def uneven_halves(nodes: Sequence[Node], source: Node) -> Any:
    """The first bound at which one of `nodes` slices `source`'s last dim (a slice of step 1)
    that is neither its start, its end, nor provably its half (size // 2); None if there is
    none. `x.chunk(2, -1)` of a symbolic size s is split at (s + 1) // 2, which is the half
    only for an even s: code the fused op's halves compute only where s is proven even."""
    value = tensor_meta(source)
    if value is None or value.dim() == 0:
        return None
    size = value.shape[-1]
    for node in nodes:
        if not (is_call(node, torch.ops.aten.slice.Tensor) and node.args[0] is source
                and len(node.args) > 1 and node.args[1] in (-1, value.dim() - 1)
                and (len(node.args) < 5 or node.args[4] == 1)):
            continue
        for bound in node.args[2:4]:
            bound = bound.meta.get("val") if isinstance(bound, Node) else bound
            if not isinstance(bound, (int, torch.SymInt)):
                return bound
            if not any(known_equal(bound, at) for at in (0, size // 2, size)) and not (
                    isinstance(bound, int) and bound >= 2**63 - 1):  # `x[a:]` ends at 2**63 - 1
                return bound
    return None


def users_outside(nodes: Sequence[Node], allowed: Sequence[Node]) -> Optional[tuple[Node, Node]]:
    """The first (node, user) where a user of `nodes` is not in `allowed`."""
    allowed_set = set(allowed)
    for node in nodes:
        for user in node.users:
            if user not in allowed_set:
                return node, user
    return None


def deterministic_and_pure(target: Any) -> bool:
    """An op (or getitem) whose result depends on its arguments alone: it draws no random
    numbers and mutates nothing."""
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return False
    return (torch.Tag.nondeterministic_seeded not in target.tags
            and not target._schema.is_mutable)  # noqa: SLF001


def op_name(target: Any) -> str:
    """npu.npu_rms_norm.default -> "npu.npu_rms_norm", the capabilities key."""
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}"  # noqa: SLF001


def functional_target(node: Node) -> Any:
    """The op a node runs: its target, or for a mutating op in a functional graph (the
    higher-order op auto_functionalized(_v2) torch and torchair spell it with: DeepSeek-V4's
    in-place partial RoPE) the op it wraps."""
    name = getattr(node.target, "__name__", "")
    if name in ("auto_functionalized", "auto_functionalized_v2") and node.args \
            and isinstance(node.args[0], torch._ops.OpOverload):  # noqa: SLF001
        return node.args[0]
    return node.target


def custom_ops(gm: torch.fx.GraphModule) -> set[str]:
    """The non-aten ops a traced function calls ("npu.npu_rms_norm", ...); a mutating op that
    is called functionally (auto_functionalized_v2) counts as the op it wraps."""
    targets = [functional_target(n) for n in gm.graph.nodes if n.op == "call_function"]
    return {op_name(t) for t in targets
            if isinstance(t, torch._ops.OpOverload)  # noqa: SLF001
            and t.namespace not in ("aten", "prims")}


def constant_on_a_size_range(value: Any) -> Optional[tuple[int, Callable[[], bool]]]:
    """For a SymInt that is one constant over an unbounded range of its sizes, (c, guard):
    `min(k, S)` is k for every S >= k, `max(k, S)` for every S <= k. `guard()` installs that
    range as a guard of the compiled graph, as dynamo does when it specialises a size (a
    compile at a size outside it recompiles), and returns whether it holds here. None for
    anything else: guarding `S == 16` itself would pin the size, one compile per length."""
    if not isinstance(value, torch.SymInt):
        return None
    expr = value.node.expr
    kind = type(expr).__name__
    if kind not in ("Min", "Max"):
        return None
    constants = [a for a in expr.args if a.is_number]
    hint = value.node.hint
    if len(constants) != 1 or hint is None or int(constants[0]) != int(hint):
        return None
    c = int(constants[0])
    others = [a for a in expr.args if not a.is_number]

    def guard() -> bool:
        # on each size expression itself (S >= k): the shape environment then narrows the
        # size's range, and proves min(k, S) == k wherever the graph reads it
        from torch.fx.experimental.symbolic_shapes import guard_bool

        env = value.node.shape_env
        held = True
        for other in others:
            size = env.create_symintnode(other, hint=int(env.guarding_hint_or_throw(other)))
            held = held and guard_bool(size >= c if kind == "Min" else size <= c)
        return held

    return c, guard
