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

import importlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = [
    "TinyModel",
    "build_hf",
    "build_torchtitan",
    "build_torchtitan_ep_moe",
    "TORCHTITAN_EP_FLAVORS",
    "HF_MODEL_TYPES",
    "TORCHTITAN_MODELS",
]


@dataclass
class TinyModel:
    """A built model plus the inputs to call it with.

    ``model(*example_inputs)`` returns the logits tensor, shape (batch, seq, vocab).
    The model is in eval mode but its parameters still require grad (so the same
    build serves training tests): compile under ``torch.no_grad()`` to get the
    inference graph rather than a joint forward/backward one.

    ``name`` is filename-safe and unique per build recipe, e.g. ``hf-llama-bf16``,
    ``hf-qwen3_moe-grouped_mm-fp32``, ``torchtitan-llama3-fp32``.
    """

    model: nn.Module
    example_inputs: tuple
    name: str
    description: str = ""


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
    # the default seq_len=16 it keeps 8 of 16.
    "deepseek_v32": (
        dict(_DEEPSEEK_V3, index_topk=8, index_head_dim=32, index_n_heads=4),
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
# emulation and note them on each site.
_DEEPSEEK_V4 = dict(
    num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, sliding_window=128,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    index_n_heads=4, index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20,
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


_HF_POST_INIT = {"deepseek_v4": _init_deepseek_v4}
# ---- end of the DeepSeek-V4 block --------------------------------------------------------

HF_MODEL_TYPES: tuple[str, ...] = tuple(_HF_MODELS)


class _LogitsOnly(nn.Module):
    """Calls an HF causal LM and returns only the logits.

    HF returns a ModelOutput; a plain tensor keeps the compiled graph's outputs, the
    comparison code and the example inputs identical across HF and torchtitan.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


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
    **config_overrides: Any,
) -> TinyModel:
    """Build a tiny random-weight HF transformers causal LM.

    Args:
        model_type: one of :data:`HF_MODEL_TYPES` (an HF ``model_type`` string).
        dtype: parameter dtype (fp32, bf16 or fp16).
        num_layers: number of decoder layers (None: 2; deepseek_v4 3, one per attention kind).
        seq_len, batch: shape of the example ``input_ids`` (seq_len None: 16; deepseek_v4 18).
        seed: seeds weights and inputs; the same arguments give the same model.
        experts_implementation: MoE models only. ``"grouped_mm"`` (HF default, one
            graph), ``"batched_mm"`` (one graph, bmm per token-expert pair) or
            ``"eager"`` (Python loop over experts: graph breaks). Ignored for dense
            models.
        attn_implementation: ``"sdpa"`` (None: the default, but ``"eager"`` for
            deepseek_v4, which has no other) or ``"eager"`` (explicit matmul/softmax attention).
        **config_overrides: any HF config field, overriding the tiny defaults.
    """
    if model_type not in _HF_MODELS:
        raise ValueError(
            f"unknown HF model type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    tag = _dtype_tag(dtype)  # validate before the (slow) import and build
    transformers = _import_optional("transformers", _HF_INSTALL_HINT)
    extra, is_moe, desc = _HF_MODELS[model_type]
    defaults = {"attn_implementation": "sdpa", "num_layers": 2, "seq_len": 16, **_HF_DEFAULTS.get(model_type, {})}
    num_layers = defaults["num_layers"] if num_layers is None else num_layers
    seq_len = defaults["seq_len"] if seq_len is None else seq_len
    attn_implementation = attn_implementation or defaults["attn_implementation"]

    cfg_kwargs = {**_HF_COMMON, **extra, "num_hidden_layers": num_layers}
    if model_type == "deepseek_v4":
        cfg_kwargs.update(_deepseek_v4_layer_config(num_layers))
    cfg_kwargs.update(config_overrides)
    config = transformers.AutoConfig.for_model(model_type, **cfg_kwargs)

    model_kwargs: dict[str, Any] = dict(attn_implementation=attn_implementation, dtype=dtype)
    if is_moe:
        # Dense models reject the argument, so only pass it where it means something.
        model_kwargs["experts_implementation"] = experts_implementation

    # fork_rng keeps the caller's global RNG stream untouched while still making the
    # weights and inputs a pure function of `seed`.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm = transformers.AutoModelForCausalLM.from_config(config, **model_kwargs)
        if model_type in _HF_POST_INIT:
            with torch.no_grad():
                _HF_POST_INIT[model_type](lm, torch.Generator().manual_seed(seed))
        ids = _random_ids(config.vocab_size, batch, seq_len)
    lm.eval()

    name = f"hf-{model_type}"
    if is_moe:
        name += f"-{experts_implementation}"
    name += f"-{tag}"
    return TinyModel(
        model=_LogitsOnly(lm).eval(),
        example_inputs=(ids,),
        name=name,
        description=f"{desc} ({num_layers} layers, transformers {transformers.__version__})",
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
}

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

    On CPU, the MoE router's ``torch.autocast(dtype=float32)`` is unsupported and
    disabled (torch warns), so in a bf16 deepseek_v3 the router gate runs in bf16
    here, unlike on devices where that autocast is honoured.
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

    # "flex" is the flavor's default backend; we swap it right away because flex
    # attention needs a BlockMask input and a compiled kernel, while SDPA runs (and
    # traces) on CPU with the causal mask built in.
    cfg = getattr(models_mod, configs_attr)["debugmodel"](attn_backend="flex", **flavor_kwargs)
    if num_layers > len(cfg.layers):
        raise ValueError(
            f"torchtitan {name} debugmodel has {len(cfg.layers)} layers; asked for {num_layers}"
        )
    cfg.layers = cfg.layers[:num_layers]
    for layer_cfg in cfg.layers:
        layer_cfg.attention.inner_attention = attention_mod.ScaledDotProductAttention.Config()

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
    model.eval()

    return TinyModel(
        model=model,
        example_inputs=(ids,),
        name=f"torchtitan-{name}-{tag}",
        description=f"{desc} ({num_layers} layers, debugmodel flavor)",
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
    )
