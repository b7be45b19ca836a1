"""Expert parallel: torchtitan's MoE with its experts sharded over ranks (docs/expert-parallel.md).

moe_dispatch fuses each side of the all-to-all: the local reorder in front of the token
exchange (npu_moe_init_routing_v2), the regroup after it (npu_moe_re_routing), and the
combine after the reverse exchange (npu_moe_finalize_routing); grouped_matmul fuses the
expert GEMMs in between. Two kinds of tests:

- graph capture in this process, over torch's fake process group (the collectives are
  recorded, their data is meaningless, nothing runs): every form fires on torchtitan's
  own graph, in both spellings of the all-to-all (torch's functional collective and the
  `npu_define.all_to_all_single_npu` torchair's decompositions make of it), and the
  regroup's anchor proof turns down graphs it does not hold for;
- numerics on 2 and 4 real CPU processes over gloo (tests/gloo_ranks.py): eager against
  compiled-with-fusion on every rank, forward and a training step.

Tolerances. The reorder, the regroup and the collectives are copies (exact). The grouped
GEMMs (bf16 in, fp32 accumulation, rounded once) agree to rounding. The combine is the
one change of summation: torchtitan rounds each weighted row to bf16 and scatter-adds the
k rows of a token in bf16, finalize_routing (or token_unpermute in training) adds the k
fp32 products and rounds once, so the outputs differ by at most k bf16 roundings at the
output's scale: `top_k` ulp (assert_close_at_scale). Gradients: the same bound, at each
gradient's scale.

The multi-process tests carry the `multiprocess` marker. The default run has a bounded
slice of them (the harness's own tests, and the 2-rank forward of deepseek_v3);
NPU_FX_FUSION_MULTIPROCESS=all adds qwen3, the 4-rank forward and the training steps
(slow), NPU_FX_FUSION_MULTIPROCESS=0 skips them all.
"""
from __future__ import annotations

import time

import pytest
import torch

import npu_fx_fusion as nff
from gloo_ranks import (RanksFailed, run_on_ranks, worker_all_reduce, worker_never_returns,
                        worker_skips_a_collective)
from helpers import (CaptureBackend, GraphCaptured, RecordingBackend, assert_close_at_scale, fake_world,
                     near_miss_reasons, ulp)
from torchair_harness.runner import run_scenario

torchtitan = pytest.importorskip("torchtitan")

FLAVORS = ("deepseek_v3", "qwen3")
MOE_PASSES = frozenset({"moe_dispatch", "moe_gating", "grouped_matmul", "swiglu"})
# per MoE layer per rank: the dispatch's two sides, the combine, three expert GEMMs
EP_FUSED = {"npu.npu_moe_init_routing_v2": 1, "npu.npu_moe_re_routing": 1, "npu.npu_grouped_matmul": 3,
            "npu.npu_moe_finalize_routing": 1}
# on gloo ranks the whole MoE layer compiles, router included: torchtitan's deepseek_v3
# sigmoid router with its selecting bias fuses too (moe_gating reads routers by what they compute)
EP_ROUTERS = {"deepseek_v3": {"npu.npu_moe_gating_top_k": 1}}
EP_TRAINED_FORWARD = {"npu_moe_token_permute": 1, "npu_moe_re_routing": 1, "npu_grouped_matmul": 3,
                      "npu_moe_token_unpermute": 1}


