"""The survey of issue 15: every transformers causal-LM model_type (and torchtitan's models),
built tiny, compiled for inference in fp32, bf16, and bf16 with dynamic=True (batch and
sequence symbolic together). A row per model: sites fused / sites present in each mode, where
a site present is one a pass fused or left a near miss at, and the passes that left near
misses, with their most common reason. Logits are compared with eager (relative to their
largest value); a type that does not build says why.

    .venv/bin/python benchmarks/survey.py [model ...] [--limit N] [--reasons]

model: as benchmarks/dynamic_survey.py takes them (hf:<model_type>[:<experts>] or
torchtitan:<name>); default: every type tiny_models.hf_model_types() lists, then torchtitan's
llama3 and deepseek_v3. Roughly 10-20 s a model on a shared 2-core machine.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from dynamic_survey import build, compile_report  # noqa: E402

from npu_fx_fusion import tiny_models  # noqa: E402

MODES = (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False), ("bf16 dynamic", torch.bfloat16, True))
# logits further from eager than this (relative to their largest value) are flagged: the bf16
# model's own rounding through two tiny layers stays well under it
FLAG = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def survey(spec: str) -> dict:
    row = {"model": spec, "modes": {}, "missed": collections.Counter(), "reasons": {}, "notes": []}
    for mode, dtype, dynamic in MODES:
        try:
            tiny = build(spec, dtype)
            report, error = compile_report(tiny, dynamic)
        except Exception as exc:  # a type that does not build or run tiny: say why, go on
            row["notes"].append(f"{mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        fused = sum(report.counts.values())
        row["modes"][mode] = (fused, fused + len(report.near_misses))
        for miss in report.near_misses:
            row["missed"][miss.pass_name] += 1
            row["reasons"].setdefault((miss.pass_name, mode), collections.Counter())[miss.reason[:160]] += 1
        if error > FLAG[dtype]:
            row["notes"].append(f"{mode}: logits {error:.1e} from eager")
        if report.errors:
            row["notes"].append(f"{mode}: pass errors {report.errors}")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*")
    parser.add_argument("--limit", type=int, help="only the first N models")
    parser.add_argument("--reasons", action="store_true", help="print each model's near-miss reasons")
    args = parser.parse_args(argv)
    models = args.models or [*(f"hf:{t}" for t in tiny_models.hf_model_types()),
                             "torchtitan:llama3", "torchtitan:deepseek_v3"]
    models = models[:args.limit] if args.limit else models
    start = time.perf_counter()
    print("| model | " + " | ".join(f"{mode} fused / present" for mode, _, _ in MODES) + " | near misses by pass | notes |")
    print("|---" * (len(MODES) + 3) + "|")
    totals = collections.Counter()
    for spec in models:
        row = survey(spec)
        cells = []
        for mode, _, _ in MODES:
            fused, present = row["modes"].get(mode, (None, None))
            cells.append("-" if fused is None else f"{fused} / {present}")
            if fused is not None:
                totals[(mode, "fused")] += fused
                totals[(mode, "present")] += present
        missed = ", ".join(f"{p} {n}" for p, n in row["missed"].most_common()) or "none"
        print(f"| {spec} | " + " | ".join(cells) + f" | {missed} | {'; '.join(row['notes'])} |", flush=True)
        if args.reasons:
            for (pass_name, mode), reasons in sorted(row["reasons"].items()):
                for reason, n in reasons.most_common():
                    print(f"    {mode} {pass_name} x{n}: {reason}")
    print("\ntotal: " + ", ".join(f"{mode} {totals[(mode, 'fused')]} / {totals[(mode, 'present')]}"
                                  for mode, _, _ in MODES) + f"; {len(models)} models in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
