"""NCCL groups are made so that a timeout or a dead peer raises in the caller (loomrl/collectives.py), not so that
torch's watchdog tears the process down. There is no GPU here: torch.cuda.set_device and the group constructors are
replaced by recorders (said at each test); what is checked is what loomrl passes them and the environment they see."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loomrl.collectives import ERROR_HANDLING_VAR, collective_failed


def test_trainer_ranks_on_cuda_get_an_eager_nccl_group_that_raises(monkeypatch):
    """Mocked: torch.cuda.set_device and dist.init_process_group (no GPU, no NCCL here)."""
    from loomrl.trainer import distributed

    seen = {}
    monkeypatch.delenv(ERROR_HANDLING_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def init(backend, **kw):
        seen.update(backend=backend, env=distributed.os.environ.get(ERROR_HANDLING_VAR), **kw)

    monkeypatch.setattr(dist, "init_process_group", init)
    distributed.init_process_group(1, 4, master_port=1234, device=torch.device("cuda", 1), timeout_s=30)
    assert seen["backend"] == "nccl" and seen["env"] == "2"  # abort the communicator, raise; no teardown
    assert seen["device_id"] == torch.device("cuda", 1)  # the communicator is made at the rendezvous
    assert seen["timeout"].total_seconds() == 30


def test_a_value_the_user_set_is_kept_and_gloo_is_left_alone(monkeypatch):
    """Mocked: torch.cuda.set_device and dist.init_process_group."""
    from loomrl.trainer import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, distributed.os.environ.get(ERROR_HANDLING_VAR),
                                                            "device_id" in kw)))
    monkeypatch.setenv(ERROR_HANDLING_VAR, "1")
    distributed.init_process_group(0, 2, master_port=1, device=torch.device("cuda", 0))
    monkeypatch.delenv(ERROR_HANDLING_VAR)
    distributed.init_process_group(0, 2, master_port=1, device=torch.device("cpu"))
    assert calls == [("nccl", "1", True), ("gloo", None, False)]


def test_the_weight_broadcast_group_on_nccl_raises_too(monkeypatch):
    """A real TCPStore; mocked: the group constructor (_new_process_group_helper: NCCL needs a GPU)."""
    import os

    from torch.distributed import distributed_c10d

    from loomrl.weights.group import GroupAddress, WeightGroup, host_store

    seen = []
    monkeypatch.delenv(ERROR_HANDLING_VAR, raising=False)
    monkeypatch.setattr(distributed_c10d, "_new_process_group_helper",
                        lambda *a, **kw: seen.append((a[3], os.environ.get(ERROR_HANDLING_VAR))) or (None, None))
    store = host_store("127.0.0.1", 1, 10)
    for backend in ("gloo", "nccl"):
        address = GroupAddress(host="127.0.0.1", port=store.port, world_size=1, name=f"t-{backend}", timeout_s=10,
                               backend=backend)
        WeightGroup(address, 0, torch.device("cpu"), store=store)
    assert seen == [("gloo", None), ("nccl", "2")]


def test_which_errors_are_the_group_s():
    assert collective_failed(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert collective_failed(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert collective_failed(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited"))
    assert not collective_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not collective_failed(ValueError("data-parallel step: no rank got a sampled token"))
