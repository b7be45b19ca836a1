"""rms_norm: RMSNorm over the last dim -> torch.ops.npu.npu_rms_norm.

    y = x / sqrt(mean(x^2, last dim) + eps) * weight

npu_rms_norm normalises in fp32 and multiplies the weight in fp32 with one rounding at
the end (op_semantics.md 2.1). HF code rounds to the input dtype before multiplying the
weight, so in bf16/fp16 the two differ by at most one ulp of the output; in fp32 they
agree to float rounding. eps is captured from the graph, never baked in.
"""
import torch
import torch.nn.functional as F

from npu_fx_fusion.capabilities import unsupported
from npu_fx_fusion.matching import (Form, FusionPass, is_call, known_equal, normalized_dims, sum_over_count,
                                    tensor_meta, users_outside)

aten = torch.ops.aten


# ---- the unfused forms, as model code writes them --------------------------------------
def hf_llama(x, weight, eps):
    # transformers LlamaRMSNorm (also Qwen2/Qwen3 incl. q_norm/k_norm, Mistral, DeepSeek-V3).
    # The engine also takes the other spellings of these ops as this form (spellings.py):
    # the operands of each product in either order, x * x for pow(x, 2), sum / n for the
    # mean, (v + eps) ** -0.5 for rsqrt, x / sqrt(v) for x * rsqrt(v)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def weight_before_cast(x, weight, eps):
    # weight applied in fp32, one cast at the end (Megatron, torchtitan-style modules)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).type_as(x)


def torch_functional(x, weight, eps):
    # torch.nn.RMSNorm / F.rms_norm (torchtitan): positive dims, eps as an add.Scalar
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def divide_by_sqrt(x, weight, eps):
    # hf_llama in inference; in training the gradient of a division by sqrt differs from
    # that of a product with rsqrt, so its joint graph is its own
    h = x.to(torch.float32)
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma(x, weight, eps):
    # Gemma / Gemma2 / Gemma3: the weight is stored as an offset from 1, applied in fp32
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def in_input_dtype(x, weight, eps):
    # hf_llama without the fp32 upcast: in bf16 / fp16 every step rounds to the input
    # dtype (in fp32 it is hf_llama's trace). npu_rms_norm computes in fp32 and rounds
    # once, so the fused result is closer to exact: within 1 ulp where this chain is up
    # to 3 ulp off, and up to 3 ulp from the chain (measured: tests/test_rms_norm.py).
    # Inductor makes the same trade when it fuses low-precision pointwise chains;
    # FusionConfig(keep_intermediate_rounding=True) keeps the chain instead.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rstd_in_input_dtype(x, eps):
    # DeepSeek-V4 DeepseekV4UnweightedRMSNorm (q_b_norm, the mHC input norms): the rstd is rounded
    # to x's dtype and multiplies x in it (in fp32 this is no_weight's trace)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def no_weight(x, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def no_weight_in_input_dtype(x, eps):
    # no_weight without the upcast (in fp32 it is no_weight's trace): rounds once in the
    # op, at every step in the code, as in_input_dtype
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ---- the fused calls --------------------------------------------------------------------
def npu_rms_norm(x, weight, eps):
    return torch.ops.npu.npu_rms_norm(x, weight, eps)[0]


def npu_rms_norm_once(x, weight, eps):
    # npu_rms_norm for in_input_dtype: a replacement of its own, since in fp32 its search
    # traces as hf_llama's, and the engine registers a trace once per replacement; the
    # bf16 trace (which has no casts) is what this form adds
    return torch.ops.npu.npu_rms_norm(x, weight, eps)[0]


def npu_rms_norm_gemma(x, weight, eps):
    # gamma = 1 + w in fp32, as Gemma computes it; an fp32 gamma with a half input is the
    # op's mixed-precision mode (checked against the SoC in `check`).
    return torch.ops.npu.npu_rms_norm(x, weight.float() + 1.0, eps)[0]


def npu_rms_norm_unit_weight(x, eps):
    ones = torch.ones(x.shape[-1:], dtype=x.dtype, device=x.device)
    return torch.ops.npu.npu_rms_norm(x, ones, eps)[0]


def npu_rms_norm_unit_weight_once(x, eps):
    # npu_rms_norm_unit_weight for no_weight_in_input_dtype (its own, as npu_rms_norm_once)
    ones = torch.ones(x.shape[-1:], dtype=x.dtype, device=x.device)
    return torch.ops.npu.npu_rms_norm(x, ones, eps)[0]


FORMS = [
    Form(hf_llama, npu_rms_norm),
    Form(weight_before_cast, npu_rms_norm),
    Form(torch_functional, npu_rms_norm),
    Form(divide_by_sqrt, npu_rms_norm),
    Form(gemma, npu_rms_norm_gemma),
    Form(in_input_dtype, npu_rms_norm_once, dtypes=(torch.bfloat16,)),
    Form(rstd_in_input_dtype, npu_rms_norm_unit_weight, dtypes=(torch.bfloat16, torch.float16)),
    Form(no_weight, npu_rms_norm_unit_weight),  # last two: sub-patterns of the others
    Form(no_weight_in_input_dtype, npu_rms_norm_unit_weight_once, dtypes=(torch.bfloat16,)),
]


