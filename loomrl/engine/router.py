"""Router: the Engine protocol over N engine instances (engine.instances > 1), so that every caller (the agent loop, the
gateway, `loomrl serve`, the runtime's weight route) is unchanged.

Placement (placement.py): round_robin, least_loaded, or affinity (a program's turns and a GRPO group's siblings stay on
one instance unless it is overloaded; otherwise a cost of queueing against recomputing the prefix it lacks, from a
router-side prefix index scoped to the weight version). Weights, interrupts, sleep and wake fan out to every instance;
the router reports a version only once every instance serves it, and a failure names the instance. An instance that
fails a weight update the others passed (a replica killed, a device lost) is retired (engine.retire_failed_instances,
on by default): closed, logged by name, never placed on again, left out of every later update and fingerprint, so
that one lost instance does not stop a run; with retirement off, or when every instance fails, the update raises as
before. A retired instance does not come back (restart the run to use it again). release(program)
goes to the instance holding the program. A request whose instance faults (EngineFault) is run once more, from its
prompt, on another instance: the fault returned no partial output (an EngineFault carries none), so nothing is returned
twice and a seeded request gives the tokens it would have given. One instance is passed straight through (make_engine
does not even build a router for one).

Metrics: `metrics` sums the instances' counters (a live view: the runtime keeps the record and reads it each step);
`instances[i].metrics` are each one's; `placement` is the router's own (placements by reason, prefix tokens expected
against those the instances report reused, retries). `counters()` (engine/readings.py KeepsCounters) gives the
placement counters and the instances' own (programs, the shared K/V pool) to the step metrics:
engine/router_placed_<reason>, engine/router_retries, engine/programs_paused, engine/kv_pool_hits, ...

Prefill/decode split and divided rollout (engine.prefill_instances, engine.chunk_tokens): split.py, over `attempt`.

What it is not: a K/V pool (engine/kv_pool.py, priced through placement.KVFetch), or the Ray wiring (an engine actor
or rollout actor that builds its engine with make_engine gets a router inside it; nothing routes across actors).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loomrl.engine.base import Engine, EngineFault, EngineMetrics, GenerationRequest, GenerationResult
from loomrl.engine.placement import InstanceLoad, KVFetch, Placer, Policy, PrefixIndex
from loomrl.engine.readings import Counters, KeepsCounters, counters_of
from loomrl.engine.split import Choose, Split, SplitMetrics, SplitPlan
from loomrl.weights.fingerprint import Fingerprint, check

if TYPE_CHECKING:
    from torch import Tensor

    from loomrl.weights.adapter import AdapterMeta
    from loomrl.weights.handle import Transport, WeightHandle

log = logging.getLogger("loomrl")

FAULT_COOLDOWN_S = 5.0  # new requests avoid an instance this long after it faulted (while another is healthy)


def _summed(name: str) -> property:
    def get(self: SummedMetrics) -> Any:
        values = [v for m in self.parts() if (v := getattr(m, name)) is not None]
        return sum(values) if values else None

    def ignore(self: SummedMetrics, value: Any) -> None:  # EngineMetrics.__init__ sets every field: nothing to keep
        pass

    return property(get, ignore)


class SummedMetrics(EngineMetrics):
    """The instances' EngineMetrics summed, read live: the runtime keeps an engine's record and reads it later
    (engine/readings.py EngineDelta), so a copy made once would never change. A counter no instance measures is None;
    `started` is the earliest instance's."""

    __slots__ = ("parts",)

    def __init__(self, parts: Callable[[], list[EngineMetrics]]):
        super().__init__()
        self.parts = parts


for _f in dataclasses.fields(EngineMetrics):
    if _f.name != "started":
        setattr(SummedMetrics, _f.name, _summed(_f.name))
setattr(SummedMetrics, "started", property(lambda self: min(m.started for m in self.parts()),  # noqa: B010
                                           lambda self, value: None))


