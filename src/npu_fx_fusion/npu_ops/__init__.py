"""The target ops: torch_npu's fused ops, or CPU stand-ins with the same schemas.

On an Ascend machine `torch.ops.npu.*` comes from torch_npu and nothing here is
registered. Everywhere else `ensure_registered()` defines a stand-in `npu` library (and a
`cann_ops_transformer` one, unless that package is installed): the
exact torch_npu schema (schemas.py), a CPU reference kernel that computes what the NPU
kernel computes (precision and rounding points included), a fake kernel for tracing, and
autograd where torch_npu defines a backward. Registration is lazy: importing
npu_fx_fusion registers nothing.

Adding an op: one `@op_spec(...)` on its reference kernel, in the module of its family
(norm.py, ..., or a new module: every public module of this package is read), holding its
schema, fake kernel, autograd, capability and opcheck samples (spec.py says how).
"""
from ._library import (ensure_registered, real_torch_npu_available, registered_stand_ins,
                       stand_in_differentiable)
from .spec import (FLOAT_DTYPES, LAYOUTS, OPCHECK_TESTS, OpCapability, OpSpec, Sample, SocLimits, all_specs,
                   op_spec, spec_of)

__all__ = ["ensure_registered", "real_torch_npu_available", "registered_stand_ins",
           "stand_in_differentiable", "FLOAT_DTYPES", "LAYOUTS", "OPCHECK_TESTS", "OpCapability", "OpSpec",
           "Sample", "SocLimits", "all_specs", "op_spec", "spec_of"]
