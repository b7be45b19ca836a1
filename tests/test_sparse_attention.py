"""sparse_attention and lightning_indexer on transformers' DeepseekV32Attention.

The attention layer is transformers' own (its indexer, its top-k mask, SDPA); the wrapper
only makes what the model makes around it: positions, rotary cos/sin and the causal mask,
built in the graph from aranges, as the model does. That mask is what both passes must
prove causal (sparse_mode 3) before they fuse.

Numerics: the indexer's indices are compared as the attention uses them (only the keys
the mask lets through); the attention output within a few ulp of its scale (fp32: the op
scales q.k once, the model multiplies q and k by sqrt(scale) each; the same softmax
otherwise).
"""
import pytest
import torch

import npu_fx_fusion as nff
from helpers import GuardRecordingBackend, assert_close_at_scale, compile_and_run, is_size_limit, near_miss_reasons

BOTH = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"})
SEQ = 16


def _config(index_topk=8, attn_implementation="sdpa", index_heads=4):
    from transformers import DeepseekV32Config

    config = DeepseekV32Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_topk=index_topk, index_head_dim=32,
        index_n_heads=index_heads, max_position_embeddings=256, use_cache=False)
    config._attn_implementation = attn_implementation
    return config


def _window_mask(queries, keys, window):
    i = torch.arange(queries).unsqueeze(-1)
    j = torch.arange(keys).unsqueeze(0)
    return (j <= i) & (j > i - window)


class AttentionLayer(torch.nn.Module):
    """transformers' DeepseekV32Attention with the causal mask the model would build.

    mask: "causal" (the model's), "full" (no mask: sparse_mode 0), "window" (sliding window:
    neither), "input" (passed in by the caller: unknown at compile time).
    """

    def __init__(self, index_topk=8, mask="causal", attn_implementation="sdpa", index_heads=4):
        super().__init__()
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
            DeepseekV32Attention, DeepseekV32RotaryEmbedding)

        config = _config(index_topk, attn_implementation, index_heads)
        torch.manual_seed(0)
        self.attention = DeepseekV32Attention(config, layer_idx=0)
        self.rotary = DeepseekV32RotaryEmbedding(config)
        for param in self.attention.parameters():
            torch.nn.init.normal_(param, std=0.2)
        self.mask = mask

    def forward(self, hidden_states, user_mask=None):
        batch, seq = hidden_states.shape[:2]
        positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        cos_sin = self.rotary(hidden_states, positions)
        if self.mask == "input":
            visible = user_mask
        elif self.mask == "full":
            visible = torch.ones(seq, seq, dtype=torch.bool)
        elif self.mask == "window":
            visible = _window_mask(seq, seq, 4)
        else:
            visible = _window_mask(seq, seq, seq + 1)  # plain causal
        visible = visible.expand(batch, 1, seq, seq)
        return self.attention(hidden_states, cos_sin, visible)[0]


def _hidden(dtype=torch.float32, seq=SEQ):
    torch.manual_seed(1)
    return torch.randn(2, seq, 64).to(dtype)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
@pytest.mark.parametrize("index_topk", [4, 8, 12])
def test_indexer_and_sparse_attention_fuse_under_the_causal_mask(index_topk, npu_dispatch):
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, npu_dispatch=npu_dispatch)
    out, ref, report = compile_and_run(AttentionLayer(index_topk), _hidden(), config=config)
    # an NPU compile holds SDPA as torch_npu's FlashAttention (npu_dispatch.py), the CPU
    # trace as SDPA's math decomposition: the FA forms and the math forms fuse the same site
    before = report.graphs[0].ops_before
    assert (before["npu.npu_fusion_attention_v3.default"] == 1) == npu_dispatch
    assert (before["aten._safe_softmax.default"] == 1) != npu_dispatch
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    assert report.fused_ops == {"npu.npu_sparse_flash_attention": 1, "npu.npu_lightning_indexer": 1}
    # the first index_topk - 1 queries see fewer than index_topk keys: the op pads with -1
    # where the model lists masked keys, and both attentions ignore those
    assert_close_at_scale(out, ref, 4)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_without_a_mask_both_fuse_with_sparse_mode_0(npu_dispatch):
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, npu_dispatch=npu_dispatch)
    out, ref, report = compile_and_run(AttentionLayer(mask="full"), _hidden(), config=config)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    assert_close_at_scale(out, ref, 4)
    # the causal replacement is turned down first, and the site says why mode 0 serves
    assert all("masks nothing: sparse_mode 0, not 3" in s.note for s in report.sites), report.sites


