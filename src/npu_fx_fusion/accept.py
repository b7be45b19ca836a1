"""Running one pass over one graph: find its patterns, accept or refuse each match, replace.

torch's PatternMatcherPass walks the graph from the patterns' anchor ops and matches
each registration structurally (registry.py: sizes and scalars are wildcards there).
Every structural match then goes through the acceptance chain, in this order, and the
first check that fails is the reason the site is not fused (a near miss in the report):

1. the exact match: the form's search, retraced at the match's own shapes and scalars,
   must match the same nodes (slice bounds, view sizes, the eps literal ...);
2. in a joint graph, arguments bound to forward values and tangents to backward ones;
3. every matched node in one torchair scope (a stream, a super kernel ...);
4. each argument of the right kind (a tensor, or a constant scalar: a number or a string);
5. no matched node with a keyword argument the form does not compute;
6. every emitted op lowerable in the torchair mode;
7. the pass's own check (hardware limits, layouts, proofs about the uses);
8. the replacement's outputs of the same shapes and dtypes as the subgraph's;
9. with FusionConfig(verify=True), numerically equal on random inputs (verify.py).

Everything one run learns (accepted sites, refusals by node, caches valid for this
graph's fake mode) lives in a RunContext that is created per run and handed to every
check: nothing is kept on the pass or the module between runs.
"""
from __future__ import annotations

import functools
import itertools
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonical import is_backward, same_shape
from .capabilities import not_lowerable
from .insertion import (_inherit_kept_calls, _inherit_source_meta, _reads_later_node, insert_replacement,
                        trace_input)
from .forms import Form, FusionPass, Reason, Site
from .nodes import constant_on_a_size_range, known_equal
from .recognition import RecognitionRun, recognized_sites
from .registry import (SCALAR_ARGUMENT, PatternSet, Registration, anchor_of, deep_patterns, keyword_value,
                       pattern_set)
from .replay import MatchShape
from .report import FusedSite, NearMiss, PassResult, location_of
from .spellings import match as match_commutative
from .spellings import may_occur, ops_present, prefilter, respell_exact
from .tracing import TRACERS, failure_is_an_answer, is_joint_kind, is_static, signature

log = logging.getLogger("npu_fx_fusion.matching")

Node = torch.fx.Node


@dataclass
class RunContext:
    """One run of one pass over one graph."""

    fusion_pass: FusionPass
    patterns: Optional[PatternSet]  # None: a run that only looks for near misses
    soc: Optional[str]
    mode: Optional[str]
    verify: bool = False
    joint: bool = False  # matching on a joint graph
    # matching a differentiable pass's forward forms on a joint graph: only at sites no
    # gradient flows through (_differentiated)
    gradient_free_only: bool = False
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
    fake_mode: Any = None  # the graph's (what its nodes' fake values belong to)
    keep_intermediate_rounding: bool = False  # FusionConfig's: Site.keep_intermediate_rounding
    dedicated_groups: frozenset = frozenset()  # FusionConfig.ep_group's: Site.dedicated_groups
    # called before the pass's check first runs, and so before the run can change the
    # graph (the caller's revert snapshot: a run without a candidate takes none)
    before_change: Optional[Callable[[], None]] = None
    # the torchair scope of each node of the graph ({}: none), read on first use (_scopes_differ)
    scopes: Optional[dict] = None
    # near misses of recognised regions said only where no other near miss is (Recognized.fallback)
    fallback_misses: list[NearMiss] = field(default_factory=list)

    def reject(self, form: Form, nodes: Sequence[Node], reason: str) -> None:
        for node in nodes:
            self.rejections.setdefault(node, (form, reason))

    def reason(self, node: Node) -> Reason:
        return self.rejections[node][1] if node in self.rejections else None


