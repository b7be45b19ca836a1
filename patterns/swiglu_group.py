"""swiglu_group: DeepSeek-V4's clamped SwiGLU between the expert GEMMs, the routed score folded in
-> cann_ops_nn.swiglu_group (or npu_clipped_swiglu, score left after the GEMM).

transformers' DeepseekV4Experts._apply_gate (modeling_deepseek_v4.py L1067), on the grouped_mm
path (integrations/moe.py grouped_mm_experts_forward):

    gate, up = h.chunk(2, -1)
    y = silu(gate.clamp(max=L)) * up.clamp(min=-L, max=L)        L = swiglu_limit
    out_rows = (y @ W2[e]) * score                               the routed score AFTER the down GEMM

The down projection has no bias, so (y * score) @ W2 = (y @ W2) * score: the score can move
in front of W2, into swiglu_group's per-row weight (hicann/ops-nn aclnnSwigluGroup: the same
clamps, then `y * weight`). That is what torchtitan-npu's npu_swiglu_group does, and what this
pass does where moe_dispatch has already fused the block (it runs after moe_dispatch and
moe_gating): the block's combine then sums unweighted, finalize_routing(scales=None) in
inference, npu_moe_token_unpermute with probs of ones in training (None would mean top-1). The check proves what the move
needs: the down GEMM is a grouped GEMM with no bias, and the score multiplies whole rows (one
per token-expert pair, the combine's own weights, put in the rows' order by the routing's own
row map).

Targets by SoC (capabilities.py): swiglu_group (950; trains through SwigluGroup below,
which mirrors the extension's SwigluGroupFn: swiglu_group_backward with the unweighted
y_origin); elsewhere npu_clipped_swiglu(alpha=1, limit=L, bias=0, interleaved=False) on the
activation alone (Atlas A2 / A3 inference; no weight, no backward).

Precision: swiglu_group multiplies the score in fp32 and rounds once before the GEMM;
transformers rounds the activation, then the GEMM's output, then the weighted rows (bf16).
The clamp masks of the backward are open intervals (a value exactly at L gets no gradient;
torch's clamp passes it): they differ only on exact ties.

Not fused, and reported: the shared expert's separate gate and up projections (DeepseekV4MLP)
would need their outputs concatenated for either op (swiglu_group's input is one [.., 2I]).
"""
import functools

import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, only_on, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
SWIGLU_GROUP = CAPABILITIES["cann_ops_nn.swiglu_group"]
CLIPPED = CAPABILITIES["npu.npu_clipped_swiglu"]


# ---- the unfused pieces ------------------------------------------------------------------------
def _clamped_swiglu(h, swiglu_limit, swiglu_min):
    # DeepseekV4Experts._apply_gate; swiglu_min is -swiglu_limit (check)
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=swiglu_min, max=swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def _grouped_mm(x, w, offs):
    return torch._grouped_mm(x, w, offs)


def _grouped_mm_fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _experts(gemm, activation):
    """The two expert GEMMs around an activation, as moe_dispatch's fused block runs them."""
    def run(x_g, w_gate_up, w_down, offsets, *limits):
        return gemm(activation(gemm(x_g, w_gate_up, offsets), *limits), w_down, offsets)
    return run


def _folded_weight(weights, row_map):
    """The routed scores in the expert rows' order: row row_map[p] holds flat pair p = t*K + k
    (init_routing_v2's expanded_row_idx / token_permute's sorted_indices: source -> row)."""
    flat = weights.reshape(-1)
    return flat.new_zeros(flat.shape).index_put((row_map.long(),), flat).float()


class SwigluGroup(torch.autograd.Function):
    """The extension's SwigluGroupFn (activation/swiglu_group/torch_extension/swiglu_group.py):
    swiglu_group forward, swiglu_group_backward backward with y_origin = the UNWEIGHTED forward and
    clamp_limit 0.0 for "off" (the forward's -1.0). capabilities.py: the op's autograd_rule."""

    @staticmethod
    def forward(ctx, x, weight, clamp_limit):
        ctx.save_for_backward(x, weight)
        ctx.clamp_limit = clamp_limit
        return torch.ops.cann_ops_nn.swiglu_group(x, weight=weight, clamp_limit=clamp_limit)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        y_origin = torch.ops.cann_ops_nn.swiglu_group(x, clamp_limit=ctx.clamp_limit)
        grad_x, grad_weight = torch.ops.cann_ops_nn.swiglu_group_backward(
            grad.contiguous(), x, weight=weight.view(-1, 1), y_origin=y_origin,
            clamp_limit=0.0 if ctx.clamp_limit == -1.0 else ctx.clamp_limit)
        return grad_x, grad_weight.view(weight.shape), None


def _swiglu_group_folded(h, weight, swiglu_limit):
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return SwigluGroup.apply(h.contiguous(), weight, swiglu_limit)
    return torch.ops.cann_ops_nn.swiglu_group(h.contiguous(), weight=weight, clamp_limit=swiglu_limit)


