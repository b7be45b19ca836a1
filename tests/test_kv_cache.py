"""kv_cache: transformers' StaticLayer.update -> scatter_update, and what is not that write.

The module under test is transformers' own StaticLayer (cache_utils.py), allocated as
generation allocates it, its update compiled through the emulation backend. After each
call the cache tensors must equal eager's exactly: a write copies values, no arithmetic.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from helpers import RecordingBackend, near_miss_reasons
from npu_fx_fusion.npu_ops import ensure_registered
from torchair_harness.runner import run_scenario

ensure_registered()
SCATTER_UPDATE = torch.ops.npu.scatter_update.default
B, NKV, LEN, D = 2, 2, 12, 8


def _layer():
    layer = StaticLayer(max_cache_len=LEN)
    layer.lazy_initialization(torch.zeros(B, NKV, 0, D), torch.zeros(B, NKV, 0, D))
    return layer


class Writes(nn.Module):
    """StaticLayer.update, read back so the written caches are outputs too."""

    def __init__(self):
        super().__init__()
        self.layer = _layer()

    def forward(self, key, value):
        keys, values = self.layer.update(key, value)
        return keys.sum((-1, -2)) + values.sum((-1, -2))


def _kv(seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, NKV, seq, D, generator=g), torch.randn(B, NKV, seq, D, generator=g).transpose(1, 2) \
        .contiguous().transpose(1, 2)  # the value as transformers has it: a transposed view


def _generate(module_type, steps, dynamic=False):
    eager, fused = module_type(), module_type()
    backend = RecordingBackend()
    compiled = torch.compile(fused, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for index, seq in enumerate(steps):
            key, value = _kv(seq, index)
            torch.testing.assert_close(compiled(key, value), eager(key, value))
            assert torch.equal(fused.layer.keys, eager.layer.keys) and torch.equal(fused.layer.values,
                                                                                 eager.layer.values)
            assert torch.equal(fused.layer.cumulative_length, eager.layer.cumulative_length)
    return backend


def test_prefill_then_decode_writes_fuse_and_the_caches_stay_equal():
    backend = _generate(Writes, [4, 1, 1, 1])
    report = backend.report
    assert [len(r.sites) for g in report.graphs for r in g.passes if r.pass_name == "kv_cache"] == [2, 2]
    assert near_miss_reasons(report, "kv_cache") == []
    decode = backend.graphs["inference"]
    ops = [n.target for n in decode.graph.nodes if n.op == "call_function"]
    assert ops.count(SCATTER_UPDATE) == 2 and torch.ops.aten.index_copy.default not in ops
    assert torch.ops.aten.arange.default not in ops  # the positions are gone with both writes
    # the shape torchair re-inplaces: input -> view -> scatter_update -> view -> copy_(input)
    for write in (n for n in decode.graph.nodes if n.target is SCATTER_UPDATE):
        pre, post = write.args[0], next(iter(write.users))
        assert pre.target is torch.ops.aten.view.default and pre.args[0].op == "placeholder"
        assert post.target is torch.ops.aten.view.default
        assert any(u.target is torch.ops.aten.copy_.default and u.args[0] is pre.args[0] for u in post.users)
    note = report.sites[0].note
    assert "does not check bounds" in note and "scatter_update_ in place" in note


def test_dynamic_sequence_length():
    backend = _generate(Writes, [3, 5, 2], dynamic=True)
    assert backend.report.counts["kv_cache"] >= 2


# ---- negatives ----------------------------------------------------------------------------
class CallerPositions(nn.Module):
    """Positions handed in by the caller (a cache_position tensor): nothing proves them a run."""

    def __init__(self):
        super().__init__()
        self.layer = _layer()

    def forward(self, key, value, positions):
        self.layer.keys.index_copy_(2, positions, key)
        self.layer.values.index_copy_(2, positions, value)
        return self.layer.keys.sum() + self.layer.values.sum()


class StridedPositions(CallerPositions):
    def forward(self, key, value, start):
        positions = torch.arange(key.shape[-2]) * 2 + start
        return super().forward(key, value, positions)


class SequenceFirstCache(nn.Module):
    """A (B, max_len, N, D) cache written along dim 1."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(B, LEN, NKV, D))
        self.register_buffer("length", torch.tensor(0))

    def forward(self, key):
        positions = torch.arange(key.shape[1]) + self.length
        self.keys.index_copy_(1, positions, key)
        return self.keys.sum()


def _near_misses(module, *inputs):
    backend = RecordingBackend()
    with torch.no_grad():
        eager = module(*inputs)
        compiled = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)  # the same values written again
    assert backend.report.counts["kv_cache"] == 0
    return near_miss_reasons(backend.report, "kv_cache")


@pytest.mark.parametrize("module, extra", [(CallerPositions, torch.tensor([0, 2, 3])),
                                           (StridedPositions, torch.tensor(1))])
def test_positions_not_proven_contiguous(module, extra):
    key, value = _kv(3, 0)
    reasons = _near_misses(module(), key, value, extra)
    assert len(reasons) == 2 and all("not proven contiguous" in r for r in reasons), reasons


def test_a_cache_in_another_layout():
    (reason,) = _near_misses(SequenceFirstCache(), torch.randn(B, 3, NKV, D))
    assert "along dim 1 of a 4-d cache" in reason


# ---- torchair makes the write in place -----------------------------------------------------
def scenario_torchair_reinplaces_the_fused_write():
    """torchair's own remove_noop_ops and recover_view_inplace_pattern (its _optimize_fx
    steps 2 and 3) on our fused decode graph: scatter_update_ in place, no copy_ back."""
    import torch
    import torchair  # noqa: F401  (behind the harness stubs)

    import test_kv_cache as t
    from helpers import RecordingBackend
    from torchair_harness.runner import recover_view_inplace

    module = t.Writes()
    backend = RecordingBackend()
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.no_grad():
        key, value = t._kv(1, 0)
        compiled(key, value)
        gm = backend.graphs["inference"]
        targets = recover_view_inplace(gm, "reduce-overhead")
        # run the rewritten graph on fresh zero caches, writing at position 3: the writes land
        # in the caches themselves (the same tensor as key and value: which is which is moot)
        caches, args = [], []
        for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
            value_ = node.meta["val"]
            if tuple(value_.shape) == (t.B, t.NKV, t.LEN, t.D):
                caches.append(torch.zeros(t.B, t.NKV, t.LEN, t.D))
                args.append(caches[-1])
            elif value_.dtype == torch.int64 and value_.dim() == 0:
                args.append(torch.tensor(3))
            else:
                args.append(key)
        gm.recompile()
        gm(*args)
    return {"targets": targets, "written": [bool(torch.equal(c[:, :, 3:4], key)) for c in caches],
            "elsewhere": [float(c[:, :, :3].abs().sum() + c[:, :, 4:].abs().sum()) for c in caches]}


def test_torchair_reinplaces_the_fused_write():
    result = run_scenario(scenario_torchair_reinplaces_the_fused_write)
    targets = result["targets"]
    assert targets.count("npu.scatter_update_.default") == 2 and "npu.scatter_update.default" not in targets
    assert targets.count("aten.copy_.default") == 1  # only the cache length is still copied back
    assert result["written"] == [True, True] and result["elsewhere"] == [0.0, 0.0]
