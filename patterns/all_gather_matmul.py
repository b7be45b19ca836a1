"""all_gather_matmul: an all-gather feeding a matmul -> torch.ops.npu.npu_all_gather_base_mm.

    full = all_gather(x_shard, group)      # sequence parallel: the tokens of every rank
    y = full @ weight.T                    # a column-parallel linear on them
 -> y, full = npu_all_gather_base_mm(x_shard, weight.T, hcom, ranks)

With sequence parallel (torch.distributed.tensor.parallel's SequenceParallel and a
ColwiseParallel that takes Replicate input; torchtitan's SP), each rank holds a slice of the
sequence between the blocks; every column-parallel projection reads the all-gathered
sequence. A compiled graph records the gather as `_c10d_functional.all_gather_into_tensor` +
`wait_tensor`, rank-major on dim 0, reassembled along the sequence dim as funcol's
all_gather_tensor does it: nothing for a gather on dim 0, a view when the batch is 1, slices
concatenated along dim 1 otherwise. The MC2 kernel gathers the rows of a 2-D x1 rank-major,
tile by tile, each tile's matmul overlapping the next tile's transfer, and returns the
gathered rows too (`gather_out`): the other projections that read the same gathered input
(w1 and w3, or q, k and v) read those, and so does a training step's weight gradient.

Exactness: a matmul acts row by row, so gathering rows and multiplying them is multiplying
and gathering, in any row order; the gathered rows must only come back in the order the model
uses them. Gather dim 0 and the one-sequence view: x's rows, flattened, are the gathered
tensor's rows in order. Several sequences (batch > 1): x is handed over sequence-major
(x.transpose(0, 1), a copy), so rank-major rows are sequence-major rows of the whole batch,
transposed back (two more copies: the model's layout, which a training step's backward reads
the saved gathered input with).

In a training step's backward, the gradient of a row-parallel matmul under SP is the same
shape: the incoming gradient's sequence slices, all-gathered, multiplied by the weight
(npu_all_gather_base_mm), and the gathered gradient times the saved input gives the weight's
gradient (a plain matmul, as the unfused matmul_backward computes it). That backward is the one
an NPU compile holds: torch_npu records a matmul's backward as one aten.matmul_backward
(npu_dispatch.py), which these forms match (`npu_only`).

The op's limits (capability row): fp16 / bf16; Atlas A2 (2, 4, 8 ranks) and A3 (2 to 32); x
2-D rows with k (the contracted dim) in [256, 65535); its default communication mode is
documented for training, comm_mode="aiv" for inference too, which torchair 2.13's GE
converter refuses on A2/A3: an inference graph fuses with comm_mode="aiv" except in
max-autotune.
"""
import torch

from npu_fx_fusion.capabilities import unsupported
from npu_fx_fusion.matching import Form, FusionPass, hcom_of, is_call, tensor_meta
from npu_fx_fusion.patterns._tensor_parallel import (describe, group_reason, k_range_reason, one_domain_reason,
                                                     same_dtype_reason, scenario_choice)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
OP = "npu.npu_all_gather_base_mm"


# ---- the unfused forms, as a compiled sequence-parallel model holds them ------------------------
def gather_then_matmul(x, weight_t, ranks, group_name):
    # all_gather_into_tensor on dim 0 (funcol.all_gather_tensor(x, 0, group)), then the linear
    # (x @ weight.T: `weight_t` the weight's transposed view, which a training step also saves);
    # the gathered input is also returned: other projections and the backward may read it
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, ranks, group_name))
    return gathered @ weight_t, gathered


def gather_sequence_then_matmul(x, weight_t, ranks, group_name):
    # the sequence dim of one sequence (batch 1): funcol's all_gather_tensor(x, 1, group) views
    # the rank-major (ranks, s, d) as (1, ranks * s, d) (_maybe_view_chunk_cat)
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, ranks, group_name))
    full = gathered.view(1, -1, x.shape[-1])
    return full @ weight_t, full


def gather_sequences_then_matmul(x, weight_t, ranks, group_name):
    # the sequence dim of a batch: funcol's chunk of the rank-major result and cat along dim 1
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, ranks, group_name))
    full = torch.cat(torch.chunk(gathered, ranks), dim=1)
    return full @ weight_t, full


# the backward of a row-parallel linear under SP, as an NPU compile records it: the incoming
# gradient's slices all-gathered, then one matmul_backward for the input's and the weight's
# gradients (matmul(a, b): a the saved input, b the weight's transposed view)
def gather_gradient_then_matmul_backward(grad, saved_rows, weight_t, ranks, group_name):
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(grad, ranks, group_name))
    return torch.ops.aten.matmul_backward(gathered, saved_rows, weight_t, [True, True])


def gather_sequence_gradient_then_matmul_backward(grad, saved, weight_t, ranks, group_name):
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(grad, ranks, group_name))
    full = gathered.view(1, -1, grad.shape[-1])
    return torch.ops.aten.matmul_backward(full, saved, weight_t, [True, True])


