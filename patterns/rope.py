"""rope: rotary position embedding -> npu_rotary_mul / npu_interleave_rope.

    out = x * cos + rotate(x) * sin

`rotate` comes in two layouts (op_semantics.md 3.1):
- half:       cat(-x2, x1) over the two halves of the head dim (HF rotate_half; Llama,
              Qwen, Mistral, ...), written with slices, chunk or split (one spelling to
              the engine: canonical.py), its products and sum in any operand order;
- interleave: [-x1, x0, -x3, x2, ...] over even/odd pairs, written as GPT-J's
              stack(-odd, even).flatten(-2), or as complex multiplication
              view_as_complex(x.view(..., -1, 2)) * freqs_cis (Meta's Llama code,
              torchtitan llama3 / deepseek_v3), which is the same rotation.
HF DeepSeek-V3 rotates interleaved pairs but writes the result de-interleaved (evens
first, then odds): exactly npu_interleave_rope, or half mode on the de-interleaved x.

The fused ops compute in fp32 and round once; the unfused code rounds after each of its
three ops in bf16/fp16, so the two differ by a few ulps there and agree to float
rounding in fp32. q and k are fused one by one: npu_apply_rotary_pos_emb would take them
as a pair, but only in BSND layout (HF applies RoPE in BNSD) and it overwrites its inputs
although its schema does not say so.

Interleave mode and max-autotune: torchair's GE converter lowers npu_rotary_mul without
`rotate` to RotaryMul, which only rotates halves, on every SoC but Ascend950
(custom/npu_rotary_mul.py). There the interleaved forms use their half-mode
alternative: de-interleave x (a copy), rotate halves, interleave the result back.
"""
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Optional

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import (RESHAPES, ChannelGather, Factor, Form, FusionPass, NotEvaluable, Recognized,
                                    channel_gather, evaluate_around, is_backward, is_call, modelled, region_around,
                                    single_terms, tensor_meta, uneven_halves, users_outside)

aten = torch.ops.aten
ROTARY_MUL = CAPABILITIES["npu.npu_rotary_mul"]
INTERLEAVE_ROPE = CAPABILITIES["npu.npu_interleave_rope"]
PARTIAL_ROTARY = CAPABILITIES["cann_ops_transformer.inplace_partial_rotary_mul"]


# ---- rotations, as model code writes them ------------------------------------------------
def _rotate_half_sliced(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_split(x):
    # x.chunk(2, dim=-1) and torch.split(x, h, -1), split at the half npu_rotary_mul rotates:
    # with a symbolic head dim s, chunk splits at (s + 1) // 2, which only an even s makes
    # the half (proven by the shape environment, else a near miss: explain)
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    # GPT-J / CodeGen / GLM "rotate_every_two"
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _deinterleave(x):
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] (DeepSeek's view/transpose trick)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _interleave(x):
    """The inverse of _deinterleave."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _apply_form(rotate, name):
    """`x * cos + rotate(x) * sin`. The engine matches the products and the sum with their
    operands in either order (spellings.py), so one spelling serves `cos * x`,
    `sin * rotate(x)` and the sine term first."""

    def search(x, cos, sin):
        return x * cos + rotate(x) * sin

    search.__name__ = name
    return search


def deepseek_deinterleave_then_rotate_half(x, cos, sin):
    # DeepSeek-V2/V3 modeling_deepseek.py: de-interleave the pairs, then HF rotate_half RoPE
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return x * cos + _rotate_half_sliced(x) * sin


def even_odd_pairs(x, pair_cos, pair_sin):
    # transformers 5 DeepSeek-V3 apply_rotary_pos_emb_interleave: the tables hold one
    # angle per pair (the first half of HF's cat(freqs, freqs)); the result is de-interleaved
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * pair_cos - x2 * pair_sin, x2 * pair_cos + x1 * pair_sin], dim=-1)


def complex_multiply(x, freqs):
    # Meta Llama / torchtitan: x is the fp32 activation, freqs complex [.., S, .., D/2]
    # (freqs * pairs too: a product matches in either operand order)
    pairs = torch.view_as_complex(x.view(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2)


# ---- the fused calls ---------------------------------------------------------------------
def _as_rank_of(table, x):
    """cos/sin with leading 1s up to x's rank: the op wants tables of x's rank."""
    return table.reshape(_padded_shape(table, x))


def _padded_shape(table, x):
    return (1,) * (x.dim() - table.dim()) + tuple(table.shape)


def _rotary_mul(x, cos, sin, *mode):
    """npu_rotary_mul(x, cos, sin), the tables of x's rank. A 3-d x whose tables are not the
    op's TND ones (a (B, S, D) key without a head dim, tables (1, S, D): DeepSeek-V4's kv) is
    BSND with one head, as torchtitan-npu's converter calls it (`_with_one_head`)."""
    cos, sin = _as_rank_of(cos, x), _as_rank_of(sin, x)
    if _with_one_head(x.shape, cos.shape):
        return torch.ops.npu.npu_rotary_mul(x.unsqueeze(2), cos.unsqueeze(2), sin.unsqueeze(2), *mode).squeeze(2)
    return torch.ops.npu.npu_rotary_mul(x, cos, sin, *mode)


def rotary_mul_half(x, cos, sin):
    return _rotary_mul(x, cos, sin)


def rotary_mul_interleave(x, cos, sin):
    return _rotary_mul(x, cos, sin, "interleave")


def rotary_mul_interleave_via_half(x, cos, sin):
    # de-interleave x and the tables, rotate halves, interleave back: the same numbers
    cos, sin = _as_rank_of(cos, x), _as_rank_of(sin, x)
    return _interleave(_rotary_mul(_deinterleave(x), _deinterleave(cos), _deinterleave(sin)))


def interleave_rope(x, cos, sin):
    return torch.ops.npu.npu_interleave_rope(x.contiguous(), cos, sin)


def interleave_rope_pair_angles(x, pair_cos, pair_sin):
    return torch.ops.npu.npu_interleave_rope(x.contiguous(), torch.cat((pair_cos, pair_cos), -1),
                                             torch.cat((pair_sin, pair_sin), -1))


def rotary_mul_half_deinterleaved_pair_angles(x, pair_cos, pair_sin):
    cos, sin = torch.cat((pair_cos, pair_cos), -1), torch.cat((pair_sin, pair_sin), -1)
    return _rotary_mul(_deinterleave(x), cos, sin)


def _tables_from_complex(freqs):
    """freqs_cis -> (cos, sin), each angle repeated for its pair: interleave-mode tables."""
    # resolve_conj: freqs_cis.conj() (an inverse rotation) is a lazy conjugate view_as_real refuses
    table = torch.view_as_real(freqs.resolve_conj())
    cos, sin = table[..., 0], table[..., 1]
    return (cos.unsqueeze(-1).expand(*cos.shape, 2).flatten(-2),
            sin.unsqueeze(-1).expand(*sin.shape, 2).flatten(-2))


def rotary_mul_from_complex(x, freqs):
    return rotary_mul_interleave(x, *_tables_from_complex(freqs))


def rotary_mul_from_complex_via_half(x, freqs):
    return rotary_mul_interleave_via_half(x, *_tables_from_complex(freqs))


