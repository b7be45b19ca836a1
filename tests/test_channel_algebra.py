"""channel_algebra: a region's value as polynomials over its trailing dims, whatever its spelling.

Each evaluation is checked against the region itself: the polynomials, evaluated at random
inputs, must give what running the region gives. The index ops run on element ids through
torch's own kernels, so any spelling of one indexing gives one map.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion.channel_algebra import (Complex, NotEvaluable, Poly, channel_gather, evaluate_around,
                                           modelled)


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _output(gm):
    (out,) = gm.graph.find_nodes(op="output")
    value = out.args[0]
    return value[0] if isinstance(value, (list, tuple)) else value


def _evaluate_poly(poly, value, inputs):
    """A polynomial at concrete inputs: {placeholder name: tensor}, each factor read at
    leading position 0 (the leaves here have none, or broadcast ones of size 1)."""
    total = 0.0
    for mono, coef in poly.items():
        term = coef
        for fid in mono:
            factor = value.factor(fid)
            leaf = inputs[factor.leaf.name]
            block = leaf.reshape(-1, math.prod(leaf.shape[leaf.dim() - factor.tracked:]))[0]
            element = block[factor.index]
            term = term * (element.real if factor.part == 0 and element.is_complex() else
                           element.imag if factor.part else element)
        total = total + term
    return total


def _check_against_the_region(fn, args, names):
    gm = _graph(fn, *args)
    out = _output(gm)
    evaluated = evaluate_around(out)
    value = evaluated.values[out]
    # every leaf is a placeholder here: the polynomials must give what the code gives
    inputs = dict(zip(names, args))
    expected = fn(*args).reshape(-1, math.prod(value.tracked_shape))[0]
    got = torch.stack([torch.as_tensor(_evaluate_poly(p, value, inputs), dtype=torch.float64)
                       for p in value.channels])
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-5)
    return value


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), -1)


SPELLINGS = {
    "slices": lambda x, c, s: x * c + rotate_half(x) * s,
    "chunk": lambda x, c, s: x * c + torch.cat((-x.chunk(2, -1)[1], x.chunk(2, -1)[0]), -1) * s,
    "unbind of (2, D/2)": lambda x, c, s: x * c + torch.cat(
        (-x.unflatten(-1, (2, -1)).unbind(-2)[1], x.unflatten(-1, (2, -1)).unbind(-2)[0]), -1) * s,
    "roll and sign": lambda x, c, s: x * c + torch.roll(x, x.shape[-1] // 2, -1) * torch.cat(
        (-s[..., :s.shape[-1] // 2], s[..., s.shape[-1] // 2:]), -1),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_spellings_of_one_rotation_evaluate_to_one_map(spelling):
    x, c, s = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    value = _check_against_the_region(SPELLINGS[spelling], (x, c, s), ("x_1", "c_1", "s_1"))
    reference = _check_against_the_region(SPELLINGS["slices"], (x, c, s), ("x_1", "c_1", "s_1"))

    def by_names(v, poly):
        return {tuple(sorted((v.factor(f).leaf.name, v.factor(f).index) for f in mono)): coef
                for mono, coef in poly.items()}

    assert [by_names(value, p) for p in value.channels] == [by_names(reference, p) for p in reference.channels]


def test_pairs_from_a_reshape_and_a_stack():
    # torchtune: the pair dim is split off the head dim, then stacked and flattened back
    def tt(x, cache):
        xs = x.reshape(*x.shape[:-1], -1, 2)
        out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                           xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
        return out.flatten(-2)

    value = _check_against_the_region(tt, (torch.randn(1, 8), torch.randn(1, 4, 2)), ("x_1", "cache_1"))
    assert value.tracked_shape == (8,)


def test_complex_multiplication():
    def cplx(x, freqs):
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs).flatten(-2)

    freqs = torch.polar(torch.ones(1, 4), torch.randn(1, 4))
    _check_against_the_region(cplx, (torch.randn(1, 8), freqs), ("x_1", "freqs_1"))


def test_an_op_on_leading_dims_ends_the_region():
    # a transpose of heads and sequence is no channel op: the region starts after it
    def fn(q, cos, sin):
        q = q.transpose(1, 2)
        return q * cos + rotate_half(q) * sin

    gm = _graph(fn, torch.randn(2, 5, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8))
    evaluated = evaluate_around(_output(gm))
    assert [leaf.name for leaf in evaluated.region.leaves] == ["cos_1", "sin_1", "transpose"]


def test_a_product_of_products_takes_the_inner_product_as_a_leaf():
    # degree 3 is not modelled: (x * c) * rotate_half(x) is read as a product of two values,
    # x * c taken as it is (nGPT's scaled q, then its rotation)
    gm = _graph(lambda x, c: x * c * rotate_half(x), torch.randn(1, 8), torch.randn(1, 8))
    evaluated = evaluate_around(_output(gm))
    inner = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert inner in evaluated.region.leaves
    assert all(len(mono) == 2 for poly in evaluated.values[_output(gm)].channels for mono in poly)


def test_a_symbolic_trailing_dim_is_not_tracked():
    gm = make_fx(lambda x: rotate_half(x) * 2.0, tracing_mode="symbolic")(torch.randn(3, 8))
    with pytest.raises(NotEvaluable, match="symbolic size"):
        evaluate_around(_output(gm))


def test_a_vector_viewed_with_leading_ones_needs_no_leading_dim_tracked():
    # nGPT scales q by a (D,) vector viewed as (1, 1, D) (here added, a product being taken whole
    # as a leaf): its block holds the whole view, and the ones broadcast as absent dims do, so q
    # keeps tracking its head dim alone (its batch and sequence are symbolic under dynamic shapes,
    # and could not be tracked)
    def fn(x, w, c, s):
        y = w.view(1, 1, 8) + x
        return y * c + rotate_half(y) * s

    args = (torch.randn(2, 5, 8), torch.randn(8), torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    gm = _graph(fn, *args)
    evaluated = evaluate_around(_output(gm))
    assert evaluated.tracked[_node(gm, "x_1")] == 1, evaluated.tracked
    _check_against_the_region(fn, args, ("x_1", "w_1", "c_1", "s_1"))


def test_a_size_one_dim_behind_an_untracked_one_keeps_its_place():
    # a table (1, S, D) unsqueezed to (1, S, 1, D) against x (B, S, H, D): its 1 stands for the
    # heads, so x tracks (H, D) and the table's (1, S) line up with x's (B, S), not (S, H)
    def fn(x, c, s):
        return x * c.unsqueeze(2) + rotate_half(x) * s.unsqueeze(2)

    args = (torch.randn(2, 5, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    gm = _graph(fn, *args)
    evaluated = evaluate_around(_output(gm))
    assert evaluated.tracked[_node(gm, "x_1")] == 2, evaluated.tracked
    assert evaluated.leading_dims(_node(gm, "c_1")) == 2


def test_division_by_a_tensor_is_not_modelled():
    gm = _graph(lambda x, y: rotate_half(x) / y, torch.randn(1, 8), torch.randn(1, 8))
    div = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.div.Tensor)
    assert not modelled(div)


def test_polynomials_cancel_exactly():
    gm = _graph(lambda x, c: x * c - c * x + rotate_half(x), torch.randn(1, 4), torch.randn(1, 4))
    value = evaluate_around(_output(gm)).values[_output(gm)]
    assert all(len(p) == 1 and list(p.values()) in ([1.0], [-1.0]) for p in value.channels)


def test_complex_elements_keep_their_parts():
    a, b = Poly({(0,): 1.0}), Poly({(1,): 1.0})
    assert Complex(a, b) == Complex(Poly({(0,): 1.0}), Poly({(1,): 1.0}))


# ---- gathering channels with views -----------------------------------------------------------
def _index(t, sources, signs):
    return torch.stack([sign * t[(..., *src)] for src, sign in zip(sources, signs)], -1)


GATHERS = {
    "identity": (lambda d: [(j,) for j in range(d)], lambda d: (d,), lambda d: [1.0] * d),
    "repeat each": (lambda d: [(j // 2, 0) for j in range(d)], lambda d: (d // 2, 2), lambda d: [1.0] * d),
    "tile": (lambda d: [(j % (d // 2),) for j in range(d)], lambda d: (d // 2,), lambda d: [1.0] * d),
    "halves negated": (lambda d: [(j % (d // 2), 1) for j in range(d)], lambda d: (d // 2, 2),
                       lambda d: [-1.0] * (d // 2) + [1.0] * (d // 2)),
    "de-interleave": (lambda d: [((j % (d // 2)) * 2 + j // (d // 2),) for j in range(d)], lambda d: (d,),
                      lambda d: [1.0] * d),
    "offset block": (lambda d: [(j + 2,) for j in range(d)], lambda d: (d + 4,), lambda d: [1.0] * d),
    # a rotation's table over rows that merge 2 batches and 3 positions: read alike for each
    # batch (four digits: batch, position, half, channel)
    "rows repeat": (lambda d: [(s, j % (d // 2)) for b in range(2) for s in range(3) for j in range(d)],
                    lambda d: (3, d // 2), lambda d: [1.0] * (6 * d)),
    "rows repeat, halves negated": (lambda d: [(s, j % (d // 2)) for b in range(2) for s in range(3) for j in range(d)],
                                    lambda d: (3, d // 2), lambda d: ([-1.0] * (d // 2) + [1.0] * (d // 2)) * 6),
}


@pytest.mark.parametrize("d", [4, 8, 16])
@pytest.mark.parametrize("case", list(GATHERS))
def test_channel_gather_reads_what_indexing_reads(case, d):
    sources_of, shape_of, signs_of = GATHERS[case]
    sources, shape, signs = sources_of(d), shape_of(d), signs_of(d)
    gather = channel_gather(sources, shape, signs)
    assert gather is not None
    t = torch.randn(3, *shape)
    assert torch.equal(gather(t), _index(t, sources, signs))
    assert gather.identity == (case == "identity")


def test_channel_gather_refuses_what_no_view_reads():
    assert channel_gather([(3,), (1,), (2,), (0,)], (4,)) is None  # a shuffle
    assert channel_gather([(0,), (1,)], (2,), [1.0, 2.0]) is None  # not a sign


def test_every_small_gather_it_accepts_is_right():
    # exhaustive over index lists of 4 channels into 4 sources: whatever it accepts, reads right
    t = torch.randn(2, 4)
    accepted = 0
    for sources in itertools.product(range(4), repeat=4):
        gather = channel_gather([(s,) for s in sources], (4,))
        if gather is not None:
            accepted += 1
            assert torch.equal(gather(t), t[..., list(sources)]), sources
    assert accepted >= 10


# ---- evaluate_slice: running a few of the graph's nodes on concrete values -------------------
def _group_mask(scores, idx):
    mask = scores.new_ones(scores.shape, dtype=torch.bool).scatter_(1, idx, False)
    return mask.unsqueeze(-1).expand(-1, -1, 4).reshape(scores.shape[0], -1)


def test_evaluate_slice_runs_the_nodes_between_its_inputs_and_outputs():
    from npu_fx_fusion.channel_algebra import evaluate_slice, real_tensors

    gm = _graph(_group_mask, torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int64))
    idx_node = list(gm.graph.find_nodes(op="placeholder"))[1]
    with real_tensors():
        idx = torch.tensor([[0, 2], [1, 3], [3, 0]])
        (mask,) = evaluate_slice([_output(gm)], {idx_node: idx})
        # the scores are read for their shape only (new_ones): a zero stand-in serves
        assert torch.equal(mask, _group_mask(torch.randn(3, 4), idx))


def test_evaluate_slice_refuses_to_read_a_value_it_was_not_given():
    from npu_fx_fusion.channel_algebra import evaluate_slice, real_tensors

    gm = _graph(lambda s, i: s.gather(1, i), torch.randn(3, 4), torch.zeros(3, 2, dtype=torch.int64))
    idx_node = list(gm.graph.find_nodes(op="placeholder"))[1]
    with real_tensors(), pytest.raises(NotEvaluable, match="reads the values of"):
        evaluate_slice([_output(gm)], {idx_node: torch.zeros(3, 2, dtype=torch.int64)})


def test_a_gather_negates_runs_of_channels_not_each_channel():
    """A table read with its first half negated (code that bakes rotate_half's sign into sin):
    one negation of the half, not one per channel (64 of them on a 64-wide head once)."""
    gather = channel_gather([(i,) for i in range(64)], (64,), [-1.0] * 32 + [1.0] * 32)
    table = torch.randn(3, 64)
    assert torch.equal(gather(table), torch.cat([-table[:, :32], table[:, 32:]], -1))
    traced = make_fx(gather)(table)
    assert sum(n.target is torch.ops.aten.neg.default for n in traced.graph.nodes) == 1