def gather_sequences_gradient_then_matmul_backward(grad, saved_sequences, weight_t, ranks, group_name):
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(grad, ranks, group_name))
    full = torch.cat(torch.chunk(gathered, ranks), dim=1)
    return torch.ops.aten.matmul_backward(full, saved_sequences, weight_t, [True, True])


# ---- the fused calls -------------------------------------------------------------------------
def _gather_mm(rows, weight_t, ranks, group_name, inference):
    """npu_all_gather_base_mm on 2-D rows; in an inference graph in comm_mode "aiv", the mode
    documented for inference (checks: _tensor_parallel.scenario_choice)."""
    mode = {"comm_mode": "aiv"} if inference else {}
    return torch.ops.npu.npu_all_gather_base_mm(rows, weight_t, hcom_of(group_name), ranks, **mode)


def _replacements(gather_rows, inference):
    """The fused call of a forward form: gather_rows(x, ranks) -> (x's rows in the order the
    op gathers them, a function from gathered rows of any width to the model's layout)."""

    def fused(x, weight_t, ranks, group_name):
        rows, arrange = gather_rows(x, ranks)
        out, gathered = _gather_mm(rows, weight_t, ranks, group_name, inference)
        return arrange(out), arrange(gathered)

    return fused


def _dim0(x, ranks):
    # gathered on dim 0: x's rows in order, the gathered tensor's rows rank-major
    return x.reshape(-1, x.shape[-1]), lambda rows: rows.view(ranks * x.shape[0], *x.shape[1:-1], rows.shape[-1])


def _one_sequence(x, ranks):
    return x.reshape(-1, x.shape[-1]), lambda rows: rows.view(1, -1, rows.shape[-1])


def _sequences(x, ranks):
    # (b, s, d) handed over sequence-major, (s, b, d) flattened: rank-major gathered rows are then
    # (ranks * s, b) in order, the whole batch's sequence dim; transposed back into the model's
    # contiguous layout (the gathered input may be saved for the backward, which reads it with
    # the strides it was traced with)
    batch, seq, width = x.shape
    rows = x.transpose(0, 1).reshape(seq * batch, width)
    return rows, lambda gathered: gathered.view(ranks * seq, batch, gathered.shape[-1]).transpose(0, 1).contiguous()


def _named(fn, name):
    fn.__name__ = name
    return fn


npu_all_gather_mm = _named(_replacements(_dim0, False), "npu_all_gather_mm")
npu_all_gather_mm_aiv = _named(_replacements(_dim0, True), "npu_all_gather_mm_aiv")
npu_all_gather_mm_sequence = _named(_replacements(_one_sequence, False), "npu_all_gather_mm_sequence")
npu_all_gather_mm_sequence_aiv = _named(_replacements(_one_sequence, True), "npu_all_gather_mm_sequence_aiv")
npu_all_gather_mm_sequences = _named(_replacements(_sequences, False), "npu_all_gather_mm_sequences")
npu_all_gather_mm_sequences_aiv = _named(_replacements(_sequences, True), "npu_all_gather_mm_sequences_aiv")


def _backward_replacement(gather_rows):
    def fused(grad, saved, weight_t, ranks, group_name):  # (saved: the form's saved_rows ... too)
        rows, arrange = gather_rows(grad, ranks)
        out, gathered = _gather_mm(rows, weight_t.t(), ranks, group_name, inference=False)
        # the weight's gradient from the gathered gradient, as matmul_backward folds it: the saved
        # input's rows against the gradient's rows in the model's order, one 2-D matmul
        full_grad = arrange(gathered)
        grad_weight = torch.matmul(saved.reshape(-1, saved.shape[-1]).t(), full_grad.reshape(-1, full_grad.shape[-1]))
        return arrange(out).view(saved.shape), grad_weight.view(weight_t.shape)

    return fused


npu_all_gather_mm_backward = _named(_backward_replacement(_dim0), "npu_all_gather_mm_backward")
npu_all_gather_mm_sequence_backward = _named(_backward_replacement(_one_sequence),
                                             "npu_all_gather_mm_sequence_backward")
npu_all_gather_mm_sequences_backward = _named(_backward_replacement(_sequences),
                                              "npu_all_gather_mm_sequences_backward")

# the rank counts the op takes (A3's too: the check refuses those of another SoC); one slice per
# rank makes the batch form's structure depend on the count
RANK_VARIANTS = [{"ranks": ranks, "saved_sequences": lambda dtype, ranks=ranks: torch.empty(3, 5 * ranks, 24, dtype=dtype)}
                 for ranks in (4, 8, 16, 32)]
# a 2-D x (tokens flattened): its matmul has no views; the gather on dim 0 only
FLAT_VARIANT = [{"x": lambda dtype: torch.empty(5, 24, dtype=dtype),
                 "grad": lambda dtype: torch.empty(5, 16, dtype=dtype),
                 "saved_rows": lambda dtype: torch.empty(10, 24, dtype=dtype)}]

