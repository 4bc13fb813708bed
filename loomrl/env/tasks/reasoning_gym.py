"""reasoning_gym: generated reasoning tasks from reasoning-gym (PyPI), scored by its own verifiers; nothing to download.

`env.args.tasks` names any of its task families (its dataset names: basic_arithmetic, chain_sum, ...; the registry is
`reasoning_gym.factory.DATASETS`), `env.args.config` gives one's generator its own settings (its config dataclass's
fields: `{basic_arithmetic: {max_terms: 4}}`). Single turn, as the `chat` environment: the system prompt (by default
reasoning-gym's own, `SYSTEM_PROMPTS["default"]`, which asks for `<answer>...</answer>`), the question, one reply.

Tasks are made on demand (a Sequence: task i generated when asked for), round robin over the families. Each family
generates from one seed (from env.seed and its name): the held-out tasks are its items 0.., the training tasks the
items after them, so the two never share an item's seed (reasoning-gym seeds item i with seed + i). Two different
items may still ask the same question where a family's space is small (basic_arithmetic with one-digit numbers).

Reward: reasoning-gym's `score_answer(answer, entry)` as the component `score` (in [0, 1]; some families give part
marks), the answer read from the reply by `env.args.answer_format` (default `answer_tag`: the last <answer>...</answer>;
chat.py lists the others); success: a score of 1.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Sequence
from importlib.metadata import version as dist_version
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.base import Env
from loomrl.env.tasks.chat import AnswerFormat, ChatArgs, ChatEnv
from loomrl.types import Task, Trajectory

_MANAGED = ("seed", "size")  # generator fields loomrl sets: the seed from env.seed, the size from the split sizes


class ReasoningGymArgs(BaseModel):
    """env.args of env.name=reasoning_gym."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[str] = Field(min_length=1)  # reasoning-gym dataset names
    config: dict[str, dict[str, Any]] = {}  # per dataset: its generator's settings
    answer_format: AnswerFormat = "answer_tag"
    system_prompt: str | None = None  # None: reasoning-gym's default; a key of its SYSTEM_PROMPTS picks that one


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise ConfigError(f"config error: env.name=reasoning_gym: reasoning-gym is not installed ({err}); pip install "
                          "'loomrl[reasoning]'") from None
    return DATASETS


class GeneratedTasks(Sequence[Task]):
    """One split's tasks, each generated when asked for. Pickles as its settings (some generators hold lambdas)."""

    def __init__(self, families: list[tuple[str, dict[str, Any], int]], split: str, n: int, offset: int, size: int):
        self.families = families  # (name, generator settings, seed)
        self.split, self.n, self.offset, self.size = split, n, offset, size
        self._datasets: list[Any] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        k = i % len(self.families)
        entry = self._generators()[k][self.offset + i // len(self.families)]
        answer = entry.get("answer")
        return Task(task_id=f"rg-{self.split}-{i}", prompt=str(entry["question"]),
                    answer="" if answer is None else str(answer), split=self.split, family=self.families[k][0],
                    data={"entry": {"question": entry["question"], "answer": answer,
                                    "metadata": entry.get("metadata", {})}})

    def _generators(self) -> list[Any]:
        if self._datasets is None:
            from reasoning_gym import create_dataset

            self._datasets = [create_dataset(name, **settings, seed=seed, size=self.size)
                              for name, settings, seed in self.families]
        return self._datasets

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_datasets": None}


class ReasoningGymEnvironment(Environment):
    """Single-turn reasoning tasks from reasoning-gym's generators, scored by its verifiers."""

    Args = ReasoningGymArgs

    def __init__(self, args: ReasoningGymArgs):
        registry = _registry()
        for name in args.tasks:
            if name not in registry:
                close = difflib.get_close_matches(name, list(registry), n=3)
                hint = f"did you mean {', '.join(close)}? " if close else ""
                raise ConfigError(f"config error: env.args.tasks: no reasoning-gym dataset {name!r}; {hint}"
                                  f"{len(registry)} are registered (reasoning_gym.factory.DATASETS)")
        for name, settings in args.config.items():
            if name not in args.tasks:
                raise ConfigError(f"config error: env.args.config.{name}: not one of env.args.tasks "
                                  f"({', '.join(args.tasks)})")
            if managed := [f for f in _MANAGED if f in settings]:
                raise ConfigError(f"config error: env.args.config.{name}.{managed[0]}: set by loomrl (the seed from "
                                  "env.seed, the size from env.n_train and env.n_heldout); remove it")
        self.args = args
        self._scorers = {name: self._generator(name, seed=0, size=1).score_answer for name in args.tasks}
        from reasoning_gym.utils import SYSTEM_PROMPTS

        prompt = args.system_prompt if args.system_prompt is not None else "default"
        self.system_prompt = SYSTEM_PROMPTS.get(prompt, prompt)
        self.version = f"reasoning-gym-{dist_version('reasoning-gym')}"

    def _generator(self, name: str, **managed: int) -> Any:
        from reasoning_gym import create_dataset

        try:
            return create_dataset(name, **self.args.config.get(name, {}), **managed)
        except (TypeError, ValueError, AssertionError) as err:  # a wrong field, or the generator's own checks
            raise ConfigError(f"config error: env.args.config.{name}: {err or type(err).__name__}") from None

    def check(self, setup: TaskSetup) -> None:
        if setup.families:
            raise ConfigError("config error: env.families: env.name=reasoning_gym picks its families with "
                              "env.args.tasks")

    def tasks(self, setup: TaskSetup) -> tuple[GeneratedTasks, GeneratedTasks]:
        k = len(self.args.tasks)
        held, train = -(-setup.n_heldout // k), -(-setup.n_train // k)  # items per family, rounded up
        families = [(name, self.args.config.get(name, {}),
                     random.Random(f"{setup.seed}:reasoning_gym:{name}").randrange(2**31)) for name in self.args.tasks]
        return (GeneratedTasks(families, "train", setup.n_train, offset=held, size=held + train),
                GeneratedTasks(families, "heldout", setup.n_heldout, offset=0, size=held + train))

    def episode(self, ctx: EpisodeContext) -> Env:
        return ChatEnv(ChatArgs(answer_format=self.args.answer_format, system_prompt=self.system_prompt))

    def score(self, traj: Trajectory, task: Task) -> float:
        """reasoning-gym's own score of the episode's final answer."""
        return float(self._scorers[task.family](traj.final_answer, task.data["entry"]))

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return {"score": self.score(traj, task)}

    def success(self, traj: Trajectory, task: Task) -> bool:
        return self.score(traj, task) == 1.0
