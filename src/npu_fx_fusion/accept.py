"""Running one pass over one graph: find its patterns, accept or refuse each match, replace.

torch's PatternMatcherPass walks the graph from the patterns' anchor ops and matches
each registration structurally (registry.py: sizes and scalars are wildcards there).
Every structural match then goes through the acceptance chain, in this order, and the
first check that fails is the reason the site is not fused (a near miss in the report):

1. the exact match: the form's search, retraced at the match's own shapes and scalars,
   must match the same nodes (slice bounds, view sizes, the eps literal ...);
2. in a joint graph, arguments bound to forward values and tangents to backward ones;
3. each argument of the right kind (a tensor, or a constant scalar);
4. no matched node with a keyword argument the form does not compute;
5. every emitted op lowerable in the torchair mode;
6. the pass's own check (hardware limits, layouts, proofs about the uses);
7. the replacement's outputs of the same shapes and dtypes as the subgraph's;
8. with FusionConfig(verify=True), numerically equal on random inputs (verify.py).

Everything one run learns (accepted sites, refusals by node, caches valid for this
graph's fake mode) lives in a RunContext that is created per run and handed to every
check: nothing is kept on the pass or the module between runs.
"""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonical import is_backward
from .capabilities import not_lowerable
from .forms import Form, FusionPass, Reason, Site
from .registry import PatternSet, Registration, pattern_set
from .report import FusedSite, NearMiss, PassResult, location_of
from .tracing import TRACERS, is_static, signature

log = logging.getLogger("npu_fx_fusion.matching")

Node = torch.fx.Node


@dataclass
class RunContext:
    """One run of one pass over one graph."""

    fusion_pass: FusionPass
    patterns: PatternSet
    soc: Optional[str]
    mode: Optional[str]
    verify: bool = False
    joint: bool = False  # matching joint patterns on a joint graph
    sites: list[FusedSite] = field(default_factory=list)
    rejections: dict[Node, tuple[Form, str]] = field(default_factory=dict)
    # structural matches the exact retrace turned down: a weaker diagnosis than a check's
    # (the pass's own explain() says more), used where nothing else says why
    inexact: dict[Node, str] = field(default_factory=dict)
    from_tangents: dict[Node, bool] = field(default_factory=dict)  # memo of _reads_tangents
    # Traces valid for this graph only: their fake values belong to its fake mode, and
    # symbolic sizes name values of its shape env. Every layer of a model repeats the same
    # signatures, so one trace per (registration kind, form, signature) serves them all:
    # torch's matcher only reads a replacement graph (copies it into the graph).
    replacements: dict = field(default_factory=dict)
    exact_patterns: dict = field(default_factory=dict)
    inserted: list[Node] = field(default_factory=list)
    out_of_order: bool = False  # a replacement reads a node defined after it

    def reject(self, form: Form, nodes: Sequence[Node], reason: str) -> None:
        for node in nodes:
            self.rejections.setdefault(node, (form, reason))

    def reason(self, node: Node) -> Reason:
        return self.rejections[node][1] if node in self.rejections else None


