#!/usr/bin/env python
"""The weight path across hosts whose links are rate-limited: trainer -> ``primerl-broker`` -> inference workers.

    sudo .venv/bin/python bench/weight_crosshost.py [--rates 1gbit,10gbit] [--model 1b|100m|tiny]
        [--fanout-model auto|1b|100m|tiny] [--workers 4] [--repeats 3] [--warmup 1] [--chunk-mib 8]
        [--cases full,delta,star,chain,raw] [--max-anon-gib 9] [--markdown PATH] [--json PATH]

Hosts: one network namespace each (``tests/support/netns.py``: a veth pair per host, the other ends ports of one
bridge): ``t`` (the trainer), ``b`` (the broker), ``w0``..``w{N-1}`` (inference workers). Every host's link is
limited to the rate in both directions, as a switch with NICs of that speed would be: a ``tbf`` qdisc on the egress
of the host's ``eth0`` (what it sends) and on the egress of its bridge port (what it receives). The limit is
checked, not assumed: the raw send must take about bytes x 8 / rate (TCP/IP and Ethernet headers leave ~95.6 % of
the rate to payload at MTU 1500), and the qdiscs' counters are printed.

The update: one AdamW step at lr 1e-6 from transformers' initial weights (``bench/delta_fraction.py``'s models
and its in-backward-pass step, run once per model in a child process), both weight sets kept in bf16 (the serving
dtype) in safetensors files. The trainer process (host ``t``) maps them (its "model" is a bf16 ``Qwen2ForCausalLM``
on those tensors, not an fp32 master: see memory below) and publishes with the project's ``PolicyPublisher``
(``serving_dtype`` bf16, ``transport="socket"``: across hosts the shared-memory road is refused anyway, so this
skips the one refused try per publisher; chunks of ``--chunk-mib``, the broker's ``weight_chunk_bytes``) to a real
``primerl-broker`` process (host ``b``, run token, its own spool, Prometheus on). Each worker host runs one
``WeightSubscriber`` (the inference worker's client, no vLLM) that receives the update into a buffer, checks its
digest, acknowledges it and notes the time: "has it" = the whole update held and digest-checked. Times are
``CLOCK_MONOTONIC``, one clock for every namespace of this machine; "publish -> has it" runs from the call of
``publish`` (build included: copy, encode, digest) to the has-it time of the LAST worker; "send -> has it" leaves
the build (the publisher's phases but ``send``) out: the path across the links alone, since on 2 shared cores the
build (fresh memory, other users' load) varies by seconds. Between cases the trainer returns its freed heap to the
system (``malloc_trim``); before each publish the bench waits until the broker freed the previous update's frames
(its durable file written, as between the steps of a run; at most 60 s), so that the broker holds one update, not
two.

Cases (a fresh broker and fresh workers per case):

1. ``full``: one worker, FULL (``kind="full"``); ``--warmup`` untimed publishes first, then ``--repeats`` timed.
2. ``delta``: one worker, DELTA (``kind="delta"``, ``delta_policy="always"``, SPARSE): the initial weights as FULL
   (the base, untimed), then per repeat the stepped weights as DELTA (timed) and the initial ones again as DELTA
   (untimed: the base is back for the next repeat).
3. ``star``: ``--workers`` workers, broker ``weight_fanout = "star"``, FULL.
4. ``chain``: ``--workers`` workers, ``weight_fanout = "chain"``, each with ``weight_relay_host`` = its own address,
   FULL (joined one after the other, so the chain is w0 -> w1 -> ...).
5. ``raw``: the floor: a pyzmq PUSH -> PULL send of the FULL payload's byte count, in messages of the chunk size,
   from the trainer host to a worker host (one link-pair; the broker path crosses two, cut-through).

Memory (why the fan-out cases may run on a smaller model): with P the bf16 payload (1B: 1.85 GB), a worker holds
P, the broker P while an update arrives, the trainer's publisher a snapshot and a payload (2P; DELTA: base,
snapshot and an idle pooled buffer, 3P) besides the weights it maps from the files (page cache, clean and
reclaimable, counted apart). ``--fanout-model auto`` runs cases 3 and 4 on ``--model`` when that estimate fits
``--max-anon-gib``, else on 100m (then cases 1 and 5 run at that model too, for the ratios). The anonymous and
file-backed RSS of every process of the bench is sampled every 0.5 s; past ``--max-anon-gib`` + 1 the bench stops.
An fp32 master would add 2P (the trainer's ``.to(bf16)`` cast then reads fp32), which does not fit next to a worker
and the broker at 1B on this machine; the copy into the snapshot is the same code path.

Printed per rate: each case's publish -> has it and send -> has it (median, min-max, n), the broker's sent bytes /
payload (Prometheus ``primerl_broker_weight_bytes_pushed_total``: 1 per worker in star mode, 1 in chain mode), and
the ratios of the medians (also from the send): DELTA / FULL (target <= 0.15 at 1 Gb/s), chain last worker /
one-worker FULL (target <= 1.2), star last worker / one-worker FULL (expected ~ the number of workers), FULL / raw
send.
Needs root (network namespaces, ``tc``); everything it makes is removed on exit (namespaces, their veths and
qdiscs, the bridge, the processes it started).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # support.netns: the multi-host tests' hosts

from report import Section, Stats, fmt, target_line  # noqa: E402

from primerl.proto.units import GiB, MiB  # noqa: E402

TOKEN = "bench-crosshost-token"
LR = 1e-6
TRAINER_MAX_CHUNK_BYTES = 64 * MiB  # what the trainer sends at most per chunk (trainer/runner.py)
TBF_LATENCY_MS = 20
TBF_BURST_S = 0.002  # the bucket holds 2 ms of the rate (at least 64 KiB)
PAYLOAD_SHARE_AT_MTU_1500 = 1448 / 1514  # TCP payload per Ethernet frame (timestamps on): what tbf leaves to data
TARGET_DELTA_OVER_FULL = 0.15
TARGET_CHAIN_OVER_ONE = 1.2
STATE_FILES = {"init": "init.safetensors", "stepped": "stepped.safetensors"}
CASE_LABELS = {
    "full": "1. FULL, one worker",
    "delta": "2. DELTA (sparse), one worker",
    "star": "3. FULL, star fan-out",
    "chain": "4. FULL, relay chain",
    "raw": "5. raw zmq PUSH->PULL (floor)",
}
PROCESS_START_TIMEOUT_S = 120.0
BROKER_START_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    """A measurement that cannot go on (a child failed, a limit was crossed); the message says which and why."""


# ---------------------------------------------------------------------------------------------------------
# models: the step of bench/delta_fraction.py, the weights in files


def model_specs() -> dict[str, Any]:
    """delta_fraction's 100m and 1b, plus the tiny model's shape (the smoke test's)."""
    from delta_fraction import model_specs as delta_fraction_specs

    from primerl.trainer.tiny_model import TinyModelSpec

    return {**delta_fraction_specs(), "tiny": TinyModelSpec()}


def prepare_states(model_name: str, seed: int, out_dir: Path) -> dict[str, Any]:
    """Child ``prepare``: the model's initial and stepped weights in bf16, written to ``out_dir`` as safetensors.

    The step is ``delta_fraction.measure_model``'s own (one AdamW step at ``LR`` inside the backward pass, one
    parameter at a time): its per-tensor measurement is swapped for a function that keeps the two bf16 tensors it
    is handed (stepped, initial), so that step is reused, not copied."""
    import argparse as argparse_module

    import delta_fraction
    import numpy as np
    import torch

    from primerl.trainer.hf_state_dict import SAFETENSORS_METADATA
    from primerl.trainer.payload_writer import safetensors_layout

    states: dict[str, dict[str, Any]] = {"init": {}, "stepped": {}}
    counts = {"elements": 0, "changed": 0}

    def keep(point: Any, name: str, new: Any, base: Any, encodings: list[str], repeats: int) -> None:
        states["stepped"][name], states["init"][name] = new.contiguous(), base.contiguous()
        counts["elements"] += new.numel()
        counts["changed"] += int(np.count_nonzero(delta_fraction.raw_bits(new) != delta_fraction.raw_bits(base)))

    # pooled_max_gib=0: no whole-model encode/decode timings (what measure_model runs after the step, if it has them)
    args = argparse_module.Namespace(lrs=[LR], dtypes=["bf16"], encodings=[], repeats=1, seed=seed, pooled_max_gib=0)
    measure_tensor = delta_fraction.measure_tensor
    delta_fraction.measure_tensor = keep
    try:
        points = delta_fraction.measure_model(model_name, model_specs()[model_name], args)
    finally:
        delta_fraction.measure_tensor = measure_tensor
    if len(states["init"]) == 0 or len(states["init"]) != len(states["stepped"]):
        raise BenchError(f"the step of {model_name} handed over no tensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    payload_bytes = 0
    for label, tensors in states.items():
        prefix, spans = safetensors_layout(tensors, SAFETENSORS_METADATA)
        with open(out_dir / STATE_FILES[label], "wb") as out:  # tensor by tensor: no second copy in memory
            out.write(prefix)
            for name, _, _ in spans:
                out.write(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
        payload_bytes = spans[-1][2]
        tensors.clear()
    info = {
        "model": model_name,
        "num_params": points[0].num_params,
        "num_tensors": len(spans),
        "changed_fraction": counts["changed"] / max(1, counts["elements"]),
        "file_bytes": payload_bytes,
    }
    (out_dir / "info.json").write_text(json.dumps(info))
    return info


def mapped_model(model_name: str, seed: int, path: Path) -> Any:
    """A bf16 ``Qwen2ForCausalLM`` of ``model_name`` whose parameters view ``path`` (a private, copy-on-write
    mapping: file-backed pages until written; nothing here writes them)."""
    import mmap

    import torch
    from delta_fraction import build_model

    from primerl.trainer.payload_writer import payload_tensors

    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = payload_tensors(memoryview(mapping))
    with torch.device("meta"):
        model = build_model(model_specs()[model_name], seed).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    on_meta = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if unexpected or on_meta or any(not key.startswith("lm_head.") for key in missing):
        raise BenchError(f"{path.name} does not fit {model_name}: missing {missing}, unexpected {unexpected}")
    return model


# ---------------------------------------------------------------------------------------------------------
# children: each role of the bench as a process on its host, JSON lines in (stdin) and out (stdout)


class Channel:
    """A child's JSON-line channel: stdout becomes the log (stderr) so that nothing else lands in the channel."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        self.lock = threading.Lock()

    def say(self, event: str, **fields: Any) -> None:
        with self.lock:
            self.out.write(json.dumps({"event": event, **fields}) + "\n")

    def commands(self) -> Any:
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)


def trainer_child(args: argparse.Namespace, channel: Channel) -> None:
    """Host ``t``: publishes with ``PolicyPublisher`` (ops ``connect``, ``publish``), sends raw (op ``raw``: PUSH
    sockets stay open until ``release``, so that nothing queued is dropped)."""
    import gc

    import torch
    import zmq

    from primerl.trainer.publish import PolicyPublisher

    states_dir = Path(args.states_dir)
    publisher = None
    models: dict[str, Any] = {}
    context = zmq.Context()
    pushes: dict[str, Any] = {}

    def release() -> None:
        nonlocal publisher
        if publisher is not None:
            publisher.close()
        publisher = None
        models.clear()
        for push in pushes.values():
            push.close(linger=0)
        pushes.clear()
        gc.collect()
        trim_heap()

    try:
        for command in channel.commands():
            op = command["op"]
            if op == "connect":
                release()
                model_dir = states_dir / command["model"]
                for state in command["states"]:
                    models[state] = mapped_model(command["model"], args.seed, model_dir / STATE_FILES[state])
                publisher = PolicyPublisher(
                    command["endpoint"],
                    TOKEN,
                    "bench-trainer",
                    command["chunk_bytes"],
                    kind=command["kind"],
                    policy_name="policy",
                    serving_dtype=torch.bfloat16,
                    delta_policy="always",
                    delta_encoding="sparse",
                    lineage=1,
                    transport="socket",
                )
                channel.say("connected")
            elif op == "publish":
                if publisher is None:
                    raise BenchError("publish before connect")
                start_s = time.monotonic()
                result = publisher.publish(models[command["state"]], command["version"], timeout_s=command["timeout_s"])
                channel.say(
                    "published",
                    start_s=start_s,
                    acked_s=time.monotonic(),
                    kind=result.kind,
                    payload_bytes=result.payload_bytes,
                    fallback=result.fallback,
                    phases_ms={k: round(v, 1) for k, v in result.phases_ms.items()},
                )
            elif op == "raw":
                endpoint = command["endpoint"]
                if endpoint not in pushes:
                    pushes[endpoint] = context.socket(zmq.PUSH)
                    pushes[endpoint].setsockopt(zmq.SNDTIMEO, 600_000)
                    pushes[endpoint].connect(endpoint)
                channel.say("raw_sent", **raw_send(pushes[endpoint], command["num_bytes"], command["chunk_bytes"]))
            elif op == "release":
                release()
                channel.say("released")
            else:
                raise BenchError(f"unknown op {op!r}")
    finally:
        release()
        context.destroy(linger=0)


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc keeps freed tensors under its 32 MiB mmap threshold in
    the heap): the next case starts from what this process really holds."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def raw_send(push: Any, num_bytes: int, chunk_bytes: int) -> dict[str, float]:
    """``num_bytes`` in messages of ``chunk_bytes`` (zero-copy, one buffer reused) to a PULL socket; returns once
    they are queued (the receiver says when they arrived)."""
    chunk = bytearray(chunk_bytes)
    start_s = time.monotonic()
    remaining = num_bytes
    while remaining > 0:
        size = min(chunk_bytes, remaining)
        push.send(memoryview(chunk)[:size], copy=False)
        remaining -= size
    return {"start_s": start_s, "queued_s": time.monotonic()}


def raw_receiver_child(args: argparse.Namespace, channel: Channel) -> None:
    """A worker host: a PULL socket on its address; op ``expect`` -> ``ready``, then ``received`` with the time the
    last of ``num_bytes`` arrived."""
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    try:
        port = pull.bind_to_random_port(f"tcp://{args.host_address}")
        channel.say("bound", endpoint=f"tcp://{args.host_address}:{port}")
        for command in channel.commands():
            if command["op"] != "expect":
                raise BenchError(f"unknown op {command['op']!r}")
            channel.say("ready")
            received, deadline_s = 0, time.monotonic() + command["timeout_s"]
            while received < command["num_bytes"]:
                if not pull.poll(max(1, int((deadline_s - time.monotonic()) * 1000))):
                    raise BenchError(f"raw receiver: {received} of {command['num_bytes']} bytes by the deadline")
                received += len(pull.recv(copy=False))
            channel.say("received", t=time.monotonic(), num_bytes=received)
    finally:
        pull.close(linger=0)
        context.destroy(linger=0)


class HoldingSink:
    """A ``PayloadSink`` into one reused buffer (a new one when the size changes): where the worker keeps it."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def begin_payload(self, header: Any, num_bytes: int) -> memoryview:
        if len(self.buffer) != num_bytes:
            self.buffer = bytearray()  # freed before the next one is taken
            self.buffer = bytearray(num_bytes)
        return memoryview(self.buffer)

    def payload_progress(self, num_bytes: int) -> None:
        pass

    def end_payload(self, complete: bool) -> None:
        pass


def subscriber_child(args: argparse.Namespace, channel: Channel) -> None:
    """A worker host: a ``WeightSubscriber`` (relaying when ``--relay``) that says ``joined`` once the broker
    answered its HELLO and ``update`` per update held and digest-checked; it stops when stdin closes."""
    from primerl.client.control import ControlClient
    from primerl.client.weights import WeightSubscriber
    from primerl.proto.digests import payload_digest
    from primerl.runtime.config_common import BrokerClientConfig

    stop = threading.Event()

    def wait_for_eof() -> None:
        for _ in sys.stdin:
            pass
        stop.set()

    # Registered first, heartbeating, as an inference worker: the broker relays only through registered workers.
    control = ControlClient(BrokerClientConfig(address=args.grpc_address, run_token=TOKEN), "inference", args.worker_id)
    worker_id = control.register().worker_id
    control.start_heartbeats()
    subscriber = WeightSubscriber(
        args.endpoint,
        TOKEN,
        worker_id,
        payload_sink=HoldingSink(),
        relay_host=args.host_address if args.relay else None,
        hello_interval_s=1.0,
    )
    try:
        subscriber.hello()
        deadline_s = time.monotonic() + PROCESS_START_TIMEOUT_S
        while subscriber.broker_latest is None:
            if time.monotonic() > deadline_s:
                raise BenchError(f"the broker did not answer {args.worker_id}'s HELLO")
            subscriber.receive(0.1)
        channel.say("joined", relay_endpoint=subscriber.relay.endpoint if subscriber.relay is not None else None)
        threading.Thread(target=wait_for_eof, daemon=True).start()
        while not stop.is_set():
            got = subscriber.receive(0.2)
            if got is None:
                continue
            header, payload = got
            # a whole (one-message) update is not hashed as it lands: hash it here, as the inference worker does
            ok = (subscriber.received_digest or payload_digest(payload)) == header.digest
            held_s = time.monotonic()
            subscriber.ack(header.policy_version, applied=ok)
            channel.say("update", version=header.policy_version, t=held_s, ok=ok, num_bytes=payload.nbytes)
    finally:
        subscriber.close()
        control.close()


def child_main(args: argparse.Namespace) -> int:
    from primerl.runtime.log_setup import configure_logging

    channel = Channel()
    configure_logging(args.child, "bench-crosshost", level="warning")
    try:
        if args.child == "prepare":
            channel.say("prepared", **prepare_states(args.model, args.seed, Path(args.states_dir)))
        else:
            {"trainer": trainer_child, "subscriber": subscriber_child, "raw_receiver": raw_receiver_child}[args.child](
                args, channel
            )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the bench with it
        traceback.print_exc()
        channel.say("error", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------
# the parent: hosts, links, processes


class Child:
    """A child of this bench: JSON lines to its stdin, events from its stdout (read by a thread), stderr in a log."""

    def __init__(self, label: str, argv: list[str], log_path: Path):
        self.label, self.log_path = label, log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True
        )
        self._events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"read-{label}").start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("{"):
                try:
                    self._events.put(json.loads(line))
                except ValueError:
                    continue
        self._events.put(None)

    def send(self, **command: Any) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(json.dumps(command) + "\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"{self.label} is gone:\n{self.log_tail()}") from None

    def expect(self, event: str, timeout_s: float, **match: Any) -> dict[str, Any]:
        """The next event named ``event`` (with these field values); earlier other events are dropped."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise BenchError(f"{self.label}: no {event} {match or ''} within {timeout_s:.0f} s\n{self.log_tail()}")
            try:
                message = self._events.get(timeout=min(remaining_s, 1.0))
            except queue.Empty:
                MemoryGuard.check()
                continue
            if message is None:
                self._events.put(None)
                raise BenchError(f"{self.label} exited ({self.popen.poll()}) waiting for {event}:\n{self.log_tail()}")
            if message.get("event") == "error":
                raise BenchError(f"{self.label}: {message['error']}\n{self.log_tail()}")
            if message.get("event") == event and all(message.get(k) == v for k, v in match.items()):
                return message

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            try:
                self.popen.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        self._log.close()


def child_argv(host: Any, role: str, *extra: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", role, *extra]
    return host.argv(argv) if host is not None else argv


def run_quiet(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise BenchError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}")
    return result


def rate_bits_per_s(rate: str) -> float:
    """``1gbit`` -> 1e9 (tc's units: kbit, mbit, gbit; decimal)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"a rate is a number and kbit, mbit or gbit (tc's units), got {rate!r}")
    return float(match.group(1)) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


class LinkShaper:
    """``tbf`` on both ends of every host's veth (module docstring): a host sends and receives at most the rate."""

    def __init__(self, hosts: Any):
        tag = hosts.bridge[:-2]  # support.netns names the bridge tag + "br", the bridge ports tag + "v" + index
        self.links: dict[str, list[tuple[str | None, str]]] = {}
        for index, host in enumerate(hosts.hosts.values()):
            self.links[host.name] = [(host.namespace, host.ifname), (None, f"{tag}v{index}")]
        self.shaped: list[tuple[str | None, str]] = []

    @staticmethod
    def _tc(namespace: str | None, *args: str) -> list[str]:
        return ["tc", *(("-n", namespace) if namespace else ()), *args]

    def set_rate(self, rate: str) -> None:
        burst_bytes = max(64 * 1024, int(rate_bits_per_s(rate) / 8 * TBF_BURST_S))
        for ends in self.links.values():
            for namespace, device in ends:
                run_quiet(
                    self._tc(
                        namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                        "burst", str(burst_bytes), "latency", f"{TBF_LATENCY_MS}ms",
                    )
                )  # fmt: skip
                if (namespace, device) not in self.shaped:
                    self.shaped.append((namespace, device))

    def counters(self, host_name: str) -> dict[str, dict[str, int]]:
        """The tbf counters of a host's two ends: ``send`` (its eth0) and ``receive`` (its bridge port)."""
        out = {}
        for direction, (namespace, device) in zip(("send", "receive"), self.links[host_name], strict=True):
            shown = run_quiet(self._tc(namespace, "-s", "-j", "qdisc", "show", "dev", device), check=False)
            try:
                qdisc = next(q for q in json.loads(shown.stdout or "[]") if q.get("kind") == "tbf")
            except (ValueError, StopIteration):
                continue
            out[direction] = {k: int(qdisc.get(k, 0)) for k in ("bytes", "packets", "drops", "overlimits")}
        return out

    def remove(self) -> None:
        for namespace, device in self.shaped:
            run_quiet(self._tc(namespace, "qdisc", "del", "dev", device, "root"), check=False)
        self.shaped.clear()


class MemoryGuard:
    """Samples the anonymous and file-backed RSS of this process's descendants; stops the bench past a limit."""

    _instance: MemoryGuard | None = None

    def __init__(self, max_anon_bytes: int):
        self.max_anon_bytes = max_anon_bytes
        self.peak_anon_bytes = self.peak_file_bytes = 0
        self.failure: str | None = None
        self._stop = threading.Event()
        MemoryGuard._instance = self
        threading.Thread(target=self._run, daemon=True, name="memory-guard").start()

    @staticmethod
    def sample() -> tuple[int, int]:
        import psutil

        anon = file_backed = 0
        for process in psutil.Process().children(recursive=True):
            try:
                status = Path(f"/proc/{process.pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
            file_backed += int(fields.get("RssFile", "0 kB").split()[0]) * 1024
        return anon, file_backed

    def reset_peaks(self) -> None:
        self.peak_anon_bytes = self.peak_file_bytes = 0

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            anon, file_backed = self.sample()
            self.peak_anon_bytes = max(self.peak_anon_bytes, anon)
            self.peak_file_bytes = max(self.peak_file_bytes, file_backed)
            if anon > self.max_anon_bytes and self.failure is None:
                self.failure = (
                    f"the bench's processes held {anon / GiB:.1f} GiB (limit {self.max_anon_bytes / GiB:.1f})"
                )
                for process in psutil.Process().children(recursive=True):
                    try:
                        process.kill()
                    except psutil.Error:
                        pass

    @classmethod
    def check(cls) -> None:
        if cls._instance is not None and cls._instance.failure is not None:
            raise BenchError(f"memory guard: {cls._instance.failure}")

    def close(self) -> None:
        self._stop.set()


class Broker:
    """``primerl-broker`` on host ``b`` (ports 0, a run token, its own spool, Prometheus on its address)."""

    def __init__(self, host: Any, work_dir: Path, fanout: str, chunk_bytes: int):
        from support.netns import Proc

        work_dir.mkdir(parents=True, exist_ok=True)
        ready_file = work_dir / "ready.json"
        argv = [
            Path(sys.executable).parent / "primerl-broker",
            "--host", host.address, "--grpc-port", "0", "--rollout-port", "0", "--weight-port", "0",
            "--spool-dir", work_dir / "spool", "--run-id", "bench-crosshost", "--weight-fanout", fanout,
            "--weight-chunk-bytes", str(chunk_bytes), "--prometheus.host", host.address,
            "--prometheus.port", "0", "--log.level", "warning", "--ready-file", ready_file,
        ]  # fmt: skip
        env = {**os.environ, "PRIMERL_RUN_TOKEN": TOKEN}
        self.proc = Proc("broker", host, argv, env, work_dir / "broker.log", work_dir)
        deadline_s = time.monotonic() + BROKER_START_TIMEOUT_S
        while not ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline_s:
                self.proc.stop(10)
                raise BenchError(f"primerl-broker did not start:\n{self.proc.tail()}")
            time.sleep(0.05)
        ready = json.loads(ready_file.read_text())
        self.weight_endpoint = f"tcp://{host.address}:{ready['weight_port']}"
        self.grpc_address = f"{host.address}:{ready['grpc_port']}"
        self.metrics_url = ready["metrics_url"]
        self.idle_anon_bytes = self.anon_bytes()

    def anon_bytes(self) -> int:
        """The broker's anonymous RSS (``ip netns exec`` execs it: the child's pid is the broker's)."""
        try:
            status = Path(f"/proc/{self.proc.popen.pid}/status").read_text()
        except OSError:
            return 0
        line = next((line for line in status.splitlines() if line.startswith("RssAnon:")), "RssAnon: 0 kB")
        return int(line.split()[1]) * 1024

    def settle(self, payload_bytes: int, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
        """Wait until the broker freed the frames of the updates it holds (its durable file is written), as it has
        between the steps of a run; returns the seconds waited (``timeout_s`` at most)."""
        started_s = time.monotonic()
        while self.anon_bytes() > self.idle_anon_bytes + payload_bytes // 2:
            if time.monotonic() - started_s > timeout_s:
                print(f"  (the broker still holds {self.anon_bytes() / GiB:.2f} GiB after {timeout_s:.0f} s)")
                break
            time.sleep(0.2)
        return time.monotonic() - started_s

    def counters(self) -> dict[str, float]:
        from support.probes import scrape_metrics

        from primerl.proto import telemetry

        samples = scrape_metrics(self.metrics_url)
        names = {
            "bytes_pushed": telemetry.BROKER_WEIGHT_BYTES_PUSHED,
            "relay_chains": telemetry.BROKER_WEIGHT_RELAY_CHAINS,
            "relay_heals": telemetry.BROKER_WEIGHT_RELAY_HEALS,
        }
        return {key: samples.get((f"{name}_total", ()), 0.0) for key, name in names.items()}

    def stop(self) -> None:
        self.proc.stop(30)


# ---------------------------------------------------------------------------------------------------------
# the cases


@dataclass
class CaseResult:
    case: str
    model: str
    num_workers: int
    payload_bytes: int = 0
    last_s: Stats = field(default_factory=Stats)  # publish -> the last worker has it
    first_s: Stats = field(default_factory=Stats)  # publish -> the first worker has it
    acked_s: Stats = field(default_factory=Stats)  # publish -> the broker's ack reached the trainer
    build_ms: Stats = field(default_factory=Stats)
    sent_last_s: Stats = field(default_factory=Stats)  # the trainer's send starts -> the last worker has it
    sent_ratio: float | None = None  # the broker's pushed bytes / payload bytes published
    relay: str = ""
    peak_anon_bytes: int = 0
    peak_file_bytes: int = 0
    link: dict[str, Any] = field(default_factory=dict)

    def as_json(self, rate: str) -> dict[str, Any]:
        fields = {k: v for k, v in vars(self).items() if not isinstance(v, Stats)}
        stats = {k: v.values for k, v in vars(self).items() if isinstance(v, Stats)}
        return {"rate": rate, **fields, **stats}


class Bench:
    """Runs the cases of one rate on the hosts (module docstring)."""

    def __init__(self, args: argparse.Namespace, hosts: Any, work_dir: Path, trainer: Child, guard: MemoryGuard):
        self.args, self.hosts, self.work_dir, self.trainer, self.guard = args, hosts, work_dir, trainer, guard
        self.chunk_bytes = args.chunk_mib * MiB  # the broker's weight_chunk_bytes, which the trainer follows
        self.trainer_chunk_bytes = min(TRAINER_MAX_CHUNK_BYTES, self.chunk_bytes)
        self.num_runs = 0

    def release_trainer(self) -> None:
        """The trainer drops its publisher, sockets and mapped weights (skipped when it is gone: that is reported)."""
        if self.trainer.popen.poll() is None:
            self.trainer.send(op="release")
            self.trainer.expect("released", 60)

    def transfer_timeout_s(self, num_bytes: int, rate_bps: float, num_workers: int) -> float:
        return 120.0 + 4 * num_bytes * 8 / rate_bps * num_workers

    def publish_case(self, case: str, model: str, num_workers: int, rate: str, expected_bytes: int) -> CaseResult:
        rate_bps = rate_bits_per_s(rate)
        fanout = "chain" if case == "chain" else "star"
        self.num_runs += 1
        run_dir = self.work_dir / f"run{self.num_runs}-{case}-{model}-{rate}"
        result = CaseResult(case, model, num_workers)
        timeout_s = self.transfer_timeout_s(expected_bytes, rate_bps, num_workers)
        self.guard.reset_peaks()
        broker = Broker(self.hosts["b"], run_dir, fanout, self.chunk_bytes)
        workers: list[Child] = []
        try:
            for index in range(num_workers):  # one after the other: a chain follows the order of joining
                host = self.hosts[f"w{index}"]
                extra = ["--endpoint", broker.weight_endpoint, "--worker-id", f"w{index}", "--host-address"]
                extra = [*extra[:-1], "--grpc-address", broker.grpc_address, "--host-address"]
                extra += [host.address, *(["--relay"] if case == "chain" else [])]
                worker = Child(f"w{index}", child_argv(host, "subscriber", *extra), run_dir / f"w{index}.log")
                workers.append(worker)
                worker.expect("joined", PROCESS_START_TIMEOUT_S)
            states = ["init", "stepped"] if case == "delta" else ["stepped"]
            kind = "delta" if case == "delta" else "full"
            self.trainer.send(
                op="connect",
                endpoint=broker.weight_endpoint,
                kind=kind,
                model=model,
                states=states,
                chunk_bytes=self.trainer_chunk_bytes,
            )
            self.trainer.expect("connected", PROCESS_START_TIMEOUT_S)
            if case == "delta":
                plan = [("init", False)] + [("stepped", True), ("init", False)] * self.args.repeats
            else:
                plan = [("stepped", False)] * self.args.warmup + [("stepped", True)] * self.args.repeats
            published_bytes = 0
            for version, (state, timed) in enumerate(plan, 1):
                broker.settle(expected_bytes)
                self.trainer.send(op="publish", state=state, version=version, timeout_s=timeout_s)
                published = self.trainer.expect("published", timeout_s)
                held = [w.expect("update", timeout_s, version=version) for w in workers]
                if not all(h["ok"] for h in held):
                    raise BenchError(f"{case}: v{version} failed its digest check on a worker: {held}")
                wanted = "delta" if case == "delta" and version > 1 else "full"
                if published["kind"] != wanted:
                    raise BenchError(f"{case}: v{version} went as {published['kind']} ({published['fallback']})")
                published_bytes += published["payload_bytes"]
                start_s = published["start_s"]
                times = sorted(h["t"] - start_s for h in held)
                line = (
                    f"  [{rate} {case:5} {model}] v{version} {published['kind']:5} "
                    f"{published['payload_bytes'] / MiB:8.1f} MiB: ack {published['acked_s'] - start_s:6.2f} s, "
                    f"first {times[0]:6.2f} s, last {times[-1]:6.2f} s"
                    f"{'' if timed else ' (untimed)'}  phases {published['phases_ms']}"
                )
                print(line, flush=True)
                if timed:
                    result.payload_bytes = published["payload_bytes"]
                    result.last_s.add(times[-1])
                    result.first_s.add(times[0])
                    result.acked_s.add(published["acked_s"] - start_s)
                    build_ms = sum(v for k, v in published["phases_ms"].items() if k != "send")
                    result.build_ms.add(build_ms)
                    result.sent_last_s.add(times[-1] - build_ms / 1000)
            counters = broker.counters()
            result.sent_ratio = counters["bytes_pushed"] / max(1, published_bytes)
            if case == "chain":
                result.relay = f"chains {counters['relay_chains']:.0f}, heals {counters['relay_heals']:.0f}"
        finally:
            for worker in workers:
                worker.stop()
            broker.stop()
            self.release_trainer()
        result.peak_anon_bytes, result.peak_file_bytes = self.guard.peak_anon_bytes, self.guard.peak_file_bytes
        return result

    def raw_case(self, model: str, num_bytes: int, rate: str, shaper: LinkShaper) -> CaseResult:
        rate_bps = rate_bits_per_s(rate)
        self.num_runs += 1
        run_dir = self.work_dir / f"run{self.num_runs}-raw-{model}-{rate}"
        run_dir.mkdir(parents=True, exist_ok=True)
        result = CaseResult("raw", model, 1, payload_bytes=num_bytes)
        timeout_s = self.transfer_timeout_s(num_bytes, rate_bps, 1)
        self.guard.reset_peaks()
        host = self.hosts["w0"]
        receiver = Child("raw-w0", child_argv(host, "raw_receiver", "--host-address", host.address), run_dir / "w0.log")
        try:
            endpoint = receiver.expect("bound", PROCESS_START_TIMEOUT_S)["endpoint"]
            before = {name: shaper.counters(name) for name in ("t", "w0")}
            for _ in range(self.args.repeats):
                receiver.send(op="expect", num_bytes=num_bytes, timeout_s=timeout_s)
                receiver.expect("ready", 30)
                self.trainer.send(op="raw", endpoint=endpoint, num_bytes=num_bytes, chunk_bytes=self.chunk_bytes)
                sent = self.trainer.expect("raw_sent", timeout_s)
                received = receiver.expect("received", timeout_s)
                seconds = received["t"] - sent["start_s"]
                result.last_s.add(seconds)
                result.first_s.add(seconds)
                result.sent_last_s.add(seconds)
                print(
                    f"  [{rate} raw   {model}] {num_bytes / MiB:8.1f} MiB in {seconds:6.2f} s = "
                    f"{num_bytes * 8 / seconds / 1e9:.3f} Gb/s",
                    flush=True,
                )
            after = {name: shaper.counters(name) for name in ("t", "w0")}
        finally:
            receiver.stop()
            self.release_trainer()
        result.link = {
            "goodput_bps": num_bytes * 8 / result.last_s.median,
            "expected_s": num_bytes * 8 / (rate_bps * PAYLOAD_SHARE_AT_MTU_1500),
            "trainer_send": diff_counters(before["t"].get("send"), after["t"].get("send")),
            "worker_receive": diff_counters(before["w0"].get("receive"), after["w0"].get("receive")),
        }
        result.peak_anon_bytes, result.peak_file_bytes = self.guard.peak_anon_bytes, self.guard.peak_file_bytes
        return result


def diff_counters(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int]:
    if before is None or after is None:
        return {}
    return {key: after[key] - before.get(key, 0) for key in after}


# ---------------------------------------------------------------------------------------------------------
# plan, report


def lscpu_model_name() -> str:
    try:
        shown = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        shown = ""
    for line in shown.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    from cpu_info import cpu_phrase

    return cpu_phrase()


def anon_estimate_bytes(payload_bytes: int, case: str, num_workers: int) -> int:
    """Anonymous memory of a case at its peak (module docstring): workers, broker, the trainer's publisher, plus
    ~0.3 GiB per Python process."""
    trainer = 3 * payload_bytes if case == "delta" else 2 * payload_bytes
    return num_workers * payload_bytes + payload_bytes + trainer + int(0.3 * GiB) * (num_workers + 2)


def prepare(model: str, args: argparse.Namespace, states_dir: Path) -> dict[str, Any]:
    started_s = time.monotonic()
    out_dir = states_dir / model
    states_dir.mkdir(parents=True, exist_ok=True)
    child = Child(
        f"prepare-{model}",
        child_argv(None, "prepare", "--model", model, "--states-dir", str(out_dir)),
        states_dir / f"prepare-{model}.log",
    )
    try:
        info = child.expect("prepared", 3600)
    finally:
        child.stop()
    print(
        f"[{model}] {info['num_params'] / 1e6:.0f}M parameters, one AdamW step at lr {LR:g} changed "
        f"{info['changed_fraction']:.2%} of the bf16 elements; payload {info['file_bytes'] / MiB:.0f} MiB "
        f"({time.monotonic() - started_s:.0f} s)",
        flush=True,
    )
    return info


def cell(stats: Stats) -> str:
    return stats.cell(3) if len(stats) else "—"


def ratio(numerator: CaseResult | None, denominator: CaseResult | None, from_send: bool = False) -> float | None:
    """Median over median of publish -> last worker has it (``from_send``: from the start of the send)."""
    if numerator is None or denominator is None:
        return None
    top, bottom = (
        (numerator.sent_last_s, denominator.sent_last_s) if from_send else (numerator.last_s, denominator.last_s)
    )
    return top.median / bottom.median if len(top) and len(bottom) else None


def ratio_note(numerator: CaseResult | None, denominator: CaseResult | None) -> str:
    value = ratio(numerator, denominator, from_send=True)
    return f"(from the send, the build left out: {fmt(value)})" if value is not None else ""


def report_rate(rate: str, results: list[CaseResult], args: argparse.Namespace) -> list[str]:
    """The markdown of one rate: the table, the ratios, the link check."""
    from report import markdown_table

    rate_bps = rate_bits_per_s(rate)
    lines = [f"#### Link rate {rate} ({rate_bps / 1e9:g} Gb/s on every host's link, both directions)", ""]
    header = [
        "case",
        "model",
        "workers",
        "payload MiB",
        "publish -> last worker has it, s",
        "-> first worker, s",
        "-> broker ack, s",
        "build, ms",
        "send -> last worker has it, s",
        "broker sent / payload",
        "peak RSS anon / file, GiB",
    ]
    rows = [
        [
            CASE_LABELS[r.case] + (f" ({r.relay})" if r.relay else ""),
            r.model,
            r.num_workers,
            fmt(r.payload_bytes / MiB, 4),
            cell(r.last_s),
            cell(r.first_s) if r.num_workers > 1 else "",
            cell(r.acked_s) if r.case != "raw" else "",
            cell(r.build_ms) if r.case != "raw" else "",
            cell(r.sent_last_s),
            fmt(r.sent_ratio, 3) if r.sent_ratio is not None else "",
            f"{r.peak_anon_bytes / GiB:.1f} / {r.peak_file_bytes / GiB:.1f}",
        ]
        for r in results
    ]
    lines += [markdown_table(header, rows), ""]
    by_key = {(r.case, r.model): r for r in results}
    model, fanout_model = args.model, args.fanout_model
    one = by_key.get(("full", fanout_model))
    pairs = {
        "delta": (by_key.get(("delta", model)), by_key.get(("full", model))),
        "chain": (by_key.get(("chain", fanout_model)), one),
        "star": (by_key.get(("star", fanout_model)), one),
    }
    name = f"DELTA / FULL, one worker, {model}"
    if "delta" in args.cases and math.isclose(rate_bps, 1e9):
        lines.append(
            target_line(name, ratio(*pairs["delta"]), "<=", TARGET_DELTA_OVER_FULL, ratio_note(*pairs["delta"]))
        )
    elif "delta" in args.cases:
        lines.append(f"- {name}: {fmt(ratio(*pairs['delta']))} {ratio_note(*pairs['delta'])}; its target is at 1 Gb/s")
    name = f"chain last worker / one-worker FULL, {args.workers} workers, {fanout_model}"
    if "chain" in args.cases:
        lines.append(
            target_line(name, ratio(*pairs["chain"]), "<=", TARGET_CHAIN_OVER_ONE, ratio_note(*pairs["chain"]))
        )
    if ratio(*pairs["star"]) is not None:
        lines.append(
            f"- star last worker / one-worker FULL, {args.workers} workers, {fanout_model}: "
            f"{fmt(ratio(*pairs['star']))} {ratio_note(*pairs['star'])}; expected ~{args.workers}: the broker's link "
            "carries every worker's copy"
        )
    for name in dict.fromkeys([model, fanout_model]):
        pair = (by_key.get(("full", name)), by_key.get(("raw", name)))
        if ratio(*pair) is not None:
            lines.append(f"- FULL / raw send, {name}: {fmt(ratio(*pair))} {ratio_note(*pair)}")
    for name in dict.fromkeys([model, fanout_model]):
        raw = by_key.get(("raw", name))
        if raw is None or not raw.link:
            continue
        link, sent, received = raw.link, raw.link["trainer_send"], raw.link["worker_receive"]
        lines.append(
            f"- link check ({name}): the raw send moved {raw.payload_bytes * 8 / 1e9:.3f} Gb of payload in "
            f"{raw.last_s.median:.3f} s (median) = {link['goodput_bps'] / 1e9:.3f} Gb/s, "
            f"{link['goodput_bps'] / rate_bps:.3f} of the rate (at most {PAYLOAD_SHARE_AT_MTU_1500:.3f} with TCP/IP "
            f"and Ethernet headers at MTU 1500: {link['expected_s']:.3f} s). tbf counters over the raw sends: "
            f"trainer's eth0 {sent.get('bytes', 0) / 1e9:.3f} GB, {sent.get('overlimits', 0)} overlimits, "
            f"{sent.get('drops', 0)} drops; the worker's bridge port {received.get('bytes', 0) / 1e9:.3f} GB, "
            f"{received.get('overlimits', 0)} overlimits, {received.get('drops', 0)} drops"
        )
    lines.append("")
    return lines


def case_plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(case, model) in the order run: ``--model``'s cases, then the fan-out cases' model's (with its one-worker
    FULL and raw send, the denominators of their ratios)."""
    plan = []
    for case in args.cases:
        if case in ("full", "delta", "raw") or args.fanout_model == args.model:
            plan.append((case, args.model))
    if args.fanout_model != args.model and any(c in args.cases for c in ("star", "chain")):
        plan += [(case, args.fanout_model) for case in ("full", "star", "chain", "raw") if case in args.cases]
    return plan


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="comma-separated tc rates (kbit, mbit, gbit)")
    parser.add_argument("--model", default="1b", choices=["1b", "100m", "tiny"], help="cases 1, 2, 5")
    parser.add_argument(
        "--fanout-model",
        default="auto",
        choices=["auto", "1b", "100m", "tiny"],
        help="cases 3 and 4 (auto: --model when its memory estimate fits --max-anon-gib, else 100m)",
    )
    parser.add_argument("--workers", type=int, default=4, help="workers of cases 3 and 4")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed FULL updates before cases 1, 3, 4")
    parser.add_argument(
        "--chunk-mib", type=int, default=8, help="weight chunk size, MiB (the broker's weight_chunk_bytes)"
    )
    parser.add_argument("--cases", default="full,delta,star,chain,raw", help=f"comma-separated of {list(CASE_LABELS)}")
    parser.add_argument("--max-anon-gib", type=float, default=9.0, help="memory the bench's processes may hold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables here")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--states-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-id", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--host-address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return args
    args.rates = [rate.strip() for rate in args.rates.split(",") if rate.strip()]
    args.cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    try:
        for rate in args.rates:
            rate_bits_per_s(rate)
    except ValueError as exc:
        parser.error(str(exc))
    unknown = [case for case in args.cases if case not in CASE_LABELS]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASE_LABELS)}")
    if args.repeats < 1 or args.warmup < 0 or args.workers < 2 or not 1 <= args.chunk_mib <= 64:
        parser.error("--repeats >= 1, --warmup >= 0, --workers >= 2, 1 <= --chunk-mib <= 64")
    return args


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    from support.netns import Hosts, namespaces_available

    ok, why = namespaces_available()
    if not ok or shutil.which("tc") is None:
        print(f"cannot run: {why or 'no `tc` command (iproute2)'}", file=sys.stderr)
        return 2
    cpu = lscpu_model_name()
    section = Section("Cross-host weight updates under a bandwidth limit", argv)
    print(f"CPU: {cpu}\n{section.lines[2]}", flush=True)
    guard = MemoryGuard(int((args.max_anon_gib + 1) * GiB))
    work_dir = Path(tempfile.mkdtemp(prefix="primerl-crosshost-"))
    made: dict[str, Any] = {}

    def cleanup() -> None:
        trainer = made.pop("trainer", None)
        if trainer is not None:
            trainer.stop(10)
        shaper = made.pop("shaper", None)
        if shaper is not None:
            shaper.remove()
        hosts = made.pop("hosts", None)
        if hosts is not None:
            hosts.close()
        shutil.rmtree(work_dir, ignore_errors=True)

    atexit.register(cleanup)
    previous_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        states_dir = work_dir / "states"
        infos = {args.model: prepare(args.model, args, states_dir)}
        notes = []
        fanout_cases = [c for c in args.cases if c in ("star", "chain")]
        if args.fanout_model == "auto":
            needed = anon_estimate_bytes(infos[args.model]["file_bytes"], "full", args.workers)
            args.fanout_model = args.model if needed <= args.max_anon_gib * GiB or not fanout_cases else "100m"
            if args.fanout_model != args.model:
                notes.append(
                    f"Cases 3 and 4 ran at 100m: at {args.model} they would hold ~{needed / GiB:.1f} GiB "
                    f"({args.workers} workers' copies, the broker's, the trainer's), over --max-anon-gib "
                    f"{args.max_anon_gib:g}."
                )
        if args.fanout_model not in infos and fanout_cases:
            infos[args.fanout_model] = prepare(args.fanout_model, args, states_dir)
        plan = case_plan(args)
        for case, model in plan:
            workers = args.workers if case in ("star", "chain") else 1
            estimate = anon_estimate_bytes(infos[model]["file_bytes"], case, workers)
            print(f"memory estimate, {case} at {model} to {workers}: {estimate / GiB:.1f} GiB", flush=True)
        hosts = made["hosts"] = Hosts.create(["t", "b", *(f"w{i}" for i in range(args.workers))], mode="netns")
        print(hosts.describe(), flush=True)
        shaper = made["shaper"] = LinkShaper(hosts)
        shaper.set_rate(args.rates[0])
        trainer = made["trainer"] = Child(
            "trainer",
            child_argv(hosts["t"], "trainer", "--states-dir", str(states_dir), "--seed", str(args.seed)),
            work_dir / "trainer.log",
        )
        bench = Bench(args, hosts, work_dir, trainer, guard)
        section.line(
            f"CPU: {cpu} ({os.cpu_count()} cores). Hosts: network namespaces on one bridge; every host's veth "
            f"limited to the rate in both directions (tbf, burst {TBF_BURST_S * 1000:g} ms of the rate, latency "
            f"{TBF_LATENCY_MS} ms). One AdamW step at lr {LR:g} from initial weights, published in bf16 by "
            f"`PolicyPublisher` through a `primerl-broker` process to `WeightSubscriber` processes (has it = the "
            f"whole update held and digest-checked); chunks of {bench.trainer_chunk_bytes // MiB} MiB; "
            f"{args.repeats} timed updates per case ({args.warmup} untimed before each FULL case). Times: median "
            f"(min–max, n). `bench/weight_crosshost.py` (module docstring) says how."
        )
        section.line()
        for model, info in infos.items():
            section.line(
                f"- {model}: {info['num_params'] / 1e6:.0f}M parameters, payload {info['file_bytes'] / MiB:.0f} "
                f"MiB in bf16, {info['changed_fraction']:.2%} of the elements changed by the step"
            )
        for note in notes:
            section.line(f"- {note}")
        section.line()
        measured: list[dict[str, Any]] = []
        for rate in args.rates:
            shaper.set_rate(rate)
            results = []
            for case, model in plan:
                if case == "raw":
                    results.append(bench.raw_case(model, infos[model]["file_bytes"], rate, shaper))
                else:
                    workers = args.workers if case in ("star", "chain") else 1
                    results.append(bench.publish_case(case, model, workers, rate, infos[model]["file_bytes"]))
            measured += [result.as_json(rate) for result in results]
            lines = report_rate(rate, results, args)
            for line in lines:
                section.line(line)
            print("\n" + "\n".join(lines), flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        guard.close()
        cleanup()
        atexit.unregister(cleanup)
    if args.markdown:
        section.write(args.markdown)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "infos": infos, "results": measured}, indent=1))
    print("\n" + section.text(), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args)
    return run(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
