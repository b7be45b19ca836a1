"""Tiny random-weight third-party models for tests and benchmarks.

Fusion patterns are only worth something if they match model code that nobody on this
project wrote. This module builds small instances of real HF transformers and
torchtitan models from configs (random weights, no hub downloads) that run on CPU in
a fraction of a second and trace into a single torch.compile graph. The configs follow
the project's model corpus notes (reference/model_corpus.md; checked with torch 2.13,
transformers 5.24, torchtitan 0.3.0).

Every builder returns a :class:`TinyModel` whose ``model`` takes ``input_ids`` and
returns the logits tensor only, so callers can treat all models alike::

    tm = build_hf("qwen3", dtype=torch.bfloat16)
    out = torch.compile(tm.model, backend=backend)(*tm.example_inputs)

transformers and torchtitan are optional dependencies: they are imported inside the
builders, so importing this module costs nothing and never fails.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = [
    "TinyModel",
    "build_hf",
    "build_hf_from_config",
    "build_torchtitan",
    "build_torchtitan_ep_moe",
    "build_torchtitan_tp",
    "TORCHTITAN_EP_FLAVORS",
    "TORCHTITAN_TP_MODELS",
    "hf_config",
    "hf_model_types",
    "load_hf_config",
    "HF_MODEL_TYPES",
    "TORCHTITAN_MODELS",
]


def did_you_mean(given: str, valid, n: int = 3) -> str:
    """"did you mean 'x' or 'y'? " for the valid names nearest `given` (difflib), else ""."""
    import difflib

    near = difflib.get_close_matches(given, list(valid), n=n, cutoff=0.6)
    return f"did you mean {' or '.join(map(repr, near))}? " if near else ""


@dataclass
class TinyModel:
    """A built model plus the inputs to call it with.

    ``model(*example_inputs)`` returns the logits tensor, shape (batch, seq, vocab).
    The model is in eval mode but its parameters still require grad (so the same
    build serves training tests): compile under ``torch.no_grad()`` to get the
    inference graph rather than a joint forward/backward one.

    ``name`` is filename-safe and unique per build recipe, e.g. ``hf-llama-bf16``,
    ``hf-qwen3_moe-grouped_mm-fp32``, ``torchtitan-llama3-fp32``.

    ``real_dims``: the model is at its configured sizes, its parameters and inputs fake
    tensors (torch's FakeTensorMode: shapes and dtypes, no storage). Calling it, compiled
    or not, computes shapes only: a compile sees the real head dims, expert counts and
    dtypes, and nothing is allocated or computed.
    """

    model: nn.Module
    example_inputs: tuple
    name: str
    description: str = ""
    real_dims: bool = False
    # a model parallelized over ranks: its process groups by mesh dimension ("ep": the
    # expert-parallel group, what FusionConfig(ep_group=...) declares)
    process_groups: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------

_DTYPE_TAGS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_tag(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_TAGS:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_DTYPE_TAGS)}")
    return _DTYPE_TAGS[dtype]


def _random_ids(vocab_size: int, batch: int, seq_len: int) -> torch.Tensor:
    # Start above the special tokens (pad=0, bos=1, eos=2) so no id is treated
    # specially by any model-side logic; the values themselves do not matter.
    return torch.randint(3, vocab_size, (batch, seq_len), dtype=torch.long)


def _import_optional(module: str, install_hint: str) -> Any:
    """Import an optional dependency, turning failure into an actionable message.

    A missing transitive import (torchtitan imports tyro, einops, triton, ... at model
    import time) is reported by name, since "install torchtitan" would not fix it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or "?"
        raise ImportError(
            f"importing {module!r} failed (missing module: {missing}). {install_hint}"
        ) from e


# --------------------------------------------------------------------------------------
# HF transformers
# --------------------------------------------------------------------------------------

_HF_INSTALL_HINT = (
    "Install it with `pip install transformers` (pin your torch version in the same "
    "command, e.g. `pip install transformers 'torch==<your version>'`, so pip does not "
    "replace torch)."
)

# Common to every HF model: small enough for CPU tests, big enough that GQA (4 query
# heads over 2 KV heads) and the MLP's gate/up split are real. Caches and tied
# embeddings are off so the traced graph is a plain prefill with no cache plumbing.
_HF_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    use_cache=False,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# DSA lightning indexers (deepseek_v32 below and the generic builds' _TINY_SIZES): enough
# heads that scores rarely tie exactly (deepseek_v32's comment says why that matters).
_TINY_INDEXER_HEADS = 16

# DeepSeek-V3: MLA with both LoRA ranks non-zero (so q_a_layernorm and kv_a_layernorm
# both exist), and a MoE that uses sigmoid scores + bias with group-limited top-k.
# first_k_dense_replace=1 makes layer 0 dense and the rest MoE, so two layers already
# cover both MLP kinds.
_DEEPSEEK_V3 = dict(
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)

# Per-model additions to _HF_COMMON, and whether the model has routed experts (which
# decides whether `experts_implementation` applies).
_HF_MODELS: dict[str, tuple[dict[str, Any], bool, str]] = {
    "llama": ({}, False, "Llama: RMSNorm, rotate_half RoPE, SwiGLU MLP, GQA SDPA"),
    "qwen3": (
        dict(head_dim=16),
        False,
        "Qwen3: Llama plus per-head q_norm/k_norm RMSNorms",
    ),
    # Phi-3 and GLM-4 fuse gate and up into one projection and rotate part of the head
    # dim (partial_rotary_factor); GLM-4 rotates interleaved pairs (stack(-x2, x1)).
    "phi3": (
        dict(partial_rotary_factor=0.5),
        False,
        "Phi-3: fused qkv and gate_up projections, partial rotate_half RoPE, SwiGLU as up * silu(gate)",
    ),
    "glm4": (
        dict(head_dim=16, partial_rotary_factor=0.5),
        False,
        "GLM-4: fused gate_up, partial RoPE on interleaved pairs, sandwich RMSNorms",
    ),
    "qwen3_moe": (
        dict(head_dim=16, **_QWEN3_MOE),
        True,
        "Qwen3-MoE: Qwen3 attention, softmax top-k router, routed experts",
    ),
    "deepseek_v3": (
        dict(_DEEPSEEK_V3),
        True,
        "DeepSeek-V3: MLA, interleaved rotate_half RoPE, sigmoid group-limited MoE "
        "with a shared expert",
    ),
    # index_topk must stay below seq_len for the indexer to actually drop keys; with
    # the default seq_len=16 it keeps 8 of 16. 16 indexer heads (A.X-K2's; V3.2 has 64):
    # a key scores exactly 0 when relu zeroes all of them, about 2**-heads of the keys, and
    # where such ties fall on the k-th score eager's top-k keeps whichever tied key it
    # happens to (torch: "the indices of tied elements are not guaranteed to be stable"),
    # so the logits would depend on the tie order. With 4 heads 2-4% of the scores were 0,
    # and the fused logits differed from eager by 0.06 for seeds 4 and 5 of this type, by
    # 0.05-0.12 for seed 0 of axk2 and dots3_note (patterns/lightning_indexer.py).
    "deepseek_v32": (
        dict(_DEEPSEEK_V3, index_topk=8, index_head_dim=32, index_n_heads=_TINY_INDEXER_HEADS),
        True,
        "DeepSeek-V3.2: DeepSeek-V3 plus the DSA lightning indexer (top-k sparse mask)",
    ),
}

# ---- DeepSeek-V4 (transformers 5.24 deepseek_v4) ----------------------------------------
# Three layers, one of each attention kind (sliding window, compressed sparse attention
# with its lightning indexer, heavily compressed attention) and both MoE kinds (hash-routed
# first, then top-k). Sizes keep every mechanism live at seq_len 18: CSA's 4:1 compression
# gives 4 blocks (+ a remainder of 2) of which the indexer keeps 3, HCA's 8:1 gives 2 (+ 2);
# mHC over 4 streams with V4's 20 Sinkhorn iterations; the partial RoPE rotates the last 8
# of 32 channels. The sliding window is V4's 128 (the only one sparse_flash_mla takes), so at
# 18 tokens the sliding part of every mask is the causal mask. The real kernels' other limits
# (head_dim 512, HCA ratio 128, top-k 512 / 1024, bf16 only) are not met: the passes fuse in
# emulation and note them on each site. The indexer has _TINY_INDEXER_HEADS heads, as
# deepseek_v32's: a block scores exactly 0 where relu zeroes every head (2**-heads of them),
# and where such ties fall on the k-th score eager's top-k and the fused indexer may keep
# different blocks. With 4 heads 6.5% of the scores were 0, 4 of seeds 0-19 tied at the k-th
# (seeds 8, 10, 13, 18) and the fused logits of seeds 8 and 10 differed from eager by 0.022;
# with 16 none tied and seeds 8, 10 and 13 matched to 2.5e-7.
_DEEPSEEK_V4 = dict(
    num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_n_heads=_TINY_INDEXER_HEADS, index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    intermediate_size=32,  # V4's attribute_map: the experts' (and shared expert's) moe_intermediate_size
)
_DEEPSEEK_V4_LAYERS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_DEEPSEEK_V4_MLPS = ("hash_moe", "moe", "moe")
_HF_MODELS["deepseek_v4"] = (
    _DEEPSEEK_V4, True,
    "DeepSeek-V4: mHC pre/post over 4 streams, sliding / CSA (+ indexer) / HCA attention with sinks, "
    "partial interleaved RoPE, hash and sqrt-softplus routers, clamped SwiGLU experts",
)
# per-model defaults where the common ones do not apply: V4 has eager attention only, and
# its layer schedule is three layers long
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v4": dict(attn_implementation="eager", num_layers=3, seq_len=18),
}


