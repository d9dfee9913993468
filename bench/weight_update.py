#!/usr/bin/env python
"""Weight updates from publish to "applied" at scale, next to a raw zmq send and the filesystem hand-off.

    .venv/bin/python bench/weight_update.py [--models tiny,100m] [--dtypes fp32] [--kinds full,lora,delta]
                                            [--repeats 3] [--warmup 1] [--lr 1e-5] [--delta-policy auto|always]
                                            [--markdown PATH] [--plots-dir DIR] [--quick] [--stream auto|on|off]

Points: ``--models`` (tiny, 100m, 500m, 1b of the Qwen2 family, and 100m-mistral, 100m-phi3 in fp32:
``scale_models.py``) times ``--dtypes`` (fp32,
bf16); a model may name its own dtypes (``tiny:fp32,100m:fp32+bf16,1b:bf16``). ``--quick``: tiny in fp32
and 100m in bf16, whatever ``--models`` says. Each point's checkpoint is stored in its dtype, its
``primerl-infer`` serves that dtype (``--model.dtype``), and the trainer side loads the model in it
(``optimization_dtype``) and publishes with ``PolicyPublisher(serving_dtype=bf16)`` for bf16 (for fp32, the
model's own dtype: no cast, no snapshot copy). Chunks of ``min(64 MiB, the broker's chunk size)``, as the
trainer sends. Before each update the machine must have 3 x the checkpoint + 2 GiB available (it is shared);
otherwise the point stops there and says so (its figures come from the updates before).

Per point: a ``primerl-broker`` subprocess (ports 0) and one ``primerl-infer`` subprocess on the model
(``--enable-lora --max-lora-rank 16``). Points up to ``START_TOGETHER_BYTES`` of checkpoint start their daemons
together; larger ones one at a time (memory). Then, once every daemon of the group is up and idle, for FULL, LORA
(rank 16 on q/k/v/o) and DELTA updates (LORA and DELTA only on models up to ``SMALL_MODEL_MAX_PARAMS``), each
after one real AdamW step on a few tokens (larger models: every parameter scaled by 1 +- 2^-6 instead, since
AdamW's state of a 1B model would not fit beside the daemons):

- publish->applied: from ``PolicyPublisher.publish`` (build: read the parameters, cast, encode, digest; send:
  chunks to the broker; ``--stream on``: FULL updates larger than a chunk are streamed, build and send
  overlapping; ``auto``, as the trainer: streamed when the weights are on a GPU, so not here) until the worker
  logs ``weight update live`` for the version (after its WEIGHT_ACK;
  the log is read every 1 ms; the broker's run status, asked every second, is the fallback);
- broker ack: until ``publish`` returns (the broker stored the update and acknowledged it);
- worker has it: until the worker logs ``weight update received`` (its subscriber holds the whole update);
- worker apply: the ``apply_ms`` the worker reports (arrival to serving: checks, load, resume);
- memory: peak RSS during the update (``proc_memory.py``: VmHWM reset before it) of the broker process and of
  the inference worker (the daemon and its engine core, summed);
- generation pause: the ``update_pause_ms`` of the worker's ``weight update live`` line, else from its Prometheus
  ``/metrics`` (``update_pause``: histogram sum / count over the update), when the worker reports one; else the
  column says the metric is missing;
- raw zmq: one pyzmq PUSH->PULL send of the same number of bytes over TCP loopback to a receiver in another
  process (``copy=False`` both sides), until the receiver says it has them; raw copy: ``bytearray`` of them
  (payloads under 1 GiB). Both right after each update, in the same run.

Then, with that point's daemon and broker stopped, the filesystem hand-off of FULL updates (``fs_handoff.py``):
the same trainer model, written with ``save_file`` in the serving dtype to a fresh directory, loaded by a twin
vLLM engine (same ``EngineOptions``, its own process) with ``collective_rpc("reload_weights", kwargs=
{"weights_path": dir})``; write and load are reported apart, and a raw zmq send of the same bytes follows each
(the machine's load in this phase). The daemon itself cannot be asked to load a directory (it serves no such
route), hence the twin.

The DELTA publisher's first publish is FULL (no base yet) and is not counted; ``--delta-policy auto`` may send
a DELTA as FULL ("sent" column). ``--warmup`` updates of each kind run before the ``--repeats`` counted; tables
show medians, the markdown min / median / max. A second table gives delta size / FULL size after one AdamW step
(fp32 points of tiny and 100m; XOR + zlib level 1). Targets, printed as met / missed (ratios from this run):
1B bf16 FULL publish->applied <= 0.7x the filesystem hand-off and (stretch) <= 1.5x the raw send; broker peak
RSS <= payload + 256 MiB; pause p50 at 100M <= 50 ms; the tiny model's FULL publish->applied no slower than
the last part e figure committed in bench/RESULTS.md (10 % noise allowed); 100M FULL <= 5x raw,
DELTA never slower than FULL. ``--markdown PATH`` writes the part-e section; the plot of update time against
payload size goes to ``--plots-dir``. Every process started here is stopped on exit; the models live in a
temporary directory that is removed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fs_handoff import FilesystemHandoff  # noqa: E402
from proc_memory import PeakRss, descendants  # noqa: E402
from scale_models import DTYPES, ModelPoint, build_point, model_specs  # noqa: E402

from primerl.proto import telemetry
from primerl.proto.units import GiB, MiB  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"
POLICY_NAME = "policy"
LORA_RANK = 16
LORA_ALPHA = 32.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MAX_MODEL_LEN = 512
NUM_TRAIN_TOKENS = 16
DELTA_FRACTION_LRS = (1e-6, 1e-5)
START_TIMEOUT_S = 600.0
APPLY_TIMEOUT_S = 300.0
RAW_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
STATUS_POLL_S = 1.0
"""How often the broker's run status is asked, as the fallback of the worker's log (a cost to the broker)."""
STATUS_GRACE_S = 1.0
KINDS = ("full", "full-socket", "lora", "delta")
"""``full-socket``: a FULL update sent as bytes through the broker (``transport = "socket"``, the road across hosts and
before the same-host road), beside ``full`` (``transport = "auto"``: on one host, through shared memory)."""
BIN = Path(sys.executable).parent
TRAINER_MAX_CHUNK_BYTES = 64 * MiB
"""The trainer publishes chunks of min(this, the broker's weight_chunk_bytes) (trainer/runner.py)."""
SMALL_MODEL_MAX_PARAMS = 200_000_000
"""Up to this size: a real AdamW step before each update, and LORA and DELTA measured too."""
NUDGE = 1.0 + 2.0**-6
"""Larger models: every parameter multiplied by this (odd versions) or divided by it (even) before an update."""
START_TOGETHER_BYTES = 1 * GiB
"""Points whose checkpoints add up to at most this start their daemons at once."""
RAW_COPY_MAX_BYTES = 1 * GiB
QUICK_MODELS = "tiny:fp32,100m:bf16"
MEMORY_HEADROOM_CHECKPOINTS = 3
MEMORY_RESERVE_BYTES = 2 * GiB
"""An update starts only with 3 x the checkpoint + 2 GiB available: the machine is shared, and an update grows the
worker and the raw receiver by about the payload each (the rest of a point's memory is taken already)."""
BROKER_RSS_SLACK_BYTES = 256 * MiB
"""Target: the broker's peak RSS during an update <= payload + this."""
FS_TARGET_RATIO = 0.7
RAW_STRETCH_RATIO = 1.5
PAUSE_TARGET_MS = 50.0
SCALE_TARGET = ModelPoint("1b", "bf16")
PAUSE_TARGET_MODEL = "100m"
NOISE_TOLERANCE = 1.10
"""Medians of separate runs of one path: within 10 % counts as "not slower" (the shared machine's noise)."""
PAUSE_METRIC = "update_pause"
"""The worker's generation-pause metric (``inference/update_pause_ms``), matched by this part of its name."""


# ---------------------------------------------------------------------------------------------------------
# raw loopback zmq receiver (its own process, as the inference worker is)


def raw_receiver_main(conn: Any) -> None:
    """PULL socket on loopback: reports its port, then the size of each message received; b"" stops it."""
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    try:
        while True:
            if not socket.poll(int(RAW_TIMEOUT_S * 1000) * 10):
                return  # the parent is gone
            frame = socket.recv(copy=False)
            size = len(frame.buffer)
            del frame  # free a large message before the next arrives
            if size == 0:
                return
            conn.send(size)
    finally:
        socket.close()
        context.term()


class RawZmq:
    """The sender side of the raw PUSH->PULL measurement."""

    def __init__(self) -> None:
        import zmq

        parent, child = mp.get_context("spawn").Pipe()
        self.conn = parent
        self.process = mp.get_context("spawn").Process(target=raw_receiver_main, args=(child,), daemon=True)
        self.process.start()
        if not parent.poll(RAW_TIMEOUT_S):
            raise RuntimeError("the raw zmq receiver did not report its port")
        port = parent.recv()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def send_ms(self, buffer: memoryview) -> float:
        start = time.perf_counter()
        self.socket.send(buffer, copy=False)
        if not self.conn.poll(RAW_TIMEOUT_S):
            raise RuntimeError(f"the raw zmq receiver did not get {buffer.nbytes} bytes in {RAW_TIMEOUT_S} s")
        size = self.conn.recv()
        elapsed = (time.perf_counter() - start) * 1000.0
        assert size == buffer.nbytes, (size, buffer.nbytes)
        return elapsed

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.socket.send(b"")
                self.process.join(5)
        finally:
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
            self.socket.close()
            self.context.term()


class RawBytes:
    """Real bytes for the raw paths: the point's checkpoint file, mapped read-only (no extra memory; its size is
    the FULL payload's, give or take the header), or, when that is shorter, random non-zero bytes grown as
    needed."""

    def __init__(self) -> None:
        self._array: Any = None
        self._maps: dict[Path, mmap.mmap] = {}

    def view(self, num_bytes: int, checkpoint: Path | None = None) -> memoryview:
        if checkpoint is not None and checkpoint.is_file() and checkpoint.stat().st_size >= num_bytes:
            if checkpoint not in self._maps:
                with open(checkpoint, "rb") as f:
                    self._maps[checkpoint] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return memoryview(self._maps[checkpoint])[:num_bytes]
        import numpy as np

        if self._array is None or self._array.nbytes < num_bytes:
            self._array = None
            self._array = np.random.default_rng(0).integers(1, 255, num_bytes, dtype=np.uint8)
        return memoryview(self._array)[:num_bytes]

    def close(self) -> None:
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:
                continue  # a zmq frame still holds a view; the mapping goes with the process
        self._maps.clear()


def raw_copy_ms(buffer: memoryview) -> float:
    start = time.perf_counter()
    copy = bytearray(buffer)
    elapsed = (time.perf_counter() - start) * 1000.0
    assert len(copy) == buffer.nbytes
    return elapsed


# ---------------------------------------------------------------------------------------------------------
# broker and daemon processes


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def read_ready(path: Path, process: subprocess.Popen, what: str, log_tail: Any) -> dict[str, Any] | None:
    """The ready file's JSON once written; None before; raises when the process exited."""
    if process.poll() is not None:
        raise RuntimeError(f"{what} exited with code {process.returncode}:\n{log_tail()}")
    if not path.exists():
        return None
    return json.loads(path.read_text())


class BrokerProcess:
    """A ``primerl-broker`` child process (all ports 0, no Prometheus) and a control client of it."""

    def __init__(self, work_dir: Path, run_id: str):
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "broker.log"
        self.ready_file = work_dir / "broker-ready.json"
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.ready: dict[str, Any] | None = None
        self._client: Any = None
        self.process = subprocess.Popen(
            [
                str(BIN / "primerl-broker"),
                "--host",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--rollout-port",
                "0",
                "--weight-port",
                "0",
                "--spool-dir",
                str(work_dir / "spool"),
                "--run-id",
                run_id,
                "--prometheus.host",
                "127.0.0.1",
                "--ready-file",
                str(self.ready_file),
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN},
            cwd=work_dir,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready is None:
            self.ready = read_ready(self.ready_file, self.process, "primerl-broker", self.log_tail)
            if self.ready is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"primerl-broker did not start within {timeout_s} s:\n{self.log_tail()}")
                time.sleep(0.05)

    @property
    def grpc_address(self) -> str:
        assert self.ready is not None
        return f"127.0.0.1:{self.ready['grpc_port']}"

    @property
    def weight_endpoint(self) -> str:
        assert self.ready is not None
        return f"tcp://127.0.0.1:{self.ready['weight_port']}"

    def bytes_pushed(self) -> float:
        """The payload bytes the broker has sent to inference workers (``primerl_broker_weight_bytes_pushed_total``
        on its ``/metrics``): 0 for an update a same-host worker read from shared memory."""
        assert self.ready is not None and self.ready.get("metrics_url")
        request = urllib.request.Request(self.ready["metrics_url"], headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("primerl_broker_weight_bytes_pushed_total "):
                    return float(line.split()[1])
        raise RuntimeError("the broker's /metrics has no primerl_broker_weight_bytes_pushed_total")

    @property
    def chunk_bytes(self) -> int:
        """What the trainer sends: min(64 MiB, the broker's chunk size; this broker runs the default config)."""
        from primerl.proto.data_plane_limits import DEFAULT_BROKER_LIMITS

        return min(TRAINER_MAX_CHUNK_BYTES, DEFAULT_BROKER_LIMITS.weight_chunk_bytes)

    def worker_versions(self) -> dict[str, int | None]:
        """Registered worker id -> the policy version the broker says it acknowledged (None: none yet)."""
        if self._client is None:
            from primerl.client.control import ControlClient
            from primerl.runtime.config_common import BrokerClientConfig

            self._client = ControlClient(
                BrokerClientConfig(address=self.grpc_address, run_token=TOKEN), "client", "bench-weight-update"
            )
        return {
            w.worker_id: w.policy_version if w.HasField("policy_version") else None
            for w in self._client.get_run_status(timeout_s=10).workers
        }

    def log_tail(self, num_chars: int = 3000) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        stop_process(self.process)
        self.log_file.close()


class LogWatcher:
    """Reads a daemon's log as it grows; remembers when (``perf_counter``) each version's update events appeared
    and the ``key=value`` fields of their lines."""

    RECEIVED = telemetry.WEIGHT_UPDATE_RECEIVED
    LIVE = telemetry.WEIGHT_UPDATE_LIVE
    APPLIED = telemetry.WEIGHT_UPDATE_APPLIED  # the engine's phases (PolicyUpdater)

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""
        self.seen_s: dict[tuple[str, int], float] = {}
        self.fields: dict[tuple[str, int], dict[str, str]] = {}

    def poll(self) -> None:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return
        if size <= self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        now = time.perf_counter()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            for event in (self.RECEIVED, self.LIVE, self.APPLIED):
                if event not in line:
                    continue
                match = re.search(r"\bpolicy_version=(\d+)\b", line)
                if match:
                    key = (event, int(match[1]))
                    self.seen_s.setdefault(key, now)
                    self.fields[key] = dict(re.findall(r"\b(\w+)=([^\s,]+)", line))


class Daemon:
    """One ``primerl-infer`` child process on a model in one dtype, joined to a broker."""

    def __init__(self, work_dir: Path, model_dir: Path, dtype_name: str, grpc_address: str):
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "infer.log"
        self.ready_file = work_dir / "infer-ready.json"
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.started_s = time.monotonic()
        self.ready: dict[str, Any] | None = None
        self.start_s: float | None = None
        self.pids: list[int] = []
        self.watcher = LogWatcher(self.log_path)
        self.process = subprocess.Popen(
            [
                str(BIN / "primerl-infer"),
                "--model.name",
                str(model_dir),
                "--model.max-model-len",
                str(MAX_MODEL_LEN),
                "--model.dtype",
                dtype_name,
                "--enable-lora",
                "--max-lora-rank",
                str(LORA_RANK),
                "--server.port",
                "0",
                "--broker.address",
                grpc_address,
                "--broker.connect-timeout-s",
                "60",
                "--ready-file",
                str(self.ready_file),
            ],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PRIMERL_RUN_TOKEN": TOKEN},
            cwd=work_dir,
        )

    @staticmethod
    def inference_config(model_dir: Path, dtype_name: str) -> Any:
        """The ``InferenceConfig`` of the daemon's command line (for its filesystem hand-off twin)."""
        from primerl.configs.inference import InferenceConfig

        return InferenceConfig(
            model={"name": str(model_dir), "max_model_len": MAX_MODEL_LEN, "dtype": dtype_name},
            enable_lora=True,
            max_lora_rank=LORA_RANK,
        )

    def poll_ready(self) -> bool:
        if self.ready is not None:
            return True
        self.ready = read_ready(self.ready_file, self.process, "primerl-infer", self.log_tail)
        if self.ready is None:
            return False
        self.start_s = time.monotonic() - self.started_s
        self.pids = [self.process.pid, *descendants(self.process.pid)]
        return True

    @property
    def worker_id(self) -> str:
        assert self.ready is not None
        return self.ready["worker_id"]

    def apply_ms(self, version: int) -> float:
        value = self.watcher.fields.get((LogWatcher.LIVE, version), {}).get("apply_ms")
        return float(value) if value is not None else float("nan")

    def apply_phases(self, version: int) -> dict[str, float]:
        """The ``*_ms`` phases the daemon logged for applying ``version``."""
        fields = {
            **self.watcher.fields.get((LogWatcher.APPLIED, version), {}),
            **self.watcher.fields.get((LogWatcher.LIVE, version), {}),
        }
        out = {}
        for key, value in fields.items():
            if key.endswith("_ms") and key != "apply_ms":
                try:
                    out[key.removesuffix("_ms")] = float(value)
                except ValueError:
                    continue  # not a number: not a phase
        return out

    def pause_samples(self) -> dict[str, float]:
        """The samples of the worker's generation-pause metric on its ``/metrics`` ({} when it has none)."""
        assert self.ready is not None
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.ready['http_port']}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode(errors="replace")
        samples = {}
        for line in text.splitlines():
            if line.startswith("#") or PAUSE_METRIC not in line:
                continue
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue  # not a sample line
        return samples

    def logged_pause_ms(self, version: int) -> float | None:
        for key, value in self.watcher.fields.get((LogWatcher.LIVE, version), {}).items():
            if "pause" in key and key.endswith("_ms"):
                try:
                    return float(value)
                except ValueError:
                    return None
        return None

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        stop_process(self.process)
        self.log_file.close()


def pause_ms_between(before: dict[str, float], after: dict[str, float]) -> float | None:
    """One update's pause from two scrapes of the pause metric: a histogram's (or summary's) sum / count over
    the update, else a gauge's value after it; seconds are turned into ms. None: no metric."""

    def base(name: str) -> str:
        return name.split("{")[0]

    sums = [k for k in after if base(k).endswith("_sum")]
    counts = [k for k in after if base(k).endswith("_count")]
    scale = 1000.0 if any("seconds" in base(k) for k in after) else 1.0
    if sums and counts:
        d_count = after[counts[0]] - before.get(counts[0], 0.0)
        d_sum = after[sums[0]] - before.get(sums[0], 0.0)
        return d_sum / d_count * scale if d_count > 0 else None
    gauges = [k for k in after if not base(k).endswith(("_bucket", "_created", "_total"))]
    return after[gauges[0]] * scale if gauges else None


def pause_metric_in_source() -> bool:
    """Whether the inference worker's code mentions the pause metric at all."""
    return any(PAUSE_METRIC in path.read_text(errors="replace") for path in (ROOT / "inference").glob("*.py"))


@dataclass
class Point:
    """One point under test: a model in a dtype, its files, broker, daemon and the measurements taken on it."""

    point: ModelPoint
    model_dir: Path
    num_params: int
    broker: BrokerProcess | None = None
    daemon: Daemon | None = None
    next_version: int = 1
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    sent: dict[str, list[str]] = field(default_factory=dict)  # kind asked for -> kinds sent
    fs: dict[str, list[float]] = field(default_factory=dict)
    fs_start_s: float | None = None
    full_model: Any = None  # (model, optimizer) of the FULL publisher, kept for the filesystem hand-off
    pause_in_log: bool = False  # the worker logs each update's pause (no /metrics scrape needed)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.point.label

    @property
    def dtype_name(self) -> str:
        return self.point.torch_dtype_name

    @property
    def small(self) -> bool:
        return self.num_params <= SMALL_MODEL_MAX_PARAMS

    @property
    def checkpoint(self) -> Path | None:
        files = sorted(self.model_dir.glob("*.safetensors"))
        return files[0] if len(files) == 1 else None

    @property
    def checkpoint_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))

    def memory_allows(self, what: str) -> bool:
        """Whether the machine has room for one more update of this point (MEMORY_HEADROOM_CHECKPOINTS x its
        checkpoint + MEMORY_RESERVE_BYTES available); if not, says so in a note and on the console."""
        needed = MEMORY_HEADROOM_CHECKPOINTS * self.checkpoint_bytes + MEMORY_RESERVE_BYTES
        available = memory_available_bytes()
        if available >= needed:
            return True
        note = (
            f"stopped before {what}: {available / MiB:.0f} MiB available, {needed / MiB:.0f} MiB wanted "
            f"(shared machine); the figures of this point are from the updates before"
        )
        self.notes.append(note)
        print(f"  {self.name}: {note}", flush=True)
        return False

    def take_version(self) -> int:
        version = self.next_version
        self.next_version += 1
        return version

    def wait_applied(self, version: int, start_s: float) -> tuple[float, float | None, str]:
        """Wait until the worker serves ``version``: (seconds from ``start_s`` to the ``weight update live`` line,
        to its ``weight update received`` line or None, what told). The broker's run status is the fallback, asked
        every ``STATUS_POLL_S`` (a cost to the broker); when it tells first, the log line is still awaited for
        ``STATUS_GRACE_S`` (the worker acknowledges just before it logs)."""
        assert self.daemon is not None and self.broker is not None
        watcher = self.daemon.watcher
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        next_status_s = time.monotonic() + STATUS_POLL_S
        status_s: float | None = None  # perf_counter when the broker's status said applied
        while True:
            watcher.poll()
            live = watcher.seen_s.get((LogWatcher.LIVE, version))
            received = watcher.seen_s.get((LogWatcher.RECEIVED, version))
            received_after = None if received is None else received - start_s
            if live is not None:
                return live - start_s, received_after, "log"
            now = time.monotonic()
            if status_s is not None and time.perf_counter() - status_s > STATUS_GRACE_S:
                return status_s - start_s, received_after, "run status"
            if status_s is None and now >= next_status_s:
                next_status_s = now + STATUS_POLL_S
                if (self.broker.worker_versions().get(self.daemon.worker_id) or 0) >= version:
                    status_s = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"{self.name}: the worker did not apply v{version} within {APPLY_TIMEOUT_S} s")
            time.sleep(0.001)


