"""moe_dispatch: transformers' grouped_mm experts block -> init_routing_v2 ... finalize_routing.

The block's output must equal the model's. Inside, the rows of one expert come in
another order (torch.sort is not stable, init_routing's sort is), so only the block's
output is compared, and the inputs have many tokens per expert (ties in the sort) to make
that difference real. Tolerance: fp32 1e-5 relative to the output's scale (sums of the
same products in another order); bf16: the model rounds y * w to bf16 before summing,
the op sums fp32 products, a few bf16 ulps at the output's scale.
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import TORCHTITAN_DEEPSEEK_ROUTER, assert_close_at_scale, compile_and_run, near_miss_reasons, torchtitan_moe

EXPERTS, TOP_K, HIDDEN, FFN = 4, 2, 16, 8


class GroupedMmExperts(torch.nn.Module):
    """transformers 5 grouped_mm_experts_forward (integrations/moe.py), gated experts."""

    def __init__(self, dtype, weighted=True, cast_back=True):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN, dtype=dtype) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN, dtype=dtype) * 0.3)
        self.weighted = weighted
        self.cast_back = cast_back

    def _gemm(self, x, w, offs):
        if x.dtype == torch.bfloat16:
            return torch._grouped_mm(x, w, offs)
        return torch.ops.transformers.grouped_mm_fallback(x, w, offs)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        tokens_per_expert = torch.histc(expert_ids_g.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate, up = self._gemm(selected, self.gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
        proj = self._gemm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offsets)
        weighted = proj * sample_weights_g.unsqueeze(-1) if self.weighted else proj
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        out = weighted[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return out.to(hidden_states.dtype) if self.cast_back else out


def _routing(dtype, tokens=96, weights_dtype=None):
    """Top-k ids of a random router over few experts: many ties in the sort."""
    torch.manual_seed(1)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    probs = torch.softmax(torch.randn(tokens, EXPERTS), -1)
    weights, ids = torch.topk(probs, TOP_K, -1)
    return x, ids, weights.to(weights_dtype or dtype)


@pytest.fixture(autouse=True, scope="module")
def _transformers_fallback_op():
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers)


def _assert_block_equal(out, ref):
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    else:
        assert_close_at_scale(out, ref, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("passes", [{"moe_dispatch"}, {"moe_dispatch", "swiglu", "grouped_matmul"}],
                         ids=["dispatch only", "with swiglu and grouped_matmul"])
def test_the_block_becomes_init_routing_and_finalize(dtype, passes):
    x, ids, weights = _routing(dtype)
    config = nff.FusionConfig(enable=passes)
    out, ref, report = compile_and_run(GroupedMmExperts(dtype), x, ids, weights, config=config)
    assert report.counts["moe_dispatch"] == 1
    fused = report.fused_ops
    assert fused["npu.npu_moe_init_routing_v2"] == 1 and fused["npu.npu_moe_finalize_routing"] == 1
    ops = report.graphs[0].ops_after
    assert ops["aten.sort.default"] == ops["aten.histc.default"] == ops["aten.index_put.default"] == 0
    if "grouped_matmul" in passes:  # the whole block: routing -> 2 grouped GEMMs + swiglu -> combine
        assert fused["npu.npu_grouped_matmul"] == 2 and fused["npu.npu_swiglu"] == 1
    _assert_block_equal(out, ref)


def _active_nums(gm):
    # (a trace leaves out an argument passed at its schema default, -1 for active_num)
    return [n.kwargs.get("active_num", -1) for n in gm.graph.nodes
            if n.target is torch.ops.npu.npu_moe_init_routing_v2.default]


def test_a_symbolic_token_count_routes_every_row_without_pinning_it():
    """dynamic=True: init_routing's active_num is an int attribute. The static N*K is spelled
    out (the V3 doc: must equal NUM_ROWS*K); a symbolic one would be specialised into a guard
    N*K == this compile's value, a recompile per token count, so -1 (every row: the kernel's
    tiling skips the N*K check for -1) is passed instead. One graph serves both counts."""
    from helpers import RecordingBackend

    static = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}))
    with torch.no_grad():
        torch.compile(GroupedMmExperts(torch.float32), backend=static, fullgraph=True)(*_routing(torch.float32))
    assert _active_nums(static.graphs["inference"]) == [96 * TOP_K]

    torch._dynamo.reset()
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}))
    module = GroupedMmExperts(torch.float32)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (96, 61):
            x, ids, weights = _routing(torch.float32, tokens=tokens)
            for t in (x, ids, weights):
                torch._dynamo.mark_dynamic(t, 0)
            _assert_block_equal(compiled(x, ids, weights), module(x, ids, weights))
    assert len(backend.report.graphs) == 1 and backend.report.counts["moe_dispatch"] == 1
    assert _active_nums(backend.graphs["inference"]) == [-1]


def test_fp32_routing_weights_on_bf16_experts():
    # DeepSeek-V3: the router's weights stay fp32, y * w promotes, the block returns fp32
    x, ids, weights = _routing(torch.bfloat16, weights_dtype=torch.float32)

    class Promoting(GroupedMmExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights).float()

    out, ref, report = compile_and_run(Promoting(torch.bfloat16), x, ids, weights,
                                       config=nff.FusionConfig(enable={"moe_dispatch"}))
    assert report.counts["moe_dispatch"] == 1
    _assert_block_equal(out, ref)


class WithSharedExperts(torch.nn.Module):
    """DeepSeek-V3's MoE (transformers DeepseekV3MoE.forward): the routed experts' sum, in the
    model's dtype, plus the shared experts' output. The routing weights are fp32 (its router)."""

    def __init__(self, dtype, add_a_bias_instead=False):
        super().__init__()
        self.experts = GroupedMmExperts(dtype)
        self.shared = torch.nn.Linear(HIDDEN, HIDDEN, bias=False).to(dtype)
        # a (1, H) bias broadcasts over the tokens: not something finalize can add
        self.bias = torch.nn.Parameter(torch.randn(1, HIDDEN, dtype=dtype)) if add_a_bias_instead else None

    def forward(self, x, ids, weights):
        routed = self.experts(x, ids, weights)
        return routed + (self.shared(x) if self.bias is None else self.bias)


def _finalize_calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.npu.npu_moe_finalize_routing.default]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_combine_takes_its_rows_in_the_model_dtype_and_the_shared_output_as_skip1(dtype, dynamic):
    """finalize's mixed-precision mode (bf16 rows, fp32 scales) instead of casting the rows to
    fp32 and the sum back, and the add of the shared experts' output as its skip1: the block
    launches one call where it launched three (bf16) or two (fp32)."""
    from helpers import RecordingBackend

    x, ids, weights = _routing(dtype, weights_dtype=torch.float32)
    module = WithSharedExperts(dtype)
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(x, ids, weights)
        ref = module(x, ids, weights)
    (call,) = _finalize_calls(backend.graphs["inference"])
    rows, skip1, skip2, _, scales = call.args[:5]
    assert rows.meta["val"].dtype == dtype and scales.meta["val"].dtype == torch.float32
    assert skip1 is not None and skip2 is None and call.meta["val"].dtype == dtype
    ops = backend.report.graphs[0].ops_after
    assert ops["aten.add.Tensor"] == 0 and ops["aten._to_copy.default"] <= 2  # ids to int32 (twice at most)
    (result,) = [r for r in backend.report.graphs[0].passes if r.pass_name == "moe_dispatch"]
    assert len(result.finished) == (2 if dtype == torch.bfloat16 else 1), result.finished
    # bf16: the model rounds the routed sum before adding the shared output, the op once after
    _assert_block_equal(out, ref)


def test_keep_intermediate_rounding_keeps_the_add_after_a_half_combine():
    from helpers import RecordingBackend

    x, ids, weights = _routing(torch.bfloat16, weights_dtype=torch.float32)
    module = WithSharedExperts(torch.bfloat16)
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}, keep_intermediate_rounding=True))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(x, ids, weights)
    (call,) = _finalize_calls(backend.graphs["inference"])
    assert call.args[1] is None  # the model's rounding of the routed sum stays
    assert call.args[0].meta["val"].dtype == torch.bfloat16  # the kernel widens the rows itself: exact
    assert backend.report.graphs[0].ops_after["aten.add.Tensor"] == 1
    _assert_block_equal(out, module(x, ids, weights))


def test_a_sum_read_in_fp32_or_a_broadcast_add_stays_as_it_was():
    from helpers import RecordingBackend

    x, ids, weights = _routing(torch.bfloat16, weights_dtype=torch.float32)
    module = WithSharedExperts(torch.bfloat16, add_a_bias_instead=True)
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(x, ids, weights)
    (call,) = _finalize_calls(backend.graphs["inference"])
    assert call.args[1] is None and backend.report.graphs[0].ops_after["aten.add.Tensor"] == 1
    _assert_block_equal(out, module(x, ids, weights))

    # the fp32 sum is the block's output: the rows stay widened, the sum fp32
    torch._dynamo.reset()
    module = GroupedMmExperts(torch.bfloat16, cast_back=False)
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch"}))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(x, ids, weights)
    (call,) = _finalize_calls(backend.graphs["inference"])
    assert call.meta["val"].dtype == torch.float32 and call.args[0].meta["val"].dtype == torch.float32
    _assert_block_equal(out, module(x, ids, weights))


def test_every_site_verifies():
    x, ids, weights = _routing(torch.float32)
    config = nff.FusionConfig(enable={"moe_dispatch"}, verify=True)
    _, _, report = compile_and_run(GroupedMmExperts(torch.float32), x, ids, weights, config=config)
    (site,) = report.sites
    assert site.verified.startswith("verified: max error"), site.verified


def test_a_combine_without_the_routing_weights_does_not_fuse():
    x, ids, weights = _routing(torch.float32)
    out, ref, report = compile_and_run(GroupedMmExperts(torch.float32, weighted=False), x, ids, weights,
                                       config=nff.FusionConfig(enable={"moe_dispatch"}))
    assert report.counts["moe_dispatch"] == 0
    (miss,) = near_miss_reasons(report, "moe_dispatch")
    assert "neither transformers' grouped_mm experts block" in miss, miss
    torch.testing.assert_close(out, ref)


def test_310p_has_no_routing_ops():
    x, ids, weights = _routing(torch.float32)
    config = nff.FusionConfig(enable={"moe_dispatch"}, soc="Ascend310P")
    _, _, report = compile_and_run(GroupedMmExperts(torch.float32), x, ids, weights, config=config)
    assert report.counts["moe_dispatch"] == 0
    (miss,) = near_miss_reasons(report, "moe_dispatch")
    assert "not available on Ascend310P" in miss, miss


class BatchedMmExperts(GroupedMmExperts):
    """transformers 5 batched_mm_experts_forward: a weight gathered per (token, expert) pair."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        selected = hidden_states.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        gate, up = torch.bmm(self.gate_up_proj[expert_ids], selected.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        proj = torch.bmm(self.down_proj[expert_ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        weighted = proj * sample_weights.unsqueeze(-1)
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("passes", [{"moe_dispatch"}, {"moe_dispatch", "swiglu"}], ids=["silu_mul", "npu_swiglu"])
def test_the_batched_block_becomes_routing_grouped_matmuls_and_finalize(dtype, passes):
    x, ids, weights = _routing(dtype)
    out, ref, report = compile_and_run(BatchedMmExperts(dtype), x, ids, weights,
                                       config=nff.FusionConfig(enable=passes))
    assert report.counts["moe_dispatch"] == 1
    fused = report.fused_ops
    assert fused["npu.npu_moe_init_routing_v2"] == fused["npu.npu_moe_finalize_routing"] == 1
    assert fused["npu.npu_grouped_matmul"] == 2
    assert report.graphs[0].ops_after["aten.bmm.default"] == 0
    _assert_block_equal(out, ref)


