"""moe_gating: routers read by what they compute (issue 28, item 5; survey root causes M1, M2).

Each router below is another library's spelling of a router the fused ops compute: litgpt's
LLaMAMoE (top-k of the logits, then a softmax over the k chosen), torchtitan 0.2.2's
TokenChoiceTopKRouter (sigmoid + expert bias, unsorted top-k, gather, / (sum + 1e-20),
* route_scale) and torchtitan 0.3.0's group-limited router (a bool mask scattered with
False at the chosen groups, -inf outside them, over (B, L, E) tokens).

Numerics (fp32 logits):
- a softmax router with a bias selecting: the op gathers the same fp32 softmax: 1 ulp;
- litgpt's softmax over the k chosen logits: the op's softmax over all E, gathered, over the
  chosen ones' sum; mathematically equal, two more roundings (the E-sum's division and the
  renormalisation): 4 ulp;
- sigmoid routers: the same sigmoid, sum, division and scale in the same order: 1 ulp of the
  largest weight (the scale is applied once after the division, as the model does);
- the expert ids exactly (random fp32 logits do not tie).
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, assert_within_ulps, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend

ONLY_GATING = nff.FusionConfig(enable={"moe_gating"})
E, D = 16, 32


def _run(module, *inputs, dynamic=False):
    backend = EmulationBackend(ONLY_GATING)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        return compiled(*inputs), module(*inputs), backend.report


def _x(*lead, seed=1):
    torch.manual_seed(seed)
    return torch.randn(*lead, D)


class Gate(torch.nn.Module):
    def __init__(self, k=2, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(D, E, bias=False)
        self.expert_bias = torch.nn.Parameter(torch.randn(E) * 0.1, requires_grad=False)
        self.k = k
        self.__dict__.update(kw)


class LitgptRouter(Gate):
    """litgpt model.py:866-869 (LLaMAMoE.forward)."""

    def forward(self, x):
        x = x.view(-1, x.size(-1))
        router = self.gate(x)
        probs, indices = torch.topk(router, self.k)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        return probs, indices


class BiasedSoftmaxRouter(Gate):
    """torchtitan's softmax router with a load-balancing bias (Qwen3-MoE debugmodel_moe):
    the bias selects, the unbiased softmax weighs, then route_norm renormalises."""

    def forward(self, x):
        scores = F.softmax(self.gate(x).float(), dim=-1)
        _, ids = torch.topk(scores + self.expert_bias, self.k, dim=-1)
        weights = scores.gather(-1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids


class Torchtitan022Router(Gate):
    """torchtitan 0.2.2 models/moe/moe.py:311-345, route_norm and route_scale, sorted=False;
    the routing map it feeds is indifferent to the order of the k experts."""

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        _, selected = torch.topk(scores + self.expert_bias, k=self.k, dim=1, sorted=False)
        top_scores = scores.gather(dim=1, index=selected)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.scale
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, selected, True)
        return routing_map, top_scores.sum(dim=-1)


class GroupLimitedRouter(Gate):
    """torchtitan 0.3.0 models/common/moe.py:267-281 over (B, L, E) tokens, then renormalised."""

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).float())
        choice = (scores + self.expert_bias).unflatten(-1, (self.groups, E // self.groups))
        group_scores = choice.topk(2, dim=-1)[0].sum(dim=-1)
        _, group_idx = torch.topk(group_scores, k=self.kept, dim=-1, sorted=False)
        # True = masked; the look-alike masks the chosen groups instead of the others
        if self.new_ones:  # the spelling (item 5)
            group_mask = group_scores.new_ones(group_scores.shape, dtype=torch.bool).scatter_(-1, group_idx, False)
        else:
            group_mask = torch.full_like(group_scores, not self.inverted, dtype=torch.bool)
            group_mask.scatter_(-1, group_idx, self.inverted)
        choice = choice.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(-2)
        _, ids = torch.topk(choice, self.k, dim=-1)
        weights = scores.gather(-1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, ids


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_litgpt_topk_then_softmax_fuses_as_the_softmax_op_renormalised(k, dynamic):
    out, ref, report = _run(LitgptRouter(k=k), _x(2, 6), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k_softmax": 1}
    (site,) = [s for g in report.graphs for r in g.passes for s in r.sites if r.pass_name == "moe_gating"]
    assert "the model ranks the logits" in site.note, site.note
    assert torch.equal(out[1], ref[1])
    assert_within_ulps(out[0], ref[0], 4)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_biased_softmax_router_fuses_with_its_renormalisation_replayed(dynamic):
    out, ref, report = _run(BiasedSoftmaxRouter(k=4), _x(10), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[1], ref[1])
    assert_close_at_scale(out[0], ref[0], 2)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torchtitan_022_sigmoid_router_fuses(dynamic):
    out, ref, report = _run(Torchtitan022Router(k=3, scale=2.5), _x(10), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[0], ref[0])
    assert_close_at_scale(out[1], ref[1], 2)


@pytest.mark.parametrize("new_ones", [False, True], ids=["ones_like", "new_ones"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_group_limited_router_with_a_scattered_bool_mask_fuses(dynamic, new_ones):
    router = GroupLimitedRouter(k=4, groups=4, kept=2, inverted=False, new_ones=new_ones)
    out, ref, report = _run(router, _x(2, 5), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[1], ref[1])
    assert_close_at_scale(out[0], ref[0], 2)


class TakeAlongDimRouter(Gate):
    """A sigmoid router gathering with torch.take_along_dim, which traces as expand (to the shape
    it has), remainder(ids, n) and gather; `modulus` other than the experts' count is a look-alike
    (remainder by E - 1 moves the last expert's weight to the first)."""

    def forward(self, x):
        scores = torch.sigmoid(F.linear(x, self.gate.weight).float())
        _, ids = torch.topk(torch.add(scores, self.expert_bias), self.k, dim=-1)
        if self.modulus == E:
            weights = torch.take_along_dim(scores, ids, dim=-1)
        else:
            weights = scores.gather(-1, ids.expand(ids.shape).remainder(self.modulus))
        return weights / weights.sum(dim=-1, keepdim=True) * 2.5, ids


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_take_along_dim_router_fuses_through_its_identity_remainder(dynamic):
    out, ref, report = _run(TakeAlongDimRouter(k=3, modulus=E), _x(10), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[1], ref[1])
    assert_close_at_scale(out[0], ref[0], 2)


class V4Router(Gate):
    """torchtitan-npu 0.2.2 deepseek_v4/model/moe.py:141-165: sqrt of a softplus written
    log1p(exp(-|x|)) + relu(x), bias, sorted top-k, gather, route_norm, route_scale."""

    def forward(self, x):
        logits = self.gate(x).to(torch.float32)
        scores = self.softplus(logits).sqrt()
        ids = (scores + self.expert_bias).topk(self.k, dim=-1)[1]
        weights = scores.gather(dim=1, index=ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * 1.5, ids


def _softplus_stable(x):
    return torch.log1p(torch.exp(-x.abs())) + torch.relu(x)


def _softplus_overflowing(x):  # softplus up to x ~ 88, inf beyond: not the op's
    return torch.log1p(torch.exp(x))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_v4_sqrt_softplus_router_with_an_elementwise_softplus_fuses(dynamic):
    out, ref, report = _run(V4Router(k=4, softplus=_softplus_stable), _x(10), dynamic=dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1}
    assert torch.equal(out[1], ref[1])
    # the stand-in's softplus is F.softplus: 1 ulp from the stable spelling, then sqrt, sum, division
    assert_close_at_scale(out[0], ref[0], 4)


def test_an_elementwise_function_that_is_not_softplus_everywhere_is_not_read_as_one():
    out, ref, report = _run(V4Router(k=4, softplus=_softplus_overflowing), _x(10))
    assert report.counts["moe_gating"] == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class ScaledChoiceRouter(Gate):
    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        _, ids = torch.topk(scores * 2.0 + self.expert_bias, self.k, dim=-1)
        weights = scores.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class OffsetChoiceRouter(Gate):
    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        _, ids = torch.topk(scores + 0.5 + self.expert_bias, self.k, dim=-1)
        weights = scores.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class UnnormalisedSigmoidRouter(Gate):
    def forward(self, x):
        scores = torch.sigmoid(self.gate(x))
        _, ids = torch.topk(scores + self.expert_bias, self.k, dim=-1)
        return scores.gather(-1, ids) * 2.5, ids


class HalfLitgptRouter(LitgptRouter):
    def forward(self, x):  # the softmax over the k chosen in bf16: the op computes it in fp32
        probs, indices = torch.topk(self.gate(x), self.k)
        return probs.softmax(dim=-1), indices


@pytest.mark.parametrize("module, x, reason", [
    (ScaledChoiceRouter(), _x(8), "scaled before the top-k"),
    (OffsetChoiceRouter(), _x(8), "a constant 0.5 is added"),
    (UnnormalisedSigmoidRouter(), _x(8), "sigmoid mode always renormalises"),
    (GroupLimitedRouter(k=4, groups=4, kept=2, inverted=True, new_ones=False), _x(2, 5),
     "does not keep exactly the experts of the chosen groups"),
    (HalfLitgptRouter().to(torch.bfloat16), _x(8).to(torch.bfloat16), "softmax over the k chosen bfloat16"),
    (TakeAlongDimRouter(k=3, modulus=E - 1), _x(8), "chosen experts' weights are computed some other way"),
], ids=["scaled choice", "offset choice", "no renormalisation", "groups inverted", "bf16 softmax of k",
        "ids wrapped by E - 1"])
def test_look_alikes_do_not_fuse_and_say_why(module, x, reason):
    out, ref, report = _run(module, x)
    assert report.counts["moe_gating"] == 0
    reasons = near_miss_reasons(report, "moe_gating")
    assert len(reasons) == 1 and reason in reasons[0], reasons
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


# ---- training: a recognised router and its backward replaced together -------------------------
def _train(module, x, dynamic=False):
    """(report, the compiled step's and eager's gradients of x and the gate weight)."""
    import copy
    torch._dynamo.reset()
    reference, model = copy.deepcopy(module), copy.deepcopy(module)  # (parametrised modules are shared)
    backend = EmulationBackend(ONLY_GATING)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    grads = []
    for run, mod in ((compiled, model), (reference, reference)):
        xi = x.clone().requires_grad_()
        weights, _ = run(xi)
        torch.manual_seed(7)
        (weights * torch.randn_like(weights)).sum().backward()
        grads.append((xi.grad, mod.gate.weight.grad))
    return backend.report, grads


class TorchtitanRouterTrained(Gate):
    """torchtitan 0.2.2's router as above, its chosen weights what the step differentiates."""

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        _, selected = torch.topk(scores + self.expert_bias, k=self.k, dim=1)
        top_scores = scores.gather(dim=1, index=selected)
        return top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, selected


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("module, x", [
    (TorchtitanRouterTrained(k=3), _x(10)),
    (GroupLimitedRouter(k=4, groups=4, kept=2, inverted=False, new_ones=True), _x(2, 5)),
    (TakeAlongDimRouter(k=3, modulus=E), _x(10)),
], ids=["torchtitan 0.2.2", "group-limited", "take_along_dim"])
def test_a_recognised_sigmoid_router_trains_fused(module, x, dynamic):
    report, ((dx, dw), (dx_ref, dw_ref)) = _train(module, x, dynamic)
    assert report.counts["moe_gating"] == 1, near_miss_reasons(report, "moe_gating")
    assert report.fused_ops == {"npu.npu_moe_gating_top_k": 1, "npu.npu_moe_gating_top_k_backward": 1}
    # the op's backward: the renormalisation's and the sigmoid's derivatives in fp32, in
    # another order than autograd's chain: a few ulp of the gradient's largest element
    assert_close_at_scale(dx, dx_ref, 8)
    assert_close_at_scale(dw, dw_ref, 8)


def test_a_softmax_router_in_training_says_the_op_has_no_backward():
    report, ((dx, dw), (dx_ref, dw_ref)) = _train(BiasedSoftmaxRouter(k=4), _x(10))
    assert report.counts["moe_gating"] == 0
    assert any("npu_moe_gating_top_k_softmax has no backward" in m for m in near_miss_reasons(report, "moe_gating"))
    torch.testing.assert_close(dx, dx_ref)
