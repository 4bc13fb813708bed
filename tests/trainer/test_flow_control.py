"""Flow control at consumption: backpressure metrics (buffer depth, waiting time), the staleness
histogram, drops beyond the lag counted by reason, and exp(-lambda * lag) down-weighting."""

from __future__ import annotations

import json
import math

import torch

from loomrl.config import load_config
from loomrl.train_pool.service import TrainerService
from loomrl.types import TokenSpan, Trajectory, Turn


def group(tag: str, version: int, rewards=(0.0, 1.0)) -> list[Trajectory]:
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory(task_id=tag, trajectory_id=f"{tag}-{i}", group_id=tag, token_ids=[1, 2, 3, 4, 5],
                       prompt_ids=[1, 2], total_reward=r,
                       turns=[Turn(act_span=TokenSpan(start=2, end=5), logprobs=[-1.0] * 3, versions=[version] * 3)])
        t.metadata.policy_version_min = t.metadata.policy_version_max = version
        out.append(t)
    return out


def test_consumption_metrics_drops_and_lag_decay(tmp_path, tiny_model, tokenizer):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=flow", "model.kind=tiny", "trainer.groups_per_step=3",
                             "buffer.max_policy_lag=2", "buffer.lag_decay=0.5", "trainer.total_steps=10"])
    cfg.run_dir.mkdir(parents=True)
    service = TrainerService(cfg.train_pool(), tiny_model, tokenizer, device=torch.device("cpu"))
    service.trainer.step = 4  # the trainer is at version 4
    seen = []
    service.trainer.train_step = lambda samples, **_: seen.extend(samples) or _stats()
    for pos, (tag, v) in enumerate([("old", 1), ("lag2", 2), ("lag1", 3), ("fresh", 4)]):
        service.receive(pos, group(tag, v))
    step = service.run_step()
    metrics = step.metrics
    assert metrics["buffer/depth"] == 4 and metrics["groups_stale"] == 1  # "old" (lag 3) dropped, counted
    assert step.groups_stale == 1 and step.trained  # the typed step the driver reads
    assert service.buffer.dropped["stale"] == 1 and 0 < metrics["buffer/wait_s_max"] < 60  # received, then taken
    assert {k: v for k, v in metrics.items() if k.startswith("staleness/")} == {
        "staleness/lag_2": 1, "staleness/lag_1": 1, "staleness/lag_0": 1}
    by_group = {s.group_id: s for s in seen}
    fresh = max(by_group["fresh"].advantages, key=abs)
    assert math.isclose(max(by_group["lag1"].advantages, key=abs), fresh * math.exp(-0.5))
    assert math.isclose(max(by_group["lag2"].advantages, key=abs), fresh * math.exp(-1.0))
    assert metrics["samples_downweighted"] == 4  # two samples in each of the two lagging groups
    # the train records (the viewer's "as trained") carry the decayed advantages, which GRPO's formula alone would not
    records = {r["trajectory_id"]: r for r in map(json.loads, (cfg.run_dir / "train_records.jsonl").read_text()
                                                 .splitlines())}
    assert set(records) == {s.trajectory_id for s in seen}
    for tag, decay in (("fresh", 1.0), ("lag1", math.exp(-0.5)), ("lag2", math.exp(-1.0))):
        for i, sign in ((0, -1), (1, 1)):
            (adv,) = records[f"{tag}-{i}"]["advantages"]
            assert records[f"{tag}-{i}"]["step"] == service.version and math.isclose(adv, sign * abs(fresh) * decay)


def _stats():
    from loomrl.trainer.trainer import StepStats

    return StepStats(loss=0.0, grad_norm=0.0, clip_frac=0.0, ratio_mean=1.0, approx_kl=0.0, tokens=0, loss_tokens=0,
                     seconds=0.0, lr=0.0)


def test_window_sampler_holds_later_groups_until_the_oldest_is_in(tmp_path, tiny_model, tokenizer):
    cfg = load_config(None, [f"output_dir={tmp_path}", "name=win", "model.kind=tiny", "trainer.groups_per_step=2",
                             "buffer.sampler=window", "buffer.window=2", "buffer.max_policy_lag=9"])
    cfg.run_dir.mkdir(parents=True)
    service = TrainerService(cfg.train_pool(), tiny_model, tokenizer, device=torch.device("cpu"))
    seen = []
    service.trainer.train_step = lambda samples, **_: seen.append({s.group_id for s in samples}) or _stats()
    service.receive(1, group("p1", 0))
    service.receive(2, group("p2", 0))
    assert not service.has_step()  # position 0 is still running: the window [0, 2) holds p1, and p2 is outside
    service.receive(0, group("p0", 0))
    assert service.has_step()
    service.run_step()
    assert seen == [{"p0", "p1"}]  # the window's oldest first, then what finished inside it
    service.receive(3, group("p3", 0))
    service.run_step()
    assert seen[-1] == {"p2", "p3"}
