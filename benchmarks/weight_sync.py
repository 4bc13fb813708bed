"""Weight sync transports (loomrl/weights/): how long new weights take to go from the
trainer to an engine in another process, per transport and model size.

Sizes: the tests' tiny Llama (~3.2M parameters), a ~31M one, and SmolLM2-135M's shapes (~134M). The
tensors are random float32 tensors of those models' parameter shapes (a transport never looks at
the values), not trained weights.

Per transfer: the trainer publishes and sends the handle; the reader (a spawned process; for "ray" a
Ray actor, called with the handle) loads it into its own preallocated copy of the weights, as an
engine would (load_weights(handle, into=...)), and answers. The "ray" arm is this script's own:
ray.put at publish, ray.get and a copy into the weights in the reader (loomrl's Ray backend sends
the trainer actor's returned ObjectRef instead, with no publisher).
- publish_s: time inside publish() (the snapshot);
- load_s: time inside load_weights() (for "ray": ray.get and the copy) in the reader;
- total_s: from the start of publish to the reader's answer: handoff included (for "queue" that is
  where torch pickles every storage into shared memory).
--fsdp: the sharded trainer's (trainer.parallel=fsdp) publish path for a model of --fsdp-params parameters on gloo
ranks, three arms side by side, each in fresh processes: "old" (before issue 27: every parameter gathered and kept in
a float32 host copy on rank 0, then published in float32), "new" (GatheredSource: a bucket at a time, cast to bfloat16
as gathered, copied into the shm segment) and "gather" (the collectives alone: the time bound). Seconds per version
and the peak resident set of rank 0 above its baseline (the segment it writes counts), against the target: the
segment plus one bucket.

Bound: a plain clone of the same tensors in this process (one memory copy), measured in the same run;
efficiency = bound / total. A clone also pays for fresh pages (the kernel zeroes each one first), so
the copy into preallocated tensors is printed too, with the efficiency against it: every transport
copies at least twice (the snapshot and the reader's copy into its weights), so against that tighter
bound 0.5 is about the best it can reach; "file" adds the safetensors write, an fsync to the
folder's disk and a read. Medians over --repeats transfers after three warm-up ones.

--vllm (run it where vLLM is installed, e.g. `make test`'s .venv-vllm): a SmolLM2-135M update into vLLM from a shm
handle, the last hop of a run's weight sync, two ways side by side: "inline" (this process reads the segment, then
VLLMEngine.update_weights sends the buckets' bytes through vLLM's weight-transfer API into its worker process) and
"worker" (VLLMEngine.update_from: the worker maps the segment and loads from views of it), and a third arm,
"broadcast" (runtime.weight_transport=broadcast over gloo, timed from publish to settle); all pause, re-pack the
tied head, reset the prefix cache and resume. Timed from the call to its return, against the same clone bound.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bound_tolerance, divide, efficiency, machine, report  # noqa: E402

from loomrl.weights.handle import Transport, WeightHandle, WeightPublisher  # noqa: E402
from loomrl.weights.transports import load_weights, make_publisher

# Transfers left out of the medians: the shm publisher's segments (2 kept + 1 spare) are all made by
# then, and later versions rewrite them, as in a run.
WARMUP = 3
# (vocab, hidden, intermediate, layers, heads, kv heads); embeddings tied to the head, as in SmolLM2
SIZES = {
    "tiny": (49152, 64, 128, 2, 4, 2),
    "31m": (49152, 384, 1024, 8, 6, 2),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3),
}


def llama_shapes(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> dict[str, tuple]:
    kv = kv_heads * (hidden // heads)
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def _reader(shapes: dict[str, tuple], threads: int, handles, answers) -> None:
    torch.set_num_threads(threads)
    into = {n: torch.empty(s) for n, s in shapes.items()}  # the engine's weights
    answers.put("ready")
    while (handle := handles.get()) is not None:
        answers.put(load_weights(handle, into=into).load_s)


class RayPutPublisher(WeightPublisher):
    """The "ray" arm: ray.put into the object store, the handle holding the ObjectRef. The last `keep` refs stay
    held, as every publisher's window; older objects are freed by Ray's reference counting."""

    transport = Transport.RAY

    def _snapshot(self, source, version: int) -> tuple[Any, WeightHandle]:
        import ray

        # a bucket's tensors are valid until the next is asked for (weights/source.py): each is copied out as it passes
        weights = {n: t.detach().to("cpu", copy=True) for bucket in source.buckets() for n, t in bucket}
        ref = ray.put(weights)  # an immutable object in the store
        return ref, WeightHandle(transport=self.transport, version=version, nbytes=source.nbytes, payload=ref)


def _ray_reader_class():
    import ray

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self, shapes, threads):
            torch.set_num_threads(threads)
            self.into = {n: torch.empty(s) for n, s in shapes.items()}

        def load(self, handle):
            start = time.perf_counter()
            with torch.no_grad():
                for name, t in ray.get(handle.payload).items():
                    self.into[name].copy_(t)
            return time.perf_counter() - start

    return Reader


def measure(transport: Transport, weights: dict[str, torch.Tensor], repeats: int, folder: str | None) -> dict:
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    pub = RayPutPublisher(keep=2) if transport is Transport.RAY else make_publisher(transport, keep=2, folder=folder)
    publish, load, total = [], [], []
    if transport is Transport.RAY:
        import ray

        reader = _ray_reader_class().remote(shapes, torch.get_num_threads())
        ray.get(reader.__ray_ready__.remote())

        def send(handle):
            return ray.get(reader.load.remote(handle))
    else:
        ctx = mp.get_context("spawn")
        handles, answers = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_reader, args=(shapes, torch.get_num_threads(), handles, answers), daemon=True)
        child.start()
        assert answers.get(timeout=120) == "ready"

        def send(handle):
            handles.put(handle)
            return answers.get(timeout=300)
    try:
        for version in range(WARMUP + repeats):
            start = time.perf_counter()
            handle = pub.publish(weights, version)
            load_s = send(handle)
            if version >= WARMUP:
                total.append(time.perf_counter() - start)
                publish.append(handle.publish_s)
                load.append(load_s)
    finally:
        if transport is not Transport.RAY:
            handles.put(None)
            child.join(timeout=30)
        pub.close()
    return {"publish_s": statistics.median(publish), "load_s": statistics.median(load),
            "total_s": statistics.median(total)}


def copy_bounds(weights: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """(clone, copy into preallocated tensors): one memory copy, with and without fresh pages."""
    clones, copies = [], []
    into = {n: torch.empty_like(t) for n, t in weights.items()}
    for _ in range(repeats + 1):
        start = time.perf_counter()
        fresh = {n: t.clone() for n, t in weights.items()}
        clones.append(time.perf_counter() - start)
        del fresh
        start = time.perf_counter()
        for n, t in weights.items():
            into[n].copy_(t)
        copies.append(time.perf_counter() - start)
    return statistics.median(clones[1:]), statistics.median(copies[1:])


def measure_vllm(repeats: int) -> dict:
    """SmolLM2-135M's weights, published to shared memory, into a running VLLMEngine (engine.kind=vllm), both ways,
    interleaved, `repeats` times each after one warm-up: "inline" reads the segment in this process and sends the
    buckets' bytes through vLLM's sockets (load_weights + update_weights); "worker" hands vLLM's worker the segment,
    which it reads through views of its mapping (update_from)."""
    from loomrl.config import ModelConfig, load_config
    from loomrl.engine.factory import make_engine
    from loomrl.model.loader import load_model

    model, tokenizer = load_model(ModelConfig(kind="smollm2"))
    weights = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    bound, warm = copy_bounds(weights, repeats)
    cfg = load_config(None, ["engine.kind=vllm", "runtime.mode=async", "engine.vllm.max_model_len=2048",
                             f"engine.vllm.kv_cache_memory_bytes={256 << 20}", "engine.vllm.cpu_reserved_cores=0"])
    engine = make_engine(cfg.engine_setup(), model, tokenizer, 0)
    publisher = make_publisher("shm", keep=2)
    group = make_publisher("broadcast", receivers=1, bucket_bytes=cfg.engine.vllm.weight_bucket_bytes)
    times: dict[str, list[float]] = {"inline": [], "worker": [], "broadcast": []}
    version = 0
    try:
        for _ in range(repeats + 1):
            for arm in times:
                version += 1
                if arm == "broadcast":  # timed from the publish: the broadcast runs while the worker receives
                    start = time.perf_counter()
                    engine.update_from(group.publish(weights, version))
                    group.settle()
                    times[arm].append(time.perf_counter() - start)
                    continue
                handle = publisher.publish(weights, version)
                start = time.perf_counter()
                if arm == "inline":
                    engine.update_weights(load_weights(handle).weights, version)
                else:
                    engine.update_from(handle)
                times[arm].append(time.perf_counter() - start)
    finally:
        engine.close()
        publisher.close()
        group.close()
    inline, worker, broadcast = (statistics.median(times[a][1:]) for a in ("inline", "worker", "broadcast"))
    return {"params": sum(t.numel() for t in weights.values()), "bytes": nbytes, "inline_s": inline,
            "worker_s": worker, "broadcast_s": broadcast, "ratio_broadcast": inline / broadcast,
            "ratio": inline / worker, "gb_s": nbytes / worker / 1e9, "bound_s": bound,
            # no update can be faster than one copy of the weights: a speed above the clone's is a wrong bound
            "efficiency": efficiency(divide(1, worker, "1 / worker seconds"), divide(1, bound, "1 / clone seconds"),
                                     "weight_sync vllm worker"),
            "efficiency_inline": efficiency(divide(1, inline, "1 / inline seconds"), 1 / bound,
                                            "weight_sync vllm inline"),
            "efficiency_warm": warm / worker,
            "bucket_bytes": cfg.engine.vllm.weight_bucket_bytes}


# -- --fsdp: the sharded trainer's publish path, before and after issue 27 ------------------------------------------


def _rss_sampler(stop: Any, peak: list[int]) -> None:
    """Samples this process's resident set (anonymous and shared pages: shm segments it wrote count) every 5 ms."""
    while not stop.is_set():
        with open("/proc/self/statm") as f:
            peak[0] = max(peak[0], int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        stop.wait(0.005)


def _fsdp_rank(rank: int, world: int, port: int, arm: str, params: float, hidden: int, bucket_bytes: int,
               out: Any) -> None:
    """One trainer rank: a stack of hidden x hidden linear layers of `params` parameters in all, FSDP2-sharded over
    `world` gloo ranks (materialised after sharding: each rank only ever holds its shard), then one version published
    to shm the way `arm` says. Rank 0 reports seconds and its resident set's peak above the baseline."""
    import threading

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from loomrl.train_pool.distributed import Gather, GatheredSource, init_process_group
    from loomrl.weights.source import WeightSource

    torch.set_num_threads(1)
    init_process_group(rank, world, master_port=port, timeout_s=1800)
    layers = max(1, round(params / hidden**2))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.to_local().normal_(generator=g)
    dist.barrier()
    publisher = make_publisher("shm", keep=1, dtype=None if arm == "old" else torch.bfloat16,
                               bucket_bytes=bucket_bytes) if rank == 0 else None
    peak, stop = [0], threading.Event()
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    sampler = threading.Thread(target=_rss_sampler, args=(stop, peak), daemon=True)
    sampler.start()
    start = time.perf_counter()
    if arm == "old":  # what train_pool/distributed.py did before: every parameter gathered, rank 0 keeping a float32
        # host copy of the whole model, then published (in the trainer's float32, as the transports then did)
        weights = {}
        for name, p in model.named_parameters():
            full = p.full_tensor().detach()
            if rank == 0:
                weights[name] = full.to("cpu", copy=True)
        handle = publisher.publish(weights, 1) if rank == 0 else None
        del weights
    else:
        source: WeightSource = GatheredSource(model, Gather(None if arm == "gather" else "bfloat16", bucket_bytes),
                                              keep=rank == 0)
        if arm == "new" and rank == 0:
            handle = publisher.publish(source, 1)
        else:  # "gather": the collectives alone, the bound; followers take part in either
            for _ in source.buckets():
                pass
            handle = None
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    dist.barrier()
    if rank == 0:
        out.put({"arm": arm, "seconds": seconds, "peak_above_base": peak[0] - base,
                 "published_bytes": handle.nbytes if handle else 0,
                 "params": sum(p.numel() for p in model.parameters()), "layers": layers})
        publisher.close()
    dist.destroy_process_group()


def measure_fsdp(params: float, world: int, hidden: int, bucket_bytes: int, repeats: int) -> dict:
    """Each arm in fresh processes (a resident set's peak is per process), arms interleaved, `repeats` times."""
    from loomrl.train_pool.distributed import free_port

    ctx = mp.get_context("spawn")
    # glibc raises its mmap threshold as large blocks are freed (up to 32 MB), after which freed parameter-sized blocks
    # stay in the heap and a resident set measures the allocator's cache, not what is held: fixed at 1 MB here (read
    # when each rank's process starts), so that memory freed is memory returned.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    runs: dict[str, list[dict]] = {"gather": [], "old": [], "new": []}
    for _ in range(repeats):
        for arm in runs:
            out = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_fsdp_rank, args=(r, world, port, arm, params, hidden, bucket_bytes, out))
                     for r in range(world)]
            for proc in procs:
                proc.start()
            runs[arm].append(out.get(timeout=3600))
            for proc in procs:
                proc.join(120)
            print(f"  {arm}: {runs[arm][-1]['seconds']:.1f} s, peak {runs[arm][-1]['peak_above_base'] / 1e9:.2f} GB",
                  file=sys.stderr, flush=True)
    return {arm: {"seconds": statistics.median(r["seconds"] for r in rs),
                  "peak_above_base": max(r["peak_above_base"] for r in rs),
                  "published_bytes": rs[0]["published_bytes"], "params": rs[0]["params"], "layers": rs[0]["layers"]}
            for arm, rs in runs.items()}


