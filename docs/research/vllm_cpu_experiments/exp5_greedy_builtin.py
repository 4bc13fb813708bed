"""Exp 5b (MAIN venv): loomrl's builtin engine greedy on the same prompts; compare with vLLM's."""
import asyncio, json, time
import torch
from loomrl.config import ModelConfig
from loomrl.model.loader import load_model
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.base import GenerationRequest, SamplingParams
d = json.load(open("/work/notes/exp/exp5_vllm_greedy.json"))
m, tok = load_model(ModelConfig(kind="smollm2"))
eng = BuiltinEngine(m, eos_token_id=tok.eos_token_id)
async def main():
    t = time.time()
    res = await asyncio.gather(*[eng.generate(GenerationRequest(prompt_ids=p, sampling=SamplingParams(
        temperature=0.0, max_tokens=48, ignore_eos=True))) for p in d["prompts"]])
    print(f"builtin 4x48 greedy {time.time()-t:.2f}s")
    for i, r in enumerate(res):
        v = d["ids"][i]
        n = next((k for k, (a, b) in enumerate(zip(r.token_ids, v)) if a != b), len(v))
        dl = max(abs(a - b) for a, b in zip(r.logprobs[:n], d["lps"][i][:n])) if n else 0
        print(f"prompt {i}: equal={r.token_ids == v} first_diff_at={n if n < len(v) else None} max|dlp| over equal prefix={dl:.1e}")
    for n, T in ((1, 128), (16, 64), (32, 128)):
        t = time.time()
        await asyncio.gather(*[eng.generate(GenerationRequest(prompt_ids=d["prompts"][i % 4], sampling=SamplingParams(
            temperature=1.0, max_tokens=T, ignore_eos=True, seed=i))) for i in range(n)])
        dt = time.time() - t
        print(f"builtin batch {n}x{T}: {n*T/dt:.1f} tok/s ({dt:.2f}s)")
    eng.close()
asyncio.run(main())
