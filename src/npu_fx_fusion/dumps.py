"""What FusionConfig(dump_dir=DIR) writes, and what each file is.

    DIR/report.html                        the report to look at: pass table, near misses with
                                           their source lines, one decoder layer drawn before and
                                           after fusion side by side (self-contained, no network)
    DIR/report.md, DIR/report.json         the report as text and as data
    DIR/graph_NNN_<phase>/before.py        the graph as the passes received it (FX code with the
                                           model's source lines as comments)
    DIR/graph_NNN_<phase>/after.py         the same graph after fusion
    DIR/graph_NNN_<phase>/after.svg        a drawing of the whole fused graph, fused ops filled
    DIR/graph_NNN_<phase>/layer_before.svg one decoder layer before fusion, replaced nodes filled
    DIR/graph_NNN_<phase>/layer_after.svg  the same layer after fusion, fused ops filled

The report files are rewritten after every graph (a training step compiles its backward
later). Drawings need pydot and Graphviz (drawing.py); without them they are skipped and
report.html says so.
"""
from __future__ import annotations

import copy
import html
import logging
import os
import re
from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.fx

if TYPE_CHECKING:
    from .report import FusionReport, GraphReport

log = logging.getLogger("npu_fx_fusion")

# file name (in DIR or a graph folder) -> what it is, for describe_dump and report.html
FILES = {
    "report.html": "the report to open in a browser: pass table, near misses with their source lines, "
                   "one decoder layer before/after fusion",
    "report.md": "the report as markdown (what the CLI prints)",
    "report.json": "the report as JSON (FusionReport.to_dict())",
    "before.py": "the graph as the passes received it: FX code, the model's source lines as comments",
    "after.py": "the graph after fusion",
    "after.svg": "drawing of the whole fused graph, each fused op filled in its colour",
    "layer_before.svg": "one decoder layer before fusion, the nodes fusion replaced filled",
    "layer_after.svg": "the same layer after fusion, its fused ops filled",
}
LAYER_FILES = ("layer_before.svg", "layer_after.svg")
# DIR/error_<what>.txt (pipeline._log_failure): written only when a graph's fusion was reverted
ERROR_FILE = "the full error of a graph's fusion that failed and was reverted"


def describe_dump(dump_dir: str) -> list[tuple[str, str]]:
    """[(path relative to dump_dir, what it is)] for every file in it, in a stable order."""
    found = []
    for root, dirs, files in os.walk(dump_dir):
        dirs.sort()
        for name in sorted(files, key=lambda f: (list(FILES).index(f) if f in FILES else len(FILES), f)):
            path = os.path.relpath(os.path.join(root, name), dump_dir)
            found.append((path, FILES.get(name, ERROR_FILE if name.startswith("error_") else "")))
    return found


class Dumper:
    """Writes graph_NNN_<name>/{before.py, after.py, after.svg, layer_*.svg} and the report files."""

    def __init__(self, dump_dir: Optional[str]):
        self.dump_dir = dump_dir
        self._before: Optional[torch.fx.Graph] = None

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

    def keep_before(self, gm: torch.fx.GraphModule) -> None:
        """Keep a copy of the graph before fusion, for the layer drawing (dumping only)."""
        if self.dump_dir:
            self._before = copy.deepcopy(gm.graph)

    def draw(self, folder: Optional[str], gm: torch.fx.GraphModule, title: str,
             original_nodes: Collection[torch.fx.Node] = (), graph_report: Optional["GraphReport"] = None) -> None:
        """after.svg: the graph with its fused ops highlighted; with `graph_report`, the
        layer drawings too (needs pydot and Graphviz).

        A drawing is a convenience: one that fails is logged, never an error of the compile.
        """
        if not folder:
            return
        from .drawing import fused_nodes, graph_svg

        try:
            svg = graph_svg(gm, fused_nodes(gm, original_nodes), title)
            if svg is not None:
                self.write(folder, "after.svg", svg)
            if graph_report is not None and self._before is not None:
                for filename, text in layer_drawings(self._before, gm, graph_report, title.split(":")[0],
                                                      original_nodes).items():
                    self.write(folder, filename, text)
        except Exception as exc:  # noqa: BLE001 - Graphviz failing must not fail a compile
            log.warning("could not draw %s: %s: %s", title, type(exc).__name__, exc)

    def write_reports(self, report: "FusionReport") -> None:
        if self.dump_dir:
            self.write(self.dump_dir, "report.md", report.to_markdown())
            self.write(self.dump_dir, "report.json", report.to_json())
            self.write(self.dump_dir, "report.html", report_html(report, self.dump_dir))


