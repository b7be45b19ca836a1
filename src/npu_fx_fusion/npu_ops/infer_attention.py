"""Inference attention: npu_fused_infer_attention_score (FIA).

Reference semantics: the torch_npu 2.13.0 docstring (`_op_plugin_docs.py`, "npu_fused_infer_attention_score")
and its Meta function (`op_plugin/meta/_meta_registrations.py`, npu_fused_infer_attention_score_forward),
summarised in shared/reference/attention_inference.md section 3 and op_semantics.md 9.2.

    attention_out = softmax(scale * query @ key^T, masked) @ value

The conventions the stand-in implements (and refuses to guess beyond):

* Layouts: "BNSD" (B, N, S, D), "BSND" (B, S, N, D), "BSH" (B, S, N*D), and "BNSD_BSND"
  (BNSD in, BSND out, Q_S > 1 only). The output has the query's layout (BNSD_BSND: BSND)
  with value's head dim. query, key, value and atten_mask must be contiguous ("不支持非连续
  的Tensor"), key and value of one shape ("key、value中对应tensor的shape需要完全一致").
* Heads: num_heads query heads over num_key_value_heads key/value heads (0: as many as
  num_heads), a divisor of num_heads, ratio <= 64; query head h reads key head h // G. In
  BNSD/BSND both must equal the tensors' N.
* atten_mask: bool / int8 / uint8, True (1) = masked out, the opposite of SDPA's bool mask.
  sparse_mode 0 / 1: a full mask (Q_S, KV_S), (1, Q_S, KV_S), (B, 1, Q_S, KV_S) or
  (1, 1, Q_S, KV_S), or (B, KV_S) when Q_S = 1; mode 0 without a mask attends everywhere.
  sparse_mode 2 (left-up causal: query i sees keys j <= i) and 3 (right-down causal:
  j <= i + KV_S - Q_S) take the compressed mask triu(ones(2048, 2048), 1) instead.
* Q_S = 1 runs the incremental (IFA) branch: sparse_mode, pre_tokens, next_tokens and
  actual_seq_lengths are ignored there, and inner_precise must be 0 or 1.
* inner_precise bit 1 ("行无效修正", invalid-row correction): a query row whose every key is
  masked gives 0. Without it the docs promise nothing ("精度可能会有损失"), and the stand-in
  gives NaN, so a graph that relies on such rows shows it.
* actual_seq_lengths_kv (per batch, or one value for all): keys at or past the length are
  not attended. With sparse_mode 3 the causal origin moves with it.

Precision: scores, softmax and the value product in fp32 (float64 stays float64), one
rounding to the query's dtype. Whether the kernel rounds the probabilities to fp16/bf16
before the second matmul is not documented (attention_inference.md 3.5, question 3).
Quantisation, paged KV (block_table), shared prefixes, pse_shift, MLA rope inputs and
sparse_mode 4 are not implemented: the kernel raises NotImplementedError for them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .spec import OpCapability, Sample, SocLimits, op_spec, randn

DEFAULT_TOKENS = 2147483647  # pre_tokens / next_tokens: "everything"
COMPRESSED_MASK_SIZE = 2048  # sparse_mode 2/3/4 take triu(ones(2048, 2048), 1)
LAYOUTS = ("BNSD", "BSND", "BSH", "BNSD_BSND")
MAX_GROUP = 64  # num_heads / num_key_value_heads <= 64

_UNSUPPORTED = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
                "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
                "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "block_table",
                "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
                "actual_shared_prefix_len", "query_rope", "key_rope", "key_rope_antiquant_scale")

OP = "npu_fused_infer_attention_score"


def compressed_causal_mask(device=None) -> torch.Tensor:
    """The mask sparse_mode 2 / 3 take: triu(ones(2048, 2048), 1), True above the diagonal."""
    return torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _to_bnsd(t: torch.Tensor, layout: str, heads: int, name: str) -> torch.Tensor:
    """A (B, N, S, D) view of a query / key / value in `layout`."""
    if layout == "BSH":
        if t.dim() != 3 or t.shape[-1] % heads:
            raise RuntimeError(f"{OP}: with layout BSH {name} must be (B, S, N*D) with N = {heads}, "
                               f"got {tuple(t.shape)}")
        return t.unflatten(-1, (heads, t.shape[-1] // heads)).transpose(1, 2)
    if t.dim() != 4:
        raise RuntimeError(f"{OP}: with layout {layout} {name} must be 4-D, got {tuple(t.shape)}")
    return t.transpose(1, 2) if layout == "BSND" else t


def _query_out_layouts(input_layout: str) -> tuple[str, str]:
    if input_layout not in LAYOUTS:
        raise NotImplementedError(f"{OP}: input_layout {input_layout!r} is not implemented by the stand-in "
                                  f"(implemented: {', '.join(LAYOUTS)}; TND and the _NBSD layouts are not)")
    if input_layout == "BNSD_BSND":
        return "BNSD", "BSND"
    return input_layout, input_layout


def _heads(query: torch.Tensor, key: torch.Tensor, layout: str, num_heads: int,
           num_key_value_heads: int) -> tuple[int, int]:
    if num_heads <= 0:
        raise RuntimeError(f"{OP}: num_heads must be positive, got {num_heads}")
    kv_heads = num_heads if num_key_value_heads == 0 else num_key_value_heads
    if kv_heads <= 0 or num_heads % kv_heads or num_heads // kv_heads > MAX_GROUP:
        raise RuntimeError(f"{OP}: num_heads {num_heads} must be a multiple of num_key_value_heads {kv_heads}, "
                           f"at most {MAX_GROUP} times it")
    if layout in ("BNSD", "BSND"):
        axis = 1 if layout == "BNSD" else 2
        if query.shape[axis] != num_heads or key.shape[axis] != kv_heads:
            raise RuntimeError(f"{OP}: in {layout} query has {query.shape[axis]} heads and key "
                               f"{key.shape[axis]}, the arguments say {num_heads} and {kv_heads}")
    return num_heads, kv_heads


def _lengths(values: Optional[Sequence[int]], batch: int, full: int, name: str) -> list[int]:
    if values is None:
        return [full] * batch
    values = [int(v) for v in values]
    if len(values) == 1:
        values = values * batch
    elif len(values) >= batch:
        values = values[:batch]
    else:
        raise RuntimeError(f"{OP}: {name} has {len(values)} entries for batch {batch} (1 or >= B allowed)")
    if any(not 0 <= v <= full for v in values):
        raise RuntimeError(f"{OP}: {name} {values} must lie in [0, {full}]")
    return values


def _is_compressed_causal(mask: torch.Tensor) -> bool:
    if mask.shape[-2:] != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE) or mask.dim() > 4:
        return False
    if any(s != 1 for s in mask.shape[:-2]):
        return False
    flat = mask.reshape(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE).to(torch.bool)
    return bool((flat == compressed_causal_mask(mask.device)).all())


def _explicit_mask(mask: torch.Tensor, batch: int, queries: int, keys: int) -> torch.Tensor:
    """A full mask of sparse_mode 0/1 as (B, 1, Q_S, KV_S) bool, True = masked."""
    shape = tuple(mask.shape)
    allowed = {(queries, keys), (1, queries, keys), (batch, 1, queries, keys), (1, 1, queries, keys)}
    if queries == 1:
        allowed.add((batch, keys))
    if shape not in allowed:
        raise RuntimeError(f"{OP}: atten_mask of shape {shape} for Q_S={queries}, KV_S={keys}, B={batch}; "
                           f"the op takes {sorted(allowed)}")
    if shape == (batch, keys) and queries == 1:
        mask = mask.view(batch, 1, 1, keys)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.to(torch.bool).expand(batch, 1, queries, keys)


def _visible(batch: int, queries: int, keys: int, atten_mask: Optional[torch.Tensor], sparse_mode: int,
             kv_lengths: list[int], device) -> torch.Tensor:
    """(B, 1, Q_S, KV_S) bool, True where query i attends key j."""
    j = torch.arange(keys, device=device)
    visible = (j.view(1, 1, 1, keys) < torch.tensor(kv_lengths, device=device).view(batch, 1, 1, 1))
    visible = visible.expand(batch, 1, queries, keys)
    if queries == 1:  # the incremental branch: only an explicit mask applies
        if atten_mask is not None:
            visible = visible & ~_explicit_mask(atten_mask, batch, 1, keys)
        return visible
    if sparse_mode in (0, 1):
        if sparse_mode == 1 and atten_mask is None:
            raise RuntimeError(f"{OP}: sparse_mode 1 (allMask) needs the full atten_mask")
        if atten_mask is not None:
            visible = visible & ~_explicit_mask(atten_mask, batch, queries, keys)
        return visible
    if sparse_mode in (2, 3):
        if atten_mask is None or not _is_compressed_causal(atten_mask):
            raise RuntimeError(f"{OP}: sparse_mode {sparse_mode} takes the compressed mask "
                               f"triu(ones(2048, 2048), 1), shaped (2048, 2048), (1, 2048, 2048) or "
                               f"(1, 1, 2048, 2048); got {None if atten_mask is None else tuple(atten_mask.shape)}")
        i = torch.arange(queries, device=device).view(1, 1, queries, 1)
        if sparse_mode == 2:  # left-up: the origin is the top-left corner
            last = i.expand(batch, 1, queries, 1)
        else:  # right-down: the last query of a batch sees its last valid key
            offset = torch.tensor(kv_lengths, device=device).view(batch, 1, 1, 1) - queries
            last = i + offset
        return visible & (j.view(1, 1, 1, keys) <= last)
    raise NotImplementedError(f"{OP}: sparse_mode {sparse_mode} is not implemented by the stand-in "
                              "(0, 1, 2 and 3 are; 4 is a band, 9 a tree mask)")


def _check_inputs(query, key, value, atten_mask, input_layout, sparse_mode, inner_precise, pre_tokens,
                  next_tokens, unsupported: dict, queries: int) -> None:
    given = [name for name, value_ in unsupported.items() if value_ is not None]
    if given:
        raise NotImplementedError(f"{OP}: the stand-in does not implement {', '.join(given)}")
    for name, t in (("query", query), ("key", key), ("value", value), ("atten_mask", atten_mask)):
        if t is not None and not t.is_contiguous():
            raise RuntimeError(f"{OP}: {name} is not contiguous; the op does not take non-contiguous tensors")
    if key.shape != value.shape:
        raise RuntimeError(f"{OP}: key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
    if not query.dtype.is_floating_point or key.dtype != query.dtype or value.dtype != query.dtype:
        raise RuntimeError(f"{OP}: query, key and value must be floating point of one dtype, got "
                           f"{query.dtype}, {key.dtype}, {value.dtype}")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise RuntimeError(f"{OP}: atten_mask must be bool, int8 or uint8 (True / 1 = masked), got "
                           f"{atten_mask.dtype}")
    if inner_precise not in (0, 1, 2, 3):
        raise RuntimeError(f"{OP}: inner_precise must be 0-3, got {inner_precise}")
    if input_layout == "BNSD_BSND" and queries == 1:
        raise RuntimeError(f"{OP}: BNSD_BSND needs Q_S > 1")
    if (pre_tokens, next_tokens) != (DEFAULT_TOKENS, DEFAULT_TOKENS) and sparse_mode in (0, 1):
        raise NotImplementedError(f"{OP}: the stand-in implements pre_tokens/next_tokens only at their default "
                                  f"{DEFAULT_TOKENS} (a band is sparse_mode 4, not implemented)")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            row_correction: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, Q_S, Dv) in the compute dtype, and the lse (B, N, Q_S, 1); k, v (B, N, KV_S, D)."""
    compute = _compute_dtype(q)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.to(compute))
    if row_correction:
        empty = ~visible.any(dim=-1, keepdim=True)
        out = out.masked_fill(empty, 0.0)
    return out, lse


