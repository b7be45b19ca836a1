"""Linear layers that read one input, merged into one matmul on their concatenated weights.

q/k/v and gate/up are separate nn.Linear layers in most model code: three (two) matmuls
where a serving model launches one (vLLM's QKVParallelLinear / MergedColumnParallelLinear,
TensorRT-LLM AutoDeploy's fuse_gemms). With weights that do not change (inference), the
layers become one linear on the weights concatenated along the output dim, its output
split back; the swiglu pass then fuses silu(gate) * up on the halves of one tensor.

Where the weights come from. The aot graphs the passes see take parameters as inputs, and
a concatenation in the graph would copy every weight on every step. Inductor's freezing
(torch/_inductor/freezing.py) makes parameters graph constants and folds the cat at
compile time; torchair would embed such a constant in its GE graph as a copy
(ge/_ge_graph.py Const serialises the tensor), and the model would hold its weights twice.
So the merge happens one level up, on the dynamo graph, where the backend holds the real
parameters (its example inputs):
- the weights are copied once into one buffer, and each parameter's storage is re-pointed
  to its rows of it (`param.data = buffer[a:b]`): the model holds each weight once, in
  place, and state_dict(), load_state_dict() and in-place updates see the same memory;
- the buffer becomes a parameter of the dynamo GraphModule, so aot_autograd lifts it into
  a graph input like any weight (torchair marks it a parameter, a frozen input with
  `frozen_parameter`), and the graph reads it with one matmul.
A later compile of the same model (a recompile, the prefill graph next to the decode one)
finds the parameters already laid out in a merged buffer and reuses it.

When the user rebinds a parameter (`p.data = t`, a new nn.Parameter assigned to the
module), the buffer would be stale: the backend wraps the compiled callable with a check
per call that each merged parameter still has its address in the buffer (a data_ptr
comparison per parameter), and if not, copies its new values into the buffer and points it
there again (`MergedWeights.check`). A parameter of another module in its place (dynamo
calls a graph it compiled for a method frame with every instance's parameters) is copied
in for that call only and the merged module's weights put back. In-place updates (copy_,
load_state_dict, optimizers) need nothing. A dtype or device change (`model.to(...)`)
recompiles (dynamo's guards) and merges again.

In training the optimizer updates each parameter, and the gradient of a merged buffer would
not reach them. There only a SwiGLU's gate and up linears (outputs that meet as
silu(gate) * up) are merged, with `torch.cat` of their weights in the graph: a copy of both
weights on every step, which autograd differentiates back into each weight's own gradient,
and which buys one matmul for two (forward, and the input's and the weights' gradients)
and npu_swiglu with its backward in place of silu * mul.

Not merged, each a near miss with its reason: other linears of training graphs, linears with and
without a bias in one group, weights of different dtypes, devices or input sizes, a weight
that is a view into some other buffer (FSDP's flat parameters), a weight that is not a
parameter of the model, a weight that is not a plain tensor (a DTensor shard, a quantized or
fake tensor). Linears inside a torch.autocast region are left out of every group. The merged buffer is not saved by safetensors' save_file as is:
the parameters share its storage (torch.save keeps the sharing; clone them to save apart).
"""
from __future__ import annotations

import logging
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from .canonical import DYNAMO_PRODUCTS, dynamo_call
from .report import FusedSite, NearMiss, PassResult, SourceLocation

log = logging.getLogger("npu_fx_fusion")

Node = torch.fx.Node
PASS_NAME = "merged_projections"
FUSED_OP = "one linear on the concatenated weights"
# the spellings of nn.Linear / F.linear in a dynamo graph
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)  # noqa: SLF001
_SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")

# Buffers made so far, by the data pointer of their storage: a later compile of the same
# parameters reuses the buffer they already view.
_BUFFERS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


@dataclass
class _Group:
    """The linears of one input, in graph order (a SwiGLU's two: gate, then up)."""

    input: Node
    linears: list[Node]
    weights: list[torch.Tensor] = field(default_factory=list)
    biases: list[Optional[torch.Tensor]] = field(default_factory=list)


