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

from .spec import FLOAT_DTYPES, OPCHECK_TESTS, OpCapability, Sample, SocLimits, op_spec, randn


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
    return torch.empty_like(self)  # the Meta function's (the kernel's clone keeps self's layout too)


def _values(*shape, dtype, seed):
    return (randn(*shape, dtype=torch.float64, seed=seed) * 8).to(dtype)  # integer caches (int8) too


def _scatter_update_samples(dtype):
    # a (B, N, max_len, D) cache written at one offset per batch row, along the sequence (axis -2)
    # and along the last dim
    data = _values(3, 2, 9, 6, dtype=dtype, seed=1)
    yield Sample((data, torch.tensor([0, 4, 7]), _values(3, 2, 2, 6, dtype=dtype, seed=2), -2))
    yield Sample((data, torch.tensor([0, 1, 3], dtype=torch.int32), _values(3, 2, 9, 3, dtype=dtype, seed=3), -1))


@op_spec("npu::scatter_update",
         schema="scatter_update(Tensor self, Tensor indices, Tensor updates, int axis) -> Tensor",
         fake=_scatter_update_fake, samples=_scatter_update_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.int8, torch.float16, torch.float32, torch.bfloat16, torch.int32}),
             min_rank=2,
             max_rank=8,
             backward=None,
             # custom/scatter_update.py: TensorMove(data) + Scatter(reduce="update", axis) (a full
             # copy of the cache), and scatter_update_ -> Scatter in place, which torchair's
             # recover_view_inplace_pattern substitutes for view -> scatter_update -> view -> copy_
             ge_converter=True,
             # the docstring's products: Atlas training, A2, A3 (no Atlas inference, no 950)
             socs={"Ascend310P": SocLimits(supported=False), "Ascend950": SocLimits(supported=False)},
             limits={
                 "axes": (-2, -1),  # the offsets index dim 0; the write runs along one of the last two dims
                 "indices_dtypes": (torch.int32, torch.int64),
                 "indices_ranks": (1,),  # 1-D: one offset per row of dim 0 (2-D is undocumented)
                 "bounds_checked": False,  # "索引越界不校验"
                 # torchair recover_view_inplace_pattern (patterns/_recover_view_inplace_pattern.py):
                 # placeholder -> aten.view -> scatter_update -> aten.view -> copy_(placeholder),
                 # the placeholder with exactly those two users, CANN >= 8.3.RC1
                 "reinplace_min_cann": "8.3.RC1",
             },
             doc="attention_inference.md 4.2-4.3 / torch_npu 2.13.0 docstring (_op_plugin_docs.py "
             "scatter_update): data and updates of one rank, 2-8 dims, int8/fp16/fp32/bf16/int32 (A2/A3), "
             "indices int32/int64 1-D or 2-D, no bounds check; products Atlas training, A2, A3; GE "
             "converters custom/scatter_update.py (functional: TensorMove + Scatter; in place: Scatter); "
             "Meta empty_like(self); no autograd",
         ))  # no autograd in torch_npu
def scatter_update(self, indices, updates, axis):
    out = self.clone()
    _scatter_update_into("scatter_update", out, indices, updates, axis)
    return out


# torch's functionalization refuses a custom op whose output aliases an input (torch_npu's schema
# `-> Tensor(a!)`), so aot_autograd cannot trace it; only torchair's own re-inplacing pass emits
# it, after functionalization, so no aot graph holds it on an NPU either
_ALIASED_OUTPUT = "functionalization refuses a custom op returning its mutated input (Tensor(a!) -> Tensor(a!))"


def _scatter_update__fake(self, indices, updates, axis):
    return self


def _scatter_update__samples(dtype):
    for sample in _scatter_update_samples(dtype):
        yield Sample(sample.args, layout_args=(0, 2))


@op_spec("npu::scatter_update_",
         schema="scatter_update_(Tensor(a!) self, Tensor indices, Tensor updates, int axis) -> Tensor(a!)",
         fake=_scatter_update__fake, samples=_scatter_update__samples, sample_dtypes=FLOAT_DTYPES,
         layouts=("contiguous", "transposed", "sliced", "channels_last"),  # no write into an expanded tensor
         opcheck_skips=dict.fromkeys(("test_aot_dispatch_static", "test_aot_dispatch_dynamic"), _ALIASED_OUTPUT))
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


