"""``kvbridge`` command line: parses (the commands are :mod:`.registry`'s), runs the command, turns errors into
messages."""

from __future__ import annotations

import sys

from ..errors import KVBridgeError
from ..family import FAMILIES
from .registry import BY_NAME, parse

FAMILY_NAMES = tuple(FAMILIES)
LIST_FLAGS = ("--lags", "--lever-layers", "--contexts", "--lever-kinds")


def _family_pair(args) -> None:
    """--family stands for --source/--target (the commands that take a pair); one of the two is needed."""
    if not (hasattr(args, "family") and hasattr(args, "source")) or args.command == "frontier" \
            or getattr(args, "table", None):  # kvbridge gap --table reads a saved report: no models
        return
    if args.family:
        if args.source or args.target or args.source_revision or args.target_revision:
            raise KVBridgeError("give --family or --source/--target (and their revisions), not both.")
        from .. import family

        args.source, args.target = family.source_path(args.family), family.target_path(args.family)
    elif not (args.source and args.target):
        raise KVBridgeError("give --source and --target (folders or hub ids), or --family "
                            f"{'|'.join(FAMILY_NAMES)} for an embedded family.")


def _join_negative_lists(argv: list[str]) -> list[str]:
    """``--lags -1,0`` as ``--lags=-1,0``: argparse takes a value that starts with "-" for an option (and says
    "expected one argument"); joined, the value reaches the check that names what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1] in LIST_FLAGS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(_join_negative_lists(sys.argv[1:] if argv is None else list(argv)))
    try:
        _family_pair(args)
        return BY_NAME[args.command].run(args)
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a disk, permission, path or network problem the checks could not foresee
        where = f" ({exc.filename})" if exc.filename else ""
        hint = ("Check the network (lm-eval downloads its datasets; kvbridge's own tasks work offline), then rerun."
                if isinstance(exc, (ConnectionError, TimeoutError)) or "reach" in str(exc)
                else "Check the path, its permissions and the free disk space, then rerun.")
        print(f"kvbridge {args.command}: error: {exc.strerror or exc}{where}. {hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
