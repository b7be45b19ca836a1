"""The target ops: torch_npu's fused ops, or CPU stand-ins with the same schemas.

On an Ascend machine `torch.ops.npu.*` comes from torch_npu and nothing here is
registered. Everywhere else `ensure_registered()` defines a stand-in `npu` library (and a
`cann_ops_transformer` one, unless that package is installed): the
exact torch_npu schema (schemas.py), a CPU reference kernel that computes what the NPU
kernel computes (precision and rounding points included), a fake kernel for tracing, and
autograd where torch_npu defines a backward. Registration is lazy: importing
npu_fx_fusion registers nothing.

Adding an op: put its schema in schemas.py and its kernels in the module of its family
(norm.py, ...) with the `stand_in` decorators; list the module in _FAMILY_MODULES.
"""
from ._library import (ensure_registered, real_torch_npu_available, registered_stand_ins,
                       stand_in_differentiable)

__all__ = ["ensure_registered", "real_torch_npu_available", "registered_stand_ins",
           "stand_in_differentiable"]
