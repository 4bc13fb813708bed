"""The lifecycle every server adapter shares (vLLM in process: engine/vllm/engine.py; vLLM over HTTP:
engine/vllm/http.py; SGLang: engine/sglang.py): closed and broken state, which aborts were the adapter's own, the
busy clock, and the bounded wait of a control call.

What it is: one `Lifecycle` object an adapter holds (its counters, its lock, the version it serves), with the
sequence around every request written once (`serving`: admitted, in flight, done; `running` where the admission is on
another thread), `wait_control`,
the wait every adapter's update, sleep and wake returns through, and where control calls run: a `ControlThread` (the
HTTP adapters: blocking calls, in order) or a `LoopThread` (in-process vLLM: an asyncio loop of its own).

What it is not: a transport (each adapter talks to its server its own way) or a base class of the Engine protocol: the
adapters keep their own `generate` (a few lines inside `serving`) and control calls. The contract it keeps is in
docs/engines.md, 'The server adapters' shared lifecycle'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from loomrl.engine.base import EngineFault, EngineMetrics, GenerationRequest, refuse_request

DEATH_POLL_S = 1.0  # how often a control call's wait asks whether the server behind it died


@dataclass(slots=True, frozen=True)
class Ticket:
    """What a request saw when it started: the version serving, and the adapter's interrupts done by then."""

    version: int
    interrupts: int


class Lifecycle:
    """An adapter's state, thread-safe under `lock`: `closed`; `broken`, why the last weight load failed (requests are
    refused until a load succeeds); `version`, the weights serving; the interrupts it began and finished (a request that
    saw one begin after it started was aborted by the adapter: "interrupted", not an EngineFault); and, where `metrics`
    measures busy_s, the wall time with a request in flight."""

    def __init__(self, metrics: EngineMetrics, version: int):
        self.metrics = metrics
        self.lock = threading.Lock()
        self.version = version
        self.closed = False
        self.broken: str | None = None
        self._begun = self._done = 0  # interrupts begun / finished; done == begun while none is running
        self._in_flight = 0
        self._busy_since = 0.0

    # -- requests ---------------------------------------------------------------------------------
    def admit(self, request: GenerationRequest) -> None:
        """Refuse `request` (base.refuse_request: empty, closed, broken) or count it. Hold `lock` around this and the
        request's hand-off where a close must not slip in between (`serving` does, where there is no hand-off)."""
        refuse_request(request, closed=self.closed, broken=self.broken)
        self.metrics.requests += 1

    @contextlib.contextmanager
    def serving(self, request: GenerationRequest) -> Generator[Ticket, None, None]:
        """Around one request admitted and served on the same thread (the HTTP adapters): `admit` under `lock`, then
        `running`. Yields what the request saw as it started."""
        with self.lock:
            self.admit(request)
        with self.running() as ticket:
            yield ticket

    @contextlib.contextmanager
    def running(self) -> Generator[Ticket, None, None]:
        """Around a request admitted already (in-process vLLM admits on the caller's thread, under `lock` with its
        hand-off, and runs the request on its loop): in flight inside, the busy clock running; no longer in flight
        however it ends (an error, a cancellation), which changes no other state: what an error means is the
        adapter's to say."""
        with self.lock:
            self._tick()
            self._in_flight += 1
            ticket = Ticket(version=self.version, interrupts=self._done)
        try:
            yield ticket
        finally:
            with self.lock:
                self._tick()
                self._in_flight -= 1

    def tick(self) -> None:
        """Count the busy time so far (as outputs come, so that a reading lags by one output at most)."""
        with self.lock:
            self._tick()

    def interrupted(self, ticket: Ticket) -> bool:
        """Whether an interrupt of the adapter's began after the request of `ticket` started (an abort is ours)."""
        return self._begun > ticket.interrupts

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._in_flight and self.metrics.busy_s is not None:
            self.metrics.add_busy(now - self._busy_since)
        self._busy_since = now

    # -- control ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def interrupting(self) -> Generator[None, None, None]:
        """Around a call that aborts requests (an interrupt, a sleep, a pause with abort): begun before it, so that a
        request it aborts reads the abort as ours; done after it, however it ends."""
        with self.lock:
            self._begun += 1
        try:
            yield
        finally:
            with self.lock:
                self._done = self._begun

    @contextlib.contextmanager
    def loading(self, version: int, server: str = "vLLM") -> Generator[None, None, None]:
        """Around one weight load: when it completes `version` serves and the adapter is whole again; when it fails
        the adapter is broken (it refuses requests until a complete load succeeds) and the error an EngineFault."""
        try:
            yield
        except Exception as err:
            with self.lock:
                self.broken = f"{type(err).__name__}: {err}"
            raise EngineFault(f"update_weights: {server} could not load version {version}: {self.broken}") from err
        with self.lock:
            self.version = version
            self.broken = None

    def check_open(self, what: str) -> None:
        """EngineFault for a call (`what`) on a closed adapter."""
        if self.closed:
            raise EngineFault(f"{what}: the engine is closed")

    def close(self) -> bool:
        """Mark the adapter closed; False when it was already (the caller then has nothing to stop)."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True


def wait_control(future: concurrent.futures.Future, what: str, timeout_s: float | None, *,
                 death: Callable[[], str | None] = lambda: None,
                 failed: Callable[[Exception, str], Any] | None = None) -> Any:
    """The result of a control call (`what`) running elsewhere (a loop or a control thread), within `timeout_s` (None:
    each call inside is bounded on its own). Every DEATH_POLL_S it asks `death` why the server is gone (None while it
    lives): a control call into a dead server may never be answered. Its error goes to `failed` (which raises) when
    given, else up as it is; a timeout or a death is an EngineFault naming `what`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = DEATH_POLL_S if deadline is None else max(0.0, min(DEATH_POLL_S, deadline - time.monotonic()))
        # waited on, not future.result(left): a call that raises TimeoutError itself is done, not still running
        if concurrent.futures.wait([future], timeout=left).done:
            try:
                return future.result()
            except Exception as err:
                if failed is None:
                    raise
                failed(err, what)
                raise
        why = death()
        if why is not None:
            future.cancel()
            raise EngineFault(f"{what}: {why}")
        if deadline is not None and time.monotonic() >= deadline:
            future.cancel()
            raise EngineFault(f"{what}: not done after {timeout_s:.0f}s")


class ControlThread:
    """One thread for an HTTP adapter's control calls, run in order: an interrupt() then an update never interleave."""

    def __init__(self, name: str):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run `fn(*args)` after the calls before it; nobody waits (an interrupt)."""
        return self._pool.submit(fn, *args)

    def call(self, what: str, timeout_s: float | None, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` after the calls before it and wait for it (wait_control)."""
        return wait_control(self._pool.submit(fn, *args), what, timeout_s)

    def shutdown(self) -> None:
        """Finish the call running, drop the ones waiting."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class LoopThread:
    """A thread running an asyncio loop of its own, for a client whose sockets belong to the loop that made them
    (vLLM's AsyncLLM): every call into it runs there, from whichever thread or loop asks."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; nobody need wait."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Any, timeout_s: float) -> Any:
        """Run `coro` on the loop and wait for its result (concurrent.futures.TimeoutError after `timeout_s`)."""
        return self.submit(coro).result(timeout_s)

    def stop(self) -> None:
        """Stop the loop and wait (bounded) for its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30.0)
