"""Third-party model code: every RMSNorm of tiny transformers / torchtitan models fuses.

Logit tolerance in fp32: the fused ops compute the same fp32 arithmetic in another
order; over two layers and the LM head that stays within 1e-4 of logits of order 1.
"""
import pytest
import torch

import npu_fx_fusion as nff
from helpers import compile_and_run
from npu_fx_fusion.tiny_models import build_hf, build_torchtitan

# (builder, name, RMSNorms in 2 layers, of which a residual add feeds)
MODELS = [
    (build_hf, "llama", 5, 4),  # 2 per layer + final; the first norm reads the embeddings
    (build_hf, "qwen3", 9, 4),  # + per-head q_norm / k_norm in each layer
    (build_torchtitan, "llama3", 5, 4),  # torch.nn.RMSNorm
]


def _no_unfused_norm_left(report):
    ops = report.graphs[0].ops_after
    return ops["aten.rsqrt.default"] == 0 and ops["aten.mean.dim"] == 0


@pytest.mark.parametrize("build, name, norms, residual_norms", MODELS, ids=[m[1] for m in MODELS])
def test_every_rms_norm_fuses_and_logits_match(build, name, norms, residual_norms):
    tiny = build(name)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs)
    assert len(report.graphs) == 1
    assert report.counts["rms_norm"] == norms
    assert report.counts["add_rms_norm"] == residual_norms
    assert report.fused_ops == {"npu.npu_rms_norm": norms - residual_norms,
                                "npu.npu_add_rms_norm": residual_norms}
    assert _no_unfused_norm_left(report)
    assert [m for m in report.near_misses if m.pass_name in ("rms_norm", "add_rms_norm")] == []
    assert all(site.location.module and site.location.line for site in report.sites)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build, name", [(build_hf, "llama"), (build_torchtitan, "llama3")], ids=["llama", "llama3"])
def test_bf16_models_fuse_every_norm(build, name):
    # bf16 numerics are checked per op in test_rms_norm / test_add_rms_norm; here the
    # forms with casts must all be found in real model code, and the logits stay close.
    tiny = build(name, dtype=torch.bfloat16)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs)
    assert report.counts == {**report.counts, "rms_norm": 5, "add_rms_norm": 4}
    assert _no_unfused_norm_left(report)
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0)
    assert cosine > 0.999


def test_dynamic_sequence_length():
    tiny = build_hf("llama", seq_len=24)
    (ids,) = tiny.example_inputs
    backend = nff.get_npu_backend()
    compiled = torch.compile(tiny.model, backend=backend)
    with torch.no_grad():
        for seq_len in (16, 11, 24):
            x = ids[:, :seq_len].clone()
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), tiny.model(x), rtol=1e-4, atol=1e-4)
    report = nff.last_report()
    assert len(report.graphs) == 1  # one graph, symbolic in the sequence length, served all three
    assert report.counts["rms_norm"] == 5 and report.counts["add_rms_norm"] == 4
