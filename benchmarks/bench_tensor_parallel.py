"""Tensor parallel on gloo ranks: sites fused / present, launches per layer, fused vs eager (a
benchmark, not a test).

For torchtitan's llama3 and qwen3 debugmodels parallelized by torchtitan's own
parallelize_llama / parallelize_qwen3 (tiny_models.build_torchtitan_tp, FSDP left out), TP or
TP+SP, fp32 or bf16, inference or one training step, on WORLD gloo processes
(tests/gloo_ranks.py, loopback only), each rank compiles the model with the tensor-parallel
passes (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter) and reports:

- sites fused / present: the passes' fused sites, and their candidates (the collectives next to a
  matmul they anchor at: fused sites plus near misses), over every graph of the compile;
- launches per layer, before -> after the passes: the estimated kernel launches
  (report.GraphCost: every computing call node, a collective and its wait_tensor included) of
  the model with 2 layers minus the model with 1, inference graph or forward + backward;
- the largest |fused - eager| over the output (and in training every parameter's gradient).

Every rank must report the same sites and launches (asserted); rank 0's are printed.
docs/tensor-parallel.md quotes these numbers.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [WORLD ...]   # WORLD: 2 (default), 4
"""
import os
import sys

# the multi-process harness and the test helpers live with the tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch  # noqa: E402
from gloo_ranks import run_on_ranks  # noqa: E402

TP_PASSES = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter")


def _compile_and_run(name, sequence_parallel, dtype, training, layers, compare):
    import npu_fx_fusion as nff
    from helpers import RecordingBackend
    from npu_fx_fusion.tiny_models import build_torchtitan_tp

    torch._dynamo.reset()
    tm = build_torchtitan_tp(name, sequence_parallel=sequence_parallel, dtype=dtype, num_layers=layers)
    model = tm.model.train(training)
    backend = RecordingBackend(nff.FusionConfig(enable=set(TP_PASSES)))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    outputs = []
    for module in (model, compiled) if compare else (compiled,):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(training):
            out = module(*tm.example_inputs)
            out = out.to_local() if hasattr(out, "to_local") else out
            if training:
                out.float().pow(2).mean().backward()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in model.parameters() if p.grad is not None]
        outputs.append([out.detach(), *[g.clone() for g in grads]])
    report = backend.report
    graphs = [g for g in report.graphs if g.name != "joint"]
    launches = (sum(g.cost_before.launches for g in graphs), sum(g.cost_after.launches for g in graphs))
    sites = {p: sum(1 for s in report.sites if s.pass_name == p) for p in TP_PASSES}
    misses = {p: [m.reason for m in report.near_misses if m.pass_name == p] for p in TP_PASSES}
    diff = None
    if compare:
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(*outputs))
    return {"launches": launches, "sites": sites, "misses": misses, "diff": diff, "errors": report.errors}


def worker(rank, world_size, name, sequence_parallel, dtype, training):
    dtype = getattr(torch, dtype)
    one = _compile_and_run(name, sequence_parallel, dtype, training, 1, compare=False)
    two = _compile_and_run(name, sequence_parallel, dtype, training, 2, compare=True)
    per_layer = tuple(b - a for a, b in zip(one["launches"], two["launches"]))
    return {"per_layer": per_layer, "sites": two["sites"], "misses": two["misses"], "diff": two["diff"],
            "errors": one["errors"] + two["errors"]}


def main(worlds):
    for world in worlds:
        for name in ("llama3", "qwen3"):
            for sequence_parallel in (False, True):
                for dtype in ("float32", "bfloat16"):
                    for training in (False, True):
                        results = run_on_ranks(worker, world, name=name, sequence_parallel=sequence_parallel,
                                               dtype=dtype, training=training, timeout=3600)
                        first = results[0]
                        for rank, r in enumerate(results):
                            assert r["errors"] == [], (rank, r["errors"])
                            assert (r["sites"], r["per_layer"]) == (first["sites"], first["per_layer"]), rank
                        fused = sum(first["sites"].values())
                        present = fused + sum(len(m) for m in first["misses"].values())
                        by_pass = ", ".join(f"{p} {first['sites'][p]}/{first['sites'][p] + len(first['misses'][p])}"
                                            for p in TP_PASSES if first['sites'][p] or first['misses'][p])
                        reasons = sorted({m for ms in first["misses"].values() for m in ms})
                        print(f"world={world} {name} {'tp_sp' if sequence_parallel else 'tp'} {dtype} "
                              f"{'train' if training else 'infer'}: sites {fused}/{present} ({by_pass}); launches "
                              f"per layer {first['per_layer'][0]} -> {first['per_layer'][1]}; max |fused - eager| "
                              f"{max(r['diff'] for r in results):.3g}", flush=True)
                        for reason in reasons:
                            print(f"    near miss: {reason[:160]}", flush=True)


if __name__ == "__main__":
    main([int(w) for w in sys.argv[1:]] or [2])
