"""Append-only trajectory store (parquet)."""

from loomrl.store.trajectory_store import TrajectoryStore, read_trajectories

__all__ = ["TrajectoryStore", "read_trajectories"]
