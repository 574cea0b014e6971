"""kvbridge: cross-model KV-cache transfer within an LLM family.

A small source model prefills the context, a closed-form linear mapper turns its KV cache into the
cache of a larger target model of the same family, and the target continues without prefilling.
"""

from .core.mapper import Mapper
from .core.mapper_config import MapperConfig
from .core.models import load_model  # noqa: E402
from .core.transfer import Bridge  # noqa: E402
from .errors import (
    ArtifactError,
    CompatibilityError,
    FitError,
    InputError,
    KVBridgeError,
    ModelLoadError,
    NumericalError,
    UnsupportedModelError,
)
from .fit import FitConfig, fit_mapper  # noqa: E402
from .version import __version__

__all__ = [
    "ArtifactError",
    "Bridge",
    "CompatibilityError",
    "FitConfig",
    "FitError",
    "InputError",
    "KVBridgeError",
    "Mapper",
    "MapperConfig",
    "ModelLoadError",
    "NumericalError",
    "UnsupportedModelError",
    "__version__",
    "fit_mapper",
    "load_model",
]
