"""`env.name: verifiers:<environment id>`: an installed verifiers (0.4.0, v1 API) environment, trained on with the
exact tokens loomrl's engine sampled.

A verifiers environment is a taskset package: `verifiers:vf-wordcount` imports the module `vf_wordcount` (the id with
dashes as underscores, as verifiers' own loader does), whose `__all__` exports a `vf.Taskset` (its data, its Task with
@vf.reward / @vf.stop hooks and vf.Toolset tools) and optionally a `vf.Env` (the protocol: `Env.run(task, agents)`;
else verifiers' single-agent env). It must be installed (`pip install -e path/to/env`), or its folder listed in
`env.args.paths`. `env.args.env_args` is verifiers' own `[env]` table for it (its `taskset` fields, its agent's
`max_turns`, ...), validated by the environment's config classes.

Why loomrl drives the episode (white box) and does not point verifiers at loomrl's gateway (black box). verifiers
owns its rollout: a harness program (a `uv run` script, or codex, claude-code...) runs in a runtime (a subprocess of
the host, docker, a Prime sandbox) and calls the model through verifiers' interception server, which records the
trace; prime-rl trains on it by giving verifiers a client that renders token ids for vLLM and bridges each turn's
prompt onto the last. Pointing that client at agent/gateway.py would work the same way, and pay for it: per episode a
harness process (whose packages `uv` installs), an MCP server process per toolset and an interception server, and
token fidelity that holds only while the harness re-sends history that extends what it was given. But the rollout
logic of a verifiers environment that needs no box is in Python objects loomrl can call: the Env's run(), the
taskset's data, the Task's @vf.stop and @vf.reward hooks, the Toolsets' @vf.tool methods. So the episode runs in
loomrl's agent loop (verifiers_episode.py): the loop samples and keeps its tokens exactly, the environment's run()
supplies the opening messages and the env responses and decides when the episode is done, its tools run in process
(verifiers_tools.py), and its rubric scores the recorded trace on the reward pool (`reward`, below). The price: what
only a harness program or a box provides is refused at load, in one line naming it.

Supported: tasksets (finite or infinite; `env.args.env_args.taskset` configures them), single- and multi-turn
protocols (a vf.Env subclass's run() with one agent role: interactions, scripted user turns), task and taskset
Toolsets run in process with the rollout's vf.State, @vf.stop on Trace / Request / Response, the role's
`max_turns`, @vf.reward and @vf.metric hooks that read the task and the trace (and config-plugged ones), rewards an
Env.run() records on the trace. A reward component per verifiers reward (its score times its weight). Tools reach
the model as schemas through the chat template; a template that renders none (SmolLM2's) gets them in words in the
system prompt instead, with one warning at load (`use_tokenizer`).

Refused at load: harnesses other than `null` (bash, codex, claude-code, ...: loomrl plays the null harness: chat plus
the task's tools) and tasksets that ship their own; tasks that need a container (NEEDS_CONTAINER, an image) or hooks
that run in the rollout's runtime (Task.setup/finalize, rewards or metrics with a `runtime` parameter); LLM judges
(taskset.task.judges: an external model API); @vf.intercept hooks; tool servers that are remote (`url`), in another
runtime (docker, prime, ...) or not a vf.Toolset; multi-agent environments and Env.finalize/start/stop; an agent pinned
to its own model, client or sampling, or token limits (use loomrl's sampling and agent.max_context_tokens);
multimodal prompts. Not visible at load, so ending the episode env_error: a run() that runs a second agent or uses
steering or runtimes. Metrics are computed but not kept (loomrl's reward is the rewards' sum).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import logging
import os
import random
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.tools import callable_name
from loomrl.errors import folded
from loomrl.types import Task, Trajectory

if TYPE_CHECKING:
    import verifiers.v1 as vf
    from transformers import PreTrainedTokenizerBase

    from loomrl.env.adapters.verifiers_episode import Protocol, VerifiersEpisode

log = logging.getLogger(__name__)
TESTED = "0.4.0"  # the verifiers release this adapter is written against (pyproject's `verifiers` extra pins it)


class VerifiersArgs(BaseModel):
    """env.args of env.name=verifiers:<id>."""

    model_config = ConfigDict(extra="forbid")
    env_id: str  # from env.name
    env_args: dict[str, Any] = {}  # verifiers' [env] table: taskset fields under `taskset`, the agent's under `agent`
    heldout_args: dict[str, Any] | None = None  # taskset fields for the held-out tasks (e.g. {split: test}), over
    # env_args.taskset; None: the held-out tasks are drawn from the training taskset, disjoint from the training ones
    paths: list[str] = []  # folders put first on sys.path before the environment is imported (one not installed)
    success_threshold: float = 1.0  # an episode succeeds when its reward (the weighted sum of the rubric) reaches this
    reward_timeout_s: float = Field(60.0, gt=0)  # bound of one rubric run (the task's own scoring timeout wins)


class VerifiersEnvironment(Environment):
    """An installed verifiers environment (see the module's doc)."""

    Args = VerifiersArgs

    def __init__(self, args: VerifiersArgs):
        self.args = args
        self.name = f"verifiers:{args.env_id}"
        for folder in reversed(args.paths):
            path = os.path.abspath(folder)
            if path not in sys.path:
                sys.path.insert(0, path)
        vf = _verifiers(self.name)
        config = self._config(vf)
        self.protocol = self._protocol(vf, config)
        self.version = self.protocol.version

    # -- load: what verifiers makes of the id and the args, and what loomrl refuses ------------------------------
    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(f"config error: env.name={self.name}: not supported by loomrl: {what} (docs/"
                           "environments.md, 'verifiers environments')")

    def _config(self, vf: Any) -> vf.EnvConfig:
        own = dict(self.args.env_args.get("taskset") or {})
        if "id" in own:
            raise ConfigError(f"config error: env.args.env_args.taskset.id: the environment's id is env.name's "
                              f"(env.name={self.name}); remove it")
        return self._loaded(lambda: vf.resolve_env_config({**self.args.env_args,
                                                           "taskset": {**own, "id": self.args.env_id}}), "env_args")

    def _loaded(self, make, field: str):
        """make(), its failures as one line: the environment missing, its args wrong, its own code failing."""
        module = self.args.env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
        try:
            return make()
        except ModuleNotFoundError as err:
            missing = err.__cause__ if isinstance(err.__cause__, ModuleNotFoundError) else err  # verifiers re-raises
            if missing.name == module:
                raise ConfigError(f"config error: env.name={self.name}: no verifiers environment "
                                  f"{self.args.env_id!r} is installed (no module {module!r}); pip install its package, "
                                  "or list its folder in env.args.paths") from None
            raise ConfigError(f"config error: env.name={self.name}: importing the environment failed: {err}") from None
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join(str(p) for p in e["loc"])
            raise ConfigError(f"config error: env.args.{field}.{where}: {e['msg']} (got {e.get('input')!r}) for "
                              f"env.name={self.name}") from None
        except Exception as err:  # noqa: BLE001 - the environment's own code: one line, whatever it raised
            raise ConfigError(f"config error: env.name={self.name}: loading the verifiers environment raised "
                              f"{type(err).__name__}: {folded(str(err))}") from None

    def _protocol(self, vf: Any, config: vf.EnvConfig) -> Protocol:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import default_harness_id, environment_class

        from loomrl.env.adapters import verifiers_tools
        from loomrl.env.adapters.verifiers_episode import Protocol

        env_cls = environment_class(config.taskset.id, config.id)
        roles = agent_config_fields(config)
        if len(roles) != 1:
            raise self._refuse(f"a multi-agent environment ({env_cls.__name__} plays roles {', '.join(roles)})")
        for hook, what in (("finalize", "cross-agent judgement"), ("start", "env-level resources"),
                           ("stop", "env-level resources")):
            if getattr(env_cls, hook) is not getattr(vf.Env, hook):
                raise self._refuse(f"{env_cls.__name__}.{hook} ({what})")
        seat, agent = next(iter(roles.items()))
        harness = agent.harness.id if agent.harness is not None else None
        if harness not in (None, "null"):
            raise self._refuse(f"harness {harness!r} (loomrl plays verifiers' null harness: chat and the task's tools)")
        if default_harness_id(config.taskset.id) == config.taskset.id:
            raise self._refuse(f"the taskset's own harness ({config.taskset.id!r} ships one)")
        pinned = [f for f in ("model", "client", "sampling", "max_input_tokens", "max_output_tokens",
                              "max_total_tokens") if getattr(agent, f) is not None]
        if pinned:
            raise self._refuse(f"{seat}.{pinned[0]} (loomrl's policy plays the seat, with loomrl's sampling section "
                               "and agent.max_context_tokens)")
        env = self._loaded(lambda: env_cls(config), "env_args")
        taskset = env.taskset
        for server in type(taskset).toolsets(taskset.config):
            if why := verifiers_tools.refusal(server):
                raise self._refuse(why)
        first = next(iter(self._loaded(lambda: list(itertools.islice(taskset, 1)), "env_args")), None)
        if first is None:
            raise ConfigError(f"config error: env.name={self.name}: the taskset has no tasks")
        self._check_task(vf, first)
        try:
            tools = verifiers_tools.bind([*type(first).toolsets(first.config), *type(taskset).toolsets(taskset.config)])
        except ValueError as err:
            raise ConfigError(f"config error: env.name={self.name}: {err}") from None
        module = config.taskset.id.replace("-", "_").lower()
        try:
            own = dist_version(config.taskset.id)
        except PackageNotFoundError:
            own = "local"
        return Protocol(env=env, seat=seat, agent=agent, shared=verifiers_tools.SharedTools(
            type(taskset).toolsets(taskset.config)), version=f"verifiers-{TESTED}:{module}-{own}", has_tools=bool(tools))

    def _check_task(self, vf: Any, task: vf.Task) -> None:
        """What the first task shows of the taskset's Task class and config (every task shares them)."""
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.utils.decorators import discover_decorated

        from loomrl.env.adapters import verifiers_tools

        kind = type(task)
        if kind.NEEDS_CONTAINER:
            raise self._refuse(f"a task that needs a container ({kind.__name__}.NEEDS_CONTAINER)")
        for hook in ("setup", "finalize", "stage_verifier"):
            if getattr(kind, hook) is not getattr(vf.Task, hook):
                raise self._refuse(f"{kind.__name__}.{hook} (it runs in the rollout's runtime box)")
        if discover_decorated(task, "intercept"):
            raise self._refuse("@vf.intercept hooks (request and response rewriting)")
        if task.config.judges:
            raise self._refuse("LLM judges (taskset.task.judges call an external model API)")
        for attr in ("reward", "metric"):
            for fn in task.hooks(attr):
                param = inspect.signature(fn).parameters.get("runtime")
                if param is not None and param.default is inspect.Parameter.empty:
                    raise self._refuse(f"{attr} {callable_name(fn)!r} (it reads the rollout's runtime box)")
        for fn in task.hooks("stop"):
            try:
                hook_boundary(fn, allow_trace=True)
            except TypeError as err:
                raise ConfigError(f"config error: env.name={self.name}: @vf.stop {err}") from None
        for server in kind.toolsets(task.config):
            if why := verifiers_tools.refusal(server):
                raise self._refuse(why)
        self._check_data(task.data)

    def _check_data(self, data: vf.TaskData) -> None:
        if data.image is not None:
            raise self._refuse(f"task {data.idx}'s container image {data.image!r}")
        if not isinstance(data.prompt, str | None) and any(
                isinstance(m.content, list) and any(p.type != "text" for p in m.content) for m in data.prompt):
            raise self._refuse(f"task {data.idx}'s multimodal prompt (images)")

    def check(self, setup: TaskSetup) -> None:
        if setup.families:
            raise ConfigError(f"config error: env.families: env.name={self.name} has no task families; choose its "
                              "tasks with env.args.env_args.taskset (and env.args.heldout_args)")

    def use_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Told by the rollout side which tokenizer renders the episodes: verifiers gives tools to the model only as
        schemas, so when this chat template renders none (SmolLM2's) the opening system prompt describes them in
        words, as ToolEnv's does, and the load says so once."""
        from loomrl.model.chat import renders_tools

        describe = self.protocol.has_tools and not renders_tools(tokenizer)
        if describe and not self.protocol.describe_tools:
            log.warning("env.name=%s: the chat template of %s renders no tool schemas: the tools are described in the "
                        "system prompt instead", self.name, tokenizer.name_or_path)
        self.protocol.describe_tools = describe

    # -- tasks -------------------------------------------------------------------------------------------------------
    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        """Held-out tasks first from the training taskset in a seeded order (or from env.args.heldout_args' own),
        then the training tasks after them: disjoint, and the same for a seed. An infinite taskset keeps its order."""
        import verifiers.v1 as vf

        taskset = self.protocol.env.taskset
        heldout_args = self.args.heldout_args
        if heldout_args is None:
            drawn = self._draw(taskset, setup.n_heldout + setup.n_train, setup.seed)
            heldout, train = drawn[: setup.n_heldout], drawn[setup.n_heldout :]
        else:
            config = taskset.config.model_dump()
            own = self._loaded(lambda: type(taskset.config).model_validate({**config, **heldout_args}),
                               "heldout_args")
            heldout = self._draw(self._loaded(lambda: vf.load_taskset(own), "heldout_args"), setup.n_heldout,
                                 setup.seed)
            train = self._draw(taskset, setup.n_train, setup.seed)
        if not train:
            raise ConfigError(f"config error: env.n_heldout: env.name={self.name}'s taskset has only {len(heldout)} "
                              "tasks, all held out; lower env.n_heldout or give env.args.heldout_args")
        return [self._task(t, "train") for t in train], [self._task(t, "heldout") for t in heldout]

    def _draw(self, taskset: vf.Taskset, n: int, seed: int) -> list[vf.Task]:
        if not taskset.bounded:
            return self._loaded(lambda: list(itertools.islice(taskset, n)), "env_args")
        tasks = self._loaded(lambda: list(taskset), "env_args")
        random.Random(f"{seed}:verifiers").shuffle(tasks)
        return tasks[:n]

    def _task(self, task: vf.Task, split: str) -> Task:
        data = task.data
        self._check_data(data)
        wire = data.model_dump(mode="json")
        answer = wire.get("answer")
        return Task(task_id=f"{self.args.env_id}/{split}/{data.idx}", prompt=data.prompt_text,
                    answer="" if answer is None else str(answer), split=split, family=self.args.env_id,
                    data={"vf": wire})

    # -- episodes and their reward -------------------------------------------------------------------------------------
    def episode(self, ctx: EpisodeContext) -> VerifiersEpisode:
        from loomrl.env.adapters.verifiers_episode import VerifiersEpisode

        return VerifiersEpisode(self.protocol, ctx)

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        """The rubric on the episode's recorded trace: each verifiers reward's score times its weight. Run on the
        reward pool's thread, in a loop of its own, bounded by the task's scoring timeout or env.args'."""
        import verifiers.v1 as vf
        from verifiers.v1.state import state_cls

        record = traj.env_record
        if record is None:
            raise ValueError("the episode left no verifiers trace (no step ran)")
        data = record["trace"]["task"]
        task_ = self.protocol.task(data["data"], data["type"])
        # pydantic's generic model parametrized at run time by the task's own types (verifiers' cli/replay.py does
        # the same): ty reads any subscript of a generic class as a type expression, where calls are not allowed
        data_t, state_t = type(task_.data), state_cls(type(task_))
        trace = vf.Trace[data_t, state_t, vf.AgentConfig].model_validate(  # ty: ignore[invalid-type-form]
            record["trace"])
        trace.state = state_cls(type(task_)).model_validate(record["state"])
        if trace.stop_condition is None:
            trace.stop("max_turns")  # loomrl cut it short (agent.max_turns or max_context_tokens)
        _calls_from(traj, trace)
        timeout = task_.data.timeout.scoring or self.protocol.agent.timeout.scoring or self.args.reward_timeout_s
        asyncio.run(asyncio.wait_for(task_.score(trace), timeout))
        unscored = [name for name, r in trace.rewards.items() if r is None]
        if unscored:
            raise ValueError(f"verifiers rewards {', '.join(unscored)} did not run")
        return {name: r.value for name, r in trace.rewards.items() if r is not None}

    def success(self, traj: Trajectory, task: Task) -> bool:
        return traj.scored and bool(traj.reward_components) and traj.total_reward >= self.args.success_threshold


def _calls_from(traj: Trajectory, trace: vf.Trace) -> None:
    """The trace's model calls (finish reasons, token counts: `is_truncated`, `num_*_tokens` read them) from the
    trajectory's turns, one per recorded reply."""
    import verifiers.v1 as vf

    replies = [i for i, node in enumerate(trace.nodes) if node.sampled]
    turns = [(t, t.act_span) for t in traj.all_turns() if t.act_span is not None
             and not any(e.get("action") == "summary_written" for e in t.context_events)]
    if trace.calls or len(replies) != len(turns):
        return
    calls = []
    for i, (t, span) in zip(replies, turns):
        message = trace.nodes[i].message  # a sampled node's: the assistant's reply
        calls.append(vf.ModelCall(node=i, finish_reason="tool_calls" if isinstance(message, vf.AssistantMessage)
                                  and message.tool_calls else "length" if t.finish_reason == "length" else "stop",
                                  usage=vf.Usage(prompt_tokens=span.start, completion_tokens=span.end - span.start)))
    trace.calls = calls


def _verifiers(name: str) -> Any:
    """verifiers.v1, or a ConfigError saying how to install the release this adapter is written for."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError(f"config error: env.name={name}: verifiers is not installed ({err}); pip install "
                          f"'loomrl[verifiers]' (verifiers=={TESTED})") from None
    if verifiers.__version__ != TESTED:
        raise ConfigError(f"config error: env.name={name}: verifiers {verifiers.__version__} is installed; this "
                          f"adapter is written for {TESTED} (pip install 'loomrl[verifiers]')")
    importlib.import_module("loomrl.env.adapters.verifiers_episode")  # its imports fail here, at load, if at all
    return vf
