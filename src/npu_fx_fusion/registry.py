"""A pass's patterns: traced from its forms, or loaded precompiled.

Each form is registered once per dtype it is traced at, per example variant, per cast
spelling (aten._to_copy on CPU, npu._npu_dtype_cast on an NPU) and, for training graphs,
per set of arguments that require grad. Tracing all of that costs seconds per pass, so
the patterns are precompiled: scripts/precompile_patterns.py writes each pass's patterns
as Python (torch's PatternPrettyPrinter, as Inductor ships its attention patterns) into
npu_fx_fusion/patterns/_precompiled/<pass>.py, together with what else registration
learns from tracing (the ops each form emits, the keywords its search spells out).

A precompiled file is used only when it provably comes from the current sources: it
records the torch version, a hash of the pass module and of the engine modules that
shape a trace, and which emitted ops have a backward here; any difference, or a form it
does not know, and the pass's patterns are traced instead (a log line says so).
tests/test_precompiled.py regenerates every file and fails on drift.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import importlib.util
import itertools
import logging
import operator
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._ordered_set import OrderedSet

from . import npu_ops
from .capabilities import capability, has_backward
from .forms import Form, FusionPass
from .nodes import custom_ops
from .spellings import respell
from .canonical import is_backward
from .tracing import (FORWARD, FORWARD_NPU, FORWARD_NPU_CAST, JOINT, JOINT_NPU, JOINT_NPU_CAST, TRACERS,
                      is_joint_kind, spell_casts_as_npu, trace_without_decompositions)

log = logging.getLogger("npu_fx_fusion.registry")

PRECOMPILED_PACKAGE = "npu_fx_fusion.patterns._precompiled"
# The engine modules whose code decides what a trace (and so a pattern) looks like.
# (npu_dispatch: the forward-npu traces run its kernels, and forms call its SDPA; nodes:
# canonical and spellings prove sizes equal with its known_equal)
_TRACE_SHAPING_MODULES = ("npu_fx_fusion.canonical", "npu_fx_fusion.tracing", "npu_fx_fusion.spellings",
                          "npu_fx_fusion.npu_dispatch", "npu_fx_fusion.nodes")

# Deep patterns (DeepSeek-V4's 20-iteration Sinkhorn, patterns/mhc_pre.py: a chain of ~200
# nodes forward, twice that joint) recurse once per pattern node, a few frames each, in torch's
# pattern building (fx_to_pattern), printing (PatternPrettyPrinter.memoize), respelling and
# matching (PatternExpr.match): past Python's default limit of 1000 frames.
PATTERN_RECURSION_LIMIT = 10000

# A multi-output pattern finds its later outputs by walking each one's sub-patterns down to
# a node the first output matched (torch's _TargetArgsExpr.find_anchor_nodes). The walk has
# no memo, so through a chain whose steps read the step before twice (Sinkhorn's
# x / x.sum(-1)) it takes 2**steps paths: a graph with another iteration count than the
# pattern's never finishes. Expanding each sub-pattern once per search yields the same
# candidates: a second expansion can only yield nodes the first already put in `searched`
# (the match state is restored between candidates, and in a DAG the first expansion ends
# before the second begins). {id(searched): (searched, expanded patterns)}, while matching.
_ORIGINAL_FIND_ANCHOR_NODES = pm._TargetArgsExpr.find_anchor_nodes  # noqa: SLF001
_EXPANDED: dict[int, tuple[Any, set]] = {}
_DEEP_PATTERN_DEPTH = [0]


def _find_anchor_nodes_once(self: Any, ctx: Any, searched: Any):
    if self in ctx.pattern_to_node:
        yield ctx.pattern_to_node[self]
        return
    entry = _EXPANDED.get(id(searched))
    if entry is None or entry[0] is not searched:
        entry = _EXPANDED[id(searched)] = (searched, set())  # holds `searched`: its id stays its own
    if self in entry[1]:
        return
    entry[1].add(self)
    yield from _ORIGINAL_FIND_ANCHOR_NODES(self, ctx, searched)


# Each later output of a multi-output pattern is searched among the users of the nodes the
# match has bound so far (torch's _match_from_anchors), and the first candidate that matches
# wins, with no return to it later. Two outputs with the same sub-patterns (rope_qk's two
# npu_rotary_mul calls on one cos / sin) then find, from the first output's node, that very
# node again: a match binding one node as two outputs, which acceptance refuses, while the
# node beside it would have matched. A node another output already bound is tried last (where
# it is the only candidate, acceptance then names the problem).
_ORIGINAL_MATCH_FROM_ANCHORS = pm.MultiOutputPattern._match_from_anchors  # noqa: SLF001


def _match_from_anchors_distinct(self: Any, pattern: Any, ctx: Any) -> Any:
    prior = dict(ctx.pattern_to_node)
    taken = {prior[output] for output in self.outputs if output is not pattern and output in prior}
    found: Any = pm.FailedMatch("no anchor found")
    passed_over = []

    def candidates() -> Any:
        for node in pattern.find_anchor_nodes(ctx, OrderedSet()):
            if node in taken:
                passed_over.append(node)
            else:
                yield node
        yield from passed_over

    for node in candidates():
        found = ctx.match(pattern, node)
        if pm.is_match(found):
            return found
        ctx.pattern_to_node = dict(prior)  # undo the partial match
    return found


@contextlib.contextmanager
def deep_patterns():
    """While building, printing or matching patterns (usable as a decorator): the recursion
    limit raised to PATTERN_RECURSION_LIMIT, and each multi-output search expanding a
    sub-pattern once and binding each output to a node of its own."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, PATTERN_RECURSION_LIMIT))
    _DEEP_PATTERN_DEPTH[0] += 1
    pm._TargetArgsExpr.find_anchor_nodes = _find_anchor_nodes_once  # noqa: SLF001
    pm.MultiOutputPattern._match_from_anchors = _match_from_anchors_distinct  # noqa: SLF001
    try:
        yield
    finally:
        _DEEP_PATTERN_DEPTH[0] -= 1
        if not _DEEP_PATTERN_DEPTH[0]:
            pm._TargetArgsExpr.find_anchor_nodes = _ORIGINAL_FIND_ANCHOR_NODES  # noqa: SLF001
            pm.MultiOutputPattern._match_from_anchors = _ORIGINAL_MATCH_FROM_ANCHORS  # noqa: SLF001
            _EXPANDED.clear()
        sys.setrecursionlimit(limit)