def test_bf16_fuses_and_rounds_once():
    layer = AttentionLayer().to(torch.bfloat16)
    out, ref, report = compile_and_run(layer, _hidden(torch.bfloat16), config=BOTH)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    # the model's SDPA math upcasts to fp32 and rounds the output once, as the op does
    assert_close_at_scale(out, ref, 4)


def test_the_indexer_alone_does_not_fuse_where_its_indices_feed_the_models_own_mask():
    # with sparse_attention off, the indices reach transformers' scatter, which cannot read
    # the op's -1 padding
    config = nff.FusionConfig(enable={"lightning_indexer"})
    out, ref, report = compile_and_run(AttentionLayer(), _hidden(), config=config)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "reach" in miss and "scatter" in miss, miss
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_indices_that_are_not_a_top_k_are_not_fused(npu_dispatch):
    # halved top-k indices list keys twice: the model's scatter shows such a key once, the op
    # would count it twice
    layer = AttentionLayer()
    indexer = layer.attention.indexer
    top_k = indexer.forward
    indexer.forward = lambda *args, **kwargs: torch.div(top_k(*args, **kwargs), 2, rounding_mode="floor")
    config = nff.FusionConfig(enable={"sparse_attention"}, npu_dispatch=npu_dispatch)
    out, ref, report = compile_and_run(layer, _hidden(), config=config)
    assert report.counts["sparse_attention"] == 0
    assert any("not a top-k's" in m for m in near_miss_reasons(report, "sparse_attention")), report.near_misses
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("mask, reason", [
    ("window", "neither right-down causal nor empty"),
    ("input", "computed from graph inputs"),
], ids=["sliding window", "caller's mask"])
@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_masks_the_op_cannot_express_are_not_fused(mask, reason, npu_dispatch):
    layer = AttentionLayer(mask=mask)
    inputs = (_hidden(),) if mask != "input" else (_hidden(), _window_mask(SEQ, SEQ, SEQ + 1))
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, npu_dispatch=npu_dispatch)
    out, ref, report = compile_and_run(layer, *inputs, config=config)
    assert report.counts["sparse_attention"] == 0 and report.counts["lightning_indexer"] == 0
    for pass_name in ("sparse_attention", "lightning_indexer"):
        misses = near_miss_reasons(report, pass_name)
        assert misses and all(reason in m or "reach" in m for m in misses), (pass_name, misses)
    assert any(reason in m for m in near_miss_reasons(report, "sparse_attention"))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_under_dynamic_shapes_the_mask_is_proven_for_every_size_and_the_top_k_guarded(mask):
    """With the sequence symbolic the model's mask is another tensor at every size: it is
    proven right-down causal over all sizes (symbolic_values.py), and the indexer's
    `min(index_topk, S)` is taken as index_topk behind a guard S >= index_topk (a shorter
    sequence compiles again, without the fusion there). A sliding window is proven not
    causal and neither fuses."""
    backend = GuardRecordingBackend(BOTH)
    layer = AttentionLayer(index_topk=8, mask=mask)
    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for seq in (16, 11):  # one graph serves both (S >= 8)
            assert_close_at_scale(compiled(_hidden(seq=seq)), layer(_hidden(seq=seq)), 4)
        assert len(backend.report.graphs) == 1
        first = backend.report
        if mask == "window":
            assert first.counts["sparse_attention"] == 0 and first.counts["lightning_indexer"] == 0
            assert any("neither right-down causal nor empty for every size" in m
                       for m in near_miss_reasons(first, "sparse_attention"))
            return
        assert first.counts["sparse_attention"] == 1 and first.counts["lightning_indexer"] == 1
        notes = " ".join(s.note for s in first.sites)
        assert "index_topk taken as 8: a guard" in notes, notes
        # the guard bounds the sequence by 8 and pins nothing (the other guards: kernels' size limits)
        assert all(is_size_limit(g) for g in backend.added_guards), backend.added_guards
        assert any(8 in g.atoms() for g in backend.added_guards), backend.added_guards
        # below the guard: a second compile, where min(8, S) is S (not a constant): unfused
        assert_close_at_scale(compiled(_hidden(seq=5)), layer(_hidden(seq=5)), 4)
    assert len(backend.report.graphs) == 2
    second = backend.report.graphs[1]
    assert [len(r.sites) for r in second.passes if r.pass_name == "lightning_indexer"] == [0]


