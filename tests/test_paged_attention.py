"""paged_attention: attention over keys gathered out of a paged cache -> FIA reading the cache
through a block table, and the gathers whose layout the graph does not prove.

The module is a user's own paged decode in plain PyTorch (paged_modules.PagedDecode): the
new token written at its slot, the history gathered block by block or slot by slot,
SDPA under the lengths' mask. The rewrite reads the same keys in the same order under the
same mask: its output equals the attention pass's FIA over the gathered keys bit for bit,
and eager within FIA's precision (fp32 softmax, one rounding).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import npu_fx_fusion as nff
from helpers import RecordingBackend, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered
from paged_modules import PagedDecode, gather_blocks, masked_attention, next_slots, write_at_slots

ensure_registered()
FIA = torch.ops.npu.npu_fused_infer_attention_score.default
N, NKV, D, BLOCK = 4, 2, 16, 16
TABLE = torch.tensor([[0, 3, -1, -1], [1, 2, 5, -1], [4, -1, -1, -1]], dtype=torch.int32)  # -1: no block
LENGTHS = torch.tensor([20, 40, 7])


def _inputs(batch=3, queries=1, dtype=torch.float32, seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, N, queries, D, generator=g).to(dtype), torch.randn(batch, NKV, D, generator=g).to(dtype),
            torch.randn(batch, NKV, D, generator=g).to(dtype), TABLE[:batch], lengths[:batch])


def _compile(module, dynamic=False, config=None):
    backend = RecordingBackend(config)
    return torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic), backend


def _paged_fia(backend):
    return [n for n in backend.graphs["inference"].graph.nodes if n.target is FIA]


@pytest.mark.parametrize("gather, dtype, dynamic", [("blocks", torch.float32, False), ("blocks", torch.bfloat16, True),
                                                    ("slots once", torch.float32, True),
                                                    ("slots", torch.bfloat16, False)])
def test_decode_reads_the_cache_through_the_block_table(gather, dtype, dynamic):
    eager, fused = PagedDecode(dtype=dtype, gather=gather), PagedDecode(dtype=dtype, gather=gather)
    compiled, backend = _compile(fused, dynamic)
    with torch.no_grad():
        for batch, seed in ((3, 0), (2, 1)):
            inputs = _inputs(batch, dtype=dtype, seed=seed)
            torch.testing.assert_close(compiled(*inputs), eager(*inputs))
            assert torch.equal(fused.key_cache, eager.key_cache) and torch.equal(fused.value_cache, eager.value_cache)
    (fia,) = _paged_fia(backend)
    assert fia.kwargs["block_size"] == BLOCK and fia.kwargs["block_table"] is not None
    ops = {n.target for n in backend.graphs["inference"].graph.nodes}
    assert torch.ops.aten.index.Tensor not in ops  # no gather left
    assert near_miss_reasons(backend.report, "paged_attention") == []
    note = next(s.note for s in backend.report.sites if s.pass_name == "paged_attention")
    assert "block table" in note and "modulo num_blocks" in note


def test_the_rewrite_reads_what_the_gather_read():
    """Bit for bit the attention pass's FIA over the gathered keys (nothing else changes)."""
    inputs = _inputs()
    outputs = []
    for config in (None, nff.FusionConfig(disable={"paged_attention"})):
        compiled, backend = _compile(PagedDecode(), config=config)
        with torch.no_grad():
            outputs.append(compiled(*inputs))
        assert len(_paged_fia(backend)) == 1
        assert (_paged_fia(backend)[0].kwargs.get("block_table") is None) == (config is not None)
    assert torch.equal(*outputs)


class Prefill(PagedDecode):
    """Three new tokens per sequence (a chunked prefill), causal within the lengths."""

    def forward(self, query, key, value, block_table, lengths):
        for step in range(query.shape[2]):  # the three tokens' slots, one at a time
            slots = next_slots(block_table, lengths - query.shape[2] + 1 + step, self.block_size)
            write_at_slots(self.key_cache, self.value_cache, slots, key, value)
        table = block_table.long()
        return masked_attention(query, gather_blocks(self.key_cache, table), gather_blocks(self.value_cache, table),
                                lengths)


