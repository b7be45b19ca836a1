"""A region of a graph found by walking it: the nodes that compute some outputs from some inputs.

A traced form matches one connected pattern, and a replacement stands for the nodes the
pattern spells. Some regions cannot be spelled: their values have data-dependent sizes
(`.tolist()` of a tensor, then tensors of those sizes), and the graph checks each such size
with runtime asserts (`aten._assert_scalar` on the symbolic expressions) that read the
region's nodes but feed nothing. A pass that has proved what such a region computes (its
`recognize`, forms.Recognized) takes its nodes from here: every node between the inputs and
the outputs, and the runtime checks that read only those nodes, which go with them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Node = torch.fx.Node


def enclosed_region(outputs: Sequence[Node], inputs: Sequence[Node],
                    stops: Sequence[Node] = ()) -> tuple[list[Node], Optional[tuple[Node, Node]]]:
    """(the region's nodes in graph order, the first (node, user) that escapes it, or None).

    The region: every node `outputs` are computed from, walking up to `inputs` (what the
    replacement reads: they stay outside, as do the graph's placeholders and attributes) and
    to `stops` (values the region reads and the replacement does not: the walk goes no
    higher); the pure nodes above it, `stops` included, that only the region reads (they compute nothing once it is gone); and every node computed
    only from region nodes that nothing but such nodes reads (the runtime asserts on its
    data-dependent sizes, and the symbolic expressions they check). A region node other
    than an output that something else reads escapes: the region cannot be replaced whole.
    """
    boundary = set(inputs) | set(stops)
    region: set[Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in region or node in boundary or node.op in ("placeholder", "get_attr"):
            continue
        region.add(node)
        stack.extend(node.all_input_nodes)
    _absorb_producers(region, set(inputs))
    checks = _dependent_checks(region)
    nodes = sorted(region | checks)
    members, output_set = set(nodes), set(outputs)
    for node in nodes:
        if node in output_set:
            continue
        for user in node.users:
            if user not in members:
                return nodes, (node, user)
    return nodes, None


def _absorb_producers(region: set[Node], keep: set[Node]) -> None:
    """Add to `region` the pure call nodes above it (not `keep`) that only it reads."""
    frontier = [a for node in region for a in node.all_input_nodes]
    while frontier:
        node = frontier.pop()
        if (node in region or node in keep or node.op != "call_function" or node.is_impure()
                or not node.users or any(user not in region for user in node.users)):
            continue
        region.add(node)
        frontier.extend(node.all_input_nodes)


def _dependent_checks(region: set[Node]) -> set[Node]:
    """The nodes outside `region` computed from it (and from sizes) whose values nothing else reads."""
    derived: set[Node] = set()
    frontier = [user for node in region for user in node.users]
    while frontier:
        node = frontier.pop()
        if node in region or node in derived or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        # a check may also read symbolic sizes of the region's inputs (Eq(u0 + u1, 48 * s0))
        if (all(a in region or a in derived or _is_size(a) for a in inputs)
                and any(a in region or a in derived for a in inputs)):
            derived.add(node)
            frontier.extend(node.users)
    # keep only those whose every use stays among them (an expression also read by the rest
    # of the graph is the rest of the graph's)
    changed = True
    while changed:
        changed = False
        for node in list(derived):
            if any(user not in derived for user in node.users):
                derived.discard(node)
                changed = True
    return derived


def _is_size(node: Node) -> bool:
    """A node whose value is a (symbolic) integer or boolean: a size, not a tensor."""
    return isinstance(node.meta.get("val"), (int, bool, torch.SymInt, torch.SymBool))
