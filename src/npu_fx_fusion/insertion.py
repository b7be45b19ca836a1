"""Putting a replacement into a graph in place of the nodes it replaces.

Shared by the two ways a site is found: torch's pattern matcher (accept.py) and the
recognition of a region by what it computes (recognition.py).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensor

from .canonical import size_reads_from_inputs
from .cleanup import LAYOUT_CHANGED, fake_copy, same_layout

Node = torch.fx.Node



def trace_input(value: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A tensor to trace a replacement on, in the active (fake) mode: `value`'s sizes,
    strides and dtype. A lazily conjugated value (freqs_cis.conj()) stays one, so that a
    replacement's resolve_conj traces as the copy it is at run time."""
    like = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device,
                               requires_grad=requires_grad)
    return like.conj() if value.is_conj() else like

def insert_replacement(match: pm.Match, graph: torch.fx.Graph, replacement: torch.fx.GraphModule,
                       args: Sequence[Any], fake_mode: Any = None,
                       reads_gradient: Optional[Callable[[Node], bool]] = None) -> list[Node]:
    """Copy `replacement` into `graph` in place of the matched nodes; returns the nodes added.

    What torch's ReplacementPatternEntry.replace_with_graph does, in time independent of
    the graph's size: torch finds the first output of a multi-output match with
    `list(graph.nodes).index(...)`, a walk of the whole graph per site, which made a
    pass quadratic in the depth of the model (every decoder layer's add_rms_norm). Nodes
    are ordered, so the first output is the least. The replacement is inserted before it;
    a node it reads that the graph defines later is the caller's to sort out
    (apply_pass sorts the graph then). The copies' fake values are made in `fake_mode`
    (the graph's) when the replacement was traced in another one.

    In a joint graph (`reads_gradient`: whether a node is computed from the tangents), the
    replacement's backward half (what it computes from a gradient argument) goes where
    the backward half it replaces is: before the match's first backward node, or right
    after its latest input where that comes later (an incoming gradient computed between
    the match's backward nodes). So the backward stays after the forward, as torch's
    default_partition needs, without sorting the graph.
    """
    added: list[Node] = []
    env: dict[Node, Any] = {}
    from_gradient: set[Node] = set()  # the replacement's nodes computed from a gradient argument
    placeholders = iter(args)
    outputs = match.output_nodes()
    first_output = min(n for n in outputs if isinstance(n, Node))
    first_backward = None
    if reads_gradient is not None:
        first_backward = min((n for n in match.nodes if reads_gradient(n)), default=None)
    for node in replacement.graph.nodes:
        if node.op == "placeholder":
            env[node] = value = next(placeholders)
            if first_backward is not None and isinstance(value, Node) and reads_gradient(value):
                from_gradient.add(node)
        elif node.op == "call_function":
            before = first_output
            if first_backward is not None and any(i in from_gradient for i in node.all_input_nodes):
                from_gradient.add(node)
                inputs = [env[i] for i in node.all_input_nodes if isinstance(env[i], Node)]
                latest = max(inputs, default=None)
                before = latest.next if latest is not None and latest > first_backward else first_backward
            with graph.inserting_before(before):
                copied = graph.call_function(node.target, *torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__))
            pm._transfer_meta(new_meta=copied.meta, old_node=node)  # noqa: SLF001
            if fake_mode is not None and "val" in copied.meta:
                item = _item_of_source(copied)
                copied.meta["val"] = item if item is not None else _in_mode(copied.meta["val"], fake_mode)
            added.append(copied)
            env[node] = copied
        elif node.op == "output":
            result = torch.fx.node.map_arg(node.args[0], env.__getitem__)
        else:
            raise NotImplementedError(f"a replacement graph with a {node.op} node ({node})")
    new_outputs = [result] if isinstance(result, Node) else list(result)
    if len(outputs) != len(new_outputs):
        if len(outputs) != 1:
            raise RuntimeError(f"the replacement gives {len(new_outputs)} outputs for {len(outputs)}")
        new_outputs = [new_outputs]
    inserted = set(added)
    matched = set(match.nodes)
    read_by_match = {arg for node in match.nodes for arg in node.all_input_nodes if arg not in matched}
    for old, new in zip(outputs, new_outputs):
        _replace_output(graph, old, new, inserted)
    match.erase_nodes()
    for node in reversed(added):  # replacement nodes nothing reads (an unused second output)
        if not node.users and not node.is_impure():
            graph.erase_node(node)
    _erase_dead(graph, read_by_match)
    # the replacement's reads of its arguments' symbolic sizes, as canonicalize spells the graph's
    size_reads_from_inputs(graph, [node for node in added if not node._erased])  # noqa: SLF001
    return [node for node in added if not node._erased]  # noqa: SLF001


