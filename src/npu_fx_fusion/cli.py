"""`npu-fx-fusion`: the command line.

    npu-fx-fusion demo [--model llama] [options]
    npu-fx-fusion report TARGET [options]

`report` compiles TARGET with `torch.compile(model, backend=get_npu_backend(...))`, runs
it once, compares its outputs with eager and prints the fusion report: every fused site,
every near miss with its reason, the estimated cost before and after, and with
`--verify` the measured error of each site. TARGET is one of TARGET_FORMS below. With
`--real-dims` an hf: target is traced at its configured sizes on fake tensors: no
weights, no numerics, the capability checks see the real head dims, expert counts and
dtypes. `demo` is `report hf:llama` (the README's demo). With `--phase prefill|decode` (and
`--max-cache-len N`) an hf: target is compiled as one generation step over a transformers
StaticCache instead, and the report adds per layer which attention calls and cache writes
fused (`demo --phase decode`: one decode step of llama). Exit codes: 0 ok, 1 failure
(outputs differ from eager beyond tolerance, a pass failed, the model failed to run), 2
bad arguments or settings (a bad NPU_FX_FUSION* environment variable too).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch

from .capabilities import MODES, SOCS
from .config import PASS_NAMES, FusionConfig, check_environment, check_pass_names
from .tiny_third_party import LIBRARIES as THIRD_PARTY_LIBRARIES
from .tiny_third_party import build_third_party

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Output tolerance, relative to the largest |output| (at least 1): fp32 fusions reorder
# float operations only; in half precision every fused op may differ by an ulp or two,
# which the layers after it carry.
OUTPUT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
_TOLERANCE_REASONS = {
    torch.float32: "fp32: fused ops only reorder float operations",
    torch.bfloat16: "bf16: each fused op may round an ulp or two differently, and later layers carry it",
    torch.float16: "fp16: each fused op may round an ulp or two differently, and later layers carry it",
}
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")  # transformers' MoE experts
DOCS = "docs/getting-started.md (\"From the command line\") and docs/models.md in the npu-fx-fusion repository"

TARGET_FORMS = f"""\
TARGET forms:
  hf:TYPE[@experts]    any causal-LM model_type of transformers (llama, mistral, gemma,
                       qwen3_moe, deepseek_v3, ...), built tiny with random weights;
                       @{'/@'.join(EXPERTS_IMPLEMENTATIONS)} picks the MoE experts implementation
  hf:DIR, hf:FILE.json a local model directory or config.json: no hub access, no weights;
                       built tiny with its structure kept, or at its sizes with --real-dims
  torchtitan:NAME      a tiny torchtitan model: llama3, deepseek_v3
  torchtune:BUILDER    a torchtune 0.6.1 model builder (llama3_2_1b, gemma2_2b, qwen2_5_0_5b, ...)
  litgpt:CONFIG        a litgpt 0.5.13 config name (Llama-3.2-1B, Mixtral-8x7B-v0.1, ...)
  olmo_core:BUILDER    an olmo-core 3.0.0 TransformerConfig builder (olmo2_1B, olmo3_7B, ...)
  torchtitan_npu:NAME  torchtitan-npu's own deepseek_v3, deepseek_v32, deepseek_v4, converters
                       off (torchtitan 0.2.2 from .cache/torchtitan-0.2.2: scripts/test.sh)
  module:factory       a callable in an importable module returning (model, example_inputs)
  file.py:factory      the same, from a Python file

