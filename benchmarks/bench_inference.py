"""Inference steps over a StaticCache: what fuses per step, and the estimated launches per
decoder layer before and after fusion (a benchmark, not a test: the numbers are the
report's graph cost estimate, FusionReport.graphs[i].cost_before / cost_after).

For each tiny transformers model, a prompt (the prefill step) and one decode step run
through the emulation backend on a StaticCache, on the NPU graph (npu_dispatch=True, the
default) or the plain CPU graph. Per step it prints the fused sites per pass and the
estimated kernel launches of the whole graph and per decoder layer. "Per decoder layer" is
the difference between an L+1-layer and an L-layer model of the same config (the
embedding, the final norm and the LM head cancel out); for deepseek_v3 the added layer is
an MoE layer (first_k_dense_replace=1), so its numbers are the MoE layer's.

    .venv/bin/python benchmarks/bench_inference.py [--models llama qwen3 qwen3_moe deepseek_v3]
        [--dtype bf16] [--no-npu-dispatch]
"""
import argparse

import torch

import npu_fx_fusion as nff
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.tiny_models import CacheStep, build_hf, static_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_steps(model_type, dtype, layers, npu_dispatch, prompt=5, max_cache_len=16):
    """(prefill graph report, decode graph report) of one prompt and one decode step."""
    # a fresh dynamo: CacheStep.forward recompiled for another model would otherwise be
    # traced with automatic dynamic shapes, a different graph from the one measured here
    torch._dynamo.reset()  # noqa: SLF001
    tiny = build_hf(model_type, dtype=dtype, num_layers=layers)
    lm = tiny.model.lm
    step = CacheStep(lm)
    cache = static_cache(lm, batch=2, max_cache_len=max_cache_len)
    backend = EmulationBackend(nff.FusionConfig(npu_dispatch=npu_dispatch))
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    ids = torch.randint(3, lm.config.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = compiled(ids, cache)
        compiled(logits[:, -1:].argmax(-1), cache)
    prefill, decode = backend.report.graphs
    return prefill, decode


def _sites(graph):
    return {r.pass_name: len(r.sites) for r in graph.passes if r.skipped is None and r.sites}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--no-npu-dispatch", dest="npu_dispatch", action="store_false")
    args = parser.parse_args()
    graph = "NPU graph" if args.npu_dispatch else "CPU graph"
    print(f"| model ({args.dtype}, {graph}) | step | sites fused (2 layers) | launches 2 layers before -> after "
          "| per decoder layer before -> after |")
    print("|---|---|---|---|---|")
    for model_type in args.models:
        two = run_steps(model_type, DTYPES[args.dtype], 2, args.npu_dispatch)
        three = run_steps(model_type, DTYPES[args.dtype], 3, args.npu_dispatch)
        for name, g2, g3 in zip(("prefill", "decode"), two, three):
            before, after = g2.cost_before.launches, g2.cost_after.launches
            layer_before = g3.cost_before.launches - before
            layer_after = g3.cost_after.launches - after
            sites = ", ".join(f"{p} {n}" for p, n in sorted(_sites(g2).items()))
            added = {p: n - _sites(g2).get(p, 0) for p, n in _sites(g3).items() if n != _sites(g2).get(p, 0)}
            print(f"| {model_type} | {name} | {sites} | {before} -> {after} | {layer_before} -> {layer_after} "
                  f"({', '.join(f'{p} +{n}' for p, n in sorted(added.items())) or 'nothing'} fused in the added layer) |")


if __name__ == "__main__":
    main()
