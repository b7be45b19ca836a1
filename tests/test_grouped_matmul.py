"""grouped_matmul: the MoE expert GEMM fuses into npu_grouped_matmul with the same numbers.

Tolerance: both compute each row's dot products in fp32 and round once (the stand-in
and torch's CPU _grouped_mm alike), so the results agree to 1 ulp; fp32 to float
rounding of the summation order.
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import RecordingBackend, assert_close_at_scale, assert_within_ulps, compile_and_run, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.report import fused_op_counts, op_counts

ONLY_GMM = nff.FusionConfig(enable={"grouped_matmul"})


class ExpertGemm(torch.nn.Module):
    """x sorted by expert times per-expert weights, the way transformers / torchtitan call it."""

    def __init__(self, experts=3, k=16, n=8, transposed=True, fallback=False):
        super().__init__()
        torch.manual_seed(0)
        shape = (experts, n, k) if transposed else (experts, k, n)
        self.weight = torch.nn.Parameter(torch.randn(*shape) * 0.2)
        self.transposed, self.fallback = transposed, fallback

    def forward(self, x, offs):
        w = self.weight.transpose(-2, -1) if self.transposed else self.weight
        if self.fallback:
            return torch.ops.transformers.grouped_mm_fallback(x, w.to(x.dtype), offs)
        return torch._grouped_mm(x, w.to(x.dtype), offs)


def _inputs(dtype, rows=24, k=16, ends=(8, 8, 24), offs_dtype=torch.int32):
    torch.manual_seed(1)
    return torch.randn(rows, k).to(dtype), torch.tensor(ends, dtype=offs_dtype)


def _check(out, ref):
    assert_within_ulps(out, ref, 1)


@pytest.mark.parametrize("transposed", [True, False], ids=["w (E,N,K)^T", "w (E,K,N)"])
def test_aten_grouped_mm_fuses(transposed):
    # torch's _grouped_mm takes bf16 and int32 offsets only; fp32 models reach the
    # transformers fallback op below
    x, offs = _inputs(torch.bfloat16)  # the second expert gets no rows
    out, ref, report = compile_and_run(ExpertGemm(transposed=transposed), x, offs, config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 1
    assert report.fused_ops == {"npu.npu_grouped_matmul": 1}
    assert report.graphs[0].ops_after["aten._grouped_mm.default"] == 0
    _check(out, ref)


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64], ids=str)
def test_transformers_fallback_op_fuses(offs_dtype):
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers)

    x, offs = _inputs(torch.float32, offs_dtype=offs_dtype)
    out, ref, report = compile_and_run(ExpertGemm(fallback=True), x, offs, config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 1
    assert [s.form for s in report.sites] == ["transformers_grouped_mm_fallback"]
    _check(out, ref)


def test_verification_uses_valid_offsets():
    x, offs = _inputs(torch.bfloat16)
    config = nff.FusionConfig(enable={"grouped_matmul"}, verify=True)
    _, _, report = compile_and_run(ExpertGemm(), x, offs, config=config)
    (site,) = report.sites
    assert site.verified.startswith("verified: max error"), site.verified


class StridedWeight(ExpertGemm):
    def __init__(self):
        super().__init__(transposed=False)
        self.big = torch.nn.Parameter(torch.randn(3, 32, 8, dtype=torch.bfloat16))  # no cast: a view

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.big[:, ::2, :].to(x.dtype), offs)  # every other row of K


@pytest.mark.parametrize("module, config, reason", [
    (StridedWeight(), ONLY_GMM, "weight strides"),
    (ExpertGemm(), nff.FusionConfig(enable={"grouped_matmul"}, soc="Ascend310P"), "does not support bfloat16"),
    (ExpertGemm(experts=1025), ONLY_GMM, "1025 experts"),
], ids=["strided weight", "310P bf16", "too many experts"])
def test_does_not_fuse_and_says_why(module, config, reason):
    experts, k = module.weight.shape[0], 16
    ends = [(e + 1) * 24 // experts for e in range(experts)]
    x, offs = _inputs(torch.bfloat16, rows=24, k=k, ends=ends)
    out, ref, report = compile_and_run(module, x, offs, config=config)
    assert report.counts["grouped_matmul"] == 0
    (miss,) = near_miss_reasons(report, "grouped_matmul")
    assert reason in miss, miss
    torch.testing.assert_close(out, ref)


class CountedExperts(torch.nn.Module):
    """Two expert GEMMs on offsets the model sums from its per-expert counts, as transformers'
    grouped_mm_experts_forward does (`cumsum(tokens_per_expert, dtype=torch.int32)`)."""

    def __init__(self, through_float=False):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Parameter((torch.randn(3, 16, 16) * 0.2).bfloat16())
        self.down = torch.nn.Parameter((torch.randn(3, 8, 16) * 0.2).bfloat16())
        self.through_float = through_float

    def forward(self, x, counts):
        if self.through_float:  # a float running sum: not the integer one the op computes
            offs = torch.cumsum(counts.float(), 0).to(torch.int32)
        else:
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch._grouped_mm(x, self.up.transpose(-2, -1), offs)
        return torch._grouped_mm(h, self.down.transpose(-2, -1), offs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_offsets_summed_from_counts_are_read_as_the_counts(dynamic):
    """group_list_type 1: the op sums the counts itself, and the cumsum and the casts to int32
    and back to the op's int64 are no longer launched."""
    x = torch.randn(24, 16).to(torch.bfloat16)
    counts = torch.tensor([8, 0, 16])  # int64, as init_routing_v2 counts; an expert without rows
    out, ref, report = compile_and_run(CountedExperts(), x, counts, config=ONLY_GMM, dynamic=dynamic)
    assert report.counts["grouped_matmul"] == 2
    ops = report.graphs[0].ops_after
    assert ops["aten.cumsum.default"] == 0 and ops["aten._to_copy.default"] == 0, dict(ops)
    _check(out, ref)


