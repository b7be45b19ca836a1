"""A residual add and the RMSNorm it feeds, compiled into two graphs by a graph break.

npu_add_rms_norm takes the add and the norm in one graph. Where dynamo breaks the graph
between them (an MoE layer's data-dependent op or `.tolist()`, a frame that ends with the
add and a next one that starts with the norm), the add ends one compiled graph and the norm
starts another, and no pass sees both: the norm fuses alone, and nothing else would say why
the pair did not. Which tensor a graph's input is only shows when the graphs run, so:

- at compile time, `residual_outputs` reads off dynamo's graph the outputs an add of two
  same-shape tensors computes, and `normed_inputs` (pipeline, after the passes) the inputs
  of an aot graph a fused npu_rms_norm reads;
- `watching` wraps the compiled graph: the tensors its residual outputs return are noted
  (weakly), and an input that is one of them, read by a fused norm, is such a pair. The
  norm's graph then gets a near miss of add_rms_norm naming both lines, once per pair, with
  how often it was seen (NearMiss.observed).
"""
from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx

from .nodes import MOVES, is_call, is_cast
from .report import GraphReport, NearMiss, SourceLocation, location_of

PASS = "add_rms_norm"
_ADDS = (operator.add, torch.add, torch.Tensor.add, torch.ops.aten.add.Tensor)
# the tensors residual outputs returned, by id, and where the add is (weak: a tensor gone
# leaves no entry, so an id is never mistaken for a later tensor's)
_RETURNED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_ADD_AT: dict[int, SourceLocation] = {}


def residual_outputs(gm: torch.fx.GraphModule) -> dict[int, SourceLocation]:
    """{output position: the add's location} for dynamo graph outputs that are an add of two
    tensors of the result's shape (a residual stream, not a bias)."""
    (output,) = gm.graph.find_nodes(op="output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    found = {}
    for position, node in enumerate(values):
        if not isinstance(node, torch.fx.Node) or not _is_add(node):
            continue
        result = _example(node)
        operands = [_example(a) for a in node.args[:2]]
        if (isinstance(result, torch.Tensor) and result.is_floating_point()
                and all(isinstance(o, torch.Tensor) and o.shape == result.shape for o in operands)):
            found[position] = location_of([node])
    return found


def _is_add(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("add", "__add__") and "alpha" not in node.kwargs
    return node.op == "call_function" and node.target in _ADDS and "alpha" not in node.kwargs


def _example(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def normed_inputs(gm: torch.fx.GraphModule) -> dict[int, SourceLocation]:
    """{placeholder position: the norm's location} for the inputs of an aot graph that a fused
    npu_rms_norm reads as its x (directly, or through casts and views)."""
    npu = getattr(torch.ops, "npu", None)
    norm = getattr(getattr(npu, "npu_rms_norm", None), "default", None)
    if norm is None:
        return {}
    positions = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    found = {}
    for call in gm.graph.find_nodes(op="call_function", target=norm):
        x = call.args[0]
        while is_cast(x) or is_call(x, *MOVES):
            x = x.args[0]
        if x in positions:
            found.setdefault(positions[x], location_of([call, *call.users]))
    return found


def lifted(gm: torch.fx.GraphModule) -> int:
    """How many inputs aot_autograd puts before the dynamo graph's own: the parameters and
    buffers `gm` holds as attributes (aot_module_simplified lifts them first)."""
    return (len(dict(gm.named_parameters(remove_duplicate=False)))
            + len(dict(gm.named_buffers(remove_duplicate=False))))


def watching(compiled: Callable, residuals: dict[int, SourceLocation], graphs: Sequence[GraphReport],
             lifted_inputs: int = 0) -> Callable:
    """`compiled` (called with the dynamo graph's flat inputs, returning its outputs), noting
    the tensors its residual outputs return and the inputs its fused norms read that an
    earlier graph's residual add returned (a near miss in `graphs`' add_rms_norm result).
    `lifted_inputs`: the aot graphs' placeholders before the dynamo graph's inputs."""
    norms = {}
    for graph in graphs:
        if graph.name in ("inference", "forward"):
            norms.update({position - lifted_inputs: at for position, at in graph.normed_inputs.items()
                          if position >= lifted_inputs})
    # where add_rms_norm ran on this compile's graphs (in training: the joint graph)
    results = [r for g in graphs for r in g.passes if r.pass_name == PASS and r.skipped is None]
    if not residuals and not (norms and results):
        return compiled
    seen: dict[tuple, int] = {}  # (add, norm) -> its near miss's index in results[-1]

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        if results:
            for position, norm_at in norms.items():
                value = flat[position] if position < len(flat) else None
                if isinstance(value, torch.Tensor) and _RETURNED.get(id(value)) is value:
                    _note(results[-1], seen, _ADD_AT[id(value)], norm_at)
        outputs = compiled(*args)
        values = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        for position, add_at in residuals.items():
            value = values[position] if position < len(values) else None
            if isinstance(value, torch.Tensor):
                _RETURNED[id(value)] = value
                _ADD_AT[id(value)] = add_at
        if len(_ADD_AT) > 2 * len(_RETURNED) + 64:  # forget the locations of tensors gone
            for gone in set(_ADD_AT) - set(_RETURNED.keys()):
                del _ADD_AT[gone]
        return outputs

    return run


def _note(result: Any, seen: dict, add_at: SourceLocation, norm_at: SourceLocation) -> None:
    """One more sighting of the pair: its near miss in `result` (`seen`: pair -> its index)."""
    key = (str(add_at), str(norm_at))
    if key in seen:
        old = result.near_misses[seen[key]]
        result.near_misses[seen[key]] = old._replace(observed=old.observed + 1)
        return
    seen[key] = len(result.near_misses)
    result.near_misses.append(NearMiss(
        PASS, f"the residual add at {add_at} ends one compiled graph and this RMSNorm starts another (a graph "
              "break between them): npu_add_rms_norm takes the add and the norm in one graph", norm_at, 1))
