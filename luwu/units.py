"""How LuWu writes sizes and durations for people: one family for every command.

Sizes are decimal (kB, MB, GB: powers of 1000), the family of link speeds in
Gbit/s, so that a size per second and a link speed compare at a glance.
"""

from __future__ import annotations

import math

_SIZE_UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'``: decimal units, one decimal (bytes as a whole number)."""
    for unit in _SIZE_UNITS:
        if abs(n) < 1000 or unit == _SIZE_UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    """``185`` -> ``'3m05s'``: the two largest units; '-' for a duration that is not a number."""
    if not math.isfinite(s):
        return "-"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s // 60:.0f}m{s % 60:02.0f}s"
    if s < 86400:
        return f"{s // 3600:.0f}h{s % 3600 // 60:02.0f}m"
    return f"{s // 86400:.0f}d{s % 86400 // 3600:02.0f}h"
