"""The default sinks' output: TensorBoard tags read back from the event file, metrics.jsonl's keys."""

from __future__ import annotations

import struct

from tensorboardX.proto.event_pb2 import Event

from loomrl.config.metrics import MetricsConfig
from loomrl.metrics import open_metrics, read_metrics


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the TFRecord event files in `folder` (8-byte length, its crc, the record, its
    crc; tensorboard itself is not installed here)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12: at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tags_are_the_metric_names_and_the_jsonl_keeps_its_keys(tmp_path):
    logger = open_metrics(tmp_path, MetricsConfig())
    logger.log(0, {"eval/success": 0.25, "eval/heldout/success": 0.5}, kind="eval_before")
    logger.log(1, {"train/loss": 0.5, "rollout/reward_mean": 0.125, "groups": 2})
    logger.log(2, {"eval/success": 0.75}, kind="eval_after")
    logger.rollback(1, "resume")
    logger.close()
    tags = _scalars(tmp_path / "tensorboard")
    # a metric's own namespace is its tag (no `train/train/loss`); held-out success is one curve over the steps
    assert tags == {"eval/success": [(0, 0.25), (2, 0.75)], "eval/heldout/success": [(0, 0.5)],
                    "train/loss": [(1, 0.5)], "rollout/reward_mean": [(1, 0.125)], "train/groups": [(1, 2.0)]}
    records = read_metrics(tmp_path)
    assert [sorted(set(r) - {"kind", "step", "time"}) for r in records] == [
        ["eval/heldout/success", "eval/success"], ["groups", "rollout/reward_mean", "train/loss"], ["eval/success"],
        ["reason"]]
