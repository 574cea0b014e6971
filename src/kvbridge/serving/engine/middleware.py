"""The HTTP layer's part of serving: an ASGI middleware in front of vLLM's OpenAI-compatible routes.

For every ``POST`` with a JSON body it refuses, with HTTP 400 and a message before the engine sees it, what
would hurt the engine or the namespace: JSON nested deeper than ``MAX_DEPTH`` (vLLM pickles request options to
its workers: a 500-deep ``kv_transfer_params`` killed the engine), a malformed ``kv_transfer_params`` (not an
object, a key other than kvbridge's, an unknown mode, a bad hold-back) and a client ``cache_salt`` in kvbridge's
reserved namespace. On ``/v1/completions`` and ``/v1/chat/completions`` a request gets the server's default
mode when it names none, and one that may be mapped (``mapped`` or ``auto``) a ``cache_salt`` in the mapper's
namespace, the client's own salt kept after it — so mapped K/V are shared only among requests that asked for
this mapper. Other routes are not salted: their mapped requests fall back to native prefill. ``kvbridge serve``
puts the settings in the environment (``KVBRIDGE_SERVE``) before vLLM imports this class.
"""

from __future__ import annotations

import json
import os

from ...errors import InputError
from .config import (
    HOLD_BACK,
    LOAD,
    NAMESPACE_PREFIX,
    NATIVE_REST,
    PARAM,
    USE_STORE,
    request_hold_back,
    request_load,
    request_mode,
    request_native_rest,
    request_use_store,
    salted,
)

ENV = "KVBRIDGE_SERVE"
PATHS = ("/v1/completions", "/v1/chat/completions")  # the routes whose requests are salted
MAX_BODY = 64 << 20  # bytes
MAX_DEPTH = 64  # JSON nesting (vLLM's own limit for structured-output schemas)


def depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_body(data) -> None:
    """What any route must not pass to the engine (InputError: the 400's message)."""
    deep = [key for key, value in data.items() if depth(value) >= MAX_DEPTH]
    if deep:
        raise InputError(f"the request's {deep[0]} nests more than {MAX_DEPTH} levels deep; kvbridge serve refuses it.")
    params = data.get("kv_transfer_params")
    if isinstance(params, dict):
        unknown = sorted(set(params) - {PARAM, HOLD_BACK, USE_STORE, NATIVE_REST, LOAD})
        if unknown:
            raise InputError(f"kv_transfer_params has unknown keys {', '.join(map(repr, unknown[:5]))}; this server "
                             f"takes {PARAM!r} (mapped, native or auto), {HOLD_BACK!r}, {USE_STORE!r}, "
                             f"{NATIVE_REST!r} and {LOAD!r}.")
    request_mode(params, "native")
    request_hold_back(params)
    request_use_store(params)
    request_native_rest(params)
    request_load(params, False)
    salt = data.get("cache_salt")
    if isinstance(salt, str) and salt.startswith(NAMESPACE_PREFIX):
        raise InputError(f"cache_salt may not start with {NAMESPACE_PREFIX!r}: that namespace holds mapped K/V, and "
                         "only kvbridge sets it. Choose another salt.")


def rewrite(data, mode: str, namespace: str):
    """The request body a kvbridge server hands vLLM for a salted route (InputError: the 400's message)."""
    check_body(data)
    params = data.get("kv_transfer_params")
    chosen = request_mode(params, mode)
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
        if scope.get("type") != "http" or scope.get("method") != "POST":
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
                if scope.get("path") in PATHS:
                    body = json.dumps(rewrite(data, self.mode, self.namespace)).encode()
                else:
                    check_body(data)
            except InputError as exc:
                field = next((f for f in ("cache_salt", "kv_transfer_params") if f in str(exc)), None)
                return await _bad_request(send, str(exc), field)
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
