"""Expert parallel on gloo ranks: fused ops and estimated launches per MoE layer per rank,
and the fused-vs-eager difference in ulp at scale (a benchmark, not a test).

For torchtitan's MoE with expert parallel (tiny_models.build_torchtitan_ep_moe, deepseek_v3
and qwen3 flavors), on WORLD gloo processes (tests/gloo_ranks.py, loopback only), inference
and one training step, each rank prints:

- the estimated kernel launches of every graph it compiled, fusion off -> on
  (report.GraphCost: an estimate from the graph);
- the npu ops in each fused graph (forward, and backward in training);
- the largest fused-vs-eager difference (output, or the input gradient), in ulp of the
  largest eager value; in inference also against the same graph compiled with every pass
  off (at H = 1024 the compile itself differs from eager on a token or two of some ranks,
  with every pass off).

With --mc2, inference at H = 1024 (MC2's smallest hidden size on A3, the SoC that takes 2
ranks), each flavor twice: as before, and with the EP group declared dedicated
(FusionConfig(ep_group=...)), where the layers MC2 takes become npu_moe_distribute_dispatch_v2 /
combine_v2 (the others print their near miss).

docs/expert-parallel.md quotes these numbers.

    .venv/bin/python benchmarks/bench_expert_parallel.py [WORLD] [--mc2]   # WORLD: 2 (default) or 4
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


def worker(rank, world_size, flavor, training, mc2=False, dim=64):
    import npu_fx_fusion as nff
    from helpers import RecordingBackend, npu_ops
    from npu_fx_fusion.tiny_models import build_torchtitan_ep_moe
    from test_expert_parallel import MOE_PASSES, _dynamic_sizes

    torch._dynamo.reset()
    tm = build_torchtitan_ep_moe(flavor, dim=dim)
    model = tm.model.train(training)
    (x,) = tm.example_inputs
    ep_group = {"ep_group": tm.process_groups["ep"]} if mc2 else {}
    backend = RecordingBackend(nff.FusionConfig(enable=MOE_PASSES, **ep_group))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    out = {}
    with _dynamic_sizes():
        if not training:
            with torch.no_grad():
                eager, fused = model(x), compiled(x)
                torch._dynamo.reset()  # the same compile with every pass off
                unfused = torch.compile(model, backend=RecordingBackend(nff.FusionConfig(enable=set())),
                                        fullgraph=True)(x)
            out["ulps"] = ulps_at_scale(fused, eager)
            out["ulps_vs_unfused"] = ulps_at_scale(fused, unfused)
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
    out["mc2_near_misses"] = [m.reason for m in backend.report.near_misses if "MC2" in m.reason]
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--mc2"]
    mc2 = "--mc2" in sys.argv[1:]
    world = int(args[0]) if args else 2
    runs = ([(False, False, 64), (True, False, 64)] if not mc2
            else [(False, False, 1024), (False, True, 1024)])  # (training, declared EP group, H)
    for training, declared, dim in runs:
        for flavor in ("deepseek_v3", "qwen3"):
            results = run_on_ranks(worker, world, flavor=flavor, training=training, mc2=declared, dim=dim)
            for rank, r in enumerate(results):
                print(f"world={world} {flavor} H={dim} {'train' if training else 'infer'}"
                      f"{' ep_group declared' if declared else ''} rank{rank}: "
                      f"launches {r['graphs']} ops {r['ops']} diff {r['ulps']:.2f} ulp"
                      + (f" (vs the unfused compile {r['ulps_vs_unfused']:.2f})" if "ulps_vs_unfused" in r else ""),
                      flush=True)
                for reason in r["mc2_near_misses"] if declared else ():
                    print(f"  near miss: {reason}", flush=True)