def test_an_soc_with_the_kernels_limits_refuses_the_tiny_head_dims():
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, soc="Ascend910B")
    layer = AttentionLayer().to(torch.bfloat16)
    _, _, report = compile_and_run(layer, _hidden(torch.bfloat16), config=config)
    assert report.counts["sparse_attention"] == 0
    (miss,) = near_miss_reasons(report, "sparse_attention")
    assert "head dim 16, the kernels take 512" in miss, miss


def test_on_ascend950_the_npu_fusion_attention_form_is_matched():
    """Ascend950's SDPA is npu_fusion_attention: its FA form matches (then the SoC's limits
    refuse the tiny head dims, which says the site was found)."""
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, soc="Ascend950")
    layer = AttentionLayer().to(torch.bfloat16)
    out, ref, report = compile_and_run(layer, _hidden(torch.bfloat16), config=config)
    before = report.graphs[0].ops_before
    assert before["npu.npu_fusion_attention.default"] == 1 and before["npu.npu_fusion_attention_v3.default"] == 0
    (miss,) = near_miss_reasons(report, "sparse_attention")
    assert "head dim 16, the kernels take 512" in miss, miss
    assert_close_at_scale(out, ref, 4)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_the_fused_call_has_the_models_scale(npu_dispatch, tmp_path):
    """The FA forms pass the scale SDPA got; the math forms' q and k scaled by sqrt(scale)
    each give it back squared (within an ulp)."""
    import re

    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, npu_dispatch=npu_dispatch,
                              dump_dir=str(tmp_path))
    layer = AttentionLayer()
    compile_and_run(layer, _hidden(), config=config)
    (after,) = list(tmp_path.rglob("after.py"))
    (call,) = re.findall(r"npu_sparse_flash_attention\.default\(([^\n]*)\)", after.read_text())
    scale = float(call.split(", ")[4])
    if npu_dispatch:
        assert scale == layer.attention.scaling
    else:
        assert scale == pytest.approx(layer.attention.scaling, rel=2e-7)


def test_in_emulation_the_sites_note_the_kernels_limits():
    _, _, report = compile_and_run(AttentionLayer(), _hidden(), config=BOTH)
    notes = {s.pass_name: s.note for s in report.sites}
    assert "on an NPU: head dim 16, the kernels take 512" in notes["sparse_attention"]
    assert "on an NPU: head dim 32, the kernel takes 128" in notes["lightning_indexer"]


def test_both_sites_verify():
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, verify=True)
    _, _, report = compile_and_run(AttentionLayer(), _hidden(), config=config)
    assert len(report.sites) == 2
    assert all(s.verified.startswith("verified: max error") for s in report.sites), \
        [s.verified for s in report.sites]


def test_a_top_k_over_other_scores_is_not_an_indexer():
    class NotAnIndexer(torch.nn.Module):
        def forward(self, q, k):
            scores = torch.matmul(q, k.transpose(-1, -2))  # no relu, no head weights
            return scores.topk(4, dim=-1).indices.to(torch.int32)

    torch.manual_seed(0)
    _, _, report = compile_and_run(NotAnIndexer(), torch.randn(2, 8, 16), torch.randn(2, 8, 16), config=BOTH)
    assert report.counts["lightning_indexer"] == 0
    assert near_miss_reasons(report, "lightning_indexer") == []


