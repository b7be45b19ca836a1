"""The fusion sites present in a third-party model, counted without the passes (issue 28).

A pass's own report says what it fused and where it left a near miss; a site it did not
even notice (a silent miss) appears in neither. So the sites a model holds are counted here
from the model itself: one eager forward with hooks on every module call and on the
library's RoPE functions, and a table, per library, of what each module class computes
(written by reading the library's code; `SITES` says where each count comes from). Every
module class a model contains must be in the table (with its sites, or with none and why):
a class nobody looked at fails the census instead of hiding sites.

Categories and the passes that fuse them (CATEGORIES): an RMSNorm; a residual add feeding
an RMSNorm (add_rms_norm: counted where an RMSNorm's input is the output of an add, read
from its autograd node); one RoPE application to one tensor (q and k are two); a SwiGLU
(silu(gate) * up); an attention; a MoE layer's router, token dispatch / combine, and its
expert GEMMs (one per expert weight: w1, w3, w2); DeepSeek's lightning indexer and its
indexer loss; a hyper-connection pre or post mix (mHC).

`census(model, inputs, library)` -> [Site]; `attribute(sites, report)` matches a report's
fused sites and near misses to them (same category, by module path and source line), and
leaves the rest silent; `measure(library, name, mode)` does both for one compile.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import sys
import types
from typing import Any, Callable, Optional

import torch
from torch import nn

# category -> the passes that fuse it
CATEGORIES: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rms_norm",),
    "add_rms_norm": ("add_rms_norm",),
    "rope": ("rope", "kv_rmsnorm_rope_cache"),
    "swiglu": ("swiglu", "swiglu_group"),
    "attention": ("attention",),
    # DeepSeek-V3.2's attention over the indexer's top-k keys, V4's sparse MLA
    "sparse_attention": ("sparse_attention", "sparse_mla"),
    "moe_router": ("moe_gating",),
    "moe_dispatch": ("moe_dispatch",),
    "moe_experts": ("grouped_matmul",),
    "indexer": ("lightning_indexer",),
    "indexer_loss": ("softmax_l1_norm",),
    "mhc": ("mhc_pre", "mhc_post"),
}
CATEGORY_OF_PASS = {p: c for c, passes in CATEGORIES.items() for p in passes}
# Not counted in a training step's totals: no pass fuses a dense attention in training (the
# attention pass emits the inference op npu_fused_infer_attention_score); on an NPU, SDPA
# reaches the graph as npu_fusion_attention through torch_npu's dispatch, not a pass.
NOT_IN_TRAINING = ("attention",)
# a site of another category a pass's item may stand for, when none of its own is left: the
# dense attention pass fusing a sparse attention (over its materialised top-k mask) did
# not make it the sparse op: a near miss of it, with this reason
STANDS_FOR = {"attention": ("sparse_attention", "fused by the attention pass as a dense npu_fused_infer_attention_score "
                                                "over the materialised top-k mask, not as a sparse attention")}


@dataclasses.dataclass(frozen=True)
class Site:
    category: str
    module: str  # the module path whose call holds it ("" for the root)
    source: str  # where the code is: "file.py:line (Class.forward)" or the function's
    count: int = 1
    span: tuple = ()  # (absolute file, first line, last line) of the class or function
    children: tuple = ()  # the module's sub-module paths, relative to it ("router", "experts")
    caller: tuple = ()  # the span of the module whose forward calls it (() for the root's own)

    def holds(self, file: str, line: int) -> bool:
        return bool(self.span) and file == self.span[0] and self.span[1] <= line <= self.span[2]


Rule = Callable[[nn.Module, str], dict]  # (module, path) -> {category: sites per call}


def _fixed(**sites: int) -> Rule:
    return lambda module, path: sites


NONE = _fixed()


def _swiglu_unless_expert(module: nn.Module, path: str) -> dict:
    # an expert of a MoE that loops over its experts: its SwiGLU is the MoE's (one site)
    return {} if ".experts." in f".{path}." else {"swiglu": 1}


def _torchtune_feed_forward(module: nn.Module, path: str) -> dict:
    # torchtune.modules.FeedForward: w2(act(w1(x)) * w3(x)); SwiGLU when the activation is SiLU
    return {"swiglu": 1} if isinstance(module.activation, nn.SiLU) and module.w3 is not None else {}


def _olmo_feed_forward(module: nn.Module, path: str) -> dict:
    # olmo_core.nn.feed_forward.FeedForward: SwiGLU with F.silu, GeGLU (Gemma 3's gelu_tanh) otherwise
    return {"swiglu": 1} if module.activation_fn is torch.nn.functional.silu else {}


# A MoE layer: its router, its token dispatch and combine, its routed experts' GEMMs (w1,
# w3, w2) and their SwiGLU (one, over all routed tokens).
MOE = _fixed(moe_router=1, moe_dispatch=1, moe_experts=3, swiglu=1)

# library -> {class "module.QualName": rule}; `why` strings are for the classes with no site
SITES: dict[str, dict[str, Rule]] = {
    "torch": {
        "torch.nn.modules.normalization.RMSNorm": _fixed(rms_norm=1),
        # no site: containers, projections, embeddings, activations (counted in their MLP),
        # LayerNorm (centred: not an RMSNorm)
        **{f"torch.nn.modules.{name}": NONE for name in (
            "container.ModuleList", "container.ModuleDict", "container.Sequential", "linear.Linear",
            "linear.Identity", "sparse.Embedding", "activation.SiLU", "activation.GELU", "dropout.Dropout",
            "normalization.LayerNorm")},
    },
    "torchtune": {
        "torchtune.modules.rms_norm.RMSNorm": _fixed(rms_norm=1),  # F.rms_norm(x.float(), ...).to(x.dtype)
        "torchtune.models.gemma.rms_norm.GemmaRMSNorm": _fixed(rms_norm=1),  # x * rsqrt(...) * (1 + w)
        # each call rotates one tensor (MultiHeadAttention calls it for q, then for k)
        "torchtune.modules.position_embeddings.RotaryPositionalEmbeddings": _fixed(rope=1),
        "torchtune.models.llama3_1._position_embeddings.Llama3ScaledRoPE": _fixed(rope=1),
        "torchtune.models.phi3._position_embeddings.Phi3RotaryPositionalEmbeddings": _fixed(rope=1),
        "torchtune.models.qwen2._positional_embeddings.Qwen2RotaryPositionalEmbeddings": _fixed(rope=1),
        "torchtune.modules.attention.MultiHeadAttention": _fixed(attention=1),
        "torchtune.models.gemma2._attention.Gemma2Attention": _fixed(attention=1),
        "torchtune.modules.feed_forward.FeedForward": _torchtune_feed_forward,
        # no site: the decoder and its layers (residual adds: add_rms_norm, counted at the
        # norms), Gemma's embedding scale, Gemma 2's final norm (its RMSNorm child counts)
        # and its logit soft-capping
        **{name: NONE for name in (
            "torchtune.modules.transformer.TransformerDecoder",
            "torchtune.modules.transformer.TransformerSelfAttentionLayer",
            "torchtune.models.gemma.gemma_norm_embedding.GemmaNormEmbeddings",
            "torchtune.models.gemma2._component_builders.Gemma2FinalNorm",
            "torchtune.models.gemma2._component_builders.TanhSoftCapping",
            "torchtune.modules.classifier.ClassifierHead")},
    },
    "litgpt": {
        "litgpt.model.RMSNorm": _fixed(rms_norm=1),
        # one attention per call; its RoPE is apply_rope / apply_rope_interleave (FUNCTIONS)
        "litgpt.model.CausalSelfAttention": _fixed(attention=1),
        "litgpt.model.LLaMAMLP": _swiglu_unless_expert,  # proj(silu(fc_1(x)) * fc_2(x))
        "litgpt.model.LLaMAMoE": MOE,  # gate, top-k, softmax; a loop over its LLaMAMLP experts
        # no site: GELU MLPs (GemmaMLP: gelu(fc_1) * fc_2 is GeGLU; GptNeoxMLP), the blocks,
        # the grouped router (the MoE's router site)
        **{f"litgpt.model.{name}": NONE for name in ("GPT", "Block", "GemmaMLP", "GptNeoxMLP",
                                                      "GroupedTopkRouter")},
    },
    "olmo_core": {
        "olmo_core.nn.layer_norm.RMSNorm": _fixed(rms_norm=1),
        "olmo_core.nn.layer_norm.QwenRMSNorm": _fixed(rms_norm=1),
        "olmo_core.nn.rope.RotaryEmbedding": _fixed(rope=2),  # q, k = self.rope(q, k): both rotated
        "olmo_core.nn.attention.Attention": _fixed(attention=1),
        "olmo_core.nn.attention.NormalizedAttention": _fixed(attention=1),
        "olmo_core.nn.feed_forward.FeedForward": _olmo_feed_forward,  # w2(act(w1(x)) * w3(x))
        "olmo_core.nn.feed_forward.NormalizedFeedForward": _fixed(swiglu=1),  # silu(w1 x * s_u) * (w3 x * s_v)
        # no site: nGPT's L2Norm (x / ||x||: no eps, no mean; not an RMSNorm), the attention
        # backend (its attention's), the LM heads (their norm child counts), residual streams
        **{f"olmo_core.nn.{name}": NONE for name in (
            "layer_norm.L2Norm", "attention.backend.TorchAttentionBackend", "lm_head.LMHead",
            "lm_head.NormalizedLMHead", "residual_stream.ResidualStream", "transformer.model.Transformer",
            "transformer.model.NormalizedTransformer", "transformer.block.TransformerBlock",
            "transformer.block.ReorderedNormTransformerBlock", "transformer.block.PeriNormTransformerBlock",
            "transformer.block.NormalizedTransformerBlock")},
    },
    "torchtitan_npu": {
        # torchtitan 0.2.2 (DeepSeek-V3's model, and the MoE V3.2 / V4 use)
        "torchtitan.models.deepseek_v3.model.model.Attention": _fixed(attention=1),
        "torchtitan.models.moe.moe.MoE": MOE,
        "torchtitan.models.moe.moe.FeedForward": _fixed(swiglu=1),  # w2(silu(w1(x)) * w3(x)): dense / shared
        **{f"torchtitan.models.{name}": NONE for name in (
            "deepseek_v3.model.model.DeepSeekV3Model", "deepseek_v3.model.model.TransformerBlock",
            "attention.ScaledDotProductAttentionWrapper", "moe.moe.GroupedExperts", "moe.moe.TokenChoiceTopKRouter",
            "moe.moe.TokenReorderer")},
        # torchtitan-npu DeepSeek-V3.2
        "torchtitan_npu.models.deepseek_v32.model.model.RMSNorm": _fixed(rms_norm=1),
        # The ops' computations are where the sites are counted: the lightning indexer's scores and
        # top-k (bf16_index, topk), the loss's target distribution (get_attn_scores: the softmax
        # summed over heads, L1-normalised) and the SDPA over the top-k mask all run in
        # DSV32_SDPA.forward. Indexer only projects the indexer's q, k and weights (their inputs);
        # DSAIndexerLoss is the KL divergence between two distributions (no op replaces it).
        "torchtitan_npu.models.deepseek_v32.model.model.DSV32_SDPA": _fixed(sparse_attention=1, indexer=1,
                                                                             indexer_loss=1),
        "torchtitan_npu.models.common.dsa_indexer_loss.DSAIndexerLoss": NONE,
        **{f"torchtitan_npu.models.deepseek_v32.model.model.{name}": NONE for name in (
            "DeepSeekV32Model", "TransformerBlockV32", "Attention", "PreAttention", "PostAttention", "Indexer")},
        # torchtitan-npu DeepSeek-V4
        "torchtitan_npu.models.deepseek_v4.model.model.RMSNorm": _fixed(rms_norm=1),
        # + the weightless per-head q norm written inline: q * rsqrt(mean(q^2) + eps) (model.py:587)
        "torchtitan_npu.models.deepseek_v4.model.model.PreAttention": _fixed(rms_norm=1),
        "torchtitan_npu.models.deepseek_v4.model.model.SparseAttention": _fixed(sparse_attention=1),
        # the indexer's scores and top-k are LiCompute's (Indexer projects q, k and weights); the
        # loss's target distribution is LiLoss's (GetAttnScores within it)
        "torchtitan_npu.models.deepseek_v4.model.model.LiCompute": _fixed(indexer=1),
        "torchtitan_npu.models.deepseek_v4.model.model.LiLoss": _fixed(indexer_loss=1),
        "torchtitan_npu.models.deepseek_v4.model.model.HcPre": _fixed(mhc=1),
        "torchtitan_npu.models.deepseek_v4.model.model.HcPost": _fixed(mhc=1),
        "torchtitan_npu.models.deepseek_v4.model.moe.MoE": MOE,  # hash / sqrt-softplus router, clamped SwiGLU
        # no site: the model, its blocks and attention wrappers, the final hyper-connection
        # head (no converter of torchtitan-npu replaces it), the helpers of the sites above
        **{f"torchtitan_npu.models.deepseek_v4.model.{name}": NONE for name in (
            "model.DeepSeekV4Model", "model.DeepSeekV4TransformerBlock", "model.Attention", "model.InnerAttention",
            "model.PostAttention", "model.Compressor", "model.HcHead", "model.HcSplitSinkhorn", "model.GetAttnScores",
            "model.Indexer", "model.GetWindowTopkIdxs", "model.GetCompressTopkIdxs", "moe.TokenChoiceTopKRouter")},
        # the survey's bf16 wrapper (tiny_third_party._Autocast)
        "npu_fx_fusion.tiny_third_party._Autocast": NONE,
    },
}
# library -> [(module, function, category)]: each call is one site
FUNCTIONS: dict[str, list[tuple[str, str, str]]] = {
    "litgpt": [("litgpt.model", "apply_rope", "rope"), ("litgpt.model", "apply_rope_interleave", "rope")],
    "torchtitan_npu": [("torchtitan.models.deepseek_v3.model.model", "apply_rotary_emb", "rope"),
                       ("torchtitan_npu.models.deepseek_v32.model.model", "apply_rotary_emb", "rope"),
                       ("torchtitan_npu.models.deepseek_v4.model.model", "apply_rotary_emb", "rope")],
}
# the classes whose input, when it is the output of an add, makes an add_rms_norm site
_NORMS = {"rms_norm"}


def _qualname(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _source(obj: Any) -> str:
    try:
        function = obj.forward if isinstance(obj, nn.Module) else obj
        file = inspect.getsourcefile(function) or "?"
        line = inspect.getsourcelines(function)[1]
    except (OSError, TypeError):
        return "?"
    for marker in ("site-packages/", "torchtitan-0.2.2/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    name = type(obj).__qualname__ + ".forward" if isinstance(obj, nn.Module) else obj.__qualname__
    return f"{file}:{line} ({name})"


def _span(obj: Any) -> tuple:
    """(file, first, last line) of a module's class (all its methods) or of a function."""
    target = type(obj) if isinstance(obj, nn.Module) else obj
    try:
        lines, first = inspect.getsourcelines(target)
        return (inspect.getsourcefile(target), first, first + len(lines) - 1)
    except (OSError, TypeError):
        return ()


