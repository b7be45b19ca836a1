"""Quantized sites fused / present, error vs eager and launches per layer (issue 30's closing note).

Two tables, every row compiled with the CPU emulation backend (all passes on) in bf16 and
fp16, static and dynamic=True:

* spellings: one module per spelling of tests/quant_modules.py (torchao-style W8A8, vLLM's
  reference quant + compressed-tensors' dequantize, compressed-tensors int8 weight-only,
  HQQ / GPTQ int4 group 32, residual add + RMSNorm + W8A8 linear, int8 MoE experts
  weight-only and W8A8, SwiGLU + per-token quant), torchao's own tensor
  subclasses on one nn.Linear, and the three look-alikes that must stay near misses.
  "present" is what the module computes, counted by construction (one activation
  quantization and one quantized GEMM per W8A8 linear, one dequantized GEMM per weight-only
  linear, one norm + quant per block); "fused" is the report's sites per pass.
* models: a tiny transformers Llama and Qwen3-MoE with hand-written W8A8 linears
  (quant_modules.quantize_linears), and loaded through transformers with torchao
  (TorchAoConfig: Int8DynamicActivationInt8WeightConfig = W8A8 dynamic,
  IntxWeightOnlyConfig(int4, PerGroup(32)) = W4A16), as tests/test_quant_models.py does;
  compressed-tensors checkpoints (W8A8 int-quantized, W4A16 pack-quantized) as well.
  Also the Qwen3-MoE with int8 experts (quant_modules.quantize_experts: W8A16, and W8A8 with
  each expert GEMM's input quantized per token); "present" counts the nn.Linear modules
  quantized, or for those the expert GEMMs (two per layer). Launches per layer: the report's
  estimate (GraphCost before the passes -> after; the Ascend910B roofline's launch count
  after) at 3 layers minus 2 layers (layer 0's input norm has no residual add in front).

Errors are max |compiled - eager| of the same module (eager runs the same quantized math);
for models also the minimum cosine similarity of the logits rows and the argmax agreement.

    .venv/bin/python benchmarks/quant_sites.py                       # both tables
    .venv/bin/python benchmarks/quant_sites.py --table spellings --dtype bfloat16 --static-only
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch  # noqa: E402

import npu_fx_fusion as nff  # noqa: E402
from npu_fx_fusion.backend import EmulationBackend  # noqa: E402
from npu_fx_fusion.tiny_models import build_hf  # noqa: E402
import quant_modules as qm  # noqa: E402

QUANT_PASSES = ("dynamic_quant", "quant_matmul", "weight_quant_matmul", "add_rms_norm_quant", "quant_grouped_matmul",
                "swiglu_quant")
SHORT = {"dynamic_quant": "dq", "quant_matmul": "qmm", "weight_quant_matmul": "wqmm", "add_rms_norm_quant": "norm+q",
         "quant_grouped_matmul": "qgmm", "swiglu_quant": "swiglu+q"}


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _ExpertRows(torch.nn.Module):
    """Int8Experts on the input's rows, the rows split over its 3 experts at fixed offsets (the
    middle expert gets none)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts
        self.register_buffer("offs", torch.tensor([3, 3, 10], dtype=torch.int32))

    def forward(self, x):
        return self.experts(x.reshape(-1, x.shape[-1]), self.offs)


def _swiglu_then_quant(gate_up):
    # a W8A8 MLP's activation: silu(gate) * up, quantized per token (vLLM's reference)
    gate, up = gate_up.chunk(2, dim=-1)
    h = torch.nn.functional.silu(gate) * up
    return qm.vllm_ref_dynamic_per_token_quant(h.reshape(-1, h.shape[-1]))


def _experts(dtype, **kwargs):
    return _ExpertRows(qm.Int8Experts(dtype, k=64, **kwargs))


def _linear(dtype, out=32, k=64):
    torch.manual_seed(1)
    return torch.nn.Linear(k, out, bias=False).to(dtype)


def _torchao_linear(dtype, config):
    from torchao.quantization import quantize_

    module = torch.nn.Sequential(_linear(dtype))
    quantize_(module, config)
    return module


def _torchao_configs():
    from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig,
                                      IntxWeightOnlyConfig)
    from torchao.quantization.granularity import PerGroup

    return {"w8a8": Int8DynamicActivationInt8WeightConfig(), "w8a16": Int8WeightOnlyConfig(),
            "w4a16": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}


