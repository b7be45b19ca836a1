"""Paged KV cache: the slot-mapping writes npu_scatter_pa_kv_cache_functional (key and value
in one call) and npu_scatter_nd_update (one cache), and the block-table read FIA does.

Reference semantics: the torch_npu 2.13.0 docstrings (`_op_plugin_docs.py`
"npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score" page attention), the CANN
README of ScatterPaKvCache (ops-transformer attention/scatter_pa_kv_cache/README.md), the
op-plugin kernels (op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp: the functional op
clones both caches and calls aclnnScatterPaKvCache with scatter_mode "None"), the wheel's
Meta functions and shared/reference/attention_inference.md 4.2-4.3.

npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping,
cache_mode="Norm"): the ND layout (the README's scenario 2). key (T, N, Dk) and value
(T, N, Dv) are the T new tokens; the caches are (num_blocks, block_size, N, Dk|Dv); token t
goes to slot slot_mapping[t], i.e. block slot // block_size at offset slot % block_size:

    key_cache.view(-1, N, Dk)[slot_mapping[t]] = key[t]     (value alike)

Returns (key_cache', value_cache'), the caches with the writes (the Meta function's
empty_like of each). The kernel checks no bounds ("slot_mapping的值范围[0,num_blocks*
block_size-1]"), and "元素值保证不重复，重复时不保证正确性": a slot written twice holds one of
the rows, which one is not said. The stand-in refuses a slot out of range (IndexError, as
scatter_update's does) and writes duplicates in token order (the last one wins, what
index_copy does on CPU); a pass that emits the op notes that the NPU promises nothing for
such a slot. The NZ layout (cache_mode "PA_NZ", FRACTAL_NZ caches) and the compressed
scenarios (4-D keys with seq_lens / compress_lens) are not implemented.

npu_scatter_nd_update(self, indices, updates): TensorFlow's ScatterNd update,
`self[tuple(indices[i])] = updates[i]`; with indices (T, 1) on a (S, ...) tensor it is
index_copy along dim 0 (attention_inference.md 4.3). Duplicated indices: the kernel does
not say which row wins; the stand-in writes in order.

`paged_to_dense(cache, block_table, block_size)` is FIA's page-attention read (its
reference kernel calls it): the blocks of each batch row's table, in table order, as
(B, N, blocks * block_size, D).
"""
from __future__ import annotations

import torch

from .kv_cache import ALIASED_OUTPUT
from .spec import OpCapability, Sample, SocLimits, in_layout_of, op_spec

_PA = "npu_scatter_pa_kv_cache_functional"
_HALF = frozenset({torch.float16, torch.bfloat16})


