"""The public environment API: the one way to add an environment to loomrl (docs/environments.md).

An environment is an `Environment`: made once per rollout process from its factory and its own config section
(`env.args`), it says where its tasks come from, makes one `Env` per episode (reset/step, loomrl/env/base.py), and
gives the default reward and the success test of its episodes. The built-in ones (calculator, codefix, gym, chat,
reasoning_gym) are written on it like any other: nothing in the run knows their names.

`env.name` picks the factory:
- a built-in name (BUILTIN below: each is a "module:Factory" string, loaded like a user's);
- an installed plugin: a `loomrl.envs` entry point of that name (a package's
  `[project.entry-points."loomrl.envs"] my_env = "my_pkg.envs:MyEnv"`);
- `package.module:Factory`, found with the current directory and PYTHONPATH on sys.path;
- `<adapter>:<id>` for environments of another library (ADAPTERS: `verifiers:<environment id>`, `openenv:<server>`): the adapter's
  factory gets the id as `env.args.env_id`.

A factory is an Environment subclass or a function returning an Environment. Its config model is the class's
`Args` attribute, or the type of the function's one parameter, a pydantic model: `env.args` is validated by it, and a
wrong field stops the run at load with one line naming `env.args.<field>`. A factory without one takes no args.
"""

from __future__ import annotations

import inspect
import random
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from loomrl.config import ConfigError, EnvConfig
from loomrl.env.base import Env
from loomrl.plugins import import_object
from loomrl.types import Task, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from loomrl.env.browser.pool import BrowserTab
    from loomrl.env.pool import LeasePool, Leases

ENTRY_POINT_GROUP = "loomrl.envs"
BUILTIN = {
    "calculator": "loomrl.env.tasks.calculator:CalculatorEnvironment",
    "codefix": "loomrl.env.tasks.codefix:CodefixEnvironment",
    "gym": "loomrl.env.tasks.gym_text:GymEnvironment",
    "chat": "loomrl.env.tasks.chat:ChatEnvironment",
    "reasoning_gym": "loomrl.env.tasks.reasoning_gym:ReasoningGymEnvironment",
    "web": "loomrl.env.tasks.web.environment:WebEnvironment",
    "miniwob": "loomrl.env.tasks.miniwob.environment:MiniWoBEnvironment",
}
ADAPTERS = {
    "verifiers": "loomrl.env.adapters.verifiers:VerifiersEnvironment",
    "openenv": "loomrl.env.adapters.openenv:OpenEnvEnvironment",
}
# "call": an episode leases a pool sandbox for each tool call; "episode": for the whole episode; None: no sandbox
SandboxUse = Literal["call", "episode"] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSetup:
    """What the run tells an environment about the tasks it wants (the env section's generic fields)."""

    families: list[str] | None  # env.families: which of its task families (None: its default)
    n_train: int
    n_heldout: int  # per held-out split
    seed: int
    heldout_template_share: float  # generated families: the share of templates held out (registry.template_splits)
    sandbox: str  # env.sandbox and env.sandbox_limits, for environments that check their tasks in sandboxes
    sandbox_limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, e: EnvConfig) -> TaskSetup:
        return cls(families=e.families, n_train=e.n_train, n_heldout=e.n_heldout, seed=e.seed,
                   heldout_template_share=e.heldout_template_share, sandbox=e.sandbox,
                   sandbox_limits=dict(e.sandbox_limits))


@dataclass(slots=True, kw_only=True)
class EpisodeContext:
    """What one episode gets from the run."""

    pool: Leases | None  # the sandbox pool (Environment.sandbox set), else None
    rng: random.Random  # seeded from the run: fault injection, sampling inside the env
    tool_timeout_s: float  # env.tool_timeout_s: the bound of one tool call
    browsers: LeasePool[BrowserTab] | None = None  # the browser pool (Environment.browser set), else None
    action_timeout_s: float = 10.0  # env.browser.action_timeout_s: the bound of one browser action


class Environment:
    """Subclass it (or return one from a factory function). Only `episode` must be written."""

    Args: type[BaseModel] | None = None  # the model env.args is validated by (None: the factory takes no args)
    version: str = "1"  # recorded on every trajectory (metadata.env_version)
    sandbox: SandboxUse = None
    browser: bool = False  # its episodes lease a browser tab (env.browser: the pool; docs/web.md)

    async def start(self, setup: TaskSetup) -> None:
        """The explicit start-up step, run once per process before `tasks` (env/registry.py prepared_tasks: by the
        rollout side as it starts): what preparing the tasks needs sandboxes or the network for (codefix validates its
        tasks here). Keep the result on the environment, cached where it is costly; `tasks` then only reads."""

    def use_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """The tokenizer (and chat template) this process renders the environment's episodes with: told once by the
        rollout side when it has loaded the model, before the first episode. By default nothing; an environment whose
        prompts depend on what the template renders reads it here (verifiers' adapter: tool schemas)."""

    def tasks(self, setup: TaskSetup) -> tuple[Sequence[Task], Sequence[Task]] | None:
        """(train, held-out) tasks, or None when the environment brings none: the recipe's `data:` section then
        supplies them (a recipe with neither stops at load). Held-out tasks carry their split name in Task.split."""
        return None

    def episode(self, ctx: EpisodeContext) -> Env:
        """A fresh Env for one episode."""
        raise NotImplementedError(f"{type(self).__name__}.episode: an environment must make its episodes")

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        """The default reward (reward.function(s) replace it): named components, their sum the total. By default
        1 for a final answer equal to the task's answer."""
        return {"correct": 1.0 if self.success(traj, task) else 0.0}

    def success(self, traj: Trajectory, task: Task) -> bool:
        """Whether a scored episode solved its task (held-out success counts these)."""
        return traj.final_answer is not None and traj.final_answer == task.answer

    def answer_of(self, text: str) -> str | None:
        """A black-box agent's final answer from its printed output or last message. An environment that leaves
        this as it is takes no black-box agents (load_config refuses them)."""
        raise NotImplementedError

    @property
    def takes_blackbox(self) -> bool:
        return type(self).answer_of is not Environment.answer_of

    @property
    def brings_tasks(self) -> bool:
        """Whether `tasks` is written (it may still return None: then the run needs a data: section)."""
        return type(self).tasks is not Environment.tasks

    def check(self, setup: TaskSetup) -> None:
        """Refuse, with a ConfigError of one line, what the config cannot check alone (e.g. the names env.families
        lists). Run at load, before any model loads."""


