"""`loomrl` command line. Heavy imports (torch, transformers) happen inside the commands, so
`loomrl --help` answers at once."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path


def _adapter_spec(text: str) -> tuple[str, Path]:
    """`loomrl serve --adapter NAME=PATH`'s value."""
    name, eq, path = text.partition("=")
    if not eq or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (the model name clients send = a LoRA "
                                         "checkpoint, run folder or adapter folder)")
    return name.strip(), Path(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loomrl", description="Reinforcement learning for multi-turn, tool-using LLM agents.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy from a YAML recipe", description="Train from a YAML recipe. "
                       "Override any field with dotted KEY=VALUE pairs, e.g. trainer.lr=1e-6 runtime.mode=async.")
    t.add_argument("config", help="YAML recipe, e.g. examples/calculator_smollm2.yaml")
    t.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    t.add_argument("--resume", action="store_true", help="continue the run in output_dir/name from its latest checkpoint, with the "
                   "config it ran with (its config.yaml) and these overrides on top")
    e = sub.add_parser("eval", help="held-out success of a checkpoint")
    e.add_argument("config", help="YAML recipe the checkpoint was trained with")
    e.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    e.add_argument("--checkpoint", required=True, help="a checkpoint folder or a run folder (its latest checkpoint)")
    s = sub.add_parser("serve", help="serve the recipe's model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
                       "with the engine the recipe's engine.kind names.")
    s.add_argument("config", help="YAML recipe naming the model (and engine settings)")
    s.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    s.add_argument("--checkpoint", help="serve a checkpoint folder (or a run folder's latest) instead of model:")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default=None, help="the model id clients send (default: the recipe's name)")
    s.add_argument("--adapter", action="append", default=[], type=_adapter_spec, metavar="NAME=PATH",
                   help="also serve a LoRA adapter over the same base model as model NAME (repeatable): PATH a LoRA "
                   "run's checkpoint, its run folder (the latest) or a PEFT adapter folder; a request's `model` picks "
                   "which answers (built-in engine: one engine per adapter sharing every untargeted weight)")
    v = sub.add_parser("validate-tasks", help="check codefix tasks: golden patch passes, untouched repo fails",
                       description="Validate the codefix tasks in real sandboxes: ground truth (the golden patch "
                       "passes every hidden test) and no-op (the untouched repository fails); with --judge, also a "
                       "review of each task by several LLM judges (any environment's tasks). Invalid tasks are "
                       "listed, written to the report, and left out of runs. Exit code 1 if any is invalid.")
    v.add_argument("--families", nargs="*", default=None, help="only these bug families (default: all)")
    v.add_argument("--backend", default="auto", choices=["auto", "bwrap", "process", "docker"])
    v.add_argument("--report", default=None, help="where to write the JSON report (default: "
                   "task_validation.json in loomrl's cache folder, $LOOMRL_CACHE or ~/.cache/loomrl)")
    v.add_argument("--env", default="codefix", help="whose tasks: codefix (sandbox checks, and the judges' review "
                   "with --judge) or any other environment's training tasks (the judges' review only; needs --judge)")
    v.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    v.add_argument("--judge", action="store_true", help="also have several LLM judges review each task: is it "
                   "well-posed, solvable, its answer right; a task passes when a strict majority say yes")
    v.add_argument("--judge-url", default=None, help="the judges' OpenAI-compatible base URL, e.g. "
                   "http://127.0.0.1:8000/v1 (`loomrl serve`)")
    v.add_argument("--judge-model", action="append", default=[], help="a judge's model id (repeatable: judge i uses "
                   "the i-th, round robin)")
    v.add_argument("--judges", type=int, default=None, help="how many judges (default: the models given, or 3 of one "
                   "model, each sampling with its own seed)")
    v.add_argument("--judge-temperature", type=float, default=None, help="the judges' sampling temperature "
                   "(default: 0.7 when a model serves several judges, so that they differ; else 0)")
    v.add_argument("--judge-api-key-env", default=None, help="the environment variable holding the API key")
    w = sub.add_parser("view", help="a web page of runs: curves, pools, timeline, trajectories (live while training)",
                       description="Serve a dashboard of one or more run folders (output_dir/name) at "
                       "http://HOST:PORT: curves of every run overlaid, the pools, each group's timeline, and the "
                       "trajectory viewer. It follows the folders, so a run still training shows its new steps.")
    w.add_argument("runs", nargs="+", metavar="RUN", help="run folders, e.g. runs/calculator-smollm2-20261201-120000")
    w.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: reachable from other "
                   "machines; the viewer has no login)")
    w.add_argument("--port", type=int, default=8765)
    sb = sub.add_parser("sandbox", help="check the sandbox set-up", description="Sandbox tools.")
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
    r = sbsub.add_parser("run", help="run one command in a fresh sandbox and print its output and exit code",
                         description="Run one command in a fresh sandbox (workdir /work), print its stdout, its "
                         "stderr (to stderr) and a last line with the exit code; exits with the command's code "
                         "(124 when the sandbox killed it). Example: loomrl sandbox run -- python3 -c 'print(1)'")
    r.add_argument("--backend", default="auto", choices=["auto", "bwrap", "process", "docker"])
    r.add_argument("--timeout", type=float, default=30.0, help="wall-clock seconds before the command is killed")
    r.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                   help="a sandbox limit, e.g. cpu_s=5 or disk_mb=64 (repeatable)")
    r.add_argument("--file", action="append", default=[], metavar="PATH",
                   help="copy a host file into the workdir first (repeatable)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    _cost_parser(sub)
    _plan_parser(sub)
    _check_env_parser(sub)
    _compare_parser(sub)
    return p


def _number(kind: type, low: float, strict: bool):
    """An argparse type: a number above `low` (or at least it); argparse's error names the flag."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value
    return parse


_POSITIVE, _COUNT, _NONNEG = _number(float, 0, True), _number(int, 0, True), _number(float, 0, False)


def _rate_range(text: str) -> tuple[float, float]:
    """A tokens/s figure or a LOW-HIGH range of them (the seed's training 2000-5000)."""
    low, sep, high = text.partition("-")
    ends = (_POSITIVE(low), _POSITIVE(high)) if sep else (_POSITIVE(text),) * 2
    if ends[0] > ends[1]:
        raise argparse.ArgumentTypeError(f"range {text!r} runs high to low; write LOW-HIGH")
    return ends


# estimate-cost without a recipe: docs/planning.md's worked example (5k tasks x 4 x 20 turns x 500 tokens, 5k tokens/s
# on 8 GPUs, training 2k-5k tokens/s)
_COST_EXAMPLE = {"tasks": 5000, "rollouts_per_task": 4, "turns": 20.0, "tokens_per_turn": 500.0,
                 "inference_tokens_per_s": 5000.0, "gpus": 8, "train_tokens_per_s": (2000.0, 5000.0)}


def _cost_parser(sub) -> None:
    c = sub.add_parser("estimate-cost", help="estimate a run's tokens, hours, GPU-hours and $ before it starts",
                       description="The cost model of docs/planning.md: rollout tokens = tasks x rollouts per task x "
                       "turns x tokens per turn; training tokens = rollout tokens x epochs; hours from throughputs; "
                       "environments = sandboxes x hours x price; and the environments that keep the engine busy. "
                       "Given a recipe (and dotted overrides, as train takes them), it reads tasks (total_steps x "
                       "groups_per_step), rollouts per task (group_size), turns (agent.max_turns), tokens per turn "
                       "(sampling.max_tokens), the model's size and the GPUs (ray sections, devices; a CPU recipe "
                       "counts machine-hours); flags override, and the throughputs a recipe cannot hold are asked "
                       "for. Without a recipe the defaults are docs/planning.md's worked example (5k tasks x 4 x 20 "
                       "turns x 500 tokens, 5k tokens/s on 8 GPUs, training 2k-5k tokens/s).")
    c.add_argument("recipe", nargs="?", default=None, help="a recipe (YAML) to read the run's figures from")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides of the recipe")
    c.add_argument("--tasks", type=_COUNT, default=None)
    c.add_argument("--rollouts-per-task", type=_COUNT, default=None)
    c.add_argument("--turns", type=_POSITIVE, default=None, help="mean turns per trajectory")
    c.add_argument("--tokens-per-turn", type=_POSITIVE, default=None, help="mean tokens per turn (think, act, observe)")
    c.add_argument("--inference-tokens-per-s", type=_POSITIVE, default=None, help="the rollout engines' throughput, "
                   "all GPUs together")
    c.add_argument("--gpus", type=_COUNT, default=None, help="inference GPUs")
    c.add_argument("--train-tokens-per-s", type=_rate_range, default=None, metavar="N or LOW-HIGH",
                   help="training throughput, or a range of it (the table then gives both ends)")
    c.add_argument("--train-gpus", type=_COUNT, default=None, help="training GPUs (default: --gpus, or the recipe's)")
    c.add_argument("--model-params", type=_POSITIVE, default=None, help="the model's parameters (e.g. 7e9), for the "
                   "compute line (default: the recipe's model, where its size is known)")
    c.add_argument("--epochs", type=_POSITIVE, default=1.0)
    c.add_argument("--sandboxes", type=_number(int, 0, False), default=0, help="concurrent sandboxes")
    c.add_argument("--sandbox-hours", type=_NONNEG, default=None, help="how long they run (default: the rollout's "
                   "wall hours; a week: 168)")
    c.add_argument("--sandbox-price", type=_NONNEG, default=0.0, help="$ per sandbox-hour")
    c.add_argument("--gpu-price", type=_NONNEG, default=0.0, help="$ per GPU-hour (a CPU recipe: per machine-hour)")
    c.add_argument("--env-step-s", type=_NONNEG, default=None, help="the environment's latency per step: prints how "
                   "many environments keep the engine busy (docs/planning.md; e.g. 5 with --gen-step-s 0.2)")
    c.add_argument("--gen-step-s", type=_POSITIVE, default=None, help="the engine's time per step for a request "
                   "(default: --engine-batch x --tokens-per-turn / --inference-tokens-per-s)")
    c.add_argument("--engine-batch", type=_COUNT, default=1, help="requests the engine serves at once")
    c.add_argument("--reset-s", type=_NONNEG, default=0.0, help="an environment's reset between trajectories")
    c.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="capacity and wall time from a finished run's own measurements",
                        description="Calibrate the cost model from a finished run (metrics.jsonl, trajectories, "
                        "config.yaml): decode speed against batch size, environment step and reset latency, reward "
                        "latency, trainer tokens/s. Prints the environments that keep the engine busy, the pool size, "
                        "expected staleness, wall time and GPU-hours (machine-hours for a CPU run) per 1,000 groups "
                        "and the bottleneck; the flags predict another configuration of the same run "
                        "(docs/planning.md). A last section, SIMULATED, runs the cluster simulation on the run's shape "
                        "for its engine config (router, program policy, K/V pool and budget, --instances): prefix hit "
                        "rate, prefill saved, K/V pauses.")
    pl.add_argument("run", help="a run folder (output_dir/name)")
    pl.add_argument("--max-inflight", type=_number(int, 0, False), default=None,
                    help="predict with this runtime.max_inflight_trajectories (0: no cap)")
    pl.add_argument("--groups-per-step", type=_COUNT, default=None, help="predict with this trainer.groups_per_step")
    pl.add_argument("--group-size", type=_COUNT, default=None, help="predict with this trainer.group_size")
    pl.add_argument("--steps", type=_COUNT, default=None, help="predict a run of this many steps (trainer.total_steps)")
    pl.add_argument("--mode", choices=["sync", "async"], default=None, help="predict with this runtime.mode")
    pl.add_argument("--max-policy-lag", type=_number(int, 0, False), default=None, help="predict with this "
                    "buffer.max_policy_lag (async)")
    pl.add_argument("--gpus", type=_COUNT, default=None, help="GPUs the run holds, for GPU-hours (default: from the "
                    "run's config.yaml: ray num_gpus, or CUDA devices; a CPU run counts machine-hours)")
    pl.add_argument("--instances", type=_COUNT, default=None, help="engine instances for the simulated section "
                    "(default: --gpus, else the run's engine.instances); SIMULATED with a GPU cost model")
    pl.add_argument("--kv-budget-tokens", type=_COUNT, default=None, help="each instance's K/V budget in the "
                    "simulated section (default: the run's engine.kv_budget_tokens)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="run arms of a recipe over seeds, paired by seed, and decide whether a change "
                       "helped", description="Run every arm (the recipe with its overrides) on every seed, paired by "
                       "seed (the same tasks and sampling noise where the policies agree), and decide each arm against "
                       "the first: better, worse, equivalent within --margin, or undecided at this N. The plan (arms, "
                       "metric, margin, seeds, looks) is fixed in OUT/plan.json by the first call; the same command "
                       "resumes it, and any other plan is refused, seeds added after looking included "
                       "(docs/compare.md).")
    c.add_argument("config", help="YAML recipe")
    c.add_argument("--arm", nargs="+", action="append", required=True, metavar=("NAME", "OVERRIDE"),
                   help="an arm: its name, then its KEY=VALUE overrides (none: the recipe as it is). The first --arm "
                   "is the baseline; give at least two")
    c.add_argument("--metric", default="heldout_templates", help="what decides: a held-out split's success after "
                   "training (heldout, heldout_templates) or success_after (all held-out tasks). Default: "
                   "heldout_templates")
    c.add_argument("--margin", type=float, required=True, help="the difference that matters: within +-margin the "
                   "arms are equivalent (e.g. 0.05)")
    c.add_argument("--seeds", type=_COUNT, required=True, help="seeds per arm: --first-seed and the N-1 after it (fix "
                   "N from a power calculation: docs/compare.md)")
    c.add_argument("--first-seed", type=_number(int, 0, False), default=0, help="the first seed (0); a new comparison "
                   "after looking at another starts after the other's last seed number")
    c.add_argument("--looks", default="", help="a sequential design, fixed in advance: seed counts at which to decide "
                   "early, e.g. 3,5 (each look then uses confidence 1 - alpha/looks)")
    c.add_argument("--confidence", type=float, default=0.95, help="overall confidence of the intervals (0.95)")
    c.add_argument("--set", nargs="*", default=[], dest="common", metavar="OVERRIDE",
                   help="overrides for every arm, e.g. trainer.total_steps=20")
    c.add_argument("--out", type=Path, default=None, help="the comparison's folder (default: runs/compare-<recipe>)")


def _compare(args) -> int:
    from loomrl.compare.plan import ComparePlan, fix_plan, loomrl_build, recipe_digest
    from loomrl.compare.runner import run_comparison, train_arm
    from loomrl.plugins import search_beside

    search_beside(args.config)  # the recipe's own modules (its reward function), found as `loomrl train` finds them
    try:
        looks = [int(x) for x in args.looks.split(",") if x.strip()]
    except ValueError:
        print(f"--looks: comma-separated seed counts, e.g. 3,5; got {args.looks!r}", file=sys.stderr)
        return 2
    names = [arm[0] for arm in args.arm]
    if len(set(names)) != len(names):
        print(f"--arm: each arm needs its own name; got {names}", file=sys.stderr)
        return 2
    plan = ComparePlan(recipe=args.config, arms={arm[0]: arm[1:] for arm in args.arm}, metric=args.metric,
                       margin=args.margin, seeds=list(range(args.first_seed, args.first_seed + args.seeds)),
                       looks=looks, common=args.common, confidence=args.confidence,
                       recipe_sha256=recipe_digest(args.config), loomrl=loomrl_build())
    folder = args.out or Path("runs") / f"compare-{Path(args.config).stem}"
    plan = fix_plan(folder, plan)
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = run_comparison(plan, folder, train_arm(plan.recipe, plan.metric, say), progress=say)
    print(report.text(), flush=True)
    print(f"report: {folder / 'report.md'} (and report.json); runs: loomrl view {folder}", file=sys.stderr)
    return 0


def _check_env_parser(sub) -> None:
    c = sub.add_parser("check-env", help="play a recipe's tasks with a model behind an OpenAI-compatible endpoint: is "
                       "the environment broken, or the model weak?",
                       description="Check an environment before training, as verifiers' vf-eval does: play N of the "
                       "recipe's tasks (held-out by default) through its environment, the model behind --base-url "
                       "(a strong model on vLLM or a hosted API, or `loomrl serve`) choosing each reply, score each "
                       "episode with the recipe's reward as a run would, and report success with its standard "
                       "error, mean turns, each tool's calls and failures (refused, timeout, raised by exception "
                       "type), episodes by status with the first error of each kind, and a verdict that tells the "
                       "environment failing from the model not solving the task. Exit code: 0 the environment "
                       "worked, 1 it failed, 2 the endpoint or the recipe could not serve the check (the endpoint "
                       "refused every episode, or cannot be reached), 130 "
                       "interrupted (the report covers the episodes that finished). docs/environments.md.")
    c.add_argument("config", help="YAML recipe naming the environment (env:, data:, reward:, agent.max_turns)")
    c.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    c.add_argument("--base-url", required=True, help="the endpoint, e.g. http://127.0.0.1:8000/v1")
    c.add_argument("--model", default=None, help="the model id to ask for (default: the first the endpoint lists)")
    c.add_argument("--api-key-env", default=None, help="the environment variable holding the endpoint's API key")
    c.add_argument("--n", type=_COUNT, default=20, help="episodes to play (the first N tasks of the split)")
    c.add_argument("--split", choices=["heldout", "train"], default="heldout")
    c.add_argument("--concurrency", type=_COUNT, default=4, help="episodes in flight at once")
    c.add_argument("--timeout", type=_POSITIVE, default=120.0, help="seconds one request to the endpoint may take "
                   "(a failed or timed-out request is sent again twice, then the check stops)")
    c.add_argument("--temperature", type=_NONNEG, default=None, help="default: the recipe's eval.temperature")
    c.add_argument("--max-tokens", type=_COUNT, default=None, help="per reply (default: the recipe's "
                   "sampling.max_tokens; a reasoning model needs more)")
    c.add_argument("--json", action="store_true", help="print the report as JSON, with every episode's replies")


def _check_env(args) -> int:
    import asyncio

    from tqdm import tqdm

    from loomrl.agent.endpoint import EndpointUnavailable
    from loomrl.config import load_config
    from loomrl.env.registry import check_env_config
    from loomrl.plugins import search_beside
    from loomrl.runtime.check_env import CheckSettings, EnvCheck
    from loomrl.runtime.check_report import build_report, report_text

    search_beside(args.config)
    cfg = load_config(args.config, args.overrides)
    check_env_config(cfg.env, cfg.data)  # the environment's own settings; the recipe's model and devices are not used here
    check = EnvCheck(cfg, CheckSettings(
        base_url=args.base_url, model=args.model, api_key_env=args.api_key_env, n=args.n, split=args.split,
        concurrency=args.concurrency, timeout_s=args.timeout, temperature=args.temperature, max_tokens=args.max_tokens))
    bars: list = []

    def progress(total: int):
        bars.append(tqdm(total=total, desc="check-env", unit="episode", file=sys.stderr))
        return bars[0]

    interrupted = False
    try:
        asyncio.run(check.run(progress))
    except EndpointUnavailable as err:
        print(f"check-env: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the episodes in flight were cancelled and their environments closed
        interrupted = True
    finally:
        for bar in bars:
            bar.close()
    report = build_report(check.episodes, env=cfg.env.name, endpoint=args.base_url, model=check.model or "?",
                          split=args.split, planned=check.planned, interrupted=interrupted)
    print(json.dumps(report.as_json()) if args.json else report_text(report), flush=True)
    if interrupted:
        return 130
    refused_all = not report.success.n and report.statuses.get("engine_error") == report.episodes > 0
    return 1 if report.env_failed else 2 if refused_all else 0


def _cost_figures(args):
    """The figures of estimate-cost: the flags, else the recipe's, else (no recipe) the worked example's; a
    throughput no recipe holds is asked for by name (ConfigError: one line)."""
    from loomrl.config import ConfigError, load_config
    from loomrl.planning.recipe import recipe_figures

    figures = recipe_figures(load_config(args.recipe, args.overrides)) if args.recipe else None
    base = dict(_COST_EXAMPLE) if figures is None else {
        "tasks": figures.tasks, "rollouts_per_task": figures.rollouts_per_task, "turns": figures.turns,
        "tokens_per_turn": figures.tokens_per_turn, "gpus": figures.inference_gpus}
    given = {k: getattr(args, k) for k in (*_COST_EXAMPLE, "train_gpus", "model_params")
             if getattr(args, k) is not None}
    missing = [f"--{k.replace('_', '-')} N" for k in ("inference_tokens_per_s", "train_tokens_per_s")
               if k not in given and k not in base]
    if missing:
        raise ConfigError(f"loomrl estimate-cost: {args.recipe} cannot say the throughputs: add "
                          f"{' and '.join(missing)} "
                          "(tokens/s, all engines or trainer ranks together; `loomrl plan` of a short run measures "
                          "them, docs/planning.md)")
    out = {**base, **given}
    out.setdefault("train_gpus", figures.train_gpus if figures and "gpus" not in given else out["gpus"])
    out.setdefault("model_params", figures.model_params if figures else None)
    return out, figures


def _estimate_cost(args) -> int:
    from loomrl.planning.capacity import CapacityInputs, required_envs
    from loomrl.planning.cost import CostInputs, estimate_cost
    from loomrl.planning.report import cost_json, cost_table, recipe_lines

    f, figures = _cost_figures(args)
    unit = "GPU" if figures is None or args.gpus or args.train_gpus else figures.unit
    estimates = [estimate_cost(CostInputs(
        tasks=f["tasks"], rollouts_per_task=f["rollouts_per_task"], turns=f["turns"],
        tokens_per_turn=f["tokens_per_turn"],
        inference_tokens_per_s=f["inference_tokens_per_s"], inference_gpus=f["gpus"], train_tokens_per_s=rate,
        train_gpus=f["train_gpus"], epochs=args.epochs, sandboxes=args.sandboxes, sandbox_hours=args.sandbox_hours,
        sandbox_price_per_hour=args.sandbox_price, gpu_price_per_hour=args.gpu_price, unit=unit))
        for rate in sorted(set(f["train_tokens_per_s"]), reverse=True)]  # the fast end first
    gen = args.gen_step_s or args.engine_batch * f["tokens_per_turn"] / f["inference_tokens_per_s"]
    rule = None if args.env_step_s is None else required_envs(CapacityInputs(
        env_step_s=args.env_step_s, gen_step_s=gen, turns=f["turns"], engine_batch=args.engine_batch,
        reset_s=args.reset_s))
    if args.json:
        print(json.dumps({**cost_json(estimates, rule), "recipe": None if figures is None else {
            "path": args.recipe, "model_params": f["model_params"], "read": figures.read}}), flush=True)
    else:
        print("\n".join([*recipe_lines(args.recipe, figures, f["model_params"], estimates[0]),
                         cost_table(estimates, rule)]), flush=True)
    return 0


def _plan(args) -> int:
    from loomrl.planning.measure import measure_run
    from loomrl.planning.predict import Shape, plan
    from loomrl.planning.report import plan_json, plan_table
    from loomrl.planning.sim_plan import sim_json, sim_lines, simulate_plan

    measured = measure_run(Path(args.run))
    target = Shape.of(measured, max_inflight=args.max_inflight, groups_per_step=args.groups_per_step,
                      group_size=args.group_size, steps=args.steps, mode=args.mode, max_policy_lag=args.max_policy_lag)
    result = plan(measured, target, gpus=args.gpus)
    sim = simulate_plan(_sim_inputs(args, measured, result.target.inflight, target.group_size))
    if args.json:
        print(json.dumps({**plan_json(result), "simulated": sim_json(sim)}), flush=True)
    else:
        print("\n".join([plan_table(result), *sim_lines(sim)]), flush=True)
    return 0


def _sim_inputs(args, m, inflight: int, group_size: int):
    """The simulated section's inputs: the run's engine config and measured shape, the flags' changes."""
    from loomrl.planning.sim_plan import sim_inputs

    e = m.engine
    return sim_inputs(instances=args.instances or args.gpus or e.instances, router=e.router,
                      program_policy=e.program_policy, pool=e.kv_pool, kv_budget_tokens=args.kv_budget_tokens
                      or e.kv_budget_tokens, inflight=inflight, group_size=group_size, turns=m.turns,
                      prompt_tokens=m.prompt_tokens, output_tokens=m.tokens_per_turn, obs_tokens=m.obs_tokens,
                      tool_median_s=m.env_step.p50)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line. Overrides may come after a flag as well (`train CFG --resume k=v`): argparse fills a
    positional list from one run of words only, and its parse_intermixed_args refuses subcommands, so the
    words it leaves over join the overrides of train, eval, serve and check-env (parse_overrides names any that is not
    KEY=VALUE); a leftover option is still refused."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = ("train", "eval", "serve", "check-env")
    if extra and (args.command not in takes_overrides or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _sandbox_run(args) -> int:
    import asyncio

    from loomrl.env.sandbox import SandboxError, make_sandbox

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise SandboxError("sandbox run: no command given; usage: loomrl sandbox run [--backend bwrap] -- CMD ...")
    limits = {}
    for item in args.limit:
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise SandboxError(f"sandbox run: --limit {item!r} is not KEY=INTEGER (e.g. cpu_s=5)")
        limits[key.strip()] = int(value)
    box = make_sandbox(args.backend, limits=limits)
    try:
        for path in args.file:
            host = Path(path)
            if not host.is_file():
                raise SandboxError(f"sandbox run: --file {path!r} is not a file")
            box.write_file(host.name, host.read_bytes())
        res = asyncio.run(box.exec(cmd, timeout=args.timeout))
    finally:
        box.close()
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    why = f", killed: {res.killed}" if res.killed else ""
    print(f"[loomrl sandbox: backend {box.backend}, exit code {res.returncode}{why}, {res.duration_s:.2f}s]", flush=True)
    return 124 if res.killed else (res.returncode if res.returncode >= 0 else 128 - res.returncode)


def _view(args) -> int:
    from loomrl.compare.runner import run_folders
    from loomrl.view.run_folder import RunFolderError
    from loomrl.view.serve import serve_view

    try:  # a comparison's folder (loomrl compare --out) stands for its arms' runs, overlaid
        serve_view([run for r in args.runs for run in run_folders(Path(r))], args.host, args.port)
    except RunFolderError as err:
        print(str(err), file=sys.stderr)
        return 2
    return 0


def _validate_tasks(args) -> int:
    from loomrl.config import ConfigError
    from loomrl.env.tasks.codefix import write_validation_report

    if args.judge and not (args.judge_url and args.judge_model):
        raise ConfigError("validate-tasks --judge: give the judges' endpoint and model, e.g. --judge-url "
                          "http://127.0.0.1:8000/v1 --judge-model judge")
    if args.env != "codefix" and not args.judge:
        raise ConfigError(f"validate-tasks --env {args.env}: only codefix tasks have sandbox checks; add --judge to have "
                          "the tasks reviewed by LLM judges")
    if args.env == "codefix":
        report, items = _validate_codefix(args)
    else:
        report, items = [], _env_review_items(args.env, args.limit)
    if args.judge:
        reviews = _judge_review(args, items)
        by_id = {r["task_id"]: r for r in report}
        for review in reviews:
            record = by_id.get(review.task_id) or {"task_id": review.task_id, "valid": True}
            if review.task_id not in by_id:
                report.append(record)
            record["review"] = review.as_dict()
            record["valid"] = record["valid"] and review.passed
            print(f"{'PASS' if review.passed else 'FAIL'} {review.task_id}: judges yes {review.yes}, no {review.no}, "
                  f"abstain {review.abstain}")
    from loomrl.cache_dir import cache_root

    path = Path(args.report) if args.report else cache_root() / "task_validation.json"
    write_validation_report(report, path)
    bad = [r for r in report if not r["valid"]]
    for r in bad:
        why = r.get("detail") or ""
        if "review" in r and not r["review"]["passed"]:
            why = f"{why}; " if why else ""
            why += f"judges: {r['review']['yes']} of {len(r['review']['votes'])} said yes"
        print(f"INVALID {r['task_id']}: {why}")
    print(f"{len(report)} tasks: {len(report) - len(bad)} valid, {len(bad)} invalid (left out of runs); "
          f"report: {path}")
    return 1 if bad else 0


def _validate_codefix(args) -> tuple[list[dict], list]:
    """The sandbox checks of the codefix tasks (golden patch passes, no-op fails), and the tasks as judges see them."""
    import asyncio

    from tqdm import tqdm

    from loomrl.env.tasks.codefix import codefix_specs, validate_codefix
    from loomrl.reward.task_review import codefix_items

    specs = list(codefix_specs(args.families).values())[:args.limit]
    with tqdm(total=len(specs), desc="validate", file=sys.stderr) as bar:
        report = asyncio.run(validate_codefix(specs, args.backend, progress=bar))
    return report, codefix_items(specs)


def _env_review_items(env: str, limit: int | None) -> list:
    """Any environment's training tasks (its own, per its default settings), as judges see them."""
    from loomrl.config import load_config
    from loomrl.env.registry import prepared_tasks
    from loomrl.reward.task_review import ReviewItem

    cfg = load_config(None, [f"env.name={env}"])
    train, _ = prepared_tasks(cfg.env, cfg.data)
    return [ReviewItem(task_id=t.task_id, prompt=t.prompt, reference=t.answer) for t in list(train)[:limit]]


def _judge_review(args, items: list) -> list:
    import asyncio

    from tqdm import tqdm

    from loomrl.reward.judge_client import JudgeClient
    from loomrl.reward.task_review import review_tasks

    models = args.judge_model
    n = args.judges or (len(models) if len(models) > 1 else 3)
    shared = n > len(set(models))  # a model serving several judges: they differ only by their seeds' samples
    temperature = args.judge_temperature if args.judge_temperature is not None else (0.7 if shared else 0.0)
    judges = [JudgeClient(base_url=args.judge_url, model=models[i % len(models)], api_key_env=args.judge_api_key_env,
                          field="--judge-api-key-env") for i in range(n)]
    async def run(bar) -> list:
        try:
            return await review_tasks(items, judges, temperature=temperature, progress=bar)
        finally:
            for judge in judges:
                await judge.aclose()

    with tqdm(total=len(items), desc="review", file=sys.stderr) as bar:
        return asyncio.run(run(bar))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from loomrl.compare.plan import PlanError
    from loomrl.config import ConfigError, load_config
    from loomrl.env.sandbox import SandboxError
    from loomrl.model.loader import ModelLoadError
    from loomrl.planning.measure import NotARun
    from loomrl.plugins import search_beside

    try:
        if args.command == "estimate-cost":
            return _estimate_cost(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "sandbox":
            return _sandbox_run(args)
        if args.command == "validate-tasks":
            return _validate_tasks(args)
        if args.command == "view":
            return _view(args)
        if args.command == "check-env":
            return _check_env(args)
        if args.command == "compare":
            return _compare(args)
        search_beside(args.config)  # the recipe's own modules, found as its data files are (plugins.py)
        cfg = load_config(args.config, args.overrides)  # train checks it against this machine (runtime/run.py)
        if args.command != "train":
            from loomrl.runtime.checks import check_config

            check_config(cfg)
        if args.command == "train":
            start = float(os.environ.get("LOOMRL_WALL_START", time.time()))
            from loomrl.runtime.run import RunInterrupted, resume_config, train
            from loomrl.runtime.stopping import stop_as_ctrl_c, stopped_line

            if args.resume:
                cfg = resume_config(cfg, args.overrides)
            signals = stop_as_ctrl_c()
            try:
                summary = train(cfg, resume=args.resume, wall_start=start)
            except RunInterrupted as stop:
                by = signals[0] if signals else signal.SIGINT
                print(stopped_line(stop, by, ["loomrl", "train", args.config, *args.overrides], cfg), file=sys.stderr,
                      flush=True)
                return 128 + by
            print(json.dumps(summary), flush=True)
        elif args.command == "eval":
            from loomrl.runtime.run import evaluate_checkpoint

            print(json.dumps(evaluate_checkpoint(cfg, Path(args.checkpoint))), flush=True)
        elif args.command == "serve":
            from loomrl.runtime.run import resolve_checkpoint
            from loomrl.runtime.serve import serve, served_adapter

            ckpt = resolve_checkpoint(Path(args.checkpoint)) if args.checkpoint else None
            adapters = [served_adapter(name, path) for name, path in args.adapter]
            serve(cfg, ckpt, args.host, args.port, args.model_name or cfg.name, adapters)
    except (ConfigError, ModelLoadError, SandboxError, NotARun, PlanError) as err:
        print(str(err), file=sys.stderr)
        return 2
    except Exception as err:  # RunError and friends carry their own message
        from loomrl.runtime.failures import CannotStart, RunError

        if isinstance(err, RunError):
            print(str(err), file=sys.stderr)
            return 2
        if isinstance(err, CannotStart):  # the run folder or checkpoint a command was given, before any run
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
