"""Mapper artifacts: files, checksums, manifest. ``save_mapper`` and ``load_mapper`` are a pair.

A mapper folder holds::

    mapper.safetensors   float32 weights as fitted: ``{key,value}.{target_layer}.{weight,bias}``,
                         weight (|S_l|·Fs, Ft) applied as ``x @ W + b`` on content features
    mapper.json          format version, model pair, geometry, RoPE, selection, fit settings & summary
    checksums.sha256     ``sha256sum``-compatible lines for the two files above

Writes go to a temporary sibling folder that replaces the destination only when complete, so a
crash never leaves a half-written artifact. Loading verifies checksums (before a single tensor is
parsed), the format version and every tensor's shape.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .errors import ArtifactError
from .hashing import sha256_file
from .hub import snapshot
from .mapper import INTEGER_TENSORS, Lever, Mapper, MapperConfig, RuntimeOptions, keeps_dtype
from .models import ModelInfo

FORMAT = "kvbridge-mapper"
FORMAT_VERSION = 2  # 2 adds "levers" (lags, inputs, residual MLPs) and "runtime"; version-1 files read as plain maps
WEIGHTS_FILE = "mapper.safetensors"
CONFIG_FILE = "mapper.json"
CHECKSUMS_FILE = "checksums.sha256"
ARTIFACT_FILES = [WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE]
FEATURE_LAYOUT = (
    "content keys (RoPE removed with the model's own rotary module) and values; a layer's features are its "
    "KV heads concatenated head-major (feature h*head_dim + d); x = selected source layers concatenated in "
    "ascending order, of the target's own kind at the same token; y = x @ weight + bias. A lever on (kind, "
    "layer) makes x the concatenation over its lags j (ascending), then its inputs (key before value), then "
    "the selected source layers, of the source token t - j (zeros before a sequence's first token), and adds "
    "gelu(x @ mlp.in.weight + mlp.in.bias) @ mlp.out.weight + mlp.out.bias when hidden > 0"
)


def config_to_json(config: MapperConfig) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvbridge_version": __version__,
        "source": config.source.to_dict(),
        "target": config.target.to_dict(),
        "feature_layout": FEATURE_LAYOUT,
        "selection": {kind: [list(layers) for layers in config.selection[kind]] for kind in config.selection},
        "levers": [lever.to_dict() for lever in config.levers],
        "runtime": config.runtime.to_dict(),
        "num_parameters": config.num_parameters(),
        "weights_dtype": "float32",  # runtime tables: recompute.bigram.keys int64, counts float32
        "fit": config.fit,
    }


def config_from_json(data: dict[str, Any]) -> MapperConfig:
    if data.get("format") != FORMAT:
        raise ArtifactError(f"{CONFIG_FILE} is not a kvbridge mapper (format {data.get('format')!r}).")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(
            f"{CONFIG_FILE} has format version {version!r}; this kvbridge reads up to {FORMAT_VERSION}. "
            "Upgrade kvbridge (`pip install -U kvbridge`)."
        )
    try:
        return MapperConfig(
            source=ModelInfo.from_dict(data["source"]),
            target=ModelInfo.from_dict(data["target"]),
            selection={k: tuple(tuple(int(s) for s in layers) for layers in v) for k, v in data["selection"].items()},
            fit=dict(data.get("fit", {})),
            levers=tuple(Lever.from_dict(v) for v in data.get("levers", [])),
            runtime=RuntimeOptions.from_dict(data.get("runtime", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{CONFIG_FILE} is incomplete or malformed ({exc!r}); re-download or refit the mapper.") from None


def is_artifact_dir(directory: Path) -> bool:
    """Whether ``directory`` holds a kvbridge mapper (its mapper.json says so), whatever state its files are in."""
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_writable_artifact_dir(directory: Path) -> None:
    """Refuse to replace anything but an absent or empty folder or an earlier kvbridge artifact.

    Saving replaces the whole folder: a results folder or a model folder given as ``--out`` would be lost.
    """
    if directory.exists() and not directory.is_dir():
        raise ArtifactError(f"{directory} exists and is not a folder; choose another --out.")
    if directory.is_dir() and any(directory.iterdir()) and not is_artifact_dir(directory):
        raise ArtifactError(f"{directory} is a folder with other files, not a kvbridge artifact; writing the mapper "
                            "would replace it. Choose a new or empty folder for --out.")


def save_mapper(mapper: Mapper, directory: str | Path) -> Path:
    """Write the artifact atomically; an existing folder at ``directory`` is replaced only on success."""
    from safetensors.torch import save_file

    directory = Path(directory)
    check_writable_artifact_dir(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        tensors = {name: t.detach().to("cpu", None if name in INTEGER_TENSORS else torch.float32).contiguous()
                   for name, t in mapper.weights.items()}
        # one metadata key: safetensors orders several keys at random, and identical mappers must hash alike
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
        with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as handle:
            json.dump(config_to_json(mapper.config), handle, indent=2, sort_keys=False)
            handle.write("\n")
        lines = [f"{sha256_file(tmp / name)}  {name}\n" for name in (CONFIG_FILE, WEIGHTS_FILE)]
        (tmp / CHECKSUMS_FILE).write_text("".join(lines), encoding="utf-8")
        for name in ARTIFACT_FILES:
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
        _replace_dir(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _replace_dir(new: Path, dest: Path) -> None:
    """Move ``new`` to ``dest``; an old ``dest`` is moved aside first and removed after."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rmdir(old)
        os.replace(dest, old)
    os.replace(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_checksums(directory: Path) -> dict[str, str]:
    path = directory / CHECKSUMS_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the artifact is incomplete. Re-download or re-save it.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is not text (a corrupted byte?); re-download or re-save the artifact.") from None
    sums = {}
    for line in text.splitlines():
        if line.strip():  # "<digest>  <name>" (text mode) or "<digest> *<name>" (sha256sum -b)
            digest, _, name = line.strip().partition(" ")
            sums[name.strip().lstrip("*")] = digest.strip().lower()
    return sums


def verify_artifact(directory: str | Path) -> list[str]:
    """Problems found in an artifact folder (empty list: files present and checksums match)."""
    directory = Path(directory)
    problems = []
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if not (directory / name).is_file():
            problems.append(f"{name} is missing")
    try:
        sums = read_checksums(directory)
    except ArtifactError as exc:
        return problems + [str(exc)]
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        if name not in sums:
            problems.append(f"{CHECKSUMS_FILE} has no entry for {name}")
        elif (directory / name).is_file() and sha256_file(directory / name) != sums[name]:
            problems.append(f"{name} does not match its SHA-256 in {CHECKSUMS_FILE} (corrupted or modified)")
    return problems


def read_config(directory: str | Path) -> MapperConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: not a mapper folder, or an incomplete artifact.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); the artifact is corrupted.") from None
    return config_from_json(data)


