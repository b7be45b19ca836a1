"""moe_gating: softmax router top-k -> npu_moe_gating_top_k_softmax; other routers say why not.

Numerics: the op computes the same fp32 softmax and picks the same k largest in the same
(descending) order, so weights agree to 1 fp32 ulp and the expert ids exactly (random
logits have no ties).
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import (TORCHTITAN_DEEPSEEK_ROUTER, assert_close_at_scale, assert_within_ulps, compile_and_run,
                     near_miss_reasons, torchtitan_moe)

ONLY_GATING = nff.FusionConfig(enable={"moe_gating"})


class SoftmaxRouter(torch.nn.Module):
    """transformers Qwen3-MoE / Mixtral router: fp32 softmax, top-k, optional renormalisation."""

    def __init__(self, hidden=16, experts=8, k=2, renormalize=False, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, dtype=dtype))
        self.k, self.renormalize = k, renormalize

    def forward(self, x):
        logits = F.linear(x, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


def _tokens(dtype=torch.float32, tokens=12, hidden=16):
    torch.manual_seed(1)
    return torch.randn(tokens, hidden).to(dtype)


def _check(out, ref, probs):
    """Same weights; the same experts, except among experts of exactly equal probability.

    bf16 logits tie often (8 bits of mantissa), and which of two tied experts a top-k
    returns is unspecified for torch.topk and the NPU op alike (the stand-in takes the
    lower index): there, any of the tied experts is a correct routing.
    """
    (weights, experts), (ref_weights, ref_experts) = out, ref
    if ref_weights.dtype == torch.float32:
        assert_within_ulps(weights, ref_weights, 1)
    else:  # both round the same fp32 value once
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
    differ = experts != ref_experts
    assert torch.equal(probs.gather(-1, experts)[differ], probs.gather(-1, ref_experts)[differ])
    return int(differ.sum())


def _probs(router, x):
    return F.softmax(F.linear(x, router.weight).float(), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "norm_topk_prob"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_softmax_router_fuses(dtype, renormalize, k):
    router = SoftmaxRouter(k=k, renormalize=renormalize, dtype=dtype)
    out, ref, report = compile_and_run(router, _tokens(dtype), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 1
    assert report.fused_ops == {"npu.npu_moe_gating_top_k_softmax": 1}
    ops = report.graphs[0].ops_after
    assert ops["aten._softmax.default"] == 0 and ops["aten.topk.default"] == 0
    # the renormalisation stays in the graph, after the fused op
    assert (ops["aten.div.Tensor"] > 0) == renormalize
    ties = _check(out, ref, _probs(router, _tokens(dtype)))
    assert ties == 0 or dtype == torch.bfloat16  # fp32 logits of random weights do not tie


class HalfSoftmaxRouter(SoftmaxRouter):
    def forward(self, x):
        probs = F.softmax(F.linear(x, self.weight), dim=-1)  # bf16 probabilities
        return torch.topk(probs, self.k, dim=-1)


class UnsortedRouter(SoftmaxRouter):
    def forward(self, x):
        probs = F.softmax(F.linear(x, self.weight), dim=-1)
        return torch.topk(probs, self.k, dim=-1, sorted=False)


class BiasedRouter(SoftmaxRouter):
    """torchtitan-style: a load-balancing bias decides the choice, the softmax the weights."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x):
        scores = F.softmax(F.linear(x, self.weight), dim=-1)
        experts = torch.topk(scores + self.bias, self.k, dim=-1)[1]
        return scores.gather(-1, experts), experts


class SigmoidGroupRouter(torch.nn.Module):
    """transformers DeepSeek-V3 noaux_tc router (the sigmoid, group-limited top-k part)."""

    def __init__(self, experts=8, groups=2, topk_group=1, k=2):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(experts, 16))
        self.bias = torch.nn.Parameter(torch.randn(experts) * 0.1)
        self.experts, self.groups, self.topk_group, self.k = experts, groups, topk_group, k

    def forward(self, x):
        scores = F.linear(x, self.weight).sigmoid()
        choice = scores + self.bias
        group_scores = choice.view(-1, self.groups, self.experts // self.groups).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.groups, self.experts // self.groups).reshape(-1, self.experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        experts = torch.topk(choice, k=self.k, dim=-1, sorted=False)[1]
        return scores.gather(1, experts), experts


@pytest.mark.parametrize("module, dtype, config, reason", [
    (HalfSoftmaxRouter(dtype=torch.bfloat16), torch.bfloat16, ONLY_GATING, "softmax over bfloat16 logits"),
    (UnsortedRouter(), torch.float32, ONLY_GATING, "unsorted top-k"),
    (SigmoidGroupRouter(), torch.float32, ONLY_GATING, "always renormalises"),
    (SoftmaxRouter(), torch.float32, nff.FusionConfig(enable={"moe_gating"}, soc="Ascend950"),
     "not available on Ascend950"),
], ids=["bf16 softmax", "unsorted", "sigmoid groups", "Ascend950"])
def test_does_not_fuse_and_says_why(module, dtype, config, reason):
    out, ref, report = compile_and_run(module, _tokens(dtype), config=config)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")  # one per router, not per inner top-k
    assert reason in miss, miss
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


def test_a_bias_that_only_selects_fuses_into_the_grouped_op():
    # npu_moe_gating_top_k's softmax mode (norm_type 0): the bias selects, the unbiased softmax
    # of the chosen experts weighs (read by what it computes: tests/test_moe_router_reading.py)
    router = BiasedRouter()
    out, ref, report = compile_and_run(router, _tokens(), config=ONLY_GATING)
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[1], ref[1])
    assert_within_ulps(out[0], ref[0], 1)


