"""Network partitions (issue 30, item 4) on hosts made of network namespaces (``support.netns``), the broker in
this process on the bridge's address. Skipped where network namespaces cannot be made (not root).

**Broker <-> an inference worker.** The real `primerl-orchestrator` on the bridge's address, two real
`primerl-infer` daemons on hosts d and e. Host d is cut off the bridge (its veth leaves the bridge: its packets
are dropped silently, its link stays up, as with an unplugged switch port) and plugged back:

- shorter than the broker's liveness window (heartbeat x liveness): nothing is lost, d stays listed;
- longer than the liveness window but within d's `broker.outage_s`: the broker marks d LOST, the orchestrator
  drops it and dispatches its groups to e; once healed d registers again, catches up and serves rollouts again
  (the time from the heal to d finishing rollouts again is printed: heal to full speed);
- longer than d's `broker.outage_s`: d says `broker outage exceeded the budget` and exits 1 (a supervisor
  restarts it), the run goes on with e.

Throughout, every step is sent exactly once (steps 1..n, each once) and what the broker holds for each step is
what the orchestrator logged as sent (digests).

**Broker <-> the trainer, and split brain** (``test_partitions_between_the_broker_and_the_trainer``): real
`primerl-trainer` daemons on hosts t and u, fed by this process; see that test.

**The orchestrator <-> an inference worker** (``test_a_partition_between_the_orchestrator_and_an_inference_worker``):
the orchestrator on host o, workers on d and e; o and d drop each other's packets (blackhole routes) while both
still reach the broker: d stays registered, the steps go on from e, and d serves o again after the heal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.broker import BrokerHarness
from support.daemons import BIN
from support.inference import TOKEN
from support.orchestrator import ENV_FIXTURES, ENV_PYTHON, metric_rows, orchestrator_args

from primerl.client.rollouts import RolloutConsumer
from primerl.proto import telemetry
from primerl.proto.step_digest import data_digest
from primerl.proto.v1 import common_pb2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

HEARTBEAT_S = 0.5
LIVENESS = 5  # the broker's default: LOST after 2.5 s of silence here
WORKER_OUTAGE_S = 12.0
SHORT_S = 0.4 * HEARTBEAT_S * LIVENESS
LONG_S = 8.0
BEYOND_S = WORKER_OUTAGE_S + 6.0
INFER_READY_S = 300.0


def made_hosts(names: list[str]):
    from support.netns import Hosts, namespaces_available

    ok, why = namespaces_available()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    return Hosts.create(names, mode="netns")


@pytest.fixture
def hosts():
    with made_hosts(["d", "e"]) as made:
        yield made


@pytest.fixture
def trainer_hosts():
    with made_hosts(["t", "u"]) as made:
        yield made


class Cable:
    """Host ``name``'s veth taken off the bridge and put back (``support.netns`` names it ``<tag>v<index>``)."""

    def __init__(self, hosts, name: str):
        self.bridge = hosts.bridge
        self.port = f"{hosts.bridge[:-2]}v{list(hosts.hosts).index(name)}"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", "link", "set", self.port, *args], check=True, timeout=20)

    def cut(self) -> None:
        self._ip("nomaster")

    def heal(self) -> None:
        self._ip("master", self.bridge)


def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
    return value


def requests_served(url: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=3).text
    except httpx.HTTPError:
        return -1.0
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def steps_sent(text: str) -> list[tuple[int, str]]:
    return [
        (int(re.search(r"\bstep=(\d+)", line).group(1)), re.search(r"data_digest=(\w+)", line).group(1))
        for line in text.splitlines()
        if telemetry.STEP_SENT in line
    ]


