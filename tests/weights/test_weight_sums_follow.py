"""A sharded trainer's broadcast is fingerprinted after all (weights/fingerprint.py, weights/group.py): its version is
gathered only as the broadcast sends it, so the handle cannot carry the sums; they follow the last bucket over the same
gloo group, and a receiver in another process gets exactly the sums of what it received. `check` then compares the
engine's own sums with those and fails, naming the tensor, the version and both sums, where the load missed one.

The sharded source is train_pool/distributed.py's GatheredSource over an unsharded model (world size 1: it hands on the
parameters as they are, through the same class the FSDP recipe publishes with)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from loomrl.train_pool.distributed import Gather, GatheredSource
from loomrl.weights.fingerprint import Fingerprint, WeightMismatch, check, fingerprint_of, pick
from loomrl.weights.group import describe
from loomrl.weights.source import DictSource
from loomrl.weights.transports import make_publisher


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def _receive(payloads, out) -> None:
    """An engine's receiving process (the built-in engine's, engine/actor.py WeightGate): every version whole, and the
    sums that followed it."""
    from loomrl.weights.group import Receiver

    receiver = Receiver()
    for payload in iter(payloads.get, None):
        out.put(receiver.receive_all(payload, torch.device("cpu")))


@pytest.mark.integration  # starts a process
def test_a_sharded_trainers_sums_follow_its_broadcast_and_catch_a_load_that_missed():
    ctx = mp.get_context("spawn")
    payloads, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receive, args=(payloads, out), daemon=True)
    child.start()
    model = _model()
    pub = make_publisher("broadcast", dtype=torch.bfloat16, bucket_bytes=256, timeout_s=60)
    try:
        handle = pub.publish(GatheredSource(model, Gather(dtype="bfloat16", bucket_bytes=256), keep=True), 3)
        assert handle.fingerprint is not None and handle.fingerprint.follows and not handle.fingerprint.sums
        assert handle.payload["trailer"] == pick([n for n, _ in model.named_parameters()])
        payloads.put(handle.payload)
        pub.settle()
        weights, followed = out.get(timeout=60)
    finally:
        payloads.put(None)
        pub.close()
        child.join(30)
    want = fingerprint_of({n: p.detach() for n, p in model.named_parameters()}, dtype=torch.bfloat16)
    assert followed == want.sums  # exactly the trainer's sums, in the published dtype and shapes
    engine = fingerprint_of(weights, Fingerprint(sums=followed))  # an engine that loaded everything it received
    assert check("builtin", 3, handle.fingerprint, Fingerprint(sums=engine.sums, published=followed), 3) == 6
    missed = {**weights, "1.weight": torch.zeros_like(weights["1.weight"])}  # a load that never reached one tensor
    actual = fingerprint_of(missed, Fingerprint(sums=followed))
    with pytest.raises(WeightMismatch, match=r"engine builtin did not load version 3 as published: 1 of 6 fingerprinted "
                                             r"tensors differ \(1\.weight\); 1\.weight: published sum [-\d.e]+, weighted "
                                             r"[-\d.e]+; the engine's sum 0\.0, weighted 0\.0$"):
        check("builtin", 3, handle.fingerprint, Fingerprint(sums=actual.sums, published=followed), 3)


def test_an_engine_that_reports_no_followed_sums_is_logged_as_not_checked(caplog):
    """An engine that cannot report the sums that followed (an SGLang server, an external vLLM) is not checked, and
    says so once; the version still is."""
    with caplog.at_level("WARNING", logger="loomrl.weights.fingerprint"):
        assert check("sglang-x", 1, Fingerprint(follows=True), Fingerprint(unchecked="a server reports none"), 1) == 0
    assert "the publisher's sums follow the weights and the engine did not report them (a server reports none)" in \
        caplog.text
    with pytest.raises(WeightMismatch, match="serves version 0 after loading version 1"):
        check("sglang-x", 1, Fingerprint(follows=True), Fingerprint(), 0)


def test_only_the_buckets_wire_carries_sums_after_the_weights():
    """SGLang's "tensors" wire takes exactly the tensors it names: no sums follow there."""
    source = DictSource({"w": torch.ones(2)})
    assert describe(source)["trailer"] == []
    with pytest.raises(ValueError, match="carries no sums"):
        describe(source, "tensors", ["w"])
