"""Per-site numerical verification (FusionConfig(verify=True)).

Before a match is accepted, the subgraph it would replace and the fused replacement run
on the same random inputs of the site's shapes and dtypes, and their outputs are
compared with the fused op's tolerance (capabilities: OpCapability.verify_ulps). A site that fails is not fused
(so never silently kept) and becomes a near miss with the measured error. On CPU the
fused ops run as the stand-in kernels, on an NPU as the real ones. A site of a training
(joint) graph is run forward and backward, with the same random incoming gradients on
both sides, and its gradients are compared too (verify_joint_match).

Tolerances are in units of the output dtype's epsilon at the output's scale,
|fused - original| <= ulps * eps(dtype) * max(|original|, 1 ulp): the fused ops round
once where the unfused code rounds after each op, so their differences are a few
roundings of values of the output's size, not relative to each element (a rotary output
near zero is a difference of two large products).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx

from .capabilities import capability
from .nodes import is_cast
from .tracing import trace_joint_without_decompositions

Node = torch.fx.Node

SEED = 0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str  # "max error 1.2e-07 = 0.5 ulp at scale 3.1 (tolerance 4 ulp)", or why not checked


def verify_match(*args: Any, **kwargs: Any) -> Verdict:
    """_verify_match on real tensors: the matcher may run under the compile's fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _verify_match(*args, **kwargs)


def _verify_match(nodes: Sequence[Node], outputs: Sequence[Optional[Node]], args: Mapping[str, Any],
                 arg_nodes: Mapping[str, Any], replace: Callable, argnames: Sequence[str],
                 fused_op: str, make_input: Optional[Callable[..., Any]] = None,
                 canonical: Optional[Callable[[list, dict], list]] = None) -> Verdict:
    """Run the matched subgraph and `replace` on the same inputs and compare.

    nodes/outputs: the match's nodes and output nodes; args/arg_nodes: the values (fake
    tensors, scalars) and graph nodes bound to each argument of the form; make_input:
    an optional factory (name, all fake args, the argument's node) -> real input or None,
    for arguments random values do not suit (offsets, indices, constant masks ...);
    canonical: puts both output lists in one canonical form before they are compared
    (Form.canonical_outputs).
    """
    generator = torch.Generator().manual_seed(SEED)
    inputs = _inputs(argnames, args, arg_nodes, make_input, generator)
    if isinstance(inputs, Verdict):
        return inputs
    try:
        original = _run_subgraph(nodes, outputs, arg_nodes, inputs)
    except _NotExtractable as exc:
        return Verdict(True, f"not verified: {exc}")
    with torch.no_grad():
        fused = replace(*[inputs[n] for n in argnames])
    fused = list(fused) if isinstance(fused, (tuple, list)) else [fused]
    if canonical is not None:
        original, fused = canonical(original, inputs), canonical(fused, inputs)
    return _compare(original, fused, fused_op)


