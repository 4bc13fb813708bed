"""GPU smoke test of loomrl's training half, for any CUDA machine: `python scripts/gpu_smoke.py`.

Needs torch and transformers only (a GPU machine may have nothing else, and no network): it imports
loomrl's torch-level modules (the trainer's logprob paths, the chunked head, the FSDP2 sharding), none
of which needs the config layer. Prints one JSON line; each part reports its numbers or its error, and
one failing part does not stop the others.

  a  a tiny random Qwen3 under bf16 autocast: dense and tree-merged logprobs against a float32
     reference, finite gradients, the same loss and gradients with activation checkpointing on and off
  b  FSDP2 at world size 1 on a random model shaped like Qwen2.5-7B: one training step over 8 samples
     of 4k tokens (loomrl's sharded forward and chunked head, a policy-gradient surrogate loss, AdamW),
     peak memory, seconds; a torch.distributed.checkpoint save and reload of the model, compared
  c  tree-merged attention through FlexAttention (a block mask of the trie) against the SDPA segments:
     logprobs and gradients (the CPU has no FlexAttention backward, so only a GPU checks the gradients)
  d  one 32k-token sample through the chunked head (152k vocabulary): peak memory against the dense
     logits it never holds
  e  tokens/s of (b)'s step and its model FLOPs utilisation (6 x parameters x tokens / time / peak)
  f  runtime.weight_transport=cuda_ipc: a trainer process publishes bf16 snapshots of 7B-layer-sized weights as
     CUDA IPC handles (weights/ IpcPublisher); this process maps them (load_weights), compared
     exactly, timed (GB/s); a version that left the window is freed in the publisher. CUDA only

`--cpu` runs every part at toy sizes on the CPU, to check the script itself (its numbers say nothing
about a GPU). Budget: under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # loomrl from this checkout, uninstalled

from loomrl.trainer.forward import compute_context, enable_activation_checkpointing, token_logprobs  # noqa: E402
from loomrl.trainer.fsdp import fsdp_shard  # noqa: E402
from loomrl.trainer.head import chunked_logprobs  # noqa: E402
from loomrl.trainer.tree import tree_token_logprobs  # noqa: E402
from loomrl.types import TrainingSample  # noqa: E402

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16, NVIDIA's H200 SXM figure; other GPUs: pass --peak-tflops


def _samples(vocab: int, n: int, prompt: int, completion: int, seed: int = 0, vary: bool = True) -> list[TrainingSample]:
    """n samples sharing one prompt (a GRPO group), completions of different lengths (`vary`) or all as long."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prompt)]
    out = []
    for i in range(n):
        ids = shared + [rng.randrange(vocab) for _ in range(completion - vary * i * completion // (2 * n))]
        mask = [0] * prompt + [1] * (len(ids) - prompt)
        adv = 1.0 if i % 2 else -1.0
        out.append(TrainingSample(trajectory_id=f"s{i}", group_id="g", token_ids=ids, loss_mask=mask,
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

    def run(path, checkpointing: bool) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with bf16():
            logps = path(model, samples, with_grad=True)
            loss = _surrogate(logps, samples, tokens)
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return float(loss.detach()), torch.cat([lp.detach() for lp in logps]), grads

    loss_d, lp_d, g_d = run(token_logprobs, False)
    loss_t, lp_t, g_t = run(tree_token_logprobs, False)
    out["max_abs_dense_vs_fp32"] = float((lp_d - ref).abs().max())
    out["max_abs_tree_vs_fp32"] = float((lp_t - ref).abs().max())
    out["max_abs_dense_vs_tree"] = float((lp_d - lp_t).abs().max())
    out["grads_finite"] = all(bool(torch.isfinite(g).all()) for g in g_d + g_t)
    out["loss_dense"], out["loss_tree"] = loss_d, loss_t
    enable_activation_checkpointing(model)
    model.train()
    loss_c, _, g_c = run(token_logprobs, True)
    out["loss_checkpointing"] = loss_c
    out["loss_rel_diff_checkpointing"] = abs(loss_c - loss_d) / max(abs(loss_d), 1e-12)
    out["grad_max_rel_diff_checkpointing"] = max(float((a - b).norm() / b.norm().clamp_min(1e-12))
                                                 for a, b in zip(g_c, g_d))
    out["ok"] = (out["grads_finite"] and out["max_abs_dense_vs_fp32"] < 0.1 and out["max_abs_tree_vs_fp32"] < 0.1
                 and out["loss_rel_diff_checkpointing"] < 1e-2)
    return out


def part_c(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    samples = (_samples(cfg.vocab_size, 4, prompt=200, completion=120, seed=2)
               + _samples(cfg.vocab_size, 3, prompt=64, completion=300, seed=3))
    tokens = sum(sum(s.loss_mask) for s in samples)

    def run(flex: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logps = tree_token_logprobs(model, samples, with_grad=True, flex=flex)
        _surrogate(logps, samples, tokens).backward()
        return torch.cat([lp.detach() for lp in logps]), [p.grad.detach().clone() for p in model.parameters()]

    if device.type != "cuda":  # no FlexAttention backward on the CPU: the forward only
        with torch.no_grad():
            seg = torch.cat(tree_token_logprobs(model, samples, with_grad=False))
            flex = torch.cat(tree_token_logprobs(model, samples, with_grad=False, flex=True))
        return {"max_abs_logprob": float((seg - flex).abs().max()), "gradients": "not on the CPU"}
    (seg, g_seg), (flex, g_flex) = run(False), run(True)
    rel = max(float((a - b).norm() / b.norm().clamp_min(1e-12)) for a, b in zip(g_flex, g_seg))
    out = {"max_abs_logprob": float((seg - flex).abs().max()), "grad_max_rel_diff": rel}
    out["ok"] = out["max_abs_logprob"] < 1e-4 and rel < 1e-3
    return out


def _qwen25_7b_like(layers: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                       num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                       tie_word_embeddings=False, rope_theta=1e6)


def _memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _fsdp_step(device: torch.device, layers: int, n: int, seq: int, ckpt_dir: Path) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    cfg = _qwen25_7b_like(layers)
    if device.type != "cuda":  # toy size: the same code path
        cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 128, 256, 4096
        cfg.num_attention_heads, cfg.num_key_value_heads = 4, 2
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    params = sum(p.numel() for p in model.parameters())
    enable_activation_checkpointing(model)
    model.train()
    forward = fsdp_shard(model, param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    # fused on CUDA: foreach would allocate temporaries the size of all the parameters at once
    try:
        opt, kind = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda"), "fused"
    except (RuntimeError, TypeError):  # a torch whose fused AdamW does not take DTensors
        opt, kind = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False), "per-tensor"
    kind = kind if device.type == "cuda" else "default"
    samples = _samples(cfg.vocab_size, n, prompt=seq // 4, completion=seq - seq // 4, seed=1, vary=False)
    tokens = sum(len(s.token_ids) for s in samples)
    loss_tokens = sum(sum(s.loss_mask) for s in samples)
    ctx = compute_context("bfloat16" if device.type == "cuda" else "float32", device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for s in samples:  # one sample a micro-batch: activations of one 4k sequence at a time
        with ctx():
            loss = _surrogate(forward([s], False), [s], loss_tokens)
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_s = time.perf_counter() - t0
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    out = {"layers": layers, "params": params, "tokens": tokens, "step_s": step_s, "peak_gib": _memory(device),
           "optimizer": kind, "grad_norm": grad_norm, "grad_norm_finite": bool(torch.isfinite(torch.tensor(grad_norm)))}
    out.update(_dcp_roundtrip(model, ckpt_dir))
    return out


def _dcp_roundtrip(model: torch.nn.Module, folder: Path) -> dict[str, Any]:
    """The sharded model saved with torch.distributed.checkpoint, perturbed, reloaded: equal to what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    shutil.rmtree(folder, ignore_errors=True)
    before = {k: v.full_tensor().float().sum().item() for k, v in get_model_state_dict(model).items()}
    t0 = time.perf_counter()
    dcp.save(get_model_state_dict(model), checkpoint_id=str(folder))
    save_s = time.perf_counter() - t0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    state = get_model_state_dict(model)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state)
    load_s = time.perf_counter() - t0
    after = {k: v.full_tensor().float().sum().item() for k, v in get_model_state_dict(model).items()}
    size = sum(f.stat().st_size for f in folder.iterdir())
    shutil.rmtree(folder, ignore_errors=True)
    return {"dcp_save_s": save_s, "dcp_load_s": load_s, "dcp_gib": size / 2**30, "dcp_equal": before == after}


def part_b(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    ckpt = Path(args.scratch) / "dcp"
    n, seq = (8, 4096) if device.type == "cuda" else (2, 128)
    try:
        return _fsdp_step(device, args.layers, n, seq, ckpt)
    except torch.cuda.OutOfMemoryError as err:  # report it, then the same step at half the depth
        first = {"layers": args.layers, "error": f"OutOfMemoryError: {str(err).splitlines()[0]}"}
        torch.cuda.empty_cache()
        return {"full_depth": first, **_fsdp_step(device, args.layers // 2, n, seq, ckpt)}


def part_d(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    rows, hidden, vocab = (32768, 3584, 152064) if device.type == "cuda" else (2048, 128, 32000)
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device) * 0.02).requires_grad_()
    h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with compute_context("bfloat16", device)():
        logp = chunked_logprobs(h, weight, targets)
    logp.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {"rows": rows, "vocab": vocab, "seconds": time.perf_counter() - t0,
           "dense_fp32_logits_gib": rows * vocab * 4 / 2**30, "finite": bool(torch.isfinite(logp).all())}
    if device.type == "cuda":
        out["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return out


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

    from loomrl.weights.transports import load_weights  # imported on the CPU too: it needs no config layer

    if device.type != "cuda":
        return {"skipped": "CUDA IPC needs a GPU"}

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
        out["publisher_allocated_gib_after_v2"] = outbox.get(timeout=60) / 2**30  # one snapshot + v2's masters
        inbox.put("stop")
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return out


def part_e(b: dict[str, Any], peak_flops: float) -> dict[str, Any]:
    if "step_s" not in b:
        return {"error": "part b did not complete"}
    tps = b["tokens"] / b["step_s"]
    # 6 x N per token (forward + backward), not counting attention or the checkpointing's recompute
    return {"tokens_per_s": tps, "mfu": 6 * b["params"] * tps / peak_flops, "layers": b["layers"],
            "peak_tflops_assumed": peak_flops / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="toy sizes on the CPU: checks the script, not a GPU")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers of the 7B-shaped model (Qwen2.5-7B: 28)")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    ap.add_argument("--parts", default="abcdef")
    ap.add_argument("--scratch", default=None, help="folder for the checkpoint of part b (default: a temp dir)")
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
                              "torch": torch.__version__, "transformers": transformers.__version__}
    parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "f": part_f}
    t_all = time.perf_counter()
    for name in args.parts:
        t0 = time.perf_counter()
        if name == "e":
            result["e"] = part_e(result.get("b", {}), args.peak_tflops * 1e12)
            continue
        try:
            result[name] = parts[name](device, args)
        except Exception as err:  # noqa: BLE001 - reported in the JSON line; the other parts still run
            result[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
        result[name]["part_s"] = round(time.perf_counter() - t0, 2)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    if own_scratch:
        shutil.rmtree(args.scratch, ignore_errors=True)
    print(json.dumps(result))
    os._exit(0)  # no process-group teardown to hang on


if __name__ == "__main__":
    main()