# ---- DeepSeek-V4: interleaved pairs on the last channels only (partial RoPE) -------------------
def deepseek_v4_partial_rope(x, angle_cos, angle_sin):
    # transformers DeepSeek-V4 apply_rotary_pos_emb (unsqueeze_dim=1): the tables hold one angle
    # per pair, repeated for both channels of the pair; the LAST 2 * len(angles) channels rotate
    cos = angle_cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = angle_sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (_rotate_every_two(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class InplacePartialRotaryMul(torch.autograd.Function):
    """The extension's InplacePartialRotaryMulFn (COT ops/inplace_partial_rotary_mul.py), on a
    copy: forward rotates x[..., start:end] in place, backward rotates the gradient back in place
    with inplace_partial_rotary_mul_backward; no gradients for r1 / r2 (capabilities.py: the op's
    autograd_rule). Traced into a joint graph, both in-place calls are functionalised
    (auto_functionalized_v2), as torchair expects mutating ops."""

    @staticmethod
    def forward(ctx, x, r1, r2, partial_slice):
        ctx.save_for_backward(r1, r2)
        ctx.partial_slice = partial_slice
        out = x.clone()
        torch.ops.cann_ops_transformer.inplace_partial_rotary_mul(out, r1, r2, rotary_mode="interleave",
                                                                  partial_slice=partial_slice)
        return out

    @staticmethod
    def backward(ctx, grad):
        r1, r2 = ctx.saved_tensors
        grad = grad.contiguous().clone()
        torch.ops.cann_ops_transformer.inplace_partial_rotary_mul_backward(grad, r1, r2, rotary_mode="interleave",
                                                                           partial_slice=ctx.partial_slice)
        return grad, None, None, None


def _pair_tables_bsnd(angles, x_bsnd, heads):
    """(b, S, rd/2) angles -> (B, S, heads, rd) contiguous tables, each angle per pair."""
    table = angles.repeat_interleave(2, dim=-1).unsqueeze(2)
    return table.expand(x_bsnd.shape[0], x_bsnd.shape[1], heads, table.shape[-1]).contiguous()


def _inplace_partial_rotary_mul(x, angle_cos, angle_sin, table_heads):
    # x is (B, N, S, D) as transformers rotates it; the op takes BSND and rotates in place
    rope_dim, dim = 2 * angle_cos.shape[-1], x.shape[-1]
    x_bsnd = x.transpose(1, 2).contiguous()
    heads = x_bsnd.shape[2] if table_heads else 1
    r1, r2 = _pair_tables_bsnd(angle_cos, x_bsnd, heads), _pair_tables_bsnd(angle_sin, x_bsnd, heads)
    partial_slice = [dim - rope_dim, dim]
    if torch.is_grad_enabled() and x.requires_grad:  # the joint replacement
        out = InplacePartialRotaryMul.apply(x_bsnd, r1, r2, partial_slice)
    else:  # functional, as aot_autograd spells a mutating op (torchair lowers auto_functionalized_v2)
        out = torch.ops.higher_order.auto_functionalized_v2(
            torch.ops.cann_ops_transformer.inplace_partial_rotary_mul.default, r1=r1, r2=r2,
            rotary_mode="interleave", partial_slice=partial_slice, _x_base_index=0, _all_bases=[x_bsnd])[1]
    # contiguous (B, N, S, D), as transformers' cat returns it: the passes after this one (the
    # attention's matmuls) then see the graph they see unfused
    return out.transpose(1, 2).contiguous()


def inplace_partial_rotary_mul_bs1d(x, angle_cos, angle_sin):
    # tables (B, S, 1, rd): the BS1D broadcast Atlas A2/A3 take
    return _inplace_partial_rotary_mul(x, angle_cos, angle_sin, table_heads=False)


def inplace_partial_rotary_mul_bsnd(x, angle_cos, angle_sin):
    # tables (B, S, N, rd): 950 takes BSND / B1ND / B11D / 111D, not BS1D
    return _inplace_partial_rotary_mul(x, angle_cos, angle_sin, table_heads=True)


def rotary_mul_on_rope_slice(x, angle_cos, angle_sin):
    # npu_rotary_mul in interleave mode on the rotated slice, the rest concatenated back
    cos = angle_cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = angle_sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    rope_dim = cos.shape[-1]
    rotated = torch.ops.npu.npu_rotary_mul(x[..., -rope_dim:], cos, sin, "interleave")
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


_V4_PARTIAL = dict(dtypes=(torch.float32, torch.bfloat16))
_V4_INPLACE = dict(_V4_PARTIAL, fused_op="cann_ops_transformer.inplace_partial_rotary_mul")
V4_FORMS = [
    # the in-place COT op first (per SoC's table layout), npu_rotary_mul on the slice after
    Form(deepseek_v4_partial_rope, inplace_partial_rotary_mul_bs1d, **_V4_INPLACE),
    Form(deepseek_v4_partial_rope, inplace_partial_rotary_mul_bsnd, **_V4_INPLACE),
    Form(deepseek_v4_partial_rope, rotary_mul_on_rope_slice, **_V4_PARTIAL),
]


# The rotary forms have no casts, so one trace per form matches every dtype.
_INTERLEAVE_ROPE_FORMS = dict(fused_op="npu.npu_interleave_rope", dtypes=(torch.bfloat16,))

_ROTATE_EVERY_TWO = _apply_form(_rotate_every_two, "rotate_every_two")

FORMS = [
    # larger forms first: they contain a rotate_half the smaller forms would take alone
    *V4_FORMS,
    Form(deepseek_deinterleave_then_rotate_half, interleave_rope, **_INTERLEAVE_ROPE_FORMS),
    Form(even_odd_pairs, interleave_rope_pair_angles, **_INTERLEAVE_ROPE_FORMS),
    Form(even_odd_pairs, rotary_mul_half_deinterleaved_pair_angles, dtypes=(torch.float32,)),
    # slices, chunk and split are one rotation to the engine (canonical.py); in training
    # the gradient of slices and of a split differ, hence two forms
    *(Form(_apply_form(rotate, name), rotary_mul_half, dtypes=(torch.float32,)) for rotate, name in (
        (_rotate_half_sliced, "rotate_half_sliced"),
        (_rotate_half_split, "rotate_half_split"),
    )),
    Form(_ROTATE_EVERY_TWO, rotary_mul_interleave, dtypes=(torch.float32,)),
    Form(_ROTATE_EVERY_TWO, rotary_mul_interleave_via_half, dtypes=(torch.float32,)),
    Form(complex_multiply, rotary_mul_from_complex, dtypes=(torch.float32,)),
    Form(complex_multiply, rotary_mul_from_complex_via_half, dtypes=(torch.float32,)),
]


# ---- checks ------------------------------------------------------------------------------
# npu_rotary_mul's cos/sin shapes per layout (op_semantics 3.1), as which dims of x they
# keep (x's letters) and which are 1: BNSD takes 11SD / B1SD / BNSD, and so on.
_TABLE_LAYOUTS = {
    4: {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"),
        "SBND": ("S11D", "SB1D", "SBND")},
    3: {"TND": ("T1D", "TND")},
}
_INTERLEAVE_TABLES = ("11SD", "1S1D", "S11D", "T1D")  # interleave mode: no per-batch tables


def _table_layout(x_shape, table_shape):
    """(layout, table spelling) of the first layout whose allowed tables fit, or None. A 3-d
    x whose tables fit no 3-d layout is read with a head dim of 1 (_with_one_head)."""
    if _with_one_head(x_shape, table_shape):
        x_shape, table_shape = _one_head(x_shape), _one_head(table_shape)
    for layout, tables in _TABLE_LAYOUTS.get(len(x_shape), {}).items():
        for spelling in tables:
            expected = [1 if letter == "1" else size for letter, size in zip(spelling, x_shape)]
            if list(table_shape) == expected:
                return layout, spelling
    return None


def _one_head(shape):
    return (*shape[:2], 1, shape[2])


def _with_one_head(x_shape, table_shape):
    """A 3-d x (B, S, D) and tables that vary along S only, (1, S, D): the rotation of one
    head, which the op takes as BSND (B, S, 1, D), tables 1S1D; in the op's own 3-d layout,
    TND, such tables would be per head (1ND), which it does not take."""
    return (len(x_shape) == 3 and len(table_shape) == 3 and table_shape[0] == 1 and table_shape[1] == x_shape[1]
            and table_shape[2] == x_shape[2] and not x_shape[0] == 1)


def _rotary_tables(site):
    """Fake (cos, sin) of the shape and dtype the replacement passes to the op."""
    x = site["x"]
    if "freqs" in site.args:  # complex [.., D/2] -> real [.., D], each angle per pair
        freqs = site["freqs"]
        shape = (*freqs.shape[:-1], 2 * freqs.shape[-1])
        real = x.new_empty(shape, dtype=freqs.real.dtype) if freqs.is_complex() else freqs
        return real, real
    if "angle_cos" in site.args:  # DeepSeek-V4: one angle per pair, repeated per channel, (b, 1, S, rd)
        cos, sin = site["angle_cos"], site["angle_sin"]
        shape = (cos.shape[0], 1, cos.shape[1], 2 * cos.shape[-1])
        return cos.new_empty(shape), sin.new_empty(shape)
    if "pair_cos" in site.args:  # one angle per pair -> cat(angles, angles)
        cos, sin = site["pair_cos"], site["pair_sin"]
        return (cos.new_empty((*cos.shape[:-1], 2 * cos.shape[-1])),
                sin.new_empty((*sin.shape[:-1], 2 * sin.shape[-1])))
    return site["cos"], site["sin"]


_GE_HALF_ONLY = ("under max-autotune torchair lowers npu_rotary_mul without `rotate` to GE RotaryMul, "
                 "which only rotates halves, on every SoC but Ascend950")


def _check_rotary_mul(site, mode_name):
    x = site["x"]
    cos, sin = _rotary_tables(site)
    head_dim = x.shape[-1]
    reason = unsupported("npu.npu_rotary_mul", site.soc, x=x)
    if reason:
        return reason
    if head_dim % ROTARY_MUL.limits["head_dim_multiple"]:
        return f"head_dim {head_dim} is odd: npu_rotary_mul rotates pairs"
    if head_dim >= ROTARY_MUL.limits["max_head_dim"]:
        return f"head_dim {head_dim} is not below npu_rotary_mul's {ROTARY_MUL.limits['max_head_dim']}"
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        # (the recognition below fuses such a region, x and the tables cast to the dtype the
        # code computes in, when it can read the rotation channel by channel)
        symbolic = "" if isinstance(head_dim, int) else (
            f"; the head dim {head_dim} is symbolic (dynamic=True on x itself), so the rotation cannot be read "
            "channel by channel to fuse it in the promoted dtype")
        return (f"cos/sin are {str(cos.dtype)[6:]}, x is {str(x.dtype)[6:]}: "
                f"npu_rotary_mul takes one dtype{symbolic}")
    if cos.shape != sin.shape:
        return f"cos {list(cos.shape)} and sin {list(sin.shape)} differ in shape"
    if cos.dim() > x.dim():
        return f"cos/sin have more dims ({cos.dim()}) than x ({x.dim()})"
    padded = _padded_shape(cos, x)
    found = _table_layout(x.shape, padded)
    if found is None:
        allowed = "; ".join(f"{layout}: {', '.join(tables)}" for layout, tables
                            in _TABLE_LAYOUTS.get(x.dim(), {}).items())
        return (f"cos/sin of shape {list(padded)} do not broadcast to x "
                f"{list(x.shape)} the way npu_rotary_mul needs ({allowed or 'x must be 3-d or 4-d'})")
    layout, spelling = found
    shape = _one_head(x.shape) if _with_one_head(x.shape, padded) else x.shape
    batch, heads = (shape[layout.index("B")] if "B" in layout else 1), shape[layout.index("N")]
    if mode_name == "interleave":
        if spelling not in _INTERLEAVE_TABLES:
            return f"per-batch cos/sin ({spelling}) are not supported in interleave mode"
        if batch * heads >= ROTARY_MUL.limits["interleave_max_batch_heads"]:
            return f"B*N = {batch * heads} is not below {ROTARY_MUL.limits['interleave_max_batch_heads']} (interleave mode)"
        if site.soc is None or site.soc in ROTARY_MUL.limits["ge_half_only_without_rotate_socs"]:
            reason = _GE_HALF_ONLY
            if site.mode == "max-autotune":
                return reason
            if site.mode is None:
                site.notes.append(f"max-autotune would take the half-mode alternative: {reason}")
    # each size against the limit, not max(B, N): with symbolic sizes, max() would guard on
    # which of B and N is larger (a recompile whenever the batch passes the head count); a
    # size against its limit guards only on what the kernel needs (B < 1000)
    elif batch >= ROTARY_MUL.limits["max_batch_heads"] or heads >= ROTARY_MUL.limits["max_batch_heads"]:
        return f"B = {batch} or N = {heads} is not below {ROTARY_MUL.limits['max_batch_heads']}"
    if site.soc in ROTARY_MUL.limits["jit_compile_only_socs"]:
        wanted = ROTARY_MUL.limits["jit_compile_head_dim"]
        if mode_name != "half" or len(shape) != 4 or head_dim != wanted:
            return (f"on {site.soc} npu_rotary_mul only has its jit kernel: half mode, 4-d x, "
                    f"head_dim {wanted} (this site: {mode_name}, {len(shape)}-d, head_dim {head_dim})")
    return None


def _check_interleave_rope(site):
    x = site["x"]
    cos, sin = _rotary_tables(site)
    reason = unsupported("npu.npu_interleave_rope", site.soc, x=x)
    if reason:
        return reason
    wanted = INTERLEAVE_ROPE.limits["head_dim"]
    if x.shape[-1] != wanted:
        return f"npu_interleave_rope needs head_dim {wanted}, this site has {x.shape[-1]}"
    batch, _, seq, _ = x.shape
    if tuple(cos.shape) not in ((batch, 1, seq, wanted), (batch, 1, 1, wanted)) or cos.shape != sin.shape:
        return (f"npu_interleave_rope needs cos/sin of shape (B, 1, S or 1, {wanted}) = "
                f"{[batch, 1, seq, wanted]}, got {list(cos.shape)}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return "npu_interleave_rope takes x, cos and sin of one dtype"
    if x.dtype not in INTERLEAVE_ROPE.limits["ge_dtypes"]:
        reason = f"torchair's GE InterleaveRope takes fp16 only, this site is {str(x.dtype)[6:]}"
        if site.mode == "max-autotune":
            return reason
        if site.mode is None:
            site.notes.append(f"max-autotune would take the half-mode alternative: {reason}")
    return None


def _v4_partial_reason(site):
    """The first reason the V4 form's shapes are not a partial rotation of x's last channels."""
    x, cos, sin = site["x"], site["angle_cos"], site["angle_sin"]
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return f"x {list(x.shape)} and angles {list(cos.shape)} / {list(sin.shape)} are not (B, N, S, D) and (b, S, pairs)"
    rope_dim = 2 * cos.shape[-1]
    if rope_dim > x.shape[-1] or cos.shape[1] != x.shape[2] or cos.shape[0] not in (1, x.shape[0]):
        return f"angles {list(cos.shape)} do not rotate the last channels of x {list(x.shape)}"
    return None


def _check_inplace_partial(site):
    reason = _v4_partial_reason(site)
    if reason:
        return reason
    x, cos = site["x"], site["angle_cos"]
    limits = PARTIAL_ROTARY.limits
    dim, rope_dim = x.shape[-1], 2 * cos.shape[-1]
    tables_bsnd = site.form.replace is inplace_partial_rotary_mul_bsnd
    if site.soc is not None:  # one table layout per SoC (capabilities: table_layouts_*)
        if site.soc == "Ascend950" and not tables_bsnd:
            return f"on Ascend950 the tables are {'/'.join(limits['table_layouts_950'])}, not BS1D"
        if site.soc != "Ascend950" and tables_bsnd:
            return f"on {site.soc} the tables are {'/'.join(limits['table_layouts_a2_a3'])}"
    elif tables_bsnd:
        return "the BS1D tables of the previous form serve in emulation"
    if cos.dtype != site["angle_sin"].dtype:
        return "the cos and sin tables differ in dtype: the op takes one"
    return site.hardware_limits([
        unsupported(PARTIAL_ROTARY.op, site.soc, x=x),
        f"head_dim {dim} > {limits['max_head_dim']}" if dim > limits["max_head_dim"] else None,
        f"head_dim {dim} or rope dim {rope_dim} is odd" if dim % 2 or rope_dim % 2 else None,
    ])


def check(site):
    replace = site.form.replace
    recognized_mode = getattr(replace, "rotary_mode", None)
    if recognized_mode is not None:
        return _check_rotary_mul(site, recognized_mode)
    if replace in (inplace_partial_rotary_mul_bs1d, inplace_partial_rotary_mul_bsnd):
        return _check_inplace_partial(site)
    if replace is rotary_mul_on_rope_slice:
        reason = _v4_partial_reason(site)
        if reason:
            return reason
        rope_x = site["x"].new_empty((*site["x"].shape[:-1], 2 * site["angle_cos"].shape[-1]))
        return _check_rotary_mul(_SliceSite(site, rope_x), "interleave")
    if replace in (interleave_rope, interleave_rope_pair_angles):
        return _check_interleave_rope(site)
    if replace in (rotary_mul_interleave, rotary_mul_from_complex):
        return _check_rotary_mul(site, "interleave")
    return _check_rotary_mul(site, "half")


class _SliceSite:
    """A site seen as npu_rotary_mul on the rotated slice: x is the slice, the tables its own."""

    def __init__(self, site, rope_x):
        self._site, self.args = site, dict(site.args, x=rope_x)
        self.soc, self.mode, self.notes = site.soc, site.mode, site.notes

    def __getitem__(self, name):
        return self.args[name]


# ---- near misses: a rotation no form consumed --------------------------------------------
def _source_of_half(node):
    """x, for a node that takes a slice / chunk piece of x's last dim; else None."""
    if is_call(node, aten.slice.Tensor):
        return node.args[0]
    if node.op == "call_function" and node.target.__name__ == "getitem":
        split = node.args[0]
        if is_call(split, aten.split.Tensor, aten.split_with_sizes.default):
            return split.args[0]
    return None


def _rotation_parts(node):
    """For a rotate_half cat / rotate_every_two stack: (x, the rotation's inner nodes)."""
    if not (is_call(node, aten.cat.default, aten.stack.default) and len(node.args[0]) == 2):
        return None
    negated, kept = node.args[0]
    if not is_call(negated, aten.neg.default):
        return None
    x = _source_of_half(negated.args[0])
    if x is None or _source_of_half(kept) is not x:
        return None
    inner = [negated.args[0], negated, kept]
    if is_call(negated.args[0].args[0], aten.split.Tensor, aten.split_with_sizes.default):
        inner.append(negated.args[0].args[0])
    return x, inner


def anchor(node):
    if _rotation_parts(node) is not None:
        return True
    if is_call(node, aten.view_as_complex.default):
        return any(is_call(u, aten.mul.Tensor) for u in node.users)
    return False


def explain(node):
    if is_call(node, aten.view_as_complex.default):
        pairs = tensor_meta(node)
        mul = next(u for u in node.users if is_call(u, aten.mul.Tensor))
        other = next((a for a in mul.args if a is not node), None)
        freqs = tensor_meta(other)
        if freqs is None or not freqs.is_complex():
            return "the complex pairs are not multiplied by a complex rotation (freqs_cis)"
        if pairs is not None and len(node.users) > 1:
            user = next(u for u in node.users if u is not mul)
            return f"intermediate {node.name} ({node.target}) is also used by {user.name}"
        return None
    x, inner = _rotation_parts(node)
    x_val = tensor_meta(x)
    # (proofs, not comparisons: a near miss must not add a guard to the compiled graph)
    if x_val is not None and statically_known_true(x_val.shape[-1] % 2 == 1):
        return f"head_dim {x_val.shape[-1]} is odd: npu_rotary_mul rotates pairs"
    uneven = uneven_halves(inner, x)
    if uneven is not None:
        return (f"x is split at {uneven}, not provably the half of its head dim {x_val.shape[-1]} (x.chunk(2, -1) "
                "splits a symbolic d at (d + 1) // 2): npu_rotary_mul rotates the halves of an even head dim")
    consumers = [u for u in node.users if not is_call(u, aten.view.default, aten.flatten.using_ints)]
    rotated = node
    if is_call(node, aten.stack.default):  # the flatten(-2) that follows
        rotated = next(iter(node.users), node)
    chain = inner + [node] + ([rotated] if rotated is not node else [])
    sin_mul = next((u for u in rotated.users if is_call(u, aten.mul.Tensor)), None)
    shared = users_outside(chain, allowed=chain + ([sin_mul] if sin_mul else []))
    if shared:
        used, user = shared
        return f"intermediate {used.name} ({used.target}) is also used by {user.name}"
    if sin_mul is None or not consumers:
        return "the rotated x is not multiplied by a sin table"
    if not any(is_call(u, aten.add.Tensor) for u in sin_mul.users):
        return "rotate(x) * sin is not added to x * cos"
    return None


# ---- rotations recognised by what they compute -------------------------------------------------
# The forms above are the spellings of transformers and torchtitan; any other spelling of the
# same map (torchtune's pairs from a reshape and a stack, olmo-core's unbind of a (2, D/2)
# view, a rotation by the negative angle, tables in another dtype than x ...) is found by
# evaluating the region around an index op symbolically (channel_algebra.py): each output
# channel j is then a sum of terms coefficient * x[u] * table[t]. It is npu_rotary_mul when
#     y[j] = x'[j] * r1[j] + s_j * x'[p(j)] * r2[j]
# for x' = x, or x with its pairs de-interleaved (or interleaved), p the partner of the op's
# mode (half: j +- D/2; interleave: j ^ 1), s_j -1 for the first channel of a pair and +1 for
# the second, over a block of channels (the rest passed through unchanged: partial RoPE), with
# r1, r2 read out of one table each by plain views. The op then computes exactly the
# region's math, in the region's arithmetic dtype (x and the tables cast to it, as the
# region does by promotion or casts), rounding once.
_SEEDS = (aten.cat.default, aten.stack.default, aten.slice.Tensor, aten.select.int, aten.view_as_complex.default,
          aten.flip.default, aten.roll.default, aten.unbind.int)
_ARITHMETIC = (aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor,
               aten.div.Scalar)
_WIDTH = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


@dataclass(frozen=True)
class _Table:
    leaf: torch.fx.Node
    tracked: int  # the leaf's trailing dims the gather reads
    is_complex: bool  # read through view_as_real (the part is the last index)
    gather: ChannelGather
    per_outer: bool  # one table per outer index (else one for all, broadcast over them)
    leading: int  # the leaf's dims that line up with x's leading dims


@dataclass(frozen=True)
class Rotation:
    x: torch.fx.Node
    x_tracked: int
    x_gather: Optional[ChannelGather]  # None: x's channels as they are
    outer: tuple  # the output's tracked dims outside the rotated dim (heads), each rotated alike
    channels: int  # D: the rotated dim
    block: tuple  # (a, b): the rotated channels of each D; the rest pass through
    mode: str
    r1: _Table
    r2: _Table
    out_dims: tuple = (0, 0)  # the output's (rank, leading dims the algebra did not track)


def recognize(graph, joint):
    seen = set()
    found = []
    # joint graphs: the backward nodes autograd made for each forward op (their seq_nr)
    backward_by_seq = {}
    if joint:
        for n in graph.nodes:
            if is_backward(n) and n.meta.get("seq_nr") is not None and modelled(n):
                backward_by_seq.setdefault(n.meta["seq_nr"], []).append(n)
    for node in graph.nodes:
        if node in seen or not is_call(node, *_SEEDS, operator.getitem) or (joint and is_backward(node)):
            continue
        if not _reaches_arithmetic(node):
            continue  # only moved on into what the algebra stops at: no region to evaluate
        include = (lambda n: not is_backward(n)) if joint else (lambda n: True)
        region = region_around(node, include)
        if region is not None and single_terms(region) and not any(_rotates_halves(n) for n in region.nodes):
            # no channel in it sums two terms, as a rotation's do, and no half rotation to name
            # (a merged projection's gate and up halves read by the SwiGLU's product): its
            # evaluation finds nothing from any of its seeds (a millisecond or more each)
            seen.update(region.nodes)
            continue
        try:
            evaluated = evaluate_around(node, include=include)
        except NotEvaluable as exc:
            seen.add(node)
            # say why, rather than nothing, where the forms do not (a gradient's rotation is
            # not a site of its own: its forward says it)
            if _rotates_halves(node) and not is_backward(node):
                found.append(Recognized("rotation (channel algebra)", node, [node], fallback=True,
                                        reason=f"a rotation (-x2 joined to x1) whose channels cannot be read: {exc}"))
            continue
        seen.update(evaluated.region.nodes)
        for output in evaluated.region.outputs:
            value = evaluated.values.get(output)
            if value is None or tensor_meta(output).is_complex():
                continue
            rotations = _rotations(value, output, evaluated)
            if isinstance(rotations, str) or tensor_meta(output).dim() < 3:
                # (read in fewer dims than the op takes: V3.2's indexer key reshaped to (B*S, D)
                # for its Hadamard transform; the rotation's own result has them)
                output, rotations = _before_a_repeat(output, rotations, evaluated)
            if not rotations:
                continue
            nodes = _ancestors_within(output, evaluated.region.nodes)
            if isinstance(rotations, str):
                found.append(Recognized("rotation (channel algebra)", output, nodes, reason=rotations))
                continue
            for rotation in rotations:
                found.extend(_recognized(rotation, output, nodes, backward_by_seq, evaluated.values))
    return found


def _reaches_arithmetic(node, limit=64):
    """Whether `node`'s values reach arithmetic (a product with a table, a negation) through
    moves and copies: a rotation's region does; a merged projection's q / k / v slice that
    reads straight into a fused op or the attention does not, and is not evaluated (half a
    millisecond each, 5 per layer)."""
    pending, seen = [node], set()
    while pending and len(seen) < limit:
        current = pending.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if is_call(user, *_ARITHMETIC, aten.neg.default):
                return True
            if is_call(user, *_MOVES) or user.target is operator.getitem:
                pending.append(user)
    return bool(pending)  # the walk's limit: evaluate rather than guess


def _rotates_halves(node):
    """A cat / stack of a negated piece and another piece of one tensor: rotate_half's
    `cat((-x2, x1))`, torchtune's `stack([-x1, x0])`: the shape of a rotation, whatever its
    tables (used only to name a region the algebra could not evaluate)."""
    if not is_call(node, aten.cat.default, aten.stack.default):
        return False
    pieces = [p for p in node.args[0] if isinstance(p, torch.fx.Node)]
    negated = [p.args[0] for p in pieces if is_call(p, aten.neg.default)]
    return len(pieces) == 2 and len(negated) == 1 and _root(negated[0]) is _root(
        next(p for p in pieces if not is_call(p, aten.neg.default)))


def _root(node):
    """The tensor a piece was cut from (through slices, selects, unbinds and views)."""
    while isinstance(node, torch.fx.Node) and (
            is_call(node, aten.slice.Tensor, aten.select.int, *RESHAPES) or node.target is operator.getitem):
        node = node.args[0]
        if is_call(node, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default):
            node = node.args[0]
    return node


# ops that move, copy or repeat their input's elements and compute nothing (GQA's repeat of k
# over the query heads: unsqueeze, expand, reshape; the transpose to BNSD for the attention)
_REPEATS = (*RESHAPES, aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.alias.default,
            aten.transpose.int, aten.permute.default)
# what a seed's values move through on their way to a rotation's arithmetic (_reaches_arithmetic):
# those, the index ops, and casts
_MOVES = (*_SEEDS, *_REPEATS, aten._to_copy.default, aten.view_as_real.default)


def _before_a_repeat(output, reason, evaluated):
    """(node, rotations): where the rotation is read after its result was moved or repeated
    (k expanded over the query heads, its channels more than x's; heads and positions
    transposed), the rotation as its result was before; else (output, reason) as they were."""
    chain, node = [], output
    while is_call(node, *_REPEATS) and node.args[0] in evaluated.values:
        node = node.args[0]
        chain.append(node)
    inner_reason = None
    for node in reversed(chain):  # the rotation's own result first, not a view of it
        if tensor_meta(node).is_complex():  # a complex value's channels are not real terms
            continue
        rotations = _rotations(evaluated.values[node], node, evaluated)
        if rotations and not isinstance(rotations, str):
            return node, rotations
        if isinstance(rotations, str) and inner_reason is None:
            inner_reason = node, rotations  # reported where the rotation is computed
    return inner_reason or (output, reason)


def _ancestors_within(output, region_nodes):
    inside, stack, out = set(region_nodes), [output], set()
    while stack:
        node = stack.pop()
        if node in out or node not in inside:
            continue
        out.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(out)


def _terms(value, x):
    """Per channel, [(coefficient, x's factor, the table's factor or None)], or None when a
    term is not x's element times at most one other element."""
    out = []
    for poly in value.channels:
        terms = []
        for mono, coef in poly.items():
            factors = [value.factor(f) for f in mono]
            xs = [f for f in factors if f.leaf is x]
            rest = [f for f in factors if f.leaf is not x]
            if len(xs) != 1 or len(rest) > 1 or xs[0].part != 0:
                return None
            terms.append((coef, xs[0], rest[0] if rest else None))
        out.append(terms)
    return out


def _rotations(value, output, evaluated):
    """The Rotations `value` can be read as (each rotated dim that fits, the output's last dim
    first), a reason why a rotation-like map is not one the op computes, or None when it is
    no rotation at all."""
    monomials = [set(value.factor(f).leaf for f in mono) for poly in value.channels for mono in poly]
    if not monomials:
        return None
    common = set.intersection(*monomials)
    out_shape = tensor_meta(output).shape
    lead = len(out_shape) - len(value.tracked_shape)
    # x has the output's leading dims (the tables broadcast there)
    candidates = sorted(common, key=lambda leaf: tuple(tensor_meta(leaf).shape[:lead]) != tuple(out_shape[:lead]))
    reason = None
    for x in candidates:
        terms = _terms(value, x)
        if terms is None or not any(len({t[1].index for t in channel}) > 1 for channel in terms):
            continue  # not linear in x, or no channel mixes two of x's channels: no rotation
        found = []
        for outer, channels in _rotated_dims(value.tracked_shape):
            fitted = _fit_rotation(value, x, terms, outer, channels, evaluated, (len(out_shape), lead))
            if isinstance(fitted, Rotation):
                found.append(fitted)
            else:
                reason = reason or fitted
        if found:
            return found
    return reason


def _rotated_dims(tracked_shape):
    """(outer dims, D) splits of the output's tracked dims: the last dim, then the last two ..."""
    for i in range(len(tracked_shape) - 1, -1, -1):
        channels = math.prod(tracked_shape[i:])
        if channels >= 2:
            yield tuple(tracked_shape[:i]), channels


def _x_orders(channels):
    """x' = x, x de-interleaved ([x0, x2, ..., x1, x3, ...]) and x interleaved: j -> x's index."""
    half = channels // 2
    yield "identity", list(range(channels))
    if channels % 2 == 0:
        yield "de-interleaved", [(j % half) * 2 + j // half for j in range(channels)]
        yield "interleaved", [(j // 2) + (j % 2) * half for j in range(channels)]


def _partner(j, a, size, mode):
    return a + ((j - a + size // 2) % size if mode == "half" else (j - a) ^ 1)


def _first_of_pair(j, a, size, mode):
    return (j - a) < size // 2 if mode == "half" else (j - a) % 2 == 0


def _fit_rotation(value, x, terms, outer, channels, evaluated, out_dims):
    x_tracked = next(t[1].tracked for channel in terms for t in channel)
    x_shape = tuple(tensor_meta(x).shape[tensor_meta(x).dim() - x_tracked:])
    total = len(terms)
    if channels % 2:
        return f"head_dim {channels} is odd: npu_rotary_mul rotates pairs"
    # the channels of x the rotation reads: all of x, or (x a merged projection the rotation
    # reads a slice of) as many of them as it has; read through a gather of those
    whole = math.prod(x_shape) == total
    window = list(range(total)) if whole else sorted({t[1].index for channel in terms for t in channel})
    if len(window) != total:
        return f"the rotation's {total} channels are not x's {math.prod(x_shape)}"
    rank = {u: i for i, u in enumerate(window)}
    # each output row of D channels reads only x's row at the same outer index
    if any(rank[t[1].index] // channels != j // channels for j, channel in enumerate(terms) for t in channel):
        return None if outer else "the rotation mixes channels of different rows"
    rotated = sorted({j % channels for j, t in enumerate(terms) if len(t) == 2})
    if not rotated:
        return None
    a, b = rotated[0], rotated[-1] + 1
    if rotated != list(range(a, b)) or (b - a) % 2:
        return "the rotated channels are not one block of an even number of channels"
    reason = "its channels are not pairs of x's channels npu_rotary_mul rotates (half or interleaved)"
    rows = total // channels
    for order_name, order in _x_orders(channels):
        x_index = [window[(j // channels) * channels + order[j % channels]] for j in range(total)]
        if any(terms[j] != [(1.0, terms[j][0][1], None)] or terms[j][0][1].index != x_index[j]
               for j in range(total) if not a <= j % channels < b):
            continue
        for mode in ("half", "interleave"):
            fitted = _fit_mode(terms, x_index, a, b, channels, rows, mode, evaluated)
            if isinstance(fitted, str):
                reason = fitted if "table" in fitted else reason
                continue
            r1, r2 = fitted
            x_gather = None
            if order_name != "identity" or not whole:
                x_gather = channel_gather([_multi(x_shape, i) for i in x_index], x_shape)
                if x_gather is None:
                    continue
            return Rotation(x, x_tracked, x_gather, outer, channels, (a, b), mode, r1, r2, out_dims)
    return reason


def _multi(shape, index):
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def _fit_mode(terms, x_index, a, b, channels, rows, mode, evaluated):
    size = b - a
    direct, cross = [], []
    for row in range(rows):
        for j in range(row * channels + a, row * channels + b):
            by_index = {t[1].index: t for t in terms[j]}
            partner = row * channels + _partner(j - row * channels, a, size, mode)
            here, there = by_index.get(x_index[j]), by_index.get(x_index[partner])
            if here is None or there is None:
                return f"channel {j} is not paired with its {mode} partner"
            if here[2] is None or there[2] is None:
                return f"channel {j} is not multiplied by a table"
            sign = -1.0 if _first_of_pair(j - row * channels, a, size, mode) else 1.0
            direct.append((here[0], here[2]))
            cross.append((sign * there[0], there[2]))
    tables = []
    for which, entries in (("cos", direct), ("sin", cross)):
        if any(abs(coef) != 1.0 for coef, _ in entries):
            return f"the {which} table is scaled by {next(c for c, _ in entries if abs(c) != 1.0)}: not a rotation"
        groups = {(f.leaf, f.tracked, tensor_meta(f.leaf).is_complex()) for _, f in entries}
        if len(groups) != 1:
            return f"the {which} table is read from {len(groups)} tensors: npu_rotary_mul takes one"
        (leaf, tracked, is_complex), = groups
        shape = tuple(tensor_meta(leaf).shape[tensor_meta(leaf).dim() - tracked:]) + ((2,) if is_complex else ())
        sources = [f.multi_index() + ((f.part,) if is_complex else ()) for _, f in entries]
        signs = [coef for coef, _ in entries]
        per_row = size
        # one table for every row (broadcast over the heads), or one per row
        per_outer = any(sources[i] != sources[i % per_row] or signs[i] != signs[i % per_row]
                        for i in range(len(sources)))
        if not per_outer:
            sources, signs = sources[:per_row], signs[:per_row]
        gather = channel_gather(sources, shape, signs)
        if gather is None:
            return f"the {which} table is read in an order plain views cannot gather"
        tables.append(_Table(leaf, tracked, is_complex, gather, per_outer, evaluated.leading_dims(leaf)))
    return tables


def _arithmetic_dtypes(nodes):
    # a complex product computes in its parts' real dtype
    return {tensor_meta(n).dtype.to_real() for n in nodes if is_call(n, *_ARITHMETIC)}


def _shared_intermediate(rotation, output, nodes):
    """A node between x and the output that something outside the rotation also reads: the
    code would compute it anyway, and the fused op would only add work (the same refusal as
    the forms' explain: "also used by")."""
    inside = set(nodes)
    on_x_path = {rotation.x}
    for node in nodes:
        if any(a in on_x_path for a in node.all_input_nodes):
            on_x_path.add(node)
    for node in nodes:
        if node is output or node not in on_x_path:
            continue
        outside = next((u for u in node.users if u not in inside), None)
        if outside is not None:
            return f"intermediate {node.name} ({node.target}) is also used by {outside.name}"
    return None


def _recognized(rotation, output, nodes, backward_by_seq, forward_values):
    dtypes = _arithmetic_dtypes(nodes)
    if not dtypes:
        return []
    shared = _shared_intermediate(rotation, output, nodes)
    if shared:
        return [Recognized("rotation (channel algebra)", output, nodes, reason=shared)]
    compute = max(dtypes, key=lambda d: _WIDTH.get(d, 0))
    out_dtype = tensor_meta(output).dtype
    backward = None
    readers = _backward_nodes(nodes, backward_by_seq)
    if readers:
        backward = _backward_of(rotation, output, nodes, forward_values, readers)
        if isinstance(backward, str):
            return [Recognized("rotation (channel algebra)", output, nodes, reason=backward)]
    notes = []
    if len(dtypes) > 1:
        notes.append(f"computes in {str(compute)[6:]} and rounds once where the code rounds in "
                     f"{', '.join(sorted(str(d)[6:] for d in dtypes))}")
    args = {"x": rotation.x, "table_cos": rotation.r1.leaf, "table_sin": rotation.r2.leaf}
    out_tracked = _out_tracked(output, rotation)
    found = []
    layouts = [rotation]
    if tensor_meta(rotation.x).dim() - rotation.x_tracked + len(rotation.outer) + 1 == 3:
        # a 3-d x without a head dim (a shared key rotated once: DeepSeek-V4's kv) is not the
        # op's TND unless its tables are; with a head dim of 1 it is BSND, tables 1S1D
        layouts.append(dataclasses.replace(rotation, outer=rotation.outer + (1,)))
    for rotation, via_half in ((r, half) for r in layouts
                               for half in ((False, True) if rotation.mode == "interleave" else (False,))):
        replace = _rotation_replacement(rotation, compute, out_dtype, out_tracked, via_half,
                                        tensor_meta(output).dim() - len(out_tracked))
        replace.rotary_mode = "half" if via_half else rotation.mode
        name = f"rotation of {rotation.mode} pairs (channel algebra)" + (", as half mode" if via_half else "")
        extra = {}
        if backward is not None:
            gradient_output, gradient_nodes, gradient = backward
            extra = dict(backward_output=gradient_output, backward_nodes=gradient_nodes,
                         backward_args={**args, "grad": gradient},
                         backward_replace=_rotation_gradient(rotation, compute, out_tracked, via_half))
        found.append(Recognized(name, output, nodes, args, replace, _site_args(rotation, compute),
                                fused_op="npu.npu_rotary_mul", notes=notes, **extra))
    return found


def _factor_key(factor):
    return (factor.leaf.name, factor.tracked, factor.index, factor.part)


def _canonical(value, poly):
    return {tuple(sorted((value.factor(f) for f in mono), key=_factor_key)): coef for mono, coef in poly.items()}


def _backward_of(rotation, output, nodes, forward_values, readers):
    """In a joint graph: (the node computing x's gradient from the output's, the backward
    region's nodes, the incoming gradient), where the backward computes exactly
        dx[u] = sum over j of M[j, u] * g[j]    (M: the rotation, y = M x)
    else the reason it does not."""
    forward = set(nodes)
    known = {n: forward_values[n] for n in nodes if n in forward_values}
    try:
        evaluated = evaluate_around(readers[0], include=is_backward, known=known)
    except NotEvaluable as exc:
        return f"the rotation's backward is not one the channel algebra reads: {exc}"
    if any(r not in evaluated.region.nodes for r in readers):
        return "the rotation's backward is spread over several regions"
    value = forward_values[output]
    x_count = value and len(value.channels)
    for candidate in evaluated.region.outputs:
        grad = evaluated.values.get(candidate)
        if grad is None or len(grad.channels) != x_count:
            continue
        gradients = {grad.factor(f).leaf for poly in grad.channels for mono in poly for f in mono
                     if is_backward(grad.factor(f).leaf) or grad.factor(f).leaf.op == "placeholder"}
        gradients -= forward | {rotation.r1.leaf, rotation.r2.leaf}
        if len(gradients) != 1:
            continue
        (g,) = gradients
        g_tracked = next(grad.factor(f).tracked for poly in grad.channels for mono in poly for f in mono
                         if grad.factor(f).leaf is g)
        if _expected_gradient(value, rotation.x, g, g_tracked) == [_canonical(grad, p) for p in grad.channels]:
            region = _ancestors_within(candidate, evaluated.region.nodes)
            return candidate, region, g
    return "the backward of the rotation does not compute its gradient alone (x's gradient summed with others?)"


def _backward_nodes(nodes, backward_by_seq):
    """The joint graph's backward nodes autograd made for the region's forward nodes (they
    carry their forward op's seq_nr), that the channel algebra models."""
    forward_ops = {n.meta.get("seq_nr") for n in nodes} - {None}
    return sorted(n for seq in forward_ops for n in backward_by_seq.get(seq, ()))


def _expected_gradient(value, x, g, g_tracked):
    """[dx[u] as {factors: coefficient}] for the forward map `value` (y = M x)."""
    count = len(value.channels)
    expected = [dict() for _ in range(count)]
    for j, poly in enumerate(value.channels):
        g_factor = Factor(g, g_tracked, j)
        for mono, coef in poly.items():
            factors = [value.factor(f) for f in mono]
            xs = [f for f in factors if f.leaf is x]
            rest = [f for f in factors if f.leaf is not x]
            key = tuple(sorted([*rest, g_factor], key=_factor_key))
            out = expected[xs[0].index]
            out[key] = out.get(key, 0.0) + coef
    return [{k: c for k, c in e.items() if c != 0.0} for e in expected]


def _out_tracked(output, rotation):
    """The output's trailing dims that hold the outer dims and the rotated channels."""
    shape = tensor_meta(output).shape
    count, dims = 1, 0
    wanted = math.prod(rotation.outer) * rotation.channels
    while count < wanted and dims < len(shape):
        dims += 1
        count *= int(shape[-dims])
    return tuple(int(s) for s in shape[len(shape) - dims:])


def _table_shape(table, rotation, table_shape):
    """The op's table: the table's dims that broadcast against x's leading dims, then the
    heads (its own per head, or 1), then the rotated channels. (Its other dims are tracked,
    or size-1 dims that broadcast over what the algebra tracked of x.)"""
    a, b = rotation.block
    rows = rotation.outer if table.per_outer else (1,) * len(rotation.outer)
    # The table's leading dims line up with the output's last untracked ones. x may leave a
    # dim untracked that the output tracks (k's one head, where only the table's unsqueeze
    # made that dim): in x's frame ones stand between the table's leading dims and the rows.
    out_rank, out_lead = rotation.out_dims
    x_lead = tensor_meta(rotation.x).dim() - rotation.x_tracked
    gap = x_lead - out_lead if out_rank == x_lead + len(rotation.outer) + 1 else 0
    return (*table_shape[:table.leading], *(1,) * max(gap, 0), *rows, b - a)


def _table_of(table, t, rotation):
    gathered = table.gather(torch.view_as_real(t.resolve_conj()) if table.is_complex else t)
    return gathered.reshape(_table_shape(table, rotation, t.shape))


def _leading_as_output(lead, count):
    """x's untracked leading sizes as the output's `count` leading dims: the algebra leaves out
    size-1 dims (an MQA k's one head), which x or the output may hold where the other does
    not. Same elements in the same order either way (a shape the output does not have is
    refused by the comparison of the replacement with the region)."""
    lead = list(lead)
    while len(lead) > count and statically_known_true(lead[-1] == 1):
        lead.pop()
    return [*lead, *(1,) * (count - len(lead))]


def _rotation_replacement(rotation, compute, out_dtype, out_tracked, via_half, out_lead):
    a, b = rotation.block
    partial = (a, b) != (0, rotation.channels)
    outer, channels = rotation.outer, rotation.channels

    def npu_rotary_mul_recognized(x, table_cos, table_sin):
        lead = x.shape[:x.dim() - rotation.x_tracked]
        xv = rotation.x_gather(x) if rotation.x_gather is not None else x
        xv = xv.reshape(*lead, *outer, channels).to(compute)
        block = xv[..., a:b] if partial else xv
        cos = _as_rank_of(_table_of(rotation.r1, table_cos, rotation).to(compute), block)
        sin = _as_rank_of(_table_of(rotation.r2, table_sin, rotation).to(compute), block)
        if via_half:
            y = _interleave(torch.ops.npu.npu_rotary_mul(_deinterleave(block), _deinterleave(cos), _deinterleave(sin)))
        else:
            y = torch.ops.npu.npu_rotary_mul(block, cos, sin, rotation.mode)
        if partial:
            y = torch.cat([p for p in (xv[..., :a], y, xv[..., b:]) if p.shape[-1]], dim=-1)
        return y.reshape(*_leading_as_output(lead, out_lead), *out_tracked).to(out_dtype)

    return npu_rotary_mul_recognized


def _rotation_gradient(rotation, compute, out_tracked, via_half):
    """dx from the incoming gradient: npu_rotary_mul_backward, the op torch_npu
    differentiates npu_rotary_mul with (the passed-through channels' gradient is theirs)."""
    a, b = rotation.block
    partial = (a, b) != (0, rotation.channels)
    outer, channels = rotation.outer, rotation.channels

    def npu_rotary_mul_backward_recognized(x, table_cos, table_sin, grad):
        lead = x.shape[:x.dim() - rotation.x_tracked]
        xv = x.reshape(*lead, *outer, channels).to(compute)
        g = grad.reshape(*lead, *outer, channels).to(compute)
        x_block, g_block = (xv[..., a:b], g[..., a:b]) if partial else (xv, g)
        cos = _as_rank_of(_table_of(rotation.r1, table_cos, rotation).to(compute), x_block)
        sin = _as_rank_of(_table_of(rotation.r2, table_sin, rotation).to(compute), x_block)
        if via_half:
            dx = _interleave(torch.ops.npu.npu_rotary_mul_backward(
                _deinterleave(g_block), _deinterleave(x_block), _deinterleave(cos), _deinterleave(sin))[0])
        else:
            dx = torch.ops.npu.npu_rotary_mul_backward(g_block, x_block, cos, sin, rotation.mode)[0]
        if partial:
            dx = torch.cat([p for p in (g[..., :a], dx, g[..., b:]) if p.shape[-1]], dim=-1)
        return dx.reshape(x.shape).to(x.dtype)

    return npu_rotary_mul_backward_recognized


def _site_args(rotation, compute):
    """The op's operands as check() reads them: x's rotated block, the tables at x's rank."""
    x = tensor_meta(rotation.x)
    a, b = rotation.block
    lead = tuple(x.shape[:x.dim() - rotation.x_tracked]) + rotation.outer
    block = x.new_empty((*lead, b - a), dtype=compute)
    tables = []
    for table in (rotation.r1, rotation.r2):
        value = tensor_meta(table.leaf)
        shape = _table_shape(table, rotation, tuple(value.shape))
        shape = (1,) * (len(lead) + 1 - len(shape)) + shape
        tables.append(value.new_empty(shape, dtype=compute))
    return {"x": block, "cos": tables[0], "sin": tables[1]}


PASS = FusionPass(
    name="rope",
    fused_op="npu.npu_rotary_mul",
    forms=FORMS,
    example={
        # B, N, S, D; cos/sin broadcast over heads as HF's unsqueeze(1) makes them
        "x": lambda dtype: torch.empty(2, 3, 5, 8, dtype=dtype),
        "cos": lambda dtype: torch.empty(2, 1, 5, 8, dtype=dtype),
        "sin": lambda dtype: torch.empty(2, 1, 5, 8, dtype=dtype),
        "pair_cos": lambda dtype: torch.empty(2, 1, 5, 4, dtype=dtype),
        "pair_sin": lambda dtype: torch.empty(2, 1, 5, 4, dtype=dtype),
        # torchtitan: x is [B, S, N, D] in fp32, freqs_cis [1, S, 1, D/2] complex64
        "freqs": lambda dtype: torch.empty(1, 3, 1, 4, dtype=torch.complex64),
        # DeepSeek-V4: (b, S, rd/2) angles (the model's position_ids are (1, S)); x's last 4 of
        # its 8 channels rotate
        "angle_cos": lambda dtype: torch.empty(1, 5, 2, dtype=dtype),
        "angle_sin": lambda dtype: torch.empty(1, 5, 2, dtype=dtype),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.cat.default, aten.stack.default, aten.view_as_complex.default),
    explain=explain,
    # training graphs: only x needs a gradient; cos/sin/freqs come from buffers
    differentiable=("x",),
    # kv_rmsnorm_rope_cache folds DeepSeek's k RoPE into its op, so it must see it unfused;
    # attention's eager / math forms were traced on the model's transposed (roped) views,
    # which a fused rope's contiguous output no longer is
    after=("kv_rmsnorm_rope_cache", "attention"),
    recognize=recognize,
)
