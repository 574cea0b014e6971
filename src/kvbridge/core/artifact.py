"""Artifact folders on disk: writing them atomically, verifying checksums, reading headers and tensors.

It knows the folder's files (their names), checksums and safetensors, not what a mapper's tensors
mean — the mapper fills in its part (:meth:`kvbridge.core.mapper.Mapper.save_pretrained` /
``from_pretrained``; the JSON format is in :mod:`kvbridge.core.schema`).

A mapper folder holds::

    mapper.safetensors   float32 weights as fitted: ``{key,value}.{target_layer}.{weight,bias}``,
                         weight (|S_l|·Fs, Ft) applied as ``x @ W + b`` on content features
    mapper.json          format version, model pair, geometry, RoPE, selection, fit settings & summary
    checksums.sha256     ``sha256sum``-compatible lines for the two files above
    fit_report.json      (fits only) time, throughput and peak memory of the run that wrote it: outside
                         the checksums on purpose, so two identical fits give identical checksums

Writes go to a temporary sibling folder that replaces the destination in one atomic step (Linux's
rename-exchange; elsewhere two renames, repaired by the next save), under a lock on the parent
folder, so a crash never leaves a half-written artifact and concurrent saves queue. Leftovers of an
interrupted save are restored or removed by the next save and named by verify and load. Loading
verifies checksums (before a single tensor is parsed), validates every field of mapper.json, and
checks tensor names, shapes and dtypes from the file's header before reading a tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ArtifactError, InputError
from .hashing import sha256_file
from .hub import snapshot
from .outputs import check_output_dir, umask
from .schema import CONFIG_FILE, FORMAT

WEIGHTS_FILE = "mapper.safetensors"
BINDING_TAG = ";computation="  # in the weights file's format tag: see write_artifact
CHECKSUMS_FILE = "checksums.sha256"
RUN_REPORT_FILE = "fit_report.json"  # volatile measurements of the fit: not part of the artifact's identity
ARTIFACT_FILES = [WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE]
DOWNLOAD_FILES = [*ARTIFACT_FILES, RUN_REPORT_FILE]
CARD_FILES = ("README.md", "artifact_manifest.json", "example.py")  # written by `kvbridge card` (kvbridge.release.card)
KNOWN_FILES = frozenset([*DOWNLOAD_FILES, *CARD_FILES])
def is_artifact_dir(directory: Path) -> bool:
    """Whether ``directory`` holds a kvbridge mapper (its mapper.json says so), whatever state its files are in."""
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _artifact_path(directory: str | Path) -> Path:
    """The absolute destination (symlinks resolved: a save replaces the folder a link points to, not the link)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ArtifactError(f"an artifact folder is a path, not {type(directory).__name__}.")
    path = Path(directory).expanduser()
    resolved = path.resolve()
    if not path.name or path.name in (".", "..") or resolved == resolved.parent:
        raise ArtifactError(f"--out {directory} names no folder of its own (it resolves to {resolved}); give the "
                            "artifact folder's name, e.g. --out mappers/my-mapper.")
    return resolved


def check_writable_artifact_dir(directory: str | Path) -> None:
    """Refuse to replace anything but an absent or empty folder or an earlier kvbridge artifact with only its
    own files; and a place where the swap could not be done (the parent folder must be writable).

    Saving replaces the whole folder: a results folder, a model folder or a git clone given as ``--out``
    would be lost.
    """
    directory = _artifact_path(directory)
    if directory.exists() and not directory.is_dir():
        raise ArtifactError(f"{directory} exists and is not a folder; choose another --out.")
    if directory.is_dir() and any(directory.iterdir()):
        if not is_artifact_dir(directory):
            raise ArtifactError(f"{directory} is a folder with other files, not a kvbridge artifact; writing the "
                                "mapper would replace it. Choose a new or empty folder for --out.")
        extra = sorted(p.name for p in directory.iterdir() if p.name not in KNOWN_FILES)
        if extra:
            raise ArtifactError(f"{directory} is a kvbridge artifact but also holds {', '.join(extra[:5])}; writing "
                                "the mapper would delete them. Move them away, or choose another --out.")
    try:  # the new folder is made and swapped in there
        check_output_dir(directory.parent, "the artifact's parent folder")
    except InputError as exc:
        raise ArtifactError(str(exc)) from None


