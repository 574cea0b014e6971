"""The HTTP layer's part of serving: an ASGI middleware in front of vLLM's OpenAI-compatible routes.

For ``POST /v1/completions`` and ``/v1/chat/completions`` it reads ``kv_transfer_params``: a malformed one
(not an object, an unknown ``kvbridge`` mode) is answered with HTTP 400 and a message, before the engine
sees it; otherwise the request gets the server's default mode when it names none, and a request that may be
mapped (``mapped`` or ``auto``) gets a ``cache_salt`` in the mapper's namespace, the client's own salt kept
after it — so mapped K/V are shared only among requests that asked for this mapper. Everything else passes
through untouched. ``kvbridge serve`` puts the settings in the environment (``KVBRIDGE_SERVE``) before vLLM
imports this class.
"""

from __future__ import annotations

import json
import os

from ..errors import InputError
from .config import PARAM, request_hold_back, request_mode, salted

ENV = "KVBRIDGE_SERVE"
PATHS = ("/v1/completions", "/v1/chat/completions")  # other routes pass untouched: their mapped requests fall
# back to native prefill (no namespace), never the other way round
MAX_BODY = 64 << 20  # bytes


def rewrite(data, mode: str, namespace: str):
    """The request body a kvbridge server hands vLLM (InputError: the 400's message)."""
    params = data.get("kv_transfer_params")
    chosen = request_mode(params, mode)
    request_hold_back(params)
    data["kv_transfer_params"] = {**(params or {}), PARAM: chosen}
    if chosen != "native":
        data["cache_salt"] = salted(namespace, data.get("cache_salt"))
    return data


class KVBridgeMiddleware:
    def __init__(self, app):
        self.app = app
        settings = json.loads(os.environ.get(ENV) or "{}")
        if not settings.get("namespace"):
            raise RuntimeError(f"KVBridgeMiddleware needs its settings in ${ENV}: start the server with `kvbridge "
                               "serve`, not with a plain `vllm serve --middleware ...`.")
        self.mode = settings.get("mode", "mapped")
        self.namespace = settings["namespace"]

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if len(body) > MAX_BODY:
            return await _bad_request(send, f"the request body has {len(body):,} bytes; kvbridge serve takes at most "
                                            f"{MAX_BODY:,}.", param=None)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None  # vLLM answers malformed JSON itself (400)
        if isinstance(data, dict):
            try:
                body = json.dumps(rewrite(data, self.mode, self.namespace)).encode()
            except InputError as exc:
                return await _bad_request(send, str(exc), "cache_salt" if "cache_salt" in str(exc) else
                                          "kv_transfer_params")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app({**scope, "headers": headers}, replay, send)


async def _bad_request(send, message: str, param: str | None) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