def _dynamic_sizes():
    """What torchtitan's apply_compile sets for its MoE (distributed/compile.py): the
    split sizes' .tolist() becomes unbacked SymInts in one graph instead of a break."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)


# ---- graph capture over the fake process group -------------------------------------------------
def capture(flavor, world_size, config=None, dtype=torch.bfloat16, decompositions=None, training=False,
            dynamic=None, **router):
    """The fused graph of one EP MoE layer on rank 0 of a fake world, and its report: the
    inference graph, or in training the forward graph partitioned from the fused joint one.
    `config` may be a function of the built TinyModel (a config naming its EP group)."""
    from npu_fx_fusion.tiny_models import build_torchtitan_ep_moe

    torch._dynamo.reset()
    with fake_world(world_size), _dynamic_sizes():
        tm = build_torchtitan_ep_moe(flavor, dtype=dtype, **router)
        (x,) = tm.example_inputs
        config = config(tm) if callable(config) else config
        backend = CaptureBackend(config or nff.FusionConfig(enable=MOE_PASSES), decompositions)
        with torch.set_grad_enabled(training), pytest.raises(GraphCaptured):
            torch.compile(tm.model.train(training), backend=backend, fullgraph=True,
                          dynamic=dynamic)(x.requires_grad_(training))
    assert backend.report.errors == []
    return backend.graphs["forward" if training else "inference"], backend.report


def _calls(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(name)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_both_sides_of_the_all_to_all_fuse(flavor, world_size):
    gm, report = capture(flavor, world_size)
    assert report.counts["moe_dispatch"] == 3 and report.counts["grouped_matmul"] == 3
    assert report.fused_ops == EP_FUSED
    ops = report.graphs[0].ops_after
    for gone in ("aten.sort.stable", "aten.repeat_interleave.Tensor", "torchtitan.deterministic_scatter_add.default",
                 "aten._grouped_mm.default"):
        assert ops[gone] == 0, gone
    # the collectives stay: the count exchange and the two token exchanges
    assert ops["_c10d_functional.all_to_all_single.default"] == 3
    # the regroup reads the (ranks, local experts) view of what the count exchange received
    (re_routing,) = _calls(gm, "npu.npu_moe_re_routing")
    counts = re_routing.args[1]
    assert counts.meta["val"].shape[0] == world_size
    source = counts
    while source.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                            torch.ops._c10d_functional.wait_tensor.default):
        source = source.args[0]
    assert source.target is torch.ops._c10d_functional.all_to_all_single.default
    # its index feeds the unpermute (index_put), its counts the grouped GEMMs' group list
    index, per_expert = (next(u for u in re_routing.users if u.args[1] == i) for i in (2, 3))
    assert any(torch.ops.aten.index_put.default in {u2.target for u2 in u.users} for u in index.users)
    gemms = _calls(gm, "npu.npu_grouped_matmul")
    assert all(_reads(g.kwargs["group_list"], per_expert) for g in gemms)
    # MC2 stays out, and says why
    (mc2,) = near_miss_reasons(report, "moe_dispatch")
    assert "MC2" in mc2 and "no EP group is declared dedicated (FusionConfig(ep_group=...))" in mc2, mc2
    assert "cannot prove that the EP group carries no other communication" in mc2


def test_symbolic_batch_and_sequence_fuse_the_same():
    """dynamic=True: the tokens per rank are symbolic too (T = B * L), on top of the
    data-dependent rows the exchange receives."""
    _, report = capture("deepseek_v3", 2, dynamic=True)
    assert report.fused_ops == EP_FUSED


def _reads(node, source, depth=6):
    """`node` is computed from `source` (through at most `depth` ops)."""
    if node is source:
        return True
    return depth > 0 and any(_reads(a, source, depth - 1) for a in node.all_input_nodes)


def test_the_re_routed_counts_group_the_gemms_exactly_as_the_models():
    """The GEMMs' group list is re_routing's per-expert counts, read as counts
    (group_list_type 1): the op sums them into the offsets torchtitan's GroupedExperts builds
    from _permute's t_mat.sum(0) with a cumsum, which is gone."""
    gm, _ = capture("deepseek_v3", 2)
    (re_routing,) = _calls(gm, "npu.npu_moe_re_routing")
    per_expert = next(u for u in re_routing.users if u.args[1] == 3)
    gemms = _calls(gm, "npu.npu_grouped_matmul")
    assert len(gemms) == 3
    for gemm in gemms:
        assert gemm.kwargs["group_list_type"] == 1 and _reads(gemm.kwargs["group_list"], per_expert, 2)
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.cumsum.default]


