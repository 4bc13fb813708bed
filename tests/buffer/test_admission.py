"""The admission rule itself (loomrl/buffer/admission.py), which both runtime backends apply: a group
is launched only while the step that will consume it is at most max_lag versions ahead of the weights
it would be sampled with."""

from __future__ import annotations

import pytest

from loomrl.buffer.admission import admits, open_positions


def test_sync_admits_exactly_the_current_step_and_async_lag_more_steps():
    # 2 groups per step: positions 0-1 are consumed at step 0, 2-3 at step 1, ...
    assert [p for p in range(10) if admits(p, version=0, groups_per_step=2, max_lag=0)] == [0, 1]
    assert [p for p in range(10) if admits(p, version=0, groups_per_step=2, max_lag=1)] == [0, 1, 2, 3]
    assert [p for p in range(10) if admits(p, version=3, groups_per_step=2, max_lag=1)] == list(range(10))
    assert [p for p in range(12) if not admits(p, version=3, groups_per_step=2, max_lag=1)] == [10, 11]


@pytest.mark.parametrize("groups_per_step", [1, 2, 3, 8])
@pytest.mark.parametrize("max_lag", [0, 1, 2, 8])
def test_open_positions_counts_what_the_rule_still_admits(groups_per_step, max_lag):
    for version in range(4):
        admitted = [p for p in range(200) if admits(p, version=version, groups_per_step=groups_per_step,
                                                  max_lag=max_lag)]
        assert admitted == list(range(len(admitted)))  # a prefix of the data order: nothing skipped
        # no group trained at step s was launched with weights older than s - max_lag
        assert max(p // groups_per_step for p in admitted) - version == max_lag
        for nxt in range(len(admitted) + 1):
            assert open_positions(nxt, version=version, groups_per_step=groups_per_step,
                                  max_lag=max_lag) == len(admitted) - nxt
