"""mhc_pre: DeepSeek-V4's hyper-connection mappings -> mhc_pre_sinkhorn / npu_mhc_pre + npu_mhc_sinkhorn.

transformers' DeepseekV4HyperConnection (modeling_deepseek_v4.py L956) turns the n residual
streams X (B, S, n, D) into the block input and the two mixing weights of mHC post:

    flat = UnweightedRMSNorm(X.view(B, S, n*D).float()) @ fn^T      (n^2 + 2n mixes)
    pre  = sigmoid(flat_pre * scale[0] + base_pre) + hc_eps
    post = 2 * sigmoid(flat_post * scale[1] + base_post)
    comb = Sinkhorn(softmax(flat_res * scale[2] + base_res) + hc_eps)    (hc_sinkhorn_iters)
    collapsed = sum_j pre[j] * X[j]                                  (the un-normalised X)

That is exactly the fused ops' definition (npu_ops/mhc.py, deepseek_v4.md 3.2-3.3), so the
whole module is one form, and becomes, by SoC (capabilities.py):

  - cann_ops_transformer.mhc_pre_sinkhorn (one op; 950 / A2 / A3, n = 4 and 20 iterations
    only, C 128-aligned on A2/A3, C in {4096, 7168} on 950), or
  - npu_mhc_pre, then npu_mhc_sinkhorn on its pre-Sinkhorn h_res (torch_npu; 950 only).

Nothing is assumed: norm_eps and hc_eps are captured (each use of hc_eps must bind the same
value, or the form does not match), the stream count and sizes come from the shapes, and
the Sinkhorn iteration count is the form's. torch's matcher has no repetition, so the
unrolled loop is one form per count; SINKHORN_ITERATIONS lists the registered ones (V4's
configs use 20; the COT op takes 20 only). A loop of another length is a near miss that
names its count (engine follow-up: a repeated sub-pattern with a captured trip count).

The fused ops compute the mixes as (x @ fn^T) * rsqrt(...) where transformers scales first
and rounds the normalised streams: equal up to fp32 rounding. collapsed is rounded once.

Other spellings are identified by evaluating their region on random inputs (`_recognized`), and
train fused too: in a joint graph the region's backward is what autograd made of it
(regions.backward_region), and both are replaced by one joint trace of the fused call (`_trained`).

Training: npu_mhc_pre / npu_mhc_sinkhorn differentiate at the dispatcher with out_flag=1
(set where autograd records the call); the COT op is differentiated by the extension's
Python MhcPreSinkhornFunction, mirrored by MhcPreSinkhorn below, which calls
mhc_pre_sinkhorn(outFlag=True) and mhc_pre_sinkhorn_backward explicitly.
"""
import math
import operator
from dataclasses import replace as with_fields

import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import CAPABILITIES, only_on, unsupported
from npu_fx_fusion.matching import (MOVES, RESHAPES, Form, FusionPass, Recognized, backward_nodes_by_seq,
                                    backward_region, is_backward, is_call, is_cast, is_joint_graph, records_gradient,
                                    same_function, tensor_meta)

aten = torch.ops.aten
PRE_SINKHORN = CAPABILITIES["cann_ops_transformer.mhc_pre_sinkhorn"]
MHC_PRE = CAPABILITIES["npu.npu_mhc_pre"]
SINKHORN = CAPABILITIES["npu.npu_mhc_sinkhorn"]
# The Sinkhorn loop lengths registered as forms (module docstring): DeepSeek-V4's hc_sinkhorn_iters.
SINKHORN_ITERATIONS = (20,)


