"""kv_rmsnorm_rope_cache: DeepSeek-V3's latent KV path -> npu_kv_rmsnorm_rope_cache_v2_functional.

transformers 5.24 DeepseekV3Attention caches the compressed latent, not per-head keys and
values ("Cache read / write is performed while latent KV is still compressed"):

    kv_nope, k_rot = split(kv_a_proj_with_mqa(h), [kv_lora_rank, qk_rope_head_dim], -1)
    kv_nope = kv_a_layernorm(kv_nope).view(B, 1, S, kv_lora_rank)              RMSNorm
    k_rot = k_rot.view(B, 1, S, rope)
    k_rot = cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)   k1, k2 = k_rot[..., 0::2], [..., 1::2]
    cache.update(kv_nope, k_rot)          StaticLayer: index_copy at arange(S) + cumulative_length

npu_kv_rmsnorm_rope_cache (npu_ops/kv_cache.py) computes exactly this from kv = the
projection viewed (B, 1, S, rank + rope): RMSNorm of the first part, the second part
de-interleaved and rotated by halves with the full (duplicated) cos/sin tables, both
written into their caches at index[b, s] (cache_mode "Norm"). transformers' even/odd
rotation written de-interleaved is that rotation exactly (its own docstring: "bit-identical
to the de-interleaved rotate_half formulation"); cos/sin are HF's duplicated tables, whose
first halves the model slices (cat(first_half, first_half) rebuilds them). The op rounds
once where transformers rounds after the norm and each rope product (a few ulps in bf16).

The pass emits the _v2_functional variant: v1's schema does not say it writes its cache
arguments, which would be wrong in a functional graph. torchair re-inplaces _v2_functional
in its ACL modes (graph_pass.py, mutated arguments 5 and 6); its GE converter copies both
caches (TensorMove) before KvRmsNormRopeCache. It runs before rms_norm and rope
(rms_norm and rope declare after=("kv_rmsnorm_rope_cache", ...)), which would otherwise take the norm and the rotation one by one.

Real kernels take hidden = 512 + 64 on Atlas A2/A3 (torch_npu docs) and fp16/bf16 only;
the tiny test configs are emulation-only: such sites fuse with a note, and are refused
with a SoC given. `npu_mla_prolog_v3` would fuse more (the q and kv projections too), but
only for absorbed MLA: it is reported as a near miss at the kv_b_proj that expands the
cache, with the reason (docs/passes/kv_rmsnorm_rope_cache.md).
"""
import operator

import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import RESHAPES, Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
LATENT_OP = "npu.npu_kv_rmsnorm_rope_cache_v2_functional"
LATENT = CAPABILITIES[LATENT_OP]


# ---- the unfused form ---------------------------------------------------------------------
def deepseek_v3_latent_cache_write(compressed_kv, gamma, pair_cos, pair_sin, latent_cache, rope_cache, start,
                                   eps):
    batch, seq = compressed_kv.shape[:2]
    rank, rope = gamma.shape[0], 2 * pair_cos.shape[-1]
    kv_nope, k_rot = torch.split(compressed_kv, [rank, rope], dim=-1)
    # DeepseekV3RMSNorm (kv_a_layernorm)
    hidden = kv_nope.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    kv_nope = gamma * hidden.to(kv_nope.dtype)
    kv_nope = kv_nope.view(batch, 1, seq, rank)
    k_rot = k_rot.view(batch, 1, seq, rope)
    # apply_rotary_pos_emb_interleave (cos/sin: the first halves of HF's tables, unsqueezed)
    k1, k2 = k_rot[..., 0::2], k_rot[..., 1::2]
    k_rot = torch.cat([k1 * pair_cos - k2 * pair_sin, k2 * pair_cos + k1 * pair_sin], dim=-1)
    # StaticLayer.update
    position = torch.arange(seq, device=compressed_kv.device) + start
    return latent_cache.index_copy(2, position, kv_nope), rope_cache.index_copy(2, position, k_rot)


# ---- the fused call -----------------------------------------------------------------------
def npu_kv_rmsnorm_rope_cache_write(compressed_kv, gamma, pair_cos, pair_sin, latent_cache, rope_cache, start,
                                    eps):
    batch, seq, width = compressed_kv.shape
    rope = 2 * pair_cos.shape[-1]
    kv = compressed_kv.reshape(batch, 1, seq, width)
    cos = torch.cat((pair_cos, pair_cos), -1).expand(batch, 1, seq, rope)  # HF's duplicated tables
    sin = torch.cat((pair_sin, pair_sin), -1).expand(batch, 1, seq, rope)
    # Norm mode: (B, S) positions. One position (decode) is the start itself, as the int64
    # arange(1) + start computes it, with no arange and add to launch.
    if isinstance(seq, int) and seq == 1:
        positions = start.to(torch.int64).expand(1)
    else:
        positions = torch.arange(seq, device=compressed_kv.device) + start
    index = positions.expand(batch, seq)
    _, _, rope_cache, latent_cache = torch.ops.npu.npu_kv_rmsnorm_rope_cache_v2_functional(
        kv, gamma, cos, sin, index, rope_cache, latent_cache, epsilon=eps, cache_mode="Norm")
    return latent_cache, rope_cache


FORMS = [Form(deepseek_v3_latent_cache_write, npu_kv_rmsnorm_rope_cache_write)]  # fp32 and bf16 (casts)


