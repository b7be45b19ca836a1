"""sparse_mla on torchtitan-npu's own DeepSeek-V4 attention (SparseAttention.forward: the keys as
an index list, a padding lane, sinks), run from the library's code at tiny sizes, and on
hand-written variants of it (another window, another threshold, indices not from a top-k, a fill
that does not hide, ...) that must not fuse.

Numerics as tests/test_sparse_mla.py: the stand-in computes the COT golden (fp32 softmax with
the sinks, P rounded to q's dtype before P @ V, as torchtitan's autocast path rounds its
probabilities before its bf16 matmul), so the fused attention agrees with eager to a few ulps at
the output's scale. The CSA indices are the model's own (its LiCompute top-k stays in the graph):
ties in the indexer cannot make the two sides differ.
"""
import __future__
import ast
import functools
import os
import types

import pytest
import torch
from torch import nn

import npu_fx_fusion as nff
from helpers import assert_close_at_scale, compile_and_run, near_miss_reasons
from v4_modules import fused_calls, train_and_compare

SMLA = nff.FusionConfig(enable={"sparse_mla"})
ULPS = {torch.float32: 8, torch.bfloat16: 2}
LAYER = {"swa": 0, "csa": 1, "hca": 2}  # the tiny V4's compress ratios (1, 4, 8)
FORM = {"swa": "torchtitan_v4_sliding_attention", "csa": "torchtitan_v4_indexed_attention",
        "hca": "torchtitan_v4_compressed_attention"}


_MODULE = "torchtitan_npu.models.deepseek_v4.model.model"
_CLASSES = ("GetWindowTopkIdxs", "GetCompressTopkIdxs", "SparseAttention", "LiCompute")


@functools.lru_cache(maxsize=None)
def _library():
    """torchtitan-npu's SparseAttention and LiCompute (and the index helpers they call), compiled
    from the unpacked wheel's model.py itself (with tiny_third_party's CPU patch of its "npu"
    device), and its tiny V4 sizes. Only these classes: importing the package would bring its
    torchtitan 0.2.2 into a process that may hold another torchtitan (tests/test_third_party_models.py
    runs the whole models in a subprocess for that reason); they need nothing but torch."""
    from npu_fx_fusion import tiny_third_party as ttp

    folder = ttp.torchtitan_npu_dir()
    path = os.path.join(folder, *_MODULE.split(".")) + ".py"
    if not os.path.isfile(path):
        pytest.skip("torchtitan-npu is not unpacked (scripts/fetch_torchtitan_npu.sh)")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    for old, new, count, _ in ttp._TORCHTITAN_NPU_PATCHES[_MODULE]:
        assert source.count(old) == count
        source = source.replace(old, new)
    tree = ast.parse(source, path)
    kept = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in _CLASSES]
    assert [node.name for node in kept] == list(_CLASSES)
    namespace = {"torch": torch, "nn": nn, "__name__": __name__}  # (dynamo imports a class's module)
    # (annotations unevaluated: they name the module's args class, not compiled here)
    code = compile(ast.Module(body=kept, type_ignores=[]), path, "exec", flags=__future__.annotations.compiler_flag)
    exec(code, namespace)  # noqa: S102
    # the tiny V4's attention sizes (tiny_third_party._torchtitan_npu_args): ratios 1, 4, 8
    args = dict(n_heads=4, head_dim=32, rope_head_dim=8, window_size=128, compress_ratios=(1, 4, 8), n_layers=3,
                mtp_layer_compress_ratio=4, index_topk=3, index_n_heads=16, index_head_dim=16)
    return types.SimpleNamespace(**namespace), args


