"""A user's own model: any transformers causal-LM type, a local config.json, real sizes.

- `hf:TYPE` builds every causal-LM model_type of transformers tiny from its own default
  config (tiny_models.hf_config); the README's Mistral and Gemma run in the default
  suite, a bounded slice of all the others in the slow sweep (NPU_FX_FUSION_HF_SWEEP=all
  for every type; docs/models.md lists the few that do not build and why).
- `hf:DIR` reads a config.json (no hub, no weights), `--layers` keeps one layer of each
  kind first, `--real-dims` traces at the configured sizes on fake tensors: a 61-layer
  DeepSeek-V3-sized config reports in seconds without allocating its weights.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from npu_fx_fusion import tiny_models  # noqa: E402
from npu_fx_fusion.cli import main  # noqa: E402

SWEEP_ENV = "NPU_FX_FUSION_HF_SWEEP"  # "all", or how many types the slow sweep takes
SWEEP_DEFAULT = 8

# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), as a user would point
# the tool at it: 61 layers, the first 3 dense, 256 routed experts, fp8 weights.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "transformers_version": "4.46.3",
}


def _report_json(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", *argv, "--format", "json"])
    return code, (json.loads(out.getvalue()) if out.getvalue() else None)


@pytest.fixture
def deepseek_v3_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG, indent=2))
    return tmp_path


# ---- any model_type (the README's Mistral and Gemma: tests/test_docs.py) -----------------
def test_every_causal_lm_type_is_accepted():
    types = tiny_models.hf_model_types()
    assert len(types) > 150 and set(tiny_models.HF_MODEL_TYPES) <= set(types)
    assert {"mistral", "gemma", "qwen2_moe", "mixtral", "gpt2", "falcon"} <= set(types)
    assert set(tiny_models.HF_KNOWN_FAILURES) <= set(types)


def _sweep_types():
    types = [t for t in tiny_models.hf_model_types() if t not in tiny_models.HF_MODEL_TYPES]
    wanted = os.environ.get(SWEEP_ENV, "")
    if wanted != "all":
        count = int(wanted) if wanted else SWEEP_DEFAULT
        types = types[::max(1, len(types) // count)][:count]  # spread over the alphabet
    return [pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=tiny_models.HF_KNOWN_FAILURES[t]))
            if t in tiny_models.HF_KNOWN_FAILURES else t for t in types]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _sweep_types())
def test_model_type_reports_and_matches_eager(model_type):
    code, doc = _report_json(f"hf:{model_type}")
    assert code == 0, doc and doc["outputs_vs_eager"]
    assert doc["outputs_vs_eager"]["ok"] and not doc["report"]["graphs"][0]["passes"][0]["error"]


# ---- a config.json, cut, tiny or at its sizes ---------------------------------------------
def test_layers_keep_one_layer_of_each_kind():
    fields = {"num_hidden_layers": 61, "first_k_dense_replace": 3,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 55,
              "mlp_only_layers": [10], "per_layer_config": {"5": {"rope_theta": 1e6}}}
    cut = tiny_models._cut_depth(fields, 4)  # noqa: SLF001
    # kept: layer 0 (dense), 3 (MoE), 5 (full attention, its own config), 10 (MLP only)
    assert cut["num_hidden_layers"] == 4 and cut["first_k_dense_replace"] == 1
    assert cut["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert cut["mlp_only_layers"] == [3] and cut["per_layer_config"] == {2: {"rope_theta": 1e6}}
    # fewer layers than kinds: the first kinds; more layers than kinds: the earliest others
    assert tiny_models._cut_depth(fields, 2)["first_k_dense_replace"] == 1  # noqa: SLF001
    assert tiny_models._cut_depth({"num_hidden_layers": 4, "first_k_dense_replace": 1}, 3) == {  # noqa: SLF001
        "num_hidden_layers": 3, "first_k_dense_replace": 1}


def test_config_dir_builds_tiny_with_its_structure(deepseek_v3_dir):
    config = tiny_models.load_hf_config(str(deepseek_v3_dir), num_layers=2)
    assert (config.num_hidden_layers, config.first_k_dense_replace) == (2, 1)  # a dense and a MoE layer
    assert (config.hidden_size, config.n_routed_experts, config.kv_lora_rank) == (64, 8, 32)
    assert config.n_group == 2 and config.rope_parameters["rope_type"] == "yarn"
    code, doc = _report_json(f"hf:{deepseek_v3_dir}", "--layers", "2", "--dtype", "float32")
    assert code == 0 and doc["outputs_vs_eager"]["ok"]
    counts = doc["report"]["counts"]
    assert (counts["moe_gating"], counts["moe_dispatch"], counts["grouped_matmul"]) == (1, 1, 2)


def test_real_dims_report_in_seconds_without_the_weights(deepseek_v3_dir):
    # its own process, so its peak memory is its own: 2 real DeepSeek-V3 layers (one of
    # them 256 experts) and the embeddings would be about 27 GB of bf16 weights
    script = ("import resource, sys\nfrom npu_fx_fusion.cli import main\n"
              f"code = main(['report', {str(deepseek_v3_dir)!r}.join(['hf:', '']), '--real-dims', '--layers', '2',"
              " '--format', 'json'])\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\nsys.exit(code)\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    doc = json.loads(proc.stdout)
    assert doc["target"] == "hf-deepseek_v3-grouped_mm-real_dims-bf16"  # the config's dtype
    assert doc["outputs_vs_eager"]["ok"] is None and "nothing was allocated" in doc["outputs_vs_eager"]["why"]
    counts = doc["report"]["counts"]
    assert (counts["moe_gating"], counts["moe_dispatch"], counts["grouped_matmul"]) == (1, 1, 2)
    assert doc["report"]["counts"]["rope"] == 4
    (graph,) = doc["report"]["graphs"]
    assert graph["estimated_cost"]["before"]["bytes_moved"] > 20e9  # the real sizes were traced
    # the capability checks saw the real rope head dim (64; the tiny build has 16) and dtype
    # (bf16: the tiny fp32 build is turned down for its dtype before the shapes are checked)
    rope_notes = {site["note"] for p in graph["passes"] if p["pass"] == "rope" for site in p["sites"]}
    assert any("npu_interleave_rope needs cos/sin of shape (B, 1, S or 1, 64)" in note for note in rope_notes), rope_notes
    assert peak_kb < 3_000_000, f"peak RSS {peak_kb / 1e6:.1f} GB: weights were allocated"
    assert seconds < 120, f"{seconds:.0f} s"  # about 15 s of CPU on 2 cores


def test_real_dims_of_a_type_take_its_default_sizes():
    tiny = tiny_models.build_hf("qwen3_moe", num_layers=1, real_dims=True, seq_len=8)
    lm = tiny.model.lm
    assert tiny.real_dims and tiny.name == "hf-qwen3_moe-grouped_mm-real_dims-fp32"
    assert lm.config.hidden_size == 2048 and lm.config.num_experts == 128  # Qwen3-30B-A3B's
    weight = lm.model.embed_tokens.weight
    assert type(weight).__name__ == "FakeTensor" or type(weight.data).__name__ == "FakeTensor"