def _randn(*shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _checked_slots(op: str, slots: torch.Tensor, count: int, capacity: int) -> list[int]:
    if slots.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{op}: the slots must be int32 or int64, got {slots.dtype}")
    if slots.numel() != count:
        raise RuntimeError(f"{op}: {slots.numel()} slots for {count} tokens")
    values = slots.reshape(-1).tolist()
    for token, slot in enumerate(values):
        if not 0 <= slot < capacity:
            raise IndexError(f"{op}: token {token} goes to slot {slot} of a cache of {capacity} slots; the NPU "
                             "kernel does not check this and would write out of bounds")
    return values


# ---- npu_scatter_pa_kv_cache_functional ---------------------------------------------------
def _scatter_pa_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                              compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    return torch.empty_like(key_cache), torch.empty_like(value_cache)  # the Meta function's


def _scatter_pa_kv_cache_samples(dtype):
    # T=3 tokens, N=2 heads, Dk=8, Dv=4; 4 blocks of 5 slots; tokens to scattered slots
    for seed, slots in ((0, [7, 0, 19]), (1, [12, 13, 3])):
        key, value = _randn(3, 2, 8, dtype=dtype, seed=seed), _randn(3, 2, 4, dtype=dtype, seed=seed + 10)
        key_cache, value_cache = _randn(4, 5, 2, 8, dtype=dtype, seed=seed + 20), _randn(4, 5, 2, 4, dtype=dtype,
                                                                                       seed=seed + 30)
        for index_dtype in (torch.int32, torch.int64):
            yield Sample((key, value, key_cache, value_cache, torch.tensor(slots, dtype=index_dtype)),
                         {"cache_mode": "Norm"})


@op_spec(f"npu::{_PA}",
         schema=f"{_PA}(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slot_mapping, *, "
         "Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, Tensor? seq_lens=None, "
         "str? cache_mode='PA_NZ') -> (Tensor, Tensor)",
         fake=_scatter_pa_kv_cache_fake,
         capability=OpCapability(
             # the CANN README: on A2 / A3 key and value FLOAT16, BFLOAT16, INT8 only (the torch_npu
             # docstring also lists float, which the A2 / A3 kernel does not take)
             dtypes=frozenset({torch.float16, torch.bfloat16, torch.int8}),
             min_rank=3,  # key / value (T, N, D)
             max_rank=3,
             backward=None,
             # custom/npu_scatter_pa_kv_cache.py: TensorMove of both caches + ScatterPaKvCache; the GE
             # pass optimize_reference_op_redundant_copy (_ge_concrete_graph/graph_pass.py) drops the
             # TensorMove and the Assign back when a cache is a graph input used by nothing else
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},  # README: A2, A3, Ascend 950
             limits={
                 "cache_modes": ("Norm",),  # ND caches (num_blocks, block_size, N, D); PA_NZ needs NZ caches
                 "cache_rank": 4,
                 "indices_dtypes": (torch.int32, torch.int64),
                 "bounds_checked": False,  # "slot_mapping的值范围[0,num_blocks*block_size-1]", unchecked
                 "unique_slots": True,  # "元素值保证不重复，重复时不保证正确性"
                 # torchair 2.13's ACL modes re-inplace only the ops of graph_pass.py's table
                 # (kv_rmsnorm_rope_cache_v2, mla_prolog_v3, add_rms_norm_v2): there the functional
                 # op clones both caches (op_plugin ScatterPaKvCacheNpuOpApi.cpp) every call
                 "acl_reinplaced": False,
             },
             doc="torch_npu 2.13.0 docstring npu_scatter_pa_kv_cache (scenario 2: key/value (T, N, D), caches "
             "(num_blocks, block_size, N, D), slot_mapping (T,) int32/int64, no bounds check, unique slots); "
             "CANN README attention/scatter_pa_kv_cache (A2/A3: fp16/bf16/int8; cache_mode Norm = ND, PA_NZ = "
             "FRACTAL_NZ; the NHSD scatter_mode of head-major caches exists in CANN, but torch_npu 2.13 always "
             "passes scatter_mode 'None'); GE converter for _functional only; no autograd"),
         samples=_scatter_pa_kv_cache_samples,
         sample_dtypes=(torch.float32, torch.float16, torch.bfloat16),
         # the caches are written, not read as values: layouts of key and value only
         layouts=("contiguous",))
def npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                                       compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    if cache_mode not in (None, "Norm"):
        raise NotImplementedError(f"{_PA}: cache_mode {cache_mode!r}: the stand-in implements the ND layout "
                                  "(None / 'Norm'); PA_NZ takes FRACTAL_NZ caches")
    if any(t is not None for t in (compress_lens, compress_seq_offsets, seq_lens)):
        raise NotImplementedError(f"{_PA}: the compressed scenarios (compress_lens, seq_lens) are not implemented")
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise RuntimeError(f"{_PA}: key and value must be (T, N, D) and the caches (num_blocks, block_size, N, D), "
                           f"got {tuple(key.shape)}, {tuple(value.shape)}, {tuple(key_cache.shape)}, "
                           f"{tuple(value_cache.shape)}")
    if key.shape[:2] != value.shape[:2]:
        raise RuntimeError(f"{_PA}: key {tuple(key.shape)} and value {tuple(value.shape)} differ in T or N")
    for name, rows, cache in (("key", key, key_cache), ("value", value, value_cache)):
        if cache.shape[2:] != rows.shape[1:]:
            raise RuntimeError(f"{_PA}: {name}_cache {tuple(cache.shape)} does not hold {name} rows "
                               f"{tuple(rows.shape[1:])}")
        if cache.dtype != key.dtype or rows.dtype != key.dtype:
            raise RuntimeError(f"{_PA}: key, value and both caches must have one dtype")
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise RuntimeError(f"{_PA}: the caches differ in blocks or block size: {tuple(key_cache.shape)}, "
                           f"{tuple(value_cache.shape)}")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    slots = _checked_slots(_PA, slot_mapping, key.shape[0], capacity)
    key_out, value_out = key_cache.clone(), value_cache.clone()  # the op-plugin kernel's clones
    key_rows, value_rows = key_out.view(capacity, *key.shape[1:]), value_out.view(capacity, *value.shape[1:])
    for token, slot in enumerate(slots):
        key_rows[slot] = key[token]
        value_rows[slot] = value[token]
    return key_out, value_out


