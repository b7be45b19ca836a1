"""KV-cache writes: scatter_update (+ its in-place twin) and DeepSeek's latent-cache op
npu_kv_rmsnorm_rope_cache_v2_functional.

Reference semantics: shared/reference/attention_inference.md sections 4.3 and 5.1; the
torch_npu 2.13.0 docstring of scatter_update (`_op_plugin_docs.py`), the CANN README of
KvRmsNormRopeCache (ops-transformer posembedding/kv_rms_norm_rope_cache/README.md) and
torch_npu's own golden for the op (test_npu_kv_rmsnorm_rope_cache.py, supported_op_exec),
and the wheel's Meta functions (op_plugin/meta/_meta_registrations.py).

scatter_update(data, indices, updates, axis): 1-D `indices` holds one offset per row of
dim 0 of data (its "batch"); along `axis` (the last or the second-to-last dim) row b of
`updates` is written at positions indices[b] .. indices[b] + updates.shape[axis] - 1:

    data[b, ..., indices[b] + k, ...] = updates[b, ..., k, ...]

Every other dim of updates equals data's. The kernel does not check bounds ("索引越界不校
验": an out-of-range offset writes memory it does not own on an NPU); the stand-in refuses
one with an IndexError instead of reproducing undefined behaviour. 2-D indices are
documented only as "1-D or 2-D" and are not implemented.

npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache, ckv_cache):
kv (B, 1, S, Dv + Dk) is split into its RMSNorm part kv[..., :Dv] (Dv = gamma's size) and
its RoPE part kv[..., Dv:] (Dk = cos's last dim), and in fp32:

    y = x / sqrt(mean(x^2) + epsilon) * gamma                      x = kv[..., :Dv]
    k = cat(r[..., 0::2], r[..., 1::2]) * cos + cat(-r[..., 1::2], r[..., 0::2]) * sin
                                                                   r = kv[..., Dv:]
(the rope part is de-interleaved, then rotated by halves: the "interleaveRope" of the
README). In cache_mode "Norm" the caches are (B, 1, cache_len, Dk) and (B, 1, cache_len,
Dv), and token s of batch b goes to position index[b, s] (index (B, S) int64, values in
[-1, cache_len), -1 writes nothing). Returns (k, y, k_cache', ckv_cache'): k and y rounded
to kv's dtype, the caches updated (their dtype). The paged modes, quantised caches and the
`v` input are not implemented (NotImplementedError).
"""
from __future__ import annotations

import torch

from ._library import stand_in


# ---- scatter_update / scatter_update_ ---------------------------------------------------
def _scatter_update_into(op: str, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor,
                         axis: int) -> None:
    rank = data.dim()
    if not 2 <= rank <= 8 or updates.dim() != rank:
        raise RuntimeError(f"{op}: data and updates must have one rank between 2 and 8, got "
                           f"{tuple(data.shape)} and {tuple(updates.shape)}")
    if updates.dtype != data.dtype:
        raise RuntimeError(f"{op}: updates ({updates.dtype}) must have data's dtype ({data.dtype})")
    if indices.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{op}: indices must be int32 or int64, got {indices.dtype}")
    if indices.dim() != 1:
        raise NotImplementedError(f"{op}: only 1-D indices (one offset per row of dim 0) are implemented; "
                                  "the docs do not say what 2-D indices mean")
    if axis not in (-1, -2, rank - 1, rank - 2) or axis % rank == 0:
        raise NotImplementedError(f"{op}: axis {axis} of a {rank}-D tensor: only the last two dims, not dim 0 "
                                  "(the rows the offsets index), are implemented")
    ax = axis % rank
    other = [d for d in range(rank) if d != ax]
    if indices.shape[0] != data.shape[0] or any(data.shape[d] != updates.shape[d] for d in other):
        raise RuntimeError(f"{op}: updates {tuple(updates.shape)} must match data {tuple(data.shape)} outside "
                           f"axis {axis}, and indices ({indices.shape[0]}) hold one offset per row of dim 0")
    count = updates.shape[ax]
    for b, start in enumerate(indices.tolist()):
        if not 0 <= start <= data.shape[ax] - count:
            raise IndexError(f"{op}: row {b} writes positions {start}..{start + count - 1} of a dim of size "
                             f"{data.shape[ax]}; the NPU kernel does not check this and would write out of bounds")
        data[b].narrow(ax - 1, start, count).copy_(updates[b])


def _scatter_update_fake(self, indices, updates, axis):
    return torch.empty_like(self)  # the Meta function's


@stand_in("npu::scatter_update", fake=_scatter_update_fake)  # no autograd in torch_npu
def scatter_update(self, indices, updates, axis):
    out = self.clone()
    _scatter_update_into("scatter_update", out, indices, updates, axis)
    return out


def _scatter_update__fake(self, indices, updates, axis):
    return self


@stand_in("npu::scatter_update_", fake=_scatter_update__fake)
def scatter_update_(self, indices, updates, axis):
    # Only torchair's recover_view_inplace_pattern emits it (from scatter_update between
    # two views and a copy_ into a graph input); the passes never do.
    _scatter_update_into("scatter_update_", self, indices, updates, axis)
    return self


# ---- npu_kv_rmsnorm_rope_cache_v2_functional ----------------------------------------------
_LATENT = "npu_kv_rmsnorm_rope_cache_v2_functional"


