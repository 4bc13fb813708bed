"""What an LLM judge costs a step, with and without its group cache (reward.judge; loomrl/reward/judge.py).

Workload: real GRPO groups from the demo's task. examples/calculator_smollm2.yaml as it is (SmolLM2-135M-Instruct,
temperature 1.0, 24 tokens a turn, up to 3 turns, group_size 16): --groups groups (default: the recipe's
groups_per_step, so one step's worth) sampled by loomrl's own rollout machinery (RolloutSide: the built-in engine,
the agent loop, the calculator's sandboxed tool). The engine is then closed and a real `loomrl serve` of SmolLM2
(a process of its own) judges every trajectory of the step at once, the way a step's trajectories reach the reward
pool, through Judge (the default rubric with two worked gradings, 6-token replies, max_concurrency 8). Each arm gets a
fresh server, warmed up by one request on other content, so that none finds another arm's prompts in the built-in
engine's prefix cache.

Arms (each a fresh Judge, so an empty cache; run in this order, once):
- no_cache:            reward.judge.cache=false, show=final_reply (the last assistant message)
- cache:               the same with the cache (the default)
- cache_final_answer:  the cache, show=final_answer (the calculator's extracted number: the most sharing a group has)

Per arm: judge calls, prompt and completion tokens, cost at an example price (USD 0.15 / 0.60 per 1M prompt /
completion tokens), the judge's wall time for the step (all its trajectories judged at once; in a run they are
judged as each episode ends, overlapped with the others' generation, so this is at most what it adds), and parse
failures. Ratio: no_cache calls / cache calls. Bound (analytic): no_cache calls = trajectories; cache calls = distinct
contents judged (distinct rubric renderings), so the bound is trajectories / distinct contents and efficiency = ratio
/ bound (1.0: each distinct content judged exactly once, identical ones never). Nothing is simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bound_tolerance, divide, efficiency, machine, report  # noqa: E402

from loomrl.config import load_config  # noqa: E402
from loomrl.config.judge import JudgeConfig, JudgeExample  # noqa: E402
from loomrl.reward.judge import Judge  # noqa: E402
from loomrl.types import Task, Trajectory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "calculator_smollm2.yaml"
PRICES = {"prompt": 0.15, "completion": 0.60}
SHOTS = [JudgeExample(prompt="Anna has 5 pens and gets 2 more. Her friend has 4 books. How many pens does Anna have?",
                      reference="7", response="She has 7 pens.", score=10),
         JudgeExample(prompt="Bo has 9 cups and breaks 3. His mother has 2 cars. How many cups does Bo have?",
                      reference="6", response="The answer is 12.", score=0)]


def sample_groups(n_groups: int) -> tuple[list[tuple[Task, list[Trajectory]]], float]:
    """n_groups GRPO groups of the recipe, sampled by a RolloutSide; and the wall time it took."""
    from loomrl.rollout.actor import RolloutSide

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(RECIPE, [f"output_dir={out}", "progress=false"])
        side = RolloutSide(cfg.rollout_pool(), None)

        async def run() -> tuple[list[tuple[Task, list[Trajectory]]], float]:
            try:
                t0 = time.perf_counter()
                groups = await asyncio.gather(*(side.worker.run_group(p) for p in range(n_groups)))
                return [(side.worker.task_at(p), g) for p, g in enumerate(groups)], time.perf_counter() - t0
            finally:
                await side.close()

        return asyncio.run(run())


def start_server() -> tuple[subprocess.Popen, str]:
    """`loomrl serve` of SmolLM2 on a free port: the process and its /v1 URL."""
    recipe = Path(tempfile.mkdtemp()) / "judge.yaml"
    recipe.write_text("name: judge\nmodel:\n  kind: smollm2\n")
    proc = subprocess.Popen([sys.executable, "-m", "loomrl", "serve", str(recipe), "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            found = re.search(r"listening on (\S+/v1)", lines.get(timeout=1.0))
        except queue.Empty:
            continue
        if found:
            return proc, found.group(1)
    proc.kill()
    raise SystemExit("loomrl serve did not start within 300 s")


def warm_up(url: str) -> None:
    """One request on other content, so that no arm pays the server's first-request costs."""
    import openai

    openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(
        model="judge", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4)


