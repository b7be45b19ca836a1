"""The package installs as one: the engine and the patterns catalog, plus the CLI."""
import importlib.metadata
import os
import subprocess
import sys

import npu_fx_fusion
import npu_fx_fusion.patterns
from npu_fx_fusion.config import PASS_NAMES
from npu_fx_fusion.pipeline import load_pass


def test_patterns_install_inside_the_package():
    package_dir = os.path.dirname(npu_fx_fusion.__file__)
    patterns_dir = os.path.dirname(npu_fx_fusion.patterns.__file__)
    editable = os.path.basename(os.path.dirname(package_dir)) == "src"
    if not editable:  # scripts/test.sh installs regularly: the wheel layout
        assert patterns_dir == os.path.join(package_dir, "patterns")
        assert "site-packages" in package_dir


def test_every_pattern_module_is_named_after_its_pass():
    for name in PASS_NAMES:
        fusion_pass = load_pass(name)
        if fusion_pass is not None:
            assert fusion_pass.name == name


def test_import_registers_and_traces_nothing():
    code = ("import torch, npu_fx_fusion, npu_fx_fusion.patterns.rms_norm as p; "
            "print(hasattr(torch.ops.npu, 'npu_rms_norm'), bool(p.PASS.registered))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "npu-fx-fusion" and ep.value == "npu_fx_fusion.cli:main" for ep in scripts)


def test_cli_rejects_a_bad_pass_name_with_exit_code_2():
    from npu_fx_fusion.cli import main

    assert main(["demo", "--disable", "nope"]) == 2
