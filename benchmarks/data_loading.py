"""Time to the first group and peak memory of a rollout worker's data, for a 1,000,000-row parquet file of prompts.

What is compared, each in a fresh process (a rollout worker is its own process, beside the model):
  baseline   the interpreter with loomrl.data and HF datasets imported (what any worker pays)
  cold       load_splits on the file with an empty cache (datasets converts it to Arrow once), then the tasks of the
             first 8 positions of the run's data order (RolloutWorker's DataOrder: a shuffled epoch)
  warm       the same with the cache filled (every later worker and every resumed run)
Reported: seconds from the start of load_splits to the 8th task; the resident memory it added (VmRSS after the group
minus before load_splits, in the same process: memory-mapped Arrow pages it touched included); and peak RSS
(ru_maxrss) minus the baseline process's (the imports, torch among them, dominate that peak).
Targets (issue 28): under 5 s and under 500 MB. Nothing here is simulated.

    .venv/bin/python benchmarks/data_loading.py [--rows 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, report  # noqa: E402

CHILD = r"""
import json, resource, sys, time
from loomrl.data import DataConfig, load_splits
from loomrl.rollout.worker import DataOrder
import datasets
mode, path = sys.argv[1], sys.argv[2]
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
out = {"rss_before_mb": rss_mb()}
if mode != "baseline":
    t0 = time.perf_counter()
    train, held = load_splits(DataConfig(path=path), seed=0, n_heldout=200)
    order = DataOrder(len(train), 0)
    group = [train[order.index(p)] for p in range(8)]
    out["seconds"] = time.perf_counter() - t0
    out["rows"] = len(train) + len(held)
out["rss_after_mb"] = rss_mb()  # resident now: the mapped Arrow pages it touched count too
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def child(mode: str, path: str, cache: str) -> dict:
    env = {**os.environ, "LOOMRL_CACHE": cache}
    res = subprocess.run([sys.executable, "-c", CHILD, mode, path], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rows = 10_000
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "prompts.parquet")
        n = args.rows
        pq.write_table(pa.table({
            "prompt": [f"Tom has {i % 97} apples and {i % 89} pears. He buys {i % 13} more apples. How many apples "
                       f"does Tom have now? (problem {i})" for i in range(n)],
            "answer": [str(i % 97 + i % 13) for i in range(n)]}), path)
        size_mb = os.path.getsize(path) / 2**20
        cache = str(Path(tmp) / "cache")
        base = child("baseline", path, cache)
        cold = child("cold", path, cache)
        warm = child("warm", path, cache)
    arms = {"cold": cold, "warm": warm}
    details = [f"{'arm':6} {'s to first group':>17} {'RSS added (MB)':>15} {'peak RSS - baseline (MB)':>25}"]
    for name, r in arms.items():
        details.append(f"{name:6} {r['seconds']:17.2f} {r['rss_after_mb'] - r['rss_before_mb']:15.0f} "
                       f"{r['rss_mb'] - base['rss_mb']:25.0f}")
    worst_s = max(r["seconds"] for r in arms.values())
    worst_mb = max(max(r["rss_after_mb"] - r["rss_before_mb"], r["rss_mb"] - base["rss_mb"]) for r in arms.values())
    report({"machine": machine(), "rows": n, "file_mb": round(size_mb, 1), "baseline_rss_mb": round(base["rss_mb"]),
            "targets": "first group < 5 s, memory < 500 MB above the baseline",
            "worst_seconds": round(worst_s, 2), "worst_mb_above_baseline": round(worst_mb),
            "within_targets": worst_s < 5 and worst_mb < 500, "arms": arms, "details": details}, args.json)


if __name__ == "__main__":
    main()
