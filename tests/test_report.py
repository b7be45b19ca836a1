"""report.py: where a fused site is, what a later site folded in, the op table's notes.

The model-level checks of the same (qwen3_moe through the CLI) are in test_cli.py; here
each rule is pinned on graphs built by hand, including the cases it must not touch.
"""
import operator
from collections import Counter

import torch
import torch.fx

from npu_fx_fusion import npu_ops
from npu_fx_fusion.insertion import _inherit_kept_calls, _inherit_source_meta
from npu_fx_fusion.cleanup import drop_lossless_round_trips
import helpers
import npu_fx_fusion as nff
from helpers import RoutedExpertsLoop
from npu_fx_fusion.report import (FusedSite, FusionReport, GraphCost, GraphCosts, GraphReport, NearMiss, PassResult,
                                  SourceLocation, added_conversions, human_bytes, op_table, pass_rows, pass_table,
                                  site_location)

aten = torch.ops.aten


def _trace(line, module="model.layers.0.mlp"):
    return {"stack_trace": f'  File "/src/model.py", line {line}, in forward\n    code_at_{line}()\n',
            "nn_module_stack": {"k": (module, object)}}


def _node(graph, target, args, line=None, dtype=torch.float32, shape=(4,)):
    node = graph.call_function(target, args)
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    if line is not None:
        node.meta.update(_trace(line))
    return node


def test_a_site_is_located_at_its_output_then_its_anchor():
    npu_ops.ensure_registered()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    square = _node(graph, aten.pow.Tensor_Scalar, (x, 2), line=10)
    root = _node(graph, aten.rsqrt.default, (square,), line=11)
    out = _node(graph, aten.mul.Tensor, (x, root), line=12)
    nodes = [square, root, out]
    is_rsqrt = lambda n: n.target is aten.rsqrt.default  # noqa: E731
    assert site_location(nodes, [out], is_rsqrt).line == 12  # what the fused op's output replaces
    assert site_location(nodes, [], is_rsqrt).line == 11  # no output given: the anchor
    assert site_location(nodes).line == 10  # neither: the first with a line
    del out.meta["stack_trace"]
    assert site_location(nodes, [out], is_rsqrt).line == 11  # an output without a line: the anchor
    assert site_location(nodes, [out]).module == "model.layers.0.mlp"


def test_an_earlier_fusions_op_does_not_give_the_location():
    # add_rms_norm matches the residual add and rms_norm's npu_rms_norm, whose line is the
    # norm's (already reported under rms_norm): the site is the add
    npu_ops.ensure_registered()
    graph = torch.fx.Graph()
    x, r, w = graph.placeholder("x"), graph.placeholder("r"), graph.placeholder("w")
    add = _node(graph, aten.add.Tensor, (x, r), line=20)
    norm = _node(graph, torch.ops.npu.npu_rms_norm.default, (add, w), line=30)
    y = _node(graph, operator.getitem, (norm, 0), line=30)
    anchor = lambda n: n.target is torch.ops.npu.npu_rms_norm.default  # noqa: E731
    site = FusedSite.of_match("add_rms_norm", "form", "npu.npu_add_rms_norm", [add, norm, y], [y, add], anchor)
    assert site.location.line == 20
    assert site.replaced == (add.name, norm.name, y.name)
    assert site.consumed == ("npu.npu_rms_norm",)