def apply_pass(fusion_pass: FusionPass, gm: torch.fx.GraphModule, soc: Optional[str] = None,
               mode: Optional[str] = None, verify: bool = False, joint: bool = False) -> Optional[PassResult]:
    """Fuse every accepted match of `fusion_pass` in `gm` in place; report sites and near misses.

    soc: the SoC whose limits to honour; mode: the torchair mode the graph is lowered in
    (a form whose op that mode cannot lower is refused, so a later form can serve);
    verify: check each site numerically before accepting it. joint: `gm` is a joint
    forward+backward graph (canonical.normalize_joint_graph'ed): the pass's joint patterns
    run (its forward-only ones with forward_forms_on_joint), and only forward nodes anchor
    near misses; None when the pass has nothing to match there.
    """
    patterns = pattern_set(fusion_pass)
    ctx = RunContext(fusion_pass, patterns, soc, mode, verify, joint)
    anchors = (lambda node: not is_backward(node)) if joint else (lambda node: True)
    if fusion_pass.prefilter is not None and not fusion_pass.prefilter(gm.graph):
        return _near_misses(ctx, gm, PassResult(fusion_pass.name), anchors)  # no form can match here
    registrations = _registrations(fusion_pass, patterns, joint)
    if registrations is None:
        return None
    if may_match(patterns, registrations, gm.graph):
        count = _matcher(ctx, registrations).apply(gm)
        if count != len(ctx.sites):  # the matcher and our bookkeeping must agree
            raise RuntimeError(f"{fusion_pass.name}: matcher replaced {count} sites, accepted {len(ctx.sites)}")
        _inherit_source_meta([n for n in ctx.inserted if not n._erased])  # noqa: SLF001
        if ctx.sites and (joint or ctx.out_of_order):
            # a replacement is inserted before the first node it replaces, and may read a
            # value the graph computes later (Gemma's 1 + w; in a joint graph, the backward
            # half): sort (stable: the rest keeps its order)
            pm.stable_topological_sort(gm.graph)
        if ctx.sites and joint:
            gm.graph.eliminate_dead_code()
    result = PassResult(fusion_pass.name)
    result.sites = ctx.sites[::-1]  # the matcher walks the graph backwards: source order
    return _near_misses(ctx, gm, result, anchors)


def _registrations(fusion_pass: FusionPass, patterns: PatternSet, joint: bool) -> Optional[Sequence[Registration]]:
    if not joint:
        return patterns.forward
    if fusion_pass.differentiable and patterns.joint:
        return patterns.joint
    return patterns.forward if fusion_pass.forward_forms_on_joint else None


def may_change(fusion_pass: FusionPass, graph: torch.fx.Graph, joint: bool = False) -> bool:
    """Whether apply_pass could change `graph`: False when no registration of the pass can
    start a match in it (it then only looks for near misses)."""
    if fusion_pass.prefilter is not None and not fusion_pass.prefilter(graph):
        return False
    patterns = pattern_set(fusion_pass)
    registrations = _registrations(fusion_pass, patterns, joint)
    return bool(registrations) and may_match(patterns, registrations, graph)


def may_match(patterns: PatternSet, registrations: Sequence[Registration], graph: torch.fx.Graph) -> bool:
    """Whether `graph` has a node any of `registrations` could start a match from."""
    return any(graph.find_nodes(op=op, target=target) for op, target in patterns.anchors(registrations))


class _Replacement(pm.ReplacementPatternEntry):
    """torch's replacement entry, telling the run what it inserted."""

    def __init__(self, ctx: RunContext, registration: Registration):
        super().__init__(pattern=registration.pattern,
                         extra_check=lambda match: _accept(ctx, registration, match),
                         normalize_args=_replacement_arguments(registration.form.argnames))
        self.ctx = ctx

    def apply(self, match: pm.Match, graph: torch.fx.Graph, node: Node) -> None:
        added = self.replace_with_graph(match, graph, match.replacement_graph, self.normalize_args(**match.kwargs))
        if added is None:  # torch versions that do not say what they inserted: sort anyway
            self.ctx.out_of_order = True
            return
        self.ctx.inserted.extend(added)
        self.ctx.out_of_order = self.ctx.out_of_order or _reads_later_node(added)


def _replacement_arguments(argnames: Sequence[str]) -> Callable[..., list]:
    """The replacement's arguments from a match's kwargs: the form's, then any tangents
    (joint replacements take the incoming gradients as their last inputs)."""

    def normalize(**kwargs: Any) -> list:
        args = [kwargs.pop(name) for name in argnames]
        for i in itertools.count(1):
            if f"tangents_{i}" not in kwargs:
                break
            args.append(kwargs.pop(f"tangents_{i}"))
        return args

    return normalize


