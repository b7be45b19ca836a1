"""rms_norm pass: every unfused form fires, wrong ones do not, numerics hold.

Tolerances: npu_rms_norm normalises and multiplies the weight in fp32 and rounds once
(op_semantics.md 2.1). The unfused HF code rounds once more before the weight multiply.
Each rounding is within 0.5 ulp, and the re-rounded product can land one ulp further:
fused and unfused agree within 2 ulp of the output dtype. In fp32 there is no extra
rounding, only the order of float operations: a few fp32 ulps (we allow 8).
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import assert_within_ulps, compile_and_run, near_miss_reasons

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULPS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}
ONLY_RMS = nff.FusionConfig(enable={"rms_norm"})


class Norm(torch.nn.Module):
    def __init__(self, dim=64, eps=1e-6, weight=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5) if weight else None
        self.eps = eps


class HFLlama(Norm):  # transformers LlamaRMSNorm
    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class WeightAfterCast(Norm):
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


class WeightBeforeCast(Norm):
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (h * self.weight).type_as(x)


class Functional(Norm):
    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class TorchModule(torch.nn.Module):
    def __init__(self, dim=64, eps=1e-5):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=eps)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.norm(x)


class DivideBySqrt(Norm):
    def forward(self, x):
        h = x.to(torch.float32)
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Gemma(Norm):  # transformers GemmaRMSNorm: weight stored as an offset from 1
    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class NoWeight(Norm):
    def __init__(self, dim=64, eps=1e-6):
        super().__init__(dim, eps, weight=False)

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class TimesReciprocalSqrt(Norm):
    # dynamo records 1 / t as reciprocal(t) * 1: canonical drops the noop multiply
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * (1 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return self.weight * h.to(x.dtype)


class TimesTwiceReciprocalSqrt(Norm):  # the look-alike: 2 / sqrt(v) is no noop
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * (2 / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return self.weight * h.to(x.dtype)


class SquareAsProduct(Norm):  # x * x for x ** 2 (the structural pattern ignores the int 2)
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class ImplicitUpcast(Norm):  # transformers CpmAntLayerNorm: the multiply's type promotion upcasts x
    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class MeanOfCubes(Norm):  # the look-alike: x ** 3 has pow's structure, not its exponent
    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(3).abs().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


FORMS = {
    "hf_llama": HFLlama, "times_reciprocal_sqrt": TimesReciprocalSqrt, "square_as_product": SquareAsProduct, "weight_after_cast": WeightAfterCast, "weight_before_cast": WeightBeforeCast,
    "torch_functional": Functional, "torch_module": TorchModule, "divide_by_sqrt": DivideBySqrt,
    "gemma": Gemma, "no_weight": NoWeight, "implicit_upcast": ImplicitUpcast,
}


def _inputs(dtype, shape=(2, 5, 64)):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=dtype) * 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_fuses_and_matches(form, dtype):
    module = FORMS[form]().to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_RMS)
    assert report.counts["rms_norm"] == 1, report.to_markdown()
    assert report.fused_ops == {"npu.npu_rms_norm": 1}
    leftover = report.graphs[0].ops_after
    assert leftover["aten.rsqrt.default"] == leftover["aten.sqrt.default"] == leftover["aten.mean.dim"] == 0
    assert report.near_misses == []
    assert_within_ulps(out, ref, ULPS[dtype])


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 3.7e-4, 0.1])
def test_eps_is_captured_not_baked_in(eps):
    module = HFLlama(eps=eps)
    x = _inputs(torch.float32) * 1e-2  # small activations make eps matter
    out, ref, report = compile_and_run(module, x, config=ONLY_RMS)
    assert report.counts["rms_norm"] == 1
    assert_within_ulps(out, ref, ULPS[torch.float32])


def test_qwen3_per_head_norm_on_4d_input():
    module = HFLlama(dim=16)
    out, ref, report = compile_and_run(module, _inputs(torch.bfloat16, (2, 5, 4, 16)).float(), config=ONLY_RMS)
    assert report.counts["rms_norm"] == 1
    assert_within_ulps(out, ref, ULPS[torch.float32])


# ---- negatives: must not fuse, and must say why --------------------------------------
class NonLastDim(Norm):
    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps)
        return self.weight * h


class MeanWithoutKeepdim(Norm):
    def forward(self, x):
        v = x.pow(2).mean(-1)
        return self.weight * (x * torch.rsqrt(v + self.eps).unsqueeze(-1))


class TensorEps(Norm):
    def __init__(self):
        super().__init__()
        self.register_buffer("eps_t", torch.tensor(1e-6))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps_t))


class SharedIntermediate(Norm):
    def forward(self, x):
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x * inv), inv  # the normaliser escapes


class TwoDimWeight(Norm):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(5, 64))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("module, reason", [
    (NonLastDim(dim=64), "last dim only"),
    (MeanWithoutKeepdim(), "without keepdim"),
    (TensorEps(), "eps is a tensor"),
    (SharedIntermediate(), "also used by"),
    (TimesTwiceReciprocalSqrt(), "matches none of the forms"),
], ids=["non_last_dim", "no_keepdim", "tensor_eps", "shared_intermediate", "twice_reciprocal_sqrt"])
def test_does_not_fuse_and_says_why(module, reason):
    if isinstance(module, NonLastDim):
        module.weight = torch.nn.Parameter(torch.rand(64))
    x = _inputs(torch.float32)
    out, ref, report = compile_and_run(module, x, config=ONLY_RMS)
    assert report.counts["rms_norm"] == 0
    assert "npu.npu_rms_norm" not in report.fused_ops
    reasons = near_miss_reasons(report, "rms_norm")
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert report.near_misses[0].location.line > 0  # points at the user's source line
    torch.testing.assert_close(out, ref)


def test_a_mean_of_cubes_is_not_a_norm():
    out, ref, report = compile_and_run(MeanOfCubes(), _inputs(torch.float32), config=ONLY_RMS)
    assert report.counts["rms_norm"] == 0 and "npu.npu_rms_norm" not in report.fused_ops
    torch.testing.assert_close(out, ref)


def test_weight_that_is_not_per_channel_is_not_folded_into_the_norm():
    # weight [5, 64] on x [2, 5, 64]: npu_rms_norm would treat it as gamma over 2 dims and
    # normalise over both. Only the weight-free norm inside may fuse.
    out, ref, report = compile_and_run(TwoDimWeight(), _inputs(torch.float32), config=ONLY_RMS)
    assert [s.form for s in report.sites] == ["no_weight"]
    torch.testing.assert_close(out, ref)


def test_fp32_weight_on_bf16_input_keeps_the_models_output_dtype():
    # HF with an fp32 weight promotes the output to fp32; npu_rms_norm returns bf16, so the
    # weight multiply must stay outside; the norm itself still fuses.
    module = HFLlama()  # fp32 weight
    x = _inputs(torch.bfloat16)
    out, ref, report = compile_and_run(module, x, config=ONLY_RMS)
    assert out.dtype == ref.dtype == torch.float32
    assert [s.form for s in report.sites] == ["no_weight"]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_soc_limits_are_honoured():
    # No bf16 npu_rms_norm on 310P: the bf16 forms are turned down, and only the fp32 core
    # (the norm of the upcast input, before the cast back and the weight) may fuse.
    module = HFLlama().to(torch.bfloat16)
    config = nff.FusionConfig(enable={"rms_norm"}, soc="Ascend310P")
    out, ref, report = compile_and_run(module, _inputs(torch.bfloat16), config=config)
    [site] = report.sites
    assert site.form == "no_weight"
    assert "npu.npu_rms_norm does not support bfloat16 on Ascend310P" in site.note
    graph_ops = report.graphs[0].ops_after
    assert graph_ops["aten._to_copy.default"] == 2  # upcast before, cast back after the fused op
    assert_within_ulps(out, ref, ULPS[torch.bfloat16])


def test_two_norms_in_one_graph_keep_their_own_eps():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = HFLlama(eps=1e-6), HFLlama(eps=0.5)

        def forward(self, x):
            return self.a(x) + self.b(x * 1e-2)

    out, ref, report = compile_and_run(Two(), _inputs(torch.float32), config=ONLY_RMS)
    assert report.counts["rms_norm"] == 2
    assert_within_ulps(out, ref, ULPS[torch.float32])


class NpuCastSpelling(Norm):
    """HF Llama as torch_npu's aot graphs spell it: casts are npu._npu_dtype_cast."""

    def forward(self, x):
        h = torch.ops.npu._npu_dtype_cast(x, torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * torch.ops.npu._npu_dtype_cast(h, x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_npu_dtype_cast_spelling_fuses_too(dtype):
    from npu_fx_fusion.npu_ops import ensure_registered

    ensure_registered()
    module = NpuCastSpelling().to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_RMS)
    assert [s.form for s in report.sites] == ["hf_llama"]
    assert report.graphs[0].ops_after["npu._npu_dtype_cast.default"] == 0
    assert_within_ulps(out, ref, ULPS[dtype])


# ---- dynamic=True: dynamo lifts a module's float eps into a graph input (lifted_floats.py) ---
def _rms_norm_eps(backend):
    gm = backend.graphs["inference"]  # the latest
    (call,) = [n for n in gm.graph.nodes if str(n.target) == "npu.npu_rms_norm.default"]
    return call.args[2] if len(call.args) > 2 else call.kwargs.get("epsilon", 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dynamic_shapes_fuse_with_the_modules_eps_and_recompile_when_it_changes(dtype):
    from helpers import RecordingBackend

    torch._dynamo.reset()
    module = HFLlama(eps=3.7e-4).to(dtype)
    backend = RecordingBackend(ONLY_RMS)
    compiled = torch.compile(module, backend=backend, dynamic=True)
    x = _inputs(dtype) * 1e-2  # small activations make eps matter
    with torch.no_grad():
        assert_within_ulps(compiled(x), module(x), ULPS[dtype])
        assert backend.report.counts["rms_norm"] == 1 and backend.report.near_misses == []
        assert _rms_norm_eps(backend) == 3.7e-4
        module.eps = 0.1  # the guard on the attribute recompiles: never the old constant
        assert_within_ulps(compiled(x), module(x), ULPS[dtype])
    assert len(backend.report.graphs) == 2 and _rms_norm_eps(backend) == 0.1


def test_a_float_argument_stays_a_runtime_input():
    # a float passed per call is what a dynamic compile is for: not specialised, so the
    # norm reads it at run time and is left unfused, with the reason
    from helpers import RecordingBackend

    def norm(x, w, eps):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    torch._dynamo.reset()
    backend = RecordingBackend(ONLY_RMS)
    compiled = torch.compile(norm, backend=backend, dynamic=True)
    x, w = _inputs(torch.float32) * 1e-2, torch.rand(64) + 0.5
    with torch.no_grad():
        for eps in (1e-6, 0.1):
            torch.testing.assert_close(compiled(x, w, eps), norm(x, w, eps))
    assert len(backend.report.graphs) == 1 and backend.report.counts["rms_norm"] == 0
    assert any("eps" in reason for reason in near_miss_reasons(backend.report, "rms_norm"))


class FunctionalNoWeight(Norm):  # F.rms_norm(x, shape, None): nn.RMSNorm(elementwise_affine=False)
    def __init__(self, dim=64, eps=3.7e-4):
        super().__init__(dim, eps, weight=False)

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:], None, self.eps)


