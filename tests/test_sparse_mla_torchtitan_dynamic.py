"""sparse_mla on torchtitan-npu's own DeepSeek-V4 attention under dynamic shapes (the sequence
length symbolic): the facts the static checks prove by evaluating the index masks and lists at
one size (tests/test_sparse_mla_torchtitan.py) are proven for every size (symbolic_values: each
list's members and each mask's zeros as formulas of their indices and the size symbols), so the
compiled graph serves every length without a guard and without fusing anything it should not.

The modules are test_sparse_mla_torchtitan.Inner (the library's SparseAttention and LiCompute)
with what the model derives from the tokens derived here too: the compressed keys (and the
indexer's keys) as blocks of m tokens, so T = S // m as the model's compressor makes it; the
kernel's head dim 512 and bf16 (torchtitan's autocast), so that A2 (FusionConfig(soc=
"Ascend910B"): no metadata) takes them; its A2 limits the tiny sizes miss (ratio 8, top-3) set
aside. sparse_flash_mla_metadata takes its sizes as int attributes: with symbolic sizes the
metadata convention (Ascend950, and emulation) is refused, naming that limit.

Numerics as test_sparse_mla_torchtitan.py (the stand-in computes the COT golden, P rounded to
q's dtype before P @ V as torchtitan's autocast path rounds it): 2 ulp of the output's scale in
bf16.
"""
import pytest
import torch
from torch import nn

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.patterns import sparse_mla
from test_sparse_mla_torchtitan import Inner, Variant, _window

A2 = nff.FusionConfig(enable={"sparse_mla"}, soc="Ascend910B")
BF16_ULPS = 2
LENGTHS = (16, 136)  # both divisible by the ratios 4 and 8; 136 > 128: the window cuts keys off


@pytest.fixture
def a2_limits_of_the_tiny_sizes(monkeypatch):
    # the tiny layers' ratio 8 and top-3: A2 / A3 take ratios (1, 4, 128) and top-k 512 / 1024
    monkeypatch.setitem(sparse_mla.SMLA.limits, "cmp_ratios_a2_a3", (1, 4, 8, 128))
    monkeypatch.setitem(sparse_mla.SMLA.limits, "csa_topk_a2_a3", (3, 512, 1024))


class Derived(nn.Module):
    """Inner with the compressed keys derived from the tokens (blocks of m, as the model's
    compressor makes them: T = S // m for every S), q and kv of one length."""

    def __init__(self, kind, **overrides):
        super().__init__()
        self.kind = kind
        self.inner = Inner(kind, autocast=True, head_dim=512, **overrides)

    def forward(self, q, kv, q_indexer=None, weights=None):
        torch._check(kv.shape[1] == q.shape[1])
        inputs = [q, kv]
        if self.kind != "swa":
            ratio = self.inner.sparse_attn.compress_ratio
            if kv.shape[1] % ratio != 0:  # (the model's compressor refuses such lengths too)
                raise ValueError("the sequence length must be divisible by the compress ratio")
            compressed = kv.unflatten(1, (-1, ratio)).mean(2)
            inputs.append(compressed)
        if self.kind == "csa":
            torch._check(q_indexer.shape[1] == q.shape[1])
            torch._check(weights.shape[1] == q.shape[1])
            inputs += [q_indexer, compressed[..., :q_indexer.shape[-1]], weights]
        return self.inner(*inputs)


def _inputs(kind, seq):
    generator = torch.Generator().manual_seed(seq)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    inputs = [randn(2, seq, 4, 512), randn(2, seq, 512)]
    if kind == "csa":
        inputs += [randn(2, seq, 16, 16), randn(2, seq, 16)]
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 1)
    return inputs


def _compile(module, config):
    """(compiled module, backend, list of the graphs compiled)."""
    torch._dynamo.reset()
    backend = EmulationBackend(config)
    compiled_graphs = []

    def counting(gm, example_inputs):
        compiled_graphs.append(gm)
        return backend(gm, example_inputs)

    return torch.compile(module, backend=counting, fullgraph=True), backend, compiled_graphs


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_each_layer_kind_fuses_for_every_length_on_a2(kind, a2_limits_of_the_tiny_sizes):
    module = Derived(kind)
    compiled, backend, graphs = _compile(module, A2)
    with torch.no_grad():
        for seq in LENGTHS:
            inputs = _inputs(kind, seq)
            out, ref = compiled(*inputs), module(*inputs)
            assert_close_at_scale(out, ref, BF16_ULPS)
    # one graph serves both lengths: nothing guarded a size
    assert len(graphs) == 1
    report = backend.report
    assert report.counts["sparse_mla"] == 1, near_miss_reasons(report, "sparse_mla")
    assert report.fused_ops["cann_ops_transformer.sparse_flash_mla"] == 1
    assert "cann_ops_transformer.sparse_flash_mla_metadata" not in report.fused_ops


