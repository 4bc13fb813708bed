"""A discrete-event simulation of many GPU engine instances serving multi-turn agent programs in GRPO groups, to see how
the router's placement policies scale past this machine (dozens of instances, thousands of concurrent programs).

What is real and what is simulated:
- Real (the same code the router runs): every placement decision is `engine/placement.py`'s `Placer.choose`, over its
  per-instance `PrefixIndex` and `InstanceLoad` (given this simulation's clock through `InstanceLoad.clock`), followed
  by the bookkeeping `Router._place` and `Router._run` do around it (`Placer.placed`, the index's add of the prompt when
  sent and of prompt + output less its last token when finished, `load.start`/`load.end`). With `pool=True` the shared
  K/V pool is `engine/kv_pool.py`'s `SharedKVPool` (its put, get, eviction and version bookkeeping) priced for the placer
  by its `PoolFetch`: the K/V it stores is a miniature (1 layer, 1 head, head_dim 1) standing in for the real one, and
  its two rate fields are set to the cost model's after each put (on real K/V it measures them).
- Simulated: time only. An instance is a server with continuous batching: each step admits waiting requests (FIFO, up
  to `max_batch` running), prefills what they do not find in the instance's prefix cache (or fetch from the pool), and
  decodes one token for every running request. Its prefix cache is a `PrefixIndex` too (blocks of BLOCK tokens, least
  recently used dropped first, a hit capped below the last prompt token and block-aligned, as vLLM's and SGLang's block
  caches do). A program is an agent: turn after turn, its prompt is its last prompt + output + a tool observation,
  and between turns it waits on a tool for a lognormal time.

Not simulated: a K/V budget on running requests (no pause/restore: `engine/builtin/programs.py`'s ProgramTable is not
driven here, remaining work), chunked prefill, prefill/decode disaggregation, divided rollout, faults, weight updates
mid-rollout, network contention on the pool. Every figure of the cost model is printed with its source (`assumptions`);
where none was found it says "assumed".

The hit-rate bound: the prompt tokens one infinite cache shared by every instance would have served (everything any
request left in K/V before this one was admitted, with the same cap and block alignment). No placement and no pool can
beat it; affinity reaches it when every program and group stays on its instance and nothing is evicted.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.placement import BLOCK, InstanceLoad, Placer, Policy, PrefixIndex

if TYPE_CHECKING:
    from loomrl.engine.kv_pool import SharedKVPool

VERSION = 0  # one weight version for the whole rollout (no update mid-rollout is simulated)
MINI_BYTES_PER_TOKEN = 4  # the pool's stand-in K/V: [1 layer, K and V, 1 head, token, head_dim 1] in float16

# Each cost-model field's source: a citation, or "assumed" with the reasoning.
SOURCES = {
    "prefill_tokens_per_s": "derived: 989 TFLOP/s dense BF16 (NVIDIA H100 SXM datasheet) x 25% utilisation (assumed) / "
                            "16 GFLOP per token (2 x 8e9 parameters, Llama-3-8B)",
    "decode_base_s": "derived: 16 GB of BF16 weights read per step / 3.35 TB/s HBM3 (H100 SXM datasheet) = 4.8 ms, at "
                     "~75% of that roofline as measured for vLLM at batch 1 on an A100 (johnmusgrave.com, 'vLLM "
                     "throughput-latency sweep on NVIDIA A100': 75 tok/s, 77% of roofline) = 6.5 ms",
    "decode_per_seq_s": "derived: each running sequence reads its K/V every step: ~3k tokens x 128 KiB / 3.35 TB/s "
                        "= 0.12 ms, rounded up for attention overhead (assumed)",
    "kv_bytes_per_token": "Llama-3-8B: 2 (K,V) x 32 layers x 8 KV heads x head_dim 128 x 2 bytes (BF16) = 128 KiB",
    "transfer_bytes_per_s": "assumed: half of PCIe Gen5 x16's 64 GB/s per direction, or of a 400 Gb/s (50 GB/s) "
                            "InfiniBand NDR NIC (NVIDIA ConnectX-7), to a host-memory pool",
    "transfer_latency_s": "assumed: a fixed 1 ms per fetch (lookup, RDMA/DMA setup)",
    "kv_capacity_tokens": "derived: (80 GB x 0.9 (vLLM gpu_memory_utilization default) - 16 GB weights - ~4 GB "
                          "activations) / 128 KiB per token = ~400k tokens",
    "max_batch": "vLLM's default max_num_seqs (256)",
    "pool_tokens_per_instance": "assumed: 128 GiB of host memory per GPU for the pool / 128 KiB = 1M tokens",
    "tool_median_s": "assumed: median tool call of 2 s (code execution, search); no published distribution found",
    "tool_sigma": "assumed: lognormal sigma 1.0 (a long tail: p99 ~ 10x the median)",
}


@dataclass(slots=True, kw_only=True, frozen=True)
class CostModel:
    """Seconds per unit of work on one instance (defaults: Llama-3-8B, BF16, one H100 SXM; sources in SOURCES)."""

    prefill_tokens_per_s: float = 15_000.0
    decode_base_s: float = 0.0065  # a decode step at batch size 0 (weights read once per step)
    decode_per_seq_s: float = 0.00015  # added per running sequence
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    transfer_bytes_per_s: float = 25e9
    transfer_latency_s: float = 0.001
    kv_capacity_tokens: int = 400_000
    max_batch: int = 256
    pool_tokens_per_instance: int = 1_000_000
    tool_median_s: float = 2.0  # 0: no tool wait
    tool_sigma: float = 1.0

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def tool_s(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.tool_median_s), self.tool_sigma) if self.tool_median_s > 0 else 0.0

    def fetch_s(self, tokens: int) -> float:
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s if tokens else 0.0


@dataclass(slots=True, kw_only=True, frozen=True)
class Workload:
    """`groups` GRPO groups of `group_size` programs; each program runs `turns` turns. The siblings of a group share
    its first prompt (no prefix is shared across groups); each turn's output is `output_tokens` x a uniform factor in
    [1 - output_jitter, 1 + output_jitter], and each observation `obs_tokens`; lengths and tool waits are drawn per
    (program, turn) from `seed`, so every arm sees the same ones."""

    groups: int
    group_size: int = 8
    turns: int = 4
    prompt_tokens: int = 1024
    output_tokens: int = 256
    output_jitter: float = 0.5
    obs_tokens: int = 128
    seed: int = 0


@dataclass(slots=True, kw_only=True)
class SimResult:
    """One arm's figures; `wall_s` is simulated seconds."""

    policy: str
    instances: int
    programs: int
    requests: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # served from the instance's own prefix cache
    pool_tokens: int = 0  # fetched from the shared pool
    computed_tokens: int = 0  # prefilled: the prefill tokens recomputed
    bound_tokens: int = 0  # what one infinite shared cache would have served
    wall_bound_s: float = 0.0  # the longest program's path alone: its tool waits, decode at batch 1, bound's prefill
    busy_s: float = 0.0  # instance-seconds spent in steps, summed over the instances (GPU time used)
    max_queue: int = 0  # the most requests waiting (not yet admitted) at one instance at once
    placements: dict[str, int] = field(default_factory=dict)  # by Choice.reason

    @property
    def hit_rate(self) -> float:
        return (self.reused_tokens + self.pool_tokens) / max(self.prompt_tokens, 1)

    @property
    def hit_bound(self) -> float:
        return self.bound_tokens / max(self.prompt_tokens, 1)