def _reads_later_node(added: Sequence[Node]) -> bool:
    """A node of `added` reads a node the graph defines after it."""
    new = set(added)
    return any(arg not in new and not arg < node for node in added for arg in node.all_input_nodes)


def _matcher(ctx: RunContext, registrations: Sequence[Registration]) -> pm.PatternMatcherPass:
    """A PatternMatcherPass for this run, its checks bound to `ctx` (cheap: the patterns
    themselves are built once, in the PatternSet)."""
    matcher = pm.PatternMatcherPass(pass_name=f"npu_fx_fusion.{ctx.fusion_pass.name}")
    for registration in registrations:
        _Replacement(ctx, registration).register(matcher)
    return matcher


# ---- the acceptance chain ------------------------------------------------------------------
def _accept(ctx: RunContext, registration: Registration, match: pm.Match) -> bool:
    """torch's matcher asks this of every structural match: fuse it?"""
    form = registration.form
    exact = _exact_match(ctx, registration, match)
    if isinstance(exact, str):
        for node in match.nodes:
            ctx.inexact.setdefault(node, exact)
        return False
    site, exact_match, args = exact
    replacement: list = []  # the replacement's trace, made by the output check
    reason = _first_failure(ctx, registration, site, exact_match, args, replacement)
    if reason is not None:
        log.debug("%s: not fusing %s at %s: %s", ctx.fusion_pass.name, form.name,
                  location_of(exact_match.nodes), reason)
        ctx.reject(form, exact_match.nodes, reason)
        return False
    match.replacement_graph = replacement[0]
    ctx.sites.append(FusedSite(ctx.fusion_pass.name, form.name, form.fused_op or ctx.fusion_pass.fused_op,
                               location_of(exact_match.nodes), "; ".join(_notes(ctx, site)), site.verified))
    return True


def _exact_match(ctx: RunContext, registration: Registration, match: pm.Match):
    """(site, exact match, traced arguments) of a structural match, or why there is none.

    The structural pattern took every size and scalar as a wildcard; here the form's search
    is traced again at the match's own shapes, dtypes and scalars, and that trace must
    match the same nodes exactly (as torch's register_replacement does, with the traces
    kept per signature, and the scalars read from the match itself: a retrace that
    names them by their example values would take a model size equal to an example for
    the scalar).
    """
    form = registration.form
    argnames = form.argnames
    missing = [name for name in argnames if name not in match.kwargs]
    if missing:
        return f"the pattern binds no {missing[0]}"
    arg_nodes = {name: match.kwargs[name] for name in argnames}
    values = {name: (node.meta.get("val") if isinstance(node, Node) else node) for name, node in arg_nodes.items()}
    if any(isinstance(arg_nodes[n], Node) and values[n] is None for n in argnames):
        return "the matched nodes carry no tensor metadata (meta['val'])"
    fake_mode = torch._guards.detect_fake_mode(list(values.values()))  # noqa: SLF001
    if fake_mode is None:
        return "the matched nodes carry no fake tensors"
    args, sym_args = [], []
    with fake_mode:
        for name in argnames:
            value = values[name]
            if isinstance(value, torch.Tensor):
                grad = name in registration.requires_grad
                if grad and not value.is_floating_point():
                    return f"{name} is {value.dtype} here, but the form takes it as differentiable"
                value = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                            device=value.device, requires_grad=grad)
                for size in itertools.chain(value.shape, value.stride()):
                    if isinstance(size, torch.SymInt) and all(statically_known_true(size != a) for a in sym_args):
                        sym_args.append(size)
            args.append(value)
        exact = _exact_pattern(ctx, registration, args, sym_args)
    if isinstance(exact, str):
        return exact
    exact_match = exact.match(match.output_nodes()[0])
    if not pm.is_match(exact_match):
        return f"{form.name} has its structure, but differs in sizes or constants: {exact_match}"
    site_args = {name: values[name] for name in argnames}
    site_nodes = {name: exact_match.kwargs.get(name, arg_nodes[name]) for name in argnames}
    site = Site(form, site_args, list(exact_match.nodes), site_nodes, ctx.soc, ctx.mode)
    return site, exact_match, args


