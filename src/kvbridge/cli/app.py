"""``kvbridge`` command line: parses (the commands are :mod:`.registry`'s), runs the command, turns errors into
messages."""

from __future__ import annotations

import sys

from ..errors import KVBridgeError
from .args import family_pair, join_negative_lists
from .registry import BY_NAME, parse


def main(argv: list[str] | None = None) -> int:
    args = parse(join_negative_lists(sys.argv[1:] if argv is None else list(argv)))
    try:
        family_pair(args)
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
