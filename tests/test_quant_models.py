"""Quantized transformers models: every quantized linear, activation quantization and norm + quant fuses.

Three ways a tiny transformers model gets quantized linears, each compiled whole:

* hand-written W8A8 modules (tests/quant_modules.py TorchaoStyleW8A8Linear) on every linear of a
  tiny Llama (the issue's spelling: amax / 127, round, clamp, torch._int_mm, the scales): 14
  linears, 14 activation quantizations (merged to 5 calls), 3 norms feeding them fuse with their
  residual add (the first norm has no add in front of it, the last feeds the unquantized
  lm_head);
* torchao through transformers (TorchAoConfig, a local checkpoint, quantized at load):
  Int8DynamicActivationInt8WeightConfig (W8A8) and IntxWeightOnlyConfig(int4, PerGroup(32))
  (W4A16) on a tiny Llama and a tiny Qwen3-MoE. Every linear torchao quantized fuses (its
  Qwen3-MoE experts are not linears in transformers 5.24, torchao leaves them in bf16, and they
  fuse as the unquantized MoE does). torchao's own activation quantization divides by 127.5 (the
  [-128, 127] range's): a near miss each, by design;
* compressed-tensors through transformers (a W8A8 int-quantized and a W4A16 pack-quantized
  checkpoint written here): transformers 5.24 with compressed-tensors 0.20 decompresses every
  weight to the model dtype on the first forward (CompressedTensorsHfQuantizer, ModelCompressor's
  decompress hook) and the quantized forward graph-breaks at every linear (compressed_tensors
  patch_attr calls object(), which dynamo does not trace). What a compile sees then is a bf16
  model with a per-token fake quantization at 127.5: nothing quantized left to fuse, which the
  test asserts rather than hides (docs/passes/quant_matmul.md).

Tolerances: the fused quantization computes in fp32 what torchao / the modules compute in fp32
or bf16; an int8 value can move by one per site and that moves logits through two layers: the
logits are compared by cosine similarity (as tests/test_models.py does) and by the argmax.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import quant_modules as qm
from helpers import near_miss_reasons
from npu_fx_fusion.backend import EmulationBackend
import npu_fx_fusion as nff
from npu_fx_fusion.tiny_models import build_hf

pytestmark = pytest.mark.slow


def _compile(model, inputs, dynamic=False):
    backend = EmulationBackend(nff.FusionConfig())
    with torch.no_grad():
        expected = model(*inputs)
        actual = torch.compile(model, backend=backend, dynamic=dynamic)(*inputs)
    return actual, expected, backend.report


def assert_logits_agree(actual, expected, cosine=0.999):
    a, e = actual.float().flatten(0, -2), expected.float().flatten(0, -2)
    assert torch.nn.functional.cosine_similarity(a, e, dim=-1).min() > cosine
    assert (a.argmax(-1) == e.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("dtype, dynamic", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-dynamic"])
def test_llama_with_every_linear_w8a8_fuses_every_quantized_site(dtype, dynamic):
    tiny = build_hf("llama", dtype=dtype)
    assert qm.quantize_linears(tiny.model, qm.TorchaoStyleW8A8Linear.from_float) == 14
    actual, expected, report = _compile(tiny.model, tiny.example_inputs, dynamic)
    assert report.counts["dynamic_quant"] == 14 and report.counts["quant_matmul"] == 14
    assert report.counts["add_rms_norm_quant"] == 3
    assert report.fused_ops["npu.npu_quant_matmul"] == 14
    # per layer: the attention input's quantization with the input norm (but in layer 0), o_proj's
    # input, the MLP norm's with it, down_proj's input
    assert report.fused_ops["npu.npu_dynamic_quant"] == 5 and report.fused_ops["npu.npu_add_rms_norm_dynamic_quant"] == 3
    ops = report.graphs[0].ops_after
    assert not any(ops.get(op, 0) for op in ("aten._int_mm.default", "aten.round.default", "aten.amax.default"))
    assert near_miss_reasons(report, "add_rms_norm_quant") == [
        "no residual add before the norm: torch_npu 2.13 has no RMSNorm + per-token quant op for A2/A3 "
        "(npu_rms_norm_dynamic_mx_quant is Ascend950's MX format)"]
    assert_logits_agree(actual, expected)


# ---- torchao through transformers --------------------------------------------------------------
def _torchao_model(tmp_path, model_type, scheme, dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny = build_hf(model_type, dtype=dtype)
    tiny.model.lm.save_pretrained(tmp_path)  # a local checkpoint: torchao quantizes it at load
    config = {"w8a8": Int8DynamicActivationInt8WeightConfig(),
              "w4a16": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}[scheme]
    lm = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, quantization_config=TorchAoConfig(config))
    tiny.model.lm = lm.eval()
    quantized = sum(type(m.weight).__name__ in ("Int8Tensor", "IntxUnpackedToInt8Tensor")
                    for m in lm.modules() if isinstance(m, torch.nn.Linear))
    return tiny, quantized


@pytest.mark.parametrize("model_type, linears", [("llama", 14), ("qwen3_moe", 8)])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_torchao_quantized_models_fuse_every_quantized_linear(tmp_path, model_type, linears, scheme):
    tiny, quantized = _torchao_model(tmp_path, model_type, scheme, torch.bfloat16)
    assert quantized == linears  # every nn.Linear but lm_head (the Qwen3-MoE experts are no Linears)
    actual, expected, report = _compile(tiny.model, tiny.example_inputs)
    if scheme == "w8a8":
        assert report.counts["quant_matmul"] == linears == report.fused_ops["npu.npu_quant_matmul"]
        # torchao's activation scale is max(|min|, |max|) / 127.5: each one a near miss saying so
        reasons = near_miss_reasons(report, "dynamic_quant")
        assert len(reasons) == linears and all("127.5" in r for r in reasons)
    else:
        assert report.counts["weight_quant_matmul"] == linears == report.fused_ops["npu.npu_weight_quant_batchmatmul"]
        assert not near_miss_reasons(report, "weight_quant_matmul")
    assert not report.graphs[0].ops_after.get("aten._int_mm.default", 0)
    if model_type == "qwen3_moe":  # the bf16 experts fuse as in the unquantized model
        assert report.counts["moe_dispatch"] == 2 and report.counts["grouped_matmul"] == 4
    assert_logits_agree(actual, expected)


# ---- compressed-tensors through transformers ----------------------------------------------------
def _compressed_tensors_checkpoint(path, scheme, dtype):
    """A tiny Llama quantized by us (per-channel amax / 127 int8, or symmetric int4 per group of
    32) and written in compressed-tensors' format, as llm-compressor writes it."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    tiny = build_hf("llama", dtype=dtype)
    lm = tiny.model.lm
    if scheme == "w8a8":
        groups = {"group_0": {"targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "token", "dynamic": True}}}
        fmt = "int-quantized"
    else:  # llm-compressor's W4A16 preset: symmetric (an asymmetric pack-quantized checkpoint's packed
        # zero points do not load into transformers 5.24: "size mismatch", ckpt (N/8, K/32) vs (N, K/32))
        groups = {"group_0": {"targets": ["Linear"],
                              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                          "group_size": 32}}}
        fmt = "pack-quantized"
    config = QuantizationConfig(config_groups=groups, ignore=["lm_head"], format=fmt, quantization_status="frozen")
    apply_quantization_config(lm, config)
    for module in lm.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.float()
            if scheme == "w8a8":
                module.weight_scale.data.copy_(w.abs().amax(1, keepdim=True) / 127)
            else:
                module.weight_scale.data.copy_(w.unflatten(-1, (-1, 32)).abs().amax(-1) / 7)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(lm)
    lm.save_pretrained(path)
    compressor.update_config(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["format"] == fmt
    return tiny, ct


@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
def test_compressed_tensors_models_leave_nothing_quantized_to_fuse(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    tiny, ct = _compressed_tensors_checkpoint(tmp_path, scheme, torch.bfloat16)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    q_proj = lm.model.layers[0].self_attn.q_proj
    stored = {name: t.dtype for name, t in q_proj.state_dict().items()}
    assert stored.get("weight", stored.get("weight_packed")) in (torch.int8, torch.int32)  # as the checkpoint holds it
    with torch.no_grad():
        lm(tiny.example_inputs[0])  # the decompress hook runs on the first forward
    assert q_proj.weight.dtype == torch.bfloat16  # every weight dequantized, for good
    from compressed_tensors.offload import remove_dispatch

    remove_dispatch(lm)  # compressed-tensors' offloading wrappers break the graph at every module
    tiny.model.lm = lm
    actual, expected, report = _compile(tiny.model, tiny.example_inputs)
    # the quantized forward breaks the graph at each linear (patch_attr's object()): many graphs,
    # and no int8 weight left in any of them
    assert len(report.graphs) > 7
    assert not report.fused_ops.get("npu.npu_quant_matmul") and not report.fused_ops.get(
        "npu.npu_weight_quant_batchmatmul")
    if scheme == "w8a8":  # its dynamic activation fake-quantization divides by 127.5
        reasons = near_miss_reasons(report, "dynamic_quant")
        assert reasons and all("127.5" in r for r in reasons)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=0.05)


# ---- launches per layer ------------------------------------------------------------------------
def _launches(num_layers, dtype=torch.bfloat16):
    tiny = build_hf("llama", dtype=dtype, num_layers=num_layers)
    qm.quantize_linears(tiny.model, qm.TorchaoStyleW8A8Linear.from_float)
    _, _, report = _compile(tiny.model, tiny.example_inputs)
    return report.graphs[0].cost_before.launches, report.graphs[0].cost_after.launches


def test_a_w8a8_layer_launches_a_fraction_of_the_kernels():
    # the report's estimate (report.GraphCost): computing ops, one launch each; a layer is the
    # difference between a 3-layer and a 2-layer model (the first layer's norm has no residual add)
    (before2, after2), (before3, after3) = _launches(2), _launches(3)
    per_layer_before, per_layer_after = before3 - before2, after3 - after2
    assert per_layer_after * 5 < per_layer_before, (per_layer_before, per_layer_after)


# ---- Qwen3-MoE with int8 experts (transformers' 3-d expert parameters) ---------------------------
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
@pytest.mark.parametrize("dtype, dynamic", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-dynamic"])
def test_qwen3_moe_with_int8_experts_fuses_every_expert_gemm(scheme, dtype, dynamic):
    # the experts quantized with compressed-tensors' channel scheme (tests/quant_modules.py
    # quantize_experts): weight-only through transformers' own grouped_mm experts forward, W8A8
    # through its routing with each GEMM's input quantized per token (vLLM's reference quant)
    tiny = build_hf("qwen3_moe", dtype=dtype)
    assert qm.quantize_experts(tiny.model, scheme) == 4  # gate_up and down, 2 layers
    actual, expected, report = _compile(tiny.model, tiny.example_inputs, dynamic)
    assert report.counts["quant_grouped_matmul"] == 4 and report.counts["grouped_matmul"] == 0
    assert not near_miss_reasons(report, "quant_grouped_matmul")
    ops = report.graphs[0].ops_after
    fallback = "transformers.grouped_mm_fallback.default"
    assert not ops.get("aten._grouped_mm.default", 0) and not ops.get(fallback, 0)
    if scheme == "w8a8":
        # each GEMM's input quantized per token (amax / 127): npu_dynamic_quant, the down GEMM's with
        # the SwiGLU before it as npu_swiglu_quant; the block with quantized GEMMs is not the routed
        # block moe_dispatch knows: its near miss says so
        assert report.counts["dynamic_quant"] == 4 and report.counts["swiglu_quant"] == 2
        assert report.fused_ops["npu.npu_dynamic_quant"] == 2 and report.fused_ops["npu.npu_swiglu_quant"] == 2
        assert report.counts["moe_dispatch"] == 0 and len(near_miss_reasons(report, "moe_dispatch")) == 2
        assert not ops.get("aten.round.default", 0)
    else:
        assert report.counts["moe_dispatch"] == 2  # the routing around the int8 experts fuses as before
    assert_logits_agree(actual, expected)
