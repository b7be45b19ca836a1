"""Site table of the tiny transformers deepseek_v4 (issue 17's closing numbers): compile it with
the emulation backend (NPU dispatch on), run inference or one training step next to eager, and
print the fused sites per pass, the fused ops, the near misses and the graph sizes before and after.

    .venv/bin/python benchmarks/v4_site_table.py infer|infer_bf16|train

Minutes on a shared 2-core machine (inference ~2.5 min, training ~6.5 min).
"""
import collections
import copy
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import torch
import npu_fx_fusion as nff
from helpers import RecordingBackend, assert_close_at_scale
from npu_fx_fusion.tiny_models import build_hf
from npu_fx_fusion.report import fused_op_counts

which = sys.argv[1]
dtype = torch.bfloat16 if "bf16" in which else torch.float32
tiny = build_hf("deepseek_v4", dtype=dtype)
model, inputs = tiny.model, tuple(tiny.example_inputs)
torch._dynamo.reset()
backend = RecordingBackend(nff.FusionConfig())
t = time.perf_counter()
if which.startswith("infer"):
    with torch.no_grad():
        ref = model(*inputs)
        out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    diff = (out.float() - ref.float()).abs().max().item()
    print("logits max abs diff", diff, "scale", ref.float().abs().max().item(), "equal", torch.equal(out, ref))
else:
    reference = copy.deepcopy(model)
    out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    ref = reference(*inputs)
    g = torch.Generator().manual_seed(5); probe = torch.randn(out.shape, generator=g)
    (out.float() * probe).sum().backward(); (ref.float() * probe).sum().backward()
    print("logits max abs diff", (out - ref).abs().max().item())
    worst = []
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None): worst.append((n, "grad presence differs"))
            continue
        scale = q.grad.abs().max().item()
        d = (p.grad - q.grad).abs().max().item()
        ulp = torch.finfo(q.grad.dtype).eps * scale
        worst.append((n, d / ulp if ulp else d))
    worst = sorted([w for w in worst if isinstance(w[1], float)], key=lambda w: -w[1])[:5]
    print("worst grads (ulps at scale):", worst)
print(f"compile+run {time.perf_counter() - t:.0f} s; graph_source {backend.report.graph_source}")
r = backend.report
print("counts", r.counts)
print("fused_ops", r.fused_ops)
print("errors", r.errors)
miss = collections.Counter((m.pass_name, m.reason[:200]) for m in r.near_misses)
for (p, reason), n in sorted(miss.items()):
    print(f"near miss x{n} [{p}] {reason}")
for g in r.graphs:
    print(f"graph {g.name}: nodes {g.nodes_before} -> {g.nodes_after}; {g.cost_line()}")
    comp = lambda c: sum(v for k, v in c.items() if not k.startswith(("aten.view", "aten.reshape", "aten._unsafe_view", "operator.getitem", "aten.expand", "aten.permute", "aten.transpose", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select", "aten.t.")))
    print(f"   computing ops (no views/getitem) {comp(g.ops_before)} -> {comp(g.ops_after)}; fused {dict(g.fused_ops)}")
