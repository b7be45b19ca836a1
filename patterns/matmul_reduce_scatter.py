"""matmul_reduce_scatter: a matmul whose partial sums are reduce-scattered -> torch.ops.npu.npu_mm_reduce_scatter_base.

    y = x @ weight.T                            # a row-parallel linear: k sharded over the ranks
    y = reduce_scatter(y, "sum", group, dim)    # its partial sums, summed, each rank keeping a slice
 -> y = npu_mm_reduce_scatter_base(x, weight.T, hcom, ranks)

With sequence parallel (torch.distributed.tensor.parallel's RowwiseParallel with Shard(1)
output, torchtitan's `wo` and `w2` with SP), the row-parallel projections end the block by
reduce-scattering their partial sums over the sequence. A compiled graph records
funcol.reduce_scatter_tensor: for a scatter along dim 1, the slices of dim 1 concatenated on
dim 0 first (one per rank), then `_c10d_functional.reduce_scatter_tensor` + `wait_tensor`.
The MC2 kernel reduce-scatters the rows of a 2-D x1 @ x2 (rank r keeps the r-th block of
rows), each tile's transfer overlapping the next tile's matmul.

Exactness: a matmul acts row by row, so the rows only have to reach the kernel in the order
the model scatters them. Dim 0: x's rows, flattened, in order. Dim 1 (the sequence): x handed
over sequence-major (x.transpose(0, 1): a copy for a batch, a view for one sequence), so each
rank's block of rows is its slice of every sequence, transposed back into the model's layout
(again a copy for a batch only).

In a training step's backward, the gradient of a column-parallel linear under SP is the same
shape: matmul_backward's input gradient, reduce-scattered over the sequence. It becomes
npu_mm_reduce_scatter_base on the incoming gradient and the weight, and the weight's gradient a
plain matmul, as matmul_backward computes it (the forms match the backward an NPU compile
holds: torch_npu records it as aten.matmul_backward, `npu_only`). Where the reduce-scatter sums
the input gradients of two projections (SwiGLU's w1 and w3), it reads their sum, not a
matmul: a near miss.

The op's limits (capability row): fp16 / bf16; Atlas A2 (2, 4, 8 ranks) and A3 (2 to 32); x
2-D rows, their number divisible by the ranks, k in [256, 65535); the default communication
mode is documented for training only, comm_mode="aiv" for inference too, which torchair 2.13's
GE converter refuses on A2/A3: an inference graph fuses with comm_mode="aiv" except in
max-autotune.
"""
import operator

import torch

from npu_fx_fusion.capabilities import unsupported
from npu_fx_fusion.matching import Form, FusionPass, hcom_of, is_call, tensor_meta
from npu_fx_fusion.patterns._tensor_parallel import (describe, group_reason, k_range_reason, one_domain_reason,
                                                     same_dtype_reason, scenario_choice)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
OP = "npu.npu_mm_reduce_scatter_base"


# ---- the unfused forms, as a compiled sequence-parallel model holds them -----------------------
def matmul_then_reduce_scatter(x, weight_t, ranks, group_name):
    # the row-parallel linear (x @ weight.T: `weight_t` the weight's transposed view, which a training
    # step also saves), then funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group)
    y = x @ weight_t
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", ranks, group_name))


def matmul_then_reduce_scatter_sequence(x, weight_t, ranks, group_name):
    # funcol.reduce_scatter_tensor(y, "sum", scatter_dim=1, group): dim 1's slices stacked on dim 0
    y = x @ weight_t
    y = torch.cat(torch.chunk(y, ranks, dim=1))
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", ranks, group_name))


# the backward of a column-parallel linear under SP, as an NPU compile records it: one
# matmul_backward (matmul(a, b): a the saved input, b the weight's transposed view), its input
# gradient reduce-scattered over the sequence
def matmul_backward_then_reduce_scatter(grad, saved, weight_t, ranks, group_name):
    grad_in, grad_weight = torch.ops.aten.matmul_backward(grad, saved, weight_t, [True, True])
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad_in, "sum", ranks, group_name)), grad_weight


def matmul_backward_then_reduce_scatter_sequence(grad, saved, weight_t, ranks, group_name):
    grad_in, grad_weight = torch.ops.aten.matmul_backward(grad, saved, weight_t, [True, True])
    grad_in = torch.cat(torch.chunk(grad_in, ranks, dim=1))
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad_in, "sum", ranks, group_name)), grad_weight


