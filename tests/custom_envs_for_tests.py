"""Custom environments for tests of the public environment API (tests/env/test_env_api.py): a factory function
with its own args model, a ToolEnv with in-process and sandbox tools, and factories that are wrong."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from pydantic import BaseModel

from loomrl.env import Environment, EpisodeContext, TaskSetup, ToolEnv, tool
from loomrl.types import Task


class LookupArgs(BaseModel):
    table: dict[str, int] = {"a": 1, "b": 2, "c": 3}
    mode: Literal["plain", "loud"] = "plain"


class LookupEpisode(ToolEnv):
    version = "lookup-test-1"
    system_prompt = "Look values up."

    def __init__(self, ctx: EpisodeContext, table: dict[str, int]):
        super().__init__(ctx)
        self.table = table

    @tool
    def lookup(self, key: str) -> int:
        """Look a key up in the table.

        Args:
            key: the key
        """
        return self.table[key]

    @tool
    def add(self, x: int, y: int = 1) -> int:
        """Add two integers.

        Args:
            x: the first
            y: the second
        """
        return x + y

    @tool
    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("boom")

    @tool(timeout_s=0.3)
    async def stall(self) -> str:
        """Never answers in time."""
        await asyncio.sleep(30)
        return "late"

    @tool(timeout_s=0.3)
    def stall_sync(self) -> str:
        """Blocks past its timeout (a thread Python cannot stop)."""
        time.sleep(1.0)
        return "late"

    @tool(sandbox=True)
    async def shell(self, command: str, sandbox) -> str:
        """Run a command in the sandbox.

        Args:
            command: a shell command line
        """
        result = await sandbox.exec(["sh", "-c", command], timeout=self.ctx.tool_timeout_s)
        return result.stdout.strip()


class Lookup(Environment):
    """Tasks: which value does key k have. Made by `make_lookup` below (a factory function)."""

    version = "lookup-test-1"
    sandbox = "call"

    def __init__(self, args: LookupArgs):
        self.args = args

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        keys = sorted(self.args.table)
        make = lambda split, n: [Task(task_id=f"lk-{split}-{i}", prompt=f"What is {keys[i % len(keys)]}?",  # noqa: E731
                                      answer=str(self.args.table[keys[i % len(keys)]]), split=split) for i in range(n)]
        return make("train", setup.n_train), make("heldout", setup.n_heldout)

    def episode(self, ctx: EpisodeContext) -> LookupEpisode:
        return LookupEpisode(ctx, self.args.table)


def make_lookup(args: LookupArgs) -> Lookup:
    return Lookup(args)


def not_an_environment() -> str:
    return "nope"


class NoTasks(Environment):
    def episode(self, ctx: EpisodeContext) -> LookupEpisode:
        return LookupEpisode(ctx, {})
