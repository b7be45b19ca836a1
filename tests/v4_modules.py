"""transformers' DeepSeek-V4 modules, tiny, for the V4 pass tests (and a training helper).

The modules are transformers 5.24's own (DeepseekV4HyperConnection, DeepseekV4Attention with
its compressors and indexer, DeepseekV4SparseMoeBlock); the wrappers only make what
DeepseekV4Model makes around them: positions, the rotary tables, the sliding-window mask
(where(visible, 0, finfo.min), from aranges as transformers' masking builds it), and the
decoder layer's residual mix, which has no module of its own.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from helpers import RecordingBackend, assert_close_at_scale

LAYER_TYPES = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}


def v4_config(**overrides):
    from transformers import AutoConfig

    from npu_fx_fusion.tiny_models import _DEEPSEEK_V4, _HF_COMMON

    kwargs = {**_HF_COMMON, **_DEEPSEEK_V4, "num_hidden_layers": 3,
              "layer_types": list(LAYER_TYPES.values()), "mlp_layer_types": ["hash_moe", "moe", "moe"]}
    kwargs.update(overrides)
    config = AutoConfig.for_model("deepseek_v4", **kwargs)
    config._attn_implementation = "eager"
    config._experts_implementation = "grouped_mm"
    return config


def _randomise(module, seed):
    """Checkpoint-like values (tiny_models._init_deepseek_v4 for the buffers, normal weights)."""
    from npu_fx_fusion.tiny_models import _init_deepseek_v4

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() > 1:
                param.normal_(std=0.1, generator=generator)
        _init_deepseek_v4(module, generator)


class HyperConnection(nn.Module):
    """DeepseekV4HyperConnection: streams (B, S, n, D) -> (post, comb, collapsed)."""

    def __init__(self, dtype=torch.float32, seed=0, **config):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

        self.hc = DeepseekV4HyperConnection(v4_config(**config))
        _randomise(self, seed)

    def forward(self, streams):
        return self.hc(streams)


class ResidualMix(nn.Module):
    """DeepseekV4DecoderLayer's mHC post, the expression as transformers writes it."""

    def forward(self, hidden_states, block_output, post, comb):
        dtype = hidden_states.dtype
        return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states)


class Attention(nn.Module):
    """DeepseekV4Attention of one layer kind ("swa" / "csa" / "hca"), with the model's inputs."""

    def __init__(self, kind, dtype=torch.float32, seed=0, **config):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Attention,
                                                                          DeepseekV4RotaryEmbedding)

        config = v4_config(**config)
        layer = list(LAYER_TYPES).index(kind)
        self.config = config
        self.attention = DeepseekV4Attention(config, layer)
        self.rotary = DeepseekV4RotaryEmbedding(config)
        _randomise(self, seed)
        self.to(dtype)
        # transformers keeps these in fp32 (_keep_in_fp32_modules_strict)
        for name, module in self.named_modules():
            if name.endswith(("q_a_norm", "kv_norm")):
                module.float()
        self.attention.sinks.data = self.attention.sinks.data.float()
        for name, param in self.named_parameters():
            if name.endswith("position_bias"):
                param.data = param.data.float()

    def forward(self, hidden_states):
        batch, seq = hidden_states.shape[:2]
        position_ids = torch.arange(seq, device=hidden_states.device).unsqueeze(0)
        embeddings = {kind: self.rotary(hidden_states, position_ids=position_ids, layer_type=kind)
                      for kind in ("main", "compress")}
        i = torch.arange(seq).unsqueeze(-1)
        j = torch.arange(seq).unsqueeze(0)
        visible = (j <= i) & (j > i - self.config.sliding_window)
        mask = torch.where(visible, torch.zeros((), dtype=hidden_states.dtype),
                           torch.finfo(hidden_states.dtype).min).expand(batch, 1, seq, seq)
        return self.attention(hidden_states, embeddings, position_ids, mask)[0]


class MoeBlock(nn.Module):
    """DeepseekV4SparseMoeBlock (router, grouped_mm experts, shared expert) of a hash ("hash")
    or top-k ("topk") layer; forward(hidden_states, input_ids)."""

    def __init__(self, kind, dtype=torch.float32, seed=0, **config):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

        self.block = DeepseekV4SparseMoeBlock(v4_config(**config), 0 if kind == "hash" else 1)
        _randomise(self, seed)
        self.to(dtype)
        for name, buffer in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                self.block.gate.e_score_correction_bias = buffer.float()

    def forward(self, hidden_states, input_ids):
        return self.block(hidden_states, input_ids=input_ids)


