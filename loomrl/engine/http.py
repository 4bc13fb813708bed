"""ServerClient: the HTTP calls of the engines that are clients of a server the user runs (SGLang, vLLM's HTTP server).

What it is: a sync client for control calls and one async client per event loop for generation (an AsyncClient's
connections belong to the loop that opened them), with one retry rule: a call the server never received (connect
errors) or answered 503 (starting) is sent again, `retries` times, `backoff_s` x 2^k apart; any other failure is an
EngineFault with the server's own message. A call the server received is never sent twice.

What it is not: a connection pool across engines or a streaming client (every call waits for one JSON answer).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from loomrl.engine.base import EngineFault

_RETRIED = (httpx.ConnectError, httpx.ConnectTimeout)  # the server never received the call


def server_message(resp: httpx.Response) -> str:
    """The error text of an answer: {"error": {"message"}} (OpenAI-style ErrorResponse), {"error": "..."},
    {"message"}, {"detail"} (FastAPI's HTTPException and validation errors) or a plain body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("error", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return resp.text.strip()


class ServerClient:
    """POST/GET to one server with the retry rule above; `name` prefixes every error ("SGLang", "vLLM")."""

    def __init__(self, name: str, base_url: str, *, retries: int, backoff_s: float):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._client = httpx.Client(base_url=self.base_url)
        self._aclients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}  # one per event loop

    def post(self, path: str, body: dict[str, Any] | None, timeout: float,
             params: dict[str, Any] | None = None) -> httpx.Response:
        return self._send("POST", path, body, timeout, params)

    def get(self, path: str, timeout: float, params: dict[str, Any] | None = None) -> httpx.Response:
        return self._send("GET", path, None, timeout, params)

    async def apost(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """POST from the caller's event loop; the answer's JSON."""
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            for old in [k for k in self._aclients if k.is_closed()]:
                del self._aclients[old]
            client = self._aclients[loop] = httpx.AsyncClient(base_url=self.base_url)
        for attempt in range(self.retries + 1):
            try:
                resp = await client.post(path, json=body, timeout=timeout)
            except httpx.HTTPError as err:
                self._retry_or_raise(path, attempt, err)
            else:
                if resp.status_code == 200:
                    return resp.json()
                self._retry_or_raise(path, attempt, resp)
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable: the last attempt raises")

    def close(self) -> None:
        self._client.close()
        for loop, client in self._aclients.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda c=client: asyncio.ensure_future(c.aclose()))
        self._aclients.clear()

    def _send(self, method: str, path: str, body: dict[str, Any] | None, timeout: float,
              params: dict[str, Any] | None) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.request(method, path, json=body, params=params, timeout=timeout)
            except httpx.HTTPError as err:
                self._retry_or_raise(path, attempt, err)
            else:
                if resp.status_code == 200:
                    return resp
                self._retry_or_raise(path, attempt, resp)
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable: the last attempt raises")

    def _retry_or_raise(self, path: str, attempt: int, failure: httpx.Response | httpx.HTTPError) -> None:
        """Return (try again) for a call the server never received or answered 503 (starting), while attempts
        are left; raise EngineFault with the server's message otherwise."""
        last = attempt == self.retries
        if isinstance(failure, httpx.Response):
            if failure.status_code != 503 or last:
                raise EngineFault(f"{self.name} {path} answered {failure.status_code}: {server_message(failure)}")
        elif not isinstance(failure, _RETRIED):
            raise EngineFault(f"{self.name} {path}: {type(failure).__name__}: {failure}")
        elif last:
            raise EngineFault(f"{self.name} {path}: cannot reach {self.base_url}: {failure}")
