"""Run the enabled passes in order on one aten-level GraphModule and report on it.

Guarantees, whatever a pass does:
- a pass that raises leaves the graph exactly as it was before that pass, and the error
  is logged and recorded in the report (FusionConfig(strict=True) re-raises instead);
- the graph is linted after every pass;
- running the pipeline again on its own output changes nothing.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from . import cost_model, npu_ops
from .accept import apply_pass
from .canonical import canonicalize, normalize_joint_graph
from .capabilities import CAPABILITIES, detect_soc
from .catalog import load_pass
from .cleanup import (LAYOUT_CHANGED, copies_for_contiguous_inputs, drop_lossless_round_trips,
                      merge_repeated_fused_calls, merge_repeated_pure_calls, views_to_reshapes_where_needed)
from .config import FusionConfig
from .dumps import Dumper
from .forms import FinishOptions
from .graph_breaks import normed_inputs
from .nodes import op_name
from .report import FusionReport, GraphCost, GraphCosts, GraphReport, NearMiss, PassResult, added_conversions, op_counts

log = logging.getLogger("npu_fx_fusion")

Node = torch.fx.Node


def _ensure_tensor_meta(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]]) -> None:
    """Patterns read node.meta['val'] as fake tensors of one FakeTensorMode.

    aot_autograd graphs have that. A make_fx graph traced in "real" mode has vals from a
    fresh fake mode per node, and a symbolic_trace graph has none: propagate fake values
    through those, from `example_inputs` or else from the placeholders' own metadata.
    """
    if _fake_values_of_one_mode(gm.graph):
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


def _fake_values_of_one_mode(graph: torch.fx.Graph) -> bool:
    """Every node that computes a value has one, and its fake tensors share one mode."""
    modes: set = set()
    for node in graph.nodes:
        if node.op in ("output", "get_attr"):
            continue
        value = node.meta.get("val")
        # (a node's value is mostly one tensor: tested first, without a generator per node,
        # a third of the time on a partitioned training graph)
        if isinstance(value, FakeTensor):
            modes.add(id(value.fake_mode))
        elif isinstance(value, (list, tuple)):
            modes.update(id(tensor.fake_mode) for tensor in _fake_tensors(value))
        elif value is None and not _returns_nothing(node):
            return False
    return len(modes) <= 1


def _fake_tensors(values: Sequence[Any]) -> Any:
    """The fake tensors in a (nested) list or tuple of values."""
    for item in values:
        if isinstance(item, FakeTensor):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _fake_tensors(item)


def _returns_nothing(node: torch.fx.Node) -> bool:
    """An op with no outputs, whose meta['val'] is None in every graph: the runtime checks
    of data-dependent sizes (`aten._assert_scalar` after `.tolist()` in an expert-parallel
    dispatch, docs/expert-parallel.md)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.returns


