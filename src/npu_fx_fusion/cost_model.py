"""Estimated device time of a graph, per SoC: a roofline over the ops it launches.

Each op that launches a kernel costs

    seconds = launch + max(bytes / HBM bandwidth, cube FLOPs / cube throughput,
                           vector elements / vector throughput)

with the SoC's figures below (every figure with its source), in the precision the op
computes in. What an op does comes from the graph: its tensor inputs and outputs (bytes),
the contraction of the matmul-like aten ops (cube FLOPs), one vector operation per output
element otherwise; an NPU op whose work differs says so in its capability
(OpCapability.work: FLOPs of an attention kernel, the part of a cache a scatter writes, the
copies a torchair lowering adds around a kernel). The engine names no op family here.

What is not a launch on an NPU, following what torchair does with the graph:
- views, getitems and SymInt arithmetic (report._computes);
- a copy_ into a graph input of a value the graph computed: torchair writes the value
  there directly (max-autotune maps the Assign onto a graph output that reuses the input's
  memory, fx2ge_converter._mapping_assign_op_to_graph_output; an ACL graph re-inplaces the
  op that produced it, _acl_concrete_graph/graph_pass._mutated_input_reinplace, and
  patterns/_recover_view_inplace_pattern.py for scatter_update from CANN 8.3.RC1 on). The
  op that produced the value then runs in place: it writes the part it updates, not a
  new copy of the whole input (`_inplace_writes`);
- a constant (a value that depends on no graph input, such as the compressed causal mask
  of a FlashAttention call) is computed once per graph however often the graph spells it
  out: identical constant subgraphs count once (GE folds constants at compile time).

It is an estimate for comparing graphs (before and after fusion, one fusion against the
code it replaces), not a timing: it ignores caches, overlap between kernels, tiling and
the host. In decode, where tensors are small, the launches dominate it.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx

from .nodes import hashable, is_call
from .npu_ops.spec import OpCall, tensor_bytes
from .report import SourceLocation, _computes

Node = torch.fx.Node
aten = torch.ops.aten


@dataclass(frozen=True)
class Figure:
    value: float
    source: str


# The CANN platform configuration of each SoC (data/platform_config/<SoC>.ini in the CANN
# toolkit; CANN 8.1.RC1's, mirrored at github.com/leideng/CANN-8.1.RC1,
# Ascend/ascend-toolkit/8.1.RC1/aarch64-linux/data/platform_config/): Ascend910B1.ini (A2)
# and Ascend910_9391.ini (A3, one die; torch_npu sees each die of an A3 package as one device)
# both give cube_core_cnt=24, vector_core_cnt=48, cube_freq=1850 (MHz),
# cube_m/n/k_size=16, vec_calc_size=128, ub_size=196608.
_CANN_INI = "CANN 8.1.RC1 platform_config/{ini}: "
_CUBE_FP16 = 24 * 16 * 16 * 16 * 2 * 1.85e9  # cores x MACs per cycle x 2 FLOP x Hz = 363.7 TFLOP/s
_VECTOR_FP16 = 48 * 128 * 1.85e9  # vector cores x fp16 lanes x Hz = 11.4 T elements/s


def _cann_figures(ini: str) -> dict:
    where = _CANN_INI.format(ini=ini)
    return {
        "cube": {
            "half": Figure(_CUBE_FP16, where + "24 cube cores x 16x16x16 MACs x 2 FLOP x 1850 MHz"),
            # Ascend C's fractal for float operands is 16x8 in K where fp16's is 16x16: half
            # the MACs per cycle (derived, not a published figure)
            "float": Figure(_CUBE_FP16 / 2, where + "fp16 rate / 2 (float fractals are 16x8, fp16 16x16)"),
        },
        "vector": {
            # a 256-byte vector unit (Hot Chips 2019 Da Vinci: "2048-bit vector"):
            # 128 fp16/bf16 lanes, 64 fp32 lanes
            "half": Figure(_VECTOR_FP16, where + "48 vector cores x vec_calc_size 128 x 1850 MHz"),
            "float": Figure(_VECTOR_FP16 / 2, where + "fp16 rate / 2 (64 fp32 lanes in 256 bytes)"),
        },
        "ub_bytes": Figure(196608, where + "ub_size=196608"),
    }


@dataclass(frozen=True)
class Roofline:
    """One device's figures (per device torch_npu sees: an A3 die, an A2 chip)."""

    soc: str
    hbm_bytes_per_s: Figure
    cube_per_s: Mapping[str, Figure]  # "half" (fp16/bf16), "float" (fp32)
    vector_per_s: Mapping[str, Figure]
    launch_seconds: Figure
    ub_bytes: Figure

    def figures(self) -> list[tuple[str, Figure]]:
        return [("HBM bandwidth (B/s)", self.hbm_bytes_per_s),
                *((f"cube {k} (FLOP/s)", v) for k, v in self.cube_per_s.items()),
                *((f"vector {k} (elements/s)", v) for k, v in self.vector_per_s.items()),
                ("per-kernel launch (s)", self.launch_seconds), ("UB (bytes per core)", self.ub_bytes)]


