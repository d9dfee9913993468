"""Several hosts on one machine (issue 17, point 3): the four daemons as separate processes on seven "hosts"
(network namespaces joined by a bridge, else the loopback addresses 127.0.0.2...; ``support.netns``), each with its
own config files, in the scenario of ``support.multihost``: broker + orchestrator on a, two trainer ranks under
torchrun on b and c (c10d rendezvous across them), inference workers on d and e; d is stopped after step 1 (SIGTERM
on the plain wire, SIGKILL on the encrypted one) and a worker on f joins; `primerl status` runs on g. Plain (run
token) and encrypted (mutual TLS + CURVE, from `primerl certs`).

Passes when the run reaches max_steps with every step trained once, every worker up at the end serves the final
policy version (in the broker's status and in its own Prometheus metrics), host g's `primerl status` lists d as
not alive and e and f as alive, the orchestrator logged d leaving (and f joining and used it, when f was up with
steps to go), and its retried-rollout count matches the groups it logged as retried. `make multihost` runs the same
scenario and prints the figures."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def hosts():
    from support.netns import Hosts

    with Hosts.create(["a", "b", "c", "d", "e", "f", "g"]) as made:
        yield made


# d leaves cleanly (SIGTERM: it finishes its requests and deregisters) on the plain wire, and vanishes mid-request
# (SIGKILL: the broker declares it lost, its requests fail and their groups are retried elsewhere) on the encrypted one
@pytest.mark.parametrize(("wire", "stop_signal"), [("plain", "TERM"), ("encrypted", "KILL")])
def test_a_run_across_hosts_survives_a_worker_leaving_and_one_joining(
    hosts, tiny_model: Path, tmp_path: Path, wire: str, stop_signal: str
):
    from support.multihost import MultihostRun

    run = MultihostRun(
        hosts,
        tmp_path / "run",
        tiny_model,
        max_steps=32,
        encrypted=wire == "encrypted",
        stop_signal=stop_signal,
        timeout_s=480.0,
    )
    report = run.run()
    print("\n" + report.summary())
    problems = report.problems()
    assert not problems, "\n".join(problems) + f"\n\nlogs in {tmp_path / 'run' / 'logs'}"
