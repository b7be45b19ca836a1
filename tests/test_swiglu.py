"""swiglu pass: silu(gate) * up, gate and up the two halves of one tensor -> npu_swiglu.

Tolerances, measured on the CPU stand-in (npu_ops/activation.py) against eager:
- fp32: the stand-in computes F.silu(a) * b in fp32 exactly as the model does: 0 ulp
  measured. We allow 2 ulp for a kernel that evaluates silu in another order.
- bf16 / fp16: npu_swiglu computes silu(a) * b in fp32 and rounds once; the unfused code
  rounds silu(a) to the dtype, multiplies, and rounds again. The rounded silu is within
  u = 2^-8 (bf16) / 2^-11 (fp16) relative of the exact one, so the unfused product before
  its last rounding is within u * |p| < 1 ulp(p) of the exact product p; two reals less
  than 1 ulp apart round to values at most 1 ulp apart: fused and unfused agree within
  1 ulp of the output. Measured wherever silu(a) is a normal number: 1 ulp exactly (in
  ~25% of elements), over randn inputs at scales 1, 3 and 10 and over every finite
  bf16/fp16 gate value (with up at scales 1, 3 and 100).
  The argument needs silu(a) to be a normal number of the dtype. In fp16 silu(a) is
  subnormal for |a| < ~1.2e-4 and a < ~-12; rounded there it keeps only a few bits, and
  the unfused product then differs from the fused one by up to 18 (randn * 10) or 137
  (every fp16 gate, up ~ 100) ulp. The fused op is the accurate one there: it stays
  within 1 ulp of the exact fp64 result (test_fp16_subnormal_silu_...). The per-element
  tests therefore compare where silu(gate) is normal.
- After a down projection the per-element differences enter a matmul: compared on the
  scale of the output (helpers.assert_close_at_scale). Measured over 15 seeds: at most
  1 ulp at scale for one MLP and for the 2-layer stack; we allow 2 and 4.
"""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import (GuardRecordingBackend, assert_close_at_scale, assert_within_ulps, compile_and_run,
                     near_miss_reasons)
from npu_fx_fusion.backend import EmulationBackend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULPS = {torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}
AT_SCALE = {torch.float32: 2, torch.bfloat16: 2, torch.float16: 2}  # one down projection
ONLY_SWIGLU = nff.FusionConfig(enable={"swiglu"})
SWIGLU = "npu.npu_swiglu"
HIDDEN, FFN = 64, 128


# ---- the forms, as model code writes them: h is the gate_up projection's output ------------
def chunk(h):  # transformers MoE experts: gate, up = gate_up.chunk(2, -1)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def chunk_up_first(h):  # Phi-3 / GLM-4 MLP: up_states * self.activation_fn(gate)
    gate, up = h.chunk(2, dim=-1)
    return up * F.silu(gate)


def slice_(h):  # vLLM SiluAndMul
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def slice_up_first(h):
    d = h.shape[-1] // 2
    return h[..., d:] * F.silu(h[..., :d])


def split_sizes(h):
    d = h.shape[-1] // 2
    gate, up = torch.split(h, [d, d], dim=-1)
    return F.silu(gate) * up


def split_sizes_up_first(h):
    d = h.shape[-1] // 2
    gate, up = torch.split(h, [d, h.shape[-1] - d], dim=-1)
    return up * F.silu(gate)


