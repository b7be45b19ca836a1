"""Every op the library declares keeps its contract, from its spec (npu_ops/spec.py).

torch.library.opcheck runs over each spec's samples: schema, fake tensor (the fake kernel's
shapes, dtypes and strides against the real kernel's), autograd registration and aot
dispatch, static and dynamic. Every dtype the op's capability lists is run contiguous; every
input layout the op accepts (transposed, expanded, sliced, channels-last) is run in the
op's first dtype, because a fake kernel that promises other strides than the kernel returns
is what crashes a training step (autograd plans a `view` from the fake strides). A check an
op cannot pass is listed in its spec's `opcheck_skips`, with the reason, and skipped for
that op alone.

Time: the two aot_dispatch checks trace the op (and its backward, for samples that require
grad) through aot_autograd, a second or more per sample where the other checks take
milliseconds. They run once per op, on its first dtype with contiguous inputs; the other
dtypes and the other layouts run test_schema, test_autograd_registration and
test_faketensor, which is where a stride or dtype break shows (the fake's metadata against
the kernel's). Measured on 2 cores shared with other jobs (load 12): about 1 minute of CPU
and 4 of wall time in that shape, against 14 minutes of wall time with every check on every
case.

test_fake_is_the_wheels_meta compares each npu op's fake with torch_npu's own Meta function
(the fake tensors of an NPU compile) where the wheel has a Python one.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from npu_fx_fusion.npu_ops import LAYOUTS, OPCHECK_TESTS, all_specs, ensure_registered, real_torch_npu_available
from torchair_harness.runner import torch_npu_dir_or_skip
from torchair_harness.wheel_meta import wheel_meta_functions

SPECS = all_specs()


def relayout(t: torch.Tensor, layout: str):
    """`t`'s values with the strides of `layout`, or None where the layout does not apply."""
    if layout == "contiguous":
        return t
    if layout == "transposed":
        if t.dim() < 2:
            return None
        a, b = (1, 2) if t.dim() == 4 else (-2, -1)
        if t.shape[a] == 1 or t.shape[b] == 1:
            return None  # a transpose of a size-1 dim leaves the layout contiguous
        return t.transpose(a, b).contiguous().transpose(a, b)
    if layout == "expanded":
        dim = next((d for d in range(t.dim()) if t.shape[d] > 1), None)
        if dim is None:
            return None
        return t.narrow(dim, 0, 1).expand(t.shape)  # a stride-0 dim: the first slice repeated
    if layout == "sliced":
        if t.dim() < 1 or t.shape[-1] == 0:
            return None
        wide = t.new_zeros((*t.shape[:-1], t.shape[-1] + 3))
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    if layout == "channels_last":
        if t.dim() != 4 or t.shape[1] == 1:
            return None
        return t.contiguous(memory_format=torch.channels_last)
    raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")


def _selected(sample, key, value) -> bool:
    if sample.layout_args is not None:
        return key in sample.layout_args
    return value.is_floating_point()


def _laid_out(sample, layout):
    """The sample's arguments with `layout` applied, or None if it changed no tensor (a
    `Tensor[]` argument's tensors are laid out one by one)."""
    changed = False

    def apply_one(key, value):
        nonlocal changed
        if not isinstance(value, torch.Tensor) or not _selected(sample, key, value):
            return value
        new = relayout(value, layout)
        if new is None or new.stride() == value.stride():
            return value
        changed = True
        return new

    def apply(key, value):
        if isinstance(value, (list, tuple)):
            return type(value)(apply_one(key, v) for v in value)
        return apply_one(key, value)

    args = tuple(apply(i, a) for i, a in enumerate(sample.args))
    kwargs = {k: apply(k, v) for k, v in sample.kwargs.items()}
    return (args, kwargs) if changed or layout == "contiguous" else None


def _with_grads(sample, args, kwargs):
    def needs(key):
        return sample.grad_args is not None and key in sample.grad_args

    def leaf(key, value):
        if not needs(key):
            return value
        return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(), value)

    return tuple(leaf(i, a) for i, a in enumerate(args)), {k: leaf(k, v) for k, v in kwargs.items()}


# the checks every case runs; the aot_dispatch ones run on each op's first case only (module docstring)
CHEAP_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _first_dtype(spec):
    return sorted(spec.opcheck_dtypes, key=str)[0]


def _cases():
    for qualname, spec in sorted(SPECS.items()):
        if spec.samples is None:
            continue
        dtypes = sorted(spec.opcheck_dtypes, key=str)  # dtypes[0] == _first_dtype(spec)
        for dtype in dtypes:
            yield pytest.param(qualname, dtype, "contiguous", id=f"{qualname}-{str(dtype)[6:]}-contiguous")
        for layout in spec.layouts:
            if layout != "contiguous":
                yield pytest.param(qualname, dtypes[0], layout, id=f"{qualname}-{str(dtypes[0])[6:]}-{layout}")


@pytest.fixture(scope="module", autouse=True)
def _stand_ins():
    if real_torch_npu_available():
        pytest.skip("torch_npu is installed: its own ops are used, there are no stand-ins to check")
    ensure_registered()


