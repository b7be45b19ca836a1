"""Training graphs: forward and backward fused together on the joint graph (docs/training.md).

Every test runs a compiled training step through the emulation backend (its partition_fn
runs the joint passes, then torchair's default_partition) next to the same step in eager,
and checks that the fused forward AND backward ops are in the graphs aot_autograd
compiles, and that the gradients of every parameter and input match eager.

Tolerances. The fused backward ops compute the gradient with the closed forms of torch_npu's
kernels (npu_rms_norm_backward: dx = (dy*g - xhat*mean(dy*g*xhat)) * rstd, in fp32),
where eager runs autograd's op-by-op derivative. Both are exact formulas evaluated in
another order, so in fp32 they differ by float rounding only; but dx is a difference of two
terms of the size of dy*g, and weight gradients are sums over every row, so the rounding
is absolute at the scale of the gradient tensor, not relative to each element (small
elements come from cancellation). Hence: within a few ulp of the tensor's largest
element (assert_close_at_scale). Unit modules (one fused op and its backward): 8 fp32
ulp at scale (measured: <= 1). Two-layer models, where the differences flow through
every matmul and token sum after them: 64 (measured: <= 11.5). bf16: the fused ops
compute in fp32 and round once where eager rounds after each bf16 op (the weight
multiply and its gradient sum), so a few bf16 ulps at scale: 4 for unit modules
(measured: <= 2), 8 for models (measured: <= 2.2).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import RecordingBackend, assert_close_at_scale, npu_ops
from npu_fx_fusion.capabilities import CAPABILITIES, has_backward
from npu_fx_fusion.config import PASS_NAMES
from npu_fx_fusion.pipeline import load_pass
from npu_fx_fusion.registry import pattern_set

HIDDEN = 64
# ulp of each gradient's dtype at its largest element (see the module docstring)
UNIT_ULPS = {torch.float32: 8, torch.bfloat16: 4}
MODEL_ULPS = {torch.float32: 64, torch.bfloat16: 8}


# ---- unit modules --------------------------------------------------------------------------
class HFNorm(nn.Module):
    """transformers LlamaRMSNorm."""

    def __init__(self, dim=HIDDEN, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SelfProductNorm(HFNorm):
    """litgpt's RMSNorm: the mean of x * x, the weight applied in fp32, one cast at the end."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class OneFactorDetachedNorm(HFNorm):
    """x * x.detach(): the forward of a mean of squares, but the gradient flows through one
    factor only, half a square's: not RMSNorm's backward."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(torch.mean(h * h.detach(), dim=-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class HFNormNpuCasts(HFNorm):
    """HFNorm with its casts spelled as torch_npu records `.to(dtype)` on an NPU; their
    backward is then torch_npu's `_npu_dtype_cast_backward`."""

    def forward(self, x):
        cast = torch.ops.npu._npu_dtype_cast
        h = cast(x, torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * cast(h, x.dtype)


class ResidualBlock(nn.Module):
    """x + proj(norm(x)): x has a user outside the norm, so autograd sums its gradient
    as add(add(residual grad, g_a), g_b), which only the accumulation canonicalisation
    (joint.canonicalize_grad_accumulation) lets the norm's pattern match, in fp32."""

    def __init__(self, norm_cls=HFNorm):
        super().__init__()
        self.norm = norm_cls()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.proj(self.norm(x))


class TorchRMSNorm(nn.Module):
    """torch.nn.RMSNorm (F.rms_norm, torchtitan)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)

    def forward(self, x):
        return self.norm(x)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HFRope(nn.Module):
    """q projection, then HF's apply_rotary_pos_emb (q is used three times by the rotation)."""

    def __init__(self, heads=2, seq=8, head_dim=32):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(HIDDEN, heads * head_dim, bias=False)
        angles = torch.arange(seq)[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None])
        self.register_buffer("sin", emb.sin()[None, None])

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos.to(q.dtype), self.sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin


class MLAQueryRope(nn.Module):
    """DeepSeek's query: one projection split into a nope and a rope part per head, the rope
    part rotated as complex pairs (torchtitan's apply_rotary_emb), the parts concatenated.
    The rope part's gradient is a slice of the concatenation's, so not contiguous."""

    def __init__(self, heads=2, seq=8, nope=16, rope=16):
        super().__init__()
        self.heads, self.nope, self.rope = heads, nope, rope
        self.q = nn.Linear(HIDDEN, heads * (nope + rope), bias=False)
        angles = torch.arange(seq)[:, None] * (1.0 / 10000 ** (torch.arange(0, rope, 2) / rope))
        # an attribute, not a buffer: Module.to(float32) would drop its imaginary part
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.nope + self.rope)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        pairs = torch.view_as_complex(q_pe.float().view(b, s, self.heads, -1, 2))
        q_pe = torch.view_as_real(pairs * self.freqs_cis[None, :, None]).flatten(3).type_as(q)
        return torch.cat([q_nope, q_pe], dim=-1)


