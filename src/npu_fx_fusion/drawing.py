"""A drawing of an FX graph as SVG, with the fused regions highlighted.

Graphviz lays the graph out: pydot writes the DOT text, Graphviz's `dot` binary turns it
into SVG (run here rather than through pydot, which has no timeout). Both are optional:
without them `graph_svg` returns None and says so once in the log.

torch's FxGraphDrawer draws through pydot too, but is not used: its labels are record
tables with the args, dtype, shape, stride and requires_grad of every node (about 2.6 KB
of SVG a node: 525 KB for the 2-layer tiny Llama), its styling hooks are private methods
of a class torch marks not backward compatible, and it names DOT nodes by their bare FX
names, which pydot writes unquoted as `node`/`graph`/`edge` default statements when an
FX node is called that. The graph here is small enough to build directly: one box per
node (op name, shape, dtype; the FX name is the SVG <title>, shown on hover), one edge
per use, a title and a legend of the highlight labels above the graph.
"""
from __future__ import annotations

import html
import logging
import operator
import shutil
import subprocess
from typing import Any, Collection, Mapping, Optional, Sequence

import torch
import torch.fx

log = logging.getLogger("npu_fx_fusion.drawing")

# Fill colours for the highlight labels, in order of first appearance in the graph; none
# is the grey of inputs and outputs. A drawing with more labels than these gets as many
# hues spread evenly around the colour wheel instead (distinct_colours): no two labels of
# one drawing share a colour.
PALETTE = ("#ffb347", "#77dd77", "#84b6f4", "#fdfd96", "#ff6961", "#c3a6ff", "#f49ac2", "#76d7c4")
IO_FILL = "#eeeeee"  # placeholders and the output
NEAR_MISS_COLOUR = "#d62728"  # the dashed border of a near miss's nodes, and its legend text
MAX_OUTPUT_EDGES = 8  # a graph returning more values has no edges into its output node
DOT_TIMEOUT = 60.0  # seconds; a graph taking longer to lay out is not drawn

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}

_missing_logged = False


def fused_nodes(gm: torch.fx.GraphModule, original: Collection[torch.fx.Node] = ()) -> dict[torch.fx.Node, str]:
    """The nodes calling a fused op of capabilities.CAPABILITIES, each with the op's name.

    {node: "npu_rms_norm", ...}: a node counts when its target is an OpOverload whose
    "{namespace}.{opname}" is a CAPABILITIES key ("npu.npu_rms_norm") and it is not one of
    the graph's `original` nodes: on an NPU graph torch_npu's own dispatch already calls
    some (npu_fusion_attention_v3 for SDPA), which no pass fused.
    """
    from .capabilities import CAPABILITIES

    found = {}
    for node in gm.graph.nodes:
        if node in original:
            continue
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            opname = target.overloadpacket.__name__
            if f"{target.namespace}.{opname}" in CAPABILITIES:
                found[node] = opname
    return found


def distinct_colours(n: int) -> list[str]:
    """`n` fill colours, pairwise distinct and light enough for black text: PALETTE's first
    `n`, or for more than it holds `n` hues evenly spaced (HSL, 70% saturation, 75% lightness)."""
    import colorsys

    if n <= len(PALETTE):
        return list(PALETTE[:n])
    colours = []
    for i in range(n):
        red, green, blue = colorsys.hls_to_rgb((i / n + 0.08) % 1.0, 0.75, 0.7)
        colours.append("#%02x%02x%02x" % (round(red * 255), round(green * 255), round(blue * 255)))
    return colours


def drawing_unavailable() -> Optional[str]:
    """Why graphs cannot be drawn here (pydot or Graphviz's `dot` missing), or None."""
    try:
        import pydot  # noqa: F401
    except ImportError:
        return "pydot is not installed (pip install pydot)"
    if shutil.which("dot") is None:
        return "Graphviz's `dot` is not on PATH (apt-get install graphviz)"
    return None


