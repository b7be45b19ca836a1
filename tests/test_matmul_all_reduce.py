"""matmul_all_reduce: RowwiseParallel's matmul and the all-reduce of its partial sums ->
npu_mm_all_reduce_base (patterns/matmul_all_reduce.py).

The graphs are torch.distributed.tensor.parallel's own (parallelize_module on a small MLP,
tests/tp_modules.py), compiled in this process over the fake process group: the collectives
are recorded as a real compile records them, their data is meaningless, so these tests check
what fuses and what does not, and why. Numerics: on 2 gloo ranks the fused graph equals the
unfused one exactly (tests/test_tensor_parallel.py): the reference kernel multiplies and
all-reduces over the same gloo group as the code it replaces.
"""
from __future__ import annotations

import pytest
import torch

import npu_fx_fusion as nff
from helpers import fake_world, near_miss_reasons
from tp_modules import TP_PASSES, capture, feed_forward, ops_in

OP = "npu.npu_mm_all_reduce_base"


def _default_group_name():
    return torch.distributed.distributed_c10d._get_default_group().group_name


def _inference(world, dtype=torch.bfloat16, config=None, dynamic=None, **module):
    """The report and graphs of feed_forward(...) compiled for inference on rank 0 of `world`."""
    with fake_world(world):
        block = feed_forward(dtype=dtype, **module)
        x = torch.randn(2, 8, 256, dtype=dtype)
        return capture(block, x, config=config, dynamic=dynamic)


@pytest.mark.parametrize("world, dtype", [(2, torch.bfloat16), (4, torch.float16)])
def test_rowwise_parallel_fuses(world, dtype):
    with fake_world(world):
        report, graphs = capture(feed_forward(dtype=dtype), torch.randn(2, 8, 256, dtype=dtype))
        group_name = _default_group_name()
    assert report.fused_ops == {OP: 1}
    (fused,) = ops_in(graphs["inference"], OP)
    # the collective and its wait are gone; the op names the group the all-reduce ran on (on
    # the fake backend, as on gloo: its c10d name, which the reference kernel resolves)
    assert not ops_in(graphs["inference"], "_c10d_functional")
    assert fused.args[2] == group_name
    # x2 is the weight's transposed view, as the op takes it; x1 the activations' rows
    assert fused.args[0].meta["val"].dim() == 2 and fused.args[1].meta["val"].shape == (1024 // world, 256)


def test_symbolic_batch_and_sequence_fuse_the_same():
    report, _ = _inference(2, dynamic=True)
    assert report.fused_ops == {OP: 1}


def test_fp32_is_left_alone_naming_the_dtype():
    report, _ = _inference(2, torch.float32)
    assert report.fused_ops == {}
    assert near_miss_reasons(report, "matmul_all_reduce") == [f"{OP} does not support float32"]


def test_three_ranks_are_outside_the_op():
    # the op documents 1, 2, 4 and 8 ranks (hccs all mesh)
    report, _ = _inference(3, hidden=768)
    assert near_miss_reasons(report, "matmul_all_reduce") == [f"the group has 3 ranks: {OP} takes 1, 2, 4, 8"]


def test_atlas_a3_has_no_mm_all_reduce():
    report, _ = _inference(2, config=nff.FusionConfig(enable=TP_PASSES, soc="Ascend910_93"))
    assert near_miss_reasons(report, "matmul_all_reduce") == [f"{OP} is not available on Ascend910_93"]


def test_a_training_step_keeps_its_all_reduce():
    """The op is documented for inference and has no backward: in a training step's forward
    graph the all-reduce stays, a near miss saying so."""
    with fake_world(2):
        block = feed_forward()
        report, graphs = capture(block, torch.randn(2, 8, 256, dtype=torch.bfloat16, requires_grad=True),
                                 training=True)
    assert report.fused_ops == {}
    # the forward's all-reduce, and the backward's (w1's input gradient, all-reduced)
    reasons = near_miss_reasons(report, "matmul_all_reduce")
    assert len(reasons) == 2 and len(set(reasons)) == 1, reasons
    assert reasons[0].startswith(f"{OP} is documented for inference only") and "training graph" in reasons[0]


def test_an_all_reduce_of_no_matmul_says_what_it_reduces():
    """torchtitan's vocabulary-parallel embedding all-reduces its masked lookups, a product."""

    class Partial(torch.nn.Module):
        def forward(self, x):
            y = torch.ops._c10d_functional.all_reduce(x * 2, "sum", group_name)
            return torch.ops._c10d_functional.wait_tensor(y)

    with fake_world(2):
        group_name = _default_group_name()
        report, _ = capture(Partial(), torch.randn(4, 256, dtype=torch.bfloat16))
    (reason,) = near_miss_reasons(report, "matmul_all_reduce")
    assert reason.startswith("the all-reduced tensor is computed by mul (aten.mul.Tensor), not a matmul")


def test_the_residual_add_and_norm_after_it_become_npu_add_rms_norm():
    """The documented chain: torch_npu 2.13 has no op folding the add and the norm into the
    matmul + all-reduce (x3 is added inside the all-reduce), so add_rms_norm takes the fused
    op's output as the residual branch of npu_add_rms_norm."""

    class TwoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = feed_forward(seed=0), feed_forward(seed=1)

        def forward(self, x):
            return self.second(self.first(x))

    with fake_world(2):
        config = nff.FusionConfig(enable=TP_PASSES | {"rms_norm", "add_rms_norm"})
        report, graphs = capture(TwoBlocks(), torch.randn(2, 8, 256, dtype=torch.bfloat16), config=config)
    assert report.fused_ops[OP] == 2 and report.fused_ops["npu.npu_add_rms_norm"] == 1
    (add_norm,) = ops_in(graphs["inference"], "npu.npu_add_rms_norm")

    def source(node):  # through the view back to the fused op's rows
        return source(node.args[0]) if node.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default) else node

    assert any(str(source(arg).target).startswith(OP) for arg in add_norm.args[:2])


