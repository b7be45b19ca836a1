"""Third-party model code: every site of every implemented pass fuses in tiny models.

Each model is compiled twice: with NPU dispatch emulated (the default: the graph an NPU
compile holds, npu_dispatch.py) and on the plain CPU trace; both must fuse the same sites.

One compile per model checks all passes at once: the exact number of fused sites per
pass, no near miss left for the passes that should cover the model completely, and the
logits. fp32 tolerance: the fused ops compute the same fp32 arithmetic (in another
order in places); over two layers and the LM head that stays within 1e-4 of logits of
order 1. bf16: the fused ops round once where the model rounds after each op, a few ulp
per site that the following matmuls carry on; the per-op bounds are in the pass tests.
"""
from dataclasses import dataclass, field

import pytest
import torch

import npu_fx_fusion as nff
from helpers import GuardRecordingBackend, compile_and_run, is_size_limit, near_miss_reasons
from npu_fx_fusion.tiny_models import build_hf, build_torchtitan

SEPARATE_PROJECTIONS = "gate and up come from separate projections"


@dataclass
class Expected:
    build: object
    name: str
    counts: dict  # fused sites per pass, 2 layers
    separate_mlps: int = 0  # MLPs whose gate and up are two projections (swiglu near misses)
    kwargs: dict = field(default_factory=dict)
    gemms_per_block: int = 2  # grouped GEMMs per routed experts block
    # routers that stay unfused in bf16 in the plain CPU graph (npu_dispatch=False): CPU
    # autocast does not take fp32, torch_npu's does (the NPU graph's router is fp32 and fuses)
    bf16_unfused_routers: int = 0
    # cosine of low-precision logits to eager's: one rounding of a fused op (one in fp32 where
    # the code rounds twice) moves them; a top-k over rounded scores (V3.2's indexer) can then
    # keep another key, which moves them further
    low_precision_cosine: float = 0.999

    @property
    def id(self):
        return "-".join([self.name, *map(str, self.kwargs.values())])


def _counts(norms, residual_norms, ropes, swiglus, grouped_gemms=0, routers=0, dispatches=0, dsa=0):
    # attention: each layer's (a prefill without a cache: its mask is proven causal,
    # sparse_mode 3), except where DeepSeek-V3.2's sparse attention takes it
    return {"rms_norm": norms, "add_rms_norm": residual_norms, "rope": ropes, "swiglu": swiglus,
            "grouped_matmul": grouped_gemms, "moe_gating": routers, "moe_dispatch": dispatches,
            "lightning_indexer": dsa, "sparse_attention": dsa, "attention": 0 if dsa else 2}


