"""The driver: one loop for every run, over three parts that hold only placement and transport (runtime/parts.py:
Rollouts, Trainer, WeightRoute).

The driver owns what a run decides:
- admission (bounded staleness, buffer/admission.py): the group at data position p is launched only
  while p // groups_per_step - version <= max_lag (buffer.max_policy_lag; 0 in sync mode, so a step's
  groups are sampled by the current policy and training never overlaps generation);
- data positions: a resumed or restarted run goes on from the positions its trainer has not received;
- retries: an attempt whose rollout worker died (RolloutLost) runs again after
  runtime.retry_backoff_s x 2^k, at most runtime.max_group_attempts times in all, then the position is
  recorded as failed; rollout workers replaced more than ray.rollout.max_restarts times stop the run;
- the trainer-restart policy: a trainer that dies (TrainerLost) is restarted from the run folder's
  latest checkpoint at most runtime.max_trainer_restarts times; groups it received after that
  checkpoint, and attempts still in flight, may hold tokens of versions the restored model never had:
  the first are discarded (reason trainer_restart), the others cancelled, and their positions run
  again with the restored weights;
- step metrics, eval before and after, the summary, and the accounting identity (accounting.py):
  every trajectory launched ends in exactly one fate, checked against the ledger at the end;
- what stops the run: the parts report failures as typed facts (runtime/failures.py) and only the driver turns one
  into RunError: an engine that cannot serve the run's weights, a part that cannot start, a trainer past its
  restarts or one that cannot be restarted.

The parts run attempts, train and move weights: runtime/local.py (this process, and a trainer process in async
mode) and runtime/ray_backend.py (actors); runtime/run.py make_parts composes them once per run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loomrl.config import RunConfig
from loomrl.errors import error_line
from loomrl.metrics import open_metrics
from loomrl.metrics.sink import SinkError
from loomrl.rollout.worker import group_summary
from loomrl.run_folder import RunFolder, Summary, read_ledger, write_summary
from loomrl.runtime.accounting import Accounting, ledger_line
from loomrl.runtime.failure_watch import FailureWatch, failed_step
from loomrl.runtime.failures import CannotStart, EngineLost, Fact, RolloutLost, RunError, TrainerLost
from loomrl.runtime.group_log import GroupLog
from loomrl.runtime.interrupt import interrupted, interruptible
from loomrl.runtime.parts import Parts, RolloutReport, TrainerState
from loomrl.runtime.positions import PositionBook, StepWindow
from loomrl.runtime.reproducibility import not_reproducible
from loomrl.runtime.summary import FINISHED, Segment, append_segment, whole_run
from loomrl.store import TrajectoryStore
from loomrl.trainer.checkpoint import checkpoint_step, latest_checkpoint, load_state
from loomrl.trainer_boundary import Carried, TrainStep
from loomrl.types import EvalRecord, Trajectory

log = logging.getLogger("loomrl")


SETTLE_TIMEOUT_S = 300.0  # the longest the run waits, at its end, for the last version to be loaded

UNTRAINED_HINT = ("A group takes a gradient only when its rollouts' rewards differ: zero_variance means every rollout "
                  "of each group scored the same (check that the reward, reward.function or the task's verifier, "
                  "gives this policy some successes: `loomrl eval` on the recipe shows its held-out success), "
                  "incomplete that too few of a group's rollouts could be scored (see rollout/status_* in "
                  "metrics.jsonl).")


def stop_message(fact: Fact) -> str:
    """The one line (or lines) a run stops with when a fact reaches the top of the driver."""
    if isinstance(fact, TrainerLost):
        return f"run error: {fact}; continue with the same command and --resume"
    if isinstance(fact, (CannotStart, EngineLost, RolloutLost)):
        return f"run error: {fact}"
    return f"run error: {type(fact).__name__}: {fact}"


def store_episodes(episodes: list[Trajectory], folder: Path) -> None:
    """An evaluation's episodes in a trajectory store of their own (one evaluated again starts it anew)."""
    shutil.rmtree(folder, ignore_errors=True)
    store = TrajectoryStore(folder)
    store.append(episodes)
    store.flush()