# ---- the unfused form, as transformers writes it ---------------------------------------------
def _hyper_connection(iterations):
    def search(hidden_streams, fn, base, scale, norm_eps, hc_eps):
        batch_size, seq_len, hc = hidden_streams.shape[0], hidden_streams.shape[1], hidden_streams.shape[2]
        flattened = hidden_streams.view(batch_size, seq_len, -1).float()
        # DeepseekV4UnweightedRMSNorm
        flattened = flattened * torch.rsqrt(
            flattened.float().square().mean(-1, keepdim=True) + norm_eps).to(flattened.dtype)
        flattened = F.linear(flattened, fn.float())
        pre_w, post_w, comb_w = flattened.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        comb_b = comb_b.view(hc, hc)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
        return post, comb, collapsed

    search.__name__ = f"deepseek_v4_hyper_connection[{iterations} sinkhorn iterations]"
    return search


# ---- the fused calls ----------------------------------------------------------------------
class MhcPreSinkhorn(torch.autograd.Function):
    """The extension's MhcPreSinkhornFunction (COT ops/mhc_pre_sinkhorn.py): the op with
    outFlag=True forward, mhc_pre_sinkhorn_backward backward; (hin, h_post, h_res) out.
    capabilities.py names it as the op's autograd_rule."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, hc_mult, num_iters, hc_eps, norm_eps):
        hin, h_post, h_res, h_pre, before_norm, inv_rms, sums, norms = \
            torch.ops.cann_ops_transformer.mhc_pre_sinkhorn(x, phi, alpha, bias, hc_mult, num_iters, hc_eps,
                                                            norm_eps, True)
        ctx.save_for_backward(x, phi, alpha, bias, h_pre, before_norm, inv_rms, sums, norms)
        ctx.hc_eps = hc_eps
        return hin, h_post, h_res

    @staticmethod
    def backward(ctx, grad_hin, grad_h_post, grad_h_res):
        x, phi, alpha, bias, h_pre, before_norm, inv_rms, sums, norms = ctx.saved_tensors
        grad_hin = grad_hin if grad_hin is not None else torch.zeros_like(x[..., 0, :])
        grad_h_post = grad_h_post if grad_h_post is not None else torch.zeros_like(h_pre)
        grad_h_res = grad_h_res if grad_h_res is not None else torch.zeros_like(norms[0].flatten(-2))
        grads = torch.ops.cann_ops_transformer.mhc_pre_sinkhorn_backward(
            grad_hin, grad_h_post, grad_h_res, x, phi, alpha, bias, h_pre, before_norm, inv_rms, sums, norms,
            ctx.hc_eps)
        return (*grads, None, None, None, None)


def _mhc_pre_sinkhorn(iterations):
    def replace(hidden_streams, fn, base, scale, norm_eps, hc_eps):
        b, s, n, _ = hidden_streams.shape
        args = (hidden_streams, fn.float(), scale.float(), base.float(), n, iterations, hc_eps, norm_eps)
        if records_gradient(hidden_streams, fn, base, scale):
            hin, h_post, h_res = MhcPreSinkhorn.apply(*args)
        else:
            hin, h_post, h_res = torch.ops.cann_ops_transformer.mhc_pre_sinkhorn(*args, False)[:3]
        return h_post, h_res.view(b, s, n, n), hin

    replace.__name__ = "mhc_pre_sinkhorn"
    replace.iterations = iterations
    return replace


def _npu_mhc_pre_then_sinkhorn(iterations):
    def replace(hidden_streams, fn, base, scale, norm_eps, hc_eps):
        # the joint replacement: the op saves what its backward reads (out_flag)
        out_flag = int(records_gradient(hidden_streams, fn, base, scale))
        h_in, h_post, h_res, _, _, _ = torch.ops.npu.npu_mhc_pre(
            hidden_streams, fn.float(), scale.float(), base.float(), norm_eps=norm_eps, hc_eps=hc_eps,
            out_flag=out_flag)
        comb, _, _ = torch.ops.npu.npu_mhc_sinkhorn(h_res, eps=hc_eps, num_iters=iterations, out_flag=out_flag)
        return h_post, comb, h_in

    replace.__name__ = "npu_mhc_pre_then_npu_mhc_sinkhorn"
    replace.iterations = iterations
    return replace


# Training: the streams and fn / base / scale (parameters) all carry gradients in V4; one joint
# trace (each covers a 20-iteration Sinkhorn's backward)
_ALL_TRAINABLE = (("hidden_streams", "fn", "base", "scale"),)


def _forms():
    forms = []
    for iterations in SINKHORN_ITERATIONS:
        search = _hyper_connection(iterations)
        # the one-op form first; the torch_npu pair where the COT op's limits are not met
        forms.append(Form(search, _mhc_pre_sinkhorn(iterations), fused_op="cann_ops_transformer.mhc_pre_sinkhorn",
                          grad_subsets=_ALL_TRAINABLE))
        forms.append(Form(search, _npu_mhc_pre_then_sinkhorn(iterations), fused_op="npu.npu_mhc_pre",
                          grad_subsets=_ALL_TRAINABLE))
    return forms


FORMS = _forms()


# ---- checks -------------------------------------------------------------------------------
def _shape_reason(x, fn, base, scale):
    if x.dim() != 4:
        return f"hidden streams of {x.dim()} dims: the form is (B, S, n, D)"
    n, d = x.shape[2], x.shape[3]
    width = (2 + n) * n
    if tuple(fn.shape) != (width, n * d) or tuple(base.shape) != (width,) or scale.numel() != 3:
        return (f"fn {list(fn.shape)}, base {list(base.shape)}, scale {list(scale.shape)} are not the "
                f"({width}, {n * d}), ({width},), (3,) of {n} streams of {d}")
    if fn.dtype != torch.float32 or base.dtype != torch.float32 or scale.dtype != torch.float32:
        return "fn, base and scale are not fp32: the ops take fp32 phi, alpha and bias"
    return None


def check(site):
    x, fn, base, scale = site["hidden_streams"], site["fn"], site["base"], site["scale"]
    reason = _shape_reason(x, fn, base, scale)
    if reason:
        return reason
    if site["norm_eps"] <= 0 or site["hc_eps"] < 0:
        return f"norm_eps {site['norm_eps']} / hc_eps {site['hc_eps']} out of range"
    iterations = site.form.replace.iterations  # a form's, or a recognised site's
    n, d = x.shape[2], x.shape[3]
    if site.form.fused_op == "cann_ops_transformer.mhc_pre_sinkhorn":
        limits = PRE_SINKHORN.limits
        return site.hardware_limits([
            unsupported("cann_ops_transformer.mhc_pre_sinkhorn", site.soc, x=x),
            f"{n} streams: mhc_pre_sinkhorn takes N = {_values(limits['streams'])}"
            if n not in limits["streams"] else None,
            f"{iterations} Sinkhorn iterations: mhc_pre_sinkhorn takes {_values(limits['iterations'])}"
            if iterations not in limits["iterations"] else None,
            *_dim_reasons(d, site.soc),
        ])
    low, high = SINKHORN.limits["iterations"]
    return site.hardware_limits([
        unsupported("npu.npu_mhc_pre", site.soc, x=x) or (only_on("npu.npu_mhc_pre") if site.soc is None else None),
        unsupported("npu.npu_mhc_sinkhorn", site.soc, x=x.new_empty((*x.shape[:2], n, n), dtype=torch.float32)),
        f"{n} streams: npu_mhc_pre takes n in {MHC_PRE.limits['streams']}" if n not in MHC_PRE.limits["streams"]
        else None,
        f"D = {d}: npu_mhc_pre takes D 16-aligned up to {MHC_PRE.limits['max_dim']}"
        if d % MHC_PRE.limits["dim_multiple"] or d > MHC_PRE.limits["max_dim"] else None,
        f"{iterations} iterations: npu_mhc_sinkhorn takes {low}..{high}" if not low <= iterations <= high else None,
    ])


def _values(allowed):
    """A capability row's allowed values as a note says them: "20 only", or the tuple."""
    return f"{allowed[0]} only" if len(allowed) == 1 else str(allowed)


