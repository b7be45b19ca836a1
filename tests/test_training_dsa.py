"""DeepSeek-V3.2 sparse attention in training graphs: forward and backward fused together.

sparse_attention runs on the joint forward+backward graph (docs/training.md): its joint
replacement calls npu_sparse_flash_attention with return_softmax_lse=True, whose autograd
brings npu_sparse_flash_attention_grad into the backward. transformers' indexer runs under
no_grad, so no gradient flows through it; its indices are saved for that backward, which
after partitioning the forward-only indexer pass cannot see, so lightning_indexer matches
its forward-only forms on the joint graph (FusionPass.forward_forms_on_joint) and emits
npu_lightning_indexer (no return_value, no backward).

Every test runs one compiled training step through the emulation backend next to the same
step in eager, checks which fused ops the forward and backward graphs call, and compares
the gradient of every parameter and input.

Tolerances, in ulp of each gradient's dtype at its largest element (assert_close_at_scale):
the fused backward is FlashAttention's closed form (dS = P * (dP - rowsum(dO * O)), P
recomputed from the forward's softmax_max / softmax_sum), where eager runs autograd's
op-by-op derivative of the dense masked softmax. Both are exact formulas evaluated in
another order, in fp32: they differ by rounding, absolute at the scale of the gradient
(dS is a difference of two terms of the size of P * dP, and the key / value gradients
are sums over queries). Unit layers: 8 fp32 ulp (measured: <= 3.5 transformers form,
<= 4.4 absorbed MLA). bf16 (the model's SDPA math upcasts to fp32 and rounds the output
once, as the op does; both sides round each gradient to bf16 once): 4 bf16 ulp (measured:
<= 1). Two-layer model, where the differences flow through every matmul after the
attention: 64 fp32 ulp, as in test_training.py (measured: <= 16).
"""
from __future__ import annotations

import copy

import pytest
import torch

import npu_fx_fusion as nff
from helpers import RecordingBackend, assert_close_at_scale, near_miss_reasons, npu_ops
from npu_fx_fusion.pipeline import load_pass

pytest.importorskip("transformers")

from test_sparse_attention import AttentionLayer, MlaSparseLayer, _hidden, _mla_inputs  # noqa: E402

DSA = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"})
UNIT_ULPS = {torch.float32: 8, torch.bfloat16: 4}
MODEL_ULPS = 64


def _calls(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == f"npu.{name}.default"]


def _joint_sites(report):
    joint = next(g for g in report.graphs if g.name == "joint")
    return {r.pass_name: r.sites for r in joint.passes}


def _train(module, inputs, config, *, requires_grad=None):
    """One compiled and one eager step; every parameter and input gradient must agree.
    Returns the backend (its report and graphs)."""
    torch._dynamo.reset()
    reference = copy.deepcopy(module)
    requires_grad = requires_grad or [t.is_floating_point() for t in inputs]
    fused_in = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, requires_grad)]
    eager_in = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, requires_grad)]
    backend = RecordingBackend(config)
    out = torch.compile(module, backend=backend, fullgraph=True)(*fused_in)
    torch.manual_seed(5)
    probe = torch.randn(out.shape)
    (out.float() * probe).sum().backward()
    out_ref = reference(*eager_in)
    (out_ref.float() * probe).sum().backward()
    ulps = UNIT_ULPS[out.dtype]
    assert_close_at_scale(out, out_ref, ulps)
    named = [(f"param {n}", p.grad, q.grad) for (n, p), q in zip(module.named_parameters(), reference.parameters())]
    named += [(f"input {i}", a.grad, b.grad) for i, (a, b) in enumerate(zip(fused_in, eager_in)) if a.requires_grad]
    assert named
    for name, grad, grad_ref in named:
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            try:
                assert_close_at_scale(grad, grad_ref, ulps)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
    assert backend.report.errors == []
    return backend