# ---- torchtitan: LocalTokenDispatcher + GroupedExperts --------------------------------------
ONLY_DISPATCH = nff.FusionConfig(enable={"moe_dispatch"})


def _torchtitan_tokens(dtype=torch.float32, dim=64):
    torch.manual_seed(2)
    return torch.randn(2, 24, dim).to(dtype)  # 48 tokens over 8 experts: many per expert


@pytest.mark.parametrize("router", [{}, TORCHTITAN_DEEPSEEK_ROUTER], ids=["softmax+bias", "sigmoid groups"])
def test_torchtitan_block_becomes_init_routing_and_finalize(router):
    moe = torchtitan_moe(num_experts=16 if router else 8, **router)
    out, ref, report = compile_and_run(moe, _torchtitan_tokens(), config=ONLY_DISPATCH)
    assert report.counts["moe_dispatch"] == 1
    assert report.fused_ops == {"npu.npu_moe_init_routing_v2": 1, "npu.npu_moe_finalize_routing": 1}
    # the same rows through the same bf16 GEMMs; each token's k weighted rows added in
    # another order (fp32)
    _assert_block_equal(out, ref)


def test_torchtitan_block_in_bf16():
    moe = torchtitan_moe()
    for param in moe.parameters():
        param.data = param.data.bfloat16()
    moe.expert_bias_E.data = moe.expert_bias_E.data.bfloat16()
    out, ref, report = compile_and_run(moe, _torchtitan_tokens(torch.bfloat16), config=ONLY_DISPATCH)
    assert report.counts["moe_dispatch"] == 1
    # torchtitan rounds each weighted row to bf16 and adds the k rows in bf16; finalize adds
    # in fp32 and rounds once: at most k (3) roundings apart at the output's scale
    assert_close_at_scale(out, ref, 3)


