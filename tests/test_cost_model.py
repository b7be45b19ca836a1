"""cost_model: launches and a per-SoC roofline of a graph, as torchair would run it."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion import cost_model
from npu_fx_fusion.cost_model import ROOFLINES, estimate, node_works, roofline


def _graph(fn, *args):
    """The functionalized aten graph of fn (in-place writes become an op and a copy_ back
    into the input, as aot_autograd with keep_inference_input_mutations leaves them)."""
    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"))(*args).graph


def test_every_figure_says_where_it_comes_from():
    for soc, rl in ROOFLINES.items():
        assert rl.soc == soc
        for name, figure in rl.figures():
            assert figure.value > 0 and figure.source, (soc, name)
    a2 = ROOFLINES["Ascend910B"]
    assert a2.cube_per_s["half"].value == pytest.approx(24 * 16 ** 3 * 2 * 1.85e9)  # 363.7 TFLOP/s
    assert a2.hbm_bytes_per_s.value == 1.6e12
    assert roofline("Ascend950").soc == cost_model.DEFAULT_SOC  # no figures: the default's


def test_a_matmul_is_cube_work_and_bound_by_the_larger_of_bytes_and_flops():
    a, b = torch.randn(64, 256), torch.randn(256, 512)
    (_, work), = node_works(_graph(torch.matmul, a, b))
    assert work.launches == 1 and work.cube_flops == 2 * 64 * 256 * 512
    assert work.bytes == 4 * (64 * 256 + 256 * 512 + 64 * 512)
    rl = ROOFLINES["Ascend910B"]
    busy = max(work.bytes / rl.hbm_bytes_per_s.value, work.cube_flops / rl.cube_per_s["float"].value)
    assert work.seconds(rl) == pytest.approx(rl.launch_seconds.value + busy)


def write_step(cache, position, update, counter):
    cache.index_copy_(1, position, update)
    counter.add_(1)
    return cache.sum()


def test_a_write_back_into_an_input_is_done_in_place():
    cache, update = torch.zeros(4, 1024, 8), torch.randn(4, 1, 8)
    graph = _graph(write_step, cache, torch.tensor([3]), update, torch.zeros((), dtype=torch.int64))
    copies = [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 2  # the cache's and the counter's write-backs
    works = {n.target: w for n, w in node_works(graph)}
    assert torch.ops.aten.copy_.default not in works  # torchair writes the values in place
    # the cache write moves what it writes, not two copies of the cache
    written = works[torch.ops.aten.index_copy.default].bytes
    assert written < cache.numel() * 4 / 10


def two_masks(x):
    first = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    second = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return x.masked_fill(first[:4, :4], 0) + x.masked_fill(second[:4, :4], 1)


def test_a_constant_spelled_out_twice_is_computed_once():
    graph = _graph(two_masks, torch.randn(4, 4))
    counted = [str(n.target) for n, _ in node_works(graph)]
    assert counted.count("aten.ones.default") == 1 and counted.count("aten.triu.default") == 1
    assert counted.count("aten.masked_fill.Scalar") == 2


def test_estimates_group_by_decoder_layer():
    from npu_fx_fusion.tiny_models import build_hf

    import npu_fx_fusion as nff

    tiny = build_hf("llama", num_layers=2)
    backend = nff.get_npu_backend()
    with torch.no_grad():
        torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
    graph = nff.last_report().graphs[0]
    for soc in ROOFLINES:
        before, after = graph.roofline_before[soc], graph.roofline_after[soc]
        assert {"layers.0", "layers.1", "other"} <= set(after.groups)
        assert after.launches < before.launches and after.seconds < before.seconds
        assert sum(row[0] for row in after.groups.values()) == after.launches
    assert "estimated device time" in nff.last_report().to_markdown()
    assert set(graph.to_dict()["estimated_time"]) == set(ROOFLINES)


def test_estimate_of_an_empty_graph_is_zero():
    empty = torch.fx.Graph()
    empty.output(None)
    result = estimate(empty, "Ascend910_93")
    assert result.launches == 0 and result.seconds == 0 and result.soc == "Ascend910_93"


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def test_the_report_measures_the_graph_as_it_was_before_and_after_the_passes_when_read(monkeypatch):
    import copy

    from torch._logging._internal import trace_log

    import npu_fx_fusion as nff
    from npu_fx_fusion.report import GraphCost

    # pytest's log capture is a handler of torch's structured trace, which would read the
    # whole report in the compile; without TORCH_TRACE it has none
    monkeypatch.setattr(trace_log, "handlers", [])
    gm = make_fx(rms_norm)(torch.randn(4, 64), torch.randn(64))
    before = copy.deepcopy(gm.graph)
    graph = nff.fuse(gm).graphs[0]
    after = copy.deepcopy(gm.graph)
    assert graph._costs is None  # not measured in the compile
    # what the graph compiler does with the graph next changes nothing the report says
    output = next(iter(gm.graph.find_nodes(op="output")))
    with gm.graph.inserting_before(output):
        doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (output.args[0], 2))
        doubled.meta["val"] = output.args[0].meta["val"]
    output.args = (doubled,)
    assert graph.fused_ops == {"npu.npu_rms_norm": 1}
    assert graph.cost_before == GraphCost.of(before) and graph.cost_after == GraphCost.of(after)
    assert graph.cost_after.launches == 1 < graph.cost_before.launches
    for soc in ROOFLINES:
        assert graph.roofline_before[soc].to_dict() == estimate(before, soc).to_dict()
        assert graph.roofline_after[soc].to_dict() == estimate(after, soc).to_dict()
