"""lightning_indexer: DeepSeek-V3.2's token selector -> npu_lightning_indexer.

transformers' DeepseekV32Indexer scores every key for every query and keeps the best
index_topk:

    scores = relu(q.float() @ k.float()^T * scale)                 (B, S, H, T)
    index_scores = weights[:, :, None, :] @ scores                (sum over heads h)
    index_scores = index_scores masked to -inf where the mask hides a key
    indices = index_scores.topk(index_topk).indices.int()

npu_lightning_indexer computes sum_h w_h * relu(q_h . k) with no scale (op_semantics.md
8.1), so the scale goes into the weights: relu(s * x) = s * relu(x) for s > 0. The mask is
not an input of the op: its sparse_mode 3 is the right-down causal mask and 0 none. So the
model's mask must be proven to be one of them: it is evaluated at compile time when it
depends on no graph input (transformers builds it from aranges; constants.sparse_mode_of),
and anything else (padding, a user's mask) is not fused.

Where fewer than index_topk keys are visible (the first queries under a causal mask), the
model's top-k still returns index_topk keys, some of them masked ones (score -inf), which
its attention then masks again; the op returns -1 in those slots instead, and may order
equal scores differently. Only npu_sparse_flash_attention reads such indices the way the
model's attention reads its own (-1 selects nothing, masked keys are masked by its
sparse_mode), so the indexer is fused only where every use of its indices is a fused
sparse attention: sparse_attention runs before this pass.

The scores the op ranks are the model's up to fp32 rounding (the scale is applied to the
weights instead of the products): keys whose scores differ by about an ulp may be
selected differently, as between any two top-k implementations. Keys whose scores are
equal may be too, and exact ties are not rare here: a key scores exactly 0 wherever relu
zeroes the products of all H heads, about 2**-H of the keys. Where such a tie falls on the
k-th score, torch's top-k keeps whichever tied key its algorithm reaches (torch.topk: "the
indices of tied elements are not guaranteed to be stable"), the op another: both are the
top-k, and the attention after them attends to other keys: the fused model is the model
under another tie order, not a miscompile. transformers 5.24's A.X-K2 and dots3_note built
tiny with 4 indexer heads (DeepSeek-V3.2 too, for seeds 4 and 5) differed from eager by
0.05-0.12 in their logits, every differing selection a tie at 0 on the k-th score, and
matched eager run with a stable top-k (lower key first among ties, as the stand-in) to
2e-7. Verification therefore compares the scores of the kept keys, not their positions
(kept_keys_by_score).

DeepSeek-V4's compressed indexer as torchtitan-npu writes it (LiCompute: the scores of T = S // m
blocks, an additive finfo.min mask past (s + 1) // m, its hidden blocks' indices made -1, its values
read by LiLoss) is recognised as any other spelling (recognize=) and, once its mask is proven that
compressed causal mask, becomes cann_ops_transformer.lightning_indexer (mask_mode 3, cmp_ratio m), the
padded slots given the model's finfo.min values (_mask_terms, _recognized_replacement).

In training the indexer has no gradient (transformers runs it under no_grad) and its indices
are saved for the fused attention's backward (npu_sparse_flash_attention_grad), a reader
only the joint graph shows: the forward-only forms also run there (forward_forms_on_joint).
A recognised indexer whose top-k values get a gradient (torchtitan-npu's indexer loss) is
replaced jointly with the backward autograd made of it: npu_lightning_indexer(return_value=True),
whose autograd brings npu_lightning_indexer_grad (see "training: the joint replacement" below);
DeepSeek-V4's compressed one through CompressedLightningIndexer, the COT op with
npu_lightning_indexer_grad(sparse_mode=0) as its backward.
"""
import heapq
import operator

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npu_fx_fusion.capabilities import CAPABILITIES, GE_MODES, not_lowerable, unsupported
from npu_fx_fusion.constants import MaskTerm, compressed_mask_ratio, mask_mode, sparse_mode_of, value_set
from npu_fx_fusion.matching import (MOVES, AxisEvaluation, Form, FusionPass, NotEvaluable, Recognized,
                                   backward_nodes_by_seq, backward_region, constant_on_a_size_range, first_refused_use,
                                   formula_of, index_symbol, is_backward, is_call, is_cast, known_equal,
                                   read_masked_scores, rearrange, records_gradient, region_between, scale_and_rest,
                                   size_expr, tensor_meta)

aten = torch.ops.aten
INDEXER = CAPABILITIES["npu.npu_lightning_indexer"]
# DeepSeek-V4's compressed indexer (torchtitan-npu's LiCompute): the op sparse_mla's CSA form emits, whose
# mask_mode 3 takes a cmp_ratio (npu_lightning_indexer's sparse_mode 3 has none)
COMPRESSED_INDEXER = CAPABILITIES["cann_ops_transformer.lightning_indexer"]
# A finite additive fill f hides a key as the model's top-k and the replacement read it only where
# score + f rounds to f itself: with f <= -2**127 (the top binade of fp32, where its spacing is 2**104;
# bf16's there is 2**120) every score of magnitude below 2**103 leaves f unchanged, in fp32 and in bf16
# arithmetic alike, and ranks above it. finfo(float32).min and finfo(bfloat16).min are such fills;
# finfo(float16).min (-65504) is not (a score of 16 moves it).
_FINITE_FILL_AT_MOST = -(2.0 ** 127)


# ---- the unfused form (transformers DeepseekV32Indexer, bool mask: its sdpa path) -----------
def _index_scores(query, key, weights, scale):
    scores = torch.matmul(query.float(), key.transpose(-1, -2).float().unsqueeze(1)) * scale
    scores = torch.relu(scores)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def transformers_indexer(query, key, weights, mask, scale, index_topk):
    index_scores = _index_scores(query, key, weights, scale).masked_fill(~mask, float("-inf"))
    return index_scores.topk(index_topk, dim=-1).indices.to(torch.int32)


# ---- the fused calls: one per sparse_mode the mask may prove ---------------------------------
def _lightning_indexer(query, key, weights, scale, index_topk, sparse_mode):
    # (B, S, H, D) queries, one key head (B, T, 1, D); indices come back (B, S, 1, k)
    indices, _ = torch.ops.npu.npu_lightning_indexer(
        query, key.unsqueeze(2), weights * scale, layout_query="BSND", layout_key="BSND",
        sparse_count=index_topk, sparse_mode=sparse_mode)
    return indices.squeeze(2)


def npu_lightning_indexer_causal(query, key, weights, mask, scale, index_topk):
    return _lightning_indexer(query, key, weights, scale, index_topk, sparse_mode=3)


def npu_lightning_indexer_unmasked(query, key, weights, mask, scale, index_topk):
    return _lightning_indexer(query, key, weights, scale, index_topk, sparse_mode=0)


def kept_keys_by_score(outputs, inputs):
    """Per query, how many keys its selection keeps (listed, and let through by the mask),
    and the model's scores of those keys, best first (0 for the rest of the keys): what the
    model's attention uses of a top-k, under which model and op are compared (verification).

    Scores, not key positions: where keys tie at the k-th score, either is a top-k (torch
    documents no order among tied elements: "the indices of tied elements are not
    guaranteed to be stable"), and exact ties are common here: a key scores exactly 0 when
    relu zeroes every head's product, about 2**-H of the keys of H indexer heads (with 4
    heads, a quarter of random draws at B=2, S=T=16, k=8 tie at the k-th score). A key of
    another score, a hidden one or a key listed twice is caught: a score or the count differs.
    """
    (indices,) = outputs
    indices = indices.long()
    scores = _index_scores(inputs["query"], inputs["key"], inputs["weights"], inputs["scale"])
    visible = torch.broadcast_to(inputs["mask"], scores.shape)
    listed = indices.clamp(min=0)  # the op's -1 slots name no key
    listed_visible = (indices >= 0) & visible.gather(-1, listed)
    # a count per key, so a key listed twice is kept once
    times_kept = torch.zeros_like(scores, dtype=torch.long).scatter_add(-1, listed, listed_visible.long())
    kept = times_kept > 0
    best_first = scores.masked_fill(~kept, float("-inf")).sort(dim=-1, descending=True).values
    return [kept.sum(dim=-1), best_first.masked_fill(torch.isneginf(best_first), 0.0)]


def _form(search, replace):
    return Form(search, replace, canonical_outputs=kept_keys_by_score)


FORMS = [
    # the same search twice: the check keeps the replacement whose sparse_mode the mask is
    _form(transformers_indexer, npu_lightning_indexer_causal),
    _form(transformers_indexer, npu_lightning_indexer_unmasked),
]
_MODE = {npu_lightning_indexer_causal: 3, npu_lightning_indexer_unmasked: 0}


# ---- checks -------------------------------------------------------------------------------
def check(site):
    if getattr(site.form.replace, "indexer_recognized", False):
        return _check_recognized(site)
    query, key, weights = site["query"], site["key"], site["weights"]
    if site["scale"] <= 0:
        return f"scale {site['scale']} <= 0: relu(scale * x) is not scale * relu(x)"
    mode, why = sparse_mode_of(site.arg_nodes["mask"])
    if mode is None:
        return why
    if mode != _MODE[site.form.replace]:
        return f"{why}: sparse_mode {mode}, not {_MODE[site.form.replace]}"
    use = _use_other_than_sparse_attention(site, mode)
    if use is not None:
        if use.op == "output":  # in a training graph's forward half: kept for its backward
            return ("its indices are an output of the graph (in a partitioned training graph: saved for the "
                    "backward, where this pass cannot see who reads them); the op pads with -1 where fewer "
                    "than k keys are visible and may order equal scores differently, which only a fused "
                    "sparse attention (or its backward) under the same mask reads as the model does")
        return (f"its indices reach {use.name} ({use.target}): the op pads with -1 where fewer "
                "than k keys are visible and may order equal scores differently, which only a "
                "fused sparse attention (or its backward) under the same mask reads as the model does")
    return site.hardware_limits(_hardware_reasons(query, key, weights, site["index_topk"], site.soc))


