"""softmax_l1_norm: the KL target of the DeepSeek-V3.2 indexer -> sparse_flash_mla_softmax_l1_norm.

In training, the lightning indexer learns where the main attention looks: its loss is
KL(p || softmax(indexer scores)), the target p the main attention's probabilities summed
over the G query heads that share a key head and divided by G (the paper's "summed over
the heads, L1-normalised"; op_semantics.md 10):

    scores = einsum(q, kv) * scale                 MLA absorbed: H heads, one latent key
    scores = scores.masked_fill(hidden, -inf)      none, right-down causal, compressed causal
    probs  = softmax(scores, -1, dtype=float32)    or  exp(scores.float() - lse[..., None])
    p      = probs.sum(heads) / H                  or  probs.mean(heads)

becomes, with the op's tiling metadata computed in the graph,

    metadata = cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata(H, 1, D, ...)
    p = cann_ops_transformer.sparse_flash_mla_softmax_l1_norm(q, kv[..., None, :], lse,
            metadata=metadata, softmax_scale=scale, mask_mode=0 | 3, cmp_ratio=r, ...)

The forms (Variant) are the product of
  layout  BSND: q (B, S1, H, D), kv (B, S2, D); TND: packed q (T1, H, D), kv (T2, D) with
          cu_seqlens_q / cu_seqlens_k (B + 1,);
  keys    dense, or sparse: kv gathered at `sparse_indices` (B, S1, K) / (T1, K), batch-local
          key positions, negative = no key (the gather reads some key there; the mask hides it);
  mask    BSND dense: none (mask_mode 0), a mask tensor proven right-down causal at compile
            time (mode 3: query i sees key j <= i + S2 - S1; constants.evaluate_constant, so
            any spelling built in the graph: triu, tril, aranges), or compressed keys
            (mode 3, cmp_ratio r > 1: compressed key j covers original tokens [j r, (j + 1) r)
            of Sk r + cmp_residual original ones, and is seen once complete:
            (j + 1) r <= orig - Sq + i + 1; spelled, cmp_residual a (B,) tensor);
          TND dense: each query's own sequence (mode 0), + right-down causal, + compressed keys,
            per sequence (spelled: positions from searchsorted over cu_seqlens);
          sparse: any slot mask that hides the negative indices (BSND, and TND when the mask
            does not read the sequence positions), or TND's spelled causal / compressed ones;
  probs   the softmax (the op needs its log-sum-exp: computed in the graph, in fp32, from the
          model's scores), or exp(s - lse) with the attention forward's lse given;
  heads   sum / H, or mean.

Exactness. The op takes no mask tensor: a dense mask must be one of its modes, proven.
Sparse forms do not use the op's own causal cut (it limits the NUMBER of slots, not the
indices): the replacement lists the slots the model's mask keeps first (stable), passes
their count as topk_length with mask_mode 0, and puts each result back in its slot, so any
index order and any -1 placement give the model's result. A row with no visible key is NaN
in the model's softmax (0 / 0) and 0 in the op: softmax replacements add lse - lse, NaN
exactly there. Dense TND: the kernel writes batch-local key positions in rows max_seqlen_k
wide (op_semantics 11.9, the extension's docs say (T1, N2, T2)); the replacement asks for
rows T2 wide and moves them to the packed positions the model's rows have.

Numerics: the op computes q.k in fp32 from the inputs and exp(s - lse) in fp32. fp32
models: fused and unfused differ by the order of the sums, a few fp32 ulps. Half models
round their scores to bf16/fp16 before the fp32 softmax (DeepSeek's einsum does); the op
does not, so the target moves by that rounding (relative |s| * 2^-8 in bf16), towards the
exact value; the site's note says so, and FusionConfig(verify=True) turns such sites down.

Hardware: Ascend 950 only (950PR/950DT), q/kv fp16/bf16, D = 512, H <= 128, one key head,
cmp_ratio <= 128 (capabilities.py). Without a SoC a site fuses and its note lists what the
hardware would refuse; with FusionConfig(soc=...) those limits are kept. Neither op has a
GE converter: max-autotune does not fuse (capabilities.not_lowerable).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.constants import causal_mask, evaluate_constant
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta, with_arguments

aten = torch.ops.aten
OP = "cann_ops_transformer.sparse_flash_mla_softmax_l1_norm"
L1_NORM = CAPABILITIES[OP]


@dataclass(frozen=True)
class Variant:
    """One unfused form: how the model spells each part of the target."""

    layout: str  # "bsnd" | "tnd"
    keys: str  # "dense" | "sparse"
    mask: str  # "none" | "given" (a mask tensor the check proves) | "causal" | "compressed"
    probs: str  # "softmax" | "exp_lse"
    heads: str  # "sum_div" | "mean"

    @property
    def name(self) -> str:
        return f"{self.probs}_head_{self.heads}[{self.layout},{self.keys},{self.mask}]"

    @property
    def argnames(self) -> list[str]:
        packed = self.layout == "tnd"
        names = ["q_packed", "kv_packed", "cu_seqlens_q", "cu_seqlens_k"] if packed else ["q", "kv"]
        if self.keys == "sparse":
            names.append("indices_packed" if packed else "sparse_indices")
        if self.keys == "sparse" and self.mask == "given":
            names.append("slot_mask_packed" if packed else "slot_mask")
        elif self.mask == "given":
            names.append("mask")
        if self.mask == "compressed":
            names.append("cmp_residual")
        if self.probs == "exp_lse":
            names.append("lse_packed" if packed else "lse")
        names.append("scale")
        if self.mask == "compressed":
            names.append("ratio")
        return names


# ---- the unfused forms, as model code writes them -------------------------------------
# Plain PyTorch pieces that a form (Variant) composes; `a` maps argument names to values.
def packed_positions(cu_seqlens, tokens):
    """For packed (TND) tokens: each token's sequence, and its position in it."""
    t = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens, t, right=True) - 1
    return seq, t - cu_seqlens[seq]