# ---- one decoder layer, before and after ----------------------------------------------------
def layer_of(node: torch.fx.Node) -> Optional[str]:
    """The repeated block a node belongs to: its module path up to the first index
    ("lm.model.layers.1" for lm.model.layers.1.mlp.experts), or None."""
    from .report import _module_path

    parts = _module_path(node).split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return ".".join(parts[:index + 1]) if index is not None else None


def _is_plumbing(node: torch.fx.Node) -> bool:
    """Views, reshapes, getitems: drawn as plain edges in a layer drawing."""
    import operator

    from .report import _FREE_OPS

    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target._opname in _FREE_OPS  # noqa: SLF001


def _layer_module(graph: torch.fx.Graph, layer: str) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """The nodes of `layer` as a graph of their own: what flows in from outside becomes a
    placeholder, what flows out the output; views and getitems are contracted into edges.
    Returns it and {FX name: its node}."""
    inside = [n for n in graph.nodes if n.op == "call_function" and layer_of(n) == layer]
    members = set(inside)
    drawn = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}

    def value(node: torch.fx.Node) -> Any:
        if node not in env:
            if node in members and _is_plumbing(node):  # stands for the tensor it views
                source = node.all_input_nodes[0] if node.all_input_nodes else None
                env[node] = value(source) if source is not None else None
            elif node not in members:
                outside = drawn.placeholder(node.name)
                outside.meta["val"] = node.meta.get("val")
                env[node] = outside
        return env[node]

    for node in inside:
        if _is_plumbing(node):
            continue
        args = torch.fx.node.map_arg(node.args, value)
        kwargs = torch.fx.node.map_arg(node.kwargs, value)
        copied = drawn.create_node("call_function", node.target, args, kwargs, name=node.name)
        copied.meta["val"] = node.meta.get("val")
        env[node] = copied
    leaving = {value(n) for n in inside if any(u not in members for u in n.users)}
    drawn.output(tuple(v for v in drawn.nodes if v in leaving))
    return torch.fx.GraphModule(torch.nn.Module(), drawn), {n.name: n for n in drawn.nodes}


def pick_layer(after: torch.fx.Graph, original_nodes: Collection[torch.fx.Node] = ()) -> Optional[str]:
    """The layer to draw: the one with the most kinds of fused ops, then the most of them
    (ops the passes added: not the graph's `original_nodes`, drawing.fused_nodes)."""
    from .drawing import fused_nodes

    gm = torch.fx.GraphModule(torch.nn.Module(), after) if not isinstance(after, torch.fx.GraphModule) else after
    per_layer: dict[str, list[str]] = {}
    for node, op in fused_nodes(gm, original_nodes).items():
        layer = layer_of(node)
        if layer is not None:
            per_layer.setdefault(layer, []).append(op)
    if not per_layer:
        return None
    return max(per_layer, key=lambda layer: (len(set(per_layer[layer])), len(per_layer[layer])))


def _final_sites(before: torch.fx.Graph, graph_report: "GraphReport") -> dict[Any, Any]:
    """{site: the site whose fused ops its nodes end up in}: itself, or a later site that
    folded it in.

    A site a later site folded in (FusedSite.consumed: add_rms_norm takes rms_norm's
    npu_rms_norm) ends up in the later one's op. Which earlier site it was: one whose
    replaced nodes read a node of the graph before fusion that the later site replaced
    (the norm reads the residual add that add_rms_norm replaces)."""
    by_name = {n.name: n for n in before.nodes}
    sites = [site for result in graph_report.passes for site in result.sites]
    final = {site: site for site in sites}
    # how many sites of each pass a later pass folded away (GraphReport.folded): an op the
    # later site puts back in the graph (moe_dispatch's block around npu_swiglu) is not
    # folded, its earlier site keeps its own label
    budget = {(producer, consumer): n for producer, into in graph_report.folded().items() for consumer, n in into.items()}

    def fold(earlier: Any, later: Any) -> None:
        final[earlier] = final[later]
        budget[earlier.pass_name, later.pass_name] -= 1
        wanted[earlier.fused_op] -= 1

    for index, later in enumerate(sites):
        if not later.consumed:
            continue
        replaced = set(later.replaced)
        wanted = Counter(later.consumed)
        for earlier in sites[:index]:
            if budget.get((earlier.pass_name, later.pass_name), 0) > 0 and wanted[earlier.fused_op] > 0 and any(
                    arg.name in replaced for name in earlier.replaced if name in by_name
                    for arg in by_name[name].all_input_nodes):
                fold(earlier, later)
        # A later site that replaced the earlier fused ops themselves and nothing of the
        # graph before fusion around them (rope_qk takes q's and k's npu_rotary_mul): the
        # earlier sites of those ops not yet folded anywhere, those of its own module first
        # (its layer). Which of them it was does not change a drawing: the label is the op's.
        if all(name in by_name for name in later.replaced):
            continue
        free = [site for site in sites[:index] if final[site] is site and wanted[site.fused_op] > 0]
        for earlier in sorted(free, key=lambda site: site.location.module != later.location.module):
            if wanted[earlier.fused_op] > 0 and budget.get((earlier.pass_name, later.pass_name), 0) > 0:
                fold(earlier, later)
    return final


