"""The RoPE and SwiGLU stand-ins compute what op_semantics.md sections 3 and 4 say.

Every kernel is compared with a reference written here independently (slicing, complex
numbers, the HF model code), evaluated in float64 as the "exact" value.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import ulp
from npu_fx_fusion.npu_ops import ensure_registered
from npu_fx_fusion.npu_ops.rope import rope_tables
from npu_fx_fusion.npu_ops.spec import randn

npu = torch.ops.npu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEW_OPS = ["npu_rotary_mul", "npu_rotary_mul_backward", "npu_interleave_rope",
           "npu_swiglu", "npu_swiglu_backward"]
U32 = 2.0 ** -24  # fp32 unit roundoff: one fp32 rounding moves a value by at most U32 * |value|


@pytest.fixture(scope="module", autouse=True)
def _ops():
    registered = ensure_registered()
    assert all(f"npu::{op}" in registered for op in NEW_OPS)


def assert_one_rounding(actual, exact, scale, fp32_ops):
    """`actual` is `exact` computed in fp32, then rounded once to actual's dtype.

    One final rounding is at most half an ulp of the result; the fp32 computation before
    it adds at most `fp32_ops` roundings, each within U32 of the magnitude `scale` of the
    terms (per element, or a bound). A kernel that rounded an intermediate product to
    bf16/fp16 would be off by ~half an ulp of that product, far beyond this.
    """
    assert actual.dtype != torch.float64 and actual.shape == exact.shape
    allowed = 0.5 * ulp(exact.to(actual.dtype)).double() + fp32_ops * U32 * scale.double()
    excess = (actual.double() - exact.double()).abs() - allowed
    assert excess.max().item() <= 0, f"max excess over one rounding: {excess.max().item():.3g}"


# ---- independent references ------------------------------------------------------------
def rotate_half(x):  # HF Llama / DeepSeek
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def rotate_quarter(x):
    # quarter mode is half mode applied to each half of D on its own
    d = x.shape[-1] // 2
    return torch.cat((rotate_half(x[..., :d]), rotate_half(x[..., d:])), dim=-1)


def rope_ref(x, cos, sin, rotate):
    """(value, magnitude of its terms) of x*cos + rotate(x)*sin, in float64."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    a, b = x * cos, rotate(x) * sin
    return a + b, a.abs() + b.abs()


