"""A decode step over a static KV cache through torchair's real max-autotune pipeline, on CPU.

torchair (from the unpacked torch-npu wheel, behind tests/torchair_harness/stubs.py) compiles
a decode step with our pipeline as its post_grad_custom_pre_pass, converts every node with
its real GE converters (FusedInferAttentionScore, Scatter, KvRmsNormRopeCache) and dumps the
GE graph; with debug.run_eagerly it then runs the FX graph. The output and the caches must
equal eager's, and the GE graph must hold the fused ops.

transformers cannot be imported behind the stubs (it probes for torch_npu, which they
block), so the step is transformers' code written out in plain torch: StaticLayer.update's
index_copy at arange(S) + cumulative_length, repeat_kv, sdpa_mask's causal mask offset by
the cache length, SDPA; and DeepseekV3Attention's latent path (RMSNorm, the even/odd
rotation, the two writes).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchair_harness.runner import run_scenario

B, N, NKV, D, LEN = 2, 4, 2, 16, 12
RANK, ROPE = 32, 16


class DecodeStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(B, NKV, LEN, D, dtype=torch.bfloat16))
        self.register_buffer("values", torch.zeros(B, NKV, LEN, D, dtype=torch.bfloat16))
        self.register_buffer("length", torch.tensor(3))

    def forward(self, q, k, v):
        position = torch.arange(k.shape[-2]) + self.length  # StaticLayer.update
        self.keys.index_copy_(2, position, k)
        self.values.index_copy_(2, position, v)
        keys = self.keys[:, :, None].expand(B, NKV, N // NKV, LEN, D).reshape(B, N, LEN, D)  # repeat_kv
        values = self.values[:, :, None].expand(B, NKV, N // NKV, LEN, D).reshape(B, N, LEN, D)
        q_idx = torch.arange(q.shape[2]) + self.length  # sdpa_mask
        mask = (torch.arange(LEN)[None, None, None, :] <= q_idx[None, None, :, None]).expand(B, -1, -1, -1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=D ** -0.5)


class LatentStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(RANK, dtype=torch.bfloat16) + 0.5)
        self.register_buffer("latent", torch.zeros(B, 1, LEN, RANK, dtype=torch.bfloat16))
        self.register_buffer("rope", torch.zeros(B, 1, LEN, ROPE, dtype=torch.bfloat16))
        self.register_buffer("length", torch.tensor(3))

    def forward(self, compressed_kv, cos, sin):
        batch, seq = compressed_kv.shape[:2]
        kv_nope, k_rot = torch.split(compressed_kv, [RANK, ROPE], dim=-1)
        hidden = kv_nope.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        kv_nope = (self.weight * hidden.to(kv_nope.dtype)).view(batch, 1, seq, RANK)
        k_rot = k_rot.view(batch, 1, seq, ROPE)
        cos, sin = cos[..., : ROPE // 2].unsqueeze(1), sin[..., : ROPE // 2].unsqueeze(1)
        k1, k2 = k_rot[..., 0::2], k_rot[..., 1::2]
        k_rot = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
        position = torch.arange(seq) + self.length
        self.latent.index_copy_(2, position, kv_nope)
        self.rope.index_copy_(2, position, k_rot)
        return self.latent.sum(-1) + self.rope.sum(-1)


def _inputs(name):
    g = torch.Generator().manual_seed(0)
    if name == "DecodeStep":
        return (torch.randn(B, 1, N, D, generator=g).transpose(1, 2).to(torch.bfloat16),
                torch.randn(B, NKV, 1, D, generator=g).to(torch.bfloat16),
                torch.randn(B, 1, NKV, D, generator=g).transpose(1, 2).to(torch.bfloat16))
    angles = torch.randn(1, 1, ROPE // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    return (torch.randn(B, 1, RANK + ROPE, generator=g).to(torch.bfloat16), emb.cos().to(torch.bfloat16),
            emb.sin().to(torch.bfloat16))


def scenario_decode_step_lowers_to_ge(name: str, dump_dir: str):
    import torch

    import npu_fx_fusion as nff
    import test_torchair_inference as t
    from test_torchair_backend import _ge_dumps, _max_autotune_config

    config, graphs = _max_autotune_config(dump_dir)
    backend = nff.get_npu_backend(compiler_config=config)
    eager, fused = getattr(t, name)(), getattr(t, name)()
    fused.load_state_dict(eager.state_dict())
    inputs = t._inputs(name)
    with torch.no_grad():
        expected = eager(*inputs)
        actual = torch.compile(fused, backend=backend, fullgraph=True)(*inputs)
    states = [(a, b) for a, b in zip(fused.buffers(), eager.buffers()) if a.is_floating_point()]
    dumps = _ge_dumps(dump_dir)
    return {
        "max_diff": (actual.float() - expected.float()).abs().max().item(),
        "scale": expected.float().abs().max().item(),
        "cache_max_diff": max((a.float() - b.float()).abs().max().item() for a, b in states),
        "npu_ops_lowered": graphs,
        "ge_ops": sorted(op for op in ("FusedInferAttentionScore", "Scatter", "TensorMove", "KvRmsNormRopeCache")
                         if op in dumps),
    }


@pytest.mark.parametrize("name, ops, ge_ops", [
    ("DecodeStep", ["npu.npu_fused_infer_attention_score.default", "npu.scatter_update.default"],
     ["FusedInferAttentionScore", "Scatter"]),
    ("LatentStep", ["npu.npu_kv_rmsnorm_rope_cache_v2_functional.default"], ["KvRmsNormRopeCache"]),
])
def test_decode_step_lowers_to_ge_under_max_autotune(name, ops, ge_ops, tmp_path):
    result = run_scenario(scenario_decode_step_lowers_to_ge, name=name, dump_dir=str(tmp_path), timeout=600)
    # bf16: the fused ops round once where the step rounds after each op
    assert result["max_diff"] <= 4 * 2 ** -8 * max(1.0, result["scale"]), result
    assert result["cache_max_diff"] <= 2 ** -5, result
    (lowered,) = result["npu_ops_lowered"]
    for op in ops:
        assert op in lowered, (op, lowered)
    assert set(ge_ops) <= set(result["ge_ops"]), result["ge_ops"]
