"""The docs' examples run: every ```python block, and every `npu-fx-fusion` command line.

A block fenced as ```python is executed as written (in a fresh namespace, in this
process); illustrations that are not complete programs are fenced ```python fragment,
and examples that need torchair ```python torchair (tests/test_torchair_backend.py
runs those paths). In ```bash blocks, lines starting with `npu-fx-fusion ` run through
the CLI and must exit 0 (```bash fragment: commands on paths of the reader's own).

The facts the docs state about the code are checked against it too: the models the
README's table names, the pass order, the model types that do not build, the dump files.
"""
import contextlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from npu_fx_fusion.cli import main
from npu_fx_fusion.config import PASS_NAMES
from npu_fx_fusion.dumps import FILES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted([os.path.join(REPO, "README.md")]
              + [os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, "docs"))
                 for f in files if f.endswith(".md")])
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(kind):
    found = []
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for match in FENCE.finditer(text):
            info, body = match.group(1).strip(), match.group(2)
            line = text[: match.start()].count("\n") + 1
            found.append((f"{os.path.relpath(path, REPO)}:{line}", info, body))
    return [(where, body) for where, info, body in found if info == kind]


PYTHON = _blocks("python")
COMMANDS = [(where, line.split("#")[0].strip()) for where, body in _blocks("bash")
            for line in body.splitlines() if line.startswith("npu-fx-fusion ")]


def test_the_docs_have_examples_to_run():
    assert len(PYTHON) >= 2 and len(COMMANDS) >= 3, (PYTHON, COMMANDS)


@pytest.mark.parametrize("where, code", PYTHON, ids=[w for w, _ in PYTHON])
def test_python_example_runs(where, code):
    exec(compile(code, where, "exec"), {"__name__": "__docs_example__"})  # noqa: S102


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w + " " + c for w, c in COMMANDS])
def test_command_line_example_runs(where, command, capsys):
    argv = shlex.split(command)[1:]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, f"{where}: `{command}` exited {code}\n{out[-3000:]}"


def _read(relpath):
    with open(os.path.join(REPO, relpath), encoding="utf-8") as f:
        return f.read()


def _readme_row(pass_name):
    (row,) = [line for line in _read("README.md").splitlines() if line.startswith(f"| `{pass_name}` |")]
    return row


def test_models_the_readme_names_for_rms_norm_fuse_it():
    pytest.importorskip("transformers")
    from npu_fx_fusion.tiny_models import HF_KNOWN_FAILURES, hf_model_types

    row = _readme_row("rms_norm")
    named = sorted({word.lower() for word in re.findall(r"[A-Z][a-z]+", row)} & set(hf_model_types()))
    assert {"llama", "mistral", "gemma"} <= set(named), row
    for model_type in named:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["report", f"hf:{model_type}", "--layers", "1", "--format", "json"])
        doc = json.loads(out.getvalue())
        # 1 layer: its 2 norms and the final one, and the logits still match
        assert doc["report"]["counts"]["rms_norm"] == 3, (model_type, doc["report"]["counts"])
        assert doc["outputs_vs_eager"]["ok"], model_type
        # the whole report succeeds, or the model is a known failure (another pass's bug)
        errors = [p["error"] for g in doc["report"]["graphs"] for p in g["passes"] if p["error"]]
        assert (code == 0) == (model_type not in HF_KNOWN_FAILURES), (model_type, errors)


def test_configuration_lists_the_passes_in_pipeline_order():
    text = _read("docs/configuration.md")
    (line,) = re.findall(r"Pass names, in pipeline order: ([^.]+)\.", text.replace("\n", " "))
    assert re.findall(r"`([a-z_0-9]+)`", line) == list(PASS_NAMES)


def test_models_page_lists_the_types_that_do_not_report():
    pytest.importorskip("transformers")
    from npu_fx_fusion.tiny_models import HF_KNOWN_FAILURES

    rows = [line for line in _read("docs/models.md").splitlines() if line.startswith("| `")]
    listed = {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}
    assert listed == set(HF_KNOWN_FAILURES)


def test_every_dump_file_is_documented():
    text = _read("docs/reports-and-dumps.md")
    assert [name for name in FILES if f"`{name}`" not in text and f"/{name}`" not in text] == []


def test_the_docs_say_how_to_enter_the_venv_and_its_command_is_there():
    # the scripts make ./.venv; a reader must learn how to use it before the first command
    for doc in ("README.md", "docs/getting-started.md"):
        text = _read(doc)
        assert "source .venv/bin/activate" in text and ".venv/bin/npu-fx-fusion" in text, doc
    # the tests run in such a venv: its console script is where the docs say, and runs
    script = os.path.join(os.path.dirname(sys.executable), "npu-fx-fusion")
    proc = subprocess.run([script, "report", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "TARGET forms:" in proc.stdout, proc.stderr[-2000:]


def test_the_python_version_the_docs_name_is_the_one_the_pins_need():
    pinned = importlib.metadata.metadata("transformers")["Requires-Python"]  # ">=3.11.0"
    minimum = re.match(r">=\s*(\d+\.\d+)", pinned).group(1)
    assert f"Python {minimum} or newer" in _read("README.md")
    assert f"sys.version_info < ({minimum.replace('.', ', ')})" in _read("scripts/venv.sh")


def _without_timings(line):
    line = re.sub(r"\(\d+\.\d ms\)", "(ms)", line)
    return re.sub(r"max abs diff [^,]+,", "max abs diff _,", line)


def test_the_example_report_is_what_the_demo_prints(capsys):
    text = _read("docs/reports-and-dumps.md")
    (example,) = re.findall(r"Example \(from `bash scripts/demo.sh`.*?\n```\n(.*?)```", text, re.DOTALL)
    lines = [line for line in example.splitlines() if line != "..."]
    assert len(lines) > 20
    assert main(["demo"]) == 0
    printed = {_without_timings(line) for line in capsys.readouterr().out.splitlines()}
    assert [line for line in lines if _without_timings(line) not in printed] == []
