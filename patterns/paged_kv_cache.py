"""paged_kv_cache: slot-mapping KV-cache writes -> npu_scatter_pa_kv_cache_functional (key and
value in one call), or npu_scatter_nd_update (one cache).

A paged cache holds one row per token slot: (num_blocks, block_size, N, D), written through
its (num_blocks * block_size, N, D) view at the slots of the new tokens (vLLM's
reshape_and_cache, a user's own paged cache, transformers' PagedAttentionCache):

    key_cache.view(-1, N, D).index_copy_(0, slots, key)          key (T, N, D), slots (T,)
    value_cache.view(-1, N, Dv).index_copy_(0, slots, value)

aot_autograd functionalizes each into `view -> index_copy -> view back`, copied into the
cache input at the end of the graph (attention_inference.md 4.1). Any slots are a valid
write: no layout needs proving, the slot is the row.

- Two such writes into two caches that do not share memory, at one slot tensor, are one
  npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slots,
  cache_mode="Norm") (npu_ops/paged_cache.py): the ND layout of the torch_npu docstring's
  scenario 2, slot s at block s // block_size, offset s % block_size, which is row s of the
  view. The caches are passed as the graph holds them, (num_blocks, block_size, N, D): in
  max-autotune torchair's GE pass optimize_reference_op_redundant_copy drops the op's
  TensorMove of a cache that is a graph input used by nothing but the write and its copy
  back, so it writes in place. In reduce-overhead and npugraph_ex it does not: torchair
  2.13 re-inplaces only the ops of its graph_pass.py table (kv_rmsnorm_rope_cache_v2,
  mla_prolog_v3, add_rms_norm_v2), and the functional op clones both caches every call
  (op-plugin ScatterPaKvCacheNpuOpApi.cpp). There the pair is refused and each write
  takes the single-cache op below, which torchair writes in place in every mode.
- A single write (one cache; or two writes into views of one buffer, as transformers'
  PagedAttentionCache holds the keys and values of every layer, which one functional call
  cannot return as two caches) is npu_scatter_nd_update(cache.view(S, -1), slots.view(-1, 1),
  rows.view(T, -1)): index_copy along dim 0 is a ScatterNd update of whole rows. Written as
  `placeholder -> view -> npu_scatter_nd_update -> view -> copy_(placeholder)`, torchair's
  recover_view_inplace_pattern makes it npu_scatter_nd_update_ in place (CANN >= 8.3.RC1).
  It also gives max-autotune a write it can lower: aten.index_copy has no GE converter
  (torchair ge_converter/aten/index_copy.py raises NotImplementedError).

Neither kernel checks bounds, and both leave a slot written twice undefined (ScatterPaKvCache:
"元素值保证不重复，重复时不保证正确性"); eager index_copy raises on the first and writes one of
the rows on the second. The site's note says so.

The contiguous StaticCache (B, N, max_len, D) is not a paged cache: its slots hold one head
each, N * D apart (kv_cache keeps its two scatter_update writes). No torch_npu 2.13 op writes
key and value together into it: ScatterPaKvCache's ND mode takes token-major blocks
(num_blocks, block_size, N, D); its head-major NHSD mode exists in CANN, but torch_npu 2.13
always calls aclnnScatterPaKvCache with scatter_mode "None" (op-plugin
ScatterPaKvCacheNpuOpApi.cpp, torchair custom/npu_scatter_pa_kv_cache.py);
npu_qkv_rms_norm_rope_cache takes PA_NZ caches only (CANN README: "目前只支持PA_NZ"); and
npu_scatter_list writes one update tensor into a list of per-sequence caches
(docs/passes/paged_kv_cache.md).
"""
import torch

from npu_fx_fusion.capabilities import ACL_MODES, CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, known_equal, tensor_meta

aten = torch.ops.aten
PAIR_OP = "npu.npu_scatter_pa_kv_cache_functional"
ROWS_OP = "npu.npu_scatter_nd_update"
PAIR = CAPABILITIES[PAIR_OP]