# made once per op: forms() is asked at every run, and a pass's forms are compared by identity
# (its registrations, the precompiled patterns)
@functools.cache
def _forms_for(gemm, gemm_name, dtype):
    experts = _experts(gemm, _clamped_swiglu)

    def init_routing_block(x_g, w_gate_up, w_down, offsets, weights, row_idx, expert_ids, swiglu_limit,
                           swiglu_min):
        # moe_dispatch's inference replacement around the clamped SwiGLU
        y = experts(x_g, w_gate_up, w_down, offsets, swiglu_limit, swiglu_min)
        return torch.ops.npu.npu_moe_finalize_routing(y, None, None, None, weights, row_idx, expert_ids,
                                                      drop_pad_mode=2)

    def init_routing_block_folded(x_g, w_gate_up, w_down, offsets, weights, row_idx, expert_ids, swiglu_limit,
                                  swiglu_min):
        h = _swiglu_group_folded(gemm(x_g, w_gate_up, offsets), _folded_weight(weights, row_idx), swiglu_limit)
        y = gemm(h, w_down, offsets)
        return torch.ops.npu.npu_moe_finalize_routing(y, None, None, None, None, row_idx, expert_ids,
                                                      drop_pad_mode=2, k=weights.shape[-1])

    def permute_block(x_g, w_gate_up, w_down, offsets, weights, src_to_dst, swiglu_limit, swiglu_min):
        # moe_dispatch's trainable replacement around the clamped SwiGLU
        y = experts(x_g, w_gate_up, w_down, offsets, swiglu_limit, swiglu_min)
        return torch.ops.npu.npu_moe_token_unpermute(y, src_to_dst, weights)

    def permute_block_folded(x_g, w_gate_up, w_down, offsets, weights, src_to_dst, swiglu_limit, swiglu_min):
        h = _swiglu_group_folded(gemm(x_g, w_gate_up, offsets), _folded_weight(weights, src_to_dst), swiglu_limit)
        # probs of ones, not None: unpermute reads top-k from probs (None is top-1, one row per
        # token); multiplying by 1 is exact, the op's fp32 sum over the K rows stays
        return torch.ops.npu.npu_moe_token_unpermute(gemm(h, w_down, offsets), src_to_dst, torch.ones_like(weights))

    init_routing_block.__name__ = f"init_routing_{gemm_name}_clamped_swiglu_finalize"
    permute_block.__name__ = f"token_permute_{gemm_name}_clamped_swiglu_unpermute"
    init_routing_block_folded.__name__ = "swiglu_group_score_before_w2_finalize"
    permute_block_folded.__name__ = "swiglu_group_score_before_w2_unpermute"
    common = dict(dtypes=(dtype,), fused_op="cann_ops_nn.swiglu_group")
    return (Form(init_routing_block, init_routing_block_folded, grad_subsets=(), **common),
            Form(permute_block, permute_block_folded, grad_subsets=(("x_g", "w_gate_up", "w_down", "weights"),),
                 **common))


def deepseek_v4_clamped_swiglu(h, swiglu_limit, swiglu_min):
    return _clamped_swiglu(h, swiglu_limit, swiglu_min)


def npu_clipped_swiglu(h, swiglu_limit, swiglu_min):
    # alpha 1 (silu), bias 0, halves (not even/odd pairs): V4's _apply_gate exactly
    return torch.ops.npu.npu_clipped_swiglu(h.contiguous(), alpha=1.0, limit=swiglu_limit, bias=0.0,
                                            interleaved=False)


_CLIPPED_FORM = Form(deepseek_v4_clamped_swiglu, npu_clipped_swiglu, dtypes=(torch.float32,),
                     fused_op="npu.npu_clipped_swiglu")


def forms():
    """The fp32 block runs transformers' grouped_mm_fallback op: its forms exist once
    transformers is imported (asked at every apply)."""
    found = list(_forms_for(_grouped_mm, "grouped_mm", torch.bfloat16))
    if interop.transformers_grouped_mm_fallback() is not None:
        found += _forms_for(_grouped_mm_fallback, "grouped_mm_fallback", torch.float32)
    return found + [_CLIPPED_FORM]


# ---- checks ---------------------------------------------------------------------------------
def _gemm_bias_free(site):
    """The down GEMM (the one reading the activation) takes no bias: (y * s) @ W2 = (y @ W2) * s."""
    for node in site.nodes:
        if is_call(node, aten._grouped_mm.default) and (len(node.args) > 3 and node.args[3] is not None
                                                        or node.kwargs.get("bias") is not None):
            return f"{node.name} has a bias: moving the score before it would scale the bias too"
    return None


