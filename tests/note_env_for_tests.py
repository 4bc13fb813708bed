"""A custom tool environment for tests/runtime/test_trl_rewards_end_to_end.py, written on loomrl's public API as a user
writes one (docs/environments.md): yes/no questions, its own (`tasks`) or the same ones from the recipe's `data:` section (ROWS, which the test saves with
`datasets`); one tool, `note`.

A tiny random model never writes a well-formed tool call, so this environment takes the first reply of each episode
as the `note` tool's argument: every episode is then a tool episode of TRL's shape, [assistant turn with tool_calls,
tool result, final reply], which is what the test's reward functions must be given."""

from __future__ import annotations

import json

from loomrl.env import Environment, EpisodeContext, TaskSetup, ToolEnv, tool
from loomrl.env.base import StepResult
from loomrl.types import Task

# the questions, as a TRL user's dataset holds them: conversational prompts and an answer column
ROWS = [{"prompt": [{"role": "user", "content": f"Is {a} + {b} equal to {a + b + s}?"}], "answer": "yes" if s == 0 else "no"}
        for a in range(4) for b in range(3) for s in (0, 1)]


class NoteEpisode(ToolEnv):
    version = "note-test-1"
    system_prompt = "Note what you know with the note tool, then answer *yes* or *no*."

    def __init__(self, ctx: EpisodeContext):
        super().__init__(ctx)
        self.notes: list[str] = []

    @tool
    def note(self, text: str) -> str:
        """Keep a note for later.

        Args:
            text: what to note
        """
        self.notes.append(text)
        return f"noted ({len(self.notes)})"

    async def step(self, action: str) -> StepResult:
        if not self.notes:  # the first reply is the note (see the module's doc)
            action = f"<tool_call>{json.dumps({'name': 'note', 'arguments': {'text': action}})}</tool_call>"
        return await super().step(action)


class NoteEnvironment(Environment):
    version = "note-test-1"

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        own = [Task(task_id=f"own-{i}", prompt=r["prompt"][0]["content"], answer=r["answer"], split="train" if i < 20
                    else "heldout") for i, r in enumerate(ROWS)]
        return own[:20], own[20:]

    def episode(self, ctx: EpisodeContext) -> NoteEpisode:
        return NoteEpisode(ctx)
