"""What a kvbridge connector inside a vLLM engine needs to know, and the engine arguments that set it up.

No vLLM import here: :func:`engine_kwargs` builds the keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs``
(``kvbridge.serving.launch.vllm_argv`` the same as ``vllm serve`` flags), so they can be checked without an engine.

A request says how its prompt's prefix is built with ``kv_transfer_params={"kvbridge": MODE}``:

* ``mapped``: the source prefills all prompt tokens but the last ``hold_back``, the mapper builds the target's
  K/V for them, the connector writes them into the engine's paged cache; the engine computes the rest itself;
* ``native``: the engine prefills the whole prompt, as without kvbridge;
* ``auto``: ``mapped`` for prompts of at least ``min_tokens`` tokens, ``native`` below (mapping a short prompt
  costs more than it saves: measure the break-even with ``kvbridge bench``).

``"kvbridge_store": false`` (optional) builds the prefix from a fresh source prefill even when the server's KV store
holds the source's own K/V of it (the cold path, for comparisons); ``"source"`` maps the stored source K/V at the
switch, ignoring blocks the source engine mapped ahead; ``"folder"`` reads the blocks mapped ahead from the
store's folder even when the connector holds them in memory (both for comparisons). When the stored prefix leaves
at most ``native_rest`` prompt tokens before the hold-back (a conversation's new turn), the connector loads the
stored prefix only and the engine computes those tokens itself, over it, as it computes the held-back ones: no
source prefill at all (``"kvbridge_native_rest": n`` per request; 0: the source and the mapper cover them too, and
the warm prefix equals the cold path's). ``"kvbridge_load": "sync" | "async"`` (optional; default the server's
``sync_load``) runs the request's map inside the engine's step, or beside it while the engine serves the other
requests (the request waits, and joins once its blocks are written). ``"kvbridge_hold_back": n`` (optional) makes
the engine compute the last ``n`` prompt tokens itself instead of the mapper's hold-back: a scoring request that
asks for ``prompt_logprobs`` of a continuation holds the continuation back, so it is scored by the target over the
mapped context.

Approximate K/V stay approximate: a mapped request's blocks live in the prefix cache under a ``cache_salt``
of their own (:func:`namespace`: the mapper's checksums and runtime options), so a request that did not ask
for mapped K/V from this very mapper never gets them as a prefix-cache hit.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from ...errors import InputError, UnsupportedModelError

MODES = ("mapped", "native", "auto")
PARAM = "kvbridge"  # the key of kv_transfer_params a request sets
HOLD_BACK = "kvbridge_hold_back"  # and its own hold-back, optionally
USE_STORE = "kvbridge_store"  # and whether stored source K/V may be used (default: yes, when the server has a store)
PREWARM = "kvbridge_prewarm"  # (to the source) load this conversation into the target's prefix cache ahead
NATIVE_REST = "kvbridge_native_rest"  # and how many tokens after a stored prefix the engine computes itself
LOAD = "kvbridge_load"  # and whether its map runs inside the engine's step ("sync") or beside it ("async")
LOADS = ("sync", "async")
CONNECTOR = "KVBridgeConnector"
CONNECTOR_MODULE = "kvbridge.serving.engine.connector"
PRODUCER = "KVBridgeSourceConnector"
PRODUCER_MODULE = "kvbridge.serving.engine.producer"
NAMESPACE_PREFIX = "kvbridge-"
MAX_SALT = 128  # vLLM's limit on cache_salt


class ExtraConfig:
    """A connector's settings as ``kv_connector_extra_config`` (a JSON object) and back."""

    @classmethod
    def from_extra(cls, extra: Any):
        """From ``kv_connector_extra_config`` (unknown keys are refused: a misspelled option would be ignored)."""
        if not isinstance(extra, dict):
            raise InputError("kvbridge serving: kv_connector_extra_config must be a JSON object.")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise InputError(f"kvbridge serving: unknown connector option(s) {', '.join(unknown)}; the options "
                             f"are {', '.join(sorted(names))}.")
        return cls(**extra)

    def to_extra(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ServeConfig(ExtraConfig):
    """The connector's settings (``kv_connector_extra_config``), validated on construction.

    ``mapper``, ``source`` and ``target``: folders (resolved hub snapshots included); ``target`` must be the model
    the engine serves. ``mode``: the default for requests that do not say; ``min_tokens``: ``auto``'s break-even
    prompt length. ``device``/``dtype``: where the source and the mapper run inside the engine's worker (the
    target's config and RoPE sit beside them, and its transformers weights only for a selective recompute).
    ``runtime``: overrides of the mapper's runtime options (hold_back, recompute, recompute_by, recompute_window, sink).
    ``store``: the folder of the source engine's KV store (warm transfer: stored blocks of a prompt are mapped
    without a source prefill, or read where that engine mapped them ahead); ``store_verify``: check each entry's
    CRC-32 as it is read; ``native_rest``: when a prompt's stored prefix leaves at most this many tokens before the
    hold-back (a conversation's new turn), the engine computes them itself over the stored prefix instead of the
    source prefilling them for the mapper (0: never — the warm prefix then equals the cold path's);
    ``store_memory_bytes``: blocks the source engine maps ahead are loaded into the worker's memory as they are
    announced, up to this many bytes (:mod:`kvbridge.serving.store.hot`; 0: read from the folder when a request needs
    them).
    ``sync_load`` (default): a mapped request's source prefill and map (or store read and map) run inside the
    engine's step, every running request waiting for them; false: in a worker thread beside the steps (vLLM's
    asynchronous KV load: the request waits in ``WAITING_FOR_REMOTE_KVS`` and joins once its blocks are written).
    Synchronous is the default because it measured better on a 2-core CPU (``kvbridge load-bench``: the thread's map
    competes with the engine's steps for the cores and the interpreter, and took 1.7× as long).
    ``lmcache``: instead of ``store``, the URL (``tcp://host:port``) of the LMCache server a source engine stores its
    K/V in through vLLM's ``LMCacheMPConnector`` (:mod:`kvbridge.serving.store.lmcache_store`; whole LMCache chunks, no
    map-ahead); ``lmcache_model``: the model name that engine was given (LMCache keys by it; default: ``source``,
    as ``kvbridge serve-source`` gives it); ``lmcache_timeout_s``: the longest wait for one LMCache round trip.
    """

    mapper: str
    source: str
    target: str
    mode: str = "mapped"
    min_tokens: int = 256
    device: str = "cpu"
    dtype: str = "auto"
    runtime: dict[str, Any] = field(default_factory=dict)
    allow_revision_mismatch: bool = False
    store: str | None = None
    store_verify: bool = True
    native_rest: int = 256
    store_memory_bytes: int = 1 << 30
    sync_load: bool = True
    lmcache: str | None = None
    lmcache_model: str | None = None
    lmcache_timeout_s: float = 2.0

    def __post_init__(self):
        for name in ("mapper", "source", "target"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InputError(f"kvbridge serving: {name} must be a folder or hub id, not {getattr(self, name)!r}.")
        if self.mode not in MODES:
            raise InputError(f"kvbridge serving: the default mode must be one of {', '.join(MODES)}, not "
                             f"{self.mode!r}.")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 2:
            raise InputError(f"kvbridge serving: min_tokens must be an integer >= 2, not {self.min_tokens!r}.")
        if self.store is not None and (not isinstance(self.store, str) or not self.store):
            raise InputError(f"kvbridge serving: store must be a folder, not {self.store!r}.")
        if self.lmcache is not None:
            from ..store.lmcache_store import parse_url

            parse_url(self.lmcache)
            if self.store is not None:
                raise InputError("kvbridge serving: the source's stored K/V are read from one place: a store folder "
                                 "or an LMCache server, not both.")
        if self.lmcache_model is not None and (not isinstance(self.lmcache_model, str) or not self.lmcache_model):
            raise InputError(f"kvbridge serving: lmcache_model must be the source engine's model name, not "
                             f"{self.lmcache_model!r}.")
        if not isinstance(self.lmcache_timeout_s, (int, float)) or isinstance(self.lmcache_timeout_s, bool) or \
                not 0 < self.lmcache_timeout_s <= 600:
            raise InputError(f"kvbridge serving: lmcache_timeout_s must be in (0, 600] seconds, not "
                             f"{self.lmcache_timeout_s!r}.")
        request_native_rest({NATIVE_REST: self.native_rest}, "native_rest")
        if not isinstance(self.store_memory_bytes, int) or isinstance(self.store_memory_bytes, bool) or \
                self.store_memory_bytes < 0:
            raise InputError(f"kvbridge serving: store_memory_bytes must be an integer >= 0, not "
                             f"{self.store_memory_bytes!r}.")
        if not isinstance(self.sync_load, bool):
            raise InputError(f"kvbridge serving: sync_load must be true or false, not {self.sync_load!r}.")
        known = {"hold_back", "recompute", "recompute_by", "recompute_window", "sink"}
        if not isinstance(self.runtime, dict) or set(self.runtime) - known:
            raise InputError(f"kvbridge serving: runtime overrides must be a dict of {', '.join(sorted(known))}, "
                             f"not {self.runtime!r}.")



@dataclass(frozen=True)
class StoreConfig(ExtraConfig):
    """The source engine's connector settings (:mod:`kvbridge.serving.engine.producer`): the ``store`` folder, its
    ``cap_bytes`` (least recently used blocks go beyond it), and the ``source`` checkpoint folder when the engine
    serves it under another path (its identity is read from it; default: the served model). ``mapper`` and
    ``target`` (folders): map ahead — each stored block is also mapped into the target's K/V, in the background,
    so that the target's connector reads it instead of mapping it; ``dtype``: the map's (``auto``: float32 on CPU,
    bfloat16 on a GPU, as the target's connector; entries of another dtype are not read there). ``prewarm``: every
    request asks the target's server to load its conversation ahead (:mod:`kvbridge.serving.store.prewarm`; per request
    ``kv_transfer_params={"kvbridge_prewarm": true | false}``)."""

    store: str
    cap_bytes: int = 2 << 30
    source: str | None = None
    mapper: str | None = None
    target: str | None = None
    dtype: str = "auto"
    prewarm: bool = False

    def __post_init__(self):
        if not isinstance(self.store, str) or not self.store:
            raise InputError(f"kvbridge source connector: store must be a folder, not {self.store!r}.")
        for name in ("source", "mapper", "target"):
            if getattr(self, name) is not None and (not isinstance(getattr(self, name), str) or
                                                    not getattr(self, name)):
                raise InputError(f"kvbridge source connector: {name} must be a folder, not "
                                 f"{getattr(self, name)!r}.")
        if self.mapper is not None and not Path(self.mapper).is_dir():
            raise InputError(f"kvbridge source connector: mapper must be a mapper folder (a resolved hub snapshot), "
                             f"not {self.mapper!r}.")
        if (self.mapper is None) != (self.target is None):
            raise InputError("kvbridge source connector: map-ahead needs both the mapper and its target (the "
                             "target's config gives the RoPE the mapped keys carry); pass both or neither.")
        if not isinstance(self.cap_bytes, int) or isinstance(self.cap_bytes, bool) or self.cap_bytes < 1:
            raise InputError(f"kvbridge source connector: cap_bytes must be a positive integer, not "
                             f"{self.cap_bytes!r}.")
        if not isinstance(self.prewarm, bool):
            raise InputError(f"kvbridge source connector: prewarm must be true or false, not {self.prewarm!r}.")


def check_map_ahead(mapper_dir: str) -> None:
    """Refuse map-ahead for a pair whose RoPE depends on the prompt's length (``dynamic``): a block is mapped before
    the prompt's end is known, so its keys would be un-rotated or rotated at other frequencies than the whole
    prompt's map uses."""
    from ...core.mapper_config import read_config

    config = read_config(mapper_dir)
    for role, info in (("source", config.source), ("target", config.target)):
        if info.rope.rope_type == "dynamic":
            raise UnsupportedModelError(f"map-ahead: the {role}'s RoPE is 'dynamic' (its frequencies depend on the "
                                        "prompt's length), so a block cannot be mapped before the prompt ends; serve "
                                        "the source without --mapper (the target's connector maps stored K/V).")


def namespace(mapper_dir: str | Path, runtime: dict[str, Any]) -> str:
    """The prefix-cache namespace of mapped K/V: the mapper's checksums file (its weights and mapper.json) and the
    runtime options the requests run with, hashed. Two servers with the same mapper and options share it."""
    from ...core.artifact import CHECKSUMS_FILE
    from ...core.hashing import sha256_json

    checksums = (Path(mapper_dir) / CHECKSUMS_FILE).read_text(encoding="utf-8")
    return NAMESPACE_PREFIX + sha256_json({"checksums": checksums, "runtime": runtime})[:32]


@functools.lru_cache(maxsize=16)
def _namespace_of(mapper: str, runtime_json: str) -> str:
    from ...core.mapper_config import read_config

    runtime = read_config(mapper).runtime.override(**json.loads(runtime_json)).to_dict()
    return namespace(mapper, runtime)


def mapper_namespace(config: ServeConfig) -> str:
    """The namespace of ``config``'s mapper with its runtime overrides: what the connector, the HTTP layer and
    offline callers salt with (read and hashed once per process: a served artifact does not change under it)."""
    return _namespace_of(config.mapper, json.dumps(config.runtime, sort_keys=True))


def salted(namespace_: str, salt: Any) -> str:
    """A request's cache_salt in the mapper's namespace (a salt of its own kept after it, within vLLM's limit)."""
    if salt is None or salt == "":
        return namespace_
    if not isinstance(salt, str):
        raise InputError(f"cache_salt must be a string, not {type(salt).__name__}.")
    if len(namespace_) + 1 + len(salt) > MAX_SALT:
        raise InputError(f"cache_salt is {len(salt)} characters; with kvbridge's mapper namespace "
                         f"({len(namespace_)} characters) a mapped request's salt may have at most "
                         f"{MAX_SALT - len(namespace_) - 1}.")
    return f"{namespace_}:{salt}"


def in_namespace(salt: str | None, namespace_: str) -> bool:
    return isinstance(salt, str) and (salt == namespace_ or salt.startswith(namespace_ + ":"))


def request_mode(params: Any, default: str) -> str:
    """A request's mode from its ``kv_transfer_params`` (None or without the key: ``default``); InputError for
    anything else, with what to send."""
    if params is None:
        return default
    if not isinstance(params, dict):
        raise InputError(f"kv_transfer_params must be a JSON object such as {{\"{PARAM}\": \"mapped\"}}, not "
                         f"{type(params).__name__}.")
    mode = params.get(PARAM, default)
    if mode not in MODES:
        raise InputError(f"kv_transfer_params.{PARAM} must be one of {', '.join(MODES)}, not {mode!r}.")
    return mode


def request_hold_back(params: Any) -> int | None:
    """A request's own ``kv_transfer_params.kvbridge_hold_back`` (prompt tokens the engine computes itself: the
    scored continuation of a log-likelihood request, say), None when it sets none; InputError for a bad value."""
    value = params.get(HOLD_BACK) if isinstance(params, dict) else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InputError(f"kv_transfer_params.{HOLD_BACK} must be an integer >= 1 (prompt tokens the engine computes "
                         f"itself), not {value!r}.")
    return value


class StoreUse(Enum):
    """What of the source engine's KV store a mapped request's load may read (``kv_transfer_params.kvbridge_store``,
    parsed once by :func:`request_use_store`)."""

    ON = "on"  # true (the default): the store's entries, blocks mapped ahead read, from memory where loaded
    FOLDER = "folder"  # "folder": blocks mapped ahead read from the store's folder (a comparison with the memory tier)
    SOURCE = "source"  # "source": the stored source K/V only, mapped at the switch (a comparison with map-ahead)
    OFF = "off"  # false: a fresh source prefill even when the store holds the prefix (the cold path)

    @property
    def reads_store(self) -> bool:
        """Whether the load consults the store (its folder or LMCache) at all."""
        return self is not StoreUse.OFF

    @property
    def reads_ahead(self) -> bool:
        """Whether the load reads the blocks the source engine mapped ahead."""
        return self in (StoreUse.ON, StoreUse.FOLDER)

    @property
    def from_memory(self) -> bool:
        """Whether blocks mapped ahead are read from the connector's memory where it loaded them."""
        return self is StoreUse.ON


def request_use_store(params: Any) -> StoreUse:
    """A request's ``kv_transfer_params.kvbridge_store``: true (what it sets when it sets none: the store's entries,
    blocks mapped ahead read, from memory where the connector loaded them), ``"folder"`` (those blocks read from the
    store's folder: a comparison with the memory tier), ``"source"`` (the stored source K/V only, mapped at the
    switch: a comparison with map-ahead) or false (a fresh source prefill even when the store holds the prefix — the
    cold path), as a :class:`StoreUse`; InputError for anything else."""
    value = params.get(USE_STORE, True) if isinstance(params, dict) else True
    if not isinstance(value, bool) and value not in ("source", "folder"):
        raise InputError(f'kv_transfer_params.{USE_STORE} must be true, false, "folder" or "source", not {value!r}.')
    if isinstance(value, bool):
        return StoreUse.ON if value else StoreUse.OFF
    return StoreUse(value)


def request_native_rest(params: Any, name: str = f"kv_transfer_params.{NATIVE_REST}") -> int | None:
    """A request's own ``kv_transfer_params.kvbridge_native_rest`` (the most tokens after a stored prefix that the
    engine computes itself rather than the source and the mapper), None when it sets none; InputError for a bad
    value."""
    value = params.get(NATIVE_REST) if isinstance(params, dict) else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise InputError(f"{name} must be an integer >= 0 (0: the source and the mapper cover every token after a "
                         f"stored prefix too), not {value!r}.")
    return value


def request_load(params: Any, sync_default: bool) -> bool:
    """Whether a request's map runs asynchronously (``kv_transfer_params.kvbridge_load``: ``"sync"`` or ``"async"``;
    unset: the server's default, ``not sync_default``); InputError for anything else."""
    value = params.get(LOAD) if isinstance(params, dict) else None
    if value is None:
        return not sync_default
    if value not in LOADS:
        raise InputError(f'kv_transfer_params.{LOAD} must be "sync" or "async", not {value!r}.')
    return value == "async"


def client_salt(salt: str | None, namespace_: str) -> str | None:
    """The client's own part of a mapped request's cache_salt (``namespace:salt``), None when it set none: what
    the source engine saw as that client's salt."""
    if not isinstance(salt, str) or not in_namespace(salt, namespace_):
        return salt
    return salt[len(namespace_) + 1:] or None


def llama4_scaling(target_dir: str | Path) -> dict[str, Any] | None:
    """The ``hf_overrides`` that make vLLM apply Ministral-3's position-dependent query scaling as transformers does.

    transformers' Ministral3 keeps ``llama_4_scaling_beta`` inside ``rope_parameters``; vLLM's Mistral model applies
    the scaling only when the config has a top-level ``llama_4_scaling``. Without it vLLM serves a different model
    past ``original_max_position_embeddings`` (16,384 on the real Ministral-3). Read from the target's own config
    (text config of a multimodal repo included); None when the model has no such scaling.
    """
    config = json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    if text.get("llama_4_scaling") or config.get("llama_4_scaling"):
        return None  # already in vLLM's form
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    original = rope.get("original_max_position_embeddings")
    if beta is None or original is None:
        return None
    scaling = {"original_max_position_embeddings": int(original), "beta": float(beta)}
    return {"text_config": {"llama_4_scaling": scaling}} if "text_config" in config else {"llama_4_scaling": scaling}


def producer_transfer_config(config: StoreConfig) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for an engine serving the source with the storing connector."""
    return {"kv_connector": PRODUCER, "kv_connector_module_path": PRODUCER_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": config.to_extra()}


def engine_kwargs(config: ServeConfig | None = None, **vllm_options) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (or ``AsyncEngineArgs``) serving ``config.target`` with the kvbridge
    connector (``config`` None: the target alone, no connector — the native baseline), with the target's
    llama-4 query scaling in vLLM's form. ``vllm_options`` are passed through (dtype, max_model_len, …) and win."""
    kwargs: dict[str, Any] = {}
    if config is not None:
        kwargs["model"] = config.target
        kwargs["kv_transfer_config"] = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                                        "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                                        "kv_connector_extra_config": config.to_extra()}
    kwargs.update(vllm_options)
    if "model" not in kwargs:
        raise InputError("engine_kwargs needs a ServeConfig or model=...")
    overrides = llama4_scaling(kwargs["model"])
    if overrides:
        kwargs["hf_overrides"] = {**overrides, **(kwargs.get("hf_overrides") or {})}
    return kwargs
