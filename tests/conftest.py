import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own modules; stale dynamo caches would hide recompiles.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def caplog_fusion(caplog):
    caplog.set_level(logging.INFO, logger="npu_fx_fusion")
    return caplog
