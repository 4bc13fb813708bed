"""Exp 6: enforce_eager=False (torch.compile on CPU) start-up; priority!=0 under the default fcfs policy."""
import asyncio, os, time
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
async def main():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM
    t = time.time()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model="/work/notes/smollm2-hf", dtype="float32",
        max_model_len=1024, enforce_eager=os.environ.get("EAGER") == "1", kv_cache_memory_bytes=1 << 30))
    print(f"EAGER={os.environ.get('EAGER')} start {time.time()-t:.1f}s", flush=True)
    P = list(range(1000, 1040))
    try:
        async for o in llm.generate(TokensPrompt(prompt_token_ids=P), SamplingParams(max_tokens=4), "x", priority=5):
            pass
        print("fcfs + priority=5: accepted, finish", o.outputs[0].finish_reason)
    except Exception as e:
        print("fcfs + priority=5 raised:", type(e).__name__, e)
    async def run(i, T):
        async for o in llm.generate(TokensPrompt(prompt_token_ids=P), SamplingParams(temperature=1.0, max_tokens=T,
                                    ignore_eos=True, seed=i), f"b{T}-{i}-{time.time()}"):
            pass
    for n, T in ((1, 64), (1, 64), (16, 64), (16, 64)):
        t = time.time()
        await asyncio.gather(*[run(i, T) for i in range(n)])
        print(f"EAGER={os.environ.get('EAGER')} {n}x{T}: {n*T/(time.time()-t):.1f} tok/s", flush=True)
    llm.shutdown()
if __name__ == "__main__":
    asyncio.run(main())
