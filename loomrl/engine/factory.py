"""The engine a run's config asks for (engine.kind), over a model it may share with the trainer."""

from __future__ import annotations

from typing import Any

from loomrl.config import RunConfig
from loomrl.engine.base import Engine


def make_engine(cfg: RunConfig, model: Any, tokenizer: Any, version: int) -> Engine:
    """The engine engine.kind names: the built-in one over `model` (sync runs share it with the trainer), a client
    of an SGLang server (`model` gives only the config.json written beside each weight update), or vLLM's AsyncLLM
    over the folder `model` was loaded from (saved to a temporary one when it has none)."""
    e = cfg.engine
    if e.kind == "sglang":
        from loomrl.engine.sglang import SGLangEngine

        return SGLangEngine(e.sglang, version=version, model_config=model.config)
    if e.kind == "vllm":
        from loomrl.engine.vllm import VLLMEngine, engine_dtype, served_model

        return VLLMEngine(e.vllm, served_model(model, tokenizer), dtype=engine_dtype(e.vllm.dtype, cfg.model.dtype),
                          seed=cfg.seed, max_num_seqs=e.max_batch_size, prefix_cache=e.prefix_cache, version=version)
    from loomrl.engine.builtin.engine import BuiltinEngine

    return BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=e.kv_budget_tokens,
                         max_running=e.max_batch_size, max_prefill_tokens=e.max_prefill_tokens,
                         prefix_cache=e.prefix_cache, seed=cfg.seed, version=version, tokenizer=tokenizer)
