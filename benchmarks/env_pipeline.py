"""Rollout dispatch: SkyRL-Agent's staged pipeline against naive batching, on this machine.

SkyRL-Agent (arXiv 2511.16108; skyrl-agent/skyrl_agent/dispatcher/dispatchers.py) splits each trajectory
into three stage jobs, runtime initialisation -> agent run (LLM generation + tool calls) -> reward
calculation, and its `async_pipeline` dispatcher gives each stage its own bounded set of workers joined by
queues, so the scarce resource of the run stage, the inference engine's batch, stays full while containers
start and tests run. It reports 1.55x over naive async batching, where every trajectory holds its place
through init -> run -> evaluate.

Model (both arms, one invocation, interleaved repeats, medians):
- Run-stage capacity: R run slots, the engine's batch (SkyRL's `max_parallel_agents`). A trajectory holds a
  slot for its whole run stage (its sequence stays in the batch between turns, tool calls included).
- Same total concurrency means here: the same R and the same N trajectories (the same drawn latencies) in
  both arms. Naive (SkyRL's bounded async batch): at most R trajectories in flight, each runs
  init -> run -> evaluate on one slot, so a slot idles on the GPU while its trajectory initialises or is
  evaluated. Staged (SkyRL's async pipeline): at most R in the run stage too; init and evaluate have their
  own bounded worker pools (defaults as SkyRL's: R each) and a bounded queue of initialised, ready
  instances between init and run. The staged arm holds more sandboxes at once (init + ready + run + eval):
  that is what it spends, on cheap CPU-side instances, to keep the scarce run slots busy.
- Pre-warming: both arms take sandboxes from a real EnvPool pre-warmed to its full size before the timed
  window (sized with pool_size_for(max sandboxes leased at once)), so neither pays sandbox creation; the
  simulated per-task setup (container start, repo setup) is paid by every trajectory in both arms.
- Stages (real work where it is cheap, simulated latency where it cannot be real here):
  init = pool.acquire() (with its health check, a real command) + write the task's repo files (real) +
    a simulated setup latency (container start / repo setup);
  run = T turns, each a simulated LLM turn latency then a real tool command in the sandbox (the last one
    edits the repo with sed); turn latency does not depend on how many slots are busy (decode is
    bandwidth-bound: a step costs about the same at batch 1 and at batch R; R is the capacity);
  evaluate = a real test command in the sandbox + a simulated test-suite latency, then pool.release().
  Latencies are uniform in mean*(1 +- jitter), drawn once per repeat and shared by both arms.

Bound (steady state, configured simulated stage means I, Rn = T*L, E; worker pools n_init, n_eval):
  staged throughput <= X_s = min(n_init / I, R / Rn, n_eval / E)
  naive throughput  =  X_n = R / (I + Rn + E)       (each slot completes one trajectory per I + Rn + E)
  bound = X_s / X_n                                 (= (I + Rn + E) / Rn when the run stage is the bottleneck)
efficiency = measured ratio / bound. A finite run loses a little of it: the staged arm has to fill (one
init) and drain (one evaluation) around its steady state; the estimate of that is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, median, report  # noqa: E402

from loomrl.env.pool import EnvPool, pool_size_for  # noqa: E402
from loomrl.env.sandbox import Sandbox, SandboxError, make_sandbox  # noqa: E402

CMD_TIMEOUT_S = 10.0
PATCH_MARK = "fixed = True"


@dataclass(slots=True)
class Traj:
    """One trajectory's simulated latencies (the same draws in both arms)."""

    idx: int
    init_s: float
    turn_s: list[float]
    eval_s: float


@dataclass
class ArmStats:
    """What one arm's run measured."""

    done: int = 0
    passed: int = 0
    dirty: int = 0  # instances handed out with a previous trajectory's files still there (a reset bug)
    stage_s: dict[str, list[float]] = field(default_factory=lambda: {"init": [], "run": [], "eval": []})
    in_run: int = 0
    max_in_run: int = 0
    run_slot_s: float = 0.0  # integral over time of the number of trajectories in the run stage
    _last: float = 0.0

    def _tick(self) -> None:
        now = time.perf_counter()
        self.run_slot_s += self.in_run * (now - self._last)
        self._last = now

    def enter_run(self) -> None:
        self._tick()
        self.in_run += 1
        self.max_in_run = max(self.max_in_run, self.in_run)

    def leave_run(self) -> None:
        self._tick()
        self.in_run -= 1