def test_torchairs_all_to_all_spelling_fuses_too():
    """torchair's default decompositions turn the functional all_to_all_single into
    npu_define.all_to_all_single_npu with element counts (split * H) before our passes see
    the graph; run in a subprocess with the wheel's torchair imported behind the stubs.

    torchair 2.13's decomposition cannot trace the reverse exchange: its input has the
    data-dependent row count the dispatch received, and hcom_alltoall.py:136 branches on
    `out_size[0] == 0` (GuardOnDataDependentSymNode): with torchair's table as it is, the EP
    layer does not compile in one graph (docs/expert-parallel.md; when torchair fixes it,
    the first assertion says so). Where it raises, the functional op is traced instead:
    the dispatch side (count and token exchange) is then in torchair's spelling, the
    combine side in torch's, and every form fuses."""
    as_is, where_it_traces = run_scenario(scenario_torchair_all_to_all_spelling, timeout=900)
    assert as_is["error"].startswith("GuardOnDataDependentSymNode"), as_is
    assert "hcom_alltoall.py" in as_is["error"] and "Eq(u2 + u3, 0)" in as_is["error"]
    result = where_it_traces
    assert result["all_to_all_single_npu"] == 2 and result["functional_all_to_all"] == 1
    assert result["counts"] == {"moe_dispatch": 3, "grouped_matmul": 3}
    assert result["fused_ops"] == EP_FUSED
    assert len(result["near_misses"]) == 1 and "MC2" in result["near_misses"][0]


def scenario_torchair_all_to_all_spelling():
    """(in the torchair harness's child) the fake-PG capture with torchair's own
    decomposition table (torchair._utils.get_npu_default_decompositions, the one its
    backend hands aot_autograd): as it is, and tracing the functional op where torchair's
    decomposition raises on a data-dependent size."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    from torchair._utils import get_npu_default_decompositions

    functional = torch.ops._c10d_functional.all_to_all_single.default
    try:
        capture("deepseek_v3", 2, decompositions=get_npu_default_decompositions())
        as_is = {"error": None}
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        as_is = {"error": f"{type(exc.inner_exception).__name__}: {exc.inner_exception}"}

    decompositions = get_npu_default_decompositions()
    torchairs = decompositions[functional]

    def where_it_traces(*args, **kwargs):
        try:
            return torchairs(*args, **kwargs)
        except GuardOnDataDependentSymNode:
            return NotImplemented  # aot traces the op itself then

    decompositions[functional] = where_it_traces
    gm, report = capture("deepseek_v3", 2, decompositions=decompositions)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return as_is, {"all_to_all_single_npu": targets.count("npu_define.all_to_all_single_npu.default"),
                   "functional_all_to_all": targets.count("_c10d_functional.all_to_all_single.default"),
                   "counts": {p: n for p, n in report.counts.items() if n},
                   "fused_ops": dict(report.fused_ops),
                   "near_misses": near_miss_reasons(report, "moe_dispatch")}


def test_verification_runs_the_reorder_and_leaves_the_data_dependent_sides_to_the_gloo_tests():
    """FusionConfig(verify=True): the reorder's inputs have static shapes and it verifies
    exactly (a copy); the regroup's and the combine's rows have data-dependent sizes, which
    verification cannot draw random inputs for: the gloo tests below check them."""
    _, report = capture("deepseek_v3", 2, config=nff.FusionConfig(enable={"moe_dispatch"}, verify=True))
    verdicts = {site.form: site.verified for site in report.sites}
    assert verdicts["torchtitan_ep_local_reorder"].startswith("verified: max error 0 ulp"), verdicts
    assert verdicts["torchtitan_ep_permute"] == "not verified: argument received has symbolic or unsupported shape"
    assert verdicts["torchtitan_ep_combine"].startswith("not verified: argument expert_out has symbolic")


# ---- where it must not fuse ------------------------------------------------------------------
def _unchanged_counts(original):
    """_sync_token_count_exchange handing on the local counts where the received ones belong."""

    def sync(self, local_counts, received, ep_size):
        _, input_splits, output_splits = original(self, local_counts, received, ep_size)
        return local_counts, input_splits, output_splits

    return sync


def _swapped_splits(original):
    """The token exchange with its split sizes swapped."""

    def exchange(self, routed, pg, output_splits, input_splits):
        return original(self, routed, pg, input_splits, output_splits)

    return exchange


@pytest.mark.parametrize("method, replacement, reason", [
    ("_sync_token_count_exchange", _unchanged_counts, "the counts are not a view of a count all-to-all's output"),
    ("_dispatch_token_exchange", _swapped_splits,
     "the rows received from rank 0 (_local_scalar_dense) are not the sum of row 0 of the received counts"),
], ids=["local counts", "swapped splits"])
def test_the_regroup_fuses_only_where_the_graph_proves_its_counts(monkeypatch, method, replacement, reason):
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    monkeypatch.setattr(AllToAllTokenDispatcher, method, replacement(getattr(AllToAllTokenDispatcher, method)))
    _, report = capture("deepseek_v3", 2)
    assert report.fused_ops.get("npu.npu_moe_re_routing", 0) == 0
    # the other sides still fuse: each is exact on its own
    assert report.fused_ops["npu.npu_moe_init_routing_v2"] == report.fused_ops["npu.npu_moe_finalize_routing"] == 1
    misses = near_miss_reasons(report, "moe_dispatch")
    assert any(reason in miss for miss in misses), misses


def test_fp32_tokens_are_not_re_routed():
    _, report = capture("deepseek_v3", 2, dtype=torch.float32)
    assert report.fused_ops.get("npu.npu_moe_re_routing", 0) == 0
    assert report.fused_ops["npu.npu_moe_init_routing_v2"] == report.fused_ops["npu.npu_moe_finalize_routing"] == 1
    assert "npu.npu_moe_re_routing does not support float32" in near_miss_reasons(report, "moe_dispatch")


def test_310p_has_none_of_the_routing_ops():
    _, report = capture("deepseek_v3", 2, config=nff.FusionConfig(enable={"moe_dispatch"}, soc="Ascend310P"))
    assert report.counts["moe_dispatch"] == 0
    misses = near_miss_reasons(report, "moe_dispatch")
    for op in ("npu_moe_init_routing_v2", "npu_moe_re_routing", "npu_moe_finalize_routing"):
        assert f"npu.{op} is not available on Ascend310P" in misses, (op, misses)


def test_deepseek_router_fuses_in_front_of_the_ep_dispatch():
    """DeepSeek-V3's own router (sigmoid, node-limited groups, route_norm) in fp32 scores:
    its experts feed only the fused dispatch and the routing map, indifferent to the order
    of each token's k experts, so moe_gating fuses it too."""
    _, report = capture("deepseek_v3", 2, dtype=torch.float32, score_func="sigmoid", num_expert_groups=2,
                        num_limited_groups=1, route_norm=True, route_scale=2.5)
    assert report.fused_ops.get("npu.npu_moe_gating_top_k") == 1, near_miss_reasons(report, "moe_gating")


