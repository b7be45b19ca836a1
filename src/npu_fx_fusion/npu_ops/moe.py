"""MoE family: gating, token routing and the grouped expert GEMM.

Reference semantics: shared/reference/op_semantics.md sections 5 (gating), 6 (routing)
and 7 (npu_grouped_matmul); output shapes and dtypes from the wheel's Meta functions
(op_plugin/meta/_meta_registrations.py), which the fake kernels reproduce.

The index conventions are the point of these ops, so here they are in one place
(t: token, j: its j-th expert, N tokens, K experts per token, flat = t*K + j):

* npu_moe_gating_top_k_softmax: row_idx[t, j] = j*N + t, "k-major" source ids (the v1
  npu_moe_init_routing input), NOT the token-major flat position.
* npu_moe_init_routing_v2: token-major; expanded_x[i] = x[order[i] // K] with
  order = argsort(expert_idx.flatten(), stable). expanded_row_idx is, for
  row_idx_type=0 ("gather" index), the INVERSE of order: src flat position -> dst row
  (-1 for an expert outside active_expert_range); for row_idx_type=1 ("scatter"), order
  itself: dst row -> src flat position.
* npu_moe_token_permute: sorted_indices = argsort(order), the inverse again
  (permuted[sorted_indices[i]] = tokens[i // K]), where Megatron's sorted_indices is the
  forward argsort `order`. npu_moe_token_unpermute reads it the same way.
* npu_moe_finalize_routing: expanded_src_to_dst_row is src -> dst; drop_pad_mode 0/1 index
  it k-major (j*N + t), 2/3 token-major (t*K + j). The init_routing_v2 map pairs with 2.
* npu_moe_compute_expert_tokens and group_list_type=0: CUMULATIVE end offsets;
  init_routing_v2 expert_tokens_num_type=1 and group_list_type=1: per-expert COUNTS.

Everything is computed in fp32 (float64 stays float64 so gradcheck can run) and rounded
once to the output dtype. Hardware limits (expert counts, k, hidden sizes, SoCs) live in
capabilities.py; the kernels refuse only what they cannot compute, and raise
NotImplementedError for the modes that have no CPU reference here (quantisation, padded
and drop-pad modes, non-MoE grouped_matmul layouts).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .spec import (FLOAT_DTYPES, OpCapability, Sample, SocLimits, dtype_argument, dtype_of_argument, in_layout_of,
                   op_spec, randn)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 as on the NPU; float64 stays float64 so gradcheck can run on the stand-in.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _topk_desc(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, descending; ties go to the lower index.

    The kernels' tie-breaking is undocumented (op_semantics 11.6); a stable sort makes the
    stand-in deterministic, which torch.topk on CPU does not promise.
    """
    vals, idx = torch.sort(values, dim=-1, descending=True, stable=True)
    return vals[..., :k].contiguous(), idx[..., :k].contiguous()


def _flat_topk(indices: torch.Tensor) -> int:
    return 1 if indices.dim() == 1 else indices.shape[1]


# =====================================================================================
# opcheck samples (and the inputs tests/test_npu_ops_moe.py builds its cases from)
# =====================================================================================
# DeepSeek-V3's noaux_tc router, small: 4 of 16 experts in 4 groups of which 2 are kept
# (V3 is 8 of 256 in 8 groups, 4 kept), sigmoid scores renormalised and scaled
DEEPSEEK_SMALL = dict(k=4, k_group=2, group_count=4, group_select_mode=1, norm_type=1,
                      routed_scaling_factor=2.5, eps=1e-20)


def expert_ids(tokens: int, k: int, ids, seed: int = 0) -> torch.Tensor:
    """(tokens, k) int32 expert ids drawn from `ids`, no repeats within a token."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids)
    return torch.stack([ids[torch.randperm(len(ids), generator=generator)[:k]] for _ in range(tokens)]).int()


def _routing(dtype):
    """Six tokens routed to 3 of 5 experts: tokens, ids, the permute's sorted_indices, probs."""
    idx = expert_ids(6, 3, list(range(5)), seed=111)
    tokens = randn(6, 4, dtype=dtype, seed=112)
    sorted_indices = npu_moe_token_permute(tokens, idx.long())[1]
    probs = torch.rand(6, 3, generator=torch.Generator().manual_seed(113), dtype=torch.float64).to(dtype)
    return tokens, idx, sorted_indices, probs


def _gating_softmax_samples(dtype):
    x = randn(6, 16, dtype=dtype, seed=110)
    yield Sample((x, None, 3))
    yield Sample((x.view(2, 3, 16), torch.tensor([[False, True, False], [False, False, True]]), 2))


def _gating_top_k_samples(dtype):
    x = randn(6, 16, dtype=dtype, seed=110)
    noaux_tc = {k: v for k, v in DEEPSEEK_SMALL.items() if k != "k"}
    # sigmoid with out_flag: the differentiable form (torch_npu's backward reads norm_out)
    yield Sample((x, 4), dict(bias=randn(16, dtype=dtype), out_flag=True, **noaux_tc), grad_args=(0,))
    yield Sample((x, 2), dict(norm_type=0, renorm=1))  # softmax, renormalised: no backward
    yield Sample((x, 3), dict(norm_type=2, out_flag=True, routed_scaling_factor=1.5))  # sqrt-softplus


def _gating_top_k_backward_samples(dtype):
    x_norm = torch.sigmoid(randn(6, 16, seed=115))
    top_idx = npu_moe_gating_top_k(randn(6, 16, dtype=dtype, seed=110), **DEEPSEEK_SMALL)[1]
    yield Sample((x_norm, randn(6, 4, dtype=dtype), top_idx), dict(norm_type=1, routed_scaling_factor=2.5))


def _init_routing_samples(dtype):
    x, idx = randn(6, 4, dtype=dtype), expert_ids(6, 3, list(range(5)), seed=111)
    yield Sample((x, idx), dict(expert_num=5))
    yield Sample((x, idx), dict(scale=randn(6), expert_num=5, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                                active_expert_range=[1, 4], active_num=12, row_idx_type=1))
    yield Sample((x, idx), dict(expert_num=5, expert_tokens_num_type=2, expert_tokens_num_flag=True))


def _compute_expert_tokens_samples(dtype):
    yield Sample((torch.tensor([0, 0, 2, 2, 3], dtype=dtype), 5))
    yield Sample((torch.tensor([1, 1, 1], dtype=dtype), 3))  # experts 0 and 2 empty


def _permute_samples(dtype):
    tokens, idx, _, _ = _routing(dtype)
    yield Sample((tokens, idx.long()), grad_args=(0,))
    yield Sample((tokens, idx[:, 0].long(), 4), grad_args=(0,))  # one expert per token, 4 rows kept
    yield Sample((tokens, idx.long(), -3), grad_args=(0,))  # the last 3 rows dropped


def _permute_grad_samples(dtype):
    _, _, sorted_indices, _ = _routing(dtype)
    yield Sample((randn(15, 4, dtype=dtype), sorted_indices, 6, dtype, 3))


def _unpermute_samples(dtype):
    _, _, sorted_indices, probs = _routing(dtype)
    permuted = randn(18, 4, dtype=dtype, seed=114)
    yield Sample((permuted, sorted_indices, probs), grad_args=(0, 2))
    yield Sample((permuted, sorted_indices), grad_args=(0,))


def _unpermute_grad_samples(dtype):
    _, _, sorted_indices, probs = _routing(dtype)
    permuted = randn(18, 4, dtype=dtype, seed=114)
    yield Sample((randn(6, 4, dtype=dtype), sorted_indices, 18, dtype, probs, False, None, permuted))
    yield Sample((randn(18, 4, dtype=dtype), sorted_indices, 18, dtype))


def _finalize_samples(dtype):
    tokens, idx, sorted_indices, probs = _routing(dtype)
    permuted = randn(18, 4, dtype=dtype, seed=114)
    yield Sample((permuted, tokens, None, randn(5, 4, dtype=dtype), probs, sorted_indices, idx, 2, 3))
    yield Sample((permuted, None, None, None, None, sorted_indices, None, 0, 3))
    if dtype == torch.bfloat16:  # the mixed-precision mode: fp32 scales, skip1 alone
        yield Sample((permuted, tokens, None, None, probs.float(), sorted_indices, idx, 2, 3))


def _grouped_matmul_samples(dtype):
    x, w = randn(9, 4, dtype=dtype, seed=116), randn(3, 4, 5, dtype=dtype, seed=117)
    # group_type 0, the expert GEMM: one (E, K, N) weight, or E (K, N) weights with biases; only the
    # weight's layout varies (the kernel takes a transposed weight, not a transposed x)
    yield Sample(([x], [w]), dict(group_list=torch.tensor([2, 2, 9]), split_item=3, group_type=0),
                 layout_args=(1,))
    bias = randn(5, dtype=GMM_BIAS_DTYPES[dtype])  # (a bf16 x takes an fp32 bias)
    yield Sample(([x], list(w.unbind(0))), dict(bias=[bias] * 3, group_list=torch.tensor([4, 0, 5]),
                                                split_item=2, group_type=0, group_list_type=1), layout_args=(1,))
    # group_type 2, the weight gradient: x.T of the tokens (a transposed view, as the kernel
    # requires) times dy, split along K; neither layout may change
    yield Sample(([x.t()], [randn(9, 5, dtype=dtype, seed=118)]),
                 dict(group_list=torch.tensor([2, 2, 9]), split_item=3, group_type=2), layout_args=())
    if dtype in (torch.float16, torch.bfloat16):
        # quantised MoE experts (one (E, K, N) int8 weight, (E, N) scales; the weight's layout varies)
        w8 = (randn(3, 4, 5, seed=119) * 40).round().clamp(-128, 127).to(torch.int8)
        channel = randn(3, 5, seed=120).abs() / 64
        ends = dict(group_list=torch.tensor([2, 2, 9]), split_item=3, group_type=0)
        yield Sample(([x], [w8]), dict(antiquant_scale=[channel.to(dtype)], **ends), layout_args=(1,))
        yield Sample(([x], [w8]), dict(antiquant_scale=[channel.to(dtype)],
                                       antiquant_offset=[randn(3, 5, seed=121).round().to(dtype)], **ends),
                     layout_args=(1,))
        # per-token: a bf16 scale for a bf16 output, an fp32 one for fp16 (D)
        q = (randn(9, 4, seed=122) * 40).round().clamp(-128, 127).to(torch.int8)
        yield Sample(([q], [w8]), dict(scale=[channel.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)],
                                       per_token_scale=[randn(9, seed=123).abs() / 64],
                                       output_dtype=dtype_argument(dtype), **ends), layout_args=(1,))


