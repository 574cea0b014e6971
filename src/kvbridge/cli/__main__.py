"""``python -m kvbridge.cli`` is the ``kvbridge`` command, as ``python -m kvbridge``."""

import sys

from .app import main

if __name__ == "__main__":  # (a process vLLM spawns imports this module again: it must not run the command twice)
    sys.exit(main())