def verify_joint_match(*args: Any, **kwargs: Any) -> Verdict:
    """_verify_joint_match on real tensors (see verify_match)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _verify_joint_match(*args, **kwargs)


def _verify_joint_match(nodes: Sequence[Node], outputs: Sequence[Optional[Node]], args: Mapping[str, Any],
                        arg_nodes: Mapping[str, Any], tangent_nodes: Mapping[str, Node], replace: Callable,
                        argnames: Sequence[str], fused_op: str,
                        make_input: Optional[Callable[..., Any]] = None) -> Verdict:
    """_verify_match for a joint (forward + backward) site: the matched forward and
    backward nodes, and the joint trace of `replace` (the fused op and its backward op),
    run on the same inputs and the same random incoming gradients (tangent_nodes:
    the match's tangents by name); their outputs, the forward results and the gradients
    of the form's arguments, are compared.

    Joint outputs are the search's [forward outputs..., gradient of each argument (None
    where there is none)], so which arguments require grad is read off the match.
    """
    generator = torch.Generator().manual_seed(SEED)
    inputs = _inputs(argnames, args, arg_nodes, make_input, generator)
    if isinstance(inputs, Verdict):
        return inputs
    tangents = {}
    for name, node in sorted(tangent_nodes.items(), key=lambda item: int(item[0].rsplit("_", 1)[1])):
        tangent = _random_like(node.meta.get("val"), generator)
        if tangent is None:
            return Verdict(True, f"not verified: {name} has a symbolic or unsupported shape")
        tangents[name] = tangent
    try:
        original = _run_subgraph(nodes, outputs, {**arg_nodes, **tangent_nodes}, {**inputs, **tangents})
    except _NotExtractable as exc:
        return Verdict(True, f"not verified: {exc}")
    forward_count = len(outputs) - len(argnames)
    needs_grad = {n for i, n in enumerate(argnames) if outputs[forward_count + i] is not None}
    primals = [inputs[n].detach().requires_grad_(n in needs_grad) if isinstance(inputs[n], torch.Tensor)
               else inputs[n] for n in argnames]
    joint = trace_joint_without_decompositions(replace, primals)
    with torch.no_grad():
        # an Interpreter binds placeholders by position: joint_fwd_bwd's renamed placeholders
        # (node primals_2 for input primals_1) make the module's generated code alias them
        fused = list(torch.fx.Interpreter(joint).run(
            *[p.detach() if isinstance(p, torch.Tensor) else p for p in primals], *tangents.values()))
    return _compare(original, fused, fused_op)


def _inputs(argnames: Sequence[str], args: Mapping[str, Any], arg_nodes: Mapping[str, Any],
            make_input: Optional[Callable[..., Any]], generator: torch.Generator):
    """Real inputs for the form's arguments, or a Verdict saying why there are none."""
    inputs = {}
    for name in argnames:
        value = args.get(name)
        made = make_input(name, args, arg_nodes.get(name)) if make_input else None
        if made is not None:
            inputs[name] = made
        elif isinstance(value, torch.Tensor):
            tensor = _random_like(value, generator)
            if tensor is None:
                return Verdict(True, f"not verified: argument {name} has symbolic or unsupported shape")
            inputs[name] = tensor
        else:
            inputs[name] = value
    return inputs


def _compare(original: Sequence[Any], fused: Sequence[Any], fused_op: str) -> Verdict:
    ulps_allowed, steps_allowed = capability(fused_op).verify_ulps, capability(fused_op).verify_integer_steps
    worst = 0.0
    for index, (orig, new) in enumerate(zip(original, fused)):
        if not isinstance(orig, torch.Tensor):
            continue
        if not isinstance(new, torch.Tensor) or orig.shape != new.shape or orig.dtype != new.dtype:
            described = f"{new.dtype}{list(new.shape)}" if isinstance(new, torch.Tensor) else repr(new)
            return Verdict(False, f"output {index}: {described} vs {orig.dtype}{list(orig.shape)}")
        if not orig.is_floating_point():
            steps = (orig.long() - new.long()).abs().max().item() if orig.numel() else 0
            if steps > steps_allowed:
                return Verdict(False, f"output {index}: integer results differ by {steps}"
                                      + (f" (more than {steps_allowed})" if steps_allowed else ""))
            continue
        error, scale = _error_in_ulps(new, orig)
        if not error <= ulps_allowed:  # also catches nan
            return Verdict(False, f"output {index}: error {error:.3g} ulp at scale {scale:.3g} "
                                  f"exceeds {ulps_allowed:g} ulp ({str(orig.dtype)[6:]})")
        worst = max(worst, error)
    return Verdict(True, f"verified: max error {worst:.2g} ulp at the output's scale (tolerance {ulps_allowed:g})")


class _NotExtractable(Exception):
    pass


def _random_like(fake: torch.Tensor, generator: torch.Generator) -> Optional[torch.Tensor]:
    shape = []
    for size in fake.shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            if hint is None:
                return None
            size = int(hint)
        shape.append(size)
    if fake.is_complex():
        real = torch.randn(*shape, 2, generator=generator)
        return torch.view_as_complex(real).to(fake.dtype).to(fake.device)
    if fake.is_floating_point():
        return torch.randn(*shape, generator=generator).to(fake.dtype).to(fake.device)
    if fake.dtype == torch.bool:
        return (torch.rand(*shape, generator=generator) > 0.5).to(fake.device)
    return torch.randint(0, 4, shape, generator=generator).to(fake.dtype).to(fake.device)


