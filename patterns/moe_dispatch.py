"""moe_dispatch: routed experts blocks -> init_routing / finalize_routing.

Three block families: transformers' grouped_mm path (below), its batched_mm path, and
torchtitan's local dispatcher (_torchtitan_block).

transformers 5 (integrations/moe.py, grouped_mm_experts_forward) routes tokens like this:

    expert_ids_g, perm = sort(top_k_index.reshape(-1))          # flat positions by expert
    x_g = x[perm // K];  w_g = top_k_weights.reshape(-1)[perm]
    offsets = cumsum(histc(expert_ids_g, E bins), int32)
    y = grouped_mm(act(grouped_mm(x_g, w_gate_up, offsets)), w_down, offsets)
    inv[perm] = arange(T*K)                                     # the inverse permutation
    out = (y * w_g[:, None])[inv].view(T, K, H).sum(1)

The whole block is one form, from the sort to the sum, and becomes

    x_g, row_idx, counts, _ = npu_moe_init_routing_v2(x, ids.int(), active_num=T*K,
        expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True, row_idx_type=0)
    offsets = counts.cumsum(0).int()
    y = <the same two grouped GEMMs and activation>             # grouped_matmul / swiglu fuse them
    out = npu_moe_finalize_routing(y, None, None, None, top_k_weights, row_idx, ids.int(),
                                   drop_pad_mode=2)

Index conventions (op_semantics.md 6.1, 6.4; each has a mix-up test in
tests/test_npu_ops_moe.py): init_routing_v2 is token-major (row r of x_g is token
src // K of flat position src), row_idx_type=0 gives the inverse permutation (flat
position t*K + k -> its row in x_g), which is what finalize's token-major mode 2 reads
(mode 0 would read it k-major); expert token counts (type 1, the documented one) are
turned into the cumulative ends grouped_mm takes.

Training. init_routing / finalize have no backward, npu_moe_token_permute / unpermute do,
with the same conventions (a stable sort by expert, its inverse map). So every block
also has a trainable form: on the joint graph it becomes permute -> the same expert
GEMMs -> unpermute, forward and backward (grouped_matmul and swiglu then fuse the GEMMs
and the activation with their backward). The counts are recounted from the ids as the
model does (histc). In inference the init_routing forms come first.

Why the whole block and not the dispatch alone: torch.sort is not stable, so the order of
the rows within one expert in x_g differs from init_routing's stable order. Every row is
computed alone and put back by the same permutation, so the block's output is the same;
the intermediate tensors are not, and a rewrite of only one side would mix tokens.
"""
import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta
from npu_fx_fusion.patterns.grouped_matmul import gemm_limits_reason

aten = torch.ops.aten
INIT = CAPABILITIES["npu.npu_moe_init_routing_v2"]


# ---- the routing both forms emit --------------------------------------------------------
def _init_routing(x, ids, num_experts):
    """Every token-expert pair active, sorted by expert: (x_g, row_idx, counts, _).

    active_expert_range is spelled out ([0, E), all experts): torchair 2.13's GE converter
    passes it on to the IR as a list and fails on the schema's empty default
    (tests/test_torchair_backend.py lowers this call).
    """
    tokens, top_k = ids.shape
    return torch.ops.npu.npu_moe_init_routing_v2(
        x, ids.to(torch.int32), active_num=tokens * top_k, expert_num=num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
        row_idx_type=0)


def _finalize(y, weights, row_idx, ids):
    """The weighted sum over each token's k rows, token-major (mode 2) as init_routing wrote them."""
    # the model weights y in the promoted dtype (DeepSeek: bf16 rows, fp32 weights)
    dtype = torch.promote_types(y.dtype, weights.dtype)
    return torch.ops.npu.npu_moe_finalize_routing(y.to(dtype), None, None, None, weights.to(dtype),
                                                  row_idx, ids.to(torch.int32), drop_pad_mode=2)


