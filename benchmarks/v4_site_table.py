"""Site table of the tiny transformers deepseek_v4 (issue 17's closing numbers): compile it with
the emulation backend (NPU dispatch on), run inference or one training step next to eager, and
print the site table (family: fused / present, tests/v4_modules.py V4_FAMILIES), the computing
ops per decoder layer before and after fusion, the fused ops, the near misses and the graph sizes.

    .venv/bin/python benchmarks/v4_site_table.py infer|infer_bf16|train|train_bf16

A minute or two on a shared 2-core machine. tests/test_deepseek_v4.py asserts the table and
compares logits and gradients with float64; here they are compared with eager only.
"""
import collections
import copy
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import torch  # noqa: E402

import npu_fx_fusion as nff  # noqa: E402
from helpers import RecordingBackend  # noqa: E402
from npu_fx_fusion.tiny_models import build_hf  # noqa: E402
from v4_modules import SHARED_EXPERT_SWIGLUS, computing_ops_per_layer, site_table  # noqa: E402


class CountingBackend(RecordingBackend):
    """RecordingBackend that counts each graph's computing ops per decoder layer before and after
    the passes: {"joint" | "forward" | "backward" | "inference": (before, after)}."""

    def __init__(self, config=None):
        super().__init__(config)
        self.per_layer = {}

    def _compile(self, phase, gm, example_inputs):
        before = computing_ops_per_layer(gm.graph)
        compiled = super()._compile(phase, gm, example_inputs)
        self.per_layer[phase] = (before, computing_ops_per_layer(gm.graph))
        return compiled

    def _partition(self, joint_gm, joint_inputs, **kwargs):
        before = computing_ops_per_layer(joint_gm.graph)
        run_joint = self.pipeline.run_joint

        def counted(gm, *args, **kw):
            fused = run_joint(gm, *args, **kw)
            self.per_layer["joint"] = (before, computing_ops_per_layer(gm.graph))
            return fused

        self.pipeline.run_joint = counted
        try:
            return super()._partition(joint_gm, joint_inputs, **kwargs)
        finally:
            del self.pipeline.run_joint


def main(which):
    dtype = torch.bfloat16 if "bf16" in which else torch.float32
    train = which.startswith("train")
    tiny = build_hf("deepseek_v4", dtype=dtype)
    model, inputs = tiny.model, tuple(tiny.example_inputs)
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    backend = CountingBackend(nff.FusionConfig())
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
        ref = reference(*inputs)
    print(f"{which}: logits max abs diff {(out.float() - ref.float()).abs().max().item():.3g} "
          f"(scale {ref.float().abs().max().item():.3g})")
    if train:
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out.float() * probe).sum().backward()
        (ref.float() * probe).sum().backward()
        gaps = []
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.grad is not None and q.grad is not None and q.grad.abs().max() > 0:
                # in the model's dtype's eps: an fp32 gradient (V4 keeps its mHC weights fp32) of a
                # bf16 model is computed through bf16 values, and only as exact
                unit = torch.finfo(dtype).eps * q.grad.abs().max().item()
                gaps.append(((p.grad - q.grad).abs().max().item() / unit, name))
        print("largest gradient gaps to eager (the model dtype's eps x the gradient's largest value):",
              [(round(g, 1), n) for g, n in sorted(gaps, reverse=True)[:5]])
    report = backend.report
    print(f"compile + run {time.perf_counter() - start:.0f} s; {report.graph_source}; errors {report.errors}")
    print("\nsite table (fused / present):")
    for family, (fused, present) in site_table(report).items():
        print(f"  {family:26s} {fused:3d} / {present}")
    print(f"  {'shared-expert SwiGLU':26s}   0 / {SHARED_EXPERT_SWIGLUS} (separate gate and up projections)")
    print("\ncomputing ops per decoder layer (no views / getitem), before -> after:")
    for phase, (before, after) in backend.per_layer.items():
        layers = sorted(k for k in set(before) | set(after) if k is not None)
        row = ", ".join(f"layer {k}: {before.get(k, 0)} -> {after.get(k, 0)}" for k in layers)
        print(f"  {phase}: {row}; outside the layers (and backward nodes, which carry no module): "
              f"{before.get(None, 0)} -> {after.get(None, 0)}")
    print("\nfused ops:", report.fused_ops)
    misses = collections.Counter((m.pass_name, m.reason[:160]) for m in report.near_misses)
    for (pass_name, reason), count in sorted(misses.items()):
        print(f"near miss x{count} [{pass_name}] {reason}")
    for graph in report.graphs:
        print(f"graph {graph.name}: nodes {graph.nodes_before} -> {graph.nodes_after}; {graph.cost_line()}")


if __name__ == "__main__":
    main(sys.argv[1])
