"""The CPU a bench ran on, as one phrase for its RESULTS.md section (model name, vector extensions, core count)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_phrase(cpuinfo: str | None = None) -> str:
    """E.g. ``Intel(R) Xeon(R) Processor (AVX-512, AMX), 2 cores``: /proc/cpuinfo's model name and flags, and the
    CPUs this process may run on."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    extensions = [name for name, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags]
    if not extensions and "avx2" in flags:
        extensions = ["AVX2"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    vectors = f" ({', '.join(extensions)})" if extensions else ""
    return f"{model}{vectors}, {cores} cores"