def write_artifact(directory: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                   run_report: dict[str, Any] | None = None, binding: str | None = None) -> Path:
    """Write ``mapper.safetensors`` (``tensors`` as given: CPU, contiguous), ``mapper.json`` (``config``),
    ``checksums.sha256`` over those two and, if given, ``fit_report.json``; atomically. ``binding``: a digest of
    the config fields that change the computation without changing a tensor's shape, stored in the weights
    file's header (:func:`header_problems` compares it), so an edit of them fails verification even resealed.

    An existing folder at ``directory`` is replaced only on success. Saves to one folder queue on a lock
    of its parent folder (POSIX, where the filesystem has locks), so concurrent saves never interleave:
    the last one wins. Under that lock, leftovers of a save that was killed are restored or removed first.
    """
    from safetensors import SafetensorError

    directory = _artifact_path(directory)
    check_writable_artifact_dir(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with _parent_lock(directory.parent) as locked:
            if locked:  # without a lock a leftover may be a live save's: leave it
                recover_interrupted_save(directory)
            check_writable_artifact_dir(directory)  # again: another process may have written it meanwhile
            tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
            try:
                _write_files(tmp, config, tensors, run_report, binding)
                _swap_in(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error, not an OSError
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise ArtifactError(f"cannot write the artifact to {directory} ({reason}); nothing was "
                            "changed there. Check the disk space and permissions, or choose another folder.") from None
    return directory


def _write_files(tmp: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 run_report: dict[str, Any] | None, binding: str | None = None) -> None:
    from safetensors.torch import save_file

    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; an artifact folder follows the umask
    # one metadata key: safetensors orders several keys at random, and identical mappers must hash alike
    tag = f"{FORMAT}/{config.get('format_version')}" + (f"{BINDING_TAG}{binding}" if binding else "")
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": tag})
    with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=False)
        handle.write("\n")
    lines = [f"{sha256_file(tmp / name)}  {name}\n" for name in (CONFIG_FILE, WEIGHTS_FILE)]
    (tmp / CHECKSUMS_FILE).write_text("".join(lines), encoding="utf-8")
    written = list(ARTIFACT_FILES)
    if run_report:
        (tmp / RUN_REPORT_FILE).write_text(json.dumps(run_report, indent=2) + "\n", encoding="utf-8")
        written.append(RUN_REPORT_FILE)
    for name in written:
        os.chmod(tmp / name, 0o666 & ~umask())  # safetensors writes 0600
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(tmp)


def _fsync_dir(folder: Path) -> None:
    """Make a folder's entries durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _parent_lock(parent: Path):
    """An exclusive advisory lock on ``parent`` (flock on the folder itself: no lock file left behind).

    Yields whether the lock is held: not on Windows, nor on filesystems without flock on folders (some
    NFS and Lustre mounts), where saves stay atomic but concurrent saves are not queued.
    """
    try:
        import fcntl
    except ImportError:
        yield False
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as exc:
            if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            locked = False
        yield locked
    finally:
        os.close(fd)  # releases the lock


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the platform lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # libc older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(new: Path, dest: Path) -> None:
    """Make ``new`` the folder at ``dest`` in one step; the old ``dest`` (if any) is removed afterwards."""
    if not dest.exists():
        os.rename(new, dest)
    elif _rename_exchange(new, dest):  # dest holds the new artifact, `new` the old one
        _fsync_dir(dest.parent)
        shutil.rmtree(new, ignore_errors=True)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rmdir(old)
        os.rename(dest, old)  # a kill between these two renames leaves no `dest`: the next save restores it
        os.rename(new, dest)
        _fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(dest.parent)


def leftovers(directory: str | Path) -> list[Path]:
    """What an interrupted save of ``directory`` left beside it: ``.NAME.tmp-XXXXXXXX`` and ``.NAME.old-XXXXXXXX``
    (the suffix ``tempfile.mkdtemp`` makes), nothing else."""
    directory = Path(directory).expanduser().absolute()
    if not directory.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(directory.name)}\.(tmp|old)-[a-z0-9_]{{8}}")
    return sorted(p for p in directory.parent.iterdir() if pattern.fullmatch(p.name))


def recover_interrupted_save(directory: str | Path) -> list[str]:
    """Repair what a killed save left: restore the artifact if ``directory`` is missing, remove the rest.

    ``directory`` is missing only when a save without rename-exchange was killed between its two
    renames: then an ``.old-`` folder holds the previous artifact and a complete ``.tmp-`` folder the
    new one, which is restored (else the old one). Call with the parent's lock held (``write_artifact``
    does), so no leftover belongs to a live save. Returns what was done, one line each.
    """
    directory = Path(directory).expanduser().absolute()
    done = []
    found = leftovers(directory)
    if not directory.exists() and any(".old-" in p.name for p in found):
        complete = [p for p in found if not p.is_symlink() and p.is_dir() and not verify_artifact(p)]
        complete.sort(key=lambda p: ".tmp-" not in p.name)  # the interrupted save's new artifact first
        if complete:
            os.rename(complete[0], directory)
            found.remove(complete[0])
            done.append(f"restored {directory} from {complete[0].name}")
    for p in found:
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p.name}")
    return done


def _missing_hint(path_or_repo_id: str | Path) -> None:
    """Before treating a missing local path as a hub id: say so when an interrupted save explains it."""
    path = Path(path_or_repo_id).expanduser()
    if not path.exists():
        found = leftovers(path)
        if found:
            raise ArtifactError(f"{path} does not exist, but an interrupted save left "
                                f"{', '.join(p.name for p in found)} beside it. Saving the mapper there again "
                                "restores or removes them; or rename the one that passes `kvbridge verify` to the "
                                "folder's name.")


def read_checksums(directory: Path) -> dict[str, str]:
    path = directory / CHECKSUMS_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: the artifact is incomplete")  # (callers say what to do)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is not text (a corrupted byte?)") from None
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


def read_config_json(directory: str | Path) -> Any:
    """The parsed ``mapper.json`` of an artifact folder (validation: :func:`kvbridge.core.schema.validate`)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ArtifactError(f"{path} is missing: not a mapper folder, or an incomplete artifact.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc.strerror or exc}); check its permissions.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); the artifact is corrupted.") from None
    except RecursionError:
        raise ArtifactError(f"{path} is nested too deeply to be a mapper.json; the artifact is corrupted.") from None


