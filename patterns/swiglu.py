"""swiglu: silu(gate) * up, gate and up the two halves of one tensor -> npu_swiglu.

    npu_swiglu(x, dim=-1) = silu(x[..., :h]) * x[..., h:]      (h = x.shape[-1] // 2)

It activates the FIRST half (op_semantics.md 4.1). The forms: the halves taken with
chunk (transformers' MoE experts on the grouped_mm path: gate_up split), slicing or
split, and either operand order (Phi-3 and GLM-4 write `up * act(gate)`). The op computes
in fp32 and rounds once; the unfused bf16/fp16 code rounds after silu and after the
multiply, so the two differ by about one ulp there.

Gate and up from two separate projections (HF Llama / Qwen MLPs, torchtitan FeedForward)
are the two halves of one tensor once merged_projections has merged the projections, when
the backend compiles the model (merged_projections.py: in inference into one buffer of
weights, in training by concatenating the two weights in the graph on every step);
elsewhere (fuse() on an aot graph, the transform disabled or refused) they are reported:
npu_swiglu would need their outputs concatenated, one extra copy per step. GeGLU and other
gates (gelu, relu) are not SwiGLU and never match.
"""
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from npu_fx_fusion.capabilities import CAPABILITIES, unsupported
from npu_fx_fusion.matching import (RESHAPES, Form, FusionPass, NotEvaluable, Recognized, channels_of, is_backward,
                                    is_call, is_cast, tensor_meta, uneven_halves, users_outside)

aten = torch.ops.aten
SWIGLU = CAPABILITIES["npu.npu_swiglu"]


# ---- the unfused forms --------------------------------------------------------------------
def chunked(x):
    # transformers MoE experts (grouped_mm / batched_mm): gate, up = gate_up.chunk(2, -1);
    # Phi-3 / GLM-4 MLP: up_states * self.activation_fn(gate); torch.split(x, [h, h], -1).
    # The engine reads a split as its slices and a product in either order, and
    # g * sigmoid(g) as silu(g) (canonical.py, spellings.py): one form for all of them.
    # Spelled as the split at npu_swiglu's half: with a symbolic width s, chunk splits at
    # (s + 1) // 2, which only an even s makes the half (proven by the shape environment,
    # else a near miss: explain)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def sliced(x):
    # vLLM SiluAndMul: the same in inference; in training its gradient reaches x through
    # two slice_backwards where a split's comes back as one cat, so the joint graph differs
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


# silu written out as gate * sigmoid(gate) (Mamba-style and hand-written MLPs). A forward
# graph needs no form of its own for it (spellings.py reads g * sigmoid(g) as silu(g)), but
# autograd differentiates the product, not silu: its joint graph holds sigmoid_backward and a
# sum of two gradient terms where silu's holds silu_backward, so training needs these traces
def chunked_sigmoid(x):
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def sliced_sigmoid(x):
    half = x.shape[-1] // 2
    gate = x[..., :half]
    return gate * torch.sigmoid(gate) * x[..., half:]


# nGPT (olmo-core's NormalizedFeedForward): each half scaled per channel before the gate,
# silu(sw1 * gate) * (sw3 * up). That is silu(x1) * x2 of x scaled by cat(sw1, sw3) along its
# halves: npu_swiglu of the scaled x (scales of one number or one per channel: check)
def chunked_scaled(x, gate_scale, up_scale):
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate_scale * gate) * (up_scale * up)


def sliced_scaled(x, gate_scale, up_scale):
    half = x.shape[-1] // 2
    return F.silu(gate_scale * x[..., :half]) * (up_scale * x[..., half:])


# ---- the fused call -----------------------------------------------------------------------
def npu_swiglu(x):
    # the op takes contiguous input (capabilities: limits["contiguous"]); a no-op when it is
    return torch.ops.npu.npu_swiglu(x.contiguous(), -1)


def npu_swiglu_of_scaled_halves(x, gate_scale, up_scale):
    # one product by both scales, laid along x's halves, then the op (the model's two products
    # become one; the scaled x is in the dtype the model's products promote to)
    half = x.shape[-1] // 2
    scale = torch.cat([gate_scale.reshape(-1).expand(half), up_scale.reshape(-1).expand(half)])
    return npu_swiglu(x * scale)


FORMS = [Form(search, npu_swiglu, dtypes=(torch.float32,))
         for search in (chunked, sliced, chunked_sigmoid, sliced_sigmoid)]
FORMS += [Form(search, npu_swiglu_of_scaled_halves, dtypes=(torch.float32,))
          for search in (chunked_scaled, sliced_scaled)]


