"""The engine an EngineSetup asks for (engine.kind), over a model it may share with the trainer."""

from __future__ import annotations

from typing import Any

from loomrl.config import EngineConfig, EngineSetup
from loomrl.engine.base import Engine

BUILTIN_MAX_RUNNING = 64  # engine.max_batch_size unset: the built-in engine's running sequences, on any device


def server_of(base_url: str | list[str], replica: int) -> str:
    """The server engine actor `replica` drives when the config lists several (each its own), else the one."""
    return base_url[replica % len(base_url)] if isinstance(base_url, list) else base_url


def _sglang_engine(e: EngineConfig, model: Any, version: int, replica: int) -> Engine:
    """A client of the SGLang server engine.sglang names (of `replica`'s, when it lists several)."""
    from loomrl.engine.sglang import SGLangEngine

    s = e.sglang
    if not isinstance(s.base_url, list):
        return SGLangEngine(s, version=version, model_config=model.config, sleep_mode=e.sleep_while_training)
    # one server per engine actor, each writing its versions into a folder of its own
    mine = {"base_url": server_of(s.base_url, replica)}
    if s.weights_dir:
        mine["weights_dir"] = f"{s.weights_dir}/server{replica}"
    if s.server_weights_dir:
        mine["server_weights_dir"] = f"{s.server_weights_dir}/server{replica}"
    return SGLangEngine(s.model_copy(update=mine), version=version, model_config=model.config,
                        sleep_mode=e.sleep_while_training)


def make_engine(setup: EngineSetup, model: Any, tokenizer: Any, version: int, replica: int = 0, *,
                share_linears: bool = False) -> Engine:
    """The engine engine.kind names: the built-in one over `model` (sync runs share it with the trainer), a client
    of an SGLang server (`model` gives only the config.json written beside each weight update; `replica`: the
    engine actor's index, which picks its server when engine.sglang.base_url lists several), a client of a vLLM
    server (engine.vllm.base_url; `model` gives the parameter names and shapes), or vLLM's AsyncLLM over the folder
    `model` was loaded from (saved to a temporary one when it has none). All but the built-in one take a meta-device
    skeleton (model/loader.py load_engine_model): they never read the weights of `model`. engine.instances > 1 (the
    built-in engine): a Router (engine/router.py) over that many; with vLLM or SGLang servers, a Router over one client
    of each server engine.<kind>.base_url lists (engine/replicas.py). `share_linears` (the built-in engine): share packed
    linears with other engines over the same unchanged tensors (`loomrl serve --adapter`: engine/builtin/linears.py)."""
    e = setup.engine
    if e.instances > 1 and e.kind != "builtin":
        from loomrl.engine.replicas import server_replicas

        return server_replicas(setup, lambda one, i: make_engine(one, model, tokenizer, version, replica=i))
    if e.kind == "sglang":
        return _sglang_engine(e, model, version, replica)
    if e.kind == "vllm" and e.vllm.base_url:
        from loomrl.engine.vllm.http import VLLMHTTPEngine
        from loomrl.engine.vllm.translate import recorded_layout
        from loomrl.engine.vllm.weights import parameter_shapes

        shapes, aliases = parameter_shapes(model)  # auto dtype: the server's
        mine = e.vllm.model_copy(update={"base_url": server_of(e.vllm.base_url, replica)})
        return VLLMHTTPEngine(mine, shapes=shapes, aliases=aliases, version=version,
                              dtype=None if e.vllm.dtype == "auto" else e.vllm.dtype,
                              routed_experts=recorded_layout(model, setup.routed_experts))
    if e.kind == "vllm":
        from loomrl.engine.vllm.engine import VLLMEngine
        from loomrl.engine.vllm.served import served_model
        from loomrl.engine.vllm.translate import recorded_layout
        from loomrl.model.loader import build_tiny_model
        from loomrl.weights.route import engine_dtype

        def build() -> Any:  # a tiny model's skeleton has no folder: its weights are its seed's, saved for vLLM
            return build_tiny_model(setup.model, len(tokenizer), tokenizer.eos_token_id)

        layout = recorded_layout(model, setup.routed_experts)  # before a temporary folder is made
        served = served_model(model, tokenizer, build if setup.model.kind == "tiny" else None)
        # agent.max_context_tokens bounds every request of a run (prompt + output): the K/V cache's sequence length
        return VLLMEngine(e.vllm, served, dtype=engine_dtype(e.vllm.dtype, setup.model.dtype),
                          seed=setup.seed, max_num_seqs=e.max_batch_size, prefix_cache=e.prefix_cache, version=version,
                          sleep_mode=e.sleep_while_training, context_tokens=setup.context_tokens,
                          speculation=e.speculation, lora_rank=setup.lora_rank, lora_targets=setup.lora_targets,
                          routed_experts=layout)
    return _builtin_engines(setup, model, tokenizer, version, share_linears)


def _builtin_engines(setup: EngineSetup, model: Any, tokenizer: Any, version: int, share_linears: bool) -> Engine:
    """The built-in engine over `model`; with engine.instances > 1, a Router over that many, each over a copy of the
    model of its own (a deepcopy: every instance adds the model's parameters and its own engine.kv_budget_tokens of
    K/V to this process's memory) and seeded seed + i (unseeded requests draw from different streams). With
    engine.kv_pool_bytes, one SharedKVPool is built here and shared by every instance (with one instance it is a second
    level beyond the prefix cache's budget), and the router weighs fetching from it against recomputing."""
    import copy

    from loomrl.engine.builtin.engine import BuiltinEngine
    from loomrl.engine.kv_pool import PoolFetch, open_pool

    e = setup.engine
    # engine.kv_pool_dir: shared with the other engine processes given the same folder (engine/kv_files.py)
    pool = open_pool(e.kv_pool_bytes, e.kv_pool_dir) if e.kv_pool_bytes else None

    def one(i: int) -> BuiltinEngine:
        return BuiltinEngine(model if i == 0 else copy.deepcopy(model), eos_token_id=tokenizer.eos_token_id,
                             kv_budget_tokens=e.kv_budget_tokens, max_running=e.max_batch_size or BUILTIN_MAX_RUNNING,
                             max_prefill_tokens=e.max_prefill_tokens, prefix_cache=e.prefix_cache,
                             seed=setup.seed + i, version=version, tokenizer=tokenizer, speculation=e.speculation,
                             program_policy=e.program_policy, max_pauses_in_row=e.max_pauses_in_row, kv_pool=pool,
                             return_routed_experts=setup.routed_experts, share_linears=share_linears)

    if e.instances == 1:
        return one(0)
    from loomrl.engine.router import Router

    built: list[BuiltinEngine] = []
    try:
        for i in range(e.instances):
            built.append(one(i))
    except BaseException:
        for engine in built:  # no engine thread left behind
            engine.close()
        raise
    split = None
    if pool is not None and (e.prefill_instances or e.chunk_tokens is not None):  # engine/split.py, over the pool
        from loomrl.engine.split import SplitPlan

        split = SplitPlan(pool=pool, prefill_instances=e.prefill_instances, min_prompt_tokens=e.pd_min_prompt_tokens,
                          chunk_tokens=e.chunk_tokens)
    router = Router(built, policy=e.router, split=split, retire=e.retire_failed_instances)
    if pool is not None:  # the placer's cost compares fetching from the pool with recomputing, at its measured rate
        router.placer.fetch = PoolFetch(pool=pool, prefill_tokens_per_s=lambda: router.placer.prefill_tokens_per_s)
    return router
