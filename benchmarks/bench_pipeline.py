"""What fusion costs at compile time (a benchmark, not a test: timings are noisy here).

Prints, for tiny transformers models of 2, 8 and 32 layers, the fusion pipeline's time as
a fraction of the whole torch.compile (dynamo + aot_autograd + passes) and per 1k graph
nodes, so growth with graph size shows, with each pass's share; and the one-time costs:
`import npu_fx_fusion`, stand-in op registration, and tracing each pass's patterns.
The default models: Llama (rms_norm, add_rms_norm, rope fuse; swiglu only finds near
misses), Phi-3 (fused gate_up: swiglu fuses too) and Qwen3-MoE (+ moe_gating,
moe_dispatch and grouped_matmul), each with its estimated kernel launches before and
after fusion; then the ops per routed MoE block of Qwen3-MoE and DeepSeek-V3, for both transformers
experts implementations.

    .venv/bin/python benchmarks/bench_pipeline.py [--models llama phi3 qwen3_moe] [--layers 2 8 32]
"""
import argparse
import subprocess
import sys
import time

import torch


def one_time_costs() -> None:
    def child(code: str) -> float:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return float(out.stdout.strip())

    torch_s = child("import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)")
    both_s = child("import time; t=time.perf_counter(); import torch, npu_fx_fusion; print(time.perf_counter()-t)")
    print(f"import torch: {torch_s:.2f} s; import npu_fx_fusion on top of it: {both_s - torch_s:+.3f} s")

    from npu_fx_fusion import npu_ops
    from npu_fx_fusion.catalog import load_pass, pass_names
    from npu_fx_fusion.registry import pattern_set

    start = time.perf_counter()
    npu_ops.ensure_registered()
    print(f"stand-in op registration: {time.perf_counter() - start:.3f} s")
    for name in pass_names():
        fusion_pass = load_pass(name)
        if fusion_pass is None:
            continue
        start = time.perf_counter()
        patterns = pattern_set(fusion_pass)  # precompiled when current, else traced (once per process)
        count = len(patterns.forward)
        print(f"pattern registration {name}: {time.perf_counter() - start:.3f} s "
              f"({len(fusion_pass.forms)} forms, {count} forward patterns, {patterns.source})")


def compile_fraction(model: str, layers: int) -> None:
    import npu_fx_fusion as nff
    from npu_fx_fusion.tiny_models import build_hf

    tiny = build_hf(model, num_layers=layers)
    torch._dynamo.reset()
    backend = nff.get_npu_backend()
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
    total = time.perf_counter() - start
    graph = nff.last_report().graphs[0]
    passes = ", ".join(f"{r.pass_name} {len(r.sites)} sites {r.seconds * 1e3:.0f} ms"
                       for r in graph.passes if not r.skipped)
    print(f"{model:6s} {layers:3d} layers: {graph.nodes_before:5d} nodes, compile {total:6.2f} s, "
          f"pipeline {graph.seconds:5.2f} s = {graph.seconds / total:5.1%} of compile, "
          f"{graph.seconds / graph.nodes_before * 1e3 * 1e3:6.1f} ms per 1k nodes; "
          f"launches {graph.cost_before.launches} -> {graph.cost_after.launches} ({passes})")


# (label, builder, kwargs); a block is every call under <layer>.mlp.{gate,experts} (transformers)
# or under <layer>.moe except its shared experts (torchtitan: router, dispatcher, experts and
# the routing map the MoE layer itself computes)
MOE_MODELS = [
    ("qwen3_moe grouped_mm", "hf", "qwen3_moe", {"experts_implementation": "grouped_mm"}),
    ("qwen3_moe batched_mm", "hf", "qwen3_moe", {"experts_implementation": "batched_mm"}),
    ("deepseek_v3 grouped_mm", "hf", "deepseek_v3", {"experts_implementation": "grouped_mm"}),
    ("deepseek_v3 batched_mm", "hf", "deepseek_v3", {"experts_implementation": "batched_mm"}),
    ("torchtitan deepseek_v3", "torchtitan", "deepseek_v3", {}),
]


def _moe_block(module: str):
    if ".mlp." in module:
        block, rest = module.split(".mlp.", 1)
        return f"{block}.mlp" if rest.split(".")[0] in ("experts", "gate") else None
    if module.endswith(".moe") or ".moe." in module:
        block, _, rest = module.partition(".moe")
        return None if rest.startswith(".shared_experts") else f"{block}.moe"
    return None


def moe_block_ops() -> None:
    """Ops per routed MoE block (router, dispatch, experts, combine) before and after fusion:
    call nodes in the block's graph region, and the computing ones among them (views,
    getitems excluded, as in the cost estimate)."""
    from collections import Counter

    from npu_fx_fusion.backend import EmulationBackend
    from npu_fx_fusion.report import GraphCost, SourceLocation
    from npu_fx_fusion.tiny_models import build_hf, build_torchtitan

    def per_block(gm):
        ops, computing, moved = Counter(), Counter(), Counter()
        for node in gm.graph.nodes:
            block = _moe_block(SourceLocation.of(node).module or "")
            if node.op == "call_function" and block:
                cost = GraphCost.of_node(node)
                ops[block] += 1
                computing[block] += cost.launches
                moved[block] += cost.bytes_moved
        return ops, computing, moved

    class Counting(EmulationBackend):
        def _compile(self, phase, gm, example_inputs):
            self.before = per_block(gm)
            compiled = super()._compile(phase, gm, example_inputs)
            self.after = per_block(gm)
            return compiled

    for label, library, model, kwargs in MOE_MODELS:
        torch._dynamo.reset()
        build = build_hf if library == "hf" else build_torchtitan
        tiny = build(model, num_layers=2, **kwargs)
        backend = Counting()
        with torch.no_grad():
            torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
        (ops_b, launches_b, bytes_b), (ops_a, launches_a, bytes_a) = backend.before, backend.after
        fused = {s.fused_op.split(".")[-1] for s in backend.report.sites
                 if s.pass_name.startswith(("moe", "grouped"))}
        for block in sorted(ops_b):
            print(f"{label:23s} {block}: {ops_b[block]} -> {ops_a[block]} ops, "
                  f"{launches_b[block]} -> {launches_a[block]} launching, "
                  f"{bytes_b[block] / 1e3:.0f} -> {bytes_a[block] / 1e3:.0f} KB moved (estimates); "
                  f"fused: {', '.join(sorted(fused))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "phi3", "qwen3_moe"])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    args = parser.parse_args()
    one_time_costs()
    # the first compile pays pattern registration (measured above): warm up once
    compile_fraction(args.models[0], 1)
    for model in args.models:
        for layers in args.layers:
            compile_fraction(model, layers)
    moe_block_ops()


if __name__ == "__main__":
    main()