@pytest.mark.parametrize("mark_dynamic", [None, (0, 1)], ids=["dynamic=True", "mark_dynamic(batch, seq)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_weightless_norm_trains_fused_under_dynamic_shapes(dtype, mark_dynamic):
    # the mean's backward divides by the count it averaged: `div.Tensor(g, 64)` in the joint
    # form's trace, `div.Scalar(g, s1)` with the normalised dim symbolic; canonical spells
    # both as div.Tensor (the fuzz's refused positive: an fp32 weightless F.rms_norm in
    # training under dynamic=True, "rsqrt is also used by mul_22"). Gradients within the
    # training tolerance of tests/test_training.py (npu_rms_norm_backward's closed form in
    # fp32 against autograd's op-by-op derivative: a few ulp at the gradient's scale).
    from helpers import RecordingBackend, assert_close_at_scale, npu_ops

    torch._dynamo.reset()
    module = FunctionalNoWeight()
    backend = RecordingBackend(ONLY_RMS)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True if mark_dynamic is None else None)
    x = _inputs(dtype, (2, 5, 64)).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    for dim in mark_dynamic or ():
        torch._dynamo.mark_dynamic(x, dim)
    out, ref = compiled(x), module(x_ref)
    probe = torch.randn(out.shape).to(dtype)
    (grad,), (grad_ref,) = torch.autograd.grad(out, x, probe), torch.autograd.grad(ref, x_ref, probe)
    assert npu_ops(backend.graphs["forward"]) == {"npu_rms_norm": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_rms_norm_backward": 1}
    assert near_miss_reasons(backend.report, "rms_norm") == []
    ulps = {torch.float32: 8, torch.bfloat16: 4}[dtype]
    assert_close_at_scale(out.detach(), ref.detach(), ulps)
    assert_close_at_scale(grad, grad_ref, ulps)


class SumOverCount(Norm):
    """The mean written as sum / n: n the dim's size as the code reads it (None), or a number."""

    def __init__(self, count=None):
        super().__init__(weight=False)
        self.count = count

    def forward(self, x):
        h = x.float()
        count = x.shape[-1] if self.count is None else self.count
        return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / count + self.eps)).to(x.dtype)


