"""Wiring of the pools: rollout (engine + envs + agent loops), reward, training; local runtime."""
