"""Tensor parallel end to end (docs/tensor-parallel.md): torchtitan's llama3 and qwen3
parallelized by torchtitan's own parallelize functions, and torch's parallelize_module, fused
by matmul_all_reduce, all_gather_matmul and matmul_reduce_scatter.

Two kinds of tests, as for expert parallel (tests/test_expert_parallel.py):
- graph capture in this process over the fake process group: which sites of torchtitan's
  graphs fuse, per layer, and the near miss of every one that does not, naming the limit;
- numerics on real CPU processes over gloo (tests/gloo_ranks.py): eager against compiled on
  every rank, outputs and the gradients of every parameter.

Tolerance: none. The reference kernels run the same collective over the same gloo group as
the code they replace and multiply the same rows (fp32 accumulation, one rounding, as CPU's
matmul), and a training step's weight gradients read the gathered rows in the model's order:
the fused graph equals the unfused one bit for bit on gloo, every rank, fp32 and bf16. On an
NPU an all-reduce or reduce-scatter may sum in another order (capabilities' verify_ulps).
Only the tensor-parallel passes run in these numerics; the other passes have their own tests.

The default run has one multi-process test (the small MLP's TP inference and SP training step,
2 ranks); NPU_FX_FUSION_MULTIPROCESS=all adds torchtitan's models on 2 and 4 ranks (slow).
"""
from __future__ import annotations

import pytest
import torch

import npu_fx_fusion as nff
from gloo_ranks import run_on_ranks
from helpers import RecordingBackend, fake_world, near_miss_reasons
from tp_modules import TP_PASSES

pytest.importorskip("torchtitan")

AR, AG, RS = "npu.npu_mm_all_reduce_base", "npu.npu_all_gather_base_mm", "npu.npu_mm_reduce_scatter_base"
LAYERS = 2


def _capture(name, sequence_parallel, training, world=2, dtype=torch.bfloat16):
    """torchtitan's `name` (LAYERS layers) on rank 0 of a fake world, compiled with every pass."""
    from npu_fx_fusion.tiny_models import build_torchtitan_tp

    torch._dynamo.reset()
    with fake_world(world):
        tm = build_torchtitan_tp(name, sequence_parallel=sequence_parallel, dtype=dtype, num_layers=LAYERS)
        backend = RecordingBackend(nff.FusionConfig())
        with torch.set_grad_enabled(training):
            out = torch.compile(tm.model.train(training), backend=backend, fullgraph=True)(*tm.example_inputs)
            if training:
                out.float().sum().backward()
    assert backend.report.errors == []
    return backend.report


def _per_graph(report, op):
    return {graph.name: graph.ops_after.get(f"{op}.default", 0) for graph in report.graphs if graph.name != "joint"}


# One process compiles these one after another, training first. Known defect, not ours
# (test_an_upstream_partition_failure_depends_on_what_compiled_before pins it with torch's own
# aot_eager backend): after a TP inference compile and an SP training compile of llama3 in one
# process, qwen3's SP training step reaches the partitioner with a tangent among its forward
# outputs, and torch's partition refuses it ("Node tangents_2 was invalid, but is output").
# Each compile alone, and this order, pass.
TP_CAPTURE = pytest.mark.xdist_group("tp_capture")


def scenario_compile_in_order(steps):
    """(in a fresh process) compile torchtitan's TP models one after another with torch's own
    aot_eager backend, no npu-fx-fusion: the message of what each compile raised, or "ok"."""
    from npu_fx_fusion.tiny_models import build_torchtitan_tp

    outcomes = []
    for name, sequence_parallel, training in steps:
        torch._dynamo.reset()
        try:
            with fake_world(2):
                tm = build_torchtitan_tp(name, sequence_parallel=sequence_parallel, dtype=torch.bfloat16,
                                         num_layers=LAYERS)
                with torch.set_grad_enabled(training):
                    out = torch.compile(tm.model.train(training), backend="aot_eager", fullgraph=True)(
                        *tm.example_inputs)
                    if training:
                        out.float().sum().backward()
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001 (what torch raised is the result)
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.slow
def test_an_upstream_partition_failure_depends_on_what_compiled_before():
    """torch 2.13 + torchtitan 0.3.0, without npu-fx-fusion: qwen3's SP training step compiles
    alone, and fails after llama3's TP inference and SP training compiles in the same process.
    The day this passes through, the training-first order above is no longer needed."""
    from torchair_harness.runner import run_scenario

    steps = [("llama3", False, False), ("llama3", True, True), ("qwen3", True, True)]
    assert run_scenario(scenario_compile_in_order, steps=steps[2:], timeout=900) == ["ok"]
    outcomes = run_scenario(scenario_compile_in_order, steps=steps, timeout=900)
    assert outcomes[:2] == ["ok", "ok"] and "Node tangents_2 was invalid, but is output" in outcomes[2], outcomes


