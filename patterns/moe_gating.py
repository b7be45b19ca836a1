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

Not fused, and reported: DeepSeek-V3's noaux_tc router (sigmoid scores, a correction bias
for the choice only, group-limited top-k over unsorted groups). npu_moe_gating_top_k
computes it, but transformers takes its top-k with sorted=False, so the order of the k
experts, which the fused op would change, is whatever the unfused kernel produced: a
rewrite has to prove every consumer indifferent to that order first (the dispatch
pass's job, not done in this version).
"""
import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
GATING = CAPABILITIES["npu.npu_moe_gating_top_k_softmax"]


# ---- the unfused form ---------------------------------------------------------------------
def softmax_top_k(router_logits, k):
    probs = torch.softmax(router_logits, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    return weights, experts


# ---- the fused call -----------------------------------------------------------------------
def npu_moe_gating_top_k_softmax(router_logits, k):
    weights, experts, _row_idx = torch.ops.npu.npu_moe_gating_top_k_softmax(router_logits, None, k)
    return weights, experts.to(torch.int64)


FORMS = [Form(softmax_top_k, npu_moe_gating_top_k_softmax, dtypes=(torch.float32,))]


# ---- checks -------------------------------------------------------------------------------
def check(site):
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
    return None


# ---- near misses: a router top-k left unfused ---------------------------------------------
def _router_scores(node):
    """The softmax / sigmoid a top-k selects experts from (through masks and bias adds)."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        if is_call(node, aten._softmax.default, aten.sigmoid.default):
            return node
        if not node.all_input_nodes:
            return None
        node, seen = node.all_input_nodes[0], seen + 1
    return None


def anchor(node):
    """A top-k over one score per expert: its input is as wide as the softmax / sigmoid it
    comes from (noaux_tc's top-k over groups, or within a group, is narrower)."""
    if not is_call(node, aten.topk.default):
        return False
    scores, chosen_from = _router_scores(node.args[0]), tensor_meta(node.args[0])
    scores_val = tensor_meta(scores)
    return (scores_val is not None and chosen_from is not None and chosen_from.dim() > 0
            and chosen_from.shape[-1] == scores_val.shape[-1])


def explain(topk):
    scores = _router_scores(topk.args[0])
    if is_call(scores, aten.sigmoid.default):
        return ("sigmoid router with bias / group-limited top-k (DeepSeek noaux_tc): its top-k is "
                "unsorted, and the order of the k experts is not proven irrelevant downstream")
    if topk.args[0] is not scores:
        changed = topk.args[0]
        if is_call(changed, aten.add.Tensor) and isinstance(changed.args[1], torch.fx.Node):
            return (f"a bias ({changed.args[1].name}) is added to the softmax before the top-k "
                    "(load balancing): npu_moe_gating_top_k_softmax has no bias input")
        return "the softmax is masked or changed before the top-k"
    if len(topk.args) > 4 and topk.args[4] is False:
        return "an unsorted top-k: npu_moe_gating_top_k_softmax returns the k experts in descending order"
    return None


PASS = FusionPass(
    name="moe_gating",
    fused_op="npu.npu_moe_gating_top_k_softmax",
    forms=FORMS,
    # the scalar k's example value marks it in the trace: no other 3 may appear there
    example={"router_logits": lambda dtype: torch.empty(5, 8, dtype=dtype), "k": 3},
    check=check,
    anchor=anchor,
    explain=explain,
)