def _run_subgraph(nodes: Sequence[Node], outputs: Sequence[Optional[Node]],
                  arg_nodes: Mapping[str, Any], inputs: Mapping[str, Any], exact: bool = False) -> list[Any]:
    """Copy the matched nodes into a graph of their own and run it on `inputs`. exact: in
    float64, its casts between float dtypes left out (what the region computes, without the
    roundings it spells)."""
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for name, node in arg_nodes.items():
        if isinstance(node, Node):
            env[node] = graph.placeholder(name)
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    matched = set(nodes)

    def lookup(node: Node) -> Node:
        if node not in env:
            raise _NotExtractable(f"the subgraph reads {node.name}, which is not an argument of the form")
        return env[node]

    for node in sorted(matched - set(env), key=order.__getitem__):
        if exact and _float_cast(node):
            env[node] = lookup(node.args[0])
        else:
            env[node] = graph.node_copy(node, lookup)
    graph.output([env[n] if n is not None else None for n in outputs])
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    placeholders = [n.target for n in graph.nodes if n.op == "placeholder"]
    values = [inputs[name] for name in placeholders]
    if exact:
        values = [v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]
    with torch.no_grad():
        return list(module(*values))


def _float_cast(node: Node) -> bool:
    """A cast from a float dtype to another (what an exact run leaves out)."""
    if not is_cast(node) or not isinstance(node.args[0], Node):
        return False
    value, source = node.meta.get("val"), node.args[0].meta.get("val")
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (value, source))


def same_function(nodes: Sequence[Node], outputs: Sequence[Node], args: Mapping[str, Any],
                  arg_nodes: Mapping[str, Any], replace: Callable, argnames: Sequence[str], ulps: float,
                  make_input: Optional[Callable[..., Any]] = None) -> Verdict:
    """Whether the region `nodes` computes what `replace` does, as functions: both run on the
    same random inputs (verify_match's), the region in float64 without its casts, and every
    output of `replace` must be within `ulps` of its dtype, at the output's scale, of the
    region's exact value. A region that rounds an intermediate to a narrower dtype than the
    op computes in is the same function, computed less exactly (a Verdict that fails says
    which output differs and by how much; one that cannot run says so, and fails)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # real tensors, inside the compile's fake mode
        return _same_function(nodes, outputs, args, arg_nodes, replace, argnames, ulps, make_input)


def _same_function(nodes, outputs, args, arg_nodes, replace, argnames, ulps, make_input) -> Verdict:
    inputs = _inputs(argnames, args, arg_nodes, make_input, torch.Generator().manual_seed(SEED))
    if isinstance(inputs, Verdict):
        return Verdict(False, inputs.detail)
    try:
        exact = _run_subgraph(nodes, outputs, arg_nodes, inputs, exact=True)
    except (_NotExtractable, RuntimeError) as exc:
        return Verdict(False, f"the region does not run in float64: {exc}")
    with torch.no_grad():
        fused = replace(*[inputs[n] for n in argnames])
    fused = list(fused) if isinstance(fused, (tuple, list)) else [fused]
    worst = 0.0
    for index, (want, got) in enumerate(zip(exact, fused)):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return Verdict(False, f"output {index}: no tensor of the region's shape")
        error, scale = _error_in_ulps(got, want, got.dtype)
        if not error <= ulps:
            return Verdict(False, f"output {index}: {error:.3g} ulp at scale {scale:.3g} from the region's exact value "
                                  f"(more than {ulps:g} ulp of {str(got.dtype)[6:]})")
        worst = max(worst, error)
    return Verdict(True, f"max error {worst:.2g} ulp of the region's exact value at the output's scale")


def _error_in_ulps(actual: torch.Tensor, expected: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> tuple[float, float]:
    """(|actual - expected| in ulp of `dtype` (expected's) at expected's largest |value|, that scale)."""
    dtype = dtype or expected.dtype
    eps = torch.finfo(dtype).eps
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    scale = max(scale, torch.finfo(dtype).tiny)
    error = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    return error / (eps * scale), scale