@dataclass(frozen=True)
class Registration:
    """One pattern of a form: what the matcher looks for first, structurally (sizes and
    scalars as wildcards); accept.py then checks each match exactly at its own shapes."""

    form: Form
    pattern: pm.PatternExpr  # as traced (and precompiled)
    kind: str  # tracing.TRACERS key: how the form was traced, and is retraced for the exact check
    requires_grad: tuple[str, ...] = ()  # joint kinds: the arguments traced as requiring grad

    @functools.cached_property
    @deep_patterns()
    def spelled(self) -> tuple[pm.PatternExpr, ...]:
        """The pattern accepting every spelling of each of its nodes, one per spelling of
        its root (spellings.py): what the matcher runs."""
        return tuple(respell(self.pattern))

    @property
    def anchors(self) -> frozenset:
        return frozenset(anchor_of(p) for p in self.spelled)


@dataclass
class PatternSet:
    """Everything registration knows about one pass's current forms.

    The registrations themselves are built on first use: a graph that has none of their
    anchor ops (the ops a match starts from) never needs them.
    """

    fusion_pass: FusionPass
    forms: tuple[Form, ...]
    build_forward: Callable[[], tuple[Registration, ...]]
    build_joint: Callable[[], tuple[Registration, ...]]
    emitted_ops: dict[Form, tuple[str, ...]]  # the non-aten ops each form's replacement calls
    keywords: dict[Form, frozenset]  # (str(op), keyword, repr(value)) its search spells out
    source: str  # "precompiled" or "traced"
    # (op, target) a match can start from, when known without building the registrations
    known_anchors: dict[str, frozenset] = field(default_factory=dict)
    # exact-match patterns and replacement traces of static signatures, shared by every
    # graph (accept.py)
    exact_patterns: dict = field(default_factory=dict)
    replacements: dict = field(default_factory=dict)
    # per registration, the static exact patterns that matched a site (accept.KnownExact):
    # tried at a candidate before the structural pattern
    known_exact: dict = field(default_factory=dict)

    @functools.cached_property
    @deep_patterns()
    def forward(self) -> tuple[Registration, ...]:
        return self.build_forward()

    @functools.cached_property
    @deep_patterns()
    def joint(self) -> tuple[Registration, ...]:
        return self.build_joint()

    @property
    def joint_forms(self) -> tuple[Form, ...]:
        return tuple(dict.fromkeys(r.form for r in self.joint))

    def anchors(self, joint: bool) -> frozenset:
        """The (op, target) pairs the matcher starts from: a graph without any of them
        cannot match."""
        which = "joint" if joint else "forward"
        if which not in self.known_anchors:
            self.known_anchors[which] = frozenset().union(*(r.anchors for r in (self.joint if joint else self.forward)))
        return self.known_anchors[which]