def _query_positions(a, q):
    """packed_positions of the queries, computed once per form (the model shares them
    between the key gather and the mask)."""
    if "_query_positions" not in a:
        a["_query_positions"] = packed_positions(a["cu_seqlens_q"], q.shape[0])
    return a["_query_positions"]


def _queries_keys(v, a):
    return (a["q_packed"], a["kv_packed"]) if v.layout == "tnd" else (a["q"], a["kv"])


def _indices(v, a):
    return a["indices_packed"] if v.layout == "tnd" else a["sparse_indices"]


def _slot_mask(v, a):
    return a["slot_mask_packed"] if v.layout == "tnd" else a["slot_mask"]


def _selected_keys(v, a):
    """The keys each query reads: kv itself (dense), or kv gathered at its indices (sparse:
    batch-local positions; a negative one reads some key the mask then hides)."""
    q, kv = _queries_keys(v, a)
    if v.keys == "dense":
        return kv
    idx = _indices(v, a)
    if v.layout == "bsnd":  # (B, S1, K, D)
        batch = torch.arange(q.shape[0], device=q.device).view(-1, 1, 1)
        return kv[batch, idx]
    seq_q, _ = _query_positions(a, q)
    return kv[a["cu_seqlens_k"][seq_q].view(-1, 1) + idx]  # (T1, K, D)


_EINSUM = {("bsnd", "dense"): "bshd,btd->bsht", ("bsnd", "sparse"): "bshd,bskd->bshk",
           ("tnd", "dense"): "thd,sd->ths", ("tnd", "sparse"): "thd,tkd->thk"}


def attention_scores(v, a, upcast=False):
    """scale * q.k: (B, S1, H, S2 or K) / (T1, H, T2 or K). MLA absorbed: one latent key."""
    q, _ = _queries_keys(v, a)
    k = _selected_keys(v, a)
    if upcast:
        q, k = q.float(), k.float()
    return torch.einsum(_EINSUM[v.layout, v.keys], q, k) * a["scale"]