def memory_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


# ---------------------------------------------------------------------------------------------------------
# training side


def adamw_step(model: Any, optimizer: Any, seed: int) -> None:
    """One real optimizer step: next-token loss on a few random tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (1, NUM_TRAIN_TOKENS), generator=generator)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def nudge_step(model: Any, version: int) -> None:
    """Change every parameter (a stand-in for an optimizer step of a model too large for AdamW's state here)."""
    import torch

    factor = NUDGE if version % 2 else 1.0 / NUDGE
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(factor)


def train_step(model: Any, optimizer: Any | None, version: int) -> None:
    if optimizer is None:
        nudge_step(model, version)
    else:
        adamw_step(model, optimizer, seed=version)


def load_trainer_model(model_dir: Path, lora: bool, dtype_name: str = "float32") -> Any:
    from primerl.configs.trainer import LoRAConfig, ModelConfig
    from primerl.trainer.model import load_model

    lora_config = LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules=LORA_TARGETS) if lora else None
    return load_model(ModelConfig(name=str(model_dir), lora=lora_config, optimization_dtype=dtype_name))


def serving_dtype(point: Point) -> Any:
    """The publisher's ``serving_dtype``: bf16 for bf16 points; None (the model's own: fp32) for fp32 ones."""
    import torch

    return torch.bfloat16 if point.point.dtype == "bf16" else None


