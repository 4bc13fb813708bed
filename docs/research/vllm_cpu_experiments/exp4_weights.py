"""Exp 4: weight updates into a running AsyncLLM on CPU, checked against a fresh engine on the new weights.
Paths: (N) naive model.load_weights via a worker extension; (A) collective_rpc("reload_weights",
weights_iterator=...); (B) weight-transfer API with a custom inline engine, bucketed; (G) same with a gloo
broadcast engine; (C) reload_weights(weights_path=folder). Also: stale prefix cache after an update."""
import asyncio
import os
import sys
import threading
import time

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + ":" + os.environ.get("PYTHONPATH", "")
ORIG = "/work/notes/smollm2-hf"
MOD = "/work/notes/exp/smollm2-mod"
PROMPTS = ["What is 2+3? Answer briefly.", "Write a haiku about the sea.", "Name three colours."]


def make(model, **kw):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", max_model_len=1024, enforce_eager=True, kv_cache_memory_bytes=1 << 29,
        logprobs_mode="processed_logprobs", seed=0, enable_prefix_caching=True,
        worker_extension_cls="loomrl_vllm_ext.WorkerExt", **kw))


async def gen(llm, tag):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    tok = llm.tokenizer
    outs = []
    for i, p in enumerate(PROMPTS):
        ids = list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        final = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(
                temperature=0.7, top_p=0.9, seed=11 + i, max_tokens=24, logprobs=0), f"{tag}-{i}-{time.time()}"):
            final = o
        c = final.outputs[0]
        outs.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
    return outs


def same(a, b):
    ids = all(x[0] == y[0] for x, y in zip(a, b))
    d = max((abs(p - q) for x, y in zip(a, b) if x[0] == y[0] for p, q in zip(x[1], y[1])), default=0.0)
    return f"ids_equal={ids} max|dlogprob|={d:.1e}"


def buckets(sd, nbytes=64 << 20):
    cur, size = [], 0
    for k, v in sd.items():
        cur.append((k, v))
        size += v.numel() * v.element_size()
        if size >= nbytes:
            yield cur
            cur, size = [], 0
    if cur:
        yield cur