def draw(n: int, args, seed: int) -> list[Traj]:
    rng = random.Random(seed)

    def jit(mean: float) -> float:
        return mean * rng.uniform(1 - args.jitter, 1 + args.jitter)

    return [Traj(i, jit(args.init_s), [jit(args.llm_s) for _ in range(args.turns)], jit(args.eval_s))
            for i in range(n)]


def repo_files(idx: int) -> dict[str, str]:
    """A small task repository (distinct per task): what init lays out in the sandbox."""
    files = {f"repo/src/mod{k}.py": f"# task {idx} module {k}\nfixed = False\n\n\ndef f{k}(x):\n    return x + {k}\n"
             for k in range(4)}
    files["repo/tests/test_mod0.py"] = "from src.mod0 import f0, fixed\n\n\ndef test_fixed():\n    assert fixed\n"
    files["repo/README.md"] = f"Task {idx}: make mod0 report fixed.\n"
    return files


TOOLS = [
    ["/usr/bin/grep", "-rn", "def ", "repo"],
    ["/usr/bin/cat", "repo/src/mod0.py"],
    ["/usr/bin/ls", "-R", "repo"],
    ["/usr/bin/sed", "-n", "1,4p", "repo/tests/test_mod0.py"],
]
EDIT = ["/usr/bin/sed", "-i", f"s/fixed = False/{PATCH_MARK}/", "repo/src/mod0.py"]
TEST = ["/usr/bin/sh", "-c", f"grep -q '{PATCH_MARK}' repo/src/mod0.py && echo pass || echo fail"]


# -- the three stages (shared by both arms: only the dispatch differs) --------------------------------
async def init_stage(pool: EnvPool, traj: Traj, st: ArmStats, sb: Sandbox | None = None) -> Sandbox:
    t0 = time.perf_counter()
    if sb is None:
        sb = await pool.acquire()  # real: pooled, pre-warmed, health-checked
    try:
        sb.read_file("repo/src/mod0.py")
        st.dirty += 1  # a reset instance has an empty workdir
    except SandboxError:
        pass
    for path, text in repo_files(traj.idx).items():
        sb.write_file(path, text)  # real
    await asyncio.sleep(traj.init_s)  # SIMULATED: container start + repo setup
    st.stage_s["init"].append(time.perf_counter() - t0)
    return sb


async def run_stage(sb: Sandbox, traj: Traj, st: ArmStats) -> None:
    t0 = time.perf_counter()
    st.enter_run()
    try:
        for k, turn_s in enumerate(traj.turn_s):
            await asyncio.sleep(turn_s)  # SIMULATED: one LLM turn
            argv = EDIT if k == len(traj.turn_s) - 1 else TOOLS[k % len(TOOLS)]
            res = await sb.exec(argv, timeout=CMD_TIMEOUT_S)  # real tool command in the sandbox
            if res.returncode != 0:
                raise SandboxError(f"tool {argv[0]} failed: {res.returncode} {res.stderr[:200]}")
    finally:
        st.leave_run()
    st.stage_s["run"].append(time.perf_counter() - t0)


async def eval_stage(sb: Sandbox, traj: Traj, st: ArmStats) -> None:
    t0 = time.perf_counter()
    res = await sb.exec(TEST, timeout=CMD_TIMEOUT_S)  # real test command
    await asyncio.sleep(traj.eval_s)  # SIMULATED: the test suite's run time
    st.passed += res.stdout.strip() == "pass"
    st.done += 1
    st.stage_s["eval"].append(time.perf_counter() - t0)


# -- dispatchers -------------------------------------------------------------------------------------
async def naive(trajs: list[Traj], pool: EnvPool, slots: int, st: ArmStats) -> None:
    """SkyRL's bounded async batch: `slots` trajectories in flight, each init -> run -> evaluate."""
    todo = deque(trajs)

    async def slot() -> None:
        while todo:
            traj = todo.popleft()
            async with pool.lease() as sb:  # released (reset in the background) after evaluate
                await init_stage(pool, traj, st, sb)
                await run_stage(sb, traj, st)
                await eval_stage(sb, traj, st)

    await asyncio.gather(*[slot() for _ in range(slots)])


