"""Fused sites per model and pass, static shapes vs torch.compile(dynamic=True) (issue 15, item 1).

Every tiny third-party model (transformers 5.24 / torchtitan 0.3.0 via tiny_models) is
compiled with the emulation backend twice in inference: static shapes, and dynamic=True with
batch and sequence marked dynamic together; the dynamic graph then also runs at a smaller
and a larger batch and length. A pass whose count differs between the two is a dynamic-shape
gap (its near misses under dynamic=True are printed), and so is a recompile; the guards the
passes added to the shape environment are printed (a size's kernel limit, `s0 < 1000`, is
expected; anything pinning or relating sizes is a defect). DeepSeek-V3.2's indexer and sparse
attention are the known exception (tests/test_models.py says why).

    .venv/bin/python benchmarks/dynamic_survey.py [model ...] [--dtype bf16|fp16|fp32]

model: hf:<model_type>[:<experts_implementation>] or torchtitan:<name>. A few minutes for the
default list on a shared 2-core machine.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import npu_fx_fusion as nff  # noqa: E402
from helpers import GuardRecordingBackend  # noqa: E402
from npu_fx_fusion.tiny_models import build_hf, build_torchtitan  # noqa: E402

DEFAULT = ["hf:llama", "hf:qwen3", "hf:phi3", "hf:glm4", "hf:qwen3_moe:grouped_mm", "hf:qwen3_moe:batched_mm",
           "hf:deepseek_v3:grouped_mm", "hf:deepseek_v3:batched_mm", "hf:deepseek_v32", "torchtitan:llama3",
           "torchtitan:deepseek_v3"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(spec: str, dtype: torch.dtype):
    kind, name, *rest = spec.split(":")
    if kind == "hf":
        kwargs = {"experts_implementation": rest[0]} if rest else {}
        return build_hf(name, dtype=dtype, **kwargs)
    return build_torchtitan(name, dtype=dtype)


def _relative_error(actual, expected):
    return (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()


def compile_report(tiny, dynamic: bool):
    """(report, max |fused - eager| / max |eager|) of one inference compile; dynamic: the
    worst over the example and two more batch / sequence lengths, which the one symbolic
    graph must serve."""
    torch._dynamo.reset()
    backend = GuardRecordingBackend(nff.FusionConfig())
    inputs = [t.clone() for t in tiny.example_inputs]
    if dynamic:  # batch and sequence symbolic together, as a serving stack compiles
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
    compiled = torch.compile(tiny.model, backend=backend, fullgraph=True, dynamic=dynamic or None)
    with torch.no_grad():
        error = _relative_error(compiled(*inputs), tiny.model(*inputs))
        if dynamic:  # a smaller and a larger batch and length (past the head counts)
            (ids,) = inputs
            for batch, seq in ((ids.shape[0] + 1, ids.shape[1] - 3), (ids.shape[0] + 7, ids.shape[1] + 9)):
                other = torch.randint(3, int(ids.max()) + 1, (batch, seq), dtype=ids.dtype)
                error = max(error, _relative_error(compiled(other), tiny.model(other)))
            if len(backend.report.graphs) != 1:
                print(f"    recompiled: {len(backend.report.graphs)} graphs")
            if backend.added_guards:
                print(f"    guards the passes added: {sorted(set(map(str, backend.added_guards)))}")
    return backend.report, error


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=DEFAULT)
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    args = parser.parse_args(argv)
    rows = []
    for spec in args.models:
        tiny = build(spec, DTYPES[args.dtype])
        static, static_err = compile_report(tiny, dynamic=False)
        dynamic, dynamic_err = compile_report(tiny, dynamic=True)
        passes = sorted(set(static.counts) | set(dynamic.counts))
        gaps = [p for p in passes if static.counts.get(p, 0) != dynamic.counts.get(p, 0)]
        cells = ", ".join(f"{p} {static.counts.get(p, 0)}/{dynamic.counts.get(p, 0)}" for p in passes
                          if static.counts.get(p, 0) or dynamic.counts.get(p, 0))
        print(f"{spec} [{args.dtype}] static/dynamic: {cells}; rel. logits err {static_err:.1e}/{dynamic_err:.1e}")
        for p in gaps:
            reasons = collections.Counter(m.reason[:240] for m in dynamic.near_misses if m.pass_name == p)
            for reason, n in reasons.items():
                print(f"    GAP {p}: near miss x{n}: {reason}")
        if dynamic.errors:
            print(f"    errors: {dynamic.errors}")
        rows.append((spec, gaps))
    print("gaps:", {spec: gaps for spec, gaps in rows if gaps} or "none")


if __name__ == "__main__":
    main()
