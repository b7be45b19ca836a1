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
    """comb @ X instead of comb^T @ X: a comb stored indexed [k, j]. The same map as the op's
    with h_res = comb^T, so the recognition passes comb transposed."""

    def forward(self, hidden_states, block_output, post, comb):
        return post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(comb, hidden_states)


def test_the_untransposed_mix_fuses_with_comb_transposed():
    x, o, post, comb = _inputs()
    out, ref, report = compile_and_run(UntransposedMix(), x, o, post, comb, config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert report.sites[0].form == "streams mix (axis algebra)"
    assert_close_at_scale(out, ref, ULPS[torch.float32])
    # and it is not the transposed mix: the two differ where comb is not symmetric
    transposed, _, _ = compile_and_run(ResidualMix(), x, o, post, comb, config=POST)
    assert (out - transposed).abs().max() > 0.1


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
def test_the_summed_product_spelling_fuses(dtype):
    """HcPost computes in fp32 and rounds once, as the op does: the same sums in another order."""
    out, ref, report = compile_and_run(SummedProductMix(), *_inputs(dtype), config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert report.sites[0].form == "streams mix (axis algebra)"
    assert_close_at_scale(out, ref, ULPS[dtype])


class EinsumMix(torch.nn.Module):
    """The mix as two einsums over (B, S) tokens, computed in fp32 and rounded once."""

    def forward(self, hidden_states, block_output, post, comb):
        mixed = torch.einsum("bsk,bsd->bskd", post, block_output.float()) + torch.einsum(
            "bsjk,bsjd->bskd", comb, hidden_states.float())
        return mixed.to(hidden_states.dtype)


class TokenMix(torch.nn.Module):
    """The summed-product spelling over flattened tokens: X (T, n, D), one index for B and S."""

    def forward(self, hidden_states, block_output, post, comb):
        t, n, d = hidden_states.shape[0] * hidden_states.shape[1], hidden_states.shape[2], hidden_states.shape[3]
        x, o, p, c = (hidden_states.reshape(t, n, d), block_output.reshape(t, d), post.reshape(t, n),
                      comb.reshape(t, n, n))
        y = p.unsqueeze(-1) * o.unsqueeze(-2) + (c.unsqueeze(-1) * x.unsqueeze(-2)).sum(1)
        return y.to(hidden_states.dtype)


@pytest.mark.parametrize("module", [EinsumMix, TokenMix])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_layouts_fuse(module, dtype):
    out, ref, report = compile_and_run(module(), *_inputs(dtype), config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[dtype])


def test_the_summed_product_spelling_fuses_with_dynamic_shapes():
    out, ref, report = compile_and_run(SummedProductMix(), *_inputs(torch.bfloat16), config=POST, dynamic=True)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[torch.bfloat16])
    torch._dynamo.reset()
    out, ref, report = compile_and_run(SummedProductMix(), *_inputs(torch.bfloat16, b=3, s=7), config=POST,
                                       dynamic=True)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[torch.bfloat16])


@pytest.mark.parametrize("module", [SummedProductMix, EinsumMix, TokenMix])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recognised_spellings_train_through_the_backward_op(module, dtype):
    """In the joint graph, the backward of a recognised mix is the nodes autograd made for its
    forward ops (their seq_nr): replaced by the op's backward, which computes the four gradients
    in fp32 and rounds each once, as these spellings' own backward does (fp32 products and sums,
    one cast): the same few ulps as the forward."""
    backend = train_and_compare(module(), _inputs(dtype), POST, ULPS)
    assert fused_calls(backend.graphs["forward"]) == {"npu.npu_mhc_post": 1}
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_mhc_post_backward": 1}
    assert near_miss_reasons(backend.report, "mhc_post") == []


def test_a_recognised_spelling_trains_fused_with_dynamic_shapes():
    backend = train_and_compare(SummedProductMix(), _inputs(torch.bfloat16), POST, ULPS, dynamic=True)
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_mhc_post_backward": 1}


def test_only_some_inputs_requiring_grad_get_theirs():
    """post and comb computed without grad (a frozen mHC): the backward passes on two
    gradients, and the op's other two are dropped."""
    backend = train_and_compare(SummedProductMix(), _inputs(), POST, ULPS, grads=[True, True, False, False])
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_mhc_post_backward": 1}


