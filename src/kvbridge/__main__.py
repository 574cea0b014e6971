"""``python -m kvbridge`` is the ``kvbridge`` command (also under torchrun)."""

import sys

from .cli import main

if __name__ == "__main__":  # (a process vLLM spawns imports this module again: it must not run the command twice)
    sys.exit(main())
