"""DeepSeek-V3.2 sparse attention (DSA): the lightning indexer, sparse flash attention, and
the softmax-L1-norm target of the indexer loss (cann_ops_transformer) with its metadata.

Reference semantics: shared/reference/op_semantics.md sections 8 and 10, checked against
the op-plugin docs (docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md,
-npu_sparse_flash_attention.md), the A2/A3 AscendC kernels (LightningIndexer,
SparseFlashAttention: lightning_indexer_kernel.h, sparse_flash_attention_kernel_mla.h),
the vendor CPU goldens (sgl-kernel-npu tests/python/sgl_kernel_npu/test_lightning_indexer.py,
test_sparse_flash_attention.py), and for the cann_ops_transformer ops the extension's docs,
infershape, pypto kernel and AICPU metadata kernel (hicann/ops-transformer). Output shapes
and dtypes of the npu ops are the wheel's Meta functions'.

The conventions, in one place (b: batch, i: query row in its batch, j: key in its batch):

* Layouts. BSND (B, S, N, D): batch b is row block b, its first L_b rows valid, with L_b
  the per-batch `actual_seq_lengths*` (None: all S). TND (T, N, D): the batches are
  consecutive row ranges and the lengths are CUMULATIVE (prefix sums, no leading 0:
  [3, 5] = rows 0-2, 3-4); the cann_ops_transformer ops take `cu_seqlens` WITH the leading
  0 (B + 1 entries) instead. PA_BSND (keys only): (blocks, block_size, N, D) paged cache;
  key j of batch b is key[block_table[b, j // block_size], j % block_size], and the
  per-batch key lengths are required.
* Key positions (indices in and out) are batch-local: 0 is the batch's first key, in every
  layout, TND and paged included.
* sparse_mode / mask_mode 3 is the RIGHT-DOWN causal mask: row i of a batch with Lq queries
  and Lk keys sees j <= (Lk - Lq) + i (the last query sees every key). 0: no mask.
* Sparse indices: valid entries first; the first negative (-1 padding) ends the list, it
  and every slot after it select nothing. In npu_sparse_flash_attention an entry is a
  BLOCK id: block s selects keys [s * sparse_block_size, (s + 1) * sparse_block_size),
  cut at the batch's key count.
* Heads: N1 query heads share N2 key heads in groups of G = N1 / N2 consecutive heads
  (query head h reads key head h // G). The docs allow N2 = 1 only; the kernels compute any
  N2 dividing N1, capabilities.py holds the limits.

Everything is computed in fp32 (float64 stays float64) and rounded once to the output
dtype. Hardware limits (D = 128 / 512 + 64, head counts, sparse_count values, block sizes,
SoCs) live in capabilities.py; the kernels refuse only what they cannot compute or what
the op itself would reject (ranks, layouts, modes, mismatched shapes and dtypes).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from .spec import HALF_DTYPES, OpCapability, Sample, SocLimits, in_layout_of, only_on_socs, op_spec, randn

# the CANN ops-transformer extension's products (its docs): Atlas A2, A3 and Ascend 950
_A2_A3_950 = only_on_socs("Ascend910B", "Ascend910_93", "Ascend950")


_I64_MAX = 9223372036854775807  # pre_tokens / next_tokens: only the default is supported
# SOFTMAX_MIN_NUM of the A2/A3 SFA vector service: softmax_max of a row with no key
_SOFTMAX_MIN = -2e38
# The metadata op spreads the rows over min(rows, AIC cores, 36) cores. The AIC count is the
# device's; the stand-in assumes at least 36 (the kernel's result does not depend on it).
_METADATA_MAX_CORES = 36
_METADATA_SIZE = 64

LAYOUTS = ("BSND", "TND")
KEY_LAYOUTS = ("BSND", "TND", "PA_BSND")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _ints(op: str, name: str, t: torch.Tensor) -> list[int]:
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise RuntimeError(f"{op}: {name} must be a 1-D integer tensor, got {t.dtype} {_shape(t)}")
    return [int(v) for v in t.tolist()]


def _check_rank(op: str, name: str, t: torch.Tensor, layout: str) -> None:
    rank = 3 if layout == "TND" else 4
    if t.dim() != rank:
        raise RuntimeError(f"{op}: with layout {layout} {name} must be {rank}-D, it has {t.dim()} dims "
                           f"{_shape(t)}")


def _check_layouts(op: str, layout_q: str, layout_k: str, k_name: str, key_layouts=KEY_LAYOUTS) -> None:
    if layout_q not in LAYOUTS:
        raise RuntimeError(f"{op}: query layout must be one of {LAYOUTS}, got {layout_q!r}")
    if layout_k not in key_layouts:
        raise RuntimeError(f"{op}: {k_name} must be one of {key_layouts}, got {layout_k!r}")
    if layout_k != "PA_BSND" and layout_k != layout_q:
        raise RuntimeError(f"{op}: without paged keys (PA_BSND) {k_name} must equal the query layout, "
                           f"got {layout_q!r} and {layout_k!r}")


def _check_float_pair(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if not a.dtype.is_floating_point or a.dtype != b.dtype:
        raise RuntimeError(f"{op}: {a_name} and {b_name} must be floating point of one dtype, got "
                           f"{a.dtype} and {b.dtype}")


def _check_heads(op: str, n1: int, n2: int) -> int:
    if n2 <= 0 or n1 % n2:
        raise RuntimeError(f"{op}: the {n1} query heads must be a multiple of the {n2} key heads")
    return n1 // n2


def _check_default_tokens(op: str, pre_tokens: int, next_tokens: int) -> None:
    if pre_tokens != _I64_MAX or next_tokens != _I64_MAX:
        raise NotImplementedError(f"{op}: only the default pre_tokens/next_tokens (2^63-1) are supported "
                                  f"(torch_npu docs), got {pre_tokens} and {next_tokens}")


# ---- batches ----------------------------------------------------------------------------
def _query_batches(op: str, layout: str, query: torch.Tensor, lengths: Optional[torch.Tensor],
                   name: str) -> tuple[list[int], list[int]]:
    """(first flat row, valid rows) of each batch of a BSND / TND query-like tensor."""
    if layout == "TND":
        if lengths is None:
            raise RuntimeError(f"{op}: with layout TND {name} (cumulative lengths) is required")
        return _cumulative(op, name, _ints(op, name, lengths), query.shape[0])
    batch, seq = query.shape[0], query.shape[1]
    if lengths is None:
        return [b * seq for b in range(batch)], [seq] * batch
    lens = _ints(op, name, lengths)
    if len(lens) != batch or any(not 0 <= n <= seq for n in lens):
        raise RuntimeError(f"{op}: {name} must hold {batch} lengths in [0, {seq}], got {lens}")
    return [b * seq for b in range(batch)], lens


def _cumulative(op: str, name: str, cum: list[int], rows: int) -> tuple[list[int], list[int]]:
    if not cum or cum[0] < 0 or any(b < a for a, b in zip(cum, cum[1:])) or cum[-1] > rows:
        raise RuntimeError(f"{op}: {name} must be non-decreasing cumulative lengths (prefix sums) "
                           f"between 0 and {rows}, got {cum}")
    starts = [0] + cum[:-1]
    return starts, [end - start for start, end in zip(starts, cum)]


def _key_rows(op: str, layout: str, key: torch.Tensor, lengths: Optional[torch.Tensor],
              block_table: Optional[torch.Tensor], batch: int, name: str) -> list[torch.Tensor]:
    """Per batch, the rows of key.reshape(-1, N, D) holding its keys 0, 1, ... in order."""
    if layout == "PA_BSND":
        if block_table is None or lengths is None:
            raise RuntimeError(f"{op}: paged keys (PA_BSND) need block_table and {name}")
        lens = _ints(op, name, lengths)
        blocks, block_size = key.shape[0], key.shape[1]
        if block_table.dim() != 2 or block_table.shape[0] != batch or len(lens) != batch:
            raise RuntimeError(f"{op}: PA_BSND needs block_table (B={batch}, max_blocks) and {batch} "
                               f"{name}, got {_shape(block_table)} and {lens}")
        table = block_table.long()
        rows = []
        for b, n in enumerate(lens):
            if n < 0 or (n and (n - 1) // block_size >= table.shape[1]):
                raise RuntimeError(f"{op}: batch {b} has {n} keys, not between 0 and the "
                                   f"{table.shape[1]} x {block_size} its block_table row holds")
            j = torch.arange(n)
            ids = table[b, j // block_size]
            if n and not ((ids >= 0) & (ids < blocks)).all():
                raise RuntimeError(f"{op}: block_table[{b}] names blocks outside [0, {blocks})")
            rows.append(ids * block_size + j % block_size)
        return rows
    if block_table is not None:
        raise RuntimeError(f"{op}: block_table is for paged keys (PA_BSND) only, layout is {layout}")
    if layout == "TND":
        if lengths is None:
            raise RuntimeError(f"{op}: with layout TND {name} (cumulative lengths) is required")
        starts, lens = _cumulative(op, name, _ints(op, name, lengths), key.shape[0])
    else:
        if key.shape[0] != batch:
            raise RuntimeError(f"{op}: key has batch {key.shape[0]}, the query {batch}")
        starts, lens = _query_batches(op, "BSND", key, lengths, name)
    if len(lens) != batch:
        raise RuntimeError(f"{op}: {name} has {len(lens)} batches, the query {batch}")
    return [torch.arange(start, start + n) for start, n in zip(starts, lens)]


def _batches(op: str, query: torch.Tensor, layout_query: str, query_lengths: Optional[torch.Tensor],
             query_name: str, key: torch.Tensor, layout_key: str, key_lengths: Optional[torch.Tensor],
             key_name: str, block_table: Optional[torch.Tensor] = None):
    """The batches with queries and keys, as (slice of the flat query rows, query rows,
    flat key rows, key count): what every kernel here loops over."""
    starts, lens = _query_batches(op, layout_query, query, query_lengths, query_name)
    key_rows = _key_rows(op, layout_key, key, key_lengths, block_table, len(lens), key_name)
    return [(slice(start, start + lq), lq, k_b, k_b.numel())
            for start, lq, k_b in zip(starts, lens, key_rows) if lq and k_b.numel()]


def _causal_hidden(lq: int, lk: int) -> torch.Tensor:
    """(lq, lk) True where the right-down causal mask hides key j from query row i."""
    i = torch.arange(lq).unsqueeze(1)
    return torch.arange(lk).unsqueeze(0) > (lk - lq) + i


# =====================================================================================
# opcheck samples (DeepSeek-V3.2: BSND, TND and paged keys; V4: SWA / CSA / HCA)
# =====================================================================================
def _dsa_inputs(dtype):
    """Queries, keys and weights in BSND (B=2, S1=3, N1=4) and TND (lengths 2 and 4), paged keys
    (block size 4), the lengths, and sparse indices (-1 ending a list) for both query layouts."""
    return SimpleNamespace(
        q4=randn(2, 3, 4, 8, dtype=dtype), k4=randn(2, 5, 1, 8, dtype=dtype, seed=1),
        w4=randn(2, 3, 4, dtype=dtype, seed=2),
        q3=randn(6, 4, 8, dtype=dtype, seed=3), k3=randn(9, 1, 8, dtype=dtype, seed=4),
        w3=randn(6, 4, dtype=dtype, seed=5),
        paged=randn(6, 4, 1, 8, dtype=dtype, seed=6), table=torch.tensor([[3, 0], [1, 5]], dtype=torch.int32),
        cq=torch.tensor([2, 6], dtype=torch.int32), ck=torch.tensor([4, 9], dtype=torch.int32),
        lens_k=torch.tensor([5, 7], dtype=torch.int32),
        sq4=randn(2, 3, 4, 16, dtype=dtype, seed=7), sk4=randn(2, 5, 1, 16, dtype=dtype, seed=8),
        skr4=randn(2, 5, 1, 4, dtype=dtype, seed=9), sqr4=randn(2, 3, 4, 4, dtype=dtype, seed=10),
        sq3=randn(6, 4, 16, dtype=dtype, seed=11), sk3=randn(9, 1, 16, dtype=dtype, seed=12),
        spaged=randn(6, 4, 1, 16, dtype=dtype, seed=13),
        si4=torch.tensor([0, 3, 1, -1], dtype=torch.int32).expand(2, 3, 1, 4).contiguous(),
        si3=torch.tensor([1, 0, -1], dtype=torch.int32).expand(6, 1, 3).contiguous(),
        cu_q=torch.tensor([0, 2, 6], dtype=torch.int32), cu_k=torch.tensor([0, 4, 9], dtype=torch.int32))


def _indexer_samples(dtype):
    # no gradient checked here: opcheck's loss sums every output, and the int32 indices make that an
    # integer (tests/test_npu_ops_attention.py differentiates the values instead)
    t = _dsa_inputs(dtype)
    yield Sample((t.q4, t.k4, t.w4), dict(sparse_count=3))
    yield Sample((t.q4, t.k4, t.w4), dict(sparse_count=7, sparse_mode=0, return_value=True))
    yield Sample((t.q3, t.k3, t.w3), dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_key=t.ck,
                                          layout_query="TND", layout_key="TND", sparse_count=4, return_value=True))
    yield Sample((t.q4, t.paged, t.w4), dict(actual_seq_lengths_key=t.lens_k, block_table=t.table, layout_key="PA_BSND",
                                             sparse_count=4))
    yield Sample((t.q3, t.paged, t.w3), dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_key=t.lens_k,
                                             block_table=t.table, layout_query="TND", layout_key="PA_BSND",
                                             sparse_count=4, return_value=True))


def _indexer_grad_samples(dtype):
    t = _dsa_inputs(dtype)
    idx4 = npu_lightning_indexer(t.q4, t.k4, t.w4, sparse_count=3)[0]
    yield Sample((t.q4, t.k4, randn(2, 3, 1, 3, dtype=dtype, seed=14), idx4, t.w4))
    tnd = dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_key=t.ck)
    idx3 = npu_lightning_indexer(t.q3, t.k3, t.w3, sparse_count=4, layout_query="TND", layout_key="TND", **tnd)[0]
    yield Sample((t.q3, t.k3, randn(6, 1, 4, dtype=dtype, seed=15), idx3, t.w3),
                 dict(layout="TND", sparse_mode=0, **tnd))


def _sfa_samples(dtype):
    t = _dsa_inputs(dtype)
    # with the lse, not paged: the differentiable form (opcheck traces its grad op too)
    yield Sample((t.sq4, t.sk4, t.sk4, t.si4, 0.5), dict(query_rope=t.sqr4, key_rope=t.skr4, return_softmax_lse=True,
                                                       attention_mode=2), grad_args=(0, 1, 2, "query_rope", "key_rope"))
    yield Sample((t.sq4, t.sk4, t.sk4, t.si4, 0.5), dict(sparse_block_size=2, sparse_mode=0))
    yield Sample((t.sq3, t.sk3, t.sk3, t.si3, 0.5), dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_kv=t.ck,
                                                       layout_query="TND", layout_kv="TND", return_softmax_lse=True),
                 grad_args=(0, 1, 2))
    yield Sample((t.sq3, t.spaged, t.spaged, t.si3, 0.5),
                 dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_kv=t.lens_k, block_table=t.table,
                      layout_query="TND", layout_kv="PA_BSND"))


def _sfa_grad_args(q, k, v, idx, scale, dtype, sparse_block_size=1, **kwargs):
    """Positional arguments of npu_sparse_flash_attention_grad, from a forward with the lse."""
    out, smax, ssum = npu_sparse_flash_attention(q, k, v, idx, scale, sparse_block_size=sparse_block_size,
                                                 return_softmax_lse=True, **kwargs)
    return q, k, v, idx, randn(*out.shape, seed=9, dtype=dtype), out, smax, ssum, scale, sparse_block_size


def _sfa_grad_samples(dtype):
    t = _dsa_inputs(dtype)
    rope = dict(query_rope=t.sqr4, key_rope=t.skr4, attention_mode=2)
    yield Sample(_sfa_grad_args(t.sq4, t.sk4, t.sk4, t.si4, 0.5, dtype, **rope), rope)
    tnd = dict(actual_seq_lengths_query=t.cq, actual_seq_lengths_kv=t.ck)
    yield Sample(_sfa_grad_args(t.sq3, t.sk3, None, t.si3, 0.5, dtype, layout_query="TND", layout_kv="TND",
                                sparse_block_size=2, **tnd),
                 dict(actual_seq_qlen=t.cq, actual_seq_kvlen=t.ck, layout="TND", sparse_mode=0))


def _l1_norm_metadata_samples(dtype):
    t = _dsa_inputs(torch.float32)
    yield Sample((4, 1, 16), dict(batch_size=2, max_seqlen_q=3, max_seqlen_k=5))
    yield Sample((4, 1, 16), dict(cu_seqlens_q=t.cu_q, cu_seqlens_k=t.cu_k, layout_q="TND", layout_k="TND",
                                  mask_mode=3))


def _l1_norm_samples(dtype):
    t = _dsa_inputs(dtype)
    meta4 = sparse_flash_mla_softmax_l1_norm_metadata(4, 1, 16, batch_size=2, max_seqlen_q=3, max_seqlen_k=5)
    meta3 = sparse_flash_mla_softmax_l1_norm_metadata(4, 1, 16, cu_seqlens_q=t.cu_q, cu_seqlens_k=t.cu_k,
                                                      layout_q="TND", layout_k="TND")
    lse4, lse3 = torch.zeros(2, 1, 3, 4), torch.zeros(1, 6, 4)
    tnd = dict(metadata=meta3, cu_seqlens_q=t.cu_q, cu_seqlens_k=t.cu_k, layout_q="TND", layout_k="TND")
    yield Sample((t.sq4, t.sk4, lse4), dict(metadata=meta4, softmax_scale=0.25, mask_mode=3))
    yield Sample((t.sq4, t.sk4, lse4), dict(metadata=meta4, sparse_indices=t.si4))
    yield Sample((t.sq3, t.sk3, lse3), dict(max_seqlen_k=6, **tnd))
    yield Sample((t.sq3, t.sk3, lse3), dict(sparse_indices=t.si3, mask_mode=3, **tnd))


def v4_attention_inputs(kind, dtype=torch.float64, b=2, s=18, h=4, d=16, window=8, seed=0):
    """DeepSeek-V4 attention inputs of one kind ("swa", "csa", "hca"): q (B, H, S, D), ori / cmp
    kv (B, 1, S or T, D), sinks (H,), and for CSA the indexer's top-3 compressed blocks (-1 past
    the causally visible ones)."""
    g = torch.Generator().manual_seed(seed)
    ratio = {"swa": 1, "csa": 4, "hca": 8}[kind]
    t = s // ratio if kind != "swa" else 0
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dtype)
    ori = torch.randn(b, 1, s, d, generator=g, dtype=torch.float64).to(dtype)
    cmp = torch.randn(b, 1, t, d, generator=g, dtype=torch.float64).to(dtype)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    indices = None
    if kind == "csa":  # what the V4 indexer returns: top-3 of the causally visible blocks, -1 past them
        k = 3
        visible = (torch.arange(s) + 1) // ratio
        perm = torch.stack([torch.randperm(t, generator=g) for _ in range(b * s)]).view(b, s, t)
        order = torch.where(perm < visible.view(1, s, 1), perm, t + perm)  # visible ids first
        chosen = order.sort(-1).values[..., :k]
        indices = torch.where(chosen < t, chosen, -1)
    return SimpleNamespace(q=q, ori=ori, cmp=cmp, sinks=sinks, indices=indices, ratio=ratio, t=t, s=s,
                           window=window, scale=d ** -0.5, residual=s - t * ratio)


def smla_kwargs(x, **overrides):
    """sparse_flash_mla's keyword arguments for v4_attention_inputs(...) (BSND kv)."""
    kwargs = dict(ori_kv=x.ori.transpose(1, 2), sinks=x.sinks.float() if x.q.dtype != torch.float64 else x.sinks,
                  softmax_scale=x.scale, cmp_ratio=x.ratio, ori_mask_mode=4, cmp_mask_mode=3,
                  ori_win_left=x.window - 1, ori_win_right=0)
    if x.t:
        kwargs.update(cmp_kv=x.cmp.transpose(1, 2),
                      cmp_residual_kv=torch.full((x.q.shape[0],), x.residual, dtype=torch.int32))
    if x.indices is not None:
        kwargs["cmp_sparse_indices"] = x.indices.to(torch.int32).unsqueeze(2)
    kwargs.update(overrides)
    return kwargs


