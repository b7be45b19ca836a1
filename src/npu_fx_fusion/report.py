"""What the passes did: fused sites, near misses with reasons, op counts, errors.

Each pass returns a PassResult for one graph; the pipeline gathers them into a
GraphReport; a FusionReport holds every graph a backend compiled (graph breaks, forward
and backward). All of it renders as markdown or JSON.
"""
from __future__ import annotations

import functools
import json
import operator
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import AbstractSet, Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.fx

from .nodes import deterministic_and_pure, functional_target
from .npu_ops.spec import tensor_bytes

# Namespaces of the fused ops we emit; counted as "fused ops" in the final graphs.
FUSED_OP_NAMESPACES = ("npu", "cann_ops_transformer", "cann_ops_nn")
# A site's note that starts so names a limit of the real kernel the site breaks: with no
# SoC given (CPU emulation) such a site fuses, and the report lists it as one an NPU would
# refuse (forms.Site.hardware_limits writes these notes).
ON_AN_NPU = "on an NPU: "


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
        file, line, code = _user_frame(node.meta.get("stack_trace") or "")
        return SourceLocation(file, line, code, _module_path(node))


# Every node of a source line carries its stack trace, and every decoder layer repeats the
# lines: each trace and module path is parsed once per process, not once per node.
@functools.lru_cache(maxsize=4096)
def _user_frame(trace: str) -> tuple[str, int, str]:
    """(file, line, code) of the innermost frame of `trace` outside torch (F.rms_norm for
    nn.RMSNorm is inside it), else its innermost frame; empty for no frame."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    user_frames = [f for f in frames if not _in_torch(f[0])] or frames
    if not user_frames:
        return "", 0, ""
    file, line, code = user_frames[-1]
    return file, int(line), code.strip()


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _in_torch(path: str) -> bool:
    return path.startswith(_TORCH_DIR)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return _dotted_module_path(next(reversed(stack.values()))[0])


@functools.lru_cache(maxsize=4096)
def _dotted_module_path(path: str) -> str:
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


def _is_fused_op(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in FUSED_OP_NAMESPACES  # noqa: SLF001


def _made_by_fusion(node: torch.fx.Node) -> bool:
    """A fused-op call or one of its outputs: its source line is the earlier site's."""
    if node.target is operator.getitem and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return _is_fused_op(node)


def site_location(nodes: Sequence[torch.fx.Node], outputs: Sequence[Optional[torch.fx.Node]] = (),
                  is_anchor: Optional[Callable[[torch.fx.Node], bool]] = None) -> SourceLocation:
    """Where a fused site is in the model's code: the line of the code it replaces.

    Among the matched `nodes` that the model computed (not an earlier fusion's op, whose
    line is that site's): the node the fused op's first output replaces (`outputs`, the
    match's output nodes: rope's `q_embed = q * cos + rotate_half(q) * sin`, the expert
    GEMM call), else the pass's anchor (where its near misses are reported), else the
    first with a source line.
    """
    own = [n for n in nodes if not _made_by_fusion(n)]
    replaced_outputs = [n for n in outputs if n is not None and n in own]
    anchors = [n for n in own if is_anchor is not None and is_anchor(n)]
    for candidates in (replaced_outputs, anchors, own):
        location = location_of(candidates)
        if location.file:
            return location
    return location_of(nodes)


@dataclass(frozen=True)
class FusedSite:
    pass_name: str
    form: str  # the unfused form that matched (the search function's name)
    fused_op: str
    location: SourceLocation
    note: str = ""  # e.g. why only part of the candidate subgraph was fused
    verified: str = ""  # FusionConfig(verify=True): the measured error, or why not checked
    replaced: tuple[str, ...] = ()  # the FX names of the nodes the fusion replaced
    consumed: tuple[str, ...] = ()  # fused ops of earlier sites among them ("npu.npu_rms_norm")
    # every fused op the form's replacement calls ("npu.npu_moe_init_routing_v2",
    # "npu.npu_moe_finalize_routing"): the drawings colour them as one site
    emitted: tuple[str, ...] = ()
    # the limits of the real kernel this site breaks (its notes' "on an NPU: ..."): fused
    # because no SoC was given (CPU emulation), refused on an NPU
    npu_limits: tuple[str, ...] = ()

    @staticmethod
    def of_match(pass_name: str, form: str, fused_op: str, nodes: Sequence[torch.fx.Node],
                 outputs: Sequence[Optional[torch.fx.Node]] = (),
                 is_anchor: Optional[Callable[[torch.fx.Node], bool]] = None,
                 notes: Union[str, Sequence[str]] = (), verified: str = "",
                 emitted: Sequence[str] = ()) -> "FusedSite":
        """The site of a match: its location (site_location), the nodes it replaces, the
        earlier fused ops it folds in (add_rms_norm consumes rms_norm's npu_rms_norm), its
        notes joined, those naming a limit of the real kernel (ON_AN_NPU) kept apart too
        (`notes` as one string: already joined with "; ")."""
        if isinstance(notes, str):
            notes = notes.split("; ") if notes else []
        consumed = tuple(_target_name(n.target).rsplit(".", 1)[0] for n in nodes if _is_fused_op(n))
        npu_limits = tuple(note[len(ON_AN_NPU):] for note in notes if note.startswith(ON_AN_NPU))
        return FusedSite(pass_name, form, fused_op, site_location(nodes, outputs, is_anchor), "; ".join(notes),
                         verified, tuple(n.name for n in nodes), consumed, tuple(emitted) or (fused_op,), npu_limits)


