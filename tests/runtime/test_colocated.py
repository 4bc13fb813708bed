"""engine.sleep_while_training (colocated GPUs): the driver puts the engines to sleep around every training step
and only then. The engines' memory cannot be freed on this CPU machine (the built-in engine's sleep is a no-op),
so the run records the order of the real backend's calls (a LocalBackend subclass that logs them) and checks
it; the run itself, its trainer and engine are real."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_checks import check_run

from loomrl.config import load_config
from loomrl.runtime.local import LocalBackend
from loomrl.runtime.run import train

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


class Recording(LocalBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def sleep_engines(self) -> None:
        self.calls.append("sleep")
        await super().sleep_engines()

    async def wake_engines(self) -> None:
        self.calls.append("wake")
        await super().wake_engines()

    async def train_step(self):
        metrics = await super().train_step()
        self.calls.append("train" if metrics is not None else "nothing")
        return metrics

    async def publish(self, version: int) -> None:
        self.calls.append("publish")
        await super().publish(version)


def test_engines_sleep_through_each_training_step_and_only_then(tmp_path):
    for mode in ("async", "sync"):
        cfg = load_config(RECIPE, [f"output_dir={tmp_path}", f"name={mode}", "progress=false", "eval.n_tasks=0",
                                   "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=3",
                                   "checkpoint_every=0", f"runtime.mode={mode}", "engine.sleep_while_training=true"])
        backend = Recording(cfg, None)
        summary = train(cfg, backend=backend)
        assert summary["steps"] == 3
        # the engine asleep while the trainer starts (loads, publishes, offloads its state), then the start's weights;
        # then every step: sleep, train, wake, the new weights; never a sleep for a step that was not due (the driver
        # asks the trainer first)
        assert backend.calls == ["sleep", "wake", "publish"] + ["sleep", "train", "wake", "publish"] * 3, (
            mode, backend.calls)
        check_run(cfg.run_dir, summary, 3)
