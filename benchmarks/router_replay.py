"""Router replay (R3: trainer.router_replay, loomrl/trainer/moe_step.py) in the real training step: the engine-trainer
logprob gap and the importance ratio's spread on tiny mixture-of-experts models after a few steps of drift, with and
without replay, a dense model's gap under the same steps for reference, and what the replay hooks cost a forward, in
one run.

Setup: tiny random Qwen3-MoE, Mixtral and OLMoE models (2 layers, 4 experts, top-2; routers near ties, as a trained
router is for some tokens; experts at weight std --expert-std) and a dense Qwen3 of the same width (MLP weights at the
same std). The engine is the real BuiltinEngine (return_routed_experts) on a copy of the model that never receives new
weights (async lag at its worst: its routing stays version 0's while the trainer's drifts); the trainer is the real
Trainer (trainer.router_replay on for the MoE models; AdamW at --lr, one micro-batch). Each step the engine samples 4
groups of 4 (8 prompt tokens, 16 sampled at temperature 1, seeded), the agent loop's add_turn keeps its logprobs and
routing records, samples_from_group makes the samples (random rewards: every group has signal); then, on the trainer's
weights before the step's update, the trainer's logprobs of the sampled tokens with replay (the engine's experts) and
without (its own top-k), against the engine's logprobs: the gap |logp_trainer - logp_engine| (mean, max) and the
importance ratio exp(logp_trainer - logp_engine) (std, 1% and 99% quantiles, max); then the Trainer's step, whose own
moe/logprob_gap and moe/logprob_gap_no_replay (same weights, same tokens) must agree with those means, and whose
moe/router_agreement says how far routing drifted. Step 0 is equal weights: its gap is the engine's numerics alone.

Replay cost: the median of --repeats no-grad forwards (and forward + backward) of the last batch with the replay hooks
(Routing with the engine's experts) against the same without hooks, interleaved, on one torch thread, CPU and wall
seconds.

What it is not: a model of a real MoE's drift (real routers are trained, these are random near ties): the figures say
whether replay removes the part of the gap that switched experts add; the part the weights' own change makes stays.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import divide, machine, median, report  # noqa: E402

from loomrl.agent.loop import add_turn  # noqa: E402
from loomrl.config import TrainerConfig  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.trainer.forward import logprobs_of  # noqa: E402
from loomrl.trainer.grpo import samples_from_group  # noqa: E402
from loomrl.trainer.replay import Routing, moe_routers  # noqa: E402
from loomrl.trainer.trainer import Trainer  # noqa: E402
from loomrl.types import TrainingSample, Trajectory  # noqa: E402

VOCAB, EOS = 64, 63
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128, eos_token_id=EOS)
GROUPS, PER_GROUP, PROMPT, ANSWER = 4, 4, 8, 16
SAMPLE_TIMEOUT_S = 300.0


def build(kind: str, seed: int, expert_std: float) -> torch.nn.Module:
    """A tiny model of `kind` (moe: routers near ties, experts large enough that which run shows)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3Config, Qwen3MoeConfig

    configs = {
        "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, moe_intermediate_size=32,
                                            norm_topk_prob=True),
        "mixtral": lambda: MixtralConfig(**SHAPE, head_dim=8, num_local_experts=4),
        "olmoe": lambda: OlmoeConfig(**SHAPE, num_experts=4, norm_topk_prob=False),
        "dense": lambda: Qwen3Config(**{k: v for k, v in SHAPE.items() if k != "num_experts_per_tok"}, head_dim=8),
    }
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs[kind](), attn_implementation="sdpa").float()
    with torch.no_grad():
        for router in moe_routers(model) if kind != "dense" else []:
            router.weight.normal_(0.0, 0.1)
        for name, p in model.named_parameters():  # the dense MLPs at the experts' scale, for a like-for-like gap
            if ".experts." in name or (kind == "dense" and ".mlp." in name):
                p.normal_(0.0, expert_std)
    return model.eval()


