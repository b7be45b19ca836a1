"""regions.backward_region: the backward autograd made for a forward region of a joint graph."""
import torch
from functorch.compile import aot_function, make_boxed_func
from torch._functorch.partitioners import default_partition

from npu_fx_fusion.regions import BackwardRegion, backward_nodes_by_seq, backward_region


def _joint(fn, *shapes):
    graphs = []

    def partition(joint, inputs, **kwargs):
        graphs.append(joint)
        return default_partition(joint, inputs, **kwargs)

    aot_function(fn, lambda gm, _: make_boxed_func(gm), partition_fn=partition)(
        *[torch.randn(s, requires_grad=True) for s in shapes])
    return graphs[0].graph


def _node(graph, name):
    return next(n for n in graph.nodes if n.name == name)


def test_a_region_whose_inputs_are_also_read_elsewhere():
    """y = sin(x) * w, with x and w read again after it: the backward is sin's and mul's
    nodes, the sums with the other gradients of x and w stay outside it."""
    def fn(x, w):
        return ((torch.sin(x) * w) + x.exp() + w.cos()).sum()

    graph = _joint(fn, 3, 3)
    x, w = _node(graph, "primals_1"), _node(graph, "primals_2")
    sin, mul = _node(graph, "sin"), _node(graph, "mul")
    region = backward_region([sin, mul], [x, w], mul, backward_nodes_by_seq(graph))
    assert isinstance(region, BackwardRegion), region
    assert set(region.gradients) == {x, w}
    assert all(not n.meta.get("is_gradient_acc") for n in region.nodes)
    # x's gradient from the region is cos(x) * (w * g): computed from sin's backward
    assert region.gradients[x].meta["seq_nr"] == sin.meta["seq_nr"]


def test_an_input_added_unchanged_is_refused():
    """y = x + sin(x): the add passes x's gradient on unchanged, which no backward node of the
    region computes (replacing the region's backward would count it twice)."""
    def fn(x):
        return ((x + torch.sin(x)) * 2).sum()

    graph = _joint(fn, 3)
    x = _node(graph, "primals_1")
    sin, add = _node(graph, "sin"), _node(graph, "add")
    reason = backward_region([sin, add], [x], add, backward_nodes_by_seq(graph))
    assert isinstance(reason, str) and "unchanged" in reason, reason


def test_an_intermediate_read_elsewhere_is_refused():
    """y = sin(x) * w, and sin(x) read again: its gradient sums one from outside the region."""
    def fn(x, w):
        s = torch.sin(x)
        return (s * w + s.exp()).sum()

    graph = _joint(fn, 3, 3)
    x, w = _node(graph, "primals_1"), _node(graph, "primals_2")
    reason = backward_region([_node(graph, "sin"), _node(graph, "mul")], [x, w], _node(graph, "mul"),
                             backward_nodes_by_seq(graph))
    assert isinstance(reason, str) and "gradient" in reason, reason


def test_a_cloned_input_read_again_is_refused():
    """y = clone(x) * sin(x): clone passes the mul's gradient to x unchanged (no node), while
    sin's backward computes the other part: the region's gradient of x is in two places."""
    def fn(x):
        return (x.clone() * torch.sin(x)).sum()

    graph = _joint(fn, 3)
    x = _node(graph, "primals_1")
    region = [n for n in graph.nodes if n.op == "call_function" and not n.meta.get("autograd_backward")
              and n.target in (torch.ops.aten.clone.default, torch.ops.aten.sin.default, torch.ops.aten.mul.Tensor)]
    reason = backward_region(region, [x], region[-1], backward_nodes_by_seq(graph))
    assert isinstance(reason, str) and "gradient" in reason, reason


