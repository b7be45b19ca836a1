"""The whole tiny transformers deepseek_v4 (issue 17), through the emulation backend: which sites
fuse, family by family, and the logits and gradients against eager.

build_hf("deepseek_v4"): 3 layers (sliding, CSA with its indexer, HCA attention; a hash-routed and
two top-k MoE layers), mHC over 4 streams. Compiled with get_npu_backend()'s CPU emulation (no
torchair; NPU dispatch emulated for the default SoC, as tests/test_models.py does).

Precision. The fused ops compute the model's fp32 arithmetic in another order, and round once
where the model rounds after each op; through 3 layers, the hyper-connections and the LM head the
differences travel as absolute errors at the activations' scale. So both the fused and the eager
run are compared with a float64 run of the same weights (helpers.KeepFloat64: transformers casts
its mHC, router and compressor math to fp32 explicitly) and the fused run must be about as exact
as the model's own fp32 (bf16) arithmetic: its largest error, over the logits and over every
parameter's gradient, within twice eager's largest (in ulps at each tensor's scale), and no
gradient off by more than a fixed bound. Measured numbers are at each assertion.

The largest gradient errors are those of the hyper-connections' `scale` (3 numbers each): each
is a sum over every token and mix of dz * w whose terms cancel, sum |terms| up to 100x |sum|
(layers.1.ffn_hc.scale), so a few ulps of rounding in the terms become tens of ulps of the
result, eager's as much as the fused op's (fp32, seed 0: eager 181 ulp at scale from float64,
fused 127, on opposite sides: 307 apart). See docs/passes/mhc_pre.md, "Training graphs".
"""
import copy
from dataclasses import dataclass, field

import pytest
import torch

import npu_fx_fusion as nff
from helpers import KeepFloat64, RecordingBackend, errors_at_scale, near_miss_reasons
from npu_fx_fusion.tiny_models import build_hf
from v4_modules import SHARED_EXPERT_SWIGLUS, site_table

# the passes that must leave no near miss on V4 (each site of theirs fuses), routers aside
COMPLETE = ("mhc_pre", "mhc_post", "rope", "sparse_mla", "lightning_indexer", "sparse_attention", "moe_dispatch",
            "grouped_matmul", "rms_norm", "attention")
SHARED_EXPERT = "a clamped SwiGLU whose gate and up come from separate projections (DeepSeek-V4's shared expert"
SEPARATE_PROJECTIONS = "gate and up come from separate projections"
CLAMPED = "gate and up are clamped (DeepSeek-V4's clamped SwiGLU): npu_swiglu has no clamp"
BF16_ROUTER = "scores over bfloat16 logits: npu_moe_gating_top_k ranks fp32 scores"
TRAINING_ROUTER = ("a sqrt-softplus router in training (DeepSeek-V4): npu_moe_gating_top_k_backward differentiates "
                   "the sigmoid mode only (norm_type 1), not norm_type 2")


@dataclass
class Step:
    report: object
    backend: object
    logits: dict  # "fused" / "eager" / "exact" (float64)
    grads: dict = field(default_factory=dict)  # parameter name -> (fused, eager, exact)


def _float64_copy(model):
    exact = copy.deepcopy(model).double()
    for module in exact.modules():  # torch's grouped_mm takes no float64: the experts' own loop
        if getattr(getattr(module, "config", None), "_experts_implementation", None) is not None:
            module.config._experts_implementation = "eager"
    return exact