# 2 layers: 2 norms per layer + final (+ q_norm / k_norm per layer in qwen3-style
# attention and the MLA LoRA norms in DeepSeek); q and k rotated per layer. Separate gate and
# up projections are merged into one linear first (merged_projections, inference), so their
# SwiGLU fuses too.
MODELS = [
    Expected(build_hf, "llama", _counts(5, 4, 4, 2)),
    Expected(build_hf, "qwen3", _counts(9, 4, 4, 2)),
    # fused gate_up projections; partial rotary (half of the head dim)
    Expected(build_hf, "phi3", _counts(5, 4, 4, 2)),
    # + interleaved-pair rotary written with stack(-x2, x1).flatten(-2)
    Expected(build_hf, "glm4", _counts(9, 4, 4, 2)),
    # MoE experts: one gate_up tensor per expert, split then silu(gate) * up
    # (grouped_mm: gate_up and down GEMMs per MoE layer; batched_mm gathers weights per
    # token-expert pair and calls bmm, which is not a grouped GEMM)
    # + the routed experts block: init_routing -> grouped GEMMs -> finalize_routing
    Expected(build_hf, "qwen3_moe", _counts(9, 4, 4, 2, 4, 2, 2), kwargs={"experts_implementation": "grouped_mm"}),
    # batched_mm: the moe_dispatch pass emits the grouped GEMMs itself (there are none to keep)
    Expected(build_hf, "qwen3_moe", _counts(9, 4, 4, 2, 0, 2, 2), kwargs={"experts_implementation": "batched_mm"}),
    # even/odd pair rotary written de-interleaved; layer 0 dense, layer 1 MoE + a shared
    # expert, routed by noaux_tc (npu_moe_gating_top_k, once the dispatch is fused)
    Expected(build_hf, "deepseek_v3", _counts(9, 4, 4, 3, 2, 1, 1),
             kwargs={"experts_implementation": "grouped_mm"}),
    Expected(build_hf, "deepseek_v3", _counts(9, 4, 4, 3, 0, 1, 1),
             kwargs={"experts_implementation": "batched_mm"}),
    # + the lightning indexer's own rotary on its q and k; per layer the indexer and the
    # attention over its top-k keys (both fused; on an NPU the sites note the MLA kernels'
    # head-dim limits, which the tiny config does not meet)
    Expected(build_hf, "deepseek_v32", _counts(9, 4, 8, 3, 2, 1, 1, dsa=2), low_precision_cosine=0.998),
    # complex-number rotary (view_as_complex * freqs_cis)
    Expected(build_torchtitan, "llama3", _counts(5, 4, 4, 2)),
    # torchtitan's biased softmax router, its local dispatcher (stable argsort, scatter-add
    # combine) and its experts: w1, w3 and w2 as three grouped GEMMs. In bf16 the router runs
    # under autocast to fp32: in the NPU graph it fuses, in the plain CPU graph it stays bf16.
    # One MLP keeps its w1 / w3 apart after merged_projections (a swiglu near miss).
    Expected(build_torchtitan, "deepseek_v3", _counts(7, 4, 4, 2, 3, 1, 1), separate_mlps=1,
             gemms_per_block=3, bf16_unfused_routers=1),
]

COMPLETE_PASSES = ("rms_norm", "add_rms_norm", "rope", "grouped_matmul", "lightning_indexer",
                   "sparse_attention", "attention")  # nothing may be left unfused


def _check_fusion(report, expected: Expected, unfused_routers=0):
    assert len(report.graphs) == 1
    counts = dict(expected.counts, moe_gating=expected.counts["moe_gating"] - unfused_routers)
    assert {p: report.counts[p] for p in counts} == counts
    if expected.counts["moe_dispatch"]:  # every routed block: gating -> routing -> grouped GEMMs -> combine
        blocks = expected.counts["moe_dispatch"]
        fused = report.fused_ops
        assert fused["npu.npu_moe_init_routing_v2"] == fused["npu.npu_moe_finalize_routing"] == blocks
        assert fused["npu.npu_grouped_matmul"] == expected.gemms_per_block * blocks
        assert counts["moe_gating"] == blocks - unfused_routers
    for pass_name in COMPLETE_PASSES:
        assert near_miss_reasons(report, pass_name) == [], pass_name
    swiglu_misses = near_miss_reasons(report, "swiglu")
    assert len(swiglu_misses) == expected.separate_mlps
    assert all(SEPARATE_PROJECTIONS in reason for reason in swiglu_misses), swiglu_misses
    ops = report.graphs[0].ops_after
    assert ops["aten.rsqrt.default"] == 0 and ops["aten.view_as_complex.default"] == 0
    assert all(site.location.module and site.location.line for site in report.sites)


def _sites(report, routers_apart=False):
    """Each fused site as (pass, fused op, module): the same sites whichever graph they fused
    in (the form, and so the source line it is reported at, differs: FA-v3 under NPU
    dispatch, SDPA's CPU decomposition without)."""
    return sorted((s.pass_name, s.fused_op, s.location.module) for s in report.sites
                  if not (routers_apart and s.pass_name == "moe_gating"))


