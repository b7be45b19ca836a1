"""Tiny random-weight decoders from libraries other than transformers and torchtitan 0.3.0.

The passes are tuned on transformers' and torchtitan's model code; this module builds the
decoders of four more codebases, each from the library's own config API, at tiny sizes with
their structure kept (GQA, MoE, qk-norm, the RoPE variant, sliding windows, soft-capping,
...), so the survey (benchmarks/survey.py) and the tests can measure how well fusion
generalises (issue 28):

- ``torchtune:NAME``     torchtune 0.6.1: every decoder model builder (``llama3_2_1b``,
  ``gemma2_2b``, ``qwen2_5_0_5b``, ...), its size arguments recorded and cut down, the
  component builder called with the rest;
- ``litgpt:NAME``        litgpt 0.5.13: one config per distinct architecture of its config
  list (block, norm, MLP, RoPE, attention), named after its first checkpoint;
- ``olmo_core:NAME``     ai2-olmo-core 3.0.0: its ``TransformerConfig`` builders
  (``olmo2_*``, ``olmo3_*``, ``llama3_*``, ``qwen3_*``, ``gemma3_*``, MoE, ...), one per
  distinct block structure;
- ``torchtitan_npu:NAME`` torchtitan-npu 0.2.2.post2's own DeepSeek-V3 / V3.2 / V4 models,
  with the torchtitan 0.2.2 they were written against, converters off (the model code as
  written, before torchtitan-npu swaps modules for NPU kernels by name).

Every builder returns a :class:`~npu_fx_fusion.tiny_models.TinyModel` whose model takes
``input_ids`` and returns the logits tensor. ``third_party_models(library)`` lists the
names, each with the library builders it stands for (the ones of the same structure).

Installing (scripts/test.sh does exactly this; pin torch in the same command)::

    pip install --no-deps torchtune==0.6.1 litgpt==0.5.13 ai2-olmo-core==3.0.0 dataclass-extensions==0.5.0
    pip install --no-deps --target .cache/torchtitan-0.2.2 torchtitan==0.2.2 \\
        torchtitan-npu==0.2.2.post2 torchdata==0.11.0 scipy==...

Import-time shims (``_import_library``): each library's package imports modules its model
code never calls (dataset loaders, tokenizers, the Lightning trainer, cloud storage).
Those that are not installed are stood in for, only while the library imports, by
placeholder modules (:class:`_AbsentModules`): their attributes are inert classes, so
``from datasets import load_dataset`` binds a name nothing calls. The stand-ins leave
``sys.modules`` when the import returns, so nothing else sees them. The list per library,
and why each module is not needed, is ``_IMPORT_ONLY``.

torchtitan-npu needs torchtitan 0.2.2, and another torchtitan (0.3.0, tiny_models) may be
installed: it is put first on ``sys.path`` from its own folder (``NPU_FX_FUSION_TORCHTITAN_NPU_DIR``,
default ``.cache/torchtitan-0.2.2`` of the repository), and only in a process that has not
imported another torchtitan (the survey and the tests build those models in a subprocess).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .tiny_models import TinyModel, _cast_floating_params, _dtype_tag, _random_ids, did_you_mean

__all__ = [
    "LIBRARIES",
    "Architecture",
    "build_third_party",
    "third_party_models",
    "torchtitan_npu_dir",
]

LIBRARIES = ("torchtune", "litgpt", "olmo_core", "torchtitan_npu")

# The tiny sizes, as tiny_models' (4 query heads of 16 over 2 KV heads, width 64, MLP 128,
# 8 experts of 32, top-2), so the rows of the survey compare with transformers' and torchtitan's.
VOCAB, WIDTH, HEADS, HEAD_DIM, MLP, EXPERTS, EXPERT_MLP, TOP_K = 256, 64, 4, 16, 128, 8, 32, 2
# A sliding window that bites within the example's 16 tokens (the libraries' windows are 512
# to 4096 tokens, which at 16 tokens are the causal mask)
WINDOW = 8


def _kv_heads(heads: int, kv_heads: Optional[int]) -> int:
    """The tiny KV-head count that keeps the kind of attention: MHA, MQA or GQA."""
    if kv_heads is None or kv_heads == heads:
        return HEADS
    return 1 if kv_heads == 1 else 2


@dataclass(frozen=True)
class Architecture:
    """One tiny model: a library's builder (or config), and every builder of the same
    structure it stands for (they differ in sizes only)."""

    library: str
    name: str
    builders: tuple[str, ...]
    description: str = ""
    skip: str = ""  # why it is not built (encoder-only, vision, needs a GPU kernel, ...)


# --------------------------------------------------------------------------------------
# Import-time shims
# --------------------------------------------------------------------------------------

class _Inert(type):
    """The metaclass of a placeholder: any attribute is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(name)


def _placeholder(name: str) -> type:
    """A class standing for any name an absent module exports: instantiable with any
    arguments (module-level calls such as ``RequirementCache("x")`` run), false, and
    every attribute or call another placeholder. Usable as a base class and in ``A | B``."""
    return _Inert(name, (), {
        "__init__": lambda self, *args, **kwargs: None,
        "__bool__": lambda self: False,
        "__call__": lambda self, *args, **kwargs: _placeholder("result")(),
        "__getattr__": lambda self, attr: _placeholder(attr),
    })