def _step(dtype, train, seed=0):
    tiny = build_hf("deepseek_v4", dtype=dtype, seed=seed)
    model, inputs = tiny.model, tuple(tiny.example_inputs)
    eager, exact = copy.deepcopy(model), _float64_copy(model)
    torch._dynamo.reset()
    # merged_projections off: the families below are counted as the model writes them (with it,
    # the shared expert's gate and up are merged and its clamped SwiGLU fuses too:
    # test_merging_fuses_the_shared_experts_clamped_swiglu)
    backend = RecordingBackend(nff.FusionConfig(disable={"merged_projections"}))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(train):
        fused_out = compiled(*inputs)
        eager_out = eager(*inputs)
        with KeepFloat64():
            exact_out = exact(*inputs)
    step = Step(backend.report, backend, {"fused": fused_out, "eager": eager_out, "exact": exact_out})
    if train:
        probe = torch.randn(fused_out.shape, generator=torch.Generator().manual_seed(5))
        for out in (fused_out, eager_out, exact_out):
            (out * probe.to(out.dtype)).sum().backward()
        for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
            step.grads[name] = (p.grad, q.grad, r.grad)
    return step


@pytest.fixture(scope="module")
def inference_fp32():
    return _step(torch.float32, train=False)


@pytest.fixture(scope="module")
def inference_bf16():
    return _step(torch.bfloat16, train=False)


@pytest.fixture(scope="module")
def training_fp32():
    return _step(torch.float32, train=True)


@pytest.fixture(scope="module")
def training_bf16():
    return _step(torch.bfloat16, train=True)


def _assert_site_table(report, unfused=()):
    """Every family fused as often as the model has it, but `unfused` ({family: count})."""
    table = site_table(report)
    expected = {family: (present - dict(unfused).get(family, 0), present) for family, (_, present) in table.items()}
    assert table == expected


def _assert_as_exact_as_eager(fused, eager, exact, precision, factor=2.0, floor=4.0):
    """fused's error against float64 within `factor` x eager's (or `floor` ulps where eager is
    exact by chance). Returns both errors (ulps of `precision` at the float64 tensor's scale)."""
    fused_error, eager_error = errors_at_scale(fused, exact, precision), errors_at_scale(eager, exact, precision)
    assert fused_error <= max(factor * eager_error, floor), (fused_error, eager_error)
    return fused_error, eager_error


def _assert_gradients(step, precision, bound):
    """Over every parameter: the fused step's largest gradient error against float64 within twice
    eager's largest, and each within `bound` ulps at its scale; the same parameters get gradients."""
    errors = {}
    for name, (fused, eager, exact) in step.grads.items():
        assert (fused is None) == (exact is None) == (eager is None), name
        if exact is not None and exact.abs().max() > 0:
            errors[name] = (errors_at_scale(fused, exact, precision), errors_at_scale(eager, exact, precision))
    worst_fused = max(errors.items(), key=lambda item: item[1][0])
    worst_eager = max(errors.items(), key=lambda item: item[1][1])
    assert worst_fused[1][0] <= 2 * worst_eager[1][1], (worst_fused, worst_eager)
    assert worst_fused[1][0] <= bound, worst_fused
    return worst_fused, worst_eager


def _assert_swiglu_near_misses(report, graphs=1):
    """The shared experts' SwiGLU (separate gate and up) is the only SwiGLU left, in each graph
    holding the forward; swiglu also anchors the routed experts' (clamped) and says who fuses it."""
    swiglu = near_miss_reasons(report, "swiglu")
    assert sum(SEPARATE_PROJECTIONS in r for r in swiglu) == SHARED_EXPERT_SWIGLUS * graphs, swiglu
    assert all(SEPARATE_PROJECTIONS in r or CLAMPED in r for r in swiglu), swiglu
    shared = near_miss_reasons(report, "swiglu_group")
    assert len(shared) == SHARED_EXPERT_SWIGLUS * graphs and all(r.startswith(SHARED_EXPERT) for r in shared), shared