@deep_patterns()  # matching and the exact retraces recurse per pattern node
def apply_pass(fusion_pass: FusionPass, gm: torch.fx.GraphModule, soc: Optional[str] = None,
               mode: Optional[str] = None, verify: bool = False, joint: bool = False,
               keep_intermediate_rounding: bool = False,
               before_change: Optional[Callable[[], None]] = None,
               from_tangents: Optional[dict] = None,
               dedicated_groups: frozenset = frozenset()) -> Optional[PassResult]:
    """Fuse every accepted match of `fusion_pass` in `gm` in place; report sites and near misses.

    soc: the SoC whose limits to honour; mode: the torchair mode the graph is lowered in
    (a form whose op that mode cannot lower is refused, so a later form can serve);
    verify: check each site numerically before accepting it; before_change: called before
    the pass's check first runs on a candidate (and may be called again); from_tangents: which
    nodes of `gm` are computed from its tangents, as far as known (a memo the passes over
    one joint graph share: rewrites never change the answer for a node). joint: `gm` is a joint
    forward+backward graph (canonical.normalize_joint_graph'ed): the pass's joint patterns
    run (its forward-only ones with forward_forms_on_joint), and only forward nodes anchor
    near misses; None when the pass has nothing to match there.
    """
    anchors = (lambda node: not is_backward(node)) if joint else (lambda node: True)
    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = torch._guards.detect_fake_mode(inputs)  # noqa: SLF001
    from_tangents = {} if from_tangents is None else from_tangents
    if fusion_pass.prefilter is not None and not fusion_pass.prefilter(gm.graph):
        # no form can match here: nothing to register
        ctx = RunContext(fusion_pass, None, soc, mode, verify, joint, fake_mode=fake_mode,
                         keep_intermediate_rounding=keep_intermediate_rounding, before_change=before_change,
                         from_tangents=from_tangents, dedicated_groups=dedicated_groups)
        result = PassResult(fusion_pass.name)
        return _near_misses(ctx, gm, result, _recognize(ctx, gm, result, anchors) or anchors)
    patterns = pattern_set(fusion_pass)
    ctx = RunContext(fusion_pass, patterns, soc, mode, verify, joint, fake_mode=fake_mode,
                     keep_intermediate_rounding=keep_intermediate_rounding, before_change=before_change,
                     from_tangents=from_tangents, dedicated_groups=dedicated_groups)
    which = _which_registrations(fusion_pass, patterns, joint)
    if which is None and not (joint and fusion_pass.recognize is not None and fusion_pass.differentiable):
        return None
    candidates = None  # the anchors left unfused, where known
    if which is not None and _has_anchor(patterns, which == "joint", gm.graph):
        registrations = patterns.joint if which == "joint" else patterns.forward
        count = _run_matcher(ctx, registrations, gm.graph)
        if which == "joint" and _has_anchor(patterns, False, gm.graph):
            candidates = fusion_pass.candidate_anchors(gm.graph, anchors)
            if candidates:
                # a site no gradient flows through has no backward to fuse (DeepSeek-V4's
                # indexer: its top-k indices are not differentiated): its forward form fuses
                # it here, not a near miss here and a fusion in the partitioned forward graph
                ctx.gradient_free_only = True
                count += _run_matcher(ctx, patterns.forward, gm.graph)
        if count != len(ctx.sites):  # the matcher and our bookkeeping must agree
            raise RuntimeError(f"{fusion_pass.name}: matcher replaced {count} sites, accepted {len(ctx.sites)}")
        _inherit_source_meta([n for n in ctx.inserted if not n._erased])  # noqa: SLF001
        if ctx.sites and ctx.out_of_order:
            # a replacement is inserted before the first node it replaces, and may read a
            # value the graph computes later (Gemma's 1 + w): sort (stable: the rest keeps
            # its order), and in a joint graph keep the backward after the forward
            pm.stable_topological_sort(gm.graph)
            if joint:
                backward_after_forward(gm.graph)
    result = PassResult(fusion_pass.name)
    result.sites = ctx.sites[::-1]  # the matcher walks the graph backwards: source order
    recognized_anchors = _recognize(ctx, gm, result, anchors)
    if recognized_anchors is not None:
        candidates = None  # replacements erased some anchors: walk the graph again
        anchors = recognized_anchors
    return _near_misses(ctx, gm, result, anchors, candidates)


def _recognize(ctx: RunContext, gm: torch.fx.GraphModule, result: PassResult,
               anchors: Callable[[Node], bool]) -> Optional[Callable[[Node], bool]]:
    """The pass's recognised sites (recognition.py), after its forms: fused ones join
    `result`; a refused one is the near miss of the anchors in its region, or one of its
    own where it holds none. Returns None when none fused, else the anchors the near-miss
    walk goes on with: `anchors` among the nodes the graph had before the replacements
    (what they inserted, a fused call's own plumbing such as a table's sign flip as
    cat(-a, b), is no site of its own)."""
    fusion_pass = ctx.fusion_pass
    if fusion_pass.recognize is None:
        return None
    present = set(gm.graph.nodes)
    reads_gradient = (lambda n: _reads_tangents(n, ctx.from_tangents)) if ctx.joint else None
    run = RecognitionRun(fusion_pass, ctx.soc, ctx.mode, ctx.fake_mode, ctx.verify, ctx.keep_intermediate_rounding,
                         ctx.before_change, reads_gradient, ctx.dedicated_groups)
    sites, refused = recognized_sites(run, gm.graph, ctx.joint)
    if sites:
        _inherit_source_meta([n for n in gm.graph.nodes if n.op == "call_function" and "stack_trace" not in n.meta])
        pm.stable_topological_sort(gm.graph)
        if ctx.joint:
            backward_after_forward(gm.graph)
    result.sites.extend(sites)
    for found, miss in refused:
        held = [n for n in found.nodes if not n._erased and anchors(n) and fusion_pass.anchor(n)]  # noqa: SLF001
        if found.fallback:
            ctx.fallback_misses.append(miss)
        elif held:
            ctx.reject(Form(_named(found.name), found.replace or _named(found.name)), held, miss.reason)
        else:
            result.near_misses.append(miss)
    return (lambda node: node in present and anchors(node)) if sites else None


def _named(name: str) -> Callable:
    def recognized(*_: Any) -> None:
        raise NotImplementedError("a recognised site has no search function")

    recognized.__name__ = name
    return recognized


def backward_after_forward(graph: torch.fx.Graph) -> int:
    """Move the backward nodes of a joint graph after its forward ones (stably); returns
    how many moved.

    A joint replacement puts a site's backward op next to its forward op, and torch's
    default_partition (torchair's) "respects the original placement of ops": every node
    up to the last forward one goes into the forward graph. With two sites, the first
    one's backward would be taken for forward, and partitioning fails ("getitem_N was
    invalid, but is output"). A node moves when it reads a tangent or autograd made it
    for the backward, and every user of it moves too (so no forward node loses an input).
    """
    nodes = list(graph.nodes)
    memo: dict = {}
    movable: set = set()
    for node in reversed(nodes):
        if node.op in ("placeholder", "output"):
            continue
        if (_reads_tangents(node, memo) or is_backward(node)) and all(
                user.op == "output" or user in movable for user in node.users):
            movable.add(node)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    last_forward = max((i for i, n in enumerate(body) if n not in movable), default=-1)
    first = next((i for i, n in enumerate(body[:last_forward]) if n in movable), None)
    if first is None:
        return 0
    # from the first backward node before a forward one on, every backward node moves, in
    # order (a later one may read an earlier one)
    moving = [n for n in body[first:] if n in movable]
    output = next(iter(graph.find_nodes(op="output")))
    for node in moving:
        output.prepend(node)
    return len(moving)


