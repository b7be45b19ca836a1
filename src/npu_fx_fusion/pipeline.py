"""Run the enabled passes in order on one aten-level GraphModule and report on it.

Guarantees, whatever a pass does:
- a pass that raises leaves the graph exactly as it was before that pass, and the error
  is logged and recorded in the report (FusionConfig(strict=True) re-raises instead);
- the graph is linted after every pass;
- running the pipeline again on its own output changes nothing.
"""
from __future__ import annotations

import copy
import importlib
import json
import logging
import time
from typing import Any, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from . import npu_ops
from .capabilities import detect_soc
from .config import FusionConfig
from .dumps import Dumper
from .matching import FusionPass, canonicalize
from .report import FusionReport, GraphCost, GraphReport, PassResult, added_conversions, op_counts

log = logging.getLogger("npu_fx_fusion")
Node = torch.fx.Node

_UNAVAILABLE = object()
_loaded_passes: dict[str, Any] = {}


def load_pass(name: str) -> Optional[FusionPass]:
    """The FusionPass of npu_fx_fusion.patterns.<name>, or None if this version has none."""
    if name not in _loaded_passes:
        try:
            module = importlib.import_module(f"npu_fx_fusion.patterns.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"npu_fx_fusion.patterns.{name}":
                raise
            _loaded_passes[name] = _UNAVAILABLE
        else:
            _loaded_passes[name] = module.PASS
    found = _loaded_passes[name]
    return None if found is _UNAVAILABLE else found


def _ensure_tensor_meta(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]]) -> None:
    """Patterns read node.meta['val'] as fake tensors of one FakeTensorMode.

    aot_autograd graphs have that. A make_fx graph traced in "real" mode has vals from a
    fresh fake mode per node, and a symbolic_trace graph has none: propagate fake values
    through those, from `example_inputs` or else from the placeholders' own metadata.
    """
    computing = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr")]
    vals = [n.meta.get("val") for n in computing]
    modes = {id(v.fake_mode) for v in pytree.tree_leaves(vals) if isinstance(v, FakeTensor)}
    if all(v is not None for v in vals) and len(modes) <= 1:
        return
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    if example_inputs is not None:
        inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    else:
        placeholder_vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        if not all(isinstance(v, torch.Tensor) for v in placeholder_vals):
            raise ValueError(
                "the graph's nodes carry no tensor metadata (node.meta['val']); pass "
                "example_inputs to fuse(), or give it an aot_autograd / make_fx graph")
        with fake_mode:
            inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                      for v in placeholder_vals]
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)


