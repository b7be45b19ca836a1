"""sparse_attention over a top-k mask the model materialises its own way (the given-mask forms).

torchtitan-npu's DeepSeek-V3.2 (DSV32_SDPA.forward) turns its indexer's top-k into an
attention mask through an additive causal bias, a scatter of 0 into -inf, isinf and a
negation, with the slots whose key is in the future replaced by the sentinel seqlen - 1
(scatter takes no -1); then SDPA over that bool mask. The pass matches SDPA over any
bool mask and proves, for every size, that the mask shows each query exactly the keys
its row of a top-k lists that the causal mask lets through (sparse_attention.
top_k_mask_proof), and that no key the query sees is listed twice; the fused call takes
those indices (Form.bound).

The module below writes that computation in several spellings (the mask: additive
-inf/0 with isinf, a bool scatter, masked_fill of a float scatter; with or without the
sentinel; one key head (MLA absorbed) or per-head keys), and the negatives break one
condition each. Numerics: npu_sparse_flash_attention's stand-in computes the scores in
fp32 with the scale applied once, the model's SDPA scales q and k by sqrt(scale) each:
a few fp32 ulps at the output's scale (bf16: both compute in fp32 and round the output
once).
"""

import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import (assert_close_at_scale, compile_and_run, in_subprocess, near_miss_reasons,
                     torchtitan_npu)

SPARSE = nff.FusionConfig(enable={"sparse_attention", "attention"})
SEQ, TOPK = 12, 5


class TopKMaskAttention(torch.nn.Module):
    """Attention over the top-k keys of an indexer score, the mask built as `mask` says.

    mask: "additive" (torchtitan-npu's: causal bias + scatter(-inf, idx, 0), isinf & < 0),
    "bool" (zeros(bool).scatter(idx, True) & tril), "masked_fill" (a float scatter read
    with masked_fill of the causal mask, == 0);
    sentinel: the hidden slots (index > query) replaced by this key ("last": seqlen - 1, an
    int: that key), or None (the top-k's indices as they are).
    Negatives: window (a sliding window instead of the causal mask), hide_key (the mask
    hides key 3 too), indices="input" (indices given by the caller), strict (the slots kept
    where index < query, which the proof does not take).
    """

    def __init__(self, mask="additive", sentinel="last", kv_heads=1, window=None, hide_key=None, strict=False,
                 dim=16, rope=8, heads=4, causal=True, transposed=False, by_view=False):
        super().__init__()
        self.transposed, self.by_view = transposed, by_view
        self.mask, self.sentinel, self.kv_heads, self.causal = mask, sentinel, kv_heads, causal
        self.window, self.hide_key, self.strict = window, hide_key, strict
        self.dim, self.rope, self.heads = dim, rope, heads

    def _mask(self, index_score, indices_input):
        bsz, seqlen, _ = index_score.shape
        causal_bias = torch.where(
            torch.triu(torch.ones((bsz, seqlen, seqlen), dtype=index_score.dtype), diagonal=1) == 1,
            float("-inf"), 0.0)
        if not self.causal:  # every key visible: the selection alone (sparse_mode 0)
            causal_bias = torch.zeros((bsz, seqlen, seqlen), dtype=index_score.dtype)
        if self.window is not None:
            i = torch.arange(seqlen).unsqueeze(-1)
            j = torch.arange(seqlen).unsqueeze(0)
            causal_bias = torch.where((j <= i) & (j > i - self.window), 0.0, float("-inf")).expand(bsz, -1, -1)
        if indices_input is None:
            _, indices = (index_score + causal_bias).topk(min(TOPK, seqlen), dim=-1)
        else:
            indices = indices_input
        if self.sentinel is not None:
            positions = torch.arange(seqlen).unsqueeze(0).unsqueeze(-1)
            valid = indices < positions if self.strict else indices <= positions
            sentinel = seqlen - 1 if self.sentinel == "last" else self.sentinel
            indices = torch.where(valid, indices, torch.full_like(indices, sentinel))
        if self.mask == "additive":
            index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter_(-1, indices, 0)
            hidden = causal_bias + index_mask
            visible = ~(torch.isinf(hidden) & (hidden < 0))
        elif self.mask == "bool":
            listed = torch.zeros((bsz, seqlen, seqlen), dtype=torch.bool).scatter(-1, indices, True)
            visible = listed & (causal_bias == 0)
        else:  # masked_fill
            index_mask = torch.full((bsz, seqlen, seqlen), float("-inf")).scatter(-1, indices, 0.0)
            visible = index_mask.masked_fill(causal_bias != 0, float("-inf")) == 0
        if self.hide_key is not None:
            visible = visible & (torch.arange(seqlen) != self.hide_key)
        if self.transposed:  # each key row read as a query row: not the listed keys
            visible = visible.transpose(-1, -2)
        return visible.view(bsz, 1, seqlen, seqlen) if self.by_view else visible.unsqueeze(1)

    def forward(self, q, k, v, index_score, indices_input=None):
        visible = self._mask(index_score, indices_input)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.25)


