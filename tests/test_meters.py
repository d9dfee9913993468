"""The one throughput meter (runtime/meters.py) the broker's planes share."""

from __future__ import annotations

import pytest

from primerl.runtime.meters import RateMeter


def test_rates_are_events_and_bytes_over_the_window_and_old_events_fall_out():
    meter = RateMeter(window_s=10.0, bucket_s=0.5)
    start_s = meter._started_s
    for offset_s in (0.0, 0.1, 1.0, 2.0):  # the first two share a bucket
        meter.add(100, start_s + offset_s)
    assert meter.rates(start_s + 10.0) == pytest.approx((4 / 10.0, 400 / 10.0))
    # 10.5 s later the first bucket (and both its events) is out of the window; 11.5 s later all but the last.
    assert meter.rates(start_s + 10.5) == pytest.approx((2 / 10.0, 200 / 10.0))
    assert meter.bytes_per_s(start_s + 11.5) == pytest.approx(100 / 10.0)
    assert meter.rates(start_s + 30.0) == (0.0, 0.0)
    assert meter.total_events == 4 and meter.total_bytes == 400  # totals never fall out


def test_a_young_meter_divides_by_its_age_but_never_by_less_than_one_bucket():
    meter = RateMeter(window_s=10.0, bucket_s=0.25)
    start_s = meter._started_s
    meter.add(1000, start_s)
    assert meter.bytes_per_s(start_s + 2.0) == pytest.approx(500.0)
    assert meter.bytes_per_s(start_s + 0.001) == pytest.approx(4000.0)


def test_memory_is_bounded_by_the_window_not_the_traffic():
    meter = RateMeter(window_s=1.0, bucket_s=0.25)
    start_s = meter._started_s
    for index in range(10_000):
        meter.add(1, start_s + index * 0.001)
    assert len(meter._buckets) <= 5 and meter.total_events == 10_000


def test_bad_windows_are_refused():
    with pytest.raises(ValueError):
        RateMeter(window_s=0.0)
    with pytest.raises(ValueError):
        RateMeter(window_s=1.0, bucket_s=2.0)