def _re_routing_samples(dtype):
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 ranks x 3 local experts, empty buckets included
    tokens = (randn(7, 4, seed=119) * 20).to(dtype)  # int8 tokens too
    yield Sample((tokens, counts))
    scales = torch.rand(7, generator=torch.Generator().manual_seed(119))
    yield Sample((tokens, counts.int()), dict(per_token_scales=scales))


# =====================================================================================
# Gating
# =====================================================================================

# ---- npu_moe_gating_top_k_softmax ----------------------------------------------------
def _check_gating_softmax(x, finished, k) -> None:
    op = "npu_moe_gating_top_k_softmax"
    if x.dim() not in (2, 3):
        raise RuntimeError(f"{op}: x must be 2-D or 3-D, it has {x.dim()} dims")
    if not 0 < k <= x.shape[-1]:
        raise RuntimeError(f"{op}: k must be in (0, {x.shape[-1]}] (the number of experts), got {k}")
    if finished is not None and (finished.dtype != torch.bool or finished.shape != x.shape[:-1]):
        raise RuntimeError(f"{op}: finished must be a bool tensor of shape {tuple(x.shape[:-1])}, "
                           f"got {finished.dtype} {tuple(finished.shape)}")


def _gating_softmax_fake(x, finished=None, k=1):
    _check_gating_softmax(x, finished, k)
    shape = (*x.shape[:-1], k)  # Meta: y x.dtype, expert_idx and row_idx int32
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.int32)


@op_spec("npu::npu_moe_gating_top_k_softmax",
         schema="npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
         fake=_gating_softmax_fake, samples=_gating_softmax_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,
             max_rank=3,
             backward=None,
             ge_converter=True,
             # the v1 docstring lists Atlas A2 only (v2 adds A3); torchair's converter warns
             # that arch35 no longer supports v1 (use npu_moe_gating_top_k_softmax_v2)
             socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
             limits={
                 "max_k": 1024,  # 0 < k <= E and k <= 1024
                 "finished_dtype": torch.bool,  # shape x.shape[:-1]
                 "renormalises": False,  # top-k of the softmax, no division by their sum
             },
             doc="op_semantics 5.1 / torch_npu docstring (_op_plugin_docs.py npu_moe_gating_top_k_softmax): "
             "x 2-D/3-D fp16/bf16/fp32, 0 < k <= E, k <= 1024, finished bool of x.shape[:-1]; products: "
             "Atlas A2 (A3 listed for _v2 only); GE converter custom/moe_gating_top_k_softmax.py warns it "
             "is unsupported on Ascend950; no autograd (inference graphs only)",
         ))  # no autograd in torch_npu
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    # op_semantics 5.1: softmax in fp32, top-k (descending), NO renormalisation of the k weights.
    _check_gating_softmax(x, finished, k)
    num_experts = x.shape[-1]
    y, idx = _topk_desc(torch.softmax(x.to(_compute_dtype(x)), dim=-1), k)
    if finished is not None:
        # A finished row gets expert id E (one past the last expert) [doc]. Its y is left
        # as the softmax top-k values: the docs do not say (op_semantics 11.6) [inferred].
        idx = torch.where(finished.unsqueeze(-1), torch.full_like(idx, num_experts), idx)
    # row_idx[t, j] = j*N + t: k-major source ids (op_semantics 5.1). For 3-D x the rows
    # are the flattened leading dims, N = B*S (row_idx for 3-D x is undocumented,
    # op_semantics 11.6) [inferred].
    rows = x.numel() // num_experts
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t()
    return y.to(x.dtype), idx.to(torch.int32), row_idx.reshape(*x.shape[:-1], k).contiguous()


# ---- npu_moe_gating_top_k (DeepSeek noaux_tc grouped top-k) -------------------------
def _check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode,
                        renorm, norm_type) -> None:
    op = "npu_moe_gating_top_k"
    if x.dim() != 2:
        raise RuntimeError(f"{op}: x must be 2-D (tokens, experts), it has {x.dim()} dims")
    num_experts = x.shape[1]
    if bias is not None and bias.shape != (num_experts,):
        raise RuntimeError(f"{op}: bias must have shape ({num_experts},), got {tuple(bias.shape)}")
    if (input_ids is None) != (tid2eid is None):
        raise RuntimeError(f"{op}: input_ids and tid2eid must be both provided or both omitted")
    if norm_type not in (0, 1, 2):
        raise RuntimeError(f"{op}: norm_type must be 0 (softmax), 1 (sigmoid) or 2 (sqrt-softplus), got {norm_type}")
    if renorm not in (0, 1):
        raise RuntimeError(f"{op}: renorm must be 0 or 1, got {renorm}")
    if input_ids is not None:
        if input_ids.shape != (x.shape[0],) or tid2eid.dim() != 2 or tid2eid.shape[1] != k:
            raise RuntimeError(f"{op}: hash mode needs input_ids ({x.shape[0]},) and tid2eid (keys, {k}), "
                               f"got {tuple(input_ids.shape)} and {tuple(tid2eid.shape)}")
        return
    if group_count <= 0 or num_experts % group_count:
        raise RuntimeError(f"{op}: group_count={group_count} must divide the {num_experts} experts")
    group_size = num_experts // group_count
    if group_select_mode not in (0, 1):
        raise RuntimeError(f"{op}: group_select_mode must be 0 (max) or 1 (top-2 sum), "
                           f"got {group_select_mode}")
    if group_select_mode == 1 and group_size < 2:
        raise RuntimeError(f"{op}: group_select_mode=1 sums each group's top 2, groups have {group_size}")
    if not 1 <= k_group <= group_count:
        raise RuntimeError(f"{op}: k_group must be in [1, group_count={group_count}], got {k_group}")
    if not 1 <= k <= k_group * group_size:
        raise RuntimeError(f"{op}: k must be in [1, k_group * experts per group = {k_group * group_size}], "
                           f"got {k}")


def _gating_top_k_fake(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                       group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
                       routed_scaling_factor=1.0, eps=1e-20):
    _check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode,
                        renorm, norm_type)
    n = x.shape[0]  # Meta: (N, k) x.dtype, (N, k) int32, (N, E) float32 whatever out_flag is
    return (x.new_empty((n, k)), x.new_empty((n, k), dtype=torch.int32),
            x.new_empty((n, x.shape[1]), dtype=torch.float32))


def _gating_top_k_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(output[2], output[1])  # norm_out, expert_idx
    for name in ("renorm", "norm_type", "out_flag", "routed_scaling_factor", "eps"):
        setattr(ctx, name, keyword_only_inputs[name])


def _gating_top_k_backward(ctx, grad_y, grad_idx, grad_norm_out):
    # torch_npu: npu_moe_gating_top_k_backward(result2, grad, result1, ...), x differentiable
    # through y only (op_semantics section 1). It reads norm_out, which the forward writes
    # only with out_flag=True, and supports sigmoid (norm_type=1) only: refuse the rest
    # rather than differentiate what the NPU would get wrong.
    if not ctx.out_flag:
        raise RuntimeError("npu_moe_gating_top_k: torch_npu's backward reads norm_out, which is only "
                           "computed with out_flag=True; call the forward with out_flag=True to train")
    if ctx.norm_type != 1:
        raise RuntimeError("npu_moe_gating_top_k: torch_npu's backward supports norm_type=1 (sigmoid) only")
    norm_out, expert_idx = ctx.saved_tensors
    grad_x = torch.ops.npu.npu_moe_gating_top_k_backward(
        norm_out, grad_y, expert_idx, renorm=ctx.renorm, norm_type=ctx.norm_type,
        routed_scaling_factor=ctx.routed_scaling_factor, eps=ctx.eps)
    return grad_x, None


@op_spec("npu::npu_moe_gating_top_k",
         schema="npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? "
                "tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int "
                "norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, "
                "Tensor, Tensor)",
         fake=_gating_top_k_fake, samples=_gating_top_k_samples,
         backward=_gating_top_k_backward, setup_context=_gating_top_k_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,
             max_rank=2,
             backward="npu.npu_moe_gating_top_k_backward",
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "max_experts": 2048,  # x.shape[-1] <= 2048
                 "min_group_size": 3,  # E / group_count > 2 (the wheel docstring)
                 "max_aligned_experts": 2048,  # align32(E / group_count) * group_count <= 2048
                 "group_select_modes": (0, 1),  # 0 group max, 1 sum of the group's top 2
                 "norm_types": (0, 1, 2),  # 0 softmax, 1 sigmoid, 2 sqrt-softplus (below)
                 # sqrt-softplus (DeepSeek-V4's routers): CANN README (mirror-cann/ops-transformer
                 # 3a280bc moe/moe_gating_top_k/README.md) "仅Ascend 950PR/Ascend 950DT支持"; the
                 # torch_npu docstring documents 0 / 1 only, so whether its host path passes 2
                 # through is unverified (deepseek_v4.md 11.2). No backward (sigmoid only).
                 "norm_type_socs": {2: ("Ascend950",)},
                 "norm_type_2_torch_npu_docs": "undocumented (0 / 1 only)",
                 "renorm": (0,),  # the wheel docstring: only 0 (the CANN README adds 1)
                 "bias_same_dtype": True,  # bias (E,) in x's dtype
                 "hash_mode_max_k": 64,  # input_ids/tid2eid (CANN README)
                 # autograd: backward reads norm_out, so the forward needs out_flag=True, and
                 # supports sigmoid (norm_type=1) only
                 "backward_norm_types": (1,),
                 "backward_needs_out_flag": True,
                 "backward_socs": ("Ascend910B", "Ascend910_93"),
                 # torch_npu 7.0.0 docs (hiascend ptaoplist_002365) on A2/A3: E == 256,
                 # k <= 32, k_group == 4, bias required; later docs lift these
                 "legacy_a2_a3": {"experts": 256, "max_k": 32, "k_group": 4, "bias_required": True},
             },
             doc="op_semantics 5.2 / torch_npu docstring (_op_plugin_docs.py npu_moe_gating_top_k): x 2-D "
             "fp16/bf16/fp32, E <= 2048, E % group_count == 0 and E/group_count > 2, "
             "align32(E/group_count)*group_count <= 2048, 1 <= k_group <= group_count, "
             "1 <= k <= k_group*E/group_count, renorm 0 only; CANN README hicann/ops-transformer "
             "moe/moe_gating_top_k (renorm=1 = softmax-mode renorm, hash mode k <= 64; products A2, A3, "
             "950) and moe/moe_gating_top_k_backward (A2/A3 only, sigmoid only); torch_npu 7.0.0 "
             "page ptaoplist_002365 for the older A2/A3 limits",
         ))
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
                         routed_scaling_factor=1.0, eps=1e-20):
    # op_semantics 5.2 and the CANN README (hicann/ops-transformer moe/moe_gating_top_k/README.md):
    #   norm_out = softmax(x) or sigmoid(x)                 (fp32)
    #   selection scores = norm_out + bias                  (bias steers SELECTION only)
    #   group_count > 1: keep the k_group best groups (max, or sum of top 2), others -inf
    #   expert_idx = top-k of the selection scores          (descending)
    #   y = norm_out[expert_idx]                            (weights from UNBIASED scores)
    #   renormalised y / (sum(y) + eps) for sigmoid, and for softmax only with renorm=1
    #   y *= routed_scaling_factor
    # renorm=1: the wheel docstring says "only 0"; op_semantics 11.1 lists it as open. The
    # README above defines it (softmax mode: renormalise; sigmoid: no effect), used here.
    # Hash mode (input_ids, tid2eid): expert_idx = tid2eid[input_ids], no selection [README;
    # op_semantics 11.1 marks it inferred].
    # norm_type 2 (CANN README, mirror-cann/ops-transformer 3a280bc moe/moe_gating_top_k, Ascend 950
    # only): norm_out = sqrt(softplus(x)), renormalised like sigmoid; DeepSeek-V4's router. The
    # README's TopK-mode renorm divides by ReduceSum(normOut) (every expert) where its hash mode
    # divides by the gathered k: the gathered k are used in both, as for sigmoid (and as V4 and
    # the backward do) [the README's TopK line read as a slip, deepseek_v4.md 11.2].
    _check_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, group_select_mode,
                        renorm, norm_type)
    acc = _compute_dtype(x)
    xf = x.to(acc)
    if norm_type == 0:
        scores = torch.softmax(xf, dim=-1)
    elif norm_type == 1:
        scores = torch.sigmoid(xf)
    else:
        scores = torch.nn.functional.softplus(xf).sqrt()
    if input_ids is not None:
        idx = tid2eid[input_ids.long()].long()
    else:
        sel = scores + bias.to(acc) if bias is not None else scores
        if group_count > 1:
            grouped = sel.view(x.shape[0], group_count, -1)
            if group_select_mode == 0:
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = _topk_desc(grouped, 2)[0].sum(dim=-1)
            _, keep_groups = _topk_desc(group_scores, k_group)
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
            sel = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], -1)
        _, idx = _topk_desc(sel, k)
    y = scores.gather(1, idx)
    if norm_type in (1, 2) or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    # norm_out is (N, E) fp32 in every case (Meta); without out_flag the NPU leaves it
    # unwritten, zeros here. Contiguous whatever x's layout, as the Meta's new_empty.
    norm_out = (scores.to(torch.float32).contiguous() if out_flag
                else torch.zeros(scores.shape, dtype=torch.float32, device=x.device))
    return y.to(x.dtype), idx.to(torch.int32), norm_out