# name -> (module factory(dtype), number of inputs, sites present per pass)
SPELLINGS = {
    "torchao-style W8A8 (amax/127, round, clamp, _int_mm)":
        (lambda d: qm.TorchaoStyleW8A8Linear.from_float(_linear(d)), 1, {"dynamic_quant": 1, "quant_matmul": 1}),
    "vLLM ref quant + compressed-tensors dequantize + F.linear":
        (lambda d: qm.VllmRefW8A8Linear.from_float(_linear(d)), 1, {"dynamic_quant": 1, "quant_matmul": 1}),
    "compressed-tensors channel int8 weight-only":
        (lambda d: qm.CompressedTensorsW8A16Linear.from_float(_linear(d)), 1, {"weight_quant_matmul": 1}),
    "HQQ int4 g32 (uint8 pairs, zero points)":
        (lambda d: qm.HqqW4Linear.from_float(_linear(d)), 1, {"weight_quant_matmul": 1}),
    "GPTQ int4 g32 (int32 qweight / qzeros)":
        (lambda d: qm.GptqW4Linear.from_float(_linear(d)), 1, {"weight_quant_matmul": 1}),
    "residual add + RMSNorm + per-token quant + W8A8 matmul":
        (lambda d: qm.QuantizedDecoderBlock(64, 32, dtype=d), 2,
         {"dynamic_quant": 1, "quant_matmul": 1, "add_rms_norm_quant": 1}),
    "torchao Int8DynamicActivationInt8WeightConfig (nn.Linear)":
        (lambda d: _torchao_linear(d, _torchao_configs()["w8a8"]), 1, {"dynamic_quant": 1, "quant_matmul": 1}),
    "torchao Int8WeightOnlyConfig (nn.Linear)":
        (lambda d: _torchao_linear(d, _torchao_configs()["w8a16"]), 1, {"weight_quant_matmul": 1}),
    "torchao IntxWeightOnlyConfig int4 PerGroup(32) (nn.Linear)":
        (lambda d: _torchao_linear(d, _torchao_configs()["w4a16"]), 1, {"weight_quant_matmul": 1}),
    "int8 experts weight-only (compressed-tensors channel, transformers grouped GEMM)":
        (lambda d: _experts(d), 1, {"quant_grouped_matmul": 1}),
    "int8 experts weight-only with zero points":
        (lambda d: _experts(d, zero=True), 1, {"quant_grouped_matmul": 1}),
    "int8 experts weight-only, stored (E, K, N)":
        (lambda d: _experts(d, layout="kn"), 1, {"quant_grouped_matmul": 1}),
    "W8A8 experts (vLLM ref quant + compressed-tensors dequantize + grouped GEMM)":
        (lambda d: _experts(d, activation=qm.vllm_ref_dynamic_per_token_quant), 1,
         {"dynamic_quant": 1, "quant_grouped_matmul": 1}),
    "SwiGLU + per-token quant (a W8A8 down projection's input)":
        (lambda d: _Fn(_swiglu_then_quant), 1, {"dynamic_quant": 1, "swiglu_quant": 1}),
    "look-alike: int8 experts per group of 8":
        (lambda d: _experts(d, group=8), 1, {"quant_grouped_matmul": 1}),
    "look-alike: per-tensor scale":
        (lambda d: _Fn(qm.per_tensor_quant), 1, {"dynamic_quant": 1}),
    "look-alike: amax / 127.5":
        (lambda d: _Fn(qm.over_127_5_quant), 1, {"dynamic_quant": 1}),
    "look-alike: round half away from zero":
        (lambda d: _Fn(qm.half_away_from_zero_quant), 1, {"dynamic_quant": 1}),
}
LOOK_ALIKES = {name for name in SPELLINGS if name.startswith("look-alike")}


def _inputs(dtype, count, shape=(2, 5, 64)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=gen).to(dtype) for _ in range(count)]


def _run(module, inputs, dynamic, fullgraph):
    torch._dynamo.reset()
    backend = EmulationBackend(nff.FusionConfig())
    compiled = torch.compile(module, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    with torch.no_grad():
        expected = module(*inputs)
        actual = compiled(*inputs)
    if not backend.report.graphs:
        raise RuntimeError("nothing was compiled")
    return actual, expected, backend.report


def _float_leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]  # noqa: SLF001


def _error(actual, expected) -> str:
    """Per output: max |a - e| and max |e|, and the difference in ulps of the output's dtype at
    max |e| (an ulp of a value near 0 would overstate it); integer outputs in steps."""
    parts = []
    for a, e in zip(_float_leaves(actual), _float_leaves(expected)):
        diff = (a.double() - e.double()).abs().max().item()
        if e.is_floating_point():
            scale = e.abs().max().reshape(1)
            ulp = (torch.nextafter(scale, torch.full_like(scale, float("inf"))) - scale).double().item()
            parts.append(f"{diff:.3g} of {scale.item():.3g} ({diff / ulp:.2g} ulp at scale)")
        else:
            parts.append(f"{int(diff)} int step")
    return "; ".join(parts)


def _fused(report) -> dict:
    return {p: report.counts.get(p, 0) for p in QUANT_PASSES}