def _dim_reasons(d, soc):
    """mhc_pre_sinkhorn's C limit, which differs by SoC (COT docs/zh/mhc_pre_sinkhorn.md): one
    reason per SoC family it is broken on, naming it: the site's SoC, or in emulation (no SoC)
    A2/A3 and Ascend950 both, as "C = 64: on <SoC> mhc_pre_sinkhorn takes ..."."""
    limits = PRE_SINKHORN.limits
    families = [(soc, soc == "Ascend950")] if soc is not None else [("A2/A3", False), ("Ascend950", True)]
    reasons = []
    for name, is_950 in families:
        if is_950 and d not in limits["dims_950"]:
            reasons.append(f"C = {d}: on {name} mhc_pre_sinkhorn takes C in {limits['dims_950']}")
        elif not is_950 and (d % limits["a2_a3_dim_multiple"] or d > limits["a2_a3_max_dim"]):
            reasons.append(f"C = {d}: on {name} mhc_pre_sinkhorn takes C {limits['a2_a3_dim_multiple']}-aligned "
                           f"up to {limits['a2_a3_max_dim']}")
    return reasons


# ---- the hyper-connection recognised by what it computes ----------------------------------------
# Other codebases spell the module otherwise: torchtitan-npu's HcPre scales the projection by
# the rms after it (`F.linear(x, fn) * rsqrt(...)`, the ops' own order), slices base and
# indexes scale, flattens with `flatten(2)`, collapses `x.view(shape)` of the fp32 streams; a
# Sinkhorn loop of another length than the forms' 20. Such a site is found from its Sinkhorn
# loop (anchor), its region read off the graph: the projection the softmax's logits come from
# (a matmul with a 2-d weight leaf fn), the streams X it flattens, the two other leaves the
# logits read (base, scale), and the region's three outputs (post, comb, and the collapse of the
# streams, sum over the streams of a product with X). The region's function is then
# *identified*: the region and the fused call run on the same random inputs (verify.py) and
# must agree within the op's tolerance, for base and scale in either role. Only smooth ops
# (arithmetic, sigmoid, softmax, sums, rsqrt, views) may be in the region, so agreeing on random
# inputs is agreeing as functions (no branch a probe could miss).
_SMOOTH = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
           aten.div.Scalar, aten.neg.default, aten.sigmoid.default, aten._softmax.default, aten.sum.dim_IntList,
           aten.mean.dim, aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.square.default,
           aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.view.default,
           aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
           aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default,
           aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
           aten.alias.default, aten.contiguous.default, aten.sym_size.int}  # and casts (is_cast)
