"""grouped_matmul: the MoE expert GEMM over tokens sorted by expert -> npu_grouped_matmul.

    out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]      (offs: cumulative row ends)

is `torch._grouped_mm(x, w, offs)` (transformers' grouped_mm experts in bf16, torchtitan's
GroupedExperts) and `torch.ops.transformers.grouped_mm_fallback(x, w, offs)` (the same
in transformers where _grouped_mm does not apply, e.g. fp32). It becomes

    npu_grouped_matmul([x], [w], group_list=offs.long(), split_item=3, group_type=0,
                       group_list_type=0)[0]

with every choice explicit (op_semantics.md 7): one 2-D x split along M (group_type 0),
one 3-D weight, a single output tensor (split_item 3), and the group list as the
cumulative ends `offs` already are (group_list_type 0; int64, as the op wants). Rows past
the last offset are unspecified in all three (the routed tokens always fill x).
The op has no autograd in torch_npu: inference graphs only (a training graph keeps the
unfused GEMMs).
"""
import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, tensor_meta

aten = torch.ops.aten
GROUPED_MATMUL = CAPABILITIES["npu.npu_grouped_matmul"]


# ---- the unfused forms --------------------------------------------------------------------
def aten_grouped_mm(x, w, offs):
    return torch._grouped_mm(x, w, offs)


def transformers_grouped_mm_fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


# ---- the fused call -----------------------------------------------------------------------
def npu_grouped_matmul(x, w, offs):
    return torch.ops.npu.npu_grouped_matmul(
        [x.contiguous()], [w], group_list=offs.to(torch.int64), split_item=3, group_type=0,
        group_list_type=0)[0]


ATEN_FORM = Form(aten_grouped_mm, npu_grouped_matmul, dtypes=(torch.bfloat16,))  # _grouped_mm: bf16 only
FALLBACK_FORM = Form(transformers_grouped_mm_fallback, npu_grouped_matmul, dtypes=(torch.float32,))


def forms():
    """The fallback form exists once transformers is imported (asked at every apply)."""
    return [ATEN_FORM] + ([FALLBACK_FORM] if interop.transformers_grouped_mm_fallback() is not None else [])


# ---- checks -------------------------------------------------------------------------------
def _weight_layout_reason(w):
    """None if w is a contiguous (E, K, N) tensor or a transposed view of an (E, N, K) one."""
    e, k, n = w.shape
    if w.is_contiguous() or tuple(w.stride()) == (k * n, 1, k):
        return None
    return (f"weight strides {tuple(w.stride())} are neither an (E, K, N) tensor nor a transposed "
            "(E, N, K) one, the two layouts npu_grouped_matmul reads")


def check(site):
    x, w, offs = site["x"], site["w"], site["offs"]
    reason = unsupported("npu.npu_grouped_matmul", site.soc, x=x)
    if reason:
        return reason
    if w.dim() != 3 or offs.dim() != 1:
        return f"needs a 3-d weight and 1-d offsets, got {w.dim()}-d and {offs.dim()}-d"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from x's {x.dtype}"
    if offs.dtype not in (torch.int32, torch.int64):
        return f"offsets are {offs.dtype}, not an integer list"
    if offs.shape[0] != w.shape[0]:
        return f"{offs.shape[0]} offsets for {w.shape[0]} experts"
    return gemm_limits_reason(site.soc, x, *w.shape) or _weight_layout_reason(w)


def gemm_limits_reason(soc, x, experts, k, n):
    """The first limit an expert GEMM of x (M, k) by (experts, k, n) weights breaks, or None.

    Also used by moe_dispatch, which emits these GEMMs itself on transformers' batched_mm path.
    """
    reason = unsupported("npu.npu_grouped_matmul", soc, x=x)
    if reason:
        return reason
    if experts > GROUPED_MATMUL.limits["max_groups_single_weight"]:
        return f"{experts} experts: npu_grouped_matmul takes at most {GROUPED_MATMUL.limits['max_groups_single_weight']}"
    inner = GROUPED_MATMUL.limits["max_inner_dim"]
    if k >= inner or n >= inner:
        return f"K = {k} or N = {n} is not below npu_grouped_matmul's {inner}"
    if soc == "Ascend310P" and n % GROUPED_MATMUL.limits["310p_n_multiple"]:
        return f"on Ascend310P N must be a multiple of 16, got {n}"
    return None


# ---- near misses: a grouped GEMM left unfused ---------------------------------------------
def anchor(node):
    fallback = interop.transformers_grouped_mm_fallback()
    return is_call(node, aten._grouped_mm.default) or (fallback is not None and node.target is fallback)


def explain(node):
    x = tensor_meta(node.args[0])
    if x is not None and x.dim() != 2:
        return f"x is {x.dim()}-d: only the 2-d (tokens, hidden) x of the MoE expert GEMM is fused"
    if len(node.args) < 3 or node.args[2] is None:
        return "no offsets: a batched (3-d x 3-d) grouped GEMM, not the MoE expert GEMM"
    extra = set(node.kwargs) - {"offs"}
    if extra or len(node.args) > 3:
        return f"carries arguments the fused call does not compute (bias / out_dtype: {sorted(extra)})"
    return None


PASS = FusionPass(
    name="grouped_matmul",
    fused_op="npu.npu_grouped_matmul",
    forms=forms,
    example={
        # _grouped_mm's meta function wants 16-byte aligned strides: sizes multiple of 8
        "x": lambda dtype: torch.empty(24, 16, dtype=dtype),
        "w": lambda dtype: torch.empty(3, 16, 8, dtype=dtype),
        "offs": lambda dtype: torch.empty(3, dtype=torch.int32),
    },
    check=check,
    anchor=anchor,
    explain=explain,
    verify_input=lambda name, args: _even_offsets(args) if name == "offs" else None,
)


def _even_offsets(args):
    """Verification input for offs: cumulative row ends spreading x's rows over the experts
    (random integers would not be a valid group list)."""
    rows, groups = int(args["x"].shape[0]), int(args["offs"].shape[0])
    return torch.tensor([(e + 1) * rows // groups for e in range(groups)], dtype=args["offs"].dtype)
