"""merged_projections: the linears of one input -> one linear on their concatenated weights.

Numerics: the merged linear computes each output column with the same dot product the
separate ones do; a BLAS may block a wider matmul differently, so fp32 results agree to
float rounding at the output's scale (measured 0 to 1 ulp); bf16 to 1-2 ulp. Compared at
the output's scale (helpers.assert_close_at_scale) with 4 ulp allowed.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
PASS = "merged_projections"


class AttentionInputs(nn.Module):
    """q/k/v and gate/up as transformers' Llama writes them (bias-free nn.Linear)."""

    def __init__(self, bias=False):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=bias)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = x + (q[..., :KV_HEADS * HEAD_DIM] * k + v).sum(-1, keepdim=True)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def _model(cls=AttentionInputs, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    return cls(**kwargs).to(dtype).eval()


def _run(model, x, config=None, dynamic=None):
    backend = EmulationBackend(config or nff.FusionConfig())
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        expected = model(x)
        actual = compiled(x)
    return actual, expected, backend.report, compiled


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_of_one_input_merge_and_swiglu_fuses_on_the_halves(dtype, dynamic):
    model = _model(dtype=dtype)
    x = torch.randn(2, 3, HIDDEN, dtype=dtype)
    actual, expected, report, _ = _run(model, x, dynamic=dynamic)
    assert report.counts[PASS] == 2  # q/k/v and gate/up
    assert report.fused_ops.get("npu.npu_swiglu") == 1  # gate and up are now halves of one tensor
    graph = report.graphs[0]
    assert graph.ops_after["aten.matmul.default"] == 3  # qkv, gate_up, down
    assert_close_at_scale(actual, expected, 4)


def test_the_weights_are_held_once_as_views_of_one_buffer():
    model = _model()
    weights = [model.q_proj.weight, model.k_proj.weight, model.v_proj.weight]
    values = [w.detach().clone() for w in weights]
    _run(model, torch.randn(2, 3, HIDDEN))
    storage = weights[0].untyped_storage()
    assert all(w.untyped_storage().data_ptr() == storage.data_ptr() for w in weights)
    # one buffer exactly the size of the three weights: nothing held twice
    assert storage.nbytes() == sum(w.numel() * w.element_size() for w in weights)
    assert [w.storage_offset() for w in weights] == [0, 64 * 64, 64 * 64 + 32 * 64]
    assert all(torch.equal(w, v) for w, v in zip(weights, values))  # same values, same Parameter objects
    assert isinstance(model.q_proj.weight, nn.Parameter) and model.q_proj.weight.requires_grad


def test_opt_out_keeps_every_linear():
    model = _model()
    before = model.q_proj.weight.untyped_storage().data_ptr()
    actual, expected, report, _ = _run(model, torch.randn(2, 3, HIDDEN),
                                       config=nff.FusionConfig(merge_projections=False))
    assert PASS not in report.counts and report.graphs[0].ops_after["aten.matmul.default"] == 6
    assert model.q_proj.weight.untyped_storage().data_ptr() == before
    assert "separate projections" in " ".join(near_miss_reasons(report, "swiglu"))
    torch.testing.assert_close(actual, expected)


def test_a_rebound_parameter_is_copied_into_the_buffer_before_the_next_call():
    model = _model()
    x = torch.randn(2, 3, HIDDEN)
    _, _, _, compiled = _run(model, x)
    buffer_ptr = model.k_proj.weight.untyped_storage().data_ptr()
    model.k_proj.weight.data = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN)  # rebinding, not in place
    model.up_proj.weight = nn.Parameter(torch.randn(FFN, HIDDEN))  # a new Parameter object
    with torch.no_grad():
        expected = model(x)
        actual = compiled(x)
    assert_close_at_scale(actual, expected, 4)
    assert model.k_proj.weight.untyped_storage().data_ptr() == buffer_ptr  # pointed back into it


