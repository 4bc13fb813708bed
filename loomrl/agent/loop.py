"""White-box multi-turn agent loop.

The trajectory is one token sequence: the rendered prompt, then for every turn the tokens the engine
sampled (kept exactly, with their logprobs and policy versions) and the tokens of the observation
appended after them. Model output is decoded only to let the env parse it; it is never re-encoded.

Limits: `max_turns` and `max_context_tokens` end the episode as `truncated` (unless a context strategy
makes room: see agent/context.py; each rewrite starts a new context segment); a deadline per trajectory
ends it as `timeout`. A crashing or hanging tool ends only this trajectory (`env_error`, `timeout`),
with the error recorded on the turn and the trajectory.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace
from typing import Any

from loomrl.agent.context import SUMMARY_REQUEST, ContextStrategy
from loomrl.agent.priorities import ProgramPriorities
from loomrl.engine.base import Engine, EngineFault, GenerationResult, SamplingParams, generate_resuming
from loomrl.env.base import Env, EnvCrash, StepResult, ToolTimeout
from loomrl.errors import with_frames
from loomrl.model.chat import ChatRenderer
from loomrl.seeds import keyed_seed
from loomrl.turn_experts import new_rows, recorded_rows
from loomrl.types import ContextSegment, RolloutStatus, Task, TokenSpan, Trajectory, Turn, new_id

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_think(text: str) -> tuple[str, str]:
    """A reply's <think>...</think> parts (joined) and the rest: what rewards read as a turn's `think` and `act`."""
    thoughts = _THINK.findall(text)
    return "\n".join(t.strip() for t in thoughts), _THINK.sub("", text).strip()


def record_step(traj: Trajectory, turn: Turn, step: StepResult) -> bool:
    """What an environment's step said, kept on the turn and the trajectory (the record its own reward reads, the
    final answer); whether the episode is done (then it is COMPLETED). Shared with check-env's endpoint episodes."""
    turn.reward_step = step.reward
    turn.done = step.done
    turn.tool_calls = step.info.get("tool_calls", [])
    if "record" in step.info:  # what the environment's own reward reads (types.Trajectory.env_record)
        traj.env_record = step.info["record"]
    if step.done:
        traj.final_answer = step.info.get("final_answer")
        traj.status = RolloutStatus.COMPLETED
    return step.done


# Shared with the gateway, so white-box and black-box rollouts assemble the same trajectory.
def add_turn(traj: Trajectory, result: GenerationResult, **fields: Any) -> Turn:
    """Append a sampled turn to the current context: its exact tokens, logprobs and versions, and the rows of the
    engine's routed experts (result.routed_experts: the prompt, which is the context so far, and the output) that the
    context's earlier turns did not record (turn_experts.py)."""
    begin = len(traj.token_ids)
    traj.token_ids.extend(result.token_ids)
    start = recorded_rows(traj.turns)
    turn = Turn(act_span=TokenSpan(start=begin, end=len(traj.token_ids)), logprobs=list(result.logprobs),
                versions=list(result.versions), routed_experts=new_rows(result.routed_experts, start),
                routed_start=start, **fields)
    traj.turns.append(turn)
    return turn


def finish_metadata(traj: Trajectory, wall_time: float) -> None:
    """Fill the trajectory's metadata from its turns and contexts once the rollout has ended."""
    md, turns = traj.metadata, traj.all_turns()
    md.total_steps = len(turns)
    md.total_tokens = sum(len(c.token_ids) for c in traj.contexts())
    md.wall_time = wall_time
    md.truncated = traj.status == RolloutStatus.TRUNCATED
    versions = [v for t in turns for v in t.versions]
    md.policy_version_min, md.policy_version_max = (min(versions), max(versions)) if versions else (-1, -1)