def sampled(engine: BuiltinEngine, step: int, seed: int) -> list[TrainingSample]:
    """One step's samples: GROUPS x PER_GROUP single-turn trajectories the engine samples, through add_turn (its
    logprobs and routing records kept, as the agent loop keeps them), random rewards."""
    rng = random.Random(seed * 1000 + step)
    prompts = [[rng.randrange(1, EOS) for _ in range(PROMPT)] for _ in range(GROUPS)]
    futures = [engine.submit(GenerationRequest(
        prompt_ids=p, program_id=f"s{step}g{g}i{i}",
        sampling=SamplingParams(temperature=1.0, max_tokens=ANSWER, seed=seed * 1000 + step * 97 + g * 7 + i)))
        for g, p in enumerate(prompts) for i in range(PER_GROUP)]
    results = [f.result(timeout=SAMPLE_TIMEOUT_S) for f in futures]
    out = []
    for g, p in enumerate(prompts):
        group = []
        for i in range(PER_GROUP):
            traj = Trajectory(task_id=f"t{g}", trajectory_id=f"s{step}g{g}i{i}", group_id=f"s{step}g{g}",
                              prompt_ids=list(p), token_ids=list(p))
            add_turn(traj, results[g * PER_GROUP + i])
            traj.total_reward = float(rng.random() < 0.5) if i > 1 else float(i)  # both rewards in every group
            group.append(traj)
        out += samples_from_group(group)
    return out


def engine_logps(samples: list[TrainingSample]) -> torch.Tensor:
    """The engine's logprobs of the sampled tokens, in logprobs_of's order."""
    return torch.tensor([s.behaviour_logprobs[t] for s in samples for t in range(1, len(s.token_ids)) if s.loss_mask[t]])


def replayed(samples: list[TrainingSample]) -> Routing:
    return Routing(experts=[s.routed_experts.tensor() for s in samples])


def trainer_logps(model, samples: list[TrainingSample], routing: Routing | None) -> torch.Tensor:
    return torch.cat(logprobs_of(model, samples, False, with_grad=False, routing=routing))


def spread(trainer: torch.Tensor, engine: torch.Tensor) -> dict[str, float]:
    """The gap and the importance ratio's spread over the sampled tokens."""
    diff = (trainer - engine).double()
    ratio = diff.exp()
    q01, q99 = torch.quantile(ratio, torch.tensor([0.01, 0.99], dtype=torch.float64)).tolist()
    return {"gap_mean": float(diff.abs().mean()), "gap_max": float(diff.abs().max()), "ratio_std": float(ratio.std()),
            "q01": q01, "q99": q99, "ratio_max": float(ratio.max())}


def fmt(name: str, s: dict[str, float]) -> str:
    return (f"{name} gap mean {s['gap_mean']:.4f} max {s['gap_max']:.4f} ratio std {s['ratio_std']:.4f} "
            f"q01 {s['q01']:.3f} q99 {s['q99']:.3f} max {s['ratio_max']:.3f}")


def trainer_cfg(lr: float, replay: bool) -> TrainerConfig:
    return TrainerConfig(lr=lr, micro_batch_size=GROUPS * PER_GROUP, warmup_steps=0, router_replay=replay)


def drift(kind: str, steps: int, lr: float, seed: int, expert_std: float) -> tuple[list[dict], list[TrainingSample],
                                                                                   Trainer]:
    """Steps 0..steps of `kind` against an engine left on version 0: per step the measures on the trainer's weights
    before that step's update, and the step's own figures; the last batch and the trainer (for the timing)."""
    moe = kind != "dense"
    model = build(kind, seed, expert_std)
    engine = BuiltinEngine(copy.deepcopy(model), eos_token_id=EOS, return_routed_experts=moe, seed=seed)
    trainer = Trainer(model, trainer_cfg(lr, moe))
    rows: list[dict] = []
    try:
        for step in range(steps + 1):
            samples = sampled(engine, step, seed)
            ref = engine_logps(samples)
            row = {"free": spread(trainer_logps(model, samples, None), ref)}
            if moe:
                row["replay"] = spread(trainer_logps(model, samples, replayed(samples)), ref)
            stats = trainer.train_step(samples)
            row["step"] = stats.moe.metrics() if stats.moe else {"gap": stats.logprob_gap_mean}
            rows.append(row)
    finally:
        engine.close()
    return rows, samples, trainer


def consistent(kind: str, row: dict) -> None:
    """The step's own moe/* gaps are of the same weights and tokens as the measured means: they must agree."""
    pairs = ([("moe/logprob_gap", "replay"), ("moe/logprob_gap_no_replay", "free")] if "replay" in row
             else [("gap", "free")])
    for key, name in pairs:
        if abs(row["step"][key] - row[name]["gap_mean"]) > 1e-4 + 1e-3 * row[name]["gap_mean"]:
            raise SystemExit(f"benchmark error: {kind}: the step's {key} {row['step'][key]:.6f} is not the measured "
                             f"{name} gap {row[name]['gap_mean']:.6f}")