def hidden_keys(v, a):
    """The spelled masks: True where a query may not see a key (slot), (B, S1, S2) /
    (T1, T2 or K)."""
    q, kv = _queries_keys(v, a)
    if v.layout == "bsnd":  # compressed: query i sits at original position orig - S1 + i
        s1, s2 = q.shape[1], kv.shape[1]
        orig = s2 * a["ratio"] + a["cmp_residual"]
        position = (orig - s1).view(-1, 1, 1) + torch.arange(s1, device=q.device).view(-1, 1)
        return (torch.arange(s2, device=q.device) + 1) * a["ratio"] > position + 1
    cu_q, cu_k = a["cu_seqlens_q"], a["cu_seqlens_k"]
    seq_q, pos_q = _query_positions(a, q)
    if v.mask == "causal":  # right-down: the last key a query sees
        last = pos_q + (cu_k[1:] - cu_k[:-1] - (cu_q[1:] - cu_q[:-1]))[seq_q]
    elif v.mask == "compressed":  # the query's position in its original sequence
        orig = (cu_k[1:] - cu_k[:-1]) * a["ratio"] + a["cmp_residual"]
        position = pos_q + (orig - (cu_q[1:] - cu_q[:-1]))[seq_q]
    if v.keys == "sparse":  # slots: the key each one lists, -1 for none
        idx = a["indices_packed"]
        key, hidden = idx, idx < 0
    else:  # keys: each query sees its own sequence's keys
        seq_k, key = packed_positions(cu_k, kv.shape[0])
        hidden = seq_q.view(-1, 1) != seq_k
    if v.mask == "causal":
        hidden = hidden | (key > last.view(-1, 1))
    elif v.mask == "compressed":
        hidden = hidden | ((key + 1) * a["ratio"] > position.view(-1, 1) + 1)
    return hidden


def masked_scores(v, a, upcast=False):
    scores = attention_scores(v, a, upcast)
    if v.mask == "given":
        return scores.masked_fill(_slot_mask(v, a) if v.keys == "sparse" else a["mask"], float("-inf"))
    if v.layout == "bsnd" and v.mask == "none":
        return scores
    hidden = hidden_keys(v, a)
    # the head dim, before the keys: (B, S1, 1, S2), (T1, 1, T2)
    return scores.masked_fill(hidden.unsqueeze(hidden.dim() - 1), float("-inf"))


def unfused(v, a):
    scores = masked_scores(v, a)
    if v.probs == "softmax":
        probs = scores.softmax(dim=-1, dtype=torch.float32)
    else:  # the log-sum-exp of the attention forward, (B, S1, H) / (T1, H)
        probs = torch.exp(scores.float() - a["lse_packed" if v.layout == "tnd" else "lse"].unsqueeze(-1))
    head = 2 if v.layout == "bsnd" else 1
    if v.heads == "mean":
        return probs.mean(dim=head)
    return probs.sum(dim=head) / probs.shape[head]


