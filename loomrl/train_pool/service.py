"""TrainerService: the training pool. Owns the Buffer, the Trainer, the trained-trajectory ledger and
checkpoints. It runs in the rollout's process (sync mode) or in its own process (async mode); either
way it is fed groups with their data positions and answers with new weights and metrics. A step (run_step) composes
selection.py (what the step's groups give the trainer, the lag decay, the consumption metrics), the Trainer's step,
the ledger line and the train records, and returns a typed TrainStep (trainer_boundary.py), which the runtime's
Trainer hands to the driver.

Ledger (RUN/ledger.jsonl): one line per training step naming every trajectory it consumed, by fate
(trained, skipped with reason, dropped as stale). On resume the lines after the checkpoint's step are
cut, so the ledger always equals what the saved model has seen. Next to it, RUN/train_records.jsonl (records.py):
per trajectory trained, the advantages it was trained with and its engine-vs-trainer logprob gap per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loomrl.buffer import Buffer
from loomrl.buffer.buffer import group_min_version
from loomrl.config import TrainPoolConfig
from loomrl.run_folder import LedgerEntry, RunFolder, append_line
from loomrl.train_pool.distributed import Gather
from loomrl.train_pool.offload import Moved, offload, onload
from loomrl.train_pool.ranks import RankGroup, RankModel, Reference, build_trainer, load_rank
from loomrl.trainer.adapter_publish import AdapterSource
from loomrl.trainer.checkpoint import Retention, RngState, load_state, save_checkpoint
from loomrl.trainer.credit import AdvantageRule, GroupCredit
from loomrl.trainer.records import append_records, cut_records, cut_to_step, train_records
from loomrl.trainer.selection import Selection, balance, consumption_metrics, lag_weighted, select_groups
from loomrl.trainer.trainer import StepStats
from loomrl.trainer_boundary import Carried, PositionSet, PositionState, TrainStep
from loomrl.types import TrainingSample, Trajectory
from loomrl.weights.source import DictSource, WeightSource, dtype_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The checkpoint's model folder is written a file per bucket of this size (HF's own default shard size is 5 GB).
CHECKPOINT_BUCKET_BYTES = 2 << 30


def repair_ledger_for_restart(run_dir: Path, checkpoint: Path | None) -> None:
    """Before a trainer restarts after a crash with no checkpoint: the model starts over, and so do its ledger and
    train records. From a checkpoint, TrainerService cuts both back to its step (a last line torn by the kill with
    them: that step was logged before its checkpoint was written, so it is undone anyway)."""
    if checkpoint is None:
        cut_to_step(RunFolder(run_dir).ledger, None)
        cut_records(run_dir, None)


def advantage_metrics(samples: list[TrainingSample], credits: list[GroupCredit], rule: AdvantageRule,
                      ) -> dict[str, float]:
    """What the advantage options did this step: the mean |advantage| over the sampled tokens trained (after the
    balance filter and the lag decay), the trained groups' mean scale (what their centred returns were divided by),
    how many of them the std floor set, and under turn credit how many turns fell back to the others' returns."""
    trained = [abs(a) for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    out = {"advantage/abs_mean": sum(trained) / len(trained) if trained else 0.0,
           "advantage/scale_mean": sum(c.scale for c in credits) / len(credits) if credits else 0.0}
    if rule.norm == "std_floor":
        out["advantage/groups_floored"] = sum(c.floored for c in credits)
    if rule.credit == "turn":
        out["advantage/fallback_turns"] = sum(c.fallback_turns for c in credits)
    return out


class TrainerService:
    def __init__(self, pool: TrainPoolConfig, model: PreTrainedModel, tokenizer: Any, resume_from: Path | None = None,
                 ranks: RankGroup | None = None, *, device: torch.device, own_model: bool = False,
                 reference: Reference | None = None):
        """`model` trains on `device` (trainer.device, resolved once by the process that builds the pool). `ranks`
        (trainer.distributed): the other ranks, in the process group already. `own_model`: `model` is this service's
        alone (from_run); False: sync mode's built-in engine runs it too. `reference`: KL's, read before joining the
        ranks (ranks.py load_rank; None: read here)."""
        if pool.trainer.lora is not None and not own_model:
            # the engine packs each linear's .weight, which under LoRA is the base's: it would never see the adapter
            raise ValueError("trainer.lora needs runtime.mode=async: in sync mode the built-in engine runs the "
                             "trainer's own model, and the adapters would not reach it")
        self.pool = pool
        self.run_dir = Path(pool.run_dir)
        self.model = model
        self.tokenizer = tokenizer
        self.trainer = build_trainer(pool.trainer, pool.model, device, model, resume_from, reference)
        self.ranks = ranks
        if ranks is not None:
            ranks.attach(self.trainer)
        self.buffer = Buffer(pool.buffer.max_policy_lag, pool.buffer.sampler, pool.buffer.window)
        self.received = PositionSet()
        self.carried = Carried()  # runtime facts to carry across resume (e.g. eval before)
        # the metrics of the step the latest checkpoint was taken at: a trainer that dies after writing
        # it but before reporting the step gives them to the driver when it restarts from it
        self.last_metrics: dict[str, float] | None = None
        self.ledger_path = RunFolder(self.run_dir).ledger
        if resume_from is not None:
            state = load_state(resume_from)
            self.received = PositionSet.of(PositionState.from_json(state["received"]))
            waiting = {t.position for g in state["buffer"]["groups"] for t in g}
            self.buffer.load_state_dict(state["buffer"], skip=lambda p: p in self.received and p not in waiting)
            self.carried = Carried.from_json(state.get("extra"))
            self.last_metrics = state.get("metrics")
            RngState.from_json(state["rng"]).restore()
            cut_to_step(self.ledger_path, state["step"])
            cut_records(self.run_dir, state["step"])

    @classmethod
    def from_run(cls, pool: TrainPoolConfig, carried: Carried, checkpoint: Path | None, device: torch.device,
                 ranks: RankGroup | None = None, rendezvous: tuple[str, int] | None = None,
                 loaded: RankModel | None = None) -> TrainerService:
        """A trainer of its own (async or Ray) from `checkpoint` (the run folder's latest; None: the
        configured model), after repairing a ledger torn by a crash. `carried`: runtime facts the
        checkpoint does not have yet (e.g. eval before). `ranks` (trainer.distributed), not joined yet: this rank joins
        them at `rendezvous` (address, port) once its model is read, and tells the followers to join then (ranks.py
        RankModel). `loaded`: what `load` read already (None: read here). `device`: trainer.device as the calling
        process resolved it (its entry: the trainer process, the trainer actor)."""
        loaded = loaded if loaded is not None else cls.load(pool, checkpoint, device)
        if ranks is not None:
            if rendezvous is None:
                raise ValueError("TrainerService.from_run: ranks need the rendezvous (address, port) to join them at")
            ranks.join(*rendezvous)
        service = cls(pool, loaded.model, loaded.tokenizer, resume_from=checkpoint, ranks=ranks, device=device,
                      own_model=True, reference=loaded.reference)
        service.carried = service.carried.filled_from(carried)
        return service

    @staticmethod
    def load(pool: TrainPoolConfig, checkpoint: Path | None, device: torch.device) -> RankModel:
        """Rank 0's model, tokenizer and KL reference from `checkpoint` (float32 on trainer.device; several FSDP2
        ranks: in the checkpoint's own precision on the CPU, sharded before it goes there), after repairing a ledger
        torn by a crash."""
        repair_ledger_for_restart(Path(pool.run_dir), checkpoint)
        return load_rank(pool, checkpoint, device, rank0=True)

    @property
    def version(self) -> int:
        return self.trainer.step

    @property
    def done(self) -> bool:
        return self.trainer.step >= self.pool.trainer.total_steps

    def receive(self, position: int, group: list[Trajectory]) -> None:
        if position in self.received:
            raise RuntimeError(f"group at position {position} received twice")
        self.buffer.put(group, position, skip=lambda p: p in self.received)  # received before: consumed already
        self.received.add(position)

    def has_step(self) -> bool:
        return not self.done and self.buffer.takeable() >= self.pool.trainer.groups_per_step

    def run_step(self) -> TrainStep:
        """Consume one step's groups, update the policy (when any group has signal), log the ledger."""
        version, depth = self.version, len(self.buffer)
        groups, stale = self.buffer.take(self.pool.trainer.groups_per_step, version)
        rule = AdvantageRule.of(self.pool.trainer)
        chosen = select_groups(groups, self.pool.buffer, self.pool.trainer.count_idle_groups, rule)
        if self.pool.buffer.balance_max_ratio is not None and chosen.samples:
            balance(chosen, self.pool.buffer.balance_max_ratio, seed=version)
        staleness = [version - group_min_version(g) for g in groups if group_min_version(g) >= 0]
        metrics = consumption_metrics(groups, stale, depth, chosen.why_skipped, self.buffer.last_waits, staleness)
        samples, downweighted = lag_weighted(chosen.samples, version, self.pool.buffer.lag_decay)
        if downweighted:
            metrics["samples_downweighted"] = downweighted
        stats = self._train(samples, chosen, rule, metrics)
        metrics["staleness_max"] = max(staleness) if staleness else 0
        stale_ids = [t.trajectory_id for g in stale for t in g]
        append_line(self.ledger_path, LedgerEntry(step=self.version, trained=chosen.trained, skipped=chosen.skipped,
                                                  stale=stale_ids))
        if stats is not None:
            kept = set(chosen.trained)  # the balance filter may have left some out
            trajectories = [t for t in chosen.trajectories if t.trajectory_id in kept]
            append_records(self.run_dir, train_records(self.version, trajectories, samples, stats.gaps))
        every = self.pool.checkpoint_every
        if (every and self.version % every == 0) or self.done:
            self.last_metrics = metrics
            self.checkpoint()
        return TrainStep(version=self.version, trained=stats is not None, metrics=metrics, groups_stale=len(stale))

    def _train(self, samples: list[TrainingSample], chosen: Selection, rule: AdvantageRule,
               metrics: dict[str, float]) -> StepStats | None:
        """One optimizer step on `samples` (on every rank), its metrics added to `metrics`; without samples, a step
        with no signal, which still consumes its groups and advances the schedule (None)."""
        if not samples:
            (self.ranks or self.trainer).skip_step()
            return None
        metrics.update(advantage_metrics(samples, chosen.credits, rule))
        step = self.ranks.train_step if self.ranks else self.trainer.train_step
        stats = step(samples, idle_tokens=chosen.idle_tokens, idle_seqs=chosen.idle_seqs,
                     idle_longest=chosen.idle_longest)
        metrics["train/idle_tokens"] = chosen.idle_tokens
        metrics.update({f"train/{k}": v for k, v in stats.metrics().items()})
        return stats

    def checkpoint(self) -> Path:
        state = {"buffer": self.buffer.state_dict(), "received": self.received.state().as_json(),
                 "extra": self.carried.as_json(), "metrics": self.last_metrics}
        ranks = self.ranks if self.trainer.sharded else None
        model_folder = ranks.gathered(Gather(None, CHECKPOINT_BUCKET_BYTES, everything=True)) if ranks else None
        lora = self.trainer.lora
        return save_checkpoint(self.run_dir, self.version, model=self.model, tokenizer=self.tokenizer,
                               optimizer=self.trainer.optimizer, scheduler=self.trainer.scheduler, state=state,
                               retention=Retention(self.pool.checkpoint_keep, self.pool.checkpoint_keep_optimizer),
                               weights=model_folder, shards=ranks.save_shards if ranks else None,
                               adapter=lora.save if lora is not None else None)

    def offload(self) -> Moved:
        """The trainer's state to host memory on every rank (colocated engines: train_pool/offload.py)."""
        return self.ranks.offload() if self.ranks else offload(self.trainer)

    def onload(self) -> Moved:
        """The trainer's state back on every rank's GPU, for a step."""
        return self.ranks.onload() if self.ranks else onload(self.trainer)

    def weight_source(self, dtype: torch.dtype | None, bucket_bytes: int) -> WeightSource:
        """The parameters that training changes (frozen ones never need resending), in `dtype` (the engine's), a
        bucket at a time: the live parameters, cast as they are read (no copy where the dtype matches: a publisher
        copies them out before the next step changes them), or, sharded, gathered by every rank a bucket at a time.
        Under trainer.lora: the adapter's tensors alone, named as this version's adapter (publish=adapter:
        trainer/adapter_publish.py), or the targeted linears' merged weights (publish=merged: trainer/lora.py
        MergedSource)."""
        lora = self.trainer.lora
        if lora is not None:
            if self.pool.trainer.lora is not None and self.pool.trainer.lora.publish == "adapter":
                return AdapterSource(lora, self.version, dtype, bucket_bytes)
            return lora.merged_source(dtype, bucket_bytes)
        if self.trainer.sharded:
            if self.ranks is None:  # a sharded trainer is built by its rank group (ranks.py)
                raise RuntimeError("TrainerService.weight_source: a sharded trainer without its rank group")
            return self.ranks.gathered(Gather(dtype_name(dtype) if dtype else None, bucket_bytes))
        return DictSource({n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}, dtype,
                          bucket_bytes)
