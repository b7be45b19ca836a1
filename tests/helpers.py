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


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    """|actual - expected| within `ulps` ulp of the largest |expected|.

    For outputs computed through several layers: rounding differences of a few ulp at a
    fused op travel through the following matmuls as absolute errors on the scale of the
    activations, not relative to each element.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max()
    allowed = ulps * ulp(scale.reshape(1)).double().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    assert diff <= allowed, f"max diff {diff:.3g} exceeds {ulps} ulp at scale {scale.item():.3g} ({allowed:.3g})"
