"""SIGTERM and SIGINT during training: finish the step, save, stop cleanly.

For: turning the first SIGTERM (a scheduler preempting the job) or SIGINT (Ctrl-C) into a request the
trainer honours at the next step boundary (checkpoint, summary, exit status 128 + the signal number).
A second signal interrupts at once (KeyboardInterrupt), for a user who cannot wait for the step.
Never: stop in the middle of a step (an in-backward update cannot be taken back), install handlers
unless asked (`enabled`: the command line asks; a library caller keeps its own), or outside the main
thread (Python allows them only there; elsewhere it does nothing).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)


class SecondSignal(KeyboardInterrupt):
    """A second SIGTERM/SIGINT arrived before the step ended: stopping now, without a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint")
        self.signum = signum


class StopSignals:
    """Context manager: while active, SIGTERM/SIGINT set `requested` instead of killing the process."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second signal: do not wait for the step to end
            raise SecondSignal(signum)
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