# ---- npu_moe_gating_top_k_backward ---------------------------------------------------
def _check_gating_top_k_backward(x_norm, grad_y, expert_idx, norm_type) -> None:
    op = "npu_moe_gating_top_k_backward"
    if x_norm.dim() != 2 or grad_y.dim() != 2 or expert_idx.shape != grad_y.shape \
            or grad_y.shape[0] != x_norm.shape[0]:
        raise RuntimeError(f"{op}: needs x_norm (M, N), grad_y (M, K) and expertIdx (M, K); got "
                           f"{tuple(x_norm.shape)}, {tuple(grad_y.shape)}, {tuple(expert_idx.shape)}")
    if norm_type != 1:
        raise NotImplementedError(f"{op}: only norm_type=1 (sigmoid) is supported (torch_npu docs), "
                                  f"got {norm_type}")


def _gating_top_k_backward_fake(x_norm, grad_y, expertIdx, *, renorm=0, norm_type=0,
                                routed_scaling_factor=1.0, eps=1e-20):
    _check_gating_top_k_backward(x_norm, grad_y, expertIdx, norm_type)
    return grad_y.new_empty(x_norm.shape)  # docs: x_norm's shape, grad_y's dtype


@op_spec("npu::npu_moe_gating_top_k_backward",
         schema="npu_moe_gating_top_k_backward(Tensor x_norm, Tensor grad_y, Tensor expertIdx, *, int renorm=0, int "
                "norm_type=0, float routed_scaling_factor=1.0, float eps=1e-20) -> Tensor",
         fake=_gating_top_k_backward_fake, samples=_gating_top_k_backward_samples, sample_dtypes=FLOAT_DTYPES)
def npu_moe_gating_top_k_backward(x_norm, grad_y, expertIdx, *, renorm=0, norm_type=0,
                                  routed_scaling_factor=1.0, eps=1e-20):
    # CANN README moe/moe_gating_top_k_backward (sigmoid mode), with s = x_norm[i, idx]:
    #   g = c * grad_y;  D = sum(s) + eps;  w = s / D;  beta = sum(w * g)
    #   d s = (g - beta) / D, scattered to the selected experts;  dx = x_norm (1 - x_norm) d s
    # i.e. the quotient rule of y = c * s / (sum(s) + eps). renorm does not enter (sigmoid
    # always renormalises).
    _check_gating_top_k_backward(x_norm, grad_y, expertIdx, norm_type)
    acc = _compute_dtype(grad_y) if x_norm.dtype != torch.float64 else torch.float64
    norm = x_norm.to(acc)
    idx = expertIdx.long()
    s = norm.gather(1, idx)
    g = grad_y.to(acc) * routed_scaling_factor
    denom = s.sum(dim=-1, keepdim=True) + eps
    beta = (s / denom * g).sum(dim=-1, keepdim=True)
    grad_norm = torch.zeros_like(norm).scatter_add_(1, idx, (g - beta) / denom)
    # contiguous: op-plugin's generated kernel allocates x_norm's size in grad_y's dtype with
    # apply_tensor_without_format (op_plugin_functions.yaml gen_opapi out0: size x_norm, dtype grad_y)
    return (norm * (1 - norm) * grad_norm).to(grad_y.dtype).contiguous()


# =====================================================================================
# Routing
# =====================================================================================

# ---- npu_moe_init_routing_v2 ---------------------------------------------------------
def _init_routing_v2_plan(x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode,
                          expert_tokens_num_type, expert_tokens_num_flag, quant_mode,
                          active_expert_range, row_idx_type, x_dtype):
    """Validate; return (rows of expanded_x, expert range start, end, expert_tokens shape)."""
    op = "npu_moe_init_routing_v2"
    if x.dim() != 2 or expert_idx.dim() != 2 or x.shape[0] != expert_idx.shape[0]:
        raise RuntimeError(f"{op}: needs x (N, H) and expert_idx (N, K), got {tuple(x.shape)} and "
                           f"{tuple(expert_idx.shape)}")
    if quant_mode != -1 or x_dtype is not None:
        raise NotImplementedError(f"{op}: only the non-quantised mode (quant_mode=-1, x_dtype=None) has a "
                                  f"CPU reference, got quant_mode={quant_mode}, x_dtype={x_dtype}")
    if drop_pad_mode != 0:
        raise NotImplementedError(f"{op}: only dropless drop_pad_mode=0 has a CPU reference "
                                  f"(the docs support only 0), got {drop_pad_mode}")
    if offset is not None:
        raise NotImplementedError(f"{op}: offset is for static quantisation, which has no CPU reference")
    if row_idx_type not in (0, 1) or expert_tokens_num_type not in (0, 1, 2):
        raise RuntimeError(f"{op}: row_idx_type must be 0/1 and expert_tokens_num_type 0/1/2, got "
                           f"{row_idx_type} and {expert_tokens_num_type}")
    n, k = expert_idx.shape
    if active_expert_range:
        if len(active_expert_range) != 2 or not 0 <= active_expert_range[0] < active_expert_range[1]:
            raise RuntimeError(f"{op}: active_expert_range must be [start, end) with 0 <= start < end, "
                               f"got {list(active_expert_range)}")
        start, end = active_expert_range
    else:
        start, end = 0, expert_num
    if end <= 0 or (expert_tokens_num_flag and expert_tokens_num_type == 2 and expert_num <= 0):
        raise RuntimeError(f"{op}: expert_num must be > 0 (or active_expert_range given), got {expert_num}")
    if scale is not None and scale.shape != (n,):
        raise RuntimeError(f"{op}: without quantisation scale is per token, ({n},), got {tuple(scale.shape)}")
    rows = n * k if active_num <= 0 else min(active_num, n * k)
    if not expert_tokens_num_flag:
        tokens_shape: tuple[int, ...] = ()  # Meta: a 0-dim tensor (not an empty one)
    elif expert_tokens_num_type == 2:
        tokens_shape = (expert_num, 2)
    else:
        tokens_shape = (end - start,)
    return rows, start, end, tokens_shape


def _init_routing_v2_fake(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                          expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                          expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(),
                          row_idx_type=0, x_dtype=None):
    rows, _, _, tokens_shape = _init_routing_v2_plan(
        x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode, expert_tokens_num_type,
        expert_tokens_num_flag, quant_mode, active_expert_range, row_idx_type, x_dtype)
    return (x.new_empty((rows, x.shape[1])), x.new_empty((expert_idx.numel(),), dtype=torch.int32),
            x.new_empty(tokens_shape, dtype=torch.int64), x.new_empty((rows,), dtype=torch.float32))


