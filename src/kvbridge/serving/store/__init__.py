"""The source's K/V between engines: the folder store (:mod:`.folder`; its keys and identities: :mod:`.keys`), its
memory tier (:mod:`.hot`), prewarm (:mod:`.prewarm`) and LMCache (:mod:`.lmcache_store`). Runs inside vLLM engines
beside :mod:`kvbridge.serving.engine`.

``from kvbridge.serving.store import KVStore`` works as before the package existed: the names below are the folder
store's (patch them in :mod:`kvbridge.serving.store.folder` or :mod:`kvbridge.serving.store.keys`, where the store
looks them up).
"""

from .folder import (
    DEFAULT_CAP,
    JOURNAL_BYTES,
    JOURNAL_FILE,
    PREWARM_FILE,
    RESCAN_WRITES,
    STALE_TMP_S,
    STORE_FILE,
    Found,
    KVStore,
    RefusedEntry,
    all_finite,
)
from .keys import (
    FORMAT,
    MAPPED_FORMAT,
    VERSION,
    chain,
    chain_seed,
    folder_identity,
    identity,
    map_identity,
    mapped_suffix,
    next_key,
    target_description,
)

__all__ = [
    "DEFAULT_CAP",
    "FORMAT",
    "JOURNAL_BYTES",
    "JOURNAL_FILE",
    "MAPPED_FORMAT",
    "PREWARM_FILE",
    "RESCAN_WRITES",
    "STALE_TMP_S",
    "STORE_FILE",
    "VERSION",
    "Found",
    "KVStore",
    "RefusedEntry",
    "all_finite",
    "chain",
    "chain_seed",
    "folder_identity",
    "identity",
    "map_identity",
    "mapped_suffix",
    "next_key",
    "target_description",
]