def graph_svg(gm: torch.fx.GraphModule, highlight: Mapping[torch.fx.Node, str], title: str,
              timeout: float = DOT_TIMEOUT, colours: Optional[Mapping[str, str]] = None,
              near_misses: Optional[Mapping[torch.fx.Node, str]] = None) -> Optional[str]:
    """SVG text of `gm`'s graph; the nodes of `highlight` filled with a colour per label.

    `highlight` maps nodes to a short label (a pass or fused-op name); a legend above the
    graph lists the labels with their colours: `colours` ({label: "#rrggbb"}, so that two
    drawings colour alike), else distinct_colours in order of first appearance.
    `near_misses` maps nodes to the pass that left them unfused: drawn with a dashed red
    border, the passes named in the legend. Returns None, and logs, when pydot or
    Graphviz's `dot` is missing (once per process) or `dot` takes over `timeout` seconds.
    """
    global _missing_logged
    missing = drawing_unavailable()
    if missing:
        if not _missing_logged:
            _missing_logged = True
            log.info("graph drawings skipped: %s", missing)
        return None
    import pydot

    near_misses = near_misses or {}
    if colours is None:  # in graph order, so the same graph draws the same
        labels = list(dict.fromkeys(highlight[node] for node in gm.graph.nodes if node in highlight))
        colours = dict(zip(labels, distinct_colours(len(labels))))
    else:  # the legend lists the labels this drawing has
        colours = {label: colour for label, colour in colours.items() if label in set(highlight.values())}
    # A graph returning many values (the saved activations of a training forward, the
    # gradients of a backward) gets no edges into its output: dot routes each through
    # every rank in between, and lays 700 nodes out in minutes instead of seconds. Its
    # output box says how many values it returns; the nodes returned get a double border.
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    returned = set(output.all_input_nodes) if output is not None else set()
    collapsed = len(returned) > MAX_OUTPUT_EDGES

    missed = sorted(set(near_misses.values()))
    dot = pydot.Dot("G", graph_type="digraph", rankdir="TB", labelloc="t", nodesep="0.15", ranksep="0.3",
                    fontname="Helvetica", fontsize="12", label=_graph_label(title, colours, missed))
    dot.set_node_defaults(shape="box", fontname="Helvetica", fontsize="9", height="0.3", margin="0.05,0.02")
    dot.set_edge_defaults(arrowsize="0.5")
    for node in gm.graph.nodes:
        lines = _node_label(node, highlight.get(node))
        attrs: dict[str, Any] = {}
        if node in highlight:
            attrs.update(style="filled", fillcolor=colours[highlight[node]], penwidth="2")
        elif node.op in ("placeholder", "output"):
            attrs.update(style="filled", fillcolor=IO_FILL)
        if node in near_misses:
            attrs.update(color=NEAR_MISS_COLOUR, penwidth="2",
                         style=",".join(filter(None, (attrs.get("style"), "dashed"))))
        if collapsed and node is output:
            lines.append(f"{len(returned)} values, double-bordered")
        elif collapsed and node in returned:
            attrs.update(peripheries="2")
        dot.add_node(pydot.Node(_quoted(node.name), label=_quoted(*lines), **attrs))
    for node in gm.graph.nodes:
        for user in node.users:
            if not (collapsed and user is output):
                dot.add_edge(pydot.Edge(_quoted(node.name), _quoted(user.name)))
    try:
        run = subprocess.run([shutil.which("dot") or "dot", "-Tsvg"], input=dot.to_string(),
                             capture_output=True, encoding="utf-8", timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("graph drawing %r skipped: Graphviz took over %gs for %d nodes",
                    title, timeout, len(gm.graph.nodes))
        return None
    if run.returncode != 0:
        raise RuntimeError(f"Graphviz failed to draw {title!r}: {run.stderr.strip()}")
    return run.stdout


def _quoted(*lines: str) -> str:
    """A DOT string of `lines` (centred, one per line).

    Every id is quoted here, not by pydot: pydot leaves `node`, `graph` and `edge`
    unquoted, which DOT reads as default-attribute statements, not as nodes.
    """
    escaped = (line.replace("\\", "\\\\").replace('"', '\\"') for line in lines)
    return '"' + "\\n".join(escaped) + '"'


LEGEND_COLUMNS = 2  # legend cells per row: the legend does not widen the drawing of one layer


def _graph_label(title: str, colours: Mapping[str, str], near_misses: Sequence[str] = ()) -> str:
    """An HTML-like DOT label: the title, then one coloured cell per highlight label, and
    one red cell per pass with a near miss drawn, in rows of LEGEND_COLUMNS."""
    cells = [f'<td bgcolor="{colour}">{html.escape(label, quote=False)}</td>' for label, colour in colours.items()]
    cells += [f'<td><font color="{NEAR_MISS_COLOUR}">near miss ({html.escape(name, quote=False)}): dashed</font></td>'
              for name in near_misses]
    columns = max(min(len(cells), LEGEND_COLUMNS), 1)
    rows = f'<tr><td colspan="{columns}"><b>{html.escape(title, quote=False)}</b></td></tr>'
    for start in range(0, len(cells), columns):
        rows += f"<tr>{''.join(cells[start:start + columns])}</tr>"
    return f'<<table border="0" cellborder="1" cellspacing="2">{rows}</table>>'


def _node_label(node: torch.fx.Node, highlighted: Optional[str]) -> list[str]:
    if node.op in ("placeholder", "get_attr"):
        name = node.name
    elif node.op == "output":
        name = "output"
    else:
        name = _target_name(node.target)
    lines = [name]
    if highlighted and highlighted != name:  # one line per op of a multi-op label: boxes stay narrow
        lines[:0] = f"[{highlighted}]".replace(" + ", " +\n").split("\n")
    value = _value_text(node.meta.get("val"))
    if value:
        lines.append(value)
    return lines


def _target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        return packet.__name__
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _value_text(value: Any, depth: int = 0) -> str:
    """"2x16x64 f32" for a tensor; the first two of a tuple; "" for what has no shape."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(d) for d in value.shape) or "scalar"
        return f"{shape} {_DTYPES.get(value.dtype, str(value.dtype).replace('torch.', ''))}"
    if isinstance(value, (tuple, list)) and value and depth == 0:
        parts = [_value_text(v, 1) for v in value[:2]]
        return ", ".join(p for p in parts if p) + (", ..." if len(value) > 2 else "")
    if isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    return ""