# ---- absorbed MLA over gathered keys (DeepSeek-V3.2 inference form) -------------------------
class MlaSparseLayer(torch.nn.Module):
    """DeepSeek-V3.2's inference-time sparse attention, written as its reference does: the
    indexer's scores and top-k (causal mask from aranges), then attention of the absorbed
    queries over the gathered latent keys (one KV head, also the value) and their rope part.
    Inputs are the projections' outputs; dims default to the real kernels' (latent 512,
    rope 64, indexer head dim 128)."""

    def __init__(self, index_topk=8, latent=512, rope=64, index_dim=128, causal=True):
        super().__init__()
        self.index_topk, self.latent, self.rope, self.index_dim = index_topk, latent, rope, index_dim
        self.causal = causal

    def forward(self, q_nope, q_rope, kv, k_rope, q_index, k_index, index_weights, indices=None):
        seq = q_nope.shape[1]
        if indices is None:
            visible = torch.arange(seq).unsqueeze(0) <= torch.arange(seq).unsqueeze(-1)
            visible = visible.expand(q_nope.shape[0], seq, seq)
            scores = torch.relu(torch.matmul(q_index.float(), k_index.transpose(-1, -2).float().unsqueeze(1))
                                * self.index_dim ** -0.5)
            index_scores = torch.matmul(index_weights.unsqueeze(-2), scores).squeeze(-2)
            index_scores = index_scores.masked_fill(~visible, float("-inf"))
            indices = index_scores.topk(self.index_topk, dim=-1).indices.to(torch.int32)
        batch = torch.arange(indices.shape[0]).view(-1, 1, 1)
        keys = indices.clamp(min=0).long()
        kv_selected, rope_selected = kv[batch, keys], k_rope[batch, keys]
        scores = (torch.einsum("bsnd,bskd->bsnk", q_nope, kv_selected)
                  + torch.einsum("bsnr,bskr->bsnk", q_rope, rope_selected)) * (self.latent + self.rope) ** -0.5
        hidden = indices < 0
        if self.causal:  # the attention hides future keys too, as DeepSeek's reference does
            hidden = hidden | (indices > torch.arange(seq).view(1, -1, 1))
        scores = scores.masked_fill(hidden.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
        return torch.einsum("bsnk,bskd->bsnd", probs, kv_selected)


def _mla_inputs(dtype=torch.float32, seq=24, heads=16, latent=512, rope=64, index_heads=8, index_dim=128):
    torch.manual_seed(3)
    shapes = [(1, seq, heads, latent), (1, seq, heads, rope), (1, seq, latent), (1, seq, rope),
              (1, seq, index_heads, index_dim), (1, seq, index_dim)]
    tensors = [torch.randn(*shape).to(dtype) for shape in shapes]
    return (*tensors, torch.randn(1, seq, index_heads))  # indexer weights stay fp32


def test_absorbed_mla_over_gathered_keys_fuses_with_the_indexer():
    out, ref, report = compile_and_run(MlaSparseLayer(latent=32, rope=16, index_dim=16),
                                       *_mla_inputs(latent=32, rope=16, index_dim=16), config=BOTH)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    (attention,) = [s for s in report.sites if s.pass_name == "sparse_attention"]
    assert attention.form == "mla_gathered_top_k_causal"
    # the first queries' top-k lists future keys, which the model's attention hides; the
    # fused indexer lists -1 there, which the op (sparse_mode 3) skips: the same keys
    assert_close_at_scale(out, ref, 4)


def test_absorbed_mla_verifies_on_indices_a_causal_top_k_gives():
    # verification draws the indices as a causal top-k lists them (every query sees one of its
    # keys); uniformly random keys left query 0 with only future keys, a row of -inf whose
    # softmax is NaN in the form and 0 in the op: "error nan ulp at scale nan", so refused
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, verify=True)
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16)
    out, ref, report = compile_and_run(layer, *_mla_inputs(latent=32, rope=16, index_dim=16), config=config)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    assert all(s.verified.startswith("verified: max error") for s in report.sites), \
        [s.verified for s in report.sites]
    assert_close_at_scale(out, ref, 4)