class AgentLoop:
    def __init__(self, engine: Engine, renderer: ChatRenderer, *, sampling: SamplingParams,
                 max_turns: int, max_context_tokens: int, trajectory_timeout_s: float = 300.0,
                 context: ContextStrategy | None = None, priorities: ProgramPriorities | None = None,
                 seed: int | None = None):
        self.engine = engine
        self.renderer = renderer
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.trajectory_timeout_s = trajectory_timeout_s
        self.context = context or ContextStrategy(window=max_context_tokens)
        self.resumed = 0  # generations resumed after an interrupt (weight update mid-turn)
        self.priorities = priorities  # Seer's order of engine calls across programs (runtime.schedule)
        # with a seed, a turn samples with a seed keyed by (seed, the episode's stream, the turn's number): seeds.py
        self.seed = seed

    async def run(self, env: Env, task: Task, *, group_id: str = "", position: int = -1,
                  stream: str | None = None) -> Trajectory:
        """Play one episode. `stream`: what names its randomness (e.g. a training episode's data position and group
        member): with the loop's seed, each turn samples with keyed_seed(seed, stream, turn), so the episode's tokens do
        not depend on what else runs; None: unseeded (the engine draws)."""
        start = time.perf_counter()
        deadline = start + self.trajectory_timeout_s
        traj = Trajectory(task_id=task.task_id, trajectory_id=new_id("traj"), group_id=group_id or new_id("group"),
                          position=position, temperature=self.sampling.temperature)
        traj.metadata.env_version = env.version
        try:
            await self._run_turns(env, task, traj, deadline, stream)
        except (EnvCrash, ToolTimeout, TimeoutError, Exception) as err:  # noqa: BLE001 - errors are data
            traj.status = (RolloutStatus.TIMEOUT if isinstance(err, (ToolTimeout, TimeoutError))
                           else RolloutStatus.ENGINE_ERROR if isinstance(err, EngineFault) else RolloutStatus.ENV_ERROR)
            traj.error = with_frames(f"{type(err).__name__}: {err}", err)
            traj.metadata.env_errors += 1
            if traj.turns:
                traj.turns[-1].error = traj.error
        finally:
            self.engine.release(traj.trajectory_id)
            if self.priorities is not None:
                if traj.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED):
                    self.priorities.finished(traj.group_id, traj.trajectory_id)
                else:  # a failed episode says nothing about the group's length (and may be retried)
                    self.priorities.abandoned(traj.group_id, traj.trajectory_id)
        finish_metadata(traj, time.perf_counter() - start)
        return traj

    def _params(self, max_tokens: int, stream: str | None, traj: Trajectory) -> SamplingParams:
        """The next turn's sampling: at most max_tokens, seeded by the turn's number in the episode (its turns so far,
        summaries included, across contexts) when the loop has a seed and the episode a stream."""
        keyed = self.seed is not None and stream is not None
        return replace(self.sampling, max_tokens=max_tokens,
                       seed=keyed_seed(self.seed, stream, len(traj.all_turns())) if keyed else self.sampling.seed)

    async def _run_turns(self, env: Env, task: Task, traj: Trajectory, deadline: float, stream: str | None) -> None:
        t0 = time.perf_counter()
        obs = await asyncio.wait_for(env.reset(task), max(deadline - time.perf_counter(), 0.001))
        traj.metadata.reset_s = time.perf_counter() - t0
        opening = list(obs.messages)
        messages = list(opening)
        ids = self.renderer.prompt_ids(messages, obs.tools)
        traj.prompt_ids, traj.token_ids = list(ids), list(ids)
        traj.status = RolloutStatus.TRUNCATED  # until a turn says done
        new_message, closed = False, True
        for _ in range(self.max_turns):
            if self.context.fires(len(traj.token_ids), messages, new_message):
                messages = await self._new_context(traj, messages, opening, obs.tools, closed, stream)
            new_message = False
            budget = self.max_context_tokens - len(traj.token_ids)
            if budget <= 0:
                return
            if time.perf_counter() > deadline:
                raise TimeoutError(f"trajectory ran past {self.trajectory_timeout_s}s")
            params = self._params(min(self.sampling.max_tokens, budget), stream, traj)
            t0 = time.perf_counter()
            result = await self._generate(list(traj.token_ids), params, traj.trajectory_id, traj.group_id)
            t1 = time.perf_counter()
            text = self.renderer.decode(result.token_ids)
            think, act = split_think(text)
            turn = add_turn(traj, result, think=think, act=act, finish_reason=result.finish_reason, gen_s=t1 - t0)
            messages.append({"role": "assistant", "content": text})
            closed = result.finish_reason == "stop"
            t2 = time.perf_counter()
            step = await asyncio.wait_for(env.step(text), max(deadline - time.perf_counter(), 0.001))
            turn.env_s = time.perf_counter() - t2
            if record_step(traj, turn, step):
                return
            new_ids = self.renderer.continuation_ids(messages, step.observation, closed=closed, tools=obs.tools)
            turn.obs = "\n".join(str(m.get("content", "")) for m in step.observation)
            if len(traj.token_ids) + len(new_ids) >= self.max_context_tokens:
                if not self.context.makes_room:
                    return  # the observation does not fit: truncated
                messages = await self._new_context(traj, messages, opening, obs.tools, closed, stream,
                                                   pending=step.observation)
                continue  # the strategy made room; the observation goes into the new context
            obs_start = len(traj.token_ids)
            traj.token_ids.extend(new_ids)
            turn.obs_span = TokenSpan(start=obs_start, end=len(traj.token_ids))
            messages.extend(step.observation)
            new_message = True

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, program_id: str,
                        group_id: str = "") -> GenerationResult:
        p = self.priorities
        priority = p.priority(group_id, program_id) if p is not None else 0
        result, resumed = await generate_resuming(self.engine, prompt_ids, params, program_id, priority, group_id)
        self.resumed += resumed
        if p is not None:
            p.generated(group_id, program_id, len(result.token_ids))
        return result

    async def _new_context(self, traj: Trajectory, messages: list[dict], opening: list[dict], tools, closed: bool,
                           stream: str | None, pending: list[dict] | None = None) -> list[dict]:
        """Apply the context strategy: close the current context as a segment, start the rewritten one.
        `pending`: an observation that did not fit in the old context, carried into the new one
        (except by discard_all, which keeps the opening messages only)."""
        name = self.context.name
        before = len(traj.token_ids)
        summary = await self._write_summary(traj, messages, tools, closed, stream) if name == "summarize" else None
        rewritten = self.context.rewrite(opening, messages, summary)
        if pending and name != "discard_all":
            rewritten = [*rewritten, *pending]
        ids = self.renderer.prompt_ids(rewritten, tools)
        event = {"action": name, "tokens_before": before, "tokens_after": len(ids),
                 "messages_before": len(messages), "messages_after": len(rewritten)}
        if traj.turns:
            traj.turns[-1].context_events.append(event)
        traj.segments.append(ContextSegment(reason=name, prompt_ids=traj.prompt_ids, token_ids=traj.token_ids,
                                            turns=traj.turns))
        traj.prompt_ids, traj.token_ids, traj.turns = list(ids), list(ids), []
        self.engine.release(traj.trajectory_id)  # the old context's cached K/V will not be reused
        return rewritten

    async def _write_summary(self, traj: Trajectory, messages: list[dict], tools, closed: bool,
                             stream: str | None) -> str:
        """The policy writes the summary in the current context: a sampled turn, trained with it."""
        ask = self.renderer.continuation_ids(messages, [{"role": "user", "content": SUMMARY_REQUEST}], closed=closed,
                                             tools=tools)
        room = self.max_context_tokens - len(traj.token_ids) - len(ask)
        if room <= 0:
            return ""  # no room left to ask: the new context starts from the opening messages
        traj.token_ids.extend(ask)
        params = self._params(min(self.context.summary_max_tokens, room), stream, traj)
        result = await self._generate(list(traj.token_ids), params, traj.trajectory_id, traj.group_id)
        text = self.renderer.decode(result.token_ids)
        add_turn(traj, result, act=text, finish_reason=result.finish_reason,
                 context_events=[{"action": "summary_written"}])
        return split_think(text)[1]