def start_inference(hosts, name: str, address: str, env: dict, tmp_path: Path, model: Path, procs: dict, urls: dict):
    """A real `primerl-infer` on host ``name`` against the broker at ``address``; its base URL into ``urls``."""
    from support.netns import Proc

    ready = tmp_path / f"infer-{name}-ready.json"
    argv = [
        BIN / "primerl-infer",
        "--model.name",
        model,
        "--model.max-model-len",
        "512",
        "--server.port",
        "0",
        "--server.host",
        hosts[name].address,
        "--broker.address",
        address,
        "--broker.connect-timeout-s",
        "30",
        "--broker.outage-s",
        str(WORKER_OUTAGE_S),
        "--ready-file",
        ready,
    ]
    procs[name] = proc = Proc(f"infer@{name}", hosts[name], argv, env, tmp_path / f"infer-{name}.log", tmp_path)
    wait_for(lambda: ready.exists(), INFER_READY_S, f"infer@{name} ready:\n{proc.tail()}", proc.popen)
    urls[name] = json.loads(ready.read_text())["base_url"]


def gateway_broker(hosts, tmp_path: Path, run_id: str, **fields) -> tuple[BrokerHarness, str]:
    """A broker in this process on the bridge's address (every host reaches it); returns it and its gRPC address."""
    spool = tmp_path / "spool"
    broker = BrokerHarness(
        spool, run_token=TOKEN, run_id=run_id, host=hosts.gateway, heartbeat_interval_s=HEARTBEAT_S, **fields
    )
    return broker, f"{hosts.gateway}:{broker.endpoints.grpc_port}"