def _check_recognized(site):
    replace = site.form.replace
    if getattr(replace, "trained", False):
        # the joint replacement emits the op with return_value=True and, through its autograd, its grad op
        reason = not_lowerable(INDEXER.backward, site.mode or GE_MODES[0])
        if reason is not None:
            reason = f"training: {reason}"
            if replace.ratio is None:  # (the compressed op takes return_value in no graph mode: no GE converter)
                reason += (", and the op's docs support return_value (which its backward needs) in graph mode only "
                           f"on {', '.join(INDEXER.limits['return_value_graph_socs'])}")
            if site.mode in GE_MODES:
                return reason
            if site.mode is None:
                site.notes.append(f"in {GE_MODES[0]}: {reason}")
    if replace.rounds and site.keep_intermediate_rounding:
        return ("the model rounds the indexer's scores to bf16/fp16 on the way, the op ranks fp32 scores "
                "(FusionConfig.keep_intermediate_rounding keeps the code's roundings)")
    hardware = _hardware_reasons if replace.ratio is None else _compressed_hardware_reasons
    broken = hardware(site["query"], site["key"], site["weights"], site["index_topk"], site.soc)
    if replace.ratio is not None and getattr(replace, "trained", False):
        broken += _compressed_backward_reasons(site["query"], site.soc)
    reason = site.hardware_limits(broken)
    if reason is None and replace.guard is not None:
        # min(index_topk, S) is index_topk for every S >= index_topk: guarded as dynamo guards its own
        if not replace.guard():
            return f"the top-k's k is not {replace.count} at this compile's sizes"
        site.notes.append(f"k taken as {replace.count}: a guard keeps this graph to the sizes where it is (a call "
                          "outside them compiles again)")
    return reason


def _hardware_reasons(query, key, weights, count, soc):
    limits = INDEXER.limits
    heads, dim = query.shape[-2], query.shape[-1]
    return [
        unsupported("npu.npu_lightning_indexer", soc, x=query),
        f"query {str(query.dtype)[6:]} and key {str(key.dtype)[6:]}: the kernel takes one dtype"
        if key.dtype != query.dtype else None,
        f"head dim {dim}, the kernel takes {limits['head_dim']}" if dim != limits["head_dim"] else None,
        f"{heads} query heads, the kernel takes at most {limits['max_query_heads']}"
        if heads > limits["max_query_heads"] else None,
        f"weights are {str(weights.dtype)[6:]}" if weights.dtype not in limits["weights_dtypes"] else None,
        f"index_topk {count} > {limits['max_sparse_count']}"
        if count > limits["max_sparse_count"] and count not in limits["large_sparse_counts"] else None,
    ]


def _compressed_hardware_reasons(query, key, weights, count, soc):
    """cann_ops_transformer.lightning_indexer's limits (its capability; the metadata op is not called: the
    op takes metadata=None, as torchtitan-npu's converter calls it)."""
    limits = COMPRESSED_INDEXER.limits
    heads, dim = query.shape[-2], query.shape[-1]
    return [
        unsupported(COMPRESSED_INDEXER.op, soc, x=query),
        f"query {str(query.dtype)[6:]} and key {str(key.dtype)[6:]}: the kernel takes one dtype"
        if key.dtype != query.dtype else None,
        f"indexer head dim {dim}: lightning_indexer takes {limits['head_dim']}" if dim != limits["head_dim"] else None,
        f"{heads} indexer heads: lightning_indexer takes 1..{limits['max_query_heads']}"
        if not 1 <= heads <= limits["max_query_heads"] else None,
        f"index top-k {count}: lightning_indexer takes 1..{limits['max_topk']} or one of {limits['large_topks']}"
        if count > limits["max_topk"] and count not in limits["large_topks"] else None,
    ]


def _compressed_backward_reasons(query, soc):
    """In training, CompressedLightningIndexer's backward: npu_lightning_indexer_grad's limits, with the fp32
    weights the compressed op takes."""
    fp32_socs = INDEXER.limits["weights_fp32_socs"]
    return [
        unsupported(INDEXER.backward, soc, x=query),
        f"in training: {INDEXER.backward} takes the compressed indexer's fp32 weights only on {', '.join(fp32_socs)}"
        if soc not in fp32_socs else None,
    ]


# Ops that move the indices without changing which key each slot names.
_PASS_ON = (aten._to_copy.default, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
            aten.expand.default, aten.clone.default)


# The sparse attention ops that read sparse_indices as npu_sparse_flash_attention does: the
# forward, and in a training graph its backward (sparse_indices: argument 3 of both;
# sparse_mode: a keyword of the forward, argument 15 of the grad op).
_READERS = {"npu_sparse_flash_attention": 3, "npu_sparse_flash_attention_grad": 15}


def _sparse_mode_of_reader(user):
    name = user.target._schema.name.split("::")[-1]  # noqa: SLF001
    position = _READERS[name]
    if "sparse_mode" in user.kwargs:
        return user.kwargs["sparse_mode"]
    return user.args[position] if len(user.args) > position and name.endswith("_grad") else 3


def _use_other_than_sparse_attention(site, mode):
    """The first use of the site's indices that is not the sparse_indices of a fused sparse
    attention (or, in a training graph, of its backward) that hides what the indexer's
    mask hides (sparse_mode 3 behind a causal indexer: the model's attention then ignores
    the masked keys the model's top-k listed, as the op's -1 slots are ignored)."""
    def reads_as_the_model_does(user, value):
        return (is_call(user, torch.ops.npu.npu_sparse_flash_attention, torch.ops.npu.npu_sparse_flash_attention_grad)
                and len(user.args) > 3 and user.args[3] is value
                and (mode == 0 or _sparse_mode_of_reader(user) == 3))

    return first_refused_use(site, reads_as_the_model_does, _PASS_ON)


# ---- near misses: a top-k over relu'd, head-weighted scores -----------------------------------
def anchor(node):
    if not is_call(node, aten.topk.default):
        return False
    relu = _nearest_input_call(node.args[0], aten.relu.default, limit=40)
    return relu is not None and tensor_meta(relu) is not None and tensor_meta(relu).dim() == 4


def _nearest_input_call(start, target, limit):
    """The first call of `target` met walking up from `start` breadth-first, within `limit`
    nodes visited that are not moves (views, permutes: a graph with symbolic sizes re-views a
    value several times where a static one does not), or None."""
    frontier, seen = [start], 0
    while frontier and seen < limit:
        current = frontier.pop(0)
        seen += not is_call(current, *MOVES)
        if is_call(current, target):
            return current
        if isinstance(current, torch.fx.Node):
            frontier.extend(current.all_input_nodes)
    return None


def _masked_by_a_compressed_threshold(topk):
    """Whether the scores a top-k ranks are masked with a floor division of the positions:
    DeepSeek-V4's indexer (DeepseekV4Indexer: blocks w >= (t + 1) // compress_rate hidden),
    which V3.2's token-level mask never has."""
    scores = topk.args[0]
    if not is_call(scores, aten.masked_fill.Scalar):
        return False
    return _nearest_input_call(scores.args[1], aten.floor_divide.default, limit=12) is not None


def _additively_masked_by_a_compressed_threshold(topk):
    """torchtitan-npu's LiCompute: scores + where(w >= (t + 1) // ratio, finfo.min, 0)."""
    scores = topk.args[0]
    while is_call(scores, aten._to_copy.default):
        scores = scores.args[0]
    return (is_call(scores, aten.add.Tensor) and is_call(scores.args[1], aten.where.self)
            and _nearest_input_call(scores.args[1], aten.floor_divide.default, limit=12) is not None)


def _readers_beyond_the_attention(topk):
    """(the top-k scores' first reader, the indices' first reader that is no fused sparse
    attention), each None where there is none: what the model reads of its top-k besides
    the key selection (DeepSeek-V3.2's indexer loss: a softmax of the scores, a gather at
    the indices)."""
    scores = next((u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 0 and u.users), None)
    frontier = [u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 1]
    seen, other = 0, None
    while frontier and seen < 24 and other is None:
        node = frontier.pop(0)
        seen += 1
        for user in node.users:
            if is_call(user, *_PASS_ON):
                frontier.append(user)
            elif user.op == "call_function" and not is_call(user, torch.ops.npu.npu_sparse_flash_attention,
                                                            torch.ops.npu.npu_sparse_flash_attention_grad):
                other = user
                break
    return (next(iter(scores.users)) if scores is not None else None), other