def test_k_larger_than_the_expert_count_cannot_exist_but_k_limit_is_checked():
    # k <= E always holds for a working model (topk would fail); the op's own k <= 1024
    router = SoftmaxRouter(experts=1100, k=1025)
    _, _, report = compile_and_run(router, _tokens(), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "k <= 1024" in miss, miss


# ---- biased routers -> npu_moe_gating_top_k ----------------------------------------------------
def _deepseek_moe(experts_implementation, experts=8, groups=2, topk_group=1, k=2, norm_topk_prob=True):
    """transformers' own DeepseekV3MoE (router, routed experts, shared expert), tiny."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=experts,
                              num_experts_per_tok=k, n_group=groups, topk_group=topk_group,
                              n_shared_experts=1, norm_topk_prob=norm_topk_prob,
                              routed_scaling_factor=2.5)
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    moe = DeepseekV3MoE(config)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    # a real correction bias is learned; random, some of it negative
    moe.gate.e_score_correction_bias.normal_(std=0.1)
    return moe.eval()


def _hidden(tokens=24, hidden=32):
    torch.manual_seed(1)
    return torch.randn(2, tokens // 2, hidden)


GATING_AND_DISPATCH = nff.FusionConfig(enable={"moe_gating", "moe_dispatch", "swiglu"})


@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "batched_mm"])
# n_group=1: the group mask's expand + reshape is a view there, a copy elsewhere
# (canonical.py spells both as reshape)
@pytest.mark.parametrize("experts, groups, topk_group, k", [(8, 2, 1, 2), (16, 4, 2, 4), (24, 4, 3, 6),
                                                             (8, 1, 1, 2)])
def test_noaux_tc_router_fuses_in_front_of_the_fused_dispatch(experts_implementation, experts, groups,
                                                             topk_group, k):
    moe = _deepseek_moe(experts_implementation, experts, groups, topk_group, k)
    out, ref, report = compile_and_run(moe, _hidden(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 1 and report.counts["moe_dispatch"] == 1
    assert report.fused_ops["npu.npu_moe_gating_top_k"] == 1
    assert near_miss_reasons(report, "moe_gating") == []
    # the same experts with the same weights; each token's k rows summed in another order
    # (descending score instead of the unsorted top-k's): fp32 rounding of a sum, a few ulp
    # of the output's scale (not of each element: the terms may cancel)
    assert_close_at_scale(out, ref, 4)


def test_noaux_tc_scalars_are_read_from_the_model_not_from_the_example():
    # The pass's example n_group is 4: a model with groups of 4 experts (8 in 2 groups) must
    # still be checked and fused with n_group=2.
    moe = _deepseek_moe("grouped_mm", experts=8, groups=2, topk_group=1, k=2)
    _, _, report = compile_and_run(moe, _hidden(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 1


def test_noaux_tc_router_verifies_in_expert_order():
    moe = _deepseek_moe("grouped_mm")
    config = nff.FusionConfig(enable={"moe_gating", "moe_dispatch"}, verify=True)
    _, _, report = compile_and_run(moe, _hidden(), config=config)
    (site,) = [s for s in report.sites if s.pass_name == "moe_gating"]
    assert site.verified.startswith("verified"), site.verified


def test_noaux_tc_router_alone_is_not_fused_where_the_expert_order_is_used():
    # the router on its own: its ids and weights leave the graph in top-k order
    moe = _deepseek_moe("grouped_mm")
    _, _, report = compile_and_run(moe.gate, _hidden().view(-1, 32), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "order of the k experts" in miss and "output" in miss, miss


def test_noaux_tc_router_with_the_dispatch_left_unfused_says_so():
    moe = _deepseek_moe("grouped_mm")
    _, _, report = compile_and_run(moe, _hidden(), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "order of the k experts" in miss, miss


def test_noaux_tc_without_renormalisation_does_not_fuse():
    # the op's sigmoid mode always renormalises
    moe = _deepseek_moe("grouped_mm", norm_topk_prob=False)
    _, _, report = compile_and_run(moe, _hidden(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "always renormalises" in miss, miss


def test_noaux_tc_groups_too_small_for_the_op_do_not_fuse():
    # E / group_count > 2 is one of the op's documented limits
    moe = _deepseek_moe("grouped_mm", experts=8, groups=4, topk_group=2, k=2)
    _, _, report = compile_and_run(moe, _hidden(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "groups of at least 3 experts" in miss, miss


# torchtitan's TokenChoiceTopKRouter, in its own MoE layer (local dispatcher, grouped experts)
def _torchtitan_tokens():
    torch.manual_seed(2)
    return torch.randn(2, 24, 64)


@pytest.mark.parametrize("router, experts", [({}, 8), (TORCHTITAN_DEEPSEEK_ROUTER, 16)],
                         ids=["softmax+bias", "sigmoid groups route_norm"])
def test_torchtitan_router_fuses_in_front_of_the_fused_dispatch(router, experts):
    moe = torchtitan_moe(num_experts=experts, **router)
    out, ref, report = compile_and_run(moe, _torchtitan_tokens(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 1 and report.counts["moe_dispatch"] == 1
    assert report.fused_ops["npu.npu_moe_gating_top_k"] == 1
    assert_close_at_scale(out, ref, 4)


def test_torchtitan_sigmoid_router_without_route_norm_does_not_fuse():
    moe = torchtitan_moe(num_experts=16, **dict(TORCHTITAN_DEEPSEEK_ROUTER, route_norm=False))
    _, _, report = compile_and_run(moe, _torchtitan_tokens(), config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "always renormalises" in miss, miss


def test_torchtitan_router_alone_is_not_fused_where_the_expert_order_is_used():
    moe = torchtitan_moe()
    _, _, report = compile_and_run(moe.router, _torchtitan_tokens(), moe.expert_bias_E, config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "order of the k experts" in miss, miss


# ---- a softmax router whose top-k is unsorted ------------------------------------------------
class UnsortedSoftmaxRouter(SoftmaxRouter):
    def forward(self, x):
        probs = F.softmax(F.linear(x, self.weight), dtype=torch.float, dim=-1)
        return torch.topk(probs, self.k, dim=-1, sorted=False)


def test_an_unsorted_softmax_top_k_whose_order_is_used_says_so():
    _, _, report = compile_and_run(UnsortedSoftmaxRouter(), _tokens(), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
    (miss,) = near_miss_reasons(report, "moe_gating")
    assert "order of the k experts" in miss, miss


def _qwen3_moe_block_with_an_unsorted_router():
    """transformers' Qwen3-MoE block (softmax router, grouped_mm experts), its router's
    top-k taken with sorted=False."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    class UnsortedTopKRouter(qwen3_moe.Qwen3MoeTopKRouter):
        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            router_logits = F.linear(hidden_states, self.weight)
            router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
            values, indices = torch.topk(router_probs, self.top_k, dim=-1, sorted=False)
            values = values / values.sum(dim=-1, keepdim=True)
            return router_logits, values.to(router_logits.dtype), indices

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    block.gate = UnsortedTopKRouter(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block.eval()


def test_an_unsorted_softmax_top_k_fuses_in_front_of_the_fused_dispatch():
    out, ref, report = compile_and_run(_qwen3_moe_block_with_an_unsorted_router(), _hidden(),
                                       config=GATING_AND_DISPATCH)
    assert report.counts["moe_gating"] == 1 and report.counts["moe_dispatch"] == 1
    assert report.fused_ops["npu.npu_moe_gating_top_k_softmax"] == 1
    assert near_miss_reasons(report, "moe_gating") == []
    # each token's k rows summed in the op's (descending) order: fp32 rounding of a sum
    assert_close_at_scale(out, ref, 4)


# ---- DeepSeek-V4: sqrt-softplus scores (norm_type 2), top-k and hash routers --------------------
# transformers' DeepseekV4SparseMoeBlock (grouped_mm experts) with moe_dispatch, as in the
# pipeline: the top-k router's unsorted k experts only fuse where the dispatch consumes them
# order-free. Tolerance as for noaux_tc above: the same rows summed in another order.
V4_GATING = nff.FusionConfig(enable={"moe_gating", "moe_dispatch"})


def _v4_block(kind, dtype=torch.float32, **config):
    from v4_modules import MoeBlock

    torch.manual_seed(7)
    return MoeBlock(kind, dtype=dtype, **config), torch.randn(2, 9, 64).to(dtype), torch.randint(0, 100, (2, 9))


@pytest.mark.parametrize("kind, dtype", [("topk", torch.float32), ("hash", torch.float32), ("hash", torch.bfloat16)])
def test_deepseek_v4_router_fuses_with_norm_type_2(kind, dtype):
    module, hidden, ids = _v4_block(kind, dtype)
    out, ref, report = compile_and_run(module, hidden, ids, config=V4_GATING)
    assert report.counts["moe_gating"] == 1 and report.counts["moe_dispatch"] == 1
    assert report.fused_ops["npu.npu_moe_gating_top_k"] == 1
    assert_close_at_scale(out, ref, 4 if dtype == torch.float32 else 2)


def test_deepseek_v4_scaling_factor_is_captured():
    module, hidden, ids = _v4_block("topk", routed_scaling_factor=2.5)
    out, ref, report = compile_and_run(module, hidden, ids, config=V4_GATING)
    assert report.counts["moe_gating"] == 1
    assert_close_at_scale(out, ref, 4)


def test_deepseek_v4_bf16_top_k_router_is_refused_for_near_ties():
    module, hidden, ids = _v4_block("topk", torch.bfloat16)
    _, _, report = compile_and_run(module, hidden, ids, config=V4_GATING)
    assert report.counts["moe_gating"] == 0
    assert ("scores over bfloat16 logits: npu_moe_gating_top_k ranks fp32 scores and could choose other experts "
            "in near ties") in near_miss_reasons(report, "moe_gating")


@pytest.mark.parametrize("kind", ["topk", "hash"])
def test_deepseek_v4_router_is_950_only(kind):
    module, hidden, ids = _v4_block(kind)
    config = nff.FusionConfig(enable={"moe_gating", "moe_dispatch"}, soc="Ascend910B")
    _, _, report = compile_and_run(module, hidden, ids, config=config)
    assert report.counts["moe_gating"] == 0
    assert ("sqrt-softplus scores (norm_type 2) are Ascend950 only (and undocumented in torch_npu)"
            in near_miss_reasons(report, "moe_gating"))


def test_deepseek_v4_router_in_training_says_why():
    from v4_modules import train_and_compare

    module, hidden, ids = _v4_block("topk")
    backend = train_and_compare(module, [hidden, ids], V4_GATING, {torch.float32: 16})
    assert backend.report.counts["moe_gating"] == 0
    reason = ("a sqrt-softplus router in training (DeepSeek-V4): npu_moe_gating_top_k_backward differentiates the "
              "sigmoid mode only (norm_type 1), not norm_type 2")
    # the joint graph's, and the partitioned forward's (not 'matches neither form': the same router,
    # its scores saved for the backward)
    assert [m.reason for g in backend.report.graphs if g.name == "joint" for r in g.passes
            if r.pass_name == "moe_gating" for m in r.near_misses] == [reason]
    forward = [m.reason for g in backend.report.graphs if g.name == "forward" for r in g.passes
               if r.pass_name == "moe_gating" for m in r.near_misses]
    assert forward == [f"{reason} (here, the forward of a training step: its scores are saved for the backward)"]


class Dim1Router(torch.nn.Module):
    """Older transformers Mixtral: softmax and top-k over dim=1 of the 2-d (tokens, E) logits."""

    def __init__(self, k=2, sorted_=True):
        super().__init__()
        self.k, self.sorted = k, sorted_

    def forward(self, logits):
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.k, dim=1, sorted=self.sorted)
        if self.sorted:
            return weights, experts
        # uses indifferent to the order of the k experts: the routing map, a per-token sum
        return torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True), weights.sum(-1)


@pytest.mark.parametrize("sorted_", [True, False], ids=["sorted", "unsorted"])
def test_top_k_over_dim_1_of_2d_logits_fuses(sorted_):
    # canonical.py writes topk's dim 1 of 2-d scores as -1, then leaves that default out, as
    # the trace of `topk(probs, k, dim=-1)` does (found by the fuzz: tests/fuzz_cases.py)
    logits = _tokens() * 2
    out, ref, report = compile_and_run(Dim1Router(sorted_=sorted_), logits, config=ONLY_GATING)
    assert report.counts["moe_gating"] == 1, report.to_markdown()
    assert report.fused_ops == {"npu.npu_moe_gating_top_k_softmax": 1}
    assert torch.equal(out[1 if sorted_ else 0], ref[1 if sorted_ else 0])
    assert_within_ulps(out[0 if sorted_ else 1], ref[0 if sorted_ else 1], 1)


def test_top_k_over_dim_0_is_not_a_router():
    class Dim0(torch.nn.Module):
        def forward(self, logits):
            return torch.topk(F.softmax(logits, dim=-1), 2, dim=0)

    _, _, report = compile_and_run(Dim0(), _tokens(), config=ONLY_GATING)
    assert report.counts["moe_gating"] == 0
