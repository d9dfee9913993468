"""Fault injection, tests and ``make chaos`` only: a process whose wall clock reads hours away from its hosts'.

``PRIMERL_FAULT_CLOCK_OFFSET_S=<seconds>`` (negative: behind) in a daemon's environment makes ``apply_clock_offset``
shift ``time.time`` and ``time.time_ns`` of that process by that much, as a host with a skewed clock would (the
monotonic clocks, which every timeout here reads, are untouched, as they are on such a host). The trainer applies it
first thing and logs ``fault injection: this process's wall clock is offset``. What it proves: nothing that orders a
run (the policy lineage, step commits, liveness) reads a wall clock, so a trainer restarted on a host whose clock is
hours behind or ahead goes on as any restarted trainer (``make chaos``, kind ``trainer-clock``).

    offset_s = apply_clock_offset()   # None when unset
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

CLOCK_OFFSET_ENV = "PRIMERL_FAULT_CLOCK_OFFSET_S"

_REAL_TIME = time.time
_REAL_TIME_NS = time.time_ns


def apply_clock_offset(environ: Mapping[str, str] = os.environ) -> float | None:
    """Shift this process's wall clock by ``$PRIMERL_FAULT_CLOCK_OFFSET_S`` seconds; the offset, or None when it is
    unset (the clock is then the host's). Applying it again replaces the offset. A value that is not a number is a
    ``ValueError`` that says how to fix it."""
    raw = environ.get(CLOCK_OFFSET_ENV, "").strip()
    if not raw:
        return None
    try:
        offset_s = float(raw)
    except ValueError:
        raise ValueError(
            f"{CLOCK_OFFSET_ENV}={raw!r} is not a number of seconds (e.g. -21600 for a clock 6 h behind); it is a "
            "fault injection for tests: unset it"
        ) from None
    offset_ns = round(offset_s * 1e9)
    time.time = lambda: _REAL_TIME() + offset_s
    time.time_ns = lambda: _REAL_TIME_NS() + offset_ns
    return offset_s


__all__ = ["CLOCK_OFFSET_ENV", "apply_clock_offset"]