def judge_step(groups: list[tuple[Task, list[Trajectory]]], **cfg) -> dict:
    """Every trajectory of the step judged at once by a fresh Judge, on a fresh server (no arm finds another's prompts
    in its prefix cache); its counts and wall time."""
    proc, url = start_server()
    try:
        warm_up(url)
        judge = Judge(JudgeConfig(base_url=url, model="judge", examples=SHOTS, max_tokens=6, prices=PRICES, **cfg))
        pairs = [(t, task) for task, trajs in groups for t in trajs if t.scored]
        distinct = len({str(judge.messages(t, task)) for t, task in pairs})

        async def run() -> float:
            try:
                t0 = time.perf_counter()
                await asyncio.gather(*(judge.grade(t, task) for t, task in pairs))
                return time.perf_counter() - t0
            finally:
                await judge.aclose()

        wall = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    m = judge.metrics
    return {"trajectories": len(pairs), "distinct": distinct, "calls": m.calls, "cache_hits": m.cache_hits,
            "prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens, "cost_usd": m.cost_usd,
            "parse_failures": m.parse_failures, "failures": m.failures, "wall_s": round(wall, 2),
            "busy_s": round(m.busy_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=None, help="groups (default: the recipe's groups_per_step)")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: one group")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.groups = 1
    n_groups = args.groups or load_config(RECIPE).trainer.groups_per_step
    groups, gen_wall = sample_groups(n_groups)
    arms = {"no_cache": judge_step(groups, cache=False), "cache": judge_step(groups),
            "cache_final_answer": judge_step(groups, show="final_answer")}
    off, on, ans = arms["no_cache"], arms["cache"], arms["cache_final_answer"]
    ratio = divide(off["calls"], on["calls"], "no_cache calls / cache calls")
    bound = divide(on["trajectories"], on["distinct"], "trajectories / distinct contents")
    # counts, not timings: no noise to allow for, so the strict tolerance even in --quick mode
    eff = efficiency(ratio, bound, "judge_cost", bound_tolerance(False))
    per_group = [len({t.turns[-1].act if t.turns else "" for t in trajs}) for _, trajs in groups]
    details = [f"{name}: {a['calls']} calls ({a['cache_hits']} cache hits) for {a['trajectories']} trajectories, "
               f"{a['prompt_tokens']} prompt + {a['completion_tokens']} completion tokens, ${a['cost_usd']:.6f}, "
               f"judge wall {a['wall_s']} s (busy {a['busy_s']} s), {a['parse_failures']} parse failures, "
               f"{a['failures']} failures" for name, a in arms.items()]
    details += [f"rollout of the step's {n_groups} groups: {gen_wall:.1f} s (built-in engine, in process)",
                f"distinct final replies per group of 16: {per_group}",
                f"final_answer arm: {ans['distinct']} distinct contents, calls ratio {off['calls'] / ans['calls']:.2f}"]
    report({"name": "judge_cost", "machine": machine(),
            "workload": f"{n_groups} groups x 16 of {RECIPE.name} (SmolLM2, temperature 1.0), judged by loomrl serve "
                        "SmolLM2 (max_concurrency 8, 6-token replies)",
            "ratio": round(ratio, 3), "ratio_over": "no_cache calls / cache calls (show=final_reply)",
            "bound": round(bound, 3), "efficiency": round(eff, 3),
            "wall_ratio": round(off["wall_s"] / on["wall_s"], 3), "arms": arms, "details": details}, args.json)


if __name__ == "__main__":
    main()
