"""matmul_reduce_scatter: a row-parallel matmul and the reduce-scatter of its partial sums ->
npu_mm_reduce_scatter_base (patterns/matmul_reduce_scatter.py).

The graphs are torch.distributed.tensor.parallel's own (RowwiseParallel with Shard(1) output
on a small MLP, tests/tp_modules.py), compiled in this process over the fake process group:
the collectives are recorded as a real compile records them, their data is meaningless. These
tests check what fuses and what does not, and why; on 2 gloo ranks the fused graph equals the
unfused one exactly, forward and backward (tests/test_tensor_parallel.py).
"""
from __future__ import annotations

import pytest
import torch

import npu_fx_fusion as nff
from helpers import fake_world, near_miss_reasons
from tp_modules import TP_PASSES, Gathered, capture, default_group_name, feed_forward, ops_in

OP = "npu.npu_mm_reduce_scatter_base"


def _sequence_parallel(world, batch=1, dtype=torch.bfloat16, config=None, training=False, **module):
    with fake_world(world):
        block = feed_forward(sequence_parallel=True, dtype=dtype, **module)
        x = torch.randn(batch, 16 // world, 256, dtype=dtype, requires_grad=training)
        return capture(block, x, config=config, training=training)


def _site_forms(report):
    return [site.form for site in report.sites if site.pass_name == "matmul_reduce_scatter"]


@pytest.mark.parametrize("world, batch", [(2, 1), (4, 1), (2, 2)], ids=["2-ranks", "4-ranks", "batch-2"])
def test_the_reduce_scatter_after_a_rowwise_linear_fuses(world, batch):
    report, graphs = _sequence_parallel(world, batch)
    assert _site_forms(report) == ["matmul_then_reduce_scatter_sequence"]
    (fused,) = ops_in(graphs["inference"], OP)
    assert not ops_in(graphs["inference"], "_c10d_functional.reduce_scatter_tensor")
    assert fused.args[3] == world and fused.kwargs == {"comm_mode": "aiv"}
    # the rows reach the op sequence-major: for one sequence that is a view, no copy
    copies = [n for n in graphs["inference"].graph.nodes if n.target is torch.ops.aten.clone.default]
    assert (len(copies) > 0) == (batch > 1)


def test_flat_rows_scattered_on_dim_0_fuse():
    with fake_world(2):
        module = Gathered(torch.randn(64, 512, dtype=torch.bfloat16), default_group_name(), 2, "scatter")
        report, _ = capture(module, torch.randn(8, 512, dtype=torch.bfloat16))
    assert _site_forms(report) == ["matmul_then_reduce_scatter"]


def test_a_training_step_fuses_the_forward_and_the_backward():
    """Forward: w2 and its reduce-scatter. Backward: w1's input gradient (aten.matmul_backward in
    an NPU graph), reduce-scattered over the sequence; its weight gradient a plain matmul."""
    report, graphs = _sequence_parallel(2, training=True)
    assert _site_forms(report) == ["matmul_then_reduce_scatter_sequence",
                                   "matmul_backward_then_reduce_scatter_sequence"]
    assert [n.kwargs for n in ops_in(graphs["forward"], OP)] == [{}]
    assert [n.kwargs for n in ops_in(graphs["backward"], OP)] == [{}]


def test_swiglus_summed_input_gradients_are_a_near_miss():
    """w1 and w3 read one input: its gradient is the sum of their input gradients, which the
    backward reduce-scatters once; no op reduce-scatters a sum of two matmuls."""
    report, _ = _sequence_parallel(2, training=True, swiglu=True)
    assert _site_forms(report) == ["matmul_then_reduce_scatter_sequence"]
    (reason,) = near_miss_reasons(report, "matmul_reduce_scatter")
    assert reason.startswith("the reduce-scatter reads a sum") and "w1 and w3" in reason


def test_a_local_k_below_256_is_outside_the_op():
    """w2's contracted dim is the hidden width over the ranks: 256 / 2 = 128."""
    report, _ = _sequence_parallel(2, hidden=256)
    assert near_miss_reasons(report, "matmul_reduce_scatter") == [
        f"k = 128 (the contracted dim, local to the rank) is outside {OP}'s [256, 65535)"]


def test_fp32_is_left_alone_naming_the_dtype():
    report, _ = _sequence_parallel(2, dtype=torch.float32)
    assert near_miss_reasons(report, "matmul_reduce_scatter") == [f"{OP} does not support float32"]


def test_max_autotune_inference_cannot_lower_the_inference_mode():
    report, _ = _sequence_parallel(2, config=nff.FusionConfig(enable=TP_PASSES, mode="max-autotune"))
    (reason,) = near_miss_reasons(report, "matmul_reduce_scatter")
    assert "comm_mode='aiv'" in reason and "max-autotune cannot lower it" in reason


def test_atlas_inference_has_no_mc2():
    report, _ = _sequence_parallel(2, config=nff.FusionConfig(enable=TP_PASSES, soc="Ascend310P"))
    assert near_miss_reasons(report, "matmul_reduce_scatter") == [f"{OP} is not available on Ascend310P"]


def test_symbolic_sizes_fuse_the_same():
    """dynamic=True: the sequence's slices are symbolic; the scatter needs no padding."""
    with fake_world(2):
        block = feed_forward(sequence_parallel=True)
        report, _ = capture(block, torch.randn(1, 8, 256, dtype=torch.bfloat16), dynamic=True)
    assert _site_forms(report) == ["matmul_then_reduce_scatter_sequence"]