def _graph_code(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


@functools.lru_cache(maxsize=None)
def _pure_fused_ops() -> frozenset:
    """The ops the passes emit that are functional and deterministic: every declared op (its
    reference kernel computes its outputs from its arguments alone) whose schema mutates and
    aliases nothing."""
    ops = set()
    for spec in npu_ops.all_specs().values():
        op = getattr(getattr(torch.ops, spec.namespace, None), spec.name, None)
        schema = op.default._schema if op is not None and hasattr(op, "default") else None  # noqa: SLF001
        if schema is not None and not schema.is_mutable and not any(r.alias_info for r in schema.returns):
            ops.add(op.default)
    return frozenset(ops)


def _takes_contiguous_inputs(node: torch.fx.Node) -> bool:
    """A call of a fused op whose kernel takes no strided tensor (its capability's limits)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return False
    capability = CAPABILITIES.get(op_name(target))
    return capability is not None and bool(capability.limits.get("contiguous"))


def run_passes(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport, *,
               graph_name: str, example_inputs: Optional[Sequence[Any]] = None,
               mode: Optional[str] = None, earlier_results: Sequence[PassResult] = ()) -> GraphReport:
    """Fuse `gm` in place with the passes `config` enables; add its GraphReport to `report`.

    `mode` is the torchair mode the graph will be lowered in (FusionConfig.mode wins).
    `earlier_results`: what a transform of the graph this one was traced from did (the
    backend's merged_projections on the dynamo graph), reported with this graph.
    """
    start = time.perf_counter()
    npu_ops.ensure_registered()
    _ensure_tensor_meta(gm, example_inputs)
    soc, mode = _soc(config, report), config.mode or mode
    graph_report, dumper, folder, before = _begin_graph(gm, config, report, graph_name, mode)
    graph_report.passes.extend(earlier_results)

    enabled = config.enabled_passes()
    done_in_joint = _done_in_joint_graph(gm.graph)
    for name in [name for name in enabled if name in done_in_joint]:
        graph_report.passes.append(PassResult(name, skipped="done in the joint graph this graph was split from"))
    enabled = [name for name in enabled if name not in done_in_joint]
    if enabled:
        # Patterns pin user counts: a dead node (an unused getitem of a multi-output op in
        # a make_fx graph) would look like a user. aot_autograd graphs have none.
        if any(not n.users and n.op == "call_function" for n in gm.graph.nodes):
            gm.graph.eliminate_dead_code()
        canonicalize(gm.graph)
    original_nodes = set(gm.graph.nodes)
    snapshot = before if enabled else None  # a failure after the passes restores the graph as given
    try:
        results = []
        for name in enabled:
            result, original_nodes = _run_one(gm, name, config, soc, mode, original_nodes)
            graph_report.passes.append(result)
            results.append(result)
            if result.sites:  # before the next pass: one call per value it may fuse further
                merge_repeated_fused_calls(gm.graph, original_nodes, _pure_fused_ops())
        original_nodes = _run_finishes(gm, results, config, soc, mode, original_nodes)
        views_to_reshapes_where_needed(gm, [n for n in gm.graph.nodes if n not in original_nodes])
        copies_for_contiguous_inputs(gm.graph, _takes_contiguous_inputs)
        merge_repeated_pure_calls(gm.graph, original_nodes)
        drop_lossless_round_trips(gm.graph, original_nodes)
        graph_report.conversions_added = added_conversions(gm.graph, original_nodes)
        gm.graph.lint()
    except Exception as exc:
        # each pass reverts what fails in it; this is what fails after them
        original_nodes = set(_revert(gm, snapshot, exc, config, graph_report, "cleanup after the passes").values())
        graph_report.conversions_added.clear()  # the graph is back as it was: none added

    _finish_graph(gm, config, report, graph_report, start, dumper, folder, before)
    dumper.draw(folder, gm, f"{graph_name}: after npu-fx-fusion", original_nodes, graph_report)
    dumper.write_reports(report)  # again: report.html shows the drawings
    return graph_report


def _soc(config: FusionConfig, report: FusionReport) -> Optional[str]:
    """The SoC whose limits the passes apply: FusionConfig.soc, else the NPU's (torch_npu),
    else None (CPU emulation: limits the stand-ins do not have become notes). The report
    says which (FusionReport.soc)."""
    soc = config.soc or detect_soc()
    report.soc, report.soc_detected = soc, config.soc is None and soc is not None
    return soc


def _begin_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                 graph_name: str, mode: Optional[str]) -> tuple[GraphReport, Dumper, Optional[str], "_Snapshot"]:
    """The graph's report as it is before fusion, its dump folder with before.py, and a
    record of the graph for the report's cost estimates."""
    graph_report = GraphReport(graph_name, mode=mode, nodes_before=len(gm.graph.nodes), ops_before=op_counts(gm.graph))
    dumper = Dumper(config.dump_dir)
    folder = dumper.folder(len(report.graphs), graph_name)
    if folder:
        dumper.write(folder, "before.py", _graph_code(gm))
        dumper.keep_before(gm)
    return graph_report, dumper, folder, _Snapshot(gm.graph)


def _measure_later(graph_report: GraphReport, before: "_Snapshot", after: "_Snapshot") -> None:
    """The report's cost estimates, worked out from the two records when first read
    (GraphReport.measure)."""
    def measure() -> GraphCosts:
        graph_before, graph_after = before.copy(), after.copy()
        return GraphCosts(GraphCost.of(graph_before), GraphCost.of(graph_after),
                          cost_model.estimates(graph_before, graph_report.mode),
                          cost_model.estimates(graph_after, graph_report.mode))

    graph_report.measure_with(measure)


def _finish_graph(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                  graph_report: GraphReport, start: float, dumper: Dumper, folder: Optional[str],
                  before: "_Snapshot") -> None:
    """Complete the graph's report (the graph is linted where it changed), add it to
    `report`, trace and dump it."""
    gm.recompile()
    graph_report.nodes_after = len(gm.graph.nodes)
    graph_report.ops_after = op_counts(gm.graph)
    _measure_later(graph_report, before, _Snapshot(gm.graph))
    graph_report.normed_inputs = normed_inputs(gm)
    graph_report.seconds = time.perf_counter() - start
    report.add(graph_report)
    # With TORCH_TRACE set, the graph's report goes into torch's structured trace (tlparse
    # shows it next to the compile it belongs to); a no-op otherwise.
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"npu_fx_fusion_report_{graph_report.name}", "encoding": "json"},
        payload_fn=lambda: json.dumps(graph_report.to_dict()),
    )
    if folder:
        dumper.write(folder, "after.py", _graph_code(gm))
    dumper.write_reports(report)


