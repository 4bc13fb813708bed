"""A comparison's plan, fixed before any run starts: the recipe, the arms, the metric, the margin, the seeds, and the
looks (how many seeds' results the decision may be taken at).

The plan is written to COMPARE/plan.json by the first `loomrl compare` and every later one must ask for the same plan:
that is what resumes it. Adding seeds after looking at the results is refused, because stopping when a difference
looks good inflates the false-discovery rate; a design that wants to stop early says so in advance with its looks
(a group-sequential design: each look decides at confidence 1 - alpha / looks, Bonferroni, so the overall error stays
within alpha whichever look stops it; stats.py). A recipe edited since the plan was fixed is refused too.

What it is not: the runs (runner.py) or the statistics (stats.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


class PlanError(ValueError):
    """A plan that cannot be run as asked, with what to do instead."""


@dataclass(frozen=True)
class ComparePlan:
    recipe: str  # the recipe's path
    arms: dict[str, list[str]]  # name -> its overrides; the first arm is the baseline every other is compared with
    metric: str  # a held-out split's success after training (heldout, heldout_templates), or success_after
    margin: float  # differences within +-margin count as equivalent
    seeds: list[int]  # every seed the design may run (paired: each arm runs each seed)
    looks: list[int] = field(default_factory=list)  # seed counts at which to decide; [] = once, after all seeds
    common: list[str] = field(default_factory=list)  # overrides for every arm
    confidence: float = 0.95
    recipe_sha256: str = ""  # the recipe's text when the plan was fixed

    def __post_init__(self) -> None:
        if len(self.arms) < 2:
            raise PlanError(f"a comparison needs at least two arms (--arm NAME [OVERRIDE ...]); got {list(self.arms)}")
        if not self.margin > 0:
            raise PlanError(f"--margin must be > 0 (the difference that matters), got {self.margin}")
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise PlanError(f"--seeds: at least two distinct seeds (a standard error needs two), got {self.seeds}")
        if sorted(set(self.looks)) != self.looks or any(not 2 <= k <= len(self.seeds) for k in self.looks):
            raise PlanError(f"--looks: increasing seed counts between 2 and {len(self.seeds)}, got {self.looks}")
        if not 0.5 < self.confidence < 1:
            raise PlanError(f"--confidence must be in (0.5, 1), got {self.confidence}")

    @property
    def checkpoints(self) -> list[int]:
        """The seed counts at which the decision is taken: the looks, and always all the seeds."""
        return sorted({*self.looks, len(self.seeds)})

    @property
    def look_confidence(self) -> float:
        """The confidence of each look's intervals: 1 - alpha / looks (alpha split over the looks)."""
        return 1 - (1 - self.confidence) / len(self.checkpoints)

    @property
    def baseline(self) -> str:
        return next(iter(self.arms))


def recipe_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        raise PlanError(f"cannot read the recipe {path}: {err}") from err


def fix_plan(folder: Path, plan: ComparePlan) -> ComparePlan:
    """Write `plan` to folder/plan.json, or check it against the one there (a resumed comparison): any difference is
    refused, naming the field."""
    path = folder / "plan.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(plan), indent=2) + "\n")
        return plan
    fixed = ComparePlan(**json.loads(path.read_text()))
    if fixed == plan:
        return fixed
    changed = [name for name in asdict(plan) if getattr(plan, name) != getattr(fixed, name)]
    if "seeds" in changed and plan.seeds[: len(fixed.seeds)] == fixed.seeds and len(plan.seeds) > len(fixed.seeds):
        raise PlanError(
            f"{path} fixed {len(fixed.seeds)} seeds before any run; adding seeds after looking at the results is "
            f"refused (it inflates false discoveries). To allow stopping early, plan a sequential design from the "
            f"start in a new folder, e.g. --seeds {len(plan.seeds)} --looks {len(fixed.seeds)}")
    if changed == ["recipe_sha256"]:
        raise PlanError(f"{plan.recipe} changed since {path} was fixed: the runs so far used the old recipe. Restore "
                        f"it, or start a new comparison in another folder (--out)")
    raise PlanError(f"{path} was fixed with other settings ({', '.join(changed)} differ: "
                    + "; ".join(f"{n}: {getattr(fixed, n)!r} then, {getattr(plan, n)!r} now" for n in changed)
                    + "). Resume with the same command, or start a new comparison in another folder (--out)")