# ---- inference ---------------------------------------------------------------------------------
def test_merging_fuses_the_shared_experts_clamped_swiglu():
    tiny = build_hf("deepseek_v4")
    backend = RecordingBackend(nff.FusionConfig())  # the routed experts fuse as a block (moe_dispatch)
    with torch.no_grad():
        torch.compile(tiny.model, backend=backend, fullgraph=True)(*tiny.example_inputs)
    forms = [s.form for s in backend.report.sites if s.pass_name == "swiglu_group"]
    assert forms.count("deepseek_v4_clamped_swiglu") == SHARED_EXPERT_SWIGLUS, forms
    assert not any(SEPARATE_PROJECTIONS in r for r in near_miss_reasons(backend.report, "swiglu"))


def test_inference_fuses_every_v4_site(inference_fp32):
    report = inference_fp32.report
    assert report.errors == [] and len(report.graphs) == 1
    _assert_site_table(report)
    for pass_name in (*COMPLETE, "moe_gating", "swiglu_group"):
        if pass_name != "swiglu_group":
            assert near_miss_reasons(report, pass_name) == [], pass_name
    _assert_swiglu_near_misses(report)
    fused = report.fused_ops
    # the CSA site's indexer, with the metadata ops of emulation's (950's) convention
    assert fused["cann_ops_transformer.lightning_indexer"] == 1
    assert fused["cann_ops_transformer.sparse_flash_mla"] == fused["cann_ops_transformer.sparse_flash_mla_metadata"] == 3
    assert fused["cann_ops_transformer.mhc_pre_sinkhorn"] == 6 and fused["npu.npu_mhc_post"] == 6
    assert fused["npu.npu_moe_gating_top_k"] == 3 and fused["cann_ops_nn.swiglu_group"] == 3
    # nothing of the unfused forms is left: no sink softmax, no Sinkhorn step, no rsqrt
    ops = report.graphs[0].ops_after
    assert ops["aten.rsqrt.default"] == 0 and ops["aten.topk.default"] == 0


def test_inference_logits_match_eager(inference_fp32):
    logits = inference_fp32.logits
    # measured (seed 0): fused 2.4e-7 from float64 at scale 0.71, 4.1 ulp; eager 2.1e-7, 3.6 ulp
    fused, _ = _assert_as_exact_as_eager(logits["fused"], logits["eager"], logits["exact"], torch.float32)
    assert fused <= 8


@pytest.mark.slow
def test_bf16_inference_fuses_every_v4_site_but_the_top_k_routers(inference_bf16):
    report = inference_bf16.report
    assert report.errors == []
    # the top-k routers: the op ranks fp32 scores, the model its bf16 ones (near ties would pick
    # other experts); the hash router ranks nothing and fuses
    _assert_site_table(report, unfused={"router": 2})
    routers = near_miss_reasons(report, "moe_gating")
    assert len(routers) == 2 and all(r.startswith(BF16_ROUTER) for r in routers), routers
    for pass_name in COMPLETE:
        assert near_miss_reasons(report, pass_name) == [], pass_name
    _assert_swiglu_near_misses(report)
    logits = inference_bf16.logits
    # measured (seed 0): fused 0.038 from float64 at scale 0.72, 9.7 bf16 ulp; eager 0.037, 9.4 (the
    # bf16 model's own rounding, through 3 layers); fused and eager 0.027 apart
    fused, _ = _assert_as_exact_as_eager(logits["fused"], logits["eager"], logits["exact"], torch.bfloat16)
    assert fused <= 16


@pytest.mark.slow
def test_seeds_whose_indexer_tied_at_four_heads_match_eager():
    # with 4 indexer heads seeds 8 and 10 tied at the k-th score and their logits differed by 0.022
    # (tiny_models._DEEPSEEK_V4); with 16 they match as seed 0 does
    step = _step(torch.float32, train=False, seed=8)
    assert step.report.counts["sparse_mla"] == 3
    logits = step.logits
    _assert_as_exact_as_eager(logits["fused"], logits["eager"], logits["exact"], torch.float32)


