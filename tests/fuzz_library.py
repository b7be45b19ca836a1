"""The fuzz's library family: model code of other codebases, reduced to standalone modules (issue 28).

Each spelling is the RMSNorm, RoPE, SwiGLU, router or attention code of one library, as
written there (`origin` names the file and line of torchtune 0.6.1, litgpt 0.5.13,
ai2-olmo-core 3.0.0, torchtitan 0.2.2 / torchtitan-npu 0.2.2.post2), cut out of its module
with its tensors as inputs. A case draws one spelling, then sizes, a dtype, static or
`dynamic=True`, inference or training (attention: inference only), as the other families do,
and declares what the code computes (fuzz_cases.Case.kind):

  positive  it is the fused op's math (an RMSNorm, a rotation by the table's angle, a softmax
            top-k router, an attention): the pass should fuse it;
  limit     the op's real limit (gate and up from separate projections; a soft-capped score,
            which the fused attention has no parameter for): no fusion, and a near miss
            matching `limit`;
  negative  a look-alike (GeGLU: gelu, not silu).

`make_case(seed, "library")` (fuzz_cases) builds one; `SPELLINGS` lists them by name. The
fuzz's default rotation (fuzz_cases.FAMILIES, the CI slice) does not draw this family:
tests/test_fuzz.py runs every spelling with its current outcome (LIBRARY_NOW there), and
`benchmarks/fuzz.py --family library` draws it at scale.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Optional

import torch
from torch import nn

from fuzz_cases import DTYPES, Case, _module_from_source, _randn

FAMILY = "library"


@dataclasses.dataclass(frozen=True)
class Spelling:
    origin: str  # "<library> <file>:<line>: what"
    family: str  # rms_norm, rope, swiglu, router, attention
    source: str  # the module's forward (and helpers)
    inputs: Callable  # (rng, gen, dtype) -> (inputs tuple, shapes text, init(module) or None)
    expect: dict  # positive: {pass: sites}
    kind: str = "positive"
    limit: str = ""  # limit: the near-miss regex
    grad_inputs: tuple = (0,)  # training: the inputs that take a gradient (tables never)
    index_outputs: tuple = ()
    training_limit: str = ""  # in a training step: a limit, with this near-miss regex
    training_limit_dtypes: tuple = ()  # ... in these dtypes only (none: in every dtype)


# ---- RMSNorm --------------------------------------------------------------------------------
def _norm_inputs(weight_dtype=None, offset=False):
    def make(rng, gen, dtype):
        D = rng.choice([8, 16, 64])
        shape = [rng.randint(1, 3), rng.randint(1, 5), D]
        x = _randn(gen, *shape, scale=rng.choice([3.0, 1e-2])).to(dtype)

        def init(module):
            module.eps = rng.choice([1e-6, 1e-5])
            w = _randn(gen, D, scale=0.1) if offset else torch.rand(D, generator=gen) + 0.5
            module.weight = nn.Parameter(w.to(weight_dtype or dtype))
            module.normalized_shape = (D,)
        return (x,), f"x {shape}", init
    return make


# olmo-core's RMSNorm ({weighted}: the weight, and the cast back, in RMSNorm's or QwenRMSNorm's order)
_OLMO_NORM = (
    "def forward(self, x):\n"
    "    with torch.autocast(enabled=False, device_type=x.device.type):\n"
    "        og_dtype = x.dtype\n"
    "        x = x.float()\n"
    "        variance = x.pow(2).mean(-1, keepdim=True)\n"
    "        x = x * torch.rsqrt(variance + self.eps)\n"
    "{weighted}")

NORMS = {
    "torchtune.RMSNorm": Spelling(
        "torchtune modules/rms_norm.py:58: F.rms_norm of the fp32 upcast, weight fp32", "rms_norm",
        "def forward(self, x):\n"
        "    return F.rms_norm(x.float(), normalized_shape=self.normalized_shape, weight=self.weight,\n"
        "                      eps=self.eps).to(x.dtype)",
        _norm_inputs(torch.float32), {"rms_norm": 1}),
    "torchtune.GemmaRMSNorm": Spelling(
        "torchtune models/gemma/rms_norm.py:25: x * rsqrt(mean(x^2) + eps) on x.float(), * (1 + w)", "rms_norm",
        "def _norm(self, x):\n"
        "    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n\n\n"
        "def forward(self, x):\n"
        "    output = _norm(self, x.float())\n"
        "    output = output * (1.0 + self.weight.float())\n"
        "    return output.type_as(x)",
        _norm_inputs(torch.float32, offset=True), {"rms_norm": 1}),
    "litgpt.RMSNorm": Spelling(
        "litgpt model.py:1315: mean(x * x), weight.float() after the normalisation, then .to(dtype)", "rms_norm",
        "def forward(self, x):\n"
        "    dtype = x.dtype\n"
        "    x = x.float()\n"
        "    norm_x = torch.mean(x * x, dim=-1, keepdim=True)\n"
        "    x_normed = x * torch.rsqrt(norm_x + self.eps)\n"
        "    return (x_normed * self.weight.float()).to(dtype=dtype)",
        _norm_inputs(), {"rms_norm": 1}),
    "litgpt.RMSNorm(add_unit_offset)": Spelling(
        "litgpt model.py:1321: Gemma's (1 + weight) of the same norm", "rms_norm",
        "def forward(self, x):\n"
        "    dtype = x.dtype\n"
        "    x = x.float()\n"
        "    norm_x = torch.mean(x * x, dim=-1, keepdim=True)\n"
        "    x_normed = x * torch.rsqrt(norm_x + self.eps)\n"
        "    weight = 1 + self.weight\n"
        "    return (x_normed * weight.float()).to(dtype=dtype)",
        _norm_inputs(offset=True), {"rms_norm": 1}),
    "olmo_core.RMSNorm": Spelling(
        "olmo-core nn/layer_norm.py:272: under autocast(enabled=False), weight.type_as(x) * x", "rms_norm",
        _OLMO_NORM.format(weighted="        x = self.weight.type_as(x) * x\n        return x.to(og_dtype)"),
        _norm_inputs(), {"rms_norm": 1}),
    "olmo_core.QwenRMSNorm": Spelling(
        "olmo-core nn/layer_norm.py:303: cast back before the weight", "rms_norm",
        _OLMO_NORM.format(weighted="        x = x.to(og_dtype)\n        return x * self.weight.type_as(x)"),
        _norm_inputs(), {"rms_norm": 1}),
    "torchtitan_npu.RMSNorm": Spelling(
        "torchtitan-npu models/deepseek_v4/model/model.py:111 (V3.2's at :67 with pow): fp32 weight times the "
        "fp32 normalised x", "rms_norm",
        "def forward(self, x):\n"
        "    dtype = x.dtype\n"
        "    x = x.float()\n"
        "    var = x.square().mean(-1, keepdim=True)\n"
        "    x = x * torch.rsqrt(var + self.eps)\n"
        "    return (self.weight * x).to(dtype)",
        _norm_inputs(torch.float32), {"rms_norm": 1}),
    "torchtitan_npu.v4_q_norm": Spelling(
        "torchtitan-npu models/deepseek_v4/model/model.py:587: the weightless per-head q norm, in q's dtype", "rms_norm",
        "def forward(self, q):\n"
        "    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)",
        _norm_inputs(), {"rms_norm": 1}),
}


# ---- RoPE -----------------------------------------------------------------------------------
def _rope_inputs(layout, tables, both=False, tables_fp32=False):
    """q (and k) in `layout`, and the tables as `tables` builds them from (S, D) angles."""
    def make(rng, gen, dtype):
        B, N, S, D = rng.randint(1, 2), rng.choice([1, 2, 4]), rng.choice([3, 5, 8]), rng.choice([8, 16, 32])
        shape = {"BSND": (B, S, N, D), "BNSD": (B, N, S, D), "BSD": (B, S, D)}[layout]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        angles = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq  # (S, D/2)
        made = tables(angles)
        made = tuple(t if t.is_complex() or tables_fp32 else t.to(dtype) for t in made)
        xs = tuple(_randn(gen, *shape).to(dtype) for _ in range(2 if both else 1))
        return (*xs, *made), f"x {list(shape)} x{len(xs)}, tables {[list(t.shape) for t in made]}", None
    return make


def _halves(angles):  # rotate_half tables: (S, D)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _freqs_cis(angles):
    return (torch.polar(torch.ones_like(angles), angles).to(torch.complex64),)


# torchtune's Qwen2 / Phi3 RoPE: cos and sin the halves of one cache ({cast}: Qwen2 casts them to x's dtype)
_CACHE_HALVES = (
    "def forward(self, x, cache):\n"
    "    seq_len = x.size(1)\n"
    "    head_dim = x.size(-1)\n"
    "    rope_cache = cache[:seq_len]\n"
    "    rope_cache = rope_cache.view(-1, seq_len, 1, head_dim * 2)\n"
    "    cos = rope_cache[..., :head_dim]{cast}\n"
    "    sin = rope_cache[..., head_dim:]{cast}\n"
    "    x1 = x[..., : x.shape[-1] // 2]\n"
    "    x2 = x[..., x.shape[-1] // 2 :]\n"
    "    rotated = torch.cat((-x2, x1), dim=-1)\n"
    "    x_out = (x * cos) + (rotated * sin)\n"
    "    return x_out.type_as(x)")
# litgpt's apply_rope ({interleave}: apply_rope_interleave's de-interleaving first)
_LITGPT_ROPE = (
    "def forward(self, x, cos, sin):\n"
    "    cos = cos.unsqueeze(0)\n"
    "    sin = sin.unsqueeze(0)\n"
    "{interleave}"
    "    head_size_half = x.size(-1) // 2\n"
    "    x1 = x[..., :head_size_half]\n"
    "    x2 = x[..., head_size_half:]\n"
    "    rotated = torch.cat((-x2, x1), dim=-1)\n"
    "    dims_diff = x.dim() - cos.dim()\n"
    "    if dims_diff > 0:\n"
    "        new_shape = cos.shape[0:1] + (1,) * dims_diff + cos.shape[1:]\n"
    "        cos = cos.view(*new_shape)\n"
    "        sin = sin.view(*new_shape)\n"
    "    roped = (x * cos) + (rotated * sin)\n"
    "    return roped.to(dtype=x.dtype)")
# torchtitan-npu's DeepSeek-V4 apply_rotary_emb ({conj}: inverse=True; {view}: 4-D or 3-D x)
_V4_ROPE = (
    "def forward(self, x, freqs_cis):\n"
    "    original_dtype = x.dtype\n"
    "    x_complex = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))\n"
    "    seqlen = x_complex.size(1)\n"
    "    freqs_cis = freqs_cis[:seqlen]\n"
    "{conj}"
    "    freqs_cis = freqs_cis.view({view}, x_complex.size(-1))\n"
    "    x_rotated = torch.view_as_real(x_complex * freqs_cis).flatten(-2)\n"
    "    return x_rotated.to(original_dtype)")

ROPES = {
    "torchtune.RotaryPositionalEmbeddings": Spelling(
        "torchtune modules/position_embeddings.py:118: interleaved pairs as reshape(..., -1, 2), a (S, D/2, 2) "
        "[cos, sin] cache, stack of the two rotated parts, flatten(3)", "rope",
        "def forward(self, x, cache):\n"
        "    seq_len = x.size(1)\n"
        "    rope_cache = cache[:seq_len]\n"
        "    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)\n"
        "    rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)\n"
        "    x_out = torch.stack(\n"
        "        [\n"
        "            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],\n"
        "            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],\n"
        "        ],\n"
        "        -1,\n"
        "    )\n"
        "    x_out = x_out.flatten(3)\n"
        "    return x_out.type_as(x)",
        _rope_inputs("BSND", lambda a: (torch.stack([a.cos(), a.sin()], dim=-1).float(),), tables_fp32=True),
        {"rope": 1}),
    "torchtune.Qwen2RotaryPositionalEmbeddings": Spelling(
        "torchtune models/qwen2/_positional_embeddings.py:105: cos and sin as the halves of one (S, 2D) cache, "
        "cast to x's dtype, rotate_half by slices", "rope", _CACHE_HALVES.format(cast=".to(x.dtype)"),
        _rope_inputs("BSND", lambda a: (torch.cat(_halves(a), dim=-1),), tables_fp32=True), {"rope": 1}),
    "torchtune.Phi3RotaryPositionalEmbeddings": Spelling(
        "torchtune models/phi3/_position_embeddings.py:100: the same with the fp32 cache not cast: x * cos "
        "promotes a half x to fp32, type_as(x) casts back", "rope", _CACHE_HALVES.format(cast=""),
        _rope_inputs("BSND", lambda a: (torch.cat(_halves(a), dim=-1),), tables_fp32=True), {"rope": 1}),
    "litgpt.apply_rope": Spelling(
        "litgpt model.py:1144: rotate_half by slices on (B, nh, T, hs), (1, T, hs) tables viewed to 4-D", "rope",
        _LITGPT_ROPE.format(interleave=""), _rope_inputs("BNSD", _halves), {"rope": 1}),
    "litgpt.apply_rope_interleave": Spelling(
        "litgpt model.py:1176: pairs de-interleaved by view(..., d // 2, 2).transpose(-1, -2), then rotate_half", "rope",
        _LITGPT_ROPE.format(interleave="    *batch_dims, d = x.shape\n"
                                       "    x = x.view(*batch_dims, d // 2, 2).transpose(-1, -2).reshape(*batch_dims, d)\n"),
        _rope_inputs("BNSD", _halves), {"rope": 1}),
    "olmo_core.RotaryEmbedding": Spelling(
        "olmo-core nn/rope.py:470-486: full precision (q, k upcast), rotate_half as "
        "view(B, nh, T, 2, hs // 2).unbind(-2), fp32 (S, hs) tables", "rope",
        "def rotate_half(x):\n"
        "    B, nh, T, hs = x.size()\n"
        "    x = x.view(B, nh, T, 2, hs // 2)\n"
        "    x1, x2 = x.unbind(dim=-2)\n"
        "    return torch.cat((-x2, x1), dim=-1)\n\n\n"
        "def apply(pos_sin, pos_cos, t):\n"
        "    return ((t * pos_cos) + (rotate_half(t) * pos_sin)).to(t.dtype)\n\n\n"
        "def forward(self, q, k, pos_cos, pos_sin):\n"
        "    q_, k_ = q.float(), k.float()\n"
        "    with torch.autocast(q.device.type, enabled=False):\n"
        "        q_abs_start = k_.shape[-2] - q_.shape[-2]\n"
        "        sin, cos = pos_sin[None, None, :, :], pos_cos[None, None, :, :]\n"
        "        q_ = apply(sin[:, :, q_abs_start:k_.shape[-2], :], cos[:, :, q_abs_start:k_.shape[-2], :], q_)\n"
        "        k_ = apply(sin, cos, k_)\n"
        "    return q_.type_as(q), k_.type_as(k)",
        _rope_inputs("BNSD", _halves, both=True, tables_fp32=True), {"rope": 2}, grad_inputs=(0, 1)),
    "torchtitan_npu.v32_indexer_rope": Spelling(
        "torchtitan-npu models/deepseek_v32/model/model.py:52 (interleaved=False): halves made pairs by "
        "view(..., 2, -1).transpose(-1, -2), complex product, pairs made halves by cat(y[..., 0::2], y[..., 1::2])",
        "rope",
        "def forward(self, x, freqs_cis):\n"
        "    dtype = x.dtype\n"
        "    shape = x.shape\n"
        "    x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()\n"
        "    x = torch.view_as_complex(x.float().view(*shape[:-1], -1, 2))\n"
        "    freqs_cis = freqs_cis[0:shape[1]].view(1, shape[1], 1, x.shape[-1])\n"
        "    y = torch.view_as_real(x * freqs_cis).flatten(3)\n"
        "    y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)\n"
        "    return y.to(dtype)",
        _rope_inputs("BSND", _freqs_cis), {"rope": 1}),
    "torchtitan_npu.v4_rope": Spelling(
        "torchtitan-npu models/deepseek_v4/model/model.py:29: complex pairs by unflatten(-1, (-1, 2)), "
        "flatten(-2) back", "rope", _V4_ROPE.format(conj="", view="1, seqlen, 1"),
        _rope_inputs("BSND", _freqs_cis), {"rope": 1}),
    "torchtitan_npu.v4_rope_3d": Spelling(
        "torchtitan-npu models/deepseek_v4/model/model.py:63: the same on a 3-D (B, S, D) x (the compressor's kv)",
        "rope", _V4_ROPE.format(conj="", view="1, seqlen"), _rope_inputs("BSD", _freqs_cis), {"rope": 1}),
    "torchtitan_npu.v4_rope_inverse": Spelling(
        "torchtitan-npu models/deepseek_v4/model/model.py:61 (inverse=True, the attention output's): a rotation "
        "by the negative angle, freqs_cis.conj(): npu_rotary_mul with the sin table negated", "rope",
        _V4_ROPE.format(conj="    freqs_cis = freqs_cis.conj()\n", view="1, seqlen, 1"),
        _rope_inputs("BSND", _freqs_cis), {"rope": 1}),
}


# ---- SwiGLU ---------------------------------------------------------------------------------
def _mlp_inputs(experts=False, scales=None):
    """scales: None, or nGPT's per-channel sw1 / sw3 ("channel": (H,)), or per-row ones ("row": (N, 1))."""
    def make(rng, gen, dtype):
        D, H = rng.choice([8, 16]), rng.choice([8, 16, 32])
        lead = [rng.randint(1, 3), rng.randint(1, 5)]
        if experts:  # (E, N, D) tokens per expert, (E, D, H) weights
            E = rng.choice([2, 4])
            x = _randn(gen, E, lead[1], D, scale=2.0).to(dtype)

            def init(module):
                module.w1 = nn.Parameter(_randn(gen, E, D, H, scale=D ** -0.5).to(dtype))
                module.w3 = nn.Parameter(_randn(gen, E, D, H, scale=D ** -0.5).to(dtype))
                module.w2 = nn.Parameter(_randn(gen, E, H, D, scale=H ** -0.5).to(dtype))
            return (x,), f"x {[E, lead[1], D]}, experts {E} x ({D}, {H})", init
        if scales == "row":  # rows that differ: at least two of them
            lead[1] = max(lead[1], 2)
        x = _randn(gen, *lead, D, scale=2.0).to(dtype)

        def init(module):
            module.fc_1 = nn.Linear(D, H, bias=False).to(dtype)
            module.fc_2 = nn.Linear(D, H, bias=False).to(dtype)
            module.proj = nn.Linear(H, D, bias=False).to(dtype)
            with torch.no_grad():
                for p in module.parameters():
                    p.copy_(_randn(gen, *p.shape, scale=p.shape[-1] ** -0.5))
            if scales is not None:
                shape = (H,) if scales == "channel" else (lead[1], 1)
                module.sw1 = nn.Parameter((torch.rand(shape, generator=gen) + 0.5).to(dtype))
                module.sw3 = nn.Parameter((torch.rand(shape, generator=gen) + 0.5).to(dtype))
        return (x,), f"x {lead + [D]}, hidden {H}" + (f", {scales} scales" if scales else ""), init
    return make