--layers N keeps N layers (hf: one of each layer kind first, e.g. a dense and a MoE layer).
--real-dims (hf: targets) traces at the configured sizes with fake tensors: nothing is
allocated or computed, so outputs are not compared; --dtype defaults to the config's.
Docs: {DOCS}."""


class TargetError(ValueError):
    """A TARGET that names nothing buildable: an argument error (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npu-fx-fusion", description=__doc__.split("\n\n")[0],
                                     epilog=TARGET_FORMS, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a tiny transformers model with fusion and print the report")
    demo.add_argument("--model", default="llama", help="transformers model type (default: llama)")
    report = commands.add_parser("report", help="compile TARGET with fusion and print what fused and why",
                                 description="Compile TARGET with fusion, run it once, compare with eager "
                                             "and print what fused, where, and why the rest did not.",
                                 epilog=TARGET_FORMS, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("target", help="hf:TYPE[@experts], hf:DIR, torchtitan:NAME, module:factory "
                                       "or file.py:factory (below)")
    for sub in (demo, report):
        sub.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                         help="parameter dtype of hf:/torchtitan: targets (default: the config's own "
                              "for hf:DIR and --real-dims, else float32)")
        sub.add_argument("--layers", type=int, default=None,
                         help="layers of hf:/torchtitan: targets (default 2; hf:deepseek_v4 3, one per attention kind)")
        sub.add_argument("--seq-len", type=int, default=None,
                         help="tokens per sequence of hf: targets (default 16; hf:deepseek_v4 18)")
        sub.add_argument("--real-dims", action="store_true",
                         help="hf: targets at their configured sizes, traced on fake tensors (no numerics)")
        sub.add_argument("--disable", default="", help=f"comma-separated passes to turn off: {', '.join(PASS_NAMES)}")
        sub.add_argument("--soc", default=None, choices=SOCS,
                         help="Ascend SoC whose limits to honour (default: none; the report lists the fused "
                              "sites an NPU would refuse)")
        sub.add_argument("--mode", default=None, choices=MODES,
                         help="torchair mode to fuse for (max-autotune: only ops with GE converters)")
        sub.add_argument("--verify", action="store_true", help="check every fused site numerically")
        sub.add_argument("--no-npu-dispatch", dest="npu_dispatch", action="store_false",
                         help="fuse the plain CPU trace instead of the graph an NPU compile holds (emulation only)")
        sub.add_argument("--dump-dir", default=None,
                         help="write report.html, the graphs before/after, drawings and the report here")
        sub.add_argument("--format", default="markdown", choices=("markdown", "json"))
        sub.add_argument("--traceback", action="store_true",
                         help="when the model fails to build or run, print the whole traceback, not one line")
        sub.add_argument("--allow-unknown-keys", action="store_true",
                         help="hf:DIR / hf:FILE.json: build a config.json whose keys look misspelt as it is")
        _add_inference_arguments(sub)
    return parser


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or spec.endswith(".json") or spec in (".", "..")


def load_target(target: str, dtype: Optional[torch.dtype], layers: Optional[int], *, real_dims: bool = False,
                seq_len: Optional[int] = None, allow_unknown_keys: bool = False) -> tuple[str, torch.nn.Module, tuple, bool]:
    """(name, model, example_inputs, real_dims) for a TARGET string; TargetError if it
    names nothing. dtype None: the config's own (hf:DIR, --real-dims), else float32;
    layers / seq_len None: the target's defaults (2 layers, 16 tokens; tiny_models.build_hf's
    per-type ones); allow_unknown_keys: tiny_models.load_hf_config's."""
    kind, sep, rest = target.partition(":")
    if not sep or not rest:
        raise TargetError(f"TARGET {target!r} is not hf:TYPE, hf:DIR, torchtitan:NAME, "
                          f"{', '.join(f'{kind}:NAME' for kind in THIRD_PARTY_LIBRARIES)} or module:factory")
    if real_dims and kind != "hf":
        raise TargetError("--real-dims applies to hf: targets (transformers configs) only")
    if kind == "hf":
        return _load_hf(rest, dtype, layers, real_dims, seq_len, allow_unknown_keys)
    if kind == "torchtitan":
        from .tiny_models import TORCHTITAN_MODELS, build_torchtitan

        if rest not in TORCHTITAN_MODELS:
            raise TargetError(f"unknown torchtitan model {rest!r}; {_did_you_mean(rest, TORCHTITAN_MODELS)}"
                              f"supported: {', '.join(TORCHTITAN_MODELS)}")

        tiny = build_torchtitan(rest, dtype=dtype or torch.float32, num_layers=2 if layers is None else layers)
        return tiny.name, tiny.model, tuple(tiny.example_inputs), False
    if kind in THIRD_PARTY_LIBRARIES:

        sizes = {k: v for k, v in (("num_layers", layers), ("seq_len", seq_len)) if v is not None}
        try:
            tiny = build_third_party(kind, rest, dtype=dtype or torch.float32, **sizes)
        except (ValueError, ImportError, RuntimeError) as exc:  # an unknown name, a library not installed
            raise TargetError(f"{target}: {str(exc).splitlines()[0]}") from None
        return tiny.name, tiny.model, tuple(tiny.example_inputs), False
    factory = _import_factory(kind, rest)
    try:
        built = factory()
    except Exception as exc:  # the user's factory raised: their code failed, not the TARGET
        raise TargetFailed(f"{target} failed to build", exc) from exc
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        raise TargetError(f"{target} must return (model, example_inputs), got {type(built).__name__}")
    model, inputs = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return target, model, inputs, False


def _did_you_mean(given: str, valid: Sequence[str]) -> str:
    from .tiny_models import did_you_mean

    return did_you_mean(given, valid)


def _load_hf(spec: str, dtype: Optional[torch.dtype], layers: Optional[int], real_dims: bool,
             seq_len: Optional[int], allow_unknown_keys: bool = False) -> tuple[str, torch.nn.Module, tuple, bool]:
    from .tiny_models import (build_hf, build_hf_from_config, hf_config, hf_model_types, load_hf_config,
                              unknown_model_type)

    kwargs = {}
    base, at, experts = spec.rpartition("@")
    if at and not _looks_like_path(experts):
        if experts not in EXPERTS_IMPLEMENTATIONS:
            raise TargetError(f"hf:{spec}: unknown experts implementation {experts!r}; "
                              f"{_did_you_mean(experts, EXPERTS_IMPLEMENTATIONS)}"
                              f"valid: {', '.join(EXPERTS_IMPLEMENTATIONS)}")
        spec, kwargs = base, {"experts_implementation": experts}
    if _looks_like_path(spec) or (os.path.isdir(spec) and spec not in hf_model_types()):
        try:
            config = load_hf_config(spec, num_layers=2 if layers is None else layers, real_dims=real_dims,
                                    allow_unknown_keys=allow_unknown_keys)
        except ValueError as exc:  # no config.json there, or not one transformers can read
            raise TargetError(f"hf:{spec}: {exc}") from None
        tiny = build_hf_from_config(config, dtype=dtype, real_dims=real_dims, seq_len=seq_len or 16,
                                    description=f"{config.model_type} from {spec}", **kwargs)
    else:
        if spec not in hf_model_types():
            raise TargetError(f"hf:{spec}: {unknown_model_type(spec)}; or give hf:path/to/model_dir")
        if dtype is None and real_dims:  # the type's own default dtype, when it names one
            dtype = getattr(hf_config(spec, num_layers=2 if layers is None else layers, real_dims=True), "dtype", None)
            dtype = dtype if dtype in DTYPES.values() else None
        tiny = build_hf(spec, dtype=dtype or torch.float32, num_layers=layers, real_dims=real_dims,
                        seq_len=seq_len, **kwargs)
    return tiny.name, tiny.model, tuple(tiny.example_inputs), tiny.real_dims


class TargetFailed(Exception):
    """The TARGET names code that then failed (to import, build or run): exit code 1."""

    def __init__(self, what: str, exc: BaseException):
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")
        self.exc = exc


def _import_factory(module_name: str, attr: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise TargetError(f"no such file: {module_name}")
        spec = importlib.util.spec_from_file_location("_npu_fx_fusion_target", module_name)
        module = importlib.util.module_from_spec(spec)
        load = functools.partial(spec.loader.exec_module, module)
    else:
        module = None
        load = functools.partial(importlib.import_module, module_name)
    try:
        module = load() or module
    except ModuleNotFoundError as exc:
        if exc.name != module_name.split(".")[0]:  # the module imports something missing
            raise TargetFailed(f"{module_name} failed to import", exc) from exc
        hint = ""
        if os.path.isfile(module_name.replace(".", os.sep) + ".py"):
            hint = (f"; {module_name.replace('.', os.sep)}.py is here: give the file, "
                    f"{module_name.replace('.', os.sep)}.py:{attr}")
        raise TargetError(f"cannot import {module_name}: {exc}{hint}") from None
    except Exception as exc:  # the module's own code raised while it was imported
        raise TargetFailed(f"{module_name} failed to import", exc) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = [name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))]
        raise TargetError(f"{module_name} has no callable {attr!r}; {_did_you_mean(attr, names)}".rstrip("; "))
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


