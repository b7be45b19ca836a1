"""The paged-cache stand-ins compute what their docs say: slot writes and block-table reads.

npu_scatter_pa_kv_cache_functional and npu_scatter_nd_update against per-token Python
loops; FIA's page attention (block_table, block_size) against the same FIA on the keys a
loop gathers block by block. Each convention gets a mix-up test: slot s read as (s % bs,
s // bs), the table read by column, a (blocks, N, bs, D) cache read as (blocks, bs, N*D)
each give another result on the same input.
"""
from __future__ import annotations

import pytest
import torch

from npu_fx_fusion.npu_ops import ensure_registered

npu = torch.ops.npu
NB, BS, NKV, N, D = 6, 4, 2, 4, 8


@pytest.fixture(scope="module", autouse=True)
def _ops():
    registered = ensure_registered()
    assert {"npu::npu_scatter_pa_kv_cache_functional", "npu::npu_scatter_nd_update"} <= set(registered)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- writes -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_pa_kv_cache_writes_each_token_at_its_slot(dtype):
    key, value = _randn(3, NKV, D, seed=1, dtype=dtype), _randn(3, NKV, 2 * D, seed=2, dtype=dtype)
    key_cache, value_cache = _randn(NB, BS, NKV, D, seed=3, dtype=dtype), _randn(NB, BS, NKV, 2 * D, seed=4,
                                                                              dtype=dtype)
    slots = torch.tensor([9, 0, 23], dtype=torch.int32)
    new_keys, new_values = npu.npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slots,
                                                                  cache_mode="Norm")
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        expected_keys[slot // BS, slot % BS] = key[token]
        expected_values[slot // BS, slot % BS] = value[token]
    assert torch.equal(new_keys, expected_keys) and torch.equal(new_values, expected_values)
    assert torch.equal(key_cache, _randn(NB, BS, NKV, D, seed=3, dtype=dtype))  # functional: inputs untouched
    # mix-up: slot 9 is block 2 offset 1, not block 1 offset 2
    swapped = key_cache.clone()
    swapped[9 % BS, 9 // BS] = key[0]
    assert not torch.equal(new_keys[2, 1], swapped[2, 1])


def test_scatter_pa_kv_cache_refusals():
    key, cache = _randn(2, NKV, D), _randn(NB, BS, NKV, D)
    with pytest.raises(IndexError, match="does not check"):
        npu.npu_scatter_pa_kv_cache_functional(key, key, cache, cache, torch.tensor([0, NB * BS]), cache_mode="Norm")
    with pytest.raises(NotImplementedError, match="PA_NZ"):
        npu.npu_scatter_pa_kv_cache_functional(key, key, cache, cache, torch.tensor([0, 1]))  # the default mode
    with pytest.raises(RuntimeError, match="does not hold"):
        npu.npu_scatter_pa_kv_cache_functional(key, key, _randn(NB, BS, 1, D), cache, torch.tensor([0, 1]),
                                               cache_mode="Norm")


def test_scatter_nd_update_is_index_copy_along_dim_0():
    cache, rows = _randn(24, NKV * D, seed=5), _randn(3, NKV * D, seed=6)
    index = torch.tensor([5, 17, 0])
    out = npu.npu_scatter_nd_update(cache, index.view(-1, 1), rows)
    assert torch.equal(out, cache.index_copy(0, index, rows))
    with pytest.raises(IndexError, match="does not check"):
        npu.npu_scatter_nd_update(cache, torch.tensor([[24]]), rows[:1])


# ---- FIA page attention -------------------------------------------------------------------
def _dense(cache, table):
    """(B, N_kv, blocks * BS, D) gathered block by block, slot by slot."""
    rows = [torch.stack([cache[block, offset] for block in row.tolist() for offset in range(BS)]) for row in table]
    return torch.stack(rows).transpose(1, 2).contiguous()


@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
@pytest.mark.parametrize("queries", [1, 3])
def test_fia_reads_the_cache_through_the_block_table(layout, queries):
    key_cache, value_cache = _randn(NB, BS, NKV, D, seed=7), _randn(NB, BS, NKV, D, seed=8)
    table = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32)
    query = _randn(2, N, queries, D, seed=9)
    lengths = [10, 7]
    common = {"num_heads": N, "num_key_value_heads": NKV, "scale": 0.3}
    q = query if layout == "BNSD" else query.transpose(1, 2).contiguous()
    dense_k, dense_v = _dense(key_cache, table), _dense(value_cache, table)
    if layout == "BSND":
        dense_k, dense_v = (t.transpose(1, 2).contiguous() for t in (dense_k, dense_v))
    expected, _ = npu.npu_fused_infer_attention_score(q, dense_k, dense_v, actual_seq_lengths_kv=lengths,
                                                      input_layout=layout, **common)
    for k, v in ((key_cache.flatten(-2), value_cache.flatten(-2)),  # (blocks, bs, N*D)
                 (key_cache.transpose(1, 2).contiguous(), value_cache.transpose(1, 2).contiguous())):  # (blocks, N, bs, D)
        if k.dim() == 4 and layout != "BNSD":
            continue  # the docstring: BSH / BSND queries take (blocks, bs, H) only
        out, _ = npu.npu_fused_infer_attention_score(q, k, v, block_table=table, block_size=BS,
                                                     actual_seq_lengths_kv=lengths, input_layout=layout, **common)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # mix-up: the table read by column gathers other blocks
    wrong = _dense(key_cache, table.t().contiguous()[:2])
    assert not torch.equal(wrong, _dense(key_cache, table))


def test_fia_page_attention_refusals():
    cache, table = _randn(NB, BS, NKV * D), torch.tensor([[0, 1]], dtype=torch.int32)
    query = _randn(1, N, 1, D)
    common = {"num_heads": N, "num_key_value_heads": NKV, "input_layout": "BNSD", "block_size": BS}
    with pytest.raises(RuntimeError, match="needs actual_seq_lengths_kv"):
        npu.npu_fused_infer_attention_score(query, cache, cache, block_table=table, **common)
    with pytest.raises(IndexError, match="does not check"):
        npu.npu_fused_infer_attention_score(query, cache, cache, block_table=torch.tensor([[0, NB]], dtype=torch.int32),
                                            actual_seq_lengths_kv=[5], **common)
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_fused_infer_attention_score(query, cache, cache, block_table=table.long(), actual_seq_lengths_kv=[5],
                                            **common)
