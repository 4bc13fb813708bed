"""Loading FSDP2 trainer ranks from rank 0's whole state (trainer/rank0_load.py) against today's path, where every rank
loads the whole model itself and shards it: two gloo ranks, tiny Llama, Qwen2 (biases), Qwen3-MoE and Qwen3 models.
Every rank's shards, buffers (the rotary inv_freq) and a forward's logprobs equal the old path's bit for bit, under LoRA
too (rank 0's fresh adapters on every rank) and with an offloaded KL reference; one train step after loading equals the
old path's; rank 1 allocates no full-size tensor before its shards exist; a checkpoint resumes."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from dist_launch import launch_local
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from loomrl.config import ModelConfig, TrainerConfig
from loomrl.types import TrainingSample

pytestmark = pytest.mark.integration  # starts processes: not in `make test-fast`

CASES = [("llama", {"loss": {"kind": "ppo_clip", "kl": "k3", "kl_coef": 0.1}, "kl_reference_offload": True}),
         ("qwen2", {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}),
         ("qwen3_moe", {}),
         ("qwen3", {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]}, "freeze_layers": 1})]


def _samples(vocab: int) -> list[TrainingSample]:
    rng = random.Random(0)
    out = []
    for i in range(4):
        ids = [rng.randrange(vocab) for _ in range(6 + 2 * i)]
        mask = [0] * 3 + [1] * (len(ids) - 3)
        out.append(TrainingSample(trajectory_id=f"s{i}", group_id="g", token_ids=ids, loss_mask=mask,
                                  behaviour_logprobs=[-10.8 * m for m in mask], versions=[0] * len(ids),
                                  advantages=[(1.0 if i % 2 else -1.0) * m for m in mask]))
    return out


class _FullSizeAudit(TorchDispatchMode):
    """Records every tensor an op makes off the meta device with at least `numel` elements (a whole parameter's
    size) while `armed`; `armed` is switched off by the first to_empty (the shards being allocated)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.armed, self.seen = numel, True, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if self.armed and isinstance(t, torch.Tensor) and not t.is_meta and t.numel() >= self.numel:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _build(rank: int, arch: str, options: dict, new: bool, start: ModelConfig | None = None):
    from loomrl.model.loader import load_rank_model
    from loomrl.train_pool.distributed import DataParallelTrainer
    from loomrl.train_pool.ranks import build_trainer

    start = start or ModelConfig(kind="tiny", tiny={"arch": arch})
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, parallel="fsdp", world_size=2 if new else 1, **options)
    if not (new and rank == 1):
        model, tok = load_rank_model(start, None, trainer=cfg, rank0=rank == 0)
        return DataParallelTrainer(build_trainer(cfg, start, torch.device("cpu"), model, None)), len(tok), None
    # a whole parameter's size: the smallest matrix of the model (here the k/v projections)
    skeleton, tok = load_rank_model(start, None, trainer=cfg, rank0=False)
    audit = _FullSizeAudit(min(p.numel() for p in skeleton.parameters() if p.dim() == 2))
    to_empty = torch.nn.Module.to_empty

    def disarm(module, *, device, recurse=True):
        audit.armed = False
        return to_empty(module, device=device, recurse=recurse)

    torch.nn.Module.to_empty = disarm  # type: ignore[method-assign]
    try:
        with audit:  # loading and building, until the shards are allocated
            model, tok = load_rank_model(start, None, trainer=cfg, rank0=False)
            assert all(p.is_meta for p in model.parameters())
            trainer = build_trainer(cfg, start, torch.device("cpu"), model, None)
    finally:
        torch.nn.Module.to_empty = to_empty  # type: ignore[method-assign]
    return DataParallelTrainer(trainer), len(tok), audit


def _state(dp, samples) -> dict:
    trainer = dp.trainer
    with torch.no_grad():
        logprobs = [lp.detach().clone() for lp in trainer.forward(samples[:2], False)]
        ref = [lp.detach().clone() for lp in trainer.ref_forward(samples[:2], False)] if trainer.ref_forward else []
    return {"params": {n: _local(p) for n, p in trainer.model.named_parameters()},
            "buffers": {n: _local(b) for n, b in trainer.model.named_buffers()},
            "adapters": {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()
                         if "lora_" in n},
            "logprobs": logprobs, "ref": ref}


