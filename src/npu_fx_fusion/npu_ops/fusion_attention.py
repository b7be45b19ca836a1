"""Dense FlashAttention: npu_fusion_attention_v3 / npu_fusion_attention and their grads.

These are the ops torch_npu's own `scaled_dot_product_attention` kernel calls
(ScaledDotProductAttentionKernelNpuOpApi.cpp: `_v3` below Ascend950, the plain one on
Ascend950), so they are what an NPU aot graph holds for SDPA (npu_dispatch.py). Schemas:
the wheel's yaml (in each op_spec). Semantics: the wheel's docstring of npu_fusion_attention_v3
(`_op_plugin_docs.py` ~L1895), op_semantics.md 9.1, output shapes and dtypes from op-plugin's
FlashAttentionKernelNpuOpApi.cpp (infer_fa_v3_output_tensors, npu_fusion_attention_v3_symint)
and the wheel's Meta (`npu_fusion_attention_forward`), autograd from op-plugin's
derivatives.yaml.

    attention_out = Dropout(Softmax(Mask(scale * (pse + query @ key^T), atten_mask)), keep_prob) @ value

Conventions, in one place:
* `atten_mask`: bool or uint8, **True / 1 = masked out** (not computed), the opposite of
  PyTorch SDPA's bool mask. Shapes SS, B1SS, BNSS, 11SS.
* sparse_mode 0: the given mask (or none), intersected with the band pre_tockens /
  next_tockens around the diagonal (top-left origin: key j of query i is computed when
  i - pre <= j <= i + next; the defaults 2147483647 compute everything); 1: the full mask,
  pre / next ignored; 2: left-up causal (j <= i), 3: right-down causal (j <= i + Skv - Sq);
  2 and 3 take the compressed 2048x2048 upper-triangular mask `triu(ones, 1)`, which the
  stand-in checks and does not read further. No atten_mask: nothing is masked, whatever
  sparse_mode / pre / next say (docs). Modes 4-8 (band, prefix, varlen) are not stood in.
* Heads: Nq query heads share Nkv key heads in consecutive groups of Nq / Nkv (GQA).
* Layouts BNSD, BSND, BSH, SBH (TND, varlen, is not stood in).
* Outputs: attention_out in the query's layout with value's head dim; softmax_max and
  softmax_sum fp32 (B, N, Sq, 8), the row max of the masked scaled scores and the sum of
  exp(score - max), each replicated 8 times; softmax_out an empty (0,) "reserved" tensor;
  v3's seed / offset int64 (1,) CPU tensors, the plain op's seed / offset / numels ints.
* A row with every key masked gives 0 (the kernel's "invalid row" correction, which the
  SDPA kernel turns on with inner_precise=2 whenever it passes a mask), softmax_max -inf
  and softmax_sum 0 [inferred: the kernel's values for such rows are not documented].
* Precision: fp32 accumulation (float64 stays float64, for reference tests), the output
  rounded once to the query's dtype.
* Dropout (keep_prob < 1) is refused: the NPU's Philox mask cannot be reproduced.
"""
from __future__ import annotations

from typing import Optional

import torch

from .spec import FLOAT_DTYPES, OpCapability, Sample, SocLimits, op_spec, randn

TOKEN_MAX = 2147483647  # pre_tockens / next_tockens default: no band
COMPRESSED_MASK = 2048  # sparse_mode 2 / 3 take triu(ones(2048, 2048), 1)
_STATS = 8  # softmax_max / softmax_sum replicate each row's value 8 times
LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
# The hardware limits all four ops share: the wheel's npu_fusion_attention_v3 docstring
# (_op_plugin_docs.py ~L1895) and op_semantics 9.1. SoC gates from op-plugin's kernels
# (npu_fusion_attention_v3_symint refuses Ascend950, whose SDPA calls npu_fusion_attention
# instead; below Ascend910B1 SDPA takes its math path).
_FA_LIMITS = {
    "max_head_dim": 768,  # Dq = Dk >= Dv, 1..768
    "max_query_heads": 256,  # Nq 1..256, Nq % Nkv == 0
    "layouts": ("BSH", "SBH", "BSND", "BNSD", "TND"),  # TND is not stood in on CPU
    "sparse_modes": tuple(range(9)),  # 0-3 stood in on CPU
    "atten_mask": "bool / uint8, True = masked out; SS, B1SS, BNSS, 11SS; sparse_mode 2 / 3: triu(ones(2048, 2048), 1)",
}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---- layouts -------------------------------------------------------------------------------
def _check_layout(op: str, layout: str, query, key, value) -> None:
    if layout == "TND":
        raise NotImplementedError(f"{op}: input_layout TND (varlen, actual_seq_qlen / actual_seq_kvlen) is not "
                                  "stood in on CPU")
    if layout not in LAYOUTS:
        raise RuntimeError(f"{op}: input_layout must be one of BSH/SBH/BNSD/BSND/TND, got {layout!r}")
    rank = 3 if layout in ("BSH", "SBH") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise RuntimeError(f"{op}: with input_layout {layout} {name} must be {rank}-D, got {tuple(t.shape)}")