def explain(topk):
    if _additively_masked_by_a_compressed_threshold(topk):
        # sparse_mla's torchtitan-npu forms read the model's own top-k indices (re-based), so
        # its attention fuses whether or not this does
        scores_reader, _ = _readers_beyond_the_attention(topk)
        values = ("; its top-k values are read too (the indexer loss)" if scores_reader is not None else "")
        return ("DeepSeek-V4's compressed lightning indexer as torchtitan-npu's LiCompute writes it (an additive "
                "finfo.min mask past (t + 1) // compress_rate): its scores could not be read as an indexer's "
                "(sum_h w_h * relu(s * q_h . k)) by the axis algebra, so it is not fused into "
                f"cann_ops_transformer.lightning_indexer{values}")
    if _masked_by_a_compressed_threshold(topk):
        # left in the graph where sparse_mla refused its CSA site; that pass's near miss for the
        # layer's attention says why (sparse_mla runs first: after=)
        return ("DeepSeek-V4's lightning indexer (scores over compressed blocks, masked past (t + 1) // "
                "compress_rate): sparse_mla fuses it with its CSA attention, into "
                "cann_ops_transformer.lightning_indexer (npu_lightning_indexer has no cmp_ratio for that "
                "mask); see sparse_mla's near miss for this layer's attention")
    scores_reader, indices_reader = _readers_beyond_the_attention(topk)
    if scores_reader is not None and indices_reader is not None:
        read = []
        if scores_reader is not None:
            read.append(f"its top-k scores reach {scores_reader.name} ({scores_reader.target})")
        if indices_reader is not None:
            read.append(f"its indices reach {indices_reader.name} ({indices_reader.target}) besides any sparse "
                        "attention")
        return ("a top-k over relu'd query-key scores whose results the model reads beyond the attention's key "
                "selection (DeepSeek-V3.2's indexer loss: a softmax of the top-k scores, a gather of the attention "
                "distribution at the indices): " + ", and ".join(read) + ". The axis algebra could not evaluate "
                "the scores as an indexer's (sum_h w_h * relu(s * q_h . k)), so its readers were not analysed; "
                "npu_lightning_indexer pads with -1 where fewer than k keys are visible and may order the k slots "
                "otherwise")
    return ("a top-k over relu'd query-key scores that matches none of the indexer forms "
            "(transformers DeepseekV32Indexer: scale inside the relu, weights summing the heads, "
            "a bool mask; the additive mask of its eager path is not covered)")


# ---- any spelling, recognised by what it computes (recognize=) ------------------------------------
# A top-k over  masks(c * sum_H(W * relu(c' * sum_D(Q * K))))  is an indexer whatever its spelling
# (rearrange / permute, matmul / einsum, a product summed over the heads or a matmul with the
# weights): the axis algebra (axis_algebra.py) evaluates the top-k's input into that expression,
# over index variables, and the replacement rearranges Q, K and W into the op's BSND layouts.
# The op's results are the model's only up to (a) the order of the k slots and (b) the slots it
# pads; both are proven harmless to every reader of the top-k's values and indices (_readers_reason)
# before it fuses, or the site is a near miss naming the reader.
_RECOGNIZED = "lightning indexer (axis algebra)"


def _strip_exact_casts(expr):
    """The expression under casts that round nothing: each cast's dtype at least as wide as the
    value's own (a bf16 value cast to fp32 and back)."""
    base = expr
    chain = []
    while base.op == "cast":
        chain.append(base.value)
        base = base.args[0]
    if all(_widens(base.dtype, dtype) for dtype in chain):
        return base
    return expr


def _widens(source, target):
    order = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    if source == target:
        return True
    return source in order and target in order and order[target] > order[source] and not (
        {source, target} == {torch.float16, torch.bfloat16})


def _wider(a, b):
    return a != b and _widens(b, a)


def _factors(expr):
    """The factors of a product (nested products flattened)."""
    if expr.op == "mul":
        return [f for a in expr.args for f in _factors(a)]
    return [expr]


def _rounds(expr, stop):
    """Whether `expr` rounds an intermediate value to a narrower float than fp32 (a cast down, or an
    op computed in bf16/fp16) above the leaves `stop`."""
    stack = [expr]
    while stack:
        e = stack.pop()
        if any(e is s for s in stop) or e.op in ("leaf", "const"):
            continue
        if e.dtype in (torch.float16, torch.bfloat16):
            return True
        stack.extend(e.args)
    return False


class _Read:
    """An indexer's scores read off the algebra: query / key / weights expressions, their atoms' roles,
    the constant folded into the weights, and the masks."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _read_indexer(value):
    """The indexer read off the top-k input's Value, or why it is not  sum_H(W * relu(s * Q.K)) masked."""
    dims = value.dims
    if len(dims) != 3:
        return "the top-k's scores are not (batch, queries, keys)"
    read = read_masked_scores(value.expr)
    coefficient, core = scale_and_rest(read.rest)
    if core.op not in ("sum", "mean") or len(core.args) != 1:
        return "the scores are not a sum over the indexer heads (sum_h w_h * relu(q_h . k))"
    if not isinstance(coefficient, (int, float)):
        return f"the scores' scale {coefficient} is not a constant"
    heads = set(core.atoms)
    if core.op == "mean":  # the mean over the heads: the sum over them divided by their count
        if not isinstance(core.value, int):
            return "the scores are a mean over a symbolic number of heads"
        coefficient = coefficient / core.value
    factors = _factors(core.args[0])
    relus = [f for f in factors if _strip_exact_casts(f).op == "relu"]
    if len(relus) != 1:
        return "the summed product holds no relu of the query-key product (or more than one)"
    relu = _strip_exact_casts(relus[0])
    rest = [f for f in factors if f is not relus[0]]
    scale = 1.0
    weights = []
    for f in rest:
        c, e = scale_and_rest(f)
        scale *= c
        if e.op != "const":
            weights.append(_strip_exact_casts(e))
    if len(weights) != 1 or weights[0].node is None:
        return "the heads are not weighted by one tensor (sum_h w_h * relu(q_h . k))"
    inner_scale, product = scale_and_rest(relu.args[0])
    if not isinstance(inner_scale, (int, float)) or not isinstance(scale, (int, float)):
        return "a scale of the scores is not a constant"
    if inner_scale <= 0:
        return f"the relu's argument is scaled by {inner_scale} <= 0: relu(s * x) is not s * relu(x)"
    if not (product.op == "sum" and len(product.args) == 1 and product.args[0].op == "mul"
            and len(product.args[0].args) == 2):
        return "the relu's argument is not a contraction of a query with a key"
    q, k = (_strip_exact_casts(f) for f in product.args[0].args)
    batch, queries, keys = (set(d) for d in dims)
    head_dim = set(product.atoms)
    if heads & k.free:
        q, k = k, q
    w = weights[0]
    if q.node is None or k.node is None or not heads or not head_dim:
        return "the query-key product is not of two tensors"
    if (not heads <= q.free or heads & k.free or not head_dim <= q.free or not head_dim <= k.free
            or not q.free <= batch | queries | heads | head_dim or not k.free <= batch | keys | head_dim
            or not keys <= k.free or keys & (q.free | w.free) or not w.free <= batch | queries | heads
            or not heads <= w.free or not queries <= q.free):
        return ("the scores do not read query (batch, queries, heads, dim), one key head (batch, keys, dim) and "
                "weights (batch, queries, heads) as the indexer does")
    return _Read(q=q, k=k, w=w, masks=read.masks, weight_scale=float(coefficient * scale * inner_scale),
                 batch=dims[0], queries=dims[1], keys=dims[2], heads=_ordered(heads, q.dims),
                 head_dim=_ordered(head_dim, q.dims), rounds=_rounds(value.expr, (q, k, w)))


def _ordered(atoms, dims):
    order = [a for group in dims for a in group]
    return tuple(sorted(atoms, key=order.index))


def _mask_terms(read):
    """(MaskTerms of the scores' masks, the value a hidden key scores), or the reason one is not a mask
    hiding keys with -inf or with one finite fill f <= -2**127 (an additive finfo.min: score + f rounds
    to f for |score| < 2**103, _FINITE_FILL_AT_MOST): the op's padded slots stand for the model's hidden
    keys, whose scores the replacement restores, only where those are one value."""
    roles_of = {**{a: "b" for a in read.batch}, **{a: "s" for a in read.queries}, **{a: "t" for a in read.keys}}
    terms, fills = [], set()
    for mask in read.masks:
        roles = []
        for atoms in mask.dims:
            found = {roles_of.get(a, "?") for a in atoms}
            if len(found) > 1 or "?" in found:
                return "a mask of the scores has a dim that is not the batch, the queries or the keys"
            roles.append(found.pop() if found else None)  # a dim of size 1: broadcast
        roles = tuple(roles)
        if mask.kind in ("fill", "keep"):
            # written, not added: a hidden key scores the fill itself, whatever its score
            if not (isinstance(mask.fill, float) and mask.fill <= _FINITE_FILL_AT_MOST):
                return (f"the scores are masked with {mask.fill}, not -inf or a fill <= -2**127 (finfo(float32 / "
                        "bfloat16).min), which every score ranks above: the op's padded slots stand for hidden keys")
            terms.append(MaskTerm(mask.node, "true" if mask.kind == "fill" else "false", roles))
            fills.add(mask.fill)
            continue
        values = value_set(mask.node)
        hiding = None if values is None else values - {0.0}
        if values is None or 0.0 not in values or len(hiding) != 1 or not (
                hiding == {float("-inf")} or next(iter(hiding)) <= _FINITE_FILL_AT_MOST):
            return (f"the additive mask {mask.node.name} is not only 0 and -inf (or 0 and one finite fill <= -2**127, "
                    "which every score below 2**103 leaves unchanged: finfo(float32 / bfloat16).min)"
                    + ("" if values is None else f" (it holds {sorted(values)})"))
        terms.append(MaskTerm(mask.node, "nonzero", roles))
        fills |= hiding
    if len(fills) > 1 or (fills and min(fills) != float("-inf") and len(terms) > 1):
        return ("the scores are masked by several masks, one of them with a finite fill: a key two of them hide "
                "scores their sum, not one fill")
    return terms, (fills.pop() if fills else float("-inf"))


def recognize(graph, joint):
    """Indexers of any spelling whose top-k the forms left: fused where the mask is proven causal (or
    none) and every reader of the top-k's values and indices is proven to read the op's as the model's."""
    evaluation = AxisEvaluation()
    found = []
    by_seq = {}
    for topk in sorted(graph.find_nodes(op="call_function", target=aten.topk.default)):
        if joint and is_backward(topk):
            continue
        if joint and not by_seq:
            by_seq = backward_nodes_by_seq(graph)
        try:
            site = _recognized(topk, evaluation, joint, by_seq)
        except NotEvaluable:
            site = None
        if site is not None:
            found.append(site)
    return found


