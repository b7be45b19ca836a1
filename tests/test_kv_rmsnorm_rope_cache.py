"""kv_rmsnorm_rope_cache: DeepSeek-V3's latent cache write -> npu_kv_rmsnorm_rope_cache_v2_functional.

The module under test is transformers' own code for the latent path (DeepseekV3RMSNorm,
apply_rotary_pos_emb_interleave, StaticLayer.update), wired as DeepseekV3Attention wires
it; the whole model is in test_inference_models.py. Tolerances: fp32, 1e-5 (the same fp32
arithmetic: x / sqrt where the model multiplies by rsqrt); bf16, 2 ulps at the cache's
scale (the op rounds once, the model after the norm and after each rope product).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.cache_utils import StaticLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RMSNorm, apply_rotary_pos_emb,
                                                                    apply_rotary_pos_emb_interleave)

import npu_fx_fusion as nff
from helpers import RecordingBackend, assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered

ensure_registered()
LATENT_OP = torch.ops.npu.npu_kv_rmsnorm_rope_cache_v2_functional.default
B, RANK, ROPE, LEN = 2, 32, 16, 12


class LatentPath(nn.Module):
    """DeepseekV3Attention.forward up to its cache write (the query side left out)."""

    def __init__(self, dtype=torch.float32, interleave=True):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(64, RANK + ROPE, bias=False, dtype=dtype)
        self.kv_a_layernorm = DeepseekV3RMSNorm(RANK).to(dtype)
        with torch.no_grad():
            self.kv_a_layernorm.weight.normal_(1.0, 0.2)
        self.interleave = interleave
        self.layer = StaticLayer(max_cache_len=LEN)
        self.layer.lazy_initialization(torch.zeros(B, 1, 0, RANK, dtype=dtype),
                                       torch.zeros(B, 1, 0, ROPE, dtype=dtype))

    def forward(self, hidden, cos, sin):
        batch, seq = hidden.shape[:2]
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden), [RANK, ROPE], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, RANK)
        k_rot = k_rot.view(batch, 1, seq, ROPE)
        rotate = apply_rotary_pos_emb_interleave if self.interleave else apply_rotary_pos_emb
        _, k_rot = rotate(k_rot, k_rot, cos, sin)  # (the query is rotated the same way; not needed here)
        keys, values = self.layer.update(kv_nope, k_rot)
        return keys.sum(-1) + values.sum(-1)


def _inputs(seq, step, dtype):
    g = torch.Generator().manual_seed(step)
    positions = torch.arange(seq) + step
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(0, ROPE, 2).float() / ROPE))
    emb = torch.cat((freqs, freqs), -1)[None]  # HF's duplicated tables (1, S, rope)
    return torch.randn(B, seq, 64, generator=g).to(dtype), emb.cos().to(dtype), emb.sin().to(dtype)


def _generate(dtype, config=None, interleave=True, steps=(4, 1, 1)):
    eager, fused = LatentPath(dtype, interleave), LatentPath(dtype, interleave)
    fused.load_state_dict(eager.state_dict())
    backend = RecordingBackend(config)
    compiled = torch.compile(fused, backend=backend, fullgraph=True)
    position = 0
    with torch.no_grad():
        for seq in steps:
            inputs = _inputs(seq, position, dtype)
            compiled(*inputs), eager(*inputs)
            position += seq
            for got, want in ((fused.layer.keys, eager.layer.keys), (fused.layer.values, eager.layer.values)):
                if dtype == torch.float32:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                else:
                    assert_close_at_scale(got, want, ulps=2)
    return backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_write_fuses_in_prefill_and_decode(dtype):
    backend = _generate(dtype)
    report = backend.report
    assert [len(r.sites) for g in report.graphs for r in g.passes if r.pass_name == "kv_rmsnorm_rope_cache"] == [1, 1]
    assert report.counts["kv_cache"] == 0 and report.counts["rms_norm"] == 0  # the latent op took them
    decode = backend.graphs["inference"]
    (call,) = [n for n in decode.graph.nodes if n.target is LATENT_OP]
    assert call.kwargs.get("cache_mode", "Norm") == "Norm"  # the default: the trace leaves it out
    assert call.args[0].meta["val"].shape == (B, 1, 1, RANK + ROPE)
    note = report.sites[0].note
    assert "on an NPU" in note and "512 + 64" in note  # the tiny dims are emulation-only


def test_half_rotation_is_not_the_latent_op():
    # rope_interleave=False: rotate_half on the latent's rope part. The op de-interleaves,
    # so it is not this; the writes fuse one by one (kv_cache), the norm and rope apart.
    report = _generate(torch.float32, interleave=False).report
    assert report.counts["kv_rmsnorm_rope_cache"] == 0
    assert report.counts["kv_cache"] == 4 and report.counts["rms_norm"] == 2 and report.counts["rope"] == 2
    reasons = near_miss_reasons(report, "kv_rmsnorm_rope_cache")
    assert reasons and all("not of RMSNorm(kv_nope) and the interleaved RoPE" in r for r in reasons)


def test_a2_refuses_the_tiny_dims_and_950_takes_them():
    a2 = _generate(torch.bfloat16, config=nff.FusionConfig(soc="Ascend910B"), steps=(4,)).report
    assert a2.counts["kv_rmsnorm_rope_cache"] == 0
    assert set(near_miss_reasons(a2, "kv_rmsnorm_rope_cache")) == {
        f"RMSNorm dim {RANK} + RoPE dim {ROPE}: torch_npu's A2/A3 kernel takes 512 + 64 only"}
    # the open-source CANN kernel (Ascend 950) takes any rank + an even rope dim
    a5 = _generate(torch.bfloat16, config=nff.FusionConfig(soc="Ascend950"), steps=(4,)).report
    assert a5.counts["kv_rmsnorm_rope_cache"] == 1 and "on an NPU" not in a5.sites[0].note