def test_the_mc2_ops_have_torchairs_converters():
    """The MC2 ops' capability rows (quoted by the near miss and the check) say truly that
    torchair 2.13 could lower them (a GE converter each), as the other emitted ops' rows do."""
    from test_capabilities import _wheel_ge_converters

    from npu_fx_fusion.capabilities import CAPABILITIES

    converters = _wheel_ge_converters()
    for op in ("npu.npu_moe_distribute_dispatch_v2", "npu.npu_moe_distribute_combine_v2"):
        assert CAPABILITIES[op].ge_converter and op in converters, op


# ---- MC2 on a declared EP group ----------------------------------------------------------------
MC2_FUSED = {"npu.npu_moe_distribute_dispatch_v2": 1, "npu.npu_grouped_matmul": 3, "npu.npu_moe_distribute_combine_v2": 1}


# MC2's hidden sizes: (0, 7168] in multiples of 32 on A2, but there in 16 to 256 EP ranks;
# [1024, 8192] on A3, from 2 ranks. So the 2-rank layers MC2 takes have H = 1024 (on A3)
MC2_DIM = 1024


def _declaring(group=lambda tm: tm.process_groups["ep"], **settings):
    """A config function for capture(): the built layer's EP group declared dedicated."""
    return lambda tm: nff.FusionConfig(enable=MOE_PASSES, ep_group=group(tm), **settings)


