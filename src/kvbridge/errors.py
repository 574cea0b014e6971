"""Errors a user can act on.

Every message says what is wrong *and* what to do. The CLI prints ``str(error)`` and exits non-zero;
library users catch :class:`KVBridgeError`. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class ArtifactError(KVBridgeError):
    """A mapper artifact is missing, incomplete, corrupted or written by an unknown format."""


class CompatibilityError(KVBridgeError):
    """Models, tokenizers or a mapper do not belong together (pair, geometry, revision, tokenizer)."""


class UnsupportedModelError(KVBridgeError):
    """The model's attention or RoPE layout is one kvbridge cannot map exactly."""


class InputError(KVBridgeError):
    """Bad user input: an empty or over-long prompt, an unreadable text file, an invalid option."""


class ModelLoadError(KVBridgeError):
    """A checkpoint could not be found, downloaded or loaded completely."""


class FitError(KVBridgeError):
    """The closed-form fit cannot produce a finite mapper from the collected statistics."""


class NumericalError(KVBridgeError):
    """A mapped cache or a model's output holds NaN or Inf: the result would be garbage, so nothing is returned."""