class NearMiss(NamedTuple):
    """A candidate site that did not fuse, and the first check that failed."""

    pass_name: str
    reason: str
    location: SourceLocation
    # how often it was seen at run time (graph_breaks: an add and a norm in two graphs); None:
    # found in the graph, once per run of it
    observed: Optional[int] = None


@dataclass
class PassResult:
    pass_name: str
    sites: list[FusedSite] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    error: Optional[str] = None  # the pass raised; the graph was restored
    skipped: Optional[str] = None  # why the pass did not run at all
    seconds: float = 0.0
    finished: list[str] = field(default_factory=list)  # what its finish() changed after the sites

    def to_dict(self) -> dict:
        return {
            "pass": self.pass_name,
            "fused": len(self.sites),
            "sites": [dict(asdict(s), location=str(s.location), replaced=list(s.replaced), consumed=list(s.consumed),
                           emitted=list(s.emitted), npu_limits=list(s.npu_limits))
                      for s in self.sites],
            "near_misses": [{"reason": m.reason, "location": str(m.location),
                             **({"observed": m.observed} if m.observed is not None else {})}
                            for m in self.near_misses],
            "error": self.error,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 6),
            "finished": list(self.finished),
        }


def op_counts(graph: torch.fx.Graph) -> Counter:
    """call_function targets by name ("aten.mul.Tensor", "npu.npu_rms_norm.default", ...)."""
    return Counter(_target_name(functional_target(n)) for n in graph.nodes if n.op == "call_function")


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
    """An estimate from the FX graph alone: kernels launched and tensor bytes read + written,
    per step, and apart from them what is built once.

    Every call node that computes (not a view, a getitem or a SymInt expression) counts as
    one launch and moves its tensor inputs and outputs once. It ignores caching, kernel
    internals and fusion done later by the graph compiler: a comparison of graphs, not a
    timing.

    Constants are not per-step traffic: a value computed from no graph input (a causal-mask
    template from `ones` + `triu`, an `arange` of static sizes, a get_attr buffer; no
    random op on the way, constant_nodes) is the same at every step, and the graph compiler
    builds it once (torchair's GE folds it into a Const). The launches and bytes that build
    it are `constant_launches` / `constant_bytes`, and a per-step op reading it is not
    charged for it: such templates are read in part, or stay resident (sparse_mode 3's
    compressed 2048x2048 causal mask: the kernel reads the tiles on the diagonal).
    """

    launches: int = 0  # per step
    bytes_moved: int = 0  # per step
    constant_launches: int = 0  # once: building the constants
    constant_bytes: int = 0  # once: the bytes building them moves, and get_attr buffers

    @staticmethod
    def of(graph: torch.fx.Graph) -> "GraphCost":
        """The cost of `graph`."""
        launches = moved = constant_launches = constant_moved = 0
        sizes: dict = {}  # each value measured once, however many nodes read it

        def size(node: torch.fx.Node) -> int:
            found = sizes.get(node)
            if found is None:
                found = sizes[node] = tensor_bytes(node.meta.get("val"))
            return found

        constants = constant_nodes(graph)
        for node in graph.nodes:
            if node.op == "get_attr" and node.users:
                constant_moved += size(node)
            elif not _computes(node):
                continue
            elif node in constants:
                constant_launches += 1
                constant_moved += size(node) + sum(size(arg) for arg in node.all_input_nodes)
            else:
                launches += 1
                moved += size(node) + sum(size(arg) for arg in node.all_input_nodes if arg not in constants)
        return GraphCost(launches, moved, constant_launches, constant_moved)

    @staticmethod
    def of_node(node: torch.fx.Node) -> "GraphCost":
        """One launch moving its tensor inputs and outputs, or nothing for a free node."""
        if not _computes(node):
            return GraphCost()
        moved = sum(tensor_bytes(arg.meta.get("val")) for arg in node.all_input_nodes)
        return GraphCost(1, moved + tensor_bytes(node.meta.get("val")))