@dataclass(slots=True, kw_only=True)
class _Turn:
    program: int
    request: GenerationRequest
    output: list[int]
    steps_left: int


def _floor_block(n: int) -> int:
    return n // BLOCK * BLOCK


def _usable(held: int, prompt_len: int) -> int:
    """Of `held` prompt tokens cached, those a block cache serves: never the last prompt token, whole blocks only."""
    return _floor_block(min(held, prompt_len - 1))


class ClusterSim:
    """One rollout of `workload` over `instances` simulated instances placed by the real Placer (`policy`), with or
    without a shared K/V pool; `run()` returns its SimResult."""

    def __init__(self, *, instances: int, policy: Policy, workload: Workload, cost: CostModel = CostModel(),
                 pool: bool = False, imbalance: int = 8):
        self.cost, self.workload, self.now = cost, workload, 0.0
        self.placer = Placer(policy=policy, indexes=[PrefixIndex(cost.kv_capacity_tokens) for _ in range(instances)],
                             loads=[InstanceLoad(clock=self.clock) for _ in range(instances)], imbalance=imbalance,
                             prefill_tokens_per_s=cost.prefill_tokens_per_s)
        self.caches = [PrefixIndex(cost.kv_capacity_tokens) for _ in range(instances)]  # what each engine holds
        self.bound = PrefixIndex(1 << 60)  # everything ever left in K/V: the hit-rate bound
        self.pool = self._make_pool(instances) if pool else None
        self.waiting: list[deque[_Turn]] = [deque() for _ in range(instances)]
        self.running: list[list[_Turn]] = [[] for _ in range(instances)]
        self.stepping = [False] * instances
        self.events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, program or instance)
        self.tie = itertools.count()
        self.contexts: list[list[int]] = []
        self.turns_done: list[int] = []
        self.paths: list[float] = []  # each program's seconds with no other program in the way (the wall bound)
        name = policy + ("+pool" if pool else "")
        self.result = SimResult(policy=name, instances=instances, programs=workload.groups * workload.group_size)

    def clock(self) -> float:
        return self.now

    def _make_pool(self, instances: int) -> SharedKVPool:
        from loomrl.engine.kv_pool import PoolFetch, SharedKVPool  # imports torch: only the pooled arms need it

        pool = SharedKVPool(capacity_bytes=instances * self.cost.pool_tokens_per_instance * MINI_BYTES_PER_TOKEN)
        pool.new_version(VERSION)
        self._price(pool)
        self.placer.fetch = PoolFetch(pool=pool, prefill_tokens_per_s=lambda: self.placer.prefill_tokens_per_s)
        return pool

    def _price(self, pool: SharedKVPool) -> None:
        """The pool's rates as the cost model's (a put measures them on its miniature K/V)."""
        pool.bytes_per_token = self.cost.kv_bytes_per_token
        pool.copy_bytes_per_s = self.cost.transfer_bytes_per_s

    # -- the workload -------------------------------------------------------------------------------------------
    def _draw(self, program: int, turn: int) -> random.Random:
        return random.Random(hash((self.workload.seed, program, turn)))

    def _tokens(self, program: int, turn: int, n: int, what: int) -> list[int]:
        """Fresh token ids, unique to (program, turn, what): nothing but a group's prompt is shared."""
        base = ((program * self.workload.turns + turn) * 2 + what + 1) << 20
        return list(range(base, base + n))

    def run(self) -> SimResult:
        w = self.workload
        for g in range(w.groups):
            prompt = list(range(g << 20, (g << 20) + w.prompt_tokens))  # below every program's ids: shared by siblings
            for s in range(w.group_size):
                self.contexts.append(list(prompt))
                self.turns_done.append(0)
                self.paths.append(0.0)
                self._at(0.0, "arrive", g * w.group_size + s)
        while self.events:
            self.now, _, kind, who = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(who)
            else:
                self._step_end(who)
        self.result.wall_s = self.now
        self.result.wall_bound_s = max(self.paths)
        return self.result

    def _at(self, t: float, kind: str, who: int) -> None:
        heapq.heappush(self.events, (t, next(self.tie), kind, who))

    # -- the router: the real Placer, and the bookkeeping Router._place and Router._run do around it -------------
    def _arrive(self, k: int) -> None:
        w, t = self.workload, self.turns_done[k]
        n_out = max(1, round(w.output_tokens * self._draw(k, t).uniform(1 - w.output_jitter, 1 + w.output_jitter)))
        request = GenerationRequest(prompt_ids=self.contexts[k], program_id=f"p{k}",
                                    group_id=f"g{k // w.group_size}", sampling=SamplingParams(max_tokens=n_out))
        choice = self.placer.choose(request)
        i = choice.instance
        r = self.result
        r.placements[choice.reason] = r.placements.get(choice.reason, 0) + 1
        self.placer.placed(request, i)
        self.placer.indexes[i].add(request.prompt_ids)
        self.placer.loads[i].start()
        self.waiting[i].append(_Turn(program=k, request=request, output=self._tokens(k, t, n_out, 0), steps_left=n_out))
        r.max_queue = max(r.max_queue, len(self.waiting[i]))
        if not self.stepping[i]:
            self._start_step(i)

    def _finish(self, i: int, turn: _Turn) -> None:
        self.placer.loads[i].end(True)
        prompt = turn.request.prompt_ids
        left = prompt + turn.output[:-1]  # the engine keeps the turn's K/V: prompt + output less its last token
        self.placer.indexes[i].add(left)
        self.caches[i].add(left)
        self.bound.add(left)
        if self.pool is not None:
            self._put(left)
        k, w = turn.program, self.workload
        self.turns_done[k] += 1
        self.result.requests += 1
        if self.turns_done[k] < w.turns:
            self.contexts[k] = prompt + turn.output + self._tokens(k, self.turns_done[k] - 1, w.obs_tokens, 1)
            wait = self.cost.tool_s(self._draw(k, -self.turns_done[k]))
            self.paths[k] += wait
            self._at(self.now + wait, "arrive", k)

    def _put(self, tokens: list[int]) -> None:
        from loomrl.engine.builtin.runner import SequenceKV  # the pooled arms only (torch)

        assert self.pool is not None
        kv = SequenceKV(1, 1, 1, len(tokens), self._dtype())
        kv.length = len(tokens)
        self.pool.put(tokens, kv, VERSION)
        self._price(self.pool)

    @staticmethod
    def _dtype():
        import torch

        return torch.float16

    # -- an instance: continuous batching, time from the cost model ---------------------------------------------
    def _admit(self, i: int, turn: _Turn) -> float:
        """Seconds this turn adds to the step that admits it: prefill what it lacks, fetch what the pool has."""
        prompt = turn.request.prompt_ids
        reused = _usable(self.caches[i].held(prompt), len(prompt))
        fetched = 0
        if self.pool is not None:
            n, _ = self.pool.get(prompt, VERSION, held=reused)
            fetched = max(0, _usable(n, len(prompt)) - reused)
        r = self.result
        r.prompt_tokens += len(prompt)
        r.reused_tokens += reused
        r.pool_tokens += fetched
        r.computed_tokens += len(prompt) - reused - fetched
        bound = _usable(self.bound.held(prompt), len(prompt))
        r.bound_tokens += bound
        self.paths[turn.program] += ((len(prompt) - bound) / self.cost.prefill_tokens_per_s
                                     + turn.steps_left * self.cost.decode_step_s(1))
        self.caches[i].add(prompt)
        self.bound.add(prompt)
        return (len(prompt) - reused - fetched) / self.cost.prefill_tokens_per_s + self.cost.fetch_s(fetched)

    def _start_step(self, i: int) -> None:
        seconds = 0.0
        while self.waiting[i] and len(self.running[i]) < self.cost.max_batch:
            turn = self.waiting[i].popleft()
            seconds += self._admit(i, turn)
            self.running[i].append(turn)
        self.stepping[i] = bool(self.running[i])
        if self.stepping[i]:
            seconds += self.cost.decode_step_s(len(self.running[i]))
            self.result.busy_s += seconds
            self._at(self.now + seconds, "step", i)

    def _step_end(self, i: int) -> None:
        still = []
        for turn in self.running[i]:
            turn.steps_left -= 1
            if turn.steps_left:
                still.append(turn)
            else:
                self._finish(i, turn)
        self.running[i] = still
        self._start_step(i)