def _topk_outputs(topk):
    values = next((u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 0 and u.users), None)
    indices = next((u for u in topk.users if is_call(u, operator.getitem) and u.args[1] == 1 and u.users), None)
    return values, indices


def _recognized(topk, evaluation, joint, by_seq=None):
    x = topk.args[0]
    meta = tensor_meta(x)
    if meta is None or not meta.is_floating_point() or meta.dim() != 3:
        return None
    dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    if dim not in (-1, 2) or not largest:
        return None
    values, indices = _topk_outputs(topk)
    if indices is None and values is None:
        return None
    if _masked_by_a_compressed_threshold(topk):
        return None  # transformers' DeepSeek-V4 indexer: sparse_mla's (with its CSA attention), explain() says so
    read = _read_indexer(evaluation.value(x))
    outputs = [n for n in (values, indices) if n is not None]
    if isinstance(read, str):
        # a top-k the pass's anchor flags (relu'd scores) says why the algebra does not take it
        return Recognized(_RECOGNIZED, outputs, [topk], reason=f"the scores the top-k ranks are not an indexer's "
                          f"(sum_h w_h * relu(s * q_h . k), masked): {read}") if anchor(topk) else None
    refuse = lambda why: Recognized(_RECOGNIZED, outputs, [topk], reason=why)  # noqa: E731
    terms = _mask_terms(read)
    if isinstance(terms, str):
        return refuse(terms)
    terms, hidden_value = terms
    queries, keys = meta.shape[1], meta.shape[2]
    mode, why = mask_mode(terms, queries, keys)
    ratio = None
    if mode not in ("causal", "none"):
        # DeepSeek-V4's compressed causal mask (torchtitan-npu's LiCompute): cann_ops_transformer.lightning_indexer's
        # mask_mode 3 with cmp_ratio m
        ratio, compressed_why = compressed_mask_ratio(terms, queries, keys, _threshold_divisor(terms))
        if ratio is None:
            return refuse(f"the scores' mask is not proven right-down causal or empty ({why}), nor DeepSeek-V4's "
                          f"compressed causal mask ({compressed_why}): npu_lightning_indexer's sparse_mode 3 / 0 and "
                          "cann_ops_transformer.lightning_indexer's mask_mode 3 with a cmp_ratio cannot express it")
        why = compressed_why
        reason = _compressed_sizes_reason(ratio, queries, keys)
        if reason is not None:
            return refuse(reason)
    sparse_mode = 3 if mode == "causal" or ratio is not None else 0
    count = topk.args[1]
    guard = None
    if isinstance(count, torch.fx.Node):
        count = count.meta.get("val")
    if isinstance(count, torch.SymInt) and count.node.expr.is_number:  # min(k, S) where S >= k is known
        count = int(count.node.expr)
    if isinstance(count, torch.SymInt):
        constant = constant_on_a_size_range(count)
        if constant is None:
            return refuse(f"the top-k's k is {count}, computed from symbolic sizes, not a constant the op's "
                          "sparse_count can take")
        count, guard = constant
    if not isinstance(count, int):
        return refuse(f"the top-k's k is {count!r}, not a constant")
    inputs = {"query": read.q.node, "key": read.k.node, "weights": read.w.node}
    nodes = region_between([topk, *outputs], list(inputs.values()))
    if nodes is None:
        return None
    trained = None
    if joint and any(is_backward(u) for n in nodes for u in n.users):
        trained = _trained(nodes, inputs, values, outputs, terms, by_seq)
        if isinstance(trained, str):
            # a reader the slot-order analysis refuses says more (a backward weighing the slots' gradients by
            # their position is no region's backward either)
            own = {b for n in nodes for b in by_seq.get(n.meta.get("seq_nr"), ())}
            return refuse(_readers_reason(values, indices, sparse_mode, queries, keys, ratio, own_backward=own)
                          or trained)
    reason = _readers_reason(values, indices, sparse_mode, queries, keys, ratio,
                             own_backward=set(trained.backward.nodes) if trained is not None else frozenset())
    if reason is not None:
        return refuse(reason)
    notes = [f"{why} (the scores' mask)"]
    if hidden_value != float("-inf") and values is not None:
        notes.append(f"the model's hidden keys score {hidden_value:g} (written by a masked fill, or score + "
                     f"{hidden_value:g}, which is {hidden_value:g} for every score below 2**103 in magnitude): the "
                     "replacement gives the op's padded slots that value (the op's -inf would make a softmax over "
                     "a row that sees no key NaN, the model's uniform)")
    if trained is not None:
        notes.append("in training: the top-k values' gradient reaches query, key and weights through "
                     "npu_lightning_indexer_grad (the padded slots get none, as the model's hidden keys)"
                     + trained.note)
    if read.rounds:
        notes.append("the model rounds the scores to bf16/fp16 on the way (autocast); the op computes them in fp32 "
                     "and ranks those: keys whose scores differ by about the rounding may be selected differently")
    replace = _recognized_replacement(read, count, sparse_mode, values is not None,
                                      tensor_meta(values).dtype if values is not None else None,
                                      tensor_meta(indices).dtype if indices is not None else None, guard,
                                      ratio=ratio, hidden_value=hidden_value)
    replace.rounds = read.rounds
    replace.trained = trained is not None
    if values is not None and _wider(tensor_meta(values).dtype, replace.values_dtype):
        notes.append(f"the op returns the top-k scores in {str(replace.values_dtype)[6:]} (its query's dtype), the "
                     f"model's are {str(tensor_meta(values).dtype)[6:]}: each read score within half a "
                     f"{str(replace.values_dtype)[6:]} ulp of the model's")
    sizes = _joint_atom_sizes([(tensor_meta(expr.node), expr.dims) for expr in (read.q, read.k, read.w)])

    def size(atoms):
        out = 1
        for a in atoms:
            out = out * sizes[a] if a in sizes else out * a.size
        return out

    q_meta = tensor_meta(read.q.node)
    dtype = replace.dtype
    site_args = {
        "query": q_meta.new_empty((size(read.batch), size(read.queries), size(read.heads), size(read.head_dim)),
                                  dtype=dtype),
        "key": q_meta.new_empty((size(read.batch), size(read.keys), size(read.head_dim)), dtype=dtype),
        "weights": q_meta.new_empty((size(read.batch), size(read.queries), size(read.heads)),
                                    dtype=replace.weights_dtype),
        "index_topk": count,
    }
    joint_fields = {}
    if trained is not None:
        backward = trained.backward
        joint_fields = dict(backward_nodes=backward.nodes, output_gradients=backward.output_gradients,
                            needs_gradient=trained.roles,
                            backward_output=[backward.gradients[inputs[role]] for role in trained.roles])
    return Recognized(_RECOGNIZED, outputs if len(outputs) > 1 else outputs[0], nodes, inputs, replace, site_args,
                      fused_op=replace.op, notes=notes, canonical_outputs=replace.canonical,
                      **joint_fields)


# ---- training: the joint replacement ------------------------------------------------------------
# In a training step the model's top-k values may feed a loss (torchtitan-npu's DSAIndexerLoss), and
# autograd differentiates the indexer: the top-k's backward scatters each slot's gradient to its key's
# score, and the scores' backward (relu, the weights, the two matmuls) takes it to query, key and weights.
# npu_lightning_indexer is differentiable through its values (return_value=True): its registered backward
# is npu_lightning_indexer_grad, which computes the same sums over the listed keys of each query, and none
# for the -1 slots it pads. The replacement, traced with its autograd, stands for the forward region and
# the backward autograd made of it (regions.backward_region finds it by the region's seq_nr) at once:
#
# - the gradient of the values enters the op's backward in the op's slot order, which the readers'
#   analysis (_readers_reason, over the backward's nodes too) proves to be the model's up to the one
#   permutation per query row (the gradient of a function indifferent to the order of the slots is
#   permuted with them);
# - the padded slots: the replacement's where(padded, -inf, scores) sends their gradient nowhere, and the
#   op's backward skips -1 slots. The model's top-k lists hidden keys there, whose gradient a masked_fill
#   or where mask zeroes; an additive -inf mask passes it on to those keys' scores, so there the values'
#   gradient itself must be proven zero in those slots (_padded_slots_get_no_gradient);
# - a scale folded into the weights (relu(s x) = s relu(x)) is the replacement's weights * s, which
#   autograd differentiates: the weights' gradient gets the factor s, as the model's does;
# - the indices have no gradient, and the op computes nothing else: a backward that reads any other
#   value of the region (an intermediate of the scores saved for another consumer) is refused.
class _Trained:
    def __init__(self, backward, roles, note):
        self.backward, self.roles, self.note = backward, roles, note


def _trained(nodes, inputs, values, outputs, terms, by_seq):
    """The backward of a recognised indexer whose scores get a gradient (_Trained), or why the op's
    backward is not it."""
    if values is None:
        return ("in training the backward reads the indexer's scores, but the model reads only its top-k indices: "
                "npu_lightning_indexer is differentiable only through its values (return_value=True, "
                "npu_lightning_indexer_grad), its indices have no gradient")
    given = set(inputs.values())
    differentiated = set()
    for node in nodes:  # (graph order) the region's values computed from query, key or weights
        if any(a in given or a in differentiated for a in node.all_input_nodes):
            differentiated.add(node)
    # what else they read (a mask built from aranges) gets no gradient
    constants = sorted({a for n in differentiated for a in n.all_input_nodes
                        if a not in differentiated and a not in given and tensor_meta(a) is not None})
    backward = backward_region(sorted(differentiated), list(inputs.values()), outputs, by_seq, constants)
    if isinstance(backward, str):
        return (f"in training: {backward}; npu_lightning_indexer_grad computes the gradients of query, key and "
                "weights from the gradient of the top-k values alone")
    gradient = backward.output_gradients[0]
    if gradient is None:
        return ("in training the indexer's scores get a gradient, but not through its top-k values: "
                "npu_lightning_indexer is differentiable only through them (npu_lightning_indexer_grad)")
    note = ""
    if any(term.hides == "nonzero" for term in terms):
        why = _padded_slots_get_no_gradient(gradient, values)
        if why is not None:
            return (f"in training, behind an additive -inf mask the model's top-k passes the gradient of its padded "
                    f"slots on to the hidden keys it lists there, where the op has none: {why}")
        note = ("; behind the additive mask the values' gradient is a softmax's over the slots, 0 in the padded "
                "slots: exactly, beside a visible key's score (the hidden ones' exp is 0), and in a query that sees "
                "no key, whose softmax is uniform, to the rounding of its sum (the backward of a reader "
                "indifferent to the slot order is one value in every slot there)")
    roles = [role for role, node in inputs.items() if node in backward.gradients]
    return _Trained(backward, roles, note)


