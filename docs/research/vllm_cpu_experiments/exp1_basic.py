"""Exp 1: AsyncLLM in-process, token ids in/out, logprobs (processed vs raw), stop tokens, timing."""
import asyncio
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

MODEL = os.environ.get("MODEL", "/work/notes/smollm2-hf")
DTYPE = os.environ.get("DTYPE", "float32")
MODE = os.environ.get("LOGPROBS_MODE", "processed_logprobs")


async def main():
    t0 = time.time()
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    t_import = time.time() - t0

    args = AsyncEngineArgs(
        model=MODEL, dtype=DTYPE, max_model_len=2048, enforce_eager=True,
        kv_cache_memory_bytes=1 << 30, logprobs_mode=MODE, seed=0,
        scheduling_policy="priority", enable_prefix_caching=True,
    )
    t1 = time.time()
    llm = AsyncLLM.from_engine_args(args)
    t_start = time.time() - t1
    print(f"import {t_import:.1f}s  engine start {t_start:.1f}s", flush=True)
    tok = llm.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}],
                                         add_generation_prompt=True, tokenize=True)
    if hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    prompt_ids = list(prompt_ids)
    print("prompt len", len(prompt_ids), "eos", tok.eos_token_id)

    async def run(params, rid, prompt=prompt_ids, priority=0):
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, rid, priority=priority):
            final = out
        return final

    # greedy
    g = await run(SamplingParams(temperature=0.0, max_tokens=40, logprobs=0), "greedy")
    c = g.outputs[0]
    print("GREEDY ids", list(c.token_ids))
    print("GREEDY text", repr(c.text), "finish", c.finish_reason, "stop_reason", c.stop_reason)
    print("GREEDY logprobs[0]", c.logprobs[0] if c.logprobs else None)
    print("weight_versions", c.weight_versions)

    # sampled, logprobs=0 -> only the sampled token's logprob
    s = await run(SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, logprobs=0, seed=1234), "sampled")
    c = s.outputs[0]
    lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
    print("SAMPLED ids", list(c.token_ids))
    print("SAMPLED lps", [round(x, 5) for x in lps])
    print("SAMPLED finish", c.finish_reason, c.stop_reason, "text", repr(c.text))
    import json
    json.dump({"prompt": prompt_ids, "greedy": list(g.outputs[0].token_ids), "ids": list(c.token_ids),
               "lps": lps, "mode": MODE}, open(f"/work/notes/exp/sampled_{MODE}_{DTYPE}.json", "w"))

    # throughput: 16 requests x 64 tokens, ignore_eos
    t2 = time.time()
    res = await asyncio.gather(*[run(SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=i), f"b{i}")
                                 for i in range(16)])
    dt = time.time() - t2
    ntok = sum(len(r.outputs[0].token_ids) for r in res)
    print(f"BATCH 16x64: {ntok} tokens in {dt:.2f}s = {ntok/dt:.1f} tok/s", flush=True)
    t2 = time.time()
    r = await run(SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), "single")
    dt = time.time() - t2
    print(f"SINGLE 1x64: {len(r.outputs[0].token_ids)/dt:.1f} tok/s", flush=True)
    import psutil
    p = psutil.Process()
    rss = p.memory_info().rss + sum(ch.memory_info().rss for ch in p.children(recursive=True))
    print(f"RSS parent+children {rss/2**30:.2f} GiB; children {[ch.name() for ch in p.children(recursive=True)]}")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