def daemon_env() -> dict[str, str]:
    return {
        **os.environ,
        "PRIMERL_RUN_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }


def start_workers_d_and_e(hosts, address: str, env: dict, tmp_path: Path, model: Path, procs: dict, urls: dict):
    """`primerl-infer` on hosts d and e, started side by side; their base URLs into ``urls``."""
    threads = [
        threading.Thread(target=start_inference, args=(hosts, name, address, env, tmp_path, model, procs, urls))
        for name in ("d", "e")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(urls) == ["d", "e"], {n: p.tail() for n, p in procs.items()}


def long_orchestrator_args(model: Path, broker: BrokerHarness, address: str, output_dir: Path) -> list[str]:
    """An orchestrator on the reverse-text environment for up to 400 steps, never held by the async bound (no
    trainer here), against the broker at ``address``."""
    args = orchestrator_args(model, broker, output_dir, "reverse-text")
    args[args.index("--broker.address") + 1] = address
    args[args.index("--max-steps") + 1] = "400"
    return [*args, "--max-async-level", "400"]


def test_partitions_between_the_broker_and_an_inference_worker(hosts, tmp_path, tiny_model):
    from support.netns import Proc

    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    broker, address = gateway_broker(hosts, tmp_path, "partition-test", max_queue_batches=256)
    env = daemon_env()
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    orchestrator: subprocess.Popen | None = None
    cable = Cable(hosts, "d")
    cut = False
    figures: dict[str, float] = {}
    try:
        start_workers_d_and_e(hosts, address, env, tmp_path, tiny_model, procs, urls)
        args = long_orchestrator_args(tiny_model, broker, address, tmp_path / "out")
        log_path = tmp_path / "orchestrator.log"
        with open(log_path, "w") as log_file:
            orchestrator = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**env, "PYTHONPATH": str(ENV_FIXTURES)},
            )

        def log_text() -> str:
            return log_path.read_text(errors="replace")

        def last_step() -> int:
            return max((step for step, _ in steps_sent(log_text())), default=0)

        wait_for(lambda: last_step() >= 2, 240, "step 2 sent", orchestrator)
        assert requests_served(urls["d"]) > 0

        # shorter than the liveness window: d stays listed, nothing happens
        cable.cut()
        cut = True
        time.sleep(SHORT_S)
        cable.heal()
        cut = False
        assert telemetry.INFERENCE_WORKER_LEFT not in log_text()

        # longer than the liveness window, within d's outage budget: LOST, dropped, back after the heal
        step_at_cut = last_step()
        cable.cut()
        cut = True
        cut_s = time.monotonic()
        wait_for(lambda: telemetry.INFERENCE_WORKER_LEFT in log_text(), 15, "the orchestrator dropping d", orchestrator)
        figures["dropped_s"] = time.monotonic() - cut_s
        wait_for(lambda: last_step() >= step_at_cut + 2, 60, "steps from e while d is cut off", orchestrator)
        time.sleep(max(0.0, LONG_S - (time.monotonic() - cut_s)))
        served = requests_served(urls["d"])  # -1: unreachable, as it should be
        assert served == -1.0, served
        cable.heal()
        cut = False
        healed_s = time.monotonic()
        joins = log_text().count(telemetry.INFERENCE_WORKER_JOINED)
        wait_for(
            lambda: log_text().count(telemetry.INFERENCE_WORKER_JOINED) > joins, 30, "d registering again", orchestrator
        )
        figures["rejoined_s"] = time.monotonic() - healed_s
        base = requests_served(urls["d"])
        wait_for(lambda: requests_served(urls["d"]) > base, 60, "d serving rollouts again", orchestrator)
        figures["heal_to_full_speed_s"] = time.monotonic() - healed_s

        # longer than d's outage budget: d stops with one clear line; the run goes on with e
        step_at_cut = last_step()
        cable.cut()
        cut = True
        cut_s = time.monotonic()
        code = procs["d"].popen.wait(BEYOND_S + 30)
        figures["d_exit_after_s"] = time.monotonic() - cut_s
        cable.heal()
        cut = False
        wait_for(lambda: last_step() >= step_at_cut + 2, 60, "steps from e after d exited", orchestrator)
        orchestrator.send_signal(signal.SIGTERM)
        assert orchestrator.wait(60) == 0, log_text()[-4000:]

        text = log_text()
        d_log = procs["d"].log.read_text(errors="replace")
        assert code == 1, d_log[-3000:]
        assert "broker outage exceeded the budget" in d_log, d_log[-3000:]
        sent = steps_sent(text)
        steps = [step for step, _ in sent]
        assert steps == list(range(1, len(steps) + 1)), steps  # exactly once, none lost
        rows = [r["step"] for r in metric_rows(tmp_path / "out")]
        assert rows == list(range(1, len(rows) + 1)) and set(steps) <= set(rows), (rows, steps)
        rollout_endpoint = f"tcp://{hosts.gateway}:{broker.endpoints.rollout_port}"
        with RolloutConsumer(rollout_endpoint, auth_token=TOKEN, worker_id="checker", rank=0) as consumer:
            for step, digest in sent:
                fetched = consumer.fetch_step(step, timeout_s=60)
                assert data_digest([tensors for _, tensors in fetched]) == digest, step
        print(
            f"\npartition d<->broker: {len(steps)} steps, each once; short cut ({SHORT_S:g} s): no change; "
            f"long cut ({LONG_S:g} s): dropped after {figures['dropped_s']:.1f} s, registered again "
            f"{figures['rejoined_s']:.1f} s after the heal, serving rollouts again (heal to full speed) "
            f"{figures['heal_to_full_speed_s']:.1f} s after it; beyond broker.outage_s = {WORKER_OUTAGE_S:g} s: "
            f"d exited {code} after {figures['d_exit_after_s']:.1f} s"
        )
    finally:
        if cut:
            cable.heal()
        if orchestrator is not None and orchestrator.poll() is None:
            orchestrator.kill()
            orchestrator.wait(10)
        for proc in procs.values():
            proc.stop()
        broker.stop()


TRAINER_OUTAGE_S = 90.0
TRAINER_CUT_S = 8.0
FEED_AHEAD = 4  # steps sent beyond the last committed one


