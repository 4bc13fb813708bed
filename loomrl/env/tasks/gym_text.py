"""Gymnasium toy-text games as multi-turn text environments.

Games (keys of GYM_GAMES): frozenlake (the fixed 4x4 map, not slippery), frozenlake_random (a random
solvable 4x4 map per episode seed), taxi, cliffwalking, blackjack. The games run in-process: toy-text
envs are pure Python and execute no model-written code, so they need no sandbox.

Observations: the system prompt holds the rules and the answer format; every user message holds the
state as text and the legal actions. Grid games use gymnasium's "ansi" render with the colour codes
stripped; the cell the game highlights in colour (the agent, the taxi) becomes "@" so the position
survives stripping, and one sentence gives it in words (rows and columns count from 1 at the top left).
Taxi also names the passenger and the destination in words, since the ansi render only colours them.
Blackjack has no ansi render and is described from its observation tuple.

Action parsing (one action per turn; case-insensitive): `<think>...</think>` is dropped, then the FIRST
action in the reply is played: the first tool call if the reply has any (Hermes `<tool_call>{"name":
"move", "arguments": {"action": "left"}}</tool_call>` or `move(left)`), else the first line that is
only an action word. If that first action is not in the game's vocabulary the reply is invalid; later
actions are not tried, so what is played is always what the model put first. An invalid reply does not
step the game and is answered with an error listing the legal actions; `max_invalid` (3) invalid replies
in a row end the episode (info["invalid_limit"]).

Worked examples (few_shot="game", off by default): before the task, two moves of the same game are shown as
earlier chat turns (GymGame.example): a state, `move(...)`, the state that move led to, `move(...)`; for Blackjack
two one-move hands. They are played on a real env, so their text is exactly what the env shows. A 135M model
needs them to reply with an action at all: without them SmolLM2-135M-Instruct made no valid move in 200 greedy
episodes (40 of each game) and in 188 of 200 sampled at temperature 1, and won none. The FrozenLake example is on a
map of its own; CliffWalking has one start, so its example shows the first two moves of the task itself (up,
right), as any example of that game would.

Rewards: each step's reward is the game's own (FrozenLake 1 at the goal; Taxi -1 a step, +20 delivered,
-10 bad pickup/dropoff; CliffWalking -1 a step, -100 into the cliff; Blackjack +1/0/-1), 0 for an
invalid reply; they are shown to the agent, and the reward is success alone (gym_reward says why). Success:
FrozenLake and CliffWalking reached the goal, Taxi delivered the passenger, Blackjack won. An episode ends when the game terminates or its step budget (GymGame.max_steps, enforced
by gymnasium's TimeLimit) runs out; its last info carries final_answer "success" or "failure", which
the agent loop copies to Trajectory.final_answer for gym_reward.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import gymnasium as gym
from gymnasium.envs.toy_text import CliffWalkingEnv, FrozenLakeEnv, TaxiEnv
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from pydantic import BaseModel, ConfigDict

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.base import Env, Observation, StepResult
from loomrl.model.tools import parse_tool_calls
from loomrl.types import RolloutStatus, Task, Trajectory

ENV_VERSION = "gym-text-v1"
SUCCESS, FAILURE = "success", "failure"  # Task.answer / final_answer values
MOVE_TOOL = {"move": "action"}  # tool name -> its single argument, for parse_tool_calls

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HIGHLIGHT = re.compile(r"\x1b\[4[0-7](?:;1)?m(.)\x1b\[0m")  # a background-coloured cell: the agent
_LAST_ACTION = re.compile(r"^\s*\(\w+\)\s*$")  # the "  (Left)" line ansi renders add after a step
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)  # an unclosed <think> runs to the end
_TAXI_STOPS = ["R", "G", "Y", "B"]


def _registered(*ids: str) -> str:
    """The first of `ids` this gymnasium registers (Taxi-v3 became v4 and CliffWalking-v0 v1 in 1.x)."""
    return next((i for i in ids if i in gym.registry), ids[-1])


_Toy = TypeVar("_Toy", bound=gym.Env)


def _unwrapped(env: gym.Env, kind: type[_Toy]) -> _Toy:
    """The game under `env`'s wrappers, as the renderer of `kind` reads it."""
    game = env.unwrapped
    if not isinstance(game, kind):
        raise TypeError(f"a {kind.__name__} renderer got a {type(game).__name__}")
    return game


