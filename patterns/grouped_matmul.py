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

Training. torch_npu defines no autograd for npu_grouped_matmul (op_semantics 7), so the
fused call goes through our own rule, `GroupedMatmul` below, built from the op itself the
way MindSpeed differentiates it:

    dx = npu_grouped_matmul([dy], [w^T], group_type=0)       the same M groups (tokens)
    dw = npu_grouped_matmul([x^T], [dy], group_type=2)       K groups: each expert's tokens

(group_type 2 splits the K axis of x^T (H, tokens) and dy (tokens, N) by the same offsets:
dw[e] = x_e^T @ dy_e, zeros for an expert without tokens). aten._grouped_mm's own
derivative is the same two products (`_grouped_mm(dy, w^T, offs)`; `_grouped_mm(x^T, dy,
offs)`, or `_grouped_mm(dy^T, x, offs)^T` for a w that is a transposed view, hence the
example variant), so the joint pattern of the aten form (traced with `joint_fwd_bwd`)
covers the forward GEMM and both backward GEMMs, and the replacement puts the rule's
three calls in their place. capabilities.py names the rule (`autograd_rule`), which is what lets the op
into training graphs (`has_backward`). On an NPU the same rule runs: it needs nothing
from torch_npu but the op.
"""
import torch

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, plain_cast, tensor_meta

aten = torch.ops.aten
GROUPED_MATMUL = CAPABILITIES["npu.npu_grouped_matmul"]


# ---- the unfused forms --------------------------------------------------------------------
def aten_grouped_mm(x, w, offs):
    return torch._grouped_mm(x, w, offs)


def transformers_grouped_mm_fallback(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


# ---- the fused call and its autograd rule --------------------------------------------------
def _m_split(x, w, group_list):
    """x (M, K) rows in groups (cumulative ends group_list) times w (E, K, N) -> (M, N)."""
    return torch.ops.npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3, group_type=0,
                                            group_list_type=0)[0]


class GroupedMatmul(torch.autograd.Function):
    """npu_grouped_matmul's M-split expert GEMM with a backward made of npu_grouped_matmul
    calls (torch_npu has none: capabilities.py records this class as the op's autograd_rule).

    forward(x (M, K), w (E, K, N), group_list (E,) int64 cumulative ends) -> (M, N)
    backward: dx = the M-split of dy by w^T (E, N, K), the same groups; rows past the last
    end get no group (unspecified, as the forward's); dw = the K-split of x^T (K, M) and dy
    (M, N) over the same ends -> (E, K, N), x^T passed as the transposed view the kernel
    requires for group_type 2, dy as a contiguous (M, N) weight (not transposed). For a w
    stored (E, N, K) (nn.Linear layout, passed transposed) dw^T = K-split of dy^T and x is
    computed instead, in w's own layout, as aten's derivative does.
    """

    @staticmethod
    def forward(ctx, x, w, group_list):
        x = x.contiguous()  # the kernel does not take a transposed x for group_type 0
        ctx.save_for_backward(x, w, group_list)
        return _m_split(x, w, group_list)

    @staticmethod
    def backward(ctx, dy):
        x, w, group_list = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _m_split(dy, w.transpose(-2, -1), group_list) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if _stored_transposed(w):  # nn.Linear-style (E, N, K) storage: dw^T in that layout
                dw = _k_split(dy, x, group_list).transpose(-2, -1)
            else:
                dw = _k_split(x, dy, group_list)
        return dx, dw, None


def _k_split(a, b, group_list):
    """(a^T b) per group of rows of a (M, P) and b (M, Q) -> (E, P, Q): npu_grouped_matmul's
    K-split, a^T passed as the transposed view it requires, b as the untransposed weight."""
    return torch.ops.npu.npu_grouped_matmul([a.t()], [b], group_list=group_list, split_item=3,
                                            group_type=2, group_list_type=0)[0]


def _stored_transposed(w):
    """w (E, K, N) is a transposed view of (E, N, K) storage (not also contiguous)."""
    return not w.is_contiguous() and w.transpose(-2, -1).is_contiguous()


def npu_grouped_matmul(x, w, offs):
    return GroupedMatmul.apply(x, w, offs.to(torch.int64))


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
    if w.dim() == 2 and x.dim() == 2 and offs.dim() == 1:
        return ("a 2-d weight with offsets: the K-grouped product of a weight gradient (x^T dy per "
                "expert), which fuses only with its forward GEMM on the joint graph (as "
                "npu_grouped_matmul group_type 2), not on its own")
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


# ---- after the sites are fused: the group list as the counts it was summed from ------------
def counts_for_running_sums(graph, options=None):
    """group_list_type 1 (counts) where a fused call's cumulative ends are the model's running
    sum of per-expert counts, read through integer casts: the op sums the counts itself.

    transformers sums its int64 counts into int32 offsets (`cumsum(tokens_per_expert,
    dtype=torch.int32)`), and the replacement widens them back to the int64 the op takes:
    a cumsum and two casts, launched once per MoE layer, that the counts make unneeded. The
    values are the same wherever the model's offsets are what they mean, row ends of x held
    in its integer type (torch's _grouped_mm takes int32 offsets): then no cast on the way
    changed one. Returns a note per call that now reads counts (exact, and the same op: nothing
    in `options` stops it)."""
    changed = []
    for call in graph.find_nodes(op="call_function", target=torch.ops.npu.npu_grouped_matmul.default):
        if call.kwargs.get("group_list_type", 0) != 0:
            continue
        chain = _summed_counts(call.kwargs.get("group_list"))
        if chain is None:
            continue
        counts = chain[-1].args[0]
        if tensor_meta(counts).dtype != torch.int64:
            with graph.inserting_before(call):
                widened = graph.call_function(aten._to_copy.default, (counts,), {"dtype": torch.int64})
            widened.meta["val"] = tensor_meta(counts).to(torch.int64)
            counts = widened
        call.update_kwarg("group_list", counts)
        call.update_kwarg("group_list_type", 1)
        changed.append(f"{call.name}: reads the per-expert counts (group_list_type 1), not their running sum")
        for node in chain:  # the casts and the cumsum, where no other call reads them
            if not node.users:
                graph.erase_node(node)
    return changed


def _summed_counts(group_list):
    """[the casts..., cumsum(c)] where group_list is the running sum of a 1-d integer c read
    through integer casts (in the order they are read back from group_list); else None."""
    chain, node = [], group_list
    while plain_cast(node) and _integer(node.kwargs["dtype"]):
        chain.append(node)
        node = node.args[0]
    if not (is_call(node, aten.cumsum.default) and len(node.args) == 2 and node.args[1] in (0, -1)
            and _integer(node.kwargs.get("dtype", torch.int64))):
        return None
    counts = tensor_meta(node.args[0])
    if counts is None or counts.dim() != 1 or not _integer(counts.dtype):
        return None
    return [*chain, node]


def _integer(dtype):
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


# ---- near misses: a grouped GEMM left unfused ---------------------------------------------
# Experts may also run one by one: a matmul per expert with weight w[e] on its rows, in a
# Python loop over torch.split(x, counts) (torchtitan's GroupedExperts with
# use_grouped_mm=False, litgpt / Mixtral-style loops). The counts are read on the host for
# the split (a graph break), so the graph holds E separate GEMMs, each specialised on its
# row count. One near miss per expert weight, at its first expert's matmul.
_MATMULS = (aten.matmul.default, aten.mm.default)
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)


def _expert_weight(operand):
    """(w, e) where `operand` is expert e of a stacked (E, ., .) weight w, maybe transposed."""
    node = operand
    while is_call(node, *_TRANSPOSES):
        node = node.args[0]
    if not (is_call(node, aten.select.int) and isinstance(node.args[2], int)):
        return None
    weight = tensor_meta(node.args[0])
    if weight is None or weight.dim() != 3 or node.args[1] % 3 != 0:  # dim 0, or -3
        return None
    return node.args[0], node.args[2]


def _per_expert_matmuls(node):
    """The matmuls that read one expert each of the weight node's first expert reads, if node is
    one of expert 0 and experts of the same weight feed other matmuls; else None."""
    if not is_call(node, *_MATMULS) or len(node.args) < 2:
        return None
    found = _expert_weight(node.args[1])
    if found is None or found[1] != 0:
        return None
    weight = found[0]
    experts = {user.args[2] for user in weight.users
               if _expert_weight(user) is not None and any(is_call(reader, *_MATMULS, *_TRANSPOSES)
                                                           for reader in user.users)}
    return experts if len(experts) > 1 else None


def anchor(node):
    fallback = interop.transformers_grouped_mm_fallback()
    return (is_call(node, aten._grouped_mm.default) or (fallback is not None and node.target is fallback)
            or _per_expert_matmuls(node) is not None)


def explain(node):
    experts = _per_expert_matmuls(node)
    if experts is not None:
        weight = tensor_meta(_expert_weight(node.args[1])[0])
        return (f"{len(experts)} experts of a {tuple(weight.shape)} weight run one by one, a matmul per expert on "
                "its rows (a loop over torch.split(x, counts), which reads the counts on the host: a graph "
                "break): npu_grouped_matmul takes the experts as one grouped GEMM with the counts as a device "
                "tensor. Write them as one (torchtitan: GroupedExperts(use_grouped_mm=True); torch._grouped_mm)")
    x = tensor_meta(node.args[0])
    if x is not None and x.dim() != 2:
        return f"x is {x.dim()}-d: only the 2-d (tokens, hidden) x of the MoE expert GEMM is fused"
    if len(node.args) < 3 or node.args[2] is None:
        return "no offsets: a batched (3-d x 3-d) grouped GEMM, not the MoE expert GEMM"
    given = {**dict(zip(("bias", "out_dtype"), node.args[3:])), **node.kwargs}
    extra = sorted(name for name, value in given.items() if name != "offs" and value is not None)
    if extra:
        return f"carries arguments the fused call does not compute: {', '.join(extra)}"
    return None


PASS = FusionPass(
    name="grouped_matmul",
    # moe_dispatch matches whole expert blocks, their grouped GEMMs included
    # swiglu_group (DeepSeek-V4's clamped SwiGLU) matches the grouped GEMMs around it unfused
    # quant_grouped_matmul takes a GEMM over dequantized int8 experts with its dequantization
    after=("moe_dispatch", "swiglu_group", "quant_grouped_matmul"),
    fused_op="npu.npu_grouped_matmul",
    forms=forms,
    # training: x and w carry gradients (through GroupedMatmul); offs is an index
    differentiable=("x", "w"),
    example={
        # _grouped_mm's meta function wants 16-byte aligned strides: sizes multiple of 8
        "x": lambda dtype: torch.empty(24, 16, dtype=dtype),
        "w": lambda dtype: torch.empty(3, 16, 8, dtype=dtype),
        "offs": lambda dtype: torch.empty(3, dtype=torch.int32),
    },
    # aten._grouped_mm's weight gradient depends on the weight's strides: a transposed view of
    # (E, N, K) storage (torchtitan's and transformers' experts) gets it as (dy^T x)^T, an
    # (E, K, N) tensor as x^T dy; the joint patterns need both traces
    example_variants=[{"w": lambda dtype: torch.empty(3, 8, 16, dtype=dtype).transpose(-2, -1)}],
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (aten._grouped_mm.default, interop.transformers_grouped_mm_fallback(), *_MATMULS),
    explain=explain,
    verify_input=lambda name, args: even_offsets(args) if name == "offs" else None,
    finish=counts_for_running_sums,
)


def even_offsets(args):
    """Verification input for offs: cumulative row ends spreading the rows of x (or of the int8
    activation q, quant_grouped_matmul's) over the experts (random integers would not be a
    valid group list)."""
    rows, groups = int(args["x" if "x" in args else "q"].shape[0]), int(args["offs"].shape[0])
    return torch.tensor([(e + 1) * rows // groups for e in range(groups)], dtype=args["offs"].dtype)