def _output_dtype(outputs: Any) -> torch.dtype:
    """The lowest precision among the floating outputs: the tolerance follows it."""
    dtypes = [t.dtype for t in torch.utils._pytree.tree_leaves(outputs)  # noqa: SLF001
              if isinstance(t, torch.Tensor) and t.dtype in OUTPUT_TOLERANCE]
    return max(dtypes, key=lambda d: OUTPUT_TOLERANCE[d], default=torch.float32)


def compare_with_eager(actual: Any, expected: Any) -> dict:
    """The outputs-vs-eager verdict: max difference, the tolerance and where it comes from.

    tolerance = relative tolerance of the output dtype x the largest |eager output| (at
    least 1): so it differs between models and dtypes (1e-4 for fp32 logits up to 1,
    4.1e-4 for fp32 logits up to 4.1).
    """
    diff, scale = _max_difference(actual, expected)
    dtype = _output_dtype(expected)
    relative = OUTPUT_TOLERANCE[dtype]
    tolerance = relative * max(1.0, scale)
    return {"max_abs_diff": diff, "tolerance": tolerance, "ok": diff <= tolerance,
            "relative_tolerance": relative, "output_scale": scale,
            "tolerance_rule": (f"{relative:g} ({_TOLERANCE_REASONS[dtype]}) x {max(1.0, scale):.3g} "
                               f"(the largest |eager output|, at least 1)")}


