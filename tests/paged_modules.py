"""Paged KV caches written and read in plain PyTorch, as code without a paged kernel does.

`PagedDecode` is a user's own paged cache (vLLM's reshape_and_cache and its reference
attention, in torch): the new tokens' key and value written at their slots, the history
read back through a block table, SDPA under the lengths' mask. `paged_decode_attention` is
the same for transformers' continuous batching: an attention implementation for its
decode fast path (block table, page views of PagedAttentionCache), which transformers
itself only has as flash_attn_with_kvcache on CUDA / XPU (its NPU integration's
npu_flash_attn_with_kvcache raises NotImplementedError).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def repeat_kv(hidden, groups):
    batch, heads, length, dim = hidden.shape
    if groups == 1:
        return hidden
    return hidden[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def write_at_slots(key_cache, value_cache, slots, key, value):
    """reshape_and_cache: token t's key and value at slot slots[t] of (blocks, block_size, N, D)."""
    heads, dim = key_cache.shape[2:]
    key_cache.view(-1, heads, dim).index_copy_(0, slots, key)
    value_cache.view(-1, heads, dim).index_copy_(0, slots, value)


def next_slots(block_table, lengths, block_size):
    """The slot of each sequence's next token: offset (lengths - 1) % block_size of the block
    its table names at (lengths - 1) // block_size (lengths count the new token)."""
    position = lengths - 1
    return block_table.gather(1, (position // block_size)[:, None])[:, 0] * block_size + position % block_size


def gather_blocks(cache, block_table):
    """(B, N, M * block_size, D): the blocks of each table row, in table order."""
    batch, count = block_table.shape
    _, block_size, heads, dim = cache.shape
    return cache[block_table].view(batch, count * block_size, heads, dim).transpose(1, 2)


def table_slots(block_table, block_size):
    """The slot of position p of each sequence: block_table[b, p // block_size] * block_size
    + p % block_size, for p over the table's span."""
    positions = torch.arange(block_table.shape[1] * block_size, device=block_table.device)
    return block_table[:, positions // block_size] * block_size + positions % block_size


def gather_slots(cache, block_table, slots=None):
    """The keys gather_blocks gives, gathered slot by slot from the (blocks * block_size, N, D)
    view (at table_slots, or at `slots` computed once for the keys and the values)."""
    _, block_size, heads, dim = cache.shape
    slots = table_slots(block_table, block_size) if slots is None else slots
    return cache.view(-1, heads, dim)[slots].transpose(1, 2)


def masked_attention(query, keys, values, lengths, scale=None):
    """SDPA of (B, N, S_q, D) queries over (B, N_kv, L, D) keys, key p visible to row b while
    p < lengths[b] (and causally, the last query at the last valid key)."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
    span, queries = keys.shape[2], query.shape[2]
    positions = torch.arange(span, device=query.device)
    last = lengths[:, None] - queries + torch.arange(queries, device=query.device)[None, :]  # (B, S_q)
    mask = positions[None, None, :] <= last[:, :, None]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=scale)


class PagedDecode(nn.Module):
    """One decode step over a paged cache: write each sequence's new token, attend over its
    blocks. `gather`: "blocks" (gather_blocks), "slots" (gather_slots, the slots computed for
    the keys and again for the values) or "slots once" (one slot tensor for both)."""

    def __init__(self, blocks=8, block_size=16, kv_heads=2, dim=16, dtype=torch.float32, gather="blocks"):
        super().__init__()
        self.block_size, self.gather = block_size, gather
        self.register_buffer("key_cache", torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype))
        self.register_buffer("value_cache", torch.zeros(blocks, block_size, kv_heads, dim, dtype=dtype))

    def forward(self, query, key, value, block_table, lengths):
        # query (B, N, S_q, D), key / value (B, N_kv, D) of the new tokens, lengths with them
        slots = next_slots(block_table, lengths, self.block_size)
        write_at_slots(self.key_cache, self.value_cache, slots, key, value)
        table = block_table.long()
        if self.gather == "blocks":
            keys, values = gather_blocks(self.key_cache, table), gather_blocks(self.value_cache, table)
        else:
            once = table_slots(table, self.block_size) if self.gather == "slots once" else None
            keys, values = gather_slots(self.key_cache, table, once), gather_slots(self.value_cache, table, once)
        return masked_attention(query, keys, values, lengths)


def paged_decode_attention(module, query, key, value, attention_mask, scaling=None, block_table=None, k_cache=None,
                           v_cache=None, cu_seq_lens_k=None, **kwargs):
    """A transformers attention implementation (AttentionInterface) for continuous batching:
    its decode fast path (one new token per sequence, a block table, the cache's page views)
    written and read in plain PyTorch; its varlen path (prefill) is transformers' SDPA."""
    if block_table is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    count, heads, dim = query.shape[2], query.shape[1], query.shape[3]  # the sequences are packed in dim 2
    lengths = (cu_seq_lens_k[1:count + 1] - cu_seq_lens_k[:count]).long()
    slots = next_slots(block_table.long(), lengths, k_cache.shape[1])
    write_at_slots(k_cache, v_cache, slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    table = block_table.long()
    # as flash's paged branch: (tokens, 1, N, D), here in BNSD
    q = query.transpose(1, 2).reshape(count, 1, heads, dim).transpose(1, 2)
    out = masked_attention(q, gather_blocks(k_cache, table), gather_blocks(v_cache, table), lengths, scaling)
    return out.transpose(0, 2), None  # (1, tokens, N, D)


# ---- transformers' continuous batching, its cache update traced ---------------------------------
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def cb_model(kind, layers=2, dtype=torch.float32):
    """A tiny random transformers Llama or Qwen3 (Qwen3: RMSNorm on q and k)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM._from_config(LlamaConfig(**common), attn_implementation="sdpa", dtype=dtype)
    else:
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**common, head_dim=16), attn_implementation="sdpa",
                                              dtype=dtype)
    return model.eval()


class traced_continuous_batching:
    """transformers' continuous batching with PagedAttentionCache.update traced into the graph
    (it is @torch.compiler.disable as shipped), and with `fast_path` its decode fast path (a
    block table) on CPU, served by paged_decode_attention: transformers keeps that path for
    flash attention on CUDA / XPU. `processor(model)` gives a batch processor with PROMPTS
    queued, its model switched to the paged attention when `fast_path`."""

    def __init__(self, fast_path):
        self.fast_path = fast_path

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.generation.continuous_batching import cache, initialization

        self._saved = [(cache.PagedAttentionCache, "update", cache.PagedAttentionCache.update)]
        cache.PagedAttentionCache.update = cache.PagedAttentionCache.update._torchdynamo_orig_callable
        if self.fast_path:
            self._saved.append((initialization, "ensure_decode_fast_path_is_available",
                                initialization.ensure_decode_fast_path_is_available))
            initialization.ensure_decode_fast_path_is_available = lambda *args, **kwargs: None
            AttentionInterface.register("paged_decode_torch", paged_decode_attention)
        return self

    def __exit__(self, *exc):
        for owner, name, value in self._saved:
            setattr(owner, name, value)

    def processor(self, model, page_size=16):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = ContinuousBatchingConfig(num_blocks=16, page_size=page_size, max_batch_tokens=64,
                                          max_requests_per_batch=4, max_blocks_per_request=4 if self.fast_path else 0)
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0),
            continuous_batching_config=config)
        processor = manager._create_batch_processor()
        manager.add_requests(inputs=PROMPTS, max_new_tokens=8)
        if self.fast_path:  # after the manager sized its inputs (masks for SDPA's varlen prefill)
            model.config._attn_implementation = "paged_decode_torch"
        return processor


def cb_step(processor, model):
    """One batch through `model` (eager or compiled); its tokens fed back. Returns the
    logits and whether the batch took the block table."""
    assert processor.prepare_next_batch()
    kwargs = processor.inputs_and_outputs.get_model_kwargs()
    logits = model(**kwargs).logits
    tokens = logits[:, kwargs["logits_indices"], :].argmax(-1).squeeze(0).to(torch.int32)
    processor.inputs_and_outputs.output_ids[0, :tokens.numel()].copy_(tokens)
    processor.update_batch()
    return logits, kwargs["block_table"] is not None