def test_offsets_summed_in_floating_point_keep_their_running_sum():
    x = torch.randn(24, 16).to(torch.bfloat16)
    out, ref, report = compile_and_run(CountedExperts(through_float=True), x, torch.tensor([8, 0, 16]),
                                       config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 2
    assert report.graphs[0].ops_after["aten.cumsum.default"] == 1
    _check(out, ref)


class ExpertsInALoop(torch.nn.Module):
    """torchtitan's GroupedExperts with use_grouped_mm=False (_run_experts_for_loop): the rows
    split by per-expert counts, a gated MLP per expert on its rows, the results concatenated.
    `expert_of(i)`: the expert whose weights chunk i meets (a look-alike when not i)."""

    def __init__(self, experts=4, dim=16, hidden=32, expert_of=None, scale_of=None):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)
        self.expert_of = expert_of or (lambda i: i)
        self.scale_of = scale_of or (lambda i: 1.0)

    def forward(self, x, counts):
        outs = []
        for i, rows in enumerate(torch.split(x, counts)):
            e = self.expert_of(i)
            h = torch.nn.functional.silu(rows @ self.w1[e].transpose(-2, -1)) * (rows @ self.w3[e].transpose(-2, -1))
            outs.append(h * self.scale_of(i) @ self.w2[e].transpose(-2, -1))
        return torch.cat(outs)


def _gemms_left(report):
    return report.graphs[0].ops_after.get("aten.matmul.default", 0) + report.graphs[0].ops_after.get("aten.mm.default", 0)


def test_experts_run_one_by_one_fuse_as_one_grouped_gemm_per_weight():
    """Each weight's per-expert GEMMs become one npu_grouped_matmul over the split's rows, the
    gated activation between them runs once on all rows; an expert without rows included."""
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(ExpertsInALoop(), x, [3, 0, 4, 3], config=ONLY_GMM)
    assert report.fused_ops == {"npu.npu_grouped_matmul": 3}
    assert _gemms_left(report) == 0
    assert report.graphs[0].ops_after["aten.silu.default"] == 1
    _check(out, ref)