def test_verification_indices_are_a_causal_top_k():
    from npu_fx_fusion.patterns.sparse_attention import _top_k_indices

    for queries, keys in ((7, 7), (7, 9)):  # a prefill, and fewer queries than keys (decode-like)
        indices = _top_k_indices({"indices": torch.empty(2, queries, 5, dtype=torch.int32),
                                  "kv": torch.empty(2, keys, 24)})
        assert indices.dtype == torch.int32 and indices.shape == (2, queries, 5)
        last_visible = torch.arange(queries).view(1, -1, 1) + (keys - queries)
        visible = indices <= last_visible
        assert visible.any(dim=-1).all()  # each query lists a key it sees
        # the keys it sees come first, as in a top-k over -inf-masked scores, and none twice
        assert (visible.int().diff(dim=-1) <= 0).all()
        assert all(len(set(row.tolist())) == 5 for row in indices.view(-1, 5))


def test_an_attention_that_trusts_the_indices_keeps_the_indexer_unfused():
    # without its own causal mask the attention reads the future keys the model's top-k
    # lists for the first queries; the op's -1 slots would drop them
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16, causal=False)
    out, ref, report = compile_and_run(layer, *_mla_inputs(latent=32, rope=16, index_dim=16), config=BOTH)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "under the same mask" in miss, miss
    assert_close_at_scale(out, ref, 4)


def test_at_the_real_kernels_dims_a_soc_accepts_both():
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, soc="Ascend910B")
    out, ref, report = compile_and_run(MlaSparseLayer(), *_mla_inputs(torch.bfloat16), config=config)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    assert all(site.note == "" for site in report.sites), [s.note for s in report.sites]
    assert_close_at_scale(out.float(), ref.float(), 8 * 2 ** -8 / torch.finfo(torch.float32).eps)


def test_gathered_attention_over_indices_of_unknown_origin_is_not_fused():
    # indices passed in: their -1 slots may sit anywhere, the op stops at the first one
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16)
    indices = torch.randint(0, 24, (1, 24, 8), dtype=torch.int32)
    out, ref, report = compile_and_run(layer, *_mla_inputs(latent=32, rope=16, index_dim=16), indices,
                                       config=BOTH)
    assert report.counts["sparse_attention"] == 0
    (miss,) = near_miss_reasons(report, "sparse_attention")
    assert "not known to be trailing" in miss, miss
    torch.testing.assert_close(out, ref, equal_nan=True)  # rows with no visible key: NaN both ways


# ---- ties at the k-th score (the axk2 / dots3_note sweep failures) --------------------------
# A key scores exactly 0 where relu zeroes every head's product; where more such keys than
# free slots reach the k-th score, torch.topk keeps whichever it reaches, the op the lower
# keys. Both are the top-k: the fused model is the model under another tie order.
def _tied_indexer_inputs(seq=24, heads=2, dim=16):
    """Indexer inputs where every query from position 8 on ties at the k-th score (k=8): queries
    and head weights positive, every 4th key positive (a positive score), the others
    negative in every coordinate (score exactly 0)."""
    torch.manual_seed(5)
    q_index = torch.randn(1, seq, heads, dim).abs()
    k_index = -torch.randn(1, seq, dim).abs()
    k_index[:, ::4] *= -1
    return q_index, k_index, torch.rand(1, seq, heads) + 0.5


def _model_scores(q_index, k_index, weights, scale):
    scores = torch.relu(torch.matmul(q_index.float(), k_index.transpose(-1, -2).float().unsqueeze(1)) * scale)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    seq = index_scores.shape[-1]
    visible = torch.arange(seq).unsqueeze(0) <= torch.arange(seq).unsqueeze(-1)
    return index_scores.masked_fill(~visible, float("-inf")), visible.expand_as(index_scores)