def test_compiled_under_inference_mode_the_weights_stay_updatable():
    model = _model()
    backend = EmulationBackend(nff.FusionConfig())
    with torch.inference_mode():
        torch.compile(model, backend=backend)(torch.randn(2, 3, HIDDEN))
    assert backend.report.counts[PASS] == 2
    assert not model.q_proj.weight.is_inference()
    model.load_state_dict(model.state_dict())  # in place, outside inference mode


def test_in_place_updates_and_load_state_dict_need_nothing():
    model = _model()
    x = torch.randn(2, 3, HIDDEN)
    _, _, _, compiled = _run(model, x)
    with torch.no_grad():
        model.q_proj.weight.mul_(2)
    model.load_state_dict({**model.state_dict(), "gate_proj.weight": torch.randn(FFN, HIDDEN)})
    with torch.no_grad():
        expected = model(x)
        actual = compiled(x)
    assert_close_at_scale(actual, expected, 4)


def test_a_recompile_reuses_the_buffer():
    model = _model()
    _, _, report, compiled = _run(model, torch.randn(2, 3, HIDDEN))
    ptr = model.v_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        compiled(torch.randn(5, HIDDEN))  # another rank: dynamo compiles again
    notes = [s.note for s in report.sites if s.pass_name == PASS]
    assert any("reused the buffer" in n for n in notes), notes
    assert model.v_proj.weight.untyped_storage().data_ptr() == ptr


class MixedBias(AttentionInputs):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=True)


def test_with_biases_all_merge_with_their_biases():
    model = _model(bias=True)
    actual, expected, report, _ = _run(model, torch.randn(2, 3, HIDDEN))
    assert report.counts[PASS] == 2
    bias_storage = model.q_proj.bias.untyped_storage()
    assert model.v_proj.bias.untyped_storage().data_ptr() == bias_storage.data_ptr()
    assert_close_at_scale(actual, expected, 4)


def test_a_bias_on_some_linears_only_is_a_near_miss():
    model = _model(MixedBias)
    actual, _, report, _ = _run(model, torch.randn(2, 3, HIDDEN))
    assert report.counts[PASS] == 1  # gate/up still merge
    assert any("have a bias and others none" in r for r in near_miss_reasons(report, PASS))


def _training_step_equals_eager(model, reference, dynamic):
    """One compiled training step of `model` and one eager step of `reference` (the same weights):
    outputs within 4 ulp at scale, every gradient within 64 (fp32: the merged matmuls sum the same
    products in another blocking, as test_training). Returns the report."""
    x = torch.randn(2, 3, HIDDEN)
    backend = EmulationBackend(nff.FusionConfig())
    out = torch.compile(model, backend=backend, dynamic=dynamic)(x)
    out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    assert_close_at_scale(out, expected, 4)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close_at_scale(p.grad, q.grad, 64)
    return backend.report


@pytest.mark.parametrize("dynamic", [None, True])
def test_training_merges_a_swiglu_by_concatenating_its_weights_each_step(dynamic):
    """In training each parameter keeps its own storage and gradient: q/k/v stay separate (a
    near miss), gate/up merge through a torch.cat in the graph, so swiglu fuses, forward and
    backward; the gradients equal eager's (fp32: the merged matmuls sum the same products,
    in another blocking, 64 ulp of each gradient's largest element as test_training)."""
    model = _model().train()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    report = _training_step_equals_eager(model, _model().train(), dynamic)
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages  # nothing re-pointed
    assert report.counts[PASS] == 1
    (site,) = [s for s in report.sites if s.pass_name == PASS]
    assert site.replaced and "concatenated in the graph on every step" in site.note
    assert any("a training graph" in r for r in near_miss_reasons(report, PASS))  # q/k/v
    assert report.fused_ops.get("npu.npu_swiglu") == 1
    assert report.fused_ops.get("npu.npu_swiglu_backward") == 1


