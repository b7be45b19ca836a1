"""Expert parallel on gloo ranks: fused ops and estimated launches per MoE layer per rank,
and the fused-vs-eager difference in ulp at scale (a benchmark, not a test).

For torchtitan's MoE with expert parallel (tiny_models.build_torchtitan_ep_moe, deepseek_v3
and qwen3 flavors), on WORLD gloo processes (tests/gloo_ranks.py, loopback only), inference
and one training step, each rank prints:

- the estimated kernel launches of every graph it compiled, fusion off -> on
  (report.GraphCost: an estimate from the graph);
- the npu ops in each fused graph (forward, and backward in training);
- the largest fused-vs-eager difference (output, or the input gradient), in ulp of the
  largest eager value.

docs/expert-parallel.md quotes these numbers.

    .venv/bin/python benchmarks/bench_expert_parallel.py [WORLD]   # WORLD: 2 (default) or 4
"""
import os
import sys

# the multi-process harness and the test helpers live with the tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks


def ulps_at_scale(actual, expected):
    from helpers import ulp
    scale = expected.abs().max().reshape(1)
    return ((actual.double() - expected.double()).abs().max() / ulp(scale).double()).item()


def worker(rank, world_size, flavor, training):
    import npu_fx_fusion as nff
    from helpers import RecordingBackend, npu_ops
    from npu_fx_fusion.tiny_models import build_torchtitan_ep_moe
    from test_expert_parallel import MOE_PASSES, _dynamic_sizes

    torch._dynamo.reset()
    tm = build_torchtitan_ep_moe(flavor)
    model = tm.model.train(training)
    (x,) = tm.example_inputs
    backend = RecordingBackend(nff.FusionConfig(enable=MOE_PASSES))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out = {}
    with _dynamic_sizes():
        if not training:
            with torch.no_grad():
                eager, fused = model(x), compiled(x)
            out["ulps"] = ulps_at_scale(fused, eager)
        else:
            grads = []
            for module in (model, compiled):
                model.zero_grad(set_to_none=True)
                t = x.detach().clone().requires_grad_(True)
                module(t).float().pow(2).mean().backward()
                grads.append(t.grad)
            out["ulps"] = ulps_at_scale(grads[1], grads[0])
    out["graphs"] = {g.name: (g.cost_before.launches, g.cost_after.launches) for g in backend.report.graphs}
    out["ops"] = {phase: npu_ops(gm) for phase, gm in backend.graphs.items()}
    out["local_tokens"] = int(x.shape[0] * x.shape[1])
    return out


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for training in (False, True):
        for flavor in ("deepseek_v3", "qwen3"):
            results = run_on_ranks(worker, world, flavor=flavor, training=training)
            for rank, r in enumerate(results):
                print(f"world={world} {flavor} {'train' if training else 'infer'} rank{rank}: "
                      f"launches {r['graphs']} ops {r['ops']} diff {r['ulps']:.2f} ulp", flush=True)