def test_a_constant_mask_the_backward_reads_and_a_top_ks_integer_output():
    """y = topk(masked_fill(sin(x) * cos(w), mask, -inf)) with the mask built from aranges (read by the rest of the
    graph too): the mask is one of the region's `constants` (its backward reads it, no gradient reaches it,
    it is no input the region's gradient is computed for), and of the top-k's two outputs, which carry the
    same seq_nr, only the values (floating point) own the gradient."""
    def fn(x, w):
        i = torch.arange(4)
        mask = i.unsqueeze(-1) < i  # (4, 4)
        scores = (x.sin() * w.cos()).masked_fill(mask, float("-inf"))
        values, indices = scores.topk(2, dim=-1)
        return values.softmax(-1).sum() + indices.float().sum() + mask.float().sum()

    graph = _joint(fn, (4, 4), (4, 4))
    x, w = _node(graph, "primals_1"), _node(graph, "primals_2")
    sin, cos, mul = _node(graph, "sin"), _node(graph, "cos"), _node(graph, "mul")
    masked, topk = _node(graph, "masked_fill"), _node(graph, "topk")
    values, indices = sorted(u for u in topk.users)
    mask = masked.args[1]
    by_seq = backward_nodes_by_seq(graph)
    nodes = [sin, cos, mul, masked, topk, values, indices]
    without = backward_region(nodes, [x, w], [values, indices], by_seq)
    assert isinstance(without, str) and mask.name in without, without
    region = backward_region(nodes, [x, w], [values, indices], by_seq, [mask])
    assert isinstance(region, BackwardRegion), region
    assert region.output_gradients[1] is None and region.output_gradients[0] is not None
    assert set(region.gradients) == {x, w}


def _in_place_relu_of_a_view(x, w):
    """LiCompute's shape: an einsum's output (a view) relu'd in place, then weighted and summed."""
    s = torch.einsum("bshd,btd->bsht", x, w)
    return (s.relu_() * 2.0).sum(dim=2)


def test_in_place_relu_on_a_view_brings_its_autograd_only_backward_nodes():
    """relu_ on a view rebases its autograd history: its backward nodes carry seq_nrs no forward
    op has. Between the region's first and last seq_nr, reading only its backward and values,
    they are the region's."""
    def fn(x, w):
        return _in_place_relu_of_a_view(x, w).sum()

    graph = _joint(fn, (2, 4, 3, 5), (2, 6, 5))
    x, w = _node(graph, "primals_1"), _node(graph, "primals_2")
    by_seq = backward_nodes_by_seq(graph)
    forward = [n for n in graph.nodes if n.op == "call_function" and not n.meta.get("autograd_backward")]
    summed = [n for n in forward if n.target is torch.ops.aten.sum.dim_IntList]
    region = forward[:forward.index(summed[0]) + 1]
    found = backward_region(region, [x, w], summed[0], by_seq)
    assert isinstance(found, BackwardRegion), found
    assert set(found.gradients) == {x, w}
    own = {n.meta.get("seq_nr") for n in region}
    assert any(n.meta.get("seq_nr") not in own for n in found.nodes)  # the autograd-only ones


def test_autograd_only_nodes_of_other_code_in_the_regions_span_stay_outside():
    """sin(x) * 2 with another relu_ of a view computed between its two ops: those autograd-only
    seq_nrs lie in the region's span, but their nodes read none of its backward or values."""
    def fn(x, v, w):
        a = torch.sin(x)
        other = _in_place_relu_of_a_view(v, w)
        return (a * 2.0).sum() + other.sum()

    graph = _joint(fn, (3,), (2, 4, 3, 5), (2, 6, 5))
    x, sin, mul = _node(graph, "primals_1"), _node(graph, "sin"), _node(graph, "mul_1")
    assert mul.args[0] is sin, mul.format_node()
    found = backward_region([sin, mul], [x], mul, backward_nodes_by_seq(graph))
    assert isinstance(found, BackwardRegion), found
    own = {sin.meta["seq_nr"], mul.meta["seq_nr"]}
    assert all(n.meta.get("seq_nr") in own for n in found.nodes), [(n.name, n.meta.get("seq_nr")) for n in found.nodes]