def anchor_of(pattern: pm.PatternExpr) -> tuple:
    """(op, target) of the node a pattern's match starts from (its first output)."""
    if isinstance(pattern, pm.MultiOutputPattern):
        pattern = pattern.outputs[0]
    (target,) = pattern.fns
    return pattern.op, target


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return str(target)
    if getattr(operator, target.__name__, None) is target:
        return f"operator.{target.__name__}"
    raise ValueError(f"a pattern starts from {target!r}, which precompiled patterns cannot name")


def _target_of(name: str) -> Any:
    """The inverse of _target_name: "aten.mul.Tensor", "operator.getitem"."""
    if name.startswith("operator."):
        return getattr(operator, name.split(".", 1)[1])
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


@deep_patterns()
def pattern_set(fusion_pass: FusionPass) -> PatternSet:
    """The patterns of `fusion_pass`'s current forms, built on first use and kept on the pass."""
    forms = fusion_pass.forms
    key = tuple(form.key for form in forms)
    found = fusion_pass.registered.get(key)
    if found is None:
        npu_ops.ensure_registered()
        found = _load_precompiled(fusion_pass, forms) or _trace(fusion_pass, forms)
        fusion_pass.registered.clear()  # only the current set of forms is kept
        fusion_pass.registered[key] = found
    return found


# ---- tracing -----------------------------------------------------------------------------
def _scalar_arguments(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any]) -> dict:
    """The form's scalar arguments in a trace on `inputs` (the example's values, or an example
    variant's): {name: value}, numbers and strings."""
    return {n: v for n, v in zip(form.argnames, inputs) if fusion_pass.is_scalar(n) and isinstance(v, (int, float, str))}


def _scalar_workaround(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any]) -> dict:
    """The numbers among them: torch's fx_to_pattern makes each a named argument."""
    return {n: v for n, v in _scalar_arguments(fusion_pass, form, inputs).items() if not isinstance(v, str)}


def _string_arguments(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any]) -> dict:
    """{value: argument name} of the strings among them (a process group's name): like a
    number's, an example string marks its argument in the trace."""
    return {v: n for n, v in _scalar_arguments(fusion_pass, form, inputs).items() if isinstance(v, str)}


def _with_string_arguments(pattern: pm.PatternExpr, strings: Mapping[str, str]) -> pm.PatternExpr:
    """`pattern` with each literal of `strings` (example value -> argument name) as that
    named argument, which matches any string and binds it (the same object at every use).

    torch's fx_to_pattern makes named arguments of numbers only (its scalar_workaround);
    a collective's group name is a string, and a form must take any group, not its example's."""
    if not strings:
        return pattern
    named = {value: pm.KeywordArg(name) for value, name in strings.items()}
    seen: set = set()

    def rename(arg: Any) -> Any:
        if isinstance(arg, str) and arg in named:
            return named[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(rename(item) for item in arg)
        visit(arg)
        return arg

    def visit(node: Any) -> None:
        if not isinstance(node, pm.PatternExpr) or id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, pm.MultiOutputPattern):
            for output in node.outputs:
                visit(output)
        elif isinstance(node, pm._TargetArgsExpr):  # noqa: SLF001
            node.args = tuple(rename(arg) for arg in node.args)
            node.kwargs = {key: rename(value) for key, value in node.kwargs.items()}
            node.flat_args_kwargs = node.flatten(node.args, node.kwargs)

    visit(pattern)
    return pattern


