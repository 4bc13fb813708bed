"""Environments (message space, async) and the sandboxes their tools run in."""

from loomrl.env.base import Env, EnvCrash, Observation, StepResult, ToolTimeout

__all__ = ["Env", "EnvCrash", "Observation", "StepResult", "ToolTimeout"]
