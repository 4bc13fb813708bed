"""Batch samplers: ordering of each sampler, the window's guarantees, ready(), errors."""

from __future__ import annotations

import copy
import math
import random

import pytest

from loomrl.buffer.samplers import (
    SAMPLERS,
    FifoSampler,
    WindowSampler,
    make_sampler,
)
from loomrl.types import Trajectory, TrajectoryMetadata


def drive(sampler, n_groups: int, finish_order: list[int], takes: dict[int, int] | None = None, gaps: bool = False):
    """Submit n_groups, finish them in `finish_order` (ranks); after the k-th finish take takes[k]
    groups (default: none); finally take everything. Returns the ranks in the order taken."""
    index = [3 * r + (r % 2) if gaps else r for r in range(n_groups)]
    rank_of = {i: r for r, i in enumerate(index)}
    for i in index:
        sampler.submitted(i)
    out = []
    for k, r in enumerate(finish_order):
        sampler.finished(index[r], f"g{r}")
        for i, g in sampler.take((takes or {}).get(k, 0)):
            assert g == f"g{rank_of[i]}"
            out.append(rank_of[i])
    out += [rank_of[i] for i, _ in sampler.take(10**9)]
    return out


def reference_window(n_groups: int, window: float, events: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Brute-force Forge window: events are ("finish", rank) or ("take", n). Returns (ranks taken in
    order, ready count after every event)."""
    finished_at: dict[int, int] = {}
    taken: set[int] = set()
    order, readies = [], []

    def eligible():
        head = min((r for r in range(n_groups) if r not in taken), default=n_groups)
        return sorted((finished_at[r], r) for r in finished_at if r not in taken and head <= r < head + window)

    def take_one():
        e = eligible()
        if not e:
            return None
        taken.add(e[0][1])
        return e[0][1]

    for kind, x in events:
        if kind == "finish":
            finished_at[x] = len(finished_at)
        else:
            for _ in range(x):
                r = take_one()
                if r is None:
                    break
                order.append(r)
        saved = set(taken)
        count = 0
        while take_one() is not None:
            count += 1
        taken.clear()
        taken.update(saved)
        readies.append(count)
    return order, readies


def random_events(rng: random.Random, n_groups: int) -> list[tuple[str, int]]:
    ranks = list(range(n_groups))
    rng.shuffle(ranks)
    events = []
    for r in ranks:
        events.append(("finish", r))
        if rng.random() < 0.5:
            events.append(("take", rng.randint(0, 4)))
    return events


def run_events(sampler, n_groups: int, events, gaps: bool = False) -> tuple[list[int], list[int]]:
    index = [5 * r + 2 if gaps else r for r in range(n_groups)]
    rank_of = {i: r for r, i in enumerate(index)}
    for i in index:
        sampler.submitted(i)
    order, readies = [], []
    for kind, x in events:
        if kind == "finish":
            sampler.finished(index[x], x)
        else:
            order += [rank_of[i] for i, _ in sampler.take(x)]
        readies.append(sampler.takeable())
    return order, readies


# -- ordering of each sampler on hand-made sequences ---------------------------------------------------

def test_fifo_is_completion_order():
    assert drive(make_sampler("fifo"), 5, [3, 1, 4, 0, 2]) == [3, 1, 4, 0, 2]


def test_oldest_first_takes_lowest_finished_and_never_waits():
    s = make_sampler("oldest_first")
    assert drive(s, 5, [3, 1, 4, 0, 2]) == [0, 1, 2, 3, 4]
    # taking after each finish: it never waits for an unfinished older group
    s = make_sampler("oldest_first")
    assert drive(s, 5, [3, 1, 4, 0, 2], takes={0: 1, 2: 1, 4: 5}) == [3, 1, 0, 2, 4]
    s = make_sampler("oldest_first")
    assert drive(s, 5, [3, 4, 1, 0, 2], takes={2: 2}) == [1, 3, 0, 2, 4]


def test_freshest_first_takes_highest_finished():
    assert drive(make_sampler("freshest_first"), 5, [3, 1, 4, 0, 2]) == [4, 3, 2, 1, 0]
    assert drive(make_sampler("freshest_first"), 5, [0, 3, 1, 4, 2], takes={2: 2}) == [3, 1, 4, 2, 0]


def test_window_hand_made():
    s = make_sampler("window", 2)
    for r in range(6):
        s.submitted(r)
    for r in (1, 2, 3):
        s.finished(r, f"g{r}")
    assert s.takeable() == 1 and len(s) == 3  # only 1 is inside [0, 2); 2 and 3 wait
    assert s.take(5) == [(1, "g1")]
    assert s.takeable() == 0
    s.finished(0, "g0")  # the head: the window moves to [2, 4)
    assert s.takeable() == 3
    assert s.take(5) == [(0, "g0"), (2, "g2"), (3, "g3")]
    assert s.takeable() == 0 and len(s) == 0
    s.finished(5, "g5")  # the window is [4, 6): 5 may overtake 4
    assert s.takeable() == 1 and s.take(2) == [(5, "g5")]


def test_window_hand_made_ready_inside():
    s = make_sampler("window", 2)
    for r in range(6):
        s.submitted(r)
    for r in (0, 1, 2, 3):
        s.finished(r, r)
    assert [i for i, _ in s.take(4)] == [0, 1, 2, 3]
    s.finished(5, 5)
    assert s.takeable() == 1  # window [4, 6)
    assert s.take(1) == [(5, 5)]
    s.finished(4, 4)
    assert s.take(1) == [(4, 4)]


def test_window_advances_only_when_its_oldest_is_taken():
    s = make_sampler("window", 3)
    for r in range(8):
        s.submitted(r)
    s.finished(1, 1)
    s.finished(2, 2)
    assert [i for i, _ in s.take(10)] == [1, 2]
    s.finished(3, 3)
    s.finished(4, 4)
    # 1 and 2 were taken, but the head 0 was not: the window stays [0, 3), so 3 and 4 wait
    assert s.takeable() == 0 and s.take(10) == [] and len(s) == 2
    s.finished(0, 0)
    assert s.takeable() == 3
    assert [i for i, _ in s.take(10)] == [0, 3, 4]


def test_window_take_n_equals_repeated_take_1():
    rng = random.Random(7)
    for _ in range(50):
        order = list(range(12))
        rng.shuffle(order)
        a, b = make_sampler("window", 3), make_sampler("window", 3)
        for r in range(12):
            a.submitted(r)
            b.submitted(r)
        for r in order:
            a.finished(r, r)
            b.finished(r, r)
            n = rng.randint(0, 5)
            got_a = a.take(n)
            got_b = [x for _ in range(n) for x in b.take(1)]
            assert got_a == got_b


@pytest.mark.parametrize("seed", range(40))
def test_window_w1_is_strict_submission_order(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    events = random_events(rng, n) + [("take", n)]
    order, _ = run_events(make_sampler("window", 1), n, events)
    assert order == list(range(n))
    assert order == run_events(make_sampler("oldest_first"), n, [e for e in events if e[0] == "finish"] + [("take", n)])[0]


@pytest.mark.parametrize("seed", range(40))
def test_large_window_is_first_finished(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    events = random_events(rng, n) + [("take", n)]
    fifo, fifo_ready = run_events(make_sampler("fifo"), n, events)
    assert fifo == [x for kind, x in events if kind == "finish"]
    for w in (n, n + 3, math.inf):
        got, ready = run_events(make_sampler("window", w), n, events)
        assert got == fifo and ready == fifo_ready


# -- the window's guarantees against a brute-force model ---------------------------------------------

@pytest.mark.parametrize("window", [1, 2, 3, 4, 8, math.inf])
@pytest.mark.parametrize("seed", range(25))
def test_window_matches_brute_force_model(window, seed):
    """Take order and ready() after every event equal a direct implementation of the definition."""
    rng = random.Random(1000 * seed + (99 if math.isinf(window) else window))
    n = rng.randint(1, 25)
    events = random_events(rng, n) + [("take", n)]
    want = reference_window(n, window, events)
    assert run_events(make_sampler("window", window), n, events) == want
    assert run_events(make_sampler("window", window), n, events, gaps=True) == want


@pytest.mark.parametrize("window", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", range(25))
def test_window_bounded_overtaking(window, seed):
    """Guarantee 1: when rank r is taken, every rank <= r - W has been taken; so at most W-1
    later-submitted groups are taken before any group."""
    rng = random.Random(seed)
    n = 30
    events = random_events(rng, n) + [("take", n)]
    order, _ = run_events(make_sampler("window", window), n, events)
    assert sorted(order) == list(range(n))
    pos = {r: k for k, r in enumerate(order)}
    for r in range(n):
        overtakers = [q for q in range(r + 1, n) if pos[q] < pos[r]]
        assert len(overtakers) <= window - 1
        assert all(q < r + window for q in overtakers)


def test_window_bound_is_tight_and_slow_group_is_not_starved():
    w, n = 4, 20
    s = make_sampler("window", w)
    for r in range(n):
        s.submitted(r)
    for r in range(1, n):  # everything but the slow head finishes
        s.finished(r, r)
    got = [i for i, _ in s.take(n)]
    assert got == [1, 2, 3]  # W-1 overtake the slow group, no more
    s.finished(0, 0)
    assert [i for i, _ in s.take(n)] == [0, *range(4, n)]


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("seed", range(15))
def test_nothing_lost_or_duplicated_and_ready_is_exact(name, seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    events = random_events(rng, n)
    sampler = make_sampler(name, rng.choice([1, 2, 5, math.inf]) if name == "window" else None)
    index = [7 * r + rng.randint(0, 6) for r in range(n)]  # increasing with gaps
    for i in index:
        sampler.submitted(i)
    taken, finished = [], 0
    for kind, x in events:
        if kind == "finish":
            sampler.finished(index[x], ("group", index[x]))
            finished += 1
        else:
            taken += sampler.take(x)
        assert len(sampler) == finished - len(taken)
        ready = sampler.takeable()
        assert ready == len(copy.deepcopy(sampler).take(10**9))  # ready() is what take would return now
    taken += sampler.take(10**9)
    assert sorted(i for i, _ in taken) == index
    assert all(g == ("group", i) for i, g in taken)
    assert len(sampler) == 0 and sampler.takeable() == 0 and sampler.take(3) == []


def test_groups_of_trajectories():
    def group(i, version):
        return [Trajectory(task_id=f"t{i}", trajectory_id=f"t{i}-{k}", group_id=f"g{i}",
                           metadata=TrajectoryMetadata(policy_version_min=version)) for k in range(2)]

    s = make_sampler("window", 2)
    for i in range(3):
        s.submitted(i)
    s.finished(1, group(1, 0))
    s.finished(0, group(0, 0))
    (i1, g1), (i0, g0) = s.take(2)
    assert (i1, i0) == (1, 0) and g1[0].group_id == "g1" and len(g0) == 2


# -- errors -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["FIFO", "lifo", "", "windows"])
def test_unknown_name(name):
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler(name)


@pytest.mark.parametrize("window", [0, -1, -math.inf, math.nan, 1.5, 2.0, True, "3", None])
def test_bad_window(window):
    with pytest.raises(ValueError, match="window"):
        make_sampler("window", window)


def test_window_given_to_other_samplers():
    for name in ("fifo", "oldest_first", "freshest_first"):
        with pytest.raises(ValueError, match="only applies"):
            make_sampler(name, 4)
    with pytest.raises(ValueError, match="window"):
        WindowSampler(0)


def test_misuse():
    s = FifoSampler()
    s.submitted(3)
    with pytest.raises(ValueError, match="increase"):
        s.submitted(3)
    with pytest.raises(ValueError, match="increase"):
        s.submitted(1)
    with pytest.raises(ValueError, match="non-negative"):
        s.submitted(-1)
    with pytest.raises(ValueError, match="never submitted"):
        s.finished(4, "x")
    s.finished(3, "x")
    with pytest.raises(ValueError, match="finished twice"):
        s.finished(3, "x")
    with pytest.raises(ValueError, match="non-negative"):
        s.take(-1)
