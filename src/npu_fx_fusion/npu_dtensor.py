"""torch_npu's DTensor sharding rule for aten.matmul_backward, while an NPU trace is emulated.

On an NPU a matmul's backward is one op, aten.matmul_backward (torch_npu's kernel at
PrivateUse1, npu_dispatch.py), and a tensor-parallel model's DTensors reach it in a training
step. DTensor has no sharding rule for it; torch_npu registers one
(torch_npu/distributed/tensor/_matrix_ops.py, custom_matmul_backward_strategy, unless
TORCH_NPU_USE_COMPATIBLE_IMPL=1). The emulation reproduces the rule for the case a linear
layer makes, an N-D input times a 2-D weight (its second branch), so that a tensor-parallel
training step traces on CPU as on an NPU:

    grad R,        input S(-1), weight S(0)  -> grad_input S(-1), grad_weight S(0)   (row-parallel)
    grad S(i),     input S(i),  weight R     -> grad_input S(i),  grad_weight P      (i a batch dim)
    grad S(-1),    input R,     weight S(1)  -> grad_input P,     grad_weight S(1)   (column-parallel)

and everything replicated, as torch_npu lists first; other ranks of the inputs get the
replicated strategy only. The rule is registered while `sharding_rules()` is entered and
removed after (DTensor caches its propagation per op: cleared both ways).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

aten = torch.ops.aten


def _matmul_backward_shardings(grad, tensor1, tensor2, mask):
    from torch.distributed.tensor import Partial, Replicate, Shard

    acceptable = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None])]
    dims1, dims2, grad_dims = len(tensor1.shape), len(tensor2.shape), len(grad.shape)
    if dims1 < 2 or dims2 != 2:
        return acceptable
    ranks = tensor2.mesh.size(0)
    if tensor2.shape[0] % ranks == 0:
        acceptable.append(([Shard(dims1 - 1), Shard(0)], [Replicate(), Shard(dims1 - 1), Shard(0), None]))
    for dim in range(dims1 - 1):
        if tensor1.shape[dim] % ranks == 0:
            acceptable.append(([Shard(dim), Partial()], [Shard(dim), Shard(dim), Replicate(), None]))
    if tensor2.shape[1] % ranks == 0:
        acceptable.append(([Partial(), Shard(1)], [Shard(grad_dims - 1), Replicate(), Shard(1), None]))
    return acceptable


@contextlib.contextmanager
def sharding_rules() -> Iterator[None]:
    """torch_npu's DTensor rule for aten.matmul_backward, registered inside this block (where
    DTensor is in use: its module imported, as a model with DTensors has; and no rule is
    registered already: torch_npu's own)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can reach the trace
        yield
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import register_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001
    op = aten.matmul_backward.default
    if op in propagator.op_strategy_funcs:
        yield
        return
    register_sharding(op)(_matmul_backward_shardings)
    propagator.propagate_op_sharding.cache_clear()
    try:
        yield
    finally:
        propagator.op_strategy_funcs.pop(op, None)
        propagator.op_to_schema_info.pop(op, None)
        propagator.propagate_op_sharding.cache_clear()
