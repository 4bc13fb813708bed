"""The router's placement policies (engine/router.py) on N built-in engines in this process, in one run: affinity
against round_robin and least_loaded, and one engine alone, on a multi-turn grouped workload; and affinity and
each policy again with a shared K/V pool (engine/kv_pool.py) under the instances (`+pool`): a turn placed away from
the instance holding its prefix fetches what an earlier FINISHED turn left in the pool instead of recomputing it (a
group's siblings that start together find nothing there yet: their shared prompt is put only once a turn ends).

Workload: G GRPO groups of S programs; the S siblings of a group share its prompt (a long task statement that begins
with a token of its own, so groups share no prefix), and each program runs T turns, each turn's prompt its last one +
its sampled output + an observation. Every program samples with its own seeds, so every arm generates the same tokens
and makes the same requests, only where they run differs, except where a near-tied sample is rounded apart by
recomputing a prefix instead of reusing its K/V (counted and printed; the one engine with its prefix cache off differs
from it on as many): each arm's bound is taken from its own requests.

Figures per arm, from the instances' own counters (EngineMetrics, summed by the router):
- prefix hit rate: the workload's prompt tokens not computed (served from a prefix cache or the pool) / its prompt
  tokens (the +pd and +chunks arms' extra requests, prefills and later chunks, count only by what they compute). Bound: the share of prompt tokens that
  are a prefix of what an earlier request of the same program or group left in K/V (its prompt, and its prompt +
  output less the last token once finished; a request's last prompt token is always computed), in the order the
  workload makes them (turn by turn, siblings in order). A cache that held everything and a placement that always
  found it would reach it; efficiency = hit rate / bound (a count: a rate above its bound exits).
- prefill tokens recomputed: prompt tokens computed; bound: prompt tokens less the bound's reused ones.
- pool (the +pool arms): prompt tokens served from the pool (recompute avoided; counted in the hit rate too), its
  hits and bytes moved in and out.
- tokens/s: generated tokens / wall seconds. On this machine's 2 cores the N instances share the same cores (each its
  own thread and OpenMP team): the figure is printed as measured, not as a gain. What routing saves here is work (prefill
  tokens); that it turns into time needs one device per instance (unrun: no GPU here). No bound is claimed for
  tokens/s: with the tiny model a step is mostly per-step overhead, which several engine threads overlap.
- split (the +pd and +chunks arms, engine/split.py, over the pool): +pd makes the first --prefill-instances instances
  prefill only (each prompt with enough left to compute runs there with max_tokens 1, its token discarded, and its
  K/V goes to the pool) and the rest decode, fetching it; +chunks divides each turn into chunks of --chunk-tokens,
  each later one on the least loaded instance, fetching the chunk before's K/V. Figures: prompts prefilled, tokens
  discarded, prefill tokens the decode instances computed, pool tokens served, chunks and chunks moved. Work moved
  and saved, not speed: on 2 cores a prefill instance shares the cores it would free.
--quick: the same path at smoke-test sizes (figures not results).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, divide, efficiency, machine, report  # noqa: E402

from loomrl.config import ModelConfig  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.engine.kv_pool import PoolFetch, SharedKVPool  # noqa: E402
from loomrl.engine.router import Router  # noqa: E402
from loomrl.engine.split import SplitPlan  # noqa: E402
from loomrl.model.loader import load_model  # noqa: E402
from loomrl.tokens import common_prefix_len  # noqa: E402

POLICIES = ("affinity", "least_loaded", "round_robin")
POOLED = ("affinity+pool", "least_loaded+pool", "round_robin+pool")
SPLIT = ("affinity+pd", "affinity+chunks", "affinity+pd+chunks")  # engine/split.py, each over the pool


def workload(tokenizer, groups: int, size: int, prompt_len: int, obs_len: int):
    """[(group id, program id, first prompt, observation)]: siblings share their group's first prompt."""
    out = []
    for g in range(groups):
        text = f"Problem {g}: " + " ".join(f"crate {g}-{j} holds {j + 3 * g} apples." for j in range(80))
        prompt = [1000 + g] + tokenizer.encode(text)[: prompt_len - 1]  # a first token of its own: no shared prefix
        obs = tokenizer.encode(f" Tool result for problem {g}: the sum is {17 * g + 4}. Continue." * 3)[:obs_len]
        out += [(f"g{g}", f"g{g}s{s}", prompt, obs) for s in range(size)]
    return out


def run_arm(engine, programs, turns: int, new_tokens: int):
    """All programs at once, each its turns in order. Returns (seconds, the requests made with their outputs)."""
    made: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (turn, program index) -> (prompt, output)

    async def program(k, gid, pid, prompt, obs):
        ctx = list(prompt)
        for t in range(turns):
            r = await engine.generate(GenerationRequest(
                prompt_ids=ctx, program_id=pid, group_id=gid,
                sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=7919 * k + t)))
            made[(t, k)] = (ctx, r.token_ids)
            ctx = ctx + r.token_ids + obs

    async def everything():
        await asyncio.gather(*[program(k, *p) for k, p in enumerate(programs)])

    t0 = time.perf_counter()
    asyncio.run(everything())
    return time.perf_counter() - t0, made


