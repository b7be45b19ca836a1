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


class FeedForward(nn.Module):
    """An MLP block: norm, w1 (column-parallel), w2 (row-parallel), residual."""

    def __init__(self, dim, hidden, bias=False):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(self.norm(x))))


def feed_forward(*, sequence_parallel=False, dim=256, hidden=1024, dtype=torch.bfloat16, bias=False, seed=0):
    """FeedForward tensor-parallel over every rank of the default group: w1 ColwiseParallel, w2
    RowwiseParallel; with sequence_parallel the norm is SequenceParallel (sequence-sharded),
    w1 gathers the sequence (all-gather) and w2 reduce-scatters it (input and output Shard(1)):
    the block then takes and returns each rank's slice of the sequence, a plain tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = FeedForward(dim, hidden, bias=bias).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if sequence_parallel:
        plan = {"norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
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