def split_int(h):  # split by one size traces like chunk: aten.split.Tensor
    gate, up = torch.split(h, h.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def nn_silu_module(h, act=torch.nn.SiLU()):  # ACT2FN["silu"] is an nn.SiLU
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


# test form -> the pass's form that must be the one reported: in inference every way of
# halving (chunk, split, slices) and either operand order is one pattern to the engine
# (canonical.py, spellings.py), that of the first form
FORMS = {
    "chunk": (chunk, "chunked"),
    "chunk_up_first": (chunk_up_first, "chunked"),
    "slice": (slice_, "chunked"),
    "slice_up_first": (slice_up_first, "chunked"),
    "split_sizes": (split_sizes, "chunked"),
    "split_sizes_up_first": (split_sizes_up_first, "chunked"),
    "split_int": (split_int, "chunked"),
    "nn_silu": (nn_silu_module, "chunked"),
}
SHAPES = {"2d": (10, HIDDEN), "3d": (2, 5, HIDDEN)}


class Glu(torch.nn.Module):
    """The activation alone, on a given gate_up tensor: the fused op's output itself."""

    def __init__(self, glu):
        super().__init__()
        self.glu = glu

    def forward(self, h):
        return self.glu(h)


class MLP(torch.nn.Module):
    """gate_up projection -> glu -> down projection, as real MLPs."""

    def __init__(self, glu=chunk, hidden=HIDDEN, ffn=FFN):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)
        self.glu = glu

    def forward(self, x):
        return self.down_proj(self.glu(self.gate_up_proj(x)))


class Stack(torch.nn.Module):
    def __init__(self, glu=chunk, layers=2):
        super().__init__()
        self.mlps = torch.nn.ModuleList(MLP(glu) for _ in range(layers))

    def forward(self, x):
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


def _inputs(dtype, shape=(2, 5, HIDDEN), scale=1.0, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(*shape) * scale).to(dtype)


def _assert_fused(report, forms):
    assert report.counts["swiglu"] == len(forms), report.to_markdown()
    assert [s.form for s in report.sites] == forms
    assert report.fused_ops == {SWIGLU: len(forms)}
    assert report.graphs[0].ops_after["aten.silu.default"] == 0
    assert near_miss_reasons(report, "swiglu") == []


def _silu_is_normal(h, dtype):
    """Where silu(gate) is a normal number of `dtype` (see the module docstring)."""
    gate = h.float().chunk(2, -1)[0]
    return F.silu(gate).abs() >= torch.finfo(dtype).tiny


# ---- 1. every form fires ------------------------------------------------------------------
@pytest.mark.parametrize("rank", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_fuses_in_an_mlp(form, dtype, rank):
    glu, pass_form = FORMS[form]
    module = MLP(glu).to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype, SHAPES[rank]), config=ONLY_SWIGLU)
    _assert_fused(report, [pass_form])
    # the projections stay as they are: mm on the CPU trace, aten.matmul as an NPU compile
    # holds a bias-free Linear (npu_dispatch.py, the default)
    ops = report.graphs[0].ops_after
    assert ops["aten.mm.default"] + ops["aten.matmul.default"] == 2
    assert_close_at_scale(out, ref, AT_SCALE[dtype])