@dataclass(frozen=True)
class GraphCosts:
    """A graph's estimated cost before and after the passes: GraphCost's count, and each
    SoC's roofline estimate ({SoC: cost_model.Estimate})."""

    before: GraphCost = field(default_factory=GraphCost)
    after: GraphCost = field(default_factory=GraphCost)
    time_before: dict = field(default_factory=dict)
    time_after: dict = field(default_factory=dict)


def constant_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose values are the same at every step: get_attr, and calls whose inputs
    are all such nodes (none: `ones`, `arange` of static sizes) through ops that neither
    draw random numbers nor mutate. A graph input, a symbolic size or a random op on the
    way makes a value per-step."""
    constants: set[torch.fx.Node] = set()
    for node in graph.nodes:  # topological: a node's inputs are decided before it
        if node.op == "get_attr":
            constants.add(node)
        elif node.op == "call_function" and deterministic_and_pure(node.target) and all(
                arg in constants for arg in node.all_input_nodes):
            constants.add(node)
    return constants


def _computes(node: torch.fx.Node) -> bool:
    """A call that launches a kernel: an aten or fused op that is not a view (a getitem or
    a SymInt expression is no op)."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)  # noqa: SLF001
            and node.target._opname not in _FREE_OPS)  # noqa: SLF001


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
    # dtype conversions the fusions added, by what they convert for (added_conversions)
    conversions_added: Counter = field(default_factory=Counter)
    # how often the compiled graph has run so far: dynamo reuses one compiled graph wherever
    # the same code runs under the same guards (a graph break inside a decoder layer: every
    # layer runs the layer's graphs). None: not counted (fuse(), or a graph torchair's
    # backend compiled after dynamo's call returned)
    runs: Optional[int] = None
    # {placeholder position: location} of the inputs a fused npu_rms_norm reads
    # (graph_breaks.normed_inputs: where a residual add of another graph may feed it)
    normed_inputs: dict = field(default_factory=dict)
    # Works out the graph's GraphCosts (the pipeline's: from records of the graph taken
    # before and after the passes). Called when a cost is first read, not in the compile:
    # measuring every node of both graphs costs as much as a pass does, and most compiles'
    # reports are never read.
    measure: Optional[Callable[[], "GraphCosts"]] = field(default=None, repr=False, compare=False)
    _costs: Optional["GraphCosts"] = field(default=None, init=False, repr=False, compare=False)

    def measure_with(self, measure: Callable[[], "GraphCosts"]) -> None:
        """Work the costs out with `measure` when next read, forgetting any read before (a
        joint graph put back unfused after its report was written)."""
        self.measure, self._costs = measure, None

    @property
    def costs(self) -> "GraphCosts":
        """The estimated costs before and after the passes, worked out once (`measure`)."""
        if self._costs is None:
            self._costs = self.measure() if self.measure is not None else GraphCosts()
            self.measure = None  # let go of the records
        return self._costs

    @property
    def cost_before(self) -> GraphCost:
        return self.costs.before

    @property
    def cost_after(self) -> GraphCost:
        return self.costs.after

    @property
    def roofline_before(self) -> dict:
        """{SoC: cost_model.Estimate}: the roofline estimate of the graph before the passes."""
        return self.costs.time_before

    @property
    def roofline_after(self) -> dict:
        return self.costs.time_after

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "runs": self.runs,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
            "conversions_added": dict(self.conversions_added),
            "seconds": round(self.seconds, 6),
            "estimated_cost": {"before": asdict(self.cost_before), "after": asdict(self.cost_after)},
            "estimated_time": {soc: {"before": self.roofline_before[soc].to_dict(),
                                     "after": self.roofline_after[soc].to_dict()}
                               for soc in self.roofline_before if soc in self.roofline_after},
            "passes": [r.to_dict() for r in self.passes],
        }

    def cost_line(self) -> str:
        """The estimated cost before and after, per step, and what is built once (GraphCost)."""
        b, a = self.cost_before, self.cost_after
        line = (f"estimated cost per run (from the graph: launches of computing ops, tensor bytes in + out): "
                f"{b.launches} -> {a.launches} kernel launches ({_ratio(a.launches, b.launches)}), "
                f"{human_bytes(b.bytes_moved)} -> {human_bytes(a.bytes_moved)} moved "
                f"({_ratio(a.bytes_moved, b.bytes_moved)})")
        if b.constant_bytes or a.constant_bytes or b.constant_launches or a.constant_launches:
            line += (f"; built once, not per run (constants: values computed from no graph input): "
                     f"{b.constant_launches} -> {a.constant_launches} launches, "
                     f"{human_bytes(b.constant_bytes)} -> {human_bytes(a.constant_bytes)}")
        return line

    def time_line(self) -> str:
        """Each SoC's estimated device time before and after (cost_model.py)."""
        parts = [f"{soc} {self.roofline_before[soc].seconds * 1e6:.1f} -> {self.roofline_after[soc].seconds * 1e6:.1f} us"
                 for soc in self.roofline_before if soc in self.roofline_after]
        return ("estimated device time (cost_model.py: launches + roofline per SoC; a comparison, not a timing): "
                + ", ".join(parts))

    @property
    def fused_ops(self) -> Counter:
        """The npu ops the passes added to this graph: those in it after, less those it held
        before (torch_npu's own calls in an NPU graph, such as npu_fusion_attention_v3 for
        SDPA; in a graph split from a fused joint graph, the joint graph's fusions)."""
        return fused_op_counts(self.ops_after) - fused_op_counts(self.ops_before)

    def folded(self) -> dict[str, Counter]:
        """{pass: {later pass: n}}: sites whose fused op a later pass's site folded into its own.

        add_rms_norm replaces an add and the npu_rms_norm that rms_norm made of the norm
        after it: that rms_norm site is then counted in both passes, and the final graph
        holds the npu_add_rms_norm only. A consumed op is credited to the latest earlier
        pass that emitted it (an op the model called itself is nobody's). Only ops that
        are gone from the final graph count: a later site that takes an op in and emits
        it again (moe_dispatch's block around npu_swiglu) folds nothing away."""
        emitted: list[tuple[str, Counter]] = []  # per pass run, its fused ops not yet consumed
        credits: list[tuple[str, str, str]] = []  # (producer, consumer, op), in pipeline order
        for result in self.passes:
            for site in result.sites:
                for op in site.consumed:
                    producer = next(((name, ops) for name, ops in reversed(emitted) if ops[op] > 0), None)
                    if producer is not None:
                        producer[1][op] -= 1
                        credits.append((producer[0], result.pass_name, op))
            emitted.append((result.pass_name, Counter(site.fused_op for site in result.sites)))
        made = Counter(site.fused_op for result in self.passes for site in result.sites)
        gone = {op: made[op] - self.fused_ops[op] for op in made}  # fused_ops: the final graph's
        folded: dict[str, Counter] = {}
        for producer, consumer, op in credits:
            if gone.get(op, 0) > 0:
                gone[op] -= 1
                folded.setdefault(producer, Counter())[consumer] += 1
        return folded


