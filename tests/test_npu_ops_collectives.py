"""The MC2 ops' CPU reference kernels and the registry of the groups they name: tensor
parallel (npu_ops/collectives.py), expert parallel (npu_ops/moe_distribute.py), groups
(npu_ops/_groups.py). opcheck runs over their specs' samples in tests/test_op_specs.py;
their numerics across ranks in tests/test_tensor_parallel.py and tests/test_expert_parallel.py."""
from __future__ import annotations

import pytest
import torch

from npu_fx_fusion import npu_ops
from npu_fx_fusion.npu_ops import _groups


@pytest.fixture(scope="module", autouse=True)
def _stand_ins():
    if npu_ops.real_torch_npu_available():
        pytest.skip("torch_npu is installed: its own ops are used")
    npu_ops.ensure_registered()


def _one_rank():
    return _groups.single_rank_group()


def test_one_rank_the_ops_are_their_matmul():
    """Over one rank each collective moves nothing: the result is the local matmul, rounded
    once (CPU's bf16 matmul accumulates in fp32), in the shapes torch_npu's Meta gives."""
    x, w = torch.randn(6, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    expected = x @ w.t()
    hcom = _one_rank()
    assert torch.equal(torch.ops.npu.npu_mm_all_reduce_base(x, w.t(), hcom), expected)
    out, gathered = torch.ops.npu.npu_all_gather_base_mm(x, w.t(), hcom, 1)
    assert torch.equal(out, expected) and torch.equal(gathered, x)
    out, none = torch.ops.npu.npu_all_gather_base_mm(x, w.t(), hcom, 1, gather_output=False)
    assert none.shape == (0,)
    assert torch.equal(torch.ops.npu.npu_mm_reduce_scatter_base(x, w.t(), hcom, 1), expected)


def test_x3_is_added_inside_the_all_reduce():
    # aclnnMatmulAllReduceV2: allreduce(x1 @ x2 + bias + x3)
    x, w, x3 = torch.randn(4, 8), torch.randn(8, 5), torch.randn(4, 5)
    out = torch.ops.npu.npu_mm_all_reduce_base(x, w, _one_rank(), x3=x3)
    torch.testing.assert_close(out, x @ w + x3)


def test_a_world_size_other_than_the_groups_is_refused():
    with pytest.raises(ValueError, match="world_size=2, but the group .* has 1 ranks"):
        torch.ops.npu.npu_all_gather_base_mm(torch.randn(4, 8), torch.randn(8, 5), _one_rank(), 2)


def test_quantisation_arguments_are_not_emulated():
    with pytest.raises(NotImplementedError, match="unquantised op only, got \\['x2_scale'\\]"):
        torch.ops.npu.npu_mm_reduce_scatter_base(torch.randn(4, 8), torch.randn(8, 5), _one_rank(), 1,
                                                 x2_scale=torch.ones(1, 5))


def test_an_unknown_hcom_names_what_is_known():
    with pytest.raises(ValueError, match="no process group is named 'nowhere' in this process"):
        torch.ops.npu.npu_mm_all_reduce_base(torch.randn(4, 8), torch.randn(8, 5), "nowhere")


def test_a_group_that_does_not_exist_here_has_no_communicator():
    assert _groups.no_communicator_reason("no_such_group") == (
        "the process group 'no_such_group' does not exist in this process")
    assert _groups.hcom_of("no_such_group") == "no_such_group"  # (a pattern's example: traced, never run)


# ---- the EP MC2 ops (npu_ops/moe_distribute.py) ------------------------------------------------
def test_dispatch_v2_lays_out_the_rows_by_expert_and_combine_v2_sums_them_in_fp32():
    """Over one rank every expert is local: expand_x is the (token, k) rows sorted stably by
    expert (torchtitan's _permute order), padded to BS * min(E, K) rows; the per-expert counts
    and the running receive counts describe them; combine_v2 gives each token the fp32 sum of
    its k weighted rows, rounded once. global_bs 8 (the most tokens any rank has) pads
    expand_x to 8 * 3 rows."""
    generator = torch.Generator().manual_seed(0)
    tokens, top_k, experts, hidden = 6, 3, 4, 32
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)]).int()
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()
    hcom = _one_rank()
    expand_x, _, assist, per_expert, recv_counts, tp_counts, _ = torch.ops.npu.npu_moe_distribute_dispatch_v2(
        x, ids, hcom, 1, 0, experts, global_bs=8)
    order = torch.argsort(ids.flatten().long(), stable=True)
    rows = tokens * top_k
    assert expand_x.shape == (8 * min(experts, top_k), hidden) and tp_counts.shape == (0,)
    assert torch.equal(expand_x[:rows], x[order // top_k]) and not expand_x[rows:].any()
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    assert torch.equal(per_expert, counts) and torch.equal(recv_counts, counts.cumsum(0).int())
    assert torch.equal(assist[:3 * rows].view(rows, 3)[:, 1:].long(), torch.stack([order // top_k, order % top_k], 1))
    # the expert outputs: a row's own value times 2 (the padding rows hold garbage on the NPU)
    expert_out = (expand_x.float() * 2).bfloat16()
    expert_out[rows:] = float("nan")
    scores = torch.rand(tokens, top_k, generator=generator)
    out = torch.ops.npu.npu_moe_distribute_combine_v2(expert_out, ids, assist, recv_counts, scores, hcom, 1, 0, experts,
                                                      global_bs=8)
    expected = torch.zeros(tokens, hidden)
    for k in range(top_k):
        expected += (x.float() * 2).bfloat16().float() * scores[:, k:k + 1]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())


def test_the_ep_ops_refuse_what_they_do_not_implement():
    x, ids = torch.randn(2, 32).bfloat16(), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="quant_mode"):
        torch.ops.npu.npu_moe_distribute_dispatch_v2(x, ids, _one_rank(), 1, 0, 2, quant_mode=2)
    with pytest.raises(ValueError, match="has 1 ranks"):
        torch.ops.npu.npu_moe_distribute_dispatch_v2(x, ids, _one_rank(), 2, 0, 2)