_GRADIENT_KEEPS = (aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default)


def _padded_slots_get_no_gradient(gradient, values):
    """None where the top-k values' gradient is 0 in every slot whose value is -inf: it is the backward of a
    softmax over the slots of the values (through casts), y * (g - sum(y * g)) with y = softmax(values) exactly
    0 there; else why that is not proven."""
    g = gradient
    while is_cast(g) or is_call(g, *_GRADIENT_KEEPS):
        g = g.args[0]
    if not is_call(g, aten._softmax_backward_data.default):
        return (f"the values' gradient {gradient.name} is not proven 0 where their value is -inf (only a softmax "
                "over the slots reading the values alone is)")
    out, dim = g.args[1], g.args[2]
    while is_cast(out) or is_call(out, *_GRADIENT_KEEPS):
        out = out.args[0]
    x = out.args[0] if is_call(out, aten._softmax.default) else None
    while x is not None and (is_cast(x) or is_call(x, *_GRADIENT_KEEPS)):
        x = x.args[0]
    rank = tensor_meta(values).dim()
    if x is not values or dim % rank != rank - 1 or out.args[1] % rank != rank - 1:
        return (f"the values' gradient {gradient.name} is a softmax's backward, but not that of a softmax over "
                "the slots of the top-k values")
    return None


def _joint_atom_sizes(pairs):
    """{atom: size} over several tensors and their dims (axis_algebra.atom_sizes of each, jointly): a dim
    holding two symbolic atoms (a leaf with batch and sequence merged, under dynamic shapes) is resolved
    once the other tensors give all but one of its atoms. Raises NotEvaluable where one stays unknown."""
    sizes, pending = {}, []
    for t, dims in pairs:
        for d, group in enumerate(dims):
            for a in group:
                if isinstance(a.size, int):
                    sizes[a] = a.size
            pending.append((t.shape[d], group))
    progress = True
    while progress:
        progress = False
        for total, group in pending:
            unknown = [a for a in group if a not in sizes]
            if len(unknown) == 1:
                known = 1
                for a in group:
                    if a is not unknown[0]:
                        known = known * sizes[a]
                sizes[unknown[0]] = total // known
                progress = True
    if any(a not in sizes for _, group in pending for a in group):
        raise NotEvaluable("a dim of the indexer's inputs holds symbolic atoms no other input gives the sizes of")
    return sizes


def _threshold_divisor(terms):
    """The constant divisor of a floor division the masks compute from (the compress ratio m of
    `(s + 1) // m`), or None: the candidate a mask of symbolic sizes is proven against."""
    seen, frontier = set(), [t.node for t in terms]
    while frontier and len(seen) < 60:
        node = frontier.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        if is_call(node, aten.floor_divide.default) and isinstance(node.args[1], int):
            return node.args[1]
        frontier.extend(node.all_input_nodes)
    return None


def _compressed_sizes_reason(ratio, queries, keys):
    """Why the op's compressed mask with cmp_ratio `ratio` and cmp_residual_k S - T * ratio is not the proven one
    for these sizes, or None: the op takes ratios 1..128 and a residual 0 <= S - T * ratio < ratio (its full
    length S: query i then sees the blocks t < (i + 1) // ratio, the model's)."""
    limit = COMPRESSED_INDEXER.limits["max_cmp_ratio"]
    if ratio > limit:
        return f"compress ratio {ratio}: cann_ops_transformer.lightning_indexer takes 1..{limit}"
    residual = queries - keys * ratio
    try:
        known = known_equal(keys, queries // ratio) or (
            statically_known_true(residual >= 0) and statically_known_true(residual < ratio))
    except Exception:  # noqa: BLE001 - a size relation the shape environment cannot decide: not proven
        known = False
    if not known:
        return (f"{keys} blocks of ratio {ratio} for {queries} queries: the op's residual S - T * {ratio} is not "
                f"proven in [0, {ratio}) (T = S // {ratio})")
    return None


def _compressed_indexer(q, k, w, topk, residual, ratio, return_value):
    """cann_ops_transformer.lightning_indexer under DeepSeek-V4's compressed causal mask (mask_mode 3,
    cmp_ratio, cmp_residual_k), BSND."""
    return torch.ops.cann_ops_transformer.lightning_indexer(
        q, k, w, topk, cmp_residual_k=residual, layout_q="BSND", layout_k="BSND", mask_mode=3, cmp_ratio=ratio,
        return_value=int(return_value))


class CompressedLightningIndexer(torch.autograd.Function):
    """cann_ops_transformer.lightning_indexer (mask_mode 3, cmp_ratio m, return_value) with a backward: the
    extension has none (it returns indices; torchtitan-npu trains V4's indexer through its fused KL-loss op).
    The top-k values are v[i, s] = sum_h w[i, h] relu(q[i, h] . k[j]) at the listed blocks j = idx[i, s],
    whatever mask chose them, so their gradient is npu_lightning_indexer_grad's over the same list: called
    with sparse_mode 0, which skips only the -1 slots (its sparse_mode 3 would hide the compressed blocks
    j > i + T - S that the compressed mask lets through). capabilities.py: the op's autograd_rule.
    forward(q (B, S, N, D), k (B, T, 1, D), w fp32 (B, S, N), topk, cmp_residual_k, ratio)
    -> int32 indices, fp32 values (B, S, 1, topk)."""

    @staticmethod
    def forward(ctx, q, k, w, topk, residual, ratio):
        indices, values = _compressed_indexer(q, k, w, topk, residual, ratio, return_value=True)
        ctx.save_for_backward(q, k, w, indices)
        ctx.mark_non_differentiable(indices)
        return indices, values

    @staticmethod
    def backward(ctx, grad_indices, grad_values):
        q, k, w, indices = ctx.saved_tensors
        # dy in the query's dtype, as npu_lightning_indexer's own values (and the model's bf16 scores) are
        dq, dk, dw = torch.ops.npu.npu_lightning_indexer_grad(q, k, grad_values.to(q.dtype), indices, w,
                                                              layout="BSND", sparse_mode=0)
        return dq, dk, dw, None, None, None


