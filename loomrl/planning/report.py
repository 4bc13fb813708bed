"""Tables and JSON for `loomrl estimate-cost` and `loomrl plan`: presentation only, the numbers come from cost.py,
capacity.py and predict.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from loomrl.planning.capacity import CapacityPlan
from loomrl.planning.cost import CostEstimate, round_figure

if TYPE_CHECKING:
    from loomrl.planning.hardware import Hardware
    from loomrl.planning.measure import Spread
    from loomrl.planning.predict import Plan
    from loomrl.planning.recipe import RecipeFigures

RULE = "docs/planning.md, matching environments to the engine"  # where the user reads the rule the reports apply


def wall_text(hours: float) -> str:
    """Wall-clock hours; below an hour in minutes (a two-minute phase is `2min`, never 0 hours)."""
    if hours <= 0:
        return "0"
    return f"{float(f'{hours * 60:.2g}'):g}min" if hours < 1 else round_figure(hours)


def hours_text(hours: float) -> str:
    """Device-hours; below one to two significant figures (0.033), never rounded to 0."""
    if hours <= 0:
        return "0"
    return f"{float(f'{hours:.2g}'):g}" if hours < 1 else round_figure(hours)


def _span(values: list[float], text: Callable[[float], str] = round_figure) -> str:
    """One value, or low-high when the estimates differ ("11-28")."""
    texts = [text(v) for v in sorted(values)]
    return texts[0] if texts[0] == texts[-1] else f"{texts[0]}-{texts[-1]}"


def _money(v: float) -> str:
    return f"{v:,.0f}" if v >= 1 or v == 0 else f"{float(f'{v:.2g}'):g}"


def _usd(values: list[float]) -> str:
    lo, hi = _money(min(values)), _money(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def cost_table(estimates: list[CostEstimate], rule: CapacityPlan | None) -> str:
    """The estimates (one, or the fast and the slow end of a training throughput range) as one table."""
    inf = [e.inference for e in estimates]
    tr = [e.training for e in estimates]
    env = [e.environments for e in estimates]
    unit = estimates[0].inputs.unit

    def row(name: str, phases: list) -> tuple[str, ...]:
        return (name, _span([p.tokens for p in phases]), _span([p.wall_hours for p in phases], wall_text),
                _span([p.gpu_hours for p in phases], hours_text), _usd([p.usd for p in phases]))

    rows = [("phase", "tokens", "wall h", f"{unit}-h", "$"), row("inference (rollout)", inf), row("training", tr),
            ("environments", "-", _span([e.hours for e in env], wall_text), "-", _usd([e.usd for e in env])),
            ("total (one after the other)", "-",
             _span([i.wall_hours + t.wall_hours for i, t in zip(inf, tr, strict=True)], wall_text),
             _span([i.gpu_hours + t.gpu_hours for i, t in zip(inf, tr, strict=True)], hours_text),
             _usd([e.total_usd for e in estimates]))]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    if unit != "GPU":
        lines.append(f"{unit}-h: a CPU run's hours are its machine's (no GPU in the recipe's devices)")
    e0 = estimates[0].environments
    lines.append(f"environments: {e0.sandboxes} sandboxes x {_span([e.hours for e in env], hours_text)} h = "
                 f"{_span([e.sandbox_hours for e in env], hours_text)} sandbox-hours")
    gpu = [e.gpu_usd for e in estimates]
    if max(gpu) > 0 and e0.usd > 0:
        lines.append(f"environments / {unit} cost: {_ratio([e.environments.usd / e.gpu_usd for e in estimates])}")
    if rule is not None:
        lines.append(f"{rule.workers} concurrent environment workers keep the engine busy (one alone: "
                     f"{rule.utilisation_one_worker:.1%}); pool size {rule.pool_size} ({RULE})")
    return "\n".join(lines)


def recipe_lines(path: str | None, figures: RecipeFigures | None, params: float | None,
                 e: CostEstimate) -> list[str]:
    """What estimate-cost read from the recipe (and from which fields), and the compute the model's size implies."""
    x, lines = e.inputs, []
    if figures is not None:
        r = figures.read
        lines.append(f"recipe {path}: {x.tasks} tasks ({r['tasks']}) x {x.rollouts_per_task} rollouts "
                     f"({r['rollouts_per_task']}) x {x.turns:g} turns x {x.tokens_per_turn:g} tokens (at most: "
                     f"{r['turns']}, {r['tokens_per_turn']}, sampled tokens only); flags override each")
        devices = (f"{x.inference_gpus} inference + {x.train_gpus} training GPUs" if x.unit == "GPU"
                   else "no GPU: a CPU run, hours counted per machine")
        lines.append(f"devices: {devices} ({r['gpus']})")
    if params:
        where = f" ({figures.read['model_params']})" if figures is not None and figures.model_params == params else ""
        lines.append(f"model: {round_figure(params)} parameters{where}; compute ~ 2 x parameters x rollout tokens = "
                     f"{2 * params * e.inference.tokens:.2g} FLOP, training ~ 6 x parameters x tokens = "
                     f"{6 * params * e.training.tokens:.2g} FLOP")
    elif figures is not None:
        lines.append(f"model: size unknown ({figures.read['model_params']}); give --model-params N for the compute")
    return lines


