"""Expert-parallel MC2: npu_moe_distribute_dispatch_v2 / npu_moe_distribute_combine_v2.

dispatch_v2 sends every (token, k) pair of this rank to the rank that owns its expert and
returns what this rank received, grouped by local expert; combine_v2 sends the expert
outputs back along the same path and adds each token's k rows, weighted. One
communicating kernel each on an NPU (HCCL); here the reference kernels run the exchange
over the process group `group_ep` names (_groups.process_group_of: the c10d group itself
on gloo), so 2 and 4 CPU ranks check a fused graph end to end.

What the outputs hold (E experts, W ranks, L = E / W local experts per rank, BS tokens of
K experts each on this rank, A = global_bs * min(L, K) rows, global_bs = BS * W when 0):

* expand_x (A, H): the received rows, local expert by local expert, within one expert
  source rank by source rank, within one source in that rank's flat (t * K + k) order;
  the rows past the received count are padding (undefined on the NPU, zeros here).
  The ops-transformer kernel writes its status slots at (local expert * W + source rank)
  (op_kernel/moe_distribute_dispatch_v2.h, SetStatus) and copies the windows out in that
  order; each sender walks its expert ids in flat order;
* assist_info_for_combine (max(BS * K, A * 128),) int32: per received row, the triple
  (source rank, source token, k) (the kernel's expand_idx, "按3元组保存信息，分别为rank_id
  token_id topk_id", op_kernel/moe_distribute_combine_v2.h); the doc says to pass it to
  combine_v2 unchanged and not to depend on its values, and the passes do neither;
* expert_token_nums (L,) int64: the rows per local expert (expert_token_nums_type 1) or
  their running sum (0);
* ep_recv_counts (W * L,) int32: running sums of the rows per (local expert, source rank),
  in that order (Atlas A3's shape; the doc: "token数以前缀和的形式表示");
* tp_recv_counts (tp_world_size,) int32, expand_scales (0,) fp32, dynamic_scales (A,) fp32:
  nothing without a TP domain, expert_scales and quantisation (zeros here).

combine_v2's sum (op_kernel/moe_distribute_combine_v2.h, LocalWindowCopy / ProcessMoeExpert):
per token a fp32 accumulator starts at 0, and for k = 0 .. K-1 the row is cast to fp32,
multiplied by the fp32 expert_scales[t, k] and added; the sum is rounded once to the
output dtype (expand_x's, the Meta function's). The reference does exactly that.

Only the plain mode is implemented: no quantisation, TP domain, shared-expert ranks,
expert_scales, active masks, elastic scaling or special experts; any of them raises
NotImplementedError. Sources: torch_npu 2.13's schemas (npu_native_functions_by_codegen.yaml)
and Meta functions (op_plugin/meta/_meta_registrations.py), the op-plugin docs
(torch_npu-npu_moe_distribute_dispatch_v2.md, ..._combine_v2.md), torchair 2.13's GE
converters (ge_converter/custom/moe_distribute_dispatch_v2.py, ..._combine_v2.py).

opcheck: the samples run over a one-rank gloo group (_groups.single_rank_group), every
expert local, so the op-level tests stay single-process; the gloo tests of the
expert-parallel pass run them on 2 ranks.
"""
from __future__ import annotations

import torch

from . import _groups
from .spec import OpCapability, Sample, SocLimits, op_spec

HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
# the triple assist_info_for_combine holds per received row: source rank, token, k
_ASSIST = 3


def _plain_mode(op: str, **arguments) -> None:
    given = sorted(name for name, value in arguments.items() if value not in (None, False, 0, ""))
    if given:
        raise NotImplementedError(f"{op}: the CPU stand-in implements the plain mode only (no quantisation, TP "
                                  f"domain, shared-expert ranks, masks, elastic scaling or special experts), got {given}")


def _layout(moe_expert_num: int, ep_world_size: int, batch: int, top_k: int, global_bs: int) -> tuple[int, int]:
    """(local experts L, rows A of expand_x), as the Meta function computes them."""
    local = moe_expert_num // ep_world_size
    return local, (global_bs if global_bs else batch * ep_world_size) * min(local, top_k)


def _exchange(group, send: torch.Tensor, send_rows: list, recv_rows: list) -> torch.Tensor:
    """all_to_all of rows: send_rows[r] rows to rank r, recv_rows[r] from rank r, rank-major."""
    received = send.new_empty((sum(recv_rows), *send.shape[1:]))
    group.alltoall_base(received, send.contiguous(), recv_rows, send_rows).wait()
    return received


