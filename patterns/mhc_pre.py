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

Training: npu_mhc_pre / npu_mhc_sinkhorn differentiate at the dispatcher with out_flag=1
(set where autograd records the call); the COT op is differentiated by the extension's
Python MhcPreSinkhornFunction, mirrored by MhcPreSinkhorn below, which calls
mhc_pre_sinkhorn(outFlag=True) and mhc_pre_sinkhorn_backward explicitly.
"""
import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import CAPABILITIES, only_on, unsupported
from npu_fx_fusion.matching import Form, FusionPass, is_call, is_joint_graph, tensor_meta

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
def _training(*tensors):
    """Whether autograd records this call (the joint replacement), so the ops must save what
    their backward reads (out_flag / outFlag)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


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
        if _training(hidden_streams, fn, base, scale):
            hin, h_post, h_res = MhcPreSinkhorn.apply(*args)
        else:
            hin, h_post, h_res = torch.ops.cann_ops_transformer.mhc_pre_sinkhorn(*args, False)[:3]
        return h_post, h_res.view(b, s, n, n), hin

    replace.__name__ = "mhc_pre_sinkhorn"
    return replace


def _npu_mhc_pre_then_sinkhorn(iterations):
    def replace(hidden_streams, fn, base, scale, norm_eps, hc_eps):
        out_flag = int(_training(hidden_streams, fn, base, scale))
        h_in, h_post, h_res, _, _, _ = torch.ops.npu.npu_mhc_pre(
            hidden_streams, fn.float(), scale.float(), base.float(), norm_eps=norm_eps, hc_eps=hc_eps,
            out_flag=out_flag)
        comb, _, _ = torch.ops.npu.npu_mhc_sinkhorn(h_res, eps=hc_eps, num_iters=iterations, out_flag=out_flag)
        return h_post, comb, h_in

    replace.__name__ = "npu_mhc_pre_then_npu_mhc_sinkhorn"
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
_ITERATIONS = {form.replace: iterations for form, iterations in
               zip(FORMS, [i for i in SINKHORN_ITERATIONS for _ in range(2)])}


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
    iterations = _ITERATIONS[site.form.replace]
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
    prefilter=lambda graph: any(n.target is aten._softmax.default for n in graph.nodes),
)