def _site_label(site: Any, present: Collection[str]) -> str:
    """A site's label in the drawings: the fused ops its replacement put in the graph
    ("npu_moe_init_routing_v2 + npu_moe_finalize_routing"), those of them `present`, else
    its main op. One label, one colour: the nodes a site replaced and every op it emitted."""
    ops = [op.split(".", 1)[-1] for op in site.emitted]
    shown = [op for op in ops if op in present] or [site.fused_op.split(".", 1)[-1]]
    return " + ".join(dict.fromkeys(shown))


def _near_miss_nodes(graph: torch.fx.Graph, layer: str, graph_report: "GraphReport") -> dict[str, str]:
    """{FX name: pass} of the nodes of `layer` on a line the passes left a near miss at:
    the nodes of that source line in that module (a near miss names a line, not a node)."""
    from .report import SourceLocation

    lines = {(m.location.module, m.location.file, m.location.line): r.pass_name
             for r in graph_report.passes for m in r.near_misses if m.location.file}
    found = {}
    for node in graph.nodes:
        if node.op == "call_function" and layer_of(node) == layer and not _is_plumbing(node):
            where = SourceLocation.of(node)
            name = lines.get((where.module, where.file, where.line))
            if name is not None:
                found[node.name] = name
    return found


def _colour_kept_calls(before: torch.fx.Graph, before_nodes: dict[str, torch.fx.Node], label_of: dict[Any, str],
                       highlight_before: dict[torch.fx.Node, str]) -> None:
    """A site whose nodes were all made by an earlier fusion (grouped_matmul's expert GEMM,
    which moe_dispatch's replacement calls again where the model called it) names none of
    the graph before fusion. A kept call keeps the source line of the call it stands for
    (accept._inherit_kept_calls), so the before-drawing nodes of that line, inside the
    earlier site, take this site's colour: they became its op."""
    from .report import SourceLocation

    by_name = {n.name: n for n in before.nodes}
    for site, label in label_of.items():
        if not site.location.file or any(name in by_name for name in site.replaced):
            continue
        for name, node in before_nodes.items():
            original = by_name.get(name)
            if node in highlight_before and original is not None and SourceLocation.of(original) == site.location:
                highlight_before[node] = label