@op_spec("npu::npu_moe_init_routing_v2",
         schema="npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int "
                "active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int "
                "expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] "
                "active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)",
         fake=_init_routing_v2_fake, samples=_init_routing_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES | {torch.int8},  # int8 x only without (re)quantisation
             min_rank=2,
             max_rank=2,
             backward=None,
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "expert_idx_dtype": torch.int32,  # (N, K)
                 "drop_pad_modes": (0,),  # dropless only
                 # the docs: count (1) and key_value (2) only, with the flag True; the Meta
                 # function also accepts 0 (cumsum), the V3 README does not
                 "expert_tokens_num_types": (1, 2),
                 "expert_tokens_num_flag": True,
                 "quant_modes": (-1, 1),  # none, dynamic int8 (newer CANN: MX/FP8/INT4 modes)
                 "max_expert_num": 10240,
                 "key_value_max_expert_num": 5120,
                 "active_num_equals_rows": True,  # V3 README: unused, must equal N*K
                 "row_idx_types": (0, 1),  # 0 gather (src -> dst), 1 scatter (dst -> src)
                 "socs_of_docs": ("Ascend910B", "Ascend910_93"),
             },
             doc="op_semantics 6.1 / torch_npu docstring (_op_plugin_docs.py npu_moe_init_routing_v2) and "
             "the aclnnMoeInitRoutingV3 doc (hicann/ops-transformer moe/moe_init_routing_v3): x (N, H) "
             "fp16/bf16/fp32/int8, expert_idx (N, K) int32, drop_pad_mode 0, expert_tokens_num_type 1/2 "
             "with the flag True, quant_mode -1/1, expert_num <= 10240 (<= 5120 key_value), "
             "active_num unused (= N*K); products A2/A3 (950 not covered by those docs); no autograd",
         ))  # no autograd in torch_npu
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                            expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(),
                            row_idx_type=0, x_dtype=None):
    # op_semantics 6.1. Token-major: the kernel gathers x[row // K] and scale[row // K]
    # (hicann/ops-transformer moe_init_routing_v3 op_kernel/arch35/moe_v3_gather_out.h);
    # the V3 doc's `sortedRowIdx % NUM_ROWS` is the v1 (k-major) formula, not this op's.
    # The sort is stable (ascending flat position within an expert), as the v1 doc's
    # argsort(kind="stable") [inferred, op_semantics 11.7].
    rows, start, end, _ = _init_routing_v2_plan(
        x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode, expert_tokens_num_type,
        expert_tokens_num_flag, quant_mode, active_expert_range, row_idx_type, x_dtype)
    n, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # dst row -> src flat position
    sorted_experts = flat[order]
    valid = (sorted_experts >= start) & (sorted_experts < end)
    src = order[valid]  # the active rows, in expert order
    n_valid = src.numel()
    m = min(rows, n_valid)
    # Rows >= n_valid (and the tail of expanded_scale) are undefined on the NPU: zeros here.
    # active_num < n_valid keeps the first active_num rows [inferred, op_semantics 11.7].
    expanded_x = x.new_zeros((rows, x.shape[1]))
    expanded_x[:m] = x[src[:m] // k]
    expanded_scale = x.new_zeros((rows,), dtype=torch.float32)
    if scale is not None:
        expanded_scale[:m] = scale[src[:m] // k].float()
    expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32, device=x.device)
    if row_idx_type == 0:
        # "gather" index: src flat position -> dst row, -1 where the expert is inactive (the
        # docs: valid and -1 entries interleave). The inverse of `order`.
        expanded_row_idx[src] = torch.arange(n_valid, dtype=torch.int32, device=x.device)
    else:
        # "scatter" index: dst row -> src flat position, the first n_valid entries valid
        # (the tail is undefined on the NPU: -1 here).
        expanded_row_idx[:n_valid] = src.to(torch.int32)
    if not expert_tokens_num_flag:
        expert_tokens = torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        counts = torch.bincount(sorted_experts[valid] - start, minlength=end - start)
        if expert_tokens_num_type == 0:  # cumsum (the docs list 1 and 2 only; Meta accepts 0)
            expert_tokens = counts.cumsum(0)
        elif expert_tokens_num_type == 1:  # count
            expert_tokens = counts
        else:  # key_value: [expert id, count] for each count > 0, then (0, 0) and undefined (zeros)
            nonzero = torch.nonzero(counts).squeeze(1)
            expert_tokens = torch.zeros((expert_num, 2), dtype=torch.int64, device=x.device)
            expert_tokens[:nonzero.numel(), 0] = nonzero + start
            expert_tokens[:nonzero.numel(), 1] = counts[nonzero]
    return expanded_x, expanded_row_idx, expert_tokens.to(torch.int64).contiguous(), expanded_scale


# ---- npu_moe_compute_expert_tokens ---------------------------------------------------
def _check_compute_expert_tokens(sorted_experts, num_expert) -> None:
    op = "npu_moe_compute_expert_tokens"
    if sorted_experts.dim() != 1:
        raise RuntimeError(f"{op}: sorted_expert_for_source_row must be 1-D, "
                           f"it has {sorted_experts.dim()} dims")
    if num_expert <= 0:
        raise RuntimeError(f"{op}: num_expert must be > 0, got {num_expert}")


def _compute_expert_tokens_fake(sorted_expert_for_source_row, num_expert):
    _check_compute_expert_tokens(sorted_expert_for_source_row, num_expert)
    return sorted_expert_for_source_row.new_empty((num_expert,), dtype=torch.int32)  # Meta: int32


@op_spec("npu::npu_moe_compute_expert_tokens",
         schema="npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
         fake=_compute_expert_tokens_fake, samples=_compute_expert_tokens_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.int32}),
             min_rank=1,
             max_rank=1,
             backward=None,
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "max_num_expert": 2048,  # 0 < num_expert <= 2048
                 "max_elements": 2**24,  # exclusive
                 "output": "cumsum",  # inclusive end offsets: group_list_type=0
             },
             doc="op_semantics 6.2 / torch_npu docstring (_op_plugin_docs.py "
             "npu_moe_compute_expert_tokens): 1-D int32 sorted expert ids in [0, num_expert), fewer than "
             "2^24, 0 < num_expert <= 2048; products Ascend950 and Atlas A2 (A3 not listed); inference",
         ))
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    # op_semantics 6.2: out[e] = (last index of expert e) + 1, an absent expert carrying the
    # previous value: the CUMULATIVE end offsets (group_list_type=0), not counts.
    _check_compute_expert_tokens(sorted_expert_for_source_row, num_expert)
    ids = sorted_expert_for_source_row.long()
    if ids.numel() > 1 and bool((ids[1:] < ids[:-1]).any()):
        # the kernel's binary search would silently return garbage
        raise RuntimeError("npu_moe_compute_expert_tokens: sorted_expert_for_source_row must be "
                           "non-decreasing (sorted expert ids)")
    experts = torch.arange(num_expert, dtype=torch.int64, device=ids.device)
    return torch.searchsorted(ids, experts, right=True).to(torch.int32)


# ---- npu_moe_token_permute -----------------------------------------------------------
def _permute_rows(op, indices, num_out_tokens) -> int:
    if indices.dim() not in (1, 2):
        raise RuntimeError(f"{op}: indices must be 1-D or 2-D, it has {indices.dim()} dims")
    n = indices.numel()
    wanted = num_out_tokens or 0  # Meta: None and 0 keep every row
    rows = min(wanted, n) if wanted > 0 else n + wanted  # < 0 slices from the end
    if rows < 0:
        raise RuntimeError(f"{op}: num_out_tokens={num_out_tokens} leaves no rows out of {n}")
    return rows


def _check_permute(tokens, indices, num_out_tokens, padded_mode) -> int:
    op = "npu_moe_token_permute"
    if padded_mode:
        raise NotImplementedError(f"{op}: padded_mode=True has no CPU reference "
                                  "(torch_npu supports False only)")
    if tokens.dim() != 2 or indices.shape[0] != tokens.shape[0]:
        raise RuntimeError(f"{op}: needs tokens (T, H) and indices (T,) or (T, topK), got "
                           f"{tuple(tokens.shape)} and {tuple(indices.shape)}")
    return _permute_rows(op, indices, num_out_tokens)


def _permute_fake(tokens, indices, num_out_tokens=None, padded_mode=False):
    rows = _check_permute(tokens, indices, num_out_tokens, padded_mode)
    return tokens.new_empty((rows, tokens.shape[1])), tokens.new_empty((indices.numel(),), dtype=torch.int32)


def _permute_setup_context(ctx, inputs, output):
    tokens, indices, _, padded_mode = inputs
    ctx.save_for_backward(output[1])
    ctx.tokens_size_0, ctx.tokens_dtype = tokens.shape[0], tokens.dtype
    ctx.topk, ctx.padded_mode = _flat_topk(indices), padded_mode


def _permute_backward(ctx, grad_permuted, grad_sorted_indices):
    # derivatives.yaml: npu_moe_token_permute_grad_v2(grad, result1, tokens.size(0),
    # tokens.scalar_type(), topK, padded_mode) (op_semantics section 1)
    (sorted_indices,) = ctx.saved_tensors
    grad_tokens = torch.ops.npu.npu_moe_token_permute_grad_v2(
        grad_permuted, sorted_indices, ctx.tokens_size_0, ctx.tokens_dtype, ctx.topk, ctx.padded_mode)
    return grad_tokens, None, None, None


@op_spec("npu::npu_moe_token_permute",
         schema="npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False)"
                " -> (Tensor, Tensor)",
         fake=_permute_fake, samples=_permute_samples,
         backward=_permute_backward, setup_context=_permute_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,
             max_rank=2,
             backward="npu.npu_moe_token_permute_grad_v2",
             ge_converter=False,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "max_topk": 512,
                 "max_index": 16777215,  # indices.numel() and values < 16777215 (exclusive)
                 "index_dtypes": (torch.int32, torch.int64),  # (T,) or (T, topK)
                 "padded_mode": False,
                 "int8_tokens_socs": ("Ascend950",),
             },
             doc="op_semantics 6.3 / torch_npu docstring (_op_plugin_docs.py ~L16842 "
             "npu_moe_token_permute): tokens (T, H) fp16/bf16/fp32 (int8 on 950), indices 1-D/2-D "
             "int32/int64 < 16777215, topK <= 512, padded_mode False; products A2, A3, 950; "
             "sorted_indices is the inverse of the stable argsort (Megatron's is the argsort); "
             "no GE converter in torchair 2.13",
         ))
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    # op_semantics 6.3 (the newer docstring, ~L16842: permuted[sorted_indices[i]] = tokens[i // topK]):
    # sorted_indices is the INVERSE of the stable argsort (src flat -> dst row); Megatron's
    # sorted_indices is the argsort itself (dst -> src).
    rows = _check_permute(tokens, indices, num_out_tokens, padded_mode)
    topk = _flat_topk(indices)
    order = torch.argsort(indices.reshape(-1), stable=True)  # dst -> src (Megatron's)
    sorted_indices = torch.argsort(order)  # src -> dst (torch_npu's)
    permuted = tokens[order[:rows] // topk]
    return permuted.contiguous(), sorted_indices.to(torch.int32)


# ---- npu_moe_token_permute_grad_v2 ---------------------------------------------------
def _check_permute_grad(grad_permuted_tokens, sorted_indices, padded_mode) -> None:
    op = "npu_moe_token_permute_grad_v2"
    if padded_mode:
        raise NotImplementedError(f"{op}: padded_mode=True has no CPU reference")
    if grad_permuted_tokens.dim() != 2 or sorted_indices.dim() != 1:
        raise RuntimeError(f"{op}: needs grad_permuted_tokens (rows, H) and sorted_indices 1-D, got "
                           f"{tuple(grad_permuted_tokens.shape)} and {tuple(sorted_indices.shape)}")


def _permute_grad_fake(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK,
                       padded_mode=False):
    _check_permute_grad(grad_permuted_tokens, sorted_indices, padded_mode)
    return grad_permuted_tokens.new_empty((tokens_size_0, grad_permuted_tokens.shape[1]), dtype=tokens_dtype)


@op_spec("npu::npu_moe_token_permute_grad_v2",
         schema="npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices, SymInt "
                "tokens_size_0, ScalarType tokens_dtype, SymInt num_topK, bool padded_mode=False) -> Tensor",
         fake=_permute_grad_fake, samples=_permute_grad_samples, sample_dtypes=FLOAT_DTYPES)
def npu_moe_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype,
                                  num_topK, padded_mode=False):
    # op_semantics 6.3: grad_tokens[t] = sum_j grad_permuted[sorted_indices[t*topK + j]], over
    # the rows the permute kept (< grad_permuted.size(0)); a dropped row contributes nothing.
    _check_permute_grad(grad_permuted_tokens, sorted_indices, padded_mode)
    acc = _compute_dtype(grad_permuted_tokens)
    dst = sorted_indices.long().view(tokens_size_0, num_topK)
    kept = dst < grad_permuted_tokens.shape[0]
    rows = grad_permuted_tokens.to(acc)[dst.clamp(max=max(grad_permuted_tokens.shape[0] - 1, 0))]
    rows = rows * kept.unsqueeze(-1)
    return rows.sum(dim=1).to(tokens_dtype)


