"""Run a test function on N CPU processes that talk gloo over loopback, bounded in time.

    results = run_on_ranks(worker, world_size=2, flavor="qwen3")   # [worker's result per rank]

`worker(rank, world_size, **kwargs)` is a module-level function (the children are spawned,
so they import it by name); it runs after `torch.distributed.init_process_group("gloo")`
on 127.0.0.1 at a free port, and its return value (tensors, dicts, lists) comes back to
the parent through a queue, serialized with torch.save (a child may exit before the parent
reads a shared-memory tensor).

Nothing can hang CI:
- every collective times out (init_process_group(timeout=collective_timeout)): a rank
  waiting for a peer that never joins a collective raises, and its error comes back;
- the parent waits `timeout` seconds in all for every rank's report, then kills the
  children that are still running and fails, naming them;
- each child exits by itself once its worker returned or raised (the process group is
  destroyed in a finally).

One thread per process (OMP_NUM_THREADS=1): the ranks share a few cores.
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 600.0  # seconds for the whole run: imports, compiles and all
DEFAULT_COLLECTIVE_TIMEOUT = 120.0  # seconds a rank waits in one collective


class RanksFailed(AssertionError):
    """A rank raised, crashed, or did not finish in time (the message says which)."""


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(worker: Callable[..., Any], world_size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT, **kwargs: Any) -> list:
    """worker(rank, world_size, **kwargs) on `world_size` gloo ranks; their results by rank.

    Raises RanksFailed with each failing rank's traceback (or the ranks that timed out).
    """
    context = mp.get_context("spawn")
    reports = context.Queue()
    port = free_port()
    children = [context.Process(target=_child, name=f"rank{rank}", daemon=True,
                                args=(worker, rank, world_size, port, collective_timeout, kwargs, reports))
                for rank in range(world_size)]
    for child in children:
        child.start()
    deadline = time.monotonic() + timeout
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = reports.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                silent = [c for r, c in enumerate(children) if r not in results and r not in errors]
                crashed = [c for c in silent if c.exitcode is not None]
                if crashed:  # died without a report (a segfault, os._exit): give the queue a moment
                    time.sleep(0.5)
                    if reports.empty():
                        raise RanksFailed("; ".join(f"{c.name} exited with code {c.exitcode} without a report"
                                                    for c in crashed)) from None
                if time.monotonic() >= deadline:
                    raise RanksFailed(f"{', '.join(c.name for c in silent)} did not finish within {timeout:.0f} s "
                                      "(killed)") from None
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for child in children:
            child.join(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
        for child in children:
            if child.is_alive():
                child.kill()
                child.join(timeout=10.0)
        reports.close()
    if errors:
        raise RanksFailed("\n".join(f"rank {rank} failed:\n{text}" for rank, text in sorted(errors.items())))
    return [results[rank] for rank in range(world_size)]


def _child(worker, rank, world_size, port, collective_timeout, kwargs, reports):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            result = worker(rank, world_size, **kwargs)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        reports.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        reports.put((rank, False, traceback.format_exc()))


# ---- workers of the harness's own tests (tests/test_expert_parallel.py) ---------------------
# Here rather than in the test module: a spawned child imports its worker's module, and
# this one imports torch only, so these tests cost a process start, not a model import.
def worker_all_reduce(rank, world_size):
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "backend": dist.get_backend()}


def worker_skips_a_collective(rank, world_size):
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return rank


def worker_never_returns(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank
