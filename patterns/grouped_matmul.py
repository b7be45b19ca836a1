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
import itertools
import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npu_fx_fusion import interop
from npu_fx_fusion.capabilities import CAPABILITIES, unsupported

from npu_fx_fusion.matching import (Form, FusionPass, Recognized, hashable, is_backward, is_call, is_cast,
                                    known_equal, plain_cast, tensor_meta, with_arguments)

aten = torch.ops.aten
Node = torch.fx.Node
GROUPED_MATMUL = CAPABILITIES["npu.npu_grouped_matmul"]
BIAS_DTYPES = GROUPED_MATMUL.limits["bias_dtype_for_x"]


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
    """None if w is a contiguous (E, K, N) tensor or a transposed view of an (E, N, K) one (or
    an expert's own (K, N) weight, one of a weight list, likewise)."""
    k, n = w.shape[-2:]
    if w.is_contiguous() or tuple(w.stride()) == (k * n,) * (w.dim() - 2) + (1, k):
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


# ---- experts run one by one: the loop rolled into one grouped GEMM per weight ----------------
# Experts may also run one by one: a matmul per expert with weight w[e] on its rows, in a
# Python loop over torch.split(x, counts) (torchtitan's GroupedExperts with
# use_grouped_mm=False, which is what runs where its Triton padding kernel does not). The
# counts are read on the host for the split (a graph break), so the graph after it holds E
# GEMMs per weight, each on its chunk of rows, with the counts as sizes (constants, or
# symbolic with dynamic shapes). That is the grouped GEMM with those sizes as its groups:
#
#     chunk_e(A) @ w[e]  for e < E   ==   chunk_e(npu_grouped_matmul([A], [w], sizes))
#
# `recognize` rolls each weight's E matmuls into one call. A's chunks may come from one
# split directly, or be computed row by row from chunks split the same way (the gated
# activation between w1 / w3 and w2: silu(chunk_e(Y)) * chunk_e(Z) is chunk_e(silu(Y) * Z)),
# the weight through transposes and casts (autocast's bf16 copy of w[e] is a slice of w's).
# The same ops on whole tensors compute every row as each chunk did; only the GEMM changes.
_MATMULS = (aten.matmul.default, aten.mm.default)
_TRANSPOSES = (aten.t.default, aten.transpose.int, aten.permute.default)


def _rows_of(matmul):
    """The left operand of a GEMM (mm / matmul (a, w), or addmm (bias, a, w))."""
    return matmul.args[1] if is_call(matmul, aten.addmm.default) else matmul.args[0]


def _weight_of(matmul):
    return matmul.args[2] if is_call(matmul, aten.addmm.default) else matmul.args[1]


def _bias_of(matmul):
    return matmul.args[0] if is_call(matmul, aten.addmm.default) else None


def _expert_weight(operand):
    """(w, e, chain) where `operand` is expert e of a stacked (E, ., .) weight w read through
    transposes and casts (`chain`, from w[e] up to operand); else None."""
    chain, node = [], operand
    while is_call(node, *_TRANSPOSES) or is_cast(node):
        chain.append(node)
        node = node.args[0]
    if not (is_call(node, aten.select.int) and isinstance(node.args[2], int)):
        return None
    weight = tensor_meta(node.args[0])
    if weight is None or weight.dim() != 3 or node.args[1] % 3 != 0:  # dim 0, or -3
        return None
    return node.args[0], node.args[2], [node, *reversed(chain)]


def _expert_matmuls(weight, joint):
    """{e: the forward matmul reading expert e of `weight` as its right operand}, if each
    expert has exactly one; else None."""
    found = {}
    for select in weight.users:
        for matmul in _readers_through_chain(select):
            if joint and is_backward(matmul):
                continue
            e = select.args[2]
            if e in found:
                return None
            found[e] = matmul
    return found or None


def _readers_through_chain(select):
    """The matmuls whose right operand is `select` read through transposes and casts."""
    readers, frontier = [], [select]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (is_call(user, *_TRANSPOSES) or is_cast(user)) and user.args[0] is node:
                frontier.append(user)
            elif is_call(user, *_MATMULS) and len(user.args) == 2 and user.args[1] is node:
                readers.append(user)
    return readers