def _deepseek_v4_layer_config(num_layers: int) -> dict[str, Any]:
    return dict(layer_types=[_DEEPSEEK_V4_LAYERS[i % 3] for i in range(num_layers)],
                mlp_layer_types=[_DEEPSEEK_V4_MLPS[i % 3] for i in range(num_layers)])


def _init_deepseek_v4(lm: nn.Module, generator: torch.Generator) -> None:
    """Give V4's zero-initialised buffers and parameters the values a checkpoint has.

    transformers zero-initialises them (real values come from the checkpoint), which would
    make several mechanisms degenerate: tid2eid all 0 routes every token twice to expert 0,
    zero sinks and position biases hide their own code paths, a zero correction bias and
    unit mHC scales hide operand mix-ups. Each hash-table row lists distinct experts.
    """
    for name, module in lm.named_modules():
        kind = type(module).__name__
        if kind == "DeepseekV4HashRouter":
            experts, k = module.num_experts, module.top_k
            rows = [torch.randperm(experts, generator=generator)[:k] for _ in range(module.tid2eid.shape[0])]
            module.tid2eid.copy_(torch.stack(rows))
        elif kind == "DeepseekV4TopKRouter":
            module.e_score_correction_bias.normal_(std=0.1, generator=generator)
        elif kind == "DeepseekV4Attention":
            module.sinks.data.normal_(std=1.0, generator=generator)
        elif kind == "DeepseekV4HyperConnection":
            module.base.data.normal_(std=0.5, generator=generator)
            module.scale.data.uniform_(0.5, 1.5, generator=generator)
        elif kind == "DeepseekV4HyperHead":
            module.hc_base.data.normal_(std=0.5, generator=generator)
        elif kind in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor", "DeepseekV4Indexer"):
            module.position_bias.data.normal_(std=0.5, generator=generator)


def _init_afmoe(lm: nn.Module, generator: torch.Generator) -> None:
    """AFMoE's router gate and expert bias are zero-initialised (init.zeros_ in its
    _init_weights): every token's sigmoid scores tie at 0.5, and which k experts a top-k
    takes is then the kernel's tie-breaking (undocumented for the NPU's, implementation-defined
    for torch.topk), not the model's. A checkpoint's values do not tie."""
    for module in lm.modules():
        if type(module).__name__ == "AfmoeTokenChoiceRouter":
            module.gate.weight.data.normal_(std=module.gate.in_features ** -0.5, generator=generator)
        elif type(module).__name__ == "AfmoeSparseMoeBlock":
            module.expert_bias.data.normal_(std=0.05, generator=generator)


_HF_POST_INIT = {"deepseek_v4": _init_deepseek_v4, "afmoe": _init_afmoe}
# ---- end of the DeepSeek-V4 block --------------------------------------------------------

HF_MODEL_TYPES: tuple[str, ...] = tuple(_HF_MODELS)


# --------------------------------------------------------------------------------------
# Any transformers causal LM: its own config, cut down generically
# --------------------------------------------------------------------------------------
# The curated types above are tuned by hand (the fusions are tested on them). Every other
# causal-LM model_type transformers knows is built from its own default config (or a
# user's config.json) with each size field below cut to at most the given value, so the
# model keeps its structure (MoE, MLA, layer types, rope scaling) at tiny dimensions.
# Values are the ones of _HF_COMMON / _DEEPSEEK_V3, so the generic and the curated builds
# of a type agree where both apply. A field a config does not have is not added.
_TINY_SIZES: dict[str, int] = {
    # widths: 4 query heads of 16 over 2 KV heads, as in _HF_COMMON
    "vocab_size": 256, "hidden_size": 64, "d_model": 64, "n_embd": 64,
    "intermediate_size": 128, "ffn_hidden_size": 128, "n_inner": 128, "d_inner": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "num_attention_heads": 4, "num_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "head_dim": 16, "d_head": 16, "attention_head_size": 16,
    "attention_head_dim": 16, "kv_channels": 16, "rotary_dim": 8, "embedding_dim": 64,
    "attention_hidden_size": 128, "adapter_rank": 8,
    "max_position_embeddings": 256, "n_positions": 256, "context_length": 256, "max_seq_len": 256,
    # routed experts, as _QWEN3_MOE / _DEEPSEEK_V3
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    # MLA and DSA, as _DEEPSEEK_V3 and deepseek_v32 above
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "qk_head_dim": 32, "v_head_dim": 16, "index_topk": 8, "index_head_dim": 32,
    "index_n_heads": _TINY_INDEXER_HEADS,
    # linear attention and state-space layers (Qwen3-Next, Mamba hybrids)
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "state_size": 16, "mamba_d_state": 16, "mamba_d_ssm": 128,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_headdim": 16, "mamba_chunk_size": 16, "chunk_size": 16,
    "time_step_rank": 8, "mamba_dt_rank": 8, "ssm_state_size": 16,
}
# KV-head counts follow the query heads: as many (MHA, MLA), one (MQA), else 2 (GQA).
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "num_query_groups")
# Layer counts: all of them become `num_layers`.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks",
                 "decoder_layers", "encoder_layers")