# the fused ops' error from the region's exact value (float64, its casts left out) on random
# inputs: they compute in fp32 and round once, a few ulp of each output at its scale (8 fp32
# ulp over the 20 iterations in the tests); another function is off by the function itself
IDENTIFY_ULPS = 16
# symbolic token counts are probed at most at this many; static sizes as they are, up to this
# many stream elements (fp32 probes, the region in float64: a few hundred MB at most)
PROBE_TOKENS = 8
PROBE_MAX_ELEMENTS = 2 ** 22
_PROJECTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default)


def recognize(graph, joint):
    if not graph.find_nodes(op="call_function", target=aten._softmax.default):
        return []
    found = []
    by_seq = backward_nodes_by_seq(graph) if joint else None
    for node in graph.find_nodes(op="call_function", target=aten.div.Tensor):
        if (joint and is_backward(node)) or not anchor(node):
            continue
        found.extend(_recognized(node, by_seq))
    return found


def _leaf(node):
    return node.op in ("placeholder", "get_attr")


def _moved_or_cast(node):
    return is_call(node, *MOVES) or is_cast(node)


def _through(node):
    """`node` without the moves and casts on it."""
    while _moved_or_cast(node):
        node = node.args[0]
    return node


def _nearest_up(start, read, limit):
    """The first non-None read(node) of the nodes above `start` (itself first), nearest first,
    among at most `limit` of them."""
    pending, seen = [start], set()
    while pending and len(seen) < limit:
        node = pending.pop(0)
        if node in seen or not isinstance(node, torch.fx.Node):
            continue
        seen.add(node)
        found = read(node)
        if found is not None:
            return found
        pending.extend(a for a in node.all_input_nodes if tensor_meta(a) is not None)
    return None


