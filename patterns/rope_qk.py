"""rope_qk: the RoPE of q and of k, one call -> npu_apply_rotary_pos_emb.

The rope pass leaves one npu_rotary_mul per tensor: two launches per attention layer,
q's and k's, with the same cos / sin tables. npu_apply_rotary_pos_emb rotates both in one
kernel (npu_ops/rope_qk.py), in half mode, BSND layout, D 64 or 128 on A2/A3:

    npu_rotary_mul(q, cos, sin), npu_rotary_mul(k, cos, sin)
        -> npu_apply_rotary_pos_emb(q, k, cos, sin, "BSND")

HF attention applies RoPE to BNSD views (q.view(B, S, N, D).transpose(1, 2)): those are
handed to the op as the BSND tensors they are views of, and the tables (1 or B, 1, S, D)
as (B, S, 1, D) views (the op wants cos's batch to be q's).

What makes it different from a pure function: the kernel writes q and k in place and
returns them (op-plugin `std::tie(query, key)`; the schema does not say so). So
- q and k must be read by nothing else, and no other view of their memory may be read
  after the call: a q / k / v split of one merged projection is fine (the ranges of the
  last dim are disjoint), a k also returned or cached unrotated is not;
- the outputs are q's and k's own memory, strided like them, where npu_rotary_mul's are
  laid out like torch.empty_like(x) (contiguous for a slice of a merged projection). The
  code after the RoPE was fused for the layout it had (the attention op takes no strided
  query), so an output that is not laid out as before is copied into that layout, a
  launch of its own, and the cost model then weighs the site as a whole (accept.py): in
  a batched decode step over a merged q/k/v projection the two copies make it no faster
  than two npu_rotary_mul, and it stays unfused with that reason. Where q and k come
  from their own projections (or a batch of one), it saves one launch per layer.
Under max-autotune torchair lowers the op as two TensorMove copies and the kernel
(custom/apply_rotary_pos_emb.py): three launches for two, which the cost model refuses too.
"""
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
npu = torch.ops.npu
APPLY = CAPABILITIES["npu.npu_apply_rotary_pos_emb"]


# ---- the unfused form: two rotations with the same tables (the rope pass's output) ----------
# k's first: a match starts from the later of the two calls, and model code rotates q, then k
# (a pair the other way round fuses too, with the names swapped: the op treats q and k alike)
def rotary_mul_pair(q, k, cos, sin):
    return npu.npu_rotary_mul(k, cos, sin), npu.npu_rotary_mul(q, cos, sin)


# ---- the fused calls -----------------------------------------------------------------------
def _dense(x):
    """x covers its memory without gaps (dims of size 1 aside): torch.empty_like(x) keeps its
    strides. Sizes not proven are taken as not dense."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(x.shape, x.stride())
                                if not statically_known_true(s == 1)), key=lambda p: _hint(p[1])):
        if not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _hint(size):
    return size.node.hint if isinstance(size, torch.SymInt) else size


def _laid_out_like_rotary_mul(out, x):
    """The result in the layout npu_rotary_mul gives, torch.empty_like(x)'s (torch_npu's
    Meta): x's own for a dense x, else contiguous. On an NPU the kernel returns x's memory
    itself, so for an x that is not dense (a slice of a merged projection) it is copied,
    whatever the fake result's strides say."""
    return out if _dense(x) else out.clone(memory_format=torch.contiguous_format)


def apply_rotary_pos_emb_bnsd(q, k, cos, sin):
    # q, k (B, N, S, D) views of BSND tensors; cos, sin (1 or B, 1, S, D)
    batch = q.shape[0]
    tables = [t.transpose(1, 2).expand(batch, -1, -1, -1) for t in (cos, sin)]
    q_out, k_out = npu.npu_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *tables, "BSND")
    return _laid_out_like_rotary_mul(k_out.transpose(1, 2), k), _laid_out_like_rotary_mul(q_out.transpose(1, 2), q)


def apply_rotary_pos_emb_bsnd(q, k, cos, sin):
    # q, k (B, S, N, D); cos, sin (1 or B, S, 1, D)
    batch = q.shape[0]
    tables = [t.expand(batch, -1, -1, -1) for t in (cos, sin)]
    q_out, k_out = npu.npu_apply_rotary_pos_emb(q, k, *tables, "BSND")
    return _laid_out_like_rotary_mul(k_out, k), _laid_out_like_rotary_mul(q_out, q)


