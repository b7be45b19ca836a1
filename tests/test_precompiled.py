"""Precompiled patterns (registry.py): what ships equals what tracing gives, and a stale
file is never used.

Every shipped file is checked to be current (its key: the torch version and the hash of the
sources that shape its traces), so the pipeline loads it. Retracing a pass's forms to compare
them with its file takes 10-100 s for the passes with the biggest forms (HEAVY): those are
retraced only with NPU_FX_FUSION_PRECOMPILED=all, the rest in every run.
"""
import importlib
import os

import pytest
from torch._inductor import pattern_matcher as pm

from npu_fx_fusion import registry
from npu_fx_fusion.catalog import load_pass, pass_names


@pytest.fixture(scope="module", autouse=True)
def _every_form():
    registry.import_optional_form_libraries()


PRECOMPILED_ENV = "NPU_FX_FUSION_PRECOMPILED"
# retraced in 20-100 s each on the shared 2-core machine (CI's test durations)
HEAVY = frozenset({"sparse_attention", "attention", "mhc_post", "sparse_mla", "mhc_pre", "softmax_l1_norm"})


@pytest.mark.parametrize("name", pass_names())
def test_every_shipped_file_is_current(name):
    fusion_pass = load_pass(name)
    module = importlib.import_module(f"{registry.PRECOMPILED_PACKAGE}.{name}")
    assert registry._staleness(fusion_pass, fusion_pass.forms, module) is None, (  # noqa: SLF001
        f"patterns/_precompiled/{name}.py is out of date: run scripts/precompile_patterns.py {name}")
    fusion_pass.registered.clear()
    assert registry.pattern_set(fusion_pass).source == "precompiled"


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.skipif(
        name in HEAVY and os.environ.get(PRECOMPILED_ENV) != "all",
        reason=f"a long retrace: {PRECOMPILED_ENV}=all runs it (its file's key is checked above)"))
    for name in pass_names()])
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
        assert all(_pattern_eq(a.pattern, b.pattern, set()) for a, b in zip(ours, theirs))
        assert loaded.anchors(joint=which == "joint") == frozenset().union(*(r.anchors for r in theirs))
    assert loaded.emitted_ops == traced.emitted_ops and loaded.keywords == traced.keywords


def _pattern_eq(a, b, equal_pairs):
    """torch's PatternExpr.pattern_eq, memoised on the pairs already compared: torch's recursion
    has no memo, and compares a sub-pattern once per path to it (2**20 paths through
    mhc_pre's 20-iteration Sinkhorn, whose steps read the step before twice)."""
    if (id(a), id(b)) in equal_pairs:
        return True
    if isinstance(a, pm._TargetArgsExpr):  # noqa: SLF001
        same = (type(a) is type(b) and a.fns == b.fns and a.op == b.op and a.users == b.users
                and a.flat_args_kwargs[1] == b.flat_args_kwargs[1]
                and len(a.flat_args_kwargs[0]) == len(b.flat_args_kwargs[0])
                and all(_pattern_eq(x, y, equal_pairs) if isinstance(x, pm.PatternExpr) else x == y
                        for x, y in zip(a.flat_args_kwargs[0], b.flat_args_kwargs[0])))
    elif isinstance(a, pm.MultiOutputPattern):
        same = type(b) is pm.MultiOutputPattern and len(a.outputs) == len(b.outputs) and all(
            _pattern_eq(x, y, equal_pairs) if isinstance(x, pm.PatternExpr) else x == y
            for x, y in zip(a.outputs, b.outputs))
    else:
        same = a.pattern_eq(b)
    if same:
        equal_pairs.add((id(a), id(b)))
    return same


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