def qkv(queries: int, keys: int, *, dtype=torch.float64, batch=2, heads=4, kv_heads=2, dim=8, dim_v=8, seed=0):
    """BNSD query (B, N, Q_S, D) and key / value (B, N_kv, KV_S, D / Dv) of seeded values."""
    return (randn(batch, heads, queries, dim, seed=seed, dtype=dtype),
            randn(batch, kv_heads, keys, dim, seed=seed + 1, dtype=dtype),
            randn(batch, kv_heads, keys, dim_v, seed=seed + 2, dtype=dtype))


def _as_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A BNSD tensor in `layout` (contiguous, as the op requires)."""
    if layout in ("BNSD", "BNSD_BSND"):
        return t
    bsnd = t.transpose(1, 2).contiguous()
    return bsnd if layout == "BSND" else bsnd.flatten(-2)


def _fia_samples(dtype):
    # the layouts, GQA, the right-down causal mask (compressed), an explicit mask, decode (Q_S = 1)
    # with per-batch kv lengths, the lse
    for layout in LAYOUTS:
        q, k, v = (_as_layout(t, layout) for t in qkv(3, 5, dtype=dtype))
        yield Sample((q, k, v), {"num_heads": 4, "num_key_value_heads": 2, "input_layout": layout,
                                 "softmax_lse_flag": layout == "BNSD", "scale": 0.3})
    q, k, v = qkv(3, 7, dtype=dtype)
    yield Sample((q, k, v), {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD", "sparse_mode": 3,
                             "atten_mask": compressed_causal_mask(), "inner_precise": 2})
    mask = torch.arange(7).view(1, 1, 1, 7).expand(2, 1, 3, 7) > torch.arange(3).view(1, 1, 3, 1) + 4
    yield Sample((q, k, v), {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD",
                             "atten_mask": mask.contiguous()})
    q, k, v = qkv(1, 7, dtype=dtype)
    yield Sample((q, k, v), {"num_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD",
                             "actual_seq_lengths_kv": [5, 7], "softmax_lse_flag": True})


def _fia_fake(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
              actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
              quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
              key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
              value_antiquant_offset=None, block_table=None, query_padding_size=None, kv_padding_size=None,
              key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
              key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=DEFAULT_TOKENS,
              next_tokens=DEFAULT_TOKENS, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
              inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
              softmax_lse_flag=False):
    # the Meta function's shapes: output in the query's layout (BNSD_BSND: BSND) with value's D
    query_layout, out_layout = _query_out_layouts(input_layout)
    kv_heads = num_heads if num_key_value_heads == 0 else num_key_value_heads
    q = _to_bnsd(query, query_layout, num_heads, "query")
    batch, heads, queries, _ = q.shape
    dim_v = value.shape[-1] if query_layout != "BSH" else value.shape[-1] // kv_heads
    if out_layout == "BNSD":
        shape = (batch, heads, queries, dim_v)
    elif out_layout == "BSND":
        shape = (batch, queries, heads, dim_v)
    else:
        shape = (batch, queries, heads * dim_v)
    lse = query.new_empty((batch, heads, queries, 1) if softmax_lse_flag else (0,), dtype=torch.float32)
    return query.new_empty(shape), lse


@op_spec("npu::npu_fused_infer_attention_score",
         schema="npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
                "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
                "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? "
                "quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? "
                "antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? "
                "value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? "
                "query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? "
                "value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? "
                "key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int "
                'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, '
                "int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, int "
                "key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)",
         fake=_fia_fake, samples=_fia_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),  # query; int8 only with quantisation
             min_rank=3,  # BSH / TND
             max_rank=4,  # BNSD / BSND
             backward=None,  # no autograd node in torch_npu: inference graphs only
             ge_converter=True,  # custom/fused_infer_attention_score.py -> GE FusedInferAttentionScore
             # the 2.13 docstring lists Atlas A2 and A3 only ("支持的芯片型号"); Atlas inference
             # (310P) has PFA/IFA in fp16 but not FIA; 950 has FIA_v2, which no pass emits
             socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
             limits={
                 "layouts": ("BNSD", "BSND"),  # the ones the attention pass emits (also BSH, TND, ...)
                 "head_dim_multiple": 16,  # fp16 / bf16 D 16-aligned (Q_S > 1; 32 for int8)
                 "max_head_dim": 512,
                 "max_heads": 256,
                 "max_batch": 65536,
                 "max_group": 64,  # num_heads / num_key_value_heads
                 "max_bsnd_hidden": 65535,  # N * D < 65535 in BSH / BSND (Q_S > 1)
                 "max_decode_kv_len": 262144,  # Q_S = 1: KV_S <= 262144
                 "key_value_one_shape": True,  # "key、value中对应tensor的shape需要完全一致"
                 "contiguous": True,  # query, key, value, atten_mask: no non-contiguous tensors
                 "compressed_mask_size": 2048,  # sparse_mode 2/3/4: triu(ones(2048, 2048), 1)
                 "sparse_modes": (0, 1, 2, 3, 4),
                 "decode_inner_precise": (0, 1),  # Q_S = 1; 2 / 3 add the invalid-row correction
                 # torchair's ACL modes rewrite it to its .out overload with a static workspace
                 # and make actual_seq_lengths(_kv) replay parameters (acl_graph.py:108-135)
                 "acl_out_rewrite": True,
             },
             doc="attention_inference.md 3.1-3.2 / torch_npu 2.13.0 docstring (_op_plugin_docs.py "
             "npu_fused_infer_attention_score, ~L8053) and Meta function: query fp16/bf16/int8 (no fp32), "
             "key and value of one shape, contiguous inputs, layouts BSH/BSND/BNSD/BNSD_BSND/TND; Q_S > 1: "
             "B <= 65536, N <= 256, D <= 512 and 16-aligned, N*D < 65535 in BSH/BSND; Q_S = 1 (IFA branch): "
             "KV_S <= 262144, sparse_mode / pre / next ignored, inner_precise 0/1; GQA num_heads % "
             "num_key_value_heads == 0, ratio <= 64; mask True = masked, sparse_mode 2/3/4 with the "
             "compressed 2048x2048 mask; products Atlas A2/A3; GE converter "
             "custom/fused_infer_attention_score.py (.default only); no autograd",
         ))  # no autograd in torch_npu: inference only
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=DEFAULT_TOKENS, next_tokens=DEFAULT_TOKENS, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    unsupported = dict(zip(_UNSUPPORTED, (
        pse_shift, dequant_scale1, quant_scale1, dequant_scale2, quant_scale2, quant_offset2, antiquant_scale,
        antiquant_offset, key_antiquant_scale, key_antiquant_offset, value_antiquant_scale, value_antiquant_offset,
        block_table, query_padding_size, kv_padding_size, key_shared_prefix, value_shared_prefix,
        actual_shared_prefix_len, query_rope, key_rope, key_rope_antiquant_scale)))
    query_layout, out_layout = _query_out_layouts(input_layout)
    heads, kv_heads = _heads(query, key, query_layout, num_heads, num_key_value_heads)
    q = _to_bnsd(query, query_layout, heads, "query")
    k = _to_bnsd(key, query_layout, kv_heads, "key")
    v = _to_bnsd(value, query_layout, kv_heads, "value")
    _check_inputs(query, key, value, atten_mask, input_layout, sparse_mode, inner_precise, pre_tokens,
                  next_tokens, unsupported, queries=q.shape[2])
    batch, _, queries, dim = q.shape
    keys = k.shape[2]
    if k.shape[0] != batch or k.shape[-1] != dim:
        raise RuntimeError(f"{OP}: key {tuple(k.shape)} (as BNSD) does not fit query {tuple(q.shape)}")
    if queries == 1:
        if inner_precise not in (0, 1):
            raise RuntimeError(f"{OP}: with Q_S = 1 inner_precise must be 0 or 1, got {inner_precise}")
    elif actual_seq_lengths is not None and any(n != queries for n in _lengths(actual_seq_lengths, batch,
                                                                              queries, "actual_seq_lengths")):
        raise NotImplementedError(f"{OP}: the stand-in implements actual_seq_lengths only equal to Q_S")
    kv_lengths = _lengths(actual_seq_lengths_kv, batch, keys, "actual_seq_lengths_kv")
    visible = _visible(batch, queries, keys, atten_mask, sparse_mode, kv_lengths, q.device)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = _attend(q, k, v, visible, scale, row_correction=bool(inner_precise & 2) and queries > 1)
    out = out.to(query.dtype)
    if out_layout == "BSND":
        out = out.transpose(1, 2).contiguous()
    elif out_layout == "BSH":
        out = out.transpose(1, 2).flatten(-2).contiguous()
    lse = lse.float() if softmax_lse_flag else query.new_empty((0,), dtype=torch.float32)
    return out, lse