def complex_rope_ref(x, cos, sin):
    """torchtitan / Meta Llama: rotate consecutive pairs as complex numbers, in float64."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * torch.complex(cos.double(), sin.double())).flatten(-2)
    pairs = x.double().reshape(*x.shape[:-1], -1, 2).abs()
    scale = ((pairs[..., 0] + pairs[..., 1]) * (cos.double().abs() + sin.double().abs()))
    return out, scale.repeat_interleave(2, -1)


# ---- npu_rotary_mul: forward -------------------------------------------------------------
# (x shape, r1/r2 shape): every documented broadcast of BNSD, BSND, SBND and TND.
HALF_LAYOUTS = [
    ((2, 3, 5, 16), (1, 1, 5, 16)),  # BNSD, 11SD
    ((2, 3, 5, 16), (2, 1, 5, 16)),  # BNSD, B1SD
    ((2, 3, 5, 16), (2, 3, 5, 16)),  # BNSD, BNSD
    ((2, 5, 3, 16), (1, 5, 1, 16)),  # BSND, 1S1D
    ((2, 5, 3, 16), (2, 5, 1, 16)),  # BSND, BS1D
    ((5, 2, 3, 16), (5, 1, 1, 16)),  # SBND, S11D
    ((5, 2, 3, 16), (5, 2, 1, 16)),  # SBND, SB1D
    ((7, 3, 16), (7, 1, 16)),  # TND, T1D
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_shape, r_shape", HALF_LAYOUTS, ids=str)
def test_rotary_mul_half_is_rotate_half_rope_rounded_once(x_shape, r_shape, dtype):
    x, (cos, sin) = randn(*x_shape, dtype=dtype), rope_tables(r_shape, dtype)
    out = npu.npu_rotary_mul(x, cos, sin)  # 'half' is the default
    exact, scale = rope_ref(x, cos, sin, rotate_half)
    assert out.shape == x.shape and out.dtype == dtype
    assert_one_rounding(out, exact, scale, fp32_ops=3)  # two products and their sum


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_shape, r_shape", [((2, 3, 5, 16), (1, 1, 5, 8)),  # BNSD, 11SD
                                              ((2, 5, 3, 16), (1, 5, 1, 8)),  # BSND, 1S1D
                                              ((7, 3, 16), (7, 1, 8))], ids=str)  # TND, T1D
def test_rotary_mul_interleave_is_complex_rope(x_shape, r_shape, dtype):
    # The torchtitan mapping of op_semantics 3.1: freqs_cis -> repeat_interleave(2) tables.
    x, (cos, sin) = randn(*x_shape, dtype=dtype), rope_tables(r_shape, dtype)
    out = npu.npu_rotary_mul(x, cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), "interleave")
    exact, scale = complex_rope_ref(x, cos, sin)
    assert_one_rounding(out, exact, scale, fp32_ops=3)


def test_rotary_mul_interleave_pairs_neighbours_elementwise():
    x, (c, s) = randn(1, 1, 1, 4), rope_tables((1, 1, 1, 4))
    out = npu.npu_rotary_mul(x, c, s, "interleave")[0, 0, 0]
    x, c, s = x[0, 0, 0], c[0, 0, 0], s[0, 0, 0]
    expected = torch.stack([x[0] * c[0] - x[1] * s[0], x[1] * c[1] + x[0] * s[1],
                            x[2] * c[2] - x[3] * s[2], x[3] * c[3] + x[2] * s[3]])
    torch.testing.assert_close(out, expected, rtol=2 * U32, atol=2 * U32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_mul_quarter_rotates_each_half_of_d(dtype):
    x, (cos, sin) = randn(2, 3, 5, 16, dtype=dtype), rope_tables((1, 1, 5, 16), dtype)
    out = npu.npu_rotary_mul(x, cos, sin, "quarter")
    exact, scale = rope_ref(x, cos, sin, rotate_quarter)
    assert_one_rounding(out, exact, scale, fp32_ops=3)


def test_the_modes_really_differ():
    # guards the references above against testing one rotation three times
    x, (cos, sin) = randn(1, 2, 3, 16), rope_tables((1, 1, 3, 16))
    outs = [npu.npu_rotary_mul(x, cos, sin, mode) for mode in ("half", "interleave", "quarter")]
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])
    assert not torch.allclose(outs[1], outs[2])


# ---- npu_rotary_mul with `rotate` ----------------------------------------------------------
def _half_matrix(d, dtype=torch.float32):
    """The docs' half-mode rotate matrix: x @ R == rotate_half(x)."""
    h = d // 2
    r = torch.zeros(d, d, dtype=dtype)
    r[:h, h:] = torch.eye(h)
    r[h:, :h] = -torch.eye(h)
    return r


def test_rotate_with_the_docs_half_matrix_equals_half_mode():
    x, (cos, sin) = randn(2, 3, 5, 16), rope_tables((1, 1, 5, 16))
    fused = npu.npu_rotary_mul(x, cos, sin, "half", _half_matrix(16))
    assert torch.equal(fused, npu.npu_rotary_mul(x, cos, sin, "half"))  # x @ R only moves values