# ---- npu_moe_token_unpermute ---------------------------------------------------------
def _check_unpermute(permuted_tokens, sorted_indices, probs, padded_mode) -> int:
    op = "npu_moe_token_unpermute"
    if padded_mode:
        raise NotImplementedError(f"{op}: padded_mode=True has no CPU reference "
                                  "(torch_npu supports False only)")
    if permuted_tokens.dim() != 2 or sorted_indices.dim() != 1:
        raise RuntimeError(f"{op}: needs permuted_tokens (T*topK, H) and sorted_indices (T*topK,), got "
                           f"{tuple(permuted_tokens.shape)} and {tuple(sorted_indices.shape)}")
    topk = 1 if probs is None else probs.shape[1]
    if probs is not None and (probs.dim() != 2 or probs.numel() != sorted_indices.numel()):
        raise RuntimeError(f"{op}: probs must be (T, topK) with T*topK = {sorted_indices.numel()}, "
                           f"got {tuple(probs.shape)}")
    return topk


def _unpermute_fake(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    topk = _check_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
    return permuted_tokens.new_empty((sorted_indices.shape[0] // topk, permuted_tokens.shape[1]))


def _unpermute_setup_context(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    ctx.save_for_backward(permuted_tokens, sorted_indices, probs)
    ctx.padded_mode, ctx.restore_shape = padded_mode, restore_shape


def _unpermute_backward(ctx, grad):
    # derivatives.yaml: npu_moe_token_unpermute_grad_v2(grad, sorted_indices,
    # permuted_tokens.size(0), dtype, probs, padded_mode, restore_shape,
    # permuted_tokens_for_backward) (op_semantics section 1). torch_npu wraps the forward
    # in _npu_moe_token_unpermute to keep permuted_tokens; saving it here is the same.
    permuted_tokens, sorted_indices, probs = ctx.saved_tensors
    grad_permuted, grad_probs = torch.ops.npu.npu_moe_token_unpermute_grad_v2(
        grad, sorted_indices, permuted_tokens.shape[0], permuted_tokens.dtype, probs, ctx.padded_mode,
        ctx.restore_shape, permuted_tokens)
    return grad_permuted, None, grad_probs if probs is not None else None, None, None


def _gather_permuted(permuted: torch.Tensor, sorted_indices: torch.Tensor, topk: int):
    """permuted[sorted_indices] as (T, topK, H), zero where an index is past the last row.

    Indices >= permuted.size(0) appear when the permute dropped rows (num_out_tokens): they
    are taken to contribute nothing [inferred, op_semantics 11.5].
    """
    dst = sorted_indices.long().view(-1, topk)
    kept = dst < permuted.shape[0]
    rows = permuted[dst.clamp(max=max(permuted.shape[0] - 1, 0))]
    return rows * kept.unsqueeze(-1), dst, kept


@op_spec("npu::npu_moe_token_unpermute",
         schema="npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool "
                "padded_mode=False, int[]? restore_shape=None) -> Tensor",
         fake=_unpermute_fake, samples=_unpermute_samples,
         backward=_unpermute_backward, setup_context=_unpermute_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,
             max_rank=2,
             backward="npu.npu_moe_token_unpermute_grad_v2",
             ge_converter=False,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "max_topk": 512,  # A2/A3
                 "sorted_indices_dtype": torch.int32,  # (T*topK,), no duplicates
                 "padded_mode": False,
                 "restore_shape": None,
                 # on 950 torch_npu forwards to aclnnMoeFinalizeRoutingV2
             },
             doc="op_semantics 6.3 / torch_npu docstring (_op_plugin_docs.py ~L16931 "
             "npu_moe_token_unpermute): permuted_tokens (T*topK, H) fp16/bf16/fp32, sorted_indices int32 "
             "without duplicates, probs (T, topK), padded_mode False, restore_shape None, topK <= 512 on "
             "A2/A3; products A2, A3, 950; no GE converter in torchair 2.13",
         ))
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):
    # op_semantics 6.3: out[t] = sum_j probs[t, j] * permuted[sorted_indices[t*topK + j]]
    # (topK = probs.size(1), 1 without probs), sorted_indices the src -> dst map the
    # permute returned. restore_shape only matters with padded_mode=True (docs): ignored.
    topk = _check_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
    acc = _compute_dtype(permuted_tokens)
    rows, _, _ = _gather_permuted(permuted_tokens.to(acc), sorted_indices, topk)
    if probs is not None:
        rows = rows * probs.to(acc).unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


# ---- npu_moe_token_unpermute_grad_v2 -------------------------------------------------
def _check_unpermute_grad(grad, sorted_indices, probs, padded_mode, permuted_tokens) -> int:
    op = "npu_moe_token_unpermute_grad_v2"
    if padded_mode:
        raise NotImplementedError(f"{op}: padded_mode=True has no CPU reference")
    if grad.dim() != 2 or sorted_indices.dim() != 1:
        raise RuntimeError(f"{op}: needs grad_unpermuted_tokens (T, H) and sorted_indices 1-D, got "
                           f"{tuple(grad.shape)} and {tuple(sorted_indices.shape)}")
    if probs is not None and permuted_tokens is None:
        raise RuntimeError(f"{op}: the grad of probs needs permuted_tokens")
    return 1 if probs is None else probs.shape[1]


def _unpermute_grad_fake(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                         permuted_tokens_dtype, probs=None, padded_mode=False, restore_shape=None,
                         permuted_tokens=None):
    _check_unpermute_grad(grad_unpermuted_tokens, sorted_indices, probs, padded_mode, permuted_tokens)
    grad_permuted = grad_unpermuted_tokens.new_empty(
        (permuted_tokens_size_0, grad_unpermuted_tokens.shape[1]), dtype=permuted_tokens_dtype)
    return grad_permuted, _grad_probs_like(grad_unpermuted_tokens, probs)


def _grad_probs_like(grad: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    # Meta: empty_like(probs) (probs' strides kept), None without probs; a registered op must
    # return a Tensor there: an empty one.
    return grad.new_empty((0,)) if probs is None else torch.empty_like(probs)


@op_spec("npu::npu_moe_token_unpermute_grad_v2",
         schema="npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices, SymInt "
                "permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False, "
                "int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (Tensor, Tensor)",
         fake=_unpermute_grad_fake, samples=_unpermute_grad_samples, sample_dtypes=FLOAT_DTYPES)
def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                                    permuted_tokens_dtype, probs=None, padded_mode=False,
                                    restore_shape=None, permuted_tokens=None):
    # op_semantics 6.3: grad_permuted[S[t*K + j]] = grad[t] * probs[t, j] and
    # grad_probs[t, j] = <grad[t], permuted[S[t*K + j]]>; rows no index reaches stay zero.
    topk = _check_unpermute_grad(grad_unpermuted_tokens, sorted_indices, probs, padded_mode,
                                 permuted_tokens)
    acc = _compute_dtype(grad_unpermuted_tokens)
    g = grad_unpermuted_tokens.to(acc)
    dst = sorted_indices.long().view(-1, topk)
    kept = dst < permuted_tokens_size_0
    contrib = g.unsqueeze(1).expand(-1, topk, -1)
    if probs is not None:
        contrib = contrib * probs.to(acc).unsqueeze(-1)
    grad_permuted = g.new_zeros((permuted_tokens_size_0, g.shape[1]))
    grad_permuted[dst[kept]] = contrib[kept]
    if probs is None:
        return grad_permuted.to(permuted_tokens_dtype), _grad_probs_like(grad_unpermuted_tokens, None).zero_()
    rows, _, _ = _gather_permuted(permuted_tokens.to(acc), sorted_indices, topk)
    grad_probs = (rows * g.unsqueeze(1)).sum(dim=-1)
    return grad_permuted.to(permuted_tokens_dtype), in_layout_of(grad_probs.to(probs.dtype), probs)


# ---- npu_moe_finalize_routing --------------------------------------------------------
# (rows, scales): bf16 rows with fp32 scales, the mixed-precision mode of A2/A3 (ops-transformer
# moe_finalize_routing_v2_def.cpp, aclnnMoeFinalizeRoutingV2.md); the wheel docstring, older,
# asks for one dtype
_MIXED_SCALES = (torch.bfloat16, torch.float32)


def _finalize_plan(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, drop_pad_mode,
                   k):
    op = "npu_moe_finalize_routing"
    mode = 0 if drop_pad_mode is None else drop_pad_mode
    if mode not in (0, 1, 2, 3):
        raise RuntimeError(f"{op}: drop_pad_mode must be 0-3, got {drop_pad_mode}")
    if expanded_permuted_rows.dim() != (3 if mode in (1, 3) else 2):
        raise RuntimeError(f"{op}: drop_pad_mode {mode} takes expanded_permuted_rows of "
                           f"{'(E, C, H)' if mode in (1, 3) else '(N*K, H)'}, got "
                           f"{tuple(expanded_permuted_rows.shape)}")
    topk = scales.shape[1] if scales is not None else (1 if k is None else k)
    n_src = expanded_src_to_dst_row.numel()
    if expanded_src_to_dst_row.dim() != 1 or topk <= 0 or n_src % topk:
        raise RuntimeError(f"{op}: expanded_src_to_dst_row must be 1-D with N*K entries, K={topk}; got "
                           f"{tuple(expanded_src_to_dst_row.shape)}")
    n = scales.shape[0] if scales is not None else n_src // topk  # Meta
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None and t.shape != (n, expanded_permuted_rows.shape[-1]):
            raise RuntimeError(f"{op}: {name} must be (N, H) = {(n, expanded_permuted_rows.shape[-1])}, "
                               f"got {tuple(t.shape)}")
    if skip2 is not None and skip1 is None:  # the V2 tiling's check (limits["skip2_needs_skip1"])
        raise RuntimeError(f"{op}: skip2 needs skip1")
    rows = expanded_permuted_rows.dtype
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias)):
        if t is not None and t.dtype != rows:
            raise RuntimeError(f"{op}: {name} must be {rows} like expanded_permuted_rows, got {t.dtype}")
    if scales is not None and scales.dtype != rows and (rows, scales.dtype) != _MIXED_SCALES:
        raise RuntimeError(f"{op}: scales must be {rows} like expanded_permuted_rows (or float32 for bfloat16 "
                           f"rows), got {scales.dtype}")
    return mode, topk, n