# ---- the fused call -------------------------------------------------------------------
def fused(v, a):
    cann = torch.ops.cann_ops_transformer
    q, kv = _queries_keys(v, a)
    bsnd = v.layout == "bsnd"
    heads, dim = q.shape[-2], q.shape[-1]
    if v.probs == "softmax":  # the log-sum-exp of the model's softmax rows, in fp32
        lse = torch.logsumexp(masked_scores(v, a, upcast=True), dim=-1)
    else:
        lse = a["lse" if bsnd else "lse_packed"].float()
    layout = "BSND" if bsnd else "TND"
    call = dict(layout_q=layout, layout_k=layout)
    if bsnd:
        metadata = dict(call, batch_size=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=kv.shape[1])
    else:
        call.update(cu_seqlens_q=a["cu_seqlens_q"].to(torch.int32), cu_seqlens_k=a["cu_seqlens_k"].to(torch.int32))
        metadata = dict(call)
    if v.keys == "sparse":
        # the model's slot mask, the kept slots listed first (in order) and counted: any
        # order and any -1 placement give the model's result, in mask_mode 0
        idx = _indices(v, a)
        if v.mask == "given":
            hidden = torch.broadcast_to(_slot_mask(v, a), (*idx.shape[:-1], 1, idx.shape[-1])).squeeze(-2)
        else:
            hidden = hidden_keys(v, a)
        order = torch.argsort(hidden.to(torch.int32), dim=-1, stable=True)
        listed = idx.masked_fill(hidden, -1).gather(-1, order).to(torch.int32)
        count = (~hidden).sum(dim=-1, dtype=torch.int32).unsqueeze(-1)
        call.update(sparse_indices=listed.unsqueeze(-2), topk_length=count, mask_mode=0)
        metadata.update(topk_length=count, topk=idx.shape[-1], mask_mode=0)
    else:
        call["mask_mode"] = metadata["mask_mode"] = 0 if v.mask == "none" else 3
        if v.mask == "compressed":
            residual = a["cmp_residual"].to(torch.int32)
            call.update(cmp_ratio=a["ratio"], cmp_residual_k=residual)
            metadata.update(cmp_ratio=a["ratio"], cmp_residual_k=residual)
        if not bsnd:  # rows as wide as all keys: no sequence is longer
            call["max_seqlen_k"] = metadata["max_seqlen_k"] = kv.shape[0]
    meta = cann.sparse_flash_mla_softmax_l1_norm_metadata(heads, 1, dim, **metadata)
    out = cann.sparse_flash_mla_softmax_l1_norm(
        q, kv.unsqueeze(-2), lse.unsqueeze(1) if bsnd else lse.unsqueeze(0), metadata=meta.to(q.device),
        softmax_scale=a["scale"], **call).squeeze(-2)
    if v.keys == "sparse":  # each result back in its slot
        out = torch.zeros_like(out).scatter(-1, order, out)
    elif not bsnd:  # batch-local key positions -> the packed ones the model's rows have
        seq_q, _ = _query_positions(a, q)
        local = torch.arange(kv.shape[0], device=q.device) - a["cu_seqlens_k"][seq_q].view(-1, 1)
        out = out.gather(-1, local.clamp(min=0)).masked_fill(local < 0, 0.0)
    if v.probs == "softmax":  # NaN where the model's softmax had a row without a key
        out = out + (lse - lse).sum(dim=-1, keepdim=True)
    return out


def _function(v, body, prefix=""):
    """body(v, {name: value}) as a function of the variant's named arguments."""
    fn = with_arguments(v.argnames, lambda given: body(v, given), prefix + v.name)
    fn.variant = v
    return fn


# Most specific first where two overlap: the spelled compressed mask is also "a mask".
# Packed (TND) masks are spelled: they read the sequence positions the key gather reads too.
LAYOUTS_KEYS_MASKS = [("bsnd", "dense", "compressed"), ("bsnd", "dense", "given"), ("bsnd", "dense", "none"),
                      ("bsnd", "sparse", "given"), ("tnd", "dense", "compressed"), ("tnd", "dense", "causal"),
                      ("tnd", "dense", "none"), ("tnd", "sparse", "compressed"), ("tnd", "sparse", "causal"),
                      ("tnd", "sparse", "given")]
VARIANTS = [Variant(layout, keys, mask, probs, heads)
            for probs in ("softmax", "exp_lse") for heads in ("sum_div", "mean")
            for layout, keys, mask in LAYOUTS_KEYS_MASKS]
FORMS = [Form(_function(v, unfused), _function(v, fused, "fused_")) for v in VARIANTS]


# ---- checks -----------------------------------------------------------------------------
def _dtype(t):
    """'bfloat16' for a tensor or a dtype."""
    return str(getattr(t, "dtype", t)).replace("torch.", "")


def _head_broadcast(mask, rows_shape, width):
    """Why `mask` is not one mask per query row, the same for all heads, or None."""
    wanted = (*rows_shape, 1, width)
    try:
        shape = torch.broadcast_shapes(tuple(mask.shape), wanted)
    except RuntimeError:
        shape = None
    if mask.dtype != torch.bool or shape != wanted:
        return (f"the mask is {_dtype(mask)}{list(mask.shape)}: {OP} needs one key mask per query row, "
                f"the same for every head ({list(wanted)})")
    return None