# Fields some default configs leave None although their model needs a value.
_TINY_WHEN_NONE = {"head_dim": 16, "num_key_value_heads": 2, "num_experts_per_tok": 2}
# Special tokens inside the tiny vocabulary (an embedding rejects ids past its size).
_TINY_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# The few types whose own default config needs more fields to build tiny: type ->
# fields(num_layers).
_GENERIC_FIXUPS: dict[str, Callable[[int], dict[str, Any]]] = {
    # its config checks hidden_size * expand == num_heads * head_dim
    "mamba2": lambda layers: {"num_heads": 8},
    # ReformerModelWithLMHead refuses to run as an encoder; its axial position embedding
    # splits hidden_size in two and max_position_embeddings into axial_pos_shape
    "reformer": lambda layers: {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    # the default leaves layer_types None, which its decoder layers index: conv and
    # attention layers, as its checkpoints alternate them
    "lfm2_moe": lambda layers: {"layer_types": (["conv", "full_attention"] * layers)[:layers]},
    # its last 15 of 35 layers read the KV cache of an earlier layer of their type; a few
    # layers cannot keep that (no earlier layer of each type), so the tiny build shares none
    "gemma3n_text": lambda layers: {"num_kv_shared_layers": 0},
    # the default leaves the expert counts None, which its experts and shared experts read
    "dots1": lambda layers: {"n_routed_experts": 8, "n_shared_experts": 1},
    # X-MOD's adapters are per language; its forward needs to know which one
    "xmod": lambda layers: {"default_language": "en_XX"},
}


# Causal-LM types whose `report hf:TYPE` does not succeed on CPU with transformers 5.24,
# and why (the slow sweep in tests/test_any_hf_model.py holds each to it; docs/models.md
# lists them). The first ones do not build at all; the last ones compute another model on
# the NPU graph before any pass runs. A fusion bug the sweep finds goes at the end, with
# its evidence, until its pass is fixed.
HF_KNOWN_FAILURES: dict[str, str] = {
    "cohere_compass_text": "transformers' default config does not build: it gives no rope parameters for the "
                           "'full_attention' layer type its rotary embedding looks up",
    "dbrx": "transformers' default config does not build: its attn_config has no rope_theta, which "
            "DbrxAttention reads",
    "gemma3n": "its vision tower is a timm model: it needs timm and pillow, which are not installed here",
    "gemma4_assistant": "transformers' default config fails its own validation (hidden_size_per_layer_input "
                        "must be 0, got 256)",
    "gemma4_unified_assistant": "a draft model whose every layer reads the main model's KV cache "
                                "(num_kv_shared_layers = all its layers): it does not run alone",
    "musicgen": "transformers' default config does not build: MusicgenConfig has no dropout, which its "
                "decoder reads",
    "musicgen_melody": "transformers' default config does not build: MusicgenMelodyConfig has no dropout, "
                       "which its decoder reads",
    "qwen4_exp": "transformers' default config does not build: its layer types include sparse (QSA) "
                 "attention whose indexer sizes (indexer_budget, indexer_compress_ratio) it leaves None",
    "qwen4_exp_text": "transformers' default config does not build: its layer types include sparse (QSA) "
                      "attention whose indexer sizes (indexer_budget, indexer_compress_ratio) it leaves None",
    "zamba": "its hybrid layers share one attention block that transformers ties from the first hybrid "
             "layer to the others; a cut of its layout (hybrid layers 4, 10, ...) to a few layers has "
             "one, and transformers refuses to tie it to nothing",
    # the NPU graph (npu_dispatch) differs from the CPU model, before any fusion
    "doge": "the NPU graph is not the CPU model: transformers 5.24's NPU branch of sdpa_attention_forward "
            "(sdpa_attention.py:158-161) makes a float mask `logical_not(mask.bool())`, and Doge's mask is "
            "its dynamic attention bias (dt_states, any value): on an NPU only its exact zeros are attended. "
            "With every pass off (NPU_FX_FUSION=0) the emulated NPU graph differs from eager by 0.52; "
            "--no-npu-dispatch matches exactly",
    "inkling_text": "the NPU graph is not the CPU model, cause not found: with every pass off (NPU_FX_FUSION=0) the "
                    "emulated NPU graph differs from eager by 0.007, and --no-npu-dispatch matches within 6e-9 with "
                    "the passes on. Not the mask conversion alone (sdpa_attention_forward adds its relative position "
                    "bias after the NPU branch makes the causal mask bool)",
}


def hf_model_types() -> tuple[str, ...]:
    """Every model_type the installed transformers builds as a causal LM, sorted.

    build_hf accepts each of these; HF_MODEL_TYPES are the curated ones among them.
    """
    _import_optional("transformers", _HF_INSTALL_HINT)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def unknown_model_type(model_type: str) -> str:
    """One line for a model_type transformers does not build as a causal LM: the nearest
    valid ones, and where the rest are listed (not all of them: there are about 200)."""
    import transformers

    types = hf_model_types()
    guess = did_you_mean(model_type, types)
    return (f"unknown transformers model type {model_type!r}; {guess}transformers {transformers.__version__} "
            f"builds {len(types)} types as causal LMs (docs/survey.md lists them; "
            f"npu_fx_fusion.tiny_models.hf_model_types() returns them)")


def _layer_count(fields: dict[str, Any]) -> Optional[int]:
    counts = [fields[key] for key in _LAYER_COUNTS if isinstance(fields.get(key), int)]
    return max(counts) if counts else None


# Per-layer facts that are not lists as long as the model: counts of leading dense layers
# (DeepSeek's first_k_dense_replace) and lists of layer indices.
_LEADING_DENSE = ("first_k_dense_replace", "num_dense_layers")
_LAYER_INDEX_LISTS = ("mlp_only_layers", "full_attn_idxs")


def _kept_layers(fields: dict[str, Any], depth: int, num_layers: int) -> list[int]:
    """Which `num_layers` of `depth` layers to keep: the first of each kind, then the earliest.

    A layer's kind is what the config says about it alone: its entry in every per-layer
    list (layer_types, mlp_layer_types, ...), whether it is one of the leading dense
    layers or an index list's, its per_layer_config. So `--layers 2` of DeepSeek-V3
    (3 dense layers, then MoE) keeps a dense layer and a MoE layer, and a hybrid keeps an
    attention layer next to its linear ones.
    """
    lists = [value for value in fields.values() if isinstance(value, list) and len(value) == depth]
    per_layer_config = fields.get("per_layer_config") or {}

    def kind(index: int) -> str:
        facts = [value[index] for value in lists]
        facts += [index < fields[key] for key in _LEADING_DENSE if isinstance(fields.get(key), int)]
        facts += [index in fields[key] for key in _LAYER_INDEX_LISTS if isinstance(fields.get(key), list)]
        facts.append(per_layer_config.get(index, per_layer_config.get(str(index))))
        return repr(facts)

    first_of_kind: dict[str, int] = {}
    for index in range(depth):
        first_of_kind.setdefault(kind(index), index)
    kept = sorted(first_of_kind.values())[:num_layers]
    kept += [index for index in range(depth) if index not in kept][:num_layers - len(kept)]
    return sorted(kept)


def _cut_depth(fields: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`fields` (a config's to_dict()) with `num_layers` layers, one of each kind first
    (_kept_layers): every layer count, per-layer list, leading-dense count, layer-index
    list and per_layer_config follows the layers kept. Sub-configs likewise."""
    depth = _layer_count(fields)
    kept = _kept_layers(fields, depth, num_layers) if depth is not None and depth > num_layers else None
    out = {}
    for key, value in fields.items():
        if key in _LAYER_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            value = min(value, num_layers)
        elif isinstance(value, dict) and "model_type" in value:
            value = _cut_depth(value, num_layers)
        elif kept is None:
            pass
        elif isinstance(value, list) and len(value) == depth:
            value = [value[index] for index in kept]
        elif key in _LEADING_DENSE and isinstance(value, int):
            value = sum(index < value for index in kept)
        elif key in _LAYER_INDEX_LISTS and isinstance(value, list):
            value = [new for new, index in enumerate(kept) if index in value]
        elif key == "per_layer_config" and isinstance(value, dict):  # {layer index: overrides}
            value = {new: value[old] for new, index in enumerate(kept)
                     for old in (index, str(index)) if old in value}
        out[key] = value
    return out


def _widths(fields: dict[str, Any]) -> set[int]:
    """Every hidden_size of a config and its sub-configs (the widths other fields repeat)."""
    found = {fields["hidden_size"]} if isinstance(fields.get("hidden_size"), int) else set()
    for value in fields.values():
        if isinstance(value, dict) and "model_type" in value:
            found |= _widths(value)
    return found


def _shrink(fields: dict[str, Any], config_class: Any, widths: Optional[set[int]] = None) -> dict[str, Any]:
    """`fields` with each _TINY_SIZES field at most its tiny value, special tokens inside
    the tiny vocabulary; sub-configs (text_config, vision_config, ...) and per-layer
    overrides (per_layer_config) likewise. A width field that repeats a model width
    (a vision adapter's adapter_out_dim is the text model's hidden_size) follows it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    widths = _widths(fields) if widths is None else widths
    sizes = dict(_TINY_SIZES)
    for standard, own in getattr(config_class, "attribute_map", {}).items():
        if standard in _TINY_SIZES and own not in sizes:  # gpt2's n_embd is its hidden_size
            sizes[own] = _TINY_SIZES[standard]
    heads = fields.get("num_attention_heads")
    out = {}
    for key, value in fields.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if key in _KV_HEADS and is_int and isinstance(heads, int):
            value = min(heads, 4) if value == heads else 1 if value == 1 else 2
        elif key in sizes and is_int:
            value = min(value, sizes[key])
        elif (is_int and value in widths and value > _TINY_SIZES["hidden_size"]
              and key.endswith(("_dim", "_size", "_size_global"))):
            value = _TINY_SIZES["hidden_size"]
        elif key in _TINY_WHEN_NONE and value is None:
            value = _TINY_WHEN_NONE[key]
        elif key in _TINY_TOKENS and is_int:
            value = _TINY_TOKENS[key]
        elif key in _TINY_TOKENS and isinstance(value, list):  # several eos ids
            value = [_TINY_TOKENS[key]]
        elif isinstance(value, dict) and "model_type" in value:
            value = _shrink(value, CONFIG_MAPPING.get(value["model_type"]), widths)
        elif key == "per_layer_config" and isinstance(value, dict):
            value = {index: _shrink({**layer, "num_attention_heads": layer.get("num_attention_heads", heads)},
                                    config_class, widths) if isinstance(layer, dict) else layer
                     for index, layer in value.items()}
            value = {index: {k: v for k, v in layer.items() if k in fields[key][index]}
                     if isinstance(layer, dict) else layer for index, layer in value.items()}
        out[key] = value
    return out


def _config_class(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def hf_config(model_type: str, *, num_layers: int = 2, real_dims: bool = False,
              **config_overrides: Any) -> Any:
    """The transformers config build_hf builds `model_type` from.

    real_dims=False: the curated tiny config of HF_MODEL_TYPES, or for any other causal-LM
    type its default config cut down (_TINY_SIZES). real_dims=True: its default config at
    its own sizes (the reference checkpoint's, for most types), cut to `num_layers`.
    """
    transformers = _import_optional("transformers", _HF_INSTALL_HINT)
    if model_type in _HF_MODELS and not real_dims:
        extra, _, _ = _HF_MODELS[model_type]
        cfg_kwargs = {**_HF_COMMON, **extra, "num_hidden_layers": num_layers}
        if model_type == "deepseek_v4":
            cfg_kwargs.update(_deepseek_v4_layer_config(num_layers))
        cfg_kwargs.update(config_overrides)
        return transformers.AutoConfig.for_model(model_type, **cfg_kwargs)
    if model_type not in hf_model_types():
        raise ValueError(unknown_model_type(model_type))
    config_class = _config_class(model_type)
    defaults = config_class().to_dict()
    fields = _cut_depth(defaults, num_layers)
    if not real_dims:
        fields = _shrink(fields, config_class)
    # Only the changed fields go to the constructor: what it derives from them (head_dim,
    # layer_types, rope parameters per layer type) it derives again at the new sizes.
    changed = {key: value for key, value in fields.items() if defaults.get(key) != value}
    fixups = {} if real_dims or model_type not in _GENERIC_FIXUPS else _GENERIC_FIXUPS[model_type](num_layers)
    return config_class(**{**changed, **fixups, **config_overrides})


def _config_from_fields(config_class: Any, fields: dict[str, Any], num_layers: Optional[int],
                        real_dims: bool, overrides: dict[str, Any]) -> Any:
    """A config.json's fields as its config class reads them (from_dict), cut and shrunk."""
    if num_layers is not None:
        fields = _cut_depth(fields, num_layers)
    if not real_dims:
        fields = _shrink(fields, config_class)
    fields = {**fields, **overrides}
    for key in ("transformers_version", "_name_or_path", "architectures", "quantization_config"):
        # quantization_config: from_config would quantize the random weights (fp8 DeepSeek-V3
        # wants a GPU kernel); fusion sees the unquantized graph, which is what it rewrites
        fields.pop(key, None)
    return config_class.from_dict(fields)


def _config_keys(config_class: Any) -> set[str]:
    """The top-level keys `config_class` reads: its and its bases' constructor arguments,
    their attribute_map aliases, and what every PretrainedConfig serialises."""
    from transformers import PretrainedConfig

    keys = set(PretrainedConfig().to_dict())
    for cls in config_class.__mro__:
        if "__init__" in vars(cls):
            keys.update(inspect.signature(cls.__init__).parameters)
        keys.update(getattr(cls, "attribute_map", None) or {})
    return keys - {"self", "kwargs"}


@functools.lru_cache(maxsize=1)
def _config_source_names() -> frozenset[str]:
    """Every identifier in transformers' configuration_*.py files: a key one of them names
    is read by some config class. Reading the sources takes about half a second; importing
    every config class to ask them would take seconds."""
    import glob
    import os
    import re

    import transformers

    names: set[str] = set()
    for path in glob.glob(os.path.join(os.path.dirname(transformers.__file__), "models", "*", "configuration_*.py")):
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f.read()))
    return frozenset(names)


def check_config_keys(file: str, fields: dict[str, Any], model_type: str) -> None:
    """ValueError, one line naming the nearest valid key, for a top-level key of a
    config.json that its config class does not read and that looks like a misspelling of
    one it does (`num_key_value_head`: transformers would keep it as a stray attribute and
    build the model without GQA). Keys no config class reads and close to none
    (remote-code settings such as DeepSeek's `scoring_func`, `torch_dtype`, `auto_map`)
    pass, as do keys another config class names (`head_dim` next to DeepSeek's `v_head_dim`)."""
    import difflib

    known = _config_keys(_config_class(model_type))
    for key in fields:
        if key in known:
            continue
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if near and key not in _config_source_names():
            raise ValueError(f"{file}: {key!r} is not a key of transformers' {model_type} config; did you mean "
                             f"{near[0]!r}? (--allow-unknown-keys builds it as it is)")


def load_hf_config(path: str, *, num_layers: Optional[int] = None, real_dims: bool = False,
                   allow_unknown_keys: bool = False, **config_overrides: Any) -> Any:
    """A config from a local model directory or config.json (no hub access, no weights).

    Cut to `num_layers` (None: as deep as configured); unless real_dims, at tiny sizes
    (_TINY_SIZES) with the rest of the config (MoE, MLA, layer types, rope scaling) kept.
    A key that looks like a misspelt one of its config class is an error
    (check_config_keys) unless `allow_unknown_keys`.
    """
    _import_optional("transformers", _HF_INSTALL_HINT)
    import json
    import os

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"no config.json at {path}")
    with open(file, encoding="utf-8") as f:
        try:
            fields = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file} is not valid JSON: {exc}") from None
    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if model_type not in hf_model_types():
        known = "needs its own remote code (auto_map), which is never run here" if "auto_map" in fields else (
            "is not a causal-LM model_type of this transformers version")
        raise ValueError(f"{file}: model_type {model_type!r} {known}")
    if not allow_unknown_keys:
        check_config_keys(file, fields, model_type)
    return _config_from_fields(_config_class(model_type), fields, num_layers, real_dims, config_overrides)