def test_torchtitan_block_verifies():
    config = nff.FusionConfig(enable={"moe_dispatch"}, verify=True)
    _, _, report = compile_and_run(torchtitan_moe(), _torchtitan_tokens(), config=config)
    (site,) = report.sites
    assert site.verified.startswith("verified: max error"), site.verified


def _unstable_reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
    perm = torch.argsort(topk_expert_ids_TK.view(-1))  # not stable: rows of one expert in any order
    return x_TD[perm // self.top_k], perm // self.top_k, topk_scores_TK.view(-1)[perm]


def _unweighted_combine(self, routed_output_RD, metadata, x_TD):
    from torchtitan.ops.scatter_add import deterministic_scatter_add

    index = metadata.token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, x_TD.shape[-1])
    return deterministic_scatter_add(torch.zeros_like(x_TD), index, routed_output_RD)


@pytest.mark.parametrize("method, replacement", [("_local_reorder", _unstable_reorder),
                                                 ("combine", _unweighted_combine)],
                         ids=["unstable argsort", "combine without weights"])
def test_torchtitan_variants_the_rewrite_does_not_cover_stay_unfused(monkeypatch, method, replacement):
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    moe = torchtitan_moe()
    monkeypatch.setattr(type(moe.routed_experts.token_dispatcher), method, replacement)
    assert isinstance(moe.routed_experts.token_dispatcher, LocalTokenDispatcher)
    out, ref, report = compile_and_run(moe, _torchtitan_tokens(), config=ONLY_DISPATCH)
    assert report.counts["moe_dispatch"] == 0
    (miss,) = near_miss_reasons(report, "moe_dispatch")
    assert "torchtitan's local dispatcher" in miss, miss
    torch.testing.assert_close(out, ref)


