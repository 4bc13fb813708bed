"""Exp 2: which logprobs_mode gives the logprob of the distribution actually sampled from?
vLLM (both modes, one engine each) vs a transformers float32 forward of the same weights."""
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
MODEL = os.environ.get("MODEL", "/work/notes/smollm2-hf")
DTYPE = os.environ.get("DTYPE", "float32")
T, P = 0.7, 0.9
PROMPTS = ["What is 2+3? Answer briefly.", "Write a haiku about the sea.", "Name three colours.",
           "Explain what a prime number is in one sentence."]


async def vllm_samples(mode):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=MODEL, dtype=DTYPE, max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 29,
        logprobs_mode=mode, seed=0))
    tok = llm.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for p in PROMPTS]

    async def one(i, pr):
        final = None
        sp = SamplingParams(temperature=T, top_p=P, max_tokens=48, logprobs=0, seed=100 + i)
        async for out in llm.generate(TokensPrompt(prompt_token_ids=pr), sp, f"{mode}-{i}"):
            final = out
        c = final.outputs[0]
        return {"prompt": pr, "ids": list(c.token_ids), "lps": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]}

    res = await asyncio.gather(*[one(i, pr) for i, pr in enumerate(prompts)])
    llm.shutdown()
    return res


def reference(samples):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt"] + s["ids"]])
        with torch.no_grad():
            logits = m(ids).logits[0, len(s["prompt"]) - 1:-1].float()  # predicts each generated token
        raw = torch.log_softmax(logits, -1)
        scaled = logits / T
        probs = torch.softmax(scaled, -1)
        sp, si = probs.sort(-1, descending=True)
        before = sp.cumsum(-1) - sp
        keep_sorted = before < P
        keep = torch.zeros_like(keep_sorted).scatter(-1, si, keep_sorted)
        proc = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), -1)
        tgt = torch.tensor(s["ids"])
        out.append({"raw": raw.gather(1, tgt[:, None])[:, 0].tolist(),
                    "processed": proc.gather(1, tgt[:, None])[:, 0].tolist(),
                    "scaled_no_topp": torch.log_softmax(scaled, -1).gather(1, tgt[:, None])[:, 0].tolist(),
                    "in_topp": keep.gather(1, tgt[:, None])[:, 0].tolist()})
    return out


def compare(name, samples, refs):
    import math
    for key in ("raw", "processed", "scaled_no_topp"):
        diffs = [abs(a - b) for s, r in zip(samples, refs) for a, b in zip(s["lps"], r[key])]
        print(f"  vllm[{name}] vs ref[{key}]: max|diff|={max(diffs):.2e} mean={sum(diffs)/len(diffs):.2e} n={len(diffs)}")
    outside = sum(1 for r in refs for k in r["in_topp"] if not k)
    print(f"  sampled tokens outside the reference top-p set: {outside}")


if __name__ == "__main__":
    modes = sys.argv[1:] or ["processed_logprobs", "raw_logprobs"]
    results = {}
    for mode in modes:
        t = time.time()
        results[mode] = asyncio.run(vllm_samples(mode))
        print(f"{mode}: {sum(len(s['ids']) for s in results[mode])} tokens ({time.time()-t:.0f}s incl. start)", flush=True)
    json.dump(results, open(f"/work/notes/exp/exp2_{DTYPE}.json", "w"))
    for mode in modes:
        refs = reference(results[mode])
        print(f"== logprobs_mode={mode} dtype={DTYPE} T={T} top_p={P}")
        compare(mode, results[mode], refs)
    if len(modes) == 2:
        a, b = results[modes[0]], results[modes[1]]
        print("same sampled ids across modes (same seeds):", [x["ids"] == y["ids"] for x, y in zip(a, b)])