class GateUpSwiGLU(nn.Module):
    """Phi-3's MLP: one gate_up projection, chunked, up * silu(gate)."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * F.silu(gate))


# ---- running a training step ---------------------------------------------------------------
def _seeded(cls, dtype, seed=0):
    torch.manual_seed(seed)
    return cls().to(dtype).train()


def _grads(module, x):
    named = {f"param {n}": p.grad for n, p in module.named_parameters() if p.requires_grad}
    if x.requires_grad:
        named["input x"] = x.grad
    return named


def _step(module, x, probe):
    out = module(x)
    (out.float() * probe).sum().backward()
    return out


def train_and_compare(cls, dtype=torch.float32, *, x_grad=True, frozen=(), config=None):
    """One compiled and one eager forward+backward; returns (report, fw graph, bw graph).

    Gradients of every parameter that requires grad, and of x when it does, must be
    equal within UNIT_ULPS at scale.
    """
    torch._dynamo.reset()
    model, reference = _seeded(cls, dtype), _seeded(cls, dtype)
    for module in (model, reference):
        for name, p in module.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
    torch.manual_seed(1)
    x = torch.randn(2, 8, HIDDEN, dtype=dtype)
    x_ref = x.clone()
    x.requires_grad_(x_grad)
    x_ref.requires_grad_(x_grad)
    backend = RecordingBackend(config)
    out = _step(torch.compile(model, backend=backend, fullgraph=True), x,
                probe := torch.randn(reference(x_ref).shape))
    out_ref = _step(reference, x_ref, probe)
    assert_close_at_scale(out, out_ref, UNIT_ULPS[dtype])
    grads, grads_ref = _grads(model, x), _grads(reference, x_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name] is not None, name
        assert_close_at_scale(grads[name], grads_ref[name], UNIT_ULPS[dtype])
    return backend.report, backend.graphs["forward"], backend.graphs["backward"]


# ---- unit modules: fused forward and backward, gradients equal eager ----------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fuses_forward_and_backward(dtype):
    report, fw, bw = train_and_compare(HFNorm, dtype)
    assert npu_ops(fw) == {"npu_rms_norm": 1}
    assert npu_ops(bw) == {"npu_rms_norm_backward": 1}
    joint = next(g for g in report.graphs if g.name == "joint")
    # every pass with joint patterns ran (moe_dispatch has some once torchtitan is loaded)
    sites = {r.pass_name: len(r.sites) for r in joint.passes}
    assert sites.pop("rms_norm") == 1 and {"rope", "swiglu"} <= set(sites) and not any(sites.values())
    assert report.counts["rms_norm"] == 1  # the forward-only pass afterwards found nothing left
    assert report.fused_ops == {"npu.npu_rms_norm": 1, "npu.npu_rms_norm_backward": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mean_of_self_products_trains_fused(dtype):
    # autograd differentiates x * x as two products summed; spelled as a square before it
    # traces (canonical.squares_as_powers), the backward is the joint form's
    report, fw, bw = train_and_compare(SelfProductNorm, dtype)
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}
    assert report.counts["rms_norm"] == 1


def test_a_product_with_a_detached_copy_is_not_a_square():
    report, _, bw = train_and_compare(OneFactorDetachedNorm)
    assert "npu_rms_norm_backward" not in npu_ops(bw)
    assert not report.fused_ops.get("npu.npu_rms_norm_backward")


def test_only_tensor_products_with_themselves_become_squares():
    from npu_fx_fusion.canonical import squares_as_powers

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def products(x, y):
        n = x.shape[0] * x.shape[0]  # a product of sizes (SymInts under dynamic=True): stays
        return x * x, x * y, torch.mul(y, y), x.mul(x) + n

    torch._dynamo.reset()
    x, y = torch.randn(3), torch.randn(3)
    torch.compile(products, backend=capture, dynamic=True)(x, y)
    (gm,) = graphs
    assert squares_as_powers(gm) == 3
    assert sum(n.target is torch.pow for n in gm.graph.nodes) == 3
    assert sum(n.op != "placeholder" and "mul" in str(n.target) for n in gm.graph.nodes) == 2  # x * y, n
    tensors = iter((x, y))
    inputs = [3 if isinstance(n.meta["example_value"], torch.SymInt) else next(tensors)
              for n in gm.graph.find_nodes(op="placeholder")]
    for got, want in zip(gm(*inputs), products(x, y)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_npu_spelled_casts_and_their_backward_match_joint():
    # bf16: the casts are real; in fp32 they vanish from the trace
    _, fw, bw = train_and_compare(HFNormNpuCasts, torch.bfloat16)
    assert npu_ops(fw) == {"npu_rms_norm": 1}
    assert npu_ops(bw) == {"npu_rms_norm_backward": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_needs_the_accumulation_canonicalisation(dtype):
    _, fw, bw = train_and_compare(ResidualBlock, dtype)
    assert npu_ops(fw) == {"npu_rms_norm": 1}
    assert npu_ops(bw) == {"npu_rms_norm_backward": 1}


def test_torch_rms_norm_module():
    _, fw, bw = train_and_compare(TorchRMSNorm)
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}


def test_input_without_grad_uses_the_weight_only_variant():
    # a frozen embedding feeding layer 0: only the weight needs a gradient
    report, fw, bw = train_and_compare(HFNorm, x_grad=False)
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}


def test_frozen_weight():
    _, fw, bw = train_and_compare(ResidualBlock, frozen={"norm.weight"})
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}


class NormPicksIndices(nn.Module):
    """The norm's output only picks indices (top-k), so no gradient flows through it, while
    its input has one from elsewhere: DeepSeek-V4's indexer (its kv_norm and ropes)."""

    def __init__(self):
        super().__init__()
        self.norm = HFNorm()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return self.proj(x).gather(-1, self.norm(x).topk(4, dim=-1).indices)


def test_a_site_no_gradient_flows_through_fuses_forward_only_in_the_joint_graph():
    report, fw, bw = train_and_compare(NormPicksIndices, frozen={"norm.weight"})
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {}
    joint = next(g for g in report.graphs if g.name == "joint")
    (norm,) = [r for r in joint.passes if r.pass_name == "rms_norm"]
    # fused where it is, in the joint graph: no near miss there, nothing left afterwards
    assert len(norm.sites) == 1 and norm.near_misses == []
    assert report.counts["rms_norm"] == 1 and report.near_misses == []


class NormBesideAProjection(nn.Module):
    """The norm's input also feeds a projection, and the model adds the two: in fp32 the
    input's gradient sums the projection's and the norm's two terms in whatever order
    autograd meets them, which the operand order decides."""

    def __init__(self, projection_first=False):
        super().__init__()
        self.norm = HFNorm()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.projection_first = projection_first

    def forward(self, x):
        return self.proj(x) + self.norm(x) if self.projection_first else self.norm(x) + self.proj(x)


class ProjectionFirst(NormBesideAProjection):
    def __init__(self):
        super().__init__(projection_first=True)