def layer_drawings(before: torch.fx.Graph, after: torch.fx.GraphModule, graph_report: "GraphReport",
                   title: str, original_nodes: Collection[torch.fx.Node] = ()) -> dict[str, str]:
    """{"layer_before.svg": ..., "layer_after.svg": ...} for the layer pick_layer chooses:
    each fused site's replaced nodes (before) and the ops it emitted (after) in one colour,
    distinct from every other site's; the nodes of a near miss's line dashed red. {} when
    there is no such layer or drawing is unavailable."""
    from .drawing import distinct_colours, fused_nodes, graph_svg

    layer = pick_layer(after.graph, original_nodes)
    if layer is None:
        return {}
    before_gm, before_nodes = _layer_module(before, layer)
    after_gm, after_nodes = _layer_module(after.graph, layer)
    # the layer's copies keep their FX names: what the whole graph highlights, by name
    fused_after = {after_nodes[node.name]: op for node, op in fused_nodes(after, original_nodes).items()
                   if node.name in after_nodes and after_nodes[node.name].op == "call_function"}
    present = set(fused_after.values())
    label_of = {site: _site_label(final, present) for site, final in _final_sites(before, graph_report).items()}
    highlight_before = {}
    # a node two sites replaced (moe_dispatch's block around the expert GEMMs that
    # grouped_matmul fuses) takes the label of the smaller, more specific one
    for site, label in sorted(label_of.items(), key=lambda item: len(item[0].replaced)):
        for name in site.replaced:
            if name in before_nodes and before_nodes[name].op == "call_function":
                highlight_before.setdefault(before_nodes[name], label)
    _colour_kept_calls(before, before_nodes, label_of, highlight_before)
    op_label = {}  # a fused op in the after drawing takes the label of the site that emitted it
    for label in label_of.values():
        for op in label.split(" + "):
            op_label.setdefault(op, label)
    highlight_after = {node: op_label.get(op, op) for node, op in fused_after.items()}
    labels = list(dict.fromkeys([*highlight_after.values(), *highlight_before.values()]))
    colours = dict(zip(labels, distinct_colours(len(labels))))
    drawings = {}
    for filename, gm, nodes, graph, highlight, when in (
            ("layer_before.svg", before_gm, before_nodes, before, highlight_before, "before fusion"),
            ("layer_after.svg", after_gm, after_nodes, after.graph, highlight_after, "after fusion")):
        missed = {nodes[name]: pass_name for name, pass_name in _near_miss_nodes(graph, layer, graph_report).items()
                  if name in nodes}
        svg = graph_svg(gm, highlight, f"{title}: {layer}, {when}", colours=colours, near_misses=missed)
        if svg is None:
            return {}
        drawings[filename] = svg
    return drawings