@dataclass
class MergedWeights:
    """What one compile merged: the per-call check of the parameters it re-pointed."""

    # (argument index of the parameter in the compiled callable, the buffer rows it views,
    # a weak reference to the parameter merged)
    views: list[tuple[int, torch.Tensor, Callable[[], Optional[torch.Tensor]]]] = field(default_factory=list)
    result: PassResult = field(default_factory=lambda: PassResult(PASS_NAME))
    # dynamo's fake tensor of each re-pointed parameter, by argument index (`trace_inputs`)
    fakes: dict = field(default_factory=dict)
    # the warning about another module's parameters was given (once per compiled graph)
    warned: bool = False

    def trace_inputs(self, example_inputs: Sequence[Any]) -> list:
        """The example inputs for aot_autograd: a re-pointed parameter as dynamo's fake
        tensor of it. aot_autograd fakeifies real inputs again with the symbolic context
        dynamo recorded for them, storage offset 0 included; a parameter that is now a view
        at another offset would not match it, and its fake (made before) is what it was."""
        return [self.fakes.get(index, value) for index, value in enumerate(example_inputs)]

    def check(self, args: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Point every merged parameter back at its rows of the buffer if the user rebound it
        (its new values copied there first): one data_ptr comparison per parameter.

        Another module's parameter in its place (dynamo reuses a graph it compiled for a
        method frame for every instance of the module: litgpt's experts, called one by one
        after a graph break) is not re-pointed: that would overwrite the merged module's
        weights. Its values are copied into the rows for this call; returns (rows, what
        they held) for the caller to put back after it."""
        borrowed = []
        for position, (index, rows, merged) in enumerate(self.views):
            param = args[index]
            if param.data_ptr() == rows.data_ptr():
                continue
            original = merged()
            if original is None or param is original:  # rebound, or replaced (the old one is gone)
                _repoint(param, rows)
                self.views[position] = (index, rows, weakref.ref(param))
                continue
            if not self.warned:
                self.warned = True
                log.warning("merged_projections: a compiled graph is called with another module's parameters "
                            "(dynamo reuses it for every instance of a module): their weights are copied into "
                            "the merged buffer for each such call. Compile per instance, or "
                            "FusionConfig(merge_projections=False), to avoid the copies")
            with torch.no_grad():
                borrowed.append((rows, rows.clone()))
                rows.copy_(param.detach())
        return borrowed

    def wrap(self, compiled: Callable) -> Callable:
        """`compiled`, checking the merged parameters before each call."""
        if not self.views:
            return compiled
        check = self.check

        def checked(*args: Any) -> Any:
            borrowed = check(args[0] if len(args) == 1 and isinstance(args[0], list)
                             and getattr(compiled, "_boxed_call", False) else args)
            try:
                return compiled(*args)
            finally:
                with torch.no_grad():
                    for rows, held in borrowed:  # the merged module's own weights, back in place
                        rows.copy_(held)

        checked.__dict__.update(getattr(compiled, "__dict__", {}))
        checked.__wrapped__ = compiled  # type: ignore[attr-defined]
        return checked


def _repoint(param: torch.Tensor, rows: torch.Tensor) -> None:
    with torch.no_grad():
        rows.copy_(param.detach())
    param.data = rows
    log.info("merged_projections: a rebound parameter %s was copied back into its merged buffer",
             tuple(param.shape))


def merge_projections(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], verify: bool = False) -> MergedWeights:
    """Merge the linears of `gm` (a dynamo graph) that share an input, in place (module
    docstring). Returns what it did: the per-call check and the report of sites and near
    misses. verify (FusionConfig.verify): each group's merged linear is first compared with
    its separate linears on a random input, and one that differs is not merged."""
    merged = MergedWeights()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    real = {node: value for node, value in zip(placeholders, example_inputs)}
    index_of = {node: index for index, node in enumerate(placeholders)}
    groups = _groups(gm.graph)
    training = torch.is_grad_enabled()
    for group in groups:
        reason = _refusal(group, real)
        # in training, the gradient of a merged buffer would not reach the parameters
        per_step = reason is None and training and _needs_gradients(group)
        if per_step and not _gates_a_swiglu(group):
            reason = _TRAINING
        elif reason is None and not per_step:
            reason = _layout_refusal(group)
        verified = ""
        if reason is None and verify:
            ok, verified = _verdict(group)
            reason = None if ok else f"verification failed: {verified}"
        if reason is not None:
            merged.result.near_misses.append(NearMiss(PASS_NAME, reason, _location(group.linears)))
            continue
        if per_step:
            _rewrite(gm, group, *_concatenated_in_the_graph(gm, group))
            merged.result.sites.append(FusedSite(
                PASS_NAME, "gate and up linears of a SwiGLU, in training", FUSED_OP, _location(group.linears),
                "the weights are concatenated in the graph on every step (a copy of both; autograd splits "
                "their gradient back), so the swiglu pass fuses silu(gate) * up and one matmul replaces two, "
                "forward and backward", verified, replaced=tuple(n.name for n in group.linears)))
            continue
        buffer, bias_buffer, note = _buffers(group)
        for linear, bias, (start, stop) in zip(group.linears, group.biases, _rows(group)):
            for node, rows in ((linear.args[1], buffer.data[start:stop]),
                               (_bias_node(linear), None if bias is None else bias_buffer.data[start:stop])):
                if rows is not None:
                    merged.views.append((index_of[node], rows, weakref.ref(real[node])))
                    merged.fakes[index_of[node]] = node.meta["example_value"]
        _rewrite(gm, group, buffer, bias_buffer)
        merged.result.sites.append(FusedSite(
            PASS_NAME, f"{len(group.linears)} linears on one input", FUSED_OP, _location(group.linears), note,
            verified, replaced=tuple(n.name for n in group.linears)))
    if merged.result.sites:
        gm.graph.lint()
        gm.recompile()
    return merged


# The merged linear sums each output's products as the separate one does; a BLAS may block
# the wider matmul differently: float rounding at the output's scale (verify.py's measure)
VERIFY_ULPS = 4


def _verdict(group: _Group) -> tuple[bool, str]:
    """The merged linear against the separate ones on a random input (before anything is
    moved: the concatenation is a temporary copy of this group's weights)."""
    from .verify import SEED, _error_in_ulps

    first = group.weights[0]
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(4, first.shape[1], generator=generator).to(first.dtype).to(first.device)
    biases = group.biases if group.biases[0] is not None else [None] * len(group.weights)
    with torch.no_grad():
        separate = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(group.weights, biases)], -1)
        merged = torch.nn.functional.linear(x, torch.cat(list(group.weights)),
                                            None if biases[0] is None else torch.cat(list(biases)))
    error, _ = _error_in_ulps(merged, separate)
    ok = error <= VERIFY_ULPS
    return ok, (f"verified: max error {error:.2g} ulp at the output's scale (tolerance {VERIFY_ULPS})" if ok
                else f"error {error:.3g} ulp exceeds {VERIFY_ULPS}")