def _which_registrations(fusion_pass: FusionPass, patterns: PatternSet, joint: bool) -> Optional[str]:
    """"forward" or "joint": the registrations to run; None: none apply to a joint graph."""
    if not joint:
        return "forward"
    if fusion_pass.differentiable and patterns.anchors(joint=True):
        return "joint"
    return "forward" if fusion_pass.forward_forms_on_joint else None


def _has_anchor(patterns: PatternSet, joint: bool, graph: torch.fx.Graph) -> bool:
    """Whether `graph` has a node a registration could start a match from."""
    return any(graph.find_nodes(op=op, target=target) for op, target in patterns.anchors(joint))


class _Replacement(pm.ReplacementPatternEntry):
    """torch's replacement entry, inserting with insert_replacement and telling the run
    what it inserted."""

    def __init__(self, ctx: RunContext, registration: Registration, pattern: pm.PatternExpr):
        super().__init__(pattern=pattern,
                         extra_check=lambda match: _accept(ctx, registration, match),
                         normalize_args=_replacement_arguments([*registration.form.argnames,
                                                                *registration.form.bound]))
        self.ctx, self.registration = ctx, registration
        self.may_match = prefilter(pattern)  # shared by the patterns that test the same

    def apply(self, match: pm.Match, graph: torch.fx.Graph, node: Node) -> None:
        replaced = sorted(match.nodes)  # in graph order, while they are in the graph
        ctx = self.ctx
        reads_gradient = (lambda n: _reads_tangents(n, ctx.from_tangents)) if ctx.joint else None
        added = insert_replacement(match, graph, match.replacement_graph, self.normalize_args(**match.kwargs),
                                   ctx.fake_mode, reads_gradient)
        _inherit_kept_calls(added, [n for n in replaced if n._erased])  # noqa: SLF001
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


def _run_matcher(ctx: RunContext, registrations: Sequence[Registration], graph: torch.fx.Graph) -> int:
    """Match and replace `registrations` in `graph`; returns the number of sites replaced.

    torch's PatternMatcherPass.apply, less what serves Inductor only: its test of every
    candidate node for a CPU fallback (which asks Inductor's lowering about each node, a
    third of this pass's time) and its graph-transform observer. As there: candidates are
    every node a pattern can start from, latest first (in a joint graph, forward nodes
    only); a match that crosses a mutation (an in-place op between its nodes) or a stream
    boundary is skipped.
    """
    entries = defaultdict(list)
    for registration in registrations:
        for pattern in registration.spelled:
            entries[anchor_of(pattern)].append(_Replacement(ctx, registration, pattern))
    if pm.should_compute_mutation_region_ids(graph):
        pm.compute_mutation_region_ids(graph)
    candidates = sorted(itertools.chain.from_iterable(
        graph.find_nodes(op=op, target=target, sort=False) for op, target in entries), reverse=True)
    if ctx.joint:  # a joint pattern starts from its forward output: never a backward node
        candidates = [node for node in candidates if not is_backward(node)]
    present = ops_present(graph.nodes)
    occurs: dict = {}  # pattern -> may_occur in the graph (again once a replacement adds an op)
    count = 0
    for node in candidates:
        tested: dict = {}  # prefilter -> its verdict at this node
        for entry in entries[(node.op, node.target)]:
            if node._erased:  # noqa: SLF001 - replaced by an earlier match
                break
            occur = occurs.get(entry.pattern)
            if occur is None:
                occur = occurs[entry.pattern] = may_occur(entry.pattern, present)
            if not occur:
                continue
            may = tested.get(entry.may_match)
            if may is None:
                may = tested[entry.may_match] = entry.may_match(node)
            if not may:  # its arguments' ops rule it out
                continue
            match = _known_exact_match(ctx, entry.registration, node) or match_commutative(entry.pattern, node)
            if not pm.is_match(match):
                continue
            if len({pm.get_mutation_region_id(graph, n) for n in match.nodes}) != 1:
                continue
            if len({n.meta.get("custom", {}).get("stream", 0) for n in match.nodes}) != 1:
                continue
            if entry.extra_check(match):
                count += 1
                inserted = len(entry.ctx.inserted)
                entry.apply(match, graph, node)
                added = ops_present(entry.ctx.inserted[inserted:])
                if not added <= present:
                    present |= added
                    occurs.clear()
    return count


# ---- the acceptance chain ------------------------------------------------------------------
def _accept(ctx: RunContext, registration: Registration, match: pm.Match) -> bool:
    """torch's matcher asks this of every structural match: fuse it?"""
    form = registration.form
    if ctx.gradient_free_only and _differentiated(match, ctx):
        return False  # not news: the joint forms' run said why this site did not fuse
    exact = _exact_match(ctx, registration, match)
    if isinstance(exact, str):
        for node in match.nodes:
            ctx.inexact.setdefault(node, exact)
        return False
    site, exact_match, arguments = exact
    if ctx.before_change is not None:  # the pass's own code (its check) is about to run
        ctx.before_change()
    replacement: list = []  # the replacement's trace, made by the output check
    reason = _first_failure(ctx, registration, site, exact_match, arguments, replacement)
    if reason is not None:
        log.debug("%s: not fusing %s at %s: %s", ctx.fusion_pass.name, form.name,
                  location_of(exact_match.nodes), reason)
        ctx.reject(form, exact_match.nodes, reason)
        return False
    match.replacement_graph = replacement[0]
    match.kwargs.update(site.bound)  # the replacement's further arguments (Form.bound), after the form's
    # The replacement goes where the exact match (the one checked) binds, not the structural
    # one: with sizes as wildcards, two outputs of a multi-output pattern that differ only in
    # sizes can bind one node there (the first candidate torch's matcher tries for each), e.g.
    # the two slices of a cat's gradient (sparse_mla's joint forms: kv's and the compressed
    # kv's); the exact pattern's literal sizes tell them apart.
    match.ctx, match.nodes = exact_match.ctx, exact_match.nodes
    ctx.sites.append(FusedSite.of_match(ctx.fusion_pass.name, form.name, form.fused_op or ctx.fusion_pass.fused_op,
                                        exact_match.nodes, match.output_nodes(), ctx.fusion_pass.anchor,
                                        _notes(ctx, site), site.verified, ctx.patterns.emitted_ops[form]))
    return True