def test_a_kept_op_keeps_the_line_of_the_call_it_stands_for():
    # moe_dispatch's replacement keeps the two expert GEMMs (grouped_matmul fuses them next):
    # each takes the line of the GEMM it replaces, not the block's output line
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    old = [_node(graph, aten.mm.default, (x, x), line=line) for line in (40, 41)]
    new = [_node(graph, aten.mm.default, (x, x)) for _ in range(2)]
    extra = _node(graph, aten.relu.default, (new[1],))
    combine = _node(graph, aten.sum.default, (extra,), line=99)
    for node in old:
        graph.erase_node(node)
    _inherit_kept_calls([*new, extra, combine], old)  # per site, as accept.py does
    _inherit_source_meta([*new, extra, combine])  # then, for the pass, the rest from their users
    assert [SourceLocation.of(n).line for n in new] == [40, 41]
    assert SourceLocation.of(extra).line == 99  # not a kept op: its user's line
    # as many kept calls as replaced ones, or none is paired (which would be which?)
    graph2 = torch.fx.Graph()
    y = graph2.placeholder("y")
    old2 = [_node(graph2, aten.mm.default, (y, y), line=50)]
    new2 = [_node(graph2, aten.mm.default, (y, y)) for _ in range(2)]
    out = _node(graph2, aten.add.Tensor, tuple(new2), line=77)
    graph2.erase_node(old2[0])
    _inherit_kept_calls([*new2, out], old2)
    _inherit_source_meta([*new2, out])
    assert [SourceLocation.of(n).line for n in new2] == [77, 77]


def _site(pass_name, fused_op, consumed=()):
    return FusedSite(pass_name, "form", fused_op, SourceLocation(), consumed=tuple(consumed))


def test_folded_sites_are_credited_to_the_pass_that_made_the_op():
    graph = GraphReport("inference", nodes_before=0, passes=[
        PassResult("rms_norm", sites=[_site("rms_norm", "npu.npu_rms_norm")] * 3),
        PassResult("add_rms_norm", sites=[_site("add_rms_norm", "npu.npu_add_rms_norm", ["npu.npu_rms_norm"])] * 2),
        # an op the model called itself (no earlier site made it) is nobody's
        PassResult("other", sites=[_site("other", "npu.npu_x", ["npu.npu_rotary_mul"])]),
    ])
    assert graph.folded() == {"rms_norm": Counter(add_rms_norm=2)}
    report = FusionReport()
    report.add(graph)
    assert pass_table(pass_rows(report)[0])[2:] == [
        "| rms_norm | 3 | 0 | 2 folded into add_rms_norm |", "| add_rms_norm | 2 | 0 |  |", "| other | 1 | 0 |  |"]


def test_more_folds_than_sites_are_not_invented():
    graph = GraphReport("inference", nodes_before=0, passes=[
        PassResult("rms_norm", sites=[_site("rms_norm", "npu.npu_rms_norm")]),
        PassResult("add_rms_norm", sites=[_site("add_rms_norm", "npu.npu_add_rms_norm", ["npu.npu_rms_norm"])] * 3),
    ])
    assert graph.folded() == {"rms_norm": Counter(add_rms_norm=1)}


def test_an_op_taken_in_and_emitted_again_is_not_folded():
    # moe_dispatch's form takes the npu_swiglu of the experts in and its replacement emits
    # it again: the final graph still has both, and the counts need no note
    graph = GraphReport("inference", nodes_before=0, ops_after=Counter({"npu.npu_swiglu.default": 2}), passes=[
        PassResult("swiglu", sites=[_site("swiglu", "npu.npu_swiglu")] * 2),
        PassResult("moe_dispatch", sites=[_site("moe_dispatch", "npu.npu_moe_init_routing_v2",
                                                ["npu.npu_swiglu"])] * 2),
    ])
    assert graph.folded() == {}


