"""lightning_indexer on DeepSeek-V4's compressed indexer as torchtitan-npu writes it (LiCompute,
deepseek_v4/model/model.py:514-545) and on a hand-written equivalent, with the reads of LiLoss (its
indexer loss, computed in the forward in inference as well).

LiCompute scores the T = S // m compressed blocks (sum_h w_h * relu(q_h . k_t)), adds the finite mask
where(t >= (s + 1) // m, finfo(dtype).min, 0), takes topk(min(index_topk, S // m)) and maps the hidden
blocks' indices to -1 (where(idx >= (s + 1) // m, -1, idx + offset)); LiLoss reads the values (a softmax
over the k slots, kl_div, a sum over them) and the indices (the offset undone, clamp, a gather of the
attention distribution, masked_fill, an L1 normalisation). The pass fuses the top-k into
cann_ops_transformer.lightning_indexer (mask_mode 3, cmp_ratio m, cmp_residual_k S - T * m,
return_value) once the mask is proven the op's (for every size under dynamic=True), and every reader
indifferent to the order of the k slots and to the padded slots, which the replacement gives the model's
values: finfo.min (score + finfo.min rounds to it for |score| < 2**103) and a hidden block's index.

Numerics: fp32, the op sums the same products in another order (the scores within a few ulp, so the
values within 1e-6 relative, the loss within 64 ulp of its scale, 1e-6); bf16, the model rounds its
scores to bf16 on the way (the einsum's bmm, each weighted term, the sum over 16 heads), the op ranks and
returns fp32 ones, rounded once to the model's bf16: each value within 2**-5 of the largest (the model's
roundings, about 16 * 2**-9 of the terms' magnitude), the loss within 2 %. The
indices are compared per row as sets (sorted), the rows' hidden slots -1 in both.
"""
import pytest
import torch
import torch.nn.functional as F

import npu_fx_fusion as nff
from helpers import (RecordingBackend, assert_close_at_scale, compile_and_run, in_subprocess, near_miss_reasons,
                     npu_ops, torchtitan_npu)
from test_sparse_mla_torchtitan import _library

CONFIG = nff.FusionConfig(enable={"lightning_indexer"})
RATIO, TOPK, SEQ, HEADS, DIM = 4, 3, 16, 16, 16