def test_experts_run_one_by_one_fuse_with_dynamic_counts():
    """With dynamic shapes the counts read on the host are symbolic sizes: the group list is
    built from them in the graph, and other counts run the same graph."""
    model = ExpertsInALoop()
    backend = EmulationBackend(ONLY_GMM)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for counts in ([3, 2, 4, 5], [6, 2, 3, 3]):
        x = torch.randn(sum(counts), 16)
        with torch.no_grad():
            _check(compiled(x, counts), model(x, counts))
    assert backend.report.fused_ops == {"npu.npu_grouped_matmul": 3}
    assert len(backend.report.graphs) == 1


class AutocastExperts(ExpertsInALoop):
    """The loop under bf16 autocast (torchtitan's mixed precision): each matmul reads a bf16
    copy of its expert's fp32 weight and of its rows."""

    def forward(self, x, counts):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x, counts)


def test_experts_run_one_by_one_under_autocast_fuse_with_the_weights_cast_once():
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(AutocastExperts(), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.fused_ops == {"npu.npu_grouped_matmul": 3}
    assert _gemms_left(report) == 0
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_within_ulps(out, ref, 1)


@pytest.mark.parametrize("experts, counts", [
    (lambda: ExpertsInALoop(), [3, 2, 4, 1]), (lambda: ExpertsInALoop(), [0, 10, 0, 0]),
    (lambda: ExpertModules(), [3, 2, 4, 1]),  # (defined below)
], ids=["spread", "all to one expert", "weights of their own"])
def test_experts_run_one_by_one_in_training_fuse_their_forward(experts, counts):
    """The joint graph keeps the loop (its backward is a GEMM per expert and gradient): a near
    miss there; the forward graph fuses, the gradients are eager's, whether the experts' weights
    are stacked or each expert's own (ExpertModules, below). A chunk of all the rows is the rows
    themselves in the forward graph (aot drops a slice that takes them all)."""
    model, reference = experts(), experts()
    x = torch.randn(10, 16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    backend = RecordingBackend(ONLY_GMM)
    out = torch.compile(model, backend=backend, fullgraph=True)(xs[0], counts)
    ref = reference(xs[1], counts)
    probe = torch.randn_like(ref)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    _check(out, ref)
    for a, b in [(xs[0].grad, xs[1].grad)] + [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]:
        assert_close_at_scale(a, b, 4)
    assert dict(fused_op_counts(op_counts(backend.graphs["forward"].graph))) == {"npu.npu_grouped_matmul": 3}
    reasons = near_miss_reasons(backend.report, "grouped_matmul")
    assert len(reasons) == 3 and all("in training" in r for r in reasons), reasons


@pytest.mark.parametrize("expert_of, scale_of, why, fused", [
    # chunk i meets expert 3 - i: each weight's GEMMs read the rows in another order
    (lambda i: 3 - i, None, "the experts' row slices do not cover the rows in order", 0),
    # a per-expert factor between the GEMMs: w1 and w3 group, w2's rows are not one computation
    (None, lambda i: 1.0 + i, "differ in argument 1", 2),
], ids=["experts in reverse", "a per-expert scale"])
def test_a_loop_that_is_not_the_grouped_gemm_is_a_near_miss(expert_of, scale_of, why, fused):
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(ExpertsInALoop(expert_of=expert_of, scale_of=scale_of), x, [3, 2, 4, 1],
                                       config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == fused
    reasons = near_miss_reasons(report, "grouped_matmul")
    assert len(reasons) == 3 - fused and any(why in r for r in reasons), reasons
    torch.testing.assert_close(out, ref)


class SomeExperts(ExpertsInALoop):
    """Only the first three of four experts run: not one GEMM over the whole weight."""

    def forward(self, x, counts):
        return torch.cat([rows @ self.w1[i].transpose(-2, -1) for i, rows in enumerate(torch.split(x, counts))])


def test_a_loop_over_some_of_the_experts_is_a_near_miss():
    x = torch.randn(9, 16)
    out, ref, report = compile_and_run(SomeExperts(), x, [3, 2, 4], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 0
    reasons = near_miss_reasons(report, "grouped_matmul")
    assert reasons == ["3 of the 4 experts of a (4, 32, 16) weight run one by one (a matmul per expert on its rows): "
                       "not every expert's, so not one grouped GEMM over the weight"], reasons
    torch.testing.assert_close(out, ref)


def test_one_expert_weight_reused_for_every_chunk_is_no_expert_loop():
    x = torch.randn(10, 16)
    _, _, report = compile_and_run(ExpertsInALoop(expert_of=lambda i: 1), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 0
    assert near_miss_reasons(report, "grouped_matmul") == []


class MergedExpertsInALoop(torch.nn.Module):
    """Experts run one by one with a merged gate_up projection (transformers' stacked
    `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)): each expert's product cut in two
    along its columns, `chunk(2, -1)`. `rows_op`: what the up half goes through (a look-alike
    when it mixes rows); `up_read_outside`: the up halves returned, not multiplied in."""

    def __init__(self, experts=4, dim=16, hidden=32, rows_op=None, up_read_outside=False):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * hidden, dim) * 0.2)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.rows_op, self.up_read_outside = rows_op or (lambda t: t), up_read_outside

    def forward(self, x, counts):
        outs, ups = [], []
        for e, rows in enumerate(torch.split(x, counts)):
            gate, up = torch.nn.functional.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            ups.append(up)
            other = gate if self.up_read_outside else self.rows_op(up)
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * other, self.down_proj[e]))
        return (torch.cat(outs), *ups) if self.up_read_outside else torch.cat(outs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_experts_with_a_merged_gate_up_fuse_and_their_activation_fuses_once(dynamic):
    """The column halves of each expert's product are cut from the whole product: the loop is
    two grouped GEMMs, and the activation between them, which the swiglu pass fused per
    expert, one npu_swiglu over all rows (it computes each row from that row's halves).
    Tolerance: the GEMMs are exact (see the top); npu_swiglu's stand-in computes silu(a) * b
    as eager does."""
    model = MergedExpertsInALoop()
    backend = EmulationBackend(nff.FusionConfig(enable={"grouped_matmul", "swiglu"}))
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    for counts in ([3, 1, 4, 3], [2, 5, 1, 2]):
        x = torch.randn(sum(counts), 16)
        with torch.no_grad():
            assert_within_ulps(compiled(x, counts), model(x, counts), 1)
    graph = backend.report.graphs[-1]
    assert graph.fused_ops == {"npu.npu_grouped_matmul": 2, "npu.npu_swiglu": 1}
    assert graph.ops_after.get("aten.mm.default", 0) + graph.ops_after.get("aten.matmul.default", 0) == 0


def test_a_merged_gate_up_loop_with_an_expert_without_rows_fuses():
    """With static counts an expert without rows has an empty product, which npu_swiglu does
    not take: the swiglu pass (before this one) fuses the other experts' activations only. The
    empty expert computes nothing, so its spelling does not keep the loop from rolling."""
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(MergedExpertsInALoop(), x, [3, 0, 4, 3])
    assert report.fused_ops == {"npu.npu_grouped_matmul": 2, "npu.npu_swiglu": 1}
    assert near_miss_reasons(report, "grouped_matmul") == []
    assert_within_ulps(out, ref, 1)


def test_the_halves_of_a_merged_gate_up_read_outside_the_loop_are_cut_from_the_whole():
    """The up halves returned, not multiplied in: they are the whole product's columns, cut
    by the experts' row counts, as each expert's were."""
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(MergedExpertsInALoop(up_read_outside=True), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 2
    for a, b in zip(out, ref, strict=True):
        assert_within_ulps(a, b, 1)


def test_a_merged_gate_up_loop_that_mixes_rows_rolls_only_its_first_gemm():
    x = torch.randn(10, 16)
    model = MergedExpertsInALoop(rows_op=lambda t: t.flip(0))  # each expert's rows reversed
    out, ref, report = compile_and_run(model, x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 1  # gate_up's GEMMs read the split rows themselves
    reasons = near_miss_reasons(report, "grouped_matmul")
    assert len(reasons) == 1 and "is not an op of each row alone" in reasons[0], reasons
    torch.testing.assert_close(out, ref)


class ExpertModules(torch.nn.Module):
    """Experts as an nn.ModuleList, each a gated MLP of its own nn.Linear layers (older
    transformers MoE blocks, hand-written MoE code), run one by one on the rows split by
    counts. `activation_of(e)`: expert e's activation (a look-alike when they differ)."""

    def __init__(self, experts=4, dim=16, hidden=32, activation_of=None, shared_weight=False, bias=False):
        super().__init__()
        torch.manual_seed(0)
        linear = lambda a, b: torch.nn.Linear(a, b, bias=bias)  # noqa: E731
        self.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict({"w1": linear(dim, hidden), "w3": linear(dim, hidden), "w2": linear(hidden, dim)})
            for _ in range(experts))
        if shared_weight:  # one MLP run on every chunk: no experts
            self.experts = torch.nn.ModuleList([self.experts[0]] * experts)
        self.activation_of = activation_of or (lambda e: torch.nn.functional.silu)

    def forward(self, x, counts):
        outs = []
        for e, (expert, rows) in enumerate(zip(self.experts, torch.split(x, counts))):
            outs.append(expert["w2"](self.activation_of(e)(expert["w1"](rows)) * expert["w3"](rows)))
        return torch.cat(outs)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_experts_with_weights_of_their_own_fuse_as_a_weight_list(dynamic):
    """Each layer of the experts' own weights is one npu_grouped_matmul taking the E weights as
    a list; with the default passes, each expert's gate and up merge (merged_projections) and
    the activation between the two grouped GEMMs runs once, as npu_swiglu. An expert without
    rows included (static counts). Tolerance: the GEMMs are exact (see the top)."""
    model = ExpertModules()
    backend = RecordingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    for counts in ([3, 1, 0, 6], [2, 5, 1, 2]):
        x = torch.randn(sum(counts), 16)
        with torch.no_grad():
            assert_within_ulps(compiled(x, counts), model(x, counts), 1)
    graph = backend.report.graphs[-1]
    assert graph.fused_ops == {"npu.npu_grouped_matmul": 2, "npu.npu_swiglu": 1}
    assert graph.ops_after.get("aten.mm.default", 0) + graph.ops_after.get("aten.matmul.default", 0) == 0
    calls = backend.graphs["inference"].graph.find_nodes(op="call_function",
                                                         target=torch.ops.npu.npu_grouped_matmul.default)
    assert [len(call.args[1]) for call in calls] == [4, 4]  # the four experts' weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_experts_with_biased_linears_of_their_own_fuse_with_a_bias_list(dtype):
    """nn.Linear with a bias is addmm per expert: the E biases go with the weights, as the op's
    per-group biases, fp32 for bf16 rows (the op's dtype rule; widening is exact). Tolerance:
    both add the bias to the fp32 product and round once (bf16: 1 ulp)."""
    model = ExpertModules(bias=True).to(dtype)
    x = torch.randn(10, 16, dtype=dtype)
    backend = RecordingBackend(ONLY_GMM)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x, [3, 2, 0, 5])
        ref = model(x, [3, 2, 0, 5])
    assert backend.report.fused_ops == {"npu.npu_grouped_matmul": 3}
    calls = backend.graphs["inference"].graph.find_nodes(op="call_function",
                                                         target=torch.ops.npu.npu_grouped_matmul.default)
    assert all(len(call.kwargs["bias"]) == 4 for call in calls)
    assert_within_ulps(out, ref, 1)


def test_experts_with_weights_of_their_own_fuse_each_linear_unmerged():
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(ExpertModules(), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.fused_ops == {"npu.npu_grouped_matmul": 3}
    assert _gemms_left(report) == 0
    _check(out, ref)


def test_experts_of_their_own_that_compute_differently_roll_only_their_alike_gemms():
    """Expert 1 gates with gelu: w1 and w3 still group (each reads its own rows), w2's rows
    are not one computation, a near miss that names the differing op."""
    gelu_for_one = lambda e: torch.nn.functional.gelu if e == 1 else torch.nn.functional.silu  # noqa: E731
    x = torch.randn(10, 16)
    out, ref, report = compile_and_run(ExpertModules(activation_of=gelu_for_one), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 2
    reasons = near_miss_reasons(report, "grouped_matmul")
    assert len(reasons) == 1 and "are not one op on each expert's rows" in reasons[0], reasons
    torch.testing.assert_close(out, ref)


def test_one_module_run_on_every_chunk_is_no_expert_loop():
    x = torch.randn(10, 16)
    _, _, report = compile_and_run(ExpertModules(shared_weight=True), x, [3, 2, 4, 1], config=ONLY_GMM)
    assert report.counts["grouped_matmul"] == 0
    assert near_miss_reasons(report, "grouped_matmul") == []


class CountedExpertModules(ExpertModules):
    """The counts read off a tensor (`.tolist()`, as torchtitan's experts do): a graph break,
    or, with dynamo's capture_scalar_outputs, sizes the graph computes (unbacked)."""

    def forward(self, x, counts):
        return super().forward(x, counts.tolist())


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_experts_with_counts_computed_in_the_graph_fuse(training):
    """Under capture_scalar_outputs the counts are unbacked sizes the graph computes: with the
    default passes each expert's gate and up merge (in training concatenated in the graph, so
    the weight is computed there from the parameters), and each layer's GEMMs roll (in
    training in the forward graph; the joint graph's loops are near misses). No pass error,
    eager's numbers."""
    model, reference = CountedExpertModules(), CountedExpertModules()
    counts = torch.tensor([3, 2, 4, 1])
    x = torch.randn(10, 16).requires_grad_(training)
    backend = EmulationBackend(nff.FusionConfig(strict=True))
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.set_grad_enabled(training):
        out = torch.compile(model, backend=backend, fullgraph=True)(x, counts)
        ref = reference(x, counts)
    assert_within_ulps(out, ref, 1)
    if training:
        grads = [torch.autograd.grad(y.sum(), list(m.parameters())) for y, m in ((out, model), (ref, reference))]
        for a, b in zip(*grads, strict=True):
            assert_close_at_scale(a, b, 4)
    assert backend.report.errors == []
    assert backend.report.counts["grouped_matmul"] == 2
    # each expert's activation runs on rows that may be none (an unbacked count): not npu_swiglu
    assert any("is or may be empty" in r for r in near_miss_reasons(backend.report, "swiglu"))
    reasons = near_miss_reasons(backend.report, "grouped_matmul")
    assert len(reasons) == (2 if training else 0) and all("in training" in r for r in reasons), reasons


class StoredInOutExperts(torch.nn.Module):
    """The loop with weights stored (E, in, out), read as `torch.mm(rows, w[e])`; chunk e meets
    expert E - 1 - e (a look-alike: not one grouped GEMM over the stacked weight)."""

    def __init__(self, experts=2, dim=16, hidden=32):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(experts, dim, hidden) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * 0.2)

    def forward(self, x, counts):
        n, outs = len(counts), []
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(torch.mm(rows, self.w1[n - 1 - e])) * torch.mm(rows, self.w3[n - 1 - e])
            outs.append(torch.mm(h, self.w2[n - 1 - e]))
        return torch.cat(outs)


def test_a_backward_graph_reading_saved_expert_weights_is_left_to_the_joint_graphs_near_miss():
    """The backward graph reads each expert's weight as a saved tensor of its own: its GEMMs
    are not rolled as experts holding their own weights (the look-alike, whose forward does
    not roll, fuses nothing anywhere; the joint graph's near misses say why)."""
    x = torch.randn(5, 16, requires_grad=True)
    backend = EmulationBackend(ONLY_GMM)
    torch.compile(StoredInOutExperts(), backend=backend, fullgraph=True)(x, [2, 3]).sum().backward()
    assert backend.report.counts["grouped_matmul"] == 0
    reasons = near_miss_reasons(backend.report, "grouped_matmul")
    assert reasons and not any("weights of their own" in r for r in reasons), reasons