def _rank(rank: int, world: int) -> list:
    out = []
    for arch, options in CASES:
        old, vocab, _ = _build(rank, arch, options, new=False)
        new, _, audit = _build(rank, arch, options, new=True)
        samples = _samples(vocab)
        mine = samples[:3] if rank == 0 else samples[3:]
        before = (_state(old, samples), _state(new, samples))
        steps = (old.train_step(copy.deepcopy(mine)).loss, new.train_step(copy.deepcopy(mine)).loss)
        after = (_state(old, samples), _state(new, samples))
        out.append({"before": before, "after": after, "losses": steps, "audit": audit.seen if audit else None,
                    "meta_refs": new.trainer.ref_model is not None})
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a["params"].keys() == b["params"].keys(), what
    for kind in ("params", "buffers", "adapters"):
        for name, t in a[kind].items():
            assert torch.equal(t, b[kind][name]), (what, kind, name)
    for x, y in zip(a["logprobs"] + a["ref"], b["logprobs"] + b["ref"], strict=True):
        assert torch.equal(x, y), what


def test_rank0_load_equals_every_rank_loading_the_whole_model():
    ranks = launch_local(_rank, 2, timeout_s=600, threads=1)
    for (arch, options), r0, r1 in zip(CASES, *ranks):
        for rank, r in enumerate((r0, r1)):
            what = f"{arch} {options} rank {rank}"
            _same(*r["before"], what + " after loading")
            _same(*r["after"], what + " after a step")
            assert r["losses"][0] == r["losses"][1], what
            assert any("inv_freq" in n for n in r["before"][1]["buffers"]), what
        # rank 0's adapters on every rank (whole tensors, gathered)
        for name, t in r0["before"][1]["adapters"].items():
            assert torch.equal(t, r1["before"][1]["adapters"][name]), (arch, name)
        assert ("lora" in options) == bool(r0["before"][1]["adapters"]), arch
        assert r1["audit"] == [], (arch, r1["audit"][:3])  # no whole-size tensor on rank 1 before its shards exist
    assert ranks[0][0]["meta_refs"]  # the KL case has a reference of its own, filled from the policy's shards


def _resume_rank(rank: int, world: int, run_dir: str, options: dict) -> tuple[list[float], list[float], dict]:
    """Per rank, loaded from rank 0: 3 steps straight, and 2 steps + a checkpoint + fresh trainers from it + 1 step."""
    import torch.distributed as dist

    from loomrl.config import RunConfig
    from loomrl.model.loader import load_rank_model
    from loomrl.train_pool.distributed import DataParallelTrainer, Gather
    from loomrl.train_pool.ranks import build_trainer
    from loomrl.trainer.checkpoint import latest_checkpoint, save_checkpoint
    from loomrl.trainer.fsdp import save_sharded_optimizer
    from loomrl.trainer.lora import base_checkpoint

    cfg = RunConfig.model_validate({"model": {"kind": "tiny"}, "runtime": {"mode": "async"}, "output_dir": run_dir,
                                    "trainer": {"lr": 1e-4, "micro_batch_size": 2, "parallel": "fsdp",
                                                "world_size": 2, **options}})

    def trainer(ckpt=None) -> DataParallelTrainer:
        # as Follower and TrainerService.from_run load it: under LoRA the base (the checkpoint holds the adapter)
        model = load_rank_model(cfg.model, base_checkpoint(cfg.trainer.lora, ckpt), trainer=cfg.trainer,
                                rank0=rank == 0)[0]
        return DataParallelTrainer(build_trainer(cfg.trainer, cfg.model, torch.device("cpu"), model, ckpt))

    tok_len = len(load_rank_model(cfg.model, None, trainer=cfg.trainer, rank0=False)[1])
    samples = _samples(tok_len)
    mine = samples[:3] if rank == 0 else samples[3:]

    def steps(dp: DataParallelTrainer, n: int) -> list[float]:
        return [dp.train_step(copy.deepcopy(mine)).loss for _ in range(n)]

    straight = trainer()
    want = steps(straight, 3)
    first = trainer()
    got = steps(first, 2)
    t = first.trainer
    everything = Gather(None, 1 << 20, everything=True)
    lora = t.lora
    if rank == 0:
        tok = load_rank_model(cfg.model, None, trainer=cfg.trainer, rank0=False)[1]
        save_checkpoint(cfg.run_dir, 2, model=t.model, tokenizer=tok, optimizer=t.optimizer, scheduler=t.scheduler,
                        state={}, weights=None if lora else first.gathered(everything),
                        adapter=lora.save if lora else None, shards=lambda folder: save_sharded_optimizer(t, folder))
    else:  # rank 0's save_checkpoint gathers the model folder (or the adapter), then writes this rank's part here
        if lora is not None:
            lora.save(cfg.run_dir / "not-written")
        else:
            for _ in first.gathered(everything).buckets():
                pass
        save_sharded_optimizer(t, cfg.run_dir / "checkpoints" / ".tmp_step_000002" / "optimizer")
    dist.barrier()
    resumed = trainer(latest_checkpoint(cfg.run_dir))
    assert resumed.trainer.step == 2
    got += steps(resumed, 1)
    full = {n: p.full_tensor().detach().clone() for n, p in straight.trainer.model.named_parameters()}
    return want, got, {n: (full[n], p.full_tensor().detach().clone())
                       for n, p in resumed.trainer.model.named_parameters()}