def _both_ways(tiny, expected, unfused_routers=0):
    """Compile with NPU dispatch emulated (the default) and without; check each and compare.

    A site that fuses in one graph and not in the other fails here: the passes must match
    the NPU spelling (what an NPU compile holds) as well as the plain CPU trace."""
    results = {}
    for npu_dispatch in (True, False):
        out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs,
                                           config=nff.FusionConfig(npu_dispatch=npu_dispatch))
        assert report.graph_source.startswith("NPU graph" if npu_dispatch else "CPU graph")
        _check_fusion(report, expected, unfused_routers=0 if npu_dispatch else unfused_routers)
        results[npu_dispatch] = out, ref, report
    (npu_out, ref, npu_report), (cpu_out, _, cpu_report) = results[True], results[False]
    # the routers only the NPU graph fuses (its autocast takes fp32) aside, the same sites
    routers_apart = bool(unfused_routers)
    assert _sites(npu_report, routers_apart) == _sites(cpu_report, routers_apart)
    # the npu ops the passes added (an NPU graph holds npu_fusion_attention_v3 before any pass)
    router_ops = {s.fused_op for s in npu_report.sites if s.pass_name == "moe_gating"} if routers_apart else set()
    assert _without(npu_report.fused_ops, router_ops, routers_apart) == _without(cpu_report.fused_ops, router_ops,
                                                                                routers_apart)
    return npu_out, cpu_out, ref, npu_report


def _without(fused_ops, router_ops, routers_apart):
    """The fused ops less the routers'. Where only one graph computes its routers in fp32, the
    norm in front of a router also writes that fp32 input there (npu_add_rms_norm_cast): the
    same norm as npu_add_rms_norm in the other graph."""
    counts = {op: n for op, n in fused_ops.items() if op not in router_ops}
    if routers_apart and "npu.npu_add_rms_norm_cast" in counts:
        counts["npu.npu_add_rms_norm"] = counts.get("npu.npu_add_rms_norm", 0) + counts.pop("npu.npu_add_rms_norm_cast")
    return counts


@pytest.mark.parametrize("expected", MODELS, ids=[m.id for m in MODELS])
def test_every_site_fuses_and_logits_match(expected):
    tiny = expected.build(expected.name, **expected.kwargs)
    npu_out, cpu_out, ref, _ = _both_ways(tiny, expected)
    torch.testing.assert_close(npu_out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_out, ref, rtol=1e-4, atol=1e-4)


BF16 = [m for m in MODELS if m.name in ("llama", "glm4", "deepseek_v32") or m.build is build_torchtitan]


@pytest.mark.parametrize("expected", BF16, ids=[m.id for m in BF16])
def test_bf16_models_fuse_every_site(expected):
    # the forms with casts (norms, the complex rotary's fp32 island) must be found in
    # real bf16 model code; the logits stay close.
    tiny = expected.build(expected.name, dtype=torch.bfloat16, **expected.kwargs)
    npu_out, cpu_out, ref, _ = _both_ways(tiny, expected, unfused_routers=expected.bf16_unfused_routers)
    _close_in_low_precision([(npu_out, ref), (cpu_out, ref)], expected)


def test_deepseek_v32_sdpa_fuses_as_an_npu_compile_holds_it():
    """The issue's done-when: under NPU dispatch (A2/A3), transformers' DeepSeek-V3.2 with SDPA
    attention reaches the graph as npu_fusion_attention_v3 fed by logical_not of its top-k
    mask, and still fuses its indexer and sparse attention in both layers, logits as eager."""
    expected = next(m for m in MODELS if m.name == "deepseek_v32")
    tiny = expected.build(expected.name)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs)  # the default config
    before = report.graphs[0].ops_before
    assert before["npu.npu_fusion_attention_v3.default"] == 2 and before["aten.logical_not.default"] >= 2
    assert before["aten._safe_softmax.default"] == 0  # no CPU decomposition of SDPA left
    assert report.counts["sparse_attention"] == report.counts["lightning_indexer"] == 2
    layers = {s.location.module.split(".self_attn")[0] for s in report.sites if s.pass_name == "sparse_attention"}
    assert layers == {"lm.model.layers.0", "lm.model.layers.1"}
    assert report.graphs[0].ops_after["npu.npu_fusion_attention_v3.default"] == 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


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
    assert {p: report.counts[p] for p in ("rms_norm", "add_rms_norm", "rope")} == \
        {"rms_norm": 5, "add_rms_norm": 4, "rope": 4}