@pytest.mark.parametrize("qualname, dtype, layout", list(_cases()))
def test_opcheck(qualname, dtype, layout):
    spec = SPECS[qualname]
    op = getattr(getattr(torch.ops, spec.namespace), spec.name).default
    full = dtype == _first_dtype(spec) and layout == "contiguous"
    tests = [name for name in (OPCHECK_TESTS if full else CHEAP_TESTS) if name not in spec.opcheck_skips]
    if not tests:
        pytest.skip(f"{qualname} passes no check: {'; '.join(sorted(set(spec.opcheck_skips.values())))}")
    checked = 0
    for sample in spec.samples(dtype):
        laid_out = _laid_out(sample, layout)
        if laid_out is None:
            continue
        args, kwargs = _with_grads(sample, *laid_out)
        torch.library.opcheck(op, args, kwargs, test_utils=tests)
        checked += 1
    if checked == 0:
        pytest.skip(f"no sample of {qualname} has an input the {layout} layout applies to")


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of t's shape, dtype and strides (a sliced or expanded view's too)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _signature(outputs):
    """(shape, dtype, strides) of each output; an int or None as itself."""
    flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [(tuple(o.shape), o.dtype, tuple(o.stride())) if isinstance(o, torch.Tensor) else o for o in flat]


def _agree(ours, wheels) -> bool:
    # A None in the Meta's outputs claims nothing: torch_npu returns None for an absent optional
    # output, which a registered op cannot return for a `Tensor` of its schema (the stand-ins
    # return an empty (0,) tensor there), and for the plain FlashAttention grad's dpse even with
    # a pse (its kernel returns pse's shape, which the stand-in follows)
    return len(ours) == len(wheels) and all(w is None or w == o for o, w in zip(ours, wheels))


def _meta_cases():
    for qualname, spec in sorted(SPECS.items()):
        if spec.namespace == "npu" and spec.samples is not None:
            for layout in spec.layouts:
                yield pytest.param(qualname, layout, id=f"{qualname}-{layout}")


@pytest.mark.parametrize("qualname, layout", list(_meta_cases()))
def test_fake_is_the_wheels_meta(qualname, layout):
    """On an NPU a compile traces with torch_npu's Meta functions: where the wheel has a Python
    one, our fake gives the same shapes, dtypes and strides, on every sample and input layout
    (the kernel then returns those strides: test_opcheck)."""
    meta = wheel_meta_functions(torch_npu_dir_or_skip()).get(SPECS[qualname].name)
    if meta is None:
        pytest.skip(f"{qualname} has no Python Meta function in the wheel (its fake is allocated in C++)")
    spec = SPECS[qualname]
    op = getattr(getattr(torch.ops, spec.namespace), spec.name).default
    checked = 0
    for sample in spec.samples(_first_dtype(spec)):
        laid_out = _laid_out(sample, layout)
        if laid_out is None:
            continue
        args, kwargs = laid_out
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            ours = _signature(op(*tree_map_only(torch.Tensor, mode.from_tensor, args),
                                 **tree_map_only(torch.Tensor, mode.from_tensor, kwargs)))
        wheels = _signature(meta(*tree_map_only(torch.Tensor, _meta_copy, args),
                                 **tree_map_only(torch.Tensor, _meta_copy, kwargs)))
        assert _agree(ours, wheels), f"{qualname} ({layout}): ours {ours}, the wheel's Meta {wheels}"
        checked += 1
    if checked == 0:
        pytest.skip(f"no sample of {qualname} has an input the {layout} layout applies to")


def test_every_declared_op_has_samples():
    # a new op is one spec, and its spec says how to call it: opcheck runs on every op
    missing = sorted(qualname for qualname, spec in SPECS.items() if spec.samples is None)
    assert not missing, f"these ops declare no samples (op_spec(..., samples=...)), so opcheck cannot run: {missing}"
    for qualname, spec in SPECS.items():
        for dtype in spec.opcheck_dtypes:
            assert list(spec.samples(dtype)), f"{qualname}: samples({dtype}) yields no call"


def test_relayout_keeps_values_and_changes_strides():
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    for layout in LAYOUTS[1:]:
        new = relayout(t, layout)
        assert new.shape == t.shape and new.stride() != t.stride(), layout
        if layout != "expanded":  # the expanded layout repeats one slice by design
            assert torch.equal(new, t), layout
    assert relayout(torch.ones(3), "transposed") is None
    assert relayout(torch.ones(2, 3), "channels_last") is None


def test_opcheck_catches_a_fake_that_promises_other_strides():
    # the harness itself: a fake kernel returning contiguous strides for a kernel that returns
    # its transposed input's strides is what opcheck's fake-tensor check must refuse
    lib = torch.library.Library("nff_test_op_specs", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")  # x * 2 keeps x's strides
    torch.library.register_fake("nff_test_op_specs::twice", lambda x: x.new_empty(x.shape), lib=lib)
    x = relayout(torch.randn(2, 3, 4, 5), "transposed")
    with pytest.raises(Exception, match="Stride mismatch"):
        torch.library.opcheck(torch.ops.nff_test_op_specs.twice.default, (x,), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.nff_test_op_specs.twice.default, (x.contiguous(),),
                          test_utils=("test_faketensor",))
