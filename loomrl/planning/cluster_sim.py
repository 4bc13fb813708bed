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
- Real too: each instance's ProgramTable (`engine/builtin/programs.py`, the built-in engine's own class, driven by the
  simulated clock): it sees every arrival, admission (with the hit and the wait), finish and release, and its policy
  (`program_policy`: lru, smallest_first, longest_wait) picks the program to pause when the instance's K/V budget
  (the cost model's, from the GPU's memory less weights and activations) needs room; a paused program's next turn
  restores by recompute, or from the pool (`ProgramTable.fetch`). The instance's memory rules are the built-in
  scheduler's, over token counts (planning/sim_instance.py).
- Simulated: time, and the K/V tensors. An instance is a server with continuous batching: each step admits waiting
  requests (FIFO, up to `max_batch` running, while the budget allows), prefills what they do not find in its cache (or
  fetch from the pool), and decodes one token for every running request. Its cache holds one entry per program (its
  last turn's K/V, whole blocks of BLOCK tokens; a hit is capped below the last prompt token, as vLLM's and SGLang's
  block caches do). A program is an agent: turn after turn, its prompt is its last prompt + output + a tool
  observation, and between turns it waits on a tool for a lognormal time; after its last turn it is released.
  Decode steps with nothing to admit run back to back as one event, cut short by an arrival at the step boundary
  after it, so the rollout is the one a step-by-step run gives (a test compares both).

Not simulated: chunked prefill, prefill/decode disaggregation, divided rollout, faults, weight updates mid-rollout,
network contention on the pool, sharing of one K/V block between programs inside an instance (each program's entry is
its own copy, as in the built-in engine; vLLM's and SGLang's paged caches share a group's prompt blocks, so the budget
binds them later than here). Every figure of the cost model is printed with its source (`assumptions`,
planning/sim_costs.py); where none was found it says "assumed".

The hit-rate bound: the prompt tokens one infinite cache shared by every instance would have served (everything any
request left in K/V before this one was admitted, with the same cap and block alignment). No placement and no pool can
beat it; affinity reaches it when every program and group stays on its instance and nothing is evicted.
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import TYPE_CHECKING

from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.programs import ProgramPolicy, ProgramTable
from loomrl.engine.placement import BLOCK, InstanceLoad, Placer, Policy, PrefixIndex
from loomrl.planning.sim_costs import SIMULATED, CostModel, cost_lines
from loomrl.planning.sim_instance import SimInstance, SimTurn, extend_hashes, usable
from loomrl.planning.sim_records import SimResult, Workload

__all__ = ["ClusterSim", "CostModel", "SimResult", "Workload", "assumptions", "simulate"]

if TYPE_CHECKING:
    from loomrl.engine.kv_pool import SharedKVPool

VERSION = 0  # one weight version for the whole rollout (no update mid-rollout is simulated)
DEFAULT_COST = CostModel()
MINI_BYTES_PER_TOKEN = 4  # the pool's stand-in K/V: [1 layer, K and V, 1 head, token, head_dim 1] in float16


