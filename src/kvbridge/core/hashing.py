"""The one SHA-256 helper every module uses (artifacts, corpora, tokenizer fingerprints)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 22  # 4 MiB reads keep memory flat on multi-GB files


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes | Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    if isinstance(data, (bytes, bytearray, memoryview)):
        digest.update(data)
    else:
        for part in data:
            digest.update(part)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-able object in canonical form (sorted keys, no whitespace)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def sha256_texts(texts: Iterable[str]) -> str:
    """Hash of an ordered list of texts, each UTF-8 encoded and followed by a NUL byte."""
    return sha256_bytes(text.encode("utf-8") + b"\0" for text in texts)
