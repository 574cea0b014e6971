"""What every command line of kvbridge shares: messages on stderr, list options, optional dependencies."""

from __future__ import annotations

import sys

from ..core.outputs import check_output_file, check_plot_file
from ..errors import KVBridgeError

EPILOG = "Models are local folders or hub ids (pin them with --source-revision/--target-revision)."


def check_results(args, command: str) -> None:
    """--json and --plot checked before the work they record (a plot's suffix and matplotlib included)."""
    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_plot_file(args.plot, "--plot")
        require("matplotlib", "plot", f"{command} --plot")


def require(module: str, extra: str, what: str) -> None:
    """Fail in one line, before any work, when an optional dependency is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise KVBridgeError(f"{what} needs {module}, which is not installed: pip install \"kvbridge[{extra}]\"")


def counts(text: str, minimum: int, flag: str = "--contexts") -> list[int]:
    """--contexts (or ``flag``): comma-separated counts, each at least ``minimum``."""
    try:
        contexts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < minimum:
        raise KVBridgeError(f"{flag} must be comma-separated integers >= {minimum}, e.g. 1024,8192, not {text!r}.")
    return contexts


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, an ellipsis last where it was cut."""
    return text if len(text) <= width else text[: width - 1] + "…"
