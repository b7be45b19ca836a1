"""Run a test scenario in a fresh subprocess that has torchair imported behind the stubs.

Why a subprocess: torchair patches process-global state the first time it compiles
(meta kernels, Inductor's pattern tables, config class attributes, the stand-in op
libraries), and its stubs must be installed before torch is imported. The pytest process
has torch imported already and must stay clean for the other tests.

A scenario is a module-level function of a test module, taking JSON-able keyword
arguments and returning a JSON-able value:

    def scenario_fuses(tmpdir):            # runs in the child, after stubs.bootstrap()
        import torch, torchair, npu_fx_fusion as nff
        ...
        return {"fused_ops": nff.last_report().fused_ops}

    def test_fuses(tmp_path):
        result = run_scenario(scenario_fuses, tmpdir=str(tmp_path))
        assert result["fused_ops"]["npu.npu_rms_norm"] == 1

The test is skipped when the unpacked wheel is missing (run scripts/fetch_torch_npu.sh),
and fails instead when NPU_FX_FUSION_REQUIRE_WHEEL is set (CI, so a broken fetch
cannot pass as a skip).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Any, Callable, Optional

TORCH_NPU_VERSION = "2.13.0"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRE_ENV = "NPU_FX_FUSION_REQUIRE_WHEEL"
DIR_ENV = "NPU_FX_FUSION_TORCH_NPU_DIR"
DEFAULT_TIMEOUT = 180.0


def torch_npu_dir() -> str:
    """Where scripts/fetch_torch_npu.sh unpacks the wheel (same default and override)."""
    return os.environ.get(DIR_ENV) or os.path.join(REPO, ".cache", f"torch_npu-{TORCH_NPU_VERSION}")


def torch_npu_dir_or_skip() -> str:
    """torch_npu_dir() if it holds the unpacked wheel; otherwise skip (or fail, if required)."""
    import pytest

    folder = torch_npu_dir()
    if os.path.isfile(os.path.join(folder, "torch_npu", "dynamo", "torchair", "__init__.py")):
        return folder
    message = (f"torchair tests need the unpacked torch-npu {TORCH_NPU_VERSION} wheel in {folder}: "
               f"run `bash scripts/fetch_torch_npu.sh` (or set {DIR_ENV})")
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        pytest.fail(f"{message}; {REQUIRE_ENV} is set, so this is an error, not a skip", pytrace=False)
    pytest.skip(message)


def run_scenario(fn: Callable[..., Any], *, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Any:
    """Run `fn(**kwargs)` in a fresh Python with torchair bootstrapped; return its result.

    A scenario that raises (an assertion included) fails the calling test with the
    child's traceback and the tail of its output.
    """
    folder = torch_npu_dir_or_skip()
    source = inspect.getsourcefile(fn)
    if source is None or fn.__qualname__ != fn.__name__:
        raise TypeError(f"{fn!r}: a scenario must be a module-level function of a source file")
    with tempfile.TemporaryDirectory(prefix="torchair_scenario_") as scratch:
        result_path = os.path.join(scratch, "result.json")
        spec = {"file": os.path.abspath(source), "function": fn.__name__, "kwargs": kwargs,
                "result": result_path, "torch_npu_dir": folder}
        env = dict(os.environ)
        env[DIR_ENV] = folder
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS_DIR, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "torchair_harness.runner", json.dumps(spec)],
                env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"scenario {fn.__name__} timed out after {timeout:.0f} s\n"
                                 + _tail(_text(exc.output))) from None
        outcome = _read(result_path)
    if outcome is None or proc.returncode != 0:
        detail = (outcome or {}).get("error") or f"(the child exited with code {proc.returncode} "\
                                                  "and wrote no result)"
        raise AssertionError(f"scenario {fn.__name__} failed in its subprocess:\n{detail}\n"
                             f"--- child output (tail) ---\n{_tail(proc.stdout)}")
    return outcome["value"]


def _read(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _text(output: Any) -> str:
    if isinstance(output, bytes):
        return output.decode("utf-8", "replace")
    return output or ""


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _child(spec: dict) -> int:
    """The subprocess side: bootstrap, import the scenario's module by path, run, save."""
    from torchair_harness import stubs

    stubs.bootstrap(spec["torch_npu_dir"])  # before anything imports torch
    outcome: dict
    code = 0
    try:
        import importlib.util

        module_spec = importlib.util.spec_from_file_location("_torchair_scenario_module", spec["file"])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        value = getattr(module, spec["function"])(**spec["kwargs"])
        outcome = {"value": value}
        json.dumps(outcome)  # fail here, with a traceback, if the result is not JSON-able
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        outcome = {"error": traceback.format_exc()}
        code = 1
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))


def recover_view_inplace(gm: Any, mode: str) -> list:
    """torchair's remove_noop_ops and recover_view_inplace_pattern (its _optimize_fx steps 2
    and 3) on a fused graph, inside a scenario (torchair importable), its CANN gate (>= 8.3.RC1)
    lifted; the graph's call targets after them, as strings."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    from torchair.patterns import _recover_view_inplace_pattern as recover

    recover._is_supported_cann_version = lambda version: True
    remove_noop_ops(gm.graph)

    class Config:  # what recover_view_inplace_pattern reads
        class mode:
            value = None

    Config.mode.value = mode
    recover.recover_view_inplace_pattern(gm, None, Config())
    gm.recompile()
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
