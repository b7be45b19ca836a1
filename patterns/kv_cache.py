"""kv_cache: a static KV-cache write -> torch.ops.npu.scatter_update.

transformers' StaticLayer.update (cache_utils.py, 5.24) writes the new keys and values of
a step into preallocated (B, N_kv, max_cache_len, D) caches at the positions that follow
what the cache already holds:

    position = arange(S) + cumulative_length           cumulative_length: a 0-d tensor
    keys.index_copy_(2, position, key_states)
    values.index_copy_(2, position, value_states)

aot_autograd functionalizes the in-place writes into `index_copy` and, because torchair
compiles with keep_inference_input_mutations=True, a `copy_` of the result back into the
cache input at the end of the graph (attention_inference.md 4.1). scatter_update(data,
offsets, updates, axis) writes row b of `updates` at offsets[b] along `axis`
(npu_ops/kv_cache.py): the same thing exactly when every batch row writes the same
contiguous run start .. start + S - 1, which the form proves by spelling the positions as
`arange(S) + start` with `start` a 0-d tensor. Any other index (a caller's cache_position,
a strided or per-batch index) is not this form and stays unfused, with a near miss.

Each write is one site. The key and the value write share their positions, so the form
returns the positions as a second output (torch's matcher would otherwise refuse a shared
intermediate, and a two-write pattern of two identical halves can bind both halves to one
write): the first fused write recomputes them for the second, and once both are fused
nothing reads them.

The fused write is emitted on a (B, 1, N_kv, max_cache_len, D) view of the cache, viewed
back: `placeholder -> view -> scatter_update -> view -> copy_(placeholder)` is what
torchair's recover_view_inplace_pattern turns into the in-place scatter_update_ and
drops the copy_ (CANN >= 8.3.RC1), so the step writes S rows instead of copying the cache
(GE's converter of the functional op is TensorMove + Scatter). A same-shape view would not
do: torchair's remove_noop_ops runs first and deletes it. The inserted unit dim keeps the
batch as dim 0, whose rows the offsets index (aclnnInplaceScatterUpdate: "indices 1-D:
one offset per batch (highest) dim along axis"), so the update goes in as a view of what
the model computed, whatever its strides (the kernel takes non-contiguous updates, per the
torch_npu docs): a key or value that is a slice of a merged q/k/v projection is not
copied first, as a (B * N_kv, S, D) view of it would have to be.

The NPU kernel does not check bounds ("索引越界不校验"): where eager index_copy raises
once a StaticCache overflows, the fused write would write past the cache. The site's note
says so; keeping start + S <= max_cache_len is the caller's job, as with the real cache.
"""
import torch

from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
SCATTER_UPDATE = CAPABILITIES["npu.scatter_update"]
SEQUENCE_DIM = 2  # of a (B, N, max_cache_len, D) cache


# ---- the unfused form -------------------------------------------------------------------
def static_cache_write(cache, update, start):
    """One of StaticLayer.update's two writes. The positions are an output too: the other
    write (of the value cache) reads them, and the fused write recomputes them for it (once
    both are fused nothing reads them and they go)."""
    position = torch.arange(update.shape[-2], device=update.device) + start
    return cache.index_copy(2, position, update), position


# ---- the fused call -----------------------------------------------------------------------
def _scatter_update_rows(cache, offsets, update):
    """scatter_update on the (B, 1, N, max_len, D) view: batch row b writes at offsets[b]."""
    batch, heads, length, dim = cache.shape
    written = torch.ops.npu.scatter_update(cache.view(batch, 1, heads, length, dim), offsets,
                                           update.unsqueeze(1), -2)
    return written.view(batch, heads, length, dim)


def scatter_update_write(cache, update, start):
    # int64 (B,): the same contiguous run for every batch row
    written = _scatter_update_rows(cache, start.expand(cache.shape[0]), update)
    position = torch.arange(update.shape[-2], device=update.device) + start
    return written, position


def static_cache_write_at(cache, position, update):
    """The same write with its positions an argument, proven `arange(S) + start` by the check:
    with a symbolic S torch's retrace of the first form spells arange(sym_size(update)),
    where dynamo's graph reads S from a SymInt input."""
    return cache.index_copy(2, position, update)


def scatter_update_write_at(cache, position, update):
    # position[0] = start, for every batch row (views)
    return _scatter_update_rows(cache, position.narrow(0, 0, 1).expand(cache.shape[0]), update)


FORMS = [
    Form(static_cache_write, scatter_update_write, dtypes=(torch.float32,)),  # no casts: one trace
    Form(static_cache_write_at, scatter_update_write_at, dtypes=(torch.float32,)),
]