def latent_cache_inputs(dtype, *, seq=3, batch=2, dim_v=6, dim_k=4, cache_len=7):
    """(kv, gamma, cos, sin, index, k_cache, ckv_cache) of a Norm-mode call: HF's duplicated rope
    tables, index writing batch b's tokens from position 1 + 2b on."""
    kv = randn(batch, 1, seq, dim_v + dim_k, seed=11, dtype=dtype)
    gamma = randn(dim_v, seed=12, dtype=dtype)
    angles = randn(batch, 1, seq, dim_k // 2, seed=13, dtype=torch.float64)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    index = (torch.arange(seq) + torch.tensor([[1], [3]])[:batch]).to(torch.int64)
    k_cache = randn(batch, 1, cache_len, dim_k, seed=14, dtype=dtype)
    ckv_cache = randn(batch, 1, cache_len, dim_v, seed=15, dtype=dtype)
    return kv, gamma, cos, sin, index, k_cache, ckv_cache


def _latent_samples(dtype):
    yield Sample(latent_cache_inputs(dtype))
    kv, gamma, cos, sin, index, k_cache, ckv_cache = latent_cache_inputs(dtype)
    yield Sample((kv, gamma, cos, sin, torch.full_like(index, -1), k_cache, ckv_cache), {"epsilon": 1e-6})  # no write


def _latent_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                 k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                 is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None):
    # the Meta function's: (k_embed (.., cos D), y (.., gamma D), k_cache', ckv_cache')
    lead = tuple(kv.shape[:-1])
    return (kv.new_empty((*lead, cos.shape[3])), kv.new_empty((*lead, gamma.shape[0])),
            torch.empty_like(k_cache), torch.empty_like(ckv_cache))


@op_spec("npu::npu_kv_rmsnorm_rope_cache_v2_functional",
         schema="npu_kv_rmsnorm_rope_cache_v2_functional(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index,"
                " Tensor k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? "
                "k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, str "
                "cache_mode='Norm', bool is_output_kv=False, int? k_cache_dtype=None, int? ckv_cache_dtype=None) -> "
                "(Tensor, Tensor, Tensor, Tensor)",
         fake=_latent_fake, samples=_latent_samples,
         capability=OpCapability(
             dtypes=frozenset({torch.float16, torch.bfloat16}),  # kv, gamma, cos, sin; caches also int8
             min_rank=4,
             max_rank=4,
             backward=None,
             # custom/npu_kv_rmsnorm_rope_cache.py:43: TensorMove of both caches +
             # KvRmsNormRopeCache; ACL modes re-inplace it (graph_pass.py:165-169, args 5, 6)
             ge_converter=True,
             socs={"Ascend310P": SocLimits(supported=False)},
             limits={
                 "cache_modes": ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"),
                 "heads": 1,  # kv (B, 1, S, D): N = 1 only
                 # torch_npu's doc (hiascend ptaoplist_002368): hidden 576 = RMSNorm 512 + RoPE 64
                 # only, on the A2 / A3 kernel; the open-source CANN kernel (ops-transformer README,
                 # products Ascend 950) takes any Dv + Dk with Dk even
                 "rms_dim": 512,
                 "rope_dim": 64,
                 "fixed_dims_socs": ("Ascend910B", "Ascend910_93"),
                 "norm_index": "(B, S) int64 cache positions, -1 = no write",
             },
             doc="attention_inference.md 5.1 / CANN README ops-transformer posembedding/kv_rms_norm_rope_cache "
             "(formulas: interleaveRope = de-interleave + rotate halves, rmsNorm = x / sqrt(mean(x^2) + eps) * "
             "gamma; Norm index (B, S) in [-1, Scache); N = 1) / torch_npu doc ptaoplist_002368 (kv (B, 1, S, "
             "576) bf16/fp16, gamma 512, rope 64, Norm caches (B, 1, cache_len, 64 | 512)) / torch_npu's golden "
             "test_npu_kv_rmsnorm_rope_cache.py (fp32 compute, one rounding) / Meta: (k_embed, y, k_cache', "
             "ckv_cache'); GE converter custom/npu_kv_rmsnorm_rope_cache.py; no autograd",
         ))  # no autograd in torch_npu
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
_V1_REFUSED = ("its kernel refuses to compute (the schema hides v1's in-place cache write, so no pass emits it; "
               "the op exists for torchair's converter module), so no check can run it")
def _latent_v1_fake(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                    k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                    is_output_kv=False):
    lead = tuple(kv.shape[:-1])  # the Meta function's: (k_cache', ckv_cache', k_embed, y)
    return (torch.empty_like(k_cache), torch.empty_like(ckv_cache), kv.new_empty((*lead, cos.shape[3])),
            kv.new_empty((*lead, gamma.shape[0])))


@op_spec("npu::npu_kv_rmsnorm_rope_cache",
         schema="npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor "
                "k_cache, Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? "
                "k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, str "
                "cache_mode='Norm', bool is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)",
         fake=_latent_v1_fake, samples=_latent_samples, sample_dtypes=(torch.bfloat16,),
         opcheck_skips=dict.fromkeys(OPCHECK_TESTS, _V1_REFUSED))
def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None,
                              c_kv_scale=None, k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5,
                              cache_mode="Norm", is_output_kv=False):
    # The kernel writes k_cache and ckv_cache in place although the schema does not say so
    # ("本质in-place更新"): a functional graph holding it would be wrong, so no pass emits it
    # and the stand-in does not pretend to be it. It exists as on an NPU, where torchair's
    # converter module (custom/npu_kv_rmsnorm_rope_cache.py) registers it before _v2_functional.
    raise NotImplementedError("npu_kv_rmsnorm_rope_cache (v1) hides its in-place cache write in its schema; "
                              "use npu_kv_rmsnorm_rope_cache_v2_functional (what the passes emit)")
