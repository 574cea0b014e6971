"""``python -m kvbridge`` is the ``kvbridge`` command (also under torchrun)."""

import sys

from .cli import main

sys.exit(main())