def run_joint_passes(gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport, *,
                     graph_name: str = "joint", mode: Optional[str] = None,
                     earlier_results: Sequence[PassResult] = ()) -> "FusedJoint":
    """Fuse a joint forward+backward graph (aot_autograd's, before partitioning) in place.

    run_passes for training graphs: each enabled pass that has joint patterns replaces a
    forward region AND its backward with the fused op and its backward op; the others
    find nothing here and run after partitioning, as do those that left a near miss here
    (the passes done here skip the forward and backward graphs: _mark_done_in_joint_graph).
    The same guarantees: a pass that raises is reverted, the graph is linted; the
    GraphReport is added to `report`. Partition the graph with the FusedJoint returned:
    a fused graph the partitioner cannot split is reverted there and split unfused.
    """
    start = time.perf_counter()
    npu_ops.ensure_registered()
    soc, mode = _soc(config, report), config.mode or mode
    graph_report, dumper, folder, before = _begin_graph(gm, config, report, graph_name, mode)
    graph_report.passes.extend(earlier_results)
    # only passes with differentiable arguments have joint patterns (or match their
    # forward-only ones there: FusionPass.forward_forms_on_joint)
    passes = [name for name in config.enabled_passes()
              if (fusion_pass := load_pass(name)) is not None
              and (fusion_pass.differentiable or fusion_pass.forward_forms_on_joint)]
    snapshot = before if passes else None  # (the graph as _begin_graph recorded it)
    fused = False
    try:
        if passes:
            relaid = normalize_joint_graph(gm)
            if relaid:  # gradient sums re-folded into another layout: the views after them follow
                for node in relaid:
                    node.meta[LAYOUT_CHANGED] = True
                views_to_reshapes_where_needed(gm, relaid)
        original_nodes = set(gm.graph.nodes)
        from_tangents: dict = {}  # accept._reads_tangents' memo, shared by the passes
        results = []
        for name in passes:
            result, original_nodes = _run_one(gm, name, config, soc, mode, original_nodes, joint=True,
                                              from_tangents=from_tangents)
            if result is not None:
                graph_report.passes.append(result)
                results.append(result)
        original_nodes = _run_finishes(gm, results, config, soc, mode, original_nodes)
        new_nodes = [n for n in gm.graph.nodes if n not in original_nodes]
        if new_nodes:
            views_to_reshapes_where_needed(gm, new_nodes)
            gm.graph.lint()
            fused = True
        _mark_done_in_joint_graph(gm.graph, [r.pass_name for r in graph_report.passes
                                             if not r.error and not r.near_misses])
    except Exception as exc:
        # the passes each revert what fails in them; this is what fails between or after
        # them: the joint graph goes back unfused
        _revert(gm, snapshot, exc, config, graph_report, "joint graph")
    _finish_graph(gm, config, report, graph_report, start, dumper, folder, before)
    return FusedJoint(gm, config, report, graph_report, snapshot if fused else None, dumper, folder, before)


