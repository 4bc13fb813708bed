"""OpenAI-compatible HTTP API over an Engine: /v1/completions, /v1/chat/completions (tools included), /v1/models,
/health and Prometheus /metrics.

Token ids and logprobs come back the way vLLM returns them: with `return_token_ids: true` a choice carries `token_ids`
(sampled) and `prompt_token_ids`; loomrl adds `policy_versions` (the version of the weights that produced each token).
Logprobs are those of the sampled tokens under the distribution actually sampled from. The engines compute no
alternatives, so each position's top logprobs hold one entry, the sampled token: `logprobs` 0 or 1 on
/v1/completions and `top_logprobs` 0 or 1 on /v1/chat/completions are served (greedy, the sampled token is the most
likely one; sampling, it need not be), and more is a 400 naming the field rather than a shorter list than asked for.
`stream=true` answers server-sent events (responses.py stream_events: each choice's output in one chunk once it has
finished).

Several models over one base (`loomrl serve --adapter`): besides the base's engine, one engine per LoRA adapter, each
under its own name; a request's `model` picks its engine, /v1/models lists every name, and a name not served is a 404
listing those that are (OpenAI's `model_not_found`). With one model served, any `model` is answered by it, as before:
a client that names nothing in particular needs no configuration. /health and /metrics report the base's engine
(/health also each served model's policy version).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from loomrl.engine.base import GenerationRequest, GenerationResult, SamplingParams
from loomrl.model.chat import ChatRenderer
from loomrl.server import responses as oai
from loomrl.server.protocol import ChatCompletionRequest, CompletionRequest


class OpenAIServer:
    def __init__(self, engine, tokenizer, model_name: str, adapters: Mapping[str, Any] | None = None):
        """`engine` serves `model_name`; `adapters`: each further served name's engine (an adapter over the same base
        model, so the same tokenizer)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.model_name = model_name
        self.engines = {model_name: engine, **(adapters or {})}  # the base first: /v1/models lists it first
        self.started = int(time.time())
        self.requests = 0
        self.errors = 0

    # -- helpers ----------------------------------------------------------------------------------
    def _served(self, model: str | None):
        """(name, engine) serving a request's `model`, or a 404 naming the served models. With one model served it
        answers whatever is asked (a client's placeholder name included), as it did before adapters were served."""
        if len(self.engines) == 1 or model is None:
            return self.model_name, self.engine
        if model in self.engines:
            return model, self.engines[model]
        served = ", ".join(repr(name) for name in self.engines)
        return oai.error_response(404, f"The model {model!r} does not exist: this server serves {served}", "model",
                                  code="model_not_found")

    async def _generate_n(self, engine, prompt_ids: list[int], sampling: SamplingParams, n: int
                          ) -> list[GenerationResult]:
        """n samples of one prompt (seeds seed, seed+1, ... when seeded); the prefix cache shares the prompt."""
        reqs = [
            engine.generate(GenerationRequest(
                prompt_ids=prompt_ids, program_id=f"http-{uuid.uuid4().hex[:8]}",
                sampling=replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)))
            for i in range(n)
        ]
        return list(await asyncio.gather(*reqs))

    @staticmethod
    def _check_context(engine, prompts: list[list[int]], max_tokens: int):
        """A 400 when a prompt and max_tokens cannot fit in the engine's KV budget together, or None."""
        limit = engine.kv_budget
        for ids in prompts:
            if len(ids) + max_tokens > limit:
                return oai.error_response(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                          f"the engine's KV budget of {limit} tokens", "max_tokens")
        return None

    # -- endpoints --------------------------------------------------------------------------------
    @staticmethod
    def _one_alternative(field: str, asked: int | None):
        """A 400 when a request asks for more top logprobs per position than the sampled token's, or None."""
        if asked is None or asked <= 1:
            return None
        return oai.error_response(400, f"{field}={asked} asks for the {asked} most likely tokens at each position, but "
                                  f"the engine computes only the sampled token's logprob: use {field}=1 for it", field)

    def _prompt_ids(self, p: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        """Each prompt's token ids: `p` is one prompt (a string, or token ids) or a non-empty list of them (the
        request model has made any list homogeneous, so the isinstance filters below drop nothing)."""
        if isinstance(p, str):
            return [self.renderer.encode_text(p)]
        if isinstance(p[0], int):  # one prompt's token ids
            return [[t for t in p if isinstance(t, int)]]
        return [self.renderer.encode_text(x) if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]

    async def completions(self, req: CompletionRequest):
        served = self._served(req.model)
        if not isinstance(served, tuple):
            return served
        model, engine = served
        if req.echo:
            return oai.error_response(400, "echo=true is not supported", "echo")
        if (bad := self._one_alternative("logprobs", req.logprobs)) is not None:
            return bad
        p = req.prompt
        if not isinstance(p, str) and not p:  # the request model has made any list homogeneous
            return oai.error_response(400, "prompt must be a non-empty string, list of token ids, or list of either", "prompt")
        prompts = self._prompt_ids(p)
        vocab = len(self.tokenizer)
        if any(not x or any(t < 0 or t >= vocab for t in x) for x in prompts):
            return oai.error_response(400, f"prompt token ids must be non-empty and in [0, {vocab})", "prompt")
        if (bad := self._check_context(engine, prompts, req.max_tokens)) is not None:
            return bad
        sampling = oai.sampling_params(req, req.max_tokens)
        results = await asyncio.gather(*[self._generate_n(engine, ids, sampling, req.n) for ids in prompts])
        choices = []
        for ids, outs in zip(prompts, results):
            for r in outs:
                text, reason = oai.sampled_text(self.tokenizer, r, sampling.stop)
                choice: dict[str, Any] = {"index": len(choices), "text": text, "finish_reason": reason,
                                          "stop_reason": None, "logprobs": None, "policy_versions": r.versions}
                if req.logprobs is not None:
                    toks = [self.tokenizer.decode([t]) for t in r.token_ids]
                    choice["logprobs"] = {"tokens": toks, "token_logprobs": r.logprobs,
                                          "top_logprobs": [{t: lp} for t, lp in zip(toks, r.logprobs)],
                                          "text_offset": list(itertools.accumulate(map(len, toks), initial=0))[:-1]}
                if req.return_token_ids:
                    choice["token_ids"] = r.token_ids
                    choice["prompt_token_ids"] = ids
                choices.append(choice)
        self.requests += 1
        return oai.completion_body("cmpl", "text_completion", model, choices, sum(map(len, prompts)) * req.n,
                                   sum(len(r.token_ids) for outs in results for r in outs))

    async def chat(self, req: ChatCompletionRequest):
        served = self._served(req.model)
        if not isinstance(served, tuple):
            return served
        model, engine = served
        if (bad := oai.bad_roles(req.messages)) is not None:
            return bad
        if (bad := self._one_alternative("top_logprobs", req.top_logprobs)) is not None:
            return bad
        try:
            prompt_ids = self.renderer.prompt_ids(req.messages, req.tools)
        except Exception as err:  # noqa: BLE001 - a template that cannot render this conversation
            return oai.error_response(400, f"cannot render messages with the chat template: {err}", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        if (bad := self._check_context(engine, [prompt_ids], max_tokens)) is not None:
            return bad
        sampling = oai.sampling_params(req, max_tokens)
        outs = await self._generate_n(engine, prompt_ids, sampling, req.n)
        choices = []
        for r in outs:
            text, reason = oai.sampled_text(self.tokenizer, r, sampling.stop)
            message, reason = oai.assistant_message(text, reason, req.tools, self.renderer.messages)
            logprobs = oai.chat_logprobs(self.tokenizer, r, top=bool(req.top_logprobs)) if req.logprobs else None
            choice: dict[str, Any] = {"index": len(choices), "message": message, "finish_reason": reason,
                                      "logprobs": logprobs, "policy_versions": r.versions}
            if req.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        body = oai.completion_body("chatcmpl", "chat.completion", model, choices, len(prompt_ids) * req.n,
                                   sum(len(r.token_ids) for r in outs))
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        self.requests += 1
        return body

    def metrics_text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        server = self

        class _Collector:
            def collect(self):
                m = server.engine.metrics
                yield GaugeMetricFamily("loomrl_policy_version", "Policy version of the engine's weights",
                                        value=server.engine.version)
                yield CounterMetricFamily("loomrl_http_requests", "Requests served", value=server.requests)
                yield CounterMetricFamily("loomrl_http_errors", "Requests refused with an error", value=server.errors)
                for name, help_ in [("requests", "Generation requests"), ("generated_tokens", "Tokens sampled"),
                                    ("prompt_tokens", "Prompt tokens received"),
                                    ("prefill_tokens", "Prompt tokens computed"),
                                    ("reused_tokens", "Prompt tokens served from the prefix cache"),
                                    ("preemptions", "Sequences preempted for recompute"), ("steps", "Engine steps")]:
                    yield CounterMetricFamily(f"loomrl_engine_{name}", help_, value=getattr(m, name))
                yield GaugeMetricFamily("loomrl_engine_prefix_hit_rate", "Share of prompt tokens reused",
                                        value=m.hit_rate)

        registry = CollectorRegistry()
        registry.register(_Collector())
        return generate_latest(registry)


def create_app(engine, tokenizer, model_name: str = "loomrl", *, adapters: Mapping[str, Any] | None = None):
    """The app serving `engine` as `model_name` and each of `adapters` (name -> engine) under its name."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse

    server = OpenAIServer(engine, tokenizer, model_name, adapters)
    app = FastAPI(title="loomrl", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        server.errors += 1
        return oai.invalid_request(exc)

    @app.get("/health")
    async def health():
        body: dict[str, Any] = {"status": "ok", "policy_version": engine.version}
        if len(server.engines) > 1:
            body["models"] = {name: e.version for name, e in server.engines.items()}
        return body

    @app.get("/v1/models")
    async def models():
        return oai.model_list(list(server.engines), server.started)

    async def answer(req: CompletionRequest | ChatCompletionRequest, body):
        """The body, or (stream=true) its events; an error response stays an error response."""
        if not req.stream or isinstance(body, Response):
            return body
        return StreamingResponse(oai.stream_events(body, req.include_usage), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await answer(req, await server.completions(req))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        return await answer(req, await server.chat(req))

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics_text(), media_type="text/plain; version=0.0.4")

    return app