def report(args: argparse.Namespace, target: str) -> int:
    import npu_fx_fusion as nff

    check_environment()  # a bad NPU_FX_FUSION* variable: one line now, not a compile error later
    if args.phase is not None:  # one generation step over a KV cache (report_inference)
        return report_inference(args, target)
    config = _config(args)  # argument errors before the (slow) model build
    if args.real_dims and args.verify:
        raise ValueError("--verify runs every fused site on random data at its shapes; --real-dims "
                         "traces at the configured sizes without computing anything: use one or the other")
    if (args.layers is not None and args.layers < 1) or (args.seq_len is not None and args.seq_len < 1):
        raise ValueError("--layers and --seq-len must be at least 1")
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        name, model, inputs, real_dims = load_target(target, dtype, args.layers, real_dims=args.real_dims,
                                                     seq_len=args.seq_len, allow_unknown_keys=args.allow_unknown_keys)
    except TargetError:
        raise
    except TargetFailed as failed:
        return _failed(args, str(failed), failed.exc)
    except Exception as exc:  # the target names a model, which then failed to build
        return _failed(args, f"{target} failed to build: {type(exc).__name__}: {exc}", exc)
    backend = nff.get_npu_backend(fusion_config=config)
    try:
        with torch.no_grad():
            expected = None if real_dims else model(*inputs)
            actual = torch.compile(model, backend=backend)(*inputs)
    except Exception as exc:  # the model or the compile failed: not an argument problem
        return _failed(args, f"{name} failed to run: {type(exc).__name__}: {exc}", exc)
    fusion_report = nff.last_report()
    verdict = None if real_dims else compare_with_eager(actual, expected)
    fusion_report.target = name
    fusion_report.outputs_vs_eager = verdict if verdict else {"ok": None, "why": NO_NUMERICS}
    if args.dump_dir:  # again, now with the target and the verdict
        from .dumps import Dumper

        Dumper(args.dump_dir).write_reports(fusion_report)
    dumped = _dump_listing(args.dump_dir) if args.dump_dir else []
    if args.format == "json":
        doc = {"target": name, "report": fusion_report.to_dict(), "outputs_vs_eager": fusion_report.outputs_vs_eager}
        if args.dump_dir:
            doc["dump"] = {"dir": os.path.abspath(args.dump_dir),
                           "files": [{"path": path, "what": what} for path, what in dumped]}
        print(json.dumps(doc, indent=2))
    else:
        print(fusion_report.to_markdown())
        if fusion_report.errors:
            print(f"pass errors: {fusion_report.errors}")
        if args.dump_dir:
            print(f"dump: wrote {len(dumped)} files to {os.path.abspath(args.dump_dir)}:")
            print("\n".join(f"  {path}: {what}" for path, what in dumped))
            print(f"  open {os.path.join(os.path.abspath(args.dump_dir), 'report.html')} in a browser\n")
        print(summary_line(fusion_report))
    ok = verdict is None or verdict["ok"]
    return 0 if ok and not fusion_report.errors else 1


