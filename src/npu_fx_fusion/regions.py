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

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .canonical import is_backward
from .nodes import is_call as is_call_of

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


@dataclass
class BackwardRegion:
    """What autograd made, in a joint graph, of a recognised forward region (backward_region)."""

    nodes: list  # the backward nodes, in graph order
    gradient: Node  # the gradient of the region's output they start from
    gradients: dict  # {an input of the region: the node of its gradient}


def backward_nodes_by_seq(graph: torch.fx.Graph) -> dict:
    """{seq_nr: the joint graph's backward nodes autograd made for the forward op(s) of that
    seq_nr} (aot_autograd gives each backward node its forward op's seq_nr)."""
    by_seq: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and is_backward(node) and node.meta.get("seq_nr") is not None:
            by_seq.setdefault(node.meta["seq_nr"], []).append(node)
    return by_seq


def backward_region(nodes: Sequence[Node], inputs: Sequence[Node], output: Node,
                    by_seq: dict) -> Union[BackwardRegion, str]:
    """The backward of a forward region `nodes` (reading `inputs`, computing `output`) in a
    joint graph, or why it cannot be replaced by the fused op's backward alone.

    Whatever the spelling, autograd's nodes for the region are the backward nodes that carry
    the seq_nr of one of its forward ops (by_seq: backward_nodes_by_seq), less the gradient
    sums (aot_autograd's is_gradient_acc) that add one from elsewhere (autograd records them
    under the seq_nr of the backward op it runs when the second gradient arrives). They are the
    region's backward, and nothing else, when they read one gradient from outside, of the
    output's layout, and forward values of the region or its inputs only: a gradient of an
    intermediate summed with one from outside the region, or a forward op spanning the
    region's edge, is refused. So is a region that passes an input's gradient on unchanged
    (an add of the input: no backward node computes that part). Each gradient they pass on is
    the gradient of the one input read by the forward op it was made for."""
    region = [n for n in nodes if n.op == "call_function"]
    seqs = {n.meta.get("seq_nr") for n in region}
    if None in seqs:
        return "its forward ops carry no autograd sequence numbers (seq_nr), which find their backward"
    candidates = sorted(n for seq in seqs for n in by_seq.get(seq, ()))
    in_candidates = set(candidates)
    given = set(inputs)
    with_backward = {n.meta.get("seq_nr") for n in candidates}
    # an input whose gradient autograd passes on unchanged (an add's operand; a clone, which
    # makes no backward node) gets that part of it from no node of the backward: it would be
    # counted twice, once by the op's backward and once as it is. (An op that made no backward
    # node because its input needs no gradient is fine: checked once the gradients are known.)
    unchanged = {}
    for node in region:
        if is_call_of(node, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor) \
                and any(a in given for a in node.all_input_nodes):
            return (f"{node.name} ({node.target}) passes an input's gradient on unchanged: no backward node "
                    "computes that part of it")
        if node.meta["seq_nr"] not in with_backward:
            unchanged.update({a: node for a in node.all_input_nodes if a in given})

    def gradient_from_outside(arg: Node) -> bool:
        return arg not in in_candidates and (is_backward(arg) or (arg.op == "placeholder"
                                                                  and str(arg.target).startswith("tangents")))

    # the gradient sums aot_autograd marks (is_gradient_acc) that add a gradient from outside
    accumulations = {n for n in candidates if n.meta.get("is_gradient_acc")
                     and any(gradient_from_outside(a) for a in n.all_input_nodes)}
    read_by_the_rest = {a for n in candidates if n not in accumulations for a in n.all_input_nodes
                        if gradient_from_outside(a)}
    if any(a in read_by_the_rest for n in accumulations for a in n.all_input_nodes):
        return "a gradient its backward starts from is also summed into one of its gradients"
    backward = [n for n in candidates if n not in accumulations]
    in_backward = in_candidates - accumulations
    if not backward:
        return "no backward nodes of its forward ops (no gradient flows through it)"
    in_region = set(region)
    gradients_in = set()
    for node in backward:
        for arg in node.all_input_nodes:
            if arg in in_backward or not isinstance(arg.meta.get("val"), torch.Tensor):
                continue  # (a symbolic size the graph reads from a placeholder)
            if gradient_from_outside(arg) or arg in accumulations:
                gradients_in.add(arg)
            elif arg not in in_region and arg not in given:
                return (f"its backward reads {arg.name}, a forward value computed outside the region: the fused "
                        "op's backward does not compute that")
    if len(gradients_in) != 1:
        return (f"its backward reads {len(gradients_in)} gradients from outside it, not only its output's: "
                "an intermediate's gradient is summed with one from elsewhere")
    (gradient,) = gradients_in
    gradient_value, output_value = gradient.meta.get("val"), output.meta.get("val")
    if not isinstance(output_value, torch.Tensor) or list(gradient_value.shape) != list(output_value.shape):
        return "the gradient its backward starts from is not of its output's shape"
    region_by_seq: dict = {}
    for node in region:
        region_by_seq.setdefault(node.meta["seq_nr"], []).append(node)
    gradients: dict = {}
    for node in backward:
        if all(u in in_backward for u in node.users):
            continue
        read = {a for f in region_by_seq[node.meta["seq_nr"]] for a in f.all_input_nodes if a in given}
        if len(read) != 1:
            return (f"its gradient {node.name} is passed on from a forward op reading {len(read)} of the region's "
                    "inputs: which input's gradient it is is not known")
        (source,) = read
        if source in gradients:
            return f"the gradient of {source.name} leaves its backward in two parts"
        gradients[source] = node
    passed_on = next((source for source in gradients if source in unchanged), None)
    if passed_on is not None:
        node = unchanged[passed_on]
        return (f"{node.name} ({node.target}) passes {passed_on.name}'s gradient on unchanged: no backward node "
                "computes that part of it")
    return BackwardRegion(backward, gradient, gradients)
