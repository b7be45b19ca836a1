"""Tensor-parallel matmuls fused with their collective (MC2): npu_mm_all_reduce_base,
npu_all_gather_base_mm, npu_mm_reduce_scatter_base.

Each op overlaps one HCCL collective with one matmul in a single kernel. The reference
kernels below do what the NPU kernel computes, over the process group its `hcom` names
(_groups.process_group_of): on CPU a gloo group, so a graph fused on 2 or 4 gloo ranks runs
the collective and the local matmul for real. Only the unquantised ops are implemented (the
passes emit no other); a quantisation argument raises.

Precision: the local matmul accumulates in fp32 and rounds once to the input dtype (CPU's
and the NPU's matmul alike); the collective then moves or sums values of that dtype. How
HCCL sums bf16 inside the fused kernel (its reduction order and intermediate precision) is
not documented; the reference sums as the group's backend does, which is what the unfused
graph's functional collective does on the same group. So on gloo a fused site equals its
unfused code bit for bit; on an NPU an all-reduce or reduce-scatter may differ by the
rounding of its (ranks - 1) additions, the tolerance `verify_ulps` allows.

Sources: the torch_npu 2.13 docstrings (_op_plugin_docs.py) and schemas (the wheel's
npu_native_functions_by_codegen.yaml), the Meta functions (op_plugin/meta/_meta_registrations.py:
npu_mm_all_reduce_base_forward, npu_all_gather_base_mm_meta, npu_mm_reduce_scatter_base_meta),
the CANN aclnn docs (aclnnMatmulAllReduceV2: output = allreduce(x1 @ x2 + bias + x3), Atlas A3 not
supported; aclnnAllGatherMatmul, aclnnMatmulReduceScatter), and torchair 2.13's GE converters
(_ge_concrete_graph/ge_converter/custom/matmul_all_reduce.py, all_gather_matmul.py,
matmul_reduce_scatter.py).

opcheck: the samples run over a one-rank gloo group built in the test process and
registered under its own hcom (_groups.single_rank_group), with no init_process_group, so
the op-level tests stay single-process; world_size 1 is what that group has (the op's rank
limits are the capability's, not the kernel's).
"""
from __future__ import annotations

import torch

from . import _groups
from .spec import OpCapability, Sample, SocLimits, op_spec

HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
_UNSUPPORTED = SocLimits(supported=False)

# The limits npu_all_gather_base_mm and npu_mm_reduce_scatter_base share (their docs, 参数说明 and 约束说明),
# among them the documented scenario of their default (ai_cpu) communication mode and of comm_mode="aiv"
# (the hiascend torch_npu pages, 约束说明: "comm_mode为ai_cpu时: 该接口支持训练场景下使用" / "仅在训练场景下
# 使用"; "comm_mode为aiv时，训练和推理场景均可使用"); torchair 2.13's GE converters refuse any comm_mode below
# Ascend950 (A2/A3 use the ai_cpu kernel there), so a GE graph (max-autotune) gets the training-only mode
_GATHER_SCATTER_LIMITS = {
    "k_range": (256, 65535),  # k in [256, 65535)
    "world_sizes": {"Ascend910B": (2, 4, 8), "Ascend910_93": (2, 4, 8, 16, 32)},
    "x1_contiguous": True,  # input 不支持输入转置后的tensor
    "default_mode_scenarios": ("training",),
    "aiv_scenarios": ("training", "inference"),
    "ge_comm_mode": False,  # torchair 2.13: "comm_mode ... not supported on Ascend910B/Ascend910C"
}


def _group_of(hcom: str, world_size: int | None = None):
    group = _groups.process_group_of(hcom)
    if world_size is not None and group.size() != world_size:
        raise ValueError(f"world_size={world_size}, but the group {hcom!r} has {group.size()} ranks")
    return group


def _unquantised(op: str, **arguments) -> None:
    given = sorted(name for name, value in arguments.items() if value is not None and value is not False)
    if given:
        raise NotImplementedError(f"{op}: the CPU stand-in implements the unquantised op only, got {given}")


