"""Environments (message space, async), the public API to write them (docs/environments.md), and the sandboxes their
tools run in."""

from loomrl.env.api import Environment, EpisodeContext, TaskSetup, opening_messages
from loomrl.env.base import Env, EnvCrash, Observation, StepResult, ToolTimeout
from loomrl.env.tools import Tool, ToolEnv, ToolError, tool

__all__ = ["Env", "EnvCrash", "Environment", "EpisodeContext", "Observation", "StepResult", "TaskSetup", "Tool",
           "ToolEnv", "ToolError", "ToolTimeout", "opening_messages", "tool"]