def _generic_pattern(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any],
                     kind: str) -> tuple[pm.PatternExpr, torch.fx.GraphModule]:
    """The structural pattern of `form` traced on `inputs` (sizes, scalars and dtypes as
    wildcards, the scalars' example values as named arguments), and the traced graph."""
    numbers = _scalar_workaround(fusion_pass, form, inputs)
    # torch's gen_pattern_and_search_gm takes those from the dict and the other arguments from
    # its example inputs, in order: the numbers are left out of them (wherever they stand)
    others = [value for name, value in zip(form.argnames, inputs) if name not in numbers]
    pattern, gm = pm.gen_pattern_and_search_gm(form.search, others, TRACERS[kind], numbers)
    return _with_string_arguments(pattern, _string_arguments(fusion_pass, form, inputs)), gm


def _with_npu_casts(fusion_pass: FusionPass, form: Form, search_gm: torch.fx.GraphModule, inputs: Sequence[Any],
                    joint: bool) -> Optional[tuple[pm.PatternExpr, torch.fx.GraphModule]]:
    """The pattern and graph of a traced search with torch_npu's cast spelling, if it has casts."""
    if not any(n.target is torch.ops.aten._to_copy.default for n in search_gm.graph.nodes):
        return None
    gm = spell_casts_as_npu(copy.deepcopy(search_gm), is_backward if joint else (lambda node: False))
    # as gen_pattern_and_search_gm converts the aten spelling (tangents keep their names)
    pattern = pm.fx_to_pattern(gm, ignore_types=(int, float, list, torch.device, torch.dtype),
                               argnames=form.argnames, scalar_workaround=_scalar_workaround(fusion_pass, form, inputs))
    return _with_string_arguments(pattern, _string_arguments(fusion_pass, form, inputs)), gm


def _spellings(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any], joint: bool) -> list:
    """[(kind, pattern, traced graph)] of a form at some inputs: as CPU traces it; with
    torch_npu's cast spelling when the trace has casts; and as an NPU compile records it
    (npu_dispatch.py) where that differs (the joint trace only where the forward one does:
    no emulated override changes a backward without its forward, tests/test_npu_dispatch.py,
    and joint traces are the costly ones)."""
    aten_kind, cast_kind, npu_kind = (JOINT, JOINT_NPU_CAST, JOINT_NPU) if joint else \
        (FORWARD, FORWARD_NPU_CAST, FORWARD_NPU)
    if form.npu_only:
        return [(npu_kind, *_generic_pattern(fusion_pass, form, inputs, npu_kind))]
    pattern, gm = _generic_pattern(fusion_pass, form, inputs, aten_kind)
    found = [(aten_kind, pattern, gm)]
    casts = _with_npu_casts(fusion_pass, form, gm, inputs, joint)
    if casts is not None:
        found.append((cast_kind, *casts))
    if _npu_spelling_differs(fusion_pass, form, inputs):
        found.append((npu_kind, *_generic_pattern(fusion_pass, form, inputs, npu_kind)))
    return found


def _npu_spelling_differs(fusion_pass: FusionPass, form: Form, inputs: Sequence[Any]) -> bool:
    """Whether the form's forward traces differently as an NPU compile records it."""
    forward = [i.detach() if isinstance(i, torch.Tensor) else i for i in inputs]
    cpu = TRACERS[FORWARD](form.search, forward)
    npu = TRACERS[FORWARD_NPU](form.search, forward)
    return cpu.code != npu.code


def _covered(form: Form, kind: str, gm: torch.fx.GraphModule, scalars: Mapping[str, Any],
             earlier: Sequence[Registration]) -> bool:
    """An earlier registration with the same replacement already matches this traced
    search, binding each argument to the same input: registering it adds nothing. (After
    canonicalisation and with every spelling accepted, `x[..., :h]` and `x.chunk(2)`, or
    `x / sqrt(v)` and `x * rsqrt(v)`, are one pattern; their training traces differ.)"""
    outputs = [n for n in pytree.tree_leaves(next(iter(gm.graph.find_nodes(op="output"))).args)
               if isinstance(n, torch.fx.Node)]
    # fx_to_pattern names the placeholders by position: the form's arguments, then tangents
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    names = [*form.argnames, *(str(p.target) for p in placeholders[len(form.argnames):])]
    expected = dict(zip(names, placeholders))
    for registration in earlier:
        if registration.kind != kind or registration.form.replace is not form.replace or not outputs:
            continue
        for pattern in registration.spelled:
            match = pattern.match(outputs[0])
            if match and all(_binds(scalars, match, name, node) for name, node in expected.items()):
                return True
    return False


