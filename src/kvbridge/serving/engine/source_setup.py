"""What both sides of the source's storing connector (:mod:`kvbridge.serving.engine.producer`) share: the settings
and the store, read and checked once against the engine (:class:`SourceSetup`), and the connector's logger."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

from ...errors import UnsupportedModelError
from ..store.folder import KVStore
from ..store.keys import folder_identity
from .config import StoreConfig

logger = init_logger("vllm.kvbridge")


@dataclass(frozen=True)
class SourceSetup:
    """The storing connector's settings (``config``), the engine's block size, the source's checkpoint folder and
    identity in the store, and the store: the same on the scheduler and on the worker."""

    config: StoreConfig
    block_size: int
    source: str  # the checkpoint folder the engine serves (its identity is read from it)
    identity: str
    store: KVStore

    @classmethod
    def read(cls, vllm_config, kv_transfer_config, kv_cache_config) -> SourceSetup:
        """From the engine's config; refuses (UnsupportedModelError) an engine whose K/V the connector cannot
        observe or store faithfully."""
        config = StoreConfig.from_extra(kv_transfer_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if (parallel.tensor_parallel_size or 1) != 1 or (parallel.pipeline_parallel_size or 1) != 1:
            raise UnsupportedModelError("kvbridge source connector: tensor and pipeline parallel engines are not "
                                        "supported yet (one worker must see every layer and head).")
        if vllm_config.speculative_config is not None:
            raise UnsupportedModelError("kvbridge source connector: speculative decoding is not supported (tokens "
                                        "it rejects would be stored); serve the source without it.")
        model_config = vllm_config.model_config
        eager = model_config.enforce_eager or vllm_config.device_config.device_type == "cpu"
        refusals = {
            "the engine must run eagerly (--enforce-eager): CUDA graph replays skip the calls through which the "
            "connector sees the K/V": not eager,
            "the served model takes images (K/V of an image would be stored under its placeholder tokens): serve "
            "the source with --language-model-only": model_config.supports_multimodal_inputs,
            "LoRA adapters are enabled (an adapter's K/V would be stored as the base model's)":
                vllm_config.lora_config is not None,
            f"the engine quantizes the model ({model_config.quantization}) and the mapper was fitted on its own "
            "weights": model_config.quantization is not None,
            "multi-head latent attention (MLA) caches are not per-head K/V": model_config.use_mla,
            "the KV cache has several groups (sliding-window or hybrid layers)":
                kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1,
        }
        for reason, refused in refusals.items():
            if refused:
                raise UnsupportedModelError(f"kvbridge source connector: {reason}.")
        block_size = vllm_config.cache_config.block_size
        source = config.source or model_config.model
        if not Path(source).is_dir():  # a hub id: the snapshot vLLM serves
            from ...core.models import resolve_model

            source = resolve_model(source, model_config.revision)
        identity = folder_identity(source)
        store = KVStore(config.store, block_tokens=block_size, cap_bytes=config.cap_bytes, create=True)
        return cls(config, block_size, source, identity, store)
