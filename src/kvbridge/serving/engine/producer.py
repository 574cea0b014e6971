"""The source engine's side of warm transfer: a vLLM KV connector that stores what the source computes.

Letters: L source layers, n tokens a request computes in a step, H kv heads, D head dim, S hidden size.

A vLLM engine serving the *source* model runs this connector (``kv_role="kv_producer"``). It changes nothing in how
the engine serves: every request is prefilled and decoded as usual. Alongside, for every token a request computes
(prompt or generated), the connector keeps the post-RoPE keys and values the engine writes into its paged cache and
the model's final hidden state at that token; each time a request's tokens fill a block of ``block_size`` tokens
(the engine's own block size, so that the engine's prefix-cache hits — whole blocks — are always blocks some
earlier request stored), the block is written to the :class:`~kvbridge.serving.store.folder.KVStore` by a background
thread. The target's engine (:mod:`kvbridge.serving.engine.connector`) then maps stored blocks instead of running the
source again: the map alone replaces the target's prefill. With map-ahead (``StoreConfig.mapper`` and ``target``),
a second thread maps each stored block (:func:`kvbridge.core.transfer.map_block`) and stores the target's K/V beside
it: the target's connector then reads the block instead of mapping it.

What it observes, and how, without a fork of vLLM: the keys and values reach it through the attention backend's own
cache-update call (``impl.do_kv_cache_update``, wrapped once per layer: the paged layout stays the backend's
business), and the hidden states through a forward hook on the served model (the module whose output the engine
turns into logits). Tokens are matched to requests through the slot mapping of the step. Both need the Python code
of those calls to run at every step: engines that replay CUDA graphs do not, so the connector refuses to start
unless the engine runs eagerly (``--enforce-eager``), as it does on CPU.

The connector has two sides, as vLLM's own connectors do: :class:`KVBridgeSourceConnector`, the class vLLM
instantiates in the scheduler's process and in the worker, hands each call to its role's half — the scheduler's
(:class:`~kvbridge.serving.engine.source_scheduler.KVBridgeSourceScheduler`: which requests are stored, where each
step's tokens land) or the worker's (:class:`~kvbridge.serving.engine.source_worker.KVBridgeSourceWorker`: the
observation, with the writer and map-ahead threads of :mod:`~kvbridge.serving.engine.source_writer`); the settings and
the store both read are in :mod:`~kvbridge.serving.engine.source_setup`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .source_scheduler import KVBridgeSourceScheduler
from .source_setup import SourceSetup
from .source_worker import KVBridgeSourceWorker


class KVBridgeSourceConnector(KVConnectorBase_V1):
    """``kv_connector="KVBridgeSourceConnector"``, ``kv_connector_module_path="kvbridge.serving.engine.producer"``,
    ``kv_role="kv_producer"``, settings in ``kv_connector_extra_config`` (:class:`StoreConfig`).

    A facade: each method vLLM calls goes to ``connector_scheduler`` (the scheduler's process) or
    ``connector_worker`` (the worker), whichever this instance's role holds."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.setup = SourceSetup.read(vllm_config, self._kv_transfer_config, kv_cache_config)
        self.config = self.setup.config
        self.connector_scheduler: KVBridgeSourceScheduler | None = None
        self.connector_worker: KVBridgeSourceWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = KVBridgeSourceWorker(self.setup, vllm_config)
        else:
            self.connector_scheduler = KVBridgeSourceScheduler(self.setup)

    # -- scheduler side ------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.step_begins(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # a producer loads nothing

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # the K/V are observed at the cache update (layout-independent), not read back from the paged cache

    def wait_for_save(self):
        """After the step's forward: append each request's captured tokens; queue every block they complete."""
        if self.connector_worker is not None:
            self.connector_worker.step_ends(self._connector_metadata)

    def flush(self) -> None:
        """Wait until every queued block is written and mapped ahead (tests, shutdown)."""
        if self.connector_worker is not None:
            self.connector_worker.flush()

    def shutdown(self):
        self.flush()
