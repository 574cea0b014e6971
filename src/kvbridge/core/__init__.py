"""The library's core: the mapper and its artifact, model loading, the transfer (Bridge) and what it runs.

Imports nothing above it (:mod:`kvbridge.fit`, :mod:`kvbridge.measure`, :mod:`kvbridge.release`,
:mod:`kvbridge.serving`, :mod:`kvbridge.cli`); ``tests/test_lint.py`` holds the layers.
"""