def test_rotate_block_diagonal_rotates_each_block():
    # The docs' use case: x split along D into sub-blocks, each with its own half rotation.
    sizes = (8, 4, 4)
    rotate = torch.block_diag(*[_half_matrix(n) for n in sizes])
    x, (cos, sin) = randn(2, 5, 3, 16), rope_tables((1, 5, 1, 16))
    out = npu.npu_rotary_mul(x, cos, sin, "half", rotate)
    blocks = lambda t: t.split(sizes, -1)  # noqa: E731
    expected = torch.cat([xb * cb + rotate_half(xb) * sb
                          for xb, cb, sb in zip(blocks(x), blocks(cos), blocks(sin))], -1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_rotate_is_used_as_given_whatever_the_mode():
    # The docs' interleave example matrix only swaps pairs (no sign, op_semantics 11.11):
    # the stand-in multiplies by it as it is and adds no sign of the mode.
    swap = torch.zeros(8, 8)
    for i in range(0, 8, 2):
        swap[i, i + 1] = swap[i + 1, i] = 1
    x, (cos, sin) = randn(1, 2, 3, 8), rope_tables((1, 1, 3, 8))
    out = npu.npu_rotary_mul(x, cos, sin, "interleave", swap)
    swapped = x.reshape(1, 2, 3, 4, 2).flip(-1).reshape(1, 2, 3, 8)
    torch.testing.assert_close(out, x * cos + swapped * sin, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_general_matrix(dtype):
    d = 16
    x, (cos, sin) = randn(2, 3, 5, d, dtype=dtype), rope_tables((2, 1, 5, d), dtype)
    rotate = randn(d, d, dtype=dtype, seed=3)
    out = npu.npu_rotary_mul(x, cos, sin, "half", rotate)
    xr = x.double() @ rotate.double()
    a, b = x.double() * cos.double(), xr * sin.double()
    scale = (x.double().abs() @ rotate.double().abs()) * sin.double().abs() + a.abs()
    # the matmul's d products and d-1 sums add up to d+1 fp32 roundings on top of the two
    # products and the sum (a bound, not the typical error)
    assert_one_rounding(out, a + b, scale, fp32_ops=d + 4)


def test_rotary_mul_refuses_what_it_cannot_compute():
    x = randn(1, 1, 2, 6)
    with pytest.raises(RuntimeError, match="rotary_mode 'interleave-half' has no CPU reference"):
        npu.npu_rotary_mul(x, x, x, "interleave-half")
    with pytest.raises(RuntimeError, match="4 equal parts, it has size 6"):
        npu.npu_rotary_mul(x, x, x, "quarter")
    with pytest.raises(RuntimeError, match="does not broadcast to the input's shape"):
        npu.npu_rotary_mul(x, randn(2, 1, 2, 6), x)


# ---- npu_rotary_mul: backward --------------------------------------------------------------
MODES_AND_TABLES = [("half", (2, 1, 3, 8)), ("half", (1, 1, 3, 8)), ("half", (2, 2, 3, 8)),
                    ("interleave", (1, 1, 3, 8)), ("quarter", (1, 1, 3, 8))]


@pytest.mark.parametrize("mode, r_shape", MODES_AND_TABLES, ids=str)
def test_rotary_mul_gradcheck_float64(mode, r_shape):
    x = randn(2, 2, 3, 8, dtype=torch.float64).requires_grad_()
    r1, r2 = (t.requires_grad_() for t in rope_tables(r_shape, torch.float64))
    assert torch.autograd.gradcheck(lambda *a: npu.npu_rotary_mul(*a, mode), (x, r1, r2))


REFERENCE_ROTATION = {"half": rotate_half, "quarter": rotate_quarter,
                      "interleave": lambda x: torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode, r_shape", MODES_AND_TABLES, ids=str)
def test_rotary_mul_grads_equal_the_unfused_reference(mode, r_shape, dtype):
    x = randn(2, 2, 3, 8, dtype=dtype).requires_grad_()
    r1, r2 = (t.requires_grad_() for t in rope_tables(r_shape, dtype))
    grad = randn(2, 2, 3, 8, dtype=dtype, seed=4)
    fused = torch.autograd.grad(npu.npu_rotary_mul(x, r1, r2, mode), (x, r1, r2), grad)

    leaves = [t.detach().double().requires_grad_() for t in (x, r1, r2)]
    ref = leaves[0] * leaves[1] + REFERENCE_ROTATION[mode](leaves[0]) * leaves[2]
    exact = torch.autograd.grad(ref, leaves, grad.double())
    # Every term is at most `bound` (|r| <= 1 for the dx terms r*g). dx: two products and a
    # sum, 3 roundings. dr1/dr2 sum n = B*N = 4 products: n roundings of the products and
    # n-1 of partial sums of at most n terms each, n + (n-1)*n = 16.
    bound = max(x.detach().abs().max().double(), 1.0) * grad.abs().max().double()
    for g, e, ops in zip(fused, exact, (3, 16, 16)):
        assert g.dtype == dtype
        assert_one_rounding(g, e, bound.expand(e.shape), fp32_ops=ops)


def test_rotary_mul_backward_op_shapes_and_dtypes():
    # Meta: dx like self; dr1/dr2 shaped like r1/r2 but in self's dtype.
    x, grad = randn(2, 3, 4, 8, dtype=torch.bfloat16), randn(2, 3, 4, 8, dtype=torch.bfloat16)
    r1, r2 = rope_tables((1, 1, 4, 8), torch.float32)
    dx, dr1, dr2 = npu.npu_rotary_mul_backward(grad, x, r1, r2, "half")
    assert (dx.shape, dr1.shape, dr2.shape) == (x.shape, r1.shape, r2.shape)
    assert dx.dtype == dr1.dtype == dr2.dtype == torch.bfloat16


def test_rotary_mul_backward_with_rotate_raises():
    x, (cos, sin) = randn(1, 2, 3, 8).requires_grad_(), rope_tables((1, 1, 3, 8))
    out = npu.npu_rotary_mul(x, cos, sin, "half", _half_matrix(8))  # the forward is fine
    with pytest.raises(RuntimeError, match="passing rotate disables backward"):
        out.sum().backward()


# ---- npu_interleave_rope ---------------------------------------------------------------------
def interleave_rope_doc(x, cos, sin):
    """op_semantics 3.3, verbatim."""
    B, N, S, D = x.shape
    q = x.view(B, N, S, D // 2, 2).transpose(-1, -2).reshape(B, N, S, D)
    q1, q2 = q.chunk(2, -1)
    return q * cos + torch.cat((-q2, q1), -1) * sin


def hf_deepseek_v3_rope(q, cos_cached, sin_cached, position_ids):
    """modeling_deepseek.py apply_rotary_pos_emb (the q half), as HF runs it."""
    cos = cos_cached[position_ids].unsqueeze(1)
    sin = sin_cached[position_ids].unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin)


def _deepseek_cache(seq_len, dim=64, base=10000.0, dtype=torch.float32):
    """DeepseekV3RotaryEmbedding's cos/sin cache: cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _mla_rope_inputs(dtype):
    q = randn(2, 3, 5, 64, dtype=dtype)
    cos_cached, sin_cached = _deepseek_cache(16, dtype=dtype)
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = cos_cached[position_ids].unsqueeze(1), sin_cached[position_ids].unsqueeze(1)
    return q, cos, sin, (cos_cached, sin_cached, position_ids)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interleave_rope_equals_the_doc_reference_and_hf_deepseek(dtype):
    q, cos, sin, hf_args = _mla_rope_inputs(dtype)
    out = npu.npu_interleave_rope(q, cos, sin)
    assert out.shape == q.shape and out.dtype == dtype
    if dtype == torch.float32:
        # both references do the kernel's fp32 operations in the same order: bit-equal
        assert torch.equal(out, interleave_rope_doc(q, cos, sin))
        assert torch.equal(out, hf_deepseek_v3_rope(q, *hf_args))
    # HF in bf16/fp16 rounds after each op; the kernel rounds once: compare with HF exact.
    exact = hf_deepseek_v3_rope(q.double(), hf_args[0].double(), hf_args[1].double(), hf_args[2])
    torch.testing.assert_close(interleave_rope_doc(q.double(), cos.double(), sin.double()), exact,
                               rtol=0, atol=0)
    assert_one_rounding(out, exact, q.double().abs().max().expand(q.shape) * 2, fp32_ops=3)


def test_interleave_rope_is_interleave_rotary_mul_left_de_interleaved():
    # op_semantics 3.3: not npu_rotary_mul(..., 'interleave') but that followed by a fixed
    # permutation of the output, [y0, y2, ..., y1, y3, ...].
    q, cos, sin, _ = _mla_rope_inputs(torch.float32)
    freqs_cos, freqs_sin = cos[..., :32], sin[..., :32]  # cat(freqs, freqs): one half suffices
    rope = npu.npu_interleave_rope(q, cos, sin)
    y = npu.npu_rotary_mul(q, freqs_cos.repeat_interleave(2, -1), freqs_sin.repeat_interleave(2, -1),
                           "interleave")
    assert not torch.allclose(rope, y)
    torch.testing.assert_close(rope, torch.cat((y[..., 0::2], y[..., 1::2]), -1), rtol=0, atol=0)


def test_interleave_rope_has_no_backward_like_torch_npu():
    q, cos, sin, _ = _mla_rope_inputs(torch.float32)
    out = npu.npu_interleave_rope(q.requires_grad_(), cos, sin)
    with pytest.raises(RuntimeError, match="npu_interleave_rope has no backward in torch_npu"):
        out.sum().backward()


# ---- npu_swiglu -------------------------------------------------------------------------------
def swiglu_ref(x, dim):
    """vLLM SiluAndMul along `dim`, in float64: silu of the FIRST half times the second."""
    d = x.shape[dim] // 2
    gate, up = x.double().narrow(dim, 0, d), x.double().narrow(dim, d, d)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_swiglu_is_silu_of_the_first_half_times_the_second(dim, dtype):
    x = randn(6, 4, 10, dtype=dtype) * 3
    out = npu.npu_swiglu(x, dim)
    exact = swiglu_ref(x, dim)
    assert out.shape == exact.shape and out.dtype == dtype
    # fp32 silu is exp, add and divide (exp within ~2 ulp), then the product: 6 roundings
    # of the result's size bounds it.
    assert_one_rounding(out, exact, exact.abs(), fp32_ops=6)


def test_swiglu_default_dim_is_last_and_odd_sizes_are_refused():
    x = randn(3, 8)
    torch.testing.assert_close(npu.npu_swiglu(x), npu.npu_swiglu(x, -1), rtol=0, atol=0)
    assert npu.npu_swiglu(x).shape == (3, 4)
    with pytest.raises(RuntimeError, match="two equal halves, it has size 3"):
        npu.npu_swiglu(x, 0)


@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu_gradcheck_float64(dim):
    x = randn(4, 6, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: npu.npu_swiglu(t, dim), (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [-1, 1])
def test_swiglu_grads_equal_the_unfused_reference(dim, dtype):
    x = (randn(2, 6, 8, dtype=dtype) * 3).requires_grad_()
    grad = randn(*npu.npu_swiglu(x, dim).shape, dtype=dtype, seed=5)
    (dx,) = torch.autograd.grad(npu.npu_swiglu(x, dim), x, grad)
    x64 = x.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(swiglu_ref(x64, dim), x64, grad.double())
    assert dx.dtype == dtype
    # grad_a = g*b*s*(1 + a*(1-s)), grad_b = g*a*s: every intermediate, scaled by the factors
    # it is later multiplied with, is at most |g|*|x|*(1+|x|) (0 < s < 1); there are about
    # 8 roundings of such values (sigmoid's exp within 2 ulp): 10 bounds them.
    xmax = x64.detach().abs().max()
    scale = grad.double().abs().max() * xmax * (1 + xmax)
    assert_one_rounding(dx, exact, scale.expand(exact.shape), fp32_ops=10)


# =====================================================================================
# DeepSeek-V4: in-place partial RoPE, clamped SwiGLU (npu_clipped_swiglu, cann_ops_nn.swiglu_group)
# =====================================================================================
def v4_partial_rope(x, cos, sin):
    """transformers DeepseekV4 apply_rotary_pos_emb in float64: interleaved pairs on the LAST
    2 * cos.shape[-1] channels; cos/sin one angle per pair (repeat_interleave(2))."""
    cos, sin = cos.double().repeat_interleave(2, -1), sin.double().repeat_interleave(2, -1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd].double(), x[..., -rd:].double()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), -1).flatten(-2)
    return torch.cat([nope, rope * cos + rotated * sin], -1)


def _partial_rope_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64).to(dtype)  # BSND, rope on the last 8
    angles = torch.rand(2, 5, 1, 4, generator=g, dtype=torch.float64) * 6
    return x, angles.cos(), angles.sin()


def test_inplace_partial_rotary_mul_is_v4s_partial_rope():
    x, cos, sin = _partial_rope_inputs()
    out = x.clone()
    result = torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(
        out, cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), rotary_mode="interleave",
        partial_slice=[8, 16])
    assert result is None  # in place
    torch.testing.assert_close(out, v4_partial_rope(x, cos, sin))
    assert torch.equal(out[..., :8], x[..., :8])


def test_inplace_partial_rotary_mul_mix_ups():
    x, cos, sin = _partial_rope_inputs()
    expected = v4_partial_rope(x, cos, sin)
    # the slice is [start, end) of the LAST dim: the first 8 channels are another rotation
    first = x.clone()
    torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(first, cos.repeat_interleave(2, -1),
                                                              sin.repeat_interleave(2, -1), partial_slice=[0, 8])
    assert not torch.allclose(first, expected)
    # r1 is cos, r2 sin
    swapped = x.clone()
    torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(swapped, sin.repeat_interleave(2, -1),
                                                              cos.repeat_interleave(2, -1), partial_slice=[8, 16])
    assert not torch.allclose(swapped, expected)
    # interleaved pairs, not halves: cos/sin duplicated per pair, not cat(angles, angles)
    halves = x.clone()
    torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(halves, torch.cat([cos, cos], -1),
                                                              torch.cat([sin, sin], -1), partial_slice=[8, 16])
    assert not torch.allclose(halves, expected)


def test_inplace_partial_rotary_mul_backward_is_the_transpose():
    x, cos, sin = _partial_rope_inputs()
    r1, r2 = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    leaf = x.clone().requires_grad_()
    ref = v4_partial_rope(leaf, cos, sin)
    grad = torch.randn_like(x)
    (expected,) = torch.autograd.grad(ref, leaf, grad)
    g = grad.clone()
    torch.ops.cann_ops_transformer.inplace_partial_rotary_mul_backward(g, r1, r2, partial_slice=[8, 16])
    torch.testing.assert_close(g, expected)


def test_inplace_partial_rotary_mul_bf16_rounds_once_and_refuses_bad_slices():
    x, cos, sin = _partial_rope_inputs(torch.bfloat16)
    out = x.clone()
    torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(
        out, cos.float().repeat_interleave(2, -1), sin.float().repeat_interleave(2, -1), partial_slice=[8, 16])
    assert torch.equal(out, v4_partial_rope(x, cos, sin).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="even length"):
        torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(x.clone(), cos, sin, partial_slice=[9, 16])
    with pytest.raises(RuntimeError, match="only supports 'interleave'"):
        torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(x.clone(), cos, sin, rotary_mode="half",
                                                                  partial_slice=[12, 16])


def v4_apply_gate(gate_up, limit, weight=None):
    """transformers DeepseekV4Experts._apply_gate in float64 (then the routed score, if any)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    y = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    return y if weight is None else y * weight.double().reshape(-1, 1)


def _gate_up(rows=12, width=16, dtype=torch.float64):
    g = torch.Generator().manual_seed(6)
    return (torch.randn(rows, width, generator=g, dtype=torch.float64) * 8).to(dtype)  # many values past the limit


def test_swiglu_group_is_v4s_clamped_gate_with_the_score():
    h = _gate_up()
    w = torch.rand(12, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.cann_ops_nn.swiglu_group(h, clamp_limit=10.0), v4_apply_gate(h, 10.0))
    torch.testing.assert_close(torch.ops.cann_ops_nn.swiglu_group(h, weight=w, clamp_limit=10.0),
                               v4_apply_gate(h, 10.0, w))
    # -1.0 disables the clamp; group_index counts the rows computed
    torch.testing.assert_close(torch.ops.cann_ops_nn.swiglu_group(h), v4_apply_gate(h, float("inf")))
    part = torch.ops.cann_ops_nn.swiglu_group(h, group_index=torch.tensor([3, 4]), clamp_limit=10.0)
    torch.testing.assert_close(part[:7], v4_apply_gate(h, 10.0)[:7])
    assert not part[7:].any()


def test_swiglu_group_mix_ups():
    h = _gate_up()
    # the gate is the FIRST half and is clamped above only; up is clamped on both sides
    y = torch.ops.cann_ops_nn.swiglu_group(h, clamp_limit=10.0)
    gate, up = h.chunk(2, -1)
    swapped = torch.nn.functional.silu(up.clamp(max=10.0)) * gate.clamp(-10.0, 10.0)
    assert not torch.allclose(y, swapped)
    symmetric = torch.nn.functional.silu(gate.clamp(-10.0, 10.0)) * up.clamp(-10.0, 10.0)
    assert not torch.allclose(y, symmetric)


def test_swiglu_group_backward_against_autograd():
    h = _gate_up()
    w = torch.rand(12, 1, dtype=torch.float64)
    leaves = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = v4_apply_gate(leaves[0], 10.0, leaves[1])
    grad = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, leaves, grad)
    y_origin = torch.ops.cann_ops_nn.swiglu_group(h, clamp_limit=10.0)  # without the weight (SwigluGroupFn)
    grad_x, grad_w = torch.ops.cann_ops_nn.swiglu_group_backward(grad, h, weight=w, y_origin=y_origin,
                                                                 clamp_limit=10.0)
    torch.testing.assert_close(grad_x, expected[0])
    torch.testing.assert_close(grad_w, expected[1])
    grad_x, empty = torch.ops.cann_ops_nn.swiglu_group_backward(grad, h, clamp_limit=10.0)
    torch.testing.assert_close(grad_x, torch.autograd.grad(v4_apply_gate(leaves[0], 10.0), leaves[0], grad)[0])
    assert empty.numel() == 0
    with pytest.raises(RuntimeError, match="provided together"):
        torch.ops.cann_ops_nn.swiglu_group_backward(grad, h, weight=w, clamp_limit=10.0)


def test_npu_clipped_swiglu_with_v4s_arguments():
    h = _gate_up()
    y = npu.npu_clipped_swiglu(h, alpha=1.0, limit=10.0, bias=0.0, interleaved=False)
    torch.testing.assert_close(y, v4_apply_gate(h, 10.0))
    # its defaults are gpt-oss's (alpha 1.702, limit 7, bias 1, interleaved pairs): another function
    assert not torch.allclose(npu.npu_clipped_swiglu(h), y)
    g = h.double()
    a, b = g[:, 0::2].clamp(max=7.0), g[:, 1::2].clamp(-7.0, 7.0)
    torch.testing.assert_close(npu.npu_clipped_swiglu(h), a * torch.sigmoid(1.702 * a) * (b + 1.0))
