"""drawing.graph_svg: an SVG of the fused graph, fused nodes filled per label, a legend.

The drawings need pydot and Graphviz's `dot`; the render check also needs rsvg-convert
(Debian librsvg2-bin). scripts/test.sh installs all three and sets
NPU_FX_FUSION_REQUIRE_DRAWING, so there a missing one fails instead of skipping.

Rendering is checked on the SVG itself, not on the DOT source: rsvg-convert (librsvg, a
real SVG renderer) turns the SVG into a PNG, which is decoded here, and the fused node's
fill colour must be among its pixels.
"""
import logging
import os
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

import pytest
import torch

import npu_fx_fusion as nff
from npu_fx_fusion import drawing
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.tiny_models import build_hf

REQUIRE_ENV = "NPU_FX_FUSION_REQUIRE_DRAWING"
SVG = "{http://www.w3.org/2000/svg}"
# The 2-layer tiny Llama's inference graph (200 nodes, 229 edges) draws to about 160 KB;
# torch's FxGraphDrawer makes 525 KB of it.
LLAMA_SVG_BOUND = 250_000


def _skip_or_fail(message):
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{message}; {REQUIRE_ENV} is set, so this is an error, not a skip", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def can_draw():
    missing = drawing.drawing_unavailable()
    if missing:
        _skip_or_fail(f"graph drawings need pydot and Graphviz: {missing}")


