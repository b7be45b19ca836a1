"""What the passes did: fused sites, near misses with reasons, op counts, errors.

Each pass returns a PassResult for one graph; the pipeline gathers them into a
GraphReport; a FusionReport holds every graph a backend compiled (graph breaks, forward
and backward). All of it renders as markdown or JSON.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.fx

# Namespaces of the fused ops we emit; counted as "fused ops" in the final graphs.
FUSED_OP_NAMESPACES = ("npu", "cann_ops_transformer")


@dataclass(frozen=True)
class SourceLocation:
    """Where a node came from in the user's code (from FX node meta)."""

    file: str = ""
    line: int = 0
    code: str = ""
    module: str = ""  # e.g. model.layers.0.input_layernorm

    def __str__(self) -> str:
        parts = []
        if self.module:
            parts.append(self.module)
        if self.file:
            parts.append(f"{self.file.rsplit('/', 1)[-1]}:{self.line}")
        where = " @ ".join(parts) if parts else "<unknown source>"
        return f"{where}: {self.code}" if self.code else where

    @staticmethod
    def of(node: torch.fx.Node) -> "SourceLocation":
        file, line, code = "", 0, ""
        trace = node.meta.get("stack_trace") or ""
        frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
        # The innermost frame may be inside torch (F.rms_norm for nn.RMSNorm): the user's
        # line is the innermost frame outside it.
        user_frames = [f for f in frames if not _in_torch(f[0])] or frames
        if user_frames:
            file, line_s, code = user_frames[-1]
            line = int(line_s)
        return SourceLocation(file, line, code.strip(), _module_path(node))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _in_torch(path: str) -> bool:
    return path.startswith(_TORCH_DIR)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # dynamo spells paths as L['self'].model.layers[0].norm or L__self___model...
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.lstrip(".")


def location_of(nodes) -> SourceLocation:
    """The most informative location among `nodes` (the first with a source line)."""
    best = SourceLocation()
    for node in nodes:
        loc = SourceLocation.of(node)
        if loc.file:
            return loc
        if loc.module and not best.module:
            best = loc
    return best


@dataclass(frozen=True)
class FusedSite:
    pass_name: str
    form: str  # the unfused form that matched (the search function's name)
    fused_op: str
    location: SourceLocation
    note: str = ""  # e.g. why only part of the candidate subgraph was fused
    verified: str = ""  # FusionConfig(verify=True): the measured error, or why not checked


class NearMiss(NamedTuple):
    """A candidate site that did not fuse, and the first check that failed."""

    pass_name: str
    reason: str
    location: SourceLocation


@dataclass
class PassResult:
    pass_name: str
    sites: list[FusedSite] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    error: Optional[str] = None  # the pass raised; the graph was restored
    skipped: Optional[str] = None  # why the pass did not run at all
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "pass": self.pass_name,
            "fused": len(self.sites),
            "sites": [dict(asdict(s), location=str(s.location)) for s in self.sites],
            "near_misses": [{"reason": m.reason, "location": str(m.location)} for m in self.near_misses],
            "error": self.error,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 6),
        }


def op_counts(graph: torch.fx.Graph) -> Counter:
    """call_function targets by name ("aten.mul.Tensor", "npu.npu_rms_norm.default", ...)."""
    return Counter(_target_name(n.target) for n in graph.nodes if n.op == "call_function")


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return f"{target.namespace}.{target._opname}.{target._overloadname}"  # noqa: SLF001
    return getattr(target, "__name__", str(target))


# Ops that only reinterpret or select memory: no kernel launch, no bytes moved (on an NPU
# torchair turns views into reshapes, which can copy; counting them as free keeps the
# estimate a lower bound on what fusion saves).
_FREE_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "permute", "transpose", "t",
    "unsqueeze", "squeeze", "slice", "select", "alias", "as_strided", "split", "split_with_sizes",
    "unbind", "detach", "view_as_real", "view_as_complex", "unflatten", "flatten", "sym_size",
    "sym_numel", "sym_stride", "lift_fresh_copy",
})