@dataclass
class _Arguments:
    """A match's arguments as traces take them: its fake values with requires_grad as the
    registration traced them, and the symbolic sizes among their shapes and strides.
    Made on demand: a trace kept for this signature needs none of it."""

    nodes: dict  # each argument's node (or value) in the graph
    values: list
    requires_grad: list[bool]
    fake_mode: Any
    symbolic_sizes: list
    key: Optional[tuple]

    @functools.cached_property
    def traced(self) -> list:
        with self.fake_mode:
            return [trace_input(v, grad) if isinstance(v, torch.Tensor) else v
                    for v, grad in zip(self.values, self.requires_grad)]


def _arguments(registration: Registration, kwargs: dict):
    """The _Arguments of a match's bindings, or why a trace cannot take them."""
    argnames = registration.form.argnames
    missing = [name for name in argnames if name not in kwargs]
    if missing:
        return f"the pattern binds no {missing[0]}"
    arg_nodes = {name: kwargs[name] for name in argnames}
    values = [arg_nodes[n].meta.get("val") if isinstance(arg_nodes[n], Node) else arg_nodes[n] for n in argnames]
    if any(isinstance(arg_nodes[n], Node) and v is None for n, v in zip(argnames, values)):
        return "the matched nodes carry no tensor metadata (meta['val'])"
    fake_mode = torch._guards.detect_fake_mode(values)  # noqa: SLF001
    if fake_mode is None:
        return "the matched nodes carry no fake tensors"
    requires_grad = [name in registration.requires_grad for name in argnames]
    symbolic_sizes: list = []
    for name, value, grad in zip(argnames, values, requires_grad):
        if isinstance(value, torch.Tensor):
            if grad and not value.is_floating_point():
                return f"{name} is {value.dtype} here, but the form takes it as differentiable"
            for size in itertools.chain(value.shape, value.stride()):
                # every distinct symbolic size, once: torch's register_replacement keeps one
                # only where it is provably *different* from those taken (`size != a`), which
                # two independent sizes (dynamic batch and sequence: s0, s1) are not, and the
                # retrace then spells the second `sym_size(x, i)` where the graph reads its
                # SymInt input: no dynamic=True site with two symbolic sizes matched
                if isinstance(size, torch.SymInt) and not any(statically_known_true(size == a)
                                                              for a in symbolic_sizes):
                    symbolic_sizes.append(size)
    key = signature([*symbolic_sizes, *values], requires_grad=[False] * len(symbolic_sizes) + requires_grad)
    return _Arguments(arg_nodes, values, requires_grad, fake_mode, symbolic_sizes, key)


@dataclass(frozen=True)
class KnownExact:
    """An exact match made at one site with a static signature, as its shape in the graph.

    Every decoder layer repeats its sites' signatures, and at each the structural match
    only leads to the exact pattern of the signature, matched from the same node (the
    match's first output, where the structural one started). So a candidate is first
    looked for as the shape of an exact match its registration already made
    (replay.MatchShape: torch's matcher would match an isomorphic region the same way), and
    where it is found with the same signature, that is the exact match the structural one
    would have led to; the acceptance checks all run on it as on any other."""

    shape: MatchShape
    anchor: tuple  # (op, target) of the node it matched from
    anchor_value: tuple  # the signature of the value it started from (to pass others by unmatched)
    key: tuple  # the signature it was traced at
    scalars: dict  # the arguments it has as literals (scalars), which it binds no node for


# a model's sites of one form have few signatures and spellings; kept process-wide, the
# most recently used first
_KNOWN_EXACT_PER_REGISTRATION = 4


def _known_exact_match(ctx: RunContext, registration: Registration, node: Node) -> Optional[pm.Match]:
    """The match at `node` of the shape of an exact match `registration` made before, at
    the signature it was made at; None if there is none."""
    known_here = ctx.patterns.known_exact.get(registration, ())
    value = signature([node.meta.get("val")]) if known_here else None
    for known in known_here:
        if known.anchor != (node.op, node.target) or known.anchor_value != value:
            continue
        match = known.shape.find(node)
        if match is None:
            continue
        arguments = _arguments(registration, {**known.scalars, **match.kwargs})
        if isinstance(arguments, _Arguments) and arguments.key == known.key:
            match.kwargs.update(known.scalars)
            match.known_exact = known
            if known_here[0] is not known:  # most recently used first
                known_here.remove(known)
                known_here.insert(0, known)
            return match
    return None


def _remember_exact(ctx: RunContext, registration: Registration, arguments: _Arguments,
                    exact_match: pm.Match) -> None:
    if arguments.key is None or not is_static(arguments.key):
        return
    scalars = {name: value for name, value in arguments.nodes.items() if name not in exact_match.kwargs}
    if any(isinstance(value, (Node, torch.Tensor)) for value in scalars.values()):
        return  # a node it does not bind: another site's, were it reused
    known = ctx.patterns.known_exact.setdefault(registration, [])
    shape = MatchShape.of(exact_match)
    if shape is not None and all(k.key != arguments.key or k.shape != shape for k in known):
        start = exact_match.output_nodes()[0]
        known.insert(0, KnownExact(shape, (start.op, start.target), signature([start.meta.get("val")]),
                                   arguments.key, scalars))
        del known[_KNOWN_EXACT_PER_REGISTRATION:]  # the least recently used go