def _rules(library: str) -> dict[str, Rule]:
    return {**SITES["torch"], **SITES[library]}


def census(model: nn.Module, inputs: tuple, library: str) -> list[Site]:
    """The sites `model` holds: one eager forward (gradients on, so each norm's input tells
    whether an add made it), its module calls and the library's RoPE-function calls counted."""
    rules = _rules(library)
    unknown = sorted({_qualname(m) for m in model.modules()} - set(rules))
    if unknown:
        raise ValueError(f"{library}: module classes the census has no entry for (read their code, then add "
                         f"them to third_party_sites.SITES): {', '.join(unknown)}")
    sites: list[Site] = []
    stack: list[tuple[nn.Module, str]] = []

    def path_of(module: nn.Module) -> str:
        if not stack:
            return ""
        parent, parent_path = stack[-1]
        name = next((n for n, child in parent.named_modules() if child is module and n), None)
        return f"{parent_path}.{name}".lstrip(".") if name is not None else parent_path

    def pre_hook(module, args):
        if not any(m is module for m, _ in stack) and _in(module):
            path = path_of(module)
            caller = _span(stack[-1][0]) if stack else ()
            stack.append((module, path))
            for category, count in rules[_qualname(module)](module, path).items():
                children = tuple(name for name, _ in module.named_modules() if name)
                sites.append(Site(category, path, _source(module), count, _span(module), children, caller))
                if category in _NORMS and args and getattr(args[0], "grad_fn", None) is not None \
                        and type(args[0].grad_fn).__name__ == "AddBackward0":
                    sites.append(Site("add_rms_norm", path, _source(module), 1, _span(module), (), caller))

    def post_hook(module, args, output):
        if stack and stack[-1][0] is module:
            stack.pop()

    members = {id(m) for m in model.modules()}

    def _in(module):
        return id(module) in members

    wrapped = []
    for module_name, function_name, category in FUNCTIONS.get(library, []):
        namespace = sys.modules.get(module_name)
        if namespace is None or not hasattr(namespace, function_name):
            continue
        original = getattr(namespace, function_name)

        def counting(*args, _original=original, _category=category, **kwargs):
            sites.append(Site(_category, stack[-1][1] if stack else "", _source(_original), 1, _span(_original)))
            return _original(*args, **kwargs)
        setattr(namespace, function_name, counting)
        wrapped.append((namespace, function_name, original))
    handles = [nn.modules.module.register_module_forward_pre_hook(pre_hook),
               nn.modules.module.register_module_forward_hook(post_hook)]
    try:
        with torch.enable_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
        for namespace, function_name, original in wrapped:
            setattr(namespace, function_name, original)
    return sites


