"""One place per NPU op: its schema, kernels, autograd, capability, tolerance and opcheck inputs.

An op is declared once, with `@op_spec(...)` on its CPU reference kernel, in the module of
its family (norm.py, moe.py, ...):

    @op_spec("npu::npu_rms_norm",
             schema="npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
             fake=_rms_norm_fake, backward=_rms_norm_backward, setup_context=_rms_norm_setup_context,
             capability=OpCapability(dtypes=FLOAT_DTYPES, min_rank=1, max_rank=8, ...),
             samples=_rms_norm_samples)
    def npu_rms_norm(self, gamma, epsilon=1e-6):
        ...

Everything else is derived from the spec: the stand-in library (`ensure_registered`), the
schemas the wheel is checked against (tests/test_schemas.py), the capability table the
passes ask (`capabilities.CAPABILITIES`, with each op's SoC limits, GE converter and
`verify_ulps` tolerance), and the op-level tests (tests/test_op_specs.py: `torch.library.opcheck`
over every spec's samples, in every dtype its capability lists and in the input layouts it
accepts, and each fake against torch_npu's own Meta function). A new op is one spec in a family
module (a new module of this package is found without being listed) and nothing else in the
engine changes; an op without samples fails the tests.

Schemas are copied character for character: torch_npu's from the wheel's
torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml (compared with it by the tests); the
extension packages' from their OpBuilder.schema(): cann_ops_transformer's from
torch_extension/cann_ops_transformer/ops/*.py of mirror-cann/ops-transformer at 3a280bc
(2026-07-21), spaces and their absence included; cann_ops_nn's from hicann/ops-nn
activation/swiglu_group/torch_extension/swiglu_group.py (3caf360) and
torch_extension/cann_ops_nn/ops/activation/swiglu_group_backward/swiglu_group_backward.py
(0188283, the revision whose clamp_limit defaults to 0.0, "no clamp", with a (.., 1) weight).
Those are compared with the installed package where there is one.

Fakes give what the NPU compile's fake tensors are: the wheel's Meta function where it has a
Python one (torch_npu/op_plugin/meta/_meta_registrations.py), else how op-plugin allocates the
outputs in C++ (named in a comment at the fake), or the extension's register_meta. Most
allocate contiguous outputs (torch.empty, new_empty, apply_tensor_without_format); an
empty_like(input) keeps a transposed or channels-last input's strides. The reference kernel
returns exactly those strides (`in_layout_of`, `.contiguous()`): a compile plans views from
the fake's strides, and a kernel that returns others fails the compiled graph at run time.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# SoC names as torch_npu's get_soc_version / the docs name the product lines.
SOCS: tuple[str, ...] = (
    "Ascend910B",  # Atlas A2 training / 800I A2 inference
    "Ascend910_93",  # Atlas A3
    "Ascend310P",  # Atlas inference series ("310P-class")
    "Ascend950",  # arch35
)

# torch_npu's `int? ..._dtype` arguments (output_dtype, dst_type, y_dtype ...) take c10's
# ScalarType enum values (the wheel's op_plugin/meta/_meta_registrations.py TORCH_DTYPE_MAP)
SCALAR_TYPE_ENUM = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
                    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}


def dtype_argument(dtype: torch.dtype) -> int:
    """The int a torch_npu op's dtype argument takes for `dtype`."""
    return SCALAR_TYPE_ENUM[dtype]


def dtype_of_argument(value: int) -> torch.dtype:
    """The dtype an int dtype argument of a torch_npu op names."""
    return next(dtype for dtype, enum in SCALAR_TYPE_ENUM.items() if enum == value)


@dataclass(frozen=True)
class SocLimits:
    """Restrictions one SoC adds on top of an op's general limits."""

    supported: bool = True
    dtypes: Optional[frozenset] = None  # None: the op's general dtypes
    mixed_gamma: bool = True  # fp32 gamma with an fp16/bf16 input


def only_on_socs(*socs: str) -> dict[str, SocLimits]:
    """The `socs` of a capability whose op runs on `socs` only (every other SoC unsupported)."""
    unknown = set(socs) - set(SOCS)
    if unknown:
        raise ValueError(f"unknown SoC {sorted(unknown)}; known: {', '.join(SOCS)}")
    return {soc: SocLimits(supported=False) for soc in SOCS if soc not in socs}


