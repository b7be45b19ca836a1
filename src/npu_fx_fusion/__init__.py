"""npu-fx-fusion: torch.compile FX passes that rewrite unfused PyTorch into fused Ascend NPU ops.

    import torch, npu_fx_fusion as nff
    backend = nff.get_npu_backend(fusion_config=nff.FusionConfig(disable={"rope"}))
    out = torch.compile(model, backend=backend)(*inputs)
    print(nff.last_report().to_markdown())

Importing this package registers nothing and traces nothing: the stand-in ops and the
patterns are set up when the first graph is fused.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .backend import get_npu_backend, install, last_report
from .config import FusionConfig
from .report import FusionReport

__all__ = ["FusionConfig", "FusionReport", "get_npu_backend", "install", "fuse", "last_report"]
__version__ = "0.1.0"


def fuse(gm: torch.fx.GraphModule, example_inputs: Optional[Sequence[Any]] = None,
         config: Optional[FusionConfig] = None) -> FusionReport:
    """Fuse an aten-level GraphModule in place and return its report.

    The graph must be aten-level (aot_autograd or make_fx output). If its nodes carry no
    tensor metadata, `example_inputs` are propagated through it first.
    """
    from .backend import _set_last_report
    from .pipeline import run_passes

    report = FusionReport()
    run_passes(gm, config or FusionConfig(), report, graph_name="graph", example_inputs=example_inputs)
    _set_last_report(report)
    return report
