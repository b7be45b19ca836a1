"""transformers models generating over a StaticCache: the prefill and the decode graph fuse.

A tiny transformers llama / qwen3 / qwen3_moe / deepseek_v3 runs a prompt (the prefill
step, 5 tokens) and then 4 decode steps (1 token each) through CacheStep, once eagerly on
one StaticCache and once compiled through the emulation backend on another. Dynamo makes
two graphs, prefill and decode, each compiled once and reused for every later step. After
every step the logits and every layer's cache tensors are compared: the cache is the state
the next step reads, so a write that is lost, misplaced or corrupted shows in it first.

What fuses, per 2-layer model and graph: every attention call (npu_fused_infer_attention_score)
and every cache write (scatter_update, or for DeepSeek-V3 the latent cache op
npu_kv_rmsnorm_rope_cache_v2_functional), and the other passes as in the plain prefill
(test_models.py), minus the RMSNorm and the key RoPE that DeepSeek-V3's latent op takes in.
Nothing is left unfused by the complete passes, except the npu_mla_prolog_v3 near miss that
kv_rmsnorm_rope_cache reports at each DeepSeek layer (docs/passes/kv_rmsnorm_rope_cache.md).

Tolerances. fp32: the fused ops compute the same fp32 arithmetic in another order, well
inside 1e-4 of logits of order 1 and 1e-5 of the cache entries. bf16 / fp16: the fused
ops round once where the model rounds after each op (RMSNorm, RoPE, the latent op's norm
and rotation), a few ulps per site; the next layers and steps carry them on, so logits are
compared by cosine (as test_models.py) and caches within a few ulps at their scale.

Every model runs both ways: on the NPU graph (FusionConfig(npu_dispatch=True), the default:
SDPA is torch_npu's npu_fusion_attention_v3 behind logical_not / ones+triu, matmul stays
aten.matmul, softmax casts with npu._npu_dtype_cast) and on the plain CPU graph (SDPA's CPU
op, or its math path). The same sites must fuse in both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from helpers import assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.catalog import load_pass
from npu_fx_fusion.tiny_models import CacheStep, build_hf, static_cache

PROMPT, DECODE_STEPS, MAX_CACHE_LEN = 5, 4, 16
COMPLETE = ("attention", "kv_cache", "kv_rmsnorm_rope_cache", "rms_norm", "add_rms_norm", "rope")


@dataclass(frozen=True)
class Model:
    name: str
    counts: dict  # fused sites per graph (the prefill and the decode graph alike), 2 layers
    prolog_near_misses: int = 0  # kv_rmsnorm_rope_cache's npu_mla_prolog_v3 near miss, per graph


def _counts(norms, ropes, attention=2, writes=4, latent=0, swiglu=0, moe=0, gemms=0):
    return {"rms_norm": norms, "add_rms_norm": 4, "rope": ropes, "attention": attention, "kv_cache": writes,
            "kv_rmsnorm_rope_cache": latent, "swiglu": swiglu, "moe_dispatch": moe, "moe_gating": moe,
            "grouped_matmul": gemms}


MODELS = {
    # gate and up of each layer merged into one projection (merged_projections), then swiglu
    "llama": Model("llama", _counts(5, 4, swiglu=2)),
    "qwen3": Model("qwen3", _counts(9, 4, swiglu=2)),  # + q_norm / k_norm per layer
    "qwen3_moe": Model("qwen3_moe", _counts(9, 4, swiglu=2, moe=2, gemms=4)),
    # the kv norm and the k rope of each layer go into the latent op, whose two writes it
    # does itself; layer 0 dense (a gate/up MLP), layer 1 MoE with a shared expert: both
    # gate/up pairs merged (merged_projections), then swiglu, as in the routed experts
    "deepseek_v3": Model("deepseek_v3", _counts(7, 2, writes=0, latent=2, swiglu=3, moe=1, gemms=2),
                         prolog_near_misses=2),
}


def _prompt(vocab, batch=2):
    return torch.randint(3, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


GRAPHS = pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu-graph", "cpu-graph"])


def generate(model_type, dtype, *, attn_implementation="sdpa", allocate=True, steps=DECODE_STEPS,
             config=None, npu_dispatch=True, **config_overrides):
    """Eager and compiled generation side by side; returns (report, per-step comparisons).

    Each comparison is (logits, expected logits, [(cache tensor, expected), ...])."""
    from npu_fx_fusion import FusionConfig

    config = dataclasses.replace(config or FusionConfig(), npu_dispatch=npu_dispatch)
    tiny = build_hf(model_type, dtype=dtype, attn_implementation=attn_implementation, **config_overrides)
    lm = tiny.model.lm
    step = CacheStep(lm)
    caches = [static_cache(lm, batch=2, max_cache_len=MAX_CACHE_LEN, allocate=allocate) for _ in range(2)]
    backend = EmulationBackend(config)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    ids = _prompt(lm.config.vocab_size)
    compared = []
    with torch.no_grad():
        for _ in range(steps + 1):
            expected = step(ids, caches[0])
            actual = compiled(ids, caches[1])
            states = [(got, want) for mine, ref in zip(caches[1].layers, caches[0].layers)
                      for got, want in ((mine.keys, ref.keys), (mine.values, ref.values))]
            states += [(caches[1].layers[0].cumulative_length, caches[0].layers[0].cumulative_length)]
            compared.append((actual, expected, [(g.clone(), w.clone()) for g, w in states]))
            ids = expected[:, -1:].argmax(-1)
    return backend.report, compared


def _assert_steps_match(compared, dtype):
    for index, (actual, expected, states) in enumerate(compared):
        if dtype == torch.float32:
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=f"logits of step {index}")
        else:
            cosine = torch.nn.functional.cosine_similarity(actual.float().flatten(), expected.float().flatten(), 0)
            assert cosine > 0.999, f"step {index}: logits cosine {cosine.item():.5f}"
        for got, want in states:
            if not want.is_floating_point():  # the cache length
                assert torch.equal(got, want), f"step {index}: cache length {got} != {want}"
            elif dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"cache after step {index}")
            else:
                assert_close_at_scale(got, want, ulps=4)


def _assert_fused(report, model):
    assert [g.name for g in report.graphs] == ["inference", "inference"]  # prefill, decode
    for graph in report.graphs:
        counts = {r.pass_name: len(r.sites) for r in graph.passes if r.skipped is None}
        assert {name: counts[name] for name in model.counts} == model.counts, graph
        misses = [m for r in graph.passes for m in r.near_misses if r.pass_name in COMPLETE]
        prolog = [m for m in misses if "npu_mla_prolog_v3" in m.reason]
        assert len(prolog) == model.prolog_near_misses and len(misses) == len(prolog), misses
        ops = graph.ops_after
        for unfused in ("aten.index_copy.default", "aten._scaled_dot_product_flash_attention_for_cpu.default",
                        "npu.npu_fusion_attention_v3.default", "aten._safe_softmax.default", "aten.rsqrt.default"):
            assert ops[unfused] == 0, (unfused, ops[unfused])
        assert graph.cost_after.launches < graph.cost_before.launches


def _check(model_type, dtype, npu_dispatch=True, **kwargs):
    report, compared = generate(model_type, dtype, npu_dispatch=npu_dispatch, **kwargs)
    _assert_steps_match(compared, dtype)
    _assert_fused(report, MODELS[model_type])
    return report


# default run: one GQA model in fp32 and DeepSeek-V3's latent path in bf16
@GRAPHS
def test_llama_static_cache_generation_fuses_prefill_and_decode(npu_dispatch):
    from npu_fx_fusion import FusionConfig

    report = _check("llama", torch.float32, npu_dispatch, config=FusionConfig(verify=True))
    assert all(s.verified.startswith("verified: max error") for s in report.sites), \
        [(s.pass_name, s.verified) for s in report.sites if not s.verified.startswith("verified")]
    prefill, decode = report.graphs
    # the static cache's mask depends on its cumulative_length (an input): an explicit mask
    notes = [s.note for r in prefill.passes if r.pass_name == "attention" for s in r.sites]
    assert all("cannot be proven causal" in n and "explicit mask" in n for n in notes), notes
    notes = [s.note for r in decode.passes if r.pass_name == "attention" for s in r.sites]
    assert all("reads all 16 key positions" in n and "actual_seq_lengths_kv" in n for n in notes), notes
    writes = [s.note for r in decode.passes if r.pass_name == "kv_cache" for s in r.sites]
    assert all("scatter_update_ in place" in n for n in writes), writes


@GRAPHS
def test_deepseek_v3_latent_cache_in_bf16(npu_dispatch):
    _check("deepseek_v3", torch.bfloat16, npu_dispatch)


@pytest.mark.slow
@GRAPHS
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_fp32(model_type, npu_dispatch):
    _check(model_type, torch.float32, npu_dispatch)


@pytest.mark.slow
@GRAPHS
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_bf16(model_type, npu_dispatch):
    _check(model_type, torch.bfloat16, npu_dispatch)


@pytest.mark.slow
@GRAPHS
@pytest.mark.parametrize("model_type", list(MODELS))
def test_fp16(model_type, npu_dispatch):
    _check(model_type, torch.float16, npu_dispatch)


@pytest.mark.slow
def test_eager_attention_fuses_too():
    # eager attention is the same on both graphs but for aten.matmul (NPU) / bmm (CPU)
    _check("llama", torch.float32, attn_implementation="eager")


@GRAPHS
def test_prefill_into_a_fresh_cache_is_proven_causal(npu_dispatch):
    """A first prefill whose cache the step itself allocates: transformers then knows the
    cache is empty, slices the keys to the prompt and calls SDPA with is_causal=True, which
    the pass maps to sparse_mode 3 (top-left = right-down causal, S_q = S_kv). The caches are
    allocated in the graph (zeros), not inputs: the writes stay functional, and say so."""
    report, compared = generate("llama", torch.float32, allocate=False, steps=0, npu_dispatch=npu_dispatch)
    _assert_steps_match(compared, torch.float32)
    (prefill,) = report.graphs
    sites = {r.pass_name: r.sites for r in prefill.passes}
    assert len(sites["attention"]) == 2 and all("is_causal=True: sparse_mode 3" in s.note
                                                for s in sites["attention"])
    assert len(sites["kv_cache"]) == 4 and all("stays functional" in s.note for s in sites["kv_cache"])


def test_a_soc_refuses_what_the_npu_cannot_run():
    """fp32 attention and the tiny latent dims fuse in emulation with a note; with a SoC
    given they are refused, each with the limit it breaks."""
    from npu_fx_fusion import FusionConfig

    report, _ = generate("deepseek_v3", torch.float32, steps=0, config=FusionConfig(soc="Ascend910B"))
    assert near_miss_reasons(report, "attention") == [
        "npu.npu_fused_infer_attention_score does not support float32 on Ascend910B"] * 2
    latent = [r for r in near_miss_reasons(report, "kv_rmsnorm_rope_cache") if "npu_mla_prolog_v3" not in r]
    # (reported at both writes of each layer, the anchors of a latent pair)
    assert latent == ["npu.npu_kv_rmsnorm_rope_cache_v2_functional does not support float32 on Ascend910B"] * 4
    # the writes then fuse one by one, as scatter_update
    assert report.counts["kv_cache"] == 4


def test_passes_are_registered():
    for name in ("attention", "kv_cache", "kv_rmsnorm_rope_cache"):
        assert load_pass(name) is not None
