"""Make torchair's pure-Python pipeline importable on a machine without an NPU or CANN.

torchair ships inside the torch-npu wheel (torch_npu/dynamo/torchair), but the wheel
cannot be installed where torch imports from: torch would auto-load torch_npu, which
needs CANN's shared libraries. scripts/fetch_torch_npu.sh unpacks the wheel (plus numpy,
protobuf and packaging) into a folder instead; `bootstrap(folder)` then arranges, in
this process, exactly what shared/reference/torchair.md section 6 found necessary:

1. TORCH_DEVICE_BACKEND_AUTOLOAD=0, so `import torch` does not load torch_npu through
   the `torch.backends` entry point of the unpacked wheel's dist-info;
2. the folder (for the deps) and folder/torch_npu/dynamo (so `torchair` and
   `npugraph_ex` import as top-level packages, as torch_npu aliases them on an NPU) on
   sys.path;
3. stand-in modules for torchair's four pybind extensions, which link against
   libge_runner / libascendcl;
4. an import blocker for `torch_npu` itself;
5. npugraph_ex's exit handlers removed once it is imported.

Call it before importing torch, in a process of its own: torchair patches process-global
state (meta kernels, Inductor pattern tables, config classes), which is why
tests/torchair_harness/runner.py runs every scenario in a fresh subprocess.
"""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import types
import warnings

# torchair's native extension modules (torchair/core/*.so). All of them need CANN.
NATIVE_MODULES = (
    "torchair.core._torchair",
    "torchair.core._npu_graph_executor",
    "torchair.core._npu_utils",
    "torchair.core._abi_compat_ge_apis",
)

# (module, attribute) of every native entry point torchair touched, for diagnostics:
# a scenario can report it to show how far into the native layer a compile reached.
STUB_CALLS: list[tuple[str, str]] = []


class _NativeStubType(type):
    """A class standing in for anything a native module exports.

    Attribute access on the class yields another stub class (so enum-like constants such
    as `_torchair.TorchDataType.FLOAT32` exist, and `class TorchNpuGraph(
    _torchair.TorchNpuGraphBase)` can subclass one). Calling the class builds an instance
    whose methods accept anything and return None.
    """

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = _NativeStubType(attr, (), {"__init__": _accept_anything, "__getattr__": _stub_method})
        type.__setattr__(cls, attr, sub)
        return sub


def _accept_anything(self, *args, **kwargs) -> None:
    pass


def _stub_method(self, attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)

    def method(*args, **kwargs):
        STUB_CALLS.append((type(self).__name__, attr))
        return None

    return method


def _native_stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"CPU stand-in for torchair's native {name} (no CANN here)")
    module.__file__ = "<npu-fx-fusion torchair stub>"
    root = _NativeStubType(name.rsplit(".", 1)[-1], (), {})

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        STUB_CALLS.append((name, attr))
        value = getattr(root, attr)
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__
    return module


def _registered_ir_def_not_found(ge_name: str):
    """`_torchair.get_registered_ir_def`: the CANN op-IR registry, which is empty here.

    Answering "not registered" (status "ERROR") makes an op without an explicit GE
    converter fail lowering with torchair's own "No AscendIR ... registered" error,
    deterministically, instead of with a TypeError from unpacking a stub.
    """
    return ("ERROR", [], [], [])


def _cann_compatible(optype, runtime_optional_inputs, runtime_optional_attrs) -> str:
    """`_torchair.check_cann_compat`: "" (compatible) for every GE op.

    torchair asks the installed CANN whether it knows the optional inputs / attributes a
    converter sets on newer IR ops (compat_ir.ge_op); a non-empty answer is an error
    message. There is no CANN here, so the CANN is taken to be the one torchair was
    built against, which is what a matching torch_npu install has.
    """
    return ""