def _groups(graph: torch.fx.Graph) -> list[_Group]:
    by_input: dict[Node, _Group] = {}
    # a linear inside a torch.autocast region computes in autocast's dtype, its neighbours
    # outside in theirs: it is merged with none of them
    autocast = _under_autocast(graph)
    for node in graph.nodes:
        if (node.op == "call_function" and node.target in _LINEARS and isinstance(node.args[0], Node)
                and node not in autocast):
            by_input.setdefault(node.args[0], _Group(node.args[0], [])).linears.append(node)
    groups = []
    for group in by_input.values():
        # a SwiGLU's gate and up merge by themselves, gate first: npu_swiglu takes them as the
        # two halves of one tensor, activating the first. Merged with other linears of the
        # input (a MoE block's router next to its shared expert) they would be two pieces of
        # a wider one, and the swiglu pass could not fuse them
        pairs = _swiglu_pairs(group.linears)
        paired = {linear for pair in pairs for linear in pair}
        rest = [linear for linear in group.linears if linear not in paired]
        groups.extend(_Group(group.input, list(pair)) for pair in pairs)
        if len(rest) > 1:
            groups.append(_Group(group.input, rest))
    return groups


def _under_autocast(graph: torch.fx.Graph) -> set:
    """The nodes between a torch.autocast region's _enter_autocast and _exit_autocast (dynamo
    keeps the region in its graph): their dtypes are autocast's (torchtitan's routers run
    under autocast to fp32, which the NPU emulation takes, the experts beside them do not)."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    inside, depth = set(), 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _enter_autocast:
            depth += 1
        elif node.op == "call_function" and node.target is _exit_autocast:
            depth = max(depth - 1, 0)
        elif depth:
            inside.add(node)
    return inside


def _bias_node(linear: Node) -> Any:
    return linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")


_TRAINING = ("a training graph: the weights need gradients of their own (the optimizer updates each parameter), "
             "so they stay separate (only a SwiGLU's gate and up are merged in training, concatenated on every "
             "step: there the merge lets npu_swiglu replace silu(gate) * up)")


def _gates_a_swiglu(group: _Group) -> bool:
    """Two linears whose outputs meet as silu(one) * other (F.silu, or g * sigmoid(g)), in
    either order: where a per-step concatenation of their weights buys a fused npu_swiglu."""
    return len(group.linears) == 2 and bool(_swiglu_pairs(group.linears))


def _swiglu_pairs(linears: Sequence[Node]) -> list[tuple[Node, Node]]:
    """(gate, up) for each two of `linears` whose outputs meet as silu(gate) * up, each
    linear in one pair at most."""
    pairs, taken = [], set()
    for gate in linears:
        silus = [] if gate in taken else [silu for g in _scaled_per_channel(gate) for silu in _silus_of(g)]
        for silu in silus:
            up = next((other for other in linears if other is not gate and other not in taken
                       and any(_is_product_of(user, silu, u) for user in silu.users
                               for u in _scaled_per_channel(other))), None)
            if up is not None:
                pairs.append((gate, up))
                taken.update((gate, up))
                break
    return pairs


def _scaled_per_channel(node: Node) -> list[Node]:
    """`node`, and its products by a per-channel tensor (nGPT's sw1 * gate, sw1 of shape (h,)): what
    the swiglu pass still reads as a half of the merged output (patterns/swiglu.py, the scaled
    forms)."""
    def per_channel(factor: Any) -> bool:
        value = factor.meta.get("example_value") if isinstance(factor, Node) else None
        return (isinstance(value, torch.Tensor) and value.dim() > 0
                and all(isinstance(size, int) and size == 1 for size in value.shape[:-1]))

    return [node] + [user for user in node.users
                     if dynamo_call(user, DYNAMO_PRODUCTS, "mul") and len(user.args) == 2 and node in user.args
                     and per_channel(user.args[1] if user.args[0] is node else user.args[0])]


def _silus_of(node: Node) -> list[Node]:
    """The users of `node` that compute silu(node): F.silu(node), or node * sigmoid(node)."""
    def is_silu(user: Node) -> bool:
        if dynamo_call(user, (torch.nn.functional.silu,), "silu"):
            return user.args[0] is node
        return (dynamo_call(user, DYNAMO_PRODUCTS, "mul") and node in user.args[:2]
                and any(dynamo_call(a, (torch.sigmoid, torch.nn.functional.sigmoid), "sigmoid") and a.args[0] is node
                        for a in user.args[:2]))

    return [user for user in node.users if is_silu(user)]


def _is_product_of(node: Node, a: Node, b: Node) -> bool:
    return dynamo_call(node, DYNAMO_PRODUCTS, "mul") and set(node.args[:2]) == {a, b}


def _concatenated_in_the_graph(gm: torch.fx.GraphModule, group: _Group) -> tuple[Node, Optional[Node]]:
    """torch.cat of the group's weights (and biases) in the graph, in front of its first linear."""
    first = min(group.linears)
    with gm.graph.inserting_before(first):
        weight = gm.graph.call_function(torch.cat, ([linear.args[1] for linear in group.linears],), {"dim": 0})
        bias = None
        if group.biases[0] is not None:
            bias = gm.graph.call_function(torch.cat, ([_bias_node(linear) for linear in group.linears],), {"dim": 0})
    return weight, bias


def _needs_gradients(group: _Group) -> bool:
    return any(t.requires_grad for t in group.weights + [b for b in group.biases if b is not None])


def _refusal(group: _Group, real: dict) -> Optional[str]:
    """The first reason not to merge `group`, or None (filling its weights and biases)."""
    weights = [linear.args[1] for linear in group.linears]
    if len(set(weights)) != len(weights):
        return "two of the linears use the same weight"
    for node in weights:
        value = real.get(node)
        if not isinstance(value, torch.nn.Parameter):
            return f"weight {node.name} is not a parameter of the model (computed in the graph or passed in)"
        group.weights.append(value)
    for linear in group.linears:
        bias = _bias_node(linear)
        value = real.get(bias) if isinstance(bias, Node) else None
        if bias is not None and not isinstance(value, torch.nn.Parameter):
            return f"the bias of {linear.name} is not a parameter of the model"
        group.biases.append(value)
    with_bias = [b is not None for b in group.biases]
    if any(with_bias) and not all(with_bias):
        return ("some of the linears have a bias and others none: one linear would need a zero bias for "
                "the others (a buffer of its own)")
    tensors = group.weights + [b for b in group.biases if b is not None]
    subclass = next((t for t in tensors if type(t.data) is not torch.Tensor), None)
    if subclass is not None:
        # a DTensor's local shard, a quantized or fake tensor: its storage is not one the
        # weights' rows can be re-pointed into
        return (f"a weight is a {type(subclass.data).__name__}, not a plain tensor (tensor-parallel shards "
                "and quantized weights stay separate)")
    first = group.weights[0]
    if any(w.dim() != 2 for w in group.weights):
        return "a weight is not 2-d"
    if len({t.dtype for t in tensors}) > 1:
        return f"the weights are of different dtypes ({', '.join(sorted({str(t.dtype)[6:] for t in tensors}))})"
    if len({t.device for t in tensors}) > 1:
        return "the weights are on different devices"
    if any(w.shape[1] != first.shape[1] for w in group.weights):
        return "the weights take inputs of different sizes"
    return None


def _layout_refusal(group: _Group) -> Optional[str]:
    """Each weight owns its storage (then it is copied into a new buffer), or all of them
    are already the rows of one buffer of ours, in this order (a second compile)."""
    if _existing_buffer(group.weights) is not None:
        if any(b is not None for b in group.biases) and _existing_buffer(group.biases) is None:
            return "the weights are merged already, their biases differently"
        return None
    for tensor in group.weights + [b for b in group.biases if b is not None]:
        if tensor.untyped_storage().data_ptr() in _BUFFERS:
            return "a weight is merged already, with other weights (another compiled graph merged them)"
        if (not tensor.is_contiguous() or tensor.storage_offset() != 0
                or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()):
            return ("a weight is a view into a larger buffer (a flat parameter): re-pointing it would "
                    "detach it from that buffer")
    return None


def _existing_buffer(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The buffer of ours whose consecutive rows the tensors are, exactly, else None."""
    buffer = _BUFFERS.get(tensors[0].untyped_storage().data_ptr())
    if buffer is None:
        return None
    start = 0
    for tensor in tensors:
        stop = start + tensor.shape[0]
        if stop > buffer.shape[0] or tensor.data_ptr() != buffer[start:stop].data_ptr():
            return None
        start = stop
    return buffer if start == buffer.shape[0] else None


def _rows(group: _Group) -> list[tuple[int, int]]:
    rows, start = [], 0
    for weight in group.weights:
        rows.append((start, start + weight.shape[0]))
        start += weight.shape[0]
    return rows


def _buffers(group: _Group) -> tuple[torch.Tensor, Optional[torch.Tensor], str]:
    """The merged weight (and bias) buffer, made now or found; the site's note."""
    buffer = _existing_buffer(group.weights)
    biased = group.biases[0] is not None
    if buffer is not None:
        return buffer, _existing_buffer(group.biases) if biased else None, "reused the buffer of an earlier compile"
    buffer = _concatenate(group.weights)
    bias_buffer = _concatenate(group.biases) if biased else None
    size = buffer.numel() * buffer.element_size()
    return buffer, bias_buffer, (f"the weights were moved into one buffer of {size / 1e6:.3g} MB, "
                                 "each parameter now a view of its rows (no copy kept)")


def _concatenate(tensors: Sequence[torch.Tensor]) -> torch.nn.Parameter:
    """One buffer holding `tensors` along dim 0; each tensor re-pointed to its rows.

    The buffer is a parameter (the graph module that reads it lifts it as one); each of
    the re-pointed parameters keeps it alive (`_npu_fx_fusion_merged`), so that a later
    compile finds it for as long as the model lives."""
    first = tensors[0]
    # a normal tensor even under torch.inference_mode(): the parameters become views of it,
    # and an inference tensor could not be updated in place outside that mode later
    # (load_state_dict, an optimizer)
    with torch.inference_mode(False):
        buffer = torch.nn.Parameter(torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]),
                                                dtype=first.dtype, device=first.device), requires_grad=False)
    start = 0
    with torch.inference_mode(False), torch.no_grad():
        for tensor in tensors:
            rows = buffer.data[start:start + tensor.shape[0]]
            rows.copy_(tensor.detach())
            tensor.data = rows
            tensor._npu_fx_fusion_merged = buffer  # noqa: SLF001
            start += tensor.shape[0]
    _BUFFERS[buffer.untyped_storage().data_ptr()] = buffer
    return buffer