def _grid_lines(env: gym.Env) -> str:
    """The ansi render with the highlighted cell as "@", colours stripped, the last-action line dropped."""
    frame = env.render()
    if not isinstance(frame, str):  # grid games are made with render_mode="ansi" (GymGame.ansi)
        raise TypeError(f"an ansi render is text, got {type(frame).__name__}")
    text = _ANSI.sub("", _HIGHLIGHT.sub("@", frame))
    return "\n".join(line for line in text.splitlines() if line.strip() and not _LAST_ACTION.match(line))


def _render_frozenlake(env: gym.Env, obs: int) -> str:
    row, col = divmod(obs, _unwrapped(env, FrozenLakeEnv).ncol)
    return f"{_grid_lines(env)}\nYou (@) are at row {row + 1}, column {col + 1}."


def _render_taxi(env: gym.Env, obs: int) -> str:
    row, col, passenger, destination = _unwrapped(env, TaxiEnv).decode(obs)
    where = "is in the taxi" if passenger == 4 else f"is waiting at {_TAXI_STOPS[passenger]}"
    return (f"{_grid_lines(env)}\nThe taxi (@) is at row {row + 1}, column {col + 1}. "
            f"The passenger {where}. The destination is {_TAXI_STOPS[destination]}.")


def _render_cliffwalking(env: gym.Env, obs: int) -> str:
    # This render marks the agent with "x" and no colour, so "@" is swapped in for the same legend.
    row, col = divmod(obs, _unwrapped(env, CliffWalkingEnv).shape[1])
    return f"{_grid_lines(env).replace('x', '@')}\nYou (@) are at row {row + 1}, column {col + 1}."


def _render_blackjack(env: gym.Env, obs: tuple[int, int, int]) -> str:
    player, dealer, usable_ace = obs
    shows = "an ace" if dealer == 1 else str(dealer)
    ace = "a usable ace" if usable_ace else "no usable ace"
    return f"Your sum is {player}, the dealer shows {shows}, you have {ace}."


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkedGame:
    """A worked example: the game started from `seed` (with `make_kwargs`, else the game's own), then `actions`."""

    seed: int
    actions: tuple[str, ...]
    make_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GymGame:
    gym_id: str
    rules: str
    actions: Mapping[str, int]  # action word -> gymnasium action
    max_steps: int  # game steps per episode (invalid replies do not count)
    render: Callable[[gym.Env, Any], str]  # (env, observation) -> state text
    make_kwargs: Callable[[int], dict[str, Any]] = lambda seed: {}  # episode seed -> gym.make kwargs
    # Given the last reward of a terminated episode; by default, won when it is positive.
    success: Callable[[float], bool] = lambda reward: reward > 0
    ansi: bool = True  # made with render_mode="ansi"
    example: tuple[WorkedGame, ...] = ()  # shown before the task with few_shot="game", one after the other

    @property
    def legal(self) -> str:
        return ", ".join(self.actions)


_FROZENLAKE = GymGame(
    gym_id="FrozenLake-v1", make_kwargs=lambda seed: {"map_name": "4x4", "is_slippery": False},
    rules="You walk on a frozen lake from the start S to the goal G. F is safe ice; H is a hole, and stepping "
          "into it ends the game. @ marks where you are. Walking into the edge leaves you in place. The ice is "
          "not slippery: you always move where you choose. Reaching G gives reward 1; every other step gives 0.",
    actions={"left": 0, "down": 1, "right": 2, "up": 3}, max_steps=20, render=_render_frozenlake,
    # a map of its own (not the fixed task map): down, then right, both onto safe ice
    example=(WorkedGame(seed=0, actions=("down", "right"),
                        make_kwargs={"desc": ["SFFF", "FFHF", "HFFF", "FHFG"], "is_slippery": False}),))