def fsdp_report(args: argparse.Namespace) -> None:
    r = measure_fsdp(args.fsdp_params, args.fsdp_world, args.fsdp_hidden, args.fsdp_bucket, args.repeats)
    params = r["new"]["params"]
    fp32 = params * 4
    held = r["new"]["published_bytes"]  # the shm segment, bfloat16: what the transport itself holds
    target = held + args.fsdp_bucket
    ratio_s = divide(r["old"]["seconds"], r["new"]["seconds"], "old seconds / new seconds")
    # the gather alone is the bound: publishing can only add to it
    gather_eff = efficiency(divide(r["gather"]["seconds"], r["new"]["seconds"], "gather seconds / new seconds"), 1.0,
                            "weight_sync fsdp new against the gather alone")
    ratio_mem = r["old"]["peak_above_base"] / r["new"]["peak_above_base"]
    report({"name": "weight_sync_fsdp", "machine": machine(),
            "weights": f"random float32 parameters of {params / 1e9:.2f}B in {r['new']['layers']} linear "
                       f"layers of {args.fsdp_hidden}x{args.fsdp_hidden}, FSDP2-sharded over {args.fsdp_world} gloo "
                       "ranks (processes of this machine), one version published to shm per run",
            "repeats": args.repeats, "ratio_seconds": round(ratio_s, 2), "ratio_host_memory": round(ratio_mem, 2),
            "ratio_over": "new (old / new)", "arms": r,
            "details": [
                f"gather only (every parameter's full_tensor, dropped; the bound): {r['gather']['seconds']:.1f} s, peak "
                f"host memory above baseline {r['gather']['peak_above_base'] / 1e9:.2f} GB",
                f"old (rank 0 keeps a float32 host copy, then publishes it in float32): {r['old']['seconds']:.1f} s, "
                f"peak host memory above baseline {r['old']['peak_above_base'] / 1e9:.2f} GB "
                f"(analytic: copy + segment = 2 x {fp32 / 1e9:.2f} GB)",
                f"new (a bucket of {args.fsdp_bucket / 1e6:.0f} MB at a time, cast to bfloat16 as gathered, copied into "
                f"the segment): {r['new']['seconds']:.1f} s, peak host memory above baseline "
                f"{r['new']['peak_above_base'] / 1e9:.2f} GB (target: segment {held / 1e9:.2f} GB + one bucket = "
                f"{target / 1e9:.2f} GB; efficiency {target / r['new']['peak_above_base']:.2f})",
                f"seconds: old / new {ratio_s:.2f}, efficiency of new against the gather alone "
                f"{gather_eff:.2f}; host memory: old / new {ratio_mem:.2f}"]},
           args.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--transports", nargs="+", choices=[t.value for t in Transport], default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--folder", default=None, help="folder of the file transport (default: a new temp folder)")
    ap.add_argument("--quick", action="store_true", help="tiny and 31m only, 3 repeats")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of the trainer and the reader (0: torch's default). On a shared, busy "
                         "machine 1 is steadier: a descheduled OpenMP thread leaves the others spinning")
    ap.add_argument("--vllm", action="store_true", help="only the update of SmolLM2-135M into vLLM (engine.kind=vllm)")
    ap.add_argument("--fsdp", action="store_true",
                    help="only the sharded trainer's publish path, before and after (seconds, peak host memory)")
    ap.add_argument("--fsdp-params", type=float, default=1.5e9)
    ap.add_argument("--fsdp-hidden", type=int, default=4096)
    ap.add_argument("--fsdp-world", type=int, default=2)
    ap.add_argument("--fsdp-bucket", type=int, default=64 << 20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.fsdp:
        fsdp_report(args)
        return
    if args.vllm:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        r = measure_vllm(args.repeats)
        report({"name": "weight_sync_vllm", "machine": machine(),
                "weights": "SmolLM2-135M-Instruct's own float32 weights, published to shm under a new version each "
                           "time, then loaded into vLLM inline (this process reads, the bytes go through vLLM's "
                           "sockets) or by vLLM's worker (it maps the segment)",
                "repeats": args.repeats, "update_s": round(r["worker_s"], 4), "ratio": round(r["ratio"], 2),
                "ratio_over": "inline", "gb_s": round(r["gb_s"], 3), "efficiency": round(r["efficiency"], 3),
                "arms": r,
                "details": [f"{r['params'] / 1e6:.1f}M params, {r['bytes'] / 1e6:.0f} MB float32",
                            f"inline (load_weights + update_weights, buckets of {r['bucket_bytes'] / 1e6:.0f} MB): "
                            f"{r['inline_s']:.2f} s, efficiency {r['efficiency_inline']:.3f}",
                            f"worker (update_from: vLLM's worker reads the segment): {r['worker_s']:.2f} s "
                            f"({r['gb_s']:.2f} GB/s), efficiency {r['efficiency']:.3f} (vs the preallocated copy "
                            f"{r['efficiency_warm']:.3f})",
                            f"broadcast (gloo, a process group with vLLM's worker; NCCL on GPUs): "
                            f"{r['broadcast_s']:.2f} s, ratio inline / broadcast {r['ratio_broadcast']:.2f}",
                            f"ratio inline / worker: {r['ratio']:.2f}; bound: one copy (clone) "
                            f"{r['bound_s'] * 1e3:.1f} ms"]},
               args.json)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = ["tiny", "31m"] if args.quick else args.sizes
    repeats = 3 if args.quick else args.repeats
    try:
        import ray
    except ImportError:
        ray = None
    # an arm whose machinery is absent here (ray, a CUDA GPU for cuda_ipc) is skipped and listed under "skipped", and
    # so is broadcast: only an engine's workers receive it (load_weights refuses it); --vllm measures it
    usable = [t for t in Transport if (ray is not None or t is not Transport.RAY)
              and (torch.cuda.is_available() or t is not Transport.CUDA_IPC) and t is not Transport.BROADCAST]
    transports = [t for t in usable if args.transports is None or t.value in args.transports]
    skipped = [t.value for t in Transport if t not in usable]
    if Transport.RAY in transports:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    arms: dict[str, dict] = {}
    details = []
    try:
        for size in sizes:
            g = torch.Generator().manual_seed(0)
            weights = {n: torch.randn(s, generator=g) for n, s in llama_shapes(*SIZES[size]).items()}
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            params = sum(t.numel() for t in weights.values())
            bound, warm = copy_bounds(weights, repeats)
            arms[size] = {"params": params, "bytes": nbytes, "bound_s": bound, "bound_gb_s": nbytes / bound / 1e9,
                          "warm_copy_s": warm}
            details.append(f"{size}: {params / 1e6:.1f}M params, {nbytes / 1e6:.0f} MB float32; copy bound (clone) "
                           f"{bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.2f} GB/s); copy into preallocated "
                           f"tensors {warm * 1e3:.1f} ms ({nbytes / warm / 1e9:.2f} GB/s)")
            for transport in transports:
                r = measure(transport, weights, repeats, args.folder)
                # no transport can be faster than one copy of the weights (the clone bound)
                speed = divide(1, r["total_s"], f"{size} {transport.value}: 1 / total seconds")
                eff = efficiency(speed, divide(1, bound, f"{size}: 1 / clone seconds"),
                                 f"weight_sync {size} {transport.value}", bound_tolerance(args.quick))
                r |= {"gb_s": nbytes / r["total_s"] / 1e9, "efficiency": eff,
                      "efficiency_warm": warm / r["total_s"]}
                arms[size][transport.value] = r
                details.append(f"  {transport.value:5s}  publish {r['publish_s'] * 1e3:8.1f} ms  load "
                                f"{r['load_s'] * 1e3:8.1f} ms  total {r['total_s'] * 1e3:8.1f} ms  "
                                f"{r['gb_s']:6.2f} GB/s  efficiency {r['efficiency']:.2f} "
                                f"(vs the preallocated copy {r['efficiency_warm']:.2f})")
            del weights
    finally:
        if Transport.RAY in transports:
            ray.shutdown()
    largest = arms[sizes[-1]]
    best = max(transports, key=lambda t: largest[t.value]["efficiency"])
    report({
        "name": "weight_sync",
        "machine": machine(),
        "weights": "random float32 tensors with the models' parameter shapes (not trained weights)",
        "transports": [t.value for t in transports],
        "skipped": skipped or "none",
        "repeats": repeats,
        "best": f"{best.value} at {sizes[-1]}",
        "efficiency": round(largest[best.value]["efficiency"], 3),
        "gb_s": round(largest[best.value]["gb_s"], 3),
        "summary_of": f"the most efficient transport at the largest size ({sizes[-1]})",
        "arms": {s: {k: ({m: round(x, 5) for m, x in v.items()} if isinstance(v, dict) else
                         round(v, 5) if isinstance(v, float) else v) for k, v in a.items()} for s, a in arms.items()},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
