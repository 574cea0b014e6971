"""The embedded family's corpus: the CPython standard library's own source code and documentation.

Licence: Python Software Foundation License Version 2 (the standard library's licence; see
``LICENSE-CORPUS.txt`` beside this file). Nobody in this project wrote it. Source code is a good
instrument for KV transfer: identifiers defined early in a file recur later, so a model that reads
its context predicts much better than one that does not.

Documents are files split at top-level blank-line boundaries into chunks of about
``CHUNK_CHARS`` characters. Splits are fixed by the SHA-256 of each file's path relative to the
standard library, so they never depend on file order or on how many files exist:

* ``heldout``: bucket 0–2 of 100 (never trained on, never calibrated on),
* ``calibration``: bucket 3–5,
* ``train``: everything else.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from ..core.hashing import sha256_bytes

CHUNK_CHARS = 4000
MAX_FILE_BYTES = 400_000
SKIP_PARTS = ("site-packages", "encodings", "__pycache__", "lib2to3/tests/data", "test/encoded_modules",
              "test/cjkencodings", "test/decimaltestdata", "_sysconfigdata")


def split_of(relpath: str) -> str:
    bucket = int(sha256_bytes(relpath.encode())[:8], 16) % 100
    return "heldout" if bucket < 3 else "calibration" if bucket < 6 else "train"


def stdlib_files(root: str | Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every usable ``.py`` file under the standard library, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in SKIP_PARTS) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 200:
            files.append((rel, text))
    return files


def chunk(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Split at blank lines before unindented code, into pieces of about ``size`` characters."""
    pieces, current = [], []
    length = 0
    for block in text.split("\n\n"):
        if length >= size and block[:1] not in (" ", "\t", ""):
            pieces.append("\n\n".join(current))
            current, length = [], 0
        current.append(block)
        length += len(block) + 2
    if current:
        pieces.append("\n\n".join(current))
    return [p for p in pieces if len(p.strip()) > 200]


def documents(root: str | Path | None = None) -> dict[str, list[str]]:
    """The three splits as lists of document chunks."""
    splits: dict[str, list[str]] = {"train": [], "calibration": [], "heldout": []}
    for rel, text in stdlib_files(root):
        splits[split_of(rel)].extend(chunk(text))
    return splits
