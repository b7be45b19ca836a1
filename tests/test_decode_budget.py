"""Issue 31's launch budget: launches per decoder layer of one compiled decode step.

benchmarks/decode_budget.py measures it (a tiny transformers model over a StaticCache, one
decode step after an eager prefill; the report's roofline estimate, cost_model.py, of the
graph with two layers subtracted from the graph with one more, so what the layers share
cancels) and checks the logits and the caches against eager. The issue's goal: Llama <=
12, Qwen3 <= 14, a DeepSeek-V3 MoE layer <= 25 (the tiny model's second layer is its first
MoE layer, so two layers minus one is an MoE layer). In a batch of more than one, a Llama layer keeps 13: the q slice of the
merged projection must be copied contiguous for the attention op (an npu_rotary_mul
does it), so q's and k's RoPE stay two calls (tests/test_rope_qk.py); with a batch of one
the slices are dense and the pair is one call.
"""
import importlib.util
import os

import pytest
import torch

import npu_fx_fusion as nff

pytest.importorskip("transformers")

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "decode_budget.py")
_spec = importlib.util.spec_from_file_location("decode_budget", _PATH)
decode_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_budget)


def launches_per_layer(model, batch=2, dtype=torch.float32, dynamic=False):
    one = decode_budget.decode_step(model, 1, dtype, dynamic, batch, {}, nff.FusionConfig())
    two = decode_budget.decode_step(model, 2, dtype, dynamic, batch, {}, nff.FusionConfig())
    assert one["ok"] and two["ok"] and not two["errors"], (one["diff"], two["diff"], two["errors"])
    return two["estimate"]["Ascend910B"][0] - one["estimate"]["Ascend910B"][0]


@pytest.mark.slow
@pytest.mark.parametrize("model, batch, budget", [("llama", 1, 12), ("llama", 2, 13), ("qwen3", 2, 14)])
def test_launches_per_decode_layer(model, batch, budget):
    assert launches_per_layer(model, batch) <= budget


@pytest.mark.slow
def test_launches_per_decode_layer_bf16_dynamic():
    assert launches_per_layer("qwen3", dtype=torch.bfloat16, dynamic=True) <= 14


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_launches_per_deepseek_moe_decode_layer(dtype):
    # bf16 counts on the combine's mixed precision and the norm's fp32 readout for the router
    # (patterns/moe_dispatch.py, add_rms_norm.py: each saves the casts around a call)
    assert launches_per_layer("deepseek_v3", dtype=dtype, dynamic=dtype == torch.bfloat16) <= 25
