"""Trainer ranks join the process group only once rank 0 has read its model (train_pool/ranks.py RankModel): the
rendezvous is bounded by COLLECTIVE_TIMEOUT_S (300 s), and rank 0 reading a large model whole on the CPU takes longer,
so a follower that entered it at once would time out. Here the order is checked on the real functions with the model
reading and the process group replaced by recorders: a model that takes minutes to read cannot be read on this machine
in a test (the real path, with real gloo ranks, runs in test_fsdp_rank0_load.py, test_distributed_trainer.py and the
runtime's trainer-kill and Ray tests)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from loomrl.config import RunConfig
from loomrl.train_pool import ranks as ranks_module
from loomrl.train_pool.ranks import JOIN, LocalRankGroup, RankModel, Reference


class _Recorder:
    """Stands in for Follower in _follower_main: records that it read its model and when it was told to join."""

    events: list[str] = []

    def __init__(self, pool, ckpt):
        self.events.append("read")

    def join(self, rank, world, addr, port):
        self.events.append("join")

    def work(self, w):
        return w


@pytest.fixture(autouse=True)
def _in_this_process(monkeypatch):
    """_follower_main runs in the test's process here: Follower recorded, the process not renamed."""
    monkeypatch.setattr(ranks_module, "Follower", _Recorder)
    monkeypatch.setattr(ranks_module, "name_process", lambda name: None)
    _Recorder.events = []


def _pool_json(tmp_path: Path) -> str:
    cfg = RunConfig.model_validate({"model": {"kind": "tiny"}, "output_dir": str(tmp_path),
                                    "runtime": {"mode": "async"}, "trainer": {"parallel": "fsdp", "world_size": 2}})
    return cfg.train_pool().model_dump_json()


def test_a_local_follower_reads_its_model_then_waits_for_rank_0s_word_to_join(tmp_path, monkeypatch):
    inbox, outbox = queue.Queue(), queue.Queue()
    seen = []

    def get():
        seen.append(list(_Recorder.events))  # what the follower had done when it asked for its next message
        return messages.pop(0)

    messages = [JOIN, None]
    inbox.get = get  # type: ignore[method-assign]
    ranks_module._follower_main(_pool_json(tmp_path), None, 1, 2, 12345, torch.get_num_threads(), inbox, outbox)
    assert seen == [["read"], ["read", "join"]]  # read, then waited for JOIN before entering the rendezvous
    assert outbox.empty()


def test_a_local_follower_stopped_before_rank_0_read_its_model_never_joins(tmp_path, monkeypatch):
    inbox, outbox = queue.Queue(), queue.Queue()
    inbox.put(None)  # LocalFollowers.stop: rank 0 failed or the run stopped while rank 0 read its model
    ranks_module._follower_main(_pool_json(tmp_path), None, 1, 2, 12345, torch.get_num_threads(), inbox, outbox)
    assert _Recorder.events == ["read"] and outbox.empty()


def test_a_local_follower_refuses_work_before_it_was_told_to_join(tmp_path, monkeypatch):
    class Outbox(list):  # a failing follower puts its error, then closes the queue and waits until it is sent
        put = list.append

        def close(self):
            pass

        def join_thread(self):
            pass

    inbox, outbox = queue.Queue(), Outbox()
    inbox.put(ranks_module.RankWork())
    with pytest.raises(SystemExit):
        ranks_module._follower_main(_pool_json(tmp_path), None, 1, 2, 12345, torch.get_num_threads(), inbox, outbox)
    [(kind, why)] = outbox
    assert kind == "error" and "expected rank 0's word to join" in why and _Recorder.events == ["read"]


def test_local_rank_0_tells_the_followers_to_join_as_it_enters_the_rendezvous(monkeypatch):
    inboxes = [queue.Queue(), queue.Queue()]
    told = []
    monkeypatch.setattr(ranks_module, "init_process_group",
                        lambda rank, world, **_: told.append([q.get_nowait() for q in inboxes]))
    LocalRankGroup(3, torch.device("cpu"), inboxes, [queue.Queue(), queue.Queue()]).join("127.0.0.1", 1)
    assert told == [[JOIN, JOIN]]


def test_rank_0_reads_its_model_and_kls_reference_before_it_joins(tmp_path, monkeypatch):
    """TrainerService.from_run (the trainer process's and the Ray trainer actor's rank 0): `load` reads the model and
    KL's reference, then the ranks are joined."""
    from loomrl.train_pool import service as service_module
    from loomrl.train_pool.service import TrainerService

    order = []

    def load_rank(pool, ckpt, device, *, rank0):
        order.append(("read", rank0))
        return RankModel(model=None, tokenizer=None, reference=Reference(None))  # type: ignore[arg-type]

    class Joined(Exception):
        pass

    class Ranks:
        def join(self, addr, port):
            order.append(("join", port))
            raise Joined  # the rest (building the trainer) is not what this test is about

    monkeypatch.setattr(service_module, "load_rank", load_rank)
    pool = RunConfig.model_validate({"model": {"kind": "tiny"}, "output_dir": str(tmp_path)}).train_pool()
    with pytest.raises(Joined):
        TrainerService.from_run(pool, service_module.Carried(), None, torch.device("cpu"), ranks=Ranks(),  # type: ignore[arg-type]
                                rendezvous=("127.0.0.1", 7))
    assert order == [("read", True), ("join", 7)]


def test_a_resumed_ranks_kl_reference_is_read_with_its_model(tmp_path):
    """load_rank reads KL's reference (the run's starting model) with the model, before joining: rank 0's whole, a
    follower's the skeleton under FSDP2 over two ranks."""
    from loomrl.train_pool.ranks import load_rank

    cfg = RunConfig.model_validate({"model": {"kind": "tiny", "tiny": {"num_hidden_layers": 1}},
                                    "output_dir": str(tmp_path), "runtime": {"mode": "async"},
                                    "trainer": {"parallel": "fsdp", "world_size": 2,
                                                "loss": {"kl": "k3", "kl_coef": 0.1}}})
    ckpt = tmp_path / "checkpoints" / "step_000001"  # only its name matters: the reference is the starting model's
    pool = cfg.train_pool()
    fresh = load_rank(pool, None, torch.device("cpu"), rank0=True)
    assert fresh.reference.model is None  # a fresh run: the reference is a copy of the policy
    ref0 = ranks_module.reference_of(pool.trainer, pool.model, torch.device("cpu"), ckpt, rank0=True).model
    ref1 = ranks_module.reference_of(pool.trainer, pool.model, torch.device("cpu"), ckpt, rank0=False).model
    assert ref0 is not None and not any(p.is_meta for p in ref0.parameters())
    assert ref1 is not None and all(p.is_meta for p in ref1.parameters())
