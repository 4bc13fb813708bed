"""What a finished run measured about itself, for `loomrl plan`: read from its folder, never re-run.

- the engine: decode time against batch size, a least-squares line through every decode-only engine step of the run
  (the engine/decode_* sums of metrics.jsonl: steps, rows, rows squared, seconds, rows x seconds); an engine that
  does not fill them (vLLM, SGLang) gives each training step's engine/busy_s over engine/steps at that interval's
  mean batch (engine/generated_tokens / engine/steps) as the points;
- the environment: each turn's env.step and generation seconds (Turn.env_s, Turn.gen_s), each trajectory's
  env.reset and reward seconds (reset_s, reward_s), its turns and sampled tokens (trajectories/part-*.parquet);
- sandbox starts: env_pool/created over the run's wall time (summary.json);
- the trainer: train/tokens over train/seconds, and each step's time/step_s, time/rollout_s, time/train_s;
- the run's shape (config.yaml): mode, groups per step, group size, runtime.max_inflight_trajectories, the engine's
  batch limit, evaluation episodes, and the devices it held (hardware.py: GPU-hours or machine-hours).

What it is not: a profile of one component; each number is what the run saw under its own load.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from loomrl.planning.hardware import Hardware, run_hardware
from loomrl.run_folder import CONFIG, METRICS, SUMMARY, TRAJECTORIES, RunFolder, read_json_lines, read_summary


class NotARun(Exception):
    """The folder is not a finished run that `loomrl plan` can read."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Spread:
    """A latency distribution, in seconds."""

    n: int
    mean: float
    p50: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls(n=0, mean=0.0, p50=0.0, p90=0.0, max=0.0)
        ordered = sorted(values)
        return cls(n=len(ordered), mean=statistics.fmean(ordered), p50=ordered[len(ordered) // 2],
                   p90=ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], max=ordered[-1])


@dataclass(slots=True, kw_only=True, frozen=True)
class DecodeFit:
    """An engine step's seconds at batch B: base_s + per_seq_s x B (least squares over the run's steps)."""

    base_s: float
    per_seq_s: float
    points: int  # metrics records with engine steps
    batch_mean: float  # the run's mean decode batch
    tokens_per_s: float  # generated tokens over engine busy seconds, the whole run

    def step_s(self, batch: float) -> float:
        return self.base_s + self.per_seq_s * max(batch, 1.0)


@dataclass(slots=True, kw_only=True, frozen=True)
class RunMeasurements:
    run_dir: Path
    mode: str
    steps: int
    groups_per_step: int
    group_size: int
    max_inflight: int  # runtime.max_inflight_trajectories (0: no cap)
    max_policy_lag: int
    engine_max_batch: int
    eval_inflight: int  # eval.max_inflight (0: no cap of its own)
    eval_episodes: int  # per evaluation pass (both held-out splits)
    eval_passes: int
    wall_s: float
    step_s: float  # mean time/step_s
    rollout_s: float  # mean time/rollout_s
    train_s: float  # mean time/train_s
    eval_pass_s: float  # the last evaluation pass, from the last step's record to the eval's
    trainer_tokens_per_s: float
    decode: DecodeFit
    turns: float  # mean turns per training trajectory
    tokens_per_turn: float  # mean sampled tokens per turn
    eval_turns: float
    gen_turn: Spread  # seconds per turn waiting on the engine (queueing included)
    env_step: Spread
    env_reset: Spread
    reward: Spread
    trajectory: Spread  # wall seconds per training trajectory
    trajectory_times: tuple[float, ...]  # each training trajectory's wall seconds, sorted (predict.py's long tail)
    sandbox_starts_per_s: float
    staleness_mean: float  # policy lag of the groups trained
    hardware: Hardware  # the devices the run held (config.yaml)
    prompt_tokens: float  # mean first prompt: where each trajectory's first action starts
    obs_tokens: float  # mean tokens from one action's end to the next's start (observation, chat template)
    engine: EngineShape  # the config's engine fields the cluster simulation reads (sim_plan.py)


