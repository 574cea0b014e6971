"""The ``kvbridge`` command line (:mod:`.app`; the serving commands in :mod:`.serving`)."""

from .app import main

__all__ = ["main"]
