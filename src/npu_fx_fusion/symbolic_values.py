"""Values a graph computes from symbolic sizes only, as formulas of their indices (WIP)."""
from __future__ import annotations

from typing import Optional


def symbolic_mask_mode(terms) -> tuple[Optional[str], str]:
    return None, ("the attention mask is computed from graph inputs (or symbolic sizes), so it cannot be proven "
                  "causal at compile time")
