"""Shared test helpers: compile through the emulation backend, compare within ulps."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Optional

import torch

import npu_fx_fusion as nff
from npu_fx_fusion.backend import EmulationBackend


def compile_and_run(module, *inputs, config=None, grad=False, dynamic=None):
    """(fused output, eager output, report) of `module` on `inputs` (dynamic: torch.compile's)."""
    backend = EmulationBackend(config or nff.FusionConfig())
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)
    with torch.set_grad_enabled(grad):
        expected = module(*inputs)
        actual = compiled(*inputs)
    return actual, expected, backend.report


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at |t| (the size of one unit in the last place)."""
    a = t.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs()
    allowed = ulps * ulp(expected).double()
    worst = (diff - allowed).max().item()
    assert worst <= 0, f"differs by more than {ulps} ulp: max excess {worst:.3g}, max diff {diff.max().item():.3g}"


def near_miss_reasons(report, pass_name):
    return [m.reason for m in report.near_misses if m.pass_name == pass_name]


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, ulps: float,
                          precision: Optional[torch.dtype] = None) -> None:
    """|actual - expected| within `ulps` ulp of the largest |expected|.

    For outputs computed through several layers: rounding differences of a few ulp at a
    fused op travel through the following matmuls as absolute errors on the scale of the
    activations, not relative to each element. precision: the dtype whose ulp counts, when
    a tensor is computed from values of a coarser one (an fp32 gradient of bf16 rows).
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.abs().max()
    allowed = ulps * ulp(scale.reshape(1).to(precision or scale.dtype)).double().item()
    diff = (actual.double() - expected.double()).abs().max().item()
    assert diff <= allowed, f"max diff {diff:.3g} exceeds {ulps} ulp at scale {scale.item():.3g} ({allowed:.3g})"


