"""Mapper artifacts: files, checksums, manifest. ``save_mapper`` and ``load_mapper`` are a pair.

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

from . import __version__
from .errors import ArtifactError
from .hashing import sha256_file
from .hub import snapshot
from .mapper import INTEGER_TENSORS, Lever, Mapper, MapperConfig, RuntimeOptions, keeps_dtype
from .models import ModelInfo, check_device
from .outputs import check_output_dir, umask

FORMAT = "kvbridge-mapper"
FORMAT_VERSION = 2  # 2 adds "levers" (lags, inputs, residual MLPs) and "runtime"; version-1 files read as plain maps
WEIGHTS_FILE = "mapper.safetensors"
CONFIG_FILE = "mapper.json"
CHECKSUMS_FILE = "checksums.sha256"
RUN_REPORT_FILE = "fit_report.json"  # volatile measurements of the fit: not part of the artifact's identity
ARTIFACT_FILES = [WEIGHTS_FILE, CONFIG_FILE, CHECKSUMS_FILE]
DOWNLOAD_FILES = [*ARTIFACT_FILES, RUN_REPORT_FILE]
CARD_FILES = ("README.md", "artifact_manifest.json", "example.py")  # written by `kvbridge card` (kvbridge.card)
KNOWN_FILES = frozenset([*DOWNLOAD_FILES, *CARD_FILES])
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


def config_from_json(data: Any) -> MapperConfig:
    """A validated :class:`MapperConfig`; any malformed field is one ArtifactError that names it."""
    _validate(data)
    version = data["format_version"]
    try:
        return MapperConfig(
            source=ModelInfo.from_dict(data["source"]),
            target=ModelInfo.from_dict(data["target"]),
            selection={k: tuple(tuple(layers) for layers in data["selection"][k]) for k in ("key", "value")},
            fit=dict(data.get("fit", {})),
            levers=tuple(Lever.from_dict(v) for v in data.get("levers", [])) if version >= 2 else (),
            runtime=RuntimeOptions.from_dict(data.get("runtime", {})) if version >= 2 else RuntimeOptions(),
        )
    except (KeyError, TypeError, ValueError) as exc:  # _validate should have named it: a last line of defence
        raise ArtifactError(f"{CONFIG_FILE} is incomplete or malformed ({exc!r}); "
                            "re-download or refit the mapper.") from None


# -- mapper.json validation: every field's type and range, checked before any object is built --------
def _bad(field: str, what: str, value: Any = None, missing: bool = False) -> ArtifactError:
    shown = "missing" if missing else f"{_short(value)} ({type(value).__name__})"
    return ArtifactError(f"{CONFIG_FILE}: field {field!r} must be {what}, but is {shown}. The file is malformed or "
                         "was edited; re-download or refit the mapper.")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(obj: dict, key: str, where: str, check, what: str, required: bool = True) -> Any:
    field = f"{where}.{key}" if where else key
    if key not in obj:
        if required:
            raise _bad(field, what, missing=True)
        return None
    if not check(obj[key]):
        raise _bad(field, what, obj[key])
    return obj[key]


def _validate(data: Any) -> None:
    if not isinstance(data, dict):
        raise ArtifactError(f"{CONFIG_FILE} must hold a JSON object, not {type(data).__name__}; the file is corrupted.")
    if data.get("format") != FORMAT:
        raise ArtifactError(f"{CONFIG_FILE} is not a kvbridge mapper (format {_short(data.get('format'))}).")
    version = data.get("format_version")
    if _is_int(version) and version > FORMAT_VERSION:
        raise ArtifactError(f"{CONFIG_FILE} has format version {version}; this kvbridge reads up to {FORMAT_VERSION}. "
                            "Upgrade kvbridge (`pip install -U kvbridge`).")
    _get(data, "format_version", "", lambda v: _is_int(v) and 1 <= v, f"an integer from 1 to {FORMAT_VERSION}")
    # sizes beyond 2**40 are not a model: bounding them keeps every product of shapes a machine integer
    integer = lambda lo, hi=2**40: (lambda v: _is_int(v) and lo <= v <= hi)  # noqa: E731
    text = lambda v: isinstance(v, str)  # noqa: E731
    for role in ("source", "target"):
        info = _get(data, role, "", lambda v: isinstance(v, dict), "an object")
        _get(info, "name_or_path", role, text, "a string")
        _get(info, "revision", role, lambda v: v is None or isinstance(v, str), "a string or null")
        _get(info, "architecture", role, text, "a string")
        for key, lo in (("num_layers", 1), ("num_kv_heads", 1), ("head_dim", 1), ("max_positions", 0)):
            _get(info, key, role, integer(lo), f"an integer from {lo} to 2**40")
        _get(info, "tokenizer_sha256", role, text, "a string")
        _get(info, "weights_sha256", role, lambda v: v is None or isinstance(v, str), "a string or null",
             required=False)
        rope = _get(info, "rope", role, lambda v: isinstance(v, dict), "an object")
        _get(rope, "model_type", f"{role}.rope", text, "a string")
        _get(rope, "rope_type", f"{role}.rope", text, "a string")
        _get(rope, "head_dim", f"{role}.rope", integer(1), "an integer from 1 to 2**40")
        _get(rope, "parameters", f"{role}.rope", lambda v: isinstance(v, dict) and all(
            x is None or isinstance(x, (str, int, float, bool)) for x in v.values()),
            "an object of numbers, strings, booleans or nulls", required=False)
    selection = _get(data, "selection", "", lambda v: isinstance(v, dict), "an object")
    for kind in ("key", "value"):
        _get(selection, kind, "selection", lambda v: isinstance(v, list) and all(
            isinstance(layers, list) and all(_is_int(s) for s in layers) for layers in v),
            "a list (one per target layer) of lists of source layer indices")
    fit = _get(data, "fit", "", lambda v: isinstance(v, dict), "an object", required=False) or {}
    _get(fit, "settings", "fit", lambda v: isinstance(v, dict), "an object", required=False)
    levers = _get(data, "levers", "", lambda v: isinstance(v, list), "a list", required=False) or []
    for i, lever in enumerate(levers):
        where = f"levers[{i}]"
        if not isinstance(lever, dict):
            raise _bad(where, "an object", lever)
        _get(lever, "kind", where, text, "'key' or 'value'")
        _get(lever, "layer", where, integer(0), "an integer from 0 to 2**40")
        _get(lever, "lags", where, lambda v: isinstance(v, list) and all(_is_int(j) for j in v),
             "a list of integers", required=False)
        _get(lever, "inputs", where, lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
             "a list of 'key'/'value'", required=False)
        _get(lever, "hidden", where, integer(0), "an integer >= 0", required=False)
    runtime = _get(data, "runtime", "", lambda v: isinstance(v, dict), "an object", required=False) or {}
    _get(runtime, "hold_back", "runtime", integer(1), "an integer >= 1", required=False)
    _get(runtime, "recompute", "runtime", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
         and 0 <= v <= 1, "a number in [0, 1]", required=False)
    _get(runtime, "recompute_by", "runtime", text, "a string", required=False)
    _get(runtime, "sink", "runtime", lambda v: isinstance(v, bool), "true or false", required=False)
    for key in ("bigram_pairs", "bigram_vocab"):
        _get(runtime, key, "runtime", integer(0), "an integer >= 0", required=False)


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
    check_output_dir(directory.parent, "--out's parent folder")  # the new folder is made and swapped in there


def save_mapper(mapper: Mapper, directory: str | Path) -> Path:
    """Write the artifact atomically; an existing folder at ``directory`` is replaced only on success.

    Saves to one folder queue on a lock of its parent folder (POSIX, where the filesystem has locks),
    so concurrent saves never interleave: the last one wins. Under that lock, leftovers of a save that
    was killed are restored or removed first.
    """
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
                _write_files(mapper, tmp)
                _swap_in(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as exc:
        raise ArtifactError(f"cannot write the artifact to {directory} ({exc.strerror or exc}); nothing was "
                            "changed there. Check the disk space and permissions, or choose another folder.") from None
    return directory


def _write_files(mapper: Mapper, tmp: Path) -> None:
    from safetensors.torch import save_file

    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; an artifact folder follows the umask
    tensors = {name: t.detach().to("cpu", None if name in INTEGER_TENSORS else torch.float32).contiguous()
               for name, t in mapper.weights.items()}
    # one metadata key: safetensors orders several keys at random, and identical mappers must hash alike
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
    with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as handle:
        json.dump(config_to_json(mapper.config), handle, indent=2, sort_keys=False)
        handle.write("\n")
    lines = [f"{sha256_file(tmp / name)}  {name}\n" for name in (CONFIG_FILE, WEIGHTS_FILE)]
    (tmp / CHECKSUMS_FILE).write_text("".join(lines), encoding="utf-8")
    written = list(ARTIFACT_FILES)
    if mapper.run_report:
        (tmp / RUN_REPORT_FILE).write_text(json.dumps(mapper.run_report, indent=2) + "\n", encoding="utf-8")
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
    new one, which is restored (else the old one). Call with the parent's lock held (``save_mapper``
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
        raise ArtifactError(f"{path} is missing: the artifact is incomplete. Re-download or re-save it")
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
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc.strerror or exc}); check its permissions.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); the artifact is corrupted.") from None
    except RecursionError:
        raise ArtifactError(f"{path} is nested too deeply to be a mapper.json; the artifact is corrupted.") from None
    return config_from_json(data)


def load_mapper(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> Mapper:
    """Load a mapper from a folder or a hub repo; see :meth:`Mapper.from_pretrained`.

    Tensor names, shapes and dtypes are checked from the file's header before any tensor is read, so
    a file with junk tensors costs no memory; tensors are then read one at a time onto ``device``.
    """
    from safetensors import SafetensorError, safe_open

    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise ArtifactError(f"a mapper is a folder or a hub id (a string), not {type(path_or_repo_id).__name__}.")
    check_device(device, "mapper device")
    _missing_hint(path_or_repo_id)
    directory, _ = snapshot(str(path_or_repo_id), revision, DOWNLOAD_FILES, ArtifactError, "mapper")
    if verify:
        problems = verify_artifact(directory)
        if problems:
            raise ArtifactError(
                f"mapper at {directory} failed verification: {'; '.join(problems)}. Re-download or refit it; "
                "nothing was loaded."
            )
    config = read_config(directory)
    problems = check_weights(directory, config, values=False)
    if problems:
        raise ArtifactError(f"{directory / WEIGHTS_FILE} does not match {CONFIG_FILE}: {'; '.join(problems[:3])}. "
                            "Re-download or refit the mapper; nothing was loaded.")
    try:
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt", device=str(device)) as handle:
            tensors = {}
            for name in config.weight_shapes():
                t = handle.get_tensor(name)
                tensors[name] = t if dtype is None or keeps_dtype(name) else t.to(dtype)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ArtifactError(f"{directory / WEIGHTS_FILE} cannot be read onto {device} ({exc}).") from None
    return Mapper(config, tensors, run_report=read_run_report(directory))


def read_run_report(directory: str | Path) -> dict[str, Any]:
    """The fit's volatile measurements (``fit_report.json``), or {} when absent or unreadable (not verified)."""
    try:
        data = json.loads((Path(directory) / RUN_REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def check_weights(directory: str | Path, config: MapperConfig, values: bool = True) -> list[str]:
    """Problems between the weights file and ``mapper.json``: names, shapes and dtypes from the header, then
    (``values``) NaN/Inf read one tensor at a time."""
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
            if values and not problems:  # one tensor at a time: memory stays at the largest tensor
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
