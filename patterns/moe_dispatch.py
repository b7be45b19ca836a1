"""moe_dispatch: routed experts blocks -> init_routing / finalize_routing.

Four block families: transformers' grouped_mm path (below), its batched_mm path,
torchtitan's local dispatcher (_torchtitan_block), and torchtitan's expert-parallel
dispatcher, fused on each side of its all-to-alls (the "Expert parallel" section below;
docs/expert-parallel.md), or, on an EP group declared dedicated (FusionConfig(ep_group=...)),
replaced whole by MC2's dispatch_v2 / combine_v2 (the "MC2" section, a region found by
walking the graph: `recognize`).

transformers 5 (integrations/moe.py, grouped_mm_experts_forward) routes tokens like this:

    expert_ids_g, perm = sort(top_k_index.reshape(-1))          # flat positions by expert
    x_g = x[perm // K];  w_g = top_k_weights.reshape(-1)[perm]
    offsets = cumsum(histc(expert_ids_g, E bins), int32)
    y = grouped_mm(act(grouped_mm(x_g, w_gate_up, offsets)), w_down, offsets)
    inv[perm] = arange(T*K)                                     # the inverse permutation
    out = (y * w_g[:, None])[inv].view(T, K, H).sum(1)

The whole block is one form, from the sort to the sum, and becomes

    x_g, row_idx, counts, _ = npu_moe_init_routing_v2(x, ids.int(), active_num=T*K,  # -1 if T is symbolic
        expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True, row_idx_type=0)
    offsets = counts.cumsum(0).int()
    y = <the same two grouped GEMMs and activation>             # grouped_matmul / swiglu fuse them
    out = npu_moe_finalize_routing(y, None, None, None, top_k_weights, row_idx, ids.int(),
                                   drop_pad_mode=2)

Index conventions (op_semantics.md 6.1, 6.4; each has a mix-up test in
tests/test_npu_ops_moe.py): init_routing_v2 is token-major (row r of x_g is token
src // K of flat position src), row_idx_type=0 gives the inverse permutation (flat
position t*K + k -> its row in x_g), which is what finalize's token-major mode 2 reads
(mode 0 would read it k-major); expert token counts (type 1, the documented one) are
turned into the cumulative ends grouped_mm takes.

Training. init_routing / finalize have no backward, npu_moe_token_permute / unpermute do,
with the same conventions (a stable sort by expert, its inverse map). So every block
also has a trainable form: on the joint graph it becomes permute -> the same expert
GEMMs -> unpermute, forward and backward (grouped_matmul and swiglu then fuse the GEMMs
and the activation with their backward). The counts are recounted from the ids as the
model does (histc). In inference the init_routing forms come first.

Why the whole block and not the dispatch alone: torch.sort is not stable, so the order of
the rows within one expert in x_g differs from init_routing's stable order. Every row is
computed alone and put back by the same permutation, so the block's output is the same;
the intermediate tensors are not, and a rewrite of only one side would mix tokens.
"""
import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import (MOVES, RESHAPES, FinishOptions, Form, FusionPass, Recognized, enclosed_region,
                                   hcom_of, is_call, is_cast, is_training_graph, no_communicator_reason, plain_cast,
                                   tensor_meta)
from npu_fx_fusion.patterns.grouped_matmul import gemm_limits_reason

aten = torch.ops.aten
npu = torch.ops.npu
INIT = CAPABILITIES["npu.npu_moe_init_routing_v2"]
FINALIZE = CAPABILITIES["npu.npu_moe_finalize_routing"]


# ---- the routing both forms emit --------------------------------------------------------
def _init_routing(x, ids, num_experts, row_idx_type=0):
    """Every token-expert pair active, sorted by expert: (x_g, row_idx, counts, _).

    active_expert_range is spelled out ([0, E), all experts): torchair 2.13's GE converter
    passes it on to the IR as a list and fails on the schema's empty default
    (tests/test_torchair_backend.py lowers this call). row_idx_type 0 is the map
    src -> dst finalize reads, 1 its inverse dst -> src (the sort's own permutation).
    """
    tokens, top_k = ids.shape
    return torch.ops.npu.npu_moe_init_routing_v2(
        x, ids.to(torch.int32), active_num=_every_row(tokens * top_k), expert_num=num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
        row_idx_type=row_idx_type)


def _every_row(rows):
    """active_num for every one of the N*K rows.

    A static N*K is spelled out, as the aclnnMoeInitRoutingV3 doc asks ("unused, must equal
    NUM_ROWS*K"). A symbolic one (dynamic shapes) cannot be: active_num is an `int`
    attribute of the schema, and a SymInt passed there is specialised, a guard
    `N*K == <this compile's value>` that recompiles the model at every other token count.
    There -1: the kernel's tiling checks active_num == N*K only when it is not -1 and
    takes -1 as every row (ops-transformer moe_init_routing_v3_tiling.cpp, CheckAttr /
    CheckInputShape; torch_npu's docstring: "-1 and 0 both process all tokens"), and the
    meta function gives N*K rows for it."""
    return rows if isinstance(rows, int) else -1


def _finalize(y, weights, row_idx, ids):
    """The weighted sum over each token's k rows, token-major (mode 2) as init_routing wrote them."""
    # the model weights y in the promoted dtype (DeepSeek: bf16 rows, fp32 weights)
    dtype = torch.promote_types(y.dtype, weights.dtype)
    return torch.ops.npu.npu_moe_finalize_routing(y.to(dtype), None, None, None, weights.to(dtype),
                                                  row_idx, ids.to(torch.int32), drop_pad_mode=2)