def check(site):
    limit, low = site["swiglu_limit"], site["swiglu_min"]
    if low != -limit or limit <= 0:
        return (f"up is clamped to [{low}, {limit}] and the gate below {limit}: both ops clamp up to "
                "[-limit, limit] with limit > 0")
    if site.form is _CLIPPED_FORM:
        h = site["h"]
        reason = unsupported(CLIPPED.op, site.soc, x=h) or (
            f"the gate_up dim {h.shape[-1]} is odd" if h.shape[-1] % 2 else None)
        if reason is None and site.soc is None:
            site.notes.append(f"on an NPU: {only_on(CLIPPED.op)} (inference series; no backward)")
        return reason
    x_g, weights = site["x_g"], site["weights"]
    row_map = site.args.get("row_idx", site.args.get("src_to_dst"))
    if weights.dim() != 2 or row_map is None or row_map.numel() != weights.numel() or x_g.shape[0] != weights.numel():
        return (f"the combine's weights {list(weights.shape)} are not one per expert row ({x_g.shape[0]} rows): "
                "the score would not multiply whole rows")
    reason = _gemm_bias_free(site)
    if reason:
        return reason
    return site.hardware_limits([unsupported(SWIGLU_GROUP.op, site.soc, x=x_g)
                                 or (only_on(SWIGLU_GROUP.op) if site.soc is None else None)])


# ---- near misses: a clamped SwiGLU left unfused -------------------------------------------------
def _clamped_silu_product(mul):
    """(silu node, other factor) of silu(clamp(..)) * clamp(..), else None."""
    if not is_call(mul, aten.mul.Tensor):
        return None
    silu = next((a for a in mul.args if is_call(a, aten.silu.default)), None)
    other = next((a for a in mul.args if a is not silu), None)
    if silu is None or not is_call(silu.args[0], aten.clamp.default) or not is_call(other, aten.clamp.default):
        return None
    return silu, other


# an NPU graph keeps aten.matmul unsplit (npu_dispatch.py), a CPU one has mm / bmm
_PROJECTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default, aten.matmul.default)


def _projection(node):
    while is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clamp.default):
        node = node.args[0]
    return is_call(node, *_PROJECTIONS)


def anchor(node):
    return _clamped_silu_product(node) is not None


def explain(mul):
    silu, other = _clamped_silu_product(mul)
    if _projection(silu.args[0]) and _projection(other):
        return ("a clamped SwiGLU whose gate and up come from separate projections (DeepSeek-V4's shared "
                "expert, DeepseekV4MLP): swiglu_group and npu_clipped_swiglu take them as the two halves of "
                "one tensor, and concatenating them would add a copy per step")
    return ("a clamped SwiGLU outside a fused routed-experts block (moe_dispatch fuses transformers' grouped_mm "
            "block first), or between GEMMs other than two bias-free grouped GEMMs")


PASS = FusionPass(
    name="swiglu_group",
    # inside the fused experts block (moe_dispatch), reading the combine's weights, which
    # moe_gating accepts only there
    after=("moe_dispatch", "moe_gating"),
    fused_op="cann_ops_nn.swiglu_group",
    forms=forms,
    example={
        # 12 rows (T=6 tokens, K=2) of H=16 through E=5 experts of a gate_up of 2*8, sizes multiples of 8
        "x_g": lambda dtype: torch.empty(12, 16, dtype=dtype),
        "w_gate_up": lambda dtype: torch.empty(5, 16, 16, dtype=dtype).transpose(-2, -1),
        "w_down": lambda dtype: torch.empty(5, 16, 8, dtype=dtype).transpose(-2, -1),
        "offsets": lambda dtype: torch.empty(5, dtype=torch.int32),
        "weights": lambda dtype: torch.empty(6, 2, dtype=dtype),
        "row_idx": lambda dtype: torch.empty(12, dtype=torch.int32),
        "expert_ids": lambda dtype: torch.empty(6, 2, dtype=torch.int32),
        "src_to_dst": lambda dtype: torch.empty(12, dtype=torch.int32),
        "h": lambda dtype: torch.empty(12, 16, dtype=dtype),
        "swiglu_limit": 1.75,
        "swiglu_min": -1.75,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.mul.Tensor,),
    explain=explain,
    differentiable=("x_g", "w_gate_up", "w_down", "weights"),
    verify_input=lambda name, args: _verification_input(name, args),
)


def _verification_input(name, args):
    """A row map that is a permutation and offsets that are cumulative row ends (random data is neither)."""
    if name in ("row_idx", "src_to_dst"):
        generator = torch.Generator().manual_seed(0)
        return torch.randperm(int(args[name].numel()), generator=generator).to(args[name].dtype)
    if name == "offsets":
        rows, groups = int(args["x_g"].shape[0]), int(args["offsets"].shape[0])
        return torch.tensor([(e + 1) * rows // groups for e in range(groups)], dtype=args["offsets"].dtype)
    return None
