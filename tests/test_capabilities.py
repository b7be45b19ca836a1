"""The capability table against the wheel, and what a torchair mode does with it.

capabilities.CAPABILITIES must list every op a pass can emit, and say truly whether
torchair 2.13 can lower it in max-autotune (a GE converter). A pass must not emit, in a
mode, an op that mode cannot lower: it leaves the site unfused with a near miss instead.
"""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch

from npu_fx_fusion import FusionConfig, capabilities
from npu_fx_fusion.accept import apply_pass
from npu_fx_fusion.backend import FusionPipeline
from npu_fx_fusion.config import PASS_NAMES
from npu_fx_fusion.pipeline import load_pass
from npu_fx_fusion.registry import pattern_set
from helpers import ScaleShiftFusion
from torchair_harness.runner import torch_npu_dir_or_skip

IMPLEMENTED = [name for name in PASS_NAMES if load_pass(name) is not None]


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_every_op_a_pass_emits_is_in_the_table(name):
    emitted = pattern_set(load_pass(name)).emitted_ops  # raises KeyError for an op missing from the table
    assert all(ops for ops in emitted.values()), f"{name}: a form emits no fused op: {emitted}"
    for ops in emitted.values():
        assert set(ops) <= set(capabilities.CAPABILITIES), ops


def _wheel_ge_converters() -> set[str]:
    """Every `torch.ops.<ns>.<op>` torchair 2.13 registers a GE converter for, from source."""
    torchair_dir = os.path.join(torch_npu_dir_or_skip(), "torch_npu", "dynamo", "torchair")
    pattern = re.compile(r"register_fx_node_ge_converter\(\s*torch\.ops\.(\w+)\.(\w+)\.")
    found = set()
    for root, _, files in os.walk(torchair_dir):
        for filename in files:
            if filename.endswith(".py"):
                with open(os.path.join(root, filename), encoding="utf-8") as f:
                    found.update(f"{ns}.{op}" for ns, op in pattern.findall(f.read()))
    return found


def test_ge_converter_column_matches_torchairs_converter_sources():
    converters = _wheel_ge_converters()
    assert "npu.npu_rms_norm" in converters and len(converters) > 500  # the scan itself works
    wrong = {op: cap.ge_converter for op, cap in capabilities.CAPABILITIES.items()
             if cap.ge_converter != (op in converters)}
    assert not wrong, f"capabilities.py says ge_converter= {wrong}; torchair 2.13 disagrees"


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="max-autotune"):
        FusionConfig(mode="max_autotune")


# ---- a test-only fusion whose op has no GE converter ------------------------------------
_NO_CONVERTER = ScaleShiftFusion("nff_test_caps", ge_converter=False)


def _test_pass():
    return _NO_CONVERTER.fusion_pass()


def _graph():
    return ScaleShiftFusion.graph(4)


@pytest.fixture
def no_converter_op(monkeypatch):
    monkeypatch.setitem(capabilities.CAPABILITIES, _NO_CONVERTER.capability.op, _NO_CONVERTER.capability)


@pytest.mark.parametrize("mode, fuses", [("max-autotune", False), ("reduce-overhead", True),
                                         ("npugraph_ex", True), (None, True)])
def test_an_op_without_ge_converter_is_not_emitted_in_max_autotune(no_converter_op, mode, fuses):
    result = apply_pass(_test_pass(), _graph(), mode=mode)
    assert len(result.sites) == int(fuses), result
    if fuses:
        assert result.near_misses == []
        # in emulation (mode unknown) the site says what max-autotune would do with it
        note = result.sites[0].note
        assert ("no GE converter" in note) == (mode is None), note
    else:
        (miss,) = result.near_misses
        assert miss.reason == ("nff_test_caps.scale_shift has no GE converter in torchair 2.13, "
                               "so max-autotune cannot lower it"), miss


def test_an_op_missing_from_the_table_cannot_be_emitted():
    with pytest.raises(KeyError, match="no entry in capabilities.CAPABILITIES"):
        apply_pass(_test_pass(), _graph())


def test_the_pipeline_takes_the_mode_from_torchairs_config(no_converter_op):
    torchair_config = SimpleNamespace(mode=SimpleNamespace(value="max-autotune"))
    pipeline = FusionPipeline(FusionConfig(enable={"rms_norm"}))
    pipeline(_graph(), None, torchair_config)
    pipeline(_graph(), None, None)
    assert [g.mode for g in pipeline.report.graphs] == ["max-autotune", None]
    # FusionConfig.mode wins over the config torchair passes
    pipeline = FusionPipeline(FusionConfig(enable={"rms_norm"}, mode="reduce-overhead"))
    pipeline(_graph(), None, torchair_config)
    assert pipeline.report.graphs[0].mode == "reduce-overhead"
    assert "torchair mode reduce-overhead" in pipeline.report.to_markdown()