def _dense_mask_reason(site, q, kv):
    """None if the dense BSND mask is right-down causal (mask_mode 3), else why not."""
    s1, s2 = q.shape[1], kv.shape[1]
    reason = _head_broadcast(site["mask"], (q.shape[0], s1), s2)
    if reason:
        return reason
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # passes run inside the compile's fake mode
        value = evaluate_constant(site.arg_nodes["mask"])
        if value is None:
            return (f"the mask is computed from graph inputs (or symbolic sizes): it cannot be proven "
                    f"right-down causal at compile time, and {OP} takes no mask tensor")
        visible = ~torch.broadcast_to(value, (q.shape[0], s1, 1, s2)).squeeze(-2)
        if bool((visible == causal_mask(s1, s2)).all()):
            return None
        if bool((visible == torch.ones(s1, s2, dtype=torch.bool).tril()).all()):
            return (f"the mask is upper-left causal (query i sees keys j <= i) over {s1} queries and {s2} "
                    f"keys: {OP}'s mask_mode 3 is right-down causal (j <= i + {s2 - s1})")
        if bool(visible.all()):
            return "the mask hides no key: only the unmasked form fuses as mask_mode 0"
    return (f"the mask is neither right-down causal nor empty: {OP}'s mask_mode 0 / 3 cannot "
            "express it")


_NEGATIVE_TESTS = {aten.lt.Scalar: 0, aten.le.Scalar: -1}
_NONNEGATIVE_TESTS = {aten.ge.Scalar: 0, aten.gt.Scalar: -1}


def _reads(node, source):
    while node is not source and is_call(node, aten._to_copy.default, aten.view.default, aten.unsqueeze.default):
        node = node.args[0]
    return node is source


def hides_negative_indices(mask, idx):
    """The mask (an or of conditions) hides every slot whose index is negative."""
    while is_call(mask, aten.unsqueeze.default, aten.view.default, aten.expand.default):
        mask = mask.args[0]
    if is_call(mask, aten.bitwise_or.Tensor, aten.logical_or.default):
        return any(hides_negative_indices(arg, idx) for arg in mask.args[:2])
    if is_call(mask, aten.bitwise_not.default, aten.logical_not.default):
        test = mask.args[0]
        return (is_call(test, *_NONNEGATIVE_TESTS) and _reads(test.args[0], idx)
                and test.args[1] == _NONNEGATIVE_TESTS[test.target])
    return (is_call(mask, *_NEGATIVE_TESTS) and _reads(mask.args[0], idx)
            and mask.args[1] == _NEGATIVE_TESTS[mask.target])


def _slot_mask_reason(site, v):
    packed = v.layout == "tnd"
    idx_name, mask_name = ("indices_packed", "slot_mask_packed") if packed else ("sparse_indices", "slot_mask")
    idx = site[idx_name]
    reason = _head_broadcast(site[mask_name], tuple(idx.shape[:-1]), idx.shape[-1])
    if reason:
        return reason
    if idx.dtype not in (torch.int32, torch.int64):
        return f"the sparse indices are {_dtype(idx)}: the forms take int32 or int64 ones ({OP} takes int32)"
    if not hides_negative_indices(site.arg_nodes[mask_name], site.arg_nodes[idx_name]):
        return ("the mask does not hide the negative (no key, -1) indices: the model's gather reads "
                f"kv[-1] there, {OP} stops at the first negative index")
    return None


def _upcast_from(node):
    """The half dtype a node was upcast to fp32 from, or None."""
    if is_call(node, aten._to_copy.default, torch.ops.npu._npu_dtype_cast.default):
        source = tensor_meta(node.args[0])
        if source is not None and source.dtype in (torch.float16, torch.bfloat16):
            return source.dtype
    return None


