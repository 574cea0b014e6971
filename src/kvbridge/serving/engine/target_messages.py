"""What the two sides of the target's connector send each other through vLLM: the scheduler's plan of a step
(:class:`KVBridgeMetadata`: a :class:`Load` per request to map), and the workers' reports
(:class:`KVBridgeWorkerMetadata`: a :class:`LoadOutcome` per request loaded). vLLM pickles both between processes
(the scheduler's and the workers')."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .config import StoreUse

# a load's time reading a stored source prefix, by phase: from LMCache (connect, when the read dialed the server;
# lookup, retrieve, decode of the source engine's page layout, check of the values' range) or from the store's folder
# (read: the entries found, checked); then the map and the writes into the engine's paged cache
PHASES = ("connect", "lookup", "retrieve", "decode", "check", "read", "map", "write")


@dataclass
class Load:
    """One request's mapped prefix: K/V of prompt positions [start, end) into ``block_ids`` (the request's blocks,
    in order); the source reads ``token_ids`` (its first ``end`` prompt tokens)."""

    request_id: str
    token_ids: list[int]
    start: int
    end: int
    block_ids: list[int]
    salt: str | None = None  # the client's own cache_salt: the store's entries are keyed by it too
    use_store: StoreUse = StoreUse.ON  # what of the store it may read (config.request_use_store)
    asynchronous: bool = False  # mapped in the worker's thread, beside the engine's steps


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    idle: bool = False  # the step schedules no token: the worker may wait for an asynchronous load


@dataclass(frozen=True)
class LoadOutcome:
    """A finished load, as a worker reports it."""

    status: str  # "mapped" or "fallback: <reason>"
    ms: float = 0.0  # the load's time (the map's, reads and writes included)
    stored: int = 0  # prefix tokens read from the source's KV store
    refused: str | None = None  # why a store entry was refused (None: none was)
    premapped: int = 0  # prefix tokens whose target K/V the source engine had mapped ahead
    hot: int = 0  # of them, read from the connector's memory
    write_ms: float = 0.0  # of ``ms``, the writes into the engine's paged cache
    phases: dict[str, float] = field(default_factory=dict)  # ms by phase (PHASES); empty when no store was consulted

    @property
    def mapped(self) -> bool:
        return self.status == "mapped"

    def combine(self, other: LoadOutcome) -> LoadOutcome:
        """The request's outcome over two tensor-parallel workers' reports: one worker's failure makes the load a
        failure; both mapped, each has its own memory tier: what all of them read there, the slowest worker's writes
        and phases."""
        if self.mapped and not other.mapped:
            return other
        if self.mapped and other.mapped:
            phases = {k: max(self.phases.get(k, 0.0), other.phases.get(k, 0.0))
                      for k in {**self.phases, **other.phases}}
            return replace(self, hot=min(self.hot, other.hot), write_ms=max(self.write_ms, other.write_ms),
                           phases=phases)
        return self


@dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler: each loaded request's :class:`LoadOutcome`."""

    outcomes: dict[str, LoadOutcome] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.outcomes)
        for rid, outcome in getattr(other, "outcomes", {}).items():
            merged[rid] = merged[rid].combine(outcome) if rid in merged else outcome
        return KVBridgeWorkerMetadata(merged)
