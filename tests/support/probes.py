"""Small probes tests use to look at a running system: a free loopback port, waiting until a condition holds,
scraping a Prometheus endpoint."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Scraped samples by (sample name, sorted label pairs)."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for a process that must be told its port up front)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 5.0, what: str = "the condition", interval_s: float = 0.02
) -> T:
    """Call `predicate` until it returns something truthy and return that; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
    return value


def parse_metrics(text: str) -> Samples:
    """Prometheus text exposition -> {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_metrics(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Samples:
    """GET a /metrics URL and parse it (`parse_metrics`)."""
    import httpx

    return parse_metrics(httpx.get(url, headers=headers, timeout=timeout_s).text)
