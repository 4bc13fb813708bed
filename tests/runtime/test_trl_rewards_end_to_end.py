"""A TRL user's run, end to end: a custom tool environment (tests/note_env_for_tests.py) trained on the tiny model from a
`datasets` save_to_disk DatasetDict with TRL's documented reward functions unchanged (tests/trl_rewards_for_tests.py).
Every stored trajectory's reward components are what those functions give for TRL's completion of that episode, built
here from the trajectory store as TRL's tool loop builds it (trl/trainer/grpo_trainer.py `_tool_call_loop`)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import datasets
import pytest
import trl_rewards_for_tests as documented
from note_env_for_tests import ROWS

from loomrl.config import load_config
from loomrl.runtime.run import train
from loomrl.store import plain_row, read_rows

pytestmark = pytest.mark.integration  # starts processes, servers or training runs: not in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
# TRL's documented functions, and the smoke recipe's parity reward in TRL's form: a random model's replies all run to
# sampling.max_tokens, so only the parity of its first token differs within a group (what lets a step train)
FUNCTIONS = ("docs_token_length", "docs_char_length", "format_reward_func", "async_reward_func", "think_format_reward",
             "correctness_reward", "first_token_parity")


def _dataset(folder: Path) -> str:
    """What a TRL user keeps: DatasetDict.save_to_disk."""
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:20]),
                          "test": datasets.Dataset.from_list(ROWS[20:])}).save_to_disk(str(folder))
    return str(folder)


def _trl_completion(turns: list[dict]) -> list[dict]:
    """TRL's completion of a tool episode: each reply {"role": "assistant", "content", "tool_calls"?}, then the tool's
    answer {"role": "tool", "name", "content"} where the model was shown one."""
    out = []
    for t in turns:
        assert "<tool_call>" not in t["act"]  # the model's own text (the environment made its call)
        message = {"role": "assistant", "content": (f"<think>{t['think']}</think>" if t["think"] else "") + t["act"]}
        calls = [c for c in t["tool_calls"] if not c.get("error")]
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in calls]
        out.append(message)
        if t["obs_span"] is not None and t["obs"]:
            out.append({"role": "tool", "name": calls[0]["name"], "content": t["obs"]})
    return out


def _trl_rewards(row: dict) -> dict[str, float]:
    """Each documented function on this stored trajectory, called as TRL's _calculate_rewards calls it."""
    row = plain_row(row)  # tool calls as recorded (their open-shaped record is JSON in the store)
    contexts = [*row["segments"], {"token_ids": row["token_ids"], "turns": row["turns"]}]
    turns = [t for c in contexts for t in c["turns"]]
    ids = []
    for c in contexts:  # after the prompt: the sampled tokens and the tool's answers between them
        spans = [s for t in c["turns"] for s in (t["act_span"], t["obs_span"]) if s is not None]
        ids += list(c["token_ids"][min(s["start"] for s in spans) : max(s["end"] for s in spans)])
    kwargs = {"prompts": [[{"role": "user", "content": row["prompt"]}]], "completions": [_trl_completion(turns)],
              "completion_ids": [ids], "answer": [row["answer"]]}
    out = {}
    for name in FUNCTIONS:
        values = getattr(documented, name)(**kwargs)
        out[name] = (asyncio.run(values) if inspect.isawaitable(values) else values)[0]
    return out


@pytest.mark.parametrize("source", ["dataset", "own"])
def test_trls_documented_reward_functions_train_a_custom_environment(tmp_path, source):
    """From a save_to_disk dataset (the issue's done-when), and from the environment's own tasks (the same questions)."""
    data = [f"data.path={_dataset(tmp_path / 'yes_no')}", "data.prompt=prompt", "data.answer=answer"]
    terms = ", ".join(f"{{function: trl_rewards_for_tests:{f}, weight: 1.0}}" for f in FUNCTIONS)
    cfg = load_config(ROOT / "examples" / "calculator_tiny.yaml", [
        f"output_dir={tmp_path / 'runs'}", "name=trl-rewards", "progress=false", "trainer.total_steps=2",
        "env.name=note_env_for_tests:NoteEnvironment", "env.families=null", *(data if source == "dataset" else []),
        "agent.max_turns=2", "agent.max_context_tokens=1000", "eval.n_tasks=2", "reward.function=null",
        f"reward.functions=[{terms}]", "checkpoint_every=0"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["ledger"]["trained"] > 0
    rows = read_rows(cfg.run_dir / "trajectories")
    scored = [r for r in rows if r["reward_components"] and "reward_failed" not in r["reward_components"]]
    assert scored and not [r["error"] for r in rows if r["error"]]  # no function raised on any trajectory
    for row in scored:
        stored = row["reward_components"]
        assert stored == pytest.approx(_trl_rewards(row)), (row["trajectory_id"], stored)
        # every episode a tool episode: completion[0] the tool-call turn, then the tool's answer, then the final reply
        assert stored["docs_char_length"] >= 3 and stored["async_reward_func"] == 1.0
        assert stored["correctness_reward"] in (-0.5, 0.6, -1.0)
        assert row["total_reward"] == pytest.approx(sum(stored.values()))