@pytest.mark.parametrize("options", [{"loss": {"kind": "decoupled_ppo", "kl": "k3", "kl_coef": 0.1}},
                                     {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}])
def test_rank0_load_resumes_from_a_checkpoint(tmp_path, options):
    for rank, (want, got, weights) in enumerate(launch_local(_resume_rank, 2, (str(tmp_path), options),
                                                             timeout_s=300, threads=1)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), rank
        for name, (a, b) in weights.items():
            assert float((a - b).abs().max()) < 1e-6, (rank, name)


def test_copy_shards_puts_the_buffers_where_the_forward_runs_when_the_shards_are_offloaded():
    """An offloaded KL reference: its shards in host memory, its buffers on the compute device (FSDP's CPU offload moves
    parameters only; a router's correction bias used in place must sit where the inputs are). On this CPU machine the
    compute device stands in as `meta`: the check is where each tensor ends up, and that the parameters are copied."""
    from loomrl.model.loader import build_tiny_model
    from loomrl.trainer.rank0_load import _to_meta, copy_shards

    source = build_tiny_model(ModelConfig(kind="tiny"), 64, 0)
    # untied: unsharded, to_empty makes a Parameter per module (sharded, FSDP swaps them in place and ties hold)
    source.lm_head.weight = torch.nn.Parameter(source.lm_head.weight.detach().clone())
    target = copy.deepcopy(source)
    _to_meta(target)  # ties kept, as rank 0's model before sharding
    copy_shards(source, target, torch.device("cpu"), buffers_on=torch.device("meta"))
    assert all(p.device.type == "cpu" for p in target.parameters())
    assert all(torch.equal(p, q) for p, q in zip(target.parameters(), source.parameters(), strict=True))
    buffers = list(target.buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers)
    again = copy.deepcopy(source)
    _to_meta(again)
    copy_shards(source, again, torch.device("cpu"))  # not offloaded: the buffers stay with the shards, rebuilt
    assert all(b.device.type == "cpu" for b in again.buffers())
    assert all(torch.equal(a, b) for a, b in zip(again.buffers(), source.buffers(), strict=True))