def _smla_samples(dtype):
    for kind in ("swa", "csa", "hca"):
        x = v4_attention_inputs(kind, dtype=dtype, s=10, window=4)
        yield Sample((x.q.transpose(1, 2).contiguous(),), dict(smla_kwargs(x), return_softmax_lse=kind != "hca"))


def _smla_grad_samples(dtype):
    for kind in ("swa", "csa"):
        x = v4_attention_inputs(kind, dtype=dtype, s=10, window=4)
        q = x.q.transpose(1, 2).contiguous()
        out, lse = sparse_flash_mla(q, **smla_kwargs(x), return_softmax_lse=True)
        kwargs = smla_kwargs(x)
        ori, cmp, indices = kwargs.pop("ori_kv"), kwargs.pop("cmp_kv", None), kwargs.pop("cmp_sparse_indices", None)
        yield Sample((q, randn(*out.shape, dtype=dtype, seed=16), out, lse, ori, cmp, None, indices), kwargs)


def _smla_metadata_samples(dtype):
    yield Sample((4, 1, 16), dict(batch_size=2, max_seqlen_q=10, cmp_ratio=8, ori_mask_mode=4, cmp_mask_mode=3,
                                  ori_win_left=3, ori_win_right=0, layout_q="BSND", layout_kv="BSND"))
    yield Sample((4, 1, 16), dict(batch_size=2, max_seqlen_q=10))


def _cann_indexer_inputs(dtype, b=2, s=18, h=4, d=16, ratio=4, seed=7):
    """V4's indexer after its projections: q (B, S, H, D), compressed k (B, S / ratio, 1, D), weights
    (B, S, H) fp32, the pre-compression residual per batch."""
    t = s // ratio
    return (randn(b, s, h, d, dtype=dtype, seed=seed), randn(b, t, 1, d, dtype=dtype, seed=seed + 1),
            randn(b, s, h, dtype=torch.float32, seed=seed + 2), torch.full((b,), s % ratio, dtype=torch.int32))


def _cann_indexer_samples(dtype):
    q, k, w, residual = _cann_indexer_inputs(dtype)
    yield Sample((q, k, w, 3), dict(mask_mode=3, cmp_ratio=4, cmp_residual_k=residual, return_value=1))
    yield Sample((q, k, w, 2), dict(mask_mode=3))  # cmp_ratio 1: the right-down causal mask


def _cann_indexer_metadata_samples(dtype):
    yield Sample((4, 1, 16, 3), dict(batch_size=2, max_seqlen_q=18, mask_mode=3, cmp_ratio=4))
    yield Sample((4, 1, 16, 2), dict())


# =====================================================================================
# npu_lightning_indexer
# =====================================================================================
def _check_indexer(query, key, weights, block_table, layout_query, layout_key, sparse_count, sparse_mode,
                   pre_tokens, next_tokens) -> int:
    """Validate; return N2 (key heads)."""
    op = "npu_lightning_indexer"
    _check_layouts(op, layout_query, layout_key, "layout_key")
    _check_rank(op, "query", query, layout_query)
    _check_rank(op, "key", key, "BSND" if layout_key == "PA_BSND" else layout_key)
    _check_float_pair(op, "query", query, "key", key)
    if not weights.dtype.is_floating_point or _shape(weights) != _shape(query)[:-1]:
        raise RuntimeError(f"{op}: weights must be floating point of shape {_shape(query)[:-1]} (query "
                           f"without D), got {weights.dtype} {_shape(weights)}")
    if key.shape[-1] != query.shape[-1]:
        raise RuntimeError(f"{op}: query and key head dims differ: {query.shape[-1]} and {key.shape[-1]}")
    _check_heads(op, query.shape[-2], key.shape[-2])
    if layout_key == "PA_BSND" and block_table is None:
        raise RuntimeError(f"{op}: paged keys (PA_BSND) need block_table")
    if sparse_count <= 0:
        raise RuntimeError(f"{op}: sparse_count must be > 0, got {sparse_count}")
    if sparse_mode not in (0, 3):
        raise RuntimeError(f"{op}: sparse_mode must be 0 (no mask) or 3 (right-down causal), got {sparse_mode}")
    _check_default_tokens(op, pre_tokens, next_tokens)
    return key.shape[-2]


def _indexer_out_shape(query, n2, sparse_count, layout_query) -> tuple:
    if layout_query == "BSND":
        return (query.shape[0], query.shape[1], n2, sparse_count)
    return (query.shape[0], n2, sparse_count)


def _lightning_indexer_fake(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                            sparse_mode=3, pre_tokens=_I64_MAX, next_tokens=_I64_MAX, return_value=False):
    n2 = _check_indexer(query, key, weights, block_table, layout_query, layout_key, sparse_count, sparse_mode,
                        pre_tokens, next_tokens)
    shape = _indexer_out_shape(query, n2, sparse_count, layout_query)
    values = query.new_empty(shape) if return_value else query.new_empty((0,))
    return query.new_empty(shape, dtype=torch.int32), values


def _lightning_indexer_setup_context(ctx, inputs, keyword_only_inputs, output):
    query, key, weights = inputs
    ctx.save_for_backward(query, key, weights, output[0], keyword_only_inputs["actual_seq_lengths_query"],
                          keyword_only_inputs["actual_seq_lengths_key"])
    for name in ("layout_query", "layout_key", "sparse_mode", "pre_tokens", "next_tokens", "return_value"):
        setattr(ctx, name, keyword_only_inputs[name])


def _lightning_indexer_backward(ctx, grad_indices, grad_values):
    # torch_npu (derivatives.yaml, NpuLightningIndexerBackward0): output_differentiability
    # [false, true], i.e. only sparse_values, and
    #   npu_lightning_indexer_grad(query, key, grad, result0, weights, actual_seq_lengths_query,
    #                              actual_seq_lengths_key, layout_query, sparse_mode, pre_tokens,
    #                              next_tokens)
    op = "npu_lightning_indexer"
    if not ctx.return_value:
        raise RuntimeError(f"{op}: it is differentiable only through sparse_values, which it returns only with "
                           "return_value=True (torch_npu's npu_lightning_indexer_grad reads their gradient); "
                           "this call had return_value=False, so there is nothing to differentiate")
    if ctx.layout_key == "PA_BSND":
        raise RuntimeError(f"{op}: npu_lightning_indexer_grad takes one layout for query and key; paged keys "
                           "(PA_BSND) have no backward (return_value is not supported with them either)")
    if grad_values is None:
        return None, None, None
    query, key, weights, indices, lengths_query, lengths_key = ctx.saved_tensors
    grad_query, grad_key, grad_weights = torch.ops.npu.npu_lightning_indexer_grad(
        query, key, grad_values, indices, weights, lengths_query, lengths_key, ctx.layout_query, ctx.sparse_mode,
        ctx.pre_tokens, ctx.next_tokens)
    return grad_query, grad_key, grad_weights


@op_spec("npu::npu_lightning_indexer",
         schema="npu_lightning_indexer(Tensor query, Tensor key, Tensor weights, *, Tensor? "
                "actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str "
                'layout_query="BSND", str layout_key="BSND", int sparse_count=2048, int sparse_mode=3, int '
                "pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, bool return_value=False) -> "
                "(Tensor, Tensor)",
         fake=_lightning_indexer_fake, samples=_indexer_samples,
         backward=_lightning_indexer_backward, setup_context=_lightning_indexer_setup_context,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),  # query and key, one dtype
             min_rank=3,  # TND
             max_rank=4,  # BSND
             # through sparse_values only (output_differentiability [false, true]), so the
             # forward needs return_value=True (the stand-in's backward raises otherwise).
             # transformers' indexer runs under no_grad and returns only the indices: the
             # pass emits return_value=False, in training graphs too (matched on the joint
             # graph, forward_forms_on_joint), and never its backward
             backward="npu.npu_lightning_indexer_grad",
             ge_converter=True,  # custom/lightning_indexer.py -> GE LightningIndexer
             socs={
                 "Ascend310P": SocLimits(supported=False),
                 # Atlas 350 (950): weights fp16/bf16 only, N1 in {8, 16, 24, 32, 64}
                 "Ascend950": SocLimits(),
             },
             limits={
                 "head_dim": 128,  # query and key D
                 "max_query_heads": 64,  # N1 <= 64
                 "query_heads_950": (8, 16, 24, 32, 64),
                 "key_heads": 1,  # N2
                 "layouts_query": ("BSND", "TND"),
                 "layouts_key": ("BSND", "TND", "PA_BSND"),  # key layout = query layout unless paged
                 "pa_block_size_multiple": 16,  # PA_BSND block_size: a multiple of 16, <= 1024
                 "pa_max_block_size": 1024,
                 "max_sparse_count": 2048,  # sparse_count in [1, 2048] or one of:
                 "large_sparse_counts": (3072, 4096, 5120, 6144, 7168, 8192),
                 "sparse_modes": (0, 3),  # none, right-down causal
                 "pre_next_tokens_default_only": True,
                 "weights_dtypes": (torch.float16, torch.bfloat16, torch.float32),  # fp32: not on 950
                 "weights_fp32_socs": ("Ascend910B", "Ascend910_93"),
                 # return_value: training only and not with paged keys; in graph mode only on 950
                 "return_value_with_paged_key": False,
                 "return_value_graph_socs": ("Ascend950",),
                 "actual_seq_lengths_dtype": torch.int32,  # TND: cumulative; PA_BSND key: per batch, required
             },
             doc="op_semantics 8.1 / op-plugin doc torch_npu-npu_lightning_indexer.md: products Atlas A2 and "
             "A3 inference, Atlas 350 (950); query/key fp16/bf16 (one dtype), weights fp16/bf16 or fp32 "
             "(not on 950), D == 128, N1 <= 64 (950: 8/16/24/32/64), N2 == 1, PA block_size % 16 == 0 and "
             "<= 1024, sparse_count in [1, 2048] or 3072..8192 step 1024, sparse_mode 0/3, default "
             "pre/next_tokens only, return_value not with PA_BSND; GE converter custom/lightning_indexer.py; "
             "autograd NpuLightningIndexerBackward0 through sparse_values",
         ))
def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                          sparse_mode=3, pre_tokens=_I64_MAX, next_tokens=_I64_MAX, return_value=False):
    # op_semantics 8.1 and the op-plugin doc formula: for query row i and key j (of one key head)
    #   score[i, j] = sum_h weights[i, h] * relu(query[i, h] . key[j])     (fp32, no scale)
    # sparse_indices = the top sparse_count key positions, descending by score, batch-local;
    # slots past the batch's (causally visible) keys are -1 and their values -inf
    # [inferred: the kernel's sort buffer starts as (-inf, -1) pairs, lightning_indexer
    # service vector InitSortOutBuf]. The order within the top-k is not specified by the
    # docs (the vendor test compares sorted rows): ties go to the lower key here. Query rows
    # past a batch's length are all -1 (the kernel's CleanInvalidOutput).
    n2 = _check_indexer(query, key, weights, block_table, layout_query, layout_key, sparse_count, sparse_mode,
                        pre_tokens, next_tokens)
    op = "npu_lightning_indexer"
    n1, d = query.shape[-2], query.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(query)
    batches = _batches(op, query, layout_query, actual_seq_lengths_query, "actual_seq_lengths_query",
                       key, layout_key, actual_seq_lengths_key, "actual_seq_lengths_key", block_table)
    q_flat, w_flat, k_flat = query.reshape(-1, n1, d), weights.reshape(-1, n1), key.reshape(-1, n2, d)
    rows = q_flat.shape[0]
    indices = torch.full((rows, n2, sparse_count), -1, dtype=torch.int32, device=query.device)
    values = torch.full((rows, n2, sparse_count), float("-inf"), dtype=acc, device=query.device)
    for rs, lq, k_b, lk in batches:
        q = q_flat[rs].to(acc).view(lq, n2, g, d)
        w = w_flat[rs].to(acc).view(lq, n2, g)
        k = k_flat[k_b].to(acc)  # (lk, n2, d)
        score = (torch.einsum("sngd,tnd->sngt", q, k).relu() * w.unsqueeze(-1)).sum(2)  # (lq, n2, lk)
        if sparse_mode == 3:
            score = score.masked_fill(_causal_hidden(lq, lk).unsqueeze(1), float("-inf"))
        n = min(sparse_count, lk)
        vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)
        vals, idx = vals[..., :n], idx[..., :n]
        indices[rs, :, :n] = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
        values[rs, :, :n] = vals
    shape = _indexer_out_shape(query, n2, sparse_count, layout_query)
    sparse_values = values.to(query.dtype).view(shape) if return_value else query.new_empty((0,))
    return indices.view(shape), sparse_values