def opening_messages(task: Task, system: str | None = None, few_shot: Sequence[dict[str, Any]] = ()) -> list[dict]:
    """An episode's opening messages: the environment's system prompt and worked examples, then the task. A task
    that brings its own messages (a dataset's, Task.messages) keeps them; its own system prompt wins over `system`."""
    own = list(task.messages) if task.messages else [{"role": "user", "content": task.prompt}]
    if own and own[0].get("role") == "system":
        return [own[0], *few_shot, *own[1:]]
    head = [{"role": "system", "content": system}] if system else []
    return [*head, *few_shot, *own]


# -- loading ---------------------------------------------------------------------------------------------------------
def _args_model(factory: Callable[..., Any]) -> tuple[type[BaseModel] | None, bool]:
    """(the pydantic model of the factory's args, whether it takes an argument at all)."""
    if isinstance(factory, type) and issubclass(factory, Environment):
        return factory.Args, factory.Args is not None
    params = list(inspect.signature(factory).parameters.values())
    if not params:
        return None, False
    hint = typing.get_type_hints(factory).get(params[0].name)
    return (hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None), True


def _validated(model: type[BaseModel], args: dict[str, Any], name: str) -> BaseModel:
    unknown = [k for k in args if k not in model.model_fields]
    if unknown:  # refused whatever the model's own `extra` says: a misspelt field must not pass silently
        raise ConfigError(f"config error: unknown field 'env.args.{unknown[0]}' for env.name={name}; known fields: "
                          f"{', '.join(model.model_fields) or 'none'}")
    try:
        return model.model_validate(args)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise ConfigError(f"config error: 'env.args.{where}': {e['msg']} (got {e.get('input')!r}) for "
                          f"env.name={name}") from None


def make_environment(factory: Callable[..., Any], args: dict[str, Any], name: str) -> Environment:
    """Call `factory` with `args` validated by its own model (see the module's doc)."""
    model, takes = _args_model(factory)
    if model is not None:
        env = factory(_validated(model, args, name))
    elif takes:
        env = factory(dict(args))
    elif args:
        raise ConfigError(f"config error: env.args: env.name={name} takes no arguments (got {', '.join(args)}); "
                          "remove env.args")
    else:
        env = factory()
    if not isinstance(env, Environment):
        raise ConfigError(f"config error: env.name={name}: the factory returned a {type(env).__name__}, not a "
                          "loomrl.env.Environment")
    return env


def resolve_factory(name: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The factory env.name names, and args it adds (an adapter's env_id)."""
    if name in BUILTIN:
        return import_object(BUILTIN[name], "env.name", "env.name=my_env:MyEnvironment"), {}
    prefix, sep, rest = name.partition(":")
    if sep and prefix in ADAPTERS:
        if not rest:
            raise ConfigError(f"config error: env.name={name}: give the {prefix} environment's id, e.g. "
                              f"env.name={prefix}:my-environment")
        return import_object(ADAPTERS[prefix], "env.name", ""), {"env_id": rest}
    plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name in plugins:
        try:
            return plugins[name].load(), {}
        except Exception as err:  # noqa: BLE001 - the plugin's own import failed
            raise ConfigError(f"config error: env.name={name}: loading the entry point {plugins[name].value!r} "
                              f"raised {type(err).__name__}: {err}") from None
    if not sep:
        known = sorted({*BUILTIN, *plugins})
        raise ConfigError(f"config error: env.name: unknown environment {name!r}; choose a built-in or installed one "
                          f"({', '.join(known)}), {'/'.join(f'{a}:<id>' for a in ADAPTERS)}, or "
                          "package.module:Factory for your own (docs/environments.md)")
    return import_object(name, "env.name", "env.name=my_env:MyEnvironment for a file my_env.py there", "Factory"), {}


_made: dict[str, Environment] = {}


def environment_for(env: EnvConfig) -> Environment:
    """The run's environment, made once per process for a given env section."""
    key = env.model_dump_json()
    if key not in _made:
        factory, extra = resolve_factory(env.name)
        _made[key] = make_environment(factory, {**env.args, **extra}, env.name)
    return _made[key]
