"""LoRA in the trainer (trainer.lora; loomrl/trainer/lora.py) on tiny float32 Llama and Qwen3 models built from a
config, their matrices redrawn at std 0.2 (as test_tree.py, so that a wrong forward moves logprobs visibly) and every
adapter's B drawn non-zero (PEFT starts B at zero, where A's gradient is zero and the adapter changes nothing).

"The same step" on merged weights: a plain model holding W + s x B @ A in each targeted linear, trained by the same
Trainer step on the same samples, gives the same per-token logprobs and loss, and its weight gradient dL/dW gives the
adapter's by the chain rule (dL/dB = s x dL/dW @ A^T, dL/dA = s x B^T @ dL/dW). Nothing is mocked.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from tiny_lora_models import spread_tiny

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.config.trainer import LoraConfig, LossConfig
from loomrl.model.adapter import ADAPTER, ADAPTER_WEIGHTS, is_adapter_folder, merge_adapter
from loomrl.model.loader import build_tiny_model
from loomrl.run_folder import CheckpointFolder
from loomrl.train_pool.ranks import build_trainer
from loomrl.trainer.checkpoint import save_checkpoint
from loomrl.trainer.forward import token_logprobs
from loomrl.trainer.trainer import Trainer
from loomrl.types import TrainingSample
from loomrl.weights.fingerprint import Tap, WeightMismatch, check, fingerprint_of

RTOL = 1e-5
LORA = LoraConfig(rank=4, alpha=8)
NO_CLIP = 1e9  # clip_grad_norm_ scales the gradients in place above grad_clip: the chain-rule check reads them raw


def _tiny(tokenizer, arch: str = "llama"):
    return spread_tiny(len(tokenizer), tokenizer.eos_token_id, arch)


def _samples(model) -> list[TrainingSample]:
    """Two groups sharing their prompts (tree merge has something to merge), behaviour logprobs the model's own (so
    PPO's ratios start at 1 and no token is clipped), advantages of both signs."""
    rng, vocab, out = random.Random(0), model.config.vocab_size, []
    for g in range(2):
        prompt = [rng.randrange(vocab) for _ in range(7)]
        for i in range(3):
            ids = prompt + [rng.randrange(vocab) for _ in range(rng.randrange(3, 7))]
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            adv = 1.0 if (g + i) % 2 else -0.5
            out.append(TrainingSample(trajectory_id=f"t{g}{i}", group_id=f"g{g}", token_ids=ids, loss_mask=mask,
                                      behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                                      advantages=[adv * m for m in mask]))
    logps = token_logprobs(model, out, with_grad=False)
    for s, lp in zip(out, logps):
        at = iter(lp.tolist())
        s.behaviour_logprobs = [next(at) if m else 0.0 for m in s.loss_mask]
    return out


def _lora_trainer(model, **kw) -> Trainer:
    trainer = Trainer(model, TrainerConfig(lora=kw.pop("lora", LORA), grad_clip=NO_CLIP, lr=1e-2, **kw))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in trainer.lora.layers.values():
            b = layer.lora_B[ADAPTER].weight
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return trainer


def _merged_plain(tokenizer, trainer: Trainer, arch: str):
    """A plain model of the same architecture holding the LoRA model's merged weights."""
    plain = _tiny(tokenizer, arch)
    merged = {n: t.clone() for bucket in trainer.lora.merged_source(None, 1 << 20).buckets() for n, t in bucket}
    plain.load_state_dict(merged, strict=False)
    return plain


