"""report.html in a dump folder, and the layer drawings it shows, in a real browser.

One dump of a one-layer tiny Llama serves every test. The page must be self-contained
(no script, no network), hold the pass table and every near miss with its source line,
and show the decoder layer before and after fusion side by side, fused ops and the
nodes they replaced in the same colour. Debian's chromium renders it headless: the page
must load without a console message and its screenshot must show the drawings' colours.

Needs pydot and Graphviz (the drawings) and chromium: scripts/test.sh installs them and
sets NPU_FX_FUSION_REQUIRE_DRAWING / NPU_FX_FUSION_REQUIRE_BROWSER, so there a missing
one fails instead of skipping.
"""
import contextlib
import html.parser
import io
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch

import npu_fx_fusion as nff
from npu_fx_fusion import drawing, dumps
from npu_fx_fusion.cli import main
from npu_fx_fusion.report import pass_rows
from test_drawing import SVG, colours_of, decode_png, drawn_nodes, fills, legend

BROWSER_ENV = "NPU_FX_FUSION_REQUIRE_BROWSER"
DRAWING_ENV = "NPU_FX_FUSION_REQUIRE_DRAWING"
WINDOW = (1200, 1300)  # the screenshot: the pass table and the two drawings


def _skip_or_fail(env, message):
    if os.environ.get(env, "") not in ("", "0"):
        pytest.fail(f"{message}; {env} is set, so this is an error, not a skip", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """(dump dir, FusionReport) of `report hf:llama --layers 1 --dump-dir DIR`."""
    missing = drawing.drawing_unavailable()
    if missing:
        _skip_or_fail(DRAWING_ENV, f"the layer drawings need pydot and Graphviz: {missing}")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("dump")
    torch._dynamo.reset()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", "hf:llama", "--layers", "1", "--dump-dir", str(folder)]) == 0
    return folder, nff.last_report()


class _Page(html.parser.HTMLParser):
    """The tags, attributes and table rows (as text cells) of an HTML page."""

    def __init__(self):
        super().__init__()
        self.tags, self.rows, self._row, self._cell = [], [], None, None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _page(folder):
    page = _Page()
    page.feed((folder / "report.html").read_text())
    return page


def test_report_html_is_self_contained(dump):
    folder, _ = dump
    page = _page(folder)
    assert not [tag for tag, _ in page.tags if tag in ("script", "link", "img", "iframe", "object")]
    urls = [value for _, attrs in page.tags for key, value in attrs.items() if key in ("src", "href") and value]
    assert urls == [], urls
    assert "http" not in "".join(re.findall(r"url\([^)]*\)", (folder / "report.html").read_text()))


def test_report_html_has_the_pass_table_and_every_near_miss_with_its_line(dump):
    folder, report = dump
    rows = _page(folder).rows
    shown, quiet = pass_rows(report)
    for row in shown:
        assert [row.name, str(row.fused), str(row.near_misses), row.note] in rows
    assert ["rms_norm", "3", "0", "2 folded into add_rms_norm"] in rows
    # the passes that found nothing are one line, not rows of zeros
    assert quiet and not [row for row in rows if row and row[0] in quiet]
    assert f"{len(quiet)} more passes ran and found no candidate: {', '.join(quiet)}." in _text(folder)
    assert report.near_misses
    for miss in report.near_misses:
        where = f"{miss.location.file.rsplit('/', 1)[-1]}:{miss.location.line}"
        assert [miss.pass_name, miss.reason, miss.location.module, where, miss.location.code] in rows


def _text(folder):
    """The page's text, tags dropped and entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", (folder / "report.html").read_text()))


def test_report_html_says_what_was_compiled_and_whether_it_matched(dump):
    folder, report = dump
    page = (folder / "report.html").read_text()
    assert report.target == "hf-llama-fp32"
    assert "<h1>npu-fx-fusion report: hf-llama-fp32</h1>" in page
    text = _text(folder)
    assert f"graphs fused: {report.graph_source}" in text
    assert "SoC limits: none applied" in text and "npu_fused_infer_attention_score does not support float32" in text
    verdict = re.search(r'<li class="ok">(outputs vs eager: [^<]*)', page)
    assert verdict and verdict.group(1).strip().endswith(": OK"), page[:3000]
    # the op table, before and after
    rows = _page(folder).rows
    assert ["op", "before", "after", "note"] in rows
    (graph,) = report.graphs
    assert ["npu.npu_rotary_mul.default", "0", "2", ""] in rows
    assert graph.ops_after["npu.npu_rotary_mul.default"] == 2


def test_report_md_says_what_was_compiled_and_whether_it_matched(dump):
    folder, report = dump
    text = (folder / "report.md").read_text()
    assert text.startswith("# npu-fx-fusion report: hf-llama-fp32\n")
    assert "- outputs vs eager: max abs diff" in text and ": OK" in text


def test_layer_drawings_show_one_layer_before_and_after(dump):
    folder, report = dump
    (graph_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    before, after = (ET.fromstring((graph_folder / name).read_text()) for name in dumps.LAYER_FILES)
    before_nodes, after_nodes = drawn_nodes(before), drawn_nodes(after)
    # one layer of the 200-node graph, views and getitems contracted into edges
    assert 20 < len(after_nodes) < len(before_nodes) < 100
    labels = {g: [t.text for t in g.iter(f"{SVG}text")][0] for g in after_nodes.values()}
    assert not [text for text in labels.values() if text in ("view", "reshape", "getitem", "_unsafe_view")]
    # the same colour for a fused op in the after drawing and for what it replaced before
    titles_before, fills_before = legend(before)
    titles_after, fills_after = legend(after)
    assert titles_before[1:] == titles_after[1:] == [
        "npu_rms_norm", "npu_rotary_mul", "npu_fused_infer_attention_score", "npu_add_rms_norm", "npu_swiglu",
        "near miss (rope_qk): dashed"]
    assert fills_before == fills_after
    npu = {name: g for name, g in after_nodes.items() if labels[g].startswith("npu_")}
    fused = {name: g for name, g in npu.items() if fills(g) & set(drawing.PALETTE)}
    assert sorted(labels[g] for g in fused.values()) == [
        "npu_add_rms_norm", "npu_fused_infer_attention_score", "npu_rms_norm", "npu_rotary_mul", "npu_rotary_mul",
        "npu_swiglu"]  # gate and up merged by merged_projections
    assert npu == fused  # the NPU graph's own FlashAttention became the fused inference attention
    replaced = {name for site in report.sites for name in site.replaced}
    highlighted = {name for name, g in before_nodes.items() if fills(g) & set(drawing.PALETTE)}
    assert highlighted and highlighted <= replaced
    # one colour per label, no two alike
    assert set(drawing.PALETTE[:4]) <= fills_after  # 4 labels, 4 distinct fills


def test_the_near_miss_is_marked_in_the_drawings(dump):
    folder, report = dump
    (graph_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    (miss,) = [m for m in report.near_misses if m.location.module.startswith("lm.model.layers.0")]
    for name in dumps.LAYER_FILES:
        root = ET.fromstring((graph_folder / name).read_text())
        dashed = [n for n, g in drawn_nodes(root).items()
                  if any(shape.get("stroke") == drawing.NEAR_MISS_COLOUR and shape.get("stroke-dasharray")
                         for shape in g)]
        # the nodes on the line of the near miss (rope_qk's: q's rotation, slower fused with k's
        # after the merged q / k / v projection), in the layer drawn
        assert 1 <= len(dashed) <= 3, (name, dashed)
        assert f"near miss ({miss.pass_name}): dashed" in legend(root)[0]


@pytest.fixture(scope="module")
def moe_dump(tmp_path_factory):
    """The layer drawings of `report hf:qwen3_moe --layers 1 --dump-dir DIR`: (before, after) SVG roots."""
    missing = drawing.drawing_unavailable()
    if missing:
        _skip_or_fail(DRAWING_ENV, f"the layer drawings need pydot and Graphviz: {missing}")
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("moe_dump")
    torch._dynamo.reset()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["report", "hf:qwen3_moe", "--layers", "1", "--dump-dir", str(folder)]) == 0
    (graph_folder,) = [p for p in folder.iterdir() if p.is_dir()]
    return tuple(ET.fromstring((graph_folder / name).read_text()) for name in dumps.LAYER_FILES)


def test_each_fused_site_has_one_colour_before_and_after(moe_dump):
    before, after = moe_dump
    (titles_before, _), (titles_after, _) = legend(before), legend(after)
    labels = titles_after[1:]
    assert titles_before[1:] == labels and len(labels) > 6, (titles_before, labels)
    # the two ops of moe_dispatch's site are one site: one label, one colour
    assert "npu_moe_finalize_routing + npu_moe_init_routing_v2" in labels
    # every colour a fused op has after fusion is the colour of nodes it replaced before
    colour_of = {}
    for root in (before, after):
        for g in drawn_nodes(root).values():
            texts = [t.text for t in g.iter(f"{SVG}text")]
            filled = fills(g) - {"none", drawing.IO_FILL}
            if filled and texts[0].startswith(("[npu_", "npu_")):
                colour_of.setdefault(root is before, set()).update(filled)
    assert colour_of[False] == colour_of[True] and len(colour_of[True]) == len(labels)


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    _skip_or_fail(BROWSER_ENV, "the browser check needs chromium: apt-get install chromium")


def test_report_html_renders_in_a_browser_without_errors(dump, tmp_path):
    folder, _ = dump
    browser = _chromium()
    screenshot = tmp_path / "report.png"
    # a throwaway profile; --enable-logging=stderr prints every console message as INFO:CONSOLE
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
         "--enable-logging=stderr", "--v=0", f"--screenshot={screenshot}", (folder / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and screenshot.is_file(), proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    width, height, pixels, channels = decode_png(screenshot.read_bytes())
    assert (width, height) == WINDOW
    seen = colours_of(pixels, channels)
    # the drawings are on screen: each of their highlight colours is among the pixels
    assert {bytes.fromhex(c[1:]) for c in drawing.PALETTE[:4]} <= seen