def simulate(*, instances: int, policy: Policy, workload: Workload, cost: CostModel = CostModel(),
             pool: bool = False) -> SimResult:
    """One rollout of `workload` on `instances` instances under `policy` (and the shared pool when `pool`)."""
    return ClusterSim(instances=instances, policy=policy, workload=workload, cost=cost, pool=pool).run()


def assumptions(cost: CostModel, workload: Workload) -> list[str]:
    """Every figure the simulation uses, with its source."""
    lines = ["SIMULATED (not measured): a discrete-event model of GPU instances; placement by the real Placer"]
    for name in SOURCES:
        lines.append(f"  {name} = {getattr(cost, name)}  ({SOURCES[name]})")
    lines.append(f"  decode step = {cost.decode_base_s * 1e3:.1f} ms + {cost.decode_per_seq_s * 1e3:.2f} ms x batch "
                 f"({cost.decode_step_s(64) * 1e3:.1f} ms at batch 64)")
    lines.append(f"  workload: GRPO groups of {workload.group_size} programs, {workload.turns} turns each, "
                 f"prompt {workload.prompt_tokens}, output {workload.output_tokens} +-{workload.output_jitter:.0%}, "
                 f"observation {workload.obs_tokens} tokens, seed {workload.seed} (assumed: an agentic GRPO rollout)")
    return lines