def _graph_code(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


# Ops that only convert or re-view a tensor: pure, so two calls on the same input with the
# same arguments are one value.
_CONVERSIONS = frozenset({
    torch.ops.aten._to_copy.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default, torch.ops.aten.permute.default,
})


def _merge_repeated_conversions(graph: torch.fx.Graph, original_nodes: set) -> int:
    """One node for each repeated conversion that fusion introduced.

    Replacements are traced one site at a time, so two fused ops reading the same tensor
    each bring their own cast of it (the int32 expert ids of init_routing and finalize, the
    int64 group list of each grouped matmul). A repeat is merged into the first node with
    the same op and arguments when one of the two is new; the model's own repeats stay as
    they are. Returns the number of nodes merged.
    """
    npu_cast = getattr(getattr(torch.ops, "npu", None), "_npu_dtype_cast", None)
    conversions = _CONVERSIONS | ({npu_cast.default} if npu_cast is not None else set())
    first: dict[Any, Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in conversions:
            continue
        key = (node.target, _hashable(node.args), _hashable(node.kwargs))
        earlier = first.setdefault(key, node)
        if earlier is not node and (node not in original_nodes or earlier not in original_nodes):
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            merged += 1
    return merged


# dtype -> the dtypes that hold each of its values exactly (a conversion there and back is
# the identity): integer widening, float widening, bool into anything.
_EXACT_IN = {
    torch.bool: {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.uint8: {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.int8: {torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64},
    torch.int16: {torch.int32, torch.int64, torch.float32, torch.float64},
    torch.int32: {torch.int64, torch.float64},
    torch.float16: {torch.float32, torch.float64},
    torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
}


def _drop_lossless_round_trips(graph: torch.fx.Graph, original_nodes: set) -> int:
    """`convert(convert(x, wide), x.dtype)` -> `x` where `wide` holds every value of x's
    dtype exactly, when fusion introduced either conversion.

    Two fusions meeting at an integer tensor each convert it to what their own op or the
    model declares: moe_gating's replacement widens npu_moe_gating_top_k_softmax's int32
    expert ids to the int64 of the top-k it replaces, moe_dispatch narrows them back to
    the int32 npu_moe_init_routing_v2 takes. The pair is the identity; the model's own
    conversions stay. Returns the number of conversions bypassed.
    """
    def dtype_only(node: Node) -> Optional[torch.dtype]:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        if node.target is torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
            return node.kwargs["dtype"]
        npu_cast = getattr(getattr(torch.ops, "npu", None), "_npu_dtype_cast", None)
        if npu_cast is not None and node.target is npu_cast.default and len(node.args) == 2:
            return node.args[1]
        return None

    bypassed = 0
    for outer in list(graph.nodes):
        to = dtype_only(outer)
        inner = outer.args[0] if to is not None else None
        wide = dtype_only(inner) if inner is not None else None
        source = inner.args[0].meta.get("val") if wide is not None else None
        if (not isinstance(source, torch.Tensor) or source.dtype != to
                or wide not in _EXACT_IN.get(to, ()) or {outer, inner} <= original_nodes):
            continue
        outer.replace_all_uses_with(inner.args[0])
        graph.erase_node(outer)
        if not inner.users:
            graph.erase_node(inner)
        bypassed += 1
    return bypassed


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def views_to_reshapes_downstream(new_nodes: Sequence[Node]) -> None:
    """Make every `view` a replacement can reach a `reshape`.

    A fused op's output need not have the strides of what it replaced (torch_npu's meta
    functions return contiguous tensors where elementwise aten kept a transposed layout),
    and aten.view fails on strides it was not traced for. torchair turns every view into
    a reshape right after our pass anyway (_optimize_fx's view_to_reshape); doing it here
    for the views downstream of a fusion keeps fuse() and the emulation backend correct.
    Done once, after every pass: patterns match the graph's own views.
    """
    seen: set[Node] = set()
    pending = list(new_nodes)
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
        pending.extend(node.users)


def run_passes(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport, *,
               graph_name: str, example_inputs: Optional[Sequence[Any]] = None,
               mode: Optional[str] = None) -> GraphReport:
    """Fuse `gm` in place with the passes `config` enables; add its GraphReport to `report`.

    `mode` is the torchair mode the graph will be lowered in (FusionConfig.mode wins).
    """
    start = time.perf_counter()
    npu_ops.ensure_registered()
    _ensure_tensor_meta(gm, example_inputs)
    soc, mode = config.soc or detect_soc(), config.mode or mode
    graph_report, dumper, folder = _begin_graph(gm, config, report, graph_name, mode)

    enabled = config.enabled_passes()
    if enabled:
        # Patterns pin user counts: a dead node (an unused getitem of a multi-output op in
        # a make_fx graph) would look like a user. aot_autograd graphs have none.
        gm.graph.eliminate_dead_code()
        canonicalize(gm.graph)
        gm.recompile()
    original_nodes = set(gm.graph.nodes)
    for name in enabled:
        graph_report.passes.append(_run_one(gm, name, config, soc, mode))
    views_to_reshapes_downstream([n for n in gm.graph.nodes if n not in original_nodes])
    _merge_repeated_conversions(gm.graph, original_nodes)
    _drop_lossless_round_trips(gm.graph, original_nodes)
    graph_report.conversions_added = added_conversions(gm.graph, original_nodes)

    _finish_graph(gm, config, report, graph_report, start, dumper, folder)
    dumper.draw(folder, gm, f"{graph_name}: after npu-fx-fusion", graph_report)
    dumper.write_reports(report)  # again: report.html shows the drawings
    return graph_report


def _begin_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                 graph_name: str, mode: Optional[str]) -> tuple[GraphReport, Dumper, Optional[str]]:
    """The graph's report as it is before fusion, and its dump folder with before.py."""
    graph_report = GraphReport(graph_name, mode=mode, nodes_before=len(gm.graph.nodes),
                               ops_before=op_counts(gm.graph), cost_before=GraphCost.of(gm.graph))
    dumper = Dumper(config.dump_dir)
    folder = dumper.folder(len(report.graphs), graph_name)
    dumper.write(folder, "before.py", _graph_code(gm))
    dumper.keep_before(gm)
    return graph_report, dumper, folder


def _finish_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                  graph_report: GraphReport, start: float, dumper: Dumper, folder: Optional[str]) -> None:
    """Lint, then complete the graph's report, add it to `report`, trace and dump it."""
    gm.graph.lint()
    gm.recompile()
    graph_report.nodes_after = len(gm.graph.nodes)
    graph_report.ops_after = op_counts(gm.graph)
    graph_report.cost_after = GraphCost.of(gm.graph)
    graph_report.seconds = time.perf_counter() - start
    report.add(graph_report)
    # With TORCH_TRACE set, the graph's report goes into torch's structured trace (tlparse
    # shows it next to the compile it belongs to); a no-op otherwise.
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"npu_fx_fusion_report_{graph_report.name}", "encoding": "json"},
        payload_fn=lambda: json.dumps(graph_report.to_dict()),
    )
    dumper.write(folder, "after.py", _graph_code(gm))
    dumper.write_reports(report)


