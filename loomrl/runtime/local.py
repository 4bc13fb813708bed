"""Local runtime: one machine, one command.

sync  (hybrid, the seed's time-sharing): generate a step's groups with the current weights, then train
      on them, in one process; the engine and the trainer share one model object.
async (disaggregated): the trainer runs in its own process; the rollout process keeps launching groups
      while it trains, within bounded staleness (AReaL's admission rule: the group at data position p
      is consumed at step p // groups_per_step, so it is launched only while that step minus the
      current policy version is at most buffer.max_policy_lag). New weights reach the engine between
      batches; every token records the version that sampled it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loomrl.buffer.admission import admits, open_positions
from loomrl.config import ModelConfig, RunConfig, save_resolved
from loomrl.engine.base import Engine, EngineFault
from loomrl.env.registry import env_family
from loomrl.metrics import MetricsLogger
from loomrl.model.chat import ChatRenderer
from loomrl.model.loader import load_model
from loomrl.runtime.rollout import EvalResult, RolloutWorker, gather_all, group_summary
from loomrl.runtime.trainer_ranks import (
    LocalRankGroup,
    exit_reason,
    follower_threads,
    join_watching,
    name_process,
    spawn_local_followers,
)
from loomrl.runtime.trainer_service import PositionSet, TrainerService, repair_ledger_for_restart
from loomrl.runtime.weight_sync import StaleWeights, load_weights, make_publisher, sync_metrics
from loomrl.store import TrajectoryStore
from loomrl.trainer.checkpoint import checkpoint_step, latest_checkpoint, load_state

log = logging.getLogger("loomrl")


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


class TrainerDied(RuntimeError):
    """The async trainer process failed; the run restarts it or stops (runtime.max_trainer_restarts)."""


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def prepare_run_dir(cfg: RunConfig, resume: bool) -> Path | None:
    """Create the run folder (or find the checkpoint to resume); returns the checkpoint or None."""
    run_dir = cfg.run_dir
    ckpt = latest_checkpoint(run_dir)
    if resume:
        if ckpt is None:
            raise RunError(f"run error: --resume given but '{run_dir}' has no checkpoint; start without --resume")
    elif ckpt is not None or (run_dir / "ledger.jsonl").exists():
        raise RunError(f"run error: '{run_dir}' already holds a run; pass --resume to continue it, or set name=... "
                       "for a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir / "config.yaml")
    return ckpt


def build_model(cfg: RunConfig, ckpt: Path | None):
    if ckpt is not None:
        return load_model(ModelConfig(kind="hf", path=str(ckpt / "model")))
    return load_model(cfg.model)


def async_threads(cfg: RunConfig) -> tuple[int, int]:
    """Torch threads of the rollout and trainer processes in async mode: the configured numbers, or
    the machine's cores split between the two (both at torch's default would oversubscribe)."""
    cores = os.cpu_count() or 2
    engine = cfg.engine.threads or max(1, cores // 2)
    trainer = cfg.trainer.threads or max(1, cores - engine)
    return engine, trainer


def make_engine(cfg: RunConfig, model, tokenizer, version: int):
    """The engine the config asks for, over `model` (shared with the trainer in sync mode)."""
    e = cfg.engine
    from loomrl.engine.builtin.engine import BuiltinEngine

    return BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=e.kv_budget_tokens,
                         max_running=e.max_batch_size, max_prefill_tokens=e.max_prefill_tokens,
                         prefix_cache=e.prefix_cache, seed=cfg.seed, version=version, tokenizer=tokenizer)


class EngineDelta:
    """The engine's counters since the last call, for the step's metrics line (busy time: how much of
    the step the engine computed; the rest it waited for tools, the trainer or admission)."""

    def __init__(self, engine: Engine):
        self.metrics = engine.metrics
        self.last = self._read()

    def _read(self) -> dict[str, float]:
        m = self.metrics
        return {"busy_s": m.busy_s, "generated_tokens": m.generated_tokens, "prompt_tokens": m.prompt_tokens,
                "reused_tokens": m.reused_tokens, "preemptions": m.preemptions, "faults": m.faults}

    def take(self) -> dict[str, float]:
        now = self._read()
        d = {k: now[k] - self.last.get(k, 0) for k in now}
        self.last = now
        out = {f"engine/{k}": v for k, v in d.items() if k != "reused_tokens"}
        out["engine/prefix_hit_rate"] = d["reused_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
        return out


def positions_after(received: PositionSet) -> Iterator[int]:
    p = 0
    while True:
        if p not in received:
            yield p
        p += 1


def _eval_record(res: EvalResult) -> dict[str, Any]:
    return {"success": res.success, "n": res.n, "stderr": res.stderr, "statuses": res.statuses}


class LocalRun:
    def __init__(self, cfg: RunConfig, resume: bool = False, wall_start: float | None = None):
        self.cfg = cfg
        self.wall_start = wall_start or time.time()
        self.ckpt = prepare_run_dir(cfg, resume)
        self.train_tasks, self.heldout = env_family(cfg.env.name).splits(cfg)
        self.logger = MetricsLogger(cfg.run_dir)
        if self.ckpt is not None:
            self.logger.rollback(checkpoint_step(self.ckpt), "resume")
        self.store = TrajectoryStore(cfg.run_dir / "trajectories")
        self.trainer_restarts = 0  # async: trainer processes restarted from a checkpoint in this run
        torch.manual_seed(cfg.seed)

    # -- shared pieces ----------------------------------------------------------------------------
    def _engine(self, model, tokenizer, version: int):
        return make_engine(self.cfg, model, tokenizer, version)

    async def _evaluate(self, worker: RolloutWorker, label: str, step: int) -> dict[str, Any]:
        tasks = self.heldout[: self.cfg.eval.n_tasks]
        bar = _progress(len(tasks), f"eval {label}", self.cfg.progress)
        try:
            res = await worker.evaluate(tasks, progress=bar)
        finally:
            bar.close()  # before an error's message, not after it
        record = _eval_record(res)
        self.logger.log(step, {f"eval/{k}": v for k, v in record.items() if k != "statuses"}, kind=f"eval_{label}")
        log.info("held-out success %s: %.3f ± %.3f (n=%d)", label, res.success, res.stderr, res.n)
        return record

    def _log_step(self, step: int, metrics: dict[str, Any], groups, worker: RolloutWorker | None = None) -> None:
        values = {**metrics, **group_summary(groups)}
        if worker is not None:
            values.update(worker.program_metrics())
            values.update({f"env_pool/{k}": v for k, v in worker.pool_metrics().items()})
            if self.cfg.runtime.max_inflight_trajectories:
                values["rollout/cap_wait_s_total"] = worker.cap_wait_s
        self.logger.log(step, values)

    # -- sync -------------------------------------------------------------------------------------
    async def _run_sync(self) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        model, tokenizer = build_model(cfg, self.ckpt)
        service = TrainerService(cfg, model, tokenizer, resume_from=self.ckpt)
        followers = None
        try:
            if cfg.trainer.world_size > 1:  # this process is rank 0; a dead follower stops the run (--resume)
                followers = spawn_local_followers(cfg, self.ckpt, follower_threads(cfg, os.cpu_count() or 1))
                service.ranks = LocalRankGroup(service.trainer, cfg.trainer.world_size, *followers.channels(),
                                               dead=followers.dead)
                join_watching(service.ranks, followers)
            engine = self._engine(model, tokenizer, service.version)
            worker = RolloutWorker(cfg, engine, ChatRenderer(tokenizer), self.train_tasks)
            try:
                result = await self._sync_steps(service, engine, worker)
            finally:
                await worker.aclose()
                engine.close()
        finally:  # on every path, start-up failures included
            if followers is not None:
                followers.stop()
                if service.ranks is not None:
                    service.ranks.close()
        # After the pool closed: its metrics then count every instance's teardown.
        return {**result, "rollouts": worker.rollout_counts(), "env_pool": worker.pool_metrics()}

    async def _sync_steps(self, service: TrainerService, engine, worker: RolloutWorker) -> dict[str, Any]:
        """Eval before, the steps (generate a step's groups, then train on them), eval after."""
        cfg = self.cfg
        before = service.extra.get("eval_before")
        if before is None and cfg.eval.before and cfg.eval.n_tasks:
            before = service.extra["eval_before"] = await self._evaluate(worker, "before", service.version)
        pos = positions_after(service.received)
        bar = _progress(cfg.trainer.total_steps, "train", cfg.progress)
        bar.update(service.version)
        engine_delta = EngineDelta(engine)
        try:
            while not service.done:
                t0 = time.perf_counter()
                need = cfg.trainer.groups_per_step - len(service.buffer)
                positions = [next(pos) for _ in range(max(need, 0))]
                groups = await gather_all([worker.run_group(p) for p in positions])
                for p, g in zip(positions, groups):
                    self.store.append(g)
                    service.receive(p, g)
                self.store.flush()
                t1 = time.perf_counter()
                # on the engine's thread: one OpenMP team per process
                metrics = await asyncio.wrap_future(engine.call(service.train_step))
                engine.update_weights(None, service.version)  # weights changed in place (shared model)
                # The hybrid split: generation and training take turns on the same cores.
                metrics.update({"time/rollout_s": t1 - t0, "time/train_s": time.perf_counter() - t1,
                                **engine_delta.take()})
                self._log_step(service.version, metrics, groups, worker)
                bar.update(1)
                bar.set_postfix(reward=f"{group_summary(groups).get('rollout/reward_mean', 0):.3f}")
        finally:
            bar.close()
        after = await self._evaluate(worker, "after", service.version) if cfg.eval.after and cfg.eval.n_tasks else None
        return {"before": before, "after": after, "steps": service.version}

    # -- async ------------------------------------------------------------------------------------
    async def _run_async(self) -> dict[str, Any]:
        cfg = self.cfg
        torch.set_num_threads(async_threads(cfg)[0])
        model, tokenizer = build_model(cfg, self.ckpt)
        extra = load_state(self.ckpt).get("extra", {}) if self.ckpt else {}
        engine = self._engine(model, tokenizer, 0)
        worker = RolloutWorker(cfg, engine, ChatRenderer(tokenizer), self.train_tasks)
        before = extra.get("eval_before")
        try:
            if before is None and cfg.eval.before and cfg.eval.n_tasks:
                before = extra["eval_before"] = await self._evaluate(worker, "before", 0)
            steps = await self._async_loop(engine, worker, extra)
            after = await self._evaluate(worker, "after", steps) if cfg.eval.after and cfg.eval.n_tasks else None
            result = {"before": before, "after": after, "steps": steps}
        finally:
            await worker.aclose()
            engine.close()
        # After the pool closed: its metrics then count every instance's teardown.
        return {**result, "rollouts": worker.rollout_counts(), "env_pool": worker.pool_metrics()}

    async def _async_loop(self, engine, worker: RolloutWorker, extra: dict[str, Any]) -> int:
        """Run the async segments: a trainer process that dies is restarted from the latest checkpoint
        (at most runtime.max_trainer_restarts times). Groups in flight or sent after that checkpoint
        may hold tokens of versions the restored model never had: they are abandoned (they stay in the
        trajectory store, and in no ledger line) and their data positions run again."""
        cfg = self.cfg
        ckpt, restarts = self.ckpt, 0
        while True:
            try:
                return await self._async_segment(engine, worker, extra, ckpt, restore=restarts > 0)
            except TrainerDied as err:
                ckpt = latest_checkpoint(cfg.run_dir)
                where = f"its latest checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
                restarts += 1
                if restarts > cfg.runtime.max_trainer_restarts:
                    raise RunError(f"run error: the trainer process failed:\n{err}\nThe run folder "
                                   f"'{cfg.run_dir}' keeps everything up to the last checkpoint ({where}); "
                                   "continue with the same command and --resume") from None
                log.warning("the trainer process failed (%s); restarting it (%d of %d), %s", str(err).splitlines()[-1],
                            restarts, cfg.runtime.max_trainer_restarts, where)
                self.logger.rollback(checkpoint_step(ckpt) if ckpt else 0, "trainer_restart")
                self.trainer_restarts = restarts

    async def _async_segment(self, engine, worker: RolloutWorker, extra: dict[str, Any], ckpt: Path | None,
                             restore: bool) -> int:
        cfg = self.cfg
        if restore:
            repair_ledger_for_restart(cfg.run_dir, ckpt)
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        # trainer.world_size > 1: the follower ranks are the trainer's siblings, so that this process
        # sees them die (and stops the whole trainer, which then restarts) and cleans them up.
        followers = (spawn_local_followers(cfg, ckpt, follower_threads(cfg, async_threads(cfg)[1]))
                     if cfg.trainer.world_size > 1 else None)
        ranks = (followers.channels(), followers.port) if followers else None
        proc = ctx.Process(target=_trainer_main, name="loomrl-trainer", daemon=True,
                           args=(cfg.model_dump_json(), str(ckpt) if ckpt else None, extra, inbox, outbox, restore,
                                 ranks))
        proc.start()
        loop = asyncio.get_running_loop()
        messages: asyncio.Queue = asyncio.Queue()

        def pump() -> None:  # trainer process -> asyncio, on a thread so the loop never blocks
            while True:
                try:
                    msg = outbox.get(timeout=0.5)
                except queue.Empty:
                    if not proc.is_alive():
                        loop.call_soon_threadsafe(messages.put_nowait, ("error", exit_reason(proc.exitcode, "trainer process")))
                        return
                    why = followers.dead() if followers else None
                    if why:  # rank 0 may be waiting on it in a collective: the whole trainer restarts
                        proc.kill()
                        loop.call_soon_threadsafe(messages.put_nowait, ("error", why))
                        return
                    continue
                except Exception:  # noqa: BLE001 - e.g. a message that cannot be unpickled
                    loop.call_soon_threadsafe(messages.put_nowait, ("error", traceback.format_exc()))
                    return
                if msg[0] == "error" and followers is not None:
                    time.sleep(0.5)  # a dead follower reaches rank 0 as a failed collective: name it
                    why = followers.dead()
                    msg = ("error", f"{msg[1]}\n{why}") if why else msg
                loop.call_soon_threadsafe(messages.put_nowait, msg)
                if msg[0] in ("done", "error"):
                    return

        threading.Thread(target=pump, daemon=True, name="loomrl-trainer-pump").start()
        kind, version, received_state, *restored = await messages.get()
        if kind == "error":
            proc.join(timeout=10)
            if followers is not None:
                followers.stop()
            if restore:  # a restart that cannot even start counts against the restarts
                raise TrainerDied(f"trainer process failed to start: {version}")
            raise RunError(f"trainer process failed to start: {version}")
        # A restart rolls the engine back to the checkpoint's weights; a first start shares them already.
        try:
            engine.update_weights(load_weights(restored[0]).weights if restored else None, version)
        except BaseException:
            proc.kill()
            if followers is not None:
                followers.stop()
            raise
        engine_version = version  # the weights the engine holds: admission counts the lag from these
        received = PositionSet(received_state["watermark"], set(received_state["above"]))
        pos = positions_after(received)
        next_pos = next(pos)
        B, lag = cfg.trainer.groups_per_step, cfg.buffer.max_policy_lag
        inflight: dict[asyncio.Task, int] = {}
        bar = _progress(cfg.trainer.total_steps, "train (async)", cfg.progress)
        bar.update(version)
        recent: list = []
        getter: asyncio.Task | None = None
        engine_delta = EngineDelta(engine)
        # Backpressure, per step: seconds the rollout side had no group in flight (admission closed:
        # it waited for the trainer), groups launched, and the most in flight at once.
        idle_s, idle_since, launched, peak = 0.0, None, 0, 0
        step_started = time.perf_counter()
        try:
            while True:
                while admits(next_pos, version=engine_version, groups_per_step=B, max_lag=lag):
                    inflight[asyncio.ensure_future(worker.run_group(next_pos))] = next_pos
                    next_pos = next(pos)
                    launched += 1
                    if idle_since is not None:
                        idle_s += time.perf_counter() - idle_since
                        idle_since = None
                peak = max(peak, len(inflight))
                if getter is None:
                    getter = asyncio.ensure_future(messages.get())
                done, _ = await asyncio.wait([*inflight, getter], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is getter:
                        continue
                    position = inflight.pop(task)
                    group = task.result()
                    self.store.append(group)
                    recent.append(group)
                    inbox.put(("group", position, group))
                if not inflight and idle_since is None:
                    idle_since = time.perf_counter()
                if getter in done:
                    msg, getter = getter.result(), None
                    if msg[0] == "error":
                        raise TrainerDied(msg[1])
                    if msg[0] == "done":
                        version = msg[1]
                        break
                    _, version, handle, metrics = msg
                    try:
                        loaded = load_weights(handle)
                    except StaleWeights:  # newer versions were published meanwhile: the next message
                        loaded = None     # brings one; admission waits for it (engine_version)
                        log.warning("weights of version %d were freed before they were read", version)
                    if loaded is not None:
                        if cfg.runtime.interrupt_on_update:
                            engine.interrupt()  # in-flight turns resume under the new weights (AgentLoop._generate)
                        t_apply = time.perf_counter()
                        try:
                            engine.update_weights(loaded.weights, version)
                        except EngineFault as err:  # the trainer's own weights: retrying cannot help
                            raise RunError(f"run error: the engine could not load the weights of version "
                                           f"{version}: {err}") from None
                        engine_version = version
                        metrics.update(sync_metrics(handle, loaded))
                        metrics["weight_sync/apply_s"] = time.perf_counter() - t_apply  # into the engine
                    now = time.perf_counter()
                    if idle_since is not None:
                        idle_s, idle_since = idle_s + now - idle_since, now
                    metrics.update({"admission/launched_groups": launched, "admission/inflight_groups_max": peak,
                                    "admission/inflight_groups": len(inflight),
                                    # positions the rule still admits before the next weight update
                                    "admission/open_positions": open_positions(
                                        next_pos, version=version, groups_per_step=B, max_lag=lag),
                                    "time/step_s": now - step_started, "time/rollout_idle_s": idle_s,
                                    **engine_delta.take()})
                    idle_s, launched, peak, step_started = 0.0, 0, len(inflight), now
                    self._log_step(version, metrics, recent, worker)
                    recent = []
                    bar.update(1)
        finally:
            bar.close()
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            if getter is not None:
                getter.cancel()
            inbox.put(("stop",))
            self.store.flush()
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()  # SIGTERM first: its finally frees the published weights
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            if followers is not None:
                followers.stop()
        return version

    # -- entry ------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        runner = self._run_sync if self.cfg.runtime.mode == "sync" else self._run_async
        threads = torch.get_num_threads()
        try:
            result = asyncio.run(runner())
        finally:
            torch.set_num_threads(threads)  # a library call leaves the caller's setting as it was
            self.store.flush()
            self.logger.close()
        summary = {
            "success_before": result["before"]["success"] if result["before"] else None,
            "success_after": result["after"]["success"] if result["after"] else None,
            "n_heldout": (result["after"] or result["before"] or {}).get("n", 0),
            "stderr_before": result["before"]["stderr"] if result["before"] else None,
            "stderr_after": result["after"]["stderr"] if result["after"] else None,
            "steps": result["steps"],
            "run_dir": str(self.cfg.run_dir),
            "wall_s": round(time.time() - self.wall_start, 1),
            # launched = the sum of the ending statuses (completed, truncated, timeout, env_error, ...)
            "rollouts": result["rollouts"],
            "trainer_restarts": self.trainer_restarts,
            "env_pool": {k: round(v, 4) if isinstance(v, float) else v for k, v in result["env_pool"].items()},
        }
        (self.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _trainer_main(cfg_json: str, ckpt: str | None, extra: dict, inbox, outbox, restore: bool = False,
                  ranks: tuple | None = None) -> None:
    """Entry of the trainer process (async mode); `ranks`: the follower ranks' queues and port."""
    import signal
    import sys

    # SIGTERM (the rollout side giving up on us) unwinds through `finally`, which frees the weights.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    name_process("loomrl-trainer")
    publisher = None
    try:
        cfg = RunConfig.model_validate_json(cfg_json)
        torch.set_num_threads(async_threads(cfg)[1])
        ckpt_path = Path(ckpt) if ckpt else None
        model, tokenizer = build_model(cfg, ckpt_path)
        service = TrainerService(cfg, model, tokenizer, resume_from=ckpt_path)
        service.extra.update(extra)
        if ranks is not None:
            (inboxes, outboxes), port = ranks
            service.ranks = LocalRankGroup(service.trainer, cfg.trainer.world_size, inboxes, outboxes)
            service.ranks.join("127.0.0.1", port)
        # New weights reach the rollout process through runtime.weight_transport (weight_sync.py): a
        # small handle travels on the queue; the last few versions stay readable.
        folder = cfg.run_dir / "weights" if cfg.runtime.weight_transport == "file" else None
        publisher = make_publisher(cfg.runtime.weight_transport, keep=3, folder=folder)
        if restore:  # the rollout side holds newer weights than the checkpoint: send these with "ready"
            live = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
            outbox.put(("ready", service.version, service.received.state(), publisher.publish(live, service.version)))
        else:
            outbox.put(("ready", service.version, service.received.state()))
        while not service.done:
            msg = inbox.get()
            if msg[0] == "stop":  # the rollout side ended the run (e.g. it failed): nothing more to read
                return
            _, position, group = msg
            service.receive(position, group)
            while service.ready():
                metrics = service.train_step()
                live = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
                outbox.put(("weights", service.version, publisher.publish(live, service.version), metrics))
        outbox.put(("done", service.version))
        # Stay alive until the rollout side has read everything: the published versions (and
        # shared-memory tensors in our messages) are handed over through this process and vanish with it.
        while inbox.get()[0] != "stop":
            pass
    except BaseException:  # noqa: BLE001 - reported to the rollout process, which stops the run
        outbox.put(("error", traceback.format_exc()))
    finally:
        if publisher is not None:
            publisher.close()


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or a run folder's latest checkpoint."""
    ckpt = path if (path / "model").is_dir() else latest_checkpoint(path)
    if ckpt is None:
        raise RunError(f"error: '{path}' is neither a checkpoint folder nor a run folder with one")
    return ckpt


def evaluate_checkpoint(cfg: RunConfig, checkpoint: Path) -> dict[str, Any]:
    """Held-out success of a checkpoint folder (or a run folder: its latest checkpoint)."""
    ckpt = resolve_checkpoint(checkpoint)
    _, heldout = env_family(cfg.env.name).splits(cfg)
    model, tokenizer = build_model(cfg, ckpt)
    engine = make_engine(cfg, model, tokenizer, 0)
    worker = RolloutWorker(cfg, engine, ChatRenderer(tokenizer), heldout)
    try:
        bar = _progress(min(cfg.eval.n_tasks, len(heldout)), "eval", cfg.progress)

        async def run_eval() -> EvalResult:
            try:
                return await worker.evaluate(heldout[: cfg.eval.n_tasks], progress=bar)
            finally:
                await worker.aclose()

        try:
            res = asyncio.run(run_eval())
        finally:
            bar.close()
    finally:
        engine.close()
    return {"checkpoint": str(ckpt), **_eval_record(res)}


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