class _LogitsOnly(nn.Module):
    """Calls an HF causal LM and returns only the logits.

    HF returns a ModelOutput; a plain tensor keeps the compiled graph's outputs, the
    comparison code and the example inputs identical across HF and torchtitan.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        # a model without a KV cache (BERT-style decoders, RWKV, ...) takes no use_cache
        parameters = inspect.signature(lm.forward).parameters
        self._cache_kwargs = {"use_cache": False} if "use_cache" in parameters or any(
            p.kind is p.VAR_KEYWORD for p in parameters.values()) else {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, **self._cache_kwargs).logits


def build_hf(
    model_type: str,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: Optional[int] = None,
    seq_len: Optional[int] = None,
    batch: int = 2,
    seed: int = 0,
    experts_implementation: str = "grouped_mm",
    attn_implementation: Optional[str] = None,
    real_dims: bool = False,
    **config_overrides: Any,
) -> TinyModel:
    """Build a tiny random-weight HF transformers causal LM.

    Args:
        model_type: an HF ``model_type`` string: one of :data:`HF_MODEL_TYPES` (curated
            configs, the ones the fusions are tested on) or any other type of
            :func:`hf_model_types` (its default config cut down to tiny sizes).
        dtype: parameter dtype (fp32, bf16 or fp16).
        num_layers: number of decoder layers (None: 2; deepseek_v4 3, one per attention kind).
        seq_len, batch: shape of the example ``input_ids`` (seq_len None: 16; deepseek_v4 18).
        seed: seeds weights and inputs; the same arguments give the same model.
        experts_implementation: MoE models only. ``"grouped_mm"`` (HF default, one
            graph), ``"batched_mm"`` (one graph, bmm per token-expert pair) or
            ``"eager"`` (Python loop over experts: graph breaks). Ignored for dense
            models.
        attn_implementation: ``"sdpa"`` (None: the default, but ``"eager"`` for
            deepseek_v4, which has no other, and for models without SDPA support) or
            ``"eager"`` (explicit matmul/softmax attention).
        real_dims: build the type's default config at its own sizes, with fake tensors
            (no weights allocated, nothing computed): see :class:`TinyModel`.
        **config_overrides: any HF config field, overriding the tiny defaults.
    """
    description = _HF_MODELS[model_type][2] if model_type in _HF_MODELS else ""
    defaults = {"num_layers": 2, "seq_len": 16, **_HF_DEFAULTS.get(model_type, {})}
    num_layers = defaults["num_layers"] if num_layers is None else num_layers
    seq_len = defaults["seq_len"] if seq_len is None else seq_len
    try:
        config = hf_config(model_type, num_layers=num_layers, real_dims=real_dims, **config_overrides)
        return build_hf_from_config(config, dtype=dtype, seq_len=seq_len, batch=batch, seed=seed,
                                    experts_implementation=experts_implementation,
                                    attn_implementation=attn_implementation, real_dims=real_dims,
                                    description=description)
    except Exception as exc:
        if model_type not in HF_KNOWN_FAILURES:
            raise
        raise RuntimeError(f"{model_type} is known not to build here: {HF_KNOWN_FAILURES[model_type]} "
                           f"({type(exc).__name__}: {exc})") from exc


def build_hf_from_config(
    config: Any,
    *,
    dtype: Optional[torch.dtype] = None,
    seq_len: int = 16,
    batch: int = 2,
    seed: int = 0,
    experts_implementation: str = "grouped_mm",
    attn_implementation: Optional[str] = None,
    real_dims: bool = False,
    description: str = "",
) -> TinyModel:
    """The causal LM of a transformers config (hf_config, load_hf_config), random weights.

    dtype None: the config's own dtype, else fp32. real_dims: parameters and inputs are
    fake tensors (TinyModel.real_dims).
    """
    transformers = _import_optional("transformers", _HF_INSTALL_HINT)
    if dtype is None:
        dtype = config.dtype if config.dtype in _DTYPE_TAGS else torch.float32
    tag = _dtype_tag(dtype)
    model_type = config.model_type
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]  # noqa: SLF001
    # Dense models reject experts_implementation, so only pass it where it means something
    # (transformers' own test: the modeling file uses @use_experts_implementation).
    is_moe = model_class._can_set_experts_implementation()  # noqa: SLF001
    if attn_implementation is None:
        attn_implementation = _HF_DEFAULTS.get(model_type, {}).get("attn_implementation", "sdpa")
    if not getattr(model_class, "_supports_sdpa", False):
        attn_implementation = "eager"
    model_kwargs: dict[str, Any] = dict(attn_implementation=attn_implementation, dtype=dtype)
    if is_moe:
        model_kwargs["experts_implementation"] = experts_implementation

    # Real sizes: fake tensors on the CPU device. Not the meta device: model code branches
    # on the device type (transformers' MoE takes an int32 histc off CPU), and torch's
    # pattern matcher skips nodes whose values are on meta.
    fake_mode = None
    if real_dims:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    # fork_rng keeps the caller's global RNG stream untouched while still making the
    # weights and inputs a pure function of `seed`.
    with torch.random.fork_rng(devices=[]), (fake_mode or contextlib.nullcontext()):
        torch.manual_seed(seed)
        lm = transformers.AutoModelForCausalLM.from_config(config, **model_kwargs)
        if model_type in _HF_POST_INIT and not real_dims:
            with torch.no_grad():
                _HF_POST_INIT[model_type](lm, torch.Generator().manual_seed(seed))
        ids = _random_ids(config.get_text_config().vocab_size, batch, seq_len)
    lm.eval()

    name = f"hf-{model_type}"
    if is_moe:
        name += f"-{experts_implementation}"
    if real_dims:
        name += "-real_dims"
    name += f"-{tag}"
    layers = _layer_count(config.get_text_config().to_dict())
    summary = description or f"transformers {model_class.__name__}"
    sizes = "configured sizes, fake tensors" if real_dims else "tiny sizes"
    return TinyModel(
        model=_LogitsOnly(lm).eval(),
        example_inputs=(ids,),
        name=name,
        description=f"{summary} ({layers} layers, {sizes}, transformers {transformers.__version__})",
        real_dims=real_dims,
    )


# --------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------

_TORCHTITAN_INSTALL_HINT = (
    "Install torchtitan without its training dependencies: "
    "`pip install --no-deps torchtitan==0.3.0` and then "
    "`pip install tyro einops 'spmd_types==0.2.3' triton` "
    "(pin your torch version in that command too)."
)

# name -> (module holding the configs, name of the flavor dict, extra flavor kwargs,
# description). The "debugmodel" flavor is torchtitan's own small config; we only cut
# it to `num_layers`.
_TORCHTITAN_MODELS: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama3": (
        "torchtitan.models.llama3",
        "llama3_configs",
        {},
        "torchtitan Llama3: nn.RMSNorm, complex (view_as_complex) RoPE, SwiGLU",
    ),
    "deepseek_v3": (
        "torchtitan.models.deepseek_v3",
        "deepseekv3_configs",
        # "standard" is the single-device token dispatcher (no all-to-all).
        {"moe_comm_backend": "standard"},
        "torchtitan DeepSeek-V3: MLA, complex RoPE, softmax top-k MoE with "
        "torch._grouped_mm experts",
    ),
    "qwen3_moe": (
        "torchtitan.models.qwen3",
        "qwen3_configs",
        {"moe_comm_backend": "standard"},
        "torchtitan Qwen3 MoE: q/k RMSNorm, cos/sin RoPE, softmax top-8 of 64 experts with "
        "route_norm, torch._grouped_mm experts",
    ),
}
# the flavor each model is built from, where it is not "debugmodel"
_TORCHTITAN_FLAVORS = {"qwen3_moe": "debugmodel_moe"}

TORCHTITAN_MODELS: tuple[str, ...] = tuple(_TORCHTITAN_MODELS)


def _cast_floating_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast real floating-point parameters and buffers to `dtype`, in place.

    Not `model.to(dtype)`: that also casts complex tensors, and the complex RoPE cache
    (freqs_cis, complex64) would silently lose its imaginary part. torchtitan itself
    keeps that cache complex64 under bf16 training (FSDP mixed precision only casts
    parameters), so this matches what it runs.
    """
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    for mod in model.modules():
        for key, buf in mod._buffers.items():
            if buf is not None and buf.is_floating_point():
                mod._buffers[key] = buf.to(dtype)


