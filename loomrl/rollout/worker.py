"""RolloutWorker: turns positions in the task stream into scored GRPO groups.

Position p of the run's data order maps to a training task through a per-epoch permutation seeded by
the run seed, so the stream is reproducible and a resumed run can skip exactly the positions whose
groups were already received by the trainer. Each trajectory gets a fresh env whose tool calls lease
sandboxes from one EnvPool (pre-warmed, reset between uses, broken ones replaced); the reward pool
scores it off the agent loop; `counts` says how many episodes were launched and how each ended, for training and for
evaluation apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from loomrl.agent.blackbox import BlackBoxRunner, read_agent_files
from loomrl.agent.context import ContextStrategy
from loomrl.agent.gateway import Budget, Gateway, ServerThread
from loomrl.agent.loop import AgentLoop
from loomrl.agent.priorities import ProgramPriorities
from loomrl.config import RolloutPoolConfig
from loomrl.engine.base import Engine, SamplingParams
from loomrl.env.api import EpisodeContext, environment_for
from loomrl.env.pool import LeasePool, Leases, sandbox_pool
from loomrl.env.registry import sandbox_pool_size
from loomrl.model.chat import ChatRenderer
from loomrl.reward.composite import Composite
from loomrl.reward.judge import judge_for
from loomrl.reward.pool import RewardPool, Scorer, load_terms
from loomrl.reward.terms import CombinedReward
from loomrl.seeds import keyed_seed
from loomrl.types import REWARD_FAILED, EvalRecord, Evaluation, RewardFn, RolloutStatus, Score, Task, Trajectory

if TYPE_CHECKING:
    from loomrl.env.browser.pool import BrowserTab
    from loomrl.env.remote_episode import RemoteEpisodes


@dataclass(slots=True, kw_only=True)
class EpisodeCounts:
    """The episodes of one purpose (training or evaluation), as summary.json's `rollouts` shows them.

    `ended` partitions `launched` once none is in flight: each episode once, by its final status, "cancelled" (in
    flight when the run ended) or "failed:<error>" (an error outside the agent loop's own handling). The other two
    count beside that sum: `among_ended` counts ended episodes again by a trait (reward_failed: played out, its
    reward could not be computed; stored, not trained), and `retried_attempts` counts attempts, not episodes, that
    ended with a status in agent.retry_on and were run again (their episode ends once, later, in `ended`)."""

    launched: int = 0
    ended: Counter[str] = field(default_factory=Counter)
    among_ended: Counter[str] = field(default_factory=Counter)
    retried_attempts: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"launched": self.launched, "ended": dict(self.ended), "among_ended": dict(self.among_ended),
                "retried_attempts": dict(self.retried_attempts)}


async def gather_all(coros: list) -> list:
    """asyncio.gather, except that when it fails or is cancelled it returns only after every awaitable
    has finished: plain gather gives up at the first cancelled child while its siblings are still
    unwinding (releasing sandboxes, closing gateway sessions, counting how they ended)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class DataOrder:
    """Reproducible order of training tasks: a fresh permutation per epoch."""

    def __init__(self, n_tasks: int, seed: int):
        self.n = n_tasks
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if epoch not in self._perms:
            perm = list(range(self.n))
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(perm)
            self._perms = {epoch: perm}
        return self._perms[epoch][offset]


def reward_fn_for(pool: RolloutPoolConfig) -> RewardFn | CombinedReward:
    """The run's reward: the recipe's reward.functions or reward.function (weighted, run in reward worker processes),
    else the environment's own reward. For a black-box agent with agent.reward_from_agent, what the program reported
    when it did."""
    reported = pool.agent.kind == "blackbox" and pool.agent.reward_from_agent
    if pool.reward.functions or pool.reward.function:
        return CombinedReward(load_terms(pool.reward), max_steps=pool.total_steps, keep_reported=reported)
    reward_fn = environment_for(pool.env).reward
    if reported:
        verifier = reward_fn

        def reward_fn(t: Trajectory, task: Task) -> dict[str, float]:
            return dict(t.reward_components) if t.reward_components else verifier(t, task)
    return reward_fn


def reward_pool_for(pool: RolloutPoolConfig) -> RewardPool:
    """The run's reward pool in this process: its reward (reward_fn_for), reward.terms, the judge (reward.judge),
    workers and timeout."""
    r = pool.reward
    return RewardPool(reward_fn_for(pool), workers=r.workers, timeout_s=r.timeout_s,
                      composite=Composite.from_config(r.terms), judge=judge_for(r.judge))


def group_slots(pool: RolloutPoolConfig) -> int:
    """Groups in flight at once under runtime.max_inflight_trajectories (at least one: a group is never split)."""
    return max(1, pool.max_inflight_trajectories // pool.group_size)


def eval_slots(pool: RolloutPoolConfig) -> int:
    """Evaluation episodes in flight at once: eval.max_inflight and runtime.max_inflight_trajectories, where set."""
    return min(c for c in (pool.eval.max_inflight, pool.max_inflight_trajectories, 1 << 30) if c)


def rollout_concurrency(pool: RolloutPoolConfig) -> int:
    """Trajectories in flight at once on one rollout worker: the groups of a step (sync) or the
    admission window (async), or evaluation's episodes, within runtime.max_inflight_trajectories."""
    window = 1 + pool.max_policy_lag if pool.mode == "async" else 1
    train = pool.groups_per_step * window * pool.group_size
    evaluating = min(pool.eval.n_tasks, eval_slots(pool))
    if pool.max_inflight_trajectories:
        return max(min(train, group_slots(pool) * pool.group_size), evaluating)
    return max(train, evaluating)


class RolloutWorker:
    def __init__(self, pool: RolloutPoolConfig, engine: Engine, renderer: ChatRenderer, train_tasks: Sequence[Task],
                 reward_pool: Scorer | None = None, env_pool: Leases | None = None,
                 episodes: RemoteEpisodes | None = None):
        """`pool`: the rollout pool's config (config/pools.py). `reward_pool`: where trajectories are scored
        (default: threads of this process; on Ray it may be the reward actors, reward/actor.py RemoteRewardPool).
        `env_pool`: where white-box environments lease sandboxes (default: an EnvPool of this process, made on first
        use; on Ray it may be the env actors, env/remote.py RemoteEnvPool). `episodes`: where white-box episodes run
        (default: here, each from the environment with this process's pools; on Ray, for environments with a browser,
        in the env actors: env/remote_episode.py RemoteEpisodes, and this process then has no pools)."""
        self.config = pool
        self.engine = engine
        self.renderer = renderer
        self.train_tasks = train_tasks
        self.order = DataOrder(len(train_tasks), pool.seed)
        self.environment = environment_for(pool.env)
        self.environment.use_tokenizer(renderer.tokenizer)  # e.g. a template that renders no tool schemas
        self.reward_pool: Scorer = reward_pool or reward_pool_for(pool)
        self.composite = Composite.from_config(pool.reward.terms)  # the group terms (completion_time)
        self._retry_rng = random.Random(f"{pool.seed}:retry")
        self._pool: Leases | None = env_pool
        self._episodes = episodes
        self._browsers: LeasePool[BrowserTab] | None = None
        self._blackbox: BlackBoxRunner | None = None
        self._gateway: Gateway | None = None
        self._gateway_dir = ""
        self._servers: list[ServerThread] = []
        self._prepare_lock = asyncio.Lock()
        self._prepared = False
        # slots for groups (runtime.max_inflight_trajectories) and eval episodes; bound to the run's loop on first wait
        self._group_slots = asyncio.Semaphore(group_slots(pool)) if pool.max_inflight_trajectories else None
        self._eval_slots = asyncio.Semaphore(eval_slots(pool))
        self.cap_wait_s = 0.0  # summed time groups waited for a slot under max_inflight_trajectories
        # episodes by purpose ("training", "evaluation"): launched, how each ended, and counts beside that partition
        self.counts: dict[str, EpisodeCounts] = {"training": EpisodeCounts(), "evaluation": EpisodeCounts()}
        s = pool.sampling
        # Seer orders the training rollouts' engine calls; evaluation episodes are single programs.
        self.priorities = ProgramPriorities(pool.agent.max_turns * s.max_tokens) if pool.schedule == "seer" else None
        self.train_loop = self._loop(SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                    max_tokens=s.max_tokens), self.priorities)
        self.eval_loop = self._loop(SamplingParams(temperature=pool.eval.temperature, max_tokens=s.max_tokens))

    def _loop(self, sampling: SamplingParams, priorities: ProgramPriorities | None = None) -> AgentLoop:
        # keyed sampling (sampling.keyed_seeds): each turn's seed is named by the run seed, the episode and the turn
        a = self.config.agent
        context = ContextStrategy(a.context.strategy, window=a.max_context_tokens, threshold=a.context.threshold,
                                  keep_last=a.context.keep_last, summary_max_tokens=a.context.summary_max_tokens)
        return AgentLoop(self.engine, self.renderer, sampling=sampling, max_turns=a.max_turns,
                         max_context_tokens=a.max_context_tokens, trajectory_timeout_s=a.trajectory_timeout_s,
                         context=context, priorities=priorities,
                         seed=self.config.seed if self.config.sampling.keyed(self.config.engine.engine.kind) else None)

    def task_at(self, position: int) -> Task:
        return self.train_tasks[self.order.index(position)]

    async def env_pool(self, binds: dict[str, str] | None = None) -> Leases | None:
        """The sandbox pool, made and pre-warmed on first use (inside the run's event loop); None for
        environments that need no sandbox."""
        use = "episode" if self.config.agent.kind == "blackbox" else self.environment.sandbox
        if use is None or self._episodes is not None:  # remote episodes: the env actors hold the sandboxes
            return None
        if self._pool is None:
            size = sandbox_pool_size(self.config.env, self.config.agent.kind, rollout_concurrency(self.config))
            self._pool = sandbox_pool(self.config.env, size, binds)
            await self._pool.start()
        return self._pool

    async def browser_pool(self) -> LeasePool[BrowserTab] | None:
        """The browser pool (env.browser), made and pre-warmed on first use; None for environments without a browser."""
        if not self.environment.browser or self._episodes is not None:  # remote episodes: the env actors hold them
            return None
        if self._browsers is None:
            from loomrl.env.browser.pool import browser_pool

            self._browsers = browser_pool(self.config.env.browser, rollout_concurrency(self.config))
            await self._browsers.start()
        return self._browsers

    async def prepare(self) -> None:
        """Start what episodes need (the env pool, pre-warmed; for black-box agents the gateway too)
        before the first one runs: a sandbox backend that cannot work stops the run here, before any
        rollout, and the episodes of the first groups all start together, after it, instead of the
        first one waiting on the pool's start-up while its siblings go ahead."""
        async with self._prepare_lock:
            if not self._prepared:
                if self.config.agent.kind == "blackbox":
                    self._blackbox = await self._start_blackbox()
                else:
                    await self.env_pool()
                    await self.browser_pool()
                self._prepared = True

    async def _start_blackbox(self) -> BlackBoxRunner:
        """The gateway (served on a unix socket for sandboxes and on loopback TCP for the process
        backend) and the runner."""
        a = self.config.agent
        self._gateway = Gateway(self.engine, self.renderer.tokenizer, self.config.name,
                                allow_agent_reward=a.reward_from_agent)
        # 0700, as mkdtemp makes it: bwrap mounts the socket as root, so the sandbox's uid need not
        # traverse this folder (only the socket file itself is 0666, see ServerThread)
        self._gateway_dir = tempfile.mkdtemp(prefix="loomrl-gateway-")
        socket_path = os.path.join(self._gateway_dir, "gateway.sock")
        self._servers = [ServerThread(self._gateway.app(), uds=socket_path), ServerThread(self._gateway.app())]
        pool = await self.env_pool(binds=BlackBoxRunner.sandbox_binds(socket_path))
        assert pool is not None
        return BlackBoxRunner(
            self._gateway, pool, a.command, gateway_url=self._servers[1].url, files=read_agent_files(a.files),
            timeout_s=a.trajectory_timeout_s,
            budget=Budget(max_calls=a.max_turns, max_context_tokens=a.max_context_tokens,
                          max_wall_s=a.trajectory_timeout_s))

    async def _run_blackbox(self, loop: AgentLoop, task: Task, group_id: str, position: int) -> Trajectory:
        assert self.environment.takes_blackbox, "config.load_config refuses black-box agents for this env"
        answer_of = self.environment.answer_of
        assert self._blackbox is not None, "prepare() starts it"
        run = await self._blackbox.run(task, group_id=group_id, position=position, sampling=loop.sampling)
        traj = run.trajectory
        if traj.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED):
            # The verifier: the program's printed answer, else its last assistant message.
            last = traj.all_turns()[-1].act if traj.all_turns() else ""
            traj.final_answer = answer_of(run.stdout) or answer_of(last)
        return traj

    async def run_one(self, loop: AgentLoop, task: Task, group_id: str, position: int, stream: str) -> Trajectory:
        """One episode, scored; retried as agent.retry_on says. `stream` names its randomness (seeds.py): its
        environment's draws and, with sampling.keyed_seeds, its turns' sampling. A retry draws from streams of its
        own (`<stream>:retry<k>`): what failed may have been the environment's own draw (injected faults) or the
        policy's (a generation that ran past the deadline), which the same draws would repeat."""
        counts = self.counts["evaluation" if loop is self.eval_loop else "training"]
        counts.launched += 1
        try:
            a = self.config.agent
            errors: list[str] = []
            while True:
                attempt = f"{stream}:retry{len(errors)}" if errors else stream
                traj = await self._run_one(loop, task, group_id, position, attempt)
                traj.prompt, traj.answer, traj.split = task.prompt, task.answer, task.split
                for pool in (self._pool, self._browsers, self._episodes):
                    if pool is not None and pool.failure is not None:
                        # The sandboxes (or browsers, here or in an env actor) cannot work (the episode ended env_error
                        # with the same cause): every later episode would fail at once, so the run stops with the cause.
                        raise pool.failure
                if str(traj.status) not in a.retry_on or len(errors) >= a.max_retries:
                    traj.metadata.attempts = len(errors) + 1
                    traj.metadata.retry_errors = errors
                    t0 = time.perf_counter()
                    traj = await self.reward_pool.score(traj, task)
                    traj.metadata.reward_s = time.perf_counter() - t0
                    counts.ended[str(traj.status)] += 1
                    if traj.reward_failed:  # ended with its status (counted there), and its reward failed
                        counts.among_ended[REWARD_FAILED] += 1
                    return traj
                # A failure the recipe retries (agent.retry_on): run the episode again after a backoff.
                errors.append(f"{traj.status}: {traj.error}")
                counts.retried_attempts[str(traj.status)] += 1  # an attempt, not an episode: it ends later
                delay = a.retry_backoff_s * 2 ** (len(errors) - 1)
                await asyncio.sleep(delay * (0.5 + self._retry_rng.random()))
        except asyncio.CancelledError:
            counts.ended["cancelled"] += 1  # still in flight when the run ended (async mode), or stopped
            raise
        except BaseException as err:  # a failure outside the agent loop's own error handling
            counts.ended[f"failed:{type(err).__name__}"] += 1
            raise

    async def _run_one(self, loop: AgentLoop, task: Task, group_id: str, position: int, stream: str) -> Trajectory:
        if self.config.agent.kind == "blackbox":
            traj = await self._run_blackbox(loop, task, group_id, position)
        else:
            source = self._episodes if self._episodes is not None else self.environment
            env = source.episode(EpisodeContext(
                pool=await self.env_pool(), rng=random.Random(keyed_seed(self.config.seed, "env", stream)),
                tool_timeout_s=self.config.env.tool_timeout_s, browsers=await self.browser_pool(),
                action_timeout_s=self.config.env.browser.action_timeout_s))
            try:
                traj = await loop.run(env, task, group_id=group_id, position=position, stream=stream)
                traj.metadata.env_version = self.environment.version  # the environment's, whichever Env ran it
                if traj.status == RolloutStatus.TRUNCATED:
                    try:  # e.g. codefix: run the tests on what the agent left
                        answer = await env.finalize()
                        if answer is not None:
                            traj.final_answer = answer
                    except Exception as err:  # noqa: BLE001 - errors are data: the sandbox died, not the run
                        traj.status = RolloutStatus.ENV_ERROR
                        traj.error = f"finalize failed: {type(err).__name__}: {err}"
            finally:
                await env.close()  # sandboxes always go back to the pool
        return traj

    async def run_group(self, position: int) -> list[Trajectory]:
        await self.prepare()
        task = self.task_at(position)
        group_id = f"group-{position:07d}"
        t0 = time.perf_counter()
        async with self._group_slots or contextlib.nullcontext():
            self.cap_wait_s += time.perf_counter() - t0
            try:
                group = await gather_all([self.run_one(self.train_loop, task, group_id, position,
                                                       f"train:{position}:{member}")
                                          for member in range(self.config.group_size)])
                self.composite.score_group(group)
                return group
            finally:
                if self.priorities is not None:
                    self.priorities.forget(group_id)

    async def evaluate(self, tasks: list[Task], progress=None) -> Evaluation:
        """Success rate on `tasks`, one episode each at the eval temperature (0 = greedy), and the episodes."""
        await self.prepare()

        async def one(i: int, task: Task) -> Trajectory:
            async with self._eval_slots:
                traj = await self.run_one(self.eval_loop, task, f"eval-{i:05d}", -1, f"eval:{i}:{task.task_id}")
            if progress is not None:
                progress.update(1)
            return traj

        trajs = await gather_all([one(i, t) for i, t in enumerate(tasks)])
        by_split: dict[str, list[bool]] = {task.split: [] for task in tasks}  # a split whose episodes all failed: n=0
        for tr, task in zip(trajs, tasks):
            if tr.scored:  # one that could not be played out is no success and no failure
                by_split[task.split].append(self.environment.success(tr, task))
        total = Score.of([hit for hits in by_split.values() for hit in hits])
        record = EvalRecord(success=total.success, n=total.n, stderr=total.stderr,
                            statuses=dict(Counter(tr.ending for tr in trajs)),
                            splits={k: Score.of(v) for k, v in by_split.items()},
                            first_error=next((tr.error for tr in trajs if not tr.scored), None))
        return Evaluation(record=record, episodes=trajs)

    def rollout_counts(self) -> dict[str, dict[str, Any]]:
        """Episodes by purpose ("training", "evaluation"), each EpisodeCounts.as_dict."""
        return {purpose: counts.as_dict() for purpose, counts in self.counts.items()}

    def program_metrics(self) -> dict[str, float]:
        """Black-box programs by phase and status (ThunderAgent's view), for the metrics log."""
        if self._gateway is None:
            return {}
        out: Counter[str] = Counter()
        for p in self._gateway.programs():
            out[f"programs/{p['phase']}"] += 1
            out[f"programs/{p['status']}"] += 1
        return {k: float(v) for k, v in out.items()}

    def reward_metrics(self) -> dict[str, float]:
        """The reward pool's counters so far (the LLM judge's: judge/calls, judge/cost_usd, ...)."""
        return self.reward_pool.metrics()

    def pool_metrics(self) -> dict[str, float]:
        """The sandbox pool's metrics, and the browser pool's under browser_*."""
        out = asdict(self._pool.metrics) if self._pool is not None else {}
        if self._browsers is not None:
            out.update({f"browser_{k}": v for k, v in asdict(self._browsers.metrics).items()})
        return out

    async def aclose(self) -> None:
        await self.reward_pool.aclose()
        for server in self._servers:
            server.stop()
        if self._gateway_dir:
            shutil.rmtree(self._gateway_dir, ignore_errors=True)
        if self._pool is not None:
            await self._pool.close()  # kept: its metrics stay readable
        if self._browsers is not None:
            await self._browsers.close()


