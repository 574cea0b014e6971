"""kvbridge: cross-model KV-cache transfer within an LLM family.

A small source model prefills the context, a closed-form linear mapper turns its KV cache into the
cache of a larger target model of the same family, and the target continues without prefilling.
"""

__version__ = "0.1.0"

from .errors import KVBridgeError  # noqa: E402
from .mapper import Mapper  # noqa: E402

__all__ = ["Mapper", "KVBridgeError", "__version__"]


def __getattr__(name):  # lazy: keep `import kvbridge` light
    if name == "Bridge":
        from .transfer import Bridge

        return Bridge
    if name in ("fit_mapper", "FitConfig"):
        from . import fit

        return getattr(fit, name)
    if name == "load_model":
        from .models import load_model

        return load_model
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