# ---- DeepSeek-V4: transformers' grouped_mm experts around the clamped SwiGLU --------------------
# DeepseekV4Experts runs transformers' grouped_mm block with its own _apply_gate (clamped
# SwiGLU): the limits are captured and replayed. Tolerance: the same rows, their k-sum in the
# op's fp32 (a few ulps at the output's scale).
def _v4_moe(dtype=torch.float32, **config):
    from v4_modules import MoeBlock

    torch.manual_seed(8)
    return MoeBlock("topk", dtype=dtype, **config), torch.randn(2, 9, 64).to(dtype), torch.randint(0, 100, (2, 9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v4_experts_block_fuses(dtype):
    module, hidden, ids = _v4_moe(dtype)
    out, ref, report = compile_and_run(module, hidden, ids, config=nff.FusionConfig(enable={"moe_dispatch"}))
    assert report.counts["moe_dispatch"] == 1
    assert report.fused_ops == {"npu.npu_moe_init_routing_v2": 1, "npu.npu_moe_finalize_routing": 1}
    assert_close_at_scale(out, ref, 4 if dtype == torch.float32 else 2)


def test_deepseek_v4_clamp_limits_are_replayed_as_captured():
    # up clamped to [-2L, L]: not transformers' _apply_gate, but the replacement keeps the
    # activation, so the block still fuses and computes the same
    import types

    module, hidden, ids = _v4_moe(swiglu_limit=0.5)
    experts = module.block.experts

    def asymmetric(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-2 * self.limit, max=self.limit)

    experts._apply_gate = types.MethodType(asymmetric, experts)
    out, ref, report = compile_and_run(module, hidden, ids, config=nff.FusionConfig(enable={"moe_dispatch"}))
    assert report.counts["moe_dispatch"] == 1
    assert_close_at_scale(out, ref, 4)


def test_deepseek_v4_experts_block_trains_through_permute_and_unpermute():
    from v4_modules import fused_calls, train_and_compare

    module, hidden, ids = _v4_moe()
    backend = train_and_compare(module, [hidden, ids], nff.FusionConfig(enable={"moe_dispatch"}), {torch.float32: 16})
    assert fused_calls(backend.graphs["forward"]) == {"npu.npu_moe_token_permute": 1, "npu.npu_moe_token_unpermute": 1}
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_moe_token_permute_grad_v2": 1,
                                                      "npu.npu_moe_token_unpermute_grad_v2": 1}


class SortedRowsLeaveTheGraph(torch.nn.Module):
    """torchtitan's dispatch up to the gather, where its for-loop experts break the graph
    (counts.tolist()): the sorted rows and their order are this graph's outputs."""

    def forward(self, x, expert_ids):
        order = torch.argsort(expert_ids.view(-1), stable=True)
        return x[order // expert_ids.shape[1]], order


def test_a_dispatch_whose_rows_leave_the_graph_names_the_break():
    x, expert_ids = torch.randn(6, 8), torch.randint(0, 4, (6, 2))
    out, ref, report = compile_and_run(SortedRowsLeaveTheGraph(), x, expert_ids,
                                       config=nff.FusionConfig(enable={"moe_dispatch"}))
    (reason,) = near_miss_reasons(report, "moe_dispatch")
    assert "the gathered rows leave this graph" in reason and "a graph break after the gather" in reason, reason
    torch.testing.assert_close(out, ref)
