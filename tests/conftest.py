import logging
import os

import pytest
import torch

# Tests that start several processes (tests/gloo_ranks.py) carry the `multiprocess` marker.
# By default only those not also marked `slow` run (a bounded slice: the harness's own
# tests, the 2-rank deepseek_v3 forward of expert parallel and the small MLP's TP inference and
# SP training step of tensor parallel); NPU_FX_FUSION_MULTIPROCESS=all runs them all, =0 none.
MULTIPROCESS_ENV = "NPU_FX_FUSION_MULTIPROCESS"


def _multiprocess_slice(items):
    wanted = os.environ.get(MULTIPROCESS_ENV, "default").strip().lower()
    for item in items:
        if item.get_closest_marker("multiprocess") is None:
            continue
        if wanted in ("0", "none", "off"):
            item.add_marker(pytest.mark.skip(reason=f"{MULTIPROCESS_ENV}={wanted}: no multi-process tests"))
        elif wanted != "all" and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.skip(
                reason=f"a slow multi-process test, outside the default slice: {MULTIPROCESS_ENV}=all runs it"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own modules; stale dynamo caches would hide recompiles.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _anchor_ops_cover_every_anchor():
    # FusionPass.anchor_ops narrow each pass's near-miss walk: in every graph a test fuses,
    # anchor() must hold at no node they leave out (else its near miss would go unreported)
    from npu_fx_fusion import forms

    forms.ANCHOR_OPS_MISSED = missed = []
    yield
    forms.ANCHOR_OPS_MISSED = None
    assert not missed, f"anchors outside their pass's anchor_ops: {sorted(set(map(str, missed)))}"


@pytest.fixture
def caplog_fusion(caplog):
    caplog.set_level(logging.INFO, logger="npu_fx_fusion")
    return caplog


# Modules whose tests compile whole models, run training steps or torchair's pipeline:
# marked slow, so `pytest -m "not slow"` is the quick subset a contributor runs (CI,
# scripts/test.sh, runs everything and prints the 20 slowest tests: keep this list in
# step with what it shows). Tests elsewhere mark themselves (@pytest.mark.slow).
SLOW_MODULES = frozenset({
    "test_models.py", "test_training.py", "test_training_dsa.py", "test_training_grouped_matmul.py",
    "test_torchair_backend.py",
})


# Tests that must not run alongside each other under pytest-xdist (scripts/test.sh runs `-n 2
# --dist loadgroup`): each group runs on one worker, one test after the other. The
# multi-process tests start several gloo ranks on 127.0.0.1 ports and as many processes as
# ranks (gloo_ranks.free_port: two at once could race for a port and oversubscribe the
# cores); the browser test starts a headless chromium. Everything else keeps its state in its
# own process: dynamo's caches, the stand-in registrations, environment variables (pytest's
# monkeypatch) and files (tmp_path).
SERIAL_GROUPS = {"multiprocess": lambda item: item.get_closest_marker("multiprocess") is not None,
                 "browser": lambda item: item.path.name == "test_report_html.py"}


def _serial_groups(items):
    for item in items:
        for group, member in SERIAL_GROUPS.items():
            if member(item):
                item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config, items):
    # one hook (a second definition of it in this module would replace the first)
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    _multiprocess_slice(items)
    _serial_groups(items)
