"""Number formatting shared by the reports, the plan and the forecast: tokens, dollars, durations, bytes.

Every table and log line that shows one of these quantities goes through this module, so the same number
reads the same everywhere (e.g. dollars: cents from $1 up, a few significant digits below).
"""

from __future__ import annotations

import math


def human_tokens(n: int) -> str:
    """``17,012,345 -> "17.0M"``; below a million the exact count with thousands separators."""
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n:,}"


def format_hours(hours: float, digits: int = 1) -> str:
    """A duration given in hours, in seconds, minutes or hours, whichever keeps it >= 1 (``0.006 -> "21.6 s"``);
    ``digits`` decimals for hours (seconds and minutes get one)."""
    s = hours * 3600
    if s < 60:
        return f"{s:,.1f} s"
    if s < 3600:
        return f"{s / 60:,.1f} min"
    return f"{hours:,.{digits}f} h"


def format_usd(v: float, significant: int = 2) -> str:
    """Dollars (no ``$``) with the precision that keeps them meaningful, the same in every table: cents from $1
    up (``1,234.50``), ``significant`` significant digits below and at least two decimals (``significant=2``:
    ``0.50``, ``0.0012``, ``0.00023``; ``significant=4``: ``0.01656``), ``0.00`` for zero."""
    if not v:
        return "0.00"
    if abs(v) >= 1:
        return f"{v:,.2f}"
    return f"{v:.{max(2, significant - 1 - math.floor(math.log10(abs(v))))}f}"


def dollars(v: float | None) -> str:
    """Dollars for a log line: ``$`` + cents from $1 up, 4 significant digits below (``0.0165607 -> "$0.01656"``);
    ``"unknown"`` for None."""
    return "unknown" if v is None else f"${format_usd(v, significant=4)}"


def format_duration(seconds: int) -> str:
    """A bucket width in whole hours or minutes: ``3600 -> "1 h"``, ``300 -> "5 min"``."""
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    return f"{seconds // 60} min"


def format_clock(seconds: float) -> str:
    """Elapsed time as a clock: ``75 -> "1:15"``, ``3725 -> "1:02:05"`` (rounded to the second)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_bytes(x: float) -> str:
    """Bytes in the largest decimal unit that keeps the number >= 1, with the binary unit beside it:
    ``43_800_000 -> "43.80 MB (41.77 MiB)"``, ``512 -> "512 B"``."""
    k = 0
    while k < 4 and abs(x) >= 1000 ** (k + 1):
        k += 1
    if k == 0:
        return f"{x:,.0f} B"
    j = 0
    while j < 4 and abs(x) >= 1024 ** (j + 1):
        j += 1
    return f"{x / 1000**k:,.2f} {'B KB MB GB TB'.split()[k]} ({x / 1024**j:,.2f} {'B KiB MiB GiB TiB'.split()[j]})"