# ---- the fused calls -------------------------------------------------------------------------------
def _mm_reduce_scatter(rows, weight_t, ranks, group_name, inference):
    """npu_mm_reduce_scatter_base on 2-D rows; in an inference graph in comm_mode "aiv", the
    mode documented for inference (checks: _tensor_parallel.scenario_choice)."""
    mode = {"comm_mode": "aiv"} if inference else {}
    return torch.ops.npu.npu_mm_reduce_scatter_base(rows, weight_t, hcom_of(group_name), ranks, **mode)


def _dim0(x, ranks):
    # rank r keeps the r-th block of x's rows, flattened: its slice of dim 0
    return x.reshape(-1, x.shape[-1]), lambda rows: rows.view(x.shape[0] // ranks, *x.shape[1:-1], rows.shape[-1])


def _sequence(x, ranks):
    # (b, s, k) handed over sequence-major: rank r's block of rows is its s / ranks tokens of every
    # sequence, (s / ranks, b) in order; transposed back into the model's contiguous layout (for
    # one sequence neither transpose copies)
    batch, seq, width = x.shape
    rows = x.transpose(0, 1).reshape(seq * batch, width)
    return rows, lambda out: out.view(seq // ranks, batch, out.shape[-1]).transpose(0, 1).contiguous()


def _forward_replacement(scatter_rows, inference, name):
    def fused(x, weight_t, ranks, group_name):
        rows, arrange = scatter_rows(x, ranks)
        return arrange(_mm_reduce_scatter(rows, weight_t, ranks, group_name, inference))

    fused.__name__ = name
    return fused


def _backward_replacement(scatter_rows, name):
    def fused(grad, saved, weight_t, ranks, group_name):
        rows, arrange = scatter_rows(grad, ranks)
        grad_in = arrange(_mm_reduce_scatter(rows, weight_t.t(), ranks, group_name, inference=False))
        # the weight's gradient, as matmul_backward folds it: the saved input's rows against the
        # gradient's, one 2-D matmul
        grad_weight = torch.matmul(saved.reshape(-1, saved.shape[-1]).t(), grad.reshape(-1, grad.shape[-1]))
        return grad_in, grad_weight.view(weight_t.shape)

    fused.__name__ = name
    return fused


npu_mm_reduce_scatter = _forward_replacement(_dim0, False, "npu_mm_reduce_scatter")
npu_mm_reduce_scatter_aiv = _forward_replacement(_dim0, True, "npu_mm_reduce_scatter_aiv")
npu_mm_reduce_scatter_sequence = _forward_replacement(_sequence, False, "npu_mm_reduce_scatter_sequence")
npu_mm_reduce_scatter_sequence_aiv = _forward_replacement(_sequence, True, "npu_mm_reduce_scatter_sequence_aiv")
npu_mm_reduce_scatter_backward = _backward_replacement(_dim0, "npu_mm_reduce_scatter_backward")
npu_mm_reduce_scatter_sequence_backward = _backward_replacement(_sequence, "npu_mm_reduce_scatter_sequence_backward")

# the rank counts the op takes (A3's too: the check refuses those of another SoC): one slice per
# rank makes the sequence forms' structure depend on the count
RANK_VARIANTS = [{"ranks": ranks} for ranks in (4, 8, 16, 32)]
# a 2-D x (tokens flattened): its matmul has no views
FLAT_VARIANT = [{"x": lambda dtype: torch.empty(96, 16, dtype=dtype),
                 "grad": lambda dtype: torch.empty(96, 24, dtype=dtype),
                 "saved": lambda dtype: torch.empty(96, 16, dtype=dtype)}]

FORMS = [
    Form(matmul_then_reduce_scatter, npu_mm_reduce_scatter_aiv, example_variants=FLAT_VARIANT),
    Form(matmul_then_reduce_scatter, npu_mm_reduce_scatter, example_variants=FLAT_VARIANT),
    Form(matmul_then_reduce_scatter_sequence, npu_mm_reduce_scatter_sequence_aiv, example_variants=RANK_VARIANTS),
    Form(matmul_then_reduce_scatter_sequence, npu_mm_reduce_scatter_sequence, example_variants=RANK_VARIANTS),
    Form(matmul_backward_then_reduce_scatter, npu_mm_reduce_scatter_backward, npu_only=True,
         example_variants=FLAT_VARIANT),
    Form(matmul_backward_then_reduce_scatter_sequence, npu_mm_reduce_scatter_sequence_backward, npu_only=True,
         example_variants=RANK_VARIANTS),
]
INFERENCE_FORMS = (npu_mm_reduce_scatter_aiv, npu_mm_reduce_scatter_sequence_aiv)


# ---- checks ---------------------------------------------------------------------------------------
def check(site):
    backward = "grad" in site.args
    x = site["grad"] if backward else site["x"]
    weight = site["weight_t"]
    ranks, group_name = site["ranks"], site["group_name"]
    rows = x.flatten(0, -2)
    reason = (unsupported(OP, site.soc, x=rows)
              or same_dtype_reason(OP, x, weight)
              or k_range_reason(OP, x.shape[-1])
              or group_reason(OP, group_name, site.soc, site["ranks"])
              or (f"{rows.shape[0]} rows are not divisible by the {ranks} ranks ({OP}: m轴需要整除world_size)"
                  if rows.shape[0] % ranks else None)
              or scenario_choice(site, OP, site.form.replace in INFERENCE_FORMS))
    return reason or one_domain_reason(site, hcom_of(group_name))


# ---- near misses: a reduce-scatter no form consumed ----------------------------------------------
def anchor(node):
    return is_call(node, c10d.reduce_scatter_tensor.default)


def _scattered_source(node):
    """What the reduce-scatter reads, through the concatenation of per-rank slices and views;
    and the nodes of that reassembly."""
    between = []
    if is_call(node, aten.cat.default) and node.args[0] and all(is_call(p, aten.slice.Tensor) for p in node.args[0]):
        between += [node, *node.args[0]]
        node = node.args[0][0].args[0]
    while is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        between.append(node)
        node = node.args[0]
    return node, between


def explain(reduce_scatter):
    if reduce_scatter.args[1] != "sum":
        return f"the reduce-scatter computes {reduce_scatter.args[1]!r}: {OP} sums"
    source, between = _scattered_source(reduce_scatter.args[0])
    if is_call(source, aten.add.Tensor):
        return (f"the reduce-scatter reads a sum ({describe(source)}), not a matmul: the input gradients of two "
                "projections of one input (SwiGLU's w1 and w3), which would need two reduce-scatters fused")
    if is_call(source, aten.addmm.default):
        return f"the matmul adds a bias before the reduce-scatter: {OP} does not support a nonzero bias"
    matmul = source.args[0] if is_call(source, operator.getitem) else source
    if not is_call(matmul, aten.mm.default, aten.matmul.default, aten.matmul_backward.default):
        return f"the reduce-scattered tensor is computed by {describe(source)}, not a matmul"
    meta = tensor_meta(source)
    if meta is not None and meta.dim() > 3:
        return f"the matmul's output has {meta.dim()} dims: only 2-D and 3-D ones (sequence parallel) are matched"
    elsewhere = [describe(user) for user in source.users if user not in between]
    if elsewhere:
        return f"the matmul's output is also read by {', '.join(elsewhere)}, not only reduce-scattered"
    return None



PASS = FusionPass(
    name="matmul_reduce_scatter",
    fused_op=OP,
    forms=FORMS,
    example={
        # 6 sequences of 96 tokens of width k 16 against an (n 24, k 16) weight, transposed (weight_t
        # (16, 24), a view); in the backward the gradient of that output (width 24) and the saved
        # input. 2 ranks scatter dim 1 in slices of 48 tokens (no other 2, 4, 8, 16 or 32 in the
        # traces: the rank count's value marks it there)
        "x": lambda dtype: torch.empty(6, 96, 16, dtype=dtype),
        "ranks": 2,
        "group_name": "tp_group_example",
        "grad": lambda dtype: torch.empty(6, 96, 24, dtype=dtype),
        "saved": lambda dtype: torch.empty(6, 96, 16, dtype=dtype),
        "weight_t": lambda dtype: torch.empty(24, 16, dtype=dtype).t(),
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (c10d.reduce_scatter_tensor.default,),
    explain=explain,
)