def present(sites: list[Site], training: bool = False) -> collections.Counter:
    """{category: sites} (a training step's categories only, with training=True)."""
    counts = collections.Counter()
    for site in sites:
        if not (training and site.category in NOT_IN_TRAINING):
            counts[site.category] += site.count
    return counts


@dataclasses.dataclass
class Attribution:
    """Per category: sites present, fused, near-missed (with reasons), silent; and the report
    items that matched no site (a pass acting on something the census does not count)."""

    present: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    near: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    silent: list = dataclasses.field(default_factory=list)  # [Site] (one per unmatched site unit)
    # [(Site, why)]: unmatched sites in code the report names as run in eager (a function
    # dynamo skipped after a graph break): no pass saw them, and the report says why
    eager: list = dataclasses.field(default_factory=list)
    near_reasons: list = dataclasses.field(default_factory=list)  # [(category, pass, reason, location)]
    extra: list = dataclasses.field(default_factory=list)  # [(kind, pass, reason or form, location)]

    def totals(self) -> tuple[int, int, int, int]:
        """(present, fused, near-missed, silent): a site in eager code is not silent, nor a
        near miss."""
        present = sum(self.present.values())
        fused = sum(self.fused.values())
        near = sum(self.near.values())
        return present, fused, near, present - fused - near - len(self.eager)