def _torchtitan_flavor(configs: Any, flavor: str, attention_mod: Any, num_layers: int, name: str,
                       **flavor_kwargs: Any) -> Any:
    """The model config of torchtitan's `flavor`, cut to `num_layers`, attention on SDPA."""
    # "flex" is the flavor's default backend; we swap it right away because flex
    # attention needs a BlockMask input and a compiled kernel, while SDPA runs (and
    # traces) on CPU with the causal mask built in.
    cfg = configs[flavor](attn_backend="flex", **flavor_kwargs)
    if num_layers > len(cfg.layers):
        raise ValueError(f"torchtitan {name} {flavor} has {len(cfg.layers)} layers; asked for {num_layers}")
    cfg.layers = cfg.layers[:num_layers]
    for layer_cfg in cfg.layers:
        layer_cfg.attention.inner_attention = attention_mod.ScaledDotProductAttention.Config()
    return cfg


def _build_torchtitan_model(cfg: Any, *, dtype: torch.dtype, seed: int, batch: int, seq_len: int) -> tuple:
    """(model, token ids) of a torchtitan model config: weights and tokens seeded, in `dtype`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cfg.build()
        # torchtitan builds parameters first and initializes them separately (so the
        # same code works after meta-device init); without this call weights are
        # uninitialized memory and the RoPE cache may be missing.
        model.init_states(buffer_device=torch.device("cpu"))
        ids = _random_ids(cfg.vocab_size, batch, seq_len)
    if dtype != torch.float32:
        _cast_floating_params(model, dtype)
    return model, ids


def build_torchtitan(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    seq_len: int = 16,
    batch: int = 2,
    seed: int = 0,
) -> TinyModel:
    """Build a tiny random-weight torchtitan model (its "debugmodel" flavor).

    Args:
        name: one of :data:`TORCHTITAN_MODELS`.
        dtype: parameter dtype (fp32, bf16 or fp16); the complex RoPE cache stays
            complex64.
        num_layers: number of transformer blocks kept from the flavor.
        seq_len, batch: shape of the example ``tokens``.
        seed: seeds weights and inputs.

    The returned model is torchtitan's own module (no wrapper), so module paths in
    the traced graph are torchtitan's FQNs (``layers.0.attention_norm`` ...).

    The MoE router computes its gate under ``torch.autocast(device_type=x.device.type,
    dtype=float32)``. Eager on CPU that autocast is disabled (CPU autocast takes bf16 / fp16
    only; torch warns), so a bf16 model's gate runs in bf16; compiled under the NPU dispatch
    emulation it is torch_npu's autocast, which takes fp32, and the gate runs in fp32 as on an
    NPU (npu_dispatch, dispatch_inventory.AUTOCAST).
    """
    if name not in _TORCHTITAN_MODELS:
        raise ValueError(
            f"unknown torchtitan model {name!r}; supported: {', '.join(TORCHTITAN_MODELS)}"
        )
    tag = _dtype_tag(dtype)
    module_name, configs_attr, flavor_kwargs, desc = _TORCHTITAN_MODELS[name]
    models_mod = _import_optional(module_name, _TORCHTITAN_INSTALL_HINT)
    attention_mod = _import_optional(
        "torchtitan.models.common.attention", _TORCHTITAN_INSTALL_HINT
    )

    flavor = _TORCHTITAN_FLAVORS.get(name, "debugmodel")
    cfg = _torchtitan_flavor(getattr(models_mod, configs_attr), flavor, attention_mod, num_layers, name, **flavor_kwargs)
    model, ids = _build_torchtitan_model(cfg, dtype=dtype, seed=seed, batch=batch, seq_len=seq_len)
    model.eval()

    return TinyModel(
        model=model,
        example_inputs=(ids,),
        name=f"torchtitan-{name}-{tag}",
        description=f"{desc} ({num_layers} layers, {flavor} flavor)",
    )


# --------------------------------------------------------------------------------------
# Inference steps with a transformers StaticCache (prefill and decode graphs)
# --------------------------------------------------------------------------------------


class CacheStep(nn.Module):
    """One generation step of an HF causal LM over a StaticCache: ``step(input_ids, cache)``
    writes the tokens' keys and values into ``cache`` and returns the logits.

    Compiled, a step with several tokens is the prefill graph and a step with one token
    the decode graph; the cache is an input, mutated in place (aot_autograd keeps that
    mutation in the graph as a copy_ into the input, as torchair compiles it).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.lm(input_ids=input_ids, cache=cache, use_cache=True).logits


