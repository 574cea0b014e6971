"""Serving: kvbridge inside vLLM, through vLLM's own KV-connector API and OpenAI-compatible server.

* :mod:`~kvbridge.serving.engine.config`: the connector's settings, the mapper's prefix-cache namespace, the engine's
  arguments (no vLLM import);
* :mod:`~kvbridge.serving.engine.connector`: the connector vLLM loads (``kv_connector_module_path``);
* :mod:`~kvbridge.serving.engine.middleware`: the HTTP layer's part (request validation, the namespace's cache_salt);
* :mod:`~kvbridge.serving.launch`: ``kvbridge serve``;
* :mod:`~kvbridge.serving.bench.ttft`: time to first token through the engine, native vs mapped.

vLLM is an optional dependency (``pip install "kvbridge[serve]"`` on CPU, ``vllm`` itself on GPU machines).
"""

from __future__ import annotations

from typing import Any

from .engine.config import MODES, PARAM, ServeConfig, engine_kwargs, mapper_namespace, namespace, salted

__all__ = ["MODES", "PARAM", "ServeConfig", "engine_kwargs", "mapped_request", "mapper_namespace", "namespace",
           "salted"]


def mapped_request(prompt: str | list[int], config: ServeConfig, mode: str | None = None,
                   cache_salt: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """For vLLM's offline ``LLM.generate``: ``(prompt, extra_args)`` of one request in ``mode`` (default: the
    config's), its cache_salt in the mapper's namespace when it may be mapped. Use as
    ``llm.generate(prompt, SamplingParams(..., extra_args=extra_args))``; the HTTP server does this itself."""
    from .engine.config import request_mode

    mode = request_mode({PARAM: mode or config.mode}, config.mode)
    item: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
    if mode != "native":
        cache_salt = salted(mapper_namespace(config), cache_salt)
    if cache_salt:
        item["cache_salt"] = cache_salt
    return item, {"kv_transfer_params": {PARAM: mode}}