def _near_misses(report) -> list[str]:
    found = collections.Counter(f"{m.pass_name}: {m.reason}" for m in report.near_misses if m.pass_name in QUANT_PASSES)
    return [f"{n} x {reason}" for reason, n in found.items()]


def _fraction(fused: dict, present: dict) -> str:
    return ", ".join(f"{SHORT[p]} {fused.get(p, 0)}/{n}" for p, n in present.items())


def spellings_table(dtypes, modes, out):
    out(f"| spelling | dtype | shapes | fused / present | fused ops | max error vs eager | quant near misses |")
    out("|---|---|---|---|---|---|---|")
    totals = collections.Counter()
    for name, (factory, n_inputs, present) in SPELLINGS.items():
        for dtype in dtypes:
            for dynamic in modes:
                tag = "dynamic" if dynamic else "static"
                try:
                    actual, expected, report = _run(factory(dtype), _inputs(dtype, n_inputs), dynamic, True)
                except Exception as exc:  # a row that fails says so; the others still run
                    out(f"| {name} | {str(dtype)[6:]} | {tag} | FAILED | | | {type(exc).__name__}: {str(exc)[:200]} |")
                    traceback.print_exc()
                    continue
                fused = _fused(report)
                kind = "look-alike" if name in LOOK_ALIKES else "spelling"
                totals[kind, "present"] += sum(present.values())
                totals[kind, "fused"] += sum(min(fused.get(p, 0), n) for p, n in present.items())
                ops = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in sorted(report.fused_ops.items()))
                misses = "<br>".join(_near_misses(report)) or "-"
                out(f"| {name} | {str(dtype)[6:]} | {tag} | {_fraction(fused, present)} | {ops or '-'} | "
                    f"{_error(actual, expected)} | {misses} |")
    return totals


# ---- models --------------------------------------------------------------------------------------
def _hand_written(model_type, dtype, layers, tmp):
    tiny = build_hf(model_type, dtype=dtype, num_layers=layers)
    quantized = qm.quantize_linears(tiny.model, qm.TorchaoStyleW8A8Linear.from_float)
    return tiny, quantized


def _torchao(scheme):
    def build(model_type, dtype, layers, tmp):
        from transformers import AutoModelForCausalLM, TorchAoConfig

        tiny = build_hf(model_type, dtype=dtype, num_layers=layers)
        path = os.path.join(tmp, f"{model_type}-{layers}")
        tiny.model.lm.save_pretrained(path)  # a local checkpoint: torchao quantizes it at load
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                  quantization_config=TorchAoConfig(_torchao_configs()[scheme]))
        tiny.model.lm = lm.eval()
        quantized = sum(type(m.weight).__name__ in ("Int8Tensor", "IntxUnpackedToInt8Tensor")
                        for m in lm.modules() if isinstance(m, torch.nn.Linear))
        return tiny, quantized
    return build


def _compressed_tensors(scheme):
    def build(model_type, dtype, layers, tmp):
        import test_quant_models as tqm  # the test's own checkpoint writer
        from compressed_tensors.offload import remove_dispatch
        from transformers import AutoModelForCausalLM

        if model_type != "llama" or layers != 2:
            raise NotImplementedError("the test's checkpoint writer builds the default 2-layer Llama")
        path = os.path.join(tmp, f"ct-{scheme}-{dtype}")
        tiny, _ = tqm._compressed_tensors_checkpoint(path, scheme, dtype)  # noqa: SLF001
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        quantized = sum(1 for m in lm.modules() if hasattr(m, "weight_scale"))
        with torch.no_grad():
            lm(tiny.example_inputs[0])  # the decompress hook runs on the first forward
        remove_dispatch(lm)
        tiny.model.lm = lm
        return tiny, quantized
    return build


def _int8_experts(scheme):
    def build(model_type, dtype, layers, tmp):
        if model_type != "qwen3_moe":
            raise NotImplementedError("int8 experts: MoE models only")
        tiny = build_hf(model_type, dtype=dtype, num_layers=layers)
        return tiny, qm.quantize_experts(tiny.model, scheme)
    return build


MODELS = {
    "hand-written W8A8 (TorchaoStyleW8A8Linear)": (_hand_written, {"dynamic_quant", "quant_matmul"}),
    "int8 experts W8A16 (quant_modules.quantize_experts)": (_int8_experts("w8a16"), {"quant_grouped_matmul"}),
    "int8 experts W8A8 (quant_modules.quantize_experts)": (_int8_experts("w8a8"),
                                                           {"dynamic_quant", "quant_grouped_matmul"}),
    "torchao W8A8 dynamic (Int8DynamicActivationInt8WeightConfig)": (_torchao("w8a8"), {"dynamic_quant", "quant_matmul"}),
    "torchao W4A16 g32 (IntxWeightOnlyConfig int4 PerGroup(32))": (_torchao("w4a16"), {"weight_quant_matmul"}),
    "compressed-tensors W8A8 (int-quantized)": (_compressed_tensors("w8a8"), {"dynamic_quant", "quant_matmul"}),
    "compressed-tensors W4A16 g32 (pack-quantized)": (_compressed_tensors("w4a16"), {"weight_quant_matmul"}),
}