def _indexer_pass():
    from npu_fx_fusion.pipeline import load_pass

    return load_pass("lightning_indexer")


def test_verification_takes_any_top_k_of_tied_scores_and_no_other_selection():
    from npu_fx_fusion.npu_ops import ensure_registered
    from npu_fx_fusion.verify import _compare  # what verify_match applies to the canonical outputs

    ensure_registered()

    (causal, _) = _indexer_pass().forms
    q_index, k_index, weights = _tied_indexer_inputs()
    scale, k = 16 ** -0.5, 8
    scores, visible = _model_scores(q_index, k_index, weights, scale)
    inputs = {"query": q_index, "key": k_index, "weights": weights, "mask": visible, "scale": scale,
              "index_topk": k}
    model = causal.search(q_index, k_index, weights, visible, scale, k)  # torch.topk's choice
    # the last query: 6 positive keys, 18 tied at 0 for its last 2 slots
    last = model[0, -1].long()
    tied_left_out = [j for j in range(24) if scores[0, -1, j] == 0 and j not in last.tolist()]
    assert (scores[0, -1, last] == 0).sum() == 2 and len(tied_left_out) == 16

    def with_last_row(row):
        other = model.clone()
        other[0, -1] = torch.tensor(row, dtype=torch.int32)
        return other

    def compare(selection):
        return _compare(causal.canonical_outputs([model], inputs), causal.canonical_outputs([selection], inputs),
                        "npu.npu_lightning_indexer")

    first_tied = next(j for j in last.tolist() if scores[0, -1, j] == 0)
    tied_exchanged = [tied_left_out[0] if j == first_tied else j for j in last.tolist()]
    assert compare(with_last_row(tied_exchanged[::-1])).ok, "another top-k of the tied keys"
    assert compare(causal.replace(q_index, k_index, weights, visible, scale, k)).ok, "the op's top-k"
    # a positive key dropped for a tied one: a lower score
    dropped = [tied_left_out[0] if j == 0 else j for j in last.tolist()]
    assert not compare(with_last_row(dropped)).ok
    # a tied key listed twice: one key fewer
    doubled = [j for j in last.tolist() if scores[0, -1, j] != 0] + [tied_left_out[0]] * 2
    assert not compare(with_last_row(doubled)).ok
    # query 3 sees keys 0-3: a future key in place of one of them is hidden, one kept key fewer
    third = model[0, 3].tolist()
    future = [23 if j == third[0] else j for j in third]
    other = model.clone()
    other[0, 3] = torch.tensor(future, dtype=torch.int32)
    assert not compare(other).ok


def _tied_mla_inputs(seq=24, heads=2):
    q_nope, q_rope, kv, k_rope, _, _, _ = _mla_inputs(latent=32, rope=16, index_dim=16, seq=seq)
    return (q_nope, q_rope, kv, k_rope, *_tied_indexer_inputs(seq, heads))


def test_where_the_top_k_ties_the_fused_model_is_the_model_under_a_stable_tie_order():
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16)
    inputs = _tied_mla_inputs()
    out, _, report = compile_and_run(layer, *inputs, config=BOTH)
    assert report.counts["sparse_attention"] == 1 and report.counts["lightning_indexer"] == 1
    # the model with its top-k's ties broken as the stand-in breaks them (lower key first);
    # eager's torch.topk breaks them otherwise here, which torch leaves unspecified (its
    # output differs from this reference by 2.3, from the fused output as much)
    scores, _ = _model_scores(*inputs[4:], 16 ** -0.5)
    stable = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :8].to(torch.int32)
    with torch.no_grad():
        ref = layer(*inputs, indices=stable)
    assert_close_at_scale(out, ref, 4)