@dataclass(frozen=True)
class GraphCost:
    """An estimate from the FX graph alone: kernels launched and tensor bytes read + written.

    Every call node that computes (not a view, a getitem or a SymInt expression) counts as
    one launch and moves its tensor inputs and outputs once. It ignores caching, kernel
    internals and fusion done later by the graph compiler: a comparison of graphs, not a
    timing.
    """

    launches: int = 0
    bytes_moved: int = 0

    @staticmethod
    def of(graph: torch.fx.Graph) -> "GraphCost":
        costs = [GraphCost.of_node(node) for node in graph.nodes]
        return GraphCost(sum(c.launches for c in costs), sum(c.bytes_moved for c in costs))

    @staticmethod
    def of_node(node: torch.fx.Node) -> "GraphCost":
        """One launch moving its tensor inputs and outputs, or nothing for a free node."""
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            return GraphCost()
        if node.target._opname in _FREE_OPS:  # noqa: SLF001
            return GraphCost()
        moved = sum(_tensor_bytes(arg.meta.get("val")) for arg in node.all_input_nodes)
        return GraphCost(1, moved + _tensor_bytes(node.meta.get("val")))


def _tensor_bytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    numel = 1
    for size in value.shape:
        if isinstance(size, torch.SymInt):  # a symbolic size: its hint, the size it was traced at
            size = size.node.hint if size.node.hint is not None else 1
        numel *= int(size)
    return numel * value.element_size()


def _ratio(after: int, before: int) -> str:
    return f"{after / before:.2f}x" if before else "n/a"


def fused_op_counts(counts: Counter) -> Counter:
    """Fused-op calls among `counts`, keyed "npu.npu_rms_norm" (overload dropped)."""
    fused = Counter()
    for name, n in counts.items():
        if name.split(".", 1)[0] in FUSED_OP_NAMESPACES:
            fused[name.rsplit(".", 1)[0]] += n
    return fused


@dataclass
class GraphReport:
    name: str  # "forward", "backward", "inference", or the fuse() caller's name
    nodes_before: int
    mode: Optional[str] = None  # the torchair mode it is lowered in, when known
    nodes_after: int = 0
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    passes: list[PassResult] = field(default_factory=list)
    seconds: float = 0.0  # the whole pipeline on this graph, setup included
    cost_before: GraphCost = field(default_factory=GraphCost)
    cost_after: GraphCost = field(default_factory=GraphCost)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
            "seconds": round(self.seconds, 6),
            "estimated_cost": {"before": asdict(self.cost_before), "after": asdict(self.cost_after)},
            "passes": [r.to_dict() for r in self.passes],
        }

    def cost_line(self) -> str:
        b, a = self.cost_before, self.cost_after
        return (f"estimated cost (from the graph: launches of computing ops, tensor bytes in + out): "
                f"{b.launches} -> {a.launches} kernel launches ({_ratio(a.launches, b.launches)}), "
                f"{_megabytes(b.bytes_moved)} -> {_megabytes(a.bytes_moved)} moved "
                f"({_ratio(a.bytes_moved, b.bytes_moved)})")

    @property
    def fused_ops(self) -> Counter:
        """The npu ops the passes added to this graph: those in it after, less those it held
        before (torch_npu's own calls in an NPU graph, such as npu_fusion_attention_v3 for
        SDPA; in a graph split from a fused joint graph, the joint graph's fusions)."""
        return fused_op_counts(self.ops_after) - fused_op_counts(self.ops_before)


