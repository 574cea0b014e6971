"""kvbridge's version: a leaf module, so the code that records it (artifacts, cards, the CLI) imports nothing else."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
