"""Measurements: benchmarks, evaluation (lm-eval included), diagnosis, the frontier, the fit's plan, the demo."""