def resolve(path_or_repo_id: str | Path, revision: str | None = None, what: str = "mapper",
            files: list[str] | None = None) -> Path:
    """The local folder of an artifact: a folder as given, or a hub snapshot (``files`` downloaded)."""
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise ArtifactError(f"a {what} is a folder or a hub id (a string), not {type(path_or_repo_id).__name__}.")
    _missing_hint(path_or_repo_id)
    directory, _ = snapshot(str(path_or_repo_id), revision, files or DOWNLOAD_FILES, ArtifactError, what)
    return Path(directory)


def read_run_report(directory: str | Path) -> dict[str, Any]:
    """The fit's volatile measurements (``fit_report.json``), or {} when absent or unreadable (not verified)."""
    try:
        data = json.loads((Path(directory) / RUN_REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def header_problems(directory: str | Path, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                    binding: str | None = None) -> list[str]:
    """Differences between the weights file's header and the expected tensor names, shapes and dtype codes
    (``F32``, ``I64``) and, when the file records one (artifacts written since it existed), the ``binding``
    digest of the config; reads the header only."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(directory) / WEIGHTS_FILE), framework="pt") as handle:
            found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
            codes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
            tag = (handle.metadata() or {}).get("format", "")
    except (SafetensorError, OSError) as exc:
        return [f"{WEIGHTS_FILE} cannot be read ({exc})"]
    if binding and BINDING_TAG in tag and tag.split(BINDING_TAG, 1)[1] != binding:
        return [f"{CONFIG_FILE}'s layer selection, levers or geometry differ from those {WEIGHTS_FILE} was fitted "
                "with (edited after the fit)"]
    problems = [f"missing tensor {n}" for n in sorted(set(shapes) - set(found))]
    problems += [f"unexpected tensor {n}" for n in sorted(set(found) - set(shapes))]
    problems += [f"tensor {n} has shape {found[n]}, expected {s}" for n, s in shapes.items()
                 if n in found and found[n] != s]
    problems += [f"tensor {n} has dtype {codes[n]}, expected {dtypes[n]}" for n in shapes
                 if n in codes and codes[n] != dtypes[n]]
    return problems


def nonfinite_tensors(directory: str | Path, names: list[str]) -> list[str]:
    """The tensors among ``names`` holding NaN or Inf, read one at a time (memory: the largest tensor)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(directory) / WEIGHTS_FILE), framework="pt") as handle:
            return [n for n in names if not bool(torch.isfinite(handle.get_tensor(n)).all())]
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{Path(directory) / WEIGHTS_FILE} cannot be read ({exc}).") from None


@contextlib.contextmanager
def open_tensors(directory: str | Path, device: str | torch.device):
    """Yield ``fetch(name)``: one tensor of the weights file at a time, read onto ``device``."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            def fetch(name: str) -> torch.Tensor:
                try:
                    return handle.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as exc:
                    raise ArtifactError(f"{path}: tensor {name} cannot be read onto {device} ({exc}).") from None

            yield fetch
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{path} cannot be read onto {device} ({exc}).") from None