# ---- the unfused forms ----------------------------------------------------------------------
def paged_write_pair(key_cache, value_cache, slots, key, value):
    """The key and the value of T tokens written into a (num_blocks, block_size, N, D) cache
    pair through its token-row view."""
    keys = key_cache.view(-1, key.shape[-2], key.shape[-1]).index_copy(0, slots, key)
    values = value_cache.view(-1, value.shape[-2], value.shape[-1]).index_copy(0, slots, value)
    return keys.view(key_cache.shape), values.view(value_cache.shape)


def paged_write(cache, slots, rows):
    """One cache written through a view of its token rows."""
    return cache.view(-1, *rows.shape[1:]).index_copy(0, slots, rows).view(cache.shape)


def slot_write(row_cache, slots, rows):
    """Rows written along dim 0 of a cache as it is (a (slots, N, D) cache, a view of a
    shared buffer)."""
    return row_cache.index_copy(0, slots, rows)


# ---- the fused calls --------------------------------------------------------------------------
def scatter_pa_kv_cache(key_cache, value_cache, slots, key, value):
    keys, values = torch.ops.npu.npu_scatter_pa_kv_cache_functional(
        key.contiguous(), value.contiguous(), key_cache, value_cache, slots, cache_mode="Norm")
    return keys, values


def scatter_rows(cache, slots, rows):
    """The cache viewed (slots, row size) as the graph holds it (one view: placeholder -> view
    -> op -> view -> copy_ is what torchair re-inplaces), the rows written, viewed back."""
    updates = rows.reshape(rows.shape[0], -1)
    written = torch.ops.npu.npu_scatter_nd_update(cache.view(-1, updates.shape[1]), slots.view(-1, 1), updates)
    return written.view(cache.shape)


def scatter_slot_rows(row_cache, slots, rows):
    return scatter_rows(row_cache, slots, rows)


FORMS = [
    Form(paged_write_pair, scatter_pa_kv_cache, dtypes=(torch.float32,)),  # no casts: one trace
    Form(paged_write, scatter_rows, dtypes=(torch.float32,)),
    Form(slot_write, scatter_slot_rows, dtypes=(torch.float32,)),
]


# ---- checks ------------------------------------------------------------------------------------
def check(site):
    if site.form.search is paged_write_pair:
        return _pair_reason(site)
    cache = site["cache"] if "cache" in site.args else site["row_cache"]
    return _rows_reason(site, cache, site["slots"], site["rows"])


def _slots_reason(slots, rows):
    if slots.dim() != 1 or slots.dtype not in PAIR.limits["indices_dtypes"]:
        return f"the slots are a {str(slots.dtype)[6:]}{list(slots.shape)} tensor, not one int32/int64 slot per token"
    if rows.dim() < 2 or not known_equal(slots.shape[0], rows.shape[0]):
        return f"{slots.shape[0]} slots for rows {list(rows.shape)}"
    return None


def _rows_reason(site, cache, slots, rows):
    reason = _slots_reason(slots, rows)
    if reason:
        return reason
    if cache.dim() < 2 or not cache.is_contiguous():
        return (f"the cache {list(cache.shape)} is not contiguous: npu_scatter_nd_update writes it viewed as "
                "(slots, row size)")
    reason = unsupported(ROWS_OP, site.soc, x=cache)
    if reason:
        return reason
    site.notes.append("npu_scatter_nd_update checks no bounds and leaves a slot written twice undefined (eager "
                      "index_copy raises past the cache, and writes one of the rows)")
    return None