def _match(location: Any, site: Site) -> int:
    """How well a report item at `location` matches `site` (0: not at all).

    A graph compiled for a sub-module's frame (after a graph break) names modules relative
    to it ("attn" for "transformer.h.0.attn"): a path matches the site's, or its end.
    4: the item's source line is in the site's code and the paths agree; 3: the paths agree;
    2: the item is inside the site's module; 1: only the source line, or an item with no
    module path."""
    item, path = location.module.split(".") if location.module else [], site.module.split(".") if site.module else []
    # the item's path read from any module the site's path passes through (a sub-frame's graph)
    tails = [path[i:] for i in range(len(path))] or [[]]
    same = bool(item) and any(item == tail for tail in tails)
    # inside it: below one of those, or a sub-module path of the site's module (a graph of
    # that module's own frame names its children from it)
    inside = bool(item) and (any(item[:len(tail)] == tail and len(item) > len(tail) for tail in tails)
                             or location.module in site.children)
    in_code = site.holds(location.file, location.line)
    if same and in_code:
        return 4
    if same:
        return 3
    if inside:
        return 2
    if in_code or not item:
        return 1
    return 0


def attribute(sites: list[Site], report: Any, repeats: Optional[dict] = None,
              training: bool = False, observed: Optional[dict] = None) -> Attribution:
    """Match `report`'s fused sites, then its near misses, to `sites`; each item once per
    run of its graph (`repeats`: {report graph index: runs}; a graph dynamo reused for
    several layers after a graph break is one report for all of them). A site takes the
    best-matching item (_match) of its category; add_rms_norm's by count, as its fused site
    is reported at the add's module, not the norm's. Sites left over are in eager where the
    report's dynamo_gaps name a function dynamo skipped in their code (with the break), else
    silent."""
    result = Attribution(present=present(sites, training))
    free = [s for s in sites for _ in range(s.count) if not (training and s.category in NOT_IN_TRAINING)]
    items = []
    for index, graph in enumerate(report.graphs):
        copies = (repeats or {}).get(index, 1)
        for pass_result in graph.passes:
            items += [(0, "fused", s.pass_name, s.form, s.location, copies) for s in pass_result.sites]
            # a near miss seen at run time (an add and a norm in two graphs) counts as often as seen
            # in the counted call (`observed`: CountingBackend.observed; else all the runs so far)
            items += [(1, "near", m.pass_name, m.reason, m.location, _seen(m, observed) or copies)
                      for m in pass_result.near_misses]
    items.sort(key=lambda item: item[0])  # fused sites claim theirs before near misses
    for _, kind, pass_name, what, location, copies in items:
        for _copy in range(copies):
            category = CATEGORY_OF_PASS.get(pass_name)
            candidates = [s for s in free if s.category == category]
            if not candidates and category in STANDS_FOR:
                category, why = STANDS_FOR[category]
                candidates = [s for s in free if s.category == category]
                kind, what = "near", f"{why} ({what})"
            if category == "add_rms_norm":
                best = candidates[0] if candidates else None
            else:
                scored = [(_match(location, s), -i, s) for i, s in enumerate(candidates)]
                scored = [t for t in scored if t[0]]
                best = max(scored, key=lambda t: t[:2])[2] if scored else None
            if best is None:
                result.extra.append((kind, pass_name, what, str(location)))
                continue
            free.remove(best)
            if kind == "fused":
                result.fused[category] += 1
            else:
                result.near[category] += 1
                result.near_reasons.append((category, pass_name, what, str(location)))
    gaps = getattr(report, "dynamo_gaps", None)
    for site in free:
        why = gaps.eager_reason(*site.span) if gaps is not None and site.span else None
        if not why and gaps is not None and site.caller:
            # dynamo compiles no frame of torch.nn's own modules: called from a forward that ran
            # in eager, one runs in eager too; and a residual add is computed by the calling code
            caller = gaps.eager_reason(*site.caller)
            if caller and site.category == "add_rms_norm":
                why = f"the add is the calling code's, which ran in eager: {caller}"
            elif caller and _torch_nn(site.span):
                why = f"a torch.nn module called from code that ran in eager: {caller}"
        if why:
            result.eager.append((site, why))
        else:
            result.silent.append(site)
    return result


