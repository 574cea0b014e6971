"""Background work beside a vLLM engine: wait until its steps leave a quiet spell, and stay off its cores.

Both engines of a cascade run threads of their own beside the engine's steps — the source's writes its KV to the
store and maps it ahead, the target's prefetches what was mapped ahead into memory. Their Python holds the
interpreter's lock the engine's steps need and their torch threads share its cores (on a 2-core CPU, writing and
mapping as the source decoded doubled its answer times). So a piece of background work waits for ``IDLE_S`` without
a step, at most ``DEFER_S`` (under a steady load it runs anyway: at the engine's pace, a little late), and not at all
once its queue backs up; and its torch work runs on one OpenMP thread of its own.
"""

from __future__ import annotations

import time

import torch

IDLE_S = 0.02
DEFER_S = 2.0


def single_threaded() -> None:
    """This thread's torch work on one OpenMP thread (the calling thread's own setting; ``torch.set_num_threads``
    would change the engine's too): a background thread's parallel regions must not take the engine's cores."""
    import ctypes

    torch.get_num_threads()  # torch's first call in a thread sets the thread's OpenMP count to its global one
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (AttributeError, OSError):  # no OpenMP runtime in the process: nothing to limit
        pass


class StepClock:
    """When the engine's steps run: a connector marks each step's start (``bind_connector_metadata``) and end
    (``wait_for_save``); background threads :meth:`wait` for a quiet spell."""

    def __init__(self):
        # (a step is running, time.monotonic() of the last step's start or end): one assignment, so that a
        # background thread never reads one half of a step's start with the other half of its end
        self.mark = (False, 0.0)

    def begin(self) -> None:
        self.mark = (True, time.monotonic())

    def end(self) -> None:
        self.mark = (False, time.monotonic())

    def wait(self, since: float, backlog=lambda: False) -> None:
        """Return once the engine has run no step for ``IDLE_S``, ``DEFER_S`` after ``since``, or as soon as
        ``backlog()`` is true (before each piece of background work: the engine's own requests come first, but a
        queue must not overflow)."""
        while not backlog():
            in_step, mark = self.mark
            now = time.monotonic()
            left = DEFER_S - (now - since)
            if left <= 0 or (not in_step and now - mark >= IDLE_S):
                return
            time.sleep(min(IDLE_S if in_step else max(IDLE_S - (now - mark), 0.002), left))


class Backoff:
    """A journal poll's waits: ``low`` seconds after a read that found something, doubling after each read that
    found nothing, up to ``high``. An idle server reads its journals ``1 / high`` times a second, not ``1 / low``;
    the first announcement after a quiet spell waits at most ``high``."""

    def __init__(self, low: float, high: float):
        if not 0 < low <= high:
            raise ValueError(f"a backoff needs 0 < low <= high, not {low}, {high}")
        self.low, self.high, self.wait_s = low, high, low

    def next(self, found: bool) -> float:
        """The wait before the next read, after one that ``found`` something or not."""
        self.wait_s = self.low if found else min(self.high, 2 * self.wait_s)
        return self.wait_s

