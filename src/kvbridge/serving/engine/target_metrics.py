"""The target's connector in numbers: request counts by outcome, the map's time and the store's figures, as vLLM logs
them (:class:`KVBridgeStats`, gathered by the scheduler side) and exports them on ``/metrics``
(:class:`KVBridgePromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .target_messages import PHASES, LoadOutcome

STATUSES = ("mapped", "cached", "native", "short", "fallback")
# counters beside them: name -> /metrics documentation
COUNTS = {"stored_tokens": "prompt tokens mapped from the source engine's stored K/V (warm transfer: no source "
                           "prefill)",
          "premapped_tokens": "prompt tokens whose target K/V the source engine mapped ahead (read, not mapped)",
          "hot_tokens": "of those, prompt tokens read from the connector's memory (loaded as the source engine "
                        "announced them)",
          "store_refused": "mapped requests whose store lookup refused an entry (another source model or map, "
                           "torn or corrupted)"}


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Request counts by outcome, the map's time, prefix tokens read from the source's KV store (and of them, mapped
    ahead) and store entries refused, since the last interval (vLLM logs and exports them)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**{s: 0 for s in STATUSES}, "map_ms": 0.0, "write_ms": 0.0, **{c: 0 for c in COUNTS},
                     **{f"read_{p}_ms": 0.0 for p in PHASES}}

    def add_request(self, status: str) -> None:
        """A finished request, by its outcome (``"fallback: …"`` counted as ``fallback``, ``"cached: …"`` as
        ``cached``)."""
        self.data[status.split(":")[0]] += 1

    def add_load(self, outcome: LoadOutcome) -> None:
        """A worker's report of a load: its time (the writes, the phases of a store read) and the store's figures."""
        self.data["map_ms"] += outcome.ms
        for phase, phase_ms in outcome.phases.items():
            self.data[f"read_{phase}_ms"] = self.data.get(f"read_{phase}_ms", 0.0) + phase_ms
        self.data["write_ms"] += outcome.write_ms
        self.data["stored_tokens"] += outcome.stored
        self.data["premapped_tokens"] += outcome.premapped
        self.data["hot_tokens"] += outcome.hot
        self.data["store_refused"] += int(outcome.refused is not None)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**{s: self.data.get(s, 0) for s in STATUSES}, "map_ms": round(self.data.get("map_ms", 0.0), 1),
                "write_ms": round(self.data.get("write_ms", 0.0), 1),
                **{c: self.data.get(c, 0) for c in COUNTS},
                **{f"read_{p}_ms": round(self.data[f"read_{p}_ms"], 1) for p in PHASES
                   if self.data.get(f"read_{p}_ms")}}

    def is_empty(self) -> bool:
        return not any(self.data.get(s) for s in STATUSES)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``/metrics``: ``vllm:kvbridge_requests_total{outcome=…}``, ``vllm:kvbridge_map_seconds_total`` (of it
    ``vllm:kvbridge_write_seconds_total``, the cache writes),
    ``vllm:kvbridge_stored_tokens_total``, ``vllm:kvbridge_premapped_tokens_total``,
    ``vllm:kvbridge_hot_tokens_total``, ``vllm:kvbridge_store_refused_total`` and
    ``vllm:kvbridge_read_seconds_total{phase=…}`` (the loads that read a stored source prefix, by phase:
    :data:`PHASES`)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        requests = self._counter_cls(name="vllm:kvbridge_requests", documentation="kvbridge requests by outcome "
                                     "(mapped, native, short, fallback)", labelnames=[*labelnames, "outcome"])
        seconds = self._counter_cls(name="vllm:kvbridge_map_seconds", documentation="time the kvbridge connector "
                                    "spent building mapped caches", labelnames=labelnames)
        writes = self._counter_cls(name="vllm:kvbridge_write_seconds", documentation="of that time, writing the "
                                   "mapped K/V into the engine's paged cache (its own cache-update op)",
                                   labelnames=labelnames)
        counters = {c: self._counter_cls(name=f"vllm:kvbridge_{c}", documentation=doc, labelnames=labelnames)
                    for c, doc in COUNTS.items()}
        reads = self._counter_cls(name="vllm:kvbridge_read_seconds", documentation="time of the loads that read a "
                                  "stored source prefix (the store's folder or LMCache), by phase: connect, lookup, "
                                  "retrieve, decode, check (LMCache), read (the folder), map, write",
                                  labelnames=[*labelnames, "phase"])
        self._requests = {(e, s): requests.labels(*values, s) for e, values in per_engine_labelvalues.items()
                          for s in STATUSES}
        self._seconds = {e: seconds.labels(*values) for e, values in per_engine_labelvalues.items()}
        self._writes = {e: writes.labels(*values) for e, values in per_engine_labelvalues.items()}
        self._counts = {(e, c): counter.labels(*values) for e, values in per_engine_labelvalues.items()
                        for c, counter in counters.items()}
        self._reads = {(e, p): reads.labels(*values, p) for e, values in per_engine_labelvalues.items()
                       for p in PHASES}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for status in STATUSES:
            if transfer_stats_data.get(status):
                self._requests[(engine_idx, status)].inc(transfer_stats_data[status])
        if transfer_stats_data.get("map_ms"):
            self._seconds[engine_idx].inc(transfer_stats_data["map_ms"] / 1000)
        if transfer_stats_data.get("write_ms"):
            self._writes[engine_idx].inc(transfer_stats_data["write_ms"] / 1000)
        for c in COUNTS:
            if transfer_stats_data.get(c):
                self._counts[(engine_idx, c)].inc(transfer_stats_data[c])
        for phase in PHASES:
            if transfer_stats_data.get(f"read_{phase}_ms"):
                self._reads[(engine_idx, phase)].inc(transfer_stats_data[f"read_{phase}_ms"] / 1000)
