"""A broker restart under a thundering herd: a real `primerl-broker` process with 200 simulated inference workers,
trainer ranks and orchestrators registered (`support.fleet`: the project's own clients) and a run in progress is
SIGKILLed and restarted on the same ports and spool (weights in relay chains). Every worker registers again by
itself (the `ControlClient` heartbeat thread's retry and re-registration path), none is marked LOST after the
recovery, none needed more than one re-registration, the broker's memory stays bounded, and the run's next step is
committed and its policy acknowledged by every worker."""

from __future__ import annotations

import time

from support.fleet import Fleet, FleetBroker, RunDriver, fleet_members

NUM_INFERENCE = 200
NUM_TRAINER_RANKS = 4
NUM_ORCHESTRATORS = 2
REGISTERED_WITHIN_S = 30.0
MAX_BROKER_RSS_BYTES = 400 * 2**20
ACKED_WITHIN_S = 10.0
LIVENESS = 5  # the broker's default heartbeat_liveness


def test_a_restarted_broker_takes_back_the_whole_fleet(tmp_path):
    broker = FleetBroker(tmp_path, "--weight-fanout", "chain", heartbeat_interval_s=0.5)
    members = fleet_members(NUM_INFERENCE, NUM_TRAINER_RANKS, NUM_ORCHESTRATORS)
    inference = {member.name for member in members if member.role == "inference"}
    fleet = Fleet(members, 2, address=broker.address, run_token=broker.run_token, relay=True, start_spread_s=2.0)
    driver = RunDriver(broker, NUM_TRAINER_RANKS)
    try:
        assert driver.wait_registered(fleet, len(members) + 1, 60) is not None, broker.log_tail()
        assert driver.take_step(fleet, inference) is not None, "step 1 was not acknowledged by every worker"

        broker.kill()  # the run is in progress: step 1 committed, policy 1 everywhere
        killed = time.monotonic()
        broker.start()
        took_s = driver.wait_registered(fleet, len(members) + 1, REGISTERED_WITHIN_S)
        assert took_s is not None, f"{driver.num_alive()} of {len(members) + 1} back within {REGISTERED_WITHIN_S} s"
        recovered_unix_s = time.time()
        print(f"fleet of {len(members) + 1} registered again {time.monotonic() - killed:.1f} s after the SIGKILL")

        time.sleep(2 * LIVENESS * broker.heartbeat_interval_s)  # twice the silence that marks a worker LOST
        assert driver.lost_events(recovered_unix_s) == []
        assert broker.rss_bytes() < MAX_BROKER_RSS_BYTES
        acked_s = driver.take_step(fleet, inference)
        print(f"step 2 acknowledged by all {NUM_INFERENCE} inference workers {acked_s} s after its publish")
        # well within the relay timeout (20 s): no chain waits on an old id a subscriber said HELLO with
        assert acked_s is not None and acked_s < ACKED_WITHIN_S, "step 2 was not acknowledged by every worker"
        assert driver.num_alive() == len(members) + 1
        fleet.drain(1.0)
        assert sorted(set(fleet.registrations.values())) == [2], "each member registers once more, no more"
        assert not fleet.errors
    finally:
        driver.close()
        fleet.close()
        broker.stop()
