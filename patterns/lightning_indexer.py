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

In training the indexer has no gradient (transformers runs it under no_grad) and its indices
are saved for the fused attention's backward (npu_sparse_flash_attention_grad), a reader
only the joint graph shows: the forward-only forms also run there (forward_forms_on_joint).
"""
import operator

import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.constants import sparse_mode_of
from npu_fx_fusion.matching import MOVES, Form, FusionPass, first_refused_use, is_call, tensor_meta

aten = torch.ops.aten
INDEXER = CAPABILITIES["npu.npu_lightning_indexer"]


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
        values = ("; its top-k values are read too (the indexer loss), and the op pads them with -inf where the "
                  "model's are finfo.min" if scores_reader is not None else "")
        return ("DeepSeek-V4's compressed lightning indexer as torchtitan-npu's LiCompute writes it (an additive "
                "finfo.min mask past (t + 1) // compress_rate): no form fuses it into "
                f"cann_ops_transformer.lightning_indexer yet{values}. The op may order tied scores otherwise, "
                "which would have to be proven harmless to every reader of its indices")
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
                "distribution at the indices): " + ", and ".join(read) + ". npu_lightning_indexer pads with -1 "
                "where fewer than k keys are visible (the model's top-k lists hidden keys there, which its code "
                "replaces or masks by position: -1 passes `index <= position` and no gather takes it), may order "
                "equal scores differently, and gives the scores only with return_value=True: only a fused sparse "
                "attention reads its indices as the model does, and a fused indexer loss "
                "(npu_sparse_lightning_indexer_grad_kl_loss, as torchtitan-npu's npu_dsa converter uses) is no "
                "pass here (its scores are not matched as an indexer form either)")
    return ("a top-k over relu'd query-key scores that matches none of the indexer forms "
            "(transformers DeepseekV32Indexer: scale inside the relu, weights summing the heads, "
            "a bool mask; the additive mask of its eager path is not covered)")


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
    # transformers' indexer runs under no_grad, so in training its indices are saved for the
    # fused attention's backward: only on the joint graph does the check see that reader
    forward_forms_on_joint=True,
)