def test_mc2_replaces_the_whole_layer_on_a_declared_ep_group():
    gm, report = capture("deepseek_v3", 2, config=_declaring(), dim=MC2_DIM)
    assert report.fused_ops == MC2_FUSED, report.fused_ops
    assert near_miss_reasons(report, "moe_dispatch") == []
    ops = report.graphs[0].ops_after
    # the collectives, the .tolist() syncs and their runtime asserts went with the region,
    # and the routing map only the count exchange read
    for gone in ("_c10d_functional.all_to_all_single.default", "aten._local_scalar_dense.default",
                 "aten._assert_scalar.default", "aten.scatter.value", "npu.npu_moe_re_routing.default",
                 "npu.npu_moe_init_routing_v2.default", "npu.npu_moe_finalize_routing.default"):
        assert ops[gone] == 0, gone
    (dispatch,) = _calls(gm, "npu.npu_moe_distribute_dispatch_v2")
    (combine,) = _calls(gm, "npu.npu_moe_distribute_combine_v2")
    assert dispatch.args[2:] == (combine.args[5], 2, 0, 8)  # group_ep, ranks, rank, experts
    # the GEMMs group dispatch_v2's rows by its per-expert counts; combine_v2 reads its assist
    # info and receive counts, and the scores in fp32
    expand_x, assist, per_expert, recv_counts = (next(u for u in dispatch.users if u.args[1] == i) for i in (0, 2, 3, 4))
    gemms = _calls(gm, "npu.npu_grouped_matmul")
    assert all(_reads(g.kwargs["group_list"], per_expert) for g in gemms)
    assert sum(g.args[0][0] is expand_x for g in gemms) == 2
    assert combine.args[2] is assist and combine.args[3] is recv_counts
    assert combine.args[4].meta["val"].dtype == torch.float32


def test_mc2_with_symbolic_tokens_is_a_near_miss():
    """dynamic=True: the tokens per rank are symbolic, MC2's batch limit cannot be checked."""
    _, report = capture("deepseek_v3", 2, config=_declaring(), dynamic=True, dim=MC2_DIM)
    assert report.fused_ops == EP_FUSED
    (mc2,) = near_miss_reasons(report, "moe_dispatch")
    assert "are symbolic: MC2's batch limit cannot be checked" in mc2, mc2


@pytest.mark.parametrize("flavor, dim, settings, reasons", [
    ("deepseek_v3", 64, {"soc": "Ascend910_93"}, ["hidden size 64 is outside Ascend910_93's [1024, 8192]"]),
    ("deepseek_v3", MC2_DIM, {"soc": "Ascend910B"}, ["2 EP ranks: MC2 on Ascend910B takes [16, 32, 64, 128, 256]"]),
    # in emulation (no SoC) a layer no SoC takes: every SoC's reasons
    ("qwen3", 64, {}, ["32 local experts: MC2 on Ascend910B takes at most 24",
                       "hidden size 64 is outside Ascend910_93's [1024, 8192]"]),
], ids=["A3 hidden size", "A2 rank count", "no SoC"])
def test_mc2_outside_the_documented_limits_is_a_near_miss(flavor, dim, settings, reasons):
    _, report = capture(flavor, 2, config=_declaring(**settings), dim=dim)
    assert "npu.npu_moe_distribute_dispatch_v2" not in report.fused_ops
    misses = near_miss_reasons(report, "moe_dispatch")
    assert any("MC2" in miss and all(reason in miss for reason in reasons) for miss in misses), misses


def test_mc2_above_the_batch_limit_is_a_near_miss():
    """600 tokens per rank: above the A3 limit of 512."""
    _, report = capture("deepseek_v3", 2, config=_declaring(soc="Ascend910_93"), batch=6, seq_len=100, dim=MC2_DIM)
    assert report.fused_ops.get("npu.npu_moe_distribute_dispatch_v2", 0) == 0
    (mc2,) = near_miss_reasons(report, "moe_dispatch")
    assert "600 tokens per rank exceed MC2's batch limit on Ascend910_93 (512)" in mc2, mc2


def test_mc2_on_another_group_than_the_declared_one_is_a_near_miss():
    """The user declared a group, but the layer exchanges its tokens on another one."""
    import torch.distributed as dist

    _, report = capture("deepseek_v3", 2, config=_declaring(group=lambda tm: dist.new_group([0, 1])), dim=MC2_DIM)
    assert report.fused_ops == EP_FUSED
    (mc2,) = near_miss_reasons(report, "moe_dispatch")
    assert "the exchange runs on group '0', not on the EP group declared dedicated" in mc2, mc2


def test_mc2_in_a_training_graph_is_a_near_miss():
    _, report = capture("deepseek_v3", 2, config=_declaring(), training=True, dim=MC2_DIM)
    assert "npu.npu_moe_distribute_dispatch_v2" not in report.fused_ops
    misses = near_miss_reasons(report, "moe_dispatch")
    assert any("MC2" in miss and "this is a training graph: MC2 has no backward" in miss for miss in misses), misses


