"""Background work beside an engine (kvbridge.serving.engine.idle): waiting for a quiet spell, one OpenMP thread."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def test_background_threads_wait_for_an_idle_engine_and_keep_to_one_thread():
    """Background work (the source engine writing and mapping ahead, the target prefetching) never competes with the
    engine's own steps: a piece of it waits until no step ran for IDLE_S (at most DEFER_S after it was queued, not
    at all once its queue backs up), and the threads' torch work runs on one OpenMP thread of their own, leaving the
    engine's setting as it was."""
    import threading

    from kvbridge.serving.engine import idle

    clock = idle.StepClock()
    calm = lambda: False  # noqa: E731  (no backlog)
    start = time.monotonic()
    clock.wait(start, calm)
    assert time.monotonic() - start < 0.5  # idle: at once (not after a step, nor DEFER_S later)
    clock.begin()
    start = time.monotonic()  # before the timer starts: on a loaded machine the gap between them was over 1 ms
    threading.Timer(0.15, clock.end).start()
    clock.wait(start, calm)
    assert time.monotonic() - start >= 0.15 + idle.IDLE_S * 0.9  # after the step, and a quiet spell
    clock.begin()  # a step that does not end: the block goes DEFER_S after queueing
    start = time.monotonic()
    clock.wait(start - idle.DEFER_S + 0.1, calm)
    assert 0.09 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    clock.wait(start, lambda: True)  # its queue backs up: at once, step or not
    assert time.monotonic() - start < 0.5

    # the thread counts in a fresh interpreter: an engine built in this process earlier (the test session may hold
    # one) leaves its own OpenMP settings behind
    probe = """
import threading, torch
from kvbridge.serving.engine import idle
torch.set_num_threads(2)  # so that one thread is a change
seen = []
for limit in (True, False):  # a thread that limits itself, and one that does not
    thread = threading.Thread(target=lambda limit=limit: (limit and idle.single_threaded(),
                                                          seen.append(torch.get_num_threads())))
    thread.start()
    thread.join()
print(seen, torch.get_num_threads())
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[1, 2] 2", run.stdout


def test_a_journal_poll_backs_off_while_idle_and_returns_at_once_on_news():
    """Backoff: the low wait after a read that found something, doubling after each empty read up to the high one;
    bad bounds refused."""
    import pytest

    from kvbridge.serving.engine.idle import Backoff

    b = Backoff(0.05, 0.5)
    assert [b.next(False) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert b.next(True) == 0.05 and b.next(False) == 0.1
    with pytest.raises(ValueError):
        Backoff(0.5, 0.05)