# ---- checks -------------------------------------------------------------------------------
def check(site):
    x = site["x"]
    reason = unsupported("npu.npu_swiglu", site.soc, x=x)
    if reason:
        return reason
    if "gate_scale" in site.args:
        reason = _scales_reason(x, site["gate_scale"], site["up_scale"])
        if reason:
            return reason
    if x.shape[-1] % SWIGLU.limits["split_dim_multiple"]:
        return f"the gate_up dim {x.shape[-1]} is odd: npu_swiglu halves it"
    if not SWIGLU.limits["empty"] and not statically_known_true(x.numel() != 0):
        # (a data-dependent row count, an expert's tokens in a per-expert loop: jetmoe, may be
        # zero, and asking would raise GuardOnDataDependentSymNode)
        return (f"the gate_up tensor {list(x.shape)} is or may be empty: npu_swiglu takes no empty "
                "tensors")
    return None


def _scales_reason(x, gate_scale, up_scale):
    """Why the scales are not ones the replacement lays side by side cheaply: one number or one
    per channel (a (h,) vector, size 1 along every other dim). A scale that varies along the rows
    would be concatenated in full, a copy of the size of x the two products did not make."""
    for name, scale in (("gate", gate_scale), ("up", up_scale)):
        if scale.dim() > x.dim():
            return f"the {name} scale {list(scale.shape)} has more dims than x {list(x.shape)}: the product adds some"
        if not all(statically_known_true(size == 1) for size in scale.shape[:-1]):
            return (f"the {name} scale {list(scale.shape)} varies along the rows, not only the channels: laid "
                    "beside the other half's scale it would be copied in full (x's size), more than the two "
                    "products it replaces")
    return None


# ---- near misses: a silu that gates a product but did not fuse ----------------------------
def _piece_of(node):
    """(source tensor, which half: 0 first / 1 second / None unknown) of a half-taking node."""
    if is_call(node, aten.slice.Tensor):
        start = node.args[2] if len(node.args) > 2 else 0
        return node.args[0], 0 if start == 0 else 1
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
        parent = node.args[0]
        if is_call(parent, aten.split.Tensor, aten.split_with_sizes.default):
            return parent.args[0], node.args[1]
    return None, None


def _is_silu(node):
    """silu(g), or g * sigmoid(g) (either order: the spelling the forms accept, spellings.py)."""
    if is_call(node, aten.silu.default):
        return True
    if not is_call(node, aten.mul.Tensor):
        return False
    a, b = node.args[:2]
    return any(is_call(s, aten.sigmoid.default) and s.args[0] is g for s, g in ((a, b), (b, a)))


def _gate_of(silu):
    if is_call(silu, aten.silu.default):
        return silu.args[0]
    a, b = silu.args[:2]
    return b if is_call(a, aten.sigmoid.default) and a.args[0] is b else a


def _silu_and_other(mul):
    """(silu node, the other factor) of a mul by a silu of a tensor, or None."""
    if _is_silu(mul) and not is_call(mul, aten.silu.default):
        return None  # g * sigmoid(g) itself: the silu, not a product gated by one
    silu = next((a for a in mul.args if isinstance(a, torch.fx.Node) and _is_silu(a)), None)
    other = next((a for a in mul.args if a is not silu), silu)  # silu(x) * silu(x): itself
    if silu is None or not isinstance(other, torch.fx.Node) or tensor_meta(other) is None:
        return None  # silu(x) * 2.0 scales an activation, it gates nothing
    return silu, other


_PROJECTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
                aten._grouped_mm.default, aten.matmul.default)


def _is_projection(node):
    return is_call(_unreshaped(node), *_PROJECTIONS)


def _unreshaped(node):
    while is_call(node, *RESHAPES):
        node = node.args[0]
    return node


def _reads_stacked_experts(projection):
    """The projection multiplies by a stacked (E, ., .) expert weight: the whole of it
    (_grouped_mm), or expert e of it (w[e], through transposes and casts)."""
    projection = _unreshaped(projection)
    weight = projection.args[1] if len(projection.args) > 1 else None
    while is_call(weight, aten.t.default, aten.transpose.int, aten.permute.default) or is_cast(weight):
        weight = weight.args[0]
    if is_call(weight, aten.select.int):
        weight = weight.args[0]
    meta = tensor_meta(weight)
    return meta is not None and meta.dim() == 3


def _scaled_projection(node):
    """The projection `node` is, or that `node` scales (a product of it by another factor), or None."""
    if _is_projection(node):
        return node
    if is_call(node, aten.mul.Tensor):
        return next((a for a in node.args[:2] if isinstance(a, torch.fx.Node) and _is_projection(a)), None)
    return None


def anchor(node):
    return is_call(node, aten.mul.Tensor) and _silu_and_other(node) is not None


def _unclamped(node):
    return node.args[0] if is_call(node, aten.clamp.default) else node