def static_cache(lm: nn.Module, *, batch: int, max_cache_len: int, allocate: bool = True) -> Any:
    """A transformers StaticCache for ``lm`` holding ``max_cache_len`` positions.

    allocate=True allocates every layer's tensors now, as generation does before it runs a
    compiled step (their shapes are read off one eager token on a scratch cache: DeepSeek's
    latent caches differ per part); the compiled graphs then take them as inputs.
    allocate=False leaves them to the first step, which then allocates them inside its graph.
    """
    transformers = _import_optional("transformers", _HF_INSTALL_HINT)
    cache = transformers.StaticCache(config=lm.config, max_cache_len=max_cache_len)
    if not allocate:
        return cache
    scratch = transformers.StaticCache(config=lm.config, max_cache_len=max_cache_len)
    ids = torch.full((batch, 1), 3, dtype=torch.long, device=next(lm.parameters()).device)
    with torch.no_grad():
        lm(input_ids=ids, cache=scratch, use_cache=True)
    for layer, sample in zip(cache.layers, scratch.layers):
        layer.lazy_initialization(sample.keys[:, :, :0], sample.values[:, :, :0])
    return cache


# --------------------------------------------------------------------------------------
# torchtitan MoE layers with expert parallel (docs/expert-parallel.md)
# --------------------------------------------------------------------------------------