def reuse_bound(programs, made) -> int:
    """Prompt tokens that are a prefix of what an earlier request of the same program or group left in K/V."""
    held: dict[str, list[list[int]]] = {}  # program or group -> token sequences its earlier requests left
    total = 0
    for t, k in sorted(made):
        gid, pid = programs[k][0], programs[k][1]
        prompt, output = made[(t, k)]
        best = max((common_prefix_len(prompt, seq) for key in (gid, pid) for seq in held.get(key, [])), default=0)
        total += min(best, len(prompt) - 1)
        for key in (gid, pid):
            held.setdefault(key, []).extend([prompt, prompt + output[:-1]])
    return total


def measure(name, model, tokenizer, programs, args):
    instances = 1 if name == "one_engine" else args.instances
    policy, *extras = name.split("+")
    pool = SharedKVPool(capacity_bytes=args.pool_mib << 20) if extras else None
    split = SplitPlan(pool=pool, prefill_instances=args.prefill_instances if "pd" in extras else 0,
                      min_prompt_tokens=args.pd_min_prompt_tokens,
                      chunk_tokens=args.chunk_tokens if "chunks" in extras else None) if set(extras) - {"pool"} else None
    engines = [BuiltinEngine(model if i == 0 else copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id, seed=i,
                             kv_pool=pool) for i in range(instances)]
    engine = engines[0] if name == "one_engine" else Router(engines, policy=policy, split=split)
    if pool is not None and isinstance(engine, Router):
        router = engine  # the placer weighs fetching from the pool against recomputing, at its measured rate
        router.placer.fetch = PoolFetch(pool=pool, prefill_tokens_per_s=lambda: router.placer.prefill_tokens_per_s)
    try:
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=2))))
        base = {k: sum(getattr(e.metrics, k) for e in engines) for k in ("prompt_tokens", "reused_tokens",
                                                                           "prefill_tokens", "generated_tokens")}
        base_decode = [e.metrics.prefill_tokens for e in engines[args.prefill_instances:]]
        seconds, made = run_arm(engine, programs, args.turns, args.new_tokens)
        got = {k: sum(getattr(e.metrics, k) for e in engines) - v for k, v in base.items()}
        placements = dict(engine.placement.placements) if isinstance(engine, Router) else {}
        split_counts = engine.split.metrics.counts() if isinstance(engine, Router) and engine.split else None
        decode_prefill = sum(e.metrics.prefill_tokens for e in engines[args.prefill_instances:]) - sum(
            base_decode) if split is not None and split.prefill_instances else None
    finally:
        engine.close()
    bound = reuse_bound(programs, made)
    # the workload's prompt tokens: the instances' own count adds the split's extra requests (prefills, later chunks)
    prompt_tokens = sum(len(prompt) for prompt, _ in made.values())
    hit = divide(prompt_tokens - got["prefill_tokens"], prompt_tokens, f"{name}: prompt tokens not computed / prompt "
                 "tokens")
    hit_bound = divide(bound, prompt_tokens, f"{name}: bound reused tokens / prompt tokens")
    return {"arm": name, "instances": instances, "seconds": seconds, "hit_rate": hit, "hit_bound": hit_bound,
            # counts, not timings: a hit rate above its bound means the bound is wrong (no tolerance)
            "efficiency": efficiency(hit, hit_bound, f"router {name} hit rate", tolerance=0.0),
            "prompt_tokens": prompt_tokens, "prefill_tokens": got["prefill_tokens"],
            "prefill_bound": prompt_tokens - bound,
            "tokens_per_s": divide(got["generated_tokens"], seconds, f"{name}: generated tokens / seconds"),
            "placements": placements, "made": made, "split": split_counts, "decode_prefill_tokens": decode_prefill,
            "pool": {k: getattr(pool.metrics, k) for k in ("tokens_served", "hits", "misses", "bytes_in", "bytes_out",
                                                           "evictions")} if pool is not None else None}


