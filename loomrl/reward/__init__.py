"""Reward functions and the reward pool that runs them off the rollout path.

RewardPool and import_reward are imported on first use: a reward worker process (reward/workers.py) imports this
package and needs neither (nor loomrl.config, which they bring: 1.6 s of a worker's start on a 2-core machine).
"""

from __future__ import annotations

from typing import Any

from loomrl.reward.calculator import calculator_reward

__all__ = ["RewardPool", "calculator_reward", "import_reward"]


def __getattr__(name: str) -> Any:
    if name in ("RewardPool", "import_reward"):
        from loomrl.reward import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'loomrl.reward' has no attribute {name!r}")