def _pair_reason(site):
    key_cache, value_cache, slots, key, value = (site[name] for name in
                                                 ("key_cache", "value_cache", "slots", "key", "value"))
    nodes = site.arg_nodes
    if nodes["key_cache"] is nodes["value_cache"] or _shares_memory(nodes["key_cache"], nodes["value_cache"]):
        return ("the key and the value cache are views of one buffer (transformers' PagedAttentionCache): one "
                "functional npu_scatter_pa_kv_cache cannot return the two writes, each is written on its own")
    reason = _slots_reason(slots, key) or _slots_reason(slots, value)
    if reason:
        return reason
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != PAIR.limits["cache_rank"]:
        return (f"the cache {list(key_cache.shape)} and its rows {list(key.shape)} are not (num_blocks, block_size, "
                "N, D) and (T, N, D)")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "a cache is not contiguous: ScatterPaKvCache takes contiguous (num_blocks, block_size, N, D) caches"
    if not (known_equal(key_cache.shape[0], value_cache.shape[0])
            and known_equal(key_cache.shape[1], value_cache.shape[1])):
        return (f"the key cache {list(key_cache.shape)} and the value cache {list(value_cache.shape)} differ in blocks "
                "or block size")
    if site.mode in ACL_MODES:
        return (f"in {site.mode} torchair 2.13 does not re-inplace npu_scatter_pa_kv_cache_functional (graph_pass.py "
                "re-inplaces kv_rmsnorm_rope_cache_v2, mla_prolog_v3, add_rms_norm_v2 only): it would clone both "
                "caches every call, where npu_scatter_nd_update writes each in place")
    reason = site.hardware_limits([unsupported(PAIR_OP, site.soc, x=key)])
    if reason:
        return reason
    site.notes.append("key and value in one write; in max-autotune in place when each cache is a graph input read "
                      "by nothing but this write (torchair GE optimize_reference_op_redundant_copy); in "
                      "reduce-overhead / npugraph_ex the pair is not fused (the functional op would clone both caches)")
    site.notes.append("ScatterPaKvCache checks no bounds and leaves a slot written twice undefined (eager index_copy "
                      "raises past the cache, and writes one of the rows)")
    return None


def _shares_memory(a, b):
    """Whether two cache nodes are views of one buffer: of one graph input, through the views
    and the functionalized writes into it (as_strided_scatter and the like return the buffer
    written, aot_autograd's spelling of a write through a view of a shared base)."""
    return _base_of(a) is _base_of(b)


_SAME_BUFFER = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.as_strided.default,
                aten.slice.Tensor, aten.select.int, aten.alias.default, aten.as_strided_scatter.default,
                aten.slice_scatter.default, aten.select_scatter.default, aten.index_copy.default)


def _base_of(node):
    while is_call(node, *_SAME_BUFFER):
        node = node.args[0]
    return node


# ---- near misses: a write along dim 0 no form took ----------------------------------------------
def anchor(node):
    if not is_call(node, aten.index_copy.default):
        return False
    cache = tensor_meta(node.args[0])
    return cache is not None and cache.dim() >= 2 and node.args[1] % cache.dim() == 0


def explain(node):
    cache, _, slots, rows = node.args[:4]
    reason = _slots_reason(tensor_meta(slots), tensor_meta(rows))
    if reason:
        return reason
    value = tensor_meta(cache)
    if not value.is_contiguous():
        return (f"the cache {list(value.shape)} is not contiguous: npu_scatter_nd_update writes it viewed as "
                "(slots, row size)")
    return None


PASS = FusionPass(
    name="paged_kv_cache",
    fused_op=PAIR_OP,
    forms=FORMS,
    example={
        # 4 blocks of 8 slots, N=2 heads, D=4; 3 new tokens
        "key_cache": lambda dtype: torch.empty(4, 8, 2, 4, dtype=dtype),
        "value_cache": lambda dtype: torch.empty(4, 8, 2, 4, dtype=dtype),
        "cache": lambda dtype: torch.empty(4, 8, 2, 4, dtype=dtype),
        "row_cache": lambda dtype: torch.empty(32, 2, 4, dtype=dtype),  # (slots, N, D)
        "slots": lambda dtype: torch.empty(3, dtype=torch.int64),
        "key": lambda dtype: torch.empty(3, 2, 4, dtype=dtype),
        "value": lambda dtype: torch.empty(3, 2, 4, dtype=dtype),
        "rows": lambda dtype: torch.empty(3, 2, 4, dtype=dtype),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.index_copy.default,),
    explain=explain,
    verify_input=lambda name, args: _distinct_slots(args) if name == "slots" else None,
)


def _distinct_slots(args):
    """For FusionConfig(verify=True): distinct slots inside the cache (random integers could
    repeat, where the kernels promise nothing)."""
    count = int(args["slots"].shape[0])
    cache = next(args[name] for name in ("key_cache", "cache", "row_cache") if name in args)
    capacity = int(cache.numel() // max(1, int(args.get("key", args.get("rows")).shape[1:].numel())))
    return torch.randperm(capacity)[:count].to(args["slots"].dtype)
