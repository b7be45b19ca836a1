"""A thin layer over torch._inductor.pattern_matcher for the pattern catalog.

A fusion (one module in npu_fx_fusion.patterns) declares a FusionPass: its unfused
forms as plain PyTorch functions, the fused replacement, a check that returns the first
reason not to fuse (or None), and an anchor predicate that finds candidate sites so that
the ones left unfused are reported as near misses. This module turns that into
`register_replacement` calls on a private PatternMatcherPass, registered lazily on first
use, and records what matched and what was turned down and why.

Two decisions matter for correctness:
- Search functions are traced without decompositions. `fwd_only` applies Inductor's
  decomposition table by default (silu -> neg/exp/add/div ...), but torchair's graphs
  are aot_autograd graphs with almost none (shared/reference/torchair.md, section 2.2).
- Before accepting a match, the replacement is run on the match's fake values and must
  produce outputs of the same shapes and dtypes as the subgraph it replaces. That catches
  type promotion (an fp32 weight on a bf16 activation) and broadcasting, whatever a
  pattern's own check forgot.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode

from . import npu_ops
from .capabilities import capability, has_backward, not_lowerable
from .report import FusedSite, NearMiss, PassResult, location_of

log = logging.getLogger("npu_fx_fusion.matching")

Node = torch.fx.Node
Reason = Optional[str]  # None: fine; a string: why not


def trace_without_decompositions(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """Trace a search/replace function into the aten that torchair's graphs contain.

    fwd_only minus Inductor's decompositions, functionalized as aot_autograd's graphs are
    (F.rms_norm's in-place `add_` becomes `add`), with reduction dims canonicalised the
    way the pipeline canonicalises the graphs it matches on (canonicalize).
    """
    kwargs["get_decomp_fn"] = dict  # -> {}; torch passes its own default explicitly otherwise
    gm = pm.fwd_only(fn, args, **kwargs)
    if _functionalize_inplace_on_temporaries(gm.graph) + canonicalize(gm.graph):
        gm.recompile()
    return gm


def _functionalize_inplace_on_temporaries(graph: torch.fx.Graph) -> int:
    """`add_(t, eps)` on a temporary `t` used nowhere else -> `add(t, eps)`.

    That is what aot_autograd's functionalization makes of it (F.rms_norm's eps add), and
    make_fx alone does not functionalize. Only this trivial case occurs in search
    functions; anything else is left alone (and then simply will not match).
    """
    changed = 0
    for node in graph.nodes:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.name.endswith("_"):  # noqa: SLF001
            continue
        mutated = node.args[0] if node.args else None
        if not isinstance(mutated, Node) or mutated.op == "placeholder" or len(mutated.users) != 1:
            continue
        packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1][:-1], None)  # noqa: SLF001
        functional = getattr(packet, target._overloadname, None)  # noqa: SLF001
        if functional is not None:
            node.target = functional
            changed += 1
    return changed


def trace_with_npu_dtype_casts(fn: Callable, args: Sequence[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """The same trace with each dtype conversion spelled `npu._npu_dtype_cast(x, dtype)`.

    On an NPU, torch_npu records `x.to(dtype)` that way in aot graphs, where CPU records
    `aten._to_copy(x, dtype=...)` (torchair's own patterns accept both).
    """
    return spell_casts_as_npu(trace_without_decompositions(fn, args, **kwargs))


def spell_casts_as_npu(gm: torch.fx.GraphModule,
                       is_gradient_cast: Callable[[Node], bool] = lambda node: False) -> torch.fx.GraphModule:
    """Each dtype conversion of `gm` as torch_npu records it: `npu._npu_dtype_cast(x, dtype)`,
    and in a joint graph's backward (is_gradient_cast) `npu._npu_dtype_cast_backward(grad,
    dtype)`, its derivative."""
    for node in gm.graph.nodes:
        if (node.target is torch.ops.aten._to_copy.default and "dtype" in node.kwargs
                and set(node.kwargs) <= {"dtype", "layout", "device"}):
            cast = torch.ops.npu._npu_dtype_cast_backward if is_gradient_cast(node) else torch.ops.npu._npu_dtype_cast
            node.target, node.args, node.kwargs = cast.default, (node.args[0], node.kwargs["dtype"]), {}
    gm.recompile()
    return gm


# op -> (index of its dim argument, whether that argument is a list of dims). The rank a
# dim refers to is the first tensor input's (cat: the first tensor of its list).
_DIM_ARGUMENTS = {
    torch.ops.aten.mean.dim: (1, True),
    torch.ops.aten.sum.dim_IntList: (1, True),
    torch.ops.aten.amax.default: (1, True),
    torch.ops.aten.amin.default: (1, True),
    torch.ops.aten.slice.Tensor: (1, False),
    torch.ops.aten.split.Tensor: (2, False),
    torch.ops.aten.split_with_sizes.default: (2, False),
    torch.ops.aten.cat.default: (1, False),
    torch.ops.aten.select.int: (1, False),
}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def canonicalize(graph: torch.fx.Graph) -> int:
    """Spell dims and view sizes one way: the same op, whichever way the code wrote it.

    - dim arguments as negative indices (`mean(x, [2])` on 3-d x -> `[-1]`): model code
      says `mean(-1)`, F.rms_norm `mean([x.dim() - 1])`, dynamo turns `x[..., :h]` into
      `slice(x, 3, 0, h)`;
    - a -1 in a view's sizes as the size it stands for (`view(x, [2, 16, -1, 2])` ->
      `[2, 16, 32, 2]`), where that size is a plain int: `reshape(..., -1, 2)` reaches
      the graph with or without its -1;
    - no `detach`: aot graphs run without autograd, where it is the identity. Joint
      graphs detach what they save for the backward, and a search may detach an output
      the model uses without a gradient (a router's full scores), so that its joint
      trace has no tangent for it.
    Search functions and matched graphs are both canonicalised. Returns the number of
    nodes changed; the computation is unchanged.
    """
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default and not (
                node.args[0].op == "placeholder" and any(u.op == "output" for u in node.users)):
            # (an input's detached alias leaving the graph stays: aot's runtime wrapper
            # knows that output as a view of the input)
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            changed += 1
            continue
        if node.target in _VIEWS:
            changed += _resolve_inferred_size(node)
            continue
        if node.target not in _DIM_ARGUMENTS:
            continue
        index, is_list = _DIM_ARGUMENTS[node.target]
        if len(node.args) <= index:
            continue  # the default dim (cat's 0, slice's 0): leave it
        source = node.args[0][0] if node.target is torch.ops.aten.cat.default else node.args[0]
        source = tensor_meta(source)
        dims = node.args[index]
        if source is None or source.dim() == 0 or not isinstance(dims, (int, list, tuple)):
            continue
        rank = source.dim()
        canonical = ([d - rank if d >= 0 else d for d in dims] if is_list
                     else (dims - rank if isinstance(dims, int) and dims >= 0 else dims))
        if canonical != (list(dims) if is_list else dims):
            node.args = (*node.args[:index], canonical, *node.args[index + 1:])
            changed += 1
    return changed


def _resolve_inferred_size(view: Node) -> int:
    out = tensor_meta(view)
    if out is None or len(view.args) < 2 or not isinstance(view.args[1], (list, tuple)):
        return 0
    sizes = list(view.args[1])
    if -1 not in sizes or len(sizes) != out.dim() or not isinstance(out.shape[sizes.index(-1)], int):
        return 0
    sizes[sizes.index(-1)] = out.shape[sizes.index(-1)]
    view.args = (view.args[0], sizes, *view.args[2:])
    return 1


def _trace_searches_once(trace_fn: Callable, cache: dict, fn: Callable, args: Sequence[Any],
                         **kwargs: Any) -> torch.fx.GraphModule:
    """trace_fn, remembering the traces of search functions per argument signature.

    To verify a structural match, torch's matcher retraces the search function on the
    match's own values (shapes decide slice bounds, view sizes ...). Every layer of a
    model gives the same shapes, so that trace is the same graph each time; it is only
    read (turned into a pattern), never changed. That retrace was half of a pass's time.
    Replacements, and arguments with symbolic sizes, are traced every time.
    """
    if not getattr(fn, "_nff_search", False):
        return trace_fn(fn, args, **kwargs)
    return _memoized_trace(trace_fn, cache, fn, args, **kwargs)


def _memoized_trace(trace_fn: Callable, cache: dict, fn: Callable, args: Sequence[Any],
                    **kwargs: Any) -> torch.fx.GraphModule:
    """trace_fn(fn, args), from `cache` when it was traced with the same argument signature
    (arguments with symbolic sizes are traced every time)."""
    key = _signature(trace_fn, fn, args)
    if key is None:
        return trace_fn(fn, args, **kwargs)
    if key not in cache:
        if len(cache) >= 512:  # a bound, not an expected size
            cache.clear()
        cache[key] = trace_fn(fn, args, **kwargs)
    return cache[key]


def _signature(trace_fn: Callable, fn: Callable, args: Sequence[Any]) -> Optional[tuple]:
    parts: list[Any] = [trace_fn, fn]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if not all(isinstance(d, int) for d in (*arg.shape, *arg.stride())):
                return None
            parts.append((tuple(arg.shape), arg.stride(), arg.dtype, arg.device.type, arg.requires_grad))
        elif isinstance(arg, (int, float, bool, str, type(None), torch.dtype)):
            parts.append((type(arg), arg))
        else:
            return None
    return tuple(parts)


@dataclass(frozen=True)
class Form:
    """One unfused form and the fused call that computes the same thing.

    `search` and `replace` take the same arguments. Tensor arguments match any tensor
    node; scalar arguments (eps, ...) are captured from the matched graph, never baked in.
    `dtypes` are the dtypes to trace at: a cast to float32 vanishes from an fp32 trace, so
    forms with upcasts are traced at a half dtype as well.
    """

    search: Callable
    replace: Callable
    dtypes: tuple = (torch.float32, torch.bfloat16)
    fused_op: Optional[str] = None  # the op the report names, if not the pass's fused_op
    # For forms whose outputs are equal only up to what the model never relies on (the
    # order of an unsorted top-k's k experts, the slots of keys a mask hides):
    # (outputs, {argument name: input}) -> the outputs in one canonical form, applied to
    # both sides before verification compares them.
    canonical_outputs: Optional[Callable[[list, dict], list]] = None
    # Training graphs: the sets of differentiable arguments to trace joint patterns for;
    # None: every non-empty subset of the pass's `differentiable` (a big block with five
    # trainable inputs would otherwise trace 31 variants).
    grad_subsets: Optional[Sequence[tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        self.search._nff_search = True  # its retraces may be cached (_trace_searches_once)

    @property
    def name(self) -> str:
        return self.search.__name__

    @property
    def argnames(self) -> list[str]:
        return list(inspect.signature(self.search).parameters)


@dataclass
class Site:
    """A candidate match, seen through the values it binds (fake tensors and scalars)."""

    form: Form
    args: dict[str, Any]
    nodes: list[Node]
    arg_nodes: dict[str, Any]
    soc: Optional[str]
    mode: Optional[str] = None  # the torchair mode it is lowered in, when known
    # a check may add what the report should say about a site it accepts ("max-autotune
    # on Ascend910B would need ...")
    notes: list[str] = field(default_factory=list)
    verified: str = ""  # the verification verdict, when FusionConfig(verify=True)

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def hardware_limits(self, broken: Sequence[str]) -> Reason:
        """For limits of the real kernels that the CPU stand-ins do not have (head dims,
        head counts, dtypes of the MLA kernels): with a SoC given, the first one broken is
        the reason not to fuse; in emulation (no SoC) the site fuses and each broken limit
        becomes a note, so the report says what a real NPU would refuse."""
        broken = [reason for reason in broken if reason]
        if not broken:
            return None
        if self.soc is not None:
            return broken[0]
        self.notes.extend(f"on an NPU: {reason}" for reason in broken)
        return None


@dataclass
class _PassRun:
    """What one apply() of a FusionPass saw: accepted sites and rejections by node."""

    soc: Optional[str]
    mode: Optional[str]
    verify: bool = False
    joint: bool = False  # matching joint patterns on a joint graph
    sites: list[FusedSite] = field(default_factory=list)
    rejections: dict[Node, tuple[Form, str]] = field(default_factory=dict)
    from_tangents: dict[Node, bool] = field(default_factory=dict)  # memo of _reads_tangents

    def reject(self, form: Form, nodes: Sequence[Node], reason: str) -> None:
        for node in nodes:
            self.rejections.setdefault(node, (form, reason))

    def reason(self, node: Node) -> Reason:
        return self.rejections[node][1] if node in self.rejections else None


class FusionPass:
    """One fusion: forms -> fused op, with its checks and near-miss diagnosis.

    name:     the pass name (config.PASS_NAMES)
    fused_op: the op the replacement emits, "npu.npu_rms_norm"
    forms:    the unfused forms, most specific first (tried in this order at each node);
              or a function returning them, for forms that exist only once some library
              is imported (transformers' custom ops): it is asked again at every apply,
              and the patterns are registered again when its answer changes
    example:  example value per argument name, as a function of dtype (tensors), or a
              float/int for scalars. A scalar's example value marks it in the trace, so it
              must not occur elsewhere in the search function's graph.
    check:    check(site) -> reason or None, run on every structural match
    anchor:   anchor(node) -> bool, the nodes that signal a candidate site
    explain:  explain(anchor_node) -> reason or None, for an anchor no form matched
    verify_input: verify_input(arg_name, {arg_name: fake value}) -> a real input for
              verification, or None for the default (random normal floats, small random
              integers)
    example_variants: further examples, each overriding some of `example`, whose traces are
              registered too: torch's matmul decomposes by strides (a view at batch 1, a
              clone + _unsafe_view at batch 2), so a form traced at one batch size does not
              match the other
    prefilter: prefilter(graph) -> bool, for passes whose patterns cost seconds to register:
              False means no form can match this graph, and the pass only looks for near
              misses there, without registering anything (it must never be False where a
              form would match)
    differentiable: the arguments that may carry a gradient in a training graph
              (("x", "weight") for a norm; rope's cos/sin come from buffers). Non-empty:
              the forms whose emitted ops have a backward are also matched on joint
              forward+backward graphs (joint_matcher, apply_joint; joint.py).
    forward_forms_on_joint: for a pass without `differentiable` whose sites carry no
              gradient in the models (DeepSeek-V3.2's indexer runs under no_grad): its
              forward-only patterns also run on joint graphs, where its check sees the
              backward's uses of its outputs (after partitioning they are forward-graph
              outputs, saved for a backward the check cannot see). A region a gradient
              flows through does not match there: its backward reads its intermediates.
    """

    def __init__(self, *, name: str, fused_op: str,
                 forms: Union[Sequence[Form], Callable[[], Sequence[Form]]],
                 example: Mapping[str, Any], check: Callable[[Site], Reason],
                 anchor: Callable[[Node], bool], explain: Callable[[Node], Reason],
                 verify_input: Optional[Callable[[str, Mapping[str, Any]], Any]] = None,
                 differentiable: Sequence[str] = (),
                 example_variants: Sequence[Mapping[str, Any]] = (),
                 prefilter: Optional[Callable[[torch.fx.Graph], bool]] = None,
                 forward_forms_on_joint: bool = False):
        self.name = name
        self.forward_forms_on_joint = forward_forms_on_joint
        self.prefilter = prefilter
        self.example_variants = tuple(dict(v) for v in example_variants)
        unknown = set(differentiable) - set(example)
        if unknown:
            raise ValueError(f"{name}: differentiable names unknown arguments {sorted(unknown)}")
        self.differentiable = tuple(differentiable)
        self._replacement_traces: dict = {}
        self.joint_forms: tuple[Form, ...] = ()  # the forms registered joint
        self._npu_cast_spelling_pending: list = []  # (form, dtype, subset, variant) in CPU spelling only
        self.verify_input = verify_input
        self.fused_op = fused_op
        self._forms_source = forms
        self.example = dict(example)
        self.check = check
        self.anchor = anchor
        self.explain = explain
        self._run: Optional[_PassRun] = None
        self._search_traces: dict = {}
        self._retrace_args: Sequence[Any] = ()
        self._keywords: dict[str, frozenset] = {}
        self.forms: tuple[Form, ...] = ()
        self._refresh_forms()

    def _refresh_forms(self) -> None:
        forms = tuple(self._forms_source() if callable(self._forms_source) else self._forms_source)
        if forms == self.forms:
            return
        for form in forms:
            missing = set(form.argnames) - set(self.example)
            if missing:
                raise ValueError(f"{self.name}: form {form.name} has no example for {sorted(missing)}")
        self.forms = forms
        for registered in ("matcher", "emitted_ops", "joint_matcher"):  # register the new set on next use
            self.__dict__.pop(registered, None)

    # ---- registration (lazy: tracing every form costs time, pay it on first use) ----------
    @functools.cached_property
    def matcher(self) -> pm.PatternMatcherPass:
        npu_ops.ensure_registered()
        matcher = pm.PatternMatcherPass(pass_name=f"npu_fx_fusion.{self.name}")
        with FakeTensorMode():
            for form in self.forms:
                # Duplicates are skipped within a form (its dtype and cast-spelling traces
                # often coincide) but not across forms: two forms may share a search
                # function with different replacements, the second one the fallback
                # where the first one's check fails.
                matcher.seen_patterns.clear()
                for dtype in form.dtypes:
                    self._register(matcher, form, dtype)
        return matcher

    @functools.cached_property
    def joint_matcher(self) -> Optional[pm.PatternMatcherPass]:
        """The same forms as joint forward+backward patterns, or None if none applies.

        A form is registered joint only when every op its replacement emits has a
        backward (capabilities.has_backward): the replacement is traced with autograd at
        match time, and an op without one would fail the compile. Each form is traced
        once per non-empty subset of its differentiable tensor arguments that require
        grad, because the backward nodes differ (no grad_weight for a frozen weight); a
        subset whose trace has no backward at all fails to register and is skipped (the
        forward-only pass after partitioning covers it). Casts are traced in CPU's
        spelling (aten._to_copy); torch_npu's (`_npu_dtype_cast`, and its derivative
        `_npu_dtype_cast_backward` in the backward) is registered the first time a graph
        holds one (_register_npu_cast_spelling): it doubles the cost of every form with a
        cast, and a graph comes from one device.
        """
        from .joint import trace_joint_without_decompositions

        if not self.differentiable:
            return None
        npu_ops.ensure_registered()
        matcher = pm.PatternMatcherPass(pass_name=f"npu_fx_fusion.{self.name}.joint")
        registered = []
        self._npu_cast_spelling_pending = []
        with FakeTensorMode():
            for form in self.forms:
                if not all(has_backward(op) for op in self.emitted_ops[form]):
                    continue
                grad_args = [n for n in self.differentiable if n in form.argnames
                             and callable(self.example[n])]
                matcher.seen_patterns.clear()  # as in `matcher`: fallbacks across forms
                subsets = form.grad_subsets if form.grad_subsets is not None else _non_empty_subsets(grad_args)
                for subset in subsets:
                    for dtype in form.dtypes:
                        # the variants too: an autograd formula may depend on strides (the
                        # weight gradient of _grouped_mm on a transposed weight view)
                        for variant in ({}, *self.example_variants):
                            if self._register_joint(matcher, form, dtype, subset,
                                                    trace_joint_without_decompositions, variant):
                                registered.append(form)
                                if self._has_casts(form, dtype, variant):
                                    self._npu_cast_spelling_pending.append((form, dtype, subset, variant))
        self.joint_forms = tuple(dict.fromkeys(registered))
        return matcher if registered else None

    def _register_npu_cast_spelling(self, matcher: pm.PatternMatcherPass) -> None:
        """Add the joint patterns of the forms with casts in torch_npu's spelling."""
        from .joint import trace_joint_with_npu_dtype_casts

        pending, self._npu_cast_spelling_pending = self._npu_cast_spelling_pending, []
        with FakeTensorMode():
            for form, dtype, subset, variant in pending:
                matcher.seen_patterns.clear()
                self._register_joint(matcher, form, dtype, subset, trace_joint_with_npu_dtype_casts, variant)

    def _register_joint(self, matcher: pm.PatternMatcherPass, form: Form, dtype: torch.dtype,
                        requires_grad: Sequence[str], trace_fn: Callable,
                        variant: Optional[Mapping[str, Any]] = None) -> bool:
        scalars = {n: v for n, v in self.example.items()
                   if n in form.argnames and isinstance(v, (int, float))}
        inputs = []
        for name in form.argnames:
            value = self._example_value(name, dtype, variant)
            if name in requires_grad and isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.requires_grad_(True)
            inputs.append(value)
        try:
            pm.register_replacement(
                form.search, form.replace, inputs,
                trace_fn=functools.partial(self._trace_joint, trace_fn),
                pass_dicts=matcher,
                extra_check=functools.partial(self._extra_check, form),
                scalar_workaround=scalars,
                skip_duplicates=True,
            )
        except Exception as exc:  # noqa: BLE001 - e.g. no input of the subset reaches an output
            log.debug("%s: no joint pattern for %s (%s, grads of %s): %s: %s", self.name, form.name,
                      dtype, list(requires_grad), type(exc).__name__, exc)
            return False
        return True

    def _trace_joint(self, trace_fn: Callable, fn: Callable, args: Sequence[Any], **kwargs: Any):
        """_trace_search for joint traces; replacements are cached as well.

        A joint replacement trace is a full aot_autograd run (~50 ms), repeated for every
        site of every layer with the same shapes. torch's matcher only reads the traced
        replacement (an Interpreter copies it into the graph), so one trace per argument
        signature serves all of them. The copies keep the trace's fake values, which
        belong to the fake mode of the graph being fused: apply_joint empties the cache
        for every graph, or values of two modes would meet in later passes.
        """
        if getattr(fn, "_nff_search", False):
            return self._trace_search(trace_fn, fn, args, **kwargs)
        return _memoized_trace(trace_fn, self._replacement_traces, fn, args, **kwargs)

    @functools.cached_property
    def emitted_ops(self) -> dict[Form, tuple[str, ...]]:
        """{form: the non-aten ops its replacement calls ("npu.npu_rms_norm", ...)}.

        Keyed by the Form, not its name: a fallback form shares its search (and name) with
        the form it stands in for, and emits other ops.

        Read from a trace of each replacement, so what is checked for lowerability is
        what a fusion really emits. Every one must have a capabilities entry.
        """
        npu_ops.ensure_registered()
        emitted = {}
        with FakeTensorMode():
            for form in self.forms:
                inputs = [self._example_value(n, form.dtypes[0]) for n in form.argnames]
                # ops the search already contains (a custom op of the model the replacement
                # keeps, an earlier pass's npu op) are carried over, not emitted
                ops = sorted(_custom_ops(trace_without_decompositions(form.replace, inputs))
                             - _custom_ops(trace_without_decompositions(form.search, inputs)))
                for op in ops:
                    capability(op)  # raises for an op the table lacks
                emitted[form] = tuple(ops)
        return emitted

    def _register(self, matcher: pm.PatternMatcherPass, form: Form, dtype: torch.dtype) -> None:
        for variant in ({}, *self.example_variants):
            self._register_example(matcher, form, dtype, variant)

    def _register_example(self, matcher: pm.PatternMatcherPass, form: Form, dtype: torch.dtype,
                          variant: Mapping[str, Any]) -> None:
        scalars = {n: v for n, v in self.example.items()
                   if n in form.argnames and isinstance(v, (int, float))}
        inputs = [self._example_value(n, dtype, variant) for n in form.argnames]
        trace_fns = [trace_without_decompositions]
        if self._has_casts(form, dtype, variant):  # else the same pattern again
            trace_fns.append(trace_with_npu_dtype_casts)
        for trace_fn in trace_fns:
            pm.register_replacement(
                form.search,
                form.replace,
                inputs,
                trace_fn=functools.partial(self._trace_search, trace_fn),
                pass_dicts=matcher,
                extra_check=functools.partial(self._extra_check, form),
                scalar_workaround=scalars,
                # fp32 and half traces of a cast-free form are the same pattern, and so
                # are its two cast spellings
                skip_duplicates=True,
            )

    def _has_casts(self, form: Form, dtype: torch.dtype, variant: Optional[Mapping[str, Any]] = None) -> bool:
        """The form's search converts dtypes at `dtype` (so it has a torch_npu spelling too)."""
        if not hasattr(torch.ops.npu, "_npu_dtype_cast"):
            return False
        inputs = [self._example_value(n, dtype, variant) for n in form.argnames]
        traced = _trace_searches_once(trace_without_decompositions, self._search_traces, form.search, inputs)
        return any(n.target is torch.ops.aten._to_copy.default for n in traced.graph.nodes)

    def _trace_search(self, trace_fn: Callable, fn: Callable, args: Sequence[Any], **kwargs: Any):
        # torch's matcher retraces the search function with the match's own arguments,
        # then calls the extra check; the scalars among those arguments are the true ones
        # (see _site)
        self._retrace_args = args
        return _trace_searches_once(trace_fn, self._search_traces, fn, args, **kwargs)

    def _example_value(self, name: str, dtype: torch.dtype,
                       variant: Optional[Mapping[str, Any]] = None) -> Any:
        value = (variant or {}).get(name, self.example[name])
        return value(dtype) if callable(value) else value

    # ---- the check run on every structural match -----------------------------------------
    def _extra_check(self, form: Form, match: pm.Match) -> bool:
        run = self._run
        assert run is not None, "FusionPass matcher used outside apply()"
        site = self._site(form, match, run.soc, run.mode)
        reason = self._first_failure(site, match, run)
        if reason is not None:
            log.debug("%s: not fusing %s at %s: %s", self.name, form.name,
                      location_of(match.nodes), reason)
            run.reject(form, match.nodes, reason)
            return False
        run.sites.append(FusedSite.of_match(self.name, form.name, form.fused_op or self.fused_op, match.nodes,
                                            match.output_nodes(), self.anchor, "; ".join(self._notes(site, run)),
                                            site.verified))
        return True

    def _notes(self, site: Site, run: _PassRun) -> list[str]:
        notes = []
        # A form turned down over some of these nodes: say why this one serves instead.
        turned_down = next((run.rejections[n] for n in site.nodes if n in run.rejections), None)
        if turned_down is not None:
            form, reason = turned_down
            if form.search is site.form.search:  # an alternative replacement of one form
                notes.append(f"instead of {form.replace.__name__}: {reason}")
            else:
                notes.append(f"partial: the larger form {form.name} was turned down ({reason})")
        notes += site.notes
        if run.mode is None:  # emulation: say what torchair's GE mode would refuse
            notes += [reason for op in self.emitted_ops[site.form]
                      if (reason := not_lowerable(op, "max-autotune"))]
        return notes

    def _spelled_keywords(self, form: Form) -> frozenset:
        """(op, keyword, value) of every keyword argument the form's search spells out:
        torch's matcher compares those itself (argsort's stable=True)."""
        cached = self._keywords.get(form.name)
        if cached is None:
            with FakeTensorMode():  # registration traced this already: it comes from the cache
                inputs = [self._example_value(n, form.dtypes[0]) for n in form.argnames]
                traced = _trace_searches_once(trace_without_decompositions, self._search_traces,
                                              form.search, inputs)
            cached = self._keywords[form.name] = frozenset(
                (node.target, key, repr(value)) for node in traced.graph.nodes
                for key, value in node.kwargs.items())
        return cached

    def _site(self, form: Form, match: pm.Match, soc: Optional[str], mode: Optional[str]) -> Site:
        arg_nodes = {name: match.kwargs[name] for name in form.argnames if name in match.kwargs}
        # The check runs on torch's second, exact match, whose scalars are found by their
        # example values (scalar_workaround) in a retrace at the model's sizes: a size
        # that happens to equal an example value (8 experts in groups of 4, n_group's
        # example 4) would be read as the scalar. The retrace's own arguments are right.
        # (The replacement is traced from the first match's arguments, unaffected.)
        retraced = self._retrace_args[len(self._retrace_args) - len(form.argnames):]
        for name, value in zip(form.argnames, retraced):
            if isinstance(self.example[name], (int, float)) and isinstance(value, (int, float)):
                arg_nodes[name] = value
        args = {name: value.meta.get("val") if isinstance(value, Node) else value
                for name, value in arg_nodes.items()}
        return Site(form, args, list(match.nodes), arg_nodes, soc, mode)

    def _first_failure(self, site: Site, match: pm.Match, run: _PassRun) -> Reason:
        return ((_joint_roles_swapped(site, match, run) if run.joint else None)
                or self._argument_kinds_differ(site)
                or _unexpected_keyword(site.nodes, self._spelled_keywords(site.form))
                or next(filter(None, (not_lowerable(op, run.mode) for op in self.emitted_ops[site.form])), None)
                or self.check(site)
                or self._outputs_differ(site, match)
                or (self._verify(site, match) if run.verify else None))

    def _verify(self, site: Site, match: pm.Match) -> Reason:
        from .verify import Verdict, verify_joint_match, verify_match

        fused_op = site.form.fused_op or self.fused_op
        tangents = {name: node for name, node in match.kwargs.items() if name.startswith("tangents_")}
        if not tangents:
            verdict = verify_match(match.nodes, match.output_nodes(), site.args, site.arg_nodes,
                                   site.form.replace, site.form.argnames, fused_op,
                                   self._verification_input, site.form.canonical_outputs)
        elif site.form.canonical_outputs is not None:
            # outputs equal only up to an order the model ignores (a top-k's k experts): the
            # incoming gradients of the two sides would have to be reordered alike
            verdict = Verdict(True, "not verified: its outputs are compared in a canonical order, "
                                    "which random incoming gradients do not follow")
        else:
            verdict = verify_joint_match(match.nodes, match.output_nodes(), site.args, site.arg_nodes,
                                         tangents, site.form.replace, site.form.argnames, fused_op,
                                         self._verification_input)
        site.verified = verdict.detail
        return None if verdict.ok else f"verification failed: {verdict.detail}"

    def _verification_input(self, name: str, args: Mapping[str, Any], node: Any = None) -> Any:
        # A value the graph computes from no input (a causal mask built from aranges) is
        # verified as what it is, not as random data; then the pass's own factory.
        from .constants import evaluate_constant

        constant = evaluate_constant(node)
        if constant is not None:
            return constant
        return self.verify_input(name, args) if self.verify_input else None

    def _argument_kinds_differ(self, site: Site) -> Reason:
        for name in site.form.argnames:
            wants_tensor = callable(self.example[name])
            value = site.args.get(name)
            if wants_tensor and not isinstance(value, torch.Tensor):
                return f"{name} is {value!r}, not a tensor"
            if not wants_tensor and isinstance(site.arg_nodes.get(name), Node):
                return f"{name} is a tensor computed in the graph, not a constant"
        return None

    def _outputs_differ(self, site: Site, match: pm.Match) -> Reason:
        originals = [n.meta.get("val") if n is not None else None for n in match.output_nodes()]
        fake_mode = torch._guards.detect_fake_mode(list(site.args.values()))  # noqa: SLF001
        if fake_mode is None:
            return "the matched nodes carry no tensor metadata (meta['val'])"
        with fake_mode:
            fused = site.form.replace(*[site.args[n] for n in site.form.argnames])
        fused = list(fused) if isinstance(fused, (tuple, list)) else [fused]
        for index, (orig, new) in enumerate(zip(originals, fused)):
            if not isinstance(orig, torch.Tensor):
                continue
            if orig.dtype != new.dtype or orig.shape != new.shape:
                return (f"{self.fused_op} would give {_describe(new)} where the model computes "
                        f"{_describe(orig)} (output {index})")
        return None

    # ---- running -------------------------------------------------------------------------
    def apply(self, gm: torch.fx.GraphModule, soc: Optional[str] = None,
              mode: Optional[str] = None, verify: bool = False) -> PassResult:
        """Fuse every match in `gm` in place; report sites and near misses.

        soc: the SoC whose limits to honour; mode: the torchair mode the graph is lowered
        in (a form whose op that mode cannot lower is skipped, so a later form can serve);
        verify: check each site numerically before accepting it (verify.py).
        """
        self._refresh_forms()
        if self.prefilter is not None and not self.prefilter(gm.graph):  # near misses only
            return self._apply(None, gm, _PassRun(soc, mode, verify), anchors=lambda node: True)
        self.emitted_ops  # trace the replacements (and check their ops) outside the matcher
        result = self._apply(self.matcher, gm, _PassRun(soc, mode, verify), anchors=lambda node: True)
        if result.sites:
            # torch's matcher inserts a replacement with several outputs at its first one; an
            # argument an earlier fusion computed next to a later output (rms_norm's `1 + w`
            # for Gemma's norm, read by add_rms_norm's replacement at the residual add) is
            # then defined after its use: sort (stable: the rest keeps its order)
            pm.stable_topological_sort(gm.graph)
            gm.recompile()
        return result

    def apply_joint(self, gm: torch.fx.GraphModule, soc: Optional[str] = None,
                    mode: Optional[str] = None, verify: bool = False) -> Optional[PassResult]:
        """apply() on a joint forward+backward graph (normalised: joint.normalize_joint_graph)
        with the joint patterns (the forward-only ones with forward_forms_on_joint); None
        when this pass has none (it then runs after partitioning only). Near misses are
        looked for among forward nodes: a backward node never anchors a site. verify:
        each site's forward outputs and gradients against the fused op and its backward
        (verify.verify_joint_match)."""
        from .joint import is_backward

        self._refresh_forms()
        if self.prefilter is not None and not self.prefilter(gm.graph):  # near misses only
            return self._apply(None, gm, _PassRun(soc, mode, verify, joint=True),
                               anchors=lambda node: not is_backward(node))
        self.emitted_ops  # trace the replacements (and check their ops) outside the matcher
        matcher = self.joint_matcher
        if matcher is None and self.forward_forms_on_joint:
            matcher = self.matcher
        if matcher is None:
            return None
        if matcher is self.joint_matcher and self._npu_cast_spelling_pending and any(
                n.target is getattr(torch.ops.npu, "_npu_dtype_cast", None) for n in gm.graph.nodes):
            self._register_npu_cast_spelling(matcher)
        self._replacement_traces.clear()  # traces of this graph's fake mode only (_trace_joint)
        result = self._apply(matcher, gm, _PassRun(soc, mode, verify=verify, joint=True),
                             anchors=lambda node: not is_backward(node))
        if result.sites:
            # a joint replacement is inserted at one point of the graph, so its backward half
            # can land before nodes it reads: sort (stable: the rest keeps its order)
            pm.stable_topological_sort(gm.graph)
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return result

    def _apply(self, matcher: Optional[pm.PatternMatcherPass], gm: torch.fx.GraphModule, run: _PassRun,
               anchors: Callable[[Node], bool]) -> PassResult:
        """Run `matcher` (None: only look for near misses) and report."""
        result = PassResult(self.name)
        self._run = run
        existing = list(gm.graph.nodes)
        try:
            count = matcher.apply(gm) if matcher is not None else 0
        finally:
            self._run = None
        kept = set(existing)
        _inherit_source_meta([n for n in gm.graph.nodes if n not in kept], [n for n in existing if n._erased])  # noqa: SLF001
        if count != len(run.sites):  # the matcher and our bookkeeping must agree
            raise RuntimeError(f"{self.name}: matcher replaced {count} sites, accepted {len(run.sites)}")
        result.sites = run.sites[::-1]  # the matcher walks the graph backwards: source order
        for node in gm.graph.nodes:
            if anchors(node) and self.anchor(node):
                reason = run.reason(node) or self.explain(node) or self._no_form_matched()
                result.near_misses.append(NearMiss(self.name, reason, location_of([node, *node.users])))
        return result


    def _no_form_matched(self) -> str:
        # forms spelled in several operand orders share a base name: "name[cos*x]"
        names = list(dict.fromkeys(form.name.split("[")[0] for form in self.forms))
        return f"matches none of the forms {', '.join(names)}"


def _joint_roles_swapped(site: Site, match: pm.Match, run: _PassRun) -> Reason:
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
        if tangent != _reads_tangents(value, run.from_tangents):
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


_SOURCE_META = ("stack_trace", "nn_module_stack")


def _inherit_source_meta(new_nodes: Sequence[Node], erased: Sequence[Node] = ()) -> None:
    """Give replacement nodes the source line of the code they replaced.

    The pattern matcher copies it onto the replacement's output node only; the fused op
    call under a getitem would otherwise have no source line in dumps and reports. A
    replacement that keeps an op of the code it replaces (moe_dispatch keeps the expert
    GEMMs for grouped_matmul) gives each kept call the line of the call it stands for:
    the k-th new call of an op that as many `erased` nodes called takes the k-th one's
    (both in graph order). The rest take their users' (the output's, in the end).
    """
    erased_by_op: dict[Any, list[Node]] = {}
    for node in erased:
        if isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            erased_by_op.setdefault(node.target, []).append(node)
    new_by_op: dict[Any, list[Node]] = {}
    for node in new_nodes:
        if node.target in erased_by_op:
            new_by_op.setdefault(node.target, []).append(node)
    for target, kept in new_by_op.items():
        if len(kept) == len(erased_by_op[target]):
            for node, old in zip(kept, erased_by_op[target]):
                for key in _SOURCE_META:
                    if key not in node.meta and key in old.meta:
                        node.meta[key] = old.meta[key]
    for node in reversed(new_nodes):
        for key in _SOURCE_META:
            if key not in node.meta:
                donor = next((u for u in node.users if key in u.meta), None)
                if donor is not None:
                    node.meta[key] = donor.meta[key]


# Keyword arguments a matched node may carry beyond what a form spells out: they place or
# type the result (and a wrong dtype shows up in the output check), they never change the
# arithmetic. Anything else (add's alpha, div's rounding_mode, ...) does.
_HARMLESS_KEYWORDS = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking",
                                "memory_format", "keepdim"})


def _unexpected_keyword(nodes: Sequence[Node], spelled: frozenset = frozenset()) -> Reason:
    """torch's matcher drops node kwargs its pattern lacks (pattern_matcher.py,
    _TargetArgsExpr._match), so `torch.add(x, r, alpha=2)` matches `x + r`. Reject those;
    `spelled` are the (op, keyword, value) the pattern has, and the matcher compared."""
    for node in nodes:
        if not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
            continue
        defaults = {a.name: a.default_value for a in node.target._schema.arguments  # noqa: SLF001
                    if a.has_default_value()}
        for key, value in node.kwargs.items():
            if (node.target, key, repr(value)) in spelled:
                continue
            if key not in _HARMLESS_KEYWORDS and (key not in defaults or defaults[key] != value):
                return f"{node.name} ({node.target}) has {key}={value!r}, which the form does not compute"
    return None


def _non_empty_subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Largest first: ("x", "weight"), ("x",), ("weight",)."""
    return [subset for size in range(len(names), 0, -1)
            for subset in itertools.combinations(names, size)]


def _custom_ops(gm: torch.fx.GraphModule) -> set[str]:
    """The non-aten ops a traced function calls ("npu.npu_rms_norm", ...)."""
    return {_op_name(n.target) for n in gm.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload)  # noqa: SLF001
            and n.target.namespace not in ("aten", "prims")}


def _op_name(target: torch._ops.OpOverload) -> str:  # noqa: SLF001
    """npu.npu_rms_norm.default -> "npu.npu_rms_norm", the capabilities key."""
    return f"{target.namespace}.{target._schema.name.split('::')[-1]}"  # noqa: SLF001


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


# ---- helpers for pattern checks and explanations -----------------------------------------
def is_call(node: Any, *targets: Any) -> bool:
    """node is a call_function of one of `targets` (OpOverloadPackets match any overload)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target or getattr(node.target, "overloadpacket", None) is target:
            return True
    return False


def tensor_meta(node: Any) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def normalized_dims(dims: Any, rank: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return sorted(d % rank for d in dims)


def first_refused_use(site: "Site", accept: Callable[[Node, Node], bool], pass_on: Sequence[Any],
                      outputs: Optional[Sequence[Node]] = None) -> Optional[Node]:
    """The first node outside `site` that reads its `outputs` (default: every site node),
    directly or through `pass_on` ops (casts, views: what counts is where the values end
    up), and that `accept(user, value_it_reads)` refuses; None if every use is accepted."""
    inside = set(site.nodes)
    pending = [(user, node) for node in (site.nodes if outputs is None else outputs)
               for user in node.users if user not in inside]
    while pending:
        user, value = pending.pop()
        if is_call(user, *pass_on):
            pending += [(u, user) for u in user.users]
        elif not accept(user, value):
            return user
    return None


def users_outside(nodes: Sequence[Node], allowed: Sequence[Node]) -> Optional[tuple[Node, Node]]:
    """The first (node, user) where a user of `nodes` is not in `allowed`."""
    allowed_set = set(allowed)
    for node in nodes:
        for user in node.users:
            if user not in allowed_set:
                return node, user
    return None
