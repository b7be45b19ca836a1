"""add_rms_norm pass: residual add + RMSNorm -> npu_add_rms_norm.

Tolerances: in bf16 the kernel normalises the fp32 sum before rounding it, the unfused
graph normalises the rounded sum (op_semantics.md 2.2): the normaliser differs by at most
0.5 ulp of bf16 relative, which moves y by at most one more ulp: 3 ulp in all with the
rounding-order difference of rms_norm. fp16 and fp32 follow the unfused order.
"""
import pytest
import torch

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, assert_within_ulps, compile_and_run, near_miss_reasons, npu_ops
from test_rms_norm import HFLlama

ULPS = {torch.float32: 8, torch.bfloat16: 3, torch.float16: 2}


class DecoderLike(torch.nn.Module):
    """Two residual blocks: norm(h) -> branch -> h = h + branch, as decoder layers do."""

    def __init__(self, dim=64, eps=1e-5):
        super().__init__()
        self.norms = torch.nn.ModuleList(HFLlama(dim, eps) for _ in range(3))
        self.branches = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))

    def forward(self, h):
        for norm, branch in zip(self.norms, self.branches):
            h = h + branch(norm(h))
        return self.norms[-1](h)


def _inputs(dtype, shape=(2, 5, 64)):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])  # 1e-6 is the schema default: traced without eps
def test_residual_adds_fuse_into_add_rms_norm(dtype, eps):
    module = DecoderLike(eps=eps).to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype))
    # 3 norms: the first has no residual add in front of it, the other two do.
    assert {p: n for p, n in report.counts.items() if n} == {"rms_norm": 3, "add_rms_norm": 2}
    assert report.fused_ops == {"npu.npu_rms_norm": 1, "npu.npu_add_rms_norm": 2}
    assert report.graphs[0].ops_after["aten.add.Tensor"] == 0
    assert_close_at_scale(out, ref, 2 * ULPS[dtype])  # through two linear layers


class OneBlock(torch.nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.norm = HFLlama(eps=eps)

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_one_block_numerics_per_element(dtype, eps):
    module = OneBlock(eps).to(dtype)
    (y, h), (y_ref, h_ref), report = compile_and_run(module, _inputs(dtype), _inputs(dtype).flip(0))
    assert report.fused_ops == {"npu.npu_add_rms_norm": 1}
    assert_within_ulps(y, y_ref, ULPS[dtype])
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the sum is rounded once either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemma_norms_whose_weight_the_graph_computes_fold_the_residual_add(dtype):
    # GemmaRMSNorm's weight is `1 + w`, computed in the graph after the residual add it
    # folds: the replacement must be placed where its weight exists (it once raised "used
    # before it has been defined", and the pass was reverted)
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")

    class GemmaLike(DecoderLike):
        def __init__(self):
            super().__init__()
            self.norms = torch.nn.ModuleList(gemma.GemmaRMSNorm(64) for _ in range(3))
            for norm in self.norms:
                torch.nn.init.normal_(norm.weight)

    module = GemmaLike().to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype))
    assert report.errors == []
    assert report.fused_ops == {"npu.npu_rms_norm": 1, "npu.npu_add_rms_norm": 2}
    assert_close_at_scale(out, ref, 2 * ULPS[dtype])


def test_needs_the_rms_norm_pass():
    # add_rms_norm folds adds into npu_rms_norm calls; with rms_norm off there are none.
    config = nff.FusionConfig(disable={"rms_norm"})
    _, _, report = compile_and_run(DecoderLike(), _inputs(torch.float32), config=config)
    assert report.counts["add_rms_norm"] == 0 and report.fused_ops == {}


class BiasAdd(torch.nn.Module):  # x + bias[D] broadcasts: x1 and x2 differ in shape
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(64))
        self.norm = HFLlama()

    def forward(self, x):
        return self.norm(x + self.bias)


class ScaledAdd(torch.nn.Module):  # x + 2 * r is not x + r
    def __init__(self):
        super().__init__()
        self.norm = HFLlama()

    def forward(self, x):
        return self.norm(torch.add(x, x.flip(0), alpha=2))


