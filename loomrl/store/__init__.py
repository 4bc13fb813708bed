"""Append-only trajectory store (parquet)."""

from loomrl.store.schema import plain_row, stored_turns
from loomrl.store.trajectory_store import TrajectoryStore, read_rows, read_trajectories

__all__ = ["TrajectoryStore", "plain_row", "read_rows", "read_trajectories", "stored_turns"]
