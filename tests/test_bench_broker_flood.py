"""The pure helpers of bench/broker_flood.py (the flood itself runs under `make bench`)."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("broker_flood", Path(__file__).resolve().parents[1] / "bench" / "broker_flood.py")
broker_flood = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(broker_flood)


def test_producers_together_offer_more_batches_than_the_queue_holds():
    for queue_batches in (1, 8, 64):
        for num_producers in (1, 4, 16):
            distinct = broker_flood.distinct_batches(queue_batches, num_producers)
            assert distinct >= 2
            assert distinct * num_producers > queue_batches


def test_per_connection_term_grows_with_producers():
    assert broker_flood.per_connection_mib(1, 4, 32) == 160
    assert broker_flood.per_connection_mib(16, 4, 32) == 16 * 160
