"""accept.py: where a multi-output match is replaced.

The structural patterns take sizes as wildcards, so two outputs of a form that differ only in
sizes look alike there, and torch's matcher binds each later output to the first candidate
that fits: possibly a node an earlier output took. The exact match (the form retraced at the
site's sizes) is the one checked, and the one replaced; two outputs bound to one node are
refused. (Found on DeepSeek-V4's compressed attention in training: the gradients of kv and of
the compressed kv are two slices of one cat gradient, tests/test_sparse_mla.py.)
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion import capabilities
from npu_fx_fusion.accept import apply_pass
from npu_fx_fusion.canonical import canonicalize
from npu_fx_fusion.capabilities import FLOAT_DTYPES, OpCapability
from npu_fx_fusion.matching import Form, FusionPass

_LIB = torch.library.Library("nff_test_accept", "DEF")  # kept: the op lives as long as the module
_LIB.define("neg_halves(Tensor z) -> (Tensor, Tensor)")


def _neg_halves(z):
    half = z.shape[-1] // 2
    return -z[..., :half], -z[..., half:]


_LIB.impl("neg_halves", _neg_halves, "CompositeExplicitAutograd")
torch.library.register_fake("nff_test_accept::neg_halves", _neg_halves, lib=_LIB)
_CAPABILITY = OpCapability(op="nff_test_accept.neg_halves", dtypes=FLOAT_DTYPES, min_rank=1, max_rank=8,
                           backward=None, ge_converter=True)


def negated_halves(z):
    half = z.shape[-1] // 2
    return -z[..., :half], -z[..., half:]


def negated_twice(z):
    return -z, -z


def _fused(z):
    return torch.ops.nff_test_accept.neg_halves(z)


def _pass(search):
    # traced at width 8 (halves 0:4, 4:8): at another width the halves' bounds are other sizes
    return FusionPass(name="test", fused_op=_CAPABILITY.op, forms=[Form(search, _fused, dtypes=(torch.float32,))],
                      example={"z": lambda dtype: torch.empty(3, 8, dtype=dtype)}, check=lambda site: None,
                      anchor=lambda node: node.target is torch.ops.aten.neg.default, explain=lambda node: None)


def _graph(fn, *shape):
    """fn's graph, canonicalised as the pipeline does before the passes (dims, slice bounds)."""
    gm = make_fx(fn, tracing_mode="fake")(torch.empty(*shape))
    canonicalize(gm.graph)
    gm.recompile()
    return gm