SEPARATE = r"gate and up come from separate projections"
MLPS = {
    "litgpt.LLaMAMLP": Spelling(
        "litgpt model.py:827 (torchtune FeedForward, olmo-core FeedForward and torchtitan FeedForward alike): "
        "silu(fc_1(x)) * fc_2(x), two projections", "swiglu",
        "def forward(self, x):\n"
        "    x_fc_1 = self.fc_1(x)\n"
        "    x_fc_2 = self.fc_2(x)\n"
        "    x = F.silu(x_fc_1) * x_fc_2\n"
        "    return self.proj(x)",
        # merged_projections makes fc_1 and fc_2 one linear first: on one buffer in inference,
        # on a per-step concatenation of the two weights in training
        _mlp_inputs(), {"swiglu": 1}),
    "olmo_core.MoEMLP": Spelling(
        "olmo-core nn/moe/mlp.py:195: the experts as batched GEMMs, silu(bmm(x, w1)) * bmm(x, w3)", "swiglu",
        "def forward(self, x):\n"
        "    og_dtype = x.dtype\n"
        "    x = x.type_as(self.w1)\n"
        "    return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2).to(dtype=og_dtype)",
        _mlp_inputs(experts=True), {}, kind="limit", limit=SEPARATE),
    "olmo_core.NormalizedFeedForward": Spelling(
        "olmo-core nn/feed_forward.py:253-256 (nGPT): silu(sw1 * w1(x)) * (sw3 * w3(x)), the two projections' "
        "outputs scaled per channel before they meet", "swiglu",
        "def forward(self, x):\n"
        "    sw1 = self.sw1 * ((1.0 / 0.5) * 4.0)\n"
        "    sw3 = self.sw3 * (1.0 / 0.5)\n"
        "    return self.proj(F.silu(sw1 * self.fc_1(x)) * (sw3 * self.fc_2(x)))",
        _mlp_inputs(scales="channel"), {"swiglu": 1}),
    "olmo_core.NormalizedFeedForward_per_row": Spelling(
        "nGPT's feed-forward with scales per token row instead of per channel: the concatenated scale would be "
        "a full copy, so it stays unfused, saying why", "swiglu",
        "def forward(self, x):\n"
        "    return self.proj(F.silu(self.sw1 * self.fc_1(x)) * (self.sw3 * self.fc_2(x)))",
        _mlp_inputs(scales="row"), {}, kind="limit", limit=r"varies along the rows|" + SEPARATE + ", scaled"),
    "litgpt.GemmaMLP": Spelling(
        "litgpt model.py:835: GeGLU, gelu(fc_1(x)) * fc_2(x): a look-alike (gelu, not silu)", "swiglu",
        "def forward(self, x):\n"
        "    x_fc_1 = self.fc_1(x)\n"
        "    x_fc_2 = self.fc_2(x)\n"
        "    x = F.gelu(x_fc_1, approximate='tanh') * x_fc_2\n"
        "    return self.proj(x)",
        _mlp_inputs(), {}, kind="negative"),
}