def _exact_pattern(ctx: RunContext, registration: Registration, args: list, sym_args: list):
    """The form's search traced at `args` as an exact pattern (sizes and scalars literal),
    or why it does not trace; kept per signature (process-wide when static)."""
    form = registration.form
    key = (registration.kind, form.key, signature([*sym_args, *args]))
    cache = ctx.patterns.exact_patterns if key[-1] is not None and is_static(key[-1]) else ctx.exact_patterns
    if key in cache:
        return cache[key]
    trace = TRACERS[registration.kind]
    argnames = form.argnames
    try:
        if sym_args:
            # make_fx dedupes symbolic sizes of its inputs: pass them as inputs, so the
            # trace reads them as the graph does (its own SymInt inputs), not as sym_size
            def search_with_sizes(*args_and_sizes: Any) -> Any:
                return form.search(*args_and_sizes[len(sym_args):])

            gm = trace(search_with_sizes, [*sym_args, *args])
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            size_names = [p.target for p in placeholders[:len(sym_args)]]
            for placeholder, name in zip(placeholders[len(sym_args):], argnames):
                with gm.graph.inserting_after(placeholder):
                    renamed = gm.graph.placeholder(name)
                renamed.target = renamed.name
                placeholder.replace_all_uses_with(renamed)
                gm.graph.erase_node(placeholder)
            argnames = [*size_names, *argnames]
        else:
            gm = trace(form.search, args)
    except RuntimeError as exc:
        found: Any = f"{form.name} does not trace at this site's shapes: {type(exc).__name__}: {exc}"
    else:
        found = pm.fx_to_pattern(gm, argnames=argnames)
    if key[-1] is not None:
        cache[key] = found
    return found


def _first_failure(ctx: RunContext, registration: Registration, site: Site, match: pm.Match,
                   args: list, replacement: list) -> Reason:
    form = site.form
    return ((_joint_roles_swapped(match, ctx) if ctx.joint else None)
            or _argument_kinds_differ(ctx.fusion_pass, site)
            or _unexpected_keyword(site.nodes, ctx.patterns.keywords[form])
            or next(filter(None, (not_lowerable(op, ctx.mode) for op in ctx.patterns.emitted_ops[form])), None)
            or ctx.fusion_pass.check(site)
            or _outputs_differ(ctx, registration, site, match, args, replacement)
            or (_verify(ctx, site, match) if ctx.verify else None))


def _argument_kinds_differ(fusion_pass: FusionPass, site: Site) -> Reason:
    for name in site.form.argnames:
        value = site.args.get(name)
        if not fusion_pass.is_scalar(name) and not isinstance(value, torch.Tensor):
            return f"{name} is {value!r}, not a tensor"
        if fusion_pass.is_scalar(name) and isinstance(site.arg_nodes.get(name), Node):
            return f"{name} is a tensor computed in the graph, not a constant"
    return None


# Keyword arguments a matched node may carry beyond what a form spells out: they place or
# type the result (and a wrong dtype shows up in the output check), they never change the
# arithmetic. Anything else (add's alpha, div's rounding_mode, ...) does.
_HARMLESS_KEYWORDS = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking",
                                "memory_format", "keepdim"})


def _unexpected_keyword(nodes: Sequence[Node], spelled: frozenset) -> Reason:
    """torch's matcher drops node kwargs its pattern lacks (pattern_matcher.py,
    _TargetArgsExpr._match), so `torch.add(x, r, alpha=2)` matches `x + r`. Reject those;
    `spelled` are the (op, keyword, value) the form's search has, and the matcher compared."""
    for node in nodes:
        if not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            continue
        defaults = {a.name: a.default_value for a in node.target._schema.arguments  # noqa: SLF001
                    if a.has_default_value()}
        for key, value in node.kwargs.items():
            if (str(node.target), key, repr(value)) in spelled:
                continue
            if key not in _HARMLESS_KEYWORDS and (key not in defaults or defaults[key] != value):
                return f"{node.name} ({node.target}) has {key}={value!r}, which the form does not compute"
    return None


