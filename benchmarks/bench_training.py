"""What fusing training graphs costs and saves (a benchmark, not a test: timings are noisy).

For tiny models of 2 and 6 layers (torchtitan's deepseek_v3 debugmodel has 6), one compiled training step (forward + backward) with
the emulation backend, all passes on:

- the fusion pipeline's share of the whole compile (dynamo + aot_autograd + partitioning +
  our joint, forward and backward passes), measured in the same run;
- the estimated kernel launches of the forward and backward graphs aot_autograd hands
  to the compiler, with fusion off and on (report.GraphCost: an estimate from the graph);

and, once per process, the time to register each pass's joint patterns.

    .venv/bin/python benchmarks/bench_training.py [--models llama qwen3_moe deepseek_v3_tt] [--layers 2 6]
"""
import argparse
import time

import torch

import npu_fx_fusion as nff
from npu_fx_fusion.backend import EmulationBackend
from npu_fx_fusion.report import GraphCost


class _Counting(EmulationBackend):
    """The emulation backend, keeping the estimated cost of the graphs it compiles."""

    def __init__(self, config):
        super().__init__(config)
        self.launches = {}

    def _compile(self, phase, gm, example_inputs):
        compiled = super()._compile(phase, gm, example_inputs)
        self.launches[phase] = GraphCost.of(gm.graph).launches
        return compiled


def _build(name, layers):
    from npu_fx_fusion.tiny_models import build_hf, build_torchtitan

    if name.endswith("_tt"):
        return build_torchtitan(name[: -len("_tt")], dtype=torch.float32, num_layers=layers)
    return build_hf(name, dtype=torch.bfloat16, num_layers=layers)


def _step(name, layers, config):
    """(compile + first step seconds, backend) of one training step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    tm = _build(name, layers)
    backend = _Counting(config)
    (ids,) = tm.example_inputs
    start = time.perf_counter()
    torch.compile(tm.model.train(), backend=backend)(ids).float().pow(2).mean().backward()
    return time.perf_counter() - start, backend


def joint_registration() -> None:
    from npu_fx_fusion.catalog import load_pass, pass_names
    from npu_fx_fusion.registry import pattern_set

    parts = []
    for name in pass_names():
        fusion_pass = load_pass(name)
        if fusion_pass is None or not fusion_pass.differentiable:
            continue
        start = time.perf_counter()
        patterns = pattern_set(fusion_pass)
        count = len(patterns.joint)  # built on first use: precompiled when current, else traced
        parts.append(f"{name} {time.perf_counter() - start:.2f} s ({count}, {patterns.source})")
    print("joint pattern registration (once per process):", ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "qwen3_moe", "deepseek_v3_tt"])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 6])
    args = parser.parse_args()
    import transformers.integrations.moe  # noqa: F401  (its fp32 grouped_mm op; torchtitan's ops below)
    import torchtitan.models  # noqa: F401

    joint_registration()
    for name in args.models:
        for layers in args.layers:
            _step(name, layers, nff.FusionConfig())  # warm: one-time registrations are not the step's
            plain_seconds, plain = _step(name, layers, nff.FusionConfig(enable=set()))
            seconds, fused = _step(name, layers, nff.FusionConfig())
            pipeline = sum(g.seconds for g in fused.report.graphs)
            joint = next((g.seconds for g in fused.report.graphs if g.name == "joint"), 0.0)
            print(f"{name:15s} {layers:2d} layers: compile + first step {plain_seconds:5.1f} s unfused, "
                  f"{seconds:5.1f} s fused; pipeline {pipeline:5.2f} s = {pipeline / seconds:5.1%} "
                  f"(joint graph {joint:.2f} s); launches forward {plain.launches['forward']} -> "
                  f"{fused.launches['forward']}, backward {plain.launches['backward']} -> "
                  f"{fused.launches['backward']}")


if __name__ == "__main__":
    main()
