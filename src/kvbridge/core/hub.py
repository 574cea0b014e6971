"""The one place that talks to huggingface_hub: snapshots to read (models, mappers) and pushes of artifacts.

``snapshot`` resolves a local folder or a hub id (with an optional pinned revision) to a local
snapshot; ``push_folder`` uploads an artifact folder in one commit.
Honours ``HF_HUB_OFFLINE=1`` (no network attempt, cached snapshots only) and turns the hub's
exceptions into one :class:`~kvbridge.errors.ModelLoadError` / :class:`ArtifactError` with a hint.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import InputError, KVBridgeError

_SNAPSHOT_RE = re.compile(r"snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")


def is_hub_id(name: str) -> bool:
    """``owner/name`` that is not a path on this machine."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


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
    if not isinstance(id_or_path, (str, os.PathLike)):
        raise error_cls(f"a {what} is a folder or a hub id (a string), not {type(id_or_path).__name__}.")
    id_or_path = str(id_or_path)
    if not id_or_path.strip():
        raise error_cls(f"no {what} given: pass a folder or a hub id (owner/name).")
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
    except hub_errors.HFValidationError as exc:
        raise error_cls(f"{what} {id_or_path!r} is neither an existing folder nor a valid hub id ({exc}). "
                        "Check the path or the id (owner/name).") from None
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


def check_repo_id(repo_id: str, flag: str, error_cls: type[KVBridgeError] = InputError) -> None:
    """Refuse what the hub would refuse as a model repo id (owner/name), before any work."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except (hub_errors.HFValidationError, TypeError) as exc:
        raise error_cls(f"{flag} {repo_id!r} is not a hub id ({exc}); use owner/name.") from None
    if repo_id.count("/") != 1:
        raise error_cls(f"{flag} {repo_id!r} must name an owner: owner/name.")


def push_folder(folder: Path, repo_id: str, files: list[str], error_cls: type[KVBridgeError], private: bool = False,
                create_pr: bool = False, token: str | None = None, commit_message: str = "Upload kvbridge mapper",
                delete: list[str] | None = None) -> tuple[str, str, str | None]:
    """Create ``repo_id`` if needed and upload ``files`` of ``folder`` in one commit, deleting ``delete`` from
    the repo in the same commit (files of an earlier push that this artifact does not have).

    Returns ``(commit_sha, commit_url, pr_url)``. Offline mode, a missing or refused token, an invalid
    id and an unreachable hub are one ``error_cls`` each, with what to do.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub import errors as hub_errors

    check_repo_id(repo_id, "--repo-id", error_cls)
    if _offline():
        raise error_cls("HF_HUB_OFFLINE is set: nothing can be pushed. Unset it (and check the network), then retry.")
    token = token or None  # an empty --token is no token
    if token is None and get_token() is None:
        raise error_cls("not logged in to the Hugging Face Hub: run `hf auth login` with a token that has write "
                        "access, or set HF_TOKEN, then retry.")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", allow_patterns=files,
                                 delete_patterns=delete or None, commit_message=commit_message, create_pr=create_pr)
    except hub_errors.OfflineModeIsEnabled:
        raise error_cls("HF_HUB_OFFLINE is set: nothing can be pushed. Unset it, then retry.") from None
    except hub_errors.HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403):
            raise error_cls(f"the hub refused the token (HTTP {status}): pushing to {repo_id} needs a token with write "
                            "access to it. Run `hf auth login` with such a token, then retry.") from None
        raise error_cls(f"the hub answered HTTP {status} for {repo_id}: {getattr(exc, 'server_message', None) or exc}")\
            from None
    except Exception as exc:
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
            raise error_cls(f"cannot reach the hub ({type(exc).__name__}: {exc}); check the network (or HF_ENDPOINT), "
                            "then retry. Nothing was pushed.") from None
        raise
    return info.oid, info.commit_url, info.pr_url