def delta_fractions(point: Point) -> list[dict[str, Any]]:
    """Delta size / full size after one AdamW step from the initial weights, for each lr of DELTA_FRACTION_LRS."""
    import torch

    from primerl.configs.trainer import OptimizerConfig
    from primerl.proto.tensor_frames import encode_tensors
    from primerl.proto.weight_delta import encode_delta
    from primerl.trainer.hf_state_dict import hf_state_dict
    from primerl.trainer.optim import build_optimizer

    def snapshot(model: Any) -> dict[str, Any]:
        return {k: v.detach().clone().contiguous() for k, v in hf_state_dict(model).items()}

    out = []
    for lr in DELTA_FRACTION_LRS:
        model = load_trainer_model(point.model_dir, lora=False)
        base = snapshot(model)
        full_payload, _ = encode_tensors(base, metadata={"format": "pt"})
        adamw_step(model, build_optimizer(model, OptimizerConfig(lr=lr)), seed=0)
        new = snapshot(model)
        payload, specs, _ = encode_delta(new, base, changed_only=True, level=1)
        num_changed = sum(int(torch.ne(new[k].view(torch.int32), base[k].view(torch.int32)).sum()) for k in new)
        num_elements = sum(t.numel() for t in new.values())
        out.append(
            {
                "model": point.name,
                "params": point.num_params,
                "lr": lr,
                "full_bytes": len(full_payload),
                "delta_bytes": len(payload),
                "fraction": len(payload) / len(full_payload),
                "num_tensors": len(specs),
                "total_tensors": len(new),
                "changed_elements": num_changed / num_elements,
            }
        )
        del model
    return out


