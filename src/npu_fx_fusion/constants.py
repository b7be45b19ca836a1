"""Values a graph computes from no input at all, evaluated at compile time.

Some fused ops take as a mode what the model computes as a tensor: the attention ops'
sparse_mode 3 is "right-down causal", where the model builds a causal mask from
`arange`s. When such a mask depends on no graph input (static shapes, positions made in
the graph), it is the same at every call: evaluating its subgraph once proves what it is,
and a pass can then compare it with the mask its op would apply. Anything read from an
input (a user's attention mask, position ids), a parameter, a symbolic size or a random
op makes the value unknown (None), and the pass must not assume it.
"""
from __future__ import annotations

from typing import Any, Optional

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


def _evaluate(node: Node, needed: dict) -> Optional[torch.Tensor]:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for current in sorted(needed, key=order.__getitem__):
        env[current] = graph.node_copy(current, env.__getitem__)
    graph.output(env[node])
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        try:
            value = torch.fx.GraphModule(torch.nn.Module(), graph)()
        except Exception:  # an op that cannot run here: unknown, not an error of the model
            return None
    return value if isinstance(value, torch.Tensor) else None


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
        return _sparse_mode(evaluate_constant(mask_node), visible_when)


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
