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
`demo` is `report hf:llama` (the README's demo). Exit codes: 0 ok, 1 failure (outputs
differ from eager beyond tolerance, a pass failed, the model failed to run), 2 bad
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
        sub.add_argument("--layers", type=int, default=2, help="layers of hf:/torchtitan: targets")
        sub.add_argument("--disable", default="", help=f"comma-separated passes to turn off: {', '.join(PASS_NAMES)}")
        sub.add_argument("--soc", default=None, choices=SOCS, help="Ascend SoC whose limits to honour")
        sub.add_argument("--mode", default=None, choices=MODES,
                         help="torchair mode to fuse for (max-autotune: only ops with GE converters)")
        sub.add_argument("--verify", action="store_true", help="check every fused site numerically")
        sub.add_argument("--no-npu-dispatch", dest="npu_dispatch", action="store_false",
                         help="fuse the plain CPU trace instead of the graph an NPU compile holds (emulation only)")
        sub.add_argument("--dump-dir", default=None, help="write graphs before/after, drawings and the report here")
        sub.add_argument("--format", default="markdown", choices=("markdown", "json"))
    return parser


def load_target(target: str, dtype: torch.dtype, layers: int) -> tuple[str, torch.nn.Module, tuple]:
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

        tiny = build_torchtitan(rest, dtype=dtype, num_layers=layers)
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