@pytest.mark.parametrize("module, reason", [
    (BiasAdd(), "needs x1 and x2 of one shape and dtype"),
    (ScaledAdd(), "alpha=2"),
], ids=["broadcast_bias", "alpha"])  # mixed dtypes fuse: test_a_half_output_added_to_an_fp32_residual...
def test_does_not_fuse_and_says_why(module, reason):
    out, ref, report = compile_and_run(module, _inputs(torch.float32))
    assert report.counts["rms_norm"] == 1 and report.counts["add_rms_norm"] == 0
    reasons = near_miss_reasons(report, "add_rms_norm")
    assert len(reasons) == 1 and reason in reasons[0], reasons
    torch.testing.assert_close(out, ref)


def test_bf16_not_fused_on_310p():
    config = nff.FusionConfig(soc="Ascend310P")
    out, ref, report = compile_and_run(DecoderLike().half(), _inputs(torch.float16), config=config)
    assert report.counts["add_rms_norm"] == 2  # fp16 is supported there
    module = DecoderLike().bfloat16()
    out, ref, report = compile_and_run(module, _inputs(torch.bfloat16), config=config)
    assert report.counts["add_rms_norm"] == 0


class WeightlessChain(torch.nn.Module):
    """Two residual adds each feeding a weightless RMSNorm (rms_norm's unit-weight form)."""

    def forward(self, x, residual):
        def norm(t):
            h = t.float()
            return (h / torch.sqrt(h.square().mean(-1, keepdim=True) + 1e-6)).to(t.dtype)

        h = x + residual
        h2 = h + norm(h) * 0.5
        return norm(h2), h2


def _compile_dynamic(module, *inputs, mark_dynamic=None):
    """(fused outputs, eager outputs, report): dynamic=True, or with `mark_dynamic` the
    dims it names of every input dynamic (the rest static)."""
    backend = nff.backend.EmulationBackend(nff.FusionConfig())
    if mark_dynamic is not None:
        for t in inputs:
            for dim in mark_dynamic:
                torch._dynamo.mark_dynamic(t, dim)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True if mark_dynamic is None else None)
    with torch.no_grad():
        return compiled(*inputs), module(*inputs), backend.report