@pytest.mark.parametrize("cls", [NormBesideAProjection, ProjectionFirst], ids=["norm + proj", "proj + norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_trains_fused_whatever_the_order_of_its_inputs_other_consumers(cls, dtype):
    # canonical.canonicalize_grad_accumulation sums the norm's own two terms first (a subtree,
    # as in the pattern's trace) however autograd ordered the projection's between them
    report, fw, bw = train_and_compare(cls, dtype)
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}
    assert report.near_misses == []


class AuxiliaryLossScaler(torch.autograd.Function):
    """Passes the output through and seeds the auxiliary loss's gradient with ones in the
    backward, as torchtitan-npu's DSAIndexerLossAutoScaler (after Megatron-LM's) does."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


class NormReadByAnAuxiliaryLoss(nn.Module):
    """The norm feeds an auxiliary loss only (DeepSeek-V4's indexer compressor norm): its
    output's gradient is computed from the seeded ones, from no tangent of the graph."""

    def __init__(self):
        super().__init__()
        self.norm = HFNorm()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        aux_loss = torch.log_softmax(self.norm(x) @ self.proj.weight, -1).float().mean()
        return AuxiliaryLossScaler.apply(self.proj(x), aux_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_whose_gradient_no_tangent_computes_trains_fused(dtype):
    # fp32: the input's gradient also sums the projection's term, which autograd meets
    # between the norm's two (canonicalize_grad_accumulation keeps the norm's sum a subtree)
    report, fw, bw = train_and_compare(NormReadByAnAuxiliaryLoss, dtype)
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}
    assert report.near_misses == []


@pytest.mark.parametrize("cls", [NormBesideAProjection, ProjectionFirst, NormReadByAnAuxiliaryLoss],
                         ids=["norm + proj", "proj + norm", "auxiliary loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gradient_sums_hold_under_dynamic_shapes(cls, dtype):
    # one symbolic graph, two batch / sequence sizes: fused forward and backward, eager's gradients
    torch._dynamo.reset()
    model, reference = _seeded(cls, dtype), _seeded(cls, dtype)
    backend = RecordingBackend(None)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for shape in ((2, 8), (3, 5)):
        torch.manual_seed(1)
        x = torch.randn(*shape, HIDDEN, dtype=dtype)
        x, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        probe = torch.randn(reference(x_ref).shape)
        _step(compiled, x, probe)
        _step(reference, x_ref, probe)
        assert_close_at_scale(x.grad, x_ref.grad, UNIT_ULPS[dtype])
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        assert_close_at_scale(p.grad, p_ref.grad, UNIT_ULPS[dtype])
    assert npu_ops(backend.graphs["forward"]) == {"npu_rms_norm": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_rms_norm_backward": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_fuses_forward_and_backward(dtype):
    _, fw, bw = train_and_compare(HFRope, dtype)
    assert npu_ops(fw) == {"npu_rotary_mul": 1}
    assert npu_ops(bw) == {"npu_rotary_mul_backward": 1}


def test_rope_of_a_split_query_fuses_forward_and_backward():
    # the copy autograd makes of the sliced gradient sits above the pattern's tangent once
    # joint.hoist_contiguous_copies moved it
    _, fw, bw = train_and_compare(MLAQueryRope)
    assert npu_ops(fw) == {"npu_rotary_mul": 1}
    assert npu_ops(bw) == {"npu_rotary_mul_backward": 1}


def test_a_gradient_copied_for_a_reshape_is_spelled_as_the_copy_and_a_view():
    # canonical.gradient_copies_apart: the einsum hands the matmul a permuted gradient, upcast
    # (the forward's .float()); its backward copies it before the reshape. The rewrite leaves
    # a plain view of a contiguous copy, the copy moved above the cast, and the forward alone
    from torch._inductor import pattern_matcher as pm

    from npu_fx_fusion.canonical import gradient_copies_apart, is_backward

    aten = torch.ops.aten

    def fn(p, v, w):
        return torch.einsum("bhsd,hde->bse", (p @ v).float(), w)

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 3, 5, 5, generator=g).bfloat16().requires_grad_(), torch.randn(
        2, 3, 5, 4, generator=g).bfloat16().requires_grad_(), torch.randn(3, 4, 6, generator=g).requires_grad_()]
    gm = pm.joint_fwd_bwd(fn, args, get_decomp_fn=dict)
    before = copy.deepcopy(gm)

    def copied_views(graph):  # (backward _unsafe_views of a clone, forward ones)
        found = [n for n in graph.nodes
                 if n.target is aten._unsafe_view.default and n.args[0].target is aten.clone.default]
        return sum(map(is_backward, found)), sum(not is_backward(n) for n in found)

    assert copied_views(gm.graph)[0] >= 1
    forward = [(n.name, n.target) for n in gm.graph.nodes if not is_backward(n)]
    assert gradient_copies_apart(gm.graph) >= 2
    gm.recompile()
    assert copied_views(gm.graph) == (0, copied_views(before.graph)[1])
    assert [(n.name, n.target) for n in gm.graph.nodes if not is_backward(n)] == forward
    (cast,) = [n for n in gm.graph.nodes if is_backward(n) and n.target is aten._to_copy.default]
    assert cast.args[0].target is aten.clone.default and all(u.target is aten.view.default for u in cast.users)
    inputs = [a.detach() for a in args] + [torch.randn(2, 5, 6, generator=g)]
    for old, new in zip(torch.fx.Interpreter(before).run(*inputs), torch.fx.Interpreter(gm).run(*inputs)):
        assert torch.equal(old, new)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _two_ropes(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _two_norms(x, y, w):
    def norm(h):
        h32 = h.float()
        return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    return norm(x), norm(y)


def test_a_joint_graph_that_does_not_partition_is_compiled_unfused(monkeypatch, tmp_path):
    # a partitioner that fails on the fused graph (as torchair's default_partition did on a
    # backward op placed among forward ones): the compile must still succeed, unfused
    # there, and say why
    from torch._functorch import partitioners

    partition = partitioners.default_partition

    def fails_on_fused_graphs(gm, *args, **kwargs):
        if npu_ops(gm):
            raise AssertionError("Node getitem_7 was invalid, but is output")
        return partition(gm, *args, **kwargs)

    monkeypatch.setattr(partitioners, "default_partition", fails_on_fused_graphs)
    torch._dynamo.reset()
    inputs = [torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 4, 8, 16, requires_grad=True),
              torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)]
    # (with dumps, the joint graph's report is written, its costs read, before the partition)
    backend = RecordingBackend(nff.FusionConfig(enable={"rope"}, dump_dir=str(tmp_path)))
    q, k = torch.compile(_two_ropes, backend=backend, fullgraph=True)(*inputs)
    (q.sum() + k.sum()).backward()
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    (error,) = [r.error for r in joint.passes if r.error]
    assert "was invalid, but is output" in error
    # its cost after is the unfused graph's it was put back to, not the fused one's read before
    assert joint.cost_after == joint.cost_before
    reverted = [m.reason for r in joint.passes for m in r.near_misses if m.reason.startswith("fused, then reverted")]
    assert len(reverted) == 2 and not any(r.sites for r in joint.passes)
    # the forward-only pass after partitioning fuses the forward halves instead
    assert npu_ops(backend.graphs["forward"]) == {"npu_rotary_mul": 2}
    q_ref, k_ref = _two_ropes(*[t.detach() for t in inputs])
    torch.testing.assert_close(q, q_ref)


class RotateHalfThenTranspose(nn.Module):
    """olmo-core's RoPE reduced to its layouts: a tensor read twice (t * c, and a rotate_half
    of it), the sum transposed out. The first read's gradient comes back through the
    transpose (transposed strides), rotate_half's through its cat (contiguous), and the
    view of the projection's output takes their sum."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        t = self.proj(x).view(*x.shape[:2], 4, HIDDEN // 4)
        return (t * 2 + _rotate_half(t)).transpose(1, 2).contiguous()


def test_a_gradient_sum_refolded_into_another_layout_keeps_its_views_valid():
    # canonicalize_grad_accumulation puts t * 2's gradient (transposed) before rotate_half's
    # (contiguous): the sum is then laid out transposed, and the backward's view of it, traced
    # for the contiguous sum, fails at run time unless it becomes a reshape (olmo-core's
    # training step crashed so)
    report, _, bw = train_and_compare(RotateHalfThenTranspose)
    assert report.errors == []
    assert any(n.target is torch.ops.aten.reshape.default for n in bw.graph.nodes)


@pytest.mark.parametrize("case", ["ropes", "norms"])
def test_two_fused_sites_returned_together_train(case):
    # a graph break after the rotary embedding returns both sites from one graph: the
    # first site's backward op must not stay among the forward nodes the default
    # partitioner takes (accept.backward_after_forward)
    torch._dynamo.reset()
    torch.manual_seed(0)
    if case == "ropes":
        fn, op = _two_ropes, "npu_rotary_mul"
        inputs = [torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(1, 1, 8, 16),
                  torch.randn(1, 1, 8, 16)]
        grads = [True, True, False, False]
    else:
        fn, op = _two_norms, "npu_rms_norm"
        inputs = [torch.randn(2, 8, HIDDEN), torch.randn(2, 8, HIDDEN), torch.randn(HIDDEN)]
        grads = [True, True, True]
    fused = [t.clone().requires_grad_(g) for t, g in zip(inputs, grads)]
    eager = [t.clone().requires_grad_(g) for t, g in zip(inputs, grads)]
    backend = RecordingBackend(nff.FusionConfig())
    outs = torch.compile(fn, backend=backend, fullgraph=True)(*fused)
    outs_ref = fn(*eager)
    probes = [torch.randn(o.shape) for o in outs]
    sum(((o * p).sum() for o, p in zip(outs, probes))).backward()
    sum(((o * p).sum() for o, p in zip(outs_ref, probes))).backward()
    assert backend.report.errors == []
    assert npu_ops(backend.graphs["forward"]) == {op: 2}
    assert npu_ops(backend.graphs["backward"]) == {f"{op}_backward": 2}
    for out, out_ref in zip(outs, outs_ref):
        assert_close_at_scale(out, out_ref, UNIT_ULPS[torch.float32])
    for a, b in zip(fused, eager):
        if a.requires_grad:
            assert_close_at_scale(a.grad, b.grad, UNIT_ULPS[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_fuses_forward_and_backward(dtype):
    _, fw, bw = train_and_compare(GateUpSwiGLU, dtype)
    assert npu_ops(fw) == {"npu_swiglu": 1}
    assert npu_ops(bw) == {"npu_swiglu_backward": 1}


class NormThenSeparateSwiGLU(nn.Module):
    """An RMSNorm (fuses in the joint graph) before a Llama MLP (gate and up projections
    apart: a swiglu near miss there)."""

    def __init__(self, dim=HIDDEN):
        super().__init__()
        self.norm = HFNorm(dim)
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return F.silu(self.gate(h)) * self.up(h)


def test_a_pass_done_in_the_joint_graph_skips_its_parts_and_one_with_a_near_miss_does_not():
    # merged_projections off: its projections stay separate, a swiglu near miss in the joint graph
    report, fw, bw = train_and_compare(NormThenSeparateSwiGLU, config=nff.FusionConfig(disable={"merged_projections"}))
    assert npu_ops(fw) == {"npu_rms_norm": 1} and npu_ops(bw) == {"npu_rms_norm_backward": 1}
    joint, forward, backward = (next(g for g in report.graphs if g.name == name)
                                for name in ("joint", "forward", "backward"))
    joint_results = {r.pass_name: r for r in joint.passes}
    assert len(joint_results["rms_norm"].sites) == 1 and joint_results["swiglu"].near_misses
    for part in (forward, backward):
        results = {r.pass_name: r for r in part.passes}
        # rms_norm fused every candidate of the joint graph: not searched again
        assert results["rms_norm"].skipped == "done in the joint graph this graph was split from"
        # swiglu refused a site there: it runs again (a refused site may fuse forward-only)
        assert results["swiglu"].skipped is None
        # a pass with nothing to match on joint graphs runs after partitioning, as before
        assert results["add_rms_norm"].skipped is None
    assert any(m.pass_name == "swiglu" for r in forward.passes for m in r.near_misses)


def test_disabled_pass_does_not_run_on_the_joint_graph():
    report, fw, bw = train_and_compare(HFNorm, config=nff.FusionConfig(disable={"rms_norm"}))
    assert npu_ops(fw) == {} and npu_ops(bw) == {}
    joint = next(g for g in report.graphs if g.name == "joint")
    assert "rms_norm" not in [r.pass_name for r in joint.passes]


# ---- a tiny torchtitan llama3 and HF llama training step -----------------------------------
def _training_step_matches_eager(tm, dtype):
    model = tm.model.train()
    reference = copy.deepcopy(model)
    (ids,) = tm.example_inputs
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))

    def loss_of(module):
        return module(ids).float().pow(2).mean()

    loss, loss_ref = loss_of(compiled), loss_of(reference)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=4 * torch.finfo(dtype).eps * loss_ref.item())
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        try:
            assert_close_at_scale(p.grad, p_ref.grad, MODEL_ULPS[dtype])
        except AssertionError as exc:
            raise AssertionError(f"{name}.grad: {exc}") from None
    opt.step()
    opt_ref.step()
    with torch.no_grad():  # the loss after the step: the parameters moved alike
        after, after_ref = loss_of(compiled), loss_of(reference)
    torch.testing.assert_close(after, after_ref, rtol=0, atol=4 * torch.finfo(dtype).eps * after_ref.item())
    return backend


def test_torchtitan_llama3_training_step():
    from npu_fx_fusion.tiny_models import build_torchtitan

    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_torchtitan("llama3", dtype=torch.float32, num_layers=2)
    backend = _training_step_matches_eager(tm, torch.float32)
    # 2 blocks x (attention norm, ffn norm) + the final norm; q and k rotated per block. Every
    # norm but the first folds the residual add in front of it, keeping the rstd its backward reads.
    # FeedForward's w1 and w3 are one linear on their concatenated weights (merged_projections),
    # so each block's SwiGLU fuses too
    assert npu_ops(backend.graphs["forward"]) == {"npu_rms_norm": 1, "npu_add_rms_norm": 4, "npu_rotary_mul": 4,
                                                  "npu_swiglu": 2}
    assert npu_ops(backend.graphs["backward"]) == {"npu_rms_norm_backward": 5, "npu_rotary_mul_backward": 4,
                                                   "npu_swiglu_backward": 2}
    assert backend.report.errors == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_llama_training_step(dtype):
    from npu_fx_fusion.tiny_models import build_hf

    pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_hf("llama", dtype=dtype, num_layers=2)
    backend = _training_step_matches_eager(tm, dtype)
    # gate_proj and up_proj merged per step (merged_projections): the SwiGLU fuses as Phi-3's does
    assert npu_ops(backend.graphs["forward"]) == {"npu_rms_norm": 1, "npu_add_rms_norm": 4, "npu_rotary_mul": 4,
                                                  "npu_swiglu": 2}
    assert npu_ops(backend.graphs["backward"]) == {"npu_rms_norm_backward": 5, "npu_rotary_mul_backward": 4,
                                                   "npu_swiglu_backward": 2}


def test_hf_phi3_training_step_fuses_swiglu():
    from npu_fx_fusion.tiny_models import build_hf

    pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = _training_step_matches_eager(build_hf("phi3", dtype=torch.float32, num_layers=2), torch.float32)
    # Phi-3's fused gate_up projection: up * silu(gate) on its two halves
    assert npu_ops(backend.graphs["forward"]) == {
        "npu_rms_norm": 1, "npu_add_rms_norm": 4, "npu_rotary_mul": 4, "npu_swiglu": 2}
    assert npu_ops(backend.graphs["backward"]) == {
        "npu_rms_norm_backward": 5, "npu_rotary_mul_backward": 4, "npu_swiglu_backward": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_joint_site_of_a_training_step_verifies(dtype):
    """FusionConfig(verify=True) on the joint graph: each site's forward outputs and
    gradients, from the matched nodes and from the fused op and its backward, on the
    same random inputs and incoming gradients (verify.verify_joint_match)."""
    from npu_fx_fusion.tiny_models import build_hf

    pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_hf("phi3", dtype=dtype, num_layers=2)
    backend = RecordingBackend(nff.FusionConfig(verify=True))
    (ids,) = tm.example_inputs
    torch.compile(tm.model.train(), backend=backend)(ids).float().pow(2).mean().backward()
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    sites = [site for result in joint.passes for site in result.sites]
    assert len(sites) == 5 + 4 + 2
    assert all(site.verified.startswith("verified: max error") for site in sites), [s.verified for s in sites]
    assert npu_ops(backend.graphs["backward"]) == {
        "npu_rms_norm_backward": 5, "npu_rotary_mul_backward": 4, "npu_swiglu_backward": 2}


def test_torchtitan_deepseek_v3_training_step_is_as_accurate_as_eager():
    """MLA + MoE: the norms (MLA's kv_norm too), the q and k ropes, the router
    (npu_moe_gating_top_k) and the routed experts block (npu_moe_token_permute /
    unpermute) fuse with their backward.

    Its MoE layer makes the fp32 gradients ill-conditioned: eager itself is up to ~16000
    ulp at scale away from a float64 run in the expert weight gradients. So each gradient
    is compared with float64 instead: the fused step's error is at most three times
    eager's (or 64 ulp at scale, for gradients eager gets nearly exact). Measured: at most
    2.3x (layer 0's w1: 87 against eager's 38 ulp, the same with moe_gating off, so the
    norms' and ropes' rounding, not the router's); the router gate 8.6 against 9.8.
    """
    from helpers import ulp
    from npu_fx_fusion.tiny_models import build_torchtitan

    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_torchtitan("deepseek_v3", dtype=torch.float32, num_layers=2)
    model = tm.model.train()
    (ids,) = tm.example_inputs
    # DeepSeek-V3's own router (sigmoid, node-limited groups, route_norm; the debugmodel
    # has a softmax one), which trains through npu_moe_gating_top_k
    router = model.layers["1"].moe.router
    router.score_func, router.num_expert_groups, router.num_limited_groups = "sigmoid", 2, 1
    router.route_norm, router.route_scale = True, 2.5
    reference, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    # the passes whose ops have a backward; grouped_matmul stays forward-only. On the CPU
    # trace: in the NPU graph SDPA is the FA-v3 stand-in, whose fp32 rounding (as close to
    # float64 as CPU's flash attention, 1.4e-7 against 1.2e-7 here) moves the near-tied
    # routing of this ill-conditioned MoE, and the forward alone then differs from float64
    # 10x more than eager does, passes or not; the NPU graph's fusions are compared with its
    # unfused compile in test_torchtitan_deepseek_v3_trains_the_same_fused_on_the_npu_graph.
    backend = RecordingBackend(nff.FusionConfig(enable={"rms_norm", "rope", "swiglu", "moe_dispatch",
                                                         "moe_gating"}, npu_dispatch=False))
    for module in (torch.compile(model, backend=backend), reference, exact):
        module(ids).double().pow(2).mean().backward()
    assert backend.report.errors == []
    forward, backward = npu_ops(backend.graphs["forward"]), npu_ops(backend.graphs["backward"])
    # 2 layers x (attention_norm, kv_norm, ffn_norm) + the final norm
    assert forward["npu_rms_norm"] == 7 and backward["npu_rms_norm_backward"] == 7
    # q's and k's ropes (q's gradient arrives as a slice of q's: joint.hoist_contiguous_copies)
    assert forward["npu_rotary_mul"] == 4 and backward["npu_rotary_mul_backward"] == 4
    # the routed experts block of layer 1: permute / unpermute, and their grads
    assert forward["npu_moe_token_permute"] == forward["npu_moe_token_unpermute"] == 1
    assert backward["npu_moe_token_permute_grad_v2"] == backward["npu_moe_token_unpermute_grad_v2"] == 1
    # and its router
    assert forward["npu_moe_gating_top_k"] == backward["npu_moe_gating_top_k_backward"] == 1
    for (name, p), p_ref, p_exact in zip(model.named_parameters(), reference.parameters(), exact.parameters()):
        spacing = ulp(p_ref.grad.abs().max().reshape(1)).double().item()
        fused_error = (p.grad.double() - p_exact.grad).abs().max().item()
        eager_error = (p_ref.grad.double() - p_exact.grad).abs().max().item()
        assert fused_error <= max(3 * eager_error, 64 * spacing), (name, fused_error, eager_error, spacing)


def test_torchtitan_deepseek_v3_trains_the_same_fused_on_the_npu_graph():
    """The same training step on the graph an NPU compile holds (the default): the fused
    step's gradients against the NPU graph compiled without the passes (what the NPU runs
    unfused), within the bound above, and the same fused ops in forward and backward."""
    from helpers import ulp
    from npu_fx_fusion.tiny_models import build_torchtitan

    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_torchtitan("deepseek_v3", dtype=torch.float32, num_layers=2)
    model = tm.model.train()
    (ids,) = tm.example_inputs
    router = model.layers["1"].moe.router
    router.score_func, router.num_expert_groups, router.num_limited_groups = "sigmoid", 2, 1
    router.route_norm, router.route_scale = True, 2.5
    unfused, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    backend = RecordingBackend(nff.FusionConfig(enable={"rms_norm", "rope", "swiglu", "moe_dispatch", "moe_gating"}))
    plain = RecordingBackend(nff.FusionConfig(enable=set()))
    for module in (torch.compile(model, backend=backend), torch.compile(unfused, backend=plain), exact):
        module(ids).double().pow(2).mean().backward()
    assert backend.report.errors == [] and backend.report.graph_source.startswith("NPU graph")
    forward, backward = npu_ops(backend.graphs["forward"]), npu_ops(backend.graphs["backward"])
    assert forward["npu_rms_norm"] == 7 and backward["npu_rms_norm_backward"] == 7
    assert forward["npu_rotary_mul"] == 4 and backward["npu_rotary_mul_backward"] == 4
    assert forward["npu_moe_token_permute"] == forward["npu_moe_token_unpermute"] == 1
    assert forward["npu_moe_gating_top_k"] == backward["npu_moe_gating_top_k_backward"] == 1
    # torch_npu's own FlashAttention, unfused, in both
    for recorded in (backend, plain):
        ops = recorded.report.graphs[-1].ops_before
        assert ops["npu.npu_fusion_attention_grad_v3.default"] == 2
    for (name, p), p_ref, p_exact in zip(model.named_parameters(), unfused.parameters(), exact.parameters()):
        spacing = ulp(p_ref.grad.abs().max().reshape(1)).double().item()
        fused_error = (p.grad.double() - p_exact.grad).abs().max().item()
        unfused_error = (p_ref.grad.double() - p_exact.grad).abs().max().item()
        assert fused_error <= max(3 * unfused_error, 64 * spacing), (name, fused_error, unfused_error, spacing)


# ---- limits ----------------------------------------------------------------------------------
def _dynamic_step(cls, dims):
    """One compiled training step with `dims` of x marked dynamic, next to eager: the output
    and the gradients within UNIT_ULPS at scale, as train_and_compare's."""
    torch._dynamo.reset()
    model, reference = _seeded(cls, torch.float32), _seeded(cls, torch.float32)
    backend = RecordingBackend()
    torch.manual_seed(1)
    x = torch.randn(2, 8, HIDDEN)
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    for dim in dims:
        torch._dynamo.mark_dynamic(x, dim)
    probe = torch.randn(2, 8, HIDDEN)
    out = _step(torch.compile(model, backend=backend, fullgraph=True), x, probe)
    assert_close_at_scale(out, _step(reference, x_ref, probe), UNIT_ULPS[torch.float32])
    grads, grads_ref = _grads(model, x), _grads(reference, x_ref)
    assert grads.keys() == grads_ref.keys() == {"param weight", "input x"}
    for name in grads:
        assert_close_at_scale(grads[name], grads_ref[name], UNIT_ULPS[torch.float32])
    return backend


@pytest.mark.parametrize("dims", [(1,), (0, 1)], ids=["sequence", "batch-and-sequence"])
def test_dynamic_sizes_fuse_forward_and_backward(dims):
    # the backward's size lists hold one SymInt per dynamic size (expand(g, [s0, s1, 64])):
    # the exact retrace takes each as an input (accept._exact_match), however many there are
    backend = _dynamic_step(HFNorm, dims)
    assert npu_ops(backend.graphs["forward"]) == {"npu_rms_norm": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_rms_norm_backward": 1}
    inputs = [n.meta["val"] for n in backend.graphs["forward"].graph.find_nodes(op="placeholder")]
    symbols = {s.node.expr for v in inputs if isinstance(v, torch.Tensor) for s in v.shape
               if isinstance(s, torch.SymInt)}
    assert len(symbols) == len(dims)  # the sizes really are symbolic in the fused graph


def test_no_joint_pattern_emits_an_op_without_backward():
    """A joint replacement is traced with autograd: an op without a backward would fail
    the compile. Checked over every pass's registered joint forms."""
    registered = 0
    for name in PASS_NAMES:
        fusion_pass = load_pass(name)
        if fusion_pass is None or not fusion_pass.differentiable:
            continue
        patterns = pattern_set(fusion_pass)
        for form in patterns.joint_forms:
            ops = patterns.emitted_ops[form]
            assert ops and all(has_backward(op) for op in ops), (name, form, ops)
            registered += 1
    assert registered > 0
    rope = pattern_set(load_pass("rope"))
    # npu_interleave_rope (inference only) is never emitted joint, its rotary_mul fallbacks are
    assert "even_odd_pairs" in {form.name for form in rope.joint_forms}
    assert not any("npu.npu_interleave_rope" in rope.emitted_ops[f] for f in rope.joint_forms)


def test_a_form_whose_op_has_no_backward_gets_no_joint_pattern(monkeypatch):
    import dataclasses

    from npu_fx_fusion.matching import FusionPass

    swiglu = load_pass("swiglu")
    monkeypatch.setitem(CAPABILITIES, "npu.npu_swiglu",
                        dataclasses.replace(CAPABILITIES["npu.npu_swiglu"], backward=None))
    twin = FusionPass(name="swiglu", fused_op=swiglu.fused_op, forms=swiglu.forms, example=swiglu.example,
                      check=swiglu.check, anchor=swiglu.anchor, explain=swiglu.explain,
                      differentiable=("x",))
    assert pattern_set(twin).joint == () and pattern_set(twin).joint_forms == ()


def test_torchtitan_moe_block_trains_through_permute_and_unpermute():
    """torchtitan's MoE layer: its dispatch and combine become npu_moe_token_permute /
    unpermute on the joint graph (init_routing / finalize, the inference form, have no
    backward), and the backward graph holds their grad ops. The rows reach the same bf16
    expert GEMMs in the same order (both sorts are stable), so the gradients agree to the
    summation order of each token's k rows."""
    from helpers import torchtitan_moe

    backend = _moe_training_step(torchtitan_moe().train(), nff.FusionConfig(enable={"moe_dispatch"}))
    assert npu_ops(backend.graphs["forward"]) == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_moe_token_permute_grad_v2": 1,
                                                   "npu_moe_token_unpermute_grad_v2": 1}


# ---- the MoE router --------------------------------------------------------------------------
def _moe_training_step(model, config, loss=lambda out: out.pow(2).mean()):
    """One compiled and one eager step of a torchtitan MoE module; returns the backend.
    Every input and parameter gradient within 4 ulp at scale (each token's k rows are
    summed in another order)."""
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    torch.manual_seed(2)
    x = torch.randn(2, 24, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    backend = RecordingBackend(config)
    loss(torch.compile(model, backend=backend)(x)).backward()
    loss(reference(x_ref)).backward()
    assert backend.report.errors == []
    assert_close_at_scale(x.grad, x_ref.grad, 4)
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        assert_close_at_scale(p.grad, p_ref.grad, 4)
    return backend


def test_torchtitan_deepseek_router_trains_through_npu_moe_gating_top_k():
    """DeepSeek-V3's router (sigmoid, expert bias, node-limited groups, route_norm) becomes
    npu_moe_gating_top_k(out_flag=True) on the joint graph, and its backward
    npu_moe_gating_top_k_backward. Its full scores (norm_out) leave the router only for
    their shape, as in torchtitan; its ids and weights only into the fused permute /
    unpermute, which do not depend on the order of each token's k experts. Gradients
    within 4 fp32 ulp at scale (the quotient rule evaluated in another order)."""
    from helpers import TORCHTITAN_DEEPSEEK_ROUTER, torchtitan_moe

    torch.manual_seed(0)
    backend = _moe_training_step(torchtitan_moe(num_experts=16, **TORCHTITAN_DEEPSEEK_ROUTER).train(),
                                 nff.FusionConfig(enable={"moe_dispatch", "moe_gating"}))
    assert npu_ops(backend.graphs["forward"]) == {
        "npu_moe_gating_top_k": 1, "npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}
    assert npu_ops(backend.graphs["backward"]) == {
        "npu_moe_gating_top_k_backward": 1, "npu_moe_token_permute_grad_v2": 1,
        "npu_moe_token_unpermute_grad_v2": 1}


def test_softmax_router_does_not_train_through_the_fused_op():
    # torchtitan's debugmodel router: softmax + expert bias; the op's backward has no softmax mode
    from helpers import torchtitan_moe

    torch.manual_seed(0)
    backend = _moe_training_step(torchtitan_moe().train(), nff.FusionConfig(enable={"moe_dispatch", "moe_gating"}))
    assert "npu_moe_gating_top_k" not in npu_ops(backend.graphs["forward"])
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    (gating,) = [r for r in joint.passes if r.pass_name == "moe_gating"]
    assert gating.sites == []
    assert any("sigmoid mode only" in m.reason for m in gating.near_misses)


class _MoEWithBalanceLoss(nn.Module):
    """torchtitan's MoE forward, plus a switch-style load-balancing loss over the router's
    full scores: those scores then carry a gradient of their own."""

    def __init__(self):
        from helpers import TORCHTITAN_DEEPSEEK_ROUTER, torchtitan_moe

        super().__init__()
        self.moe = torchtitan_moe(num_experts=16, **TORCHTITAN_DEEPSEEK_ROUTER)

    def forward(self, x):
        top_scores, ids, scores = self.moe.router(x, self.moe.expert_bias_E)
        counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=(0, 1))
        out = self.moe.routed_experts(x, top_scores, ids, counts)
        return out, (scores.mean(dim=(0, 1)) * counts).sum()


def test_router_whose_scores_have_a_gradient_is_not_fused():
    """torch_npu's norm_out carries no gradient: fusing this router would drop the
    balance loss's gradient. Nothing matches, and the report says why."""
    torch.manual_seed(0)
    backend = _moe_training_step(_MoEWithBalanceLoss().train(), nff.FusionConfig(enable={"moe_dispatch", "moe_gating"}),
                                 loss=lambda out: out[0].pow(2).mean() + 0.1 * out[1])
    assert npu_ops(backend.graphs["forward"]) == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    (gating,) = [r for r in joint.passes if r.pass_name == "moe_gating"]
    assert gating.sites == []
    assert any("gradient of their own" in m.reason for m in gating.near_misses)


# ---- transformers' MoE blocks ------------------------------------------------------------------
@pytest.mark.parametrize("dtype, weights_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16 rows, fp32 weights (DeepSeek)"])
def test_transformers_experts_block_trains_through_permute_and_unpermute(dtype, weights_dtype):
    """transformers' grouped_mm experts block: on the joint graph it becomes
    npu_moe_token_permute / unpermute around the grouped GEMMs (init_routing / finalize have
    no backward). Its sort is not stable, permute's is: the rows of one expert come in
    another order, each computed alone, so the block's output and every gradient are the
    same up to the order of the k-row sums: 4 ulp at scale, in the rows' precision (fp32
    routing weights get their gradient from bf16 rows)."""
    from test_moe_dispatch import GroupedMmExperts, _routing

    pytest.importorskip("transformers.integrations.moe")  # registers its fp32 grouped_mm op
    torch._dynamo.reset()
    x, ids, weights = _routing(dtype, weights_dtype=weights_dtype)
    model = GroupedMmExperts(dtype).train()
    reference = copy.deepcopy(model)
    inputs = [x.requires_grad_(True), ids, weights.requires_grad_(True)]
    inputs_ref = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    backend = RecordingBackend(nff.FusionConfig(enable={"moe_dispatch", "swiglu", "grouped_matmul"}))
    probe = torch.randn(x.shape)
    _step_inputs = lambda module, args: (module(*args).float() * probe).sum().backward()  # noqa: E731
    _step_inputs(torch.compile(model, backend=backend), inputs)
    _step_inputs(reference, inputs_ref)
    assert backend.report.errors == []
    assert npu_ops(backend.graphs["forward"]) == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1,
                                                  "npu_grouped_matmul": 2, "npu_swiglu": 1}
    assert npu_ops(backend.graphs["backward"]) == {
        "npu_moe_token_permute_grad_v2": 1, "npu_moe_token_unpermute_grad_v2": 1, "npu_grouped_matmul": 4,
        "npu_swiglu_backward": 1}
    for got, want in [(inputs[0].grad, inputs_ref[0].grad), (inputs[2].grad, inputs_ref[2].grad),
                      *[(p.grad, p_ref.grad) for p, p_ref in zip(model.parameters(), reference.parameters())]]:
        # fp32 routing weights get their gradient from the bf16 rows (measured: 0.5 bf16 ulp)
        assert_close_at_scale(got, want, 4, precision=dtype)


@pytest.mark.parametrize("name, dtype", [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16),
                                         ("deepseek_v3", torch.float32)])
def test_hf_moe_training_step(name, dtype):
    """Every routed block trains fused: dispatch and combine (permute / unpermute), the
    expert GEMMs (grouped_matmul's rule) and their swiglu, and DeepSeek's sigmoid router;
    Qwen's softmax router stays unfused (the op's backward has a sigmoid mode only).
    bf16 DeepSeek is left out: a 1-ulp change of its layer-0 weights alone moves eager's
    router-gate gradient by ~1e5 ulp at scale (routing flips), so no tolerance separates
    rounding from error there."""
    from npu_fx_fusion.tiny_models import build_hf

    pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = build_hf(name, dtype=dtype, num_layers=2)
    backend = _training_step_matches_eager(tm, dtype)
    forward, backward = npu_ops(backend.graphs["forward"]), npu_ops(backend.graphs["backward"])
    blocks = 2 if name == "qwen3_moe" else 1  # DeepSeek's first layer is dense
    assert forward["npu_moe_token_permute"] == forward["npu_moe_token_unpermute"] == blocks
    assert backward["npu_moe_token_permute_grad_v2"] == backward["npu_moe_token_unpermute_grad_v2"] == blocks
    assert forward["npu_grouped_matmul"] == 2 * blocks and backward["npu_grouped_matmul"] == 4 * blocks
    if name == "deepseek_v3":
        assert forward["npu_moe_gating_top_k"] == backward["npu_moe_gating_top_k_backward"] == 1
    else:
        assert "npu_moe_gating_top_k_softmax" not in forward
    assert backend.report.errors == []


# ---- the joint graph's normalisation ---------------------------------------------------------------
def _joint_graphs(model, inputs, dynamic):
    """The joint graphs aot_autograd builds for a training step of `model` (before any pass)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import default_partition

    graphs = []

    def partition(joint, *args, **kwargs):
        graphs.append(copy.deepcopy(joint))
        return default_partition(joint, *args, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), partition_fn=partition),
                             dynamic=dynamic)
    compiled(*inputs).float().pow(2).mean().backward()
    return graphs


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_remove_noop_ops_is_torchs(dynamic):
    """canonical.remove_noop_ops tests a candidate's metadata before collecting its fake arguments,
    where torch collects them first: both tests are pure, so it removes exactly what torch's removes."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops as torchs

    from npu_fx_fusion.canonical import remove_noop_ops
    from npu_fx_fusion.tiny_models import build_hf

    tiny = build_hf("llama", dtype=torch.bfloat16, num_layers=2)
    (joint,) = _joint_graphs(tiny.model.train(), tiny.example_inputs, dynamic)
    ours = copy.deepcopy(joint)
    before = len(joint.graph.nodes)
    torchs(joint.graph)
    remove_noop_ops(ours.graph)
    assert len(joint.graph.nodes) < before  # there were no-ops to remove (the views that keep a shape)
    assert str(ours.graph) == str(joint.graph)