GYM_GAMES: dict[str, GymGame] = {
    "frozenlake": _FROZENLAKE,
    # The fixed map and start make every frozenlake episode the same; this variant varies the map.
    "frozenlake_random": dataclasses.replace(
        _FROZENLAKE, make_kwargs=lambda seed: {"desc": generate_random_map(size=4, seed=seed), "is_slippery": False}),
    "taxi": GymGame(
        gym_id=_registered("Taxi-v4", "Taxi-v3"),
        rules="You drive a taxi (@) on a 5x5 grid. R, G, Y and B are the four stops; north is up. A '|' is a "
              "wall that blocks moving east or west; ':' does not. Drive to the passenger, pickup, drive to "
              "the destination and dropoff. Each step costs -1, delivering the passenger gives +20 and ends "
              "the game, and a pickup or dropoff at the wrong place costs -10.",
        actions={"south": 0, "north": 1, "east": 2, "west": 3, "pickup": 4, "dropoff": 5}, max_steps=40,
        render=_render_taxi,
        # the taxi at row 3, column 3 and the passenger at B (row 5, column 4): east, then south (the way on)
        example=(WorkedGame(seed=1, actions=("east", "south")),)),
    "cliffwalking": GymGame(
        gym_id=_registered("CliffWalking-v1", "CliffWalking-v0"),
        rules="You walk on a 4x12 grid from the start at the bottom left to the goal T at the bottom right. "
              "o is safe ground and @ marks where you are. C is the cliff: stepping into it costs -100 and "
              "sends you back to the start. Walking into the edge leaves you in place. Each step costs -1; "
              "the game ends when you reach T.",
        actions={"up": 0, "right": 1, "down": 2, "left": 3}, max_steps=30, render=_render_cliffwalking,
        success=lambda reward: True,  # it terminates only at the goal (the cliff sends you back to the start)
        example=(WorkedGame(seed=0, actions=("up", "right")),)),
    "blackjack": GymGame(
        gym_id="Blackjack-v1",
        rules="You play one hand of blackjack against the dealer. Number cards count their value, face cards "
              "10, and an ace 1 or 11 (a usable ace is one counted as 11 without going over 21). hit takes "
              "another card; going over 21 loses at once. stick ends your turn: the dealer then draws until "
              "reaching 17 or more, and whoever is closer to 21 wins. Win +1, draw 0, loss -1.",
        actions={"stick": 0, "hit": 1}, max_steps=10, render=_render_blackjack,
        ansi=False,  # Blackjack renders only to pixels
        # two hands, each action once where it is the right play: stick on 20 against a 9, hit on 10 against a 10.
        # SmolLM2 copies the last move shown whatever its hand: after one hand of hit-then-stick it chose hit
        # with probability 0.12-0.15 for every sum from 6 to 20, after these two 0.36-0.51.
        example=(WorkedGame(seed=41, actions=("stick",)), WorkedGame(seed=20, actions=("hit",)))),
}


def check_games(names: list[str]) -> None:
    """Refuse names that are not games: one line naming env.families (where a recipe lists them) and the choices."""
    unknown = [n for n in names if n not in GYM_GAMES]
    if unknown:
        raise ConfigError(f"config error: env.families: unknown gym game {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(sorted(GYM_GAMES))}")


def _game(name: str) -> GymGame:
    check_games([name])
    return GYM_GAMES[name]


def _start(game: GymGame, episode_seed: int, make_kwargs: dict[str, Any] | None = None) -> tuple[gym.Env, Any]:
    """A fresh gymnasium env reset with the episode seed, and its first observation."""
    kwargs = game.make_kwargs(episode_seed) if make_kwargs is None else make_kwargs
    env = gym.make(game.gym_id, render_mode="ansi" if game.ansi else None,
                   max_episode_steps=game.max_steps, **kwargs)
    obs, _ = env.reset(seed=episode_seed)
    return env, obs


def system_prompt(game: GymGame) -> str:
    example = next(iter(game.actions))
    return (f"{game.rules}\n\nEach turn, reply with exactly one action, in one of these forms:\nmove({example})\n"
            f'<tool_call>{{"name": "move", "arguments": {{"action": "{example}"}}}}</tool_call>\n'
            "or the bare action word on a line by itself. Only the first action in your reply is played.\n"
            f"Legal actions: {game.legal}.")


