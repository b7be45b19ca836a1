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
from .nodes import RESHAPES, SHAPE_ONLY_OPS, tensor_meta
from .nodes import is_call as is_call_of

Node = torch.fx.Node


def region_between(outputs: Sequence[Node], inputs: Sequence[Node]) -> Optional[list[Node]]:
    """The nodes, in graph order, that `outputs` are computed from, walking up to `inputs`
    (tensors; a size argument is a SymInt node the replacement reads from its own inputs); None
    where the walk reaches a graph input (or attribute) that is not one of `inputs`."""
    boundary = set(inputs)
    region: set[Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in region or node in boundary:
            continue
        if node.op != "call_function":
            return None
        region.add(node)
        stack.extend(a for a in node.all_input_nodes if tensor_meta(a) is not None)
    return sorted(region)


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
    output_gradients: list  # per output of the region, the gradient they start from (None: it has none)
    gradients: dict  # {an input of the region: the node of its gradient}

    @property
    def gradient(self) -> Node:
        """The gradient of a one-output region's output."""
        (gradient,) = self.output_gradients
        return gradient


# ops whose derivative passes the gradient on as it is, with no backward node (add and sub, whose
# operands get it so, are refused where they read an input at all)
_GRADIENT_UNCHANGED = (torch.ops.aten.clone.default, torch.ops.aten.alias.default)


def backward_nodes_by_seq(graph: torch.fx.Graph) -> dict:
    """{seq_nr: the joint graph's backward nodes autograd made for the forward op(s) of that
    seq_nr} (aot_autograd gives each backward node its forward op's seq_nr)."""
    by_seq: dict = {GRADIENT_SUMS: []}
    forward_seqs = set()
    for node in graph.nodes:
        if node.op == "call_function" and is_backward(node):
            if node.meta.get("is_gradient_acc"):
                by_seq[GRADIENT_SUMS].append(node)
            if node.meta.get("seq_nr") is not None:
                by_seq.setdefault(node.meta["seq_nr"], []).append(node)
        elif node.op == "call_function" and not _sizes_only(node):
            forward_seqs.add(node.meta.get("seq_nr"))
    by_seq[AUTOGRAD_ONLY] = {seq for seq in by_seq if isinstance(seq, int) and seq not in forward_seqs}
    return by_seq


# backward_nodes_by_seq's entry for every gradient sum aot_autograd made (is_gradient_acc), in
# graph order: a sum of two of a region's own gradients (a value it reads twice) carries the
# seq_nr of whichever backward op ran when the second arrived, which may be none of its own
GRADIENT_SUMS = "gradient sums"
# backward_nodes_by_seq's entry for the seq_nrs of backward nodes no forward op of the graph carries:
# autograd's own nodes for an in-place op on a view (relu_ of an einsum's output rebases the view's
# history: its as_strided / copy-slices backward gets seq_nrs of its own, while functionalisation
# replays the views under the in-place op's, and under dynamic shapes keeps some whose sizes alone
# are read, under the seq_nr of the view autograd made): _add_autograd_only.
AUTOGRAD_ONLY = "autograd-only seq_nrs"


def backward_region(nodes: Sequence[Node], inputs: Sequence[Node], outputs: Union[Node, Sequence[Node]],
                    by_seq: dict, constants: Sequence[Node] = ()) -> Union[BackwardRegion, str]:
    """The backward of a forward region `nodes` (reading `inputs`, computing `outputs`) in a
    joint graph, or why it cannot be replaced by the fused op's backward alone.

    Whatever the spelling, autograd's nodes for the region are the backward nodes that carry
    the seq_nr of one of its forward ops (by_seq: backward_nodes_by_seq), less the gradient
    sums (aot_autograd's is_gradient_acc) that add one from elsewhere (autograd records them
    under the seq_nr of the backward op it runs when the second gradient arrives). They are the
    region's backward, and nothing else, when no value of the region but its outputs is read
    outside it and its backward, and they read forward values of the region or its inputs
    only, and one gradient from outside per output at most, of that output's layout, entering
    the backward of that output's op (or of the ops whose values it passes on unchanged: an
    add's operands). Refused, with the reason: a gradient of an intermediate summed with one
    from outside the region, a forward op spanning the region's edge, a region that passes an
    input's gradient on unchanged (an add of the input: no backward node computes that part).
    Each gradient they pass on is the gradient of the one input read by the forward op it was
    made for. `constants`: forward values the region reads that no gradient reaches (computed
    from none of the graph's inputs: a mask built from aranges); its backward may read them
    (a masked_fill's backward reads its mask), and they are no inputs whose gradient it computes."""
    outputs = [outputs] if isinstance(outputs, Node) else list(outputs)
    region = [n for n in nodes if n.op == "call_function"]
    seqs = {n.meta.get("seq_nr") for n in region}
    if None in seqs:
        return "its forward ops carry no autograd sequence numbers (seq_nr), which find their backward"
    candidates = sorted(n for seq in seqs for n in by_seq.get(seq, ()))
    in_candidates = set(candidates)
    _add_autograd_only(candidates, in_candidates, region, set(inputs) | set(constants), seqs, by_seq)
    for total in by_seq.get(GRADIENT_SUMS, ()):  # (graph order: a sum of sums follows them)
        if total not in in_candidates and all(a in in_candidates for a in total.all_input_nodes):
            candidates.append(total)
            in_candidates.add(total)
    candidates.sort()
    given = set(inputs)
    readable = given | set(constants)
    with_backward = {n.meta.get("seq_nr") for n in candidates}
    # an input whose gradient autograd passes on unchanged (an add's operand; a clone, which
    # makes no backward node) gets that part of it from no node of the backward: it would be
    # counted twice, once by the op's backward and once as it is. (A clone whose input needs no
    # gradient is fine: checked once the gradients are known. Other ops make no backward node
    # only where their value needs no gradient: comb's slice of base when comb is detached.)
    unchanged = {}
    for node in region:
        if node.target in _GRADIENT_UNCHANGED and node.meta["seq_nr"] not in with_backward:
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
    escaping = next((n for n in region if n not in outputs for u in n.users
                     if u not in in_region and u not in in_candidates and not _sizes_only(u)), None)
    if escaping is not None:
        return f"its intermediate {escaping.name} is read outside it: its gradient would come from there too"
    gradients_in = set()
    for node in backward:
        for arg in node.all_input_nodes:
            if arg in in_backward or not isinstance(arg.meta.get("val"), torch.Tensor):
                continue  # (a symbolic size the graph reads from a placeholder)
            if arg in accumulations and any(a in in_backward for a in arg.all_input_nodes):
                return (f"{arg.name} sums a gradient of its own with one from outside and feeds it back: an output "
                        "it also reads itself")
            if gradient_from_outside(arg) or arg in accumulations:
                gradients_in.add(arg)
            elif arg not in in_region and arg not in readable:
                return (f"its backward reads {arg.name}, a forward value computed outside the region: the fused "
                        "op's backward does not compute that")
    output_gradients = _gradients_of_outputs(outputs, gradients_in, backward, with_backward, in_region)
    if isinstance(output_gradients, str):
        return output_gradients
    carrying = _carrying_a_gradient(region, [o for o, g in zip(outputs, output_gradients) if g is not None])
    added = next((n for n in region if n in carrying and any(a in given for a in n.all_input_nodes)
                  and is_call_of(n, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor)), None)
    if added is not None:
        return (f"{added.name} ({added.target}) passes an input's gradient on unchanged: no backward node "
                "computes that part of it")
    region_by_seq: dict = {}
    for node in region:
        region_by_seq.setdefault(node.meta["seq_nr"], []).append(node)

    def read_by_its_forward(node):
        if node.meta.get("is_gradient_acc"):  # a sum of two of the region's gradients of one value
            return set().union(*[read_by_its_forward(a) for a in node.all_input_nodes])
        return {a for f in region_by_seq.get(node.meta.get("seq_nr"), ()) for a in f.all_input_nodes if a in given}

    gradients: dict = {}
    for node in backward:
        if all(u in in_backward for u in node.users):
            continue
        read = read_by_its_forward(node)
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
    return BackwardRegion(backward, output_gradients, gradients)


_SIZE_READS = (*SHAPE_ONLY_OPS, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
               torch.ops.aten.sym_storage_offset.default)
_VIEWS = (*RESHAPES, torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.as_strided.default)


def _add_autograd_only(candidates: list, in_candidates: set, region: Sequence[Node], readable: set, seqs: set,
                       by_seq: dict) -> None:
    """Add to a region's backward candidates the backward nodes of autograd-only seq_nrs between its
    first and last that read only its backward, its values and what it may read, and at least one
    of the first two: relu_'s backward on a view, made under seq_nrs no forward op carries. (A
    seq_nr is also left without a forward op where an earlier fusion replaced that op, so the
    span alone does not make a node the region's.)"""
    low, high = min(seqs), max(seqs)
    own = set(region)
    orphans = sorted(n for seq in by_seq.get(AUTOGRAD_ONLY, ()) if low < seq < high for n in by_seq.get(seq, ()))
    for node in orphans:  # graph order: a node's operands come first
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if tensors and all(a in in_candidates or a in own or a in readable for a in tensors) \
                and any(a in in_candidates or a in own for a in tensors):
            candidates.append(node)
            in_candidates.add(node)
    candidates.sort()


def _sizes_only(node: Node) -> bool:
    """Whether only the sizes of what `node` reads are read: a size query, or a view whose readers
    read only sizes, or none (under dynamic shapes functionalisation replays an in-place op's views,
    and the graph keeps ones only a sym_size, or nothing, reads)."""
    if node.target in _SIZE_READS:
        return True
    return node.target in _VIEWS and all(_sizes_only(u) for u in node.users)


def _carrying_a_gradient(region: Sequence[Node], seeds: Sequence[Node]) -> set:
    """The region's values a gradient reaches from the outputs that get one (`seeds`): those a
    reader reaching it reads as a floating-point value. Gradients flow through floating-point
    tensors only, so a value that feeds only a top-k's indices, a comparison or a gather's
    index gets none (a router's `scores + bias`, which only selects)."""
    in_region = set(region)
    carrying = set(seeds)
    for node in sorted(region, reverse=True):  # readers first
        if node in carrying:
            continue
        value = node.meta.get("val")
        differentiable = isinstance(value, (tuple, list)) or (
            isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex))
        if differentiable and any(u in carrying for u in node.users if u in in_region):
            carrying.add(node)
    return carrying


