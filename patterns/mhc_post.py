"""mhc_post: DeepSeek-V4's residual mix -> npu_mhc_post / cann_ops_transformer.mhc_post.

transformers' DeepseekV4DecoderLayer (modeling_deepseek_v4.py L1190-1200) mixes the block
output o (B, S, D) back into the n residual streams X (B, S, n, D) with mhc_pre's post and comb:

    X = post.to(dtype).unsqueeze(-1) * o.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), X)

i.e. Y[k] = post[k] * o + sum_j comb[j, k] * X[j]: the ops' `(H^res)^T x + h_out (x) H^post`
with the same transpose (npu_ops/mhc.py; the mix-up test in tests/test_npu_ops_mhc.py). Per
SoC (capabilities.py): npu_mhc_post (torch_npu, 950), else cann_ops_transformer.mhc_post
(A2 / A3; its 950 row is a decision from the kernel sources, see there).

Precision: transformers rounds post and comb to the streams' dtype and mixes in that dtype
(a bf16 bmm); the ops take them in fp32 and round once. In bf16 the fused result is the more
exact one, a few bf16 ulps from the model's; in fp32 they agree to rounding.

Training: npu_mhc_post differentiates at the dispatcher (NpuMhcPostBackward0); the COT op by
the extension's Python MhcPostFunction, mirrored by MhcPost below (mhc_post_backward).
"""
import torch

from npu_fx_fusion.capabilities import CAPABILITIES, only_on, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
NPU_POST = CAPABILITIES["npu.npu_mhc_post"]
COT_POST = CAPABILITIES["cann_ops_transformer.mhc_post"]


# ---- the unfused form ----------------------------------------------------------------------
def deepseek_v4_residual_mix(hidden_states, block_output, post, comb):
    dtype = hidden_states.dtype
    return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), hidden_states)


# ---- the fused calls -----------------------------------------------------------------------
class MhcPost(torch.autograd.Function):
    """The extension's MhcPostFunction (COT ops/mhc_post.py): mhc_post forward, mhc_post_backward
    backward (capabilities.py: the op's autograd_rule)."""

    @staticmethod
    def forward(ctx, x, h_res, h_out, h_post):
        ctx.save_for_backward(x, h_res, h_out, h_post)
        return torch.ops.cann_ops_transformer.mhc_post(x, h_res, h_out, h_post)

    @staticmethod
    def backward(ctx, grad):
        x, h_res, h_out, h_post = ctx.saved_tensors
        return torch.ops.cann_ops_transformer.mhc_post_backward(grad.contiguous(), x, h_res, h_out, h_post)


def npu_mhc_post(hidden_states, block_output, post, comb):
    return torch.ops.npu.npu_mhc_post(hidden_states, comb.float(), block_output, post.float())


def mhc_post(hidden_states, block_output, post, comb):
    return MhcPost.apply(hidden_states, comb.float(), block_output, post.float())


FORMS = [
    Form(deepseek_v4_residual_mix, npu_mhc_post, fused_op="npu.npu_mhc_post"),
    Form(deepseek_v4_residual_mix, mhc_post, fused_op="cann_ops_transformer.mhc_post"),
]


# ---- checks -------------------------------------------------------------------------------
def check(site):
    x, o, post, comb = site["hidden_states"], site["block_output"], site["post"], site["comb"]
    if x.dim() != 4:
        return f"residual streams of {x.dim()} dims, not (B, S, n, D)"
    b, s, n, d = x.shape
    if tuple(o.shape) != (b, s, d) or tuple(post.shape) != (b, s, n) or tuple(comb.shape) != (b, s, n, n):
        return (f"block output {list(o.shape)}, post {list(post.shape)}, comb {list(comb.shape)} do not "
                f"mix {n} streams of {list(x.shape)}")
    if o.dtype != x.dtype:
        return f"block output {str(o.dtype)[6:]} and streams {str(x.dtype)[6:]}: the ops take one dtype"
    if not post.dtype.is_floating_point or not comb.dtype.is_floating_point:
        return "post / comb are not floating point"
    cap = NPU_POST if site.form.fused_op == "npu.npu_mhc_post" else COT_POST
    return site.hardware_limits([
        unsupported(cap.op, site.soc, x=x) or (only_on(cap.op) if site.soc is None and cap is NPU_POST else None),
        f"{n} streams: {cap.op} takes n in {cap.limits['streams']}" if n not in cap.limits["streams"] else None,
    ])


