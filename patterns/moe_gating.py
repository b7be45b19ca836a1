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
k rows; moe_dispatch runs before this pass to put them there) and the one-hot
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
import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, first_refused_use, is_call, is_joint_graph, tensor_meta

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
    if site.form.search is deepseek_v4_sqrt_softplus_top_k:
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
    if site.form.search is softmax_top_k_unsorted:
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
    if bias.shape != (experts,) or torch.promote_types(bias.dtype, logits.dtype) != logits.dtype:
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
    return _order_reason(site, top_k)


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
    return first_refused_use(site, _indifferent_to_k_order, _keeps_k_order, outputs=k_wide)


# ---- near misses: a router top-k left unfused ---------------------------------------------
def _is_sqrt_softplus(node):
    return is_call(node, aten.sqrt.default) and is_call(node.args[0], aten.softplus.default)


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
)