@dataclass(frozen=True)
class OpCapability:
    """What the hardware accepts for an op a pass emits (read through capabilities.py)."""

    dtypes: frozenset
    min_rank: int
    max_rank: int
    backward: Optional[str]  # the op torch_npu differentiates it with, None: inference only
    # torchair 2.13 registers a GE converter for it (register_fx_node_ge_converter), so
    # max-autotune can lower it; tests/test_capabilities.py checks this against the wheel
    ge_converter: bool
    socs: Mapping[str, SocLimits] = field(default_factory=dict)
    same_shape: tuple[str, ...] = ()  # tensor arguments that must have one shape and dtype
    # op-specific numeric limits read by the pattern's check ("max_head_dim": 896, ...)
    limits: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""
    # FusionConfig(verify=True): the error a site may show against the code it replaces, in
    # ulps of the output dtype at the output's scale. The fused ops round once where the
    # unfused code rounds after each op: measured bounds (tests/test_<pass>.py) are 1-2 ulp,
    # and the default leaves headroom for inputs that are random, not model activations.
    verify_ulps: float = 4
    # FusionConfig(verify=True), integer outputs: how many units a value may differ by (0: equal).
    # A quantization the op computes in fp32 where the code rounds first lands one unit off
    # where that rounding crosses a .5
    verify_integer_steps: int = 0
    # torch_npu has no backward for it (`backward` None), but our code differentiates it: the
    # torch.autograd.Function ("module.Class") that the passes emitting the op in training
    # graphs call, whose backward is made of ops that need no autograd themselves
    autograd_rule: Optional[str] = None
    # nothing flows back through it: the passes use only integer outputs of it (top-k indices,
    # tiling metadata), so a training graph may emit it although nothing differentiates it
    gradient_free: bool = False
    # "npu.npu_rms_norm": filled in from the spec that holds the capability
    op: str = ""


# The input layouts opcheck tries, each derived from a sample's contiguous tensors (same
# shape, other strides): see tests/test_op_specs.py.
#   transposed     the strides of a transpose of the last two dims (4-D: of dims 1 and 2, the
#                  BSND <-> BNSD permute attention code does), values unchanged
#   expanded       a stride-0 dim (the tensor repeated along its first dim of size > 1)
#   sliced         a view into a wider buffer (the last dim padded), like a split of a fused
#                  projection
#   channels_last  4-D tensors in channels-last memory format
LAYOUTS = ("contiguous", "transposed", "expanded", "sliced", "channels_last")
# The checks torch.library.opcheck runs (its default test_utils)
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")


@dataclass(frozen=True)
class Sample:
    """One call of an op for opcheck: contiguous inputs the kernel accepts.

    `layout_args`: the tensor arguments (positional indices or keyword names) whose layout
    opcheck varies; None means every floating-point tensor argument. Integer tensors (indices,
    lengths) keep theirs: their values, not their strides, are the point.
    `grad_args`: for an op with a backward, the arguments that require grad in the run that
    checks it (opcheck then traces the backward too); None: this sample checks the forward only.
    """

    args: tuple
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    layout_args: Optional[tuple] = None
    grad_args: Optional[tuple] = None
    note: str = ""


@dataclass(frozen=True)
class OpSpec:
    qualname: str  # "npu::npu_rms_norm"
    schema: str  # torch_npu's schema string, character for character (tests/test_schemas.py)
    kernel: Callable  # the CPU reference kernel: what the NPU kernel computes, its rounding included
    fake: Callable  # shapes, dtypes and strides of the real kernel's outputs
    backward: Optional[Callable] = None
    setup_context: Optional[Callable] = None
    # torch_npu differentiates the op with this op, which has no stand-in yet: backward
    # raises NotImplementedError naming both instead of differentiating or dropping grads
    missing_backward: Optional[str] = None
    # keyword-only tensor arguments torch_npu differentiates (npu_sparse_flash_attention's
    # query_rope / key_rope): autograd tracks them too, and `backward` returns their
    # gradients after the positional ones, in this order
    differentiable_kwargs: tuple[str, ...] = ()
    # The extension packages (cann_ops_transformer, cann_ops_nn) differentiate their ops with a
    # Python torch.autograd.Function in their public wrapper, not at the dispatcher: the raw op
    # has no autograd. This names that Function, for the error a backward through the raw op raises.
    python_autograd: Optional[str] = None
    # the hardware facts of an op a pass emits (None: an op only called by other ops'
    # kernels or autograd, or by the NPU dispatch emulation)
    capability: Optional[OpCapability] = None
    # opcheck inputs: samples(dtype) -> contiguous calls of the op (Sample)
    samples: Optional[Callable[..., Iterable[Sample]]] = None
    # the dtypes opcheck runs the samples in (default: the capability's dtypes, else fp32)
    sample_dtypes: Optional[frozenset] = None
    # the input layouts the op accepts (LAYOUTS); the NPU kernel's documented requirements:
    # contiguous only when its capability's limits say "contiguous", else every layout
    layouts: tuple[str, ...] = LAYOUTS
    # opcheck test (OPCHECK_TESTS) -> why this op cannot pass it; only that check is skipped
    opcheck_skips: Mapping[str, str] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return self.qualname.split("::")[0]

    @property
    def name(self) -> str:
        return self.qualname.split("::")[1]

    @property
    def dotted(self) -> str:
        """The name the capability table and the patterns use: "npu.npu_rms_norm"."""
        return self.qualname.replace("::", ".", 1)

    @property
    def opcheck_dtypes(self) -> frozenset:
        if self.sample_dtypes is not None:
            return self.sample_dtypes
        return self.capability.dtypes if self.capability is not None else frozenset({torch.float32})