def _head_dim(layout: str, query, head_num: int) -> int:
    if layout in ("BSH", "SBH"):
        if query.shape[-1] % head_num:
            raise RuntimeError(f"hidden size {query.shape[-1]} is not a multiple of head_num {head_num}")
        return query.shape[-1] // head_num
    return query.shape[-1]


def _to_bnsd(t: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """(B, N, S, D) view of a tensor in `layout`; for BSH / SBH N = H / head_dim (the key's
    and value's head count follows from their hidden size)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, h // head_dim, head_dim).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.reshape(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t.contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _value_head_dim(layout: str, query, key, value, head_num: int) -> int:
    """Dv: value's head dim (BSH / SBH: value's hidden size over key's head count)."""
    if layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        kv_heads = key.shape[-1] // d
        return value.shape[-1] // kv_heads
    return value.shape[-1]


def _out_shape(layout: str, query, key, value, head_num: int) -> tuple:
    dv = _value_head_dim(layout, query, key, value, head_num)
    if layout in ("BSH", "SBH"):  # (B, S, N * Dv) / (S, B, N * Dv)
        return (query.shape[0], query.shape[1], head_num * dv)
    return tuple(query.shape[:-1]) + (dv,)


def _batch_and_queries(layout: str, query) -> tuple[int, int]:
    if layout == "BNSD":
        return query.shape[0], query.shape[2]
    if layout in ("BSND", "BSH"):
        return query.shape[0], query.shape[1]
    return query.shape[1], query.shape[0]  # SBH


# ---- argument checks -----------------------------------------------------------------------
def _check(op: str, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
           prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink) -> int:
    """The checks op-plugin's kernel makes, and what the stand-in does not cover; returns D."""
    if head_num <= 0:
        raise RuntimeError(f"{op}: head_num must > 0, but got {head_num}")
    _check_layout(op, input_layout, query, key, value)
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (
            torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise RuntimeError(f"{op}: query, key and value must be one of fp16/bf16/fp32, got "
                           f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"{op}: The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    if keep_prob != 1:
        raise NotImplementedError(f"{op}: keep_prob {keep_prob} < 1 draws the NPU's Philox dropout mask, which a "
                                  "CPU stand-in cannot reproduce")
    if padding_mask is not None:
        raise RuntimeError(f"{op}: padding_mask is not supported (torch_npu docs)")
    if prefix is not None or actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NotImplementedError(f"{op}: prefix / actual_seq_qlen / actual_seq_kvlen (prefix and varlen "
                                  "modes) are not stood in")
    if softmax_layout not in ("", None):
        raise RuntimeError(f"{op}: softmax_layout={softmax_layout!r} needs input_layout TND")
    if sink is not None:
        raise NotImplementedError(f"{op}: sink is not stood in (its semantics are not documented for this op)")
    if sparse_mode not in (0, 1, 2, 3):
        raise NotImplementedError(f"{op}: sparse_mode {sparse_mode} (band / prefix / varlen) is not stood in; "
                                  "0-3 are")
    d = _head_dim(input_layout, query, head_num)
    dk = key.shape[-1] if input_layout not in ("BSH", "SBH") else d
    if input_layout not in ("BSH", "SBH") and (query.shape[-1] != key.shape[-1] or key.shape[-1] < value.shape[-1]):
        raise RuntimeError(f"{op}: head dims must satisfy Dq = Dk >= Dv, got {query.shape[-1]}, {key.shape[-1]}, "
                           f"{value.shape[-1]}")
    heads_kv = _to_bnsd(key, input_layout, dk).shape[1]
    if heads_kv <= 0 or head_num % heads_kv:
        raise RuntimeError(f"{op}: Nq / Nkv must be a non-zero integer, got {head_num} query heads over "
                           f"{heads_kv} key heads")
    q_heads = _to_bnsd(query, input_layout, d).shape[1]
    if q_heads != head_num:
        raise RuntimeError(f"{op}: head_num {head_num} but query has {q_heads} heads")
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{op}: atten_mask must be bool or uint8 (True / 1 = masked out), got "
                               f"{atten_mask.dtype}")
        if atten_mask.dim() not in (2, 4):
            raise RuntimeError(f"{op}: atten_mask must be SS, B1SS, BNSS or 11SS, got {tuple(atten_mask.shape)}")
    if pse is not None and pse.dtype != query.dtype:
        raise RuntimeError(f"{op}: pse must have the query's dtype {query.dtype}, got {pse.dtype}")
    return d


def _hidden(op: str, atten_mask, sparse_mode: int, pre_tockens: int, next_tockens: int,
            batch: int, heads: int, queries: int, keys: int) -> Optional[torch.Tensor]:
    """Which scores are masked out: bool, broadcastable to (B, N, Sq, Skv); None: none."""
    if atten_mask is None:
        return None  # "不传mask ... 忽略pre_tockens和next_tockens取值": full computation
    i = torch.arange(queries).view(-1, 1)
    j = torch.arange(keys).view(1, -1)
    if sparse_mode in (2, 3):
        compressed = torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool).triu(1)
        if tuple(atten_mask.shape) != (COMPRESSED_MASK, COMPRESSED_MASK) or not torch.equal(
                atten_mask.bool(), compressed):
            raise RuntimeError(f"{op}: sparse_mode {sparse_mode} takes the compressed mask "
                               f"triu(ones({COMPRESSED_MASK}, {COMPRESSED_MASK}), 1), got {tuple(atten_mask.shape)}")
        offset = 0 if sparse_mode == 2 else keys - queries
        return j > i + offset
    mask = atten_mask.bool()
    if mask.dim() == 2:
        if tuple(mask.shape) != (queries, keys):
            raise RuntimeError(f"{op}: an SS atten_mask must be ({queries}, {keys}), got {tuple(mask.shape)}")
    elif mask.shape[-2:] != (queries, keys) or mask.shape[0] not in (1, batch) or mask.shape[1] not in (1, heads) \
            or (mask.shape[0] == 1 and mask.shape[1] != 1 and batch != 1):
        raise RuntimeError(f"{op}: atten_mask must be SS, B1SS, BNSS or 11SS for B={batch}, N={heads}, "
                           f"Sq={queries}, Skv={keys}; got {tuple(mask.shape)}")
    if sparse_mode == 0 and (pre_tockens != TOKEN_MAX or next_tockens != TOKEN_MAX):
        mask = mask | (j > i + next_tockens) | (j < i - pre_tockens)
    return mask


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Nkv, S, D) -> (B, N, S, D): query head h reads key head h // (N / Nkv)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores(q, k, pse, scale, hidden):
    scores = q @ k.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse
    scores = scores * scale
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _forward(op, query, key, value, head_num, input_layout, pse, atten_mask, scale, pre_tockens, next_tockens,
             sparse_mode):
    """(attention_out, softmax_max, softmax_sum) computed in fp32 (fp64 stays fp64)."""
    acc = _compute_dtype(query)
    d = _head_dim(input_layout, query, head_num)
    q = _to_bnsd(query, input_layout, d).to(acc)
    k = _expand_heads(_to_bnsd(key, input_layout, d).to(acc), head_num)
    dv = _value_head_dim(input_layout, query, key, value, head_num)
    v = _expand_heads(_to_bnsd(value, input_layout, dv).to(acc), head_num)
    batch, heads, queries, _ = q.shape
    hidden = _hidden(op, atten_mask, sparse_mode, pre_tockens, next_tockens, batch, heads, queries, k.shape[2])
    scores = _scores(q, k, None if pse is None else pse.to(acc), scale, hidden)
    row_max = scores.amax(-1, keepdim=True)
    visible = row_max > float("-inf")  # a row with a computed key
    exp = torch.exp(scores - torch.where(visible, row_max, torch.zeros((), dtype=acc)))
    total = exp.sum(-1, keepdim=True)
    out = (exp @ v) / torch.where(visible, total, torch.ones((), dtype=acc))
    out = torch.where(visible, out, torch.zeros((), dtype=acc))
    stats = (batch, heads, queries, _STATS)
    softmax_max = row_max.float().expand(stats).contiguous()
    softmax_sum = torch.where(visible, total, torch.zeros((), dtype=acc)).float().expand(stats).contiguous()
    return _from_bnsd(out.to(query.dtype), input_layout), softmax_max, softmax_sum


