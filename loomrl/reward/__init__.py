"""Reward functions and the reward pool that runs them off the rollout path."""

from loomrl.reward.calculator import calculator_reward
from loomrl.reward.pool import RewardPool, import_reward

__all__ = ["RewardPool", "calculator_reward", "import_reward"]
