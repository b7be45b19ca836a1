"""Tensor parallel on gloo ranks: sites fused / present, launches per layer, fused vs eager (a
benchmark, not a test).

For torchtitan's llama3 and qwen3 debugmodels parallelized by torchtitan's own
parallelize_llama / parallelize_qwen3 (tiny_models.build_torchtitan_tp, FSDP left out), TP or
TP+SP, fp32 or bf16, inference or one training step, on WORLD gloo processes
(tests/gloo_ranks.py, loopback only), each rank compiles the model with the tensor-parallel
passes (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter) and reports:

- sites fused / present: the passes' fused sites, and their candidates (the collectives next to a
  matmul they anchor at: fused sites plus near misses), over every graph of the compile;
- launches per layer, without -> with the passes: the estimated kernel launches
  (report.GraphCost: every computing call node, a collective and its wait_tensor included; dead
  code left out) of the model with 2 layers minus the model with 1, the inference graph or a
  training step's forward + backward;
- the largest difference over the output (and in training every parameter's gradient) from
  the same compile without the passes (what the fusions change: 0 on gloo) and from eager
  (what compiling changes too: the NPU dispatch emulation's attention kernels round otherwise).

Every rank must report the same sites and launches (asserted); rank 0's are printed.
docs/tensor-parallel.md quotes these numbers.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [WORLD ...]   # WORLD: 2 (default), 4
    .venv/bin/python benchmarks/bench_tensor_parallel.py 4 --model llama3 --dtype bfloat16  # a subset
"""
import argparse
import collections
import os
import sys

# the multi-process harness and the test helpers live with the tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch  # noqa: E402
from gloo_ranks import run_on_ranks  # noqa: E402

TP_PASSES = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter")