FORMS = [
    Form(gather_then_matmul, npu_all_gather_mm_aiv, example_variants=FLAT_VARIANT),
    Form(gather_then_matmul, npu_all_gather_mm, example_variants=FLAT_VARIANT),
    Form(gather_sequence_then_matmul, npu_all_gather_mm_sequence_aiv, example_variants=()),
    Form(gather_sequence_then_matmul, npu_all_gather_mm_sequence, example_variants=()),
    Form(gather_sequences_then_matmul, npu_all_gather_mm_sequences_aiv, example_variants=RANK_VARIANTS),
    Form(gather_sequences_then_matmul, npu_all_gather_mm_sequences, example_variants=RANK_VARIANTS),
    Form(gather_gradient_then_matmul_backward, npu_all_gather_mm_backward, npu_only=True,
         example_variants=FLAT_VARIANT),
    Form(gather_sequence_gradient_then_matmul_backward, npu_all_gather_mm_sequence_backward, npu_only=True,
         example_variants=()),
    Form(gather_sequences_gradient_then_matmul_backward, npu_all_gather_mm_sequences_backward, npu_only=True,
         example_variants=RANK_VARIANTS),
]
INFERENCE_FORMS = (npu_all_gather_mm_aiv, npu_all_gather_mm_sequence_aiv, npu_all_gather_mm_sequences_aiv)


# ---- checks ---------------------------------------------------------------------------------------
def check(site):
    backward = "grad" in site.args
    x = site["grad"] if backward else site["x"]
    weight = site["weight_t"]
    group_name = site["group_name"]
    reason = (unsupported(OP, site.soc, x=x.flatten(0, -2))
              or same_dtype_reason(OP, x, weight)
              or k_range_reason(OP, x.shape[-1])
              or group_reason(OP, group_name, site.soc, site["ranks"])
              or scenario_choice(site, OP, site.form.replace in INFERENCE_FORMS))
    return reason or one_domain_reason(site, hcom_of(group_name))


# ---- near misses: an all-gather no form consumed ------------------------------------------------
def anchor(node):
    return is_call(node, c10d.all_gather_into_tensor.default)


def _matmul_users(node, depth=3):
    """The matmuls reading `node`, through the waits, views, slices and cats of its reassembly."""
    found = []
    for user in node.users:
        if is_call(user, aten.mm.default, aten.matmul.default, aten.addmm.default, aten.matmul_backward.default):
            found.append(user)
        elif depth and is_call(user, c10d.wait_tensor.default, aten.view.default, aten.reshape.default,
                               aten.slice.Tensor, aten.cat.default, aten._unsafe_view.default):
            found += _matmul_users(user, depth - 1)
    return found


def explain(all_gather):
    matmuls = _matmul_users(all_gather, depth=5)
    if not matmuls:
        users = [describe(u) for u in all_gather.users]
        return f"the gathered tensor feeds no matmul (it is read by {', '.join(users) or 'nothing'})"
    if any(is_call(m, aten.addmm.default) for m in matmuls):
        return f"the matmul reading the gathered tensor adds a bias: {OP} does not support a nonzero bias"
    shard = tensor_meta(all_gather.args[0])
    waited = [u for u in all_gather.users if is_call(u, c10d.wait_tensor.default)]
    views = [v for w in waited for v in w.users if is_call(v, aten.view.default)]
    if any(is_call(u, aten.slice.Tensor) for v in views for u in v.users):
        return ("the gathered sequence is sliced back to the model's length before the matmul: DTensor pads a "
                "sequence the ranks may not divide evenly (dynamic shapes), and the padding rows would need "
                "the fused output sliced too; not matched in this version")
    if shard is not None and shard.dim() > 3:
        return f"the gathered shard has {shard.dim()} dims: only 2-D and 3-D ones (sequence parallel) are matched"
    return ("the gathered tensor reaches a matmul, but not as a gather on dim 0, the one-sequence view or the "
            "concatenation of per-rank slices along the sequence dim (funcol.all_gather_tensor), nor as the "
            "input of matmul_backward (in a backward: the gathered gradient, not the weight's gradient)")


PASS = FusionPass(
    name="all_gather_matmul",
    fused_op=OP,
    forms=FORMS,
    example={
        # a shard of 3 sequences of 5 tokens, width k 24, against an (n 16, k 24) weight, transposed
        # (weight_t (24, 16), a view); in the backward the gradient of that output (width 16)
        # against the same weight_t. 2 ranks: no other 2 (or 4, 8, 16, 32) in the traces, the
        # rank count's value marks it there
        "x": lambda dtype: torch.empty(3, 5, 24, dtype=dtype),
        "ranks": 2,
        "group_name": "tp_group_example",
        # the saved input of the forward linear (24 -> 16): (6, 5, 24) for a gather on dim 0, one
        # sequence (1, 30, 24), 3 sequences of the 2 ranks' 5 tokens (3, 10, 24)
        "grad": lambda dtype: torch.empty(3, 5, 16, dtype=dtype),
        "saved_rows": lambda dtype: torch.empty(6, 5, 24, dtype=dtype),
        "saved": lambda dtype: torch.empty(1, 30, 24, dtype=dtype),
        "saved_sequences": lambda dtype: torch.empty(3, 10, 24, dtype=dtype),
        "weight_t": lambda dtype: torch.empty(16, 24, dtype=dtype).t(),
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (c10d.all_gather_into_tensor.default,),
    explain=explain,
)
