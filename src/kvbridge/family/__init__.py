"""The embedded default family: two small Ministral3 models trained by this project, shipped with the package.

``target`` (4 layers, 256 wide) and ``source`` (2 layers, 160 wide, pruned from the target and
distilled) share one byte-level BPE tokenizer and were trained on the CPython standard library's
source (PSF License 2.0) by :mod:`kvbridge.family.train`. They load through exactly the same
transformers code path as hub checkpoints, so every command works on them with no network.
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


def _require(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(
            f"the embedded family file {path} is missing from this installation; reinstall kvbridge "
            "(`pip install -e .` from a full clone), or retrain it with `python -m kvbridge.family.train`."
        )
    return path


def source_path() -> str:
    return str(_require(SOURCE))


def target_path() -> str:
    return str(_require(TARGET))


def _texts(split: str) -> list[str]:
    with open(_require(DATA / f"{split}.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def calibration_texts() -> list[str]:
    """Calibration split (never trained on): what ``kvbridge demo`` fits its mapper on."""
    return _texts("calibration")


def heldout_texts() -> list[str]:
    """Held-out split (never trained or calibrated on): what the family tasks evaluate on."""
    return _texts("heldout")


def report() -> dict:
    """``family.json``: sizes, corpus hashes, training settings and the figures measured after training."""
    return json.loads(_require(CHECKPOINTS / "family.json").read_text(encoding="utf-8"))


def load_family(device: str = "cpu", dtype=None):
    """``(source, target)`` as :class:`kvbridge.models.LoadedModel`, loaded like any checkpoint folder."""
    from ..models import load_model

    return load_model(source_path(), device=device, dtype=dtype), load_model(target_path(), device=device, dtype=dtype)


MAPPER = FAMILY_DIR / "mapper"


def mapper_path() -> str:
    """The family's recommended mapper, shipped as a verified artifact: ``kvbridge fit``'s defaults with ``--top-k 1
    --lever-top-k 1`` on the calibration split (its ``fit_report.json`` says how long the fit took)."""
    return str(_require(MAPPER))


CHAT_TEMPLATE = FAMILY_DIR / "chat_template.jinja"


def chat_template_path() -> str:
    """A chat template for the family (its tokenizer has none: it was trained on code, not conversations): each
    message as a comment line naming its role, then its text."""
    return str(_require(CHAT_TEMPLATE))