# ---- npu_moe_distribute_dispatch_v2 ----------------------------------------------------------
def _dispatch_fake(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                   x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None, group_tp="",
                   tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                   quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                   copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None, scales_dtype=None):
    # torch_npu's Meta in the plain mode (no shared-expert ranks, tp_world_size 0/1, quant_mode 0)
    batch, hidden, top_k = x.shape[0], x.shape[1], expert_ids.shape[1]
    local, rows = _layout(moe_expert_num, ep_world_size, batch, top_k, global_bs)
    return (x.new_empty((rows, hidden)),
            x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((max(batch * top_k, rows * 128),), dtype=torch.int32),
            x.new_empty((local,), dtype=torch.int64),
            x.new_empty((ep_world_size * local,), dtype=torch.int32),
            x.new_empty((tp_world_size,), dtype=torch.int32),
            x.new_empty((0,), dtype=torch.float32))


def _dispatch_samples(dtype):
    group = _groups.single_rank_group()
    generator = torch.Generator().manual_seed(0)
    # 5 tokens of top-2 over 4 experts (every expert local on one rank), H 16
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(5)]).to(torch.int32)
    x = torch.randn(5, 16, generator=generator).to(dtype)
    yield Sample((x, ids, group, 1, 0, 4), layout_args=(0,))
    yield Sample((x, ids, group, 1, 0, 4), {"expert_token_nums_type": 0, "global_bs": 8}, layout_args=(0,))


_MC2_LIMITS = {
    "group": "an HCCL communicator name (group_ep), the EP domain carrying no other operator",
    "scenarios": ("inference",),  # 该接口支持推理场景下使用
    "max_top_k": 16,  # 0 < K <= 16 (12 with comm_alg fullmesh_v2)
    "max_batch": {"Ascend910B": 256, "Ascend910_93": 512},  # BS per rank (fullmesh / v1)
    "hidden": {"Ascend910B": (1, 7168, 32), "Ascend910_93": (1024, 8192, 1)},  # min, max, multiple
    # ep_world_size: A2 "fullmesh" 16, 32, 64, 128, 256 ("hierarchy" 16, 32, 64), A3 [2, 768] (the
    # torch_npu doc and aclnnMoeDistributeDispatchV2.md, 参数说明)
    "world_sizes": {"Ascend910B": (16, 32, 64, 128, 256), "Ascend910_93": tuple(range(2, 769))},
    "max_moe_expert_num": 1024,  # moe_expert_num in [1, 1024]
    "a2_max_moe_expert_num": 512,  # A2: moeExpertNum in (0, 512] (aclnn doc)
    "a2_max_local_experts": 24,  # A2: moe_expert_num / ep_world_size <= 24
    "a3_max_experts_times_ranks": 2048,  # local experts * world size
    "ids_dtypes": (torch.int32,),
    "scales_dtypes": (torch.float32,),  # combine's expert_scales
    "tp": "reserved: tp_world_size 0/1 only",
}
_UNSUPPORTED = SocLimits(supported=False)


def _mc2_capability(limits, doc):
    """The facts both ops share: fp16 / bf16 2-D rows, inference only (no backward), a GE
    converter each in torchair 2.13 (ge_converter/custom/moe_distribute_*_v2.py), A2 / A3 only."""
    return OpCapability(dtypes=HALF_DTYPES, min_rank=2, max_rank=2, backward=None, ge_converter=True,
                        socs={"Ascend310P": _UNSUPPORTED, "Ascend950": _UNSUPPORTED}, limits=limits, doc=doc)


@op_spec("npu::npu_moe_distribute_dispatch_v2",
         schema="npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, "
         "int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None, "
         "Tensor? expert_scales=None, Tensor? elastic_info=None, Tensor? performance_info=None, str group_tp=\"\", "
         "int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, "
         "int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, int expert_token_nums_type=1, "
         "str comm_alg=\"\", int zero_expert_num=0, int copy_expert_num=0, int const_expert_num=0, "
         "int? y_dtype=None, int? x_dtype=None, int? scales_dtype=None) "
         "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
         fake=_dispatch_fake,
         capability=_mc2_capability(
             _MC2_LIMITS,
             "torch_npu doc (Ascend/op-plugin docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md, 约束说明): "
             "inference only, paired with combine_v2 with identical group_ep, ep_world_size, moe_expert_num, "
             "shared-expert and global_bs settings on every rank and layer; group_ep an HCCL group name; K <= 16; "
             "BS <= 256 (A2) / 512 (A3); H (0, 7168] multiple of 32 on A2, [1024, 8192] on A3; A2/A3 only"),
         samples=_dispatch_samples)