@pytest.mark.parametrize("rank", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_per_element(form, dtype, rank):
    glu, pass_form = FORMS[form]
    h = _inputs(dtype, (*SHAPES[rank][:-1], 2 * FFN), scale=3.0)
    out, ref, report = compile_and_run(Glu(glu), h, config=ONLY_SWIGLU)
    _assert_fused(report, [pass_form])
    assert out.shape == (*SHAPES[rank][:-1], FFN)
    normal = _silu_is_normal(h, dtype)
    assert normal.float().mean() > 0.99  # the comparison covers nearly every element
    assert_within_ulps(out[normal], ref[normal], ULPS[dtype])


def test_fp16_subnormal_silu_the_fused_op_is_the_accurate_one():
    # gate in [-17, -13]: silu(gate) ~ -1e-5 .. -3e-6 is subnormal in fp16 (< 6.1e-5), the
    # unfused code keeps a few bits of it and multiplies by up ~ 40: many ulps off. The
    # fused op keeps silu in fp32 and rounds the product once.
    torch.manual_seed(0)
    gate = torch.empty(4, 64).uniform_(-17, -13)
    up = torch.empty(4, 64).uniform_(30, 50)
    h = torch.cat((gate, up), -1).half()
    out, ref, report = compile_and_run(Glu(chunk), h, config=ONLY_SWIGLU)
    assert report.fused_ops == {SWIGLU: 1}
    g, u = h.double().chunk(2, -1)
    exact = (F.silu(g) * u).half()
    assert_within_ulps(out, exact, 1)
    with pytest.raises(AssertionError):  # the unfused fp16 code is not (why the tests mask)
        assert_within_ulps(ref, exact, 4)


def test_fp32_matches_eager_bitwise_on_the_stand_in():
    # The stand-in is the documented reference: silu(a) * b in fp32, nothing else.
    out, ref, report = compile_and_run(Glu(chunk_up_first), _inputs(torch.float32, (2, 5, 256), 3.0),
                                       config=ONLY_SWIGLU)
    assert report.fused_ops == {SWIGLU: 1}
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ---- 2. what must not fuse, and why ---------------------------------------------------------
class SeparateProjections(torch.nn.Module):  # HF Llama / Qwen MLP, torchtitan FeedForward
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def second_half_activated(h):  # gate_up concatenated [up, gate]: npu_swiglu would be wrong
    x1, x2 = h.chunk(2, dim=-1)
    return F.silu(x2) * x1


def second_half_sliced(h):
    d = h.shape[-1] // 2
    return h[..., :d] * F.silu(h[..., d:])


class SiluAlsoReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        act = F.silu(gate)
        return act * up, act  # the activation escapes: npu_swiglu does not produce it


class UpAlsoUsed(torch.nn.Module):
    def forward(self, h):
        gate, up = h.chunk(2, -1)
        return F.silu(gate) * up + up.sum(-1, keepdim=True)  # the `up` half escapes too


def odd_gate_up(h):  # [..., 1] * [..., 2] broadcasts: a 3-wide gate_up cannot be halved
    gate, up = torch.split(h, [1, 2], dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("module, width, reason", [
    (SeparateProjections(), HIDDEN, "gate and up come from separate projections"),
    (Glu(second_half_activated), 2 * FFN, "silu is applied to the second half"),
    (Glu(second_half_sliced), 2 * FFN, "silu is applied to the second half"),
    (SiluAlsoReturned(), HIDDEN, "is also used by"),
    (UpAlsoUsed(), 2 * FFN, "is also used by"),
    (Glu(odd_gate_up), 3, "the gate_up dim 3 is odd"),
], ids=["separate_projections", "second_half_chunk", "second_half_slice", "silu_also_returned",
        "up_also_used", "odd_gate_up"])
def test_does_not_fuse_and_says_why(module, width, reason):
    out, ref, report = compile_and_run(module, _inputs(torch.float32, (2, 5, width)), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    assert SWIGLU not in report.fused_ops
    assert report.graphs[0].ops_after["aten.silu.default"] == 1  # the model's own code stays
    reasons = near_miss_reasons(report, "swiglu")
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert report.near_misses[0].location.line > 0  # points at the user's source line
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def geglu(h):
    gate, up = h.chunk(2, -1)
    return F.gelu(gate) * up


def geglu_tanh(h):
    gate, up = h.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


def reglu(h):
    gate, up = h.chunk(2, -1)
    return F.relu(gate) * up


def sigmoid_glu(h):  # F.glu's arithmetic, the other way round: not silu either
    gate, up = h.chunk(2, -1)
    return torch.sigmoid(gate) * up


@pytest.mark.parametrize("glu", [geglu, geglu_tanh, reglu, sigmoid_glu], ids=lambda f: f.__name__)
def test_other_gates_are_not_swiglu_candidates(glu):
    # Not SwiGLU: nothing fused, and not even a near miss (no silu anchors the site).
    out, ref, report = compile_and_run(MLP(glu), _inputs(torch.float32), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0 and report.fused_ops == {}
    assert near_miss_reasons(report, "swiglu") == []
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def halves_along_dim_1(h):  # gate and up stacked along the sequence, not the features
    gate, up = h.chunk(2, dim=1)
    return F.silu(gate) * up


def halves_along_dim_0(h):
    gate, up = h.chunk(2, dim=0)
    return F.silu(gate) * up


@pytest.mark.parametrize("glu, shape", [(halves_along_dim_1, (2, 6, HIDDEN)), (halves_along_dim_0, (6, HIDDEN))],
                         ids=["3d_dim1", "2d_dim0"])
def test_halves_along_another_dim_are_not_fused(glu, shape):
    # npu_swiglu takes a dim, but the pass only emits dim=-1: the forms are traced with
    # the halves on the last dim and the matcher re-checks the split dim on the real
    # shapes. Halves along another dim do not fuse (a near miss matching no form), and
    # the graph computes what eager does.
    out, ref, report = compile_and_run(Glu(glu), _inputs(torch.float32, shape), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0 and report.fused_ops == {}
    reasons = near_miss_reasons(report, "swiglu")
    assert len(reasons) == 1 and "matches none of the forms" in reasons[0], reasons
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_training_graph_fuses_forward_and_backward():
    # A forward-only rewrite cannot fuse a training step's forward (it saves the halves
    # and the silu for the backward); the joint graph, before partitioning, fuses both
    # halves (docs/training.md; gradients are checked in tests/test_training.py).
    module = MLP()
    x = _inputs(torch.float32).requires_grad_()
    out, ref, report = compile_and_run(module, x, config=ONLY_SWIGLU, grad=True)
    out.sum().backward()
    assert [g.name for g in report.graphs] == ["joint", "forward", "backward"]
    assert report.counts["swiglu"] == 1
    assert report.fused_ops == {"npu.npu_swiglu": 1, "npu.npu_swiglu_backward": 1}
    assert near_miss_reasons(report, "swiglu") == []
    torch.testing.assert_close(out, ref)


# ---- 3. a stack of MLPs ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["chunk", "chunk_up_first", "slice"])
def test_two_layer_mlp_stack(form, dtype):
    glu, pass_form = FORMS[form]
    module = Stack(glu).to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_SWIGLU)
    _assert_fused(report, [pass_form] * 2)
    assert_close_at_scale(out, ref, 2 * AT_SCALE[dtype])  # two down projections


def test_dynamic_token_count():
    # One graph, symbolic in the number of tokens, fuses and serves every length.
    module = MLP()
    backend = EmulationBackend(ONLY_SWIGLU)
    compiled = torch.compile(module, backend=backend)
    with torch.no_grad():
        for tokens in (7, 3, 11):
            x = _inputs(torch.float32, (tokens, HIDDEN), seed=tokens)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), module(x))
    assert len(backend.report.graphs) == 1
    assert backend.report.fused_ops == {SWIGLU: 1}


class GluOfAnInput(torch.nn.Module):
    """The activation of a gate_up tensor passed in, so that dynamic=True makes its width s
    symbolic: halves by chunk (split at (s + 1) // 2), optionally after torch._check that s
    is even (a guard the compiled graph has before any pass runs), by split at s // 2, or
    by narrow at a literal half (the half of one width only)."""

    def __init__(self, halves):
        super().__init__()
        self.halves = halves

    def forward(self, h):
        if self.halves == "chunk_checked_even":
            torch._check(h.shape[-1] % 2 == 0)
        if self.halves.startswith("chunk"):
            gate, up = h.chunk(2, dim=-1)
        elif self.halves == "split_at_half":
            gate, up = h.split(h.shape[-1] // 2, dim=-1)
        else:
            gate, up = h.narrow(-1, 0, FFN), h.narrow(-1, FFN, FFN)
        return F.silu(gate) * up


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("halves, dynamic, fuses", [
    ("chunk_checked_even", "dynamic=True", True), ("split_at_half", "dynamic=True", True),
    ("chunk", "dynamic=True", False), ("narrow", "dynamic=True", False),
    # the token count dynamic, the width static (as a projection makes it): all fuse
    ("chunk", "mark_dynamic(tokens)", True), ("narrow", "mark_dynamic(tokens)", True)])
def test_halves_of_a_symbolic_width_fuse_only_where_they_are_provably_the_halves(halves, dynamic, fuses, training):
    # npu_swiglu takes x[..., :s // 2] and x[..., s // 2:]; chunk's (s + 1) // 2 is that only
    # for an even s, narrow's literal FFN only for s == 2 * FFN. The pass proves it from what
    # the graph knows (nodes.known_equal), with no guard of its own: unproven, a near miss
    module = GluOfAnInput(halves)
    backend = GuardRecordingBackend(ONLY_SWIGLU)
    compiled = torch.compile(module, backend=backend, fullgraph=True,
                             dynamic=True if dynamic == "dynamic=True" else None)
    with torch.set_grad_enabled(training):
        for tokens in (3, 7):
            h = _inputs(torch.float32, (tokens, 2 * FFN), seed=tokens).requires_grad_(training)
            if dynamic != "dynamic=True":
                torch._dynamo.mark_dynamic(h, 0)
            out, ref = compiled(h), module(h)
            assert_within_ulps(out.detach(), ref.detach(), ULPS[torch.float32])
            if training:
                # npu_swiglu_backward's gate gradient g * up * s * (1 + a * (1 - s)) is five
                # roundings in another order than autograd's silu_backward: a few ulp apart,
                # compared at the gradient's scale (elements near 0 have far smaller ulps)
                (got,), (want,) = torch.autograd.grad(out.sum(), h), torch.autograd.grad(ref.sum(), h)
                assert_close_at_scale(got, want, 4)
    report = backend.report
    assert report.counts["swiglu"] == (1 if fuses else 0), report.to_markdown()
    if halves != "split_at_half":  # (a split at s // 2 is the op's halves at any s: an odd s is
        # the op's limit, which the check guards on, docs/adding-a-pattern.md step 4)
        assert not any("Mod" in str(guard) for guard in backend.added_guards), backend.added_guards
    if not fuses:
        reasons = near_miss_reasons(report, "swiglu")
        assert reasons and all("is split at" in r and "not provably its half" in r for r in reasons), reasons


# ---- 4. SoC limits --------------------------------------------------------------------------
def test_not_fused_on_310p():
    config = nff.FusionConfig(enable={"swiglu"}, soc="Ascend310P")
    out, ref, report = compile_and_run(MLP().half(), _inputs(torch.float16), config=config)
    assert report.counts["swiglu"] == 0 and report.fused_ops == {}
    assert near_miss_reasons(report, "swiglu") == ["npu.npu_swiglu is not available on Ascend310P"]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("soc", ["Ascend910B", "Ascend910_93", "Ascend950"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_on_the_other_socs(soc, dtype):
    config = nff.FusionConfig(enable={"swiglu"}, soc=soc)
    _, _, report = compile_and_run(MLP().to(dtype), _inputs(dtype), config=config)
    _assert_fused(report, ["chunked"])


# ---- 5. third-party model code ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transformers_phi3_mlp(dtype):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    config = Phi3Config(hidden_size=HIDDEN, intermediate_size=FFN, hidden_act="silu")
    torch.manual_seed(0)
    module = Phi3MLP(config).to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_SWIGLU)
    _assert_fused(report, ["chunked"])
    [site] = report.sites
    assert site.location.file.endswith("modeling_phi3.py")
    # the site is at the line its fused output replaces (its anchor too): silu(gate) * up
    assert site.location.code == "up_states = up_states * self.activation_fn(gate)", site.location
    assert_close_at_scale(out, ref, AT_SCALE[dtype])


# ---- 6. the report --------------------------------------------------------------------------
def _line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_report_names_the_fused_site_and_its_source_line():
    _, _, report = compile_and_run(MLP(chunk), _inputs(torch.float32), config=ONLY_SWIGLU)
    markdown = report.to_markdown()
    assert "| swiglu | 1 |" in markdown
    assert "Fused ops in the final graphs: npu.npu_swiglu x1" in markdown
    site_lines = [line for line in markdown.splitlines() if "fused `chunked` -> npu.npu_swiglu at" in line]
    assert len(site_lines) == 1, markdown
    lines = {_line_of(chunk, "h.chunk(2"), _line_of(chunk, "F.silu(gate) * up")}  # the halves or the product
    assert any(f"test_swiglu.py:{n}:" in site_lines[0] for n in lines), site_lines
    assert "| aten.silu.default | 1 | 0 |" in markdown


def test_report_names_the_near_miss_and_its_source_line():
    _, _, report = compile_and_run(SeparateProjections(), _inputs(torch.float32), config=ONLY_SWIGLU)
    markdown = report.to_markdown()
    line = _line_of(SeparateProjections.forward, "F.silu(self.gate_proj(x))")
    misses = [m for m in markdown.splitlines() if m.lstrip().startswith("- near miss: gate and up come")]
    assert len(misses) == 1 and f"test_swiglu.py:{line}:" in misses[0], markdown


# ---- edge cases (each was a bug when these tests were written) --------------------------------
class CapturingBackend(EmulationBackend):
    """The emulation backend, keeping the fused graph to look at its nodes."""

    def _compile(self, phase, gm, example_inputs):
        self.gm = gm
        return super()._compile(phase, gm, example_inputs)


class TransposedGateUp(torch.nn.Module):  # (batch, seq) -> (seq, batch): not contiguous
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).transpose(0, 1).chunk(2, -1)
        return F.silu(gate) * up


def test_non_contiguous_gate_up_is_made_contiguous_or_not_fused():
    backend = CapturingBackend(ONLY_SWIGLU)
    module = TransposedGateUp()
    x = _inputs(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=backend)(x), module(x))
    calls = [n for n in backend.gm.graph.nodes if n.target is torch.ops.npu.npu_swiglu.default]
    assert all(n.args[0].meta["val"].is_contiguous() for n in calls), \
        [n.args[0].meta["val"].stride() for n in calls]


def test_empty_input_is_not_fused():
    out, ref, report = compile_and_run(MLP(), torch.empty(0, HIDDEN), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    (reason,) = near_miss_reasons(report, "swiglu")
    assert "is or may be empty" in reason, reason


class MLPOverSelectedRows(MLP):
    """The rows a mask selects (a data-dependent count, as an MoE's per-expert tokens: jetmoe)."""

    def forward(self, x):
        return super().forward(x[x[..., 0] > 0])


def test_rows_that_may_be_none_are_a_near_miss_not_a_pass_error():
    # asking whether a data-dependent count is 0 raised GuardOnDataDependentSymNode, and the
    # whole pass was reverted
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out, ref, report = compile_and_run(MLPOverSelectedRows(), _inputs(torch.float32), config=ONLY_SWIGLU)
    assert report.errors == [] and report.counts["swiglu"] == 0
    (reason,) = near_miss_reasons(report, "swiglu")
    assert "is or may be empty" in reason, reason
    torch.testing.assert_close(out, ref)


class ScaledSilu(torch.nn.Module):
    def forward(self, x):
        return F.silu(x) * 2.0


def test_silu_times_a_scalar_is_not_a_candidate():
    out, ref, report = compile_and_run(ScaledSilu(), _inputs(torch.float32), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    assert near_miss_reasons(report, "swiglu") == []  # it gates nothing: not even a near miss
    torch.testing.assert_close(out, ref)


class SelfGated(torch.nn.Module):
    def forward(self, x):
        return F.silu(x) * x


def test_silu_times_its_own_input_is_not_called_separate_projections():
    out, ref, report = compile_and_run(SelfGated(), _inputs(torch.float32), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    (reason,) = near_miss_reasons(report, "swiglu")
    assert reason == "the silu and the tensor it multiplies are not the two halves of one tensor"


# ---- silu written out: g * sigmoid(g) (spellings.py), found by the fuzz (tests/fuzz_cases.py) --
def gate_times_sigmoid(h):
    gate, up = h.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def up_times_sigmoid_gate(h):
    d = h.shape[-1] // 2
    gate, up = h[..., :d], h[..., d:]
    return up * (torch.sigmoid(gate) * gate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("glu", [gate_times_sigmoid, up_times_sigmoid_gate], ids=lambda f: f.__name__)
def test_silu_spelled_as_gate_times_sigmoid_fuses(glu, dtype):
    # The gate is read twice (by the sigmoid and the product) where silu reads it once: the
    # respelling counts that extra user (before, every such spelling was a silent miss).
    # Tolerance: the unfused code rounds sigmoid(g), g * sigmoid(g) and the product, one
    # rounding more than F.silu's: within 2 ulp of the fused op's one rounding at scale.
    h = _inputs(dtype, (3, 2 * FFN), scale=3.0)
    out, ref, report = compile_and_run(Glu(glu), h, config=ONLY_SWIGLU)
    _assert_fused(report, ["chunked"])
    assert report.graphs[0].ops_after["aten.sigmoid.default"] == 0
    assert_close_at_scale(out, ref, AT_SCALE[dtype])


def test_sigmoid_of_the_gate_times_another_tensor_is_not_silu():
    # g * sigmoid(u) * u: the sigmoid is not of the tensor it multiplies
    def lookalike(h):
        gate, up = h.chunk(2, dim=-1)
        return gate * torch.sigmoid(up) * up

    _, _, report = compile_and_run(Glu(lookalike), _inputs(torch.float32, (3, 2 * FFN)), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0


def test_gate_times_sigmoid_on_the_second_half_says_why():
    # the written-out silu anchors a near miss like silu itself (found by tests/fuzz_cases.py)
    def second_half(h):
        gate, up = h.chunk(2, dim=-1)
        return gate * (up * torch.sigmoid(up))

    _, _, report = compile_and_run(Glu(second_half), _inputs(torch.float32, (3, 2 * FFN)), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    assert near_miss_reasons(report, "swiglu") == ["silu is applied to the second half: npu_swiglu activates the first half"]


# ---- halves taken any other way: recognised by the channel algebra ---------------------------
def unbind_of_pairs(h):  # the halves as an unbind of a (2, ffn) view
    gate, up = h.view(*h.shape[:-1], 2, -1).unbind(-2)
    return F.silu(gate) * up


def zero_offset(h):  # GPT-OSS-style `(up + offset)`, with the offset a literal 0
    gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
    return F.silu(gate) * (up + 0.0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("glu", [unbind_of_pairs, zero_offset], ids=lambda f: f.__name__)
def test_halves_taken_any_other_way_are_recognised(glu, dtype, dynamic):
    module = MLP(glu).to(dtype)
    x = _inputs(dtype)
    backend = EmulationBackend(ONLY_SWIGLU)
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(x)
        ref = module(x)
    report = backend.report
    assert report.counts["swiglu"] == 1 and report.fused_ops == {SWIGLU: 1}
    assert report.sites[0].form == "silu-gated halves (channel algebra)"
    assert near_miss_reasons(report, "swiglu") == []
    assert_close_at_scale(out, ref, AT_SCALE[dtype])


def offset_one(h):  # GPT-OSS: `(up + 1)`
    gate, up = h[..., : h.shape[-1] // 2], h[..., h.shape[-1] // 2:]
    return F.silu(gate) * (up + 1.0)


def interleaved_halves(h):  # gate and up interleaved: npu_swiglu takes halves
    return F.silu(h[..., ::2]) * h[..., 1::2]


def halves_of_a_part(h):  # the halves of the first two thirds only
    third = h.shape[-1] // 3
    return F.silu(h[..., :third]) * h[..., third:2 * third]


@pytest.mark.parametrize("glu, reason", [
    (offset_one, "a constant 1.0 is added"),
    (interleaved_halves, "not x's first and second halves"),
    (halves_of_a_part, "that is exactly the two halves"),
], ids=["offset_one", "interleaved", "part"])
def test_pieces_that_are_not_npu_swiglus_halves_say_why(glu, reason):
    out, ref, report = compile_and_run(Glu(glu), _inputs(torch.float32, (2, 5, 3 * 32)), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    reasons = near_miss_reasons(report, "swiglu")
    assert len(reasons) == 1 and reason in reasons[0], reasons
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class StackedExpertsGateAndUp(torch.nn.Module):
    """olmo-core's MoEMLP: the experts as batched GEMMs by stacked (E, H, I) weights w1, w3."""

    def __init__(self, experts=2, hidden=HIDDEN, inner=32):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, inner) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(experts, hidden, inner) * 0.2)

    def forward(self, x):
        return F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3)


def test_experts_gate_and_up_by_stacked_weights_say_why_they_are_not_merged():
    """merged_projections merges nn.Linear weights only: the near miss says so, and why, rather
    than pointing at its report (which has nothing on stacked expert weights)."""
    x = torch.randn(2, 5, HIDDEN)
    out, ref, report = compile_and_run(StackedExpertsGateAndUp(), x)
    assert report.counts["swiglu"] == 0
    (reason,) = near_miss_reasons(report, "swiglu")
    assert "two stacked weights (w1, w3)" in reason and "would change their strides" in reason, reason
    torch.testing.assert_close(out, ref)


# ---- halves scaled before the gate (nGPT) ------------------------------------------------------
class ScaledHalvesMLP(MLP):
    """olmo-core's NormalizedFeedForward on one gate_up projection: each half scaled before the
    gate, silu(sw1 * gate) * (sw3 * up); the scales' shapes given (per channel, one number, per row)."""

    def __init__(self, spelling="chunk", gate_shape=(FFN,), up_shape=(FFN,)):
        super().__init__()
        self.spelling = spelling
        self.sw1 = torch.nn.Parameter(torch.rand(gate_shape) + 0.5)
        self.sw3 = torch.nn.Parameter(torch.rand(up_shape) + 0.5)

    def forward(self, x):
        h = self.gate_up_proj(x)
        if self.spelling == "chunk":
            gate, up = h.chunk(2, dim=-1)
        else:
            gate, up = h[..., :FFN], h[..., FFN:]
        return self.down_proj(F.silu(self.sw1 * gate) * (up * self.sw3))


SCALES = {"per channel": ((FFN,), (FFN,)), "viewed (1, 1, h)": ((1, 1, FFN), (FFN,)), "one number": ((1,), (FFN,))}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("spelling", ["chunk", "slice"])
def test_halves_scaled_before_the_gate_fuse(spelling, scales, dtype, dynamic):
    # x * cat(s1, s2) rounds each scaled element as the model's s1 * gate does (the same product),
    # then the op is npu_swiglu's: the tolerances of the unscaled forms (module docstring)
    module = ScaledHalvesMLP(spelling, *SCALES[scales]).to(dtype)
    out, ref, report = compile_and_run(module, _inputs(dtype), config=ONLY_SWIGLU, dynamic=dynamic)
    _assert_fused(report, ["chunked_scaled"])  # (slices are a split's in an inference graph)
    assert_close_at_scale(out, ref, AT_SCALE[dtype])


def test_halves_scaled_per_row_say_why():
    module = ScaledHalvesMLP("chunk", (2, 5, 1), (FFN,))
    out, ref, report = compile_and_run(module, _inputs(torch.float32), config=ONLY_SWIGLU)
    assert report.counts["swiglu"] == 0
    (reason,) = near_miss_reasons(report, "swiglu")
    assert "the gate scale [2, 5, 1] varies along the rows" in reason, reason
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("spelling", ["chunk", "slice"])
def test_halves_scaled_before_the_gate_train_fused(spelling):
    # the scales' gradients come from autograd of x * cat(s1, s2): the sums over the rows of the
    # op's input gradient times x, each half's to its scale (fp32: within 4 ulp at scale)
    module = ScaledHalvesMLP(spelling)
    eager = copy.deepcopy(module)
    x = _inputs(torch.float32).requires_grad_()
    backend = EmulationBackend(ONLY_SWIGLU)
    torch._dynamo.reset()
    torch.compile(module, backend=backend)(x).square().sum().backward()
    report = backend.report
    assert report.counts["swiglu"] == 1, report.near_misses
    assert report.fused_ops == {"npu.npu_swiglu": 1, "npu.npu_swiglu_backward": 1}
    x_eager = x.detach().clone().requires_grad_()
    eager(x_eager).square().sum().backward()
    assert_close_at_scale(x.grad, x_eager.grad, 4)
    for name, parameter in module.named_parameters():
        assert_close_at_scale(parameter.grad, dict(eager.named_parameters())[name].grad, 4)
