"""What fusion costs at compile time, as ratios measured in one run (timings on shared
machines are noisy; ratios of runs made side by side much less so).

- share: the pipeline's seconds (every graph's, from the report) over the whole
  torch.compile with fusion (dynamo + aot_autograd + partitioning + passes), for tiny
  transformers Llama models of several depths, inference and one training step;
- per 1k nodes: the pipeline's seconds per 1000 graph nodes, and how that grows with depth
  (the engine should be linear: the same cost per node at 32 layers as at 8);
- first use: in a fresh process, the first fused compile minus the first compile with
  torch's own aot_eager backend (imports, stand-in ops, loading the patterns), for
  inference and for a training step (which also traces the joint replacements once per
  signature); the shares are measured after both, in a warm process;
- and the same against the numbers recorded in docs/performance.md: a line per number,
  REGRESSION where one is worse than recorded by more than the noise allowance.

    .venv/bin/python benchmarks/bench_engine.py [--layers 8 32 64] [--repeat 3] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

import torch

RECORDED = pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md"
# a measured ratio may exceed its recorded value by this factor before it is called a
# regression: repeated runs on these machines differ by up to ~1.5x
NOISE = 1.5


def _compile_seconds(model, inputs, backend, train: bool) -> float:
    """One compile (and run) of `model`, timed with the garbage collector off, as timeit
    times: a full collection of this process's heap takes ~0.4 s here, and whichever phase
    of the compile it falls in (ours or torch's) would carry it."""
    torch._dynamo.reset()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        if train:
            torch.compile(model, backend=backend)(*inputs).float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                torch.compile(model, backend=backend)(*inputs)
        return time.perf_counter() - start
    finally:
        gc.enable()


def compile_share(layers: int, train: bool, repeat: int) -> dict:
    """Medians over `repeat` alternating compiles of the same model, fused and aot_eager."""
    import npu_fx_fusion as nff
    from npu_fx_fusion.tiny_models import build_hf

    tiny = build_hf("llama", dtype=torch.bfloat16 if train else torch.float32, num_layers=layers)
    model = tiny.model.train() if train else tiny.model
    fused, plain, pipeline, nodes = [], [], [], 0
    for _ in range(repeat):
        plain.append(_compile_seconds(model, tiny.example_inputs, "aot_eager", train))
        backend = nff.get_npu_backend()
        fused.append(_compile_seconds(model, tiny.example_inputs, backend, train))
        graphs = backend.report.graphs
        pipeline.append(sum(g.seconds for g in graphs))
        nodes = sum(g.nodes_before for g in graphs)
    total, seconds = statistics.median(fused), statistics.median(pipeline)
    return {"layers": layers, "train": train, "nodes": nodes, "compile_s": total,
            "aot_eager_s": statistics.median(plain), "pipeline_s": seconds,
            "share": seconds / total, "per_1k_nodes_s": seconds / nodes * 1e3}


_FIRST_COMPILE = """
import sys, time
start = time.perf_counter()
import torch
from npu_fx_fusion.tiny_models import build_hf
train = sys.argv[2] == "train"
tiny = build_hf("llama", dtype=torch.bfloat16 if train else torch.float32, num_layers=2)
if sys.argv[1] == "fused":
    import npu_fx_fusion as nff
    backend = nff.get_npu_backend()
else:
    backend = "aot_eager"
start = time.perf_counter()
if train:
    torch.compile(tiny.model.train(), backend=backend)(*tiny.example_inputs).float().pow(2).mean().backward()
else:
    with torch.no_grad():
        torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
print(time.perf_counter() - start)
"""


def first_use(repeat: int, train: bool = False) -> dict:
    """The first compile in fresh processes, fused and with aot_eager, alternating (a
    training step: the joint replacements are traced then, per signature, and kept)."""
    def run(kind: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FIRST_COMPILE, kind, "train" if train else "inference"],
                             capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    fused, plain = [], []
    for _ in range(repeat):
        plain.append(run("aot_eager"))
        fused.append(run("fused"))
    return {"first_fused_s": statistics.median(fused), "first_aot_eager_s": statistics.median(plain),
            "first_use_extra_s": statistics.median(fused) - statistics.median(plain)}


def recorded() -> dict:
    """The numbers docs/performance.md records, from its ```json bench_engine block."""
    if not RECORDED.exists():
        return {}
    found = re.search(r"```json bench_engine\n(.*?)\n```", RECORDED.read_text(), re.S)
    return json.loads(found.group(1)) if found else {}


def compare(name: str, value: float, limits: dict) -> str:
    """'ok' or 'REGRESSION', against the recorded value (within NOISE) and the goal."""
    verdicts = []
    if name in limits.get("recorded", {}):
        was = limits["recorded"][name]
        verdicts.append(f"recorded {was:.3g}" + (" REGRESSION" if value > was * NOISE else ""))
    if name in limits.get("goals", {}):
        goal = limits["goals"][name]
        verdicts.append(f"goal <= {goal:.3g}" + (" MISSED" if value > goal else ""))
    return "; ".join(verdicts) or "nothing recorded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--train-layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat, 8 and 32 layers")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.train_layers, args.repeat = [8, 32], [8], 1
    limits = recorded()
    numbers: dict = {}

    for train, key in ((False, "first_use_extra_s"), (True, "first_training_use_extra_s")):
        first = first_use(args.repeat, train)
        numbers[key] = first["first_use_extra_s"]
        print(f"first {'training step' if train else 'compile'} in a fresh process: {first['first_fused_s']:.2f} s "
              f"fused, {first['first_aot_eager_s']:.2f} s aot_eager: {first['first_use_extra_s']:+.2f} s "
              f"({compare(key, first['first_use_extra_s'], limits)})")

    # warm: what a process pays once (imports, loading the patterns, tracing the joint
    # replacements per signature: the same for every depth) is measured above, not here
    for train in (False, True):
        _compile_seconds(*_warm_model(train), __import__("npu_fx_fusion").get_npu_backend(), train)
    for train, depths in ((False, args.layers), (True, args.train_layers)):
        base = None
        for layers in depths:
            row = compile_share(layers, train, args.repeat)
            kind = "training" if train else "inference"
            base = base or row["per_1k_nodes_s"]
            growth = row["per_1k_nodes_s"] / base
            numbers[f"{kind}_share_{layers}"] = row["share"]
            numbers[f"{kind}_per_1k_growth_{layers}"] = growth
            print(f"{kind:9s} {layers:3d} layers, {row['nodes']:6d} nodes: compile {row['compile_s']:6.2f} s "
                  f"(aot_eager {row['aot_eager_s']:6.2f} s), pipeline {row['pipeline_s']:5.2f} s = "
                  f"{row['share']:5.1%} of it ({compare(f'{kind}_share_{layers}', row['share'], limits)}); "
                  f"{row['per_1k_nodes_s'] * 1e3:6.1f} ms per 1k nodes, x{growth:.2f} of the shallowest "
                  f"({compare(f'{kind}_per_1k_growth_{layers}', growth, limits)})")
    print("measured:", json.dumps({k: round(v, 4) for k, v in numbers.items()}))


def _warm_model(train: bool):
    from npu_fx_fusion.tiny_models import build_hf

    tiny = build_hf("llama", dtype=torch.bfloat16 if train else torch.float32, num_layers=1)
    return (tiny.model.train() if train else tiny.model), tiny.example_inputs


if __name__ == "__main__":
    main()