def _erase_dead(graph: torch.fx.Graph, candidates: set) -> None:
    """Erase the calls among `candidates` that nothing reads any more (what only the
    replaced nodes read: a value a pattern ignored, a backward's constant), and so on up
    their inputs: dead-code elimination where a replacement can have made code dead, not
    over the whole graph per pass."""
    pending = list(candidates)
    while pending:
        node = pending.pop()
        if node._erased or node.users or node.op != "call_function" or node.is_impure():  # noqa: SLF001
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        pending.extend(inputs)


def _item_of_source(node: Node) -> Any:
    """The value of `getitem(source, i)`: item i of source's, the one fake tensor both nodes
    hold in any aot graph (None where node is no such getitem)."""
    if node.target is not operator.getitem:
        return None
    source, index = node.args
    values = source.meta.get("val") if isinstance(source, Node) else None
    if isinstance(values, (list, tuple)) and isinstance(index, int) and -len(values) <= index < len(values):
        return values[index]
    return None


def _in_mode(value: Any, fake_mode: Any) -> Any:
    """A fake value of another fake mode, made again in `fake_mode` (static sizes only:
    replacements traced for one graph only are already in its mode)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_in_mode(v, fake_mode) for v in value)
    if isinstance(value, FakeTensor) and value.fake_mode is not fake_mode:
        return fake_copy(value, fake_mode)
    return value


def _replace_output(graph: torch.fx.Graph, old: Optional[Node], new: Any, inserted: set) -> None:
    """Point the users of a matched output at its replacement (as torch does, including an
    op with several outputs replaced by a list: its getitems become the list's items)."""
    if old is None:
        return
    not_inserted = lambda user: user not in inserted  # noqa: E731 - the replacement may read `old`
    if new is None:
        old.replace_all_uses_with(None, delete_user_cb=not_inserted)
    elif isinstance(new, Node):
        if not same_layout(old.meta.get("val"), new.meta.get("val")):
            new.meta[LAYOUT_CHANGED] = True
        pm._transfer_meta(new.meta, old)  # noqa: SLF001
        for tag in ("recompute", "ac_graph_id"):  # activation checkpointing's tags, as torch keeps them
            if tag in old.meta:
                _percolate_tag(new, tag, old.meta[tag], inserted)
        old.replace_all_uses_with(new, delete_user_cb=not_inserted)
    else:
        for user in list(old.users):
            if user.op == "call_function" and user.target is operator.getitem:
                _replace_output(graph, user, new[user.args[1]], inserted)
            else:  # as torch does
                old.replace_all_uses_with(new)
    if not old.users:
        graph.erase_node(old)


def _percolate_tag(node: Node, tag: str, value: Any, inserted: set) -> None:
    pending = [node]
    while pending:
        current = pending.pop()
        if current in inserted and current.meta.get(tag) != value:
            current.meta[tag] = value
            pending.extend(current.all_input_nodes)


def _reads_later_node(added: Sequence[Node]) -> bool:
    """A node of `added` reads a node the graph defines after it."""
    new = set(added)
    return any(arg not in new and not arg < node for node in added for arg in node.all_input_nodes)


_SOURCE_META = ("stack_trace", "nn_module_stack")


def _inherit_kept_calls(added: Sequence[Node], erased: Sequence[Node]) -> None:
    """A replacement that keeps an op of the code it replaces (moe_dispatch keeps the
    expert GEMMs for grouped_matmul) gives each kept call the source line of the call it
    stands for, not the site's output line (the combine's `.sum(dim=1)`): the k-th new
    call of an op that as many `erased` nodes of the site called takes the k-th one's
    (both in graph order). An op called a different number of times takes the line of the
    erased call its place in the sequence of calls aligns it with (_aligned_calls): the
    clamped SwiGLU's `act(gate) * up` that moe_dispatch keeps is one of two muls of the site
    it replaces (the other weighs the expert outputs, which finalize_routing does), and is
    the one between the clamps and silu and the down projection. Calls aligned with none, or
    not alike both ways, are left to _inherit_source_meta."""
    erased_by_op: dict[Any, list[Node]] = {}
    for node in erased:
        if isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            erased_by_op.setdefault(node.target, []).append(node)
    added_by_op: dict[Any, list[Node]] = {}
    for node in added:
        if node.target in erased_by_op:
            added_by_op.setdefault(node.target, []).append(node)
    pairs = []
    uneven = set()
    for target, kept in added_by_op.items():
        if len(kept) == len(erased_by_op[target]):
            pairs.extend(zip(kept, erased_by_op[target]))
        else:
            uneven.add(target)
    if uneven:
        calls = lambda nodes: [n for n in nodes if n.target in erased_by_op]  # noqa: E731
        pairs.extend((new, old) for new, old in _aligned_calls(calls(added), calls(erased)) if new.target in uneven)
    for node, old in pairs:
        for key in _SOURCE_META:
            if key not in node.meta and key in old.meta:
                node.meta[key] = old.meta[key]


# a longer alignment (a whole joint site against its replacement) is not worth its time
_ALIGNMENT_CELLS = 500_000


def _aligned_calls(added: Sequence[Node], erased: Sequence[Node]) -> list[tuple[Node, Node]]:
    """The pairs (new call, erased call) of the same op that a longest common subsequence of
    the two call sequences aligns, and aligns alike taken from the front and from the back: a
    call with a choice (two new GEMMs for one erased: which would be which?) gets none."""
    if len(added) * len(erased) > _ALIGNMENT_CELLS:
        return []
    front = _lcs_pairs(added, erased)
    back = {(len(added) - 1 - i, len(erased) - 1 - j) for i, j in _lcs_pairs(added[::-1], erased[::-1])}
    return [(added[i], erased[j]) for i, j in front if (i, j) in back]


def _lcs_pairs(a: Sequence[Node], b: Sequence[Node]) -> list[tuple[int, int]]:
    """Index pairs of a longest common subsequence of a and b by op, matching as early as it can."""
    n, m = len(a), len(b)
    longest = [[0] * (m + 1) for _ in range(n + 1)]  # longest[i][j]: of a[i:] and b[j:]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            longest[i][j] = (longest[i + 1][j + 1] + 1 if a[i].target is b[j].target
                             else max(longest[i + 1][j], longest[i][j + 1]))
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if a[i].target is b[j].target and longest[i][j] == longest[i + 1][j + 1] + 1:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif longest[i + 1][j] >= longest[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _inherit_source_meta(new_nodes: Sequence[Node]) -> None:
    """Give replacement nodes the source line of the code they replaced.

    The pattern matcher copies it onto the replacement's output node only; the fused op
    call under a getitem would otherwise have no source line in dumps and reports.
    """
    for node in reversed(new_nodes):
        for key in _SOURCE_META:
            if key not in node.meta:
                donor = next((u for u in node.users if key in u.meta), None)
                if donor is not None:
                    node.meta[key] = donor.meta[key]