# ---- real ranks over gloo ----------------------------------------------------------------------
@pytest.mark.multiprocess
def test_the_harness_runs_gloo_ranks_on_loopback():
    results = run_on_ranks(worker_all_reduce, 2, timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)


@pytest.mark.multiprocess
def test_a_hanging_collective_fails_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 0 failed"):
        run_on_ranks(worker_skips_a_collective, 2, timeout=120, collective_timeout=3)
    assert time.monotonic() - start < 90


@pytest.mark.multiprocess
def test_a_rank_that_never_returns_is_killed():
    start = time.monotonic()
    # (rank 0 returns at once; on a loaded machine it may still be starting when the time is up)
    with pytest.raises(RanksFailed, match=r"^(rank0, )?rank1 did not finish within 6 s \(killed\)"):
        run_on_ranks(worker_never_returns, 2, timeout=6)
    assert time.monotonic() - start < 40


def worker_forward(rank, world_size, flavors, mc2=False):
    """Eager and fused forward of each flavor's EP MoE layer on this rank; with `mc2`, its
    EP group declared dedicated (FusionConfig(ep_group=...))."""
    from npu_fx_fusion.tiny_models import build_torchtitan_ep_moe

    results = {}
    for flavor in flavors:
        torch._dynamo.reset()
        tm = build_torchtitan_ep_moe(flavor, **({"dim": MC2_DIM} if mc2 else {}))
        ep_group = {"ep_group": tm.process_groups["ep"]} if mc2 else {}
        backend = RecordingBackend(nff.FusionConfig(enable=MOE_PASSES, **ep_group))
        with torch.no_grad(), _dynamic_sizes():
            eager = tm.model(*tm.example_inputs)
            fused = torch.compile(tm.model, backend=backend, fullgraph=True)(*tm.example_inputs)
            unfused = None
            if mc2:  # the same compile without fusion (see _assert_mc2_forward_matches)
                torch._dynamo.reset()
                unfused = torch.compile(tm.model, backend=RecordingBackend(nff.FusionConfig(enable=set())),
                                        fullgraph=True)(*tm.example_inputs)
        (graph,) = backend.report.graphs
        results[flavor] = {
            "eager": eager, "fused": fused, "unfused": unfused, "top_k": tm.model.router.top_k,
            "fused_ops": dict(backend.report.fused_ops), "errors": backend.report.errors,
            "near_misses": near_miss_reasons(backend.report, "moe_dispatch"),
            "launches": (graph.cost_before.launches, graph.cost_after.launches),
        }
    return results


def _assert_forward_matches(results):
    for rank, per_flavor in enumerate(results):
        for flavor, result in per_flavor.items():
            assert result["errors"] == [], (rank, flavor)
            assert result["fused_ops"] == {**EP_FUSED, **EP_ROUTERS.get(flavor, {})}, (rank, flavor, result["fused_ops"])
            (mc2,) = result["near_misses"]
            assert "MC2" in mc2 and "no EP group is declared dedicated (FusionConfig(ep_group=...))" in mc2, mc2
            assert_close_at_scale(result["fused"], result["eager"], result["top_k"])
            before, after = result["launches"]
            assert after < before, (rank, flavor, before, after)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, flavors", [
    (2, ("deepseek_v3",)),  # the default slice: one flavor, two ranks (about 30 s on two cores)
    pytest.param(2, ("qwen3",), marks=pytest.mark.slow),
    pytest.param(4, FLAVORS, marks=pytest.mark.slow),  # 4 ranks on the shared cores
], ids=["2-deepseek_v3", "2-qwen3", "4-both"])
def test_forward_matches_eager(world_size, flavors):
    _assert_forward_matches(run_on_ranks(worker_forward, world_size, flavors=flavors))


