"""The embedded families' trainers, run as ``python -m kvbridge.family.training.train`` (``train_long``,
``train_deep``, ``train_pruned``); the loaders stay in :mod:`kvbridge.family`."""