def _adapter_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lora_step_equals_the_step_on_merged_weights(tokenizer, arch):
    lora = _lora_trainer(_tiny(tokenizer, arch))
    plain_model = _merged_plain(tokenizer, lora, arch)
    samples = _samples(plain_model)
    for a, b in zip(token_logprobs(lora.model, samples, with_grad=False),
                    token_logprobs(plain_model, samples, with_grad=False)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6)
    before = {m: (layer.lora_A[ADAPTER].weight.detach().clone(), layer.lora_B[ADAPTER].weight.detach().clone())
              for m, layer in lora.lora.layers.items()}
    plain = Trainer(plain_model, TrainerConfig(grad_clip=NO_CLIP, lr=1e-2))
    s_lora, s_plain = lora.train_step(samples), plain.train_step(samples)
    assert s_lora.loss == pytest.approx(s_plain.loss, rel=1e-5, abs=1e-7) and s_lora.loss != 0.0
    weights = dict(plain_model.named_parameters())
    scale = LORA.alpha / LORA.rank
    for module, layer in lora.lora.layers.items():
        a, b = before[module]
        dw = weights[f"{module}.weight"].grad  # [out, in]
        _assert_near(layer.lora_B[ADAPTER].weight.grad, scale * dw @ a.T)
        _assert_near(layer.lora_A[ADAPTER].weight.grad, scale * b.T @ dw)


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding, over the whole tensor (an element near zero may differ relatively more)."""
    assert got.shape == want.shape
    err = float((got - want).norm())
    assert err <= 1e-5 * float(want.norm()) + 1e-9, (err, float(want.norm()))


def test_only_the_adapters_train(tokenizer):
    trainer = _lora_trainer(_tiny(tokenizer))
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapter_before = _adapter_state(trainer)
    assert {id(p) for p in trainer.params} == {id(p) for p in trainer.lora.parameters()}
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(p) for p in trainer.params}
    trainer.train_step(_samples(trainer.model))
    for n, p in trainer.model.named_parameters():
        if "lora_" in n:
            assert not torch.equal(p, adapter_before[n]), n
        else:
            assert torch.equal(p, base_before[n]), n


@pytest.mark.parametrize("variant", ["tree", "tree_checkpointed", "dense_checkpointed"])
def test_dense_and_tree_merged_paths_agree_under_lora(tokenizer, variant):
    """Tree-merged (and activation-checkpointed) steps give the dense step's loss and adapter gradients."""
    dense = _lora_trainer(_tiny(tokenizer))
    kw = {"tree_merge": "off" if variant == "dense_checkpointed" else "on",
          "activation_checkpointing": variant.endswith("checkpointed")}
    other = _lora_trainer(_tiny(tokenizer), **kw)
    samples = _samples(dense.model)
    s_dense, s_other = dense.train_step(samples), other.train_step(samples)
    assert s_other.loss == pytest.approx(s_dense.loss, rel=1e-5, abs=1e-7)
    if kw["tree_merge"] == "on":
        assert s_other.tree_ratio > 1.0  # something was merged
    grads = {n: p.grad for n, p in other.model.named_parameters() if "lora_" in n}
    for n, p in dense.model.named_parameters():
        if "lora_" in n:
            err = float((grads[n] - p.grad).norm())
            assert err <= RTOL * float(p.grad.norm()) + 1e-8, (n, err)


def test_resume_from_an_adapter_checkpoint_is_bit_for_bit(tokenizer, tmp_path: Path):
    """Two steps straight equal one step, a checkpoint (adapter, optimizer, schedule), a trainer rebuilt from the base
    and that checkpoint through build_trainer (the pool's path), and one step."""
    cfg = dict(warmup_steps=3)  # the schedule's position matters too
    samples = _samples(_tiny(tokenizer))
    straight = _lora_trainer(_tiny(tokenizer), **cfg)
    straight.train_step(samples)
    straight.train_step(samples)

    first = _lora_trainer(_tiny(tokenizer), **cfg)
    first.train_step(samples)
    ckpt = save_checkpoint(tmp_path, first.step, model=first.model, tokenizer=tokenizer, optimizer=first.optimizer,
                           scheduler=first.scheduler, state={}, adapter=first.lora.save)
    folder = CheckpointFolder(ckpt).model
    assert not list(folder.glob("model*.safetensors"))  # no base model in the checkpoint
    from safetensors.torch import load_file
    saved = load_file(str(folder / ADAPTER_WEIGHTS))
    assert saved and all("lora_" in n for n in saved)

    resumed = build_trainer(first.cfg, ModelConfig(kind="tiny"), torch.device("cpu"), _tiny(tokenizer), ckpt)
    assert resumed.step == 1 and resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    assert all(torch.equal(t, _adapter_state(first)[n]) for n, t in _adapter_state(resumed).items())
    resumed.train_step(samples)
    want = _adapter_state(straight)
    got = _adapter_state(resumed)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_an_adapter_checkpoint_merges_into_its_base(tokenizer, tmp_path: Path):
    """What eval, serve and a resumed run's engine need from a LoRA checkpoint: its base with the adapter merged, the
    weights the trainer publishes."""
    trainer = _lora_trainer(_tiny(tokenizer))
    trainer.train_step(_samples(trainer.model))
    trainer.lora.save(tmp_path / "model")
    assert is_adapter_folder(tmp_path / "model") and not is_adapter_folder(tmp_path)
    merged = dict(merge_adapter(_tiny(tokenizer), tmp_path / "model").named_parameters())
    published = {n: t.clone() for bucket in trainer.lora.merged_source(None, 1 << 20).buckets() for n, t in bucket}
    assert published and all(torch.equal(merged[n], t) for n, t in published.items())