# ---- transformers' DeepseekV32Attention (indexer, top-k mask, SDPA) -------------------------
@pytest.mark.parametrize("npu_dispatch", [True, False], ids=["npu graph", "cpu graph"])
@pytest.mark.parametrize("index_topk", [8, 12])  # 12: most queries see fewer keys (-1 padding)
def test_transformers_attention_trains_through_the_fused_ops(index_topk, npu_dispatch):
    # an NPU compile holds SDPA as npu_fusion_attention_v3 with its grad op in the backward
    # (npu_dispatch.py), the CPU trace its math decomposition: the FA and math forms both fuse
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, npu_dispatch=npu_dispatch)
    backend = _train(AttentionLayer(index_topk).train(), [_hidden()], config)
    joint = next(g for g in backend.report.graphs if g.name == "joint")
    assert (joint.ops_before["npu.npu_fusion_attention_grad_v3.default"] == 1) == npu_dispatch
    forward, backward = backend.graphs["forward"], backend.graphs["backward"]
    assert npu_ops(forward) == {"npu_lightning_indexer": 1, "npu_sparse_flash_attention": 1}
    assert npu_ops(backward) == {"npu_sparse_flash_attention_grad": 1}
    # the joint replacement asks for the lse its backward reads; the indexer, without a
    # gradient, for the indices only
    (attention,) = _calls(forward, "npu_sparse_flash_attention")
    assert attention.kwargs["return_softmax_lse"] is True and attention.kwargs.get("sparse_mode", 3) == 3
    (indexer,) = _calls(forward, "npu_lightning_indexer")
    assert not indexer.kwargs.get("return_value", False)
    sites = _joint_sites(backend.report)
    assert [s.form for s in sites["sparse_attention"]] == [
        "transformers_fa_v3_top_k_mask_bsnd" if npu_dispatch else "transformers_sdpa_top_k_mask_bsnd"]
    assert len(sites["lightning_indexer"]) == 1
    # in emulation the site says what max-autotune would refuse, and the kernels' limits
    note = sites["sparse_attention"][0].note
    assert "in max-autotune: training: npu.npu_sparse_flash_attention_grad has no GE converter" in note, note
    assert "on an NPU: head dim 16, the kernels take 512" in note, note
    assert backend.report.fused_ops == {"npu.npu_lightning_indexer": 1, "npu.npu_sparse_flash_attention": 1,
                                        "npu.npu_sparse_flash_attention_grad": 1}


def test_batch_1_trains_through_the_fused_ops():
    # the pass's batch-1 example is registered joint too (torch's matmul views where it
    # copies at batch 2, so its joint trace differs)
    backend = _train(AttentionLayer(8).train(), [_hidden()[:1]], DSA)
    assert npu_ops(backend.graphs["forward"]) == {"npu_lightning_indexer": 1, "npu_sparse_flash_attention": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}
    mla = _train(MlaSparseLayer(latent=32, rope=16, index_dim=16), [t[:1] for t in _mla_batch()], DSA,
                 requires_grad=[True] * 4 + [False] * 3)
    assert npu_ops(mla.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}


def test_transformers_attention_trains_in_bf16():
    backend = _train(AttentionLayer().to(torch.bfloat16).train(), [_hidden(torch.bfloat16)], DSA)
    assert npu_ops(backend.graphs["forward"]) == {"npu_lightning_indexer": 1, "npu_sparse_flash_attention": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}


def test_without_a_mask_the_attention_trains_with_sparse_mode_0():
    backend = _train(AttentionLayer(mask="full").train(), [_hidden()], DSA)
    (attention,) = _calls(backend.graphs["forward"], "npu_sparse_flash_attention")
    assert attention.kwargs["sparse_mode"] == 0
    assert npu_ops(backend.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}


def test_after_partitioning_the_indexer_would_not_fuse(monkeypatch):
    # what the joint route is for: without it (the forward-only pass on the partitioned
    # forward graph) the indices are a forward-graph output, saved for the attention's
    # backward, whose reader the pass cannot see; it stays unfused and says why
    monkeypatch.setattr(load_pass("lightning_indexer"), "forward_forms_on_joint", False)
    backend = _train(AttentionLayer().train(), [_hidden()], DSA)
    assert npu_ops(backend.graphs["forward"]) == {"npu_sparse_flash_attention": 1}
    (miss,) = near_miss_reasons(backend.report, "lightning_indexer")
    assert "its indices are an output of the graph" in miss and "saved for the backward" in miss, miss


# ---- absorbed MLA over gathered keys (DeepSeek-V3.2's reference form) ------------------------
def _mla_batch(seq=12, latent=32, rope=16, index_dim=16):
    """The layer's inputs at batch 2 (the joint patterns' batch), a prefill."""
    torch.manual_seed(4)
    inputs = _mla_inputs(seq=seq, latent=latent, rope=rope, index_dim=index_dim)
    return [torch.cat([t, torch.randn_like(t)]) for t in inputs]


def test_absorbed_mla_gathered_form_trains_through_the_fused_ops():
    # q_nope, q_rope, kv and k_rope need gradients (they come from trainable projections);
    # the indexer's inputs do not (its top-k has none)
    inputs = _mla_batch()
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16)
    backend = _train(layer, inputs, DSA, requires_grad=[True] * 4 + [False] * 3)
    assert npu_ops(backend.graphs["forward"]) == {"npu_lightning_indexer": 1, "npu_sparse_flash_attention": 1}
    assert npu_ops(backend.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}
    (attention,) = _calls(backend.graphs["forward"], "npu_sparse_flash_attention")
    # one KV head that is also the value: kv's gradient sums the op's dkey and dvalue
    assert attention.args[1] is not None and attention.kwargs["return_softmax_lse"] is True
    assert [s.form for s in _joint_sites(backend.report)["sparse_attention"]] == ["mla_gathered_top_k_causal"]


