"""The passes: every module of npu_fx_fusion.patterns, run in the order their declarations imply.

A pass is a module `patterns/<name>.py` defining `PASS` (a FusionPass named <name>); its
name is its module name, so adding a fusion adds its name. Each declares the passes that
must run before it (`after=`); the pipeline order is a topological order of those
declarations, with passes that have no order between them taken by name, so the order
never depends on which other passes exist or are enabled.
"""
from __future__ import annotations

import functools
import heapq
import importlib
import pkgutil
from typing import Optional

from .forms import FusionPass

PATTERNS_PACKAGE = "npu_fx_fusion.patterns"


@functools.cache
def pass_names() -> tuple[str, ...]:
    """Every pass, in pipeline order."""
    passes = {name: load_pass(name) for name in _module_names()}
    return pass_order({name: fusion_pass.after for name, fusion_pass in passes.items() if fusion_pass})


def _module_names() -> list[str]:
    package = importlib.import_module(PATTERNS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def pass_order(after: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A topological order of `after` ({pass: passes that must run before it}), ties by name."""
    for name, earlier in after.items():
        unknown = sorted(set(earlier) - set(after))
        if unknown:
            raise ValueError(f"pass {name} is declared after unknown pass(es) {', '.join(unknown)}")
    waiting = {name: set(earlier) for name, earlier in after.items()}
    ready = [name for name, earlier in waiting.items() if not earlier]
    heapq.heapify(ready)
    order = []
    while ready:
        name = heapq.heappop(ready)
        order.append(name)
        for other, earlier in waiting.items():
            if name in earlier:
                earlier.discard(name)
                if not earlier:
                    heapq.heappush(ready, other)
    if len(order) != len(after):
        cycle = sorted(set(after) - set(order))
        raise ValueError(f"the passes {', '.join(cycle)} are declared after each other in a cycle")
    return tuple(order)


@functools.cache
def load_pass(name: str) -> Optional[FusionPass]:
    """The FusionPass of npu_fx_fusion.patterns.<name>, or None if this version has none."""
    try:
        module = importlib.import_module(f"{PATTERNS_PACKAGE}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{PATTERNS_PACKAGE}.{name}":
            raise
        return None
    fusion_pass = module.PASS
    if fusion_pass.name != name:
        raise ValueError(f"{PATTERNS_PACKAGE}.{name} declares a pass named {fusion_pass.name!r}: "
                         "a pass is named after its module")
    return fusion_pass
