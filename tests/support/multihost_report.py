"""What one multi-host run (``support.multihost``) did, and what it got wrong: ``Report`` (its ``problems()`` are
the checks of tests/test_multihost.py; ``summary()`` the figures `make multihost` prints), and predicates on a
run status as JSON (``served``, ``num_alive_inference``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

BATCH_SIZE, ROLLOUTS_PER_EXAMPLE = 64, 8


@dataclass
class Report:
    hosts: str = ""
    roles: dict[str, str] = field(default_factory=dict)  # label -> address
    max_steps: int = 0
    steps_done: list[int] = field(default_factory=list)  # rank 0's "step done" steps, in order
    sent_digests: dict[int, str] = field(default_factory=dict)  # step -> rank 0's batch digest, as sent
    trained_digests: dict[int, str] = field(default_factory=dict)  # step -> rank 0's batch digest, as trained
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    broker_status: dict = field(default_factory=dict)  # the test process's last RunStatus (JSON)
    g_status: dict = field(default_factory=dict)  # `primerl status --json` run on host g
    g_status_text: str = ""
    g_status_lines: int = 0
    workers_left: list[str] = field(default_factory=list)
    workers_joined: list[str] = field(default_factory=list)
    stopped_at_step: int = 0
    stop_signal: str = "TERM"
    d_inflight_at_stop: int = 0  # the stopped worker's requests in flight at its last heartbeat before the stop
    joined_ready_at_step: int = 0
    join_ready_s: float = 0.0  # start of the joining worker's process -> its ready file
    join_version: int = 0  # the latest policy version when the joining worker was ready
    join_serving_s: float = 0.0  # its "registered with the broker" -> "weight update live" for >= join_version
    join_seen_serving_s: float = 0.0  # its ready file -> the broker's status shows it serving join_version
    join_caught_up_s: float | None = None  # the worker's own "inference worker caught up" join_to_serving_s
    retried_events: int = 0  # "rollout group retried" (worker unreachable or gone): dispatched again
    retried_rollouts: float = 0.0  # the orchestrator's rollout/retried, summed over its metric rows
    rescheduled_events: int = 0  # "rollout group rescheduled" (the worker's request failed): sampled again
    rescheduled_rollouts: float = 0.0  # rollout/rescheduled, summed
    orchestrator_rows: int = 0
    orchestrator_saw: dict[str, list[dict]] = field(default_factory=dict)  # joined / left / serving events
    metrics: dict[str, dict] = field(default_factory=dict)  # label -> the worker's scraped metrics
    wall_s: float = 0.0
    rollouts_per_example: int = ROLLOUTS_PER_EXAMPLE
    errors: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        found = list(self.errors)
        want = list(range(1, self.max_steps + 1))
        if self.steps_done != want:
            found.append(f"the trainer's steps were {self.steps_done}, want each of {want} once")
        differ = [step for step in want if self.sent_digests.get(step) != self.trained_digests.get(step)]
        if differ:
            found.append(
                f"steps {differ[:10]}: the trainer trained other data than the orchestrator sent (rank 0's data_digest)"
            )
        for label, code in self.exit_codes.items():
            if code not in (0, None):
                found.append(f"{label} exited {code}")
        status = self.g_status
        if int(status.get("last_committed_step", 0)) != self.max_steps:
            found.append(f"broker: last committed step {status.get('last_committed_step')} != {self.max_steps}")
        if int(status.get("latest_policy_version", 0)) != self.max_steps:
            found.append(f"broker: latest policy version {status.get('latest_policy_version')} != {self.max_steps}")
        for queue in status.get("queues", []):
            if queue.get("name") == "rollouts" and int(queue.get("num_items", 0)):
                found.append(f"broker: {queue.get('num_items')} rollout batches still spooled after the last step")
        if int(status.get("num_rollbacks", 0)):
            found.append(f"broker: {status.get('num_rollbacks')} rollbacks")
        infer = {w.get("address"): w for w in status.get("workers", []) if w.get("role") == "ROLE_INFERENCE"}
        for url in self.workers_left:
            state = infer.get(url, {}).get("state", "absent")
            if state == "WORKER_STATE_ALIVE":
                found.append(f"primerl status lists the stopped worker {url} as alive")
        for url, worker in infer.items():
            if worker.get("state") == "WORKER_STATE_ALIVE" and int(worker.get("policy_version", -1)) != self.max_steps:
                found.append(f"worker {url} serves v{worker.get('policy_version')}, not the final v{self.max_steps}")
        for label, values in self.metrics.items():
            if label == "infer@f" and not self.joined_mid_run:
                continue
            if values.get("policy_version") != self.max_steps:
                found.append(f"{label}: primerl_inference_policy_version {values.get('policy_version')}")
        joined = self.workers_joined if self.joined_mid_run else []  # else it was told to stop as it came up
        for url in joined + [
            u for u in self.roles.values() if u.startswith("http") and u not in self.workers_left + self.workers_joined
        ]:
            if infer.get(url, {}).get("state") != "WORKER_STATE_ALIVE":
                found.append(f"primerl status does not list {url} as alive: {infer.get(url, {}).get('state')}")
        if self.retried_rollouts > self.retried_events * self.rollouts_per_example:
            found.append(
                f"rollout/retried {self.retried_rollouts:g} > {self.retried_events} groups retried x "
                f"{self.rollouts_per_example}"
            )
        if not self.orchestrator_rows:
            found.append("no orchestrator metrics rows (rollout/retried, rollout/rescheduled) in metrics.jsonl")
        left = {e.get("url", "").removesuffix("/v1") for e in self.orchestrator_saw.get("left", [])}
        for url in self.workers_left:
            if url not in left:
                found.append(f"the orchestrator did not log 'inference worker left' for {url}")
        if self.joined_mid_run:  # else the run was over before the worker was up: nothing was left to use it for
            joined = {e.get("url", "").removesuffix("/v1") for e in self.orchestrator_saw.get("joined", [])}
            for url in self.workers_joined:
                if url not in joined:
                    found.append(f"the orchestrator did not log 'inference worker joined' for {url}")
            if not self.metrics.get("infer@f", {}).get("requests"):
                found.append(f"the worker that joined after step {self.joined_ready_at_step} answered no request")
        return found

    @property
    def joined_mid_run(self) -> bool:
        """The joining worker was up with steps still to go (two, so that the orchestrator had rollouts to
        send it)."""
        return bool(self.workers_joined) and self.joined_ready_at_step < self.max_steps - 2

    def summary(self) -> str:
        roles = "\n".join(f"  {label:<22} {address}" for label, address in self.roles.items())
        return (
            f"{self.hosts}\nroles:\n{roles}\n"
            f"steps completed: {len(self.steps_done)} of {self.max_steps}"
            f"{', each once' if self.steps_done == list(range(1, self.max_steps + 1)) else f' ({self.steps_done})'}"
            f"; trained data = sent data "
            f"(rank 0's digest) for {sum(self.sent_digests.get(k) == v for k, v in self.trained_digests.items())} "
            f"steps\n"
            f"workers left: {self.workers_left} (SIG{self.stop_signal} after step {self.stopped_at_step}, "
            f"{self.d_inflight_at_stop} requests in flight at its last heartbeat)\n"
            f"workers joined: {self.workers_joined} (process start -> ready {self.join_ready_s:.1f} s, after "
            f"step {self.joined_ready_at_step}{'' if self.joined_mid_run else ', too late to be sent rollouts'}; "
            f"registered -> serving the current version v{self.join_version}: {self.join_serving_s:.2f} s by its "
            f"log, {self.join_caught_up_s} s by its 'inference worker caught up'; the test saw it in the broker's "
            f"status {self.join_seen_serving_s:.2f} s after its ready file)\n"
            f"live workers' metrics: {self.metrics}\n"
            f"rollouts retried: {self.retried_rollouts:g} ({self.retried_events} groups; rescheduled after a "
            f"failed request: {self.rescheduled_rollouts:g} in {self.rescheduled_events} groups)\n"
            f"the orchestrator saw: {json.dumps(self.orchestrator_saw)}\n"
            f"errors the roles reported to the broker: {self.g_status.get('recent_errors') or 'none'}\n"
            f"wall time: {self.wall_s:.0f} s\n"
            f"primerl status on host g:\n{self.g_status_text}"
        )


def num_alive_inference(status: dict) -> int:
    return sum(
        1
        for w in status.get("workers", [])
        if w.get("role") == "ROLE_INFERENCE" and w.get("state") == "WORKER_STATE_ALIVE"
    )


def served(max_steps: int) -> Callable[[dict], bool]:
    """A status (JSON) predicate: the last step is committed and published, and every live inference worker
    serves it."""

    def check(status: dict) -> bool:
        live = [
            w
            for w in status.get("workers", [])
            if w.get("role") == "ROLE_INFERENCE" and w.get("state") == "WORKER_STATE_ALIVE"
        ]
        return (
            int(status.get("last_committed_step", 0)) >= max_steps
            and int(status.get("latest_policy_version", 0)) >= max_steps
            and bool(live)
            and all(int(w.get("policy_version", -1)) == max_steps for w in live)
        )

    return check


def parse_ts(event: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(event.get("timestamp")).replace("Z", "+00:00")).timestamp()
