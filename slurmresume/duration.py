"""Human durations: parse "90s", "30m", "2h", "1d", "1w", "1h30m", "1.5h" and print them back.

`parse_duration` is strict: a malformed, negative or non-finite value is a ConfigError naming
the value and the valid forms, so a typo in `--remove-incomplete-older-than` never deletes.
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

__all__ = ["parse_duration", "format_duration", "UNITS"]

UNITS: dict[str, float] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_WHOLE = re.compile(r"^(?:\d+(?:\.\d+)?[smhdw])+$")
_FORMS = "a number with a unit: 90s, 30m, 2h, 1d, 1w, or combined like 1h30m"


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds in `text`. A bare number means seconds ("600" = 600 s). Units are case-insensitive.

    Raises ConfigError for anything else: empty, negative ("-1h"), unknown unit ("3y"),
    non-finite, or trailing junk. `what` names the option in the message.
    """
    raw = text
    text = text.strip().lower().replace(" ", "")
    if text.startswith("-"):
        raise ConfigError(f"{what} {raw!r} is negative: durations must be >= 0 ({_FORMS})")
    try:
        if text and text.replace(".", "", 1).isdigit():
            return _finite(float(text), raw, what)
    except ValueError:
        pass
    if not _WHOLE.match(text):
        raise ConfigError(f"{what} {raw!r} is not a duration: use {_FORMS}")
    total = sum(float(n) * UNITS[u] for n, u in _PART.findall(text))
    return _finite(total, raw, what)


def _finite(value: float, raw: str, what: str) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"{what} {raw!r} is not finite: use {_FORMS}")
    return value


def format_duration(seconds: float) -> str:
    """A short, rounded rendering: 42s, 5m 3s, 2h 5m, 3d 4h. Negative clamps to 0s."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m" if s % 3600 >= 60 else f"{s // 3600}h"
    return f"{s // 86400}d {s % 86400 // 3600}h" if s % 86400 >= 3600 else f"{s // 86400}d"