# ---- routers --------------------------------------------------------------------------------
def _router_inputs(rng, gen, dtype):
    T, D, E = rng.choice([3, 5, 8]), 8, rng.choice([4, 8])
    x = _randn(gen, T, D, scale=2.0).to(dtype)

    def init(module):
        module.gate = nn.Linear(D, E, bias=False).to(dtype)
        module.k = rng.randint(1, min(4, E))
        with torch.no_grad():
            module.gate.weight.copy_(_randn(gen, E, D))
    return (x,), f"[{T}, {D}] -> logits [{T}, {E}]", init


def _biased_router_inputs(rng, gen, dtype):
    (x,), shapes, gate = _router_inputs(rng, gen, dtype)

    def init(module):
        gate(module)
        module.k = min(module.k, module.gate.out_features)
        module.expert_bias = torch.zeros(module.gate.out_features)  # a buffer, as torchtitan's
        module.expert_bias.copy_(_randn(gen, module.gate.out_features, scale=0.1))
        module.route_scale = rng.choice([1.0, 2.5])
    return (x,), shapes, init


ROUTERS = {
    "litgpt.LLaMAMoE": Spelling(
        "litgpt model.py:865: the top-k of the logits first, then the softmax over the k chosen (in fp32): the "
        "softmax top-k router, renormalised", "router",
        "def forward(self, x):\n"
        "    router = self.gate(x)\n"
        "    probs, indices = torch.topk(router, self.k)\n"
        "    probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)\n"
        "    return probs, indices",
        _router_inputs, {"moe_gating": 1}, index_outputs=(1,),
        # a half step saves the fp32 softmax over the k chosen for its backward; the op returns the
        # weights in the logits' dtype, and its softmax mode has no backward
        training_limit=r"softmax router in training|a value inside the router, is also an output of the graph",
        training_limit_dtypes=(torch.bfloat16, torch.float16)),
    "torchtitan_npu.v3_router": Spelling(
        "torchtitan 0.2.2 models/moe/moe.py:311-345 (torchtitan-npu DeepSeek-V3 / V3.2): fp32 sigmoid, expert_bias, "
        "unsorted top-k, gather, / (sum + 1e-20), * route_scale; the routing map and per-token sums (order-free uses)",
        "router",
        "def forward(self, x):\n"
        "    scores = self.gate(x)\n"
        "    scores = torch.sigmoid(scores.to(torch.float32))\n"
        "    scores_for_choice = scores + self.expert_bias\n"
        "    _, selected = torch.topk(scores_for_choice, k=self.k, dim=-1, sorted=False)\n"
        "    top_scores = scores.gather(dim=1, index=selected)\n"
        "    denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20\n"
        "    top_scores = top_scores / denominator\n"
        "    top_scores = top_scores * self.route_scale\n"
        "    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, selected, True)\n"
        "    return routing_map, top_scores.sum(dim=-1)",
        _biased_router_inputs, {"moe_gating": 1}, index_outputs=(0,)),
    "torchtitan_npu.v4_router": Spelling(
        "torchtitan-npu deepseek_v4/model/moe.py:41 + 141-165: sqrt of softplus written log1p(exp(-|x|)) + relu(x), "
        "expert_bias, sorted top-k, gather, route_norm, route_scale",
        "router",
        "def forward(self, x):\n"
        "    scores = self.gate(x).to(torch.float32)\n"
        "    scores = (torch.log1p(torch.exp(-scores.abs())) + torch.relu(scores)).sqrt()\n"
        "    selected = (scores + self.expert_bias).topk(self.k, dim=-1)[1]\n"
        "    top_scores = scores.gather(dim=1, index=selected)\n"
        "    top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)\n"
        "    return top_scores * self.route_scale, selected",
        _biased_router_inputs, {"moe_gating": 1}, index_outputs=(1,),
        training_limit=r"sqrt-softplus router in training .*differentiates the sigmoid mode only"),
}


