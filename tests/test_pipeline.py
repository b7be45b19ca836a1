"""Pipeline guarantees: error isolation, lint, idempotence, dumps, fuse() on plain graphs."""
import logging
import os

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fx_fusion as nff
from npu_fx_fusion import pipeline
from npu_fx_fusion.report import PassResult
from test_rms_norm import HFLlama


def _graph(module=None, dtype=torch.float32):
    module = module or HFLlama()
    x = torch.randn(2, 5, 64, dtype=dtype)
    return make_fx(module)(x), module, x


def _ExplodingPass():
    """rms_norm, with a check that mutates the graph, then raises: the pipeline must
    restore the graph."""
    from npu_fx_fusion.matching import FusionPass

    real = pipeline.load_pass("rms_norm")

    def check(site):
        for node in site.nodes[0].graph.nodes:
            if node.op == "call_function":
                node.target = torch.ops.aten.sub.Tensor  # vandalise
        raise RuntimeError("boom")

    return FusionPass(name="rms_norm", fused_op=real.fused_op, forms=real.forms, example=real.example,
                      check=check, anchor=real.anchor, explain=real.explain)


def test_a_failing_pass_is_reverted_and_reported(monkeypatch, caplog):
    gm, module, x = _graph()
    before = gm.code
    exploding = _ExplodingPass()
    monkeypatch.setattr(pipeline, "load_pass", lambda name: exploding if name == "rms_norm" else None)
    with caplog.at_level(logging.WARNING, logger="npu_fx_fusion"):
        report = nff.fuse(gm, config=nff.FusionConfig(enable={"rms_norm"}))
    assert gm.code == before
    torch.testing.assert_close(gm(x), module(x))
    assert report.errors == [("rms_norm", "RuntimeError: boom")]
    assert "pass rms_norm failed and was reverted" in caplog.text


def test_a_finish_that_leaves_a_node_after_its_readers_is_reverted_alone(monkeypatch):
    """After each pass or finish that changed the graph, the graph is checked for what one
    can break: each node reads nodes defined before it. The one that broke it is reverted,
    not the fusions before it (here a finish moving the fused norm after its readers)."""
    import copy

    gm, module, x = _graph()

    def misplace(graph, options):
        norm = next(n for n in graph.nodes if n.target is torch.ops.npu.npu_rms_norm.default)
        next(iter(graph.find_nodes(op="output"))).prepend(norm)
        return ["moved"]

    broken = copy.copy(pipeline.load_pass("rms_norm"))
    broken.finish = misplace
    monkeypatch.setattr(pipeline, "load_pass", lambda name: broken if name == "rms_norm" else None)
    report = nff.fuse(gm, config=nff.FusionConfig(enable={"rms_norm"}))
    assert report.fused_ops == {"npu.npu_rms_norm": 1}
    (result,) = report.graphs[0].passes
    assert len(result.finished) == 1 and "reads npu_rms_norm" in result.finished[0], result.finished
    assert result.finished[0].startswith("its finish raised and was reverted: RuntimeError: ")
    torch.testing.assert_close(gm(x), module(x))


def test_a_failure_after_the_passes_restores_the_graph_as_given(monkeypatch):
    """The cleanup after the passes failing puts back the graph the pipeline was given (its
    canonical spelling included), and turns the fused sites into near misses naming it."""
    gm, module, x = _graph()
    before = gm.code

    def fail(graph, *args):
        raise RuntimeError("cleanup broke")

    monkeypatch.setattr(pipeline, "copies_for_contiguous_inputs", fail)
    report = nff.fuse(gm, config=nff.FusionConfig(enable={"rms_norm"}))
    assert gm.code == before and report.fused_ops == {}
    assert report.errors == [("cleanup after the passes", "RuntimeError: cleanup broke")]
    (result, _) = report.graphs[0].passes
    assert [m.reason for m in result.near_misses] == [
        "fused, then reverted with the cleanup after the passes: RuntimeError: cleanup broke"]
    torch.testing.assert_close(gm(x), module(x))


