"""rope: every rotary form fuses, the fused graph computes the same, negatives say why.

Tolerances. fp32: the fused op computes x*cos + rotate(x)*sin in fp32, the same three
operations as the model, so results agree to 1 ulp. bf16/fp16: the model rounds after
each of its three ops, the op once at the end; each rounding is half an ulp of its
result and the two products can be larger than their sum, so the bound is taken at the
output's scale (2 ulp of the largest |output|), not per element.
"""
import math

import pytest
import torch
import torch.nn as nn

import npu_fx_fusion as nff
from helpers import (GuardRecordingBackend, RecordingBackend, assert_close_at_scale, assert_within_ulps, compile_and_run,
                     is_size_limit, near_miss_reasons)

ONLY_ROPE = nff.FusionConfig(enable={"rope"})
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- rotations and tables, as model code writes them ------------------------------------
def rotate_half_sliced(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_half_chunked(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def angles(batch, seq, dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    positions = torch.arange(seq, dtype=torch.float32) + torch.arange(batch)[:, None] * 3
    return positions[..., None] * inv_freq  # [B, S, D/2]


def hf_tables(batch, seq, dim, dtype):
    """HF: cos/sin of cat(freqs, freqs), [B, S, D]."""
    emb = torch.cat((angles(batch, seq, dim),) * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inputs(dtype, shape=(2, 4, 6, 16), seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype)


# ---- modules -------------------------------------------------------------------------------
class HFRope(nn.Module):
    """transformers' apply_rotary_pos_emb on q and k, with a choice of rotation and order."""

    def __init__(self, rotate=rotate_half_sliced, unsqueeze_dim=1, swapped=False):
        super().__init__()
        self.rotate, self.unsqueeze_dim, self.swapped = rotate, unsqueeze_dim, swapped

    def apply(self, x, cos, sin):
        if self.swapped == "cos*x first":  # both products' operands the other way round
            return cos * x + sin * self.rotate(x)
        if self.swapped:  # the other operand order: rotate(x) * sin first, cos * x
            return sin * self.rotate(x) + cos * x
        return x * cos + self.rotate(x) * sin

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(self.unsqueeze_dim), sin.unsqueeze(self.unsqueeze_dim)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


class PartialRope(HFRope):
    """Phi-3 / GLM: rotate the first rotary_dim of the head dim, pass the rest through."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotary_dim = cos.shape[-1]
        return tuple(torch.cat([self.apply(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
                     for x in (q, k))


class ComplexRope(nn.Module):
    """torchtitan / Meta Llama apply_rotary_emb: [B, S, N, D] in, freqs_cis [S, D/2]."""

    def forward(self, q, k, freqs_cis):
        def rotate(x):
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            freqs = freqs_cis.view(1, x.shape[1], 1, x.shape[-1] // 2)
            return torch.view_as_real(pairs * freqs).flatten(3).type_as(x)

        return rotate(q), rotate(k)


class DeepSeekEvenOdd(nn.Module):
    """transformers 5 DeepSeek-V3 apply_rotary_pos_emb_interleave (result de-interleaved)."""

    def forward(self, q, k, cos, sin):
        cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
        sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
        q1, q2 = q[..., 0::2], q[..., 1::2]
        k1, k2 = k[..., 0::2], k[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))


class DeepSeekViewTranspose(nn.Module):
    """modeling_deepseek.py (DeepSeek-V2/V3 remote code): de-interleave, then rotate_half."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotate(x):
            b, h, s, d = x.shape
            x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
            return x * cos + rotate_half_sliced(x) * sin

        return rotate(q), rotate(k)


def _run(module, q, k, *tables, config=ONLY_ROPE):
    return compile_and_run(module, q, k, *tables, config=config)


def _assert_numerics(out, ref):
    for o, r in zip(out, ref):
        if r.dtype == torch.float32:
            assert_within_ulps(o, r, 1)
        else:
            assert_close_at_scale(o, r, 2)


def _fused(report):
    return {op: n for op, n in report.fused_ops.items()}


# ---- every form fires, and computes the same ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [rotate_half_sliced, rotate_half_chunked, rotate_half_split],
                         ids=lambda f: f.__name__)
# "cos*x first": Commutative's first choice (x = cos) fails only at the second product, where
# spellings.match tries the first again the other way round
@pytest.mark.parametrize("swapped", [False, True, "cos*x first"], ids=["x*cos first", "sin*rot first", "cos*x first"])
def test_rotate_half_forms_fuse_to_half_mode(dtype, rotate, swapped):
    q, k = inputs(dtype), inputs(dtype, (2, 2, 6, 16), seed=1)
    cos, sin = hf_tables(2, 6, 16, dtype)
    out, ref, report = _run(HFRope(rotate, swapped=swapped), q, k, cos, sin)
    assert report.counts["rope"] == 2
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    ops = report.graphs[0].ops_after
    assert ops["aten.neg.default"] == 0 and ops["aten.cat.default"] == 0
    _assert_numerics(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bsnd_layout_with_tables_unsqueezed_at_dim_2(dtype):
    q, k = inputs(dtype, (2, 6, 4, 16)), inputs(dtype, (2, 6, 2, 16), seed=1)
    cos, sin = hf_tables(2, 6, 16, dtype)
    out, ref, report = _run(HFRope(unsqueeze_dim=2), q, k, cos, sin)
    assert report.counts["rope"] == 2
    _assert_numerics(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_partial_rotary_fuses_the_rotated_part(dtype):
    q, k = inputs(dtype, (2, 4, 6, 32)), inputs(dtype, (2, 2, 6, 32), seed=1)
    cos, sin = hf_tables(2, 6, 16, dtype)  # rotary_dim 16 of head_dim 32
    out, ref, report = _run(PartialRope(), q, k, cos, sin)
    assert report.counts["rope"] == 2
    assert report.graphs[0].ops_after["aten.neg.default"] == 0
    _assert_numerics(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_every_two_fuses_to_interleave_mode(dtype):
    q, k = inputs(dtype), inputs(dtype, (2, 2, 6, 16), seed=1)
    emb = angles(2, 6, 16).repeat_interleave(2, dim=-1)  # GPT-J: each angle for its pair
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out, ref, report = _run(HFRope(rotate_every_two), q, k, cos, sin)
    assert report.counts["rope"] == 2
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    assert report.graphs[0].ops_after["aten.stack.default"] == 0
    _assert_numerics(out, ref)


def _freqs_cis(seq, dim):
    return torch.polar(torch.ones(seq, dim // 2), angles(1, seq, dim)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_complex_form_fuses_without_complex_arithmetic(dtype):
    q, k = inputs(dtype, (2, 6, 4, 16)), inputs(dtype, (2, 6, 1, 16), seed=1)
    out, ref, report = _run(ComplexRope(), q, k, _freqs_cis(6, 16))
    assert report.counts["rope"] == 2
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    ops = report.graphs[0].ops_after
    assert ops["aten.view_as_complex.default"] == 0 and ops["aten.mul.Tensor"] == 0
    # the model computes in fp32 and casts back once; so does the fused graph
    for o, r in zip(out, ref):
        assert_within_ulps(o.float(), r.float(), 1) if dtype == torch.float32 else torch.testing.assert_close(o, r)


@pytest.mark.parametrize("shape", [(2, 4, 4, 16), (1, 4, 4, 16), (4, 4, 4, 16)], ids=["S=N", "B=1, S=N", "B=S=N"])
def test_complex_form_takes_its_layout_from_the_graph_when_sizes_coincide(shape):
    # [B, S, N, D] with S == N (torchtitan at a sequence length equal to its head count):
    # the table's view (1, S, 1, D/2) says which dim is the sequence, not the sizes
    q, k = inputs(torch.float32, shape), inputs(torch.float32, shape, seed=1)
    out, ref, report = _run(ComplexRope(), q, k, _freqs_cis(shape[1], shape[-1]))
    assert report.counts["rope"] == 2 and report.near_misses == []
    for o, r in zip(out, ref):
        assert_within_ulps(o, r, 1)


@pytest.mark.parametrize("dtype, head_dim, fused_op", [
    (torch.bfloat16, 64, "npu.npu_interleave_rope"),
    (torch.float16, 64, "npu.npu_interleave_rope"),
    (torch.float32, 64, "npu.npu_rotary_mul"),  # npu_interleave_rope is fp16/bf16 only
    (torch.bfloat16, 32, "npu.npu_rotary_mul"),  # ... and head_dim 64 only
], ids=["bf16-64", "fp16-64", "fp32-64", "bf16-32"])
@pytest.mark.parametrize("module", [DeepSeekEvenOdd(), DeepSeekViewTranspose()],
                         ids=["even_odd", "view_transpose"])
def test_deepseek_interleaved_pairs(module, dtype, head_dim, fused_op):
    q, k = inputs(dtype, (2, 4, 6, head_dim)), inputs(dtype, (2, 1, 6, head_dim), seed=1)
    cos, sin = hf_tables(2, 6, head_dim, dtype)
    out, ref, report = _run(module, q, k, cos, sin)
    assert report.counts["rope"] == 2
    assert _fused(report) == {fused_op: 2}
    if fused_op == "npu.npu_rotary_mul":  # the site says why the better op was not used
        assert all("npu_interleave_rope" in site.note for site in report.sites), report.sites
    _assert_numerics(out, ref)


# ---- dynamic shapes: batch and sequence symbolic together ----------------------------------
def _hf_case(module, head_dim=16, pairs=False):
    """(module, inputs at (batch, seq), the (batch, sequence) dims of each input): BNSD q and
    k, [B, S, D] tables."""
    def make(batch, seq, dtype):
        q, k = inputs(dtype, (batch, 4, seq, head_dim)), inputs(dtype, (batch, 2, seq, head_dim), seed=1)
        if pairs:  # GPT-J / GLM: each angle for its pair
            emb = angles(batch, seq, head_dim).repeat_interleave(2, dim=-1)
            return q, k, emb.cos().to(dtype), emb.sin().to(dtype)
        return (q, k, *hf_tables(batch, seq, head_dim, dtype))
    return module, make, ((0, 2), (0, 2), (0, 1), (0, 1))


def _complex_case():
    def make(batch, seq, dtype):  # torchtitan: [B, S, N, D], freqs_cis [S, D/2]
        return inputs(dtype, (batch, seq, 4, 16)), inputs(dtype, (batch, seq, 1, 16), seed=1), _freqs_cis(seq, 16)
    return ComplexRope(), make, ((0, 1), (0, 1), (0,))


DYNAMIC_CASES = {
    "rotate_half": _hf_case(HFRope()),
    "rotate_every_two": _hf_case(HFRope(rotate_every_two), pairs=True),
    "partial": _hf_case(PartialRope(), head_dim=32),
    "complex": _complex_case(),
    "deepseek_even_odd": _hf_case(DeepSeekEvenOdd(), head_dim=64),
    "deepseek_view_transpose": _hf_case(DeepSeekViewTranspose(), head_dim=64),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(DYNAMIC_CASES))
def test_every_form_fuses_with_symbolic_batch_and_sequence(case, dtype):
    """Every form fuses as with static shapes with batch and sequence marked dynamic (two
    independent symbols: the exact match takes both), head counts and dims static as a
    model's projections make them, and the one symbolic graph computes the same as eager at
    another batch and length."""
    module, make, dynamic_dims = DYNAMIC_CASES[case]
    backend = GuardRecordingBackend(ONLY_ROPE)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        # sizes unlike every head count and dim: dynamo's duck sizing would otherwise give
        # two equal sizes one symbol, and the second call would recompile
        for batch, seq in ((3, 7), (5, 9)):
            args = make(batch, seq, dtype)
            for t, dims in zip(args, dynamic_dims):
                for dim in dims:
                    torch._dynamo.mark_dynamic(t, dim)
            _assert_numerics(compiled(*args), module(*args))
    report = backend.report
    assert len(report.graphs) == 1  # no recompile: nothing pinned a size
    # the checks guard on the kernel's limits only (B < 1000), never on how two sizes compare
    assert all(is_size_limit(g) for g in backend.added_guards), backend.added_guards
    assert report.counts["rope"] == 2 and near_miss_reasons(report, "rope") == []


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", ["rotate_half", "rotate_every_two", "complex", "deepseek_even_odd"])
def test_every_form_fuses_with_every_size_symbolic(case, training):
    """dynamic=True: the head dim symbolic too. Dynamo sizes the flatten after
    rotate_every_two's stack and the complex form's view from an intermediate's symbolic
    size (`sym_size(x[..., 1::2], -1) * 2`); that read is taken from the graph's inputs
    (canonical.size_reads_from_inputs), so it neither keeps the site from matching ("is also
    used by sym_size") nor reads a node the replacement erased."""
    module, make, _ = DYNAMIC_CASES[case]
    backend = GuardRecordingBackend(ONLY_ROPE)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    with torch.set_grad_enabled(training):
        for batch, seq in ((3, 7), (5, 9)):
            args = make(batch, seq, torch.float32)
            if training:  # q and k need a gradient, the tables are buffers
                args = [a.requires_grad_() if i < 2 else a for i, a in enumerate(args)]
            out, ref = compiled(*args), module(*args)
            _assert_numerics([o.detach() for o in out], [r.detach() for r in ref])
            if training:
                grads = torch.autograd.grad(sum(o.sum() for o in out), args[:2])
                expected = torch.autograd.grad(sum(r.sum() for r in ref), args[:2])
                _assert_numerics(grads, expected)
    report = backend.report
    assert len(report.graphs) == (3 if training else 1)  # one compile: joint, forward, backward
    assert report.counts["rope"] == 2 and near_miss_reasons(report, "rope") == []


class SplitHalvesRope(torch.nn.Module):
    """rotate_half as torch.split(x, x.shape[-1] // 2), with `size` the split size."""

    def __init__(self, size=lambda d: d // 2):
        super().__init__()
        self.size = size

    def forward(self, q, cos, sin):
        x1, x2 = torch.split(q, self.size(q.shape[-1]), dim=-1)
        return q * cos + torch.cat([-x2, x1], -1) * sin


@pytest.mark.parametrize("size, fuses", [(lambda d: d // 2, True), (lambda d: 3 * d // 4, False)],
                         ids=["halves", "three_quarters"])
def test_a_split_at_a_symbolic_half_of_the_head_dim_reads_as_the_halves(size, fuses):
    # dynamic=True on q itself makes its head dim symbolic: split(q, s // 2) reaches the
    # graph with a SymInt size, which canonical._split_as_slices spells as the slices
    # q[..., :s // 2] and q[..., s // 2:]; a split at three quarters is no rotate_half
    module = SplitHalvesRope(size)
    backend = GuardRecordingBackend(ONLY_ROPE)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for batch, seq in ((3, 7), (5, 9)):
            q = inputs(torch.float32, (batch, 4, seq, 16))
            cos, sin = (t.unsqueeze(1) for t in hf_tables(batch, seq, 16, torch.float32))
            _assert_numerics(compiled(q, cos, sin), module(q, cos, sin))
    assert backend.report.counts["rope"] == (1 if fuses else 0)
    if not fuses:
        assert near_miss_reasons(backend.report, "rope")


class ChunkedRope(torch.nn.Module):
    """rotate_half as x.chunk(2, -1); `even`: the code also checks the head dim is even
    (torch._check: a guard the compiled graph has before any pass runs)."""

    def __init__(self, even):
        super().__init__()
        self.even = even

    def forward(self, q, cos, sin):
        if self.even:
            torch._check(q.shape[-1] % 2 == 0)
        x1, x2 = q.chunk(2, dim=-1)
        return q * cos + torch.cat((-x2, x1), dim=-1) * sin


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("even, dynamic", [(True, "dynamic=True"), (False, "dynamic=True"),
                                           (False, "mark_dynamic(batch, seq)")],
                         ids=["proven-even", "maybe-odd", "static-head-dim"])
def test_a_chunk_of_a_symbolic_head_dim_fuses_only_where_it_is_proven_even(even, dynamic, training):
    # dynamic=True on q makes its head dim s symbolic: x.chunk(2, -1) splits it at
    # (s + 1) // 2, npu_rotary_mul's half s // 2 only for an even s. The pass proves it from
    # what the graph knows (nodes.known_equal) and adds no guard of its own: unproven, the
    # site is a near miss saying so. With batch and sequence dynamic, the head dim is static
    # (as a projection makes it): the chunk fuses
    module = ChunkedRope(even)
    backend = GuardRecordingBackend(ONLY_ROPE)
    fuses = even or dynamic != "dynamic=True"
    compiled = torch.compile(module, backend=backend, fullgraph=True,
                             dynamic=True if dynamic == "dynamic=True" else None)
    with torch.set_grad_enabled(training):
        for batch, seq in ((3, 7), (5, 9)):
            q = inputs(torch.float32, (batch, 4, seq, 16)).requires_grad_(training)
            cos, sin = (t.unsqueeze(1) for t in hf_tables(batch, seq, 16, torch.float32))
            if dynamic != "dynamic=True":
                for t, dims in ((q, (0, 2)), (cos, (0, 2)), (sin, (0, 2))):
                    for dim in dims:
                        torch._dynamo.mark_dynamic(t, dim)
            out, ref = compiled(q, cos, sin), module(q, cos, sin)
            _assert_numerics([out.detach()], [ref.detach()])
            if training:
                _assert_numerics(torch.autograd.grad(out.sum(), q), torch.autograd.grad(ref.sum(), q))
    report = backend.report
    assert report.counts["rope"] == (1 if fuses else 0)
    assert not any("Mod" in str(guard) for guard in backend.added_guards), backend.added_guards
    if not fuses:
        reasons = near_miss_reasons(report, "rope")
        assert reasons and all("not provably the half of its head dim" in r for r in reasons), reasons


# ---- torchair modes: interleave mode under max-autotune ----------------------------------
@pytest.mark.parametrize("soc, alternative", [(None, True), ("Ascend910B", True), ("Ascend950", False)])
def test_max_autotune_takes_the_half_mode_alternative_where_ge_ignores_the_mode(soc, alternative):
    q, k = inputs(torch.float32, (2, 6, 4, 16)), inputs(torch.float32, (2, 6, 1, 16), seed=1)
    config = nff.FusionConfig(enable={"rope"}, mode="max-autotune", soc=soc)
    out, ref, report = _run(ComplexRope(), q, k, _freqs_cis(6, 16), config=config)
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    notes = [site.note for site in report.sites]
    if alternative:
        assert all(n.startswith("instead of rotary_mul_from_complex: under max-autotune") for n in notes), notes
        assert report.graphs[0].ops_after["aten.transpose.int"] >= 4  # de-/re-interleaving
    else:
        assert notes == ["", ""]
    _assert_numerics(out, ref)


def test_emulation_notes_what_max_autotune_would_do():
    q, k = inputs(torch.float32, (2, 6, 4, 16)), inputs(torch.float32, (2, 6, 1, 16), seed=1)
    _, _, report = _run(ComplexRope(), q, k, _freqs_cis(6, 16))
    assert all("max-autotune would take the half-mode alternative" in s.note for s in report.sites)


def test_max_autotune_bf16_interleave_rope_falls_back_to_half_mode():
    q, k = inputs(torch.bfloat16, (2, 4, 6, 64)), inputs(torch.bfloat16, (2, 1, 6, 64), seed=1)
    cos, sin = hf_tables(2, 6, 64, torch.bfloat16)
    config = nff.FusionConfig(enable={"rope"}, mode="max-autotune")
    out, ref, report = _run(DeepSeekEvenOdd(), q, k, cos, sin, config=config)
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    assert all("GE InterleaveRope takes fp16 only" in s.note for s in report.sites)
    _assert_numerics(out, ref)


# ---- negatives: must not fuse, and must say why ------------------------------------------
class ReusesRotation(HFRope):
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated = rotate_half_sliced(q)
        return q * cos + rotated * sin, rotated


class PerHeadTables(HFRope):
    def forward(self, q, k, cos, sin):  # cos/sin given as [1, N, S, D]: not a layout the op has
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


class OddHeadDim(HFRope):
    def forward(self, q, k, cos, sin):
        return self.apply(q, cos, sin), k


def _negative_cases():
    q = inputs(torch.float32, (2, 4, 6, 16))
    k = inputs(torch.float32, (2, 4, 6, 16), seed=1)
    cos, sin = hf_tables(2, 6, 16, torch.float32)
    per_head = torch.randn(1, 4, 6, 16)
    odd = inputs(torch.float32, (2, 4, 6, 7))
    return [
        ("reused rotation", ReusesRotation(), (q, k, cos, sin), "also used by"),
        ("per-head tables", PerHeadTables(), (q, k, per_head, per_head), "do not broadcast to x"),
        ("odd head dim", OddHeadDim(), (odd, k, torch.randn(7), torch.randn(7)), "head_dim 7 is odd"),
    ]


@pytest.mark.parametrize("case", _negative_cases(), ids=lambda c: c[0])
def test_does_not_fuse_and_says_why(case):
    _, module, args, reason = case
    out, ref, report = _run(module, *args)
    reasons = near_miss_reasons(report, "rope")
    expected_misses = 1 if isinstance(module, (ReusesRotation, OddHeadDim)) else 2
    assert report.counts["rope"] == 0, report.sites
    assert len(reasons) == expected_misses and all(reason in r for r in reasons), reasons
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("head_dim, fuses", [(64, False), (128, True)])
def test_310p_has_only_the_jit_kernel(head_dim, fuses):
    q, k = inputs(torch.float16, (1, 2, 4, head_dim)), inputs(torch.float16, (1, 2, 4, head_dim), seed=1)
    cos, sin = hf_tables(1, 4, head_dim, torch.float16)
    config = nff.FusionConfig(enable={"rope"}, soc="Ascend310P")
    _, _, report = _run(HFRope(), q, k, cos, sin, config=config)
    assert report.counts["rope"] == (2 if fuses else 0)
    if not fuses:
        assert all("only has its jit kernel" in r for r in near_miss_reasons(report, "rope"))


def test_head_count_limit():
    q = inputs(torch.float32, (1, 1000, 2, 8))
    cos, sin = hf_tables(1, 2, 8, torch.float32)
    _, _, report = _run(OddHeadDim(), q, q, cos.unsqueeze(1), sin.unsqueeze(1))
    assert report.counts["rope"] == 0
    (reason,) = near_miss_reasons(report, "rope")
    assert "N = 1000 is not below 1000" in reason, reason


def test_report_names_the_source_line():
    q, k = inputs(torch.float32), inputs(torch.float32, (2, 2, 6, 16), seed=1)
    cos, sin = hf_tables(2, 6, 16, torch.float32)
    _, _, report = _run(HFRope(), q, k, cos, sin)
    text = report.to_markdown()
    assert "**rope**: 2 fused" in text
    assert "return x * cos + self.rotate(x) * sin" in text
    assert not math.isnan(report.graphs[0].seconds)


# ---- DeepSeek-V4: partial interleaved RoPE (transformers' DeepseekV4Attention) -------------------
# The tiny attention rotates the last 8 of 32 channels of q, the kv head and (inverse, -sin) the
# output; CSA adds the compressor's keys and the indexer's q / k. Tolerances as above: fp32 1 ulp
# per element is the same three operations; the attention around them is measured at scale.
def _v4_attention(kind, dtype):
    from v4_modules import Attention

    module = Attention(kind, dtype=dtype)
    torch.manual_seed(6)
    return module, torch.randn(2, 18, module.config.hidden_size).to(dtype)


def _v4_table_heads(gm):
    """The head dim of every inplace_partial_rotary_mul call's r1 table (BS1D: 1, BSND: N)."""
    op = torch.ops.cann_ops_transformer.inplace_partial_rotary_mul.default
    return [node.kwargs["r1"].meta["val"].shape[2] for node in gm.graph.nodes
            if node.op == "call_function" and node.args[:1] == (op,)]


@pytest.mark.parametrize("kind, sites", [("swa", 3), ("csa", 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v4_partial_rope_fuses_in_place(kind, sites, dtype):
    module, hidden = _v4_attention(kind, dtype)
    out, ref, report = compile_and_run(module, hidden, config=ONLY_ROPE)
    assert report.counts["rope"] == sites
    assert report.fused_ops == {"cann_ops_transformer.inplace_partial_rotary_mul": sites}
    assert_close_at_scale(out, ref, 2)


@pytest.mark.parametrize("soc, heads", [("Ascend910B", {1}), ("Ascend950", {1, 4})])
def test_deepseek_v4_rope_tables_take_the_soc_layout(soc, heads):
    # A2/A3 take BS1D tables, 950 does not (BSND: one table row per head; the kv head has 1)
    from helpers import RecordingBackend

    module, hidden = _v4_attention("swa", torch.bfloat16)
    backend = RecordingBackend(nff.FusionConfig(enable={"rope"}, soc=soc))
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(hidden)
        ref = module(hidden)
    assert backend.report.counts["rope"] == 3
    assert set(_v4_table_heads(backend.graphs["inference"])) == heads
    assert_close_at_scale(out, ref, 2)


def test_deepseek_v4_rope_trains_through_the_backward_op():
    from v4_modules import fused_calls, train_and_compare

    module, hidden = _v4_attention("swa", torch.float32)
    backend = train_and_compare(module, [hidden], ONLY_ROPE, {torch.float32: 4})
    assert fused_calls(backend.graphs["forward"]) == {"cann_ops_transformer.inplace_partial_rotary_mul": 3}
    assert fused_calls(backend.graphs["backward"]) == {"cann_ops_transformer.inplace_partial_rotary_mul_backward": 3}


def test_deepseek_v4_rope_dim_is_read_from_the_tables():
    # partial_rotary_factor 0.5: 16 of 32 channels rotate; a baked-in 8 would rotate the wrong ones
    from v4_modules import Attention

    module = Attention("swa", partial_rotary_factor=0.5)
    torch.manual_seed(6)
    hidden = torch.randn(2, 18, module.config.hidden_size)
    out, ref, report = compile_and_run(module, hidden, config=ONLY_ROPE)
    assert report.counts["rope"] == 3
    assert_close_at_scale(out, ref, 2)


# ---- other codebases' spellings: recognised by what they compute ----------------------------
# Each is the library's own code, reduced to the rotation (the source named); none matches a
# form above. The recognizer (patterns/rope.py, channel_algebra.py) reads each output channel
# as terms of x and the tables and fuses where the map is npu_rotary_mul's.
def torchtune_rope(x, cache):
    # torchtune.modules.RotaryPositionalEmbeddings.forward (0.6.1): x [B, S, N, D], cache [S, D/2, 2]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                         xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
    return x_out.flatten(3).type_as(x)


def olmo_core_rope(x, sin, cos):
    # olmo_core.nn.rope.RotaryEmbedding._rotate_half / _apply_rotary_pos_emb (3.0.0): x [B, N, S, D]
    def rotate_half(t):
        B, nh, T, hs = t.size()
        t = t.view(B, nh, T, 2, hs // 2)
        x1, x2 = t.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


def negative_angle_rope(x, cos, sin):
    # a rotation by -angle, written out per half: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c + x2 * s, -x1 * s + x2 * c), dim=-1)


def torchtitan_npu_v32_rope(x, freqs_cis):
    # torchtitan_npu.models.deepseek_v32 apply_rotary_emb(interleaved=False), the indexer's:
    # halves paired as complex numbers, rotated, de-paired: half mode on x
    shape = x.shape
    x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    x = torch.view_as_complex(x.float().view(*shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: x.size(1)].view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1).to(torch.float32)


def torchtitan_npu_v4_rope(x, freqs_cis):
    # torchtitan_npu.models.deepseek_v4 apply_rotary_emb: x 3-d (B, S, D) for the shared
    # key (no head dim) or 4-d (B, S, N, D)
    x_complex = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    seqlen = x_complex.size(1)
    freqs_cis = freqs_cis[:seqlen]
    if x_complex.ndim == 3:
        freqs_cis = freqs_cis.view(1, seqlen, x_complex.size(-1))
    else:
        freqs_cis = freqs_cis.view(1, seqlen, 1, x_complex.size(-1))
    return torch.view_as_real(x_complex * freqs_cis).flatten(-2).to(x.dtype)


class TwoRotations(nn.Module):
    def __init__(self, rotate):
        super().__init__()
        self.rotate = rotate

    def forward(self, q, k, *tables):
        return self.rotate(q, *tables), self.rotate(k, *tables)


def _torchtune_case(dtype, batch=2, seq=6):
    q, k = inputs(dtype, (batch, seq, 4, 16)), inputs(dtype, (batch, seq, 2, 16), seed=1)
    theta = angles(1, seq, 16)[0]
    cache = torch.stack([theta.cos(), theta.sin()], dim=-1)  # fp32, as torchtune's buffer
    return TwoRotations(torchtune_rope), (q, k, cache), ((0, 1), (0, 1), (0,))


def _olmo_core_case(dtype, batch=2, seq=6):
    q, k = inputs(dtype, (batch, 4, seq, 16)), inputs(dtype, (batch, 2, seq, 16), seed=1)
    cos, sin = hf_tables(1, seq, 16, dtype)
    return TwoRotations(olmo_core_rope), (q, k, sin[:, None], cos[:, None]), ((0, 2), (0, 2), (2,), (2,))


def _negative_angle_case(dtype, batch=2, seq=6):
    q, k = inputs(dtype, (batch, 4, seq, 16)), inputs(dtype, (batch, 2, seq, 16), seed=1)
    cos, sin = hf_tables(batch, seq, 16, dtype)
    return TwoRotations(negative_angle_rope), (q, k, cos[:, None], sin[:, None]), ((0, 2),) * 4


def _promoted_tables_case(dtype, batch=2, seq=6):
    # fp32 tables on the activations (Gemma-style buffers kept in fp32): torch computes in fp32
    q, k = inputs(dtype, (batch, 4, seq, 16)), inputs(dtype, (batch, 2, seq, 16), seed=1)
    cos, sin = hf_tables(batch, seq, 16, torch.float32)
    return HFRope(), (q, k, cos, sin), ((0, 2), (0, 2), (0, 1), (0, 1))


def _torchtitan_npu_v32_case(dtype, batch=2, seq=6):
    q, k = inputs(dtype, (batch, seq, 4, 16)), inputs(dtype, (batch, seq, 1, 16), seed=1)
    return TwoRotations(torchtitan_npu_v32_rope), (q, k, _freqs_cis(seq, 16)), ((0, 1), (0, 1), (0,))


def _torchtitan_npu_v4_case(dtype, batch=2, seq=6):
    # the query with heads, the shared key without (3-d): the op takes it with a head dim of 1
    q, k = inputs(dtype, (batch, seq, 4, 16)), inputs(dtype, (batch, seq, 16), seed=1)
    return TwoRotations(torchtitan_npu_v4_rope), (q, k, _freqs_cis(seq, 16)), ((0, 1), (0, 1), (0,))


class RepeatedKeyRotations(TwoRotations):
    """k's rotation read after GQA's repeat over the query heads (olmo-core's attention backend:
    unsqueeze, expand, reshape): the rotation ends before the repeat."""

    def forward(self, q, k, *tables):
        rotated = self.rotate(k, *tables)
        b, heads, s, d = rotated.shape
        return self.rotate(q, *tables), rotated[:, :, None].expand(b, heads, 2, s, d).reshape(b, heads * 2, s, d)


def _repeated_key_case(dtype, batch=2, seq=6):
    module, args, dims = _olmo_core_case(dtype, batch, seq)
    return RepeatedKeyRotations(olmo_core_rope), args, dims


class MergedProjectionRotations(nn.Module):
    """torchtune's rotation of q and k read as slices of one q/k/v projection (what
    merged_projections makes of three linears on one input): x's channels are more than the
    rotation's, and each rotation reads a slice of them."""

    def forward(self, x, w, cache):
        qkv = x @ w.t()
        b, s, _ = qkv.shape
        q, k = qkv[..., :64].view(b, s, 4, 16), qkv[..., 64:96].view(b, s, 2, 16)
        return torchtune_rope(q, cache), torchtune_rope(k, cache)


def _merged_projection_case(dtype, batch=2, seq=6):
    x, w = inputs(dtype, (batch, seq, 32)), inputs(dtype, (128, 32), seed=1) / 4
    theta = angles(1, seq, 16)[0]
    cache = torch.stack([theta.cos(), theta.sin()], dim=-1)
    return MergedProjectionRotations(), (x, w, cache), ((0, 1), (), (0,))


RECOGNISED_CASES = {"torchtune": _torchtune_case, "olmo_core": _olmo_core_case,
                    "negative_angle": _negative_angle_case, "promoted_tables": _promoted_tables_case,
                    "torchtitan_npu_v32": _torchtitan_npu_v32_case, "torchtitan_npu_v4": _torchtitan_npu_v4_case,
                    "repeated_key": _repeated_key_case, "merged_projection": _merged_projection_case}


def _assert_same(out, ref):
    # the recognised rotation computes in the region's arithmetic dtype and rounds once: fp32
    # regions agree to 1 ulp; a half-precision region rounds thrice where the op rounds once
    for o, r in zip(out, ref):
        if r.dtype == torch.float32:
            assert_within_ulps(o, r, 1)
        else:
            assert_close_at_scale(o, r, 2)


def _mark_dynamic(args, dims):
    # batch and sequence symbolic, as a model's are under dynamic=True; the head dim stays
    # static, as a model's does (it comes from the weights' shapes, not from an input)
    for arg, which in zip(args, dims):
        torch._dynamo.mark_dynamic(arg, list(which))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(RECOGNISED_CASES))
def test_other_codebases_rotations_are_recognised(case, dtype, dynamic):
    module, args, dims = RECOGNISED_CASES[case](dtype)
    if dynamic:
        _mark_dynamic(args, dims)
    backend = nff.backend.EmulationBackend(ONLY_ROPE)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        out, ref = compiled(*args), module(*args)
        if dynamic:  # the same graph serves another batch and sequence length
            _, other, _ = RECOGNISED_CASES[case](dtype, batch=3, seq=9)
            _assert_same(compiled(*other), module(*other))
    report = backend.report
    assert len(report.graphs) == 1  # one compile
    assert report.counts["rope"] == 2 and near_miss_reasons(report, "rope") == []
    assert _fused(report) == {"npu.npu_rotary_mul": 2}
    if case == "torchtitan_npu_v4":  # the 4-d query is torchtitan's complex form
        assert sorted(site.form for site in report.sites)[0] == "complex_multiply"
    elif case != "promoted_tables" or dtype != torch.float32:  # (fp32 everywhere: transformers' form)
        assert all("channel algebra" in site.form for site in report.sites)
    _assert_same(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [case for case in RECOGNISED_CASES if case != "merged_projection"])
def test_other_codebases_rotations_train_through_the_backward_op(case, dtype):
    module, args, _ = RECOGNISED_CASES[case](dtype)
    q, k = (a.detach().clone().requires_grad_() for a in args[:2])
    q_ref, k_ref = (a.detach().clone().requires_grad_() for a in args[:2])
    backend = nff.backend.EmulationBackend(ONLY_ROPE)
    out = torch.compile(module, backend=backend, fullgraph=True)(q, k, *args[2:])
    ref = module(q_ref, k_ref, *args[2:])
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, grads)
    report = backend.report
    assert report.fused_ops == {"npu.npu_rotary_mul": 2, "npu.npu_rotary_mul_backward": 2}, report.fused_ops
    _assert_same([o.detach() for o in out], [r.detach() for r in ref])
    _assert_same([q.grad, k.grad], [q_ref.grad, k_ref.grad])


def test_a_rotation_of_a_merged_projection_slice_trains_with_its_forward_fused_and_says_why_not_more():
    # x's gradient is the sum of every slice's (q's, k's, v's): the joint graph's backward is
    # not the rotation's alone, so the joint pass leaves it (a near miss), and the forward graph
    # after partitioning fuses the rotations, the backward staying as autograd wrote it
    module, args, _ = _merged_projection_case(torch.float32)
    x, w = (a.detach().clone().requires_grad_() for a in args[:2])
    x_ref, w_ref = (a.detach().clone().requires_grad_() for a in args[:2])
    backend = nff.backend.EmulationBackend(ONLY_ROPE)
    out = torch.compile(module, backend=backend, fullgraph=True)(x, w, args[2])
    ref = module(x_ref, w_ref, args[2])
    grads = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, grads)
    assert backend.report.fused_ops == {"npu.npu_rotary_mul": 2}
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    (result,) = [p for p in joint.passes if p.pass_name == "rope"]
    assert [m.reason for m in result.near_misses] == [
        "the backward of the rotation does not compute its gradient alone (x's gradient summed with others?)"] * 2
    _assert_same([o.detach() for o in out], [r.detach() for r in ref])
    _assert_same([x.grad, w.grad], [x_ref.grad, w_ref.grad])


def test_promoted_tables_compute_in_the_promoted_dtype():
    # bf16 x with fp32 tables: torch computes x * cos in fp32 and returns fp32; so does the op,
    # on x cast to fp32 (exact): the result equals the model's to fp32 rounding
    module, args, _ = _promoted_tables_case(torch.bfloat16)
    out, ref, report = _run(module, *args)
    assert report.counts["rope"] == 2 and all(o.dtype == torch.float32 for o in out)
    for o, r in zip(out, ref):
        assert_within_ulps(o, r, 1)


class ScaledRotation(nn.Module):  # x * cos + rotate(x) * sin * 3: not a rotation
    def forward(self, q, k, cos, sin, _):
        return tuple(x * cos + rotate_half_sliced(x) * (sin * 2.0).to(x.dtype) * 1.5 for x in (q, k))


class QuarterRotation(nn.Module):  # cat(-x[d/4:], x[:d/4]): pairs a quarter apart, not halves
    def forward(self, q, k, cos, sin, _):
        def rotate(x):
            quarter = x.shape[-1] // 4
            return torch.cat((-x[..., quarter:], x[..., :quarter]), dim=-1)

        return tuple(x * cos + rotate(x) * sin for x in (q, k))


class TwoTablesPerHalf(nn.Module):  # the first half's cos from one tensor, the second's from another
    def forward(self, q, k, cos, sin, other_cos):
        half = cos.shape[-1] // 2

        def rope(x):
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half],
                              x2 * other_cos[..., half:] + x1 * sin[..., half:]), dim=-1)

        return rope(q), rope(k)


@pytest.mark.parametrize("module, reason", [
    (ScaledRotation(), "not a rotation"),
    (QuarterRotation(), "not pairs of x's channels"),
    (TwoTablesPerHalf(), "from 2 tensors"),
], ids=["scaled", "quarter", "two tables"])
def test_look_alike_rotations_do_not_fuse_and_say_why(module, reason):
    q, k = inputs(torch.float32), inputs(torch.float32, (2, 2, 6, 16), seed=1)
    cos, sin = hf_tables(2, 6, 16, torch.float32)
    out, ref, report = _run(module, q, k, cos[:, None], sin[:, None], cos[:, None] * 0.5)
    assert report.counts["rope"] == 0, report.sites
    reasons = near_miss_reasons(report, "rope")
    assert len(reasons) == 2 and all(reason in r for r in reasons), reasons
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


class ScaledQueryRotation(nn.Module):
    """olmo-core's nGPT: q = sq * normalize(q) in (B, S, H*D), viewed into heads, then
    olmo-core's rotate_half RoPE: a product of products the channel algebra cuts at the
    scaled q, so the rotation is evaluated and reported, not skipped."""

    def __init__(self):
        super().__init__()
        self.sq = nn.Parameter(torch.rand(64) + 0.5)

    def forward(self, q, sin, cos):
        b, s, _ = q.shape
        q = (self.sq * (q / q.norm(dim=-1, keepdim=True))).view(b, s, 4, 16)
        return olmo_core_rope(q, sin[:, :, None], cos[:, :, None]).transpose(1, 2)


def test_a_rotation_of_a_scaled_query_is_fused_or_says_why():
    q = inputs(torch.float32, (2, 6, 64))
    cos, sin = hf_tables(1, 6, 16, torch.float32)
    out, ref, report = _run(ScaledQueryRotation(), q, sin, cos)
    reasons = near_miss_reasons(report, "rope")
    assert report.counts["rope"] + len(reasons) == 1, reasons
    torch.testing.assert_close(out, ref)


class SplitKeyRotation(nn.Module):
    """DeepSeek-V4's shared key (torchtitan-npu): the rope channels split off a 3-d (B, S, D)
    key without a head dim, rotated as complex pairs by tables (1, S, D/2) that vary along S
    only, and put back. The op's own 3-d layout, TND, would read those tables as per head
    (1ND), which it does not take: it runs as BSND with one head, as the converter calls it."""

    def forward(self, kv, freqs_cis):
        nope, rope = torch.split(kv, [8, 16], dim=-1)
        return torch.cat([nope, torchtitan_npu_v4_rope(rope, freqs_cis)], dim=-1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_3d_key_without_heads_fuses_as_one_head(dynamic):
    kv, freqs = inputs(torch.float32, (2, 6, 24)), _freqs_cis(6, 16)
    backend = RecordingBackend(ONLY_ROPE)
    with torch.no_grad():
        out = torch.compile(SplitKeyRotation(), backend=backend, fullgraph=True, dynamic=dynamic)(kv, freqs)
    assert [site.form for site in backend.report.sites] == ["complex_multiply"]
    assert _fused(backend.report) == {"npu.npu_rotary_mul": 1}
    (call,) = backend.graphs["inference"].graph.find_nodes(op="call_function", target=torch.ops.npu.npu_rotary_mul.default)
    x, cos = (arg.meta["val"] for arg in call.args[:2])
    assert (x.dim(), x.shape[2], cos.shape[0], cos.shape[2]) == (4, 1, 1, 1)  # BSND, one head; tables 1S1D
    assert_within_ulps(out, SplitKeyRotation()(kv, freqs), 1)



class IndexerKeyForItsHadamard(nn.Module):
    """torchtitan-npu DeepSeek-V3.2's indexer key: the rope channels of a 3-d key rotated with
    a head dim of 1 (unsqueeze, the non-interleaved complex form, squeeze), put back (with a
    head dim of 1 again), and the key reshaped to (B*S, D) for the Hadamard transform. Read there, the rotation's table
    repeats over the batch within the merged rows; the rotation fuses at its own result."""

    def __init__(self):
        super().__init__()
        self.wk = nn.Linear(32, 32, bias=False)

    def forward(self, x, freqs_cis, hadamard):
        k_pe, k_nope = torch.split(self.wk(x), [16, 16], dim=-1)
        k_pe = torchtitan_npu_v32_rope(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        k = torch.cat([k_pe, k_nope], dim=-1).unsqueeze(2)
        return (k.reshape(-1, 32) @ hadamard).view(k.shape)


def test_a_rotation_read_through_a_reshape_to_rows_fuses_at_its_own_result():
    x, hadamard = inputs(torch.float32, (2, 16, 32)), torch.randn(32, 32)
    out, ref, report = compile_and_run(IndexerKeyForItsHadamard(), x, _freqs_cis(64, 16), hadamard, config=ONLY_ROPE)
    assert _fused(report) == {"npu.npu_rotary_mul": 1} and near_miss_reasons(report, "rope") == []
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
