"""The built-in engine's device and dtype (loomrl/engine/builtin): a bfloat16 engine loading the trainer's float32
weights (cast as they load) and serving like a bfloat16 forward of them, and every tensor of a generation made on the
model's device.

The device audit runs on the CPU: torch's default device set to "meta" on the engine's own thread (the setting is
per thread), so a tensor made there without an explicit device= lands on meta and the step fails."""

from __future__ import annotations

import asyncio
import copy
import random

import torch

from loomrl.config import ModelConfig, RunConfig, TinyModelConfig, TrainerConfig
from loomrl.devices import place
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.runner import Chunk, ModelRunner
from loomrl.model.loader import load_run_model
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample
from loomrl.weights.transports import load_weights, make_publisher

TINY = ModelConfig(kind="tiny", tiny=TinyModelConfig(init_std=0.1, seed=3))


def _generate(engine, prompts, **sampling):
    async def go():
        return await asyncio.gather(*[engine.generate(GenerationRequest(prompt_ids=p, program_id=f"p{i}",
                                                                        sampling=SamplingParams(**sampling)))
                                      for i, p in enumerate(prompts)])

    return asyncio.run(go())


def _prompts(tokenizer):
    return [tokenizer.encode(t) for t in ("You are a careful calculator. What is 2 + 2?", "unrelated short",
                                          "You are a careful calculator. A longer question about apples")]


def _last_logits(model, prompt):
    """The runner's logits after `prompt` (a fresh runner: it packs the model's current weights)."""
    runner = ModelRunner(model)
    return runner.forward([Chunk(runner.new_kv(len(prompt)), prompt)])[0]


def test_a_bfloat16_engine_takes_float32_weights_cast_and_serves_like_a_bfloat16_forward(tokenizer):
    """Async mode's path: the trainer (float32 masters) takes a step, publishes through shared memory, the engine
    (model.dtype=bfloat16) loads the float32 snapshot: its weights are the masters rounded to bfloat16, and its
    greedy tokens are the argmax (to bfloat16's precision) of transformers' bfloat16 forward of those weights."""
    cfg = RunConfig(model=TINY.model_copy(update={"dtype": "bfloat16"}), runtime={"mode": "async"},
                    trainer=TrainerConfig(lr=3e-2, micro_batch_size=4))
    engine_model, _ = load_run_model(cfg.model, None)
    masters, _ = load_run_model(cfg.model, None, trainer=cfg.trainer)
    rng = random.Random(2)
    prompt = _prompts(tokenizer)[0]
    samples = [TrainingSample(trajectory_id=f"t{k}", group_id="g", token_ids=prompt + [rng.randrange(len(tokenizer))
                                                                                       for _ in range(4)],
                              loss_mask=[0] * len(prompt) + [1] * 4, behaviour_logprobs=[0.0] * (len(prompt) + 4),
                              versions=[0] * (len(prompt) + 4), advantages=[k - 1.5] * (len(prompt) + 4))
               for k in range(4)]
    Trainer(masters, cfg.trainer).train_step(samples)
    publisher = make_publisher("shm")
    engine = BuiltinEngine(engine_model, eos_token_id=tokenizer.eos_token_id)
    try:
        stale = _last_logits(engine_model, prompt)
        handle = publisher.publish({n: p.detach() for n, p in masters.named_parameters()}, 1)
        loaded = load_weights(handle)
        assert all(t.dtype == torch.float32 for t in loaded.weights.values())
        engine.update_weights(loaded.weights, loaded.version)
        ref = dict(masters.named_parameters())
        for n, p in engine_model.named_parameters():
            assert p.dtype == torch.bfloat16 and torch.equal(p, ref[n].detach().to(torch.bfloat16)), n
        reference = place(copy.deepcopy(masters), torch.device("cpu"), torch.bfloat16)  # transformers, bf16
        with torch.no_grad():
            ref_last = reference(torch.tensor([prompt])).logits[0, -1].float()
        fresh = _last_logits(engine_model, prompt)
        assert (fresh - ref_last).abs().max() < 0.1 < (stale - ref_last).abs().max()  # the update is what serves
        prompts = _prompts(tokenizer)
        for p, r in zip(prompts, _generate(engine, prompts, temperature=0.0, max_tokens=8)):
            assert set(r.versions) == {1}
            with torch.no_grad():
                logits = reference(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1].float()  # [n, V]
            chosen = logits.gather(1, torch.tensor(r.token_ids).unsqueeze(1)).squeeze(1)
            assert (chosen >= logits.max(dim=-1).values - 0.1).all()  # bf16 kernels differ by ~0.03 here
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(r.logprobs), logp, atol=0.1)
    finally:
        engine.close()
        publisher.close()


def test_a_generation_makes_every_tensor_on_the_model_device(tiny_model, tokenizer):
    """Greedy, top-k/top-p and seeded requests, prefill chunks, decodes, the prefix cache and a preemption, with the
    engine thread's default device set to meta: the outputs equal an engine run normally."""
    prompts = _prompts(tokenizer) * 2
    # sampled requests seeded: each draws from its own generator, whatever the batches the timing makes
    sampling = [dict(temperature=0.0), dict(temperature=1.0, top_k=5, top_p=0.9, seed=3), dict(temperature=0.7, seed=4)]

    def run(engine):
        async def go():
            return await asyncio.gather(*[
                engine.generate(GenerationRequest(prompt_ids=p, program_id=f"p{i}",
                                                  sampling=SamplingParams(max_tokens=6, **sampling[i % 3])))
                for i, p in enumerate(prompts)])

        return [r.token_ids for r in asyncio.run(go())]

    def engine():
        return BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=40,
                             max_prefill_tokens=16)

    normal = engine()
    try:
        expected = run(normal)
    finally:
        normal.close()
    audited = engine()
    try:
        audited.call(lambda: torch.set_default_device("meta")).result()
        try:
            got = run(audited)
        finally:
            audited.call(lambda: torch.set_default_device(None)).result()
        assert audited.metrics.faults == 0 and audited.metrics.preemptions > 0
    finally:
        audited.close()
    assert got == expected
