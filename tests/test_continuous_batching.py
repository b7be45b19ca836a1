"""transformers' continuous batching (ContinuousBatchingManager, PagedAttentionCache, 5.24) on
CPU, its model forward compiled through the emulation backend, with the cache update traced
into the graph (PagedAttentionCache.update is @torch.compiler.disable as shipped: the tests
call the function it wraps).

- Its decode fast path (a block table, the cache's page views), with the attention written
  in plain PyTorch (paged_modules.paged_decode_attention: transformers has that kernel only
  as flash_attn_with_kvcache on CUDA / XPU, and gates the path on them, which the test
  lifts): the attention reads the paged cache in place (FIA with a block table), the writes
  fuse, and logits and the whole cache equal eager over 4 decode steps, Llama and Qwen3.
- Its varlen path as shipped (SDPA, read_index / write_index computed on the host): the
  writes fuse; the attention is a near miss naming the slots the graph cannot prove.

Each step runs eager and compiled from the same cache contents (saved and restored), then
continues from the compiled one. The fused rope rounds differently from transformers' (a
few fp32 ulps), so the written keys and the logits are compared within fp32 tolerance.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

FIA = "npu.npu_fused_infer_attention_score.default"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def _model(kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM._from_config(LlamaConfig(**common), attn_implementation="sdpa").eval()
    return Qwen3ForCausalLM._from_config(Qwen3Config(**common, head_dim=16), attn_implementation="sdpa").eval()


@pytest.fixture
def traced_cache_update(monkeypatch):
    """PagedAttentionCache.update without its @torch.compiler.disable: the writes and reads
    of the varlen path, and the fast path's block-table kwargs, in the graph."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    monkeypatch.setattr(PagedAttentionCache, "update", PagedAttentionCache.update._torchdynamo_orig_callable)


def _processor(model, monkeypatch, fast_path):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    if fast_path:
        # transformers keeps the decode fast path for flash attention on CUDA / XPU
        monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", lambda *args, **kwargs: None)
    config = ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=64, max_requests_per_batch=4,
                                      max_blocks_per_request=4 if fast_path else 0)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0),
        continuous_batching_config=config)
    processor = manager._create_batch_processor()
    manager.add_requests(inputs=PROMPTS, max_new_tokens=8)
    return processor


def _decode(model, processor, backend, steps=4):
    """A prefill (eager), then `steps` decode steps, each eager and compiled from one cache."""
    compiled = torch.compile(model, backend=backend)
    cache = processor.cache.cache_tensor
    rows = cache.view(model.dtype)
    batches = []
    with torch.no_grad():
        for step in range(steps + 1):
            assert processor.prepare_next_batch()
            kwargs = processor.inputs_and_outputs.get_model_kwargs()
            logits = model(**kwargs).logits
            if step:
                batches.append(kwargs["block_table"] is not None)
                written = rows.clone()
                cache.copy_(saved)
                fused = compiled(**kwargs).logits
                torch.testing.assert_close(fused, logits, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(rows, written, rtol=1e-5, atol=1e-5)
                changed = (written != saved.view(model.dtype)).any(-1)
                assert torch.equal((rows != saved.view(model.dtype)).any(-1), changed)  # the same slots written
                logits = fused
            saved = cache.clone()
            tokens = logits[:, kwargs["logits_indices"], :].argmax(-1).squeeze(0).to(torch.int32)
            processor.inputs_and_outputs.output_ids[0, :tokens.numel()].copy_(tokens)
            processor.update_batch()
    return batches


def _ops_per_layer(backend):
    graph = backend.graphs["inference"].graph
    return [n for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decode_fast_path_reads_the_paged_cache_in_place(kind, monkeypatch, traced_cache_update):
    from transformers import AttentionInterface

    from helpers import RecordingBackend
    from paged_modules import paged_decode_attention

    AttentionInterface.register("paged_decode_torch", paged_decode_attention)
    model = _model(kind)
    processor = _processor(model, monkeypatch, fast_path=True)
    model.config._attn_implementation = "paged_decode_torch"  # after the manager chose its IO (masks for SDPA)
    backend = RecordingBackend()
    assert _decode(model, processor, backend) == [True] * 4  # every decode step took the block table
    nodes = _ops_per_layer(backend)
    fia = [n for n in nodes if str(n.target) == FIA]
    assert len(fia) == 2 and all(n.kwargs["block_table"] is not None and n.kwargs["block_size"] == 16 for n in fia)
    # the keys and values are read in place: no gather of the history is left
    assert not [n for n in nodes if n.target in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)]
    # the writes: keys and values of a layer are views of one buffer, so each is written on its own
    assert [str(n.target) for n in nodes].count("npu.npu_scatter_nd_update.default") == 4
    assert torch.ops.aten.index_copy.default not in {n.target for n in nodes}


@pytest.mark.parametrize("kind", ["llama"])
def test_varlen_path_as_shipped_fuses_the_writes_and_names_the_unproven_read(kind, monkeypatch,
                                                                             traced_cache_update):
    from helpers import RecordingBackend, near_miss_reasons

    model = _model(kind)
    processor = _processor(model, monkeypatch, fast_path=False)
    backend = RecordingBackend()
    assert _decode(model, processor, backend, steps=2) == [False, False]
    nodes = _ops_per_layer(backend)
    assert [str(n.target) for n in nodes].count("npu.npu_scatter_nd_update.default") == 4
    assert all(n.kwargs.get("block_table") is None for n in nodes if str(n.target) == FIA)
    reasons = near_miss_reasons(backend.report, "paged_attention")
    assert reasons and all("slots that are a graph input" in r for r in reasons)