# Conversion ops: what added_conversions counts.
_CONVERSION_OPS = ("aten._to_copy", "npu._npu_dtype_cast")
_SHORT_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8",
                 torch.uint8: "uint8", torch.bool: "bool"}


def _is_conversion(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)  # noqa: SLF001
            and _target_name(node.target).rsplit(".", 1)[0] in _CONVERSION_OPS)


def _dtype_of(node: Any) -> str:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return _SHORT_DTYPES.get(value.dtype, str(value.dtype)) if isinstance(value, torch.Tensor) else "?"


def _argument_name(user: torch.fx.Node, node: torch.fx.Node) -> str:
    """The schema name of the argument of `user` that `node` is passed as ("group_list")."""
    if not isinstance(user.target, torch._ops.OpOverload):  # noqa: SLF001
        return ""
    schema = user.target._schema.arguments  # noqa: SLF001
    given = list(zip((a.name for a in schema), user.args)) + list(user.kwargs.items())
    for name, value in given:
        if value is node or (isinstance(value, (list, tuple)) and node in value):
            return name
    return ""


def added_conversions(graph: torch.fx.Graph, original_nodes: AbstractSet[torch.fx.Node]) -> Counter:
    """The dtype conversions fusion added to `graph` (nodes not in `original_nodes`), as
    chains of conversions with their readers, each with how often it occurs:
    {"aten._to_copy: int64 -> int32 -> int64 for npu.npu_grouped_matmul(group_list)": 2}.

    A fused op takes its integer arguments in the dtype torch_npu declares (int32 expert
    ids, int64 group lists) and the replacement converts what the model computed: the
    report says so rather than leave `aten._to_copy` growing unexplained."""
    added = {n for n in graph.nodes if n not in original_nodes and _is_conversion(n) and n.args}
    found: Counter = Counter()
    for node in graph.nodes:
        if node not in added or (node.users and all(u in added for u in node.users)):
            continue  # a link inside a chain: described with the chain's last conversion
        chain = [node]
        while chain[0].args[0] in added and len(chain[0].args[0].users) == 1:
            chain.insert(0, chain[0].args[0])
        readers = sorted({_target_name(u.target).rsplit(".", 1)[0]
                          + (f"({arg})" if (arg := _argument_name(u, node)) else "")
                          for u in node.users}) or ["nothing (dead)"]
        dtypes = " -> ".join([_dtype_of(chain[0].args[0])] + [_dtype_of(n) for n in chain])
        op = _target_name(node.target).rsplit(".", 1)[0]
        found[f"{op}: {dtypes} for {', '.join(readers)}"] += 1
    return found