class MoEBlockInputs(nn.Module):
    """A MoE block's router, shared expert and shared-expert gate all read one input (Qwen2-MoE,
    torchtitan-npu's DeepSeek-V3 compiled without a graph break); `up_first`: the expert's code
    computes up before gate (`w2(w3(x) * silu(w1(x)))`)."""

    def __init__(self, up_first=False):
        super().__init__()
        self.router = nn.Linear(HIDDEN, 8, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)
        self.shared_gate = nn.Linear(HIDDEN, 1, bias=False)
        self.up_first = up_first

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        if self.up_first:
            up = self.up_proj(x)
            h = up * F.silu(self.gate_proj(x))
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h) * torch.sigmoid(self.shared_gate(x)) + scores.sum(-1, keepdim=True)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("up_first", [False, True], ids=["gate first", "up first"])
def test_a_swiglus_gate_and_up_merge_by_themselves_gate_first(up_first, training):
    """The gate and up of a SwiGLU merge as a pair, gate first (npu_swiglu activates the first
    half), whatever else reads their input and in whichever order the code runs them: the
    router and the shared-expert gate merge with each other (inference), not into the pair.
    With all four in one linear, npu_swiglu would get two pieces of a wider tensor."""
    model, reference = _model(MoEBlockInputs, up_first=up_first), _model(MoEBlockInputs, up_first=up_first)
    x = torch.randn(2, 3, HIDDEN)
    backend = EmulationBackend(nff.FusionConfig())
    with torch.set_grad_enabled(training):
        out = torch.compile(model.train(training), backend=backend)(x)
        expected = reference.train(training)(x)
    assert_close_at_scale(out, expected, 4)
    report = backend.report
    sites = [s.form for s in report.sites if s.pass_name == PASS]
    assert sites == (["gate and up linears of a SwiGLU, in training"] if training
                     else ["2 linears on one input", "2 linears on one input"]), sites
    assert report.fused_ops.get("npu.npu_swiglu") == 1, near_miss_reasons(report, "swiglu")


class GeGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x):
        return F.gelu(self.gate_proj(x)) * self.up_proj(x)


def test_training_keeps_the_linears_of_anything_but_a_swiglu_separate():
    """A per-step copy of the weights is worth it only where it buys npu_swiglu: GeGLU's
    linears (and q/k/v above) stay as the model wrote them."""
    model = _model(GeGLU).train()
    backend = EmulationBackend(nff.FusionConfig())
    torch.compile(model, backend=backend)(torch.randn(2, 3, HIDDEN)).sum().backward()
    assert backend.report.counts.get(PASS, 0) == 0
    assert any("a training graph" in r for r in near_miss_reasons(backend.report, PASS))
    assert model.gate_proj.weight.grad is not None and model.up_proj.weight.grad is not None


class NotParameters(nn.Module):
    def forward(self, x, w1, w2):
        return F.linear(x, w1) + F.linear(x, w2)


def test_weights_that_are_not_parameters_do_not_merge():
    x, w1, w2 = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4, 8)
    backend = EmulationBackend(nff.FusionConfig())
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(NotParameters(), backend=backend)(x, w1, w2),
                                   NotParameters()(x, w1, w2))
    assert any("is not a parameter of the model" in r for r in near_miss_reasons(backend.report, PASS))


def test_a_view_into_a_flat_buffer_is_not_re_pointed():
    model = _model()
    flat = torch.zeros(10_000)
    with torch.no_grad():
        flat[:HEADS * HEAD_DIM * HIDDEN].copy_(model.q_proj.weight.flatten())
    model.q_proj.weight.data = flat[:HEADS * HEAD_DIM * HIDDEN].view(HEADS * HEAD_DIM, HIDDEN)
    _, _, report, _ = _run(model, torch.randn(2, 3, HIDDEN))
    assert any("view into a larger buffer" in r for r in near_miss_reasons(report, PASS))
    assert model.q_proj.weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("how", ["switch", "disable_env", "disable", "enable_others"])
