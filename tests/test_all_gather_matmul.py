"""all_gather_matmul: the sequence all-gather in front of a column-parallel matmul ->
npu_all_gather_base_mm (patterns/all_gather_matmul.py).

The graphs are torch.distributed.tensor.parallel's own (SequenceParallel + ColwiseParallel on a
small MLP, tests/tp_modules.py), compiled in this process over the fake process group: the
collectives are recorded as a real compile records them, their data is meaningless. These
tests check what fuses and what does not, and why; on 2 gloo ranks the fused graph equals the
unfused one exactly, forward and backward (tests/test_tensor_parallel.py).
"""
from __future__ import annotations

import pytest
import torch

import npu_fx_fusion as nff
from helpers import fake_world, near_miss_reasons
from tp_modules import TP_PASSES, Gathered, capture, default_group_name, feed_forward, ops_in

OP = "npu.npu_all_gather_base_mm"


def _sequence_parallel(world, batch=1, dtype=torch.bfloat16, config=None, training=False, dynamic=None, **module):
    """The report and graphs of feed_forward(sequence_parallel=True, ...) on rank 0 of `world`,
    taking its slice of a batch of 16-token sequences."""
    with fake_world(world):
        block = feed_forward(sequence_parallel=True, dtype=dtype, **module)
        x = torch.randn(batch, 16 // world, module.get("dim", 256), dtype=dtype, requires_grad=training)
        return capture(block, x, config=config, training=training, dynamic=dynamic)


def _site_forms(report, pass_name="all_gather_matmul"):
    return [site.form for site in report.sites if site.pass_name == pass_name]


@pytest.mark.parametrize("world, batch, form", [
    (2, 1, "gather_sequence_then_matmul"),  # one sequence: funcol views the rank-major rows
    (4, 1, "gather_sequence_then_matmul"),
    (2, 2, "gather_sequences_then_matmul"),  # a batch: per-rank slices concatenated on dim 1
], ids=["2-ranks", "4-ranks", "batch-2"])
def test_the_sequence_gather_in_front_of_a_colwise_linear_fuses(world, batch, form):
    report, graphs = _sequence_parallel(world, batch)
    assert _site_forms(report) == [form]
    (fused,) = ops_in(graphs["inference"], OP)
    assert not ops_in(graphs["inference"], "_c10d_functional.all_gather_into_tensor")
    assert fused.args[3] == world
    # an inference graph: the communication mode documented for inference
    assert fused.kwargs == {"comm_mode": "aiv"}
    (site,) = [s for s in report.sites if s.pass_name == "all_gather_matmul"]
    assert "comm_mode='aiv'" in site.note and "max-autotune" in site.note


def test_flat_rows_gathered_on_dim_0_fuse():
    with fake_world(2):
        module = Gathered(torch.randn(64, 256, dtype=torch.bfloat16), default_group_name(), 2, "gather")
        report, graphs = capture(module, torch.randn(8, 256, dtype=torch.bfloat16))
    assert _site_forms(report) == ["gather_then_matmul"]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_training_step_fuses_the_forward_and_the_backward(batch):
    """Forward: the gather in front of w1. Backward: w2's input gradient is the gathered
    gradient times w2, aten.matmul_backward in an NPU graph, whose weight gradient then reads
    the fused op's gathered output. The default communication mode (training)."""
    report, graphs = _sequence_parallel(2, batch, training=True)
    suffix = "" if batch == 1 else "s"
    assert _site_forms(report) == [f"gather_sequence{suffix}_then_matmul",
                                   f"gather_sequence{suffix}_gradient_then_matmul_backward"]
    for phase in ("forward", "backward"):
        (fused,) = ops_in(graphs[phase], OP)
        assert fused.kwargs == {}, phase
    backward = graphs["backward"]
    (fused,) = ops_in(backward, OP)
    # w2's matmul_backward is gone (and w1's: matmul_reduce_scatter fused its input gradient)
    assert not [n for n in backward.graph.nodes if "matmul_backward" in str(n.target)]
    weight_gradient = [n for n in backward.graph.nodes if n.target is torch.ops.aten.matmul.default]
    assert any(_reads(n, fused) for n in weight_gradient)
    training_sites = [s for s in report.sites if s.pass_name == "all_gather_matmul" and "then_matmul" in s.form
                      and "gradient" not in s.form]
    assert "a training graph takes the default communication mode" in training_sites[0].note


def _reads(node, source, depth=6):
    return node is source or (depth > 0 and any(_reads(a, source, depth - 1) for a in node.all_input_nodes))


def test_fp32_is_left_alone_naming_the_dtype():
    report, _ = _sequence_parallel(2, dtype=torch.float32)
    assert report.fused_ops.get(OP, 0) == 0
    assert near_miss_reasons(report, "all_gather_matmul") == [f"{OP} does not support float32"]


def test_a_width_below_256_is_outside_the_op():
    report, _ = _sequence_parallel(2, dim=128, hidden=1024)
    assert near_miss_reasons(report, "all_gather_matmul") == [
        f"k = 128 (the contracted dim, local to the rank) is outside {OP}'s [256, 65535)"]


def test_rank_counts_are_the_socs():
    """Atlas A2 takes 2, 4 or 8 ranks, A3 also 16 and 32; 3 ranks neither."""
    report, _ = _sequence_parallel(3, hidden=768, config=nff.FusionConfig(enable=TP_PASSES, soc="Ascend910B"))
    assert near_miss_reasons(report, "all_gather_matmul") == [
        f"the group has 3 ranks: {OP} takes 2, 4, 8 on Ascend910B"]


def test_max_autotune_inference_cannot_lower_the_inference_mode():
    """torchair 2.13's GE converter refuses comm_mode on A2/A3, and the default mode is documented
    for training: an inference graph lowered in max-autotune keeps its gather."""
    report, _ = _sequence_parallel(2, config=nff.FusionConfig(enable=TP_PASSES, mode="max-autotune"))
    assert report.fused_ops.get(OP, 0) == 0
    (reason,) = near_miss_reasons(report, "all_gather_matmul")
    assert "comm_mode='aiv'" in reason and "max-autotune cannot lower it" in reason


def test_dynamic_shapes_pad_the_sequence_and_are_a_near_miss():
    """Under dynamic=True DTensor cannot know the ranks divide the sequence: it gathers a padded
    one and slices it back, which the forms do not take (the fused output would need the slice)."""
    report, _ = _sequence_parallel(2, dynamic=True)
    assert report.fused_ops.get(OP, 0) == 0
    (reason,) = near_miss_reasons(report, "all_gather_matmul")
    assert reason.startswith("the gathered sequence is sliced back to the model's length")


def test_a_gather_read_by_two_projections_fuses_once_and_feeds_the_other():
    """SwiGLU's w1 and w3 read one gathered input (torchtitan gathers the FFN's input once): one
    matmul becomes the fused op, the other reads its gathered output."""
    report, graphs = _sequence_parallel(2, swiglu=True)
    assert _site_forms(report) == ["gather_sequence_then_matmul"]
    (fused,) = ops_in(graphs["inference"], OP)
    (other,) = [n for n in graphs["inference"].graph.nodes if n.target is torch.ops.aten.matmul.default
                and n.args[1].meta["val"].shape[1] == 512]
    assert _reads(other.args[0], fused)
