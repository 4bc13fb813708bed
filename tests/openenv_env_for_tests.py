"""Two tiny OpenEnv (openenv-core 0.3.0) environments for tests/env/test_openenv_env.py, written on openenv-core's own
server API (openenv-core ships no example environment) and served by uvicorn as an environment package's would be.

`app`: a text game. reset(seed, target) picks a number from 0 to 9 (the seed's, or a data row's `target`); each reply is
a guess, answered "higher" / "lower", reward 1 and done when right, done after three wrong guesses. The reply "die"
makes the server process exit mid-episode (a crashed server). With LOOMRL_TEST_OPENENV_HANG set, importing this module
never finishes (a server that never gets healthy).

`tools_app`: an MCP environment (its action is CallToolAction): tools `add(a, b)`, `broken(x)` (raises: a bug in the
tool) and `submit(answer)` (ends the episode, reward 1 when the answer is 5).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

if os.environ.get("LOOMRL_TEST_OPENENV_HANG"):
    time.sleep(600)

PROMPT = "I picked a number from 0 to 9. Guess it: reply with the number only."


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""
    tries: int = 0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance: nothing shared

    def __init__(self):
        super().__init__()
        self._state = State()
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None,
              **kwargs: Any) -> GuessObservation:
        self.target = int(target) if target is not None else random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=PROMPT)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        guess = action.message.strip()
        if guess == "die":
            os._exit(3)
        n = self._state.step_count
        if guess == str(self.target):
            return GuessObservation(prompt="Correct!", tries=n, done=True, reward=1.0)
        hint = "higher" if guess.isdigit() and int(guess) < self.target else "lower"
        return GuessObservation(prompt=f"No, {hint}.", tries=n, done=n >= 3, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=8)


class TaskObservation(Observation):
    prompt: str


class SumToolsEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("sum")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def broken(x: str) -> str:
            """A tool with a bug."""
            raise AttributeError("'NoneType' object has no attribute 'group'")

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer (ends the episode)."""
            return "submitted"  # never run: step_async ends the episode first

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return TaskObservation(prompt="What is 2 + 3? Use the tools, then submit the answer.")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            right = str(action.arguments.get("answer")) == "5"
            return CallToolObservation(tool_name="submit", result="submitted", done=True, reward=float(right))
        return await super().step_async(action, timeout_s=timeout_s, **kwargs)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": "only tool calls"})

    @property
    def state(self) -> State:
        return self._state


tools_app = create_app(SumToolsEnvironment, CallToolAction, CallToolObservation, env_name="sum",
                       max_concurrent_envs=8)