class Feeder:
    """Sends each step's samples (``support.trainer_runs``) as an orchestrator would, ``FEED_AHEAD`` steps beyond
    the broker's last committed step, until stopped."""

    def __init__(self, broker: BrokerHarness, endpoint: str):
        self.broker, self.endpoint = broker, endpoint
        self.stop = threading.Event()
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from support.trainer_runs import send_steps

        try:
            while not self.stop.is_set():
                target = self.broker.service.registry.last_committed_step + FEED_AHEAD
                if self.sent < target:
                    send_steps(self.endpoint, range(self.sent + 1, target + 1), num_micro_batches=1, auth_token=TOKEN)
                    self.sent = target
                self.stop.wait(0.05)
        except BaseException as err:  # the test's checks say it
            self.error = err

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def test_partitions_between_the_broker_and_the_trainer(trainer_hosts, tmp_path, small_tiny_model):
    """Trainer A on host t is cut off the broker (the broker, in this process, and the data it trains on are on the
    bridge's address), with checkpoints every step in a directory both hosts share:

    - shorter than the broker's liveness window: nothing changes (A stays registered, steps go on);
    - longer than the liveness window, within A's `broker.outage_s`: the broker marks A LOST; healed, A registers
      again under its own lineage and goes on (heal to full speed: the next commit);
    - split brain: A is cut off again and, once the broker lists it LOST, trainer B starts on host u from the
      shared checkpoints and takes over the run. Healed, A learns it was superseded and stops (exit 2, one line)
      without publishing or committing anything: the weights the broker holds stay B's lineage.

    Every step is committed once (B's re-commit of the checkpoint it resumed from aside), each trained on the
    data sent for it."""
    from support.netns import Proc
    from support.trainer_runs import log_events, packed, samples, trainer_args

    hosts = trainer_hosts
    broker, address = gateway_broker(hosts, tmp_path, "trainer-partition-test", max_queue_batches=64)
    registry = broker.service.registry
    env = daemon_env()
    out = tmp_path / "out"  # both hosts' trainers checkpoint here (a shared file system)
    args = trainer_args(
        small_tiny_model,
        address,
        out,
        "--max-steps",
        "10000",
        "--ckpt.interval",
        "1",
        "--ckpt.keep-last",
        "3",
        "--broker.outage-s",
        str(TRAINER_OUTAGE_S),
    )
    cable = Cable(hosts, "t")
    cut = False
    procs: dict[str, Proc] = {}
    feeder = Feeder(broker, f"tcp://{hosts.gateway}:{broker.endpoints.rollout_port}")
    figures: dict[str, float] = {}

    def committed() -> int:
        return registry.last_committed_step

    def trainers_alive() -> list:
        return registry.list_workers(common_pb2.ROLE_TRAINER)

    def wait_committed(step: int, timeout_s: float, what: str, proc: Proc) -> None:
        try:
            wait_for(lambda: committed() >= step, timeout_s, f"{what} (step {step} committed)", proc.popen)
        except AssertionError as err:
            raise AssertionError(f"{err}; feeder error: {feeder.error!r}; {proc.label}:\n{proc.tail()}") from None

    try:
        procs["a"] = a = Proc("trainer@t", hosts["t"], args, env, tmp_path / "trainer-a.log", tmp_path)
        wait_committed(3, 240, "trainer A training", a)
        lineage_a = registry.policy.latest().lineage  # A has published: the store holds A's lineage

        # shorter than the liveness window: nothing changes
        cable.cut()
        cut = True
        time.sleep(SHORT_S)
        cable.heal()
        cut = False
        step_at_heal = committed()
        wait_committed(step_at_heal + 3, 60, "trainer A after a short cut", a)
        assert len(a.events(telemetry.REGISTERED_WITH_THE_BROKER)) == 1, a.tail()

        # longer than the liveness window, within A's outage budget: LOST, then back under its own lineage
        cable.cut()
        cut = True
        cut_s = time.monotonic()
        wait_for(lambda: not trainers_alive(), 15, "the broker marking A LOST", a.popen)
        figures["lost_after_s"] = time.monotonic() - cut_s
        time.sleep(max(0.0, TRAINER_CUT_S - (time.monotonic() - cut_s)))
        step_at_heal = committed()
        cable.heal()
        cut = False
        healed_s = time.monotonic()
        wait_committed(step_at_heal + 1, 60, "trainer A after the heal", a)
        figures["heal_to_commit_s"] = time.monotonic() - healed_s
        wait_committed(step_at_heal + 3, 60, "trainer A at full speed", a)
        assert len(a.events(telemetry.REGISTERED_WITH_THE_BROKER)) == 2, a.tail()
        assert [w.name for w in trainers_alive()] == ["trainer-rank0"]

        # split brain: A cut off, B takes over from the shared checkpoints, A comes back
        cable.cut()
        cut = True
        cut_s = time.monotonic()
        wait_for(lambda: not trainers_alive(), 15, "the broker marking A LOST again", a.popen)
        step_at_cut = committed()
        procs["b"] = b = Proc("trainer@u", hosts["u"], args, env, tmp_path / "trainer-b.log", tmp_path)
        wait_committed(step_at_cut + 3, 240, "trainer B taking over", b)
        figures["takeover_s"] = time.monotonic() - cut_s
        lineage_b = registry.policy.latest().lineage
        assert lineage_b > lineage_a
        cable.heal()
        cut = False
        healed_s = time.monotonic()
        code_a = a.popen.wait(60)
        figures["heal_to_a_stopped_s"] = time.monotonic() - healed_s
        assert code_a == 2, a.tail()
        step_now = committed()
        wait_committed(step_now + 3, 60, "trainer B after A came back", b)
        assert registry.policy.latest().lineage == lineage_b  # A never published over B's lineage
        b.popen.send_signal(signal.SIGTERM)
        assert b.popen.wait(120) == 0, b.tail()
    finally:
        if cut:
            cable.heal()
        feeder.close()
        for proc in procs.values():
            proc.stop()
        broker.stop()

    assert feeder.error is None, feeder.error
    a_log, b_log = procs["a"].log.read_text(errors="replace"), procs["b"].log.read_text(errors="replace")
    assert "a newer trainer publishes this run's policy; this one stops and must not be restarted" in a_log, a_log[
        -3000:
    ]
    assert len(procs["b"].events(telemetry.REGISTERED_WITH_THE_BROKER)) == 1, b_log[-3000:]
    committed_a = [e["step"] for e in log_events(a_log, "checkpoint committed")]
    committed_b = [e["step"] for e in log_events(b_log, "checkpoint committed")]
    assert committed_a == list(range(1, len(committed_a) + 1)), committed_a
    resumed = committed_b[0]  # B commits the checkpoint it resumed from again (idempotent), then goes on
    assert resumed <= committed_a[-1] + 1 and committed_b == list(range(resumed, resumed + len(committed_b)))
    assert committed_a[-1] < committed_b[1], (committed_a[-3:], committed_b[:3])  # A committed nothing after B
    for proc in procs.values():
        for done in proc.events(telemetry.STEP_DONE):
            assert done["data_digest"] == data_digest([packed(samples(done["step"]))]), done
    print(
        f"\npartition trainer<->broker: steps 1-{committed_b[-1]} committed once ({len(committed_a)} by A, then B "
        f"from step {resumed}); short cut ({SHORT_S:g} s): no change; long cut ({TRAINER_CUT_S:g} s): LOST after "
        f"{figures['lost_after_s']:.1f} s, first commit {figures['heal_to_commit_s']:.1f} s after the heal; split "
        f"brain: B took over {figures['takeover_s']:.1f} s after the cut (lineage {lineage_a} -> {lineage_b}), A "
        f"stopped (exit 2) {figures['heal_to_a_stopped_s']:.1f} s after the heal"
    )


