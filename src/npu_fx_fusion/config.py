"""FusionConfig: which passes run, for which SoC, and what gets dumped.

A pass's name is its module name in `npu_fx_fusion.patterns`, and the config keys, the
report keys and the CLI flags are those strings: `PASS_NAMES` lists them in pipeline
order (derived from the passes' own declarations, catalog.py).
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import AbstractSet, Optional

from .catalog import pass_names


def __getattr__(name: str):
    # PASS_NAMES: every pass in pipeline order, from the pass declarations in
    # npu_fx_fusion.patterns (catalog.py); computed on first use, so that importing the
    # package imports no pattern module
    if name == "PASS_NAMES":
        return pass_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ENV_SWITCH = "NPU_FX_FUSION"  # "0" turns every pass off
ENV_DISABLE = "NPU_FX_FUSION_DISABLE"  # comma-separated pass names to turn off
# The values ENV_SWITCH takes (any case, surrounding spaces ignored); unset or empty is on.
SWITCH_ON = ("1", "true", "on", "yes")
SWITCH_OFF = ("0", "false", "off", "no")


# Transforms the backends run on the dynamo graph, before aot_autograd (not patterns/ passes):
# named, enabled and disabled like the passes (FusionConfig.enable / disable,
# NPU_FX_FUSION_DISABLE, the CLI's --disable), and reported as passes.
DYNAMO_TRANSFORMS = ("merged_projections",)


def check_pass_names(names: Iterable[str], where: str) -> frozenset[str]:
    """Return `names` as a frozenset, or raise ValueError naming the unknown ones."""
    if isinstance(names, str):  # a bare string would otherwise be read as letters
        names = [names]
    names = frozenset(names)
    valid = (*DYNAMO_TRANSFORMS, *pass_names())
    unknown = sorted(names - set(valid))
    if unknown:
        near = [match for name in unknown for match in difflib.get_close_matches(name, valid, n=1)]
        guess = f"did you mean {', '.join(map(repr, near))}? " if near else ""
        raise ValueError(
            f"unknown pass name(s) {', '.join(map(repr, unknown))} in {where}; {guess}"
            f"valid names: {', '.join(valid)}"
        )
    return names


def _env_disabled() -> frozenset[str]:
    raw = os.environ.get(ENV_DISABLE, "")
    names = [part.strip() for part in raw.split(",") if part.strip()]
    return check_pass_names(names, f"${ENV_DISABLE}={raw!r}")


def fusion_switched_off() -> bool:
    """$NPU_FX_FUSION is off; ValueError for a value that is neither on nor off (never
    guessed: `NPU_FX_FUSION=banana` is an error, not "on")."""
    raw = os.environ.get(ENV_SWITCH, "")
    value = raw.strip().lower()
    if value in SWITCH_OFF:
        return True
    if value in SWITCH_ON or not value:
        return False
    raise ValueError(f"${ENV_SWITCH}={raw!r} is not a switch; valid values: "
                     f"{', '.join(SWITCH_ON)} (fusion on) or {', '.join(SWITCH_OFF)} (every pass off)")


def check_environment() -> None:
    """Raise ValueError, one line naming the variable, its value and the valid ones, for a
    bad $NPU_FX_FUSION or $NPU_FX_FUSION_DISABLE. The backends and the CLI call it when
    they are created, so a typo fails at once rather than inside the first compile."""
    fusion_switched_off()
    _env_disabled()


@dataclass(frozen=True)
class FusionConfig:
    """What the fusion pipeline does.

    enable:   run only these passes (None: all of them).
    disable:  never run these passes (applied after `enable`).
    soc:      the Ascend SoC to honour hardware limits for (see capabilities.SOCS). None:
              detected from torch_npu when it is present, otherwise no SoC-specific limits
              are applied and the report notes which limits a site would hit.
    mode:     the torchair mode the graph is lowered in ("max-autotune", "reduce-overhead",
              "npugraph_ex"; capabilities.MODES). A pass never emits an op that mode cannot
              lower (max-autotune needs a GE converter per op). None: taken from the
              torchair / npugraph_ex config the pipeline is called with; in CPU emulation
              nothing is excluded, and a site max-autotune could not lower says so.
    dump_dir: write each compiled graph before/after the passes and the report there.
    verify:   run each matched subgraph and its replacement on random inputs of the
              site's shapes and compare (OpCapability.verify_ulps); a site that fails is not
              fused and is reported. Costs one eager run of both per site.
    strict:   re-raise a pass's exception instead of reverting that pass and reporting it.
    npu_dispatch: CPU emulation only (no effect on an NPU, whose graphs are NPU graphs):
              trace the model as an NPU compile does, with torch_npu 2.13's and torchair's
              dispatch overrides and transformers' NPU branches reproduced for `soc`
              (None: Ascend910B), so the passes see the graph an NPU compile holds
              (SDPA as npu_fusion_attention_v3, aten.matmul, ...; npu_dispatch.py,
              docs/npu-graph.md). False: the plain CPU trace, to compare with.
    keep_intermediate_rounding: never fuse a site whose fused op computes in more precision
              than the code does: a bf16 / fp16 RMSNorm written without an fp32 upcast
              rounds every step to the input dtype, npu_rms_norm rounds once (closer to
              the exact result; each such site's note gives the measured difference).
              Such sites are near misses instead. Default False: fuse them.
    merge_projections: in inference, merge the linear layers that read one input (q/k/v,
              gate/up) into one matmul on their concatenated weights, when the backend
              compiles the model (get_npu_backend, the emulation backend): each merged
              parameter becomes a view of the one buffer (no second copy of the weights),
              and a rebound parameter is copied back into it before the next call
              (merged_projections.py). False: keep every linear as the model wrote it. It
              is also the transform `merged_projections` (DYNAMO_TRANSFORMS), named like a
              pass: `enable` without it, `disable={"merged_projections"}`,
              NPU_FX_FUSION_DISABLE=merged_projections and NPU_FX_FUSION=0 turn it off too.
    ep_group: the expert-parallel process group (a torch.distributed ProcessGroup, or its
              c10d group name) that you declare dedicated to the MoE layers' token exchanges:
              no other communication (other graphs, eager code, FSDP) runs on it. MC2
              (npu_moe_distribute_dispatch_v2 / combine_v2) requires that of its EP domain,
              and a graph cannot prove it, so moe_dispatch fuses a layer's whole dispatch and
              combine into MC2 only on the group declared here (inference, within the ops'
              limits; docs/expert-parallel.md). None: MC2 is never used. Stored as the group's
              name; a group this process does not know is an error at creation.

    The environment is read each time a pipeline runs, so it overrides code:
    NPU_FX_FUSION=0 turns every pass off; NPU_FX_FUSION_DISABLE=rope,swiglu adds to `disable`.

    Bad settings fail at creation, in one line: a field of the wrong type (TypeError), an
    unknown pass, SoC or mode, a dump_dir that cannot be written (ValueError). The
    backends and the CLI check the environment when they are made (check_environment).
    """

    enable: Optional[AbstractSet[str]] = None
    disable: AbstractSet[str] = field(default_factory=frozenset)
    soc: Optional[str] = None
    mode: Optional[str] = None
    dump_dir: Optional[str] = None
    strict: bool = False
    verify: bool = False
    npu_dispatch: bool = True
    keep_intermediate_rounding: bool = False
    merge_projections: bool = True
    ep_group: Optional[object] = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.ep_group is not None:
            object.__setattr__(self, "ep_group", _group_name(self.ep_group))
        if self.enable is not None:
            object.__setattr__(self, "enable", check_pass_names(self.enable, "FusionConfig(enable=...)"))
        object.__setattr__(self, "disable", check_pass_names(self.disable, "FusionConfig(disable=...)"))
        if self.soc is not None:
            from .capabilities import check_soc_name

            check_soc_name(self.soc)
        if self.mode is not None:
            from .capabilities import check_mode_name

            check_mode_name(self.mode)
        if self.dump_dir is not None:
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
            _check_writable_dir(self.dump_dir)

    def _check_types(self) -> None:
        """TypeError, one line, for a field of the wrong type (a typo'd keyword is Python's own)."""
        for name in ("enable", "disable"):
            value = getattr(self, name)
            if value is None and name == "enable":
                continue
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"FusionConfig({name}=...) takes pass names (str), got {value!r}; "
                                f"valid names: {', '.join(pass_names())}")
        for name in ("soc", "mode"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"FusionConfig({name}=...) takes a str or None, got {value!r} "
                                f"({type(value).__name__})")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise TypeError(f"FusionConfig(dump_dir=...) takes a path (str or os.PathLike) or None, got "
                            f"{self.dump_dir!r} ({type(self.dump_dir).__name__})")
        for name in ("strict", "verify", "npu_dispatch", "keep_intermediate_rounding", "merge_projections"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"FusionConfig({name}=...) takes True or False, got {value!r} "
                                f"({type(value).__name__})")

    def dedicated_groups(self) -> frozenset[str]:
        """The c10d names of the groups declared dedicated to the exchanges a pass may fuse."""
        return frozenset() if self.ep_group is None else frozenset({self.ep_group})

    def transform_enabled(self, name: str) -> bool:
        """A transform of DYNAMO_TRANSFORMS runs (after the environment overrides)."""
        if name == "merged_projections" and not self.merge_projections:
            return False
        if fusion_switched_off() or (self.enable is not None and name not in self.enable):
            return False
        return name not in set(self.disable) | _env_disabled()

    def enabled_passes(self) -> tuple[str, ...]:
        """The passes to run now, in pipeline order, after the environment overrides."""
        if fusion_switched_off():
            return ()
        wanted = set(pass_names()) if self.enable is None else set(self.enable)
        wanted -= set(self.disable) | _env_disabled()
        return tuple(name for name in pass_names() if name in wanted)


def _group_name(group: object) -> str:
    """The c10d name of `group` (a ProcessGroup or a name): TypeError for anything else,
    ValueError for a name no group of this process has."""
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group.group_name
    if not isinstance(group, str) or not group:
        raise TypeError(f"FusionConfig(ep_group=...) takes a torch.distributed ProcessGroup or its group name, "
                        f"got {group!r} ({type(group).__name__})")
    from .npu_ops._groups import resolve_group

    if resolve_group(group) is None:
        raise ValueError(f"FusionConfig(ep_group={group!r}): no process group of this process has that name "
                         "(create the EP group first, e.g. device_mesh['ep'].get_group(), and pass it)")
    return group


def _check_writable_dir(path: str) -> None:
    """ValueError unless `path` is a directory this process can write, or can be created
    as one: checked when the config is made, without creating anything yet."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise ValueError(f"FusionConfig(dump_dir={path!r}): {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the directory" if existing == os.path.abspath(path) else f"{existing}, where it would be created,"
        raise ValueError(f"FusionConfig(dump_dir={path!r}): {what} is not writable")

