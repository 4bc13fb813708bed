"""Prefix cache on vs off in the built-in engine, in one run, on two workloads:

- grpo: groups of G samples of one prompt (the prompt's K/V is computed once per group);
- multiturn: programs whose every turn extends the previous one (the history's K/V is kept
  between turns under the program id).

Bound: if a fraction h of prompt tokens is served from the cache and prefill adds a fraction f of the
cache-off run's time, the best possible speed-up is 1 / (1 - h * f). h comes from the cache-on run: reused / prompt
tokens, the changes of the engine's own counters (engine.metrics, which its scheduler counts into) over the pass.
f = (off - warm) / off, where warm is the same workload run a second time on the cache-on engine,
whose cache then holds every prompt (the same seeds give the same tokens): what is left is the decode
work. (The cache-off run's requests replayed with max_tokens=1, the prefill alone, take longer than
what prefill adds to the run: decode tokens ride along in the prefill steps almost free, because a
decode step's cost is mostly streaming the weights. That replay-based fraction is printed too.)
efficiency = measured ratio / bound, checked by _common.efficiency (a ratio above its bound exits). Nothing is
simulated. --quick: the same path at smoke-test sizes (figures not results).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, report  # noqa: E402

from loomrl.config import ModelConfig  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.engine.readings import counter_changes, read_engine  # noqa: E402
from loomrl.model.loader import load_model  # noqa: E402

SYSTEM = ("You are a careful assistant that solves arithmetic word problems with a calculator tool. "
          "Read the problem, decide which numbers matter, call the tool with one expression, read the "
          "result, and answer with one sentence. ")


def grpo_programs(tokenizer, groups: int, group_size: int, prompt_len: int):
    out = []
    for g in range(groups):
        text = SYSTEM + f"Problem {g}: " + " ".join(f"item{g}-{j} costs {j + g} coins." for j in range(60))
        prompt = tokenizer.encode(text)[:prompt_len]
        out += [(f"g{g}s{s}", prompt, [], 1) for s in range(group_size)]
    return out  # (program id, first prompt, observation, turns)


def multiturn_programs(tokenizer, programs: int, turns: int, obs_tokens: int):
    out = []
    for p in range(programs):
        prompt = tokenizer.encode(SYSTEM + f"Problem {p}: Ana has {p + 20} coins and gets {p + 3} more.")
        obs = tokenizer.encode(f" Result: {2 * p + 23}. The calculator ran without errors and returned one value." * 2)
        out.append((f"m{p}", prompt, obs[:obs_tokens], turns))
    return out


def run(model, tokenizer, programs, new_tokens: int, cache: bool, replay: list | None = None, passes: int = 1):
    """Run the workload `passes` times on one engine; returns ([seconds per pass], metrics of the
    first pass, the requests made)."""
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, prefix_cache=cache)
    made: list[list[int]] = []

    async def program(pid, prompt, obs, turns):
        ctx = list(prompt)
        for t in range(turns):
            made.append(list(ctx))
            r = await engine.generate(GenerationRequest(
                prompt_ids=ctx, program_id=pid,
                sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=sum(map(ord, pid)) * 7 + t)))
            ctx = ctx + r.token_ids + obs

    async def replayed(reqs):
        await asyncio.gather(*[engine.generate(GenerationRequest(prompt_ids=r, sampling=SamplingParams(max_tokens=1)))
                               for r in reqs])

    async def everything():
        if replay is not None:
            await replayed(replay)
        else:
            await asyncio.gather(*[program(*p) for p in programs])

    asyncio.run(engine.generate(GenerationRequest(prompt_ids=programs[0][1][:8], sampling=SamplingParams(max_tokens=2))))
    times, counts = [], None
    for _ in range(passes):
        # The scheduler counts prompt, reused and prefill tokens into the record it was given at start, so a pass's
        # counts are the changes of that record across the pass (replacing engine.metrics would leave the scheduler
        # counting into the old record, and this pass would read a hit rate of 0).
        before = read_engine(engine.metrics)
        t0 = time.perf_counter()
        asyncio.run(everything())
        times.append(time.perf_counter() - t0)
        counts = counts or counter_changes(before, read_engine(engine.metrics))
    engine.close()
    return times, counts, made


def measure(name, model, tokenizer, programs, new_tokens, repeats, tolerance):
    ons, offs, pres, warms = [], [], [], []
    for _ in range(repeats):
        (off_s,), _, reqs = run(model, tokenizer, programs, new_tokens, cache=False)
        (on_s, warm_s), on_m, _ = run(model, tokenizer, programs, new_tokens, cache=True, passes=2)
        (pre_s,), _, _ = run(model, tokenizer, programs, new_tokens, cache=False, replay=reqs)
        ons.append(on_s)
        offs.append(off_s)
        pres.append(pre_s)
        warms.append(warm_s)
    from statistics import median

    ratio = divide(median(offs), median(ons), f"{name}: cache-off seconds / cache-on seconds")
    h = divide(on_m["reused_tokens"], on_m["prompt_tokens"], f"{name}: reused prompt tokens / prompt tokens")
    f = min(max(1.0 - median(warms) / median(offs), 0.0), 1.0)
    bound = divide(1.0, 1.0 - h * f, f"{name}: bound 1 / (1 - h * f)")
    return {
        "workload": name, "ratio": ratio, "bound": bound,
        "efficiency": efficiency(ratio, bound, f"prefix_cache {name}", tolerance),
        "hit_rate": h,
        "prefill_fraction": f, "prefill_alone_fraction": min(median(pres) / median(offs), 1.0),
        "seconds_on": median(ons), "seconds_off": median(offs), "seconds_warm": median(warms),
        "reused_tokens": on_m["reused_tokens"], "prefill_tokens_on": on_m["prefill_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--obs-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.group_size, args.prompt_len = 2, 4, 64
        args.programs, args.turns, args.new_tokens, args.obs_tokens, args.repeats = 2, 2, 4, 16, 1
    model, tokenizer = load_model(ModelConfig(kind=args.model))
    rows = [
        measure("grpo", model, tokenizer, grpo_programs(tokenizer, args.groups, args.group_size, args.prompt_len),
                args.new_tokens, args.repeats, bound_tolerance(args.quick)),
        measure("multiturn", model, tokenizer, multiturn_programs(tokenizer, args.programs, args.turns, args.obs_tokens),
                args.new_tokens, args.repeats, bound_tolerance(args.quick)),
    ]
    details = [
        f"{r['workload']}: off {r['seconds_off']:.1f}s, on {r['seconds_on']:.1f}s, ratio {r['ratio']:.2f}, hit rate "
        f"{r['hit_rate']:.2f}, prefill fraction {r['prefill_fraction']:.2f} (warm pass {r['seconds_warm']:.1f}s; "
        f"prefill alone would say {r['prefill_alone_fraction']:.2f}), bound {r['bound']:.2f}, "
        f"efficiency {r['efficiency']:.2f}"
        for r in rows
    ]
    if args.quick:
        details.append(QUICK_NOTE)
    worst = min(rows, key=lambda r: r["efficiency"])
    report({
        "name": "prefix_cache",
        "machine": machine(),
        "model": args.model,
        "ratio": round(worst["ratio"], 3),
        "bound": round(worst["bound"], 3),
        "efficiency": round(worst["efficiency"], 3),
        "summary_of": f"the workload with the lowest efficiency ({worst['workload']})",
        "arms": {r["workload"]: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