# =====================================================================================
# npu_lightning_indexer_grad
# =====================================================================================
def _grad_defaults(layout, sparse_mode, pre_tokens, next_tokens):
    """The grad ops' optional (`str?`, `int?`) arguments: None means the default."""
    return (layout or "BSND", 3 if sparse_mode is None else sparse_mode,
            _I64_MAX if pre_tokens is None else pre_tokens, _I64_MAX if next_tokens is None else next_tokens)


def _check_indexer_grad(query, key, dy, sparse_indices, weights, layout, sparse_mode, pre_tokens,
                        next_tokens) -> int:
    op = "npu_lightning_indexer_grad"
    n2 = _check_indexer(query, key, weights, None, layout, layout, sparse_indices.shape[-1], sparse_mode,
                        pre_tokens, next_tokens)
    expected = _indexer_out_shape(query, n2, sparse_indices.shape[-1], layout)
    if sparse_indices.dtype != torch.int32 or _shape(sparse_indices) != expected:
        raise RuntimeError(f"{op}: sparse_indices must be int32 of shape {expected} (the forward's indices), got "
                           f"{sparse_indices.dtype} {_shape(sparse_indices)}")
    if _shape(dy) != expected or not dy.dtype.is_floating_point:
        raise RuntimeError(f"{op}: dy (the gradient of sparse_values) must be floating point of shape {expected}, "
                           f"got {dy.dtype} {_shape(dy)}")
    return n2


def _lightning_indexer_grad_fake(query, key, dy, sparse_indices, weights, actual_seq_lengths_query=None,
                                 actual_seq_lengths_key=None, layout="BSND", sparse_mode=3, pre_tokens=_I64_MAX,
                                 next_tokens=_I64_MAX):
    layout, sparse_mode, pre_tokens, next_tokens = _grad_defaults(layout, sparse_mode, pre_tokens, next_tokens)
    _check_indexer_grad(query, key, dy, sparse_indices, weights, layout, sparse_mode, pre_tokens, next_tokens)
    # the wheel's Meta (npu_lightning_indexer_grad_meta): new_empty of each input's shape, contiguous
    return query.new_empty(query.shape), key.new_empty(key.shape), weights.new_empty(weights.shape)


@op_spec("npu::npu_lightning_indexer_grad",
         schema="npu_lightning_indexer_grad(Tensor query, Tensor key, Tensor dy, Tensor sparse_indices, Tensor weights,"
                ' Tensor? actual_seq_lengths_query=None, Tensor? actual_seq_lengths_key=None, str? layout="BSND", int? '
                "sparse_mode=3, int? pre_tokens=9223372036854775807, int? next_tokens=9223372036854775807) -> (Tensor, "
                "Tensor, Tensor)",
         fake=_lightning_indexer_grad_fake, samples=_indexer_grad_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),
             min_rank=3,  # TND
             max_rank=4,  # BSND
             backward=None,
             ge_converter=False,  # torchair 2.13 has no converter: not lowerable under max-autotune
             limits={"layouts": ("BSND", "TND")},  # one layout for query and key: no paged keys
             doc="op_semantics 1 / 8.1: npu_lightning_indexer's backward (NpuLightningIndexerBackward0), "
             "dquery, dkey, dweights from the gradient of sparse_values; BSND / TND (one layout); "
             "no GE converter in torchair 2.13",
         ))
def npu_lightning_indexer_grad(query, key, dy, sparse_indices, weights, actual_seq_lengths_query=None,
                               actual_seq_lengths_key=None, layout="BSND", sparse_mode=3, pre_tokens=_I64_MAX,
                               next_tokens=_I64_MAX):
    # op_semantics 8.1: the gradient of sparse_values[i, n, s] = sum_h w[i, h] relu(q[i, h] . k[j])
    # (h over the G query heads of key head n, j = sparse_indices[i, n, s]):
    #   dweights[i, h] = sum_s dy[i, n, s] relu(q[i, h] . k[j])
    #   dquery[i, h]   = sum_s dy[i, n, s] w[i, h] 1[q[i, h] . k[j] > 0] k[j]
    #   dkey[j, n]    += sum_h dy[i, n, s] w[i, h] 1[q[i, h] . k[j] > 0] q[i, h]
    # over the valid slots: an index >= 0 naming a key of the batch (and, sparse_mode 3, one
    # the causal mask lets through: the forward lists no other); -1 slots (value -inf) have
    # none. Query rows and keys past the batches' lengths get 0. One layout for query and
    # key (BSND / TND: no paged keys); lengths as in the forward (TND: cumulative). fp32
    # accumulation, rounded once to each input's dtype (the wheel's Meta: dweights in
    # weights' dtype).
    layout, sparse_mode, pre_tokens, next_tokens = _grad_defaults(layout, sparse_mode, pre_tokens, next_tokens)
    n2 = _check_indexer_grad(query, key, dy, sparse_indices, weights, layout, sparse_mode, pre_tokens, next_tokens)
    op = "npu_lightning_indexer_grad"
    n1, d, count = query.shape[-2], query.shape[-1], sparse_indices.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(query)
    batches = _batches(op, query, layout, actual_seq_lengths_query, "actual_seq_lengths_query",
                       key, layout, actual_seq_lengths_key, "actual_seq_lengths_key")
    q_flat, w_flat, k_flat = query.reshape(-1, n1, d), weights.reshape(-1, n1), key.reshape(-1, n2, d)
    idx_flat, dy_flat = sparse_indices.reshape(-1, n2, count), dy.reshape(-1, n2, count)
    grad_q = torch.zeros((q_flat.shape[0], n2, g, d), dtype=acc, device=query.device)
    grad_w = torch.zeros((q_flat.shape[0], n2, g), dtype=acc, device=query.device)
    grad_k = torch.zeros(k_flat.shape, dtype=acc, device=query.device)
    heads = torch.arange(n2).view(1, n2, 1)
    for rs, lq, k_b, lk in batches:
        slots = idx_flat[rs].long()  # (lq, n2, K)
        valid = (slots >= 0) & (slots < lk)
        if sparse_mode == 3:
            valid &= slots <= (lk - lq) + torch.arange(lq).view(lq, 1, 1)
        rows_kv = k_b[slots.clamp(0, lk - 1)]  # (lq, n2, K)
        k_sel = k_flat[rows_kv, heads].to(acc)  # (lq, n2, K, d)
        q = q_flat[rs].to(acc).view(lq, n2, g, d)
        w = w_flat[rs].to(acc).view(lq, n2, g)
        dots = torch.einsum("ingd,inkd->ingk", q, k_sel)
        grad_v = torch.where(valid, dy_flat[rs].to(acc), torch.zeros((), dtype=acc))  # (lq, n2, K)
        grad_w[rs] = torch.einsum("ink,ingk->ing", grad_v, dots.relu())
        grad_dots = grad_v.unsqueeze(2) * w.unsqueeze(-1) * (dots > 0)  # (lq, n2, g, K)
        grad_q[rs] = torch.einsum("ingk,inkd->ingd", grad_dots, k_sel)
        grad_k.index_put_((rows_kv, heads.expand_as(rows_kv)), torch.einsum("ingk,ingd->inkd", grad_dots, q),
                          accumulate=True)
    return (grad_q.to(query.dtype).view(query.shape), grad_k.to(key.dtype).view(key.shape),
            grad_w.to(weights.dtype).view(weights.shape))


# =====================================================================================
# npu_sparse_flash_attention
# =====================================================================================
def _check_sfa(query, key, value, sparse_indices, block_table, query_rope, key_rope, sparse_block_size,
               layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode,
               return_softmax_lse, sinks, op="npu_sparse_flash_attention") -> int:
    """Validate; return N2 (key/value heads)."""
    _check_layouts(op, layout_query, layout_kv, "layout_kv")
    kv_layout = "BSND" if layout_kv == "PA_BSND" else layout_kv
    _check_rank(op, "query", query, layout_query)
    _check_rank(op, "key", key, kv_layout)
    _check_float_pair(op, "query", query, "key", key)
    if value is not None:
        _check_float_pair(op, "query", query, "value", value)
        if _shape(value) != _shape(key):
            raise RuntimeError(f"{op}: value must have key's shape {_shape(key)}, got {_shape(value)}")
    if key.shape[-1] != query.shape[-1]:
        raise RuntimeError(f"{op}: query, key and value head dims must be equal (the output has query's "
                           f"shape), got {query.shape[-1]} and {key.shape[-1]}")
    n1, n2 = query.shape[-2], key.shape[-2]
    _check_heads(op, n1, n2)
    if (query_rope is None) != (key_rope is None):
        raise RuntimeError(f"{op}: query_rope and key_rope go together")
    if query_rope is not None:
        _check_float_pair(op, "query", query, "query_rope", query_rope)
        _check_float_pair(op, "key", key, "key_rope", key_rope)
        if _shape(query_rope)[:-1] != _shape(query)[:-1] or _shape(key_rope)[:-1] != _shape(key)[:-1] \
                or query_rope.shape[-1] != key_rope.shape[-1]:
            raise RuntimeError(f"{op}: query_rope must be query's shape and key_rope key's shape but for a "
                               f"common rope dim, got {_shape(query_rope)} for {_shape(query)} and "
                               f"{_shape(key_rope)} for {_shape(key)}")
    if sparse_indices.dtype != torch.int32:
        raise RuntimeError(f"{op}: sparse_indices must be int32, got {sparse_indices.dtype}")
    expected = _shape(query)[:-2] + (n2,)
    if _shape(sparse_indices)[:-1] != expected or sparse_indices.dim() != len(expected) + 1 \
            or sparse_indices.shape[-1] <= 0:
        lead = "B, S1" if layout_query == "BSND" else "T1"
        raise RuntimeError(f"{op}: sparse_indices must be ({lead}, N2, K) = {expected + ('K',)} with K > 0, "
                           f"got {_shape(sparse_indices)}")
    if query.numel() == 0 or key.numel() == 0:
        raise RuntimeError(f"{op}: query and key must not be empty")
    if sparse_block_size < 1:
        raise RuntimeError(f"{op}: sparse_block_size must be >= 1, got {sparse_block_size}")
    if sparse_mode not in (0, 3):
        raise RuntimeError(f"{op}: sparse_mode must be 0 (selection only) or 3 (right-down causal), "
                           f"got {sparse_mode}")
    if attention_mode not in (0, 2):
        raise RuntimeError(f"{op}: attention_mode must be 0 or 2 (MLA absorb), got {attention_mode}")
    _check_default_tokens(op, pre_tokens, next_tokens)
    if layout_kv == "PA_BSND" and block_table is None:
        raise RuntimeError(f"{op}: paged keys (PA_BSND) need block_table")
    if return_softmax_lse and layout_kv == "PA_BSND":
        raise RuntimeError(f"{op}: return_softmax_lse is not supported with paged keys (PA_BSND)")
    if sinks is not None:
        raise NotImplementedError(f"{op}: sinks (Ascend 950, aclnnSparseFlashAttentionV2) are undocumented "
                                  "(op_semantics 11.3): no CPU reference")
    return n2


def _sfa_lse_shape(query, n2, layout_query) -> tuple:
    g = query.shape[-2] // n2
    if layout_query == "BSND":
        return (query.shape[0], n2, query.shape[1], g)
    return (n2, query.shape[0], g)


def _sparse_flash_attention_fake(query, key, value, sparse_indices, scale_value, *, block_table=None,
                                 actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                 key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                 sparse_mode=3, pre_tokens=_I64_MAX, next_tokens=_I64_MAX, attention_mode=0,
                                 return_softmax_lse=False, sinks=None):
    n2 = _check_sfa(query, key, value, sparse_indices, block_table, query_rope, key_rope, sparse_block_size,
                    layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode,
                    return_softmax_lse, sinks)
    lse_shape = _sfa_lse_shape(query, n2, layout_query) if return_softmax_lse else (0,)
    return (query.new_empty(query.shape), query.new_empty(lse_shape, dtype=torch.float32),
            query.new_empty(lse_shape, dtype=torch.float32))


_SFA_SAVED = ("scale_value", "sparse_block_size", "layout_query", "layout_kv", "sparse_mode", "pre_tokens",
              "next_tokens", "attention_mode", "return_softmax_lse")


def _sparse_flash_attention_setup_context(ctx, inputs, keyword_only_inputs, output):
    query, key, value, sparse_indices, scale_value = inputs
    kw = keyword_only_inputs
    ctx.mark_non_differentiable(output[1], output[2])  # softmax_max / softmax_sum
    ctx.save_for_backward(query, key, value, sparse_indices, output[0], output[1], output[2], kw["query_rope"],
                          kw["key_rope"], kw["actual_seq_lengths_query"], kw["actual_seq_lengths_kv"])
    ctx.scale_value = scale_value
    for name in _SFA_SAVED[1:]:
        setattr(ctx, name, kw[name])


def _sparse_flash_attention_backward(ctx, grad_out, grad_max, grad_sum):
    # torch_npu (derivatives.yaml, NpuSparseFlashAttentionBackward0), output 0 only:
    #   npu_sparse_flash_attention_grad(query, key, value, sparse_indices, grad, result0, result1,
    #       result2, scale_value, sparse_block_size, query_rope, key_rope, actual_seq_lengths_query,
    #       actual_seq_lengths_kv, layout_query, sparse_mode, pre_tokens, next_tokens, attention_mode)
    # -> gradients of query, key, value, query_rope, key_rope; sinks has none.
    # Returns the positional inputs' gradients, then query_rope's and key_rope's
    # (StandIn.differentiable_kwargs).
    op = "npu_sparse_flash_attention"
    if not ctx.return_softmax_lse:
        raise RuntimeError(f"{op}: its backward (npu_sparse_flash_attention_grad) needs softmax_max and "
                           "softmax_sum, which the forward returns only with return_softmax_lse=True; this call "
                           "had return_softmax_lse=False, so there is nothing to differentiate with")
    (query, key, value, sparse_indices, out, softmax_max, softmax_sum, query_rope, key_rope, lengths_query,
     lengths_kv) = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None
    grads = torch.ops.npu.npu_sparse_flash_attention_grad(
        query, key, value, sparse_indices, grad_out, out, softmax_max, softmax_sum, ctx.scale_value,
        ctx.sparse_block_size, query_rope, key_rope, lengths_query, lengths_kv, ctx.layout_query, ctx.sparse_mode,
        ctx.pre_tokens, ctx.next_tokens, ctx.attention_mode)
    grad_query, grad_key, grad_value, grad_query_rope, grad_key_rope = grads
    return (grad_query, grad_key, None if value is None else grad_value, None, None,
            None if query_rope is None else grad_query_rope, None if key_rope is None else grad_key_rope)


@op_spec("npu::npu_sparse_flash_attention",
         schema="npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, float "
                "scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, Tensor? "
                "actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, int sparse_block_size=1, "
                'str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, int pre_tokens=9223372036854775807, '
                "int next_tokens=9223372036854775807, int attention_mode=0, bool return_softmax_lse=False, Tensor? "
                "sinks=None) -> (Tensor, Tensor, Tensor)",
         fake=_sparse_flash_attention_fake, samples=_sfa_samples,
         backward=_sparse_flash_attention_backward, setup_context=_sparse_flash_attention_setup_context,
         differentiable_kwargs=("query_rope", "key_rope"),
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),  # query, key, value (and ropes), one dtype
             min_rank=3,  # TND
             max_rank=4,  # BSND
             # needs softmax_max/sum, i.e. return_softmax_lse=True (the stand-in's backward raises
             # otherwise): the joint replacement (training graphs) sets it, the forward-only one
             # (inference) does not. Grads of query, key, value, query_rope, key_rope; none for
             # sinks. Its grad op has no GE converter, and the docs refuse return_softmax_lse in
             # graph mode: joint sites are refused under max-autotune (read as GE graph mode;
             # ACL graph capture runs the aclnn kernels as single ops do [inferred])
             backward="npu.npu_sparse_flash_attention_grad",
             ge_converter=True,  # custom/sparse_flash_attention.py -> GE SparseFlashAttention
             socs={
                 "Ascend310P": SocLimits(supported=False),
                 # 950 per op_semantics 8.2 (N1 any of 1..128, sparse_block_size 1 only, sinks);
                 # the op-plugin master doc lists A2/A3 inference only
                 "Ascend950": SocLimits(),
             },
             limits={
                 "head_dim": 512,  # query, key, value D
                 "rope_head_dim": 64,  # query_rope, key_rope D
                 "query_heads": (1, 2, 4, 8, 16, 32, 64, 128),  # 950: any of 1..128
                 "max_query_heads_950": 128,
                 "key_heads": 1,  # KV_N
                 "layouts_query": ("BSND", "TND"),
                 "layouts_kv": ("BSND", "TND", "PA_BSND"),  # kv layout = query layout unless paged
                 "pa_block_size_multiple": 16,
                 "pa_max_block_size": 1024,
                 "max_sparse_block_size": 128,  # a power of 2 in [1, 128], dividing the PA block_size
                 "sparse_block_size_power_of_2": True,
                 "sparse_block_sizes_950": (1,),
                 "sparse_modes": (0, 3),
                 "attention_modes": (2,),  # the docs: only 2 (MLA absorb, key and value one tensor)
                 "pre_next_tokens_default_only": True,
                 # return_softmax_lse: training only, not with PA_BSND, not in graph mode
                 "return_softmax_lse_with_paged_kv": False,
                 "return_softmax_lse_in_graph": False,
                 "value_none_min_cann": "9.2.0",  # the wheel's Meta function
                 "sinks_socs": ("Ascend950",),  # undocumented semantics: no CPU reference
                 "sparse_indices_dtype": torch.int32,
             },
             doc="op_semantics 8.2 / op-plugin doc torch_npu-npu_sparse_flash_attention.md: products Atlas A2 "
             "and A3 inference (950 per op_semantics); query/key/value fp16/bf16 of one dtype, D == 512, rope "
             "D == 64, N1 a power of 2 <= 128, KV_N == 1, sparse_block_size a power of 2 in [1, 128] dividing "
             "the PA block_size (16k <= 1024), sparse_mode 0/3, attention_mode 2, default pre/next_tokens, "
             "return_softmax_lse not with PA_BSND nor in graph mode; value=None needs CANN >= 9.2 (Meta); "
             "GE converter custom/sparse_flash_attention.py; autograd NpuSparseFlashAttentionBackward0",
         ))