class FusedJoint:
    """A joint graph as the passes left it, to be partitioned.

    The passes cannot know whether the partitioner will split what they fused (torchair's
    default_partition takes every node up to the last forward one as forward: a backward
    op placed among them fails it); the partition is where that shows, so it is tried
    there, on the graph itself, and a fused graph that does not split is reverted to the
    unfused one and split again, its sites near misses naming the error. A graph the passes
    did not change is partitioned as it is: its failure is not ours to hide.
    """

    def __init__(self, gm: torch.fx.GraphModule, config: FusionConfig, report: FusionReport,
                 graph_report: GraphReport, snapshot: Optional["_Snapshot"], dumper: Dumper,
                 folder: Optional[str], before: "_Snapshot"):
        self.gm, self.config, self.report, self.graph_report = gm, config, report, graph_report
        self._snapshot, self._dumper, self._folder, self._before = snapshot, dumper, folder, before

    @property
    def fused(self) -> bool:
        return self._snapshot is not None

    def partition(self, partition_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """partition_fn(self.gm, *args, **kwargs), unfused if it fails on the fused graph."""
        if self._snapshot is None:
            return partition_fn(self.gm, *args, **kwargs)
        try:
            return partition_fn(self.gm, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reverted and reported, or re-raised with strict
            self.revert(exc)
        return partition_fn(self.gm, *args, **kwargs)

    def check(self) -> None:
        """Partition a copy as torchair does (default_partition), where the caller cannot
        partition through `partition`; revert the graph if that fails."""
        from torch._functorch.partitioners import default_partition

        if self._snapshot is None:
            return
        output = next(iter(self.gm.graph.find_nodes(op="output")))
        outputs = len(pytree.tree_leaves(output.args))
        primals = sum(1 for n in self.gm.graph.find_nodes(op="placeholder") if str(n.target).startswith("primals"))
        try:
            default_partition(copy.deepcopy(self.gm), None, num_fwd_outputs=outputs - primals)
        except Exception as exc:  # noqa: BLE001
            self.revert(exc)

    def revert(self, exc: Exception) -> None:
        """Put the joint graph back unfused after `exc` failed its partition; say so in its
        report (and its dumps) as a failure of the passes would."""
        start = time.perf_counter()
        _revert(self.gm, self._snapshot, exc, self.config, self.graph_report, "joint graph's partition")
        _mark_done_in_joint_graph(self.gm.graph, [])  # unfused: its parts get every pass
        self._snapshot = None
        graph_report = self.graph_report
        graph_report.nodes_after = len(self.gm.graph.nodes)
        graph_report.ops_after = op_counts(self.gm.graph)
        _measure_later(graph_report, self._before, _Snapshot(self.gm.graph))
        graph_report.seconds += time.perf_counter() - start
        if self._folder:
            self._dumper.write(self._folder, "after.py", _graph_code(self.gm))
        self._dumper.write_reports(self.report)


# The passes a joint graph's run completed, on its placeholders' meta: the partitioner
# copies their meta into the forward graph's primals and the backward graph's tangents.
_DONE_IN_JOINT = "npu_fx_fusion_done_in_joint"


def _mark_done_in_joint_graph(graph: torch.fx.Graph, passes: Sequence[str]) -> None:
    """Record that `passes` are done with the joint graph `graph`: each fused every
    candidate it found there (no near miss, no error). Its forward and backward graphs are
    then not searched again by them: the forward graph is the joint graph's forward half,
    whose candidates they fused (forward forms too, at sites no gradient flows through).
    A pass that left a near miss runs again after partitioning, where a site it refused may
    still fuse forward-only (its backward then stays as autograd made it)."""
    done = frozenset(passes)
    for node in graph.find_nodes(op="placeholder"):
        node.meta[_DONE_IN_JOINT] = done


def _done_in_joint_graph(graph: torch.fx.Graph) -> frozenset:
    """The passes done with the joint graph `graph` was partitioned from (none for a graph
    that is not a part of a fused joint graph)."""
    return next((node.meta[_DONE_IN_JOINT] for node in graph.find_nodes(op="placeholder")
                 if _DONE_IN_JOINT in node.meta), frozenset())


def _revert(gm: torch.fx.GraphModule, snapshot: Optional["_Snapshot"], exc: Exception, config: FusionConfig,
            graph_report: GraphReport, what: str) -> dict[Node, Node]:
    """Put `gm` back as `snapshot` holds it after `exc` failed `what` (re-raise it with
    strict, or with no snapshot); its report says so. Returns {snapshot node: rebuilt node}."""
    if config.strict or snapshot is None:
        raise exc
    rebuilt = snapshot.restore(gm)
    _unfuse_report(graph_report, exc, config, what)
    return rebuilt


def _unfuse_report(graph_report: GraphReport, exc: Exception, config: FusionConfig, what: str) -> None:
    """Turn a reverted graph's fused sites into near misses naming the error; say so in one line."""
    error = _one_line(exc)
    for result in graph_report.passes:
        result.near_misses = [NearMiss(result.pass_name, f"fused, then reverted with the {what}: {error}",
                                       site.location) for site in result.sites] + result.near_misses
        result.sites = []
    graph_report.passes.append(PassResult(what, error=error))
    where = _log_failure(what, exc, config)
    log.warning("%s: fusion failed and was reverted: %s (%s)", what, error, where)


def _one_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(exc).__name__}: {first}"


def _log_failure(what: str, exc: Exception, config: FusionConfig) -> str:
    """Write the whole error (its traceback, a graph it may print) where it does not flood
    the console: the dump dir if there is one, else the debug log. Returns where it went."""
    import traceback

    text = "".join(traceback.format_exception(exc))
    if config.dump_dir:
        name = re.sub(r"[^A-Za-z0-9_]+", "_", what)
        path = os.path.join(config.dump_dir, f"error_{name}.txt")
        os.makedirs(config.dump_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(text + "\n")
        return f"full text in {path}"
    log.debug("%s failed:\n%s", what, text)
    return "full text in the debug log: logging.getLogger('npu_fx_fusion').setLevel(logging.DEBUG)"


class _Snapshot:
    """Enough of a graph to rebuild it exactly as it was: every node's op, target,
    arguments, name, type and meta, in order.

    Taking one costs a tuple per node, not a copy of the graph (a deep copy of a
    3000-node graph takes ~30 ms, a tenth of a second per pass at scale); only a pass
    that fails pays for the rebuild. A pass may change nodes in place (targets, args),
    insert, erase and reorder them: the records hold what each was. Meta dicts are kept,
    not copied: what a pass writes into an existing node's meta (the matcher's mutation
    region ids) describes the node, whatever the pass does next.

    The report's cost estimates read the graph before and after the passes from two of
    them (`copy`, when first read): a node keeps its value's shape and dtype through every
    rewrite, so the shared meta measures as it did.
    """

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        # (a node's args and kwargs are properties over these two fields: read directly, a
        # snapshot of a 2000-node joint graph takes 0.12 ms instead of 0.29, a dozen per step)
        self.records = [(n, n.op, n.target, n._args, n._kwargs, n.name, n.type, n.meta)  # noqa: SLF001
                        for n in graph.nodes]

    def restore(self, gm: torch.fx.GraphModule) -> dict[Node, Node]:
        """Put the graph back into `gm`; returns {node of the snapshot: its rebuilt node}."""
        old = self.graph
        graph = torch.fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls,  # noqa: SLF001
                               tracer_extras=old._tracer_extras)  # noqa: SLF001
        graph._codegen = copy.deepcopy(old._codegen)  # noqa: SLF001
        rebuilt = self._rebuild(graph)
        gm.graph = graph  # the setter re-parents the graph and recompiles
        return rebuilt

    def copy(self) -> torch.fx.Graph:
        """The graph as it was, in a graph of its own (no module: to read, not to run)."""
        graph = torch.fx.Graph()
        self._rebuild(graph)
        return graph

    def _rebuild(self, graph: torch.fx.Graph) -> dict[Node, Node]:
        rebuilt: dict[Node, Node] = {}
        for node, op, target, args, kwargs, name, type_, meta in self.records:
            new = graph.create_node(op, target, torch.fx.node.map_arg(args, rebuilt.__getitem__),
                                    torch.fx.node.map_arg(kwargs, rebuilt.__getitem__), name, type_)
            new.meta = dict(meta)
            rebuilt[node] = new
        return rebuilt


def _check_def_before_use(graph: torch.fx.Graph) -> None:
    """What a pass or finish can break in a graph: each node reads nodes of this graph
    defined before it (Graph.lint's main check, at a seventh of its cost). Checked after
    each one that changed the graph, so the one that broke it is the one reverted; the
    whole Graph.lint runs once, after them all."""
    defined: set = set()
    for node in graph.nodes:
        for arg in node._input_nodes:  # noqa: SLF001 - all_input_nodes' own dict, not a list copy
            if arg not in defined:
                raise RuntimeError(f"{node.name} reads {arg.name}, which is not a node before it in this graph")
        defined.add(node)


def _run_finishes(gm: torch.fx.GraphModule, results: Sequence[PassResult], config: FusionConfig,
                  soc: Optional[str], mode: Optional[str], original_nodes: set) -> set:
    """Each pass's finish (FusionPass.finish), in pass order, for the passes that fused sites:
    after every pass has run, so no pass matches a graph another one has already finished
    (swiglu_group matches the finalize call moe_dispatch emits, before its finish gives it a
    skip). A finish that raises is reverted alone and says so in its notes. Returns the
    graph's original nodes as they are afterwards."""
    options = FinishOptions(soc, mode, config.keep_intermediate_rounding)
    for result in results:
        fusion_pass = load_pass(result.pass_name) if result.sites else None
        if fusion_pass is None or fusion_pass.finish is None:
            continue
        snapshot = _Snapshot(gm.graph)
        try:
            result.finished = list(fusion_pass.finish(gm.graph, options))
            _check_def_before_use(gm.graph)
        except Exception as exc:
            rebuilt = snapshot.restore(gm)
            original_nodes = {rebuilt[n] for n in original_nodes if n in rebuilt}
            if config.strict:
                raise
            error = _one_line(exc)
            log.warning("the finish of pass %s failed and was reverted: %s (%s)", result.pass_name, error,
                        _log_failure(f"finish of pass {result.pass_name}", exc, config))
            result.finished = [f"its finish raised and was reverted: {error}"]
    return original_nodes


def _run_one(gm: torch.fx.GraphModule, name: str, config: FusionConfig, soc: Optional[str],
             mode: Optional[str], original_nodes: set, joint: bool = False,
             from_tangents: Optional[dict] = None) -> tuple[Optional[PassResult], set]:
    """Run one pass; (its result or None if it has nothing for this graph, the graph's
    original nodes as they are afterwards: rebuilt ones when the pass was reverted)."""
    fusion_pass = load_pass(name)
    if fusion_pass is None:
        log.info("pass %r is not implemented in this version of npu-fx-fusion", name)
        return PassResult(name, skipped="not implemented in this version"), original_nodes
    start = time.perf_counter()
    # taken before the pass's check first runs on a candidate: a pass with no candidate in
    # this graph takes none (the matcher only reads the graph, and so must the pass's
    # anchor, explain and prefilter: FusionPass)
    snapshot: list[_Snapshot] = []

    def before_change() -> None:
        if not snapshot:
            snapshot.append(_Snapshot(gm.graph))

    try:
        result = apply_pass(fusion_pass, gm, soc, mode, verify=config.verify, joint=joint,
                            keep_intermediate_rounding=config.keep_intermediate_rounding,
                            before_change=before_change, from_tangents=from_tangents,
                            dedicated_groups=config.dedicated_groups())
        if result is None:  # no joint patterns: nothing to do, nothing to report
            return None, original_nodes
        if result.sites:
            _check_def_before_use(gm.graph)
    except Exception as exc:
        if snapshot:
            rebuilt = snapshot[0].restore(gm)
            original_nodes = {rebuilt[n] for n in original_nodes if n in rebuilt}
        if config.strict:
            raise
        error = _one_line(exc)
        log.warning("pass %s failed and was reverted: %s (%s)", name, error,
                    _log_failure(f"pass {name}", exc, config))
        result = PassResult(name, error=error)
    result.seconds = time.perf_counter() - start
    log.info("pass %s: %d fused, %d near misses, %.1f ms", name, len(result.sites),
             len(result.near_misses), result.seconds * 1e3)
    return result, original_nodes