def _backward(op, query, key, value, dy, head_num, input_layout, pse, atten_mask, softmax_max, softmax_sum,
              attention_in, scale, pre_tockens, next_tockens, sparse_mode):
    """(dq, dk, dv, dpse) of the forward, from its softmax_max / softmax_sum and output (the
    kernel recomputes the probabilities from them, it does not redo the max and sum):
        S = scale * (Q K^T + pse), masked     P = exp(S - softmax_max) / softmax_sum
        dV = P^T dO       dP = dO V^T        D = rowsum(dO * O)       dS = P * (dP - D)
        dQ = scale * dS K     dK = scale * dS^T Q     dpse = scale * dS (summed to pse's shape)
    with dK, dV summed over the query heads of each key head (GQA). fp32 accumulation, each
    gradient rounded once to its input's dtype."""
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise RuntimeError(f"{op}: softmax_max, softmax_sum and attention_in (the forward's outputs 1, 2 and 0) "
                           "are required")
    acc = _compute_dtype(query)
    d = _head_dim(input_layout, query, head_num)
    dv_dim = _value_head_dim(input_layout, query, key, value, head_num)
    q = _to_bnsd(query, input_layout, d).to(acc)
    k_heads = _to_bnsd(key, input_layout, d)
    groups = head_num // k_heads.shape[1]
    k = _expand_heads(k_heads.to(acc), head_num)
    v = _expand_heads(_to_bnsd(value, input_layout, dv_dim).to(acc), head_num)
    do = _to_bnsd(dy, input_layout, dv_dim).to(acc)
    o = _to_bnsd(attention_in, input_layout, dv_dim).to(acc)
    batch, heads, queries, _ = q.shape
    stats = (batch, heads, queries, _STATS)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if tuple(t.shape) != stats:
            raise RuntimeError(f"{op}: {name} must be the forward's fp32 {stats}, got {t.dtype} {tuple(t.shape)}")
    hidden = _hidden(op, atten_mask, sparse_mode, pre_tockens, next_tockens, batch, heads, queries, k.shape[2])
    scores = _scores(q, k, None if pse is None else pse.to(acc), scale, hidden)
    row_max = softmax_max[..., :1].to(acc)
    total = softmax_sum[..., :1].to(acc)
    visible = total > 0
    probs = torch.exp(scores - torch.where(visible, row_max, torch.zeros((), dtype=acc)))
    probs = torch.where(visible, probs / torch.where(visible, total, torch.ones((), dtype=acc)),
                        torch.zeros((), dtype=acc))
    grad_v = probs.transpose(-1, -2) @ do
    delta = (do * o).sum(-1, keepdim=True)
    grad_scores = probs * (do @ v.transpose(-1, -2) - delta)
    grad_q = scale * (grad_scores @ k)
    grad_k = scale * (grad_scores.transpose(-1, -2) @ q)

    def per_key_head(t):  # (B, N, S, D) -> (B, Nkv, S, D): sum each group's query heads
        b, n, s, e = t.shape
        return t.view(b, n // groups, groups, s, e).sum(2)

    grads = (_from_bnsd(grad_q.to(query.dtype), input_layout),
             _from_bnsd(per_key_head(grad_k).to(key.dtype), input_layout),
             _from_bnsd(per_key_head(grad_v).to(value.dtype), input_layout))
    if pse is None:
        return (*grads, query.new_empty((0,)))
    grad_pse = (scale * grad_scores).sum_to_size(pse.shape).to(pse.dtype)
    return (*grads, grad_pse)


# ---- opcheck samples ------------------------------------------------------------------------
def qkv(dtype=torch.float64, *, batch=2, heads=4, kv_heads=2, queries=5, keys=7, dim=8, dim_v=None, seed=0):
    """BNSD query (B, N, Sq, D), key (B, Nkv, Skv, D), value (B, Nkv, Skv, Dv) of seeded values."""
    return (randn(batch, heads, queries, dim, dtype=dtype, seed=seed),
            randn(batch, kv_heads, keys, dim, dtype=dtype, seed=seed + 1),
            randn(batch, kv_heads, keys, dim_v or dim, dtype=dtype, seed=seed + 2))


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A BNSD tensor in `layout` (BNSD, BSND, BSH or SBH)."""
    if layout == "BNSD":
        return t
    b, n, s, d = t.shape
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _forward_calls(dtype):
    """(args, kwargs) of forward calls: every layout with GQA and a value head dim of its own, a
    B1SS mask, the right-down causal mode SDPA emits for is_causal, a pse"""
    for layout in LAYOUTS:
        yield tuple(to_layout(t, layout) for t in qkv(dtype, dim_v=6)) + (4, layout), {"scale": 0.3}
    q, k, v = qkv(dtype)
    visible_one = ~torch.eye(5, 7, dtype=torch.bool)  # every row keeps a key
    mask = (torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(7)) > 0.6) & visible_one
    yield (q, k, v, 4, "BNSD"), {"atten_mask": mask, "scale": 0.3, "inner_precise": 2}
    causal = torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool).triu(1)
    yield (q, k, v, 4, "BNSD"), {"atten_mask": causal, "sparse_mode": 3, "scale": 0.4}
    yield (q, k, v, 4, "BNSD"), {"pse": randn(1, 4, 5, 7, dtype=dtype, seed=9), "scale": 0.5}


def _forward_samples(dtype):
    for args, kwargs in _forward_calls(dtype):
        # the differentiable inputs require grad: opcheck then traces the grad op too
        yield Sample(args, kwargs, grad_args=(0, 1, 2, "pse"))


def _grad_samples(forward, names):
    """Samples of a grad op, each from a forward call's own outputs (`names`: the forward's
    outputs the grad reads, by their grad-op keyword)."""
    def samples(dtype):
        for args, kwargs in _forward_calls(dtype):
            outputs = dict(zip(names, forward(*args, **kwargs)))
            dy = randn(*outputs["attention_in"].shape, dtype=dtype, seed=11)
            kwargs = {"scale_value" if k == "scale" else k: v for k, v in kwargs.items()}
            yield Sample((*args[:3], dy, *args[3:]), {**kwargs, **outputs})
    return samples


# =====================================================================================
# npu_fusion_attention_v3 (op-plugin npu_fusion_attention_v3_symint; below Ascend950 only)
# =====================================================================================
_V3 = "npu_fusion_attention_v3"
_V3_GRAD = "npu_fusion_attention_grad_v3"


def _v3_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
             keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX, inner_precise=0, prefix=None,
             actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
             softmax_layout="", sink=None):
    # infer_fa_v3_output_tensors + the kernel's softmax_out / seed / offset
    _check(_V3, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    batch, queries = _batch_and_queries(input_layout, query)
    stats = (batch, head_num, queries, _STATS)
    return (query.new_empty(_out_shape(input_layout, query, key, value, head_num)),
            query.new_empty(stats, dtype=torch.float32), query.new_empty(stats, dtype=torch.float32),
            query.new_empty((0,)), torch.empty((1,), dtype=torch.int64, device="cpu"),
            torch.empty((1,), dtype=torch.int64, device="cpu"))


_V3_SAVED = ("head_num", "input_layout", "scale", "keep_prob", "pre_tockens", "next_tockens", "inner_precise",
             "prefix", "sparse_mode", "gen_mask_parallel", "sync", "softmax_layout")


def _v3_setup_context(ctx, inputs, output):
    (query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens,
     next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel,
     sync, softmax_layout, sink) = inputs
    ctx.mark_non_differentiable(output[1], output[2], output[3], output[4], output[5])
    ctx.save_for_backward(query, key, value, pse, padding_mask, atten_mask, actual_seq_qlen, actual_seq_kvlen, sink,
                          *output)
    for name, value_ in zip(_V3_SAVED, (head_num, input_layout, scale, keep_prob, pre_tockens, next_tockens,
                                        inner_precise, prefix, sparse_mode, gen_mask_parallel, sync,
                                        softmax_layout)):
        setattr(ctx, name, value_)


def _v3_backward(ctx, grad, *unused_grads):
    # derivatives.yaml (NpuFusionAttentionV3Backward0), from output 0's gradient only:
    #   query, key, value, pse, sink: npu_fusion_attention_grad_v3(query, key, value, grad, head_num,
    #     input_layout, pse, padding_mask, atten_mask, result1, result2, result3, result0, scale,
    #     keep_prob, pre_tockens, next_tockens, inner_precise, result4, result5, prefix,
    #     actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink)
    (query, key, value, pse, padding_mask, atten_mask, actual_seq_qlen, actual_seq_kvlen, sink, out, softmax_max,
     softmax_sum, softmax_out, seed, offset) = ctx.saved_tensors
    if grad is None:
        return (None,) * 21
    dq, dk, dv, dpse, dsink = torch.ops.npu.npu_fusion_attention_grad_v3(
        query, key, value, grad, ctx.head_num, ctx.input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_out,
        attention_in=out, scale_value=ctx.scale, keep_prob=ctx.keep_prob, pre_tockens=ctx.pre_tockens,
        next_tockens=ctx.next_tockens, inner_precise=ctx.inner_precise, seed=seed, offset=offset, prefix=ctx.prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=ctx.sparse_mode,
        gen_mask_parallel=ctx.gen_mask_parallel, sync=ctx.sync, softmax_layout=ctx.softmax_layout, sink=sink)
    return (dq, dk, dv, None, None, None if pse is None else dpse, None, None, None, None, None, None, None,
            None, None, None, None, None, None, None, None if sink is None else dsink)


@op_spec("npu::npu_fusion_attention_v3",
         schema="npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
                "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float "
                "keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, SymInt[]? "
                "prefix=None, Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, bool "
                'gen_mask_parallel=True, bool sync=False, str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor,'
                " Tensor, Tensor, Tensor, Tensor)",
         fake=_v3_fake, samples=_forward_samples, backward=_v3_backward, setup_context=_v3_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=3,
             max_rank=4,
             backward="npu.npu_fusion_attention_grad_v3",  # NpuFusionAttentionV3Backward0
             ge_converter=False,  # torchair 2.13 has none (attention_inference.md 2.3): not lowerable in max-autotune
             socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
             limits=_FA_LIMITS,
             doc="npu_fusion_attention's graph-mode version (docstring: aclgraph supports BNSD); what torch_npu's "
                 "SDPA calls below Ascend950; training and inference; Atlas A2 training series in the docs",
         ))
def npu_fusion_attention_v3(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                            atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=TOKEN_MAX,
                            next_tockens=TOKEN_MAX, inner_precise=0, prefix=None, actual_seq_qlen=None,
                            actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                            softmax_layout="", sink=None):
    _check(_V3, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    out, softmax_max, softmax_sum = _forward(_V3, query, key, value, head_num, input_layout, pse, atten_mask,
                                             scale, pre_tockens, next_tockens, sparse_mode)
    # seed / offset: keep_prob 1 draws no mask, the kernel returns uninitialised int64 (1,) CPU tensors
    seed = torch.zeros((1,), dtype=torch.int64)
    return out, softmax_max, softmax_sum, query.new_empty((0,)), seed, seed.clone()


def _grad_fake(query, key, value, dy, pse):
    # dq, dk, dv of their inputs' shapes and dtypes, CONTIGUOUS whatever the inputs' strides:
    # op-plugin allocates them with apply_tensor_without_format(sizes, options) (contiguous), in
    # infer_fa_v3_grad_output_tensors (op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp, Ascend/
    # op-plugin master 517f2e7), which is also the v3 grad's fake on an NPU (there is no Python Meta
    # for _v3); the wheel's Meta of the plain grad (npu_fusion_attention_backward) likewise
    # new_empty(query.shape). dpse likewise (pse's shape) or an empty (0,); dsink an empty fp32
    # (0,) without sink. (empty_like here kept a transposed q / k / v's strides, which the kernel
    # does not return: a compiled backward planned a `view` of dq from them and failed at run time.)
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            query.new_empty((0,)) if pse is None else pse.new_empty(pse.shape),
            key.new_empty((0,), dtype=torch.float32))


def _check_grad(op, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
                actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink):
    _check(op, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    expected = _out_shape(input_layout, query, key, value, head_num)
    if tuple(dy.shape) != expected or dy.dtype != query.dtype:
        raise RuntimeError(f"{op}: dy must be the output's {query.dtype} {expected}, got {dy.dtype} {tuple(dy.shape)}")


def _v3_grad_fake(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
                  softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0,
                  keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX, inner_precise=0, seed=None,
                  offset=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                  gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    _check_grad(_V3_GRAD, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    return _grad_fake(query, key, value, dy, pse)


@op_spec("npu::npu_fusion_attention_grad_v3",
         schema="npu_fusion_attention_grad_v3(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str "
                "input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? "
                "softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float "
                "scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int "
                "inner_precise=0, Tensor? seed=None, Tensor? offset=None, SymInt[]? prefix=None, Tensor? "
                "actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
                'bool sync=False, str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)',
         fake=_v3_grad_fake, samples=_grad_samples(
             npu_fusion_attention_v3, ("attention_in", "softmax_max", "softmax_sum", "softmax_in", "seed", "offset")),
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=3,
             max_rank=4,
             backward=None,
             ge_converter=False,
             socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
             limits=_FA_LIMITS,
             doc="npu_fusion_attention_v3's backward (derivatives.yaml): dq, dk, dv, dpse, dsink from the forward's "
                 "softmax_max / softmax_sum / output",
         ))  # torch_npu has no double backward
def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=TOKEN_MAX,
                                 next_tockens=TOKEN_MAX, inner_precise=0, seed=None, offset=None, prefix=None,
                                 actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                 sync=False, softmax_layout="", sink=None):
    _check_grad(_V3_GRAD, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    dq, dk, dv, dpse = _backward(_V3_GRAD, query, key, value, dy, head_num, input_layout, pse, atten_mask,
                                 softmax_max, softmax_sum, attention_in, scale_value, pre_tockens, next_tockens,
                                 sparse_mode)
    return dq, dk, dv, dpse, key.new_empty((0,), dtype=torch.float32)


# =====================================================================================
# npu_fusion_attention (what torch_npu's SDPA calls on Ascend950) and its grad
# =====================================================================================
_FA = "npu_fusion_attention"
_FA_GRAD = "npu_fusion_attention_grad"


def _fa_fake(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
             keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX, inner_precise=0, prefix=None,
             actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
             softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    _check(_FA, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    batch, queries = _batch_and_queries(input_layout, query)
    stats = (batch, head_num, queries, _STATS)
    # the wheel's Meta (npu_fusion_attention_forward) returns seed = offset = numels = 0
    return (query.new_empty(_out_shape(input_layout, query, key, value, head_num)),
            query.new_empty(stats, dtype=torch.float32), query.new_empty(stats, dtype=torch.float32),
            query.new_empty((0,)), 0, 0, 0)


_FA_SAVED = _V3_SAVED + ("actual_seq_qlen", "actual_seq_kvlen")


def _fa_setup_context(ctx, inputs, output):
    (query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens,
     next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel,
     sync, softmax_layout, sink, dropout_mask, seed, offset) = inputs
    if dropout_mask is not None:
        raise NotImplementedError(f"{_FA}: dropout_mask is not stood in")
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    ctx.save_for_backward(query, key, value, pse, padding_mask, atten_mask, sink, *output[:4])
    ctx.ints = output[4:]  # seed, offset, numels
    for name, value_ in zip(_FA_SAVED, (head_num, input_layout, scale, keep_prob, pre_tockens, next_tockens,
                                        inner_precise, prefix, sparse_mode, gen_mask_parallel, sync,
                                        softmax_layout, actual_seq_qlen, actual_seq_kvlen)):
        setattr(ctx, name, value_)


def _fa_backward(ctx, grad, *unused_grads):
    # derivatives.yaml (NpuFusionAttentionBackward0): npu_fusion_attention_grad(query, key, value, grad,
    #   head_num, input_layout, pse, padding_mask, atten_mask, result1, result2, result3, result0, scale,
    #   keep_prob, pre_tockens, next_tockens, inner_precise, result4, result5, result6, prefix,
    #   actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink)
    query, key, value, pse, padding_mask, atten_mask, sink, out, softmax_max, softmax_sum, softmax_out = \
        ctx.saved_tensors
    if grad is None:
        return (None,) * 24
    seed, offset, numels = ctx.ints
    dq, dk, dv, dpse, dsink = torch.ops.npu.npu_fusion_attention_grad(
        query, key, value, grad, ctx.head_num, ctx.input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_out,
        attention_in=out, scale_value=ctx.scale, keep_prob=ctx.keep_prob, pre_tockens=ctx.pre_tockens,
        next_tockens=ctx.next_tockens, inner_precise=ctx.inner_precise, seed=seed, offset=offset, numels=numels,
        prefix=ctx.prefix, actual_seq_qlen=ctx.actual_seq_qlen, actual_seq_kvlen=ctx.actual_seq_kvlen,
        sparse_mode=ctx.sparse_mode, gen_mask_parallel=ctx.gen_mask_parallel, sync=ctx.sync,
        softmax_layout=ctx.softmax_layout, sink=sink)
    return (dq, dk, dv, None, None, None if pse is None else dpse, None, None, None, None, None, None, None,
            None, None, None, None, None, None, None, None if sink is None else dsink, None, None, None)


@op_spec("npu::npu_fusion_attention",
         schema="npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? "
                "pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., int "
                "pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? "
                "actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
                'bool sync=False, str softmax_layout="", Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, int '
                "offset=0) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
         fake=_fa_fake, samples=_forward_samples, backward=_fa_backward, setup_context=_fa_setup_context,
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=3,
             max_rank=4,
             backward="npu.npu_fusion_attention_grad",  # NpuFusionAttentionBackward0
             ge_converter=True,  # custom/npu_fusion_attention.py:4 (BSH/BNSD, keep_prob 1 only)
             socs={"Ascend310P": SocLimits(supported=False)},
             limits=_FA_LIMITS,
             doc="training FlashAttention (op_semantics 9.1); what torch_npu's SDPA calls on Ascend950",
         ))
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None,
                         seed=0, offset=0):
    _check(_FA, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob, prefix,
           actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    if dropout_mask is not None:
        raise NotImplementedError(f"{_FA}: dropout_mask is not stood in")
    out, softmax_max, softmax_sum = _forward(_FA, query, key, value, head_num, input_layout, pse, atten_mask,
                                             scale, pre_tockens, next_tockens, sparse_mode)
    # seed / offset / numels as the wheel's Meta returns them (keep_prob 1 draws no mask)
    return out, softmax_max, softmax_sum, query.new_empty((0,)), 0, 0, 0


def _fa_grad_fake(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
                  softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, scale_value=1.0,
                  keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX, inner_precise=0, seed=0, offset=0,
                  numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                  gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    _check_grad(_FA_GRAD, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    return _grad_fake(query, key, value, dy, pse)


@op_spec("npu::npu_fusion_attention_grad",
         schema="npu_fusion_attention_grad(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str "
                "input_layout, *, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? "
                "softmax_max=None, Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float "
                "scale_value=1., float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int "
                "inner_precise=0, int seed=0, int offset=0, int numels=0, int[]? prefix=None, int[]? "
                "actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
                'bool sync=False, str softmax_layout="", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)',
         fake=_fa_grad_fake,
         samples=_grad_samples(npu_fusion_attention, ("attention_in", "softmax_max", "softmax_sum", "softmax_in", "seed",
                                                      "offset", "numels")),
         capability=OpCapability(
             dtypes=FLOAT_DTYPES,
             min_rank=3,
             max_rank=4,
             backward=None,
             ge_converter=True,  # custom/npu_fusion_attention.py:75
             socs={"Ascend310P": SocLimits(supported=False)},
             limits=_FA_LIMITS,
             doc="npu_fusion_attention's backward (derivatives.yaml)",
         ))
def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1.0, keep_prob=1.0, pre_tockens=TOKEN_MAX, next_tockens=TOKEN_MAX,
                              inner_precise=0, seed=0, offset=0, numels=0, prefix=None, actual_seq_qlen=None,
                              actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                              softmax_layout="", sink=None):
    _check_grad(_FA_GRAD, query, key, value, dy, head_num, input_layout, pse, padding_mask, atten_mask, keep_prob,
                prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink)
    dq, dk, dv, dpse = _backward(_FA_GRAD, query, key, value, dy, head_num, input_layout, pse, atten_mask,
                                 softmax_max, softmax_sum, attention_in, scale_value, pre_tockens, next_tockens,
                                 sparse_mode)
    return dq, dk, dv, dpse, key.new_empty((0,), dtype=torch.float32)
