"""What both sides of the target's connector (:mod:`kvbridge.serving.engine.connector`) share: the settings, read and
checked once against the engine (:class:`TargetSetup`), the source engine's KV store opened once it exists
(:class:`StoreOpener`), the LMCache reader, and the connector's logger."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.logger import init_logger

from ...errors import CompatibilityError, UnsupportedModelError
from .config import ServeConfig, mapper_namespace

logger = init_logger("vllm.kvbridge")  # under vLLM's own logger: its handlers and level


def failure(exc: BaseException) -> str:
    """``"<type>: <first line of the message, at most 200 characters>"``: how an outcome names a failure."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _same_model(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


@dataclass(frozen=True)
class TargetSetup:
    """The connector's settings (``config``) and what it reads from the engine and the mapper, the same on the
    scheduler and on each worker."""

    config: ServeConfig
    runtime: Any  # the mapper's runtime options with the server's overrides
    hold_back: int
    source_positions: int  # the source's positions (a prefix longer than them is prefilled natively)
    block_size: int
    prefix_caching: bool
    namespace: str  # the mapper's prefix-cache namespace (config.namespace)
    tensor_parallel: int

    @classmethod
    def read(cls, vllm_config, kv_transfer_config) -> TargetSetup:
        """From the engine's config; refuses (CompatibilityError, UnsupportedModelError) an engine the connector
        cannot serve: another model than the mapper's target, a quantized KV cache, a failure policy other than
        recompute, pipeline or context parallelism."""
        from ...core.mapper_config import read_config

        config = ServeConfig.from_extra(kv_transfer_config.kv_connector_extra_config or {})
        served = vllm_config.model_config.model
        if not _same_model(served, config.target):
            raise CompatibilityError(f"kvbridge connector: the engine serves {served!r} but the mapper's target is "
                                     f"{config.target!r}; serve the target the mapper was fitted for.")
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            raise UnsupportedModelError(f"kvbridge connector: kv cache dtype {vllm_config.cache_config.cache_dtype!r} "
                                        "is not supported; serve with the model's own dtype (--kv-cache-dtype auto).")
        policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise CompatibilityError(f"kvbridge connector: kv_load_failure_policy is {policy!r}; it must be "
                                     "'recompute', so that a failed map is a native prefill, not a failed request.")
        parallel = vllm_config.parallel_config
        sizes = {name: getattr(parallel, name, 1) or 1 for name in ("pipeline_parallel_size",
                                                                     "decode_context_parallel_size",
                                                                     "prefill_context_parallel_size")}
        if any(v != 1 for v in sizes.values()):
            found = ", ".join(f"{k}={v}" for k, v in sizes.items() if v != 1)
            raise UnsupportedModelError(f"kvbridge connector: {found}; the connector writes every layer of the "
                                        "target and each worker's share of its heads, so it serves one device or "
                                        "tensor parallel engines (--tensor-parallel-size), not pipeline or context "
                                        "parallel ones (for now).")
        mapper_config = read_config(config.mapper)
        runtime = mapper_config.runtime.override(**config.runtime)
        return cls(config=config, runtime=runtime, hold_back=runtime.hold_back,
                   source_positions=mapper_config.source.max_positions or 10**12,
                   block_size=vllm_config.cache_config.block_size,
                   prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                   namespace=mapper_namespace(config),
                   tensor_parallel=getattr(parallel, "tensor_parallel_size", 1) or 1)


class StoreOpener:
    """The source engine's KV store (``config.store``): called, the store, None until that engine has created it (or
    without one); opened once."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self._store = None

    def __call__(self):
        if self._store is None and self.config.store:
            from ..store.folder import STORE_FILE, KVStore

            if (Path(self.config.store) / STORE_FILE).exists():
                self._store = KVStore(self.config.store, verify=self.config.store_verify)
        return self._store


def config_geometry(source: str) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the source from its config (no weights loaded)."""
    from ...core.models import text_config

    text = text_config(source)[0]
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return (text.num_hidden_layers, heads,
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def lmcache_source(setup: TargetSetup, vllm_config, geometry: tuple[int, int, int], reads: bool = True):
    """The reader of the source engine's K/V in LMCache: ``geometry`` (layers, kv heads, head dim) from the loaded
    source (or, on the scheduler, its config: :func:`config_geometry`); its pages laid out as this engine lays out its
    own (the source engine must use the same backend, dtype and block size: a layout the reader cannot decode is
    refused here, by name). ``reads`` False: lookups only, no pages (the scheduler)."""
    from vllm.platforms import current_platform

    from ..store.lmcache_store import Geometry, LMCacheSource, page_layout

    config = setup.config
    geometry = Geometry(*geometry)
    layout = page_layout(current_platform.device_type, vllm_config.model_config.dtype, setup.block_size,
                         geometry.head_dim)
    return LMCacheSource(config.lmcache, config.lmcache_model or config.source, setup.block_size, geometry, layout,
                         config.lmcache_timeout_s, max_tokens=min(setup.source_positions, 8192), logger=logger,
                         reads=reads)