def _recognized_replacement(read, count, sparse_mode, return_value, value_dtype, index_dtype, guard, ratio=None,
                            hidden_value=float("-inf")):
    """The fused call: npu_lightning_indexer (sparse_mode 3 / 0), or with a compress ratio (DeepSeek-V4's mask)
    cann_ops_transformer.lightning_indexer (mask_mode 3, cmp_ratio, cmp_residual_k S - T * ratio); the padded
    slots given the model's hidden score (`hidden_value`) and hidden key T - 1."""
    q_dims, k_dims, w_dims = read.q.dims, read.k.dims, read.w.dims
    bsnd_q = (read.batch, read.queries, read.heads, read.head_dim)
    bsnd_k = (read.batch, read.keys, (), read.head_dim)
    bsn_w = (read.batch, read.queries, read.heads)
    q_dtype, k_dtype = read.q.dtype, read.k.dtype
    dtype = q_dtype if q_dtype == k_dtype and q_dtype in (torch.float16, torch.bfloat16, torch.float32) \
        else torch.float32
    scale = read.weight_scale
    weights_dtype = read.w.dtype if scale == 1.0 and read.w.dtype in (torch.float16, torch.bfloat16, torch.float32) \
        else torch.float32
    if ratio is not None:
        weights_dtype = COMPRESSED_INDEXER.limits["weights_dtype"]  # fp32 weights (w of the COT op)

    def npu_lightning_indexer_recognized(query, key, weights):
        sizes = _joint_atom_sizes([(query, q_dims), (key, k_dims), (weights, w_dims)])
        q = rearrange(query, q_dims, bsnd_q, sizes).to(dtype)
        k = rearrange(key, k_dims, bsnd_k, sizes).to(dtype)
        w = rearrange(weights, w_dims, bsn_w, sizes).to(weights_dtype)
        if scale != 1.0:
            w = w * scale
        if ratio is None:
            indices, scores = torch.ops.npu.npu_lightning_indexer(
                q, k, w, layout_query="BSND", layout_key="BSND", sparse_count=count, sparse_mode=sparse_mode,
                return_value=return_value)
        else:
            # the op's full length T * ratio + residual is S: query i sees the blocks t < (i + 1) // ratio
            residual = torch.full((q.shape[0],), q.shape[1] - k.shape[1] * ratio, dtype=torch.int32, device=q.device)
            if return_value and records_gradient(q, k, w):
                indices, scores = CompressedLightningIndexer.apply(q, k, w, count, residual, ratio)
            else:
                indices, scores = _compressed_indexer(q, k, w, count, residual, ratio, return_value)
        indices = indices.squeeze(2)
        padded = indices < 0
        out = []
        if return_value:
            # the padded slots' scores: the model's scores of the hidden keys its top-k lists there (-inf, or
            # the finite fill f every score leaves unchanged, rounded to the values' dtype as the model's are)
            out.append(torch.where(padded, hidden_value, scores.squeeze(2).float()).to(value_dtype))
        if index_dtype is not None:
            if sparse_mode == 3:
                # a hidden key for the padded slots: key T - 1 (_readers_reason proves the readers indifferent
                # to which hidden key a slot lists)
                indices = torch.where(padded, k.shape[1] - 1, indices)
            out.append(indices.to(index_dtype))
        return tuple(out) if len(out) > 1 else out[0]

    def kept_scores(outputs, inputs):
        """kept_keys_by_score for a recognised site: per query, the scores of the keys its top-k values and
        indices keep, best first (-inf, a hidden or padded slot, as 0): equal for any two top-k selections
        whatever their slot order, tied keys exchanged or not, and whichever hidden key a padded slot lists."""
        query, key, weights = inputs["query"], inputs["key"], inputs["weights"]
        sizes = _joint_atom_sizes([(query, q_dims), (key, k_dims), (weights, w_dims)])
        q = rearrange(query, q_dims, bsnd_q, sizes).float()
        k = rearrange(key, k_dims, bsnd_k, sizes).float().squeeze(2)
        w = rearrange(weights, w_dims, bsn_w, sizes).float() * scale
        scores = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
        if ratio is not None:
            s_len, t_len = scores.shape[-2:]
            scores = scores.masked_fill(torch.arange(t_len) >= (torch.arange(s_len).unsqueeze(-1) + 1) // ratio,
                                        float("-inf"))
        elif sparse_mode == 3:
            s_len, t_len = scores.shape[-2:]
            i = torch.arange(s_len).unsqueeze(-1) + (t_len - s_len)
            scores = scores.masked_fill(torch.arange(t_len) > i, float("-inf"))
        out = list(outputs)
        canonical = []
        if return_value:
            values = out.pop(0).float()
            values = values.masked_fill(values <= _FINITE_FILL_AT_MOST, float("-inf"))  # a hidden key's fill
            canonical.append(values.sort(dim=-1, descending=True).values.nan_to_num(neginf=0.0))
        if index_dtype is not None:
            indices = out.pop(0).long()
            listed = scores.gather(-1, indices.clamp(0, scores.shape[-1] - 1)).masked_fill(indices < 0, float("-inf"))
            canonical.append(listed.sort(dim=-1, descending=True).values.nan_to_num(neginf=0.0))
        return canonical

    npu_lightning_indexer_recognized.canonical = kept_scores
    npu_lightning_indexer_recognized.dtype = dtype
    # the dtype the op returns its top-k scores in: npu_lightning_indexer's are its query's, the COT op's fp32
    npu_lightning_indexer_recognized.values_dtype = dtype if ratio is None else torch.float32
    npu_lightning_indexer_recognized.op = "npu.npu_lightning_indexer" if ratio is None else COMPRESSED_INDEXER.op
    npu_lightning_indexer_recognized.ratio = ratio
    npu_lightning_indexer_recognized.weights_dtype = weights_dtype
    npu_lightning_indexer_recognized.guard = guard
    npu_lightning_indexer_recognized.count = count
    npu_lightning_indexer_recognized.indexer_recognized = True
    return npu_lightning_indexer_recognized


# ---- the readers: indifferent to the order of the k slots and to which hidden key a padded slot lists --
# The op's k slots may come in another order than torch.topk's (per query row), and where fewer than k
# keys are visible (right-down causal: query i of S sees i + T - S + 1 keys) it pads the rest with -1
# (scores -inf); the model's top-k lists hidden keys there, scored -inf. The replacement gives -inf
# scores and key T - 1 in those slots: hidden too, since a padded slot exists only where
# i + T - S + 1 < k <= T, i.e. i + T - S < T - 1. So the values equal the model's, and the indices
# differ only in which hidden key a padded slot lists. Every reader must be proven not to care:
#
#   "perm" values (the model's, up to one permutation of the slots per query row): elementwise ops whose
#   other operands are constant along the slots (broadcast, expanded from 1, a constant), layout moves
#   that keep the slot dim, softmax over the slots, a gather along the slot dim at such indices, stay
#   "perm"; a reduction over the slots (sum, mean, norm, amax ...), a scatter of a constant at such
#   indices along the slots, and a fused sparse attention's sparse_indices end the permutation;
#   "raw" indices (the padded slots list some hidden key): only comparisons with the query's last
#   visible key position (index <= i + T - S, or < i + T - S + 1, or the negations) read them, which
#   are the same for every hidden key, a where that replaces the slots such a comparison finds
#   hidden by something constant along the slots, and a fused sparse attention with the causal mode
#   (which hides any hidden key it is given). Anything else refuses, naming the reader.
_KEEPS = (aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
          aten.contiguous.default, aten.lift_fresh_copy.default, torch.ops.prims.convert_element_type.default)
_ELEMENTWISE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.exp.default, aten.log.default,
    aten.log1p.default, aten.abs.default, aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default,
    aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Scalar, aten.sqrt.default, aten.rsqrt.default,
    aten.reciprocal.default, aten.sigmoid.default, aten.tanh.default, aten.relu.default, aten.isinf.default,
    aten.isneginf.default, aten.isposinf.default, aten.isnan.default, aten.eq.Scalar, aten.eq.Tensor,
    aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor,
    aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_not.default, aten.logical_not.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.xlogy.Tensor, aten.kl_div.default,
    # a joint graph's backward: the elementwise derivatives of the ops above
    aten.threshold_backward.default, aten.sigmoid_backward.default, aten.tanh_backward.default, aten.sgn.default,
    aten.sign.default,
})