# ---- attention (inference) ------------------------------------------------------------------
def _attention_inputs(gqa=True):
    def make(rng, gen, dtype):
        B, S, D = rng.randint(1, 2), rng.choice([4, 6, 8]), rng.choice([8, 16])
        kv = rng.choice([1, 2]) if gqa else 2
        N = kv * rng.choice([1, 2])
        q = _randn(gen, B, N, S, D).to(dtype)
        k = _randn(gen, B, kv, S, D).to(dtype)
        v = _randn(gen, B, kv, S, D).to(dtype)

        def init(module):
            module.q_per_kv = N // kv
            module.window = rng.choice([2, 3])
            module.cap = rng.choice([5.0, 30.0])
            module.scale = D ** -0.5
        return (q, k, v), f"q {[B, N, S, D]}, k/v {[B, kv, S, D]}", init
    return make


SOFTCAP = r"softcap|tanh"
ATTENTIONS = {
    "torchtune.MultiHeadAttention": Spelling(
        "torchtune modules/attention.py:289 + attention_utils.py:259: GQA by unsqueeze(2).expand().flatten(1, 2), "
        "SDPA(is_causal=True)", "attention",
        "def forward(self, q, k, v):\n"
        "    b, kv_heads, s, d = k.shape\n"
        "    expand_shape = (b, kv_heads, self.q_per_kv, -1, d)\n"
        "    k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)\n"
        "    v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)\n"
        "    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)",
        _attention_inputs(), {"attention": 1}),
    "litgpt.CausalSelfAttention": Spelling(
        "litgpt model.py:560 + 593: GQA by repeat_interleave(q_per_kv, dim=1), SDPA(scale=1 / sqrt(hs), "
        "is_causal=True)", "attention",
        "def forward(self, q, k, v):\n"
        "    k = k.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    v = v.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    scale = 1.0 / math.sqrt(q.shape[-1])\n"
        "    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=True)\n"
        "    return y.transpose(1, 2)",
        _attention_inputs(), {"attention": 1}),
    "litgpt.sliding_window": Spelling(
        "litgpt model.py:548: a sliding-window float mask built row by row (-inf outside the window), SDPA "
        "with it", "attention",
        "def forward(self, q, k, v):\n"
        "    k = k.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    v = v.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    T = q.size(2)\n"
        "    sliding_window_mask = torch.full((T, T), float('-inf'), dtype=q.dtype, device=q.device)\n"
        "    for i in range(T):\n"
        "        window_start = max(0, i - self.window + 1)\n"
        "        sliding_window_mask[i, window_start : i + 1] = 0.0\n"
        "    mask = sliding_window_mask.view(1, 1, T, T)\n"
        "    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scale,\n"
        "                                       is_causal=False)\n"
        "    return y.transpose(1, 2)",
        _attention_inputs(), {"attention": 1}),
    "litgpt.softcapping": Spelling(
        "litgpt model.py:583: scores = q @ k.mT * scale, tanh soft-capped, + a triu(finfo.min) mask, softmax in "
        "fp32: the fused attention has no soft-cap", "attention",
        "def forward(self, q, k, v):\n"
        "    k = k.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    v = v.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    scores = q @ k.mT * self.scale\n"
        "    scores = torch.tanh(scores / self.cap) * self.cap\n"
        "    mask = torch.ones(q.size(2), q.size(2), dtype=q.dtype, device=q.device).triu(diagonal=1)\n"
        "    mask.masked_fill_(mask.bool(), torch.finfo(q.dtype).min)\n"
        "    scores = scores + mask\n"
        "    scores = F.softmax(scores, dim=-1, dtype=torch.float).to(dtype=q.dtype)\n"
        "    y = scores @ v\n"
        "    return y.transpose(1, 2)",
        _attention_inputs(), {}, kind="limit", limit=SOFTCAP),
    "torchtune.Gemma2Attention": Spelling(
        "torchtune models/gemma2/_attention.py:299-341: q scaled in place, tril bool mask made float by "
        "where(-2.38e38, 0), sliding window by triu * tril, tanh soft-cap, softmax(float).type_as(q): no soft-cap "
        "in the fused attention", "attention",
        "def forward(self, q, k, v):\n"
        "    k = k.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    v = v.repeat_interleave(self.q_per_kv, dim=1)\n"
        "    q = q * self.scale\n"
        "    s_x = q.shape[2]\n"
        "    output = torch.matmul(q, k.transpose(2, 3))\n"
        "    mask = torch.tril(torch.ones(size=(s_x, s_x), dtype=torch.bool).to(q.device))\n"
        "    mask = torch.where(mask.logical_not(), -2.3819763e38, 0)\n"
        "    all_ones = torch.ones_like(mask)\n"
        "    sliding_mask = torch.triu(all_ones, -1 * self.window + 1) * torch.tril(all_ones, self.window - 1)\n"
        "    mask = torch.where(sliding_mask == 1, mask, -2.3819763e38)\n"
        "    output = output / self.cap\n"
        "    output = torch.tanh(output)\n"
        "    output = output * self.cap\n"
        "    output = output + mask\n"
        "    output = F.softmax(output.float(), dim=-1).type_as(q)\n"
        "    return torch.matmul(output, v)",
        _attention_inputs(), {}, kind="limit", limit=SOFTCAP),
}

