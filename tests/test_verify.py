"""FusionConfig(verify=True): a wrong replacement is caught and not kept; the cost estimate."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import npu_fx_fusion as nff
from helpers import ScaleShiftFusion, compile_and_run, near_miss_reasons
from npu_fx_fusion import capabilities
from npu_fx_fusion.accept import apply_pass
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
    result = apply_pass(_pass(_wrong), _graph(), verify=True)
    assert result.sites == []
    (miss,) = result.near_misses
    assert miss.reason.startswith("verification failed: output 0: error"), miss.reason
    assert "exceeds 4 ulp (float32)" in miss.reason


def test_without_verification_the_wrong_replacement_goes_through():
    # what the check above prevents: structurally the match is perfect
    result = apply_pass(_pass(_wrong), _graph(), verify=False)
    assert len(result.sites) == 1 and result.sites[0].verified == ""


def test_a_right_replacement_is_verified_and_says_so():
    result = apply_pass(_pass(_right), _graph(), verify=True)
    (site,) = result.sites
    assert site.verified == "verified: max error 0 ulp at the output's scale (tolerance 4)"


def test_every_site_of_a_real_model_verifies():
    tiny = build_hf("deepseek_v3", dtype=torch.bfloat16)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs, config=nff.FusionConfig(verify=True))
    # attention, norms, rope, swiglu, moe_dispatch, moe_gating (compared in expert order),
    # grouped_matmul; then merged_projections (each layer's q_a / kv_a down-projections, the dense
    # MLP's and the shared expert's gate / up) and the swiglu of the two merged gate / up
    assert len(report.sites) == 2 + 9 + 4 + 4 + 1 + 1 + 1 + 2 + 4 + 2
    assert all(s.verified.startswith("verified: max error") for s in report.sites), \
        [s.verified for s in report.sites]
    assert not any("verification failed" in r for p in ("rms_norm", "rope", "swiglu", "grouped_matmul")
                   for r in near_miss_reasons(report, p))


# ---- joint (training) sites: forward outputs and gradients -----------------------------------
def _doubled_tanh_fusion(grad_scale):
    """A test-only differentiable fusion: tanh(x) * 2 becomes `doubled_tanh(x)`, whose
    backward is right for grad_scale 1 and scaled by grad_scale otherwise."""
    from npu_fx_fusion.capabilities import FLOAT_DTYPES, OpCapability
    from npu_fx_fusion.matching import Form, FusionPass

    namespace = f"nff_test_joint_{str(grad_scale).replace('.', '_')}"
    lib = torch.library.Library(namespace, "DEF")
    lib.define("doubled_tanh(Tensor x) -> Tensor")
    lib.impl("doubled_tanh", lambda x: torch.tanh(x) * 2, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::doubled_tanh", torch.empty_like, lib=lib)
    torch.library.register_autograd(
        f"{namespace}::doubled_tanh", lambda ctx, grad: grad * 2 * (1 - torch.tanh(ctx.x) ** 2) * grad_scale,
        setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]), lib=lib)
    op = getattr(torch.ops, namespace).doubled_tanh
    capability = OpCapability(op=f"{namespace}.doubled_tanh", dtypes=FLOAT_DTYPES, min_rank=0, max_rank=8,
                              backward=f"{namespace}.doubled_tanh (test)", ge_converter=True)

    def doubled_tanh(x):
        return torch.tanh(x) * 2

    def fused(x):
        return op(x)

    fusion_pass = FusionPass(name="test", fused_op=capability.op,
                             forms=[Form(doubled_tanh, fused, dtypes=(torch.float32,))],
                             example={"x": lambda dtype: torch.empty(4, dtype=dtype)},
                             check=lambda site: None, anchor=lambda node: node.target is torch.ops.aten.tanh.default,
                             explain=lambda node: None, differentiable=("x",))
    return lib, capability, fusion_pass


@pytest.mark.parametrize("grad_scale, verified", [(1.0, True), (1.001, False)], ids=["right", "wrong backward"])
def test_joint_sites_verify_the_backward_too(monkeypatch, grad_scale, verified):
    """On a joint graph the matched forward and backward nodes run against the fused op
    and its backward, on the same inputs and incoming gradient: an op whose forward is
    right and whose backward is 0.1% off is caught."""
    from npu_fx_fusion.tracing import trace_joint_without_decompositions

    _lib, capability, fusion_pass = _doubled_tanh_fusion(grad_scale)
    monkeypatch.setitem(capabilities.CAPABILITIES, capability.op, capability)
    joint = trace_joint_without_decompositions(lambda x: (torch.tanh(x) * 2).exp(), [torch.randn(3, 5, requires_grad=True)])
    result = apply_pass(fusion_pass, joint, verify=True, joint=True)
    if verified:
        (site,) = result.sites
        assert site.verified.startswith("verified: max error"), site.verified
    else:
        assert result.sites == []
        (miss,) = result.near_misses
        # output 0 is the forward result (right); output 1 the gradient of x
        assert miss.reason.startswith("verification failed: output 1: error"), miss.reason


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
    assert "kernel launches" in report.to_markdown()
    # bytes without attention: its causal prefill takes FIA's compressed mask, a 2048x2048
    # constant (built once per graph) that outweighs a 16-token attention in this count
    _, _, report = compile_and_run(tiny.model, *tiny.example_inputs,
                                   config=nff.FusionConfig(disable={"attention"}))
    graph = report.graphs[0]
    assert graph.cost_after.bytes_moved < graph.cost_before.bytes_moved


# ---- same_function: a region identified on random inputs (mhc_pre's recognition) ---------------
def _region(f, *shapes):
    gm = make_fx(f, tracing_mode="fake")(*[torch.empty(s) for s in shapes])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    (output,) = gm.graph.find_nodes(op="output")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return nodes, list(output.args[0]), {f"x{i}": p for i, p in enumerate(placeholders)}


def test_same_function_takes_a_region_that_rounds_more_coarsely_as_the_same_function():
    from npu_fx_fusion.verify import same_function

    # the region rounds its product to bf16 (as torchtitan-npu's V4 projects); its exact value is
    # the fp32 function's, which the "fused" call computes
    nodes, outputs, args = _region(lambda a, b: [(a.bfloat16() @ b.bfloat16()).float().sigmoid()], (4, 8), (8, 3))
    values = {name: node.meta["val"] for name, node in args.items()}
    verdict = same_function(nodes, outputs, values, args, lambda a, b: [(a @ b).sigmoid()], list(args), 16)
    assert verdict.ok, verdict.detail
    # another function is told apart, and the verdict says where and by how much
    verdict = same_function(nodes, outputs, values, args, lambda a, b: [(a @ b).sigmoid() * 1.001], list(args), 16)
    assert not verdict.ok and verdict.detail.startswith("output 0: ") and "more than 16 ulp of float32" in verdict.detail
