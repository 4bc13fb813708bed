"""A comparison's plan, fixed before any run starts: the recipe, the arms, the metric, the margin, the seeds, and the
looks (how many seeds' results the decision may be taken at), and the loomrl that runs them.

The plan is written to COMPARE/plan.json by the first `loomrl compare` and every later one must ask for the same plan:
that is what resumes it. Adding seeds after looking at the results is refused, because stopping when a difference
looks good inflates the false-discovery rate; a design that wants to stop early says so in advance with its looks
(a group-sequential design: each decision is taken at confidence 1 - alpha / (looks x arms compared), Bonferroni, so
the chance of any wrong decision stays within alpha whichever look stops it and however many arms there are;
stats.py). A recipe edited since the plan was fixed, or another loomrl (another commit), is refused too, and so is a
folder that holds runs but no plan (a plan.json deleted to start over on the same runs). A new comparison of the same
arms after looking at one starts from fresh seeds (--first-seed): rerunning the seeds already seen would only repeat
what was seen, since a run is a function of its config and seed.

What it is not: the runs (runner.py) or the statistics (stats.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loomrl.run_folder import RunFolder

MIN_SEEDS = 3


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
    loomrl: str = ""  # the loomrl that runs it: its version and, in a git checkout, its commit

    def __post_init__(self) -> None:
        if len(self.arms) < 2:
            raise PlanError(f"a comparison needs at least two arms (--arm NAME [OVERRIDE ...]); got {list(self.arms)}")
        if not self.margin > 0:
            raise PlanError(f"--margin must be > 0 (the difference that matters), got {self.margin}")
        # three pairs at least: from two, the spread of the differences has one degree of freedom, and a success
        # rate's steps can make it 0
        if len(self.seeds) < MIN_SEEDS or len(set(self.seeds)) != len(self.seeds):
            raise PlanError(f"--seeds: at least {MIN_SEEDS} distinct seeds, got {self.seeds}")
        if sorted(set(self.looks)) != self.looks or any(not MIN_SEEDS <= k <= len(self.seeds) for k in self.looks):
            raise PlanError(f"--looks: increasing seed counts between {MIN_SEEDS} and {len(self.seeds)}, "
                            f"got {self.looks}")
        if not 0.5 < self.confidence < 1:
            raise PlanError(f"--confidence must be in (0.5, 1), got {self.confidence}")

    @property
    def checkpoints(self) -> list[int]:
        """The seed counts at which the decision is taken: the looks, and always all the seeds."""
        return sorted({*self.looks, len(self.seeds)})

    @property
    def look_confidence(self) -> float:
        """The confidence of each interval: 1 - alpha / (looks x arms compared with the baseline), alpha split over
        every decision the design may take (Bonferroni), so the chance of any wrong decision stays within alpha."""
        return 1 - (1 - self.confidence) / (len(self.checkpoints) * (len(self.arms) - 1))

    @property
    def baseline(self) -> str:
        return next(iter(self.arms))


def recipe_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        raise PlanError(f"cannot read the recipe {path}: {err}") from err


def loomrl_build() -> str:
    """This loomrl: its version and, where it runs from a git checkout, the commit (a dirty tree marked)."""
    import subprocess

    import loomrl

    root = Path(loomrl.__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "loomrl"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return loomrl.__version__
    if head.returncode != 0:
        return loomrl.__version__
    return f"{loomrl.__version__} {head.stdout.strip()}{' (modified)' if dirty.stdout.strip() else ''}"


def fix_plan(folder: Path, plan: ComparePlan) -> ComparePlan:
    """Write `plan` to folder/plan.json, or check it against the one there (a resumed comparison): any difference is
    refused, naming the field."""
    path = folder / "plan.json"
    if not path.exists():
        if folder.is_dir() and any(RunFolder(p).config.is_file() for p in folder.iterdir() if p.is_dir()):
            raise PlanError(f"{folder} holds runs but no plan.json: a comparison's plan is fixed before its runs. "
                            f"Start the comparison in a new folder (--out)")
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
            f"refused (it inflates false discoveries). A sequential design says so from the start (--looks); to "
            f"compare again, start a new folder with fresh seeds (--first-seed {max(fixed.seeds) + 1}): the seeds "
            f"seen would only repeat what was seen")
    if changed == ["loomrl"]:
        raise PlanError(f"{path} was fixed under loomrl {fixed.loomrl!r}, this is {plan.loomrl!r}: the runs so far ran "
                        f"on the other. Check that one out to resume, or start a new comparison in another folder")
    if changed == ["recipe_sha256"]:
        raise PlanError(f"{plan.recipe} changed since {path} was fixed: the runs so far used the old recipe. Restore "
                        f"it, or start a new comparison in another folder (--out)")
    raise PlanError(f"{path} was fixed with other settings ({', '.join(changed)} differ: "
                    + "; ".join(f"{n}: {getattr(fixed, n)!r} then, {getattr(plan, n)!r} now" for n in changed)
                    + "). Resume with the same command, or start a new comparison in another folder (--out)")
