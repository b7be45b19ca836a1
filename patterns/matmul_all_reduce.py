"""matmul_all_reduce: a matmul whose partial sums are all-reduced -> torch.ops.npu.npu_mm_all_reduce_base.

    y = x @ weight.T                       # a row-parallel linear: k is sharded over the ranks
    y = all_reduce(y, "sum", group)        # its partial sums, summed: Partial -> Replicate
 -> y = npu_mm_all_reduce_base(x, weight.T, hcom)

torch.distributed.tensor.parallel's RowwiseParallel (torchtitan's `wo` and `w2` without
sequence parallel) compiles to exactly this: the local matmul, then the functional
all-reduce the output's redistribution records (`_c10d_functional.all_reduce` + `wait_tensor`).
One MC2 kernel computes the matmul tile by tile and all-reduces each tile while the next is
computed.

The op's limits (capability row): fp16 / bf16; Atlas A2 only; 1, 2, 4 or 8 ranks; x 2-D or
3-D; inference only (no backward). Its `hcom` is the HCCL communicator of the collective's
process group (matching.hcom_of); on CPU the reference kernel all-reduces over that gloo
group, so the fused graph equals the unfused one bit for bit there (npu_ops/collectives.py).

When the all-reduced sum feeds a residual add and an RMSNorm (the decoder layer's
`h = x + attention(...)`, `ffn_norm(h)`), add_rms_norm turns the add and the norm into
npu_add_rms_norm after the rms_norm pass: npu_mm_all_reduce_base + npu_add_rms_norm is the
exact chain. torch_npu 2.13 has no op that also folds in the add and the norm (CANN's
MatmulAllReduceAddRmsNorm is reached through vllm-ascend's own extension, not torch_npu), and
the op's x3 cannot carry the residual: it is added inside the all-reduce (aclnnMatmulAllReduceV2:
allreduce(x1 @ x2 + bias + x3)), so it would be summed once per rank.
"""
import operator

import torch

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import Form, FusionPass, hcom_of, is_call, is_training_graph, tensor_meta
from npu_fx_fusion.patterns._tensor_parallel import (describe, group_reason, one_domain_reason, same_dtype_reason,
                                                     training_only_reason)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
OP = "npu.npu_mm_all_reduce_base"


# ---- the unfused form, as a compiled tensor-parallel model holds it ---------------------------
def matmul_then_all_reduce(x, weight_t, group_name):
    # RowwiseParallel: the local linear over this rank's k shard (x @ weight.T: `weight_t` is the
    # weight's transposed view, which a training step also saves for its backward), then
    # funcol.all_reduce(y, "sum", group), which a compiled graph records as the collective and its wait
    y = x @ weight_t
    return c10d.wait_tensor(c10d.all_reduce(y, "sum", group_name))


# ---- the fused call -----------------------------------------------------------------------------
def npu_mm_all_reduce(x, weight_t, group_name):
    # x as rows (a view of the contiguous activations: the op takes x1 untransposed), the (k, n)
    # operand as x2, which the op takes transposed or not
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.npu.npu_mm_all_reduce_base(rows, weight_t, hcom_of(group_name))
    return y.view(*x.shape[:-1], weight_t.shape[1])


FORMS = [Form(matmul_then_all_reduce, npu_mm_all_reduce)]


# ---- checks ---------------------------------------------------------------------------------------
def check(site):
    x, weight, group_name = site["x"], site["weight_t"], site["group_name"]
    if is_training_graph(site.nodes[0].graph):
        return training_only_reason(OP)
    reason = (unsupported(OP, site.soc, x=x) or same_dtype_reason(OP, x, weight)
              or group_reason(OP, group_name, site.soc))
    if reason:
        return reason
    if x.dim() == 3 and x.shape[1] == 1:
        site.notes.append(f"one token per sequence (a decode step): {CAPABILITIES[OP].limits['decode_note']}")
    return one_domain_reason(site, hcom_of(group_name))


# ---- near misses: an all-reduce no form consumed -----------------------------------------------
def anchor(node):
    return is_call(node, c10d.all_reduce.default)


def explain(all_reduce):
    reduced, op = all_reduce.args[0], all_reduce.args[1]
    if op != "sum":
        return f"the all-reduce computes {op!r}: {OP} sums"
    source = reduced
    while is_call(source, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        source = source.args[0]
    if is_call(source, operator.getitem) and is_call(source.args[0], aten.matmul_backward.default):
        # a column-parallel linear's input gradient, all-reduced in a training step's backward
        return training_only_reason(OP)
    if not is_call(source, aten.mm.default, aten.matmul.default, aten.addmm.default):
        return (f"the all-reduced tensor is computed by {describe(source)}, not a matmul (an embedding's "
                "partial sums, a sum of gradients)")
    if is_call(source, aten.addmm.default):
        # (DTensor hands a row-parallel linear's bias in as a Partial: the op's bias would take it,
        # allreduce(x1 @ x2 + bias); no form for it in this version)
        return "the matmul adds a bias before the all-reduce (addmm): not matched in this version"
    meta = tensor_meta(source)
    if meta is not None and meta.dim() > 3:
        return f"the matmul's output has {meta.dim()} dims: {OP} takes x 2-D or 3-D"
    if len(reduced.users) > 1 or (reduced is not source and len(source.users) > 1):
        return "the matmul's output is used elsewhere too, not only all-reduced"
    return None


PASS = FusionPass(
    name="matmul_all_reduce",
    fused_op=OP,
    forms=FORMS,
    example={
        # (batch 2, 3 tokens, k 16) rows against an (n 8, k 16) weight as nn.Linear stores it,
        # transposed (a view)
        "x": lambda dtype: torch.empty(2, 3, 16, dtype=dtype),
        "weight_t": lambda dtype: torch.empty(8, 16, dtype=dtype).t(),
        "group_name": "tp_group_example",
    },
    # a 2-D x (tokens flattened by the model) traces without the views of the 3-D matmul
    example_variants=[{"x": lambda dtype: torch.empty(6, 16, dtype=dtype)}],
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (c10d.all_reduce.default,),  # (the op exists in builds with torch.distributed)
    explain=explain,
)
