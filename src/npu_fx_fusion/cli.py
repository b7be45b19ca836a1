"""`npu-fx-fusion`: the command line.

    npu-fx-fusion demo [--model llama] [options]
    npu-fx-fusion report TARGET [options]

`report` compiles TARGET with `torch.compile(model, backend=get_npu_backend(...))`, runs
it once, compares its outputs with eager and prints the fusion report: every fused site,
every near miss with its reason, the estimated cost before and after, and with
`--verify` the measured error of each site. TARGET is
  hf:MODEL_TYPE          a tiny random-weight transformers model (tiny_models.HF_MODEL_TYPES;
                         hf:qwen3_moe@batched_mm picks the MoE experts implementation)
  torchtitan:NAME        a tiny torchtitan model (llama3, deepseek_v3)
  module:factory         a callable in an importable module (or path/to/file.py:factory)
                         returning (model, example_inputs)
`demo` is `report hf:llama` (the README's demo). With `--phase prefill|decode` (and
`--max-cache-len N`) an hf: target is compiled as one generation step over a transformers
StaticCache instead, and the report adds per layer which attention calls and cache writes
fused (`demo --phase decode`: one decode step of llama). Exit codes: 0 ok, 1 failure
(outputs differ from eager beyond tolerance, a pass failed, the model failed to run), 2 bad
arguments.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch

from .capabilities import MODES, SOCS
from .config import PASS_NAMES, FusionConfig, check_pass_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Output tolerance, relative to the largest |output|: fp32 fusions reorder float
# operations only; in half precision every fused op may differ by an ulp or two, which
# the layers after it carry.
OUTPUT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


class TargetError(ValueError):
    """A TARGET that names nothing buildable: an argument error (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-fx-fusion", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a tiny transformers model with fusion and print the report")
    demo.add_argument("--model", default="llama", help="transformers model type (default: llama)")
    report = commands.add_parser("report", help="compile TARGET with fusion and print what fused and why")
    report.add_argument("target", help="hf:MODEL_TYPE, torchtitan:NAME, or module:factory")
    for sub in (demo, report):
        sub.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                         help="parameter dtype of hf:/torchtitan: targets")
        sub.add_argument("--layers", type=int, default=None,
                         help="layers of hf:/torchtitan: targets (default: 2; hf:deepseek_v4 3)")
        sub.add_argument("--disable", default="", help=f"comma-separated passes to turn off: {', '.join(PASS_NAMES)}")
        sub.add_argument("--soc", default=None, choices=SOCS, help="Ascend SoC whose limits to honour")
        sub.add_argument("--mode", default=None, choices=MODES,
                         help="torchair mode to fuse for (max-autotune: only ops with GE converters)")
        sub.add_argument("--verify", action="store_true", help="check every fused site numerically")
        sub.add_argument("--no-npu-dispatch", dest="npu_dispatch", action="store_false",
                         help="fuse the plain CPU trace instead of the graph an NPU compile holds (emulation only)")
        sub.add_argument("--dump-dir", default=None, help="write graphs before/after, drawings and the report here")
        sub.add_argument("--format", default="markdown", choices=("markdown", "json"))
        _add_inference_arguments(sub)
    return parser


def load_target(target: str, dtype: torch.dtype, layers: Optional[int]) -> tuple[str, torch.nn.Module, tuple]:
    """(name, model, example_inputs) for a TARGET string; TargetError if it names nothing."""
    kind, sep, rest = target.partition(":")
    if not sep or not rest:
        raise TargetError(f"TARGET {target!r} is not hf:MODEL_TYPE, torchtitan:NAME or module:factory")
    if kind == "hf":
        from .tiny_models import build_hf

        model_type, _, experts = rest.partition("@")
        kwargs = {"experts_implementation": experts} if experts else {}
        tiny = build_hf(model_type, dtype=dtype, num_layers=layers, **kwargs)
        return tiny.name, tiny.model, tuple(tiny.example_inputs)
    if kind == "torchtitan":
        from .tiny_models import build_torchtitan

        tiny = build_torchtitan(rest, dtype=dtype, num_layers=2 if layers is None else layers)
        return tiny.name, tiny.model, tuple(tiny.example_inputs)
    factory = _import_factory(kind, rest)
    built = factory()
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        raise TargetError(f"{target} must return (model, example_inputs), got {type(built).__name__}")
    model, inputs = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return target, model, inputs