def _per_expert_matmuls(node):
    """The experts of the weight whose expert 0 `node` multiplies by, when other experts of it
    feed matmuls too (an anchor: recognize() says why a loop it does not roll is not one)."""
    if not is_call(node, *_MATMULS) or len(node.args) < 2:
        return None
    found = _expert_weight(node.args[1])
    if found is None or found[1] != 0:
        return None
    experts = {select.args[2] for select in found[0].users if _expert_weight(select) is not None
               and _readers_through_chain(select)}
    return experts if len(experts) > 1 else None


def _weight_replayed(chain):
    """replay(w) -> w's experts read as `chain` reads expert e: the same transposes (each of a
    2-d slice swaps its two dims) and casts, on the whole (E, ., .) weight."""
    def replay(w):
        for node in chain[1:]:
            if is_cast(node):
                w = node.target(w, *node.args[1:], **node.kwargs)
            elif not (is_call(node, aten.permute.default) and list(node.args[1]) in ([0, 1], [-2, -1])):
                w = w.transpose(-2, -1)
        return w
    return replay


class _NotRolled(Exception):
    """The E operands are not one computation on chunks of whole tensors (the reason)."""


class _Rolled:
    """E per-expert operands as one computation on whole tensors split by the same sizes.

    `template` reads as: ("chunks", x) for the chunks of x's rows; ("shared", node) for a
    value every expert reads whole (no row dim); ("constant", value); ("op", node, [templates
    of its args], [its E nodes]) for one pointwise op or cast applied to each expert's values
    alike (`node`: expert 0's; `ops` maps it to that template)."""

    def __init__(self, operands):
        self.bounds = self.ends = None
        self.leaves, self.shared, self.ops = [], [], {}
        self.template = self._roll(list(operands))

    def _roll(self, nodes):
        """nodes: the E experts' values (None: an expert without rows, see below)."""
        live = [n for n in nodes if n is not None]
        first = live[0]
        if all(n is first for n in live) and (len(live) > 1 or not _has_rows(first)):
            if _has_rows(first):
                raise _NotRolled(f"{first.name}, read by every expert, has rows of its own")
            self.shared.append(first)
            return ("shared", first)
        if all(is_call(n, operator.getitem) and n.args[0] is first.args[0] for n in live):
            return self._chunks(nodes)
        sliced = [n for n in live if is_call(n, aten.slice.Tensor) and _splits_rows(n)]
        if sliced and all(n in sliced or n is sliced[0].args[0] for n in live):
            return self._slices(nodes)
        if not all(isinstance(n, Node) and n.op == "call_function" and n.target is first.target for n in live):
            # an expert without rows (a count of 0 in a static trace) computes nothing, so what
            # its code spells does not matter (the swiglu pass fuses every activation but its
            # empty one): it is None from here on
            nodes = [None if n is None or _without_rows(n) else n for n in nodes]
            live = [n for n in nodes if n is not None]
            first = live[0] if live else first
            if not live or not all(isinstance(n, Node) and n.op == "call_function" and n.target is first.target
                                   for n in live):
                raise _NotRolled(f"the experts' {first.name} are not one op on each expert's rows")
        if not _row_wise(first):
            raise _NotRolled(f"{first.name} ({first.target}) is not an op of each row alone")
        args = []
        for position, arg in enumerate(first.args):
            column = [None if n is None else n.args[position] for n in nodes]
            if isinstance(arg, Node):
                if not all(isinstance(a, Node) for a in column if a is not None):
                    raise _NotRolled(f"the experts' {first.name} differ in argument {position}")
                args.append(self._roll(column))
            elif any(hashable(n.args[position]) != hashable(arg) for n in live):
                raise _NotRolled(f"the experts' {first.name} differ in argument {position}")
            else:
                args.append(("constant", arg))
        if any(hashable(n.kwargs) != hashable(first.kwargs) for n in live):
            raise _NotRolled(f"the experts' {first.name} differ in their keyword arguments")
        self.ops[first] = ("op", first, args, nodes)
        return self.ops[first]

    def _chunks(self, nodes):
        """nodes: the getitems of one split (None: an expert without rows)."""
        live = [(e, n) for e, n in enumerate(nodes) if n is not None]
        split = live[0][1].args[0]
        if not (is_call(split, aten.split_with_sizes.default, aten.split.Tensor)
                and all(n.args[0] is split and n.args[1] == e for e, n in live)):
            raise _NotRolled("the experts' rows are not the chunks of one split, in order")
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if is_call(split, aten.split_with_sizes.default):
            sizes = list(split.args[1])
        else:  # equal chunks (the last may be shorter): static sizes only
            size = split.args[1]
            rows = tensor_meta(split.args[0]).shape[0]
            if not (isinstance(size, int) and isinstance(rows, int)):
                raise _NotRolled("the rows are split in chunks of a symbolic size")
            sizes = [min(size, rows - start) for start in range(0, rows, size)]
        meta = tensor_meta(split.args[0])
        if len(sizes) != len(nodes) or meta is None or meta.dim() != 2 or dim not in (0, -2):
            raise _NotRolled(f"the split is not of a 2-d (tokens, hidden) tensor's rows into {len(nodes)} chunks")
        return self._leaf(split.args[0], ("sizes", sizes), list(itertools.accumulate(_value(s) for s in sizes)))

    def _slices(self, nodes):
        """Consecutive row slices: how canonical.py leaves a split of static sizes, or rows
        sliced by a running offset (`x[start:start + n]`)."""
        live = [n for n in nodes if n is not None]
        source = next(n.args[0] for n in live if is_call(n, aten.slice.Tensor))
        meta = tensor_meta(source)
        if (meta is None or meta.dim() != 2 or any(n is not source and (n.args[0] is not source or n.args[1] not in
                                                                          (0, -2) or len(n.args) != 4 or n.kwargs)
                                                   for n in live)):
            raise _NotRolled("the experts' rows are not slices of one 2-d (tokens, hidden) tensor")
        # a chunk of all the rows is the tensor itself (aot drops a slice that takes them all:
        # every token routed to one expert); its end, the row count, is static there
        if source in live and not isinstance(meta.shape[0], int):
            raise _NotRolled("a chunk of all the rows, of a symbolic count")
        items, starts = [], []
        for n in nodes:  # an expert without rows starts and ends where the one before it ends
            end_before = items[-1] if items else 0
            items.append(end_before if n is None else meta.shape[0] if n is source else n.args[3])
            starts.append(_value(end_before) if n is None else 0 if n is source else _value(n.args[2]))
        ends = [_value(item) for item in items]
        # in order, each at least empty, and within the rows (no slice clamped): rows past the
        # last one (a static count on a symbolic token count) are left out of the grouped GEMM
        if not (known_equal(starts[0], 0) and all(known_equal(a, b) for a, b in zip(starts[1:], ends))
                and all(statically_known_true(b >= a) for a, b in zip(starts, ends))
                and statically_known_true(ends[-1] <= meta.shape[0])):
            raise _NotRolled("the experts' row slices do not cover the rows in order")
        return self._leaf(source, ("ends", items), ends)

    def _leaf(self, source, bounds, ends):
        """`bounds`: ("sizes" or "ends", the split's items, ints or symbolic-size nodes)."""
        if self.bounds is None:
            self.bounds, self.ends = bounds, ends
        elif len(ends) != len(self.ends) or not all(known_equal(a, b) for a, b in zip(ends, self.ends)):
            raise _NotRolled("the experts' rows come from splits of different sizes")
        self.leaves.append(source)
        return ("chunks", source)

    def evaluate(self, values, node=None):
        """The whole tensor of the operands (or of the op whose expert-0 node is `node`): the
        template run on whole tensors (`values`: leaf node -> value)."""
        memo = {}

        def run(template):
            kind = template[0]
            if kind == "constant":
                return template[1]
            if kind in ("chunks", "shared"):
                return values[template[1]]
            if template[1] not in memo:
                memo[template[1]] = template[1].target(*[run(a) for a in template[2]], **template[1].kwargs)
            return memo[template[1]]
        return run(self.template if node is None else self.ops[node])