def _latent_sizes(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode):
    """Validate (the Meta function's checks and the Norm mode's); return (B, S, Dv, Dk)."""
    if kv.dim() != 4 or gamma.dim() != 1 or cos.dim() != 4:
        raise RuntimeError(f"{_LATENT}: kv and cos must be 4-D and gamma 1-D, got {tuple(kv.shape)}, "
                           f"{tuple(cos.shape)}, {tuple(gamma.shape)}")
    if cache_mode != "Norm":
        raise NotImplementedError(f"{_LATENT}: cache_mode {cache_mode!r}: only 'Norm' is implemented")
    batch, heads, seq, width = kv.shape
    dim_v, dim_k = gamma.shape[0], cos.shape[-1]
    if heads != 1:
        raise RuntimeError(f"{_LATENT}: kv must have N = 1 (the op is for DeepSeek's latent KV), got {heads}")
    if dim_v + dim_k != width or dim_k % 2:
        raise RuntimeError(f"{_LATENT}: kv's last dim {width} must be gamma's {dim_v} + an even rope dim "
                           f"(cos: {dim_k})")
    if tuple(cos.shape) != (batch, 1, seq, dim_k) or sin.shape != cos.shape:
        raise RuntimeError(f"{_LATENT}: cos and sin must be ({batch}, 1, {seq}, {dim_k}), got "
                           f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if tuple(index.shape) != (batch, seq) or index.dtype != torch.int64:
        raise RuntimeError(f"{_LATENT}: in Norm mode index must be int64 ({batch}, {seq}), got "
                           f"{index.dtype} {tuple(index.shape)}")
    for name, cache, dim in (("k_cache", k_cache, dim_k), ("ckv_cache", ckv_cache, dim_v)):
        if cache.dim() != 4 or cache.shape[0] != batch or cache.shape[1] != 1 or cache.shape[3] != dim:
            raise RuntimeError(f"{_LATENT}: in Norm mode {name} must be ({batch}, 1, cache_len, {dim}), got "
                               f"{tuple(cache.shape)}")
    if k_cache.shape[2] != ckv_cache.shape[2]:
        raise RuntimeError(f"{_LATENT}: k_cache and ckv_cache differ in length")
    return batch, seq, dim_v, dim_k


def _latent_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                 k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                 is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None):
    # the Meta function's: (k_embed (.., cos D), y (.., gamma D), k_cache', ckv_cache')
    lead = tuple(kv.shape[:-1])
    return (kv.new_empty((*lead, cos.shape[3])), kv.new_empty((*lead, gamma.shape[0])),
            torch.empty_like(k_cache), torch.empty_like(ckv_cache))


@stand_in(f"npu::{_LATENT}", fake=_latent_fake)  # no autograd in torch_npu
def npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                                            c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None,
                                            epsilon=1e-5, cache_mode="Norm", is_output_kv=False,
                                            k_cache_dtype=None, ckv_cache_dtype=None):
    extras = {"k_rope_scale": k_rope_scale, "c_kv_scale": c_kv_scale, "k_rope_offset": k_rope_offset,
              "c_kv_offset": c_kv_offset, "v": v, "k_cache_dtype": k_cache_dtype,
              "ckv_cache_dtype": ckv_cache_dtype}
    given = [name for name, value in extras.items() if value is not None]
    if given:
        raise NotImplementedError(f"{_LATENT}: the stand-in does not implement {', '.join(given)} "
                                  "(quantised caches, separate v)")
    batch, seq, dim_v, dim_k = _latent_sizes(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode)
    compute = torch.float64 if kv.dtype == torch.float64 else torch.float32
    x, rope = kv.to(compute).split([dim_v, dim_k], dim=-1)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.to(compute)
    evens, odds = rope[..., 0::2], rope[..., 1::2]
    k = (torch.cat((evens, odds), -1) * cos.to(compute) + torch.cat((-odds, evens), -1) * sin.to(compute))
    k_cache, ckv_cache = k_cache.clone(), ckv_cache.clone()
    length = k_cache.shape[2]
    for b, row in enumerate(index.tolist()):
        for s, position in enumerate(row):
            if position == -1:
                continue
            if not 0 <= position < length:
                raise IndexError(f"{_LATENT}: index[{b}, {s}] = {position} is outside [-1, {length})")
            k_cache[b, 0, position] = k[b, 0, s].to(k_cache.dtype)
            ckv_cache[b, 0, position] = y[b, 0, s].to(ckv_cache.dtype)
    return k.to(kv.dtype), y.to(kv.dtype), k_cache, ckv_cache


# ---- npu_kv_rmsnorm_rope_cache (v1): defined, never computed --------------------------------
def _latent_v1_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                    k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                    is_output_kv=False):
    lead = tuple(kv.shape[:-1])  # the Meta function's: (k_cache', ckv_cache', k_embed, y)
    return (torch.empty_like(k_cache), torch.empty_like(ckv_cache), kv.new_empty((*lead, cos.shape[3])),
            kv.new_empty((*lead, gamma.shape[0])))


@stand_in("npu::npu_kv_rmsnorm_rope_cache", fake=_latent_v1_fake)
def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                              c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5,
                              cache_mode="Norm", is_output_kv=False):
    # The kernel writes k_cache and ckv_cache in place although the schema does not say so
    # ("本质in-place更新"): a functional graph holding it would be wrong, so no pass emits it
    # and the stand-in does not pretend to be it. It exists as on an NPU, where torchair's
    # converter module (custom/npu_kv_rmsnorm_rope_cache.py) registers it before _v2_functional.
    raise NotImplementedError("npu_kv_rmsnorm_rope_cache (v1) hides its in-place cache write in its schema; "
                              "use npu_kv_rmsnorm_rope_cache_v2_functional (what the passes emit)")