# ---- report.html --------------------------------------------------------------------------
_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; } h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; font-size: 0.9em; }
th { background: #f3f3f3; }
td.n { text-align: right; }
code { font-family: Menlo, Consolas, monospace; font-size: 0.92em; background: #f6f6f6; }
.layers { display: flex; gap: 1em; align-items: flex-start; }
.layer { flex: 1 1 50%; min-width: 0; border: 1px solid #ddd; padding: 0.5em; overflow: auto; max-height: 85vh; }
.layer svg { max-width: none; height: auto; }
.note { color: #666; font-size: 0.9em; }
ul.summary li { margin: 0.2em 0; }
li.ok { color: #1a7f37; } li.bad { color: #c62828; font-weight: bold; }
details { margin: 0.5em 0; }
"""


def _svg_body(svg: str) -> str:
    """An SVG file's <svg> element alone, for inlining (no XML prolog or DOCTYPE)."""
    start = svg.find("<svg")
    return svg[start:] if start >= 0 else ""


def _location_cells(location: Any) -> str:
    where = f"{location.file.rsplit('/', 1)[-1]}:{location.line}" if location.file else ""
    return (f"<td><code>{html.escape(location.module)}</code></td><td><code>{html.escape(where)}</code></td>"
            f"<td><code>{html.escape(location.code)}</code></td>")


def report_html(report: "FusionReport", dump_dir: Optional[str] = None) -> str:
    """A self-contained HTML page of `report` (inline CSS and SVG, no script, no network):
    what was compiled, which graph and SoC limits, the outputs-vs-eager verdict, the pass
    table, the fused ops, for each graph its cost, its layer drawings side by side (for a
    graph dumped under `dump_dir`) and its op table, every near miss with its source line."""
    from .drawing import drawing_unavailable
    from .report import _quiet_line, graph_title, op_changes, pass_rows

    e = html.escape
    title = "npu-fx-fusion report" + (f": {report.target}" if report.target else "")
    out = ["<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
           f"<title>{e(title)}</title>", f"<style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    if not report.graphs:
        return "\n".join(out + ["<p>No graph was compiled.</p></body></html>"])
    out.append(_summary_html(report))
    rows, quiet = pass_rows(report)
    executed = report.reused
    out += ["<h2>Fused sites per pass</h2>",
            "<table><tr><th>pass</th><th>fused sites</th>" + ("<th>executed</th>" if executed else "")
            + "<th>near misses</th><th>note</th></tr>"]
    for row in rows:
        out.append(f"<tr><td>{e(row.name)}</td><td class=\"n\">{row.fused}</td>"
                   + (f"<td class=\"n\">{row.executed}</td>" if executed else "")
                   + f"<td class=\"n\">{row.near_misses}</td><td>{e(row.note)}</td></tr>")
    out.append("</table>")
    if quiet:
        out.append(f"<p class=\"note\">{e(_quiet_line(quiet))}</p>")
    fused = ", ".join(f"<code>{e(op)}</code> &times;{n}" for op, n in report.fused_ops.items()) or "none"
    out.append(f"<p>Fused ops in the final graphs: {fused}</p>")

    for index, g in enumerate(report.graphs):
        out.append(f"<h2>Graph {index}: {e(graph_title(g))}</h2>")
        out.append(f"<p class=\"note\">{e(g.cost_line())}</p>")
        folder = _graph_folder(dump_dir, index, g.name)
        drawings = [_read(folder, name) for name in LAYER_FILES] if folder else [None, None]
        if all(drawings):
            out += ["<h3>One decoder layer, before and after fusion</h3>",
                    "<p class=\"note\">Each fused site's replaced nodes (left) and the ops it emitted (right) "
                    "share a colour; nodes on a near miss's source line have a dashed red border; views, "
                    "reshapes and getitems are drawn as edges; grey boxes are values from outside the layer. "
                    "Hover a box for its FX name; scroll a drawing to see all of it.</p>",
                    "<div class=\"layers\">"]
            out += [f"<div class=\"layer\">{_svg_body(svg)}</div>" for svg in drawings]
            out.append("</div>")
        elif dump_dir:
            why = drawing_unavailable() or "no decoder layer with a fused op in this graph"
            out.append(f"<p class=\"note\">No layer drawing: {e(why)}.</p>")
        ops, sentences = op_changes(g)
        if ops:
            out += ["<details><summary>ops before and after fusion</summary>",
                    "<table><tr><th>op</th><th>before</th><th>after</th><th>note</th></tr>"]
            out += [f"<tr><td><code>{e(op)}</code></td><td class=\"n\">{before}</td><td class=\"n\">{after}</td>"
                    f"<td>{e(note)}</td></tr>" for op, before, after, note in ops]
            out.append("</table>")
            out += [f"<p class=\"note\">{e(sentence)}</p>" for sentence in sentences]
            out.append("</details>")

    misses = report.near_misses
    out.append(f"<h2>Near misses ({len(misses)})</h2>")
    if misses:
        out.append("<table><tr><th>pass</th><th>why not fused</th><th>module</th><th>line</th><th>code</th></tr>")
        out += [f"<tr><td>{e(m.pass_name)}</td><td>{e(m.reason)}</td>{_location_cells(m.location)}</tr>"
                for m in misses]
        out.append("</table>")
    else:
        out.append("<p>None: every candidate site fused.</p>")

    sites = report.sites
    out += [f"<h2>Fused sites ({len(sites)})</h2>", "<details><summary>every site, with its source line</summary>",
            "<table><tr><th>pass</th><th>form</th><th>fused op</th><th>module</th><th>line</th>"
            "<th>code</th><th>note</th></tr>"]
    out += [f"<tr><td>{e(s.pass_name)}</td><td><code>{e(s.form)}</code></td><td><code>{e(s.fused_op)}"
            f"</code></td>{_location_cells(s.location)}<td>{e(' '.join(filter(None, (s.note, s.verified))))}"
            "</td></tr>" for s in sites]
    out.append("</table></details>")
    if dump_dir:
        out += ["<h2>Files in this folder</h2>", "<table><tr><th>file</th><th>what it is</th></tr>"]
        out += [f"<tr><td><code>{e(path)}</code></td><td>{e(what)}</td></tr>"
                for path, what in describe_dump(dump_dir) if path != "report.html"]
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def _summary_html(report: "FusionReport") -> str:
    """FusionReport.summary_lines as an HTML list (nested items for the sub-bullets), the
    verdict in green or red."""
    e = html.escape
    items: list[list[str]] = []
    for line in report.summary_lines():
        if line.startswith("  - "):
            items[-1].append(line[4:])
        else:
            items.append([line[2:]])
    out = ["<ul class=\"summary\">"]
    for head, *subs in items:
        css = ""
        if head.startswith("outputs vs eager:"):
            ok = (report.outputs_vs_eager or {}).get("ok")
            css = {True: " class=\"ok\"", False: " class=\"bad\""}.get(ok, "")
        out.append(f"<li{css}>{e(head)}")
        if subs:
            out.append("<ul>" + "".join(f"<li>{e(sub)}</li>" for sub in subs) + "</ul>")
        out.append("</li>")
    out.append("</ul>")
    return "\n".join(out)


def _graph_folder(dump_dir: Optional[str], index: int, name: str) -> Optional[str]:
    if not dump_dir:
        return None
    return os.path.join(dump_dir, f"graph_{index:03d}_{re.sub(r'[^A-Za-z0-9_]+', '_', name)}")


def _read(folder: str, name: str) -> Optional[str]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()
