"""Precompiled patterns (registry.py): what ships equals what tracing gives, and a stale
file is never used."""
import importlib

import pytest

from npu_fx_fusion import registry
from npu_fx_fusion.catalog import load_pass, pass_names


@pytest.fixture(scope="module", autouse=True)
def _every_form():
    registry.import_optional_form_libraries()


@pytest.mark.parametrize("name", pass_names())
def test_the_shipped_patterns_are_what_tracing_gives_now(name):
    fusion_pass = load_pass(name)
    traced = registry.trace_patterns(fusion_pass)
    module = importlib.import_module(f"{registry.PRECOMPILED_PACKAGE}.{name}")
    with open(module.__file__, encoding="utf-8") as f:
        shipped = f.read()
    assert shipped == registry.precompiled_source(fusion_pass, traced), (
        f"patterns/_precompiled/{name}.py is out of date: run scripts/precompile_patterns.py {name}")
    # and what the pipeline loads from it is what was traced
    fusion_pass.registered.clear()
    loaded = registry.pattern_set(fusion_pass)
    assert loaded.source == "precompiled"
    for which in ("forward", "joint"):
        ours, theirs = getattr(loaded, which), getattr(traced, which)
        assert [(r.form, r.kind, r.requires_grad) for r in ours] == [(r.form, r.kind, r.requires_grad) for r in theirs]
        assert all(a.pattern.pattern_eq(b.pattern) for a, b in zip(ours, theirs))
        assert loaded.anchors(joint=which == "joint") == frozenset().union(*(r.anchors for r in theirs))
    assert loaded.emitted_ops == traced.emitted_ops and loaded.keywords == traced.keywords


def test_a_file_from_other_sources_is_not_used(monkeypatch, caplog):
    fusion_pass = load_pass("swiglu")
    fusion_pass.registered.clear()
    monkeypatch.setattr(registry, "source_hash", lambda p: "something else")
    with caplog.at_level("INFO", logger="npu_fx_fusion.registry"):
        assert registry.pattern_set(fusion_pass).source == "traced"
    assert "precompiled patterns not used (the pass or the engine's tracing changed" in caplog.text
    fusion_pass.registered.clear()


def test_a_file_from_another_torch_is_not_used(monkeypatch, caplog):
    fusion_pass = load_pass("swiglu")
    fusion_pass.registered.clear()
    monkeypatch.setattr(registry.torch, "__version__", "2.99.0")
    with caplog.at_level("INFO", logger="npu_fx_fusion.registry"):
        assert registry.pattern_set(fusion_pass).source == "traced"
    assert "generated with torch" in caplog.text
    fusion_pass.registered.clear()


def test_a_printed_pattern_keeps_its_shared_arguments():
    """A joint pattern finds its gradient outputs from the nodes its named arguments
    matched, by object: printed copies of a KeywordArg would match nothing."""
    from torch._inductor import pattern_matcher as pm

    x = pm.KeywordArg("x")
    pattern = pm.MultiOutputPattern([pm.CallFunction(registry.torch.ops.aten.neg.default, x),
                                     pm.CallFunction(registry.torch.ops.aten.exp.default, x)])
    text = registry._print_pattern(pattern)  # noqa: SLF001
    assert text.count("KeywordArg('x')") == 1
    registry._check_round_trip(pattern, text)  # noqa: SLF001 - raises if the sharing were lost