def load_mapper(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> Mapper:
    """Load a mapper from a folder or a hub repo; see :meth:`Mapper.from_pretrained`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory, _ = snapshot(str(path_or_repo_id), revision, ARTIFACT_FILES, ArtifactError, "mapper")
    if verify:
        problems = verify_artifact(directory)
        if problems:
            raise ArtifactError(
                f"mapper at {directory} failed verification: {'; '.join(problems)}. Re-download or refit it; "
                "nothing was loaded."
            )
    config = read_config(directory)
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{directory / WEIGHTS_FILE} cannot be read ({exc}); the artifact is corrupted.") from None
    if dtype is not None:
        tensors = {name: t if keeps_dtype(name) else t.to(dtype) for name, t in tensors.items()}
    return Mapper(config, tensors)


def check_weights(directory: str | Path, config: MapperConfig) -> list[str]:
    """Problems between the tensors' names/shapes in the weights file and ``mapper.json`` (reads headers only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(directory) / WEIGHTS_FILE), framework="pt") as handle:
            found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
            dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
            expected = config.weight_shapes()
            problems = [f"missing tensor {n}" for n in sorted(set(expected) - set(found))]
            problems += [f"unexpected tensor {n}" for n in sorted(set(found) - set(expected))]
            problems += [f"tensor {n} has shape {found[n]}, expected {s}" for n, s in expected.items()
                         if n in found and found[n] != s]
            problems += [f"tensor {n} has dtype {dtypes[n]}, expected {'I64' if n in INTEGER_TENSORS else 'F32'}"
                         for n in expected if n in dtypes and dtypes[n] != ("I64" if n in INTEGER_TENSORS else "F32")]
            if not problems:  # one tensor at a time: memory stays at the largest tensor
                problems += [f"tensor {n} holds NaN or Inf" for n in expected if n not in INTEGER_TENSORS
                             and not bool(torch.isfinite(handle.get_tensor(n)).all())]
    except (SafetensorError, OSError) as exc:
        return [f"{WEIGHTS_FILE} cannot be read ({exc})"]
    return problems


def check_artifact(directory: str | Path) -> list[str]:
    """Every problem ``kvbridge verify`` reports: files and checksums, then mapper.json and tensor shapes."""
    problems = verify_artifact(directory)
    if problems:
        return problems
    try:
        return check_weights(directory, read_config(directory))
    except ArtifactError as exc:
        return [str(exc)]