@pytest.fixture
def three_hosts():
    with made_hosts(["o", "d", "e"]) as made:
        yield made


class Blackhole:
    """The packets between hosts ``a`` and ``b`` dropped silently, in both directions, while both keep talking to
    everyone else: each host routes the other's address to a blackhole (``ip route add blackhole``; this kernel
    has no tc classifiers or netfilter to match on)."""

    def __init__(self, hosts, a: str, b: str):
        self.routes = [(hosts[a].namespace, hosts[b].address), (hosts[b].namespace, hosts[a].address)]

    def _route(self, action: str) -> None:
        for namespace, address in self.routes:
            subprocess.run(
                ["ip", "-n", namespace, "route", action, "blackhole", f"{address}/32"], check=True, timeout=20
            )

    def cut(self) -> None:
        self._route("add")

    def heal(self) -> None:
        self._route("del")


def test_a_partition_between_the_orchestrator_and_an_inference_worker(three_hosts, tmp_path, tiny_model):
    from support.netns import Proc

    if not Path(ENV_PYTHON).exists():
        pytest.skip(f"no env-worker interpreter at {ENV_PYTHON}: run `make setup` (it builds .venv-envs)")
    hosts = three_hosts
    broker, address = gateway_broker(hosts, tmp_path, "orchestrator-partition-test", max_queue_batches=256)
    env = daemon_env()
    procs: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    blackhole = Blackhole(hosts, "o", "d")
    cut = False
    figures: dict[str, float] = {}
    try:
        start_workers_d_and_e(hosts, address, env, tmp_path, tiny_model, procs, urls)
        # a deadline shorter than the cut: d's groups stuck on the cut connection go to e (the default is 4 x the
        # slowest recent group, at least 10 s)
        args = [
            *long_orchestrator_args(tiny_model, broker, address, tmp_path / "out"),
            "--worker-silence-timeout-s",
            "3",
        ]
        procs["o"] = orchestrator = Proc(
            "orchestrator@o",
            hosts["o"],
            args,
            {**env, "PYTHONPATH": str(ENV_FIXTURES)},
            tmp_path / "orchestrator.log",
            tmp_path,
        )

        def last_step() -> int:
            return max((step for step, _ in steps_sent(orchestrator.log.read_text(errors="replace"))), default=0)

        wait_for(lambda: last_step() >= 2, 240, "step 2 sent", orchestrator.popen)
        assert requests_served(urls["d"]) > 0
        step_at_cut = last_step()
        blackhole.cut()
        cut = True
        cut_s = time.monotonic()
        wait_for(
            lambda: last_step() >= step_at_cut + 3, 120, "steps from e while o and d cannot talk", orchestrator.popen
        )
        figures["three_steps_s"] = time.monotonic() - cut_s
        wait_for(
            lambda: telemetry.INFERENCE_WORKER_SILENT in orchestrator.log.read_text(errors="replace"),
            60,
            "d's groups stuck on the cut connection dispatched again (worker_silence_timeout_s = 3)",
            orchestrator.popen,
        )
        figures["silent_s"] = time.monotonic() - cut_s
        served_d_in_cut = requests_served(urls["d"])  # the test reaches d: only o and d are cut off each other
        time.sleep(max(0.0, LONG_S - (time.monotonic() - cut_s)))
        base = requests_served(urls["d"])
        assert base == served_d_in_cut, (base, served_d_in_cut)  # nothing of o's finished on d while cut off
        blackhole.heal()
        cut = False
        healed_s = time.monotonic()
        wait_for(lambda: requests_served(urls["d"]) > base, 120, "d serving rollouts again", orchestrator.popen)
        figures["heal_to_full_speed_s"] = time.monotonic() - healed_s
        step_now = last_step()
        wait_for(lambda: last_step() >= step_now + 2, 60, "steps after the heal", orchestrator.popen)
        orchestrator.popen.send_signal(signal.SIGTERM)
        assert orchestrator.popen.wait(60) == 0, orchestrator.tail()
    finally:
        if cut:
            blackhole.heal()
        for proc in procs.values():
            proc.stop()
        broker.stop()
    text = procs["o"].log.read_text(errors="replace")
    sent = steps_sent(text)
    steps = [step for step, _ in sent]
    assert steps == list(range(1, len(steps) + 1)), steps  # exactly once, none lost
    rows = [r["step"] for r in metric_rows(tmp_path / "out")]
    assert rows == list(range(1, len(rows) + 1)) and set(steps) <= set(rows), (rows, steps)
    assert telemetry.INFERENCE_WORKER_LEFT not in text  # d kept its broker registration throughout
    print(
        f"\npartition o<->d (d still reaches the broker): {len(steps)} steps, each once; 3 steps from e "
        f"{figures['three_steps_s']:.1f} s after the cut; {LONG_S:g} s cut; d finishing o's rollouts again "
        f"(heal to full speed) {figures['heal_to_full_speed_s']:.1f} s after the heal; d found silent within "
        f"{figures['silent_s']:.1f} s of the cut (deadline 3 s); "
        f"rollout failed lines: {text.count('rollout failed')}, groups retried: {text.count('rollout group retried')}"
    )
