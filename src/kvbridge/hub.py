"""Resolve a local folder or a hub id (with an optional pinned revision) to a local snapshot.

The one place that talks to huggingface_hub for downloads; models and mapper artifacts both use it.
Honours ``HF_HUB_OFFLINE=1`` (no network attempt, cached snapshots only) and turns the hub's
exceptions into one :class:`~kvbridge.errors.ModelLoadError` / :class:`ArtifactError` with a hint.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import KVBridgeError

_SNAPSHOT_RE = re.compile(r"snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def snapshot(
    id_or_path: str,
    revision: str | None,
    allow_patterns: list[str],
    error_cls: type[KVBridgeError],
    what: str,
) -> tuple[Path, str | None]:
    """Return ``(local_dir, commit)`` for a folder or a hub repo id.

    For a folder, ``commit`` is the 40-hex snapshot hash when the folder lies in a hub cache
    (``…/snapshots/<hash>``), else ``None``. For a hub id it is the resolved commit.
    """
    path = Path(id_or_path).expanduser()
    if path.is_dir():
        match = _SNAPSHOT_RE.search(str(path.resolve()))
        return path, (match.group(1) if match else None)
    if path.exists():
        raise error_cls(f"{what} {id_or_path!r} is a file; pass the folder that contains it.")
    looks_local = id_or_path.startswith((".", "/", "~")) or id_or_path.count("/") > 1
    if looks_local:
        raise error_cls(f"{what} folder {id_or_path!r} does not exist. Check the path.")

    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            id_or_path,
            revision=revision,
            allow_patterns=allow_patterns,
            local_files_only=_offline(),
        )
    except hub_errors.GatedRepoError as exc:
        raise error_cls(
            f"{what} {id_or_path!r} is gated: accept its licence on the hub and log in "
            f"(`hf auth login`), then retry. ({exc.__class__.__name__})"
        ) from None
    except hub_errors.RepositoryNotFoundError:
        raise error_cls(f"{what} {id_or_path!r} was not found on the hub (or is private). Check the id.") from None
    except hub_errors.RevisionNotFoundError:
        raise error_cls(f"revision {revision!r} of {what} {id_or_path!r} does not exist. Check --revision.") from None
    except (hub_errors.LocalEntryNotFoundError, FileNotFoundError, OSError, hub_errors.HfHubHTTPError) as exc:
        hint = (
            "HF_HUB_OFFLINE is set and it is not in the local cache: download it once with network, "
            "or pass a local folder."
            if _offline()
            else "the hub could not be reached and it is not cached: check the network, or pass a local folder."
        )
        raise error_cls(f"{what} {id_or_path!r} (revision {revision or 'main'}) is not available: {hint}") from exc
    match = _SNAPSHOT_RE.search(str(Path(local).resolve()))
    return Path(local), (match.group(1) if match else revision)
