"""Exp 3: stop tokens, priority scheduling, abort, pause_generation (abort / keep), weight-version spans,
reset_prefix_cache, sleep / wake_up on CPU."""
import asyncio
import os
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
MODEL = os.environ.get("MODEL", "/work/notes/smollm2-hf")


async def main():
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=MODEL, dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 29,
        logprobs_mode="processed_logprobs", seed=0, scheduling_policy="priority", max_num_seqs=1))
    tok = llm.tokenizer
    P = list(tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False))

    async def run(sp, rid, prompt=P, priority=0):
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid, priority=priority):
            final = out
        return final

    def show(tag, o):
        c = o.outputs[0]
        print(f"{tag}: ids={list(c.token_ids)} text={c.text!r} finish={c.finish_reason} stop_reason={c.stop_reason} "
              f"nlp={len(c.logprobs) if c.logprobs else None} wv={c.weight_versions}", flush=True)

    print("===== 2. stop tokens")
    show("default(eos)", await run(SamplingParams(temperature=0, max_tokens=20), "s1"))
    show("skip_special_tokens=False", await run(SamplingParams(temperature=0, max_tokens=20,
                                                                skip_special_tokens=False), "s2"))
    show("stop_token_ids=[314] ('is'?)", await run(SamplingParams(temperature=0, max_tokens=20,
                                                                     stop_token_ids=[314]), "s3"))
    show("stop=['is']", await run(SamplingParams(temperature=0, max_tokens=20, stop=[" is"]), "s4"))
    show("stop=['is'] include_stop_str_in_output", await run(SamplingParams(
        temperature=0, max_tokens=20, stop=[" is"], include_stop_str_in_output=True), "s5"))
    show("ignore_eos max_tokens=10", await run(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), "s6"))
    print("tokens 314 ->", repr(tok.decode([314])), "2 ->", repr(tok.decode([2])))

    print("===== 3. priority (max_num_seqs=1, so only one runs at a time)")
    order = []

    async def prio(rid, pr):
        await run(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), rid, priority=pr)
        order.append((rid, pr))

    first = asyncio.create_task(prio("first", 0))
    await asyncio.sleep(0.3)
    tasks = [asyncio.create_task(prio(f"p{p}", p)) for p in (5, 0, -3, 2)]
    await asyncio.gather(first, *tasks)
    print("completion order (rid, priority):", order, flush=True)

    print("===== 4a. abort mid-generation")
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=200, ignore_eos=True, logprobs=0, seed=7)
    seen = []

    async def long(rid, sp=sp):
        last = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=P), sp, rid):
            last = out
            seen.append((rid, len(out.outputs[0].token_ids), out.finished))
        return last

    t = asyncio.create_task(long("ab"))
    while not seen or seen[-1][1] < 15:
        await asyncio.sleep(0.01)
    await llm.abort("ab")
    o = await t
    c = o.outputs[0]
    print(f"after abort: finished={o.finished} finish_reason={c.finish_reason} ntok={len(c.token_ids)} "
          f"nlogprobs={len(c.logprobs)} wv={c.weight_versions}", flush=True)

    print("===== 4b. pause_generation(mode='abort')")
    seen.clear()
    t = asyncio.create_task(long("pa"))
    while not seen or seen[-1][1] < 10:
        await asyncio.sleep(0.01)
    await llm.pause_generation(mode="abort")
    o = await t
    c = o.outputs[0]
    print(f"pause abort: finish_reason={c.finish_reason} ntok={len(c.token_ids)} nlp={len(c.logprobs)} "
          f"paused={await llm.is_paused()}", flush=True)
    # a request submitted while paused waits for resume
    t2 = asyncio.create_task(run(SamplingParams(temperature=0, max_tokens=5), "while-paused"))
    await asyncio.sleep(1.0)
    print("request submitted while paused done after 1s?", t2.done())
    await llm.resume_generation()
    show("while-paused after resume", await t2)

    print("===== 4c. pause_generation(mode='keep') + version label -> weight-version spans")
    for clear in (False, True):
        seen.clear()
        await llm.update_weight_version("v0")
        spk = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
        t = asyncio.create_task(long(f"keep{clear}", spk))
        while not seen or seen[-1][1] < 10:
            await asyncio.sleep(0.01)
        await llm.pause_generation(mode="keep", clear_cache=clear)
        n_at_pause = seen[-1][1]
        await asyncio.sleep(1.0)
        n_after = seen[-1][1]
        await llm.update_weight_version("v1")
        await llm.resume_generation()
        o = await t
        c = o.outputs[0]
        ref = await run(spk, f"ref{clear}")
        print(f"keep clear_cache={clear}: tokens at pause {n_at_pause}, 1s later {n_after}; final finish="
              f"{c.finish_reason} ntok={len(c.token_ids)} spans={c.weight_versions} "
              f"same ids as an unpaused greedy run: {list(c.token_ids) == list(ref.outputs[0].token_ids)}",
              flush=True)
    print("get_weight_version ->", await llm.get_weight_version())

    print("===== 4d. reset_prefix_cache")
    print("reset_prefix_cache() ->", await llm.reset_prefix_cache())
    print("reset_prefix_cache(reset_running_requests=True) ->", await llm.reset_prefix_cache(True))

    print("===== 6. sleep / wake_up on CPU")
    try:
        t0 = time.time()
        await llm.sleep(level=1)
        print(f"sleep(1) returned in {time.time()-t0:.2f}s; is_sleeping={await llm.is_sleeping()} "
              f"is_paused={await llm.is_paused()}")
        r = await llm.wake_up()
        print("wake_up ->", r, "is_sleeping", await llm.is_sleeping(), "is_paused", await llm.is_paused())
        show("after wake", await asyncio.wait_for(run(SamplingParams(temperature=0, max_tokens=8), "aw"), 30))
    except Exception as e:  # noqa
        print("sleep/wake raised", type(e).__name__, e)

    print("===== DELTA output kind (streaming increments)")
    deltas = []
    async for out in llm.generate(TokensPrompt(prompt_token_ids=P), SamplingParams(
            temperature=0, max_tokens=8, output_kind=RequestOutputKind.DELTA, logprobs=0), "delta"):
        deltas.append((list(out.outputs[0].token_ids), out.outputs[0].finish_reason))
    print("DELTA chunks:", deltas)
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