# ---- measuring one model in one mode --------------------------------------------------------
MODES = ("fp32", "bf16 dynamic", "training")
# the dynamic graph also runs these (batch, sequence) sizes: multiples of 8 tokens, which
# DeepSeek-V4's compressed attention needs (ratios 4 and 8)
DYNAMIC_SIZES = ((3, 24), (5, 32))
# logits / gradients further from eager than this, relative to their largest value, are
# flagged (a tiny random model's fp32 logits through two layers stay well under 1e-4; in
# bf16 the fused ops' single rounding moves them a few bf16 ulps)
FLAG = {"fp32": 1e-4, "bf16 dynamic": 5e-2, "training": 1e-3}


class CountingBackend:
    """The emulation backend, also counting how often each compiled (dynamo) graph runs:
    a graph dynamo reuses for several layers (after a graph break) is one report for
    several layers' sites (issue 28, item 7)."""

    def __init__(self, config):
        from npu_fx_fusion.backend import EmulationBackend

        self.inner = EmulationBackend(config)
        self.calls: list[int] = []  # per dynamo graph, calls while `counting`
        self.graph_of_report: list[int] = []  # report graph index -> dynamo graph index
        # near misses seen at run time (NearMiss.observed): how often during the counted call
        self.observed: Optional[dict] = None
        self._counting = True

    @property
    def counting(self) -> bool:
        return self._counting

    @counting.setter
    def counting(self, on: bool) -> None:
        if self._counting and not on:
            self.observed = {(m.pass_name, m.reason, m.location): m.observed for m in self.report.near_misses
                             if m.observed is not None}
        self._counting = on

    @property
    def report(self):
        return self.inner.report

    def __call__(self, gm, example_inputs):
        index = len(self.calls)
        self.calls.append(0)
        before = len(self.report.graphs)
        compiled = self.inner(gm, example_inputs)
        self.graph_of_report += [index] * (len(self.report.graphs) - before)

        def run(*args):
            if self.counting:
                self.calls[index] += 1
            return compiled(*args)
        run._boxed_call = getattr(compiled, "_boxed_call", False)  # noqa: SLF001
        return run

    def repeats(self) -> dict[int, int]:
        """{report graph index: times its dynamo graph ran in the counted call}."""
        graph_of = self.graph_of_report + [self.graph_of_report[-1] if self.graph_of_report else 0] * (
            len(self.report.graphs) - len(self.graph_of_report))  # backward graphs: their forward's
        return {i: max(1, self.calls[g]) for i, g in enumerate(graph_of) if g < len(self.calls)}