# The counters dynamo keeps of what it could not compile (torch._dynamo.utils.counters),
# each keyed by its message: "graph_break" and "unimplemented" (which also names each frame
# it gave up on and ran in eager: "frame skipped: forward (path line N)", a graph break in a
# loop skips the frame; such a message starts with the break that led to it).
_DYNAMO_COUNTERS = ("graph_break", "unimplemented")
_FRAME_SKIPPED = re.compile(r"frame skipped: (\S+) \((.+?) line (\d+)\)")
_DEBUG_CONTEXT = re.compile(r"Developer debug context: (.+)")
_HINT = re.compile(r"Hint: (.+)")
_ANOTHER_BREAK = "*** While handling this graph break"


def dynamo_counts() -> dict[str, Counter]:
    """A snapshot of dynamo's graph-break counters, to tell later breaks from earlier ones."""
    from torch._dynamo.utils import counters

    return {kind: Counter(counters[kind]) for kind in _DYNAMO_COUNTERS}


def _break_reason(message: str) -> str:
    """"Dynamic shape operator (aten.nonzero.default); dynamo's hint: ..." of a counter's message."""
    first = message.split(_ANOTHER_BREAK)[0]
    context, hint = _DEBUG_CONTEXT.search(first), _HINT.search(first)
    reason = first.strip().splitlines()[0]
    reason += f" ({context.group(1).strip()})" if context and len(context.group(1)) < 80 else ""
    return reason + (f"; dynamo's hint: {hint.group(1).strip()}" if hint else "")


@dataclass(frozen=True)
class DynamoGaps:
    """What dynamo left out of every graph: code there runs in eager, where no pass sees it."""

    breaks: tuple[str, ...]  # each distinct reason, "Dynamic shape operator (aten.nonzero.default); ..."
    eager_frames: tuple[str, ...]  # "forward (model.py:85)": functions dynamo ran wholly in eager
    # the same functions as (name, file, line of their first line), and the break that made
    # dynamo skip each: to tell which code of the model ran in eager
    eager_code: tuple[tuple[str, str, int, str], ...] = ()

    @classmethod
    def since(cls, before: dict[str, Counter]) -> "DynamoGaps":
        now = dynamo_counts()
        messages = [m for kind in _DYNAMO_COUNTERS for m in now[kind] - before[kind]]
        code = {(name, path, int(line)): _break_reason(m)
                for m in messages for name, path, line in _FRAME_SKIPPED.findall(m)}
        frames = (f"{name} ({os.path.basename(path)}:{line})" for name, path, line in code)
        return cls(tuple(dict.fromkeys(map(_break_reason, messages))), tuple(frames),
                   tuple((*where, reason) for where, reason in code.items()))

    def eager_reason(self, file: str, first: int, last: int) -> Optional[str]:
        """Why the code of `file` from line `first` to `last` (a module's class, a function)
        ran in eager, if a function dynamo skipped starts there: the break it skipped for."""
        for name, path, line, reason in self.eager_code:
            if path == file and first <= line <= last:
                return f"{name} ({os.path.basename(path)}:{line}) ran wholly in eager: {reason}"
        return None

    def __bool__(self) -> bool:
        return bool(self.breaks or self.eager_frames)

    def lines(self) -> list[str]:
        if not self:
            return []
        lines = ["- dynamo left code out of the graphs: it runs in eager, where no pass sees it "
                 "(torch._dynamo.explain shows where)"]
        lines += [f"  - graph break: {reason}" for reason in self.breaks]
        if self.eager_frames:
            lines.append(f"  - run wholly in eager (a graph break in a loop makes dynamo skip the frame): "
                         f"{', '.join(self.eager_frames)}")
        return lines