# ---- npu_scatter_nd_update ------------------------------------------------------------------
_ND = "npu_scatter_nd_update"


def _scatter_nd_update_fake(self, indices, updates):
    return torch.empty_like(self)  # the Meta function's


def _scatter_nd_update_samples(dtype):
    # rows of a (6, 2, 4) cache, as (6, 8) with (T, 1) indices; and a 2-d index into (3, 4, 5)
    cache, rows = _randn(6, 8, dtype=dtype, seed=0), _randn(3, 8, dtype=dtype, seed=1)
    for index_dtype in (torch.int32, torch.int64):
        yield Sample((cache, torch.tensor([[4], [0], [5]], dtype=index_dtype), rows), layout_args=(0, 2))
    yield Sample((_randn(3, 4, 5, dtype=dtype, seed=2), torch.tensor([[2, 1], [0, 3]]), _randn(2, 5, dtype=dtype,
                                                                                              seed=3)))


@op_spec(f"npu::{_ND}",
         schema=f"{_ND}(Tensor self, Tensor indices, Tensor updates) -> Tensor",
         fake=_scatter_nd_update_fake,
         capability=OpCapability(
             dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool}),
             min_rank=1,
             max_rank=8,
             backward=None,
             # custom/npu_scatter_nd_update.py: TensorMove + ScatterNdUpdate; npu_scatter_nd_update_ ->
             # ScatterNdUpdate in place, which recover_view_inplace_pattern substitutes for
             # placeholder -> view -> npu_scatter_nd_update -> view -> copy_(placeholder)
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={"indices_dtypes": (torch.int32, torch.int64), "bounds_checked": False,
                     "reinplace_min_cann": "8.3.RC1"},
             doc="attention_inference.md 4.2-4.3 / op-plugin docs torch_npu-npu_scatter_nd_update_.md: "
             "TensorFlow ScatterNd update, indices >= 2-D with last dim a <= self.dim(), updates "
             "indices.shape[:-1] + self.shape[a:]; fp32/fp16/bf16/int64/int8/bool (A2/A3); GE converters for "
             "the functional and the in-place op; Meta empty_like(self); no autograd"),
         samples=_scatter_nd_update_samples,
         sample_dtypes=(torch.float32, torch.float16, torch.bfloat16),
         layouts=("contiguous", "transposed", "sliced"))
def npu_scatter_nd_update(self, indices, updates):
    out = self.clone(memory_format=torch.contiguous_format)
    _scatter_nd_update_into(_ND, out, indices, updates)
    return in_layout_of(out, self)


def _scatter_nd_update_into(op, data, indices, updates):
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() < 2:
        raise RuntimeError(f"{op}: indices must be int32/int64 with at least 2 dims, got {indices.dtype} "
                           f"{tuple(indices.shape)}")
    depth = indices.shape[-1]
    if depth > data.dim() or tuple(updates.shape) != tuple(indices.shape[:-1]) + tuple(data.shape[depth:]):
        raise RuntimeError(f"{op}: updates {tuple(updates.shape)} must be indices.shape[:-1] + "
                           f"self.shape[{depth}:] = {tuple(indices.shape[:-1]) + tuple(data.shape[depth:])}")
    rows = updates.reshape(-1, *data.shape[depth:])
    for row, index in enumerate(indices.reshape(-1, depth).tolist()):
        if any(not 0 <= i < size for i, size in zip(index, data.shape)):
            raise IndexError(f"{op}: index {index} is outside {tuple(data.shape[:depth])}; the NPU kernel does "
                             "not check this and would write out of bounds")
        data[tuple(index)] = rows[row]


def _scatter_nd_update__fake(self, indices, updates):
    return self


def _scatter_nd_update__samples(dtype):
    for sample in _scatter_nd_update_samples(dtype):
        yield Sample(sample.args, layout_args=(0, 2))