@pytest.fixture
def torchair_scope_ops():
    """torchair's scope markers (torchair/scope/_scope.py defines them when it is imported; the
    torchair tests run in subprocesses), for this test only."""
    if hasattr(torch.ops.air, "scope_enter"):
        yield
        return
    lib = torch.library.Library("air", "FRAGMENT")
    lib.define("scope_enter(str[] keys, str[] values, bool need_execute=False) -> None")
    lib.define("scope_exit(bool need_execute=False) -> None")
    lib.impl("scope_enter", lambda keys, values, need_execute=False: None, "CompositeExplicitAutograd")
    lib.impl("scope_exit", lambda need_execute=False: None, "CompositeExplicitAutograd")
    torch.fx.node.has_side_effect(torch.ops.air.scope_enter.default)
    torch.fx.node.has_side_effect(torch.ops.air.scope_exit.default)
    yield
    lib._destroy()
    for name in ("scope_enter", "scope_exit"):  # the namespace caches the packets it handed out
        torch.ops.air.__dict__.pop(name, None)


def test_the_matched_nodes_must_share_a_torchair_scope(torchair_scope_ops):
    """A collective the user put in a scope of its own (torchair's npu_stream_switch: another
    stream) is not fused with a matmul outside it."""

    class OnAStream(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = torch.nn.Parameter(weight)

        def forward(self, x):
            y = x @ self.weight.t()
            torch.ops.air.scope_enter(["_user_stream_label"], ["comm"])
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y, "sum", group_name))
            torch.ops.air.scope_exit()
            return y

    with fake_world(2):
        group_name = _default_group_name()
        module = OnAStream(torch.randn(64, 256, dtype=torch.bfloat16))
        report, _ = capture(module, torch.randn(4, 256, dtype=torch.bfloat16))
    assert report.fused_ops == {}
    (reason,) = near_miss_reasons(report, "matmul_all_reduce")
    assert reason.startswith("its nodes lie in different torchair scopes (no scope; _user_stream_label=comm)"), reason
