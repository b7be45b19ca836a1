"""The target ops: torch_npu's fused ops, or CPU stand-ins with the same schemas.

On an Ascend machine `torch.ops.npu.*` comes from torch_npu and nothing here is
registered. Everywhere else `ensure_registered()` defines a stand-in `npu` library (and
`cann_ops_transformer` / `cann_ops_nn` ones, unless those packages are installed): the exact
torch_npu schema, a CPU reference kernel that computes what the NPU kernel computes
(precision and rounding points included), a fake kernel giving the shapes, dtypes and strides
an NPU compile's fake tensors have, and autograd where torch_npu defines a backward.
Registration is lazy: importing npu_fx_fusion registers nothing.

Each op is one spec (spec.py): `@op_spec(...)` on its reference kernel, in the module of its
family (norm.py, rope.py, moe.py, ...), holds its schema, fake kernel, autograd, capability
(dtypes, ranks, SoC limits, GE converter, tolerance: what capabilities.py answers from) and
opcheck samples. Adding an op is one such spec, in a family module or a new one (every public
module of this package is read); tests/test_op_specs.py then checks it (opcheck in every dtype
and input layout, its fake against torch_npu's Meta) and fails for an op without samples.
"""
from ._library import (ensure_registered, real_torch_npu_available, registered_stand_ins,
                       stand_in_differentiable)
from .spec import (FLOAT_DTYPES, HALF_DTYPES, LAYOUTS, OPCHECK_TESTS, SOCS, OpCapability, OpSpec, Sample, SocLimits,
                   all_specs, documented_op, documented_ops, in_layout_of, only_on_socs, op_spec, randn, spec_of)

__all__ = ["ensure_registered", "real_torch_npu_available", "registered_stand_ins",
           "stand_in_differentiable", "FLOAT_DTYPES", "HALF_DTYPES", "LAYOUTS", "OPCHECK_TESTS", "SOCS", "OpCapability",
           "OpSpec", "Sample", "SocLimits", "all_specs", "documented_op", "documented_ops", "in_layout_of",
           "only_on_socs", "op_spec", "randn", "spec_of"]
