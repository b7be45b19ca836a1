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


# fp32: the fused rope, norms and attention round differently from transformers' by a few ulps;
# bf16: by an ulp or two of bf16 at the activations' scale, carried through two layers
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _decode(model, processor, backend, steps=4, dynamic=None):
    """A prefill (eager), then `steps` decode steps, each eager and compiled from one cache.
    dynamic=None: torch.compile's default, static first and dynamic once a size changes."""
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
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
                torch.testing.assert_close(fused, logits, **TOLERANCE[model.dtype])
                torch.testing.assert_close(rows, written, **TOLERANCE[model.dtype])
                changed = (written != saved.view(model.dtype)).any(-1)
                assert torch.equal((rows != saved.view(model.dtype)).any(-1), changed)  # the same slots written
                logits = fused
            saved = cache.clone()
            tokens = logits[:, kwargs["logits_indices"], :].argmax(-1).squeeze(0).to(torch.int32)
            processor.inputs_and_outputs.output_ids[0, :tokens.numel()].copy_(tokens)
            processor.update_batch()
    return batches


def _ops(backend):
    graph = backend.graphs["inference"].graph
    return [n for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind, dtype, dynamic", [("llama", torch.float32, None), ("qwen3", torch.float32, None),
                                                  ("llama", torch.bfloat16, True), ("qwen3", torch.bfloat16, True)])
def test_decode_fast_path_reads_the_paged_cache_in_place(kind, dtype, dynamic):
    from helpers import RecordingBackend
    from paged_modules import cb_model, traced_continuous_batching

    model, backend = cb_model(kind, dtype=dtype), RecordingBackend()
    with traced_continuous_batching(fast_path=True) as batching:
        # every decode step took the block table
        assert _decode(model, batching.processor(model), backend, dynamic=dynamic) == [True] * 4
    nodes = _ops(backend)
    fia = [n for n in nodes if str(n.target) == FIA]
    assert len(fia) == 2 and all(n.kwargs["block_table"] is not None and n.kwargs["block_size"] == 16 for n in fia)
    # the keys and values are read in place: no gather of the history is left
    assert not [n for n in nodes if n.target in (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)]
    # the writes: keys and values of a layer are views of one buffer, so each is written on its own
    assert [str(n.target) for n in nodes].count("npu.npu_scatter_nd_update.default") == 4
    assert torch.ops.aten.index_copy.default not in {n.target for n in nodes}


def test_varlen_path_as_shipped_fuses_the_writes_and_names_the_unproven_read():
    from helpers import RecordingBackend, near_miss_reasons
    from paged_modules import cb_model, traced_continuous_batching

    model, backend = cb_model("llama"), RecordingBackend()
    with traced_continuous_batching(fast_path=False) as batching:
        assert _decode(model, batching.processor(model), backend, steps=2) == [False, False]
    nodes = _ops(backend)
    assert [str(n.target) for n in nodes].count("npu.npu_scatter_nd_update.default") == 4
    assert all(n.kwargs.get("block_table") is None for n in nodes if str(n.target) == FIA)
    reasons = near_miss_reasons(backend.report, "paged_attention")
    assert reasons and all("slots that are a graph input" in r for r in reasons)
