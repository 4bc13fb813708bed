"""The rollout dispatcher of benchmark B2 (benchmarks/dispatcher.py: barrier / refill / Seer, with and
without divided rollout) on the real built-in engine with the tiny model; lengths are set exactly with
ignore_eos and per-request budgets."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from dispatcher import RolloutDispatcher, RolloutGroup, ScheduleReport  # noqa: E402

from loomrl.engine.base import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402

# Budgets per group (rows) and sibling (columns): uneven on purpose, including 1-token requests.
BUDGETS = [[5, 9, 3, 12], [20, 1, 7, 4], [2, 2, 15, 6], [11, 3, 8, 1]]
ARMS = [("barrier", None), ("refill", None), ("refill", 4), ("seer", None), ("seer", 4)]


class Recording:
    """An Engine wrapper that records when each generate call starts and ends, and the peak of
    calls in flight together: a check on the dispatcher that does not rely on its own accounting."""

    def __init__(self, engine: BuiltinEngine):
        self.engine = engine
        self.events: list[tuple[str, str]] = []
        self.live = 0
        self.peak = 0

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.events.append(("start", request.program_id))
        try:
            return await self.engine.generate(request)
        finally:
            self.live -= 1
            self.events.append(("end", request.program_id))

    def update_weights(self, weights, version: int) -> None:
        self.engine.update_weights(weights, version)

    def release(self, program_id: str) -> None:
        self.engine.release(program_id)


@pytest.fixture
def engine(tiny_model, tokenizer):
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    yield eng
    eng.close()


def _groups(tokenizer, budgets: list[list[int]], priors: list[float | None] | None = None,
            temperature: float = 1.0) -> list[RolloutGroup]:
    return [RolloutGroup(prompt_ids=tokenizer.encode(f"Problem {g}: how many apples are left?"),
                         samplings=[SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature,
                                                   seed=100 * g + i) for i, n in enumerate(row)],
                         prior_length=priors[g] if priors else None)
            for g, row in enumerate(budgets)]


def _run(engine, groups, **kw) -> ScheduleReport:
    return asyncio.run(RolloutDispatcher(engine, **kw).run(groups))


def _first_dispatches(report: ScheduleReport) -> list[tuple[int, int]]:
    return [(d.group, d.index) for d in report.dispatches if d.chunk == 0]


@pytest.mark.parametrize(("policy", "chunk"), ARMS)
def test_every_request_completes_with_its_whole_budget(engine, tokenizer, policy, chunk):
    report = _run(engine, _groups(tokenizer, BUDGETS), concurrency=3, policy=policy, chunk_tokens=chunk)
    for g, row in enumerate(BUDGETS):
        for i, budget in enumerate(row):
            o = report.outcomes[g][i]
            r = o.result
            assert (o.group, o.index) == (g, i)
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == budget
            assert r.finish_reason == "length" and all(lp <= 0.0 for lp in r.logprobs)
            assert o.chunks == (math.ceil(budget / chunk) if chunk else 1)
            assert 0.0 <= o.dispatched_at <= o.finished_at <= report.wall_s
        assert report.group_finished_at[g] == max(o.finished_at for o in report.outcomes[g])
    assert len(report.dispatches) == sum(o.chunks for row in report.outcomes for o in row)
    assert all(d.max_tokens <= (chunk or 10**9) for d in report.dispatches)
    assert report.generated_tokens == sum(map(sum, BUDGETS))
    assert 0.0 <= report.tail_latency() <= report.wall_s


@pytest.mark.parametrize("policy", ["refill", "seer"])
def test_divided_rollout_concatenates_to_the_undivided_result(engine, tokenizer, policy):
    groups = _groups(tokenizer, [[13, 6], [9, 17]], temperature=0.0)  # greedy: the tokens must match exactly
    whole = _run(engine, groups, concurrency=2, policy=policy)
    divided = _run(engine, groups, concurrency=2, policy=policy, chunk_tokens=5)
    for a_row, b_row in zip(whole.outcomes, divided.outcomes):
        for a, b in zip(a_row, b_row):
            assert b.chunks > 1 or len(a.result.token_ids) <= 5
            assert b.result.token_ids == a.result.token_ids
            assert b.result.logprobs == pytest.approx(a.result.logprobs, abs=1e-4)
            assert b.result.versions == a.result.versions and len(b.result.versions) == len(b.result.token_ids)


def test_seer_probes_first_then_longest_estimate_first(engine, tokenizer):
    # Each group's siblings share its length: group lengths 4, 12, 2, 8. With one slot every probe
    # has finished before any sibling is dispatched, so the siblings' order is fully determined.
    lengths = [4, 12, 2, 8]
    report = _run(engine, _groups(tokenizer, [[n] * 3 for n in lengths]), concurrency=1, policy="seer")
    order = _first_dispatches(report)
    assert order[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # probes, in arrival order (no priors)
    assert [d.speculative for d in report.dispatches] == [True] * 4 + [False] * 8
    by_length = sorted(range(4), key=lambda g: -lengths[g])  # 1, 3, 0, 2
    assert order[4:] == [(g, i) for g in by_length for i in (1, 2)]


def test_seer_counts_an_unprobed_group_as_long(engine, tokenizer):
    # Two slots. Group 0's probe (3 tokens) finishes long before group 1's (10): group 0 is then known
    # to be short, group 1 is not probed yet and counts at its full budget (10), so its siblings go
    # first; group 0's are kept for the end. Refill would start group 0's siblings at once.
    groups = _groups(tokenizer, [[3, 30, 3, 3], [10, 10, 10, 10]])
    report = _run(engine, groups, concurrency=2, policy="seer")
    assert _first_dispatches(report) == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (0, 1), (0, 2), (0, 3)]
    report = _run(engine, groups, concurrency=2, policy="refill")
    assert _first_dispatches(report) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_seer_orders_probes_shortest_prior_first(engine, tokenizer):
    report = _run(engine, _groups(tokenizer, [[3, 3]] * 4, priors=[30.0, 5.0, None, 10.0]), concurrency=1,
                  policy="seer")
    assert _first_dispatches(report)[:4] == [(2, 0), (1, 0), (3, 0), (0, 0)]  # no prior first, then shortest


@pytest.mark.parametrize("chunk", [None, 3])
def test_seer_dispatches_each_probe_before_its_siblings(engine, tokenizer, chunk):
    budgets = [[7, 2, 9, 4], [1, 12, 3, 3], [10, 10, 2, 5], [4, 4, 4, 4], [15, 1, 1, 6], [2, 8, 8, 2]]
    report = _run(engine, _groups(tokenizer, budgets), concurrency=3, policy="seer", chunk_tokens=chunk)
    order = _first_dispatches(report)
    for g in range(len(budgets)):
        assert order.index((g, 0)) < min(order.index((g, i)) for i in range(1, 4))
    # With as many probes as slots twice over, the first slots all go to probes.
    assert all(i == 0 for _, i in order[:len(budgets)])


@pytest.mark.parametrize(("policy", "chunk"), ARMS)
def test_concurrency_is_never_exceeded(engine, tokenizer, policy, chunk):
    rec = Recording(engine)
    report = _run(rec, _groups(tokenizer, BUDGETS), concurrency=3, policy=policy, chunk_tokens=chunk)
    assert rec.peak == report.max_in_flight == 3
    assert rec.live == 0


def test_barrier_waits_for_the_whole_batch(engine, tokenizer):
    rec = Recording(engine)
    report = _run(rec, _groups(tokenizer, BUDGETS), concurrency=6, policy="barrier")
    n = sum(map(len, BUDGETS))
    sizes = [min(6, n - k) for k in range(0, n, 6)]  # 6, 6, 4
    expected = [kind for size in sizes for kind in ["start"] * size + ["end"] * size]
    assert [kind for kind, _ in rec.events] == expected
    arrival = [(g, i) for g, row in enumerate(BUDGETS) for i in range(len(row))]
    assert _first_dispatches(report) == arrival  # batches in arrival order
    flat = [report.outcomes[g][i] for g, i in arrival]
    for k in range(6, n, 6):
        assert min(o.dispatched_at for o in flat[k:k + 6]) >= max(o.finished_at for o in flat[k - 6:k])
    # Refill, by contrast, starts a request as soon as one ends while others are still running.
    rec = Recording(engine)
    _run(rec, _groups(tokenizer, BUDGETS), concurrency=6, policy="refill")
    live, ended, overlapped = 0, False, False
    for kind, _ in rec.events:
        if kind == "start":
            overlapped |= ended and live > 0
            live += 1
        else:
            ended, live = True, live - 1
    assert overlapped


def test_refill_and_divided_refill_follow_arrival_order(engine, tokenizer):
    arrival = [(g, i) for g, row in enumerate(BUDGETS) for i in range(len(row))]
    assert _first_dispatches(_run(engine, _groups(tokenizer, BUDGETS), concurrency=3, policy="refill")) == arrival
    report = _run(engine, _groups(tokenizer, BUDGETS), concurrency=3, policy="refill", chunk_tokens=4)
    assert _first_dispatches(report) == arrival


def test_rejects_bad_settings(engine, tokenizer):
    with pytest.raises(ValueError):
        RolloutDispatcher(engine, concurrency=2, policy="barrier", chunk_tokens=4)
    with pytest.raises(ValueError):
        RolloutDispatcher(engine, concurrency=0)
    with pytest.raises(ValueError):
        RolloutDispatcher(engine, concurrency=2, policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        _run(engine, [RolloutGroup(prompt_ids=[1, 2], samplings=[])], concurrency=2)


@pytest.mark.parametrize("policy", ["barrier", "refill", "seer"])
def test_interrupted_requests_are_continued_to_their_budget(engine, tokenizer, policy):
    # Partial rollout: a weight update interrupts the requests in flight; the dispatcher resubmits each
    # with its tokens so far, so the result is whole and its later tokens carry the new version.
    budgets = [[40, 30], [35, 25]]
    groups = _groups(tokenizer, budgets)

    async def go() -> ScheduleReport:
        task = asyncio.ensure_future(RolloutDispatcher(engine, concurrency=4, policy=policy).run(groups))
        while engine.metrics.generated_tokens < 20:
            await asyncio.sleep(0.001)
        engine.interrupt()
        await asyncio.to_thread(engine.update_weights, None, 1)
        return await task

    report = asyncio.run(go())
    interrupted = 0
    for g, row in enumerate(budgets):
        for i, budget in enumerate(row):
            r = report.outcomes[g][i].result
            assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == budget and r.finish_reason == "length"
            assert r.versions == sorted(r.versions) and r.versions[-1] == 1
            interrupted += report.outcomes[g][i].chunks > 1
    assert interrupted == 4
