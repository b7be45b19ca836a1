"""mhc_pre on transformers' DeepseekV4HyperConnection.

Numerics: the fused ops compute the same fp32 formula as the module in another order (the
mixes as (x @ fn^T) * rsqrt(..) where transformers scales x first), so post and comb agree
to a few fp32 ulps at their scale, and collapsed (rounded once from fp32 in both) to one
ulp of its dtype; the 20-iteration Sinkhorn is contracting, it does not amplify rounding.
"""
import pytest
import torch

import npu_fx_fusion as nff
from helpers import KeepFloat64, RecordingBackend, assert_close_at_scale, compile_and_run, errors_at_scale, near_miss_reasons
from v4_modules import HyperConnection, fused_calls, train_and_compare

MHC = nff.FusionConfig(enable={"mhc_pre"})
ULPS = {torch.float32: 8, torch.bfloat16: 2}


def _streams(dtype=torch.float32, b=2, s=5, n=4, d=64):
    torch.manual_seed(1)
    return torch.randn(b, s, n, d).to(dtype)


def _check(out, ref):
    for got, want in zip(out, ref):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close_at_scale(got, want, ULPS[got.dtype] if got.dtype != torch.float32 else ULPS[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hyper_connection_fuses_into_one_op(dtype):
    module = HyperConnection()
    out, ref, report = compile_and_run(module, _streams(dtype), config=MHC)
    assert report.counts["mhc_pre"] == 1
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    _check(out, ref)
    # the kernel limits the tiny module misses are on the site, not hidden
    note = report.sites[0].note
    # in emulation each SoC family's C limit, naming the family (COT: 128-aligned on A2/A3, 4096
    # or 7168 on 950)
    assert "on an NPU: C = 64: on A2/A3 mhc_pre_sinkhorn takes C 128-aligned up to 100000" in note
    assert "on an NPU: C = 64: on Ascend950 mhc_pre_sinkhorn takes C in (4096, 7168)" in note
    assert dtype == torch.bfloat16 or "does not support float32" in note


def test_in_emulation_a_c_limit_is_noted_for_the_socs_it_binds_only():
    # C = 128 is A2/A3's (128-aligned) but not 950's
    module = HyperConnection(hidden_size=128)
    out, ref, report = compile_and_run(module, _streams(torch.bfloat16, d=128), config=MHC)
    assert report.counts["mhc_pre"] == 1
    note = report.sites[0].note
    assert note == "on an NPU: C = 128: on Ascend950 mhc_pre_sinkhorn takes C in (4096, 7168)", note
    _check(out, ref)


def test_soc_picks_the_op_pair_on_ascend950():
    # 950's mhc_pre_sinkhorn takes C in {4096, 7168} only: the torch_npu pair serves there
    module = HyperConnection()
    config = nff.FusionConfig(enable={"mhc_pre"}, soc="Ascend950")
    out, ref, report = compile_and_run(module, _streams(torch.bfloat16), config=config)
    assert report.fused_ops == {"npu.npu_mhc_pre": 1, "npu.npu_mhc_sinkhorn": 1}
    assert "instead of mhc_pre_sinkhorn: C = 64: on Ascend950 mhc_pre_sinkhorn takes C in (4096, 7168)" in \
        report.sites[0].note
    _check(out, ref)


def test_soc_refuses_what_neither_op_takes():
    # A2: the COT op wants C 128-aligned, the torch_npu ops are 950's
    config = nff.FusionConfig(enable={"mhc_pre"}, soc="Ascend910B")
    _, _, report = compile_and_run(HyperConnection(), _streams(torch.bfloat16), config=config)
    assert report.counts["mhc_pre"] == 0
    (reason,) = near_miss_reasons(report, "mhc_pre")
    assert reason == "C = 64: on Ascend910B mhc_pre_sinkhorn takes C 128-aligned up to 100000", reason
    _, _, report = compile_and_run(HyperConnection(hidden_size=128), _streams(torch.bfloat16, d=128), config=config)
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}


def test_another_iteration_count_is_identified_and_meets_the_ops_limits():
    """3 iterations is no form (they are registered for 20), but the module is identified on
    random inputs; in emulation the COT op's 20-only limit is a note, on an A2 SoC (where the
    torch_npu pair does not run) the near miss."""
    module = HyperConnection(hc_sinkhorn_iters=3)
    out, ref, report = compile_and_run(module, _streams(), config=MHC)
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    assert report.sites[0].form == "hyper-connection (identified on random inputs)"
    assert "on an NPU: 3 Sinkhorn iterations: mhc_pre_sinkhorn takes 20 only" in report.sites[0].note
    _check(out, ref)
    torch._dynamo.reset()
    config = nff.FusionConfig(enable={"mhc_pre"}, soc="Ascend910B")
    _, _, report = compile_and_run(module, _streams(torch.bfloat16), config=config)
    assert report.counts["mhc_pre"] == 0
    assert any("3 Sinkhorn iterations: mhc_pre_sinkhorn takes 20 only" in r for r in near_miss_reasons(report, "mhc_pre"))


def test_eps_values_are_captured_not_assumed():
    module = HyperConnection(rms_norm_eps=2.0**-10, hc_eps=2.0**-12)
    out, ref, report = compile_and_run(module, _streams(), config=MHC)
    assert report.counts["mhc_pre"] == 1
    _check(out, ref)


class TwoEpsHyperConnection(HyperConnection):
    """transformers' forward with the pre mapping's eps different from the Sinkhorn's: one
    captured hc_eps cannot be both, so the form does not match (never a fused op with one eps)."""

    def forward(self, streams):
        hc = self.hc
        n = hc.hc_mult
        b, s = streams.shape[:2]
        flat = hc.input_norm(streams.view(b, s, -1).float())
        flat = torch.nn.functional.linear(flat, hc.fn.float())
        pre_w, post_w, comb_w = flat.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
        pre_s, post_s, comb_s = hc.scale.unbind(0)
        comb_w, comb_b = comb_w.view(*comb_w.shape[:-1], n, n), comb_b.view(n, n)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + 2 * hc.hc_eps  # <- another eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w * comb_s + comb_b, dim=-1) + hc.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
        for _ in range(hc.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


def test_two_eps_values_are_a_near_miss():
    module = TwoEpsHyperConnection()
    out, ref, report = compile_and_run(module, _streams(), config=MHC)
    assert report.counts["mhc_pre"] == 0
    (reason,) = near_miss_reasons(report, "mhc_pre")
    # the form does not match, and random inputs tell the eps apart (an fp32 output, 4 ulp)
    assert "whose function is not the ops' on random inputs (output 2" in reason, reason
    _check(out, ref)


@pytest.mark.parametrize("soc, fused", [(None, "cann_ops_transformer.mhc_pre_sinkhorn"),
                                        ("Ascend950", "npu.npu_mhc_pre")])
def test_trains_through_the_fused_ops_and_their_backward(soc, fused):
    config = nff.FusionConfig(enable={"mhc_pre"}, soc=soc)
    dtype = torch.bfloat16 if soc else torch.float32
    # fp32: hc.scale's gradient is a cancelling sum over every token and mix (below), which the
    # fused backward and autograd round differently: measured 21 ulp at scale apart (engine v2, with
    # and without NPU dispatch), 24 allowed; most of it is eager's own error against float64
    backend = train_and_compare(HyperConnection(), [_streams(dtype)], config, {torch.float32: 24, torch.bfloat16: 4},
                                precision=None if dtype == torch.float32 else dtype)
    forward, backward = fused_calls(backend.graphs["forward"]), fused_calls(backend.graphs["backward"])
    if fused == "npu.npu_mhc_pre":
        assert forward == {"npu.npu_mhc_pre": 1, "npu.npu_mhc_sinkhorn": 1}
        assert backward == {"npu.npu_mhc_pre_backward": 1, "npu.npu_mhc_sinkhorn_backward": 1}
    else:
        assert forward == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
        assert backward == {"cann_ops_transformer.mhc_pre_sinkhorn_backward": 1}


def test_a_frozen_mhc_parameter_in_training_is_identified_and_trains_fused():
    # the joint form is traced with the streams, fn, base and scale all trainable only; the
    # region identified on random inputs trains through the fused op with fn frozen
    module = HyperConnection()
    module.hc.fn.requires_grad_(False)
    backend = train_and_compare(module, [_streams()], nff.FusionConfig(enable={"mhc_pre"}), {torch.float32: 24})
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    (result,) = [r for r in joint.passes if r.pass_name == "mhc_pre"]
    (site,) = result.sites
    assert site.form == "hyper-connection (identified on random inputs)"
    assert result.near_misses == []
    assert fused_calls(backend.graphs["backward"]) == {"cann_ops_transformer.mhc_pre_sinkhorn_backward": 1}


def test_the_scale_gradient_is_rounding_noise_the_size_of_eagers():
    """The gap between the fused and eager gradients of hc.scale is rounding, not a formula: each
    of its 3 numbers is a sum over every token and mix of dz * w whose terms cancel (sum |terms|
    6-100x |sum| in the tiny V4), so a few ulps in the terms are tens at the result. Against a
    float64 run (KeepFloat64: transformers' .float() casts kept float64) the stand-in backward run
    in float64 agrees to 1e-12 relative (the formula), and both fp32 steps are rounding noise of
    one size, which depends on the CPU's kernels: fused 6.2 and eager 19.1 ulp at scale off on one
    machine, fused 52 and eager 27 on another (the same sums in another order). A wrong formula
    would be off by the gradient itself: millions of ulps at scale."""
    import copy

    from npu_fx_fusion.patterns.mhc_pre import MhcPreSinkhorn

    module = HyperConnection()
    eager, exact = copy.deepcopy(module), copy.deepcopy(module).double()
    x = _streams()
    torch._dynamo.reset()
    backend = RecordingBackend(MHC)
    # the streams train too, as in V4 (the joint form has all four arguments trainable)
    outs = torch.compile(module, backend=backend, fullgraph=True)(x.clone().requires_grad_())
    assert backend.report.counts["mhc_pre"] == 1
    probes = [torch.randn(o.shape, generator=torch.Generator().manual_seed(5 + i)) for i, o in enumerate(outs)]
    with KeepFloat64():
        exact_outs = exact(x.double().requires_grad_())
    for results in (outs, eager(x.clone().requires_grad_()), exact_outs):
        sum((o * p.to(o.dtype)).sum() for o, p in zip(results, probes)).backward()
    fused_error = errors_at_scale(module.hc.scale.grad, exact.hc.scale.grad)
    eager_error = errors_at_scale(eager.hc.scale.grad, exact.hc.scale.grad)
    assert fused_error <= 4 * max(eager_error, 8), (fused_error, eager_error)
    # the stand-in's forward and backward in float64 (what the fused graph calls, in float64)
    hc = exact.hc
    scale = hc.scale.detach().clone().requires_grad_()
    hin, h_post, h_res = MhcPreSinkhorn.apply(x.double(), hc.fn.detach(), scale, hc.base.detach(), 4, 20, hc.hc_eps,
                                              hc.input_norm.eps)
    results = (h_post, h_res.view(exact_outs[1].shape), hin)
    sum((o * p.double()).sum() for o, p in zip(results, probes)).backward()
    torch.testing.assert_close(scale.grad, exact.hc.scale.grad, rtol=1e-12, atol=0)


# ---- other spellings, identified on random inputs --------------------------------------------
class HcPre(torch.nn.Module):
    """torchtitan-npu's HcPre + HcSplitSinkhorn (torchtitan_npu/models/deepseek_v4/model/model.py
    803-885): the mixes scaled by the rms after the projection, base sliced, scale indexed,
    the fp32 streams collapsed. `variant` changes one thing (the look-alikes below)."""

    def __init__(self, n=4, d=64, iterations=20, hc_eps=1e-6, norm_eps=1e-6, variant=None):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        width = (2 + n) * n
        self.fn = torch.nn.Parameter(torch.randn(width, n * d, generator=generator) * (n * d) ** -0.5)
        self.base = torch.nn.Parameter(torch.randn(width, generator=generator) * 0.1)
        self.scale = torch.nn.Parameter(torch.rand(3, generator=generator) + 0.5)
        self.n, self.iterations, self.hc_eps, self.norm_eps, self.variant = n, iterations, hc_eps, norm_eps, variant

    def forward(self, x):
        n, eps = self.n, self.hc_eps
        shape, dtype = x.size(), x.dtype
        x = x.flatten(2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = torch.nn.functional.linear(x, self.fn) * rsqrt
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        comb = comb.unflatten(-1, (n, n))
        pre = torch.sigmoid(pre * self.scale[0] + self.base[:n].unsqueeze(0).unsqueeze(0)) + eps
        post = (1 if self.variant == "one_sigmoid" else 2) * torch.sigmoid(
            post * self.scale[1] + self.base[n:2 * n].unsqueeze(0).unsqueeze(0))
        if self.variant == "clamped":
            post = post.clamp(max=1.5)
        comb = comb * self.scale[2] + self.base[2 * n:].view(n, n).unsqueeze(0).unsqueeze(0)
        comb = comb.softmax(-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        weights = post if self.variant == "post_collapse" else pre
        y = torch.sum(weights.unsqueeze(-1) * x.view(shape), dim=2)
        return y.to(dtype), post, comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchtitan_npus_hc_pre_is_identified_and_fuses(dtype):
    with torch.no_grad():
        out, ref, report = compile_and_run(HcPre(), _streams(dtype), config=MHC)
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    site = report.sites[0]
    assert site.form == "hyper-connection (identified on random inputs)"
    assert "identified on random inputs: max error" in site.note
    _check(out, ref)


def test_an_identified_hyper_connection_with_dynamic_shapes():
    with torch.no_grad():
        out, ref, report = compile_and_run(HcPre(), _streams(torch.bfloat16), config=MHC, dynamic=True)
        assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
        _check(out, ref)
        torch._dynamo.reset()
        out, ref, report = compile_and_run(HcPre(), _streams(torch.bfloat16, b=3, s=7), config=MHC, dynamic=True)
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    _check(out, ref)


def test_seven_iterations_fuse_the_torch_npu_pair_on_ascend950():
    config = nff.FusionConfig(enable={"mhc_pre"}, soc="Ascend950")
    with torch.no_grad():
        out, ref, report = compile_and_run(HcPre(iterations=7), _streams(torch.bfloat16), config=config)
    assert report.fused_ops == {"npu.npu_mhc_pre": 1, "npu.npu_mhc_sinkhorn": 1}
    _check(out, ref)


@pytest.mark.parametrize("variant, reason", [
    ("one_sigmoid", "whose function is not the ops' on random inputs (output 0"),
    ("post_collapse", "whose function is not the ops' on random inputs (output 2"),
    ("clamped", "computes aten.clamp.default (not only arithmetic, sigmoid, softmax, sums and views)"),
])
def test_look_alikes_are_not_identified(variant, reason):
    with torch.no_grad():
        out, ref, report = compile_and_run(HcPre(variant=variant), _streams(), config=MHC)
    assert report.counts["mhc_pre"] == 0
    (found,) = near_miss_reasons(report, "mhc_pre")
    assert reason in found, found
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_identified_spelling_trains_through_the_fused_op_and_its_backward(dtype):
    """In the joint graph, the backward of the identified region is what autograd made of it
    (regions.backward_region: its forward ops' seq_nrs, the Sinkhorn's own gradient sums with
    them): replaced with the region by one joint trace of the fused call, whose backward reads
    what its forward saves. Gradients within the tolerances of the form's training test."""
    backend = train_and_compare(HcPre(), [_streams(dtype)], MHC, {torch.float32: 24, torch.bfloat16: 4},
                                precision=None if dtype == torch.float32 else dtype)
    assert fused_calls(backend.graphs["forward"]) == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    assert fused_calls(backend.graphs["backward"]) == {"cann_ops_transformer.mhc_pre_sinkhorn_backward": 1}
    assert near_miss_reasons(backend.report, "mhc_pre") == []


def test_an_identified_spelling_trains_fused_with_dynamic_shapes_and_on_ascend950():
    backend = train_and_compare(HcPre(), [_streams(torch.bfloat16)], MHC, {torch.bfloat16: 4},
                                precision=torch.bfloat16, dynamic=True)
    assert fused_calls(backend.graphs["backward"]) == {"cann_ops_transformer.mhc_pre_sinkhorn_backward": 1}
    config = nff.FusionConfig(enable={"mhc_pre"}, soc="Ascend950")
    backend = train_and_compare(HcPre(iterations=7), [_streams(torch.bfloat16)], config, {torch.bfloat16: 4},
                                precision=torch.bfloat16)
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_mhc_pre_backward": 1,
                                                       "npu.npu_mhc_sinkhorn_backward": 1}


def test_an_identified_spelling_with_a_frozen_parameter_trains_fused():
    """fn frozen: the joint trace computes the gradients of the other three only (the form,
    traced with all four trainable, does not match this; the identified region does)."""
    module = HcPre()
    module.fn.requires_grad_(False)
    backend = train_and_compare(module, [_streams()], MHC, {torch.float32: 24})
    assert fused_calls(backend.graphs["backward"]) == {"cann_ops_transformer.mhc_pre_sinkhorn_backward": 1}


class HcPreCombDetached(HcPre):
    """comb used without a gradient (detached): the fused backward takes one for each output."""

    def forward(self, x):
        y, post, comb = super().forward(x)
        return y, post, comb.detach()


def test_an_output_without_a_gradient_in_training_is_a_near_miss_with_eagers_gradients():
    backend = train_and_compare(HcPreCombDetached(), [_streams()], MHC, {torch.float32: 8})
    assert fused_calls(backend.graphs["backward"]) == {}
    reasons = near_miss_reasons(backend.report, "mhc_pre")
    assert any("get no gradient" in r for r in reasons), reasons


def test_static_sizes_too_large_to_probe_are_a_near_miss_dynamic_ones_probe_a_few_tokens():
    """Identification runs the region on random inputs at compile time: static streams of more
    than PROBE_MAX_ELEMENTS are refused (saying so); with dynamic shapes the token count is
    probed at PROBE_TOKENS, whatever the size compiled for."""
    from npu_fx_fusion.patterns.mhc_pre import PROBE_MAX_ELEMENTS

    x = _streams(torch.bfloat16, b=1, s=PROBE_MAX_ELEMENTS // 256 + 1)  # n = 4 streams of 64
    with torch.no_grad():
        out, ref, report = compile_and_run(HcPre(), x, config=MHC)
        assert report.counts["mhc_pre"] == 0
        (reason,) = near_miss_reasons(report, "mhc_pre")
        assert "identifying it on random inputs of that size at compile time is refused" in reason, reason
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch._dynamo.reset()
        out, ref, report = compile_and_run(HcPre(), x, config=MHC, dynamic=True)
    assert report.fused_ops == {"cann_ops_transformer.mhc_pre_sinkhorn": 1}
    _check(out, ref)
