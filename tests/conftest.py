"""Fixtures shared by the test modules; the helpers they use live in tests/support/ (see its docstring).

- `tiny_model`, `small_tiny_model`: the tiny model in its two shapes (`support.tiny_models`), each built once per
  session. Read-only: a test that writes into a model directory copies it first.
- `make_broker`: starts in-process brokers (`support.broker.BrokerHarness`) and stops them after the test.
- `make_weight_plane`: starts weight planes (`support.weight_plane.WeightPlaneHarness`) and closes them after.
- `infer_broker`, `infer_daemon`, `infer_http`: one broker and one `primerl-infer` on the tiny model
  per module that asks for them (`support.inference`), and an HTTP client of the daemon.
- `no_wandb_login`: a machine without a W&B login.
- `_segments_left_behind` (every test): a trainer's shared-memory segment (``/dev/shm/primerl-seg-*``) that a test
  leaves behind with its writer gone is removed and named in the session's summary, with the test that left it.

The report header names the machine (`support.numerics.cpu_description`, without importing torch): float32
results that depend on summation order (ranks, threads) differ between CPUs, so every log says which one ran; the
numerics tests add torch's kernel level and thread counts to their messages (`machine_description`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported in the fixtures: collecting a module that needs none of them stays light
    import httpx
    from support.broker import BrokerHarness
    from support.daemons import InferenceDaemon
    from support.weight_plane import WeightPlaneHarness


def pytest_report_header(config: pytest.Config) -> str:
    from support.numerics import cpu_description

    return f"machine: {cpu_description()}"


_LEFT_SEGMENTS: list[tuple[str, str]] = []
"""(test id, segment name) of the segments tests left behind (`_segments_left_behind`)."""


@pytest.fixture(autouse=True)
def _segments_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    from primerl.proto.shared_segment import SEGMENT_PREFIX, segment_directory, stale_segments

    directory = segment_directory()
    before = {path.name for path in directory.glob(f"{SEGMENT_PREFIX}*")}
    yield
    stale = {path.name for path in stale_segments(directory)}
    own = f"-{os.getpid()}-"  # a publisher of this process the test did not close
    for path in directory.glob(f"{SEGMENT_PREFIX}*"):
        if path.name not in before and (path.name in stale or own in path.name):
            _LEFT_SEGMENTS.append((request.node.nodeid, path.name))
            if path.name in stale:
                path.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LEFT_SEGMENTS:
        terminalreporter.section("shared-memory segments left behind (removed)")
        for nodeid, name in _LEFT_SEGMENTS:
            terminalreporter.write_line(f"{nodeid}: {name}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo-shaped tiny model (`DEFAULT_SPEC`), in a directory named `tiny`."""
    from support.tiny_models import DEFAULT_SPEC

    from primerl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", DEFAULT_SPEC)


@pytest.fixture(scope="session")
def small_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-layer tiny model (`SMALL_SPEC`), in a directory named `model`."""
    from support.tiny_models import SMALL_SPEC

    from primerl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small-tiny") / "model", SMALL_SPEC)


@pytest.fixture
def make_broker(tmp_path: Path) -> Iterator[Callable[..., BrokerHarness]]:
    """`make_broker(spool_dir=None, **BrokerConfig fields)`: a running in-process broker on loopback ports; the
    first one spools to tmp_path/spool unless told otherwise. Every broker started is stopped after the test."""
    from support.broker import BrokerHarness

    started: list[BrokerHarness] = []

    def start(spool_dir: Path | None = None, **fields: Any) -> BrokerHarness:
        default = tmp_path / ("spool" if not started else f"spool-{len(started)}")
        started.append(BrokerHarness(spool_dir or default, **fields))
        return started[-1]

    try:
        yield start
    finally:
        for harness in reversed(started):
            harness.stop()


@pytest.fixture
def make_weight_plane() -> Iterator[Callable[..., WeightPlaneHarness]]:
    """`make_weight_plane(**WeightPlane keyword arguments)`: a started weight plane on loopback; every one made
    is closed after the test."""
    from support.weight_plane import WeightPlaneHarness

    created: list[WeightPlaneHarness] = []

    def make(**plane_kwargs: Any) -> WeightPlaneHarness:
        created.append(WeightPlaneHarness(**plane_kwargs))
        return created[-1]

    try:
        yield make
    finally:
        for harness in created:
            harness.close()


@pytest.fixture(scope="module")
def infer_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerHarness]:
    """The inference tests' broker (`support.inference.start_broker`), one per module."""
    from support.inference import start_broker

    broker = start_broker(tmp_path_factory.mktemp("spool"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def infer_daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, infer_broker: BrokerHarness
) -> Iterator[InferenceDaemon]:
    """`primerl-infer` on `tiny_model` joined to `infer_broker` (`support.inference.start_daemon`), one per
    module: starting vLLM's server takes ~20-45 s on 2 cores."""
    import time

    from support.inference import start_daemon

    daemon = start_daemon(tmp_path_factory.mktemp("infer"), tiny_model, infer_broker)
    print(f"\nprimerl-infer ready in {daemon.start_s:.1f} s at {daemon.url}")
    try:
        yield daemon
    finally:
        stop_start_s = time.monotonic()
        code = daemon.stop()
        print(f"primerl-infer stopped in {time.monotonic() - stop_start_s:.1f} s with exit code {code}")


@pytest.fixture(scope="module")
def infer_http(infer_daemon: InferenceDaemon) -> Iterator[httpx.Client]:
    """An HTTP client of `infer_daemon` (the run token is not set: pass `support.inference.AUTH`)."""
    import httpx

    with httpx.Client(base_url=infer_daemon.url, timeout=60.0) as client:
        yield client


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch) -> Path:
    """A machine without a W&B login: no key in the environment, an empty home (no ~/.netrc, no settings)."""
    home = tmp_path / "home"
    home.mkdir()
    for variable in (
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_MODE",
        "NETRC",
        "WANDB_CONFIG_DIR",
        "WANDB_BASE_URL",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(home))
    return home