@dataclass(slots=True, kw_only=True)
class PlacementMetrics:
    """The router's own counters since it started."""

    placements: dict[str, int] = field(default_factory=dict)  # by reason (placement.Choice.reason)
    expected_prefix_tokens: int = 0  # prompt tokens the chosen instance held by the router's index
    retried: int = 0  # requests run again on another instance after theirs faulted
    retry_failed: int = 0  # of those, the ones that failed there too
    index_resets: int = 0  # weight updates that emptied the prefix index
    retired: int = 0  # instances retired after failing a weight update the others passed
    split: SplitMetrics | None = None  # the prefill/decode split's and divided rollout's (split.py), when on

    def counts(self) -> dict[str, float]:
        """As step metrics (engine/readings.py), each the step's change: engine/router_placed_<reason> (summed over the
        reasons: the requests placed, a retry's second placement included), engine/router_expected_prefix_tokens,
        engine/router_retries, engine/router_retry_failed, engine/router_index_resets, engine/router_retired, and with a
        split (split.py)
        its SplitMetrics.counts (engine/router_pd_prefills, engine/router_chunks, ...)."""
        out: dict[str, float] = {f"router_placed_{reason}": n for reason, n in self.placements.items()}
        out.update(router_expected_prefix_tokens=self.expected_prefix_tokens, router_retries=self.retried,
                   router_retry_failed=self.retry_failed, router_index_resets=self.index_resets,
                   router_retired=self.retired)
        if self.split is not None:
            out.update(self.split.counts())
        return out