class HFLlamaNorm(torch.nn.Module):  # transformers LlamaRMSNorm
    def __init__(self, dim=64, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class NoNorm(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 + 1


class CapturingBackend(EmulationBackend):
    """EmulationBackend that keeps each GraphModule after the fusion passes ran on it."""

    def __init__(self, config=None):
        super().__init__(config)
        self.graphs = []

    def _compile(self, phase, gm, example_inputs):
        compiled = super()._compile(phase, gm, example_inputs)
        self.graphs.append(gm)
        return compiled


def fused_graph(module, *inputs):
    backend = CapturingBackend(nff.FusionConfig())
    with torch.no_grad():
        torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    assert len(backend.graphs) == 1
    return backend.graphs[0]


def parse(svg):
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return root


def drawn_nodes(root):
    """{FX node name: its <g class="node">}, with a check that no name is drawn twice."""
    groups = [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
    names = [g.find(f"{SVG}title").text for g in groups]
    assert len(names) == len(set(names))
    return dict(zip(names, groups))


def drawn_edges(root):
    """The titles of the <g class="edge">: "source->user"."""
    return [g.find(f"{SVG}title").text for g in root.iter(f"{SVG}g") if g.get("class") == "edge"]


def texts(element):
    return [t.text for t in element.iter(f"{SVG}text")]


def fills(element):
    return {shape.get("fill") for shape in element if shape.tag in (f"{SVG}polygon", f"{SVG}path")}


def legend(root):
    """(texts, fills) drawn in the graph's label: the title and the legend's cells."""
    graph = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "graph")
    return [t.text for t in graph.findall(f"{SVG}text")], fills(graph)


@pytest.fixture
def norm_graph():
    return fused_graph(HFLlamaNorm(), torch.randn(2, 8, 64))


def test_fused_nodes_finds_the_fused_op(norm_graph):
    found = drawing.fused_nodes(norm_graph)
    assert list(found.values()) == ["npu_rms_norm"]
    (node,) = found
    assert str(node.target).startswith("npu.npu_rms_norm")


def test_svg_has_every_node_and_highlights_the_fused_one(can_draw, norm_graph):
    (node,) = drawing.fused_nodes(norm_graph)
    svg = drawing.graph_svg(norm_graph, {node: "rms_norm"}, "graph_000 inference")
    root = parse(svg)
    drawn = drawn_nodes(root)
    assert set(drawn) == {n.name for n in norm_graph.graph.nodes}
    assert len(drawn_edges(root)) == sum(len(n.users) for n in norm_graph.graph.nodes)

    colour = drawing.PALETTE[0]
    fused = drawn[node.name]
    assert colour in fills(fused)
    assert "[rms_norm]" in texts(fused) and "npu_rms_norm" in texts(fused)
    # the fused op's outputs: (y, rstd) of x's shape and x's shape with the last dim 1
    assert "2x8x64 f32, 2x8x1 f32" in texts(fused)
    others = [g for name, g in drawn.items() if name != node.name]
    assert not any(colour in fills(g) for g in others)

    legend_texts, legend_fills = legend(root)
    assert legend_texts == ["graph_000 inference", "rms_norm"]
    assert colour in legend_fills


def test_one_colour_per_label(can_draw, norm_graph):
    nodes = [n for n in norm_graph.graph.nodes if n.op == "call_function"]
    highlight = {nodes[0]: "pass_b", nodes[-1]: "pass_a"}
    root = parse(drawing.graph_svg(norm_graph, highlight, "two passes"))
    drawn = drawn_nodes(root)
    assert drawing.PALETTE[0] in fills(drawn[nodes[0].name])
    assert drawing.PALETTE[1] in fills(drawn[nodes[-1].name])
    assert legend(root)[0] == ["two passes", "pass_b", "pass_a"]  # graph order


def test_graph_without_fused_nodes_has_no_highlight(can_draw):
    gm = fused_graph(NoNorm(), torch.randn(4, 8))
    assert drawing.fused_nodes(gm) == {}
    root = parse(drawing.graph_svg(gm, drawing.fused_nodes(gm), "plain <graph> & co"))
    drawn = drawn_nodes(root)
    assert set(drawn) == {n.name for n in gm.graph.nodes}
    used = set().union(*(fills(g) for g in drawn.values()))
    assert not used & set(drawing.PALETTE)
    assert legend(root)[0] == ["plain <graph> & co"]  # the title only, escaped and read back


def test_node_names_that_are_dot_keywords(can_draw):
    # pydot writes a node called `node` or `graph` unquoted: a DOT default statement
    graph = torch.fx.Graph()
    node = graph.placeholder("node")
    edge = graph.call_function(torch.relu, (node,))
    edge.name = "edge"
    graph.output(edge)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    root = parse(drawing.graph_svg(gm, {edge: "x"}, "keywords"))
    assert set(drawn_nodes(root)) == {"node", "edge", "output"}


def test_many_returned_values_draw_no_edges_into_the_output(can_draw):
    # dot would route each into the output through every rank in between (minutes for a
    # 700-node training forward): the output box counts them, they get a double border
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    values = [x]
    for _ in range(drawing.MAX_OUTPUT_EDGES + 2):
        values.append(graph.call_function(torch.relu, (values[-1],)))
    graph.output(tuple(values[1:]))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    root = parse(drawing.graph_svg(gm, {}, "many outputs"))
    drawn = drawn_nodes(root)
    assert set(drawn) == {n.name for n in graph.nodes}
    assert not [e for e in drawn_edges(root) if e.endswith("output")]
    assert len(drawn_edges(root)) == len(values) - 1  # the relu chain
    n = drawing.MAX_OUTPUT_EDGES + 2
    assert f"{n} values, double-bordered" in texts(drawn["output"])
    borders = [len(g.findall(f"{SVG}polygon")) for name, g in drawn.items() if name not in ("x", "output")]
    assert borders == [2] * n


def test_a_slow_layout_is_skipped(can_draw, norm_graph, caplog):
    caplog.set_level(logging.WARNING, logger="npu_fx_fusion.drawing")
    assert drawing.graph_svg(norm_graph, {}, "slow", timeout=1e-6) is None
    assert "Graphviz took over" in caplog.text


def test_two_layer_llama_svg_stays_small(can_draw, tmp_path):
    # the pipeline's own drawing: only what the passes added is filled (on the NPU graph
    # SDPA calls torch_npu's npu_fusion_attention_v3 before any pass runs)
    tiny = build_hf("llama")
    backend = CapturingBackend(nff.FusionConfig(dump_dir=str(tmp_path)))
    with torch.no_grad():
        torch.compile(tiny.model, backend=backend, fullgraph=True)(*tiny.example_inputs)
    (gm,) = backend.graphs
    fused = {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_swiglu"}
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    svg = (folder / "after.svg").read_text()
    root = parse(svg)
    assert len(drawn_nodes(root)) == len(gm.graph.nodes)
    size = len(svg.encode())
    assert size < LLAMA_SVG_BOUND, f"{size} bytes of SVG for {len(gm.graph.nodes)} nodes"
    assert sorted(legend(root)[0][1:]) == sorted(fused)


def test_nodes_the_graph_had_before_fusion_are_not_filled(norm_graph):
    (node,) = drawing.fused_nodes(norm_graph)
    assert drawing.fused_nodes(norm_graph, original={node}) == {}


def test_svg_renders(can_draw, norm_graph, tmp_path):
    rsvg = shutil.which("rsvg-convert")
    if rsvg is None:
        _skip_or_fail("the render check needs rsvg-convert: apt-get install librsvg2-bin")
    svg_path, png_path = tmp_path / "g.svg", tmp_path / "g.png"
    svg_path.write_text(drawing.graph_svg(norm_graph, drawing.fused_nodes(norm_graph), "render"))
    subprocess.run([rsvg, "-f", "png", "-o", str(png_path), str(svg_path)], check=True, timeout=60)
    width, height, pixels, channels = decode_png(png_path.read_bytes())
    assert width > 100 and height > 100
    colour = bytes.fromhex(drawing.PALETTE[0][1:])
    assert colour in colours_of(pixels, channels), "no pixel of the highlight colour"


def test_missing_tools_log_once(monkeypatch, caplog, norm_graph):
    monkeypatch.setattr(drawing.shutil, "which", lambda name: None)
    monkeypatch.setattr(drawing, "_missing_logged", False)
    caplog.set_level(logging.INFO, logger="npu_fx_fusion.drawing")
    assert drawing.graph_svg(norm_graph, {}, "a") is None
    assert drawing.graph_svg(norm_graph, {}, "b") is None
    messages = [r.getMessage() for r in caplog.records if r.name == "npu_fx_fusion.drawing"]
    assert len(messages) == 1 and "dot" in messages[0]


def colours_of(pixels, channels):
    """The set of RGB colours among decoded pixels."""
    return {pixels[i:i + 3] for i in range(0, len(pixels), channels)}


def decode_png(data):
    """(width, height, pixel bytes, channels) of an 8-bit RGB or RGBA non-interlaced PNG
    (what rsvg-convert and chromium write)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 4 if colour_type == 6 else 3
    raw, stride = zlib.decompress(idat), width * bpp
    out, prev = bytearray(), bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        out += line
        prev = line
    return width, height, bytes(out), bpp


def test_dump_dir_writes_the_drawing_next_to_the_graph_code(can_draw, tmp_path):
    backend = EmulationBackend(nff.FusionConfig(dump_dir=str(tmp_path)))
    with torch.no_grad():
        torch.compile(HFLlamaNorm(), backend=backend)(torch.randn(2, 5, 64))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in folder.iterdir()) == ["after.py", "after.svg", "before.py"]
    root = parse((folder / "after.svg").read_text())
    texts, _ = legend(root)
    assert "npu_rms_norm" in texts, texts


def test_more_labels_than_the_palette_get_distinct_colours(can_draw):
    def chain(x):
        for step in range(12):
            x = x + step
        return x

    gm = torch.fx.symbolic_trace(chain)
    adds = [n for n in gm.graph.nodes if n.op == "call_function"]
    highlight = {node: f"op_{index}" for index, node in enumerate(adds)}
    root = parse(drawing.graph_svg(gm, highlight, "twelve ops"))
    drawn = drawn_nodes(root)
    colours = [next(iter(fills(drawn[node.name]) - {"none"})) for node in adds]
    assert len(set(colours)) == 12  # PALETTE has 8: no colour repeats after it
    titles, legend_fills = legend(root)
    assert titles[1:] == [f"op_{index}" for index in range(12)] and set(colours) <= legend_fills
    # light enough for black text: every channel above a third of full
    assert all(min(int(c[i:i + 2], 16) for i in (1, 3, 5)) > 85 for c in colours), colours