def _projection(logits):
    """(the matmul the logits come from, its weight leaf fn, its other operand), or None."""
    def read(node):
        if not is_call(node, *_PROJECTIONS):
            return None
        operands = node.args[1:3] if is_call(node, aten.addmm.default) else node.args[:2]
        sources = [_through(a) for a in operands]
        weights = [i for i, a in enumerate(sources) if _leaf(a) and tensor_meta(a).dim() == 2]
        return (node, sources[weights[0]], operands[1 - weights[0]]) if len(weights) == 1 else None
    return _nearest_up(logits, read, 64)


def _streams(flat):
    """The (B, S, n, D) streams the projection's input is computed from: the 4-d value the
    nearest view up from it flattens (n, D) of, up through the casts only it reads."""
    def read(node):
        source = node.args[0] if is_call(node, *RESHAPES) else None
        if tensor_meta(source) is None or tensor_meta(source).dim() != 4 or tensor_meta(node).dim() != 3:
            return None
        # (a cast the rest of the layer reads too is the streams as the layer has them)
        while is_cast(source) and tensor_meta(source.args[0]).dim() == 4 and len(source.users) == 1:
            source = source.args[0]
        return source
    return _nearest_up(flat, read, 32)


def _ancestors(outputs, stops):
    found, pending = set(), list(outputs)
    while pending:
        node = pending.pop()
        if node in found or node in stops:
            continue
        found.add(node)
        if not _leaf(node):
            pending.extend(node.all_input_nodes)
    return found


def _recognized(comb, by_seq):
    """by_seq: a joint graph's backward nodes by seq_nr (None for a forward graph)."""
    joint = by_seq is not None
    start, iterations = _sinkhorn_start(comb)
    name = "hyper-connection (identified on random inputs)"
    hc_eps = start.args[1]
    projection = _projection(start.args[0].args[0])
    if not isinstance(hc_eps, (int, float)) or projection is None:
        return []
    _, fn, flat = projection
    x = _streams(flat)
    if x is None:
        return []
    upward = _ancestors([comb], {x})
    # (a symbolic size is a placeholder too: the region reads it, the fused call its own sizes)
    sizes = [n for n in upward if _leaf(n) and tensor_meta(n) is None]
    leaves = [n for n in upward if _leaf(n) and n is not fn and n not in sizes]
    # the region: what the Sinkhorn's logits are computed from, and every value computed from
    # it, X and the leaves alone, up to comb and the collapse (what reads them, the residual mix
    # and the block's norm, is not the module's)
    inputs, parameters = {x, fn, *leaves, *sizes}, {fn, *leaves}
    collapse = _collapse(_closure(upward, inputs, parameters, {comb}), x)
    if len(leaves) != 2 or collapse is None:
        return []
    region = _closure(upward, inputs, parameters, {comb, collapse})

    def outside(user, region):  # (a joint graph's backward reads what its forward saved)
        return user not in region and not (joint and is_backward(user))

    escaping = {n for n in region if any(outside(u, region) for u in n.users)} - {comb, collapse}
    escaping = {_through_moves_back(n, region) for n in escaping}
    if len(escaping) != 1:
        names = sorted(n.name for n in escaping)
        names = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") or "none"
        return [Recognized(name, comb, [comb], reason=(
            f"a hyper-connection whose values read outside it besides comb and the collapsed streams are {names} "
            "(one, post, is what the fused ops return; in a training step's forward graph the values saved for "
            "the backward are read too)"))]
    (post,) = escaping
    region = _ancestors([post, comb, collapse], {x, fn, *leaves, *sizes})
    nodes = sorted(n for n in region if not _leaf(n))
    outputs = [post, comb, collapse]
    unsmooth = next((n for n in nodes if n.target not in _SMOOTH and n.target is not operator.getitem
                     and not is_cast(n)), None)
    if unsmooth is not None:
        return [Recognized(name, comb, nodes, reason=f"a hyper-connection whose region computes {unsmooth.target} "
                           "(not only arithmetic, sigmoid, softmax, sums and views): it is not identified by "
                           "evaluation")]
    norm_eps = _norm_eps(nodes)
    if norm_eps is None:
        return []
    escape = next(((n, u) for n in nodes if n not in outputs for u in n.users if outside(u, region)), None)
    if escape is not None:
        return [Recognized(name, outputs, nodes, reason=(
            f"intermediate {escape[0].name} of the hyper-connection is also read by {escape[1].name}"))]
    sites = _identified(name, outputs, nodes, x, fn, leaves, sizes, norm_eps, float(hc_eps), iterations)
    if not joint or not sites or sites[0].reason is not None:
        return sites
    # one region, whichever fused call replaces it: its backward is found once
    backward = backward_region(sites[0].nodes, list(sites[0].args.values()), sites[0].outputs, by_seq)
    return [_trained(site, backward) for site in sites]