FORMS = [
    Form(rotary_mul_pair, apply_rotary_pos_emb_bnsd, dtypes=(torch.float32,)),
    Form(rotary_mul_pair, apply_rotary_pos_emb_bsnd, dtypes=(torch.float32,)),
]


# ---- checks ----------------------------------------------------------------------------------
def _layout_reason(site):
    """Why the tensors are not the layout of the site's form, or None."""
    q, k, cos, sin = (site[name] for name in ("q", "k", "cos", "sin"))
    if any(t.dim() != 4 for t in (q, k, cos, sin)):
        return "q, k, cos and sin are not all 4-d"
    bnsd = site.form.replace is apply_rotary_pos_emb_bnsd
    heads, seq = (1, 2) if bnsd else (2, 1)
    if cos.shape != sin.shape or not statically_known_true(cos.shape[heads] == 1):
        return f"cos/sin {list(cos.shape)} are not shared by the heads of a {'BNSD' if bnsd else 'BSND'} q"
    for name, size_q, size_k, size_table in (("B", q.shape[0], k.shape[0], cos.shape[0]),
                                             ("S", q.shape[seq], k.shape[seq], cos.shape[seq])):
        if not statically_known_true(size_q == size_k):
            return f"q and k differ in {name} ({size_q} and {size_k})"
        if not (statically_known_true(size_table == size_q) or statically_known_true(size_table == 1)):
            return f"cos/sin have {size_table} in {name}, q {size_q}"
    if q.shape[-1] != k.shape[-1] or cos.shape[-1] != q.shape[-1]:
        return f"q, k and cos differ in their head dim ({q.shape[-1]}, {k.shape[-1]}, {cos.shape[-1]})"
    if len({t.dtype for t in (q, k, cos, sin)}) != 1:
        return "q, k, cos and sin are not of one dtype: npu_apply_rotary_pos_emb takes one"
    return None


def _ub_bytes(q_heads, k_heads, dtype):
    """The UB the A2/A3 kernel needs (CANN aclnnApplyRotaryPosEmb's formula)."""
    size = torch.finfo(dtype).bits // 8
    cast = 1 if dtype == torch.bfloat16 else 0
    c = 4 if cast else size
    heads = q_heads + k_heads
    return heads * 128 * c * 2 + 128 * size * 4 + heads * 128 * c + heads * 128 * c * 2 + cast * 128 * 4 * 2


def _hardware_reasons(site):
    q, k = site["q"], site["k"]
    limits = APPLY.limits
    heads = 1 if site.form.replace is apply_rotary_pos_emb_bnsd else 2
    reasons = [unsupported(APPLY.op, site.soc, x=q)]
    if site.soc != "Ascend950":
        dim = q.shape[-1]
        if dim not in limits["head_dims"]:
            reasons.append(f"head_dim {dim} is not {' or '.join(map(str, limits['head_dims']))} "
                           "(npu_apply_rotary_pos_emb on A2/A3)")
        need = _ub_bytes(q.shape[heads], k.shape[heads], q.dtype)
        if need > limits["ub_bytes_a2_a3"]:
            reasons.append(f"{q.shape[heads]} + {k.shape[heads]} heads need {need} bytes of UB, more than "
                           f"{limits['ub_bytes_a2_a3']} (A2/A3)")
    elif q.shape[-1] > limits["max_head_dim_950"]:
        reasons.append(f"head_dim {q.shape[-1]} > {limits['max_head_dim_950']} on Ascend950")
    return reasons


def _overwritten_reason(site):
    """The kernel overwrites q and k: nothing else may read them, or memory they share."""
    matched = set(site.nodes)
    for name in ("q", "k"):
        node = site.arg_nodes[name]
        others = [u for u in node.users if u not in matched]
        if others:
            return (f"{name} is also read by {others[0].name} ({others[0].target}): npu_apply_rotary_pos_emb "
                    f"writes its result into {name} (op-plugin returns its inputs)")
        reason = _shared_memory_reason(name, node, matched)
        if reason:
            return reason
    return None


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
          aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.t.default,
          aten.alias.default)


