"""`bench/pyspy_summary.py` on a small raw (collapsed) py-spy recording: leaf shares, phases, and the
`--active` / `--inclusive` views used to find where a request's CPU goes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "pyspy_summary.py"

RAW = "\n".join(
    [
        "main (w.py:1);loop (w.py:2);post (c.py:3);build_url (c.py:4) 30",
        "main (w.py:1);loop (w.py:2);post (c.py:3);send (c.py:5) 20",
        "main (w.py:1);loop (w.py:2);score (s.py:9) 10",
        "main (w.py:1);loop (w.py:2);poll (sel.py:1) 100",
        "thread (t.py:1);Condition.wait (threading.py:2) 50",
        "main (w.py:1);0x7f00deadbeef 40",
        "",
    ]
)


def _summary() -> object:
    spec = importlib.util.spec_from_file_location("pyspy_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    recording = tmp_path / "worker.txt"
    recording.write_text(RAW)
    assert _summary().main([str(recording), *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_leaf_shares_count_every_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, capsys)
    assert "250 samples (2.5 s at 100 Hz)" in out[0]
    assert out[1].split() == ["40.0%", "poll"]


def test_active_drops_waiting_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, capsys, "--active")
    assert "60 samples of running threads" in out[0]
    assert [line.split()[1] for line in out[1:]] == ["build_url", "send", "score"]


def test_inclusive_ranks_callers_by_the_samples_under_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, capsys, "--active", "--inclusive", "--rate", "10")
    assert "(6.0 s at 10 Hz)" in out[0]
    shares = {line.split()[1]: line.split()[0] for line in out[1:]}
    assert shares == {
        "main": "100.0%",
        "loop": "100.0%",
        "post": "83.3%",
        "build_url": "50.0%",
        "send": "33.3%",
        "score": "16.7%",
    }


def test_phases_under_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, capsys, "--root", "loop", "--phase", "post", "--phase", "score")
    assert "160 samples under loop" in out[0]
    assert [line.split(None, 1)[1] for line in out[1:]] == ["other: poll", "post", "score"]