def _trained(site, backward):
    """A recognised site of a joint graph, with the backward autograd made of its region
    (`backward`: regions.backward_region's answer), replaced jointly: the fused ops' backward
    reads what their forward saves (out_flag)."""
    if isinstance(backward, str):
        return with_fields(site, args={}, replace=None, reason=f"a hyper-connection in training: {backward}")
    if any(gradient is None for gradient in backward.output_gradients):
        unused = [o.name for o, g in zip(site.outputs, backward.output_gradients) if g is None]
        return with_fields(site, args={}, replace=None, reason=(
            f"a hyper-connection in training whose {', '.join(unused)} get no gradient: the fused ops' backward "
            "takes one for each of post, comb and the collapsed streams"))
    trained = [role for role, node in site.args.items() if node in backward.gradients]
    return with_fields(site, backward_nodes=backward.nodes, output_gradients=backward.output_gradients,
                   needs_gradient=trained, backward_output=[backward.gradients[site.args[r]] for r in trained])


def _closure(upward, inputs, parameters, ends):
    """The non-leaf nodes of `upward` and every node computed from them and `inputs` alone,
    reached from them or from the module's `parameters` (not from the streams, which the rest
    of the layer reads too), not past `ends`."""
    region = {n for n in upward if not _leaf(n)}
    known = region | set(inputs)
    pending = [u for n in (region - set(ends)) | set(parameters) for u in n.users]
    while pending:
        node = pending.pop()
        if node in region or node.op != "call_function" or not all(a in known for a in node.all_input_nodes):
            continue
        region.add(node)
        known.add(node)
        if node not in ends:
            pending.extend(node.users)
    return region


def _through_moves_back(node, region):
    """A value that leaves the region through a view or unsqueeze: the value it views."""
    while is_call(node, *MOVES) and node.args[0] in region:
        node = node.args[0]
    return node


def _collapse(region, x):
    """The sum over the streams of a product with X (the pre-weighted collapse), through the
    cast after it to the streams' dtype."""
    dtype = tensor_meta(x).dtype
    for node in sorted(region):
        if is_call(node, aten.sum.dim_IntList) and is_call(node.args[0], aten.mul.Tensor) and any(
                _reads_through_moves(a, x) for a in node.args[0].args if isinstance(a, torch.fx.Node)):
            while tensor_meta(node).dtype != dtype and len(node.users) == 1 and is_cast(next(iter(node.users))):
                node = next(iter(node.users))
            return node
    return None


def _reads_through_moves(node, x):
    """Whether `node` is `x` moved and cast (views and casts up from it pass `x`)."""
    while node is not x and _moved_or_cast(node):
        node = node.args[0]
    return node is x