@dataclass(slots=True, kw_only=True, frozen=True)
class EngineShape:
    """The run's engine section, as `loomrl plan`'s simulated section reads it."""

    kind: str
    instances: int
    router: str
    program_policy: str
    kv_pool: bool
    kv_budget_tokens: int


def _fail(run_dir: Path, why: str) -> NotARun:
    return NotARun(f"loomrl plan: {run_dir} is not a finished run folder ({why}); give output_dir/name of a run "
                   "that `loomrl train` finished")


def _records(folder: RunFolder) -> list[dict]:
    if not folder.metrics.is_file():
        raise _fail(folder.path, f"no {METRICS}")
    return read_json_lines(folder.metrics)


def _line(n: float, sx: float, sxx: float, sy: float, sxy: float, mean_step: float, batch_mean: float
          ) -> tuple[float, float]:
    """(base, slope) of the least-squares line y = base + slope x from its sums; the slope kept between flat
    (memory-bound: a step costs the same at any batch) and proportional (compute-bound), flat when x barely varies."""
    spread = n * sxx - sx * sx
    if n < 2 or spread <= 1e-9 * max(n * sxx, 1.0):
        return mean_step, 0.0
    slope = (n * sxy - sx * sy) / spread
    slope = min(max(slope, 0.0), mean_step / max(batch_mean, 1.0))
    return max(mean_step - slope * batch_mean, 0.0), slope


def _decode_fit(train: list[dict]) -> DecodeFit:
    def total(key: str) -> float:
        return sum(r.get(key, 0) for r in train)

    busy, tokens, steps = total("engine/busy_s"), total("engine/generated_tokens"), total("engine/steps")
    n = total("engine/decode_steps")
    if n:  # every decode step of the run
        batch_mean, mean_step = total("engine/decode_rows") / n, total("engine/decode_s") / n
        base, slope = _line(n, total("engine/decode_rows"), total("engine/decode_rows_sq"), total("engine/decode_s"),
                            total("engine/decode_rows_s"), mean_step, batch_mean)
        points = int(n)
    else:  # one point per training step: its engine seconds per step at its mean batch
        pts = [(r["engine/generated_tokens"] / r["engine/steps"], r["engine/busy_s"] / r["engine/steps"])
               for r in train if r.get("engine/steps") and r.get("engine/busy_s")]
        batch_mean = tokens / steps if steps else 1.0
        mean_step = busy / steps if steps else 0.0
        base, slope = _line(len(pts), sum(x for x, _ in pts), sum(x * x for x, _ in pts), sum(y for _, y in pts),
                            sum(x * y for x, y in pts), mean_step, batch_mean)
        points = len(pts)
    return DecodeFit(base_s=base, per_seq_s=slope, points=points, batch_mean=batch_mean,
                     tokens_per_s=tokens / busy if busy else 0.0)


def _trajectory_columns(store: Path) -> list[dict]:
    import pyarrow.parquet as pq

    parts = sorted(store.glob("part-*.parquet"))
    rows: list[dict] = []
    for part in parts:
        names = pq.read_schema(part).names
        cols = [c for c in ("n_turns", "wall_time", "reset_s", "reward_s", "turns", "status") if c in names]
        rows.extend(pq.read_table(part, columns=cols).to_pylist())
    return rows


def _context_tokens(rows: list[dict]) -> tuple[float, float]:
    """(mean first prompt, mean observation) in tokens, from each trajectory's action spans."""
    from loomrl.store.schema import stored_turns

    firsts, gaps = [], []
    for r in rows:
        spans = [t["act_span"] for t in stored_turns(r["turns"]) if t.get("act_span")]
        if spans:
            firsts.append(spans[0]["start"])
            gaps.extend(b["start"] - a["end"] for a, b in zip(spans, spans[1:]))
    return (statistics.fmean(firsts) if firsts else 0.0), (statistics.fmean(gaps) if gaps else 0.0)


