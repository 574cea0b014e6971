"""The ``kvbridge`` command line: :func:`.app.main`; every command listed once in :mod:`.registry`, its options and
handler in a module by topic (:mod:`.fitting`, :mod:`.measuring`, :mod:`.release`, :mod:`.serve`,
:mod:`.serve_bench`, :mod:`.load_bench`), the options several share in :mod:`.args`."""

from .app import main

__all__ = ["main"]
