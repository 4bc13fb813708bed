"""Environment families a run can use (`env.name`): how to make their task splits, an env instance,
and their default reward, and whether (and how) they use the sandbox pool.

- calculator: arithmetic word problems; each tool call leases a sandbox only while it runs.
- codefix: SWE-style bug fixing; an episode holds one sandbox throughout. Tasks are validated
  (golden patch passes, untouched repository fails) before a run; invalid ones are left out.
- gym: gymnasium toy-text games as multi-turn text; in-process, no sandbox.

Generated families (tasks drawn from templates) split by template as well as by numbers with
`template_splits`, written once here for every such family: held-out templates never appear in training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.config import ConfigError, RunConfig
from loomrl.env.base import Env
from loomrl.env.pool import EnvPool, pool_size_for
from loomrl.types import RewardFn, Task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EnvFamily:
    name: str
    splits: Callable[[RunConfig], tuple[list[Task], list[Task]]]
    make_env: Callable[[RunConfig, EnvPool | None, random.Random], Env]
    reward: Callable[[RunConfig], RewardFn]
    # "call": a sandbox per tool call; "episode": one per episode; None: no sandbox.
    sandbox_use: str | None
    # A black-box agent's final answer from its printed output or last message (None: the family takes
    # no black-box agents; config.load_config refuses them)
    answer_of: Callable[[str], str | None] | None = None
    # Refuses, with a ConfigError of one line, what the config cannot check alone: the names env.families
    # (and the family's own section) may list. Run at config load, before a model is loaded
    check: Callable[[RunConfig], None] | None = None


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


# -- calculator ----------------------------------------------------------------------------------------
_CALC_FAMILIES = ["add", "sub", "mul"]


def _calc_splits(cfg: RunConfig) -> tuple[list[Task], list[Task]]:
    from loomrl.env.tasks.calculator import make_splits

    e = cfg.env
    families = e.families or _CALC_FAMILIES
    return make_splits(families, e.calculator.heldout_families or families, e.n_train, e.n_heldout, e.seed,
                       e.heldout_template_share)


def _calc_check(cfg: RunConfig) -> None:
    from loomrl.env.tasks.calculator import check_families

    check_families(cfg.env.families or [])
    check_families(cfg.env.calculator.heldout_families or [], "env.calculator.heldout_families")


def _calc_env(cfg: RunConfig, pool: EnvPool | None, rng: random.Random) -> Env:
    from loomrl.env.tasks.calculator import CalculatorEnv

    c = cfg.env.calculator
    assert pool is not None
    return CalculatorEnv(pool, tool_timeout_s=cfg.env.tool_timeout_s, crash_rate=c.crash_rate, hang_rate=c.hang_rate,
                         few_shot=c.few_shot, rng=rng, step_latency_s=c.step_latency_s,
                         step_latency_sigma=c.step_latency_sigma)


def _calc_reward(cfg: RunConfig) -> RewardFn:
    from loomrl.reward import calculator_reward

    r = cfg.reward
    return lambda t, task: calculator_reward(t, task, correct=r.correct, format_weight=r.format_weight)


# -- codefix ---------------------------------------------------------------------------------------------
_validated: dict[tuple, set[str]] = {}


def _codefix_specs(cfg: RunConfig):
    from loomrl.env.tasks.codefix import codefix_specs

    specs = codefix_specs(cfg.env.families)
    key = (cfg.env.sandbox, tuple(sorted(specs)))
    if key not in _validated:
        report = asyncio.run(validate_codefix(list(specs.values()), cfg.env.sandbox, cfg.env.sandbox_limits))
        _validated[key] = {r["task_id"] for r in report if r["valid"]}
        bad = [r for r in report if not r["valid"]]
        if bad:
            log.warning("codefix: %d invalid task(s) left out: %s", len(bad),
                        "; ".join(f"{r['task_id']}: {r['detail']}" for r in bad))
    return {k: v for k, v in specs.items() if k in _validated[key]}


def _codefix_splits(cfg: RunConfig) -> tuple[list[Task], list[Task]]:
    from loomrl.env.tasks.codefix import codefix_splits

    return codefix_splits(_codefix_specs(cfg), cfg.env.n_heldout, cfg.env.seed)


def _codefix_env(cfg: RunConfig, pool: EnvPool | None, rng: random.Random) -> Env:
    from loomrl.env.tasks.codefix import CodefixEnv

    assert pool is not None
    return CodefixEnv(pool, _codefix_specs(cfg), command_timeout_s=cfg.env.tool_timeout_s)


async def validate_codefix(specs: list, backend: str = "auto", limits: dict[str, int] | None = None,
                           progress=None) -> list[dict[str, Any]]:
    """Validate codefix tasks in real sandboxes: one record per task (task_id, valid, golden_passes,
    noop_fails, detail)."""
    from loomrl.env.sandbox import make_sandbox
    from loomrl.env.tasks.codefix import validate_tasks

    pool = await EnvPool(lambda: make_sandbox(backend, limits=limits), size=pool_size_for(4), prewarm=4).start()
    try:
        results = await validate_tasks(specs, pool, progress=progress)
    finally:
        await pool.close()
    return [{"task_id": r.task_id, "valid": r.valid, **dataclasses.asdict(r)} for r in results]


def write_validation_report(report: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    valid = sum(r["valid"] for r in report)
    path.write_text(json.dumps({"valid": valid, "invalid": len(report) - valid, "tasks": report}, indent=2))


# -- gym -----------------------------------------------------------------------------------------------------
def _gym_splits(cfg: RunConfig) -> tuple[list[Task], list[Task]]:
    from loomrl.env.tasks import gym_text

    e = cfg.env
    return gym_text.make_gym_splits(e.families or list(gym_text.GYM_GAMES), e.n_train, e.n_heldout, e.seed)


def _task_attr(module: str, name: str) -> Any:
    """`name` from loomrl.env.tasks.<module>. Task modules, like the imports inside the functions above, load
    only once a run uses their family: they are slow to import (gymnasium above all)."""
    return getattr(importlib.import_module(f"loomrl.env.tasks.{module}"), name)


FAMILIES: dict[str, EnvFamily] = {
    "calculator": EnvFamily("calculator", _calc_splits, _calc_env, _calc_reward, "call",
                            lambda text: _task_attr("calculator", "parse_final_answer")(text), check=_calc_check),
    "codefix": EnvFamily("codefix", _codefix_splits, _codefix_env, lambda cfg: _task_attr("codefix", "codefix_reward"),
                         "episode", check=lambda cfg: _task_attr("codefix", "codefix_specs")(cfg.env.families)),
    "gym": EnvFamily("gym", _gym_splits,
                     lambda cfg, pool, rng: _task_attr("gym_text", "GymTextEnv")(few_shot=cfg.env.gym.few_shot),
                     lambda cfg: _task_attr("gym_text", "gym_reward"), None,
                     check=lambda cfg: _task_attr("gym_text", "check_games")(cfg.env.families or [])),
}


def env_family(name: str) -> EnvFamily:
    if name not in FAMILIES:
        raise ConfigError(f"config error: env.name: unknown environment {name!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[name]


def check_env_config(cfg: RunConfig) -> None:
    """The env section against what only the environment and the sandbox backend know (the names
    env.families may list, the keys env.sandbox_limits may set): a ConfigError of one line, at load."""
    family = env_family(cfg.env.name)
    if family.check is not None:
        family.check(cfg)
    if cfg.env.sandbox_limits:
        from loomrl.env.sandbox.factory import limit_keys, resolve_backend

        # auto: the backend it picks on this machine (a Ray env actor's node may pick another; its
        # sandboxes check their limits again when they are made)
        backend = resolve_backend(cfg.env.sandbox)
        known = limit_keys(backend)
        unknown = [k for k in cfg.env.sandbox_limits if k not in known]
        if unknown:
            picked = f" (env.sandbox={cfg.env.sandbox} picks {backend} here)" if cfg.env.sandbox == "auto" else ""
            raise ConfigError(f"config error: env.sandbox_limits: unknown key {', '.join(map(repr, unknown))} for the "
                              f"{backend} sandbox{picked}; valid keys: {', '.join(known)}")


def sandbox_pool_size(cfg: RunConfig, concurrency: int) -> int:
    """Sandboxes for `concurrency` rollouts: env.pool_size, else enough for them plus spares."""
    if cfg.env.pool_size:
        return cfg.env.pool_size
    use = "episode" if cfg.agent.kind == "blackbox" else env_family(cfg.env.name).sandbox_use
    if use == "call":  # held only while a tool runs: a few per core are plenty
        return pool_size_for(min(concurrency, 4 * (os.cpu_count() or 1)))
    return pool_size_for(concurrency)  # held for a whole episode