def explain(mul):
    silu, other = _silu_and_other(mul)
    gate = _gate_of(silu)
    clamped = is_call(gate, aten.clamp.default) and is_call(other, aten.clamp.default)
    gate, up = _unclamped(gate), _unclamped(other)
    gate_source, gate_half = _piece_of(gate)
    up_source, up_half = _piece_of(up)
    if clamped and gate_source is not None and gate_source is up_source:
        return ("gate and up are clamped (DeepSeek-V4's clamped SwiGLU): npu_swiglu has no clamp; the "
                "swiglu_group pass fuses it (cann_ops_nn.swiglu_group / npu_clipped_swiglu)")
    if gate_source is None or up_source is None or gate_source is not up_source:
        if _is_projection(gate) and _is_projection(up) and _reads_stacked_experts(gate) and _reads_stacked_experts(up):
            return ("gate and up come from separate projections, MoE experts' GEMMs by two stacked weights (w1, w3): "
                    "npu_swiglu needs them as the two halves of one product, by one (E, 2I, H) weight; "
                    "merged_projections merges nn.Linear weights "
                    "only (re-pointing stacked expert weights into one buffer would change their strides, and "
                    "dynamo would recompile), and concatenating them would add a copy of the experts per step")
        scaled = [_scaled_projection(node) for node in (gate, up)]
        if all(scaled) and (gate, up) != tuple(scaled):
            return ("gate and up come from separate projections, scaled before they meet (nGPT's sw1 * w1(x)): "
                    "npu_swiglu needs them as the two halves of one tensor, and merged_projections merges them "
                    "only where each scale is one number or one per channel (its report says why it did not)")
        if _is_projection(gate) and _is_projection(up):
            return ("gate and up come from separate projections: npu_swiglu needs them as the two "
                    "halves of one tensor (one gate_up projection), and concatenating them would "
                    "add a copy per step (merged_projections merges the projections where the backend "
                    "compiles the model; its report says why it did not)")
        return "the silu and the tensor it multiplies are not the two halves of one tensor"
    if gate_half == 1 and up_half == 0:
        return "silu is applied to the second half: npu_swiglu activates the first half"
    x = tensor_meta(gate_source)
    # (proofs, not comparisons: a near miss must not add a guard to the compiled graph)
    if x is not None and statically_known_true(x.shape[-1] % 2 == 1):
        return f"the gate_up dim {x.shape[-1]} is odd: npu_swiglu halves it"
    uneven = uneven_halves([gate, up], gate_source)
    if uneven is not None:
        return (f"the gate_up dim {x.shape[-1]} is split at {uneven}, not provably its half (x.chunk(2, -1) "
                "splits a symbolic d at (d + 1) // 2): npu_swiglu takes the halves of an even dim")
    pieces = [_gate_of(silu), other, silu] + ([a for a in silu.args if is_call(a, aten.sigmoid.default)]
                                              if not is_call(silu, aten.silu.default) else [])
    shared = users_outside(pieces, allowed=pieces + [mul])
    if shared:
        node, user = shared
        return f"intermediate {node.name} ({node.target}) is also used by {user.name}"
    return None


# ---- halves recognised by what they are ------------------------------------------------------
# The forms take the halves as slices, a split or a chunk. Any other way of taking them (an
# unbind of a (2, h) view, a `+ 0.0` offset, a cast, a view of the pieces) is found by
# reading the gate and the up factor of a silu-gated product with the channel algebra: each
# of their channels must be one channel of one tensor x, the gate the first half of x's
# channels and up the second, in order. Inference graphs: a training graph differentiates
# the silu, which the algebra does not model, so there only the forms fuse.
def recognize(graph, joint):
    found = []
    for mul in graph.find_nodes(op="call_function", target=aten.mul.Tensor):
        parts = _silu_and_other(mul) if not (joint and is_backward(mul)) else None
        if parts is None or (joint and any(is_backward(u) for u in mul.users)):
            continue
        silu, up = parts
        gate = _gate_of(silu)
        try:
            gate_value, up_value = channels_of(gate), channels_of(up)
        except NotEvaluable:
            continue
        halves = _halves(gate_value, up_value)
        if halves is None:
            continue
        nodes = _region_nodes(mul, silu, gate, up, halves[0] if not isinstance(halves, str) else None)
        if isinstance(halves, str):
            found.append(Recognized("silu-gated halves (channel algebra)", mul, nodes, reason=halves))
            continue
        x, tracked = halves
        shared = users_outside([n for n in nodes if n is not mul], allowed=nodes)
        if shared:
            node, user = shared
            found.append(Recognized("silu-gated halves (channel algebra)", mul, nodes,
                                    reason=f"intermediate {node.name} ({node.target}) is also used by {user.name}"))
            continue
        found.append(Recognized("silu-gated halves (channel algebra)", mul, nodes, {"x": x},
                                _gated_halves_replacement(tracked, tensor_meta(mul)),
                                {"x": _operand(x, tracked, tensor_meta(mul))}))
    return found


