"""Environments and an engine for tests/test_check_env.py: a lookup ToolEnv whose tool has a bug (env.args.buggy: it
raises AttributeError on every call, the issue's own example) or none, and an engine that answers as a capable model
would, which the random tiny model cannot."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from loomrl.env import Environment, EpisodeContext, TaskSetup, ToolEnv, tool
from loomrl.types import Task

TABLE = {"a": 11, "b": 22, "c": 33}


class LookupArgs(BaseModel):
    buggy: bool = True


class LookupEpisode(ToolEnv):
    version = "check-lookup-1"
    system_prompt = "Look the key up with the lookup tool, then answer with the number alone."

    def __init__(self, ctx: EpisodeContext, buggy: bool):
        super().__init__(ctx)
        self.buggy = buggy

    @tool
    def lookup(self, key: str) -> str:
        """Look a key up in the table.

        Args:
            key: the key
        """
        # the bug: the pattern is lower-case but the key is upper-cased first, so the match is None
        match = re.fullmatch(r"[a-z]", key.upper() if self.buggy else key)
        return f"{key} = {TABLE[match.group(0)]}"  # type: ignore[union-attr]


class Lookup(Environment):
    Args = LookupArgs
    version = "check-lookup-1"

    def __init__(self, args: LookupArgs):
        self.args = args

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        keys = sorted(TABLE)
        make = lambda split, n: [Task(task_id=f"{split}-{i}", prompt=f"What is the value of {keys[i % 3]}?",  # noqa: E731
                                      answer=str(TABLE[keys[i % 3]]), split=split) for i in range(n)]
        return make("train", setup.n_train), make("heldout", setup.n_heldout)

    def episode(self, ctx: EpisodeContext) -> LookupEpisode:
        return LookupEpisode(ctx, self.args.buggy)


class CapableEngine:
    """Stands in for a strong model behind `loomrl serve` (the random tiny model never writes a tool call): the first
    reply of a conversation calls lookup on the key its question names, a later one answers with the number the tool
    gave, or says it has none. It reads the rendered prompt (ChatML: SmolLM2's template)."""

    kv_budget = 1 << 20

    def __init__(self, tokenizer):
        from loomrl.engine.base import EngineMetrics

        self.tokenizer = tokenizer
        self.version = 0
        self.metrics = EngineMetrics()

    def reply(self, prompt: str) -> str:
        if prompt.count("<|im_start|>assistant") <= 1:  # only the generation prompt: nothing said yet
            key = re.findall(r"value of (\w)\?", prompt)[-1]
            return "<tool_call>" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "</tool_call>"
        found = re.findall(r"\w = (\d+)", prompt)
        return found[-1] if found else "I could not look it up."

    async def generate(self, request):
        from loomrl.engine.base import GenerationResult

        text = self.reply(self.tokenizer.decode(request.prompt_ids))
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenerationResult(token_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                                finish_reason="stop")

    def release(self, program_id):
        pass

    def close(self):
        pass
