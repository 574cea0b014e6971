"""A bounded store of a source model's KV, written by the engine that serves the source, read by the target's.

Letters: L source layers, T tokens of a block, H kv heads, D head dim, S the source's hidden size.

Warm transfer: when the source model has already served a conversation, its engine has computed the K/V the
mapper needs; the target's connector maps them instead of running the source again. The source engine's producer
connector (:mod:`kvbridge.serving.engine.producer`) writes each full block of ``block_tokens`` tokens it computes
(prompt or generated) as one entry; the target's connector (:mod:`kvbridge.serving.engine.connector`) reads the longest
stored
prefix of a prompt, block by block; the target engine computes a short rest itself (a conversation's new turn),
the source runs over a longer one.

Keys chain like vLLM's own prefix cache: block ``i``'s key is SHA-256 of block ``i − 1``'s key and block ``i``'s
token ids, the chain seeded with the source's :func:`identity` and the request's own ``cache_salt`` — so an entry
answers exactly one token prefix of one source model (weights, tokenizer, geometry, this store format), and a
client's salt isolates its entries as it isolates its prefix cache.

A request's last, partial block is kept too, as a *tail* under the key of the block before it
(``entries/<parent[:2]>/<parent>.tail.safetensors``, the latest one wins): a lookup that runs out of full blocks uses
as much of it as the prompt shares — the end of an answer the source generated, say.

An entry (``entries/<key[:2]>/<key>.safetensors``) holds the block's post-RoPE keys and values as the source engine
computed them (``key``, ``value``: (L, T, H, D)), the source's final hidden state at each token (``hidden``:
(T, S): what the recompute criterion and state levers read), the token ids, and in its metadata the identity, the
parent key and a CRC-32 of its data section. With map-ahead, the source engine also stores the block's target K/V
as a mapper maps them (``<key>.<map[:16]>.mapped.safetensors``, a tail's ``<parent>.tail.<map[:16]>.mapped
.safetensors``: ``key``, ``value`` (Lt, T, Ht, Dt) post-RoPE, the ids; its identity is :func:`map_identity`), read
by the target's connector instead of mapping the block.

Writes go to a temporary file renamed into place, so a killed writer or a full disk never leaves a partial entry
under a key; a reader checks identity, token ids, shapes and the CRC and skips (and counts) an entry that fails any
of them. The store never grows past ``cap_bytes``: each writer evicts
the least recently used entries (readers touch what they read) before an entry that would pass it lands.

The folder is all the state there is: both engines on one machine share it (``/dev/shm`` keeps it in memory); a
deployment over several nodes would put the same entries in a shared object store or LMCache's remote backend.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ...errors import InputError
from .keys import FORMAT, MAPPED_FORMAT, VERSION, chain_seed, mapped_suffix, next_key

STORE_FILE = "store.json"
DEFAULT_CAP = 2 << 30  # 2 GiB
RESCAN_WRITES = 64  # a writer recounts the folder this often (other writers' entries count against the cap too)
STALE_TMP_S = 600  # a temporary file this old belongs to a writer that died
JOURNAL_FILE = "mapped.journal"  # the mapped entries written lately, one path per line: what a reader may prefetch
PREWARM_FILE = "prewarm.journal"  # conversations a source asked the target's server to load ahead (JSON lines)
JOURNAL_BYTES = 1 << 20  # beyond, the next writer starts a new journal (a reader then reads that one from its start)



class RefusedEntry(Exception):
    """An entry the store will not use (:meth:`KVStore.get`): another identity or format, another token block under
    its key, torn, corrupted or inconsistent. Its message says which; a lookup counts it and stops there."""


def _sections(data) -> tuple[dict, memoryview]:
    """A safetensors file's header (JSON) and its data section."""
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    return json.loads(bytes(view[8:8 + n])), view[8 + n:]


def all_finite(tensors) -> bool:
    """No NaN or Inf in any of ``tensors`` (one sum each: NaN and Inf survive a sum)."""
    return all(math.isfinite(t.sum(dtype=torch.float32)) for t in tensors)


def _shared(stored: list[int], ids: list[int], start: int, limit: int) -> int:
    """How many of a tail's token ids ``stored`` the prompt ``ids`` repeats from ``start``, up to ``limit``."""
    m = 0
    while m < min(len(stored), limit - start) and stored[m] == ids[start + m]:
        m += 1
    return m