def _exact_match(ctx: RunContext, registration: Registration, match: pm.Match):
    """(site, exact match, arguments) of a structural match, or why there is none.

    The structural pattern took every size and scalar as a wildcard; here the form's search
    is traced again at the match's own shapes, dtypes and scalars, and that trace must
    match the same nodes exactly (as torch's register_replacement does, with the traces
    kept per signature, and the scalars read from the match itself: a retrace that
    names them by their example values would take a model size equal to an example for
    the scalar). A match made by a KnownExact pattern is that exact match already.
    """
    form = registration.form
    arguments = _arguments(registration, match.kwargs)
    if isinstance(arguments, str):
        return arguments
    # remembered once it stands: a match of a static exact pattern, not one a KnownExact made
    remember = False
    if getattr(match, "known_exact", None) is not None:
        exact_match = match
    else:
        exact = _exact_pattern(ctx, registration, arguments)
        if isinstance(exact, str):
            return exact
        exact_pattern, size_arguments = exact
        exact_match = match_commutative(exact_pattern, match.output_nodes()[0])
        if not pm.is_match(exact_match):
            # (torch's failure names the pattern it expected whole: kilobytes for a norm's spellings)
            failure = str(exact_match)
            failure = failure if len(failure) <= 160 else failure[:160] + "..."
            return f"{form.name} has its structure, but differs in sizes or constants: {failure}"
        unequal = _symbolic_size_bound_elsewhere(exact_match, size_arguments)
        if unequal:
            return f"{form.name} has its structure, but differs in sizes: {unequal}"
        remember = not size_arguments
    bound: dict[Node, Any] = {}
    for pattern, node in zip(exact_match.ctx.outputs, exact_match.output_nodes()):
        if node is not None and bound.setdefault(node, pattern) is not pattern:
            # two results of the form found as one value of the graph: one of them is not there
            return f"two outputs of {form.name} bind the one node {node.name}"
    if remember:
        _remember_exact(ctx, registration, arguments, exact_match)
    argnames = form.argnames
    site_nodes = {name: exact_match.kwargs.get(name, arguments.nodes[name]) for name in argnames}
    site = Site(form, dict(zip(argnames, arguments.values)), list(exact_match.nodes), site_nodes, ctx.soc,
                ctx.mode, keep_intermediate_rounding=ctx.keep_intermediate_rounding,
                dedicated_groups=ctx.dedicated_groups)
    return site, exact_match, arguments


def _symbolic_size_bound_elsewhere(exact_match: pm.Match, sizes: dict[str, Any]) -> Reason:
    """The exact pattern takes each symbolic size as an input (a named argument, which
    matches whatever node or literal sits there; `sizes`: each name's size): each one must
    have bound a value the shape environment proves equal to its size, else the trace's
    size and the graph's only have the same place."""
    for name, size in sizes.items():
        if name not in exact_match.kwargs:
            continue
        bound = exact_match.kwargs[name]
        value = bound.meta.get("val") if isinstance(bound, Node) else bound
        if not (isinstance(value, (int, torch.SymInt)) and known_equal(value, size)):
            shown = bound.name if isinstance(bound, Node) else repr(bound)
            return f"{shown} ({value}) stands where the form has the size {size}"
    return None


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _sizes_as_inputs_per_use(gm: torch.fx.GraphModule, before: Node) -> list[Any]:
    """Each place an op of an exact trace reads a symbolic size (a SymInt input, `sym_size(v,
    0)` of an intermediate, `s0 * s1`) reads an input of its own instead, placed before
    `before`; returns their sizes, in order.

    A graph spells a symbolic value in whatever way it was traced, and not the same way in
    every place: transformers' `arange(perm.size(0))` reaches a dynamo graph as `2 * s1 *
    s0` of its SymInt inputs where a retrace has `sym_size` of the view it sorted (a second
    user of that view, which then no longer matches); dynamo passes one SymInt input per
    source of a size, so torchtitan's sequence length is one input in the rotary's first
    view and another in its last. Static shapes have literals there. What must agree in
    each place is the value, which _symbolic_size_bound_elsewhere proves through the shape
    environment."""
    sizes = []
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if node.op not in ("placeholder", "call_function") or not isinstance(value, torch.SymInt):
            continue
        for user in list(node.users):
            if user.op == "output" or isinstance(user.meta.get("val"), _SYMBOLIC):
                continue  # more size arithmetic reads it: replaced where that is read
            with gm.graph.inserting_before(before):
                placeholder = gm.graph.placeholder(f"size_{len(sizes)}")
            placeholder.meta["val"] = value
            user.replace_input_with(node, placeholder)
            sizes.append(value)
    if sizes:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return sizes


