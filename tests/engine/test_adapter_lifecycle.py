"""The lifecycle the three server adapters share (engine/adapter.py: vLLM in process, vLLM over HTTP, SGLang), without
vLLM or SGLang: refusal of requests (closed, broken), the version a load leaves, which aborts are the adapter's own,
the busy clock, and the bounded wait of a control call with its death polling. Real threads, real asyncio loops,
real time; nothing is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future

import pytest

from loomrl.engine.adapter import ControlThread, Lifecycle, LoopThread, wait_control
from loomrl.engine.base import EngineFault, EngineMetrics, GenerationRequest, SamplingParams


def request(ids: list[int] | None = None) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[1, 2] if ids is None else ids, sampling=SamplingParams())


def test_admit_counts_a_request_and_refuses_empty_closed_and_broken_ones():
    life = Lifecycle(EngineMetrics(), version=3)
    life.admit(request())
    assert life.metrics.requests == 1
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        life.admit(request([]))
    life.broken = "RuntimeError: half loaded"
    with pytest.raises(EngineFault, match="no valid weights.*half loaded"):
        life.admit(request())
    assert life.close() and not life.close()  # the second close has nothing to stop
    with pytest.raises(EngineFault, match="the engine is closed"):
        life.admit(request())
    with pytest.raises(EngineFault, match="^sleep: the engine is closed"):
        life.check_open("sleep")
    assert life.metrics.requests == 1


def test_a_load_serves_its_version_and_a_failed_one_breaks_the_adapter_until_the_next_succeeds():
    life = Lifecycle(EngineMetrics(), version=0)
    with life.loading(1):
        pass
    assert (life.version, life.broken) == (1, None)
    with pytest.raises(EngineFault, match="^update_weights: vLLM could not load version 2: RuntimeError: bucket 3"):
        with life.loading(2):
            raise RuntimeError("bucket 3")
    assert (life.version, life.broken) == (1, "RuntimeError: bucket 3")
    with pytest.raises(EngineFault, match="no valid weights"):
        life.admit(request())
    with life.loading(3):
        pass
    assert (life.version, life.broken) == (3, None)
    life.admit(request())


def test_an_abort_is_the_adapters_own_only_when_an_interrupt_began_after_the_request_started():
    life = Lifecycle(EngineMetrics(), version=5)
    with contextlib.ExitStack() as requests:
        before = requests.enter_context(life.running())
        assert (before.version, life.interrupted(before)) == (5, False)
        with life.interrupting():
            during = requests.enter_context(life.running())  # started while the abort is on its way: caught by it
            assert life.interrupted(before) and life.interrupted(during)
        after = requests.enter_context(life.running())
        assert life.interrupted(before) and not life.interrupted(after)
        with pytest.raises(RuntimeError), life.interrupting():  # an interrupt that failed is done all the same
            raise RuntimeError("pause failed")
        assert life.interrupted(after) and not life.interrupted(requests.enter_context(life.running()))


def test_the_busy_clock_counts_wall_time_with_any_request_in_flight_once():
    life = Lifecycle(EngineMetrics(busy_s=0.0), version=0)
    with life.running():
        time.sleep(0.2)
        with life.running():  # overlapping: the same wall time, not twice
            time.sleep(0.2)
            life.tick()
            ticked = life.metrics.busy_s
    time.sleep(1.0)  # idle: not counted
    life.tick()
    assert 0.35 < ticked <= life.metrics.busy_s < 0.9  # 0.4 s busy; counting the idle second would give 1.4
    unmeasured = Lifecycle(EngineMetrics(), version=0)  # an adapter that cannot measure busy_s leaves it None
    with unmeasured.running():
        pass
    assert unmeasured.metrics.busy_s is None


def test_a_control_calls_wait_is_bounded_and_names_the_call():
    future: Future = Future()
    started = time.monotonic()
    with pytest.raises(EngineFault, match=r"^update_weights: version 4: not done after 0s"):
        wait_control(future, "update_weights: version 4", 0.3)
    assert time.monotonic() - started < 2 and future.cancelled()
    done: Future = Future()
    done.set_result(7)
    assert wait_control(done, "probe", None) == 7


@pytest.mark.integration  # a server that dies: seconds of waiting
def test_a_control_calls_wait_ends_on_the_servers_death_not_its_timeout():
    deaths = iter([None, "vLLM's worker process (pid 1) was killed"])
    started = time.monotonic()
    with pytest.raises(EngineFault, match=r"^sleep: vLLM's worker process \(pid 1\) was killed"):
        wait_control(Future(), "sleep", 600.0, death=lambda: next(deaths))
    assert time.monotonic() - started < 5


def test_a_control_calls_error_goes_to_the_adapter_or_up_as_it_is():
    failed: Future = Future()
    failed.set_exception(TimeoutError("the server did not answer"))  # raised by the call: done, not still running
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer"):
        wait_control(failed, "wake", None)
    seen = []

    def translate(err: Exception, what: str):
        seen.append(what)
        raise EngineFault(f"{what}: {err}") from err

    with pytest.raises(EngineFault, match="^wake: the server did not answer"):
        wait_control(failed, "wake", 10.0, failed=translate)
    assert seen == ["wake"] and time.monotonic() - started < 1


def test_the_control_thread_runs_calls_in_order_and_drops_waiting_ones_at_shutdown():
    control = ControlThread("test-control")
    order: list[str] = []
    gate = threading.Event()
    control.submit(lambda: (gate.wait(5), order.append("interrupt")))  # nobody waits for it
    threading.Timer(0.2, gate.set).start()
    assert control.call("update", 5.0, lambda: order.append("update") or 1) == 1  # after the interrupt, not beside
    assert order == ["interrupt", "update"]
    blocker = threading.Event()
    control.submit(blocker.wait, 5)
    dropped = control.submit(order.append, "dropped")
    threading.Timer(0.2, blocker.set).start()
    control.shutdown()
    assert dropped.cancelled() and order == ["interrupt", "update"]


def test_the_loop_thread_runs_coroutines_on_its_own_loop():
    loop = LoopThread("test-loop")
    try:
        async def where() -> asyncio.AbstractEventLoop:
            return asyncio.get_running_loop()

        assert loop.run(where(), 5.0) is loop.loop
        assert loop.submit(asyncio.sleep(0, "x")).result(5.0) == "x"
    finally:
        loop.stop()
    assert not loop.loop.is_running()


def test_serving_refuses_a_closed_or_broken_adapter_before_its_clock_runs():
    life = Lifecycle(EngineMetrics(busy_s=0.0), version=0)
    life.broken = "RuntimeError: half loaded"
    with pytest.raises(EngineFault, match="no valid weights.*half loaded"), life.serving(request()):
        pytest.fail("a broken adapter ran a request")
    life.broken = None
    life.close()
    with pytest.raises(EngineFault, match="the engine is closed"), life.serving(request()):
        pytest.fail("a closed adapter ran a request")
    time.sleep(0.2)
    life.tick()
    assert (life.metrics.requests, life.metrics.busy_s) == (0, 0.0)  # nothing counted, no clock left running


def test_serving_attributes_an_interrupt_to_the_request_in_flight_only():
    life = Lifecycle(EngineMetrics(), version=2)
    with life.serving(request()) as ticket:
        assert ticket.version == 2 and not life.interrupted(ticket)
        with life.interrupting():
            pass
        assert life.interrupted(ticket)  # an abort now is the adapter's: "interrupted"
    with life.serving(request()) as later:
        assert not life.interrupted(later)  # the interrupt was done before it started
    assert life.metrics.requests == 2


def test_serving_counts_exactly_the_time_inside_on_the_busy_clock():
    life = Lifecycle(EngineMetrics(busy_s=0.0), version=0)
    time.sleep(0.3)  # idle before
    with life.serving(request()):
        time.sleep(0.4)
    time.sleep(0.6)  # idle after
    life.tick()
    assert 0.38 < life.metrics.busy_s < 0.6  # counting either idle stretch would give 0.7 or more


def test_a_request_that_fails_or_is_cancelled_inside_stops_the_clock_and_leaves_the_adapter_serving():
    life = Lifecycle(EngineMetrics(busy_s=0.0), version=0)
    with pytest.raises(RuntimeError, match="server gone"), life.serving(request()):
        raise RuntimeError("server gone")  # up as it is: what it means is the adapter's to say

    async def waits_forever() -> None:
        with life.serving(request()):
            await asyncio.sleep(60)

    async def cancelled() -> None:
        task = asyncio.create_task(waits_forever())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    busy = life.metrics.busy_s
    time.sleep(0.5)
    life.tick()
    assert life.metrics.busy_s == busy < 0.4  # stopped both times: the idle half second is not counted
    assert (life.closed, life.broken, life.metrics.requests) == (False, None, 2)
    with life.serving(request()) as ticket:  # and the next request is served
        assert ticket.version == 0


def test_running_is_serving_for_a_request_admitted_elsewhere():
    life = Lifecycle(EngineMetrics(busy_s=0.0), version=4)
    with life.lock:  # admitted on the caller's thread, with its hand-off (in-process vLLM: to its loop)
        life.admit(request())
    with life.running() as ticket:
        time.sleep(0.2)
        assert ticket.version == 4
    time.sleep(0.4)
    life.tick()
    assert life.metrics.requests == 1 and 0.18 < life.metrics.busy_s < 0.4
