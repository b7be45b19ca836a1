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

Other codebases (issue 28): torchtune, litgpt, olmo-core and torchtitan-npu's own models
(npu_fx_fusion.tiny_third_party), in fp32 static, bf16 with dynamic=True, and one training
step (forward and backward fused, gradients compared with eager; npu_dispatch=False, and
whether the same step crashes with it). Here a site present is counted from the model
itself (tests/third_party_sites.py), so a site no pass noticed shows as silent:

    .venv/bin/python benchmarks/survey.py --third-party [LIBRARY|LIBRARY:NAME ...] [--json FILE]
        [--timeout S] [--sites]

Each model runs in its own process (torchtitan-npu needs torchtitan 0.2.2, and a hung
compile is stopped after --timeout seconds), printing a line per mode as it goes. --json
keeps every record; --sites prints each model's unfused sites. `--listing FILE.json ...`
prints the table, the totals and every unfused site grouped by code and reason, from such
records (docs/survey-third-party.md is written from it). About 1-2 minutes a model on a
quiet 2-core machine (4 when it is shared).
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import subprocess
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


# ---- other codebases (issue 28) ------------------------------------------------------------
THIRD_PARTY_MODES = ("fp32", "bf16 dynamic", "training")


def third_party_specs(selection) -> tuple[list[str], list[tuple[str, str]]]:
    """(LIBRARY:NAME specs to survey, [(spec, why not)]) of `selection` (libraries or specs)."""
    from npu_fx_fusion import tiny_third_party

    specs, skipped = [], []
    for item in selection or tiny_third_party.LIBRARIES:
        library, _, name = item.partition(":")
        if name:
            specs.append(item)
            continue
        for architecture in tiny_third_party.third_party_models(library):
            spec = f"{library}:{architecture.name}"
            (skipped.append((spec, architecture.skip)) if architecture.skip else specs.append(spec))
    return specs, skipped


def measure_one(spec: str) -> list[dict]:
    """Every mode of one model (run in its own process by survey_third_party)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    import logging

    import third_party_sites

    logging.getLogger("npu_fx_fusion").setLevel(logging.ERROR)  # reverted passes are in the record
    library, name = spec.split(":", 1)
    records = []
    for mode in THIRD_PARTY_MODES:
        dtype = None
        if library == "torchtitan_npu" and name == "deepseek_v4":  # it runs in bfloat16 only
            dtype = torch.bfloat16
        record = third_party_sites.to_json(third_party_sites.measure(library, name, mode, dtype=dtype))
        print(f"    {spec} [{mode}] {_cell(record)} ({record['seconds']} s){' ' + record['note'] if record['note'] else ''}",
              file=sys.stderr, flush=True)
        records.append(record)
    return records


def _cell(record: dict) -> str:
    """fused / present (near-missed, silent[, in eager]) of one record."""
    if "present" not in record:
        return "-"
    present = sum(record["present"].values())
    fused = sum(record["fused"].values())
    near = sum(record["near"].values())
    eager = len(record.get("eager", []))
    return (f"{fused} / {present} ({near} near, {present - fused - near - eager} silent"
            + (f", {eager} in eager" if eager else "") + ")")


TABLE_HEAD = ("| model | " + " | ".join(f"{m} fused / present (near, silent, in eager)" for m in THIRD_PARTY_MODES)
              + " | training crash with NPU dispatch | notes |\n" + "|---" * (len(THIRD_PARTY_MODES) + 3) + "|")


def _row(spec: str, rows: list[dict]) -> str:
    """The table row of one model's records."""
    training = next((r for r in rows if r["mode"] == "training"), {})
    crash = training.get("crash_with_dispatch") or ("no" if "present" in training else "-")
    notes = "; ".join(f"{r['mode']}: {r['note'].strip('; ')}" for r in rows if r.get("note"))
    return f"| {spec} | " + " | ".join(_cell(r) for r in rows) + f" | {crash[:80]} | {notes[:300]} |"


def _summary(records: list[dict], skipped) -> str:
    """The rows of the models not built, and the totals per library and mode."""
    lines = [f"| {spec} | " + " | ".join("-" for _ in THIRD_PARTY_MODES) + f" | - | not built: {why} |"
             for spec, why in skipped]
    totals = collections.defaultdict(collections.Counter)
    for row in records:
        if "present" in row:
            for library in (row["spec"].split(":")[0], "all"):
                for key in ("present", "fused", "near"):
                    totals[(library, row["mode"])][key] += sum(row[key].values())
                totals[(library, row["mode"])]["eager"] += len(row.get("eager", []))
    lines.append("")
    for (library, mode), t in sorted(totals.items()):
        silent = t["present"] - t["fused"] - t["near"] - t["eager"]
        lines.append(f"{library} {mode}: {t['fused']} / {t['present']} fused "
                     f"({t['fused'] / max(t['present'], 1):.0%}), {t['near']} near misses, {silent} silent, "
                     f"{t['eager']} in code dynamo ran in eager (the report names the graph break)")
    trained = [r for r in records if r["mode"] == "training" and "present" in r]
    crashes = [r for r in trained if r.get("crash_with_dispatch")]
    lines.append(f"training steps that crash with NPU dispatch: {len(crashes)} of {len(trained)}")
    return "\n".join(lines)