@TP_CAPTURE
@pytest.mark.slow
@pytest.mark.parametrize("name, rowwise_k_fits", [("llama3", False), ("qwen3", True)])
def test_sequence_parallel_training_fuses_forward_and_backward(name, rowwise_k_fits):
    """Forward as in inference. Backward, per layer: the gradients of wo and w2 gathered and
    multiplied (all_gather_matmul); wqkv's input gradient reduce-scattered (matmul_reduce_scatter);
    the FFN input's gradient is the sum of w1's and w3's, which no op takes (a near miss); the
    output projection's input gradient reduce-scattered once."""
    report = _capture(name, True, True)
    forward_rs = LAYERS * (2 if rowwise_k_fits else 1)  # llama3's wo: k = 128, outside
    assert _per_graph(report, AG) == {"forward": 2 * LAYERS + 1, "backward": 2 * LAYERS}
    assert _per_graph(report, RS) == {"forward": forward_rs, "backward": LAYERS + 1}
    misses = near_miss_reasons(report, "matmul_reduce_scatter")
    assert sum(m.startswith("the reduce-scatter reads a sum") for m in misses) == LAYERS


@TP_CAPTURE
@pytest.mark.slow
def test_tensor_parallel_training_keeps_the_all_reduces_naming_why():
    report = _capture("llama3", False, True)
    assert report.fused_ops.get(AR, 0) == 0
    misses = near_miss_reasons(report, "matmul_all_reduce")
    training = [m for m in misses if m.startswith(f"{AR} is documented for inference only")]
    assert len(training) == 2 * LAYERS and len(misses) > len(training)


@TP_CAPTURE
def test_llama3_sequence_parallel_inference_fuses_every_site_within_the_limits():
    """Per layer: the all-gather in front of wqkv and in front of w1/w3, w2's reduce-scatter;
    plus the gather in front of the output projection. wo's reduce-scatter contracts over
    dim / ranks = 128 < 256 (the op's k range), a near miss; so is the embedding's."""
    report = _capture("llama3", True, False)
    assert report.fused_ops[AG] == 2 * LAYERS + 1 and report.fused_ops[RS] == LAYERS
    assert report.fused_ops["npu.npu_add_rms_norm"] == 2 * LAYERS  # the residual adds, as before
    misses = near_miss_reasons(report, "matmul_reduce_scatter")
    assert misses.count(f"k = 128 (the contracted dim, local to the rank) is outside {RS}'s [256, 65535)") == LAYERS
    assert sum(m.startswith("the reduce-scattered tensor is computed by mul") for m in misses) == 1  # the embedding
    assert len(misses) == LAYERS + 1 and near_miss_reasons(report, "all_gather_matmul") == []


@TP_CAPTURE
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_tensor_parallel_inference_fuses_the_rowwise_all_reduces(name):
    """Without SP: wo and w2 all-reduce their partial sums (2 per layer), which fuse; the
    vocabulary-parallel embedding's all-reduce reduces a product, not a matmul."""
    report = _capture(name, False, False)
    assert report.fused_ops[AR] == 2 * LAYERS
    (miss,) = near_miss_reasons(report, "matmul_all_reduce")
    assert miss.startswith("the all-reduced tensor is computed by mul")


# ---- numerics on gloo ranks --------------------------------------------------------------------
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(model, compiled, inputs, training):
    """Eager and compiled outputs (and in training each parameter's gradient, local shard)."""
    results = []
    for module in (model, compiled):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(training):
            out = _local(module(*inputs))
            if training:
                out.float().pow(2).mean().backward()
        # whole gradients: a compiled step may leave a DTensor gradient in another placement than
        # eager (full_tensor: a collective every rank calls in the same order)
        grads = {name: _whole(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads))
    return results


def _differences(results):
    (eager, eager_grads), (fused, fused_grads) = results
    worst = {"output": (eager.double() - fused.double()).abs().max().item()}
    if eager_grads:
        assert eager_grads.keys() == fused_grads.keys()
        worst["gradients"] = max((eager_grads[n].double() - fused_grads[n].double()).abs().max().item()
                                 for n in eager_grads)
    return worst