def _bf16_rank(rank: int, world: int, folder: str) -> dict:
    from loomrl.model.loader import load_rank_model, stored_dtype

    start = ModelConfig(kind="hf", path=folder)
    cfg = TrainerConfig(parallel="fsdp", world_size=2)
    read = load_rank_model(start, None, trainer=cfg, rank0=rank == 0)[0]
    options = {"loss": {"kind": "ppo_clip", "kl": "k3", "kl_coef": 0.1}}
    old, vocab, _ = _build(rank, "qwen2", options, new=False, start=start)
    new, _, _ = _build(rank, "qwen2", options, new=True, start=start)
    samples = _samples(vocab)
    before = (_state(old, samples), _state(new, samples))
    mine = samples[:3] if rank == 0 else samples[3:]
    losses = (old.train_step(copy.deepcopy(mine)).loss, new.train_step(copy.deepcopy(mine)).loss)
    return {"stored": stored_dtype(start), "read": {p.dtype for p in read.parameters()}, "before": before,
            "after": (_state(old, samples), _state(new, samples)), "losses": losses,
            "masters": {p.dtype for p in new.trainer.model.parameters()}, "config": new.trainer.model.config.dtype}


def test_rank0_reads_a_bfloat16_model_in_bfloat16_and_every_rank_trains_float32_masters(tmp_path):
    """A bfloat16 model (most on the Hub): rank 0 holds its whole state in bfloat16 (half the host memory), every rank's
    shards are float32 and equal, bit for bit, to every rank reading the model whole in float32; one step too."""
    from loomrl.model.loader import build_tiny_model, load_tokenizer

    tiny = ModelConfig(kind="tiny", tiny={"arch": "qwen2"})
    tok = load_tokenizer(tiny)
    build_tiny_model(tiny, len(tok), tok.eos_token_id).to(torch.bfloat16).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    r0, r1 = launch_local(_bf16_rank, 2, (str(tmp_path),), timeout_s=300, threads=1)
    assert r0["stored"] == torch.bfloat16 and r0["read"] == {torch.bfloat16}  # rank 0's whole model, as stored
    assert r1["read"] == {torch.float32}  # rank 1's skeleton (meta)
    for rank, r in enumerate((r0, r1)):
        _same(*r["before"], f"rank {rank} after loading")
        _same(*r["after"], f"rank {rank} after a step")
        assert r["losses"][0] == r["losses"][1] and r["masters"] == {torch.float32}, rank
        assert r["config"] == torch.float32, rank  # what a checkpoint's config.json will say of its tensors


def test_stored_dtype_reads_the_tensors_not_the_config(tmp_path):
    """float32 tensors under a config that says bfloat16 (a loomrl checkpoint written before this fix): float32, so
    that a resume never rounds its masters; a folder without safetensors: float32."""
    from loomrl.model.loader import build_tiny_model, load_tokenizer, stored_dtype

    tiny = ModelConfig(kind="tiny")
    tok = load_tokenizer(tiny)
    model = build_tiny_model(tiny, len(tok), tok.eos_token_id)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp_path / "f32")
    tok.save_pretrained(tmp_path / "f32")
    assert stored_dtype(ModelConfig(kind="hf", path=str(tmp_path / "f32"))) == torch.float32
    model.to(torch.float16).save_pretrained(tmp_path / "f16")
    assert stored_dtype(ModelConfig(kind="hf", path=str(tmp_path / "f16"))) == torch.float16
    assert stored_dtype(tiny) == torch.float32


@pytest.mark.parametrize(("tensors", "want"), [
    ({"w": torch.bfloat16, "steps": torch.int64, "mask": torch.bool}, torch.bfloat16),  # integers are not floats
    ({"w": torch.bfloat16, "router_bias": torch.float32}, torch.float32),  # mixed: whole in float32
    ({"w": torch.bfloat16, "scale": torch.float8_e4m3fnuz}, torch.float32),  # any other float type counts too
    ({"w": torch.float16}, torch.float16)])
def test_stored_dtype_is_one_half_precision_only_when_every_float_has_it(tmp_path, tensors, want):
    from safetensors.torch import save_file

    from loomrl.model.loader import stored_dtype

    save_file({name: torch.zeros(2, dtype=dtype) for name, dtype in tensors.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert stored_dtype(ModelConfig(kind="hf", path=str(tmp_path))) == want
