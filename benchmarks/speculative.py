"""Grouped speculative decoding (engine.speculation) on vs off in the built-in engine, on RL rollout workloads.

Workloads (both arms in one invocation, interleaved off/on --repeats times, each arm's median run reported; the same requests and
per-request seeds in both arms):
- grpo: one GRPO step's rollouts of the calculator task as `make demo` trains it: --groups groups of G=8 (the same
  rendered prompt each: the few-shot "distract" conversation of examples/calculator_smollm2.yaml), temperature 1,
  sampling.max_tokens of the recipe unless --max-tokens. Wall time of the whole step: from submitting all of its
  requests to the last one's end (the tail included). From SmolLM2-135M-Instruct as shipped, and with --checkpoint a
  trained run's checkpoint folder (RUN/checkpoints/step_N: its model/), said which in the output; without one that
  workload is skipped, saying so.
- multiturn: engine_throughput.py's multi-turn agent workload (P programs x T turns, N tokens a turn, temperature 1,
  observations appended), each program its own drafting group.
Nothing is simulated: real model (float32), real tokenizer, the engine's own thread; observations are token lists.

Printed per workload and arm: tokens/s, wall seconds, engine steps, draft tokens, acceptance, tokens per decoding
sequence per step, drafting seconds; ratio = off wall / on wall.

The bound, from this run's own measurements:
- the engine's step cost as a function of tokens per step, c(n) = a + b * n, fitted to a sweep of decode steps of
  n tokens (n = 1 .. 128, the runner's own forward over contexts of the workload's length), printed with the batch
  size at which decoding turns compute-bound here (n* = a / b: from there on the per-token cost b * n outweighs the
  fixed cost a, and a draft token costs about as much as the token it might save);
- each arm's decode steps (count S and tokens R, from the engine's counters: EngineMetrics.decode_steps and
  decode_rows), costed on that line, plus the prefill time P both arms share (busy seconds outside decode steps,
  off arm): bound = (a S_off + b R_off + P) / (a S_on + b R_on + P). The on arm's S and R follow from the acceptance
  it measured, so the bound is what speculation could give at that acceptance if drafting and verifying cost nothing
  beyond the forward; efficiency = ratio / bound (drafting, the accept rule's bookkeeping, noise).
--quick: the tiny model, a handful of requests (a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, report  # noqa: E402
from engine_throughput import RECIPE, grpo_requests, run_grpo, run_programs  # noqa: E402
from engine_throughput import workload as multiturn_workload  # noqa: E402

from loomrl.config import ModelConfig  # noqa: E402
from loomrl.config.engine import SpeculationConfig  # noqa: E402
from loomrl.config.load import load_config  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.engine.builtin.runner import Chunk  # noqa: E402
from loomrl.engine.readings import counter_changes, read_engine  # noqa: E402
from loomrl.model.loader import load_model, load_run_model  # noqa: E402

SWEEP = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)


def run_multiturn(engine: BuiltinEngine, prompts, observations, turns: int, new_tokens: int) -> tuple[int, float, dict]:
    """engine_throughput's programs; (tokens, seconds, the engine's counter changes)."""
    engine.call(engine.cache.clear).result()  # on the engine's thread: the cache is its
    before = read_engine(engine.metrics)
    made, seconds = run_programs(engine, prompts, observations, turns, new_tokens)
    return made, seconds, counter_changes(before, read_engine(engine.metrics))


def step_cost(engine: BuiltinEngine, context: int, sizes=SWEEP, repeats: int = 3) -> tuple[float, float, list]:
    """The runner's decode step seconds for n tokens over `context` cached tokens each (n sequences of one token;
    a draft token costs the same rows), fitted as a + b n by least squares; (a, b, [(n, seconds)])."""
    runner = engine.runner

    def sweep():
        points = []
        for n in sizes:
            kvs = [runner.new_kv(context + 2) for _ in range(n)]
            try:
                runner.forward([Chunk(kv, [7] * context, logits=0) for kv in kvs])
                times = []
                for _ in range(repeats):
                    for kv in kvs:
                        kv.length = context
                    t0 = time.perf_counter()
                    runner.forward([Chunk(kv, [7]) for kv in kvs])
                    times.append(time.perf_counter() - t0)
            finally:
                for kv in kvs:
                    kv.free()
            points.append((n, min(times)))
        return points

    points = engine.call(sweep).result()  # on the engine's thread, between steps: nothing else runs
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - b * mx, 0.0), b, points


def compare(name: str, run, engine: BuiltinEngine, repeats: int, a: float, b: float, quick: bool) -> dict:
    """Interleaved off/on runs of `run(engine)`; the medians, the bound and the efficiency."""
    arms: dict[str, list] = {"off": [], "on": []}
    for _ in range(repeats):
        for arm in ("off", "on"):
            engine.set_speculation(SpeculationConfig(enabled=arm == "on"))
            arms[arm].append(run(engine))
    out: dict = {}
    for arm, runs in arms.items():
        tokens, wall, c = sorted(runs, key=lambda r: r[1])[len(runs) // 2]  # the median run (by wall time), whole
        drafted = c["draft_tokens"] or 0
        out[arm] = {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(divide(tokens, wall, "wall"), 1),
                    "steps": c["steps"], "decode_steps": c["decode_steps"], "decode_rows": c["decode_rows"],
                    "draft_tokens": drafted,
                    "acceptance": round(c["accepted_tokens"] / drafted, 3) if drafted else None,
                    "tokens_per_seq_step": round(divide(c["decode_seq_tokens"], c["decode_seq_steps"],
                                                        "decode sequence-steps"), 3),
                    "draft_s": round(c["draft_s"] or 0.0, 3),
                    "prefill_s": max((c["busy_s"] or 0.0) - c["decode_s"], 0.0)}
    off, on = out["off"], out["on"]
    prefill = off["prefill_s"]
    cost_off = a * off["decode_steps"] + b * off["decode_rows"] + prefill
    cost_on = a * on["decode_steps"] + b * on["decode_rows"] + prefill
    ratio = divide(off["wall_s"], on["wall_s"], f"{name}: speculation's wall time")
    bound = divide(cost_off, cost_on, f"{name}: the costed decode steps with speculation")
    eff = efficiency(ratio, bound, f"{name} speculation", bound_tolerance(quick))
    return {"off": off, "on": on, "ratio": round(ratio, 3), "bound": round(bound, 3), "efficiency": round(eff, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=6, help="GRPO groups in the step (the demo trains 6 per step)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=0, help="0: the recipe's sampling.max_tokens")
    ap.add_argument("--checkpoint", default="", help="a trained run's checkpoint folder (its model/ is loaded)")
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="grpo,multiturn")
    ap.add_argument("--quick", action="store_true", help="the tiny model at smoke-test sizes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.quick:
        args.groups, args.group_size, args.programs, args.turns, args.new_tokens, args.repeats = 2, 4, 4, 2, 8, 1
    recipe = load_config(RECIPE)
    max_tokens = args.max_tokens or recipe.sampling.max_tokens
    models = [("tiny (quick)", ModelConfig(kind="tiny"), None)] if args.quick else \
        [("smollm2 as shipped", ModelConfig(kind="smollm2"), None)]
    skipped = []
    if args.checkpoint:
        models.append((f"trained checkpoint {args.checkpoint}", None, Path(args.checkpoint)))
    else:
        skipped.append("grpo from a trained checkpoint: no --checkpoint given (a run's RUN/checkpoints/step_N)")
    result: dict = {"benchmark": "speculative", "machine": machine(), "details": []}
    if args.quick:
        result["note"] = QUICK_NOTE
    workloads = args.workloads.split(",")
    for label, mcfg, ckpt in models:
        if ckpt is not None:
            model, tokenizer = load_run_model(recipe.model, ckpt)
        else:
            model, tokenizer = load_model(mcfg)
        model.float()
        # One engine for both arms, speculation switched between runs: a second engine's thread would run its torch
        # ops in a second OpenMP team, measured here to slow whichever engine runs second (BuiltinEngine.call).
        engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
        try:
            grpo = grpo_requests(tokenizer, args.groups, args.group_size, max_tokens)
            context = len(grpo[0].prompt_ids)
            a, b, points = step_cost(engine, context)
            result["details"].append(f"[{label}] step cost over {context}-token contexts: "
                                     + ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in points))
            result["details"].append(f"[{label}] fit c(n) = {a * 1000:.2f} ms + {b * 1000:.3f} ms x n; decoding turns "
                                     f"compute-bound at n* = a / b = {divide(a, b, 'step cost slope'):.1f} tokens/step")
            run_grpo(engine, grpo[:2])  # warm (first-call allocations)
            if "grpo" in workloads:
                key = f"grpo[{label}]"
                result[key] = compare(key, partial(run_grpo, requests=grpo), engine, args.repeats, a, b, args.quick)
            if "multiturn" in workloads and ckpt is None:
                prompts, observations = multiturn_workload(tokenizer, args.programs, 24)
                key = f"multiturn[{label}]"
                work = partial(run_multiturn, prompts=prompts, observations=observations, turns=args.turns,
                               new_tokens=args.new_tokens)
                result[key] = compare(key, work, engine, args.repeats, a, b, args.quick)
        finally:
            engine.close()
    for line in skipped:
        result["details"].append(f"skipped: {line}")
    result["settings"] = (f"groups {args.groups} x G {args.group_size}, max_tokens {max_tokens}, temperature 1; "
                          f"multiturn {args.programs} programs x {args.turns} turns x {args.new_tokens} tokens; "
                          f"repeats {args.repeats} (median runs); float32")
    report(result, args.json)


if __name__ == "__main__":
    main()
