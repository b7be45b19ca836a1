"""Shared test helpers: compile through the emulation backend, compare within ulps."""
from __future__ import annotations

import torch

import npu_fx_fusion as nff
from npu_fx_fusion.backend import EmulationBackend


def compile_and_run(module, *inputs, config=None, grad=False):
    """(fused output, eager output, report) of `module` on `inputs`."""
    backend = EmulationBackend(config or nff.FusionConfig())
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    with torch.set_grad_enabled(grad):
        expected = module(*inputs)
        actual = compiled(*inputs)
    return actual, expected, backend.report


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (the size of one unit in the last place)."""
    a = t.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs()
    allowed = ulps * ulp(expected).double()
    worst = (diff - allowed).max().item()
    assert worst <= 0, f"differs by more than {ulps} ulp: max excess {worst:.3g}, max diff {diff.max().item():.3g}"


def near_miss_reasons(report, pass_name):
    return [m.reason for m in report.near_misses if m.pass_name == pass_name]