# ---------------------------------------------------------------------------------------------------------
# measurements


def measure_update(
    point: Point,
    publisher: Any,
    model: Any,
    optimizer: Any,
    kind: str,
    raw: RawZmq,
    raw_bytes: RawBytes,
    record: bool,
    pause_wanted: bool,
) -> None:
    assert point.daemon is not None and point.broker is not None
    daemon = point.daemon
    version = point.take_version()
    train_step(model, optimizer, version)
    # The worker's log line carries the pause; /metrics is scraped only when it does not (not before every update).
    scrape = pause_wanted and not point.pause_in_log
    pause_before = daemon.pause_samples() if scrape else {}
    peaks = PeakRss({"broker": [point.broker.pid], "worker": daemon.pids})
    peaks.start()
    pushed_before = point.broker.bytes_pushed()
    start = time.perf_counter()
    result = publisher.publish(model, version)
    acked_ms = (time.perf_counter() - start) * 1000.0
    applied_s, received_s, told = point.wait_applied(version, start)
    peak = peaks.stop()
    pushed_bytes = point.broker.bytes_pushed() - pushed_before
    applied_ms = applied_s * 1000.0
    received_ms = float("nan") if received_s is None else received_s * 1000.0
    asked = kind.removesuffix("-socket")
    if result.kind != asked and not (asked == "delta" and result.kind == "full" and result.fallback):
        raise RuntimeError(f"{point.name}: asked for {kind} v{version}, sent {result.kind} ({result.fallback})")
    if told != "log":
        point.notes.append(f"{kind} v{version}: applied seen in the broker's run status, not the worker's log")
    apply_ms = daemon.apply_ms(version)
    pause_ms = daemon.logged_pause_ms(version)
    point.pause_in_log = pause_ms is not None
    if pause_ms is None and scrape:
        pause_ms = pause_ms_between(pause_before, daemon.pause_samples())
    view = raw_bytes.view(result.payload_bytes, point.checkpoint if result.kind == "full" else None)
    copy_ms = raw_copy_ms(view) if view.nbytes <= RAW_COPY_MAX_BYTES else float("nan")
    zmq_ms = raw.send_ms(view)
    del view
    label = "measured" if record else "warm-up"
    phases = " ".join(f"{k}={v:.0f}" for k, v in result.phases_ms.items())
    worker_phases = " ".join(f"{k}={v:.0f}" for k, v in daemon.apply_phases(version).items())
    print(
        f"  {point.name:>10} {kind:>5} v{version:<3} {label:8}: sent {result.kind}, "
        f"{result.payload_bytes / MiB:8.2f} MiB, applied {applied_ms:8.1f} ms (build {result.build_ms:.1f}, "
        f"ack {acked_ms:.1f}, worker has it {received_ms:.1f}, worker apply {apply_ms:.0f} ms), "
        f"raw copy {copy_ms:.1f} ms, raw zmq {zmq_ms:.1f} ms; peak RSS broker {peak['broker'] / MiB:.0f} MiB, "
        f"worker {peak['worker'] / MiB:.0f} MiB; pause {fmt_ms(pause_ms)}; broker sent "
        f"{pushed_bytes / MiB:.2f} MiB ({publisher.transport}) "
        f"[publish: {phases}] [worker: {worker_phases}]",
        flush=True,
    )
    if record:
        point.sent.setdefault(kind, []).append(result.kind)
        row = point.rows.setdefault(kind, {})
        for key, value in (
            ("payload_bytes", result.payload_bytes),
            ("applied_ms", applied_ms),
            ("build_ms", result.build_ms),
            ("ack_ms", acked_ms),
            ("received_ms", received_ms),
            ("apply_ms", apply_ms),
            ("pushed_bytes", pushed_bytes),
            ("copy_ms", copy_ms),
            ("zmq_ms", zmq_ms),
            ("broker_peak_bytes", peak["broker"]),
            ("worker_peak_bytes", peak["worker"]),
            ("pause_ms", float("nan") if pause_ms is None else pause_ms),
        ):
            row.setdefault(key, []).append(float(value))