def _local_matmul(x1: torch.Tensor, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x1 @ x2 (+ bias) as the kernel's cube unit computes it: fp32 accumulation, one rounding."""
    out = torch.matmul(x1, x2)
    return out if bias is None else out + bias


def _randn(*shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- npu_mm_all_reduce_base ------------------------------------------------------------
def _mm_all_reduce_fake(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None, antiquant_offset=None,
                        x3=None, dequant_scale=None, pertoken_scale=None, comm_quant_scale_1=None,
                        comm_quant_scale_2=None, antiquant_group_size=0, comm_turn=0, group_sizes=None, y_dtype=None,
                        x1_dtype=None, x2_dtype=None, dequant_scale_dtype=None, pertoken_scale_dtype=None,
                        comm_quant_mode=0, comm_mode=None):
    # torch_npu's Meta: x1's sizes with the last one n, x1's dtype (unquantised)
    return x1.new_empty((*x1.shape[:-1], x2.shape[1]))


def _mm_all_reduce_samples(dtype):
    hcom = _groups.single_rank_group()
    yield Sample((_randn(6, 16, dtype=dtype, seed=0), _randn(16, 8, dtype=dtype, seed=1), hcom))
    # x1 3-D (b, s, k); x2 the transposed view of an (n, k) weight, as a linear layer holds it
    yield Sample((_randn(2, 3, 16, dtype=dtype, seed=2), _randn(8, 16, dtype=dtype, seed=3).t(), hcom),
                 layout_args=(0,))


@op_spec("npu::npu_mm_all_reduce_base",
         schema="npu_mm_all_reduce_base(Tensor x1, Tensor x2, str hcom, *, str reduce_op='sum', Tensor? bias=None, "
         "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? x3=None, Tensor? dequant_scale=None, "
         "Tensor? pertoken_scale=None, Tensor? comm_quant_scale_1=None, Tensor? comm_quant_scale_2=None, "
         "int antiquant_group_size=0, int comm_turn=0, int[]? group_sizes=None, int? y_dtype=None, "
         "int? x1_dtype=None, int? x2_dtype=None, int? dequant_scale_dtype=None, int? pertoken_scale_dtype=None, "
         "int comm_quant_mode=0, str? comm_mode=None) -> Tensor",
         fake=_mm_all_reduce_fake,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=2, max_rank=3, backward=None, ge_converter=True,
             # Atlas A2 only: aclnnMatmulAllReduceV2 lists Atlas A3 as unsupported, and torch_npu's
             # docstring names A2 alone
             socs={"Ascend910_93": _UNSUPPORTED, "Ascend310P": _UNSUPPORTED, "Ascend950": _UNSUPPORTED},
             limits={
                 "world_sizes": (1, 2, 4, 8),  # 支持1、2、4、8卡 (hccs all mesh)
                 "max_m_k_n": 2147483647,  # unquantised: m, k, n in [1, 2147483647]
                 "x1_contiguous": True,  # x1 不支持输入转置后的tensor (aclnn: 不支持非连续输入)
                 "scenarios": ("inference",),  # 该接口支持推理场景下使用; no autograd
                 # 增量场景不使能该融合算子, 全量场景使能: a decode step (one token per sequence)
                 # gains nothing from the overlap; reported as a note
                 "decode_note": "torch_npu's doc: not for incremental (decode) steps, for full (prefill) ones",
                 "reduce_ops": ("sum",),
             },
             doc="torch_npu 2.13 docstring of npu_mm_all_reduce_base and CANN aclnnMatmulAllReduceV2: "
             "output = allreduce(x1 @ x2 + bias + x3) over the group hcom names; x1 2-D or 3-D, contiguous; x2 2-D "
             "(k, n), a transposed view allowed; fp16/bf16 unquantised; 1, 2, 4 or 8 ranks; reduce_op sum; "
             "inference; Atlas A2 only; A2: every MC2 op of a model on one communication domain"),
         samples=_mm_all_reduce_samples)
def npu_mm_all_reduce_base(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None, antiquant_offset=None,
                           x3=None, dequant_scale=None, pertoken_scale=None, comm_quant_scale_1=None,
                           comm_quant_scale_2=None, antiquant_group_size=0, comm_turn=0, group_sizes=None,
                           y_dtype=None, x1_dtype=None, x2_dtype=None, dequant_scale_dtype=None,
                           pertoken_scale_dtype=None, comm_quant_mode=0, comm_mode=None):
    _unquantised("npu_mm_all_reduce_base", antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                 dequant_scale=dequant_scale, pertoken_scale=pertoken_scale, comm_quant_scale_1=comm_quant_scale_1,
                 comm_quant_scale_2=comm_quant_scale_2, group_sizes=group_sizes, y_dtype=y_dtype)
    if reduce_op != "sum":
        raise ValueError(f"npu_mm_all_reduce_base: reduce_op must be 'sum' (the only one supported), got {reduce_op!r}")
    out = _local_matmul(x1, x2, bias)
    if x3 is not None:
        out = out + x3  # inside the all-reduce: allreduce(x1 @ x2 + bias + x3)
    out = out.contiguous()
    _group_of(hcom).allreduce([out]).wait()
    return out


# ---- npu_all_gather_base_mm --------------------------------------------------------------
def _all_gather_mm_fake(self, x2, hcom, world_size, *, bias=None, x1_scale=None, x2_scale=None, gather_index=0,
                        gather_output=True, comm_turn=0, output_dtype=None, comm_mode=None):
    # torch_npu's Meta (gather_index 0): (m * world_size, n), and the gathered (m * world_size, k),
    # or an empty 1-D tensor without gather_output
    world = max(world_size, 1)
    gathered = self.new_empty((self.shape[0] * world, self.shape[1])) if gather_output else self.new_empty((0,))
    return self.new_empty((self.shape[0] * world, x2.shape[1])), gathered


def _all_gather_mm_samples(dtype):
    hcom = _groups.single_rank_group()
    yield Sample((_randn(4, 16, dtype=dtype, seed=0), _randn(16, 8, dtype=dtype, seed=1), hcom, 1))
    yield Sample((_randn(4, 16, dtype=dtype, seed=2), _randn(8, 16, dtype=dtype, seed=3).t(), hcom, 1),
                 {"gather_output": False}, layout_args=(0,))


@op_spec("npu::npu_all_gather_base_mm",
         schema="npu_all_gather_base_mm(Tensor self, Tensor x2, str hcom, int world_size, *, Tensor? bias=None, "
         "Tensor? x1_scale=None, Tensor? x2_scale=None, int gather_index=0, bool gather_output=True, int comm_turn=0, "
         "ScalarType? output_dtype=None, str? comm_mode=None) -> (Tensor, Tensor)",
         fake=_all_gather_mm_fake,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=2, max_rank=2, backward=None, ge_converter=True,
             socs={"Ascend310P": _UNSUPPORTED, "Ascend950": _UNSUPPORTED},  # Atlas A2 and A3 only
             limits={
                 **_GATHER_SCATTER_LIMITS,
                 "gather_index": 0,  # 当前版本仅支持输入0: the first input is gathered, on its dim 0
             },
             doc="torch_npu 2.13 docstring of npu_all_gather_base_mm and the hiascend page: output = "
             "allgather(x1) @ x2, gather_out = allgather(x1), gathered on dim 0 in rank order; x1 (m, k) not "
             "transposed, x2 (k, n) (a transposed view allowed), k in [256, 65535); fp16/bf16 unquantised; "
             "A2: 2, 4, 8 ranks, A3: 2, 4, 8, 16, 32; gather_index 0; comm_mode ai_cpu (the default, the only one "
             "torchair's GE converter takes on A2/A3): training; aiv: training and inference; A2: every MC2 op of a "
             "model on one communication domain"),
         samples=_all_gather_mm_samples)
