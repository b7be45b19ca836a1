"""Logging: quiet by default, standard `logging` when asked, and torch's structured trace."""
import glob
import logging
import os
import subprocess
import sys
import textwrap

import torch

import npu_fx_fusion as nff
from helpers import compile_and_run
from test_rms_norm import HFLlama

_SCRIPT = textwrap.dedent("""
    import torch, npu_fx_fusion as nff
    from npu_fx_fusion.backend import EmulationBackend

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    with torch.no_grad():
        torch.compile(Norm(), backend=EmulationBackend())(torch.randn(2, 8))
    print("fused:", nff.last_report().counts["rms_norm"])
""")


def _run(env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)


def test_quiet_by_default():
    proc = _run({})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fused: 1" in proc.stdout
    assert "npu_fx_fusion" not in proc.stderr and "rms_norm" not in proc.stderr, proc.stderr


def test_reports_go_to_torchs_structured_trace(tmp_path):
    proc = _run({"TORCH_TRACE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    traces = "".join(open(p, encoding="utf-8").read() for p in glob.glob(f"{tmp_path}/*"))
    assert '"name": "npu_fx_fusion_report_inference"' in traces
    assert '"pass": "rms_norm", "fused": 1' in traces  # the payload: the graph's report


def test_info_and_debug_logs_through_standard_logging(caplog):
    module = HFLlama(8)
    with caplog.at_level(logging.DEBUG, logger="npu_fx_fusion"):
        compile_and_run(module, torch.randn(2, 8), config=nff.FusionConfig(enable={"rms_norm"}))
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("npu_fx_fusion")]
    assert any(m.startswith("pass rms_norm: 1 fused") for m in messages), messages


def test_torch_logs_turns_our_logs_on():
    proc = _run({"TORCH_LOGS": "npu_fx_fusion"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pass rms_norm: 1 fused" in proc.stderr, proc.stderr[-2000:]
