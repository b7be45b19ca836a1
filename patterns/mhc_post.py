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

Other spellings of the same mix (torchtitan-npu's HcPost: a broadcast product summed over the
streams in fp32, rounded once; einsum; a comb stored the other way round; tokens flattened to
(T, n, D)) are recognised by what they compute (`recognize`, below) and fused, in training too: their
backward is the joint graph's nodes autograd made for the region (regions.backward_region),
replaced by the op's backward (`_recognized_gradient`).

Training: npu_mhc_post differentiates at the dispatcher (NpuMhcPostBackward0); the COT op by
the extension's Python MhcPostFunction, mirrored by MhcPost below (mhc_post_backward).
"""
import math

import torch

from npu_fx_fusion.capabilities import CAPABILITIES, only_on, unsupported
from npu_fx_fusion.matching import (MOVES, AxisEvaluation, Form, FusionPass, NotEvaluable, Recognized, atom_sizes,
                                    atoms_of, backward_nodes_by_seq, backward_region, enclosed_region, is_backward,
                                    is_call, is_cast, known_equal, rearrange, rearrange_gradient, strip_casts,
                                    tensor_meta)

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


# ---- the mix recognised by what it computes ----------------------------------------------------
# Other codebases spell the same mix in other layouts: torchtitan-npu's HcPost sums a broadcast
# product over the streams (`torch.sum(comb.unsqueeze(-1) * X.unsqueeze(-2), dim=2)`, in fp32,
# rounded once by `type_as`), einsum("bsjk,bsjd->bskd", comb, X), `comb @ X` of a comb stored
# the other way round. The region that ends in the add is evaluated over index atoms
# (axis_algebra.py) and fused when it is
#     Y[b, k, d] = post[b, k] * o[b, d] + sum_j comb[b, j, k] * X[b, j, d]
# with every index in its role: j summed, shared only by comb and X; k the streams of comb and
# post; d the channels of X and o; b the rest, shared by all (several atoms: (B, S) or one
# token dim T). The roles come from which tensor holds which index, never from sizes. The
# inputs are read as they are and rearranged into the op's (B, S, n, D) layouts, so a comb
# indexed [k, j] is passed transposed, as the op's h_res is indexed [j, k].
_PRODUCTS = (aten.mul.Tensor, aten.bmm.default, aten.matmul.default, aten.mm.default)


def _mix_operands(add):
    """The nodes the algebra reads as the region's leaves: for each operand of the add, the
    inputs of its product (a mul, bmm, matmul or mm, optionally under one sum), through
    layout ops and casts; None when an operand is neither a product nor a summed product
    (a residual add of a projection's output and a graph input)."""
    stops, contractions = set(), 0
    for operand in add.args[:2]:
        if not isinstance(operand, torch.fx.Node):
            return None
        pending, state = [(operand, "top")], None
        found_product = False
        while pending:
            node, state = pending.pop()
            if is_call(node, *MOVES) or is_cast(node):
                pending.append((node.args[0], state))
            elif state != "product" and is_call(node, *_PRODUCTS):
                found_product = True
                contractions += not is_call(node, aten.mul.Tensor)
                pending += [(a, "product") for a in node.args[:2] if isinstance(a, torch.fx.Node)]
            elif state == "top" and is_call(node, aten.sum.dim_IntList):
                contractions += 1
                pending.append((node.args[0], "sum"))
            elif state == "product":
                stops.add(node)
            else:
                return None
        if not found_product:
            return None
    return stops if contractions else None


def recognize(graph, joint):
    found = []
    by_seq = None  # (read only where a mix is recognised: a walk over the whole joint graph)
    for add in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        meta = tensor_meta(add)
        if (joint and is_backward(add)) or meta is None or meta.dim() < 3 or not meta.is_floating_point():
            continue
        if add.kwargs.get("alpha", 1) != 1:
            continue
        stops = _mix_operands(add)
        if stops is None:
            continue
        output = _rounded(add)
        try:
            value = AxisEvaluation(stop=stops).value(output)
            readings = _readings(value)
        except NotEvaluable:
            continue
        if isinstance(readings, str):
            found.append(Recognized("streams mix (axis algebra)", output, [add], reason=readings))
            continue
        if by_seq is None:
            by_seq = backward_nodes_by_seq(graph) if joint else {}
        for reading in readings:
            found.extend(_sites(reading, value, output, [output] if output is add else [output, add], by_seq))
    return found


def _rounded(add):
    """Where the mix is rounded once to the streams' dtype (HcPost's type_as), through the moves
    only it reads (a streams-first layout transposed back): that cast, else the add itself."""
    node = add
    while len(node.users) == 1:
        user = next(iter(node.users))
        if is_cast(user):
            return user
        if not is_call(user, *MOVES):
            break
        node = user
    return add


def _readings(value):
    """The ways the value reads as post * o + sum_j comb * X: [(x, o, post, comb, batch, j, k, d)]
    (role expressions and atoms), why a summed product of the streams is not that mix, or []
    for a value that is no sum of a product and a summed product."""
    top = strip_casts(value.expr)
    if top.op != "add" or len(top.args) != 2:
        return []
    terms = [strip_casts(t) for t in top.args]
    mixes = [t for t in terms if t.op == "sum" and len(t.args) == 1 and t.args[0].op == "mul"
             and len(t.args[0].args) == 2]
    if len(mixes) != 1:
        return []
    mix = mixes[0]
    product = terms[1 - terms.index(mix)]
    if product.op != "mul" or len(product.args) != 2 or product.contains("sum"):
        return []
    if len(mix.atoms) != 1:
        return []  # a contraction over several indices: no mix of streams by one matrix
    (j,) = mix.atoms
    out = set(atoms_of(value.dims))
    factors = [strip_casts(f) for f in mix.args[0].args]
    if not all(j in f.free for f in factors):
        return []  # a sum over an index of one factor only: no contraction, no mix of streams
    outer = [strip_casts(f) for f in product.args]
    readings, unequal = [], None
    for comb, x in (factors, factors[::-1]):
        batch = (comb.free & x.free) - {j}
        k, d = comb.free - x.free - {j}, x.free - comb.free - {j}
        if len(k) != 1 or not d:
            continue
        holds_k = [i for i, f in enumerate(outer) if k <= f.free]
        if len(holds_k) != 1:
            continue
        post, o = outer[holds_k[0]], outer[1 - holds_k[0]]
        if not (post.free <= batch | k and o.free <= batch | d and d <= o.free and out == batch | k | d):
            continue
        (k,) = k
        if not known_equal(j.size, k.size):
            unequal = unequal or f"it mixes {j.size} streams into {k.size}: the op's comb is n x n"
            continue
        readings.append((x, o, post, comb, batch, j, k, d))
    if readings or unequal:
        return readings or unequal
    # a near miss only where a factor is a square matrix over the summed index, as comb is (an
    # unrelated sum of products is no candidate; sizes decide only whether to say so)
    if not any(sum(known_equal(a.size, j.size) for a in f.free) >= 2 for f in factors):
        return []
    return ("a product plus a product summed over one index, but not post[k] * o[d] + sum_j comb[j, k] * X[j, d]: "
            "the indices of the block output, post, comb and the streams do not play those roles")


def _sites(reading, value, output, ends, by_seq):
    """ends: the region's last nodes (the add, and the cast that rounds it where that is the output);
    by_seq: a joint graph's backward nodes by seq_nr (empty for a forward graph)."""
    x, o, post, comb, batch, j, k, d = reading
    name = "streams mix (axis algebra)"
    mix = ends[-1]
    if tensor_meta(output).dtype != x.dtype and output is not mix and tensor_meta(mix).dtype == x.dtype:
        # mixed in the streams' dtype, then rounded to another (HcPost's type_as of a block output
        # narrower than the streams): the op's result is that mix, and the cast stays after it
        output, ends = mix, [mix]
    # a block output narrower than the streams is promoted to theirs by the product (exact): the
    # op takes it so
    operand_dtypes = {"block_output": x.dtype} if o.dtype != x.dtype and torch.promote_types(
        o.dtype, x.dtype) == x.dtype and tensor_meta(mix).dtype == x.dtype else {}
    if tensor_meta(output).dtype != x.dtype:
        return [Recognized(name, output, ends, reason=(
            f"the mix's result is {str(tensor_meta(output).dtype)[6:]} and the streams {str(x.dtype)[6:]}: the op "
            "returns the streams' dtype"))]
    order = [a for group in x.dims for a in group]
    batch = sorted(batch, key=order.index)
    channels = tuple(sorted(d, key=order.index))
    lead = ((), tuple(batch)) if len(batch) < 2 else ((batch[0],), tuple(batch[1:]))
    layouts = {"hidden_states": (x, (*lead, (j,), channels)), "block_output": (o, (*lead, channels)),
               "post": (post, (*lead, (k,))), "comb": (comb, (*lead, (j,), (k,)))}
    inputs = {role: expr.node for role, (expr, _) in layouts.items()}
    if any(node is None for node in inputs.values()):
        return []
    # (a region node read elsewhere too stays, and computes what it did)
    nodes, _ = enclosed_region([output], list(inputs.values()))
    sizes = {}
    for expr, _ in layouts.values():
        sizes.update(atom_sizes(tensor_meta(expr.node), expr.dims))
    site_args = {role: tensor_meta(expr.node).new_empty([math.prod(sizes[a] for a in g) for g in target],
                                                       dtype=operand_dtypes.get(role, expr.dtype))
                 for role, (expr, target) in layouts.items()}
    out_layout = (*lead, (k,), channels)
    backward = {}
    if by_seq:
        region = backward_region(nodes, list(inputs.values()), output, by_seq)
        if isinstance(region, str):
            return [Recognized(name, output, ends, reason=f"a residual mix of n streams in training: {region}")]
        roles = {node: role for role, node in inputs.items()}
        grads = [(roles[source], node) for source, node in region.gradients.items()]
        backward = dict(backward_nodes=region.nodes, backward_output=[node for _, node in grads],
                        backward_args={**inputs, "grad": region.gradient})
    sites = []
    for fused, fused_op, gradient_op in ((npu_mhc_post, "npu.npu_mhc_post", torch.ops.npu.npu_mhc_post_backward),
                                         (mhc_post, "cann_ops_transformer.mhc_post",
                                          torch.ops.cann_ops_transformer.mhc_post_backward)):
        extra = {}
        if backward:
            dtypes = [tensor_meta(node).dtype for node in backward["backward_output"]]
            wanted = [role for role, _ in grads]
            extra = dict(backward, backward_replace=_recognized_gradient(gradient_op, layouts, out_layout, value.dims,
                                                                         wanted, dtypes, operand_dtypes))
        call = _recognized_call(fused, layouts, out_layout, value.dims, operand_dtypes)
        sites.append(Recognized(name, output, nodes, inputs, call, site_args, fused_op=fused_op, **extra))
    return sites


def _laid_out(given, dims, targets, operand_dtypes):
    """The role tensors in the op's layouts and dtypes, and {atom: size}."""
    sizes = {}
    for name, t in given.items():
        sizes.update(atom_sizes(t, dims[name]))
    laid = {name: rearrange(t, dims[name], targets[name], sizes).to(operand_dtypes.get(name, t.dtype))
            for name, t in given.items()}
    return laid, sizes


def _recognized_call(fused, layouts, out_layout, out_dims, operand_dtypes):
    dims = {name: expr.dims for name, (expr, _) in layouts.items()}
    targets = {name: target for name, (_, target) in layouts.items()}

    def npu_mhc_post_recognized(hidden_states, block_output, post, comb):
        given = {"hidden_states": hidden_states, "block_output": block_output, "post": post, "comb": comb}
        laid, sizes = _laid_out(given, dims, targets, operand_dtypes)
        out = fused(laid["hidden_states"], laid["block_output"], laid["post"], laid["comb"])
        return rearrange(out, out_layout, out_dims, sizes)

    npu_mhc_post_recognized.__name__ = fused.__name__ + "_recognized"
    return npu_mhc_post_recognized


# The op's backward computes the four gradients from the output's: (grad_x, grad_h_res,
# grad_h_out, grad_h_post). The model's gradients are those of its own inputs, laid out as they
# are: each is rearranged back (the adjoint of the forward's rearrangement: a role broadcast
# into the op's layout is summed), cast to the dtype autograd gives it.
_GRADIENT_ORDER = ("hidden_states", "comb", "block_output", "post")


def _recognized_gradient(gradient_op, layouts, out_layout, out_dims, wanted, dtypes, operand_dtypes):
    dims = {name: expr.dims for name, (expr, _) in layouts.items()}
    targets = {name: target for name, (_, target) in layouts.items()}

    def mhc_post_backward_recognized(hidden_states, block_output, post, comb, grad):
        given = {"hidden_states": hidden_states, "block_output": block_output, "post": post, "comb": comb}
        laid, sizes = _laid_out(given, dims, targets, operand_dtypes)
        grad_y = rearrange(grad, out_dims, out_layout, sizes).contiguous()
        grads = dict(zip(_GRADIENT_ORDER, gradient_op(grad_y, laid["hidden_states"], laid["comb"].float(),
                                                      laid["block_output"], laid["post"].float())))
        return tuple(rearrange_gradient(grads[name], dims[name], targets[name], sizes).to(dtype)
                     for name, dtype in zip(wanted, dtypes))

    return mhc_post_backward_recognized


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
    return (f"a residual mix of n streams (a broadcast product plus {how}) that neither transformers' "
            "DeepseekV4DecoderLayer form nor the recognition reads as post[k] * o + sum_j comb[j, k] * X[j] "
            "(its region could not be evaluated)")


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
    recognize=recognize,
    # its 150 joint patterns start from an add, which every graph has: a graph with no
    # candidate mix (every one but DeepSeek-V4's) is not matched at all
    prefilter=lambda graph: any(anchor(node) for node in graph.find_nodes(op="call_function", target=aten.add.Tensor)),
    differentiable=("hidden_states", "block_output", "post", "comb"),
)
