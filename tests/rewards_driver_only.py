"""A reward module that imports in the process that starts a run (LOOMRL_TEST_DRIVER=1, set by the test) and raises
anywhere else: it stands for a reward whose package is installed where the run is started but not on the rollout
nodes, so that a rollout actor's constructor fails (tests/runtime/test_ray_runtime.py)."""

from __future__ import annotations

import os

if os.environ.get("LOOMRL_TEST_DRIVER") != "1":
    raise ImportError("no_such_package: this reward's package is not installed on the rollout nodes (simulated)")

from rewards_for_tests import parity_reward  # noqa: E402, F401 - the reward itself, where it imports
