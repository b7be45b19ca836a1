"""The seeded differential fuzz of the passes, at scale (issue 15; tests/fuzz_cases.py).

    .venv/bin/python benchmarks/fuzz.py [--cases 1000] [--seed 0] [--family rope ...] [--show N]
    .venv/bin/python benchmarks/fuzz.py --family attention_block --cases 40   # SDPA blocks, mostly training

Case i has seed `seed + i`: `make_case(seed + i)` in tests/fuzz_cases.py rebuilds it. Prints
the figures (cases, outcomes per class, per family) and every failing case's reproducer
(its seed, choices and source). About 0.5 s a case on the shared 2-core machine.
"""
from __future__ import annotations

import argparse
import collections
import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import fuzz_cases  # noqa: E402
from fuzz_cases import BAD_OUTCOMES, FAMILIES, NAMED_FAMILIES, OUTCOMES, make_case, run_case  # noqa: E402


def figures(results) -> str:
    by_family = collections.defaultdict(collections.Counter)
    for r in results:
        by_family[r.case.family][r.outcome] += 1
        by_family["all"][r.outcome] += 1
    shown = [o for o in OUTCOMES if by_family["all"][o]]
    lines = ["| family | cases | " + " | ".join(shown) + " |", "|---" * (len(shown) + 2) + "|"]
    for family in [*FAMILIES, *NAMED_FAMILIES, "all"]:
        counts = by_family.get(family)
        if counts:
            lines.append(f"| {family} | {sum(counts.values())} | " + " | ".join(str(counts[o]) for o in shown) + " |")
    kinds = collections.Counter(r.case.kind for r in results)
    modes = collections.Counter((("train" if r.case.training else "infer") + ("/dyn" if r.case.dynamic else ""))
                                for r in results)
    lines += ["", "case kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
              "modes: " + ", ".join(f"{k} {n}" for k, n in sorted(modes.items())),
              "dtypes: " + ", ".join(f"{fuzz_cases.SHORT[d]} {n}" for d, n in
                                     collections.Counter(r.case.dtype for r in results).items())]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", action="append", choices=FAMILIES + NAMED_FAMILIES,
                        help=f"only these families ({', '.join(NAMED_FAMILIES)}: only when named here)")
    parser.add_argument("--show", type=int, default=1000, help="print at most this many failing cases")
    parser.add_argument("--quiet", action="store_true", help="no progress line per case")
    args = parser.parse_args()
    logging.getLogger("npu_fx_fusion").setLevel(logging.ERROR)  # a reverted pass is an outcome here
    results, start = [], time.perf_counter()
    for i in range(args.cases):
        seed = args.seed + i
        family = args.family[i % len(args.family)] if args.family else None
        result = run_case(make_case(seed, family))
        results.append(result)
        if not args.quiet:
            print(f"[{i + 1}/{args.cases}] {result.case.name} {result.case.kind}: {result.outcome} "
                  f"({result.seconds:.1f} s)", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n{len(results)} cases in {elapsed:.0f} s (seeds {args.seed}..{args.seed + args.cases - 1})\n")
    print(figures(results))
    failing = [r for r in results if r.outcome in BAD_OUTCOMES]
    gaps = collections.Counter(fuzz_cases.known_gap(r.case).name for r in results if r.outcome == fuzz_cases.KNOWN_GAP)
    if gaps:
        print("\nknown gaps hit: " + ", ".join(f"{g} x{n}" for g, n in gaps.items()))
    loose = collections.Counter(r.detail.split("'")[1] for r in results if r.outcome == fuzz_cases.FUSED and r.detail)
    if loose:
        print("gaps whose predicate matched cases that fused (narrow them): "
              + ", ".join(f"{g} x{n}" for g, n in loose.items()))
    print(f"\nfailing cases: {len(failing)}")
    for r in failing[: args.show]:
        print(f"\n--- {r.outcome}: {r.detail}\n{r.case.describe()}")
        if r.fused or r.near_misses:
            print(f"  fused {r.fused}; near misses {r.near_misses}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
