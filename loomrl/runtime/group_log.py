"""GroupLog: RUN/groups.jsonl, one line per group attempt that ended, for the viewer's timeline (loomrl/view/).

A line: the data position, the attempt's number, its group id and trajectory ids, when it was admitted (launched)
and when it came back (wall-clock seconds, time.time()), the policy version when it was admitted and the versions
its tokens were sampled by (min, max), and how it ended (`arrived`: stored and handed to the trainer; `superseded`:
stored, not trained (a trainer restart or newer weights raced it); `unconsumed`: it came back after the last
step; `lost`: its worker died). The step that trained or left out each trajectory is in ledger.jsonl; the viewer
joins the two by trajectory id.
Where the time went (a line with members only): `slowest`, the split of the member that took longest, in seconds:
`reset_s` (env.reset: a sandbox leased and set up), `gen_s` (its turns' generation, engine queueing included), `env_s`
(its turns' env.step: tool calls) and `reward_s` (scoring). The slowest member's, not a sum: members run at once, and
the group comes back when its slowest is scored, so that member's split is what the group's time was spent on. Lines
written before these fields existed lack them (the viewer draws those bars whole).
Cheap by design: one short line per group, written as the group settles, nothing per token.
What it is not: an accounting record (accounting.py and the ledger are), or read by anything but the viewer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from loomrl.run_folder import RunFolder
from loomrl.types import Trajectory


class GroupLog:
    def __init__(self, run_dir: Path):
        self.path = RunFolder(run_dir).groups
        self._launched: dict[int, tuple[float, int]] = {}  # serial -> (admitted at, version then)

    def launched(self, serial: int, version: int) -> None:
        self._launched[serial] = (time.time(), version)

    def ended(self, serial: int, position: int, attempt: int, how: str, group: list[Trajectory] | None = None) -> None:
        at, version = self._launched.pop(serial, (None, None))
        group = group or []
        line = {"position": position, "attempt": attempt, "ended": how, "launched": at, "finished": time.time(),
                "version_at_launch": version, "group_id": group[0].group_id if group else None,
                "policy_version_min": min((t.metadata.policy_version_min for t in group), default=-1),
                "policy_version_max": max((t.metadata.policy_version_max for t in group), default=-1),
                "trajectory_ids": [t.trajectory_id for t in group]}
        if group:
            line["slowest"] = max((time_split(t) for t in group), key=lambda split: sum(split.values()))
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def time_split(t: Trajectory) -> dict[str, float]:
    """Where one trajectory's time went (its last attempt's): env reset, generation, tool calls, scoring."""
    turns = t.all_turns()
    return {"reset_s": t.metadata.reset_s, "gen_s": sum(turn.gen_s for turn in turns),
            "env_s": sum(turn.env_s for turn in turns), "reward_s": t.metadata.reward_s}