# ---- checks -------------------------------------------------------------------------------
IN_INPUT_DTYPE_NOTE = ("computed in fp32 and rounded once, where the code rounds each step to {dtype}: "
                      "within 1 ulp of exact, up to 3 ulp from the code's own result")


ROUNDING_AT_EVERY_STEP = (in_input_dtype, no_weight_in_input_dtype)


def check(site):
    x, weight = site["x"], site.args.get("weight")
    if site.form.search in ROUNDING_AT_EVERY_STEP and x.dtype != torch.float32:
        if site.keep_intermediate_rounding:
            return (f"a {x.dtype} norm computed in {x.dtype} step by step; npu_rms_norm rounds once in fp32 "
                    "(FusionConfig.keep_intermediate_rounding keeps the code's roundings)")
        site.notes.append(IN_INPUT_DTYPE_NOTE.format(dtype=str(x.dtype).removeprefix("torch.")))
    if weight is not None:
        if tuple(weight.shape) != tuple(x.shape[-1:]):
            return (f"weight shape {list(weight.shape)} is not the normalised dim "
                    f"{list(x.shape[-1:])}: npu_rms_norm would normalise over more dims")
        if site.form.replace is npu_rms_norm_gemma:
            weight = weight.float()
    return unsupported("npu.npu_rms_norm", site.soc, x=x, gamma=weight)


# ---- near misses: a root of a mean of squares that no form consumed ------------------
def _mean_of_squares(node):
    """The mean node under an rsqrt/sqrt (through the eps add, either operand): a mean.dim,
    or a sum.dim_IntList divided by a number (sum / n); else None."""
    if is_call(node, aten.add.Tensor, aten.add.Scalar):
        node = next((a for a in node.args if isinstance(a, torch.fx.Node)
                     and (is_call(a, aten.mean.dim) or _is_sum_over_number(a))), node.args[0])
    if _is_sum_over_number(node):
        node = node.args[0]
    elif not is_call(node, aten.mean.dim):
        return None
    square = node.args[0]
    if is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        return node
    if is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        return node
    return None


def _is_sum_over_number(node):
    return sum_over_count(node) is not None


def _is_root(node):
    """rsqrt(v), sqrt(v), or v ** -0.5 (the spellings of the normaliser the forms accept)."""
    return is_call(node, aten.rsqrt.default, aten.sqrt.default) or (
        is_call(node, aten.pow.Tensor_Scalar) and node.args[1] in (-0.5, 0.5))


def anchor(node):
    # every spelling a form accepts (spellings.py) anchors, so a site none of them matches is
    # a near miss, never a silent one (the fuzz found sum / n and v ** -0.5 unreported)
    return _is_root(node) and _mean_of_squares(node.args[0]) is not None


def explain(root):
    mean = _mean_of_squares(root.args[0])
    source = tensor_meta(mean.args[0])
    rank = source.dim() if source is not None else None
    dims, keepdim = mean.args[1], (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))
    if rank is not None and normalized_dims(dims, rank) != [rank - 1]:
        return (f"normalises over dim(s) {list(dims)} of a {rank}-d tensor; "
                "npu_rms_norm normalises over the last dim only")
    if not keepdim:
        return "mean without keepdim=True: the normaliser does not broadcast over the last dim"
    eps_add = root.args[0]
    if not is_call(eps_add, aten.add.Tensor, aten.add.Scalar):
        return "no eps is added before the square root"
    over_count = [u for u in mean.users if _is_sum_over_number(u)][:1]  # sum / n: the division too
    if over_count:
        count, elements = sum_over_count(over_count[0])
        if not known_equal(count, elements):
            # dynamic=True makes the normalised dim symbolic, and the code divides by the
            # number it was written for: the mean only where they are equal, which nothing proves
            return f"divides by {count} where the normalised dim is {elements}"
    eps = next((a for a in eps_add.args[:2] if a not in (mean, *over_count)), eps_add.args[1])
    if isinstance(eps, torch.fx.Node):
        return f"eps is a tensor ({eps.name}), not a constant"
    x = mean.args[0].args[0]
    normalising = [u for u in root.users if is_call(u, aten.mul.Tensor, aten.div.Tensor) and x in u.args]
    chain = [mean.args[0], mean, *over_count, eps_add, root, *normalising[:1]]
    shared = users_outside(chain[:-1], allowed=chain)
    if shared:
        node, user = shared
        return f"intermediate {node.name} ({node.target}) is also used by {user.name}"
    return None


PASS = FusionPass(
    name="rms_norm",
    # DeepSeek-V4's hyper-connections: mhc_pre's form holds an unweighted RMSNorm over the n*D
    # streams, which this pass would otherwise take alone; kv_rmsnorm_rope_cache folds
    # DeepSeek's kv RMSNorm into its op: both must see their norms unfused
    after=("mhc_pre", "kv_rmsnorm_rope_cache"),
    fused_op="npu.npu_rms_norm",
    forms=FORMS,
    example={
        "x": lambda dtype: torch.empty(2, 3, 8, dtype=dtype),
        "weight": lambda dtype: torch.empty(8, dtype=dtype),
        # exactly representable in fp32, so F.rms_norm's float32 eps keeps it intact
        "eps": 2.0**-17,
    },
    check=check,
    anchor=anchor,
    anchor_ops=(aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar),
    explain=explain,
    # training graphs: x and the weight may need gradients (npu_rms_norm_backward gives both)
    differentiable=("x", "weight"),
)
