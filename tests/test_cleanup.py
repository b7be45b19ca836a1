"""cleanup.views_to_reshapes_where_needed: the layouts a fused op changes, propagated."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion.cleanup import LAYOUT_CHANGED, views_to_reshapes_where_needed

aten = torch.ops.aten


def test_every_view_a_changed_layout_breaks_becomes_a_reshape_not_only_the_first():
    """Two views of one value, of one layout each: the first fails and becomes a reshape, a
    copy whose fake value the fix-up reuses for ops of the same arguments. The second must
    fail and become a reshape too, not take the first one's value as a view (a view that
    fails at run time)."""
    def fn(x):
        y = x.clone()
        return y.view(6, 4) + 1, y.view(6, 4) * 2

    mode = FakeTensorMode()
    with mode:
        gm = make_fx(fn, tracing_mode="fake")(torch.empty(2, 3, 4))
    (clone,) = gm.graph.find_nodes(op="call_function", target=aten.clone.default)
    with mode:  # what a fused op returning another layout leaves: (2, 3, 4) of (3, 2, 4) memory
        clone.meta["val"] = torch.empty(3, 2, 4).transpose(0, 1)
    clone.meta[LAYOUT_CHANGED] = True
    views_to_reshapes_where_needed(gm, [clone])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.args[0] is clone]
    assert targets == [aten.reshape.default, aten.reshape.default], targets