def _rewrite(gm: torch.fx.GraphModule, group: _Group, buffer: Any, bias_buffer: Any) -> None:
    """linear(x, w_i, b_i) for each i -> split(linear(x, W, B), sizes, -1)[i]. W, B: merged
    buffers (tensors, registered here) or nodes computing them."""
    graph = gm.graph
    first = min(group.linears)  # (in graph order; a SwiGLU's up may come before its gate)
    with graph.inserting_before(first):
        weight = buffer if isinstance(buffer, Node) else graph.get_attr(_register(gm, buffer))
        bias = bias_buffer if bias_buffer is None or isinstance(bias_buffer, Node) else \
            graph.get_attr(_register(gm, bias_buffer))
        merged = graph.call_function(torch._C._nn.linear, (group.input, weight, bias))  # noqa: SLF001
        parts = graph.call_function(torch.split, (merged, [w.shape[0] for w in group.weights]), {"dim": -1})
        for node in (weight, merged, parts) + ((bias,) if bias is not None else ()):
            _copy_source_meta(first, node)
        for index, linear in enumerate(group.linears):
            part = graph.call_function(operator.getitem, (parts, index))
            _copy_source_meta(linear, part)
            linear.replace_all_uses_with(part)
    for linear in group.linears:
        graph.erase_node(linear)


def _register(gm: torch.fx.GraphModule, buffer: torch.nn.Parameter) -> str:
    """`buffer` as a parameter of `gm`: aot_autograd lifts it into a graph input, with a
    source of its own in dynamo's record of the module's parameters (aot_autograd's
    _try_get_metadata_from_dynamo requires one per lifted parameter)."""
    from torch._dynamo.source import ConstantSource

    index = 0
    while hasattr(gm, f"npu_fx_fusion_merged_{index}"):
        index += 1
    name = f"npu_fx_fusion_merged_{index}"
    gm.register_parameter(name, buffer)
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        sources[name] = ConstantSource(name)
    return name


def _copy_source_meta(donor: Node, node: Node) -> None:
    for key in _SOURCE_META:
        if key in donor.meta:
            node.meta[key] = donor.meta[key]
    if "example_value" in donor.meta and node.op == "call_function" and node.target is operator.getitem:
        node.meta["example_value"] = donor.meta["example_value"]


def _location(linears: Sequence[Node]) -> SourceLocation:
    for node in linears:
        location = SourceLocation.of(node)
        if location.file:
            return location
    return SourceLocation.of(linears[0])