def _replacement_graph(ctx: RunContext, registration: Registration, args: list) -> torch.fx.GraphModule:
    """The replacement traced at the site's arguments, one trace per signature per graph."""
    form = registration.form
    trace = TRACERS[registration.kind]
    key = (registration.kind, form.key, signature(args))
    if key[-1] is None:
        return trace(form.replace, args)
    if key not in ctx.replacements:
        ctx.replacements[key] = trace(form.replace, args)
    return ctx.replacements[key]


def _outputs_differ(ctx: RunContext, registration: Registration, site: Site, match: pm.Match,
                    args: list, replacement: list) -> Reason:
    """The replacement must compute outputs of the shapes and dtypes the subgraph computes:
    this catches type promotion (an fp32 weight on a bf16 activation) and broadcasting,
    whatever a pattern's own check forgot."""
    graph = _replacement_graph(ctx, registration, args)
    replacement.append(graph)
    (output,) = graph.graph.find_nodes(op="output")
    fused = [n.meta.get("val") if isinstance(n, Node) else n for n in _flat(output.args[0])]
    originals = [n.meta.get("val") if n is not None else None for n in match.output_nodes()]
    for index, (orig, new) in enumerate(zip(originals, fused)):
        if not isinstance(orig, torch.Tensor):
            continue
        if not isinstance(new, torch.Tensor):
            return f"{ctx.fusion_pass.fused_op} would give no tensor where the model computes {_describe(orig)} (output {index})"
        if orig.dtype != new.dtype or orig.shape != new.shape:
            return (f"{ctx.fusion_pass.fused_op} would give {_describe(new)} where the model computes "
                    f"{_describe(orig)} (output {index})")
    return None


def _flat(value: Any) -> list:
    return [v for item in value for v in _flat(item)] if isinstance(value, (list, tuple)) else [value]


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _verify(ctx: RunContext, site: Site, match: pm.Match) -> Reason:
    from .verify import Verdict, verify_joint_match, verify_match

    fusion_pass = ctx.fusion_pass
    fused_op = site.form.fused_op or fusion_pass.fused_op
    make_input = functools.partial(_verification_input, fusion_pass)
    tangents = {name: node for name, node in match.kwargs.items() if name.startswith("tangents_")}
    if not tangents:
        verdict = verify_match(match.nodes, match.output_nodes(), site.args, site.arg_nodes,
                               site.form.replace, site.form.argnames, fused_op,
                               make_input, site.form.canonical_outputs)
    elif site.form.canonical_outputs is not None:
        # outputs equal only up to an order the model ignores (a top-k's k experts): the
        # incoming gradients of the two sides would have to be reordered alike
        verdict = Verdict(True, "not verified: its outputs are compared in a canonical order, "
                                "which random incoming gradients do not follow")
    else:
        verdict = verify_joint_match(match.nodes, match.output_nodes(), site.args, site.arg_nodes,
                                     tangents, site.form.replace, site.form.argnames, fused_op, make_input)
    site.verified = verdict.detail
    return None if verdict.ok else f"verification failed: {verdict.detail}"


def _verification_input(fusion_pass: FusionPass, name: str, args: Any, node: Any = None) -> Any:
    # A value the graph computes from no input (a causal mask built from aranges) is
    # verified as what it is, not as random data; then the pass's own factory.
    from .constants import evaluate_constant

    constant = evaluate_constant(node)
    if constant is not None:
        return constant
    return fusion_pass.verify_input(name, args) if fusion_pass.verify_input else None