def measure_point(
    point: Point, kinds: list[str], args: argparse.Namespace, raw: RawZmq, raw_bytes: RawBytes, pause_wanted: bool
) -> None:
    """The primerl path: every kind asked for (FULL only on large models); keeps the FULL model for the hand-off."""
    from primerl.configs.trainer import OptimizerConfig
    from primerl.trainer.optim import build_optimizer
    from primerl.trainer.publish import PolicyPublisher

    assert point.broker is not None
    if not point.small and set(kinds) - {"full", "full-socket"}:
        point.notes.append(f"LORA and DELTA not measured above {SMALL_MODEL_MAX_PARAMS / 1e6:.0f}M parameters")
        kinds = [k for k in kinds if k in ("full", "full-socket")]
    # LoRA last: once an adapter is served, a delta (which applies to full weights) would be refused.
    for kind in sorted(kinds, key=["full", "full-socket", "delta", "lora"].index):
        model = load_trainer_model(point.model_dir, lora=kind == "lora", dtype_name=point.dtype_name)
        optimizer = build_optimizer(model, OptimizerConfig(lr=args.lr)) if point.small else None
        with PolicyPublisher(
            point.broker.weight_endpoint,
            TOKEN,
            "bench-trainer",
            point.broker.chunk_bytes,
            kind=kind.removesuffix("-socket"),
            policy_name=POLICY_NAME,
            transport="socket" if kind == "full-socket" else "auto",
            delta_policy=args.delta_policy,
            serving_dtype=serving_dtype(point),
            stream={"auto": None, "on": True, "off": False}[args.stream],
        ) as publisher:
            if kind == "delta":  # the first publish of a delta publisher is FULL: its base
                version = point.take_version()
                train_step(model, optimizer, version)
                assert publisher.publish(model, version).kind == "full"
                point.wait_applied(version, time.perf_counter())
            for i in range(args.warmup + args.repeats):
                if not point.memory_allows(f"{kind} update {i + 1}"):
                    break
                measure_update(
                    point,
                    publisher,
                    model,
                    optimizer,
                    kind,
                    raw,
                    raw_bytes,
                    record=i >= args.warmup,
                    pause_wanted=pause_wanted,
                )
        if kind == "full":
            point.full_model = (model, optimizer)
        del model, optimizer


def measure_filesystem(
    point: Point, args: argparse.Namespace, work_dir: Path, raw: RawZmq, raw_bytes: RawBytes
) -> None:
    """The filesystem hand-off of FULL updates (``fs_handoff.py``), with the FULL publisher's trainer model; a raw
    zmq send of the same bytes after each, for the machine's load in this phase."""
    import torch

    if point.full_model is None:
        model = load_trainer_model(point.model_dir, lora=False, dtype_name=point.dtype_name)
        optimizer = None
        if point.small:
            from primerl.configs.trainer import OptimizerConfig
            from primerl.trainer.optim import build_optimizer

            optimizer = build_optimizer(model, OptimizerConfig(lr=args.lr))
    else:
        model, optimizer = point.full_model
    point.full_model = None
    dtype = getattr(torch, point.dtype_name)
    if not point.memory_allows("the filesystem hand-off engine"):
        return
    handoff = FilesystemHandoff(Daemon.inference_config(point.model_dir, point.dtype_name), work_dir)
    point.fs_start_s = handoff.start_s
    try:
        for i in range(args.warmup + args.repeats):
            if not point.memory_allows(f"hand-off {i + 1}"):
                break
            version = point.take_version()
            train_step(model, optimizer, version)
            directory, write_ms, file_bytes = handoff.write(model, dtype, version)
            load_ms = handoff.load(directory)
            handoff.remove(directory)
            view = raw_bytes.view(file_bytes, point.checkpoint)
            zmq_ms = raw.send_ms(view)
            del view
            label = "measured" if i >= args.warmup else "warm-up"
            print(
                f"  {point.name:>10}    fs v{version:<3} {label:8}: {file_bytes / MiB:8.2f} MiB, hand-off "
                f"{write_ms + load_ms:8.1f} ms (write {write_ms:.1f}, reload_weights {load_ms:.1f}), "
                f"raw zmq {zmq_ms:.1f} ms",
                flush=True,
            )
            if i >= args.warmup:
                for key, value in (
                    ("write_ms", write_ms),
                    ("load_ms", load_ms),
                    ("total_ms", write_ms + load_ms),
                    ("file_bytes", file_bytes),
                    ("zmq_ms", zmq_ms),
                ):
                    point.fs.setdefault(key, []).append(float(value))
        handoff.check_serves()
    finally:
        handoff.close()
    del model, optimizer


# ---------------------------------------------------------------------------------------------------------
# output


def med(values: list[float]) -> float:
    """Median of the finite values (NaN when there are none)."""
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def fmt_ms(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.1f} ms"


