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


class IndexerRotations(torch.nn.Module):
    """torchtitan-npu DeepSeek-V3.2's indexer: the rope channels split off q (with heads) and k
    (without), each rotated in its non-interleaved complex form. torchtitan's complex form
    matches structurally, but does not trace at these shapes: a question the passes ask."""

    def __init__(self, dim=32, heads=4, head_dim=24, rope_dim=16):
        super().__init__()
        self.wq = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, head_dim, bias=False)
        self.heads, self.head_dim, self.rope_dim = heads, head_dim, rope_dim

    def forward(self, x, freqs_cis):
        from test_rope import torchtitan_npu_v32_rope

        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe, k_nope = torch.split(self.wk(x), [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe = torchtitan_npu_v32_rope(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        return torch.cat([torchtitan_npu_v32_rope(q_pe, freqs_cis), q_nope], -1), torch.cat([k_pe, k_nope], -1)


def test_a_form_that_does_not_trace_at_a_site_logs_no_error(caplog):
    from test_rope import _freqs_cis

    with caplog.at_level(logging.DEBUG, logger="torch._subclasses.fake_tensor"):
        out, ref, report = compile_and_run(IndexerRotations(), torch.randn(2, 6, 32), _freqs_cis(16, 16),
                                           config=nff.FusionConfig(enable={"rope"}))
    assert report.fused_ops == {"npu.npu_rotary_mul": 2}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)
