"""`npu-fx-fusion`: the command line.

    npu-fx-fusion demo [--model llama] [--dtype float32] [--layers 2] [--disable rope,...]

`demo` builds a tiny random-weight transformers model, compiles it with
`torch.compile(model, backend=npu_fx_fusion.get_npu_backend())`, checks the logits
against eager and prints the fusion report. Exit codes: 0 ok, 1 failure (logits differ,
or a pass failed), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from .config import PASS_NAMES, FusionConfig, check_pass_names

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Logit tolerance of the demo: fp32 fusions reorder float operations only; in half
# precision every fused norm may differ by an ulp or two, which the layers after it carry.
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-fx-fusion", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a tiny transformers model with fusion and print the report")
    demo.add_argument("--model", default="llama", help="transformers model type (default: llama)")
    demo.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--disable", default="", help=f"comma-separated passes to turn off: {', '.join(PASS_NAMES)}")
    demo.add_argument("--soc", default=None, help="Ascend SoC whose limits to honour")
    demo.add_argument("--dump-dir", default=None, help="write graphs before/after and the report here")
    demo.add_argument("--format", default="markdown", choices=("markdown", "json"))
    return parser


def demo(args: argparse.Namespace) -> int:
    import npu_fx_fusion as nff
    from .tiny_models import build_hf

    disable = [name.strip() for name in args.disable.split(",") if name.strip()]
    config = FusionConfig(disable=check_pass_names(disable, "--disable"), soc=args.soc,
                          dump_dir=args.dump_dir)
    dtype = DTYPES[args.dtype]
    tiny = build_hf(args.model, dtype=dtype, num_layers=args.layers)
    print(f"model: {tiny.name} ({tiny.description})")
    backend = nff.get_npu_backend(fusion_config=config)
    with torch.no_grad():
        expected = tiny.model(*tiny.example_inputs)
        actual = torch.compile(tiny.model, backend=backend)(*tiny.example_inputs)
    report = nff.last_report()
    print(report.to_json() if args.format == "json" else report.to_markdown())
    diff = (actual.float() - expected.float()).abs().max().item()
    tolerance = LOGIT_TOLERANCE[dtype] * max(1.0, expected.float().abs().max().item())
    same = diff <= tolerance
    print(f"logits vs eager: max abs diff {diff:.3g} (tolerance {tolerance:.3g}): {'OK' if same else 'MISMATCH'}")
    if report.errors:
        print(f"pass errors: {report.errors}")
    return 0 if same and not report.errors else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return demo(args)
    except ValueError as exc:  # bad pass names, SoC, model type: an argument problem
        print(f"npu-fx-fusion: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