@op_spec(f"npu::{_ND}_", schema=f"{_ND}_(Tensor(a!) self, Tensor indices, Tensor updates) -> Tensor(a!)",
         fake=_scatter_nd_update__fake, samples=_scatter_nd_update__samples,
         sample_dtypes=(torch.float32, torch.float16, torch.bfloat16),
         layouts=("contiguous", "transposed", "sliced"),  # no write into an expanded tensor
         opcheck_skips=dict.fromkeys(("test_aot_dispatch_static", "test_aot_dispatch_dynamic"), ALIASED_OUTPUT))
def npu_scatter_nd_update_(self, indices, updates):
    # Only torchair's recover_view_inplace_pattern emits it (from npu_scatter_nd_update between
    # two views and a copy_ into a graph input); the passes never do.
    _scatter_nd_update_into(f"{_ND}_", self, indices, updates)
    return self


# ---- FIA's page-attention read ------------------------------------------------------------
def paged_to_dense(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, kv_heads: int,
                   op: str) -> torch.Tensor:
    """(B, N, blocks * block_size, D): each batch row's blocks in table order.

    `cache` is (num_blocks, block_size, N * D) or (num_blocks, N, block_size, D), the two
    page-attention layouts of the FIA docstring ("kv cache排布支持(blocknum, blocksize, H)和
    (blocknum, KV_N, blocksize, D)"); block_table (B, max_blocks) int32 holds block ids the
    kernel does not check ("不会对blockid的合法性进行校验"): the stand-in refuses one out of range."""
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise RuntimeError(f"{op}: block_table must be 2-D int32 (B, max_blocks), got {block_table.dtype} "
                           f"{tuple(block_table.shape)}")
    if block_size <= 0:
        raise RuntimeError(f"{op}: page attention needs block_size > 0")
    if cache.dim() == 3 and cache.shape[1] == block_size and cache.shape[2] % kv_heads == 0:
        blocks = cache.unflatten(-1, (kv_heads, cache.shape[2] // kv_heads)).transpose(1, 2)  # (nb, N, bs, D)
    elif cache.dim() == 4 and cache.shape[1] == kv_heads and cache.shape[2] == block_size:
        blocks = cache
    else:
        raise RuntimeError(f"{op}: a paged cache is (num_blocks, {block_size}, N*D) or (num_blocks, {kv_heads}, "
                           f"{block_size}, D), got {tuple(cache.shape)}")
    table = block_table.long()
    if bool(((table < 0) | (table >= blocks.shape[0])).any()):
        raise IndexError(f"{op}: block_table holds ids outside [0, {blocks.shape[0]}); the NPU kernel does not "
                         "check them and would read memory it does not own")
    batch, count = table.shape
    gathered = blocks[table]  # (B, max_blocks, N, bs, D)
    return gathered.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, count * block_size, blocks.shape[-1]).contiguous()


def paged_key_value(key, value, block_table, block_size, query_layout, num_heads, num_key_value_heads,
                    actual_seq_lengths_kv, op):
    """FIA's page attention: the paged `key` / `value` caches read through `block_table`, as
    the dense key and value of `query_layout` (BNSD, BSND or BSH) that the kernel attends to.
    The docstring's conditions: actual_seq_lengths_kv given ("page attention场景下, 必须传入
    actual_seq_lengths_kv"), key and value of one shape, contiguous caches."""
    if actual_seq_lengths_kv is None:
        raise RuntimeError(f"{op}: page attention (block_table) needs actual_seq_lengths_kv")
    if key.shape != value.shape or not key.is_contiguous() or not value.is_contiguous():
        raise RuntimeError(f"{op}: the paged key and value caches must be contiguous and of one shape, got "
                           f"{tuple(key.shape)} and {tuple(value.shape)}")
    kv_heads = num_heads if num_key_value_heads == 0 else num_key_value_heads
    dense = [paged_to_dense(cache, block_table, block_size, kv_heads, op) for cache in (key, value)]
    if query_layout == "BSND":
        return [t.transpose(1, 2).contiguous() for t in dense]
    if query_layout == "BSH":
        return [t.transpose(1, 2).flatten(-2).contiguous() for t in dense]
    return dense


def paged_value_dim(value: torch.Tensor, kv_heads: int) -> int:
    """The value head dim of a paged cache, as the Meta function reads it (get_value_d)."""
    return value.shape[2] // kv_heads if value.dim() == 3 else value.shape[3]
