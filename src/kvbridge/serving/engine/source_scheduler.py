"""The scheduler's side of the source's storing connector (:mod:`kvbridge.serving.engine.producer`): which requests
are stored, and, per step, where each one's computed tokens land in the engine's paged cache and which block of the
store's chain they continue (:class:`Capture`), for the worker that observes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..store.keys import chain_seed, next_key
from .config import PREWARM, USE_STORE
from .source_setup import SourceSetup, logger


@dataclass
class Capture:
    """One request's tokens of this step: positions [start, start + count) in ``block_ids[0]``'s block onward;
    ``parent``: the chain key of the block before ``start`` when ``start`` is a block boundary (else None: the
    worker continues what it holds). ``touch``: on a request's first step, the keys of the blocks it reads from the
    engine's prefix cache, marked used in the store so that least-recently-used eviction does not drop a
    conversation's first blocks while its later ones stay."""

    request_id: str
    start: int
    count: int
    block_ids: list[int]
    parent: str | None
    touch: list[str] = field(default_factory=list)  # keys of the blocks the engine's prefix cache supplied


@dataclass
class StoreMetadata(KVConnectorMetadata):
    captures: list[Capture] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # their partial last block is stored as a tail, then dropped
    prewarm: dict[str, str | None] = field(default_factory=dict)  # finished ones to load ahead: their client salt
    preempted: list[str] = field(default_factory=list)  # dropped: a resumed request starts a block anew


@dataclass
class StoredRequest:
    """A request whose K/V are stored, on the scheduler's side."""

    request: Any | None  # vLLM's request (its tokens, its computed count); None: no longer followed
    chain: list[str] | None = None  # chain keys of its full blocks, as far as computed (None: none asked for yet)


def wants_store(request) -> bool:
    """Whether a request's K/V are stored: yes, unless its ``kv_transfer_params`` say ``"kvbridge_store": false``
    (a client that knows the conversation will not move to the target saves the store's writes and maps)."""
    params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
    asked = params.get(USE_STORE, True)
    if asked in ("folder", "source"):  # the target's choices of where to read: stored here either way
        return True
    if not isinstance(asked, bool):
        logger.warning("kvbridge source connector: request %s: kv_transfer_params %s must be true or false, not "
                       "%r; stored", request.request_id, USE_STORE, asked)
        return True
    return asked


def wants_prewarm(request, default: bool) -> bool:
    """Whether a finished request asked the target's server to load its conversation ahead: its
    ``kv_transfer_params`` ``"kvbridge_prewarm"`` (true or false), else the engine's ``default`` (``--prewarm``)."""
    params = request.kv_transfer_params if isinstance(request.kv_transfer_params, dict) else {}
    asked = params.get(PREWARM, default)
    if not isinstance(asked, bool):
        logger.warning("kvbridge source connector: request %s: kv_transfer_params %s must be true or false, not "
                       "%r; not prewarmed", request.request_id, PREWARM, asked)
        return False
    return asked


class KVBridgeSourceScheduler:
    """The storing connector on the scheduler's side (:class:`~kvbridge.serving.engine.producer.
    KVBridgeSourceConnector` delegates to it): follows the stored requests, plans each step's captures."""

    def __init__(self, setup: SourceSetup):
        self.setup = setup
        self.block_size = setup.block_size
        self._requests: dict[str, StoredRequest] = {}
        self._finished: list[str] = []
        self._prewarm: dict[str, str | None] = {}
        self._manager = None

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._manager = kv_cache_manager

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if wants_store(request):
            state = self._requests.setdefault(request.request_id, StoredRequest(request))
            state.request = request

    def _parent(self, state: StoredRequest, start: int) -> str:
        """The chain key before position ``start`` (a block boundary, every token before it known)."""
        request = state.request
        seed = chain_seed(self.setup.identity, request.cache_salt)
        keys = state.chain = [] if state.chain is None else state.chain
        bs, tokens = self.block_size, request.all_token_ids
        while len(keys) * bs < start:
            begin = len(keys) * bs
            keys.append(next_key(keys[-1] if keys else seed, list(tokens[begin:begin + bs])))
        return keys[start // bs - 1] if start else seed

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = StoreMetadata(finished=self._finished, prewarm=self._prewarm,
                             preempted=list(scheduler_output.preempted_req_ids or ()))
        self._finished, self._prewarm = [], {}
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            try:  # storing is best effort: a request it cannot follow is served, not stored
                capture = self._capture(rid, count)
            except Exception as exc:
                logger.warning("kvbridge source connector: request %s is not stored (%s)", rid, exc)
                self._drop(rid)
                continue
            if capture is not None:
                meta.captures.append(capture)
        return meta

    def _drop(self, rid: str) -> None:
        """No longer follow a request (its chain is kept until it finishes)."""
        if rid in self._requests:
            self._requests[rid].request = None

    def _capture(self, rid: str, count: int) -> Capture | None:
        state = self._requests.get(rid)
        request = state.request if state is not None else None
        if request is None or self._manager is None or count < 1:
            return None
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            self._drop(rid)  # its K/V depend on more than its token ids
            return None
        start = request.num_computed_tokens  # before this step (the scheduler updates it after the metadata)
        block_ids = self._manager.get_block_ids(rid)[0]
        bs = self.block_size
        first, last = start // bs, (start + count - 1) // bs
        if last >= len(block_ids):
            return None
        first_step = state.chain is None
        parent = self._parent(state, start) if start % bs == 0 and start <= len(request.all_token_ids) else None
        touch = list((state.chain or [])[:start // bs]) if first_step and parent is not None else []
        return Capture(rid, start, count, list(block_ids[first:last + 1]), parent, touch)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._finished.append(rid)
        if wants_prewarm(request, self.setup.config.prewarm):
            self._prewarm[rid] = request.cache_salt
        return False, None