class ScaleShiftFusion:
    """A test-only fusion: `x * 2 + 1` becomes the op `<namespace>::scale_shift(x)`.

    The op's kernel computes `x * 2 + shift`: shift 1 is a correct fusion, any other a
    deliberately wrong one. `capability` is its table entry, to be installed by the test
    (monkeypatch.setitem(capabilities.CAPABILITIES, fusion.capability.op, fusion.capability)).
    """

    def __init__(self, namespace: str, *, shift: float = 1.0, ge_converter: bool = True):
        from npu_fx_fusion.capabilities import FLOAT_DTYPES, OpCapability

        self._lib = torch.library.Library(namespace, "DEF")  # kept: the op lives as long as it
        self._lib.define("scale_shift(Tensor x) -> Tensor")
        self._lib.impl("scale_shift", lambda x: x * 2 + shift, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::scale_shift", lambda x: torch.empty_like(x), lib=self._lib)
        self.capability = OpCapability(op=f"{namespace}.scale_shift", dtypes=FLOAT_DTYPES, min_rank=0,
                                       max_rank=8, backward=None, ge_converter=ge_converter)
        op = getattr(torch.ops, namespace).scale_shift

        def fused(x):  # a plain function: the matcher traces replacements by their signature
            return op(x)

        self.fused = fused

    @staticmethod
    def search(x):
        return x * 2 + 1

    @staticmethod
    def exact(x):  # a replacement computing exactly what the search does
        return x * 2 + 1

    def fusion_pass(self, replace=None):
        from npu_fx_fusion.matching import Form, FusionPass

        return FusionPass(name="test", fused_op=self.capability.op,
                          forms=[Form(self.search, replace or self.fused, dtypes=(torch.float32,))],
                          example={"x": lambda dtype: torch.empty(4, dtype=dtype)},
                          check=lambda site: None,
                          anchor=lambda node: node.target is torch.ops.aten.mul.Tensor,
                          explain=lambda node: None)

    @classmethod
    def graph(cls, *shape: int) -> torch.fx.GraphModule:
        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(cls.search, tracing_mode="fake")(torch.randn(*shape))


def torchtitan_moe(num_experts=8, dim=64, top_k=3, **router):
    """torchtitan's own MoE layer (router, local token dispatcher, grouped experts), tiny.

    From its DeepSeek-V3 debugmodel flavor, without the shared expert; `router` overrides
    TokenChoiceTopKRouter.Config fields (score_func, num_expert_groups, route_norm, ...).
    The expert bias (load balancing) is random, as a trained one is not zero.
    """
    import dataclasses

    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    cfg = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard").layers[1].moe
    routed = cfg.routed_experts
    cfg = dataclasses.replace(
        cfg, num_experts=num_experts, shared_experts=None,
        routed_experts=dataclasses.replace(
            routed,
            inner_experts=dataclasses.replace(routed.inner_experts, num_experts=num_experts, dim=dim,
                                              hidden_dim=dim),
            token_dispatcher=dataclasses.replace(routed.token_dispatcher, num_experts=num_experts, top_k=top_k)),
        router=dataclasses.replace(cfg.router, num_experts=num_experts, top_k=top_k,
                                   gate=dataclasses.replace(cfg.router.gate, in_features=dim,
                                                            out_features=num_experts),
                                   **router))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        moe = cfg.build()
        moe.init_states(buffer_device=torch.device("cpu"))
        moe.expert_bias_E.normal_(std=0.05)
    return moe.eval()


# torchtitan's DeepSeek-V3 router settings (sigmoid, node-limited groups, route_norm, scale)
TORCHTITAN_DEEPSEEK_ROUTER = dict(score_func="sigmoid", num_expert_groups=4, num_limited_groups=2,
                                  route_norm=True, route_scale=2.5)


class RecordingBackend(EmulationBackend):
    """EmulationBackend that keeps the graphs it compiled, by phase."""

    def __init__(self, config=None):
        super().__init__(config)
        self.graphs = {}

    def _compile(self, phase, gm, example_inputs):
        compiled = super()._compile(phase, gm, example_inputs)
        self.graphs[phase] = gm
        return compiled


class GuardRecordingBackend(EmulationBackend):
    """EmulationBackend that records the guards on symbolic sizes the fusion pipeline adds
    to the compile's shape environment (`added_guards`, sympy expressions). A check that
    compares a SymInt, or a fused op's int attribute that takes one, adds a guard: the
    graph then recompiles for the sizes it rejects."""

    def __init__(self, config=None):
        super().__init__(config)
        self.added_guards = []

    def _compile(self, phase, gm, example_inputs):
        env = getattr(torch._guards.detect_fake_mode(example_inputs), "shape_env", None)
        before = len(env.guards) if env is not None else 0
        compiled = super()._compile(phase, gm, example_inputs)
        if env is not None:
            self.added_guards += [g.expr for g in env.guards[before:]]
        return compiled


# ---- graph capture over the fake process group (tests/test_expert_parallel.py, the tensor-parallel tests)
class GraphCaptured(Exception):
    """Raised instead of running a captured graph: fake collectives return no data."""


class CaptureBackend(RecordingBackend):
    """The emulation backend's aot_autograd and fusion pipeline, without the NPU dispatch (the
    CPU spelling, unless `decompositions` gives torchair's); the fused graph is kept, never run.
    `decompositions`: torchair's table, to see its spelling of the collectives."""

    def __init__(self, config=None, decompositions=None):
        super().__init__(config)
        self.decompositions = decompositions or {}

    def __call__(self, gm, example_inputs):
        import functools

        from torch._functorch.aot_autograd import aot_module_simplified

        return aot_module_simplified(gm, example_inputs, decompositions=self.decompositions,
                                     fw_compiler=functools.partial(self._compile, "forward"),
                                     bw_compiler=functools.partial(self._compile, "backward"),
                                     inference_compiler=functools.partial(self._compile, "inference"),
                                     partition_fn=self._partition,  # the joint passes, in training
                                     keep_inference_input_mutations=True)

    def _compile(self, phase, gm, example_inputs):
        from torch._functorch.aot_autograd import make_boxed_func

        self.pipeline(gm, example_inputs, phase)
        self.graphs[phase] = gm

        def never_run(*args):
            raise GraphCaptured(phase)

        return make_boxed_func(never_run)


@contextlib.contextmanager
def fake_world(world_size):
    """torch.distributed over the fake backend in this process (rank 0 of world_size): the
    collectives are recorded, their data is meaningless. torchtitan's process-wide SPMD backend
    (its builders in tiny_models set it) restored after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    try:
        from torchtitan.distributed import utils as torchtitan_utils
    except ImportError:
        torchtitan_utils = None
    spmd_backend = torchtitan_utils.get_spmd_backend() if torchtitan_utils else None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if torchtitan_utils:
            torchtitan_utils.set_spmd_backend(spmd_backend)


def is_size_limit(guard) -> bool:
    """A guard bounding one size by a constant (`s0 < 1000`: a kernel's limit), not one that
    pins a size (`Eq(2*s0*s1, 64)`) or relates two (`s1 > s0`)."""
    import sympy

    return isinstance(guard, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan,
                              sympy.GreaterThan)) and len(guard.free_symbols) == 1


# npu ops torch_npu's own dispatch puts into an NPU graph (npu_dispatch.py): SDPA's
# FlashAttention and softmax's casts, there before any pass runs
DISPATCH_OPS = ("npu_fusion_attention_v3", "npu_fusion_attention_grad_v3", "npu_fusion_attention",
                "npu_fusion_attention_grad")


def npu_ops(gm) -> dict:
    """{"npu_rms_norm": n, ...} of the npu ops a graph calls (not torch_npu's casts, nor the
    FlashAttention its SDPA kernel calls in an NPU graph: DISPATCH_OPS)."""
    counts = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("npu."):
            name = str(node.target).split(".")[1]
            if not name.startswith("_npu_dtype_cast") and name not in DISPATCH_OPS:
                counts[name] = counts.get(name, 0) + 1
    return counts


class KeepFloat64(torch.overrides.TorchFunctionMode):
    """While active, a model run in float64 stays float64 through its own fp32 casts: `.float()`,
    `.to(torch.float32)` and `dtype=torch.float32` keep float64. transformers' DeepSeek-V4 casts its
    mHC, router and compressor math to fp32 explicitly, so a `.double()` copy alone is no float64
    reference (its hyper-connection outputs differed from a float64 computation by 1e-7 relative)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.float and tensor is not None and tensor.dtype == torch.float64:
            return tensor
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func is torch.Tensor.to and tensor is not None and tensor.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def errors_at_scale(actual: torch.Tensor, exact: torch.Tensor, precision: torch.dtype = torch.float32) -> float:
    """max |actual - exact| in ulps of `precision` at the largest |exact| (exact: a float64 reference)."""
    unit = ulp(exact.abs().max().reshape(1).to(precision)).double().item()
    return (actual.double() - exact.double()).abs().max().item() / unit if unit > 0 else 0.0


class RoutedExpertsLoop(torch.nn.Module):
    """litgpt's LLaMAMoE shape: a loop over experts, each taking the tokens routed to it with
    torch.where(mask) (a data-dependent size in a loop, so dynamo runs the whole forward in
    eager: the report's dynamo_gaps name it)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        probs, chosen = self.gate(x).softmax(-1).topk(2)
        y = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == index)
            y[tokens] += probs[tokens, slot, None] * expert(x[tokens])
        return y


# ---- torchtitan-npu's own models: built in a process of their own ----------------------------
def torchtitan_npu():
    """npu_fx_fusion.tiny_third_party, which builds torchtitan-npu's models; skips the test where
    the wheel is not unpacked (bash scripts/test.sh sets it up)."""
    import pytest
    from npu_fx_fusion import tiny_third_party

    if not os.path.isdir(os.path.join(tiny_third_party.torchtitan_npu_dir(), "torchtitan_npu")):
        pytest.skip("torchtitan-npu is not unpacked (bash scripts/test.sh sets it up)")
    return tiny_third_party


def in_subprocess(module: str, call: str) -> None:
    """Run `call` (a function of the test module `module`, as code) in a process of its own:
    torchtitan-npu needs torchtitan 0.2.2, which must not stay imported in the test session
    (tiny_third_party refuses a process holding another torchtitan; test_third_party_models
    measures it the same way)."""
    torchtitan_npu()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import sys; sys.path.insert(0, 'tests'); import torch, {module} as t; t.{call}"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