def _finalize_fake(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                   export_for_source_row, drop_pad_mode=0, k=1):
    _, _, n = _finalize_plan(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             drop_pad_mode, k)
    return expanded_permuted_rows.new_empty((n, expanded_permuted_rows.shape[-1]))


@op_spec("npu::npu_moe_finalize_routing",
         schema="npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
                "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
                "int? k=1) -> Tensor",
         fake=_finalize_fake, samples=_finalize_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=2,  # expanded_permuted_rows (N*K, H) dropless
             max_rank=3,  # (E, C, H) drop-pad
             backward=None,
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 # the wheel docstring documents 0 only (k-major); the op-plugin master doc and
                 # the MoeFinalizeRoutingV2 kernel add 1 (drop-pad), 2 (token-major, pairs with
                 # npu_moe_init_routing_v2) and 3; torch_npu calls V2 for all but the full
                 # mode-0 call (GE converter custom/npu_moe_finalize_routing.py likewise)
                 "documented_drop_pad_modes": (0,),
                 "v2_drop_pad_modes": (0, 1, 2, 3),
                 "index_dtype": torch.int32,
                 # the wheel docstring says skip2 None => skip1 None, the master doc the reverse
                 # (op_semantics 11.8); the V2 tiling, which every drop_pad_mode-2 call runs,
                 # rejects skip2 without skip1 and takes skip1 alone
                 # (moe_finalize_routing_v2_tiling_membase.cpp)
                 "skip2_needs_skip1": True,
                 "mixed_scales": _MIXED_SCALES,
             },
             doc="op_semantics 6.4 / torch_npu docstring (_op_plugin_docs.py npu_moe_finalize_routing): "
             "expanded_permuted_rows (N*K, H) fp16/bf16/fp32, skip1/skip2 (N, H) and bias (E, H) and "
             "scales (N, K) in its dtype, expanded_src_to_dst_row (N*K,) int32, drop_pad_mode 0; product "
             "Atlas A2 (docstring); modes 1-3 from the op-plugin master doc; no autograd",
         ))  # no autograd in torch_npu
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    # op_semantics 6.4 (doc "equivalent logic"):
    #   out[i] = skip1[i] + skip2[i] + sum_j scales[i, j] * (rows[src2dst[p(i, j)]] + bias[expert[i, j]])
    # p(i, j) = j*N + i (k-major) for drop_pad_mode 0/1, i*K + j (token-major) for 2/3; an
    # index of -1 (a dropped or inactive row) reads a zero row. Drop-pad modes 1/3 index the
    # (E, C, H) rows flattened to (E*C, H). skip1 and skip2 may each be None: the docs
    # disagree on which may be None alone (op_semantics 11.8); whichever is given is added.
    mode, topk, n = _finalize_plan(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                                   drop_pad_mode, k)
    acc = _compute_dtype(expanded_permuted_rows)
    hidden = expanded_permuted_rows.shape[-1]
    rows_flat = expanded_permuted_rows.reshape(-1, hidden).to(acc)
    idx = expanded_src_to_dst_row.long()
    idx = idx.view(topk, n).t() if mode in (0, 1) else idx.view(n, topk)  # (N, K): dst row of (i, j)
    picked = rows_flat[idx.clamp(min=0)] * (idx >= 0).unsqueeze(-1)
    if bias is not None:
        if export_for_source_row is None:
            raise RuntimeError("npu_moe_finalize_routing: bias needs export_for_source_row (the expert ids)")
        picked = picked + bias.to(acc)[export_for_source_row.long()]
    if scales is not None:
        picked = picked * scales.to(acc).unsqueeze(-1)
    out = torch.zeros((n, hidden), dtype=acc, device=expanded_permuted_rows.device)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.to(acc)
    return (out + picked.sum(dim=1)).to(expanded_permuted_rows.dtype)


# =====================================================================================
# Grouped matmul
# =====================================================================================
_GMM_QUANT_ARGS = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
                   "activation_input", "activation_quant_scale", "activation_quant_offset")
_GMM_SUPPORTED = ("split_item 2 or 3 with one 2-D x, float x/weight of one dtype, a 1-D int64 Tensor "
                  "group_list with group_list_type 0 (cumsum) or 1 (counts), act_type=0, output_dtype=None; "
                  "group_type=0 (split along M): weight one (E, K, N) tensor or E (K, N) tensors, optional bias; "
                  "group_type=2 (split along K): x a transposed (M, K) view, weight one (K, N) tensor, not "
                  "transposed, no bias; quantised (group_type=0, one (E, K, N) int8 weight, no bias): weight-only "
                  "(fp16/bf16 x, antiquant_scale [(E, N)] and optional antiquant_offset [(E, N)] in x's dtype) "
                  "or per-token (int8 x, scale [(E, N)] bf16 for a bf16 output / fp32 for fp16, per_token_scale "
                  "[(M,)] fp32)")


