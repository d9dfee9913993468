"""primerl-infer's HTTP process freezes the collector's heap once serving (`inference.server.freeze_started_heap`),
unless `PRIMERL_INFER_GC_FREEZE=0`. Run in a child interpreter: freezing the test runner's own heap would change
every test after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = (
    "import gc, json; from primerl.inference.server import freeze_started_heap; "
    "before = gc.get_freeze_count(); froze = freeze_started_heap(); "
    "print(json.dumps({'before': before, 'froze': froze, 'after': gc.get_freeze_count()}))"
)


@pytest.mark.parametrize("setting", [None, "1", "0"])
def test_freeze_started_heap_follows_the_variable(setting: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PRIMERL_INFER_GC_FREEZE"}
    if setting is not None:
        env["PRIMERL_INFER_GC_FREEZE"] = setting
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["before"] == 0
    if setting == "0":
        assert result == {"before": 0, "froze": False, "after": 0}
    else:
        assert result["froze"] is True and result["after"] > 1000  # everything imported so far
