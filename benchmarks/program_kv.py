"""Programs under a KV budget: which acting program's K/V the built-in engine drops when room is needed
(engine.program_policy, engine/builtin/programs.py), in one run:

- lru: request-level, today's behaviour (the prefix cache's least recently used entry);
- smallest_first: ThunderAgent's public policy (pause the acting program holding the fewest tokens);
- longest_wait: pause the acting program expected to stay away longest, at most max_pauses_in_row turns in a row;
- smallest_first + pool, longest_wait + pool: the same policies with a K/V pool in host memory beyond the KV budget
  (engine/kv_pool.py over engine/kv_files.py's store: files on tmpfs, --pool-dir; --pool-share of all programs' final
  contexts in bytes, 1.0 by default: every program's last turn fits): a paused program's next turn fetches its prefix
  from the pool instead of recomputing it;
- oracle: lru with a KV budget that holds every program (nothing is ever dropped): the unlimited-memory bound.

Workload: P agent programs of T turns on a tiny random model (a real tokenizer): each turn generates a few tokens
greedily, then the program waits on its "tool" (SIMULATED: an asyncio.sleep of that program's own latency, drawn once
per program, with jitter per turn) and appends an observation. The KV budget holds a share of all programs' final
contexts, so programs must be dropped between turns and recomputed when they return.

Printed per arm: rollout wall time, prefill tokens computed, prefix tokens recomputed on restore, programs paused and
restored, the longest a turn waited for admission, prompt tokens the pool served (pool arms), and the share of the lru -> oracle gap in wall time (and in
recomputed tokens) each policy closes. Every arm's greedy outputs are checked identical to the oracle's. Timings are of
one machine in one run (arms interleaved over repeats, medians); --quick: the same path at smoke-test sizes (figures
not results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, divide, machine, median, report  # noqa: E402

from loomrl.config import ModelConfig  # noqa: E402
from loomrl.config.model import TinyModelConfig  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.engine.kv_pool import open_pool  # noqa: E402
from loomrl.model.loader import load_model  # noqa: E402

POLICIES = ("lru", "smallest_first", "longest_wait")
POOLED = ("smallest_first", "longest_wait")  # each also run with a K/V pool: the arm "<policy> + pool"
ARMS = (*POLICIES, *(f"{p} + pool" for p in POOLED))


@dataclass(slots=True, kw_only=True)
class Spec:
    program_id: str
    prompt: list[int]
    observation: list[int]
    wait_s: float  # the simulated tool's latency for this program


@dataclass(slots=True, kw_only=True)
class Arm:
    wall_s: float
    prefill_tokens: int
    recomputed_tokens: int
    paused: int
    restored: int
    max_wait_s: float
    max_pauses_in_row: int
    preemptions: int
    pool_served: int  # prompt tokens fetched from the pool instead of recomputed (0 without one)
    outputs: dict[str, list[list[int]]]


def workload(tokenizer, programs: int, prompt_len: int, obs_len: int, wait_s: float, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for p in range(programs):
        text = f"Task {p}: " + " ".join(f"record {p}-{j} holds value {rng.randint(0, 999)}." for j in range(prompt_len))
        obs = tokenizer.encode(f" Tool output {p}: " + " ".join(str(rng.randint(0, 99)) for _ in range(obs_len)))
        specs.append(Spec(program_id=f"prog{p}", prompt=tokenizer.encode(text)[:prompt_len],
                          observation=obs[:obs_len], wait_s=wait_s * rng.choice((0.5, 1.0, 2.0))))
    return specs


async def rollout(engine: BuiltinEngine, specs: list[Spec], turns: int, new_tokens: int,
                  seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    jitter = {(s.program_id, t): rng.uniform(0.8, 1.2) for s in specs for t in range(turns)}

    async def program(spec: Spec) -> list[list[int]]:
        ctx, outs = list(spec.prompt), []
        for t in range(turns):
            r = await engine.generate(GenerationRequest(
                prompt_ids=ctx, program_id=spec.program_id,
                sampling=SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)))
            outs.append(r.token_ids)
            if t + 1 < turns:
                await asyncio.sleep(spec.wait_s * jitter[spec.program_id, t])  # the simulated tool call
                ctx = ctx + r.token_ids + spec.observation
        engine.release(spec.program_id)
        return outs

    results = await asyncio.gather(*[program(s) for s in specs])
    return {s.program_id: out for s, out in zip(specs, results)}


def run_arm(model, tokenizer, specs, policy: str, budget: int, turns: int, new_tokens: int, seed: int,
            max_pauses_in_row: int = 2, pool_bytes: int = 0, pool_dir: str = "") -> Arm:
    """One rollout; `policy` "<p> + pool": policy p with a fresh K/V pool of `pool_bytes` (in `pool_dir`, removed after)."""
    policy, pooled = policy.removesuffix(" + pool"), policy.endswith(" + pool")
    pool = open_pool(pool_bytes, pool_dir) if pooled else None
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=budget,
                           max_prefill_tokens=1024, program_policy=policy,  # type: ignore[arg-type]
                           max_pauses_in_row=max_pauses_in_row, kv_pool=pool)
    try:
        before, preempted = engine.metrics.prefill_tokens, engine.metrics.preemptions
        t0 = time.perf_counter()
        outputs = asyncio.run(rollout(engine, specs, turns, new_tokens, seed))
        wall = time.perf_counter() - t0
        pm = engine.programs.metrics
        return Arm(wall_s=wall, prefill_tokens=engine.metrics.prefill_tokens - before,
                   recomputed_tokens=pm.recomputed_tokens, paused=pm.paused, restored=pm.restored,
                   max_wait_s=pm.max_wait_s, max_pauses_in_row=pm.max_pauses_in_row,
                   preemptions=engine.metrics.preemptions - preempted,
                   pool_served=pool.metrics.tokens_served if pool is not None else 0, outputs=outputs)
    finally:
        engine.close()
        if pool is not None:
            pool.close()


def middle(runs: list[Arm]) -> Arm:
    """The run of median wall time (its counts are printed: they move with timing, as its wall time does)."""
    return sorted(runs, key=lambda a: a.wall_s)[(len(runs) - 1) // 2]


def summarize(arms: dict[str, list[Arm]], oracle: list[Arm], budget: int, mean_final: float, programs: int,
              returns: int, bound: int) -> list[str]:
    """One share's lines: each arm against lru and the oracle, then the checks of the bounds."""
    wall = {n: median([a.wall_s for a in runs]) for n, runs in arms.items()}
    wall_oracle = median([a.wall_s for a in oracle])
    gap, rec_lru = wall["lru"] - wall_oracle, middle(arms["lru"]).recomputed_tokens
    lines = [f"budget {budget} tokens: holds ~{budget / mean_final:.1f} of {programs} programs' final contexts"]
    for name, runs in arms.items():
        a = middle(runs)
        closed = f"{divide(wall['lru'] - wall[name], gap, 'lru - oracle wall time'):6.1%}" if gap > 0 else "   n/a"
        rec = f"{divide(rec_lru - a.recomputed_tokens, rec_lru, 'lru recomputed tokens'):6.1%}" if rec_lru else "   n/a"
        lines.append(f"  {name:21s} wall {wall[name]:6.2f} s  prefill {a.prefill_tokens:6d}  recomputed on restore "
                     f"{a.recomputed_tokens:6d}  preempted {a.preemptions:3d}  paused {a.paused:3d}  restored "
                     f"{a.restored:3d}  max wait {max(x.max_wait_s for x in runs):5.2f} s  pauses in a row "
                     f"{a.max_pauses_in_row}  pool served {a.pool_served:6d}  lru->oracle gap closed: wall {closed}, "
                     f"recompute {rec}")
    lru, held = middle(arms["lru"]), budget / mean_final
    floor = max(0.0, (programs - held) / programs) * returns
    preempted = lru.prefill_tokens - oracle[0].prefill_tokens - lru.recomputed_tokens
    lines.append(f"  analysis: lru prefilled {lru.prefill_tokens - oracle[0].prefill_tokens} tokens more than the oracle: "
                 f"{lru.recomputed_tokens} restoring dropped programs, {preempted} re-prefilling its {lru.preemptions} "
                 "preempted turns (the program policies preempt none: a turn's output is reserved up front). Returns "
                 "that found their K/V gone: " + ", ".join(f"{n} {middle(runs).restored}/{returns}" for n, runs in arms.items())
                 + f". With ~{held:.1f} of {programs} programs' contexts in the budget and all of them alive, about "
                 f"(N - k) / N = {floor:.0f} of {returns} returns miss whatever the victim (fewer fit still: running turns "
                 "take room too); the victim choice decides which, and the rest of the gap is recompute no eviction "
                 "policy avoids: the + pool arms fetch it from host memory instead (ProgramTable.fetch)")
    lru_wait = max(x.max_wait_s for x in arms["lru"])
    for name in ("longest_wait", "longest_wait + pool"):
        lw = arms[name]
        lines.append(f"  bound: {name} pauses a program at most {bound} turns in a row: "
                     f"{'held' if max(x.max_pauses_in_row for x in lw) <= bound else 'NOT held'}; its longest admission "
                     f"wait {max(x.max_wait_s for x in lw):.2f} s against lru's (today) {lru_wait:.2f} s: "
                     f"{'held' if max(x.max_wait_s for x in lw) <= lru_wait else 'NOT held'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--obs-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--wait-s", type=float, default=0.25, help="mean simulated tool latency")
    ap.add_argument("--budget-shares", default="0.35,0.6", help="KV budgets / all programs' final contexts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pauses-in-row", type=int, default=2, help="longest_wait's bound")
    ap.add_argument("--pool-share", type=float, default=1.0,
                    help="the + pool arms' K/V pool, in host memory beyond the KV budget: a share of all programs' "
                         "final contexts, in bytes")
    ap.add_argument("--pool-dir", default=f"/dev/shm/loomrl-program-kv-{os.getpid()}" if os.path.isdir("/dev/shm") else "",
                    help="the pool's folder (engine.kv_pool_dir: files on tmpfs, an SQLite index); '': in process")
    args = ap.parse_args()
    if args.quick:
        args.programs, args.turns, args.prompt_tokens, args.obs_tokens = 6, 3, 96, 16
        args.new_tokens, args.wait_s, args.repeats, args.budget_shares = 4, 0.05, 1, "0.35"
    tiny = TinyModelConfig(hidden_size=128 if args.quick else 256, intermediate_size=256 if args.quick else 768,
                           num_hidden_layers=2 if args.quick else 4, num_attention_heads=4, num_key_value_heads=2)
    model, tokenizer = load_model(ModelConfig(kind="tiny", tiny=tiny))
    specs = workload(tokenizer, args.programs, args.prompt_tokens, args.obs_tokens, args.wait_s, seed=0)
    final = sum(len(s.prompt) + args.turns * args.new_tokens + (args.turns - 1) * len(s.observation) for s in specs)
    shares = [float(x) for x in args.budget_shares.split(",")]
    budgets = [max(int(final * sh), max(len(s.prompt) for s in specs) * 3) for sh in shares]
    oracle_budget = 4 * final  # holds every program, and a turn's copy of its prefix beside its cached one
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
    pool_bytes = int(args.pool_share * final * kv_bytes_per_token)

    def arm(policy: str, budget: int, r: int) -> Arm:
        return run_arm(model, tokenizer, specs, policy, budget, args.turns, args.new_tokens, seed=r,
                       max_pauses_in_row=args.max_pauses_in_row, pool_bytes=pool_bytes, pool_dir=args.pool_dir)

    run_arm(model, tokenizer, specs[:2], "lru", oracle_budget, 2, 2, seed=1)  # warm-up: packing, first allocations
    oracle: list[Arm] = []
    arms: list[dict[str, list[Arm]]] = [{p: [] for p in ARMS} for _ in budgets]
    for r in range(args.repeats):
        runs = [("oracle", oracle_budget, -1)] + [(p, b, i) for i, b in enumerate(budgets) for p in ARMS]
        for name, budget, i in runs if r % 2 == 0 else reversed(runs):  # interleaved: drift hits every arm alike
            a = arm("lru" if name == "oracle" else name, budget, r)
            (oracle if i < 0 else arms[i][name]).append(a)
    for a in [*oracle, *(x for by in arms for runs in by.values() for x in runs)]:
        if a.outputs != oracle[0].outputs:
            raise SystemExit("benchmark error: greedy outputs differ from the oracle's (pause/restore changed a token)")

    wall_oracle = median([a.wall_s for a in oracle])
    details = [f"oracle (budget {oracle_budget}: nothing dropped) wall {wall_oracle:6.2f} s  prefill "
               f"{oracle[0].prefill_tokens:6d}"]
    closed = {}
    for share, budget, by in zip(shares, budgets, arms):
        details += summarize(by, oracle, budget, final / len(specs), len(specs), len(specs) * (args.turns - 1),
                             args.max_pauses_in_row)
        lru = median([a.wall_s for a in by["lru"]])
        if lru > wall_oracle:
            closed[share] = {p: (lru - median([a.wall_s for a in by[p]])) / (lru - wall_oracle) for p in ARMS[1:]}
    result = {
        "name": "program_kv",
        "machine": machine(),
        "workload": (f"{args.programs} programs x {args.turns} turns, prompt {args.prompt_tokens}, +{args.new_tokens} "
                     f"generated (greedy) and {args.obs_tokens} observation tokens a turn; tool waits SIMULATED "
                     f"(asyncio.sleep, mean {args.wait_s} s x {{0.5, 1, 2}} per program, +-20% a turn)"),
        "kv_budgets": ", ".join(f"{b} tokens ({sh:.0%} of all final contexts, {final})" for sh, b in zip(shares, budgets)),
        "kv_pool": (f"+ pool arms: {pool_bytes / 2**20:.1f} MiB of host memory beyond the KV budget ({args.pool_share:.0%} "
                    f"of all final contexts at {kv_bytes_per_token} bytes a token), "
                    + (f"files on tmpfs under {args.pool_dir} (engine.kv_pool_dir), a fresh folder each run"
                       if args.pool_dir else "in process")),
        "repeats": f"{args.repeats} (arms interleaved; median wall time, and the counts of that run)",
        "greedy_outputs": "identical in every arm",
        "gap_closed_wall": "; ".join(f"budget {sh:.0%}: " + ", ".join(f"{p} {v:.1%}" for p, v in c.items())
                                     for sh, c in closed.items()) or "n/a (lru did not lose to the oracle)",
        "details": details,
    }
    if args.quick:
        result["note"] = QUICK_NOTE
    report(result, args.json)


if __name__ == "__main__":
    main()