# ---- checks -------------------------------------------------------------------------------
def check(site):
    cache, update = site["cache"], site["update"]
    if "position" in site.args:
        reason = _positions_reason(site.arg_nodes["position"], update)
        if reason:
            return reason
        start = tensor_meta(site.arg_nodes["position"].args[1])
    else:
        start = site["start"]
    if start.dim() != 0 or start.dtype not in SCATTER_UPDATE.limits["indices_dtypes"]:
        return (f"the write starts at a {str(start.dtype)[6:]}{list(start.shape)} tensor, not a 0-d int32/int64 "
                "position shared by the whole batch")
    if cache.dim() != 4 or update.dim() != 4:
        return f"the cache is {cache.dim()}-d and its update {update.dim()}-d, not (B, N, max_len, D)"
    if (cache.shape[0], cache.shape[1], cache.shape[3]) != (update.shape[0], update.shape[1], update.shape[3]):
        return f"the cache {list(cache.shape)} and its update {list(update.shape)} differ outside the sequence dim"
    reason = unsupported("npu.scatter_update", site.soc, x=cache)
    if reason:
        return reason
    site.notes.append("scatter_update does not check bounds: start + S must stay within max_cache_len "
                      "(eager index_copy raises past it)")
    site.notes.append(_reinplace_note(site.arg_nodes["cache"]))
    return None


def _positions_reason(position, update):
    """Why `position` is not proven to be arange(S) + a 0-d start, S the update's length."""
    if not _is_arange_plus_start(position):
        return ("the write positions are not proven contiguous: the index is not arange(S) + a 0-d start "
                f"({getattr(position, 'target', position)}), so every batch row may write elsewhere")
    length = position.args[0].args[0]
    length = length.meta.get("val") if isinstance(length, torch.fx.Node) else length
    if update is None:
        return None
    if len(position.args[0].args) > 1 or not statically_known_true(sym_eq(length, update.shape[2])):
        return f"the positions are arange({length}), the update has {update.shape[2]} of them"
    return None


def _reinplace_note(cache):
    """Whether torchair will write in place: the cache an input written back by a copy_."""
    users = list(cache.users)
    copies = [u for u in users if is_call(u, aten.copy_.default) and u.args[0] is cache]
    if cache.op == "placeholder" and len(users) == 2 and len(copies) == 1:
        return ("the cache input is written back (copy_): torchair's recover_view_inplace_pattern makes it "
                "scatter_update_ in place (CANN >= 8.3.RC1)")
    return ("the cache is not a graph input only written back by a copy_ (allocated in the graph, or read "
            "elsewhere): the write stays functional, a copy of the cache")


# ---- near misses: an index_copy no form consumed -------------------------------------------
def anchor(node):
    # a write along dim 0 writes whole token rows: paged_kv_cache's (a slot-mapping write)
    cache = tensor_meta(node.args[0]) if is_call(node, aten.index_copy.default) else None
    return cache is not None and not (cache.dim() >= 2 and node.args[1] % cache.dim() == 0)


def _is_arange_plus_start(index):
    if not is_call(index, aten.add.Tensor):
        return False
    a, b = index.args[:2]
    start = tensor_meta(b)
    return is_call(a, aten.arange.default) and start is not None and start.dim() == 0


def explain(node):
    cache, dim, index = node.args[:3]
    value = tensor_meta(cache)
    rank = value.dim() if value is not None else None
    if rank is not None and dim % rank != SEQUENCE_DIM:
        return (f"the write runs along dim {dim} of a {rank}-d cache: the form is transformers' (B, N, "
                f"max_len, D) cache written along dim {SEQUENCE_DIM} (scatter_update writes along its last "
                "two dims, with offsets over dim 0)")
    return _positions_reason(index, tensor_meta(node.args[3]))


PASS = FusionPass(
    name="kv_cache",
    fused_op="npu.scatter_update",
    forms=FORMS,
    example={
        # B=2, N_kv=3, max_cache_len=8, D=4; 2 new positions
        "cache": lambda dtype: torch.empty(2, 3, 8, 4, dtype=dtype),
        "update": lambda dtype: torch.empty(2, 3, 2, 4, dtype=dtype),
        "start": lambda dtype: torch.empty((), dtype=torch.int64),
        "position": lambda dtype: torch.empty(2, dtype=torch.int64),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.index_copy.default,),
    explain=explain,
    verify_input=lambda name, args: _verification_positions(name, args),
    # kv_rmsnorm_rope_cache's op takes the latent caches' writes itself
    after=("kv_rmsnorm_rope_cache",),
)


def _verification_positions(name, args):
    """For FusionConfig(verify=True): a write inside the cache, at the positions the check
    proved (random integers would write anywhere)."""
    if name == "start":
        return torch.ones((), dtype=args["start"].dtype)
    if name == "position":
        return torch.arange(int(args["position"].shape[0]), dtype=args["position"].dtype) + 1
    return None