def _exact_pattern(ctx: RunContext, registration: Registration, arguments: _Arguments):
    """The form's search traced at the arguments as an exact pattern (sizes and scalars
    literal, each symbolic size a named argument: {name: its size}), or why it does not
    trace; kept per signature (process-wide when static)."""
    form = registration.form
    key = (registration.kind, form.key, arguments.key)
    cache = ctx.patterns.exact_patterns if arguments.key is not None and is_static(arguments.key) else ctx.exact_patterns
    if key in cache:
        return cache[key]
    trace = TRACERS[registration.kind]
    argnames, sizes = form.argnames, arguments.symbolic_sizes
    size_arguments: dict[str, Any] = {}
    try:
        with arguments.fake_mode, failure_is_an_answer():
            if sizes:
                # make_fx dedupes symbolic sizes of its inputs: pass them as inputs, so the
                # trace reads them as the graph does (its own SymInt inputs), not as sym_size
                def search_with_sizes(*args_and_sizes: Any) -> Any:
                    return form.search(*args_and_sizes[len(sizes):])

                gm = trace(search_with_sizes, [*sizes, *arguments.traced])
                placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
                renamed_arguments = []
                for placeholder, name in zip(placeholders[len(sizes):], argnames):
                    with gm.graph.inserting_after(placeholder):
                        renamed = gm.graph.placeholder(name)
                    renamed.target = renamed.name
                    placeholder.replace_all_uses_with(renamed)
                    gm.graph.erase_node(placeholder)
                    renamed_arguments.append(renamed)
                if is_joint_kind(registration.kind):
                    _drop_size_gradients(gm, len(sizes), len(argnames))
                # (the size inputs themselves are then read by size arithmetic at most: their
                # names stay in front, as the placeholders are)
                uses = _sizes_as_inputs_per_use(gm, renamed_arguments[0])
                size_arguments = {**{f"symbolic_size_{i}": size for i, size in enumerate(sizes)},
                                  **{f"size_{i}": size for i, size in enumerate(uses)}}
                argnames = [*size_arguments, *argnames]  # the placeholders' order
            else:
                gm = trace(form.search, arguments.traced)
    except (RuntimeError, ValueError) as exc:  # (ValueError: a split in another number of pieces
        # than the form unpacks, `gate, up = x.split(x.shape[-1] // 2)` of an odd width)
        found: Any = f"{form.name} does not trace at this site's shapes: {type(exc).__name__}: {exc}"
    else:
        found = respell_exact(pm.fx_to_pattern(gm, argnames=argnames)), size_arguments
    if arguments.key is not None:
        cache[key] = found
    return found


def _drop_size_gradients(gm: torch.fx.GraphModule, sizes: int, arguments: int) -> None:
    """A joint trace returns the forward's outputs, then a gradient per input: with the
    symbolic sizes passed as inputs in front of the form's arguments, their gradients
    (None) would sit where the replacement, traced without them, has the arguments'
    gradients, and the match's outputs would line up with the wrong replacement outputs."""
    (output,) = gm.graph.find_nodes(op="output")
    outputs = list(output.args[0])
    first_gradient = len(outputs) - sizes - arguments
    if first_gradient < 0 or any(g is not None for g in outputs[first_gradient:first_gradient + sizes]):
        raise RuntimeError(f"a joint trace with {sizes} symbolic sizes in front of {arguments} arguments "
                           f"returned {len(outputs)} outputs")
    output.args = (outputs[:first_gradient] + outputs[first_gradient + sizes:],)
    gm.recompile()


def _drop_bound_gradients(gm: torch.fx.GraphModule, bound: int) -> None:
    """A joint trace of a replacement returns a gradient per input, the bound ones (Form.bound,
    last) too, where the search has none: they are None (no gradient flows to what a check
    binds) and are dropped, so the outputs line up with the match's."""
    (output,) = gm.graph.find_nodes(op="output")
    outputs = list(output.args[0])
    if any(g is not None for g in outputs[len(outputs) - bound:]):
        raise RuntimeError("a bound argument of a joint replacement gets a gradient")
    output.args = (outputs[:len(outputs) - bound],)
    gm.recompile()


def _first_failure(ctx: RunContext, registration: Registration, site: Site, match: pm.Match,
                   arguments: _Arguments, replacement: list) -> Reason:
    form = site.form
    reason = ((_joint_roles_swapped(match, ctx) if ctx.joint and not ctx.gradient_free_only else None)
              or _scopes_differ(ctx, site.nodes)
              or _argument_kinds_differ(ctx.fusion_pass, site)
              or _unexpected_keyword(site.nodes, ctx.patterns.keywords[form])
              or next(filter(None, (not_lowerable(op, ctx.mode) for op in ctx.patterns.emitted_ops[form])), None)
              or ctx.fusion_pass.check(site))
    if reason is not None:
        return reason
    if form.bound:
        arguments = _with_bound(site, arguments)
        if isinstance(arguments, str):
            return arguments
    return (_specialise_sizes(site, arguments)
            or _outputs_differ(ctx, registration, match, arguments, replacement)
            or _slower(ctx, site, match, replacement[0])
            or (_verify(ctx, site, match) if ctx.verify else None))


def _with_bound(site: Site, arguments: _Arguments):
    """The match's arguments followed by the nodes the check bound (Form.bound), as the
    replacement takes them; or why not (a check that accepted the site without binding)."""
    missing = [name for name in site.form.bound if name not in site.bound]
    if missing:
        return f"the check bound no {missing[0]} (an argument of the replacement the search does not compute)"
    nodes = [site.bound[name] for name in site.form.bound]
    values = [n.meta.get("val") for n in nodes]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return "a bound argument carries no tensor metadata (meta['val'])"
    all_values = [*arguments.values, *values]
    requires_grad = [*arguments.requires_grad, *([False] * len(values))]
    sizes = arguments.symbolic_sizes
    key = signature([*sizes, *all_values], requires_grad=[False] * len(sizes) + requires_grad)
    return _Arguments({**arguments.nodes, **site.bound}, all_values, requires_grad, arguments.fake_mode, sizes, key)