class ClusterSim:
    """One rollout of `workload` over `instances` simulated instances placed by the real Placer (`policy`), each with a
    real ProgramTable (`program_policy`) under the cost model's K/V budget, with or without a shared K/V pool; `run()`
    returns its SimResult."""

    def __init__(self, *, instances: int, policy: Policy, workload: Workload, cost: CostModel = DEFAULT_COST,
                 pool: bool = False, imbalance: int = 8, program_policy: ProgramPolicy = "lru"):
        self.cost, self.workload, self.now = cost, workload, 0.0
        budget = cost.kv_capacity_tokens
        self.placer = Placer(policy=policy, indexes=[PrefixIndex(budget) for _ in range(instances)],
                             loads=[InstanceLoad(clock=self.clock) for _ in range(instances)], imbalance=imbalance,
                             prefill_tokens_per_s=cost.prefill_tokens_per_s)
        self.pool = self._make_pool(instances) if pool else None
        self.nodes = [SimInstance(budget=budget, max_batch=cost.max_batch,
                                  table=ProgramTable(program_policy, clock=self.clock, pool=self.pool,
                                                     version=lambda: VERSION))
                      for _ in range(instances)]
        self.bound: set[int] = set()  # every block ever left in K/V: the hit-rate bound (an infinite shared cache)
        self.stepping = [False] * instances
        self.runs: list[tuple[float, float, int]] = [(0.0, 0.0, 1)] * instances  # (start, step seconds, steps)
        self.live: list[int] = [-1] * instances  # the tie-break of each instance's pending step event
        self.runs_ahead = True  # False: one event per step (a test checks both give the same rollout)
        self.events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, program or instance)
        self.tie = itertools.count()
        self.contexts: list[list[int]] = []
        self.hashes: list[list[int]] = []  # block hashes of each program's context
        self.turns_done: list[int] = []
        self.paths: list[float] = []  # each program's seconds with no other program in the way (the wall bound)
        self.result = SimResult(policy=policy + ("+pool" if pool else ""), program_policy=program_policy,
                                instances=instances, programs=workload.groups * workload.group_size, kv_budget=budget)

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
                self.hashes.append(extend_hashes([], prompt))
                self.turns_done.append(0)
                self.paths.append(0.0)
                self._at(0.0, "arrive", g * w.group_size + s)
        while self.events:
            t, tie, kind, who = heapq.heappop(self.events)
            if kind == "step" and tie != self.live[who]:
                continue  # a run of steps cut short by an arrival: its later end stands
            self.now = t
            if kind == "arrive":
                self._arrive(who)
            else:
                self._step_end(who)
        return self._close()

    def _close(self) -> SimResult:
        r = self.result
        r.wall_s, r.wall_bound_s = self.now, max(self.paths)
        for node in self.nodes:
            m, c = node.table.metrics, node.counters
            r.pauses += m.paused
            r.restore_tokens += m.recomputed_tokens
            r.max_wait_s = max(r.max_wait_s, m.max_wait_s)
            r.restores_pool += c.restores_pool
            r.restores_recompute += c.restores_recompute
            r.preemptions += c.preemptions
            r.max_held = max(r.max_held, c.max_held)
            r.over_budget += c.over_budget
        return r

    def _at(self, t: float, kind: str, who: int) -> int:
        tie = next(self.tie)
        heapq.heappush(self.events, (t, tie, kind, who))
        return tie

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
        node = self.nodes[i]
        node.table.started(request)  # the engine's generate: the program reasons
        node.waiting.append(SimTurn(program=k, request=request, output=self._tokens(k, t, n_out, 0), steps_left=n_out,
                                    queued_at=self.now, prompt=request.prompt_ids, hashes=self.hashes[k]))
        r.max_queue = max(r.max_queue, len(node.waiting))
        if not self.stepping[i]:
            self._start_step(i)
        else:
            self._interrupt(i)

    def _finish(self, i: int, turn: SimTurn) -> None:
        self.placer.loads[i].end(True)
        prompt, k, w, r = turn.request.prompt_ids, turn.program, self.workload, self.result
        left = prompt + turn.output[:-1]  # the engine keeps the turn's K/V: prompt + output less its last token
        self.placer.indexes[i].add(left)
        kept = extend_hashes(turn.hashes, left)
        node = self.nodes[i]
        node.set_entry(turn.pid, kept)
        node.table.finished(turn.pid, len(kept) * BLOCK)  # a block cache keeps whole blocks
        self.bound.update(kept)
        if self.pool is not None:
            self._put(left)
        self.turns_done[k] += 1
        r.requests += 1
        r.decoded_tokens += len(turn.output)
        if self.turns_done[k] == w.turns:
            r.programs_done += 1
            self.placer.programs.pop(turn.pid, None)  # Router.release: the program's home instance releases it
            node.release(turn.pid)
            return
        self.contexts[k] = prompt + turn.output + self._tokens(k, self.turns_done[k] - 1, w.obs_tokens, 1)
        self.hashes[k] = extend_hashes(kept, self.contexts[k])
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

    # -- an instance: continuous batching under its K/V budget, time from the cost model -----------------------
    def _fetch(self, i: int, turn: SimTurn) -> int:
        """Prompt tokens past the instance's cache that the pool serves, through the instance's ProgramTable."""
        if self.pool is None:
            return 0
        n, _ = self.nodes[i].table.fetch(turn.pid, turn.prompt, turn.reused)
        return max(0, usable(n, len(turn.prompt)) - turn.reused)

    def _admitted(self, i: int, turn: SimTurn, hit: int) -> float:
        """Account an admission; the seconds it adds to its step: prefill what it lacks, fetch what the pool has."""
        node, n_prompt, r = self.nodes[i], len(turn.prompt), self.result
        program = node.table.get(turn.pid)
        expected = min(program.prefix_tokens, n_prompt - 1) if program is not None else 0
        if expected > turn.reused:  # the K/V its last turn left here is (partly) gone: a restore
            if hit >= expected:
                node.counters.restores_pool += 1
            else:
                node.counters.restores_recompute += 1
        node.table.admitted(turn.request, n_prompt, hit, self.now - turn.queued_at)
        computed = n_prompt - hit
        r.admissions += 1
        r.prompt_tokens += n_prompt
        r.reused_tokens += turn.reused
        r.pool_tokens += turn.fetched
        r.computed_tokens += computed
        bound = 0
        for h in turn.hashes:
            if h not in self.bound:
                break
            bound += BLOCK
        bound = usable(bound, n_prompt)
        r.bound_tokens += bound
        if turn.prompt is turn.request.prompt_ids:  # a first admission (a preempted turn's prompt is a new list)
            self.paths[turn.program] += ((n_prompt - bound) / self.cost.prefill_tokens_per_s
                                         + turn.steps_left * self.cost.decode_step_s(1))
        self.bound.update(turn.hashes)
        return computed / self.cost.prefill_tokens_per_s + self.cost.fetch_s(turn.fetched)

    def _start_step(self, i: int) -> None:
        node, seconds = self.nodes[i], 0.0
        while node.waiting and len(node.running) < self.cost.max_batch:
            turn = node.waiting[0]
            turn.reused = usable(node.cached(turn.hashes), len(turn.prompt))
            if not node.make_room(node.need(turn, turn.reused)) and node.running:
                break  # it waits for running turns to finish
            turn.fetched = self._fetch(i, turn)
            node.admit(turn)
            seconds += self._admitted(i, turn, turn.reused + turn.fetched)
        node.preempt_if_needed()
        self.stepping[i] = bool(node.running)
        if not self.stepping[i]:
            return
        step = self.cost.decode_step_s(len(node.running))
        # steps that only decode run back to back in one event (nothing changes between them); an arrival cuts the
        # run short at the boundary after it (_interrupt), where a step-by-step run would have admitted it
        k = node.steps_ahead() if self.runs_ahead and seconds == 0.0 and not node.waiting else 1
        self.runs[i] = (self.now + seconds, step, k)
        self.result.busy_s += seconds + k * step
        self.live[i] = self._at(self.now + seconds + k * step, "step", i)

    def _interrupt(self, i: int) -> None:
        """An arrival at instance i during its run of decode steps: the run ends at the step boundary after now."""
        t0, step, k = self.runs[i]
        cut = min(k, max(1, int((self.now - t0) // step) + 1))
        if cut < k:
            self.runs[i] = (t0, step, cut)
            self.result.busy_s -= (k - cut) * step
            self.live[i] = self._at(max(self.now, t0 + cut * step), "step", i)

    def _step_end(self, i: int) -> None:
        for turn in self.nodes[i].decode(self.runs[i][2]):
            self._finish(i, turn)
        self._start_step(i)


def simulate(*, instances: int, policy: Policy, workload: Workload, cost: CostModel = DEFAULT_COST,
             pool: bool = False, program_policy: ProgramPolicy = "lru") -> SimResult:
    """One rollout of `workload` on `instances` instances under `policy` and `program_policy` (and the shared pool
    when `pool`)."""
    return ClusterSim(instances=instances, policy=policy, workload=workload, cost=cost, pool=pool,
                      program_policy=program_policy).run()


def assumptions(cost: CostModel, workload: Workload) -> list[str]:
    """Every figure the simulation uses, with its source."""
    lines = [f"{SIMULATED}: a discrete-event model of GPU instances; placement by the real Placer, pauses by the real "
             f"ProgramTable, K/V budget {cost.kv_capacity_tokens} tokens per instance"]
    lines += cost_lines(cost)
    lines.append(f"  workload: GRPO groups of {workload.group_size} programs, {workload.turns} turns each, "
                 f"prompt {workload.prompt_tokens}, output {workload.output_tokens} +-{workload.output_jitter:.0%}, "
                 f"observation {workload.obs_tokens} tokens, seed {workload.seed} (assumed: an agentic GRPO rollout)")
    return lines