def _inputs(kv_heads=1, dtype=torch.float32, seq=SEQ, batch=2, heads=4, dim=16, rope=8, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim + rope, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim + rope, generator=g)
    latent = k[..., :dim] if kv_heads == 1 else torch.randn(batch, kv_heads, seq, dim, generator=g)
    v = latent.clone()
    score = torch.randn(batch, seq, seq, generator=g)
    tensors = [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]
    return (*tensors, score)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
@pytest.mark.parametrize("kv_heads", [1, 4], ids=["one key head", "per-head keys"])
@pytest.mark.parametrize("mask, sentinel", [
    ("additive", "last"), ("additive", None), ("bool", "last"), ("bool", None), ("masked_fill", "last"),
])
def test_a_mask_materialised_from_top_k_indices_fuses_as_a_sparse_attention(mask, sentinel, kv_heads, npu_dispatch):
    config = nff.FusionConfig(enable={"sparse_attention", "attention"}, npu_dispatch=npu_dispatch)
    out, ref, report = compile_and_run(TopKMaskAttention(mask, sentinel), *_inputs(kv_heads), config=config)
    # the sparse pass runs first: the dense attention pass does not take it
    assert report.counts["sparse_attention"] == 1 and report.counts["attention"] == 0, report.near_misses
    assert report.fused_ops == {"npu.npu_sparse_flash_attention": 1}
    (site,) = report.sites
    assert "under the right-down causal mask (proven for every size)" in site.note, site.note
    assert_close_at_scale(out, ref, 4)


@pytest.mark.parametrize("module, reason", [
    (TopKMaskAttention(window=4), "not shown by the attention mask as the right-down causal mask"),
    (TopKMaskAttention(hide_key=3), "not shown by the attention mask as the right-down causal mask"),
    (TopKMaskAttention(sentinel=0), "replacement for slots the causal mask hides (0) is not proven >= T - 1"),
    (TopKMaskAttention(strict=True), "not where the causal mask shows the key"),
    (TopKMaskAttention(transposed=True), "reads its scatter through a permute"),
], ids=["sliding window", "another key hidden", "visible sentinel", "strict validity", "transposed"])
def test_masks_that_are_not_causal_and_listed_keep_the_model_unfused_as_sparse(module, reason):
    out, ref, report = compile_and_run(module, *_inputs(), config=nff.FusionConfig(enable={"sparse_attention"}))
    assert report.counts["sparse_attention"] == 0
    misses = near_miss_reasons(report, "sparse_attention")
    assert any(reason in m for m in misses), misses
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_mask_viewed_to_four_dims_fuses(dynamic):
    out, ref, report = compile_and_run(TopKMaskAttention("bool", by_view=True), *_inputs(), config=SPARSE,
                                       dynamic=dynamic)
    assert report.counts["sparse_attention"] == 1, report.near_misses
    assert_close_at_scale(out, ref, 4)


def test_without_a_causal_mask_the_selection_alone_fuses_with_sparse_mode_0():
    out, ref, report = compile_and_run(TopKMaskAttention(sentinel=None, causal=False), *_inputs(), config=SPARSE)
    assert report.counts["sparse_attention"] == 1
    (site,) = report.sites
    assert "sparse_mode 0, not 3" in site.note and "under the right-down causal mask" not in site.note, site.note
    assert_close_at_scale(out, ref, 4)


