"""Symbolic sizes in the exact match (accept._exact_match): proven equal, never assumed.

Under torch.compile(dynamic=True) a site's sizes are SymInts. The exact retrace of a form
takes each symbolic size of its arguments as an input, and each size the trace computes
(`sym_size` of an intermediate, `s0 * s1`) as one more: the graph may compute the same
value another way (transformers' `arange(perm.size(0))` is `2 * s1 * s0` of dynamo's
SymInt inputs). Whatever the graph has in such a place must be proven equal to the form's
size by the shape environment, else the site is a near miss. These tests use a test-only
pass whose form multiplies by a size, on graphs traced with symbolic shapes (make_fx),
so that the graph's value in that place can be the right size, an equal one spelled
otherwise, or another size of the same tensor.
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion.accept import apply_pass
from npu_fx_fusion.canonical import canonicalize
from npu_fx_fusion.matching import Form, FusionPass, is_call, known_equal, uneven_halves

aten = torch.ops.aten


def _pass(search, example=(3, 5)):
    """A pass replacing `search(x)` by `-search(-x)`, the same values (negation is exact):
    its mul then reads no input, and is no candidate (anchor: a mul of the graph's input)."""

    def negated_twice(x):
        return -search(-x)

    negated_twice.__name__ = f"{search.__name__}_negated_twice"
    return FusionPass(name="test", fused_op="aten.mul", forms=[Form(search, negated_twice, dtypes=(torch.float32,))],
                      example={"x": lambda dtype: torch.empty(*example, dtype=dtype)}, check=lambda site: None,
                      anchor=lambda node: is_call(node, aten.mul.Tensor) and node.args[0].op == "placeholder",
                      explain=lambda node: None)


def times_last_size(x):
    return x * x.shape[-1]


def times_element_count(x):
    return x * (x.shape[0] * x.shape[1])


def _symbolic_graph(fn):
    # (4, 6): two sizes that differ, so the shape environment gives them two symbols
    return make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 6))


@pytest.mark.parametrize("search, graph_fn", [
    (times_last_size, lambda x: x * x.shape[-1]),
    (times_element_count, lambda x: x * (x.shape[0] * x.shape[1])),
    # the same value computed in another order: proven equal (s1*s0 == s0*s1)
    (times_element_count, lambda x: x * (x.shape[1] * x.shape[0])),
], ids=["the-size", "a-product-of-sizes", "the-product-in-another-order"])
def test_a_size_the_shape_environment_proves_equal_matches(search, graph_fn):
    gm = _symbolic_graph(graph_fn)
    result = apply_pass(_pass(search), gm)
    assert len(result.sites) == 1 and result.near_misses == []


@pytest.mark.parametrize("search, graph_fn, wanted", [
    # the other dim of the same tensor in the same place: s0 where the form has s1
    (times_last_size, lambda x: x * x.shape[0], "s"),
    # a sum where the form multiplies
    (times_element_count, lambda x: x * (x.shape[0] + x.shape[1]), "+"),
], ids=["another-size", "another-expression"])
def test_a_size_not_proven_equal_is_a_near_miss(search, graph_fn, wanted):
    gm = _symbolic_graph(graph_fn)
    before = gm.code
    result = apply_pass(_pass(search), gm)
    assert result.sites == [] and gm.code == before
    (miss,) = result.near_misses
    assert "has its structure, but differs in sizes" in miss.reason and "stands where the form has the size" in miss.reason
    assert wanted in miss.reason


def test_two_independent_symbolic_sizes_are_both_inputs_of_the_retrace():
    """Batch and sequence dynamic together: neither size is provably different from the
    other, and both are taken as inputs (torch's register_replacement keeps a second one
    only if it is provably different, and the retrace then reads it as sym_size of the
    argument, which the graph's own SymInt does not match)."""
    def flattened(x):
        return x.reshape(x.shape[0] * x.shape[1], -1) * 2

    gm = make_fx(flattened, tracing_mode="symbolic")(torch.randn(4, 6, 8))
    result = apply_pass(_pass(flattened, example=(2, 3, 5)), gm)
    assert len(result.sites) == 1


# ---- a size read of an intermediate (canonical.size_reads_from_inputs) ---------------------
def rotate_every_two(x):
    # dynamo (and make_fx) size the flatten after the stack from a slice's symbolic size:
    # `sym_size(x[..., 1::2], -1) * 2`, a read of an intermediate of the rotation
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _size_reads(gm):
    return [n for n in gm.graph.nodes if n.target is aten.sym_size.int]