def test_the_metadata_convention_is_refused_naming_the_metadata_op_limit():
    # emulation takes Ascend950's convention, whose metadata op takes the sizes as int attributes
    module = Derived("swa")
    compiled, backend, _ = _compile(module, nff.FusionConfig(enable={"sparse_mla"}))
    inputs = _inputs("swa", 16)
    with torch.no_grad():
        out, ref = compiled(*inputs), module(*inputs)
    assert backend.report.counts["sparse_mla"] == 0
    assert near_miss_reasons(backend.report, "sparse_mla") == [sparse_mla.METADATA_LIMIT]
    assert_close_at_scale(out, ref, 0)


def _refused(module, inputs, reason):
    compiled, backend, _ = _compile(module, A2)
    with torch.no_grad():
        out, ref = compiled(*inputs), module(*inputs)
    assert backend.report.counts["sparse_mla"] == 0
    reasons = near_miss_reasons(backend.report, "sparse_mla")
    assert any(reason in r for r in reasons), reasons
    assert_close_at_scale(out, ref, 0)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_another_window_is_a_near_miss_naming_it(kind, a2_limits_of_the_tiny_sizes):
    _refused(Derived(kind, window_size=8), _inputs(kind, 16), "128-key window the op's band is")


class DerivedVariant(nn.Module):
    """test_sparse_mla_torchtitan.Variant (CSA-like, with knobs) on blocks of 4 tokens derived
    from kv and block scores derived from them: T = S // 4 for every S."""

    def __init__(self, **knobs):
        super().__init__()
        self.variant = Variant(**knobs)

    def forward(self, q, kv):
        torch._check(kv.shape[1] == q.shape[1])
        if kv.shape[1] % 4 != 0:
            raise ValueError("the sequence length must be divisible by 4")
        compressed = kv.unflatten(1, (-1, 4)).mean(2)
        scores = torch.einsum("bsd,btd->bst", kv.float(), compressed.float())
        return self.variant(q, kv, compressed, scores)


class WrongLane(nn.Module):
    """DerivedVariant's attention with the -1 slots sent to column S (the first compressed key, which
    they would open), not to the padding lane S + T the mask drops."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4) * 0.5)

    def forward(self, q, kv):
        torch._check(kv.shape[1] == q.shape[1])
        if kv.shape[1] % 4 != 0:
            raise ValueError("the sequence length must be divisible by 4")
        batch, seq = q.shape[:2]
        compressed = kv.unflatten(1, (-1, 4)).mean(2)
        scores = torch.einsum("bsd,btd->bst", kv.float(), compressed.float())
        picks = scores.topk(3, dim=-1).indices
        threshold = (torch.arange(seq).unsqueeze(1) + 1) // 4
        listed = torch.where(picks >= threshold, -1, picks + seq)
        topk_idxs = torch.cat([_window(seq).unsqueeze(0).expand(batch, -1, -1), listed], dim=-1).int()
        # test_sparse_mla_torchtitan._attention, but for the lane
        kv = torch.cat([kv, compressed], dim=1)
        query_states, kv_states = q.transpose(1, 2), kv.unsqueeze(1)
        attn_weights = torch.matmul(query_states, kv_states.transpose(2, 3)) * 32 ** -0.5
        topk_idxs = topk_idxs.masked_fill(topk_idxs < 0, seq)
        index_mask = torch.full((batch, 1, seq, kv_states.shape[2] + 1), torch.finfo(torch.bfloat16).min,
                                dtype=torch.bfloat16, device=q.device).scatter(-1, topk_idxs.unsqueeze(1), 0)
        attn_weights = attn_weights + index_mask[..., :-1]
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq, -1)
        combined = torch.cat([attn_weights, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined.float(), dim=-1)
        return torch.matmul(probs[..., :-1], kv_states).transpose(1, 2).contiguous()


def _variant_inputs(seq=16):
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, seq, 4, 512, generator=generator), torch.randn(2, seq, 512, generator=generator)]
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 1)
    return inputs


@pytest.mark.parametrize("variant, reason", [
    (dict(threshold_shift=2), "threshold is not (t + 1) // 4"),  # another threshold
    (dict(ratio=8), "threshold is not (t + 1) // 4"),  # the threshold of another ratio than S // T
    (dict(fill=-1.0), "does not hide a key"),  # a finite fill above -1e30
    (dict(from_topk=False), "not a top-k's indices"),
])
def test_look_alikes_are_near_misses_naming_the_failed_check(variant, reason, monkeypatch):
    # (fp32 modules: A2's dtype limit set aside, so that the checks of the form are what refuses)
    monkeypatch.setattr(sparse_mla, "unsupported", lambda *args, **kwargs: None)
    monkeypatch.setitem(sparse_mla.SMLA.limits, "csa_topk_a2_a3", (3, 512, 1024))
    _refused(DerivedVariant(**variant), _variant_inputs(), reason)


def test_a_wrong_padding_lane_is_a_near_miss_naming_it(monkeypatch):
    monkeypatch.setattr(sparse_mla, "unsupported", lambda *args, **kwargs: None)
    monkeypatch.setitem(sparse_mla.SMLA.limits, "csa_topk_a2_a3", (3, 512, 1024))
    _refused(WrongLane(), _variant_inputs(), "the -1 slots go to column")


def test_the_same_variant_fuses_when_nothing_is_wrong(monkeypatch):
    # (the look-alikes above differ from this one by their knob only)
    monkeypatch.setattr(sparse_mla, "unsupported", lambda *args, **kwargs: None)
    monkeypatch.setitem(sparse_mla.SMLA.limits, "csa_topk_a2_a3", (3, 512, 1024))
    module = DerivedVariant()
    compiled, backend, graphs = _compile(module, A2)
    with torch.no_grad():
        for seq in (16, 32):
            inputs = _variant_inputs(seq)
            out, ref = compiled(*inputs), module(*inputs)
            assert_close_at_scale(out, ref, 8)
    assert len(graphs) == 1
    assert backend.report.counts["sparse_mla"] == 1, near_miss_reasons(backend.report, "sparse_mla")


# ---- training: the joint graph under dynamic=True --------------------------------------------------
class Projected(nn.Module):
    """Derived (fp32) behind projections of one (B, S, 16) input, as the model's q / kv come from its
    projections: under dynamic=True batch and length are symbolic, the heads and head dims fixed."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.derived = Derived(kind)
        self.derived.inner.autocast = False
        self.wq, self.wkv = nn.Linear(16, 4 * 512), nn.Linear(16, 512)
        self.wqi, self.ww = nn.Linear(16, 16 * 16), nn.Linear(16, 16)

    def forward(self, x):
        batch, seq, _ = x.shape
        indexer = [self.wqi(x).view(batch, seq, 16, 16), self.ww(x)] if self.kind == "csa" else []
        return self.derived(self.wq(x).view(batch, seq, 4, 512), self.wkv(x), *indexer)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_trains_through_sparse_flash_mla_grad_under_dynamic_shapes(kind, a2_limits_of_the_tiny_sizes, monkeypatch):
    # (fp32: A2's dtype limit set aside; the gradients as tests/test_sparse_mla_torchtitan.py's, 16 ulp)
    from v4_modules import fused_calls, train_and_compare

    monkeypatch.setattr(sparse_mla, "unsupported", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 16)
    backend = train_and_compare(Projected(kind), [x], A2, {torch.float32: 16}, dynamic=True)
    assert fused_calls(backend.graphs["backward"]).get("cann_ops_transformer.sparse_flash_mla_grad") == 1
    assert near_miss_reasons(backend.report, "sparse_mla") == []


