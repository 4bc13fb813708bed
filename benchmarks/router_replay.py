"""Router replay (R3, loomrl/trainer/replay.py): the engine-trainer logprob gap and the importance-ratio spread on a
tiny mixture-of-experts model whose weights moved by a few SGD steps, with and without replay, and a dense model's gap
under the same steps for reference, in one run.

Setup: tiny random Qwen3-MoE, Mixtral and OLMoE models (2 layers, 4 experts, top-2; routers near ties, as a trained
router is for some tokens; experts at weight std 0.2) and a dense Qwen3 of the same width (MLP weights std 0.2). The "engine" is the model before training: its
logprobs of a fixed batch (16 samples, groups of 4 sharing a prompt) under its own routing, and the experts its
routers chose for every token (read by hooks on an HF forward, one sample at a time: what an engine records). The
trainer is a copy trained by plain SGD on a policy-gradient loss with fixed random advantages (every weight moves,
routers included). After each step: the mean and max |logp_trainer - logp_engine| of the trained tokens, and the
std and max of the importance ratio exp(logp_trainer - logp_engine), for the MoE trainer routing by its own top-k
(free) and replaying the engine's experts (replay), and for the dense model. Plus the share of (token, layer) routes
whose top-k the trainer would now choose differently (flipped). Replay cannot remove the gap the weights' change
makes; it removes the part switched experts add, so the replay gap should sit near the dense one.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, report  # noqa: E402

from loomrl.trainer.forward import logprobs_of  # noqa: E402
from loomrl.trainer.replay import Routing, moe_routers  # noqa: E402
from loomrl.types import TrainingSample  # noqa: E402

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128)


def build(kind: str, seed: int) -> torch.nn.Module:
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
                p.normal_(0.0, 0.2)
    return model.eval()


def batch(seed: int, groups: int = 4, per_group: int = 4, prompt: int = 8, answer: int = 16) -> list[TrainingSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        head = torch.randint(1, VOCAB, (prompt,), generator=gen).tolist()
        for i in range(per_group):
            ids = head + torch.randint(1, VOCAB, (answer,), generator=gen).tolist()
            adv = float(torch.randn((), generator=gen))
            out.append(TrainingSample(trajectory_id=f"{g}.{i}", group_id=str(g), token_ids=ids,
                                      loss_mask=[0] * prompt + [1] * answer, behaviour_logprobs=[0.0] * len(ids),
                                      versions=[0] * len(ids), advantages=[adv] * len(ids)))
    return out


def recorded_experts(model: torch.nn.Module, samples: list[TrainingSample]) -> list[torch.Tensor]:
    """Per sample, [T, L, k]: the experts `model`'s routers choose for each token, one forward per sample."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2].detach())) for r in moe_routers(model)]
    out = []
    try:
        for s in samples:
            seen.clear()
            with torch.no_grad():
                model(input_ids=torch.tensor([s.token_ids]))
            out.append(torch.stack(seen, dim=1))
    finally:
        for h in handles:
            h.remove()
    return out


def logp(model, samples, experts=None) -> torch.Tensor:
    with torch.no_grad():
        routing = Routing(experts=experts) if experts is not None else None
        return torch.cat(logprobs_of(model, samples, False, with_grad=False, routing=routing))


def spread(trainer: torch.Tensor, engine: torch.Tensor) -> dict[str, float]:
    diff = trainer - engine
    ratio = diff.exp()
    return {"gap_mean": float(diff.abs().mean()), "gap_max": float(diff.abs().max()),
            "ratio_std": float(ratio.std()), "ratio_max": float(ratio.max())}


def sgd_step(model: torch.nn.Module, samples: list[TrainingSample], lr: float) -> None:
    model.train()
    adv = torch.tensor([a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m and a is not None])
    out = torch.cat(logprobs_of(model, samples, False, with_grad=True))
    loss = -(adv[: out.numel()] * out).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
    model.eval()


def run(kind: str, steps: int, lr: float, seed: int) -> list[str]:
    samples = batch(seed)
    engine = build(kind, seed)
    dense = build("dense", seed)
    ref, dense_ref = logp(engine, samples), logp(dense, samples)
    experts = recorded_experts(engine, samples)
    trainer, dense_trainer = copy.deepcopy(engine), copy.deepcopy(dense)
    lines = []
    for step in range(1, steps + 1):
        sgd_step(trainer, samples, lr)
        sgd_step(dense_trainer, samples, lr)
        now = recorded_experts(trainer, samples)
        routes = sum(e.shape[0] * e.shape[1] for e in experts)
        flipped = sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in zip(now, experts))
        free, replay = spread(logp(trainer, samples), ref), spread(logp(trainer, samples, experts), ref)
        dense_s = spread(logp(dense_trainer, samples), dense_ref)
        lines.append(f"{kind:9s} step {step}: flipped {flipped / routes:5.1%} | "
                     + " | ".join(f"{name} gap mean {s['gap_mean']:.4f} max {s['gap_max']:.4f} ratio std "
                                  f"{s['ratio_std']:.4f} max {s['ratio_max']:.3f}"
                                  for name, s in (("free", free), ("replay", replay), ("dense", dense_s))))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="qwen3_moe,mixtral,olmoe")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one step of one model (the test suite's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kinds = 1, "olmoe"
    details = [line for kind in args.kinds.split(",") for line in run(kind, args.steps, args.lr, args.seed)]
    report({"benchmark": "router_replay", "machine": machine(), "steps": args.steps, "lr": args.lr,
            "details": details}, args.json)


if __name__ == "__main__":
    main()