def _reads_transposed(t: torch.Tensor) -> bool:
    """t (R, C) is laid out as the transposed view of a contiguous (C, R) tensor (strides
    (1, R); with a dimension of size 1 both layouts are the same memory, and this is True).

    Decided from the strides without guarding: after an expert-parallel all-to-all R or C
    is a data-dependent size, where is_contiguous() would have to guard on it (R == 1?)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if t.dim() != 2:
        return False
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
    return ((statically_known_true(row_stride == 1) or statically_known_true(rows <= 1))
            and (statically_known_true(col_stride == rows) or statically_known_true(cols <= 1)))


# the bias dtype a float x takes (the wheel's docstring, 数据类型约束场景 非量化: fp16 x, fp16 bias;
# bf16 and fp32 x, fp32 bias)
GMM_BIAS_DTYPES = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}


def _gmm_plan(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], bias, group_list, split_item,
              group_type, group_list_type, act_type, output_dtype, dtype_args, quant_args):
    """Validate the MoE expert-GEMM layout; return (groups, N)."""
    op = "npu_grouped_matmul"

    def unsupported(what: str):
        return NotImplementedError(f"{op}: {what} has no CPU reference; supported: {_GMM_SUPPORTED}")

    if group_type is None:
        raise RuntimeError(f"{op}: group_type must be given with a Tensor group_list (torch_npu's Meta "
                           "check rejects None); the MoE layout is group_type=0")
    if group_type not in (0, 2):
        raise unsupported(f"group_type={group_type}")
    if split_item not in (2, 3):
        raise unsupported(f"split_item={split_item} (a list of outputs)")
    if group_list_type not in (0, 1):
        raise unsupported(f"group_list_type={group_list_type}")
    if act_type:
        raise unsupported(f"act_type={act_type}")
    if any(v is not None for v in dtype_args):
        raise unsupported("x_dtype / weight_dtype / scale_dtype / per_token_scale_dtype")
    if len(x) != 1 or x[0].dim() != 2:
        raise unsupported(f"x as {len(x)} tensor(s) of {[t.dim() for t in x]} dims "
                          "(one 2-D x is the MoE layout)")
    if group_list is None or group_list.dim() != 1:
        raise RuntimeError(f"{op}: group_type={group_type} needs a 1-D group_list")
    xt = x[0]
    if any(value is not None for value in quant_args.values()) or xt.dtype == torch.int8:
        return _gmm_quant_plan(xt, weight, bias, group_list, group_type, output_dtype, quant_args, unsupported)
    if output_dtype:
        raise unsupported("output_dtype without quantisation")
    if not xt.is_floating_point() or any(w.dtype != xt.dtype for w in weight):
        raise unsupported(f"x {xt.dtype} with weight {[w.dtype for w in weight]} (integer or mixed dtypes)")
    if group_type == 2:
        return _gmm_k_split_plan(xt, weight, bias, group_list, unsupported)
    if len(weight) == 1 and weight[0].dim() == 3:
        groups, k, n = weight[0].shape
    elif weight and all(w.dim() == 2 for w in weight):
        groups, (k, n) = len(weight), weight[0].shape
        if any(w.shape != (k, n) for w in weight):
            raise RuntimeError(f"{op}: the weights must all be (K, N) = {(k, n)}, got "
                               f"{[tuple(w.shape) for w in weight]}")
    else:
        raise unsupported(f"weight as {[tuple(w.shape) for w in weight]}")
    if xt.shape[1] != k:
        raise RuntimeError(f"{op}: x (M, {xt.shape[1]}) does not multiply weight (.., {k}, {n})")
    if group_list.shape[0] != groups:
        raise RuntimeError(f"{op}: group_list has {group_list.shape[0]} entries for {groups} weight groups")
    if bias is not None:
        shapes = [tuple(b.shape) for b in bias]
        # one (E, N) bias for an (E, K, N) weight [inferred: the docs describe 1-D per-weight
        # biases only], or E (N,) biases for E weights
        if shapes not in ([(groups, n)], [(n,)] * groups) or len(bias) != len(weight):
            raise RuntimeError(f"{op}: bias must match the weights: got {shapes}")
        wanted = GMM_BIAS_DTYPES[xt.dtype]
        if any(b.dtype != wanted for b in bias):
            raise RuntimeError(f"{op}: a {xt.dtype} x takes a {wanted} bias (D, 数据类型约束 非量化), got "
                               f"{sorted({str(b.dtype) for b in bias})}")
    return groups, n


def _gmm_quant_plan(xt, weight, bias, group_list, group_type, output_dtype, quant, unsupported):
    """The two quantised MoE expert GEMMs (group_type 0, one (E, K, N) int8 weight, no bias) that
    have a CPU reference; return (groups, N). D (npu_grouped_matmul, Tensor group_list, A2/A3
    table) and CANN aclnnGroupedMatmulV4 (量化场景 / 伪量化场景):

      weight-only (伪量化): x fp16 / bf16, weight int8 (per-channel only for int8; per-group needs
        int4), antiquant_scale and antiquant_offset [(E, N)] in x's dtype, output x's dtype;
      per-token (动态量化 pertoken + perchannel): x int8, weight int8, scale [(E, N)] bf16 with a bf16
        output or fp32 with an fp16 output, per_token_scale [(M,)] fp32 (1-D, D).
    """
    op = "npu_grouped_matmul"
    given = sorted(name for name, value in quant.items() if value is not None)
    if group_type != 0 or len(weight) != 1 or weight[0].dim() != 3 or weight[0].dtype != torch.int8:
        raise unsupported(f"quantisation ({', '.join(given) or 'int8 x'}) with group_type={group_type} and "
                          f"weight {[(tuple(w.shape), w.dtype) for w in weight]}")
    if bias is not None:
        raise unsupported("a bias with quantisation")
    groups, k, n = weight[0].shape
    if xt.shape[1] != k:
        raise RuntimeError(f"{op}: x (M, {xt.shape[1]}) does not multiply weight (.., {k}, {n})")
    if group_list.shape[0] != groups:
        raise RuntimeError(f"{op}: group_list has {group_list.shape[0]} entries for {groups} weight groups")

    def one(name, shape, dtypes):
        value = quant[name]
        if not isinstance(value, (list, tuple)) or len(value) != 1 or tuple(value[0].shape) != shape \
                or value[0].dtype not in dtypes:
            got = None if value is None else [(tuple(t.shape), t.dtype) for t in value]
            raise RuntimeError(f"{op}: {name} must be one {shape} tensor of {sorted(map(str, dtypes))} (D), "
                               f"got {got}")

    if xt.dtype == torch.int8:
        if given != ["per_token_scale", "scale"]:
            raise unsupported(f"int8 x with {given} (the per-token mode takes scale and per_token_scale)")
        out = dtype_of_argument(output_dtype) if output_dtype else None
        wanted = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}.get(out)
        if wanted is None:
            raise unsupported(f"output_dtype {out} with per-token quantisation (bf16 or fp16 here)")
        one("scale", (groups, n), {wanted})
        one("per_token_scale", (xt.shape[0],), {torch.float32})
        return groups, n
    if not set(given) <= {"antiquant_scale", "antiquant_offset"} or "antiquant_scale" not in given:
        raise unsupported(f"{xt.dtype} x and an int8 weight with {given} (weight-only takes antiquant_scale "
                          "and optionally antiquant_offset)")
    if xt.dtype not in (torch.float16, torch.bfloat16) or (output_dtype and dtype_of_argument(output_dtype)
                                                            != xt.dtype):
        raise RuntimeError(f"{op}: weight-only quantisation takes an fp16 / bf16 x and outputs its dtype (D), "
                           f"got {xt.dtype} and output_dtype {output_dtype}")
    one("antiquant_scale", (groups, n), {xt.dtype})
    if quant["antiquant_offset"] is not None:
        one("antiquant_offset", (groups, n), {xt.dtype})
    return groups, n


def _gmm_k_split_plan(xt, weight, bias, group_list, unsupported):
    """group_type=2 (aclnnGroupedMatmulV5, "groupType支持场景"): x (M, K) must be a transposed
    view (its storage (K, M), so each K group is a contiguous block of rows), one (K, N) weight
    that is not transposed, no bias; group g multiplies x[:, K_g] by weight[K_g], giving
    (G, M, N) (the wheel's Meta function). A contiguous x is rejected on the NPU (EZ1001, as
    users of MindSpeed-style dW code report)."""
    op = "npu_grouped_matmul"
    if len(weight) != 1 or weight[0].dim() != 2:
        raise unsupported(f"group_type=2 with weight as {[tuple(w.shape) for w in weight]} (one (K, N) "
                          "tensor is the K-split layout)")
    w = weight[0]
    if bias is not None:
        raise RuntimeError(f"{op}: group_type=2 takes no bias")
    if not _reads_transposed(xt):
        raise RuntimeError(f"{op}: group_type=2 needs x as a transposed view ((M, K) with strides (1, M)), "
                           f"got strides {tuple(xt.stride())} for shape {tuple(xt.shape)}")
    if _reads_transposed(w) and not w.is_contiguous():
        raise RuntimeError(f"{op}: group_type=2 does not take a transposed weight (strides "
                           f"{tuple(w.stride())} for shape {tuple(w.shape)})")
    if xt.shape[1] != w.shape[0]:
        raise RuntimeError(f"{op}: x (M, {xt.shape[1]}) does not multiply weight ({w.shape[0]}, N) "
                           "along the grouped K")
    return group_list.shape[0], w.shape[1]


def _gmm_fake(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
              per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
              activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
              tuning_config=None, output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
              per_token_scale_dtype=None):
    quant = dict(zip(_GMM_QUANT_ARGS, (scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                       activation_input, activation_quant_scale, activation_quant_offset)))
    groups, n = _gmm_plan(x, weight, bias, group_list, split_item, group_type, group_list_type, act_type,
                          output_dtype, (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype), quant)
    if group_type == 2:  # Meta: (G, M, N), a full (M, N) product per K group
        return [x[0].new_empty((groups, x[0].shape[0], n))]
    # Meta: one (M, N) output in output_dtype, else x's dtype
    return [x[0].new_empty((x[0].shape[0], n), dtype=dtype_of_argument(output_dtype) if output_dtype else None)]


@op_spec("npu::npu_grouped_matmul",
         schema="npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
                "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, Tensor[]? "
                "per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, Tensor[]? "
                "activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, int? "
                "group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? "
                "output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, int? "
                "per_token_scale_dtype=None) -> Tensor[]",
         fake=_gmm_fake, samples=_grouped_matmul_samples,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,  # the float (non-quantised) expert GEMM the MoE passes emit
             min_rank=2,
             max_rank=2,  # x of group_type 0 and 2 (group_type -1 takes 2-6 dims)
             backward=None,  # no autograd in torch_npu ...
             # ... so training graphs call it through our rule: dx by a group_type 0 call, dw by
             # a group_type 2 one (patterns/grouped_matmul.py)
             autograd_rule="npu_fx_fusion.patterns.grouped_matmul.GroupedMatmul",
             ge_converter=True,
             # Atlas inference (310P): fp16 only, group_type 0 only, N % 16 == 0
             socs={"Ascend310P": SocLimits(dtypes=frozenset({torch.float16}))},
             limits={
                 # A2/A3 (aclnnGroupedMatmulV5): -1, 0 and 2 (K-split, float only); the wheel's
                 # older docstring lists -1 and 0; 310P: 0 only
                 "group_types": (-1, 0, 2),
                 "310p_group_types": (0,),
                 "split_items_single_output": (2, 3),  # group_type 0 and 2
                 "group_list_types": (0, 1),  # cumsum, counts (2, sparse pairs: int8 only)
                 "group_list_dtype": torch.int64,
                 "max_groups_single_weight": 1024,  # one (E, K, N) weight; group_type 2: 1024 groups
                 "max_groups_weight_list": 128,
                 "bias_dtype_for_x": GMM_BIAS_DTYPES,  # a float x's per-group bias
                 "max_inner_dim": 65536,  # exclusive: x's K and weight's N (or K transposed)
                 "x_transposed": False,  # group_type 0
                 "weight_transposed": True,  # a transposed view of (E, N, K); group_type 0
                 # group_type 2 (aclnnGroupedMatmulV5, "groupType支持场景"): one x (M, K) that
                 # must be a transposed view (its InnerLimit axis is then M), one (K, N) weight
                 # that must not be, output (G, M, N) (Meta), group_list over K with its last
                 # end (cumsum) or sum (counts) <= K, no bias, non-quantised dtypes only
                 "k_split_x_transposed": True,
                 "k_split_weight_transposed": False,
                 "k_split_bias": False,
                 # [inferred] an empty K group's output is zeros: MindSpeed and others use the
                 # group_type 2 output as the expert weight gradient directly, with experts
                 # that receive no tokens; the docs do not say it, the stand-in zero-fills.
                 "k_split_empty_group": "zeros",
                 # [unverified] torchair's GE converter (custom/grouped_matmul.py) passes
                 # transpose_x=False for every group_type and lowers the x^T view as its own
                 # Transpose; whether GE folds it into the K-split kernel's transposed x has
                 # not been run on hardware (reduce-overhead / npugraph_ex pass the view)
                 "k_split_ge_transpose_x": "unverified",
                 "310p_n_multiple": 16,
                 # quantised experts (D, Tensor group_list; aclnnGroupedMatmulV4 约束说明), group_type 0 with
                 # one (E, K, N) weight: weight-only int8 is per-channel only (per-group needs int4
                 # weights packed 8 per int32); per-token W8A8 takes a bf16 scale for a bf16 output and
                 # an fp32 one for fp16; Atlas inference (310P) takes no scale of any kind
                 "antiquant_int8_per_group": False,
                 "pertoken_scale_dtype_for_output": {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32},
                 "quant_socs_excluded": ("Ascend310P",),
             },
             doc="op_semantics 7 / torch_npu docstring (_op_plugin_docs.py npu_grouped_matmul): float "
             "x/weight fp16/bf16/fp32 (310P fp16 only, N % 16 == 0), group_type 0 needs split_item 2/3, "
             "a 3-D weight and a group_list of at most 1024 groups (128 for weight lists), cumsum "
             "(group_list_type 0) or counts (1), InnerLimit 65536, weight may be transposed, x not; "
             "group_type 2 (CANN aclnnGroupedMatmulV5, ops-transformer gmm/grouped_matmul docs): x "
             "transposed, weight not, split_item 2/3, no bias, output (G, M, N) (the wheel's Meta); "
             "products A2/A3 and Atlas inference; no autograd in torch_npu (our rule: autograd_rule); quantised "
             "(D formulas 3, 4; A2/A3 only): weight-only int8 per-channel with antiquant_scale / offset (E, N) in "
             "x's dtype, and per-token int8 x int8 with scale (E, N) (bf16 -> bf16 out, fp32 -> fp16 out) and "
             "per_token_scale (M,) fp32",
         ))  # no autograd in torch_npu (op_semantics 7)
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                       group_type=None, group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                       x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    # op_semantics 7. group_type=0, the MoE expert GEMM: rows of x split into contiguous
    # groups, group e times weight e (+ bias e); rows past the last group are untouched on
    # the NPU: zeros here. A transposed view of an (E, N, K) weight is just another (E, K, N)
    # tensor to matmul. group_type=2, the expert weight gradient: the K axis of x (M, K) and
    # weight (K, N) split into contiguous groups, out[g] = x[:, K_g] @ weight[K_g]; an empty
    # group gives zeros (no K to sum over). group_list_type=0: inclusive cumulative END
    # offsets along the grouped axis; 1: per-group counts.
    quant = dict(zip(_GMM_QUANT_ARGS, (scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                       activation_input, activation_quant_scale, activation_quant_offset)))
    groups, n = _gmm_plan(x, weight, bias, group_list, split_item, group_type, group_list_type, act_type,
                          output_dtype, (x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype), quant)
    xt = x[0]
    if xt.dtype == torch.int8 or antiquant_scale is not None:
        return [_gmm_quantised(xt, weight[0], scale, antiquant_scale, antiquant_offset, per_token_scale,
                               _gmm_group_ends(group_list, group_list_type, xt.shape[0], "rows"), output_dtype)]
    axis = 0 if group_type == 0 else 1  # the grouped axis of x: M, or K
    ends = _gmm_group_ends(group_list, group_list_type, xt.shape[axis], "rows" if axis == 0 else "columns (K)")
    acc = _compute_dtype(xt)
    if group_type == 2:
        out = xt.new_zeros((groups, xt.shape[0], n), dtype=acc)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[g] = xt[:, start:end].to(acc) @ weight[0][start:end].to(acc)
            start = end
        return [out.to(xt.dtype)]
    out = xt.new_zeros((xt.shape[0], n), dtype=acc)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            w = weight[0][e] if len(weight) == 1 and weight[0].dim() == 3 else weight[e]
            y = xt[start:end].to(acc) @ w.to(acc)
            if bias is not None:
                y = y + (bias[0][e] if bias[0].dim() == 2 else bias[e]).to(acc)
            out[start:end] = y
        start = end
    return [out.to(xt.dtype)]


def _gmm_quantised(xt, w, scale, antiquant_scale, antiquant_offset, per_token_scale, ends, output_dtype):
    """The quantised expert GEMMs (_gmm_quant_plan), rows past the last end zeros.

    per-token (D formula 3, aclnnGroupedMatmulV4 动态量化): y = (x @ w) * scale[e] * per_token_scale,
    the int8 product exact in int32 on the cube unit, scaled in fp32 (scale[n], then the row's
    per-token scale) and rounded once to the output dtype. [inferred] the scaling order and
    precision are npu_quant_matmul's per-token kernel's (quant_batch_matmul_v3_pertoken.h, quant.py),
    the same dequant step as the grouped kernel's documented formula; the two fp32 multiplies
    commute up to one fp32 rounding.
    weight-only (D formula 4): y = x @ ((w + antiquant_offset[e]) * antiquant_scale[e]).
    [inferred] dequantized as npu_weight_quant_batchmatmul's kernel does (fp32 for a bf16 x, fp16
    for fp16: the add, then the multiply, each rounded there), the weight rounded to x's dtype,
    the product accumulated in fp32: for an int8 weight and no offset this is exactly one
    rounding of w * scale to x's dtype whatever the intermediate precision."""
    out_dtype = dtype_of_argument(output_dtype) if output_dtype else xt.dtype
    out = torch.zeros((xt.shape[0], w.shape[-1]), dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            rows = xt[start:end]
            if xt.dtype == torch.int8:
                acc = (rows.double() @ w[e].double()).to(torch.int32)  # exact: |sum| < 2^31
                out[start:end] = acc.float() * scale[0][e].float() * per_token_scale[0][start:end, None]
            else:
                compute = torch.float32 if xt.dtype == torch.bfloat16 else torch.float16
                dequantized = w[e].to(compute)
                if antiquant_offset is not None:
                    dequantized = dequantized + antiquant_offset[0][e].to(compute)
                dequantized = (dequantized * antiquant_scale[0][e].to(compute)).to(xt.dtype)
                out[start:end] = rows.float() @ dequantized.float()
        start = end
    return out.to(out_dtype)


def _gmm_group_ends(group_list, group_list_type, length, what):
    """The cumulative group ends along the grouped axis (of `length`), from a cumsum or
    counts group_list; refuses a list no NPU kernel would take."""
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 0:
        if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
            raise RuntimeError(f"npu_grouped_matmul: a cumsum group_list (group_list_type=0) must be "
                               f"non-negative and non-decreasing, got {values}")
        ends = values
    else:
        if any(v < 0 for v in values):
            raise RuntimeError(f"npu_grouped_matmul: counts (group_list_type=1) must be non-negative, "
                               f"got {values}")
        ends = torch.tensor(values, dtype=torch.int64).cumsum(0).tolist() if values else []
    if ends and ends[-1] > length:
        raise RuntimeError(f"npu_grouped_matmul: group_list covers {ends[-1]} {what}, x has {length}")
    return ends


# =====================================================================================
# Expert parallel: npu_moe_re_routing (the regroup after the token all-to-all)
# =====================================================================================
def _check_re_routing(tokens, counts, per_token_scales, expert_token_num_type, idx_type, tokens_dtype) -> None:
    op = "npu_moe_re_routing"
    if tokens.dim() != 2 or counts.dim() != 2:
        raise RuntimeError(f"{op}: needs tokens (A, H) and expert_token_num_per_rank (ranks, local experts), "
                           f"got {tuple(tokens.shape)} and {tuple(counts.shape)}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{op}: expert_token_num_per_rank must be int32 or int64, got {counts.dtype}")
    if per_token_scales is not None and (per_token_scales.dim() != 1
                                         or per_token_scales.shape[0] != tokens.shape[0]):
        raise RuntimeError(f"{op}: per_token_scales must be (A,) = ({tokens.shape[0]},), got "
                           f"{tuple(per_token_scales.shape)}")
    # the docs and the kernels: count mode and the gather index only (950 adds idx_type 1,
    # whose layout no reference here computes)
    if expert_token_num_type != 1:
        raise NotImplementedError(f"{op}: expert_token_num_type={expert_token_num_type}: only 1 (counts) is "
                                  "supported by the op")
    if idx_type != 0:
        raise NotImplementedError(f"{op}: idx_type={idx_type}: only 0 (the gather index) has a CPU reference")
    if tokens_dtype is not None:
        raise NotImplementedError(f"{op}: tokens_dtype={tokens_dtype} (fp8/fp4 bit patterns) has no CPU "
                                  "reference")


def _re_routing_fake(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                     idx_type=0, tokens_dtype=None):
    _check_re_routing(tokens, expert_token_num_per_rank, per_token_scales, expert_token_num_type, idx_type,
                      tokens_dtype)
    # The wheel's Meta function (op_plugin/meta/_meta_registrations.py, npu_moe_re_routing_meta):
    # every size comes from the inputs' sizes, none from the counts' values. After an
    # all-to-all A is the data-dependent row count of the received tokens (an unbacked
    # SymInt under torch.compile): the outputs carry that same A.
    rows = tokens.shape[0]
    scales = (tokens.new_empty((rows,), dtype=torch.float32) if per_token_scales is None
              else per_token_scales.new_empty(per_token_scales.shape))
    return (tokens.new_empty(tokens.shape), scales, tokens.new_empty((rows,), dtype=torch.int32),
            expert_token_num_per_rank.new_empty((expert_token_num_per_rank.shape[1],)))


@op_spec("npu::npu_moe_re_routing",
         schema="npu_moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *, Tensor? per_token_scales=None, "
                "int expert_token_num_type=1, int idx_type=0, int? tokens_dtype=None) -> (Tensor, Tensor, Tensor, "
                "Tensor)",
         fake=_re_routing_fake, samples=_re_routing_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16, torch.int8}),  # tokens (950: fp8/fp4 too)
             min_rank=2,  # tokens (A, H)
             max_rank=2,
             backward=None,  # no autograd in torch_npu ...
             # ... so training graphs call it through our rule (backward: npu_moe_token_unpermute,
             # as torchtitan-npu's NPUMoeReRouting)
             autograd_rule="npu_fx_fusion.patterns.moe_dispatch.ReRouting",
             ge_converter=True,  # custom/npu_moe_re_routing.py -> GE MoeReRouting
             # torch_npu doc: Atlas A2/A3; the CANN README adds 950 and Kirin (no bf16 there)
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "max_hidden": 16384,  # exclusive: 0 < H < 16384
                 "counts_dtypes": (torch.int32, torch.int64),  # (ranks, local experts)
                 "expert_token_num_types": (1,),  # counts
                 "idx_types": (0,),  # the gather index (950 adds 1, scatter)
                 # the torch_npu doc says the counts "must be > 0" (取值必须大于0); the CANN
                 # kernels copy nothing for a zero count (moe_re_routing.h: zero ubFactor
                 # chunks and no tail; arch35 moe_re_routing_re_regbase.h: `if (currTokenNum
                 # == 0) continue;`) and the host cannot read the device counts: zeros are
                 # computed, not refused (docs/expert-parallel.md)
                 "zero_counts": "computed (kernel source), against the doc's > 0",
             },
             doc="op_semantics 6.5 / torch_npu doc (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/"
             "torch_npu-npu_moe_re_routing.md) and the CANN README (ops-transformer moe/moe_re_routing): "
             "tokens (A, H) fp16/bf16/int8, 0 < H < 16384, expert_token_num_per_rank (N, E) int32/int64 "
             "summing to A, per_token_scales (A,) fp32, expert_token_num_type 1 and idx_type 0 only; "
             "outputs sized from the inputs (the wheel's Meta); products A2/A3 (950 in the CANN README); "
             "no autograd",
         ))  # no autograd in torch_npu