def _is_kl_div_backward(node):
    """kl_div's backward as an NPU compile records it (npu.kl_div_backward: torch_npu differentiates kl_div
    itself; the stand-in op exists once the npu ops are registered)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.name in ("npu::kl_div_backward", "npu::kl_div_target_backward")


_NOT = (aten.bitwise_not.default, aten.logical_not.default)
_COMPARE = {aten.le.Tensor: "le", aten.le.Scalar: "le", aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
            aten.ge.Tensor: "ge", aten.ge.Scalar: "ge", aten.gt.Tensor: "gt", aten.gt.Scalar: "gt"}
_SLOT_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
                              aten.amax.default, aten.amin.default, aten.linalg_vector_norm.default,
                              aten.logsumexp.default, aten.any.dim, aten.all.dim, aten.any.default,
                              aten.all.default, aten.prod.dim_int, aten.prod.default})
_SORTS = frozenset({aten.sort.default, aten.sort.stable})
_SLOT_NORMALISE = frozenset({aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default})
# in a joint graph, the backward of a softmax over the slots: (gradient, output, dim, dtype)
_SLOT_NORMALISE_BACKWARD = frozenset({aten._softmax_backward_data.default, aten._log_softmax_backward_data.default})
_LIKE = frozenset({aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
                   aten.empty_like.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
                   aten.new_empty.default})
_CONSTANT_SOURCES = frozenset({aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
                               *_LIKE})
_READERS_LIMIT = 300  # nodes after the top-k that the analysis follows


class _State:
    """A tracked value: kind "raw" (the op's indices with a hidden key in the padded slots) or "perm" (the
    model's values with the slots permuted per row); `slot` / `query`: its dims holding the k slots and
    the query rows (None where a layout move dropped the rows' dim); `visible`: for a comparison of raw
    indices with the query position, whether it is True where the key is visible (None otherwise)."""

    __slots__ = ("kind", "slot", "query", "visible", "offset")

    def __init__(self, kind, slot, query, visible=None, offset=0):
        self.kind, self.slot, self.query, self.visible = kind, slot, query, visible
        self.offset = offset  # raw: the indices plus this constant (torchtitan-npu's `topk_idxs + offset`)


_END = object()  # a value the slot order does not reach (a reduction over the slots, a scattered mask)


def _describe(node):
    return f"{node.name} ({node.target})"


def _readers_reason(values, indices, sparse_mode, queries, keys, ratio=None, *, own_backward=frozenset()):
    """None when every reader of the top-k's values and indices reads the replacement's as the model's
    (order of the slots, the padded slots' keys), else the reason naming the first that does not.
    `ratio`: DeepSeek-V4's compressed mask (query i sees the blocks t < (i + 1) // ratio), else None.

    In a joint graph the backward's nodes that read them are analysed as the forward's are (a gradient
    of per-slot values, permuted with them, is a tracked value too), except `own_backward`: the backward
    autograd made of the indexer itself, which the replacement's (npu_lightning_indexer_grad) replaces,
    and which reads the values' gradient in the op's slot order."""
    order = {n: i for i, n in enumerate(next(iter(filter(None, (values, indices)))).graph.nodes)}
    states = {}
    heap = []
    for node, kind in ((values, "perm"), (indices, "raw" if sparse_mode == 3 else "perm")):
        if node is not None:
            rank = tensor_meta(node).dim()
            states[node] = _State(kind, rank - 1, rank - 2)
            for user in node.users:
                heapq.heappush(heap, (order[user], user))
    seen = set()
    while heap:
        _, node = heapq.heappop(heap)
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _READERS_LIMIT:
            return "the top-k's results are read by more ops than the slot-order analysis follows"
        state = _END if node in own_backward else _state_of(node, states, sparse_mode, queries, keys, ratio)
        if isinstance(state, str):
            return state
        if state is _END:
            continue
        states[node] = state
        for user in node.users:
            heapq.heappush(heap, (order[user], user))
    return None


def _tracked(node, states):
    return [a for a in node.all_input_nodes if a in states]


def _same_shape(a, b):
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def _state_of(node, states, sparse_mode, queries, keys, ratio=None):
    """The node's _State from its tracked inputs, _END, or the reason it is refused."""
    if node.op == "output":
        return ("the top-k's results are outputs of the graph (returned, or saved for a backward this pass cannot "
                "see): the op's slot order and padded slots would reach code no proof covers")
    if node.op != "call_function":
        return f"the top-k's results reach {_describe(node)}, which is no call of an op"
    tracked = _tracked(node, states)
    first = states[tracked[0]]
    meta = tensor_meta(node)
    t = node.target
    if is_call(node, *_LIKE):  # shape only: a constant tensor
        return _END
    if is_call(node, torch.ops.npu.npu_sparse_flash_attention, torch.ops.npu.npu_sparse_flash_attention_grad):
        if len(tracked) == 1 and len(node.args) > 3 and node.args[3] is tracked[0] and (
                first.kind == "perm" or _hides_what_the_indexer_hides(node, queries, keys)):
            return _END  # attends to the listed keys as a set; hidden ones hidden by its causal mode
        return (f"the top-k's results reach {_describe(node)} other than as the sparse indices of a causal sparse "
                "attention")
    if t in _SORTS:  # (a tuple of the sorted values and the permutation)
        return _sorted(node, tracked, states)
    if meta is None:
        return f"the top-k's results reach {_describe(node)}, which computes no tensor"
    if len(tracked) == 1 and (t in _KEEPS or is_cast(node)):
        if first.kind == "raw" and meta.dtype not in (torch.int32, torch.int64):
            return (f"the op's indices are cast to {meta.dtype} by {_describe(node)}, which may not hold every key "
                    "index: hidden keys would not all compare alike")
        return first
    if len(tracked) == 1 and node.args[0] is tracked[0] and t in (
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.permute.default, aten.transpose.int,
            aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return _moved(node, first)
    if t in _SLOT_REDUCTIONS:
        return _reduced(node, tracked, states)
    if t in _SLOT_NORMALISE:
        if first.kind != "perm" or node.args[1] % tensor_meta(node.args[0]).dim() != first.slot:
            return f"the top-k's results reach {_describe(node)}, a softmax over another dim than the k slots"
        return _State("perm", first.slot, first.query)
    if t in _SLOT_NORMALISE_BACKWARD:
        return _normalise_backward(node, tracked, states)
    if t is aten.gather.default:
        return _gathered(node, tracked, states)
    if t is aten.cat.default:
        return _concatenated(node, tracked, states)
    if t in (aten.scatter.value, aten.scatter.src):
        return _scattered(node, tracked, states)
    if t is aten.scatter_add.default:
        return _scattered_added(node, states)
    if t in _ELEMENTWISE or _is_kl_div_backward(node):
        return _elementwise(node, tracked, states, sparse_mode, queries, keys, ratio)
    return (f"the top-k's results reach {_describe(node)}, which the slot-order analysis does not know to be "
            "indifferent to the order of the k slots (and to the keys of the slots the op pads)")


def _normalise_backward(node, tracked, states):
    """A softmax's backward (its gradient and its output) along the k slots: per query row, a function of
    the row's slots that permutes with them, where each operand is permuted alike or constant along them."""
    rank = tensor_meta(node).dim()
    dim = node.args[2] % rank
    for a in node.args[:2]:
        if a in states:
            state = states[a]
            if state.kind != "perm" or tensor_meta(a).dim() != rank or state.slot != dim:
                return (f"the top-k's results reach {_describe(node)}, a softmax's backward over another dim than "
                        "the k slots")
        elif not _constant_along(a, dim, rank):
            return (f"{_describe(node)} combines the top-k's results with {a.name}, which varies along the k slots: "
                    "the op's slot order would pair them otherwise")
    return _State("perm", dim, states[tracked[0]].query)


def _hides_what_the_indexer_hides(attention, queries, keys):
    """A sparse attention that hides, by its own right-down causal mode over the same queries and keys
    (BSND), every key the indexer's mask hides: key T - 1 in a padded slot adds nothing there."""
    if (not is_call(attention, torch.ops.npu.npu_sparse_flash_attention) or _sparse_mode_of_reader(attention) != 3
            or attention.kwargs.get("layout_query", "BSND") != "BSND"
            or attention.kwargs.get("layout_kv", "BSND") != "BSND"
            or any(attention.kwargs.get(name) is not None
                   for name in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv"))):
        return False
    query, key = (tensor_meta(a) for a in attention.args[:2])
    return (query is not None and key is not None and query.dim() == 4 and key.dim() == 4
            and known_equal(query.shape[1], queries) and known_equal(key.shape[1], keys))


def _moved(node, state):
    """A layout move of a tracked value: where its slot and query dims go (None: refused)."""
    source = tensor_meta(node.args[0]).shape
    shape = tensor_meta(node).shape
    rank = len(source)
    t = node.target
    position = list(range(rank))  # new position of each input dim (None: dropped)
    if t is aten.unsqueeze.default:
        d = node.args[1] % (rank + 1)
        position = [p + (p >= d) for p in range(rank)]
    elif t in (aten.squeeze.dim, aten.squeeze.dims):
        dropped = {d % rank for d in ([node.args[1]] if t is aten.squeeze.dim else node.args[1])
                   if source[d % rank] == 1}
        if state.slot in dropped:
            return "the top-k's k slots are squeezed away"
        kept = [p for p in range(rank) if p not in dropped]
        position = [kept.index(p) if p in kept else None for p in range(rank)]
    elif t is aten.permute.default:
        perm = [d % rank for d in node.args[1]]
        position = [perm.index(p) for p in range(rank)]
    elif t is aten.transpose.int:
        a, b = node.args[1] % rank, node.args[2] % rank
        position[a], position[b] = b, a
    elif t is aten.expand.default:
        lead = len(shape) - rank
        if not known_equal(shape[lead + state.slot], source[state.slot]):
            return "the top-k's k slots are expanded"
        position = [p + lead for p in range(rank)]
    else:  # a view: only size-1 dims may come and go
        big = [p for p in range(rank) if not (isinstance(source[p], int) and source[p] == 1)]
        out = [p for p in range(len(shape)) if not (isinstance(shape[p], int) and shape[p] == 1)]
        if len(big) != len(out) or not all(known_equal(source[a], shape[b]) for a, b in zip(big, out)):
            return f"the top-k's results are re-viewed by {_describe(node)}, merging or splitting their dims"
        position = [out[big.index(p)] if p in big else None for p in range(rank)]
    slot = position[state.slot]
    query = position[state.query] if state.query is not None else None
    if slot is None:
        return "the top-k's k slots are dropped by a view"
    return _State(state.kind, slot, query, state.visible, state.offset)


def _reduced(node, tracked, states):
    (value,) = tracked
    state = states[value]
    if state.kind != "perm":
        return (f"the op's indices reach {_describe(node)}, a reduction of the key indices, where the op pads "
                "slots the model's top-k fills with hidden keys")
    rank = tensor_meta(value).dim()
    dims = node.args[1] if len(node.args) > 1 and node.target not in (aten.linalg_vector_norm.default,) \
        else node.kwargs.get("dim")
    if node.target is aten.linalg_vector_norm.default:
        dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if node.target in (aten.sum.default, aten.mean.default, aten.any.default, aten.all.default,
                       aten.prod.default) or dims is None or dims == []:
        return _END
    dims = {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
    if state.slot in dims:
        return _END
    return (f"the top-k's results reach {_describe(node)}, a reduction over other dims than the k slots: it adds "
            "up query rows whose slots the op may order differently")


def _slot_index(node, dim, index, states, access):
    """The state of `index` when `node` (a gather or scatter, `access`) reads the top-k's indices, permuted
    along their k slots, along those slots; else why not. Read at the op's indices, a padded slot names
    another key than the hidden key the model's top-k fills it with."""
    state = states[index]
    if state.kind != "perm":
        return (f"the op's indices reach {_describe(node)}, a {access} at the key indices, where the op pads slots "
                "the model's top-k fills with hidden keys (which key it reads or writes there differs)")
    if dim % tensor_meta(index).dim() != state.slot:
        return f"the top-k's indices are read along another dim than the k slots by {_describe(node)}"
    return state


def _gathered(node, tracked, states):
    src, dim, index = node.args[:3]
    if src in states or index not in states:
        return f"the top-k's results are gathered from by {_describe(node)}"
    state = _slot_index(node, dim, index, states, "gather")
    if isinstance(state, str):
        return state
    if tensor_meta(src).dim() != tensor_meta(index).dim():
        return f"{_describe(node)} gathers from a tensor of another rank than the top-k's indices"
    return _State("perm", state.slot, state.query)


def _scattered(node, tracked, states):
    base, dim, index = node.args[:3]
    source = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", node.kwargs.get("src"))
    if base in states or index not in states or (isinstance(source, torch.fx.Node) and source in states):
        return f"the top-k's values are scattered by {_describe(node)}"
    state = _slot_index(node, dim, index, states, "scatter")
    if isinstance(state, str):
        return state
    if isinstance(source, torch.fx.Node) and not _constant_along(source, None):
        return f"{_describe(node)} writes values that vary along the k slots at the top-k's indices"
    return _END  # one value written at each listed key: the set of keys, not their order


def _scattered_added(node, states):
    """A scatter_add of per-slot values at per-slot keys along the slots (a gather's backward: the gradient
    of what it read, summed at each key): with both permuted alike, each key gets the same sum."""
    base, dim, index, source = node.args[:4]
    if base in states or index not in states:
        return f"the top-k's results are scattered by {_describe(node)}"
    state = _slot_index(node, dim, index, states, "scatter")
    if isinstance(state, str):
        return state
    if source in states:
        if (states[source].kind != "perm" or tensor_meta(source).dim() != tensor_meta(index).dim()
                or states[source].slot != state.slot
                or not _same_shape(tensor_meta(source).shape, tensor_meta(index).shape)):
            return f"{_describe(node)} adds up values whose slots are not permuted as its indices are"
    elif not _constant_along(source, None):
        return f"{_describe(node)} adds up values that vary along the k slots at the top-k's indices"
    return _END  # per key, the sum of the slots listing it: the same whatever their order


def _constant_along(node, dim, rank=None):
    """Whether an untracked operand is constant along the output dim `dim` (of an output of `rank`
    dims; dim None: constant everywhere): broadcast there, of size 1, expanded from size 1, or a
    constant tensor."""
    if not isinstance(node, torch.fx.Node):
        return True
    if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, int, float)):
        return True  # a scalar (a symbolic size): one value everywhere
    meta = tensor_meta(node)
    if meta is None:
        return False
    if is_call(node, *_CONSTANT_SOURCES):
        return True
    if dim is None:
        return meta.dim() == 0
    position = dim - (rank - meta.dim())
    if position < 0:
        return True
    size = meta.shape[position]
    if isinstance(size, int) and size == 1:
        return True
    if is_call(node, aten.expand.default):
        source = tensor_meta(node.args[0])
        source_position = position - (meta.dim() - source.dim())
        return source_position < 0 or (isinstance(source.shape[source_position], int)
                                        and source.shape[source_position] == 1)
    if is_call(node, *_KEEPS) or is_cast(node):
        return _constant_along(node.args[0], position, meta.dim())
    if node.target in _ELEMENTWISE and node.all_input_nodes:  # (a joint graph's -gradient, expanded from (B, S, 1))
        return all(_constant_along(a, position, meta.dim()) for a in node.all_input_nodes)
    return False


def _elementwise(node, tracked, states, sparse_mode, queries, keys, ratio=None):
    meta = tensor_meta(node)
    rank = meta.dim()
    shape = meta.shape
    if node.target is aten.kl_div.default and (node.args[2] if len(node.args) > 2 else
                                               node.kwargs.get("reduction", 1)) != 0:
        return f"the top-k's results reach {_describe(node)}, a kl_div that reduces"
    if _is_kl_div_backward(node) and (node.args[3] if len(node.args) > 3 else
                                                                 node.kwargs.get("reduction", 1)) != 0:
        return f"the top-k's results reach {_describe(node)}, the backward of a kl_div that reduces"
    slots = {(states[a].slot + rank - tensor_meta(a).dim()) for a in tracked}
    queries_at = {(states[a].query + rank - tensor_meta(a).dim()) if states[a].query is not None else None
                  for a in tracked}
    if len(slots) != 1 or len(queries_at) != 1 or not all(_same_shape(tensor_meta(a).shape, shape) for a in tracked):
        return (f"{_describe(node)} combines results of the top-k laid out differently (or broadcast): its "
                "operands' slots are not permuted alike")
    (slot,), (query,) = slots, queries_at
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    for a in operands:
        if a not in states and not _constant_along(a, slot, rank):
            return (f"{_describe(node)} combines the top-k's results with {a.name}, which varies along the k "
                    "slots: the op's slot order would pair them otherwise")
    raw = [a for a in tracked if states[a].kind == "raw"]
    if not raw:
        visible = None
        if len(tracked) == 1 and is_call(node, *_NOT) and states[tracked[0]].visible is not None:
            visible = not states[tracked[0]].visible
        return _State("perm", slot, query, visible)
    return _read_raw(node, raw, states, sparse_mode, queries, keys, slot, query, ratio)


def _sorted(node, tracked, states):
    """A sort of a tracked value: its sorted values along the k slots are the model's whatever the slots'
    order (sparse_mla's replacement sorts the compressed indices so that the -1 slots come last)."""
    (value,) = tracked
    state = states[value]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if node.target is aten.sort.stable:
        dim = node.kwargs.get("dim", -1)
    if state.kind != "perm" or node.args[0] is not value or dim % tensor_meta(value).dim() != state.slot:
        return (f"the top-k's results reach {_describe(node)}, a sort of the key indices (or along another dim than "
                "the k slots)")
    if any(not (is_call(u, operator.getitem) and u.args[1] == 0) for u in node.users):
        return (f"the top-k's results are sorted by {_describe(node)} and the sort's permutation is read: it depends "
                "on the order of the slots")
    return _END  # the sorted values: the model's, whatever the slots' order


def _concatenated(node, tracked, states):
    """A cat along the k slots of the model's values (permuted per row) with other columns: the joined row
    is the model's up to a permutation of its slots too (torchtitan-npu's window indices, then the blocks)."""
    tensors = node.args[0]
    rank = tensor_meta(node).dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    for a in tensors:
        if a in states and (states[a].kind != "perm" or tensor_meta(a).dim() != rank or states[a].slot != dim):
            return (f"the top-k's results are concatenated by {_describe(node)} along another dim than the k slots "
                    "(or as the op's raw indices)")
    queries_at = {states[a].query for a in tensors if a in states}
    if len(queries_at) != 1:
        return f"{_describe(node)} concatenates results of the top-k laid out differently"
    return _State("perm", dim, queries_at.pop())


def _offset_of(node, value):
    """The constant a raw index is shifted by in `node` (add / sub of an int or a size), or None."""
    if not is_call(node, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) \
            or node.args[0] is not value or node.kwargs.get("alpha", 1) != 1:
        return None
    other = node.args[1]
    if isinstance(other, torch.fx.Node):
        other = other.meta.get("val")
    if isinstance(other, bool) or not isinstance(other, (int, torch.SymInt)):
        return None
    amount = size_expr(other)
    return amount if node.target in (aten.add.Tensor, aten.add.Scalar) else -amount


def _read_raw(node, raw, states, sparse_mode, queries, keys, slot, query, ratio=None):
    """A reader of the op's indices with a hidden key in the padded slots: a comparison with the query's
    last visible key, or a where replacing the slots such a comparison finds hidden."""
    refused = (f"the op's indices reach {_describe(node)}, which reads the key index of every slot: where fewer "
               "than k keys are visible the op pads slots the model's top-k fills with hidden keys, and this reader "
               "is not proven to treat every hidden key alike")
    (value,) = raw
    if query is None:
        return refused
    rank = tensor_meta(node).dim()
    offset = _offset_of(node, value)
    if offset is not None:  # the indices shifted by a constant: hidden keys stay hidden keys, shifted alike
        return _State("raw", slot, query, offset=states[value].offset + offset)
    if node.target in _COMPARE:
        op = _COMPARE[node.target]
        a, b = node.args[:2]
        if b is value:  # b op a  ->  a (flipped op) b
            a, b = b, a
            op = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[op]
        if a is not value or b in states:
            return refused
        bound = b if not isinstance(b, torch.fx.Node) else formula_of(b, tensor_meta(node).shape)
        if bound is None:
            return refused + " (its other operand is not computed from sizes)"
        if ratio is None:
            last = index_symbol(query) + size_expr(keys) - size_expr(queries)  # the query's last visible key
        else:  # DeepSeek-V4's compressed mask: query i sees the blocks t < (i + 1) // ratio
            last = sympy.floor((index_symbol(query) + 1) / sympy.Integer(ratio)) - 1
        last = last + states[value].offset
        expected = last + (1 if op in ("lt", "ge") else 0)
        try:
            same = sympy.simplify(sympy.sympify(bound) - expected) == 0
        except (TypeError, sympy.SympifyError):
            same = False
        if not same:
            return (f"the op's indices are compared with {bound} by {_describe(node)}, not with the query's last "
                    f"visible key (index <= {last}): hidden keys would not all compare alike")
        return _State("perm", slot, query, visible=op in ("le", "lt"))
    if node.target in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        if node.target is aten.where.self:
            condition, kept, replaced = node.args[:3]
            wanted = True  # keeps `kept` where the condition holds
            if replaced is value:
                kept, replaced, wanted = replaced, kept, False
        else:
            kept, condition, replaced = node.args[:3]
            wanted = False  # masked_fill keeps the input where the mask is False
        if kept is not value or condition not in states or replaced in states:
            return refused
        test = states[condition]
        if test.visible is not wanted or test.slot != states[value].slot + rank - tensor_meta(value).dim():
            return (f"{_describe(node)} keeps the op's indices where {condition.name} holds, which is not proven "
                    "to be where their key is visible to the query")
        return _State("perm", slot, query)
    return refused


PASS = FusionPass(
    name="lightning_indexer",
    # the fused indexer pads its indices with -1, which only the fused sparse attention
    # reads as the model's attention reads its own indices. sparse_mla: DeepSeek-V4's CSA form
    # spans its indexer (the threshold is shared by the indexer's mask and the attention's), to
    # cann_ops_transformer.lightning_indexer, whose cmp_ratio npu_lightning_indexer lacks
    after=("sparse_attention", "sparse_mla"),
    fused_op="npu.npu_lightning_indexer",
    forms=FORMS,
    example={
        # B=2, S=T=7, H=3 heads of D=16; the scalars differ from every size (k=5)
        "query": lambda dtype: torch.empty(2, 7, 3, 16, dtype=dtype),
        "key": lambda dtype: torch.empty(2, 7, 16, dtype=dtype),
        "weights": lambda dtype: torch.empty(2, 7, 3, dtype=torch.float32),
        "mask": lambda dtype: torch.empty(2, 7, 7, dtype=torch.bool),
        "scale": 0.125,
        "index_topk": 5,
    },
    # batch 1 (decode, single prompts): there the key's matmul operand is a view, not a copy
    example_variants=[{
        "query": lambda dtype: torch.empty(1, 7, 3, 16, dtype=dtype),
        "key": lambda dtype: torch.empty(1, 7, 16, dtype=dtype),
        "weights": lambda dtype: torch.empty(1, 7, 3, dtype=torch.float32),
        "mask": lambda dtype: torch.empty(1, 7, 7, dtype=torch.bool),
    }],
    check=check,
    anchor=anchor,
    anchor_ops=(aten.topk.default,),
    explain=explain,
    recognize=recognize,
    # transformers' indexer runs under no_grad, so in training its indices are saved for the
    # fused attention's backward: only on the joint graph does the check see that reader
    forward_forms_on_joint=True,
)