def _norm_eps(nodes):
    """The constant added to the mean square under the region's rsqrt."""
    for node in nodes:
        if is_call(node, aten.rsqrt.default) and is_call(node.args[0], aten.add.Tensor, aten.add.Scalar) \
                and isinstance(node.args[0].args[1], (int, float)):
            return float(node.args[0].args[1])
    return None


def _identified(name, outputs, nodes, x, fn, leaves, sizes, norm_eps, hc_eps, iterations):
    """The fused calls for the region, with base and scale in the roles the random inputs
    identify; else a near miss with the closest disagreement."""
    fused = [(_mhc_pre_sinkhorn(iterations), "cann_ops_transformer.mhc_pre_sinkhorn"),
             (_npu_mhc_pre_then_sinkhorn(iterations), "npu.npu_mhc_pre")]
    n = tensor_meta(x).shape[2]
    probed_elements = math.prod(_probe_size(size) for size in tensor_meta(x).shape)
    if probed_elements > PROBE_MAX_ELEMENTS:
        return [Recognized(name, outputs, nodes, reason=(
            f"a hyper-connection over {probed_elements} stream elements of static sizes: identifying it on random "
            f"inputs of that size at compile time is refused (more than {PROBE_MAX_ELEMENTS}; with dynamic shapes "
            f"its tokens are probed at {PROBE_TOKENS}); transformers' DeepseekV4HyperConnection spelling fuses as "
            "a form at any size"))]
    disagreement = None
    for base, scale in (leaves, leaves[::-1]):
        if _shape_reason(tensor_meta(x), tensor_meta(fn), tensor_meta(base), tensor_meta(scale)):
            continue
        inputs = {"hidden_streams": x, "fn": fn, "base": base, "scale": scale}
        # the region also reads the symbolic sizes, which the probes take at their hints
        probed = {**inputs, **{f"size_{i}": size for i, size in enumerate(sizes)}}
        sites = []
        for replace, fused_op in fused:
            call = _bound(replace, norm_eps, hc_eps)
            verdict = same_function(nodes, outputs, {k: tensor_meta(v) for k, v in inputs.items()}, probed,
                                    lambda *args, call=call: call(*args[:4]), list(probed), IDENTIFY_ULPS,
                                    make_input=_probe)
            if not verdict.ok:
                disagreement = disagreement or verdict.detail
                break
            site_args = {**{k: tensor_meta(v) for k, v in inputs.items()}, "norm_eps": norm_eps, "hc_eps": hc_eps}
            sites.append(Recognized(name, outputs, nodes, inputs, call, site_args, fused_op=fused_op,
                                    notes=[f"identified on random inputs: {verdict.detail}"]))
        if len(sites) == len(fused):
            return sites
    return [Recognized(name, outputs, nodes, reason=(
        f"a hyper-connection of {n} streams and {iterations} Sinkhorn iterations whose function is not the "
        f"ops' on random inputs ({disagreement or 'fn, base and scale are not of its shapes'})"))]


def _bound(replace, norm_eps, hc_eps):
    def fused_call(hidden_streams, fn, base, scale):
        return replace(hidden_streams, fn, base, scale, norm_eps, hc_eps)

    fused_call.__name__ = replace.__name__
    fused_call.iterations = replace.iterations
    return fused_call


def _probe(name, args, node):
    """verify.py's make_input: the streams in fp32 whatever their dtype (the function is told
    apart in fp32: a bf16 collapse would hide an eps of 1e-6 in pre under its rounding), fn
    scaled by 1/sqrt(n*D) so the mappings do not saturate, sizes as _probe_size gives them."""
    if name.startswith("size_"):
        return _probe_size(node.meta["val"])
    if name not in ("fn", "hidden_streams"):
        return None
    shape = [_probe_size(size) for size in args[name].shape]
    generator = torch.Generator().manual_seed(1 if name == "fn" else 2)
    return torch.randn(*shape, generator=generator) * (shape[1] ** -0.5 if name == "fn" else 1.0)