def test_a_sentinel_without_the_causal_mask_is_not_fused():
    # no causal mask hides the sentinel key: where it repeats, the op would count it again
    out, ref, report = compile_and_run(TopKMaskAttention(causal=False), *_inputs(), config=SPARSE)
    assert report.counts["sparse_attention"] == 0
    assert any("not a top-k's" in m for m in near_miss_reasons(report, "sparse_attention"))
    torch.testing.assert_close(out, ref)


def test_indices_that_are_not_a_top_k_are_not_fused():
    # the caller's indices may list a key twice: the op would count it twice, the mask once
    indices = torch.randint(0, SEQ, (2, SEQ, TOPK))
    out, ref, report = compile_and_run(TopKMaskAttention(sentinel=None), *_inputs(), indices,
                                       config=nff.FusionConfig(enable={"sparse_attention"}))
    assert report.counts["sparse_attention"] == 0
    assert any("not a top-k's" in m for m in near_miss_reasons(report, "sparse_attention"))
    torch.testing.assert_close(out, ref)


def test_bf16_fuses_and_rounds_once():
    out, ref, report = compile_and_run(TopKMaskAttention(), *_inputs(dtype=torch.bfloat16), config=SPARSE)
    assert report.counts["sparse_attention"] == 1
    # the model's SDPA computes in fp32 and rounds its output once, as the op does
    assert_close_at_scale(out, ref, 4)


def test_under_dynamic_shapes_the_mask_and_sentinel_are_proven_for_every_size():
    module = TopKMaskAttention()
    backend_config = nff.FusionConfig(enable={"sparse_attention"})
    from helpers import GuardRecordingBackend

    backend = GuardRecordingBackend(backend_config)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for seq in (12, 9):
            assert_close_at_scale(compiled(*_inputs(seq=seq)), module(*_inputs(seq=seq)), 4)
    assert backend.report.counts["sparse_attention"] == 1


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_training_fuses_and_the_gradients_are_eagers(npu_dispatch):
    module = TopKMaskAttention()
    config = nff.FusionConfig(enable={"sparse_attention"}, npu_dispatch=npu_dispatch)
    inputs = _inputs(grad=True)
    out, ref, report = compile_and_run(module, *inputs, config=config, grad=True)
    assert report.counts["sparse_attention"] == 1, report.near_misses
    assert report.fused_ops.get("npu.npu_sparse_flash_attention_grad", 0) == 1, report.fused_ops
    grads = torch.autograd.grad(out.sum(), inputs[:3])
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs[:3]]
    expected = module(*ref_inputs, inputs[3])
    ref_grads = torch.autograd.grad(expected.sum(), ref_inputs)
    assert_close_at_scale(out.detach(), expected.detach(), 4)
    for actual, wanted in zip(grads, ref_grads):
        assert_close_at_scale(actual, wanted, 16)


class ProjectedTopKMaskAttention(torch.nn.Module):
    """TopKMaskAttention whose output an einsum projects, as torchtitan-npu's DeepSeek-V3.2
    projects its attention output through wo: the output's gradient reaches the attention's
    backward as a permute of the einsum's gradient, not contiguous, so the matmul backward's
    reshape copies it (clone + _unsafe_view) where the joint form's trace views its tangent."""

    def __init__(self, **kwargs):
        super().__init__()
        self.attention = TopKMaskAttention(**kwargs)

    def forward(self, q, k, v, index_score, w):
        return torch.einsum("bhsd,hde->bse", self.attention(q, k, v, index_score), w)


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_fuses_with_the_output_gradient_in_another_layout(dtype, npu_dispatch):
    # the copy of the permuted gradient (and, in bf16, the upcast before it) stays outside the
    # match: canonical.gradient_copies_apart. Before it, the CPU graph was a near miss
    module = ProjectedTopKMaskAttention()
    config = nff.FusionConfig(enable={"sparse_attention"}, npu_dispatch=npu_dispatch)
    q, k, v, score = _inputs(grad=True, dtype=dtype)
    w = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    out, _, report = compile_and_run(module, q, k, v, score, w, config=config, grad=True)
    assert report.counts["sparse_attention"] == 1, report.near_misses
    assert report.fused_ops.get("npu.npu_sparse_flash_attention_grad", 0) == 1, report.fused_ops
    grads = torch.autograd.grad(out.float().pow(2).sum(), (q, k, v, w))
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, w)]
    expected = module(*ref_inputs[:3], score, ref_inputs[3])
    ref_grads = torch.autograd.grad(expected.float().pow(2).sum(), ref_inputs)
    if dtype == torch.float32:
        assert_close_at_scale(out.detach(), expected.detach(), 4)
        for actual, wanted in zip(grads, ref_grads):
            assert_close_at_scale(actual, wanted, 16)
    else:  # both compute the attention in fp32 and round its output and gradients to bf16 once
        assert_close_at_scale(out.detach(), expected.detach(), 2)
        for actual, wanted in zip(grads, ref_grads):
            assert_close_at_scale(actual, wanted, 4)