def _ops(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_outputs_alike_but_for_sizes_are_replaced_where_the_exact_match_binds_them(monkeypatch):
    monkeypatch.setitem(capabilities.CAPABILITIES, _CAPABILITY.op, _CAPABILITY)
    gm = _graph(negated_halves, 3, 10)  # halves 0:5 and 5:10
    result = apply_pass(_pass(negated_halves), gm)
    assert len(result.sites) == 1
    # both halves come from the fused op: none of the model's negations is left (the structural
    # match had bound the second half to the first half's neg, which stayed in the graph)
    assert "aten.neg.default" not in _ops(gm)
    z = torch.randn(3, 10)
    for got, want in zip(gm(z), negated_halves(z)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_two_outputs_bound_to_one_node_are_refused(monkeypatch):
    monkeypatch.setitem(capabilities.CAPABILITIES, _CAPABILITY.op, _CAPABILITY)

    def negated_once(z):  # the graph computes -z once and returns it twice
        y = -z
        return y, y

    gm = _graph(negated_once, 3, 8)
    result = apply_pass(_pass(negated_twice), gm)
    assert result.sites == []
    assert _ops(gm) == ["aten.neg.default"]
    (miss,) = result.near_misses
    assert "two outputs of negated_twice bind the one node" in miss.reason, miss.reason


_LIB.define("div_pair(Tensor a, Tensor b, Tensor s) -> (Tensor, Tensor)")


def _div_pair(a, b, s):
    return a / s, b / s


_LIB.impl("div_pair", _div_pair, "CompositeExplicitAutograd")
torch.library.register_fake("nff_test_accept::div_pair", _div_pair, lib=_LIB)
_PAIR_CAPABILITY = OpCapability(op="nff_test_accept.div_pair", dtypes=FLOAT_DTYPES, min_rank=1, max_rank=8,
                                backward=None, ge_converter=True)


def divided_pair(a, b, s):
    return a / s, b / s


def test_a_later_output_is_not_bound_to_the_node_an_earlier_one_took(monkeypatch):
    # rope_qk's two npu_rotary_mul calls on one cos / sin, as the rope pass leaves them: the
    # divisor's first user is the latest division, where the match starts, so the second
    # output's search (the divisor's users, in order) meets that same node first. It must
    # go on to the other division. (Found as a rope_qk that fused in one model and not
    # after another had compiled in the same process: tests/test_cli.py.)
    monkeypatch.setitem(capabilities.CAPABILITIES, _PAIR_CAPABILITY.op, _PAIR_CAPABILITY)
    fusion_pass = FusionPass(name="test", fused_op=_PAIR_CAPABILITY.op,
                             forms=[Form(divided_pair, torch.ops.nff_test_accept.div_pair, dtypes=(torch.float32,))],
                             example={name: (lambda dtype: torch.empty(3, 8, dtype=dtype)) for name in "abs"},
                             check=lambda site: None, anchor=lambda node: False, explain=lambda node: None)
    for _ in range(2):  # the second run starts from the exact match the first remembered
        graph = make_fx(divided_pair, tracing_mode="fake")(torch.empty(3, 8), torch.empty(3, 8), torch.empty(3, 8))
        first, second = (n for n in graph.graph.nodes if n.target is torch.ops.aten.div.Tensor)
        second.append(first)  # graph order: second, first; the divisor's users: first, second
        graph.recompile()
        result = apply_pass(fusion_pass, graph)
        assert len(result.sites) == 1 and result.near_misses == [], result.near_misses
        assert _ops(graph).count("nff_test_accept.div_pair.default") == 1 and "aten.div.Tensor" not in _ops(graph)
        a, b, s = torch.randn(3, 8), torch.randn(3, 8), torch.rand(3, 8) + 1
        for got, want in zip(graph(a, b, s), divided_pair(a, b, s)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_kept_call_of_an_op_called_a_different_number_of_times_gets_the_line_it_aligns_with():
    # moe_dispatch keeps the clamped SwiGLU's mul, one of the two muls of the block it replaces
    # (the other weighs the expert outputs, which finalize_routing does): the alignment of the
    # two call sequences pairs it with the model's act(gate) * up, not with the weighing
    from npu_fx_fusion.insertion import _aligned_calls

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")

    def calls(*targets):
        return [graph.call_function(target, (x,)) for target in targets]

    erased = calls(aten.mm.default, aten.clamp.default, aten.silu.default, aten.mul.Tensor, aten.mm.default,
                   aten.mul.Tensor, aten.sum.dim_IntList)
    added = calls(aten.mm.default, aten.clamp.default, aten.silu.default, aten.mul.Tensor, aten.mm.default)
    pairs = _aligned_calls(added, erased)
    assert [(added.index(new), erased.index(old)) for new, old in pairs] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]


# ---- canonical: implicit upcasts ---------------------------------------------------------
def _upcast_graph(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    before = gm(*inputs)
    changed = canonicalize(gm.graph)
    gm.recompile()
    return gm, changed, before, gm(*inputs)


def _mul_operands(gm):
    (mul,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    return [str(a.target) if isinstance(a, torch.fx.Node) and a.op == "call_function" else a.name for a in mul.args]


def test_an_operand_the_multiply_upcasts_reads_the_graphs_own_cast_of_it():
    def norm_like(x, v):  # CpmAntLayerNorm: x bf16 times an fp32 normaliser, x also cast explicitly
        return x.to(torch.float32).pow(2).sum(), x * v

    x, v = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)
    gm, changed, before, after = _upcast_graph(norm_like, x, v)
    assert changed == 1
    assert _mul_operands(gm) == ["aten._to_copy.default", "v_1"]
    for got, want in zip(after, before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_backward_op_does_not_read_a_forward_cast():
    # in a joint graph the forward's fp32 cast would be saved for the backward in place of
    # the bf16 operand: twice its memory
    def norm_like(x, v):
        return x.to(torch.float32).pow(2).sum(), x * v

    x, v = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8)
    gm = make_fx(norm_like, tracing_mode="fake")(x, v)
    (mul,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    mul.meta["autograd_backward"] = True
    assert canonicalize(gm.graph) == 0
    assert _mul_operands(gm) == ["x_1", "v_1"]


@pytest.mark.parametrize("case", ["result_not_wider", "no_cast_in_the_graph", "cast_after_the_op"])
def test_an_operand_stays_where_no_earlier_cast_has_its_promoted_value(case):
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    if case == "result_not_wider":  # a 0-dim fp32 operand does not promote: the result is bf16
        def fn(x, v):
            return x.to(torch.float32).sum(), x * v
        v = torch.tensor(3.0)
    elif case == "no_cast_in_the_graph":  # no cast is added
        def fn(x, v):
            return x * v
        v = torch.randn(4, 8)
    else:
        def fn(x, v):
            return x * v, x.to(torch.float32).sum()
        v = torch.randn(4, 8)
    gm, changed, before, after = _upcast_graph(fn, x, v)
    assert changed == 0
    assert _mul_operands(gm) == ["x_1", "v_1"]


# ---- canonical: a symbolic number as a .Scalar operand -----------------------------------
def test_a_division_by_a_symbolic_size_is_spelled_as_by_a_number():
    # the mean's backward divides by its count: div.Scalar(g, s1) under dynamic shapes,
    # div.Tensor(g, 64) in a static trace (canonical's add.Scalar -> add.Tensor rule)
    aten = torch.ops.aten

    def mean_backward_like(g, x):
        return aten.div.Scalar(g, x.shape[-1]), aten.div.Tensor(g, x)  # the second: two tensors

    gm = make_fx(mean_backward_like, tracing_mode="symbolic")(torch.randn(3, 8), torch.randn(3, 8))
    assert canonicalize(gm.graph) >= 1
    gm.recompile()
    divisions = [n for n in gm.graph.nodes if n.target in (aten.div.Scalar, aten.div.Tensor)]
    assert [n.target for n in divisions] == [aten.div.Tensor, aten.div.Tensor]
    assert isinstance(divisions[0].args[1], torch.fx.Node)  # still the size the graph reads
    for shape in ((3, 8), (2, 5)):
        g, x = torch.randn(*shape), torch.randn(*shape) + 3
        for got, want in zip(gm(g, x), mean_backward_like(g, x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_pattern_is_tried_only_in_a_graph_holding_every_call_it_always_contains():
    from torch._inductor import pattern_matcher as pm

    from npu_fx_fusion.spellings import AnyOf, may_occur, ops_present

    aten = torch.ops.aten
    x, w = pm.KeywordArg("x"), pm.KeywordArg("w")
    relu_then_mm = pm.CallFunction(aten.mm.default, pm.CallFunction(aten.relu.default, x), w)
    either_then_mm = pm.CallFunction(aten.mm.default, AnyOf([pm.CallFunction(aten.relu.default, x),
                                                             pm.CallFunction(aten.sigmoid.default, x)]), w)
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    relu_graph = make_fx(lambda a, b: torch.mm(a.relu(), b))(a, b).graph
    sigmoid_graph = make_fx(lambda a, b: torch.mm(a.sigmoid(), b))(a, b).graph
    assert may_occur(relu_then_mm, ops_present(relu_graph.nodes))
    assert not may_occur(relu_then_mm, ops_present(sigmoid_graph.nodes))  # no relu: it cannot match
    # an AnyOf's alternatives are not each required: the mm is
    assert may_occur(either_then_mm, ops_present(sigmoid_graph.nodes))
    assert not may_occur(either_then_mm, ops_present(make_fx(lambda a: a.relu())(a).graph.nodes))


def test_a_pattern_sharing_its_sub_patterns_is_read_once_per_node():
    # a joint pattern reads one forward value from many backward nodes: read as a tree, this
    # chain of 60 adds each reading the previous one twice would have 2**60 paths
    from torch._inductor import pattern_matcher as pm

    from npu_fx_fusion.spellings import may_occur

    aten = torch.ops.aten
    value = pm.KeywordArg("x")
    for _ in range(60):
        value = pm.CallFunction(aten.add.Tensor, value, value)
    chain = pm.CallFunction(aten.relu.default, value)
    assert may_occur(chain, {("call_function", aten.add.Tensor), ("call_function", aten.relu.default)})
    assert not may_occur(chain, {("call_function", aten.add.Tensor)})