def _notes(ctx: RunContext, site: Site) -> list[str]:
    notes = []
    # A form turned down over some of these nodes: say why this one serves instead.
    turned_down = next((ctx.rejections[n] for n in site.nodes if n in ctx.rejections), None)
    if turned_down is not None:
        form, reason = turned_down
        if form.search is site.form.search:  # an alternative replacement of one form
            notes.append(f"instead of {form.replace.__name__}: {reason}")
        else:
            notes.append(f"partial: the larger form {form.name} was turned down ({reason})")
    notes += site.notes
    if ctx.mode is None:  # emulation: say what torchair's GE mode would refuse
        notes += [reason for op in ctx.patterns.emitted_ops[site.form]
                  if (reason := not_lowerable(op, "max-autotune"))]
    return notes


def _joint_roles_swapped(match: pm.Match, ctx: RunContext) -> Reason:
    """A joint match must bind the search's arguments to forward values and its tangents to
    backward ones. A pattern whose backward repeats its forward op (a matmul's gradients
    are matmuls) also matches with the roles swapped: a backward GEMM read as the forward,
    the model's input read as the incoming gradient. The values may even be the same, but
    the replacement's forward half would then sit in the backward. Told apart by whether
    a value is computed from a tangent (the tags aot_autograd puts on backward nodes are
    missing on nodes an earlier replacement inserted)."""
    for name, value in match.kwargs.items():
        if not isinstance(value, Node):
            continue
        tangent = name.startswith("tangents_")
        if tangent != _reads_tangents(value, ctx.from_tangents):
            which = "the incoming gradient" if tangent else "a forward input"
            return f"{value.name} bound as {which} ({name}) is {'not ' if tangent else ''}computed from a tangent"
    return None


def _reads_tangents(node: Node, memo: dict) -> bool:
    """node is computed from a joint graph's tangents (memoised; the answer of a node never
    changes while the graph is rewritten, replacements compute the same values)."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        if n.op == "placeholder":
            memo[n] = str(n.target).startswith("tangents")
            stack.pop()
            continue
        pending = [a for a in n.all_input_nodes if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[n] = any(memo[a] for a in n.all_input_nodes)
        stack.pop()
    return memo[node]


# ---- near misses ---------------------------------------------------------------------------
def _near_misses(ctx: RunContext, gm: torch.fx.GraphModule, result: PassResult,
                 anchors: Callable[[Node], bool]) -> PassResult:
    """Every anchor no form consumed: the check that turned it down, or the pass's
    explanation, or that no form matched it."""
    fusion_pass = ctx.fusion_pass
    for node in gm.graph.nodes:
        if anchors(node) and fusion_pass.anchor(node):
            reason = ctx.reason(node) or fusion_pass.explain(node) or _no_form_matched(ctx.patterns.forms)
            if node in ctx.inexact and reason.startswith("matches none of the forms"):
                reason += f" (closest: {ctx.inexact[node]})"
            result.near_misses.append(NearMiss(fusion_pass.name, reason, location_of([node, *node.users])))
    return result


def _no_form_matched(forms: Sequence[Form]) -> str:
    # forms spelled in several operand orders share a base name: "name[cos*x]"
    names = list(dict.fromkeys(form.name.split("[")[0] for form in forms))
    return f"matches none of the forms {', '.join(names)}"


_SOURCE_META = ("stack_trace", "nn_module_stack")


def _inherit_source_meta(new_nodes: Sequence[Node]) -> None:
    """Give replacement nodes the source line of the code they replaced.

    The pattern matcher copies it onto the replacement's output node only; the fused op
    call under a getitem would otherwise have no source line in dumps and reports.
    """
    for node in reversed(new_nodes):
        for key in _SOURCE_META:
            if key not in node.meta:
                donor = next((u for u in node.users if key in u.meta), None)
                if donor is not None:
                    node.meta[key] = donor.meta[key]