def npu_all_gather_base_mm(self, x2, hcom, world_size, *, bias=None, x1_scale=None, x2_scale=None, gather_index=0,
                           gather_output=True, comm_turn=0, output_dtype=None, comm_mode=None):
    _unquantised("npu_all_gather_base_mm", x1_scale=x1_scale, x2_scale=x2_scale, output_dtype=output_dtype)
    if gather_index != 0:
        raise ValueError(f"npu_all_gather_base_mm: gather_index must be 0 (the only one supported), got {gather_index}")
    group = _group_of(hcom, world_size)
    shard = self.contiguous()
    gathered = shard.new_empty((shard.shape[0] * world_size, shard.shape[1]))
    group._allgather_base(gathered, shard).wait()  # noqa: SLF001 - rank-major rows, as all_gather_into_tensor
    out = _local_matmul(gathered, x2, bias)
    return out, (gathered if gather_output else self.new_empty((0,)))


# ---- npu_mm_reduce_scatter_base -----------------------------------------------------------
def _mm_reduce_scatter_fake(self, x2, hcom, world_size, *, reduce_op="sum", bias=None, x1_scale=None,
                            x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None):
    # torch_npu's Meta: (floor(m / world_size), n)
    return self.new_empty((self.shape[0] // max(world_size, 1), x2.shape[1]))


def _mm_reduce_scatter_samples(dtype):
    hcom = _groups.single_rank_group()
    yield Sample((_randn(4, 16, dtype=dtype, seed=0), _randn(16, 8, dtype=dtype, seed=1), hcom, 1))
    yield Sample((_randn(6, 16, dtype=dtype, seed=2), _randn(8, 16, dtype=dtype, seed=3).t(), hcom, 1),
                 layout_args=(0,))


@op_spec("npu::npu_mm_reduce_scatter_base",
         schema="npu_mm_reduce_scatter_base(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
         "Tensor? bias=None, Tensor? x1_scale=None, Tensor? x2_scale=None, int comm_turn=0, "
         "ScalarType? output_dtype=None, str? comm_mode=None) -> Tensor",
         fake=_mm_reduce_scatter_fake,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=2, max_rank=2, backward=None, ge_converter=True,
             socs={"Ascend310P": _UNSUPPORTED, "Ascend950": _UNSUPPORTED},  # Atlas A2 and A3 only
             limits={
                 **_GATHER_SCATTER_LIMITS,
                 "m_divisible_by_world_size": True,  # m轴需要整除world_size
                 "reduce_ops": ("sum",),
             },
             doc="torch_npu 2.13 docstring of npu_mm_reduce_scatter_base, the hiascend page and CANN "
             "aclnnMatmulReduceScatter: output = reducescatter(x1 @ x2), rank r keeps rows [r * m / ranks, "
             "(r + 1) * m / ranks) of the sum; x1 (m, k) not transposed, m divisible by the ranks; x2 (k, n) (a "
             "transposed view allowed), k in [256, 65535); fp16/bf16 unquantised; A2: 2, 4, 8 ranks, A3: 2, 4, 8, 16, "
             "32; reduce_op sum; comm_mode ai_cpu (the default, the only one torchair's GE converter takes on A2/A3): "
             "training only; aiv: training and inference; A2: every MC2 op of a model on one communication domain"),
         samples=_mm_reduce_scatter_samples)
def npu_mm_reduce_scatter_base(self, x2, hcom, world_size, *, reduce_op="sum", bias=None, x1_scale=None,
                               x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None):
    _unquantised("npu_mm_reduce_scatter_base", x1_scale=x1_scale, x2_scale=x2_scale, output_dtype=output_dtype)
    if reduce_op != "sum":
        raise ValueError(f"npu_mm_reduce_scatter_base: reduce_op must be 'sum', got {reduce_op!r}")
    group = _group_of(hcom, world_size)
    if self.shape[0] % world_size:
        raise ValueError(f"npu_mm_reduce_scatter_base: m = {self.shape[0]} is not divisible by world_size {world_size}")
    partial = _local_matmul(self, x2, bias).contiguous()
    out = partial.new_empty((partial.shape[0] // world_size, partial.shape[1]))
    group._reduce_scatter_base(out, partial).wait()  # noqa: SLF001 - rank r keeps the r-th block of rows
    return out
