"""What the run asks of its environment, written once for every environment (the public API: env/api.py): its task
splits (the environment's own, or the recipe's `data:` section), the config checks only it can make, the size of the
sandbox pool it needs.

Generated families (tasks drawn from templates) split by template as well as by numbers with
`template_splits`, written once here for every such family: held-out templates never appear in training.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Sequence

from loomrl.config import ConfigError, DataConfig, EnvConfig
from loomrl.env.api import TaskSetup, environment_for
from loomrl.env.pool import pool_size_for
from loomrl.types import Task


# -- the split by template, for every generated family -----------------------------------------------------
def split_templates(templates: dict[str, list[str]], share: float, seed: int) -> tuple[dict[str, list[str]],
                                                                                       dict[str, list[str]]]:
    """(train, held-out) template ids per kind: `int(share * count)` of each kind's templates held out, chosen
    from the seed. Each kind draws on its own, so a kind's split does not depend on which others are listed;
    a kind always keeps at least one training template (share < 1)."""
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"config error: env.heldout_template_share: {share} is not in [0, 1)")
    train, held = {}, {}
    for kind, ids in templates.items():
        order = sorted(ids)
        random.Random(f"{seed}:templates:{kind}").shuffle(order)
        k = int(share * len(order))
        held[kind], train[kind] = sorted(order[:k]), sorted(order[k:])
    return train, held


def template_splits(generate: Callable[[str, int, dict[str, list[str]], set[str]], list[Task]],
                    templates: dict[str, list[str]], n_train: int, n_heldout: int, seed: int,
                    share: float) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks of a generated family. `generate(split, n, templates, exclude)` makes `n` tasks
    of `split` from only those template ids, with no prompt in `exclude`. The held-out list holds
    `heldout` (training templates, prompts training never sees) and, when `share` holds any template
    out, `heldout_templates` (only the held-out templates: training never sees their phrasing)."""
    train_t, held_t = split_templates(templates, share, seed)
    heldout = generate("heldout", n_heldout, train_t, set())
    new = generate("heldout_templates", n_heldout, held_t, set()) if any(held_t.values()) else []
    train = generate("train", n_train, train_t, {t.prompt for t in heldout})
    return train, heldout + new


def prepared_tasks(env: EnvConfig, data: DataConfig | None) -> tuple[Sequence[Task], Sequence[Task]]:
    """The environment's start-up step (Environment.start, e.g. codefix's validation in sandboxes), then the run's
    task splits. Runs its own event loop: call it where none runs (RolloutSide calls it on a thread)."""
    asyncio.run(environment_for(env).start(TaskSetup.of(env)))
    return tasks_for(env, data)


def tasks_for(env: EnvConfig, data: DataConfig | None) -> tuple[Sequence[Task], Sequence[Task]]:
    """The run's (train, held-out) tasks: the recipe's `data:` section when it has one, else the environment's own
    (after its start-up step: prepared_tasks)."""
    if data is not None:
        from loomrl.data import load_splits  # datasets: loaded only by runs that read a dataset

        return load_splits(data, seed=env.seed, n_heldout=env.n_heldout)
    splits = environment_for(env).tasks(TaskSetup.of(env))
    if splits is None:
        raise ConfigError(f"config error: data: env.name={env.name} brings no tasks of its own; add a data: section "
                          "naming your dataset, e.g. data: {path: train.parquet} (docs/data.md)")
    return splits


def check_env_config(env: EnvConfig, data: DataConfig | None) -> None:
    """The env section against what only the environment and the sandbox backend know (the names
    env.families may list, the keys env.sandbox_limits may set), and the data section read: a ConfigError of one line,
    at load."""
    environment = environment_for(env)  # env.name and env.args: refused here when wrong
    environment.check(TaskSetup.of(env))
    if data is not None:  # read at load: a missing file, column or split stops here, in one line
        from loomrl.data import DataError, load_splits

        try:
            load_splits(data, seed=env.seed, n_heldout=env.n_heldout)
        except DataError as err:
            raise ConfigError(str(err)) from None
    if data is None and not environment.brings_tasks:
        raise ConfigError(f"config error: data: env.name={env.name} brings no tasks of its own; add a data: section "
                          "naming your dataset, e.g. data: {path: train.parquet} (docs/data.md)")
    if env.sandbox_limits:
        from loomrl.env.sandbox.factory import limit_keys, resolve_backend

        # auto: the backend it picks on this machine (a Ray env actor's node may pick another; its
        # sandboxes check their limits again when they are made)
        backend = resolve_backend(env.sandbox)
        known = limit_keys(backend)
        unknown = [k for k in env.sandbox_limits if k not in known]
        if unknown:
            picked = f" (env.sandbox={env.sandbox} picks {backend} here)" if env.sandbox == "auto" else ""
            raise ConfigError(f"config error: env.sandbox_limits: unknown key {', '.join(map(repr, unknown))} for the "
                              f"{backend} sandbox{picked}; valid keys: {', '.join(known)}")


def sandbox_pool_size(env: EnvConfig, agent_kind: str, concurrency: int) -> int:
    """Sandboxes for `concurrency` rollouts of an `agent_kind` agent (agent.kind): env.pool_size, else enough for
    them plus spares."""
    if env.pool_size:
        return env.pool_size
    use = "episode" if agent_kind == "blackbox" else environment_for(env).sandbox
    if use == "call":  # held only while a tool runs: a few per core are plenty
        return pool_size_for(min(concurrency, 4 * (os.cpu_count() or 1)))
    return pool_size_for(concurrency)  # held for a whole episode