def npu_moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                       idx_type=0, tokens_dtype=None):
    # op_semantics 6.5 and the CANN README (ops-transformer moe/moe_re_routing): the tokens
    # arrive rank-major (for each source rank r its local-expert buckets e in order, counts
    # [r, e] rows each); the output is expert-major (for each e, the buckets of every r in
    # rank order). permute_token_idx is the gather index (output row -> input row),
    # expert_token_num the per-expert counts, in the counts' dtype. A pure copy: exact in
    # every dtype.
    #
    # Zero counts. The torch_npu doc says the counts "must be > 0"; the kernels do not need
    # it: the A2/A3 kernel (op_kernel/moe_re_routing.h) copies counts[r, e] rows in
    # ubFactor-sized chunks plus a tail, zero chunks and no tail for a zero count, and the
    # offsets add the zero; the arch35 one (op_kernel/arch35/moe_re_routing_re_regbase.h)
    # skips a zero count explicitly (`if (currTokenNum == 0) continue;`). The host cannot
    # check device values. So an empty bucket is computed as an empty copy, here too
    # (docs/expert-parallel.md).
    _check_re_routing(tokens, expert_token_num_per_rank, per_token_scales, expert_token_num_type, idx_type,
                      tokens_dtype)
    counts = expert_token_num_per_rank
    ranks, experts = counts.shape
    values = [int(v) for v in counts.reshape(-1).tolist()]
    if any(v < 0 for v in values):
        raise RuntimeError(f"npu_moe_re_routing: negative token counts {values}")
    if sum(values) != tokens.shape[0]:
        raise RuntimeError(f"npu_moe_re_routing: the counts add up to {sum(values)} tokens, tokens has "
                           f"{tokens.shape[0]} rows (Sum(expert_token_num_per_rank) must equal A)")
    starts = [0]
    for v in values:
        starts.append(starts[-1] + v)  # rank-major source offsets
    pieces = [torch.arange(starts[r * experts + e], starts[r * experts + e] + values[r * experts + e],
                           dtype=torch.int64, device=tokens.device)
              for e in range(experts) for r in range(ranks)]
    index = torch.cat(pieces) if pieces else torch.zeros((0,), dtype=torch.int64, device=tokens.device)
    scales = (per_token_scales[index] if per_token_scales is not None
              else tokens.new_zeros((tokens.shape[0],), dtype=torch.float32))  # undefined on the NPU
    return (tokens[index].contiguous(), scales.contiguous(), index.to(torch.int32),
            counts.sum(dim=0).to(counts.dtype))