@pytest.mark.parametrize("count, dynamic, reason", [
    (None, "dynamic=True", None),  # / x.shape[-1]: the dim's own symbolic size
    (None, "mark_dynamic(batch, seq)", None),
    (64, "static", None),
    (64, "mark_dynamic(batch, seq)", None),  # the normalised dim stays static: 64 is its size
    # dynamic=True: the dim is s, the code divides by the 64 it was written for: the mean only
    # where s == 64, which nothing proves (the fuzz's 'sum / a literal n' gap, now a limit)
    (64, "dynamic=True", r"divides by 64 where the normalised dim is s\d+"),
    (32, "static", "divides by 32 where the normalised dim is 64"),  # the look-alike: not a mean
])
def test_a_mean_written_as_sum_over_n_fuses_where_n_is_provably_the_count(count, dynamic, reason):
    import re

    torch._dynamo.reset()
    module = SumOverCount(count)
    backend = nff.backend.EmulationBackend(ONLY_RMS)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True if dynamic == "dynamic=True" else None)
    with torch.no_grad():
        for batch, seq in ((2, 5), (3, 7)):
            x = _inputs(torch.float32, (batch, seq, 64))
            if dynamic.startswith("mark_dynamic"):
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(x, 1)
            assert_within_ulps(compiled(x), module(x), ULPS[torch.float32])
    reasons = near_miss_reasons(backend.report, "rms_norm")
    if reason is None:
        assert backend.report.counts["rms_norm"] >= 1 and reasons == []
    else:
        assert backend.report.counts["rms_norm"] == 0
        assert reasons and all(re.fullmatch(reason, r) for r in reasons), reasons


