"""Weight fingerprints (loomrl/weights/fingerprint.py): the publisher's, taken from the buckets it sends, equals one taken
from the whole state dict in the same dtype; a built-in engine that loaded what was published confirms it; one whose
transport lost or changed part of a version stops with WeightMismatch naming the engine, the version and the tensors.
The faulty transports are test doubles (a queue publisher that drops a bucket, a loader that flips a tensor): no real
transport loses data here, which is the point of the check."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loomrl.config import ModelConfig
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.model.loader import load_model
from loomrl.weights.fingerprint import WeightMismatch, confirm_weights, fingerprint_of, pick
from loomrl.weights.handle import Transport, WeightHandle, nbytes
from loomrl.weights.queue import QueuePublisher
from loomrl.weights.source import WeightSource
from loomrl.weights.transports import load_weights, make_publisher

BUCKET_BYTES = 40_000  # the tiny model's small tensors in a few buckets each; the embedding a bucket alone


@pytest.fixture
def tiny():
    """A fresh tiny model (its engine loads into it) and the next version: every parameter moved."""
    model, tokenizer = load_model(ModelConfig(kind="tiny"))
    trained = {n: p.detach() + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    return model, tokenizer, trained


class DropsABucket(QueuePublisher):
    """Test double of the queue transport: the publisher reads (and fingerprints) every bucket, but the handle
    carries all but the bucket holding `lost`, as a transport that lost one would."""

    def __init__(self, lost: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.lost = lost

    def _snapshot(self, source: WeightSource, version: int) -> tuple[Any, WeightHandle]:
        payload = {}
        for bucket in source.buckets():
            if self.lost not in {name for name, _ in bucket}:
                payload.update({name: t.clone() for name, t in bucket})
        return None, WeightHandle(transport=self.transport, version=version, nbytes=nbytes(payload), payload=payload)


@pytest.mark.parametrize("transport", ["queue", "shm", "file"])
def test_the_fingerprint_of_a_bf16_bucket_stream_equals_the_state_dict_cast_to_bf16(transport, tiny, tmp_path):
    """float32 masters published as bfloat16, a few tensors per bucket: the handle's fingerprint, taken from the
    buckets as they were sent, is bit for bit the one of the whole state dict cast to bfloat16, and of what loads."""
    _, _, trained = tiny
    pub = make_publisher(transport, folder=tmp_path / "w", dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES)
    try:
        handle = pub.publish(trained, 1)
        assert handle.fingerprint is not None
        stream = handle.fingerprint
        assert sorted(stream.sums) == pick(list(trained)) == sorted(trained)  # 20 tensors: all of them
        assert {s.dtype for s in stream.sums.values()} == {"bfloat16"}
        whole = fingerprint_of({n: t.bfloat16() for n, t in trained.items()})
        assert whole == stream
        assert fingerprint_of(trained, dtype=torch.bfloat16) == stream  # cast inside: the same values
        assert fingerprint_of(load_weights(handle).weights, stream) == stream
        assert fingerprint_of(trained) != stream  # float32 values are other values
    finally:
        pub.close()


def test_matching_fingerprints_confirm_the_version(tiny, tokenizer):
    """A version loaded whole (shm, bfloat16 engine from float32 masters) is confirmed: every tensor compared."""
    model, _, trained = tiny
    model.to(torch.bfloat16)
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    pub = make_publisher("shm", dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES)
    try:
        handle = pub.publish(trained, 1)
        engine.update_weights(load_weights(handle).weights, 1)
        assert confirm_weights(engine, "builtin", 1, handle.fingerprint) == len(trained) == 20
    finally:
        pub.close()
        engine.close()


def test_a_transport_that_drops_a_bucket_stops_with_the_engine_named(tiny, tokenizer):
    """The bucket holding one layer norm never arrives: the engine loads the rest (load_state_dict leaves the missing
    tensors as they were), serves version 1, and the check names the engine, the version and the stale tensors."""
    model, _, trained = tiny
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    lost = "model.layers.1.post_attention_layernorm.weight"
    pub = DropsABucket(lost, bucket_bytes=BUCKET_BYTES)
    try:
        handle = pub.publish(trained, 1)
        loaded = load_weights(handle)
        assert lost not in loaded.weights and len(loaded.weights) < len(trained)
        engine.update_weights(loaded.weights, 1)
        assert engine.version == 1  # nothing else noticed
        with pytest.raises(WeightMismatch, match=r"engine builtin did not load version 1 as published: "
                                                 r"\d+ of 20 fingerprinted tensors differ \(.*post_attention_layernorm"):
            confirm_weights(engine, "builtin", 1, handle.fingerprint)
    finally:
        engine.close()


def test_a_flipped_tensor_and_a_version_never_applied_are_caught(tiny, tokenizer):
    """A loader double that negates one tensor on the way: exactly that tensor differs. An engine still on its old
    version: the version itself is refused."""
    model, _, trained = tiny
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    pub = make_publisher("queue")
    try:
        handle = pub.publish(trained, 1)
        weights = dict(load_weights(handle).weights)
        weights["model.norm.weight"] = -weights["model.norm.weight"]
        with pytest.raises(WeightMismatch, match=r"engine builtin serves version 0 after loading version 1"):
            confirm_weights(engine, "builtin", 1, handle.fingerprint)
        engine.update_weights(weights, 1)
        with pytest.raises(WeightMismatch, match=r"1 of 20 fingerprinted tensors differ \(model.norm.weight\)"):
            confirm_weights(engine, "builtin", 1, handle.fingerprint)
    finally:
        engine.close()


def test_a_handle_without_a_fingerprint_is_said_not_checked(tiny, tokenizer, caplog):
    """Nothing to compare (a handle no publisher fingerprinted): one warning naming the engine and why, not silence."""
    model, _, _ = tiny
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    try:
        handle = WeightHandle(transport=Transport.QUEUE, version=0, nbytes=0, payload={})
        with caplog.at_level("WARNING", logger="loomrl.weights.fingerprint"):
            assert confirm_weights(engine, "builtin-test", 0, handle.fingerprint) == 0
        assert "weight fingerprint not checked for engine builtin-test: its handle carries no fingerprint" in caplog.text
    finally:
        engine.close()


@pytest.mark.integration  # a process group and its broadcast thread
def test_a_broadcast_handle_carries_the_fingerprint_before_anything_is_sent(tiny):
    """Broadcast sends after publish returns (no receiver joins here): the handle's fingerprint is taken from the
    trainer's whole tensors, cast as the buckets will be, and equals the state dict's in the engine's dtype."""
    _, _, trained = tiny
    pub = make_publisher("broadcast", dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES, timeout_s=2.0)
    try:
        handle = pub.publish(trained, 1)
        assert handle.fingerprint == fingerprint_of({n: t.bfloat16() for n, t in trained.items()})
        with pytest.raises(RuntimeError, match="broadcasting the weights failed"):
            pub.settle()  # nobody joined: the send ends at its timeout
    finally:
        pub.close()
