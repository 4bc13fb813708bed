"""Exp 5a: vLLM greedy ids (4 prompts x 48 tokens, ignore_eos) for comparison with loomrl's builtin engine;
also start-up time and throughput with and without enforce_eager."""
import asyncio, json, os, sys, time
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
PROMPTS = ["What is 2+3? Answer briefly.", "Write a haiku about the sea.", "Name three colours.",
           "Explain what a prime number is in one sentence."]
EAGER = os.environ.get("EAGER", "1") == "1"

async def main():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    t = time.time()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model="/work/notes/smollm2-hf", dtype="float32", max_model_len=1024,
        enforce_eager=EAGER, kv_cache_memory_bytes=1 << 30, logprobs_mode="processed_logprobs", seed=0))
    print(f"eager={EAGER} start {time.time()-t:.1f}s", flush=True)
    tok = llm.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
               tokenize=True, return_dict=False)) for p in PROMPTS]
    async def run(pr, sp, rid):
        f = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=pr), sp, rid):
            f = o
        return f.outputs[0]
    outs = await asyncio.gather(*[run(p, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0), f"g{i}")
                                  for i, p in enumerate(prompts)])
    json.dump({"prompts": prompts, "ids": [list(o.token_ids) for o in outs],
               "lps": [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in outs]},
              open("/work/notes/exp/exp5_vllm_greedy.json", "w"))
    for n, T in ((1, 128), (16, 64), (32, 128)):
        t = time.time()
        res = await asyncio.gather(*[run(prompts[i % 4], SamplingParams(temperature=1.0, max_tokens=T, ignore_eos=True,
                                     seed=i), f"b{n}-{T}-{i}") for i in range(n)])
        dt = time.time() - t
        print(f"eager={EAGER} batch {n}x{T}: {n*T/dt:.1f} tok/s ({dt:.2f}s)", flush=True)
    llm.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