# ---- a half-precision norm written without the fp32 upcast ---------------------------------
class InInputDtype(Norm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class NoWeightInInputDtype(Norm):  # the fuzz's case 174: no weight, no upcast
    def __init__(self, dim=64, eps=1e-6):
        super().__init__(dim, eps, weight=False)

    def forward(self, x):
        return x * (self.eps + x.square().mean(-1, keepdim=True)).rsqrt()


@pytest.mark.parametrize("module_class", [InInputDtype, NoWeightInInputDtype], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_norm_without_upcast_fuses_and_rounds_once(dtype, module_class):
    # npu_rms_norm computes in fp32 and rounds once: within 1 ulp of the exact result
    # (0.5 but where fp32 error meets a rounding tie), where the code's chain rounds at
    # every step (up to ~3 ulp: measured 2.9 over random sizes and scales); the site's
    # note says so
    module = module_class(dim=256).to(dtype)
    x = _inputs(dtype, shape=(4, 16, 256))
    out, ref, report = compile_and_run(module, x, config=ONLY_RMS)
    assert report.fused_ops == {"npu.npu_rms_norm": 1}
    (site,) = report.sites
    assert "rounded once" in site.note and "3 ulp" in site.note
    exact = module.double()(x.double())
    assert_within_ulps(out, exact.to(dtype), 1)
    assert_within_ulps(out, ref, 3)
    if module_class is InInputDtype:  # the chain itself is further off (without the weight, one rounding less)
        with pytest.raises(AssertionError):
            assert_within_ulps(ref, exact.to(dtype), 1)


@pytest.mark.parametrize("module_class", [InInputDtype, NoWeightInInputDtype], ids=["weight", "no_weight"])
def test_keep_intermediate_rounding_leaves_it_unfused_and_says_why(module_class):
    module = module_class().to(torch.bfloat16)
    config = nff.FusionConfig(enable={"rms_norm"}, keep_intermediate_rounding=True)
    out, ref, report = compile_and_run(module, _inputs(torch.bfloat16), config=config)
    assert report.counts["rms_norm"] == 0
    (reason,) = near_miss_reasons(report, "rms_norm")
    assert "keep_intermediate_rounding" in reason
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # an fp32 norm computes what it fuses into: the switch does not touch it
    out, ref, report = compile_and_run(module_class(), _inputs(torch.float32), config=config)
    assert report.counts["rms_norm"] == 1


# ---- DeepSeek-V4's two norms -------------------------------------------------------------------
def test_deepseek_v4_norm_with_its_fp32_weight_fuses_in_fp32():
    # DeepseekV4RMSNorm keeps its weight fp32 and multiplies before the one cast back: the
    # fp32 core fuses between the model's casts, on every SoC (no mixed-gamma mode needed)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    module = DeepseekV4RMSNorm(64, eps=2.0**-10)
    with torch.no_grad():
        module.weight.normal_()
    x = _inputs(torch.bfloat16)
    out, ref, report = compile_and_run(module, x, config=nff.FusionConfig(enable={"rms_norm"}, soc="Ascend950"))
    assert report.counts["rms_norm"] == 1 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, form, ulps", [(torch.float32, "no_weight", 0), (torch.bfloat16, "rstd_in_input_dtype", 1)])
def test_deepseek_v4_unweighted_norm(dtype, form, ulps):
    # DeepseekV4UnweightedRMSNorm (q_b_norm's, the compressor's): x * rsqrt(..).to(x.dtype).
    # bf16: the model rounds the rstd to bf16, then the product; the op rounds once (1 ulp)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm

    module = DeepseekV4UnweightedRMSNorm(eps=2.0**-12)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_RMS)
    assert [s.form for s in report.sites] == [form]
    assert report.fused_ops == {"npu.npu_rms_norm": 1}
    assert_within_ulps(out, ref, ulps)


# ---- every spelling a form accepts anchors a near miss (found by tests/fuzz_cases.py) ----
class SumOverCountNoEps(Norm):
    def forward(self, x):  # sum / n for the mean, and no eps: not fused, and said why
        h = x.float()
        return self.weight * (h * torch.rsqrt((h * h).sum(-1, keepdim=True) / x.shape[-1])).to(x.dtype)


class PowNegHalfOverDim0(Norm):
    def forward(self, x):  # (v + eps) ** -0.5 over the wrong dim
        h = x.float()
        return self.weight * (h * (h.pow(2).mean(0, keepdim=True) + self.eps) ** -0.5).to(x.dtype)


@pytest.mark.parametrize("module, reason", [
    (SumOverCountNoEps, "no eps is added"),
    (PowNegHalfOverDim0, "normalises over dim"),
])
def test_other_spellings_leave_a_near_miss(module, reason):
    # before, a mean written as sum / n or a normaliser written as ** -0.5 was no anchor:
    # a site no form matched left no near miss at all
    _, _, report = compile_and_run(module(), _inputs(torch.float32), config=ONLY_RMS)
    assert report.counts["rms_norm"] == 0
    reasons = near_miss_reasons(report, "rms_norm")
    assert len(reasons) == 1 and reason in reasons[0], reasons
