"""Ops other libraries define that patterns match on, looked up without importing those
libraries for users who do not have them loaded."""
from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch


def transformers_grouped_mm_fallback() -> Optional[torch._ops.OpOverload]:  # noqa: SLF001
    """transformers' `grouped_mm_fallback` custom op, if the running transformers defines it.

    transformers.integrations.moe registers it on import. A transformers model has
    transformers imported already, and then that one module is cheap to import; nobody
    else pays for it (importing transformers takes seconds).
    """
    if "transformers" not in sys.modules:
        return None
    try:
        importlib.import_module("transformers.integrations.moe")
        return torch.ops.transformers.grouped_mm_fallback.default
    except (ImportError, AttributeError):
        return None


def torchtitan_deterministic_scatter_add() -> Optional[torch._ops.OpOverload]:  # noqa: SLF001
    """torchtitan's `deterministic_scatter_add` custom op (its MoE combine), if torchtitan is loaded.

    torchtitan.ops.scatter_add registers it on import; a torchtitan model has imported it.
    """
    if "torchtitan" not in sys.modules:
        return None
    try:
        importlib.import_module("torchtitan.ops.scatter_add")
        return torch.ops.torchtitan.deterministic_scatter_add.default
    except (ImportError, AttributeError):
        return None
