"""Peak resident memory of other processes over a measured interval (Linux ``/proc``), for bench part e.

    peaks = PeakRss({"broker": [broker_pid], "worker": [daemon_pid, *descendants(daemon_pid)]})
    peaks.start()          # resets each process's peak (VmHWM), or starts sampling VmRSS every 5 ms
    ...                    # the update
    peaks.stop()           # -> {"broker": bytes, "worker": bytes}

The peak is the kernel's own: writing ``5`` to ``/proc/PID/clear_refs`` resets ``VmHWM`` to the current RSS, so
``VmHWM`` read after the interval is that interval's peak, with nothing missed between samples. Where that file
cannot be written (another user's process, an old kernel), a thread samples ``VmRSS`` every ``SAMPLE_S`` instead
and the peak may miss a short spike. A group's figure is the sum of its processes' peaks: pages shared between them
(the payload's shared-memory file, mapped by the daemon and its engine core) count once per process.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

SAMPLE_S = 0.005
KIB = 1024


def descendants(pid: int) -> list[int]:
    """Every live process whose chain of parents leads to ``pid`` (not ``pid`` itself)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in bytes; None when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * KIB
    except (OSError, ValueError):
        return None
    return None


def reset_peak(pid: int) -> bool:
    """Reset ``VmHWM`` of ``pid`` to its current RSS; False when the kernel does not let this process do it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """The peak RSS of groups of processes over one interval (see the module docstring)."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups
        self.sampled = False  # True: VmRSS was sampled (a process's VmHWM could not be reset)
        self._samples: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        pids = [pid for group in self.groups.values() for pid in group]
        self.sampled = not all(reset_peak(pid) for pid in pids)
        self._samples = {pid: status_bytes(pid, "VmRSS") or 0 for pid in pids}
        if self.sampled:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, args=(pids,), name="peak-rss", daemon=True)
            self._thread.start()

    def _sample(self, pids: list[int]) -> None:
        while not self._stop.wait(SAMPLE_S):
            for pid in pids:
                self._samples[pid] = max(self._samples[pid], status_bytes(pid, "VmRSS") or 0)

    def stop(self) -> dict[str, int]:
        """Bytes per group: the sum of its processes' peaks since ``start``."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(1.0)
            self._thread = None
        peaks = {}
        for name, pids in self.groups.items():
            total = 0
            for pid in pids:
                value = self._samples[pid] if self.sampled else status_bytes(pid, "VmHWM")
                total += value or 0
            peaks[name] = total
        return peaks


def current_rss(pids: list[int]) -> int:
    return sum(status_bytes(pid, "VmRSS") or 0 for pid in pids)


def pid_exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")
