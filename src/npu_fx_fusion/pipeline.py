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
import os
import re
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
from .matching import FusionPass, canonicalize
from .report import FusionReport, GraphCost, GraphReport, PassResult, op_counts

log = logging.getLogger("npu_fx_fusion")

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
    computing = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr") and not _returns_nothing(n)]
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


def _returns_nothing(node: torch.fx.Node) -> bool:
    """An op with no outputs, whose meta['val'] is None in every graph: the runtime checks
    of data-dependent sizes (`aten._assert_scalar` after `.tolist()` in an expert-parallel
    dispatch, docs/expert-parallel.md)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.returns


def _graph_code(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class _Dumper:
    """Writes graph_NNN_<name>/{before.py, after.py, after.svg} and the report under dump_dir."""

    def __init__(self, dump_dir: Optional[str]):
        self.dump_dir = dump_dir

    def folder(self, index: int, name: str) -> Optional[str]:
        if not self.dump_dir:
            return None
        path = os.path.join(self.dump_dir, f"graph_{index:03d}_{re.sub(r'[^A-Za-z0-9_]+', '_', name)}")
        os.makedirs(path, exist_ok=True)
        return path

    @staticmethod
    def write(folder: Optional[str], filename: str, text: str) -> None:
        if folder:
            with open(os.path.join(folder, filename), "w", encoding="utf-8") as f:
                f.write(text)

    def draw(self, folder: Optional[str], gm: torch.fx.GraphModule, title: str) -> None:
        """after.svg: the graph with its fused ops highlighted (needs pydot and Graphviz).

        A drawing is a convenience: one that fails is logged, never an error of the compile.
        """
        if not folder:
            return
        from .drawing import fused_nodes, graph_svg

        try:
            svg = graph_svg(gm, fused_nodes(gm), title)
        except Exception as exc:  # noqa: BLE001 - Graphviz failing must not fail a compile
            log.warning("could not draw %s: %s: %s", title, type(exc).__name__, exc)
            return
        if svg is not None:
            self.write(folder, "after.svg", svg)


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

    _finish_graph(gm, config, report, graph_report, start, dumper, folder)
    dumper.draw(folder, gm, f"{graph_name}: after npu-fx-fusion")
    return graph_report


def _begin_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                 graph_name: str, mode: Optional[str]) -> tuple[GraphReport, "_Dumper", Optional[str]]:
    """The graph's report as it is before fusion, and its dump folder with before.py."""
    graph_report = GraphReport(graph_name, mode=mode, nodes_before=len(gm.graph.nodes),
                               ops_before=op_counts(gm.graph), cost_before=GraphCost.of(gm.graph))
    dumper = _Dumper(config.dump_dir)
    folder = dumper.folder(len(report.graphs), graph_name)
    dumper.write(folder, "before.py", _graph_code(gm))
    return graph_report, dumper, folder


def _finish_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                  graph_report: GraphReport, start: float, dumper: "_Dumper", folder: Optional[str]) -> None:
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
    if config.dump_dir:
        dumper.write(config.dump_dir, "report.md", report.to_markdown())
        dumper.write(config.dump_dir, "report.json", report.to_json())


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