def _state_message(game: GymGame, env: gym.Env, obs: Any) -> str:
    return f"{game.render(env, obs)}\nLegal actions: {game.legal}."


def _after_move(game: GymGame, env: gym.Env, name: str, reward: float, obs: Any) -> str:
    return f"You played {name}; reward {reward:g}.\n{_state_message(game, env, obs)}"


def worked_example(game: GymGame) -> list[dict[str, str]]:
    """The game's worked examples as chat turns: a state, a move, the state it led to, a move... (module docstring)."""
    messages = []
    for ex in game.example:
        env, obs = _start(game, ex.seed, ex.make_kwargs)
        messages.append(_user(_state_message(game, env, obs)))
        for i, name in enumerate(ex.actions):
            messages.append({"role": "assistant", "content": f"move({name})"})
            if i + 1 < len(ex.actions):
                obs, reward, terminated, truncated, _ = env.step(game.actions[name])
                if terminated or truncated:
                    raise ValueError(f"the worked example of {game.gym_id} ends before its move {i + 2}")
                messages.append(_user(_after_move(game, env, name, float(reward), obs)))
        env.close()
    return messages


def _normalize(word: str) -> str:
    # Tolerate the wrappers models put around a word: quotes, backticks, bold, a full stop, `action=`.
    return word.strip().lower().removeprefix("action=").strip().strip("'\"`*.!").strip()


def parse_action(text: str, actions: Mapping[str, int]) -> tuple[str | None, str | None]:
    """(action word, None) for the first action in `text`, or (None, why not); see the module docstring."""
    text = _THINK.sub("", text)
    calls = parse_tool_calls(text, MOVE_TOOL)
    if calls:
        call = calls[0]
        if call.error:
            return None, call.error
        if call.name != "move":
            return None, f"unknown tool {call.name!r}; the only tool is move"
        if "action" not in call.arguments:
            return None, "move needs an 'action' argument"
        word = _normalize(str(call.arguments["action"]))
    else:
        word = next((w for w in map(_normalize, text.splitlines()) if w in actions), None)
        if word is None:
            return None, "no action found"
    if word not in actions:
        return None, f"{word!r} is not an action of this game"
    return word, None


def generate_gym_tasks(games: list[str], n: int, seed: int, split: str, exclude: set[int] | None = None) -> list[Task]:
    """`n` tasks cycling through `games`, reproducible from (seed, split); no episode seed in `exclude`."""
    check_games(games)
    rng = random.Random(f"{seed}:gym:{split}")
    used = set(exclude or ())
    tasks: list[Task] = []
    while len(tasks) < n:
        episode_seed = rng.randrange(2**31)
        if episode_seed in used:
            continue
        used.add(episode_seed)
        name = games[len(tasks) % len(games)]
        game = GYM_GAMES[name]
        env, obs = _start(game, episode_seed)
        prompt = _state_message(game, env, obs)
        env.close()
        tasks.append(Task(task_id=f"gym-{split}-{len(tasks):05d}", prompt=prompt, answer=SUCCESS, split=split,
                          family=name, data={"game": name, "episode_seed": episode_seed}))
    return tasks


