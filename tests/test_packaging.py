"""The package installs as one: the engine and the patterns catalog, plus the CLI."""
import ast
import importlib.metadata
import os
import pathlib
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


ENGINE = pathlib.Path(npu_fx_fusion.__file__).parent
CATALOG = pathlib.Path(npu_fx_fusion.patterns.__file__).parent
# what a pattern module may import of the engine (DESIGN.md: patterns/ never reaches into
# the engine's internals)
PATTERN_SURFACE = {"matching", "capabilities", "constants", "interop", "patterns"}


def _engine_imports(path: pathlib.Path, package: str) -> set:
    """The engine modules `path` imports, at any depth (function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from . import x
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                names = [node.module] if node.module else [alias.name for alias in node.names]
                found.update(".".join([*base, name]).split(".")[1] for name in names)
            elif node.module and node.module.startswith("npu_fx_fusion."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("npu_fx_fusion."))
    return found


def test_engine_modules_import_each_other_in_no_circle():
    graph = {}
    for path in ENGINE.rglob("*.py"):
        relative = path.relative_to(ENGINE.parent).with_suffix("")
        module = relative.parts[1] if len(relative.parts) > 1 else relative.parts[0]
        if module in ("__init__", "patterns"):
            continue  # the package's public API imports what it exports; the catalog is below
        package = ".".join(relative.parts[:-1])
        graph.setdefault(module, set()).update(m for m in _engine_imports(path, package) if m != module)
    order, visiting = [], {}

    def visit(module, path):
        if visiting.get(module) == "done":
            return
        assert visiting.get(module) != "open", "import circle: " + " -> ".join([*path, module])
        visiting[module] = "open"
        for imported in sorted(graph.get(module, ())):
            visit(imported, [*path, module])
        visiting[module] = "done"
        order.append(module)

    for module in sorted(graph):
        visit(module, [])
    assert {"accept", "pipeline", "canonical", "registry", "replay"} <= set(order)


def test_patterns_use_only_the_engine_surface():
    for path in CATALOG.glob("*.py"):
        used = _engine_imports(path, "npu_fx_fusion.patterns") - PATTERN_SURFACE
        assert not used, f"{path.name} imports the engine's internals: {sorted(used)}"