def test_a_prefill_over_the_cache():
    eager, fused = Prefill(), Prefill()
    compiled, backend = _compile(fused)
    inputs = _inputs(queries=3)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), eager(*inputs))
    (fia,) = _paged_fia(backend)
    assert fia.kwargs["inner_precise"] == 2 and fia.kwargs["block_table"] is not None
    # on an A2 / A3 a prefill needs blocks of 128..512 (a multiple of 128)
    note = next(s.note for s in backend.report.sites if s.pass_name == "paged_attention")
    assert "block_size 16 is not a multiple of 128" in note


def test_a_real_soc_takes_bf16_and_16_slot_blocks_in_decode():
    compiled, backend = _compile(PagedDecode(dtype=torch.bfloat16), config=nff.FusionConfig(soc="Ascend910B"))
    with torch.no_grad():
        compiled(*_inputs(dtype=torch.bfloat16))
    assert _paged_fia(backend)[0].kwargs["block_table"] is not None
    note = next(s.note for s in backend.report.sites if s.pass_name == "paged_attention")
    assert "on an NPU" not in note
    compiled, backend = _compile(PagedDecode(dtype=torch.bfloat16, block_size=8),
                                 config=nff.FusionConfig(soc="Ascend910B"))
    with torch.no_grad():
        compiled(*_inputs(dtype=torch.bfloat16, lengths=torch.tensor([12, 20, 7])))  # within the tables of 8-slot blocks
    assert _paged_fia(backend)[0].kwargs.get("block_table") is None  # FIA over the gathered keys, as before
    (reason,) = near_miss_reasons(backend.report, "paged_attention")
    assert "block_size 8 is not a multiple of 16" in reason


# ---- gathers whose layout the graph does not prove ----------------------------------------------
class SlotsFromCaller(PagedDecode):
    """The slots handed in (as transformers' PagedAttentionCache passes read_index)."""

    def forward(self, query, key, value, block_table, lengths, read_slots):
        write_at_slots(self.key_cache, self.value_cache, next_slots(block_table, lengths, self.block_size), key, value)
        keys = self.key_cache.view(-1, NKV, D)[read_slots].transpose(1, 2)
        values = self.value_cache.view(-1, NKV, D)[read_slots].transpose(1, 2)
        return masked_attention(query, keys, values, lengths)


class OtherArithmetic(PagedDecode):
    """Slots from a table of 16-slot blocks, but multiplied by 8: not the cache's layout."""

    def forward(self, query, key, value, block_table, lengths):
        write_at_slots(self.key_cache, self.value_cache, next_slots(block_table, lengths, self.block_size), key, value)
        positions = torch.arange(block_table.shape[1] * BLOCK)
        slots = block_table.long()[:, positions // BLOCK] * 8 + positions % BLOCK
        keys = self.key_cache.view(-1, NKV, D)[slots].transpose(1, 2)
        values = self.value_cache.view(-1, NKV, D)[slots].transpose(1, 2)
        return masked_attention(query, keys, values, lengths)


def _table_slots(table):
    positions = torch.arange(table.shape[1] * BLOCK)
    return (table.long()[:, positions // BLOCK] * BLOCK + positions % BLOCK).remainder(8 * BLOCK)


@pytest.mark.parametrize("module, extra, expected", [
    (SlotsFromCaller, (_table_slots(TABLE),), "slots that are a graph input"),
    (OtherArithmetic, (), "not as block_table[b, p // block_size] * block_size + p % block_size"),
])
def test_slots_the_graph_does_not_prove_are_a_near_miss(module, extra, expected):
    eager, fused = module(), module()
    compiled, backend = _compile(fused)
    inputs = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs, *extra), eager(*inputs, *extra))
    (reason,) = near_miss_reasons(backend.report, "paged_attention")
    assert expected in reason
    assert _paged_fia(backend)[0].kwargs.get("block_table") is None  # FIA over the gathered keys, as before
