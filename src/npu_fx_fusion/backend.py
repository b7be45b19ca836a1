"""How the pipeline gets into a compile: torchair, npugraph_ex, or CPU emulation.

torchair calls `post_grad_custom_pre_pass(gm, example_inputs, config)` on every graph it
compiles (forward, backward, inference, joint), after aot_autograd and before its own
pattern pass and lowering (shared/reference/torchair.md, 1.3 and 2.1). FusionPipeline is
that callable. Without torchair, EmulationBackend reproduces the part of torchair's
pipeline the passes depend on: aot_autograd with torchair's (empty, on one device)
decomposition set and the same compiler arguments, the pipeline, then eager execution
of the rewritten graph.

Training graphs are also fused earlier, as one joint forward+backward graph before it is
partitioned (docs/training.md): TorchairTrainingBackend hooks that into torchair,
EmulationBackend's partition_fn into its own aot_autograd call.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .config import FusionConfig, check_environment
from .graph_breaks import lifted, residual_outputs, watching
from .lifted_floats import specialize_module_floats
from .report import FusionReport, GraphReport, dynamo_counts

if TYPE_CHECKING:
    from .pipeline import FusedJoint

log = logging.getLogger("npu_fx_fusion")

_last_report: Optional[FusionReport] = None


def last_report() -> FusionReport:
    """The report of the backend (or fuse() call) that processed a graph most recently.

    It accumulates every graph that backend compiled: graph breaks, forward and backward
    (the backward graph is compiled lazily, at the first .backward()).
    """
    if _last_report is None:
        raise RuntimeError("no graph has been fused yet: compile and run a model with "
                           "get_npu_backend(), or call fuse()")
    return _last_report


def _set_last_report(report: FusionReport) -> None:
    global _last_report
    _last_report = report


class FusionPipeline:
    """The callable installed as torchair's / npugraph_ex's post_grad_custom_pre_pass.

    It runs the user's own pre-pass first when there was one (so their rewrites see the
    graph they expect), then ours, and records every graph in `self.report`.
    """

    def __init__(self, fusion_config: Optional[FusionConfig] = None,
                 chained: Optional[Callable] = None):
        self.fusion_config = fusion_config or FusionConfig()
        self.chained = chained
        self.report = FusionReport()
        self.report.dynamo_counts_before = dynamo_counts()
        self._graph_ids = itertools.count()
        # what merge_projections did to the dynamo graph, for the report of the next graph
        # aot_autograd makes of it
        self._pending: list = []

    def before_autograd(self, gm: torch.fx.GraphModule, example_inputs: Any, floats: dict[str, float]) -> None:
        """What the dynamo graph needs before aot_autograd traces it: the module floats
        specialised (lifted_floats; `floats`: those specialised so far) and, where the graph
        will be differentiated, spelled as the joint forms are traced (canonical.autograd_spellings)."""
        specialize_module_floats(gm, example_inputs, floats)
        if torch.is_grad_enabled():
            from .canonical import autograd_spellings

            autograd_spellings(gm)

    def merge_projections(self, gm: torch.fx.GraphModule, example_inputs: Any) -> tuple[list, Callable]:
        """Merge the linears of a dynamo graph that share an input (merged_projections.py),
        before aot_autograd traces it; returns the example inputs to trace it with and what
        wraps the compiled callable (the per-call check of the merged parameters)."""
        from .merged_projections import PASS_NAME, merge_projections

        unchanged = (list(example_inputs), lambda compiled: compiled)
        if not self.fusion_config.transform_enabled(PASS_NAME):
            return unchanged

        try:
            merged = merge_projections(gm, example_inputs, verify=self.fusion_config.verify)
        except Exception as exc:  # noqa: BLE001 - reported, or re-raised with strict
            if self.fusion_config.strict:
                raise
            from .pipeline import _one_line
            from .report import PassResult

            log.warning("merged_projections failed: %s", _one_line(exc))
            self._pending.append(PassResult(PASS_NAME, error=_one_line(exc)))
            return unchanged
        if merged.result.sites or merged.result.near_misses:
            self._pending.append(merged.result)
        return merged.trace_inputs(example_inputs), merged.wrap

    def _take_pending(self) -> list:
        pending, self._pending = self._pending, []
        return pending

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any = None, config: Any = None) -> None:
        if self.chained is not None:
            self.chained(gm, example_inputs, config)
        # Imported here: the pipeline pulls in torch._inductor's pattern matcher, seconds of
        # import time that `import npu_fx_fusion` should not cost.
        from .pipeline import run_passes

        name = _graph_kind(config) or f"graph{next(self._graph_ids)}"
        mode = self.fusion_config.mode or _torchair_mode(config)
        _set_last_report(self.report)
        run_passes(gm, self.fusion_config, self.report, graph_name=name, mode=mode,
                   earlier_results=self._take_pending())

    def run_joint(self, gm: torch.fx.GraphModule, config: Any = None) -> "FusedJoint":
        """The joint-graph passes on a training graph, before it is partitioned
        (pipeline.run_joint_passes); `config`: the torchair config, for its mode. Partition
        it with the FusedJoint returned, which reverts a fused graph that does not split."""
        from .pipeline import run_joint_passes

        _set_last_report(self.report)
        return run_joint_passes(gm, self.fusion_config, self.report, graph_name="joint",
                                mode=self.fusion_config.mode or _torchair_mode(config),
                                earlier_results=self._take_pending())


def _graph_kind(config: Any) -> Optional[str]:
    # torchair names the phase in its observer, which the pass cannot see; the emulation
    # backend passes the phase name as `config`.
    return config if isinstance(config, str) else None


def _torchair_mode(config: Any) -> Optional[str]:
    """The mode of the torchair / npugraph_ex CompilerConfig a pass is called with.

    torchair.CompilerConfig.mode is an OptionValue ("max-autotune" / "reduce-overhead");
    npugraph_ex's config reports "npugraph_ex".
    """
    from .capabilities import MODES

    mode = getattr(config, "mode", None)
    mode = getattr(mode, "value", mode)
    return mode if mode in MODES else None


def install(compiler_config: Any, fusion_config: Optional[FusionConfig] = None) -> FusionPipeline:
    """Install the fusion pipeline as `post_grad_custom_pre_pass` of a compiler config.

    compiler_config: a torchair.CompilerConfig, an npugraph_ex.CompilerConfig, or the
    `options` dict of `torch.compile(..., backend="npugraph_ex", options=...)`. A pass the
    user had set keeps running, before ours. Installing again replaces the fusion config
    rather than chaining a second pipeline. Returns the installed FusionPipeline, whose
    `report` collects what it did.

    A config alone only reaches the graphs after partitioning: training graphs get their
    forward-and-backward fusion from get_npu_backend() (docs/training.md).
    """
    check_environment()
    if fusion_config is not None and not isinstance(fusion_config, FusionConfig):
        raise TypeError(f"fusion_config must be a FusionConfig, got {type(fusion_config).__name__}")
    _check_compiler_mode(compiler_config, fusion_config)
    if isinstance(compiler_config, dict):
        existing = compiler_config.get("post_grad_custom_pre_pass")
    elif hasattr(compiler_config, "post_grad_custom_pre_pass"):
        existing = compiler_config.post_grad_custom_pre_pass
    else:
        raise TypeError(
            "install() needs a torchair.CompilerConfig, an npugraph_ex.CompilerConfig or an "
            f"options dict; got {type(compiler_config).__name__}")
    existing = getattr(existing, "value", existing)  # torchair wraps options in *Value objects
    if isinstance(existing, FusionPipeline):
        pipeline = FusionPipeline(fusion_config, chained=existing.chained)
    else:
        pipeline = FusionPipeline(fusion_config, chained=existing)
    if isinstance(compiler_config, dict):
        compiler_config["post_grad_custom_pre_pass"] = pipeline
    else:
        compiler_config.post_grad_custom_pre_pass = pipeline
    return pipeline


def _check_compiler_mode(compiler_config: Any, fusion_config: Optional[FusionConfig]) -> None:
    """ValueError for a torchair / npugraph_ex config whose mode npu-fx-fusion does not
    know (its passes would not know what that mode can lower), or one that contradicts
    FusionConfig.mode (the graph is lowered in the config's mode, whatever ours says)."""
    from .capabilities import MODES

    mode = compiler_config.get("mode") if isinstance(compiler_config, dict) else getattr(compiler_config, "mode", None)
    mode = getattr(mode, "value", mode)  # torchair.CompilerConfig.mode is an OptionValue
    if mode is None:
        return
    if mode not in MODES:
        raise ValueError(f"the compiler config's mode {mode!r} is not one npu-fx-fusion knows; "
                         f"known: {', '.join(MODES)}")
    wanted = fusion_config.mode if fusion_config is not None else None
    if wanted is not None and wanted != mode:
        raise ValueError(f"FusionConfig(mode={wanted!r}) but the compiler config lowers in {mode!r}: "
                         f"leave FusionConfig.mode None to follow the compiler config")


def import_torchair():
    """torchair, or None. On an Ascend install it is importable once torch_npu is loaded."""
    try:
        import torchair  # noqa: F401

        return torchair
    except ImportError:
        pass
    try:
        import torch_npu  # noqa: F401
        import torchair  # noqa: F811

        return torchair
    except Exception:  # torch_npu absent, or present without CANN
        return None


class EmulationBackend:
    """A torch.compile backend that runs torchair's pipeline shape on CPU, without torchair.

    dynamo graph -> aot_autograd (torchair's decompositions: none that apply on one device;
    inference input mutations kept, as torchair does) -> the fusion pipeline on each of
    the forward/backward/inference graphs -> eager execution of the fused graph.

    By default (FusionConfig.npu_dispatch) the graph is the one an NPU compile holds: the
    dynamo graph gets transformers' NPU branch and aot_autograd traces with torch_npu's and
    torchair's dispatch overrides emulated for the config's SoC (npu_dispatch.py). The
    emulation is registered for the trace only: suspended while the passes run, and gone
    when the compile returns, so eager code never sees it. Ops of an NPU graph that CPU has
    no kernel for are retargeted for execution only (npu_dispatch.lower_for_cpu), after the
    passes and the dumps.
    """

    def __init__(self, fusion_config: Optional[FusionConfig] = None):
        from .npu_dispatch import graph_source

        self.pipeline = FusionPipeline(fusion_config)
        self.pipeline.report.graph_source = graph_source(self.pipeline.fusion_config)
        self._floats: dict[str, float] = {}  # lifted_floats: module floats specialised so far
        self._joint: list[GraphReport] = []  # the joint graph's report, until its forward is compiled

    @property
    def report(self) -> FusionReport:
        return self.pipeline.report

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any):
        from torch._functorch.aot_autograd import aot_module_simplified

        from . import npu_dispatch

        config = self.pipeline.fusion_config
        if config.enabled_passes():
            self.pipeline.before_autograd(gm, example_inputs, self._floats)
        example_inputs, checked = self.pipeline.merge_projections(gm, example_inputs)
        trace_scope = contextlib.ExitStack()
        if config.npu_dispatch:
            from .npu_dtensor import sharding_rules

            npu_dispatch.apply_transformers_npu_branches(gm)
            trace_scope.enter_context(npu_dispatch.emulated(config.soc))
            trace_scope.enter_context(sharding_rules())  # a tensor-parallel model's DTensors reach torch_npu's ops
        residuals, lifted_inputs = residual_outputs(gm), lifted(gm)
        first = len(self.report.graphs)
        with trace_scope:
            compiled = aot_module_simplified(
                gm,
                example_inputs,
                fw_compiler=functools.partial(self._compile, "forward"),
                bw_compiler=functools.partial(self._compile, "backward"),
                inference_compiler=functools.partial(self._compile, "inference"),
                # aot_autograd calls partition_fn for training graphs only
                partition_fn=self._partition,
                decompositions={},
                keep_inference_input_mutations=True,
            )
        return checked(watching(compiled, residuals, self.report.graphs[first:], lifted_inputs))

    def _partition(self, joint_gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        """Fuse the joint graph, then split it as torchair does (default_partition: its
        partitioner, not min-cut, so emulation saves the same tensors for backward)."""
        from torch._functorch.partitioners import default_partition

        from .npu_dispatch import suspended

        with suspended():  # the passes trace their patterns both ways themselves
            fused = self.pipeline.run_joint(joint_gm)
            self._joint = [fused.graph_report]  # its sites run whenever its forward runs
            return fused.partition(default_partition, joint_inputs, **kwargs)

    def _compile(self, phase: str, gm: torch.fx.GraphModule, example_inputs: Any):
        from torch._functorch.aot_autograd import make_boxed_func

        from .npu_dispatch import lower_for_cpu, suspended

        graphs = self.report.graphs
        first = len(graphs)
        with suspended():
            self.pipeline(gm, example_inputs, phase)
        lower_for_cpu(gm)
        counted = graphs[first:]
        if phase == "forward":
            counted, self._joint = self._joint + counted, []
        return make_boxed_func(counting_runs(gm.forward, counted))


def counting_runs(compiled: Callable, graphs: Sequence[GraphReport]) -> Callable:
    """`compiled`, adding each of its calls to the runs of `graphs` (GraphReport.runs): what
    the report needs to count a compiled graph dynamo reuses once per use."""
    if not graphs:
        return compiled
    for graph in graphs:
        graph.runs = 0

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        for graph in graphs:
            graph.runs += 1
        return compiled(*args, **kwargs)

    return run


def get_npu_backend(compiler_config: Any = None, fusion_config: Optional[FusionConfig] = None):
    """A torch.compile backend: torchair's with the fusion pipeline installed, or emulation.

    With torchair importable: `torchair.get_npu_backend(compiler_config=cfg)` where cfg is
    `compiler_config` (or a default CompilerConfig) with the pipeline installed as its
    post_grad_custom_pre_pass, wrapped in a TorchairTrainingBackend that also fuses
    training graphs before torchair partitions them. Without torchair: an
    EmulationBackend on CPU, which does both too; `compiler_config` must then be None,
    since nothing could honour it.

    Bad settings fail here, in one line: $NPU_FX_FUSION / $NPU_FX_FUSION_DISABLE
    (config.check_environment), a compiler config mode we do not know or that contradicts
    FusionConfig.mode; FusionConfig checks its own fields when it is made.
    """
    check_environment()
    if fusion_config is not None and not isinstance(fusion_config, FusionConfig):
        raise TypeError(f"fusion_config must be a FusionConfig, got {type(fusion_config).__name__}")
    torchair = import_torchair()
    if torchair is None:
        if compiler_config is not None:
            raise ValueError("a compiler_config was given but torchair is not importable; "
                             "without torch_npu only the CPU emulation backend is available")
        log.info("torchair not found: using the CPU emulation backend")
        return EmulationBackend(fusion_config)
    config = compiler_config if compiler_config is not None else torchair.CompilerConfig()
    pipeline = install(config, fusion_config)
    pipeline.report.graph_source = ("torchair backend: the aot graphs of the device torch_npu traces on "
                                    "(no emulation)")
    return TorchairTrainingBackend(torchair.get_npu_backend(compiler_config=config), pipeline, config)


class TorchairTrainingBackend:
    """torchair's backend, fusing training graphs before torchair partitions them.

    torchair's own hooks on the joint graph either need `npu_fx_pass`, which wipes
    Inductor's joint patterns and decomposition table process-wide and runs Inductor's
    random-op passes on torchair's graphs, or joint mode, which runs on real tensors.
    torch's backend-agnostic `torch._functorch.config.joint_custom_pass` runs right before
    any partition_fn, torchair's included; it is set only while torchair's backend
    compiles a graph (aot_autograd traces and partitions then; only the backward's
    *compilation* is deferred). A joint_custom_pass the user had set keeps running, first.
    Inference graphs are not joint graphs: they get the post_grad_custom_pre_pass alone.

    A fused joint graph the partitioner cannot split is reverted and split unfused
    (pipeline.FusedJoint): torchair partitions with its module's `default_partition`
    (npu_fx_compiler.py: imported at line 26, returned by _get_partition_fn, called by its
    npu_fx_pass partition_fn), which is wrapped for as long as torchair compiles. A torchair
    without that name gets the fused graph partitioned on a copy by the joint pass instead.
    """

    def __init__(self, torchair_backend: Callable, pipeline: FusionPipeline, compiler_config: Any):
        self.torchair_backend = torchair_backend  # functools.partial(_npu_backend, compiler_config=...)
        self.pipeline = pipeline
        self.compiler_config = compiler_config
        self._running = False
        self._floats: dict[str, float] = {}  # lifted_floats: module floats specialised so far
        self._fused: Optional["FusedJoint"] = None  # the joint pass's graph, until it is partitioned
        self._partitioner = _torchair_partitioner_module()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any):
        import torch._functorch.config as functorch_config

        if self.pipeline.fusion_config.enabled_passes():
            self.pipeline.before_autograd(gm, example_inputs, self._floats)
        example_inputs, checked = self.pipeline.merge_projections(gm, example_inputs)
        chained = functorch_config.joint_custom_pass
        if isinstance(chained, TorchairTrainingBackend._JointPass):
            chained = chained.chained  # a nested compile: do not stack our pass twice
        graphs = self.pipeline.report.graphs
        first = len(graphs)
        residuals, lifted_inputs = residual_outputs(gm), lifted(gm)
        with functorch_config.patch(joint_custom_pass=self._JointPass(self, chained)), self._partitioning():
            compiled = checked(watching(self.torchair_backend(gm, example_inputs, **kwargs), residuals, graphs[first:],
                                        lifted_inputs))
        # the graphs fused while torchair compiled this one: they run when it runs (a
        # backward torchair compiles later, at its first run, is not counted)
        return counting_runs(compiled, graphs[first:])

    @contextlib.contextmanager
    def _partitioning(self):
        """torchair's default_partition wrapped: the graph our joint pass fused is split
        through its FusedJoint, any other (a nested compile's, a higher-order op's
        subgraph) as torchair would."""
        module = self._partitioner
        if module is None or isinstance(module.default_partition, _FusedJointPartition):
            yield
            return
        original = module.default_partition
        module.default_partition = _FusedJointPartition(self, original)
        try:
            yield
        finally:
            module.default_partition = original
            self._fused = None

    class _JointPass:
        """joint_custom_pass(joint_gm, joint_inputs) -> joint_gm."""

        def __init__(self, backend: "TorchairTrainingBackend", chained: Optional[Callable]):
            self.backend, self.chained = backend, chained

        def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
            if self.chained is not None:
                gm = self.chained(gm, joint_inputs)
            backend = self.backend
            if backend._running:  # noqa: SLF001 - an aot trace from inside our own pass
                return gm
            backend._running = True  # noqa: SLF001
            try:
                fused = backend.pipeline.run_joint(gm, backend.compiler_config)
            finally:
                backend._running = False  # noqa: SLF001
            if backend._partitioner is None:  # noqa: SLF001 - nothing will partition it through `fused`
                fused.check()
            else:
                backend._fused = fused  # noqa: SLF001
            return gm


class _FusedJointPartition:
    """torchair's default_partition, splitting the joint graph TorchairTrainingBackend's
    pass fused through its FusedJoint (reverted to unfused if the fused one fails)."""

    def __init__(self, backend: TorchairTrainingBackend, default_partition: Callable):
        self.backend, self.default_partition = backend, default_partition

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        fused = self.backend._fused  # noqa: SLF001
        if fused is None or fused.gm is not gm:
            return self.default_partition(gm, joint_inputs, **kwargs)
        self.backend._fused = None  # noqa: SLF001
        return fused.partition(self.default_partition, joint_inputs, **kwargs)


def _torchair_partitioner_module() -> Any:
    """The torchair module whose global `default_partition` its backend partitions with,
    or None when this torchair has none (torch's own function under that name)."""
    from torch._functorch.partitioners import default_partition

    try:
        from torchair import npu_fx_compiler
    except ImportError:
        return None
    return npu_fx_compiler if getattr(npu_fx_compiler, "default_partition", None) is default_partition else None
