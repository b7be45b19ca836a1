"""Kernel launches per decoder layer of transformers' continuous-batching decode, unfused and
fused, from the report's cost estimate: (launches at 4 layers - at 2 layers) / 2.

The decode step is transformers' own (ContinuousBatchingManager, PagedAttentionCache 5.24)
on CPU with the cache update traced into the graph (tests/paged_modules.py): its decode
fast path (block table) with the attention in plain PyTorch, and its varlen path as
shipped (SDPA over keys gathered at host-computed read indices). Per layer it also lists
the ops the fused graph still launches.

    .venv/bin/python benchmarks/paged_decode_launches.py [--kinds llama qwen3] [--steps 2]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch  # noqa: E402

import npu_fx_fusion as nff  # noqa: E402
from npu_fx_fusion.backend import EmulationBackend  # noqa: E402
from npu_fx_fusion.report import op_counts  # noqa: E402
from paged_modules import cb_model, cb_step, traced_continuous_batching  # noqa: E402


class _LastGraph(EmulationBackend):
    def _compile(self, phase, gm, example_inputs):
        compiled = super()._compile(phase, gm, example_inputs)
        self.last = gm
        return compiled


def measure(kind, layers, fast_path, steps):
    """(launches before, launches after, op counts after) of the last decode graph."""
    torch._dynamo.reset()
    model, backend = cb_model(kind, layers), _LastGraph(nff.FusionConfig())
    compiled = torch.compile(model, backend=backend)
    with traced_continuous_batching(fast_path) as batching, torch.no_grad():
        processor = batching.processor(model)
        cb_step(processor, model)  # the prefill, eager
        for _ in range(steps):
            _, took_table = cb_step(processor, compiled)
            assert took_table == fast_path
    graph = backend.report.graphs[-1]
    return graph.cost_before.launches, graph.cost_after.launches, op_counts(backend.last.graph)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["llama", "qwen3"])
    parser.add_argument("--steps", type=int, default=2, help="decode steps (the last one's graph is measured)")
    args = parser.parse_args()
    print("| model | decode path | launches / layer unfused | fused |")
    print("|---|---|---|---|")
    details = []
    for kind in args.kinds:
        for fast_path in (True, False):
            small, large = (measure(kind, layers, fast_path, args.steps) for layers in (2, 4))
            before, after = (large[0] - small[0]) / 2, (large[1] - small[1]) / 2
            path = "fast path (block table)" if fast_path else "varlen (read_index)"
            print(f"| {kind} | {path} | {before:g} | {after:g} |", flush=True)
            per_layer = collections.Counter({op: (large[2][op] - small[2].get(op, 0)) / 2 for op in large[2]})
            details.append((kind, path, {op: n for op, n in per_layer.items() if n}))
    for kind, path, ops in details:
        print(f"\n{kind}, {path}: per layer after fusion")
        for op, count in sorted(ops.items(), key=lambda item: -item[1]):
            print(f"  {count:g} x {op}")


if __name__ == "__main__":
    main()
