"""Small tensor-parallel modules for the tensor-parallel tests, parallelized by torch's own
torch.distributed.tensor.parallel (parallelize_module with ColwiseParallel, RowwiseParallel,
SequenceParallel), and a one-process capture of their graphs over the fake process group.

    with fake_world(2):
        report, graphs = capture(feed_forward(sequence_parallel=True), x)

The torchtitan models (tiny_models.build_torchtitan_tp) are the third-party code; these are
the smallest code that makes each graph shape, so the tests that pin a limit or a near miss
compile in seconds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import npu_fx_fusion as nff
from helpers import RecordingBackend

TP_PASSES = frozenset({"matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter"})


class MLP(nn.Module):
    """w1 (and w3: a SwiGLU) then w2."""

    def __init__(self, dim, hidden, bias=False, swiglu=False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if swiglu else None

    def forward(self, h):
        a = F.silu(self.w1(h))
        return self.w2(a * self.w3(h) if self.w3 is not None else a)


class FeedForward(nn.Module):
    """A residual MLP block: norm, MLP, residual (torchtitan's feed-forward half of a layer)."""

    def __init__(self, dim, hidden, bias=False, swiglu=False):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, hidden, bias=bias, swiglu=swiglu)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def feed_forward(*, sequence_parallel=False, dim=256, hidden=1024, dtype=torch.bfloat16, bias=False, swiglu=False,
                 seed=0):
    """FeedForward tensor-parallel over every rank of the default group as torchtitan plans it:
    w1 (and w3) ColwiseParallel, w2 RowwiseParallel; with sequence_parallel the norm is
    SequenceParallel (sequence-sharded), the MLP's input gathered once (PrepareModuleInput:
    Shard(1) -> Replicate, an all-gather w1 and w3 both read) and w2 reduce-scatters its output
    (Shard(1)): the block then takes and returns each rank's slice of the sequence, a plain tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = FeedForward(dim, hidden, bias=bias, swiglu=swiglu).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    projections = ("mlp.w1", "mlp.w3") if swiglu else ("mlp.w1",)
    plan = {name: ColwiseParallel() for name in projections}
    if sequence_parallel:
        plan.update({"norm": SequenceParallel(),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "mlp.w2": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan["mlp.w2"] = RowwiseParallel()
    parallelize_module(module, mesh, plan)
    return module


def capture(module, *inputs, config=None, training=False, dynamic=None):
    """Compile `module` over the current (fake or gloo) world through the emulation backend and
    run it (over the fake backend the collectives' data is meaningless, nothing else is): its
    report and graphs by phase. In training, a backward of the output's sum runs too."""
    torch._dynamo.reset()
    backend = RecordingBackend(config or nff.FusionConfig(enable=TP_PASSES))
    compiled = torch.compile(module.train(training), backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.set_grad_enabled(training):
        out = compiled(*inputs)
        if training:
            _local(out).float().sum().backward()
    assert backend.report.errors == [], backend.report.errors
    return backend.report, backend.graphs


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def ops_in(gm, name):
    """The call nodes of `gm` whose target's name starts with `name`."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(name)]


class Gathered(nn.Module):
    """The collectives spelled out, as funcol writes them into a graph: rows all-gathered on dim
    0 then multiplied (`gather`), or multiplied then reduce-scattered on dim 0 (`scatter`), over
    the group named `group_name` (a 2-D activation: tokens flattened)."""

    def __init__(self, weight, group_name, ranks, kind):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.group_name, self.ranks, self.kind = group_name, ranks, kind

    def forward(self, x):
        c10d = torch.ops._c10d_functional
        if self.kind == "gather":
            gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, self.ranks, self.group_name))
            return gathered @ self.weight.t()
        y = x @ self.weight.t()
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", self.ranks, self.group_name))


def default_group_name():
    return torch.distributed.distributed_c10d._get_default_group().group_name
