"""Reading FX nodes: the small helpers every layer above (and the pattern checks) use.

The bottom of the engine: it imports nothing from the package.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx

Node = torch.fx.Node


def is_call(node: Any, *targets: Any) -> bool:
    """node is a call_function of one of `targets` (OpOverloadPackets match any overload)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def tensor_meta(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor a node computes (node.meta['val']), or None."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


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


def users_outside(nodes: Sequence[Node], allowed: Sequence[Node]) -> Optional[tuple[Node, Node]]:
    """The first (node, user) where a user of `nodes` is not in `allowed`."""
    allowed_set = set(allowed)
    for node in nodes:
        for user in node.users:
            if user not in allowed_set:
                return node, user
    return None


def op_name(target: Any) -> str:
    """npu.npu_rms_norm.default -> "npu.npu_rms_norm", the capabilities key."""
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}"  # noqa: SLF001


def custom_ops(gm: torch.fx.GraphModule) -> set[str]:
    """The non-aten ops a traced function calls ("npu.npu_rms_norm", ...)."""
    return {op_name(n.target) for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)  # noqa: SLF001
            and n.target.namespace not in ("aten", "prims")}
