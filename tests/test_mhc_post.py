"""mhc_post on DeepseekV4DecoderLayer's residual mix (post * o + comb^T @ X).

Numerics: fp32 agrees to a few ulps at scale (the same sums in another order). bf16:
transformers rounds post and comb to bf16 and mixes in bf16 (a bf16 bmm over n = 4
streams), the op keeps them fp32 and rounds once: within ~4 bf16 ulps at the output's scale.
"""
import pytest
import torch

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, compile_and_run, near_miss_reasons
from v4_modules import ResidualMix, fused_calls, train_and_compare

POST = nff.FusionConfig(enable={"mhc_post"})
ULPS = {torch.float32: 8, torch.bfloat16: 4}


def _inputs(dtype=torch.float32, b=2, s=5, n=4, d=64):
    torch.manual_seed(2)
    comb = torch.softmax(torch.randn(b, s, n, n), -1)
    return [torch.randn(b, s, n, d).to(dtype), torch.randn(b, s, d).to(dtype), 2 * torch.rand(b, s, n), comb]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mix_fuses(dtype):
    out, ref, report = compile_and_run(ResidualMix(), *_inputs(dtype), config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[dtype])
    if dtype == torch.bfloat16:  # the op rounds the exact mix once (the model rounds post / comb first)
        x, o, post, comb = _inputs(dtype)
        exact = post.double().unsqueeze(-1) * o.double().unsqueeze(-2) + comb.double().transpose(-1, -2) @ x.double()
        # elementwise ulps would fail on cancellation (an exact sum near 0 has a tiny ulp the
        # fp32 accumulation cannot resolve): one bf16 ulp at the output's scale is the claim
        assert_close_at_scale(out, exact.to(dtype), 1)


def test_soc_picks_the_extension_op_off_950():
    config = nff.FusionConfig(enable={"mhc_post"}, soc="Ascend910_93")
    out, ref, report = compile_and_run(ResidualMix(), *_inputs(torch.bfloat16), config=config)
    assert report.fused_ops == {"cann_ops_transformer.mhc_post": 1}
    assert "npu.npu_mhc_post is not available on Ascend910_93" in report.sites[0].note
    assert_close_at_scale(out, ref, ULPS[torch.bfloat16])


class UntransposedMix(torch.nn.Module):
    """comb @ X instead of comb^T @ X: another mixing, the ops' transpose convention is not it."""

    def forward(self, hidden_states, block_output, post, comb):
        return post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb, hidden_states)


def test_the_untransposed_mix_is_not_fused():
    _, _, report = compile_and_run(UntransposedMix(), *_inputs(), config=POST)
    assert report.counts["mhc_post"] == 0


def test_six_streams_fuse_five_do_not_on_an_npu():
    config = nff.FusionConfig(enable={"mhc_post"}, soc="Ascend950")
    _, _, report = compile_and_run(ResidualMix(), *_inputs(torch.bfloat16, n=6), config=config)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    torch._dynamo.reset()
    _, _, report = compile_and_run(ResidualMix(), *_inputs(torch.bfloat16, n=5), config=config)
    assert report.counts["mhc_post"] == 0
    assert any("5 streams" in r for r in near_miss_reasons(report, "mhc_post"))


@pytest.mark.parametrize("soc, fused", [(None, "npu.npu_mhc_post"), ("Ascend910B", "cann_ops_transformer.mhc_post")])
def test_trains_through_the_backward_op(soc, fused):
    dtype = torch.float32 if soc is None else torch.bfloat16
    backend = train_and_compare(ResidualMix(), _inputs(dtype), nff.FusionConfig(enable={"mhc_post"}, soc=soc),
                                {torch.float32: 8, torch.bfloat16: 4}, precision=None if soc is None else dtype)
    assert fused_calls(backend.graphs["forward"]) == {fused: 1}
    assert fused_calls(backend.graphs["backward"]) == {f"{fused}_backward": 1}


def test_dynamic_shapes():
    inputs = _inputs()
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 1)
    out, ref, report = compile_and_run(ResidualMix(), *inputs, config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[torch.float32])


class SummedProductMix(torch.nn.Module):
    """torchtitan-npu's HcPost (deepseek_v4/model/model.py:847-857): the same mix, comb and X
    broadcast against each other and summed over the streams, in fp32 (post and comb are fp32)
    and rounded once to the streams' dtype."""

    def forward(self, hidden_states, block_output, post, comb):
        y = post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.sum(
            comb.unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=2)
        return y.type_as(block_output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_summed_product_spelling_is_a_near_miss_not_silent(dtype):
    x, o, post, comb = _inputs(dtype)
    out, ref, report = compile_and_run(SummedProductMix(), x, o, post, comb, config=POST)
    assert report.counts["mhc_post"] == 0
    reasons = near_miss_reasons(report, "mhc_post")
    assert len(reasons) == 1 and "summed over the streams" in reasons[0], reasons
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # nothing replaced


class SummedOverTheWrongDim(torch.nn.Module):
    """The product summed over comb's other dim: each stream scaled by its row of comb
    summed, no mix of streams at all."""

    def forward(self, hidden_states, block_output, post, comb):
        return post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.sum(
            comb.unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=3)


def test_a_product_summed_over_another_dim_is_no_candidate():
    _, _, report = compile_and_run(SummedOverTheWrongDim(), *_inputs(), config=POST)
    assert report.counts["mhc_post"] == 0 and not near_miss_reasons(report, "mhc_post")