def _keywords_of(gm: torch.fx.GraphModule, scalars: Mapping[str, Any]) -> set:
    """The (op, keyword, value) a traced search spells out. A value that is one of the
    form's scalar arguments (`scalars`: their example values) is a named argument of the
    pattern, which matches any value (the same at each of its uses): SCALAR_ARGUMENT."""
    examples = {(type(v), v) for v in scalars.values()}

    def spelled(value: Any) -> str:
        is_scalar = isinstance(value, (int, float, str)) and not isinstance(value, bool)
        return SCALAR_ARGUMENT if is_scalar and (type(value), value) in examples else keyword_value(value)

    return {(str(n.target), key, spelled(value)) for n in gm.graph.nodes for key, value in n.kwargs.items()}


SCALAR_ARGUMENT = "<scalar argument>"


def keyword_value(value: Any) -> str:
    """A keyword argument as the unexpected-keyword check compares it (accept.py): a tensor
    (a node) by being there, since the matcher compared the node itself where the pattern
    has the keyword (a backward op's keyword-only tensors: npu_fusion_attention_grad_v3's
    atten_mask); any other value by its repr."""
    return "<node>" if isinstance(value, torch.fx.Node) else repr(value)


def _binds(scalars: Mapping[str, Any], match: pm.Match, name: str, placeholder: torch.fx.Node) -> bool:
    """The match binds argument `name` as the traced search has it: a tensor to its
    placeholder, a scalar (a literal in the trace: `scalars`, its traced value) to that value."""
    if name in scalars:
        return match.kwargs.get(name, scalars[name]) == scalars[name]
    return match.kwargs.get(name) is placeholder or (name.startswith("tangents") and name not in match.kwargs)


def _trace(fusion_pass: FusionPass, forms: Sequence[Form]) -> PatternSet:
    """Trace every form (the slow path: seconds per pass)."""
    forward, keywords = [], {form: set() for form in forms}
    with FakeTensorMode():
        emitted = {form: _emitted_ops(fusion_pass, form) for form in forms}
        for form in forms:
            for dtype, variant in itertools.product(form.dtypes, fusion_pass.variants_of(form)):
                inputs = [fusion_pass.example_value(n, dtype, variant) for n in form.argnames]
                scalars = _scalar_arguments(fusion_pass, form, inputs)
                for kind, pattern, gm in _spellings(fusion_pass, form, inputs, joint=False):
                    keywords[form] |= _keywords_of(gm, scalars)
                    if not _covered(form, kind, gm, scalars, forward):  # a form's dtypes and spellings often coincide
                        forward.append(Registration(form, pattern, kind))
    log.info("%s: traced %d patterns of %d forms", fusion_pass.name, len(forward), len(forms))
    forward = tuple(forward)
    # the keywords of the joint traces join the forms' when those are made (lazily)
    spelled = {f: set(k) for f, k in keywords.items()}
    patterns = PatternSet(fusion_pass, tuple(forms), lambda: forward, lambda: (), emitted, {}, "traced")

    def joint() -> tuple[Registration, ...]:
        found = _trace_joint(fusion_pass, tuple(forms), emitted, spelled)
        patterns.keywords.update({f: frozenset(k) for f, k in spelled.items()})
        return found

    patterns.build_joint = joint
    patterns.keywords.update({f: frozenset(k) for f, k in spelled.items()})
    return patterns


def _emitted_ops(fusion_pass: FusionPass, form: Form) -> tuple[str, ...]:
    """The non-aten ops the form's replacement calls, read from a trace of it; ops the
    search already contains (a custom op of the model the replacement keeps, an earlier
    pass's npu op) are carried over, not emitted, unless it is the op the form declares it
    emits (a pass that calls an earlier pass's op anew: paged_attention gives FIA a block
    table). Every one needs a capabilities entry."""
    inputs = [fusion_pass.example_value(n, form.dtypes[0]) for n in form.argnames]
    bound = [fusion_pass.example_value(n, form.dtypes[0]) for n in form.bound]  # (Form.bound: the pass's example)
    trace = TRACERS[FORWARD_NPU] if form.npu_only else trace_without_decompositions
    replaced = custom_ops(trace(form.replace, [*inputs, *bound]))
    declared = {form.fused_op or fusion_pass.fused_op} & replaced
    ops = sorted((replaced - custom_ops(trace(form.search, inputs))) | declared)
    for op in ops:
        capability(op)  # raises for an op the table lacks
    return tuple(ops)