def _conversion_graph():
    """x (int32) -> int64 -> int32 -> op; c (int64) -> int32 -> int64 -> op; y: the model's own pair."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, dtype=torch.int32, device="meta")
    c = graph.placeholder("c")
    c.meta["val"] = torch.empty(4, dtype=torch.int64, device="meta")
    y = graph.placeholder("y")
    y.meta["val"] = torch.empty(4, dtype=torch.float16, device="meta")
    original = set(graph.nodes)
    model_up = graph.call_function(aten._to_copy.default, (y,), {"dtype": torch.float32})
    model_down = graph.call_function(aten._to_copy.default, (model_up,), {"dtype": torch.float16})
    original |= {model_up, model_down}
    wide = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.int64})
    back = graph.call_function(aten._to_copy.default, (wide,), {"dtype": torch.int32})
    narrow = graph.call_function(aten._to_copy.default, (c,), {"dtype": torch.int32})
    widen = graph.call_function(aten._to_copy.default, (narrow,), {"dtype": torch.int64})
    for node, dtype in ((model_up, torch.float32), (model_down, torch.float16), (wide, torch.int64),
                        (back, torch.int32), (narrow, torch.int32), (widen, torch.int64)):
        node.meta["val"] = torch.empty(4, dtype=dtype, device="meta")
    gather = graph.call_function(aten.index_select.default, (model_down, 0, back))
    take = graph.call_function(aten.take.default, (model_down, widen))
    graph.output((gather, take))
    return graph, original, {"back": back, "widen": widen, "model_down": model_down, "x": x}


def test_round_trips_fusion_added_are_dropped_when_exact():
    graph, original, nodes = _conversion_graph()
    assert drop_lossless_round_trips(graph, original) == 1
    graph.lint()
    gather, take = next(n for n in graph.nodes if n.op == "output").args[0]
    assert gather.args[2] is nodes["x"]  # int32 -> int64 -> int32: the identity, gone
    assert take.args[1] is nodes["widen"]  # int64 -> int32 -> int64 may wrap: kept
    assert gather.args[0] is nodes["model_down"]  # the model's own fp16 -> fp32 -> fp16: kept


def test_added_conversions_describe_chains_and_readers():
    graph, original, _ = _conversion_graph()
    drop_lossless_round_trips(graph, original)
    added = added_conversions(graph, original)
    assert added == Counter({"aten._to_copy: int64 -> int32 -> int64 for aten.take(index)": 1})
    report = GraphReport("inference", nodes_before=0, conversions_added=added,
                         ops_before=Counter({"aten._to_copy.default": 3}),
                         ops_after=Counter({"aten._to_copy.default": 4, "aten.view.default": 2}))
    (row,) = [line for line in op_table(report) if line.startswith("| aten._to_copy")]
    assert "fusion removed 1 (inside fused code) and added 2: int64 -> int32 -> int64 for aten.take(index) (x1)" in row


def test_the_view_to_reshape_step_is_not_a_row():
    report = GraphReport("inference", nodes_before=0,
                         ops_before=Counter({"aten.view.default": 5, "aten.mul.Tensor": 3, "getitem": 1}),
                         ops_after=Counter({"aten.reshape.default": 4, "aten.mul.Tensor": 1, "getitem": 3}))
    lines = op_table(report)
    assert [line for line in lines if line.startswith("| aten.")] == ["| aten.mul.Tensor | 3 | 1 |  |"]
    assert any("aten.view.default 5 -> 0, aten.reshape.default 0 -> 4" in line for line in lines)
    assert any(line.startswith("getitem 1 -> 3") for line in lines)


# ---- what the report shows first ------------------------------------------------------------
def _report_of(*passes, soc=None):
    report = FusionReport()
    report.soc = soc
    report.add(GraphReport("inference", nodes_before=0, passes=list(passes)))
    return report


def test_the_pass_table_shows_only_passes_that_found_something():
    miss = NearMiss("swiglu", "gate and up come from separate projections", SourceLocation())
    report = _report_of(PassResult("kv_cache"), PassResult("rms_norm", sites=[_site("rms_norm", "npu.npu_rms_norm")]),
                        PassResult("swiglu", near_misses=[miss]), PassResult("mhc_pre"),
                        PassResult("rope", error="RuntimeError: boom"), PassResult("moe_gating", skipped="off"))
    rows, quiet = pass_rows(report)
    assert [(r.name, r.fused, r.near_misses) for r in rows] == [("rms_norm", 1, 0), ("swiglu", 0, 1), ("rope", 0, 0)]
    assert "FAILED" in rows[2].note
    assert quiet == ["kv_cache", "mhc_pre"]  # in pipeline order; a skipped pass did not run
    text = report.to_markdown()
    assert "2 more passes ran and found no candidate: kv_cache, mhc_pre." in text
    assert "| kv_cache |" not in text and "**kv_cache**" not in text


def test_sites_an_npu_would_refuse_are_on_the_first_screen():
    refused = FusedSite("attention", "form", "npu.npu_fused_infer_attention_score", SourceLocation(),
                        npu_limits=("npu.npu_fused_infer_attention_score does not support float32",))
    report = _report_of(PassResult("attention", sites=[refused, refused]))
    report.target, report.outputs_vs_eager = "hf-llama-fp32", {"ok": None, "why": "nothing computed"}
    head = report.to_markdown().split("| pass |")[0]
    assert head.startswith("# npu-fx-fusion report: hf-llama-fp32\n")
    assert "SoC limits: none applied" in head and "2 fused sites here would not fuse on an NPU" in head
    assert "  - attention x2: npu.npu_fused_infer_attention_score does not support float32" in head
    assert "outputs vs eager: not compared: nothing computed" in head
    assert "2 would not fuse on an NPU" in pass_rows(report)[0][0].note
    # with a SoC given its limits applied: such a site is a near miss, nothing is listed
    report = _report_of(PassResult("attention"), soc="Ascend910B")
    (line,) = [line for line in report.summary_lines() if "SoC limits" in line]
    assert line.startswith("- SoC limits: Ascend910B's (FusionConfig(soc=...) / --soc)")


def test_of_match_keeps_the_limits_of_the_real_kernel_apart():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = _node(graph, aten.mul.Tensor, (x, x), line=3)
    graph.output(y)
    site = FusedSite.of_match("p", "form", "npu.npu_x", [y], [y],
                              notes=["instead of f: why", "on an NPU: npu.npu_x does not support float32"],
                              emitted=["npu.npu_x", "npu.npu_y"])
    assert site.note == "instead of f: why; on an NPU: npu.npu_x does not support float32"
    assert site.npu_limits == ("npu.npu_x does not support float32",)
    assert site.emitted == ("npu.npu_x", "npu.npu_y")


def test_op_table_rows_are_in_one_order():
    before = Counter({"aten.mul.Tensor": 2, "aten.add.Tensor": 2, "aten.neg.default": 1, "aten.rsqrt.default": 1})
    after = Counter({"npu.npu_rms_norm.default": 1})
    tables = {tuple(op_table(GraphReport("g", nodes_before=0, ops_before=Counter(dict(items)), ops_after=after)))
              for items in (before.items(), reversed(before.items()))}
    assert len(tables) == 1
    rows = [line.split(" | ")[0][2:] for line in tables.pop() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["aten.add.Tensor", "aten.mul.Tensor", "aten.neg.default", "aten.rsqrt.default",
                    "npu.npu_rms_norm.default"]


# ---- the cost estimate ----------------------------------------------------------------------
def test_a_constant_is_built_once_not_moved_per_run():
    # x * mask, mask = triu(ones(64, 64)): the mask is the same at every run
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(64, 64, device="meta")
    ones = _node(graph, aten.ones.default, ([64, 64],), shape=(64, 64))
    mask = _node(graph, aten.triu.default, (ones, 1), shape=(64, 64))
    y = _node(graph, aten.mul.Tensor, (x, mask), shape=(64, 64))
    rand = _node(graph, aten.rand.default, ([64, 64],), shape=(64, 64))  # new numbers at every run
    z = _node(graph, aten.add.Tensor, (y, rand), shape=(64, 64))
    graph.output(z)
    cost = GraphCost.of(graph)
    tensor = 64 * 64 * 4
    assert (cost.launches, cost.bytes_moved) == (3, 2 * tensor + tensor + 3 * tensor)  # mul, rand, add
    assert (cost.constant_launches, cost.constant_bytes) == (2, tensor + 2 * tensor)  # ones, triu
    line = GraphReport("g", nodes_before=0, measure=lambda: GraphCosts(GraphCost(3, 100), cost)).cost_line()
    assert "3 -> 3 kernel launches" in line and "built once, not per run" in line and "0 -> 2 launches" in line


def test_bytes_read_as_people_write_them():
    assert [human_bytes(n) for n in (512, 1750, 1.75e6, 22.2e6, 999.9e6, 5.0e9, 2.5e13)] == [
        "512 B", "1.75 KB", "1.75 MB", "22.2 MB", "1 GB", "5 GB", "25 TB"]


# ---- a compiled graph dynamo reuses (a graph break in every layer) ----------------------------
class _Norm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _BreakingLayer(torch.nn.Module):
    """Two norms with a graph break between them: dynamo compiles the layer's code as two
    graphs and runs them for every layer."""

    def __init__(self, dim):
        super().__init__()
        self.norm1, self.proj, self.norm2 = _Norm(dim), torch.nn.Linear(dim, dim), _Norm(dim)

    def forward(self, x):
        h = self.proj(self.norm1(x))
        torch._dynamo.graph_break()
        return x + self.norm2(h)


class _Stack(torch.nn.Module):
    def __init__(self, dim=16, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(_BreakingLayer(dim) for _ in range(layers))
        self.norm = _Norm(dim)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_a_reused_graph_counts_once_per_run():
    torch._dynamo.reset()
    model, x = _Stack(), torch.randn(2, 8, 16)
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=nff.get_npu_backend())(x)
    torch.testing.assert_close(actual, expected)
    report = nff.last_report()
    # 9 norms run (2 in each of 4 layers, the final one) from 3 compiled graphs
    assert report.counts["rms_norm"] == 3 and report.executed_counts["rms_norm"] == 9
    assert sorted(g.runs for g in report.graphs) == [1, 4, 4]
    text = report.to_markdown()
    assert "| pass | fused sites | executed | near misses | note |" in text
    assert "| rms_norm | 3 | 9 | 0 |  |" in text
    assert "- graphs run so far: " in text and "4 times" in text
    assert report.to_dict()["executed_counts"]["rms_norm"] == 9


def test_code_dynamo_leaves_out_of_the_graphs_is_named():
    torch._dynamo.reset()
    backend = nff.get_npu_backend()
    with torch.no_grad():
        torch.compile(RoutedExpertsLoop(), backend=backend)(torch.randn(6, 8))
    gaps = backend.report.dynamo_gaps
    assert any("aten.nonzero.default" in reason for reason in gaps.breaks), gaps
    assert any(frame.startswith("forward (helpers.py:") for frame in gaps.eager_frames), gaps
    first = RoutedExpertsLoop.forward.__code__.co_firstlineno
    why = gaps.eager_reason(helpers.__file__, first, first + 6)
    assert why and why.startswith("forward (helpers.py:") and "aten.nonzero.default" in why, gaps
    assert gaps.eager_reason(helpers.__file__, first + 1, first + 6) is None  # code after the skipped function's start
    text = backend.report.to_markdown()
    assert "- dynamo left code out of the graphs" in text and "run wholly in eager" in text, text


def test_a_model_in_one_graph_has_no_dynamo_gaps():
    torch._dynamo.reset()
    backend = nff.get_npu_backend()
    with torch.no_grad():
        torch.compile(torch.nn.Linear(8, 8), backend=backend)(torch.randn(2, 8))
    assert not backend.report.dynamo_gaps and "dynamo left code out" not in backend.report.to_markdown()
    assert backend.report.to_dict()["dynamo_gaps"] == {"breaks": (), "eager_frames": (), "eager_code": ()}
