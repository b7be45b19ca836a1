"""Backend integration without torchair: emulation, install() chaining, last_report()."""
import pytest
import torch

import npu_fx_fusion as nff
from npu_fx_fusion import backend
from npu_fx_fusion.backend import EmulationBackend, FusionPipeline
from test_add_rms_norm import DecoderLike


def test_without_torchair_the_backend_is_the_emulation():
    assert backend.import_torchair() is None
    assert isinstance(nff.get_npu_backend(), EmulationBackend)
    with pytest.raises(ValueError, match="torchair is not importable"):
        nff.get_npu_backend(compiler_config=object())


class _UserConfig:  # stands in for torchair / npugraph_ex CompilerConfig
    post_grad_custom_pre_pass = None


def _run_installed(pass_fn, module, x):
    # What torchair does with post_grad_custom_pre_pass: call it on each aot graph.
    def compiler(gm, example_inputs):
        pass_fn(gm, example_inputs, None)
        return torch._functorch.aot_autograd.make_boxed_func(gm.forward)

    be = lambda gm, ex: torch._functorch.aot_autograd.aot_module_simplified(  # noqa: E731
        gm, ex, fw_compiler=compiler, keep_inference_input_mutations=True)
    with torch.no_grad():
        return torch.compile(module, backend=be)(x)


def test_install_chains_the_users_pass_and_does_not_stack_twice():
    calls = []
    config = _UserConfig()
    config.post_grad_custom_pre_pass = lambda gm, ex, cfg: calls.append(len(gm.graph.nodes))
    first = nff.install(config)
    second = nff.install(config, nff.FusionConfig(disable={"add_rms_norm"}))
    assert config.post_grad_custom_pre_pass is second and second.chained is first.chained
    module, x = DecoderLike(), torch.randn(2, 5, 64)
    torch.testing.assert_close(_run_installed(config.post_grad_custom_pre_pass, module, x), module(x))
    assert len(calls) == 1  # the user's pass ran once, on the unfused graph
    assert second.report.counts == {**second.report.counts, "rms_norm": 3}
    assert "add_rms_norm" not in second.report.counts


def test_install_into_npugraph_ex_options_dict():
    options = {}
    pipeline = nff.install(options)
    assert options["post_grad_custom_pre_pass"] is pipeline
    with pytest.raises(TypeError, match="CompilerConfig"):
        nff.install(42)


def test_last_report_before_anything(monkeypatch):
    monkeypatch.setattr(backend, "_last_report", None)
    with pytest.raises(RuntimeError, match="no graph has been fused yet"):
        nff.last_report()


def test_training_forward_and_backward_are_both_reported_and_grads_match():
    module, x = DecoderLike(), torch.randn(2, 5, 64, requires_grad=True)
    compiled_module = DecoderLike()
    compiled_module.load_state_dict(module.state_dict())
    be = nff.get_npu_backend()
    x2 = x.detach().clone().requires_grad_()
    torch.compile(compiled_module, backend=be)(x2).sum().backward()
    module(x).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for p, q in zip(compiled_module.parameters(), module.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    report = nff.last_report()
    # Training: the joint forward+backward graph is fused before it is partitioned
    # (docs/training.md), then each half goes through the forward-only pipeline.
    assert [g.name for g in report.graphs] == ["joint", "forward", "backward"]
    # all 3 norms fused there, with their backward; npu_add_rms_norm has no backward, so
    # the residual adds are folded in the forward graph, after partitioning
    assert [(r.pass_name, len(r.sites)) for r in report.graphs[0].passes if r.sites] == [("rms_norm", 3)]
    assert [(r.pass_name, len(r.sites)) for r in report.graphs[1].passes if r.sites] == [("add_rms_norm", 2)]
    assert report.fused_ops == {"npu.npu_rms_norm": 3, "npu.npu_rms_norm_backward": 3, "npu.npu_add_rms_norm": 2}
    assert report.counts["rms_norm"] == 3 and report.counts["add_rms_norm"] == 2
    assert report.errors == []