def test_turned_off_like_a_pass(monkeypatch, how):
    config = nff.FusionConfig()
    if how == "switch":
        monkeypatch.setenv("NPU_FX_FUSION", "0")
    elif how == "disable_env":
        monkeypatch.setenv("NPU_FX_FUSION_DISABLE", PASS)
    elif how == "disable":
        config = nff.FusionConfig(disable={PASS})
    else:
        config = nff.FusionConfig(enable={"swiglu"})
    model = _model()
    _, _, report, _ = _run(model, torch.randn(2, 3, HIDDEN), config=config)
    assert PASS not in report.counts
    assert model.q_proj.weight.storage_offset() == 0 and model.k_proj.weight.storage_offset() == 0


class GatedExpert(nn.Module):
    """litgpt's LLaMAMLP: fc_1 and fc_2 on one input."""

    def __init__(self):
        super().__init__()
        self.fc_1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.fc_2 = nn.Linear(HIDDEN, FFN, bias=False)
        self.proj = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


def test_a_graph_dynamo_reuses_for_another_instance_computes_with_that_instances_weights(caplog):
    # litgpt's MoE calls its experts one by one after a graph break: dynamo compiles the
    # expert's forward once and calls that graph with every expert's parameters. The merge
    # re-pointed the first expert's weights; another expert's are copied in for its call and
    # the first's put back, never re-pointed (that overwrote the first expert's weights)
    torch.manual_seed(0)
    experts = [GatedExpert().eval() for _ in range(3)]
    first = [p.detach().clone() for p in experts[0].parameters()]
    backend = EmulationBackend(nff.FusionConfig())
    run = torch.compile(lambda expert, x: expert(x), backend=backend)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad(), caplog.at_level("WARNING", logger="npu_fx_fusion"):
        for _ in range(2):
            for expert in experts:
                torch.testing.assert_close(run(expert, x), expert(x))
    assert backend.report.counts[PASS] == 1 and len(backend.report.graphs) == 1  # one graph for all three
    for param, before in zip(experts[0].parameters(), first):
        torch.testing.assert_close(param, before, rtol=0, atol=0)
    # said once for the graph, not at each of its four borrowing calls
    assert caplog.text.count("called with another module's parameters") == 1


class ScaledSwiGLU(nn.Module):
    """olmo-core's nGPT feed-forward: gate and up scaled before they meet,
    w2(silu(sw1 * w1(x)) * (sw3 * w3(x))); `gate_scale`: sw1's shape (per channel, or per row)."""

    def __init__(self, gate_scale=(FFN,)):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.sw1 = nn.Parameter(torch.rand(gate_scale) + 0.5)
        self.sw3 = nn.Parameter(torch.rand(FFN) + 0.5)

    def forward(self, x):
        return self.w2(F.silu(self.sw1 * self.w1(x)) * (self.w3(x) * self.sw3))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_training_merges_a_swiglu_scaled_per_channel(dynamic):
    """The scales stand between the linears and the silu-gated product: per channel, the merged
    output's halves scaled still fuse (the swiglu pass's scaled forms), so the pair merges; the
    gradients, the scales' included, equal eager's (64 ulp at scale, as above)."""
    torch._dynamo.reset()
    report = _training_step_equals_eager(_model(ScaledSwiGLU).train(), _model(ScaledSwiGLU).train(), dynamic)
    assert report.counts[PASS] == 1
    assert report.fused_ops.get("npu.npu_swiglu") == 1
    assert report.fused_ops.get("npu.npu_swiglu_backward") == 1


def test_training_keeps_a_swiglu_scaled_per_row_separate():
    """A gate scale that varies along the rows would not fuse (its concatenation copies it in full):
    the weights are not concatenated for nothing."""
    model = _model(ScaledSwiGLU, gate_scale=(3, 1)).train()
    backend = EmulationBackend(nff.FusionConfig())
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 3, HIDDEN)).sum().backward()
    assert backend.report.counts[PASS] == 0
    assert backend.report.fused_ops.get("npu.npu_swiglu") is None
    assert any("separate projections, scaled before they meet" in reason
               for reason in near_miss_reasons(backend.report, "swiglu")), backend.report.near_misses