def _import_factory(module_name: str, attr: str):
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise TargetError(f"no such file: {module_name}")
            spec = importlib.util.spec_from_file_location("_npu_fx_fusion_target", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise TargetError(f"cannot import {module_name}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TargetError(f"{module_name} has no callable {attr!r}")
    return factory


def _config(args: argparse.Namespace) -> FusionConfig:
    disable = [name.strip() for name in args.disable.split(",") if name.strip()]
    return FusionConfig(disable=check_pass_names(disable, "--disable"), soc=args.soc, mode=args.mode,
                        dump_dir=args.dump_dir, verify=args.verify, npu_dispatch=args.npu_dispatch)


def _max_difference(actual: Any, expected: Any) -> tuple[float, float]:
    """(max |actual - expected|, max |expected|) over every tensor of two output structures."""
    pairs = list(zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)))  # noqa: SLF001
    diffs = [(a.float() - e.float()).abs().max().item() for a, e in pairs
             if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()]
    scales = [e.float().abs().max().item() for _, e in pairs
              if isinstance(e, torch.Tensor) and e.is_floating_point() and e.numel()]
    return max(diffs, default=0.0), max(scales, default=0.0)


def report(args: argparse.Namespace, target: str) -> int:
    import npu_fx_fusion as nff

    if args.phase is not None:  # one generation step over a KV cache (report_inference)
        return report_inference(args, target)
    config = _config(args)  # argument errors before the (slow) model build
    dtype = DTYPES[args.dtype]
    name, model, inputs = load_target(target, dtype, args.layers)
    backend = nff.get_npu_backend(fusion_config=config)
    try:
        with torch.no_grad():
            expected = model(*inputs)
            actual = torch.compile(model, backend=backend)(*inputs)
    except Exception as exc:  # the model or the compile failed: not an argument problem
        print(f"npu-fx-fusion: {name} failed to run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    fusion_report = nff.last_report()
    diff, scale = _max_difference(actual, expected)
    tolerance = OUTPUT_TOLERANCE[dtype] * max(1.0, scale)
    same = diff <= tolerance
    if args.format == "json":
        print(json.dumps({"target": name, "report": fusion_report.to_dict(),
                          "outputs_vs_eager": {"max_abs_diff": diff, "tolerance": tolerance, "ok": same}},
                         indent=2))
    else:
        print(f"target: {name}")
        print(fusion_report.to_markdown())
        print(f"outputs vs eager: max abs diff {diff:.3g} (tolerance {tolerance:.3g}): "
              f"{'OK' if same else 'MISMATCH'}")
        if fusion_report.errors:
            print(f"pass errors: {fusion_report.errors}")
    return 0 if same and not fusion_report.errors else 1


# ---- inference steps: --phase prefill|decode over a StaticCache ----------------------------
def _add_inference_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--phase", default=None, choices=("prefill", "decode"),
                     help="compile one generation step of an hf: target over a KV cache instead of a plain "
                          "forward: the prefill of its prompt, or a decode step (one token, after an eager prefill)")
    sub.add_argument("--cache", default="static", choices=("static",),
                     help="the KV cache of --phase: transformers' StaticCache (allocated before the step)")
    sub.add_argument("--max-cache-len", type=int, default=32, help="positions the StaticCache holds (--phase)")


def _layer_of(location: Any) -> Optional[int]:
    import re

    found = re.search(r"layers\.(\d+)", location.module or "")
    return int(found.group(1)) if found else None


_CACHE_WRITES_PER_SITE = {"kv_cache": 1, "kv_rmsnorm_rope_cache": 2}


def per_layer_summary(fusion_report: Any) -> dict:
    """{layer: {"attention": [fused, unfused], "cache_writes": [fused, unfused], "notes": [...]}}
    over the graph(s) of `fusion_report`: which attention calls and cache writes fused."""
    layers: dict = {}

    def entry(location):
        layer = _layer_of(location)
        return layers.setdefault(layer, {"attention": [0, 0], "cache_writes": [0, 0], "fused_ops": []}) \
            if layer is not None else None

    for site in fusion_report.sites:
        row = entry(site.location)
        if row is None:
            continue
        if site.pass_name == "attention":
            row["attention"][0] += 1
        elif site.pass_name in _CACHE_WRITES_PER_SITE:
            row["cache_writes"][0] += _CACHE_WRITES_PER_SITE[site.pass_name]
        else:
            continue
        row["fused_ops"].append(site.fused_op)
    for miss in fusion_report.near_misses:
        row = entry(miss.location)
        if row is None:
            continue
        if miss.pass_name == "attention":
            row["attention"][1] += 1
        elif miss.pass_name == "kv_cache":
            row["cache_writes"][1] += 1
    for row in layers.values():  # by name: the sites come in pass order, which the passes' declarations set
        row["fused_ops"].sort()
    return dict(sorted(layers.items()))


