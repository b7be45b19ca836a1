"""The docs' examples run: every ```python block, and every `npu-fx-fusion` command line.

A block fenced as ```python is executed as written (in a fresh namespace, in this
process); illustrations that are not complete programs are fenced ```python fragment,
and examples that need torchair ```python torchair (tests/test_torchair_backend.py
runs those paths). In ```bash blocks, lines starting with `npu-fx-fusion ` run through
the CLI and must exit 0.
"""
import os
import re
import shlex

import pytest

from npu_fx_fusion.cli import main

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