def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=_I64_MAX, next_tokens=_I64_MAX, attention_mode=0,
                               return_softmax_lse=False, sinks=None):
    # op_semantics 8.2, the op-plugin doc and the sgl-kernel-npu golden. For query row i,
    # query head h (key head n = h // G):
    #   selected positions: for each listed block s (up to the first negative), the keys
    #     [s*bs, min((s+1)*bs, Lkv)); sparse_mode 3 drops those with j > (Lkv - Lq) + i
    #   scores  = ([query, query_rope]_h . [key, key_rope]_j) * scale_value   (MLA absorb:
    #             the nope and rope parts are concatenated on D; no rope: query . key)
    #   out     = softmax(scores) @ value[selected]  (value None: key, CANN >= 9.2 [inferred])
    #   softmax_max = max(scores), softmax_sum = sum(exp(scores - max)): lse = max + log(sum)
    # A position listed twice counts twice (the golden concatenates the blocks). A row with no
    # selected position (all -1, causally empty, padding rows) gets out = 0 (the kernel
    # zero-fills those), softmax_max = -2e38 and softmax_sum = 0 (the kernel's softmax
    # defaults) [inferred for the training (lse) kernel, not read]. fp32 throughout, rounded
    # once: the kernel's cast of the probabilities to the KV dtype before P @ V and its AMLA
    # rescaling are not replicated (they move the output by about one bf16 ulp of P).
    n2 = _check_sfa(query, key, value, sparse_indices, block_table, query_rope, key_rope, sparse_block_size,
                    layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode,
                    return_softmax_lse, sinks)
    op = "npu_sparse_flash_attention"
    n1, d = query.shape[-2], query.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(query)
    batches = _batches(op, query, layout_query, actual_seq_lengths_query, "actual_seq_lengths_query",
                       key, layout_kv, actual_seq_lengths_kv, "actual_seq_lengths_kv", block_table)
    value = key if value is None else value
    q_flat = query.reshape(-1, n1, d)
    k_flat, v_flat = key.reshape(-1, n2, d), value.reshape(-1, n2, d)
    qr_flat = kr_flat = None
    if query_rope is not None:
        qr_flat = query_rope.reshape(-1, n1, query_rope.shape[-1])
        kr_flat = key_rope.reshape(-1, n2, key_rope.shape[-1])
    idx_flat = sparse_indices.reshape(-1, n2, sparse_indices.shape[-1])
    rows = q_flat.shape[0]
    out = torch.zeros((rows, n2, g, d), dtype=acc, device=query.device)
    smax = torch.full((rows, n2, g), _SOFTMAX_MIN, dtype=torch.float32, device=query.device)
    ssum = torch.zeros((rows, n2, g), dtype=torch.float32, device=query.device)
    within_block = torch.arange(sparse_block_size)
    heads = torch.arange(n2).view(1, n2, 1)
    for rs, lq, k_b, lk in batches:
        blocks = idx_flat[rs].long()  # (lq, n2, K)
        listed = (blocks >= 0).long().cumprod(-1).bool()  # before the first negative
        pos = blocks.unsqueeze(-1) * sparse_block_size + within_block  # (lq, n2, K, bs)
        valid = listed.unsqueeze(-1) & (pos >= 0) & (pos < lk)
        if sparse_mode == 3:
            valid &= pos <= (lk - lq) + torch.arange(lq).view(lq, 1, 1, 1)
        pos, valid = pos.flatten(2).clamp(0, lk - 1), valid.flatten(2)  # (lq, n2, P)
        # gather per (row, key head): sel[i, n, p] = kv of batch key pos[i, n, p], head n
        rows_kv = k_b[pos]
        k_sel = k_flat[rows_kv, heads].to(acc)  # (lq, n2, P, d)
        v_sel = v_flat[rows_kv, heads].to(acc)
        q = q_flat[rs].to(acc).view(lq, n2, g, d)
        scores = torch.einsum("ingd,inpd->ingp", q, k_sel)
        if qr_flat is not None:
            qr = qr_flat[rs].to(acc).view(lq, n2, g, -1)
            scores = scores + torch.einsum("ingd,inpd->ingp", qr, kr_flat[rows_kv, heads].to(acc))
        scores = (scores * scale_value).masked_fill(~valid.unsqueeze(2), float("-inf"))
        some = valid.any(-1).unsqueeze(-1)  # (lq, n2, 1)
        m = torch.where(some, scores.amax(-1), torch.zeros((), dtype=acc))
        e = torch.exp(scores - m.unsqueeze(-1))  # masked: exp(-inf) = 0
        s = e.sum(-1)
        o = torch.einsum("ingp,inpd->ingd", e, v_sel) / torch.where(some, s, torch.ones((), dtype=acc)).unsqueeze(-1)
        out[rs] = torch.where(some.unsqueeze(-1), o, torch.zeros((), dtype=acc))
        smax[rs] = torch.where(some, m, torch.tensor(_SOFTMAX_MIN, dtype=acc)).float()
        ssum[rs] = torch.where(some, s, torch.zeros((), dtype=acc)).float()
    attention_out = out.to(query.dtype).view(query.shape)
    if not return_softmax_lse:
        empty = query.new_empty((0,), dtype=torch.float32)
        return attention_out, empty, empty.clone()
    if layout_query == "BSND":  # (B, S1, N2, G) -> (B, N2, S1, G)
        b, s1 = query.shape[0], query.shape[1]
        smax, ssum = (t.view(b, s1, n2, g).transpose(1, 2).contiguous() for t in (smax, ssum))
    else:  # (T1, N2, G) -> (N2, T1, G)
        smax, ssum = smax.transpose(0, 1).contiguous(), ssum.transpose(0, 1).contiguous()
    return attention_out, smax, ssum


# =====================================================================================
# npu_sparse_flash_attention_grad
# =====================================================================================
def _check_sfa_grad(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, sparse_block_size,
                    query_rope, key_rope, layout, sparse_mode, pre_tokens, next_tokens, attention_mode) -> int:
    op = "npu_sparse_flash_attention_grad"
    if layout not in LAYOUTS:  # one layout for query and kv: no paged keys (the forward has no lse there)
        raise RuntimeError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    n2 = _check_sfa(query, key, value, sparse_indices, None, query_rope, key_rope, sparse_block_size, layout,
                    layout, sparse_mode, pre_tokens, next_tokens, attention_mode, True, None, op=op)
    for name, t in (("d_out", d_out), ("out", out)):
        if _shape(t) != _shape(query) or not t.dtype.is_floating_point:
            raise RuntimeError(f"{op}: {name} must be floating point of query's shape {_shape(query)}, got "
                               f"{t.dtype} {_shape(t)}")
    lse_shape = _sfa_lse_shape(query, n2, layout)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if _shape(t) != lse_shape or not t.dtype.is_floating_point:
            raise RuntimeError(f"{op}: {name} must be the forward's fp32 {lse_shape} (run it with "
                               f"return_softmax_lse=True), got {t.dtype} {_shape(t)}")
    return n2


def _sparse_flash_attention_grad_fake(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                                      scale_value, sparse_block_size, query_rope=None, key_rope=None,
                                      actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                      pre_tokens=_I64_MAX, next_tokens=_I64_MAX, attention_mode=0):
    layout, sparse_mode, pre_tokens, next_tokens = _grad_defaults(layout, sparse_mode, pre_tokens, next_tokens)
    _check_sfa_grad(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum, sparse_block_size,
                    query_rope, key_rope, layout, sparse_mode, pre_tokens, next_tokens,
                    0 if attention_mode is None else attention_mode)
    # the wheel's Meta (npu_sparse_flash_attention_grad_meta): new_empty of each input's shape
    # (contiguous), an empty (0,) for an absent one
    return (query.new_empty(query.shape), key.new_empty(key.shape),
            query.new_empty((0,)) if value is None else value.new_empty(value.shape),
            query.new_empty((0,)) if query_rope is None else query_rope.new_empty(query_rope.shape),
            key.new_empty((0,)) if key_rope is None else key_rope.new_empty(key_rope.shape))


@op_spec("npu::npu_sparse_flash_attention_grad",
         schema="npu_sparse_flash_attention_grad(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, Tensor"
                " d_out, Tensor out, Tensor softmax_max, Tensor softmax_sum, float scale_value, int sparse_block_size, "
                "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? actual_seq_qlen=None, Tensor? "
                'actual_seq_kvlen=None, str? layout="BSND", int? sparse_mode=3, int? pre_tokens=9223372036854775807, '
                "int? next_tokens=9223372036854775807, int? attention_mode=0) -> (Tensor, Tensor, Tensor, Tensor, "
                "Tensor)",
         fake=_sparse_flash_attention_grad_fake, samples=_sfa_grad_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),
             min_rank=3,  # TND
             max_rank=4,  # BSND
             backward=None,
             ge_converter=False,  # torchair 2.13 has no converter: not lowerable under max-autotune
             limits={"layouts": ("BSND", "TND")},  # one layout for query and kv: no paged kv
             doc="op_semantics 1 / 8.2: npu_sparse_flash_attention's backward "
             "(NpuSparseFlashAttentionBackward0), from out and softmax_max / softmax_sum "
             "(return_softmax_lse=True); grads of query, key, value, query_rope, key_rope; BSND / TND (one "
             "layout); no GE converter in torchair 2.13",
         ))
def npu_sparse_flash_attention_grad(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                                    scale_value, sparse_block_size, query_rope=None, key_rope=None,
                                    actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                    pre_tokens=_I64_MAX, next_tokens=_I64_MAX, attention_mode=0):
    # The flash-attention backward over the forward's selection (the same positions: block ids
    # up to the first negative, cut at the batch's keys, sparse_mode 3's right-down mask), from
    # the forward's out and softmax_max / softmax_sum (the kernel recomputes P from them, it
    # does not redo the max/sum): for query row i, query head h (key head n = h // G) and
    # selected position p (key j):
    #   s_p  = scale * ([query, query_rope]_h . [key, key_rope]_j)
    #   P_p  = exp(s_p - softmax_max) / softmax_sum
    #   dP_p = d_out_h . value_j          D = d_out_h . out_h   (out as the forward rounded it)
    #   dS_p = P_p * (dP_p - D)
    #   dquery_h  = scale * sum_p dS_p key_j      dquery_rope_h = scale * sum_p dS_p key_rope_j
    #   dkey_j   += scale * sum_h dS_p query_h    dkey_rope_j  += scale * sum_h dS_p query_rope_h
    #   dvalue_j += sum_h P_p d_out_h
    # A position listed twice contributes twice (as in the forward). Rows with no selected
    # position (softmax_sum 0), query rows and keys past the batches' lengths get 0. One
    # layout for query and kv (BSND / TND, lengths as in the forward: TND cumulative).
    # value None: the forward used key as the value, so key's gradient takes both parts and
    # d_value is the Meta's empty (0,) [inferred: CANN >= 9.2 only, undocumented]. fp32
    # accumulation, each gradient rounded once to its input's dtype.
    layout, sparse_mode, pre_tokens, next_tokens = _grad_defaults(layout, sparse_mode, pre_tokens, next_tokens)
    attention_mode = 0 if attention_mode is None else attention_mode
    n2 = _check_sfa_grad(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                         sparse_block_size, query_rope, key_rope, layout, sparse_mode, pre_tokens, next_tokens,
                         attention_mode)
    op = "npu_sparse_flash_attention_grad"
    n1, d = query.shape[-2], query.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(query)
    batches = _batches(op, query, layout, actual_seq_qlen, "actual_seq_qlen", key, layout, actual_seq_kvlen,
                       "actual_seq_kvlen")
    v_t = key if value is None else value
    q_flat, o_flat, do_flat = (t.reshape(-1, n1, d) for t in (query, out, d_out))
    k_flat, v_flat = key.reshape(-1, n2, d), v_t.reshape(-1, n2, d)
    rope = query_rope is not None
    if rope:
        qr_flat = query_rope.reshape(-1, n1, query_rope.shape[-1])
        kr_flat = key_rope.reshape(-1, n2, key_rope.shape[-1])
    if layout == "BSND":  # (B, N2, S1, G) -> rows (B * S1, N2, G)
        smax, ssum = (t.transpose(1, 2).reshape(-1, n2, g) for t in (softmax_max, softmax_sum))
    else:  # (N2, T1, G)
        smax, ssum = (t.transpose(0, 1).reshape(-1, n2, g) for t in (softmax_max, softmax_sum))
    idx_flat = sparse_indices.reshape(-1, n2, sparse_indices.shape[-1])
    rows = q_flat.shape[0]
    grad_q = torch.zeros((rows, n2, g, d), dtype=acc, device=query.device)
    grad_k = torch.zeros(k_flat.shape, dtype=acc, device=query.device)
    grad_v = torch.zeros(k_flat.shape, dtype=acc, device=query.device)
    if rope:
        grad_qr = torch.zeros((rows, n2, g, qr_flat.shape[-1]), dtype=acc, device=query.device)
        grad_kr = torch.zeros(kr_flat.shape, dtype=acc, device=query.device)
    within_block = torch.arange(sparse_block_size)
    heads = torch.arange(n2).view(1, n2, 1)
    zero = torch.zeros((), dtype=acc)
    for rs, lq, k_b, lk in batches:
        blocks = idx_flat[rs].long()  # (lq, n2, K)
        listed = (blocks >= 0).long().cumprod(-1).bool()
        pos = blocks.unsqueeze(-1) * sparse_block_size + within_block  # (lq, n2, K, bs)
        valid = listed.unsqueeze(-1) & (pos >= 0) & (pos < lk)
        if sparse_mode == 3:
            valid &= pos <= (lk - lq) + torch.arange(lq).view(lq, 1, 1, 1)
        pos, valid = pos.flatten(2).clamp(0, lk - 1), valid.flatten(2)  # (lq, n2, P)
        rows_kv = k_b[pos]
        index = (rows_kv, heads.expand_as(rows_kv))
        k_sel, v_sel = k_flat[index].to(acc), v_flat[index].to(acc)  # (lq, n2, P, d)
        q = q_flat[rs].to(acc).view(lq, n2, g, d)
        scores = torch.einsum("ingd,inpd->ingp", q, k_sel)
        if rope:
            qr = qr_flat[rs].to(acc).view(lq, n2, g, -1)
            kr_sel = kr_flat[index].to(acc)
            scores = scores + torch.einsum("ingd,inpd->ingp", qr, kr_sel)
        total = ssum[rs].to(acc)
        total = torch.where(total > 0, total, torch.ones((), dtype=acc)).unsqueeze(-1)
        probs = torch.exp(scores * scale_value - smax[rs].to(acc).unsqueeze(-1)) / total
        probs = torch.where(valid.unsqueeze(2), probs, zero)  # (lq, n2, g, P)
        do = do_flat[rs].to(acc).view(lq, n2, g, d)
        delta = (do * o_flat[rs].to(acc).view(lq, n2, g, d)).sum(-1, keepdim=True)
        grad_scores = probs * (torch.einsum("ingd,inpd->ingp", do, v_sel) - delta) * scale_value
        grad_q[rs] = torch.einsum("ingp,inpd->ingd", grad_scores, k_sel)
        grad_k.index_put_(index, torch.einsum("ingp,ingd->inpd", grad_scores, q), accumulate=True)
        grad_v.index_put_(index, torch.einsum("ingp,ingd->inpd", probs, do), accumulate=True)
        if rope:
            grad_qr[rs] = torch.einsum("ingp,inpd->ingd", grad_scores, kr_sel)
            grad_kr.index_put_(index, torch.einsum("ingp,ingd->inpd", grad_scores, qr), accumulate=True)
    if value is None:
        grad_k = grad_k + grad_v
    grad_value = query.new_empty((0,)) if value is None else grad_v.to(value.dtype).view(value.shape)
    grad_query_rope = grad_qr.to(query_rope.dtype).view(query_rope.shape) if rope else query.new_empty((0,))
    grad_key_rope = grad_kr.to(key_rope.dtype).view(key_rope.shape) if rope else key.new_empty((0,))
    return (grad_q.to(query.dtype).view(query.shape), grad_k.to(key.dtype).view(key.shape), grad_value,
            grad_query_rope, grad_key_rope)


