"""Agent loops that turn an Env and an Engine into trajectories."""

from loomrl.agent.loop import AgentLoop

__all__ = ["AgentLoop"]