# ---- checks -------------------------------------------------------------------------------
def check(site):
    kv, gamma, pair_cos, pair_sin = site["compressed_kv"], site["gamma"], site["pair_cos"], site["pair_sin"]
    latent_cache, rope_cache, start = site["latent_cache"], site["rope_cache"], site["start"]
    batch, seq, width = kv.shape
    rank, rope = gamma.shape[0], 2 * pair_cos.shape[-1]
    if site.arg_nodes["latent_cache"] is site.arg_nodes["rope_cache"]:
        return "the latent and the rope part are written into one cache"
    if start.dim() != 0 or start.dtype not in (torch.int32, torch.int64):
        return f"the write starts at a {str(start.dtype)[6:]}{list(start.shape)} tensor, not a 0-d position"
    for name, cache, dim in (("latent", latent_cache, rank), ("rope", rope_cache, rope)):
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != (batch, 1, dim):
            return (f"the {name} cache is {list(cache.shape)}, not (B, 1, cache_len, {dim}): the op's Norm mode "
                    "takes single-head (B, 1, cache_len, D) caches")
    if latent_cache.shape[2] != rope_cache.shape[2]:
        return "the latent and the rope cache differ in length"
    if pair_cos.shape != pair_sin.shape or pair_cos.dim() != 4 or pair_cos.shape[1:] != (1, seq, rope // 2) \
            or pair_cos.shape[0] not in (1, batch):
        return f"cos/sin of shape {list(pair_cos.shape)} are not (1 or B, 1, S, rope/2) tables"
    if len({kv.dtype, gamma.dtype, pair_cos.dtype, latent_cache.dtype, rope_cache.dtype}) != 1:
        return "kv, gamma, cos/sin and the caches are not of one dtype"
    site.notes.append("GE (max-autotune) copies both caches before the op (TensorMove); torchair's ACL modes "
                      "re-inplace the functional op")
    fixed = LATENT.limits["fixed_dims_socs"]
    dims = (f"RMSNorm dim {rank} + RoPE dim {rope}: torch_npu's A2/A3 kernel takes {LATENT.limits['rms_dim']} + "
            f"{LATENT.limits['rope_dim']} only"
            if (rank, rope) != (LATENT.limits["rms_dim"], LATENT.limits["rope_dim"])
            and (site.soc is None or site.soc in fixed) else None)
    # the op's kv is the projection viewed (B, 1, S, rank + rope)
    return site.hardware_limits([unsupported(LATENT_OP, site.soc, x=kv.unsqueeze(1)), dims])


# ---- near misses --------------------------------------------------------------------------
MLA_PROLOG = ("npu_mla_prolog_v3 would also fuse the q and kv projections and their norms, but its query output "
              "is the absorbed one only (torch_npu 2.13 docstring, outputs: query = q^N = c_Q W^UQ W^UK of shape "
              "(B, S, N, Hckv = 512), query_rope, dequant scales): it feeds attention over the latent cache (FIA "
              "with query_rope / key_rope, N_kv = 1, D 512 + 64) and W^UV after it, where transformers expands the "
              "whole latent cache through kv_b_proj every step and attends per head with D 128 + 64. And "
              "weight_dq, weight_uq_qr and weight_dkv_kr are taken in FRACTAL_NZ only (the docstring: 数据格式支持"
              "FRACTAL_NZ), which the graph's ND parameters are not: serving code casts them once after loading "
              "(vllm-ascend attention/mla_v1.py process_weights_after_loading). Using it replaces the attention "
              "and the parameters' format, not a local pattern (docs/passes/kv_rmsnorm_rope_cache.md)")


def _latent_op_output(node):
    while is_call(node, *RESHAPES):
        node = node.args[0]
    return is_call(node, operator.getitem) and is_call(node.args[0], getattr(torch.ops.npu, LATENT_OP.split(".")[1]))


def _single_head_write(node):
    cache = tensor_meta(node.args[0]) if is_call(node, aten.index_copy.default) else None
    return cache is not None and cache.dim() == 4 and cache.shape[1] == 1


def anchor(node):
    """kv_b_proj over the fused latent cache (where npu_mla_prolog_v3 would have to start: an
    mm on CPU, aten.matmul on an NPU graph, where torch_npu keeps a bias-free linear's matmul
    whole); a pair of single-head cache writes at one position (DeepSeek's latent and rope caches)."""
    if is_call(node, aten.mm.default, aten.matmul.default):
        return _latent_op_output(node.args[0])
    if _single_head_write(node):
        others = [u for u in node.args[2].users if u is not node and _single_head_write(u)]
        return bool(others)
    return False


def explain(node):
    if is_call(node, aten.mm.default, aten.matmul.default):
        return MLA_PROLOG
    return ("a pair of single-head cache writes, but not of RMSNorm(kv_nope) and the interleaved RoPE of k_rot "
            "split from one projection (transformers' DeepseekV3Attention)")


PASS = FusionPass(
    name="kv_rmsnorm_rope_cache",
    fused_op=LATENT_OP,
    forms=FORMS,
    example={
        # B=2, S=3 new tokens, latent rank 12 + rope 8, cache length 10
        "compressed_kv": lambda dtype: torch.empty(2, 3, 20, dtype=dtype),
        "gamma": lambda dtype: torch.empty(12, dtype=dtype),
        "pair_cos": lambda dtype: torch.empty(1, 1, 3, 4, dtype=dtype),
        "pair_sin": lambda dtype: torch.empty(1, 1, 3, 4, dtype=dtype),
        "latent_cache": lambda dtype: torch.empty(2, 1, 10, 12, dtype=dtype),
        "rope_cache": lambda dtype: torch.empty(2, 1, 10, 8, dtype=dtype),
        "start": lambda dtype: torch.empty((), dtype=torch.int64),
        "eps": 2.0**-17,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.mm.default, aten.matmul.default, aten.index_copy.default),
    explain=explain,
    verify_input=lambda name, args: torch.zeros((), dtype=args["start"].dtype) if name == "start" else None,
)