# =====================================================================================
# cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata
# =====================================================================================
def _check_metadata_args(num_heads_q, num_heads_k, head_dim, layout_q, layout_k, mask_mode, cmp_ratio) -> None:
    op = "sparse_flash_mla_softmax_l1_norm_metadata"
    if num_heads_q <= 0 or head_dim <= 0:
        raise RuntimeError(f"{op}: num_heads_q and head_dim must be positive, got {num_heads_q} and {head_dim}")
    _check_heads(op, num_heads_q, num_heads_k)
    if layout_q not in LAYOUTS or layout_k != layout_q:
        raise RuntimeError(f"{op}: layout_q and layout_k must be one of {LAYOUTS} and equal, got "
                           f"{layout_q!r} and {layout_k!r}")
    if mask_mode not in (0, 3):
        raise RuntimeError(f"{op}: mask_mode must be 0 (no mask) or 3 (right-down causal), got {mask_mode}")
    if cmp_ratio < 1:
        raise RuntimeError(f"{op}: cmp_ratio must be >= 1, got {cmp_ratio}")


def _metadata_fake(num_heads_q, num_heads_k, head_dim, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                   seqused_k=None, cmp_residual_k=None, topk_length=None, batch_size=None, max_seqlen_q=None,
                   max_seqlen_k=None, topk=None, layout_q=None, layout_k=None, mask_mode=None, cmp_ratio=None):
    layout_q = layout_q or "BSND"
    _check_metadata_args(num_heads_q, num_heads_k, head_dim, layout_q, layout_k or "BSND",
                         0 if mask_mode is None else mask_mode, 1 if cmp_ratio is None else cmp_ratio)
    return torch.empty((_METADATA_SIZE,), dtype=torch.int32)


def _metadata_rows(op, layout_q, cu_seqlens_q, seqused_q, batch_size, max_seqlen_q) -> int:
    """The number of (batch, query row) pairs the main op computes (the AICPU CalcTotalSize)."""
    if seqused_q is not None:
        used = _ints(op, "seqused_q", seqused_q)
        if any(n < 0 for n in used):
            raise RuntimeError(f"{op}: seqused_q must not be negative, got {used}")
        return sum(used)
    if layout_q == "TND":
        if cu_seqlens_q is None:
            raise RuntimeError(f"{op}: layout TND needs cu_seqlens_q")
        return _ints(op, "cu_seqlens_q", cu_seqlens_q)[-1]
    if not batch_size or not max_seqlen_q or batch_size < 0 or max_seqlen_q < 0:
        raise RuntimeError(f"{op}: layout BSND needs positive batch_size and max_seqlen_q, got {batch_size} "
                           f"and {max_seqlen_q}")
    return batch_size * max_seqlen_q


@op_spec("cann_ops_transformer::sparse_flash_mla_softmax_l1_norm_metadata",
         schema="sparse_flash_mla_softmax_l1_norm_metadata(int num_heads_q, int num_heads_k, int head_dim, *, Tensor? "
                "cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, Tensor? "
                "cmp_residual_k=None, Tensor? topk_length=None, int? batch_size=None, int? max_seqlen_q=None, int? "
                "max_seqlen_k=None, int? topk=None, str? layout_q=None, str? layout_k=None, int? mask_mode=None, int? "
                "cmp_ratio=None) -> Tensor",
         fake=_metadata_fake, samples=_l1_norm_metadata_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.int32}),  # its tensors: cu_seqlens / seqused / topk_length
             min_rank=1,
             max_rank=1,
             backward=None,
             ge_converter=False,
             socs=only_on_socs("Ascend950"),
             limits={
                 "package": "cann_ops_transformer",
                 "head_dim": 512,
                 "max_query_heads": 128,
                 "key_heads": 1,
                 "output": "int32[64] on the host (an AICPU tiling helper; move it to the device)",
                 "bsnd_needs": ("batch_size", "max_seqlen_q", "max_seqlen_k"),
                 "tnd_needs": ("cu_seqlens_q", "cu_seqlens_k"),
             },
             doc="op_semantics 10 / cann_ops_transformer docs: the tiling metadata of "
             "sparse_flash_mla_softmax_l1_norm, int32[64]; Ascend 950 only; no GE converter",
         ))  # no autograd
def sparse_flash_mla_softmax_l1_norm_metadata(num_heads_q, num_heads_k, head_dim, *, cu_seqlens_q=None,
                                              cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                                              cmp_residual_k=None, topk_length=None, batch_size=None,
                                              max_seqlen_q=None, max_seqlen_k=None, topk=None, layout_q=None,
                                              layout_k=None, mask_mode=None, cmp_ratio=None):
    # The AICPU kernel (sparse_flash_mla_softmax_l1_norm_metadata_aicpu_arch35.h BuildMetadata):
    # int32[64], zero but for
    #   [0] rows = sum(seqused_q), else cu_seqlens_q[B] (TND), else batch_size * max_seqlen_q
    #   [4] C = min(rows, AIC cores, 36)   [1] ceil(rows / C)   [2] floor(rows / C)
    #   [3] C - rows % C, or 0 when C divides rows (the cores taking floor(rows / C))
    # The main op reads [0] (rows) and [4] (cores) only. Output on the CPU: the docs move it
    # to the device explicitly (metadata.npu()).
    op = "sparse_flash_mla_softmax_l1_norm_metadata"
    layout_q = layout_q or "BSND"
    _check_metadata_args(num_heads_q, num_heads_k, head_dim, layout_q, layout_k or "BSND",
                         0 if mask_mode is None else mask_mode, 1 if cmp_ratio is None else cmp_ratio)
    rows = _metadata_rows(op, layout_q, cu_seqlens_q, seqused_q, batch_size, max_seqlen_q)
    metadata = torch.zeros((_METADATA_SIZE,), dtype=torch.int32)
    if rows > 0:  # 0 rows: the kernel would divide by 0 cores; all zeros here
        cores = min(rows, _METADATA_MAX_CORES)
        remainder = rows % cores
        metadata[:5] = torch.tensor([rows, -(-rows // cores), rows // cores,
                                     0 if remainder == 0 else cores - remainder, cores], dtype=torch.int32)
    return metadata


# =====================================================================================
# cann_ops_transformer.sparse_flash_mla_softmax_l1_norm
# =====================================================================================
def _check_l1_norm(q, k, softmax_lse, sparse_indices, cu_seqlens_q, cu_seqlens_k, cmp_residual_k, topk_length,
                   max_seqlen_k, cmp_ratio, mask_mode, layout_q, layout_k) -> tuple[int, bool]:
    """Validate; return (N2, sparse)."""
    op = "sparse_flash_mla_softmax_l1_norm"
    _check_layouts(op, layout_q, layout_k, "layout_k", key_layouts=LAYOUTS)
    _check_rank(op, "q", q, layout_q)
    _check_rank(op, "k", k, layout_k)
    _check_float_pair(op, "q", q, "k", k)
    if k.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"{op}: q and k head dims differ: {q.shape[-1]} and {k.shape[-1]}")
    n1, n2 = q.shape[-2], k.shape[-2]
    g = _check_heads(op, n1, n2)
    lse_shape = (q.shape[0], n2, q.shape[1], g) if layout_q == "BSND" else (n2, q.shape[0], g)
    if not softmax_lse.dtype.is_floating_point or _shape(softmax_lse) != lse_shape:
        raise RuntimeError(f"{op}: softmax_lse must be floating point (fp32) of shape "
                           f"{'(B, N2, S1, G)' if layout_q == 'BSND' else '(N2, T1, G)'} = {lse_shape}, "
                           f"got {softmax_lse.dtype} {_shape(softmax_lse)}")
    rows_shape = _shape(q)[:-2] + (n2,)
    sparse = sparse_indices is not None and sparse_indices.numel() != 0
    if sparse and (sparse_indices.dtype != torch.int32 or _shape(sparse_indices)[:-1] != rows_shape
                   or sparse_indices.dim() != len(rows_shape) + 1):
        raise RuntimeError(f"{op}: sparse_indices must be int32 of shape {rows_shape + ('K',)}, got "
                           f"{sparse_indices.dtype} {_shape(sparse_indices)}")
    if topk_length is not None and _shape(topk_length) != rows_shape:
        raise RuntimeError(f"{op}: topk_length must have shape {rows_shape}, got {_shape(topk_length)}")
    if layout_q == "TND":
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise RuntimeError(f"{op}: layout TND needs cu_seqlens_q and cu_seqlens_k")
        if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
            raise RuntimeError(f"{op}: cu_seqlens_q and cu_seqlens_k must both be (B + 1,), got "
                               f"{_shape(cu_seqlens_q)} and {_shape(cu_seqlens_k)}")
        if not sparse and max_seqlen_k <= 0:
            raise RuntimeError(f"{op}: dense TND needs max_seqlen_k > 0 (the output is (T1, N2, max_seqlen_k))")
    if mask_mode not in (0, 3):
        raise RuntimeError(f"{op}: mask_mode must be 0 (no mask) or 3 (right-down causal), got {mask_mode}")
    if cmp_ratio < 1:
        raise RuntimeError(f"{op}: cmp_ratio must be >= 1, got {cmp_ratio}")
    if mask_mode == 3 and cmp_ratio > 1 and cmp_residual_k is None:
        raise RuntimeError(f"{op}: mask_mode 3 with cmp_ratio > 1 needs cmp_residual_k (S2 % cmp_ratio per batch)")
    return n2, sparse


def _l1_norm_out_shape(q, k, sparse_indices, n2, sparse, max_seqlen_k, layout_q) -> tuple:
    if layout_q == "BSND":
        return (q.shape[0], q.shape[1], n2, sparse_indices.shape[-1] if sparse else k.shape[1])
    # TND dense: (T1, N2, max_seqlen_k), batch-local key positions (the pypto kernel's output
    # tensor and its corrected infershape; the doc's (T1, N2, T2) is the same for B = 1)
    return (q.shape[0], n2, sparse_indices.shape[-1] if sparse else max_seqlen_k)


def _l1_norm_fake(q, k, softmax_lse, *, sparse_indices=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                  seqused_k=None, cmp_residual_k=None, topk_length=None, metadata=None, softmax_scale=1.0,
                  max_seqlen_k=0, cmp_ratio=1, mask_mode=0, layout_q="BSND", layout_k="BSND"):
    n2, sparse = _check_l1_norm(q, k, softmax_lse, sparse_indices, cu_seqlens_q, cu_seqlens_k, cmp_residual_k,
                                topk_length, max_seqlen_k, cmp_ratio, mask_mode, layout_q, layout_k)
    return q.new_empty(_l1_norm_out_shape(q, k, sparse_indices, n2, sparse, max_seqlen_k, layout_q),
                       dtype=torch.float32)


def _per_batch(op: str, name: str, t: Optional[torch.Tensor], batch: int, default: Sequence[int]) -> list[int]:
    if t is None:
        return list(default)
    values = _ints(op, name, t)
    if len(values) != batch:
        raise RuntimeError(f"{op}: {name} must hold {batch} values (one per batch), got {values}")
    return values


@op_spec("cann_ops_transformer::sparse_flash_mla_softmax_l1_norm",
         schema="sparse_flash_mla_softmax_l1_norm(Tensor q, Tensor k, Tensor softmax_lse, *, Tensor? "
                "sparse_indices=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, "
                "Tensor? seqused_k=None, Tensor? cmp_residual_k=None, Tensor? topk_length=None, Tensor? metadata=None, "
                'float softmax_scale=1.0, int max_seqlen_k=0, int cmp_ratio=1, int mask_mode=0, str layout_q="BSND", '
                'str layout_k="BSND") -> Tensor',
         fake=_l1_norm_fake, samples=_l1_norm_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),  # q and k, one dtype; lse fp32
             min_rank=3,  # TND
             max_rank=4,  # BSND
             backward=None,
             ge_converter=False,  # not a torch_npu op: torchair 2.13 has no converter for it
             socs=only_on_socs("Ascend950"),  # 950PR/950DT only
             limits={
                 "package": "cann_ops_transformer",  # torch.ops.cann_ops_transformer, not torch_npu
                 "head_dim": 512,
                 "max_query_heads": 128,  # N1 in 1..128
                 "key_heads": 1,
                 "layouts": ("BSND", "TND"),  # layout_q == layout_k
                 "mask_modes": (0, 3),
                 "max_cmp_ratio": 128,  # cmp_ratio in 1..128
                 "needs_metadata": "cann_ops_transformer.sparse_flash_mla_softmax_l1_norm_metadata",
                 # torchair: single-op and ACL graph (reduce-overhead) per the docs' examples
                 "modes": ("reduce-overhead", "npugraph_ex"),
             },
             doc="op_semantics 10 / cann_ops_transformer docs (hicann/ops-transformer torch_extension/"
             "cann_ops_transformer/docs/zh/sparse_flash_mla_softmax_l1_norm.md): Ascend 950PR/950DT only; q/k "
             "fp16/bf16, D == 512, N1 1..128, N2 == 1, BSND/TND (equal), mask_mode 0/3, cmp_ratio 1..128, "
             "metadata from the _metadata op required; fp32 output; no autograd; no GE converter (not in "
             "torch_npu)",
         ))  # no autograd