def _li_compute(q, k, w, seqlen, offset, variant="model"):
    """LiCompute.forward by hand; the variants change one thing each."""
    ratio = RATIO
    score = torch.einsum("bshd,btd->bsht", q, k)
    score = (score.relu_() * w.unsqueeze(-1)).sum(dim=2)
    base = torch.arange(seqlen).unsqueeze(1)
    shift = 2 if variant == "threshold" else 1
    mask_ratio = 2 if variant == "mask_ratio" else ratio  # (T stays S // 4)
    mask = torch.arange(seqlen // ratio).unsqueeze(0) >= (base + shift) // mask_ratio
    fill = -1e9 if variant == "fill" else torch.finfo(q.dtype).min
    score += torch.where(mask, fill, 0)
    score, idx = score.topk(min(TOPK, seqlen // ratio), dim=-1)
    reader_ratio = 2 if variant in ("reader_ratio", "mask_ratio") else ratio
    hidden = idx > (base + 1) // reader_ratio if variant == "strict" else idx >= (base + 1) // reader_ratio
    return torch.where(hidden, -1, idx + offset), score, idx


class Indexer(torch.nn.Module):
    """LiCompute (torchtitan-npu's own with library=True, else _li_compute) then LiLoss's reads of its
    results: the indices sorted (the op's slot order is its own), the values sorted, the loss."""

    def __init__(self, variant="model", library=False):
        super().__init__()
        self.variant = variant
        self.li = _library()[0].LiCompute(RATIO, TOPK) if library else None

    def forward(self, q, k, w, attn):
        seqlen = q.shape[1]
        if self.li is not None:
            idx, values = self.li(q, k, w, seqlen, seqlen)
            raw = None
        else:
            idx, values, raw = _li_compute(q, k, w, seqlen, seqlen, self.variant)
        # LiLoss.forward (model.py:327-348) and DSAIndexerLoss.forward
        compress = torch.where(idx == -1, idx, idx - seqlen)
        at = raw if self.variant == "raw_gather" else compress.clamp(min=0)
        selected = torch.gather(attn, -1, at).masked_fill(compress < 0, 0.0)
        index_score = F.softmax(values, dim=-1, dtype=torch.float32)
        selected = F.normalize(selected, p=1, dim=-1)
        loss = F.kl_div((index_score + 1e-10).log(), selected + 1e-10, reduction="none").sum(dim=-1).mean()
        if self.variant == "first_slot":
            loss = loss + values[..., 0].float().mean()
        return idx.sort(-1).values, values.sort(-1).values, loss


def _inputs(dtype=torch.float32, seq=SEQ, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, HEADS, DIM, generator=g).to(dtype)
    k = torch.randn(2, seq // RATIO, DIM, generator=g).to(dtype)
    w = torch.randn(2, seq, HEADS, generator=g).to(dtype)
    attn = torch.softmax(torch.randn(2, seq, seq // RATIO, generator=g), -1)
    return q, k, w, attn


def _check(out, ref, dtype):
    indices, values, loss = out
    torch.testing.assert_close(indices, ref[0], rtol=0, atol=0)
    hidden = ref[1] <= -(2.0 ** 127)
    assert hidden.any() and bool((values[hidden] == ref[1][hidden]).all()), (values, ref[1])
    assert not bool((values[~hidden] <= -(2.0 ** 127)).any())
    visible, expected = values[~hidden].float(), ref[1][~hidden].float()
    if dtype == torch.float32:
        torch.testing.assert_close(visible, expected, rtol=1e-6, atol=1e-6)
    else:
        # the model rounds each of the 16 heads' weighted terms and every partial sum to bf16 (2**-9 relative
        # each): an error up to about 16 * 2**-9 of the terms' magnitude, which cancelling signed weights
        # leave large beside a small score; bounded here by 2**-5 of the largest score
        assert (visible - expected).abs().max() <= 2 ** -5 * expected.abs().max(), (visible, expected)
    if dtype == torch.float32:
        assert (loss - ref[2]).abs() <= 64 * torch.finfo(torch.float32).eps * max(1.0, ref[2].abs().item())
    else:
        assert (loss - ref[2]).abs() <= 2e-2 * ref[2].abs(), (loss, ref[2])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("library", [True, False], ids=["torchtitan_npu", "by_hand"])
def test_licompute_and_its_loss_fuse_and_match_eager(library, dtype, dynamic):
    out, ref, report = compile_and_run(Indexer(library=library), *_inputs(dtype), config=CONFIG, dynamic=dynamic)
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    assert report.fused_ops == {"cann_ops_transformer.lightning_indexer": 1}, report.fused_ops
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert "t >= (s + 1) // 4" in site.note and "below 2**103" in site.note, site.note
    if dynamic:
        assert "proven for every size" in site.note and "k taken as 3" in site.note, site.note
    _check(out, ref, dtype)


@pytest.mark.parametrize("seed", range(3))
def test_rows_that_see_no_block_keep_the_models_uniform_softmax(seed):
    # queries 0..2 see no block: the model's values are all finfo.min there (a uniform softmax), the op's
    # -inf (NaN): the replacement restores finfo.min, so the loss is finite and the model's
    out, ref, report = compile_and_run(Indexer(), *_inputs(seed=seed), config=CONFIG)
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    assert torch.isfinite(out[2]) and bool((out[1][:, :RATIO - 1] == torch.finfo(torch.float32).min).all())
    _check(out, ref, torch.float32)


def test_verification_compares_the_kept_scores():
    config = nff.FusionConfig(enable={"lightning_indexer"}, verify=True)
    out, ref, report = compile_and_run(Indexer(), *_inputs(), config=config)
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    (site,) = [s for s in report.sites if s.pass_name == "lightning_indexer"]
    assert site.verified.startswith("verified"), site.verified


@pytest.mark.parametrize("variant, expected", [
    ("threshold", "nor DeepSeek-V4's compressed causal mask"),          # blocks t >= (s + 2) // 4 hidden
    ("mask_ratio", "not proven in [0, 2)"),                             # blocks t >= (s + 1) // 2 of T = S // 4
    ("reader_ratio", "not with the query's last visible key"),          # the -1 where tests (s + 1) // 2
    ("strict", "not with the query's last visible key"),                # idx > (s + 1) // 4: one block kept
    ("first_slot", "select"),                                           # values[..., 0]: a slot's order
    ("raw_gather", "a gather at the key indices"),                      # the top-k's own indices gathered at
    ("fill", "not only 0 and -inf (or 0 and one finite fill"),          # -1e9: score + fill is not one value
])
def test_look_alikes_are_near_misses_naming_the_failed_check(variant, expected):
    out, ref, report = compile_and_run(Indexer(variant), *_inputs(), config=CONFIG)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert expected in miss, miss
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


def test_a_threshold_of_another_size_is_a_near_miss_under_dynamic_shapes():
    out, ref, report = compile_and_run(Indexer("threshold"), *_inputs(), config=CONFIG, dynamic=True)
    assert report.counts["lightning_indexer"] == 0
    (miss,) = near_miss_reasons(report, "lightning_indexer")
    assert "not proven to hide exactly the blocks t >= (s + 1) // 4" in miss, miss


# ---- training: the values' gradient (LiLoss's KL) reaches q, k and w ------------------------------------------
# The joint replacement: cann_ops_transformer.lightning_indexer(return_value=1) through CompressedLightningIndexer,
# whose backward is npu_lightning_indexer_grad (sparse_mode 0) over the op's listed blocks.
# Tolerance: the scores a few ulp apart (the heads summed in another order); the loss's gradient of the values
# is softmax(values) - target, and each input's gradient a sum over the k slots (the keys': over the queries
# too) of such terms: 32 fp32 ulp of each gradient's largest element, as test_lightning_indexer_readers's
# uncompressed indexer (measured below 4 here); the loss within 64 ulp, as in inference.
class TrainedIndexer(Indexer):
    """Indexer whose outputs are its indices (sorted: the op's slot order is its own) and its loss."""

    def forward(self, q, k, w, attn):
        idx, _, loss = super().forward(q, k, w, attn)
        return idx, loss


def _train(module, inputs, dynamic=None, config=CONFIG):
    torch._dynamo.reset()
    fused_in = [t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(inputs)]
    eager_in = [t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(inputs)]
    backend = RecordingBackend(config)
    idx, loss = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(*fused_in)
    loss.backward()
    idx_ref, loss_ref = module(*eager_in)
    loss_ref.backward()
    assert backend.report.errors == []
    torch.testing.assert_close(idx, idx_ref, rtol=0, atol=0)
    assert_close_at_scale(loss, loss_ref, 64)
    for name, a, b in zip("qkw", fused_in, eager_in):
        try:
            assert_close_at_scale(a.grad, b.grad, 32)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    return backend


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("library", [True, False], ids=["torchtitan_npu", "by_hand"])
def test_a_training_step_fuses_the_compressed_indexer_and_its_backward(library, dynamic):
    backend = _train(TrainedIndexer(library=library), _inputs(), dynamic=dynamic)
    report = backend.report
    assert report.counts["lightning_indexer"] == 1, near_miss_reasons(report, "lightning_indexer")
    forward = [str(n.target) for n in backend.graphs["forward"].graph.nodes if n.op == "call_function"]
    assert forward.count("cann_ops_transformer.lightning_indexer.default") == 1, forward
    assert npu_ops(backend.graphs["backward"]).get("npu_lightning_indexer_grad") == 1, backend.graphs["backward"].code
    (grad,) = [n for n in backend.graphs["backward"].graph.nodes
               if n.op == "call_function" and str(n.target) == "npu.npu_lightning_indexer_grad.default"]
    assert grad.args[8] == 0, grad.args  # sparse_mode 0: the compressed blocks, no causal mask of its own
    joint = next(g for g in report.graphs if g.name == "joint")
    (site,) = [s for r in joint.passes if r.pass_name == "lightning_indexer" for s in r.sites]
    assert "in training: the top-k values' gradient reaches query, key and weights" in site.note, site.note
    # queries 0..2 see no block: behind the additive finfo.min mask their values are uniform, whose softmax
    # backward is 0 in every slot
    assert "softmax's over the slots, 0 in the padded slots" in site.note, site.note


@pytest.mark.parametrize("soc, fuses", [("Ascend910B", True), ("Ascend950", False)])
def test_training_honours_the_grad_ops_weights_dtype_per_soc(soc, fuses):
    # the op's sizes (indexer head dim 128, 4 heads) in bf16; the compressed op takes fp32 weights, which
    # npu_lightning_indexer_grad takes on A2/A3 only
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, SEQ, 4, 128, generator=g).bfloat16().requires_grad_(True)
    k = torch.randn(2, SEQ // RATIO, 128, generator=g).bfloat16()
    w = torch.randn(2, SEQ, 4, generator=g).bfloat16()
    attn = torch.softmax(torch.randn(2, SEQ, SEQ // RATIO, generator=g), -1)
    config = nff.FusionConfig(enable={"lightning_indexer"}, soc=soc)
    compiled = torch.compile(TrainedIndexer(), backend=nff.get_npu_backend(fusion_config=config), fullgraph=True)
    compiled(q, k, w, attn)[1].backward()
    report = nff.last_report()
    assert report.counts["lightning_indexer"] == int(fuses), near_miss_reasons(report, "lightning_indexer")
    if not fuses:
        misses = near_miss_reasons(report, "lightning_indexer")
        assert any("npu.npu_lightning_indexer_grad takes the compressed indexer's fp32 weights only on" in m
                   for m in misses), misses


def test_a_reader_of_the_values_slot_order_in_training_is_a_near_miss():
    # Indexer returns values.sort(): in training its backward scatters the gradient by the sort's permutation
    q, k, w, attn = _inputs()
    w.requires_grad_(True)
    compiled = torch.compile(Indexer(), backend=nff.get_npu_backend(fusion_config=CONFIG), fullgraph=True)
    compiled(q, k, w, attn)[2].backward()
    report = nff.last_report()
    assert report.counts["lightning_indexer"] == 0
    misses = near_miss_reasons(report, "lightning_indexer")
    assert any("sorted by" in m for m in misses), misses


# ---- torchtitan-npu's own DeepSeek-V4, built tiny (bf16: it runs in bf16 only) --------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torchtitan_npu_v4_indexer_fuses_and_its_loss_is_eagers(dynamic):
    in_subprocess("test_lightning_indexer_compressed", f"v4_indexer({dynamic})")


def v4_indexer(dynamic):
    import importlib

    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v4", dtype=torch.bfloat16)
    helper = importlib.import_module("torchtitan_npu.models.common.dsa_indexer_loss").DSAIndexerLossLoggingHelper
    torch._dynamo.reset()
    compiled = torch.compile(tiny.model, backend=nff.get_npu_backend(fusion_config=nff.FusionConfig()),
                             dynamic=dynamic)
    with torch.no_grad():
        helper.tracker.clear()
        out = compiled(*tiny.example_inputs)
        losses = helper.tracker["values"].clone()
        report = nff.last_report()
        torch._dynamo.reset()
        helper.tracker.clear()
        compiled_off = torch.compile(tiny.model, backend=nff.get_npu_backend(fusion_config=nff.FusionConfig(
            disable={"lightning_indexer"})), dynamic=dynamic)
        unfused = compiled_off(*tiny.example_inputs)
        unfused_losses = helper.tracker["values"].clone()
        helper.tracker.clear()
        ref = tiny.model(*tiny.example_inputs)
        expected = helper.tracker["values"].clone()
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    assert report.fused_ops.get("cann_ops_transformer.lightning_indexer") == 1, report.fused_ops
    assert expected[0] > 0, expected  # the CSA layer's loss was computed (the others have no indexer)
    # the attention reads the model's indices, as the fused op lists them: the logits are those of the
    # graph compiled without this pass up to the indexer's bf16 ranking (the same blocks here)
    assert (out.float() - unfused.float()).abs().max() <= 2e-2 * unfused.float().abs().max()
    assert (out.float() - ref.float()).abs().max() <= 5e-2 * ref.float().abs().max()
    # the loss: the model's bf16 scores against the op's fp32 ones rounded once (2 % as the V3.2 loss)
    assert ((losses - expected).abs() <= 2e-2 * expected.abs()).all(), (losses, expected)
    assert ((unfused_losses - expected).abs() <= 2e-2 * expected.abs()).all(), (unfused_losses, expected)


@pytest.mark.slow
def test_torchtitan_npu_v4_indexer_trains_fused_with_the_gradients_of_the_unfused_graph():
    in_subprocess("test_lightning_indexer_compressed", "v4_indexer_training()")


def v4_indexer_training():
    # one training step of the whole tiny model (the logits against a fixed probe; DSAIndexerLossAutoScaler seeds
    # the indexer loss's gradient), compiled with every pass and with all but this one. The indexer's parameters
    # train only through LiLoss's KL of its top-k values: their gradients reach them through the fused op's
    # backward here, through autograd's there. Measured: 1 bf16 ulp of each gradient's largest element (the
    # scores' fp32 ranking and sums beside the model's bf16 ones); allowed 4.
    tiny = torchtitan_npu().build_third_party("torchtitan_npu", "deepseek_v4", dtype=torch.bfloat16)
    model = tiny.model.train()

    def step(config):
        torch._dynamo.reset()
        model.zero_grad()
        out = torch.compile(model, backend=nff.get_npu_backend(fusion_config=config))(*tiny.example_inputs)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out.float() * probe).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if ".indexer." in name}
        return grads, nff.last_report()

    fused, report = step(nff.FusionConfig())
    unfused, _ = step(nff.FusionConfig(disable={"lightning_indexer"}))
    assert report.counts["lightning_indexer"] == 1, report.near_misses
    assert report.fused_ops.get("cann_ops_transformer.lightning_indexer") == 1, report.fused_ops
    assert report.fused_ops.get("npu.npu_lightning_indexer_grad") == 1, report.fused_ops
    assert len(fused) == 6 and all(g is not None for g in fused.values()), fused.keys()
    for name, grad in fused.items():
        assert grad.abs().max() > 0, name
        try:
            assert_close_at_scale(grad, unfused[name], 4, precision=torch.bfloat16)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
