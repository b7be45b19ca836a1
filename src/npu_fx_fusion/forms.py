"""What a fusion declares: its unfused forms, the fused calls, its checks, its order.

A pattern module (npu_fx_fusion.patterns.<name>) defines `PASS = FusionPass(...)`. This
module holds those declarations and the `Site` a check reads; it traces and registers
nothing (registry.py does, on first use) and runs nothing (accept.py does).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.fx

from .report import ON_AN_NPU

Node = torch.fx.Node
Reason = Optional[str]  # None: fine; a string: why not


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
    # The search holds an op only an NPU graph has (aten.matmul_backward, the backward of a
    # matmul as torch_npu records it, which CPU has no kernel for): it is traced only as an
    # NPU compile records it, and matches only graphs traced that way.
    npu_only: bool = False
    # Examples this form is traced at besides the pass's `example`, each overriding some of its
    # values (a scalar too: a rank count); None: the pass's example_variants. For a form whose
    # structure depends on a value the others' does not (a concatenation of one slice per rank).
    example_variants: Optional[Sequence[Mapping[str, Any]]] = field(default=None, hash=False, compare=False)
    # Further arguments of `replace`, after the search's: graph values the search does not
    # compute but the fused call needs, which the pass's check finds and proves (the index
    # tensor a mask argument was scattered from) and binds with Site.bind. A site whose check
    # binds no node to one of them is not fused.
    bound: tuple = ()

    @property
    def name(self) -> str:
        return self.search.__name__

    @functools.cached_property
    def argnames(self) -> list[str]:
        return list(inspect.signature(self.search).parameters)

    @property
    def key(self) -> str:
        """Names the form among its pass's forms (two forms may share a search function:
        a fallback replacement; or a search and replacement, traced at other dtypes)."""
        dtypes = ",".join(str(d).replace("torch.", "") for d in self.dtypes)
        return f"{self.search.__name__} -> {self.replace.__name__} @ {dtypes}"


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
    # FusionConfig.keep_intermediate_rounding: a form whose fused op computes in more
    # precision than the code (rounds once where the code rounds each step) is refused
    keep_intermediate_rounding: bool = False
    # FusionConfig.ep_group: the c10d names of the process groups the user declared to carry
    # only the exchanges a pass may fuse into communicating kernels (a graph shows its own
    # collectives only, so it can never prove that of a group)
    dedicated_groups: frozenset = frozenset()
    # scalars computed from symbolic sizes that are a constant over a range of them
    # (min(index_topk, S)): {name: (constant, guard)}, guarded once the site is accepted
    specialised: dict = field(default_factory=dict)
    # Form.bound: {name: graph node} the check binds (Site.bind)
    bound: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def bind(self, name: str, node: Node) -> None:
        """Pass graph node `node` to the replacement as its argument `name` (one of
        Form.bound): a value the check proved the matched nodes compute from."""
        if name not in self.form.bound:
            raise ValueError(f"{self.form.name}: {name} is not one of the form's bound arguments {self.form.bound}")
        self.bound[name] = node

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
        self.notes.extend(ON_AN_NPU + reason for reason in broken)
        return None


def records_gradient(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records a call on `tensors` (None skipped): inside a replacement,
    whether it is traced jointly (its differentiable inputs require grad), so its fused ops
    must return what their backward reads, rather than on an inference or forward graph."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def is_training_graph(graph: torch.fx.Graph) -> bool:
    """A graph of a training step: the joint forward+backward graph, or the forward or the
    backward graph aot_autograd partitioned from it. aot_autograd names a training graph's
    inputs primals_* (and its incoming gradients tangents_*), an inference graph's arg*_*."""
    return any(str(node.target).startswith(("primals_", "tangents_")) for node in graph.find_nodes(op="placeholder"))


