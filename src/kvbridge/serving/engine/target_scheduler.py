"""The scheduler's side of the target's connector (:mod:`kvbridge.serving.engine.connector`): per request, whether
its prefix is mapped and how many tokens the connector loads, the plan of each step for the workers, and the request's
outcome in its response (``kv_transfer_params``) and in the connector's stats. No weights are loaded here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .config import (
    PARAM,
    StoreUse,
    client_salt,
    in_namespace,
    request_hold_back,
    request_load,
    request_mode,
    request_native_rest,
    request_use_store,
)
from .target_messages import PHASES, KVBridgeMetadata, Load, LoadOutcome
from .target_metrics import KVBridgeStats
from .target_setup import StoreOpener, TargetSetup, config_geometry, lmcache_source, logger


@dataclass(frozen=True)
class Decision:
    """The scheduler's answer about a request the engine is about to schedule (provisional until the engine
    allocates its blocks)."""

    status: str  # "mapped", "native", "short", "cached: …" or "fallback: <reason>"
    tokens: int = 0  # prompt tokens the connector loads, beyond the engine's own prefix-cache hit
    end: int = 0  # where the loaded prefix ends
    asynchronous: bool = False  # loaded beside the engine's steps
    use_store: StoreUse = StoreUse.ON  # what of the store the load may read


@dataclass
class RequestState:
    """One request on the scheduler's side, from the engine's first question about it to its end."""

    decision: Decision | None = None  # the last answer, until the engine allocates the request's blocks
    lookup: tuple[int, int] | None = None  # (limit, stored tokens): the store asked once per limit, not every step
    status: str | None = None  # its outcome so far, once the engine allocated it (None: never allocated)
    tokens: int = 0  # prompt tokens mapped
    outcome: LoadOutcome | None = None  # the workers' report of its load

    def report(self, outcome: LoadOutcome) -> None:
        """The workers' report of a load; a refusal or read phases an earlier load of the request (before a
        preemption) reported stay when this one has none."""
        self.status = outcome.status
        if self.outcome is not None:
            outcome = replace(outcome, refused=self.outcome.refused if outcome.refused is None else outcome.refused,
                              phases=outcome.phases or self.outcome.phases)
        self.outcome = outcome

    def params(self, store_figures: bool) -> dict[str, Any]:
        """The response's ``kv_transfer_params``: the outcome, and with a load the figures of it (``store_figures``:
        the server reads a store, whose figures are given)."""
        params: dict[str, Any] = {PARAM: self.status}
        out = self.outcome
        if self.status == "mapped":
            params["kvbridge_mapped_tokens"] = self.tokens
            if out is not None and store_figures:
                params["kvbridge_stored_tokens"] = out.stored
                params["kvbridge_premapped_tokens"] = out.premapped
                params["kvbridge_hot_tokens"] = out.hot
            if out is not None and out.refused is not None:
                params["kvbridge_store_refused"] = out.refused
        if out is not None:
            params["kvbridge_map_ms"], params["kvbridge_write_ms"] = round(out.ms, 2), round(out.write_ms, 2)
            if out.phases:  # the load read a stored prefix: its time by phase
                params["kvbridge_read_ms"] = {p: round(out.phases[p], 2) for p in PHASES if p in out.phases}
        return params


class KVBridgeScheduler:
    """The connector on the scheduler's side (:class:`~kvbridge.serving.engine.connector.KVBridgeConnector`
    delegates to it): decides per request, plans the loads, reports the outcomes."""

    def __init__(self, setup: TargetSetup, vllm_config):
        self.setup = setup
        self.config = setup.config
        self.store = StoreOpener(self.config)
        self._requests: dict[str, RequestState] = {}
        self._planned: dict[str, Load] = {}  # allocated this step, sent with the next metadata
        self._stats = KVBridgeStats()
        self._lmcache = None
        self._identity: str | None = None
        if self.config.lmcache:  # the scheduler counts the stored prefix (lookups only: no pages)
            self._lmcache = lmcache_source(setup, vllm_config, config_geometry(self.config.source), reads=False)
        elif self.config.store:  # the scheduler counts how much of a prompt is stored (no weights loaded)
            try:
                from ..store.keys import folder_identity

                self._identity = folder_identity(self.config.source)
            except Exception as exc:  # the store is an optimization: every prompt token is then loaded
                logger.warning("kvbridge connector: cannot tell the source's store identity from %s (%s); the "
                               "rest after a stored prefix is mapped from the source, never left to the engine",
                               self.config.source, exc)

    def decide(self, request, num_computed_tokens: int, state: RequestState | None = None) -> Decision:
        """The answer for a request the engine is about to schedule: its outcome and the tokens to load."""
        params = request.kv_transfer_params
        try:
            asynchronous = request_load(params, self.config.sync_load)
            mode = request_mode(params, self.config.mode)
            hold_back = request_hold_back(params) or self.setup.hold_back
            use_store = request_use_store(params)
            native_rest = request_native_rest(params)
        except Exception as exc:  # the HTTP layer refuses these with a 400; an offline caller gets native
            return Decision(f"fallback: {exc}", end=num_computed_tokens)
        prompt = len(request.prompt_token_ids or ())
        refused = self._not_mapped(request, mode, prompt, prompt - hold_back)
        if refused is not None:
            return Decision(refused, end=num_computed_tokens)
        native_rest = self.config.native_rest if native_rest is None else native_rest
        end = self._warm_end(request, state or RequestState(), prompt - hold_back, use_store, native_rest)
        if num_computed_tokens >= end:  # K/V of this mapper's namespace (mapped, or recomputed after a fallback)
            return Decision("cached: the prefix to load was a prefix-cache hit in the mapper's namespace",
                            end=num_computed_tokens)
        return Decision("mapped", end - num_computed_tokens, end, asynchronous, use_store)

    def _not_mapped(self, request, mode: str, prompt: int, end: int) -> str | None:
        """Why a request's prefix (``end`` tokens of its ``prompt``) is not mapped (None: it is)."""
        if mode == "native":
            return "native"
        if mode == "auto" and prompt < self.config.min_tokens:
            return "short"
        if end < 1:  # nothing before the hold-back: the engine reads it all, as Bridge's target reads such a prompt
            return "short"
        if end > self.setup.source_positions:
            return (f"fallback: the prefix has {end} tokens, more than the source's {self.setup.source_positions} "
                    "positions")
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return ("fallback: the prompt holds images or embeddings, which the source's token-only prefill would "
                    "not see")
        if getattr(request, "skip_reading_prefix_cache", False):  # vLLM would drop what the connector loads
            return ("fallback: the request skips the prefix cache (vLLM's default with prompt_logprobs), and with it "
                    "any loaded K/V; offline, SamplingParams(skip_reading_prefix_cache=False) scores over a mapped "
                    "prefix")
        if self.setup.prefix_caching and not in_namespace(request.cache_salt, self.setup.namespace):
            return ("fallback: prefix caching is on and the request's cache_salt is not in the mapper's namespace "
                    "(send it through kvbridge serve's completions or chat route, or build it with "
                    "kvbridge.serving.mapped_request)")
        return None

    def _warm_end(self, request, state: RequestState, end: int, use_store: StoreUse, native_rest: int) -> int:
        """Where the loaded prefix ends: the end of the prompt's stored prefix when at most ``native_rest`` tokens
        follow it before ``end`` — the engine computes them itself, over the stored prefix, and the source does not
        run — else ``end`` (the source prefills what the store lacks; nothing stored: the cold path). The worker
        reads and checks the entries: one that fails there is computed by the source instead."""
        salt = client_salt(request.cache_salt, self.setup.namespace)
        if use_store.reads_store and native_rest and self._lmcache is not None:
            # (asked once per request and limit: a lookup is a round trip to the server)
            stored = self._stored_prefix(state, end, lambda: self._lmcache.stored_tokens(
                list(request.prompt_token_ids), salt, end))
            return stored if 0 < stored and end - stored <= native_rest else end
        if not use_store.reads_store or not native_rest or self._identity is None:
            return end
        try:
            store = self.store()
            if store is None:
                return end
            from ..store.keys import chain_seed

            stored = self._stored_prefix(state, end, lambda: store.stored_tokens(
                chain_seed(self._identity, salt), list(request.prompt_token_ids), end))
        except Exception as exc:  # the store is an optimization: the worker's own lookup decides
            logger.warning("kvbridge connector: the store lookup for request %s failed (%s)", request.request_id, exc)
            return end
        return stored if 0 < stored and end - stored <= native_rest else end

    @staticmethod
    def _stored_prefix(state: RequestState, end: int, count) -> int:
        """The stored tokens of a request's prompt up to ``end``: ``count()`` once per limit."""
        if state.lookup is None or state.lookup[0] != end:
            state.lookup = (end, count())
        return state.lookup[1]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """May be asked again for the same request (no free blocks yet, preemption): the answer is provisional
        until :meth:`update_state_after_alloc`."""
        rid = request.request_id
        state = self._requests.setdefault(rid, RequestState())
        if (state.status or "").startswith("fallback"):  # a failed map stays failed (and native) on a retry
            return 0, False
        state.decision = self.decide(request, num_computed_tokens, state)
        status = state.decision.status
        if status.startswith("fallback"):
            logger.info("kvbridge connector: request %s is prefilled natively (%s)", rid, status[len("fallback: "):])
        return state.decision.tokens, state.decision.asynchronous

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None or state.decision is None:
            return
        decision, state.decision, state.lookup = state.decision, None, None
        status = decision.status
        if num_external_tokens < decision.tokens:  # the engine took less than was claimed: never say mapped
            status = "fallback: the engine did not load the mapped prefix"
        state.status, state.tokens = status, num_external_tokens if status == "mapped" else 0
        if num_external_tokens:
            end = decision.end
            self._planned[rid] = Load(rid, list(request.prompt_token_ids[:end]), end - num_external_tokens, end,
                                      list(blocks.get_block_ids()[0]),
                                      client_salt(request.cache_salt, self.setup.namespace), decision.use_store,
                                      decision.asynchronous)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVBridgeMetadata(list(self._planned.values()),
                                idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        self._planned = {}
        return meta

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid, outcome in getattr(meta, "outcomes", {}).items():
            self._stats.add_load(outcome)
            state = self._requests.get(rid)
            if state is not None and state.status is not None:  # (a one-token request may have finished in the
                state.report(outcome)  # step that mapped it)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        state = self._requests.pop(rid, None)
        self._planned.pop(rid, None)
        if state is None or state.status is None:  # never allocated (aborted while queued): not counted
            return False, None
        self._stats.add_request(state.status)
        return False, state.params(bool(self.config.store or self.config.lmcache))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVBridgeStats()
        return stats

    def shutdown(self) -> None:
        if self._lmcache is not None:
            self._lmcache.close()