def test_a_lora_runs_checkpoint_loads_merged_for_the_builtin_engine_and_is_refused_elsewhere(tokenizer, tmp_path):
    """load_run_model (a resumed run's engine, eval, serve) merges a LoRA checkpoint's adapter into model:'s base; the
    trainer's load and the vLLM/SGLang skeleton refuse it in one line (they would load the bare base)."""
    from loomrl.model.loader import ModelLoadError, load_run_model, load_skeleton

    cfg = ModelConfig(kind="tiny", dtype="float32")
    trainer = _lora_trainer(build_tiny_model(cfg, len(tokenizer), tokenizer.eos_token_id))
    trainer.train_step(_samples(trainer.model))
    ckpt = tmp_path / "step_000001"
    trainer.lora.save(CheckpointFolder(ckpt).model)
    model, _ = load_run_model(cfg, ckpt)
    published = {n: t for bucket in trainer.lora.merged_source(None, 1 << 20).buckets() for n, t in bucket}
    got = dict(model.named_parameters())
    assert published and all(torch.equal(got[n], t) for n, t in published.items())
    with pytest.raises(ValueError, match="holds a LoRA adapter: the trainer's model is the base"):
        load_run_model(cfg, ckpt, trainer=TrainerConfig(lora=LoraConfig(rank=4)))
    with pytest.raises(ModelLoadError, match="resume or serve it with engine.kind=builtin"):
        load_skeleton(cfg, ckpt, dtype=torch.float32)


def test_kl_reference_is_the_base_without_a_second_copy(tokenizer):
    base = _tiny(tokenizer)
    base_params = sum(p.numel() for p in base.parameters())
    model = copy.deepcopy(base)
    trainer = _lora_trainer(model, loss=LossConfig(kl="k3", kl_coef=0.1))
    assert trainer.ref_model is None and trainer.ref_forward is not None
    samples = _samples(base)
    with torch.no_grad():
        ref = trainer.ref_forward(samples, False)
        policy = trainer.forward(samples, False)
    for r, b in zip(ref, token_logprobs(base, samples, with_grad=False)):
        torch.testing.assert_close(r, b, rtol=RTOL, atol=1e-6)
    assert any(not torch.allclose(p, r, atol=1e-3) for p, r in zip(policy, ref))  # the adapters do change them
    adapter = sum(p.numel() for p in trainer.lora.parameters())
    storages = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    # every tensor the trainer holds: the base once (tied embeddings shared), the adapters, nothing else
    assert sum(p.numel() for p in trainer.model.parameters()) == base_params + adapter
    assert len(storages) == len(list(trainer.model.parameters()))
    stats = trainer.train_step(samples)
    assert stats.approx_kl >= 0.0
    assert all(p.requires_grad for p in trainer.lora.parameters())  # disable_adapter gave them back their grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_published_merged_weights_equal_peft_merge_and_unload(tokenizer, arch):
    """Every targeted linear's merged weight, and (qwen2: q/k/v) its bias, unchanged but sent: vLLM rebuilds a fused
    layer given only some of its tensors, and a bias not sent may come back as uninitialised memory."""
    trainer = _lora_trainer(_tiny(tokenizer, arch))
    trainer.train_step(_samples(trainer.model))
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
    source = Tap(trainer.lora.merged_source(torch.bfloat16, 1 << 16))
    published = {n: t.clone() for bucket in source.buckets() for n, t in bucket}
    merged = copy.deepcopy(trainer.lora.peft).merge_and_unload()
    want = dict(merged.named_parameters())
    assert published and set(published) <= set(want)
    assert {n.rsplit(".", 2)[-2] for n in published} == set(LORA.target_modules)
    targeted_biases = {n for n in want if n.endswith(".bias") and n.rsplit(".", 2)[-2] in LORA.target_modules}
    assert {n for n in published if n.endswith(".bias")} == targeted_biases
    assert bool(targeted_biases) == (arch == "qwen2")
    for n, t in published.items():
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, want[n].to(torch.bfloat16), rtol=0, atol=0)
    # the training model is unchanged by the publish
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if "base_layer" in n)
    # an engine that loads them passes the weight check; one that kept the base does not
    engine = _tiny(tokenizer, arch).to(torch.bfloat16)
    stale = copy.deepcopy(engine)
    engine.load_state_dict(published, strict=False)
    expected = source.fingerprint()
    assert check("builtin", 1, expected, fingerprint_of(dict(engine.named_parameters()), expected), 1) > 0
    with pytest.raises(WeightMismatch, match="did not load version 1"):
        check("builtin", 1, expected, fingerprint_of(dict(stale.named_parameters()), expected), 1)