def summary_line(fusion_report: Any) -> str:
    """The last line: what fused, what did not, and the verdict, as pytest ends."""
    sites, misses = len(fusion_report.sites), len(fusion_report.near_misses)
    verdict = fusion_report.outputs_vs_eager or {}
    outcome = {True: "outputs match eager", False: "OUTPUTS DIFFER FROM EAGER",
               None: "outputs not compared"}[verdict.get("ok")]
    errors = f", {len(fusion_report.errors)} pass errors" if fusion_report.errors else ""
    return (f"{fusion_report.target}: {sites} fused {'site' if sites == 1 else 'sites'}, "
            f"{misses} near {'miss' if misses == 1 else 'misses'}{errors}, {outcome}")


def _failed(args: argparse.Namespace, message: str, exc: BaseException) -> int:
    """Exit code 1 for a model that failed to import, build or run: one line saying where,
    or with --traceback the whole traceback first."""
    import traceback

    if args.traceback:
        traceback.print_exception(exc, file=sys.stderr)
        print(f"npu-fx-fusion: {message}", file=sys.stderr)
    else:
        where = _user_frame(exc)
        print(f"npu-fx-fusion: {message}" + (f" (at {where})" if where else "")
              + "; --traceback prints the whole traceback", file=sys.stderr)
    return 1


def _user_frame(exc: BaseException) -> str:
    """"file.py:6 in helper": the innermost frame of `exc` outside torch and npu_fx_fusion."""
    import traceback

    library = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(library) and not f.filename.startswith("<")]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


NO_NUMERICS = ("--real-dims traced the model at its configured sizes with fake tensors; "
               "nothing was allocated or computed")


def _dump_listing(dump_dir: str) -> list[tuple[str, str]]:
    from .dumps import describe_dump

    return describe_dump(dump_dir)


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
    if args.real_dims:
        raise ValueError("--phase runs a generation step and compares it with eager; --real-dims computes "
                         "nothing: use one or the other")
    model_type, _, experts = rest.partition("@")
    dtype = DTYPES[args.dtype or "float32"]
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
        return _failed(args, f"{tiny.name} failed to run: {type(exc).__name__}: {exc}", exc)
    fusion_report = nff.last_report()
    states = [(mine, ref) for m, r in zip(cache.layers, reference.layers)
              for mine, ref in ((m.keys, r.keys), (m.values, r.values))]
    checks = {"logits": _max_difference(actual, expected),
              "cache": _max_difference([a for a, _ in states], [e for _, e in states])}
    verdicts = {name: diff <= OUTPUT_TOLERANCE[dtype] * max(1.0, scale) for name, (diff, scale) in checks.items()}
    summary = per_layer_summary(fusion_report)
    name = f"{tiny.name}-{args.phase}-static{args.max_cache_len}"
    fusion_report.target = f"{name} ({args.phase} step over a StaticCache of {args.max_cache_len} positions)"
    if args.format == "json":
        print(json.dumps({"target": name, "report": fusion_report.to_dict(), "per_layer": summary,
                          "vs_eager": {k: {"max_abs_diff": checks[k][0], "ok": verdicts[k]} for k in checks}},
                         indent=2))
    else:
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
    except ValueError as exc:  # bad settings, pass names, SoC, model type, TARGET
        print(f"npu-fx-fusion: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