def measure_run(run_dir: Path) -> RunMeasurements:
    """Everything `loomrl plan` calibrates from (module docstring); NotARun names what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotARun(f"loomrl plan: {run_dir} is not a folder; give a run folder (output_dir/name)")
    folder = RunFolder(run_dir)
    if not folder.config.is_file():
        raise _fail(run_dir, f"no {CONFIG}")
    from loomrl.config import load_config
    from loomrl.store.schema import stored_turns

    cfg = load_config(str(folder.config), [])
    records = _records(folder)
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise _fail(run_dir, f"no training step in {METRICS}")
    summary = read_summary(run_dir)
    if summary is None:
        raise _fail(run_dir, f"no {SUMMARY}: it has not finished")
    rows = _trajectory_columns(folder.trajectories)
    if not rows:
        raise _fail(run_dir, f"no {TRAJECTORIES}/part-*.parquet")
    turns = [t for r in rows for t in stored_turns(r["turns"])]  # nested, or an older part's JSON string
    if turns and "env_s" not in turns[0]:
        raise NotARun(f"loomrl plan: {run_dir}'s turns carry no timings (Turn.env_s, gen_s): it was trained before "
                      "loomrl recorded them; train it again to plan from it")
    sampled = [t["act_span"]["end"] - t["act_span"]["start"] for t in turns if t.get("act_span")]
    evals = [r for r in records if r.get("kind", "").startswith("eval")]
    # the evaluation after training, where the driver stores it (it read evaluations/after, which no run writes, and
    # fell back to the training turns)
    eval_rows = _trajectory_columns(folder.evaluation("after", summary.steps))
    last_eval = next((r for r in reversed(records) if r.get("kind") == "eval_after"), None)
    eval_pass_s = last_eval["time"] - train[-1]["time"] if last_eval else 0.0
    lags = {int(k.rsplit("_", 1)[1]): v for r in train for k, v in r.items() if k.startswith("staleness/lag_")}
    lag_n = sum(lags.values())

    def mean_of(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in train)

    prompt_tokens, obs_tokens = _context_tokens(rows)
    e = cfg.engine
    engine = EngineShape(kind=e.kind, instances=e.instances, router=e.router, program_policy=e.program_policy,
                         kv_pool=e.kv_pool_bytes > 0, kv_budget_tokens=e.kv_budget_tokens)

    return RunMeasurements(
        run_dir=run_dir, mode=cfg.runtime.mode, steps=len(train), groups_per_step=cfg.trainer.groups_per_step,
        group_size=cfg.trainer.group_size, max_inflight=cfg.runtime.max_inflight_trajectories,
        max_policy_lag=cfg.buffer.max_policy_lag, engine_max_batch=cfg.engine.max_batch_size or 64,
        eval_inflight=cfg.eval.max_inflight, eval_episodes=int(evals[-1].get("eval/n", 0)) if evals else 0,
        eval_passes=len(evals), wall_s=summary.wall_s, step_s=mean_of("time/step_s"),
        rollout_s=mean_of("time/rollout_s"), train_s=mean_of("time/train_s"), eval_pass_s=max(eval_pass_s, 0.0),
        trainer_tokens_per_s=(sum(r.get("train/tokens", 0) for r in train)
                              / max(sum(r.get("train/seconds", 0.0) for r in train), 1e-9)),
        decode=_decode_fit(train), turns=statistics.fmean(r["n_turns"] for r in rows),
        tokens_per_turn=statistics.fmean(sampled) if sampled else 0.0,
        eval_turns=statistics.fmean(r["n_turns"] for r in eval_rows) if eval_rows else 0.0,
        gen_turn=Spread.of([t.get("gen_s", 0.0) for t in turns]), env_step=Spread.of([t["env_s"] for t in turns]),
        env_reset=Spread.of([r.get("reset_s") or 0.0 for r in rows]),
        reward=Spread.of([r.get("reward_s") or 0.0 for r in rows]),
        trajectory=Spread.of([r["wall_time"] for r in rows]),
        trajectory_times=tuple(sorted(r["wall_time"] for r in rows)),
        sandbox_starts_per_s=summary.env_pool.get("created", 0) / max(summary.wall_s, 1e-9),
        staleness_mean=sum(k * v for k, v in lags.items()) / lag_n if lag_n else 0.0, hardware=run_hardware(cfg),
        prompt_tokens=prompt_tokens, obs_tokens=obs_tokens, engine=engine)