class FusionReport:
    """Every graph one backend (or one fuse() call) processed."""

    def __init__(self) -> None:
        self.graphs: list[GraphReport] = []
        # which graph the passes saw: an NPU compile's (torchair, or CPU emulation with the
        # NPU dispatch reproduced) or the plain CPU trace; None: the caller's own (fuse())
        self.graph_source: Optional[str] = None
        # the SoC whose limits the passes applied (FusionConfig.soc, else detected from
        # torch_npu on an NPU), None for none; soc_detected: it was detected, not given
        self.soc: Optional[str] = None
        self.soc_detected = False
        # what the CLI compiled and how its outputs compared with eager (cli.compare_with_eager,
        # or {"ok": None, "why": ...} when nothing was computed); None when not known
        self.target: Optional[str] = None
        self.outputs_vs_eager: Optional[dict] = None
        # dynamo's graph-break counters when the backend was made (dynamo_counts()), or None
        # (fuse(): no dynamo); the breaks since then are the report's dynamo_gaps
        self.dynamo_counts_before: Optional[dict[str, Counter]] = None

    @property
    def dynamo_gaps(self) -> DynamoGaps:
        """The graph breaks and eager frames dynamo recorded since the backend was made
        (counted process-wide: another compile meanwhile counts too)."""
        if self.dynamo_counts_before is None:
            return DynamoGaps((), (), ())
        return DynamoGaps.since(self.dynamo_counts_before)

    def add(self, graph: GraphReport) -> None:
        self.graphs.append(graph)

    def _results(self):
        return (result for g in self.graphs for result in g.passes)

    @property
    def counts(self) -> dict[str, int]:
        """{pass_name: fused sites} over all graphs, for every pass that ran; a compiled
        graph counts once however often it runs (executed_counts counts its runs)."""
        counts: dict[str, int] = {}
        for result in self._results():
            if result.skipped is None:
                counts[result.pass_name] = counts.get(result.pass_name, 0) + len(result.sites)
        return counts

    @property
    def executed_counts(self) -> dict[str, int]:
        """{pass_name: fused sites run so far}: each graph's sites once per run of it (a
        graph dynamo reused for 4 layers counts 4 times). Graphs whose runs are not
        counted (GraphReport.runs None) count once."""
        counts: dict[str, int] = {}
        for g in self.graphs:
            runs = 1 if g.runs is None else g.runs
            for result in g.passes:
                if result.skipped is None:
                    counts[result.pass_name] = counts.get(result.pass_name, 0) + len(result.sites) * runs
        return counts

    @property
    def reused(self) -> bool:
        """A compiled graph has run more than once (then counts and executed_counts differ)."""
        return any(g.runs is not None and g.runs > 1 for g in self.graphs)

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
        return dict(sorted(total.items()))

    @property
    def folded(self) -> dict[str, dict[str, int]]:
        """{pass: {later pass: n}} over all graphs (GraphReport.folded)."""
        total: dict[str, Counter] = {}
        for g in self.graphs:
            for name, into in g.folded().items():
                total.setdefault(name, Counter()).update(into)
        return {name: dict(into) for name, into in total.items()}

    @property
    def sites(self) -> list[FusedSite]:
        return [site for result in self._results() for site in result.sites]

    @property
    def near_misses(self) -> list[NearMiss]:
        return [miss for result in self._results() for miss in result.near_misses]

    @property
    def errors(self) -> list[tuple[str, str]]:
        return [(r.pass_name, r.error) for r in self._results() if r.error]

    @property
    def npu_refusals(self) -> Counter:
        """{(pass_name, limit): fused sites}: sites fused only because no SoC was given,
        with the limit of the real kernel each breaks (FusedSite.npu_limits)."""
        return Counter((site.pass_name, "; ".join(site.npu_limits)) for site in self.sites if site.npu_limits)

    def summary_lines(self) -> list[str]:
        """The report's first lines: which graph was fused, which SoC's limits applied and
        what an NPU would refuse, whether the outputs matched eager, which graphs ran more
        than once."""
        lines = []
        if self.graph_source:
            lines.append(f"- graphs fused: {self.graph_source}")
        lines += self.soc_lines()
        if self.outputs_vs_eager is not None:
            lines.append(f"- outputs vs eager: {verdict_text(self.outputs_vs_eager)}")
        lines += self.dynamo_gaps.lines()
        if self.reused:
            runs = ", ".join(f"graph {i} ({g.name}) {_times(g.runs)}" for i, g in enumerate(self.graphs)
                             if g.runs is not None)
            lines.append(f"- graphs run so far: {runs}. Dynamo reuses a compiled graph wherever the same code "
                         "runs under the same guards (a graph break in a decoder layer: each layer runs it); "
                         "the pass table's `executed` column counts each fused site once per run")
        return lines

    def soc_lines(self) -> list[str]:
        """Which SoC's limits the passes applied; with none, the fused sites an NPU's kernels
        would refuse (FusedSite.npu_limits), grouped by pass and limit."""
        if self.soc is not None:
            how = "detected from torch_npu" if self.soc_detected else "FusionConfig(soc=...) / --soc"
            return [f"- SoC limits: {self.soc}'s ({how}): a site that breaks one is a near miss saying which"]
        refusals = self.npu_refusals
        if not refusals:
            return ["- SoC limits: none applied (--soc SOC or FusionConfig(soc=...) applies one's); "
                    "no fused site breaks a limit of the real kernels"]
        total = sum(refusals.values())
        return ([f"- SoC limits: none applied (no --soc / FusionConfig(soc=...)), so {total} fused "
                 f"{'site' if total == 1 else 'sites'} here would not fuse on an NPU: the CPU stand-ins run "
                 "what the real kernels refuse"]
                + [f"  - {name} x{n}: {limit}" for (name, limit), n in sorted(refusals.items())]
                + ["  - --soc SOC (e.g. Ascend910B) applies that SoC's limits: such sites are then near misses"])

    def to_dict(self) -> dict:
        return {"target": self.target, "graph_source": self.graph_source, "soc": self.soc,
                "outputs_vs_eager": self.outputs_vs_eager, "counts": self.counts,
                "executed_counts": self.executed_counts, "folded": self.folded, "fused_ops": self.fused_ops,
                "dynamo_gaps": asdict(self.dynamo_gaps), "graphs": [g.to_dict() for g in self.graphs]}

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        title = "# npu-fx-fusion report" + (f": {self.target}" if self.target else "")
        lines = [title, ""]
        if not self.graphs:
            return "\n".join(lines + ["No graph was compiled."] + self.dynamo_gaps.lines()) + "\n"
        lines += self.summary_lines() + [""]
        rows, quiet = pass_rows(self)
        lines += pass_table(rows, executed=self.reused)
        if quiet:
            lines += ["", _quiet_line(quiet)]
        lines += ["", "Fused ops in the final graphs: "
                  + (", ".join(f"{op} x{n}" for op, n in self.fused_ops.items()) or "none"), ""]
        for index, g in enumerate(self.graphs):
            lines += [f"## graph {index}: {graph_title(g)}", "", g.cost_line(), ""]
            if g.roofline_before and g.roofline_after:
                lines += [g.time_line(), ""]
            skipped = [r for r in g.passes if r.skipped]
            found_nothing = []
            for r in g.passes:
                if r.skipped:
                    continue
                if not (r.sites or r.near_misses or r.error):
                    found_nothing.append(r.pass_name)
                    continue
                lines.append(_pass_line(r))
                lines += [f"  - fused `{s.form}` -> {s.fused_op} at {s.location}"
                          + (f" ({s.note})" if s.note else "")
                          + (f" [{s.verified}]" if s.verified else "") for s in r.sites]
                lines += [f"  - then: {note}" for note in r.finished]
                lines += [f"  - near miss: {m.reason} at {m.location}"
                          + (f" (seen {_times(m.observed)} so far)" if m.observed is not None else "")
                          for m in r.near_misses]
            if found_nothing:
                lines.append(f"- no candidate for: {', '.join(found_nothing)}")
            if skipped:
                lines.append(f"- not run: {', '.join(r.pass_name for r in skipped)} ({skipped[0].skipped})")
            lines += op_table(g)
            lines.append("")
        return "\n".join(lines)