# flavor -> (module, configs attr, flavor name, sharding setter module, setter name,
# index of a MoE layer). The layers are torchtitan's own MoE.Config of that flavor, their
# widths cut (below); routers, expert counts and top-k stay the flavor's.
_TORCHTITAN_EP_FLAVORS: dict[str, tuple[str, str, str, str, str, int]] = {
    # softmax router with an expert bias, 8 experts, top-3, a shared expert
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_configs", "debugmodel",
                    "torchtitan.models.deepseek_v3.sharding", "set_deepseek_v3_sharding_config", 1),
    # softmax router with route_norm, 64 experts, top-8, no shared expert
    "qwen3": ("torchtitan.models.qwen3", "qwen3_configs", "debugmodel_moe",
              "torchtitan.models.qwen3.sharding", "set_qwen3_sharding_config", 0),
}

TORCHTITAN_EP_FLAVORS: tuple[str, ...] = tuple(_TORCHTITAN_EP_FLAVORS)


def _narrow_moe_config(moe_cfg: Any, dim: int, hidden_dim: int) -> Any:
    """The MoE.Config with model width `dim` and expert width `hidden_dim` (router, routed
    and shared experts alike); everything else as the flavor has it."""
    import dataclasses

    routed = moe_cfg.routed_experts
    replaced = dict(
        routed_experts=dataclasses.replace(
            routed, inner_experts=dataclasses.replace(routed.inner_experts, dim=dim, hidden_dim=hidden_dim)),
        router=dataclasses.replace(moe_cfg.router, gate=dataclasses.replace(moe_cfg.router.gate, in_features=dim)),
    )
    shared = moe_cfg.shared_experts
    if shared is not None:
        width = 2 * hidden_dim
        replaced["shared_experts"] = dataclasses.replace(
            shared,
            w1=dataclasses.replace(shared.w1, in_features=dim, out_features=width),
            w2=dataclasses.replace(shared.w2, in_features=width, out_features=dim),
            w3=dataclasses.replace(shared.w3, in_features=dim, out_features=width))
    return dataclasses.replace(moe_cfg, **replaced)


def build_torchtitan_ep_moe(
    flavor: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    dim: int = 64,
    hidden_dim: int = 32,
    batch: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    **router: Any,
) -> TinyModel:
    """One torchtitan MoE layer of `flavor` with its experts sharded over every rank of
    the default process group (expert parallel), as torchtitan parallelizes it.

    torch.distributed must be initialized (gloo on CPU, or the fake backend for graph
    capture); EP degree = world size, which must divide the flavor's expert count. The
    layer is torchtitan's own: its sharding config (set_<model>_sharding_config with
    enable_ep), ParallelDims(dp_shard=ep=world) and Module.parallelize, which shards the
    expert weights on dim 0 over the "ep" mesh and wires the mesh into its
    AllToAllTokenDispatcher (comm backend "standard"). Weights are the same on every rank
    (seeded); the example tokens differ per rank (seeded with seed + rank), as data-parallel
    batches do. `router` overrides TokenChoiceTopKRouter.Config fields (score_func,
    num_expert_groups, ...). Returns the layer, eval mode, taking x (batch, seq_len, dim).

    Sets torchtitan's process-wide SPMD backend to "partial_dtensor"
    (torchtitan.distributed.utils.set_spmd_backend): the layer's eager dispatch reads it at
    every call.
    """
    import dataclasses
    import unittest.mock

    import torch.distributed as dist

    if flavor not in _TORCHTITAN_EP_FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; supported: {', '.join(TORCHTITAN_EP_FLAVORS)}")
    if not dist.is_initialized():
        raise RuntimeError("build_torchtitan_ep_moe needs torch.distributed initialized (one process per rank)")
    tag = _dtype_tag(dtype)
    module_name, configs_attr, flavor_name, sharding_module, setter, layer = _TORCHTITAN_EP_FLAVORS[flavor]
    models_mod = _import_optional(module_name, _TORCHTITAN_INSTALL_HINT)
    parallel_dims_mod = _import_optional("torchtitan.distributed.parallel_dims", _TORCHTITAN_INSTALL_HINT)
    spmd = _import_optional("torchtitan.distributed.utils", _TORCHTITAN_INSTALL_HINT)
    set_sharding = getattr(_import_optional(sharding_module, _TORCHTITAN_INSTALL_HINT), setter)

    world = dist.get_world_size()
    cfg = getattr(models_mod, configs_attr)[flavor_name](attn_backend="flex", moe_comm_backend="standard")
    moe_cfg = cfg.layers[layer].moe
    if moe_cfg.num_experts % world:
        raise ValueError(f"{flavor}: {moe_cfg.num_experts} experts do not split over {world} ranks")
    moe_cfg = _narrow_moe_config(moe_cfg, dim, hidden_dim)
    if router:
        moe_cfg = dataclasses.replace(moe_cfg, router=dataclasses.replace(moe_cfg.router, **router))
    cfg.layers[layer].moe = moe_cfg
    # the partial_dtensor backend: DTensor expert weights (to_local() inside the experts), the
    # functional all_to_all_single under torch.compile (the spmd_types backend takes the
    # same collectives when compiling, but type-checks eager code against a full model mesh)
    spmd.set_spmd_backend("partial_dtensor")
    set_sharding(cfg, enable_sp=False, enable_ep=True)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        moe = moe_cfg.build()
        moe.init_states(buffer_device=torch.device("cpu"))
        if getattr(moe, "expert_bias_E", None) is not None:
            moe.expert_bias_E.normal_(std=0.05)  # a trained bias is not zero
        torch.manual_seed(seed + 1 + dist.get_rank())
        x = torch.randn(batch, seq_len, dim)
    if dtype != torch.float32:
        _cast_floating_params(moe, dtype)
        x = x.to(dtype)
    parallel_dims = parallel_dims_mod.ParallelDims(
        dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=world, world_size=world,
        spmd_backend="partial_dtensor")
    # torchtitan builds its meshes on the accelerator it finds, "cuda" when there is none
    # (tools/utils.py get_device_info); the CPU ranks here need CPU meshes
    with unittest.mock.patch.object(parallel_dims_mod, "device_type", "cpu"):
        parallel_dims.build_mesh()
    moe.parallelize(parallel_dims)
    return TinyModel(
        model=moe.eval(),
        example_inputs=(x,),
        name=f"torchtitan-{flavor}-moe-ep{world}-{tag}",
        description=(f"torchtitan {flavor} MoE layer ({moe_cfg.num_experts} experts, top-{moe_cfg.router.top_k}) "
                     f"with expert parallel over {world} ranks"),
        process_groups={"ep": parallel_dims.get_mesh("ep").get_group()},
    )


