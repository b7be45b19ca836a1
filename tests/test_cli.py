"""`npu-fx-fusion report / demo`: targets, options, outputs and exit codes.

The report has to explain itself to a first reader (issue 20): the folded rms_norm
sites, the view -> reshape step, the conversions fusion adds, where each site is in the
model's code, the tolerance of the eager comparison, what --dump-dir wrote.
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import npu_fx_fusion as nff
from npu_fx_fusion.cli import OUTPUT_TOLERANCE, compare_with_eager, main
from npu_fx_fusion.dumps import FILES


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def qwen3_moe():
    """`report hf:qwen3_moe --verify`, run once: (exit code, stdout, its FusionReport)."""
    torch._dynamo.reset()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", "hf:qwen3_moe", "--verify"])
    return code, out.getvalue(), nff.last_report()


def test_report_hf_model_with_verification(qwen3_moe):
    code, out, _ = qwen3_moe
    assert code == 0, out
    assert out.startswith("# npu-fx-fusion report: hf-qwen3_moe-grouped_mm-fp32\n")
    # every fused site carries its verdict, and the cost estimate is there
    site_lines = [line for line in out.splitlines() if line.strip().startswith("- fused")]
    # attention, norms, rope, swiglu, moe_gating, moe_dispatch, grouped_matmul; then
    # merged_projections (each layer's q/k/v) and rope_qk (each layer's q and k: Qwen3's
    # q_norm / k_norm leave them dense)
    assert len(site_lines) == 2 + 9 + 4 + 4 + 2 + 2 + 2 + 4 + 2 + 2
    assert all("[verified: max error" in line for line in site_lines), site_lines
    assert "kernel launches" in out and "moved" in out
    assert "outputs vs eager" in out and "OK" in out


def test_pass_table_says_how_many_norms_were_folded(qwen3_moe):
    # 9 norms fused; the 4 after a residual add were then folded into npu_add_rms_norm,
    # so the final graph holds 5 npu_rms_norm: the table must not leave that to arithmetic
    _, out, report = qwen3_moe
    assert report.folded == {"rms_norm": {"add_rms_norm": 4}, "rope": {"rope_qk": 4}}
    assert "| rms_norm | 9 | 0 | 4 folded into add_rms_norm |" in out
    assert report.fused_ops["npu.npu_rms_norm"] == report.counts["rms_norm"] - 4
    assert re.search(r"\| add_rms_norm \| 4 \| 0 \| *\|", out)  # nothing folded into a later pass


def test_op_table_keeps_the_view_to_reshape_step_apart(qwen3_moe):
    _, out, report = qwen3_moe
    table = [line for line in out.splitlines() if line.startswith("| aten.") or line.startswith("| npu.")]
    assert table and not [row for row in table if row.startswith(("| aten.view.", "| aten.reshape."))]
    assert not any(line.startswith("| getitem") for line in out.splitlines())
    (note,) = [line for line in out.splitlines() if line.startswith("Views and reshapes")]
    (graph,) = report.graphs
    views = graph.ops_before["aten.view.default"]
    assert views > graph.ops_after["aten.view.default"]  # inside fused code, or became reshapes
    assert f"aten.view.default {views} -> {graph.ops_after['aten.view.default']}" in note
    reshapes = graph.ops_before["aten.reshape.default"]
    assert (f"aten.reshape.default {reshapes} -> {graph.ops_after['aten.reshape.default']}" in note) == \
        (reshapes != graph.ops_after["aten.reshape.default"])


def test_fusion_leaves_no_conversion_of_its_own(qwen3_moe):
    """The report explains conversions fusion adds (test_report); here there are none left:
    - the expert offsets: the model sums its int64 counts into int32 for torch._grouped_mm,
      and the fused GEMMs read the counts themselves (group_list_type 1), so neither the
      cumsum nor a cast back to the op's int64 group list is launched;
    - the int32 -> int64 -> int32 round trip of the expert ids between the fused router and
      the fused dispatch is gone (cleanup.drop_lossless_round_trips)."""
    _, out, report = qwen3_moe
    (graph,) = report.graphs
    assert graph.conversions_added == {}
    # no running sum is left: the expert offsets' (one per MoE layer) are read as counts
    assert graph.ops_before["aten.cumsum.default"] >= 2 and graph.ops_after["aten.cumsum.default"] == 0
    (row,) = [line for line in out.splitlines() if line.startswith("| aten._to_copy.default |")]
    _, before, after, why, _ = (cell.strip() for cell in row.split("|")[1:])
    assert int(after) < int(before) and not why, row


def test_grouped_matmul_sites_point_at_the_gemm_line(qwen3_moe):
    # the expert GEMMs survive moe_dispatch's rewrite and are fused afterwards; they must
    # keep the line of the GEMM call, not take the block's combine line (.sum(dim=1))
    _, _, report = qwen3_moe
    sites = [s for s in report.sites if s.pass_name == "grouped_matmul"]
    assert len(sites) == 4
    for site in sites:
        assert "grouped_mm" in site.location.code and ".sum(" not in site.location.code, site.location
        assert site.location.module.endswith("mlp.experts")


def test_tolerance_says_where_it_comes_from(qwen3_moe):
    _, out, _ = qwen3_moe
    (line,) = [line for line in out.splitlines() if line.startswith("- outputs vs eager")]
    assert re.search(r"tolerance \S+ = 0\.0001 \(fp32: fused ops only reorder float operations\) "
                     r"x \S+ \(the largest \|eager output\|, at least 1\): OK", line), line


@pytest.mark.parametrize("dtype, scale, expected", [
    (torch.float32, 0.5, 1e-4),      # logits below 1: the relative tolerance itself
    (torch.float32, 4.1, 4.1e-4),    # logits up to 4.1: scaled (the 1e-4 vs 4.1e-4 of two runs)
    (torch.bfloat16, 2.0, 0.12),
])
def test_tolerance_is_relative_to_the_largest_output(dtype, scale, expected):
    eager = torch.tensor([0.0, -scale]).to(dtype)
    verdict = compare_with_eager(eager + OUTPUT_TOLERANCE[dtype] / 2, eager)
    assert verdict["tolerance"] == pytest.approx(expected, rel=1e-2)
    assert verdict["output_scale"] == pytest.approx(scale, rel=1e-2) and verdict["ok"]
    assert verdict["relative_tolerance"] == OUTPUT_TOLERANCE[dtype]
    assert str(OUTPUT_TOLERANCE[dtype]) in verdict["tolerance_rule"]
    far = compare_with_eager(eager + 2 * expected, eager)
    assert not far["ok"]


def test_report_json_is_one_document(capsys):
    code, out, _ = _run(capsys, "report", "torchtitan:llama3", "--format", "json", "--disable", "swiglu")
    assert code == 0
    doc = json.loads(out)
    assert doc["outputs_vs_eager"]["ok"] is True
    assert doc["outputs_vs_eager"]["tolerance"] == pytest.approx(
        doc["outputs_vs_eager"]["relative_tolerance"] * max(1.0, doc["outputs_vs_eager"]["output_scale"]))
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
    (["report", "nonsense"], "is not hf:TYPE, hf:DIR, torchtitan:NAME, torchtune:NAME, litgpt:NAME, "
                             "olmo_core:NAME, torchtitan_npu:NAME or module:factory"),
    (["report", "torchtune:no_such_builder"], "unknown torchtune model builder 'no_such_builder'"),
    (["report", "litgpt:no_such_config"], "unknown litgpt config 'no_such_config'"),
    (["report", "hf:no_such_model"], "unknown transformers model type 'no_such_model'"),
    (["report", "hf:qwen3_moe@fancy_mm"], "unknown experts implementation 'fancy_mm'"),
    (["report", "hf:./no/such/dir"], "no config.json at ./no/such/dir"),
    (["report", "torchtitan:no_such_model"], "unknown torchtitan model 'no_such_model'"),
    (["report", "no_such_module_xyz:build"], "cannot import"),
    (["report", "json:no_such_callable"], "has no callable"),
    (["report", "hf:llama", "--disable", "nope"], "unknown pass"),
    (["demo", "--disable", "rope,nope"], "unknown pass"),
    (["report", "torchtitan:llama3", "--real-dims"], "--real-dims applies to hf: targets"),
    (["report", "hf:llama", "--real-dims", "--verify"], "use one or the other"),
    (["report", "hf:llama", "--layers", "0"], "--layers and --seq-len must be at least 1"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert message in err, err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "hf:llama", "--soc", "Ascend999"])
    assert exc.value.code == 2


@pytest.mark.parametrize("variable, value, names", [
    ("NPU_FX_FUSION", "banana", ["'banana'", "1, true, on, yes", "0, false, off, no"]),
    ("NPU_FX_FUSION_DISABLE", "rms_nrom", ["'rms_nrom'", "rms_norm, add_rms_norm"]),
])
def test_a_bad_environment_variable_is_one_line_at_once(capsys, monkeypatch, variable, value, names):
    monkeypatch.setenv(variable, value)
    start = time.perf_counter()
    code, out, err = _run(capsys, "report", "hf:llama")
    assert time.perf_counter() - start < 5  # before the model is built, not inside a compile
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert f"${variable}" in line and all(name in line for name in names), line


def test_help_lists_the_target_forms_and_points_at_the_docs(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    for form in ("hf:TYPE[@experts]", "hf:DIR", "torchtitan:NAME", "module:factory", "file.py:factory",
                 "--real-dims", "docs/getting-started.md"):
        assert form in out, form


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
    # one line: what failed, where in the model's code, and how to see the whole traceback
    (line,) = err.splitlines()
    assert code == 1 and "broken_target:build failed to run: RuntimeError" in line, err
    assert "(at broken_target.py:6 in forward); --traceback prints the whole traceback" in line
    code, _, err = _run(capsys, "report", "broken_target:build", "--traceback")
    assert code == 1 and err.startswith("Traceback (most recent call last):")
    assert 'broken_target.py", line 6, in forward' in err


def test_console_script_runs_as_a_process_and_says_what_it_dumped(tmp_path):
    # the installed entry point, end to end, as a user runs it
    proc = subprocess.run([sys.executable, "-m", "npu_fx_fusion.cli", "report", "hf:llama", "--layers", "1",
                           "--dump-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "**rope**: 2 fused" in proc.stdout
    listing = proc.stdout.split("\ndump: wrote ", 1)[1].splitlines()
    written = sorted(os.path.relpath(os.path.join(root, f), tmp_path)
                     for root, _, files in os.walk(tmp_path) for f in files)
    assert listing[0] == f"{len(written)} files to {tmp_path}:"
    files = [line for line in listing[1:] if line.startswith("  ") and not line.startswith("  open ")]
    assert f"  open {tmp_path / 'report.html'} in a browser" in listing
    described = {line.strip().split(": ", 1)[0]: line.split(": ", 1)[1] for line in files}
    assert sorted(described) == written  # every file, and each with what it is
    assert {"report.html", "report.md", "report.json", "graph_000_inference/after.py"} <= set(described)
    for path, what in described.items():
        assert what == FILES[os.path.basename(path)]


@pytest.mark.parametrize("flag, graph", [((), "NPU graph"), (("--no-npu-dispatch",), "CPU graph")])
def test_the_report_says_which_graph_it_fused(capsys, flag, graph):
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1", *flag)
    assert code == 0, out
    assert f"- graphs fused: {graph}" in out
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1", "--format", "json", *flag)
    doc = json.loads(out)["report"]
    assert doc["graph_source"].startswith(graph)
    # an NPU compile holds llama's SDPA as torch_npu's FlashAttention, the CPU trace does not
    ops = doc["graphs"][0]["ops_before"]
    assert ("npu.npu_fusion_attention_v3.default" in ops) == (graph == "NPU graph"), ops


# ---- --phase prefill|decode: one generation step over a StaticCache ------------------------
def test_report_decode_step_per_layer(capsys):
    code, out, _ = _run(capsys, "report", "hf:llama", "--phase", "decode", "--max-cache-len", "24",
                        "--format", "json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["target"] == "hf-llama-fp32-decode-static24"
    assert doc["vs_eager"]["logits"]["ok"] and doc["vs_eager"]["cache"]["ok"]
    # every layer: its attention call and both cache writes fused
    assert doc["per_layer"] == {str(layer): {"attention": [1, 0], "cache_writes": [2, 0], "fused_ops": [
        "npu.npu_fused_infer_attention_score", "npu.scatter_update", "npu.scatter_update"]} for layer in (0, 1)}
    (graph,) = doc["report"]["graphs"]  # the compiled step is the decode step, an NPU graph by default
    assert graph["ops_before"]["npu.npu_fusion_attention_v3.default"] == 2


def test_phase_needs_an_hf_target_and_room_in_the_cache(capsys):
    code, _, err = _run(capsys, "report", "torchtitan:llama3", "--phase", "prefill")
    assert code == 2 and "--phase needs an hf:MODEL_TYPE target" in err
    code, _, err = _run(capsys, "report", "hf:llama", "--phase", "prefill", "--max-cache-len", "8")
    assert code == 2 and "cannot hold the 16-token prompt" in err


# ---- the first screen, and bad input that names the fix -------------------------------------
def test_the_first_screen_says_what_fused_what_an_npu_would_refuse_and_the_verdict(capsys):
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1")
    assert code == 0, out
    first = out.split("\n## graph 0")[0]
    assert first.startswith("# npu-fx-fusion report: hf-llama-fp32\n")
    assert "- graphs fused: NPU graph" in first
    # no SoC given: the fp32 attention fuses on the CPU stand-ins, and the report says an NPU would not
    assert "- SoC limits: none applied" in first
    assert "  - attention x1: npu.npu_fused_infer_attention_score does not support float32" in first
    assert re.search(r"^- outputs vs eager: max abs diff .*: OK$", first, re.MULTILINE)
    rows = [line for line in first.splitlines() if line.startswith("| ") and not line.startswith("| pass")]
    assert [row.split(" | ")[0][2:] for row in rows] == ["merged_projections", "rms_norm", "add_rms_norm", "attention",
                                                         "rope", "rope_qk", "swiglu"]
    assert re.search(r"more passes ran and found no candidate: .*kv_rmsnorm_rope_cache", first)
    assert out.rstrip().splitlines()[-1] == "hf-llama-fp32: 11 fused sites, 1 near miss, outputs match eager"
    # with the SoC given, its limits apply: the fp32 attention is a near miss, nothing is listed
    code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1", "--soc", "Ascend910B")
    first = out.split("\n## graph 0")[0]
    assert "- SoC limits: Ascend910B's" in first and "x1: npu.npu_fused_infer_attention_score" not in first
    assert re.search(r"^\| attention \| 0 \| 1 \|", first, re.MULTILINE), first


def test_the_op_table_is_the_same_in_every_run(capsys):
    tables = []
    for _ in range(2):
        torch._dynamo.reset()
        code, out, _ = _run(capsys, "report", "hf:llama", "--layers", "1")
        assert code == 0
        tables.append([line for line in out.splitlines() if line.startswith(("| aten.", "| npu."))])
    assert tables[0] and tables[0] == tables[1]


@pytest.fixture
def config_dir(tmp_path):
    def write(**fields):
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
                  "torch_dtype": "float32", "rope_theta": 10000.0, "transformers_version": "4.46.0", **fields}
        (tmp_path / "config.json").write_text(json.dumps(config))
        return f"hf:{tmp_path}"
    return write


def test_a_misspelt_config_key_fails_naming_the_right_one(capsys, config_dir):
    target = config_dir(num_key_value_head=2)
    code, out, err = _run(capsys, "report", target)
    (line,) = err.splitlines()
    assert code == 2 and out == ""
    assert "'num_key_value_head' is not a key of transformers' llama config; did you mean " \
           "'num_key_value_heads'? (--allow-unknown-keys builds it as it is)" in line
    # spelt right: GQA, 2 KV heads for the 4 query heads
    code, out, _ = _run(capsys, "report", config_dir(num_key_value_heads=2), "--layers", "1", "--format", "json")
    assert code == 0 and json.loads(out)["report"]["counts"]["attention"] == 1
    # keys no llama config reads but real configs carry (remote code, serialisation) pass
    code, _, err = _run(capsys, "report", config_dir(num_key_value_heads=2, scoring_func="softmax", auto_map={},
                                                     quantization_config={"quant_method": "fp8"}, head_dim=16),
                        "--layers", "1", "--format", "json")
    assert code == 0, err


def test_a_misspelt_model_type_names_the_nearest_in_one_line(capsys):
    code, _, err = _run(capsys, "report", "hf:lama")
    (line,) = err.splitlines()
    assert code == 2 and "unknown transformers model type 'lama'; did you mean 'llama'" in line
    assert len(line) < 400, line  # not every model type
    code, _, err = _run(capsys, "report", "torchtitan:lama3")
    assert code == 2 and "did you mean 'llama3'?" in err


def test_a_module_that_is_a_file_here_is_suggested_as_the_file(capsys, tmp_path, monkeypatch):
    (tmp_path / "raising.py").write_text("def factory():\n    raise RuntimeError('boom in the factory')\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "report", "raising:factory")
    assert code == 2 and "No module named 'raising'; raising.py is here: give the file, raising.py:factory" in err
    code, _, err = _run(capsys, "report", "raising.py:factry")
    assert code == 2 and "has no callable 'factry'; did you mean 'factory'?" in err
    code, _, err = _run(capsys, "report", "raising.py:factory")
    (line,) = err.splitlines()
    assert code == 1 and "raising.py:factory failed to build: RuntimeError: boom in the factory" in line
    assert "(at raising.py:2 in factory); --traceback" in line