@pytest.mark.parametrize("module, reason", [
    (ProjectedTopKMaskAttention(window=4), "not shown by the attention mask as the right-down causal mask"),
    (ProjectedTopKMaskAttention(sentinel=0), "replacement for slots the causal mask hides (0) is not proven >= T - 1"),
], ids=["sliding window", "visible sentinel"])
def test_in_training_on_the_cpu_graph_masks_that_are_not_causal_and_listed_stay_unfused(module, reason):
    config = nff.FusionConfig(enable={"sparse_attention"}, npu_dispatch=False)
    q, k, v, score = _inputs(grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    out, ref, report = compile_and_run(module, q, k, v, score, w, config=config, grad=True)
    assert report.counts["sparse_attention"] == 0
    assert any(reason in m for m in near_miss_reasons(report, "sparse_attention")), report.near_misses
    torch.testing.assert_close(out, ref)
    leaves = (q, k, v, w)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(ref.sum(), leaves))


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_in_training_a_frozen_value_is_a_near_miss_that_says_so(npu_dispatch):
    # the joint forms are traced with q, k and v all differentiable (one gradient subset)
    config = nff.FusionConfig(enable={"sparse_attention"}, npu_dispatch=npu_dispatch)
    q, k, v, score = _inputs(grad=True)
    w = torch.randn(4, 16, 8, requires_grad=True)
    out, ref, report = compile_and_run(ProjectedTopKMaskAttention(), q, k, v.detach(), score, w, config=config,
                                       grad=True)
    assert report.counts["sparse_attention"] == 0
    misses = near_miss_reasons(report, "sparse_attention")
    assert misses and all("a site where one of them gets no gradient (a frozen projection) is not covered" in m
                          for m in misses), misses
    torch.testing.assert_close(out, ref)


# ---- torchtitan-npu's own DeepSeek-V3.2 (DSV32_SDPA), built tiny -------------------------------------
@pytest.mark.parametrize("dtype, dynamic", [("float32", False), ("bfloat16", True)], ids=["fp32", "bf16 dynamic"])
def test_torchtitan_npu_dsv32_sparse_attention_fuses(dtype, dynamic):
    in_subprocess("test_sparse_attention_given_mask", f"dsv32_inference(torch.{dtype}, {dynamic})")


