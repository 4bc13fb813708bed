"""NCCL groups are made so that a timeout or a dead peer raises in the caller (loomrl/collectives.py), not so that
torch's watchdog tears the process down. There is no GPU here: torch.cuda.set_device and the group constructors are
replaced by recorders (said at each test); what is checked is what loomrl passes them and the environment they see."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from loomrl.collectives import ERROR_HANDLING_VAR, collective_failed


def test_trainer_ranks_on_cuda_get_an_unbound_nccl_group_that_raises(monkeypatch):
    """Mocked: torch.cuda.set_device and dist.init_process_group (no GPU, no NCCL here)."""
    from loomrl.train_pool import distributed

    seen = {}
    monkeypatch.delenv(ERROR_HANDLING_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def init(backend, **kw):
        seen.update(backend=backend, env=distributed.os.environ.get(ERROR_HANDLING_VAR), **kw)

    monkeypatch.setattr(dist, "init_process_group", init)
    distributed.init_process_group(1, 4, master_port=1234, device=torch.device("cuda", 1), timeout_s=30)
    assert seen["backend"] == "nccl" and seen["env"] == "2"  # abort the communicator, raise; no teardown
    # not bound to a device: torch would split the weight group's communicator from it, a collective rank 0 alone calls
    assert "device_id" not in seen
    assert seen["timeout"].total_seconds() == 30


def test_a_value_the_user_set_is_kept_and_gloo_is_left_alone(monkeypatch):
    """Mocked: torch.cuda.set_device and dist.init_process_group."""
    from loomrl.train_pool import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, distributed.os.environ.get(ERROR_HANDLING_VAR),
                                                            "device_id" in kw)))
    monkeypatch.setenv(ERROR_HANDLING_VAR, "1")
    distributed.init_process_group(0, 2, master_port=1, device=torch.device("cuda", 0))
    monkeypatch.delenv(ERROR_HANDLING_VAR)
    distributed.init_process_group(0, 2, master_port=1, device=torch.device("cpu"))
    assert calls == [("nccl", "1", False), ("gloo", None, False)]


def test_the_weight_broadcast_group_on_nccl_raises_too(monkeypatch):
    """A real TCPStore; mocked: the group constructor (_new_process_group_helper: NCCL needs a GPU)."""
    import os

    from torch.distributed import distributed_c10d

    from loomrl.weights.group import GroupAddress, WeightGroup, host_store

    seen, timeouts = [], []
    monkeypatch.delenv(ERROR_HANDLING_VAR, raising=False)
    store = host_store("127.0.0.1", 1, 10)
    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper",
                        lambda *a, **kw: seen.append((a[3], os.environ.get(ERROR_HANDLING_VAR)))
                        or timeouts.append(kw["timeout"].total_seconds()) or (None, None))
    for backend in ("gloo", "nccl"):
        address = GroupAddress(host="127.0.0.1", port=store.port, world_size=1, name=f"t-{backend}", timeout_s=10,
                               backend=backend)
        WeightGroup(address, 0, torch.device("cpu"), store=store)
    assert seen == [("gloo", None), ("nccl", "2")]
    assert timeouts == [10, 130]  # NCCL's past loomrl's own deadline (10 s): its watchdog never acts first


def test_which_errors_are_the_group_s():
    assert collective_failed(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert collective_failed(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert collective_failed(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited"))
    assert not collective_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not collective_failed(ValueError("data-parallel step: no rank got a sampled token"))


def test_the_weight_group_is_not_split_from_a_bound_default_group(monkeypatch, tmp_path):
    """A default group bound to a device (vLLM's workers with VLLM_DISTRIBUTED_USE_SPLIT_GROUP) would make torch split
    the weight group's communicator from it: a collective of ranks that never call it. A real one-rank gloo default
    group, bound by hand; mocked: the group constructor, which records the binding it sees."""
    from torch.distributed import distributed_c10d

    from loomrl.weights.group import GroupAddress, WeightGroup, host_store

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        default = distributed_c10d._get_default_group()
        default.bound_device_id = torch.device("cpu", 0)
        seen = []
        monkeypatch.setattr(distributed_c10d, "_new_process_group_helper",
                            lambda *a, **kw: seen.append(distributed_c10d._get_default_group().bound_device_id)
                            or (None, None))
        store = host_store("127.0.0.1", 1, 10)
        WeightGroup(GroupAddress(host="127.0.0.1", port=store.port, world_size=1, name="t-bound", timeout_s=10,
                                 backend="gloo"), 0, torch.device("cpu"), store=store)
        assert seen == [None] and default.bound_device_id == torch.device("cpu", 0)  # unbound meanwhile, then restored
        default.bound_device_id = None
    finally:
        dist.destroy_process_group()


class _Work:
    """A broadcast's work as NCCL leaves it after its watchdog aborted the communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING
    =2): completed, wait() returns (it only logs), the exception set. A stand-in: no NCCL here."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True

    def exception(self):
        return RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST)")


def test_an_aborted_broadcast_is_an_error_at_either_end():
    from loomrl.weights.group import GroupAddress, WeightGroup

    group = WeightGroup.__new__(WeightGroup)  # no rendezvous: only the wait is tested
    group.address = GroupAddress(host="h", port=1, world_size=2, name="n", timeout_s=5, backend="nccl")
    with pytest.raises(RuntimeError, match="weight sync: bucket 3 of 9 failed: Watchdog caught"):
        group._received([_Work()], "weight sync: bucket 3 of 9", time.monotonic() + 5)


class _Late(_Work):
    """A broadcast that never completes (a receiver gone), and the group's abort, recorded."""

    def __init__(self, log: list[str]):
        self.log = log

    def is_completed(self) -> bool:
        return False

    def abort(self) -> None:
        self.log.append("abort")


def test_a_late_bucket_aborts_the_group_at_loomrls_deadline_not_the_watchdogs():
    """NCCL's watchdog keeps a timed-out work's exception on its own copy; after its abort the work reads as completed
    without one. So the weight group's own timeout is longer (WATCHDOG_MARGIN) and loomrl's deadline aborts it first."""
    from loomrl.weights.group import GroupAddress, WeightGroup

    log: list[str] = []
    group = WeightGroup.__new__(WeightGroup)
    group.address = GroupAddress(host="h", port=1, world_size=2, name="n", timeout_s=0.2, backend="nccl")
    group._pg = _Late(log)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="bucket 1 of 2 was not received within 0s .* the group is aborted"):
        group._received([_Late(log)], "weight sync: bucket 1 of 2", time.monotonic() + 0.2)
    assert log == ["abort"] and time.monotonic() - start < 5
