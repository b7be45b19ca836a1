"""The tensor-parallel MC2 ops' CPU reference kernels and the registry of the groups they name
(npu_ops/collectives.py, npu_ops/_groups.py). opcheck runs over their specs' samples in
tests/test_op_specs.py; their numerics across ranks in tests/test_tensor_parallel.py."""
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