# ---- the expert computations the block may contain ----------------------------------------
def _swiglu_unfused(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _swiglu_fused(h):  # the swiglu pass runs before this one
    return torch.ops.npu.npu_swiglu(h, -1)


def _grouped_mm(x, w, offs):
    return torch._grouped_mm(x, w, offs)


def _grouped_mm_fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


# ---- the unfused form ---------------------------------------------------------------------
def _transformers_block(gemm, act):
    def search(x, ids, weights, w_gate_up, w_down, num_experts):
        top_k, tokens, hidden = ids.size(-1), x.size(0), x.size(-1)
        sample_weights = weights.reshape(-1)
        expert_ids_g, perm = torch.sort(ids.reshape(-1))
        x_g = x[perm // top_k]
        w_g = sample_weights[perm]
        counts = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        weighted = y * w_g.unsqueeze(-1)
        inv = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        return weighted[inv].view(tokens, top_k, hidden).sum(dim=1)

    def replace(x, ids, weights, w_gate_up, w_down, num_experts):
        x_g, row_idx, counts, _ = _init_routing(x, ids, num_experts)
        offsets = counts.cumsum(0).to(torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        return _finalize(y, weights, row_idx, ids)

    def replace_trainable(x, ids, weights, w_gate_up, w_down, num_experts):
        # permute's stable order instead of the model's unstable sort: the same rows per
        # expert in another order, each computed alone, so the block's output and its
        # gradients are the same; the offsets as the model counts them
        x_g, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, ids)
        counts = torch.histc(ids.reshape(-1).float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        dtype = torch.promote_types(y.dtype, weights.dtype)  # as the model weights its rows
        return torch.ops.npu.npu_moe_token_unpermute(y.to(dtype), src_to_dst, weights.to(dtype))

    gemm_name = "grouped_mm" if gemm is _grouped_mm else "grouped_mm_fallback"
    act_name = "npu_swiglu" if act is _swiglu_fused else "silu_mul"
    search.__name__ = f"transformers_{gemm_name}_experts_{act_name}"
    replace.__name__ = f"init_routing_finalize_{gemm_name}_{act_name}"
    replace_trainable.__name__ = f"token_permute_unpermute_{gemm_name}_{act_name}"
    return search, replace, replace_trainable


def _v4_clamped_swiglu(h, swiglu_limit, swiglu_min):
    # transformers DeepseekV4Experts._apply_gate (the grouped_mm / batched_mm experts call it):
    # the gate capped at the limit, up clamped to [swiglu_min, limit] (transformers: min = -limit)
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=swiglu_min, max=swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def _deepseek_v4_block(gemm):
    """transformers' grouped_mm experts block around DeepSeek-V4's clamped SwiGLU: the same
    routing as _transformers_block, the activation's two clamp limits captured and replayed as
    they are (any pair: the replacement keeps the activation; the swiglu_group pass, which needs
    [-limit, limit], fuses it with the routed score inside the fused block)."""

    def search(x, ids, weights, w_gate_up, w_down, num_experts, swiglu_limit, swiglu_min):
        top_k, tokens, hidden = ids.size(-1), x.size(0), x.size(-1)
        sample_weights = weights.reshape(-1)
        expert_ids_g, perm = torch.sort(ids.reshape(-1))
        x_g = x[perm // top_k]
        w_g = sample_weights[perm]
        counts = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(_v4_clamped_swiglu(gemm(x_g, w_gate_up, offsets), swiglu_limit, swiglu_min), w_down, offsets)
        weighted = y * w_g.unsqueeze(-1)
        inv = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        return weighted[inv].view(tokens, top_k, hidden).sum(dim=1)

    def replace(x, ids, weights, w_gate_up, w_down, num_experts, swiglu_limit, swiglu_min):
        x_g, row_idx, counts, _ = _init_routing(x, ids, num_experts)
        offsets = counts.cumsum(0).to(torch.int32)
        y = gemm(_v4_clamped_swiglu(gemm(x_g, w_gate_up, offsets), swiglu_limit, swiglu_min), w_down, offsets)
        return _finalize(y, weights, row_idx, ids)

    def replace_trainable(x, ids, weights, w_gate_up, w_down, num_experts, swiglu_limit, swiglu_min):
        x_g, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, ids)
        counts = torch.histc(ids.reshape(-1).float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(_v4_clamped_swiglu(gemm(x_g, w_gate_up, offsets), swiglu_limit, swiglu_min), w_down, offsets)
        dtype = torch.promote_types(y.dtype, weights.dtype)
        return torch.ops.npu.npu_moe_token_unpermute(y.to(dtype), src_to_dst, weights.to(dtype))

    gemm_name = "grouped_mm" if gemm is _grouped_mm else "grouped_mm_fallback"
    search.__name__ = f"transformers_{gemm_name}_experts_deepseek_v4_clamped_swiglu"
    replace.__name__ = f"init_routing_finalize_{gemm_name}_clamped_swiglu"
    replace_trainable.__name__ = f"token_permute_unpermute_{gemm_name}_clamped_swiglu"
    return search, replace, replace_trainable


def _transformers_batched_block(act):
    """transformers' batched_mm experts: each token repeated k times, a weight gathered per
    (token, expert) pair and a bmm, no sort at all. The weights are the parameters as
    transformers stores them, (E, out, in). The fused block is the same routing;
    its grouped GEMMs are emitted here directly, as there is no grouped GEMM to keep."""

    def search(x, ids, weights, gate_up_proj, down_proj):
        top_k, tokens, hidden = ids.size(-1), x.size(0), x.size(-1)
        selected = x.repeat_interleave(top_k, dim=0)
        sample_weights = weights.reshape(-1)
        expert_ids = ids.reshape(-1)
        h = torch.bmm(gate_up_proj[expert_ids], selected.unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(down_proj[expert_ids], act(h).unsqueeze(-1)).squeeze(-1)
        return (y * sample_weights.unsqueeze(-1)).view(tokens, top_k, hidden).sum(dim=1)

    def replace(x, ids, weights, gate_up_proj, down_proj):
        x_g, row_idx, counts, _ = _init_routing(x, ids, gate_up_proj.shape[0])

        def gemm(rows, w):  # w is (E, out, in): the transposed view is the op's (E, in, out)
            return torch.ops.npu.npu_grouped_matmul([rows], [w.transpose(-2, -1)], group_list=counts,
                                                    split_item=3, group_type=0, group_list_type=1)[0]

        y = gemm(act(gemm(x_g, gate_up_proj)), down_proj)
        return _finalize(y, weights, row_idx, ids)

    act_name = "npu_swiglu" if act is _swiglu_fused else "silu_mul"
    search.__name__ = f"transformers_batched_mm_experts_{act_name}"
    replace.__name__ = f"init_routing_grouped_matmul_finalize_{act_name}"
    return search, replace


def _torchtitan_experts(routed, w1, w2, w3, counts):
    """torchtitan's GroupedExperts on the expert-sorted rows: w1, w3, w2 as bf16 grouped GEMMs
    on the offsets of the model's own per-expert counts (the same in every form)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(routed.bfloat16(), w1.bfloat16().transpose(-2, -1),
                                                   offs=offsets))
    h = h * torch._grouped_mm(routed.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets)


def _torchtitan_block():
    """torchtitan's LocalTokenDispatcher around its GroupedExperts (models/common/moe.py,
    token_dispatcher.py): a stable argsort of the flat expert ids, the gather, offsets from
    the routing map's counts, w1/w3/w2 as three bf16 grouped GEMMs, and the combine that
    weights each row in fp32 and scatter-adds it back to its token.

    The stable argsort orders the rows exactly as init_routing_v2 does (by expert, then by
    flat position), so the experts see the same rows in the same order; the counts and
    offsets are the model's own. Only the combine's additions change order: finalize adds
    each token's k rows in k order, scatter_add in row order, and it sums in fp32 before
    the one rounding to the model's dtype, where torchtitan rounds each weighted row first.
    """

    def search(x, ids, weights, w1, w2, w3, counts):
        top_k = ids.size(-1)
        perm = torch.argsort(ids.view(-1), stable=True)
        weights_sorted = weights.view(-1)[perm]
        token = perm // top_k
        routed = x[token]
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        out = torch.zeros_like(x)
        y = (y.to(torch.float32) * weights_sorted.reshape(-1, 1)).to(y.dtype)
        index = token.reshape(-1, 1).expand(-1, x.shape[-1])
        return torch.ops.torchtitan.deterministic_scatter_add(out, index, y)

    def replace(x, ids, weights, w1, w2, w3, counts):
        routed, row_idx, _, _ = _init_routing(x, ids, counts.shape[0])
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        return _finalize(y, weights, row_idx, ids).to(x.dtype)

    def replace_trainable(x, ids, weights, w1, w2, w3, counts):
        # the same rows (permute's sort is stable as well), src_to_dst its inverse map
        routed, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, ids)
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        return torch.ops.npu.npu_moe_token_unpermute(y, src_to_dst, weights)

    search.__name__ = "torchtitan_local_dispatch_grouped_experts"
    replace.__name__ = "init_routing_grouped_mm_finalize"
    replace_trainable.__name__ = "token_permute_grouped_mm_unpermute"
    return search, replace, replace_trainable


_BATCHED_FORMS = []
for _act in (_swiglu_fused, _swiglu_unfused):
    _search, _replace = _transformers_batched_block(_act)
    _BATCHED_FORMS.append(Form(_search, _replace, dtypes=(torch.float32,), fused_op="npu.npu_moe_init_routing_v2"))


def forms():
    """transformers' fp32 experts use its fallback op, torchtitan's combine its scatter-add
    op: those forms exist once the library that defines the op is imported."""
    gemms = [(_grouped_mm, torch.bfloat16)]
    if interop.transformers_grouped_mm_fallback() is not None:
        gemms.append((_grouped_mm_fallback, torch.float32))
    grouped = [form for gemm, _ in gemms for act in (_swiglu_fused, _swiglu_unfused, _v4_clamped_swiglu)
               for form in _FORMS[(gemm, act)]]
    # the expert-parallel forms after the local block's (a local graph never matches them;
    # the local block form, tried first, never matches an EP graph)
    torchtitan = ([_TORCHTITAN_FORM, _TORCHTITAN_TRAINABLE_FORM, *_EP_FORMS]
                  if interop.torchtitan_deterministic_scatter_add() is not None else [])
    return grouped + _BATCHED_FORMS + torchtitan


# Training: init_routing / finalize have no backward; npu_moe_token_permute / unpermute do
# (the same index conventions: a stable sort, its inverse map), so on the joint graph a
# block becomes those, forward and backward. In inference the init_routing form comes first.
_FORMS = {}
for _gemm, _dtype in ((_grouped_mm, torch.bfloat16), (_grouped_mm_fallback, torch.float32)):
    for _act in (_swiglu_fused, _swiglu_unfused):
        _search, _replace, _replace_trainable = _transformers_block(_gemm, _act)
        _FORMS[(_gemm, _act)] = (
            Form(_search, _replace, dtypes=(_dtype,), fused_op="npu.npu_moe_init_routing_v2"),
            Form(_search, _replace_trainable, dtypes=(_dtype,), fused_op="npu.npu_moe_token_permute",
                 grad_subsets=(("x", "weights", "w_gate_up", "w_down"),)))


for _gemm, _dtype in ((_grouped_mm, torch.bfloat16), (_grouped_mm_fallback, torch.float32)):
    _search, _replace, _replace_trainable = _deepseek_v4_block(_gemm)
    _FORMS[(_gemm, _v4_clamped_swiglu)] = (
        Form(_search, _replace, dtypes=(_dtype,), fused_op="npu.npu_moe_init_routing_v2"),
        Form(_search, _replace_trainable, dtypes=(_dtype,), fused_op="npu.npu_moe_token_permute",
             grad_subsets=(("x", "weights", "w_gate_up", "w_down"),)))


_search, _replace, _replace_trainable = _torchtitan_block()
_TORCHTITAN_FORM = Form(_search, _replace, dtypes=(torch.float32, torch.bfloat16),
                        fused_op="npu.npu_moe_init_routing_v2")
# Training: permute / unpermute, as for transformers' blocks above.
_TORCHTITAN_TRAINABLE_FORM = Form(_search, _replace_trainable, dtypes=(torch.float32, torch.bfloat16),
                                  fused_op="npu.npu_moe_token_permute",
                                  grad_subsets=(("x", "weights", "w1", "w2", "w3"),))


# =============================================================================================
# Expert parallel: torchtitan's AllToAllTokenDispatcher (docs/expert-parallel.md)
# =============================================================================================
# With experts sharded over an EP group, torchtitan 0.3.0's dispatcher splits the block at
# its collectives (models/common/token_dispatcher.py):
#
#   _local_reorder            stable argsort of the flat expert ids, gather x[perm // K]
#   count exchange            all_to_all_single(counts.view(ranks, -1)), then .tolist() of
#                             the row sums: the token exchange's split sizes
#   token exchange            all_to_all_single(routed, output_splits, input_splits)
#   _permute                  rank-major received rows -> expert-major (for the GEMMs)
#   GroupedExperts            three grouped GEMMs on the re-routed counts' offsets
#   _unpermute                out[permuted_indices] = y (stays: one scatter)
#   reverse exchange          all_to_all_single(out, input_splits, output_splits)
#   combine                   fp32 weights times rows, scatter-add back to the tokens
#
# None of it can be one pattern: a replacement is inserted at one point of the graph, and
# the collectives sit between its two ends. So each side is a form of its own, each exact
# on its own, and the collectives stay as they are (gloo on CPU, HCCL on an NPU):
#
#   _local_reorder  -> npu_moe_init_routing_v2(row_idx_type=1)   before the exchange
#   _permute        -> npu_moe_re_routing(rows, counts.view(ranks, -1))   after it
#   the GEMMs       -> npu_grouped_matmul (grouped_matmul, which runs later)
#   combine         -> npu_moe_finalize_routing                  after the reverse one
#
# In training, npu_moe_token_permute and npu_moe_token_unpermute instead of init_routing /
# finalize; re_routing goes through our own autograd rule everywhere (ReRouting, whose
# backward is npu_moe_token_unpermute, as torchtitan-npu's NPUMoeReRouting).
def _torchtitan_ep_local_reorder():
    """_local_reorder in front of the token exchange, with the routing map the counts come from.

    torchtitan's MoE.forward counts the tokens per expert from the one-hot routing map
    (zeros_like(scores).scatter(-1, ids, True).sum over batch and sequence) and its
    dispatcher sorts the flat (T*K) expert ids stably. init_routing_v2 sorts them the same
    way (by expert, then flat position) and gathers x[perm // K] itself; with
    row_idx_type=1 its row index is that very permutation (dst row -> flat position), from
    which the combine's token index and score order follow as the model computes them.
    The routing map is part of the form only because it tells the expert count E that
    init_routing_v2 needs (its expert range); it is kept as the model wrote it.
    """

    def routing_map_counts(expert_ids, router_scores):
        return torch.zeros_like(router_scores, dtype=torch.bool).scatter(-1, expert_ids, True).sum(dim=(0, 1))

    def search(x, expert_ids, router_scores):
        tokens, top_k = x.shape[0], expert_ids.shape[-1]
        counts = routing_map_counts(expert_ids, router_scores)
        perm = torch.argsort(expert_ids.view(tokens, top_k).view(-1), stable=True)
        token = perm // top_k
        return counts, x[token], token, perm

    def replace(x, expert_ids, router_scores):
        tokens, top_k = x.shape[0], expert_ids.shape[-1]
        routed, order, _, _ = _init_routing(x, expert_ids.view(tokens, top_k), router_scores.shape[-1],
                                            row_idx_type=1)
        perm = order.to(torch.int64)
        return routing_map_counts(expert_ids, router_scores), routed, perm // top_k, perm

    def replace_trainable(x, expert_ids, router_scores):
        # permute's sort is stable too; its index is the inverse map (src -> dst)
        tokens, top_k = x.shape[0], expert_ids.shape[-1]
        routed, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, expert_ids.view(tokens, top_k))
        perm = _inverse_permutation(src_to_dst.to(torch.int64))
        return routing_map_counts(expert_ids, router_scores), routed, perm // top_k, perm

    search.__name__ = "torchtitan_ep_local_reorder"
    replace.__name__ = "init_routing_v2_before_the_token_all_to_all"
    replace_trainable.__name__ = "token_permute_before_the_token_all_to_all"
    return search, replace, replace_trainable


def _inverse_permutation(perm):
    """inv[perm[i]] = i: a scatter, no sort."""
    return torch.empty_like(perm).index_put((perm,), torch.arange(perm.shape[0], device=perm.device))


class ReRouting(torch.autograd.Function):
    """npu_moe_re_routing with a backward made of npu_moe_token_unpermute (torch_npu has none:
    capabilities.py records this class as the op's autograd_rule).

    forward(tokens (A, H), counts (ranks, local experts)) -> (rows expert-major, gather index
    int32, tokens per local expert); backward: the rows go back where they came from,
    grad_tokens[idx[i]] = grad[i], i.e. npu_moe_token_unpermute(grad, restore) with restore
    the inverse of idx (input row -> output row). torchtitan-npu's NPUMoeReRouting does the
    same (converters/kernels/permutation.py), building restore with an argsort of idx; here
    it is a scatter of arange, the same index.
    """

    @staticmethod
    def forward(ctx, tokens, counts):
        permuted, _, idx, per_expert = torch.ops.npu.npu_moe_re_routing(tokens, counts)
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(idx, per_expert)
        return permuted, idx, per_expert

    @staticmethod
    def backward(ctx, grad, grad_idx, grad_counts):
        (idx,) = ctx.saved_tensors
        restore = _inverse_permutation(idx.to(torch.int64)).to(torch.int32)
        return torch.ops.npu.npu_moe_token_unpermute(grad.contiguous(), restore, None), None


def _torchtitan_ep_permute():
    """AllToAllTokenDispatcher._permute on the received tokens and the flat received counts
    (ranks * local experts, rank-major), verbatim. npu_moe_re_routing computes exactly this
    (tests/test_npu_ops_moe.py: bit-identical, zero counts included): the rows expert-major,
    the gather index (int32; torchtitan's is int64, which _unpermute reads), the tokens per
    local expert (the grouped GEMMs' counts)."""

    def search(received, received_counts, ranks):
        experts = received_counts.shape[0] // ranks
        total = received.shape[0]
        per_rank = received_counts.view(ranks, experts)
        input_starts = (received_counts.cumsum(0) - received_counts).view(ranks, experts)
        segment_lens = per_rank.t().reshape(-1)
        input_starts = input_starts.t().reshape(-1)
        seg_ids = torch.arange(segment_lens.shape[0], device=received.device).repeat_interleave(
            segment_lens, output_size=total)
        output_starts = segment_lens.cumsum(0) - segment_lens
        permuted_indices = (input_starts[seg_ids] + torch.arange(seg_ids.shape[0], device=received.device)
                            - output_starts[seg_ids])
        return received[permuted_indices, :], permuted_indices, per_rank.sum(0)

    def replace(received, received_counts, ranks):
        # through our autograd rule in every graph: in inference it is the op alone
        permuted, idx, per_expert = ReRouting.apply(received, received_counts.view(ranks, -1))
        return permuted, idx.to(torch.int64), per_expert

    search.__name__ = "torchtitan_ep_permute"
    replace.__name__ = "re_routing_after_the_token_all_to_all"
    return search, replace


def _torchtitan_ep_combine():
    """The combine after the reverse exchange: the expert outputs come back in the order of
    the local sort (perm), are weighted in fp32 by the scores in that order, rounded, and
    scatter-added to their tokens (perm // K). finalize_routing computes each token's
    weighted sum of its k rows from the map src -> dst, the inverse of perm; as for the
    local block, it adds the k products in fp32 and rounds once (torchtitan rounds each
    weighted row, then adds in the model's dtype)."""

    def search(expert_out, x, perm, token, weights):
        scores = weights.view(-1)[perm]
        out = torch.zeros_like(x)
        rows = (expert_out.to(torch.float32) * scores.reshape(-1, 1)).to(expert_out.dtype)
        index = token.reshape(-1, 1).expand(-1, out.shape[-1])
        return torch.ops.torchtitan.deterministic_scatter_add(out, index, rows)

    def replace(expert_out, x, perm, token, weights):
        src_to_dst = _inverse_permutation(perm).to(torch.int32)
        dtype = torch.promote_types(expert_out.dtype, weights.dtype)
        out = torch.ops.npu.npu_moe_finalize_routing(expert_out.to(dtype), None, None, None, weights.to(dtype),
                                                     src_to_dst, None, drop_pad_mode=2)
        return out.to(x.dtype)

    def replace_trainable(expert_out, x, perm, token, weights):
        src_to_dst = _inverse_permutation(perm).to(torch.int32)
        return torch.ops.npu.npu_moe_token_unpermute(expert_out, src_to_dst, weights).to(x.dtype)

    search.__name__ = "torchtitan_ep_combine"
    replace.__name__ = "finalize_routing_after_the_reverse_all_to_all"
    replace_trainable.__name__ = "token_unpermute_after_the_reverse_all_to_all"
    return search, replace, replace_trainable


def _ep_forms():
    reorder, permute, combine = (_torchtitan_ep_local_reorder(), _torchtitan_ep_permute(),
                                 _torchtitan_ep_combine())
    both = (torch.float32, torch.bfloat16)
    return [
        Form(reorder[0], reorder[1], dtypes=both, fused_op="npu.npu_moe_init_routing_v2"),
        Form(reorder[0], reorder[2], dtypes=both, fused_op="npu.npu_moe_token_permute",
             grad_subsets=(("x",),)),
        # the received rows are exchanged in the model's dtype (the op: fp16/bf16/int8); one
        # form for inference and training (ReRouting: our backward, npu_moe_token_unpermute)
        Form(permute[0], permute[1], dtypes=(torch.bfloat16,), fused_op="npu.npu_moe_re_routing",
             grad_subsets=(("received",),)),
        Form(combine[0], combine[1], dtypes=both, fused_op="npu.npu_moe_finalize_routing"),
        Form(combine[0], combine[2], dtypes=both, fused_op="npu.npu_moe_token_unpermute",
             grad_subsets=(("expert_out", "weights"),)),
    ]


_EP_FORMS = _ep_forms()


# ---- checks -------------------------------------------------------------------------------
def check(site):
    if "mc2_layer" in site.args:
        return _mc2_check(site)
    if "received" in site.args:
        return _ep_permute_check(site)
    if "router_scores" in site.args:
        return _ep_local_reorder_check(site)
    if "expert_out" in site.args:
        return _ep_combine_check(site)
    x, ids, weights = site["x"], site["ids"], site["weights"]
    experts = _expert_count(site.args)
    ops = (("npu.npu_moe_token_permute", "npu.npu_moe_token_unpermute")
           if site.form.fused_op == "npu.npu_moe_token_permute"
           else ("npu.npu_moe_init_routing_v2", "npu.npu_moe_finalize_routing"))
    reason = next(filter(None, (unsupported(op, site.soc, x=x) for op in ops)), None)
    if reason:
        return reason
    if "gate_up_proj" in site.args:  # the batched forms emit the grouped GEMMs themselves
        reason = _batched_gemm_reason(site, experts)
        if reason:
            return reason
    if ids.dim() != 2 or weights.shape != ids.shape:
        return f"top-k ids {list(ids.shape)} and weights {list(weights.shape)} are not one (T, K) pair"
    if ids.dtype not in (torch.int32, torch.int64):
        return f"expert ids are {ids.dtype}"
    if experts > INIT.limits["max_expert_num"]:
        return f"{experts} experts: npu_moe_init_routing_v2 takes at most {INIT.limits['max_expert_num']}"
    return None


def _expert_count(args):
    if "num_experts" in args:
        return args["num_experts"]
    return (args["gate_up_proj"] if "gate_up_proj" in args else args["w1"]).shape[0]


def _batched_gemm_reason(site, experts):
    """The limits of the two grouped GEMMs the batched forms emit ((E, out, in) weights)."""
    x, gate_up, down = site["x"], site["gate_up_proj"], site["down_proj"]
    return (gemm_limits_reason(site.soc, x, experts, gate_up.shape[2], gate_up.shape[1])
            or gemm_limits_reason(site.soc, x, experts, down.shape[2], down.shape[1]))


# ---- expert parallel: the graph facts the checks prove ----------------------------------------
RE_ROUTING = CAPABILITIES["npu.npu_moe_re_routing"]
_WAIT = "_c10d_functional::wait_tensor"
_FUNCTIONAL_ALL_TO_ALL = "_c10d_functional::all_to_all_single"
# torchair's spelling: its default decompositions (torchair._utils.get_npu_default_decompositions)
# turn the functional collective into this op during aot tracing, so a torchair graph holds it
# (GE converter experimental/hcom_alltoall.py): its counts are in elements, rows * row size
_TORCHAIR_ALL_TO_ALL = "npu_define::all_to_all_single_npu"


@dataclass(frozen=True)
class AllToAll:
    """One all_to_all_single in either spelling: rows sent / received per rank (None: equal
    splits), and the group it runs on."""

    node: torch.fx.Node
    input: torch.fx.Node
    output_splits: Optional[list]  # per source rank, as graph values (nodes or ints), in ...
    input_splits: Optional[list]  # ... (and per destination rank) units of row_size elements:
    row_size: int  # 1 for the functional spelling (splits in rows), H for torchair's (elements)
    group: tuple  # ("name", group_name) or ("ranks", tag, ranks): equal for one group
    group_size: Optional[int]


def all_to_all_of(node) -> Optional[AllToAll]:
    """The all-to-all `node` is the output of (through wait_tensor), or None."""
    while _schema_name(node) == _WAIT:
        node = node.args[0]
    schema = getattr(getattr(node, "target", None), "_schema", None)
    if not isinstance(node, torch.fx.Node) or schema is None:
        return None
    if schema.name == _FUNCTIONAL_ALL_TO_ALL:
        source, output_splits, input_splits, group_name = node.args[:4]
        return AllToAll(node, source, output_splits, input_splits, 1, ("name", group_name),
                        _group_size(group_name))
    if schema.name == _TORCHAIR_ALL_TO_ALL:
        source, send_counts, _, recv_counts, _, tag, ranks, group_size = node.args[:8]
        meta = tensor_meta(source)
        row = 1 if meta is None or meta.dim() < 2 else int(math.prod(meta.shape[1:]))
        return AllToAll(node, source, recv_counts, send_counts, row, ("ranks", tag, tuple(ranks)), group_size)
    return None


def _schema_name(node) -> Optional[str]:
    """"namespace::op" of a call node (matched by name: torch builds without distributed lack
    the collectives, and torchair's op exists only once torchair is imported)."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    return schema.name if isinstance(node, torch.fx.Node) and schema is not None else None


def _group_size(group_name) -> Optional[int]:
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(group_name).size()  # noqa: SLF001
    except Exception:  # noqa: BLE001 - no such group in this process
        return None


def _group_backend(exchange: AllToAll) -> Optional[str]:
    """gloo / hccl / fake ... of the group, None when it cannot be resolved here."""
    try:
        if exchange.group[0] == "name":
            group = torch.distributed.distributed_c10d._resolve_process_group(exchange.group[1])  # noqa: SLF001
        else:
            group = torch.distributed.distributed_c10d._find_pg_by_ranks_and_tag(  # noqa: SLF001
                exchange.group[1], list(exchange.group[2]))
        return torch.distributed.get_backend(group)
    except Exception:  # noqa: BLE001
        return None


def _viewed(node):
    """The tensor `node` is a view of (through view / reshape), or node itself: the same
    elements in the same order."""
    while is_call(node, *RESHAPES):
        node = node.args[0]
    return node


def _received_counts_reason(received_counts, ranks):
    """None if the counts are the (ranks, local experts) counts a count all-to-all received
    on a group of `ranks` ranks (flattened rank-major, as torchtitan reads them); else why
    not. Returns (reason, the count exchange)."""
    if _viewed(received_counts) is received_counts:
        return "the counts are not a view of a count all-to-all's output", None
    exchange = all_to_all_of(_viewed(received_counts))
    if exchange is None:
        return "the counts are not what an all-to-all received: not an expert-parallel dispatch", None
    sent = tensor_meta(exchange.input)
    if sent is None or sent.dim() != 2 or sent.shape[0] != ranks:
        return (f"the count all-to-all sends {list(sent.shape) if sent is not None else '?'}, not the "
                f"({ranks}, local experts) view of the counts the regroup reads"), exchange
    # one row of local-expert counts to and from each rank: [1] * ranks in rows, or in
    # torchair's element counts [local experts] * ranks
    equal = [exchange.row_size] * ranks
    for splits in (exchange.output_splits, exchange.input_splits):
        if splits is not None and list(splits) != equal:
            return f"the count all-to-all splits {list(splits)}: not one row of counts per rank", exchange
    if exchange.group_size is not None and exchange.group_size != ranks:
        return (f"the count all-to-all runs on {exchange.group_size} ranks, the regroup reads "
                f"{ranks} rows of counts"), exchange
    return None, exchange


def _split_row(split, row_size):
    """(row index, the (ranks, experts) count matrix) if `split` is `row_size` times the
    i-th row sum of a count matrix, read as torchtitan reads it (.view(ranks, -1).sum(1)
    .to(cpu).tolist()); else None."""
    if row_size != 1:  # torchair's element counts: split * H
        if not (is_call(split, operator.mul) and row_size in split.args):
            return None
        split = next(a for a in split.args if a != row_size)
    if not is_call(split, aten._local_scalar_dense.default):
        return None
    selected = split.args[0]
    if not (is_call(selected, aten.select.int) and selected.args[1] in (0, -1)):
        return None
    sums = selected.args[0]
    while is_call(sums, aten._to_copy.default) and set(sums.kwargs) <= {"device", "non_blocking", "dtype"}:
        sums = sums.args[0]  # .to(cpu) before .tolist(), on an NPU
    if not (is_call(sums, aten.sum.dim_IntList) and list(sums.args[1]) in ([1], [-1])):
        return None
    return selected.args[2], sums.args[0]


def _received_tokens_reason(received, received_counts, counts_exchange, ranks):
    """None if the tokens were received by an all-to-all on the counts' group whose split
    sizes are the row sums of exactly those received counts (rank r sent sum(counts[r, :])
    rows); else why not."""
    exchange = all_to_all_of(received)
    if exchange is None:
        return "the tokens regrouped are not an all-to-all's output"
    if exchange.group != counts_exchange.group:
        return f"the tokens and the counts were exchanged on different groups ({exchange.group}, {counts_exchange.group})"
    splits = exchange.output_splits
    if splits is None or len(splits) != ranks:
        return f"the token all-to-all receives {splits} rows, not one count per rank of {ranks}"
    per_rank = (ranks, tensor_meta(received_counts).shape[0] // ranks)
    for rank, split in enumerate(splits):
        found = _split_row(split, exchange.row_size)
        matrix = tensor_meta(found[1]) if found is not None else None
        if (found is None or found[0] != rank or matrix is None or tuple(matrix.shape) != per_rank
                or _viewed(found[1]) is not _viewed(received_counts)):
            return (f"the rows received from rank {rank} ({split}) are not the sum of row {rank} of the "
                    "received counts: the regroup's counts do not describe these tokens")
    return None


def _ep_permute_check(site):
    received, received_counts, ranks = site["received"], site["received_counts"], site["ranks"]
    reason = unsupported("npu.npu_moe_re_routing", site.soc, x=received)
    if reason:
        return reason
    if not received.shape[-1] < RE_ROUTING.limits["max_hidden"]:
        return f"hidden size {received.shape[-1]}: npu_moe_re_routing takes H < {RE_ROUTING.limits['max_hidden']}"
    if received_counts.dtype not in RE_ROUTING.limits["counts_dtypes"]:
        return f"the received counts are {received_counts.dtype}, the op takes int32 or int64"
    reason, counts_exchange = _received_counts_reason(site.arg_nodes["received_counts"], ranks)
    if reason:
        return reason
    reason = _received_tokens_reason(site.arg_nodes["received"], site.arg_nodes["received_counts"],
                                     counts_exchange, ranks)
    if reason:
        return reason
    # counts may be 0 (a rank sends no token to a local expert): the torch_npu doc says > 0,
    # the kernels copy nothing for them (npu_ops/moe.py, docs/expert-parallel.md)
    site.notes.append("zero counts: an empty (rank, expert) bucket is an empty copy in the kernels, "
                      "though the torch_npu doc asks for counts > 0")
    return None


def _ep_local_reorder_check(site):
    x, expert_ids, scores = site["x"], site["expert_ids"], site["router_scores"]
    ops = (("npu.npu_moe_token_permute",) if site.form.fused_op == "npu.npu_moe_token_permute"
           else ("npu.npu_moe_init_routing_v2",))
    reason = next(filter(None, (unsupported(op, site.soc, x=x) for op in ops)), None)
    if reason:
        return reason
    if expert_ids.is_floating_point() or expert_ids.dim() != 3 or scores.shape[:-1] != expert_ids.shape[:-1]:
        return f"expert ids {list(expert_ids.shape)} do not index the router's scores {list(scores.shape)}"
    experts = scores.shape[-1]
    if experts > INIT.limits["max_expert_num"]:
        return f"{experts} experts: npu_moe_init_routing_v2 takes at most {INIT.limits['max_expert_num']}"
    gathers = [n for n in site.nodes if is_call(n, aten.index.Tensor) and n.args[0] is site.arg_nodes["x"]]
    if not any(all_to_all_of(user) is not None for gather in gathers for user in gather.users):
        # a local block: it fuses whole (init_routing through finalize) or not at all
        return _not_a_known_block()
    return None


def _ep_combine_check(site):
    expert_out, x, weights = site["expert_out"], site["x"], site["weights"]
    op = ("npu.npu_moe_token_unpermute" if site.form.fused_op == "npu.npu_moe_token_unpermute"
          else "npu.npu_moe_finalize_routing")
    reason = unsupported(op, site.soc, x=expert_out)
    if reason:
        return reason
    if weights.dim() != 2 or x.dim() != 2 or x.shape[0] != weights.shape[0]:
        return f"scores {list(weights.shape)} are not one (T, K) row per token of x {list(x.shape)}"
    top_k = weights.shape[1]
    perm, token = site.arg_nodes["perm"], site.arg_nodes["token"]
    ids = _stable_expert_sort_of(perm)
    if ids is None:
        return "the rows' order is not a stable ascending sort of the flat expert ids (torchtitan's _local_reorder)"
    if tensor_meta(ids) is None or tensor_meta(ids).shape != weights.shape:
        return "the sorted expert ids are not (T, K) like the scores"
    if not (is_call(token, aten.floor_divide.default) and token.args[0] is perm and token.args[1] == top_k):
        return "the rows are scattered back to another token than perm // K"
    return None


def _stable_expert_sort_of(perm):
    """The (T, K) expert ids `perm` stably sorts (flattened), or None."""
    if not (is_call(perm, operator.getitem) and perm.args[1] == 1 and is_call(perm.args[0], aten.sort.stable)):
        return None
    sort = perm.args[0]
    flat = tensor_meta(sort.args[0])
    if (not sort.kwargs.get("stable", False) or sort.kwargs.get("descending", False) or len(sort.args) > 1
            or flat is None or flat.dim() != 1
            or not is_call(sort.args[0], aten.view.default, aten.reshape.default)):
        return None
    return sort.args[0].args[0]  # (T, K): the flattened view's source


# ---- near misses: a sort of flattened expert ids that no form consumed; in expert-parallel
# graphs also a gather of received tokens, a combine of returned rows, and the token exchange
# itself (MC2) ------------------------------------------------------------------------------
def anchor(node):
    return _sorts_expert_ids(node) or _ep_anchor(node) is not None


def _sorts_expert_ids(node):
    if not is_call(node, aten.sort.default, aten.sort.stable):
        return False
    ids = tensor_meta(node.args[0])
    return (ids is not None and ids.dim() == 1 and not ids.is_floating_point()
            and any(is_call(u2, aten.floor_divide.default, aten.div.Tensor_mode)
                    for u in node.users for u2 in u.users))


def _ep_anchor(node):
    """Which expert-parallel candidate `node` is ("regroup", "combine", "exchange"), or None."""
    if is_call(node, aten.index.Tensor) and all_to_all_of(node.args[0]) is not None:
        meta = tensor_meta(node.args[0])
        # a regroup computes its gather index from the counts (a repeat_interleave of the
        # buckets); a backward gathers gradients by a saved index (_unpermute's backward)
        computed = node.args[1] and _computed_from(node.args[1][0], aten.repeat_interleave.Tensor, 5)
        return "regroup" if meta is not None and meta.dim() == 2 and computed else None
    scatter_add = interop.torchtitan_deterministic_scatter_add()
    if scatter_add is not None and node.target is scatter_add and _returned_by_all_to_all(node.args[2]):
        return "combine"
    exchange = all_to_all_of(node) if _schema_name(node) != _WAIT else None
    if exchange is not None and exchange.output_splits is not None and _reordered_tokens(exchange.input):
        return "exchange"
    return None


def _computed_from(node, target, depth):
    """`node` is computed by a `target` call at most `depth` ops upstream."""
    if is_call(node, target):
        return True
    return depth > 0 and isinstance(node, torch.fx.Node) and any(
        _computed_from(a, target, depth - 1) for a in node.all_input_nodes)


def _returned_by_all_to_all(rows):
    """The rows are an all-to-all's output, through the casts and the score multiply."""
    for _ in range(6):
        if all_to_all_of(rows) is not None:
            return True
        if not is_call(rows, aten._to_copy.default, aten.mul.Tensor, npu._npu_dtype_cast.default):
            return False
        rows = rows.args[0]
    return False


def _reordered_tokens(node):
    """The local dispatch's rows: x[perm // K], or what a fused dispatch gathered."""
    if is_call(node, aten.index.Tensor):
        index = node.args[1][0] if node.args[1] else None
        return is_call(index, aten.floor_divide.default)
    return (is_call(node, operator.getitem) and node.args[1] == 0
            and is_call(node.args[0], npu.npu_moe_init_routing_v2, npu.npu_moe_token_permute))


def explain(node):
    kind = _ep_anchor(node) if not _sorts_expert_ids(node) else None
    if kind == "regroup":
        return ("tokens received by an all-to-all are gathered, but not by torchtitan's _permute "
                "(rank-major buckets to expert-major, from the received (ranks, local experts) "
                "counts), which becomes npu_moe_re_routing")
    if kind == "combine":
        return ("rows returned by an all-to-all are scatter-added to their tokens, but not as "
                "torchtitan's combine (rows in the local sort's order, times the scores in that "
                "order in fp32, to token perm // K), which becomes npu_moe_finalize_routing")
    if kind == "exchange":
        return mc2_reason(node)
    if kind is None and _gathered_rows_leave_the_graph(node):
        return ("the tokens are sorted by expert and gathered, but the gathered rows leave this graph: the "
                "experts and the combine run in another compiled graph (a graph break after the gather, e.g. "
                "torchtitan's for-loop experts reading the counts with .tolist()), and npu_moe_init_routing_v2 "
                "and npu_moe_finalize_routing replace the dispatch and the combine only together, in one graph. "
                "npu_moe_token_permute alone (torchtitan-npu's converter) hands its combine, "
                "npu_moe_token_unpermute, its own sorted_indices: a backend cannot change what one compiled graph "
                "hands the next (the model's argsort), so the permute would leave the sort in place and save nothing")
    return _not_a_known_block()


def _gathered_rows_leave_the_graph(sort):
    """x[perm // K] (perm: the sort's order), or a cast or view of it, is an output of the graph."""
    frontier = [user for order in sort.users for div in order.users
                for user in div.users if is_call(user, aten.index.Tensor)]
    seen = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op == "output":
                return True
            if is_cast(user) or is_call(user, *MOVES):
                frontier.append(user)
    return False


def _not_a_known_block():
    return ("the tokens are sorted by expert, but the code around it is neither transformers' "
            "grouped_mm experts block (sort, gather, histc offsets, two grouped GEMMs, the "
            "weighted inverse-permutation combine) nor torchtitan's local dispatcher (stable "
            "argsort, three grouped GEMMs, weighted scatter-add), which this pass rewrites "
            "whole, nor torchtitan's expert-parallel dispatch (the stable argsort's rows sent "
            "by an all-to-all); other dispatchers (Megatron's) are not handled in this version")


# =============================================================================================
# MC2: the whole expert-parallel dispatch and combine, on an EP group declared dedicated
# =============================================================================================
# npu_moe_distribute_dispatch_v2 / combine_v2 (MC2) fuse the communication too: the count
# exchange, the .tolist() sync, the token exchange and the regroup become one communicating
# kernel, the reverse exchange and the combine another. No form can spell that: dispatch_v2
# returns expand_x padded to a static row count (global_bs * min(local experts, K), the
# op's Meta) where the graph holds the rows the exchange received (a data-dependent count,
# from the .tolist() of the count exchange), so no point between the dispatch and the
# combine can take MC2's outputs. The region to replace runs from the local reorder through
# the expert GEMMs to the combine, with the count exchange, the syncs and their runtime
# asserts inside. It is found by walking the graph the forms above leave (init_routing_v2,
# re_routing, finalize_routing around the collectives), proved with the same facts the
# regroup's check proves, and replaced whole (matching.enclosed_region):
#
#   expand_x, _, assist, per_expert, recv_counts, _, _ = npu_moe_distribute_dispatch_v2(
#       x, expert_ids, group_ep, ranks, rank, experts)
#   y = <GroupedExperts' three grouped GEMMs on expand_x, offsets of per_expert>
#   out = npu_moe_distribute_combine_v2(y, expert_ids, assist, recv_counts, scores.float(), ...)
#
# expand_x holds the received rows local expert by local expert, source rank by source rank,
# each source's in its flat order: what _permute makes of them (npu_ops/moe_distribute.py);
# the GEMMs' offsets end at the received rows, the padding is never read back. combine_v2
# adds each token's k weighted rows in fp32 and rounds once, as finalize_routing does.
#
# Only on the group FusionConfig(ep_group=...) declares dedicated (the op requires an EP
# domain that carries no other operator, which no graph can prove), in inference, within
# the ops' documented limits; anywhere else the exchange is a near miss saying why.
MC2_DISPATCH = CAPABILITIES["npu.npu_moe_distribute_dispatch_v2"]
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class EPLayer:
    """One torchtitan AllToAllTokenDispatcher layer as the forms above leave it (inference)."""

    combine: torch.fx.Node  # npu_moe_finalize_routing of the rows the reverse exchange returned
    x: torch.fx.Node  # (T, H) tokens, init_routing_v2's input
    expert_ids: torch.fx.Node  # (T, K) int32
    scores: torch.fx.Node  # (T, K) the combine's weights
    w1: torch.fx.Node  # GroupedExperts' (local experts, F, H) w1 / w3, (local experts, H, F) w2
    w2: torch.fx.Node
    w3: torch.fx.Node
    routing_counts: torch.fx.Node  # the routing map's per-expert counts the count exchange sends
    exchange: AllToAll  # the token exchange
    ranks: int
    experts: int


def recognize(graph, joint):
    """Every EP layer MC2 could replace whole (inference graphs; on a joint graph: none)."""
    if joint:
        return []
    found = []
    for combine in graph.find_nodes(op="call_function", target=npu.npu_moe_finalize_routing.default):
        layer = read_ep_layer(combine)
        if layer is None:
            continue
        inputs = [layer.x, layer.expert_ids, layer.scores, layer.w1, layer.w2, layer.w3]
        nodes, escape = enclosed_region([combine], inputs, stops=[layer.routing_counts])
        reason = (f"{escape[0].name}, inside the expert-parallel dispatch, is also read by {escape[1].name}: "
                  "MC2 would replace the whole region" if escape else None)
        found.append(Recognized(
            name="torchtitan_ep_dispatch_to_combine", output=combine, nodes=nodes,
            args=dict(zip(("x", "expert_ids", "scores", "w1", "w2", "w3"), inputs)),
            replace=_mc2_replacement(layer) if reason is None else None, reason=reason,
            site_args={"mc2_layer": layer, "x": tensor_meta(layer.x), "expert_ids": tensor_meta(layer.expert_ids)},
            fused_op="npu.npu_moe_distribute_dispatch_v2"))
    return found


def _mc2_replacement(layer):
    out_dtype = tensor_meta(layer.combine).dtype

    def dispatch_v2_grouped_experts_combine_v2(x, expert_ids, scores, w1, w2, w3):
        # traced once the check accepted the group: a c10d name of this process
        group_name = layer.exchange.group[1]
        hcom = hcom_of(group_name)
        rank = torch.distributed.distributed_c10d._resolve_process_group(group_name).rank()  # noqa: SLF001
        ids = expert_ids.to(torch.int32)
        expand_x, _, assist, per_expert, recv_counts, _, _ = torch.ops.npu.npu_moe_distribute_dispatch_v2(
            x, ids, hcom, layer.ranks, rank, layer.experts)
        y = _torchtitan_experts(expand_x, w1, w2, w3, per_expert).to(x.dtype)
        out = torch.ops.npu.npu_moe_distribute_combine_v2(y, ids, assist, recv_counts, scores.to(torch.float32),
                                                          hcom, layer.ranks, rank, layer.experts)
        return out.to(out_dtype)

    return dispatch_v2_grouped_experts_combine_v2


# ---- reading the layer: the graph facts MC2 stands on ------------------------------------------
def read_ep_layer(combine):
    """The EPLayer whose combine `combine` is, or None where the graph does not prove it:
    the rows come back through a reverse exchange from torchtitan's _unpermute of the three
    GroupedExperts GEMMs on re_routing's rows; re_routing's counts and rows are what the count
    and token exchanges received, as the regroup's check proves; the count exchange sends the
    routing map's counts of the very expert ids init_routing_v2 sorted, the token exchange
    that sort's rows in splits of those counts, the reverse exchange the same splits back on
    the same group; the combine weights each token's rows in init_routing_v2's order."""
    returned = all_to_all_of(_strip_casts(combine.args[0]))  # cast to the scores' dtype (fp32)
    if returned is None or not is_call(returned.input, aten.index_put.default):
        return None
    buffer, indices, expert_out = returned.input.args[:3]
    re_routing = _output_of(_strip_casts(indices[0]), npu.npu_moe_re_routing.default, 2) if len(indices) == 1 else None
    if re_routing is None or returned.input.args[3:4] not in ((), (False,)):
        return None
    gemms = _grouped_experts(_strip_casts(expert_out), re_routing)
    received, counts_2d = re_routing.args[:2]
    ranks = tensor_meta(counts_2d).shape[0]
    flat_counts = counts_2d.args[0] if is_call(counts_2d, aten.view.default, aten.reshape.default) else counts_2d
    reason, count_exchange = _received_counts_reason(flat_counts, ranks)
    if (gemms is None or reason or _received_tokens_reason(received, flat_counts, count_exchange, ranks)
            or not isinstance(ranks, int)):
        return None
    exchange = all_to_all_of(received)
    init = _output_of(exchange.input, npu.npu_moe_init_routing_v2.default, 0)
    if init is None or init.kwargs.get("row_idx_type") != 1:
        return None
    routing_counts = _viewed(count_exchange.input)
    x, expert_ids = init.args[:2]
    if (_routing_map_ids(routing_counts) is not _viewed(_strip_casts(expert_ids))
            or not _splits_are_row_sums(exchange, routing_counts, ranks)
            or returned.group != exchange.group or list(returned.input_splits or ()) != list(exchange.output_splits)
            or list(returned.output_splits or ()) != list(exchange.input_splits)
            or not _reads_row_order_of(combine.args[5], init) or combine.args[6:8] != (None, 2)):
        return None
    experts = tensor_meta(routing_counts).shape[0]
    return EPLayer(combine, x, expert_ids, combine.args[4], *gemms, routing_counts, exchange, ranks, experts)


def _strip_casts(node):
    while is_call(node, aten._to_copy.default, npu._npu_dtype_cast.default):
        node = node.args[0]
    return node


def _output_of(node, target, index):
    """The `target` call whose output `index` node is, or None."""
    if is_call(node, operator.getitem) and node.args[1] == index and is_call(node.args[0], target):
        return node.args[0]
    return None


def _grouped_experts(out, re_routing):
    """(w1, w2, w3) if `out` is GroupedExperts on re_routing's rows (silu(x @ w1) * (x @ w3)) @ w2
    on the offsets of re_routing's per-expert counts; else None."""
    def gemm(node):
        if not is_call(node, aten._grouped_mm.default):
            return None
        rows, weight = node.args[:2]
        offsets = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
        if not (is_call(offsets, aten.cumsum.default) and offsets.kwargs.get("dtype") == torch.int32
                and _output_of(offsets.args[0], npu.npu_moe_re_routing.default, 3) is re_routing):
            return None
        while is_call(weight, aten.transpose.int, aten._to_copy.default):
            weight = weight.args[0]
        return _strip_casts(rows), weight

    down = gemm(out)
    if down is None or not is_call(down[0], aten.mul.Tensor):
        return None
    first, second = down[0].args[:2]
    if not is_call(first, aten.silu.default):
        first, second = second, first
    gate = gemm(first.args[0]) if is_call(first, aten.silu.default) else None
    up = gemm(second)
    rows = _output_of(gate[0], npu.npu_moe_re_routing.default, 0) if gate else None
    if rows is not re_routing or up is None or up[0] is not gate[0]:
        return None
    return gate[1], down[1], up[1]


def _routing_map_ids(counts):
    """The expert ids whose routing map `counts` counts per expert (torchtitan's MoE.forward:
    zeros_like(scores, bool).scatter(-1, ids, True).sum over tokens), or None."""
    if not is_call(counts, aten.sum.dim_IntList):
        return None
    routing_map = counts.args[0]
    if not (is_call(routing_map, aten.scatter.value) and routing_map.args[1] in (-1, 2) and routing_map.args[3] is True
            and is_call(routing_map.args[0], aten.zeros_like.default)):
        return None
    return _viewed(routing_map.args[2])


def _splits_are_row_sums(exchange, counts, ranks):
    """The token exchange sends rank r the sum of row r of counts.view(ranks, -1)."""
    splits = exchange.input_splits
    if splits is None or len(splits) != ranks:
        return False
    for rank, split in enumerate(splits):
        found = _split_row(split, exchange.row_size)
        if found is None or found[0] != rank or _viewed(found[1]) is not counts:
            return False
    return True


def _reads_row_order_of(node, init):
    """`node` is computed from init_routing_v2's row index (within a few ops: its inverse)."""
    row_index = next((u for u in init.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
    return row_index is not None and _reads(node, row_index, 5)


def _reads(node, source, depth):
    """`node` is `source` or computed from it, at most `depth` ops down."""
    if node is source:
        return True
    return depth > 0 and isinstance(node, torch.fx.Node) and any(
        _reads(a, source, depth - 1) for a in node.all_input_nodes)


# ---- the limits MC2 is used within -------------------------------------------------------------
def _mc2_check(site):
    layer = site["mc2_layer"]
    reasons = _group_reasons(layer.exchange, site.dedicated_groups)
    reasons += _mc2_limit_reasons(site, layer.exchange.node.graph, site["x"], site["expert_ids"].shape[-1],
                                  layer.ranks, layer.experts)
    return _mc2_refusal(reasons) if reasons else None


def _mc2_refusal(reasons):
    return ("npu_moe_distribute_dispatch_v2 / combine_v2 (MC2) would replace this whole dispatch and "
            "combine, but: " + "; ".join(reasons))


def _group_reasons(exchange, dedicated):
    if exchange.group[0] != "name":
        return [f"the exchange names its group by ranks {list(exchange.group[2])} (torchair's spelling), not by the "
                "c10d name FusionConfig(ep_group=...) declares"]
    name = exchange.group[1]
    if not dedicated:
        # the one condition no graph can prove: a graph shows its own collectives only
        return ["no EP group is declared dedicated (FusionConfig(ep_group=...)): a graph cannot prove that the EP "
                "group carries no other communication (other compiled graphs, eager code, FSDP on an overlapping "
                "group), which MC2 requires of it"]
    if name not in dedicated:
        return [f"the exchange runs on group {name!r}, not on the EP group declared dedicated "
                f"({', '.join(map(repr, sorted(dedicated)))})"]
    reason = no_communicator_reason(name)
    return [f"{reason}: group_ep must name an HCCL communicator"] if reason else []


def _mc2_limit_reasons(site, graph, x, top_k, ranks, experts):
    """The documented limits (capabilities: npu.npu_moe_distribute_dispatch_v2): inference,
    fp16 / bf16 tokens, K <= 16, experts, and per SoC the batch, hidden size and rank count.
    With a SoC given, its limits; in emulation (none) a SoC that takes the site is enough,
    and the others' limits become notes."""
    limits, reasons = MC2_DISPATCH.limits, []
    if is_training_graph(graph):
        reasons.append("this is a training graph: MC2 has no backward")
    if x.dtype not in HALF:
        reasons.append(f"the tokens are {x.dtype}: MC2 takes float16 / bfloat16")
    if not isinstance(top_k, int) or not 0 < top_k <= limits["max_top_k"]:
        reasons.append(f"top-{top_k} is outside MC2's 0 < K <= {limits['max_top_k']}")
    if experts > limits["max_moe_expert_num"] or experts % ranks:
        reasons.append(f"{experts} experts over {ranks} ranks: MC2 takes at most {limits['max_moe_expert_num']}, "
                       "evenly divided")
    tokens, hidden = x.shape[0], x.shape[-1]
    if not isinstance(tokens, int):
        reasons.append(f"the tokens per rank ({tokens}) are symbolic: MC2's batch limit cannot be checked")
    per_soc = {soc: _soc_reasons(soc, tokens, hidden, ranks, experts // ranks) for soc in limits["max_batch"]}
    socs = [site.soc] if site.soc is not None else list(per_soc)
    if site.soc is not None and site.soc not in per_soc:
        reasons.append(f"MC2 is not available on {site.soc}")
    elif all(per_soc[soc] for soc in socs):
        reasons += [reason for soc in socs for reason in per_soc[soc]]
    else:
        site.notes.extend(f"on an NPU: {reason}" for soc in socs for reason in per_soc[soc])
    return reasons


def _soc_reasons(soc, tokens, hidden, ranks, local_experts):
    limits, reasons = MC2_DISPATCH.limits, []
    if isinstance(tokens, int) and not 0 < tokens <= limits["max_batch"][soc]:
        reasons.append(f"{tokens} tokens per rank exceed MC2's batch limit on {soc} ({limits['max_batch'][soc]}): "
                       "a decode-sized batch only")
    low, high, multiple = limits["hidden"][soc]
    if isinstance(hidden, int) and not (low <= hidden <= high and hidden % multiple == 0):
        reasons.append(f"hidden size {hidden} is outside {soc}'s [{low}, {high}]"
                       + (f" in multiples of {multiple}" if multiple > 1 else ""))
    if ranks not in limits["world_sizes"][soc]:
        reasons.append(f"{ranks} EP ranks: MC2 on {soc} takes {_ranges(limits['world_sizes'][soc])}")
    if soc == "Ascend910B" and local_experts > limits["a2_max_local_experts"]:
        reasons.append(f"{local_experts} local experts: MC2 on {soc} takes at most {limits['a2_max_local_experts']}")
    if soc == "Ascend910B" and local_experts * ranks > limits["a2_max_moe_expert_num"]:
        reasons.append(f"{local_experts * ranks} experts: MC2 on {soc} takes at most {limits['a2_max_moe_expert_num']}")
    if soc == "Ascend910_93" and local_experts * ranks > limits["a3_max_experts_times_ranks"]:
        reasons.append(f"{local_experts} local experts on {ranks} ranks: MC2 on {soc} takes local experts * ranks "
                       f"<= {limits['a3_max_experts_times_ranks']}")
    return reasons


def _ranges(values):
    values = list(values)
    return f"[{values[0]}, {values[-1]}]" if values == list(range(values[0], values[-1] + 1)) else str(values)


def mc2_reason(exchange_node):
    """Why the token exchange `exchange_node` was not replaced with the rest of its layer by
    MC2, where no candidate region was found (a refused candidate says why itself)."""
    exchange = all_to_all_of(exchange_node)
    reasons = []
    if is_training_graph(exchange_node.graph):
        reasons.append("this is a training graph: MC2 has no backward")
    else:
        reasons.append("the layer around this exchange is not torchtitan's AllToAllTokenDispatcher as the forms "
                       "leave it (init_routing_v2 in front, re_routing and GroupedExperts' three grouped GEMMs "
                       "after it, _unpermute, the reverse exchange and finalize_routing), which MC2 replaces whole")
    reasons += _mc2_shape_reasons(exchange)
    reasons.append("MC2 is used only on an EP group declared dedicated (FusionConfig(ep_group=...))")
    return _mc2_refusal(reasons)


def _mc2_shape_reasons(exchange):
    """The top-k and dtype limits, read from the local dispatch in front of the exchange."""
    rows = exchange.input
    if is_call(rows, operator.getitem):  # a fused dispatch: its x and expert ids
        x, ids = (tensor_meta(a) for a in rows.args[0].args[:2])
        top_k = ids.shape[-1] if ids is not None else None
    else:
        x, divide = tensor_meta(rows.args[0]), rows.args[1][0]
        top_k = divide.args[1]
    reasons = []
    if isinstance(top_k, int) and top_k > MC2_DISPATCH.limits["max_top_k"]:
        reasons.append(f"top-{top_k} is above MC2's K <= {MC2_DISPATCH.limits['max_top_k']}")
    if x is not None and x.dtype not in HALF:
        reasons.append(f"the tokens are {x.dtype}: MC2 takes float16 / bfloat16")
    return reasons


# ---- after the sites are fused: the combine's own cast and add -----------------------------
# DeepSeek weights its bf16 expert rows with fp32 routing weights, sums in fp32 and rounds
# the sum to bf16, then adds the shared experts' output: `(sum).to(bf16) + shared`. The
# replacement keeps the promotion (fp32 rows in, an fp32 sum out), which costs a cast on
# each side of the call, and the add is a launch of its own. finalize does both itself:
# - bf16 rows with fp32 scales are its mixed-precision mode on A2 / A3 (ops-transformer
#   moe_finalize_routing_v2_def.cpp, the fourth dtype column; aclnnMoeFinalizeRoutingV2.md:
#   "混合精度模式下，支持 expandedX 为 BFLOAT16 时 scalesOptional 为 FLOAT32"). The kernel
#   computes a bf16 input in fp32 (the tiling's TRIPLE_BUFFER comment) and rounds the
#   output once to bf16: the same values as the two casts around an fp32 call;
# - out = skip1 + skip2 + sum: the add after it is skip1. V2 takes skip1 alone and refuses
#   skip2 without it (moe_finalize_routing_v2_tiling_membase.cpp: "In the case of x1
#   parameter is not input, x2 parameter can't be inputted either"); torch_npu calls V2 for
#   drop_pad_mode 2. In a half dtype the model rounds its sum before the add and the op
#   rounds once, after it: FusionConfig.keep_intermediate_rounding keeps the add apart.
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def combine_in_model_dtype(graph, options=FinishOptions()):
    """The casts around a finalize call its mixed-precision mode makes unneeded, and the add
    of a tensor to its output taken in as skip1. Returns a note per change."""
    notes = []
    for call in graph.find_nodes(op="call_function", target=npu.npu_moe_finalize_routing.default):
        note = _rows_in_their_own_dtype(graph, call)
        if note:
            notes.append(note)
        note = _added_tensor_as_skip(call, options.keep_intermediate_rounding)
        if note:
            notes.append(note)
    return notes


def _rows_in_their_own_dtype(graph, call):
    rows_dtype, scales_dtype = FINALIZE.limits["mixed_scales"]
    rows, skip1, skip2, bias, scales = call.args[:5]
    if not (plain_cast(rows, scales_dtype) and skip1 is None and skip2 is None and bias is None):
        return None
    source, weights = tensor_meta(rows.args[0]), tensor_meta(scales)
    if source is None or weights is None or (source.dtype, weights.dtype) != (rows_dtype, scales_dtype):
        return None
    casts = list(call.users)
    if not casts or not all(plain_cast(user, rows_dtype) for user in casts):
        return None  # someone reads the fp32 sum: it must stay fp32
    call.update_arg(0, rows.args[0])
    call.meta["val"] = tensor_meta(call).to(rows_dtype)
    for cast in casts:
        cast.replace_all_uses_with(call)
        graph.erase_node(cast)
    if not rows.users:
        graph.erase_node(rows)
    return (f"{call.name}: bf16 rows with fp32 scales (finalize's mixed-precision mode, A2/A3) instead of "
            "casting the rows to fp32 and the sum back")


def _added_tensor_as_skip(call, keep_intermediate_rounding):
    if call.args[1] is not None or call.args[2] is not None:
        return None
    out = tensor_meta(call)
    if out is None or out.dim() != 2 or not isinstance(out.shape[1], int):
        return None
    if keep_intermediate_rounding and out.dtype in _HALF_DTYPES:
        return None
    chain, node = [], call  # the views of the sum, each read once
    while len(node.users) == 1 and is_call(next(iter(node.users)), *RESHAPES):
        node = next(iter(node.users))
        chain.append(node)
    add = next(iter(node.users)) if len(node.users) == 1 else None
    if not (is_call(add, aten.add.Tensor) and not add.kwargs and len(add.args) == 2):
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    result, added = tensor_meta(add), tensor_meta(other)
    if (added is None or other is node or added.dtype != out.dtype or result.dtype != out.dtype
            or tuple(added.shape) != tuple(result.shape) or not added.is_contiguous()):
        return None  # a broadcast, a promotion, or a tensor a view cannot reshape
    graph = call.graph
    with graph.inserting_before(add):
        skip = graph.call_function(aten.view.default, (other, [-1, out.shape[1]]))
    skip.meta["val"] = added.view(-1, out.shape[1])
    for moved in (call, *chain):  # after the skip, which the model may compute later
        add.prepend(moved)
    call.update_arg(1, skip)
    add.replace_all_uses_with(node)
    graph.erase_node(add)
    return f"{call.name}: adds {other.name} as skip1 (the add after the combine)"


PASS = FusionPass(
    name="moe_dispatch",
    # its blocks are also matched with the activation swiglu fused (npu_swiglu forms)
    after=("swiglu",),
    fused_op="npu.npu_moe_init_routing_v2",
    forms=forms,
    # the token embeddings, routing weights and expert weights train through the block
    differentiable=("x", "weights", "w_gate_up", "w_down", "w1", "w2", "w3", "received", "expert_out"),
    example={
        # T=12 tokens, K=2, H=16, E=5 experts of a gate_up of 2*8 and a down of 8 -> 16;
        # sizes multiples of 8 for _grouped_mm's alignment, and no other 5 in the trace
        "x": lambda dtype: torch.empty(12, 16, dtype=dtype),
        "ids": lambda dtype: torch.empty(12, 2, dtype=torch.int64),
        "weights": lambda dtype: torch.empty(12, 2, dtype=dtype),
        # transposed views of (E, out, in) storage, as transformers passes its parameters:
        # aten._grouped_mm's weight gradient (in the joint patterns) depends on it
        "w_gate_up": lambda dtype: torch.empty(5, 16, 16, dtype=dtype).transpose(-2, -1),
        "w_down": lambda dtype: torch.empty(5, 16, 8, dtype=dtype).transpose(-2, -1),
        "num_experts": 5,
        # the batched forms take the parameters as stored: (E, out, in)
        "gate_up_proj": lambda dtype: torch.empty(5, 16, 16, dtype=dtype),
        "down_proj": lambda dtype: torch.empty(5, 16, 8, dtype=dtype),
        # torchtitan's (E, F, D) w1 / w3 and (E, D, F) w2, and its per-expert counts
        "w1": lambda dtype: torch.empty(5, 8, 16, dtype=dtype),
        "w2": lambda dtype: torch.empty(5, 16, 8, dtype=dtype),
        "w3": lambda dtype: torch.empty(5, 8, 16, dtype=dtype),
        "counts": lambda dtype: torch.empty(5, dtype=torch.int64),
        # DeepSeek-V4's clamped SwiGLU limits (swiglu_limit, -swiglu_limit)
        "swiglu_limit": 1.75,
        "swiglu_min": -1.75,
        # expert parallel (torchtitan's AllToAllTokenDispatcher), the same T=12, K=2, H=16:
        # the router's (B, L, K) ids and (B, L, E) scores; 40 rows received from 3 ranks
        # with 5 local experts each; the 24 expert output rows back in the sorted order
        "expert_ids": lambda dtype: torch.empty(2, 6, 2, dtype=torch.int64),
        "router_scores": lambda dtype: torch.empty(2, 6, 5, dtype=dtype),
        "received": lambda dtype: torch.empty(40, 16, dtype=dtype),
        "received_counts": lambda dtype: torch.empty(15, dtype=torch.int64),
        "ranks": 3,
        "expert_out": lambda dtype: torch.empty(24, 16, dtype=dtype),
        "perm": lambda dtype: torch.empty(24, dtype=torch.int64),
        "token": lambda dtype: torch.empty(24, dtype=torch.int64),
    },
    # DeepSeek weights its bf16 rows with fp32 routing weights: the same forward ops, but
    # the joint traces differ (the gradients are cast back to each side's dtype)
    example_variants=[{"weights": lambda dtype: torch.empty(12, 2, dtype=torch.float32)}],
    check=check,
    anchor=anchor,
    explain=explain,
    # MC2: a whole expert-parallel layer, found by walking the graph the forms leave
    recognize=recognize,
    finish=combine_in_model_dtype,
    # verification needs expert ids below the expert count, and counts that agree with them
    verify_input=lambda name, args: _routing_input(name, args),
)


def _routing_input(name, args):
    """Verification inputs a random tensor does not make: each token's k distinct expert ids,
    and the per-expert counts of exactly those ids (torchtitan's offsets come from them).
    Both are drawn from one seeded generator, so the two calls agree."""
    if name in ("expert_ids", "perm", "token"):
        return _ep_routing_input(name, args)
    if name not in ("ids", "counts"):
        return None
    tokens, top_k = args["ids"].shape
    experts = int(_expert_count(args))
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(int(tokens))])
    if name == "ids":
        return ids.to(args["ids"].dtype)
    return torch.bincount(ids.flatten(), minlength=experts).to(args["counts"].dtype)


def _ep_routing_input(name, args):
    """The expert-parallel forms' index inputs: the router's (B, L, K) ids, distinct per
    token and below the expert count; and the combine's row order, a stable sort of such
    ids, with the token of each row (perm // K) from the same seeded draw."""
    generator = torch.Generator().manual_seed(0)
    if name == "expert_ids":
        *lead, top_k = args["expert_ids"].shape
        tokens, experts = math.prod(int(n) for n in lead), int(args["router_scores"].shape[-1])
    else:
        tokens, top_k = (int(n) for n in args["weights"].shape)
        experts = 2 * top_k
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    if name == "expert_ids":
        return ids.view(args["expert_ids"].shape).to(args["expert_ids"].dtype)
    perm = torch.argsort(ids.flatten(), stable=True)
    return (perm if name == "perm" else perm // top_k).to(args[name].dtype)