def dsv32_inference(dtype, dynamic):
    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v32", dtype=dtype)
    torch._dynamo.reset()
    backend = nff.get_npu_backend(fusion_config=nff.FusionConfig())
    compiled = torch.compile(tiny.model, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        out = compiled(*tiny.example_inputs)
        ref = tiny.model(*tiny.example_inputs)
    report = nff.last_report()
    assert report.counts["sparse_attention"] == 2 and report.counts["attention"] == 0, report.near_misses
    if dtype == torch.float32:
        # the op scales q.k once where SDPA scales q and k by sqrt(scale) each: fp32 ulps,
        # through two layers and the head (measured: 1)
        assert_close_at_scale(out, ref, 16)
        # the indexer fuses too (its readers proven slot-order free: test_lightning_indexer_readers);
        # the loss's target stays unfused, saying what stops it
        assert report.counts["lightning_indexer"] == 2, report.near_misses
        target = near_miss_reasons(report, "softmax_l1_norm")
        assert len(target) == 2 and all("not divided by the" in m for m in target), target
    else:  # the bf16 model rounds its activations in bf16 around the attention either way
        assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()


@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
def test_torchtitan_npu_dsv32_training_step_fuses_and_equals_eager(npu_dispatch):
    in_subprocess("test_sparse_attention_given_mask", f"dsv32_training_step(npu_dispatch={npu_dispatch})")


def dsv32_training_step(npu_dispatch=True):
    """One fp32 step (loss: mean of the squared logits) on the NPU graph (FlashAttention and its
    grad op) or the CPU graph (SDPA's math decomposition, whose output gradient arrives as a copy
    of the permuted gradient of the einsum through wo: the survey's training step), next to eager:
    both layers' sparse attention fuse with their backward (npu_sparse_flash_attention_grad).
    Gradients within 64 fp32 ulp of each gradient's largest element, the loss within 4 ulp
    (as test_third_party_models' training steps: the fused ops compute the same fp32 sums in
    another order, and the differences travel through every matmul after them)."""
    t3 = torchtitan_npu()
    fused_model = t3.build_third_party("torchtitan_npu", "deepseek_v32").model
    tiny = t3.build_third_party("torchtitan_npu", "deepseek_v32")
    eager_model, inputs = tiny.model, tiny.example_inputs
    fused_model.train()
    eager_model.train()
    torch._dynamo.reset()
    backend = nff.get_npu_backend(fusion_config=nff.FusionConfig(npu_dispatch=npu_dispatch))
    compiled = torch.compile(fused_model, backend=backend)
    loss = compiled(*inputs).float().pow(2).mean()
    loss.backward()
    report = nff.last_report()
    expected = eager_model(*inputs).float().pow(2).mean()
    expected.backward()
    assert report.counts["sparse_attention"] == 2, report.near_misses
    assert report.fused_ops.get("npu.npu_sparse_flash_attention", 0) == 2, report.fused_ops
    assert report.fused_ops.get("npu.npu_sparse_flash_attention_grad", 0) == 2, report.fused_ops
    assert not near_miss_reasons(report, "sparse_attention"), report.near_misses
    assert_close_at_scale(loss.detach(), expected.detach(), 4)
    for (name, fused), (_, eager) in zip(fused_model.named_parameters(), eager_model.named_parameters()):
        if eager.grad is None:
            assert fused.grad is None or not fused.grad.any(), name
            continue
        assert_close_at_scale(fused.grad, eager.grad, 64)


def test_a_check_that_binds_nothing_is_not_fused(monkeypatch):
    # Form.bound: the replacement needs the indices; a site accepted without them is refused
    from npu_fx_fusion.forms import Site

    monkeypatch.setattr(Site, "bind", lambda self, name, node: None)
    out, ref, report = compile_and_run(TopKMaskAttention(), *_inputs(), config=SPARSE)
    assert report.counts["sparse_attention"] == 0
    assert any("the check bound no indices" in m for m in near_miss_reasons(report, "sparse_attention"))
    torch.testing.assert_close(out, ref)


class IndexerFeedingALoss(torch.nn.Module):
    """An indexer (sum over heads of w_h * relu(q_h . k), an additive causal mask, a top-k)
    whose scores and indices also feed a loss, as torchtitan-npu's DSV32_SDPA's do; spelled
    with einsum here (the model: permutes and matmul)."""

    def forward(self, q, k, w):
        scores = (torch.relu(torch.einsum("bshd,btd->bhst", q.float(), k.float())) * w.permute(0, 2, 1)[..., None])
        scores = scores.sum(dim=1)
        seq = scores.shape[-1]
        scores = scores + torch.where(torch.triu(torch.ones(seq, seq), diagonal=1) == 1, float("-inf"), 0.0)
        values, indices = scores.topk(4, dim=-1)
        target = torch.softmax(torch.randn_like(scores).masked_fill(torch.isinf(scores), float("-inf")), -1)
        return (torch.softmax(values, -1) * target.gather(-1, indices)).sum()


def test_an_indexer_whose_indices_are_gathered_at_before_any_sentinel_names_the_gather():
    # the softmax of its scores is slot-order free; the gather at the top-k's own indices reads the key
    # a padded slot lists, where the op pads (tests/test_lightning_indexer_readers.py)
    q, k, w = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 4)
    _, _, report = compile_and_run(IndexerFeedingALoss(), q, k, w,
                                   config=nff.FusionConfig(enable={"lightning_indexer"}))
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "gather" in miss and "the op pads slots" in miss, miss