# No public per-kernel launch figure was found for Ascend (CANN docs describe host- and
# device-bound execution, not a number): this is an assumed order of magnitude for one
# kernel of a captured graph (ACL graph / GE sink), where the host no longer dispatches
# ops one by one. Every comparison in this module is between graphs on one SoC, so the
# value scales how much launches weigh against bytes, not which graph launches fewer.
_LAUNCH = Figure(5e-6, "assumed: no published per-kernel figure (see cost_model.py)")

ROOFLINES: dict[str, Roofline] = {
    "Ascend910B": Roofline(
        "Ascend910B",
        # Atlas A2 (Ascend 910B) HBM: 64 GB, up to 1.6 TB/s (Huawei Atlas 300I/800I A2 product
        # specifications); CANN's own per-core rate agrees in magnitude: ddr_rate=32 B/cycle x
        # 24 cores x 1.85 GHz = 1.42 TB/s (Ascend910B1.ini [AICoreMemoryRates])
        Figure(1.6e12, "Huawei Atlas A2 product specifications: HBM up to 1.6 TB/s; "
                       "Ascend910B1.ini ddr_rate=32 B/cycle/core -> 1.42 TB/s"),
        _cann_figures("Ascend910B1.ini")["cube"], _cann_figures("Ascend910B1.ini")["vector"],
        _LAUNCH, _cann_figures("Ascend910B1.ini")["ub_bytes"]),
    "Ascend910_93": Roofline(
        "Ascend910_93",
        # Ascend 910C (A3) = two dies, each one device: CloudMatrix384 has 384 Ascend 910C and
        # 1229 TB/s of memory bandwidth in total (Huawei, WAIC 2025; Zuo et al., "Serving
        # Large Language Models on Huawei CloudMatrix384", arXiv:2506.12708): 3.2 TB/s a
        # package, 1.6 TB/s a die
        Figure(1.6e12, "Huawei CloudMatrix384 (arXiv:2506.12708, WAIC 2025): 1229 TB/s over 384 "
                       "Ascend 910C of two dies = 1.6 TB/s per die"),
        _cann_figures("Ascend910_9391.ini")["cube"], _cann_figures("Ascend910_9391.ini")["vector"],
        _LAUNCH, _cann_figures("Ascend910_9391.ini")["ub_bytes"]),
}
DEFAULT_SOC = "Ascend910B"
# A fused site counts as slower only beyond this fraction of the code's time (or 10 ns): a
# few bytes more of an index tensor are below what this model can tell apart.
RESOLUTION = 0.01  # the SoC the emulation's graphs are traced for (npu_dispatch)


def roofline(soc: Optional[str]) -> Roofline:
    """The figures of `soc`, or of the default SoC when it has none here (None, 310P, 950)."""
    return ROOFLINES.get(soc or DEFAULT_SOC, ROOFLINES[DEFAULT_SOC])


@dataclass(frozen=True)
class Work:
    """What one op does on the device."""

    launches: float = 0
    bytes: float = 0
    cube_flops: float = 0
    vector_elems: float = 0
    half: bool = False  # computes in fp16/bf16 (else fp32 rates)

    def seconds(self, rl: Roofline) -> float:
        precision = "half" if self.half else "float"
        busy = max(self.bytes / rl.hbm_bytes_per_s.value,
                   self.cube_flops / rl.cube_per_s[precision].value,
                   self.vector_elems / rl.vector_per_s[precision].value)
        return self.launches * rl.launch_seconds.value + (busy if self.launches else 0.0)