def _scopes_differ(ctx: RunContext, nodes: Sequence[Node]) -> Reason:
    """The matched nodes must lie in one torchair scope: the region between an air.scope_enter
    and its air.scope_exit (torchair.scope: npu_stream_switch puts its ops on another stream,
    super_kernel, limit_core_num ... set attributes of theirs; torchair's ACL graph pass reads
    them in that order, _acl_concrete_graph/graph_pass.py apply_event_closure_with_multi_stream).
    A fused op replacing nodes of two scopes would run in one of them: a collective the user
    put on its own stream to overlap it, for one, would not be there any more."""
    if ctx.scopes is None:
        ctx.scopes = _torchair_scopes(nodes[0].graph)
    if not ctx.scopes:
        return None
    found = {ctx.scopes.get(node, ()) for node in nodes if node in ctx.scopes}
    if len(found) > 1:
        described = "; ".join(" > ".join(scope) or "no scope" for scope in sorted(found))
        return f"its nodes lie in different torchair scopes ({described}): a fused op runs in one"
    return None


def _torchair_scopes(graph: torch.fx.Graph) -> dict:
    """{node: the torchair scopes open at it, outermost first}, or {} for a graph without any."""
    air = getattr(torch.ops, "air", None)
    enter = getattr(getattr(air, "scope_enter", None), "default", None)
    if enter is None or not graph.find_nodes(op="call_function", target=enter):
        return {}
    scopes, stack = {}, []
    for node in graph.nodes:
        if node.target is enter:
            keys, values = node.args[0], node.args[1]
            stack.append(", ".join(f"{k}={v}" for k, v in zip(keys, values)))
        elif node.target is air.scope_exit.default and stack:
            stack.pop()
        scopes[node] = tuple(stack)
    return scopes


def _slower(ctx: RunContext, site: Site, match: pm.Match, replacement: torch.fx.GraphModule) -> Reason:
    """A fusion the cost model estimates slower than the code it replaces, whatever the
    sizes, is not taken (cost_model.slower). Without a torchair mode (CPU emulation) the
    op's own kernel is assumed, and a site max-autotune would refuse says so in its note."""
    from .cost_model import slower

    added = list(replacement.graph.nodes)
    reason = slower(match.nodes, added, site.soc, ctx.mode)
    if reason is None and ctx.mode is None:
        in_ge = slower(match.nodes, added, site.soc, "max-autotune")
        if in_ge is not None:
            site.notes.append(f"under max-autotune it would stay unfused: {in_ge}")
    return reason


def _argument_kinds_differ(fusion_pass: FusionPass, site: Site) -> Reason:
    for name in site.form.argnames:
        value = site.args.get(name)
        if not fusion_pass.is_scalar(name) and not isinstance(value, torch.Tensor):
            return f"{name} is {value!r}, not a tensor"
        if fusion_pass.is_scalar(name) and isinstance(site.arg_nodes.get(name), Node):
            if isinstance(value, torch.SymInt) and name in fusion_pass.symbolic_scalars:
                continue  # the pass's check proves it for every size (FusionPass.symbolic_scalars)
            if isinstance(value, (torch.SymInt, torch.SymFloat)):  # e.g. min(index_topk, S), S dynamic
                constant = constant_on_a_size_range(value)
                if constant is not None:
                    # the check reads the constant; the guard comes once the check accepts the
                    # site (_specialise_sizes), so a site the check refuses pins no size range
                    site.args[name] = constant[0]
                    site.specialised[name] = constant
                    continue
                return (f"{name} is {value}, computed from the graph's symbolic sizes (dynamic shapes), "
                        "not a constant the fused op can take, nor one over a range of sizes a guard could keep")
            return f"{name} is a tensor computed in the graph, not a constant"
    return None


def _specialise_sizes(site: Site, arguments: _Arguments) -> Reason:
    """A scalar that is a constant over a range of sizes (min(index_topk, S): index_topk for
    every S >= index_topk) is taken as that constant, guarded as dynamo guards its own
    specialisations: the compiled graph then serves the sizes in the range, and a call
    outside it compiles again (without the fusion there). The replacement is traced with
    the constant. The guard comes after the pass's own check, so a site it refuses pins no
    range, and before the output check, which needs it to prove the output shapes equal
    (`Min(8, S)` is 8 only where S >= 8)."""
    for name, (constant, guard) in site.specialised.items():
        if not guard():
            return f"{name} is not {constant} at this compile's sizes"
        arguments.values[site.form.argnames.index(name)] = constant
        arguments.__dict__.pop("traced", None)  # traced again with the constant
        site.notes.append(f"{name} taken as {constant}: a guard keeps this graph to the sizes where it is "
                          f"(a call outside them compiles again)")
    return None


# Keyword arguments a matched node may carry beyond what a form spells out: they place or
# type the result (and a wrong dtype shows up in the output check), they never change the
# arithmetic. Anything else (add's alpha, div's rounding_mode, ...) does.
_HARMLESS_KEYWORDS = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking",
                                "memory_format", "keepdim"})


def _unexpected_keyword(nodes: Sequence[Node], spelled: frozenset) -> Reason:
    """torch's matcher drops node kwargs its pattern lacks (pattern_matcher.py,
    _TargetArgsExpr._match), so `torch.add(x, r, alpha=2)` matches `x + r`. Reject those;
    `spelled` are the (op, keyword, value) the form's search has, and the matcher compared
    (or bound to a scalar argument of the form, whatever its value: registry.SCALAR_ARGUMENT)."""
    for node in nodes:
        if not node.kwargs or not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            continue
        op, defaults = str(node.target), _keyword_defaults(node.target)
        for key, value in node.kwargs.items():
            if {(op, key, keyword_value(value)), (op, key, SCALAR_ARGUMENT)} & spelled:
                continue
            if isinstance(value, Node) and any(entry[:2] == (op, key) for entry in spelled):
                # a symbolic size computed in the graph (repeat_interleave's output_size, the
                # rows an expert-parallel all-to-all received): the form spells this keyword,
                # as an int at its static example, and the exact match at the match's own
                # sizes proved its value equal (_symbolic_size_bound_elsewhere)
                continue
            if key not in _HARMLESS_KEYWORDS and (key not in defaults or defaults[key] != value):
                return f"{node.name} ({node.target}) has {key}={value!r}, which the form does not compute"
    return None