def _run(model, module, inputs, training):
    """The output (local shard) and, in training, every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(training):
        out = module(*inputs)
        out = out.to_local() if hasattr(out, "to_local") else out
        if training:
            out.float().pow(2).mean().backward()
    # whole gradients: a compiled step may leave a DTensor gradient in another placement than eager
    # (a collective each rank calls in the same order)
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return {"output": out.detach(), **grads}


def _largest_difference(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _launches(recorded):
    """Estimated launches of a compile's graphs (report.GraphCost), a training step's forward +
    backward (its joint graph is partitioned into those), dead code left out: aot_autograd's
    partitioned backward keeps recomputations nothing reads, which the pipeline removes and any
    graph compiler would. The graphs as the NPU holds them: the emulation retargets the ops CPU
    has no kernel for (aten.matmul_backward) to Python functions for running them, after the
    passes; counted here as the ops they are."""
    import copy

    from npu_fx_fusion.npu_dispatch import CPU_KERNELS
    from npu_fx_fusion.report import GraphCost

    op_of = {kernel: op for op, kernel in CPU_KERNELS.items()}
    total = 0
    for gm in recorded.values():
        graph = copy.deepcopy(gm.graph)
        for node in graph.nodes:
            if node.op == "call_function" and node.target in op_of:
                node.target = op_of[node.target]
        graph.eliminate_dead_code()
        total += GraphCost.of(graph).launches
    return total


def _compile_and_run(name, sequence_parallel, dtype, training, layers, passes):
    """torchtitan's `name` with `layers` layers compiled with `passes` (the tensor-parallel
    ones, or none) and run (a training step: the mean square of the output backward): its
    results (output, every parameter's whole gradient), launches, sites, near misses."""
    import npu_fx_fusion as nff
    from helpers import RecordingBackend
    from npu_fx_fusion.tiny_models import build_torchtitan_tp

    torch._dynamo.reset()
    tm = build_torchtitan_tp(name, sequence_parallel=sequence_parallel, dtype=dtype, num_layers=layers)
    model = tm.model.train(training)
    backend = RecordingBackend(nff.FusionConfig(enable=set(passes)))
    results = _run(model, torch.compile(model, backend=backend, fullgraph=True), tm.example_inputs, training)
    report = backend.report
    return {"results": results, "eager": _run(model, model, tm.example_inputs, training),
            "launches": _launches(backend.graphs),
            "sites": {p: sum(1 for s in report.sites if s.pass_name == p) for p in TP_PASSES},
            "misses": {p: [m.reason for m in report.near_misses if m.pass_name == p] for p in TP_PASSES},
            "errors": report.errors}


def worker(rank, world_size, name, sequence_parallel, dtype, training):
    """Per layer: launches without and with the passes (2 layers minus 1); sites and near misses
    of the 2-layer model; its fused results against the unfused compile and against eager."""
    dtype = getattr(torch, dtype)
    runs = {(layers, bool(passes)): _compile_and_run(name, sequence_parallel, dtype, training, layers, passes)
            for layers in (1, 2) for passes in ((), TP_PASSES)}
    fused, unfused = runs[(2, True)], runs[(2, False)]
    per_layer = tuple(runs[(2, on)]["launches"] - runs[(1, on)]["launches"] for on in (False, True))
    return {"per_layer": per_layer, "sites": fused["sites"], "misses": fused["misses"],
            "errors": [e for run in runs.values() for e in run["errors"]],
            "vs_unfused": _largest_difference(fused["results"], unfused["results"]),
            "vs_eager": _largest_difference(fused["results"], fused["eager"]),
            "scale": max(t.double().abs().max().item() for t in fused["eager"].values())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("worlds", nargs="*", type=int, default=[2], help="ranks: 2 (default), 4")
    parser.add_argument("--model", action="append", choices=("llama3", "qwen3"))
    parser.add_argument("--parallel", action="append", choices=("tp", "tp_sp"))
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    parser.add_argument("--phase", action="append", choices=("infer", "train"))
    args = parser.parse_args(argv)
    for world in args.worlds:
        for name in args.model or ("llama3", "qwen3"):
            for parallel in args.parallel or ("tp", "tp_sp"):
                for dtype in args.dtype or ("float32", "bfloat16"):
                    for phase in args.phase or ("infer", "train"):
                        sequence_parallel, training = parallel == "tp_sp", phase == "train"
                        label = f"world={world} {name} {parallel} {dtype} {phase}"
                        try:
                            results = run_on_ranks(worker, world, name=name, sequence_parallel=sequence_parallel,
                                                   dtype=dtype, training=training, timeout=3600)
                        except Exception as exc:  # one configuration failing does not hide the others
                            print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
                            continue
                        first = results[0]
                        for rank, r in enumerate(results):
                            assert r["errors"] == [], (rank, r["errors"])
                            assert (r["sites"], r["per_layer"]) == (first["sites"], first["per_layer"]), rank
                        fused = sum(first["sites"].values())
                        present = fused + sum(len(m) for m in first["misses"].values())
                        by_pass = ", ".join(f"{p} {first['sites'][p]}/{first['sites'][p] + len(first['misses'][p])}"
                                            for p in TP_PASSES if first['sites'][p] or first['misses'][p])
                        reasons = collections.Counter(f"{p}: {m}" for p, ms in first["misses"].items() for m in ms)
                        print(f"{label}: sites {fused}/{present} ({by_pass}), "
                              f"the same on each of the {world} ranks; launches per layer per rank "
                              f"{first['per_layer'][0]} -> {first['per_layer'][1]}; max |fused - unfused| "
                              f"{max(r['vs_unfused'] for r in results):.3g}, |fused - eager| "
                              f"{max(r['vs_eager'] for r in results):.3g} at scale "
                              f"{max(r['scale'] for r in results):.3g}", flush=True)
                        for reason, count in sorted(reasons.items()):
                            print(f"    near miss x{count} (rank 0): {reason}", flush=True)


if __name__ == "__main__":
    main()