def worker_small_mlp(rank, world_size):
    """The small MLP of tp_modules: TP inference (matmul_all_reduce) and an SP training step
    (all_gather_matmul and matmul_reduce_scatter, forward and backward), eager vs fused."""
    from tp_modules import feed_forward

    out = {}
    for label, sequence_parallel, training in (("tp-inference", False, False), ("sp-training", True, True)):
        torch._dynamo.reset()
        model = feed_forward(sequence_parallel=sequence_parallel, swiglu=True).train(training)
        generator = torch.Generator().manual_seed(1 + rank)  # each rank its own slice (SP) or batch
        x = torch.randn(2, 16 // (world_size if sequence_parallel else 1), 256, generator=generator).bfloat16()
        backend = RecordingBackend(nff.FusionConfig(enable=TP_PASSES))
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out[label] = {"differences": _differences(_step(model, compiled, (x,), training)),
                      "fused_ops": dict(backend.report.fused_ops), "errors": backend.report.errors}
    return out


@pytest.mark.multiprocess
def test_the_small_mlp_equals_eager_on_two_gloo_ranks():
    for rank, result in enumerate(run_on_ranks(worker_small_mlp, 2)):
        inference, training = result["tp-inference"], result["sp-training"]
        assert inference["errors"] == training["errors"] == [], rank
        assert inference["fused_ops"] == {AR: 1}, rank
        # forward: the gather (read by w1 and w3) and w2's reduce-scatter; backward: w2's
        # gradient gathered, w1's and w3's input gradients each reduce-scattered (two gathers:
        # this plan's PrepareModuleInput gathers once, its backward reduce-scatters the sum)
        assert training["fused_ops"][AG] == 2 and training["fused_ops"][RS] >= 1, rank
        assert inference["differences"] == {"output": 0.0}, rank
        assert training["differences"] == {"output": 0.0, "gradients": 0.0}, rank


def worker_torchtitan(rank, world_size, name, sequence_parallel, dtype):
    """torchtitan's `name` (LAYERS layers): inference and a training step on this rank, compiled
    with the tensor-parallel passes against the same compile without passes (what the fusions
    change) and against eager (what compiling changes too: the NPU dispatch emulation computes
    attention as torch_npu's kernels do, docs/npu-graph.md); the fused ops and near misses."""
    from npu_fx_fusion.tiny_models import build_torchtitan_tp

    out = {}
    for training in (False, True):
        tm = build_torchtitan_tp(name, sequence_parallel=sequence_parallel, dtype=getattr(torch, dtype),
                                 num_layers=LAYERS)
        model = tm.model.train(training)
        compiled = {}
        for label, passes in (("fused", TP_PASSES), ("unfused", set())):
            torch._dynamo.reset()
            backend = RecordingBackend(nff.FusionConfig(enable=passes))
            compiled[label] = (torch.compile(model, backend=backend, fullgraph=True), backend.report)
        fused, report = compiled["fused"]
        results = _step(model, fused, tm.example_inputs, training)
        unfused = _step(model, compiled["unfused"][0], tm.example_inputs, training)
        out["training" if training else "inference"] = {
            "vs_unfused": _differences([results[1], unfused[1]]), "ulps_from_eager": _ulps_at_scale(*results),
            "fused_ops": dict(report.fused_ops), "errors": report.errors,
            "near_misses": [(m.pass_name, m.reason) for m in report.near_misses]}
    return out


def _ulps_at_scale(eager, fused):
    """The largest |fused - eager| of the output and of each gradient, in ulp of that tensor's
    largest eager value."""
    from helpers import ulp

    pairs = [(eager[0], fused[0]), *((eager[1][n], fused[1][n]) for n in eager[1])]
    return max(((f.double() - e.double()).abs().max() / ulp(e.abs().max().reshape(1)).double()).item()
               for e, f in pairs)


# Compiled vs eager, whatever the fusions: the NPU dispatch emulation computes attention as
# torch_npu's kernels do (one rounding after an fp32 softmax) and a matmul's backward as one
# matmul_backward (docs/npu-graph.md), where eager CPU rounds otherwise; the difference travels
# through the layers into the output and every gradient. Measured on 2 ranks, qwen3 TP+SP: in
# ulp at each tensor's scale, bf16 1.25 (inference) and 3.25 (training step), fp32 5 and 18
# (fp32's ulp is 2**16 times finer: the same few roundings count for more of them).
EAGER_ULPS = {"bfloat16": 8, "float32": 64}


def _assert_close_to_eager(outcome, dtype):
    assert outcome["ulps_from_eager"] <= EAGER_ULPS[dtype], (dtype, outcome["ulps_from_eager"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torchtitan_equals_eager_on_gloo_ranks(dtype, name, sequence_parallel, world_size):
    if dtype == "float32" and world_size == 4:
        pytest.skip("fp32 fuses nothing (the ops take fp16 / bf16): its near misses are the 2-rank run's")
    results = run_on_ranks(worker_torchtitan, world_size, name=name, sequence_parallel=sequence_parallel,
                           dtype=dtype, timeout=1800)
    for rank, result in enumerate(results):
        for phase, outcome in result.items():
            assert outcome["errors"] == [], (rank, phase)
            # the fusions change nothing on gloo
            expected = {"output": 0.0} if phase == "inference" else {"output": 0.0, "gradients": 0.0}
            assert outcome["vs_unfused"] == expected, (rank, phase, outcome["vs_unfused"])
            # and the compiled model is the eager one up to the emulated attention's rounding
            _assert_close_to_eager(outcome, dtype)
            if dtype == "float32":
                assert outcome["fused_ops"] == {}, (rank, phase)
                assert any(reason.endswith("does not support float32") for _, reason in outcome["near_misses"])
            elif sequence_parallel:
                assert outcome["fused_ops"][AG] >= 2 * LAYERS + 1, (rank, phase)
            elif phase == "inference":
                assert outcome["fused_ops"] == {AR: 2 * LAYERS}, (rank, phase)
        # every rank fuses the same sites
        assert result["inference"]["fused_ops"] == results[0]["inference"]["fused_ops"]
