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
PATHS = ("/v1/completions", "/v1/chat/completions")


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
        self.mode = settings.get("mode", "mapped")
        self.namespace = settings.get("namespace", "")

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
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # vLLM answers malformed JSON itself (400)
        if isinstance(data, dict):
            try:
                body = json.dumps(rewrite(data, self.mode, self.namespace)).encode()
            except InputError as exc:
                return await _bad_request(send, str(exc))
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


async def _bad_request(send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "kv_transfer_params",
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