def sparse_flash_mla_softmax_l1_norm(q, k, softmax_lse, *, sparse_indices=None, cu_seqlens_q=None,
                                     cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None,
                                     topk_length=None, metadata=None, softmax_scale=1.0, max_seqlen_k=0,
                                     cmp_ratio=1, mask_mode=0, layout_q="BSND", layout_k="BSND"):
    # op_semantics 10, the extension doc and the pypto kernel. Per batch b (Sq, Sk: its query
    # and key counts, seqused_* if given), query row i < Sq, key head n and its G query heads:
    #   mask_mode 3: ori = Sk * cmp_ratio + (cmp_residual_k[b] if cmp_ratio > 1 else 0);
    #                visible = max((ori - Sq + i + 1) // cmp_ratio, 0)   (compressed keys wholly
    #                at or before the query: right-down causal on the uncompressed sequence)
    #   dense:  n = Sk (mode 0) or visible (mode 3); slot j < n is key j
    #   sparse: n = min(K or topk_length[i, n], Sk (mode 0) or visible (mode 3)), cut at the
    #           first negative index; slot s < n is key sparse_indices[i, n, s]
    #   out[i, n, slot] = sum_{g < G} exp(scale * q[i, nG+g] . k[slot] - lse[i, nG+g]) / G
    # ("SimpleSoftmax": the lse of the matching attention forward, no max/sum recomputed). The
    # mode-3 sparse cut limits the NUMBER of slots to the visible count, it does not test the
    # index values. Everything else is 0 (the kernel zero-initialises the output). fp32.
    op = "sparse_flash_mla_softmax_l1_norm"
    n2, sparse = _check_l1_norm(q, k, softmax_lse, sparse_indices, cu_seqlens_q, cu_seqlens_k, cmp_residual_k,
                                topk_length, max_seqlen_k, cmp_ratio, mask_mode, layout_q, layout_k)
    n1, d = q.shape[-2], q.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(q)
    if layout_q == "BSND":
        batch, s1, s2 = q.shape[0], q.shape[1], k.shape[1]
        q_starts, q_full = [b * s1 for b in range(batch)], [s1] * batch
        k_starts, k_full = [b * s2 for b in range(batch)], [s2] * batch
    else:
        cu_q, cu_k = _ints(op, "cu_seqlens_q", cu_seqlens_q), _ints(op, "cu_seqlens_k", cu_seqlens_k)
        q_starts, q_full = _cumulative(op, "cu_seqlens_q", cu_q[1:], q.shape[0])
        k_starts, k_full = _cumulative(op, "cu_seqlens_k", cu_k[1:], k.shape[0])
        if cu_q[0] != 0 or cu_k[0] != 0:
            raise RuntimeError(f"{op}: cu_seqlens_q and cu_seqlens_k start at 0, got {cu_q} and {cu_k}")
        batch = len(q_full)
    sq = _per_batch(op, "seqused_q", seqused_q, batch, q_full)
    sk = _per_batch(op, "seqused_k", seqused_k, batch, k_full)
    if any(not 0 <= u <= f for u, f in zip(sq + sk, q_full + k_full)):
        raise RuntimeError(f"{op}: seqused_q {sq} / seqused_k {sk} exceed the batches' lengths {q_full} / {k_full}")
    residual = _per_batch(op, "cmp_residual_k", cmp_residual_k, batch, [0] * batch)
    if metadata is None:
        raise RuntimeError(f"{op}: metadata is required: make it with "
                           "sparse_flash_mla_softmax_l1_norm_metadata (the docs move it to the device)")
    meta = metadata.reshape(-1)
    if meta.numel() != _METADATA_SIZE or int(meta[0]) != sum(sq) or (sum(sq) > 0 and int(meta[4]) <= 0):
        raise RuntimeError(f"{op}: metadata was not made for this call: it counts {int(meta[0])} query rows on "
                           f"{int(meta[4])} cores, the call has {sum(sq)} rows (the kernel computes the rows "
                           "metadata counts)")
    out_shape = _l1_norm_out_shape(q, k, sparse_indices, n2, sparse, max_seqlen_k, layout_q)
    width = out_shape[-1]
    q_flat, k_flat = q.reshape(-1, n1, d), k.reshape(-1, n2, d)
    lse_flat = (softmax_lse.transpose(1, 2) if layout_q == "BSND" else softmax_lse.transpose(0, 1)).reshape(-1, n2, g)
    idx_flat = sparse_indices.reshape(-1, n2, width) if sparse else None
    klen_flat = topk_length.reshape(-1, n2) if topk_length is not None else None
    out = torch.zeros((q_flat.shape[0], n2, width), dtype=acc, device=q.device)
    heads = torch.arange(n2).view(1, n2, 1)
    for b in range(batch):
        rows, keys = sq[b], sk[b]
        if rows == 0:
            continue
        i = torch.arange(rows).view(rows, 1)
        if mask_mode == 3:
            ori = keys * cmp_ratio + (residual[b] if cmp_ratio > 1 else 0)
            limit = torch.clamp((ori - rows + i + 1) // cmp_ratio, min=0)  # (rows, 1)
        else:
            limit = torch.full((rows, 1), keys)
        rs = slice(q_starts[b], q_starts[b] + rows)
        qb = q_flat[rs].to(acc).view(rows, n2, g, d)
        if sparse:
            slots = idx_flat[rs].long()  # (rows, n2, K)
            n = torch.minimum(limit, torch.full((1, 1), width)) if klen_flat is None else \
                torch.minimum(limit, klen_flat[rs].long().clamp(max=width))
            listed = (slots >= 0).long().cumprod(-1).bool()
            valid = listed & (torch.arange(width) < n.unsqueeze(-1))
            if (valid & (slots >= k_full[b])).any():
                raise RuntimeError(f"{op}: batch {b}: sparse_indices select keys past its {k_full[b]} keys")
            k_sel = k_flat[k_starts[b] + slots.clamp(0, max(k_full[b] - 1, 0)), heads].to(acc)  # (rows, n2, K, d)
        else:
            if width < keys:
                raise RuntimeError(f"{op}: max_seqlen_k={width} is less than batch {b}'s {keys} keys")
            valid = (torch.arange(width) < limit).unsqueeze(1).expand(rows, n2, width)
            kb = k_flat[k_starts[b]:k_starts[b] + keys].to(acc)  # (keys, n2, d)
            k_sel = torch.zeros((rows, n2, width, d), dtype=acc)
            k_sel[:, :, :keys] = kb.transpose(0, 1).unsqueeze(0)
            valid = valid & (torch.arange(width) < keys)
        scores = torch.einsum("ingd,inpd->ingp", qb, k_sel) * softmax_scale
        p = torch.exp(scores - lse_flat[rs].to(acc).unsqueeze(-1))
        p = p.masked_fill(~valid.unsqueeze(2), 0.0)
        out[rs] = p.sum(2) / g
    return out.to(torch.float32).view(out_shape)


# =====================================================================================
# DeepSeek-V4: cann_ops_transformer.sparse_flash_mla (+ _metadata, _grad, _grad_metadata) and
# cann_ops_transformer.lightning_indexer (+ _metadata)
# =====================================================================================
# Sources (mirror-cann/ops-transformer at 3a280bc, shared/reference/deepseek_v4.md 8.2 / 9.2):
# the extension's docs (torch_extension/cann_ops_transformer/docs/zh/sparse_flash_mla*.md,
# lightning_indexer.md), Meta functions (ops/sparse_flash_mla*.py, ops/lightning_indexer.py)
# and the forward golden (attention/sparse_flash_mla/tests/pytest/sparse_flash_mla_golden.py).
#
# sparse_flash_mla, per batch b and query row i (of Sq rows; the ori keys are the batch's
# Sori uncompressed keys, K = V, one key head shared by the G query heads):
#   ori part  ori_mask_mode 4 (band): keys [max(t - ori_win_left - 1, 0), t + ori_win_right)
#             with t = Sori - Sq + i + 1 (win_left -1: from 0); 3: [0, t + ori_win_right);
#             0: all. In modes 3 / 4 a row i < Sq - Sori sees nothing (zeros).
#   cmp part  visible count c = floor((S - Sq + i + 1) / cmp_ratio) (cmp_mask_mode 3) or
#             floor(S / cmp_ratio) (0), capped at the batch's T compressed keys, with
#             S = T * cmp_ratio + cmp_residual_kv[b] (the docs' definition of the residual;
#             the golden uses Sori, the same for a prefill whose ori keys are all S tokens).
#             Without cmp_sparse_indices (HCA): keys [0, c). With them (CSA): the first
#             min(K, c) slots, up to the first -1, skipping ids >= c; a listed id counts as
#             often as it is listed (the golden extends its key list).
#   softmax   over [ori keys, cmp keys] and the sink: m = max(sinks[h], max l), l = q.k * scale,
#             sum = exp(sinks[h] - m) + sum exp(l - m); out = (round_q(exp(l - m)) @ V) / sum
#             (the golden's RUN_MODE 1: the unnormalised probabilities rounded to q's dtype
#             before the P @ V matmul, in one S2 tile); lse = m + log(sum) (the golden adds
#             1e-10 inside the log, below fp32's resolution of sum >= 1: left out).
# Not computed here (NotImplementedError): paged kv (block tables), ori_sparse_indices, the
# *_topk_length inputs, absent ori_kv (950 only), topk_value_mode != 1.
_SMLA_METADATA_SIZE = 1024  # SMLA_METADATA_SIZE / SMLAG_METADATA_SIZE / LI_METADATA_SIZE
# The metadata ops are AICPU tiling helpers whose int32[1024] layout is undocumented. The
# stand-ins write a header of the arguments the main op must agree with (a stand-in
# convention, not the kernel's layout) and the main ops check it: a pass that builds
# metadata for other sizes or modes than it calls the op with fails here as it would on the NPU.
_SMLA_HEADER = ("num_heads_q", "num_heads_kv", "head_dim", "batch_size", "max_seqlen_q", "cmp_ratio",
                "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right", "has_ori_kv", "has_cmp_kv")
_LI_HEADER = ("num_heads_q", "num_heads_k", "head_dim", "topk", "batch_size", "max_seqlen_q", "mask_mode",
              "cmp_ratio")


def _metadata_header(values: dict, names: Sequence[str]) -> torch.Tensor:
    metadata = torch.zeros((_SMLA_METADATA_SIZE,), dtype=torch.int32)
    metadata[:len(names)] = torch.tensor([int(values[name]) for name in names], dtype=torch.int32)
    return metadata


def _check_metadata_header(op: str, metadata: Optional[torch.Tensor], values: dict, names: Sequence[str]) -> None:
    if metadata is None:
        return  # A2 / A3 take none (the docs); whether a 950 kernel needs it is capabilities.py's business
    meta = metadata.reshape(-1)
    if meta.numel() != _SMLA_METADATA_SIZE or meta.dtype != torch.int32:
        raise RuntimeError(f"{op}: metadata must be the int32[{_SMLA_METADATA_SIZE}] of its _metadata op")
    got = {name: int(meta[i]) for i, name in enumerate(names)}
    wrong = {name: (got[name], int(values[name])) for name in names if got[name] != int(values[name])}
    if wrong:
        raise RuntimeError(f"{op}: metadata was made for another call: {wrong} (metadata value, this call)")


def _cu_lengths(op: str, name: str, cu: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The extension's cu_seqlens (B + 1 entries, leading 0) as this module's cumulative lengths."""
    if cu is None:
        return None
    values = _ints(op, name, cu)
    if not values or values[0] != 0:
        raise RuntimeError(f"{op}: {name} must start with 0 (B + 1 prefix sums), got {values}")
    return cu[1:]


def _smla_lengths(op, layout, cu, seqused, name):
    """The per-batch lengths argument of _query_batches / _key_rows: TND cumulative, BSND per batch."""
    if layout == "TND":
        if seqused is not None:
            raise NotImplementedError(f"{op}: seqused with TND has no CPU reference")
        return _cu_lengths(op, f"cu_seqlens_{name}", cu)
    return seqused


def _smla_plan(op, q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, ori_block_table, cmp_block_table,
               cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv,
               cmp_residual_kv, ori_topk_length, cmp_topk_length, sinks, cmp_ratio, ori_mask_mode, cmp_mask_mode,
               layout_q, layout_kv):
    """Validate a sparse_flash_mla(_grad) call; return (n2, batches) with batches of
    (query row slice, rows, ori key rows, cmp key rows or None, S = T*ratio + residual)."""
    _check_layouts(op, layout_q, layout_kv, "layout_kv", key_layouts=LAYOUTS)
    if ori_kv is None:
        raise NotImplementedError(f"{op}: without ori_kv (Ascend 950 only) there is no CPU reference")
    if ori_block_table is not None or cmp_block_table is not None:
        raise NotImplementedError(f"{op}: paged kv (block tables) has no CPU reference")
    if ori_sparse_indices is not None or ori_topk_length is not None or cmp_topk_length is not None:
        raise NotImplementedError(f"{op}: ori_sparse_indices and the *_topk_length inputs (Ascend 950) have no CPU "
                                  "reference")
    _check_rank(op, "q", q, layout_q)
    _check_rank(op, "ori_kv", ori_kv, layout_kv)
    _check_float_pair(op, "q", q, "ori_kv", ori_kv)
    if ori_kv.shape[-1] != q.shape[-1]:
        raise RuntimeError(f"{op}: q and ori_kv head dims differ: {q.shape[-1]} and {ori_kv.shape[-1]}")
    n2 = ori_kv.shape[-2]
    _check_heads(op, q.shape[-2], n2)
    if cmp_kv is not None:
        _check_rank(op, "cmp_kv", cmp_kv, layout_kv)
        _check_float_pair(op, "q", q, "cmp_kv", cmp_kv)
        if cmp_kv.shape[-2:] != ori_kv.shape[-2:]:
            raise RuntimeError(f"{op}: cmp_kv {tuple(cmp_kv.shape)} and ori_kv {tuple(ori_kv.shape)} differ in heads "
                               "or head dim")
    elif cmp_sparse_indices is not None:
        raise RuntimeError(f"{op}: cmp_sparse_indices without cmp_kv (SWA takes neither)")
    if cmp_sparse_indices is not None:
        expected = _shape(q)[:-2] + (n2,)
        if cmp_sparse_indices.dtype != torch.int32 or _shape(cmp_sparse_indices)[:-1] != expected \
                or cmp_sparse_indices.dim() != len(expected) + 1:
            raise RuntimeError(f"{op}: cmp_sparse_indices must be int32 {expected + ('K',)}, got "
                               f"{cmp_sparse_indices.dtype} {_shape(cmp_sparse_indices)}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[-2]):
        raise RuntimeError(f"{op}: sinks must be ({q.shape[-2]},) (one per query head), got {_shape(sinks)}")
    if ori_mask_mode not in (0, 3, 4) or cmp_mask_mode not in (0, 3):
        raise RuntimeError(f"{op}: ori_mask_mode must be 0 / 3 / 4 and cmp_mask_mode 0 / 3, got {ori_mask_mode} "
                           f"and {cmp_mask_mode}")
    if not 1 <= cmp_ratio <= 128:
        raise RuntimeError(f"{op}: cmp_ratio must be in [1, 128], got {cmp_ratio}")
    starts, lens = _query_batches(op, layout_q, q, _smla_lengths(op, layout_q, cu_seqlens_q, seqused_q, "q"),
                                  "query lengths")
    ori_rows = _key_rows(op, layout_kv, ori_kv, _smla_lengths(op, layout_kv, cu_seqlens_ori_kv, seqused_ori_kv,
                                                               "ori_kv"), None, len(lens), "ori_kv lengths")
    cmp_rows = ([None] * len(lens) if cmp_kv is None else
                _key_rows(op, layout_kv, cmp_kv, _smla_lengths(op, layout_kv, cu_seqlens_cmp_kv, seqused_cmp_kv,
                                                               "cmp_kv"), None, len(lens), "cmp_kv lengths"))
    if cmp_kv is not None and cmp_mask_mode == 3 and cmp_residual_kv is None:
        raise RuntimeError(f"{op}: cmp_mask_mode 3 with cmp_kv needs cmp_residual_kv (S % cmp_ratio per batch)")
    residual = _per_batch(op, "cmp_residual_kv", cmp_residual_kv, len(lens), [0] * len(lens))
    if any(not 0 <= r < cmp_ratio for r in residual) and cmp_kv is not None:
        raise RuntimeError(f"{op}: cmp_residual_kv must be in [0, cmp_ratio), got {residual}")
    batches = []
    for b, (start, lq) in enumerate(zip(starts, lens)):
        if lq == 0:
            continue
        full = (cmp_rows[b].numel() * cmp_ratio + residual[b]) if cmp_rows[b] is not None else ori_rows[b].numel()
        batches.append((slice(start, start + lq), lq, ori_rows[b], cmp_rows[b], full))
    return n2, batches


def _smla_selection(lq, lo, cmp_count, full, indices, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left,
                    ori_win_right):
    """Per query row: the ori key mask (lq, lo) and the cmp key positions (lq, P) with their
    validity (positions into the batch's cmp keys; P = K with indices, else cmp_count)."""
    i = torch.arange(lq).unsqueeze(1)
    j = torch.arange(lo).unsqueeze(0)
    t = lo - lq + i + 1
    if ori_mask_mode == 4:
        begin = torch.clamp(t - ori_win_left - 1, min=0) if ori_win_left != -1 else torch.zeros_like(t)
        ori = (j >= begin) & (j < t + ori_win_right)
    elif ori_mask_mode == 3:
        ori = j < t + ori_win_right
    else:
        ori = torch.ones((lq, lo), dtype=torch.bool)
    if ori_mask_mode in (3, 4):
        ori &= (i >= lq - lo)  # a row before the ori keys' causal start sees nothing
    if cmp_count is None:
        return ori, None, None
    visible = (full - lq + i + 1) // cmp_ratio if cmp_mask_mode == 3 else torch.full_like(i, full // cmp_ratio)
    visible = visible.clamp(min=0, max=cmp_count)  # (lq, 1)
    if indices is None:  # every visible compressed key, in order
        pos = torch.arange(cmp_count).unsqueeze(0).expand(lq, -1)
        return ori, pos, pos < visible
    slots = indices.long()  # (lq, K)
    listed = (slots >= 0).long().cumprod(-1).bool()  # up to the first -1
    looked_at = torch.arange(slots.shape[-1]).unsqueeze(0) < visible  # the first min(K, c) slots
    valid = listed & looked_at & (slots < visible)
    return ori, slots.clamp(0, max(cmp_count - 1, 0)), valid


def _smla_logits(q_b, ori_b, cmp_b, ori_mask, cmp_pos, cmp_valid, scale):
    """Scaled logits (lq, n2, G, lo [+ P]) over [ori keys, selected cmp keys], -inf where hidden,
    and the gathered keys (lq, n2, lo [+ P], D)."""
    lq = q_b.shape[0]
    keys = ori_b.unsqueeze(0).expand(lq, -1, -1, -1)  # (lq, lo, n2, D)
    mask = ori_mask
    if cmp_pos is not None:
        keys = torch.cat([keys, cmp_b[cmp_pos]], 1)  # (lq, lo + P, n2, D)
        mask = torch.cat([ori_mask, cmp_valid], 1)
    keys = keys.transpose(1, 2)  # (lq, n2, L, D)
    logits = torch.einsum("ingd,inld->ingl", q_b, keys) * scale
    return logits.masked_fill(~mask.view(lq, 1, 1, -1), float("-inf")), keys, mask


def _sink_logits(sinks, n2, g, acc):
    return sinks.to(acc).view(1, n2, g) if sinks is not None else None


def _smla_lse_shape(q, n2, layout_q):
    g = q.shape[-2] // n2
    return (q.shape[0], n2, q.shape[1], g) if layout_q == "BSND" else (n2, q.shape[0], g)


def _sparse_flash_mla_metadata_fake(num_heads_q, num_heads_kv, head_dim, **kwargs):
    return torch.empty((_SMLA_METADATA_SIZE,), dtype=torch.int32)


def _smla_metadata_values(num_heads_q, num_heads_kv, head_dim, batch_size, max_seqlen_q, cmp_ratio, ori_mask_mode,
                          cmp_mask_mode, ori_win_left, ori_win_right, has_ori_kv, has_cmp_kv):
    # the defaults of the extension's PrivateUse1 wrapper (ops/sparse_flash_mla.py): 0 / 1 / -1 / True
    return dict(num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, head_dim=head_dim, batch_size=batch_size or 0,
                max_seqlen_q=max_seqlen_q or 0, cmp_ratio=1 if cmp_ratio is None else cmp_ratio,
                ori_mask_mode=0 if ori_mask_mode is None else ori_mask_mode,
                cmp_mask_mode=0 if cmp_mask_mode is None else cmp_mask_mode,
                ori_win_left=-1 if ori_win_left is None else ori_win_left,
                ori_win_right=-1 if ori_win_right is None else ori_win_right,
                has_ori_kv=True if has_ori_kv is None else has_ori_kv,
                has_cmp_kv=True if has_cmp_kv is None else has_cmp_kv)


def _smla_metadata_kernel(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                          cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                          cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, batch_size=None,
                          max_seqlen_q=None, max_seqlen_ori_kv=None, max_seqlen_cmp_kv=None, ori_topk=None,
                          cmp_topk=None, cmp_ratio=None, ori_mask_mode=None, cmp_mask_mode=None, ori_win_left=None,
                          ori_win_right=None, layout_q=None, layout_kv=None, has_ori_kv=None, has_cmp_kv=None):
    if num_heads_q <= 0 or head_dim <= 0:
        raise RuntimeError(f"sparse_flash_mla_metadata: num_heads_q and head_dim must be positive, got {num_heads_q} "
                           f"and {head_dim}")
    _check_heads("sparse_flash_mla_metadata", num_heads_q, num_heads_kv)
    values = _smla_metadata_values(num_heads_q, num_heads_kv, head_dim, batch_size, max_seqlen_q, cmp_ratio,
                                   ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, has_ori_kv, has_cmp_kv)
    return _metadata_header(values, _SMLA_HEADER)


op_spec("cann_ops_transformer::sparse_flash_mla_metadata",
        schema="sparse_flash_mla_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, Tensor? "
               "cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? "
               "seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None,"
               " Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, int? batch_size=None, int? "
               "max_seqlen_q=None, int? max_seqlen_ori_kv=None, int? max_seqlen_cmp_kv=None,int? ori_topk=None, int? "
               "cmp_topk=None, int? cmp_ratio=None, int? ori_mask_mode=None,int? cmp_mask_mode=None, int? "
               "ori_win_left=None, int? ori_win_right=None, str? layout_q=None,str? layout_kv=None, bool? "
               "has_ori_kv=None, bool? has_cmp_kv=None) -> Tensor",
        fake=_sparse_flash_mla_metadata_fake, samples=_smla_metadata_samples,
        capability=OpCapability(
            dtypes=frozenset({torch.int32}), min_rank=1,
            max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer", "output": "int32[1024], shape-only tiling"},
            doc="sparse_flash_mla's AICPU tiling metadata (COT ops/sparse_flash_mla.py); its GE converter raises",
        ))(
    _smla_metadata_kernel)  # no autograd: shape-only tiling
op_spec("cann_ops_transformer::sparse_flash_mla_grad_metadata",
        schema="sparse_flash_mla_grad_metadata(int num_heads_q, int num_heads_kv, int head_dim, *, Tensor? "
               "cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? "
               "seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, Tensor? cmp_residual_kv=None,"
               " Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, int? batch_size=None, int? "
               "max_seqlen_q=None, int? max_seqlen_ori_kv=None, int? max_seqlen_cmp_kv=None,int? ori_topk=None, int? "
               "cmp_topk=None, int? cmp_ratio=None, int? ori_mask_mode=None,int? cmp_mask_mode=None, int? "
               "ori_win_left=None, int? ori_win_right=None, str? layout_q=None,str? layout_kv=None, bool? "
               "has_ori_kv=None, bool? has_cmp_kv=None) -> Tensor",
        fake=_sparse_flash_mla_metadata_fake, samples=_smla_metadata_samples,
        capability=OpCapability(
            dtypes=frozenset({torch.int32}), min_rank=1,
            max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
            limits={"package": "cann_ops_transformer"},
            doc="sparse_flash_mla_grad's tiling metadata (COT ops/sparse_flash_mla_grad.py)",
        ))(
    _smla_metadata_kernel)  # the same arguments for the backward's tiling


def _smla_call_values(q, ori_kv, cmp_kv, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right,
                      layout_q):
    bsnd = layout_q == "BSND"
    return dict(num_heads_q=q.shape[-2], num_heads_kv=ori_kv.shape[-2] if ori_kv is not None else 1,
                head_dim=q.shape[-1], batch_size=q.shape[0] if bsnd else 0, max_seqlen_q=q.shape[1] if bsnd else 0,
                cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
                ori_win_left=ori_win_left, ori_win_right=ori_win_right, has_ori_kv=ori_kv is not None,
                has_cmp_kv=cmp_kv is not None)


def _sparse_flash_mla_fake(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                           ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                           cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                           cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None,
                           metadata=None, softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3,
                           ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
                           return_softmax_lse=False):
    n2 = ori_kv.shape[-2] if ori_kv is not None else 1
    # the extension's Meta: lse (B, N2, S1, G) / (N2, T1, G) with return_softmax_lse, else a 0-dim tensor
    # and the attention torch.empty(q.shape), contiguous (mirror-cann/ops-transformer ops/sparse_flash_mla.py)
    lse = q.new_empty(_smla_lse_shape(q, n2, layout_q) if return_softmax_lse else (), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@op_spec("cann_ops_transformer::sparse_flash_mla",
         schema="sparse_flash_mla(Tensor q, *,Tensor? ori_kv=None, Tensor? cmp_kv=None, Tensor? "
                "ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, Tensor? ori_block_table=None, Tensor? "
                "cmp_block_table=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_ori_kv=None, Tensor? "
                "cu_seqlens_cmp_kv=None, Tensor? seqused_q=None, Tensor? seqused_ori_kv=None, Tensor? "
                "seqused_cmp_kv=None, Tensor? cmp_residual_kv=None, Tensor? ori_topk_length=None, Tensor? "
                "cmp_topk_length=None, Tensor? sinks=None, Tensor? metadata=None, float softmax_scale=1.0, int "
                "cmp_ratio=1, int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127, int ori_win_right=0, str "
                'layout_q="BSND", str layout_kv="BSND", int topk_value_mode=1, bool return_softmax_lse=False) -> '
                "(Tensor, Tensor)",
         fake=_sparse_flash_mla_fake, samples=_smla_samples,
         python_autograd="none in the extension (torchtitan-npu's npu_smla wraps it with sparse_flash_mla_grad)",
         capability=OpCapability(
             dtypes=HALF_DTYPES,  # q, ori_kv, cmp_kv one dtype; sinks fp32
             min_rank=3,  # TND
             max_rank=4,  # BSND
             backward=None,  # none in the extension (torchtitan-npu wraps it); ours calls sparse_flash_mla_grad
             autograd_rule="npu_fx_fusion.patterns.sparse_mla.SparseFlashMla",
             ge_converter=False,  # graph_convert_sparse_flash_mla.py: the metadata op only, and it raises
             socs=_A2_A3_950,
             limits={
                 "package": "cann_ops_transformer",
                 "backward_op": "cann_ops_transformer.sparse_flash_mla_grad",
                 "head_dim": 512,
                 "key_heads": 1,
                 "query_heads": (1, 2, 4, 8, 16, 32, 64, 128),  # 950: not 1
                 "query_heads_950": (2, 4, 8, 16, 32, 64, 128),
                 "ori_mask_modes_a2_a3": (4,), "ori_mask_modes_950": (0, 3, 4),
                 "cmp_mask_modes": (3,),
                 "ori_win_left": (127,), "ori_win_right": (0,),
                 "cmp_ratios_a2_a3": (1, 4, 128), "max_cmp_ratio": 128,
                 "csa_topk_a2_a3": (512, 1024),
                 "sinks_required_a2_a3": True,
                 "metadata": {"Ascend950": "required", "Ascend910B": "none", "Ascend910_93": "none"},
                 "layouts": ("BSND", "TND"),  # q and kv alike (PA_BBND kv too: not emitted)
             },
             doc="deepseek_v4.md 9.2 / COT docs/zh/sparse_flash_mla.md: 950, A2, A3; q/ori_kv/cmp_kv bf16/fp16, D = 512, "
             "N2 = 1, N1 in {1, 2, 4, ..., 128} (950: not 1); ori_mask_mode 4 with ori_win_left 127 / ori_win_right 0 "
             "only (A2/A3), cmp_mask_mode 3, cmp_ratio 1 / 4 / 128 on A2/A3, CSA top-k 512 or 1024 (A2/A3); sinks fp32 "
             "[N1]; cmp_residual_kv for CSA/HCA; metadata required on 950, none on A2/A3; no autograd in the "
             "extension; no GE converter (aclgraph only)",
         ))
def sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                     ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                     cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                     cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                     softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                     ori_win_right=0, layout_q="BSND", layout_kv="BSND", topk_value_mode=1, return_softmax_lse=False):
    # the block comment above; fp32 (float64 stays float64), the output rounded once to q's dtype
    op = "sparse_flash_mla"
    if topk_value_mode != 1:
        raise NotImplementedError(f"{op}: topk_value_mode {topk_value_mode} is undocumented (only 1 has a reference)")
    n2, batches = _smla_plan(op, q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, ori_block_table,
                             cmp_block_table, cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q,
                             seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, ori_topk_length, cmp_topk_length,
                             sinks, cmp_ratio, ori_mask_mode, cmp_mask_mode, layout_q, layout_kv)
    _check_metadata_header(op, metadata, _smla_call_values(q, ori_kv, cmp_kv, cmp_ratio, ori_mask_mode, cmp_mask_mode,
                                                           ori_win_left, ori_win_right, layout_q), _SMLA_HEADER)
    n1, d = q.shape[-2], q.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(q)
    q_flat = q.reshape(-1, n2, g, d)
    ori_flat = ori_kv.reshape(-1, n2, d)
    cmp_flat = cmp_kv.reshape(-1, n2, d) if cmp_kv is not None else None
    idx_flat = cmp_sparse_indices.reshape(-1, n2, cmp_sparse_indices.shape[-1]) if cmp_sparse_indices is not None \
        else None
    out = torch.zeros(q_flat.shape, dtype=acc, device=q.device)
    lse = torch.zeros(q_flat.shape[:-1], dtype=torch.float32 if acc == torch.float32 else acc, device=q.device)
    sink = _sink_logits(sinks, n2, g, acc)
    for rs, lq, ori_b, cmp_b, full in batches:
        if n2 != 1 and idx_flat is not None:
            raise NotImplementedError(f"{op}: sparse indices with {n2} key heads (the op has one) have no reference")
        indices = idx_flat[rs, 0] if idx_flat is not None else None
        ori_mask, cmp_pos, cmp_valid = _smla_selection(lq, ori_b.numel(), None if cmp_b is None else cmp_b.numel(),
                                                       full, indices, cmp_ratio, ori_mask_mode, cmp_mask_mode,
                                                       ori_win_left, ori_win_right)
        logits, keys, _ = _smla_logits(q_flat[rs].to(acc), ori_flat[ori_b].to(acc),
                                       cmp_flat[cmp_b].to(acc) if cmp_b is not None else None,
                                       ori_mask, cmp_pos, cmp_valid, softmax_scale)
        m = logits.amax(-1)
        if sink is not None:
            m = torch.maximum(m, sink.expand_as(m))
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # a row with no key and no sink
        e = torch.exp(logits - m.unsqueeze(-1))
        total = e.sum(-1) + (torch.exp(sink - m) if sink is not None else 0)
        p = e.to(q.dtype).to(acc)  # rounded to q's dtype before P @ V (the golden)
        o = torch.einsum("ingl,inld->ingd", p, keys) / torch.where(total > 0, total, 1).unsqueeze(-1)
        out[rs] = o
        lse[rs] = (m + torch.log(total)).to(lse.dtype)
    attention = out.to(q.dtype).view(q.shape)
    if not return_softmax_lse:
        return attention, q.new_zeros((), dtype=torch.float32)  # unwritten on the NPU: zeros, not garbage
    if layout_q == "BSND":  # rows (B*S1, N2, G) -> (B, N2, S1, G)
        lse = lse.view(q.shape[0], q.shape[1], n2, g).transpose(1, 2)
    else:  # (T1, N2, G) -> (N2, T1, G)
        lse = lse.transpose(0, 1)
    return attention, lse.contiguous().to(torch.float32 if acc == torch.float32 else acc)


def _sparse_flash_mla_grad_fake(q, dout, attn_out, softmax_lse, ori_kv=None, cmp_kv=None, ori_sparse_indices=None,
                                cmp_sparse_indices=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                                cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                                cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None,
                                metadata=None, softmax_scale=None, cmp_ratio=None, ori_mask_mode=0, cmp_mask_mode=0,
                                ori_win_left=-1, ori_win_right=-1, layout_q="BSND", layout_kv="BSND"):
    # the extension's Meta, with an empty (0,) where it returns None (the schema's outputs are
    # Tensors); the l1-norm outputs fp32 as the docs say (the Meta copies the indices' int32)
    def like(t, dtype=None):
        return t.new_empty(t.shape, dtype=dtype or t.dtype) if t is not None else q.new_empty((0,))

    def l1(idx):
        return idx.new_empty(idx.shape, dtype=torch.float32) if idx is not None else q.new_empty((0,))

    return (like(q), like(ori_kv), like(cmp_kv), like(sinks), l1(ori_sparse_indices), l1(cmp_sparse_indices))


@op_spec("cann_ops_transformer::sparse_flash_mla_grad",
         schema="sparse_flash_mla_grad(Tensor q, Tensor dout, Tensor attn_out, Tensor softmax_lse,Tensor? ori_kv=None, "
                "Tensor? cmp_kv=None, Tensor? ori_sparse_indices=None, Tensor? cmp_sparse_indices=None, "
                "Tensor?cu_seqlens_q=None,Tensor? cu_seqlens_ori_kv=None, Tensor? cu_seqlens_cmp_kv=None, Tensor? "
                "seqused_q=None,Tensor? seqused_ori_kv=None, Tensor? seqused_cmp_kv=None, Tensor? "
                "cmp_residual_kv=None,Tensor? ori_topk_length=None, Tensor? cmp_topk_length=None, Tensor? "
                "sinks=None,Tensor? metadata=None,float softmax_scale=None, int cmp_ratio=None, int ori_mask_mode=0, "
                'int cmp_mask_mode=0,int ori_win_left=-1, int ori_win_right=-1,str layout_q="BSND", str '
                'layout_kv="BSND")->(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)',
         fake=_sparse_flash_mla_grad_fake, samples=_smla_grad_samples,
         capability=OpCapability(
             dtypes=HALF_DTYPES, min_rank=3, max_rank=4,
             backward=None, ge_converter=False, socs=_A2_A3_950,
             limits={"package": "cann_ops_transformer", "metadata": {"Ascend950": "required"}},
             doc="deepseek_v4.md 9.2 / COT docs/zh/sparse_flash_mla_grad.md: (dq, dori_kv, dcmp_kv, dsinks, "
             "ori_softmax_l1norm, cmp_softmax_l1norm); A2/A3: no seqused / topk_length / metadata, the forward's "
             "mask limits; no GE converter",
         ))
def sparse_flash_mla_grad(q, dout, attn_out, softmax_lse, ori_kv=None, cmp_kv=None, ori_sparse_indices=None,
                          cmp_sparse_indices=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None,
                          seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None,
                          ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None, softmax_scale=None,
                          cmp_ratio=None, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1,
                          layout_q="BSND", layout_kv="BSND"):
    # docs/zh/sparse_flash_mla_grad.md, over the forward's selection (same masks and sinks):
    #   P  = exp(l - lse)  (SimpleSoftmax: the forward's lse, which includes the sink)
    #   dP = dO . v        D = rowsum(dO * O)         dS = P (dP - D)
    #   dq = scale * dS @ K            dkv = scale * dS^T @ q + P^T @ dO   (K = V: both parts)
    #   dsinks[h] = -sum over rows of P_sink * D, P_sink = exp(sinks[h] - lse)  (the sink is a
    #       logit with no value; the doc's "ReduceSum(-P x dP x SimpleSoftmax(sinks, lse))" read
    #       as this, which is the gradient of transformers' cat([logits, sink]) softmax)
    #   cmp_softmax_l1norm (with cmp_sparse_indices): the mean over the G heads of P at each
    #       index slot, 0 at invalid slots (B, S1, N2, K); ori_softmax_l1norm needs
    #       ori_sparse_indices (not computed: empty)
    # softmax_scale None: 1 / sqrt(D) (the doc's default). fp32 accumulation, each gradient
    # rounded once to its input's dtype; dsinks fp32.
    op = "sparse_flash_mla_grad"
    cmp_ratio = 1 if cmp_ratio is None else cmp_ratio
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    n2, batches = _smla_plan(op, q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, None, None, cu_seqlens_q,
                             cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv,
                             cmp_residual_kv, ori_topk_length, cmp_topk_length, sinks, cmp_ratio, ori_mask_mode,
                             cmp_mask_mode, layout_q, layout_kv)
    _check_metadata_header(op, metadata, _smla_call_values(q, ori_kv, cmp_kv, cmp_ratio, ori_mask_mode, cmp_mask_mode,
                                                           ori_win_left, ori_win_right, layout_q), _SMLA_HEADER)
    for name, t in (("dout", dout), ("attn_out", attn_out)):
        if _shape(t) != _shape(q):
            raise RuntimeError(f"{op}: {name} must have q's shape {_shape(q)}, got {_shape(t)}")
    lse_shape = _smla_lse_shape(q, n2, layout_q)
    if _shape(softmax_lse) != lse_shape:
        raise RuntimeError(f"{op}: softmax_lse must be the forward's {lse_shape} (return_softmax_lse=True), got "
                           f"{_shape(softmax_lse)}")
    n1, d = q.shape[-2], q.shape[-1]
    g = n1 // n2
    acc = _compute_dtype(q)
    q_flat, do_flat, o_flat = (t.reshape(-1, n2, g, d) for t in (q, dout, attn_out))
    lse_rows = (softmax_lse.transpose(1, 2) if layout_q == "BSND" else softmax_lse.transpose(0, 1)).reshape(-1, n2, g)
    ori_flat = ori_kv.reshape(-1, n2, d)
    cmp_flat = cmp_kv.reshape(-1, n2, d) if cmp_kv is not None else None
    idx_flat = cmp_sparse_indices.reshape(-1, n2, cmp_sparse_indices.shape[-1]) if cmp_sparse_indices is not None \
        else None
    grad_q = torch.zeros(q_flat.shape, dtype=acc)
    grad_ori = torch.zeros(ori_flat.shape, dtype=acc)
    grad_cmp = torch.zeros(cmp_flat.shape, dtype=acc) if cmp_flat is not None else None
    grad_sinks = torch.zeros((n2, g), dtype=acc)
    l1 = torch.zeros(idx_flat.shape, dtype=acc) if idx_flat is not None else None
    sink = _sink_logits(sinks, n2, g, acc)
    for rs, lq, ori_b, cmp_b, full in batches:
        if n2 != 1 and idx_flat is not None:
            raise NotImplementedError(f"{op}: sparse indices with {n2} key heads (the op has one) have no reference")
        indices = idx_flat[rs, 0] if idx_flat is not None else None
        lo = ori_b.numel()
        ori_mask, cmp_pos, cmp_valid = _smla_selection(lq, lo, None if cmp_b is None else cmp_b.numel(), full,
                                                       indices, cmp_ratio, ori_mask_mode, cmp_mask_mode,
                                                       ori_win_left, ori_win_right)
        qb = q_flat[rs].to(acc)
        logits, keys, mask = _smla_logits(qb, ori_flat[ori_b].to(acc),
                                          cmp_flat[cmp_b].to(acc) if cmp_b is not None else None,
                                          ori_mask, cmp_pos, cmp_valid, scale)
        lse_b = lse_rows[rs].to(acc).unsqueeze(-1)
        p = torch.exp(logits - lse_b)  # (lq, n2, G, L); hidden keys: exp(-inf) = 0
        do = do_flat[rs].to(acc)
        delta = (do * o_flat[rs].to(acc)).sum(-1, keepdim=True)
        dp = torch.einsum("ingd,inld->ingl", do, keys)
        ds = p * (dp - delta)
        grad_q[rs] = torch.einsum("ingl,inld->ingd", ds, keys) * scale
        grad_keys = torch.einsum("ingl,ingd->inld", ds, qb) * scale + torch.einsum("ingl,ingd->inld", p, do)
        grad_keys = grad_keys.transpose(1, 2)  # (lq, L, n2, D)
        grad_ori.index_add_(0, ori_b, grad_keys[:, :lo].sum(0))
        if cmp_pos is not None:
            rows = cmp_b[cmp_pos]  # (lq, P) rows of cmp_flat
            grad_cmp.index_put_((rows,), grad_keys[:, lo:] * cmp_valid.unsqueeze(-1).unsqueeze(-1), accumulate=True)
            if l1 is not None:
                l1[rs, 0] = p[:, 0, :, lo:].mean(1) * cmp_valid  # n2 == 1
        if sink is not None:
            p_sink = torch.exp(sink.unsqueeze(-1) - lse_b)  # (lq, n2, G, 1)
            grad_sinks += (-p_sink * delta).sum((0, 3))
    def empty():  # a tensor of its own per absent output (outputs must not alias)
        return q.new_empty((0,))

    return (grad_q.to(q.dtype).view(q.shape), grad_ori.to(ori_kv.dtype).view(ori_kv.shape),
            grad_cmp.to(cmp_kv.dtype).view(cmp_kv.shape) if grad_cmp is not None else empty(),
            grad_sinks.reshape(-1).to(sinks.dtype) if sinks is not None else empty(), empty(),
            l1.to(torch.float32 if acc == torch.float32 else acc).view(cmp_sparse_indices.shape) if l1 is not None
            else empty())


# ---- cann_ops_transformer.lightning_indexer (+ _metadata) --------------------------------
# docs/zh/lightning_indexer.md: for query row i and key j (one key head, its G query heads)
#   score[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])       (fp32, no scale argument)
#   mask_mode 3: key j visible iff j < floor((S - Sq + i + 1) / cmp_ratio), S = Sk * cmp_ratio +
#   cmp_residual_k[b] (pre-compression length; cmp_ratio 1 and no residual: the right-down
#   causal mask of npu_lightning_indexer's sparse_mode 3); 0: no mask
#   sparse_indices = the top `topk` visible keys, descending; -1 (values -inf) past them.
# Ties go to the lower key (a stable sort: the order within the top-k is unspecified).
def _lightning_indexer_metadata_fake(num_heads_q, num_heads_k, head_dim, topk, **kwargs):
    return torch.empty((_SMLA_METADATA_SIZE,), dtype=torch.int32)


def _li_values(num_heads_q, num_heads_k, head_dim, topk, batch_size, max_seqlen_q, mask_mode, cmp_ratio):
    return dict(num_heads_q=num_heads_q, num_heads_k=num_heads_k, head_dim=head_dim, topk=topk,
                batch_size=batch_size or 0, max_seqlen_q=max_seqlen_q if max_seqlen_q not in (None, -1) else 0,
                mask_mode=mask_mode or 0, cmp_ratio=1 if cmp_ratio is None else cmp_ratio)


@op_spec("cann_ops_transformer::lightning_indexer_metadata",
         schema="lightning_indexer_metadata(int num_heads_q, int num_heads_k, int head_dim, int topk, *, Tensor? "
                "cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, Tensor? "
                "cmp_residual_k=None, int? batch_size=None, int? max_seqlen_q=None, int? max_seqlen_k=None, str? "
                "layout_q=None, str? layout_k=None, int? mask_mode=None, int? cmp_ratio=None) -> Tensor",
         fake=_lightning_indexer_metadata_fake, samples=_cann_indexer_metadata_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.int32}), min_rank=1,
             max_rank=1, backward=None, gradient_free=True, ge_converter=False, socs=_A2_A3_950,
             limits={"package": "cann_ops_transformer"},
             doc="lightning_indexer's tiling metadata (COT ops/lightning_indexer.py); its GE converter raises",
         ))  # no autograd