def run_joint_passes(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport, *,
                     graph_name: str = "joint", mode: Optional[str] = None) -> GraphReport:
    """Fuse a joint forward+backward graph (aot_autograd's, before partitioning) in place.

    run_passes for training graphs: each enabled pass that has joint patterns
    (FusionPass.joint_matcher) replaces a forward region AND its backward with the fused
    op and its backward op; the others find nothing here and run after partitioning, as
    the existing forward/backward pipeline does anyway. The same guarantees: a pass that
    raises is reverted, the graph is linted; the GraphReport is added to `report`.
    """
    from .joint import normalize_joint_graph, views_to_reshapes_where_needed

    start = time.perf_counter()
    npu_ops.ensure_registered()
    soc, mode = config.soc or detect_soc(), config.mode or mode
    graph_report, dumper, folder = _begin_graph(gm, config, report, graph_name, mode)
    # only passes with differentiable arguments have joint patterns (or match their
    # forward-only ones there: FusionPass.forward_forms_on_joint)
    passes = [name for name in config.enabled_passes()
              if (fusion_pass := load_pass(name)) is not None
              and (fusion_pass.differentiable or fusion_pass.forward_forms_on_joint)]
    if passes:
        normalize_joint_graph(gm)
    original_nodes = set(gm.graph.nodes)
    for name in passes:
        result = _run_one(gm, name, config, soc, mode, joint=True)
        if result is not None:
            graph_report.passes.append(result)
    new_nodes = [n for n in gm.graph.nodes if n not in original_nodes]
    if new_nodes:
        views_to_reshapes_where_needed(gm, new_nodes)
    _finish_graph(gm, config, report, graph_report, start, dumper, folder)
    return graph_report


def _run_one(gm: torch.fx.GraphModule, name: str, config: FusionConfig, soc: Optional[str],
             mode: Optional[str], joint: bool = False) -> Optional[PassResult]:
    fusion_pass = load_pass(name)
    if fusion_pass is None:
        log.info("pass %r is not implemented in this version of npu-fx-fusion", name)
        return PassResult(name, skipped="not implemented in this version")
    saved = copy.deepcopy(gm.graph)
    start = time.perf_counter()
    try:
        if joint:
            result = fusion_pass.apply_joint(gm, soc, mode, verify=config.verify)
            if result is None:  # no joint patterns: nothing to do, nothing to report
                return None
        else:
            result = fusion_pass.apply(gm, soc, mode, verify=config.verify)
        gm.graph.lint()
    except Exception as exc:
        gm.graph = saved  # the setter re-parents the graph and recompiles
        if config.strict:
            raise
        log.warning("pass %s failed and was reverted: %s: %s", name, type(exc).__name__, exc)
        result = PassResult(name, error=f"{type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - start
    log.info("pass %s: %d fused, %d near misses, %.1f ms", name, len(result.sites),
             len(result.near_misses), result.seconds * 1e3)
    return result
