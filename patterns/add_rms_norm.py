"""add_rms_norm: residual add feeding an RMSNorm -> torch.ops.npu.npu_add_rms_norm.

    h = x + residual          # the decoder layer's residual stream, used again later
    y = npu_rms_norm(h, w)    # produced by the rms_norm pass (or called by the model)
 -> y, _, h = npu_add_rms_norm(x, residual, w)

One kernel reads x and residual once and writes both h and y. It works on npu_rms_norm
calls, so the rms_norm pass (which runs first) turns every RMSNorm form into one and this
pass needs no form of its own per RMSNorm spelling.

A residual kept in fp32 with a bf16 / fp16 sublayer output (type promotion adds them in fp32)
fuses as an fp32 npu_add_rms_norm of both cast to fp32: the conversion promotion does, made
explicit (the op takes x1 and x2 of one dtype).

Numerics (op_semantics.md 2.2): in bf16 the kernel computes rstd from the fp32 sum before
rounding it to h, where the unfused graph normalises the rounded h: at most one ulp of
bf16 apart. fp16 and fp32 match the unfused order. npu_add_rms_norm has no backward in
torch_npu, so the pass has no joint forms: it runs on inference graphs and on a training
step's forward graph after partitioning, where npu_rms_norm_backward reads the rstd and h
the forward saved, now from the fused op (its rstd: the same fp32 normaliser, from the
unrounded sum in bf16).
"""
import operator

import torch

from npu_fx_fusion.capabilities import not_lowerable, unsupported
from npu_fx_fusion.matching import RESHAPES, FinishOptions, Form, FusionPass, is_call, plain_cast, tensor_meta

aten = torch.ops.aten
CAST_OP = "npu.npu_add_rms_norm_cast"


def residual_add_then_norm(x, residual, weight, eps):
    h = x + residual
    return torch.ops.npu.npu_rms_norm(h, weight, eps)[0], h


def residual_add_then_norm_default_eps(x, residual, weight):
    # eps equal to the schema default (1e-6) is left out of the traced call
    h = x + residual
    return torch.ops.npu.npu_rms_norm(h, weight)[0], h


# A training step's forward graph saves the norm's rstd for npu_rms_norm_backward; the
# fused op returns the same fp32 rstd (op_semantics.md 2.2), so the site folds the add too.
def residual_add_then_norm_keeping_rstd(x, residual, weight, eps):
    h = x + residual
    y, rstd = torch.ops.npu.npu_rms_norm(h, weight, eps)
    return y, rstd, h


def residual_add_then_norm_keeping_rstd_default_eps(x, residual, weight):
    h = x + residual
    y, rstd = torch.ops.npu.npu_rms_norm(h, weight)
    return y, rstd, h