@dataclass(frozen=True)
class FinishOptions:
    """What a pass's finish() may honour: the run's SoC and torchair mode (None: CPU
    emulation, nothing excluded) and FusionConfig.keep_intermediate_rounding."""
    soc: Optional[str] = None
    mode: Optional[str] = None
    keep_intermediate_rounding: bool = False


@dataclass
class Recognized:
    """A site a pass found by what a region computes (its `recognize`), not by a traced form.

    The pass has evaluated the region (channel_algebra.py) and says what the fused call is:
    `replace(**args)` computes the value of `output` from the region's inputs `args` (graph
    nodes), with the fused op. `site_args` are the values its check reads (fake tensors:
    the op's own operands, as the replacement builds them). `reason`: why the region, which
    computes this pass's kind of thing, cannot be fused (a near miss, nothing replaced).

    `backward`: in a joint graph, the region of the backward that computes the gradients of
    the region's inputs from the gradient of its output (`backward_output`: the node of one
    gradient, or several, then `backward_replace` returns one value per node, in this order),
    and its replacement `backward_replace(**backward_args)` (the fused backward op): both are
    replaced, or neither. recognition.backward_region finds that region for any spelling."""

    name: str  # the spelling the report names ("rotation pairs, half mode")
    # the node the replacement stands for, or several (a router's weights and expert ids):
    # then `replace` returns one value per node, in this order
    output: Union[Node, Sequence[Node]]
    nodes: Sequence[Node]
    args: Mapping[str, Any] = field(default_factory=dict)
    replace: Optional[Callable] = None
    site_args: Mapping[str, Any] = field(default_factory=dict)
    fused_op: Optional[str] = None
    reason: Optional[str] = None
    notes: Sequence[str] = ()
    backward_output: Union[None, Node, Sequence[Node]] = None
    backward_nodes: Sequence[Node] = ()
    backward_args: Mapping[str, Any] = field(default_factory=dict)
    backward_replace: Optional[Callable] = None
    # a joint replacement, for a fused op whose backward reads what its forward saves: `replace`
    # traced forward and backward at once (through its autograd), given `args` (those named in
    # `needs_gradient` traced as requiring one) and then `output_gradients` (the gradient of
    # each output, in order). It stands for nodes and backward_nodes, its outputs for `outputs`
    # and then `backward_output` (the gradients of the arguments in `needs_gradient`, in order).
    output_gradients: Sequence[Node] = ()
    needs_gradient: Sequence[str] = ()
    # a near miss (`reason`) said only where nothing else does: the pass reports it unless
    # another of its near misses stands at the same source line (a region the algebra could
    # not evaluate, where the forms' own diagnosis, when there is one, says more)
    fallback: bool = False
    # verification: puts the region's and the replacement's outputs in one canonical form before
    # they are compared (Form.canonical_outputs; a top-k's slots in another order, say)
    canonical_outputs: Optional[Callable[[list, dict], list]] = None

    @property
    def outputs(self) -> list[Node]:
        return [self.output] if isinstance(self.output, Node) else list(self.output)

    @property
    def backward_outputs(self) -> list[Node]:
        if self.backward_output is None:
            return []
        return [self.backward_output] if isinstance(self.backward_output, Node) else list(self.backward_output)


def with_arguments(names: Sequence[str], body: Callable[[dict], Any], name: str) -> Callable:
    """body({name: value}) as a function of positional arguments `names`, with that signature:
    what the tracers call (make_fx reads a function's signature to count its inputs)."""
    names = list(names)

    def fn(*args):
        return body(dict(zip(names, args)))

    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    fn.__name__ = fn.__qualname__ = name
    return fn


# A list while the tests run (tests/conftest.py): every (pass name, target) of an anchor
# node whose target the pass's anchor_ops leave out, which its near-miss walk would skip.
ANCHOR_OPS_MISSED: Optional[list] = None