def checked_eval(record: EvalRecord, label: str) -> EvalRecord:
    """The record, unless none of its episodes could be scored: then the evaluation says nothing of the policy,
    and the run stops with one line saying how they ended and the first error (never a success rate of 0)."""
    if record.n == 0 and record.statuses:
        ended = ", ".join(f"{k} {v}" for k, v in sorted(record.statuses.items()))
        if record.first_error and "\n" in record.first_error:  # where it was raised: above the one line
            log.warning("evaluation %s: the first error:\n%s", label, record.first_error)
        raise RunError(f"run error: evaluation {label}: none of the {sum(record.statuses.values())} held-out episodes "
                       f"could be scored ({ended}); the first error: {error_line(record.first_error or '')}")
    return record


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One line per step for a run with no progress bar to watch: reward over the scored trajectories, the loss (or
    why none), and where the time went."""
    scored, trajs = metrics.get("rollout/scored", 0), metrics.get("rollout/trajectories", 0)
    reward = f"reward {metrics['rollout/reward_mean']:.3f}" if "rollout/reward_mean" in metrics else "no reward"
    loss = f"loss {metrics['train/loss']:.4g}" if "train/loss" in metrics else "trained nothing"
    return (f"step {step}/{total}: {reward} ({scored:g} of {trajs:g} trajectories scored), {loss}; "
            f"{metrics.get('time/step_s', 0.0):.1f} s (training {metrics.get('time/train_s', 0.0):.1f} s)")


def eval_line(record: EvalRecord) -> str:
    """Held-out success over the scored episodes, by split, and how many were not scored, by status."""
    unscored = record.unscored
    failed = (f"; not scored: {sum(unscored.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(unscored.items()))
              + ")") if unscored else ""
    return (f"{record.success:.3f} ± {record.stderr:.3f} (n={record.n})"
            + "".join(f"; {k} {v.success:.3f} ± {v.stderr:.3f} (n={v.n})" for k, v in record.splits.items()) + failed)


@dataclass(slots=True)
class Attempt:
    position: int
    serial: int  # the position's live attempt is the one whose serial Driver.live holds


def progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


class Driver:
    def __init__(self, cfg: RunConfig, parts: Parts, checkpoint, wall_start: float):
        self.cfg, self.ckpt, self.wall_start = cfg, checkpoint, wall_start
        self.rollouts, self.trainer, self.weights = parts.rollouts, parts.trainer, parts.weights
        try:  # the driver logs every record, on the local and the Ray backend alike
            self.logger = open_metrics(cfg.run_dir, cfg.metrics, run_name=cfg.name,
                                       run_config=cfg.model_dump(mode="json"))
        except SinkError as err:
            raise RunError(f"run error: {err}") from None
        if checkpoint is not None:
            self.logger.rollback(checkpoint_step(checkpoint), "resume")
        self.store = TrajectoryStore(RunFolder(cfg.run_dir).trajectories)
        self.group_log = GroupLog(cfg.run_dir)  # each group's lifecycle, for `loomrl view`'s timeline
        self.acc = Accounting()
        self.B, self.G = cfg.trainer.groups_per_step, cfg.trainer.group_size
        self.lag = 0 if cfg.runtime.mode == "sync" else cfg.buffer.max_policy_lag
        self.version = 0
        self.inflight: dict[asyncio.Future, Attempt] = {}
        # one record per data position (attempts, retries, given up, ids sent) and the admission rule: positions.py
        self.book = PositionBook(self.B, self.lag, cfg.trainer.total_steps)
        self.window = StepWindow()  # this step's clock and counters
        self.serials = itertools.count()
        self.abandoned: list[asyncio.Future] = []  # attempts cancelled at a trainer restart, awaited at the end
        self.trainer_restarts = 0
        self.rollout_replacements = 0  # rollout workers replaced (RolloutLost.replaced)
        self.untrained_steps = 0  # steps of this segment whose groups all were left out (no gradient)
        self.before: EvalRecord | None = None  # held-out success before training (restored on resume)
        self.after: EvalRecord | None = None
        self.report: RolloutReport | None = None  # what the rollout side said when it closed
        self.failures = FailureWatch()  # the first error of each kind is logged as it arrives

    # -- the trainer --------------------------------------------------------------------------------
    async def _start_trainer(self, carried: Carried) -> TrainerState:
        # Colocated: the engines started first and hold the GPU; they sleep while the trainer loads onto it, publishes
        # its first version and moves its state to host memory (train_pool/offload.py), then wake and load that version.
        colocated = self.cfg.engine.sleep_while_training
        if colocated:
            await self.rollouts.sleep()
        try:
            state = await self.trainer.start(carried)
        finally:
            if colocated:
                await self.rollouts.wake()
        # Groups sent to a trainer that no longer holds them are discarded; attempts in flight may hold tokens of
        # versions the restored trainer never had: cancelled (ones that already finished are discarded as they are
        # settled); every position it has not received runs again, in order.
        for ids in self.book.restart(state.received):
            self.acc.discard(ids, "trainer_restart")
        for fut in [f for f in self.inflight if not f.done()]:
            del self.inflight[fut]
            self.abandoned.append(self._cancel(fut))
        self.version = state.version
        await self.weights.publish(self.version, state.weights)
        return state

    async def _restart_trainer(self, err: TrainerLost, carried: Carried) -> None:
        """After TrainerLost: a fresh trainer from the latest checkpoint, or RunError past the limit."""
        self.trainer_restarts += 1
        limit = self.cfg.runtime.max_trainer_restarts
        ckpt = latest_checkpoint(self.cfg.run_dir)
        where = f"its latest checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
        if self.trainer_restarts > limit:
            raise RunError(f"run error: the trainer failed:\n{err}\nThe run folder '{self.cfg.run_dir}' keeps "
                           f"everything up to the last checkpoint ({where}); continue with the same command and "
                           "--resume") from None
        log.warning("the trainer failed (%s); restarting it (%d of %d), %s", error_line(err, end=True),
                    self.trainer_restarts, limit, where)
        self.trainer.stop()
        reported = self.version
        state = await self._start_trainer(carried)
        self.logger.rollback(self.version, "trainer_restart")
        if self.version > reported and state.metrics is not None:
            # it died after checkpointing a step, before reporting it: that step's metrics come from there
            self.logger.log(self.version, {**state.metrics, "runtime/metrics_from_checkpoint": 1})

    # -- attempts -----------------------------------------------------------------------------------
    def _dispatch(self, pos: int) -> None:
        a = Attempt(pos, next(self.serials))
        self.book.dispatched(pos, a.serial)
        self.inflight[self.rollouts.dispatch(pos)] = a
        self.group_log.launched(a.serial, self.version)
        self.acc.launched += self.G
        self.window.launch()

    def _admit(self) -> None:
        for pos in self.book.due():
            self._dispatch(pos)
        while self.book.admits_next(self.version):  # the rule: positions.py, buffer/admission.py
            self._dispatch(self.book.take_next())
        self.window.in_flight(len(self.inflight))

    def _replaced(self, err: RolloutLost) -> None:
        """Count a rollout worker the rollout side replaced; past ray.rollout.max_restarts (e.g. an actor that dies as it
        starts, every time) the run stops."""
        if not err.replaced:
            return
        self.rollout_replacements += 1
        if self.rollout_replacements > self.cfg.ray.rollout.max_restarts:
            raise RunError(f"run error: rollout workers died {self.rollout_replacements} times (last: {err}); see the "
                           "logs of the rollout nodes (ray.rollout.max_restarts), then continue with --resume")

    def _lost(self, a: Attempt, err: RolloutLost) -> None:
        self.acc.failed["actor_died"] += self.G  # the group's trajectories died with their worker
        self.group_log.ended(a.serial, a.position, self.book.attempts(a.position), "lost")
        self._replaced(err)  # counted first: a run this stops still gives each trajectory its fate
        if not self.book.is_live(a.position, a.serial):
            return  # superseded (trainer restart): the position runs again anyway
        rt = self.cfg.runtime
        if not self.book.lost(a.position, max_attempts=rt.max_group_attempts, backoff_s=rt.retry_backoff_s,
                              why=str(err)):
            log.warning("position %d failed %d times; recorded as failed", a.position, self.book.attempts(a.position))

    def _keep(self, group: list[Trajectory]) -> None:
        """Count and store a returned group (the trainer may or may not get it)."""
        self.acc.returned.update(t.trajectory_id for t in group)
        self.store.append(group)
        for line in [*self.failures.first_errors(group), *self.failures.tool_warnings(group)]:
            log.warning(line)

    async def _arrived(self, a: Attempt, group: list[Trajectory]) -> bool:
        """Store a returned group; send it to the trainer unless it was superseded."""
        ids = [t.trajectory_id for t in group]
        self._keep(group)  # stored first: whatever happens next, it is on disk
        attempt = self.book.attempts(a.position)
        if not self.book.is_live(a.position, a.serial):
            self.acc.discard(ids, "trainer_restart")
            self.group_log.ended(a.serial, a.position, attempt, "superseded", group)
            return False
        self.book.arrived(a.position)
        if max((t.metadata.policy_version_max for t in group), default=-1) > self.version:
            # sampled by weights the trainer no longer has (a rollback raced this group): never train it
            self.acc.discard(ids, "newer_than_trainer")
            self.book.give_up(a.position, "newer_than_trainer")
            self.group_log.ended(a.serial, a.position, attempt, "superseded", group)
            return False
        self.group_log.ended(a.serial, a.position, attempt, "arrived", group)
        self.book.sent(a.position, ids)
        await self.trainer.receive(a.position, group)
        return True

    async def _settle(self, done: set[asyncio.Future], recent: list) -> None:
        for fut in done:
            a = self.inflight.pop(fut)
            err = fut.exception()
            if isinstance(err, RolloutLost):
                self._lost(a, err)
            elif err is not None:  # the run stops (a fact the driver turns into RunError, or a bug)
                self.acc.failed["rollout_error"] += self.G
                self.group_log.ended(a.serial, a.position, self.book.attempts(a.position), "lost")
                raise err
            elif await self._arrived(a, fut.result()):
                recent.append(fut.result())
        self.window.in_flight(len(self.inflight))

    # -- the loop -----------------------------------------------------------------------------------
    async def _wait(self) -> set[asyncio.Future]:
        """The attempts that ended (none: a retry is due)."""
        due = self.book.next_retry_in()
        if not self.inflight:
            if due is None:
                raise RunError(f"run error: nothing in flight at version {self.version} and nothing to retry; "
                               "every position of the step failed")
            await asyncio.sleep(due)
            return set()
        done, _ = await asyncio.wait(list(self.inflight), timeout=due, return_when=asyncio.FIRST_COMPLETED)
        return done

    async def _take_steps(self, recent: list, bar) -> None:
        """Every step the trainer can take now: train, publish the weights, log the step. The next
        step is asked for before the weights travel, so that the trainer works while engines load them."""
        total = self.cfg.trainer.total_steps
        colocated = self.cfg.engine.sleep_while_training  # the engines' memory goes to each step
        step: asyncio.Future | None = None
        try:
            while self.version < total:
                t0 = time.perf_counter()
                if colocated:
                    if not await self.trainer.has_step():
                        return
                    await self.rollouts.sleep()
                    try:
                        done = await self.trainer.train_step()
                    finally:
                        await self.rollouts.wake()
                else:
                    step = step or asyncio.ensure_future(self.trainer.train_step())
                    done, step = await step, None
                if done is None:
                    return
                self.window.train_s += time.perf_counter() - t0
                self.version += 1
                self.book.stale += done.groups_stale  # each frees its position's place
                # the next step is asked for before the weights travel (lag 0: its groups are not launched yet)
                if self.version < total and self.lag > 0 and not colocated:
                    step = asyncio.ensure_future(self.trainer.train_step())
                await self.weights.publish(self.version, done.weights)
                self._log_step(done, recent, bar)
                self._admit()  # what the new version admits generates while the next step trains
        finally:
            if step is not None:  # an error ends the run or restarts the trainer: its answer is not needed
                step.cancel()

    def _log_step(self, done: TrainStep, recent: list, bar) -> None:
        metrics: dict[str, float] = {
            **done.metrics, **self.window.close(len(self.inflight)),
            # positions the rule still admits before the next weight update
            "admission/open_positions": self.book.open(self.version),
            "runtime/trainer_restarts": self.trainer_restarts, **group_summary(recent),
            **self.rollouts.step_metrics(), **self.weights.step_metrics()}
        self.logger.log(self.version, metrics)
        if not self.cfg.progress or not sys.stderr.isatty():  # no bar to watch (progress=false, a log file)
            log.info(step_line(self.version, self.cfg.trainer.total_steps, metrics))
        self._say_if_untrained(done.trained, metrics)
        failed = None if self.cfg.runtime.tolerate_failed_steps else failed_step(recent, self.version)
        recent.clear()
        if failed is not None:
            raise RunError(failed)
        bar.update(1)
        if "rollout/reward_mean" in metrics:  # absent when no trajectory of the step's groups was scored
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")

    def _say_if_untrained(self, trained: bool, metrics: dict[str, float]) -> None:
        """Warn, at the first step that took no gradient, why (its groups' skip reasons: groups, where the ledger
        counts trajectories); count such steps."""
        if trained:
            return
        self.untrained_steps += 1
        if self.untrained_steps > 1:
            return
        why = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in metrics.items() if k.startswith("groups_skipped/"))
        log.warning("step %d trained nothing: all %d of its groups were left out (groups by reason: %s; ledger.jsonl "
                    "names each trajectory and its reason). %s", self.version, metrics.get("groups", 0),
                    why or "none buffered", UNTRAINED_HINT)

    async def _loop(self, carried: Carried) -> None:
        bar = progress(self.cfg.trainer.total_steps, f"train ({self.rollouts.label})", self.cfg.progress)
        bar.update(self.version)
        recent: list = []
        self.window = StepWindow()
        lost: TrainerLost | None = None
        try:
            while self.version < self.cfg.trainer.total_steps:
                try:
                    if lost is not None:  # a restart that fails as it starts counts as one more
                        err, lost = lost, None
                        await self._restart_trainer(err, carried)
                        bar.n = self.version
                        bar.refresh()
                    self._admit()
                    await self._settle(await self._wait(), recent)
                    await self._take_steps(recent, bar)
                except TrainerLost as err:
                    if not err.restartable:
                        raise
                    lost = err
        finally:
            bar.close()  # before an error's message, not after it

    def _cancel(self, fut: asyncio.Future) -> asyncio.Future:
        fut.cancel()
        self.acc.cancelled += self.G
        return fut

    def _end_inflight(self) -> list[asyncio.Future]:
        """The run is over: attempts that finished are stored (not trained), the others cancelled."""
        finished = [f for f in self.inflight if f.done() and not f.cancelled() and f.exception() is None]
        for fut in finished:
            self._keep(fut.result())
            a = self.inflight[fut]
            self.group_log.ended(a.serial, a.position, self.book.attempts(a.position), "unconsumed", fut.result())
        cancelled = [self._cancel(f) for f in self.inflight if f not in finished]
        self.inflight.clear()
        return cancelled

    async def _evaluate(self, label: str, step: int) -> EvalRecord | None:
        cfg = self.cfg
        if not cfg.eval.n_tasks or not (cfg.eval.before if label == "before" else cfg.eval.after):
            return None
        for _ in range(cfg.runtime.max_group_attempts):
            try:
                evaluation = await self.rollouts.evaluate(label)
                break
            except RolloutLost as err:  # the worker died: try again
                self._replaced(err)
        else:
            log.warning("eval %s: the rollout worker kept dying; no result", label)
            return None
        store_episodes(evaluation.episodes, RunFolder(self.cfg.run_dir).evaluation(label, step))
        record = checked_eval(evaluation.record, f"{label} training")
        by_split = {f"eval/{split}/{k}": v for split, score in record.splits.items() for k, v in asdict(score).items()}
        ended = {f"eval/ended/{k}": v for k, v in record.statuses.items()}
        self.logger.log(step, {"eval/success": record.success, "eval/n": record.n, "eval/stderr": record.stderr,
                               **by_split, **ended}, kind=f"eval_{label}")
        log.info("held-out success %s: %s", label, eval_line(record))
        return record

    async def _interruptible_segment(self) -> None:
        with interruptible():  # a stop signal cancels this task, also where SIGINT is ignored (runtime/interrupt.py)
            await self._segment()

    async def _segment(self) -> None:
        carried = Carried.from_json(load_state(self.ckpt).get("extra")) if self.ckpt else Carried()
        try:
            await self.rollouts.start()
            self.before = carried.eval_before  # a resumed run's, taken when it began
            if self.before is None:
                self.before = await self._evaluate("before", 0)
                carried = Carried(eval_before=self.before)
            try:
                await self._start_trainer(carried)
            except TrainerLost as err:
                raise RunError(f"run error: the trainer failed to start:\n{err}") from None
            await self._loop(carried)
            await asyncio.gather(*self._end_inflight(), return_exceptions=True)
            # the last version may still be on its way (a broadcast from the trainer's process): it must arrive
            # before the trainer stops, with or without an evaluation to use it
            await self.weights.settle(SETTLE_TIMEOUT_S)
            self.after = await self._evaluate("after", self.version)
        finally:
            try:
                await asyncio.gather(*self._end_inflight(), *self.abandoned, return_exceptions=True)
            finally:  # a cancel landing in the gather (a second signal while unwinding) still stops both sides
                self.trainer.stop()
                self.report = await self.rollouts.close()

    def run(self) -> Summary:
        """Run this segment; the whole run's summary (also RUN/summary.json). However the segment ends, its record
        is kept (summary.py) and the summary rewritten, before an error goes on up."""
        ended = "interrupted"  # Ctrl-C, SIGTERM, a crash: anything the driver does not stop on purpose
        try:
            try:
                asyncio.run(self._interruptible_segment())
            except asyncio.CancelledError:
                if not interrupted():
                    raise
                raise KeyboardInterrupt from None  # a stop signal cancelled it (runtime/interrupt.py), as Ctrl-C does
            except Fact as fact:  # what no rule above handles stops the run (the fact's own cause kept, if any)
                raise RunError(stop_message(fact)) from fact.__cause__
            ended = FINISHED
        except RunError as err:
            ended = f"stopped: {error_line(err)}"
            raise
        finally:
            self.store.flush()
            self.logger.close()
            try:
                summary = self._summarize(ended)
            except Exception:
                if ended == FINISHED:
                    raise
                log.exception("could not write the run's summary (the run's own error follows)")
        return summary

    def _summarize(self, ended: str) -> Summary:
        ledger = read_ledger(self.cfg.run_dir)
        acc = self.acc.settle(ledger)
        log.info(ledger_line(acc))
        start = checkpoint_step(self.ckpt) if self.ckpt else 0
        if self.untrained_steps:  # counted in steps; the ledger line above counts trajectories
            log.warning("%s%d of the %d steps of this run trained nothing (every group of theirs left out; in "
                        "trajectories, as the ledger counts them: %d launched, %d trained, %d skipped). %s",
                        "NOTHING WAS TRAINED: " if self.untrained_steps >= self.version - start else "",
                        self.untrained_steps, self.version - start, acc.launched, acc.trained,
                        sum(acc.skipped.values()), UNTRAINED_HINT)
        report = self.report or RolloutReport(rollouts={}, env_pool={})
        segment = Segment(from_step=start, to_step=self.version, ended=ended,
                          wall_s=round(time.time() - self.wall_start, 1), rollouts=report.rollouts,
                          trainer_restarts=self.trainer_restarts, untrained_steps=self.untrained_steps,
                          positions_failed={str(k): v for k, v in self.book.given_up().items()}, env_pool=report.env_pool,
                          accounting=acc, extra=report.extra)
        segments = append_segment(self.cfg.run_dir, segment)
        # a step the trainer took and logged (ledger) before an interrupt reached the driver counts as taken
        steps = max(self.version, max((entry.step for entry in ledger), default=0))
        summary = whole_run(self.cfg.run_dir, segments, self.before, self.after, steps, ledger)
        summary.not_reproducible = not_reproducible(self.cfg) + (
            ["resumed: a resumed run is not checked against one that ran through"] if len(segments) > 1 else [])
        write_summary(self.cfg.run_dir, summary)
        return summary