def _in_sum_dtype(x, residual):
    """x and residual in the dtype of their sum. A bf16 sublayer output added to a residual
    stream kept in fp32 (vLLM's RMSNorm.forward_native, models that keep the residual in
    fp32) is widened by type promotion; the op takes one dtype, and the explicit cast is the
    same exact conversion (no node where the dtypes agree)."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


def npu_add_rms_norm(x, residual, weight, eps):
    y, _, h = torch.ops.npu.npu_add_rms_norm(*_in_sum_dtype(x, residual), weight, eps)
    return y, h


def npu_add_rms_norm_default_eps(x, residual, weight):
    y, _, h = torch.ops.npu.npu_add_rms_norm(*_in_sum_dtype(x, residual), weight)
    return y, h


def npu_add_rms_norm_keeping_rstd(x, residual, weight, eps):
    return torch.ops.npu.npu_add_rms_norm(*_in_sum_dtype(x, residual), weight, eps)


def npu_add_rms_norm_keeping_rstd_default_eps(x, residual, weight):
    return torch.ops.npu.npu_add_rms_norm(*_in_sum_dtype(x, residual), weight)


FORMS = [
    Form(residual_add_then_norm, npu_add_rms_norm),
    Form(residual_add_then_norm_default_eps, npu_add_rms_norm_default_eps),
    Form(residual_add_then_norm_keeping_rstd, npu_add_rms_norm_keeping_rstd),
    Form(residual_add_then_norm_keeping_rstd_default_eps, npu_add_rms_norm_keeping_rstd_default_eps),
]


def _computed_from(node, matched, limit=64):
    """The first of `matched` that `node` is computed from (a bounded walk up its inputs), or None."""
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        current = todo.pop()
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        if current in matched:
            return current
        seen.add(current)
        todo.extend(current.all_input_nodes)
    return None


def check(site):
    # npu_add_rms_norm computes the sum itself, so its gamma must exist before the sum does.
    # A gamma computed from the sum would make the fused op its own input: a cycle (found by
    # tests/fuzz_cases.py; it raised in the graph's topological sort and the whole pass was
    # reverted). The unit weight of a weightless norm, ones(h.shape[-1:]), is not one: its
    # symbolic size is read from the graph's inputs (canonical.size_reads_from_inputs).
    matched = set(site.nodes) - {n for n in site.arg_nodes.values() if isinstance(n, torch.fx.Node)}
    source = _computed_from(site.arg_nodes.get("weight"), matched)
    if source is not None:
        return (f"the norm's weight is computed from the residual sum {source.name}: npu_add_rms_norm "
                "takes the weight as an input of the sum it computes")
    x, residual = site["x"], site["residual"]
    if x.dtype != residual.dtype:  # the replacement widens the narrower one (_in_sum_dtype)
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = torch.empty_like(x, dtype=dtype), torch.empty_like(residual, dtype=dtype)
        site.notes.append(f"the {str(site['x'].dtype)[6:]} and {str(site['residual'].dtype)[6:]} operands are added in "
                          f"{str(dtype)[6:]} (type promotion): the op takes both cast to it, exactly")
    return unsupported("npu.npu_add_rms_norm", site.soc, x=x, gamma=site["weight"], x1=x, x2=residual)


def anchor(node):
    return is_call(node, torch.ops.npu.npu_rms_norm.default) and is_call(node.args[0], aten.add.Tensor)


def explain(norm):
    add = norm.args[0]
    if add.kwargs.get("alpha", 1) != 1:
        return f"the add scales its second operand (alpha={add.kwargs['alpha']})"
    operands = [tensor_meta(a) for a in add.args[:2]]
    if any(t is None for t in operands):
        return "one operand of the add is a scalar, not a residual tensor"
    return None


# ---- after the sites are fused: y also read in fp32 ------------------------------------------
# A router that computes its logits in fp32 (DeepSeek's `F.linear(x.float(), w.float())`)
# reads the norm's output through a cast: a launch that reads y and writes it widened.
# npu_add_rms_norm_cast writes that fp32 copy with y, in the same kernel: torchair's own
# pattern rule does this rewrite (torchair/patterns/add_rms_norm_cast.py), but only where y
# has one other reader and the copy one, which a router next to the experts' dispatch is not.
# The fp32 output is y widened ([inferred]: npu_ops/norm.py), so keep_intermediate_rounding
# leaves the cast as it is.

def norm_output_in_fp32_too(graph, options=FinishOptions()):
    """npu_add_rms_norm whose y is cast to fp32 (through views) -> npu_add_rms_norm_cast,
    where the SoC and mode allow it. Returns a note per call."""
    if options.keep_intermediate_rounding:
        return []
    notes = []
    for call in graph.find_nodes(op="call_function", target=torch.ops.npu.npu_add_rms_norm.default):
        outputs = {user.args[1]: user for user in call.users if is_call(user, operator.getitem)}
        if 0 not in outputs:
            continue
        widened = _widening_reads(outputs[0])
        x1, gamma = tensor_meta(call.args[0]), tensor_meta(call.args[2])
        if not widened or x1 is None or gamma is None:
            continue
        if (unsupported(CAST_OP, options.soc, x=x1, gamma=gamma, x1=x1, x2=tensor_meta(call.args[1]))
                or not_lowerable(CAST_OP, options.mode)):
            continue
        y, rstd, x_out = call.meta["val"]
        with graph.inserting_before(call):
            fused = graph.call_function(torch.ops.npu.npu_add_rms_norm_cast.default, call.args, call.kwargs)
            in_fp32 = graph.call_function(operator.getitem, (fused, 0))
        fused.meta["val"] = (torch.empty_like(y, dtype=torch.float32), y, rstd, x_out)
        in_fp32.meta["val"] = fused.meta["val"][0]
        for index, getter in outputs.items():  # y, rstd, x_out move one place along
            getter.update_arg(0, fused)
            getter.update_arg(1, index + 1)
        for views, cast in widened:
            source = in_fp32
            with graph.inserting_before(cast):
                for view in views:
                    source = graph.call_function(view.target, (source, *view.args[1:]), view.kwargs)
                    source.meta["val"] = tensor_meta(view).to(torch.float32)
            cast.replace_all_uses_with(source)
            graph.erase_node(cast)
            for view in reversed(views):
                if not view.users:
                    graph.erase_node(view)
        graph.erase_node(call)
        notes.append(f"{fused.name}: writes y in fp32 too, for {', '.join(c.name for _, c in widened)}")
    return notes


def _widening_reads(y):
    """[(views, cast)]: each conversion of y to fp32, and the views of y it reads through."""
    found, todo = [], [(y, [])]
    while todo:
        node, views = todo.pop()
        for user in node.users:
            if is_call(user, *RESHAPES):
                todo.append((user, [*views, user]))
            elif plain_cast(user, torch.float32):
                found.append((views, user))
    return found


PASS = FusionPass(
    name="add_rms_norm",
    # it folds a residual add into the npu_rms_norm calls rms_norm produces
    after=("rms_norm",),
    fused_op="npu.npu_add_rms_norm",
    forms=FORMS,
    example={
        "x": lambda dtype: torch.empty(2, 3, 8, dtype=dtype),
        "residual": lambda dtype: torch.empty(2, 3, 8, dtype=dtype),
        "weight": lambda dtype: torch.empty(8, dtype=dtype),
        "eps": 2.0**-17,
    },
    check=check,
    anchor=anchor,
    anchor_ops=lambda: (getattr(torch.ops.npu, "npu_rms_norm", None),),  # None before the stand-ins load
    explain=explain,
    finish=norm_output_in_fp32_too,
)
