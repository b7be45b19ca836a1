"""The communicators the collective ops name: a process group's `hcom` string, and back.

torch_npu's communicating ops (npu_mm_all_reduce_base, npu_all_gather_base_mm,
npu_mm_reduce_scatter_base, the MC2 MoE ops) take the group as a string, `hcom`: the name of
the HCCL communicator of a torch.distributed process group. The graphs the passes fuse name
the group of each functional collective by its c10d name (`_c10d_functional.all_reduce(x,
"sum", "0")`), so a pass turns one into the other when it emits the op (`hcom_of`), at
compile time, where the process group exists:

- on an NPU (an HCCL group) it is what torchair's own collective converters use,
  `pg._get_backend(torch.device("npu")).get_hccl_comm_name(rank, init_comm=True)` with the
  global rank (torchair/_ge_concrete_graph/hcom_utils.py, get_group_name_and_record; the
  torch_npu docs, vllm-ascend and torchtitan-npu call the same method). torchair records the
  process group of every MC2 op whose `group` attribute is such a name
  (hcom_utils.record_pg_to_graph), which needs the communicator initialised: hence
  init_comm=True here, as its converters do;
- on any other backend (gloo on CPU, the fake backend of graph-capture tests) there is no
  HCCL communicator: the name is the c10d group name itself, which the CPU reference
  kernels resolve back to the group (`process_group_of`) and run the collective over, so
  2 and 4 gloo ranks check the fused graph's numerics end to end.

`process_group_of(hcom)` is the registry: the groups `hcom_of` named, plus any c10d group by
its name, plus groups registered by hand (`register`, which the op-level tests use for a
one-rank gloo group built in the test process, without init_process_group).
"""
from __future__ import annotations

import datetime
import threading
from typing import Any, Optional

import torch

_REGISTERED: dict[str, Any] = {}  # hcom -> ProcessGroup
_LOCK = threading.Lock()


def _c10d() -> Any:
    import torch.distributed.distributed_c10d as c10d

    return c10d


def resolve_group(group_name: str) -> Optional[Any]:
    """The ProcessGroup c10d knows by `group_name`, None when there is none in this process."""
    if not torch.distributed.is_available():
        return None
    try:
        return _c10d()._resolve_process_group(group_name)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - an unknown name (a pattern's example, another process's group)
        return None


def group_backend(group_name: str) -> Optional[str]:
    """"hccl", "gloo", "fake", ... of the c10d group `group_name`; None if it does not resolve."""
    group = resolve_group(group_name)
    if group is None:
        return None
    try:
        return torch.distributed.get_backend(group)
    except Exception:  # noqa: BLE001
        return None


def group_size(group_name: str) -> Optional[int]:
    """The number of ranks of the c10d group `group_name`; None if it does not resolve."""
    group = resolve_group(group_name)
    return None if group is None else group.size()


def no_communicator_reason(group_name: str) -> Optional[str]:
    """Why an op cannot name the c10d group `group_name` as its `hcom`, or None: the group
    must exist in this process; with torch_npu's real ops it must be an HCCL group (a gloo or
    fake group has no HCCL communicator for them; the CPU stand-ins run over any group)."""
    group = resolve_group(group_name)
    if group is None:
        return f"the process group {group_name!r} does not exist in this process"
    from ._library import real_torch_npu_available

    backend = group_backend(group_name)
    if real_torch_npu_available() and backend != "hccl":
        return (f"the process group {group_name!r} runs on {backend}: torch_npu's op needs an HCCL "
                "communicator (a group of the hccl backend)")
    return None


def hcom_of(group_name: str) -> str:
    """The `hcom` a torch_npu collective op takes for the c10d group `group_name` (module doc)."""
    group = resolve_group(group_name)
    if group is None or group_backend(group_name) != "hccl":
        hcom = group_name
    else:
        rank = torch.distributed.get_rank()
        hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(rank, init_comm=True)  # noqa: SLF001
    if group is not None:
        with _LOCK:
            _REGISTERED[hcom] = group
    return hcom


def register(hcom: str, group: Any) -> str:
    """Name `group` `hcom` for the reference kernels (a group built without init_process_group)."""
    with _LOCK:
        _REGISTERED[hcom] = group
    return hcom


def process_group_of(hcom: str) -> Any:
    """The ProcessGroup an op's `hcom` names: one hcom_of or register named, else the c10d
    group of that name. ValueError, naming the known ones, when there is none."""
    with _LOCK:
        group = _REGISTERED.get(hcom)
    if group is None:
        group = resolve_group(hcom)
    if group is None:
        known = sorted(_REGISTERED)
        raise ValueError(f"no process group is named {hcom!r} in this process (registered: {known}); "
                         "the CPU reference kernels of the collective ops run over the group the "
                         "graph's collectives named (npu_ops._groups.hcom_of)")
    return group


_SINGLE_RANK: dict[str, Any] = {}


def single_rank_group(hcom: str = "npu_fx_fusion_single_rank") -> str:
    """A gloo group of one rank in this process, registered as `hcom` (built once): what the
    op-level tests (torch.library.opcheck) run the collective ops' reference kernels over.
    No init_process_group: the default group, if any, stays what the process made it."""
    with _LOCK:
        if hcom in _SINGLE_RANK:
            return hcom
    from torch.distributed import HashStore, ProcessGroupGloo

    group = ProcessGroupGloo(HashStore(), 0, 1, datetime.timedelta(seconds=60))
    with _LOCK:
        _SINGLE_RANK[hcom] = group
        _REGISTERED[hcom] = group
    return hcom