def mmm(values: list[float], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """min / median / max of the finite values, each divided by ``scale``; a dash when there are none."""
    finite = [v / scale for v in values if v == v]
    if not finite:
        return "—"
    return " / ".join(fmt.format(v) for v in (min(finite), statistics.median(finite), max(finite)))


def params(num_params: int) -> str:
    return f"{num_params / 1e6:.1f}M" if num_params < 100e6 else f"{num_params / 1e6:.0f}M"


def seconds(value_ms: float) -> str:
    return "—" if value_ms != value_ms else f"{value_ms / 1000.0:.3f}"


@dataclass(frozen=True)
class ScaleRow:
    """The FULL figures of one point (medians) for the scale table, the targets and the plot."""

    name: str
    model: str
    dtype: str
    num_params: int
    payload_bytes: float
    zmq_ms: float
    ack_ms: float
    received_ms: float
    applied_ms: float
    fs_write_ms: float
    fs_load_ms: float
    fs_ms: float
    fs_zmq_ms: float  # the raw send in the hand-off phase (the machine's load then)
    broker_peak_bytes: float  # the largest over the measured updates
    worker_peak_bytes: float
    pause_ms: float

    @classmethod
    def of(cls, point: Point) -> ScaleRow | None:
        row = point.rows.get("full")
        if not row:
            return None
        return cls(
            point.name,
            point.point.model,
            point.point.dtype,
            point.num_params,
            med(row["payload_bytes"]),
            med(row["zmq_ms"]),
            med(row["ack_ms"]),
            med(row["received_ms"]),
            med(row["applied_ms"]),
            med(point.fs.get("write_ms", [])),
            med(point.fs.get("load_ms", [])),
            med(point.fs.get("total_ms", [])),
            med(point.fs.get("zmq_ms", [])),
            max(row["broker_peak_bytes"]),
            max(row["worker_peak_bytes"]),
            med(row["pause_ms"]),
        )


def pause_cell(value_ms: float, pause_in_source: bool) -> str:
    if value_ms == value_ms:
        return f"{value_ms:.1f}"
    return "n/a (not reported)" if pause_in_source else "n/a (metric missing)"


def print_tables(
    points: list[Point], fractions: list[dict[str, Any]], kinds: list[str], repeats: int, pause_in_source: bool
) -> None:
    print(f"\nWeight update, publish -> applied (medians of {repeats}; payload and raw paths: same bytes, same run)")
    header = (
        f"{'point':>10} {'params':>7} {'kind':>5} {'payload MiB':>11} {'publish->applied ms':>19} "
        f"{'build ms':>8} {'broker ack ms':>13} {'worker apply ms':>15} {'raw copy ms':>11} "
        f"{'raw zmq ms':>10} {'applied/raw-zmq':>15}"
    )
    print(header)
    print("-" * len(header))
    for point in points:
        for kind in kinds:
            row = point.rows.get(kind)
            if not row:
                continue
            applied, zmq_ms = med(row["applied_ms"]), med(row["zmq_ms"])
            print(
                f"{point.name:>10} {point.num_params / 1e6:6.1f}M {kind:>5} {med(row['payload_bytes']) / MiB:11.2f} "
                f"{applied:19.1f} {med(row['build_ms']):8.1f} {med(row['ack_ms']):13.1f} "
                f"{med(row['apply_ms']):15.0f} {med(row['copy_ms']):11.2f} {zmq_ms:10.2f} {applied / zmq_ms:15.1f}"
            )
    rows = [r for r in (ScaleRow.of(p) for p in points) if r is not None]
    print(f"\nFULL updates at scale, seconds (medians of {repeats}); peak RSS: the largest over the updates")
    header = (
        f"{'point':>10} {'params':>7} {'payload MiB':>11} {'raw zmq':>8} {'broker ack':>10} "
        f"{'worker has it':>13} {'applied':>8} {'x raw':>6} {'fs write':>8} {'fs load':>8} {'fs total':>8} "
        f"{'x fs':>5} {'fs-phase raw zmq':>16} {'broker peak MiB':>15} {'worker peak MiB':>15} "
        f"{'pause p50 ms':>20}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.name:>10} {params(r.num_params):>7} {r.payload_bytes / MiB:11.1f} {seconds(r.zmq_ms):>8} "
            f"{seconds(r.ack_ms):>10} {seconds(r.received_ms):>13} {seconds(r.applied_ms):>8} "
            f"{r.applied_ms / r.zmq_ms:6.1f} {seconds(r.fs_write_ms):>8} {seconds(r.fs_load_ms):>8} "
            f"{seconds(r.fs_ms):>8} {r.applied_ms / r.fs_ms:5.2f} {seconds(r.fs_zmq_ms):>16} "
            f"{r.broker_peak_bytes / MiB:15.0f} "
            f"{r.worker_peak_bytes / MiB:15.0f} {pause_cell(r.pause_ms, pause_in_source):>20}"
        )
    if fractions:
        print("\nDelta size / full size after one AdamW step from the initial weights (fp32, XOR + zlib level 1)")
        header = (
            f"{'point':>10} {'params':>7} {'lr':>7} {'full MiB':>9} {'delta MiB':>9} {'fraction':>8} "
            f"{'tensors in delta':>16} {'elements changed':>16}"
        )
        print(header)
        print("-" * len(header))
        for f in fractions:
            print(
                f"{f['model']:>10} {f['params'] / 1e6:6.1f}M {f['lr']:7.0e} {f['full_bytes'] / MiB:9.2f} "
                f"{f['delta_bytes'] / MiB:9.2f} {f['fraction']:8.3f} {f['num_tensors']:>7}/{f['total_tensors']:<8} "
                f"{f['changed_elements']:16.3f}"
            )


FULL_TARGET_RATIO = 5.0
"""Issue 12, 4e: FULL publish->applied at ~100M params <= 5x a raw zmq send of the same bytes."""


def previous_tiny_full_ms() -> tuple[float | None, str]:
    """The tiny model's FULL publish->applied median (ms) in the part e section of bench/RESULTS.md as last
    committed (the file on disk when git cannot tell), and where it came from."""
    source = "bench/RESULTS.md at HEAD"
    try:
        text = subprocess.run(
            ["git", "show", "HEAD:bench/RESULTS.md"], capture_output=True, text=True, cwd=ROOT, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        path = ROOT / "bench" / "RESULTS.md"
        text, source = (path.read_text() if path.exists() else ""), "bench/RESULTS.md on disk"
    match = re.search(r"^#+ e\. .*?(?=^#+ [a-z]\. |\Z)", text, flags=re.M | re.S)
    if not match:
        return None, f"no part e section in {source}"
    columns: list[str] | None = None
    for line in match.group(0).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "publish->applied ms" in cells and "kind" in cells:
            columns = cells
            continue
        if columns is None or len(cells) != len(columns) or not cells[0]:
            continue
        row = dict(zip(columns, cells))
        model = row.get("model", "").split("-")[0]
        dtype = row.get("dtype") or ("fp32" if "-" not in row.get("model", "") else row["model"].split("-")[1])
        if model == "tiny" and row.get("kind") == "full" and dtype == "fp32":
            numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", row["publish->applied ms"])]
            if numbers:
                return numbers[len(numbers) // 2], source
    return None, f"no tiny FULL row in the part e section of {source}"


def verdicts(points: list[Point], pause_in_source: bool) -> list[tuple[str, str, str]]:
    """(target, measured, "met" / "missed" / "not measured") for the targets this bench checks."""
    out = []
    rows = {r.name: r for r in (ScaleRow.of(p) for p in points) if r is not None}
    scale = rows.get(SCALE_TARGET.label)
    if scale is None:
        out.append(
            (
                f"FULL publish->applied / filesystem hand-off, {SCALE_TARGET.label} <= {FS_TARGET_RATIO:g}",
                f"{SCALE_TARGET.label} not in this run",
                "not measured",
            )
        )
    elif scale.fs_ms != scale.fs_ms:
        out.append(
            (
                f"FULL publish->applied / filesystem hand-off, {scale.name} <= {FS_TARGET_RATIO:g}",
                "the hand-off was not measured (see the notes)",
                "not measured",
            )
        )
    else:
        ratio = scale.applied_ms / scale.fs_ms
        out.append(
            (
                f"FULL publish->applied / filesystem hand-off, {scale.name} <= {FS_TARGET_RATIO:g}",
                f"{ratio:.2f}x ({scale.applied_ms / 1000:.2f} s vs {scale.fs_ms / 1000:.2f} s)",
                "met" if ratio <= FS_TARGET_RATIO else "missed",
            )
        )
    if scale is not None:
        ratio = scale.applied_ms / scale.zmq_ms
        out.append(
            (
                f"(stretch) FULL publish->applied / raw zmq, {scale.name} <= {RAW_STRETCH_RATIO:g}",
                f"{ratio:.1f}x ({scale.applied_ms / 1000:.2f} s vs {scale.zmq_ms / 1000:.2f} s)",
                "met" if ratio <= RAW_STRETCH_RATIO else "missed",
            )
        )
    for r in rows.values():
        limit = r.payload_bytes + BROKER_RSS_SLACK_BYTES
        out.append(
            (
                f"broker peak RSS during a FULL update <= payload + 256 MiB, {r.name}",
                f"{r.broker_peak_bytes / MiB:.0f} MiB vs {limit / MiB:.0f} MiB (payload {r.payload_bytes / MiB:.0f})",
                "met" if r.broker_peak_bytes <= limit else "missed",
            )
        )
    for r in rows.values():
        if r.model != PAUSE_TARGET_MODEL:
            continue
        if r.pause_ms == r.pause_ms:
            out.append(
                (
                    f"generation pause per update (p50), {r.name} <= {PAUSE_TARGET_MS:g} ms",
                    f"{r.pause_ms:.1f} ms",
                    "met" if r.pause_ms <= PAUSE_TARGET_MS else "missed",
                )
            )
        else:
            out.append(
                (
                    f"generation pause per update (p50), {r.name} <= {PAUSE_TARGET_MS:g} ms",
                    pause_cell(r.pause_ms, pause_in_source),
                    "not measured",
                )
            )
    tiny = rows.get("tiny-fp32")
    if tiny is not None:
        before, source = previous_tiny_full_ms()
        if before is None:
            out.append(("tiny FULL publish->applied no slower than the last part e figure", source, "not measured"))
        else:
            out.append(
                (
                    f"tiny FULL publish->applied no slower than the last part e figure ({source}; 10 % noise allowed)",
                    f"{tiny.applied_ms:.0f} ms now vs {before:.0f} ms before",
                    "met" if tiny.applied_ms <= before * NOISE_TOLERANCE else "missed",
                )
            )
    for point in points:
        full, delta = point.rows.get("full"), point.rows.get("delta")
        if full and point.point.model == "100m":
            ratio = med(full["applied_ms"]) / med(full["zmq_ms"])
            out.append(
                (
                    f"FULL publish->applied / raw zmq, {point.name} <= {FULL_TARGET_RATIO:g}",
                    f"{ratio:.1f}x",
                    "met" if ratio <= FULL_TARGET_RATIO else "missed",
                )
            )
        if full and delta:
            full_ms, delta_ms = med(full["applied_ms"]), med(delta["applied_ms"])
            sent = ", ".join(sorted(set(point.sent.get("delta", []))))
            out.append(
                (
                    f"DELTA never slower than FULL, {point.name} (10 % noise allowed)",
                    f"{delta_ms:.0f} ms vs {full_ms:.0f} ms (DELTA sent as: {sent})",
                    "met" if delta_ms <= full_ms * NOISE_TOLERANCE else "missed",
                )
            )
    return out


def save_plot(path: Path, points: list[Point]) -> Path | None:
    """Update time against payload size (log-log), one line per path, FULL updates of every point."""
    rows = sorted((r for r in (ScaleRow.of(p) for p in points) if r is not None), key=lambda r: r.payload_bytes)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.payload_bytes / MiB for r in rows]
    lines = {
        "primerl publish->applied": [r.applied_ms for r in rows],
        "primerl broker ack": [r.ack_ms for r in rows],
        "raw zmq send (same bytes)": [r.zmq_ms for r in rows],
        "filesystem hand-off (write + reload_weights)": [r.fs_ms for r in rows],
    }
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, values_ms in lines.items():
        xs = [x for x, v in zip(sizes, values_ms) if v == v]
        ys = [v / 1000.0 for v in values_ms if v == v]
        ax.plot(xs, ys, marker="o", label=label)
    for r, x in zip(rows, sizes):
        ax.annotate(r.name, (x, r.applied_ms / 1000.0), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("Weight update time against payload size (FULL, medians)")
    ax.set_xlabel("payload, MiB")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_markdown(
    path: Path,
    argv: list[str],
    points: list[Point],
    fractions: list[dict[str, Any]],
    kinds: list[str],
    load_start: float,
    load_end: float,
    repeats: int,
    plot: Path | None,
    pause_in_source: bool,
    cpu_model: str,
) -> None:
    """The section of bench/RESULTS.md for weight updates."""
    lines = [
        "## e. Weight updates: publish -> applied vs a raw zmq send and the filesystem hand-off",
        "",
        f"`.venv/bin/python bench/weight_update.py {' '.join(argv)}`",
        "",
        f"Machine: {os.cpu_count()} CPUs ({cpu_model}), load average {load_start:.2f} at start, {load_end:.2f} "
        f"at end (shared machine: ratios are measured side by side, in one run). Values are min / median / max "
        f"over {repeats} measured updates (after warm-up).",
        "",
        "| model | dtype | params | kind | sent | payload MiB | publish->applied ms | build ms | broker ack ms | "
        "worker apply ms | raw zmq ms | applied / raw zmq (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        for kind in kinds:
            row = point.rows.get(kind)
            if not row:
                continue
            sent = ", ".join(sorted(set(point.sent.get(kind, []))))
            ratio = med(row["applied_ms"]) / med(row["zmq_ms"])
            lines.append(
                f"| {point.point.model} | {point.point.dtype} | {point.num_params / 1e6:.1f}M | {kind} | "
                f"{sent} | {med(row['payload_bytes']) / MiB:.2f} | {mmm(row['applied_ms'])} | "
                f"{mmm(row['build_ms'])} | {mmm(row['ack_ms'])} | {mmm(row['apply_ms'])} | "
                f"{mmm(row['zmq_ms'], fmt='{:.1f}')} | {ratio:.1f} |"
            )
    lines += [
        "",
        "FULL updates at scale, seconds (min / median / max over n updates). Worker has it: its subscriber "
        "holds the whole update; applied: it serves it. Filesystem hand-off: `save_file` of the same "
        "serving-dtype tensors to a fresh directory + `reload_weights(weights_path=dir)` on a twin vLLM "
        "engine of the worker's (same engine options, own process), measured after the worker stopped, with a "
        "raw zmq send of the same bytes after each (the load in that phase). Peak RSS: the largest during the "
        "updates, worker = daemon + engine core.",
        "",
        "| model | dtype | params | n (primerl / fs) | payload MiB | raw zmq s | broker ack s | "
        "worker has it s | publish->applied s | x raw | fs write s | fs load s | fs hand-off s | x fs | "
        "raw zmq s, fs phase | broker peak RSS MiB | worker peak RSS MiB | pause p50 ms |",
        "|" + "---|" * 18,
    ]
    for point in points:
        r, row = ScaleRow.of(point), point.rows.get("full")
        if r is None or row is None:
            continue
        lines.append(
            f"| {r.model} | {r.dtype} | {params(r.num_params)} | {len(row['applied_ms'])} / "
            f"{len(point.fs.get('total_ms', []))} | {r.payload_bytes / MiB:.1f} | "
            f"{mmm(row['zmq_ms'], 1000, '{:.3f}')} | {mmm(row['ack_ms'], 1000, '{:.3f}')} | "
            f"{mmm(row['received_ms'], 1000, '{:.3f}')} | {mmm(row['applied_ms'], 1000, '{:.3f}')} | "
            f"{r.applied_ms / r.zmq_ms:.1f} | {mmm(point.fs.get('write_ms', []), 1000, '{:.3f}')} | "
            f"{mmm(point.fs.get('load_ms', []), 1000, '{:.3f}')} | "
            f"{mmm(point.fs.get('total_ms', []), 1000, '{:.3f}')} | {r.applied_ms / r.fs_ms:.2f} | "
            f"{mmm(point.fs.get('zmq_ms', []), 1000, '{:.3f}')} | "
            f"{r.broker_peak_bytes / MiB:.0f} | {r.worker_peak_bytes / MiB:.0f} | "
            f"{pause_cell(r.pause_ms, pause_in_source)} |"
        )
    if fractions:
        lines += [
            "",
            "Delta size / full size after one AdamW step from the initial weights (fp32, XOR + zlib 1):",
            "",
            "| model | lr | full MiB | delta MiB | fraction | elements changed |",
            "|---|---|---|---|---|---|",
        ]
        for f in fractions:
            lines.append(
                f"| {f['model']} | {f['lr']:.0e} | {f['full_bytes'] / MiB:.2f} | {f['delta_bytes'] / MiB:.2f} "
                f"| {f['fraction']:.3f} | {f['changed_elements']:.3f} |"
            )
    lines += ["", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {verdict} |" for name, value, verdict in verdicts(points, pause_in_source)]
    notes = [f"{p.name}: {n}" for p in points for n in dict.fromkeys(p.notes)]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    if plot is not None:
        lines += ["", f"![update time against payload size]({os.path.relpath(plot, path.parent)})"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------------------
# main


def parse_points(models: str, dtypes: str, parser: argparse.ArgumentParser) -> list[ModelPoint]:
    """``tiny,100m`` x ``fp32,bf16``; an entry ``name:dtype+dtype`` names its own dtypes."""
    specs = model_specs()
    default_dtypes = [d.strip() for d in dtypes.split(",") if d.strip()]
    points: list[ModelPoint] = []
    for entry in (e.strip() for e in models.split(",")):
        if not entry:
            continue
        name, _, own = entry.partition(":")
        if name not in specs:
            parser.error(f"unknown model {name!r}; choose from {list(specs)}")
        for dtype in own.split("+") if own else default_dtypes:
            if dtype not in DTYPES:
                parser.error(f"unknown dtype {dtype!r} (in {entry!r}); choose from {list(DTYPES)}")
            if ModelPoint(name, dtype).is_family_point and dtype != "fp32":
                parser.error(f"{name} is built in fp32 only (--models {name}:fp32)")
            if ModelPoint(name, dtype) not in points:
                points.append(ModelPoint(name, dtype))
    if not points:
        parser.error("--models names no model")
    return points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated, from: tiny, 100m, 500m, 1b, 100m-mistral, 100m-phi3 (fp32); NAME:DTYPE[+DTYPE] gives a "
        "model its own "
        "dtypes (default: tiny,100m)",
    )
    parser.add_argument("--dtypes", default="fp32", help="comma-separated, from: fp32, bf16 (default: fp32)")
    parser.add_argument(
        "--quick", action="store_true", help=f"short profile: --models {QUICK_MODELS} (overrides --models and --dtypes)"
    )
    parser.add_argument(
        "--kinds",
        default="full,full-socket,lora,delta",
        help="comma-separated, from: full, full-socket, lora, delta (lora and delta on models up to 200M only; "
        "full-socket: FULL as bytes through the broker, beside full through shared memory)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured updates per point and kind")
    parser.add_argument("--warmup", type=int, default=1, help="updates per point and kind before measuring")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the timed steps")
    parser.add_argument(
        "--delta-policy",
        choices=["auto", "always"],
        default="auto",
        help="the DELTA publisher's policy (auto: FULL when the delta would not pay)",
    )
    parser.add_argument(
        "--stream",
        choices=["auto", "on", "off"],
        default="auto",
        help="weight_broadcast.stream of the publisher: on (FULL sent while written), off (written and hashed "
        "first), auto (as the trainer: on when the weights are on a GPU; default)",
    )
    parser.add_argument("--markdown", type=Path, default=None, help="write the results as a markdown section here")
    parser.add_argument("--plots-dir", type=Path, default=ROOT / "bench" / "plots", help="where the plot goes")
    args = parser.parse_args(argv)
    models = QUICK_MODELS if args.quick else (args.models or "tiny,100m")
    args.points = parse_points(models, args.dtypes, parser)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for kind in args.kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}; choose from {list(KINDS)}")
    if "full" not in args.kinds:
        parser.error("--kinds must include full (the scale table, the hand-off and the targets are about it)")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def start_groups(points: list[Point]) -> list[list[Point]]:
    """Consecutive points whose checkpoints add up to at most START_TOGETHER_BYTES (a larger one alone)."""
    groups: list[list[Point]] = []
    total = 0
    for point in points:
        size = point.checkpoint_bytes
        if groups and total + size <= START_TOGETHER_BYTES:
            groups[-1].append(point)
            total += size
        else:
            groups.append([point])
            total = size
    return groups


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: say so below
    return "CPU model unknown"


def start_group(group: list[Point], work_dir: Path, kinds: list[str]) -> list[dict[str, Any]]:
    """Start the group's brokers and daemons; returns the delta sizes computed while the daemons start."""
    for point in group:
        point.broker = BrokerProcess(work_dir / f"broker-{point.name}", f"bench-{point.name}")
    for point in group:
        point.broker.wait_ready()
        point.daemon = Daemon(
            work_dir / f"infer-{point.name}", point.model_dir, point.dtype_name, point.broker.grpc_address
        )
    fractions = []
    if "delta" in kinds and any(p.small and p.point.dtype == "fp32" for p in group):
        print("computing delta sizes while the daemons start ...", flush=True)
        fractions = [f for p in group if p.small and p.point.dtype == "fp32" for f in delta_fractions(p)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(p.daemon.poll_ready() for p in group):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemons did not start within {START_TIMEOUT_S} s")
        time.sleep(0.2)
    for point in group:
        wait_for(
            lambda p=point: p.daemon.worker_id in p.broker.worker_versions(),
            60,
            f"{point.name}: the worker to register",
        )
        print(
            f"{point.name}: primerl-infer up after {point.daemon.start_s:.1f} s (pids {point.daemon.pids})", flush=True
        )
    time.sleep(2.0)  # let the daemons settle (compile caches, first heartbeats, the weight plane's HELLO)
    print(f"load average before measuring: {os.getloadavg()[0]:.2f}", flush=True)
    return fractions


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    from transformers.utils import logging as hf_logging

    from primerl.runtime.log_setup import configure_logging

    configure_logging("bench", "weight-update", level="warning")
    hf_logging.disable_progress_bar()  # "Loading weights" at every trainer model load

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # run the finally blocks: stop the daemons

    signal.signal(signal.SIGTERM, on_sigterm)
    wall_start = time.monotonic()
    load_start = os.getloadavg()[0]
    cpu_model = cpu_model_name()
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model}), load average {load_start:.2f} at start", flush=True)
    pause_in_source = pause_metric_in_source()
    print(f"generation pause metric ({PAUSE_METRIC}) in inference/: {'yes' if pause_in_source else 'no'}", flush=True)

    from primerl.trainer.tiny_model import build_tiny_model, count_parameters

    work_dir = Path(tempfile.mkdtemp(prefix="primerl-bench-weights-"))
    points: list[Point] = []
    raw: RawZmq | None = None
    raw_bytes = RawBytes()
    try:
        tokenizer_dir = None
        if not all(p.uses_build_tiny_model for p in args.points):
            tokenizer_dir = build_tiny_model(work_dir / "tokenizer-source")
        for model_point in args.points:
            start = time.monotonic()
            model_dir = build_point(work_dir / model_point.label, model_point, tokenizer_dir)
            point = Point(model_point, model_dir, count_parameters(model_dir))
            points.append(point)
            print(
                f"{point.name}: {point.num_params:,} parameters, {point.checkpoint_bytes / MiB:.1f} MiB "
                f"({model_specs()[model_point.model]}), built in {time.monotonic() - start:.1f} s",
                flush=True,
            )
        raw = RawZmq()
        fractions: list[dict[str, Any]] = []
        pause_wanted = pause_in_source
        for group in start_groups(points):
            fractions += start_group(group, work_dir, args.kinds)
            for point in group:
                measure_point(point, args.kinds, args, raw, raw_bytes, pause_wanted)
                point.daemon.stop()
                point.broker.stop()
                measure_filesystem(point, args, work_dir / f"fs-{point.name}", raw, raw_bytes)
        kinds = [k for k in KINDS if k in args.kinds]
        print_tables(points, fractions, kinds, args.repeats, pause_in_source)
        print("\nTargets (issue 26; issue 12, 4e)")
        for name, value, verdict in verdicts(points, pause_in_source):
            print(f"  {verdict:>12}: {name}: {value}")
        for point in points:
            for note in dict.fromkeys(point.notes):
                print(f"  note: {point.name}: {note}")
        plot = save_plot(args.plots_dir / "e_update_time_vs_size.png", points)
        if plot is not None:
            print(f"wrote {plot}")
        if args.markdown is not None:
            write_markdown(
                args.markdown,
                sys.argv[1:] if argv is None else argv,
                points,
                fractions,
                kinds,
                load_start,
                os.getloadavg()[0],
                args.repeats,
                plot,
                pause_in_source,
                cpu_model,
            )
        print(f"\ntotal wall time {time.monotonic() - wall_start:.0f} s; load average at end {os.getloadavg()[0]:.2f}")
        return 0
    except BaseException:
        try:
            print("\nPartial results (the run did not finish):")
            print_tables(points, [], [k for k in KINDS if k in args.kinds], args.repeats, pause_in_source)
        except Exception as exc:  # the tables of a half-measured run may not print: say so, raise the first error
            print(f"(no partial tables: {exc!r})")
        for point in points:
            if point.broker is not None:
                print(f"--- {point.name} broker log tail ---\n{point.broker.log_tail()}", file=sys.stderr)
            if point.daemon is not None:
                print(f"--- {point.name} daemon log tail ---\n{point.daemon.log_tail()}", file=sys.stderr)
        raise
    finally:
        for point in points:
            if point.daemon is not None:
                point.daemon.stop()
            if point.broker is not None:
                point.broker.stop()
        if raw is not None:
            raw.close()
        raw_bytes.close()
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
