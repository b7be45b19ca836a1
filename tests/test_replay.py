"""replay.MatchShape: an exact match found again at a repeated site without torch's matcher.

The shape of a site is only a shortcut to the match torch's matcher makes there: a model
fuses the same with it as without it (every site, every op, the same graph), it finds the
repeated sites of a model, and it finds nothing where a site differs from the recorded one,
which the matcher then handles as before.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch._inductor import pattern_matcher as pm

import npu_fx_fusion as nff
from helpers import RecordingBackend, compile_and_run, npu_ops
from npu_fx_fusion import replay
from npu_fx_fusion.tiny_models import build_hf


def _counting_finds(monkeypatch) -> list:
    """Each MatchShape.find's result from now on (None or a match), in order."""
    found: list = []
    original = replay.MatchShape.find

    def find(self, node):
        result = original(self, node)
        found.append(result)
        return result

    monkeypatch.setattr(replay.MatchShape, "find", find)
    return found


def _step(train: bool, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    tiny = build_hf("llama", num_layers=3)
    model = tiny.model.train() if train else tiny.model.eval()
    with torch.set_grad_enabled(train):
        out = torch.compile(model, backend=backend)(*tiny.example_inputs)
        if train:
            out.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()] if train else []
    return out.detach(), grads


def _graph_ops(gm: torch.fx.GraphModule) -> list:
    return [(n.op, str(n.target)) for n in gm.graph.nodes]


def _fused(train: bool):
    backend = RecordingBackend()
    out, grads = _step(train, backend)
    sites = [(s.pass_name, s.form, str(s.location)) for s in backend.report.sites]
    return out, grads, sites, {name: _graph_ops(gm) for name, gm in backend.graphs.items()}


def test_a_model_fuses_the_same_with_shapes_as_without(monkeypatch):
    for train in (False, True):
        found = _counting_finds(monkeypatch)
        out, grads, sites, graphs = _fused(train)
        assert sum(match is not None for match in found) >= 4, "the repeated layers' sites are found by shape"
        monkeypatch.setattr(replay.MatchShape, "find", lambda self, node: None)
        out_plain, grads_plain, sites_plain, graphs_plain = _fused(train)
        monkeypatch.undo()
        assert sites == sites_plain and len(sites) >= 6
        assert graphs == graphs_plain  # op for op, in the same order
        torch.testing.assert_close(out, out_plain, rtol=0, atol=0)
        for grad, grad_plain in zip(grads, grads_plain):
            torch.testing.assert_close(grad, grad_plain, rtol=0, atol=0)


class TwoNorms(nn.Module):
    """Two LlamaRMSNorms in a row, with eps given per norm."""

    def __init__(self, eps_first: float, eps_second: float, dim: int = 32):
        super().__init__()
        self.eps = (eps_first, eps_second)
        self.weights = nn.ParameterList([nn.Parameter(torch.rand(dim) + 0.5) for _ in self.eps])

    def forward(self, x):
        for weight, eps in zip(self.weights, self.eps):
            h = x.float()
            x = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return x


def _eps_of_fused_norms(module, x):
    backend = RecordingBackend(nff.FusionConfig(enable={"rms_norm"}))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, backend=backend)(x), module(x))
    (gm,) = backend.graphs.values()
    assert npu_ops(gm) == {"npu_rms_norm": 2}
    return [n.args[2] if len(n.args) > 2 else n.kwargs.get("epsilon") for n in gm.graph.nodes
            if n.op == "call_function" and "npu_rms_norm" in str(n.target)]


def test_a_site_with_another_literal_is_left_to_the_matcher(monkeypatch):
    x = torch.randn(2, 4, 32)
    found = _counting_finds(monkeypatch)
    # the second norm (matched first: the matcher walks backwards) is recorded; the first
    # one's shape has another eps where the recorded one has its own: not found by shape,
    # matched and fused with its own eps
    assert sorted(_eps_of_fused_norms(TwoNorms(2.0**-10, 2.0**-17), x)) == [2.0**-17, 2.0**-10]
    assert found and all(match is None for match in found)
    found.clear()
    assert _eps_of_fused_norms(TwoNorms(2.0**-12, 2.0**-12), x) == [2.0**-12, 2.0**-12]
    assert any(match is not None for match in found)


def _chain_graph(extra_user: bool) -> torch.fx.Graph:
    """Two copies of relu(x * 2) + 1; in the second, relu's value also feeds the output."""
    graph = torch.fx.Graph()
    aten = torch.ops.aten
    outputs = []
    for copy in range(2):
        x = graph.placeholder(f"x{copy}")
        mul = graph.call_function(aten.mul.Tensor, (x, 2))
        relu = graph.call_function(aten.relu.default, (mul,))
        outputs.append(graph.call_function(aten.add.Tensor, (relu, 1)))
        if extra_user and copy == 1:
            outputs.append(relu)
    graph.output(tuple(outputs))
    return graph


def _pattern():
    aten = torch.ops.aten
    return pm.CallFunction(aten.add.Tensor, pm.CallFunction(aten.relu.default, pm.CallFunction(
        aten.mul.Tensor, pm.KeywordArg("x"), 2)), 1)


def test_a_shape_is_found_where_the_matcher_matches_and_not_past_an_extra_user():
    for extra_user in (False, True):
        graph = _chain_graph(extra_user)
        first, second = graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
        recorded = _pattern().match(first)
        assert pm.is_match(recorded)
        shape = replay.MatchShape.of(recorded)
        again = shape.find(second)
        by_matcher = _pattern().match(second)
        if extra_user:
            # the matcher refuses it too (relu has one user in the pattern); a shape never
            # finds what the matcher would not
            assert again is None and not pm.is_match(by_matcher)
        else:
            assert pm.is_match(by_matcher)
            assert again.kwargs == by_matcher.kwargs and set(again.nodes) == set(by_matcher.nodes)
            assert again.output_nodes() == by_matcher.output_nodes() == [second]
        assert shape.find(first).nodes == recorded.nodes  # (and where it was recorded)