def _sites(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        lines += [f"    {row['mode']} SILENT {s['category']} {s['module']} {s['source']}" for s in row.get("silent", [])]
        lines += [f"    {row['mode']} EAGER {s['category']} {s['module']}: {s['why'][:200]}" for s in row.get("eager", [])]
        lines += [f"    {row['mode']} NEAR {category} ({pass_name}): {reason[:160]} @ {where[:120]}"
                  for category, pass_name, reason, where in row.get("near_reasons", [])]
    return "\n".join(lines)


def survey_third_party(selection, timeout: float, json_path=None, show_sites=False) -> None:
    specs, skipped = third_party_specs(selection)
    print(f"{len(specs)} models, {len(skipped)} not built", flush=True)
    print(TABLE_HEAD)
    records, start = [], time.perf_counter()
    for i, spec in enumerate(specs, 1):
        print(f"  [{i}/{len(specs)}] {spec} ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run([sys.executable, __file__, "--measure", spec], stdout=subprocess.PIPE,
                                  text=True, timeout=timeout, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            rows = json.loads(lines[-1][len("RESULT "):]) if lines else [
                {"spec": spec, "mode": m, "note": f"the process failed (exit {done.returncode})"}
                for m in THIRD_PARTY_MODES]
        except subprocess.TimeoutExpired:
            rows = [{"spec": spec, "mode": m, "note": f"stopped after {timeout:.0f} s"} for m in THIRD_PARTY_MODES]
        records += rows
        print(_row(spec, rows), flush=True)
        if show_sites:
            print(_sites(rows))
    print(_summary(records, skipped))
    print(f"{len(specs)} models in {time.perf_counter() - start:.0f} s")
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps({"records": records, "skipped": skipped}, indent=1))


def _generic(reason: str) -> str:
    """A near-miss reason with its sizes, node names and symbols blanked, to group alike ones."""
    import re

    reason = re.sub(r"\bs\d+\b", "s*", reason)
    reason = re.sub(r"\b(mul|add|rsqrt|output|view|cat|sub|neg|getitem|slice|expand|clone|to)_\d+\b", r"\1_*", reason)
    return re.sub(r"\b\d+\b", "#", reason)


def third_party_listing(json_paths) -> str:
    """The table, the totals and every unfused site of --third-party --json files (merged),
    the sites grouped: per category, each distinct (near-miss reason, source line) or silent
    site's source, with its count per mode and the models. Later records of a model replace
    earlier ones (a re-run of some models after a whole survey)."""
    import third_party_sites

    records, skipped = [], []
    for json_path in json_paths:
        data = json.loads(pathlib.Path(json_path).read_text())
        # attributed again as third_party_sites does now, where a record keeps its census and items
        records += [third_party_sites.reattribute(r) if "census" in r else r for r in data["records"]]
        skipped += [tuple(s) for s in data["skipped"] if tuple(s) not in skipped]
    latest = {(r["spec"], r["mode"]): r for r in records}
    records = list(latest.values())
    by_model = collections.defaultdict(list)
    for record in records:
        by_model[record["spec"]].append(record)
    out = [TABLE_HEAD, *(_row(spec, rows) for spec, rows in by_model.items()), _summary(records, skipped), ""]
    groups = collections.defaultdict(lambda: {"modes": collections.Counter(), "models": set(), "example": ""})
    for record in records:
        model = record["spec"]
        for category, pass_name, reason, where in record.get("near_reasons", []):
            where_code = where.split(" @ ", 1)[-1]
            group = groups[(category, "near", pass_name, _generic(reason), where_code)]
            group["modes"][record["mode"]] += 1
            group["models"].add(model)
            group["example"] = reason
        for kind in ("silent", "eager"):
            for site in record.get(kind, []):
                group = groups[(site["category"], kind, "", "", site["source"])]
                group["modes"][record["mode"]] += 1
                group["models"].add(model)
                group["example"] = site.get("why", "")
    lines = []
    for (category, kind, pass_name, reason, where), group in sorted(
            groups.items(), key=lambda item: (item[0][0], item[0][1], -sum(item[1]["modes"].values()))):
        modes = ", ".join(f"{m} {n}" for m, n in sorted(group["modes"].items()))
        models = ", ".join(sorted(group["models"]))
        example = " ".join(group["example"].split())  # some reasons hold a multi-line dump
        what = {"near": f"near miss ({pass_name}): {example[:600]}", "silent": "silent",
                "eager": f"in eager: {example[:600]}"}[kind]
        lines.append(f"- **{category}**, {what}\n  - at `{where}`\n  - {modes}; {models}")
    return "\n".join(out + lines)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*")
    parser.add_argument("--limit", type=int, help="only the first N models")
    parser.add_argument("--reasons", action="store_true", help="print each model's near-miss reasons")
    parser.add_argument("--third-party", action="store_true",
                        help="survey torchtune / litgpt / olmo_core / torchtitan_npu models (models: libraries or specs)")
    parser.add_argument("--json", help="--third-party: write every record here")
    parser.add_argument("--timeout", type=float, default=1200, help="--third-party: seconds per model")
    parser.add_argument("--sites", action="store_true", help="--third-party: print each model's unfused sites")
    parser.add_argument("--listing", metavar="JSON", nargs="+",
                        help="print the table, totals and every unfused site, grouped, of --third-party --json "
                             "files (no compile)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the per-model process of --third-party
    args = parser.parse_args(argv)
    if args.listing:
        print(third_party_listing(args.listing))
        return
    if args.measure:
        print("RESULT " + json.dumps(measure_one(args.measure)), flush=True)
        return
    if args.third_party:
        survey_third_party(args.models, args.timeout, args.json, args.sites)
        return
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