def test_a_size_read_of_an_intermediate_reads_the_inputs_instead():
    gm = make_fx(rotate_every_two, tracing_mode="symbolic")(torch.randn(4, 6))
    assert any(read.args[0].op != "placeholder" for read in _size_reads(gm))
    assert canonicalize(gm.graph) >= 1
    gm.recompile()
    gm.graph.lint()
    assert all(read.args[0].op == "placeholder" for read in _size_reads(gm))
    for shape in ((4, 6), (3, 10)):  # the one symbolic graph, at its own and another size
        x = torch.randn(*shape)
        torch.testing.assert_close(gm(x), rotate_every_two(x), rtol=0, atol=0)


def test_a_data_dependent_size_read_stays_a_read():
    # the rows nonzero finds are no input's size (an unbacked symbol): nothing else has them
    def scaled_by_count(x):
        found = x.nonzero()
        return found * found.shape[0]

    gm = make_fx(scaled_by_count, tracing_mode="symbolic")(torch.randn(4, 6))
    assert canonicalize(gm.graph) == 0
    (read,) = _size_reads(gm)
    assert read.args[0].target is aten.nonzero.default


def _rotation_pass():
    """A test pass replacing rotate_every_two(x) by -rotate_every_two(-x), the same values."""
    def negated_twice(x):
        return -rotate_every_two(-x)

    return FusionPass(name="test", fused_op="aten.neg", forms=[Form(rotate_every_two, negated_twice,
                                                                    dtypes=(torch.float32,))],
                      example={"x": lambda dtype: torch.empty(3, 8, dtype=dtype)}, check=lambda site: None,
                      # the model's stack (its slices read the input), not the replacement's
                      anchor=lambda node: (is_call(node, aten.stack.default)
                                           and node.args[0][1].args[0].op == "placeholder"),
                      explain=lambda node: None)


def test_a_region_whose_intermediate_size_was_read_fuses_into_a_valid_graph():
    # the read of the slice's size used to count as a use outside the region: the site was
    # refused ("is also used by sym_size"), and replacing it would have erased what the read reads
    gm = make_fx(rotate_every_two, tracing_mode="symbolic")(torch.randn(4, 6))
    canonicalize(gm.graph)
    result = apply_pass(_rotation_pass(), gm)
    assert len(result.sites) == 1 and result.near_misses == []
    gm.graph.lint()  # (no node reads an erased one)
    gm.recompile()
    for shape in ((4, 6), (3, 10)):
        x = torch.randn(*shape)
        torch.testing.assert_close(gm(x), rotate_every_two(x), rtol=0, atol=0)


# ---- nodes.known_equal: (s + 1) // 2 is s // 2 where the graph knows s is even -------------
def _symbolic_width(check_even):
    """A symbolic size s of a traced graph, and its shape environment; `check_even`: the traced
    code checks s is even (torch._check: a guard the graph has)."""
    def fn(x):
        if check_even:
            torch._check(x.shape[-1] % 2 == 0)
        return x * 2

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(3, 8))
    size = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[-1]
    return size, size.node.shape_env


@pytest.mark.parametrize("check_even", [True, False], ids=["proven-even", "maybe-odd"])
def test_a_chunks_split_point_is_the_half_only_where_the_size_is_proven_even(check_even):
    size, env = _symbolic_width(check_even)
    guards = len(env.guards)
    # x.chunk(2) splits at (s + 1) // 2; the shape environment alone does not reduce it
    assert known_equal((size + 1) // 2, size // 2) is check_even
    assert known_equal(size - (size + 1) // 2, size // 2) is check_even
    assert not known_equal((size + 1) // 2, size // 2 + 1)  # never a wrong equality
    assert not known_equal(size // 2, size // 4)
    assert known_equal(size // 2, size // 2) and known_equal(2 * (size // 2), 2 * (size // 2))
    assert len(env.guards) == guards  # proofs only: no guard added


def test_uneven_halves_names_the_split_point_that_is_not_the_half():
    def halves(x, split_at):
        return x[..., :split_at(x.shape[-1])], x[..., split_at(x.shape[-1]):]

    for split_at, uneven in ((lambda d: d // 2, False), (lambda d: (d + 1) // 2, True), (lambda d: 4, True)):
        gm = make_fx(lambda x: halves(x, split_at), tracing_mode="symbolic")(torch.randn(3, 8))
        canonicalize(gm.graph)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        found = uneven_halves(list(gm.graph.nodes), x)
        assert (found is not None) is uneven, found