# --------------------------------------------------------------------------------------
# torchtitan dense models with tensor parallel (docs/tensor-parallel.md)
# --------------------------------------------------------------------------------------

# name -> (models module, configs attr, flavor, sharding module, sharding setter, parallelize
# module, parallelize function); the setter takes enable_sp (qwen3's also enable_ep)
_TORCHTITAN_TP_MODELS: dict[str, tuple[str, str, str, str, str, str, str]] = {
    "llama3": ("torchtitan.models.llama3", "llama3_configs", "debugmodel", "torchtitan.models.llama3.sharding",
               "set_llama3_sharding_config", "torchtitan.models.llama3.parallelize", "parallelize_llama"),
    "qwen3": ("torchtitan.models.qwen3", "qwen3_configs", "debugmodel", "torchtitan.models.qwen3.sharding",
              "set_qwen3_sharding_config", "torchtitan.models.qwen3.parallelize", "parallelize_qwen3"),
}

TORCHTITAN_TP_MODELS: tuple[str, ...] = tuple(_TORCHTITAN_TP_MODELS)


def build_torchtitan_tp(
    name: str,
    *,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    num_layers: int = 2,
    batch: Optional[int] = None,
    seq_len: int = 16,
    seed: int = 0,
    spmd_backend: str = "partial_dtensor",
) -> TinyModel:
    """torchtitan's `name` debugmodel (cut to `num_layers`) tensor-parallel over every rank of
    the default process group, by torchtitan's own parallelize function (parallelize_llama /
    parallelize_qwen3) and sharding config (set_<model>_sharding_config, enable_sp =
    `sequence_parallel`), FSDP left out so that one graph holds the model.

    torch.distributed must be initialized (gloo on CPU, or the fake backend for graph capture);
    TP degree = world size. Weights and tokens are the same on every rank (seeded), as TP
    needs. `batch` None: 1 with sequence parallel (torchtitan's SP shards the sequence of each
    sample), else 2; `seq_len` must divide by the ranks with SP. The meshes are built on CPU
    (torchtitan builds them on the accelerator it finds). The model returns each rank's
    vocabulary shard of the logits (loss parallel), a plain tensor.
    """
    import unittest.mock

    import torch.distributed as dist

    if name not in _TORCHTITAN_TP_MODELS:
        raise ValueError(f"unknown model {name!r}; supported: {', '.join(TORCHTITAN_TP_MODELS)}")
    if not dist.is_initialized():
        raise RuntimeError("build_torchtitan_tp needs torch.distributed initialized (one process per rank)")
    world = dist.get_world_size()
    if sequence_parallel and seq_len % world:
        raise ValueError(f"sequence parallel over {world} ranks needs seq_len divisible by it, got {seq_len}")
    batch = (1 if sequence_parallel else 2) if batch is None else batch
    module_name, configs_attr, flavor, sharding_module, setter, parallelize_module, parallelize_fn = \
        _TORCHTITAN_TP_MODELS[name]
    models_mod = _import_optional(module_name, _TORCHTITAN_INSTALL_HINT)
    attention_mod = _import_optional("torchtitan.models.common.attention", _TORCHTITAN_INSTALL_HINT)
    parallel_dims_mod = _import_optional("torchtitan.distributed.parallel_dims", _TORCHTITAN_INSTALL_HINT)
    configs_mod = _import_optional("torchtitan.config", _TORCHTITAN_INSTALL_HINT)
    spmd = _import_optional("torchtitan.distributed.utils", _TORCHTITAN_INSTALL_HINT)
    set_sharding = getattr(_import_optional(sharding_module, _TORCHTITAN_INSTALL_HINT), setter)
    parallelize_mod = _import_optional(parallelize_module, _TORCHTITAN_INSTALL_HINT)

    cfg = _torchtitan_flavor(getattr(models_mod, configs_attr), flavor, attention_mod, num_layers, name)
    sharding = {"enable_sp": sequence_parallel}
    if "enable_ep" in inspect.signature(set_sharding).parameters:
        sharding["enable_ep"] = False
    set_sharding(cfg, **sharding)
    spmd.set_spmd_backend(spmd_backend)
    model, ids = _build_torchtitan_model(cfg, dtype=dtype, seed=seed, batch=batch, seq_len=seq_len)
    parallel_dims = parallel_dims_mod.ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world, spmd_backend=spmd_backend)
    with unittest.mock.patch.object(parallel_dims_mod, "device_type", "cpu"):
        parallel_dims.build_mesh()
    parallelism = configs_mod.ParallelismConfig(tensor_parallel_degree=world, enable_sequence_parallel=sequence_parallel,
                                                spmd_backend=spmd_backend)
    # FSDP left out: with it every block would be a graph of its own (its hooks break the graph)
    with unittest.mock.patch.object(parallelize_mod, "apply_fsdp_to_decoder", lambda *args, **kwargs: None):
        getattr(parallelize_mod, parallelize_fn)(
            model, parallel_dims=parallel_dims, training=configs_mod.TrainingConfig(), parallelism=parallelism,
            compile_config=configs_mod.CompileConfig(enable=False), ac_config=None, dump_folder="")
    tag = _dtype_tag(dtype)
    mode = "tp_sp" if sequence_parallel else "tp"
    return TinyModel(
        model=model.eval(),
        example_inputs=(ids,),
        name=f"torchtitan-{name}-{mode}{world}-{tag}",
        description=(f"torchtitan {name} {flavor} ({num_layers} layers), tensor parallel"
                     f"{' + sequence parallel' if sequence_parallel else ''} over {world} ranks by {parallelize_fn}"),
    )