class Inner(nn.Module):
    """torchtitan-npu's InnerAttention without its indexer loss: LiCompute (CSA) feeding
    SparseAttention, the library's own modules; attn_sink fp32 as the model keeps it."""

    def __init__(self, kind, autocast=False, **overrides):
        super().__init__()
        self.autocast = autocast  # bf16: torchtitan's mixed precision (the model runs in bf16 only so)
        model, args = _library()
        args = types.SimpleNamespace(**{**args, "use_sfa": False, **overrides})
        self.sparse_attn = model.SparseAttention(LAYER[kind], args)
        torch.manual_seed(7)
        self.attn_sink = nn.Parameter(torch.randn(args.n_heads) * 0.5)
        self.li_compute = model.LiCompute(4, args.index_topk) if kind == "csa" else None
        self.args = args

    def forward(self, *inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self._forward(*inputs)

    def _forward(self, q, kv, kv_compress=None, q_indexer=None, k_indexer=None, weights=None):
        topk = None
        if self.li_compute is not None:
            topk, _ = self.li_compute(q_indexer, k_indexer, weights, q.shape[1], kv.shape[1])
        return self.sparse_attn(q, kv, self.attn_sink, kv_compress, topk)


def _inputs(module, kind, dtype=torch.float32, batch=2, seq=16):
    args = module.args
    generator = torch.Generator().manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    inputs = [randn(batch, seq, args.n_heads, args.head_dim), randn(batch, seq, args.head_dim)]
    if kind != "swa":
        inputs.append(randn(batch, seq // module.sparse_attn.compress_ratio, args.head_dim))
    if kind == "csa":
        blocks = seq // 4
        inputs += [randn(batch, seq, args.index_n_heads, args.index_head_dim),
                   randn(batch, blocks, args.index_head_dim), randn(batch, seq, args.index_n_heads)]
    return inputs


def _site(report):
    (site,) = [s for s in report.sites if s.pass_name == "sparse_mla"]
    return site


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_each_layer_kind_fuses(kind, dtype):
    module = Inner(kind, autocast=dtype == torch.bfloat16)
    out, ref, report = compile_and_run(module, *_inputs(module, kind, dtype), config=SMLA)
    assert report.counts["sparse_mla"] == 1, near_miss_reasons(report, "sparse_mla")
    assert _site(report).form.startswith(FORM[kind])
    assert report.fused_ops["cann_ops_transformer.sparse_flash_mla"] == 1
    assert_close_at_scale(out, ref, ULPS[dtype])


@pytest.mark.parametrize("kind", ["swa", "csa"])
def test_the_window_is_proven_where_it_cuts_keys_off(kind):
    # 136 tokens: the last queries' 128-key band leaves out the first keys (and CSA lists
    # blocks past the window)
    module = Inner(kind)
    out, ref, report = compile_and_run(module, *_inputs(module, kind, seq=136), config=SMLA)
    assert report.counts["sparse_mla"] == 1, near_miss_reasons(report, "sparse_mla")
    assert_close_at_scale(out, ref, ULPS[torch.float32])


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_another_window_is_a_near_miss_naming_it(kind):
    module = Inner(kind, window_size=8)
    out, ref, report = compile_and_run(module, *_inputs(module, kind), config=SMLA)
    assert report.counts["sparse_mla"] == 0
    (reason,) = near_miss_reasons(report, "sparse_mla")
    assert "128-key window the op's band is" in reason and "8 keys" in reason, reason
    assert_close_at_scale(out, ref, 0)


def test_compressed_indices_offset_as_with_the_converter_are_refused():
    # use_sfa (the converter's setting) makes LiCompute list blocks at offset 0: the eager model then
    # reads window keys for them, which the op (blocks of cmp_kv) does not compute
    module = Inner("csa")

    class Offset0(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, q, kv, kv_compress, q_indexer, k_indexer, weights):
            topk, _ = module.li_compute(q_indexer, k_indexer, weights, q.shape[1], 0)
            return module.sparse_attn(q, kv, module.attn_sink, kv_compress, topk)

    out, ref, report = compile_and_run(Offset0(), *_inputs(module, "csa"), config=SMLA)
    assert report.counts["sparse_mla"] == 0
    reasons = near_miss_reasons(report, "sparse_mla")
    assert any("not offset by the S = 16 window keys" in r for r in reasons), reasons
    assert_close_at_scale(out, ref, 0)


# ---- hand-written variants: what torchtitan's code could be, and what it must not be taken for -------
def _attention(q, kv, sinks, topk_idxs, scale, fill, lane_drop=True, kv_compress=None):
    """torchtitan-npu's SparseAttention body on a given index list (its spelling)."""
    if kv_compress is not None:
        kv = torch.cat([kv, kv_compress], dim=1)
    topk_idxs = topk_idxs.int()
    query_states, kv_states = q.transpose(1, 2), kv.unsqueeze(1)
    attn_weights = torch.matmul(query_states, kv_states.transpose(2, 3)) * scale
    topk_idxs = topk_idxs.masked_fill(topk_idxs < 0, kv_states.shape[2])
    index_mask = torch.full((q.shape[0], 1, q.shape[1], kv_states.shape[2] + 1), fill, dtype=torch.bfloat16,
                            device=q.device).scatter(-1, topk_idxs.unsqueeze(1), 0)
    attn_weights = attn_weights + index_mask[..., :-1]
    sinks = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[1], -1)
    combined = torch.cat([attn_weights, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined.float(), dim=-1)
    scores = probs[..., :-1] if lane_drop else probs[..., 1:]
    return torch.matmul(scores, kv_states).transpose(1, 2).contiguous()


def _window(seq, width=128):
    base = torch.arange(seq).unsqueeze(1)
    window = (base - width + 1).clamp(0) + torch.arange(min(seq, width))
    return torch.where(window > base, -1, window)


class Variant(nn.Module):
    """CSA-like attention with knobs: the threshold's offset, where the blocks come from, the fill."""

    def __init__(self, fill=torch.finfo(torch.bfloat16).min, threshold_shift=1, from_topk=True, ratio=4, k=3):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4) * 0.5)
        self.fill, self.shift, self.from_topk, self.ratio, self.k = fill, threshold_shift, from_topk, ratio, k

    def forward(self, q, kv, kv_compress, scores):
        batch, seq = q.shape[:2]
        base = torch.arange(seq).unsqueeze(1)
        if self.from_topk:
            picks = scores.topk(self.k, dim=-1).indices
        else:  # the first k blocks, not a top-k
            picks = torch.arange(self.k).expand(batch, seq, -1) + 0 * scores[..., :self.k].long()
        threshold = (base + self.shift) // self.ratio
        compressed = torch.where(picks >= threshold, -1, picks + seq)
        idx = torch.cat([_window(seq).unsqueeze(0).expand(batch, -1, -1), compressed], dim=-1)
        return _attention(q, kv, self.sinks, idx, 32 ** -0.5, self.fill, kv_compress=kv_compress)


def _variant_inputs(seq=16, ratio=4):
    generator = torch.Generator().manual_seed(4)
    return [torch.randn(2, seq, 4, 32, generator=generator), torch.randn(2, seq, 32, generator=generator),
            torch.randn(2, seq // ratio, 32, generator=generator),
            torch.randn(2, seq, seq // ratio, generator=generator)]


def test_an_infinite_fill_fuses_as_finfo_min_does():
    out, ref, report = compile_and_run(Variant(fill=float("-inf")), *_variant_inputs(), config=SMLA)
    assert report.counts["sparse_mla"] == 1, near_miss_reasons(report, "sparse_mla")
    assert_close_at_scale(out, ref, ULPS[torch.float32])


@pytest.mark.parametrize("variant, reason", [
    (dict(threshold_shift=2), "threshold is not (t + 1) // 4"),
    (dict(from_topk=False), "not a top-k's indices"),
    (dict(fill=-1.0), "does not hide a key"),
])
def test_look_alikes_are_near_misses_naming_the_failed_check(variant, reason):
    out, ref, report = compile_and_run(Variant(**variant), *_variant_inputs(), config=SMLA)
    assert report.counts["sparse_mla"] == 0
    reasons = near_miss_reasons(report, "sparse_mla")
    assert any(reason in r for r in reasons), reasons
    assert_close_at_scale(out, ref, 0)


class HcaMasked(nn.Module):
    """HCA with its index mask spelled another way: masked_fill of -inf on zeros, from aranges."""

    def __init__(self, ratio=4, window=128, shift=1):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(4) * 0.5)
        self.ratio, self.window, self.shift = ratio, window, shift

    def forward(self, q, kv, kv_compress):
        seq, blocks = q.shape[1], kv_compress.shape[1]
        t = torch.arange(seq).unsqueeze(1)
        j = torch.arange(seq + blocks).unsqueeze(0)
        shown = torch.where(j < seq, (j <= t) & (j > t - self.window), (j - seq) < (t + self.shift) // self.ratio)
        mask = torch.zeros(seq, seq + blocks).masked_fill(~shown, float("-inf"))
        kv_states = torch.cat([kv, kv_compress], dim=1).unsqueeze(1)
        w = torch.matmul(q.transpose(1, 2), kv_states.transpose(2, 3)) * 32 ** -0.5 + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, -1)
        combined = torch.cat([w, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined.float(), dim=-1)[..., :-1]
        return torch.matmul(probs, kv_states).transpose(1, 2).contiguous()


def test_a_constant_mask_of_another_spelling_fuses_by_its_value():
    out, ref, report = compile_and_run(HcaMasked(), *_variant_inputs()[:3], config=SMLA)
    assert report.counts["sparse_mla"] == 1, near_miss_reasons(report, "sparse_mla")
    assert _site(report).form.startswith("torchtitan_v4_compressed_attention")
    assert_close_at_scale(out, ref, ULPS[torch.float32])


def test_a_constant_mask_hiding_other_blocks_is_a_near_miss():
    out, ref, report = compile_and_run(HcaMasked(shift=2), *_variant_inputs()[:3], config=SMLA)
    assert report.counts["sparse_mla"] == 0
    reasons = near_miss_reasons(report, "sparse_mla")
    assert any("compressed keys are not the blocks w < (t + 1) // 4" in r for r in reasons), reasons
    assert_close_at_scale(out, ref, 0)


def test_a_sink_column_kept_is_not_fused():
    # the probabilities of the sink column and all but the first key: not the op's attention
    idx = _window(16).unsqueeze(0).expand(2, -1, -1)

    class KeepsSink(nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = nn.Parameter(torch.randn(4))

        def forward(self, q, kv):
            return _attention(q, kv, self.sinks, idx, 32 ** -0.5, -1e38, lane_drop=False)

    out, ref, report = compile_and_run(KeepsSink(), *_variant_inputs()[:2], config=SMLA)
    assert report.counts["sparse_mla"] == 0
    assert_close_at_scale(out, ref, 0)


# ---- SoC, dynamic shapes, training -------------------------------------------------------------------
def test_a2_refuses_the_tiny_ratio_8_naming_it():
    module = Inner("hca", autocast=True)
    _, _, report = compile_and_run(module, *_inputs(module, "hca", torch.bfloat16),
                                   config=nff.FusionConfig(enable={"sparse_mla"}, soc="Ascend910B"))
    assert report.counts["sparse_mla"] == 0
    assert near_miss_reasons(report, "sparse_mla") == ["head dim 32: sparse_flash_mla takes 512"]


def test_symbolic_sizes_refuse_the_metadata_convention_naming_its_limit():
    # a symbolic batch: emulation takes Ascend950's convention, whose metadata op takes the sizes as
    # int attributes (tests/test_sparse_mla_torchtitan_dynamic.py: A2 / A3, without metadata, fuse)
    from npu_fx_fusion.patterns.sparse_mla import METADATA_LIMIT

    module = Inner("swa")
    inputs = _inputs(module, "swa")
    torch._dynamo.mark_dynamic(inputs[0], 0)
    torch._dynamo.mark_dynamic(inputs[1], 0)
    out, ref, report = compile_and_run(module, *inputs, config=SMLA)
    assert report.counts["sparse_mla"] == 0
    assert near_miss_reasons(report, "sparse_mla") == [METADATA_LIMIT]
    assert_close_at_scale(out, ref, 0)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_trains_through_sparse_flash_mla_grad(kind):
    from npu_fx_fusion.patterns.sparse_mla import _sink_softmax

    module = Inner(kind)
    inputs = _inputs(module, kind)
    grads = [True] * (2 if kind == "swa" else 3) + [False] * (3 if kind == "csa" else 0)
    backend = train_and_compare(module, inputs, SMLA, {torch.float32: 16}, grads=grads)
    assert fused_calls(backend.graphs["backward"]).get("cann_ops_transformer.sparse_flash_mla_grad") == 1
    assert not any(_sink_softmax(node) for node in backend.graphs["forward"].graph.nodes)
    assert near_miss_reasons(backend.report, "sparse_mla") == []