def _gradients_of_outputs(outputs, gradients_in, backward, with_backward, in_region):
    """[the gradient of each output (None: none)] among the gradients the backward reads from
    outside, each entering it at its output's op's backward, or at the ops an op with no
    backward node passes it on to (an add's operands); or why they are not that."""
    # where a gradient of each region value enters the backward: its op's backward, or, for an
    # op autograd made no node for, those of its operands' ops it passes the gradient on to
    # (one walk in graph order: operands first)
    entries: dict = {}
    for node in sorted(in_region):
        seq = node.meta.get("seq_nr")
        entries[node] = {seq} if seq in with_backward else set().union(
            *[entries[a] for a in node.all_input_nodes if a in entries])
    # (an integer output has no gradient: a top-k's indices, whose op also computes its values)
    at = [entries.get(output, set()) if _floating(output) else set() for output in outputs]
    found: list = [None] * len(outputs)
    for gradient in gradients_in:
        readers = {n.meta.get("seq_nr") for n in backward if gradient in n.all_input_nodes}
        owners = [i for i, seqs in enumerate(at) if seqs and readers <= seqs]
        if len(owners) != 1:
            return (f"a gradient its backward reads from outside ({gradient.name}) does not enter it at one "
                    "output's backward: an intermediate's gradient is summed with one from elsewhere")
        (i,) = owners
        value, wanted = gradient.meta.get("val"), outputs[i].meta.get("val")
        if found[i] is not None:
            return f"its output {outputs[i].name} has two gradients from outside"
        if not isinstance(wanted, torch.Tensor) or list(value.shape) != list(wanted.shape):
            return f"the gradient of its output {outputs[i].name} is not of that output's shape"
        found[i] = gradient
    if all(g is None for g in found):
        return "its backward reads no gradient from outside"
    return found


def _floating(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex)
