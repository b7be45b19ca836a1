"""paged_kv_cache: slot-mapping writes -> npu_scatter_pa_kv_cache_functional (key and value in
one write) or npu_scatter_nd_update (one cache), and what is not such a write.

The writes are vLLM's reshape_and_cache in plain PyTorch (paged_modules.write_at_slots):
after each call the caches must equal eager's exactly, a write copies values.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import npu_fx_fusion as nff
from helpers import RecordingBackend, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered
from paged_modules import write_at_slots

ensure_registered()
PAIR = torch.ops.npu.npu_scatter_pa_kv_cache_functional.default
ROWS = torch.ops.npu.npu_scatter_nd_update.default
BLOCKS, BLOCK, NKV, D = 4, 8, 2, 16


class Writes(nn.Module):
    """A key and a value cache of (blocks, block_size, N_kv, D), written at the slots."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.register_buffer("key_cache", torch.zeros(BLOCKS, BLOCK, NKV, D, dtype=dtype))
        self.register_buffer("value_cache", torch.zeros(BLOCKS, BLOCK, NKV, D, dtype=dtype))

    def caches(self):
        return self.key_cache, self.value_cache

    def forward(self, key, value, slots):
        key_cache, value_cache = self.caches()
        write_at_slots(key_cache, value_cache, slots, key, value)
        return key_cache.sum() + value_cache.sum()


class OneBuffer(Writes):
    """Keys and values as two halves of one buffer (transformers' PagedAttentionCache holds
    every layer's keys and values in one tensor)."""

    def __init__(self, dtype=torch.float32):
        nn.Module.__init__(self)
        self.register_buffer("buffer", torch.zeros(2 * BLOCKS, BLOCK, NKV, D, dtype=dtype))

    def caches(self):
        return self.buffer[:BLOCKS], self.buffer[BLOCKS:]


class SlotRows(nn.Module):
    """Caches kept as (slots, N_kv, D) rows, written as they are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(BLOCKS * BLOCK, NKV, D))

    def forward(self, key, slots):
        self.keys.index_copy_(0, slots, key)
        return self.keys.sum()


def _tokens(count, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:count]
    return torch.randn(count, NKV, D, generator=g).to(dtype), torch.randn(count, NKV, D, generator=g).to(dtype), slots


def _run(module_type, steps, *, dtype=torch.float32, dynamic=False, config=None):
    eager, fused = module_type(dtype), module_type(dtype)
    backend = RecordingBackend(config)
    compiled = torch.compile(fused, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for index, count in enumerate(steps):
            key, value, slots = _tokens(count, index, dtype)
            torch.testing.assert_close(compiled(key, value, slots), eager(key, value, slots))
            assert all(torch.equal(a, b) for a, b in zip(fused.buffers(), eager.buffers()))
    ops = [n.target for n in backend.graphs["inference"].graph.nodes if n.op == "call_function"]
    return backend.report, ops


@pytest.mark.parametrize("dtype, dynamic", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_key_and_value_writes_are_one_scatter_pa_kv_cache(dtype, dynamic):
    report, ops = _run(Writes, [3, 5, 2], dtype=dtype, dynamic=dynamic)
    assert ops.count(PAIR) == 1 and ROWS not in ops and torch.ops.aten.index_copy.default not in ops
    assert near_miss_reasons(report, "paged_kv_cache") == [] and near_miss_reasons(report, "kv_cache") == []
    note = next(s.note for s in report.sites if s.pass_name == "paged_kv_cache")
    assert "key and value in one write" in note and "checks no bounds" in note


def test_a_real_soc_writes_bf16_in_one_call_and_fp32_one_cache_at_a_time():
    report, ops = _run(Writes, [3], dtype=torch.bfloat16, config=nff.FusionConfig(soc="Ascend910B"))
    assert ops.count(PAIR) == 1
    report, ops = _run(Writes, [3], config=nff.FusionConfig(soc="Ascend910B"))
    # the A2 kernel takes fp16 / bf16 / int8 (CANN README): each cache on its own
    assert PAIR not in ops and ops.count(ROWS) == 2
    assert all("float32" in s.note for s in report.sites if s.pass_name == "paged_kv_cache")


def test_caches_of_one_buffer_are_written_one_at_a_time():
    report, ops = _run(OneBuffer, [3, 4])
    assert PAIR not in ops and ops.count(ROWS) == 2
    notes = [s.note for s in report.sites if s.pass_name == "paged_kv_cache"]
    assert notes and all("views of one buffer" in n for n in notes)


def test_reduce_overhead_writes_one_cache_at_a_time():
    # torchair 2.13 re-inplaces npu_scatter_pa_kv_cache_functional in no ACL mode
    report, ops = _run(Writes, [3], config=nff.FusionConfig(mode="reduce-overhead"))
    assert PAIR not in ops and ops.count(ROWS) == 2
    assert all("does not re-inplace" in s.note for s in report.sites if s.pass_name == "paged_kv_cache")


def test_rows_written_as_they_are():
    module, eager = SlotRows(), SlotRows()
    backend = RecordingBackend()
    key, _, slots = _tokens(5, 0)
    with torch.no_grad():
        torch.compile(module, backend=backend, fullgraph=True)(key, slots)
        eager(key, slots)
    assert torch.equal(module.keys, eager.keys)
    write = next(n for n in backend.graphs["inference"].graph.nodes if n.target is ROWS)
    # placeholder -> view -> npu_scatter_nd_update -> view -> copy_: what torchair writes in place
    assert write.args[0].target is torch.ops.aten.view.default and write.args[0].args[0].op == "placeholder"


class TransposedCache(nn.Module):
    """A (N_kv, slots, D) cache written through its slot-major transpose: not contiguous."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(NKV, BLOCKS * BLOCK, D))

    def forward(self, key, slots):
        self.keys.transpose(0, 1).index_copy_(0, slots, key)
        return self.keys.sum()