def _narrow_block_output_inputs():
    """fp32 streams, post and comb, and a bf16 block output (torchtitan-npu's fp32 DeepSeek-V4,
    whose attention returns bf16 in one layer)."""
    x, o, post, comb = _inputs()
    return [x, o.to(torch.bfloat16), post, comb]


def test_a_narrower_block_output_mixed_in_the_streams_dtype_fuses():
    """HcPost's type_as rounds to the block output's bf16 a mix torch computes in fp32 (the
    product promotes o): the op mixes the fp32 streams with o upcast (exact) and the cast stays
    after it: fp32 ulps before the rounding, so the bf16 results agree to one ulp at scale."""
    out, ref, report = compile_and_run(SummedProductMix(), *_narrow_block_output_inputs(), config=POST)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert out.dtype == torch.bfloat16
    assert_close_at_scale(out, ref, 1)
    backend = train_and_compare(SummedProductMix(), _narrow_block_output_inputs(), POST, ULPS)
    assert fused_calls(backend.graphs["backward"]) == {"npu.npu_mhc_post_backward": 1}


class MixReadAgain(torch.nn.Module):
    """The mix, and its streams' sum read again outside it: the gradient of that intermediate
    is the mix's plus another's, which the op's backward does not compute."""

    def forward(self, hidden_states, block_output, post, comb):
        mixed = torch.sum(comb.unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=2)
        y = post.unsqueeze(-1) * block_output.unsqueeze(-2) + mixed
        return y.type_as(block_output), mixed.tanh()


def test_a_mix_whose_intermediate_is_read_elsewhere_trains_unfused():
    backend = train_and_compare(MixReadAgain(), _inputs(), POST, ULPS)
    assert fused_calls(backend.graphs["backward"]) == {}
    reasons = near_miss_reasons(backend.report, "mhc_post")
    assert reasons and all("gradient" in r for r in reasons), reasons


class FewerOutputStreams(torch.nn.Module):
    """4 streams mixed into 3 by a (4, 3) comb: no n x n mix."""

    def forward(self, hidden_states, block_output, post, comb):
        return (post[..., :3].unsqueeze(-1) * block_output.unsqueeze(-2)
                + torch.sum(comb[..., :3].unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=2))


class PerStreamBlockOutput(torch.nn.Module):
    """post times a block output of its own per stream: not one o broadcast over the streams."""

    def forward(self, hidden_states, block_output, post, comb):
        return post.unsqueeze(-1) * hidden_states.flip(2) + torch.sum(
            comb.unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=2)


class KeptInFp32(torch.nn.Module):
    """The mix of bf16 streams left in fp32: the op would round it to bf16."""

    def forward(self, hidden_states, block_output, post, comb):
        return post.unsqueeze(-1) * block_output.unsqueeze(-2) + torch.sum(
            comb.unsqueeze(-1) * hidden_states.unsqueeze(-2), dim=2)


@pytest.mark.parametrize("module, dtype, reason", [
    (FewerOutputStreams, torch.float32, "mixes 4 streams into 3: the op's comb is n x n"),
    (PerStreamBlockOutput, torch.float32, "do not play those roles"),
    (KeptInFp32, torch.bfloat16, "the mix's result is float32 and the streams bfloat16"),
])
def test_look_alikes_are_near_misses_that_say_why(module, dtype, reason):
    out, ref, report = compile_and_run(module(), *_inputs(dtype), config=POST)
    assert report.counts["mhc_post"] == 0
    reasons = near_miss_reasons(report, "mhc_post")
    assert len(reasons) == 1 and reason in reasons[0], reasons
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


class StreamsFirstMix(torch.nn.Module):
    """The streams held (B, n, S, D): the mix as einsums over that layout in fp32, transposed
    back, then rounded once."""

    def forward(self, hidden_states, block_output, post, comb):
        streams = hidden_states.transpose(1, 2).float()
        mixed = torch.einsum("bsjk,bjsd->bksd", comb, streams) + torch.einsum("bsk,bsd->bksd", post,
                                                                              block_output.float())
        return mixed.transpose(1, 2).to(hidden_states.dtype)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_streams_first_layout_rounded_after_its_transpose_fuses(dynamic):
    out, ref, report = compile_and_run(StreamsFirstMix(), *_inputs(torch.bfloat16), config=POST, dynamic=dynamic)
    assert report.fused_ops == {"npu.npu_mhc_post": 1}
    assert_close_at_scale(out, ref, ULPS[torch.bfloat16])