class FusionPass:
    """One fusion: forms -> fused op, with its checks, near-miss diagnosis and order.

    name:     the pass name: its module name in npu_fx_fusion.patterns
    fused_op: the op the replacement emits, "npu.npu_rms_norm"
    forms:    the unfused forms, most specific first (tried in this order at each node);
              or a function returning them, for forms that exist only once some library
              is imported (transformers' custom ops): it is asked again at every run,
              and the patterns are registered again when its answer changes
    example:  example value per argument name, as a function of dtype (tensors), or a
              float/int for scalars. A scalar's example value marks it in the trace, so it
              must not occur elsewhere in the search function's graph.
    check:    check(site) -> reason or None, run on every structural match (what it does
              to the graph is reverted if the pass fails)
    anchor:   anchor(node) -> bool, the nodes that signal a candidate site
    anchor_ops: the call targets an anchor node can have (OpOverloads, packets for all
              their overloads, other callables; a callable returning them, for targets that
              exist once a library is loaded): the near-miss walk visits only their nodes.
              None: every node (tests/conftest.py checks, in every test's graphs, that
              anchor() holds nowhere else)
    explain:  explain(anchor_node) -> reason or None, for an anchor no form matched
              (anchor, explain and prefilter only read the graph: they run on every
              graph, before the pass takes its revert snapshot)
    after:    passes that must run before this one (the pipeline order is derived from
              these declarations; passes without an order between them run by name)
    verify_input: verify_input(arg_name, {arg_name: fake value}) -> a real input for
              verification, or None for the default (random normal floats, small random
              integers)
    example_variants: further examples, each overriding some of `example`, whose traces are
              registered too: torch's matmul decomposes by strides (a view at batch 1, a
              clone + _unsafe_view at batch 2), so a form traced at one batch size does not
              match the other
    prefilter: prefilter(graph) -> bool: False means no form can match this graph, and the
              pass only looks for near misses there (it must never be False where a form
              would match)
    differentiable: the arguments that may carry a gradient in a training graph
              (("x", "weight") for a norm; rope's cos/sin come from buffers). Non-empty:
              the forms whose emitted ops have a backward are also matched on joint
              forward+backward graphs (docs/training.md).
    recognize: recognize(graph, joint) -> [Recognized]: sites found by what a region of the
              graph computes (channel_algebra.py), whatever its spelling; run after the
              forms, on what they left. Each goes through the same acceptance (lowering,
              check, the replacement's output shapes, verification) and report as a form's.
    finish:   finish(graph, FinishOptions) -> [note], run once when the pass fused sites in
              a graph, after every pass has run (pipeline._run_finishes): its own rewrites of
              the calls it emitted, where the graph around them
              offers a cheaper equal one (a group list read as the counts it was summed from;
              a cast or an add the op does itself). It keeps every value, up to the op's own
              rounding where keep_intermediate_rounding is off, emits nothing the SoC or mode
              cannot run, and returns a note per change, which the report lists under the pass.
    symbolic_scalars: scalar arguments that may be symbolic (a SymInt computed from the graph's
              sizes under dynamic shapes) because the check proves their value for every size
              itself (torchtitan-npu's padding lane S + T): the site keeps the SymInt (any
              other symbolic scalar is a constant over a size range, guarded, or a refusal:
              accept._argument_kinds_differ). The replacement must not take it as an int
              attribute (that would pin the compile to one size).
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
                 after: Sequence[str] = (),
                 verify_input: Optional[Callable[[str, Mapping[str, Any]], Any]] = None,
                 differentiable: Sequence[str] = (),
                 example_variants: Sequence[Mapping[str, Any]] = (),
                 prefilter: Optional[Callable[[torch.fx.Graph], bool]] = None,
                 forward_forms_on_joint: bool = False,
                 anchor_ops: Union[None, Sequence[Any], Callable[[], Sequence[Any]]] = None,
                 recognize: Optional[Callable[[torch.fx.Graph, bool], Sequence[Recognized]]] = None,
                 finish: Optional[Callable[[torch.fx.Graph, FinishOptions], list[str]]] = None,
                 symbolic_scalars: Sequence[str] = ()):
        self.name = name
        self.fused_op = fused_op
        self.example = dict(example)
        self.check = check
        self.anchor = anchor
        self.explain = explain
        if isinstance(after, str):
            raise TypeError(f"{name}: after= takes a sequence of pass names, got the string {after!r}")
        self.after = tuple(after)
        self.verify_input = verify_input
        unknown = set(differentiable) - set(example)
        if unknown:
            raise ValueError(f"{name}: differentiable names unknown arguments {sorted(unknown)}")
        self.differentiable = tuple(differentiable)
        self.example_variants = tuple(dict(v) for v in example_variants)
        self.prefilter = prefilter
        self.forward_forms_on_joint = forward_forms_on_joint
        self.recognize = recognize
        self.finish = finish
        unknown = [n for n in symbolic_scalars if n not in example or callable(example[n])]
        if unknown:
            raise ValueError(f"{name}: symbolic_scalars {unknown} are not scalar arguments of its example")
        self.symbolic_scalars = frozenset(symbolic_scalars)
        self._anchor_ops = anchor_ops
        self._forms_source = forms
        # Filled by the registration layer (registry.pattern_set) on first use: the traced
        # or precompiled patterns of each set of forms. Never per-run state.
        self.registered: dict[tuple, Any] = {}

    @property
    def forms(self) -> tuple[Form, ...]:
        """The forms available now (a callable source is asked again every time)."""
        forms = tuple(self._forms_source() if callable(self._forms_source) else self._forms_source)
        keys = [form.key for form in forms]
        if len(set(keys)) != len(keys):
            duplicate = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"{self.name}: two forms are the same search, replacement and dtypes ({duplicate})")
        for form in forms:
            missing = set(form.argnames) - set(self.example)
            if missing:
                raise ValueError(f"{self.name}: form {form.name} has no example for {sorted(missing)}")
        return forms

    def anchor_targets(self) -> Optional[frozenset]:
        """anchor_ops as the exact targets of call_function nodes (a packet's overloads), or
        None: any node may be an anchor."""
        ops = self._anchor_ops() if callable(self._anchor_ops) else self._anchor_ops
        if ops is None:
            return None
        targets = set()
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):  # noqa: SLF001
                targets.update(getattr(op, overload) for overload in op.overloads())
            elif op is not None:  # an optional library's target that is not loaded
                targets.add(op)
        return frozenset(targets)

    def candidate_anchors(self, graph: torch.fx.Graph, include: Callable[[Node], bool] = lambda node: True) -> list:
        """The nodes of `graph` anchor() holds at (and `include`), in graph order."""
        targets = self.anchor_targets()
        if targets is None:
            nodes = graph.nodes
        else:
            nodes = sorted(node for target in targets for node in graph.find_nodes(op="call_function", target=target))
        if targets is not None and ANCHOR_OPS_MISSED is not None:
            ANCHOR_OPS_MISSED.extend((self.name, node.target) for node in graph.nodes
                                     if node.target not in targets and include(node) and self.anchor(node))
        return [node for node in nodes if include(node) and self.anchor(node)]

    def variants_of(self, form: Form) -> tuple[Mapping[str, Any], ...]:
        """The examples `form` is traced at: the pass's example, then the form's variants (or
        the pass's)."""
        variants = self.example_variants if form.example_variants is None else tuple(form.example_variants)
        return ({}, *variants)

    def example_value(self, name: str, dtype: torch.dtype, variant: Optional[Mapping[str, Any]] = None) -> Any:
        value = (variant or {}).get(name, self.example[name])
        return value(dtype) if callable(value) else value

    def is_scalar(self, name: str) -> bool:
        return not callable(self.example[name])

    def __repr__(self) -> str:
        return f"FusionPass({self.name!r})"
