"""FusionConfig(verify=True): a wrong replacement is caught and not kept; the cost estimate."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fx_fusion as nff
from helpers import ScaleShiftFusion, compile_and_run, near_miss_reasons
from npu_fx_fusion import capabilities
from npu_fx_fusion.report import GraphCost
from npu_fx_fusion.tiny_models import build_hf

# ---- a test-only fusion whose fused op computes something slightly different ------------
_WRONG = ScaleShiftFusion("nff_test_verify", shift=1.001)  # x * 2 + 1.001 for x * 2 + 1


@pytest.fixture(autouse=True)
def _capability(monkeypatch):
    monkeypatch.setitem(capabilities.CAPABILITIES, _WRONG.capability.op, _WRONG.capability)


def _pass(replace):
    return _WRONG.fusion_pass(replace)


_wrong, _right = _WRONG.fused, ScaleShiftFusion.exact


def _graph():
    return ScaleShiftFusion.graph(3, 5)


def test_a_wrong_replacement_is_not_kept_when_verifying():
    result = _pass(_wrong).apply(_graph(), verify=True)
    assert result.sites == []
    (miss,) = result.near_misses
    assert miss.reason.startswith("verification failed: output 0: error"), miss.reason
    assert "exceeds 4 ulp (float32)" in miss.reason


def test_without_verification_the_wrong_replacement_goes_through():
    # what the check above prevents: structurally the match is perfect
    result = _pass(_wrong).apply(_graph(), verify=False)
    assert len(result.sites) == 1 and result.sites[0].verified == ""


def test_a_right_replacement_is_verified_and_says_so():
    result = _pass(_right).apply(_graph(), verify=True)
    (site,) = result.sites
    assert site.verified == "verified: max error 0 ulp at the output's scale (tolerance 4)"


def test_every_site_of_a_real_model_verifies():
    tiny = build_hf("deepseek_v3", dtype=torch.bfloat16)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs, config=nff.FusionConfig(verify=True))
    # norms, rope, swiglu, moe_dispatch, moe_gating (compared in expert order), grouped_matmul
    assert len(report.sites) == 9 + 4 + 4 + 1 + 1 + 1 + 2
    assert all(s.verified.startswith("verified: max error") for s in report.sites), \
        [s.verified for s in report.sites]
    assert not any("verification failed" in r for p in ("rms_norm", "rope", "swiglu", "grouped_matmul")
                   for r in near_miss_reasons(report, p))


# ---- cost estimate --------------------------------------------------------------------------
def test_cost_counts_computing_ops_and_their_bytes():
    def f(x, w):
        h = x.view(4, 8).t()  # views: free
        return torch.relu(h @ w)  # mm + relu: 2 launches

    gm = make_fx(f, tracing_mode="fake")(torch.randn(32), torch.randn(4, 4))
    cost = GraphCost.of(gm.graph)
    assert cost.launches == 2
    floats = 4  # bytes per fp32
    mm = (8 * 4 + 4 * 4 + 8 * 4) * floats  # reads h (8x4) and w (4x4), writes 8x4
    relu = (8 * 4 + 8 * 4) * floats
    assert cost.bytes_moved == mm + relu


def test_fusion_lowers_the_estimate_and_the_report_says_so():
    tiny = build_hf("llama")
    _, _, report = compile_and_run(tiny.model, *tiny.example_inputs)
    graph = report.graphs[0]
    assert graph.cost_after.launches < graph.cost_before.launches
    assert graph.cost_after.bytes_moved < graph.cost_before.bytes_moved
    assert "kernel launches" in report.to_markdown()