# ---- a tiny transformers DeepSeek-V3.2 training step -----------------------------------------
def test_tiny_deepseek_v32_training_step():
    from npu_fx_fusion.tiny_models import build_hf

    torch._dynamo.reset()
    tm = build_hf("deepseek_v32", dtype=torch.float32, num_layers=2)
    model = tm.model.train()
    reference = copy.deepcopy(model)
    (ids,) = tm.example_inputs
    backend = RecordingBackend(nff.FusionConfig())  # every pass
    loss = torch.compile(model, backend=backend)(ids).float().pow(2).mean()
    loss_ref = reference(ids).float().pow(2).mean()
    loss.backward()
    loss_ref.backward()
    assert backend.report.errors == []
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=4 * torch.finfo(torch.float32).eps * loss_ref.item())
    forward, backward = npu_ops(backend.graphs["forward"]), npu_ops(backend.graphs["backward"])
    # per layer: the indexer and the attention over its top-k, and the attention's backward
    assert forward["npu_lightning_indexer"] == forward["npu_sparse_flash_attention"] == 2, forward
    assert backward["npu_sparse_flash_attention_grad"] == 2, backward
    assert "npu_lightning_indexer_grad" not in backward  # no gradient flows through the indexer
    sites = _joint_sites(backend.report)
    assert len(sites["sparse_attention"]) == len(sites["lightning_indexer"]) == 2
    assert near_miss_reasons(backend.report, "sparse_attention") == []
    assert near_miss_reasons(backend.report, "lightning_indexer") == []
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p.grad is not None:
            try:
                assert_close_at_scale(p.grad, p_ref.grad, MODEL_ULPS)
            except AssertionError as exc:
                raise AssertionError(f"{name}.grad: {exc}") from None


# ---- where the backward would be wrong or unavailable: nothing fuses, the report says why ------
def test_max_autotune_refuses_the_joint_sites():
    # torchair's GE graph mode lowers neither the grad op (no GE converter) nor the forward's
    # return_softmax_lse (not in graph mode, per the op's docs)
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, mode="max-autotune")
    backend = _train(AttentionLayer().train(), [_hidden()], config)
    assert npu_ops(backend.graphs["forward"]) == {} and npu_ops(backend.graphs["backward"]) == {}
    misses = near_miss_reasons(backend.report, "sparse_attention")
    assert any("training: npu.npu_sparse_flash_attention_grad has no GE converter in torchair 2.13" in m
               for m in misses), misses
    # the indexer then stays unfused too: its indices reach the model's mask scatter
    assert any("scatter" in m for m in near_miss_reasons(backend.report, "lightning_indexer"))


@pytest.mark.parametrize("mode", ["reduce-overhead", "npugraph_ex"])
def test_acl_graph_modes_fuse_the_joint_sites(mode):
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, mode=mode)
    backend = _train(AttentionLayer().train(), [_hidden()], config)
    assert npu_ops(backend.graphs["backward"]) == {"npu_sparse_flash_attention_grad": 1}


def test_a_mask_the_op_cannot_express_is_not_fused_in_training():
    backend = _train(AttentionLayer(mask="window").train(), [_hidden()], DSA)
    assert npu_ops(backend.graphs["forward"]) == {} and npu_ops(backend.graphs["backward"]) == {}
    assert any("neither right-down causal nor empty" in m for m in near_miss_reasons(backend.report, "sparse_attention"))


def test_an_soc_refuses_the_tiny_head_dims_in_training():
    config = nff.FusionConfig(enable={"sparse_attention", "lightning_indexer"}, soc="Ascend910B")
    backend = _train(AttentionLayer().to(torch.bfloat16).train(), [_hidden(torch.bfloat16)], config)
    assert npu_ops(backend.graphs["forward"]) == {} and npu_ops(backend.graphs["backward"]) == {}
    assert any("head dim 16, the kernels take 512" in m for m in near_miss_reasons(backend.report, "sparse_attention"))


def test_gathered_indices_of_unknown_origin_are_not_fused_in_training():
    # the form masks every negative slot, the op (and its grad) stop at the first one
    inputs = _mla_batch()
    # every listed key visible to its query (no row without one: softmax NaN both ways)
    indices = (torch.randint(0, 12, (2, 12, 8)) % (torch.arange(12).view(1, 12, 1) + 1)).int()
    layer = MlaSparseLayer(latent=32, rope=16, index_dim=16)
    backend = _train(layer, [*inputs, indices], DSA, requires_grad=[True] * 4 + [False] * 4)
    assert npu_ops(backend.graphs["forward"]) == {} and npu_ops(backend.graphs["backward"]) == {}
    assert any("not known to be trailing" in m for m in near_miss_reasons(backend.report, "sparse_attention"))
