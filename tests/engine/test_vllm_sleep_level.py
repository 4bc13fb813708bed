"""The sleep level the vLLM adapter asks for (engine/vllm/control.py sleep_level): vLLM's level 2 discards the weights,
which saves copying them to host memory and back only where the next update overwrites them all."""

from __future__ import annotations

from loomrl.engine.vllm.control import sleep_level


def test_the_weights_are_discarded_only_where_a_whole_update_follows_the_wake():
    assert sleep_level(update_follows_wake=True, last_update_whole=True) == 2  # the colocated run
    assert sleep_level(update_follows_wake=True, last_update_whole=False) == 1  # before any update, or frozen layers
    assert sleep_level(update_follows_wake=False, last_update_whole=True) == 1  # no update promised after the wake
