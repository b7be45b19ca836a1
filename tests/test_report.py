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
from npu_fx_fusion.report import (FusedSite, GraphReport, PassResult, SourceLocation, added_conversions,
                                  op_table, pass_table, site_location)

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
    assert pass_table({"rms_norm": 3, "add_rms_norm": 2}, {"rms_norm": {"add_rms_norm": 2}})[2:] == [
        "| rms_norm | 3 | 2 folded into add_rms_norm |", "| add_rms_norm | 2 |  |"]


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
