"""Sites a pass recognised by what a region computes, accepted and replaced like a form's.

A pass's `recognize(graph, joint)` (forms.FusionPass) returns Recognized sites: regions it
evaluated (channel_algebra.py) and found to compute its op, with the fused call that
replaces them, or the reason they cannot be fused. Each goes through the acceptance chain
the matched forms go through (accept.py), in the same order:

1. every op the replacement emits is in the capability table and lowerable in the mode;
2. the pass's own check (hardware limits, layouts);
3. the replacement's outputs of the same shapes and dtypes as the region's output;
4. with FusionConfig(verify=True), numerically equal on random inputs;

and the first that fails is the site's near miss. A region whose nodes a form already
replaced is skipped (the forms run first).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from .canonical import same_shape
from .capabilities import CAPABILITIES, capability, not_lowerable
from .forms import Form, FusionPass, Reason, Recognized, Site
from .insertion import insert_replacement, trace_input
from .nodes import tensor_meta
from .report import FusedSite, NearMiss, location_of
from .tracing import TRACERS, failure_is_an_answer

log = logging.getLogger("npu_fx_fusion.matching")

Node = torch.fx.Node


@dataclass
class RecognitionRun:
    """What accept.apply_pass hands over: the graph's fake mode, the SoC and mode, ..."""

    fusion_pass: FusionPass
    soc: Optional[str]
    mode: Optional[str]
    fake_mode: Any
    verify: bool = False
    keep_intermediate_rounding: bool = False
    before_change: Optional[Callable[[], None]] = None
    reads_gradient: Optional[Callable[[Node], bool]] = None  # joint graphs: computed from a tangent
    dedicated_groups: frozenset = frozenset()  # FusionConfig.ep_group's: Site.dedicated_groups


class _RegionMatch:
    """What insert_replacement reads of a match: its nodes, its output, and how to erase it."""

    def __init__(self, nodes: Sequence[Node], outputs: Sequence[Node]):
        self.nodes = list(nodes)
        self._outputs = list(outputs)

    def output_nodes(self) -> list[Node]:
        return list(self._outputs)

    def erase_nodes(self) -> None:
        # the region's nodes nothing else reads any more (a node another site or the rest of
        # the graph reads stays, and computes what it did)
        for node in sorted(self.nodes, reverse=True):
            if not node._erased and not node.users:  # noqa: SLF001
                node.graph.erase_node(node)


def recognized_sites(run: RecognitionRun, graph: torch.fx.Graph, joint: bool) -> tuple[list, list]:
    """Fuse every Recognized site of the pass in `graph` that passes acceptance.

    Returns (FusedSite list, [(Recognized, NearMiss)] of the refused)."""
    fusion_pass = run.fusion_pass
    sites, misses = [], []
    # alternatives for one region come in the pass's order of preference: the first accepted
    # is fused, the refusals before it become its note, and all of them a near miss if none is
    refused: dict = {}
    for found in fusion_pass.recognize(graph, joint):
        if any(n._erased for n in (*found.outputs, *found.nodes, *found.backward_nodes)):  # noqa: SLF001
            continue  # a form (or an earlier alternative, or recognised site) replaced it
        reason = found.reason
        site = None
        if reason is None:
            if run.before_change is not None:
                run.before_change()
            site = _site(run, found)
            reason, graphs = _accept(run, found, site)
        if reason is not None:
            log.debug("%s: not fusing %s at %s: %s", fusion_pass.name, found.name, location_of(found.nodes), reason)
            refused.setdefault(found.outputs[0], []).append((found, reason))
            continue
        forward, backward = graphs
        nodes = list(found.nodes) + list(found.backward_nodes)
        joint = bool(found.output_gradients)
        notes = [f"instead of {alternative.name}: {why}" for alternative, why in refused.pop(found.outputs[0], [])]
        site_record = FusedSite.of_match(fusion_pass.name, found.name, found.fused_op or fusion_pass.fused_op,
                                         nodes, found.outputs, None, [*notes, *_notes(run, found, site, graphs)],
                                         site.verified, [op for g in graphs if g is not None for op in emitted_ops(g)])
        if joint:  # forward and backward at once, the backward half placed where autograd's was
            insert_replacement(_RegionMatch(nodes, found.outputs + found.backward_outputs), graph, forward,
                               [*found.args.values(), *_tangents(found)], run.fake_mode, run.reads_gradient)
            _RegionMatch(found.nodes, found.outputs).erase_nodes()
        else:
            insert_replacement(_RegionMatch(found.nodes, found.outputs), graph, forward,
                               [found.args[name] for name in found.args], run.fake_mode)
        if backward is not None:
            insert_replacement(_RegionMatch(found.backward_nodes, found.backward_outputs), graph, backward,
                               [found.backward_args[name] for name in found.backward_args], run.fake_mode,
                               run.reads_gradient)
            # the forward nodes only the replaced backward read
            _RegionMatch(found.nodes, found.outputs).erase_nodes()
        sites.append(site_record)
    for output, refusals in refused.items():
        found, reason = refusals[0]
        if not output._erased:  # noqa: SLF001
            misses.append((found, NearMiss(fusion_pass.name, reason, location_of([output, *output.users]))))
    return sites, misses


def _tangents(found: Recognized) -> list[Node]:
    """The incoming gradients of a joint replacement's trace, in its tangents' order: one per
    output that can have one (aot_autograd makes no tangent for an integer output, a router's
    expert ids)."""
    return [gradient for output, gradient in zip(found.outputs, found.output_gradients)
            if tensor_meta(output).dtype.is_floating_point or tensor_meta(output).dtype.is_complex]


