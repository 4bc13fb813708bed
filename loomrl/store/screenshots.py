"""A web episode's screenshots as JPEG files beside its trajectory store, and its env_record as the store keeps it.

A web environment with `env.args.screenshots: true` leaves a base64 JPEG per observation in the trajectory's
env_record (`screenshots`: the first after reset, then one per executed action). They are 11-20 KB each at 1280x720
quality 50 on the shop (measured), ~0.3 MB of base64 for a 12-turn episode: kept inside the parquet row, one part of
64 trajectories would grow by ~18 MB and opening one trajectory reads its whole row group. So the store writes them as
files, `<store>/_screenshots/<trajectory_id>/<i>.jpg` (raw JPEG, a quarter smaller than base64), and keeps the rest of
the env_record (solved, reason, url, ...) in its `env_record` column as JSON with `screenshots` replaced by their count.

What it is not: a reader of parts (store_index.py in the viewer reads the column) or a place for other binary data.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

SCREENSHOTS = "screenshots"  # the env_record key the environment fills
# The folder inside a store: parquet readers given the store folder (pyarrow, pandas, Spark) skip names starting with
# "_", so the parts still read as one table; a folder beside the store would read as an evaluation store instead.
FOLDER = "_screenshots"
# A trajectory id names its folder as it is when it is made of these (the rollout worker's `traj-<hex>`); any other id
# (a black-box agent's session id is the client's) by its hash, so that no id can name a path outside the folder.
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def screenshot_path(store: Path, trajectory_id: str, index: int) -> Path:
    """Where the store keeps screenshot `index` (0: after reset) of one trajectory."""
    if index < 0:
        raise ValueError(f"screenshot index {index} is negative")
    folder = trajectory_id if _SAFE_ID.match(trajectory_id) else hashlib.sha256(trajectory_id.encode()).hexdigest()
    return Path(store) / FOLDER / folder / f"{index:04d}.jpg"


def stored_env_record(store: Path, trajectory_id: str, record: dict[str, Any] | None) -> str | None:
    """The env_record as the store's `env_record` column keeps it (JSON, its screenshots replaced by their count),
    after writing each screenshot to its file; None for a trajectory without one."""
    if record is None:
        return None
    shots = record.get(SCREENSHOTS) or []
    for i, shot in enumerate(shots):
        path = screenshot_path(store, trajectory_id, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot))  # before the part that names them: a reader never misses one
    kept = {k: v for k, v in record.items() if k != SCREENSHOTS}
    if shots:
        kept[SCREENSHOTS] = len(shots)
    return json.dumps(kept, default=str)  # a value that is not JSON is kept as its text: never a failed store write


def read_env_record(value: str | None) -> dict[str, Any] | None:
    """A stored `env_record` value as a dict (None: none stored, or a part written before the column)."""
    return None if not value else json.loads(value)
