"""On/off switches read from the environment (for A/B runs of engine features)."""
from __future__ import annotations

import os


def env_switch(name: str) -> bool:
    """An on-by-default switch: unset or "1" is on, "0" off, anything else an error naming the variable."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
