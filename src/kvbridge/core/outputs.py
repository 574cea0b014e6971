"""Writing results: output paths checked before any work starts, files replaced whole or not at all.

Every command that writes (fit, demo, frontier, bench, eval, diagnose) checks its output paths before
it loads a model, so a typo costs a second, not a finished run; and each file is written to a
temporary sibling and renamed into place, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import InputError


def _probe(folder: Path, what: str) -> None:
    """Create and delete a file in ``folder``: the only test that holds for root, read-only mounts and /proc."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"{what}: cannot write in {folder} ({exc.strerror or exc}). Choose another place.") from None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """Refuse an output folder that is a file, lies under a file, or cannot be written; creates nothing."""
    path = Path(path)
    what = f"{flag} {path}"
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} is a file, not a folder. Choose a folder.")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise InputError(f"{what} lies under {existing}, which is a file. Choose a folder.")
    _probe(existing, what)
    return path


def check_output_file(path: str | Path, flag: str) -> Path:
    """Refuse an output file that is a folder, lies under a file, or cannot be written; creates nothing."""
    path = Path(path)
    what = f"{flag} {path}"
    if path.is_dir():
        raise InputError(f"{what} is a folder; give a file name.")
    existing = _nearest_existing(path.parent)
    if not existing.is_dir():
        raise InputError(f"{what} lies under {existing}, which is a file. Choose another path.")
    _probe(existing, what)
    return path


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_plot_file(path: str | Path, flag: str) -> Path:
    """:func:`check_output_file` for a plot, whose suffix names a format matplotlib writes: checked before the
    work whose figures it shows, not after."""
    path = check_output_file(path, flag)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise InputError(f"{flag} {path}: a plot is written as {', '.join(PLOT_SUFFIXES)}; name the file with one "
                         "of those suffixes, e.g. latency.png.")
    return path


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; results follow the umask like any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask() -> int:
    """The process's umask: read from /proc on Linux (setting it to read it back would race other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    _atomic(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """``fig.savefig`` whole or not at all (the format follows ``path``'s suffix)."""
    path = Path(path)
    _atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png"))