class _AbsentModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder serving placeholder modules for `names` (and their submodules)."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "placeholder of npu_fx_fusion.tiny_third_party")
        module.__path__ = []
        module.__getattr__ = lambda name: _placeholder(name) if not name.startswith("__") else _raise(name)
        return module

    def exec_module(self, module):
        pass


def _raise(name: str):
    raise AttributeError(name)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# library -> {module stood in for while the library imports: (the module whose absence
# decides it, why the model code does not need it)}
_IMPORT_ONLY: dict[str, dict[str, tuple[str, str]]] = {
    "torchtune": {
        "torchao": ("torchao", "torchtune/__init__ insists on it; the models use it only for NF4 / QAT "
                               "quantization (modules/common_utils, peft), never in a plain decoder's forward"),
        # torchao releases after 0.12 dropped the NF4 tensor torchtune 0.6.1 imports at load time
        "torchao.dtypes.nf4tensor": ("torchao.dtypes.nf4tensor", "the same NF4 quantization, gone from newer torchao"),
        "datasets": ("datasets", "torchtune.data / torchtune.datasets load training data"),
        "omegaconf": ("omegaconf", "torchtune.config reads recipe YAML"),
        "sentencepiece": ("sentencepiece", "tokenizers"),
        "tiktoken": ("tiktoken", "tokenizers"),
    },
    "litgpt": {
        "lightning": ("lightning", "litgpt.model imports qkv_reassemble from scripts/convert_hf_checkpoint "
                                   "(legacy checkpoint loading), which imports litgpt.utils, the trainer glue"),
        "lightning_utilities": ("lightning_utilities", "litgpt.constants' optional-package checks"),
        "psutil": ("psutil", "litgpt.utils' memory reports"),
    },
    "olmo_core": {
        "cached_path": ("cached_path", "olmo_core.config / io fetch remote files"),
        "requests": ("requests", "olmo_core.io's HTTP retries"),
        "bettermap": ("bettermap", "olmo_core.data's parallel data loader"),
    },
    "torchtitan_npu": {
        "datasets": ("datasets", "torchtitan.hf_datasets, imported by the models' package __init__ (TrainSpec)"),
        "torch.utils.tensorboard": ("tensorboard", "torchtitan.components.metrics, imported by TrainSpec"),
        "torch_npu": ("torch_npu", "the models' package __init__ imports infra/parallelize.py (training "
                                   "parallelism), which imports the converters; those import torch_npu for the NPU "
                                   "kernels they swap in, which the models as written never call (and torch_npu "
                                   "must never be imported where torch runs without CANN)"),
    },
}


@contextlib.contextmanager
def _absent_modules(library: str):
    """Placeholders for the import-only modules of `library` that are not installed,
    for the duration of the block; afterwards they are gone from sys.modules."""
    names = {name for name, (decides, _) in _IMPORT_ONLY.get(library, {}).items() if not _installed(decides)}
    finder = _AbsentModules(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names)]:
            if isinstance(sys.modules[name].__spec__.loader if sys.modules[name].__spec__ else None, _AbsentModules):
                del sys.modules[name]


_INSTALL_HINT = {
    "torchtune": "pip install --no-deps torchtune==0.6.1 'torch==<your torch>'",
    "litgpt": "pip install --no-deps litgpt==0.5.13 'torch==<your torch>'",
    "olmo_core": "pip install --no-deps ai2-olmo-core==3.0.0 dataclass-extensions==0.5.0 'torch==<your torch>'",
    "torchtitan_npu": "bash scripts/test.sh sets it up: pip install --no-deps --target .cache/torchtitan-0.2.2 "
                      "torchtitan==0.2.2 torchtitan-npu==0.2.2.post2 torchdata==0.11.0 scipy",
}


def _import_library(library: str, *modules: str) -> list[types.ModuleType]:
    """Import `modules` of `library` behind its import-time shims; a clear error if it is
    not installed."""
    if library == "torchtitan_npu":
        _torchtitan_npu_path()
    imported = []
    with _absent_modules(library):
        for module in modules:
            try:
                imported.append(importlib.import_module(module))
            except ImportError as exc:
                raise ImportError(f"importing {module!r} failed ({exc}); install {library}: "
                                  f"{_INSTALL_HINT[library]}") from exc
    return imported


# --------------------------------------------------------------------------------------
# Shared: size recording and structure signatures
# --------------------------------------------------------------------------------------

@dataclass
class _Call:
    """A builder's call of its component builder, recorded instead of run."""

    function: Callable
    kwargs: dict


class _Recorded(Exception):
    def __init__(self, call: _Call):
        super().__init__(call.function.__name__)
        self.call = call


def _recording(function: Callable) -> Callable:
    def record(*args, **kwargs):
        bound = inspect.signature(function).bind(*args, **kwargs)
        raise _Recorded(_Call(function, dict(bound.arguments)))
    return record