async def staged(trajs: list[Traj], pool: EnvPool, slots: int, n_init: int, n_eval: int, ready_size: int,
                 st: ArmStats) -> None:
    """SkyRL's async pipeline: init, run and evaluate workers joined by queues; the sandbox travels with
    the trajectory from stage to stage, so acquire/release are explicit (lease() cannot span tasks)."""
    todo = deque(trajs)
    ready: asyncio.Queue = asyncio.Queue(maxsize=ready_size)  # initialised instances waiting for a slot
    to_eval: asyncio.Queue = asyncio.Queue()  # unbounded: a run slot never waits for an evaluator

    async def guarded(sb: Sandbox, coro) -> bool:
        try:
            await coro
            return True
        except BaseException:
            await asyncio.shield(pool.release(sb, broken=True))
            raise

    async def init_worker() -> None:
        while todo:
            traj = todo.popleft()
            sb = await pool.acquire()
            await guarded(sb, init_stage(pool, traj, st, sb))
            await ready.put((traj, sb))

    async def run_worker() -> None:
        while (item := await ready.get()) is not None:
            traj, sb = item
            await guarded(sb, run_stage(sb, traj, st))
            to_eval.put_nowait((traj, sb))

    async def eval_worker() -> None:
        while (item := await to_eval.get()) is not None:
            traj, sb = item
            await guarded(sb, eval_stage(sb, traj, st))
            await pool.release(sb)

    runners = [asyncio.ensure_future(run_worker()) for _ in range(slots)]
    evaluators = [asyncio.ensure_future(eval_worker()) for _ in range(n_eval)]
    try:
        await asyncio.gather(*[init_worker() for _ in range(n_init)])
        for _ in runners:
            await ready.put(None)
        await asyncio.gather(*runners)
        for _ in evaluators:
            to_eval.put_nowait(None)
        await asyncio.gather(*evaluators)
    finally:
        for task in runners + evaluators:
            task.cancel()


async def run_arm(arm: str, trajs: list[Traj], args, backend: str) -> dict:
    if arm == "naive":
        leased = args.slots
    else:
        # init workers (each may hold one initialised instance while the ready queue is full) + ready
        # queue + run slots + evaluators; instances waiting in the eval queue come out of the spares.
        leased = args.init_workers + args.ready + args.slots + args.eval_workers
    size = pool_size_for(leased)
    pool = await EnvPool(lambda: make_sandbox(backend), size=size, prewarm=size).start()
    st = ArmStats()
    try:
        st._last = t0 = time.perf_counter()
        if arm == "naive":
            await naive(trajs, pool, args.slots, st)
        else:
            await staged(trajs, pool, args.slots, args.init_workers, args.eval_workers, args.ready, st)
        secs = time.perf_counter() - t0
        st._tick()
        metrics = pool.metrics
    finally:
        await pool.close()
    if st.done != len(trajs) or st.passed != len(trajs):
        raise RuntimeError(f"{arm}: {st.done} of {len(trajs)} trajectories finished, {st.passed} passed")
    return {
        "traj_per_s": len(trajs) / secs,
        "seconds": secs,
        "run_utilization": st.run_slot_s / (args.slots * secs),
        "max_in_run": st.max_in_run,
        "pool_size": size,
        "acquire_wait_s_mean": metrics.acquire_wait_s_total / max(1, metrics.acquired),
        "dirty": st.dirty,
        "stage_mean_s": {k: sum(v) / len(v) for k, v in st.stage_s.items()},
    }


