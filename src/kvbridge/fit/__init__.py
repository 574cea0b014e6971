"""Fitting a mapper: its settings (:mod:`.config`), the closed-form solve (:mod:`.closed_form`) from calibration
statistics (:mod:`.stats`), with the levers (:mod:`.levers`, :mod:`.tune`), reduced rank (:mod:`.rank`), calibration
texts (:mod:`.texts`) and several processes (:mod:`.distributed`).

``from kvbridge.fit import FitConfig, fit_mapper`` works as before the package existed: the fit's names below are the
closed form's (patch them in :mod:`kvbridge.fit.closed_form`, where the fit looks them up).
"""

from .closed_form import (
    RIDGE_SCALING,
    fit_mapper,
    heldout_r2,
    plan_levers,
    select_layers,
    single_layer_r2,
    solve,
    solve_heads,
    working_memory,
)
from .config import LEVER_INPUTS, MAX_RIDGE, MAX_WIDTH, OPTIONAL_SETTINGS, FitConfig, recorded_settings

__all__ = [
    "LEVER_INPUTS",
    "MAX_RIDGE",
    "MAX_WIDTH",
    "OPTIONAL_SETTINGS",
    "RIDGE_SCALING",
    "FitConfig",
    "fit_mapper",
    "heldout_r2",
    "plan_levers",
    "recorded_settings",
    "select_layers",
    "single_layer_r2",
    "solve",
    "solve_heads",
    "working_memory",
]