def graph_title(g: GraphReport) -> str:
    """"inference (213 -> 124 nodes)", with its torchair mode and runs when known."""
    mode = f", torchair mode {g.mode}" if g.mode else ""
    runs = f", ran {_times(g.runs)}" if g.runs is not None and g.runs != 1 else ""
    return f"{g.name} ({g.nodes_before} -> {g.nodes_after} nodes{mode}){runs}"


def _times(n: int) -> str:
    return {0: "not yet", 1: "once"}.get(n, f"{n} times")


def verdict_text(verdict: dict) -> str:
    """The outputs-vs-eager verdict in words: "max abs diff ..., tolerance ... = ...: OK"."""
    if verdict.get("ok") is None:
        return f"not compared: {verdict.get('why', '')}"
    return (f"max abs diff {verdict['max_abs_diff']:.3g}, tolerance {verdict['tolerance']:.3g} = "
            f"{verdict['tolerance_rule']}: {'OK' if verdict['ok'] else 'MISMATCH'}")


class PassRow(NamedTuple):
    """One line of the pass table: a pass that found something (fused sites, near misses,
    or an error)."""

    name: str
    fused: int
    near_misses: int
    executed: int  # fused sites counted once per run of their graph
    note: str


def pass_rows(report: FusionReport) -> tuple[list[PassRow], list[str]]:
    """The pass table's rows, in pipeline order, and the passes that ran and found no
    candidate (no site, no near miss, no error), which the table leaves out."""
    near = Counter(m.pass_name for m in report.near_misses)
    failed = {name for name, _ in report.errors}
    folded, executed = report.folded, report.executed_counts
    refused = Counter()
    for (name, _), n in report.npu_refusals.items():
        refused[name] += n
    rows, quiet = [], []
    for name, n in report.counts.items():
        if not (n or near[name] or name in failed):
            quiet.append(name)
            continue
        notes = [f"{k} folded into {into}" for into, k in folded.get(name, {}).items()]
        if refused[name]:
            notes.append(f"{refused[name]} would not fuse on an NPU (SoC limits, above)")
        if name in failed:
            notes.append("FAILED in a graph, which was left as it was (below)")
        rows.append(PassRow(name, n, near[name], executed.get(name, n), ", ".join(notes)))
    return rows, quiet