def joint_candidates(fusion_pass: FusionPass, form: Form, emitted: Sequence[str]) -> list[tuple[str, ...]]:
    """The sets of arguments to trace `form` joint for: none unless every op it emits has a
    backward (capabilities.has_backward: an op without one would fail the compile when
    the replacement is traced with autograd), else one per subset of its differentiable
    tensor arguments (the backward nodes differ: no grad_weight for a frozen weight)."""
    if not fusion_pass.differentiable or not all(has_backward(op) for op in emitted):
        return []
    if form.grad_subsets is not None:
        return [tuple(s) for s in form.grad_subsets]
    grad_args = [n for n in fusion_pass.differentiable if n in form.argnames and not fusion_pass.is_scalar(n)]
    return [subset for size in range(len(grad_args), 0, -1) for subset in itertools.combinations(grad_args, size)]


def _trace_joint(fusion_pass: FusionPass, forms: Sequence[Form], emitted: dict,
                 keywords: dict) -> tuple[Registration, ...]:
    """The joint registrations; the keywords their traces spell out are added to `keywords`."""
    joint: list[Registration] = []
    with FakeTensorMode():
        for form in forms:
            for subset in joint_candidates(fusion_pass, form, emitted[form]):
                # the variants too: an autograd formula may depend on strides (the weight
                # gradient of _grouped_mm on a transposed weight view)
                for dtype, variant in itertools.product(form.dtypes, fusion_pass.variants_of(form)):
                    inputs = _joint_inputs(fusion_pass, form, dtype, variant, subset)
                    try:
                        found = _spellings(fusion_pass, form, inputs, joint=True)
                    except Exception as exc:  # noqa: BLE001 - e.g. no input of the subset reaches an output
                        log.debug("%s: no joint pattern for %s (%s, grads of %s): %s: %s", fusion_pass.name,
                                  form.name, dtype, list(subset), type(exc).__name__, exc)
                        continue
                    differentiable = tuple(n for n, v in zip(form.argnames, inputs)
                                           if isinstance(v, torch.Tensor) and v.requires_grad)
                    scalars = _scalar_arguments(fusion_pass, form, inputs)
                    for kind, pattern, gm in found:
                        keywords[form] |= _keywords_of(gm, scalars)
                        same_grads = [r for r in joint if r.requires_grad == differentiable]
                        if not _covered(form, kind, gm, scalars, same_grads):
                            joint.append(Registration(form, pattern, kind, differentiable))
    return tuple(joint)


def _joint_inputs(fusion_pass: FusionPass, form: Form, dtype: torch.dtype, variant: dict,
                  requires_grad: Sequence[str]) -> list:
    inputs = []
    for name in form.argnames:
        value = fusion_pass.example_value(name, dtype, variant)
        if name in requires_grad and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.requires_grad_(True)
        inputs.append(value)
    return inputs