def test_a_failure_is_one_warning_line_and_its_full_text_goes_to_the_dump_dir(monkeypatch, caplog, tmp_path):
    gm, _, _ = _graph()
    exploding = _ExplodingPass()
    graph_text = "\n".join(f"    node_{i} = torch.ops.aten.mul.Tensor(x, y)" for i in range(300))

    def check(site):
        raise RuntimeError(f"Argument 'add_1' was used before it has been defined\n{graph_text}")

    exploding.check = check
    monkeypatch.setattr(pipeline, "load_pass", lambda name: exploding if name == "rms_norm" else None)
    with caplog.at_level(logging.WARNING, logger="npu_fx_fusion"):
        report = nff.fuse(gm, config=nff.FusionConfig(enable={"rms_norm"}, dump_dir=str(tmp_path)))
    (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
    message = record.getMessage()
    assert "\n" not in message and "node_299" not in message
    assert "RuntimeError: Argument 'add_1' was used before it has been defined" in message
    path = tmp_path / "error_pass_rms_norm.txt"
    assert str(path) in message and "node_299" in path.read_text()
    assert report.errors == [("rms_norm", "RuntimeError: Argument 'add_1' was used before it has been defined")]


def test_strict_mode_reraises(monkeypatch):
    gm, _, _ = _graph()
    exploding = _ExplodingPass()
    monkeypatch.setattr(pipeline, "load_pass", lambda name: exploding)
    with pytest.raises(RuntimeError, match="boom"):
        nff.fuse(gm, config=nff.FusionConfig(enable={"rms_norm"}, strict=True))


def test_running_twice_changes_nothing_the_second_time():
    gm, module, x = _graph(dtype=torch.bfloat16)
    module = module.bfloat16()
    gm = make_fx(module)(x)
    first = nff.fuse(gm)
    code = gm.code
    second = nff.fuse(gm)
    assert first.counts["rms_norm"] == 1
    assert second.counts["rms_norm"] == 0 and second.near_misses == []
    assert gm.code == code


def test_fuse_needs_metadata_or_example_inputs():
    module = HFLlama()
    x = torch.randn(2, 5, 64)
    aten_gm = make_fx(module)(x)
    for node in aten_gm.graph.nodes:
        node.meta.pop("val", None)
    with pytest.raises(ValueError, match="example_inputs"):
        nff.fuse(aten_gm)
    report = nff.fuse(aten_gm, example_inputs=[x])
    assert report.counts["rms_norm"] == 1
    torch.testing.assert_close(aten_gm(x), module(x))


def test_disabled_everything_leaves_the_graph_alone(monkeypatch):
    gm, _, _ = _graph()
    code = gm.code
    monkeypatch.setenv("NPU_FX_FUSION", "0")
    report = nff.fuse(gm)
    assert gm.code == code and report.counts == {}


def test_dump_dir_has_before_after_and_report(tmp_path):
    gm, _, _ = _graph()
    nff.fuse(gm, config=nff.FusionConfig(dump_dir=tmp_path))
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    before, after = (folder / "before.py").read_text(), (folder / "after.py").read_text()
    assert "aten.rsqrt" in before and "npu.npu_rms_norm" not in before
    assert "npu.npu_rms_norm" in after and "aten.rsqrt" not in after
    assert "rms_norm" in (tmp_path / "report.md").read_text()
    assert '"rms_norm": 1' in (tmp_path / "report.json").read_text()


def test_report_renders_sites_near_misses_and_op_counts():
    gm, _, _ = _graph()
    report = nff.fuse(gm)
    text = report.to_markdown()
    assert "| rms_norm | 1 |" in text and "npu.npu_rms_norm.default | 0 | 1" in text
    data = report.to_dict()
    assert data["counts"]["rms_norm"] == 1
    assert data["graphs"][0]["ops_after"]["npu.npu_rms_norm.default"] == 1
    assert nff.last_report() is report


def test_repeated_conversions_that_fusion_adds_are_merged_and_the_models_own_stay():
    from npu_fx_fusion.cleanup import merge_repeated_pure_calls

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    cast = torch.ops.aten._to_copy.default
    model_a = graph.call_function(cast, (x,), {"dtype": torch.int32})
    model_b = graph.call_function(cast, (x,), {"dtype": torch.int32})  # the model's own repeat
    original = set(graph.nodes)
    new = graph.call_function(cast, (x,), {"dtype": torch.int32})  # a replacement's repeat
    other = graph.call_function(cast, (x,), {"dtype": torch.int64})  # another conversion
    graph.output((model_a, model_b, new, other))
    assert merge_repeated_pure_calls(graph, original) == 1
    (output,) = [n for n in graph.nodes if n.op == "output"]
    assert output.args[0] == (model_a, model_b, model_a, other)


def test_the_models_repeated_views_merge_so_that_what_fusion_built_on_them_merges_too():
    """Each layer slices its own view of the shared rope table; each layer's replacement
    concatenates its view twice. Once the views are one, the tables are one."""
    from npu_fx_fusion.cleanup import merge_repeated_pure_calls

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    cos = graph.placeholder("cos")
    layer_views = [graph.call_function(aten.slice.Tensor, (cos, -1, 0, 8)) for _ in range(2)]
    model_products = [graph.call_function(aten.mul.Tensor, (cos, 2.0)) for _ in range(2)]  # the model's
    original = set(graph.nodes)
    tables = [graph.call_function(aten.cat.default, ([view, view], -1)) for view in layer_views]
    graph.output((*tables, *model_products))
    assert merge_repeated_pure_calls(graph, original) == 2  # the second view, then its table
    (output,) = [n for n in graph.nodes if n.op == "output"]
    assert output.args[0][0] is output.args[0][1] is tables[0]
    assert output.args[0][2] is not output.args[0][3]  # the model's own computations stay


def test_values_written_in_place_and_uninitialised_buffers_are_never_merged():
    from npu_fx_fusion.cleanup import merge_repeated_pure_calls

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, cache = graph.placeholder("x"), graph.placeholder("cache")
    original = set(graph.nodes)
    reads = [graph.call_function(aten.mul.Tensor, (cache, 2.0)) for _ in range(2)]  # cache is written below
    buffers = [graph.call_function(aten.new_empty.default, (x, [4])) for _ in range(2)]
    graph.call_function(aten.copy_.default, (cache, x))
    graph.output((*reads, *buffers))
    assert merge_repeated_pure_calls(graph, original) == 0


def _functional_graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(torch.func.functionalize(fn))(*args)
    gm.graph.eliminate_dead_code()  # as the pipeline does before canonicalising
    return gm


def _deepseek_key(k_nope, k_rot):
    """transformers' DeepSeek-V3 key: a new buffer, its two slices written with copy_."""
    key = k_nope.new_empty(*k_nope.shape[:-1], 24)
    key[..., :16].copy_(k_nope)
    key[..., 16:].copy_(k_rot.expand(-1, 4, -1, -1))
    return key


def _written_in_reverse_order_in_another_dtype(a, b):
    out = a.new_zeros(2, 6, dtype=torch.float64)
    out[:, 4:].copy_(b)
    out[:, :4].copy_(a)
    return out


@pytest.mark.parametrize("fn, args", [
    (_deepseek_key, (torch.randn(2, 4, 5, 16), torch.randn(2, 1, 5, 8))),
    (_written_in_reverse_order_in_another_dtype, (torch.randn(2, 4), torch.randn(1, 2))),
], ids=["deepseek key", "reverse order, cast, broadcast"])
def test_a_buffer_written_slice_by_slice_is_the_cat_of_the_slices(fn, args):
    from npu_fx_fusion.canonical import canonicalize

    gm = _functional_graph(fn, *args)
    canonicalize(gm.graph)
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cat.default in targets
    assert not targets & {torch.ops.aten.slice_scatter.default, torch.ops.aten.copy.default}
    assert torch.equal(gm(*args), fn(*args))


def _gap_left_unwritten(a):
    out = a.new_zeros(2, 6)
    out[:, :4].copy_(a)  # columns 4 and 5 keep the buffer's zeros
    return out


def _half_written_buffer_read(a, b):
    out = a.new_empty(2, 6)
    out[:, :4].copy_(a)
    total = out[:, :4].sum()  # read between the writes
    out[:, 4:].copy_(b)
    return out, total


@pytest.mark.parametrize("fn, args", [
    (_gap_left_unwritten, (torch.randn(2, 4),)),
    (_half_written_buffer_read, (torch.randn(2, 4), torch.randn(2, 2))),
], ids=["a gap", "read half written"])
def test_a_buffer_the_writes_do_not_cover_or_that_is_read_between_them_stays(fn, args):
    from npu_fx_fusion.canonical import canonicalize

    gm = _functional_graph(fn, *args)
    canonicalize(gm.graph)
    assert torch.ops.aten.cat.default not in {n.target for n in gm.graph.nodes}


def test_a_view_as_complex_whose_input_a_fusion_transposed_reads_a_contiguous_copy(caplog):
    """A fused op may return another layout than the aten ops it replaced (torch_npu's
    backward ops return contiguous grads where aten kept a transposed one). A view downstream
    becomes a reshape; a view_as_complex, which needs a last stride of 1 (autograd's backward
    of view_as_real is view_as_complex(grad.contiguous()), the trace drops the .contiguous()),
    reads a contiguous copy. DeepSeek-V4's training step crashed there with only rms_norm on."""
    from npu_fx_fusion.cleanup import LAYOUT_CHANGED, views_to_reshapes_where_needed

    def f(x):  # x: [3, 2, 4]; the pairs of view_as_complex are along dim 1
        pairs = x.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        return torch.view_as_complex(pairs * 2)

    x = torch.randn(3, 2, 4)
    gm = make_fx(f, tracing_mode="fake")(x)
    clone = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default)
    # the "fusion": the same values in the transposed layout (last stride 4)
    with gm.graph.inserting_before(clone):
        fused = gm.graph.call_function(torch.ops.aten.transpose.int, (clone.args[0].args[0], 1, 2))
    fake = clone.meta["val"]
    with fake.fake_mode:
        fused.meta["val"] = torch.empty(3, 2, 4).transpose(1, 2)
    fused.meta[LAYOUT_CHANGED] = True
    clone.replace_all_uses_with(fused)
    gm.graph.erase_node(clone)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    with pytest.raises(RuntimeError, match="stride"):
        gm(x)
    caplog.set_level(logging.ERROR)
    views_to_reshapes_where_needed(gm, [fused])
    assert torch.equal(gm(x), f(x))
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert [[user.target for user in copy.users] for copy in copies] == [[torch.ops.aten.view_as_complex.default]]
    # the copy is put in front before the view is tried: no failing meta for torch to log as an error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