def _ratio(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def cost_json(estimates: list[CostEstimate], rule: CapacityPlan | None) -> dict[str, Any]:
    return {"estimates": [{**asdict(e), "gpu_usd": e.gpu_usd, "total_usd": e.total_usd} for e in estimates],
            "capacity": asdict(rule) if rule is not None else None}


def _spread(s: Spread) -> str:
    return f"mean {s.mean:.3f}s  p50 {s.p50:.3f}s  p90 {s.p90:.3f}s  max {s.max:.3f}s  (n={s.n})"


def plan_table(p: Plan) -> str:
    """`loomrl plan`'s report: what the run measured, then the prediction for the target configuration."""
    m, own, t, hw = p.measured, p.own, p.target, p.hardware
    d = m.decode
    lines = [
        f"run {m.run_dir}: {m.mode}, {m.steps} steps of {m.groups_per_step} groups x {m.group_size}, "
        f"max_inflight {m.max_inflight or 'uncapped'}, wall {m.wall_s:.1f}s",
        "measured:",
        f"  engine decode      {d.tokens_per_s:.1f} tokens/s at mean batch {d.batch_mean:.1f}; step = "
        f"{d.base_s * 1e3:.2f}ms + {d.per_seq_s * 1e3:.3f}ms x batch ({d.points} points)",
        f"  engine per turn    {_spread(m.gen_turn)}  ({m.tokens_per_turn:.1f} sampled tokens/turn, "
        f"{m.turns:.2f} turns)",
        f"  env step           {_spread(m.env_step)}",
        f"  env reset          {_spread(m.env_reset)}",
        f"  reward             {_spread(m.reward)}",
        f"  trajectory         {_spread(m.trajectory)}",
        f"  sandbox starts     {m.sandbox_starts_per_s:.3f}/s",
        f"  trainer            {m.trainer_tokens_per_s:.1f} tokens/s; step {m.step_s:.2f}s (rollout "
        f"{m.rollout_s:.2f}s, train {m.train_s:.2f}s); staleness {m.staleness_mean:.2f}",
        f"  model on this run  step {own.step_s:.2f}s, wall {own.wall_s:.1f}s",
        f"predicted for {t.shape.mode}, {t.shape.groups_per_step} groups x {t.shape.group_size}, max_inflight "
        f"{t.shape.max_inflight or 'uncapped'}, {t.shape.steps} steps:",
        f"  in flight          {t.inflight} trajectories, engine batch {t.engine_batch:.1f}",
        f"  trajectory         {t.trajectory_s:.2f}s ({t.gen_turn_s:.3f}s/turn on the engine)",
        f"  step               {t.step_s:.2f}s (rollout {t.rollout_s:.2f}s, train {t.train_s:.2f}s)",
        f"  wall               {t.wall_s:.1f}s",
        f"  per 1,000 groups   {wall_text(p.groups_1000_wall_s / 3600)} wall, "
        f"{hours_text(p.groups_1000_device_hours)} {hw.unit} ({_devices(hw)}: {hw.basis})",
        f"  staleness          {t.staleness:.2f} steps expected",
        "  step by pool       " + ", ".join(f"{k} {v:.2f}s" for k, v in t.shares.items()),
        f"  bottleneck         {t.bottleneck}",
        f"environments: {p.capacity.workers} concurrent environment workers keep the engine busy at batch "
        f"{m.engine_max_batch} (one alone: {p.capacity.utilisation_one_worker:.1%}); pool size {p.capacity.pool_size} "
        f"({RULE})",
    ]
    return "\n".join(lines)


def _devices(hw: Hardware) -> str:
    if not hw.gpus:
        return "a CPU run, one machine"
    return f"{hw.gpus} GPU{'s' if hw.gpus > 1 else ''}"


def plan_json(p: Plan) -> dict[str, Any]:
    m = asdict(p.measured)
    m["run_dir"] = str(p.measured.run_dir)
    del m["trajectory_times"]  # one number per trajectory: the spread says it
    return {"measured": m, "own": asdict(p.own), "target": asdict(p.target), "capacity": asdict(p.capacity),
            "hardware": {**asdict(p.hardware), "unit": p.hardware.unit},
            "per_1000_groups": {"wall_s": p.groups_1000_wall_s, "device_hours": p.groups_1000_device_hours,
                                "unit": p.hardware.unit}}