# ---- the expert computations the block may contain ----------------------------------------
def _swiglu_unfused(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _swiglu_fused(h):  # the swiglu pass runs before this one
    return torch.ops.npu.npu_swiglu(h, -1)


def _grouped_mm(x, w, offs):
    return torch._grouped_mm(x, w, offs)


def _grouped_mm_fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


# ---- the unfused form ---------------------------------------------------------------------
def _transformers_block(gemm, act):
    def search(x, ids, weights, w_gate_up, w_down, num_experts):
        top_k, tokens, hidden = ids.size(-1), x.size(0), x.size(-1)
        sample_weights = weights.reshape(-1)
        expert_ids_g, perm = torch.sort(ids.reshape(-1))
        x_g = x[perm // top_k]
        w_g = sample_weights[perm]
        counts = torch.histc(expert_ids_g.float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        weighted = y * w_g.unsqueeze(-1)
        inv = torch.empty_like(perm).index_put((perm,), torch.arange(perm.size(0), device=perm.device))
        return weighted[inv].view(tokens, top_k, hidden).sum(dim=1)

    def replace(x, ids, weights, w_gate_up, w_down, num_experts):
        x_g, row_idx, counts, _ = _init_routing(x, ids, num_experts)
        offsets = counts.cumsum(0).to(torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        return _finalize(y, weights, row_idx, ids)

    def replace_trainable(x, ids, weights, w_gate_up, w_down, num_experts):
        # permute's stable order instead of the model's unstable sort: the same rows per
        # expert in another order, each computed alone, so the block's output and its
        # gradients are the same; the offsets as the model counts them
        x_g, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, ids)
        counts = torch.histc(ids.reshape(-1).float(), bins=num_experts, min=0, max=num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        y = gemm(act(gemm(x_g, w_gate_up, offsets)), w_down, offsets)
        dtype = torch.promote_types(y.dtype, weights.dtype)  # as the model weights its rows
        return torch.ops.npu.npu_moe_token_unpermute(y.to(dtype), src_to_dst, weights.to(dtype))

    gemm_name = "grouped_mm" if gemm is _grouped_mm else "grouped_mm_fallback"
    act_name = "npu_swiglu" if act is _swiglu_fused else "silu_mul"
    search.__name__ = f"transformers_{gemm_name}_experts_{act_name}"
    replace.__name__ = f"init_routing_finalize_{gemm_name}_{act_name}"
    replace_trainable.__name__ = f"token_permute_unpermute_{gemm_name}_{act_name}"
    return search, replace, replace_trainable


def _transformers_batched_block(act):
    """transformers' batched_mm experts: each token repeated k times, a weight gathered per
    (token, expert) pair and a bmm, no sort at all. The weights are the parameters as
    transformers stores them, (E, out, in). The fused block is the same routing;
    its grouped GEMMs are emitted here directly, as there is no grouped GEMM to keep."""

    def search(x, ids, weights, gate_up_proj, down_proj):
        top_k, tokens, hidden = ids.size(-1), x.size(0), x.size(-1)
        selected = x.repeat_interleave(top_k, dim=0)
        sample_weights = weights.reshape(-1)
        expert_ids = ids.reshape(-1)
        h = torch.bmm(gate_up_proj[expert_ids], selected.unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(down_proj[expert_ids], act(h).unsqueeze(-1)).squeeze(-1)
        return (y * sample_weights.unsqueeze(-1)).view(tokens, top_k, hidden).sum(dim=1)

    def replace(x, ids, weights, gate_up_proj, down_proj):
        x_g, row_idx, counts, _ = _init_routing(x, ids, gate_up_proj.shape[0])

        def gemm(rows, w):  # w is (E, out, in): the transposed view is the op's (E, in, out)
            return torch.ops.npu.npu_grouped_matmul([rows], [w.transpose(-2, -1)], group_list=counts,
                                                    split_item=3, group_type=0, group_list_type=1)[0]

        y = gemm(act(gemm(x_g, gate_up_proj)), down_proj)
        return _finalize(y, weights, row_idx, ids)

    act_name = "npu_swiglu" if act is _swiglu_fused else "silu_mul"
    search.__name__ = f"transformers_batched_mm_experts_{act_name}"
    replace.__name__ = f"init_routing_grouped_matmul_finalize_{act_name}"
    return search, replace


def _torchtitan_experts(routed, w1, w2, w3, counts):
    """torchtitan's GroupedExperts on the expert-sorted rows: w1, w3, w2 as bf16 grouped GEMMs
    on the offsets of the model's own per-expert counts (the same in every form)."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(routed.bfloat16(), w1.bfloat16().transpose(-2, -1),
                                                   offs=offsets))
    h = h * torch._grouped_mm(routed.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offsets)


def _torchtitan_block():
    """torchtitan's LocalTokenDispatcher around its GroupedExperts (models/common/moe.py,
    token_dispatcher.py): a stable argsort of the flat expert ids, the gather, offsets from
    the routing map's counts, w1/w3/w2 as three bf16 grouped GEMMs, and the combine that
    weights each row in fp32 and scatter-adds it back to its token.

    The stable argsort orders the rows exactly as init_routing_v2 does (by expert, then by
    flat position), so the experts see the same rows in the same order; the counts and
    offsets are the model's own. Only the combine's additions change order: finalize adds
    each token's k rows in k order, scatter_add in row order, and it sums in fp32 before
    the one rounding to the model's dtype, where torchtitan rounds each weighted row first.
    """

    def search(x, ids, weights, w1, w2, w3, counts):
        top_k = ids.size(-1)
        perm = torch.argsort(ids.view(-1), stable=True)
        weights_sorted = weights.view(-1)[perm]
        token = perm // top_k
        routed = x[token]
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        out = torch.zeros_like(x)
        y = (y.to(torch.float32) * weights_sorted.reshape(-1, 1)).to(y.dtype)
        index = token.reshape(-1, 1).expand(-1, x.shape[-1])
        return torch.ops.torchtitan.deterministic_scatter_add(out, index, y)

    def replace(x, ids, weights, w1, w2, w3, counts):
        routed, row_idx, _, _ = _init_routing(x, ids, counts.shape[0])
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        return _finalize(y, weights, row_idx, ids).to(x.dtype)

    def replace_trainable(x, ids, weights, w1, w2, w3, counts):
        # the same rows (permute's sort is stable as well), src_to_dst its inverse map
        routed, src_to_dst = torch.ops.npu.npu_moe_token_permute(x, ids)
        y = _torchtitan_experts(routed, w1, w2, w3, counts).type_as(x)
        return torch.ops.npu.npu_moe_token_unpermute(y, src_to_dst, weights)

    search.__name__ = "torchtitan_local_dispatch_grouped_experts"
    replace.__name__ = "init_routing_grouped_mm_finalize"
    replace_trainable.__name__ = "token_permute_grouped_mm_unpermute"
    return search, replace, replace_trainable


_BATCHED_FORMS = []
for _act in (_swiglu_fused, _swiglu_unfused):
    _search, _replace = _transformers_batched_block(_act)
    _BATCHED_FORMS.append(Form(_search, _replace, dtypes=(torch.float32,), fused_op="npu.npu_moe_init_routing_v2"))


def forms():
    """transformers' fp32 experts use its fallback op, torchtitan's combine its scatter-add
    op: those forms exist once the library that defines the op is imported."""
    gemms = [(_grouped_mm, torch.bfloat16)]
    if interop.transformers_grouped_mm_fallback() is not None:
        gemms.append((_grouped_mm_fallback, torch.float32))
    grouped = [form for gemm, _ in gemms for act in (_swiglu_fused, _swiglu_unfused)
               for form in _FORMS[(gemm, act)]]
    torchtitan = ([_TORCHTITAN_FORM, _TORCHTITAN_TRAINABLE_FORM]
                  if interop.torchtitan_deterministic_scatter_add() is not None else [])
    return grouped + _BATCHED_FORMS + torchtitan


# Training: init_routing / finalize have no backward; npu_moe_token_permute / unpermute do
# (the same index conventions: a stable sort, its inverse map), so on the joint graph a
# block becomes those, forward and backward. In inference the init_routing form comes first.
_FORMS = {}
for _gemm, _dtype in ((_grouped_mm, torch.bfloat16), (_grouped_mm_fallback, torch.float32)):
    for _act in (_swiglu_fused, _swiglu_unfused):
        _search, _replace, _replace_trainable = _transformers_block(_gemm, _act)
        _FORMS[(_gemm, _act)] = (
            Form(_search, _replace, dtypes=(_dtype,), fused_op="npu.npu_moe_init_routing_v2"),
            Form(_search, _replace_trainable, dtypes=(_dtype,), fused_op="npu.npu_moe_token_permute",
                 grad_subsets=(("x", "weights", "w_gate_up", "w_down"),)))


_search, _replace, _replace_trainable = _torchtitan_block()
_TORCHTITAN_FORM = Form(_search, _replace, dtypes=(torch.float32, torch.bfloat16),
                        fused_op="npu.npu_moe_init_routing_v2")
# Training: permute / unpermute, as for transformers' blocks above.
_TORCHTITAN_TRAINABLE_FORM = Form(_search, _replace_trainable, dtypes=(torch.float32, torch.bfloat16),
                                  fused_op="npu.npu_moe_token_permute",
                                  grad_subsets=(("x", "weights", "w1", "w2", "w3"),))


# ---- checks -------------------------------------------------------------------------------
def check(site):
    x, ids, weights = site["x"], site["ids"], site["weights"]
    experts = _expert_count(site.args)
    ops = (("npu.npu_moe_token_permute", "npu.npu_moe_token_unpermute")
           if site.form.fused_op == "npu.npu_moe_token_permute"
           else ("npu.npu_moe_init_routing_v2", "npu.npu_moe_finalize_routing"))
    reason = next(filter(None, (unsupported(op, site.soc, x=x) for op in ops)), None)
    if reason:
        return reason
    if "gate_up_proj" in site.args:  # the batched forms emit the grouped GEMMs themselves
        reason = _batched_gemm_reason(site, experts)
        if reason:
            return reason
    if ids.dim() != 2 or weights.shape != ids.shape:
        return f"top-k ids {list(ids.shape)} and weights {list(weights.shape)} are not one (T, K) pair"
    if ids.dtype not in (torch.int32, torch.int64):
        return f"expert ids are {ids.dtype}"
    if experts > INIT.limits["max_expert_num"]:
        return f"{experts} experts: npu_moe_init_routing_v2 takes at most {INIT.limits['max_expert_num']}"
    return None


def _expert_count(args):
    if "num_experts" in args:
        return args["num_experts"]
    return (args["gate_up_proj"] if "gate_up_proj" in args else args["w1"]).shape[0]


def _batched_gemm_reason(site, experts):
    """The limits of the two grouped GEMMs the batched forms emit ((E, out, in) weights)."""
    x, gate_up, down = site["x"], site["gate_up_proj"], site["down_proj"]
    return (gemm_limits_reason(site.soc, x, experts, gate_up.shape[2], gate_up.shape[1])
            or gemm_limits_reason(site.soc, x, experts, down.shape[2], down.shape[1]))


# ---- near misses: a sort of flattened expert ids that no form consumed --------------------
def anchor(node):
    if not is_call(node, aten.sort.default, aten.sort.stable):
        return False
    ids = tensor_meta(node.args[0])
    return (ids is not None and ids.dim() == 1 and not ids.is_floating_point()
            and any(is_call(u2, aten.floor_divide.default, aten.div.Tensor_mode)
                    for u in node.users for u2 in u.users))


def explain(sort):
    return ("the tokens are sorted by expert, but the code around it is neither transformers' "
            "grouped_mm experts block (sort, gather, histc offsets, two grouped GEMMs, the "
            "weighted inverse-permutation combine) nor torchtitan's local dispatcher (stable "
            "argsort, three grouped GEMMs, weighted scatter-add), which this pass rewrites "
            "whole; other dispatchers (Megatron's) are not handled in this version")


PASS = FusionPass(
    name="moe_dispatch",
    # its blocks are also matched with the activation swiglu fused (npu_swiglu forms)
    after=("swiglu",),
    fused_op="npu.npu_moe_init_routing_v2",
    forms=forms,
    # the token embeddings, routing weights and expert weights train through the block
    differentiable=("x", "weights", "w_gate_up", "w_down", "w1", "w2", "w3"),
    example={
        # T=12 tokens, K=2, H=16, E=5 experts of a gate_up of 2*8 and a down of 8 -> 16;
        # sizes multiples of 8 for _grouped_mm's alignment, and no other 5 in the trace
        "x": lambda dtype: torch.empty(12, 16, dtype=dtype),
        "ids": lambda dtype: torch.empty(12, 2, dtype=torch.int64),
        "weights": lambda dtype: torch.empty(12, 2, dtype=dtype),
        # transposed views of (E, out, in) storage, as transformers passes its parameters:
        # aten._grouped_mm's weight gradient (in the joint patterns) depends on it
        "w_gate_up": lambda dtype: torch.empty(5, 16, 16, dtype=dtype).transpose(-2, -1),
        "w_down": lambda dtype: torch.empty(5, 16, 8, dtype=dtype).transpose(-2, -1),
        "num_experts": 5,
        # the batched forms take the parameters as stored: (E, out, in)
        "gate_up_proj": lambda dtype: torch.empty(5, 16, 16, dtype=dtype),
        "down_proj": lambda dtype: torch.empty(5, 16, 8, dtype=dtype),
        # torchtitan's (E, F, D) w1 / w3 and (E, D, F) w2, and its per-expert counts
        "w1": lambda dtype: torch.empty(5, 8, 16, dtype=dtype),
        "w2": lambda dtype: torch.empty(5, 16, 8, dtype=dtype),
        "w3": lambda dtype: torch.empty(5, 8, 16, dtype=dtype),
        "counts": lambda dtype: torch.empty(5, dtype=torch.int64),
    },
    # DeepSeek weights its bf16 rows with fp32 routing weights: the same forward ops, but
    # the joint traces differ (the gradients are cast back to each side's dtype)
    example_variants=[{"weights": lambda dtype: torch.empty(12, 2, dtype=torch.float32)}],
    check=check,
    anchor=anchor,
    explain=explain,
    # verification needs expert ids below the expert count, and counts that agree with them
    verify_input=lambda name, args: _routing_input(name, args),
)


def _routing_input(name, args):
    """Verification inputs a random tensor does not make: each token's k distinct expert ids,
    and the per-expert counts of exactly those ids (torchtitan's offsets come from them).
    Both are drawn from one seeded generator, so the two calls agree."""
    if name not in ("ids", "counts"):
        return None
    tokens, top_k = args["ids"].shape
    experts = int(_expert_count(args))
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(int(tokens))])
    if name == "ids":
        return ids.to(args["ids"].dtype)
    return torch.bincount(ids.flatten(), minlength=experts).to(args["counts"].dtype)
