"""moe_gating: softmax router top-k -> npu_moe_gating_top_k_softmax.

    weights, experts = topk(softmax(router_logits, -1), k)        (fp32 logits)

becomes `y, expert_idx, _ = npu_moe_gating_top_k_softmax(router_logits, None, k)` with
`experts = expert_idx.long()` (op_semantics.md 5.1: softmax in fp32, the k largest in
descending order, no renormalisation, expert ids as int32). That is Qwen2/Qwen3-MoE and
Mixtral's router: transformers computes the softmax in fp32 (`dtype=torch.float`), so the
matched subgraph starts at the fp32 logits and the op runs in fp32 too; a renormalisation
(`norm_topk_prob`) and the cast back stay in the graph after it, unchanged.

Ties: which of two experts of exactly equal probability a top-k returns is unspecified
for torch.topk and the NPU op alike (the stand-in takes the lower index). bf16 logits tie
often; the fused graph may then route a token to the other, equally ranked expert.

Biased routers -> npu_moe_gating_top_k. The choice is made on `scores + bias`, the weights
are the unbiased scores of the chosen experts (op_semantics.md 5.2):

  - transformers DeepSeek-V3 / V3.2 `noaux_tc`: sigmoid, correction bias, the best
    `topk_group` of `n_group` groups by the sum of each group's top 2, the others -inf,
    top-k, weights renormalised (+1e-20) and scaled;
  - torchtitan's TokenChoiceTopKRouter with an expert bias: softmax, no groups, no
    renormalisation (its debugmodel); sigmoid with node-limited groups and route_norm
    (its DeepSeek-V3 flavors). The router also returns its full scores: the op's
    `norm_out` (out_flag=True).

All of them take the top-k with sorted=False, so the order of the k experts is whatever
the unfused kernel produced, and the fused op returns them in descending order. The
rewrite is exact only where nothing depends on that order, so each site is accepted only
once every use of its expert ids and weights is one that is indifferent to it: the fused
MoE dispatch (init_routing sorts the pairs by expert, finalize_routing sums each token's
k rows, and so do MC2's dispatch_v2 / combine_v2; moe_dispatch runs before this pass to
put them there) and the one-hot
`scatter(ids, True)` routing map. Any other use, an unfused dispatch for one, leaves the
router unfused with that use named. The sums over k (renormalisation, finalize) then add
in another order: the results agree to rounding, not bit for bit.

Training. The sigmoid forms also run on the joint forward+backward graph, emitting
npu_moe_gating_top_k(out_flag=True) and, in the backward, npu_moe_gating_top_k_backward,
which differentiates the chosen weights through the renormalisation and the sigmoid
(torch_npu: output 0 only, sigmoid mode only). So the torchtitan searches return the full
scores detached: torchtitan uses them for their shape only, and the op's norm_out has no
gradient; a model whose scores get a gradient of their own (an auxiliary loss) does not
match. The softmax routers stay unfused in training (no backward for that mode, and none
for npu_moe_gating_top_k_softmax); the report says so.

Not fused: a sigmoid router without renormalisation (the op's sigmoid mode always
renormalises) and half-precision scores (the op ranks fp32 scores; near ties could pick
other experts). (transformers' noaux_tc with n_group=1 reshapes its group mask with a
view where other group counts copy: canonical.py spells both alike, so it fuses.)

A softmax router with an unsorted top-k (`sorted=False`, no bias) fuses into
npu_moe_gating_top_k_softmax under the same order proof as the biased ones.
"""
import itertools
import operator
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from typing import Optional

import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import (SHAPE_ONLY_OPS, Form, FusionPass, NotEvaluable, Recognized, backward_nodes_by_seq,
                                    backward_region, channels_of, evaluate_slice, real_tensors,
                                    first_refused_use, is_backward, is_call, is_joint_graph, known_equal, same_shape,
                                    tensor_meta)

Node = torch.fx.Node

aten = torch.ops.aten
GATING = CAPABILITIES["npu.npu_moe_gating_top_k_softmax"]
GROUPED = CAPABILITIES["npu.npu_moe_gating_top_k"]
EPS = 1e-20  # the renormalisation's epsilon in transformers and torchtitan, and the op's default


# ---- the unfused form ---------------------------------------------------------------------
def softmax_top_k(router_logits, k):
    probs = torch.softmax(router_logits, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    return weights, experts


def softmax_top_k_unsorted(router_logits, k):
    # the same with sorted=False: the op's descending order is one order it may return,
    # so this fuses where nothing depends on the order (checked as for the biased routers)
    probs = torch.softmax(router_logits, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1, sorted=False)
    return weights, experts


# ---- the fused call -----------------------------------------------------------------------
def npu_moe_gating_top_k_softmax(router_logits, k):
    weights, experts, _row_idx = torch.ops.npu.npu_moe_gating_top_k_softmax(router_logits, None, k)
    return weights, experts.to(torch.int64)


# ---- biased routers: the unfused forms -----------------------------------------------------
def deepseek_noaux_tc(gate_logits, bias, top_k, n_group, topk_group, routed_scaling_factor):
    """transformers DeepseekV3TopkRouter / DeepseekV32TopkRouter (norm_topk_prob=True)."""
    scores = gate_logits.sigmoid()
    choice = scores + bias
    experts = gate_logits.size(-1)
    group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group)
                  .reshape(-1, experts))
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
    return weights * routed_scaling_factor, ids


