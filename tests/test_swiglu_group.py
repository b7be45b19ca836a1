"""swiglu_group on transformers' DeepseekV4SparseMoeBlock (grouped_mm experts, clamped SwiGLU).

The pass runs after moe_dispatch (which fuses the experts block) and with grouped_matmul, as
in the pipeline. Numerics: swiglu_group multiplies the routed score in fp32 before the down
GEMM, transformers after it; the combine sums the same rows. The outputs agree within a few
ulps at their scale (fp32 4, bf16 2: measured 2.5 and 1).
"""
import types

import pytest
import torch

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, compile_and_run, near_miss_reasons
from npu_fx_fusion.patterns import swiglu_group
from v4_modules import MoeBlock, fused_calls, train_and_compare

PASSES = {"moe_dispatch", "moe_gating", "swiglu_group", "grouped_matmul"}
ULPS = {torch.float32: 4, torch.bfloat16: 2}
SHARED_EXPERT = "a clamped SwiGLU whose gate and up come from separate projections (DeepSeek-V4's shared expert"


def _inputs(dtype=torch.float32):
    torch.manual_seed(4)
    return torch.randn(2, 9, 64).to(dtype), torch.randint(0, 100, (2, 9))


def _run(module, dtype=torch.float32, soc=None):
    return compile_and_run(module, *_inputs(dtype), config=nff.FusionConfig(enable=PASSES, soc=soc))


@pytest.mark.parametrize("kind, dtype", [("topk", torch.float32), ("hash", torch.bfloat16)])
def test_the_experts_activation_fuses_with_the_score_folded(kind, dtype):
    out, ref, report = _run(MoeBlock(kind, dtype=dtype), dtype)
    assert report.counts["swiglu_group"] == 1
    assert report.fused_ops["cann_ops_nn.swiglu_group"] == 1
    assert report.fused_ops["npu.npu_moe_finalize_routing"] == 1
    assert_close_at_scale(out, ref, ULPS[dtype])
    # the shared expert stays, with its reason
    assert any(r.startswith(SHARED_EXPERT) for r in near_miss_reasons(report, "swiglu_group"))


def test_a2_gets_npu_clipped_swiglu():
    out, ref, report = _run(MoeBlock("topk", dtype=torch.bfloat16), torch.bfloat16, soc="Ascend910B")
    assert report.counts["swiglu_group"] == 1
    assert "cann_ops_nn.swiglu_group" not in report.fused_ops
    assert report.fused_ops["npu.npu_clipped_swiglu"] == 1
    assert_close_at_scale(out, ref, ULPS[torch.bfloat16])
    # reported at the model's own line of the activation (DeepseekV4Experts._apply_gate), not at
    # the grouped GEMM after it: moe_dispatch's replacement keeps the activation, one of the two
    # muls of the block it replaces, and its call is aligned with the model's (accept.py)
    (site,) = [s for s in report.sites if s.pass_name == "swiglu_group"]
    assert site.location.file.endswith("modeling_deepseek_v4.py"), site.location
    assert site.location.code == "return self.act_fn(gate) * up", site.location


def test_the_limit_is_captured():
    module = MoeBlock("topk", swiglu_limit=0.25)  # most gate_up values clamp at 0.25
    out, ref, report = _run(module)
    assert report.counts["swiglu_group"] == 1
    assert_close_at_scale(out, ref, ULPS[torch.float32])


def test_an_asymmetric_clamp_is_a_near_miss():
    module = MoeBlock("topk")
    experts = module.block.experts

    def asymmetric(self, gate_up):  # up clamped to [-2L, L]: neither op clamps that way
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-2 * self.limit, max=self.limit)

    experts._apply_gate = types.MethodType(asymmetric, experts)
    out, ref, report = _run(module)
    assert report.counts["swiglu_group"] == 0
    limit = experts.limit
    assert (f"up is clamped to [{-2 * limit}, {limit}] and the gate below {limit}: both ops clamp up to "
            "[-limit, limit] with limit > 0") in near_miss_reasons(report, "swiglu_group")
    assert_close_at_scale(out, ref, ULPS[torch.float32])


def test_a_down_gemm_with_a_bias_is_refused():
    # transformers' grouped_mm experts have no bias and the forms spell none; the check keeps
    # the score move correct should a graph spell one (a canonical spelling with bias=None)
    graph = torch.fx.Graph()
    x, w, offs, bias = (graph.placeholder(n) for n in ("x", "w", "offs", "bias"))
    biased = graph.call_function(torch.ops.aten._grouped_mm.default, (x, w, offs, bias))
    plain = graph.call_function(torch.ops.aten._grouped_mm.default, (x, w, offs))
    assert swiglu_group._gemm_bias_free(types.SimpleNamespace(nodes=[plain])) is None
    assert swiglu_group._gemm_bias_free(types.SimpleNamespace(nodes=[plain, biased])) == (
        f"{biased.name} has a bias: moving the score before it would scale the bias too")


def test_without_moe_dispatch_the_activation_alone_fuses():
    # no fused block: the score stays after the GEMM, npu_clipped_swiglu takes the activation
    config = nff.FusionConfig(enable={"swiglu_group"})
    out, ref, report = compile_and_run(MoeBlock("topk"), *_inputs(), config=config)
    assert report.fused_ops == {"npu.npu_clipped_swiglu": 1}
    assert_close_at_scale(out, ref, ULPS[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trains_through_swiglu_group_backward(dtype):
    backend = train_and_compare(MoeBlock("topk", dtype=dtype), list(_inputs(dtype)), nff.FusionConfig(enable=PASSES),
                                {torch.float32: 16, torch.bfloat16: 4})
    assert fused_calls(backend.graphs["forward"])["cann_ops_nn.swiglu_group"] >= 1
    assert fused_calls(backend.graphs["backward"])["cann_ops_nn.swiglu_group_backward"] == 1
    assert fused_calls(backend.graphs["forward"])["npu.npu_moe_token_unpermute"] == 1
