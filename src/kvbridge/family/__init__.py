"""The embedded default family: two small Ministral3 models trained by this project, shipped with the package.

``target`` (4 layers, 256 wide) and ``source`` (2 layers, 160 wide, pruned from the target and
distilled) share one byte-level BPE tokenizer and were trained on the CPython standard library's
source (PSF License 2.0) by :mod:`kvbridge.family.training.train`. They load through exactly the same
transformers code path as hub checkpoints, so every command works on them with no network. A second,
*deep* family (``name="deep"``: an 8-layer target and a 4-layer source, each trained from its own random
initialization by :mod:`kvbridge.family.training.train_deep`) shares the tokenizer and the data splits; a third,
``deep-pruned``, pairs the deep target with a 4-layer source pruned from it and distilled
(:mod:`kvbridge.family.training.train_pruned`): the deep family's geometry, built the way Ministral 3's sizes are.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelLoadError

FAMILY_DIR = Path(__file__).parent
CHECKPOINTS = FAMILY_DIR / "checkpoints"
DATA = FAMILY_DIR / "data"
SOURCE = CHECKPOINTS / "source"
TARGET = CHECKPOINTS / "target"
DEEP = FAMILY_DIR / "deep"  # the deep family (8-layer target, 4-layer source trained independently)
PRUNED = FAMILY_DIR / "deep-pruned"  # its target with a source pruned from it and distilled (source/ only)


# each family's folder holds its source/ and family.json, and its target/ unless TARGET_OF names another family's
FAMILIES = {"default": CHECKPOINTS, "deep": DEEP, "deep-pruned": PRUNED}
TARGET_OF = {"deep-pruned": "deep"}  # deep-pruned's target is the deep family's (the checkpoint it was pruned from)
TRAIN = {"default": "retrain it with `python -m kvbridge.family.training.train`",
         "deep": "train it with `python -m kvbridge.family.training.train_deep` (resumable; several hours on 2 "
                 "CPU cores)",
         "deep-pruned": "train it with `python -m kvbridge.family.training.train_pruned` (resumable; about 16 "
                        "minutes on 2 CPU cores, from the deep family's target)"}
DESCRIPTIONS = {"default": "4-layer target, 2-layer source pruned from it and distilled",
                "deep": "8-layer target, 4-layer source trained on its own",
                "deep-pruned": "the deep target, a 4-layer source pruned from it and distilled"}


def describe() -> str:
    """One line naming every embedded family (the command line's help)."""
    return "; ".join(f"{name}: {text}" for name, text in DESCRIPTIONS.items())


def _require(path: Path, name: str = "default") -> Path:
    if not path.exists():
        how = TRAIN.get(name, TRAIN["default"])
        raise ModelLoadError(f"the embedded family file {path} is missing from this installation; reinstall kvbridge "
                             f"(`pip install -e .` from a full clone), or {how}.")
    return path


def _checkpoints(name: str) -> Path:
    from ..errors import InputError

    if name not in FAMILIES:
        raise InputError(f"no embedded family {name!r}; the families are {', '.join(FAMILIES)}.")
    return FAMILIES[name]


def source_path(name: str = "default") -> str:
    return str(_require(_checkpoints(name) / "source", name))


def target_path(name: str = "default") -> str:
    _checkpoints(name)
    owner = TARGET_OF.get(name, name)
    return str(_require(_checkpoints(owner) / "target", owner))


def _texts(split: str) -> list[str]:
    with open(_require(DATA / f"{split}.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def calibration_texts() -> list[str]:
    """Calibration split (never trained on): what ``kvbridge demo`` fits its mapper on."""
    return _texts("calibration")


def heldout_texts() -> list[str]:
    """Held-out split (never trained or calibrated on): what the family tasks evaluate on."""
    return _texts("heldout")


def report(name: str = "default") -> dict:
    """``family.json``: sizes, corpus hashes, training settings and the figures measured after training."""
    return json.loads(_require(_checkpoints(name) / "family.json", name).read_text(encoding="utf-8"))


def load_family(device: str = "cpu", dtype=None, name: str = "default"):
    """``(source, target)`` as :class:`kvbridge.core.models.LoadedModel`, loaded like any checkpoint folder. ``name``:
    ``default`` (4-layer target, 2-layer source pruned from it), ``deep`` (8-layer target, 4-layer source
    trained on its own) or ``deep-pruned`` (the deep target, a 4-layer source pruned from it)."""
    from ..core.models import load_model

    return (load_model(source_path(name), device=device, dtype=dtype),
            load_model(target_path(name), device=device, dtype=dtype))


MAPPER = FAMILY_DIR / "mapper"
PLAIN_MAPPER = FAMILY_DIR / "mapper-plain"


def mapper_path(plain: bool = False) -> str:
    """The family's recommended mapper, shipped as a verified artifact: ``kvbridge fit``'s defaults with ``--top-k 1
    --lever-top-k 1`` on the calibration split (its ``fit_report.json`` says how long the fit took). ``plain``: the
    published card's kind of map beside it (every source layer, no levers or recompute: ``--lags 0 --lever-inputs
    same --lever-top-k 1 --mlp-hidden 0 --recompute 0``), which the demo compares with."""
    return str(_require(PLAIN_MAPPER if plain else MAPPER))


CHAT_TEMPLATE = FAMILY_DIR / "chat_template.jinja"


def chat_template_path() -> str:
    """A chat template for the family (its tokenizer has none: it was trained on code, not conversations): each
    message as a comment line naming its role, then its text."""
    return str(_require(CHAT_TEMPLATE))