class FusionReport:
    """Every graph one backend (or one fuse() call) processed."""

    def __init__(self) -> None:
        self.graphs: list[GraphReport] = []
        # which graph the passes saw: an NPU compile's (torchair, or CPU emulation with the
        # NPU dispatch reproduced) or the plain CPU trace; None: the caller's own (fuse())
        self.graph_source: Optional[str] = None

    def add(self, graph: GraphReport) -> None:
        self.graphs.append(graph)

    def _results(self):
        return (result for g in self.graphs for result in g.passes)

    @property
    def counts(self) -> dict[str, int]:
        """{pass_name: fused sites} over all graphs, for every pass that ran."""
        counts: dict[str, int] = {}
        for result in self._results():
            if result.skipped is None:
                counts[result.pass_name] = counts.get(result.pass_name, 0) + len(result.sites)
        return counts

    @property
    def fused_ops(self) -> dict[str, int]:
        """{"npu.npu_rms_norm": n, ...}: the fused-op calls the passes added, over all graphs.

        Each is counted in the graph it was made in: a "joint" graph's (training, before
        partitioning) are already in the forward and backward graphs it is split into. npu
        ops the traced graph held already (torch_npu's own FlashAttention for SDPA in an NPU
        graph, npu ops the model calls itself) are not counted."""
        total = Counter()
        for g in self.graphs:
            total.update(g.fused_ops)
        return dict(total)

    @property
    def sites(self) -> list[FusedSite]:
        return [site for result in self._results() for site in result.sites]

    @property
    def near_misses(self) -> list[NearMiss]:
        return [miss for result in self._results() for miss in result.near_misses]

    @property
    def errors(self) -> list[tuple[str, str]]:
        return [(r.pass_name, r.error) for r in self._results() if r.error]

    def to_dict(self) -> dict:
        return {"graph_source": self.graph_source, "counts": self.counts, "fused_ops": self.fused_ops,
                "graphs": [g.to_dict() for g in self.graphs]}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        lines = ["# npu-fx-fusion report", ""]
        if self.graph_source:
            lines += [f"Graphs fused: {self.graph_source}.", ""]
        if not self.graphs:
            return "\n".join(lines + ["No graph was compiled."]) + "\n"
        lines += ["| pass | fused sites |", "|---|---|"]
        lines += [f"| {name} | {n} |" for name, n in self.counts.items()]
        lines += ["", "Fused ops in the final graphs: "
                  + (", ".join(f"{op} x{n}" for op, n in self.fused_ops.items()) or "none"), ""]
        for index, g in enumerate(self.graphs):
            mode = f", torchair mode {g.mode}" if g.mode else ""
            lines += [f"## graph {index}: {g.name} ({g.nodes_before} -> {g.nodes_after} nodes{mode})", "",
                      g.cost_line(), ""]
            skipped = [r for r in g.passes if r.skipped]
            for r in g.passes:
                if r.skipped:
                    continue
                lines.append(_pass_line(r))
                lines += [f"  - fused `{s.form}` -> {s.fused_op} at {s.location}"
                          + (f" ({s.note})" if s.note else "")
                          + (f" [{s.verified}]" if s.verified else "") for s in r.sites]
                lines += [f"  - near miss: {m.reason} at {m.location}" for m in r.near_misses]
            if skipped:
                lines.append(f"- not run: {', '.join(r.pass_name for r in skipped)} ({skipped[0].skipped})")
            changed = sorted(set(g.ops_before) | set(g.ops_after),
                             key=lambda op: g.ops_after[op] - g.ops_before[op])
            changed = [op for op in changed if g.ops_before[op] != g.ops_after[op]]
            if changed:
                lines += ["", "| op | before | after |", "|---|---|---|"]
                lines += [f"| {op} | {g.ops_before[op]} | {g.ops_after[op]} |" for op in changed]
            lines.append("")
        return "\n".join(lines)


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


def _pass_line(r: PassResult) -> str:
    if r.error:
        return f"- **{r.pass_name}**: FAILED, graph left as it was: {r.error}"
    return (f"- **{r.pass_name}**: {len(r.sites)} fused, {len(r.near_misses)} near misses "
            f"({r.seconds * 1e3:.1f} ms)")