def _site(run: RecognitionRun, found: Recognized) -> Site:
    def recognized(**_: Any) -> None:  # names the spelling in the report
        raise NotImplementedError("a recognised site has no search function")

    recognized.__name__ = found.name
    form = Form(recognized, found.replace, fused_op=found.fused_op)
    site = Site(form, dict(found.site_args), list(found.nodes), dict(found.args), run.soc, run.mode,
                keep_intermediate_rounding=run.keep_intermediate_rounding, dedicated_groups=run.dedicated_groups)
    site.notes.extend(found.notes)
    return site


def _accept(run: RecognitionRun, found: Recognized, site: Site) -> tuple[Reason, Any]:
    # the check reads the shape environment before anything is traced in it: a trace can
    # teach it facts (a reshape's inferred size asserts its divisor is not 0)
    reason = run.fusion_pass.check(site)
    if reason:
        return reason, None
    try:
        forward = _trace(run, found.replace, found.args, found.needs_gradient if found.output_gradients else None)
        backward = _trace(run, found.backward_replace, found.backward_args) if found.backward_replace else None
    except (RuntimeError, ValueError, TypeError) as exc:
        return f"{found.name}: the fused call does not trace at this site: {type(exc).__name__}: {exc}", None
    for graph in (forward, backward):
        reason = _emitted_ops_refused(run, graph)
        if reason:
            return reason, None
    reason = _output_differs(run.fusion_pass, forward, found.outputs + (found.backward_outputs
                                                                        if found.output_gradients else []))
    if reason is None and backward is not None:
        reason = _output_differs(run.fusion_pass, backward, found.backward_outputs)
    if reason:
        return reason, None
    if run.verify:
        reason = _verify(run, found, site)
        if reason:
            return reason, None
    return None, (forward, backward)


def _trace(run: RecognitionRun, replace: Callable, args: dict,
           needs_gradient: Optional[Sequence[str]] = None) -> torch.fx.GraphModule:
    """`replace` traced on the arguments' values; jointly (forward and backward) when
    `needs_gradient` names the arguments whose gradients it computes."""
    values = {name: a.meta["val"] if isinstance(a, Node) else a for name, a in args.items()}
    with run.fake_mode, failure_is_an_answer():
        if needs_gradient is None:
            traced = [trace_input(v) if isinstance(v, torch.Tensor) else v for v in values.values()]
            return TRACERS["forward"](replace, traced)
        traced = [trace_input(v, name in needs_gradient) if isinstance(v, torch.Tensor) else v
                  for name, v in values.items()]
        joint = TRACERS["joint"](replace, traced)
    # its outputs: the forward's, then a gradient per argument (None for those that need none)
    (output,) = joint.graph.find_nodes(op="output")
    output.args = ([value for value in output.args[0] if value is not None],)
    joint.recompile()
    return joint


def emitted_ops(graph: torch.fx.GraphModule) -> list[str]:
    """The fused ops (npu.*, cann_ops_*.*) a traced replacement calls, less the backward ops
    of fused ops (their forward op's capability row speaks for them)."""
    backward_ops = {cap.backward for cap in CAPABILITIES.values() if cap.backward}
    ops = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            namespace = node.target.namespace
            if namespace not in ("aten", "prims", "_c10d_functional", "higher_order"):
                op = f"{namespace}.{node.target._opname}"  # noqa: SLF001
                if op not in backward_ops:
                    ops.append(op)
    return ops


def _emitted_ops_refused(run: RecognitionRun, graph: Optional[torch.fx.GraphModule]) -> Reason:
    if graph is None:
        return None
    for op in emitted_ops(graph):
        capability(op)  # raises for an op the table lacks: a pass may emit none
        reason = not_lowerable(op, run.mode)
        if reason:
            return reason
    return None


def _output_differs(fusion_pass: FusionPass, graph: torch.fx.GraphModule, outputs: Sequence[Node]) -> Reason:
    (out,) = graph.graph.find_nodes(op="output")
    news = out.args[0]
    news = list(news) if isinstance(news, (list, tuple)) else [news]
    if len(outputs) == 1:
        news = news[:1]
    if len(news) != len(outputs):
        return f"{fusion_pass.fused_op} would give {len(news)} values where the model computes {len(outputs)}"
    for new, output in zip(news, outputs):
        new_value = new.meta.get("val") if isinstance(new, Node) else None
        old = output.meta.get("val")
        if not isinstance(new_value, torch.Tensor):
            return f"{fusion_pass.fused_op} would give no tensor where the model computes one"
        if old.dtype != new_value.dtype or not same_shape(old, new_value):
            return (f"{fusion_pass.fused_op} would give {_describe(new_value)} where the model computes "
                    f"{_describe(old)}")
    return None


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _verify(run: RecognitionRun, found: Recognized, site: Site) -> Reason:
    from .verify import verify_match

    argnames = list(found.args)
    values = {name: a.meta["val"] if isinstance(a, Node) else a for name, a in found.args.items()}
    verdict = verify_match(list(found.nodes), found.outputs, values, dict(found.args), found.replace, argnames,
                           found.fused_op or run.fusion_pass.fused_op, canonical=found.canonical_outputs)
    site.verified = verdict.detail
    return None if verdict.ok else f"verification failed: {verdict.detail}"


def _notes(run: RecognitionRun, found: Recognized, site: Site, graphs: Any) -> list[str]:
    notes = list(site.notes)
    if run.mode is None:  # emulation: say what torchair's GE mode would refuse
        for graph in graphs:
            if graph is not None:
                notes += [reason for op in emitted_ops(graph) if (reason := not_lowerable(op, "max-autotune"))]
    return list(dict.fromkeys(notes))