def make_gym_splits(games: list[str], n_train: int, n_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
    """Fixed train and held-out splits with no episode seed in both.

    Disjoint seeds are not disjoint starts: frozenlake and cliffwalking always start the same way, and
    taxi (300 starts) and blackjack (a few hundred visible hands) repeat starts across many seeds.
    """
    heldout = generate_gym_tasks(games, n_heldout, seed, "heldout")
    train = generate_gym_tasks(games, n_train, seed, "train", exclude={t.data["episode_seed"] for t in heldout})
    return train, heldout


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


class GymTextEnv(Env):
    """One episode at a time; the gymnasium env lives from reset() to the next reset() or close()."""

    version = ENV_VERSION

    def __init__(self, *, max_invalid: int = 3, few_shot: str = "none"):
        self.max_invalid = max_invalid
        self.few_shot = few_shot  # "none" or "game": a worked example of the game before the task
        self._env: gym.Env | None = None
        self._game: GymGame | None = None
        self._return = 0.0
        self._invalid = 0  # consecutive invalid replies

    async def reset(self, task: Task) -> Observation:
        await self.close()
        self._game = _game(task.data["game"])
        self._env, obs = _start(self._game, int(task.data["episode_seed"]))
        self._return, self._invalid = 0.0, 0
        shots = worked_example(self._game) if self.few_shot == "game" else []
        return Observation(messages=[{"role": "system", "content": system_prompt(self._game)}, *shots,
                                     _user(_state_message(self._game, self._env, obs))])

    async def step(self, action: str) -> StepResult:
        if self._env is None or self._game is None:
            raise RuntimeError("step() before reset()")
        name, error = parse_action(action, self._game.actions)
        if name is None:
            return self._invalid_step(self._game, error or "")
        self._invalid = 0
        obs, reward, terminated, truncated, _ = self._env.step(self._game.actions[name])
        reward = float(reward)
        self._return += reward
        success = bool(terminated) and self._game.success(reward)
        info = self._info(name, invalid=False, success=success, truncated=bool(truncated))
        if terminated or truncated:
            info["final_answer"] = SUCCESS if success else FAILURE
            return StepResult(observation=[], reward=reward, done=True, info=info)
        text = _after_move(self._game, self._env, name, reward, obs)
        return StepResult(observation=[_user(text)], reward=reward, info=info)

    def _invalid_step(self, game: GymGame, error: str) -> StepResult:
        self._invalid += 1
        left = self.max_invalid - self._invalid
        info = self._info(None, invalid=True, success=False, truncated=False)
        if left <= 0:
            info.update(invalid_limit=True, final_answer=FAILURE)
            return StepResult(observation=[], done=True, info=info)
        text = (f"Invalid reply: {error}. Reply with exactly one action, e.g. move({next(iter(game.actions))}). "
                f"Legal actions: {game.legal}. ({left} more invalid {'reply' if left == 1 else 'replies'} "
                f"in a row will end the game.)")
        return StepResult(observation=[_user(text)], info=info)

    def _info(self, name: str | None, *, invalid: bool, success: bool, truncated: bool) -> dict[str, Any]:
        return {"action": name, "invalid": invalid, "return": self._return, "success": success,
                "truncated": truncated, "invalid_limit": False}

    async def close(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env = None


def gym_reward(traj: Trajectory, task: Task) -> dict[str, float]:
    """correct: 1.0 when the episode ended won, read from Trajectory.final_answer (the agent loop copies it from
    the last step's info); a trajectory cut off before the game ended has none and scores 0.

    The game's return is not part of the reward. It once was, weighted 0.01 to break ties, but GRPO divides by
    the group's std, so in a group where nothing was won the tie-breaker was the whole signal, and it ranked
    three invalid replies (no game step, return 0) above playing: a lost hand of Blackjack (-1), any move in Taxi
    or CliffWalking (-1 a step). SmolLM2 learned to forfeit blackjack within three steps.
    """
    if traj.status in (RolloutStatus.ENV_ERROR, RolloutStatus.TIMEOUT):
        return {"correct": 0.0}  # the env failed; nothing to credit (and not trained on)
    return {"correct": 1.0 if traj.final_answer == task.answer else 0.0}


# -- the environment, on the public API (env/api.py) --------------------------------------------------------------
class GymArgs(BaseModel):
    """env.args of env.name=gym."""

    model_config = ConfigDict(extra="forbid")
    # game: two moves of the same game, played on a real env, shown before the task (Blackjack: two one-move hands);
    # SmolLM2-135M replies with no valid move without them (see this module's doc)
    few_shot: Literal["none", "game"] = "none"


class GymEnvironment(Environment):
    """Gymnasium toy-text games as multi-turn text; in-process, no sandbox."""

    Args = GymArgs
    version = ENV_VERSION

    def __init__(self, args: GymArgs):
        self.args = args

    def check(self, setup: TaskSetup) -> None:
        check_games(setup.families or [])

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        return make_gym_splits(setup.families or list(GYM_GAMES), setup.n_train, setup.n_heldout, setup.seed)

    def episode(self, ctx: EpisodeContext) -> Env:
        return GymTextEnv(few_shot=self.args.few_shot)

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return gym_reward(traj, task)