def lightning_indexer_metadata(num_heads_q, num_heads_k, head_dim, topk, *, cu_seqlens_q=None, cu_seqlens_k=None,
                               seqused_q=None, seqused_k=None, cmp_residual_k=None, batch_size=None, max_seqlen_q=None,
                               max_seqlen_k=None, layout_q=None, layout_k=None, mask_mode=None, cmp_ratio=None):
    _check_heads("lightning_indexer_metadata", num_heads_q, num_heads_k)
    return _metadata_header(_li_values(num_heads_q, num_heads_k, head_dim, topk, batch_size, max_seqlen_q, mask_mode,
                                       cmp_ratio), _LI_HEADER)


def _cann_indexer_out_shape(q, n2, topk, layout_q):
    return (q.shape[0], q.shape[1], n2, topk) if layout_q == "BSND" else (q.shape[0], n2, topk)


def _cann_lightning_indexer_fake(q, k, w, topk, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                                 seqused_k=None, cmp_residual_k=None, block_table=None, output_idx_offset=None,
                                 metadata=None, max_seqlen_q=-1, layout_q="BSND", layout_k="BSND", mask_mode=0,
                                 cmp_ratio=1, return_value=0):
    shape = _cann_indexer_out_shape(q, k.shape[-2], topk, layout_q)
    values = q.new_empty(shape, dtype=torch.float32) if return_value else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(shape, dtype=torch.int32), values