def train_and_compare(module, inputs, config, ulps, *, grads=None, precision=None, dynamic=None):
    """One compiled and one eager training step of `module` on `inputs` (the floating ones
    require grad unless `grads` says otherwise); every output and gradient must agree within
    `ulps` of its dtype at its largest element (of `precision`'s ulp when given: an fp32
    gradient transformers computes through bf16 values, V4's fp32 mHC weights and sinks, is
    only as exact as bf16). `dynamic`: torch.compile's. Returns the backend (report, graphs)."""
    torch._dynamo.reset()
    reference = copy.deepcopy(module)
    grads = grads or [t.is_floating_point() for t in inputs]
    fused_in = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, grads)]
    eager_in = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, grads)]
    backend = RecordingBackend(config)
    outs = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)(*fused_in)
    outs_ref = reference(*eager_in)
    outs, outs_ref = ([outs], [outs_ref]) if isinstance(outs, torch.Tensor) else (list(outs), list(outs_ref))
    generator = torch.Generator().manual_seed(5)
    probes = [torch.randn(o.shape, generator=generator) for o in outs]
    sum((o.float() * p).sum() for o, p in zip(outs, probes)).backward()
    sum((o.float() * p).sum() for o, p in zip(outs_ref, probes)).backward()
    for out, ref in zip(outs, outs_ref):
        assert_close_at_scale(out, ref, ulps[precision or out.dtype], precision)
    named = [(f"param {n}", p.grad, q.grad) for (n, p), q in zip(module.named_parameters(), reference.parameters())]
    named += [(f"input {i}", a.grad, b.grad) for i, (a, b) in enumerate(zip(fused_in, eager_in)) if a.requires_grad]
    for name, grad, grad_ref in named:
        assert (grad is None) == (grad_ref is None), name
        if grad is not None:
            try:
                assert_close_at_scale(grad, grad_ref, ulps[precision or grad.dtype], precision)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
    assert backend.report.errors == []
    return backend


def fused_calls(gm) -> dict:
    """{"cann_ops_transformer.mhc_pre_sinkhorn": n, "npu.npu_mhc_post": n, ...} of a graph."""
    from npu_fx_fusion.report import fused_op_counts, op_counts

    return dict(fused_op_counts(op_counts(gm.graph)))


# ---- the whole tiny model: its V4 sites, family by family (issue 17's closing table) -------------
# What build_hf("deepseek_v4") holds (3 layers: sliding, CSA, HCA attention; hash-routed, then two
# top-k MoE layers), and the pass (and form) that fuses each family. Present counts from the model:
#   mHC pre / post: attn_hc and ffn_hc per layer, and the residual mix after attention and MLP: 2 x 3
#   partial RoPE: q, kv and the inverse on the output per layer (3 x 3), the CSA and HCA
#     compressors' keys (2), the CSA indexer's q and k (2): 13
#   attention: one layer of each kind; the CSA form spans its lightning indexer
#   routers, routed clamped SwiGLU, experts dispatch: one per MoE layer (3), grouped GEMMs 2 each
#   RMSNorm: input_layernorm, post_attention_layernorm, q_a_norm, q_b_norm (unweighted) and kv_norm
#     per layer (5 x 3), the CSA and HCA compressors' kv_norm (2), the CSA indexer's (1), hc_head's
#     input_norm and the final norm (2): 20 (the mHC input norms are part of mhc_pre's form)
#   the shared expert's clamped SwiGLU: 3, not fused with separate gate and up projections (merged
#     by merged_projections, they fuse: tests/test_deepseek_v4.py)
V4_FAMILIES = {
    "mHC pre": ("mhc_pre", None, 6),
    "mHC post": ("mhc_post", None, 6),
    "partial RoPE": ("rope", None, 13),
    "SWA attention": ("sparse_mla", "deepseek_v4_sliding_attention", 1),
    "CSA attention + indexer": ("sparse_mla", "deepseek_v4_csa_attention", 1),
    "HCA attention": ("sparse_mla", "deepseek_v4_hca_attention", 1),
    "router": ("moe_gating", None, 3),
    "routed clamped SwiGLU": ("swiglu_group", None, 3),
    "experts dispatch": ("moe_dispatch", None, 3),
    "grouped GEMM": ("grouped_matmul", None, 6),
    "RMSNorm": ("rms_norm", None, 20),
}
SHARED_EXPERT_SWIGLUS = 3


def site_table(report) -> dict:
    """{family: (fused, present)} over every graph of the report (a training step's joint graph and
    its partitioned forward: the indexer's forward-only ropes and norm fuse there)."""
    table = {}
    for family, (pass_name, form, present) in V4_FAMILIES.items():
        fused = sum(1 for s in report.sites if s.pass_name == pass_name and (form is None or s.form == form))
        table[family] = (fused, present)
    return table


# ops that only move or name data (views, getitem): not counted as computing ops
_DATA_MOVEMENT = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.expand", "aten.permute", "aten.transpose",
                  "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.t.", "aten.alias")


def computing_ops_per_layer(graph) -> dict:
    """{decoder layer index (None: outside the layers): computing ops}, by each node's module."""
    import operator
    import re

    counts = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if str(node.target).startswith(_DATA_MOVEMENT):
            continue
        layer = None
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = re.search(r"layers\.(\d+)\b", path)
            if found:
                layer = int(found.group(1))
                break
        counts[layer] = counts.get(layer, 0) + 1
    return counts