def _per_layer_markdown(summary: dict) -> list[str]:
    lines = ["| layer | attention calls fused | cache writes fused | fused ops |", "|---|---|---|---|"]
    for layer, row in summary.items():
        attention, writes = row["attention"], row["cache_writes"]
        ops = ", ".join(sorted(set(row["fused_ops"]))) or "-"
        lines.append(f"| {layer} | {attention[0]} of {sum(attention)} | {writes[0]} of {sum(writes)} | {ops} |")
    return lines


def report_inference(args: argparse.Namespace, target: str) -> int:
    """`report TARGET --phase prefill|decode`: build the hf: model with a StaticCache, compile
    the step asked for, run it next to eager on a cache of its own, and report per layer
    which attention calls and cache writes fused; the logits and the caches must match."""
    import npu_fx_fusion as nff
    from .tiny_models import CacheStep, build_hf, static_cache

    config = _config(args)
    kind, _, rest = target.partition(":")
    if kind != "hf" or not rest:
        raise TargetError(f"--phase needs an hf:MODEL_TYPE target (a transformers model with a KV cache), "
                          f"got {target!r}")
    model_type, _, experts = rest.partition("@")
    dtype = DTYPES[args.dtype]
    tiny = build_hf(model_type, dtype=dtype, num_layers=args.layers,
                    **({"experts_implementation": experts} if experts else {}))
    (prompt,) = tiny.example_inputs
    if args.max_cache_len < prompt.shape[1] + 1:
        raise ValueError(f"--max-cache-len {args.max_cache_len} cannot hold the {prompt.shape[1]}-token prompt "
                         "and a decoded token")
    lm = tiny.model.lm
    step = CacheStep(lm)
    reference, cache = (static_cache(lm, batch=prompt.shape[0], max_cache_len=args.max_cache_len)
                        for _ in range(2))
    compiled = torch.compile(step, backend=nff.get_npu_backend(fusion_config=config))
    try:
        with torch.no_grad():
            ids = prompt
            if args.phase == "decode":  # the prompt goes in eagerly; the compiled step is one token
                ids = step(prompt, reference)[:, -1:].argmax(-1)
                step(prompt, cache)
            expected = step(ids, reference)
            actual = compiled(ids, cache)
    except Exception as exc:  # the model or the compile failed: not an argument problem
        print(f"npu-fx-fusion: {tiny.name} failed to run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    fusion_report = nff.last_report()
    states = [(mine, ref) for m, r in zip(cache.layers, reference.layers)
              for mine, ref in ((m.keys, r.keys), (m.values, r.values))]
    checks = {"logits": _max_difference(actual, expected),
              "cache": _max_difference([a for a, _ in states], [e for _, e in states])}
    verdicts = {name: diff <= OUTPUT_TOLERANCE[dtype] * max(1.0, scale) for name, (diff, scale) in checks.items()}
    summary = per_layer_summary(fusion_report)
    name = f"{tiny.name}-{args.phase}-static{args.max_cache_len}"
    if args.format == "json":
        print(json.dumps({"target": name, "report": fusion_report.to_dict(), "per_layer": summary,
                          "vs_eager": {k: {"max_abs_diff": checks[k][0], "ok": verdicts[k]} for k in checks}},
                         indent=2))
    else:
        print(f"target: {name} ({args.phase} step over a StaticCache of {args.max_cache_len} positions)")
        print(fusion_report.to_markdown())
        print(f"## per layer ({args.phase})\n")
        print("\n".join(_per_layer_markdown(summary)))
        for key, (diff, _) in checks.items():
            print(f"{key} vs eager: max abs diff {diff:.3g}: {'OK' if verdicts[key] else 'MISMATCH'}")
        if fusion_report.errors:
            print(f"pass errors: {fusion_report.errors}")
    return 0 if all(verdicts.values()) and not fusion_report.errors else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits with 2 and a usage message on bad syntax
    target = args.target if args.command == "report" else f"hf:{args.model}"
    try:
        return report(args, target)
    except ValueError as exc:  # bad pass names, SoC, model type, TARGET: an argument problem
        print(f"npu-fx-fusion: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