def group_summary(groups: list[list[Trajectory]]) -> dict[str, float]:
    """The rollout metrics of the groups a step received: rewards over the trajectories that were scored only (one
    that could not be played out has no reward, not a 0), and how every trajectory ended."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        return {}
    scored = [t for t in trajs if t.scored]
    out = {"rollout/trajectories": len(trajs), "rollout/scored": len(scored),
           "rollout/turns_mean": sum(len(t.turns) for t in trajs) / len(trajs),
           "rollout/tokens_mean": sum(len(t.token_ids) for t in trajs) / len(trajs)}
    if scored:
        out["rollout/reward_mean"] = sum(t.total_reward for t in scored) / len(scored)
        components: dict[str, list[float]] = {}
        for t in scored:  # each over the trajectories it had an opinion on (a TRL-style None is no value, not 0)
            for name, value in t.reward_components.items():
                components.setdefault(name, []).append(value)
        out.update({f"reward/{name}": sum(v) / len(v) for name, v in components.items()})
        out["rollout/correct_rate"] = sum(1 for t in scored if t.reward_components.get("correct", 0) > 0) / len(scored)
    for status in RolloutStatus:
        out[f"rollout/status_{status.value}"] = sum(1 for t in trajs if t.status == status)
    out["rollout/status_reward_failed"] = sum(1 for t in trajs if t.reward_failed)
    out.update(tool_counts(trajs))
    return out


def tool_counts(trajs: list[Trajectory]) -> dict[str, float]:
    """Per tool: its calls, and those it did not carry out by why (env/tools.py ToolFailure; a tool's own exceptions
    by type): tool/<name>/calls, tool/<name>/refused, tool/<name>/timeout, tool/<name>/raised/<Exception>."""
    out: Counter[str] = Counter()
    for t in trajs:
        for call in (c for turn in t.all_turns() for c in turn.tool_calls if c.get("name")):
            out[f"tool/{call['name']}/calls"] += 1
            failure = call.get("failure")
            if failure == "raised":
                out[f"tool/{call['name']}/raised/{call.get('exception') or 'Exception'}"] += 1
            elif failure:
                out[f"tool/{call['name']}/{failure}"] += 1
    return dict(out)