def bound_for(i_s: float, run_s: float, e_s: float, slots: int, n_init: int, n_eval: int):
    caps = {"init": n_init / i_s, "run": slots / run_s, "eval": n_eval / e_s}
    bottleneck = min(caps, key=caps.get)
    naive_x = slots / (i_s + run_s + e_s)
    return caps[bottleneck] / naive_x, bottleneck, caps, naive_x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectories", type=int, default=48, help="N trajectories per arm per repeat")
    ap.add_argument("--slots", type=int, default=8, help="R run slots: the engine's batch, both arms")
    ap.add_argument("--turns", type=int, default=4, help="T turns per trajectory")
    ap.add_argument("--llm-s", type=float, default=0.3, help="simulated LLM turn latency, mean seconds")
    ap.add_argument("--init-s", type=float, default=0.4, help="simulated container start + repo setup, mean s")
    ap.add_argument("--eval-s", type=float, default=0.25, help="simulated test-suite run time, mean seconds")
    ap.add_argument("--jitter", type=float, default=0.3, help="latencies uniform in mean*(1 +- jitter)")
    ap.add_argument("--init-workers", type=int, default=None, help="staged init pool (default R, as SkyRL)")
    ap.add_argument("--eval-workers", type=int, default=None, help="staged eval pool (default R, as SkyRL)")
    ap.add_argument("--ready", type=int, default=None, help="staged queue of initialised instances (default R/2)")
    ap.add_argument("--repeats", type=int, default=3, help="arms run interleaved this many times; medians")
    ap.add_argument("--sandbox", default="auto", help="sandbox backend (auto: bwrap if usable, else process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.trajectories, args.slots, args.turns, args.repeats = 8, 4, 2, 1
    args.init_workers = args.init_workers or args.slots
    args.eval_workers = args.eval_workers or args.slots
    args.ready = args.ready or max(1, args.slots // 2)
    for name in ("trajectories", "slots", "turns", "init_workers", "eval_workers", "ready", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("llm_s", "init_s", "eval_s"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.jitter < 1:
        ap.error("--jitter must be in [0, 1)")

    backend = make_sandbox(args.sandbox)
    backend_name = backend.backend
    backend.close()

    n, r = args.trajectories, args.slots
    run_s = args.turns * args.llm_s
    bound, bottleneck, caps, naive_x = bound_for(args.init_s, run_s, args.eval_s, r, args.init_workers,
                                                 args.eval_workers)

    runs: dict[str, list[dict]] = {"naive": [], "staged": []}
    details = []
    for rep in range(args.repeats):
        trajs = draw(n, args, args.seed + rep)
        order = ("naive", "staged") if rep % 2 == 0 else ("staged", "naive")
        for arm in order:
            runs[arm].append(asyncio.run(run_arm(arm, trajs, args, backend_name)))
        nv, sg = runs["naive"][-1], runs["staged"][-1]
        details.append(f"repeat {rep + 1}: naive {nv['traj_per_s']:.2f} traj/s ({nv['seconds']:.1f}s, run slots "
                       f"{nv['run_utilization']:.0%} busy), staged {sg['traj_per_s']:.2f} traj/s ({sg['seconds']:.1f}s, "
                       f"run slots {sg['run_utilization']:.0%} busy), ratio {sg['traj_per_s'] / nv['traj_per_s']:.3f}")

    def med(arm: str, key: str) -> float:
        return median([x[key] for x in runs[arm]])

    arms = {}
    for arm in ("naive", "staged"):
        stage_means = {k: median([x["stage_mean_s"][k] for x in runs[arm]]) for k in ("init", "run", "eval")}
        arms[arm] = {
            "traj_per_s": round(med(arm, "traj_per_s"), 3),
            "seconds": round(med(arm, "seconds"), 2),
            "run_utilization": round(med(arm, "run_utilization"), 3),
            "max_in_run": max(x["max_in_run"] for x in runs[arm]),
            "pool_size": runs[arm][0]["pool_size"],
            "acquire_wait_ms_mean": round(1e3 * med(arm, "acquire_wait_s_mean"), 1),
            "dirty_instances": sum(x["dirty"] for x in runs[arm]),
            "stage_mean_s": {k: round(v, 3) for k, v in stage_means.items()},
        }
    ratio = divide(arms["staged"]["traj_per_s"], arms["naive"]["traj_per_s"], "staged traj/s / naive traj/s")
    eff = efficiency(ratio, bound, "env_pipeline", bound_tolerance(args.quick))
    per_rep = [s["traj_per_s"] / v["traj_per_s"] for s, v in zip(runs["staged"], runs["naive"], strict=True)]

    waves = n / r
    details.append(f"bound formula: X_s = min(n_init/I, R/(T*L), n_eval/E) = min({args.init_workers}/{args.init_s}, "
                   f"{r}/({args.turns}*{args.llm_s}), {args.eval_workers}/{args.eval_s}) = min("
                   + ", ".join(f"{k} {v:.2f}" for k, v in caps.items()) + f") = {caps[bottleneck]:.2f} traj/s "
                   f"(bottleneck: {bottleneck}); X_n = R/(I+T*L+E) = {r}/({args.init_s}+{run_s:g}+{args.eval_s}) = "
                   f"{naive_x:.2f} traj/s; bound = X_s/X_n = {bound:.3f}")
    if bottleneck == "run":
        finite = waves * (args.init_s + run_s + args.eval_s) / (args.init_s + waves * run_s + args.eval_s)
        details.append(f"finite-run estimate (staged arm also fills for one init and drains for one evaluation): "
                       f"(N/R)(I+T*L+E) / (I + (N/R)*T*L + E) = {finite:.3f}, i.e. efficiency {finite / bound:.3f} "
                       f"at best for N/R = {waves:g}")
    details.append(f"each arm against its own analytic throughput: naive {arms['naive']['traj_per_s'] / naive_x:.3f} "
                   f"of X_n, staged {arms['staged']['traj_per_s'] / caps[bottleneck]:.3f} of X_s")
    nm = arms["naive"]["stage_mean_s"]
    m_bound, m_bottleneck, _, _ = bound_for(nm["init"], nm["run"], nm["eval"], r, args.init_workers,
                                            args.eval_workers)
    details.append(f"stage times measured in the naive arm (simulated + real work): init {nm['init']:.3f}s, "
                   f"run {nm['run']:.3f}s, eval {nm['eval']:.3f}s -> bound from them {m_bound:.3f} "
                   f"(bottleneck {m_bottleneck})")
    sm = arms["staged"]["stage_mean_s"]
    details.append(f"stage times measured in the staged arm: init {sm['init']:.3f}s, run {sm['run']:.3f}s, "
                   f"eval {sm['eval']:.3f}s")
    details.append("fairness: both arms run the same N trajectories with the same drawn latencies per repeat and "
                   f"the same R = {r} run slots (max in the run stage seen: naive {arms['naive']['max_in_run']}, "
                   f"staged {arms['staged']['max_in_run']}); naive holds at most R sandboxes (pool "
                   f"{arms['naive']['pool_size']}), staged at most init {args.init_workers} + ready {args.ready} + "
                   f"run {r} + eval {args.eval_workers} (pool {arms['staged']['pool_size']}); both pools pre-warmed "
                   "to full size before the timed window")
    details.append(f"pool: mean acquire wait naive {arms['naive']['acquire_wait_ms_mean']} ms, staged "
                   f"{arms['staged']['acquire_wait_ms_mean']} ms; instances handed out unclean: "
                   f"{arms['naive']['dirty_instances'] + arms['staged']['dirty_instances']}")
    if args.quick:
        details.append(QUICK_NOTE)

    report({
        "name": "env_pipeline",
        "machine": machine(),
        "workload": f"{n} trajectories x {args.turns} turns, R = {r} run slots, staged pools init "
                    f"{args.init_workers} / ready {args.ready} / eval {args.eval_workers}, sandbox {backend_name}; "
                    f"medians of {args.repeats} interleaved runs",
        "simulated": f"asyncio.sleep, uniform mean*(1 +- {args.jitter}): container start + repo setup I = "
                     f"{args.init_s}s per trajectory, LLM turn L = {args.llm_s}s (flat in the number of busy "
                     f"slots), test-suite run E = {args.eval_s}s; real: EnvPool acquire/health check/reset/release, "
                     f"repo files written, {args.turns} tool commands (the last one edits the repo) and 1 test "
                     f"command per trajectory in the sandbox",
        "naive_traj_per_s": arms["naive"]["traj_per_s"],
        "staged_traj_per_s": arms["staged"]["traj_per_s"],
        "ratio": round(ratio, 3),
        "ratio_per_repeat": [round(x, 3) for x in per_rep],
        "bound": round(bound, 3),
        "efficiency": round(eff, 3),
        "reference": "SkyRL-Agent reports 1.55x (async pipeline over naive async batching, SWE agent training)",
        "arms": arms,
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
