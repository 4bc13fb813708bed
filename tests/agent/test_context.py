"""Context management as an action: each strategy's recorded event, the context segments it makes,
and their training masks. The engine is the real built-in engine on the tiny model, except for
clear_thinking, which needs `<think>` blocks that a random model never writes (a scripted engine
replays them there)."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.agent.context import ContextStrategy
from loomrl.agent.loop import AgentLoop, split_think
from loomrl.engine.base import GenerationResult, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.env.base import Observation, StepResult
from loomrl.model.chat import ChatRenderer
from loomrl.trainer.grpo import samples_from_group
from loomrl.types import Task

OPENING = [{"role": "system", "content": "You are testing contexts."}, {"role": "user", "content": "Keep going."}]
OBSERVATION = "Observation: the value is 42 and nothing else happened."


class TalkEnv:
    """Answers every turn with the same observation and never ends: drives the context past its window."""

    version = "talk-v1"

    async def reset(self, task: Task) -> Observation:
        return Observation(messages=[dict(m) for m in OPENING])

    async def step(self, action: str) -> StepResult:
        return StepResult(observation=[{"role": "user", "content": OBSERVATION}])

    async def close(self) -> None:
        pass


class ThinkingEngine:
    """Scripted: every turn is `<think>secret plan N</think>act N` plus end of turn."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.turn = 0

    async def generate(self, request):
        self.turn += 1
        ids = self.tokenizer.encode(f"<think>secret plan {self.turn}</think>act {self.turn}", add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return GenerationResult(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids), finish_reason="stop")

    def release(self, program_id):
        pass


def run(engine, tokenizer, strategy: str, *, window=220, max_turns=8, **kw):
    renderer = ChatRenderer(tokenizer)
    loop = AgentLoop(engine, renderer, sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=0),
                     max_turns=max_turns, max_context_tokens=window,
                     context=ContextStrategy(strategy, window=window, **kw))
    traj = asyncio.run(loop.run(TalkEnv(), Task(task_id="t", prompt="", answer="")))
    return traj, renderer


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)
    yield eng
    eng.close()


def check_segments_train_exactly_what_was_sampled(traj):
    samples = samples_from_group([traj, traj])[: len(traj.contexts())]
    assert len(samples) == len(traj.segments) + 1  # one sample per context
    for ctx, sample in zip(traj.contexts(), samples):
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        sampled = [t for turn in ctx.turns for t in ctx.token_ids[turn.act_span.start:turn.act_span.end]]
        assert trained == sampled and sum(sample.loss_mask) == sum(len(t.logprobs) for t in ctx.turns)
        assert sample.loss_mask[: len(ctx.prompt_ids)] == [0] * len(ctx.prompt_ids)  # prompts are never trained


def test_discard_all_keeps_the_opening_only(engine, tokenizer):
    traj, renderer = run(engine, tokenizer, "discard_all", threshold=0.7)
    assert traj.segments and {s.reason for s in traj.segments} == {"discard_all"}
    opening_ids = renderer.prompt_ids(OPENING)
    for seg, after in zip(traj.segments, [*traj.segments[1:], traj]):
        event = seg.turns[-1].context_events[-1]
        assert event["action"] == "discard_all" and event["tokens_before"] >= 0.7 * 220
        assert event["tokens_after"] == len(opening_ids) and after.prompt_ids == opening_ids
    check_segments_train_exactly_what_was_sampled(traj)
    assert len(traj.all_turns()) == 8 and traj.metadata.total_steps == 8  # the episode ran past the window


def test_keep_last_keeps_the_opening_and_the_last_turns(engine, tokenizer):
    traj, renderer = run(engine, tokenizer, "keep_last", threshold=0.7, keep_last=1)
    assert traj.segments and traj.segments[0].reason == "keep_last"
    seg, after = traj.segments[0], (traj.segments[1] if len(traj.segments) > 1 else traj)
    last = seg.turns[-1]
    expected = renderer.prompt_ids([*OPENING, {"role": "assistant", "content": renderer.decode(
        seg.token_ids[last.act_span.start:last.act_span.end])}, {"role": "user", "content": OBSERVATION}])
    assert after.prompt_ids == expected
    event = last.context_events[-1]
    assert event["action"] == "keep_last" and event["messages_after"] == len(OPENING) + 2 < event["messages_before"]
    check_segments_train_exactly_what_was_sampled(traj)


def test_clear_thinking_drops_spent_reasoning_when_a_new_message_arrives(tokenizer):
    traj, renderer = run(ThinkingEngine(tokenizer), tokenizer, "clear_thinking", window=2000, max_turns=3)
    assert [s.reason for s in traj.segments] == ["clear_thinking", "clear_thinking"]
    for i, ctx in enumerate(traj.contexts()[1:], start=1):
        text = tokenizer.decode(ctx.prompt_ids)
        assert "secret plan" not in text and f"act {i}" in text  # reasoning gone, actions kept
        assert traj.segments[i - 1].turns[-1].context_events == [
            {"action": "clear_thinking", "tokens_before": len(traj.segments[i - 1].token_ids),
             "tokens_after": len(ctx.prompt_ids), "messages_before": len(OPENING) + 2 * i,
             "messages_after": len(OPENING) + 2 * i}]
    check_segments_train_exactly_what_was_sampled(traj)


def test_summarize_is_a_sampled_action_trained_with_the_closed_context(engine, tokenizer):
    traj, renderer = run(engine, tokenizer, "summarize", window=260, threshold=0.6, summary_max_tokens=10)
    assert traj.segments and traj.segments[0].reason == "summarize"
    seg = traj.segments[0]
    summary_turn = seg.turns[-1]
    assert summary_turn.context_events[0] == {"action": "summary_written"}
    assert summary_turn.context_events[1]["action"] == "summarize"
    assert 0 < len(summary_turn.logprobs) <= 10
    after = traj.segments[1] if len(traj.segments) > 1 else traj
    assert after.prompt_ids == renderer.prompt_ids(
        [*OPENING, {"role": "user", "content": f"Summary of the earlier turns: {split_think(summary_turn.act)[1]}"}])
    check_segments_train_exactly_what_was_sampled(traj)  # the summary tokens are in the closed context's mask


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'forget'"):
        ContextStrategy("forget")
