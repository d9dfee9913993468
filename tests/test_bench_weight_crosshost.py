"""bench/weight_crosshost.py: its pure helpers, and a smoke run of the whole bench on the tiny model (network
namespaces and `tc`; skipped where they cannot be made)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench import BENCH_DIR, load_bench_module

from primerl.proto.units import GiB, MiB

crosshost = load_bench_module("weight_crosshost")

SMOKE_RATE_BPS = 100e6
SMOKE_TIMEOUT_S = 300


def test_rates_are_read_in_tc_units():
    assert crosshost.rate_bits_per_s("1gbit") == 1e9
    assert crosshost.rate_bits_per_s("10gbit") == 1e10
    assert crosshost.rate_bits_per_s("2.5mbit") == 2.5e6
    for bad in ("1gb", "fast", "1 tbit"):
        with pytest.raises(ValueError, match="kbit, mbit or gbit"):
            crosshost.rate_bits_per_s(bad)


def test_the_fan_out_cases_of_a_1b_run_do_not_fit_nine_gib_and_run_with_their_own_denominators():
    payload_1b = 1852 * MiB
    assert crosshost.anon_estimate_bytes(payload_1b, "full", 1) < 9 * GiB
    assert crosshost.anon_estimate_bytes(payload_1b, "star", 4) > 9 * GiB
    args = crosshost.parse_args(["--model", "1b"])
    args.fanout_model = "100m"
    assert crosshost.case_plan(args) == [
        ("full", "1b"),
        ("delta", "1b"),
        ("raw", "1b"),
        ("full", "100m"),
        ("star", "100m"),
        ("chain", "100m"),
        ("raw", "100m"),
    ]
    args.fanout_model = "1b"
    assert [model for _, model in crosshost.case_plan(args)] == ["1b"] * 5


def netns_or_skip() -> None:
    from support.netns import namespaces_available

    ok, why = namespaces_available()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    if shutil.which("tc") is None:
        pytest.skip("no `tc` (iproute2)")


def test_a_smoke_run_on_the_tiny_model_behind_a_real_rate_limit(tmp_path):
    """Every case through a real broker to subscriber processes on namespace hosts at 100 Mb/s: the digests check
    (the bench stops otherwise), the raw send takes about bytes x 8 / rate, the broker sends the payload once per
    worker in star mode and once in chain mode, and nothing of the run's hosts is left behind. ~30 s on 2 shared
    cores (not marked slow: under a minute)."""
    netns_or_skip()
    out = tmp_path / "results.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCH_DIR / "weight_crosshost.py"),
            "--model", "tiny", "--rates", "100mbit", "--workers", "2", "--repeats", "1", "--warmup", "0",
            "--markdown", str(tmp_path / "table.md"), "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = {(r["case"], r["model"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {(case, "tiny") for case in ("full", "delta", "star", "chain", "raw")}
    raw = results[("raw", "tiny")]
    floor_s = raw["payload_bytes"] * 8 / SMOKE_RATE_BPS
    # the limit is real: never faster than the rate (less the bucket's first burst), and not far slower
    assert 0.85 * floor_s <= raw["last_s"][0] <= 3 * floor_s, raw
    assert results[("star", "tiny")]["sent_ratio"] == pytest.approx(2.0, abs=0.01)
    assert results[("chain", "tiny")]["sent_ratio"] == pytest.approx(1.0, abs=0.01)
    assert results[("delta", "tiny")]["payload_bytes"] < 0.5 * results[("full", "tiny")]["payload_bytes"]
    table = (tmp_path / "table.md").read_text()
    assert "Cross-host weight updates under a bandwidth limit" in table and "link check (tiny)" in table
    namespaces = [line.split("(netns ")[1].split(",")[0] for line in completed.stdout.splitlines() if "(netns " in line]
    assert len(namespaces) == 4, completed.stdout[-2000:]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not [name for name in namespaces if name in left], left
    assert not Path(f"/sys/class/net/{namespaces[0][:-1]}br").exists(), "the bridge is left behind"