def _hardware_reasons(site, q, ratio):
    limits = L1_NORM.limits
    dtype = unsupported(OP, site.soc, x=q)
    upcast = _upcast_from(site.arg_nodes["q_packed" if "q_packed" in site.arg_nodes else "q"])
    if dtype and upcast is not None:
        dtype += (f" (the model upcasts {_dtype(upcast)} q and kv before the product; "
                  "no form passes the half tensors)")
    return [
        "the op runs on Ascend950 (950PR/950DT) only" if site.soc is None else None,
        dtype,
        f"head dim {q.shape[-1]}, the kernel takes {limits['head_dim']}" if q.shape[-1] != limits["head_dim"] else None,
        f"{q.shape[-2]} query heads, the kernel takes at most {limits['max_query_heads']}"
        if q.shape[-2] > limits["max_query_heads"] else None,
        f"cmp_ratio {ratio}, the kernel takes at most {limits['max_cmp_ratio']}"
        if ratio > limits["max_cmp_ratio"] else None,
    ]


# The metadata op takes the batch size and sequence lengths as int attributes: a symbolic
# size passed there is specialised (a guard, a recompile at every other size), so a site with
# symbolic sizes is not fused (with dynamic shapes the forms match: accept._exact_match).
SYMBOLIC_SIZES = ("the attention has symbolic sizes (dynamic shapes): the metadata op takes the batch size "
                  "and sequence lengths as int attributes, which would pin them to this compile's values")


def check(site):
    v = site.form.search.variant
    q, kv = (site["q_packed"], site["kv_packed"]) if v.layout == "tnd" else (site["q"], site["kv"])
    if any(isinstance(size, torch.SymInt) for t in (q, kv) for size in t.shape):
        return SYMBOLIC_SIZES
    if q.dtype != kv.dtype:
        return f"q is {_dtype(q)}, kv {_dtype(kv)}: {OP} takes them in one dtype"
    ratio = site.args.get("ratio", 1)
    if v.mask == "compressed" and ratio <= 1:
        return (f"a compressed-key mask with ratio {ratio}: {OP} ignores cmp_residual_k unless "
                "cmp_ratio > 1")
    if v.mask == "given":
        reason = _slot_mask_reason(site, v) if v.keys == "sparse" else _dense_mask_reason(site, q, kv)
        if reason:
            return reason
    reason = site.hardware_limits(_hardware_reasons(site, q, ratio))
    if reason:
        return reason
    if q.dtype != torch.float32:
        site.notes.append(f"the model rounds its scores to {_dtype(q)} before the fp32 "
                          f"{'softmax' if v.probs == 'softmax' else 'exp'}; the op keeps them in fp32, "
                          "so the target moves by that rounding, towards the exact value")
    if v.layout == "tnd" and v.keys == "dense":
        site.notes.append("dense TND: the kernel's rows hold batch-local key positions, max_seqlen_k "
                          "wide (op_semantics 11.9); they are moved back to the packed positions")
    return None


# ---- near misses: a head sum (or mean) of attention probabilities no form consumed -----
_PASS_ON = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default,
            aten.clone.default)


def _probabilities(node):
    """The softmax or exp a tensor comes from (through views and casts), or None."""
    for _ in range(4):
        if is_call(node, aten._softmax.default, aten.exp.default):
            return node
        if not is_call(node, *_PASS_ON):
            return None
        node = node.args[0]
    return None


def anchor(node):
    """A sum or mean of probabilities over one dim other than the keys (the last): the
    forms' (.., H, keys) heads, or eager attention's (B, H, S1, S2) ones, which explain()
    names."""
    if not is_call(node, aten.sum.dim_IntList, aten.mean.dim) or len(node.args) < 2:
        return False
    source = tensor_meta(node.args[0])
    dims = node.args[1]
    return (source is not None and source.dim() >= 3 and isinstance(dims, (list, tuple)) and len(dims) == 1
            and dims[0] % source.dim() != source.dim() - 1 and _probabilities(node.args[0]) is not None)