# ---- near misses: a streams mix no form consumed ----------------------------------------------
def _transposed_bmm_operand(node):
    while is_call(node, aten.view.default, aten.expand.default, aten._unsafe_view.default, aten.clone.default):
        node = node.args[0]
    return node


def _streams_mix(operand, out):
    """How `operand` of the add mixes the n streams of `out` (..., n, D), or None: "matmul" for
    a bmm over (n, n) matrices of a transposed comb (an aten.matmul in an NPU graph, which
    keeps it unsplit: npu_dispatch.py), "summed product" for comb and X broadcast against
    each other and summed over the streams (torchtitan-npu's HcPost: `torch.sum(comb.unsqueeze(-1)
    * X.unsqueeze(-2), dim=2)`)."""
    mixed = operand.args[0] if is_call(operand, aten.view.default) else operand
    if is_call(mixed, aten.bmm.default, aten.matmul.default):
        left = _transposed_bmm_operand(mixed.args[0])
        meta = tensor_meta(left)
        if is_call(left, aten.transpose.int) and meta is not None and meta.shape[-1] == meta.shape[-2] \
                == out.shape[-2]:
            return "matmul"
    if is_call(mixed, aten.sum.dim_IntList) and is_call(mixed.args[0], aten.mul.Tensor):
        product = tensor_meta(mixed.args[0])
        dims = [d % product.dim() for d in mixed.args[1]] if product is not None else []
        # (..., n, n, D) summed over the first n: one dim, the third from the end
        if product is not None and product.dim() == out.dim() + 1 and dims == [product.dim() - 3] \
                and product.shape[-2] == product.shape[-3] == out.shape[-2]:
            return "summed product"
    return None


def anchor(node):
    """`post * o + comb^T @ X` candidates: an add of a 4-d value one of whose operands mixes its
    streams (_streams_mix)."""
    if not is_call(node, aten.add.Tensor) or len(node.args) < 2:
        return False
    out = tensor_meta(node)
    if out is None or out.dim() != 4:
        return False
    return any(isinstance(operand, torch.fx.Node) and _streams_mix(operand, out) for operand in node.args[:2])


def explain(node):
    out = tensor_meta(node)
    spellings = {_streams_mix(operand, out) for operand in node.args[:2] if isinstance(operand, torch.fx.Node)}
    how = ("comb and X broadcast against each other and summed over the streams"
           if "summed product" in spellings else "comb^T @ X")
    return (f"a residual mix of n streams (a broadcast product plus {how}) in a form other than "
            "transformers' DeepseekV4DecoderLayer `post.to(dtype).unsqueeze(-1) * o.unsqueeze(-2) + "
            "torch.matmul(comb.to(dtype).transpose(-1, -2), X)`, the one spelling this pass matches")


def _f32(*shape):
    return lambda dtype: torch.empty(*shape, dtype=torch.float32)  # mhc_pre's outputs are fp32


PASS = FusionPass(
    name="mhc_post",
    fused_op="npu.npu_mhc_post",
    forms=FORMS,
    example={
        "hidden_states": lambda dtype: torch.empty(2, 3, 4, 8, dtype=dtype),
        "block_output": lambda dtype: torch.empty(2, 3, 8, dtype=dtype),
        "post": _f32(2, 3, 4),
        "comb": _f32(2, 3, 4, 4),
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.add.Tensor,),
    explain=explain,
    # its 150 joint patterns start from an add, which every graph has: a graph with no
    # candidate mix (every one but DeepSeek-V4's) is not matched at all
    prefilter=lambda graph: any(anchor(node) for node in graph.nodes),
    differentiable=("hidden_states", "block_output", "post", "comb"),
)