class _TorchNpuBlocker(importlib.abc.MetaPathFinder):
    """Makes `import torch_npu` (and its submodules) fail at once with ModuleNotFoundError.

    torchair does `try: import torch_npu / except ImportError` in several places. A real
    attempt fails half-way (no libhccl.so & co.) and leaves torch_npu.* submodules in
    sys.modules; torchair, torch_npu's own code and npu_fx_fusion take
    `'torch_npu' in sys.modules` to mean "running on an NPU", so a failed import must not
    leave that name behind.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch_npu" or fullname.startswith("torch_npu."):
            raise ModuleNotFoundError(
                f"{fullname} is blocked: torchair runs on CPU here without torch_npu "
                "(tests/torchair_harness/stubs.py)", name=fullname)
        return None


class _NpugraphExExitHooks(importlib.abc.MetaPathFinder):
    """Removes npugraph_ex's atexit hook and SIGINT/SIGTERM handlers right after it imports.

    npugraph_ex/__init__.py registers `_finalize` for process exit and for those signals;
    it resets dynamo and uninstalls NPU static kernels, which needs torch_npu and so raises
    at interpreter exit here. The previous signal handlers are put back.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "npugraph_ex":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _UnhookingLoader(spec.loader)
        return spec


class _UnhookingLoader(importlib.abc.Loader):
    """Delegates to npugraph_ex's own loader; removes the exit hooks after exec_module."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, attr):  # get_resource_reader, get_source, ... of the real loader
        return getattr(self._loader, attr)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._loader.exec_module(module)
        finally:
            finalize = getattr(module, "_finalize", None)
            if finalize is not None:
                atexit.unregister(finalize)
            for signum, handler in saved.items():
                if handler is not None:
                    try:
                        signal.signal(signum, handler)
                    except ValueError:  # not the main thread: npugraph_ex set none either
                        pass


def bootstrap(torch_npu_dir: str) -> None:
    """Prepare this process to import torchair / npugraph_ex from an unpacked torch-npu wheel.

    `torch_npu_dir` is the folder scripts/fetch_torch_npu.sh filled. Idempotent. Call it
    before `import torch`.
    """
    torch_npu_dir = os.path.abspath(torch_npu_dir)
    dynamo_dir = os.path.join(torch_npu_dir, "torch_npu", "dynamo")
    if not os.path.isfile(os.path.join(dynamo_dir, "torchair", "__init__.py")):
        raise FileNotFoundError(f"{torch_npu_dir} holds no unpacked torch-npu wheel "
                                "(run scripts/fetch_torch_npu.sh)")

    # 1. Before torch is imported: the wheel's dist-info, once on sys.path, declares a
    #    torch.backends entry point that torch would call on import.
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

    # 2. The deps folder goes at the END of sys.path, so packages the environment already
    #    has (its numpy, the one torch was tested with) win, and the folder only fills the
    #    gaps (protobuf, ...). The dynamo folder goes first: `torchair` and `npugraph_ex`
    #    must resolve to the wheel's copies.
    if torch_npu_dir not in sys.path:
        sys.path.append(torch_npu_dir)
    if dynamo_dir not in sys.path:
        sys.path.insert(0, dynamo_dir)

    # 3. The native modules; sys.modules is consulted before the .so files next to them.
    for name in NATIVE_MODULES:
        if name not in sys.modules:
            sys.modules[name] = _native_stub_module(name)
    sys.modules["torchair.core._torchair"].get_registered_ir_def = _registered_ir_def_not_found
    sys.modules["torchair.core._torchair"].check_cann_compat = _cann_compatible

    # 4 and 5. Import hooks, ahead of the path finders.
    for finder_type in (_TorchNpuBlocker, _NpugraphExExitHooks):
        if not any(isinstance(f, finder_type) for f in sys.meta_path):
            sys.meta_path.insert(0, finder_type())

    # torchair imports every GE converter module on first lowering and warns for each one
    # whose torch.ops.npu.* op does not exist. Without torch_npu only the stand-in ops we
    # register exist, so that is ~100 expected warnings that would bury real output.
    warnings.filterwarnings(
        "ignore", category=UserWarning,
        message=r"Failed to import torchair\._ge_concrete_graph\.ge_converter\.custom\.")