_SPECS: dict[str, OpSpec] = {}


def op_spec(qualname: str, *, schema: str, fake: Callable, backward: Optional[Callable] = None,
            setup_context: Optional[Callable] = None, missing_backward: Optional[str] = None,
            differentiable_kwargs: tuple[str, ...] = (), python_autograd: Optional[str] = None,
            capability: Optional[OpCapability] = None, samples: Optional[Callable[..., Iterable[Sample]]] = None,
            sample_dtypes: Optional[Iterable[torch.dtype]] = None, layouts: Optional[Iterable[str]] = None,
            opcheck_skips: Optional[Mapping[str, str]] = None) -> Callable[[Callable], Callable]:
    """Declare `namespace::op` once, on its CPU reference kernel (see the module docstring)."""
    namespace, _, name = qualname.partition("::")
    if not namespace or not name or schema.split("(", 1)[0] != name:
        raise ValueError(f"op_spec({qualname!r}): the qualname is namespace::op and the schema starts with op(")
    if (backward is None) != (setup_context is None):
        raise ValueError(f"{qualname}: backward and setup_context go together")
    if missing_backward is not None and backward is not None:
        raise ValueError(f"{qualname}: a backward and a missing_backward exclude each other")
    if differentiable_kwargs and backward is None:
        raise ValueError(f"{qualname}: differentiable_kwargs need a backward")
    if layouts is None:
        layouts = ("contiguous",) if capability is not None and capability.limits.get("contiguous") else LAYOUTS
    unknown = set(layouts) - set(LAYOUTS)
    if unknown or "contiguous" not in layouts:
        raise ValueError(f"{qualname}: layouts must include 'contiguous' and be among {LAYOUTS}, got {sorted(unknown)}")
    skips = dict(opcheck_skips or {})
    if set(skips) - set(OPCHECK_TESTS):
        raise ValueError(f"{qualname}: opcheck_skips names {sorted(set(skips) - set(OPCHECK_TESTS))}, "
                         f"not among {OPCHECK_TESTS}")

    def declare(kernel: Callable) -> Callable:
        if qualname in _SPECS:
            raise ValueError(f"{qualname} is declared twice")
        spec = OpSpec(qualname, schema, kernel, fake, backward, setup_context, missing_backward,
                      tuple(differentiable_kwargs), python_autograd,
                      None if capability is None else replace(capability, op=f"{namespace}.{name}"),
                      samples, None if sample_dtypes is None else frozenset(sample_dtypes), tuple(layouts), skips)
        _SPECS[qualname] = spec
        return kernel

    return declare


_DOCUMENTED: dict[str, OpCapability] = {}


def documented_op(qualname: str, capability: OpCapability) -> None:
    """Declare the documented limits of an op that no pass emits and no stand-in computes (a
    near miss quotes them: capabilities.NOT_EMITTED). An op with a stand-in is an `op_spec`."""
    namespace, _, name = qualname.partition("::")
    if not namespace or not name or qualname in _DOCUMENTED:
        raise ValueError(f"documented_op({qualname!r}): namespace::op, declared once")
    _DOCUMENTED[qualname] = replace(capability, op=f"{namespace}.{name}")


def _family_modules() -> list[str]:
    """Every module of this package that declares ops (all but the private ones and this one)."""
    package = importlib.import_module(__package__)
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__)
                  if not info.name.startswith("_") and info.name != "spec")


def all_specs() -> Mapping[str, OpSpec]:
    """qualname -> OpSpec of every op this package declares (importing a family module
    declares its ops; nothing is registered with torch here)."""
    for module in _family_modules():
        importlib.import_module(f"{__package__}.{module}")
    return dict(_SPECS)


def documented_ops() -> Mapping[str, OpCapability]:
    """qualname -> capability of every op declared with `documented_op` (no stand-in)."""
    all_specs()
    return dict(_DOCUMENTED)


def spec_of(qualname: str) -> Optional[OpSpec]:
    """The spec of `namespace::op` or `namespace.op`, None if no family declares it."""
    return all_specs().get(qualname.replace(".", "::", 1) if "::" not in qualname else qualname)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Seeded normal values of `shape` in `dtype`, for samples (drawn in float64, then rounded)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def in_layout_of(result: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """`result` with the strides `torch.empty_like(template)` has.

    torch_npu's Meta functions allocate most outputs with `torch.empty_like(input)`, which
    keeps a transposed or channels-last input's strides (and is contiguous for an expanded or
    sliced one); a compile plans views from those strides, so a reference kernel returns
    its result in that layout, or the graph it is traced into fails at run time."""
    like = torch.empty_like(template, dtype=result.dtype)
    if like.stride() == result.stride():
        return result
    return like.copy_(result)