def describe(rows, args) -> list[str]:
    """The per-arm lines and the work affinity saves; drops each arm's requests after counting how many differ."""
    one = rows[0]
    for r in rows:  # seeded: the same tokens, but for near-ties that recomputing instead of reusing K/V rounds apart
        r["differ"] = sum(out != one["made"][key][1] for key, (_, out) in r["made"].items())
    for r in rows:
        del r["made"]
    details = [
        f"{r['arm']} ({r['instances']} instance{'s' if r['instances'] > 1 else ''}): prefix hit rate "
        f"{r['hit_rate']:.3f} of bound {r['hit_bound']:.3f} (efficiency {r['efficiency']:.2f}); prefill tokens "
        f"recomputed {r['prefill_tokens']} (bound {r['prefill_bound']}, of {r['prompt_tokens']} prompt tokens); "
        f"{r['tokens_per_s']:.0f} tokens/s ({divide(r['tokens_per_s'], one['tokens_per_s'], 'tokens/s ratio'):.2f}x "
        f"one engine's); placements {r['placements'] or '-'}; outputs that differ from one "
        f"engine's: {r['differ']} of {args.groups * args.group_size * args.turns}"
        + (f"; pool: {r['pool']['tokens_served']} prompt tokens served ({r['pool']['hits']} hits, "
           f"{r['pool']['misses']} misses, {r['pool']['bytes_in'] / 2**20:.1f} MiB in, "
           f"{r['pool']['bytes_out'] / 2**20:.1f} MiB out, {r['pool']['evictions']} evictions)" if r["pool"] else "")
        + (f"; split: {r['split']['router_pd_prefills']} prompts prefilled on the prefill instance "
           f"({r['split']['router_pd_skipped']} sent straight to decode, {r['split']['router_pd_discarded_tokens']} "
           f"sampled tokens discarded, {r['split']['router_pd_fetched_tokens']} prompt tokens in the pool at hand-off), "
           f"prefill tokens on the decode instances {r['decode_prefill_tokens'] if r['decode_prefill_tokens'] is not None else '-'}; {r['split']['router_chunks']} later "
           f"chunks of {r['split']['router_divided']} divided requests, {r['split']['router_chunks_moved']} moved to "
           "another instance" if r["split"] else "")
        for r in rows
    ]
    arms = {r["arm"]: r for r in rows}
    aff = arms["affinity"]
    for other in ("least_loaded", "round_robin"):
        saved = arms[other]["prefill_tokens"] - aff["prefill_tokens"]
        details.append(f"affinity saves {saved} prefill tokens against {other} "
                       f"({divide(saved, arms[other]['prefill_tokens'], 'saved share'):.0%} of its prefill work)")
    for policy in POLICIES:
        saved = arms[policy]["prefill_tokens"] - arms[f"{policy}+pool"]["prefill_tokens"]
        details.append(f"the pool saves {saved} prefill tokens under {policy} "
                       f"({divide(saved, arms[policy]['prefill_tokens'], 'pool saved share'):.0%} of its prefill "
                       f"work; bound {arms[policy]['prefill_tokens'] - arms[policy]['prefill_bound']})")
    for name in SPLIT:
        r = arms[name]
        details.append(f"{name}: prefill tokens recomputed {r['prefill_tokens']} against affinity+pool's "
                       f"{arms['affinity+pool']['prefill_tokens']} (pool served {r['pool']['tokens_served']} prompt "
                       f"tokens{'; the decode instances computed ' + str(r['decode_prefill_tokens']) if r['decode_prefill_tokens'] is not None else ''})")
    details.append("divided rollout samples each later chunk with a seed of its own (engine/split.py chunk_seed): its "
                   "arms' outputs are distributed as one engine's but are not its tokens, so they differ by design; the "
                   "PD split's prefill runs each prompt with max_tokens 1 and discards the token (counted above)")
    details.append("outputs differ only where a prefix was recomputed instead of reused: float32 rounding of a "
                   "chunked prefill against the K/V decoding left flips a near-tied seeded sample (the one engine "
                   "with engine.prefix_cache off does the same); each arm's bound is taken from its own requests")
    details.append("2 cores, no GPU: the instances share the same cores, so a speed gain from several instances "
                   "cannot be shown honestly here; the work saved (prefill tokens) is the result. tokens/s is printed "
                   "as measured, with no bound: where a step is mostly per-step overhead (the tiny model) several "
                   "engine threads overlap it and may beat one engine; where it is compute (a real model) they split "
                   "the same two cores")
    return details


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="tiny")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--obs-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--pool-mib", type=int, default=512, help="the shared K/V pool's bound, MiB (the +pool arms)")
    ap.add_argument("--prefill-instances", type=int, default=1, help="the +pd arms: instances that only prefill")
    ap.add_argument("--pd-min-prompt-tokens", type=int, default=32, help="the +pd arms: shorter work goes to decode")
    ap.add_argument("--chunk-tokens", type=int, default=8, help="the +chunks arms: tokens per chunk")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.instances, args.groups, args.group_size, args.turns = 3, 2, 2, 2
        args.prompt_len, args.obs_len, args.new_tokens, args.chunk_tokens = 64, 16, 4, 2
    model, tokenizer = load_model(ModelConfig(kind=args.model))
    programs = workload(tokenizer, args.groups, args.group_size, args.prompt_len, args.obs_len)
    rows = [measure(name, model, tokenizer, programs, args) for name in ("one_engine", *POLICIES, *POOLED, *SPLIT)]
    details = describe(rows, args)
    aff = rows[1]  # the affinity arm (POLICIES[0])
    if args.quick:
        details.append(QUICK_NOTE)
    report({
        "name": "router",
        "machine": machine(),
        "model": args.model,
        "workload": f"{args.groups} groups x {args.group_size} programs x {args.turns} turns, prompt {args.prompt_len} "
                    f"tokens, observation {args.obs_len}, {args.new_tokens} new tokens per turn, "
                    f"{args.instances} instances",
        "ratio": round(aff["hit_rate"], 3),
        "bound": round(aff["hit_bound"], 3),
        "efficiency": round(aff["efficiency"], 3),
        "summary_of": "affinity's prefix hit rate against its bound",
        "arms": {r["arm"]: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
