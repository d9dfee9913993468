"""The dashboard's HTTP server: a read-only page and its JSON API over a run directory and/or a live broker.

Security (the page shows a run's config, prompts and model output):

* every route needs the login token: ``?token=`` (the URL printed at start; answered with a cookie and a
  redirect to the same path without the token), the ``primerl_dashboard_<port>`` cookie, or ``Authorization: Bearer``.
  None: 401; a wrong one: 403 (compared in constant time);
* only GET and HEAD: any other method is 405, and no route changes anything;
* a strict Content-Security-Policy (``default-src 'self'``, no inline script or style, no frames), ``nosniff``,
  ``no-referrer``, ``no-store``; the page sets every value through ``textContent`` (model output is untrusted);
* the default bind is loopback.

API (JSON, documented in docs/dashboard.md): ``/api/run``, ``/api/config``, ``/api/charts``, ``/api/metrics?since=N``,
``/api/workers``, ``/api/queues``, ``/api/events``, ``/api/rollouts?since=N``.

A run whose directory says it has ended (``RunDirSource.outcome``: finished, stopped or failed) is shown from that
directory alone: its state, its last policy version, the workers and queues last seen before the end; its broker,
gone with it, is not asked (no "broker unreachable" error). The broker's errors show only for a run that is still
supposed to be running.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import socket
import threading
import time
import tomllib
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from primerl.dashboard.charts import chart_table
from primerl.dashboard.sources import MAX_EVENTS, BrokerSource, RunDirSource
from primerl.proto.v1 import common_pb2, control_pb2
from primerl.runtime.run_files import RUN_CONFIG_FILE
from primerl.runtime.run_outcome import RUNNING, RunOutcome

STATIC_DIR = Path(__file__).resolve().parent / "static"
COOKIE_NAME = "primerl_dashboard_{port}"  # per port: browsers share cookies between the ports of one host
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
STATIC_FILES = {"/": "index.html", "/index.html": "index.html", "/app.js": "app.js", "/app.css": "app.css"}
ROLE_NAMES = {
    "ROLE_TRAINER": "trainer",
    "ROLE_INFERENCE": "inference",
    "ROLE_ORCHESTRATOR": "orchestrator",
    "ROLE_TEACHER": "teacher",
    "ROLE_CLIENT": "client",
    "ROLE_BROKER": "broker",
}


class Dashboard:
    """The data behind the API: one ``RunDirSource`` and/or one ``BrokerSource``."""

    def __init__(self, run_dir: RunDirSource | None = None, broker: BrokerSource | None = None):
        if run_dir is None and broker is None:
            raise ValueError("the dashboard needs a run directory or a broker address")
        self.run_dir = run_dir
        self.broker = broker
        self.started_s = time.time()

    # -------------------------------------------------------------------------------------- API bodies
    def api(self, route: str, query: dict[str, list[str]]) -> dict[str, Any] | None:
        since = _int_arg(query, "since")
        if route == "/api/run":
            return self.run()
        if route == "/api/config":
            return {"text": self.run_dir.config_text() if self.run_dir else "", "file": RUN_CONFIG_FILE}
        if route == "/api/charts":
            return chart_table()
        if route == "/api/metrics":
            rows, next_index = self._pick("metrics", since)
            return {"rows": [_finite(row) for row in rows], "next": next_index, "source": self._from("metrics")}
        if route == "/api/rollouts":
            rollouts, next_index = self._pick("rollouts", since)
            return {"rollouts": rollouts, "next": next_index, "source": self._from("rollouts")}
        if route == "/api/workers":
            status, error = self._status()
            workers = [] if status is None else [_worker(w, status.latest_policy_version) for w in status.workers]
            ended = self._ended()  # its workers as last seen: their heartbeats are as old as that snapshot
            as_of = (status.updated_unix_ms or ended.ended_unix_ms) if ended is not None else None
            return {"workers": workers, "broker_error": error, "as_of_unix_ms": as_of}
        if route == "/api/queues":
            status, error = self._status()
            status = status or control_pb2.RunStatus()
            return {
                "queues": [_queue(queue) for queue in status.queues],
                "rollout_batches_per_s": status.rollout_batches_per_s,
                "rollout_bytes_per_s": status.rollout_bytes_per_s,
                "weight_bytes_per_s": status.weight_bytes_per_s,
                "latest_policy_version": status.latest_policy_version,
                "history_bytes": self.broker.history_bytes[0] if self.broker else 0,
                "history_max_bytes": self.broker.history_bytes[1] if self.broker else 0,
                "broker_error": error,
            }
        if route == "/api/events":
            status, _ = self._status()
            events = self.run_dir.events() if self.run_dir else []
            broker = self._live_broker()
            if broker is not None:
                broker.refresh_history()
                events = sorted(events + broker.events.since(0)[0], key=lambda event: event["time"])
            recent = status.recent_errors if status is not None else []
            errors = [{"source": "broker", "level": "error", "message": m} for m in recent]
            return {"events": events[-MAX_EVENTS:], "recent_errors": errors}
        return None

    def _from(self, what: str) -> str:
        """Where ``what`` (metrics, rollouts) comes from: the run directory's file when it has one (complete),
        else the broker's history (bounded), else nothing yet."""
        broker = self._live_broker()
        if self.run_dir is not None:
            tail = self.run_dir.metrics if what == "metrics" else self.run_dir.rollouts
            if tail.path.exists() or broker is None:
                return "run_dir"
        return "broker" if broker is not None else "run_dir"

    def _pick(self, what: str, since: int) -> tuple[list, int]:
        if self._from(what) == "run_dir":
            tail = self.run_dir.metrics if what == "metrics" else self.run_dir.rollouts
            return tail.since(since)
        self.broker.refresh_history()
        return (self.broker.rows if what == "metrics" else self.broker.rollouts).since(since)

    def _ended(self) -> RunOutcome | None:
        """How the run ended, when its run directory says it has (see the module docstring); else None."""
        if self.run_dir is None:
            return None
        outcome = self.run_dir.outcome()
        return outcome if outcome.ended else None

    def _live_broker(self) -> BrokerSource | None:
        """The broker to ask: none for a run that has ended."""
        return self.broker if self._ended() is None else None

    def _status(self) -> tuple[control_pb2.RunStatus | None, str]:
        """The run's status and the broker's error: an ended run's last known status (no error), else the
        broker's answer."""
        ended = self._ended()
        if ended is not None:
            return ended.fill_status(control_pb2.RunStatus()), ""
        if self.broker is None:
            return None, "no broker: the dashboard reads the run directory only"
        return self.broker.status()

    def run(self) -> dict[str, Any]:
        ended = self._ended()
        status, error = self._status()
        config = self._config()
        rows, _ = self._pick("metrics", 0)
        trainer_rows = [row for row in rows if row.get("role") == "trainer"]
        step = max((row["step"] for row in trainer_rows), default=0)
        max_steps = int(config.get("max_steps") or config.get("trainer", {}).get("max_steps") or 0)
        run_id = ""
        if status is not None:
            step = max(step, status.trainer_step)
            max_steps = status.max_steps or max_steps
            run_id = status.run_id
        finished = max_steps > 0 and step >= max_steps
        running = self.run_dir is not None and self.run_dir.outcome().state == RUNNING  # its launcher is alive
        if ended is not None:
            state = ended.state  # finished, stopped or failed, as the run directory says
        elif finished:
            state = "finished"
        elif status is None and (self.broker is not None or not running):
            state = "stopped" if self.run_dir is not None and rows and not running else "unreachable"
        elif step == 0:
            state = "starting"
        else:
            state = "training"
        eta_s = None
        if state == "training" and len(trainer_rows) >= 2 and max_steps > step:
            first, last = trainer_rows[0], trainer_rows[-1]
            if last["step"] > first["step"]:
                per_step = (last["time"] - first["time"]) / (last["step"] - first["step"])
                eta_s = round(per_step * (max_steps - step), 1)
        return {
            "run_id": run_id or (self.run_dir.run_dir.name if self.run_dir else ""),
            "state": state,
            "step": step,
            "max_steps": max_steps,
            "eta_s": eta_s,
            "latest_policy_version": status.latest_policy_version if status is not None else 0,
            "last_committed_step": status.last_committed_step if status is not None else 0,
            "num_rollbacks": status.num_rollbacks if status is not None else 0,
            "run_dir": str(self.run_dir.run_dir) if self.run_dir else None,
            "broker": self.broker is not None,
            "broker_error": error if self.broker is not None else "",
            "end": ended.to_json() if ended is not None else None,
            "time": time.time(),
        }

    def _config(self) -> dict:
        if self.run_dir is None:
            return {}
        try:
            return tomllib.loads(self.run_dir.config_text())
        except tomllib.TOMLDecodeError:
            return {}

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()