@dataclass
class Estimate:
    """Launches, bytes and seconds of a graph, in total and per group (a decoder layer, or
    "other" for what belongs to none)."""

    soc: str
    launches: float = 0
    bytes: float = 0
    seconds: float = 0.0
    groups: dict = field(default_factory=dict)  # name -> [launches, bytes, seconds]

    def add(self, group: str, work: Work, rl: Roofline) -> None:
        seconds = work.seconds(rl)
        self.launches += work.launches
        self.bytes += work.bytes
        self.seconds += seconds
        row = self.groups.setdefault(group, [0, 0, 0.0])
        row[0] += work.launches
        row[1] += work.bytes
        row[2] += seconds

    def to_dict(self) -> dict:
        return {"soc": self.soc, "launches": self.launches, "bytes": int(self.bytes),
                "microseconds": round(self.seconds * 1e6, 3),
                "groups": {name: {"launches": r[0], "bytes": int(r[1]), "microseconds": round(r[2] * 1e6, 3)}
                           for name, r in self.groups.items()}}


# ---- what each node does ---------------------------------------------------------------------
def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def _numel(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    return math.prod(_hint(s) for s in value.shape)


def _is_half(values: Iterable[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) for v in values)


# aten contractions: (output) x (contracted size of the first operand's last dim) multiply-adds
_CONTRACTIONS = (aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
                 aten.baddbmm.default, aten.linear.default, aten._grouped_mm.default)


def _contracted(node: Node) -> int:
    first = node.args[1] if is_call(node, aten.addmm.default, aten.baddbmm.default) else node.args[0]
    value = first.meta.get("val") if isinstance(first, Node) else None
    return _hint(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() else 1


def _call_of(node: Node, mode: Optional[str]) -> OpCall:
    """The node's arguments by schema name, its outputs, the mode: what OpCapability.work reads."""
    schema = node.target._schema  # noqa: SLF001
    values = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            raw = node.args[index]
        elif argument.name in node.kwargs:
            raw = node.kwargs[argument.name]
        else:
            raw = argument.default_value if argument.has_default_value() else None
        values[argument.name] = torch.fx.node.map_aggregate(
            raw, lambda a: a.meta.get("val") if isinstance(a, Node) else a)
    out = node.meta.get("val")
    return OpCall(values, list(out) if isinstance(out, (list, tuple)) else [out], mode)


def _capability_of(node: Node) -> Any:
    """The capability row of the NPU op `node` calls, or None."""
    from .capabilities import CAPABILITIES

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return None
    return CAPABILITIES.get(f"{target.namespace}.{target._opname}")  # noqa: SLF001


def _capability_work(node: Node, mode: Optional[str]) -> Optional[Mapping[str, float]]:
    cap = _capability_of(node)
    return None if cap is None or cap.work is None else cap.work(_call_of(node, mode))


# Views of the aten graph that torchair's GE converters lower to kernels (max-autotune):
# view_as_complex -> GatherV2, GatherV2, Complex (ge_converter/aten/view_as_complex.py);
# view_as_real -> Real, Imag, Pack (view_as_real.py). Other views (transposes, slices) also
# become GE ops there, which GE may fold: they stay free here, so a max-autotune estimate
# is a lower bound.
_GE_KERNELS_OF_VIEWS = {aten.view_as_complex.default: 3, aten.view_as_real.default: 3}


def node_work(node: Node, mode: Optional[str] = None, inplace_writes: Optional[Mapping[Node, int]] = None,
              constants: frozenset = frozenset()) -> Work:
    """What `node` costs: nothing for a node that launches no kernel (views, a copy_
    torchair folds into its producer, ...), else its launch and the work of its kernel.
    Reads of `constants` are not counted: a constant is made once and stays cached (a
    compressed causal mask read by every attention call: 4 MB, in a 192 MB L2)."""
    if mode == "max-autotune" and node.op == "call_function" and node.target in _GE_KERNELS_OF_VIEWS:
        moved = tensor_bytes(node.args[0].meta.get("val")) + tensor_bytes(node.meta.get("val"))
        return Work(_GE_KERNELS_OF_VIEWS[node.target], 2 * moved, 0, _numel(node.meta.get("val")))
    if not _computes(node):
        return Work()
    if is_call(node, aten.copy_.default) and _writes_back_into_input(node):
        return Work()
    inputs = [a.meta.get("val") for a in node.all_input_nodes if a not in constants]
    output = node.meta.get("val")
    half = _is_half(inputs) or _is_half(output if isinstance(output, (list, tuple)) else [output])
    moved = sum(tensor_bytes(v) for v in inputs) + tensor_bytes(output)
    if inplace_writes and node in inplace_writes:
        # runs in place on a graph input (torchair): reads its other inputs, writes as much
        moved = inplace_writes[node]
    facts = _capability_work(node, mode)
    if facts is not None:
        return Work(facts.get("launches", 1), facts.get("bytes", moved), facts.get("cube_flops", 0),
                    facts.get("vector_elems", _numel(output)), half)
    if is_call(node, *_CONTRACTIONS):
        return Work(1, moved, 2 * _numel(output) * _contracted(node), 0, half)
    return Work(1, moved, 0, _numel(output), half)


def _through_views(node: Any) -> Any:
    while isinstance(node, Node) and node.op == "call_function" and not _computes(node) and node.args:
        node = node.args[0]
    return node


def _writes_back_into_input(copy: Node) -> bool:
    """copy_(graph input, value computed in the graph): torchair writes the value in place."""
    destination, source = copy.args[0], copy.args[1]
    return (isinstance(destination, Node) and destination.op == "placeholder"
            and isinstance(source, Node) and _through_views(source).op != "placeholder")


def _inplace_writes(graph: torch.fx.Graph) -> dict[Node, int]:
    """The ops torchair runs in place on a graph input (their value is copied back into the
    input they update: StaticCache's index_copy, scatter_update, a counter's add), each with
    the bytes it then moves: it reads its other tensor inputs and writes as much as the
    largest of them into the input."""
    found = {}
    for copy in graph.find_nodes(op="call_function", target=aten.copy_.default):
        if not _writes_back_into_input(copy):
            continue
        producer = _through_views(copy.args[1])
        if not isinstance(producer, Node) or producer.op != "call_function" or not producer.args:
            continue
        if _through_views(producer.args[0]) is not copy.args[0]:
            continue
        others = [tensor_bytes(a.meta.get("val")) for a in producer.all_input_nodes
                  if _through_views(a) is not copy.args[0]]
        found[producer] = sum(others) + max(others, default=tensor_bytes(producer.meta.get("val")))
    return found


def _constants(graph: torch.fx.Graph) -> set:
    """Nodes whose value depends on no graph input (ones, triu, arange of a literal size)."""
    constant: set = set()
    for node in graph.nodes:
        if node.op == "call_function" and all(a in constant for a in node.all_input_nodes):
            if not _has_symbolic_size(node):
                constant.add(node)
    return constant


def _has_symbolic_size(node: Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def _structure(node: Node, keys: dict) -> tuple:
    """What a constant node computes: its target and arguments, constant arguments by the
    number of their structure in `keys` (a key nesting its arguments' keys would grow with
    the depth of the constant subgraph)."""
    args = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: keys.get(a, a) if isinstance(a, Node) else a)
    return (node.target, hashable(args))


def layer_of(node: Node) -> Optional[str]:
    """ "layers.3" for a node of a model's fourth decoder layer (its module path), else None."""
    module = SourceLocation.of(node).module
    parts = module.split(".")
    for index, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks", "layer") and parts[index + 1].isdigit():
            return f"{part}.{parts[index + 1]}"
    return None


def node_works(graph: torch.fx.Graph, mode: Optional[str] = None) -> list[tuple[Node, Work]]:
    """(node, work) of every node that launches a kernel; a constant subgraph spelled out
    several times (each attention call's own compressed mask) is counted once."""
    inplace = _inplace_writes(graph)
    constants = _constants(graph)
    keys: dict = {}
    counted: dict = {}  # structure -> ("constant", its number)
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node in constants:
            key = _structure(node, keys)
            if key in counted:
                keys[node] = counted[key]
                continue
            keys[node] = counted[key] = ("constant", len(counted))
        work = node_work(node, mode, inplace, constants)
        if work.launches:
            found.append((node, work))
    return found


def graph_work(graph: torch.fx.Graph, mode: Optional[str] = None) -> list[tuple[str, Work]]:
    """(group, work) of every launch: its decoder layer, or "other"."""
    return [(layer_of(node) or "other", work) for node, work in node_works(graph, mode)]


def estimate(graph: torch.fx.Graph, soc: Optional[str] = None, mode: Optional[str] = None,
             work: Optional[Sequence[tuple[str, Work]]] = None) -> Estimate:
    """The roofline estimate of `graph` on `soc` (None: the default SoC)."""
    rl = roofline(soc)
    result = Estimate(rl.soc)
    for group, item in (graph_work(graph, mode) if work is None else work):
        result.add(group, item, rl)
    return result


def estimates(graph: torch.fx.Graph, mode: Optional[str] = None) -> dict[str, Estimate]:
    """{SoC: its estimate of `graph`} for every SoC with figures here (one walk of the graph)."""
    work = graph_work(graph, mode)
    return {soc: estimate(graph, soc, mode, work) for soc in ROOFLINES}


_PREPARATION = (aten.clone.default, aten.constant_pad_nd.default, aten._to_copy.default)


@dataclass(frozen=True)
class SiteCost:
    launches: float
    bytes: float
    flops: float
    seconds: float

    def describe(self) -> str:
        return f"{self.seconds * 1e6:.2f} us in {self.launches:g} launches, {self.bytes / 1e6:.3g} MB"


def site_cost(nodes: Sequence[Node], soc: Optional[str] = None, mode: Optional[str] = None) -> SiteCost:
    """The cost of the call nodes of a site: the matched nodes, or the nodes of a
    replacement. Left out:
    - a node computed from no input of the site (a constant the replacement builds, such
      as a compressed causal mask): it is computed once per graph, not once per site
      (`node_works`);
    - the preparation of a site's input for a kernel (a contiguous copy, a cast, a pad of
      an input, `_PREPARATION`): the op the code calls prepares its inputs as well where its
      kernel needs it (op-plugin / aclnn make strided inputs contiguous inside the call,
      unseen in the graph), so this model does not charge the fused side for spelling it
      out. Work on a fused op's results (rope_qk's copies of its outputs) is counted."""
    rl = roofline(soc)
    calls = [n for n in nodes if n.op == "call_function"]
    inside = set(calls)
    constant: set = set()
    prepared: set = set()
    launches = moved = flops = seconds = 0.0
    for node in calls:
        inputs = node.all_input_nodes
        if all(a in constant for a in inputs) and all(a in inside for a in inputs):
            constant.add(node)
            continue
        if is_call(node, *_PREPARATION) and (node.args[0] not in inside or node.args[0] in prepared):
            prepared.add(node)
            continue
        work = node_work(node, mode, constants=frozenset(constant))
        launches += work.launches
        moved += work.bytes
        flops += work.cube_flops + work.vector_elems
        seconds += work.seconds(rl)
    return SiteCost(launches, moved, flops, seconds)


def _declares_work(node: Node) -> bool:
    cap = _capability_of(node)
    return cap is not None and cap.work is not None


def _is_complex(node: Node) -> bool:
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in values)


def slower(matched: Sequence[Node], replacement: Sequence[Node], soc: Optional[str],
           mode: Optional[str]) -> Optional[str]:
    """Why the replacement is slower than the matched code whatever the sizes, or None:
    as many launches or more, as many bytes and as much compute or more, and one of them
    more (beyond RESOLUTION). A replacement that trades one for another (fewer bytes for
    more launches: softmax_l1_norm's metadata op) is not refused: which wins depends on
    the sizes, and the traced ones are often not the deployed ones (tiny test models).
    Only a replacement whose fused op declares its work (OpCapability.work) is judged: for
    the others the defaults (every input and output moved once) are too coarse to refuse a
    fusion on (their kernels' internals: tiling metadata, what they read of a mask). Code
    that computes in complex numbers is not compared: there are no figures for complex
    arithmetic on the NPU (which is why such code is rewritten into real ops at all)."""
    if any(_is_complex(n) for n in list(matched) + list(replacement)):
        return None
    if not any(_declares_work(n) for n in replacement):
        return None
    before = site_cost(matched, soc, mode)
    after = site_cost(replacement, soc, mode)
    where = roofline(soc).soc + (f", {mode}" if mode else "")

    def more(a: float, b: float) -> bool:
        return a > b * (1 + RESOLUTION)

    not_less = (after.launches >= before.launches and after.bytes >= before.bytes * (1 - RESOLUTION)
                and after.flops >= before.flops * (1 - RESOLUTION))
    if not_less and (after.launches > before.launches or more(after.bytes, before.bytes)
                     or more(after.flops, before.flops)):
        return (f"estimated slower fused ({where}), whatever the sizes: {after.describe()} where the code "
                f"takes {before.describe()} (cost_model.py)")
    return None


def launches_by_op(graph: torch.fx.Graph, mode: Optional[str] = None) -> Counter:
    """Launches per op name, as the estimate counts them."""
    counts: Counter = Counter()
    for node, work in node_works(graph, mode):
        counts[str(node.target)] += work.launches
    return counts