# ---- precompiled patterns ----------------------------------------------------------------
def source_hash(fusion_pass: FusionPass) -> str:
    """What a precompiled file must have been generated from: the pass module's source and
    the trace-shaping engine modules' sources."""
    digest = hashlib.sha256()
    for module in (f"npu_fx_fusion.patterns.{fusion_pass.name}", *_TRACE_SHAPING_MODULES):
        spec = importlib.util.find_spec(module)
        with open(spec.origin, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _backward_map(ops: Sequence[str]) -> dict[str, bool]:
    return {op: has_backward(op) for op in sorted(set(ops))}


def _load_precompiled(fusion_pass: FusionPass, forms: Sequence[Form]) -> Optional[PatternSet]:
    try:
        module = importlib.import_module(f"{PRECOMPILED_PACKAGE}.{fusion_pass.name}")
    except ModuleNotFoundError:
        log.info("%s: no precompiled patterns; tracing its forms", fusion_pass.name)
        return None
    stale = _staleness(fusion_pass, forms, module)
    if stale:
        log.info("%s: precompiled patterns not used (%s); tracing its forms. "
                 "Regenerate them with scripts/precompile_patterns.py", fusion_pass.name, stale)
        return None
    by_key = {form.key: form for form in forms}
    # a form absent now (the library it matches is not loaded) is skipped
    present = [(by_key[form_key], kind, tuple(requires_grad), anchor, make)
               for form_key, kind, requires_grad, anchor, make in module.REGISTRATIONS if form_key in by_key]

    def build(joint: bool) -> tuple[Registration, ...]:
        return tuple(Registration(form, make(), kind, requires_grad)
                     for form, kind, requires_grad, _, make in present if is_joint_kind(kind) == joint)

    anchors = {which: frozenset((op, _target_of(target)) for _, kind, _, roots, _ in present
                                if is_joint_kind(kind) == (which == "joint") for op, target in roots)
               for which in ("forward", "joint")}
    return PatternSet(fusion_pass, tuple(forms), functools.partial(build, False), functools.partial(build, True),
                      {form: tuple(module.FORMS[form.key]["emitted_ops"]) for form in forms},
                      {form: frozenset(map(tuple, module.FORMS[form.key]["keywords"])) for form in forms},
                      "precompiled", known_anchors=anchors)


def _staleness(fusion_pass: FusionPass, forms: Sequence[Form], module: Any) -> Optional[str]:
    """Why a precompiled module does not describe these forms here, or None."""
    key = module.KEY
    if key["torch"] != torch.__version__:
        return f"generated with torch {key['torch']}, running {torch.__version__}"
    if key["sources"] != source_hash(fusion_pass):
        return "the pass or the engine's tracing changed since they were generated"
    missing = [form.key for form in forms if form.key not in module.FORMS]
    if missing:
        return f"form {missing[0]} is not among them"
    ops = [op for form in forms for op in module.FORMS[form.key]["emitted_ops"]]
    differs = [op for op, here in _backward_map(ops).items() if key["backward"].get(op) != here]
    if differs:
        return f"whether {differs[0]} has a backward differs here (torch_npu vs the stand-ins)"
    return None


def import_optional_form_libraries() -> None:
    """Import the libraries some forms exist only with (transformers' and torchtitan's
    custom ops: interop.py), so that a pass's forms are all of them."""
    import torchtitan.ops.scatter_add  # noqa: F401
    import transformers.integrations.moe  # noqa: F401


@deep_patterns()
def trace_patterns(fusion_pass: FusionPass) -> PatternSet:
    """The pass's patterns traced from its forms, whatever is precompiled."""
    npu_ops.ensure_registered()
    return _trace(fusion_pass, fusion_pass.forms)


@deep_patterns()
def precompiled_source(fusion_pass: FusionPass, traced: Optional[PatternSet] = None) -> str:
    """The text of patterns/_precompiled/<pass>.py for the current sources: every form the
    pass can have (every optional library it matches must be importable here). `traced`:
    the pass's trace_patterns(), if already made."""
    traced = traced or trace_patterns(fusion_pass)
    forms = traced.forms
    registrations = [*traced.forward, *traced.joint]
    index = {form: i for i, form in enumerate(forms)}
    ops = [op for form in forms for op in traced.emitted_ops[form]]
    lines = [
        f"# Generated by scripts/precompile_patterns.py from the forms of patterns/{fusion_pass.name}.py:",
        "# do not edit. tests/test_precompiled.py fails when this no longer matches what tracing gives;",
        "# npu_fx_fusion traces the forms instead whenever the key below does not match (registry.py).",
        "# flake8: noqa",
        "import operator",
        "",
        "import torch",
        f"from torch._inductor.pattern_matcher import {', '.join(_PATTERN_CLASSES)}",
        "",
        "aten = torch.ops.aten",
        "prims = torch.ops.prims",
        "inf = float('inf')",
        "",
        f"KEY = {{'torch': {torch.__version__!r}, 'sources': {source_hash(fusion_pass)!r},",
        f"       'backward': {_backward_map(ops)!r}}}",
        "",
        "FORMS = {",
    ]
    for form in forms:
        lines.append(f"    {form.key!r}: {{'emitted_ops': {traced.emitted_ops[form]!r},")
        lines.append(f"        'keywords': {sorted(traced.keywords[form])!r}}},")
    lines += ["}", ""]
    for number, registration in enumerate(registrations):
        lines += ["", f"def _p{number}():  # {registration.form.name} [{registration.kind}]"]
        body = _print_pattern(registration.pattern)
        lines += ["    " + line for line in _with_namespaces(body).splitlines()]
        lines.append("    return pattern")
        _check_round_trip(registration.pattern, body)
    lines += ["", "", "# (form key, kind, arguments traced as requiring grad, the (op, target)s a match",
              "#  starts from (one per spelling of the pattern's root: spellings.py), pattern builder)",
              "REGISTRATIONS = ["]
    for number, registration in enumerate(registrations):
        roots = tuple(sorted((op, _target_name(target)) for op, target in registration.anchors))
        lines.append(f"    ({registration.form.key!r}, {registration.kind!r}, {registration.requires_grad!r},")
        lines.append(f"     {roots!r}, _p{number}),  # form {index[registration.form]}")
    lines += ["]", ""]
    return "\n".join(lines)


class _Printer(pm.PatternPrettyPrinter):
    """torch's printer, with two fixes for patterns other than Inductor's attention ones:
    - a list argument (cat's tensors) is printed item by item (torch writes it with
      repr(), which gives the nested patterns' debugging repr, not code);
    - each named argument is one object, as in the pattern traced: torch writes a
      KeywordArg anew at each use, and a multi-output pattern finds its later outputs
      from the nodes its named arguments matched, by object (MultiOutputPattern's
      anchors), so with copies a joint pattern matches nothing."""

    def pretty_print(self, obj: Any) -> str:
        if isinstance(obj, (list, tuple)):
            items = ", ".join(self.pretty_print(x) for x in obj)
            return f"[{items}]" if isinstance(obj, list) else f"({items}{',' if len(obj) == 1 else ''})"
        if isinstance(obj, (pm.KeywordArg, pm.ExclusiveKeywordArg)):
            if obj not in self.memoized_objs_names:
                self.memoized_objs_names[obj] = self.namespace.create_name(f"arg_{obj.name}", None)
                self.memoized_objs_pp[obj] = f"{type(obj).__name__}({obj.name!r})"
            return self.memoized_objs_names[obj]
        return super().pretty_print(obj)


def _print_pattern(pattern: pm.PatternExpr) -> str:
    """Python statements that build `pattern` into the name `pattern`."""
    printer = _Printer()
    out = pattern.pretty_print(pp=printer)
    lines = [f"{printer.memoized_objs_names[key]} = {printer.memoized_objs_pp[key]}"
             for key in printer.memoized_objs_names]
    return "\n".join([*lines, f"pattern = {out}"])


_PATTERN_CLASSES = ("Arg", "CallFunction", "CallFunctionVarArgs", "CallMethod", "CallMethodVarArgs",
                    "CallModule", "CallModuleVarArgs", "ExclusiveKeywordArg", "Ignored", "KeywordArg",
                    "ListOf", "MultiOutputPattern", "RepeatedExpr")


def _with_namespaces(body: str) -> str:
    """PatternPrettyPrinter writes ops as `npu.npu_rms_norm.default`: bind each op
    namespace it uses, as `aten` is bound at the top of the file."""
    import re

    namespaces = sorted(set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+\b", body))
                        - {"aten", "prims", "torch", "operator"})
    bindings = [f"{ns} = torch.ops.{ns}" for ns in namespaces if hasattr(torch.ops, ns)]
    return "\n".join([*bindings, body])


def _check_round_trip(pattern: pm.PatternExpr, body: str) -> None:
    """The printed pattern must build a pattern that prints the same and shares the same
    sub-patterns (matching relies on which parts are one object)."""
    namespace: dict = {"torch": torch, "operator": operator, "aten": torch.ops.aten,
                       "prims": torch.ops.prims, "inf": float("inf")}
    exec("from torch._inductor.pattern_matcher import *\n" + _with_namespaces(body), namespace)  # noqa: S102
    built = namespace["pattern"]
    again = _print_pattern(built)
    if again != body or _sharing(built) != _sharing(pattern):
        raise ValueError(f"a pattern does not survive printing:\n{body}\n---\n{again}")


def _sharing(pattern: Any) -> list:
    """The pattern's objects in depth-first order, each as the index of its first visit:
    two patterns with equal lists share their parts alike."""
    seen: dict[int, int] = {}
    order: list = []

    def visit(obj: Any) -> None:
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)
            return
        if not isinstance(obj, pm.PatternExpr):
            return
        first = id(obj) not in seen
        order.append(seen.setdefault(id(obj), len(seen)))
        if first:
            for child in (*getattr(obj, "args", ()), *getattr(obj, "kwargs", {}).values(),
                          *getattr(obj, "outputs", ())):
                visit(child)

    visit(pattern)
    return order
