"""Launches and estimated device time per decoder layer of one compiled decode step.

One decode step (one token after an eager prefill) of a tiny transformers model over a
StaticCache, compiled with the CPU emulation backend, unfused (every pass and
merged_projections off) and fused (the defaults). A layer's share is measured as issue 31
defines it: the estimate of the 4-layer graph minus the 2-layer graph's, halved, so the
embedding, the final norm, the head and what the layers share (the rotary tables, the
mask) cancel out. The estimate is the report's roofline (cost_model.py), per SoC.

    .venv/bin/python benchmarks/decode_budget.py                      # llama, qwen3, deepseek_v3; fp32
    .venv/bin/python benchmarks/decode_budget.py --dtype bfloat16 --dynamic --batch 1
    .venv/bin/python benchmarks/decode_budget.py --model llama --dims 8b  # Llama-3-8B's layer sizes

The logits and the caches are compared with eager (tolerance: the CLI's, cli.OUTPUT_TOLERANCE).
"GraphCost count" is report.GraphCost's launch count (every computing node one launch,
copy_ write-backs included), the count issue 31's table was measured with.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import npu_fx_fusion as nff
from npu_fx_fusion.cli import OUTPUT_TOLERANCE, _max_difference
from npu_fx_fusion.cost_model import ROOFLINES
from npu_fx_fusion.tiny_models import CacheStep, build_hf, static_cache

# Llama-3-8B's layer (hidden 4096, 32 heads of 128, 8 kv heads, MLP 14336), a small vocab
DIMS = {"tiny": {}, "8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "head_dim": 128, "intermediate_size": 14336, "vocab_size": 256}}
UNFUSED = nff.FusionConfig(enable=frozenset(), merge_projections=False)


def decode_step(model: str, layers: int, dtype: torch.dtype, dynamic: bool, batch: int, dims: dict,
                config: nff.FusionConfig) -> dict:
    # a fresh dynamo cache: CacheStep.forward is one code object, and compiling it for every
    # model, layer count and config in one process would pass dynamo's recompile limit (8),
    # after which it runs eagerly and last_report() would be the previous compile's
    torch._dynamo.reset()
    tiny = build_hf(model, dtype=dtype, num_layers=layers, batch=batch, **dims)
    lm = tiny.model.lm
    step = CacheStep(lm)
    (prompt,) = tiny.example_inputs
    reference, cache = (static_cache(lm, batch=batch, max_cache_len=prompt.shape[1] + 8) for _ in range(2))
    backend = nff.get_npu_backend(fusion_config=config)
    compiled = torch.compile(step, backend=backend, dynamic=dynamic or None)
    with torch.no_grad():
        token = step(prompt, reference)[:, -1:].argmax(-1)
        step(prompt, cache)
        expected = step(token, reference)
        actual = compiled(token, cache)
    report = backend.report  # this compile's, not whichever backend ran last
    if not report.graphs:
        raise RuntimeError(f"{model}, {layers} layers: nothing was compiled (dynamo ran it eagerly)")
    estimate = {soc: [0.0, 0.0] for soc in ROOFLINES}  # launches, seconds
    graph_cost = sum(graph.cost_after.launches for graph in report.graphs)  # report.GraphCost's count
    for graph in report.graphs:
        for soc, est in graph.roofline_after.items():
            estimate[soc][0] += est.launches
            estimate[soc][1] += est.seconds
    states = [(m, r) for mine, ref in zip(cache.layers, reference.layers)
              for m, r in ((mine.keys, ref.keys), (mine.values, ref.values))]
    checks = {"logits": _max_difference(actual, expected),
              "cache": _max_difference([a for a, _ in states], [e for _, e in states])}
    ok = all(diff <= OUTPUT_TOLERANCE[dtype] * max(1.0, scale) for diff, scale in checks.values())
    return {"estimate": estimate, "graph_cost": graph_cost, "ok": ok, "diff": {k: v[0] for k, v in checks.items()},
            "scale": {k: v[1] for k, v in checks.items()},
            "errors": report.errors, "counts": report.counts}


def per_layer(model: str, dtype: torch.dtype, dynamic: bool, batch: int, dims: dict, config: nff.FusionConfig):
    two = decode_step(model, 2, dtype, dynamic, batch, dims, config)
    four = decode_step(model, 4, dtype, dynamic, batch, dims, config)
    layer = {soc: ((four["estimate"][soc][0] - two["estimate"][soc][0]) / 2,
                   (four["estimate"][soc][1] - two["estimate"][soc][1]) / 2 * 1e6) for soc in ROOFLINES}
    layer["graph_cost"] = (four["graph_cost"] - two["graph_cost"]) / 2
    return layer, two["ok"] and four["ok"], four


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="llama, qwen3, deepseek_v3 (repeatable)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dims", default="tiny", choices=sorted(DIMS))
    args = parser.parse_args(argv)
    models = args.model or ["llama", "qwen3", "deepseek_v3"]
    dtype = getattr(torch, args.dtype)
    socs = list(ROOFLINES)
    print(f"decode step, batch {args.batch}, {args.dtype}, {'dynamic' if args.dynamic else 'static'}, "
          f"{args.dims} dims; per layer = (4 layers - 2 layers) / 2", file=sys.stderr)
    print("| model | launches unfused -> fused | GraphCost count | " + " | ".join(f"{s} us" for s in socs)
          + " | vs eager |")
    print("|---|---|---|" + "---|" * len(socs) + "---|")
    failed = False
    for model in models:
        start = time.perf_counter()
        before, ok_before, _ = per_layer(model, dtype, args.dynamic, args.batch, DIMS[args.dims], UNFUSED)
        after, ok_after, fused = per_layer(model, dtype, args.dynamic, args.batch, DIMS[args.dims],
                                           nff.FusionConfig())
        ok = ok_before and ok_after and not fused["errors"]
        failed |= not ok
        times = " | ".join(f"{before[s][1]:.1f} -> {after[s][1]:.1f}" for s in socs)
        # the fused 4-layer step's largest differences from eager, and the largest |eager value|
        diffs = ", ".join(f"{k} {fused['diff'][k]:.2g} of {fused['scale'][k]:.2g}" for k in fused["diff"])
        verdict = f"OK ({diffs})" if ok else f"MISMATCH ({diffs}) {fused['errors']}"
        print(f"| {model} | {before[socs[0]][0]:g} -> {after[socs[0]][0]:g} | "
              f"{before['graph_cost']:g} -> {after['graph_cost']:g} | {times} | {verdict} |")
        print(f"  {model}: {time.perf_counter() - start:.0f} s; fused sites {fused['counts']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
