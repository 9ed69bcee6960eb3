"""How a child process ended, in words (for the errors that name a dead worker or engine core)."""
from __future__ import annotations

import signal


def describe_exit(code: int | None) -> str:
    """A multiprocessing exitcode as text: "still running", "killed by signal SIGKILL", "exit code 1"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
