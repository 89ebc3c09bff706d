"""Waiting for a state, never for a time: the suite on a busy machine (CONTRIBUTING).

No test's verdict depends on how fast the machine is. A test waits for a state that the code
under test reports (a line a child process prints, a record the library logs, a thread that
ended); a limit only guards against a hang, and every such limit is generous and scaled by one
setting, ``POPTORCH_LITE_TEST_PATIENCE`` (a factor, default 1): a machine so loaded that a
limit is reached without a hang runs the suite with, say, ``POPTORCH_LITE_TEST_PATIENCE=4``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

_SETTING = "POPTORCH_LITE_TEST_PATIENCE"


def _scale() -> float:
    text = os.environ.get(_SETTING, "1")
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise RuntimeError(f"{_SETTING}={text!r}: give a factor above 0, such as 1 or 4")
    return value


SCALE = _scale()


def limit(seconds: float) -> float:
    """``seconds`` scaled by ``POPTORCH_LITE_TEST_PATIENCE``: how long to wait before a wait is
    called a hang."""
    return seconds * SCALE


# A watchdog that a test fires on purpose, with an action it holds: long beside any action of a
# loaded machine, so that it only fires at the action the test holds.
WATCHDOG_S = limit(2.0)


def hung(what: str, seconds: float) -> str:
    """The message of a wait that reached its limit."""
    return (f"{what}: not reached within {limit(seconds):.0f} s, which only a hang should take "
            f"(on a machine this slow, set {_SETTING} above {SCALE:g})")


def wait_until(condition, seconds: float, what: str) -> None:
    """Poll ``condition`` until it holds; AssertionError after ``limit(seconds)``."""
    deadline = time.monotonic() + limit(seconds)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(hung(what, seconds))
        time.sleep(0.005)


class _CallerStopped(logging.Handler):
    """Set when the library logs that a Ctrl-C stopped a run's streams ([Note: Ctrl-C during a
    run] in ``runtime/placement``)."""

    def __init__(self):
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Ctrl-C: every stream stops"):
            self.event.set()


def interrupt_caller() -> None:
    """Ctrl-C (a SIGINT to the main thread) sent from inside an action, at the point the test
    chose. On the main thread (a run it executes itself) Python raises KeyboardInterrupt here
    and now. On a stream's worker thread, returns only once the caller has reported that it
    stopped the streams, so the interrupt lands in this action whatever the machine's load."""
    main = threading.main_thread()
    if threading.current_thread() is main:
        signal.pthread_kill(main.ident, signal.SIGINT)  # raises before it returns
        raise AssertionError(f"SIGINT on the main thread did not raise KeyboardInterrupt (its "
                             f"handler: {signal.getsignal(signal.SIGINT)!r})")
    stopped = _CallerStopped()
    logger = logging.getLogger("poptorch_lite")
    logger.addHandler(stopped)
    try:
        signal.pthread_kill(main.ident, signal.SIGINT)
        if not stopped.event.wait(limit(120)):
            raise AssertionError(hung("the caller's report that Ctrl-C stopped the streams", 120))
    finally:
        logger.removeHandler(stopped)