@dataclasses.dataclass
class Measurement:
    spec: str
    mode: str
    attribution: Optional[Attribution] = None
    error: Optional[float] = None  # logits (and in training gradients) vs eager, relative
    graphs: int = 0  # dynamo graphs compiled
    reused: int = 0  # extra runs of compiled graphs in one forward (graph reuse)
    seconds: float = 0.0
    note: str = ""  # why it did not run, pass errors, flags
    crash_with_dispatch: Optional[str] = None  # training: the NPU-dispatch step's error, if any
    sites: list = dataclasses.field(default_factory=list)  # the census
    # the report's: (graph, kind, pass, what, location, observed: NearMiss.observed or None)
    items: list = dataclasses.field(default_factory=list)
    repeats: dict = dataclasses.field(default_factory=dict)  # {report graph: runs}
    eager_code: tuple = ()  # the report's dynamo_gaps.eager_code: functions dynamo ran in eager


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().item()
    return (actual.float() - expected.float()).abs().max().item() / (scale or 1.0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _training_step(model, ids, backend):
    """(logits, {param: grad}) of one forward + backward (loss: mean of squared logits)."""
    for p in model.parameters():
        p.grad = None
    runner = torch.compile(model, backend=backend) if backend is not None else model
    out = runner(ids)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_run(model, ids, backend, symbolic, result):
    """Compile `model` (the dims of `symbolic` marked dynamic), run it once on `ids`, keep the
    error in `result`; returns the compiled model."""
    inputs = ids.clone()
    for dim in symbolic:
        torch._dynamo.mark_dynamic(inputs, dim)
    compiled = torch.compile(model, backend=backend, dynamic=bool(symbolic) or None)
    with torch.no_grad():
        result.error = _relative(compiled(inputs), model(inputs))
    backend.counting = False
    return compiled


def measure(library: str, name: str, mode: str, *, npu_dispatch: bool = True, dtype=None) -> Measurement:
    """Build `library:name` tiny, compile it in `mode` (MODES) with the emulation backend,
    compare with eager, and attribute the report to the census's sites. training: one step
    with npu_dispatch=False (`npu_dispatch` is ignored; the step with it is run after, and
    only whether it raises is kept: the emulated npu_fusion_attention_grad_v3's strides)."""
    import time

    import npu_fx_fusion as nff
    from npu_fx_fusion.tiny_third_party import build_third_party

    spec = f"{library}:{name}"
    result = Measurement(spec, mode)
    start = time.perf_counter()
    torch._dynamo.reset()
    if dtype is None:
        dtype = torch.bfloat16 if mode == "bf16 dynamic" else torch.float32
    tiny = build_third_party(library, name, dtype=dtype)
    model, (ids,) = tiny.model, tiny.example_inputs
    try:
        sites = census(model, (ids,), library)
    except Exception as exc:  # noqa: BLE001 - the model does not run in this dtype
        result.note = f"does not run eagerly in {dtype}: {_first_line(exc)}"
        return result
    config = nff.FusionConfig(npu_dispatch=npu_dispatch and mode != "training")
    backend = CountingBackend(config)
    try:
        if mode == "training":
            model.train()
            eager_out, eager_grads = _training_step(model, ids, None)
            out, grads = _training_step(model, ids, backend)
            backend.counting = False
            result.error = max([_relative(out, eager_out)] + [_relative(grads[k], eager_grads[k]) for k in eager_grads
                                                                if k in grads])
            missing = sorted(set(eager_grads) - set(grads))
            if missing:
                result.note += f"gradients missing for {missing[:3]}; "
        else:
            dynamic = mode.endswith("dynamic")
            symbolic = (0, 1) if dynamic else ()
            try:
                compiled = _compiled_run(model, ids, backend, symbolic, result)
            except Exception as exc:  # noqa: BLE001
                if not (dynamic and "ConstraintViolation" in type(exc).__name__):
                    raise
                # the model's code specialises the sequence length (a Python loop over it):
                # only the batch stays symbolic
                torch._dynamo.reset()
                backend = CountingBackend(config)
                result.note += "the sequence length is specialised by the model's code (only the batch is " \
                               "symbolic); "
                symbolic = (0,)
                compiled = _compiled_run(model, ids, backend, symbolic, result)
            with torch.no_grad():
                for batch, seq in DYNAMIC_SIZES if dynamic else ():
                    seq = seq if 1 in symbolic else ids.shape[1]
                    other = torch.randint(3, int(ids.max()) + 1, (batch, seq),
                                          generator=torch.Generator().manual_seed(batch))
                    result.error = max(result.error, _relative(compiled(other), model(other)))
    except Exception as exc:  # noqa: BLE001 - recorded, the survey goes on
        result.note += f"compile / run failed: {_first_line(exc)}"
        result.seconds = time.perf_counter() - start
        return result
    report = backend.report
    result.graphs = len(backend.calls)
    result.reused = sum(max(0, c - 1) for c in backend.calls)
    if backend.counting:
        backend.counting = False
    result.attribution = attribute(sites, report, backend.repeats(), training=mode == "training",
                                   observed=backend.observed)
    result.sites, result.repeats = sites, backend.repeats()
    result.eager_code = report.dynamo_gaps.eager_code
    result.items = [(index, kind, pass_name, what, (loc.file, loc.line, loc.code, loc.module), observed)
                    for index, graph in enumerate(report.graphs) for pass_result in graph.passes
                    for kind, pass_name, what, loc, observed in
                    [("fused", s.pass_name, s.form, s.location, None) for s in pass_result.sites]
                    + [("near", m.pass_name, m.reason, m.location, _seen(m, backend.observed))
                       for m in pass_result.near_misses]]
    if report.errors:
        result.note += f"pass errors: {report.errors}; "
    if result.error is not None and result.error > FLAG[mode]:
        result.note += f"{'logits/grads' if mode == 'training' else 'logits'} {result.error:.1e} from eager; "
    if mode == "training":  # the same step with NPU dispatch: does it run?
        torch._dynamo.reset()
        for p in model.parameters():
            p.grad = None
        try:
            _training_step(model, ids, CountingBackend(nff.FusionConfig()))
        except Exception as exc:  # noqa: BLE001 - the crash is what is recorded
            result.crash_with_dispatch = _first_line(exc)
    result.seconds = time.perf_counter() - start
    return result


def to_json(m: Measurement) -> dict:
    """A Measurement as plain data (the survey's per-model records)."""
    a = m.attribution
    record = {"spec": m.spec, "mode": m.mode, "error": m.error, "graphs": m.graphs, "reused": m.reused,
              "seconds": round(m.seconds, 1), "note": m.note, "crash_with_dispatch": m.crash_with_dispatch}
    if a is not None:
        record.update(_attributed(a), eager_code=[list(c) for c in m.eager_code],
                      census=[dataclasses.asdict(s) | {"span": list(s.span), "children": list(s.children),
                                                       "caller": list(s.caller)} for s in m.sites],
                      items=[list(i) for i in m.items], repeats={str(k): v for k, v in m.repeats.items()})
    return record


def reattribute(record: dict) -> dict:
    """`record` (to_json's) attributed again from its census and report items, as attribute()
    does now: the same numbers without compiling again."""
    from npu_fx_fusion.report import DynamoGaps, FusedSite, GraphReport, NearMiss, PassResult, SourceLocation

    sites = [Site(s["category"], s["module"], s["source"], s["count"], tuple(s["span"]), tuple(s.get("children", ())),
                  tuple(s.get("caller", ())))
             for s in record["census"]]
    graphs = {}
    for index, kind, pass_name, what, (file, line, code, module), *observed in record["items"]:
        graph = graphs.setdefault(index, GraphReport(name="inference", nodes_before=0))
        result = PassResult(pass_name)
        location = SourceLocation(file, line, code, module)
        (result.sites.append(FusedSite(pass_name, what, "", location)) if kind == "fused"
         else result.near_misses.append(NearMiss(pass_name, what, location, *observed[:1])))
        graph.passes.append(result)
    count = max(graphs, default=-1) + 1
    gaps = DynamoGaps((), (), tuple(tuple(c) for c in record.get("eager_code", ())))
    report = types.SimpleNamespace(graphs=[graphs.get(i, GraphReport(name="inference", nodes_before=0))
                                           for i in range(count)], dynamo_gaps=gaps)
    a = attribute(sites, report, {int(k): v for k, v in record["repeats"].items()}, record["mode"] == "training")
    return dict(record, **_attributed(a))


def _seen(miss: Any, observed: Optional[dict]) -> Optional[int]:
    """How often a near miss seen at run time was seen in the counted call (`observed`:
    CountingBackend.observed), else in all the runs so far; None for one found in the graph."""
    return (observed or {}).get((miss.pass_name, miss.reason, miss.location), miss.observed)


def _torch_nn(span: tuple) -> bool:
    return bool(span) and f"{os.sep}torch{os.sep}nn{os.sep}" in span[0]


def _attributed(a: Attribution) -> dict:
    """An Attribution as a record's plain data (to_json's and reattribute's)."""
    return dict(present=dict(a.present), fused=dict(a.fused), near=dict(a.near),
                silent=[dataclasses.asdict(s) | {"span": list(s.span)} for s in a.silent],
                eager=[dataclasses.asdict(s) | {"span": list(s.span), "why": why} for s, why in a.eager],
                near_reasons=[list(r) for r in a.near_reasons], extra=[list(e) for e in a.extra])


# fp32 static (DeepSeek-V4: bf16, static), before the engine is generalised: the survey's records
# (benchmarks/survey.py --third-party; docs/survey-third-party.md), {model: {category: (present,
# fused, near-missed, silent)}}. test_third_party_models asserts that no category fuses fewer or
# leaves more silent: raise the fused counts and lower the silent ones as the engine improves.
BEFORE: dict[str, dict[str, tuple[int, int, int, int]]] = {
    'torchtune:llama2_reward_7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:llama2_13b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:llama2_70b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:llama3_8b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:llama3_1_8b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:llama3_2_1b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:mistral_7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:mistral_reward_7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:gemma_2b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
    },
    'torchtune:gemma_7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
    },
    'torchtune:gemma2_2b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 0, 2), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
    },
    'torchtune:gemma2_27b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 0, 2), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
    },
    'torchtune:phi3_mini': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:phi4_14b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:qwen2_0_5b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'torchtune:qwen2_7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:stablelm-base-alpha-3b': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0)},
    'litgpt:stablelm-3b-4e1t': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0), 'swiglu': (2, 0, 2, 0)},
    'litgpt:falcon-7b': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0)},
    'litgpt:falcon-40b': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0)},
    'litgpt:Falcon3-1B-Base': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:open_llama_3b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Llama-3.1-8B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:OLMo-1B-hf': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0), 'swiglu': (2, 0, 2, 0)},
    'litgpt:OLMo-2-1124-7B': {
        'add_rms_norm': (1, 1, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Gemma-2b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
    },
    'litgpt:Gemma-7b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
    },
    'litgpt:Gemma-2-2b': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 0, 2), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 4, 0, 0),
    },
    'litgpt:Gemma-3-1b-it': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 1, 1, 0), 'rms_norm': (13, 13, 0, 0), 'rope': (4, 4, 0, 0),
    },
    'litgpt:Gemma-3-4b-it': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 1, 1, 0), 'rms_norm': (13, 13, 0, 0), 'rope': (4, 4, 0, 0),
    },
    'litgpt:phi-1_5': {'attention': (2, 2, 0, 0), 'rope': (4, 4, 0, 0)},
    'litgpt:Phi-3-mini-4k-instruct': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 2, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Phi-4-mini-instruct': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 2, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Mathstral-7B-v0.1': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 0, 2, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Mixtral-8x7B-v0.1': {
        'add_rms_norm': (4, 2, 0, 2), 'attention': (2, 2, 0, 0), 'moe_dispatch': (2, 0, 0, 2),
        'moe_experts': (6, 0, 0, 6), 'moe_router': (2, 0, 0, 2), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Qwen2.5-0.5B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Qwen3-0.6B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'litgpt:Qwen3-30B-A3B': {
        'add_rms_norm': (4, 2, 0, 2), 'attention': (2, 2, 0, 0), 'moe_dispatch': (2, 0, 0, 2),
        'moe_experts': (6, 0, 0, 6), 'moe_router': (2, 0, 0, 2), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:gemma3_12B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (13, 13, 0, 0), 'rope': (4, 0, 0, 4),
    },
    'olmo_core:llama2_13B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:llama2_70B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (5, 5, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:ngpt_1B': {'attention': (2, 2, 0, 0), 'rope': (4, 0, 0, 4), 'swiglu': (2, 0, 2, 0)},
    'olmo_core:olmo2_100M': {
        'add_rms_norm': (1, 1, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:olmo2_32B': {
        'add_rms_norm': (1, 1, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:olmo3_100M': {
        'add_rms_norm': (1, 1, 0, 0), 'attention': (3, 3, 0, 0), 'rms_norm': (13, 13, 0, 0), 'rope': (6, 0, 0, 6),
        'swiglu': (3, 0, 3, 0),
    },
    'olmo_core:olmo3_32B': {
        'add_rms_norm': (1, 1, 0, 0), 'attention': (3, 3, 0, 0), 'rms_norm': (13, 13, 0, 0), 'rope': (6, 0, 0, 6),
        'swiglu': (3, 0, 3, 0),
    },
    'olmo_core:qwen3_0_6B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    'olmo_core:qwen3_14B': {
        'add_rms_norm': (4, 4, 0, 0), 'attention': (2, 2, 0, 0), 'rms_norm': (9, 9, 0, 0), 'rope': (4, 0, 0, 4),
        'swiglu': (2, 0, 2, 0),
    },
    # torchtitan-npu's three: the fourth survey's (2026-12-05: the for-loop experts fuse, no site silent)
    'torchtitan_npu:deepseek_v3': {
        'add_rms_norm': (4, 2, 1, 0), 'attention': (2, 2, 0, 0), 'moe_dispatch': (1, 0, 1, 0),
        'moe_experts': (3, 3, 0, 0), 'moe_router': (1, 0, 1, 0), 'rms_norm': (9, 8, 0, 0), 'rope': (4, 4, 0, 0),
        'swiglu': (3, 2, 1, 0),
    },
    'torchtitan_npu:deepseek_v32': {
        'add_rms_norm': (4, 3, 0, 0), 'indexer': (2, 0, 2, 0), 'indexer_loss': (2, 0, 2, 0),
        'moe_dispatch': (1, 0, 1, 0), 'moe_experts': (3, 3, 0, 0), 'moe_router': (1, 0, 1, 0),
        'rms_norm': (9, 9, 0, 0), 'rope': (8, 6, 2, 0), 'sparse_attention': (2, 2, 0, 0), 'swiglu': (3, 2, 1, 0),
    },
    # (sparse_attention: (2, 0, 2, 0) until sparse_attention's given-mask forms took DSV32_SDPA's
    # materialised top-k mask, which the dense attention pass had fused as FIA)
    # (indexer_loss: one per layer with an indexer since the census stopped counting DSAIndexerLoss, the
    # KL divergence, beside LiLoss, whose target distribution is the site: it was (2, 0, 1, 1))
    'torchtitan_npu:deepseek_v4': {
        'indexer': (1, 0, 1, 0), 'indexer_loss': (1, 0, 1, 0), 'mhc': (12, 12, 0, 0), 'moe_dispatch': (3, 0, 3, 0),
        'moe_experts': (9, 9, 0, 0), 'moe_router': (3, 2, 1, 0), 'rms_norm': (19, 19, 0, 0), 'rope': (13, 9, 4, 0),
        'sparse_attention': (3, 3, 0, 0), 'swiglu': (6, 3, 3, 0),
    },
    # (sparse_attention: its SparseAttention's three layers fuse to sparse_flash_mla since sparse_mla's
    # torchtitan-npu forms, in fp32 and in the training step; with dynamic=True they are near misses)
    # (mhc: (12, 11, 1, 0) until mhc_post took a bf16 block output mixed into fp32 streams, o upcast)
}


# The sites each tiny model holds (census(), fp32; DeepSeek-V4 bf16, the dtype it runs in), by
# category: the denominators of the survey and of issue 28's "done when" (fused + near-missed
# == present, silent == 0). test_third_party_models checks the census against it.
PRESENT: dict[str, dict[str, int]] = {spec: {c: counts[0] for c, counts in categories.items()}
                                      for spec, categories in BEFORE.items()}
