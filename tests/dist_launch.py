"""A local launcher for the data-parallel tests: fn(rank, world_size, *args) on N spawned ranks in one
gloo process group (the runs themselves start their ranks with train_pool/ranks.py), and a replica check."""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessException

from loomrl.train_pool.distributed import DataParallelTrainer, free_port, init_process_group, param_checksum


def in_sync(dp: DataParallelTrainer) -> bool:
    """Whether every rank holds bit-identical trainable parameters (a cheap checksum)."""
    sums = torch.tensor(param_checksum(dp.trainer.params), dtype=torch.int64)
    extremes = torch.cat([sums, -sums])  # max and -min over the ranks, in one collective
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return bool(torch.equal(extremes[:2], -extremes[2:]))


class RankFailed(RuntimeError):
    """A rank of a local launch raised; the message holds the first failure's traceback."""


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float,
               threads: int, results: Any, args: tuple) -> None:
    try:
        torch.set_num_threads(threads)
        init_process_group(rank, world_size, master_port=port, timeout_s=timeout_s)  # gloo
        out = fn(rank, world_size, *args)
    except BaseException:
        # Sent before our connections close: the first failure is the cause, the other ranks' lost
        # connections its effect, and the parent names the earliest.
        results.put((rank, "error", (time.time(), traceback.format_exc())))
        results.close()
        results.join_thread()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle: torch's queue pickler would hand tensors over as shared memory that vanishes
    # when this process exits, before the parent has read them.
    results.put((rank, "result", pickle.dumps(out)))


def launch_local(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
                 threads: int | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` spawned local ranks in one process group; returns their results
    by rank. An exception in any rank stops the others and is raised here as RankFailed (naming the rank that failed
    first); a run past `timeout_s` raises TimeoutError. `fn` must be importable (a module-level function)."""
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    procs = tmp.start_processes(_rank_main, args=(fn, world_size, free_port(), timeout_s, threads, results,
                                                  args), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}
    try:
        while True:
            _drain(results, out, errors)  # a rank cannot exit until the parent has read what it put
            try:
                if procs.join(timeout=0.2):
                    break
            except ProcessException as err:  # a rank died; join has stopped the others
                _drain(results, out, errors)
                if not errors:
                    raise RankFailed(f"launch_local: {err}") from err
                rank, (_, tb) = min(errors.items(), key=lambda e: e[1][0])
                raise RankFailed(f"launch_local: rank {rank} of {world_size} failed first:\n{tb}") from err
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch_local: {world_size} ranks still running after {timeout_s:.0f}s")
        _drain(results, out, errors)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise RankFailed(f"launch_local: ranks {missing} exited without a result")
    return [out[r] for r in range(world_size)]


def _drain(results: Any, out: dict[int, Any], errors: dict[int, tuple[float, str]]) -> None:
    while True:
        try:
            rank, kind, payload = results.get(timeout=0.05)
        except queue.Empty:
            return
        if kind == "error":
            errors[rank] = payload
        else:
            out[rank] = pickle.loads(payload)