def pass_table(rows: Sequence[PassRow], executed: bool = False) -> list[str]:
    """The headline table: per pass that found something, its fused sites, near misses,
    and how many a later pass folded in; with `executed`, the sites counted per run."""
    head = "| pass | fused sites |" + (" executed |" if executed else "") + " near misses | note |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.fused} |" + (f" {row.executed} |" if executed else "")
                     + f" {row.near_misses} | {row.note} |")
    return lines


def _quiet_line(quiet: Sequence[str]) -> str:
    return (f"{len(quiet)} more {'pass' if len(quiet) == 1 else 'passes'} ran and found no candidate: "
            f"{', '.join(quiet)}.")


# Ops whose count changes by our own bookkeeping, not by a fusion: shown below the op
# table. Views downstream of a fused op become reshapes (fused ops return contiguous
# tensors; torchair's view_to_reshape does the same to every view before lowering), and
# getitems are the outputs of multi-output ops.
_VIEW_OPS = ("aten.view.default", "aten.reshape.default")
_BOOKKEEPING_OPS = (*_VIEW_OPS, "getitem")


def _conversions_note(op: str, g: "GraphReport") -> str:
    """Why a conversion op's count changed: the ones fusion removed with the code around
    them, and the chains it added (GraphReport.conversions_added)."""
    chains = {what.split(": ", 1)[1]: n for what, n in g.conversions_added.items()
              if what.startswith(op.rsplit(".", 1)[0] + ": ")}
    if not chains:
        return ""
    added = sum(n * what.split(" for ")[0].count(" -> ") for what, n in chains.items())
    removed = g.ops_before[op] + added - g.ops_after[op]
    return (f"fusion removed {removed} (inside fused code) and added {added}: "
            + "; ".join(f"{what} (x{n})" for what, n in chains.items()))


def op_changes(g: "GraphReport") -> tuple[list[tuple[str, int, int, str]], list[str]]:
    """The ops fusion changed: rows (op, count before, after, note on conversions), fewest
    after first and then by name (the same order in every run), and sentences on the
    bookkeeping changes the rows leave out (views that became reshapes, getitems)."""
    changed = sorted((op for op in set(g.ops_before) | set(g.ops_after) if g.ops_before[op] != g.ops_after[op]),
                     key=lambda op: (g.ops_after[op] - g.ops_before[op], op))
    rows = [(op, g.ops_before[op], g.ops_after[op], _conversions_note(op, g))
            for op in changed if op not in _BOOKKEEPING_OPS]
    sentences = []
    views = [op for op in changed if op in _VIEW_OPS]
    if views:
        sentences.append("Views and reshapes (inside fused code they go; a view a fused op's contiguous output "
                         "breaks became a reshape; torchair's view_to_reshape makes every view one): "
                         + ", ".join(f"{op} {g.ops_before[op]} -> {g.ops_after[op]}" for op in views) + ".")
    if "getitem" in changed:
        sentences.append(f"getitem {g.ops_before['getitem']} -> {g.ops_after['getitem']}: "
                         "the outputs of multi-output ops (fused ops return several tensors).")
    return rows, sentences


def op_table(g: "GraphReport") -> list[str]:
    """The ops a fusion changed, before and after, as markdown (op_changes)."""
    rows, sentences = op_changes(g)
    lines = []
    if rows:
        lines += ["", "| op | before | after | note |", "|---|---|---|---|"]
        lines += [f"| {op} | {before} | {after} | {note} |" for op, before, after, note in rows]
    if sentences:
        lines += [""] + sentences
    return lines


_BYTE_UNITS = (("B", 1), ("KB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))


def human_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps three significant digits below 1000: "512 B",
    "1.75 MB", "5 GB" (never "5e+03 MB")."""
    for unit, size in _BYTE_UNITS[:-1]:
        text = f"{n / size:.3g}"
        if float(text) < 1000:
            return f"{text} {unit}"
    unit, size = _BYTE_UNITS[-1]
    return f"{n / size:.3g} {unit}"


def _pass_line(r: PassResult) -> str:
    if r.error:
        return f"- **{r.pass_name}**: FAILED, graph left as it was: {r.error}"
    return (f"- **{r.pass_name}**: {len(r.sites)} fused, {len(r.near_misses)} near misses "
            f"({r.seconds * 1e3:.1f} ms)")