def _selection(value):
    """(leaf, tracked dims, [x's channel per channel], the constants added) when every channel
    of `value` is one channel of one tensor as it is (plus a constant), else None."""
    leaf, tracked, picked, constants = None, None, [], set()
    for poly in value.channels:
        if isinstance(poly, dict):
            poly = dict(poly)
            constants.add(poly.pop((), 0.0))
        if isinstance(poly, dict) and len(poly) == 1:
            (mono, coef), = poly.items()
            if coef == 1.0 and len(mono) == 1:
                factor = value.factor(mono[0])
                if factor.part == 0 and leaf in (None, factor.leaf) and tracked in (None, factor.tracked):
                    leaf, tracked = factor.leaf, factor.tracked
                    picked.append(factor.index)
                    continue
        return None
    return (leaf, tracked, picked, constants) if leaf is not None else None


def _halves(gate_value, up_value):
    """(x, tracked dims) when gate and up are x's first and second halves; a reason when
    they are two pieces of x npu_swiglu cannot take; None when they are not pieces of one x."""
    gate, up = _selection(gate_value), _selection(up_value)
    if gate is None or up is None or gate[0] is not up[0] or gate[1] != up[1]:
        return None
    x, tracked, gate_channels, gate_constants = gate
    up_channels, up_constants = up[2], up[3]
    if len(gate_channels) != len(up_channels) or set(gate_channels) & set(up_channels):
        return None  # a broadcast, or the same channels twice (silu(x) * x): not two halves
    offset = next((c for c in (*gate_constants, *up_constants) if c != 0.0), None)
    if offset is not None:
        return f"a constant {offset} is added to the gate or up half: npu_swiglu computes silu(gate) * up alone"
    width = len(gate_channels)
    total = 1
    for size in tensor_meta(x).shape[tensor_meta(x).dim() - tracked:]:
        total *= int(size)
    if total % 2:
        return f"the gate_up dim {total} is odd: npu_swiglu halves it"
    if gate_channels == list(range(width)) and up_channels == list(range(width, 2 * width)) and total == 2 * width:
        return x, tracked
    if gate_channels == list(range(width, 2 * width)) and up_channels == list(range(width)):
        return "silu is applied to the second half: npu_swiglu activates the first half"
    if total != 2 * width:
        return (f"gate and up are {width} channels each of a tensor of {total}: npu_swiglu takes a tensor "
                "that is exactly the two halves")
    return "gate and up are not x's first and second halves (interleaved or reordered channels)"


def _region_nodes(mul, silu, gate, up, x):
    """The product, the silu, and every node between x and the two factors."""
    nodes, stack = {mul, silu}, [gate, up]
    if not is_call(silu, aten.silu.default):
        nodes.update(a for a in silu.args if isinstance(a, torch.fx.Node) and is_call(a, aten.sigmoid.default))
    while stack:
        node = stack.pop()
        if node in nodes or node is x or x is None or node.op != "call_function":
            continue
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    return sorted(nodes)


def _operand(x, tracked, out):
    value = tensor_meta(x)
    lead = tuple(value.shape[:value.dim() - tracked])
    width = 1
    for size in value.shape[value.dim() - tracked:]:
        width *= int(size)
    return value.new_empty((*lead, width), dtype=out.dtype)


def _gated_halves_replacement(tracked, out):
    def npu_swiglu_recognized(x):
        lead = x.shape[:x.dim() - tracked]
        width = 1
        for size in x.shape[x.dim() - tracked:]:
            width *= size
        y = torch.ops.npu.npu_swiglu(x.reshape(*lead, width).to(out.dtype).contiguous(), -1)
        return y.reshape(out.shape if all(isinstance(s, int) for s in out.shape) else (*lead, *out.shape[len(lead):]))

    return npu_swiglu_recognized


PASS = FusionPass(
    name="swiglu",
    fused_op="npu.npu_swiglu",
    forms=FORMS,
    example={"x": lambda dtype: torch.empty(2, 3, 8, dtype=dtype),
             # the scales per channel, as nGPT's (the check reads any broadcast)
             "gate_scale": lambda dtype: torch.empty(4, dtype=dtype),
             "up_scale": lambda dtype: torch.empty(4, dtype=dtype)},
    check=check,
    anchor=anchor,
    anchor_ops=(aten.mul.Tensor,),
    explain=explain,
    # training graphs: npu_swiglu_backward gives x's gradient
    differentiable=("x", "gate_scale", "up_scale"),
    recognize=recognize,
)