def _value(size):
    return size.meta["val"] if isinstance(size, Node) else size


_SPLITS = (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default)


def _split_dim(node):
    """The dim a slice or split of a 2-d tensor cuts, 0 (rows) or 1; None for another node."""
    meta = tensor_meta(node.args[0]) if is_call(node, *_SPLITS) else None
    if meta is None or meta.dim() != 2:
        return None
    dim = node.args[1] if is_call(node, aten.slice.Tensor) else (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    return dim % 2 if isinstance(dim, int) else None


def _has_rows(node):
    meta = tensor_meta(node)
    return meta is not None and meta.dim() >= 2 and not known_equal(meta.shape[-2], 1)


def _without_rows(node):
    meta = tensor_meta(node)
    return meta is not None and meta.dim() >= 1 and known_equal(meta.shape[0], 0)


def _splits_rows(node):
    return _split_dim(node) == 0


def _row_wise(node):
    """An op that computes each row of its result from the same row of its inputs alone, so
    it runs on the whole rows as on each expert's: pointwise ops and casts; slices and splits
    of the columns (a merged gate_up projection's `chunk(2, -1)`) and their pieces; SwiGLU
    over the last dim (npu_swiglu, where the swiglu pass fused an expert's activation)."""
    if is_cast(node) or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return True
    if is_call(node, operator.getitem):
        return _split_dim(node.args[0]) == 1
    if is_call(node, torch.ops.npu.npu_swiglu.default):
        meta = tensor_meta(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        return meta is not None and meta.dim() == 2 and dim % 2 == 1
    return _split_dim(node) == 1


_LOOP = "experts in a loop over split rows"


def _loop_site(weight, joint):
    """The Recognized site of one expert weight's per-expert matmuls, or None (no loop here)."""
    matmuls = _expert_matmuls(weight, joint)
    experts = int(tensor_meta(weight).shape[0])
    if matmuls is None or len(matmuls) < 2:
        return None
    first = matmuls[min(matmuls)]
    shape = tuple(tensor_meta(weight).shape)
    if sorted(matmuls) != list(range(experts)):
        return Recognized(_LOOP, first, [first], reason=(
            f"{len(matmuls)} of the {experts} experts of a {shape} weight run one by one (a matmul per expert "
            "on its rows): not every expert's, so not one grouped GEMM over the weight"))
    ordered = [matmuls[e] for e in range(experts)]
    chains = [_expert_weight(m.args[1])[2] for m in ordered]
    return _rolled_loop(f"a {shape} weight", [weight], ordered, chains, joint)


def _rolled_loop(what, weights, ordered, chains, joint, biases=()):
    """The site of E matmuls, expert e's `ordered[e]` multiplying its rows by what `chains[e]`
    reads (from expert e of one stacked weight, `weights` = [w], or from its own weight,
    `weights` = the E of them): one grouped GEMM, or a near miss saying why not."""
    experts, first = len(ordered), ordered[0]
    if joint:
        return Recognized(_LOOP, first, ordered, reason=(
            f"{experts} experts of {what} run one by one in training: their backward (a GEMM per expert "
            "for each gradient) is not rewritten; the forward graph, after partitioning, is where they can fuse"))
    rows = tensor_meta(_rows_of(ordered[0]))
    if rows is None or rows.dim() != 2:
        return Recognized(_LOOP, first, ordered, reason=(
            f"the experts of {what} multiply {rows.dim() if rows is not None else 'unknown'}-d rows: "
            "npu_grouped_matmul's x is 2-d (tokens, hidden)"))
    if any(len(c) != len(chains[0]) or any(a.target is not b.target for a, b in zip(c[1:], chains[0][1:]))
           for c in chains):
        return Recognized(_LOOP, first, ordered, reason=f"the experts of {what} are read in different ways")
    try:
        rolled = _Rolled([_rows_of(m) for m in ordered])
        if rolled.bounds is None:
            raise _NotRolled("no split of the rows reaches the experts' matmuls")
    except _NotRolled as why:
        return Recognized(_LOOP, first, ordered, reason=(
            f"{experts} experts of {what} run one by one, a matmul per expert on its rows, but {why}: "
            "npu_grouped_matmul takes the experts as one grouped GEMM over one tensor's rows"))
    return _rolled_site(weights, ordered, chains, rolled, biases)


def _rolled_site(weights, matmuls, chains, rolled, biases=()):
    """`weights`: [the stacked (E, ., .) weight], or the E experts' own weights (a weight list),
    with their (N,) `biases` (addmm) if any."""
    cat = _concatenation(matmuls)
    region = set(matmuls) | {n for chain in chains for n in chain if n not in weights}
    region |= {n for *_, nodes in rolled.ops.values() for n in nodes if n is not None}
    # intermediates read outside the site: each is cut from the whole (None: an expert without
    # rows, whose code is left as it was)
    escaping = [(first, nodes) for _, first, _, nodes in rolled.ops.values()
                if any(u not in region for n in nodes if n is not None for u in n.users)]
    if any(not isinstance(tensor_meta(first), torch.Tensor) for first, _ in escaping):
        return Recognized(_LOOP, matmuls[0], matmuls, reason=(
            "a split of each expert's columns has pieces read outside the loop's GEMMs: "
            "not one value per expert to cut from the whole"))
    outputs = ([cat] if cat is not None else list(matmuls)) + [n for _, nodes in escaping for n in nodes if n is not None]
    if cat is not None:
        region.add(cat)
    leaves = rolled.leaves + rolled.shared
    args = {f"a{i}": leaf for i, leaf in enumerate(dict.fromkeys(leaves))}
    args.update({f"w{i}": weight for i, weight in enumerate(weights)})
    args.update({f"c{i}": bias for i, bias in enumerate(biases)})
    kind, items = rolled.bounds
    args.update({f"b{i}": item for i, item in enumerate(items) if isinstance(item, Node)})
    replay = _weight_replayed(chains[0])
    short = [leaf for leaf in dict.fromkeys(rolled.leaves) if not known_equal(rolled.ends[-1], tensor_meta(leaf).shape[0])]

    def replace(values):
        given = [values.get(f"b{i}", item) for i, item in enumerate(items)]
        ends = list(itertools.accumulate(given)) if kind == "sizes" else given
        by_node = {node: values[key] for key, node in args.items() if key.startswith("a")}
        for leaf in short:  # the rows the chunks cover (slices may stop before the last row)
            by_node[leaf] = by_node[leaf][:ends[-1]]
        sizes = given if kind == "sizes" else [b - a for a, b in zip([0, *ends[:-1]], ends)]
        group_list = torch.stack([torch.scalar_tensor(end, dtype=torch.int64) for end in ends])
        x = rolled.evaluate(by_node)
        if len(weights) == 1:
            out = npu_grouped_matmul(x, replay(values["w0"]), group_list)
        else:  # a weight list: inference only (the joint graph's loops are near misses)
            bias = [values[f"c{e}"].to(BIAS_DTYPES[x.dtype]) for e in range(len(biases))] or None
            out = torch.ops.npu.npu_grouped_matmul(
                [x.contiguous()], [replay(values[f"w{e}"]) for e in range(len(weights))], bias=bias,
                group_list=group_list, split_item=3, group_type=0, group_list_type=0)[0]
        results = [out] if cat is not None else list(torch.split(out, sizes))
        for first, nodes in escaping:  # an intermediate read elsewhere too: its chunks of the whole
            pieces = torch.split(rolled.evaluate(by_node, first), sizes)
            results.extend(piece for piece, node in zip(pieces, nodes) if node is not None)
        return results if len(results) > 1 else results[0]

    x_value = tensor_meta(_rows_of(matmuls[0]))  # expert 0's rows: the dtype and width of them all
    if len(weights) == 1:
        w_value = replay(tensor_meta(weights[0]))
    else:  # check() reads the list as the (E, K, N) weight it would stack into
        expert = replay(tensor_meta(weights[0]))
        w_value = x_value.new_empty((len(weights), *expert.shape), dtype=expert.dtype)
    site_args = {"x": x_value, "w": w_value,
                 "offs": torch.empty(len(matmuls), dtype=torch.int64, device=x_value.device)}
    return Recognized(_LOOP, outputs if len(outputs) > 1 else outputs[0], sorted(region), args,
                      with_arguments(args, replace, "npu_grouped_matmul_rolled"), site_args)


def _concatenation(matmuls):
    """The cat of exactly the E results, in expert order along the rows, if it reads them only."""
    users = {u for m in matmuls for u in m.users}
    if len(users) != 1:
        return None
    (cat,) = users
    if not is_call(cat, aten.cat.default) or list(cat.args[0]) != list(matmuls):
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return cat if dim in (0, -2) else None


def recognize(graph, joint):
    """Each stacked expert weight whose experts run one by one, then each GEMM of experts that
    hold their own weights (a generator: a weight's site is found after the ones before it
    were replaced, so w2's operand, computed from w1's and w3's rolled results, rolls too)."""
    first_read = {}  # weight -> the first matmul reading its expert 0
    for select in graph.find_nodes(op="call_function", target=aten.select.int):
        found = _expert_weight(select)
        readers = _readers_through_chain(select) if found is not None and found[1] == 0 else []
        if readers:
            earlier = first_read.get(found[0])
            first_read[found[0]] = min(readers) if earlier is None else min(earlier, *readers)
    # in the order the loop reads them (w1, w3, then w2, whose operand rolls from their results)
    for weight in sorted(first_read, key=first_read.get):
        site = _loop_site(weight, joint)
        if site is not None:
            yield site
    yield from _weight_list_sites(graph, joint)


# ---- experts that hold their own weights (an nn.ModuleList of experts) ----------------------
# The same loop, each expert an nn.Module with its own Linear layers (older transformers MoE
# blocks, hand-written MoE code): expert e's GEMM reads its rows and a weight of its own,
#
#     chunk_e(A) @ W_e  for e < E   ==   chunk_e(npu_grouped_matmul([A], [W_0, ..., W_E-1], sizes))
#
# (group_type 0 takes E (K, N) weights as well as one (E, K, N) tensor, op_semantics 7; at most
# 128 of them), and a Linear's bias (addmm) as the group's bias. A GEMM belongs to expert e
# when its left operand is computed from the e-th chunk of the split rows and no other; the
# j-th GEMM of each expert by a weight of one shape makes one grouped GEMM (w1 / w3 / w2 of
# each expert, in the order its code runs them).
def _own_weight(operand):
    """(w, chain) where `operand` is a 2-d weight of its own read through transposes and casts
    (`chain`: w, then the nodes up to operand); else None. The weight is a graph input or
    attribute, or one op on such inputs alone (in training, merged_projections concatenates an
    expert's gate and up weights in the graph); its sizes are static, as parameters' are
    (dynamo makes inputs' sizes symbolic, not weights')."""
    if _expert_weight(operand) is not None:  # expert e of a stacked weight: _loop_site's
        return None
    chain, node = [], operand
    while is_call(node, *_TRANSPOSES) or is_cast(node):
        chain.append(node)
        node = node.args[0]
    meta = tensor_meta(node)
    if not (isinstance(node, Node) and meta is not None and meta.dim() == 2
            and all(isinstance(size, int) for size in meta.shape)):
        return None
    if not (_is_input(node) or (node.op == "call_function" and node.all_input_nodes
                                and all(_is_input(n) for n in node.all_input_nodes))):
        return None
    return node, [node, *reversed(chain)]


def _is_input(node):
    return node.op in ("placeholder", "get_attr")


def _is_row_chunk(node):
    return (is_call(node, operator.getitem) and _split_dim(node.args[0]) == 0) or (
        is_call(node, aten.slice.Tensor) and _splits_rows(node))


def _split_rows(graph):
    """The chunks of each 2-d tensor whose rows are cut in two or more (a split's getitems, or
    row slices)."""
    chunks = {}
    for node in itertools.chain(graph.find_nodes(op="call_function", target=operator.getitem),
                                graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
        if _is_row_chunk(node):
            chunks.setdefault(node.args[0], set()).add(node)
    return {chunk for pieces in chunks.values() if len(pieces) > 1 for chunk in pieces}


def _row_chunk(node, chunks, budget=48):
    """The one chunk of `chunks` that `node` is computed from, if exactly one (looked for among
    its first `budget` ancestors); else None."""
    seen, frontier, found = set(), [node], set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        if len(seen) == budget:
            return None
        seen.add(current)
        if current in chunks:
            found.add(current)
        else:
            frontier.extend(current.all_input_nodes)
    return next(iter(found)) if len(found) == 1 else None


def _chunk_order(chunk):
    return (0, chunk.args[1]) if is_call(chunk, operator.getitem) else (1, chunk)


def _weight_list_sites(graph, joint):
    chunks = _split_rows(graph)
    if not chunks:
        return
    groups = {}  # (rows split, weight shape, how it is read) -> {chunk: [its GEMMs, in graph order]}
    for matmul in (n for target in (*_MATMULS, aten.addmm.default)
                   for n in graph.find_nodes(op="call_function", target=target)):
        # the forward's GEMMs only, as for a stacked weight (whose backward graph reads the
        # experts' weights as saved tensors of their own): a backward graph's are a near miss
        # of the joint graph's loop
        if len(matmul.args) != (3 if is_call(matmul, aten.addmm.default) else 2) or matmul.kwargs \
                or is_backward(matmul):
            continue
        own = _own_weight(_weight_of(matmul))
        chunk = _row_chunk(_rows_of(matmul), chunks) if own is not None else None
        if chunk is None:
            continue
        weight, chain = own
        key = (chunk.args[0], tuple(tensor_meta(weight).shape), tuple(n.target for n in chain[1:]), matmul.target)
        groups.setdefault(key, {}).setdefault(chunk, []).append(matmul)
    layers = []
    for (_, shape, _, _), by_chunk in groups.items():
        if len(by_chunk) < 2:
            continue
        chunks = sorted(by_chunk, key=_chunk_order)
        if len({len(by_chunk[c]) for c in chunks}) != 1:
            first = min(m for c in chunks for m in by_chunk[c])
            layers.append((first, Recognized(_LOOP, first, [first], reason=(
                f"{len(chunks)} experts' rows are multiplied by {shape} weights of their own, but not as many times "
                "each: not one GEMM per expert to group"))))
            continue
        # the j-th GEMM of each expert, in graph order: a layer of the experts' MLPs
        layers.extend((layer[0], list(layer)) for layer in zip(*(sorted(by_chunk[c]) for c in chunks)))
    for _, layer in sorted(layers, key=lambda item: item[0]):
        site = layer if isinstance(layer, Recognized) else _weight_list_site(layer, joint)
        if site is not None:
            yield site


def _weight_list_site(ordered, joint):
    owned = [_own_weight(_weight_of(m)) for m in ordered]
    weights, chains = [w for w, _ in owned], [c for _, c in owned]
    if len(set(weights)) != len(weights):  # one linear run on chunks of its input: no experts
        return None
    replay = _weight_replayed(chains[0])
    metas = [replay(tensor_meta(w)) for w in weights]
    what = f"{len(weights)} {tuple(metas[0].shape)} weights of their own"
    limit = GROUPED_MATMUL.limits["max_groups_weight_list"]
    x = tensor_meta(_rows_of(ordered[0]))
    biases = [b for b in map(_bias_of, ordered) if b is not None]
    reason = None
    if len(weights) > limit:
        reason = f"{len(weights)} experts: npu_grouped_matmul takes at most {limit} weights in a list"
    elif any(m.dtype != metas[0].dtype for m in metas) or (x is not None and metas[0].dtype != x.dtype):
        reason = "the experts' weights and rows are not all one dtype"
    elif biases and not all(_a_bias(b, metas[0]) for b in biases):
        reason = f"a bias is not one ({metas[0].shape[1]},) value per output column in the rows' dtype"
    else:
        reason = next((why for why in (_weight_layout_reason(m) for m in metas) if why), None)
    if reason is not None:
        return Recognized(_LOOP, ordered[0], ordered, reason=(
            f"{len(weights)} experts run one by one, each with a weight of its own, but {reason}"))
    return _rolled_loop(what, weights, ordered, chains, joint, biases)


def _a_bias(node, weight):
    """An expert's own (N,) bias (a graph input or attribute) in its weight's dtype: the op takes
    it in BIAS_DTYPES[dtype] (an fp32 bias for bf16 rows: widened exactly)."""
    meta = tensor_meta(node)
    return (isinstance(node, Node) and _is_input(node) and meta is not None and meta.dim() == 1
            and meta.shape[0] == weight.shape[1] and meta.dtype == weight.dtype)


# ---- near misses: a grouped GEMM left unfused ---------------------------------------------
def anchor(node):
    fallback = interop.transformers_grouped_mm_fallback()
    return (is_call(node, aten._grouped_mm.default) or (fallback is not None and node.target is fallback)
            or _per_expert_matmuls(node) is not None)


def explain(node):
    experts = _per_expert_matmuls(node)
    if experts is not None:  # recognize() names the reason of every loop it reads; not this one's
        weight = tensor_meta(_expert_weight(node.args[1])[0])
        return (f"{len(experts)} experts of a {tuple(weight.shape)} weight run one by one, but an expert's weight "
                "is read by more than one matmul: not one GEMM per expert to group")
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
    recognize=recognize,
    verify_input=lambda name, args: even_offsets(args) if name == "offs" else None,
    finish=counts_for_running_sums,
)


def even_offsets(args):
    """Verification input for offs: cumulative row ends spreading the rows of x (or of the int8
    activation q, quant_grouped_matmul's) over the experts (random integers would not be a
    valid group list)."""
    rows, groups = int(args["x" if "x" in args else "q"].shape[0]), int(args["offs"].shape[0])
    return torch.tensor([(e + 1) * rows // groups for e in range(groups)], dtype=args["offs"].dtype)