SPELLINGS: dict[str, Spelling] = {**NORMS, **ROPES, **MLPS, **ROUTERS, **ATTENTIONS}


PASS_OF_FAMILY = {"rms_norm": "rms_norm", "rope": "rope", "swiglu": "swiglu", "router": "moe_gating",
                  "attention": "attention"}


def make(rng, seed: int, case_kw: dict, name: Optional[str] = None) -> Case:
    """One library case: a spelling (`name`, else drawn), its sizes and the case's mode."""
    name = name or rng.choice(sorted(SPELLINGS))
    spelling = SPELLINGS[name]
    dtype, dynamic, training = case_kw["dtype"], case_kw["dynamic"], case_kw["training"]
    if spelling.family == "attention":
        training = False  # the fused attention is an inference op (a training graph keeps SDPA)
    if "view_as_complex" in spelling.source and dtype == torch.float16:
        dtype = torch.bfloat16  # complex RoPE in fp32 / bf16, as make_case draws the rope_complex family
    kind, limit, expect = spelling.kind, spelling.limit, dict(spelling.expect)
    # a router in training: a sigmoid router trains fused with its backward; a softmax one has no
    # backward op, and the partitioned forward fuses it where the backward reads only what the op
    # returns (litgpt's fp32 softmax over the k chosen: the weights and ids themselves), else the
    # spelling's training_limit says why not
    if training and spelling.training_limit and (not spelling.training_limit_dtypes
                                                 or dtype in spelling.training_limit_dtypes):
        kind, limit, expect = "limit", spelling.training_limit, {}
    state = rng.getstate()

    def inputs():
        local = random.Random()
        local.setstate(state)
        return spelling.inputs(local, torch.Generator().manual_seed(seed), dtype)

    def build():
        made, _, init = inputs()
        return _module_from_source(spelling.source, f"<fuzz {seed}>", init or (lambda m: None)), made

    choices = {"spelling": name, "origin": spelling.origin, "shapes": inputs()[1]}
    return Case(seed, FAMILY, choices, spelling.source, kind, expect if kind == "positive" else {},
                PASS_OF_FAMILY[spelling.family], limit, dtype, dynamic, training, build, spelling.index_outputs,
                grad_inputs=spelling.grad_inputs if spelling.family == "rope" else None)


def case(seed: int, name: str) -> Case:
    """The case of spelling `name` with seed `seed` (its mode drawn as make_case draws one)."""
    rng = random.Random(seed)
    case_kw = {"dtype": rng.choice(DTYPES), "dynamic": rng.random() < 0.35, "training": rng.random() < 0.35}
    return make(rng, seed, case_kw, name)