def _assert_mc2_forward_matches(results):
    for rank, per_flavor in enumerate(results):
        for flavor, result in per_flavor.items():
            assert result["errors"] == [] and result["near_misses"] == [], (rank, flavor, result["near_misses"])
            # the router fuses too on gloo ranks (its ids feed only MC2): deepseek_v3's and qwen3's
            assert result["fused_ops"] == {**MC2_FUSED, "npu.npu_moe_gating_top_k": 1}, (rank, flavor, result["fused_ops"])
            # combine_v2 adds each token's k fp32 products and rounds once, torchtitan rounds
            # every weighted row to bf16 and adds in bf16: k roundings apart at the output's scale.
            # Against the same graph compiled without fusion: at H = 1024 the compiled layer (as
            # an NPU compile traces it) differs from eager on a token or two of some ranks by
            # far more than rounding, with every pass off too (the compile's doing, probably
            # the bf16 router choosing another expert; not traced further): the passes are
            # what is tested here
            assert_close_at_scale(result["fused"], result["unfused"], result["top_k"])
            # and on every token where the unfused compile agrees with eager, so does MC2
            eager, unfused = result["eager"], result["unfused"]
            bound = result["top_k"] * ulp(eager.abs().max().reshape(1)).double()
            agree = ((unfused.double() - eager.double()).abs() <= bound).all(-1)
            assert agree.any(), (rank, flavor)
            assert_close_at_scale(result["fused"][agree], eager[agree], result["top_k"])
            before, after = result["launches"]
            assert after < before, (rank, flavor, before, after)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size, flavors", [
    (2, ("deepseek_v3",)),  # the default slice: MC2 over gloo on two ranks
    pytest.param(2, ("qwen3",), marks=pytest.mark.slow),  # 32 local experts: A3 only
    pytest.param(4, ("deepseek_v3",), marks=pytest.mark.slow),
], ids=["2-deepseek_v3", "2-qwen3", "4-deepseek_v3"])
def test_mc2_forward_matches_eager(world_size, flavors):
    _assert_mc2_forward_matches(run_on_ranks(worker_forward, world_size, flavors=flavors, mc2=True))


def worker_training_step(rank, world_size, flavor):
    """Eager and fused gradients of one step of `flavor`'s EP MoE layer on this rank: of the
    input tokens and of every parameter (the expert weights' local shards)."""
    from torch.distributed.tensor import DTensor

    from helpers import npu_ops
    from npu_fx_fusion.tiny_models import build_torchtitan_ep_moe

    torch._dynamo.reset()
    tm = build_torchtitan_ep_moe(flavor)
    model = tm.model.train()
    (x,) = tm.example_inputs

    def gradients(module):
        model.zero_grad(set_to_none=True)
        tokens = x.detach().clone().requires_grad_(True)
        with _dynamic_sizes():
            module(tokens).float().pow(2).mean().backward()
        grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for name, p in model.named_parameters()}
        return tokens.grad, grads

    backend = RecordingBackend(nff.FusionConfig(enable=MOE_PASSES))
    eager = gradients(model)
    fused = gradients(torch.compile(model, backend=backend, fullgraph=True))
    return {"eager": eager, "fused": fused, "top_k": model.router.top_k, "errors": backend.report.errors,
            "forward_ops": npu_ops(backend.graphs["forward"]), "backward_ops": npu_ops(backend.graphs["backward"])}


def _assert_training_matches(results):
    for rank, result in enumerate(results):
        assert result["errors"] == [], rank
        assert result["forward_ops"] == EP_TRAINED_FORWARD, (rank, result["forward_ops"])
        backward = result["backward_ops"]
        # permute's and unpermute's grads; re_routing's rule: npu_moe_token_unpermute;
        # each expert GEMM's rule: dx and dw, npu_grouped_matmul group_type 0 and 2
        assert backward["npu_moe_token_permute_grad_v2"] == backward["npu_moe_token_unpermute_grad_v2"] == 1
        assert backward["npu_moe_token_unpermute"] == 1 and backward["npu_grouped_matmul"] == 6, backward
        (eager_x, eager_params), (fused_x, fused_params) = result["eager"], result["fused"]
        assert_close_at_scale(fused_x, eager_x, result["top_k"])
        for name, grad in eager_params.items():
            try:
                assert_close_at_scale(fused_params[name], grad, result["top_k"])
            except AssertionError as exc:
                raise AssertionError(f"rank {rank} {name}.grad: {exc}") from None


@pytest.mark.multiprocess
@pytest.mark.slow  # a training step compiles the joint graph on every rank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_training_step_matches_eager_gradients(flavor, world_size):
    _assert_training_matches(run_on_ranks(worker_training_step, world_size, flavor=flavor))