@op_spec("cann_ops_transformer::lightning_indexer",
         schema="lightning_indexer(Tensor q, Tensor k, Tensor w, int topk, *, Tensor? cu_seqlens_q=None, Tensor? "
                "cu_seqlens_k=None,Tensor? seqused_q=None, Tensor? seqused_k=None, Tensor? cmp_residual_k=None, Tensor?"
                " block_table=None, Tensor? output_idx_offset=None, Tensor? metadata=None, int max_seqlen_q=-1,str "
                'layout_q="BSND", str layout_k="BSND", int mask_mode=0, int cmp_ratio=1,int return_value=0) -> (Tensor,'
                " Tensor)",
         fake=_cann_lightning_indexer_fake, samples=_cann_indexer_samples,
         python_autograd="none in the extension (torchtitan-npu trains V4's indexer through its fused KL-loss op)",
         capability=OpCapability(
             dtypes=HALF_DTYPES,  # q and k; w fp32
             min_rank=3,
             max_rank=4,
             backward=None,  # none in the extension
             # the values' gradient (lightning_indexer's recognised V4 indexer in training): the rule calls
             # npu_lightning_indexer_grad (sparse_mode 0) over the op's listed blocks
             autograd_rule="npu_fx_fusion.patterns.lightning_indexer.CompressedLightningIndexer",
             gradient_free=True,  # the CSA form uses its int32 indices only (return_value False)
             ge_converter=False,  # graph_convert_lightning_indexer.py: the metadata op only, and it raises
             socs=_A2_A3_950,
             limits={
                 "package": "cann_ops_transformer",
                 "head_dim": 128, "key_heads": 1, "max_query_heads": 64, "metadata_query_heads": (32, 64),
                 "max_topk": 2048, "large_topks": (3072, 4096, 5120, 6144, 7168, 8192),
                 "mask_modes": (0, 3), "max_cmp_ratio": 128,
                 "weights_dtype": torch.float32,
                 "backward_op": "npu.npu_lightning_indexer_grad",
             },
             doc="deepseek_v4.md 8.2 / COT docs/zh/lightning_indexer.md: 950, A2, A3; q (B, S1, N1, 128) / (T1, N1, "
             "128), k one head, w fp32 (B, S1, N1); topk 1..2048 (+ 3072..8192); mask_mode 3 with cmp_ratio and "
             "cmp_residual_k: the compressed right-down causal mask; indices int32 (-1 padded); no autograd; no GE "
             "converter",
         ))
def cann_lightning_indexer(q, k, w, topk, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                           cmp_residual_k=None, block_table=None, output_idx_offset=None, metadata=None,
                           max_seqlen_q=-1, layout_q="BSND", layout_k="BSND", mask_mode=0, cmp_ratio=1,
                           return_value=0):
    op = "lightning_indexer"
    _check_layouts(op, layout_q, layout_k, "layout_k", key_layouts=LAYOUTS)
    if block_table is not None or output_idx_offset is not None:
        raise NotImplementedError(f"{op}: paged keys and output_idx_offset have no CPU reference")
    _check_rank(op, "q", q, layout_q)
    _check_rank(op, "k", k, layout_k)
    _check_float_pair(op, "q", q, "k", k)
    if k.shape[-1] != q.shape[-1] or _shape(w) != _shape(q)[:-1]:
        raise RuntimeError(f"{op}: k's head dim must be q's and w q's shape without D, got {_shape(k)} and {_shape(w)}")
    n1, n2, d = q.shape[-2], k.shape[-2], q.shape[-1]
    g = _check_heads(op, n1, n2)
    if topk <= 0 or mask_mode not in (0, 3) or not 1 <= cmp_ratio <= 128:
        raise RuntimeError(f"{op}: topk > 0, mask_mode 0 / 3 and cmp_ratio in [1, 128] expected, got {topk}, "
                           f"{mask_mode} and {cmp_ratio}")
    if mask_mode == 3 and cmp_ratio != 1 and cmp_residual_k is None:
        raise RuntimeError(f"{op}: mask_mode 3 with cmp_ratio {cmp_ratio} needs cmp_residual_k")
    bsnd = layout_q == "BSND"
    _check_metadata_header(op, metadata, _li_values(n1, n2, d, topk, q.shape[0] if bsnd else 0,
                                                    q.shape[1] if bsnd else 0, mask_mode, cmp_ratio), _LI_HEADER)
    starts, lens = _query_batches(op, layout_q, q, _smla_lengths(op, layout_q, cu_seqlens_q, seqused_q, "q"), "q lengths")
    key_rows = _key_rows(op, layout_k, k, _smla_lengths(op, layout_k, cu_seqlens_k, seqused_k, "k"), None, len(lens),
                         "k lengths")
    residual = _per_batch(op, "cmp_residual_k", cmp_residual_k, len(lens), [0] * len(lens))
    acc = _compute_dtype(q)
    q_flat, w_flat, k_flat = q.reshape(-1, n2, g, d), w.reshape(-1, n2, g), k.reshape(-1, n2, d)
    rows = q_flat.shape[0]
    indices = torch.full((rows, n2, topk), -1, dtype=torch.int32)
    values = torch.full((rows, n2, topk), float("-inf"), dtype=acc)
    for b, (start, lq) in enumerate(zip(starts, lens)):
        k_b = key_rows[b]
        lk = k_b.numel()
        if lq == 0 or lk == 0:
            continue
        rs = slice(start, start + lq)
        score = (torch.einsum("ingd,jnd->ingj", q_flat[rs].to(acc), k_flat[k_b].to(acc)).relu()
                 * w_flat[rs].to(acc).unsqueeze(-1)).sum(2)  # (lq, n2, lk)
        if mask_mode == 3:
            full = lk * cmp_ratio + residual[b]
            visible = (full - lq + torch.arange(lq) + 1) // cmp_ratio  # keys j < visible
            score = score.masked_fill(torch.arange(lk).view(1, 1, -1) >= visible.view(-1, 1, 1), float("-inf"))
        n = min(topk, lk)
        vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)
        vals, idx = vals[..., :n], idx[..., :n]
        indices[rs, :, :n] = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
        values[rs, :, :n] = vals
    shape = _cann_indexer_out_shape(q, n2, topk, layout_q)
    sparse_values = values.to(torch.float32 if acc == torch.float32 else acc).view(shape) if return_value \
        else q.new_empty((0,), dtype=torch.float32)
    return indices.view(shape), sparse_values
