"""axis_algebra's layout helpers, checked against autograd."""
import pytest
import torch

from npu_fx_fusion.axis_algebra import Atom, rearrange, rearrange_gradient


def _layouts():
    b, s, n, d = Atom(2), Atom(3), Atom(4), Atom(5)
    sizes = {b: 2, s: 3, n: 4, d: 5}
    return [
        # a permutation, with groups merged in the target (tokens flattened)
        ((b, s, n, d), ((b, s), (d,), (n,)), sizes),
        # a broadcast: t has no (s) atom, the target does
        ((b, n), ((b,), (s,), (n,)), sizes),
        # one atom broadcast over two
        ((d,), ((b,), (s,), (d,)), sizes),
    ]


@pytest.mark.parametrize("source, target, sizes", _layouts())
def test_rearrange_gradient_is_the_adjoint_of_rearrange(source, target, sizes):
    dims = tuple((a,) for a in source)
    t = torch.randn([sizes[a] for a in source], dtype=torch.float64, requires_grad=True)
    out = rearrange(t, dims, target, sizes)
    g = torch.randn(out.shape, dtype=torch.float64)
    (expected,) = torch.autograd.grad((out * g).sum(), t)
    torch.testing.assert_close(rearrange_gradient(g, dims, target, sizes), expected)
