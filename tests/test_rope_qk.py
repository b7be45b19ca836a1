"""rope_qk: the two npu_rotary_mul of q and k -> one npu_apply_rotary_pos_emb.

Numerics: both ops are stand-ins that compute x * cos + rotate_half(x) * sin; in bf16 the
pair rounds once from fp32 (npu_ops/rope_qk.py), as npu_rotary_mul does, so the fused
outputs equal the rope pass's; against the unfused code (rounding after each op in bf16)
they differ by a few ulp of the output's scale, as rope's do (tests/test_rope.py): 4 ulp
at scale allowed.
"""
import pytest
import torch
import torch.nn as nn

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64
APPLY = "npu.npu_apply_rotary_pos_emb"
SEPARATE = dict(enable={"rope", "rope_qk"})  # merged_projections not enabled: q, k, v projected apart


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """transformers Llama's attention input: projections viewed BSND, transposed to BNSD,
    RoPE with tables unsqueezed at dim 1 (apply_rotary_pos_emb)."""

    def __init__(self, head_dim=HEAD_DIM, return_unrotated_k=False):
        super().__init__()
        self.head_dim, self.return_unrotated_k = head_dim, return_unrotated_k
        self.q_proj = nn.Linear(HIDDEN, HEADS * head_dim, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = q * cos + rotate_half(q) * sin
        k_embed = k * cos + rotate_half(k) * sin
        # q and the cache write need q and k laid out as the rope pass leaves them
        out = (q_embed.contiguous(), k_embed, v)
        return out + (k,) if self.return_unrotated_k else out


def tables(batch, seq, dim, dtype):
    angles = torch.arange(seq).float()[:, None] * (1e-2 * torch.arange(dim // 2).float())
    angles = torch.cat((angles, angles), -1)[None].expand(batch, -1, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _run(model, batch=2, seq=1, dtype=torch.float32, config=None, dynamic=None, head_dim=HEAD_DIM):
    torch.manual_seed(0)
    model = model.to(dtype).eval()
    x = torch.randn(batch, seq, HIDDEN, dtype=dtype)
    cos, sin = tables(1, seq, head_dim, dtype)
    backend = EmulationBackend(config or nff.FusionConfig(**SEPARATE))
    with torch.no_grad():
        expected = model(x, cos, sin)
        actual = torch.compile(model, backend=backend, dynamic=dynamic)(x, cos, sin)
    return actual, expected, backend.report


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [1, 5])  # a decode step, a prefill
def test_q_and_k_rotate_in_one_call(dtype, dynamic, seq):
    actual, expected, report = _run(Attention(), seq=seq, dtype=dtype, dynamic=dynamic,
                                    config=nff.FusionConfig(soc="Ascend910B", **SEPARATE))
    assert report.fused_ops == {APPLY: 1}, report.near_misses
    for a, e in zip(actual, expected):
        assert_close_at_scale(a, e, 4)


def test_emulation_notes_the_head_dim_a_real_npu_would_refuse():
    _, _, report = _run(Attention(head_dim=16), head_dim=16)
    assert report.fused_ops == {APPLY: 1}
    assert any("head_dim 16 is not 64 or 128" in s.note for s in report.sites if s.pass_name == "rope_qk")


def test_on_a2_a_head_dim_the_kernel_lacks_is_a_near_miss():
    _, _, report = _run(Attention(head_dim=16), head_dim=16,
                        config=nff.FusionConfig(soc="Ascend910B", **SEPARATE))
    assert APPLY not in report.fused_ops
    assert any("head_dim 16 is not 64 or 128" in r for r in near_miss_reasons(report, "rope_qk"))


def test_an_unrotated_k_read_elsewhere_is_not_overwritten():
    actual, expected, report = _run(Attention(return_unrotated_k=True))
    assert APPLY not in report.fused_ops
    reasons = near_miss_reasons(report, "rope_qk")
    assert any("k is also read by" in r for r in reasons), reasons
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_max_autotune_would_be_slower_and_keeps_two_calls():
    _, _, report = _run(Attention(), config=nff.FusionConfig(mode="max-autotune", **SEPARATE))
    assert APPLY not in report.fused_ops
    reasons = near_miss_reasons(report, "rope_qk")
    assert any("estimated slower fused (Ascend910B, max-autotune)" in r and "in 3 launches" in r
               for r in reasons), reasons


def test_in_emulation_the_site_says_max_autotune_would_refuse_it():
    _, _, report = _run(Attention())
    assert any("under max-autotune it would stay unfused" in s.note
               for s in report.sites if s.pass_name == "rope_qk")


@pytest.mark.parametrize("batch, fused", [(2, False), (1, True)])
def test_over_a_merged_projection_the_copies_decide(batch, fused):
    # q and k are slices of one q/k/v projection: for a batch of 2 they are not dense, the
    # kernel's in-place results must be copied into the layout the code after them has, and
    # that makes the site slower than two npu_rotary_mul; for a batch of 1 they are dense
    config = nff.FusionConfig(enable={"merged_projections", "rope", "rope_qk"})
    actual, expected, report = _run(Attention(), batch=batch, config=config)
    assert report.counts["merged_projections"] == 1
    assert (APPLY in report.fused_ops) is fused
    if not fused:
        assert any("estimated slower fused" in r for r in near_miss_reasons(report, "rope_qk"))
    for a, e in zip(actual, expected):
        assert_close_at_scale(a, e, 4)