@pytest.mark.parametrize("mark_dynamic", [None, (0, 1)], ids=["dynamic=True", "mark_dynamic(batch, seq)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_weightless_norm_under_dynamic_shapes_folds_the_add(dtype, mark_dynamic):
    # dynamic=True: the unit weight rms_norm gives a weightless norm is ones(h.shape[-1:]), a read
    # of the residual sum's symbolic size; read from the graph's inputs instead
    # (canonical.size_reads_from_inputs), it is no longer computed from the sum, which
    # npu_add_rms_norm computes itself. Before, every such site was a near miss (found by
    # tests/fuzz_cases.py; and before that, a cycle that reverted the pass).
    torch.manual_seed(0)
    x, residual = torch.randn(2, 3, 16).to(dtype), torch.randn(2, 3, 16).to(dtype)
    out, ref, report = _compile_dynamic(WeightlessChain(), x, residual, mark_dynamic=mark_dynamic)
    assert report.errors == []
    assert report.counts["rms_norm"] == 2 and report.counts["add_rms_norm"] == 2, report.to_markdown()
    assert near_miss_reasons(report, "add_rms_norm") == []
    for a, b in zip(out, ref):
        assert_close_at_scale(a, b, ULPS[dtype])


class WeightFromTheSum(torch.nn.Module):
    """A residual add feeding a norm whose weight is a row of the sum itself."""

    def forward(self, x, residual):
        h = x + residual
        weight = h[0, 0]
        hf = h.float()
        return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype), h


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic=True"])
def test_weight_computed_from_the_sum_is_refused_not_a_cycle(dynamic):
    # Fusing the sum would make npu_add_rms_norm its own input: the pass raised in the
    # topological sort and was reverted, losing every site (found by tests/fuzz_cases.py).
    # Now such a site is a near miss that says so.
    torch.manual_seed(0)
    x, residual = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    if dynamic:
        out, ref, report = _compile_dynamic(WeightFromTheSum(), x, residual)
    else:
        out, ref, report = compile_and_run(WeightFromTheSum(), x, residual)
    assert report.errors == []
    assert report.counts["rms_norm"] == 1 and report.counts["add_rms_norm"] == 0, report.to_markdown()
    reasons = near_miss_reasons(report, "add_rms_norm")
    assert len(reasons) == 1 and "computed from the residual sum" in reasons[0], reasons
    for a, b in zip(out, ref):
        assert_within_ulps(a, b, ULPS[torch.float32])


def test_weightless_norm_with_static_sizes_still_folds_the_add():
    torch.manual_seed(0)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    out, ref, report = compile_and_run(WeightlessChain(), x, residual)
    assert report.counts["add_rms_norm"] == 2, report.to_markdown()


class ResidualStream(torch.nn.Module):
    """A branch added to the stream, the sum normalised and carried on (a decoder layer)."""

    def __init__(self, dim=64):
        super().__init__()
        self.branch = torch.nn.Linear(dim, dim)
        self.norm = HFLlama(dim)

    def forward(self, x):
        h = x + self.branch(x)
        return self.norm(h) * 0.5 + h


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_forward_graph_folds_the_add_and_keeps_the_rstd_for_the_backward(dtype):
    # The forward graph saves the norm's rstd for npu_rms_norm_backward: the form that
    # returns it too fuses there. Gradients of x, the branch and the norm weight: within
    # test_training's UNIT_ULPS at scale (bf16: the fused rstd comes from the unrounded sum,
    # 0.5 ulp relative from the rounded one's, and the backward multiplies it in twice).
    from test_training import train_and_compare

    report, fw, bw = train_and_compare(ResidualStream, dtype)
    assert npu_ops(fw) == {"npu_add_rms_norm": 1}
    assert npu_ops(bw) == {"npu_rms_norm_backward": 1}
    assert report.fused_ops["npu.npu_add_rms_norm"] == 1
    assert near_miss_reasons(report, "add_rms_norm") == []


class FP32Residual(torch.nn.Module):
    """A residual stream kept in fp32, a half-precision sublayer output added to it (type
    promotion adds in fp32), transformers' RMSNorm after: vLLM's RMSNorm.forward_native(x,
    residual) with an fp32 residual once failed here with "needs x1, x2 one dtype"."""

    def __init__(self, dtype, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(64, dtype=dtype) + 0.5)
        self.eps = eps

    def forward(self, x, residual):
        h = x + residual
        hidden = h.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(x.dtype), h


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_output_added_to_an_fp32_residual_fuses_in_fp32(dtype):
    module = FP32Residual(dtype)
    (y, h), (y_ref, h_ref), report = compile_and_run(module, _inputs(dtype), _inputs(torch.float32).flip(0))
    assert report.fused_ops == {"npu.npu_add_rms_norm": 1}
    # promotion converts x exactly; the op adds and normalises in fp32 as the code does
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    assert not near_miss_reasons(report, "add_rms_norm")


def test_bf16_plus_fp16_adds_in_fp32_and_fuses_so():
    # two half dtypes that differ promote to fp32: the op takes both cast to fp32
    module = FP32Residual(torch.bfloat16)
    (y, h), (y_ref, h_ref), report = compile_and_run(module, _inputs(torch.bfloat16), _inputs(torch.float16))
    assert report.fused_ops.get("npu.npu_add_rms_norm") == 1
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)


