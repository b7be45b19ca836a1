"""Masks and scalars computed from symbolic sizes only (symbolic_values.py, nodes.py).

Under dynamic shapes a mask built from aranges is another tensor at every size: it is
proven right-down causal (or empty) for every size the shape environment allows, or not
proven. Each proof here is also checked against the mask evaluated at concrete sizes, so
a proof that claims too much fails. `min(k, S)` is k over the sizes S >= k: a guard keeps
the graph there.
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from npu_fx_fusion.constants import causal_mask, sparse_mode_of
from npu_fx_fusion.nodes import constant_on_a_size_range


def _offset(q, k):
    return k.shape[-2] - q.shape[-2]


def _rows_cols(q, k):
    return torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]


def right_down(q, k):
    i, j = _rows_cols(q, k)
    return j <= i + _offset(q, k)


def top_left(q, k):
    i, j = _rows_cols(q, k)
    return j <= i


def one_off(q, k):
    i, j = _rows_cols(q, k)
    return j < i + _offset(q, k)


def sliding_window(q, k):
    i, j = _rows_cols(q, k)
    return (j <= i + _offset(q, k)) & (j > i + _offset(q, k) - 4)


def all_visible(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)


def tril_of_ones(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(_offset(q, k))


def batched_causal(q, k):  # (B, 1, S, T), as transformers expands it
    return right_down(q, k)[None, None].expand(q.shape[0], 1, q.shape[-2], k.shape[-2])


def padding_from_input(q, k):
    return (q[..., :1] > 0).expand(*q.shape[:-1], k.shape[-2])


def triu_of_minus_inf(q, k):  # additive: 0 visible, -inf hidden
    return torch.triu(torch.full((q.shape[-2], k.shape[-2]), float("-inf")), 1 + _offset(q, k))


def log_of_tril(q, k):
    return torch.log(torch.tril(torch.ones(q.shape[-2], k.shape[-2]), _offset(q, k)))


def triu_two_above(q, k):
    return torch.triu(torch.full((q.shape[-2], k.shape[-2]), float("-inf")), 2 + _offset(q, k))


MASKS = [right_down, top_left, one_off, sliding_window, all_visible, tril_of_ones, batched_causal]
ADDITIVE = [triu_of_minus_inf, log_of_tril, triu_two_above]
# (queries, keys) traced: equal sizes share one symbol (duck sizing), 3 and 7 are two
SIZES = [(5, 5), (3, 7)]


def _proof(fn, queries, keys, visible_when="true"):
    q, k = torch.randn(2, queries, 4), torch.randn(2, keys, 4)
    gm = make_fx(fn, tracing_mode="symbolic")(q, k)
    (output,) = gm.graph.find_nodes(op="output")
    return sparse_mode_of(output.args[0], visible_when)


def _concrete_mode(fn, queries, keys, visible_when):
    """The mode the mask has at every concrete size (None where sizes disagree)."""
    modes = set()
    for extra in range(0, 9):  # the proof covers every size: check a range of them
        s, t = (2 + extra, 2 + extra) if queries == keys else (2 + extra, 2 + extra + (keys - queries))
        value = fn(torch.randn(2, s, 4), torch.randn(2, t, 4))
        visible = value if visible_when == "true" else value == 0
        visible = torch.broadcast_to(visible, (*visible.shape[:-2], s, t))
        modes.add(0 if bool(visible.all()) else 3 if bool((visible == causal_mask(s, t)).all()) else None)
    return modes.pop() if len(modes) == 1 else None


@pytest.mark.parametrize("queries, keys", SIZES)
@pytest.mark.parametrize("fn, visible_when", [(f, "true") for f in MASKS] + [(f, "zero") for f in ADDITIVE],
                         ids=[f.__name__ for f in MASKS + ADDITIVE])
def test_a_mask_from_sizes_is_proven_only_what_it_is_at_every_size(fn, visible_when, queries, keys):
    mode, why = _proof(fn, queries, keys, visible_when)
    expected = _concrete_mode(fn, queries, keys, visible_when)
    assert mode == expected, why
    if mode is not None:
        assert "proven for every size" in why


@pytest.mark.parametrize("fn, expected", [(right_down, 3), (top_left, None), (one_off, None), (sliding_window, None),
                                          (all_visible, 0), (log_of_tril, 3), (triu_two_above, None)])
def test_the_proof_decides_the_forms_models_write(fn, expected):
    # (the concrete check above could agree with a proof that decides nothing: pin the modes)
    mode, why = _proof(fn, 3, 7, "zero" if fn in ADDITIVE else "true")
    assert mode == expected, why
    if expected is None:
        assert "neither right-down causal nor empty for every size" in why


def test_a_mask_read_from_an_input_is_not_proven():
    mode, why = _proof(padding_from_input, 3, 7)
    assert mode is None and "computed from graph inputs" in why


def _min_of_size(k, seq):
    captured = {}

    def fn(x):
        captured["k"] = torch.sym_min(k, x.shape[-1])  # (dynamo turns min() into this)
        return x.topk(captured["k"]).values

    make_fx(fn, tracing_mode="symbolic")(torch.randn(2, seq))
    return captured["k"]


def test_min_of_a_constant_and_a_size_is_the_constant_behind_a_guard():
    value = _min_of_size(8, 12)
    assert isinstance(value, torch.SymInt)
    constant, guard = constant_on_a_size_range(value)
    assert constant == 8
    env = value.node.shape_env
    before = len(env.guards)
    assert guard()
    (added,) = [g.expr for g in env.guards[before:]]
    assert 8 in added.atoms() and len(added.free_symbols) == 1  # S >= 8: a range, not one size


def _size_expression(fn, seq):
    captured = {}

    def traced(x):
        captured["value"] = fn(x.shape[-1])
        return x * 2

    make_fx(traced, tracing_mode="symbolic")(torch.randn(2, seq))
    return captured["value"]


@pytest.mark.parametrize("fn, seq", [
    (lambda s: torch.sym_min(8, s), 5),  # min is S at this size: guarding would pin nothing useful
    (lambda s: 2 * s, 6),  # a size, not a constant over a range
    (lambda s: torch.sym_min(s, 8) + s, 12),
    (lambda s: 8, 12),  # a plain int (no symbol)
], ids=["min-below-k", "product", "min-plus-size", "int"])
def test_anything_else_is_not_a_constant_over_a_range(fn, seq):
    assert constant_on_a_size_range(_size_expression(fn, seq)) is None