def _worker(worker: control_pb2.WorkerInfo, latest_version: int) -> dict:
    version = worker.policy_version if worker.HasField("policy_version") else None
    role = common_pb2.Role.Name(worker.role)
    return {
        "name": worker.name,
        "role": ROLE_NAMES.get(role, role),
        "state": control_pb2.WorkerState.Name(worker.state).removeprefix("WORKER_STATE_").lower(),
        "host": worker.hostname,
        "address": worker.address,
        "policy_version": version,
        "lag": latest_version - version if version is not None else None,
        "trainer_step": worker.trainer_step if worker.HasField("trainer_step") else None,
        "orchestrator_step": worker.orchestrator_step if worker.HasField("orchestrator_step") else None,
        "num_inflight": worker.num_inflight,
        "last_heartbeat_unix_ms": worker.last_heartbeat_unix_ms,
        "registered_unix_ms": worker.registered_unix_ms,
    }


def _queue(queue: control_pb2.QueueStatus) -> dict:
    return {
        "name": queue.name,
        "num_items": queue.num_items,
        "num_bytes": queue.num_bytes,
        "capacity_items": queue.capacity_items,
        "capacity_bytes": queue.capacity_bytes,
    }


def _finite(row: dict) -> dict:
    """NaN and infinities are not JSON: null instead."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _int_arg(query: dict[str, list[str]], name: str) -> int:
    try:
        return max(0, int(query.get(name, ["0"])[0]))
    except ValueError:
        return 0


# ------------------------------------------------------------------------------------------------ HTTP
class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"
    server_version = "primerl-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        return  # quiet: a page polls every few seconds

    def _send(self, code: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Cache-Control", "no-store")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, data: Any, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
        self._send(code, body, "application/json", extra)

    def _error(self, code: HTTPStatus, message: str, extra: dict[str, str] | None = None) -> None:
        self._json(code, {"error": message}, extra)

    def _presented_token(self, query: dict[str, list[str]]) -> tuple[str | None, bool]:
        """The token the request carries and whether it came in the URL."""
        if "token" in query:
            return query["token"][0], True
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :], False
        cookie = SimpleCookie()
        try:
            cookie.load(self.headers.get("Cookie", ""))
        except Exception:
            return None, False
        morsel = cookie.get(COOKIE_NAME.format(port=self.server.port))
        return (morsel.value if morsel is not None else None), False

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as err:  # a broken source must answer 500, never take the dashboard down
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"dashboard error: {type(err).__name__}: {err}"[:500])

    do_HEAD = do_GET  # noqa: N815

    def _get(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        token, in_url = self._presented_token(query)
        if not token:
            self._error(HTTPStatus.UNAUTHORIZED, "no login token: open the URL that `primerl dashboard` printed")
            return
        if not hmac.compare_digest(token.encode(), self.server.token.encode()):
            self._error(HTTPStatus.FORBIDDEN, "wrong login token: open the URL that `primerl dashboard` printed")
            return
        if in_url:  # the token becomes a cookie and leaves the address bar (and the history)
            rest = "&".join(f"{k}={v}" for k, values in query.items() if k != "token" for v in values)
            location = parts.path + (f"?{rest}" if rest else "")
            cookie = f"{COOKIE_NAME.format(port=self.server.port)}={token}; Path=/; HttpOnly; SameSite=Strict"
            self._send(HTTPStatus.SEE_OTHER, b"", "text/plain", {"Location": location, "Set-Cookie": cookie})
            return
        if parts.path in STATIC_FILES:
            name = STATIC_FILES[parts.path]
            body = (STATIC_DIR / name).read_bytes()
            self._send(HTTPStatus.OK, body, STATIC_TYPES[Path(name).suffix])
            return
        if parts.path.startswith("/api/"):
            data = self.server.dashboard.api(parts.path, query)
            if data is not None:
                self._json(HTTPStatus.OK, data)
                return
        self._error(HTTPStatus.NOT_FOUND, f"no such page: {parts.path[:100]}")

    def _not_allowed(self) -> None:
        self._error(
            HTTPStatus.METHOD_NOT_ALLOWED, "the dashboard is read-only: GET and HEAD only", {"Allow": "GET, HEAD"}
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed  # noqa: N815


class DashboardServer(ThreadingHTTPServer):
    """``serve_in_thread`` for a dashboard beside a run (``primerl rl``), ``serve_forever`` for the command."""

    daemon_threads = True

    def __init__(self, dashboard: Dashboard, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.dashboard = dashboard
        self.token = token or secrets.token_urlsafe(24)
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
        return f"http://{host}:{self.port}/?token={self.token}"

    def serve_in_thread(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="dashboard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5)
        self.server_close()
        self.dashboard.close()