def torchtitan_softmax_biased(gate_scores, bias, top_k, routed_scaling_factor):
    """torchtitan TokenChoiceTopKRouter: softmax, expert bias, no groups, route_norm=False."""
    scores = torch.softmax(gate_scores, dim=-1)
    ids = torch.topk(scores + bias, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(dim=-1, index=ids)
    return weights * routed_scaling_factor, ids, scores.detach()


def torchtitan_sigmoid_grouped(gate_scores, bias, top_k, n_group, topk_group, routed_scaling_factor):
    """torchtitan TokenChoiceTopKRouter: sigmoid, expert bias, node-limited groups, route_norm."""
    scores = torch.sigmoid(gate_scores)
    choice = scores + bias
    grouped = choice.unflatten(-1, (n_group, choice.size(-1) // n_group))
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.ones_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(-1, group_idx, False)
    choice = grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(-2)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(dim=-1, index=ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
    return weights * routed_scaling_factor, ids, scores.detach()


# ---- biased routers: the fused calls -------------------------------------------------------
def _gating_top_k(logits, bias, top_k, *, norm_type, n_group=1, topk_group=1, routed_scaling_factor):
    """npu_moe_gating_top_k on (..., E) logits: (weights, int64 ids, fp32 scores), shaped like logits."""
    flat = logits.reshape(-1, logits.size(-1))
    # the op takes the bias in the logits' dtype; a bf16 bias (a model cast to bf16) widens
    # exactly, as it does in the unfused `scores + bias`
    weights, ids, scores = torch.ops.npu.npu_moe_gating_top_k(
        flat, top_k, bias=bias.to(logits.dtype), k_group=topk_group, group_count=n_group,
        group_select_mode=1, renorm=0, norm_type=norm_type, out_flag=True,
        routed_scaling_factor=routed_scaling_factor, eps=EPS)
    lead = logits.shape[:-1]
    # norm_out carries no gradient in torch_npu (output_differentiability [true, false, false])
    return (weights.view(*lead, top_k), ids.to(torch.int64).view(*lead, top_k),
            scores.view(logits.shape).detach())


def npu_moe_gating_top_k_noaux_tc(gate_logits, bias, top_k, n_group, topk_group, routed_scaling_factor):
    weights, ids, _ = _gating_top_k(gate_logits, bias, top_k, norm_type=1, n_group=n_group,
                                    topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    return weights, ids


def npu_moe_gating_top_k_softmax_biased(gate_scores, bias, top_k, routed_scaling_factor):
    return _gating_top_k(gate_scores, bias, top_k, norm_type=0, routed_scaling_factor=routed_scaling_factor)


def npu_moe_gating_top_k_sigmoid_grouped(gate_scores, bias, top_k, n_group, topk_group, routed_scaling_factor):
    return _gating_top_k(gate_scores, bias, top_k, norm_type=1, n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=routed_scaling_factor)


# ---- DeepSeek-V4's routers: sqrt(softplus) scores (norm_type 2), top-k or hash-routed ----------
def deepseek_v4_sqrt_softplus_top_k(gate_logits, bias, top_k, routed_scaling_factor):
    """transformers DeepseekV4TopKRouter after its gate GEMM (ACT2FN["sqrtsoftplus"])."""
    scores = torch.nn.functional.softplus(gate_logits).sqrt()
    ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
    return weights * routed_scaling_factor, ids


def deepseek_v4_hash_routing(gate_logits, input_ids, tid2eid, routed_scaling_factor):
    """transformers DeepseekV4HashRouter: the experts come from a frozen token -> experts table."""
    scores = torch.nn.functional.softplus(gate_logits).sqrt()
    ids = tid2eid[input_ids.reshape(-1)].long()
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
    return weights * routed_scaling_factor, ids


def npu_moe_gating_top_k_sqrt_softplus(gate_logits, bias, top_k, routed_scaling_factor):
    weights, ids, _ = _gating_top_k(gate_logits, bias, top_k, norm_type=2,
                                    routed_scaling_factor=routed_scaling_factor)
    return weights, ids


def npu_moe_gating_top_k_hash(gate_logits, input_ids, tid2eid, routed_scaling_factor):
    # hash mode (input_ids with tid2eid): expert_idx = tid2eid[input_ids], the table's order
    weights, ids, _ = torch.ops.npu.npu_moe_gating_top_k(
        gate_logits, tid2eid.shape[1], input_ids=input_ids.reshape(-1), tid2eid=tid2eid, norm_type=2,
        routed_scaling_factor=routed_scaling_factor, eps=EPS)
    return weights, ids.to(torch.int64)


def in_expert_order(outputs, inputs):
    """(weights, ids, ...) with each token's k pairs sorted by expert id: the order-free view
    of an unsorted top-k, under which the unfused and fused routers are compared."""
    weights, ids, *rest = outputs
    ids, order = ids.sort(dim=-1)
    return [weights.gather(-1, order), ids, *rest]


def _biased(search, replace, **training):
    return Form(search, replace, dtypes=(torch.float32,), fused_op="npu.npu_moe_gating_top_k",
                canonical_outputs=in_expert_order, **training)


FORMS = [
    Form(softmax_top_k, npu_moe_gating_top_k_softmax, dtypes=(torch.float32,)),
    Form(softmax_top_k_unsorted, npu_moe_gating_top_k_softmax, dtypes=(torch.float32,),
         canonical_outputs=in_expert_order),
    _biased(deepseek_noaux_tc, npu_moe_gating_top_k_noaux_tc),
    # npu_moe_gating_top_k_backward differentiates the sigmoid mode only: no joint pattern
    _biased(torchtitan_softmax_biased, npu_moe_gating_top_k_softmax_biased, grad_subsets=()),
    _biased(torchtitan_sigmoid_grouped, npu_moe_gating_top_k_sigmoid_grouped),
    # DeepSeek-V4 (norm_type 2: no backward in torch_npu, so no joint patterns). Hash routing keeps
    # the table's order: nothing to canonicalise, and bf16 scores are fine (no selection)
    _biased(deepseek_v4_sqrt_softplus_top_k, npu_moe_gating_top_k_sqrt_softplus, grad_subsets=()),
    Form(deepseek_v4_hash_routing, npu_moe_gating_top_k_hash, dtypes=(torch.float32, torch.bfloat16),
         fused_op="npu.npu_moe_gating_top_k", grad_subsets=()),
]


# ---- checks -------------------------------------------------------------------------------
def _sqrt_softplus_reason(site):
    """norm_type 2 is Ascend 950's (CANN README); the torch_npu docstring lists 0 / 1 only."""
    socs = GROUPED.limits["norm_type_socs"][2]
    return site.hardware_limits([
        f"sqrt-softplus scores (norm_type 2) are {', '.join(socs)} only (and undocumented in torch_npu)"
        if site.soc not in socs else None])


def _check_hash(site):
    logits, input_ids, table = site["gate_logits"], site["input_ids"], site["tid2eid"]
    reason = unsupported("npu.npu_moe_gating_top_k", site.soc, x=logits)
    if reason:
        return reason
    if logits.dim() != 2 or input_ids.numel() != logits.shape[0]:
        return f"{input_ids.numel()} token ids for {list(logits.shape)} logits"
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64) or input_ids.dtype not in (torch.int32,
                                                                                                  torch.int64):
        return f"tid2eid {table.dtype}{list(table.shape)} / input_ids {input_ids.dtype}: the op takes int32/int64"
    k = table.shape[1]
    if not 1 <= k <= min(logits.shape[-1], GROUPED.limits["hash_mode_max_k"]):
        return f"{k} experts per token from the table: hash mode takes 1..{GROUPED.limits['hash_mode_max_k']}"
    if logits.shape[-1] > GROUPED.limits["max_experts"]:
        return f"{logits.shape[-1]} experts: npu_moe_gating_top_k takes at most {GROUPED.limits['max_experts']}"
    return _sqrt_softplus_reason(site)


def check(site):
    if site.form.search is deepseek_v4_hash_routing:
        return _check_hash(site)
    if site.form.search is deepseek_v4_sqrt_softplus_top_k or site.args.get("norm_type") == 2:
        return _check_biased(site) or _sqrt_softplus_reason(site)
    if site.form.fused_op == "npu.npu_moe_gating_top_k":
        return _check_biased(site)
    logits, k = site["router_logits"], site["k"]
    reason = unsupported("npu.npu_moe_gating_top_k_softmax", site.soc, x=logits)
    if reason:
        return reason
    if logits.dtype != torch.float32:
        # a half softmax rounds the probabilities the top-k compares; the op compares fp32
        return (f"softmax over {str(logits.dtype)[6:]} logits: npu_moe_gating_top_k_softmax "
                "ranks fp32 probabilities and could choose other experts in near ties")
    experts = logits.shape[-1]
    if not 0 < k <= min(experts, GATING.limits["max_k"]):
        return f"k = {k} with {experts} experts: npu_moe_gating_top_k_softmax takes 0 < k <= E, k <= 1024"
    if site.form.search is softmax_top_k_unsorted or site.args.get("unsorted"):
        return _order_reason(site, k)
    return None


def _order_reason(site, k):
    use = order_dependent_use(site, k)
    if use is not None:
        return (f"the order of the k experts (unsorted top-k) reaches {use.name} ({use.target}): "
                "the fused op returns them in another order, and only the fused MoE dispatch "
                "and the routing map are proven indifferent to it")
    return None


def _check_biased(site):
    logits = site["gate_logits"] if "gate_logits" in site.args else site["gate_scores"]
    bias, top_k = site["bias"], site["top_k"]
    groups = site.args.get("n_group", 1)
    kept_groups = site.args.get("topk_group", 1)
    experts = logits.shape[-1]
    # the op takes (tokens, E): the torchtitan forms flatten (B, L, E) for it
    reason = unsupported("npu.npu_moe_gating_top_k", site.soc, x=logits[..., 0, :] if logits.dim() > 2 else logits)
    if reason:
        return reason
    if logits.dtype != torch.float32:
        return (f"scores over {str(logits.dtype)[6:]} logits: npu_moe_gating_top_k ranks fp32 scores "
                "and could choose other experts in near ties")
    if bias is not None and (bias.shape != (experts,) or torch.promote_types(bias.dtype, logits.dtype) != logits.dtype):
        return (f"the bias is {str(bias.dtype)[6:]}{list(bias.shape)}: npu_moe_gating_top_k takes "
                f"({experts},) in the logits' dtype")
    limits = GROUPED.limits
    if experts > limits["max_experts"]:
        return f"{experts} experts: npu_moe_gating_top_k takes at most {limits['max_experts']}"
    if experts % groups or experts // groups < limits["min_group_size"]:
        return (f"{experts} experts in {groups} groups: npu_moe_gating_top_k needs groups of at least "
                f"{limits['min_group_size']} experts")
    group_size = experts // groups
    if -(-group_size // 32) * 32 * groups > limits["max_aligned_experts"]:
        return f"groups of {group_size} padded to 32 exceed {limits['max_aligned_experts']} experts"
    if not 1 <= kept_groups <= groups or not 1 <= top_k <= kept_groups * group_size:
        return f"top-{top_k} of the best {kept_groups} of {groups} groups is outside the op's range"
    return _order_reason(site, top_k) if site.args.get("unsorted", True) else None


# Ops that pass a tensor on without reordering its last (k) dim.
_PASS_ON = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default,
            aten.clone.default, aten.alias.default)


def _indifferent_to_k_order(user, value):
    """`user` reads `value` (expert ids or weights, k per token) without caring about k's order."""
    npu = torch.ops.npu
    if is_call(user, npu.npu_moe_init_routing_v2):
        # sorted by expert; for one expert the rows stay in token order (ids of one token differ)
        return user.args[1] is value
    if is_call(user, npu.npu_moe_finalize_routing):
        # the weighted sum of each token's k rows: scales and expert ids, never the row map
        return value in (user.args[4], user.args[6]) and user.args[5] is not value
    if is_call(user, npu.npu_moe_distribute_dispatch_v2):
        # MC2: each pair sent to its expert's rank, one expert's rows in token order (ids of one
        # token differ); its assist info records each row's k for the combine below
        return user.args[1] is value
    if is_call(user, npu.npu_moe_distribute_combine_v2):
        # MC2: the weighted sum of each token's k rows, by the ids and scales in one order
        return value in (user.args[1], user.args[4])
    if is_call(user, npu.npu_moe_token_permute):
        # stable sort by expert: for one expert the rows stay in token order
        return user.args[1] is value
    if is_call(user, npu.npu_moe_token_unpermute):
        # each token's k rows weighted and summed; the row map comes from the permute
        return user.args[2] is value and user.args[1] is not value
    if is_call(user, npu.npu_moe_token_unpermute_grad_v2):
        # the backward of that sum, with the same probs and row map
        return user.args[4] is value and user.args[1] is not value
    if is_call(user, aten.histc.default):
        # tokens per expert (transformers' offsets, recounted by its trainable dispatch)
        return user.args[0] is value
    if is_call(user, aten.sum.dim_IntList) and user.args[0] is value:
        # a sum over the k slots (a renormalisation's): the same value in any order, to rounding
        meta = tensor_meta(value)
        return meta is not None and list(user.args[1]) in ([-1], [meta.dim() - 1])
    if is_call(user, aten.scatter.value):
        # the one-hot routing map: the same value written at each chosen expert
        return user.args[2] is value and user.args[1] in (-1, tensor_meta(user).dim() - 1)
    return False


def _keeps_k_order(user, value):
    """`user` gives each of the k slots of `value` the same treatment, so its result is k
    wide in the same order (its uses are checked in turn): a view or cast, or a division
    or product by a scalar or by a tensor broadcast over k (a renormalisation by the sum
    of the k weights, which _indifferent_to_k_order accepts)."""
    if is_call(user, *_PASS_ON, torch.ops.npu._npu_dtype_cast.default):
        return True
    if is_call(user, aten.div.Tensor, aten.mul.Tensor) and value in user.args[:2]:
        if is_call(user, aten.div.Tensor) and user.args[0] is not value:
            return False
        other = user.args[1] if user.args[0] is value else user.args[0]
        meta = tensor_meta(other)
        return not isinstance(other, torch.fx.Node) or (meta is not None and meta.dim() > 0 and meta.shape[-1] == 1)
    return False


def order_dependent_use(site, top_k):
    """The first node outside the site that depends on the order of its k experts, or None."""
    k_wide = [node for node in site.nodes
              if (meta := tensor_meta(node)) is not None and meta.dim() and meta.shape[-1] == top_k]
    # in a joint graph the router's own backward (the nodes autograd made for its ops, which
    # carry their seq_nr) is replaced with it
    own = {node.meta.get("seq_nr") for node in site.nodes} - {None}

    def indifferent(user, value):
        return _indifferent_to_k_order(user, value) or (is_backward(user) and user.meta.get("seq_nr") in own)

    return first_refused_use(site, indifferent, _keeps_k_order, outputs=k_wide)


# ---- near misses: a router top-k left unfused ---------------------------------------------
def _is_sqrt_softplus(node):
    """sqrt(softplus(x)), however the softplus is spelled (_act_of: the router reading's own test)."""
    act = _act_of(node) if isinstance(node, torch.fx.Node) else None
    return act is not None and act[0] == "sqrt_softplus"


def _router_scores(node):
    """The softmax / sigmoid / sqrt(softplus) a top-k selects experts from (through masks and bias adds)."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        if is_call(node, aten._softmax.default, aten.sigmoid.default) or _is_sqrt_softplus(node):
            return node
        if not node.all_input_nodes:
            return None
        node, seen = node.all_input_nodes[0], seen + 1
    return None


def _hash_lookup(gather):
    """A gather of router scores at experts read from a table (tid2eid[input_ids]): the lookup."""
    ids = gather.args[2] if len(gather.args) > 2 else None
    while is_call(ids, aten._to_copy.default, aten.view.default):
        ids = ids.args[0]
    return ids if is_call(ids, aten.index.Tensor) else None


def anchor(node):
    """A top-k over one score per expert: its input is as wide as the softmax / sigmoid it
    comes from (noaux_tc's top-k over groups, or within a group, is narrower); or a hash
    router's gather of its scores at a table's experts."""
    if is_call(node, aten.gather.default):
        return _router_scores(node.args[0]) is node.args[0] and _hash_lookup(node) is not None
    if not is_call(node, aten.topk.default):
        return False
    scores, chosen_from = _router_scores(node.args[0]), tensor_meta(node.args[0])
    scores_val = tensor_meta(scores)
    return (scores_val is not None and chosen_from is not None and chosen_from.dim() > 0
            and chosen_from.shape[-1] == scores_val.shape[-1])


def explain(topk):
    scores = _router_scores(topk.args[0])
    if is_joint_graph(topk.graph):
        reason = _training_reason(scores)
        if reason:
            return reason
    elif scores is not None and any(user.op == "output" for user in scores.users):
        # the forward of a partitioned training graph (the joint graph's near miss said why), whose
        # forms do not match here because the scores are saved for the backward
        reason = _training_reason(scores)
        if reason:
            return f"{reason} (here, the forward of a training step: its scores are saved for the backward)"
    if is_call(topk, aten.gather.default):
        return ("a hash router (scores gathered at tid2eid[input_ids]) other than transformers' "
                "DeepseekV4HashRouter (sqrt-softplus scores, renormalised with 1e-20, scaled)")
    if _is_sqrt_softplus(scores):
        return ("a sqrt-softplus router that matches neither DeepSeek-V4 form (biased unsorted top-k, "
                "the chosen unbiased scores renormalised with 1e-20 and scaled)")
    if is_call(scores, aten.sigmoid.default):
        return ("a sigmoid router that matches none of the biased forms (transformers noaux_tc, "
                "torchtitan's grouped router): npu_moe_gating_top_k's sigmoid mode always "
                "renormalises the chosen weights and scales them once, after the renormalisation")
    if topk.args[0] is not scores:
        changed = topk.args[0]
        if is_call(changed, aten.add.Tensor) and isinstance(changed.args[1], torch.fx.Node):
            return (f"a bias ({changed.args[1].name}) is added to the softmax before the top-k, "
                    "in a form other than torchtitan's (weights = the chosen unbiased scores, "
                    "times a scale)")
        return "the softmax is masked or changed before the top-k"
    return None


def _training_reason(scores):
    """Why a router in a training (joint) graph cannot train through the fused op, if so."""
    if _is_sqrt_softplus(scores):
        return ("a sqrt-softplus router in training (DeepSeek-V4): npu_moe_gating_top_k_backward "
                "differentiates the sigmoid mode only (norm_type 1), not norm_type 2")
    if is_call(scores, aten._softmax.default):
        return ("a softmax router in training: npu_moe_gating_top_k_backward differentiates the "
                "sigmoid mode only, and npu_moe_gating_top_k_softmax has no backward")
    if is_call(scores, aten.sigmoid.default):
        for user in scores.users:
            if is_call(user, aten.sigmoid_backward.default) and not is_call(user.args[0], aten.scatter_add.default):
                return ("the full scores get a gradient of their own (e.g. an auxiliary loss), besides "
                        "the chosen weights': npu_moe_gating_top_k's norm_out has no gradient in torch_npu")
    return None


# =============================================================================================
# Routers recognised by what they compute
# =============================================================================================
# The forms above are the routers of transformers and torchtitan as they spell them. Any
# other spelling of the same computation is read here, piece by piece, each piece by what it
# computes rather than by how it is written:
#
#   scores  = act(logits)          a softmax over the experts, a sigmoid, or sqrt(softplus)
#   choice  = scores + bias        optional; read with the channel algebra: choice_j is
#                                  scores_j + bias_j, however it is broadcast or viewed
#   choice  = groups kept          optional: choice_j where expert j's group is among the
#                                  k_group best (each group's top-2 sum, or its max), else -inf;
#                                  the mask is run on every choice of groups (evaluate_slice)
#   ids     = topk(choice, k)      or the top-k of the logits themselves where nothing is added
#                                  (each act is increasing: the same experts, in the same order)
#   weights = scores at ids        a gather, the top-k's own values, or a softmax over the k
#                                  chosen logits (= the chosen scores over their sum)
#   weights / (sum + eps), * scale, casts     the steps after, read one at a time
#
# The fused op computes its part of that (npu_moe_gating_top_k_softmax: a softmax top-k;
# npu_moe_gating_top_k: a bias, groups, and for sigmoid / sqrt-softplus the renormalisation
# and one scale); the steps it does not compute are replayed after it as the model wrote them.
_INCREASING = {"softmax": 0, "sigmoid": 1, "sqrt_softplus": 2}  # act -> the op's norm_type
_MAX_GROUP_CHOICES = 20000  # group choices the mask is run on (every one; more: not checked)


class _NotRouter(Exception):
    """The top-k is no router the reading knows (no near miss of its own)."""


@dataclass
class _Router:
    topk: Node
    ids: Node
    k: int
    sorted: bool
    act: str
    act_node: Optional[Node]
    logits: Node  # the act's input: what the op takes
    bias: Optional[Node] = None
    groups: Optional[tuple] = None  # (n_group, k_group, group_select_mode)
    weights: Optional[Node] = None  # the chosen experts' scores (or their renormalised softmax)
    renormalised: bool = False  # weights is already the chosen scores over their sum (eps 0)
    steps: list = field(default_factory=list)  # [(kind, node, constant)] after the weights
    nodes: set = field(default_factory=set)
    notes: list = field(default_factory=list)
    compute_dtype: Optional[torch.dtype] = None  # the logits' dtype for the op, if not theirs


def _is_cast(node):
    """A dtype cast: .to(dtype) as aot spells it, or torch_npu's own (an NPU compile's)."""
    return is_call(node, aten._to_copy.default, torch.ops.prims.convert_element_type.default) or \
        getattr(getattr(node, "target", None), "__name__", "").startswith("_npu_dtype_cast")


def _cast_source(node):
    """`node` without the casts on it."""
    while _is_cast(node):
        node = node.args[0]
    return node


def _act_of(node):
    """(act name, its input) when `node` computes one of the router's score functions."""
    if is_call(node, aten._softmax.default):
        return ("softmax", node.args[0]) if node.args[1] in (-1, tensor_meta(node).dim() - 1) else None
    if is_call(node, aten.sigmoid.default):
        return "sigmoid", node.args[0]
    if is_call(node, aten.sqrt.default) and is_call(node.args[0], aten.softplus.default):
        softplus = node.args[0]
        if tuple(softplus.args[1:3]) in ((), (1,), (1, 20), (1.0, 20.0)):
            return "sqrt_softplus", softplus.args[0]
    if is_call(node, aten.sqrt.default) and isinstance(node.args[0], Node):
        source = _softplus_source(node.args[0])
        if source is not None:
            return "sqrt_softplus", source
    return None


# a softplus spelled elementwise (torchtitan-npu V4: log1p(exp(-|x|)) + relu(x)) is recognised by
# running it: on these values it must give F.softplus's within _SOFTPLUS_ULPS (the same function,
# rounded in another order: the op's own softplus is not bit-identical to either)
_SOFTPLUS_PROBE = (-100.0, -20.0, -3.0, -1.0, -0.25, -1e-3, 0.0, 1e-3, 0.25, 1.0, 3.0, 15.0, 20.0, 25.0, 100.0)
_SOFTPLUS_ULPS = 4
_MAX_SOFTPLUS_NODES = 12


def _softplus_source(node):
    """x, when `node` is an elementwise function of the one tensor x that computes softplus(x)."""
    region, sources, pending = set(), set(), [node]
    while pending:
        current = pending.pop()
        if current in region:
            continue
        pointwise = current.op == "call_function" and torch.Tag.pointwise in getattr(current.target, "tags", ())
        if not pointwise or current is not node and len(region) >= _MAX_SOFTPLUS_NODES:
            sources.add(current)
            continue
        region.add(current)
        pending.extend(current.all_input_nodes)
    if len(sources) != 1 or len(region) < 2:
        return None
    (source,) = sources
    meta = tensor_meta(source)
    if meta is None or meta.dtype != torch.float32 or tensor_meta(node).dtype != torch.float32:
        return None
    with real_tensors():
        probe = torch.tensor(_SOFTPLUS_PROBE, dtype=torch.float32)
        try:
            (value,) = evaluate_slice([node], {source: probe}, limit=_MAX_SOFTPLUS_NODES)
        except NotEvaluable:
            return None
        expected = F.softplus(probe)
        if value.shape != probe.shape or value.dtype != torch.float32:
            return None
        allowed = _SOFTPLUS_ULPS * (torch.nextafter(expected, torch.full_like(expected, float("inf"))) - expected)
        return source if bool(((value - expected).abs() <= allowed).all()) else None


def _linear_terms(poly, value):
    """{(leaf, flat index): coefficient} and the constant of one channel's polynomial, or None
    for a product (a channel that is not linear in the leaves)."""
    terms, constant = {}, 0.0
    for mono, coef in poly.items():
        if not mono:
            constant = coef
        elif len(mono) == 1:
            factor = value.factor(mono[0])
            if factor.part:
                return None
            terms[(factor.leaf, factor.index)] = coef
        else:
            return None
    return terms, constant


def _read_sum_of(node, experts):
    """{leaf: None} when channel j of `node` is the sum of leaf channels j (each leaf's last
    dim `experts` wide, broadcast over the tokens): the scores and an additive bias. Raises
    _NotRouter for anything else, with the reason as its message where it is a router's."""
    try:
        value = channels_of(node)
    except NotEvaluable:
        raise _NotRouter(None) from None
    if len(value.channels) != experts:
        raise _NotRouter(None)
    leaves = None
    for j, poly in enumerate(value.channels):
        read = _linear_terms(poly, value) if isinstance(poly, dict) else None
        if read is None:
            raise _NotRouter(None)
        terms, constant = read
        if constant:
            raise _NotRouter(f"a constant {constant:g} is added to the router's scores before the top-k: "
                             "the op selects and weights with the scores themselves")
        if any(coef != 1.0 for coef in terms.values()):
            raise _NotRouter("the router's scores are scaled before the top-k: the op selects on the scores "
                             "themselves (plus a bias)")
        here = {leaf: index for (leaf, index) in terms}
        if leaves is None:
            leaves = set(here)
        if set(here) != leaves or any(index != j for index in here.values()):
            raise _NotRouter(None)
    return leaves


def _through_views(node):
    """The nodes of a chain of reshapes (view, reshape, unsqueeze, ...) from `node` up."""
    chain = []
    while is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                  aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.clone.default):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _masked(choice, experts):
    """(masked node, the choice before the mask, mask, fill, where-true-means-kept) when the
    top-k's input is a masked copy of the choice (through reshapes), else None."""
    try:
        value = channels_of(choice)
    except NotEvaluable:
        return None
    leaf, in_order = None, True
    for j, poly in enumerate(value.channels):
        read = _linear_terms(poly, value) if isinstance(poly, dict) else None
        if read is None or read[1] or len(read[0]) != 1:
            return None
        ((node, index), coef), = read[0].items()
        if coef != 1.0 or leaf not in (None, node):
            return None
        leaf, in_order = node, in_order and index == j
    if leaf is None:
        return None
    if not in_order:
        if is_call(leaf, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self):
            raise _NotRouter("the experts are reordered between the group mask and the top-k (groups of "
                             "interleaved experts?): npu_moe_gating_top_k's groups are runs of E / group_count "
                             "consecutive experts")
        return None
    if is_call(leaf, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        data, mask, fill = leaf.args[:3]
        return leaf, data, mask, fill, False
    if is_call(leaf, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
        cond, a, b = leaf.args[:3]
        fill_a, fill_b = _constant(a), _constant(b)
        if fill_b is not None and fill_a is None:
            return leaf, a, cond, fill_b, True
        if fill_a is not None and fill_b is None:
            return leaf, b, cond, fill_a, False
    return None


def _constant(arg):
    """The number `arg` is: a Python number or a 0-d constant tensor made in the graph."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if is_call(arg, aten.full.default) and not arg.all_input_nodes and isinstance(arg.args[1], (int, float)):
        return float(arg.args[1])
    if is_call(arg, aten.scalar_tensor.default) and isinstance(arg.args[0], (int, float)):
        return float(arg.args[0])
    if is_call(arg, aten.lift_fresh_copy.default, aten._to_copy.default, aten.clone.default):
        return _constant(arg.args[0])
    if isinstance(arg, Node) and arg.op == "get_attr":  # torch.tensor(float("-inf")): a constant of the module
        with real_tensors():
            value = getattr(arg.graph.owning_module, arg.target, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
                return float(value.reshape(()).item())
    return None


def _group_scores(group_topk, experts, choice_value):
    """(n_group, group_select_mode, nodes) when the group top-k's input is, per group, the sum of
    the top 2 (mode 1) or the max (mode 0) of the choice's experts of that group."""
    scores = group_topk.args[0]
    nodes = [scores]
    if is_call(scores, aten.sum.dim_IntList) and list(scores.args[1]) == [-1] and \
            is_call(scores.args[0], operator.getitem) and scores.args[0].args[1] == 0 and \
            is_call(scores.args[0].args[0], aten.topk.default):
        top2 = scores.args[0].args[0]
        if top2.args[1] != 2 or (len(top2.args) > 2 and top2.args[2] != -1) or \
                (len(top2.args) > 3 and not top2.args[3]):
            return None
        grouped, mode = top2.args[0], 1
        nodes += [scores.args[0], top2]
    elif is_call(scores, aten.amax.default) and list(scores.args[1]) == [-1]:
        grouped, mode = scores.args[0], 0
    elif is_call(scores, operator.getitem) and scores.args[1] == 0 and is_call(scores.args[0], aten.max.dim) \
            and scores.args[0].args[1] in (-1, tensor_meta(scores.args[0].args[0]).dim() - 1):
        grouped, mode = scores.args[0].args[0], 0
        nodes.append(scores.args[0])
    else:
        return None
    shape = tensor_meta(grouped).shape
    if len(shape) < 2 or not isinstance(shape[-1], int) or not isinstance(shape[-2], int) or \
            shape[-1] * shape[-2] != experts:
        return None
    try:
        value = channels_of(grouped)
    except NotEvaluable:
        return None
    if len(value.channels) != experts or value.channels != choice_value.channels:
        return None  # (the same polynomials of the same leaves: the choice, grouped in order)
    return shape[-2], mode, nodes


def _group_mask_reason(mask, masked, kept_where, group_idx, n_group, k_group, experts):
    """None when `mask`, broadcast to the masked tensor, is true exactly at the experts of the
    groups in group_idx (kept_where) or exactly outside them: checked on every choice of
    k_group of the n_group groups, each in two orders. Else the reason."""
    try:
        lead = [_size_hint(s) for s in tensor_meta(group_idx).shape[:-1]]
        shape = [_size_hint(s) for s in tensor_meta(masked).shape]
    except (TypeError, AttributeError):
        return "the group mask's token count has no hint"
    choices = list(itertools.combinations(range(n_group), k_group))
    if 2 * len(choices) > _MAX_GROUP_CHOICES:
        return f"{len(choices)} choices of {k_group} of {n_group} groups: too many to check the group mask on each"
    rows = [list(c) for c in choices] + [list(reversed(c)) for c in choices]
    with real_tensors():
        return _mask_mismatch(mask, kept_where, group_idx, rows, lead, shape, n_group, experts)


def _size_hint(size):
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _mask_mismatch(mask, kept_where, group_idx, rows, lead, shape, n_group, experts):
    """Runs the mask on the rows of chosen groups, a token each (as many tokens as the graph's)."""
    tokens = 1
    for size in lead:
        tokens *= size
    group_of = torch.arange(experts) // (experts // n_group)
    for start in range(0, len(rows), tokens):
        batch = rows[start:start + tokens]
        batch += [batch[-1]] * (tokens - len(batch))
        idx = torch.tensor(batch, dtype=tensor_meta(group_idx).dtype)
        try:
            (value,) = evaluate_slice([mask], {group_idx: idx.reshape(*lead, -1)})
        except NotEvaluable as exc:
            return f"the group mask is not a function of the chosen groups alone ({exc})"
        try:
            value = value.to(torch.bool).broadcast_to(shape).reshape(tokens, experts)
        except (RuntimeError, TypeError):
            return "the group mask does not cover the experts group by group"
        kept = (group_of.unsqueeze(0) == idx.unsqueeze(-1)).any(1)
        if not torch.equal(value, kept if kept_where else ~kept):
            return ("the mask does not keep exactly the experts of the chosen groups (npu_moe_gating_top_k "
                    "keeps the k_group best groups' experts, each group a run of E / group_count experts)")
    return None


def _region_above(node, stop, limit=64):
    """The call nodes `node` is computed from, up to the nodes in `stop` (excluded)."""
    found, pending = set(), [node]
    while pending:
        current = pending.pop()
        if current in stop or current in found or current.op != "call_function":
            continue
        found.add(current)
        if len(found) > limit:
            raise _NotRouter(None)
        pending.extend(current.all_input_nodes)
    return found


def _read_choice(router, experts):
    """Fill in the router's scores, bias, groups and logits from the top-k's input."""
    choice = router.topk.args[0]
    masked = _masked(choice, experts)
    stop = set()
    if masked is not None:
        masked_node, data, mask, fill, kept_where = masked
        leaves = _read_sum_of(data, experts)
    else:
        data = choice
        leaves = _read_sum_of(choice, experts)
    acts = [leaf for leaf in leaves if _act_of(leaf) is not None]
    others = [leaf for leaf in leaves if _act_of(leaf) is None]
    if len(acts) == 1 and len(others) <= 1:
        router.act_node = acts[0]
        router.act, router.logits = _act_of(acts[0])
        router.bias = others[0] if others else None
    elif not acts and len(others) == 1:
        # the top-k of the logits themselves: the act is found at the weights (each is increasing)
        router.logits = others[0]
    else:
        raise _NotRouter(None)
    if router.bias is not None:
        shape = tensor_meta(router.bias).shape
        if any(not (isinstance(s, int) and s == 1) for s in shape[:-1]):
            raise _NotRouter(f"the bias added before the top-k ({router.bias.name}) is {list(shape)}, not one "
                             f"value per expert")
    stop.update(leaves)
    if masked is not None:
        group_topk = _group_topk_of(mask)
        if group_topk is None:
            raise _NotRouter("the experts are masked before the top-k, but not by a top-k over groups")
        group = _group_scores(group_topk, experts, channels_of(data))
        if group is None:
            raise _NotRouter("a top-k over groups whose scores are not each group's top-2 sum or max of the "
                             "choice: npu_moe_gating_top_k scores a group by one of those")
        n_group, mode, score_nodes = group
        k_group = group_topk.args[1]
        group_idx = next(u for u in group_topk.users if is_call(u, operator.getitem) and u.args[1] == 1)
        if fill != float("-inf"):
            if router.bias is not None or fill > 0:
                raise _NotRouter(f"the other groups' experts are masked with {fill:g}, not -inf: a biased score "
                                 "below it would rank under a masked expert (npu_moe_gating_top_k masks with -inf)")
            router.notes = [f"the other groups are masked with {fill:g}: the scores are >= 0, so only an exact "
                            "zero score could tie with a masked expert"]
        reason = _group_mask_reason(mask, masked_node, kept_where, group_idx, n_group, k_group, experts)
        if reason:
            raise _NotRouter(reason)
        router.groups = (n_group, k_group, mode)
    router.nodes |= _region_above(choice, stop)


def _group_topk_of(mask):
    """The top-k whose indices the mask is built from (the one top-k above it)."""
    found, pending, seen = [], [mask], set()
    while pending and len(seen) < 64:
        node = pending.pop()
        if node in seen or not isinstance(node, torch.fx.Node):
            continue
        seen.add(node)
        if is_call(node, aten.topk.default):
            found.append(node)
            continue
        # (zeros_like(group_scores) reads their shape, not their values)
        pending.extend(node.all_input_nodes[1:] if node.target in SHAPE_ONLY_OPS else node.all_input_nodes)
    return found[0] if len(found) == 1 else None


def _read_weights(router):
    """The chosen experts' scores: a gather of the scores at the ids, the top-k's values (when
    it selects on the scores), or a softmax over the k chosen logits."""
    values = next((u for u in router.topk.users if is_call(u, operator.getitem) and u.args[1] == 0), None)
    if router.act_node is None:
        router.notes.append("the model ranks the logits, the op their fp32 scores (an increasing function: the "
                            "same experts, except between logits whose scores round to one fp32 value)")
    for user, through in _gathers_at(router.ids):
        if user.args[1] in (-1, tensor_meta(user).dim() - 1):
            source = _unexpanded(user.args[0])
            act = _act_of(source)
            if router.act_node is None and act is not None and _cast_source(act[1]) is _cast_source(router.logits):
                router.act_node, (router.act, router.logits) = source, act
            if source is router.act_node:
                router.weights = user
                router.nodes.update(through)
                if user.args[0] is not source:
                    router.nodes.add(user.args[0])
                return
    if router.act_node is None:
        gathered = next((_unexpanded(u.args[0]) for u, _ in _gathers_at(router.ids)), None)
        if _act_of(gathered) is not None:
            raise _NotRouter(f"the experts are chosen on {router.logits.name}, which is neither the "
                             f"{_act_of(gathered)[0].replace('_', '-')} scores gathered as the weights (plus a bias, "
                             "within the best groups) nor their logits")
    if values is None:
        raise _NotRouter(None)
    if router.act_node is not None and router.bias is None and router.groups is None:
        router.weights = values  # the top-k of the scores: its values are the chosen scores
        return
    if router.act_node is None:
        # the top-k of the logits, then a softmax over the k chosen (litgpt's LLaMAMoE): the
        # chosen experts of the softmax over all of them, over their sum
        users = [u for u in values.users]
        softmax = users[0] if len(users) == 1 else None
        through = [softmax] if softmax is not None else []
        if _is_cast(softmax) and len(softmax.users) == 1:
            through.append(next(iter(softmax.users)))
            softmax = through[-1]
        if is_call(softmax, aten._softmax.default) and softmax.args[1] in (-1, tensor_meta(softmax).dim() - 1):
            if tensor_meta(softmax).dtype != torch.float32:
                raise _NotRouter(f"a softmax over the k chosen {str(tensor_meta(softmax).dtype)[6:]} logits: the op "
                                 "computes it in fp32")
            router.act, router.weights, router.renormalised = "softmax", softmax, True
            router.compute_dtype = torch.float32  # the op's softmax of the (exactly widened) logits
            router.nodes |= {values, *through}
            return
    raise _NotRouter(None)


def _renorm_divisor(node, value):
    """eps when `node` is sum(value over k) [+ eps] (keepdim), the divisor of a renormalisation."""
    eps = 0.0
    if is_call(node, aten.add.Tensor) and _constant(node.args[1]) is not None:
        eps, node = _constant(node.args[1]), node.args[0]
    if is_call(node, aten.sum.dim_IntList) and node.args[0] is value and list(node.args[1]) == [-1] and \
            (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)):
        return eps
    if is_call(node, aten.linalg_vector_norm.default) and node.args[0] is value and node.args[1] in (1, 1.0) and \
            list(node.args[2]) == [-1] and node.args[3]:
        return eps  # the 1-norm of nonnegative scores is their sum
    return None


def _forward_users(node):
    """The nodes that read `node`, less the graph's output (_router_outputs checks that one)
    and, in a joint graph, the backward's (regions.backward_region checks those)."""
    return [u for u in node.users if u.op != "output" and not is_backward(u)]


def _uses(node):
    return len(_forward_users(node))


def _read_steps(router):
    """The renormalisation, scales, casts and views after the weights, one at a time, while each
    is the only use of the value before it."""
    current = router.weights
    while True:
        # (a value also saved for the backward, in a partitioned training forward, is read past
        # the region: _router_outputs says so)
        users = _forward_users(current)
        step = None
        if len(users) == 1 and (_is_cast(users[0]) or is_call(users[0], aten.view.default, aten.reshape.default,
                                                              aten._unsafe_view.default)) \
                and tensor_meta(users[0]).shape[-1:] == tensor_meta(current).shape[-1:]:
            step = ("as", users[0], None, [users[0]])
        elif len(users) == 1 and is_call(users[0], aten.mul.Tensor, aten.div.Tensor) and users[0].args[0] is current \
                and _constant(users[0].args[1]) is not None:
            kind = "mul" if is_call(users[0], aten.mul.Tensor) else "div"
            step = (kind, users[0], _constant(users[0].args[1]), [users[0]])
        elif len(users) == 2:
            div = next((u for u in users if is_call(u, aten.div.Tensor) and u.args[0] is current), None)
            divisor = div.args[1] if div is not None else None
            eps = _renorm_divisor(divisor, current) if div is not None else None
            if eps is not None and set(users) <= {div, divisor, *divisor.all_input_nodes} and \
                    _uses(divisor) == 1:
                inner = [divisor] + ([divisor.args[0]] if is_call(divisor, aten.add.Tensor) else [])
                if all(_uses(n) == 1 for n in inner):
                    step = ("renorm", div, eps, [div, *inner])
        if step is None:
            return
        kind, node, constant, nodes = step
        router.steps.append((kind, node, constant))
        router.nodes.update(nodes)
        current = node


def _read_router(topk):
    """The router ending at `topk`, or a reason (str) it cannot be fused, or None: no router."""
    meta = tensor_meta(topk.args[0])
    if meta is None or meta.dim() < 2:
        return None
    if not isinstance(meta.shape[-1], int):
        if _act_of(topk.args[0]) is not None and _act_of(topk.args[0])[0] != "softmax":
            return (f"a top-k over {_act_of(topk.args[0])[0].replace('_', '-')} scores of a symbolic expert "
                    f"count ({meta.shape[-1]}): the reading needs the experts' number")
        return None
    args = list(topk.args) + [None] * (5 - len(topk.args))
    dim = args[2] if args[2] is not None else topk.kwargs.get("dim", -1)
    largest = args[3] if args[3] is not None else topk.kwargs.get("largest", True)
    sorted_ = args[4] if args[4] is not None else topk.kwargs.get("sorted", True)
    ids = next((u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 1), None)
    if dim not in (-1, meta.dim() - 1) or ids is None or not isinstance(topk.args[1], int):
        return None
    if any(is_call(u, aten.scatter.value, aten.scatter.src) for u in ids.users):
        if all(is_call(u, aten.scatter.value, aten.scatter.src) and u.args[1] in (-1, 1) for u in ids.users) and \
                not _gathers_at(ids) and _feeds_a_mask(ids):
            return None  # a group top-k (its indices build a mask), read with the router it serves
    router = _Router(topk, ids, topk.args[1], bool(sorted_), "", None, topk.args[0])
    router.nodes = {topk, ids}
    experts = meta.shape[-1]
    stage = "scores it selects on"
    try:
        if not largest:
            raise _NotRouter(None)
        _read_choice(router, experts)
        stage = "chosen experts' weights"
        _read_weights(router)
        _read_steps(router)
    except _NotRouter as why:
        if why.args[0] is None and router.act_node is not None:
            return (f"a top-k over {router.act.replace('_', '-')} router scores whose {stage} are computed "
                    "some other way than a bias, a group mask (-inf outside the k_group best groups), a gather "
                    "of the scores and a renormalisation")
        return why.args[0]
    router.nodes.add(router.weights)
    if router.act_node is not None and router.act_node.op == "call_function":
        router.nodes.add(router.act_node)
    return router


def _gathers_at(ids):
    """(gather, the nodes between) for each gather at the top-k's ids: reading them directly, or
    as torch.take_along_dim spells it, `gather(expand(x), d, remainder(expand(ids), n))`. The
    expands are to the shapes they already have, and the remainder by the gathered dim's size n
    wraps indices into [0, n), where a top-k's over n experts already are: identities both. The
    nodes between are read by the gather alone (and, in a joint graph, by its backward: the
    gradient is scattered at the same index)."""
    found = []
    for user in ids.users:
        if is_call(user, aten.gather.default) and user.args[2] is ids:
            found.append((user, []))
        if not (is_call(user, aten.expand.default) and _same_shape_as_input(user) and len(_forward_users(user)) == 1):
            continue
        wrap = _forward_users(user)[0]
        if not (is_call(wrap, aten.remainder.Scalar) and wrap.args[0] is user and len(_forward_users(wrap)) == 1):
            continue
        gather = _forward_users(wrap)[0]
        source = tensor_meta(gather.args[0]) if is_call(gather, aten.gather.default) else None
        if source is not None and gather.args[2] is wrap and isinstance(wrap.args[1], int) \
                and known_equal(wrap.args[1], source.shape[-1]) and gather.args[1] in (-1, source.dim() - 1):
            found.append((gather, [user, wrap]))
    return found


def _unexpanded(node):
    """`node` without an expand to the shape it already has (torch.take_along_dim's of its input)."""
    if is_call(node, aten.expand.default) and _same_shape_as_input(node) and len(_forward_users(node)) == 1:
        return node.args[0]
    return node


def _same_shape_as_input(expand):
    before, after = tensor_meta(expand.args[0]), tensor_meta(expand)
    return before is not None and after is not None and same_shape(before, after)


def _feeds_a_mask(ids):
    """The top-k's indices are scattered into a mask that a masked_fill / where reads."""
    pending, seen = [ids], set()
    while pending and len(seen) < 32:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if is_call(user, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther,
                       aten.where.ScalarSelf, aten.mul.Tensor):
                return True
            pending.append(user)
    return False


def _router_outputs(router):
    """The region's nodes read outside it: the ids, and the last weights (or a reason)."""
    final = router.steps[-1][1] if router.steps else router.weights
    outputs = [router.ids, final]
    values = next((u for u in router.topk.users if is_call(u, operator.getitem) and u.args[1] == 0), None)
    for node in router.nodes:
        if node in outputs or node is router.act_node:
            continue
        outside = [u for u in node.users if u not in router.nodes and not is_backward(u)]
        if any(u.op == "output" for u in outside):
            return (f"{node.name}, a value inside the router, is also an output of the graph (in a training "
                    "step's forward: saved for its backward): the fused op gives the chosen weights and ids only")
        if outside and (node is values or node in (router.weights, *(s[1] for s in router.steps))):
            return (f"{node.name}, a value of the router's top-k, is also read by {outside[0].name}: the fused op "
                    "gives the chosen weights and ids only")
    return outputs


def _replay(router, y):
    """The model's steps after the weights, on the op's weights `y` (those it did not compute)."""
    for kind, node, constant in router.steps:
        if kind == "renorm":
            y = y / (y.sum(dim=-1, keepdim=True) + constant) if constant else y / y.sum(dim=-1, keepdim=True)
        elif kind == "mul":
            y = y * constant
        elif kind == "div":
            y = y / constant
        else:  # a cast, or a view that keeps the k experts last
            out = tensor_meta(node)
            y = y.to(out.dtype)
            if out.dim() != y.dim() or any(isinstance(a, int) and isinstance(b, int) and a != b
                                           for a, b in zip(out.shape, y.shape)):
                y = y.reshape(*[s if isinstance(s, int) else -1 for s in out.shape[:-1]], out.shape[-1])
    return y


def _router_replacement(router):
    """replace(logits[, bias]) -> (ids, weights) with the fused op, and the op's name."""
    norm_type = _INCREASING[router.act]
    steps = list(router.steps)
    if router.renormalised:
        steps.insert(0, ("renorm", None, 0.0))
    absorbed = []
    if norm_type in (1, 2):
        if not steps or steps[0][0] != "renorm":
            act = router.act.replace('_', '-')
            return None, None, (f"a {act} router without renormalisation: npu_moe_gating_top_k's {act} mode "
                                "always renormalises the chosen weights (then scales them once)")
        absorbed.append(steps.pop(0))
        if steps and steps[0][0] == "mul":
            absorbed.append(steps.pop(0))
    eps = absorbed[0][2] if absorbed else 1e-20
    scale = absorbed[1][2] if len(absorbed) > 1 else 1.0
    k, groups = router.k, router.groups or (1, 1, 1)
    dtype = router.compute_dtype or tensor_meta(router.logits).dtype
    replay = _Router(router.topk, router.ids, k, router.sorted, router.act, None, router.logits, steps=steps)
    ids_shape = tensor_meta(router.ids)
    use_softmax_op = router.act == "softmax" and router.bias is None and router.groups is None

    def finish(y, idx, logits):
        lead = logits.shape[:-1]
        return idx.to(torch.int64).reshape(*lead, k), _replay(replay, y.reshape(*lead, k))

    if use_softmax_op:
        def npu_moe_gating_top_k_softmax_recognized(logits):
            y, idx, _ = torch.ops.npu.npu_moe_gating_top_k_softmax(logits.to(dtype), None, k)
            return finish(y, idx, logits)
        return npu_moe_gating_top_k_softmax_recognized, "npu.npu_moe_gating_top_k_softmax", None

    def gating(logits, bias):
        flat = logits.reshape(-1, logits.shape[-1]).to(dtype)
        y, idx, _ = torch.ops.npu.npu_moe_gating_top_k(
            flat, k, bias=None if bias is None else bias.reshape(-1).to(dtype), k_group=groups[1],
            group_count=groups[0], group_select_mode=groups[2], renorm=0, norm_type=norm_type,
            # the backward reads norm_out: asked for where autograd records the call (a joint trace)
            out_flag=torch.is_grad_enabled() and logits.requires_grad, routed_scaling_factor=scale, eps=eps)
        return finish(y, idx, logits)

    if router.bias is None:  # (the replacement takes the site's args, and no bias is one)
        def npu_moe_gating_top_k_recognized(logits):
            return gating(logits, None)
    else:
        def npu_moe_gating_top_k_recognized(logits, bias):
            return gating(logits, bias)
    return npu_moe_gating_top_k_recognized, "npu.npu_moe_gating_top_k", None


def recognize(graph, joint):
    found = []
    by_seq = backward_nodes_by_seq(graph) if joint else None
    readings = {}
    for topk in graph.find_nodes(op="call_function", target=aten.topk.default):
        if not (joint and is_backward(topk)):
            readings[topk] = _read_router(topk)
    # a router's group top-k and its top-2 per group are parts of it, not routers of their own
    inner = {n for r in readings.values() if isinstance(r, _Router) for n in r.nodes if n is not r.topk}
    for topk, router in readings.items():
        if router is None or topk in inner:
            continue
        name = "router (read by what it computes)"
        if isinstance(router, str):
            found.append(Recognized(name, topk, [topk], reason=router))
            continue
        nodes = sorted(router.nodes)
        act = router.act_node
        if not joint and act is not None and any(u.op == "output" for u in act.users) and _training_reason(act):
            # the forward of a partitioned training graph, as the forms say it (the joint graph's near
            # miss said why): the scores over all experts are saved for a backward the op has not
            found.append(Recognized(name, topk, nodes, reason=f"{_training_reason(act)} (here, the forward of a "
                                    "training step: its scores are saved for the backward)"))
            continue
        outputs = _router_outputs(router)
        if isinstance(outputs, str):
            found.append(Recognized(name, topk, nodes, reason=outputs))
            continue
        differentiated = joint and any(is_backward(u) for n in nodes for u in n.users)
        if differentiated and _training_reason(router.act_node):
            found.append(Recognized(name, outputs, nodes, reason=_training_reason(router.act_node)))
            continue
        replace, fused_op, reason = _router_replacement(router)
        if reason:
            found.append(Recognized(name, outputs, nodes, reason=reason))
            continue
        logits = tensor_meta(router.logits)
        logits = logits.to(router.compute_dtype or logits.dtype)
        args = {"logits": router.logits}
        site_args = {"gate_logits": logits.reshape(-1, logits.shape[-1]) if logits.dim() > 2 else logits,
                     "router_logits": logits, "k": router.k, "top_k": router.k,
                     "n_group": (router.groups or (1,))[0], "topk_group": (router.groups or (1, 1))[1],
                     "bias": None, "unsorted": not router.sorted, "norm_type": _INCREASING[router.act]}
        if router.bias is not None:
            args["bias"] = router.bias
            site_args["bias"] = tensor_meta(router.bias).reshape(-1)
        site = Recognized(f"{router.act.replace('_', '-')} router (read by what it computes)", outputs, nodes,
                          args, replace, site_args, fused_op=fused_op, notes=router.notes)
        found.append(_trained(site, backward_region(nodes, list(args.values()), outputs, by_seq))
                     if differentiated else site)
    return found


def _trained(site, backward):
    """A recognised router of a joint graph whose weights get a gradient, with the backward
    autograd made of it (`backward`: regions.backward_region's answer), replaced jointly by
    the fused call traced with its gradient (npu_moe_gating_top_k_backward): whatever the
    spelling, its backward is found by what autograd recorded for the region's ops."""
    if isinstance(backward, str):
        return with_fields(site, args={}, replace=None, reason=f"a router in training: {backward}")
    ids, weights = backward.output_gradients
    if weights is None:
        return with_fields(site, args={}, replace=None, reason=(
            "a router in training whose chosen weights get no gradient but whose region does: its backward is "
            "not the fused op's"))
    trained = [role for role, node in site.args.items() if node in backward.gradients]
    return with_fields(site, backward_nodes=backward.nodes, output_gradients=backward.output_gradients,
                       needs_gradient=trained, backward_output=[backward.gradients[site.args[r]] for r in trained])


PASS = FusionPass(
    name="moe_gating",
    # an unsorted (biased) router fuses only once its experts feed a fused dispatch,
    # which does not depend on their order
    after=("moe_dispatch",),
    fused_op="npu.npu_moe_gating_top_k_softmax",
    forms=FORMS,
    # A scalar's example value marks it in the trace: each one differs from every other
    # int there (sizes included: 5 tokens, 8 experts; 7 tokens, 24 experts in 4 groups of 6).
    example={
        "router_logits": lambda dtype: torch.empty(5, 8, dtype=dtype), "k": 3,
        "gate_logits": lambda dtype: torch.empty(7, 24, dtype=dtype),
        "gate_scores": lambda dtype: torch.empty(2, 7, 24, dtype=dtype),
        "bias": lambda dtype: torch.empty(24, dtype=dtype),
        "top_k": 5, "n_group": 4, "topk_group": 3, "routed_scaling_factor": 2.5,
        # DeepSeek-V4's hash router: (B=1, S=7) token ids into an 11-token table of 2 experts each
        "input_ids": lambda dtype: torch.empty(1, 7, dtype=torch.int64),
        "tid2eid": lambda dtype: torch.empty(11, 2, dtype=torch.int64),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.gather.default, aten.topk.default),
    explain=explain,
    # the logits; the bias only selects (no gradient reaches it through top-k indices)
    differentiable=("gate_logits", "gate_scores"),
    recognize=recognize,
)