def test_a_write_into_a_strided_cache_is_a_near_miss():
    module = TransposedCache()
    backend = RecordingBackend()
    key, _, slots = _tokens(3, 0)
    with torch.no_grad():
        torch.compile(module, backend=backend, fullgraph=True)(key, slots)
    (reason,) = near_miss_reasons(backend.report, "paged_kv_cache")
    assert "not contiguous" in reason
    assert near_miss_reasons(backend.report, "kv_cache") == []  # a dim-0 write is not kv_cache's


# ---- torchair makes the single-cache write in place -----------------------------------------------
def scenario_torchair_reinplaces_the_rows_write():
    """torchair's own remove_noop_ops and recover_view_inplace_pattern on the fused graph of a
    (slots, N, D) cache: npu_scatter_nd_update_ in place, no copy_ back."""
    import torch
    import torchair  # noqa: F401  (behind the harness stubs)

    import test_paged_kv_cache as t
    from helpers import RecordingBackend
    from torchair_harness.runner import recover_view_inplace

    backend = RecordingBackend()
    key, _, slots = t._tokens(3, 0)
    with torch.no_grad():
        torch.compile(t.SlotRows(), backend=backend, fullgraph=True)(key, slots)
        gm = backend.graphs["inference"]
        targets = recover_view_inplace(gm, "max-autotune")
        cache = torch.zeros(t.BLOCKS * t.BLOCK, t.NKV, t.D)
        placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        gm(*[cache if tuple(v.shape) == tuple(cache.shape) else slots if v.dtype == torch.int64 else key
             for v in placeholders])
    return {"targets": targets, "written": bool(torch.equal(cache[slots], key)),
            "elsewhere": float(cache.sum() - cache[slots].sum())}


def test_torchair_reinplaces_the_rows_write():
    from torchair_harness.runner import run_scenario

    result = run_scenario(scenario_torchair_reinplaces_the_rows_write)
    targets = result["targets"]
    assert targets.count("npu.npu_scatter_nd_update_.default") == 1 and "npu.npu_scatter_nd_update.default" not in targets
    assert "aten.copy_.default" not in targets
    assert result["written"] and result["elsewhere"] == 0.0