def _last_dim_range(node, base):
    """The [start, stop) of base's last dim that a slice / split piece of it keeps, else None."""
    value = tensor_meta(base)
    if value is None:
        return None
    last = value.dim() - 1
    if is_call(node, aten.slice.Tensor) and node.args[1] in (-1, last) and (len(node.args) < 5 or node.args[4] == 1):
        start = node.args[2] if len(node.args) > 2 else 0
        stop = min(node.args[3], value.shape[-1]) if len(node.args) > 3 else value.shape[-1]
        return (start, stop) if isinstance(start, int) and isinstance(stop, int) else None
    return None


def _shared_memory_reason(name, node, matched):
    """Walk from the input back through views to the tensor that owns its memory; every other
    reader of that memory must read a disjoint range of its last dim."""
    chain = []
    while is_call(node, *_VIEWS, aten.slice.Tensor):
        chain.append(node)
        node = node.args[0]
    base = node
    if base.op == "placeholder":
        return f"{name} is a view of the graph input {base.name}, which the kernel would overwrite"
    first = chain[-1] if chain else None  # the view taken of the base itself
    own = _last_dim_range(first, base) if is_call(first, aten.slice.Tensor) else "whole"
    if own == "whole":
        return (None if len(base.users) == 1 else
                f"{name}'s memory ({base.name}) is read elsewhere, and the kernel overwrites it")
    if own is None:
        return f"{name} is a piece of {base.name} whose range is not a constant slice of its last dim"
    for user in base.users:
        if user in chain:
            continue
        theirs = _last_dim_range(user, base)
        if theirs is None or not (theirs[1] <= own[0] or own[1] <= theirs[0]):
            return (f"{user.name} reads memory of {base.name} that {name} shares, which the kernel overwrites")
    return None


def _depends_on(node, target):
    """`node` is computed from `target` (a walk back over the nodes after target)."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        if current is target:
            return True
        if current in seen or not current > target:
            continue
        seen.add(current)
        pending.extend(current.all_input_nodes)
    return False


def check(site):
    reason = _layout_reason(site)
    if reason:
        return reason
    q_rope, k_rope = (next(n for n in site.nodes if is_call(n, npu.npu_rotary_mul.default)
                           and n.args[0] is site.arg_nodes[name]) for name in ("q", "k"))
    if _depends_on(site.arg_nodes["k"], q_rope) or _depends_on(site.arg_nodes["q"], k_rope):
        return "one rotation's input is computed from the other's output: one call cannot do both"
    reason = _overwritten_reason(site)
    if reason:
        return reason
    return site.hardware_limits(_hardware_reasons(site))


# ---- near misses: two rotations with the same tables that did not pair ------------------------
def _partner(node):
    """Another npu_rotary_mul (half mode) with this one's tables."""
    if len(node.args) != 3 or node.kwargs:
        return None
    cos = node.args[1]
    return next((u for u in cos.users if u is not node and is_call(u, npu.npu_rotary_mul.default)
                 and len(u.args) == 3 and not u.kwargs and u.args[1:] == node.args[1:]), None)


def anchor(node):
    # the first of the two (in graph order) anchors the pair
    if not is_call(node, npu.npu_rotary_mul.default):
        return False
    partner = _partner(node)
    return partner is not None and node < partner


def explain(node):
    x = tensor_meta(node.args[0])
    if x is not None and x.dim() != 4:
        return f"x is {x.dim()}-d: the pair is fused for 4-d (BNSD / BSND) q and k"
    return "q and k are rotated with the same tables, but no form of one call matched them"


PASS = FusionPass(
    name="rope_qk",
    fused_op="npu.npu_apply_rotary_pos_emb",
    forms=FORMS,
    example={
        # BNSD q (4 heads) and k (2 heads), tables (1, 1, S, D) as the rope pass leaves them
        "q": lambda dtype: torch.empty(2, 4, 3, 8, dtype=dtype),
        "k": lambda dtype: torch.empty(2, 2, 3, 8, dtype=dtype),
        "cos": lambda dtype: torch.empty(1, 1, 3, 8, dtype=dtype),
        "sin": lambda dtype: torch.empty(1, 1, 3, 8, dtype=dtype),
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (npu.npu_rotary_mul.default,),  # registered on first use (npu_ops)
    explain=explain,
    # the pairs are rope's npu_rotary_mul calls
    after=("rope",),
)
