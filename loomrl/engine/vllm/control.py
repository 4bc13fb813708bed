"""The in-process vLLM adapter's control calls, on its loop (engine/vllm/engine.py): interrupt, load a version, sleep,
wake, and the state of vLLM's sleep they share. docs/engines.md ('The vLLM engine's contract') gives the order of the
calls and why; tests read `calls` (sleep:<level>, abort, wake:<tag>, load:<version>, adapter:<version>, resume).

What it is: one object living on the adapter's loop, every call under one asyncio lock, in arrival order. What it is
not: the adapter's lifecycle (engine/adapter.py: closed, broken, version, interrupt attribution) or the waits of the
callers (those are the adapter's, bounded by engine.vllm.update_timeout_s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from loomrl.config import VLLMConfig
from loomrl.engine.adapter import Lifecycle
from loomrl.engine.base import EngineFault

log = logging.getLogger(__name__)

_SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # what vLLM's sleep(level>=1) puts to sleep (vllm/v1/executor)
_DISCARDED = "vLLM's level-2 sleep discarded its weights and no update has loaded them since"


def sleep_level(*, update_follows_wake: bool, last_update_whole: bool) -> int:
    """vLLM's sleep level for VLLMEngine.sleep: 2 (the weights are discarded) when an update follows every wake
    (engine.sleep_while_training: runtime/driver.py publishes after each wake) and the last update loaded every
    parameter (so the next, a version of the same run, does too: a trainer that freezes some layers publishes only
    the trained ones, and the frozen ones would be lost); 1 (the weights backed up to host memory) otherwise, the
    first sleep included (before any update the next one's extent is unknown)."""
    return 2 if update_follows_wake and last_update_whole else 1


class Control:
    """vLLM's control calls and its sleep state: `asleep`, the sleep tags still asleep (after sleep both; after wake
    kv_cache only, until the next update or the end of the wake's hold takes it back and generation resumes)."""

    def __init__(self, llm: Any, life: Lifecycle, cfg: VLLMConfig):
        self.llm: Any = llm  # vLLM's AsyncLLM; None once shut down
        self.life, self.cfg = life, cfg
        self.lock = asyncio.Lock()  # binds to the loop at its first contended use: the adapter's
        self.calls: collections.deque[str] = collections.deque(maxlen=64)  # the calls made into vLLM, newest last
        self.asleep: frozenset[str] = frozenset()
        self.last_whole = False  # the last update loaded every parameter
        self.discarded = False  # a level-2 sleep discarded the weights; a whole update brings them back
        # a streamed update loaded the weights while the K/V cache sleeps: the next wake takes it back
        self.loaded_asleep = False
        self._hold: asyncio.TimerHandle | None = None  # the end of a wake's hold for an update
        self._hold_end: asyncio.Task | None = None

    def whole(self, names: list[str], shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether an update of `names` loads every parameter of `shapes`; refused (EngineFault) when it does not and
        a level-2 sleep discarded the weights (the rest would serve what the sleep left in their memory)."""
        whole = len(set(names) & shapes.keys()) == len(shapes)
        if self.discarded and not whole:
            raise EngineFault(f"update_weights: vLLM's level-2 sleep discarded its weights (engine."
                              f"sleep_while_training); the update after it must send all {len(shapes)} parameters, not "
                              f"{len(set(names))}")
        return whole

    async def interrupt(self) -> None:
        async with self.lock:
            try:
                with self.life.interrupting():
                    await self.llm.pause_generation(mode="abort", clear_cache=False)
            except Exception as err:  # noqa: BLE001 - nobody waits for an interrupt: record it and go on
                log.warning("interrupt failed: %s: %s", type(err).__name__, err)
            finally:
                await self._resume()

    async def sleep(self, update_follows_wake: bool) -> None:
        async with self.lock:
            self._end_hold()
            if "weights" in self.asleep:  # asleep already
                return
            with self.life.interrupting():  # the requests sleep (or the abort below) ends are ours: "interrupted"
                if self.asleep:  # woken without an update since: whole again first (vLLM sleeps all tags at once)
                    if self.discarded:  # the K/V cache back for the sleep, and no step on discarded weights
                        await self._abort_held()
                    await self._wake_up(self.asleep)
                    self.loaded_asleep = False
                # (level 1: requests held since the wake may take a step on the old weights before the sleep aborts
                # them)
                level = sleep_level(update_follows_wake=update_follows_wake, last_update_whole=self.last_whole)
                await self.llm.sleep(level=level, mode="abort")
                self.asleep, self.discarded = _SLEEP_TAGS, level == 2
                self.calls.append(f"sleep:{level}")

    async def wake(self) -> None:
        async with self.lock:
            if "weights" not in self.asleep:  # not asleep, or a streamed update brought the weights back
                if self.loaded_asleep and self.asleep:
                    await self._wake_up(self.asleep)
                self.loaded_asleep = False
                await self._resume()
                return
            await self._wake_up({"weights"})  # vLLM's scheduler stays paused while the K/V cache sleeps
            self._hold = asyncio.get_running_loop().call_later(self.cfg.update_timeout_s, self._hold_expired)

    async def load(self, updates: Iterable[dict[str, Any]], version: int, whole: bool, *,
                   wake_cache: bool = True) -> None:
        """One update: `updates`, the update_info of each vLLM update_weights call (worker.py's kinds), each made off
        the loop (encoded, or handed over by a trainer: a BucketFeed); `whole`: they load every parameter.
        `wake_cache` False (a streamed update, the trainer still on the GPU): the K/V cache stays asleep, and the
        engine paused, until the run's wake."""
        async with self.lock:
            self._end_hold()
            try:  # whatever fails, the finally below ends a wake's hold
                if "weights" in self.asleep:  # an update without a wake: the weights' memory back first
                    await self._wake_up({"weights"})
                await self.llm.pause_generation(mode="keep", clear_cache=False)
                with self.life.loading(version):
                    await self._send(updates, version)
                    self.calls.append(f"load:{version}")
                self.last_whole = whole
                self.discarded = self.discarded and not whole
            finally:
                if self.discarded:  # failed on weights a level-2 sleep discarded: no step before a whole update
                    await self._abort_held()
                elif not wake_cache and self.asleep:  # the run's wake takes the K/V cache back (wake)
                    self.loaded_asleep = True
                else:
                    if self.asleep:  # after a wake: the K/V cache only now, once the new weights are in
                        await self._wake_up(self.asleep)
                    await self._resume()

    async def load_adapter(self, add: Callable[[], Awaitable[None]], version: int) -> None:
        """One LoRA adapter version (engine.py update_adapter): `add` hands it to vLLM, without a pause (a request
        admitted before keeps the adapter it carries); after a wake, the memory still asleep is taken back and
        generation resumes, as after a weight update."""
        async with self.lock:
            if self.discarded:
                raise EngineFault(f"update_adapter: {_DISCARDED}; an adapter cannot bring the base weights back")
            self._end_hold()
            woke = bool(self.asleep)
            try:
                if "weights" in self.asleep:  # an update without a wake: the weights' memory back first
                    await self._wake_up({"weights"})
                with self.life.loading(version):
                    await add()
                    self.calls.append(f"adapter:{version}")
            finally:
                if woke:
                    if self.asleep:
                        await self._wake_up(self.asleep)
                    await self._resume()

    async def shutdown(self, tasks: set[asyncio.Task]) -> None:
        """End the requests in flight (`tasks`, the generate calls), then vLLM's processes."""
        self._end_hold()
        if tasks:
            try:
                await self.llm.pause_generation(mode="abort", clear_cache=False)  # in-flight requests end now
                await asyncio.wait(list(tasks), timeout=30.0)
            except Exception as err:  # noqa: BLE001 - a dead engine: its requests fail on their own
                log.warning("aborting requests at close: %s: %s", type(err).__name__, err)
        llm, self.llm = self.llm, None
        llm.shutdown()
        for task in list(tasks):
            task.cancel()
        del llm  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit (where it raises a TypeError)

    async def _send(self, updates: Iterable[dict[str, Any]], version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.start_weight_update()
        try:
            items = iter(updates)
            while (update := await asyncio.to_thread(next, items, None)) is not None:
                await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update))
        except Exception:
            # the worker's reload has finished on a failed bucket (worker.py); this closes the update session where
            # the failure came before the worker saw the bucket (it refuses an unopened one)
            with contextlib.suppress(Exception):
                await self.llm.finish_weight_update()
            raise
        await self.llm.finish_weight_update(weight_version=str(version))
        # reset_connector: a K/V connector's own store (engine.vllm.kv_offload_gib's host memory, an external one)
        # holds the old weights' K/V too; without a connector vLLM reads it as a reset that succeeded
        if not await self.llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            raise RuntimeError("reset_prefix_cache refused to drop the old weights' K/V (from the prefix cache or the "
                               "K/V connector's store)")

    async def _abort_held(self) -> None:
        """End the requests vLLM holds ("interrupted": ours) and refuse new ones (EngineFault) until a whole update
        loads: the weights a level-2 sleep discarded are not there, and no step may run on them."""
        with self.life.lock:
            self.life.broken = self.life.broken or _DISCARDED
        with self.life.interrupting():
            await self.llm.pause_generation(mode="abort", clear_cache=False)
            self.calls.append("abort")

    async def _wake_up(self, tags: Iterable[str]) -> None:
        """wake_up(tags): vLLM resumes its scheduler itself once no tag is left asleep (EngineCore.wake_up)."""
        tags = sorted(tags)
        await self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)
        self.calls.append(f"wake:{','.join(tags)}")

    def _end_hold(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    def _hold_expired(self) -> None:
        self._hold = None
        self._hold_end = asyncio.ensure_future(self._wake_without_update())

    async def _wake_without_update(self) -> None:
        """The end of a hold no update ended: the K/V cache back, and the weights vLLM has serve."""
        async with self.lock:
            if self.asleep != {"kv_cache"} or self.life.closed:  # an update or a sleep came first
                return
            if self.discarded:  # nothing to serve: the held requests wait for an update, new ones are refused
                log.warning("vLLM woke after a level-2 sleep and no weight update came within "
                            "engine.vllm.update_timeout_s (%.0fs): it refuses requests until one loads",
                            self.cfg.update_timeout_s)
                with self.life.lock:
                    self.life.broken = self.life.broken or _DISCARDED
                return
            log.warning("vLLM woke and no weight update came within engine.vllm.update_timeout_s (%.0fs): serving "
                        "version %d", self.cfg.update_timeout_s, self.life.version)
            try:
                await self._wake_up(self.asleep)
            except Exception as err:  # noqa: BLE001 - nobody waits for this: record it; the next update tries again
                log.warning("wake_up(kv_cache) failed: %s: %s", type(err).__name__, err)
                with self.life.lock:
                    self.life.metrics.faults += 1
                return
            await self._resume()

    async def _resume(self) -> None:
        """resume_generation, unless some of vLLM's memory is asleep: a step then would run on memory that is not
        there (vLLM's resume_scheduler does not check), so the engine stays paused until the wake that ends it."""
        if self.asleep:
            return
        try:
            await self.llm.resume_generation()
            self.calls.append("resume")
        except Exception as err:  # noqa: BLE001
            log.warning("resume_generation failed (the engine may stay paused): %s: %s", type(err).__name__, err)
            with self.life.lock:
                self.life.metrics.faults += 1
