"""Exp 4b (tiny random Llama, tied embeddings): stale prefix cache after an update, partial (bucketed)
updates, the embedding/lm_head tie through a layerwise reload, and an update under pause(mode="keep")."""
import asyncio
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = HERE + ":" + os.environ.get("PYTHONPATH", "")
ORIG, MOD = "/work/notes/tiny-hf", HERE + "/tiny-mod"


def make(model, **kw):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 28,
        logprobs_mode="processed_logprobs", seed=0, enable_prefix_caching=True, block_size=32,
        worker_extension_cls="loomrl_vllm_ext.WorkerExt", **kw))


PROMPT = list(range(1000, 1100))  # 100 tokens: 3 full blocks of 32 get cached


async def gen(llm, tag, max_tokens=16):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    final = None
    async for o in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(
            temperature=0.7, top_p=0.9, seed=5, max_tokens=max_tokens, logprobs=0, ignore_eos=True),
            f"{tag}-{time.time()}"):
        final = o
    c = final.outputs[0]
    return list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], final.num_cached_tokens


def cmp(a, b):
    return f"ids_equal={a[0] == b[0]} max|dlp|={max(abs(x - y) for x, y in zip(a[1], b[1])):.1e}"


async def update(llm, named, version):
    from loomrl_vllm_ext import to_wire
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    await llm.start_weight_update()
    for i in range(0, len(named), 4):  # buckets of 4 tensors
        await llm.update_weights(WeightTransferUpdateRequest(update_info=to_wire(named[i:i + 4])))
    await llm.finish_weight_update(weight_version=version)


async def main():
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    orig, mod = load_file(ORIG + "/model.safetensors"), load_file(MOD + "/model.safetensors")
    changed = [k for k in mod if not torch.equal(mod[k], orig[k])]
    print("changed:", changed, "tie_word_embeddings: lm_head absent from checkpoint:",
          "lm_head.weight" not in orig)

    fresh = make(MOD)
    r_fresh = await gen(fresh, "fresh")
    fresh.shutdown()
    await asyncio.sleep(2)

    llm = make(ORIG, weight_transfer_config={"backend": "loomrl_inline"})
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
    r0 = await gen(llm, "orig")
    r0b = await gen(llm, "orig-again")
    print("orig: num_cached_tokens first/second run:", r0[2], r0b[2])

    await update(llm, list(mod.items()), "1")  # full update, NO prefix-cache reset
    r_stale = await gen(llm, "stale")
    print(f"full update, no reset: cached={r_stale[2]} vs fresh: {cmp(r_stale, r_fresh)}")
    print("reset_prefix_cache ->", await llm.reset_prefix_cache())
    r_reset = await gen(llm, "reset")
    print(f"after reset: cached={r_reset[2]} vs fresh: {cmp(r_reset, r_fresh)}")

    await update(llm, list(orig.items()), "2")
    await llm.reset_prefix_cache()
    print("back to orig:", cmp(await gen(llm, "orig2"), r0))
    await update(llm, [(k, mod[k]) for k in changed], "3")  # partial: only the changed tensors (embed included)
    await llm.reset_prefix_cache()
    r_part = await gen(llm, "partial")
    print("partial update (embed + one layer) vs fresh:", cmp(r_part, r_fresh))
    print("tie state:", await llm.collective_rpc("loomrl_tie_state"))
    await llm.collective_rpc("loomrl_repack_lm_head")
    await llm.reset_prefix_cache()
    print("partial update + lm_head repack vs fresh:", cmp(await gen(llm, "partial-repack"), r_fresh))
    await update(llm, list(orig.items()), "3a")
    await llm.reset_prefix_cache()
    await gen(llm, "fill-cache")
    await update(llm, list(mod.items()), "3b")  # engine's finish now re-packs lm_head itself
    r = await gen(llm, "full-autorepack-stale")
    print(f"full update (auto repack), NO reset: cached={r[2]} vs fresh:", cmp(r, r_fresh))
    await llm.reset_prefix_cache()
    print("full update (auto repack) + reset vs fresh:", cmp(await gen(llm, "full-repack"), r_fresh))
    print("embed / lm_head checksums:",
          await llm.collective_rpc("loomrl_param_checksum", args=("model.embed_tokens.weight",)),
          await llm.collective_rpc("loomrl_param_checksum", args=("lm_head.weight",)),
          "expected", float(mod["model.embed_tokens.weight"].sum()))

    print("== update under pause(mode='keep') with a request in flight")
    await update(llm, list(orig.items()), "4")
    await llm.reset_prefix_cache()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    seen = []

    async def inflight():
        last = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(
                temperature=0, max_tokens=60, ignore_eos=True, logprobs=0), "inflight"):
            last = o
            seen.append(len(o.outputs[0].token_ids))
        return last

    t = asyncio.create_task(inflight())
    while not seen or seen[-1] < 10:
        await asyncio.sleep(0.005)
    await llm.pause_generation(mode="keep", clear_cache=False)
    n = seen[-1]
    await update(llm, list(mod.items()), "5")
    print("reset_prefix_cache() with a kept request holding blocks ->", await llm.reset_prefix_cache())
    print("reset_prefix_cache(reset_running_requests=True) ->", await llm.reset_prefix_cache(True))
    await llm.resume_generation()
    o = await t
    print(f"paused at {n} tokens; final {len(o.outputs[0].token_ids)} finish={o.outputs[0].finish_reason} "
          f"spans={o.outputs[0].weight_versions}")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