def hook_cost(model, samples: list[TrainingSample], repeats: int) -> dict[str, dict[str, tuple[float, float]]]:
    """Median seconds, wall and CPU, (without hooks, with replay's) of a no-grad forward and of a forward + backward of
    `samples`, on one torch thread: on a shared machine two threads' barriers wait on each other's preemption, which
    swamps a tiny model's forward; one thread's CPU seconds move least with the other work."""
    def forward(routing: Routing | None) -> None:
        with torch.no_grad():
            logprobs_of(model, samples, False, with_grad=False, routing=routing)

    def backward(routing: Routing | None) -> None:
        loss = torch.cat(logprobs_of(model, samples, False, with_grad=True, routing=routing)).sum()
        model.zero_grad(set_to_none=True)
        loss.backward()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name, fn in (("forward", forward), ("forward+backward", backward)):
            times: dict[str, tuple[list[float], list[float]]] = {"wall": ([], []), "cpu": ([], [])}
            for k in range(repeats + 1):  # the first of each: warm-up
                for arm, routing in ((0, None), (1, replayed(samples))):
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn(routing)
                    if k:
                        times["wall"][arm].append(time.perf_counter() - t0)
                        times["cpu"][arm].append(time.process_time() - c0)
            out[name] = {clock: (median(plain), median(hooked)) for clock, (plain, hooked) in times.items()}
    finally:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
    return out


def run(kind: str, args: argparse.Namespace, dense_rows: list[dict]) -> list[str]:
    rows, samples, trainer = drift(kind, args.steps, args.lr, args.seed, args.expert_std)
    lines = []
    for step, (row, dense) in enumerate(zip(rows, dense_rows)):
        consistent(kind, row)
        lines.append(f"{kind:9s} step {step}: agreement {row['step']['moe/router_agreement']:.3f} | "
                     f"{fmt('no replay', row['free'])} | {fmt('replay', row['replay'])} | {fmt('dense', dense['free'])}")
    last, dense = rows[-1], dense_rows[-1]
    rep, free = last["replay"], last["free"]
    gap = divide(rep["gap_mean"], free["gap_mean"], kind + " gap")
    std = divide(rep["ratio_std"], free["ratio_std"], kind + " ratio std")
    width = divide(rep["q99"] - rep["q01"], free["q99"] - free["q01"], kind + " ratio q99 - q01")
    lines.append(f"{kind} after {args.steps} steps: replay / no replay gap mean {gap:.3f}, ratio std {std:.3f}, "
                 f"q99 - q01 {width:.3f}; replay / dense gap mean "
                 f"{divide(rep['gap_mean'], dense['free']['gap_mean'], kind + ' dense gap'):.3f}")
    costs = hook_cost(trainer.model, samples, args.repeats)

    def cost(name: str, clock: str) -> str:
        plain, hooked = costs[name][clock]
        return f"{plain * 1e3:.1f} ms without, {hooked * 1e3:.1f} with (x{divide(hooked, plain, name + clock):.3f})"

    lines.append(f"{kind} replay hooks ({len(samples)} samples, 1 thread, median of {args.repeats}): " + "; ".join(
        f"{name} CPU {cost(name, 'cpu')}, wall {cost(name, 'wall')}" for name in costs))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps of drift (step 0: equal weights)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--expert-std", type=float, default=0.6, help="init std of the experts' (and dense MLPs') "
                        "weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per arm of the hook cost")
    parser.add_argument("--kinds", default="qwen3_moe,mixtral,olmoe")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one step of one model (the test suite's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kinds, args.repeats = 1, "olmoe", 2
    torch.manual_seed(args.seed)
    dense_rows, _, _ = drift("dense", args.steps, args.lr, args.seed, args.expert_std)
    for row in dense_rows:
        consistent("dense", row)
    details = [line for kind in args.kinds.split(",") for line in run(kind, args, dense_rows)]
    report({"benchmark": "router_replay", "machine": machine(), "steps": args.steps, "lr": args.lr,
            "expert_std": args.expert_std, "threads": torch.get_num_threads(), "details": details}, args.json)


if __name__ == "__main__":
    main()