def test_freeze_layers_under_lora_puts_no_adapters_in_the_bottom_blocks(tokenizer):
    """trainer.freeze_layers=1 under LoRA: adapters only above block 1 (what PEFT's layers_to_transform gives), so the
    backward stops above block 0 and block 0's forward is the base's; the adapters left train as before."""
    model = _tiny(tokenizer)
    trainer = _lora_trainer(model, freeze_layers=1)
    assert trainer.lora.layers and all(".layers.1." in n for n in trainer.lora.layers)
    whole = Trainer(_tiny(tokenizer), TrainerConfig(lora=LORA))
    assert any(".layers.0." in n for n in whole.lora.layers)
    stats = trainer.train_step(_samples(model))
    assert stats.grad_norm > 0
    assert all(p.grad is None for n, p in model.named_parameters() if ".layers.0." in n)


def test_bad_lora_config_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules: qkv_proj not in this model .*q_proj"):
        Trainer(_tiny(tokenizer), TrainerConfig(lora=LoraConfig(target_modules=["q_proj", "qkv_proj"])))
    with pytest.raises(ValueError, match="freeze_layers=2 under trainer.lora leaves no layer for adapters"):
        Trainer(_tiny(tokenizer), TrainerConfig(lora=LORA, freeze_layers=2))
    for publish in ("adapter", "merged"):  # FSDP2 under LoRA: test_lora_fsdp.py
        TrainerConfig(lora=LoraConfig(rank=4, publish=publish), parallel="fsdp")
    with pytest.raises(ValidationError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValidationError, match="target_modules"):
        LoraConfig(target_modules=[])
    assert TrainerConfig().lora is None  # absent: full fine-tuning


def test_the_training_pool_publishes_merged_weights_and_resumes_from_its_adapter(tokenizer, tmp_path: Path):
    """TrainerService under LoRA (as the trainer process builds it: from_run): its weight source is the merged weights,
    its checkpoint the adapter, and from_run off that checkpoint has the base plus the saved adapter; the sync mode's
    construction (the built-in engine runs the trainer's own model) is refused."""
    from loomrl.config import load_config
    from loomrl.train_pool.service import TrainerService
    from loomrl.trainer.lora import MergedSource
    from loomrl.trainer_boundary import Carried

    cfg = load_config(None, [f"output_dir={tmp_path}", "name=lora", "model.kind=tiny", "trainer.lora.rank=4",
                           "trainer.lora.publish=merged", "runtime.mode=async"])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    pool, cpu = cfg.train_pool(), torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.lora needs runtime.mode=async"):
        TrainerService(pool, _tiny(tokenizer), tokenizer, device=cpu)
    service = TrainerService.from_run(pool, Carried(), None, cpu)
    assert isinstance(service.weight_source(torch.bfloat16, 1 << 20), MergedSource)
    with torch.no_grad():
        for p in service.trainer.lora.parameters():
            p.add_(0.01)  # a trained adapter's stand-in
    ckpt = service.checkpoint()
    assert not list(CheckpointFolder(ckpt).model.glob("model*.safetensors"))
    resumed = TrainerService.from_run(pool, Carried(), ckpt, cpu)
    want = _adapter_state(service.trainer)
    assert all(torch.equal(t, want[n]) for n, t in _adapter_state(resumed.trainer).items())


def test_adapters_start_the_same_whatever_the_generator_state(tokenizer):
    """Data-parallel ranks (processes with their own generator states) must start from the same adapters, or they
    drift apart at the first step: PEFT's random A is drawn from a fixed seed, and the caller's generator is untouched."""
    starts, draws = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        trainer = Trainer(_tiny(tokenizer), TrainerConfig(lora=LORA))
        starts.append(_adapter_state(trainer))
        draws.append(torch.rand(3))
    assert all(torch.equal(starts[0][n], starts[1][n]) for n in starts[0])
    assert not torch.equal(draws[0], draws[1])


def test_adapters_start_the_same_on_a_bfloat16_base(tokenizer):
    """FSDP2's rank 0 reads a bfloat16 model in bfloat16 (model/loader.py stored_dtype): its adapters must start from the
    same float32 A as on a float32 base (one rank, DDP), not from A rounded to bfloat16 as PEFT draws it."""
    from loomrl.trainer.lora import Lora

    base = _tiny(tokenizer)
    half = copy.deepcopy(base).to(torch.bfloat16)
    a, b = Lora(base, LORA), Lora(half, LORA)
    for name, layer in a.layers.items():
        wa, wb = layer.lora_A[ADAPTER].weight, b.layers[name].lora_A[ADAPTER].weight
        assert wb.dtype == torch.float32 and torch.equal(wa, wb), name
        assert not torch.equal(wa, wa.to(torch.bfloat16).float()), name  # the draw is not bfloat16-representable
