"""How many seeds a comparison needs: the spread of the demo's held-out-template score between independent runs
against the spread of paired differences under common random numbers (issue 48; docs/compare.md).

Workload: `loomrl compare` of the demo recipe (examples/calculator_smollm2.yaml, 40 sync steps, 150 held-out-template
tasks, greedy) with two arms, the recipe and the recipe with one change (--change, default trainer.lr=5e-5), over
--seeds seeds paired by seed. Everything is real; the comparison is resumable, so a stopped benchmark continues with
the same command (its folder: --out).

From the per-seed scores:
- independent spread s: the standard deviation of one arm's score across seeds (pooled over the arms), what separates
  two independent runs: a difference of two of them spreads with sqrt(2) s;
- paired spread s_d: the standard deviation of the seed-by-seed differences, which share tasks and sampling noise;
- rho, the correlation of the arms' scores across seeds: analytically s_d^2 = 2 s^2 (1 - rho) + (the arms' own
  variance difference), so the variance ratio 2 s^2 / s_d^2 is about 1 / (1 - rho); the printed check compares them;
- seeds to detect 0.05 (80% power, 95% two-sided): independent arms, n per arm = 2 (z_.975 + z_.8)^2 s^2 / 0.05^2;
  paired, the paired t test's n from the noncentral t (loomrl.compare.stats.seeds_needed).
With few seeds these spreads are estimates with few degrees of freedom (printed): a pilot, to choose N before the
real comparison, not a decision.

--quick: the tiny recipe, 2 sync steps, 3 seeds (a smoke test of the machinery; the tiny model scores 0, so its
spreads are 0).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import QUICK_NOTE, machine, report  # noqa: E402

from loomrl.compare.stats import seeds_needed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EFFECT = 0.05
Z = 1.959964 + 0.841621  # z_.975 + z_.8


def _sd(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def run_compare(args) -> dict:
    recipe = ROOT / "examples" / ("calculator_tiny.yaml" if args.quick else "calculator_smollm2.yaml")
    common = ["progress=false"]
    if args.quick:
        common += ["runtime.mode=sync", "trainer.total_steps=2", "eval.n_tasks=4", "checkpoint_every=2"]
    cmd = [sys.executable, "-m", "loomrl", "compare", str(recipe), "--arm", "base", "--arm", "change", args.change,
           "--metric", args.metric, "--margin", str(EFFECT), "--seeds", str(args.seeds), "--out", str(args.out),
           "--set", *common]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=not args.verbose, text=True)
    if done.returncode != 0:
        raise SystemExit(f"loomrl compare failed ({done.returncode}):\n{(done.stderr or '')[-3000:]}")
    return json.loads((args.out / "report.json").read_text())


def analyse(values: dict[str, list[float]]) -> dict:
    base, change = values["base"], values["change"]
    n = len(base)
    diffs = [c - b for b, c in zip(base, change)]
    s = math.sqrt((_sd(base) ** 2 + _sd(change) ** 2) / 2)
    s_d = _sd(diffs)
    rho = (sum((b - sum(base) / n) * (c - sum(change) / n) for b, c in zip(base, change)) / (n - 1)
           / (_sd(base) * _sd(change))) if _sd(base) > 0 and _sd(change) > 0 else float("nan")
    ratio = 2 * s * s / (s_d * s_d) if s_d > 0 else float("inf")
    independent_n = math.ceil(2 * Z * Z * s * s / EFFECT**2) if s > 0 else 2
    return {"n": n, "s": s, "s_d": s_d, "rho": rho, "ratio": ratio, "bound": 1 / (1 - rho) if rho < 1 else math.inf,
            "independent_n": max(independent_n, 2), "paired_n": seeds_needed(s_d, EFFECT), "diffs": diffs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--change", default="trainer.lr=5e-5", help="the second arm's override")
    p.add_argument("--metric", default="heldout_templates")
    p.add_argument("--out", type=Path, default=None, help="the comparison's folder (resumable)")
    p.add_argument("--verbose", action="store_true", help="show loomrl compare's output")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.out is None:
        args.out = ROOT / "runs" / ("compare-power-quick" if args.quick else "compare-power")
    if args.quick:
        import shutil

        shutil.rmtree(args.out, ignore_errors=True)  # a smoke test starts over
    rep = run_compare(args)
    a = analyse(rep["values"])
    lines = [f"{arm}: " + ", ".join(f"{v:.3f}" for v in vals) for arm, vals in rep["values"].items()]
    report({
        "machine": machine(),
        "note": QUICK_NOTE if args.quick else "real runs of the demo recipe, paired by seed",
        "workload": f"{'calculator_tiny (2 steps)' if args.quick else 'calculator_smollm2 (the demo)'}, arms base and "
                    f"{args.change}, {a['n']} seeds, metric {args.metric}",
        "independent spread (sd of one arm across seeds, pooled)": f"{a['s']:.4f} (df {2 * (a['n'] - 1)})",
        "paired spread (sd of seed-by-seed differences)": f"{a['s_d']:.4f} (df {a['n'] - 1})",
        "variance ratio 2 s^2 / s_d^2": f"{a['ratio']:.2f}; rho {a['rho']:.3f}, 1 / (1 - rho) = {a['bound']:.2f}",
        "seeds to detect 0.05 (80% power, 95%)": f"independent {a['independent_n']} per arm, paired {a['paired_n']}",
        "decision of this pilot": rep["differences"][0]["decision"],
        "details": lines,
    }, args.json)


if __name__ == "__main__":
    main()
