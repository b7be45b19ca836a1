"""`npu-fx-fusion report / demo`: targets, options, outputs and exit codes."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from npu_fx_fusion.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_hf_model_with_verification(capsys):
    code, out, _ = _run(capsys, "report", "hf:qwen3_moe", "--verify")
    assert code == 0, out
    assert "target: hf-qwen3_moe-grouped_mm-fp32" in out
    # every fused site carries its verdict, and the cost estimate is there
    site_lines = [line for line in out.splitlines() if line.strip().startswith("- fused")]
    assert len(site_lines) == 9 + 4 + 4 + 2 + 2 + 2 + 4  # norms, rope, swiglu, moe_gating, moe_dispatch, grouped_matmul
    assert all("[verified: max error" in line for line in site_lines), site_lines
    assert "kernel launches" in out and "moved" in out
    assert "outputs vs eager" in out and "OK" in out


def test_report_json_is_one_document(capsys):
    code, out, _ = _run(capsys, "report", "torchtitan:llama3", "--format", "json", "--disable", "swiglu")
    assert code == 0
    doc = json.loads(out)
    assert doc["outputs_vs_eager"]["ok"] is True
    assert doc["report"]["counts"]["rope"] == 4
    assert "swiglu" not in doc["report"]["counts"]
    cost = doc["report"]["graphs"][0]["estimated_cost"]
    assert cost["after"]["launches"] < cost["before"]["launches"]


def test_report_module_factory_and_file_factory(capsys, tmp_path, monkeypatch):
    source = textwrap.dedent("""
        import torch

        class Norm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

            def forward(self, x):
                h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                return self.weight * h

        def build():
            return Norm(), (torch.randn(2, 3, 8),)

        def not_a_pair():
            return 42
    """)
    (tmp_path / "my_target.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for target in ("my_target:build", f"{tmp_path}/my_target.py:build"):
        code, out, _ = _run(capsys, "report", target, "--soc", "Ascend910B")
        assert code == 0, out
        assert "**rms_norm**: 1 fused" in out
    code, _, err = _run(capsys, "report", "my_target:not_a_pair")
    assert code == 2 and "must return (model, example_inputs)" in err


@pytest.mark.parametrize("argv, message", [
    (["report", "nonsense"], "is not hf:MODEL_TYPE"),
    (["report", "hf:no_such_model"], "unknown HF model type"),
    (["report", "torchtitan:no_such_model"], "no_such_model"),
    (["report", "no_such_module_xyz:build"], "cannot import"),
    (["report", "json:no_such_callable"], "has no callable"),
    (["report", "hf:llama", "--disable", "nope"], "unknown pass"),
    (["demo", "--disable", "rope,nope"], "unknown pass"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "hf:llama", "--soc", "Ascend999"])
    assert exc.value.code == 2


def test_a_failing_model_exits_1(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken_target.py").write_text(textwrap.dedent("""
        import torch

        class Broken(torch.nn.Module):
            def forward(self, x):
                return x @ torch.ones(3, 3)  # x is 2x4: fails in eager already

        def build():
            return Broken(), (torch.randn(2, 4),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _run(capsys, "report", "broken_target:build")
    assert code == 1 and "failed to run" in err


def test_console_script_runs_as_a_process(tmp_path):
    # the installed entry point, end to end, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "npu_fx_fusion.cli", "report", "hf:llama", "--layers", "1",
                           "--dump-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "**rope**: 2 fused" in proc.stdout
    assert (tmp_path / "report.md").is_file()
    assert any(p.name == "after.py" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("flag, graph", [((), "NPU graph"), (("--no-npu-dispatch",), "CPU graph")])
def test_the_report_says_which_graph_it_fused(capsys, flag, graph):
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1", *flag)
    assert code == 0, out
    assert f"Graphs fused: {graph}" in out
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1", "--format", "json", *flag)
    doc = json.loads(out)["report"]
    assert doc["graph_source"].startswith(graph)
    # an NPU compile holds llama's SDPA as torch_npu's FlashAttention, the CPU trace does not
    ops = doc["graphs"][0]["ops_before"]
    assert ("npu.npu_fusion_attention_v3.default" in ops) == (graph == "NPU graph"), ops