# ---- one training step --------------------------------------------------------------------------
def _assert_training_fusion(step):
    report = step.report
    assert report.errors == []
    # every router is refused in training (the package's backward differentiates sigmoid only),
    # the rest fuses with its backward op
    _assert_site_table(report, unfused={"router": 3})
    joint = [g for g in report.graphs if g.name == "joint"]
    assert len(joint) == 1
    joint_routers = [m.reason for r in joint[0].passes if r.pass_name == "moe_gating" for m in r.near_misses]
    assert joint_routers == [TRAINING_ROUTER] * 3, joint_routers
    # the partitioned forward, where they are looked at again, says the same
    routers = near_miss_reasons(report, "moe_gating")
    assert len(routers) == 6 and all(r.startswith(TRAINING_ROUTER) for r in routers), routers
    _assert_swiglu_near_misses(report, graphs=2)  # the joint graph and the partitioned forward
    for name in ("sparse_mla", "mhc_pre", "mhc_post", "lightning_indexer", "moe_dispatch", "grouped_matmul"):
        assert near_miss_reasons(report, name) == [], name
    # the CSA indexer's ropes and kv_norm compute no gradient (it selects): their forward forms fuse
    # them in the joint graph (accept._differentiated), with no near miss there (before, the joint
    # graph listed them as near misses and the partitioned forward then fused them)
    joint_sites = {r.pass_name: r.sites for r in joint[0].passes}
    for name, count in (("rope", 2), ("rms_norm", 1)):
        assert [m for m in report.near_misses if m.pass_name == name] == []
        indexer = [s for s in joint_sites[name] if ".compressor.indexer" in s.location.module]
        assert len(indexer) == count
    fused = report.fused_ops
    assert fused["cann_ops_transformer.sparse_flash_mla_grad"] == 3
    assert fused["cann_ops_transformer.mhc_pre_sinkhorn_backward"] == 6 and fused["npu.npu_mhc_post_backward"] == 6
    assert fused["cann_ops_nn.swiglu_group_backward"] == 3
    assert fused["cann_ops_transformer.inplace_partial_rotary_mul_backward"] == 11  # the indexer's 2: no gradient
    # no eager attention left behind for a gradient (tests/test_accept.py: the compressed kv's)
    from npu_fx_fusion.patterns.sparse_mla import _sink_softmax

    assert not any(_sink_softmax(n) for n in step.backend.graphs["forward"].graph.nodes)


@pytest.mark.slow
def test_a_training_step_fuses_every_v4_site_but_the_routers(training_fp32):
    _assert_training_fusion(training_fp32)


@pytest.mark.slow
def test_a_training_step_matches_eager(training_fp32):
    logits = training_fp32.logits
    _assert_as_exact_as_eager(logits["fused"], logits["eager"], logits["exact"], torch.float32)
    # measured (seed 0), ulps at each gradient's scale: the worst, fused and eager alike, is
    # layers.1.ffn_hc.scale, fused 127 from float64, eager 181 (the cancelling sum of the module
    # docstring; 307 apart); next layers.1.attn_hc.scale 84 / 26, hc_head.hc_scale 42 / 1.2 (a
    # sum at the end of the model, over the fused layers' outputs). The bound leaves 2x
    _assert_gradients(training_fp32, torch.float32, bound=256)


@pytest.mark.slow
def test_a_bf16_training_step_fuses_and_matches_eager(training_bf16):
    _assert_training_fusion(training_bf16)
    logits = training_bf16.logits
    fused, _ = _assert_as_exact_as_eager(logits["fused"], logits["eager"], logits["exact"], torch.bfloat16)
    assert fused <= 16  # measured 9.4 bf16 ulp at scale, as eager's
    # measured (seed 0): the worst fused and eager alike, layers.2.mlp.experts.down_proj, 128 / 131 bf16
    # ulp at scale from float64 (3 apart: bf16 gradients of bf16 weights); the largest fused-eager
    # gap 22 (hc_head.hc_base). The bound leaves 2x
    _assert_gradients(training_bf16, torch.bfloat16, bound=256)