def _signature(fields: dict[str, Any], sizes: set[str]) -> tuple:
    """The structure of a config: every field but its sizes, as a hashable tuple."""
    def frozen(value):
        if isinstance(value, dict):
            return tuple(sorted((k, frozen(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return tuple(frozen(v) for v in value)
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    return tuple(sorted((k, frozen(v)) for k, v in fields.items() if k not in sizes))


def _finish(model: nn.Module, vocab: int, *, library: str, name: str, dtype: torch.dtype, batch: int,
            seq_len: int, seed: int, description: str, num_layers: int, cast: bool = True) -> TinyModel:
    """The TinyModel of a built model; cast: its floating parameters and buffers to `dtype`
    (complex RoPE tables stay complex64, as tiny_models casts torchtitan's)."""
    if cast and dtype != torch.float32:
        _cast_floating_params(model, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        ids = _random_ids(vocab, batch, seq_len)
    return TinyModel(model=model.eval(), example_inputs=(ids,), name=f"{library}-{name}-{_dtype_tag(dtype)}",
                     description=f"{description} ({num_layers} layers, tiny sizes)")


# --------------------------------------------------------------------------------------
# torchtune 0.6.1: every model builder, its component builder called at tiny sizes
# --------------------------------------------------------------------------------------
# torchtune's model builders (llama3_2_1b, gemma2_2b, ...) call a component builder
# (llama3_2(...), gemma2(...)) with the checkpoint's sizes. Each builder is called with its
# component builder replaced by a recorder, so its arguments are read without building
# anything; the component builder then builds the model with the sizes below cut down.

_TORCHTUNE_PACKAGES = ("llama2", "code_llama2", "llama3", "llama3_1", "llama3_2", "llama3_3", "mistral",
                       "gemma", "gemma2", "phi3", "phi4", "qwen2", "qwen2_5")
_TORCHTUNE_SKIPPED = {  # packages with no decoder-only text model
    "llama3_2_vision": "a vision-language model: its decoder's fusion layers cross-attend to the vision encoder",
    "clip": "an image / text encoder",
    "t5": "an encoder (T5 v1.1 XXL encoder for Flux)",
    "flux": "a diffusion autoencoder",
}


def _torchtune_size(key: str, value: Any, kwargs: dict, num_layers: int) -> Any:
    if key == "vocab_size":
        return VOCAB
    if key == "num_layers":
        return num_layers
    if key == "num_heads":
        return HEADS
    if key == "num_kv_heads":
        return _kv_heads(kwargs["num_heads"], value)
    if key == "embed_dim":
        return WIDTH
    if key == "intermediate_dim":
        return None if value is None else MLP
    if key == "head_dim":
        return HEAD_DIM
    if key == "max_seq_len":
        return 256
    if key == "sliding_window_size":
        return None if value is None else WINDOW
    return value


# arguments that are sizes or numeric settings: the structure is the rest (and whether a
# None-able setting such as query_pre_attn_scalar is given)
_TORCHTUNE_OPTIONAL = ("sliding_window_size", "query_pre_attn_scalar")
_TORCHTUNE_SIZES = {"vocab_size", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "intermediate_dim",
                    "head_dim", "max_seq_len", "sliding_window_size", "norm_eps", "rope_base", "attn_dropout",
                    "scale_factor", "hidden_capping_value", "final_capping_value", "query_pre_attn_scalar"}


def _torchtune_calls() -> dict[str, _Call]:
    """Every torchtune decoder model builder -> its recorded component-builder call."""
    calls: dict[str, _Call] = {}
    modules = _import_library("torchtune", *(f"torchtune.models.{p}" for p in _TORCHTUNE_PACKAGES))
    for package, module in zip(_TORCHTUNE_PACKAGES, modules):
        for name in getattr(module, "__all__", dir(module)):
            builder = getattr(module, name)
            if (not inspect.isfunction(builder) or name.startswith(("lora_", "qlora_"))
                    or name.endswith(("tokenizer", "transform")) or not builder.__module__.endswith("_model_builders")):
                continue
            namespace = builder.__globals__
            components = {k: v for k, v in namespace.items()
                          if inspect.isfunction(v) and v.__module__.endswith("_component_builders")}
            saved = dict(components)
            try:
                namespace.update({k: _recording(v) for k, v in components.items()})
                builder()
            except _Recorded as recorded:
                calls[name] = recorded.call
            finally:
                namespace.update(saved)
    return calls


def _torchtune_architectures() -> list[Architecture]:
    groups: dict[tuple, list[str]] = {}
    calls = _torchtune_calls()
    for name, call in calls.items():
        fields = {**call.kwargs, "component": call.function.__qualname__}
        fields.update({f"{k} given": call.kwargs.get(k) is not None for k in _TORCHTUNE_OPTIONAL})
        if "num_kv_heads" in call.kwargs:  # MHA, GQA or MQA
            fields["kv heads"] = _kv_heads(call.kwargs["num_heads"], call.kwargs["num_kv_heads"])
        groups.setdefault(_signature(fields, _TORCHTUNE_SIZES), []).append(name)
    architectures = [Architecture("torchtune", names[0], tuple(names),
                                  f"torchtune {calls[names[0]].function.__module__.rsplit('.', 2)[-2]}."
                                  f"{calls[names[0]].function.__name__}(...)")
                     for names in groups.values()]
    architectures += [Architecture("torchtune", package, (), skip=why) for package, why in _TORCHTUNE_SKIPPED.items()]
    return architectures


def build_torchtune(name: str, *, dtype: torch.dtype = torch.float32, num_layers: int = 2, seq_len: int = 16,
                    batch: int = 2, seed: int = 0) -> TinyModel:
    """torchtune's model builder `name` (e.g. "llama3_2_1b") at tiny sizes: its component
    builder with the builder's own arguments, sizes cut down (_torchtune_size)."""
    calls = _torchtune_calls()
    if name not in calls:
        raise ValueError(f"unknown torchtune model builder {name!r}; {did_you_mean(name, calls)}"
                         f"torchtune 0.6.1 has {len(calls)} decoder model builders: {', '.join(sorted(calls))}")
    call = calls[name]
    kwargs = {k: _torchtune_size(k, v, call.kwargs, num_layers) for k, v in call.kwargs.items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = call.function(**kwargs)
    return _finish(model, VOCAB, library="torchtune", name=name, dtype=dtype, batch=batch, seq_len=seq_len,
                   seed=seed, num_layers=num_layers,
                   description=f"torchtune {name}: {call.function.__module__}.{call.function.__name__}")


# --------------------------------------------------------------------------------------
# litgpt 0.5.13: one tiny config per distinct architecture of its config list
# --------------------------------------------------------------------------------------
# litgpt describes every checkpoint it supports as a Config (litgpt/config.py's `configs`,
# a few hundred). Two configs with the same fields apart from sizes and numeric settings
# build the same modules; one tiny model stands for each such group.

# sizes and numeric settings (cut down or kept as they are); the structure is the rest, with
# whether each optional feature is on (_LITGPT_OPTIONAL)
_LITGPT_SIZES = {"name", "hf_config", "block_size", "n_layer", "n_embd", "vocab_size", "padding_multiple",
                 "padded_vocab_size", "n_head", "head_size", "n_query_groups", "intermediate_size",
                 "moe_intermediate_size", "n_expert", "n_expert_per_token", "rope_base", "norm_eps",
                 "rope_condense_ratio", "sliding_window_indices", "rope_indices", "rope_local_base_freq",
                 "attention_scores_scalar", "routed_scaling_factor", "first_k_dense_replace", "n_expert_groups",
                 "n_topk_groups", "n_topk_scores_per_group", "latent_attention", "attention_logit_softcapping",
                 "final_logit_softcapping", "sliding_window_size", "rope_adjustments", "n_shared_expert",
                 "rotary_percentage", "rope_n_elem", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "qk_head_dim"}
_LITGPT_OPTIONAL = ("latent_attention", "attention_logit_softcapping", "final_logit_softcapping",
                    "sliding_window_size", "rope_local_base_freq", "attention_scores_scalar", "n_expert_groups",
                    "first_k_dense_replace", "n_shared_expert")


def _litgpt_structure(config: Any) -> tuple:
    fields = dict(vars(config))
    fields.update({f"{k} given": bool(getattr(config, k, None)) for k in _LITGPT_OPTIONAL})
    fields["kv heads"] = _kv_heads(config.n_head, config.n_query_groups)
    fields["partial rope"] = config.rotary_percentage < 1
    fields["rope adjustments"] = tuple(sorted(config.rope_adjustments or ()))
    fields["moe"] = config.n_expert > 0
    return _signature(fields, _LITGPT_SIZES)


def _litgpt_groups() -> dict[str, list[str]]:
    """First config name of each architecture -> every config name of that architecture."""
    (config_module,) = _import_library("litgpt", "litgpt.config")
    groups: dict[tuple, list[str]] = {}
    for fields in config_module.configs:
        config = config_module.Config(**fields)
        groups.setdefault(_litgpt_structure(config), []).append(config.name)
    return {names[0]: names for names in groups.values()}


def _litgpt_tiny_config(config: Any, num_layers: int) -> dict[str, Any]:
    """The config's fields with its sizes cut down; per-layer lists keep one layer of each kind first."""
    from .tiny_models import _kept_layers

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    per_layer = {k: fields[k][:config.n_layer] for k in ("sliding_window_indices", "rope_indices")
                 if fields.get(k) is not None}
    kept = _kept_layers(per_layer, config.n_layer, num_layers) if per_layer else list(range(num_layers))
    fields.update({k: [v[i] for i in kept] for k, v in per_layer.items()})
    fields.update(n_layer=num_layers, n_embd=WIDTH, n_head=HEADS, head_size=HEAD_DIM, vocab_size=VOCAB,
                  padded_vocab_size=VOCAB, padding_multiple=64, block_size=256,
                  n_query_groups=_kv_heads(config.n_head, config.n_query_groups), intermediate_size=MLP)
    if config.n_expert:
        fields.update(n_expert=EXPERTS, n_expert_per_token=TOP_K, moe_intermediate_size=EXPERT_MLP)
        if config.first_k_dense_replace is not None:
            fields["first_k_dense_replace"] = 1
        if config.n_expert_groups is not None:  # group-limited routing: 2 groups of 4, the best 2 scores of each
            fields.update(n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=2)
    if config.sliding_window_size is not None:
        fields["sliding_window_size"] = WINDOW
    if config.latent_attention is not None:  # MLA, as tiny_models' DeepSeek-V3
        fields["latent_attention"] = dict(config.latent_attention, q_lora_rank=48, kv_lora_rank=32,
                                          qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    fields.pop("rope_n_elem", None)
    return fields


def build_litgpt(name: str, *, dtype: torch.dtype = torch.float32, num_layers: int = 2, seq_len: int = 16,
                 batch: int = 2, seed: int = 0) -> TinyModel:
    """litgpt's GPT of config `name` (a litgpt config name, e.g. "Llama-3.2-1B") at tiny sizes."""
    config_module, model_module = _import_library("litgpt", "litgpt.config", "litgpt.model")
    if name not in config_module.name_to_config:
        raise ValueError(f"unknown litgpt config {name!r}; {did_you_mean(name, config_module.name_to_config)}"
                         f"one per architecture: {', '.join(list(_litgpt_groups())[:5])}, ...")
    config = config_module.Config(**_litgpt_tiny_config(config_module.Config.from_name(name), num_layers))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_module.GPT(config)
        model.apply(model._init_weights)  # noqa: SLF001 - litgpt's own initialisation
    return _finish(model, VOCAB, library="litgpt", name=name, dtype=dtype, batch=batch, seq_len=seq_len, seed=seed,
                   num_layers=num_layers, description=f"litgpt GPT({name!r} config: {config.mlp_class_name}, "
                                                      f"{config.norm_class_name})")


# --------------------------------------------------------------------------------------
# ai2-olmo-core 3.0.0: its TransformerConfig builders, one per distinct block structure
# --------------------------------------------------------------------------------------
# TransformerConfig's classmethods (olmo2_1B, olmo3_7B, llama3_8B, qwen3_4B, gemma3_1B,
# smallmoe, olmoe_1B_7B, ...) return a config tree; its sizes are cut down where they sit
# (_OLMO_SIZES), the rest (block type, norms, qk-norm, RoPE, sliding-window pattern, MoE
# router and experts) kept. The *_like builders are the generic ones the others call.

_OLMO_GENERIC = ("llama_like", "llama_like_moe", "ngpt_like", "gemma3_like", "qwen3_5_like")
# (config class, field) -> tiny value (a callable: of the field's value and the config)
_OLMO_SIZES: dict[tuple[str, str], Any] = {
    ("TransformerConfig", "d_model"): WIDTH,
    ("TransformerConfig", "vocab_size"): VOCAB,
    ("AttentionConfig", "n_heads"): HEADS,
    ("AttentionConfig", "n_kv_heads"): lambda value, cfg: None if value is None else _kv_heads(cfg.n_heads, value),
    ("AttentionConfig", "head_dim"): lambda value, cfg: None if value is None else HEAD_DIM,
    ("FeedForwardConfig", "hidden_size"): MLP,
    ("MoEConfig", "hidden_size"): EXPERT_MLP,
    ("MoEConfig", "num_experts"): EXPERTS,
    ("MoERouterConfig", "top_k"): TOP_K,
    ("SlidingWindowAttentionConfig", "pattern"): lambda value, cfg: [-1 if w == -1 else WINDOW for w in value],
    ("GatedDeltaNetConfig", "n_heads"): HEADS,
    ("GatedDeltaNetConfig", "n_v_heads"): HEADS,
    ("GatedDeltaNetConfig", "head_dim"): HEAD_DIM,
}
# what does not make two builders different architectures: sizes, numeric settings, dtypes
_OLMO_NOT_STRUCTURE = {"d_model", "vocab_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size",
                       "num_experts", "top_k", "pattern", "n_v_heads", "theta", "eps", "init_std", "init_seed",
                       "embed_scale", "lb_loss_weight", "z_loss_weight", "dtype", "embedding_init_std"}


def _olmo_shrink(config: Any) -> Any:
    """`config` (a dataclass tree) with every _OLMO_SIZES field at its tiny value."""
    if isinstance(config, dict):
        return {k: _olmo_shrink(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_olmo_shrink(v) for v in config]
    if not dataclasses.is_dataclass(config):
        return config
    changes = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        tiny = _OLMO_SIZES.get((type(config).__name__, f.name))
        if tiny is not None and value is not None:
            changes[f.name] = tiny(value, config) if callable(tiny) else tiny
        elif dataclasses.is_dataclass(value) or isinstance(value, (dict, list)):
            changes[f.name] = _olmo_shrink(value)
    return dataclasses.replace(config, **changes)


def _olmo_structure(config: Any) -> tuple:
    def walk(value):
        if dataclasses.is_dataclass(value):
            return (type(value).__name__,) + tuple((f.name, walk(getattr(value, f.name)))
                                                   for f in dataclasses.fields(value)
                                                   if f.name not in _OLMO_NOT_STRUCTURE)
        if isinstance(value, dict):
            return tuple(sorted((str(k), walk(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return tuple(walk(v) for v in value)
        return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    structure = walk(config)
    attention = getattr(config.block, "sequence_mixer", None)
    kv = _kv_heads(attention.n_heads, attention.n_kv_heads) if hasattr(attention, "n_kv_heads") else None
    return structure + (("kv heads", kv),)


def _olmo_builders() -> dict[str, Callable]:
    (transformer,) = _import_library("olmo_core", "olmo_core.nn.transformer")
    config_class = transformer.TransformerConfig
    return {name: getattr(config_class, name) for name in sorted(vars(config_class))
            if isinstance(vars(config_class)[name], classmethod) and name not in _OLMO_GENERIC
            and "vocab_size" in inspect.signature(getattr(config_class, name)).parameters}


def _olmo_groups() -> dict[str, list[str]]:
    groups: dict[tuple, list[str]] = {}
    for name, builder in _olmo_builders().items():
        groups.setdefault(_olmo_structure(builder(vocab_size=VOCAB)), []).append(name)
    return {names[0]: names for names in groups.values()}


def _olmo_layers(config: Any, num_layers: int) -> int:
    """num_layers, or 3 where a sliding-window pattern forces full attention on the first and
    last layers (then 2 layers would have no windowed one)."""
    window = getattr(getattr(config.block, "sequence_mixer", None), "sliding_window", None)
    if window is not None and (window.force_full_attention_on_first_layer or window.force_full_attention_on_last_layer):
        return max(num_layers, 3)
    return num_layers


def build_olmo_core(name: str, *, dtype: torch.dtype = torch.float32, num_layers: int = 2, seq_len: int = 16,
                    batch: int = 2, seed: int = 0) -> TinyModel:
    """olmo-core's TransformerConfig.<name>(...) (e.g. "olmo2_1B") at tiny sizes, built on CPU."""
    builders = _olmo_builders()
    if name not in builders:
        raise ValueError(f"unknown olmo-core TransformerConfig builder {name!r}; known: {', '.join(builders)}")
    config = _olmo_shrink(builders[name](vocab_size=VOCAB))
    num_layers = _olmo_layers(config, num_layers)
    config = dataclasses.replace(config, n_layers=num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = config.build(init_device="cpu")
        model.init_weights(device=torch.device("cpu"))
    return _finish(model, VOCAB, library="olmo_core", name=name, dtype=dtype, batch=batch, seq_len=seq_len, seed=seed,
                   num_layers=num_layers, description=f"olmo-core TransformerConfig.{name}")


# --------------------------------------------------------------------------------------
# torchtitan-npu 0.2.2.post2: its DeepSeek-V3, V3.2 and V4, converters off
# --------------------------------------------------------------------------------------
# torchtitan-npu's models run on torchtitan 0.2.2 (its train.py says "derived from torchtitan
# v0.2.2"; the model code imports 0.2.2's module layout: torchtitan.models.moe.MoEArgs,
# torchtitan.protocols.train_spec). Its converters swap modules for NPU kernels by name
# when a job config asks for them; building the model from its args, as here, never runs
# them: this is the model code as written.

_TORCHTITAN_NPU_DEFAULT_DIR = os.path.join(".cache", "torchtitan-0.2.2")
_TORCHTITAN_NPU_DIR_ENV = "NPU_FX_FUSION_TORCHTITAN_NPU_DIR"


def torchtitan_npu_dir() -> str:
    """Where torchtitan 0.2.2 and torchtitan-npu are unpacked (scripts/test.sh puts them there)."""
    return os.path.abspath(os.environ.get(_TORCHTITAN_NPU_DIR_ENV) or _TORCHTITAN_NPU_DEFAULT_DIR)


def _torchtitan_npu_path() -> None:
    """Put torchtitan 0.2.2 first on sys.path; refuse in a process that imported another torchtitan."""
    folder = torchtitan_npu_dir()
    if not os.path.isdir(os.path.join(folder, "torchtitan_npu")):
        raise ImportError(f"no torchtitan-npu in {folder} (set {_TORCHTITAN_NPU_DIR_ENV}, or run scripts/test.sh, "
                          f"which unpacks it there)")
    loaded = sys.modules.get("torchtitan")
    if loaded is not None and not os.path.abspath(loaded.__file__).startswith(folder + os.sep):
        raise RuntimeError(f"torchtitan is already imported in this process from {loaded.__file__}; "
                           f"torchtitan-npu needs the torchtitan 0.2.2 of {folder}: build torchtitan_npu: models "
                           f"in a fresh process (benchmarks/survey.py and the tests do)")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if "torchtitan_npu" not in sys.modules:
        _bare_torchtitan_npu(folder)


class _PatchedSource(importlib.machinery.SourceFileLoader):
    """A library module loaded from its own file with exact-string replacements, each found
    as often as declared (so a changed library fails loudly instead of running unpatched)."""

    def __init__(self, fullname: str, path: str, replacements: tuple[tuple[str, str, int], ...]):
        super().__init__(fullname, path)
        self.replacements = replacements

    def get_data(self, path):
        data = super().get_data(path)
        if path != self.path:
            return data
        source = data.decode("utf-8")
        for old, new, count in self.replacements:
            if source.count(old) != count:
                raise ImportError(f"{path}: expected {old!r} {count} times, found it {source.count(old)} times")
            source = source.replace(old, new)
        return source.encode("utf-8")

    def path_stats(self, path):  # no bytecode cache for the patched source
        raise OSError


# module -> (text, its replacement, how often, why); line numbers stay the same
_HISTC_CALL = ("        num_tokens_per_expert = torch.histc(\n"
               "            selected_experts_indices.view(-1){},\n"
               "            bins=self.num_experts,\n"
               "            min=0,\n"
               "            max=self.num_experts,\n"
               "        ){}\n")
_HISTC = (_HISTC_CALL.format("", ""), _HISTC_CALL.format(".float()", ".to(selected_experts_indices.dtype)"),
          "the router counts tokens per expert with torch.histc of the int64 expert ids, which has no CPU "
          "kernel for integers (CUDA's and the NPU's take them, and return int64): on CPU the ids are "
          "counted as floats and the counts cast back, as transformers' MoE does on CPU")
_HISTC_TWICE = (*_HISTC[:2], 2, _HISTC[2])  # the router and the token reorderer each count them
_HISTC = (*_HISTC[:2], 1, _HISTC[2])
_TORCHTITAN_NPU_PATCHES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "torchtitan.models.moe.moe": (_HISTC_TWICE,),
    "torchtitan_npu.models.deepseek_v4.model.moe": (_HISTC,),
    "torchtitan_npu.models.deepseek_v4.model.model": (
        ('            device="npu",\n', '            device=query_states.device,\n', 1,
         "SparseAttention.forward allocates its top-k mask on the literal device \"npu\"; on CPU, on the "
         "query's device"),
    ),
}


def _bare_torchtitan_npu(folder: str) -> None:
    """torchtitan_npu without its package __init__, which monkeypatches torchtitan's trainer,
    torch and torch_npu (_apply_patches) for training on an NPU; the models do not need it.
    `torchtitan_npu.train` (the trainer's NPU patches; it imports torch_npu) is stood in for
    by the one function the models import from it, compiled from train.py's own source."""
    package = types.ModuleType("torchtitan_npu")
    package.__path__ = [os.path.join(folder, "torchtitan_npu")]
    package.__file__ = os.path.join(folder, "torchtitan_npu", "__init__.py")
    sys.modules["torchtitan_npu"] = package
    train_file = os.path.join(folder, "torchtitan_npu", "train.py")
    with open(train_file, encoding="utf-8") as f:
        tree = ast.parse(f.read(), train_file)
    kept = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "reshape_for_broadcast"]
    train = types.ModuleType("torchtitan_npu.train", "reshape_for_broadcast of torchtitan_npu/train.py only")
    train.__file__ = train_file
    train.torch = torch
    exec(compile(ast.Module(body=kept, type_ignores=[]), train_file, "exec"), train.__dict__)  # noqa: S102
    sys.modules["torchtitan_npu.train"] = package.train = train
    for module, replacements in _TORCHTITAN_NPU_PATCHES.items():
        path = os.path.join(folder, *module.split(".")) + ".py"
        loader = _PatchedSource(module, path, tuple((old, new, count) for old, new, count, _ in replacements))
        sys.meta_path.insert(0, _ExactModule(module, importlib.util.spec_from_file_location(module, path,
                                                                                           loader=loader)))


class _ExactModule(importlib.abc.MetaPathFinder):
    """A finder returning `spec` for exactly one module name."""

    def __init__(self, name: str, spec):
        self.name, self.spec = name, spec

    def find_spec(self, fullname, path, target=None):
        return self.spec if fullname == self.name else None


_TORCHTITAN_NPU_MODELS = {
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_args", "671B_debug", "DeepSeekV3Model",
                    "torchtitan-npu DeepSeek-V3: torchtitan 0.2.2's model with torchtitan-npu's 671B_debug args "
                    "(sigmoid router with route_norm and route_scale, a shared expert, MLA)"),
    "deepseek_v32": ("torchtitan_npu.models.deepseek_v32", "deepseekv32_args", "debugmodel", "DeepSeekV32Model",
                     "torchtitan-npu DeepSeek-V3.2: MLA with the DSA lightning indexer (Hadamard-rotated q / k, "
                     "top-k sparse mask), sigmoid router"),
    "deepseek_v4": ("torchtitan_npu.models.deepseek_v4", "deepseekv4_args", "285B_debug_4_layers", "DeepSeekV4Model",
                    "torchtitan-npu DeepSeek-V4: mHC over 4 streams, sliding / compressed sparse (with indexer) / "
                    "heavily compressed attention with sinks, hash and sqrt-softplus routers, clamped SwiGLU"),
}
# the import order of torchtitan_npu's own __init__: V3.2's args subclass V3's
_TORCHTITAN_NPU_IMPORTS = ("torchtitan_npu.models.deepseek_v3", "torchtitan_npu.models.deepseek_v32",
                           "torchtitan_npu.models.deepseek_v4")
_TORCHTITAN_NPU_MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)


def _torchtitan_npu_args(name: str, args: Any, num_layers: int) -> Any:
    """The flavor's model args at tiny sizes (as tiny_models' DeepSeek-V3 / V3.2 / V4)."""
    # use_grouped_mm=False: the grouped-GEMM path pads each expert's token group with a Triton
    # kernel (torchtitan/models/moe/kernels.py, generate_permute_indices), which has no CPU
    # backend; the experts run as torchtitan's for-loop over them instead
    moe = dataclasses.replace(args.moe_args, num_experts=EXPERTS, top_k=TOP_K, use_grouped_mm=False)
    if getattr(moe, "num_expert_groups", None):
        moe = dataclasses.replace(moe, num_expert_groups=2, num_limited_groups=1)
    common = dict(vocab_size=VOCAB, dim=WIDTH, n_heads=HEADS, moe_inter_dim=EXPERT_MLP, moe_args=moe,
                  max_seq_len=256, n_layers=num_layers)
    if name in ("deepseek_v3", "deepseek_v32"):
        common.update(_TORCHTITAN_NPU_MLA, inter_dim=MLP, n_dense_layers=1)
    if name == "deepseek_v32":  # the indexer keeps 8 of 16 keys (tiny_models' deepseek_v32 says why 16 heads)
        common.update(index_n_heads=16, index_head_dim=32, index_topk=8)
    if name == "deepseek_v4":  # one layer of each kind: sliding window, CSA (ratio 4, indexer), HCA (ratio 8)
        moe = dataclasses.replace(moe, n_hash_layers=1)
        common.update(moe_args=moe, head_dim=32, rope_head_dim=8, q_lora_rank=32, o_lora_rank=16, o_groups=2,
                      compress_ratios=(1, 4, 8)[:num_layers], index_n_heads=16, index_head_dim=16, index_topk=3,
                      max_batch_size=4)
    args = dataclasses.replace(args, **common)
    # update_from_config(job_config) sets it from the job's expert-parallel backend; the
    # default job's is the single-device "standard" dispatcher
    args.moe_impl = "standard"
    return args


def build_torchtitan_npu(name: str, *, dtype: torch.dtype = torch.float32, num_layers: Optional[int] = None,
                         seq_len: Optional[int] = None, batch: int = 2, seed: int = 0) -> TinyModel:
    """torchtitan-npu's model `name` (deepseek_v3, deepseek_v32, deepseek_v4) at tiny sizes,
    converters off. num_layers None: 2 (V4: 3, one per attention kind).

    dtype: float32, or bfloat16 as torchtitan trains on one device with
    mixed_precision_param="bfloat16": float32 parameters, the forward under
    ``torch.autocast(dtype=bfloat16)`` (its maybe_enable_amp; with FSDP the same cast is
    FSDP's param_dtype). The models mix dtypes on purpose (V4 keeps its hyper-connection
    weights and norms float32 and its Hadamard matrix and top-k mask bfloat16), so casting
    their parameters does not run. V4 runs in bfloat16 only (float32 raises in its code).
    V4's compressed attention needs seq_len divisible by its ratios (4, 8)."""
    if name not in _TORCHTITAN_NPU_MODELS:
        raise ValueError(f"unknown torchtitan-npu model {name!r}; known: {', '.join(_TORCHTITAN_NPU_MODELS)}")
    num_layers = (3 if name == "deepseek_v4" else 2) if num_layers is None else num_layers
    seq_len = 16 if seq_len is None else seq_len
    module_name, flavors, flavor, model_class, description = _TORCHTITAN_NPU_MODELS[name]
    _import_library("torchtitan_npu", *_TORCHTITAN_NPU_IMPORTS)
    module = importlib.import_module(module_name)
    args = _torchtitan_npu_args(name, getattr(module, flavors)[flavor], num_layers)
    if name == "deepseek_v32":
        # its SDPA runs under sdpa_kernel(DSV32_SDPA.sdpa_backends): cuDNN, flash and
        # memory-efficient attention by default, none of which runs on CPU; the class
        # variable is its setting for the backends, extended by the math one
        from torch.nn.attention import SDPBackend

        sdpa = importlib.import_module("torchtitan_npu.models.deepseek_v32.model.model").DSV32_SDPA
        sdpa.sdpa_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(module, model_class)(args)
        with torch.no_grad():  # as torchtitan's trainer calls it
            model.init_weights(buffer_device=torch.device("cpu"))
    if dtype != torch.float32:
        model = _Autocast(model, dtype)
    return _finish(model, VOCAB, library="torchtitan_npu", name=name, dtype=dtype, batch=batch, seq_len=seq_len,
                   seed=seed, num_layers=num_layers, description=description, cast=False)


class _Autocast(nn.Module):
    """`model`'s forward under torch.autocast(dtype): torchtitan's mixed precision on one device."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(tokens.device.type, dtype=self.dtype):
            return self.model(tokens)


# --------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------

_OLMO_SKIPPED = {
    # their token dispatch is MegaBlocks' Triton kernels (olmo_core/kernels/moe.py:
    # binned_gather, gather, scatter), which have no CPU backend
    "smallmoe": "its MoE dispatches tokens with Triton kernels (olmo_core/kernels/moe.py binned_gather / gather / "
                "scatter), which need a GPU",
    "small_hybrid_moe": "its MoE dispatches tokens with Triton kernels (olmo_core/kernels/moe.py), which need a GPU",
    "olmoe_1B_7B": "its dropless MoE dispatches tokens with Triton kernels (olmo_core/kernels/moe.py) and runs its "
                   "experts in grouped_gemm's CUDA gmm behind torch._dynamo.disable, which need a GPU",
    "qwen3_5_0_8B": "its gated DeltaNet layers need flash-linear-attention's Triton kernels (fla), a GPU",
}


def third_party_models(library: str) -> list[Architecture]:
    """The tiny models of `library` (one per architecture), then the builders not built and why."""
    if library == "torchtune":
        return _torchtune_architectures()
    if library == "litgpt":
        return [Architecture("litgpt", name, tuple(names), f"litgpt config {name!r}")
                for name, names in _litgpt_groups().items()]
    if library == "olmo_core":
        groups = _olmo_groups()
        return [Architecture("olmo_core", name, tuple(names), f"olmo-core TransformerConfig.{name}",
                             skip=next((_OLMO_SKIPPED[n] for n in names if n in _OLMO_SKIPPED), ""))
                for name, names in groups.items()]
    if library == "torchtitan_npu":
        return [Architecture("torchtitan_npu", name, (f"{module}:{flavors}[{flavor!r}]",), description)
                for name, (module, flavors, flavor, _, description) in _TORCHTITAN_NPU_MODELS.items()]
    raise ValueError(f"unknown library {library!r}; known: {', '.join(LIBRARIES)}")


_BUILDERS = {"torchtune": build_torchtune, "litgpt": build_litgpt, "olmo_core": build_olmo_core,
             "torchtitan_npu": build_torchtitan_npu}


def build_third_party(library: str, name: str, **kwargs: Any) -> TinyModel:
    """The tiny model `name` of `library` (see third_party_models); kwargs: dtype, num_layers, seq_len, batch, seed."""
    if library not in _BUILDERS:
        raise ValueError(f"unknown library {library!r}; known: {', '.join(LIBRARIES)}")
    return _BUILDERS[library](name, **kwargs)
