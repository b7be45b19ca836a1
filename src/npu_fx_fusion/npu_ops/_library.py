"""Registration machinery for the stand-in op libraries (see the package docstring)."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from typing import Callable, Optional

import torch

from .spec import OpSpec, all_specs

log = logging.getLogger("npu_fx_fusion.npu_ops")

# Namespaces that belong to a package of their own rather than to torch_npu. Their
# stand-ins are registered only when that package is not installed (then its real ops
# are the ones to use, on an NPU, and defining look-alikes here would shadow them).
_NAMESPACE_PACKAGES = {"cann_ops_transformer": "cann_ops_transformer", "cann_ops_nn": "cann_ops_nn"}

_REGISTERED: list[str] = []
# torch.library.Library objects unregister their ops when garbage-collected: keep them.
_LIBRARIES: dict[str, torch.library.Library] = {}


def real_torch_npu_available() -> bool:
    """True when the real torch_npu imports (then its ops are used and nothing is registered)."""
    if "torch_npu" in sys.modules:
        return True
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        importlib.import_module("torch_npu")
    except Exception as exc:  # an install without CANN fails here; that is "absent" for us
        log.debug("torch_npu not usable (%s): using CPU stand-in ops", exc)
        return False
    return True


def _real_package_installed(namespace: str) -> bool:
    """True when `namespace` belongs to a package of its own (not torch_npu) that is installed."""
    package = _NAMESPACE_PACKAGES.get(namespace)
    if package is None:
        return False
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or half-imported install counts as installed
        return True


def _schema_defined(namespace: str, name: str) -> bool:
    try:
        torch._C._get_schema(f"{namespace}::{name}", "")  # noqa: SLF001
    except RuntimeError:
        return False
    return True


def _save_nothing(ctx, inputs, output=None, keyword_only_inputs=None) -> None:
    # torch calls setup_context(ctx, inputs, keyword_only_inputs, output) for an op with
    # keyword-only arguments (npu_moe_init_routing_v2, npu_grouped_matmul, ...), else
    # setup_context(ctx, inputs, output); both by keyword.
    pass


def _no_backward(qualname: str, python_autograd: Optional[str] = None) -> Callable:
    namespace = qualname.split("::")[0]
    owner = "torch_npu" if namespace == "npu" else namespace

    def backward(ctx, *grads):
        if python_autograd is not None:
            raise RuntimeError(f"{qualname} has no dispatcher autograd: {owner} differentiates it with the Python "
                               f"autograd.Function {python_autograd}, around the raw op; call the backward op "
                               "explicitly (as the passes' own autograd rules do)")
        raise RuntimeError(f"{qualname} has no backward in {owner}: it is for inference graphs only")

    return backward


def _missing_backward_message(op: OpSpec) -> str:
    return (f"{op.qualname}: torch_npu differentiates it with {op.missing_backward}, which has no CPU "
            "stand-in yet, so the stand-in cannot backpropagate through it (run it under "
            "torch.no_grad(), or add the stand-in of the backward op)")


def _missing_backward(op: OpSpec) -> Callable:
    def backward(ctx, *grads):
        raise NotImplementedError(_missing_backward_message(op))

    return backward


def _kwarg_only_tensor_names(schema) -> list[str]:
    utils = torch._library.utils  # noqa: SLF001
    return [a.name for a in schema.arguments if a.kwarg_only
            and (utils.is_tensor_like_type(a.type) or utils.is_tensorlist_like_type(a.type))]


def _register_autograd(lib: torch.library.Library, op: OpSpec, backward: Callable,
                       setup_context: Callable) -> None:
    opoverload = getattr(getattr(torch.ops, op.namespace), op.name).default
    kwarg_tensors = _kwarg_only_tensor_names(opoverload._schema)  # noqa: SLF001
    if not kwarg_tensors:
        torch.library.register_autograd(op.qualname, backward, setup_context=setup_context, lib=lib)
        return
    # torch.library.register_autograd refuses keyword-only Tensor arguments (npu_moe_gating_top_k's
    # bias, npu_grouped_matmul's bias, ...) because autograd would not track them. torch_npu
    # differentiates none of them either, so build the same autograd kernel torch would
    # (torch 2.13 private API, the torch version is pinned) and refuse a keyword-only tensor
    # that requires grad instead of silently dropping its gradient.
    autograd = torch._library.autograd  # noqa: SLF001
    if op.differentiable_kwargs:
        kernel = _autograd_with_keyword_grads(opoverload, op, backward, setup_context)
    else:
        kernel = autograd.make_autograd_impl(opoverload, autograd.Info(backward, setup_context))

    def autograd_impl(keyset, *args, **keyword_only_args):
        if torch.is_grad_enabled():
            for name in kwarg_tensors:
                if name in op.differentiable_kwargs:
                    continue
                value = keyword_only_args.get(name)
                tensors = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
                    if op.missing_backward is not None:  # torch_npu may differentiate it
                        raise NotImplementedError(_missing_backward_message(op))
                    raise RuntimeError(f"{op.qualname}: torch_npu has no gradient for its keyword-only "
                                       f"argument {name}, which requires grad")
        return kernel(keyset, *args, **keyword_only_args)

    lib.impl(op.name, autograd_impl, "Autograd", with_keyset=True)


def _autograd_with_keyword_grads(opoverload, op: OpSpec, backward: Callable, setup_context: Callable) -> Callable:
    """make_autograd_impl for an op some of whose keyword-only tensors have a gradient.

    torch's generated autograd.Function passes keyword-only arguments around autograd;
    this one passes `op.differentiable_kwargs` as inputs of the Function, so autograd
    tracks them. `backward(ctx, *grads)` returns the gradients of the positional inputs
    followed by those of the differentiable keyword arguments (in their declared order).
    """
    utils = torch._library.utils  # noqa: SLF001
    names = op.differentiable_kwargs
    schema = opoverload._schema  # noqa: SLF001

    def call_below_autograd(keyset, args, kwargs):
        with torch._C._AutoDispatchBelowAutograd():  # noqa: SLF001
            return opoverload.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)  # noqa: SLF001

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, metadata, *tensors):
            keyset, kwargs = metadata
            split = len(tensors) - len(names)
            args, kwargs = tensors[:split], {**kwargs, **dict(zip(names, tensors[split:]))}
            result = call_below_autograd(keyset, args, kwargs)
            args, kwargs = utils.fill_defaults(schema, args, kwargs)
            setup_context(ctx=ctx, inputs=args, keyword_only_inputs=kwargs, output=result)
            return result

        @staticmethod
        def backward(ctx, *grads):
            return (None, *backward(ctx, *grads))

    Function.__name__ = f"GeneratedBackwardFor_{op.namespace}_{op.name}"

    def autograd_impl(keyset, *args, **keyword_only_args):
        tracked = [keyword_only_args.pop(name, None) for name in names]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (*args, *tracked)):
            return Function.apply((keyset, keyword_only_args), *args, *tracked)
        return call_below_autograd(keyset, args, {**keyword_only_args, **dict(zip(names, tracked))})

    return autograd_impl


@functools.lru_cache(maxsize=None)
def ensure_registered() -> tuple[str, ...]:
    """Register every declared stand-in whose op is not already defined; return their names.

    Runs once per process. With the real torch_npu present it registers nothing. An op that
    another library already defined (torch_npu, or a test's fake library) is left alone.
    """
    if real_torch_npu_available():
        log.info("torch_npu is present: using its ops, no stand-ins registered")
        return ()
    for op in all_specs().values():
        if _real_package_installed(op.namespace):
            log.info("%s: the %s package is installed, its ops are used: not registering the stand-in",
                     op.qualname, _NAMESPACE_PACKAGES[op.namespace])
            continue
        if _schema_defined(op.namespace, op.name):
            log.info("%s is already defined elsewhere: not registering the stand-in", op.qualname)
            continue
        lib = _LIBRARIES.setdefault(op.namespace, torch.library.Library(op.namespace, "FRAGMENT"))
        lib.define(op.schema)
        # CompositeExplicitAutograd: one Python kernel serves every device (CPU here).
        lib.impl(op.name, op.kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(op.qualname, op.fake, lib=lib)
        if getattr(getattr(torch.ops, op.namespace), op.name).default._schema.is_mutable:  # noqa: SLF001
            # an in-place twin (scatter_update_): torch registers no autograd formula for a
            # mutating op, and torch_npu has no backward for these (only torchair's
            # re-inplacing passes emit them, in inference graphs)
            if op.backward is not None:
                raise ValueError(f"{op.qualname} mutates its input: it cannot have a backward")
            _REGISTERED.append(op.qualname)
            continue
        backward, setup_context = op.backward, op.setup_context
        if op.missing_backward is not None:
            backward, setup_context = _missing_backward(op), _save_nothing
        elif backward is None:  # fail loudly, as a missing NPU backward would, never drop grads
            backward, setup_context = _no_backward(op.qualname, op.python_autograd), _save_nothing
        # an op that mutates its input (Tensor(a!) ... -> ()) cannot carry an autograd formula
        # (torch.library refuses it); it is called on tensors that need no grad, or through
        # the extension's / our own autograd.Function
        if getattr(getattr(torch.ops, op.namespace), op.name).default._schema.is_mutable:  # noqa: SLF001
            _REGISTERED.append(op.qualname)
            continue
        _register_autograd(lib, op, backward, setup_context)
        _REGISTERED.append(op.qualname)
    log.info("registered CPU stand-ins: %s", ", ".join(_REGISTERED))
    return tuple(_REGISTERED)


def stand_in_differentiable(qualname: str) -> Optional[bool]:
    """Whether the stand-in of `qualname` implements its backward (None: no stand-in).

    A stand-in without one, or whose backward op has no stand-in yet, raises when
    differentiated."""
    op = all_specs().get(qualname)
    if op is None:
        return None
    return op.backward is not None and op.missing_backward is None


def registered_stand_ins() -> tuple[str, ...]:
    return tuple(_REGISTERED)