class Router(KeepsCounters):
    """An Engine over `instances` (each a whole engine: its own model, K/V and thread), placing each request by
    `policy`; `imbalance`: requests in flight above the least loaded instance beyond which a program's or group's
    instance counts as overloaded; `fetch`: a K/V pool's cost (kv_pool.PoolFetch; None without a pool); `split`: the
    prefill/decode split and divided rollout over that pool (split.py; None: neither); `retire`: an instance that
    fails a weight update the others passed is retired instead of failing the update."""

    def __init__(self, instances: Sequence[Engine], *, policy: Policy = "affinity", imbalance: int = 8,
                 fetch: KVFetch | None = None, split: SplitPlan | None = None, retire: bool = True):
        if not instances:
            raise ValueError("Router: needs at least one engine instance")
        self.instances = list(instances)
        self.kv_budget = min(e.kv_budget for e in self.instances)  # a request must fit wherever it goes
        self.opens: frozenset[Transport] = frozenset.intersection(*(e.opens for e in self.instances))
        self.placer = Placer(policy=policy, indexes=[PrefixIndex(e.kv_budget) for e in self.instances],
                             loads=[InstanceLoad() for _ in self.instances], imbalance=imbalance, fetch=fetch)
        self.placement = PlacementMetrics()
        self.metrics: EngineMetrics = SummedMetrics(lambda: [e.metrics for e in self.instances])
        self._version = self.instances[0].version
        self._epoch = 0  # bumped at each weight update: a request sent before it adds nothing to the index after it
        self._lock = threading.Lock()  # placement runs on the event loop, updates on a thread (asyncio.to_thread)
        self.retire = retire
        self.split = Split(self, split) if split is not None and len(self.instances) > 1 else None
        if self.split is not None:
            self.placement.split = self.split.metrics

    @property
    def version(self) -> int:
        return self._version

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens the instances served from their prefix caches (the router's expected tokens are placement's)."""
        return self.metrics.reused_tokens

    def counters(self) -> Counters:
        """Its placement counters (PlacementMetrics.counts) and its instances' own (KeepsCounters), summed; a K/V pool
        the instances share is counted once."""
        with self._lock:
            out = Counters(counts=self.placement.counts())
        for e in self.instances:
            more = counters_of(e)
            if more is not None:
                out.add(more())
        return out

    # -- requests ---------------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if len(self.instances) == 1:
            return await self.instances[0].generate(request)
        if self.split is not None:
            return await self.split.generate(request)
        return (await self.attempt(request))[1]

    async def attempt(self, request: GenerationRequest, choose: Choose | None = None) -> tuple[int, GenerationResult]:
        """(instance, result) of `request` placed by `choose` (the policy's Placer.choose by default); on an
        EngineFault once more on another instance `choose` allows (none left: the fault, naming the instance)."""
        choose = choose or self.placer.choose
        first = self._place(request, frozenset(), choose)
        try:
            return first, await self._run(first, request)
        except EngineFault as err:
            # its output so far is lost with the fault (an EngineFault carries none): run it again, from its prompt
            try:
                second = self._place(request, frozenset({first}), choose)
            except EngineFault as none:
                raise EngineFault(f"router: instance {first} failed the request ({err}); {none}") from err
            with self._lock:
                self.placement.retried += 1
            try:
                return second, await self._run(second, request)
            except EngineFault as again:
                with self._lock:
                    self.placement.retry_failed += 1
                raise EngineFault(f"router: instance {first} failed the request ({err}); retried once on instance "
                                  f"{second}, which failed too: {again}") from again

    async def once(self, request: GenerationRequest, choose: Choose) -> tuple[int, GenerationResult]:
        """(instance, result) of `request` placed by `choose`, not retried (an EngineFault is the caller's)."""
        i = self._place(request, frozenset(), choose)
        return i, await self._run(i, request)

    def _place(self, request: GenerationRequest, exclude: frozenset[int], choose: Choose) -> int:
        with self._lock:
            self.placer.prefill_tokens_per_s = self._prefill_rate()
            try:
                choice = choose(request, exclude)
            except ValueError as err:  # every instance allowed to run it is excluded or retired
                raise EngineFault(f"router: no other instance may run the request ({err})") from err
            p = self.placement
            p.placements[choice.reason] = p.placements.get(choice.reason, 0) + 1
            p.expected_prefix_tokens += choice.expected
            self.placer.placed(request, choice.instance)
            # sent: its siblings find the prompt's K/V there from now on
            self.placer.indexes[choice.instance].add(request.prompt_ids)
            return choice.instance

    def _prefill_rate(self) -> float:
        """Prompt tokens per second of steps that prefilled (busy seconds less decode-only ones), pooled over the
        instances that measure both; the placer's prior where none has yet."""
        tokens = seconds = 0.0
        for e in self.instances:
            m = e.metrics
            if m.busy_s is not None and m.prefill_tokens:
                tokens += m.prefill_tokens
                seconds += max(m.busy_s - m.decode_s, 0.0)
        return tokens / seconds if seconds > 0 else self.placer.prefill_tokens_per_s

    async def _run(self, i: int, request: GenerationRequest) -> GenerationResult:
        load = self.placer.loads[i]
        with self._lock:
            load.start()
            epoch = self._epoch
        done = False
        try:
            result = await self.instances[i].generate(request)
            done = True
        except EngineFault:
            with self._lock:  # the built-in engine clears its prefix cache when a step fails
                load.faulted_until = time.monotonic() + FAULT_COOLDOWN_S
                self.placer.indexes[i].clear()
            raise
        finally:
            with self._lock:
                load.end(done)
        if result.finish_reason != "interrupted":
            with self._lock:
                if epoch == self._epoch:  # the engine keeps the turn's K/V: prompt + output less its last token
                    self.placer.indexes[i].add(request.prompt_ids + result.token_ids[:-1])
        return result

    def release(self, program_id: str) -> None:
        with self._lock:
            home = self.placer.programs.pop(program_id, None)
        for i in self.live() if home is None else [home]:
            self.instances[i].release(program_id)

    # -- weights and lifecycle: every instance ---------------------------------------------------------------
    def live(self) -> list[int]:
        """The instances not retired."""
        return [i for i, load in enumerate(self.placer.loads) if not load.retired]

    def _each(self, what: str, fn: Callable[[Engine], Any], *, retire: bool = False) -> list[Any]:
        """`fn` on every live instance at once (each loads on its own thread), their results in order; EngineFault
        naming every one that failed. `retire` (weight updates, with self.retire): when some passed, the failed ones
        are retired instead (retire_instances) and only the passed ones' results returned."""
        live = self.live()
        with concurrent.futures.ThreadPoolExecutor(len(live), thread_name_prefix="router") as pool:
            futures = {i: pool.submit(fn, self.instances[i]) for i in live}
            outcomes = {i: f.exception() for i, f in futures.items()}
        failed = {i: f"instance {i} of {len(self.instances)}: {type(err).__name__}: {err}"
                  for i, err in outcomes.items() if err is not None}
        if failed and retire and self.retire and len(failed) < len(live):
            self.retire_instances(failed, what)
        elif failed:
            raise EngineFault(f"router: {what} failed on {len(failed)} instance(s): " + "; ".join(failed.values()))
        return [futures[i].result() for i in live if i not in failed]

    def retire_instances(self, why: dict[int, str], what: str) -> None:
        """Never place on these again; close them (best effort: they failed already)."""
        with self._lock:
            for i in why:
                self.placer.loads[i].retired = True
                self.placer.indexes[i].clear()
                self.placement.retired += 1
            for program, home in list(self.placer.programs.items()):  # their programs' K/V went with them
                if home in why:
                    del self.placer.programs[program]
            for group, home in list(self.placer.groups.items()):
                if home in why:
                    del self.placer.groups[group]
        log.warning("router: %s failed on %d of %d live instance(s), which are retired (engine."
                    "retire_failed_instances): %s; %d instance(s) serve on", what, len(why), len(why) + len(self.live()),
                    "; ".join(why.values()), len(self.live()))
        for i in why:
            try:
                self.instances[i].close()
            except Exception as err:  # noqa: BLE001 - it is gone either way; the reason is logged
                log.warning("router: closing retired instance %d raised %s: %s", i, type(err).__name__, err)

    def _new_version(self) -> None:
        """Called before a load: the index's prefixes are of the old weights from now on."""
        with self._lock:
            self._epoch += 1
            self.placer.forget()
            self.placement.index_resets += 1

    def update_weights(self, weights: dict | None, version: int) -> None:
        self._new_version()
        self._each(f"update_weights to version {version}", lambda e: e.update_weights(weights, version), retire=True)
        self._version = version  # only once every instance serves it

    def update_adapter(self, weights: dict[str, Tensor], adapter: AdapterMeta, version: int) -> None:
        self._new_version()
        self._each(f"update_adapter to version {version}", lambda e: e.update_adapter(weights, adapter, version),
                   retire=True)
        self._version = version  # only once every instance serves it

    def update_from(self, handle: WeightHandle) -> None:
        self._new_version()
        self._each(f"update_from version {handle.version}", lambda e: e.update_from(handle), retire=True)
        self._version = handle.version

    def weight_fingerprint(self, expected: Fingerprint) -> Fingerprint:
        """The first live instance's fingerprint, once every other live one's has been checked against `expected` (a
        mismatch names the instance; the caller checks the first's)."""
        live = self.live()
        prints = self._each("weight_fingerprint", lambda e: e.weight_fingerprint(expected))
        for i, fp in list(zip(live, prints))[1:]:
            check(f"router instance {i}", self._version, expected, fp, self.instances[i].version)
        return prints[0]

    def interrupt(self) -> None:
        for i in self.live():
            self.instances[i].interrupt()

    def sleep(self) -> None:
        self._each("sleep", lambda e: e.sleep())

    def wake(self) -> None:
        self._each("wake", lambda e: e.wake())

    def close(self) -> None:
        self._each("close", lambda e: e.close())
