"""Values a graph computes from no input at all, evaluated at compile time.

Some fused ops take as a mode what the model computes as a tensor: the attention ops'
sparse_mode 3 is "right-down causal", where the model builds a causal mask from
`arange`s. When such a mask depends on no graph input (static shapes, positions made in
the graph), it is the same at every call: evaluating its subgraph once proves what it is,
and a pass can then compare it with the mask its op would apply. Anything read from an
input (a user's attention mask, position ids), a parameter or a random op makes the value
unknown (None), and the pass must not assume it. A mask computed from symbolic sizes only
(dynamic shapes) is proven for every size by symbolic_values.py (`mask_mode`).

Masks come in several spellings: bool (True = visible, or True = hidden), additive floats
(0 visible, -inf or a large negative hidden: `where`, `masked_fill`, `triu(full(-inf))`,
`log(tril(ones))`), several of them applied one after the other. `MaskTerm` says how one
mask node hides keys; `mask_mode` proves what a list of them hides together, and
`hidden_keys` computes it where it cannot be proven (a replacement passes it to its op).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

Node = torch.fx.Node

# Ops whose result is not a function of their arguments.
_NONDETERMINISTIC = ("rand", "randn", "randint", "randperm", "bernoulli", "normal", "uniform",
                     "dropout", "multinomial", "empty")


def evaluate_constant(node: Any, max_nodes: int = 400) -> Optional[torch.Tensor]:
    """The value of `node` if it depends on no placeholder, attribute or random op, else None.

    The subgraph is copied and run on real tensors (outside the compile's fake mode);
    graphs larger than `max_nodes` are not evaluated (None).
    """
    if not isinstance(node, Node):
        return None
    needed: dict[Node, None] = {}
    pending = [node]
    while pending:
        current = pending.pop()
        if current in needed:
            continue
        if current.op == "get_attr" and _lifted_constant(current) is not None:
            needed[current] = None
            continue
        if current.op != "call_function" or _is_nondeterministic(current.target):
            return None
        if _has_symbolic_size(current):
            return None
        needed[current] = None
        if len(needed) > max_nodes:
            return None
        pending.extend(current.all_input_nodes)
    # A graph's mask is one node that every attention layer reads (cleanup merges the
    # copies): evaluate it once while its subgraph stays the same
    subgraph = tuple((n, n.target, n.args, tuple(n.kwargs.items())) for n in needed)
    cached = node.meta.get(_CACHE_KEY)
    if cached is not None and cached[0] == subgraph:
        return cached[1]
    value = _evaluate(node, needed)
    node.meta[_CACHE_KEY] = (subgraph, value)
    return value


_CACHE_KEY = "npu_fx_fusion_constant"


def constant_number(node: Any) -> Optional[float]:
    """evaluate_constant's value of a one-element constant as a Python number, else None
    (read outside the compile's fake mode: the value is a real tensor)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    value = evaluate_constant(node)
    if value is None or value.numel() != 1:
        return None
    with unset_fake_temporarily():
        return value.item()


def _evaluate(node: Node, needed: dict) -> Optional[torch.Tensor]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for current in sorted(needed, key=order.__getitem__):
        env[current] = graph.node_copy(current, env.__getitem__)
    graph.output(env[node])
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    root = torch.nn.Module()
    for current in needed:
        if current.op == "get_attr":
            setattr(root, current.target, _lifted_constant(current))
    with unset_fake_temporarily(), torch.no_grad():
        try:
            value = torch.fx.GraphModule(root, graph)()
        except Exception:  # an op that cannot run here: unknown, not an error of the model
            return None
    return value if isinstance(value, torch.Tensor) else None


def _lifted_constant(node: Node) -> Optional[torch.Tensor]:
    """The value of a tensor the model made from Python data in its forward, which tracing
    lifted into an attribute (`_tensor_constant0`: the 0.0 of `mask[i, a:b] = 0.0`): the
    same at every call. Parameters and buffers are inputs (or may be updated): None."""
    target = node.target
    if not isinstance(target, str) or not target.startswith("_tensor_constant") or "." in target:
        return None
    value = getattr(node.graph.owning_module, target, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return None
    from torch._subclasses.fake_tensor import is_fake

    return None if is_fake(value) else value


def _is_nondeterministic(target: Any) -> bool:
    name = getattr(target, "__name__", str(target))
    base = name.split(".")[0].lstrip("_")
    return any(base == op or base.startswith(op + "_") for op in _NONDETERMINISTIC)


def _has_symbolic_size(node: Node) -> bool:
    values = pytree.tree_leaves(node.meta.get("val"))
    return any(isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape)
               or isinstance(v, torch.SymInt) for v in values)


def causal_mask(queries: int, keys: int) -> torch.Tensor:
    """The right-down causal mask (sparse_mode 3): query i sees key j <= (keys - queries) + i."""
    i = torch.arange(queries).unsqueeze(-1)
    j = torch.arange(keys).unsqueeze(0)
    return j <= i + (keys - queries)


def sparse_mode_of(mask_node: Any, visible_when: str = "true") -> tuple[Optional[int], str]:
    """(sparse_mode, why) for an attention mask node of shape (..., S, T).

    visible_when: "true" for a bool mask that is True where a key is visible, "zero" for an
    additive float mask that is 0 there (and -inf or the dtype's minimum elsewhere).
    Returns (3, ...) for the right-down causal mask in every batch and head, (0, ...) for
    one that masks nothing, (None, why not) otherwise.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # passes run inside the compile's fake mode
        value = evaluate_constant(mask_node)
        if value is None and _has_symbolic_size(mask_node):  # a proof for every size instead
            meta = mask_node.meta["val"]
            roles = tuple(None if size == 1 else "b" for size in meta.shape[:-2]) + ("s", "t")
            term = MaskTerm(mask_node, "false" if visible_when == "true" else "nonzero", roles)
            mode, why = mask_mode([term], meta.shape[-2], meta.shape[-1])
            return {"none": 0, "causal": 3}.get(mode), why
        return _sparse_mode(value, visible_when)


def _sparse_mode(value: Optional[torch.Tensor], visible_when: str) -> tuple[Optional[int], str]:
    if value is None:
        return None, ("the attention mask is computed from graph inputs (or symbolic sizes), "
                      "so it cannot be proven causal at compile time")
    visible = value if visible_when == "true" else value == 0
    if visible.dtype != torch.bool or visible.dim() < 2:
        return None, f"the attention mask is {value.dtype}{list(value.shape)}, not a (.., S, T) mask"
    queries, keys = visible.shape[-2:]
    if bool(visible.all()):
        return 0, "the attention mask masks nothing"
    if bool((visible == causal_mask(queries, keys)).all()):
        return 3, "the attention mask is right-down causal"
    return None, ("the attention mask is neither right-down causal nor empty (padding, packed "
                  "sequences or upper-left causal): the op's sparse_mode 0 / 3 cannot express it")


def band_mask_reason(mask_node: Any, window: int) -> Optional[str]:
    """None if an additive attention mask (0 where a key is visible) depends on no graph input
    and shows each query row i of S exactly the keys in (t - window, t], t = (keys - S) + i (the
    right-down sliding window of `window` keys, the query's own included); else why not.

    Hidden entries must be -inf or at most -1e30 (transformers' finfo.min): adding them to a
    logit leaves exp() exactly 0, so the mask hides what a kernel's band hides.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        value = evaluate_constant(mask_node)
        if value is None:
            return ("the attention mask is computed from graph inputs (or symbolic sizes), so it cannot be "
                    "proven to be a sliding window at compile time")
        if value.dim() < 2 or not value.is_floating_point():
            return f"the attention mask is {value.dtype}{list(value.shape)}, not an additive (.., S, T) mask"
        visible = value == 0
        if not bool((value[~visible] <= -1e30).all()):
            return "the attention mask holds values that neither show (0) nor hide (-inf) a key"
        queries, keys = visible.shape[-2:]
        i = torch.arange(queries).unsqueeze(-1) + (keys - queries)
        j = torch.arange(keys).unsqueeze(0)
        if bool((visible == ((j <= i) & (j > i - window))).all()):
            return None
        widths = visible.sum(-1)
        widest = int(widths.max())
        if bool((visible == ((j <= i) & (j > i - widest))).all()):
            return f"the attention mask is a {widest}-key sliding window, the kernel's is {window} keys"
        return (f"the attention mask is not a right-down sliding window of {window} keys (padding, packed "
                "sequences or another mask)")


def arange_positions_reason(node: Any) -> Optional[str]:
    """None if `node` is (1 or B, S) positions 0..S-1 in every row, known at compile time (a
    prefill without cache); else why not."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        value = evaluate_constant(node)
        if value is None or value.dim() != 2:
            return "the positions are computed from graph inputs (a cache offset?), not a compile-time 0..S-1"
        if not bool((value == torch.arange(value.shape[-1])).all()):
            return "the positions are not 0..S-1 (a cache offset or packed sequences)"
    return None


# ---- masks of attention-like ops ---------------------------------------------------------------------
# A finite fill hides a key when the softmax then gives it exactly 0: exp(fill - max) underflows
# in fp32 once the row's largest visible score exceeds fill + 104 (exp(-103.98) is the
# smallest fp32 subnormal halved). At most this fill, that is any score above -9896 (attention
# logits are far from it): transformers' finfo.min and the -10000.0 of older code. A larger fill
# (-100) leaves hidden keys a share a score can reach: not a mask.
HIDING_FILL = -1e4
_EXP_UNDERFLOW = 104.0  # -log of the smallest positive fp32, rounded up


def hides(value: float) -> bool:
    """Whether a mask value hides a key as -inf does (HIDING_FILL)."""
    return value == float("-inf") or (math.isfinite(value) and value <= HIDING_FILL)


def fill_note(value: float) -> Optional[str]:
    """What the site's note says about a finite hiding value (None for -inf or a dtype's minimum)."""
    if value == float("-inf") or value <= -1e30:
        return None
    return (f"hidden keys get {value:g}: the model's softmax gives them exp({value:g} - max) of a row, 0 in fp32 "
            f"while the row's largest visible score exceeds {value + _EXP_UNDERFLOW:g}; the fused op gives 0")


@dataclass(frozen=True)
class MaskTerm:
    """One mask an attention-like op applies: `node` hides a key where it is True
    (hides="true"), where it is False ("false"), or where it is not 0 (an additive mask,
    "nonzero", whose other values all hide: value_set). `roles`: per dim of the node's value,
    "b" (batch), "s" (query), "t" (key) or None (a dim of size 1, broadcast)."""

    node: Node
    hides: str
    roles: tuple


def hidden_keys(values: Sequence[torch.Tensor], terms: Sequence[MaskTerm]) -> torch.Tensor:
    """The keys the terms hide together, (B or 1, S or 1, T or 1) bool: traceable, for a
    replacement that passes the mask to its op. `values`: each term's node's value."""
    hidden = None
    for value, term in zip(values, terms):
        h = value.bool() if term.hides == "true" else value.logical_not() if term.hides == "false" else value != 0
        h = _by_roles(h, term.roles)
        hidden = h if hidden is None else hidden | h
    return hidden


def _by_roles(t: torch.Tensor, roles: Sequence[Optional[str]]) -> torch.Tensor:
    """A mask's value as (b, s, t), each 1 where the mask has no such dim."""
    kept = [i for i, role in enumerate(roles) if role is not None]
    order = sorted(kept, key=lambda i: "bst".index(roles[i]))
    t = t.permute(*order, *(i for i in range(t.dim()) if i not in order)) if order else t
    t = t.reshape(*t.shape[:len(order)]) if len(order) < t.dim() else t
    present = [roles[i] for i in order]
    for position, role in enumerate("bst"):
        if role not in present:
            t = t.unsqueeze(position)
    return t


def mask_mode(terms: Sequence[MaskTerm], queries: Any, keys: Any) -> tuple[Optional[str], str]:
    """(mode, why) of what the terms hide together over `queries` x `keys`: "none" (nothing),
    "causal" (right-down: query i of S sees key j <= i + T - S, in every batch), or None with
    the reason it is neither or cannot be proven. Static masks are evaluated; masks computed
    from symbolic sizes only are proven for every size (symbolic_values.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not terms:
        return "none", "no mask"
    with unset_fake_temporarily():
        values = [evaluate_constant(term.node) for term in terms]
        if all(v is not None for v in values) and isinstance(queries, int) and isinstance(keys, int):
            hidden = hidden_keys(values, terms)
            visible = ~torch.broadcast_to(hidden, (hidden.shape[0], queries, keys))
            return _static_mode(visible)
    from .symbolic_values import symbolic_mask_mode

    return symbolic_mask_mode(terms, queries, keys)


def compressed_mask_ratio(terms: Sequence[MaskTerm], queries: Any, keys: Any,
                          candidate: Optional[int] = None) -> tuple[Optional[int], str]:
    """(m, why) where the terms hide exactly the keys t >= (s + 1) // m of query s, over `queries` x
    `keys`, in every batch: DeepSeek-V4's compressed causal mask (a query sees the blocks its own
    token completes; cann_ops_transformer.lightning_indexer's mask_mode 3 with cmp_ratio m and
    cmp_residual_k S - T * m), with m >= 2; (None, why not) otherwise. Static masks are evaluated
    and m read off the first query that sees a block (query m - 1), then every entry compared;
    masks of symbolic sizes are proven for every size against `candidate` (symbolic_values)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not terms:
        return None, "the scores are not masked"
    with unset_fake_temporarily():
        values = [evaluate_constant(term.node) for term in terms]
        if all(v is not None for v in values) and isinstance(queries, int) and isinstance(keys, int):
            hidden = hidden_keys(values, terms)
            visible = ~torch.broadcast_to(hidden, (hidden.shape[0], queries, keys))
            seeing = visible.any(-1).any(0).nonzero()
            if seeing.numel() == 0:
                return None, "the scores' mask hides every block from every query"
            m = int(seeing[0]) + 1
            i = torch.arange(queries).unsqueeze(-1)
            expected = torch.arange(keys).unsqueeze(0) < (i + 1) // m
            if m < 2 or not bool((visible == expected).all()):
                return None, ("the scores' mask is not the compressed causal mask t < (s + 1) // m for any m >= 2 "
                              "(the first query that sees a block is query m - 1)")
            return m, f"the scores' mask hides the blocks t >= (s + 1) // {m}"
    if candidate is None or candidate < 2:
        return None, ("the scores' mask has symbolic sizes and no compress ratio to prove it against (the top-k's "
                      "threshold names none)")
    from .symbolic_values import symbolic_compressed_ratio

    return symbolic_compressed_ratio(terms, candidate)


def _static_mode(visible: torch.Tensor) -> tuple[Optional[str], str]:
    mode, why = _sparse_mode(visible, "true")
    return {0: "none", 3: "causal"}.get(mode), why


def value_set(node: Any, limit: int = 8) -> Optional[frozenset]:
    """The values a tensor node can hold, when they are few and known at compile time
    whatever the inputs: a bool tensor's {0, 1}, a where / masked_fill of constants, a
    triu / tril of them, their sums and logs (an additive mask's {0, -inf}); None otherwise."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _value_set(node, limit, 0)


_SAME_VALUES = ("view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "permute", "transpose",
                "slice", "select", "clone", "contiguous", "alias", "lift_fresh_copy", "repeat", "index",
                "detach", "t", "flip")


def _value_set(node: Any, limit: int, depth: int) -> Optional[frozenset]:
    if isinstance(node, bool):
        return frozenset({float(node)})
    if isinstance(node, (int, float)):
        return frozenset({float(node)})
    if not isinstance(node, Node) or depth > 40:
        return None
    meta = node.meta.get("val")
    if isinstance(meta, torch.Tensor) and meta.dtype == torch.bool:
        return frozenset({0.0, 1.0})
    constant = evaluate_constant(node) if not _has_symbolic_size(node) else None
    if constant is not None:
        if constant.numel() > 1 << 16:
            return None
        found = frozenset(float(v) for v in constant.float().unique().tolist())
        return found if len(found) <= limit else None
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", "").split(".")[0]
    args = node.args

    def of(arg):
        return _value_set(arg, limit, depth + 1)

    out: Optional[frozenset] = None
    if name in _SAME_VALUES or _is_value_preserving_cast(node):
        out = of(args[0])
    elif name in ("full", "full_like", "new_full"):
        out = of(args[1] if name != "new_full" else args[2])
    elif name in ("scalar_tensor",):
        out = of(args[0])
    elif name in ("zeros", "zeros_like", "new_zeros"):
        out = frozenset({0.0})
    elif name in ("ones", "ones_like", "new_ones"):
        out = frozenset({1.0})
    elif name in ("triu", "tril"):
        inner = of(args[0])
        out = inner | {0.0} if inner is not None else None
    elif name == "where":
        a, b = of(args[1]), of(args[2])
        out = a | b if a is not None and b is not None else None
    elif name == "masked_fill":
        a, b = of(args[0]), of(args[2])
        out = a | b if a is not None and b is not None else None
    elif name in ("add", "sub", "mul"):
        a, b = of(args[0]), of(args[1])
        alpha = node.kwargs.get("alpha", 1)
        if a is not None and b is not None and len(a) * len(b) <= 4 * limit:
            op = {"add": lambda x, y: x + alpha * y, "sub": lambda x, y: x - alpha * y,
                  "mul": lambda x, y: x * y}[name]
            out = frozenset(_combine(op, x, y) for x in a for y in b)
    elif name in ("neg", "log", "exp"):
        a = of(args[0])
        fn = {"neg": lambda x: -x, "log": lambda x: math.log(x) if x > 0 else (float("-inf") if x == 0 else math.nan),
              "exp": math.exp}[name]
        out = frozenset(fn(x) for x in a) if a is not None else None
    if out is not None and len(out) > limit:
        return None
    return out


def _combine(op, x: float, y: float) -> float:
    try:
        return op(x, y)
    except (OverflowError, ValueError):
        return math.nan


def _is_value_preserving_cast(node: Node) -> bool:
    """A cast to a float or bool dtype that keeps a mask's values (0 / 1 / -inf / a large fill)."""
    name = getattr(node.target, "__name__", "")
    if not (name.startswith("_to_copy") or name.startswith("convert_element_type") or name.startswith("_npu_dtype_cast")):
        return False
    meta = node.meta.get("val")
    return isinstance(meta, torch.Tensor) and (meta.is_floating_point() or meta.dtype == torch.bool)
