"""The pure helpers of bench/broker_flood.py (the flood itself runs under `make bench`)."""

from support.bench import load_bench_module

broker_flood = load_bench_module("broker_flood")


def test_producers_together_offer_more_batches_than_the_queue_holds():
    for queue_batches in (1, 8, 64):
        for num_producers in (1, 4, 16):
            distinct = broker_flood.distinct_batches(queue_batches, num_producers)
            assert distinct >= 2
            assert distinct * num_producers > queue_batches


def test_per_connection_term_grows_with_producers():
    assert broker_flood.per_connection_mib(1, 4, 32) == 160
    assert broker_flood.per_connection_mib(16, 4, 32) == 16 * 160
