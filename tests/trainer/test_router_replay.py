"""Router replay (R3, loomrl/trainer/replay.py) on tiny mixture-of-experts models built from transformers' configs
(Qwen3-MoE, Mixtral, OLMoE: 2 layers, 4 experts, top-2), through the trainer's forward (forward.py logprobs_of).

The "engine" here is an HF forward of a copy of the model whose routers' top-k indices are read by forward hooks, one
sample at a time (what the built-in engine records, in the layout replay.py documents): no engine runs in these tests.
Nothing is mocked."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from loomrl.config import ModelConfig
from loomrl.model.loader import build_tiny_model
from loomrl.trainer.forward import logprobs_of
from loomrl.trainer.replay import Routing, aux_loss, keyed_tree, moe_routers
from loomrl.trainer.tree import pack_tree
from loomrl.types import TrainingSample

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, moe_intermediate_size=32,
                                        norm_topk_prob=True, decoder_sparse_step=1),
    "mixtral": lambda: MixtralConfig(**SHAPE, head_dim=8, num_local_experts=4),
    "olmoe": lambda: OlmoeConfig(**SHAPE, num_experts=4, norm_topk_prob=False),
}


def moe_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="sdpa").float()
    with torch.no_grad():
        # routers near ties (as a trained router often is, for some tokens): small drift flips some choices;
        # experts large enough that which ones run shows in the logprobs
        for router in moe_routers(model):
            router.weight.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def sample(k: int, ids: list[int], prompt: int) -> TrainingSample:
    mask = [0] * prompt + [1] * (len(ids) - prompt)
    return TrainingSample(trajectory_id=f"s{k}", group_id="g", token_ids=ids, loss_mask=mask,
                          behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids), advantages=[1.0] * len(ids))


def batch() -> list[TrainingSample]:
    """Four samples, three sharing a prompt (and two a first answer token), so that tree merge shares nodes."""
    prompt = [1, 5, 9, 13, 17, 21]
    return [sample(0, [*prompt, 30, 31, 32, 33], 6), sample(1, [*prompt, 30, 34, 35], 6),
            sample(2, [*prompt, 40, 41, 42, 43, 44], 6), sample(3, [2, 6, 10, 50, 51, 52], 3)]


def record_experts(model: torch.nn.Module, samples: list[TrainingSample]) -> list[torch.Tensor]:
    """Per sample, the experts each router of `model` chose for each token, [T, L, k]: one forward per sample."""
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2].detach())) for r in moe_routers(model)]
    out = []
    try:
        for s in samples:
            seen.clear()
            with torch.no_grad():
                model(input_ids=torch.tensor([s.token_ids]))
            out.append(torch.stack(seen, dim=1))  # [T, L, k]
    finally:
        for h in handles:
            h.remove()
    return out


def logprobs(model, samples, *, merged=False, experts=None, with_grad=False) -> list[torch.Tensor]:
    routing = Routing(experts=experts)
    return logprobs_of(model, samples, merged, with_grad=with_grad, routing=routing)


def drifted(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` whose routers moved: as a few training steps move them."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(out):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * scale)
    return out


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float((torch.cat(a) - torch.cat(b)).abs().mean())


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("merged", [False, True])
def test_replay_of_own_routing_changes_nothing(kind, merged):
    """Experts recorded under the same weights: replayed logprobs equal the model's own, dense and tree-merged."""
    model = moe_model(kind)
    samples = batch()
    own = logprobs(model, samples, merged=merged)
    replayed = logprobs(model, samples, merged=merged, experts=record_experts(model, samples))
    torch.testing.assert_close(torch.cat(replayed), torch.cat(own), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_replay_shrinks_the_gap_after_router_drift(kind):
    """After the trainer's routers drift from the engine's (five random drifts of 0.01 per weight), the mean gap to the
    engine's logprobs is smaller with replay: what is left is the routing weights' own change, not switched experts."""
    engine = moe_model(kind)
    samples = batch()
    reference = logprobs(engine, samples)  # the engine's logprobs, under its own routing
    recorded = record_experts(engine, samples)
    free, replayed, flips = 0.0, 0.0, 0
    for seed in range(1, 6):
        trainer = drifted(engine, 0.01, seed)
        flips += sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
                     for a, b in zip(record_experts(trainer, samples), recorded))
        free += gap(logprobs(trainer, samples), reference)
        replayed += gap(logprobs(trainer, samples, experts=recorded), reference)
    assert flips > 0  # (token, layer) pairs whose top-k the drift changed
    # measured here (sum of 5 mean gaps, free -> replayed): qwen3_moe 0.0435 -> 0.0221, mixtral 0.0638 -> 0.0176,
    # olmoe 0.0354 -> 0.0188
    assert replayed < 0.75 * free, (kind, free, replayed)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_gradients_reach_the_router_under_replay(kind):
    """Replay forces the experts, but the weights come from the router's logits: every router gets a gradient."""
    engine = moe_model(kind)
    trainer = drifted(engine, 0.3)
    trainer.train()
    samples = batch()
    out = logprobs(trainer, samples, experts=record_experts(engine, samples), with_grad=True)
    torch.cat(out).sum().backward()
    for router in moe_routers(trainer):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_aux_loss_is_transformers_load_balancing_loss(kind):
    """The load-balancing term from the trainer's forward equals the model's own aux_loss for the same padded batch,
    so a micro-batch loss + coef * aux_loss moves by exactly coef x transformers' aux loss."""
    model = moe_model(kind)
    samples = batch()
    routing = Routing()
    logprobs_of(model, samples, False, with_grad=False, routing=routing)
    ours = aux_loss(model, routing)
    width = max(len(s.token_ids) for s in samples)
    ids = torch.tensor([s.token_ids + [0] * (width - len(s.token_ids)) for s in samples])
    attn = torch.tensor([[1] * len(s.token_ids) + [0] * (width - len(s.token_ids)) for s in samples])
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=attn, output_router_logits=True).aux_loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    coef = 0.01
    policy = -torch.cat(logprobs_of(model, samples, False, with_grad=False)).mean()
    torch.testing.assert_close((policy + coef * ours) - policy, coef * theirs, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tree_merge_under_replay_equals_dense(kind):
    """Tree-merged and dense forwards under replay give the same logprobs and gradients, also when one sample's
    shared prompt was recorded under other weights: the trie splits there instead of merging different routings."""
    engine = moe_model(kind)
    samples = batch()
    experts = record_experts(engine, samples)
    experts[1] = record_experts(drifted(engine, 0.5, seed=3), samples[1:2])[0]  # sampled by an older policy
    assert not torch.equal(experts[1][:6], experts[0][:6])  # the shared prompt routed differently
    trainer = drifted(engine, 0.3)
    trainer.train()
    grads = []
    for merged in (False, True):
        trainer.zero_grad()
        out = logprobs(trainer, samples, merged=merged, experts=experts, with_grad=True)
        torch.cat(out).sum().backward()
        grads.append((torch.cat(out).detach(), [p.grad.clone() for p in trainer.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-5)
    assert len(grads[1][1]) == len(grads[0][1])
    for tree_grad, dense_grad in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(tree_grad, dense_grad, rtol=1e-3, atol=1e-5)
    seqs = [s.token_ids for s in samples]
    assert len(keyed_tree(seqs, experts)[0].token_ids) > len(pack_tree(seqs).token_ids)  # split, not merged
    same = record_experts(engine, samples)
    assert len(keyed_tree(seqs, same)[0].token_ids) == len(pack_tree(seqs).token_ids)  # equal routings still share


def test_replay_on_a_dense_model_names_it():
    """Replay asked of a model without MoE routers: one error naming the model."""
    model = build_tiny_model(ModelConfig(kind="tiny"), VOCAB, 0)
    samples = batch()
    experts = [torch.zeros(len(s.token_ids), 2, 2, dtype=torch.long) for s in samples]
    with pytest.raises(ValueError, match=type(model).__name__):
        logprobs(model, samples, experts=experts)
