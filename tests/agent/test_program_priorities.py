"""Seer's ordering for multi-turn programs (runtime.schedule=seer): probes first, then the groups
estimated longest; and what it does to a real run through the built-in engine."""

from __future__ import annotations

import pytest

from loomrl.agent.priorities import ProgramPriorities

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`


def test_probe_goes_first_then_longest_estimate_first():
    p = ProgramPriorities(budget_tokens=96)
    # Group A: a0 is its probe; a1 waits behind every probe, at the conservative budget estimate.
    assert p.priority("A", "a0") < p.priority("B", "b0") < p.priority("A", "a1")
    assert p.priority("A", "a1") == -96 == p.priority("B", "b1")
    p.generated("A", "a0", 10)
    p.generated("A", "a0", 5)  # a second turn: the program's length is summed over its calls
    p.generated("B", "b0", 40)
    p.finished("A", "a0")
    p.finished("B", "b0")
    assert p.estimate("A") == 15 and p.estimate("B") == 40
    # Both groups probed: B (longer) before A; probes no longer jump the queue.
    assert p.priority("B", "b1") < p.priority("A", "a1")
    assert p.priority("A", "a0") == -15
    # A partial sibling longer than the finished probe raises the estimate (a lower bound).
    p.generated("A", "a1", 60)
    assert p.estimate("A") == 60 and p.priority("A", "a2") == -60
    p.forget("A")
    assert p.estimate("A") == 96  # a group seen anew starts unprobed
    # A probe that fails is no evidence: the group stays unprobed and the next program probes it.
    assert p.priority("C", "c0") < p.priority("C", "c1") == -96
    p.generated("C", "c0", 3)
    p.abandoned("C", "c0")
    assert p.estimate("C") == 96 and p.priority("C", "c1") < -96  # c1 is now the probe
    with pytest.raises(ValueError, match="budget_tokens"):
        ProgramPriorities(0)


def test_seer_and_capped_runs_train_and_keep_within_the_cap(tmp_path):
    """A sync run with schedule=seer and a cap of one group in flight: it trains, and never more than
    one group's programs run at once (counted around the real rollout)."""
    from loomrl.config import load_config
    from loomrl.metrics.logger import read_metrics
    from loomrl.rollout import worker as rollout
    from loomrl.runtime.run import train

    recipe = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
    cfg = load_config(recipe, [f"output_dir={tmp_path}", "progress=false", "name=seer", "runtime.mode=sync",
                               "runtime.schedule=seer", "trainer.total_steps=2", "eval.n_tasks=6",
                               "runtime.max_inflight_trajectories=4",
                               "reward.function=rewards_for_tests:parity_reward"])
    assert cfg.trainer.group_size == 4 and cfg.trainer.groups_per_step >= 2  # the cap binds
    live = {"now": 0, "peak": 0}
    original = rollout.RolloutWorker.run_one

    async def counted(self, *args, **kwargs):
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        try:
            return await original(self, *args, **kwargs)
        finally:
            live["now"] -= 1

    rollout.RolloutWorker.run_one = counted
    try:
        summary = train(cfg)
    finally:
        rollout.RolloutWorker.run_one = original
    assert summary["steps"] == 2
    assert live["peak"] == 4
    rows = [r for r in read_metrics(cfg.run_dir) if r.get("kind") == "train"]
    waits = [r["rollout/cap_wait_s_total"] for r in rows]  # cumulative: the second group waits each step
    assert waits[0] > 0 and all(b > a for a, b in zip(waits, waits[1:]))
    assert all(r["time/rollout_s"] > 0 and r["time/train_s"] > 0 and r["engine/busy_s"] > 0 for r in rows)