def _probe_size(size):
    """A size at the probe: a symbolic one with each of its symbols at min(hint, PROBE_TOKENS)
    (the module computes each token alone, so a few tokens identify it and keep the compile
    cheap at serving sizes), a static one as it is."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr, hints = size.node.expr, size.node.shape_env.backed_var_to_val
    return int(expr.xreplace({s: min(int(hints[s]), PROBE_TOKENS) for s in expr.free_symbols}))


# ---- near misses: a Sinkhorn normalisation that no form consumed ---------------------------
def _normalisation(node, dim):
    """node = y / (y.sum(dim, keepdim=True) + eps): returns y, else None."""
    if not is_call(node, aten.div.Tensor) or not is_call(node.args[1], aten.add.Tensor, aten.add.Scalar):
        return None
    total = node.args[1].args[0]
    if is_call(total, aten.sum.dim_IntList) and total.args[0] is node.args[0] and list(total.args[1]) == [dim]:
        return node.args[0]
    return None


def _sinkhorn_start(node):
    """The softmax(+eps) a chain of column / row normalisations ending at `node` starts from,
    and the number of iterations (None if node is not such a chain's column step)."""
    iterations = 0
    while True:
        y = _normalisation(node, -2)
        if y is None:
            return None, 0
        iterations += 1
        row = _normalisation(y, -1)
        if row is None:
            start = y.args[0] if is_call(y, aten.add.Tensor, aten.add.Scalar) else None
            return (y if is_call(start, aten._softmax.default) else None), iterations
        node = row


def anchor(node):
    """The last column normalisation of a Sinkhorn loop over a softmax (its output is no input
    of another normalisation step)."""
    start, _ = _sinkhorn_start(node)
    return start is not None and not any(_normalisation(u, -1) is not None for u in node.users)


def explain(node):
    _, iterations = _sinkhorn_start(node)
    if iterations not in SINKHORN_ITERATIONS:
        return (f"a Sinkhorn loop of {iterations} iterations: forms are registered for "
                f"{', '.join(map(str, SINKHORN_ITERATIONS))} (the matcher has no repetition; "
                "mhc_pre_sinkhorn takes 20 only, npu_mhc_sinkhorn 1..100)")
    reason = ("a Sinkhorn loop whose hyper-connection is not transformers' DeepseekV4HyperConnection "
              "(unweighted RMSNorm over the n*D streams, one fn projection, sigmoid / 2*sigmoid / softmax "
              "mappings with per-mapping scale and base, the pre-weighted collapse of the raw streams)")
    if is_joint_graph(node.graph):
        # the other way a training graph misses the one joint trace (_ALL_TRAINABLE)
        reason += (", or, in training, one of the streams, fn, base and scale has no gradient (a frozen "
                   "mHC parameter): the joint form is traced with all four trainable")
    return reason


def _f32(*shape):
    return lambda dtype: torch.empty(*shape, dtype=torch.float32)  # V4 keeps the mHC parameters in fp32


PASS = FusionPass(
    name="mhc_pre",
    fused_op="cann_ops_transformer.mhc_pre_sinkhorn",
    forms=FORMS,
    example={
        # B=2, S=3, n=4 streams of D=8: fn (n^2 + 2n = 24, n*D = 32)
        "hidden_streams": lambda dtype: torch.empty(2, 3, 4, 8, dtype=dtype),
        "fn": _f32(24, 32),
        "base": _f32(24),
        "scale": _f32(3),
        "norm_eps": 2.0**-17,
        "hc_eps": 2.0**-19,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.div.Tensor,),
    explain=explain,
    # the streams and the three parameters train through the fused ops' backward
    differentiable=("hidden_streams", "fn", "base", "scale"),
    prefilter=lambda graph: bool(graph.find_nodes(op="call_function", target=aten._softmax.default)),
    recognize=recognize,
)