class RouterReadout(torch.nn.Module):
    """DeepSeek's MoE input: the residual add + norm, read by the experts in the model's dtype
    and by a router that computes its logits in fp32 (`F.linear(x.float(), w.float())`)."""

    def __init__(self, dim=64):
        super().__init__()
        self.norm = HFLlama(dim)
        self.experts = torch.nn.Linear(dim, dim, bias=False)
        self.router = torch.nn.Parameter(torch.randn(8, dim))

    def forward(self, x, residual):
        y = self.norm(x + residual).view(-1, x.shape[-1])
        logits = torch.nn.functional.linear(y.type(torch.float32), self.router.type(torch.float32))
        return self.experts(y), logits


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_norm_also_read_in_fp32_writes_that_copy_in_the_same_kernel(dtype, dynamic):
    module = RouterReadout().to(dtype)
    x = _inputs(dtype)
    (out, logits), (out_ref, logits_ref), report = compile_and_run(module, x, x.flip(0), dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_add_rms_norm_cast": 1}
    assert report.graphs[0].ops_after["aten._to_copy.default"] <= 1  # the router weight's, if it is not fp32
    (result,) = [r for r in report.graphs[0].passes if r.pass_name == "add_rms_norm"]
    assert len(result.finished) == 1 and "writes y in fp32 too" in result.finished[0], result.finished
    # y as add_rms_norm computes it (ULPS), read by a matmul over 64 channels
    assert_close_at_scale(out, out_ref, 2 * ULPS[dtype])
    assert logits.dtype == torch.float32
    assert_close_at_scale(logits, logits_ref, 2 * ULPS[dtype], precision=dtype)


@pytest.mark.parametrize("config", [nff.FusionConfig(keep_intermediate_rounding=True),
                                    nff.FusionConfig(soc="Ascend310P")],
                         ids=["keep_intermediate_rounding", "310P"])
def test_the_fp32_readout_stays_a_cast_where_the_op_may_round_differently_or_is_missing(config):
    # keep_intermediate_rounding: whether the kernel's fp32 y is y rounded is inferred, not
    # documented; 310P: npu_add_rms_norm_cast is A2 / A3 only
    module = RouterReadout().to(torch.float16)
    x = _inputs(torch.float16)
    _, _, report = compile_and_run(module, x, x.flip(0), config=config)
    assert report.fused_ops == {"npu.npu_add_rms_norm": 1}


def test_an_fp32_norm_has_nothing_to_widen():
    module = RouterReadout()
    x = _inputs(torch.float32)
    (out, logits), (out_ref, logits_ref), report = compile_and_run(module, x, x.flip(0))
    assert report.fused_ops == {"npu.npu_add_rms_norm": 1}
    assert_close_at_scale(logits, logits_ref, 2 * ULPS[torch.float32])


# ---- an add and its norm split by a graph break (graph_breaks.py) ---------------------------
class BreakingBlocks(torch.nn.Module):
    """Decoder blocks with a graph break after the second norm (an MoE's .tolist() or a
    data-dependent op does this): each block's last residual add ends a compiled graph and the
    next block's first norm (or the final norm) starts another."""

    def __init__(self, dim=64, blocks=2):
        super().__init__()
        self.norms = torch.nn.ModuleList(HFLlama(dim, 1e-5) for _ in range(2 * blocks + 1))
        self.branches = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2 * blocks))
        # two projections of one input (as q / k / v): in inference merged_projections merges
        # them into a buffer the graph holds, which aot_autograd lifts before the graph's inputs
        self.gates = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(blocks))

    def block(self, h, i):
        normed = self.norms[2 * i](h)
        h = h + self.branches[2 * i](normed) * torch.sigmoid(self.gates[i](normed))
        normed = self.norms[2 * i + 1](h)  # its add is in this graph: add_rms_norm fuses it
        torch._dynamo.graph_break()
        return h + self.branches[2 * i + 1](normed)

    def forward(self, h):
        for i in range(len(self.branches) // 2):
            h = self.block(h, i)
        return self.norms[-1](h)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_an_add_and_its_norm_in_two_graphs_are_a_near_miss_seen_at_run_time(grad):
    module = BreakingBlocks()
    backend = nff.get_npu_backend(fusion_config=nff.FusionConfig(enable={"rms_norm", "add_rms_norm",
                                                                         "merged_projections"}))
    x = _inputs(torch.float32).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = torch.compile(module, backend=backend)(x)
        torch.testing.assert_close(out, module(x))
    report = nff.last_report()
    assert report.executed_counts["add_rms_norm"] == 2  # each block's add before its second norm
    assert report.counts.get("merged_projections", 0) == (0 if grad else 2)  # one per block
    misses = [m for m in report.near_misses if m.pass_name == "add_rms_norm"]
    # block 1's first norm reads block 0's last add; the final norm reads block 1's. Block 0's
    # first norm reads the model's input: no add there, no near miss
    assert sorted(m.observed for m in misses) == [1, 1], misses
    assert all("return h + self.branches[2 * i + 1](normed) ends one compiled graph" in m.reason
               and "a graph break between them" in m.reason for m in misses), misses


def test_the_run_time_watch_forgets_the_tensors_that_are_gone():
    from npu_fx_fusion import graph_breaks

    module = BreakingBlocks(blocks=1)
    compiled = torch.compile(module, backend=nff.get_npu_backend(fusion_config=nff.FusionConfig(
        enable={"rms_norm", "add_rms_norm"})))
    with torch.no_grad():
        for _ in range(300):
            compiled(_inputs(torch.float32))
    assert len(graph_breaks._ADD_AT) < 150  # one per run if the locations of tensors gone were kept
    assert [m.observed for m in nff.last_report().near_misses if m.pass_name == "add_rms_norm"] == [300]