def test_an_indexer_with_few_heads_verifies_though_its_scores_tie():
    # transformers' indexer with 2 heads: a quarter of the random keys verification draws
    # score exactly 0, and which of them fill the last slots is the op's and torch.topk's to
    # choose (verification compared key positions before, and refused this site: "integer
    # results differ")
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, verify=True)
    out, ref, report = compile_and_run(AttentionLayer(index_heads=2), _hidden(), config=config)
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    (indexer,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert indexer.verified.startswith("verified: max error"), indexer.verified


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v32", "axk2", "dots3_note_text"])
def test_tiny_dsa_models_fuse_the_indexer_and_match_eager(model_type):
    # at the tiny size before, 4 indexer heads, ties at 0 on the k-th score made axk2 and
    # dots3_note_text differ from eager by 0.047 and 0.078 (the fused indices a top-k too)
    from npu_fx_fusion.tiny_models import build_hf

    tiny = build_hf(model_type)
    out, ref, report = compile_and_run(tiny.model, *tiny.example_inputs)
    assert report.counts["lightning_indexer"] == 2 and report.counts["sparse_attention"] == 2
    assert (out - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


class CompressedIndexerScores(torch.nn.Module):
    """torchtitan-npu DeepSeek-V4's LiCompute (deepseek_v4/model/model.py:520-545): relu'd
    scores of q against compressed keys, weighted over the heads, the blocks past each query
    masked additively with finfo.min, a top-k, its hidden blocks' indices made -1 (raw=True: the
    top-k's own indices returned instead)."""

    def __init__(self, reviews=0, raw=False):
        super().__init__()
        self.reviews, self.raw = reviews, raw

    def forward(self, q, k, weights):
        seqlen = q.shape[1]
        score = torch.einsum("bshd,btd->bsht", q, k).relu_()
        for _ in range(self.reviews):  # moves only, as a graph with symbolic sizes re-views the scores
            score = score.unsqueeze(-1).transpose(-1, -2).squeeze(-2)
        score = (score * weights.unsqueeze(-1)).sum(dim=2)
        base = torch.arange(seqlen).unsqueeze(1)
        mask = torch.arange(seqlen // 4).unsqueeze(0) >= (base + 1) // 4
        score += torch.where(mask, torch.finfo(q.dtype).min, 0)
        indices = score.topk(min(3, seqlen // 4), dim=-1)[1]
        if self.raw:
            return indices
        # the order of the k slots is the op's: the test compares them sorted
        return torch.where(indices >= (base + 1) // 4, -1, indices).sort(-1).values


@pytest.mark.parametrize("dynamic, reviews", [(False, 0), (True, 0), (False, 20), (True, 20)])
def test_the_compressed_indexer_fuses_however_often_its_scores_are_re_viewed(dynamic, reviews):
    """With symbolic sizes the graph re-views the scores several times between the relu and the
    top-k (V4's LiCompute in bf16 with dynamic=True was silent before): the axis algebra reads the
    scores through the moves, and the compressed mask is proven (for every size under dynamic=True)."""
    torch.manual_seed(0)
    q, k, weights = torch.randn(2, 16, 4, 8), torch.randn(2, 4, 8), torch.rand(2, 16, 4)
    out, ref, report = compile_and_run(CompressedIndexerScores(reviews), q, k, weights,
                                       config=nff.FusionConfig(enable={"lightning_indexer"}), dynamic=dynamic)
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    assert report.fused_ops.get("cann_ops_transformer.lightning_indexer") == 1, report.fused_ops
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_compressed_indexers_raw_indices_returned_are_a_near_miss(dynamic):
    # the top-k's own indices leave the graph: where fewer than k blocks are visible the model lists
    # hidden blocks, the op -1, and nothing proves the caller reads them alike
    torch.manual_seed(0)
    q, k, weights = torch.randn(2, 16, 4, 8), torch.randn(2, 4, 8), torch.rand(2, 16, 4)
    out, ref, report = compile_and_run(CompressedIndexerScores(raw=True), q, k, weights,
                                       config=nff.FusionConfig(enable={"lightning_indexer"}), dynamic=dynamic)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "outputs of the graph" in miss, miss
    torch.testing.assert_close(out, ref)