def _mask_of(probs):
    """(mask node, how it is applied) of the scores a softmax / exp reads, or (None, None)."""
    node = probs.args[0]
    for _ in range(4):
        if is_call(node, aten.masked_fill.Scalar):
            return node.args[1], "masked_fill"
        if is_call(node, aten.add.Tensor) and isinstance(node.args[1], torch.fx.Node):
            return node.args[1], "add"
        if is_call(node, aten.where.self):
            return node.args[0], "where"
        if not is_call(node, aten._to_copy.default, aten.sub.Tensor):
            break
        node = node.args[0]
    return None, None


def explain(head_sum):
    probs = _probabilities(head_sum.args[0])
    values = tensor_meta(probs)
    if values is not None and any(isinstance(size, torch.SymInt) for size in values.shape):
        return SYMBOLIC_SIZES
    if is_call(probs, aten._softmax.default) and values is not None:
        dim = probs.args[1] % values.dim()
        if dim != values.dim() - 1:
            return (f"the softmax is over dim {dim} of a {values.dim()}-d tensor, not over the keys (the "
                    f"last dim): {OP} normalises each query's row of keys")
    summed = tensor_meta(head_sum.args[0])
    dim = head_sum.args[1][0] % summed.dim()
    if dim != summed.dim() - 2:
        undivided = (is_call(head_sum, aten.sum.dim_IntList)
                     and not any(is_call(u, aten.div.Tensor, aten.mul.Tensor) for u in head_sum.users))
        return (f"the sum is over dim {dim} of the {summed.dim()}-d probabilities {list(summed.shape)}, "
                f"not the one next to the keys: the heads of eager attention's (B, H, S1, S2) layout? {OP} "
                "takes q as BSND / TND, (.., S1, H, D) with scores (.., H, S2); scores computed from q "
                "transposed to (B, S1, H, D) fuse"
                + (f"; and the sum is not divided by the {summed.shape[dim]} heads, where {OP} returns their mean"
                   if undivided else ""))
    heads = summed.shape[-2]
    chain = [head_sum.args[0]]
    while chain[-1] is not probs:
        chain.append(chain[-1].args[0])
    shared = [u for node in chain for u in node.users if u is not head_sum and u not in chain]
    if any(u.op == "output" or is_call(u, aten.detach.default) for u in shared):
        return (f"the probabilities are saved for the backward (the target requires grad), and {OP} has "
                "no backward: the indexer's KL target is a constant of its loss, computed from detached "
                "q and kv")
    if shared:
        return (f"the probabilities ({probs.name}) are also used by {shared[0].name} ({shared[0].target}): "
                f"{OP} returns only their head mean")
    if is_call(head_sum, aten.sum.dim_IntList):
        divisions = [u for u in head_sum.users if is_call(u, aten.div.Tensor) and u.args[0] is head_sum]
        if any(isinstance(u.args[1], torch.fx.Node) for u in divisions):
            return (f"the sum over the heads is normalised by a tensor (its own sum?), not divided by the "
                    f"{heads} heads: the forms take sum / G and mean (for exp(s - lse) an L1 normalisation "
                    "is / G only if lse is the log-sum-exp of these very keys)")
        if not divisions:
            return (f"the sum over the {heads} heads is not divided by their number: {OP} returns the "
                    "mean over the G heads that share a key head")
        if divisions[0].args[1] != heads:
            return (f"the sum over the {heads} heads is divided by {divisions[0].args[1]}, not by their "
                    f"number: {OP} returns the mean over the G heads")
    mask, applied = _mask_of(probs)
    if applied in ("add", "where"):
        return (f"the mask is applied with {applied} ({mask.name}): the forms take masked_fill(mask, -inf)")
    if mask is not None and tensor_meta(head_sum.args[0]).dim() == 3:
        return ("the packed (TND) mask is none of the spelled ones (each query's own sequence, "
                "+ right-down causal, + compressed keys), or the sparse keys are not gathered as "
                "kv[cu_seqlens_k[seq] + indices]")
    return None