def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0, y_dtype=None, x_dtype=None,
                                   scales_dtype=None):
    _plain_mode("npu_moe_distribute_dispatch_v2", scales=scales, x_active_mask=x_active_mask,
                expert_scales=expert_scales, elastic_info=elastic_info, group_tp=group_tp,
                tp_world_size=tp_world_size > 1, shared_expert_rank_num=shared_expert_rank_num, quant_mode=quant_mode,
                zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num,
                y_dtype=y_dtype, x_dtype=x_dtype)
    group = _groups.process_group_of(group_ep)
    if group.size() != ep_world_size or not 0 <= ep_rank_id < ep_world_size or group.rank() != ep_rank_id:
        raise ValueError(f"npu_moe_distribute_dispatch_v2: ep_world_size {ep_world_size} / ep_rank_id {ep_rank_id}, "
                         f"but {group_ep!r} has {group.size()} ranks and this is rank {group.rank()}")
    if moe_expert_num % ep_world_size:
        raise ValueError(f"npu_moe_distribute_dispatch_v2: {moe_expert_num} experts over {ep_world_size} ranks")
    if expert_token_nums_type not in (0, 1):
        raise ValueError(f"npu_moe_distribute_dispatch_v2: expert_token_nums_type {expert_token_nums_type}")
    batch, top_k = expert_ids.shape
    local, rows = _layout(moe_expert_num, ep_world_size, batch, top_k, global_bs)
    ids = expert_ids.reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= moe_expert_num):
        raise ValueError(f"npu_moe_distribute_dispatch_v2: expert ids outside [0, {moe_expert_num})")

    # send: the pairs ordered by expert, each expert's in flat order (rank by rank: d * L + e)
    order = torch.argsort(ids, stable=True)
    per_expert = torch.bincount(ids, minlength=moe_expert_num)
    meta = torch.stack([torch.full_like(order, ep_rank_id), order // top_k, order % top_k], dim=1).to(torch.int32)
    received_counts = _exchange(group, per_expert.view(ep_world_size, local), [1] * ep_world_size,
                                [1] * ep_world_size)  # (W, L): rows from rank r for local expert e
    send_rows = per_expert.view(ep_world_size, local).sum(1).tolist()
    recv_rows = received_counts.sum(1).tolist()
    tokens = _exchange(group, x[order // top_k], send_rows, recv_rows)  # rank-major, expert within
    triples = _exchange(group, meta, send_rows, recv_rows)

    # regroup: local expert by local expert, source rank by source rank
    starts = torch.cat([received_counts.new_zeros(1), received_counts.reshape(-1).cumsum(0)])
    counts = received_counts.tolist()
    pieces = [torch.arange(int(starts[r * local + e]), int(starts[r * local + e]) + counts[r][e])
              for e in range(local) for r in range(ep_world_size)]
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    if index.numel() > rows:
        raise RuntimeError(f"npu_moe_distribute_dispatch_v2: {index.numel()} rows received, expand_x holds {rows}")
    expand_x = x.new_zeros((rows, x.shape[1]))
    expand_x[:index.numel()] = tokens[index]
    assist = torch.zeros(max(batch * top_k, rows * 128), dtype=torch.int32)
    assist[:_ASSIST * index.numel()] = triples[index].reshape(-1)
    per_local = received_counts.sum(0)
    expert_token_nums = (per_local if expert_token_nums_type == 1 else per_local.cumsum(0)).to(torch.int64)
    ep_recv_counts = received_counts.t().reshape(-1).cumsum(0).to(torch.int32)
    return (expand_x, x.new_zeros((rows,), dtype=torch.float32), assist, expert_token_nums, ep_recv_counts,
            x.new_zeros((tp_world_size,), dtype=torch.int32), x.new_zeros((0,), dtype=torch.float32))


# ---- npu_moe_distribute_combine_v2 -----------------------------------------------------------
def _combine_fake(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                  ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                  expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None, const_expert_alpha_1=None,
                  const_expert_alpha_2=None, const_expert_v=None, performance_info=None, group_tp="",
                  tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                  const_expert_num=0):
    # torch_npu's Meta: (BS, H) in expand_x's dtype
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


def _combine_samples(dtype):
    group = _groups.single_rank_group()
    for sample in _dispatch_samples(dtype):
        x, ids = sample.args[:2]
        expand_x, _, assist, _, ep_recv_counts, _, _ = npu_moe_distribute_dispatch_v2(*sample.args, **sample.kwargs)
        scales = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
        # the expert output rows, as the GEMMs would give them (padding rows included)
        rows = (expand_x.float() * 0.5 + 1).to(dtype)
        yield Sample((rows, ids, assist, ep_recv_counts, scales, group, 1, 0, 4),
                     {"global_bs": sample.kwargs.get("global_bs", 0)}, layout_args=(0,))


@op_spec("npu::npu_moe_distribute_combine_v2",
         schema="npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine, "
         "Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, "
         "int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None, "
         "Tensor? expand_scales=None, Tensor? shared_expert_x=None, Tensor? elastic_info=None, Tensor? ori_x=None, "
         "Tensor? const_expert_alpha_1=None, Tensor? const_expert_alpha_2=None, Tensor? const_expert_v=None, "
         "Tensor? performance_info=None, str group_tp=\"\", int tp_world_size=0, int tp_rank_id=0, "
         "int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int global_bs=0, "
         "int comm_quant_mode=0, str comm_alg=\"\", int zero_expert_num=0, int copy_expert_num=0, "
         "int const_expert_num=0) -> Tensor",
         fake=_combine_fake,
         capability=_mc2_capability(
             {"pairs_with": "npu.npu_moe_distribute_dispatch_v2", **_MC2_LIMITS},
             "torch_npu doc torch_npu-npu_moe_distribute_combine_v2.md: the reverse of dispatch_v2 "
             "(its assist_info_for_combine, ep_recv_counts passed unchanged), the weighted sum of each token's k "
             "rows (expert_scales fp32, summed in fp32, one rounding: op_kernel/moe_distribute_combine_v2.h); "
             "inference only; the limits of dispatch_v2"),
         samples=_combine_samples)
def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                  const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                                  tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    _plain_mode("npu_moe_distribute_combine_v2", tp_send_counts=tp_send_counts, x_active_mask=x_active_mask,
                expand_scales=expand_scales, shared_expert_x=shared_expert_x, elastic_info=elastic_info,
                ori_x=ori_x, const_expert_v=const_expert_v, group_tp=group_tp, tp_world_size=tp_world_size > 1,
                shared_expert_rank_num=shared_expert_rank_num, comm_quant_mode=comm_quant_mode,
                zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num, const_expert_num=const_expert_num)
    group = _groups.process_group_of(group_ep)
    if group.size() != ep_world_size or group.rank() != ep_rank_id:
        raise ValueError(f"npu_moe_distribute_combine_v2: ep_world_size {ep_world_size} / ep_rank_id {ep_rank_id}, "
                         f"but {group_ep!r} has {group.size()} ranks and this is rank {group.rank()}")
    local = moe_expert_num // ep_world_size
    batch, top_k = expert_ids.shape
    received = int(ep_send_counts[ep_world_size * local - 1]) if local else 0
    triples = assist_info_for_combine[:_ASSIST * received].view(received, _ASSIST).to(torch.int64)
    # back along the same path: each source rank's rows (in expand_x order), with their (token, k)
    by_source = torch.argsort(triples[:, 0], stable=True)
    send_rows = torch.bincount(triples[:, 0], minlength=ep_world_size).tolist()
    recv_rows = _exchange(group, torch.tensor(send_rows).view(ep_world_size, 1), [1] * ep_world_size,
                          [1] * ep_world_size).view(-1).tolist()
    rows = _exchange(group, expand_x[:received][by_source], send_rows, recv_rows)
    slots = _exchange(group, triples[by_source][:, 1:], send_rows, recv_rows)
    if rows.shape[0] != batch * top_k:
        raise RuntimeError(f"npu_moe_distribute_combine_v2: {rows.shape[0]} rows came back for {batch} tokens of top-{top_k}")
    # each token's k rows in k order: fp32 products added into a fp32 sum, rounded once
    by_pair = torch.empty_like(rows).index_copy_(0, slots[:, 0] * top_k + slots[:, 1], rows)
    by_pair = by_pair.view(batch, top_k, -1).float()
    weights = expert_scales.float()
    total = torch.zeros((batch, expand_x.shape[1]), dtype=torch.float32)
    for k in range(top_k):
        total = total + by_pair[:, k] * weights[:, k:k + 1]
    return total.to(expand_x.dtype)