@dataclass
class Found:
    """The longest stored prefix of a prompt: ``tokens`` of it, as the entries' blocks (``parts``: per block its
    keys and values (L, t, H, D), hidden states (t, S; None for mapped entries) and whether it came from memory
    (:mod:`kvbridge.serving.store.hot`: verified when it was loaded)); per-layer ``keys`` and ``values``
    (1, H, tokens, D) and ``hidden`` (1, tokens, S) assembled from them when first read; ``refused``: entries
    skipped (another identity, torn, corrupted), with the reason of the first; ``chain``: the keys of the full
    blocks found (a caller that marks them used need not hash the prompt again)."""

    tokens: int
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    refused: int = 0
    reason: str | None = None

    def _layers(self, index: int) -> list[torch.Tensor] | None:
        if not self.parts:
            return None
        whole = torch.cat([p[index] for p in self.parts], dim=1) if len(self.parts) > 1 else self.parts[0][index]
        return list(whole.transpose(1, 2)[:, None].unbind(0))  # L × (1, H, T, D)

    def hot_within(self, n: int) -> int:
        """How many of the first ``n`` tokens came from memory."""
        hot = start = 0
        for keys, _, _, in_memory in self.parts:
            hot += max(0, min(keys.shape[1], n - start)) if in_memory else 0
            start += keys.shape[1]
        return hot

    @property
    def hot_tokens(self) -> int:
        """How many of its tokens came from memory."""
        return self.hot_within(self.tokens)

    @cached_property
    def keys(self) -> list[torch.Tensor] | None:
        return self._layers(0)

    @cached_property
    def values(self) -> list[torch.Tensor] | None:
        return self._layers(1)

    @cached_property
    def hidden(self) -> torch.Tensor | None:
        if not self.parts or self.parts[0][2] is None:
            return None
        return torch.cat([p[2] for p in self.parts], dim=0)[None]  # (1, T, S)