# ---- the whole tiny torchtitan-npu V4 (bf16) under dynamic=True, in a process of its own -----------
def v4_model_fuses_its_three_attentions_for_every_length():
    """(in_subprocess: the model needs torchtitan 0.2.2) Its three layers (SWA, CSA with LiCompute,
    HCA), on A2 with the tiny sizes' kernel limits set aside (head dim 32, ratio 8, top-3): the three
    attentions fuse, and a second length (32 tokens) compiles no attention graph again."""
    from helpers import torchtitan_npu

    sparse_mla.SMLA.limits.update(head_dim=32, cmp_ratios_a2_a3=(1, 4, 8, 128), csa_topk_a2_a3=(3, 512, 1024))
    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v4", dtype=torch.bfloat16)
    backend = nff.get_npu_backend(fusion_config=A2)
    fused_after_each_graph = []  # the run's report's count of sparse_mla sites, after each graph compiled

    def counting(gm, example_inputs):
        compiled_graph = backend(gm, example_inputs)
        fused_after_each_graph.append(nff.last_report().counts.get("sparse_mla", 0))
        return compiled_graph

    def sites_fused():  # (each graph that fused adds its sites, whether or not the report is a new run's)
        counts = [0, *fused_after_each_graph]
        return sum(max(b - a, 0) for a, b in zip(counts, counts[1:]))

    torch._dynamo.reset()
    compiled = torch.compile(tiny.model, backend=counting, dynamic=True)
    (ids,) = tiny.example_inputs
    with torch.no_grad():
        for tokens in (ids, torch.cat([ids, ids.flip(1)], dim=1)):
            out, ref = compiled(tokens), tiny.model(tokens)
            # bf16 through three layers, the fused attention rounding P once as the op does: within 2 %
            # of the output's scale (measured 0.4 %)
            assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
            if tokens is ids:
                assert sites_fused() == 3, fused_after_each_graph
                graphs_at_16 = len(fused_after_each_graph)
    # at 32 tokens the model compiles one graph more, with this pass or without it (13 -> 14 graphs
    # either way: its MoE's expert loop breaks the graph on data, and another resume point is reached);
    # no attention graph is compiled again for the length (the unit tests count one compile for two
    # lengths), and the site of that new graph fuses too
    assert len(fused_after_each_graph) - graphs_at_16 <= 1, fused_after_each_graph
    assert [m.reason for m in nff.last_report().near_misses if m.pass_name == "sparse_mla"] == []


def test_the_tiny_v4_model_fuses_its_three_attentions_for_every_length():
    from helpers import in_subprocess

    in_subprocess("test_sparse_mla_torchtitan_dynamic", "v4_model_fuses_its_three_attentions_for_every_length()")
