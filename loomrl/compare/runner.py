"""Running a comparison: every arm on every seed of the plan, seed by seed (so each look has whole pairs), each a run
folder COMPARE/<arm>-seed<seed> that `loomrl view COMPARE` shows side by side; a run already finished is read, one
interrupted is resumed, so the same command continues a comparison that stopped. At each look (plan.py) the paired
statistics decide (stats.py); the design stops at the first look where every arm is decided, else after all seeds.
The report is COMPARE/report.json and report.md.

A run that stops with an error stops the comparison (its folder says why): a missing pair would bias the paired
difference, and an infrastructure failure is no result.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from loomrl.compare.plan import ComparePlan, PlanError
from loomrl.compare.stats import UNDECIDED, ArmSummary, Difference, difference, summarize
from loomrl.run_folder import RunFolder


@dataclass(frozen=True)
class Measured:
    """One run's metric, and how many tasks it is a rate over (its resolution is 1/n; None: not a rate)."""

    value: float
    n: int | None = None


# (arm name, its overrides including the seed and the folder) -> the metric of that run
RunArm = Callable[[str, list[str]], Measured]


@dataclass(frozen=True)
class Report:
    plan: ComparePlan
    values: dict[str, list[float]]  # by arm, in seed order
    arms: list[ArmSummary]
    differences: list[Difference]
    look: int  # the seeds the decision was taken at
    stopped_early: bool

    def as_json(self) -> dict:
        return {"plan": asdict(self.plan), "values": self.values, "arms": [asdict(a) for a in self.arms],
                "differences": [asdict(d) for d in self.differences], "look": self.look,
                "stopped_early": self.stopped_early}

    def text(self) -> str:
        p = self.plan
        lines = [f"# compare: {p.metric} over {self.look} of {len(p.seeds)} planned seeds (paired by seed)"
                 + (" - stopped early at a planned look" if self.stopped_early else ""),
                 f"margin {p.margin}, {p.confidence:.0%} overall confidence"
                 + (f" ({p.look_confidence:.2%} per interval: alpha split over looks and arms)"
                    if p.look_confidence != p.confidence else ""), "",
                 "| arm | n | mean | stderr |", "|---|---|---|---|"]
        lines += [f"| {a.name} | {a.n} | {a.mean:.4f} | {_num(a.stderr)} |" for a in self.arms]
        lines += ["", f"| arm - {p.baseline} | mean | stderr | interval | decision |", "|---|---|---|---|---|"]
        lines += [f"| {d.arm} | {d.mean:+.4f} | {_num(d.stderr)} | [{d.low:+.4f}, {d.high:+.4f}] | **{d.decision}** |"
                  for d in self.differences]
        return "\n".join(lines) + "\n"


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"


def analyse(plan: ComparePlan, values: dict[str, list[float]], look: int, *, resolution: float = 0.0) -> Report:
    """The report of the first `look` seeds' results (not stopped early); `resolution`: the metric's step
    (stats.difference)."""
    base = values[plan.baseline][:look]
    diffs = [difference(arm, plan.baseline, values[arm][:look], base, confidence=plan.look_confidence,
                        margin=plan.margin, resolution=resolution) for arm in plan.arms if arm != plan.baseline]
    return Report(plan=plan, values={a: v[:look] for a, v in values.items()},
                  arms=[summarize(a, values[a][:look]) for a in plan.arms], differences=diffs, look=look,
                  stopped_early=False)


def run_comparison(plan: ComparePlan, folder: Path, run_arm: RunArm, progress: Callable[[str], None] = print) -> Report:
    """Run the plan (resuming what is there) and decide at its looks; writes and returns the report."""
    values: dict[str, list[float]] = {arm: [] for arm in plan.arms}
    counts: list[int] = []
    report = None
    for look in plan.checkpoints:
        for seed in plan.seeds[len(values[plan.baseline]) : look]:
            for arm, overrides in plan.arms.items():
                got = run_arm(arm, [*plan.common, *overrides, f"seed={seed}", f"output_dir={folder}",
                                    f"name={arm}-seed{seed}"])
                values[arm].append(got.value)
                counts += [got.n] if got.n else []
                progress(f"compare: {arm} seed {seed}: {plan.metric} = {got.value:.4f}")
        last = look == len(plan.seeds)
        resolution = 1 / min(counts) if counts else 0.0
        report = analyse(plan, values, look, resolution=resolution)
        if not last and all(d.decision != UNDECIDED for d in report.differences):
            report = replace(report, stopped_early=True)
            break
        if not last:
            progress(f"compare: look at {look} seeds: undecided, going on to the next planned look")
    assert report is not None  # checkpoints is never empty
    (folder / "report.json").write_text(json.dumps(report.as_json(), indent=2) + "\n")
    (folder / "report.md").write_text(report.text())
    return report


def run_folders(path: Path) -> list[Path]:
    """The run folders a path stands for in `loomrl view`: a comparison's folder (it holds plan.json), its arms' runs
    (those set aside as incomplete left out); any other path, itself."""
    if not (path / "plan.json").is_file():
        return [path]
    return sorted(p for p in path.iterdir()
                  if p.is_dir() and RunFolder(p).config.is_file() and ".incomplete-" not in p.name)


def metric_of(summary: dict, metric: str, where: str) -> Measured:
    """The metric from a run's summary.json: success_after, or a held-out split's success after training."""
    n = None
    if metric == "success_after":
        value, n = summary.get("success_after"), summary.get("n_heldout")
    else:
        split = summary.get("heldout_splits", {}).get(metric)
        if split is None:
            raise PlanError(f"{where}: no held-out split {metric!r} in its summary (splits: "
                            f"{sorted(summary.get('heldout_splits', {}))}); --metric is success_after or a split")
        value, n = split.get("success_after"), split.get("n")
    if value is None:
        raise PlanError(f"{where}: {metric} has no value after training (was eval.n_tasks 0?)")
    return Measured(float(value), int(n) if n else None)


def train_arm(recipe: str, metric: str, progress: Callable[[str], None] = print) -> RunArm:
    """Runs an arm's seed with `loomrl train` in this process (the recipe's backend: local, or Ray), resuming a run
    folder that did not finish; a finished one is only read."""
    from loomrl.config import load_config
    from loomrl.runtime.run import train
    from loomrl.runtime.summary import finished_at
    from loomrl.trainer.checkpoint import latest_checkpoint

    def run(arm: str, overrides: list[str]) -> Measured:
        cfg = load_config(recipe, overrides)
        folder = cfg.run_dir
        if finished_at(folder) is None:
            resume = latest_checkpoint(folder) is not None
            if not resume and folder.exists():  # stopped before its first checkpoint: kept aside, run again
                folder.rename(folder.with_name(f"{folder.name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}"))
            train(cfg, resume=resume)
        summary = json.loads(RunFolder(folder).summary.read_text())
        if summary.get("ended") != "finished":
            raise PlanError(f"{folder} ended {summary.get('ended')!r}: fix the cause and rerun the same command")
        if summary.get("not_reproducible"):  # common random numbers hold only as far as the runs are exact
            progress(f"compare: {folder.name} is not exact ({'; '.join(summary['not_reproducible'])}): the arms share "
                     "their noise only in part, and the pairing helps less")
        return metric_of(summary, metric, str(folder))

    return run
