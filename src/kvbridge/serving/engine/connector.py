"""A vLLM KV connector that fills a target engine's paged cache with mapped K/V (vLLM's v1 connector API).

Letters: T prompt tokens, m held-back tokens, n tokens the connector loads, H kv heads, D head dim.

The engine asks the connector, per new request, how many prompt tokens it can supply beyond the engine's own
prefix-cache hit (``get_num_new_matched_tokens``). For a request that asks for mapped K/V the answer is every
prompt token but the last ``m`` (``hold_back``) — with the source engine's KV store, when the prompt's stored
prefix leaves at most ``native_rest`` tokens before them (a conversation's new turn), that prefix only, and the
engine computes the rest itself; the scheduler allocates their blocks and, in the same step,
the worker side runs the source prefill and the mapper through kvbridge's own transformers path
(:class:`kvbridge.Bridge`: every lever of the artifact, selective recompute included, RoPE re-applied at the
positions vLLM uses) and writes the post-RoPE K/V through the attention backend's own cache-update op
(``do_kv_cache_update`` with a slot mapping: the paged layout is the backend's business). The engine then
computes the held-back tokens itself, over the mapped prefix, and decodes as usual, batched with everything else.

Asynchronous loads (``sync_load: false`` in the settings, ``kvbridge serve --async-load``, or ``"kvbridge_load":
"async"`` per request; synchronous is the default: it measured better on a 2-core CPU): the connector answers vLLM
that the request's prefix loads asynchronously, the scheduler allocates its blocks and parks it in
``WAITING_FOR_REMOTE_KVS``, and the worker runs the source prefill and the map (cold), or the store read and the map
(warm), in a thread of its own (on a GPU, on a side CUDA stream) while the engine keeps stepping the other requests;
once the blocks are written the worker reports the request in ``get_finished`` and it joins the batch. Synchronous
loads run inside ``start_load_kv``, before the step's forward, every running request waiting for them. One map runs
at a time either way. While the engine has nothing else to step, the worker waits for
a load to finish (at most ``IDLE_WAIT_S``) rather than spin through empty steps.

Transfer is an optimization, never a dependency: when mapping fails for a request (an exception, a non-finite
cache) its blocks are reported as failed loads and vLLM (``kv_load_failure_policy="recompute"``) prefills them
natively; the request is answered, the fallback counted, logged, and named in the response's
``kv_transfer_params`` (``{"kvbridge": "mapped" | "native" | "short" | "cached: …" | "fallback: <reason>", ...}``).
A prompt the source cannot hold (longer than its positions) is prefilled natively from the start.

Approximate K/V stay approximate: with prefix caching on, the connector maps only requests whose
``cache_salt`` lies in the mapper's namespace (:func:`kvbridge.serving.engine.config.namespace`; ``kvbridge serve``
sets it), so mapped blocks are never a prefix-cache hit for a native request or another mapper's.

The connector has two sides, as vLLM's own connectors do: :class:`KVBridgeConnector`, the class vLLM instantiates
once in the scheduler's process and once in each worker, hands each call to its role's half — the scheduler's
(:class:`~kvbridge.serving.engine.target_scheduler.KVBridgeScheduler`: one
:class:`~kvbridge.serving.engine.target_scheduler.RequestState` per request) or the worker's
(:class:`~kvbridge.serving.engine.target_worker.KVBridgeWorker`: the map and the cache writes). What they send each
other is in :mod:`~kvbridge.serving.engine.target_messages`, the numbers they keep in
:mod:`~kvbridge.serving.engine.target_metrics`, the settings both read in :mod:`~kvbridge.serving.engine.target_setup`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .target_metrics import KVBridgePromMetrics, KVBridgeStats
from .target_scheduler import KVBridgeScheduler
from .target_setup import TargetSetup
from .target_worker import KVBridgeWorker


class KVBridgeConnector(KVConnectorBase_V1):
    """The kvbridge connector: ``kv_connector="KVBridgeConnector"``, ``kv_connector_module_path=
    "kvbridge.serving.engine.connector"``, settings in ``kv_connector_extra_config`` (:class:`ServeConfig`).

    A facade: each method vLLM calls goes to ``connector_scheduler`` (the scheduler's process) or
    ``connector_worker`` (each worker), whichever this instance's role holds. A subclass changes a side by its class:
    ``worker_class``, ``scheduler_class``."""

    scheduler_class = KVBridgeScheduler
    worker_class = KVBridgeWorker

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.setup = TargetSetup.read(vllm_config, self._kv_transfer_config)
        self.config = self.setup.config
        self.connector_scheduler: KVBridgeScheduler | None = None
        self.connector_worker: KVBridgeWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_class(self.setup, vllm_config)
        else:
            self.connector_scheduler = self.scheduler_class(self.setup, vllm_config)

    # -- worker side ---------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self.connector_worker is not None:
            self.connector_worker.step_begins(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are done in start_load_kv; asynchronous ones before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: nothing is saved

    def wait_for_save(self):
        if self.connector_worker is not None:  # the forward is done
            self.connector_worker.step_ends(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(self._connector_metadata, finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.connector_worker is None else self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self.connector_worker is None else self.connector_worker.build_connector_worker_meta()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        super().shutdown()

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return None if self.connector_scheduler is None else self.connector_scheduler.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVBridgeStats(data=dict(data)) if data else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