def _model_run(build, model_type, dtype, layers, dynamic, tmp):
    tiny, quantized = build(model_type, dtype, layers, tmp)
    actual, expected, report = _run(tiny.model, tiny.example_inputs, dynamic, False)
    before = sum(g.cost_before.launches for g in report.graphs)
    after = sum(g.cost_after.launches for g in report.graphs)
    roofline_before = sum(g.roofline_before["Ascend910B"].launches for g in report.graphs if g.roofline_before)
    roofline_after = sum(g.roofline_after["Ascend910B"].launches for g in report.graphs if g.roofline_after)
    return dict(actual=actual, expected=expected, report=report, quantized=quantized, before=before, after=after,
                roofline=(roofline_before, roofline_after))


def _logits_error(actual, expected) -> str:
    a, e = actual.float().flatten(0, -2), expected.float().flatten(0, -2)
    cosine = torch.nn.functional.cosine_similarity(a, e, dim=-1).min().item()
    agree = (a.argmax(-1) == e.argmax(-1)).float().mean().item()
    return f"max {(a - e).abs().max().item():.3g} of {e.abs().max().item():.3g}; cos {cosine:.5f}; argmax {agree:.0%}"


def models_table(dtypes, modes, model_types, schemes, out):
    out("| model | scheme | dtype | shapes | quantized linears (or expert GEMMs) | fused (2 layers) | fused ops | logits vs eager | "
        "launches / layer (GraphCost before -> after; 910B roofline before -> after) | quant near misses |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in schemes:
            build, passes = MODELS[scheme]
            for model_type in model_types:
                for dtype in dtypes:
                    for dynamic in modes:
                        tag = "dynamic" if dynamic else "static"
                        start = time.perf_counter()
                        try:
                            two = _model_run(build, model_type, dtype, 2, dynamic, tmp)
                        except NotImplementedError:
                            continue  # the scheme does not apply to this model type
                        except Exception as exc:
                            out(f"| {model_type} | {scheme} | {str(dtype)[6:]} | {tag} | FAILED | | | | | "
                                f"{type(exc).__name__}: {str(exc)[:200]} |")
                            traceback.print_exc()
                            continue
                        try:
                            three = _model_run(build, model_type, dtype, 3, dynamic, tmp)
                            layer = (f"{three['before'] - two['before']} -> {three['after'] - two['after']}; "
                                     f"{three['roofline'][0] - two['roofline'][0]:g} -> "
                                     f"{three['roofline'][1] - two['roofline'][1]:g}")
                        except NotImplementedError as exc:
                            layer = f"not measured ({exc})"
                        report = two["report"]
                        fused = _fused(report)
                        cells = ", ".join(f"{SHORT[p]} {fused[p]}" for p in QUANT_PASSES if p in passes or fused[p])
                        ops = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in sorted(report.fused_ops.items()))
                        misses = "<br>".join(_near_misses(report)) or "-"
                        graphs = f" ({len(report.graphs)} graphs)" if len(report.graphs) > 1 else ""
                        out(f"| {model_type} | {scheme} | {str(dtype)[6:]} | {tag} | {two['quantized']} | "
                            f"{cells}{graphs} | {ops} | {_logits_error(two['actual'], two['expected'])} | {layer} | "
                            f"{misses} |")
                        others = {p: n for p, n in report.counts.items() if n and p not in QUANT_PASSES}
                        print(f"  {model_type} {scheme} {dtype} {tag}: {time.perf_counter() - start:.0f} s; "
                              f"other passes' sites {others}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=("spellings", "models", "both"), default="both")
    parser.add_argument("--dtype", action="append", choices=("bfloat16", "float16"))
    parser.add_argument("--static-only", action="store_true")
    parser.add_argument("--model", action="append", choices=("llama", "qwen3_moe"))
    parser.add_argument("--scheme", action="append", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16", "float16"])]
    modes = [False] if args.static_only else [False, True]

    def out(line):
        print(line, flush=True)

    if args.table in ("spellings", "both"):
        totals = spellings_table(dtypes, modes, out)
        out(f"\nspelling rows: {totals['spelling', 'fused']} of {totals['spelling', 'present']} sites fused; "
            f"look-alike rows: {totals['look-alike', 'fused']} of {totals['look-alike', 'present']} fused "
            f"(must be 0)\n")
    if args.table in ("models", "both"):
        models_table(dtypes, modes, args.model or ["llama", "qwen3_moe"], args.scheme or list(MODELS), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
