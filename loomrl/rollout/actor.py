"""A rollout worker with what it runs on (RolloutSide: model, engine, task splits; the local backend's
rollout side), and the rollout pool's Ray half: one as an actor on some node (RolloutActor).

Weights here only for the built-in engine, which runs the model in this process; with vLLM or SGLang the model is
a meta-device skeleton (model/loader.py load_engine_model): their own processes hold the weights, on the GPU."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from loomrl.actor_support import Placed
from loomrl.config import RolloutPoolConfig, TrainerConfig
from loomrl.engine.actor import RemoteEngine, WeightGate
from loomrl.engine.base import Engine
from loomrl.engine.factory import make_engine
from loomrl.engine.readings import Reading, reading_of
from loomrl.env.api import environment_for
from loomrl.env.pool import Leases
from loomrl.env.registry import prepared_tasks
from loomrl.env.remote import RemoteEnvPool
from loomrl.env.remote_episode import RemoteEpisodes, runs_episodes
from loomrl.model.chat import ChatRenderer
from loomrl.model.loader import load_engine_model, load_tokenizer
from loomrl.reward.actor import RemoteRewardPool
from loomrl.reward.pool import Scorer
from loomrl.rollout.worker import RolloutWorker
from loomrl.types import Evaluation, Task, Trajectory
from loomrl.weights.handle import WeightHandle


class RolloutSide:
    """A RolloutWorker, its engine over the run's model (`checkpoint`'s, else model config's: see
    load_engine_model; `trainer`: loaded as the trainer's, for a sync run; for vLLM and SGLang a skeleton without
    weights) and the run's task splits (registry.prepared_tasks); `eval_tasks`: the held-out tasks an evaluation runs.
    `reward_pool`, `env_pool`, `episodes`: the worker's (RolloutWorker; on Ray, the reward and env actors' clients)."""

    def __init__(self, pool: RolloutPoolConfig, checkpoint: Path | None, *, trainer: TrainerConfig | None = None,
                 engine_actor: Any = None, reward_pool: Scorer | None = None, env_pool: Leases | None = None,
                 episodes: RemoteEpisodes | None = None):
        # On a thread: this may run inside an event loop (a Ray actor's constructor, LocalRollouts.start), and the
        # environment's start-up step runs one of its own (codefix validates its corpus in local sandboxes, or reads
        # the validation it cached).
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            train_tasks, heldout = thread.submit(prepared_tasks, pool.env, pool.data).result()
        # the first eval.n_tasks of each held-out split (heldout, heldout_templates: see env/registry.py)
        by_split: dict[str, list[Task]] = {}
        for t in heldout:
            by_split.setdefault(t.split, []).append(t)
        self.eval_tasks = [t for tasks in by_split.values() for t in tasks[: pool.eval.n_tasks]]
        torch.manual_seed(pool.seed)
        self.model: PreTrainedModel | None  # None beside an engine actor
        if engine_actor is not None:  # the engine is an actor of its own (ray.engine.count > 0): tokenizer only
            self.model, self.tokenizer = None, load_tokenizer(pool.model)
            self.engine: Engine = RemoteEngine(engine_actor, pool.engine_restart_wait_s)
        else:
            self.model, self.tokenizer = load_engine_model(pool.engine, checkpoint, trainer=trainer)
            self.engine = make_engine(pool.engine, self.model, self.tokenizer, 0)
        try:
            self.worker = RolloutWorker(pool, self.engine, ChatRenderer(self.tokenizer), train_tasks,
                                        reward_pool=reward_pool, env_pool=env_pool, episodes=episodes)
        except BaseException:  # e.g. reward.function does not import: no engine thread left behind
            self.engine.close()
            raise

    def reward_metrics(self) -> dict[str, float]:
        """Its reward pool's counters so far (an LLM judge's): the Ray driver reads them each step."""
        return self.worker.reward_metrics()

    def engine_reading(self) -> Reading:
        """Its engine's counters now (engine/readings.py): the Ray driver reads them each step. With an engine actor,
        the client's counts (the driver reads the engine actors instead)."""
        return reading_of(self.engine)

    async def close(self) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
        """Tear down sandboxes and the engine; returns the episode counts and the env pool's metrics (read
        after the pool closed: they count every instance's teardown)."""
        try:
            await self.worker.aclose()
        finally:  # the engine's thread ends before this process does, whatever the pools did
            self.engine.close()
        return self.worker.rollout_counts(), self.worker.pool_metrics()


class RolloutActor(Placed, RolloutSide):
    """One rollout worker on some node. Async actor: many groups run at once over one engine.
    `reward_actors`: score on these (RemoteRewardPool) instead of this actor's own threads.
    `env_actors`: lease sandboxes from these (RemoteEnvPool, as `owner`) instead of this node's; for an environment
    with a browser, run whole episodes in them (RemoteEpisodes: the browsers live there).
    `engine_actor`: generate on it (RemoteEngine; it gets the weights itself) instead of an engine of its own."""

    def __init__(self, pool_json: str, reward_actors: list[Any] | None = None, env_actors: list[Any] | None = None,
                 owner: str = "", engine_actor: Any = None):
        """`pool_json`: the rollout pool's config (RolloutPoolConfig) as JSON."""
        pool = RolloutPoolConfig.model_validate_json(pool_json)
        e = pool.engine
        # engine.threads, else the CPUs Ray reserved for this actor (several actors share a node's cores)
        torch.set_num_threads(e.engine.threads or max(1, int(pool.cpus)))
        # Architecture, tokenizer and frozen weights; the trainable ones arrive with update_weights
        # before the first group (the driver sends the trainer's current version to every new actor).
        remote = runs_episodes(pool.env, pool.agent.kind)
        episodes = RemoteEpisodes(env_actors, owner, pool.env, environment_for(pool.env).version) \
            if env_actors and remote else None
        super().__init__(pool, None, reward_pool=RemoteRewardPool(reward_actors) if reward_actors else None,
                         env_pool=RemoteEnvPool(env_actors, owner) if env_actors and not remote else None,
                         episodes=episodes, engine_actor=engine_actor)
        self.gate = WeightGate(self.engine, e.interrupt_on_update,
                               label=f"{e.engine.kind} ({owner or 'rollout actor'})")

    async def update_weights(self, handle: WeightHandle) -> dict[str, float]:
        """Load a published version into the engine; groups sent after this call wait for it.
        Returns the version and how long fetching (from the object store) and applying took."""
        return await self.gate.load(handle)

    async def run_group(self, position: int) -> list[Trajectory]:
        # An update sent before this group (e.g. the rollback after a trainer restart) lands first
        # (with an engine actor, the backend waits for its engine's: ActorRollouts._attempt)
        await self.gate.settled()
        return await self.worker.run_group(position)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.engine.sleep)

    async def wake(self) -> None:
        await asyncio.to_thread(self.engine.wake)

    async def evaluate(self) -> Evaluation:
        await self.gate.settled()  # the latest published weights first, as for run_group
        return await self.worker.evaluate(self.eval_tasks)
