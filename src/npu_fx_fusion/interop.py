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
    return _op_of_loaded_library("transformers", "transformers.integrations.moe", "grouped_mm_fallback")


def torchtitan_deterministic_scatter_add() -> Optional[torch._ops.OpOverload]:  # noqa: SLF001
    """torchtitan's `deterministic_scatter_add` custom op (its MoE combine), if torchtitan is loaded.

    torchtitan.ops.scatter_add registers it on import; a torchtitan model has imported it.
    """
    return _op_of_loaded_library("torchtitan", "torchtitan.ops.scatter_add", "deterministic_scatter_add")


def _op_of_loaded_library(library: str, module: str, op: str) -> Optional[torch._ops.OpOverload]:  # noqa: SLF001
    """torch.ops.<library>.<op>.default once `library` is imported (its `module` registers
    the op), else None; never imports the library itself."""
    if library not in sys.modules:
        return None
    try:
        importlib.import_module(module)
        return getattr(getattr(torch.ops, library), op).default
    except (ImportError, AttributeError):
        return None