async def main():
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    sd_orig, sd_mod = load_file(ORIG + "/model.safetensors"), load_file(MOD + "/model.safetensors")
    # a trainer's dtype may differ (engine float32 here): send the mod weights as bfloat16 -> cast on load
    results = {}
    from loomrl_vllm_ext import to_wire

    t = time.time()
    llm = make(ORIG, weight_transfer_config={"backend": "loomrl_inline"})
    print(f"engine up {time.time()-t:.1f}s", flush=True)
    results["orig"] = await gen(llm, "orig")

    print("== (N) naive model.load_weights via worker extension")
    print("checksum q_proj before:", await llm.collective_rpc("loomrl_param_checksum",
                                                              args=("model.layers.3.mlp.down_proj.weight",)))
    try:
        r = await llm.collective_rpc("loomrl_naive_load", args=(to_wire([("model.layers.3.mlp.down_proj.weight",
                                                                  sd_mod["model.layers.3.mlp.down_proj.weight"])]),))
        print("naive load returned", r)
        after = await gen(llm, "naive")
        print("naive: output vs orig:", same(after, results["orig"]))
    except Exception as e:
        print("naive load raised:", type(e).__name__, str(e)[:300])

    print("== (A) worker-extension loomrl_reload -> Worker.reload_weights, tensors as bytes (full model)")
    t = time.time()
    await llm.collective_rpc("loomrl_reload", args=(to_wire(list(sd_mod.items())),))
    print(f"reload_weights(iterator) {time.time()-t:.2f}s")
    print("  prefix cache NOT reset: same prompts again")
    results["A_stale"] = await gen(llm, "A-stale")
    print("reset_prefix_cache ->", await llm.reset_prefix_cache())
    results["A"] = await gen(llm, "A")
    print("A vs orig:", same(results["A"], results["orig"]))

    print("== (B) weight-transfer API, inline engine, 64 MiB buckets, back to orig, bf16 on the wire? no: f32")
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
    t = time.time()
    await llm.pause_generation(mode="keep", clear_cache=False)
    await llm.start_weight_update()
    nb = 0
    for b in buckets(sd_orig):
        await llm.update_weights(WeightTransferUpdateRequest(
            update_info=to_wire(b)))
        nb += 1
    await llm.finish_weight_update(weight_version="2")
    print("reset_prefix_cache while paused(keep) ->", await llm.reset_prefix_cache())
    await llm.resume_generation()
    print(f"B: {nb} buckets, {time.time()-t:.2f}s; version now {await llm.get_weight_version()}")
    results["B"] = await gen(llm, "B")
    print("B vs orig:", same(results["B"], results["orig"]))

    print("== (B') partial update: only the 3 changed tensors, sent as bfloat16 (engine casts)")
    await llm.start_weight_update()
    changed = [k for k in sd_mod if not __import__("torch").equal(sd_mod[k], sd_orig[k])]
    await llm.update_weights(WeightTransferUpdateRequest(
        update_info=to_wire([(k, sd_mod[k].bfloat16()) for k in changed])))
    await llm.finish_weight_update(weight_version="3")
    await llm.reset_prefix_cache()
    results["Bp"] = await gen(llm, "Bp")
    print("changed:", changed)
    print("B' (bf16 partial) vs A (full f32):", same(results["Bp"], results["A"]))
    print("== (A0) collective_rpc('reload_weights', weights_iterator=[(name, tensor)]) -- tensors through msgpack")
    try:
        await llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd_mod.items())[:2]})
        print("A0 ok")
    except Exception as e:
        print("A0 raised:", type(e).__name__, str(e)[:200])
    llm.shutdown()
    await asyncio.sleep(3)

    print("== (G) gloo transfer engine (trainer rank 0 here, worker rank 1)")
    from loomrl_vllm_ext import gloo_group
    llm = make(ORIG, weight_transfer_config={"backend": "loomrl_gloo"})
    port = 29731
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("pg", gloo_group("127.0.0.1", port, 0, 2)))
    th.start()
    await llm.init_weight_transfer_engine(WeightTransferInitRequest(
        init_info={"host": "127.0.0.1", "port": port, "world_size": 2, "rank_offset": 1}))
    th.join()
    pg = box["pg"]
    import torch
    t = time.time()
    await llm.start_weight_update()
    nb = 0
    for b in buckets(sd_mod):
        info = {"names": [k for k, _ in b], "dtype_names": [str(v.dtype).split(".")[1] for _, v in b],
                "shapes": [list(v.shape) for _, v in b]}

        def send(b=b):
            for _, v in b:
                pg.broadcast([v.contiguous()], torch.distributed.BroadcastOptions()).wait()
        loop = asyncio.get_running_loop()
        await asyncio.gather(llm.update_weights(WeightTransferUpdateRequest(update_info=info)),
                             loop.run_in_executor(None, send))
        nb += 1
    await llm.finish_weight_update(weight_version="7")
    await llm.reset_prefix_cache()
    print(f"G: {nb} buckets {time.time()-t:.2f}s")
    results["G"] = await gen(llm, "G")
    print("G vs A:", same(results["G"], results["A"]))

    print("== (C) reload_weights(weights_path=ORIG) from disk")
    t = time.time()
    await llm.collective_rpc("reload_weights", kwargs={"weights_path": ORIG})
    await llm.reset_prefix_cache()
    print(f"C: {time.time()-t:.2f}s")
    results["C"] = await gen(llm, "C")
    print("C vs orig:", same(results["C"], results["orig"]))
    llm.shutdown()
    await asyncio.sleep(3)

    print("== fresh engine on MOD")
    llm = make(MOD)
    results["fresh_mod"] = await gen(llm, "fresh")
    llm.shutdown()
    print("A vs fresh_mod:", same(results["A"], results["fresh_mod"]))
    print("A_stale vs fresh_mod:", same(results["A_stale"], results["fresh_mod"]))
    print("G vs fresh_mod:", same(results["G"], results["fresh_mod"]))
    print("B' vs fresh_mod:", same(results["Bp"], results["fresh_mod"]))
    print("orig vs fresh_mod:", same(results["orig"], results["fresh_mod"]))


if __name__ == "__main__":
    asyncio.run(main())