@functools.lru_cache(maxsize=None)
def _keyword_defaults(op: torch._ops.OpOverload) -> dict:  # noqa: SLF001
    return {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}  # noqa: SLF001


def _replacement_graph(ctx: RunContext, registration: Registration, arguments: _Arguments) -> torch.fx.GraphModule:
    """The replacement traced at the site's arguments, one trace per signature: kept for
    every graph when the signature is static (a joint trace is a whole aot_autograd run,
    ~0.2 s; its fake values are re-made in each graph's fake mode as it is inserted:
    insert_replacement), else for this graph (symbolic sizes name this graph's values)."""
    form = registration.form
    key = (registration.kind, form.key, arguments.key)
    cache = ctx.patterns.replacements if arguments.key is not None and is_static(arguments.key) else ctx.replacements
    if arguments.key is not None and key in cache:
        return cache[key]
    with arguments.fake_mode:
        graph = TRACERS[registration.kind](form.replace, arguments.traced)
    if form.bound and is_joint_kind(registration.kind):
        _drop_bound_gradients(graph, len(form.bound))
    if arguments.key is not None:
        cache[key] = graph
    return graph


def _outputs_differ(ctx: RunContext, registration: Registration, match: pm.Match,
                    arguments: _Arguments, replacement: list) -> Reason:
    """The replacement must compute outputs of the shapes and dtypes the subgraph computes:
    this catches type promotion (an fp32 weight on a bf16 activation) and broadcasting,
    whatever a pattern's own check forgot."""
    graph = _replacement_graph(ctx, registration, arguments)
    replacement.append(graph)
    (output,) = graph.graph.find_nodes(op="output")
    fused = [n.meta.get("val") if isinstance(n, Node) else n for n in _flat(output.args[0])]
    originals = [n.meta.get("val") if n is not None else None for n in match.output_nodes()]
    for index, (orig, new) in enumerate(zip(originals, fused)):
        if not isinstance(orig, torch.Tensor):
            continue
        if not isinstance(new, torch.Tensor):
            return f"{ctx.fusion_pass.fused_op} would give no tensor where the model computes {_describe(orig)} (output {index})"
        # (not `orig.shape != new.shape`: that guards, and raises on a data-dependent size)
        if orig.dtype != new.dtype or not same_shape(orig, new):
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
    if site.form.bound:
        # the bound values are what the check proved the matched nodes compute from (a mask
        # scattered from indices): independent random inputs would break that relation
        site.verified = (f"not verified: the replacement reads {', '.join(site.form.bound)}, which the check proved "
                         "the matched inputs are computed from; random inputs do not keep that relation")
        return None
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
    a value is computed from a tangent: a forward input must not be (the tags aot_autograd
    puts on backward nodes are missing on nodes an earlier replacement inserted, and are on
    the symbolic sizes the backward reads again), the incoming gradient must be, or be a
    node tagged backward: a gradient may be computed from no tangent at all (an auxiliary
    loss's gradient that an autograd.Function seeds with ones_like, torchtitan-npu's
    DSAIndexerLossAutoScaler)."""
    for name, value in match.kwargs.items():
        if not isinstance(value, Node):
            continue
        if not name.startswith("tangents_"):
            if _reads_tangents(value, ctx.from_tangents):
                return f"{value.name} bound as a forward input ({name}) is computed from a tangent"
        elif not (is_backward(value) or _reads_tangents(value, ctx.from_tangents)):  # the tag is cheaper
            return (f"{value.name} bound as the incoming gradient ({name}) is computed in the forward (from no "
                    "tangent, by no node aot_autograd tags as backward)")
    return None


def _differentiated(match: pm.Match, ctx: RunContext) -> bool:
    """The backward reads a value of this match of a forward form in a joint graph: a
    gradient flows through the site, and its joint forms fuse it with its backward or say
    why not."""
    return any(is_backward(user) or _reads_tangents(user, ctx.from_tangents)
               for node in match.nodes for user in node.users)


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
                 anchors: Callable[[Node], bool], candidates: Optional[Sequence[Node]] = None) -> PassResult:
    """Every anchor no form consumed: the check that turned it down, or the pass's
    explanation, or that no form matched it. `candidates`: the anchors a walk of this graph
    found earlier in the run (replacements since then erased some, and moved others)."""
    fusion_pass = ctx.fusion_pass
    if candidates is None:
        candidates = fusion_pass.candidate_anchors(gm.graph, anchors)
    else:
        candidates = sorted(n for n in candidates if not n._erased and fusion_pass.anchor(n))  # noqa: SLF001
    for node in candidates:
        reason = ctx.reason(node) or fusion_pass.explain(node) or _no_form_matched(fusion_pass.forms)
        if node in ctx.inexact and reason.startswith("matches none of the forms"):
            reason += f" (closest: {ctx.inexact[node]})"
        result.near_misses.append(NearMiss(fusion_pass.name, reason, location_of([node, *node.users])))
    said = {(m.location.file, m.location.line) for m in result.near_misses}
    result.near_misses += [m for m in ctx.fallback_misses if (m.location.file, m.location.line) not in said]
    return result


def _no_form_matched(forms: Sequence[Form]) -> str:
    # forms spelled in several operand orders share a base name: "name[cos*x]"
    names = list(dict.fromkeys(form.name.split("[")[0] for form in forms))
    return f"matches none of the forms {', '.join(names)}"
