"""The folder store's keys and identities: which source model (weights, tokenizer, geometry, format) an entry
belongs to, which map a mapped entry holds, and the chain of block keys a prompt's token ids hash to (like vLLM's
own prefix cache: block ``i``'s key is SHA-256 of block ``i - 1``'s key and block ``i``'s token ids, seeded with
the source's identity and the request's ``cache_salt``). Read by both engines' connectors and the store
(:mod:`kvbridge.serving.store.folder`)."""

from __future__ import annotations

import json

import torch

from ...core.hashing import sha256_bytes, sha256_json
from ...errors import UnsupportedModelError

FORMAT = "kvbridge-source-kv"
MAPPED_FORMAT = "kvbridge-mapped-kv"  # a block's target K/V, mapped ahead by the source engine (map-ahead)
VERSION = 1


def identity(weights_sha256: str | None, tokenizer_sha256: str, num_layers: int, num_kv_heads: int, head_dim: int,
             hidden_size: int) -> str:
    """The source model an entry belongs to: its weights and tokenizer fingerprints, its KV geometry and this
    store's format. Entries of another model, revision, tokenizer or format never match."""
    return sha256_json({"format": FORMAT, "version": VERSION, "weights": weights_sha256, "tokenizer": tokenizer_sha256,
                        "geometry": [num_layers, num_kv_heads, head_dim, hidden_size]})[:32]


def folder_identity(local_dir: str) -> str:
    """The store identity of the checkpoint in ``local_dir`` from its files (no weights loaded)."""
    from transformers import AutoTokenizer

    from ...core.models import text_config, tokenizer_fingerprint, weights_fingerprint

    config, _ = text_config(local_dir)
    weights = weights_fingerprint(local_dir)
    if weights is None:
        raise UnsupportedModelError(f"kvbridge source connector: {local_dir} holds no model*.safetensors, so its "
                                    "weights cannot be told apart from another checkpoint's; convert it to "
                                    "safetensors.")
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return identity(weights, tokenizer_fingerprint(AutoTokenizer.from_pretrained(local_dir)),
                    int(config.num_hidden_layers), heads, head_dim, int(config.hidden_size))


def map_identity(source_identity: str, mapper_checksums: str, target: dict, dtype: torch.dtype) -> str:
    """The map a mapped entry holds: the source's store identity, the mapper's checksums file (its weights and
    mapper.json: selection, levers, both models' fingerprints and RoPE), the target's KV geometry and RoPE as the
    mapping process read them (``target``) and the dtype the map ran in. Entries of another mapper, target or
    dtype never match (a target connector mapping in another dtype maps for itself: warm stays equal to cold)."""
    return sha256_json({"format": MAPPED_FORMAT, "version": VERSION, "source": source_identity,
                        "mapper": mapper_checksums, "target": target, "dtype": str(dtype)})[:32]


def target_description(info) -> dict:
    """What of the target (a :class:`kvbridge.core.models.ModelInfo`) the mapped keys and values depend on beyond the
    mapper: its KV geometry and RoPE."""
    return {"geometry": [info.num_layers, info.num_kv_heads, info.head_dim], "rope": info.rope.to_dict()}


def chain_seed(source_identity: str, salt: str | None) -> str:
    """The key of the (virtual) block before a prompt's first: the source's identity and the request's cache_salt."""
    return sha256_json({"identity": source_identity, "salt": salt or ""})


def next_key(parent: str, ids: list[int]) -> str:
    return sha256_bytes(parent.encode() + b"\0" + json.dumps(ids).encode())


def chain(seed: str, ids: list[int], block_tokens: int) -> list[str]:
    """Keys of every full block of ``ids``."""
    keys, parent = [], seed
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        parent = next_key(parent, ids[start:start + block_tokens])
        keys.append(parent)
    return keys


def mapped_suffix(map_id: str) -> str:
    """How the file names of ``map_id``'s mapped entries end."""
    return f".{map_id[:16]}.mapped.safetensors"
