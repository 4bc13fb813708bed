"""engine.sleep_while_training (colocated GPUs): the driver puts the engines to sleep around every training step
and only then. The engines' memory cannot be freed on this CPU machine (the built-in engine's sleep is a no-op),
so the run records the order of the real local parts' calls and checks
it; the run itself, its trainer and engine are real."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_checks import check_run

from loomrl.config import load_config
from loomrl.runtime.local import local_parts
from loomrl.runtime.parts import Parts
from loomrl.runtime.run import train

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


def recording(calls: list[str]):
    """The real local parts, each call the test watches recorded in `calls` (in the order the driver makes them)."""

    def make(cfg, checkpoint) -> Parts:
        parts = local_parts(cfg, checkpoint)
        rollouts, trainer, route = parts.rollouts, parts.trainer, parts.weights
        sleep, wake, train_step, publish = rollouts.sleep, rollouts.wake, trainer.train_step, route.publish

        async def sleeping() -> None:
            calls.append("sleep")
            await sleep()

        async def waking() -> None:
            calls.append("wake")
            await wake()

        async def training():
            step = await train_step()
            calls.append("train" if step is not None else "nothing")
            return step

        async def publishing(version: int, weights) -> None:
            calls.append("publish")
            await publish(version, weights)

        rollouts.sleep, rollouts.wake, trainer.train_step, route.publish = sleeping, waking, training, publishing
        return parts

    return make


def test_engines_sleep_through_each_training_step_and_only_then(tmp_path):
    for mode in ("async", "sync"):
        cfg = load_config(RECIPE, [f"output_dir={tmp_path}", f"name={mode}", "progress=false", "eval.n_tasks=0",
                                   "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=3",
                                   "checkpoint_every=0", f"runtime.mode={mode}", "engine.sleep_while_training=true"])
        calls: list[str] = []
        summary = train(cfg, parts=recording(calls))
        assert summary["steps"] == 3
        # the engine asleep while the trainer starts (loads, publishes, offloads its state), then the start's weights;
        # then every step: sleep, train, wake, the new weights; never a sleep for a step that was not due (the driver
        # asks the trainer first)
        assert calls == ["sleep", "wake", "publish"] + ["sleep", "train", "wake", "publish"] * 3, (mode, calls)
        check_run(cfg.run_dir, summary, 3)