class KVStore:
    """The store at ``root``. ``create``: make it (with ``block_tokens`` and ``cap_bytes``) unless it exists; an
    existing store keeps its block size (a writer with another refuses to start) and takes the new cap."""

    def __init__(self, root: str | Path, block_tokens: int | None = None, cap_bytes: int | None = None,
                 create: bool = False, verify: bool = True):
        self.root = Path(root)
        self.verify = verify
        settings_path = self.root / STORE_FILE
        if settings_path.exists():
            try:
                settings = json.loads(settings_path.read_text(encoding="utf-8"))
                if settings["format"] != FORMAT + "-store" or int(settings["block_tokens"]) <= 0:
                    raise ValueError("not a store's settings")
            except (OSError, ValueError, KeyError, TypeError):
                raise InputError(f"{settings_path} is not a kvbridge KV store's settings file; point the store at "
                                 "an empty folder or one kvbridge created.") from None
            if settings.get("version") != VERSION:
                raise InputError(f"the KV store at {self.root} has format version {settings.get('version')}, this "
                                 f"kvbridge writes {VERSION}; use a new folder.")
            if block_tokens is not None and block_tokens != settings["block_tokens"]:
                raise InputError(f"the KV store at {self.root} holds blocks of {settings['block_tokens']} tokens; "
                                 f"this engine's are {block_tokens}. Use a store of its own (another folder), or "
                                 f"serve the source with --block-size {settings['block_tokens']}.")
            self.block_tokens = int(settings["block_tokens"])
            self.cap_bytes = int(cap_bytes or settings.get("cap_bytes") or DEFAULT_CAP)
        elif create:
            if not isinstance(block_tokens, int) or block_tokens < 1:
                raise InputError(f"a KV store needs block_tokens >= 1, not {block_tokens!r}.")
            self.block_tokens, self.cap_bytes = block_tokens, int(cap_bytes or DEFAULT_CAP)
            try:
                (self.root / "entries").mkdir(parents=True, exist_ok=True)
                tmp = settings_path.with_name(f".{STORE_FILE}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"format": FORMAT + "-store", "version": VERSION,
                                           "block_tokens": block_tokens, "cap_bytes": self.cap_bytes}) + "\n")
                os.replace(tmp, settings_path)
            except OSError as exc:
                raise InputError(f"cannot create the KV store at {self.root} ({exc}); pass a writable folder.") \
                    from None
        else:
            raise InputError(f"no kvbridge KV store at {self.root} (no {STORE_FILE}); start the source engine with "
                             "this store first, or check the folder.")
        if self.cap_bytes < 1:
            raise InputError(f"the KV store's cap must be positive, not {self.cap_bytes}.")
        self._lock = threading.Lock()
        self._estimate: int | None = None  # bytes in the store as this process last counted them
        self._pending = 0  # bytes this process's threads have counted but not yet written
        self._writes = 0

    def path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / f"{key}.safetensors"

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: str, parent: str, entry_identity: str, ids: list[int], keys: torch.Tensor, values: torch.Tensor,
            hidden: torch.Tensor | None, tail: bool = False, map_id: str | None = None) -> bool:
        """Write one block's entry atomically; False (nothing left behind) when it cannot be written. ``tail``: the
        partial block a request ended with, kept under its ``parent`` (the latest one wins). ``map_id``: the entry
        holds the block's target K/V mapped by that map (:func:`map_identity`; ``hidden`` None) beside its source
        entry; ``entry_identity`` is then ``map_id``."""
        from safetensors.torch import save

        path = self.mapped_path(parent if tail else key, map_id, tail) if map_id else \
            self.tail_path(parent) if tail else self.path(key)
        if not tail and path.exists():  # the same block of the same model: already stored
            try:
                os.utime(path)
                return True
            except FileNotFoundError:  # evicted meanwhile: store it again
                pass
        tensors = {"key": keys.contiguous(), "value": values.contiguous(), "ids": torch.tensor(ids, dtype=torch.int64)}
        if not map_id:
            tensors["hidden"] = hidden.contiguous()
        crc = zlib.crc32(_sections(save(tensors))[1])  # the data section does not depend on the metadata
        meta = {"format": MAPPED_FORMAT if map_id else FORMAT, "version": str(VERSION), "identity": entry_identity,
                "parent": parent, "key": key, "crc32": f"{crc:08x}"}
        data = save(tensors, metadata=meta)
        if not self._make_room(len(data)):  # before the entry lands: this writer never passes the cap, even briefly
            return False
        tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk, a removed folder: no entry, and no partial file under any key
            tmp.unlink(missing_ok=True)
            return False
        finally:
            with self._lock:
                self._pending -= len(data)
        if map_id:
            self.announce(path)
        return True

    # -- the journal of mapped entries ---------------------------------------------------------------
    def announce(self, path: Path) -> None:
        """Note a mapped entry just written in the journal (one ``O_APPEND`` write per line), so that a target's
        connector can load it into memory before a request needs it (:mod:`kvbridge.serving.store.hot`). A hint only:
        nothing is lost when it cannot be written."""
        self._append(JOURNAL_FILE, str(path.relative_to(self.root)))

    def announce_prewarm(self, tail: Path, salt: str | None) -> None:
        """Ask the target's server to load the conversation that ends with the source entry ``tail`` (its tail, or its
        last full block's entry when it ended on a block boundary) into its prefix cache now
        (:mod:`kvbridge.serving.store.prewarm`): a line of the prewarm journal, with the request's client ``salt`` (its
        chain's seed, and the target request's salt). A hint too."""
        self._append(PREWARM_FILE, json.dumps({"tail": str(tail.relative_to(self.root)), "salt": salt,
                                               "time": time.time()}))

    def _append(self, name: str, text: str) -> None:
        journal = self.root / name
        try:
            fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (text + "\n").encode())
                full = os.fstat(fd).st_size > JOURNAL_BYTES
            finally:
                os.close(fd)
            if full:  # a new, empty journal in its place (its readers see another inode and read it from its start)
                tmp = journal.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(b"")
                os.replace(tmp, journal)
        except OSError:
            pass

    def _lines(self, name: str, cursor: tuple[int, int] | None) -> tuple[list[str], tuple[int, int] | None]:
        """The journal's lines since ``cursor`` (None: the whole journal) and the cursor to pass next time."""
        journal = self.root / name
        try:
            with open(journal, "rb") as handle:
                stat = os.fstat(handle.fileno())
                offset = cursor[1] if cursor is not None and cursor[0] == stat.st_ino and cursor[1] <= stat.st_size \
                    else 0
                handle.seek(offset)
                data = handle.read()
        except OSError:  # none yet (most often): what comes is read from its start
            return [], cursor
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        return data[:end].decode("utf-8", "replace").splitlines(), (stat.st_ino, offset + end)

    def _inside(self, line: str) -> Path | None:
        rel = Path(line)  # entries inside the store only
        if rel.parts[:1] == ("entries",) and ".." not in rel.parts and "\x00" not in line:
            return self.root / rel
        return None

    def announced(self, cursor: tuple[int, int] | None) -> tuple[list[Path], tuple[int, int] | None]:
        """The mapped entries announced since ``cursor`` (None: the whole journal, at most ``JOURNAL_BYTES`` of the
        latest lines — a restarted reader loads what was written lately), and the cursor to pass next time. Lines of
        a journal that was replaced since the last call after that call are missed (a hint: those entries are read
        from the folder when a request needs them)."""
        lines, cursor = self._lines(JOURNAL_FILE, cursor)
        return [path for path in map(self._inside, lines) if path is not None], cursor

    def prewarms(self, cursor: tuple[int, int] | None) -> tuple[list[tuple[Path, str | None, float]],
                                                                 tuple[int, int] | None]:
        """The prewarm requests announced since ``cursor``: (tail entry, client salt, when), malformed lines
        skipped."""
        lines, cursor = self._lines(PREWARM_FILE, cursor)
        out = []
        for line in lines:
            try:
                record = json.loads(line)
                tail, salt, when = self._inside(record["tail"]), record["salt"], float(record["time"])
            except (ValueError, KeyError, TypeError):
                continue
            if tail is not None and (salt is None or isinstance(salt, str)):
                out.append((tail, salt, when))
        return out, cursor

    def conversation(self, tail: Path, salt: str | None, max_blocks: int, source_identity: str | None = None
                     ) -> list[int] | None:
        """The token ids of the conversation whose last block is the source entry ``tail`` (a partial block's tail
        entry, or a full block's entry when the conversation ended on a block boundary): its chain walked back, entry
        by entry, to the seed of the source's identity and ``salt``; None when an entry is missing or does not chain
        (a tail's name is checked against its parent, each block's name and key against its parent and token ids),
        when the entries are another source's than ``source_identity`` (None: any), or past ``max_blocks``. Reads the
        entries' headers and token ids only."""
        meta, ids = self._header_ids(tail)
        if meta is None or meta.get("format") != FORMAT or \
                (source_identity is not None and meta.get("identity") != source_identity):
            return None
        last = meta.get("key")
        if tail.name != f"{meta.get('parent')}.tail.safetensors" and not (
                isinstance(last, str) and tail.name == f"{last}.safetensors" and
                next_key(str(meta.get("parent")), ids) == last):
            return None
        seed = chain_seed(str(meta.get("identity")), salt)
        parts, parent = [ids], meta.get("parent")
        while parent != seed:
            if len(parts) > max_blocks or not isinstance(parent, str):
                return None
            meta, ids = self._header_ids(self.path(parent))
            if meta is None or meta.get("format") != FORMAT or meta.get("key") != parent or \
                    next_key(str(meta.get("parent")), ids) != parent:
                return None
            parts.append(ids)
            parent = meta.get("parent")
        return [token for part in reversed(parts) for token in part]

    @staticmethod
    def _header_ids(path: Path) -> tuple[dict | None, list[int]]:
        """An entry's metadata and token ids (None, [] when it is absent or not an entry)."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                ids = handle.get_tensor("ids")
            if ids.dtype != torch.int64 or ids.dim() != 1:
                return None, []
            return meta, ids.tolist()
        except Exception:  # absent, torn, not an entry: safetensors raises its own error types too
            return None, []

    def tail_path(self, parent: str) -> Path:
        return self.root / "entries" / parent[:2] / f"{parent}.tail.safetensors"

    def mapped_path(self, key: str, map_id: str, tail: bool = False) -> Path:
        """A block's mapped entry (``key``: the block's; for a tail, its parent's) beside its source entry."""
        return self.root / "entries" / key[:2] / f"{key}{'.tail' if tail else ''}{mapped_suffix(map_id)}"

    def _make_room(self, nbytes: int) -> bool:
        """Count an entry of ``nbytes`` about to be written, evicting first if the store would pass its cap with it;
        False (nothing to write) when it cannot fit. Entries this process's threads are still writing count as
        written (``_pending``: not in the folder yet, so not in a recount). The count errs high (a replaced tail, a
        write that then fails), never low, within one process; other writers' entries are counted at each rescan."""
        with self._lock:
            self._writes += 1
            if self._estimate is None or self._writes % RESCAN_WRITES == 0:  # other writers may share the folder
                self._estimate = self.size() + self._pending
            if self._estimate + nbytes > self.cap_bytes:  # some room beyond, so that not every write scans
                room = self.cap_bytes * 9 // 10 - nbytes - self._pending
                self._estimate = self.evict(max(room, 0)) + self._pending
                if self._estimate + nbytes > self.cap_bytes:  # larger than the cap, or entries that would not go
                    return False
            self._estimate += nbytes
            self._pending += nbytes
            return True

    def touch(self, keys: list[str], map_id: str | None = None) -> None:
        """Mark these blocks used now (a request read them from the engine's own prefix cache), and their mapped
        entries of ``map_id``."""
        for key in keys:
            for path in (self.path(key), self.mapped_path(key, map_id)) if map_id else (self.path(key),):
                try:
                    os.utime(path)
                except OSError:
                    pass

    def discard(self, path: Path) -> None:
        """Remove an entry a reader refused as damaged, so that the writer stores the block again."""
        try:
            path.unlink()
        except OSError:
            pass

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry; temporary files of writers that died long ago are removed."""
        out = []
        stale = time.time() - STALE_TMP_S
        for sub in (self.root / "entries").glob("*"):
            try:
                with os.scandir(sub) as it:
                    for entry in it:
                        try:
                            st = entry.stat()
                        except OSError:
                            continue  # evicted meanwhile
                        if entry.name.endswith(".safetensors"):
                            out.append((max(st.st_mtime, st.st_atime), st.st_size, Path(entry.path)))
                        elif entry.name.endswith(".tmp") and st.st_mtime < stale:
                            Path(entry.path).unlink(missing_ok=True)
            except OSError:
                continue
        return out

    def size(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def evict(self, target_bytes: int) -> int:
        """Remove the least recently used entries until at most ``target_bytes`` remain; the bytes left."""
        entries = sorted(self.entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= target_bytes:
                break
            try:
                path.unlink()
                total -= size
            except FileNotFoundError:
                total -= size
            except OSError:
                continue
        return total

    # -- reading ---------------------------------------------------------------------------------
    def get(self, path: Path, expected: str, ids: list[int] | None, mapped: bool = False
            ) -> dict[str, torch.Tensor] | None:
        """One entry's tensors; None when absent. Raises :class:`RefusedEntry` (with the reason) for an entry it will
        not use; a torn, corrupted or inconsistent one is also discarded. ``expected``: the identity it must carry
        (the source's; for a mapped entry, ``mapped``, its map identity); ``ids``: the token ids it must hold (None: a
        tail, whose ids the caller compares)."""
        from safetensors.torch import load

        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RefusedEntry(f"unreadable entry ({exc.strerror or exc})") from exc
        try:
            header, data = _sections(raw)
            meta = header.get("__metadata__") or {}
            if not isinstance(meta, dict):
                raise ValueError("the header's metadata is not an object")
        except (ValueError, UnicodeDecodeError, AttributeError):
            self.discard(path)
            raise RefusedEntry("torn or not an entry (no safetensors header)") from None
        if meta.get("format") != (MAPPED_FORMAT if mapped else FORMAT) or meta.get("version") != str(VERSION):
            raise RefusedEntry(f"another format ({meta.get('format')} {meta.get('version')})")
        if meta.get("identity") != expected:
            raise RefusedEntry(f"written by another {'map' if mapped else 'source model'} (identity differs)")
        if self.verify and meta.get("crc32") != f"{zlib.crc32(data):08x}":
            self.discard(path)
            raise RefusedEntry("corrupted (CRC-32 differs)")
        try:
            tensors = load(raw)
        except Exception as exc:  # safetensors raises its own error types for a malformed file
            self.discard(path)
            raise RefusedEntry(f"unreadable entry ({type(exc).__name__})") from exc
        names = {"key", "value", "ids"} | (set() if mapped else {"hidden"})
        if set(tensors) != names or (ids is not None and tensors["ids"].tolist() != ids):
            raise RefusedEntry("another token block under this key")
        n = tensors["ids"].numel()
        if tensors["key"].shape != tensors["value"].shape or tensors["key"].dim() != 4 or \
                tensors["key"].shape[1] != n or (not mapped and tensors["hidden"].shape[0] != n):
            self.discard(path)
            raise RefusedEntry("inconsistent shapes")
        try:
            os.utime(path)  # recently used: last to be evicted
        except OSError:
            pass
        return tensors

    def stored_tokens(self, seed: str, ids: list[int], limit: int) -> int:
        """How many of the first ``limit`` tokens of ``ids`` the store holds, as :meth:`lookup` would find them if
        every entry it meets passes its checks — from the entries' presence alone (a tail's token ids read, nothing
        else): what a scheduler decides with before the worker reads (and checks) the entries."""
        from safetensors import safe_open

        parent, start, size = seed, 0, self.block_tokens
        limit = min(limit, len(ids))
        while start < limit and start + size <= len(ids):
            key = next_key(parent, ids[start:start + size])
            if not self.path(key).exists():
                break
            parent, start = key, start + size
        if start < limit:
            try:
                with safe_open(self.tail_path(parent), framework="pt") as handle:
                    stored = handle.get_tensor("ids").tolist()
            except Exception:  # absent (most often), torn, not an entry: the reader decides, nothing found here
                return min(start, limit)
            start += _shared(stored, ids, start, limit)
        return min(start, limit)

    def lookup(self, seed: str, source_identity: str, ids: list[int], limit: int, map_id: str | None = None,
               hot=None) -> Found:
        """The longest stored prefix of ``ids`` within its first ``limit`` tokens: full blocks while they are
        stored, then the part of a request's final partial block (a tail) that matches; the first missing or
        refused entry ends it (the rest must be computed). ``map_id``: the mapped entries of that map along the
        same chain (``seed`` and ``source_identity`` stay the source's; ``hidden`` is then None); ``hot``: where a
        mapped entry is first looked for (path -> its verified tensors or None:
        :class:`kvbridge.serving.store.hot.HotEntries`)."""
        found = Found(0)
        parent, start, size = seed, 0, self.block_tokens
        limit = min(limit, len(ids))
        mapped = map_id is not None
        expected = map_id if mapped else source_identity

        def entry(path: Path, block: list[int] | None) -> tuple[dict[str, torch.Tensor] | None, bool]:
            """(the entry's tensors or None, whether they came from memory); records a refusal and returns None."""
            got = hot(path) if hot is not None and mapped else None
            if got is not None and (block is None or got["ids"].tolist() == block):
                return got, True
            try:  # (not in memory, or not that block there: the folder's)
                return self.get(path, expected, block, mapped), False
            except RefusedEntry as refused:
                found.refused, found.reason = 1, str(refused)
                return None, False

        def add(got: dict[str, torch.Tensor], n: int, in_memory: bool) -> None:
            found.parts.append((got["key"][:, :n], got["value"][:, :n], None if mapped else got["hidden"][:n],
                                in_memory))

        while start < limit and start + size <= len(ids):  # a block's key needs all its tokens; it may pass the limit
            block = ids[start:start + size]
            key = next_key(parent, block)
            got, in_memory = entry(self.mapped_path(key, map_id) if mapped else self.path(key), block)
            if got is None:
                break
            add(got, min(size, limit - start), in_memory)  # the last block may pass the limit
            found.chain.append(key)
            parent, start = key, start + size
        if not found.refused and start < limit:
            tail, in_memory = entry(self.mapped_path(parent, map_id, True) if mapped else self.tail_path(parent), None)
            if tail is not None:
                shared = _shared(tail["ids"].tolist(), ids, start, limit)
                if shared:
                    add(tail, shared, in_memory)
        found.tokens = sum(p[0].shape[1] for p in found.parts)
        return found