# ---- verification inputs: offsets, indices and masks that mean something ---------------
def verify_input(name, args):
    generator = torch.Generator().manual_seed(0)
    if name in ("cu_seqlens_q", "cu_seqlens_k"):
        tokens = (args["q_packed"] if name == "cu_seqlens_q" else args["kv_packed"]).shape[0]
        batches = args[name].shape[0] - 1
        return torch.tensor([0, *(tokens * (b + 1) // batches for b in range(batches))], dtype=args[name].dtype)
    if name in ("sparse_indices", "indices_packed", "slot_mask", "slot_mask_packed"):
        packed = name.endswith("packed")
        idx = args["indices_packed" if packed else "sparse_indices"]
        keys = (args["kv_packed"].shape[0] // (args["cu_seqlens_k"].shape[0] - 1) if packed
                else args["kv"].shape[1])
        values = torch.randint(-1, keys, tuple(idx.shape), generator=generator).to(idx.dtype)
        if name in ("sparse_indices", "indices_packed"):
            return values
        hidden = (values < 0) | (torch.rand(tuple(idx.shape), generator=generator) < 0.25)
        return hidden.unsqueeze(-2) if tuple(args[name].shape) == (*idx.shape[:-1], 1, idx.shape[-1]) else None
    if name == "cmp_residual":
        return torch.zeros(tuple(args[name].shape), dtype=args[name].dtype)
    if name in ("lse", "lse_packed"):
        # what an attention forward hands over for random normal q and kv: about
        # log(keys) + D scale^2 / 2, so that exp(s - lse) are probabilities, not e^6
        packed = name == "lse_packed"
        q = args["q_packed" if packed else "q"]
        if "indices_packed" in args or "sparse_indices" in args:
            keys = args["indices_packed" if packed else "sparse_indices"].shape[-1]
        else:
            keys = args["kv_packed"].shape[0] // (args["cu_seqlens_k"].shape[0] - 1) if packed else args["kv"].shape[1]
        value = math.log(max(int(keys), 1)) + 0.5 * int(q.shape[-1]) * args["scale"] ** 2
        return torch.full(tuple(args[name].shape), value, dtype=torch.float32)
    return None


def has_head_sum(graph):
    """Registering this pass's forms costs seconds (many large forms): a graph without a
    head sum of attention probabilities (no anchor) cannot match any of them."""
    return any(anchor(node) for target in (aten.sum.dim_IntList, aten.mean.dim)
               for node in graph.find_nodes(op="call_function", target=target))


PASS = FusionPass(
    name="softmax_l1_norm",
    fused_op=OP,
    forms=FORMS,
    # Scalars are marked by their example values: 2**-5 and 11 occur nowhere else in the
    # traces (sizes B 2, S1 3, H 4, S2 5, K 6, D 8; T1 9, T2 13).
    example={
        "q": lambda dtype: torch.empty(2, 3, 4, 8, dtype=dtype),
        "kv": lambda dtype: torch.empty(2, 5, 8, dtype=dtype),
        "mask": lambda dtype: torch.empty(3, 1, 5, dtype=torch.bool),
        "sparse_indices": lambda dtype: torch.zeros(2, 3, 6, dtype=torch.int32),
        "slot_mask": lambda dtype: torch.empty(2, 3, 1, 6, dtype=torch.bool),
        "lse": lambda dtype: torch.empty(2, 3, 4, dtype=torch.float32),
        "cmp_residual": lambda dtype: torch.zeros(2, dtype=torch.int32),
        "q_packed": lambda dtype: torch.empty(9, 4, 8, dtype=dtype),
        "kv_packed": lambda dtype: torch.empty(13, 8, dtype=dtype),
        "cu_seqlens_q": lambda dtype: torch.zeros(3, dtype=torch.int32),
        "cu_seqlens_k": lambda dtype: torch.zeros(3, dtype=torch.int32),
        "indices_packed": lambda dtype: torch.zeros(9, 6, dtype=torch.int32),
        "slot_mask_packed": lambda dtype: torch.empty(9, 1, 6, dtype=torch.bool),
        "lse_packed": lambda dtype: torch.empty(9, 4, dtype=torch.float32),
        "scale": 2.0**-5,
        "ratio": 11,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.sum.dim_IntList, aten.mean.dim),
    explain=explain,
    verify_input=verify_input,
    prefilter=has_head_sum,
)
