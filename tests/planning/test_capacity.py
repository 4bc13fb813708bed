"""The seed's section 4.3 rule on its own example and on cases computed by hand."""

from __future__ import annotations

import pytest

from loomrl.planning.capacity import CapacityInputs, ceil_exact, required_envs


def test_the_seed_example_needs_26_workers_and_one_alone_uses_3_8_percent():
    # "20 步、每步环境延迟 5s、GPU 推理每步 0.2s ... 0.2/5.2 ≈ 3.8% ... 至少 5.2/0.2 ≈ 26 个 worker"
    plan = required_envs(CapacityInputs(env_step_s=5.0, gen_step_s=0.2, turns=20))
    assert plan.workers == 26 and plan.pool_size == 26
    assert f"{plan.utilisation_one_worker:.1%}" == "3.8%"
    assert plan.workers * plan.steps_per_s_per_worker >= plan.engine_steps_per_s  # the core inequality


def test_a_batching_engine_needs_batch_times_more():
    # by hand: batch 2, (1.0 + 0.5) / 0.5 = 3 per request slot -> 6 workers
    assert required_envs(CapacityInputs(env_step_s=1.0, gen_step_s=0.5, engine_batch=2)).workers == 6
    assert required_envs(CapacityInputs(env_step_s=5.0, gen_step_s=0.2, engine_batch=64)).workers == 26 * 64


def test_resets_off_the_workers_path_add_to_the_pool():
    # by hand: 6 workers, trajectory 3 x 1.5 = 4.5 s, reset 0.9 s -> 6 x 0.9 / 4.5 = 1.2 resetting -> 2 more
    plan = required_envs(CapacityInputs(env_step_s=1.0, gen_step_s=0.5, engine_batch=2, turns=3, reset_s=0.9))
    assert (plan.workers, plan.pool_size) == (6, 8)


def test_no_environment_latency_needs_one_worker_per_batch_slot_and_a_fraction_rounds_up():
    assert required_envs(CapacityInputs(env_step_s=0.0, gen_step_s=0.1, engine_batch=4)).workers == 4
    assert required_envs(CapacityInputs(env_step_s=0.25, gen_step_s=1.0)).workers == 2  # 1.25 -> 2
    assert ceil_exact(5.2 / 0.2) == 26 and ceil_exact(26.001) == 27


def test_the_engine_time_must_be_positive():
    with pytest.raises(ValueError, match="gen_step_s"):
        required_envs(CapacityInputs(env_step_s=1.0, gen_step_s=0.0))


def test_the_long_tail_is_the_expected_longest_of_n_past_the_mean():
    from loomrl.planning.predict import tail

    # by hand: two draws from {1, 2}: max is 1 with probability 1/4, else 2 -> 1.75, mean 1.5
    assert tail((1.0, 2.0), 2) == pytest.approx(0.25)
    assert tail((1.0, 2.0), 1) == 0.0 and tail((), 5) == 0.0
    times = (0.0, 1.0, 2.0, 3.0)
    assert tail(times, 3) == pytest.approx(3 * (1 - (3 / 4) ** 3) + 2 * ((3 / 4) ** 3 - (2 / 4) ** 3)
                                           + 1 * ((2 / 4) ** 3 - (1 / 4) ** 3) - 1.5)
    assert tail(times, 50) == pytest.approx(1.5, abs=1e-5)  # many draws: the longest is the maximum
