"""The torch-npu wheel's Python Meta functions, runnable without torch_npu.

torch_npu/op_plugin/meta/_meta_registrations.py registers a Meta kernel per op with
`@impl(m, "op")` on a `Library("npu", "IMPL", "Meta")`; on an NPU those are the fake
tensors a compile traces with. The module imports torch_npu (which needs CANN), so it is run
here from its source with the torch_npu names replaced by stand-ins: the imports are dropped,
`impl` collects the functions instead of registering them, and the module-level calls
(has_side_effect on ops that do not exist here) are skipped. A Meta function that reads a
device property gets the A2 answer (get_soc_version) and CANN 9.2.0 (get_cann_version).
"""
from __future__ import annotations

import ast
import functools
import math
import os
import types
import warnings
from typing import Callable

import torch

META_FILE = os.path.join("torch_npu", "op_plugin", "meta", "_meta_registrations.py")


class _Library:
    def __init__(self, namespace, *args, **kwargs):
        self.namespace = namespace


class _Anything:
    """ErrCode.VALUE and friends: only ever formatted into error messages."""

    def __getattr__(self, name):
        return ""


def _imports_torch_npu_or_registers(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.startswith("torch_npu") for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("torch_npu") or node.module in ("torch.library", "torch.fx.node")
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)  # has_side_effect(...) calls


@functools.lru_cache(maxsize=None)
def wheel_meta_functions(torch_npu_dir: str) -> dict[str, Callable]:
    """"op" or "op.overload" -> the wheel's Meta function of torch.ops.npu.<op>."""
    path = os.path.join(torch_npu_dir, META_FILE)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    tree.body = [node for node in tree.body if not _imports_torch_npu_or_registers(node)]
    found: dict[str, Callable] = {}

    def impl(library, name, *args, **kwargs):
        def collect(fn):
            if isinstance(library, _Library) and library.namespace == "npu":
                found.setdefault(name, fn)
            return fn
        return collect

    namespace = {
        "__name__": "torch_npu_meta_registrations", "torch": torch, "math": math, "os": os, "warnings": warnings,
        "Library": _Library, "impl": impl, "ErrCode": _Anything(), "ops_error": lambda *a, **k: "",
        "get_cann_version": lambda: "9.2.0", "get_soc_version": lambda: 220,  # Ascend910B1
        # torch_npu's own dtype enum values, which the Meta functions compare arguments with
        "torch_npu": types.SimpleNamespace(int4=285, hifloat8=290, float4_e2m1fn_x2=296, float4_e1m2fn_x2=297,
                                           float8_e8m0fnu=293),
    }
    exec(compile(tree, path, "exec"), namespace)  # noqa: S102 - the wheel's own source
    return found