# ---- dynamic=True, batch and sequence symbolic together (issue 15, item 1) -------------------
# Every site fuses as with static shapes, and the one symbolic graph serves another batch and
# length without a recompile (a fused op that pinned a size would add a guard on it: the MoE
# init_routing's active_num, patterns/moe_dispatch._every_row). The models below are those
# whose sites needed the symbolic-size proofs of the exact match (accept._exact_match): GLM's
# interleaved rotary (a view to (s0, N, s1, D)), torchtitan's complex rotary, transformers'
# grouped_mm experts block (arange(2 * s1 * s0)) and, behind it, DeepSeek-V3's noaux_tc router.
# Tolerances as for the static compiles above.
def _dynamic(expected, dtype=torch.float32):
    tiny = expected.build(expected.name, dtype=dtype, **expected.kwargs)
    (ids,) = tiny.example_inputs
    ids = ids.clone()
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(ids, 1)
    backend = GuardRecordingBackend(nff.FusionConfig())
    compiled = torch.compile(tiny.model, backend=backend, fullgraph=True, dynamic=True)
    other = torch.randint(3, int(ids.max()) + 1, (ids.shape[0] + 1, ids.shape[1] - 3), dtype=ids.dtype)
    with torch.no_grad():
        results = [(compiled(x), tiny.model(x)) for x in (ids, other)]
    # mark_dynamic: the compile fails if anything specialised batch or sequence while tracing;
    # one graph (checked by _check_fusion) then served both shapes, and the passes guarded
    # on nothing but a size's kernel limit (rope's B < 1000, attention's B <= 65536)
    assert all(is_size_limit(g) for g in backend.added_guards), backend.added_guards
    return results, backend.report


DYNAMIC_GAPS = [m for m in MODELS if (m.name, m.build, m.kwargs.get("experts_implementation")) in (
    ("glm4", build_hf, None), ("llama3", build_torchtitan, None),
    ("qwen3_moe", build_hf, "grouped_mm"), ("deepseek_v3", build_hf, "grouped_mm"))]


@pytest.mark.parametrize("expected", DYNAMIC_GAPS, ids=[m.id for m in DYNAMIC_GAPS])
def test_dynamic_batch_and_sequence_fuse_every_site_as_static_shapes(expected):
    results, report = _dynamic(expected)
    _check_fusion(report, expected)
    for out, ref in results:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _close_in_low_precision(results, expected):
    for out, ref in results:
        cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0)
        assert cosine > expected.low_precision_cosine


# every model, DeepSeek-V3.2 included: its indexer's min(index_topk, S) is taken as
# index_topk behind a guard S >= index_topk, its masks are proven causal for every size
DYNAMIC_AS_STATIC = MODELS


@pytest.mark.parametrize("expected", DYNAMIC_AS_STATIC, ids=[m.id for m in DYNAMIC_AS_STATIC])
def test_dynamic_batch_and_sequence_fuse_every_site_in_bf16(expected):
    # the done-when mode, over every model (benchmarks/dynamic_survey.py prints the
    # table for each dtype)
    results, report = _dynamic(expected, torch.bfloat16)
    _check_fusion(report, expected)
    _close_in_low_precision(results, expected)


@pytest.mark.parametrize("expected", DYNAMIC_GAPS, ids=[m.id for m in DYNAMIC_GAPS])
def test_dynamic_batch_and_sequence_fuse_every_site_in_fp16(expected):
    # fp16 on CPU is as bf16 (torchtitan's router would run without its fp32 autocast)
    results, report = _dynamic(expected, torch.float16)
    _check_fusion(report, expected)
    _close_in_low_precision(results, expected)


def test_deepseek_v32_indexer_and_sparse_attention_fuse_under_dynamic_shapes():
    """Its indexer keeps `min(index_topk, S)` keys, Min(8, S) with S dynamic: taken as 8,
    the graph guarded to S >= 8 (shorter prompts compile again); the masks the model builds
    from aranges of S are proven right-down causal for every size (symbolic_values.py).
    Every site fuses, as with static shapes, and the logits match eager."""
    expected = next(m for m in MODELS if m.name == "deepseek_v32")
    results, report = _dynamic(expected)
    _check_fusion(report, expected)
    indexer = [s.note for s in report.sites if s.pass_name == "lightning_indexer"]
    assert len(indexer) == 2 and all("index_topk taken as 8: a guard" in n for n in indexer), indexer
    for out, ref in results:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
